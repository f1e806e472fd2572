"""The DEVICE as a cache of PARAM and GRAD entries, tick by tick: which entries a tick's work needs,
the demand pass that makes room by the eviction rule, the trim to each interval's last use, and
the prefetch at the first harmless opportunity (steps 1-4 of `planner.materialize`'s note).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from planner.costmodel import channel_bytes_per_s, pcie_time_rows
from planner.decisions import (
    Decisions,
    EvictionRule,
    activation_moments,
    activation_offloads,
    non_model_curve,
    offload_landing_moments,
    os_device_bytes,
)
from planner.errors import InfeasibleError
from planner.problem import Problem
from schemas.schedule import ActivationMode, Channel, ChunkList, HostStaging, Tier
from schemas.trace import Phase


PARAM_ENTRY, GRAD_ENTRY = 0, 1
NEVER = 1 << 40  # next use of an entry that is not used again


@dataclass(slots=True)
class CacheInterval:
    """One stay of an entry on DEVICE: [start, end) in ticks."""

    entry: int
    start: int
    first_use: int
    last_use: int
    end: int = -1  # -1: still resident at the end of the pass
    allocate: bool = False  # starts with ALLOCATE (a GRAD's first use), not a copy
    write_back: bool = False  # dirty when it ends: copy down before the EVICT
    pinned: bool = False  # a persistent PARAM: on DEVICE for the whole iteration
    initial: bool = False  # on DEVICE when the iteration starts (a wrap-kept PARAM): no copy brings it
    to_end: bool = False  # a wrap-kept PARAM after its last use: on DEVICE until the iteration ends


@dataclass(slots=True)
class CachePlan:
    """Everything the passes share, in integer ids."""

    problem: Problem
    decisions: Decisions
    ws: int
    n_comm_groups: int
    comm_group_chunks: list[range]
    trainable_chunks: list[list[int]]  # per comm group: chunks holding trainable params
    entry_bytes: np.ndarray  # per entry (2 g + kind): DEVICE bytes of the whole comm group
    local_grad_bytes: np.ndarray  # per comm group: a rank's GRAD bytes after the reduce-scatter (its own chunk)
    chunk_bytes: dict[ChunkList, list[int]]
    persistent: list[bool]  # per comm group
    wrap_kept: list[bool]  # per comm group: Note [PARAM kept across the iteration's end]
    optimizer_tier: list[Tier]  # per comm group
    os_tier: list[Tier]  # per chunk
    home: list[Tier]  # per chunk: HOST or NVME home of a non-persistent PARAM
    # per comm group: its grads live in its PARAM entry's slot (every chunk's ChunkPlan.grad_in_param_slot,
    # PatrickStar PS.2): its PARAM and GRAD entries on DEVICE together take the larger one's bytes
    slotted: list[bool] = field(default_factory=list)
    tick_moment: list[int] = field(default_factory=list)
    tick_budget: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    needs: list[list[int]] = field(default_factory=list)  # per tick: entries needed on DEVICE
    first_tick: dict[int, int] = field(default_factory=dict)  # moment -> its first tick
    device_step_tick: dict[int, int] = field(default_factory=dict)  # comm group -> tick of its DEVICE step
    host_step_tick: dict[int, int] = field(default_factory=dict)  # comm group -> tick of its HOST step
    grad_first_tick: dict[int, int] = field(default_factory=dict)  # comm group -> first backward use
    grad_final_tick: dict[int, int] = field(default_factory=dict)  # comm group -> tick after its last backward use
    # per-bucket reduce-scatter (Decisions.reduce_scatter_buckets, ws > 1): trainable chunk of such a comm group ->
    # tick after its last backward use, where its bucket is reduce-scattered; the others' at `grad_final_tick`
    chunk_final_tick: dict[int, int] = field(default_factory=dict)


def cache_plan(problem: Problem, d: Decisions) -> CachePlan:
    layout, ws = d.layout, 1 if d.replicated else problem.world_size  # replicated (DDP): a chunk is its own comm group
    n_chunks = len(layout.chunks)
    n_comm_groups = math.ceil(n_chunks / ws)
    comm_group_chunks = [range(g * ws, min((g + 1) * ws, n_chunks)) for g in range(n_comm_groups)]
    trainable = [set() for _ in range(n_chunks)]
    chunk_of: dict[int, int] = {}
    for slot in layout.tensors:
        chunk_of[slot.tensor] = slot.chunk
        if slot.trainable:
            trainable[slot.chunk].add(slot.tensor)
    chunk_bytes = {x: [c.elements * problem.list_itemsize(x) for c in layout.chunks] for x in problem.lists}
    pbytes = chunk_bytes[ChunkList.PARAM]
    entry_bytes = np.zeros(2 * n_comm_groups, dtype=np.int64)
    for g, chunks in enumerate(comm_group_chunks):
        entry_bytes[2 * g + PARAM_ENTRY] = sum(pbytes[c] for c in chunks)
        entry_bytes[2 * g + GRAD_ENTRY] = sum(pbytes[c] for c in chunks if trainable[c])
    # after the reduce-scatter a rank keeps the reduced grads of the chunk it owns only (PatrickStar §7:
    # "each process only keeps the gradient of its own chunk"); the busiest rank holds the biggest one
    local_grad_bytes = np.array([max((pbytes[c] for c in chunks if trainable[c]), default=0) if ws > 1
                                 else int(entry_bytes[2 * g + GRAD_ENTRY]) for g, chunks in enumerate(comm_group_chunks)],
                                dtype=np.int64)
    persistent = [any(c in d.persistent_chunks for c in chunks) for chunks in comm_group_chunks]
    home = list(d.param_home_tiers) or [Tier.HOST] * n_chunks
    plan = CachePlan(
        problem=problem, decisions=d, ws=ws, n_comm_groups=n_comm_groups, comm_group_chunks=comm_group_chunks,
        trainable_chunks=[[c for c in chunks if trainable[c]] for chunks in comm_group_chunks],
        entry_bytes=entry_bytes, local_grad_bytes=local_grad_bytes, chunk_bytes=chunk_bytes, persistent=persistent,
        wrap_kept=[any(c in d.wrap_kept_chunks for c in chunks) for chunks in comm_group_chunks],
        optimizer_tier=[d.chunk_plans[chunks[0]].optimizer_tier for chunks in comm_group_chunks],
        os_tier=[p.os_tier for p in d.chunk_plans], home=home,
        slotted=[all(d.chunk_plans[c].grad_in_param_slot for c in chunks) for chunks in comm_group_chunks],
    )
    _ticks(plan, chunk_of, trainable)
    return plan


def _ticks(plan: CachePlan, chunk_of: dict[int, int], trainable: list[set[int]]) -> None:
    """One tick per forward/backward moment; the OPTIMIZER moment gets one more per DEVICE-stepped comm group."""
    problem, ws = plan.problem, plan.ws
    opt_moment = problem.optimizer_moment
    budgets = plan.decisions.param_device_budget_bytes
    grad_ticks: dict[int, list[int]] = {}
    chunk_last: dict[int, int] = {}
    buckets = plan.decisions.reduce_scatter_buckets if ws > 1 else frozenset()
    for m in problem.moments:
        plan.first_tick[m.id] = len(plan.tick_moment)
        needs: list[int] = []
        if m.phase is not Phase.OPTIMIZER:
            comm_groups = sorted({chunk_of[t] // ws for t in m.tensors if t in chunk_of})
            needs = [2 * g + PARAM_ENTRY for g in comm_groups]
            if m.phase is Phase.BACKWARD:
                for g in sorted({chunk_of[t] // ws for t in m.tensors if t in chunk_of and t in trainable[chunk_of[t]]}):
                    needs.append(2 * g + GRAD_ENTRY)
                    grad_ticks.setdefault(g, []).append(len(plan.tick_moment))
                if buckets:
                    for t in m.tensors:
                        if t in chunk_of and t in trainable[chunk_of[t]] and chunk_of[t] // ws in buckets:
                            chunk_last[chunk_of[t]] = len(plan.tick_moment)
        plan.tick_moment.append(m.id)
        plan.needs.append(needs)
        if m.id == opt_moment:
            _optimizer_ticks(plan, grad_ticks, budgets)
    for g, ticks in grad_ticks.items():
        plan.grad_first_tick[g] = ticks[0]
        plan.grad_final_tick[g] = ticks[-1] + 1
    if buckets:  # a trainable chunk no backward moment writes (zero grads) goes with its group's last bucket
        for g, ticks in grad_ticks.items():
            for c in plan.trainable_chunks[g] if g in buckets else ():
                chunk_last.setdefault(c, ticks[-1])
        plan.chunk_final_tick = {c: tick + 1 for c, tick in sorted(chunk_last.items())}
    plan.tick_budget = np.array([budgets[m] for m in plan.tick_moment], dtype=np.int64)


def _optimizer_ticks(plan: CachePlan, grad_ticks: dict[int, list[int]], budgets: Sequence[int]) -> None:
    """DEVICE steps stream through the budget, most recently final grads first (they are still
    on DEVICE); HOST steps run at the OPTIMIZER moment's first tick unless they overlap backward."""
    opt_moment = plan.problem.optimizer_moment
    base = len(plan.tick_moment) - 1
    stepped = [g for g in range(plan.n_comm_groups) if plan.trainable_chunks[g]]
    device = [g for g in stepped if plan.optimizer_tier[g] is Tier.DEVICE]
    device.sort(key=lambda g: (-grad_ticks[g][-1] if g in grad_ticks else 1, g))
    for g in stepped:
        if plan.optimizer_tier[g] is Tier.HOST:
            overlap = plan.decisions.optimizer_overlap and g in grad_ticks
            plan.host_step_tick[g] = grad_ticks[g][-1] + 1 if overlap else base
    early = _backward_device_steps(plan, grad_ticks, device, base)
    for g in device:
        if g in early:
            continue
        plan.device_step_tick[g] = len(plan.tick_moment)
        plan.tick_moment.append(opt_moment)
        plan.needs.append([2 * g + PARAM_ENTRY, 2 * g + GRAD_ENTRY])


