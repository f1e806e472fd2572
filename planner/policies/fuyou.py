"""Fuyou (Liao et al. 2024; papers/003 §4; docs/baselines.md §6)."""

from __future__ import annotations

import math

from planner.costmodel import cpu_adam_threads, optimizer_step_price
from planner.errors import InfeasibleError
from planner.materialize import Decisions, EvictionRule, Reservation
from planner.policies._common import budget, chunk_plans, has_nvme, policy_layout
from planner.problem import Problem
from schemas.schedule import ActivationMode, ChunkLayout, ChunkList, Tier
from schemas.trace import Phase

NAME = "fuyou"


def decide(problem: Problem, layout: ChunkLayout | None = None) -> tuple[Decisions, ...]:
    """fp16 params and fp32 OS on the SSDs (CPU memory without SSDs), flowing SSD -> CPU -> GPU per
    layer in forward and again in backward (FY.1); the synchronous out-of-core CPU Adam overlaps
    backward, a group stepped as soon as its grads are offloaded (FY.2), with delayed write-back
    (FY.3: materialize's write-back of group i after group i+1's step); GPU-memory-aware FIFO
    prefetch into what the profiled peak leaves free (FY.4: prefetch into the per-moment budget,
    oldest-first (LRU) eviction); activation checkpoint per block off the GPU (CPU memory when it
    fits, else SSD; FY.5) plus full activation swapping of the blocks Eq. 1-12 picks (FY.6, FY.7,
    in whole blocks: a schedule's activation plan is per block). FY.8's backward temporaries are the
    recorded non-model bytes of a recomputed block at its backward (tide's one non-model curve).

    The swap amount is chosen by time (Eq. 1-11); the second choice, when the swapped plan does not
    fit memory, is D_f = D_start (checkpoints only), Eq. 11's lower bound.

    Single GPU only (FY.10, §5.7): refused with world_size > 1."""
    if problem.world_size > 1:
        raise InfeasibleError(f"fuyou: single-GPU system (Fuyou §5.7: evaluated and built for one GPU, no "
                              f"data-parallel mode), not feasible with world_size={problem.world_size}; "
                              "compare it on a one-GPU profile")
    home = Tier.NVME if has_nvme(problem) else Tier.HOST
    layout = layout or policy_layout(problem)
    modes, act_tier, note = activation_plan(problem, home)
    out = [_decisions(problem, layout, home, modes, act_tier, note)]
    if any(m is not ActivationMode.RECOMPUTE for m in modes):
        out.append(_decisions(problem, layout, home, (ActivationMode.RECOMPUTE,) * len(problem.blocks), act_tier,
                              "activation swap did not fit: checkpoints only (D_f = D_start, Eq. 11)"))
    return tuple(out)


# Fuyou's optimizer pipeline buffers on the CPU (FY.9), derived from §4.3 (the paper gives no formula):
# the CPU Adam steps parameter groups, a group being the parameters of the operator the GPU has just
# finished ("the corresponding operator's optimizer state is asynchronously prefetched to the CPU";
# tide's operator is its trace unit, the block); with the delayed write-back "step 2 [update] can be
# overlapped with steps 1 [read] and 3 [write back]", so three groups are in CPU memory at once: one
# being read from the SSDs (fp32 param, m, v: 12 B/param), one being updated (12 B, plus its fp16
# grads offloaded from the GPU, 2 B: Eq. 6's 2p GPU -> CPU) and one being written back (12 B, plus the
# fp16 params produced for the SSDs, 2 B: Eq. 7's "12p + 2p" written). 3 x 12 + 2 + 2 = 40 B per
# parameter of the largest group, held as fixed pinned buffers (Fuyou keeps its CPU buffers pinned,
# §5.5). The materializer's own HOST copy of the chunk being stepped is counted on top of it (at most one
# chunk's OS counted twice). Not derived: the CPU side of the FIFO prefetch queue (§4.4 "based on the
# ratio of the GPU-CPU bandwidth to the SSD-CPU bandwidth", no formula; docs/baselines.md §6).
PIPELINE_BYTES_PER_PARAM = 3 * 12 + 2 + 2


def pipeline_buffers(problem: Problem) -> Reservation:
    """FY.9: the CPU optimizer's read / update / write-back buffers of three parameter groups (§4.3)."""
    tensors = problem.trace.tensors
    group = max((sum(tensors[t].numel for t in b.tensors if tensors[t].trainable) for b in problem.blocks), default=0)
    return Reservation(tier=Tier.HOST, bytes=PIPELINE_BYTES_PER_PARAM * group,
                       what=f"Fuyou §4.3's optimizer pipeline: read, update and write-back buffers of three "
                            f"{group / 1e6:.0f} M-parameter groups (fp32 param, m, v; fp16 grad in, fp16 param out), pinned")


