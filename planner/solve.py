"""`python -m planner solve TRACE`: the trace and a hardware profile in, a schedule out (DESIGN.md §4).

1. Chunk size: every candidate of `planner.layout.candidate_chunk_sizes` is laid out and its
   placement LP relaxation solved (GLOP).
2. Placement: the aggregated MIP of `planner.placement` (HiGHS) for the candidates in LP order,
   until the next LP value cannot beat the best plan (branch and bound over chunk sizes); the best
   predicted time wins, a tie (within 0.1%) goes to the layout that wastes less memory.
3. Decisions -> `planner.materialize` (actions, steady state, prediction), eviction
   BELADY_CLEAN_FIRST with prefetch at the first harmless opportunity.
4. Header: objective = the placement MIP's iteration time, lower bound = max(smallest LP
   relaxation over the candidates, the physical limit of `planner.bounds`), gap = (objective -
   bound) / objective. The materialized schedule's own prediction (`schedule.prediction`) and the
   simulator's replay are printed next to it, with a warning when they differ by more than 5%.

Determinism: one solver thread, default seeds, sorted iteration everywhere, and no wall-clock time
in the file (solve seconds are printed, never written): the same inputs give the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from planner.bounds import explain_infeasible, physical_lower_bound_seconds
from planner.errors import PlannerError
from planner.placement import PlacementInfeasible, PlacementInput, PlacementModel, PlacementSolution, placement_input
from schemas._base import frozen
from schemas.hardware import Hardware
from schemas.schedule import ActivationMode, ChunkPlan, Schedule, SolverStatus, Tier
from schemas.trace import Trace

log = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_SECONDS = 60.0
TIE_TOLERANCE = 1e-3  # candidates within 0.1% of the best predicted time count as a tie
POLICY = "tide"


@frozen
class Candidate:
    """One evaluated chunk size."""

    chunk_elements: int
    relaxation_seconds: float  # LP relaxation of the placement (math.inf: does not fit)
    wasted_elements: int
    chunks: int


@frozen
class SolveReport:
    """What a solve produced and how (printed by the CLI; only `schedule` goes into the file)."""

    schedule: Schedule
    placement: PlacementSolution
    data: PlacementInput
    candidates: tuple[Candidate, ...]
    chunk_elements: int
    model_objective_seconds: float  # the placement model's own objective (the header's objective)
    lower_bound_seconds: float
    physical_bound_seconds: float
    relaxation_bound_seconds: float
    solve_seconds: float  # wall clock (never written into the schedule)


def solve(trace: Trace, hardware: Hardware, *, trace_digest: str, time_limit_s: float = DEFAULT_TIME_LIMIT_SECONDS,
          exact: bool = False, device_bytes: int | None = None, optimizer_overlap: bool = True,
          checkpoint_offload: bool = True) -> Schedule:
    """Plan `trace` on `hardware` and return the schedule (raises InfeasibleError / PlannerError).

    `checkpoint_offload=False` keeps every RECOMPUTE block's input on DEVICE (the executor does not
    offload recompute checkpoints yet and refuses schedules that do)."""
    return solve_report(trace, hardware, trace_digest=trace_digest, time_limit_s=time_limit_s, exact=exact,
                        device_bytes=device_bytes, optimizer_overlap=optimizer_overlap,
                        checkpoint_offload=checkpoint_offload).schedule


def solve_report(trace: Trace, hardware: Hardware, *, trace_digest: str,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_SECONDS, exact: bool = False,
                 device_bytes: int | None = None, optimizer_overlap: bool = True, checkpoint_offload: bool = True,
                 progress: Callable[[str], None] | None = None) -> SolveReport:
    from planner.layout import candidate_chunk_sizes
    from planner.problem import build_problem

    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    problem = build_problem(trace, hardware, trace_digest=trace_digest, device_bytes=device_bytes)
    if exact:
        from planner.exact import solve_exact_report

        return solve_exact_report(problem, optimizer_overlap=optimizer_overlap, time_limit_s=time_limit_s,
                                  started=started, progress=say)
    sizes = candidate_chunk_sizes(problem)
    deadline = started + time_limit_s
    # PARAM homed on NVME only when no plan with every PARAM on HOST exists: the placement model
    # charges an NVMe-homed fetch as if the SSDs were free in its stage, while in the simulator they
    # queue behind the optimizer state's traffic (measured on 175B / a100-80g-12ssd: model 106 s,
    # simulator 191 s, against 118.5 s for the HOST-homed plan). It is what lets the largest
    # models fit (Fuyou's layout), where HOST cannot hold a copy of every PARAM.
    search = _search(problem, sizes, deadline=deadline, time_limit_s=time_limit_s, optimizer_overlap=optimizer_overlap,
                     checkpoint_offload=checkpoint_offload, nvme_home=False, say=say)
    if not search[2] and problem.nvme_bytes > 0 and hardware.nvme_read_bytes_per_s > 0:
        say("no plan with every PARAM on HOST: PARAM may live on NVME")
        search = _search(problem, sizes, deadline=max(deadline, time.perf_counter() + time_limit_s / 2),
                         time_limit_s=time_limit_s, optimizer_overlap=optimizer_overlap,
                         checkpoint_offload=checkpoint_offload, nvme_home=True, say=say)
    candidates, inputs, solved, bounds = search
    if not solved:
        raise explain_infeasible(_least_demanding(inputs), what=f"{trace.meta.model_name} on {hardware.name}")
    best_time = min(x.objective_seconds for x in solved.values())
    ties = [c for c in candidates if c.chunk_elements in solved
            and solved[c.chunk_elements].objective_seconds <= best_time * (1 + TIE_TOLERANCE)]
    chosen = min(ties, key=lambda c: (c.wasted_elements, solved[c.chunk_elements].objective_seconds, c.chunk_elements))
    layout, data = inputs[chosen.chunk_elements]
    sol = solved[chosen.chunk_elements]
    best_time = min(bounds.values())
    relaxation_bound = best_time
    physical = physical_lower_bound_seconds(data)
    say("materialize: actions, eviction, prefetch")
    schedule = build_schedule(problem, layout, data, sol, notes=_notes(candidates, chosen, sol, relaxation_bound, physical))
    bound = max(relaxation_bound, physical, 0.0)
    schedule = with_header_stats(schedule, sol, bound)
    return SolveReport(schedule=schedule, placement=sol, data=data, candidates=tuple(candidates),
                       chunk_elements=chosen.chunk_elements, model_objective_seconds=sol.objective_seconds,
                       lower_bound_seconds=min(bound, schedule.header.objective_seconds),
                       physical_bound_seconds=physical, relaxation_bound_seconds=relaxation_bound,
                       solve_seconds=time.perf_counter() - started)


def _search(problem, sizes: list[int], *, deadline: float, time_limit_s: float, optimizer_overlap: bool,
            checkpoint_offload: bool, nvme_home: bool, say: Callable[[str], None]):
    """LP per chunk size, then branch and bound over chunk sizes with the MIP.

    Returns (candidates, inputs, solved MIPs, bounds per chunk size); `solved` is empty when none fits."""
    from planner.layout import build_layout, wasted_elements

    candidates: list[Candidate] = []
    inputs: dict[int, tuple[object, PlacementInput]] = {}
    for size in sizes:
        say(f"chunk size {size}: LP relaxation")
        layout = build_layout(problem, chunk_elements=size)
        data = dataclasses.replace(placement_input(problem, layout, optimizer_overlap=optimizer_overlap),
                                   param_nvme_home=nvme_home, checkpoint_offload=checkpoint_offload)
        inputs[size] = (layout, data)
        try:
            lp = PlacementModel(data, relax=True).solve(time_limit_seconds=max(1.0, deadline - time.perf_counter()))
            value = lp.objective_seconds
        except PlacementInfeasible:
            value = math.inf
        candidates.append(Candidate(chunk_elements=size, relaxation_seconds=value, wasted_elements=wasted_elements(layout),
                                    chunks=len(layout.chunks)))
    feasible = [c for c in candidates if math.isfinite(c.relaxation_seconds)]
    # Branch and bound over chunk sizes: solve the MIP of the candidates in LP order until the next
    # LP value cannot beat the best plan found; every candidate then has a bound (its MIP's proven
    # bound, or its LP value), and the smallest of them bounds every plan over these chunk sizes.
    bounds = {c.chunk_elements: c.relaxation_seconds for c in candidates}
    solved: dict[int, PlacementSolution] = {}
    order = sorted(feasible, key=lambda c: (c.relaxation_seconds, c.wasted_elements, c.chunk_elements))
    for cand in order:
        best = min((x.objective_seconds for x in solved.values()), default=math.inf)
        if cand.relaxation_seconds >= best * (1 - TIE_TOLERANCE):
            break
        left = deadline - time.perf_counter()
        if solved and left < 1.0:
            break
        # the first MIP may use most of the time; later ones share what is left
        budget = max(1.0, left * (0.8 if not solved else 0.5))
        say(f"chunk size {cand.chunk_elements}: placement MIP")
        try:
            sol = PlacementModel(inputs[cand.chunk_elements][1]).solve(time_limit_seconds=budget)
        except PlacementInfeasible as exc:
            if "no solution within" in str(exc) and not solved:
                raise PlannerError(f"the placement MIP found no integral plan within --time-limit {time_limit_s:g} s; "
                                   "raise --time-limit") from exc
            bounds[cand.chunk_elements] = math.inf if "infeasible" in str(exc) else bounds[cand.chunk_elements]
            continue
        solved[cand.chunk_elements] = sol
        bounds[cand.chunk_elements] = max(bounds[cand.chunk_elements], sol.bound_seconds)
    return candidates, inputs, solved, bounds


def _least_demanding(inputs: dict[int, tuple[object, PlacementInput]]) -> PlacementInput:
    """The chunk size whose plan needs the least DEVICE (LP relaxation): the one to explain with."""
    from planner.placement import Tier3, minimal_capacity

    def need(size: int) -> float:
        found = minimal_capacity(inputs[size][1], Tier3.DEVICE, relax_others=True, relax=True)
        return math.inf if found is None else found[0]

    return inputs[min(sorted(inputs), key=need)][1]


def with_header_stats(schedule: Schedule, sol: PlacementSolution, bound: float) -> Schedule:
    """Header: objective = the solved placement model's iteration time (the materialized cost-model
    prediction is in `schedule.prediction`), its lower bound and the gap between them."""
    objective = sol.objective_seconds
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    status = SolverStatus.OPTIMAL if sol.status is SolverStatus.OPTIMAL and gap <= 1e-3 else SolverStatus.FEASIBLE
    header = dataclasses.replace(schedule.header, solver_status=status, objective_seconds=objective,
                                 lower_bound_seconds=bound, gap=gap)
    return dataclasses.replace(schedule, header=header)


def _notes(candidates: list[Candidate], chosen: Candidate, sol: PlacementSolution, relaxation: float,
           physical: float) -> tuple[str, ...]:
    sizes = ", ".join(f"{c.chunk_elements}: {c.relaxation_seconds:.6g} s" if math.isfinite(c.relaxation_seconds)
                      else f"{c.chunk_elements}: does not fit" for c in candidates)
    return (
        f"chunk size {chosen.chunk_elements} elements chosen by the placement LP over candidates ({sizes})",
        f"placement MIP ({sol.solver}): {sol.status.value}, model objective {sol.objective_seconds:.6g} s, "
        f"LP bound {relaxation:.6g} s, physical bound {physical:.6g} s",
    )


def decisions_from_placement(problem, layout, data: PlacementInput, sol: PlacementSolution, *, notes: tuple[str, ...] = ()):
    """planner.materialize.Decisions from a placement solution (counts -> concrete chunks)."""
    from planner.materialize import Decisions, EvictionRule, param_budget_bytes

    plans: dict[int, ChunkPlan] = {}
    persistent: set[int] = set()
    for g, counts, pers in zip(data.groups, sol.os_counts, sol.persistent):
        n_dev, n_host, n_stream = int(counts["DEVICE"]), int(counts["HOST"]), int(counts.get("STREAM", 0))
        n_pers = int(pers)
        for j, chunk in enumerate(g.chunks):  # chunks of a group are interchangeable: take them in order
            if j < n_pers:
                persistent.add(chunk)
            if not g.trainable:
                plans[chunk] = ChunkPlan(chunk=chunk, os_tier=Tier.HOST, optimizer_tier=Tier.HOST)
            elif j < n_dev:
                plans[chunk] = ChunkPlan(chunk=chunk, os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE)
            elif j < n_dev + n_host:
                plans[chunk] = ChunkPlan(chunk=chunk, os_tier=Tier.HOST, optimizer_tier=Tier.HOST)
            elif j < n_dev + n_host + n_stream:  # OS streamed to the DEVICE for GPU Adam
                plans[chunk] = ChunkPlan(chunk=chunk, os_tier=Tier.HOST, optimizer_tier=Tier.DEVICE)
            else:
                plans[chunk] = ChunkPlan(chunk=chunk, os_tier=Tier.NVME, optimizer_tier=Tier.HOST)
    chunk_plans = tuple(plans[c.id] for c in layout.chunks)
    # PARAM homed on NVME: the group's last chunks that leave DEVICE and step on the CPU (the model's
    # rows param_nvme + persistent + streamed <= count guarantee there are enough of them)
    home = {c.id: Tier.HOST for c in layout.chunks}
    for g, pers, n_nvme in zip(data.groups, sol.persistent, sol.param_nvme or (0.0,) * len(data.groups)):
        left = int(n_nvme)
        for j in reversed(range(len(g.chunks))):
            if left <= 0:
                break
            chunk = g.chunks[j]
            if j >= int(pers) and plans[chunk].optimizer_tier is Tier.HOST:
                home[chunk] = Tier.NVME
                left -= 1
    param_home_tiers = tuple(home[c.id] for c in layout.chunks)
    if all(t is Tier.HOST for t in param_home_tiers):
        param_home_tiers = ()
    modes = tuple(sol.activation_modes)
    # The budget is all the room the DEVICE leaves PARAM+GRAD at each moment under this plan's OS
    # tiers and activation modes. The plan's own PARAM+GRAD bytes per stage (the resident counts,
    # `sol.param_bytes_per_stage`) always fit in it; the extra room only lets materialize's
    # Belady eviction keep more and prefetch earlier (measured on the shipped 1.3B/12B/13B traces:
    # the same predicted time, 1-25% fewer H2D bytes than budgets cut to the resident counts).
    checkpoint_tier = Tier.HOST if getattr(sol, "checkpoint_offload", False) else None
    budget = param_budget_bytes(problem, layout, chunk_plans, modes, checkpoint_tier)
    return Decisions(
        policy=POLICY, layout=layout, chunk_plans=chunk_plans, activation_modes=modes,
        param_device_budget_bytes=budget, persistent_chunks=frozenset(persistent),
        optimizer_overlap=data.optimizer_overlap, prefetch=True, eviction=EvictionRule.BELADY_CLEAN_FIRST,
        notes=notes, checkpoint_tier=checkpoint_tier, param_home_tiers=param_home_tiers,
    )


def build_schedule(problem, layout, data: PlacementInput, sol: PlacementSolution, *, notes: tuple[str, ...] = ()) -> Schedule:
    from planner.materialize import SolverStats, materialize

    decisions = decisions_from_placement(problem, layout, data, sol, notes=notes)
    stats = SolverStats(status=sol.status, objective_seconds=sol.objective_seconds,
                        lower_bound_seconds=sol.bound_seconds, gap=sol.gap)
    return materialize(problem, decisions, stats=stats)


# ----------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    from planner.presets import DEFAULT_HARDWARE

    p = subparsers.add_parser(
        "solve", help="plan a trace on a hardware profile and write the schedule",
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
                   help=f"seconds for the whole solve (default {DEFAULT_TIME_LIMIT_SECONDS:g})")
    p.add_argument("--exact", action="store_true",
                   help="one CP-SAT model over every chunk (small traces, 2-4 blocks): the optimum the default "
                        "planner is measured against")
    p.add_argument("--device-memory-gb", metavar="X", type=float, default=None,
                   help="override the DEVICE capacity the planner may fill, in GB (10^9 bytes)")
    p.add_argument("--no-optimizer-overlap", action="store_true",
                   help="run the CPU optimizer after backward instead of overlapping it (Fuyou §4.3)")
    p.add_argument("--no-checkpoint-offload", action="store_true",
                   help="keep recompute checkpoints (the inputs of RECOMPUTE blocks) on DEVICE instead of letting the "
                        "planner park them on HOST; needed by this executor, which does not offload them yet")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_main)


def _progress(enabled: bool):
    """A status line on stderr for long solves (rich), only when stderr is a terminal."""
    if not enabled:
        return None, None
    from rich.console import Console

    console = Console(stderr=True)
    status = console.status("solving")
    status.start()
    return status, (lambda msg: status.update(msg))


def _main(args: argparse.Namespace) -> int:
    from planner.presets import resolve_hardware
    from schemas._base import digest_bytes, read_bytes

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
    status, progress = _progress(sys.stderr.isatty() and not args.json)
    try:
        report = solve_report(trace, hardware, trace_digest=digest, time_limit_s=args.time_limit, exact=args.exact,
                              device_bytes=device_bytes, optimizer_overlap=not args.no_optimizer_overlap,
                              checkpoint_offload=not args.no_checkpoint_offload, progress=progress)
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


def _simulate_check(schedule: Schedule, hardware: Hardware) -> dict | None:
    """Replay the schedule in planner.simulate (when present): time and peaks vs the prediction."""
    try:
        from planner.simulate import simulate
    except ImportError:
        return None
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
            out["warnings"].append(f"simulated {tier.value} peak {peak / 1e9:.3f} GB differs from the prediction "
                                   f"{want / 1e9:.3f} GB by {100 * abs(peak - want) / want:.1f}%")
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
        "gap": h.gap,
        "predicted_seconds": s.prediction.iteration_seconds,
        "chunk_elements": report.chunk_elements,
        "chunks": len(s.layout.chunks),
        "persistent_chunks": sum(1 for c in s.initial_residency if c.list.value == "PARAM" and Tier.DEVICE in c.tiers),
        "os_tier/optimizer_tier": dict(sorted(plans.items())),
        "activation_modes": {m.value: modes.get(m.value, 0) for m in ActivationMode},
        "bytes_per_channel": {k.value: v for k, v in sorted(s.prediction.bytes_per_channel.items())},
        "peak_bytes_per_tier": {k.value: v for k, v in sorted(s.prediction.peak_bytes_per_tier.items())},
        "solve_seconds": report.solve_seconds,
        "simulated_seconds": check["iteration_seconds"] if check else None,
        "warnings": check["warnings"] if check else [],
    }


def print_summary(report: SolveReport, out: Path, check: dict | None) -> None:
    d = summary_dict(report, out, check)
    gb = 1e9
    lines = [
        f"schedule   {d['schedule']}",
        f"policy     {d['policy']}  model {d['model']}  hardware {d['hardware']}",
        f"status     {d['status']}  objective {d['objective_seconds']:.6g} s  bound {d['lower_bound_seconds']:.6g} s  "
        f"gap {100 * d['gap']:.2f}%  (materialized schedule predicts {d['predicted_seconds']:.6g} s)",
        f"chunks     {d['chunks']} x {d['chunk_elements']} elements  "
        f"(candidates: {', '.join(str(c.chunk_elements) for c in report.candidates)})",
        f"residency  {d['persistent_chunks']} PARAM chunks on DEVICE at the start of the iteration; OS/optimizer: "
        + ", ".join(f"{k} {v}" for k, v in d["os_tier/optimizer_tier"].items()),
        "activations " + ", ".join(f"{k} {v}" for k, v in d["activation_modes"].items()),
        "bytes      " + (", ".join(f"{k} {v / gb:.3f} GB" for k, v in d["bytes_per_channel"].items() if v)
                         or "none moved: everything stays on DEVICE"),
        "peaks      " + ", ".join(f"{k} {v / gb:.3f} GB" for k, v in d["peak_bytes_per_tier"].items()),
        f"solved in  {d['solve_seconds']:.2f} s (wall clock; not written into the schedule)",
    ]
    if check is not None:
        lines.append(f"simulated  {check['iteration_seconds']:.6g} s")
        for w in check["warnings"]:
            lines.append(f"warning    {w}")
    print("\n".join(lines))


__all__ = ["Candidate", "SolveReport", "build_schedule", "decisions_from_placement", "default_output_path", "register",
           "solve", "solve_report"]