# Note [DEVICE steps in backward]
# With several ranks a DEVICE-stepped comm group used to wait for the OPTIMIZER moment: its owner's reduced
# grads stayed on DEVICE through the rest of backward, and after backward the GPU Adam steps of every such
# group ran one after the other, each sharded one followed by the D2H write-back of its updated PARAM chunk
# (PatrickStar's 4B on 8 x V100, tide's MIP plan: 85 ms after the last backward compute, 2.6% of the
# iteration; bench/RESULTS.md "v18 (session 6)"). A chunk's Adam update needs its own final grads and
# nothing else unless the grads are clipped by their global norm or checked for fp16 overflow first; that
# is the contract `optimizer_overlap` already stands for (the CPU steps overlapped with backward, Fuyou
# §4.3; the executor refuses such a schedule with clipping or fp16 loss scaling, executor/attach.py
# `check_schedule_supported`). PyTorch fuses the optimizer step into backward the same way
# (`torch.distributed.optim._apply_optimizer_in_backward`, used with FSDP; the tutorial "How to save memory
# by fusing the optimizer step into the backward pass", `register_post_accumulate_grad_hook`). So with
# `Decisions.device_steps_in_backward` (several ranks, overlap on) a comm group whose OS lives on DEVICE
# (nothing to stream) is stepped in backward: its step needs its PARAM and GRAD entries at the first
# backward tick whose estimated start is at least its reduce-scatter's seconds after the tick that issues
# the reduce-scatter (estimated from the moments' compute plus recompute; `Hardware.collective_seconds`),
# so the GPU kernel does not hold the compute stream waiting for the collective (the simulator queues a
# DEVICE step on COMPUTE once its inputs are ready; the executor waits for the reduce-scatter before the
# step), and whose moment has work: a sharded group's updated chunk is written back right after the step
# (planner/emit.py) and its EVICT at the next tick finds the copy landed (an EVICT whose copy still reads
# the bytes holds the allocations after it, Note [simulator evictions] in planner/sim_actions.py).
# Groups finishing too late for that, and groups with streamed OS, keep their OPTIMIZER-moment tick.
# The cost: the PARAM entry stays on DEVICE until the step (the reduce-scatter's seconds), the step's
# compute moves into backward; the gain: the write-back of a sharded group's updated chunk and the GPU
# Adam steps overlap backward, and the local grads leave DEVICE at the step.
def _backward_device_steps(plan: CachePlan, grad_ticks: dict[int, list[int]], device: list[int], base: int) -> set[int]:
    """Comm groups stepped on DEVICE during backward (Note [DEVICE steps in backward]); adds their step
    ticks' needs and `device_step_tick`."""
    problem, d = plan.problem, plan.decisions
    if not (d.device_steps_in_backward and d.optimizer_overlap and plan.ws > 1):
        return set()
    extra = [0.0] * len(problem.moments)
    for b, mode in enumerate(d.activation_modes):
        first = problem.blocks[b].backward_moments[0]
        if mode is ActivationMode.RECOMPUTE and first >= 0:
            extra[first] += problem.blocks[b].recompute_seconds
    start, work, t = [], [], 0.0  # estimated start and work seconds of each tick before the OPTIMIZER moment
    for tick in range(base):
        start.append(t)
        m = plan.tick_moment[tick]
        work.append(problem.moments[m].compute_seconds + extra[m])
        t += work[-1]
    hw = problem.hardware
    early: set[int] = set()
    for g in device:
        if g not in grad_ticks or any(plan.os_tier[c] is not Tier.DEVICE for c in plan.trainable_chunks[g]):
            continue
        issued = grad_ticks[g][-1] + 1  # the reduce-scatter's tick (`grad_final_tick`)
        per_rank = (plan.ws - 1) * max(plan.chunk_bytes[ChunkList.GRAD][c] for c in plan.comm_group_chunks[g])
        landed = start[issued] + hw.collective_seconds(per_rank) if issued < base else math.inf
        # a tick with work: the write-back of the updated chunk, issued after the step, runs beside it
        tick = next((k for k in range(issued + 1, base) if start[k] >= landed and work[k] > 0), None)
        if tick is None:
            continue
        early.add(g)
        plan.device_step_tick[g] = tick
        plan.needs[tick] = [*plan.needs[tick], 2 * g + PARAM_ENTRY, 2 * g + GRAD_ENTRY]
    return early


