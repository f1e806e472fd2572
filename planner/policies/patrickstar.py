"""PatrickStar (Fang et al.; papers/000 §6-§8; docs/baselines.md §4)."""

from __future__ import annotations

import dataclasses

from planner.materialize import Decisions, EvictionRule, Reservation, non_model_curve
from planner.policies._common import GB, budget, chunk_plans, policy_layout
from planner.problem import Problem
from schemas.schedule import ActivationMode, Chunk, ChunkLayout, ChunkList, Tier

NAME = "patrickstar"
GPU_RATIO = 0.8  # overall_gpu_mem_ratio: the share of GPU memory PatrickStar manages (client.py:55; PS.4)
MARGIN_USE_RATIO = 0.8  # margin_use_ratio: the share of the GPU margin OS chunks may take (memtracer.py; PS.6)


def decide(problem: Problem) -> tuple[Decisions, ...]:
    """fp16 params in chunks (PS.1) that move on access, no prefetch, evicting the chunk whose next
    use (from the warm-up trace, PS.7) is farthest (Algorithm 1, §8.3; PS.3); chunk memory per moment:
    overall_gpu_mem_ratio 0.8 of the GPU minus that moment's non-model bytes (PS.4, tide's one
    non-model curve stands for the warm-up iteration's `gpu_sys_used_list`), minus a comm buffer of
    world_size fp16 chunks (PS.4); OS chunks in the GPU margin (0.8 x GPU - peak non-model - the
    rank's fp16 chunks and p-1 remote ones) x margin_use_ratio 0.8, stepped there by GPU Adam, the rest
    on the CPU (PS.6); Adam after backward (PS.9); activation checkpointing, checkpoints on the GPU
    (PS.10).

    Not modelled (docs/baselines.md): the grad written into the param chunk's slot (PS.2: tide's
    GRAD chunks are separate, so backward holds up to both on DEVICE, HOST holds 16 B/param where
    PatrickStar needs 14, and with several ranks a margin comm group's GRAD entry stays whole on
    DEVICE until its step, which the margin pays for here), the embedding computed on the CPU (PS.8),
    the Adam-time budget (PS.5).

    Chunks: `patrickstar_layout` (PS.1, the chunk-size search's criterion); the embedding in a chunk
    of its own stands for PS.8: PatrickStar keeps it out of the chunks, on the CPU (`use_cpu_embedding`),
    so the real system moves only its activations where tide moves its chunk.

    Several ranks (§7): comm groups of p chunks all-gathered before use in forward and in backward,
    grads reduce-scattered; each rank puts the OS of its own chunks in its own margin."""
    modes = (ActivationMode.RECOMPUTE,) * len(problem.blocks)
    limit = min(problem.device_bytes, int(problem.hardware.device.memory_gb * GB * GPU_RATIO))
    layout = patrickstar_layout(problem)
    ws = problem.world_size
    item = problem.list_itemsize(ChunkList.PARAM)
    # `available_chunk_mem` (FWD/BWD) subtracts `msc_factor * 2 * self._default_chunk_size` from the
    # chunkable memory: 2 B x chunk elements = one fp16 chunk per rank (msc_factor = world_size without
    # mem-saving comm), i.e. one comm group's fp16 bytes, also with one rank (PS.4)
    comm = Reservation(tier=Tier.DEVICE, bytes=ws * layout.chunk_elements * item,
                       what="comm buffer of world_size fp16 chunks (memtracer.py available_chunk_mem; PS.4)")
    peak_nm = int(max(non_model_curve(problem, modes)))
    # `update_margin_mem`: margin = overall GPU - max(gpu_sys_used_list) - param_fp16_chunks_max_mem_usage,
    # the latter being this rank's own fp16 chunks (n_chunks / world_size) plus (world_size - 1) remote
    # chunks of its comm group (client.py `param_fp16_chunks_max_mem_usage`, without mem-saving comm; PS.6)
    own_bytes = max(sum(c.elements for c in layout.chunks if c.owner_rank == r) for r in range(ws)) * item
    param_bytes = own_bytes + (ws - 1) * layout.chunk_elements * item
    margin = max(0, limit - peak_nm - param_bytes)
    os_room = int(margin * MARGIN_USE_RATIO)
    per_element = sum(problem.list_itemsize(x) for x in problem.os_lists)
    on_gpu: set[int] = set()
    for g in range(0, len(layout.chunks), ws):  # chunk order: each rank fills its margin with its own chunks' OS
        group = layout.chunks[g:g + ws]
        cost = max(c.elements for c in group) * per_element
        if ws > 1:
            # tide's format, not PatrickStar's: a DEVICE-stepped chunk's grads wait on DEVICE for the
            # step in a GRAD chunk of their own, the rank's own chunk after the reduce-scatter
            # (planner/device_cache.py), where PatrickStar writes them into the param chunk's slot (PS.2,
            # already counted in the margin). Counted here so the margin's OS chunks and their grads fit.
            cost += max(c.elements for c in group) * item
        if cost <= os_room:
            on_gpu.update(c.id for c in group)
            os_room -= cost
    plans = chunk_plans(layout, lambda c: Tier.DEVICE if c in on_gpu else Tier.HOST,
                        lambda c: Tier.DEVICE if c in on_gpu else Tier.HOST)
    # the comm buffer comes out of the chunk budget only (PS.4), inside the 0.8 share
    return (Decisions(
        policy=NAME, layout=layout, chunk_plans=plans, activation_modes=modes,
        param_device_budget_bytes=budget(problem, layout, plans, modes, None, device_limit_bytes=limit, reserved=(comm,)),
        persistent_chunks=frozenset(), optimizer_overlap=False, prefetch=False,
        eviction=EvictionRule.FARTHEST_NEXT_USE,
        release_between_phases=problem.world_size > 1,  # re-shard after forward and backward (PatrickStar Alg. 4, ZeRO-3 release_sub_module, Gemini)
        notes=(f"patrickstar (the system's): fp16 chunks on access, farthest-next-use eviction, "
               f"{len(on_gpu)}/{len(layout.chunks)} OS chunks in the GPU margin ({margin / GB:.2f} GB x "
               f"{MARGIN_USE_RATIO}), chunk budget 0.8 x GPU minus non-model and the comm buffer",
               "Adam after backward, activation checkpointing on DEVICE")),)


