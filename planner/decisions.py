"""What a policy decides, and the DEVICE room it leaves PARAM and GRAD.

`Decisions` is what tide's solver and every baseline policy hand to `planner.materialize` (how much:
tiers, budgets, modes, rules); `param_budget_bytes` and its helpers say how much DEVICE the non-model
data, the activations and the DEVICE-resident optimizer state leave per moment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum

import numpy as np

from planner.costmodel import channel_bytes_per_s
from planner.problem import NO_MOMENTS, Problem
from schemas._base import frozen
from schemas.schedule import ActivationMode, Channel, ChunkLayout, ChunkPlan, HostStaging, SolverStatus, Tier
from schemas.trace import Phase


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
    # with `pace_optimizer_io`: emit the plan once more paced on its first replay's clock and keep the faster
    # replay (Note [pacing by the replay] in planner/materialize.py); False: paced on the estimate only (every
    # baseline policy and reference decision set: one emission each, as solve's CPU-time targets need)
    pace_on_replay: bool = False
    # PARAM chunks on DEVICE when the iteration starts and ends (Note [PARAM kept across the iteration's end] in
    # planner/device_cache.py): kept after their last use where the cache has room, else fetched again at the
    # end; a CPU step's update uploaded (tide: the placement's residency at the end of the optimizer stage)
    wrap_kept_chunks: frozenset[int] = frozenset()
    # -- what a real system needs (planner/policies/): defaults are tide's behaviour --
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
    # where the system's HOST copies live for DEVICE <-> HOST copies, carried into the schedule header
    # and priced from there: PINNED (tide; PatrickStar pins its CPU chunks, `patrickstar/core/chunk_data.py:153`
    # `pin_memory=(device.type == "cpu")`; Fuyou its buffers, Fuyou §5.5) or PAGEABLE (DeepSpeed and Gemini,
    # each policy citing its `pin_memory` default beside the line that sets it)
    host_staging: HostStaging = HostStaging.PINNED
    # a HOST step's NVMe OS goes back right after the step and the next step's reads wait for it
    # (DeepSpeed offload_optimizer pipeline_read/pipeline_write false); False: tide's delayed write-back
    serial_optimizer_swap: bool = False
    # with several ranks: reduce-scatter these comm groups' grads per bucket, a bucket being the chunks of a
    # group whose grads became final at one moment, instead of once after the group's last backward use
    # (PatrickStar §7). ZeRO-3 reduces per bucket as grads complete (DeepSpeed stage3.py
    # `__reduce_and_partition_ipg_grads`, `reduce_bucket_size` 5e8 elements); tide's bucket is chunk-aligned
    # because a chunk is the unit a rank owns and frees (Note [reduce-scatter per bucket] in planner/device_cache.py)
    reduce_scatter_buckets: frozenset[int] = frozenset()  # the comm groups reduce-scattered per bucket
    # final grads leave HOST for the SSDs at this many bytes per element and come back for the HOST step
    # (DeepSpeed's fp32 grads of NVMe sub-groups, `swap_out_gradients`); 0: they wait on HOST (tide)
    grad_swap_bytes_per_element: int = 0
    # final grads that cross to HOST (the GRAD chunk's copy) come back to DEVICE and cross again at this
    # many bytes per element (DeepSpeed ZeRO-3 `partition_grads`: fp16 partition into the CPU grad
    # buffer, `.to(device)`, `.float()` sent to the CPU fp32 grads or the swap buffers); 0: once (tide)
    grad_recopy_bytes_per_element: int = 0
    # a dirty GRAD idle on DEVICE for a long gap between two uses (the tied embedding's grad between
    # the head's backward and the embedding's) goes down to HOST and comes back before its next use
    # when keeping it would leave a PARAM prefetch in that gap no room (`device_cache.spill_idle_grads`);
    # False: it stays (every baseline policy: their grad movements are set by their own fields above)
    spill_idle_grads: bool = False
    # the prefetch pass counts a written-back stay's DEVICE bytes until its copy is estimated to land, and an
    # offloaded block's until it lands behind the prefetches placed before it (Notes [write-backs in flight]
    # and [offloads behind prefetches] in planner/device_cache.py: the caching allocator's rule; the budget
    # must be `param_budget_bytes(offload_in_flight=True)`'s); False: free at the stay's end, offloads as the
    # budget says (every baseline policy: what the system it imitates prefetches by)
    hold_write_backs: bool = False
    # with `hold_write_backs`: at a backward moment without compute (a block's tail) emit issues the prefetches
    # the next moment's work needs before the tail's write-backs, and the prefetch pass dates H2D copies at the
    # link's rate alone (Note [a tail's prefetches before its write-backs] in planner/emit.py; one rank); False:
    # a tick's ended stays first, then its starts (every baseline policy; `planner.solve` replays its fastest
    # MIP plan both ways)
    tail_prefetches_first: bool = False
    # with several ranks and `optimizer_overlap`: a DEVICE-stepped comm group whose OS lives on DEVICE is
    # stepped during backward once its reduce-scatter is estimated to have landed, instead of in the
    # OPTIMIZER moment (Note [DEVICE steps in backward] in planner/device_cache.py); False: the OPTIMIZER
    # moment (every baseline, and one rank)
    device_steps_in_backward: bool = False


@frozen
class SolverStats:
    """How good a solved placement is (goes into the schedule header)."""

    status: SolverStatus
    objective_seconds: float
    lower_bound_seconds: float
    gap: float


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
                    checkpoint_tier: Tier | None = None, *, offload_in_flight: bool = False,
                    moment_seconds: Sequence[float] = ()) -> np.ndarray:
    """DEVICE non-model bytes per moment under an activation plan (int64).

    The recorded curve keeps every block's activations; a SWAP block holds none on DEVICE from its
    offload to its reload, a RECOMPUTE block only its input until its backward starts (the
    simulator's memory model). `offload_in_flight`: an offloaded block's (or checkpoint's) DEVICE
    bytes stay until its copy is estimated to land (`offload_landing_moments`, Note [offloads in
    flight]); without it (what a lower bound may assume) they leave as the offload is issued.
    """
    curve = np.array([m.non_model_bytes for m in problem.moments], dtype=np.int64)
    landed = offload_landing_moments(problem, activation_modes, checkpoint_tier, moment_seconds) if offload_in_flight else {}
    for b, mode in enumerate(activation_modes):
        if mode is ActivationMode.KEEP:
            continue
        fwd_last, reload, bwd_first = activation_moments(problem, b)
        if fwd_last < 0:
            continue
        info = problem.blocks[b]
        off = min(landed.get(b, fwd_last), reload)  # the first moment whose work finds the offload landed
        if mode is ActivationMode.RECOMPUTE:
            curve[fwd_last:bwd_first] -= max(0, info.activation_bytes - info.input_bytes)
            if checkpoint_tier is not None:  # the input is off DEVICE until its reload
                curve[off:reload] -= min(info.input_bytes, info.activation_bytes)
        else:
            curve[off:reload] -= info.activation_bytes
    return np.maximum(curve, 0)


def activation_offloads(problem: Problem, activation_modes: Sequence[ActivationMode],
                        checkpoint_tier: Tier | None = None) -> list[tuple[int, int, int, Tier]]:
    """(offload moment, block, bytes, tier) of each block whose forward ends with a D2H offload: its
    activations when swapped, its checkpointed input when recomputed with a checkpoint tier."""
    out: list[tuple[int, int, int, Tier]] = []
    for b, mode in enumerate(activation_modes):
        fwd_last, reload, _ = activation_moments(problem, b)
        if fwd_last < 0:
            continue
        info = problem.blocks[b]
        if mode in (ActivationMode.SWAP_HOST, ActivationMode.SWAP_NVME):
            tier = Tier.HOST if mode is ActivationMode.SWAP_HOST else Tier.NVME
            out.append((fwd_last, b, info.activation_bytes, tier))
        elif mode is ActivationMode.RECOMPUTE and checkpoint_tier is not None and reload > fwd_last:
            out.append((fwd_last, b, min(info.input_bytes, info.activation_bytes), checkpoint_tier))
    return out


# Note [offloads in flight]:
# A block's activations (or a RECOMPUTE block's checkpoint) offloaded at its last forward moment keep
# their DEVICE bytes until the copy lands: the copy engine records them on its stream, and PyTorch's
# caching allocator hands them out only after the copy's event (the simulator's rule, Note [simulator
# evictions] in planner/sim_actions.py; c10/cuda/CUDACachingAllocator.cpp `synchronize_and_free_events`).
# A moment whose work needs them waits for the copies in flight, oldest first. So materialize's budget keeps them on
# DEVICE through the moments that start before the copy is estimated to land: moments start at their
# cumulative seconds (tide: the placement's stage times, `Decisions.moment_seconds_hint`; otherwise
# their compute, no stalls: stalls only land copies earlier relative to the work), the offloads
# leave one after the other on one copy channel (a FIFO, as the simulator's links), each at the rate
# the hardware file gives a copy of its size while the other direction runs too
# (`costmodel.channel_bytes_per_s(duplex=True)`: the PARAM prefetches use H2D beside them in forward;
# an NVMe swap at the slower of that and the SSD write). Measured on the GPT-3 13B x
# rtx4090-768g-12ssd golden (sim17's simulator, 2026-11-24): 1.8 s of the work's 2.5 s of waits for
# DEVICE bytes had offloads in flight; the MIP's plan replays in 9.57 s instead of 10.13 s (9.85 s
# at the D2H rate alone: the forward is D2H-bound and the offloads queue).
def offload_landing_moments(problem: Problem, activation_modes: Sequence[ActivationMode],
                            checkpoint_tier: Tier | None = None, moment_seconds: Sequence[float] = ()) -> dict[int, int]:
    """Per offloaded block: the first moment after its offload whose work is estimated to start once
    the offload copy has landed (at most its reload moment; Note [offloads in flight])."""
    hw = problem.hardware
    starts, t = [], 0.0
    for m in problem.moments:
        starts.append(t)
        t += moment_seconds[m.id] if moment_seconds else m.compute_seconds
    out: dict[int, int] = {}
    free_at = 0.0  # when the copy channel is done with the offloads issued so far
    for fwd_last, b, nbytes, tier in sorted(activation_offloads(problem, activation_modes, checkpoint_tier)):
        rate = channel_bytes_per_s(hw, Channel.D2H, duplex=True, nbytes=nbytes)
        if tier is Tier.NVME:
            rate = min(rate, channel_bytes_per_s(hw, Channel.NVME_WRITE, nbytes=nbytes) or rate)
        lands = max(starts[fwd_last], free_at) + (nbytes / rate if rate > 0 else 0.0)
        free_at = lands
        _, reload, _ = activation_moments(problem, b)
        m = fwd_last + 1
        while m < reload and starts[m] < lands:
            m += 1
        out[b] = m
    return out


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
                       activation_modes: Sequence[ActivationMode], checkpoint_tier: Tier | None = None, *,
                       offload_in_flight: bool = False, moment_seconds: Sequence[float] = ()) -> tuple[int, ...]:
    """The largest PARAM+GRAD budget per moment the DEVICE allows: capacity minus non-model bytes,
    minus OS kept on DEVICE, minus (in the OPTIMIZER moment) room for one comm group's OS fetched
    for a DEVICE step. `offload_in_flight`: activations count until their offload lands (Note
    [offloads in flight])."""
    curve = non_model_curve(problem, activation_modes, checkpoint_tier, offload_in_flight=offload_in_flight,
                            moment_seconds=moment_seconds)
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
    for g in range(0, len(layout.chunks), ws):  # each owner fetches its own chunk of the comm group
        fetched = [layout.chunks[p.chunk].elements * per_element for p in chunk_plans[g:g + ws]
                   if p.optimizer_tier is Tier.DEVICE and p.os_tier is not Tier.DEVICE]
        best = max(best, *fetched, 0)
    return best


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


__all__ = ["Decisions", "EvictionRule", "Reservation", "SolverStats", "activation_moments", "non_model_curve", "offload_landing_moments", "os_device_bytes",
           "param_budget_bytes", "uniform_decisions"]