def scattered_bytes(plan: CachePlan, g: int) -> int:
    """DEVICE bytes a rank frees when comm group g's grads are reduce-scattered (Note [materialize
    ranks]): the other ranks' chunks of the GRAD entry. 0 with one rank (nothing is scattered)."""
    return int(plan.entry_bytes[2 * g + GRAD_ENTRY] - plan.local_grad_bytes[g]) if plan.ws > 1 else 0


# Note [reduce-scatter per bucket]
# For the comm groups in Decisions.reduce_scatter_buckets the grads are reduce-scattered bucket by bucket as
# backward makes them final (ZeRO-3: DeepSpeed stage3.py `__reduce_and_partition_ipg_grads`, issued when
# the `reduce_bucket_size` bucket fills), not once after the group's last backward use (PatrickStar §7).
# A bucket is the trainable chunks of the group whose last backward use is one moment: a chunk is what a
# rank owns and what the executor allocates and frees (one GRAD payload per chunk), so each chunk is
# reduced into its owner's copy (a reduce per chunk, NCCL's ring reduce: every rank sends the chunk's
# bytes once, nccl-tests doc/PERFORMANCE.md busBw = algBw) and leaves the other ranks' DEVICE as soon as
# its bucket lands. The GRAD entry is still allocated whole at the group's first backward use, so a rank
# holds, at a tick: the group's trainable chunks not final yet, plus its own reduced chunk among the
# final ones (the busiest rank: the largest of them); from the group's last bucket on, its own chunk only
# (= `local_grad_bytes`, what the per-group reduce-scatter leaves). The cost: P per chunk on INTER_GPU
# where the group's reduce-scatter sends (p-1)/p of P per chunk, and one collective call per chunk.


def bytes_at(plan: CachePlan, e: int, tick: int) -> int:
    """DEVICE bytes of entry e at `tick`: a GRAD entry shrinks to the local chunk from its reduce-scatter on
    (per bucket: chunk by chunk, Note [reduce-scatter per bucket])."""
    if e & 1 == GRAD_ENTRY and plan.ws > 1:
        g = e >> 1
        if tick >= plan.grad_final_tick.get(g, 1 << 62):
            return int(plan.local_grad_bytes[g])
        if g in plan.decisions.reduce_scatter_buckets:
            pbytes = plan.chunk_bytes[ChunkList.PARAM]
            final = [pbytes[c] for c in plan.trainable_chunks[g] if plan.chunk_final_tick.get(c, 1 << 62) <= tick]
            if final:
                return int(plan.entry_bytes[e]) - sum(final) + max(final)
    return int(plan.entry_bytes[e])


def grad_shrinks(plan: CachePlan) -> dict[int, list[int]]:
    """Tick -> comm groups whose GRAD entry shrinks there (a reduce-scatter frees other ranks' chunks)."""
    out: dict[int, list[int]] = {}
    if plan.ws <= 1:
        return out
    for g, tick in plan.grad_final_tick.items():
        out.setdefault(tick, []).append(g)
    for c, tick in plan.chunk_final_tick.items():
        g = c // plan.ws
        if tick < plan.grad_final_tick.get(g, -1) and g not in out.setdefault(tick, []):
            out[tick].append(g)
    return {tick: sorted(gs) for tick, gs in sorted(out.items())}


def group_bytes(plan: CachePlan, g: int, entries, tick: int) -> int:
    """DEVICE bytes of comm group g's entries among `entries` at `tick`: their sum, or for a slotted group
    (its grads in its PARAM's slot, PS.2) the larger one's (the replay's and the simulator's rule)."""
    sizes = [bytes_at(plan, e, tick) for e in (2 * g + PARAM_ENTRY, 2 * g + GRAD_ENTRY) if e in entries]
    return (max(sizes) if plan.slotted[g] else sum(sizes)) if sizes else 0


def added_bytes(plan: CachePlan, resident, new: Sequence[int], tick: int) -> int:
    """DEVICE bytes that entries `new` (not resident) add to the `resident` ones at `tick`."""
    total = 0
    for g in sorted({e >> 1 for e in new}):
        if not plan.slotted[g]:
            total += sum(bytes_at(plan, e, tick) for e in new if e >> 1 == g)
            continue
        both = {e for e in (2 * g, 2 * g + 1) if e in resident} | {e for e in new if e >> 1 == g}
        total += group_bytes(plan, g, both, tick) - group_bytes(plan, g, resident, tick)
    return total


def _needed_bytes(plan: CachePlan, needs: Sequence[int], tick: int) -> int:
    """DEVICE bytes of a tick's entries beyond the pinned PARAMs (a slotted group's GRAD in its PARAM's slot)."""
    total = 0
    for g in sorted({e >> 1 for e in needs}):
        mine = {e for e in needs if e >> 1 == g}
        if plan.persistent[g] and 2 * g + PARAM_ENTRY in mine:  # the pinned PARAM is counted already
            total += group_bytes(plan, g, mine, tick) - int(plan.entry_bytes[2 * g + PARAM_ENTRY])
        else:
            total += group_bytes(plan, g, mine, tick)
    return total


def check_budget(plan: CachePlan) -> None:
    """The entries a tick needs (and the pinned ones) must fit in its budget."""
    pinned = sum(int(plan.entry_bytes[2 * g]) for g in range(plan.n_comm_groups) if plan.persistent[g])
    worst = None
    for tick, needs in enumerate(plan.needs):
        need = pinned + _needed_bytes(plan, needs, tick)
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
        pinned + _needed_bytes(plan, needs, t) + int(curve[plan.tick_moment[t]]) + fixed
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


