"""From decisions to a schedule: the engine every policy (tide and the baselines) ends in.

A policy decides *how much* (DESIGN.md §4.2): the chunk layout, each chunk's optimizer-state tier
and optimizer tier, which PARAM chunks stay on DEVICE, a PARAM+GRAD byte budget on DEVICE per
moment, the activation mode of every block, the eviction rule, whether to prefetch and whether
the CPU optimizer overlaps backward. `materialize` turns that into *what happens when*: every
fetch, prefetch, eviction, write-back, allocation, optimizer step, activation copy and collective,
with its channel and bytes, the initial residency that the iteration returns to (steady state),
and the prediction (the simulator's replay of it).

The rooms: what a policy decides (`planner.decisions`); the DEVICE cache, steps 1-4
(`planner.device_cache`); action emission, steps 5-7 (`planner.emit`); the residency replay that
checks the actions and measures the peaks (`planner.replay`). This module puts them together,
checks the capacities, and replays the schedule in `planner.simulate`: the schedule's prediction
(stage times, totals) and a heuristic header's time are the simulator's, the one predictor (issue
17 item 4; a cost-model stage predictor beside it disagreed with it).
How, step by step: Note [materialize steps]; several ranks: Note [materialize ranks]; both above
`materialize`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

import planner
from planner import replays
from planner.decisions import (
    Decisions,
    EvictionRule,
    Reservation,
    SolverStats,
    activation_moments,
    non_model_curve,
    os_device_bytes,
    param_budget_bytes,
    uniform_decisions,
)
from planner.device_cache import (
    CacheInterval,
    CachePlan,
    cache_plan,
    check_budget,
    demand_pass,
    prefetch_early,
    spill_idle_grads,
    trim_intervals,
)
from planner.emit import (block_activation_plans, emit_actions, initial_residency, paces_host_io,
                          replayed_tick_seconds)
from planner.errors import InfeasibleError, PlannerError
from planner.problem import Problem
from planner.replay import ReplayError, ResidencyReplay, replay_residency
from planner.sim_result import ScheduleViolation, SimResult, ViolationKind
from planner.simulate import simulate
from schemas.schedule import (
    ActivationMode,
    Budgets,
    Channel,
    OptimizerSwap,
    Prediction,
    Schedule,
    ScheduleHeader,
    SolverStatus,
    Tier,
)


# Note [materialize steps]:
# How (DESIGN.md §4.3):
#
# 1. The DEVICE is a cache of *entries*: the PARAM and the GRAD copy of each comm group (one chunk
#    when world_size is 1). Time is a sequence of *ticks*: one per forward/backward moment, and in
#    the OPTIMIZER moment one per comm group stepped on DEVICE (so the steps stream through the
#    budget instead of needing every chunk at once).
# 2. Demand pass: at each tick the entries its work needs must be on DEVICE within the tick's budget;
#    room is made by the eviction rule (BELADY_CLEAN_FIRST: farthest next use among clean entries,
#    dirty ones only when no clean one is left; FARTHEST_NEXT_USE: PatrickStar §8.3; LRU). A dirty
#    entry (a GRAD being accumulated, a PARAM just updated on DEVICE) is written back before it goes.
# 3. Every residency interval is trimmed to end right after its last use (the data leaves as soon as
#    it is no longer needed; this frees room and costs nothing, since the entry would be fetched
#    again anyway). A GRAD leaving after its last backward use is the move of final grads to the
#    optimizer's tier.
# 4. Prefetch at the first harmless opportunity (Cao, Felten, Karlin, Li 1995, "conservative"): in
#    order of need, each fetch moves to the earliest tick from which its bytes fit in the budget at
#    every tick until its use, given everything already placed; nothing is evicted for it, and
#    copies stay issued in the order they are needed (channels are FIFOs).
# 5. Optimizer steps: on DEVICE in the OPTIMIZER moment (OS fetched from HOST/NVME and written back
#    when the OS lives there); on HOST in the OPTIMIZER moment, or — with `optimizer_overlap` — right
#    after the chunk's grads are final, during backward (Fuyou §4.3), with the OS read from NVME at
#    the chunk's first backward use and written back after the next chunk's step (Fuyou's delayed
#    write-back). Updated params go back where the iteration started: PARAM written back to
#    HOST/NVME, persistent PARAM re-fetched to DEVICE.
# 6. Activations: SWAP_* offload after the block's forward and reload at the start of the stage
#    before its backward; RECOMPUTE adds the block's forward to its first backward stage.
# 7. Copies between DEVICE and NVME go through HOST as two actions (chunks); an activation swap to
#    NVME is one action whose path crosses both channels (as the simulator models it).
#
# Budget accounting is in chunk capacity bytes (a copy moves the whole chunk buffer).
#
# Note [materialize ranks]:
# With world_size > 1 the entries are comm groups (PatrickStar §7): a PARAM comm group is fetched by the
# owner of each chunk and then all-gathered (ALL_GATHER before first use), GRAD comm groups are
# reduce-scattered when their backward is done (REDUCE_SCATTER; per bucket for the comm groups in
# Decisions.reduce_scatter_buckets, Note [reduce-scatter per bucket]), then each owner moves its chunk to
# its optimizer tier; copies to and from HOST/NVME and optimizer steps of a chunk are done by its
# owner rank, DEVICE copies and EVICTs from DEVICE by every rank. Bytes of local copies are per
# chunk (summed over ranks in the prediction), of collectives per rank.


def materialize(problem: Problem, decisions: Decisions, *, stats: SolverStats | None = None) -> Schedule:
    """A complete, steady-state schedule for `decisions` (see the module docstring), its prediction
    the simulator's replay.

    Raises InfeasibleError when a tier cannot hold what the decisions require, naming the tier,
    the moment, the bytes short and the smallest capacity that would work.
    """
    return materialize_replayed(problem, decisions, stats=stats)[0]


# Note [replay memo]:
# planner.solve replays some plans twice: the OS-margin bisection (planner.reference.os_margin_decisions)
# materializes the count it returns, which solve then replays again, and two reference sets may decide
# the same under two names (at 256 blocks x 4096 Fuyou's activation swap is all RECOMPUTE, so
# "fuyou-like" and "fuyou-like, checkpoints only" are one plan; a replay is ~0.3-0.8 s there). Inside
# `planner.replays.replay_memo()`, a call with the same problem (object), stats and decisions as an earlier one,
# the decisions' name and notes aside (only the header carries them), returns that schedule with its own name and
# notes in the header, and the same replay (or raises the same error): what materializing it again gives. So do
# the pacing switches where no chunk keeps its OS on NVME: they pace the SSD traffic of NVMe-homed OS only
# (`planner.emit._paced_host_io` emits nothing else for them), so a paced plan without any is its unpaced
# twin (GPT-3 13B x rtx4090-768g-12ssd: 6 of the solve's 13 MIP-plan replays; bench/RESULTS.md, session 16).
# The memo also replays ahead of need the plans the solve names (`replay_ahead`; Note [replays ahead] in
# planner/replays.py).
def materialize_replayed(problem: Problem, decisions: Decisions, *,
                         stats: SolverStats | None = None) -> tuple[Schedule, SimResult]:
    """`materialize`, and the simulator's replay of the schedule (what its prediction is)."""
    memo = replays.current()
    if memo is None:
        return _materialize_replayed(problem, decisions, stats)
    schedule, replay = memo.outcome(problem, _memo_plan(decisions), stats, _materialize_replayed, decisions, stats)
    header = dataclasses.replace(schedule.header, policy=decisions.policy, notes=decisions.notes)
    return dataclasses.replace(schedule, header=header), replay


