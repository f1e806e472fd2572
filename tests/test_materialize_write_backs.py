"""Note [write-backs in flight] (planner/device_cache.py): the prefetch pass counts a written-back stay's
DEVICE bytes until its copy is estimated to land, as the simulator (the caching allocator) holds them."""

from __future__ import annotations

import dataclasses

import pytest

from planner.decisions import uniform_decisions
from planner.device_cache import cache_plan, demand_pass, estimated_tick_seconds, trim_intervals, write_back_holds
from planner.families import gpt_trace
from planner.layout import build_layout
from planner.materialize import materialize_replayed
from planner.presets import resolve_hardware
from planner.problem import build_problem
from schemas.schedule import Tier

DIGEST = "sha256:" + "0" * 64
HW = resolve_hardware("a100-80g-12ssd")
# 8 blocks of hidden 1024 with CPU Adam: every block's final grads go down to HOST during backward
TRACE = gpt_trace(layers=8, hidden=1024, heads=8, seq=512, batch=4, vocab=8000)
CHUNK = 1 << 22


def _decisions(device_bytes: int, moment_seconds: float | None = None):
    p = build_problem(TRACE, HW, trace_digest=DIGEST, device_bytes=device_bytes)
    d = uniform_decisions(p, build_layout(p, chunk_elements=CHUNK), os_tier=Tier.HOST, optimizer_tier=Tier.HOST)
    if moment_seconds is not None:
        d = dataclasses.replace(d, moment_seconds_hint=(moment_seconds,) * len(p.moments))
    return p, d


def _stays(p, d):
    plan = cache_plan(p, d)
    intervals = demand_pass(plan)
    trim_intervals(intervals, len(plan.tick_moment))
    return plan, intervals


def test_a_write_back_is_held_until_the_ticks_estimated_to_start_after_it_lands() -> None:
    plan, intervals = _stays(*_decisions(900_000_000, moment_seconds=0.0))
    optimizer = plan.problem.optimizer_moment
    written = [iv for iv in intervals if iv.write_back and not iv.pinned and 0 <= iv.end < len(plan.tick_moment)
               and plan.tick_moment[iv.end] != optimizer]
    holds = write_back_holds(plan, intervals)
    assert written and len(holds) == len(written)  # every moment takes no time: no copy lands before the next tick
    lands = [x[2] for x in holds]
    assert lands == sorted(lands) and all(b > a for a, b in zip(lands, lands[1:]))  # one D2H FIFO
    for iv, until, _ in holds:
        assert until > iv.end
        assert until == len(plan.tick_moment) or any(x.entry == iv.entry and x.start == until for x in intervals)
    # moments of an hour: every copy lands during its stay's end tick, so only that tick holds it
    plan, intervals = _stays(*_decisions(900_000_000, moment_seconds=3600.0))
    est = estimated_tick_seconds(plan)
    holds = write_back_holds(plan, intervals, est)
    assert len(holds) == len(written)
    for iv, until, lands in holds:
        assert until == iv.end + 1 and est[iv.end] < lands < est[iv.end + 1]


@pytest.mark.parametrize("chunk_device_bytes", [800_000_000, 900_000_000])
def test_prefetches_leave_room_for_grads_in_flight_and_the_work_waits_less(chunk_device_bytes: int) -> None:
    # with the grads' write-backs freeing their room only as the copies land, a PARAM prefetch placed in
    # that room made the next block's work wait for the copy (simulator: Note [simulator evictions])
    p, plain = _decisions(chunk_device_bytes)
    _, before = materialize_replayed(p, plain)
    _, after = materialize_replayed(p, dataclasses.replace(plain, hold_write_backs=True))
    assert after.stall_seconds < before.stall_seconds
    assert after.iteration_seconds < before.iteration_seconds


def test_a_prefetch_goes_after_the_write_backs_unless_it_would_arrive_later_than_the_work_waits() -> None:
    # `_HeldRoom.choose`: the later start (room with the write-backs in flight counted) unless, by the
    # estimates, the prefetch would arrive late there by more than the work waits at the ticks it crowds
    from planner.device_cache import _HeldRoom

    plan, intervals = _stays(*_decisions(900_000_000, moment_seconds=0.0))
    room = _HeldRoom(plan, intervals)
    n = len(plan.tick_moment)
    entry = next(iv.entry for iv in intervals if not iv.allocate and not iv.pinned)
    copy = room.copy_seconds(entry)
    assert copy > 0
    room.est = [t * copy / 2 for t in range(n)]  # a tick takes half the prefetch's copy
    room.free_at = 0.0
    room.reloads = []
    room.bytes[:] = 10
    room.wait[:] = copy / 20  # the work of a crowded tick waits a twentieth of it for the copies in flight
    slack = [0] * n  # every tick is crowded with the write-backs counted
    # held at tick 5 for a use at tick 8: arrives at 3.5 copies, the use starts at 4: after the write-backs
    assert room.choose(entry, 8, 2, 5, slack, 1) == 5
    # held at tick 7: arrives at 4.5 copies, half a copy late, more than the 5 crowded ticks' waits (a
    # quarter copy): where it fits without them, and those ticks' work waits for the copies in flight
    assert room.arrival(entry, 7) - room.est[8] == pytest.approx(copy / 2)
    assert room.choose(entry, 8, 2, 7, slack, 1) == 2
    assert room.wait[2:7].tolist() == [0.0] * 5  # waiting already: crowding them again costs nothing
    room.wait[2:7] = copy  # waits longer than the prefetch would be late: after the write-backs
    assert room.choose(entry, 8, 2, 7, slack, 1) == 7