# Note [PARAM kept across the iteration's end]:
# The placement model keeps `keep` chunks of a class on DEVICE through each gap between two uses, the wrap
# gap too: from the last backward use, through the optimizer, to the next forward's first use, their CPU
# step's update uploaded again in place (`refresh`, priced on H2D in the wrap gap's stages); others arrive in
# that gap's stages after the optimizer. Materialize expresses both with `Decisions.wrap_kept_chunks` (the
# chunks the model has on DEVICE when the iteration ends): such a PARAM entry is on DEVICE when the iteration
# starts (an `initial` stay, no copy brings it; the demand pass may evict it before its first use, like any
# clean entry), and after its last use its next use is the iteration's end (Belady evicts it after every
# entry used again in this iteration). Still resident at the end, it stays (a `to_end` stay, not trimmed): a
# HOST step uploads its update again (`planner.emit._host_step`, as a persistent chunk's), a DEVICE step with
# streamed OS, its last use, writes it home (`planner.emit._kept_param_write_back`). Evicted, it is fetched
# again once every other copy of the iteration is issued. So the iteration ends where it began (the steady
# state). Without it every such chunk was fetched again at the forward's start: on GPT-3 175B x
# a100-80g-12ssd ~60 chunks (72 GB) queued on H2D ahead of the first activation offload, which then waited
# 2.5 s for the link's both-ways facets (Note [two-way links in the simulator]) and started the D2H backlog
# of its forward (bench/RESULTS.md, session 18). Where the DEVICE cannot hold them at the end, materialize
# drops them (`planner.materialize._materialize_replayed`).


def demand_pass(plan: CachePlan) -> list[CacheInterval]:
    """Fetch on demand, evict by the rule: every entry's stays on DEVICE as tick intervals."""
    n_ticks = len(plan.tick_moment)
    uses: dict[int, list[int]] = {}
    for tick, needs in enumerate(plan.needs):
        for e in needs:
            uses.setdefault(e, []).append(tick)
    ptr = dict.fromkeys(uses, 0)
    evictable = {e: not (e & 1 == GRAD_ENTRY and plan.ws > 1) for e in uses}  # see emit_actions: grads wait for the reduce
    victims = _Victims(plan.decisions.eviction)
    resident: dict[int, CacheInterval] = {}
    intervals: list[CacheInterval] = []
    allocated: set[int] = set()
    occupied = 0
    for g in range(plan.n_comm_groups):
        if plan.persistent[g]:
            e = 2 * g + PARAM_ENTRY
            iv = CacheInterval(entry=e, start=0, first_use=-1, last_use=-1, pinned=True)
            resident[e] = iv
            intervals.append(iv)
            occupied += int(plan.entry_bytes[e])
    dirty_param: set[int] = set()

    def next_use(e: int) -> int:
        i = ptr[e]
        return uses[e][i] if i < len(uses[e]) else NEVER

    for g in range(plan.n_comm_groups):  # Note [PARAM kept across the iteration's end]
        e = 2 * g + PARAM_ENTRY
        if plan.wrap_kept[g] and e in uses:
            resident[e] = iv = CacheInterval(entry=e, start=0, first_use=-1, last_use=-1, initial=True)
            intervals.append(iv)
            occupied += int(plan.entry_bytes[e])
            victims.push(e, next_use=next_use(e), last_use=-1, dirty=False)

    scatters = grad_shrinks(plan)  # tick -> comm groups reduce-scattered there (emitted first in the tick)
    for tick in range(n_ticks):
        for g in scatters.get(tick, ()):
            if 2 * g + GRAD_ENTRY in resident:
                # (a slotted group's slot shrinks to the larger of PARAM and the local grads)
                held = [e for e in (2 * g, 2 * g + 1) if e in resident]
                occupied -= group_bytes(plan, g, held, tick - 1) - group_bytes(plan, g, held, tick)
        needs = plan.needs[tick]
        keep = set(needs)
        missing = [e for e in needs if e not in resident]
        room = occupied + added_bytes(plan, resident, missing, tick) - int(plan.tick_budget[tick])
        while room > 0:
            victim = victims.pop(keep)
            if victim is None:
                raise InfeasibleError(_stuck_message(plan, tick, room))
            size = added_bytes(plan, {e for e in resident if e != victim and e >> 1 == victim >> 1}, [victim], tick)
            iv = resident.pop(victim)
            iv.end = tick
            occupied -= size
            room -= size
        for e in missing:
            iv = CacheInterval(entry=e, start=tick, first_use=tick, last_use=tick, allocate=e & 1 == GRAD_ENTRY and e not in allocated)
            allocated.add(e)
            occupied += added_bytes(plan, resident, [e], tick)
            resident[e] = iv
            intervals.append(iv)
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
            if kind == PARAM_ENTRY and plan.wrap_kept[g] and ptr[e] >= len(uses[e]):
                # its next use is the next iteration's (Note [PARAM kept across the iteration's end])
                victims.push(e, next_use=n_ticks, last_use=tick, dirty=dirty)
            elif not iv.pinned and (evictable[e] or ptr[e] >= len(uses[e])):
                victims.push(e, next_use=next_use(e), last_use=tick, dirty=dirty)
            else:
                victims.drop(e)
        # a GRAD written back after its last backward use goes with the trim; mark it dirty now
        for e in needs:
            if e & 1 == GRAD_ENTRY and ptr[e] >= len(uses[e]) and plan.device_step_tick.get(e >> 1) != tick:
                resident[e].write_back = True
        if plan.decisions.release_between_phases:
            occupied -= _release_at_phase_end(plan, tick, needs, resident, victims, next_use)
    for e, iv in resident.items():  # still there at the end (its stay holds its last use): to the end, not trimmed
        if e & 1 == PARAM_ENTRY and plan.wrap_kept[e >> 1]:
            iv.to_end = True
    return intervals


def _release_at_phase_end(plan: CachePlan, tick: int, needs: list[int], resident: dict[int, CacheInterval],
                          victims: _Victims, next_use) -> int:
    """End the stay of every needed PARAM entry whose next use is in another phase (or never):
    a sharded system releases a gathered comm group after its last use in forward and in backward."""
    phase = plan.problem.moments[plan.tick_moment[tick]].phase
    freed = 0
    for e in needs:
        if e & 1 != PARAM_ENTRY or plan.persistent[e >> 1] or e not in resident:
            continue
        nxt = next_use(e)
        if nxt < len(plan.tick_moment) and plan.problem.moments[plan.tick_moment[nxt]].phase is phase:
            continue
        freed += added_bytes(plan, {x for x in resident if x != e and x >> 1 == e >> 1}, [e], tick)
        iv = resident.pop(e)
        iv.end = tick + 1
        victims.drop(e)
    return freed