def replay_ahead(problem: Problem, plans: Sequence[tuple[Decisions, SolverStats | None]], *, spare: bool = False) -> None:
    """Start `materialize_replayed(problem, decisions, stats=stats)` for each (decisions, stats) of `plans`, one
    batch, in the workers of the open memo where it has workers (with `spare`, only in a worker with nothing else
    to do), for the solve to read later (Note [replays ahead] in planner/replays.py)."""
    memo = replays.current()
    if memo is not None:
        memo.ahead(problem, _materialize_replayed, [(_memo_plan(d), s, (d, s)) for d, s in plans], spare=spare)


def drop_ahead(problem: Problem, plans: Sequence[tuple[Decisions, SolverStats | None]]) -> None:
    """The solve will not read these after all: not started where no worker has started them."""
    memo = replays.current()
    if memo is not None:
        memo.drop(problem, [(_memo_plan(d), s) for d, s in plans])


def _memo_plan(decisions: Decisions) -> Decisions:
    """The decisions as the memo compares them: name and notes aside, and the pacing switches where they pace
    nothing (Note [replay memo])."""
    plan = dataclasses.replace(decisions, policy="", notes=())
    if not any(p.os_tier is Tier.NVME for p in plan.chunk_plans):  # pacing changes nothing (Note [replay memo])
        plan = dataclasses.replace(plan, pace_optimizer_io=False, pace_on_replay=False)
    return plan


