"""`python -m planner compare TRACE --hardware H`: tide and every baseline on identical work, side by side.

Each row is one policy's schedule for the same trace on the same hardware, replayed by
`planner.simulate.simulate` (a schedule the simulator rejects is an error, never a row; a policy
that runs out of memory is an INFEASIBLE row with the reason). The lower bound is
`planner.bounds.lower_bound` (the physical limit, per rank with several ranks). Rows of systems
that run on one GPU only (Fuyou) say so.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from planner.policies import POLICIES, baseline
from planner.bounds import LowerBound, lower_bound
from planner.errors import InfeasibleError, PlannerError
from planner.problem import Problem, build_problem
from planner.presets import resolve_hardware
from planner.simulate import ScheduleViolation, SimResult, simulate
from planner.solution import SolveReport
from planner.replays import add_jobs_option, checked_jobs
from planner.solve import UNPROVEN_BOUND, solve_report
from schemas import Hardware, Schedule, Trace
from schemas._base import digest_bytes, frozen, read_bytes
from schemas.schedule import Channel, Tier

GB = 1e9
TIDE = "tide"


@frozen
class CompareRow:
    """One policy on the trace and hardware."""

    policy: str
    feasible: bool
    reason: str  # why infeasible (or unavailable); "" when feasible
    schedule: Schedule | None
    result: SimResult | None
    speedup_vs_best_baseline: float | None  # best feasible baseline's seconds / this row's seconds
    # bytes the system holds for its own buffers per tier (Decisions.reserved_bytes: the tier's capacity
    # less the schedule's budget there), which the capacity check counts and the chunk replay does not
    reserved_bytes_per_tier: dict[Tier, int] | None = None

    def peak_bytes(self, tier: Tier) -> int:
        """What the system holds on `tier` at its busiest: the simulated chunk / activation peak plus its
        own buffers, the quantity the capacity check compares with the usable capacity."""
        assert self.result is not None
        return self.result.peak_bytes_per_tier[tier] + (self.reserved_bytes_per_tier or {}).get(tier, 0)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"policy": self.policy, "feasible": self.feasible, "reason": self.reason}
        if self.result is not None:
            r = self.result
            out.update(iteration_seconds=r.iteration_seconds, tflops=r.tflops,
                       gb_per_channel={k.value: v / GB for k, v in r.bytes_per_channel.items()},
                       busy_seconds_per_channel={k.value: v for k, v in r.busy_seconds_per_channel.items()},
                       peak_device_gb=self.peak_bytes(Tier.DEVICE) / GB,
                       peak_host_gb=self.peak_bytes(Tier.HOST) / GB,
                       peak_nvme_gb=self.peak_bytes(Tier.NVME) / GB,
                       reserved_gb={t.value: v / GB for t, v in (self.reserved_bytes_per_tier or {}).items() if v},
                       stall_seconds=r.stall_seconds, speedup_vs_best_baseline=self.speedup_vs_best_baseline,
                       notes=list(self.schedule.header.notes) if self.schedule else [])
        return out


@frozen
class Comparison:
    """The rows and the lower bound of one (trace, hardware) pair."""

    model_name: str
    hardware_name: str
    rows: tuple[CompareRow, ...]
    lower_bound: LowerBound  # physical: holds for any schedule
    tide_bound_seconds: float | None  # tide's header bound (a valid bound: its model's or the physical limit)
    world_size: int = 1  # ranks of data-parallel training (hardware.cluster.world_size)
    tide_true_gap: float | None = None  # (tide's simulated - tide's bound) / simulated (the header's gap)
    tide_mip_gap: float | None = None  # the chosen placement MIP's own gap (None: a reference decision set won)
    usable_bytes_per_tier: dict[Tier, int] | None = None  # the capacities every row's peaks are checked against
    tide_bound_proven: bool = True  # False: the header says its bound holds for the solve's replays only

    def row(self, policy: str) -> CompareRow:
        return next(r for r in self.rows if r.policy == policy)

    def best_baseline_seconds(self) -> float | None:
        times = [r.result.iteration_seconds for r in self.rows if r.policy != TIDE and r.result is not None]
        return min(times) if times else None

    def speedup_ceiling(self) -> float | None:
        """The most any plan can be faster than the best baseline: best baseline / tide's bound (the
        bound holds for every plan the simulator replays, so no plan, tide's included, beats it; where
        `tide_bound_proven` is False, for the plans its solve replayed)."""
        best = self.best_baseline_seconds()
        return best / self.tide_bound_seconds if best and self.tide_bound_seconds else None

    def to_json(self) -> dict[str, object]:
        return {"model": self.model_name, "hardware": self.hardware_name, "world_size": self.world_size,
                "lower_bound": {"seconds": self.lower_bound.seconds, "resource": self.lower_bound.resource,
                                "seconds_per_resource": self.lower_bound.seconds_per_resource},
                "tide_bound_seconds": self.tide_bound_seconds, "tide_true_gap": self.tide_true_gap,
                "tide_mip_gap": self.tide_mip_gap, "tide_bound_proven": self.tide_bound_proven,
                "speedup_ceiling_vs_best_baseline": self.speedup_ceiling(),
                "rows": [r.to_json() for r in self.rows]}


def _reserved(problem: Problem, schedule: Schedule) -> dict[Tier, int]:
    """Each tier's capacity less the schedule's budget there: the system's own buffers (materialize)."""
    b = schedule.budgets
    return {Tier.DEVICE: max(0, problem.device_bytes - b.device_bytes), Tier.HOST: max(0, problem.host_bytes - b.host_bytes),
            Tier.NVME: max(0, problem.nvme_bytes - b.nvme_bytes)}