def _stuck_message(plan: CachePlan, tick: int, short: int) -> str:
    m = plan.problem.moments[plan.tick_moment[tick]]
    return (f"DEVICE budget too small at moment {m.id} ({m.phase.value.lower()} {m.kind.value} {m.module or '(root)'}) "
            f"under policy {plan.decisions.policy!r}: {short} bytes more than the PARAM budget there "
            f"({int(plan.tick_budget[tick])} bytes) are pinned on DEVICE (persistent chunks, and grads waiting for their "
            f"reduce-scatter); raise param_device_budget_bytes there by {short} bytes (the DEVICE has "
            f"{plan.problem.device_bytes}) or make fewer chunks persistent")


def trim_intervals(intervals: list[CacheInterval], n_ticks: int) -> None:
    """Each stay ends right after its last use (never before it: the use is inside)."""
    for iv in intervals:
        if iv.pinned or iv.to_end:
            iv.end = -1
            continue
        iv.end = iv.last_use + 1 if iv.end < 0 else min(iv.end, iv.last_use + 1)
        iv.end = min(iv.end, n_ticks)


# Note [idle grads]:
# The demand pass keeps a dirty GRAD on DEVICE between two of its uses as long as nothing needs its
# room at a demand tick, and the prefetch pass never evicts. A tied embedding's grad is used by the
# head's backward (the first backward moment) and by the embedding's (the last), and held in
# between: on GPT-3 175B x rtx4090-768g-12ssd its 1.2 GB left 947 MiB free at every backward block's
# peak for the next block's 1154 MiB PARAM chunks, so two of them were copied only after the peak
# and the next block waited, ~11 s of 124.8 s (bench/bench_stage_gap.py, 2026-11-24; with the spill
# one of the three still is, 970 MiB free: 119.3 s). When a gap of
# at least IDLE_GRAD_MIN_TICKS ticks has a tick where a PARAM fetch in the gap has less room than its
# bytes, the grad is written back after the use before the gap and fetched again for the use after
# it (prefetched like any fetch): one D2H and one H2D copy of its bytes, hidden in the gap or not, so
# `planner.materialize` replays the schedule both ways and keeps the faster (on a 8-layer toy trace
# with a tight budget the round trip cost 0.4%; on 175B x rtx4090 it saved 5.5 s).
IDLE_GRAD_MIN_TICKS = 8  # a round trip of one chunk needs a few moments of work to hide behind (tide choice)


def spill_idle_grads(plan: CachePlan, intervals: list[CacheInterval]) -> list[CacheInterval] | None:
    """New DEVICE stays with those of dirty GRADs split over long, crowded gaps between their uses
    (Note [idle grads]); None when no stay is split."""
    if plan.ws > 1:  # a GRAD waits on DEVICE for its reduce-scatter
        return None
    n_ticks = len(plan.tick_moment)
    uses: dict[int, list[int]] = {}
    for tick, needs in enumerate(plan.needs):
        for e in needs:
            if e & 1 == GRAD_ENTRY:
                uses.setdefault(e, []).append(tick)
    delta = np.zeros(n_ticks + 1, dtype=np.int64)
    fetch_bytes = np.zeros(n_ticks, dtype=np.int64)  # the largest PARAM fetch whose use is at a tick
    for iv in intervals:
        end = n_ticks if iv.end < 0 else iv.end
        delta[iv.start] += plan.entry_bytes[iv.entry]
        delta[end] -= plan.entry_bytes[iv.entry]
        if iv.entry & 1 == PARAM_ENTRY and not iv.pinned:
            fetch_bytes[iv.start] = max(fetch_bytes[iv.start], plan.entry_bytes[iv.entry])
    slack = plan.tick_budget - np.cumsum(delta[:-1])
    out: list[CacheInterval] = []
    split = False
    for iv in sorted(intervals, key=lambda x: (x.start, x.entry)):
        iv = replace(iv)  # the caller's intervals stay as they are
        e = iv.entry
        if e & 1 != GRAD_ENTRY or iv.pinned:
            out.append(iv)
            continue
        inside = [t for t in uses.get(e, ()) if iv.first_use <= t <= iv.last_use]
        size = int(plan.entry_bytes[e])
        for a, b in zip(inside, inside[1:]):
            if b - a < IDLE_GRAD_MIN_TICKS:
                continue
            need = int(fetch_bytes[a + 1:b].max(initial=0))
            if need == 0 or int(slack[a + 1:b].min()) >= need:
                continue  # every fetch in the gap fits beside the grad
            tail = CacheInterval(entry=e, start=b, first_use=b, last_use=iv.last_use, end=iv.end,
                                 write_back=iv.write_back)
            iv.last_use, iv.end, iv.write_back = a, a + 1, True
            slack[a + 1:b] += size
            out.append(iv)
            iv = tail
            split = True
        out.append(iv)
    return out if split else None


def estimated_tick_seconds(plan: CachePlan) -> list[float]:
    """When each tick starts if nothing waits: the cumulative compute of the moments (plus the
    recompute of RECOMPUTE blocks at their first backward moment), then in the OPTIMIZER moment one
    DEVICE step after the other at the placement model's price of its copies: the PCIe link's
    both-ways rows (`costmodel.pcie_time_rows`, what the simulator charges a link moving both ways)
    or its SSD traffic, whichever is longer. Paces the SSDs (`planner.emit`)
    and dates the write-backs in flight (`write_back_holds`).

    (At each direction's rate alone, the price before, GPT-3 175B x rtx4090-768g-12ssd's 104 NVMe-
    streamed steps were estimated at 0.38 s each against 0.56 s on the rows and ~0.63 s replayed:
    the CPU steps the estimate placed after the last DEVICE step were issued there, their OS
    write-backs queued behind the last step's on the SSDs, which wrote alone for 7.3 s after the
    link went idle; 128.77 -> 122.19 s, bench/bench_stage_gap.py, 2026-11-24.)"""
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
    # (DEVICE steps in backward run beside backward's compute: not a lag of the OPTIMIZER moment's ticks)
    opt_moment = problem.optimizer_moment
    step_at = {tick: g for g, tick in plan.device_step_tick.items() if plan.tick_moment[tick] == opt_moment}
    pcie = pcie_time_rows(hw)
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
        lag += max(max(a * up + b * down for a, b in pcie), nvme)
    return out



