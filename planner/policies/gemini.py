"""Colossal-AI Gemini (ColossalAI `4f9953be`, `colossalai/booster/plugin/gemini_plugin.py`,
`colossalai/zero/gemini/placement_policy.py`; docs/baselines.md §5)."""

from __future__ import annotations

from planner.errors import PlannerError
from planner.materialize import Decisions, EvictionRule
from planner.policies._common import (
    GB,
    budget,
    chunk_plans,
    everything,
    has_nvme,
    moment_need_bytes,
    policy_layout,
)
from planner.problem import Problem
from schemas.schedule import ActivationMode, HostStaging, Tier

NAME = "gemini"
STEADY_CUDA_CAP_RATIO = 0.9  # AutoPlacementPolicy steady_cuda_cap_ratio (placement_policy.py; GM.4)


def decide(problem: Problem, *, placement: str = "auto", os_on_nvme: bool = False,
           cpu_offload: bool = False) -> tuple[Decisions, ...]:
    """placement "auto" (GM.4-GM.7): param chunks move between GPU and CPU by the runtime statistics,
    up to steady_cuda_cap_ratio 0.9 of the GPU minus the moment's non-model bytes, evicting the chunk
    whose next compute is farthest; grads, OS and HybridAdam on the CPU (GM.5, GM.7:
    gpu_margin_mem_ratio 0.0), no prefetch (max_prefetch 0, GM.6), checkpoints kept on the GPU
    (GM.9). `os_on_nvme` (default off: the plugin's nvme_offload_fraction 0.0): the OS on the SSDs, as Fuyou ran Colossal-AI (Fuyou
    §5.1: "optimizer states are offloaded to the SSDs"). placement "static" with the plugin's defaults
    (GM.2: shard_param_frac 1.0, offload fracs 0.0): everything on the GPU.

    `cpu_offload`: "parameters and gradients are offloaded to the CPU", the setup Fuyou §5.1 ran
    (Colossal-AI 0.3.0's placement_policy "cpu"; today `placement="static"` with shard_param_frac,
    offload_optim_frac and offload_param_frac all 1.0, GM.3): `StaticPlacementPolicy.evict_tensors`
    moves every chunk not in the current compute to the CPU (keep_cuda_chunk_mem = 0), so each chunk
    is fetched on access, in forward and again in backward, and leaves after it (the DEVICE budget is
    the moment's own PARAM (+GRAD) bytes); `setup_grads_device` puts every chunk's grads, so its OS
    and HybridAdam, on the CPU; no prefetch (max_prefetch 0, GM.6); pinned copies (the GPT example
    Fuyou ran passes `pin_memory=True`, where the plugin's default is pageable, GM.8).

    Several ranks: every chunk sharded over the ranks (ZeRO-3 with chunks): all-gather before use in
    forward and backward, grads reduce-scattered, each rank's OS shard on the shared CPU."""
    modes = (ActivationMode.RECOMPUTE,) * len(problem.blocks)
    layout = policy_layout(problem)
    if cpu_offload:
        os_tier = Tier.NVME if os_on_nvme and has_nvme(problem) else Tier.HOST
        plans = chunk_plans(layout, os_tier, Tier.HOST)
        room = budget(problem, layout, plans, modes, None)
        return (Decisions(
            policy=NAME, layout=layout, chunk_plans=plans, activation_modes=modes,
            param_device_budget_bytes=tuple(min(r, n) for r, n in zip(room, moment_need_bytes(problem, layout))),
            persistent_chunks=frozenset(), optimizer_overlap=False, prefetch=False,
            eviction=EvictionRule.FARTHEST_NEXT_USE, release_between_phases=True,
            # Fuyou §5.1 ran Colossal-AI's "official GPT-2 example", whose build_gemini passes
            # GeminiDDP(..., pin_memory=True) (examples/language/gpt/gemini/train_gpt_demo.py), not the
            # plugin's pageable default (GM.8)
            host_staging=HostStaging.PINNED,
            notes=((f"gemini static, every frac 1.0 (the system's, as Fuyou §5.1 ran it): each chunk fetched on access "
                    f"and moved back to the CPU after it, grads and OS on {os_tier.value}, HybridAdam on the CPU after "
                    "backward, pinned copies (the GPT example's pin_memory=True)"), "activation checkpoints kept on DEVICE")),)
    if placement == "static":
        plans = chunk_plans(layout, Tier.DEVICE, Tier.DEVICE)
        return (Decisions(policy=NAME, layout=layout, chunk_plans=plans, activation_modes=modes,
                          param_device_budget_bytes=budget(problem, layout, plans, modes, None),
                          persistent_chunks=everything(layout), optimizer_overlap=False, prefetch=False,
                          eviction=EvictionRule.FARTHEST_NEXT_USE,
                          host_staging=HostStaging.PAGEABLE,  # GeminiPlugin pin_memory defaults to False (gemini_plugin.py:456; GM.8)
                          notes=("gemini static (the system's default, GM.2): everything on DEVICE, checkpoints there",)),)
    if placement != "auto":
        raise PlannerError(f"gemini: placement {placement!r} is not one of Colossal-AI's: 'auto' or 'static'")
    os_tier = Tier.NVME if os_on_nvme and has_nvme(problem) else Tier.HOST
    plans = chunk_plans(layout, os_tier, Tier.HOST)
    limit = min(problem.device_bytes, int(problem.hardware.device.memory_gb * GB * STEADY_CUDA_CAP_RATIO))
    return (Decisions(
        policy=NAME, layout=layout, chunk_plans=plans, activation_modes=modes,
        param_device_budget_bytes=budget(problem, layout, plans, modes, None, device_limit_bytes=limit),
        persistent_chunks=frozenset(), optimizer_overlap=False, prefetch=False, eviction=EvictionRule.FARTHEST_NEXT_USE,
        host_staging=HostStaging.PAGEABLE,  # GeminiPlugin pin_memory defaults to False (gemini_plugin.py:456; GM.8)
        release_between_phases=problem.world_size > 1,  # re-shard after forward and backward (PatrickStar Alg. 4, ZeRO-3 release_sub_module, Gemini)
        notes=(f"gemini auto (the system's): chunks on access within 0.9 of the GPU, farthest-next-compute eviction, "
               f"OS on {os_tier.value}, CPU Adam after backward", "activation checkpoints kept on DEVICE")),)
