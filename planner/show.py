"""`python -m planner validate FILE` and `python -m planner show FILE`: check and summarise any tide file.

`validate` loads the file with every check the planner and executor apply (JSON Schema, then the
semantic rules) and says so in one line. `show` summarises a trace, a hardware profile or a
schedule in a few tables that fit one screen however big the model is (counts and totals, never
one row per tensor); `--json` prints the same summary as one JSON object for scripts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.errors import PlannerError
from planner.presets import hardware_for
from planner.verify import verify_schedule
from schemas import FormatError, Hardware, Schedule, Trace, load_any
from schemas._base import read_bytes
from schemas.hardware import HARDWARE_FORMAT, HARDWARE_VERSION, estimated_fields
from schemas.schedule import SCHEDULE_FORMAT, SCHEDULE_VERSION, Op, Tier
from schemas.trace import DTYPE_BYTES, TRACE_FORMAT, TRACE_VERSION, Phase, trace_digest

FORMATS: dict[type, tuple[str, str, int]] = {
    Trace: ("trace", TRACE_FORMAT, TRACE_VERSION),
    Hardware: ("hardware", HARDWARE_FORMAT, HARDWARE_VERSION),
    Schedule: ("schedule", SCHEDULE_FORMAT, SCHEDULE_VERSION),
}
# per-block rows are listed only up to this many blocks; bigger models get min/mean/max
MAX_LISTED_BLOCKS = 8


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate",
        description="Load FILE (trace .msgpack, schedule .msgpack or hardware .toml) with every check tide applies; "
                    "a schedule is also replayed by the simulator (valid sources, last copies, one optimizer step "
                    "per param, bytes per channel == prediction) and checked against --trace. "
                    "Exit 0 if it is valid, 2 with one line naming the field and the fix if not.",
    )
    p.add_argument("file", metavar="FILE", help="a tide trace, schedule (.msgpack) or hardware profile (.toml)")
    p.add_argument("--trace", metavar="TRACE", help="schedule only: the trace it was solved from (checks header.trace_digest)")
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help="schedule only: hardware to replay it on (default: the preset named in its header)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run_validate)

    p = subparsers.add_parser(
        "show",
        description="Summarise FILE: a trace (model, parameters, moments, non-model peak, compute per phase), a "
                    "hardware profile (every capacity and rate with derived bytes), or a schedule (layout, residency, "
                    "activation plan, predicted time, bytes per channel, peaks).",
    )
    p.add_argument("file", metavar="FILE", help="a tide trace, schedule (.msgpack) or hardware profile (.toml)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run_show)


# ----------------------------------------------------------------------------- validate


def run_validate(args: argparse.Namespace) -> int:
    try:
        obj = load_any(args.file)
        if isinstance(obj, Schedule):
            _verify(obj, args)
        elif getattr(args, "trace", None) or getattr(args, "hardware", None):
            raise PlannerError(f"{args.file}: --trace and --hardware apply to a schedule, this is a "
                               f"{FORMATS[type(obj)][0]}; drop them")
    except (FormatError, PlannerError) as exc:
        if args.json:  # scripts get a JSON answer on stdout too; the one line still goes to stderr
            print(json.dumps({"ok": False, "file": args.file, "error": str(exc)}))
        raise
    kind, fmt, version = FORMATS[type(obj)]
    extra: dict[str, Any] = {"estimates": _estimates(args.file)} if isinstance(obj, Hardware) else {}
    if args.json:
        print(json.dumps({"ok": True, "file": args.file, "kind": kind, "format": fmt, "format_version": version, **extra}))
    else:
        print(f"ok: {args.file} is a valid tide {kind} (format {version})")
        if extra.get("estimates"):
            print(f"  tide estimates (no source, check them): {', '.join(extra['estimates'])}")
    return 0


def _verify(schedule: Schedule, args: argparse.Namespace) -> None:
    """The simulator's semantic checks and the trace digest (planner/verify.py)."""
    hardware = hardware_for(schedule, getattr(args, "hardware", None), source=args.file)
    digest = None
    if getattr(args, "trace", None):
        Trace.read(args.trace)  # a trace that does not load is its own one-line error
        digest = trace_digest(read_bytes("trace", args.trace))
    verify_schedule(schedule, hardware, source=args.file, trace_digest=digest)


