"""PyTorch (+ activation checkpointing): everything on the GPU (docs/baselines.md §7)."""

from __future__ import annotations

from planner.materialize import Decisions, EvictionRule
from planner.policies._common import budget, chunk_plans, everything, policy_layout
from planner.problem import Problem
from schemas.schedule import ActivationMode, Tier

NAME = "pytorch"


def decide(problem: Problem) -> tuple[Decisions, ...]:
    """fp16 params, fp32 master + Adam m, v and grads all on the GPU (16 B/param, PatrickStar §9.2.1:
    "2 x 18 = 36 GB" for 2B with non-model data; PT.1), `torch.optim.AdamW` on the GPU after backward
    (PT.4). Activations kept; the second choice is `torch.utils.checkpoint` on every block, what a
    PyTorch user does next and how PatrickStar ran its PyTorch baseline (§9.1; PT.2).

    Several ranks: DistributedDataParallel (PT.3): every rank holds everything (`replicated`), each
    chunk's grads all-reduced when final (DDP's bucketed all-reduce overlapping backward; modelled
    per chunk, not per 25 MB bucket)."""
    ddp = problem.world_size > 1
    layout = policy_layout(problem, replicated=ddp)
    plans = chunk_plans(layout, Tier.DEVICE, Tier.DEVICE)
    what = f"DDP over {problem.world_size} ranks: " if ddp else ""
    out = []
    for mode, act in ((ActivationMode.KEEP, "activations kept"),
                      (ActivationMode.RECOMPUTE, "activation checkpointing per block (PatrickStar §9.1)")):
        modes = (mode,) * len(problem.blocks)
        out.append(Decisions(
            policy=NAME, layout=layout, chunk_plans=plans, activation_modes=modes,
            param_device_budget_bytes=budget(problem, layout, plans, modes, None),
            persistent_chunks=everything(layout), optimizer_overlap=False, prefetch=False,
            eviction=EvictionRule.FARTHEST_NEXT_USE, replicated=ddp,
            notes=(f"pytorch (the system's): {what}everything on DEVICE, GPU AdamW after backward, {act}",)))
    return tuple(out)
