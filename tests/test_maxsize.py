"""maxsize's two-level search for tide: a fast necessary check, then a confirming plan."""

from __future__ import annotations

from planner.families import gpt_param_count
from planner.maxsize import max_size


def test_confirm_steps_down_to_a_confirmed_size() -> None:
    ladder = ((10, 64, 4), (10, 128, 4))
    fast = {64: 30, 128: 20}  # what the necessary check lets through
    real = {64: 25, 128: 13}  # what a real plan confirms
    confirmed: list[tuple[int, int]] = []

    def fits(layers: int, hidden: int, heads: int) -> bool:
        return layers <= fast[hidden]

    def confirm(layers: int, hidden: int, heads: int) -> bool:
        confirmed.append((layers, hidden))
        return layers <= real[hidden]

    best = max_size(fits, ladder=ladder, policy="tide", confirm=confirm)
    expected = max(((25, 64), (13, 128)), key=lambda lh: gpt_param_count(layers=lh[0], hidden=lh[1]))
    assert (best.layers, best.hidden) == expected
    assert (best.layers, best.hidden) in confirmed  # the answer is a confirmed size
    assert len(confirmed) <= 12  # a binary search per width, not a scan


def test_confirm_refuting_everything_gives_none() -> None:
    best = max_size(lambda *_: True, ladder=((4, 64, 4),), policy="tide", confirm=lambda *_: False)
    assert best.params == 0 and best.layers == 0


def test_hints_are_confirmed_and_stepping_down_uses_the_fast_confirmation() -> None:
    """A baseline's size (a hint) that tide's confirmation accepts is tide's answer even when the
    necessary check stops below it; refuted widths step down with `step_confirm` only."""
    ladder = ((100, 64, 4), (10, 128, 4))
    fast = {64: 300, 128: 5}  # the LP-style necessary check
    slow_calls: list[tuple[int, int]] = []
    quick_calls: list[tuple[int, int]] = []

    def confirm(layers: int, hidden: int, heads: int) -> bool:  # the slow one (reference sets, then the MIP)
        slow_calls.append((layers, hidden))
        return (hidden == 64 and layers <= 100) or (hidden == 128 and layers <= 10)

    def step_confirm(layers: int, hidden: int, heads: int) -> bool:
        quick_calls.append((layers, hidden))
        return hidden == 64 and layers <= 100

    best = max_size(lambda layers, hidden, heads: layers <= fast[hidden], ladder=ladder, policy="tide",
                    confirm=confirm, step_confirm=step_confirm, hints=[(10, 128, 4)])
    # 300 x 64 is refuted and steps down to 100 x 64; the hint 10 x 128, above the necessary check's
    # 5 layers at that width and bigger than 100 x 64, is confirmed and wins
    size = lambda layers, hidden: gpt_param_count(layers=layers, hidden=hidden)  # noqa: E731
    assert size(100, 64) < size(10, 128) < size(300, 64)
    assert (best.layers, best.hidden) == (10, 128)
    assert (10, 128) in slow_calls and (300, 64) in slow_calls
    assert quick_calls and all(h == 64 for _, h in quick_calls)
    assert not [c for c in slow_calls if c[1] == 64 and c[0] < 300]  # the step-down never used the slow check
