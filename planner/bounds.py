"""Lower bounds on the iteration time, and explanations for models that do not fit.

Two bounds, the header takes the larger (DESIGN.md §4.3, "always a lower bound so the gap is known"):
- the LP relaxation of the placement model (planner.placement), minimised over the chunk sizes
  evaluated: no integral plan of that model is faster (planner.solve);
- `lower_bound`: the physical limit of any schedule of a problem (with several ranks, per rank), the
  bound `compare` prints. (A per-placement-input "physical" bound that assumed every optimizer
  state off the GPU steps on the CPU was removed: the MIP streams such state to the GPU instead,
  and at 128 blocks x 4096 it read 25.4 s against an LP of 17.7 s, so it bounded nothing.)
gap = (simulated - bound) / simulated, never clipped.

When the model has no solution, `explain_infeasible` says which tier runs out, at which stage, by
how many bytes, and the smallest DEVICE / HOST / NVME capacity that would work, computed from the
same model with that tier's capacity as the objective (the other tiers as given, and unbounded).
"""

from __future__ import annotations


from planner.costmodel import (cpu_adam_beside_copies, cpu_adam_threads, fastest_bytes_per_s, nvme_seconds,
                               optimizer_step_price)
from planner.decisions import non_model_curve
from planner.errors import InfeasibleError
from planner.placement import INFINITE_BYTES, PlacementInput, minimal_capacity
from planner.problem import Problem
from schemas._base import format_bytes, frozen
from schemas.schedule import ActivationMode, Channel, ChunkList, Tier


def explain_infeasible(data: PlacementInput, *, stage_names: list[str] | None = None, what: str = "the model") -> InfeasibleError:
    """An InfeasibleError naming the tier that runs out, the stage, the shortfall and the minimal capacities."""
    names = stage_names or [st.name for st in data.stages]
    given = {Tier.DEVICE: data.device_bytes, Tier.HOST: data.host_bytes, Tier.NVME: data.nvme_bytes}
    alone: dict[tuple[int, int] | None] = {}
    for tier in Tier:
        alone[tier] = minimal_capacity(data, tier, relax_others=True)
    short = [t for t in Tier if alone[t] is not None and alone[t][0] > given[t]]
    parts = []
    for tier in short or list(Tier):
        need, stage = alone[tier] or (0, -1)
        if tier not in short and short:
            continue
        if need <= given[tier]:
            continue
        where = f" at stage {stage} ({names[stage]})" if stage >= 0 else ""
        parts.append(f"{tier.value} runs out{where}: it needs {format_bytes(need)}, the capacity is "
                     f"{format_bytes(given[tier])} ({need - given[tier]} bytes short)")
    if not parts:
        # every tier suffices on its own, but not together: the smallest of each given the others
        for tier in Tier:
            joint = minimal_capacity(data, tier, relax_others=False)
            if joint is not None and joint[0] > given[tier]:
                need, stage = joint
                where = f" at stage {stage} ({names[stage]})" if stage >= 0 else ""
                parts.append(f"{tier.value} runs out{where} with the other tiers as given: it needs "
                             f"{format_bytes(need)}, the capacity is {format_bytes(given[tier])} ({need - given[tier]} bytes short)")
    minimal = []
    for tier in Tier:
        entry = alone[tier]
        if entry is None:
            minimal.append(f"{tier.value} none helps")
        else:
            minimal.append(f"{tier.value} >= {format_bytes(entry[0])} ({entry[0]} bytes)")
    head = "; ".join(parts) if parts else "no placement satisfies every tier at once"
    return InfeasibleError(
        f"{what} does not fit: {head}. Smallest capacities that would work (each with the other tiers unbounded): "
        f"{', '.join(minimal)}. Fix: a machine (or --device-memory-gb) with at least that much, fewer layers, "
        f"a smaller batch or sequence")




@frozen
class LowerBound:
    """No schedule of the trace on the hardware is faster than `seconds` (= the busiest resource)."""

    seconds: float
    resource: str  # the channel (or "COMPUTE") that sets it
    seconds_per_resource: dict[str, float]