def _materialize_replayed(problem: Problem, decisions: Decisions,
                          stats: SolverStats | None) -> tuple[Schedule, SimResult]:
    try:
        return _materialize_replayed_once(problem, decisions, stats)
    except InfeasibleError:
        if decisions.wrap_kept_chunks:  # the DEVICE cannot hold them at the end: the plan without them
            return _materialize_replayed(problem, dataclasses.replace(decisions, wrap_kept_chunks=frozenset()), stats)
        plain = _without_offloads_in_flight(problem, decisions)
        if plain is None:
            raise
    # the budget that keeps offloaded activations on DEVICE until they land leaves some moment's
    # chunks no room: the plan still runs with the budget that frees them as the offload is issued,
    # its work waiting for the copies in flight (Note [offloads in flight] in planner/decisions.py;
    # without it 55B on 8x A100 40 GB lost every reference decision set, bench/published.py angel-tide)
    return _materialize_replayed_once(problem, plain, stats)


def _without_offloads_in_flight(problem: Problem, d: Decisions) -> Decisions | None:
    """`d` with the budget that frees offloaded activations as their offload is issued, where its
    budget is the one that keeps them until they land (`param_budget_bytes(offload_in_flight=True)`)."""
    args = (problem, d.layout, d.chunk_plans, d.activation_modes, d.checkpoint_tier)
    held = param_budget_bytes(*args, offload_in_flight=True, moment_seconds=d.moment_seconds_hint)
    plain = param_budget_bytes(*args)
    if held == plain or tuple(d.param_device_budget_bytes) != held:
        return None
    # nor does the prefetch pass hold write-backs and offloads in flight (it dates them from the held budget)
    return dataclasses.replace(d, param_device_budget_bytes=plain, hold_write_backs=False)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Emitted:
    """One emission of a set of DEVICE stays: the draft schedule, its residency replay and simulation."""

    draft: Schedule
    replay: ResidencyReplay
    result: SimResult
    intervals: list[CacheInterval]  # the stays it was emitted from (after the prefetch pass)
    read_ahead: bool  # emit_actions' read_ahead (Note [streamed reads before the swap] in planner/emit.py)


