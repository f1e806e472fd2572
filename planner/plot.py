"""`python -m planner plot SCHEDULE -o out.png`: a schedule at a glance.

Top panels, one per tier that holds anything (DEVICE, HOST, NVME): the "tide" of memory over one
iteration (PatrickStar Fig. 2 shows the non-model part of it on the GPU): bytes held at each
moment, stacked into non-model data, activations and each chunk list, with the tier's budget as a
dashed line. Bottom panel: what each channel is busy with over the same time axis (compute, H2D,
D2H, NVMe read/write, CPU optimizer, between GPUs), one lane per channel.

Every number comes from the simulator (`planner.simulate.simulate`): `plot_series` returns exactly
the arrays drawn, so a test can hold them against the SimResult. matplotlib is imported lazily
with the Agg backend (no display needed, and `planner` stays importable without it).
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

from schemas import Hardware, Schedule, atomic_write_bytes
from schemas.schedule import Channel, ChunkList, Phase, Tier

from planner.errors import PlannerError
from planner.presets import preset_names, resolve_hardware
from planner.simulate import simulate

GB = 1e9  # the hardware profiles' unit (10^9 bytes)
LANES = (Channel.COMPUTE, Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE,
         Channel.CPU_OPTIMIZER, Channel.INTER_GPU)
LANE_LABELS = {
    Channel.COMPUTE: "GPU compute",
    Channel.H2D: "H2D (host→GPU)",
    Channel.D2H: "D2H (GPU→host)",
    Channel.NVME_READ: "NVMe read",
    Channel.NVME_WRITE: "NVMe write",
    Channel.CPU_OPTIMIZER: "CPU optimizer",
    Channel.INTER_GPU: "between GPUs",
}
LAYER_LABELS = {
    "non_model": "non-model data (temporaries)",
    "activations": "activations (saved for backward)",
    ChunkList.PARAM.value: "PARAM chunks (compute copy)",
    ChunkList.GRAD.value: "GRAD chunks",
    ChunkList.MASTER.value: "MASTER chunks (fp32 params)",
    ChunkList.M.value: "Adam m chunks",
    ChunkList.V.value: "Adam v chunks",
}
# colour-blind-safe (Okabe-Ito), one per layer, stable across plots
LAYER_COLORS = {
    "non_model": "#999999",
    "activations": "#E69F00",
    ChunkList.PARAM.value: "#0072B2",
    ChunkList.GRAD.value: "#56B4E9",
    ChunkList.MASTER.value: "#009E73",
    ChunkList.M.value: "#CC79A7",
    ChunkList.V.value: "#D55E00",
}
LANE_COLORS = {
    Channel.COMPUTE: "#009E73",
    Channel.H2D: "#0072B2",
    Channel.D2H: "#56B4E9",
    Channel.NVME_READ: "#D55E00",
    Channel.NVME_WRITE: "#E69F00",
    Channel.CPU_OPTIMIZER: "#CC79A7",
    Channel.INTER_GPU: "#999999",
}
PHASE_SHADES = {Phase.FORWARD: "#f2f2f2", Phase.BACKWARD: "#e4e4e4", Phase.OPTIMIZER: "#d6d6d6"}


def _budget_bytes(schedule: Schedule, tier: Tier) -> int:
    return {Tier.DEVICE: schedule.budgets.device_bytes, Tier.HOST: schedule.budgets.host_bytes,
            Tier.NVME: schedule.budgets.nvme_bytes}[tier]


def plot_series(schedule: Schedule, hardware: Hardware, *, sim: Any = None) -> dict[str, Any]:
    """Exactly what `plot` draws, in bytes and seconds, taken from the simulator's result.

    Returns {
      "moment_start_seconds": [T floats] (x of moment m), "iteration_seconds": float,
      "tiers": {tier: {"layers": {layer: [T ints]}, "total_bytes": [T ints], "budget_bytes": int, "peak_bytes": int}},
      "lanes": {channel: [(start_seconds, duration_seconds), ...]},
      "phases": [(phase, start_seconds, end_seconds)],
    }
    Layers are "non_model", "activations" and the chunk lists; tiers that never hold a byte are left out.
    "total_bytes" is held during each moment's work; "peak_bytes" is the simulator's peak, which also counts
    what a moment holds between its actions (grads written back and stepped within a moment).
    """
    if sim is None:
        sim = simulate(schedule, hardware)
    n_moments = len(schedule.moments)
    starts = [float(x) for x in sim.moment_start_seconds]
    lists = [lst.value for lst in schedule.layout.lists]
    tiers: dict[str, Any] = {}
    for tier in Tier:
        layers = {"non_model": [0] * n_moments, "activations": [0] * n_moments, **{lst: [0] * n_moments for lst in lists}}
        for sample in sim.memory:
            if sample.tier != tier:
                continue
            m = sample.moment
            layers["non_model"][m] = int(sample.non_model_bytes)
            layers["activations"][m] = int(sample.activation_bytes)
            for lst, nbytes in sample.chunk_bytes.items():
                key = lst.value if isinstance(lst, ChunkList) else str(lst)
                layers.setdefault(key, [0] * n_moments)[m] = int(nbytes)
        total = [sum(layer[m] for layer in layers.values()) for m in range(n_moments)]
        if tier is Tier.DEVICE or any(total):
            layers = {k: v for k, v in layers.items() if any(v)}  # an empty layer would only crowd the legend
            tiers[tier.value] = {"layers": layers, "total_bytes": total, "budget_bytes": _budget_bytes(schedule, tier),
                                 "peak_bytes": int(sim.peak_bytes_per_tier.get(tier, 0))}
    lanes: dict[str, list[tuple[float, float]]] = {}
    for interval in sim.timeline:
        channel = Channel(interval.channel)
        if interval.end_seconds > interval.start_seconds:
            lanes.setdefault(channel.value, []).append(
                (float(interval.start_seconds), float(interval.end_seconds) - float(interval.start_seconds)))
    lanes = {c.value: lanes[c.value] for c in LANES if c.value in lanes}
    phases: list[tuple[str, float, float]] = []
    for m in schedule.moments:
        start = starts[m.id]
        end = starts[m.id + 1] if m.id + 1 < n_moments else float(sim.iteration_seconds)
        if phases and phases[-1][0] == m.phase.value:
            phases[-1] = (phases[-1][0], phases[-1][1], end)
        else:
            phases.append((m.phase.value, start, end))
    return {
        "moment_start_seconds": starts,
        "iteration_seconds": float(sim.iteration_seconds),
        "tiers": tiers,
        "lanes": lanes,
        "phases": phases,
    }


def _steps(xs: list[float], end: float, ys: list[float]) -> tuple[list[float], list[float]]:
    """Moment m holds its bytes from its start until moment m+1: a step curve ending at `end`."""
    return [*xs, end], [*ys, ys[-1] if ys else 0.0]


def make_figure(schedule: Schedule, series: dict[str, Any]) -> Any:
    """The matplotlib Figure of `series` (see `plot_series`)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    tiers = series["tiers"]
    lanes = series["lanes"]
    n_rows = len(tiers) + 1
    heights = [3.0] * len(tiers) + [0.5 + 0.35 * max(len(lanes), 1)]
    fig, axes = plt.subplots(n_rows, 1, figsize=(12, sum(heights) + 1.2), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    axes = [row[0] for row in axes]
    xs, end = series["moment_start_seconds"], series["iteration_seconds"]
    h = schedule.header
    fig.suptitle(f"{h.model_name} on {h.hardware_name} ({h.policy} schedule): "
                 f"{end:.4g} s per iteration predicted by the simulator", fontsize=12)

    for ax, (tier, data) in zip(axes, tiers.items()):
        _shade_phases(ax, series["phases"], label=True)
        bottom = [0.0] * len(xs)
        for layer, values in data["layers"].items():
            top = [b + v / GB for b, v in zip(bottom, values)]
            sx, sb = _steps(xs, end, bottom)
            _, st = _steps(xs, end, top)
            ax.fill_between(sx, sb, st, step="post", color=LAYER_COLORS.get(layer, "#444444"), linewidth=0,
                            label=LAYER_LABELS.get(layer, layer), gid=f"layer:{tier}:{layer}")
            bottom = top
        sx, st = _steps(xs, end, [v / GB for v in data["total_bytes"]])
        ax.step(sx, st, where="post", color="black", linewidth=0.8, label="total", gid=f"total:{tier}")
        budget = data["budget_bytes"] / GB
        during = max(data["total_bytes"], default=0) / GB
        peak = data["peak_bytes"] / GB  # the simulator's: at least every moment's total
        # a budget far above the peak would flatten the tide into a line: zoom on the data, say so
        off_scale = peak > 0 and budget > 4 * peak
        label = f"budget {budget:.3g} GB" + (" (above this panel)" if off_scale else "")
        ax.axhline(budget, color="red", linestyle="--", linewidth=1.2, label=label, gid=f"budget:{tier}")
        ax.set_ylim(0, (peak * 1.15 if off_scale else max(budget, peak) * 1.08) or 1.0)
        ax.set_ylabel(f"{tier} memory (GB)")
        between = f" between actions, {during:.3g} GB during work" if peak > during else ""
        ax.set_title(f"{tier}: bytes held over the iteration (peak {peak:.3g} GB{between}, budget {budget:.3g} GB"
                     f"{', above the top of this panel' if off_scale else ''})", fontsize=10, loc="left")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.grid(axis="y", alpha=0.3)

    ax = axes[-1]
    _shade_phases(ax, series["phases"], label=False)
    names = list(lanes)
    for i, channel in enumerate(names):
        y = len(names) - 1 - i  # first lane (compute) on top
        ax.broken_barh(lanes[channel], (y - 0.4, 0.8), facecolors=LANE_COLORS.get(Channel(channel), "#444444"),
                       edgecolor="white", linewidth=0.2, gid=f"lane:{channel}")
    ax.set_yticks(range(len(names)), [LANE_LABELS[Channel(c)] for c in reversed(names)], fontsize=8)
    ax.set_ylim(-0.6, max(len(names), 1) - 0.4)
    ax.set_title("channels: when each transfer path and processor is busy (simulated)", fontsize=10, loc="left")
    ax.set_xlabel("time since the iteration started (seconds, simulated)")
    ax.set_xlim(0, end if end > 0 else 1.0)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def _shade_phases(ax: Any, phases: list[tuple[str, float, float]], *, label: bool) -> None:
    span = max((end for _, _, end in phases), default=0.0) or 1.0
    for phase, start, end in phases:
        ax.axvspan(start, end, color=PHASE_SHADES[Phase(phase)], zorder=0, linewidth=0)
        if label and (end - start) > 0.08 * span:  # a label wider than its phase would spill into the next
            ax.text((start + end) / 2, 0.97, phase.lower(), transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=8, color="#555555", clip_on=True)


def plot_schedule(schedule: Schedule, hardware: Hardware, out: str | Path) -> dict[str, Any]:
    """Simulate, draw and write the PNG; returns the series drawn."""
    import matplotlib.pyplot as plt

    series = plot_series(schedule, hardware)
    fig = make_figure(schedule, series)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out, buffer.getvalue())
    return series