# Note [write-backs in flight]:
# A dirty entry's stay ends with its WRITE_BACK and EVICT (a GRAD going down to HOST for its CPU step
# or to the SSDs, a PARAM updated by its DEVICE step), and its DEVICE bytes stay until that copy lands
# (PyTorch's caching allocator: the copy records them on its stream; the simulator's rule, Note
# [simulator evictions] in planner/sim_actions.py), as offloaded activations do (Note [offloads in
# flight] in planner/decisions.py). The demand and trim passes free them at the stay's end; the
# prefetch pass then filled that room with the next PARAM prefetch, and the next work, whose own
# allocation needed the room, waited for the write-back: on GPT-3 175B x a100-80g-12ssd every backward
# block's work waited for the whole 3.6 GB grad write-back of the block before it (0.142 s at the D2H
# rate, 11.8 s in all, with D2H idle 40 of 52 s of backward and H2D 30 s: bench/bench_stage_gap.py
# --waits, 2026-11-24). So with `Decisions.hold_write_backs` the prefetch pass counts a written-back
# stay's bytes through the ticks estimated to start before its copy lands: ticks start at
# `estimated_tick_seconds` (no stalls: stalls only land copies earlier relative to the work), the
# write-backs and activation offloads leave DEVICE one after the other on the D2H FIFO (in the order
# emit issues them: a tick's activation offloads, then its ended stays by entry), each at the rate the
# hardware file gives a copy of its size while H2D runs too (`costmodel.channel_bytes_per_s(duplex=True)`:
# backward prefetches PARAM beside them; pageable where the policy stages there). Only the prefetch
# pass: a prefetch placed after the copy lands costs nothing where the link has idle time, while the
# demand pass's evictions would fetch again. Where the link has none (GPT-3 175B x rtx4090-768g-12ssd:
# per backward block ~0.35 s of PCIe rows against 0.375 s of compute) a prefetch held back arrives late
# and the work waits for it instead (130.88 -> 133.28 s held always). So each prefetch the held bytes
# push later (`_HeldRoom.choose`) is placed later only if the work would wait longer for the write-backs
# at the ticks it would crowd than the prefetch would arrive late (against the estimated tick starts) by
# waiting, both on the H2D FIFO estimate (fetches in the order placed, activation reloads at their tick,
# at the duplex rate); otherwise where it fits without them, and those ticks' work waits (then once: a
# later prefetch crowding the same tick costs nothing more). OPTIMIZER ticks are left out: their D2H
# traffic is the streamed steps' OS, which the tail's SSD or link time bounds (bench_stage_gap: forced).
# Measured on the best MIP plans of session 5 (replayed, one run each, 2026-11-24): 175B x a100 120.37 ->
# 115.53 s (backward waits 12.4 -> 0.9 s; the tail, bound by the SSDs, takes 7 s of it back), 256 blocks
# x a100 36.17 -> 32.83 s, 175B x rtx4090 130.88 -> 130.76 s, 13B x rtx4090 8.745 -> 8.736 s, 13B x
# a100 6.555 -> 6.570 s (its tail is CPU Adam's: backward 0.22 s shorter, the tail 0.23 s longer).
#
# Note [offloads behind prefetches]:
# On the PCIe link both directions share its rows (`costmodel.pcie_time_rows`; the simulator gives a
# two-way link's shared time to the copy placed first, Note [two-way links in the simulator] in
# planner/sim_actions.py): at full H2D rate the first row is full, so a D2H copy placed after a burst
# of prefetches lands only once that burst is done. The budget holds an offloaded block's activations
# until its offload is estimated to land beside H2D but not behind it (`offload_landing_moments`, Note
# [offloads in flight] in planner/decisions.py, fixed before any prefetch is placed). On GPT-3 13B x
# a100-80g-12ssd the prefetch pass issues 60 PARAM prefetches (12.6 GB, 0.49 s of H2D) at the first
# tick; the 0.08 GB offloads of the first blocks landed 0.47 s late and the fourth block's work waited
# 0.42 s for their bytes (bench_stage_gap --waits). So the prefetch pass runs twice: the first
# placement is replayed on an estimate (`_HeldRoom.replayed`: the H2D FIFO in the order placed, the
# activation reloads at their tick, each tick's work starting once its fetches and reloads arrived),
# which dates when H2D is done with the copies placed before each tick; the second placement holds each
# offload's bytes until it lands behind them (one D2H FIFO with the write-backs) and uses that estimated
# timeline for every date. Only the offloads wait behind the H2D backlog in this estimate: dating the
# backward's grad write-backs the same way (their H2D backlog is mostly the prefetches of the same
# blocks, which the rows share as they alternate) held them longer than they are held in the replay:
# 175B x rtx4090 132.30 s against 130.16 s, the others within 0.1 s.
# Measured on the same plans as above (one run each): 13B x a100 6.570 -> 6.155 s, 13B x rtx4090 8.736 ->
# 8.511 s, 175B x a100 115.53 -> 113.80 s, 175B x rtx4090 130.76 -> 130.16 s, 256 blocks 32.83 -> 32.47 s.
def write_back_holds(plan: CachePlan, intervals: Sequence[CacheInterval], est: Sequence[float] | None = None,
                     h2d_before: Sequence[float] | None = None,
                     offloads: dict[int, float] | None = None) -> list[tuple[CacheInterval, int, float]]:
    """Per written-back stay ending at a FORWARD/BACKWARD tick: the tick until which (exclusive) its
    DEVICE bytes are held after its end, and when its copy is estimated to land (Note [write-backs in
    flight]; `est`: `estimated_tick_seconds`); stays landing before their end tick starts are left out.
    `h2d_before`: per tick, when H2D is done with the copies issued before it (a D2H copy placed after
    them waits for them on the link's shared rows); `offloads`: filled with each offloaded block's landing."""
    problem, d = plan.problem, plan.decisions
    n_ticks = len(plan.tick_moment)
    est = estimated_tick_seconds(plan) if est is None else est
    hw = problem.hardware
    pageable = d.host_staging is HostStaging.PAGEABLE

    def seconds(nbytes: int, tier: Tier = Tier.HOST) -> float:
        rate = channel_bytes_per_s(hw, Channel.D2H, duplex=True, pageable=pageable, nbytes=nbytes)
        if tier is Tier.NVME:
            rate = min(rate, channel_bytes_per_s(hw, Channel.NVME_WRITE, nbytes=nbytes) or rate)
        return nbytes / rate if rate > 0 else 0.0

    queue: list[tuple[int, int, int, float, CacheInterval | None]] = []  # (tick, order, entry, copy seconds, stay)
    for fwd_last, b, nbytes, tier in activation_offloads(problem, d.activation_modes, d.checkpoint_tier):
        queue.append((plan.first_tick[fwd_last], 0, b, seconds(nbytes, tier), None))
    optimizer = problem.optimizer_moment
    for iv in intervals:
        if iv.pinned or not iv.write_back or not 0 <= iv.end < n_ticks or plan.tick_moment[iv.end] == optimizer:
            continue
        g = iv.entry >> 1
        lst = ChunkList.PARAM if iv.entry & 1 == PARAM_ENTRY else ChunkList.GRAD
        chunks = plan.comm_group_chunks[g] if lst is ChunkList.PARAM else plan.trainable_chunks[g]
        # one rank copies its own chunk of the comm group down (Note [materialize ranks]): the busiest one's
        copy = (max((seconds(plan.chunk_bytes[lst][c]) for c in chunks), default=0.0) if plan.ws > 1
                else sum(seconds(plan.chunk_bytes[lst][c]) for c in chunks))
        queue.append((iv.end, 1, iv.entry, copy, iv))
    next_start: dict[int, list[int]] = {}
    for iv in intervals:
        next_start.setdefault(iv.entry, []).append(iv.start)
    for starts in next_start.values():
        starts.sort()
    out: list[tuple[CacheInterval, int, float]] = []
    free_at = 0.0  # when D2H is done with the copies queued so far
    for tick, _, entry, copy, iv in sorted(queue, key=lambda x: x[:3]):
        # an offload waits behind the H2D copies placed before it (Note [offloads behind prefetches])
        gate = h2d_before[tick] if h2d_before is not None and iv is None else 0.0
        lands = max(est[tick], free_at, gate) + copy
        free_at = lands
        if iv is None:
            if offloads is not None:
                offloads[entry] = lands
            continue
        back = [t for t in next_start[entry] if t > iv.end]  # the entry's next stay counts it from its start
        stop = min(back[0] if back else n_ticks, n_ticks)
        t = iv.end
        while t < stop and est[t] < lands:
            t += 1
        if t > iv.end:
            out.append((iv, t, lands))
    return out