def _materialize_replayed_once(problem: Problem, decisions: Decisions,
                               stats: SolverStats | None) -> tuple[Schedule, SimResult]:
    _check_decisions(problem, decisions)
    plan = cache_plan(problem, decisions)
    check_budget(plan)
    intervals = demand_pass(plan)
    trim_intervals(intervals, len(plan.tick_moment))
    spilled = spill_idle_grads(plan, intervals) if decisions.spill_idle_grads and decisions.prefetch else None
    best = _emission(problem, decisions, plan, intervals, stats)
    if spilled is not None:
        # the spill trades a round trip of the grad for room before crowded peaks: kept only where
        # the replay is faster (measured both ways; ties keep the grad where it is)
        try:
            other = _emission(problem, decisions, plan, spilled, stats)
        except InfeasibleError:  # the grad's HOST copy does not fit there: keep it on DEVICE
            other = None
        if other is not None and other.result.iteration_seconds < best.result.iteration_seconds:
            best = other
    if decisions.pace_on_replay and _cpu_starved(best.result) and paces_host_io(plan):
        # Note [pacing by the replay]: the faster set of stays only
        clock = replayed_tick_seconds(plan, best.result.moment_start_seconds)
        try:
            repaced = _emitted(problem, decisions, plan, best.intervals, stats, clock=clock, read_ahead=best.read_ahead)
        except InfeasibleError:  # the staged OS the new pace keeps on HOST does not fit there
            repaced = None
        if repaced is not None and repaced.result.iteration_seconds < best.result.iteration_seconds:
            best = repaced
    return _finished(problem, decisions, stats, best)


def _emission(problem: Problem, decisions: Decisions, plan: CachePlan, intervals: list[CacheInterval],
              stats: SolverStats | None) -> _Emitted:
    """One set of DEVICE stays after the prefetch pass, emitted and replayed (steps 4-7 of Note [materialize
    steps])."""
    intervals = [dataclasses.replace(iv) for iv in intervals]  # prefetch_early moves starts in place
    if decisions.prefetch:
        prefetch_early(plan, intervals)
    try:
        return _emitted(problem, decisions, plan, intervals, stats)
    except InfeasibleError:
        # the NVMe-streamed DEVICE steps' reads before the swap take one OS list more on HOST than the
        # placement model counts (Note [streamed reads before the swap] in planner/emit.py): after it instead
        if not _reads_ahead(plan):
            raise
        return _emitted(problem, decisions, plan, intervals, stats, read_ahead=False)


def _finished(problem: Problem, decisions: Decisions, stats: SolverStats | None, e: _Emitted) -> tuple[Schedule, SimResult]:
    """The schedule of an emission with the simulator's prediction in it."""
    draft = dataclasses.replace(e.draft, header=_header(problem, decisions, stats, e.result.iteration_seconds))
    # times and totals: the simulator's; peaks: the larger of the residency replay's (which the capacities
    # were checked on; it counts copies alive only between two actions of one moment) and the simulator's
    # (which holds an evicted copy's bytes until the copies reading it land: Note [simulator evictions])
    schedule = with_simulated_prediction(draft, e.result, objective=False)
    peaks = {t: max(e.replay.peak_bytes_per_tier.get(t, 0), e.result.peak_bytes_per_tier.get(t, 0))
             for t in (*e.replay.peak_bytes_per_tier, *e.result.peak_bytes_per_tier)}
    prediction = dataclasses.replace(schedule.prediction, peak_bytes_per_tier=peaks)
    return dataclasses.replace(schedule, prediction=prediction), e.result


def _cpu_starved(result: SimResult) -> bool:
    """Whether the replay's CPU optimizer idled, between its first step's start and its last step's end, longer
    than its longest step: time in which the pace could have given it one more step (Note [pacing by the
    replay]; its busy seconds include the time steps lost to copies beside them)."""
    steps = [iv for iv in result.timeline if iv.channel is Channel.CPU_OPTIMIZER]
    if not steps:
        return False
    span = max(iv.end_seconds for iv in steps) - min(iv.start_seconds for iv in steps)
    longest = max(iv.end_seconds - iv.start_seconds for iv in steps)
    return span - result.busy_seconds_per_channel.get(Channel.CPU_OPTIMIZER, 0.0) > longest


