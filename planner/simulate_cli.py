"""`python -m planner simulate SCHEDULE`: the command line of `planner.simulate` (arguments, the
trace-digest check, the result printed as tables or JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from schemas import Hardware, Schedule
from schemas._base import digest_bytes, read_bytes
from schemas.schedule import Channel, Tier

from planner.errors import PlannerError
from planner.presets import hardware_for
from planner.sim_result import SimResult
from planner.simulate import simulate

def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        description="Discrete-event replay of one iteration of SCHEDULE on the hardware: iteration seconds, TFLOPS, "
                    "bytes and busy seconds per channel, peak bytes per tier, stalls. A schedule that breaks the "
                    "action semantics (use before arrival, capacity, last copy evicted, steady state) is an error "
                    "naming the moment, action and chunk.")
    p.add_argument("schedule", metavar="SCHEDULE", help="schedule file (.msgpack)")
    p.add_argument("--trace", metavar="TRACE", help="the trace the schedule was solved from (checks its digest)")
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help="hardware preset or TOML (default: the preset named in the schedule's header)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--detail", action="store_true", help="with --json: per-moment memory and the channel timeline")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    schedule = Schedule.read(args.schedule)
    hardware = hardware_for(schedule, args.hardware, source=args.schedule)
    if args.trace:
        digest = digest_bytes(read_bytes("trace", args.trace))
        if digest != schedule.header.trace_digest:
            raise PlannerError(f"{args.trace}: digest {digest[:19]}... is not the trace the schedule was solved from "
                               f"({schedule.header.trace_digest[:19]}...); re-solve or pass the right trace")
    result = simulate(schedule, hardware)
    if args.json:
        print(json.dumps({"schedule": str(args.schedule), "policy": schedule.header.policy, "hardware": hardware.name,
                          **result.to_json(detail=args.detail)}, indent=2))
        return 0
    _print(result, schedule, hardware, Path(args.schedule).name)
    return 0


def _print(result: SimResult, schedule: Schedule, hardware: Hardware, name: str) -> None:
    console = Console()
    console.print(f"[bold]{name}[/bold]: policy {schedule.header.policy}, model {schedule.header.model_name}, "
                  f"hardware {hardware.name}")
    console.print(f"iteration {result.iteration_seconds:.4f} s, {result.tflops:.2f} TFLOPS, "
                  f"stalls {result.stall_seconds:.4f} s, predicted {schedule.prediction.iteration_seconds:.4f} s")
    table = Table(title="channels")
    for col in ("channel", "GB", "busy s", "busy %"):
        table.add_column(col, justify="right" if col != "channel" else "left")
    for ch in Channel:
        busy = result.busy_seconds_per_channel[ch]
        table.add_row(ch.value, f"{result.bytes_per_channel.get(ch, 0) / 1e9:.3f}", f"{busy:.4f}",
                      f"{100 * busy / result.iteration_seconds:.1f}" if result.iteration_seconds else "-")
    console.print(table)
    peaks = Table(title="peak bytes per tier")
    for col in ("tier", "peak GB", "budget GB"):
        peaks.add_column(col, justify="right" if col != "tier" else "left")
    budget = {Tier.DEVICE: schedule.budgets.device_bytes, Tier.HOST: schedule.budgets.host_bytes,
              Tier.NVME: schedule.budgets.nvme_bytes}
    for tier in Tier:
        peaks.add_row(tier.value, f"{result.peak_bytes_per_tier[tier] / 1e9:.3f}", f"{budget[tier] / 1e9:.3f}")
    console.print(peaks)


__all__ = ["register"]