class _HeldRoom:
    """The prefetch pass's view of write-backs in flight (Note [write-backs in flight]): per tick the
    bytes still landing and how long that tick's work would wait for them, and an estimate of the H2D
    FIFO (PARAM and GRAD fetches in the order placed, activation reloads at their tick) to date each
    prefetch's arrival."""

    def __init__(self, plan: CachePlan, intervals: Sequence[CacheInterval],
                 replayed: tuple[list[float], list[float]] | None = None) -> None:
        n_ticks = len(plan.tick_moment)
        self.plan = plan
        self.est, h2d_before = replayed if replayed is not None else (estimated_tick_seconds(plan), None)
        self._est = np.array(self.est, dtype=np.float64)
        self._copy: dict[int, float] = {}
        self.pageable = plan.decisions.host_staging is HostStaging.PAGEABLE
        self.bytes = np.zeros(n_ticks + 1, dtype=np.int64)
        self.wait = np.zeros(n_ticks, dtype=np.float64)
        d, problem = plan.decisions, plan.problem
        offloads: dict[int, float] = {}
        for iv, until, lands in write_back_holds(plan, intervals, self.est, h2d_before, offloads):
            self._hold(bytes_at(plan, iv.entry, max(iv.start, iv.end - 1)), iv.end, until, lands)
        if h2d_before is not None:
            # the budget holds an offloaded block's bytes until the moment its offload was estimated to land
            # beside H2D alone (`offload_landing_moments`); behind the H2D copies placed before it, later
            landed = offload_landing_moments(problem, d.activation_modes, d.checkpoint_tier, d.moment_seconds_hint)
            for b, lands in sorted(offloads.items()):
                info, (_, reload, _) = problem.blocks[b], activation_moments(problem, b)
                t = first = plan.first_tick[landed.get(b, reload)]
                stop = plan.first_tick[reload]
                while t < stop and self.est[t] < lands:
                    t += 1
                nbytes = info.activation_bytes if d.activation_modes[b] is not ActivationMode.RECOMPUTE \
                    else min(info.input_bytes, info.activation_bytes)
                if t > first:
                    self._hold(nbytes, first, t, lands)
        self.bytes = np.cumsum(self.bytes[:-1])
        self.pageable = d.host_staging is HostStaging.PAGEABLE
        reloads: list[tuple[int, float]] = []
        reload_blocks: list[int] = []
        for b, mode in enumerate(d.activation_modes):
            _, reload, _ = activation_moments(problem, b)
            info = problem.blocks[b]
            if mode in (ActivationMode.SWAP_HOST, ActivationMode.SWAP_NVME):
                tier = Tier.HOST if mode is ActivationMode.SWAP_HOST else Tier.NVME
                reloads.append((plan.first_tick[reload], self._seconds(info.activation_bytes, tier)))
                reload_blocks.append(b)
            elif mode is ActivationMode.RECOMPUTE and d.checkpoint_tier is not None and reload >= 0:
                nbytes = min(info.input_bytes, info.activation_bytes)
                reloads.append((plan.first_tick[reload], self._seconds(nbytes, d.checkpoint_tier)))
                reload_blocks.append(b)
        order = sorted(range(len(reloads)), key=lambda k: reloads[k])
        self.reload_blocks = [reload_blocks[k] for k in order]
        self.reloads = [reloads[k] for k in order]
        self.next_reload = 0
        self.free_at = 0.0  # when H2D is done with the copies issued so far

    def _hold(self, nbytes: int, first: int, until: int, lands: float) -> None:
        self.bytes[first] += nbytes
        self.bytes[until] -= nbytes
        self.wait[first:until] = np.maximum(self.wait[first:until], lands - self._est[first:until])

    def replayed(self, intervals: Sequence[CacheInterval]) -> tuple[list[float], list[float]]:
        """Per tick of a placement (`intervals` placed): when its work is estimated to start, waiting for the
        fetches it uses and the reloads of its blocks on the H2D FIFO (the estimated ticks move by the
        waits), and when H2D is done with the copies issued at the ticks before it."""
        plan = self.plan
        n_ticks = len(plan.tick_moment)
        issued: list[list[tuple[int, float]]] = [[] for _ in range(n_ticks)]  # (first use, copy seconds)
        for iv in intervals:
            if not iv.pinned and not iv.allocate and not iv.initial and iv.start < n_ticks:
                issued[iv.start].append((iv.first_use, self.copy_seconds(iv.entry)))
        problem = plan.problem
        for (t, secs), b in zip(self.reloads, self.reload_blocks):
            issued[t].insert(0, (plan.first_tick[problem.blocks[b].backward_moments[0]], secs))
        needed_at = [0.0] * (n_ticks + 1)
        starts, before = [], []
        free, event = 0.0, 0.0
        for t in range(n_ticks):
            before.append(free)
            for use, secs in sorted(issued[t], key=lambda x: x[0]):
                free = max(free, event) + secs
                needed_at[use] = max(needed_at[use], free)
            work = max(event, needed_at[t])
            starts.append(work)
            event = work + ((self.est[t + 1] if t + 1 < n_ticks else self.est[t]) - self.est[t])
        return starts, before

    def _seconds(self, nbytes: int, tier: Tier = Tier.HOST) -> float:
        hw = self.plan.problem.hardware
        # at the duplex rate, or alone with `tail_prefetches_first` (Note [a tail's prefetches before its
        # write-backs] in planner/emit.py)
        duplex = not self.plan.decisions.tail_prefetches_first
        rate = channel_bytes_per_s(hw, Channel.H2D, duplex=duplex, pageable=self.pageable, nbytes=nbytes)
        if tier is Tier.NVME:
            rate = min(rate, channel_bytes_per_s(hw, Channel.NVME_READ, nbytes=nbytes) or rate)
        return nbytes / rate if rate > 0 else 0.0

    def copy_seconds(self, entry: int) -> float:
        found = self._copy.get(entry)
        if found is None:
            plan, g = self.plan, entry >> 1
            lst = ChunkList.PARAM if entry & 1 == PARAM_ENTRY else ChunkList.GRAD
            chunks = plan.comm_group_chunks[g] if lst is ChunkList.PARAM else plan.trainable_chunks[g]
            each = [self._seconds(plan.chunk_bytes[lst][c], plan.home[c] if lst is ChunkList.PARAM else Tier.HOST)
                    for c in chunks]
            # with several ranks each owner fetches its own chunk of the comm group (Note [materialize ranks])
            found = self._copy[entry] = (max(each, default=0.0) if plan.ws > 1 else sum(each))
        return found

    def _queue_until(self, tick: int) -> float:
        """H2D's estimated free time once the reloads issued up to `tick` are queued (not committed)."""
        free = self.free_at
        for t, secs in self.reloads[self.next_reload:]:
            if t > tick:
                break
            free = max(free, self.est[t]) + secs
        return free

    def arrival(self, entry: int, tick: int) -> float:
        return max(self.est[tick], self._queue_until(tick)) + self.copy_seconds(entry)

    def issue(self, entry: int, tick: int) -> None:
        while self.next_reload < len(self.reloads) and self.reloads[self.next_reload][0] <= tick:
            t, secs = self.reloads[self.next_reload]
            self.free_at = max(self.free_at, self.est[t]) + secs
            self.next_reload += 1
        self.free_at = max(self.free_at, self.est[tick]) + self.copy_seconds(entry)

    def choose(self, entry: int, use: int, early: int, held: int, slack: np.ndarray, size: int) -> int:
        """The start of a prefetch for `use` that fits the budget from `early`, and from `held` with the
        write-backs in flight counted: `held` unless placing it there makes it arrive later than the
        work at `early`..`held` would wait for the write-backs, by the estimates (the wait is counted once
        per tick: a tick whose work waits anyway costs nothing more)."""
        if held == early:
            return held
        late_held = max(0.0, self.arrival(entry, held) - self.est[use])
        late_early = max(0.0, self.arrival(entry, early) - self.est[use])
        ticks = early + np.flatnonzero(slack[early:held] - self.bytes[early:held] < size)
        if float(self.wait[ticks].sum()) + late_early >= late_held:
            return held
        self.wait[ticks] = 0.0  # those ticks' work waits for the copies in flight now
        return early


