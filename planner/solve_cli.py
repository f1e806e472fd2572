"""`python -m planner solve TRACE`: the command line of `planner.solve` (arguments, the progress line,
the written schedule's path, and the summary printed or given as JSON after a replay check).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console

from planner.errors import PlannerError
from planner.presets import DEFAULT_HARDWARE, resolve_hardware
from planner.simulate import simulate
from planner.solution import SolveReport
from planner.replays import add_jobs_option, checked_jobs
from planner.solve import DEFAULT_TIME_LIMIT_SECONDS, SAFETY_SECONDS, solve_report
from schemas._base import digest_bytes, format_bytes, read_bytes
from schemas.hardware import Hardware
from schemas.schedule import ActivationMode, Schedule, Tier
from schemas.trace import Trace

def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "solve",
        description="Solve where every chunk and activation lives at every moment (OR-Tools: placement LP per "
                    "chunk size, then the placement MIP with HiGHS), materialize the actions and write the "
                    f"schedule. With no --hardware the embedded default {DEFAULT_HARDWARE!r} is used "
                    f"(traces/hardware/{DEFAULT_HARDWARE}.toml: the 2-core CI machine with DEVICE emulated by a "
                    "1 GB CPU pool). The same inputs give a byte-identical schedule (solve seconds are printed, "
                    "never written).")
    p.add_argument("trace", metavar="TRACE", help="trace file (.msgpack)")
    p.add_argument("--hardware", metavar="NAME|FILE", default=None,
                   help=f"hardware preset name or TOML path (default: {DEFAULT_HARDWARE})")
    p.add_argument("-o", "--output", metavar="SCHEDULE", default=None,
                   help="schedule path (default: <trace stem>.<hardware name>.schedule.msgpack next to the trace)")
    p.add_argument("--time-limit", metavar="S", type=float, default=DEFAULT_TIME_LIMIT_SECONDS,
                   help="safety-net seconds per solver call (at least "
                        f"{SAFETY_SECONDS:g}; default {DEFAULT_TIME_LIMIT_SECONDS:g}): LPs stop at their optimum and "
                        "MIPs at their gap or node limit, so the machine's speed never decides the schedule")
    p.add_argument("--exact", action="store_true",
                   help="one CP-SAT model over every chunk (small traces, 2-4 blocks): the optimum the default "
                        "planner is measured against")
    p.add_argument("--device-memory-gb", metavar="X", type=float, default=None,
                   help="override the DEVICE capacity the planner may fill, in GB (10^9 bytes)")
    p.add_argument("--no-optimizer-overlap", action="store_true",
                   help="run the CPU optimizer after backward instead of overlapping it (Fuyou §4.3)")
    p.add_argument("--no-checkpoint-offload", action="store_true",
                   help="keep recompute checkpoints (the inputs of RECOMPUTE blocks) on DEVICE instead of letting the "
                        "planner park them on HOST (the executor replays both)")
    p.add_argument("--prove-bound", action="store_true",
                   help="prove the header's lower bound for every plan at any depth: above 128 blocks the bound is "
                        "otherwise only checked against the solve's replays, and proving it costs one more LP per "
                        "chunk size (256 blocks x 4096: ~8 CPU s each)")
    add_jobs_option(p, help="processes that replay candidate plans, this one included, and HiGHS in a thread beside "
                            "them (default: the CPUs this process may use, here %(default)s); the schedule is the same "
                            "bytes with any number")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_main)


def _progress(enabled: bool):
    """A status line on stderr for long solves (rich), only when stderr is a terminal."""
    if not enabled:
        return None, None
    console = Console(stderr=True)
    status = console.status("solving")
    status.start()
    return status, (lambda msg: status.update(msg))


def _main(args: argparse.Namespace) -> int:
    hardware = resolve_hardware(args.hardware)
    raw = read_bytes("trace", args.trace)
    trace = Trace.from_msgpack(raw, source=str(args.trace))
    digest = digest_bytes(raw)
    device_bytes = None
    if args.device_memory_gb is not None:
        if args.device_memory_gb <= 0:
            raise PlannerError(f"--device-memory-gb must be positive, found {args.device_memory_gb}")
        device_bytes = int(args.device_memory_gb * 1e9)
    if args.time_limit <= 0:
        raise PlannerError(f"--time-limit must be positive, found {args.time_limit}")
    jobs = checked_jobs(args.jobs)
    status, progress = _progress(sys.stderr.isatty() and not args.json)
    try:
        report = solve_report(trace, hardware, trace_digest=digest, time_limit_s=args.time_limit, exact=args.exact,
                              device_bytes=device_bytes, optimizer_overlap=not args.no_optimizer_overlap,
                              checkpoint_offload=not args.no_checkpoint_offload, prove_bound=args.prove_bound,
                              progress=progress, jobs=jobs)
    finally:
        if status is not None:
            status.stop()
    out = Path(args.output) if args.output else default_output_path(args.trace, hardware.name)
    report.schedule.write(out)
    check = _simulate_check(report.schedule, hardware)
    if args.json:
        print(json.dumps(summary_dict(report, out, check), indent=2))
    else:
        print_summary(report, out, check)
    return 0


def default_output_path(trace_path: str | Path, hardware_name: str) -> Path:
    trace_path = Path(trace_path)
    stem = trace_path.name.removesuffix(".msgpack")
    return trace_path.with_name(f"{stem}.{hardware_name}.schedule.msgpack")


def _simulate_check(schedule: Schedule, hardware: Hardware) -> dict:
    """Replay the schedule in planner.simulate: time and peaks vs the prediction."""
    result = simulate(schedule, hardware)
    predicted = schedule.prediction
    out = {"iteration_seconds": result.iteration_seconds, "warnings": []}
    if predicted.iteration_seconds > 0:
        rel = abs(result.iteration_seconds - predicted.iteration_seconds) / predicted.iteration_seconds
        if rel > 0.05:
            out["warnings"].append(f"simulated iteration {result.iteration_seconds:.4g} s differs from the prediction "
                                   f"{predicted.iteration_seconds:.4g} s by {100 * rel:.1f}%")
    for tier, peak in sorted(result.peak_bytes_per_tier.items()):
        want = predicted.peak_bytes_per_tier.get(tier, 0)
        if want > 0 and abs(peak - want) / want > 0.05:
            out["warnings"].append(f"simulated {tier.value} peak {format_bytes(peak)} differs from the prediction "
                                   f"{format_bytes(want)} by {100 * abs(peak - want) / want:.1f}%")
    return out


def summary_dict(report: SolveReport, out: Path, check: dict | None) -> dict:
    s = report.schedule
    h = s.header
    plans = Counter(f"{p.os_tier.value}/{p.optimizer_tier.value}" for p in s.chunk_plans)
    modes = Counter(p.mode.value for p in s.activation_plans)
    return {
        "schedule": str(out),
        "policy": h.policy,
        "model": h.model_name,
        "hardware": h.hardware_name,
        "status": h.solver_status.value,
        "objective_seconds": h.objective_seconds,
        "lower_bound_seconds": h.lower_bound_seconds,
        "gap": h.gap,  # the true gap: (simulated - valid bound) / simulated
        "mip_gap": None if math.isnan(report.mip_gap) else report.mip_gap,
        "model_objective_seconds": None if math.isnan(report.model_objective_seconds) else report.model_objective_seconds,
        "predicted_seconds": s.prediction.iteration_seconds,
        "chunk_elements": report.chunk_elements,
        "chunks": len(s.layout.chunks),
        "param_chunks_on_device_at_start": sum(1 for c in s.initial_residency if c.list.value == "PARAM" and Tier.DEVICE in c.tiers),
        "os_tier/optimizer_tier": dict(sorted(plans.items())),
        "activation_modes": {m.value: modes.get(m.value, 0) for m in ActivationMode},
        "bytes_per_channel": {k.value: v for k, v in sorted(s.prediction.bytes_per_channel.items())},
        "peak_bytes_per_tier": {k.value: v for k, v in sorted(s.prediction.peak_bytes_per_tier.items())},
        "solve_seconds": report.solve_seconds,
        "chosen_plan": report.chosen,
        "simulated_seconds": check["iteration_seconds"] if check else None,
        "warnings": check["warnings"] if check else [],
    }


def print_summary(report: SolveReport, out: Path, check: dict | None) -> None:
    d = summary_dict(report, out, check)
    lines = [
        f"schedule   {d['schedule']}",
        f"policy     {d['policy']}  model {d['model']}  hardware {d['hardware']}",
        f"status     {d['status']}  simulated {d['objective_seconds']:.6g} s  bound {d['lower_bound_seconds']:.6g} s  "
        f"true gap {100 * d['gap']:.2f}%  MIP gap "
        + (f"{100 * d['mip_gap']:.2f}% (model objective {d['model_objective_seconds']:.6g} s)"
           if d["mip_gap"] is not None else "- (a reference decision set won)"),
        f"chunks     {d['chunks']} x {d['chunk_elements']} elements  "
        f"(candidates: {', '.join(str(c.chunk_elements) for c in report.candidates)})",
        f"residency  {d['param_chunks_on_device_at_start']} PARAM chunks on DEVICE at the start of the iteration; OS/optimizer: "
        + ", ".join(f"{k} {v}" for k, v in d["os_tier/optimizer_tier"].items()),
        "activations " + ", ".join(f"{k} {v}" for k, v in d["activation_modes"].items()),
        "bytes      " + (", ".join(f"{k} {format_bytes(v)}" for k, v in d["bytes_per_channel"].items() if v)
                         or "none moved: everything stays on DEVICE"),
        "peaks      " + ", ".join(f"{k} {format_bytes(v)}" for k, v in d["peak_bytes_per_tier"].items()),
        *([f"plan       {d['chosen_plan']} (the fastest of {len(report.evaluated)} plans replayed by the simulator)"]
          if report.chosen else []),
        f"solved in  {d['solve_seconds']:.2f} s (wall clock; not written into the schedule)",
    ]
    if check is not None:
        lines.append(f"simulated  {check['iteration_seconds']:.6g} s")
        for w in check["warnings"]:
            lines.append(f"warning    {w}")
    print("\n".join(lines))


__all__ = ["default_output_path", "print_summary", "register", "summary_dict"]