def _decisions(problem, layout, home, modes, act_tier, note) -> Decisions:
    plans = chunk_plans(layout, home, Tier.HOST)
    homes = (home,) * len(layout.chunks) if home is not Tier.HOST else ()
    return Decisions(
        policy=NAME, layout=layout, chunk_plans=plans, activation_modes=modes,
        param_device_budget_bytes=budget(problem, layout, plans, modes, act_tier),
        persistent_chunks=frozenset(), optimizer_overlap=True, prefetch=True, eviction=EvictionRule.LRU,
        checkpoint_tier=act_tier, param_home_tiers=homes, reserved_bytes=(pipeline_buffers(problem),),
        notes=(f"fuyou (the system's): params and OS on {home.value}, CPU Adam overlapped with backward, delayed "
               "write-back, FIFO prefetch into the free DEVICE budget (LRU)", note))


def activation_plan(problem: Problem, home: Tier) -> tuple[tuple[ActivationMode, ...], Tier, str]:
    """How many blocks to swap (Fuyou Eq. 1-12 at block granularity) and where activations go."""
    hw = problem.hardware
    blocks = problem.blocks
    n = len(blocks)
    p = problem.trace.param_count
    param_bytes = p * problem.list_itemsize(ChunkList.PARAM)
    os_bytes = p * sum(problem.list_itemsize(x) for x in problem.os_lists)
    fwd = sum(m.compute_seconds for m in problem.moments if m.phase is Phase.FORWARD)
    bwd = sum(m.compute_seconds for m in problem.moments if m.phase is Phase.BACKWARD)
    # the cost model's one price (costmodel.optimizer_step_price): Fuyou's CPU Adam overlaps backward
    # beside the PCIe/SSD traffic (Fuyou §4.3), so at the rate with copies and the overlapped threads
    t_opt = optimizer_step_price(hw, Tier.HOST, p, with_copies=True, threads=cpu_adam_threads(hw, overlapped=True),
                                 mixed_precision=problem.mixed_precision).seconds
    bw_gpu = min(hw.h2d_bytes_per_s, hw.d2h_bytes_per_s)
    ssd = home is Tier.NVME
    s2c = hw.nvme_read_bytes_per_s if ssd else math.inf
    c2s = hw.nvme_write_bytes_per_s if ssd else math.inf
    inputs = sum(b.input_bytes for b in blocks)
    # activations go to HOST when they fit next to what HOST must hold anyway, else to the SSDs (FY.5)
    host_model = 0 if ssd else param_bytes + os_bytes + param_bytes  # params, OS and grads live on HOST without SSDs
    all_acts = sum(b.activation_bytes for b in blocks)
    act_tier = (Tier.HOST if host_model + all_acts + inputs <= problem.host_bytes - pipeline_buffers(problem).bytes or not ssd
                else Tier.NVME)
    act_ssd = act_tier is Tier.NVME

    def t_iter(swapped: list[int]) -> tuple[float, float, float]:
        d_f = inputs + sum(blocks[b].activation_bytes - blocks[b].input_bytes for b in swapped)
        rc = sum(blocks[b].recompute_seconds for b in range(n) if b not in set(swapped))
        t_f = max(fwd, max(param_bytes, d_f) / bw_gpu,  # Eq. 2, 3
                  (param_bytes / s2c if ssd else 0) + (d_f / c2s if act_ssd else 0))  # Eq. 4
        gpu_bo = max(param_bytes, param_bytes + d_f) / bw_gpu  # Eq. 6
        ssd_bo = ((os_bytes + param_bytes) / s2c + (os_bytes + param_bytes) / c2s if ssd else 0) \
            + (d_f / s2c if act_ssd else 0)  # Eq. 7
        t_bo = max(bwd + rc, t_opt, gpu_bo, ssd_bo)  # Eq. 5, 8
        return t_f + t_bo, bwd + rc - max(gpu_bo, ssd_bo), d_f  # Eq. 1, Eq. 9

    # SBF order (Eq. 12): recompute FLOPs per swapped byte, ties: the block needed first in backward
    order = sorted(range(n), key=lambda b: (-(blocks[b].recompute_flops / max(1, blocks[b].activation_bytes)), -b))
    best_time, t_max, d_start = t_iter([])
    rates = [bw_gpu] + ([c2s, s2c] if act_ssd else [])
    d_max = max(0.0, t_max) * min(rates)  # Eq. 10
    best_k = 0
    for k in range(1, n + 1):
        time, _, d_f = t_iter(order[:k])
        if d_f - d_start > d_max:  # Eq. 11 (D_start <= D_f <= D_max, counted beyond the checkpoints)
            break
        if time < best_time:
            best_time, best_k = time, k
    swapped = set(order[:best_k])
    swap_mode = ActivationMode.SWAP_NVME if act_ssd else ActivationMode.SWAP_HOST
    modes = tuple(swap_mode if b in swapped else ActivationMode.RECOMPUTE for b in range(n))
    return modes, act_tier, (f"Eq. 1-12: swap {best_k}/{n} blocks to {act_tier.value} (predicted {best_time:.3f} s), "
                             "checkpoints of the rest offloaded")
