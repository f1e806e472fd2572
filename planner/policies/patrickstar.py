"""PatrickStar (Fang et al.; papers/000 §6-§8; docs/baselines.md §4)."""

from __future__ import annotations

from planner.materialize import Decisions, EvictionRule, Reservation, non_model_curve
from planner.policies._common import GB, budget, chunk_plans, policy_layout
from planner.problem import Problem
from schemas.schedule import ActivationMode, ChunkList, Tier

NAME = "patrickstar"
GPU_RATIO = 0.8  # overall_gpu_mem_ratio: the share of GPU memory PatrickStar manages (client.py:55; PS.4)
MARGIN_USE_RATIO = 0.8  # margin_use_ratio: the share of the GPU margin OS chunks may take (memtracer.py; PS.6)


def decide(problem: Problem) -> tuple[Decisions, ...]:
    """fp16 params in chunks (PS.1) that move on access, no prefetch, evicting the chunk whose next
    use (from the warm-up trace, PS.7) is farthest (Algorithm 1, §8.3; PS.3); chunk memory per moment:
    overall_gpu_mem_ratio 0.8 of the GPU minus that moment's non-model bytes (PS.4, tide's one
    non-model curve stands for the warm-up iteration's `gpu_sys_used_list`), minus a comm buffer of
    world_size x 2 chunks (PS.4); OS chunks in the GPU margin (0.8 x GPU - peak non-model - fp16
    chunks) x margin_use_ratio 0.8, stepped there by GPU Adam, the rest on the CPU (PS.6); Adam after
    backward (PS.9); activation checkpointing, checkpoints on the GPU (PS.10).

    Not modelled (docs/baselines.md): the grad written into the param chunk's slot (PS.2: tide's
    GRAD chunks are separate, so backward holds up to both on DEVICE), the embedding on the CPU
    (PS.8), the Adam-time budget (PS.5).

    Several ranks (§7): comm groups of p chunks all-gathered before use in forward and in backward,
    grads reduce-scattered; each rank puts the OS of its own chunks in its own margin."""
    modes = (ActivationMode.RECOMPUTE,) * len(problem.blocks)
    limit = min(problem.device_bytes, int(problem.hardware.device.memory_gb * GB * GPU_RATIO))
    layout = policy_layout(problem)
    ws = problem.world_size
    item = problem.list_itemsize(ChunkList.PARAM)
    comm = Reservation(tier=Tier.DEVICE, bytes=ws * 2 * layout.chunk_elements * item,
                       what="comm buffer of world_size x 2 chunks (memtracer.py available_chunk_mem; PS.4)")
    peak_nm = int(max(non_model_curve(problem, modes)))
    param_bytes = sum(c.elements for c in layout.chunks) * item
    margin = max(0, limit - peak_nm - param_bytes)
    os_room = int(margin * MARGIN_USE_RATIO)
    per_element = sum(problem.list_itemsize(x) for x in problem.os_lists)
    on_gpu: set[int] = set()
    for g in range(0, len(layout.chunks), ws):  # chunk order: each rank fills its margin with its own chunks' OS
        group = layout.chunks[g:g + ws]
        cost = max(c.elements for c in group) * per_element
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