def patrickstar_layout(problem: Problem) -> ChunkLayout:
    """PatrickStar's chunk list (PS.1, §6.1, §7).

    Chunk size and packing: PatrickStar's authors pick the chunk size by a search for the least overall
    chunk memory (`examples/run_transformers.sh` CS_SEARCH, `examples/eval_chunk_size.py`, README "Search
    the best chunk size": "a CS with less memory footprint"); tide's one-rank layout (planner.layout,
    `policy_layout`) is that criterion's answer within tide's packing (first fit inside a block), so it
    stands for it. PatrickStar's own packing (tensors appended across block boundaries, 312-88 Mi-element
    candidates) wastes 9-10% on the ladder's models, tide's 1-2%: measured with this module's history,
    with the fp16 grads kept in GRAD chunks (PS.2 not expressible) that 16 B/param over 9% more elements
    ran 12B out of 240 GB of HOST on one V100, where PatrickStar's 14 B/param fits.

    One rank: that layout. Several ranks (§7, Fig. 8): its chunks, in order, in comm groups of
    world_size consecutive chunks across block boundaries (`owner_rank = id % world_size`), only the last
    group padded; the chunk-size search runs on one GPU (`eval_chunk_size.py`'s hardware setting,
    `global_gpu_num` 1), so the size is the one-rank size. The vocabulary embedding, which PatrickStar
    keeps out of the chunks on the CPU (`use_cpu_embedding`, PS.8), is an oversize chunk in the one-rank
    layout: it gets a comm group of its own, padded with empty chunks (no grads or OS), so that the
    groups of ordinary chunks keep equal shards (planner/layout.py's rule) and small."""
    one = policy_layout(problem, replicated=True)  # the one-rank layout (every chunk its own comm group)
    ws = problem.world_size
    if ws == 1:
        return one
    size = one.chunk_elements
    groups: list[list[Chunk | None]] = []  # None: an empty padding chunk
    for c in one.chunks:
        if c.elements > size:
            groups.append([c] + [None] * (ws - 1))
            continue
        if not groups or len(groups[-1]) == ws or groups[-1][0] is not None and groups[-1][0].elements > size:
            groups.append([])
        groups[-1].append(c)
    if groups and len(groups[-1]) < ws:
        groups[-1] += [None] * (ws - len(groups[-1]))
    new_id: dict[int, int] = {}
    out_chunks: list[Chunk] = []
    for g, members in enumerate(groups):
        cap = max(c.elements for c in members if c is not None)
        for r, c in enumerate(members):
            i = g * ws + r
            if c is not None:
                new_id[c.id] = i
            out_chunks.append(Chunk(id=i, elements=cap, used_elements=c.used_elements if c else 0,
                                    block=c.block if c else -1, comm_group=g, owner_rank=r))
    slots = tuple(dataclasses.replace(t, chunk=new_id[t.chunk]) for t in one.tensors)
    return dataclasses.replace(one, chunks=tuple(out_chunks), tensors=slots)