# ----------------------------------------------------------------------------- show


def run_show(args: argparse.Namespace) -> int:
    obj = load_any(args.file)
    summary: dict[str, Any]
    if isinstance(obj, Trace):
        summary = summarize_trace(obj)
    elif isinstance(obj, Hardware):
        summary = summarize_hardware(obj, estimates=_estimates(args.file))
    else:
        summary = summarize_schedule(obj)
    summary = {"file": args.file, **summary}
    if args.json:
        print(json.dumps(summary, indent=2, default=str))  # model configs may hold bytes
        return 0
    console = Console(markup=False, highlight=False, emoji=False)
    if not console.is_terminal:  # piped into a file or a test: wide enough that no table wraps
        console.width = 140
    {"trace": _print_trace, "hardware": _print_hardware, "schedule": _print_schedule}[summary["kind"]](console, summary)
    return 0


def summarize_trace(trace: Trace) -> dict[str, Any]:
    meta = trace.meta
    tied = [t for t in trace.tensors if len(t.names) > 1]
    peak = max(trace.moments, key=lambda m: m.non_model_bytes)
    per_phase = {
        phase.value: {
            "moments": len(ms),
            "compute_seconds": sum(m.compute_seconds for m in ms),
            "flops": sum(m.flops for m in ms),
        }
        for phase in Phase
        for ms in [trace.moments_of(phase)]
    }
    block_bytes = trace.block_activation_bytes()
    return {
        "kind": "trace",
        "format": TRACE_FORMAT,
        "format_version": TRACE_VERSION,
        "model": {
            "name": meta.model_name, "config": meta.model_config, "batch_shape": list(meta.batch_shape),
            "compute_dtype": meta.compute_dtype.value, "world_size": meta.world_size, "optimizer": meta.optimizer.value,
            "torch_version": meta.torch_version,
        },
        "recording": {"recording": meta.recording.value, "device": meta.device, "time_source": meta.time_source.value},
        "params": {
            "count": trace.param_count,
            "bytes": trace.param_bytes,
            "tensors": len(trace.tensors),
            "trainable_tensors": sum(t.trainable for t in trace.tensors),
            "tied_tensors": len(tied),
            "tied_examples": [list(t.names) for t in tied[:3]],
        },
        "moments": {"count": len(trace.moments), "per_phase": per_phase},
        "blocks": {
            "count": len(trace.blocks),
            "first": trace.blocks[0].module if trace.blocks else None,
            "last": trace.blocks[-1].module if trace.blocks else None,
            "recompute_flops": sum(b.forward_flops for b in trace.blocks),
            "recompute_seconds": sum(b.forward_seconds for b in trace.blocks),
        },
        "peak_non_model": {
            "bytes": peak.non_model_bytes, "moment": peak.id, "phase": peak.phase.value, "kind": peak.kind.value,
            "module": peak.module,
        },
        "compute": {
            "seconds": sum(m.compute_seconds for m in trace.moments),
            "flops": sum(m.flops for m in trace.moments),
        },
        "activations": {
            "count": len(trace.activations),
            "bytes": sum(a.bytes for a in trace.activations),
            "outside_blocks_bytes": sum(a.bytes for a in trace.activations if a.block < 0),
            "per_block": _spread(block_bytes),
            "blocks": [
                {"block": b.id, "module": b.module, "bytes": block_bytes[b.id], "input_bytes": b.input_bytes}
                for b in trace.blocks
            ] if len(trace.blocks) <= MAX_LISTED_BLOCKS else None,
        },
    }


def _estimates(path: str) -> list[str]:
    """The numbers of a hardware TOML marked "tide estimate" (no source)."""
    return list(estimated_fields(Path(path).read_text(encoding="utf-8")))


def _span(values: list[float]) -> str:
    return f"{min(values):.3g}" if min(values) == max(values) else f"{min(values):.3g}-{max(values):.3g}"


