"""Reference decision sets: what the baselines (Fuyou, ZeRO-Offload, PatrickStar/Gemini, PyTorch) decide,
expressed as tide Decisions on a layout. `planner.solve` replays them beside its own placements (so
tide is never slower than those decisions) and `planner.maxsize` asks whether any of them fits.
"""

from __future__ import annotations

import logging
import math

from planner.errors import InfeasibleError, PlannerError
from planner.materialize import Decisions, EvictionRule, materialize, param_budget_bytes
from planner.policies.fuyou import activation_plan as fuyou_activation_plan
from planner.solution import POLICY
from schemas.schedule import ActivationMode, ChunkPlan, Tier

log = logging.getLogger(__name__)


def reference_decisions(problem, layout, *, optimizer_overlap: bool = True, checkpoint_offload: bool = True,
                        os_device_comm_groups: int = 0) -> list[tuple[str, object]]:
    """What the baselines decide (planner.policies), as tide Decisions on `layout`: Fuyou's (OS and
    PARAM on NVME, CPU Adam overlapped with backward, its Eq. 1-12 activation swap, checkpoints
    off DEVICE), ZeRO-Offload's (PARAM persistent on DEVICE, OS on HOST, checkpoints on HOST),
    PatrickStar/Gemini's (chunks on demand, OS on HOST, and with `os_device_comm_groups` the OS of that
    many leading comm groups in the DEVICE margin, stepped there) and PyTorch's (everything on DEVICE). They
    run through tide's engine (Belady eviction, prefetch at the first harmless opportunity, and the
    CPU overlap unless `optimizer_overlap` is False), so each is at least what the system does.
    Each set's notes say which decisions are the system's and which runtime parts are tide's
    (issue 16): a reference set is "system X's placement with tide's runtime", not system X."""
    n_blocks = len(problem.blocks)
    has_nvme = problem.hardware.nvme.count > 0 and problem.nvme_bytes > 0 and problem.hardware.nvme_read_bytes_per_s > 0
    everything = frozenset(c.id for c in layout.chunks)

    def make(name: str, os_tier: Tier, optimizer_tier: Tier, modes: tuple, *, home: Tier = Tier.HOST,
             persistent: frozenset[int] = frozenset(), checkpoint: Tier | None = None,
             os_device_comm_groups: int = 0, system: str = "") -> tuple[str, object]:
        on_device = problem.world_size * os_device_comm_groups  # the first comm groups' OS on DEVICE, GPU Adam
        plans = tuple(ChunkPlan(chunk=c.id, os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE) if c.id < on_device
                      else ChunkPlan(chunk=c.id, os_tier=os_tier, optimizer_tier=optimizer_tier) for c in layout.chunks)
        checkpoint = checkpoint if checkpoint_offload else None
        if checkpoint is not None and ActivationMode.RECOMPUTE not in modes:
            checkpoint = None
        budget = param_budget_bytes(problem, layout, plans, modes, checkpoint, offload_in_flight=True)
        homes = (home,) * len(layout.chunks) if home is not Tier.HOST else ()
        return name, Decisions(policy=POLICY, layout=layout, chunk_plans=plans, activation_modes=modes,
                               param_device_budget_bytes=budget, persistent_chunks=persistent,
                               optimizer_overlap=optimizer_overlap, prefetch=True,
                               eviction=EvictionRule.BELADY_CLEAN_FIRST, checkpoint_tier=checkpoint,
                               param_home_tiers=homes, notes=_reference_notes(name, system, checkpoint, optimizer_overlap,
                                                                              optimizer_tier, modes))

    recompute = (ActivationMode.RECOMPUTE,) * n_blocks
    out = []
    home = Tier.NVME if has_nvme else Tier.HOST
    modes, act_tier, _ = fuyou_activation_plan(problem, home)
    fy = f"fuyou: params and OS on {home.value}, CPU Adam on HOST, its Eq. 1-12 activation swap"
    out.append(make("fuyou-like", home, Tier.HOST, modes, home=home, checkpoint=act_tier, system=fy))
    if has_nvme:  # Fuyou's OS on the SSDs with every PARAM on HOST (where HOST holds them)
        out.append(make("fuyou-like, PARAM on HOST", Tier.NVME, Tier.HOST, modes, checkpoint=act_tier,
                        system="fuyou: OS on NVME, CPU Adam, its Eq. 1-12 swap; PARAM on HOST is tide's variant"))
        out.append(make("fuyou-like, checkpoints only", Tier.NVME, Tier.HOST, recompute, home=Tier.NVME,
                        checkpoint=Tier.HOST, system="fuyou: params and OS on NVME, CPU Adam, D_f = D_start (Eq. 11)"))
    out.append(make("zero-offload-like", Tier.HOST, Tier.HOST, recompute, persistent=everything, checkpoint=Tier.HOST,
                    system="zero2-offload: fp16 params persistent on DEVICE, OS on HOST, CPU Adam, a checkpoint "
                           "per block on HOST (cpu_checkpointing, as Fuyou §5.1 ran DeepSpeed)"))
    ps = "patrickstar: chunks on access, OS on HOST, CPU Adam, a checkpoint per block"
    out.append(make("patrickstar-like", Tier.HOST, Tier.HOST, recompute, system=ps))
    if os_device_comm_groups:
        out.append(make(f"patrickstar-like, OS of {os_device_comm_groups} comm groups on DEVICE", Tier.HOST, Tier.HOST,
                        recompute, os_device_comm_groups=os_device_comm_groups,
                        system=f"{ps}; OS of the leading comm groups in the DEVICE margin, GPU Adam (§8.2)"))
    out.append(make("pytorch-like", Tier.DEVICE, Tier.DEVICE, (ActivationMode.KEEP,) * n_blocks, persistent=everything,
                    system="pytorch: everything on DEVICE, GPU AdamW"))
    out.append(make("pytorch-like, checkpointing", Tier.DEVICE, Tier.DEVICE, recompute, persistent=everything,
                    system="pytorch: everything on DEVICE, GPU AdamW, torch.utils.checkpoint per block"))
    return out