def test_offloads_behind_a_burst_of_prefetches_are_held_until_they_land_behind_it() -> None:
    # Note [offloads behind prefetches]: a D2H offload placed after H2D copies lands once they are done
    # (the link's shared rows), later than the budget's estimate: the prefetch pass holds its bytes longer
    from planner.decisions import activation_moments, offload_landing_moments, param_budget_bytes
    from planner.device_cache import _HeldRoom
    from schemas.schedule import ActivationMode

    p, d = _decisions(900_000_000)
    modes = (ActivationMode.SWAP_HOST,) * len(p.blocks)
    hint = tuple(m.compute_seconds for m in p.moments)
    budget = param_budget_bytes(p, d.layout, d.chunk_plans, modes, offload_in_flight=True, moment_seconds=hint)
    d = dataclasses.replace(d, activation_modes=modes, param_device_budget_bytes=budget, moment_seconds_hint=hint,
                            hold_write_backs=True)
    plan, intervals = _stays(p, d)
    plain = _HeldRoom(plan, intervals)
    est = plain.est
    burst = [est[-1]] * len(est)  # H2D busy until the last tick with copies placed before every tick
    offloads: dict[int, float] = {}
    write_back_holds(plan, intervals, est, burst, offloads)
    swapped = [b for b in range(len(p.blocks)) if activation_moments(p, b)[0] >= 0]
    assert sorted(offloads) == swapped
    assert all(lands > est[-1] for lands in offloads.values())  # each lands behind the burst
    held = _HeldRoom(plan, intervals, (est, burst))
    landed = offload_landing_moments(p, modes, None, hint)
    extra = 0
    for b in swapped:
        _, reload, _ = activation_moments(p, b)
        first, stop = plan.first_tick[landed.get(b, reload)], plan.first_tick[reload]
        if first < stop:  # the budget frees it before its reload: held from there on, until the reload
            extra += 1
            assert all(held.bytes[t] - plain.bytes[t] >= p.blocks[b].activation_bytes for t in range(first, stop))
    assert extra >= 2
    # the placement's replay: a tick's work starts once the fetches it uses have arrived on the H2D FIFO
    starts, before = plain.replayed(intervals)
    assert all(b >= a for a, b in zip(est, starts)) and before == sorted(before)


def test_a_tails_prefetches_needed_next_are_issued_before_its_write_backs() -> None:
    # Note [a tail's prefetches before its write-backs] (planner/emit.py): at a backward moment without
    # compute the prefetches the next moment's work needs go before the moment's grad write-backs (the
    # simulator gives a two-way link's shared time to the copy placed first); the other prefetches after
    # them; without the option the ended stays go first, then the starts
    from planner.emit import emit_actions, is_tail_tick
    from schemas.schedule import ChunkList, Op

    p, d = _decisions(900_000_000)
    d = dataclasses.replace(d, hold_write_backs=True)
    plan, intervals = _stays(p, d)
    n_ticks = len(plan.tick_moment)
    tails = [t for t in range(n_ticks) if is_tail_tick(p.moments, plan.tick_moment, t)]
    written = {iv.end for iv in intervals if iv.write_back and not iv.pinned and iv.entry & 1}

    def fetched_at(t: int) -> list:
        return [iv for iv in intervals if not iv.allocate and not iv.pinned and iv.start == iv.first_use == t]

    # a tail that writes grads back, with the fetches of the work after it (and of the work after the next
    # tail) issued there instead: prefetches the pass could place at that tail
    t = next(t for t in tails if t in written and fetched_at(t + 1) and fetched_at(t + 3))
    moved, later = fetched_at(t + 1), fetched_at(t + 3)
    for iv in [*moved, *later]:
        iv.start = t

    def order(decisions) -> str:
        plan.decisions = decisions
        actions, _ = emit_actions(plan, intervals)
        need = {c for iv in moved for c in plan.comm_group_chunks[iv.entry >> 1]}
        return "".join("W" if a.op is Op.WRITE_BACK and a.list is ChunkList.GRAD else
                       "N" if a.op is Op.PREFETCH and a.chunk in need else
                       "P" if a.op is Op.PREFETCH else "" for a in actions if a.moment == plan.tick_moment[t])

    plain = order(d)
    assert plain.rindex("W") < plain.index("N") and plain.rindex("W") < plain.index("P"), plain
    first = order(dataclasses.replace(d, tail_prefetches_first=True))
    # needed next, then the write-backs, then the prefetches used later
    assert first.rindex("N") < first.index("W") and first.rindex("W") < first.index("P"), first
    assert sorted(first) == sorted(plain)