def compare(trace: Trace, hardware: Hardware, *, trace_digest: str, policies: Sequence[str] | None = None,
            problem: Problem | None = None, jobs: int = 1) -> Comparison:
    """Every policy's schedule for `trace` on `hardware`, simulated; tide's from planner.solve (with `jobs`: Note
    [replays ahead] in planner/replays.py)."""
    problem = problem or build_problem(trace, hardware, trace_digest=trace_digest)
    names = list(policies) if policies else [TIDE, *POLICIES]
    for name in names:
        if name != TIDE and name not in POLICIES:
            raise PlannerError(f"unknown policy {name!r}; choose from {', '.join([TIDE, *POLICIES])}")
    raw: list[tuple[str, Schedule | None, SimResult | None, str]] = []
    mip_gap = None
    for name in names:
        try:
            if name == TIDE:
                report = _tide(trace, hardware, trace_digest, jobs)
                schedule, mip_gap = report.schedule, None if math.isnan(report.mip_gap) else report.mip_gap
            else:
                schedule = baseline(name, problem)
        except InfeasibleError as exc:
            why = str(exc).removeprefix(f"{name}: ")  # the row names the policy (printed "policy: reason")
            if name == TIDE and problem.world_size > 1:
                # tide tried its rank-aware placement model and the baselines' decision sets
                why = (f"with {problem.world_size} ranks neither tide's placement model nor the baselines' "
                       f"decision sets fit: {why}")
            raw.append((name, None, None, why))
            continue
        except _Unavailable as exc:
            raw.append((name, None, None, str(exc)))
            continue
        if schedule.header.solver_status.value == "INFEASIBLE":
            raw.append((name, None, None, "; ".join(schedule.header.notes) or "INFEASIBLE"))
            continue
        raw.append((name, schedule, simulate(schedule, hardware), ""))  # a rejected schedule raises: not a row
    best = min((r.iteration_seconds for n, _, r, _ in raw if n != TIDE and r is not None), default=None)
    rows = tuple(CompareRow(policy=n, feasible=r is not None, reason=why, schedule=s, result=r,
                            speedup_vs_best_baseline=(best / r.iteration_seconds) if best and r is not None else None,
                            reserved_bytes_per_tier=_reserved(problem, s) if s is not None else None)
                 for n, s, r, why in raw)
    tide = next((r for r in rows if r.policy == TIDE and r.schedule is not None), None)
    return Comparison(model_name=trace.meta.model_name, hardware_name=hardware.name, rows=rows,
                      lower_bound=lower_bound(problem),
                      tide_bound_seconds=tide.schedule.header.lower_bound_seconds if tide is not None else None,
                      world_size=problem.world_size,
                      tide_true_gap=tide.schedule.header.gap if tide is not None else None,
                      tide_mip_gap=mip_gap if tide is not None else None,
                      usable_bytes_per_tier={Tier.DEVICE: problem.device_bytes, Tier.HOST: problem.host_bytes,
                                             Tier.NVME: problem.nvme_bytes},
                      tide_bound_proven=tide is None or not any(UNPROVEN_BOUND in n for n in tide.schedule.header.notes))


class _Unavailable(Exception):
    pass


def _tide(trace: Trace, hardware: Hardware, trace_digest: str, jobs: int) -> SolveReport:
    try:
        return solve_report(trace, hardware, trace_digest=trace_digest, jobs=jobs)
    except (InfeasibleError, ScheduleViolation):
        raise
    except PlannerError as exc:  # e.g. no integral plan within the time limit: a row that says so
        raise _Unavailable(f"no tide schedule: {exc}") from None