def prefetch_early(plan: CachePlan, intervals: list[CacheInterval]) -> None:
    """Move each fetch to the earliest tick from which it fits the budget until its use (Cao et al.)."""
    n_ticks = len(plan.tick_moment)
    shrink_ticks: dict[int, list[int]] = {}
    for tick, gs in grad_shrinks(plan).items():
        for g in gs:
            shrink_ticks.setdefault(g, []).append(tick)
    delta = np.zeros(n_ticks + 1, dtype=np.int64)
    for iv in intervals:
        end = n_ticks if iv.end < 0 else iv.end
        g = iv.entry >> 1
        if iv.entry & 1 == GRAD_ENTRY and plan.ws > 1:
            # the reduce-scatters inside the stay free the others' chunks; what is left leaves at its end
            delta[iv.start] += bytes_at(plan, iv.entry, iv.start)
            for tick in shrink_ticks.get(g, ()):
                if iv.start < tick < end:
                    delta[tick] -= bytes_at(plan, iv.entry, tick - 1) - bytes_at(plan, iv.entry, tick)
            delta[end] -= bytes_at(plan, iv.entry, max(iv.start, end - 1))
            continue
        delta[iv.start] += plan.entry_bytes[iv.entry]
        delta[end] -= plan.entry_bytes[iv.entry]
    occupied = np.cumsum(delta[:-1])
    slack = plan.tick_budget - occupied
    if not plan.decisions.hold_write_backs:
        _place_prefetches(plan, intervals, slack, None)
        return
    # Note [write-backs in flight]: a first placement dates the H2D copies, behind which the D2H copies wait
    first = [replace(iv) for iv in intervals]
    held = _HeldRoom(plan, intervals)
    _place_prefetches(plan, first, slack.copy(), held)
    _place_prefetches(plan, intervals, slack, _HeldRoom(plan, intervals, held.replayed(first)))


def _place_prefetches(plan: CachePlan, intervals: list[CacheInterval], slack: np.ndarray,
                      held: _HeldRoom | None) -> None:
    """`prefetch_early`'s placement, in order of need, given the slack of every tick (changed in place)."""
    n_ticks = len(plan.tick_moment)
    bucket = plan.decisions.prefetch_bucket_bytes
    ahead = np.zeros(n_ticks, dtype=np.int64)  # bytes fetched ahead of their use, per tick (with a bucket)
    previous_end: dict[int, int] = {}
    issued = 0  # copies are issued in the order they are needed: a channel is a FIFO, so a fetch for
    # later must never be queued ahead of one for sooner
    for iv in sorted(intervals, key=lambda x: (x.start, x.entry)):
        lower = previous_end.get(iv.entry, 0)
        previous_end[iv.entry] = n_ticks if iv.end < 0 else iv.end
        if iv.pinned or iv.allocate or iv.initial:
            continue
        lower = max(lower, issued)
        if iv.start <= lower:
            issued = max(issued, iv.start)
            if held is not None:
                held.issue(iv.entry, iv.start)
            continue
        size = plan.entry_bytes[iv.entry]
        window = slack[lower:iv.start]
        blocked = np.flatnonzero(window < size)
        if bucket is not None:
            blocked = np.union1d(blocked, _over_bucket(ahead[lower:iv.start], size, bucket))
        start = lower + (int(blocked[-1]) + 1 if blocked.size else 0)
        if held is not None and start < iv.start:
            later = np.flatnonzero(window - held.bytes[lower:iv.start] < size)
            start = held.choose(iv.entry, iv.start, start, max(start, lower + (int(later[-1]) + 1 if later.size else 0)),
                                slack, size)
            held.issue(iv.entry, start)
        elif held is not None:
            held.issue(iv.entry, iv.start)
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
