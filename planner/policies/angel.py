"""Angel-PTM (Nie et al., VLDB 2023; papers/004 §4-§5; docs/baselines.md §9): an Angel-PTM-like baseline.

Rules (each with its section of papers/004), as tide `Decisions`:
- AP.1 Page abstraction (§4.1): model states in 4 MB pages, a tensor spanning whole pages, so no tensor
  pads another's unit. tide moves chunks and keeps a tensor in one chunk, so the finest unit expressible
  is tide's one-rank chunk (a block's largest tensor), with several ranks grouped world_size at a time
  and the oversize vocabulary embedding in a group of its own (`patrickstar_layout`'s grouping), so the
  embedding does not size every group. Not modelled: the page-level bandwidth and fragmentation gains.
- AP.2 Placement (§4.2, "First"): forward/backward on the GPU, the optimizer on the CPU; fp16 params
  live on the CPU and move to the GPU per layer; the fp32 OS on the CPU, on the SSDs "for scaling
  model size" (the second decision set, tried when the CPU does not hold them); recomputation for
  activations (every block checkpointed; the paper offloads no checkpoint: they stay on the GPU).
- AP.3 GPU cache for optimizer states (§4.2, "Second"): "if sufficient space is available, we reserve
  a portion of the GPU memory as the cache to store a segment of the CPU's optimizer states" and move
  their update to the GPU, sized from the tensor lifetimes "without encountering GPU out-of-memory":
  the DEVICE the non-model curve and the largest moment's params + grads leave free, filled with OS
  chunks in chunk order (each rank its own), stepped by GPU Adam.
- AP.4 Unified scheduler, Algorithm 1 (§4.2): move_to_gpu tasks as early as the available memory
  allows (phase 1, lines 3-16), all_gather advanced to the earliest trigger id without OOM (phase 2,
  lines 19-22): tide's prefetch at the first harmless opportunity, with no bucket cap; when memory is
  short the last movement task is popped (lines 7-9), i.e. the page needed farthest ahead waits:
  farthest-next-use eviction. Pages are released after their last access (`end_id`, the Tracer §5);
  a param's lifetime spans forward and backward, so it is not re-sharded between them when memory
  allows (no forced release).
- AP.5 Lock-free updating, Algorithm 2 (§4.3): the CPU updating thread steps a layer as soon as its
  gradients are buffered, decoupled from the GPU. tide replays one iteration: the CPU steps overlap
  backward as the grads become final (`optimizer_overlap`), not the next iteration's forward (the
  staleness the paper accepts is not replayed), so this is a lower bound on what it overlaps.
- AP.6 The Allocator pre-allocates GPU memory, CPU pinned memory and SSD space (§5): copies at the
  pinned rates (not a pageable policy).
"""

from __future__ import annotations

from planner.materialize import Decisions, EvictionRule
from planner.policies._common import (
    budget,
    chunk_plans,
    has_nvme,
    moment_need_bytes,
)
from planner.policies.patrickstar import patrickstar_layout
from planner.problem import Problem
from schemas.schedule import ActivationMode, ChunkLayout, Tier

NAME = "angel"


def decide(problem: Problem) -> tuple[Decisions, ...]:
    """OS on the CPU (AP.2) with the GPU's spare room caching some of it (AP.3); then, where the CPU
    does not hold it, the same with the OS on the SSDs (AP.2's SSD tier). See the module docstring."""
    homes = (Tier.HOST, Tier.NVME) if has_nvme(problem) else (Tier.HOST,)
    layout = patrickstar_layout(problem)  # AP.1: tide's one-rank chunks, grouped; the embedding alone
    return tuple(_decisions(problem, layout, home, share) for home in homes for share in CACHE_SHARES)


# AP.3 sizes the cache "without encountering GPU out-of-memory errors" from the lifetimes; the room left
# at the tightest moment is an upper bound (grads waiting for their reduce-scatter, the prefetched
# pages also need DEVICE), so the decision sets try that room, then less: the steps are tide's search
# for the largest cache that fits, not Angel-PTM's numbers
CACHE_SHARES = (1.0, 0.5, 0.25, 0.0)


def _decisions(problem: Problem, layout: ChunkLayout, os_home: Tier, share: float) -> Decisions:
    ws = problem.world_size
    modes = (ActivationMode.RECOMPUTE,) * len(problem.blocks)
    # AP.3: what the lifetimes leave free at the tightest moment, after the non-model curve and the
    # params + grads that moment's layers need, is the OS cache
    plain = chunk_plans(layout, os_home, Tier.HOST)
    free = budget(problem, layout, plain, modes, None)
    need = moment_need_bytes(problem, layout)
    room = int(share * max(0, min((f - n for f, n in zip(free, need)), default=0)))
    per_element = sum(problem.list_itemsize(x) for x in problem.os_lists)
    cached: set[int] = set()
    for g in range(0, len(layout.chunks), ws):  # chunk order; each rank caches its own chunk's OS
        group = layout.chunks[g:g + ws]
        cost = max(c.elements for c in group) * per_element
        if cost > room:
            break
        cached.update(c.id for c in group)
        room -= cost
    plans = chunk_plans(layout, lambda c: Tier.DEVICE if c in cached else os_home,
                        lambda c: Tier.DEVICE if c in cached else Tier.HOST)
    return Decisions(
        policy=NAME, layout=layout, chunk_plans=plans, activation_modes=modes,
        param_device_budget_bytes=budget(problem, layout, plans, modes, None),
        persistent_chunks=frozenset(), optimizer_overlap=True, prefetch=True,
        eviction=EvictionRule.FARTHEST_NEXT_USE,
        notes=(f"angel (the system's): papers/004 §4's rules: fp16 params on HOST moved to DEVICE as early as "
               f"memory allows (Algorithm 1), farthest-needed movement deferred, OS on {os_home.value} with "
               f"{len(cached)}/{len(layout.chunks)} chunks cached on DEVICE (§4.2), CPU Adam as grads arrive "
               "(Algorithm 2, within this iteration's backward: the staleness into the next iteration is not "
               "replayed), recomputation with checkpoints on DEVICE; pages are tide's one-rank chunks, the embedding's group its own",))