# Note (the physical bound, `lower_bound`): the busiest resource's unavoidable work over its
# bandwidth, whatever the schedule: the model's compute, the PARAM bytes that cannot stay on the GPU
# (fetched before forward and again before backward), the optimizer work that cannot run on the GPU
# (grads down and CPU Adam, or OS streamed both ways) and the model data that fits neither GPU nor
# CPU memory (read and written on the SSDs every iteration). With several ranks (data parallel,
# `hardware.cluster.world_size` = p) the bound is per rank: the GPUs together hold p times as much,
# each rank moves its share (1/p) of what must cross PCIe over its own link, a node's CPU optimizer
# and HOST memory are shared by its ranks, and every rank must at least exchange 2 (p-1)/p of the
# grads over INTER_GPU (the bandwidth-optimal all-reduce; the chunk scheme moves 3 (p-1)/p,
# PatrickStar §7).
def lower_bound(problem: Problem) -> LowerBound:
    """The busiest resource's unavoidable work over its rate, for any schedule (see the note above)."""
    hw = problem.hardware
    ranks = problem.world_size
    nodes = -(-ranks // problem.ranks_per_node)  # each with its own HOST memory and CPU
    p = problem.trace.param_count
    item = problem.list_itemsize(ChunkList.PARAM)
    os_item = sum(problem.list_itemsize(x) for x in problem.os_lists)
    param_bytes = p * item
    n = len(problem.blocks)
    # the least non-model data a plan can have: every block recomputed with its input off the GPU until
    # its reload (tide's one non-model curve, `planner.decisions.non_model_curve`, the one the
    # materializer budgets with; the reload moment is the one every emitted schedule uses)
    nm = [int(x) for x in non_model_curve(problem, (ActivationMode.RECOMPUTE,) * n, Tier.HOST)]
    first_backward = next((m.id for m in problem.moments if m.phase.value == "BACKWARD"), 0)
    # the ranks' GPUs together: each rank keeps its shard, what does not fit comes over its own link
    cap_start = ranks * (problem.device_bytes - nm[0])
    cap_turn = ranks * (problem.device_bytes - nm[first_backward])
    h2d = max(0, param_bytes - cap_start) + max(0, param_bytes - cap_turn)
    # params whose Adam state cannot sit on the GPUs next to the params they must hold
    dev_free = max(0, ranks * (problem.device_bytes - max(nm)) - max(0, param_bytes - h2d // 2))
    rest = max(0.0, p - dev_free / max(1, os_item))
    # each of them: CPU Adam (grads down) or OS streamed up and down; best split by ternary search
    # the fastest rate of a copy of any size (costmodel.fastest_bytes_per_s; the flat rates without a table)
    rate_h2d, rate_d2h = fastest_bytes_per_s(hw, Channel.H2D), fastest_bytes_per_s(hw, Channel.D2H)
    # CPU Adam at the fastest rate the simulator can charge a step (costmodel.optimizer_step_price:
    # alone, at the executor's thread count of an overlapped step or of one at the OPTIMIZER moment)
    adam_per_param = min(optimizer_step_price(hw, Tier.HOST, 1, threads=cpu_adam_threads(hw, overlapped=o),
                                              mixed_precision=problem.mixed_precision).seconds for o in (False, True))

    def load(s: float) -> dict[str, float]:  # PCIe per rank (1/p each); the node's CPU shared
        return {"H2D": (h2d + os_item * (rest - s)) / ranks / rate_h2d,
                "D2H": (item * s + os_item * (rest - s)) / ranks / rate_d2h,
                "CPU_OPTIMIZER": s / nodes * adam_per_param}

    lo, hi = 0.0, rest
    for _ in range(100):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if max(load(a).values()) <= max(load(b).values()):
            hi = b
        else:
            lo = a
    per = load((lo + hi) / 2)
    per["COMPUTE"] = problem.compute_seconds
    if ranks > 1:  # the grads must be averaged: at least an all-reduce's 2 (p-1)/p of them per rank
        per["INTER_GPU"] = 2 * (ranks - 1) / ranks * param_bytes / hw.inter_gpu_bytes_per_s
    # model data that fits neither the GPUs nor the CPU lives on the SSDs: read and written every step
    excess = max(0, p * (item + os_item) - max(0, ranks * (problem.device_bytes - max(nm))) - nodes * problem.host_bytes)
    if excess:
        per["NVME"] = nvme_seconds(hw, excess, excess)  # the least time of any interleaving (costmodel.nvme_time_rows)
    resource = max(per, key=lambda k: per[k])
    return LowerBound(seconds=per[resource], resource=resource, seconds_per_resource=per)


# Note [the bound of a set of decisions]:
# A set of decisions (planner.materialize.Decisions) fixes work that a server of the simulator must do whatever
# materialize emits for it, and each server is a FIFO (Note [simulator channels] in planner/sim_actions.py), so
# no replay of the decisions is shorter than the busiest server's share of it:
# - COMPUTE (per rank): the moments' work, the recompute of every RECOMPUTE block at its first backward moment,
#   and the Adam steps the decisions run on DEVICE (`device.optimizer_params_per_s`);
# - the SSDs (per node): each chunk whose OS lives on NVME starts valid there only (planner.emit.
#   initial_residency) and steps on DEVICE or HOST, so each of its OS lists is read at least once and written
#   back at least once (its NVME copy is stale after the step), in V >= the least time of the drives' rows
#   (costmodel.nvme_seconds, which every replay satisfies: Note [two-way links in the simulator]);
# - CPU_OPTIMIZER (per node): the Adam steps run on HOST, W seconds of work at their fastest price (alone, at
#   either thread count a replay steps with); while copies run (V seconds at least, the drives') a step keeps at
#   most s of its speed (costmodel.cpu_adam_beside_copies, the largest over its steps), so in T seconds the CPU
#   does at most (T - V) + s V of that work (Note [CPU Adam beside copies]): T >= W + (1 - s) V.
# Used elements only (an OS copy moves its whole chunk; a weaker bound never misleads). With several ranks the
# ranks' (nodes') mean load, never above the busiest one's. solve uses it to leave a reference decision set
# unreplayed where it cannot be faster than a replay it already has.
def decisions_bound(problem: Problem, decisions) -> LowerBound:
    """No replay of `decisions` on `problem` is faster than `seconds` (Note [the bound of a set of decisions])."""
    hw = problem.hardware
    ranks = problem.world_size
    nodes = -(-ranks // problem.ranks_per_node)
    layout = decisions.layout
    stepped = {t.chunk for t in layout.tensors if t.trainable}
    threads = {hw.host.cores, cpu_adam_threads(hw, overlapped=True)}
    mixed = problem.mixed_precision
    os_item = sum(problem.list_itemsize(x) for x in problem.os_lists)
    cpu = device = 0.0
    kept = 0.0  # s: the largest share of its speed a CPU step keeps beside copies
    nvme_bytes = 0
    for plan in decisions.chunk_plans:
        if plan.chunk not in stepped:
            continue
        params = layout.chunks[plan.chunk].used_elements
        if plan.optimizer_tier is Tier.HOST:
            cpu += min(optimizer_step_price(hw, Tier.HOST, params, threads=t, mixed_precision=mixed).seconds for t in threads)
            kept = max(kept, *(cpu_adam_beside_copies(hw, threads=t, mixed_precision=mixed, params=params) for t in threads))
        else:
            device += optimizer_step_price(hw, Tier.DEVICE, params).seconds
        if plan.os_tier is Tier.NVME:
            nvme_bytes += params * os_item
    recompute = sum(b.recompute_seconds for b, mode in zip(problem.blocks, decisions.activation_modes)
                    if mode is ActivationMode.RECOMPUTE)
    nvme = nvme_seconds(hw, nvme_bytes / nodes, nvme_bytes / nodes) if nvme_bytes else 0.0
    per = {"COMPUTE": problem.compute_seconds + recompute + device / ranks,
           "CPU_OPTIMIZER": cpu / nodes + (1 - kept) * nvme if cpu else 0.0}
    if nvme_bytes:
        per["NVME"] = nvme
    resource = max(per, key=lambda k: per[k])
    return LowerBound(seconds=per[resource], resource=resource, seconds_per_resource=per)


__all__ = ["INFINITE_BYTES", "LowerBound", "decisions_bound", "explain_infeasible", "lower_bound"]
