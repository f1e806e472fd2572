"""From decisions to a schedule: the engine every policy (tide and the baselines) ends in.

A policy decides *how much* (DESIGN.md §4.2): the chunk layout, each chunk's optimizer-state tier
and optimizer tier, which PARAM chunks stay on DEVICE, a PARAM+GRAD byte budget on DEVICE per
moment, the activation mode of every block, the eviction rule, whether to prefetch and whether
the CPU optimizer overlaps backward. `materialize` turns that into *what happens when*: every
fetch, prefetch, eviction, write-back, allocation, optimizer step, activation copy and collective,
with its channel and bytes, the initial residency that the iteration returns to (steady state),
and the cost model's prediction.

How (DESIGN.md §4.3):

1. The DEVICE is a cache of *entries*: the PARAM and the GRAD copy of each comm group (one chunk
   when world_size is 1). Time is a sequence of *ticks*: one per forward/backward moment, and in
   the OPTIMIZER moment one per comm group stepped on DEVICE (so the steps stream through the
   budget instead of needing every chunk at once).
2. Demand pass: at each tick the entries its work needs must be on DEVICE within the tick's budget;
   room is made by the eviction rule (BELADY_CLEAN_FIRST: farthest next use among clean entries,
   dirty ones only when no clean one is left; FARTHEST_NEXT_USE: PatrickStar §8.3; LRU). A dirty
   entry (a GRAD being accumulated, a PARAM just updated on DEVICE) is written back before it goes.
3. Every residency interval is trimmed to end right after its last use (the data leaves as soon as
   it is no longer needed; this frees room and costs nothing, since the entry would be fetched
   again anyway). A GRAD leaving after its last backward use is the move of final grads to the
   optimizer's tier.
4. Prefetch at the first harmless opportunity (Cao, Felten, Karlin, Li 1995, "conservative"): in
   order of need, each fetch moves to the earliest tick from which its bytes fit in the budget at
   every tick until its use, given everything already placed; nothing is evicted for it, and
   copies stay issued in the order they are needed (channels are FIFOs).
5. Optimizer steps: on DEVICE in the OPTIMIZER moment (OS fetched from HOST/NVME and written back
   when the OS lives there); on HOST in the OPTIMIZER moment, or — with `optimizer_overlap` — right
   after the chunk's grads are final, during backward (Fuyou §4.3), with the OS read from NVME at
   the chunk's first backward use and written back after the next chunk's step (Fuyou's delayed
   write-back). Updated params go back where the iteration started: PARAM written back to
   HOST/NVME, persistent PARAM re-fetched to DEVICE.
6. Activations: SWAP_* offload after the block's forward and reload at the start of the stage
   before its backward; RECOMPUTE adds the block's forward to its first backward stage.
7. Copies between DEVICE and NVME go through HOST as two actions (chunks); an activation swap to
   NVME is one action whose path crosses both channels (as the simulator models it).

With world_size > 1 the entries are comm groups (PatrickStar §7): a PARAM group is fetched by the
owner of each chunk and then all-gathered (ALL_GATHER before first use), GRAD groups are
reduce-scattered when their backward is done (REDUCE_SCATTER), then each owner moves its chunk to
its optimizer tier; copies to and from HOST/NVME and optimizer steps of a chunk are done by its
owner rank, DEVICE copies and EVICTs from DEVICE by every rank. Bytes of local copies are per
chunk (summed over ranks in the prediction), of collectives per rank.

Budget accounting is in chunk capacity bytes (a copy moves the whole chunk buffer).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

import planner
from planner.costmodel import optimizer_seconds, transfer_seconds
from planner.errors import InfeasibleError, PlannerError
from planner.problem import NO_MOMENTS, Problem
from schemas._base import frozen
from schemas.schedule import (
    COPY_CHANNEL,
    TIER_INDEX,
    Action,
    ActivationMode,
    ActivationPlan,
    Budgets,
    Channel,
    ChunkLayout,
    ChunkList,
    ChunkPlan,
    Op,
    Prediction,
    Residency,
    Schedule,
    ScheduleHeader,
    SolverStatus,
    Stage,
    Tier,
    action_channels,
    copy_channel,
)
from schemas.trace import DTYPE_BYTES, Phase


@frozen
class Reservation:
    """Bytes a system keeps for itself on a tier (pinned staging buffers, swap pools, fp32 grad
    partitions): the schedule's budget on that tier is the capacity minus every reservation."""

    tier: Tier
    bytes: int
    what: str  # the buffer and its source (config default or code path of the real system)


class EvictionRule(StrEnum):
    BELADY_CLEAN_FIRST = "BELADY_CLEAN_FIRST"  # tide: farthest next use, clean entries before dirty ones
    FARTHEST_NEXT_USE = "FARTHEST_NEXT_USE"  # PatrickStar §8.3: farthest next use, clean or not
    LRU = "LRU"  # least recently used (what a policy without a trace can do)


@frozen
class Decisions:
    """What a policy decided; `materialize` derives everything else."""

    policy: str  # "tide" or the baseline imitated ("zero-offload", "patrickstar", ...)
    layout: ChunkLayout
    chunk_plans: tuple[ChunkPlan, ...]  # per chunk: OS tier and optimizer tier
    activation_modes: tuple[ActivationMode, ...]  # per block
    param_device_budget_bytes: tuple[int, ...]  # per moment: PARAM+GRAD chunk bytes allowed on DEVICE
    persistent_chunks: frozenset[int]  # PARAM chunks that never leave DEVICE
    optimizer_overlap: bool  # CPU steps during backward as soon as grads are final (Fuyou §4.3)
    prefetch: bool  # first harmless opportunity (Cao et al. 1995) instead of on demand
    eviction: EvictionRule
    notes: tuple[str, ...] = ()
    param_home_tiers: tuple[Tier, ...] = ()  # per chunk: HOST or NVME home of non-persistent PARAM; () = HOST
    # where RECOMPUTE blocks keep their input (the checkpoint) between forward and backward: None =
    # DEVICE; HOST = offloaded after the forward and reloaded with the SWAP blocks' timing (Fuyou §4.4)
    checkpoint_tier: Tier | None = None
    # per moment: the seconds the policy expects it to last (tide: the placement's stage times);
    # () = its compute (plus recompute). Only paces the SSD traffic of overlapped CPU steps.
    moment_seconds_hint: tuple[float, ...] = ()
    # issue the overlapped CPU steps and their OS's SSD traffic at the CPU's estimated pace instead of
    # as soon as the grads are final (`_paced_host_io`): faster when the CPU optimizer falls behind
    # backward, but the grads wait on HOST for it (the placement model's CPU-lag row counts them)
    pace_optimizer_io: bool = False
    # -- what a real system needs (issue 16, planner/policies/): defaults are tide's behaviour --
    # DDP: every rank holds every chunk (layout built for one rank), grads all-reduced when final
    replicated: bool = False
    # bytes the system reserves per tier for its buffers (subtracted from the schedule's budgets)
    reserved_bytes: tuple[Reservation, ...] = ()
    # prefetch: at most this many PARAM bytes fetched ahead of their use at any tick (DeepSpeed's
    # stage3_prefetch_bucket_size); None: no cap (tide: as early as the budget allows)
    prefetch_bucket_bytes: int | None = None
    # a PARAM entry leaves DEVICE after its last use in forward and again in backward, even with room
    # to keep it (sharded systems re-shard: PatrickStar Alg. 4, ZeRO-3's release, Gemini)
    release_between_phases: bool = False


@frozen
class SolverStats:
    """How good a solved placement is (goes into the schedule header)."""

    status: SolverStatus
    objective_seconds: float
    lower_bound_seconds: float
    gap: float


class ReplayError(PlannerError):
    """A schedule's actions break the residency bookkeeping (a materialize bug, or a hand-made schedule)."""


# ----------------------------------------------------------------------------- helpers others use


def activation_moments(problem: Problem, block: int) -> tuple[int, int, int]:
    """(offload, reload, backward start) moments of a block's activations.

    Offload at the block's last forward moment; reload at the first moment of the stage before the
    stage where its backward starts (the previous block's backward hides the copy).
    """
    info = problem.blocks[block]
    fwd_last, bwd_first = info.forward_moments[1], info.backward_moments[0]
    if NO_MOMENTS in (info.forward_moments, info.backward_moments):
        return -1, -1, -1
    stage = problem.stage_of_moment[bwd_first]
    reload = problem.stages[stage - 1].first_moment if stage > 0 else bwd_first
    reload = min(max(reload, fwd_last + 1), bwd_first)
    return fwd_last, reload, bwd_first


def non_model_curve(problem: Problem, activation_modes: Sequence[ActivationMode],
                    checkpoint_tier: Tier | None = None) -> np.ndarray:
    """DEVICE non-model bytes per moment under an activation plan (int64).

    The recorded curve keeps every block's activations; a SWAP block holds none on DEVICE from its
    offload to its reload, a RECOMPUTE block only its input until its backward starts (the
    simulator's memory model).
    """
    curve = np.array([m.non_model_bytes for m in problem.moments], dtype=np.int64)
    for b, mode in enumerate(activation_modes):
        if mode is ActivationMode.KEEP:
            continue
        fwd_last, reload, bwd_first = activation_moments(problem, b)
        if fwd_last < 0:
            continue
        info = problem.blocks[b]
        if mode is ActivationMode.RECOMPUTE:
            curve[fwd_last:bwd_first] -= max(0, info.activation_bytes - info.input_bytes)
            if checkpoint_tier is not None:  # the input is off DEVICE until its reload
                curve[fwd_last:reload] -= min(info.input_bytes, info.activation_bytes)
        else:
            curve[fwd_last:reload] -= info.activation_bytes
    return np.maximum(curve, 0)