def _reference_notes(name: str, system: str, checkpoint: Tier | None, optimizer_overlap: bool, optimizer_tier: Tier,
                     modes: tuple) -> tuple[str, ...]:
    """Which decisions of a reference set are the system's, and which runtime parts are tide's."""
    tide = ["prefetch at the first harmless opportunity (Cao et al. 1995)", "Belady eviction (clean first)",
            "budget: all the DEVICE allows"]
    if optimizer_overlap and optimizer_tier is Tier.HOST and not name.startswith("fuyou"):
        tide.append("CPU Adam overlapped with backward")
    if checkpoint is not None and ActivationMode.RECOMPUTE in modes and not name.startswith(("fuyou", "zero")):
        tide.append(f"checkpoints offloaded to {checkpoint.value}")
    return (f"reference decision set: {name}", f"the system's: {system}", "tide's: " + ", ".join(tide))


def os_margin_decisions(problem, layout, *, optimizer_overlap: bool,
                        checkpoint_offload: bool) -> tuple[str, Decisions] | None:
    """PatrickStar's margin (§8.2), found instead of estimated: the most leading comm groups whose OS
    can stay on DEVICE (GPU Adam, each rank its own chunk's) next to chunks fetched on demand; a
    bisection over the count, each step materialized (the DEVICE check is materialize's). None when
    not even one comm group's OS fits."""
    def decisions(k: int):
        return next((name, d) for name, d in reference_decisions(
            problem, layout, optimizer_overlap=optimizer_overlap, checkpoint_offload=checkpoint_offload,
            os_device_comm_groups=k) if name.startswith("patrickstar-like, OS of"))

    def fits(k: int) -> bool:
        try:
            materialize(problem, decisions(k)[1])
        except (InfeasibleError, PlannerError) as exc:
            log.info("OS of %d comm groups on DEVICE: %s", k, exc)
            return False
        return True

    lo, hi = 0, math.ceil(len(layout.chunks) / problem.world_size)
    if hi == 0 or not fits(1):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return decisions(lo)


__all__ = ["os_margin_decisions", "reference_decisions"]