def _table(field: str, values: list[float], unit: str, what: str, notes: list[str]) -> tuple:
    """One row for a measured table (a profile has dozens of shapes): its size and the span of its
    values; `--json` carries every entry under "tables"."""
    if not values:
        return (field, 0, f"{what} (none: flat rates)", "", None, "")
    return (field, len(values), f"{what}, {_span(values)} {unit}" + "".join(f"; {n}" for n in notes), "", None, "")


def summarize_hardware(hw: Hardware, *, estimates: list[str] | None = None) -> dict[str, Any]:
    d, h, n, link, c = hw.device, hw.host, hw.nvme, hw.links, hw.cluster
    rows = [
        # (field, value, unit, derived quantity, derived value, derived unit)
        ("device.kind", d.kind.value, "", "", None, ""),
        ("device.name", d.name, "", "", None, ""),
        ("device.memory_gb", d.memory_gb, "GB", "", None, ""),
        ("device.usable_fraction", d.usable_fraction, "", "DEVICE usable", hw.device_bytes, "bytes"),
        ("device.compute_tflops", d.compute_tflops, "TFLOP/s", "device compute", hw.device_flops_per_s, "FLOP/s"),
        ("device.optimizer_params_per_s", d.optimizer_params_per_s, "params/s", "", None, ""),
        ("device.memory_margin_gb", d.memory_margin_gb, "GB", "allocator margin", hw.device_margin_bytes, "bytes"),
        _table("device.matmul_rates", [r.tflops for r in d.matmul_rates], "TFLOP/s", "shapes",
               sorted({r.dtype.value for r in d.matmul_rates})),
        _table("device.attention_rates", [r.forward_tflops for r in d.attention_rates], "TFLOP/s forward", "shapes",
               [f"backward {_span([r.backward_tflops for r in d.attention_rates])}"] if d.attention_rates else []),
        ("host.memory_gb", h.memory_gb, "GB", "", None, ""),
        ("host.usable_fraction", h.usable_fraction, "", "HOST usable", hw.host_bytes, "bytes"),
        ("host.optimizer_params_per_s", h.optimizer_params_per_s, "params/s", "", None, ""),
        ("host.cores", h.cores, "cores", "CPU Adam at all cores", hw.cpu_adam_params_per_s(), "params/s"),
        ("host.dram_gb_per_s", h.dram_gb_per_s, "GB/s", "host DRAM", hw.host_dram_bytes_per_s, "bytes/s"),
        ("host.adam_chunk_params", h.adam_chunk_params, "params", "", None, ""),
        _table("host.adam_rates", [r.params_per_s for r in h.adam_rates], "params/s", "thread counts",
               [f"{_span([r.threads for r in h.adam_rates])} threads",
                f"with copies {_span([r.params_per_s_with_copies for r in h.adam_rates])}",
                f"bf16/fp16 step {_span([r.mixed_precision_params_per_s for r in h.adam_rates])}"
                if any(r.mixed_precision_params_per_s for r in h.adam_rates) else
                "bf16/fp16 step not measured: priced as fp32"] if h.adam_rates else []),
        ("host.adam_dram_bytes_per_param", h.adam_dram_bytes_per_param, "B/param", "", None, ""),
        ("nvme.count", n.count, "SSDs", "", None, ""),
        ("nvme.capacity_gb_each", n.capacity_gb_each, "GB", "", None, ""),
        ("nvme.usable_fraction", n.usable_fraction, "", "NVME usable", hw.nvme_bytes, "bytes"),
        ("nvme.read_gb_per_s_each", n.read_gb_per_s_each, "GB/s", "NVMe read (all SSDs)", hw.nvme_read_bytes_per_s, "bytes/s"),
        ("nvme.write_gb_per_s_each", n.write_gb_per_s_each, "GB/s", "NVMe write (all SSDs)", hw.nvme_write_bytes_per_s, "bytes/s"),
        ("nvme.mixed_read_gb_per_s_each", n.mixed_read_gb_per_s_each, "GB/s", "", None, ""),
        ("nvme.mixed_write_gb_per_s_each", n.mixed_write_gb_per_s_each, "GB/s", "", None, ""),
        ("nvme.host_cap_gb_per_s", n.host_cap_gb_per_s, "GB/s", "", None, ""),
        _table("nvme.chunk_rates", [r.read_gb_per_s_each for r in n.chunk_rates], "GB/s read each", "chunk sizes",
               [f"{_span([r.chunk_bytes / 2**20 for r in n.chunk_rates])} MiB",
                f"write {_span([r.write_gb_per_s_each for r in n.chunk_rates])}"] if n.chunk_rates else []),
        ("links.h2d_gb_per_s", link.h2d_gb_per_s, "GB/s", "H2D", hw.h2d_bytes_per_s, "bytes/s"),
        ("links.d2h_gb_per_s", link.d2h_gb_per_s, "GB/s", "D2H", hw.d2h_bytes_per_s, "bytes/s"),
        ("links.inter_gpu_gb_per_s", link.inter_gpu_gb_per_s, "GB/s", "INTER_GPU", hw.inter_gpu_bytes_per_s, "bytes/s"),
        ("links.h2d_pageable_gb_per_s", link.h2d_pageable_gb_per_s, "GB/s", "", None, ""),
        ("links.d2h_pageable_gb_per_s", link.d2h_pageable_gb_per_s, "GB/s", "", None, ""),
        ("links.duplex_h2d_gb_per_s", link.duplex_h2d_gb_per_s, "GB/s", "", None, ""),
        ("links.duplex_d2h_gb_per_s", link.duplex_d2h_gb_per_s, "GB/s", "", None, ""),
        ("links.inter_node_gb_per_s", link.inter_node_gb_per_s, "GB/s", "", None, ""),
        _table("links.copy_rates", [r.h2d_gb_per_s for r in link.copy_rates], "GB/s H2D", "copy sizes",
               [f"{_span([r.chunk_bytes / 2**20 for r in link.copy_rates])} MiB",
                f"D2H {_span([r.d2h_gb_per_s for r in link.copy_rates])}"] if link.copy_rates else []),
        ("cluster.world_size", c.world_size, "ranks", "", None, ""),
        ("cluster.gpus_per_node", c.gpus_per_node, "GPUs", "", None, ""),
    ]
    return {
        "kind": "hardware",
        "format": HARDWARE_FORMAT,
        "format_version": HARDWARE_VERSION,
        "name": hw.name,
        "description": hw.description,
        "digest": hw.digest,
        "rows": [
            {"field": f, "value": v, "unit": u, "derived": dq or None, "derived_value": dv, "derived_unit": du or None}
            for f, v, u, dq, dv, du in rows
        ],
        "estimates": list(estimates or []),
        "tables": {
            "device.matmul_rates": [dataclasses.asdict(r) for r in d.matmul_rates],
            "device.attention_rates": [dataclasses.asdict(r) for r in d.attention_rates],
            "host.adam_rates": [dataclasses.asdict(r) for r in h.adam_rates],
            "nvme.chunk_rates": [dataclasses.asdict(r) for r in n.chunk_rates],
            "links.copy_rates": [dataclasses.asdict(r) for r in link.copy_rates],
        },
        "derived": {
            "device_bytes": hw.device_bytes, "host_bytes": hw.host_bytes, "nvme_bytes": hw.nvme_bytes,
            "device_flops_per_s": hw.device_flops_per_s, "h2d_bytes_per_s": hw.h2d_bytes_per_s,
            "d2h_bytes_per_s": hw.d2h_bytes_per_s, "nvme_read_bytes_per_s": hw.nvme_read_bytes_per_s,
            "nvme_write_bytes_per_s": hw.nvme_write_bytes_per_s, "inter_gpu_bytes_per_s": hw.inter_gpu_bytes_per_s,
        },
    }