def _reads_ahead(plan: CachePlan) -> bool:
    """Whether `emit_actions(read_ahead=True)` emits anything else than `read_ahead=False` for this plan: some
    DEVICE step in the OPTIMIZER moment streams its OS from NVME (and so may swap with the next one)."""
    opt = plan.first_tick[plan.problem.optimizer_moment]
    return any(tick >= opt and any(plan.os_tier[c] is Tier.NVME for c in plan.trainable_chunks[g])
               for g, tick in plan.device_step_tick.items())


# Note [pacing by the replay]:
# The overlapped CPU steps' SSD traffic is paced on a clock (`planner.emit._paced_host_io`): a step is issued
# about when the CPU is estimated to reach it, its write-back once it is estimated done, because a
# write-back queued on the SSDs (one FIFO) before its step ends holds every later read behind it. The first
# emission's clock is `estimated_tick_seconds`, each moment at its placement price. Where the replay runs
# slower than that (GPT-3 175B x rtx4090-768g-12ssd: backward 49.1 s replayed against ~37 s estimated, its
# blocks waiting for grad write-backs in flight), the steps were issued a third later than the CPU could take
# them: it idled 18.4 s in backward (one step per 0.65 s replayed, 0.43 s each), and those steps and their
# SSD traffic ran in the tail. So a paced plan is emitted a second time, paced on the first replay's own
# clock (`planner.emit.replayed_tick_seconds`), replayed, and the faster of the two replays is kept (ties:
# the first). Only where the first replay's CPU optimizer idled longer than its longest step (`_cpu_starved`:
# GPT-3 175B's MIP plans of 605212776-element chunks idled 8.8-20 s and replay 0.9-1.8 s faster re-paced;
# those of 1812099072 idled 0.3-1.2 s, their steps 1.2 s, and replay the same). Deterministic; it costs one
# more emission and replay per such plan, so only for tide's MIP plans
# (`Decisions.pace_on_replay`, set by planner/solution.py; GPT-3 175B's solve replays ~6 paced reference sets
# besides its 4 paced MIP plans, and re-pacing all of them took it past its 10 CPU s). The CPU price stays
# the one with copies (the replay's steps run at it while a copy runs; pacing at the rate alone issued the
# write-backs too early: 175B x rtx4090 130.16 -> 135.04 s, bench/RESULTS.md a175).


def _emitted(problem: Problem, decisions: Decisions, plan: CachePlan, intervals: list[CacheInterval],
             stats: SolverStats | None, *, clock: Sequence[float] | None = None,
             read_ahead: bool = True) -> _Emitted:
    """The draft schedule of `intervals` (emitted with `clock` and `read_ahead`: `planner.emit.emit_actions`),
    its residency replay and its simulation; InfeasibleError when a tier overflows."""
    actions, _deadlines = emit_actions(plan, intervals, clock=clock, read_ahead=read_ahead)
    budgets = _reserved_budgets(problem, decisions)
    draft = Schedule(
        header=_header(problem, decisions, stats, 0.0),
        budgets=budgets,
        layout=decisions.layout,
        chunk_plans=decisions.chunk_plans,
        activation_plans=block_activation_plans(problem, decisions.activation_modes),
        moments=problem.moments,
        stages=problem.stages,
        initial_residency=initial_residency(plan),
        actions=actions,
        prediction=Prediction(iteration_seconds=0.0, flops=0, bytes_per_channel={}, busy_seconds_per_channel={},
                              peak_bytes_per_tier={}),
    )
    replay = replay_residency(draft)
    _check_capacity(problem, replay, budgets, decisions.reserved_bytes)
    try:
        result = simulate(draft, problem.hardware)
    except ScheduleViolation as exc:
        if exc.kind is ViolationKind.CAPACITY:  # the simulator counts per action what the replay counts per moment
            raise InfeasibleError(str(exc)) from None
        raise
    return _Emitted(draft=draft, replay=replay, result=result, intervals=intervals, read_ahead=read_ahead)


