"""Placement MIP that scales with depth (issue 18, prototype; imported by nothing in the planner yet).

Measured diagnosis (bench/bench_depth.py, a100-80g-12ssd, hidden 4096, batch 8): the time of a deep
solve goes into HiGHS branching on the *second* chunk size's MIP. Its LP relaxation is tight (the
MIP's proven bound equals the LP's to 0.1%) but a few dozen of its count variables are fractional;
the blocks are nearly interchangeable (which of 64 identical blocks keeps one more chunk on DEVICE
changes the objective by microseconds), so branch and bound meets plateaus of equal nodes and
the primal heuristics find no incumbent within 1%: 749 nodes and 19 s at 64 blocks (stopped by its
share of the time limit), 1 node and 1.7 s at 96 (the LP was integral there). Time to the first
incumbent, not the bound, is what is erratic; the LP, building the model, materialize and simulate
grow about linearly.

The remedy here is *LP-integral fixing* (a relax-and-fix dive, Wolsey 1998 §12.5), with the
mechanism switches and the activation modes pinned to the LP as today (`planner.solve._solve_mip`):

1. solve the LP of the pinned model (GLOP);
2. fix every integer variable whose LP value is integral (within FIX_TOLERANCE) to that value; what
   stays free is the fractional part of the plan, a few variables per stage window, decoupled along
   the iteration, which HiGHS closes at its root;
3. if that leaves no plan, release the groups (all of their variables) whose use stages lie within
   RELEASE_STAGES of a fractional variable, then everything (today's pinned MIP), in that order.

The pinned LP's value is a lower bound of the pinned MIP only; the valid bound of the model is
the unpinned LP (`planner.solve._search`'s relaxation), which the report below keeps using.
Deterministic: GLOP and HiGHS single-threaded with seed 0 (planner.placement._MathOpt), variables
visited in model order.

`solve_scaled_report` runs today's `planner.solve.solve_report` (chunk sizes, LPs, materialize,
simulate, the reference decision sets, bounds: all unchanged) with its MIP step replaced by
`solve_mip_fixed`; porting it means replacing the body of `_solve_mip` by it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

from planner.placement import PlacementInfeasible, PlacementInput, PlacementModel, PlacementSolution

log = logging.getLogger(__name__)

FIX_TOLERANCE = 1e-6  # an LP value this close to an integer is fixed there
RELEASE_STAGES = 6  # second try: groups used within this many stages of a fractional variable are freed
FLAG_EPSILON = 1e-6  # as planner.solve: an LP value above this pins a mechanism switch on


def _pinned(lp_flags: dict[str, float]) -> dict[str, int]:
    return {k: int(v > FLAG_EPSILON) for k, v in lp_flags.items()}


def _lp_values(model: PlacementModel) -> dict[str, float]:
    return {v.name: float(model.values[v]) for v in model.solver.model.variables()}


def _group_of(name: str) -> int | None:
    """The group id in a per-group variable's name (`keep[g,i]`, `os_host[g]`, ...), else None."""
    if "[" not in name or name.startswith(("act[", "stage_time", "suffix", "checkpoint")):
        return None
    head = name[name.index("[") + 1:].split(",")[0].rstrip("]")
    return int(head) if head.isdigit() else None