def summarize_schedule(s: Schedule) -> dict[str, Any]:
    hd, lay = s.header, s.layout
    wasted_elements = sum(c.elements - c.used_elements for c in lay.chunks)
    total_elements = sum(c.elements for c in lay.chunks)
    lists = {
        lst.value: {
            "dtype": lay.list_dtypes[lst].value,
            "bytes": total_elements * DTYPE_BYTES[lay.list_dtypes[lst]],
            "wasted_bytes": wasted_elements * DTYPE_BYTES[lay.list_dtypes[lst]],
        }
        for lst in lay.lists
    }
    residency: dict[str, dict[str, int]] = {}
    for lst in lay.lists:
        rows = [r for r in s.initial_residency if r.list is lst]
        counts = {tier.value: sum(tier in r.tiers for r in rows) for tier in Tier}
        counts["nowhere"] = len(lay.chunks) - sum(bool(r.tiers) for r in rows)
        residency[lst.value] = counts
    modes = Counter(p.mode.value for p in s.activation_plans)
    op_counts = Counter(a.op.value for a in s.actions)
    op_bytes = Counter()
    for a in s.actions:
        op_bytes[a.op.value] += a.bytes
    pred = s.prediction
    return {
        "kind": "schedule",
        "format": SCHEDULE_FORMAT,
        "format_version": SCHEDULE_VERSION,
        "header": {
            "policy": hd.policy, "planner_version": hd.planner_version, "model_name": hd.model_name,
            "hardware_name": hd.hardware_name, "world_size": hd.world_size, "solver_status": hd.solver_status.value,
            "objective_seconds": hd.objective_seconds, "lower_bound_seconds": hd.lower_bound_seconds, "gap": hd.gap,
            "trace_digest": hd.trace_digest, "hardware_digest": hd.hardware_digest, "notes": list(hd.notes),
            "host_staging": hd.host_staging.value,
        },
        "budgets": {"DEVICE": s.budgets.device_bytes, "HOST": s.budgets.host_bytes, "NVME": s.budgets.nvme_bytes},
        "layout": {
            "chunk_elements": lay.chunk_elements,
            "chunks": len(lay.chunks),
            "tensors": len(lay.tensors),
            "used_elements": total_elements - wasted_elements,
            "wasted_elements": wasted_elements,
            "wasted_fraction": wasted_elements / total_elements if total_elements else 0.0,
            "lists": lists,
        },
        "residency_at_start": residency,
        "os_tiers": {tier.value: sum(p.os_tier is tier for p in s.chunk_plans) for tier in Tier},
        "optimizer_tiers": {tier.value: sum(p.optimizer_tier is tier for p in s.chunk_plans) for tier in (Tier.DEVICE, Tier.HOST)},
        "activation_plan": {
            "blocks": len(s.activation_plans),
            "per_mode": dict(sorted(modes.items())),
            "per_block": [
                {"block": p.block, "module": p.module, "mode": p.mode.value, "bytes": p.bytes}
                for p in s.activation_plans
            ] if len(s.activation_plans) <= MAX_LISTED_BLOCKS else None,
        },
        "moments": len(s.moments),
        "stages": len(s.stages),
        "prediction": {
            "iteration_seconds": pred.iteration_seconds,
            "flops": pred.flops,
            "tflops": pred.flops / pred.iteration_seconds / 1e12 if pred.iteration_seconds > 0 else None,
            "bytes_per_channel": {ch.value: v for ch, v in pred.bytes_per_channel.items()},
            "busy_seconds_per_channel": {ch.value: v for ch, v in pred.busy_seconds_per_channel.items()},
            "peak_bytes_per_tier": {t.value: v for t, v in pred.peak_bytes_per_tier.items()},
        },
        "actions": {
            "count": len(s.actions),
            "per_op": {op.value: op_counts[op.value] for op in Op if op_counts[op.value]},
            "bytes_per_op": {op.value: op_bytes[op.value] for op in Op if op_counts[op.value]},
        },
    }