def with_simulated_prediction(schedule: Schedule, r: SimResult, *, objective: bool = True) -> Schedule:
    """The schedule with the simulator's prediction (stage times, totals, peaks) in place of its own
    (and, with `objective`, the header's objective)."""
    starts = list(r.moment_start_seconds) + [r.iteration_seconds]
    stages = tuple(dataclasses.replace(st, predicted_seconds=max(0.0, starts[st.last_moment + 1] - starts[st.first_moment]))
                   for st in schedule.stages)
    prediction = Prediction(iteration_seconds=r.iteration_seconds, flops=r.flops + r.recompute_flops,
                            bytes_per_channel=dict(r.bytes_per_channel),
                            busy_seconds_per_channel=dict(r.busy_seconds_per_channel),
                            peak_bytes_per_tier=dict(r.peak_bytes_per_tier))
    header = dataclasses.replace(schedule.header, objective_seconds=r.iteration_seconds) if objective else schedule.header
    return dataclasses.replace(schedule, header=header, stages=stages, prediction=prediction)


# -- inputs ----------------------------------------------------------------------------------


def _check_decisions(problem: Problem, d: Decisions) -> None:
    n_chunks, n_moments, n_blocks = len(d.layout.chunks), len(problem.moments), len(problem.blocks)
    if len(d.chunk_plans) != n_chunks or any(p.chunk != i for i, p in enumerate(d.chunk_plans)):
        raise PlannerError(f"decisions of {d.policy!r}: one chunk plan per chunk in chunk order expected ({n_chunks})")
    if len(d.activation_modes) != n_blocks:
        raise PlannerError(f"decisions of {d.policy!r}: one activation mode per block expected ({n_blocks}), "
                           f"found {len(d.activation_modes)}")
    if len(d.param_device_budget_bytes) != n_moments:
        raise PlannerError(f"decisions of {d.policy!r}: one PARAM budget per moment expected ({n_moments}), "
                           f"found {len(d.param_device_budget_bytes)}")
    if d.moment_seconds_hint and len(d.moment_seconds_hint) != n_moments:
        raise PlannerError(f"decisions of {d.policy!r}: moment_seconds_hint needs one value per moment ({n_moments})")
    if d.param_home_tiers and len(d.param_home_tiers) != n_chunks:
        raise PlannerError(f"decisions of {d.policy!r}: param_home_tiers needs one tier per chunk ({n_chunks})")
    if tuple(d.layout.lists) != problem.lists:
        raise PlannerError(f"decisions of {d.policy!r}: layout lists {[x.value for x in d.layout.lists]} do not "
                           f"match the trace's {[x.value for x in problem.lists]}; build it with planner.layout")
    for p in d.chunk_plans:
        if p.os_tier is Tier.DEVICE and p.optimizer_tier is not Tier.DEVICE:
            raise PlannerError(f"decisions of {d.policy!r}: chunk {p.chunk} keeps its OS on DEVICE but steps on "
                               f"{p.optimizer_tier}; OS on DEVICE means a DEVICE step")
    for c in d.persistent_chunks:
        if not 0 <= c < n_chunks:
            raise PlannerError(f"decisions of {d.policy!r}: persistent chunk {c} is not a chunk id (< {n_chunks})")
    for c in sorted(d.wrap_kept_chunks):
        p = d.chunk_plans[c] if 0 <= c < n_chunks else None
        home = d.param_home_tiers[c] if p is not None and d.param_home_tiers else Tier.HOST
        if p is None or c in d.persistent_chunks or p.os_tier is Tier.DEVICE or home is not Tier.HOST \
                or problem.world_size > 1:
            raise PlannerError(f"decisions of {d.policy!r}: wrap_kept_chunks holds chunk {c}, expected a chunk id "
                               f"(< {n_chunks}) that is not persistent, keeps its OS off DEVICE and lives on HOST, "
                               "with one rank")
    for b, mode in enumerate(d.activation_modes):
        if mode is not ActivationMode.KEEP and activation_moments(problem, b)[0] < 0:
            raise PlannerError(f"decisions of {d.policy!r}: block {b} has no forward or no backward moment, "
                               f"so its activations can only be kept, found {mode}")
    ws = 1 if d.replicated else problem.world_size  # replicated (DDP): every chunk its own comm group
    for c in d.layout.chunks:
        if c.comm_group != c.id // ws:
            raise PlannerError(f"decisions of {d.policy!r}: chunk {c.id} is in comm group {c.comm_group}, expected "
                               f"{c.id // ws}; build the layout with planner.layout")