# ----------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        description="Schedule TRACE with tide and with each baseline policy on the same hardware, replay every "
                    "schedule in the simulator and print one row per policy, with the lower bound.")
    p.add_argument("trace", metavar="TRACE", help="trace file (.msgpack)")
    p.add_argument("--hardware", metavar="NAME|FILE", help="hardware preset or TOML (default: cpu-emulated)")
    p.add_argument("--policies", nargs="+", metavar="POLICY", choices=[TIDE, *POLICIES],
                   help=f"policies to compare (default: all of {', '.join([TIDE, *POLICIES])})")
    add_jobs_option(p, help="jobs of tide's solve, as `planner solve --jobs` (default: the CPUs this process may use)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    payload = read_bytes("trace", args.trace)
    trace = Trace.from_msgpack(payload, source=args.trace)
    hardware = resolve_hardware(args.hardware)
    result = compare(trace, hardware, trace_digest=digest_bytes(payload), policies=args.policies,
                     jobs=checked_jobs(args.jobs))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_comparison(result)
    return 0


def print_comparison(c: Comparison) -> None:
    ranks = f", {c.world_size} ranks" if c.world_size > 1 else ""
    table = Table(title=f"{c.model_name} on {c.hardware_name}{ranks}")
    multi = c.world_size > 1
    cols = ["policy", "feasible", "iter s", "TFLOPS", "H2D GB", "D2H GB", "NVMe R GB", "NVMe W GB",
            *(["GPU-GPU GB"] if multi else []), "peak DEVICE GB", "peak HOST GB", "vs best baseline"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("policy", "feasible") else "right")
    for r in c.rows:
        if r.result is None:
            table.add_row(r.policy, "no", *["-"] * (len(cols) - 2))
            continue
        res = r.result
        gb = {k: v / GB for k, v in res.bytes_per_channel.items()}
        table.add_row(r.policy, "yes", f"{res.iteration_seconds:.4g}", f"{res.tflops:.3g}", f"{gb[Channel.H2D]:.3g}",
                      f"{gb[Channel.D2H]:.3g}", f"{gb[Channel.NVME_READ]:.3g}", f"{gb[Channel.NVME_WRITE]:.3g}",
                      *([f"{gb[Channel.INTER_GPU]:.3g}"] if multi else []),
                      f"{r.peak_bytes(Tier.DEVICE) / GB:.3g}", f"{r.peak_bytes(Tier.HOST) / GB:.3g}",
                      f"{r.speedup_vs_best_baseline:.2f}x" if r.speedup_vs_best_baseline else "-")
    console = Console(width=max(Console().width, 160))
    console.print(table)
    if c.usable_bytes_per_tier:
        u = c.usable_bytes_per_tier
        console.print(f"peak DEVICE / HOST: each system's chunks and activations at their busiest plus its own buffers "
                      f"(fp32 grad partitions, pinned pools: what the capacity check counts) against "
                      f"{u[Tier.DEVICE] / GB:.3g} GB DEVICE / {u[Tier.HOST] / GB:.3g} GB HOST usable")
    if c.world_size > 1:
        console.print(f"{c.world_size} ranks, data parallel: TFLOPS, H2D/D2H GB are of all ranks together; GPU-GPU GB is "
                      "what each rank sends (the schedule's collective bytes); peak DEVICE is the busiest rank's, "
                      "peak HOST the busiest node's")
    lb = c.lower_bound
    console.print(f"lower bound: {lb.seconds:.4g} s ({lb.resource}; "
                  + ", ".join(f"{k} {v:.4g} s" for k, v in lb.seconds_per_resource.items()) + ")")
    if c.tide_bound_seconds is not None:
        mip = f"{100 * c.tide_mip_gap:.2f}%" if c.tide_mip_gap is not None else "- (a reference decision set won)"
        console.print(f"tide's own bound (header: its placement model's LP or root bound, or the physical limit): "
                      f"{c.tide_bound_seconds:.4g} s; true gap (simulated - bound) / simulated "
                      f"{100 * (c.tide_true_gap or 0.0):.2f}%; MIP gap {mip}"
                      + ("" if c.tide_bound_proven else f" (the bound is {UNPROVEN_BOUND}: checked against the solve's "
                                                         "replays only, see the schedule's notes)"))
        if c.speedup_ceiling() is not None:
            plans = "no plan" if c.tide_bound_proven else "no plan the solve replayed"
            console.print(f"{plans} beats that bound: at most {c.speedup_ceiling():.2f}x the best baseline "
                          f"({c.best_baseline_seconds():.4g} s / {c.tide_bound_seconds:.4g} s)")
    for r in c.rows:
        if r.result is None:
            console.print(f"[yellow]{r.policy}[/yellow]: {r.reason}", soft_wrap=True)


__all__ = ["Comparison", "CompareRow", "LowerBound", "TIDE", "compare", "lower_bound", "print_comparison", "register"]