def _hardware_for(schedule: Schedule, spec: str | None) -> Hardware:
    """--hardware, else the preset the schedule was solved for (by name)."""
    if spec is None:
        if schedule.header.hardware_name not in preset_names():
            raise PlannerError(f"schedule was solved for hardware {schedule.header.hardware_name!r}, which is not a "
                               f"preset: pass the profile it was solved for with --hardware PATH")
        spec = schedule.header.hardware_name
    hardware = resolve_hardware(spec)
    if hardware.digest != schedule.header.hardware_digest:
        print(f"warning: hardware {spec!r} differs from the one the schedule was solved for "
              f"({schedule.header.hardware_name}); the plot simulates it on {hardware.name}", file=sys.stderr)
    return hardware


def _run(args: argparse.Namespace) -> int:
    schedule = Schedule.read(args.schedule)
    hardware = _hardware_for(schedule, args.hardware)
    plot_schedule(schedule, hardware, args.output)
    print(f"wrote {args.output}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plot",
        description="Simulate SCHEDULE and draw the tide of memory on DEVICE and HOST (stacked by non-model "
                    "data, activations and chunk list, with the budget) and the busy time of each channel.",
    )
    p.add_argument("schedule", metavar="SCHEDULE", help="schedule file (.msgpack)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.png", help="PNG to write")
    p.add_argument("--hardware", metavar="H", default=None,
                   help="preset name or TOML path to simulate on (default: the preset named in the schedule)")
    p.set_defaults(func=_run)


__all__ = ["make_figure", "plot_schedule", "plot_series", "register"]