# -- checks ----------------------------------------------------------------------------------


def _reserved_budgets(problem: Problem, d: Decisions) -> Budgets:
    """The schedule's budgets: each tier's capacity minus what the policy reserves there (its buffers)."""
    held = {t: sum(r.bytes for r in d.reserved_bytes if r.tier is t) for t in Tier}
    return Budgets(device_bytes=max(0, problem.device_bytes - held[Tier.DEVICE]),
                   host_bytes=max(0, problem.host_bytes - held[Tier.HOST]),
                   nvme_bytes=max(0, problem.nvme_bytes - held[Tier.NVME]))


def _check_capacity(problem: Problem, replay: ResidencyReplay, budgets: Budgets,
                    reserved: Sequence[Reservation]) -> None:
    for tier, per_moment, capacity in ((Tier.DEVICE, replay.device_bytes, budgets.device_bytes),
                                       (Tier.HOST, replay.host_bytes, budgets.host_bytes),
                                       (Tier.NVME, replay.nvme_bytes, budgets.nvme_bytes)):
        peak = max(per_moment)
        if peak > capacity:
            m = problem.moments[int(np.argmax(per_moment))]
            buffers = sum(r.bytes for r in reserved if r.tier is tier)
            held = (f" ({capacity + buffers} usable less {buffers} bytes of the system's own buffers: "
                    + ", ".join(r.what.split(";")[0] for r in reserved if r.tier is tier) + ")") if buffers else ""
            raise InfeasibleError(
                f"{tier.value} runs out at moment {m.id} ({m.phase.value.lower()} {m.kind.value} {m.module or '(root)'}): "
                f"it needs {peak} bytes, the capacity is {capacity}{held} ({peak - capacity} bytes short); the smallest "
                f"{tier.value} capacity that would work with these decisions is {peak + buffers} bytes "
                f"({(peak + buffers) / 1e9:.2f} GB)")


def _header(problem: Problem, d: Decisions, stats: SolverStats | None, predicted_seconds: float) -> ScheduleHeader:
    if stats is None:
        lower = min(predicted_seconds, problem.compute_seconds)  # no schedule beats the device's own work
        stats = SolverStats(status=SolverStatus.HEURISTIC, objective_seconds=predicted_seconds, lower_bound_seconds=lower,
                            gap=(predicted_seconds - lower) / predicted_seconds if predicted_seconds > 0 else 0.0)
    return ScheduleHeader(
        planner_version=planner.__version__,
        policy=d.policy,
        model_name=problem.trace.meta.model_name,
        trace_digest=problem.trace_digest,
        hardware_name=problem.hardware.name,
        hardware_digest=problem.hardware.digest,
        world_size=problem.world_size,
        solver_status=stats.status,
        objective_seconds=stats.objective_seconds,
        lower_bound_seconds=stats.lower_bound_seconds,
        gap=stats.gap,
        notes=d.notes,
        host_staging=d.host_staging,
        optimizer_swap=OptimizerSwap.SERIAL if d.serial_optimizer_swap else OptimizerSwap.PIPELINED,
    )


__all__ = [
    "Decisions", "EvictionRule", "ReplayError", "Reservation", "ResidencyReplay", "SolverStats", "activation_moments", "materialize",
    "non_model_curve", "os_device_bytes", "param_budget_bytes", "drop_ahead", "replay_ahead", "replay_residency", "uniform_decisions",
]
