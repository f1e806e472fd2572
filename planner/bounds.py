"""Lower bounds on the iteration time, and explanations for models that do not fit.

Two bounds, the header takes the larger (DESIGN.md §4.3, "always a lower bound so the gap is known"):
- the LP relaxation of the placement model (planner.placement), minimised over the chunk sizes
  evaluated: no integral plan of that model is faster;
- the physical limit: every channel must at least carry the work no placement can avoid
  (total compute; the grads of the chunks that cannot keep their optimizer state on DEVICE go
  down and their params come back up; the optimizer state that fits neither DEVICE nor HOST goes
  through the SSDs twice; the CPU Adam over those chunks), each divided by its rate.
gap = (objective - bound) / objective.

When the model has no solution, `explain_infeasible` says which tier runs out, at which stage, by
how many bytes, and the smallest DEVICE / HOST / NVME capacity that would work, computed from the
same model with that tier's capacity as the objective (the other tiers as given, and unbounded).
"""

from __future__ import annotations

from schemas._base import format_bytes

from planner.errors import InfeasibleError
from planner.placement import INFINITE_BYTES, PlacementInput, Tier3, minimal_capacity



def physical_lower_bound_seconds(data: PlacementInput) -> float:
    """max over channels of unavoidable work / rate, and the device's own compute."""
    compute = sum(st.compute_seconds for st in data.stages)
    trainable = [g for g in data.groups if g.trainable]
    param_bytes = sum(g.count * g.param_bytes for g in data.groups)
    os_bytes = sum(g.count * g.os_bytes for g in trainable)
    elements = sum(g.count * g.elements for g in trainable)
    if not elements:
        return compute
    # bytes per trainable element when a chunk lives on DEVICE entirely (PARAM, GRAD, OS)
    per_element_full = (sum(g.count * (2 * g.param_bytes + g.os_bytes) for g in trainable)) / elements
    room = max(0.0, data.device_bytes - min((st.non_model_bytes for st in data.stages), default=0)
               - (param_bytes - sum(g.count * g.param_bytes for g in trainable)))
    on_device_elements = min(elements, room / per_element_full) if per_element_full > 0 else elements
    off = elements - on_device_elements  # elements whose Adam runs on the CPU, whatever the plan
    grad_item = sum(g.count * g.param_bytes for g in trainable) / elements
    os_item = os_bytes / elements
    d2h = off * grad_item / data.d2h_bytes_per_s
    h2d = off * grad_item / data.h2d_bytes_per_s
    cpu = off * data.cpu_adam_seconds_per_element
    # OS of the CPU-stepped chunks that does not fit on HOST (next to every HOST PARAM copy) goes to NVMe
    host_room = max(0.0, data.host_bytes - off * grad_item)
    nvme_os = max(0.0, off * os_item - host_room)
    nvme = 0.0
    if nvme_os > 0 and data.has_nvme:
        nvme = nvme_os / data.nvme_read_bytes_per_s + nvme_os / data.nvme_write_bytes_per_s
    return max(compute, d2h, h2d, cpu, nvme)


def explain_infeasible(data: PlacementInput, *, stage_names: list[str] | None = None, what: str = "the model") -> InfeasibleError:
    """An InfeasibleError naming the tier that runs out, the stage, the shortfall and the minimal capacities."""
    names = stage_names or [st.name for st in data.stages]
    given = {Tier3.DEVICE: data.device_bytes, Tier3.HOST: data.host_bytes, Tier3.NVME: data.nvme_bytes}
    alone: dict[Tier3, tuple[int, int] | None] = {}
    for tier in Tier3:
        alone[tier] = minimal_capacity(data, tier, relax_others=True)
    short = [t for t in Tier3 if alone[t] is not None and alone[t][0] > given[t]]
    parts = []
    for tier in short or list(Tier3):
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
        for tier in Tier3:
            joint = minimal_capacity(data, tier, relax_others=False)
            if joint is not None and joint[0] > given[tier]:
                need, stage = joint
                where = f" at stage {stage} ({names[stage]})" if stage >= 0 else ""
                parts.append(f"{tier.value} runs out{where} with the other tiers as given: it needs "
                             f"{format_bytes(need)}, the capacity is {format_bytes(given[tier])} ({need - given[tier]} bytes short)")
    minimal = []
    for tier in Tier3:
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


__all__ = ["explain_infeasible", "physical_lower_bound_seconds", "INFINITE_BYTES"]