# ----------------------------------------------------------------------------- text rendering


def _print_trace(console: Console, s: dict[str, Any]) -> None:
    model, rec, params = s["model"], s["recording"], s["params"]
    top = _kv_table(f"trace {s['file']} (format {s['format_version']})")
    top.add_row("model", f"{model['name']}  batch {model['batch_shape']}  {model['compute_dtype']}  "
                         f"world size {model['world_size']}  {model['optimizer']}")
    top.add_row("config", _clip(json.dumps(model["config"], sort_keys=True, default=str), 160))
    times = "times measured" if rec["time_source"] == "measured" else "times derived from FLOPs at plan time (0 here)"
    top.add_row("recorded", f"{rec['recording']} run on {rec['device'] or '?'}, {times}, torch {model['torch_version']}")
    tied = f", {params['tied_tensors']} tied" + (f" (e.g. {' = '.join(params['tied_examples'][0])})" if params["tied_examples"] else "")
    top.add_row("parameters", f"{params['count']:,} in {params['tensors']:,} tensors{tied}; {_human_bytes(params['bytes'])}"
                              f" ({params['bytes']:,} bytes)")
    blocks = s["blocks"]
    top.add_row("blocks", f"{blocks['count']}" + (f" ({blocks['first']} .. {blocks['last']})" if blocks["count"] else ""))
    peak = s["peak_non_model"]
    top.add_row("peak non-model", f"{_human_bytes(peak['bytes'])} ({peak['bytes']:,} bytes) at moment {peak['moment']} "
                                  f"({peak['phase']} {peak['kind']} {peak['module'] or '(root)'})")
    acts = s["activations"]
    spread = acts["per_block"]
    top.add_row("activations", f"{acts['count']:,} saved tensors, {_human_bytes(acts['bytes'])} ({acts['bytes']:,} bytes); "
                               f"per block min/mean/max {_human_bytes(spread['min'])} / {_human_bytes(spread['mean'])} / "
                               f"{_human_bytes(spread['max'])}; outside blocks {_human_bytes(acts['outside_blocks_bytes'])}")
    console.print(top)
    phases = Table(title="moments and compute per phase", title_justify="left")
    for col in ("phase", "moments", "compute seconds", "FLOPs"):
        phases.add_column(col, justify="left" if col == "phase" else "right")
    for phase, row in s["moments"]["per_phase"].items():
        phases.add_row(phase, f"{row['moments']:,}", f"{row['compute_seconds']:.6g}", f"{row['flops']:.4g}")
    phases.add_row("total", f"{s['moments']['count']:,}", f"{s['compute']['seconds']:.6g}", f"{s['compute']['flops']:.4g}")
    console.print(phases)
    if acts["blocks"]:
        per_block = Table(title="activations per block", title_justify="left")
        for col in ("block", "module", "saved bytes", "input bytes"):
            per_block.add_column(col, justify="right" if "bytes" in col or col == "block" else "left")
        for row in acts["blocks"]:
            per_block.add_row(str(row["block"]), row["module"], f"{row['bytes']:,}", f"{row['input_bytes']:,}")
        console.print(per_block)