def solve_mip_fixed(data: PlacementInput, lp_flags: dict[str, float], budget: float,
                    lp_modes: tuple | None = None, *, stats: dict[str, Any] | None = None) -> PlacementSolution:
    """Same contract as planner.solve._solve_mip: the pinned placement MIP, solved by LP-integral fixing."""
    started = time.perf_counter()
    flags = _pinned(lp_flags)
    stats = stats if stats is not None else {}
    try:
        lp = PlacementModel(data, relax=True, fixed_flags=flags, fixed_modes=lp_modes)
        lp.solve(time_limit_seconds=max(1.0, budget))
    except PlacementInfeasible:
        lp = None  # the pins leave no plan: today's fallbacks decide
    if lp is not None:
        values = _lp_values(lp)
        model = PlacementModel(data, fixed_flags=flags, fixed_modes=lp_modes)
        integer = [v for v in model.solver.model.variables() if v.integer and v.name in values]
        bounds = {v.name: (v.lower_bound, v.upper_bound) for v in integer}
        fractional = [v.name for v in integer if abs(values[v.name] - round(values[v.name])) > FIX_TOLERANCE]
        stats["fractional"] = len(fractional)
        stats["lp_seconds"] = time.perf_counter() - started
        skip = set(fractional)
        near = _groups_near(data, fractional)
        for attempt, free_groups in (("fix integral", set()), ("release near", near)):
            left = budget - (time.perf_counter() - started)
            if left < 0.5:
                break
            fixed = 0
            for v in integer:
                lo, hi = bounds[v.name]
                x = float(round(values[v.name]))
                if v.name in skip or _group_of(v.name) in free_groups or not lo <= x <= hi:
                    v.lower_bound, v.upper_bound = lo, hi
                    continue
                v.lower_bound = v.upper_bound = x
                fixed += 1
            try:
                sol = model.solve(time_limit_seconds=max(0.5, left))
            except PlacementInfeasible as exc:
                log.info("LP-integral fixing (%s, %d fixed): %s", attempt, fixed, exc)
                continue
            stats.update(attempt=attempt, fixed=fixed, nodes=model.result.solve_stats.node_count,
                         seconds=time.perf_counter() - started)
            return sol
    from planner.solve import _solve_mip

    stats.update(attempt="today's pinned MIP")
    return _solve_mip(data, lp_flags, max(1.0, budget - (time.perf_counter() - started)), lp_modes)


def _groups_near(data: PlacementInput, names: list[str]) -> set[int]:
    """Groups used within RELEASE_STAGES stages of a group that has a fractional variable."""
    hot = {g for g in (_group_of(k) for k in names) if g is not None}
    stages = {s for g in hot for s in data.groups[g].use_stages}
    out = set(hot)
    for g in data.groups:
        if any(abs(s - t) <= RELEASE_STAGES for s in g.use_stages for t in stages):
            out.add(g.id)
    return out


@contextlib.contextmanager
def _mip_step(replacement) -> Iterator[None]:
    import planner.solve as solve_mod

    saved = solve_mod._solve_mip
    solve_mod._solve_mip = replacement
    try:
        yield
    finally:
        solve_mod._solve_mip = saved


class ScaledReport:
    """The outcome of one scaled solve, for the bench."""

    def __init__(self, report: Any, mips: list[dict[str, Any]], seconds: float) -> None:
        self.report, self.mips, self.seconds = report, mips, seconds

    @property
    def true_gap(self) -> float:
        r = self.report
        return (r.simulated_seconds - r.lower_bound_seconds) / r.simulated_seconds

    def summary(self) -> str:
        r = self.report
        mips = "; ".join(f"{m.get('attempt')}: {m.get('fractional', '?')} fractional, {m.get('fixed', '?')} fixed, "
                         f"nodes {m.get('nodes', '?')}, {m.get('seconds', math.nan):.2f} s" for m in self.mips)
        return (f"objective {r.model_objective_seconds:.4f} bound {r.lower_bound_seconds:.4f} simulated "
                f"{r.simulated_seconds:.4f} true gap {100 * self.true_gap:.2f}% chosen: {r.chosen} [MIPs: {mips}]")


def solve_scaled_report(trace: Any, hardware: Any, *, trace_digest: str, time_limit_s: float = 60.0) -> ScaledReport:
    """planner.solve.solve_report with the MIP step solved by LP-integral fixing."""
    from planner.solve import solve_report

    mips: list[dict[str, Any]] = []

    def step(data, lp_flags, budget, lp_modes=None):
        stats: dict[str, Any] = {}
        mips.append(stats)
        return solve_mip_fixed(data, lp_flags, budget, lp_modes, stats=stats)

    started = time.perf_counter()
    with _mip_step(step):
        report = solve_report(trace, hardware, trace_digest=trace_digest, time_limit_s=time_limit_s)
    return ScaledReport(report, mips, time.perf_counter() - started)


__all__ = ["ScaledReport", "solve_mip_fixed", "solve_scaled_report"]
