"""The simulator's two rules made true in session 5 (issue 17, sim17): CPU Adam slowed by copies for
exactly the time they run beside it (Note [CPU Adam beside copies] in planner/sim_actions.py), whichever
is placed first, and evicted DEVICE bytes held until the copies reading them land (Note [simulator
evictions])."""

from __future__ import annotations

import dataclasses

import pytest

from schemas.hardware import AdamRate
from schemas.schedule import Budgets, Channel, Op

from planner.sim_state import Coverage
from planner.simulate import simulate

from test_simulate_builders import (CHUNK_BYTES, ELEMENTS, RESIDENT, D, G, H, P, host_step_prefix, tiny_hardware,
                                    tiny_schedule)


def test_coverage_adds_only_the_new_pieces_and_times_a_step_through_them() -> None:
    cov = Coverage()
    assert cov.add(1.0, 2.0) == [(1.0, 2.0)]
    assert cov.add(3.0, 4.0) == [(3.0, 4.0)]
    assert cov.add(1.5, 3.5) == [(2.0, 3.0)]  # only the gap between the two is new
    assert cov.add(0.0, 5.0) == [(0.0, 1.0), (4.0, 5.0)]
    assert (cov.starts, cov.ends) == ([0.0], [5.0])
    cov = Coverage()
    cov.add(1.0, 2.0)
    # 2 s alone from 0: 1 s alone, then [1, 2] at half speed (0.5 s of work), then 0.5 s alone
    assert cov.run(0.0, 2.0, 0.5) == pytest.approx(2.5)
    assert cov.run(1.5, 0.1, 0.5) == pytest.approx(1.7)  # inside the busy interval throughout
    assert cov.run(2.0, 1.0, 0.5) == pytest.approx(3.0)  # after it: alone
    cov.place_step(0.0, 2.5, 0.5)
    # 0.5 s of new overlap x (1 - 0.5): 0.25 s of work lost, by a step keeping 0.5 of its speed beside copies
    assert cov.lost_seconds(cov.add(2.0, 3.0)) == [(pytest.approx(0.25), 0.5)]


def test_back_to_back_steps_at_one_speed_are_one_interval_losing_what_both_would() -> None:
    """Steps placed end to end at the same `slow` (the CPU optimizer's queue and its make-ups) are kept as one
    interval: a copy over both takes the sum of what it would take from each; a gap or another speed starts a new
    one."""
    cov = Coverage()
    cov.place_step(0.0, 1.0, 0.5)
    cov.place_step(1.0, 3.0, 0.5)  # back to back, same speed: merged
    cov.place_step(3.0, 4.0, 0.25)  # another speed: its own
    cov.place_step(5.0, 6.0, 0.25)  # after a gap: its own
    assert cov.steps == [(0.0, 3.0, 0.5), (3.0, 4.0, 0.25), (5.0, 6.0, 0.25)]
    assert cov.step_ends == [3.0, 4.0, 6.0]
    # [0.5, 5.5]: 2.5 s over the merged step (x 0.5 = 0.5 s + 0.75 s of its two parts), 1 s at 0.25, 0.5 s at 0.25
    assert cov.lost_seconds(cov.add(0.5, 5.5)) == [(pytest.approx(1.25), 0.5), (pytest.approx(0.75), 0.25),
                                                    (pytest.approx(0.375), 0.25)]


def _half_speed_with_copies():
    """The tiny machine, its CPU Adam measured at half its rate alone with copies beside it."""
    hw = tiny_hardware()
    host = dataclasses.replace(hw.host, adam_chunk_params=ELEMENTS, adam_rates=(
        AdamRate(threads=2, params_per_s=ELEMENTS / 2.0, params_per_s_with_copies=ELEMENTS / 4.0),))
    return dataclasses.replace(hw, host=host)


def _step_and_copy(copy_first: bool) -> list:
    """Chunk 0 lives on HOST and steps there at moment 8 (its grads land at 9 s, CPU Adam needs 2 s alone);
    a 1 s write-back of the stepped PARAM 1 (9 -> 10 s, after the grads' on D2H) runs beside it, its
    action placed before or after the step's."""
    copy = [(8, Op.WRITE_BACK, P, 1, D, H)]
    step = [(8, Op.OPTIMIZER_STEP, None, 0, None, H)]
    return [
        *host_step_prefix(),
        (8, Op.OPTIMIZER_STEP, None, 1, None, D),
        *(copy + step if copy_first else step + copy),
        (8, Op.EVICT, G, 0, H, None),
        (8, Op.EVICT, G, 1, D, None),
        (8, Op.EVICT, P, 1, H, None),
    ]