def _print_hardware(console: Console, s: dict[str, Any]) -> None:
    table = Table(title=f"hardware {s['name']} ({s['file']}, format {s['format_version']}): {s['description']}", title_justify="left")
    for col in ("field", "value", "unit", "derived", "derived value"):
        # the unit column carries the long text (a measured table's span): it wraps, numbers never do
        table.add_column(col, justify="right" if "value" in col else "left", no_wrap=col != "unit")
    for row in s["rows"]:
        value = row["value"]
        derived = ""
        if row["derived_value"] is not None:
            dv, unit = row["derived_value"], row["derived_unit"]
            derived = f"{int(dv):,} {unit}" if unit == "bytes" else f"{dv:.4g} {unit}"
        table.add_row(row["field"], f"{value:g}" if isinstance(value, float) else str(value), row["unit"],
                      row["derived"] or "", derived)
    console.print(table)
    if s.get("estimates"):
        console.print(f"tide estimates (no source, check them): {', '.join(s['estimates'])}")


def _print_schedule(console: Console, s: dict[str, Any]) -> None:
    hd, lay, pred = s["header"], s["layout"], s["prediction"]
    top = _kv_table(f"schedule {s['file']} (format {s['format_version']})")
    top.add_row("policy", f"{hd['policy']} (planner {hd['planner_version']}) for {hd['model_name']} on {hd['hardware_name']}, "
                          f"world size {hd['world_size']}, {hd['host_staging'].lower()} HOST copies")
    top.add_row("solver", f"{hd['solver_status']}: objective {hd['objective_seconds']:.6g} s, lower bound "
                          f"{hd['lower_bound_seconds']:.6g} s, gap {hd['gap']:.2%}")
    tflops = f", {pred['tflops']:.3g} TFLOPS" if pred["tflops"] is not None else ""
    top.add_row("predicted", f"{pred['iteration_seconds']:.6g} s per iteration, {pred['flops']:.4g} FLOPs{tflops}; "
                             f"{s['moments']} moments in {s['stages']} stages")
    lists = ", ".join(f"{name} {info['dtype']}" for name, info in lay["lists"].items())
    wasted = sum(info["wasted_bytes"] for info in lay["lists"].values())
    top.add_row("layout", f"{lay['chunks']:,} chunks of {lay['chunk_elements']:,} elements ({lists}); {lay['tensors']:,} tensors; "
                          f"wasted {lay['wasted_elements']:,} elements ({lay['wasted_fraction']:.1%}), {_human_bytes(wasted)} "
                          f"({wasted:,} bytes) over all lists")
    top.add_row("OS tiers", _counts(s["os_tiers"]) + "; optimizer step on " + _counts(s["optimizer_tiers"]))
    plan = s["activation_plan"]
    top.add_row("activations", f"{plan['blocks']} blocks: " + (_counts(plan["per_mode"]) or "none"))
    if plan["per_block"]:
        top.add_row("", "; ".join(f"{p['block']} {p['module']}: {p['mode']} {_human_bytes(p['bytes'])}" for p in plan["per_block"]))
    if hd["notes"]:
        top.add_row("notes", _clip(" | ".join(hd["notes"]), 240))
    console.print(top)

    res = Table(title="chunks per tier at iteration start", title_justify="left")
    res.add_column("list")
    for col in (*[t.value for t in Tier], "nowhere"):
        res.add_column(col, justify="right")
    for name, counts in s["residency_at_start"].items():
        res.add_row(name, *(f"{counts[c]:,}" for c in (*[t.value for t in Tier], "nowhere")))
    console.print(res)

    tiers = Table(title="bytes per channel and tier", title_justify="left")
    for col in ("channel / tier", "predicted bytes", "busy seconds", "budget bytes", "peak bytes"):
        tiers.add_column(col, justify="left" if col == "channel / tier" else "right")
    channels = dict.fromkeys([*pred["bytes_per_channel"], *pred["busy_seconds_per_channel"]])
    for ch in channels:
        b, busy = pred["bytes_per_channel"].get(ch), pred["busy_seconds_per_channel"].get(ch)
        tiers.add_row(ch, f"{b:,}" if b is not None else "", f"{busy:.6g}" if busy is not None else "", "", "")
    for tier in Tier:
        peak = pred["peak_bytes_per_tier"].get(tier.value)
        tiers.add_row(tier.value, "", "", f"{s['budgets'][tier.value]:,}", f"{peak:,}" if peak is not None else "")
    console.print(tiers)

    acts = s["actions"]
    ops = Table(title=f"actions: {acts['count']:,}", title_justify="left")
    for col in ("op", "count", "bytes"):
        ops.add_column(col, justify="left" if col == "op" else "right")
    for op, n in acts["per_op"].items():
        ops.add_row(op, f"{n:,}", f"{acts['bytes_per_op'][op]:,}")
    console.print(ops)


def _kv_table(title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    return table


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n:,}" for name, n in counts.items() if n)


def _spread(values: list[int]) -> dict[str, float]:
    if not values:
        return {"min": 0, "mean": 0, "max": 0}
    return {"min": min(values), "mean": statistics.fmean(values), "max": max(values)}


def _human_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["register", "run_show", "run_validate", "summarize_hardware", "summarize_schedule", "summarize_trace"]