def os_device_bytes(problem: Problem, layout: ChunkLayout, chunk_plans: Sequence[ChunkPlan]) -> int:
    """Bytes of optimizer state that live on DEVICE all the time, on the busiest rank (a chunk's OS
    is held by its owner rank only, as the simulator counts it; with one rank: the plain sum)."""
    per_element = sum(problem.list_itemsize(x) for x in problem.os_lists)
    per_rank = [0] * problem.world_size
    for p in chunk_plans:
        if p.os_tier is Tier.DEVICE:
            chunk = layout.chunks[p.chunk]
            per_rank[chunk.owner_rank] += chunk.elements * per_element
    return max(per_rank)


def param_budget_bytes(problem: Problem, layout: ChunkLayout, chunk_plans: Sequence[ChunkPlan],
                       activation_modes: Sequence[ActivationMode], checkpoint_tier: Tier | None = None) -> tuple[int, ...]:
    """The largest PARAM+GRAD budget per moment the DEVICE allows: capacity minus non-model bytes,
    minus OS kept on DEVICE, minus (in the OPTIMIZER moment) room for one comm group's OS fetched
    for a DEVICE step."""
    curve = non_model_curve(problem, activation_modes, checkpoint_tier)
    fixed = os_device_bytes(problem, layout, chunk_plans)
    transient = _device_step_os_bytes(problem, layout, chunk_plans)
    out = []
    for m in problem.moments:
        extra = transient if m.phase is Phase.OPTIMIZER else 0
        out.append(max(0, problem.device_bytes - int(curve[m.id]) - fixed - extra))
    return tuple(out)


def _device_step_os_bytes(problem: Problem, layout: ChunkLayout, chunk_plans: Sequence[ChunkPlan]) -> int:
    per_element = sum(problem.list_itemsize(x) for x in problem.os_lists)
    ws = problem.world_size
    best = 0
    for g in range(0, len(layout.chunks), ws):  # each owner fetches its own chunk of the group
        fetched = [layout.chunks[p.chunk].elements * per_element for p in chunk_plans[g:g + ws]
                   if p.optimizer_tier is Tier.DEVICE and p.os_tier is not Tier.DEVICE]
        best = max(best, *fetched, 0)
    return best


# ----------------------------------------------------------------------------- the engine

PARAM_ENTRY, GRAD_ENTRY = 0, 1
_NEVER = 1 << 40  # next use of an entry that is not used again


@dataclass(slots=True)
class _Interval:
    """One stay of an entry on DEVICE: [start, end) in ticks."""

    entry: int
    start: int
    first_use: int
    last_use: int
    end: int = -1  # -1: still resident at the end of the pass
    allocate: bool = False  # starts with ALLOCATE (a GRAD's first use), not a copy
    write_back: bool = False  # dirty when it ends: copy down before the EVICT
    pinned: bool = False  # a persistent PARAM: on DEVICE for the whole iteration


@dataclass(slots=True)
class _Plan:
    """Everything the passes share, in integer ids."""

    problem: Problem
    decisions: Decisions
    ws: int
    n_groups: int
    group_chunks: list[range]
    trainable_chunks: list[list[int]]  # per group: chunks holding trainable params
    entry_bytes: np.ndarray  # per entry (2 g + kind): DEVICE bytes of the whole group
    chunk_bytes: dict[ChunkList, list[int]]
    persistent: list[bool]  # per group
    optimizer_tier: list[Tier]  # per group
    os_tier: list[Tier]  # per chunk
    home: list[Tier]  # per chunk: HOST or NVME home of a non-persistent PARAM
    tick_moment: list[int] = field(default_factory=list)
    tick_budget: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    needs: list[list[int]] = field(default_factory=list)  # per tick: entries needed on DEVICE
    first_tick: dict[int, int] = field(default_factory=dict)  # moment -> its first tick
    device_step_tick: dict[int, int] = field(default_factory=dict)  # group -> tick of its DEVICE step
    host_step_tick: dict[int, int] = field(default_factory=dict)  # group -> tick of its HOST step
    grad_first_tick: dict[int, int] = field(default_factory=dict)  # group -> first backward use
    grad_final_tick: dict[int, int] = field(default_factory=dict)  # group -> tick after its last backward use


def materialize(problem: Problem, decisions: Decisions, *, stats: SolverStats | None = None) -> Schedule:
    """A complete, steady-state schedule for `decisions` (see the module docstring).

    Raises InfeasibleError when a tier cannot hold what the decisions require, naming the tier,
    the moment, the bytes short and the smallest capacity that would work.
    """
    _check_decisions(problem, decisions)
    plan = _plan(problem, decisions)
    _check_budget(plan)
    intervals = _demand_pass(plan)
    _trim(intervals, len(plan.tick_moment))
    if decisions.prefetch:
        _prefetch(plan, intervals)
    actions, deadlines = _emit(plan, intervals)
    residency = _initial_residency(plan)
    activation_plans = _activation_plans(problem, decisions.activation_modes)
    budgets = _reserved_budgets(problem, decisions)
    draft = Schedule(
        header=_header(problem, decisions, stats, 0.0),
        budgets=budgets,
        layout=decisions.layout,
        chunk_plans=decisions.chunk_plans,
        activation_plans=activation_plans,
        moments=problem.moments,
        stages=problem.stages,
        initial_residency=residency,
        actions=actions,
        prediction=Prediction(iteration_seconds=0.0, flops=0, bytes_per_channel={}, busy_seconds_per_channel={},
                              peak_bytes_per_tier={}),
    )
    replay = replay_residency(draft)
    _check_capacity(problem, replay, budgets, decisions.reserved_bytes)
    stages, prediction = _predict(problem, draft, deadlines, replay)
    return Schedule(
        header=_header(problem, decisions, stats, prediction.iteration_seconds),
        budgets=budgets,
        layout=decisions.layout,
        chunk_plans=decisions.chunk_plans,
        activation_plans=activation_plans,
        moments=problem.moments,
        stages=stages,
        initial_residency=residency,
        actions=actions,
        prediction=prediction,
    )


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
    for b, mode in enumerate(d.activation_modes):
        if mode is not ActivationMode.KEEP and activation_moments(problem, b)[0] < 0:
            raise PlannerError(f"decisions of {d.policy!r}: block {b} has no forward or no backward moment, "
                               f"so its activations can only be kept, found {mode}")
    ws = 1 if d.replicated else problem.world_size  # replicated (DDP): every chunk its own group
    for c in d.layout.chunks:
        if c.comm_group != c.id // ws:
            raise PlannerError(f"decisions of {d.policy!r}: chunk {c.id} is in comm group {c.comm_group}, expected "
                               f"{c.id // ws}; build the layout with planner.layout")


def _plan(problem: Problem, d: Decisions) -> _Plan:
    layout, ws = d.layout, 1 if d.replicated else problem.world_size
    n_chunks = len(layout.chunks)
    n_groups = math.ceil(n_chunks / ws)
    group_chunks = [range(g * ws, min((g + 1) * ws, n_chunks)) for g in range(n_groups)]
    trainable = [set() for _ in range(n_chunks)]
    chunk_of: dict[int, int] = {}
    for slot in layout.tensors:
        chunk_of[slot.tensor] = slot.chunk
        if slot.trainable:
            trainable[slot.chunk].add(slot.tensor)
    chunk_bytes = {x: [c.elements * problem.list_itemsize(x) for c in layout.chunks] for x in problem.lists}
    pbytes = chunk_bytes[ChunkList.PARAM]
    entry_bytes = np.zeros(2 * n_groups, dtype=np.int64)
    for g, chunks in enumerate(group_chunks):
        entry_bytes[2 * g + PARAM_ENTRY] = sum(pbytes[c] for c in chunks)
        entry_bytes[2 * g + GRAD_ENTRY] = sum(pbytes[c] for c in chunks if trainable[c])
    persistent = [any(c in d.persistent_chunks for c in chunks) for chunks in group_chunks]
    home = list(d.param_home_tiers) or [Tier.HOST] * n_chunks
    plan = _Plan(
        problem=problem, decisions=d, ws=ws, n_groups=n_groups, group_chunks=group_chunks,
        trainable_chunks=[[c for c in chunks if trainable[c]] for chunks in group_chunks],
        entry_bytes=entry_bytes, chunk_bytes=chunk_bytes, persistent=persistent,
        optimizer_tier=[d.chunk_plans[chunks[0]].optimizer_tier for chunks in group_chunks],
        os_tier=[p.os_tier for p in d.chunk_plans], home=home,
    )
    _ticks(plan, chunk_of, trainable)
    return plan


