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