@pytest.mark.parametrize("copy_first", [True, False])
def test_cpu_adam_runs_slower_exactly_while_a_copy_runs_beside_it(copy_first: bool) -> None:
    """[9, 10] s beside the write-back at half speed (0.5 s of work), the other 1.5 s alone: 11.5 s, whether
    the copy's action comes first (before: the with-copies rate for all 2 s, 4 s, 13 s) or the step's
    (before: the rate alone throughout, 11 s)."""
    r = simulate(tiny_schedule(_step_and_copy(copy_first), {(P, 0): (H,), (P, 1): (D,)}), _half_speed_with_copies())
    assert r.bytes_per_channel[Channel.D2H] == 2 * ELEMENTS * 4
    assert r.iteration_seconds == pytest.approx(11.5)
    assert r.busy_seconds_per_channel[Channel.CPU_OPTIMIZER] == pytest.approx(2.5)


def test_the_work_a_step_lost_is_made_up_at_the_slow_rate_beside_copies() -> None:
    """The step of chunk 0 runs alone [9, 11] s (placed before the copies); the write-back of PARAM 1 then covers
    [9, 10]: 0.5 s of work lost, made up after the step from 11 s; the fetch of the stepped PARAM 0 (11 -> 12 s,
    placed last) runs beside that make-up, which loses 0.25 s more, made up at half speed beside the fetch until
    12 s. The CPU is busy 2 + 0.5 + 0.5 s (until session 17 a make-up ran at the rate alone and nothing slowed
    it: 2.5 s), and does at most (T - V) + V / 2 s of work in T s of which copies run V, as the placement model
    assumes (Note [CPU Adam beside copies])."""
    specs = [*host_step_prefix(),
             (8, Op.OPTIMIZER_STEP, None, 1, None, D),
             (8, Op.OPTIMIZER_STEP, None, 0, None, H),
             (8, Op.WRITE_BACK, P, 1, D, H),
             (8, Op.FETCH, P, 0, H, D),
             (8, Op.EVICT, P, 0, D, None),
             (8, Op.EVICT, G, 0, H, None),
             (8, Op.EVICT, G, 1, D, None),
             (8, Op.EVICT, P, 1, H, None)]
    r = simulate(tiny_schedule(specs, {(P, 0): (H,), (P, 1): (D,)}), _half_speed_with_copies())
    steps = [iv for iv in r.timeline if iv.channel is Channel.CPU_OPTIMIZER]
    assert [(iv.start_seconds, iv.end_seconds) for iv in steps] == [(pytest.approx(9.0), pytest.approx(11.0))]
    assert r.busy_seconds_per_channel[Channel.CPU_OPTIMIZER] == pytest.approx(3.0)
    assert r.iteration_seconds == pytest.approx(12.0)


def test_evicted_bytes_stay_on_device_until_the_copy_reading_them_lands() -> None:
    """PARAM 1 written back to HOST (0 -> 1 s), evicted from DEVICE and prefetched again at moment 0, on a
    DEVICE that holds two chunks: the prefetch's bytes fit only once the write-back has landed, so the
    training thread waits for it, and moment 0's work starts at 1 s, not 0 s (Note [simulator evictions];
    before, the EVICT freed the bytes as it was issued)."""
    specs = [
        (0, Op.WRITE_BACK, P, 1, D, H),
        (0, Op.EVICT, P, 1, D, None),
        (0, Op.PREFETCH, P, 1, H, D),
        (8, Op.EVICT, P, 1, H, None),
    ]
    budgets = Budgets(device_bytes=2 * CHUNK_BYTES + 100_000, host_bytes=10 * CHUNK_BYTES, nvme_bytes=0)
    r = simulate(tiny_schedule(specs, RESIDENT, lists=(P,), budgets=budgets), tiny_hardware())
    assert r.moment_start_seconds[0] == pytest.approx(1.0)
    roomy = simulate(tiny_schedule(specs, RESIDENT, lists=(P,)), tiny_hardware())
    assert roomy.moment_start_seconds[0] == 0.0  # with room for both, nothing waits