def _ticks(plan: _Plan, chunk_of: dict[int, int], trainable: list[set[int]]) -> None:
    """One tick per forward/backward moment; the OPTIMIZER moment gets one more per DEVICE-stepped group."""
    problem, ws = plan.problem, plan.ws
    opt_moment = problem.optimizer_moment
    budgets = plan.decisions.param_device_budget_bytes
    grad_ticks: dict[int, list[int]] = {}
    for m in problem.moments:
        plan.first_tick[m.id] = len(plan.tick_moment)
        needs: list[int] = []
        if m.phase is not Phase.OPTIMIZER:
            groups = sorted({chunk_of[t] // ws for t in m.tensors if t in chunk_of})
            needs = [2 * g + PARAM_ENTRY for g in groups]
            if m.phase is Phase.BACKWARD:
                for g in sorted({chunk_of[t] // ws for t in m.tensors if t in chunk_of and t in trainable[chunk_of[t]]}):
                    needs.append(2 * g + GRAD_ENTRY)
                    grad_ticks.setdefault(g, []).append(len(plan.tick_moment))
        plan.tick_moment.append(m.id)
        plan.needs.append(needs)
        if m.id == opt_moment:
            _optimizer_ticks(plan, grad_ticks, budgets)
    for g, ticks in grad_ticks.items():
        plan.grad_first_tick[g] = ticks[0]
        plan.grad_final_tick[g] = ticks[-1] + 1
    plan.tick_budget = np.array([budgets[m] for m in plan.tick_moment], dtype=np.int64)


def _optimizer_ticks(plan: _Plan, grad_ticks: dict[int, list[int]], budgets: Sequence[int]) -> None:
    """DEVICE steps stream through the budget, most recently final grads first (they are still
    on DEVICE); HOST steps run at the OPTIMIZER moment's first tick unless they overlap backward."""
    opt_moment = plan.problem.optimizer_moment
    base = len(plan.tick_moment) - 1
    stepped = [g for g in range(plan.n_groups) if plan.trainable_chunks[g]]
    device = [g for g in stepped if plan.optimizer_tier[g] is Tier.DEVICE]
    device.sort(key=lambda g: (-grad_ticks[g][-1] if g in grad_ticks else 1, g))
    for g in stepped:
        if plan.optimizer_tier[g] is Tier.HOST:
            overlap = plan.decisions.optimizer_overlap and g in grad_ticks
            plan.host_step_tick[g] = grad_ticks[g][-1] + 1 if overlap else base
    for g in device:
        plan.device_step_tick[g] = len(plan.tick_moment)
        plan.tick_moment.append(opt_moment)
        plan.needs.append([2 * g + PARAM_ENTRY, 2 * g + GRAD_ENTRY])


def _check_budget(plan: _Plan) -> None:
    """The entries a tick needs (and the pinned ones) must fit in its budget."""
    pinned = sum(int(plan.entry_bytes[2 * g]) for g in range(plan.n_groups) if plan.persistent[g])
    worst = None
    for tick, needs in enumerate(plan.needs):
        need = pinned + sum(int(plan.entry_bytes[e]) for e in needs
                            if not (e & 1 == PARAM_ENTRY and plan.persistent[e >> 1]))
        short = need - int(plan.tick_budget[tick])
        if short > 0 and (worst is None or short > worst[0]):
            worst = (short, tick, need)
    if worst is None:
        return
    short, tick, need = worst
    problem = plan.problem
    m = problem.moments[plan.tick_moment[tick]]
    curve = non_model_curve(problem, plan.decisions.activation_modes, plan.decisions.checkpoint_tier)
    fixed = os_device_bytes(problem, plan.decisions.layout, plan.decisions.chunk_plans)
    smallest = max(
        pinned + sum(int(plan.entry_bytes[e]) for e in needs if not (e & 1 == PARAM_ENTRY and plan.persistent[e >> 1]))
        + int(curve[plan.tick_moment[t]]) + fixed
        for t, needs in enumerate(plan.needs)
    )
    where = f"moment {m.id} ({m.phase.value.lower()} {m.kind.value} {m.module or '(root)'})"
    if smallest <= problem.device_bytes:
        raise InfeasibleError(
            f"DEVICE budget too small at {where} under policy {plan.decisions.policy!r}: its chunks need {need} bytes, "
            f"the PARAM budget there is {need - short} bytes ({short} bytes short); the DEVICE ({problem.device_bytes} "
            f"bytes) could hold them: raise param_device_budget_bytes there to at least {need}")
    raise InfeasibleError(
        f"DEVICE runs out at {where} under policy {plan.decisions.policy!r}: its chunks need {need} bytes, the PARAM "
        f"budget there is {need - short} bytes ({short} bytes short, with {int(curve[m.id])} non-model bytes and "
        f"{fixed} bytes of OS kept on DEVICE); the smallest DEVICE capacity that would work is {smallest} bytes "
        f"({smallest / 1e9:.2f} GB), this one has {problem.device_bytes} ({smallest - problem.device_bytes} bytes short)")


# -- the passes --------------------------------------------------------------------------------


class _Victims:
    """Eviction candidates ordered by the rule, with lazy invalidation (stamp per entry)."""

    def __init__(self, rule: EvictionRule) -> None:
        self.rule = rule
        self.clean: list[tuple[int, int, int]] = []
        self.dirty: list[tuple[int, int, int]] = []
        self.stamp: dict[int, int] = {}

    def push(self, entry: int, *, next_use: int, last_use: int, dirty: bool) -> None:
        stamp = self.stamp.get(entry, 0) + 1
        self.stamp[entry] = stamp
        key = last_use if self.rule is EvictionRule.LRU else -next_use
        heap = self.dirty if dirty and self.rule is EvictionRule.BELADY_CLEAN_FIRST else self.clean
        heapq.heappush(heap, (key, entry, stamp))

    def drop(self, entry: int) -> None:
        self.stamp[entry] = self.stamp.get(entry, 0) + 1

    def pop(self, keep: set[int]) -> int | None:
        """The next victim not in `keep` (entries in `keep` stay candidates)."""
        for heap in (self.clean, self.dirty):
            held: list[tuple[int, int, int]] = []
            found = None
            while heap:
                item = heapq.heappop(heap)
                key, entry, stamp = item
                if self.stamp.get(entry) != stamp:
                    continue
                if entry in keep:
                    held.append(item)
                    continue
                found = entry
                break
            for item in held:
                heapq.heappush(heap, item)
            if found is not None:
                self.stamp[found] += 1
                return found
        return None


def _demand_pass(plan: _Plan) -> list[_Interval]:
    """Fetch on demand, evict by the rule: every entry's stays on DEVICE as tick intervals."""
    n_ticks = len(plan.tick_moment)
    uses: dict[int, list[int]] = {}
    for tick, needs in enumerate(plan.needs):
        for e in needs:
            uses.setdefault(e, []).append(tick)
    ptr = dict.fromkeys(uses, 0)
    evictable = {e: not (e & 1 == GRAD_ENTRY and plan.ws > 1) for e in uses}  # see _emit: grads wait for the reduce
    victims = _Victims(plan.decisions.eviction)
    resident: dict[int, _Interval] = {}
    intervals: list[_Interval] = []
    allocated: set[int] = set()
    occupied = 0
    for g in range(plan.n_groups):
        if plan.persistent[g]:
            e = 2 * g + PARAM_ENTRY
            iv = _Interval(entry=e, start=0, first_use=-1, last_use=-1, pinned=True)
            resident[e] = iv
            intervals.append(iv)
            occupied += int(plan.entry_bytes[e])
    dirty_param: set[int] = set()

    def next_use(e: int) -> int:
        i = ptr[e]
        return uses[e][i] if i < len(uses[e]) else _NEVER

    for tick in range(n_ticks):
        needs = plan.needs[tick]
        keep = set(needs)
        missing = [e for e in needs if e not in resident]
        room = occupied + sum(int(plan.entry_bytes[e]) for e in missing) - int(plan.tick_budget[tick])
        while room > 0:
            victim = victims.pop(keep)
            if victim is None:
                raise InfeasibleError(_stuck_message(plan, tick, room))
            iv = resident.pop(victim)
            iv.end = tick
            size = int(plan.entry_bytes[victim])
            occupied -= size
            room -= size
        for e in missing:
            iv = _Interval(entry=e, start=tick, first_use=tick, last_use=tick, allocate=e & 1 == GRAD_ENTRY and e not in allocated)
            allocated.add(e)
            resident[e] = iv
            intervals.append(iv)
            occupied += int(plan.entry_bytes[e])
        for e in needs:
            iv = resident[e]
            if iv.first_use < 0:
                iv.first_use = tick
            iv.last_use = tick
            ptr[e] += 1
            g, kind = e >> 1, e & 1
            if plan.device_step_tick.get(g) == tick:
                if kind == GRAD_ENTRY:
                    ptr[e] = len(uses[e])  # dead after the step
                elif not plan.persistent[g]:
                    dirty_param.add(e)
            dirty = kind == GRAD_ENTRY and ptr[e] < len(uses[e]) or e in dirty_param
            iv.write_back = dirty
            # with several ranks a GRAD waits for its reduce-scatter, which follows its last use
            if not iv.pinned and (evictable[e] or ptr[e] >= len(uses[e])):
                victims.push(e, next_use=next_use(e), last_use=tick, dirty=dirty)
            else:
                victims.drop(e)
        if plan.decisions.release_between_phases:
            occupied -= _release_at_phase_end(plan, tick, needs, resident, victims, next_use)
        # a GRAD written back after its last backward use goes with the trim; mark it dirty now
        for e in needs:
            if e & 1 == GRAD_ENTRY and ptr[e] >= len(uses[e]) and plan.device_step_tick.get(e >> 1) != tick:
                resident[e].write_back = True
    return intervals


def _release_at_phase_end(plan: _Plan, tick: int, needs: list[int], resident: dict[int, _Interval],
                          victims: _Victims, next_use) -> int:
    """End the stay of every needed PARAM entry whose next use is in another phase (or never):
    a sharded system releases a gathered group after its last use in forward and in backward."""
    phase = plan.problem.moments[plan.tick_moment[tick]].phase
    freed = 0
    for e in needs:
        if e & 1 != PARAM_ENTRY or plan.persistent[e >> 1] or e not in resident:
            continue
        nxt = next_use(e)
        if nxt < len(plan.tick_moment) and plan.problem.moments[plan.tick_moment[nxt]].phase is phase:
            continue
        iv = resident.pop(e)
        iv.end = tick + 1
        victims.drop(e)
        freed += int(plan.entry_bytes[e])
    return freed


def _stuck_message(plan: _Plan, tick: int, short: int) -> str:
    m = plan.problem.moments[plan.tick_moment[tick]]
    return (f"DEVICE budget too small at moment {m.id} ({m.phase.value.lower()} {m.kind.value} {m.module or '(root)'}) "
            f"under policy {plan.decisions.policy!r}: {short} bytes more than the PARAM budget there "
            f"({int(plan.tick_budget[tick])} bytes) are pinned on DEVICE (persistent chunks, and grads waiting for their "
            f"reduce-scatter); raise param_device_budget_bytes there by {short} bytes (the DEVICE has "
            f"{plan.problem.device_bytes}) or make fewer chunks persistent")


def _trim(intervals: list[_Interval], n_ticks: int) -> None:
    """Each stay ends right after its last use (never before it: the use is inside)."""
    for iv in intervals:
        if iv.pinned:
            iv.end = -1
            continue
        iv.end = iv.last_use + 1 if iv.end < 0 else min(iv.end, iv.last_use + 1)
        iv.end = min(iv.end, n_ticks)


def _prefetch(plan: _Plan, intervals: list[_Interval]) -> None:
    """Move each fetch to the earliest tick from which it fits the budget until its use (Cao et al.)."""
    n_ticks = len(plan.tick_moment)
    delta = np.zeros(n_ticks + 1, dtype=np.int64)
    for iv in intervals:
        end = n_ticks if iv.end < 0 else iv.end
        delta[iv.start] += plan.entry_bytes[iv.entry]
        delta[end] -= plan.entry_bytes[iv.entry]
    occupied = np.cumsum(delta[:-1])
    slack = plan.tick_budget - occupied
    bucket = plan.decisions.prefetch_bucket_bytes
    ahead = np.zeros(n_ticks, dtype=np.int64)  # bytes fetched ahead of their use, per tick (with a bucket)
    previous_end: dict[int, int] = {}
    issued = 0  # copies are issued in the order they are needed: a channel is a FIFO, so a fetch for
    # later must never be queued ahead of one for sooner
    for iv in sorted(intervals, key=lambda x: (x.start, x.entry)):
        lower = previous_end.get(iv.entry, 0)
        previous_end[iv.entry] = n_ticks if iv.end < 0 else iv.end
        if iv.pinned or iv.allocate:
            continue
        lower = max(lower, issued)
        if iv.start <= lower:
            issued = max(issued, iv.start)
            continue
        size = plan.entry_bytes[iv.entry]
        window = slack[lower:iv.start]
        blocked = np.flatnonzero(window < size)
        if bucket is not None:
            blocked = np.union1d(blocked, _over_bucket(ahead[lower:iv.start], size, bucket))
        start = lower + (int(blocked[-1]) + 1 if blocked.size else 0)
        if start < iv.start:
            slack[start:iv.start] -= size
            if bucket is not None:
                ahead[start:iv.start] += size
            iv.start = start
        issued = start


def _over_bucket(ahead: np.ndarray, size: int, bucket: int) -> np.ndarray:
    """Ticks where the bucket of bytes fetched ahead is full: DeepSpeed issues one more prefetch while
    fewer than `prefetch_bucket_size` elements are in flight (the last one may overshoot it;
    `partitioned_param_coordinator.py` `fetch_sub_module`, the `numel_prefetching` loop)."""
    return np.flatnonzero(ahead >= bucket)


# -- actions -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Emitter:
    """Collects actions per tick, then flattens them in tick order."""

    plan: _Plan
    per_tick: list[list[tuple[Action, int]]]  # (action, deadline moment: when its data must be there)

    def add(self, tick: int, *, deadline: int | None = None, **fields: object) -> None:
        moment = self.plan.tick_moment[min(tick, len(self.plan.tick_moment) - 1)]
        self.per_tick[tick].append((Action(moment=moment, **fields), moment if deadline is None else deadline))

    def copy(self, tick: int, op: Op, lst: ChunkList, chunk: int, src: Tier, dst: Tier, *, deadline: int | None = None) -> None:
        self.add(tick, op=op, list=lst, chunk=chunk, src=src, dst=dst, channel=COPY_CHANNEL[(src, dst)],
                 bytes=self.plan.chunk_bytes[lst][chunk], deadline=deadline)

    def evict(self, tick: int, lst: ChunkList, chunk: int, tier: Tier) -> None:
        self.add(tick, op=Op.EVICT, list=lst, chunk=chunk, src=tier)

    def collective(self, tick: int, op: Op, lst: ChunkList, group: int) -> None:
        chunks = self.plan.group_chunks[group]
        per_rank = (self.plan.ws - 1) * max(self.plan.chunk_bytes[lst][c] for c in chunks)
        self.add(tick, op=op, list=lst, chunk=group, channel=Channel.INTER_GPU, bytes=per_rank)


def _emit(plan: _Plan, intervals: list[_Interval]) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """Actions in tick order (within a tick: activations, reduce-scatters, evictions, loads, staging
    cleanup, optimizer steps) and each action's deadline moment (a prefetch's first use)."""
    n_ticks = len(plan.tick_moment)
    out = _Emitter(plan, [[] for _ in range(n_ticks + 1)])
    ends: dict[int, list[_Interval]] = {}
    starts: dict[int, list[_Interval]] = {}
    first_uses: dict[int, list[_Interval]] = {}
    for iv in intervals:
        if not iv.pinned:
            ends.setdefault(iv.end, []).append(iv)
            starts.setdefault(iv.start, []).append(iv)
            first_uses.setdefault(iv.first_use, []).append(iv)
    finals: dict[int, list[int]] = {}
    for g, tick in plan.grad_final_tick.items():
        finals.setdefault(tick, []).append(g)
    optimizer_tick = plan.first_tick[plan.problem.optimizer_moment]
    step_tick, read_tick, write_tick = _paced_host_io(plan, optimizer_tick)
    host_steps: dict[int, list[int]] = {}
    for g, tick in plan.host_step_tick.items():
        host_steps.setdefault(step_tick.get(g, tick), []).append(g)
    os_reads_early: dict[int, list[int]] = {}
    for g, tick in read_tick.items():
        os_reads_early.setdefault(tick, []).append(g)
    paced_write_backs: dict[int, list[int]] = {}
    for g, tick in write_tick.items():
        paced_write_backs.setdefault(tick, []).append(g)
    device_steps = {tick: g for g, tick in plan.device_step_tick.items()}
    device_order = [device_steps[t] for t in sorted(device_steps)]
    device_rank = {g: k for k, g in enumerate(device_order)}
    activation = _activation_actions(plan.problem, plan.decisions.activation_modes, plan.decisions.checkpoint_tier)
    first_tick_of = {tick: m for m, tick in plan.first_tick.items()}
    key = lambda iv: iv.entry  # noqa: E731 - determinism inside a tick
    written_back_later: list[int] = []

    for tick in range(n_ticks + 1):
        if tick in first_tick_of:
            for fields in activation.get(first_tick_of[tick], ()):
                out.add(tick, **fields)
        if plan.ws > 1:
            for g in sorted(finals.get(tick, ())):
                out.collective(tick, Op.REDUCE_SCATTER, ChunkList.GRAD, g)
        elif plan.decisions.replicated and plan.problem.world_size > 1:
            for g in sorted(finals.get(tick, ())):
                _all_reduce(out, plan, g, tick)
        for iv in sorted(ends.get(tick, ()), key=key):
            _emit_end(out, plan, iv, tick)
        for iv in sorted(starts.get(tick, ()), key=key):
            _emit_start(out, plan, iv, tick)
        for iv in sorted(first_uses.get(tick, ()), key=key):
            if iv.allocate:
                continue
            if iv.entry & 1 == PARAM_ENTRY:
                for c in plan.group_chunks[iv.entry >> 1]:
                    if plan.home[c] is Tier.NVME:
                        out.evict(tick, ChunkList.PARAM, c, Tier.HOST)  # the staging copy
            else:
                for c in plan.trainable_chunks[iv.entry >> 1]:
                    out.evict(tick, ChunkList.GRAD, c, Tier.HOST)  # back on DEVICE, where it changes next
        for g in sorted(os_reads_early.get(tick, ())):
            _host_step_reads(out, plan, g, tick, params=False, deadline=plan.tick_moment[plan.host_step_tick[g]])
        for g in sorted(host_steps.get(tick, ()), key=lambda g: (plan.host_step_tick[g], g)):
            paced = g in read_tick
            _host_step_reads(out, plan, g, tick, os_state=not paced)
            _host_step(out, plan, g, tick)
            if paced or not any(plan.os_tier[c] is Tier.NVME for c in plan.trainable_chunks[g]):
                continue  # paced: written back at its tick below; no NVMe OS: nothing to write back
            # delayed write-back (Fuyou §4.3): group i's OS goes down after group i+1's step is issued,
            # so the SSDs never wait on the CPU with the next group's reads queued behind them
            for previous in written_back_later:
                _host_step_write_back(out, plan, previous, tick)
            written_back_later = [g]
        for g in sorted(paced_write_backs.get(tick, ())):
            _host_step_write_back(out, plan, g, tick)
        if tick == n_ticks:
            for previous in written_back_later:
                _host_step_write_back(out, plan, previous, tick)
        if tick in device_steps:
            k = device_rank[device_steps[tick]]
            if k == 0:
                _device_step_nvme_reads(out, plan, device_order[0], tick)
            if k + 1 < len(device_order):
                # the next step's OS is read from NVME before this one's goes back: the SSDs are one
                # FIFO (simplex), so a write-back queued first would hold the next read behind the
                # whole DEVICE round trip of this step (the streamed steps pipeline instead)
                _device_step_nvme_reads(out, plan, device_order[k + 1], tick)
            _device_step(out, plan, device_steps[tick], tick)
    flat = [item for items in out.per_tick for item in items]
    return tuple(a for a, _ in flat), tuple(d for _, d in flat)


def _all_reduce(out: _Emitter, plan: _Plan, g: int, tick: int) -> None:
    """DDP's all-reduce of a final GRAD chunk (replicated decisions): a ring reduce-scatter then
    all-gather, each moving (p-1)/p of the used grad bytes per rank (torch DDP, bucketed during
    backward; modelled per chunk)."""
    p = plan.problem.world_size
    for c in plan.trainable_chunks[g]:
        half = (p - 1) * plan.decisions.layout.chunks[c].used_elements * plan.problem.list_itemsize(ChunkList.GRAD) // p
        for op in (Op.REDUCE_SCATTER, Op.ALL_GATHER):
            out.add(tick, op=op, list=ChunkList.GRAD, chunk=c, channel=Channel.INTER_GPU, bytes=half)


def _estimated_tick_seconds(plan: _Plan) -> list[float]:
    """When each tick starts if nothing waits: the cumulative compute of the moments (plus the
    recompute of RECOMPUTE blocks at their first backward moment), then in the OPTIMIZER moment one
    DEVICE step after the other at the pace of its busiest link. Only used to pace the SSDs."""
    problem, hw = plan.problem, plan.problem.hardware
    extra = [0.0] * len(problem.moments)
    for b, mode in enumerate(plan.decisions.activation_modes):
        if mode is ActivationMode.RECOMPUTE:
            first = problem.blocks[b].backward_moments[0]
            if first >= 0:
                extra[first] += problem.blocks[b].recompute_seconds
    hint = plan.decisions.moment_seconds_hint
    start, t = [], 0.0
    for m in problem.moments:
        start.append(t)
        t += hint[m.id] if hint else m.compute_seconds + extra[m.id]
    step_at = {tick: g for g, tick in plan.device_step_tick.items()}
    out: list[float] = []
    lag = 0.0
    for tick, m in enumerate(plan.tick_moment):
        out.append(start[m] + lag)
        g = step_at.get(tick)
        if g is None:
            continue
        up = down = nvme = 0.0
        for c in plan.trainable_chunks[g]:
            os_bytes = sum(plan.chunk_bytes[x][c] for x in problem.os_lists)
            param = plan.chunk_bytes[ChunkList.PARAM][c]
            if plan.os_tier[c] is not Tier.DEVICE:
                up += os_bytes
                down += os_bytes
            if plan.os_tier[c] is Tier.NVME:
                nvme += os_bytes / (hw.nvme_read_bytes_per_s or math.inf) + os_bytes / (hw.nvme_write_bytes_per_s or math.inf)
            if not plan.persistent[g]:
                up += 2 * param
                down += param
        lag += max(up / hw.h2d_bytes_per_s, down / hw.d2h_bytes_per_s, nvme)
    return out


def _paced_host_io(plan: _Plan, optimizer_tick: int) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Ticks at which the overlapped CPU steps, and the NVMe reads and write-backs of their OS, are issued.

    The SSDs are one FIFO (simplex): a write-back issued before its CPU step is done holds every
    later read (the next steps' OS, activation reloads, NVMe-homed PARAM, streamed OS) behind the
    CPU queue. When the CPU optimizer is slower than backward produces final grads (175B: 75 s of
    CPU Adam against 37 s of backward) that queue grows to tens of seconds. So the OS follows the
    CPU's pace (estimated with `_estimated_tick_seconds` and the CPU optimizer rate): a step is
    issued about one OS read before the CPU is estimated to reach it (its grads wait on HOST), its
    OS is read two reads ahead of that (never before its first backward use), and written back
    once the step is estimated done (never before the next step is issued: Fuyou §4.3's delayed
    write-back). This also bounds the OS staged on HOST to the steps in flight. Steps the CPU is
    estimated to reach only after the last tick get step tick n_ticks: the tail, issued there one
    after the other with the delayed write-back chain. Steps without NVMe OS are not paced."""
    d, problem = plan.decisions, plan.problem
    if not d.pace_optimizer_io:
        return {}, {}, {}
    early = sorted((tick, g) for g, tick in plan.host_step_tick.items() if tick != optimizer_tick)
    os_bytes = {g: sum(plan.chunk_bytes[x][c] for c in plan.trainable_chunks[g] for x in problem.os_lists
                       if plan.os_tier[c] is Tier.NVME) for _, g in early}
    if not any(os_bytes.values()):
        return {}, {}, {}
    est = _estimated_tick_seconds(plan)
    n_ticks = len(plan.tick_moment)
    rate = problem.hardware.host.optimizer_params_per_s
    lead = max(os_bytes.values()) / (problem.hardware.nvme_read_bytes_per_s or math.inf)

    def first_tick_at(seconds: float, lo: int, hi: int) -> int:
        t = lo
        while t < hi and est[t] < seconds:
            t += 1
        return t

    step_tick: dict[int, int] = {}
    cpu_end: dict[int, float] = {}
    read_tick: dict[int, int] = {}
    write_tick: dict[int, int] = {}
    cpu_free = 0.0
    last = 0
    for tick, g in early:
        elements = sum(d.layout.chunks[c].elements for c in plan.trainable_chunks[g])
        start = max(est[tick], cpu_free)
        cpu_free = cpu_end[g] = start + elements / rate
        last = step_tick[g] = max(first_tick_at(start - lead, tick, n_ticks), last)
        if step_tick[g] < n_ticks and os_bytes[g]:
            read_tick[g] = first_tick_at(start - 2 * lead, plan.grad_first_tick[g], step_tick[g])
    for k, (tick, g) in enumerate(early):
        if g in read_tick:
            after = step_tick[early[k + 1][1]] if k + 1 < len(early) else n_ticks
            write_tick[g] = first_tick_at(cpu_end[g], max(after, step_tick[g]), n_ticks)
    return step_tick, read_tick, write_tick


def _emit_end(out: _Emitter, plan: _Plan, iv: _Interval, tick: int) -> None:
    g, kind = iv.entry >> 1, iv.entry & 1
    if kind == PARAM_ENTRY:
        for c in plan.group_chunks[g]:
            if iv.write_back:  # updated on DEVICE by its optimizer step: home is stale
                out.copy(tick, Op.WRITE_BACK, ChunkList.PARAM, c, Tier.DEVICE, Tier.HOST)
                if plan.home[c] is Tier.NVME:
                    out.copy(tick, Op.WRITE_BACK, ChunkList.PARAM, c, Tier.HOST, Tier.NVME)
                    out.evict(tick, ChunkList.PARAM, c, Tier.HOST)
            out.evict(tick, ChunkList.PARAM, c, Tier.DEVICE)
        return
    for c in plan.trainable_chunks[g]:
        if iv.write_back:
            out.copy(tick, Op.WRITE_BACK, ChunkList.GRAD, c, Tier.DEVICE, Tier.HOST)
        out.evict(tick, ChunkList.GRAD, c, Tier.DEVICE)


def _emit_start(out: _Emitter, plan: _Plan, iv: _Interval, tick: int) -> None:
    g, kind = iv.entry >> 1, iv.entry & 1
    op = Op.PREFETCH if tick < iv.first_use else Op.FETCH
    use = plan.tick_moment[iv.first_use]
    if kind == GRAD_ENTRY:
        for c in plan.trainable_chunks[g]:
            if iv.allocate:
                out.add(tick, op=Op.ALLOCATE, list=ChunkList.GRAD, chunk=c, dst=Tier.DEVICE)
            else:
                out.copy(tick, op, ChunkList.GRAD, c, Tier.HOST, Tier.DEVICE, deadline=use)
        return
    for c in plan.group_chunks[g]:
        if plan.home[c] is Tier.NVME:
            out.copy(tick, op, ChunkList.PARAM, c, Tier.NVME, Tier.HOST, deadline=use)
        out.copy(tick, op, ChunkList.PARAM, c, Tier.HOST, Tier.DEVICE, deadline=use)
    # an optimizer step needs the owners' own chunks only: no all-gather for it (PatrickStar Alg. 4)
    if plan.ws > 1 and plan.device_step_tick.get(g) != iv.first_use:
        out.collective(tick, Op.ALL_GATHER, ChunkList.PARAM, g)


def _host_step_reads(out: _Emitter, plan: _Plan, g: int, tick: int, *, os_state: bool = True, params: bool = True,
                     deadline: int | None = None) -> None:
    """What a HOST step needs on HOST besides the grads: OS (and PARAM) living on NVME.

    With overlap the OS is read early (at the chunk's first backward use) so the SSDs work while
    the device computes; a PARAM from NVME is read at the step (backward may still stage it)."""
    for c in plan.trainable_chunks[g]:
        if os_state and plan.os_tier[c] is Tier.NVME:
            for lst in plan.problem.os_lists:
                out.copy(tick, Op.PREFETCH, lst, c, Tier.NVME, Tier.HOST, deadline=deadline)
        if params and not plan.persistent[g] and plan.home[c] is Tier.NVME:
            out.copy(tick, Op.PREFETCH, ChunkList.PARAM, c, Tier.NVME, Tier.HOST)


def _host_step(out: _Emitter, plan: _Plan, g: int, tick: int) -> None:
    """CPU Adam on HOST, then everything updated goes back where the iteration started."""
    for c in plan.trainable_chunks[g]:
        if g not in plan.grad_final_tick:  # trainable but never reached by backward: zero grads
            out.add(tick, op=Op.ALLOCATE, list=ChunkList.GRAD, chunk=c, dst=Tier.HOST)
        out.add(tick, op=Op.OPTIMIZER_STEP, chunk=c, dst=Tier.HOST, channel=Channel.CPU_OPTIMIZER)
        out.evict(tick, ChunkList.GRAD, c, Tier.HOST)
        if plan.persistent[g]:
            out.evict(tick, ChunkList.PARAM, c, Tier.DEVICE)  # stale now
            # nothing this iteration needs it again: the work of this moment must not wait for it
            out.copy(tick, Op.PREFETCH, ChunkList.PARAM, c, Tier.HOST, Tier.DEVICE, deadline=plan.problem.moments[-1].id)
        elif plan.home[c] is Tier.NVME:
            out.copy(tick, Op.WRITE_BACK, ChunkList.PARAM, c, Tier.HOST, Tier.NVME)
            out.evict(tick, ChunkList.PARAM, c, Tier.HOST)
    if plan.persistent[g] and plan.ws > 1:
        out.collective(tick, Op.ALL_GATHER, ChunkList.PARAM, g)


def _host_step_write_back(out: _Emitter, plan: _Plan, g: int, tick: int) -> None:
    """The OS a HOST step updated goes back to NVME (where it lives)."""
    for c in plan.trainable_chunks[g]:
        if plan.os_tier[c] is Tier.NVME:
            for lst in plan.problem.os_lists:
                out.copy(tick, Op.WRITE_BACK, lst, c, Tier.HOST, Tier.NVME)
                out.evict(tick, lst, c, Tier.HOST)


def _device_step_nvme_reads(out: _Emitter, plan: _Plan, g: int, tick: int) -> None:
    """The OS of a DEVICE step that lives on NVME, read to HOST (staged there until its write-back)."""
    for c in plan.trainable_chunks[g]:
        if plan.os_tier[c] is Tier.NVME:
            for lst in plan.problem.os_lists:
                out.copy(tick, Op.FETCH, lst, c, Tier.NVME, Tier.HOST)


def _device_step(out: _Emitter, plan: _Plan, g: int, tick: int) -> None:
    """GPU Adam: OS that lives lower comes up for the step and goes back down after it (the NVME
    reads were issued by `_device_step_nvme_reads`, one step ahead)."""
    for c in plan.trainable_chunks[g]:
        os_tier = plan.os_tier[c]
        for lst in plan.problem.os_lists:
            if os_tier is not Tier.DEVICE:
                out.copy(tick, Op.FETCH, lst, c, Tier.HOST, Tier.DEVICE)
        out.add(tick, op=Op.OPTIMIZER_STEP, chunk=c, dst=Tier.DEVICE, channel=Channel.COMPUTE)
        for lst in plan.problem.os_lists:
            if os_tier is not Tier.DEVICE:
                out.copy(tick, Op.WRITE_BACK, lst, c, Tier.DEVICE, Tier.HOST)
                out.evict(tick, lst, c, Tier.DEVICE)
            if os_tier is Tier.NVME:
                out.copy(tick, Op.WRITE_BACK, lst, c, Tier.HOST, Tier.NVME)
                out.evict(tick, lst, c, Tier.HOST)
    if plan.persistent[g] and plan.ws > 1:
        out.collective(tick, Op.ALL_GATHER, ChunkList.PARAM, g)


def _activation_actions(problem: Problem, modes: Sequence[ActivationMode],
                        checkpoint_tier: Tier | None = None) -> dict[int, list[dict]]:
    """Per moment: the activation copies of SWAP blocks (offload after forward, reload before backward),
    and of RECOMPUTE blocks' inputs when they are kept off DEVICE (`checkpoint_tier`)."""
    out: dict[int, list[dict]] = {}
    for b, mode in enumerate(modes):
        if mode is ActivationMode.RECOMPUTE and checkpoint_tier is not None:
            fwd_last, reload, bwd_first = activation_moments(problem, b)
            if fwd_last < 0 or reload <= fwd_last:
                continue
            nbytes = min(problem.blocks[b].input_bytes, problem.blocks[b].activation_bytes)
            tier = checkpoint_tier
        elif mode not in (ActivationMode.SWAP_HOST, ActivationMode.SWAP_NVME):
            continue
        else:
            fwd_last, reload, bwd_first = activation_moments(problem, b)
            nbytes = problem.blocks[b].activation_bytes
            tier = Tier.HOST if mode is ActivationMode.SWAP_HOST else Tier.NVME
        out.setdefault(fwd_last, []).append(dict(
            op=Op.ACT_OFFLOAD, block=b, src=Tier.DEVICE, dst=tier,
            channel=copy_channel(Tier.DEVICE, tier), bytes=nbytes, deadline=max(fwd_last, reload - 1)))
        out.setdefault(reload, []).append(dict(
            op=Op.ACT_RELOAD, block=b, src=tier, dst=Tier.DEVICE,
            channel=copy_channel(tier, Tier.DEVICE), bytes=nbytes, deadline=bwd_first))
    return out


def _initial_residency(plan: _Plan) -> tuple[Residency, ...]:
    """PARAM at home (DEVICE for persistent chunks, plus HOST when their step runs there), OS on
    its tier; GRAD is absent (it lives from its first backward use to its optimizer step)."""
    out = []
    for c, chunk in enumerate(plan.decisions.layout.chunks):
        g = c // plan.ws
        if plan.persistent[g]:
            tiers = (Tier.DEVICE, Tier.HOST) if plan.optimizer_tier[g] is Tier.HOST else (Tier.DEVICE,)
        else:
            tiers = (plan.home[c],)
        out.append(Residency(list=ChunkList.PARAM, chunk=c, tiers=tiers))
    for lst in plan.problem.os_lists:
        for c in range(len(plan.decisions.layout.chunks)):
            out.append(Residency(list=lst, chunk=c, tiers=(plan.os_tier[c],)))
    return tuple(out)


def _activation_plans(problem: Problem, modes: Sequence[ActivationMode]) -> tuple[ActivationPlan, ...]:
    return tuple(
        ActivationPlan(block=b.id, module=b.module, mode=modes[b.id], bytes=b.activation_bytes, input_bytes=b.input_bytes,
                       recompute_seconds=b.recompute_seconds, recompute_flops=b.recompute_flops)
        for b in problem.blocks
    )


# -- residency replay ------------------------------------------------------------------------


@frozen
class ResidencyReplay:
    """Bytes per tier during each moment's work, from replaying the actions (and the checks passed)."""

    device_bytes: tuple[int, ...]  # chunks + non-model (incl. activations kept on DEVICE), max over the moment
    host_bytes: tuple[int, ...]
    nvme_bytes: tuple[int, ...]
    fetched_chunks: int  # FETCH/PREFETCH actions to DEVICE

    @property
    def peak_bytes_per_tier(self) -> dict[Tier, int]:
        return {Tier.DEVICE: max(self.device_bytes), Tier.HOST: max(self.host_bytes), Tier.NVME: max(self.nvme_bytes)}


def replay_residency(schedule: Schedule) -> ResidencyReplay:
    """Replay the actions' bookkeeping: copies from valid sources only, PARAM on DEVICE for every
    moment's work and GRAD for every backward write, optimizer inputs present, and the iteration
    ending where it started. Raises ReplayError naming the moment, action and chunk."""
    layout = schedule.layout
    lists = tuple(layout.lists)
    n_chunks = len(layout.chunks)
    size = {x: [c.elements * DTYPE_BYTES[layout.list_dtypes[x]] for c in layout.chunks] for x in lists}
    held: dict[ChunkList, list[int]] = {x: [0] * n_chunks for x in lists}
    valid: dict[ChunkList, list[int]] = {x: [0] * n_chunks for x in lists}
    tier_bytes = [0, 0, 0]
    # With several ranks a chunk's OS on DEVICE is its owner's only (PARAM and GRAD copies there are
    # every rank's once gathered): DEVICE bytes = the chunks' plus the busiest rank's OS
    os_lists = [x for x in lists if x in (ChunkList.MASTER, ChunkList.M, ChunkList.V)]
    per_owner = schedule.header.world_size > 1
    os_device = [0] * schedule.header.world_size

    def count(x: ChunkList, c: int, t: int, sign: int) -> None:
        if per_owner and t == 0 and x in os_lists:
            os_device[layout.chunks[c].owner_rank] += sign * size[x][c]
        else:
            tier_bytes[t] += sign * size[x][c]

    def totals() -> list[int]:
        return [tier_bytes[0] + max(os_device), tier_bytes[1], tier_bytes[2]]

    for r in schedule.initial_residency:
        for tier in r.tiers:
            bit = 1 << TIER_INDEX[tier]
            held[r.list][r.chunk] |= bit
            valid[r.list][r.chunk] |= bit
            count(r.list, r.chunk, TIER_INDEX[tier], 1)
    chunk_of = {t.tensor: t.chunk for t in layout.tensors}
    trainable = {t.tensor for t in layout.tensors if t.trainable}
    by_moment: list[list[int]] = [[] for _ in schedule.moments]
    for i, a in enumerate(schedule.actions):
        by_moment[a.moment].append(i)
    modes = [p.mode for p in schedule.activation_plans]
    act_tier: dict[int, Tier] = {}
    act_bytes = [0, 0, 0]
    fwd_last, bwd_first = _activation_windows(schedule)
    held_recorded = 0
    device, host, nvme = [], [], []
    fetched = 0

    def fail(m: int, i: int | None, what: str) -> ReplayError:
        where = f"moment {m}" + (f", action {i} ({schedule.actions[i].op.value} {schedule.actions[i].list} "
                                 f"chunk {schedule.actions[i].chunk})" if i is not None else "")
        return ReplayError(f"residency replay of policy {schedule.header.policy!r}: {where}: {what}")

    def add(x: ChunkList, c: int, t: int) -> None:
        if not held[x][c] >> t & 1:
            held[x][c] |= 1 << t
            count(x, c, t, 1)
        valid[x][c] |= 1 << t

    for m in schedule.moments:
        for b in range(len(modes)):
            if fwd_last[b] == m.id:
                held_recorded += schedule.activation_plans[b].bytes
                act_bytes[0] += _act_device_bytes(schedule.activation_plans[b])
        peak_model = totals()
        for i in by_moment[m.id]:
            a = schedule.actions[i]
            if a.op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK):
                s, d = TIER_INDEX[a.src], TIER_INDEX[a.dst]
                if not valid[a.list][a.chunk] >> s & 1:
                    raise fail(m.id, i, f"copies from {a.src.value}, which holds no valid copy")
                add(a.list, a.chunk, d)
                fetched += a.dst is Tier.DEVICE and a.op is not Op.WRITE_BACK
            elif a.op is Op.EVICT:
                s = TIER_INDEX[a.src]
                if not held[a.list][a.chunk] >> s & 1:
                    raise fail(m.id, i, f"evicts from {a.src.value}, which holds no copy")
                live = valid[a.list][a.chunk] & ~(1 << s)
                if a.list is not ChunkList.GRAD and not live:
                    raise fail(m.id, i, "drops the last valid copy")
                held[a.list][a.chunk] &= ~(1 << s)
                valid[a.list][a.chunk] &= ~(1 << s)
                count(a.list, a.chunk, s, -1)
            elif a.op is Op.ALLOCATE:
                add(a.list, a.chunk, TIER_INDEX[a.dst])
                valid[a.list][a.chunk] = 1 << TIER_INDEX[a.dst]
            elif a.op is Op.OPTIMIZER_STEP:
                d = TIER_INDEX[a.dst]
                for x in (ChunkList.PARAM, ChunkList.GRAD, *os_lists):
                    if not valid[x][a.chunk] >> d & 1:
                        raise fail(m.id, i, f"steps on {a.dst.value} without a valid {x.value} copy there")
                for x in (ChunkList.PARAM, *os_lists):
                    valid[x][a.chunk] = 1 << d
                valid[ChunkList.GRAD][a.chunk] = 0  # dead: its copies are freed by EVICTs
            elif a.op is Op.ACT_OFFLOAD:
                act_tier[a.block] = a.dst
                act_bytes[0] -= _act_device_bytes(schedule.activation_plans[a.block])
                act_bytes[TIER_INDEX[a.dst]] += a.bytes
            elif a.op is Op.ACT_RELOAD:
                if act_tier.pop(a.block, None) is not a.src:
                    raise fail(m.id, i, f"reloads block {a.block}'s activations from {a.src.value}, they are not there")
                act_bytes[TIER_INDEX[a.src]] -= a.bytes
                act_bytes[0] += _act_device_bytes(schedule.activation_plans[a.block])
            elif a.op is Op.ALL_GATHER and a.list is not ChunkList.GRAD:  # a GRAD one: DDP's all-reduce, in place
                for c in range(a.chunk * schedule.header.world_size,
                               min((a.chunk + 1) * schedule.header.world_size, n_chunks)):
                    add(a.list, c, 0)
            peak_model = [max(p, now) for p, now in zip(peak_model, totals())]
        for b in range(len(modes)):
            if bwd_first[b] == m.id:
                if b in act_tier:
                    raise fail(m.id, None, f"block {b}'s backward starts with its activations on {act_tier[b].value}")
                held_recorded -= schedule.activation_plans[b].bytes
                act_bytes[0] -= _act_device_bytes(schedule.activation_plans[b])
        if m.phase is not Phase.OPTIMIZER:
            for t in m.tensors:
                c = chunk_of[t]
                if not valid[ChunkList.PARAM][c] & 1:
                    raise fail(m.id, None, f"the work of {m.module or '(root)'} needs PARAM chunk {c} on DEVICE")
                if m.phase is Phase.BACKWARD and t in trainable:
                    if not valid[ChunkList.GRAD][c] & 1:
                        raise fail(m.id, None, f"the backward of {m.module or '(root)'} writes GRAD chunk {c}, not on DEVICE")
                    valid[ChunkList.GRAD][c] = 1
        # during the actions the chunks alone; during the work the chunks, the non-model bytes and activations
        non_model = max(0, m.non_model_bytes - held_recorded) + act_bytes[0]
        now = totals()
        device.append(max(peak_model[0], now[0] + non_model))
        host.append(max(peak_model[1], now[1] + act_bytes[1]))
        nvme.append(max(peak_model[2], now[2] + act_bytes[2]))
    _check_steady_state(schedule, held, valid, fail)
    return ResidencyReplay(device_bytes=tuple(device), host_bytes=tuple(host), nvme_bytes=tuple(nvme),
                           fetched_chunks=fetched)


def _act_device_bytes(p: ActivationPlan) -> int:
    """What a block holds on DEVICE between its forward and backward when not offloaded."""
    return p.input_bytes if p.mode is ActivationMode.RECOMPUTE else p.bytes


def _activation_windows(schedule: Schedule) -> tuple[list[int], list[int]]:
    n = len(schedule.activation_plans)
    fwd_last, bwd_first = [-1] * n, [-1] * n
    for m in schedule.moments:
        if 0 <= m.block < n:
            if m.phase is Phase.FORWARD:
                fwd_last[m.block] = m.id
            elif m.phase is Phase.BACKWARD and bwd_first[m.block] < 0:
                bwd_first[m.block] = m.id
    return fwd_last, bwd_first


def _check_steady_state(schedule: Schedule, held: dict, valid: dict, fail) -> None:
    want: dict[tuple[ChunkList, int], int] = {}
    for r in schedule.initial_residency:
        want[(r.list, r.chunk)] = sum(1 << TIER_INDEX[t] for t in r.tiers)
    last = len(schedule.moments) - 1
    for x, chunks in held.items():
        for c, mask in enumerate(chunks):
            expected = want.get((x, c), 0)
            if mask != expected or (x is not ChunkList.GRAD and valid[x][c] != expected):
                raise fail(last, None, f"the iteration ends with {x.value} chunk {c} held on tiers {mask:03b} "
                                       f"(valid {valid[x][c]:03b}), it started on {expected:03b} (bits NVME,HOST,DEVICE)")


# -- checks and prediction ---------------------------------------------------------------------


def _reserved_budgets(problem: Problem, d: Decisions) -> Budgets:
    """The schedule's budgets: each tier's capacity minus what the policy reserves there (its buffers)."""
    held = {t: sum(r.bytes for r in d.reserved_bytes if r.tier is t) for t in Tier}
    return Budgets(device_bytes=max(0, problem.device_bytes - held[Tier.DEVICE]),
                   host_bytes=max(0, problem.host_bytes - held[Tier.HOST]),
                   nvme_bytes=max(0, problem.nvme_bytes - held[Tier.NVME]))


def _check_capacity(problem: Problem, replay: ResidencyReplay, budgets: Budgets | None = None,
                    reserved: Sequence[Reservation] = ()) -> None:
    budgets = budgets or Budgets(device_bytes=problem.device_bytes, host_bytes=problem.host_bytes,
                                 nvme_bytes=problem.nvme_bytes)
    for tier, per_moment, capacity in ((Tier.DEVICE, replay.device_bytes, budgets.device_bytes),
                                       (Tier.HOST, replay.host_bytes, budgets.host_bytes),
                                       (Tier.NVME, replay.nvme_bytes, budgets.nvme_bytes)):
        peak = max(per_moment)
        if peak > capacity:
            m = problem.moments[int(np.argmax(per_moment))]
            buffers = sum(r.bytes for r in reserved if r.tier is tier)
            held = (f" (after {buffers} bytes of the system's own buffers: "
                    + ", ".join(r.what.split(";")[0] for r in reserved if r.tier is tier) + ")") if buffers else ""
            raise InfeasibleError(
                f"{tier.value} runs out at moment {m.id} ({m.phase.value.lower()} {m.kind.value} {m.module or '(root)'}): "
                f"it needs {peak} bytes, the capacity is {capacity}{held} ({peak - capacity} bytes short); the smallest "
                f"{tier.value} capacity that would work with these decisions is {peak + buffers} bytes "
                f"({(peak + buffers) / 1e9:.2f} GB)")


def _predict(problem: Problem, schedule: Schedule, deadlines: Sequence[int],
             replay: ResidencyReplay) -> tuple[tuple[Stage, ...], Prediction]:
    """Stage times by the cost model and the iteration's totals.

    T_s = max(compute + recompute + GPU Adam, CPU Adam, H2D, D2H, NVMe reads + writes, inter-GPU)
    (Fuyou Eq. 2, 5). A transfer (and a CPU Adam step) counts in the stages between its issue and
    its deadline (a prefetch's first use; the end of the iteration for steps): each resource serves
    its queue in issue order during the stage, and what is still queued at a deadline lengthens
    the deadline's stage. Stage lengths are found in a few passes, each filling the resources into
    the lengths of the previous one.
    """
    hw = problem.hardware
    stages = problem.stages
    n_stages = len(stages)
    base = [0.0] * n_stages  # the stage's work: compute, recompute, optimizer steps
    device_opt = [0.0] * n_stages
    cpu_opt = [0.0] * n_stages
    for st in stages:
        base[st.id] = sum(problem.moments[m].compute_seconds for m in range(st.first_moment, st.last_moment + 1))
    recompute_flops = 0
    for p in schedule.activation_plans:
        if p.mode is ActivationMode.RECOMPUTE:
            base[problem.stage_of_moment[problem.blocks[p.block].backward_moments[0]]] += p.recompute_seconds
            recompute_flops += p.recompute_flops
    totals: dict[Channel, int] = {}
    transfers: dict[str, list[tuple[int, int, float]]] = {}  # resource -> (release stage, deadline stage, seconds)
    for a, deadline in zip(schedule.actions, deadlines):
        s = problem.stage_of_moment[a.moment]
        if a.op is Op.OPTIMIZER_STEP:
            params = schedule.layout.chunks[a.chunk].used_elements
            if a.dst is Tier.HOST:
                cpu_opt[s] += optimizer_seconds(hw, Tier.HOST, params)
            else:
                device_opt[s] += optimizer_seconds(hw, Tier.DEVICE, params)
            continue
        for ch in action_channels(a):
            totals[ch] = totals.get(ch, 0) + a.bytes
            seconds = transfer_seconds(hw, ch, a.bytes)
            if not math.isfinite(seconds):
                raise InfeasibleError(f"moment {a.moment}: {a.op.value} moves {a.bytes} bytes over {ch.value}, which "
                                      f"hardware {hw.name!r} does not have (no SSD, or one GPU); keep data off that path")
            resource = "NVME" if ch in (Channel.NVME_READ, Channel.NVME_WRITE) else ch.value
            transfers.setdefault(resource, []).append((s, max(s, problem.stage_of_moment[deadline]), seconds))
    for i, sec in enumerate(cpu_opt):
        if sec > 0:  # CPU Adam is a FIFO too: what a stage cannot hide runs on in later stages
            transfers.setdefault(Channel.CPU_OPTIMIZER.value, []).append((i, n_stages - 1, sec))
    # every resource works while the stage lasts, whichever resource makes it last: fill each one into
    # the stage lengths of the previous pass (the first pass: the device's work alone)
    work = [base[i] + device_opt[i] for i in range(n_stages)]
    seconds = list(work)
    for _ in range(_PASSES):
        room, seconds = seconds, list(work)
        for resource, items in sorted(transfers.items()):
            for i, busy in enumerate(_fifo_stage_seconds(items, room)):
                seconds[i] = max(seconds[i], busy)
    out = tuple(Stage(id=st.id, name=st.name, phase=st.phase, block=st.block, first_moment=st.first_moment,
                      last_moment=st.last_moment, predicted_seconds=seconds[st.id]) for st in stages)
    busy = {ch: transfer_seconds(hw, ch, nbytes) for ch, nbytes in totals.items()}
    busy[Channel.COMPUTE] = sum(base) + sum(device_opt)
    busy[Channel.CPU_OPTIMIZER] = sum(cpu_opt)
    prediction = Prediction(
        iteration_seconds=sum(seconds),
        flops=problem.model_flops + recompute_flops,
        bytes_per_channel={ch: int(v) for ch, v in sorted(totals.items())},
        busy_seconds_per_channel=dict(sorted(busy.items())),
        peak_bytes_per_tier=replay.peak_bytes_per_tier,
    )
    return out, prediction


_PASSES = 3  # stage lengths settle in two or three passes


def _fifo_stage_seconds(items: list[tuple[int, int, float]], room: Sequence[float]) -> list[float]:
    """Busy seconds of one channel per stage. A channel serves its transfers in the order they are
    issued (a FIFO, like the executor's streams and the simulator), in the time each stage lasts;
    when a transfer is due (its deadline stage) it and everything queued before it must finish in
    that stage, which lengthens it."""
    by_release: dict[int, list[tuple[int, float]]] = {}
    for release, deadline, sec in items:
        by_release.setdefault(release, []).append((deadline, sec))
    queue: deque[list[float]] = deque()  # [deadline, remaining seconds], in issue order
    out = [0.0] * len(room)
    for s in range(len(room)):
        queue.extend([deadline, sec] for deadline, sec in by_release.get(s, ()))
        due = max((i for i, item in enumerate(queue) if item[0] <= s), default=-1)
        used = 0.0
        for _ in range(due + 1):  # forced: what is due and what is queued ahead of it
            used += queue.popleft()[1]
        while queue and used < room[s]:
            head = queue[0]
            take = min(head[1], room[s] - used)
            head[1] -= take
            used += take
            if head[1] <= 0.0:
                queue.popleft()
        out[s] = used
    return out


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
    )


def uniform_decisions(problem: Problem, layout: ChunkLayout, *, policy: str = "tide",
                      os_tier: Tier = Tier.HOST, optimizer_tier: Tier = Tier.HOST,
                      activation_mode: ActivationMode = ActivationMode.KEEP,
                      param_budget: int | Sequence[int] | None = None,
                      persistent_chunks: Iterable[int] = (), optimizer_overlap: bool = True, prefetch: bool = True,
                      eviction: EvictionRule = EvictionRule.BELADY_CLEAN_FIRST,
                      param_home: Tier = Tier.HOST, notes: Sequence[str] = ()) -> Decisions:
    """Decisions with one choice for every chunk and block (tests, baselines, a starting point).

    `param_budget` None: the most the DEVICE allows per moment (`param_budget_bytes`); an int: that
    many bytes at every moment (capped by what the DEVICE allows).
    """
    plans = tuple(ChunkPlan(chunk=c.id, os_tier=os_tier, optimizer_tier=optimizer_tier) for c in layout.chunks)
    modes = (activation_mode,) * len(problem.blocks)
    allowed = param_budget_bytes(problem, layout, plans, modes)
    if param_budget is None:
        budget = allowed
    elif isinstance(param_budget, int):
        budget = tuple(min(param_budget, a) for a in allowed)
    else:
        budget = tuple(int(b) for b in param_budget)
    return Decisions(
        policy=policy, layout=layout, chunk_plans=plans, activation_modes=modes, param_device_budget_bytes=budget,
        persistent_chunks=frozenset(persistent_chunks), optimizer_overlap=optimizer_overlap, prefetch=prefetch,
        eviction=eviction, notes=tuple(notes),
        param_home_tiers=(param_home,) * len(layout.chunks) if param_home is not Tier.HOST else (),
    )


__all__ = [
    "Decisions", "EvictionRule", "ReplayError", "Reservation", "ResidencyReplay", "SolverStats",
    "activation_moments", "materialize", "non_model_curve", "os_device_bytes", "param_budget_bytes",
    "replay_residency", "uniform_decisions",
]
