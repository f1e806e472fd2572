"""Placement MIP that scales with depth (issue 18, prototype; imported by nothing in the planner yet).

Measured diagnosis (`python bench/bench_depth.py`, a100-80g-12ssd, hidden 4096, batch 8, CPU
seconds on the shared 2-core box, load 8-14 during most runs: ratios, not absolutes):

- 64 blocks is slow because of the *second* chunk size's MIP: HiGHS branched 749 nodes and stopped
  FEASIBLE at its share of the time limit (19.4 s of 23.4 s CPU); at 32 blocks the same MIP took
  107 nodes (1.7 s), at 96 and 128 one node. The LP of these models leaves 150-470 integer count
  variables fractional (353/466 at 64 blocks, 344/436 at 96): the erratic part is the search
  for an incumbent within 1% among them, not the bound and not the model's size.
- 256 and 512 blocks fail ("no integral plan ... raise --time-limit"): the LPs of three chunk sizes
  and their model builds use up the wall-clock limit (256: build 5.1 + LP 7.0 s CPU; 512: 15.1 +
  11.3 s), the first MIP gets the 1 s floor of `_search`'s budget and finds no incumbent in it.
- Building the model grows faster than linearly (LP build per chunk size 0.31/0.5/1.7/5.0 s at
  96/128/256/512 blocks): the DEVICE rows hold 40 nonzeros per row at 128 blocks and 72 at 256
  (quadratic), because a chunk arriving in the optimizer stage counts in every DEVICE row until
  its forward use in the next iteration. `SparsePlacementModel` routes those through running sums
  (same LP, 75,315 instead of 138,781 nonzeros at 256 blocks, build 1.07 instead of 1.74 s); GLOP
  however needs twice the pivots on it (18,836 vs 9,234), so only the MIP uses it.

The remedy here is *LP-integral fixing* (a relax-and-fix dive, Wolsey 1998 §12.5), with the
mechanism switches and the activation modes pinned to the LP as today (`planner.solve._solve_mip`):

1. take the chunk-size search's LP solution (or solve the pinned LP where there is none);
2. fix every integer variable whose LP value is integral (within FIX_TOLERANCE); the fractional
   rest is closed by HiGHS at its root (1-5 nodes measured at 32-512 blocks);
3. if that leaves no plan, release the groups used within RELEASE_STAGES of a fractional variable,
   then the pinned LP, then today's pinned MIP, in that order.

Bounds: a MIP with pinned switches, modes or fixed counts bounds only its restriction, so the bound
of a chunk size is the unpinned LP's, or HiGHS's root node of the unpinned model (node limit 1:
deterministic) where neither the LP nor the physical bound is within ROOT_BOUND_GAP of the plan.
(Today's header takes the larger of the LP and the pinned MIP's dual bound, which is not a valid
bound of the model: 32 blocks reports 2.2177 s where the unpinned root proves 2.2164 s.)
Deterministic: GLOP and HiGHS single-threaded with seed 0 (planner.placement._MathOpt), variables
visited in model order, a node limit rather than a time limit for the root bound.

Measured after (`python bench/bench_depth.py --blocks 32,48,64,96,128,256 --scaled --no-solve
--time-limit 300`, same box, load 13-16, so CPU seconds are inflated ~1.5-2x against a quiet run;
before = today's solve_report, default limit; true gap = (simulated - valid bound) / simulated):

    blocks   CPU s before -> after   simulated s before -> after   true gap after
      32        3.30 -> 4.63 *          2.3639 -> 2.2789             3.42%
      48        4.06 -> 4.60 *          4.1311 -> 4.1281             5.14%
      64       23.37 -> 4.14            5.9418 -> 5.8729             2.35%
      96        8.26 -> 5.49            9.5894 -> 9.4547             2.37%
     128       11.78 -> 7.48           13.0287 -> 12.9676            1.30%
     256       failed -> 20.15          (no plan) -> 26.9924         0.16%
     512       failed -> 72.67          (no plan) -> 55.6823         1.12%   (LP 48.1 s of it)
    175B rtx4090-768g-12ssd: 14.11 -> 7.92 CPU s, simulated 116.5494 -> 114.7867, true gap 10.73%
    (the 175B gap is the model's optimism about the SSD queue: simulated is 12% above the model's
    objective, and the physical bound is above the objective; no MIP setting closes it)
    (* the root-node bound: 23 s wall / ~3 s CPU at 32 blocks; it is what makes the gap valid)

The model objective is the same or lower than today's MIP at 32/48/96 (2.2326 vs 2.2332, 3.9802
vs 4.0346, 9.2305 vs 9.2887); at 48 blocks the placement now beats the PatrickStar-like reference
set that won before. What is left at 512 blocks is the chunk-size search's LP (three GLOP solves,
~16 s CPU each under this load even on the dual simplex, 46 s and unfinished on the primal), not the
MIP (0.9-1.3 s at the root).

`solve_scaled_report` runs today's `planner.solve.solve_report` (chunk sizes, LPs, materialize,
simulate, the reference decision sets: all unchanged) with its MIP step replaced by
`solve_mip_fixed` and the search's LP values remembered; porting it means replacing the body of
`_solve_mip` by it and keeping the LP model's values in `_search`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

from ortools.math_opt.python import mathopt

import planner.solve as solve_mod
from planner.bounds import physical_lower_bound_seconds
from planner.mathopt_solver import MathOptSolver as _MathOpt
from planner.mathopt_solver import quiet_stdout as _quiet_stdout
from planner.placement import (
    SECONDARY_TERMS,
    SECONDARY_WEIGHT,
    TIME_UNIT,
    PlacementInfeasible,
    PlacementInput,
    PlacementModel,
    PlacementSolution,
    _is_zero,
    _runs,
)
from planner.solve import PIN_MODES_BLOCKS, _solve_mip, solve_report

log = logging.getLogger(__name__)

FIX_TOLERANCE = 1e-6  # an LP value this close to an integer is fixed there
RELEASE_STAGES = 6  # second try: groups used within this many stages of a fractional variable are freed
ROOT_BOUND_GAP = 0.03  # below this model gap the LP (or physical) bound is kept; above, the root node's is computed
MIN_FIXED_SECONDS = 10.0  # wall-clock floor of a fixed MIP's time limit (see solve_mip_fixed)
FLAG_EPSILON = 1e-6  # as planner.solve: an LP value above this pins a mechanism switch on


class SparsePlacementModel(PlacementModel):
    """PlacementModel with the DEVICE rows kept sparse (the same LP, reformulated).

    Measured (bench/bench_depth.py, hidden 4096, chunk 67257720 elements): the DEVICE rows held
    20,916 nonzeros over 520 rows at 128 blocks and 74,548 over 1,032 at 256 (40 -> 72 per row:
    quadratic in depth), half of the model's nonzeros. The cause: a chunk arriving in stage k
    counts in every DEVICE row from k to its use, and the wrap gap's arrivals in the optimizer
    stage (updated params coming back up) stay until the block's forward in the next iteration,
    so the forward stage s row carries one term per block after s. Here those intervals go
    through running sums (`_interval_sums`, as the kept chunks already do): O(1) terms per row.
    """

    def _build_memory_terms(self) -> None:
        super()._build_memory_terms()
        n = len(self.data.stages)
        items: list[tuple[int, int, Any]] = []
        for gi, g in enumerate(self.data.groups):
            for i, gap in enumerate(self.gaps[gi]):
                pos = {s: j for j, s in enumerate(gap.stages)}
                for k, s_in in enumerate(gap.lookahead):
                    for first, last in _runs(gap.stages[pos[s_in]:]):
                        items.append((first, last, self.incoming[gi][i][k] * g.param_bytes))
        running = self._interval_sums("arrived_params", items)
        self.arrived = [[running[s]] if not _is_zero(running[s]) else [] for s in range(n)]


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


def _tries(data: PlacementInput, lp_flags: dict[str, float], lp_modes: tuple | None) -> list[tuple[dict[str, int], tuple | None]]:
    """The pins in planner.solve._solve_mip's order: switches and modes, switches only, then the
    switches released one at a time, least used by the LP first."""

    pinned = _pinned(lp_flags)
    tries: list[tuple[dict[str, int], tuple | None]] = []
    if lp_modes is not None and len(data.blocks) >= PIN_MODES_BLOCKS:
        tries.append((dict(pinned), lp_modes))
    tries.append((dict(pinned), None))
    for _, name in sorted((v, k) for k, v in lp_flags.items() if pinned[k]):
        pinned[name] = 0
        tries.append((dict(pinned), None))
    return tries


def solve_mip_fixed(data: PlacementInput, lp_flags: dict[str, float], budget: float,
                    lp_modes: tuple | None = None, *, stats: dict[str, Any] | None = None,
                    lp_values: dict[str, float] | None = None) -> PlacementSolution:
    """Same contract as planner.solve._solve_mip: the pinned placement MIP, solved by LP-integral
    fixing, for each of _solve_mip's pins in turn. `lp_values` (by variable name): the unpinned
    LP's solution where the caller has it (planner.solve's chunk-size search solved it already);
    else the LP of the pinned model is solved here."""
    started = time.perf_counter()
    stats = stats if stats is not None else {}
    for n_try, (flags, modes) in enumerate(_tries(data, lp_flags, lp_modes)):
        sol = _fixed(data, flags, modes, lp_values, budget, started, stats)
        if sol is not None:
            stats["pins"] = f"try {n_try}: {'modes pinned' if modes is not None else 'modes free'}"
            return sol

    stats.update(attempt="today's pinned MIP", seconds=math.nan)
    return _solve_mip(data, lp_flags, max(1.0, budget - (time.perf_counter() - started)), lp_modes)


def _fixed(data: PlacementInput, flags: dict[str, int], modes: tuple | None, lp_values: dict[str, float] | None,
           budget: float, started: float, stats: dict[str, Any]) -> PlacementSolution | None:
    """One pin set: fix to the LP's integral values, then release the groups near the fractional
    ones; None when neither leaves a plan."""
    model = SparsePlacementModel(data, fixed_flags=flags, fixed_modes=modes)
    integer = [v for v in model.solver.model.variables() if v.integer]
    bounds = {v.name: (v.lower_bound, v.upper_bound) for v in integer}
    source, values = "search LP", lp_values
    if values is None:
        try:
            lp = DualSimplexPlacementModel(data, relax=True, fixed_flags=flags, fixed_modes=modes)
            lp.solve(time_limit_seconds=max(1.0, budget - (time.perf_counter() - started)))
        except PlacementInfeasible:
            return None
        source, values = "pinned LP", _lp_values(lp)
    fractional = [v.name for v in integer
                  if v.name in values and abs(values[v.name] - round(values[v.name])) > FIX_TOLERANCE]
    stats["fractional"] = len(fractional)
    skip = set(fractional)
    near = _groups_near(data, fractional)
    for attempt, free_groups in (("fix integral", set()), ("release near", near)):
        # the fixed MIP closes at its root in about a second of CPU (bench_depth: 0.4-2.7 s at
        # 64-512 blocks): it gets that much even where the caller's budget is spent, so that a
        # loaded machine does not turn a deterministic plan into the fallback's time limit
        left = max(MIN_FIXED_SECONDS, budget - (time.perf_counter() - started))
        fixed = 0
        for v in integer:
            lo, hi = bounds[v.name]
            x = float(round(values[v.name])) if v.name in values else math.nan
            if v.name in skip or _group_of(v.name) in free_groups or not lo <= x <= hi:
                v.lower_bound, v.upper_bound = lo, hi
                continue
            v.lower_bound = v.upper_bound = x
            fixed += 1
        try:
            sol = model.solve(time_limit_seconds=left)
        except PlacementInfeasible as exc:
            log.info("LP-integral fixing (%s, %s, %d fixed): %s", source, attempt, fixed, exc)
            continue
        stats.update(attempt=f"{source}, {attempt}", fixed=fixed, nodes=model.result.solve_stats.node_count,
                     seconds=time.perf_counter() - started)
        return sol
    return None


def root_bound_seconds(data: PlacementInput, *, time_limit_seconds: float = 60.0) -> float:
    """A valid lower bound of the (unpinned) placement model, tighter than its LP: the dual bound of
    HiGHS's root node (cuts included), node limit 1 so that it does not depend on the machine's
    speed. Measured at 32 blocks (hidden 4096, a100-80g-12ssd, chunk 67257720): LP 2.1194 s, root
    2.2164 s, which is what brings the true gap under 5% where the LP leaves it at 8.9%.
    Returns 0.0 when HiGHS stops without a bound."""



    model = PlacementModel(data)
    params = mathopt.SolveParameters(time_limit=datetime.timedelta(seconds=time_limit_seconds), node_limit=1,
                                     random_seed=0, enable_output=False)
    with _quiet_stdout():
        result = mathopt.solve(model.solver.model, mathopt.SolverType.HIGHS, params=params)
    bound = result.termination.objective_bounds.dual_bound
    if not math.isfinite(bound):
        return 0.0
    return max(0.0, bound / (1 + SECONDARY_TERMS * SECONDARY_WEIGHT) * TIME_UNIT)


class _DualSimplexMathOpt(_MathOpt):
    """planner.placement's solver wrapper with GLOP on its dual simplex. Measured on the 256-block
    LP (hidden 4096, a100-80g-12ssd, chunk 67257720): 1.99 s CPU instead of 3.84 s with GLOP's
    default (primal), 3.40 s with HiGHS's dual simplex, 3.30 s with HiGHS's barrier; the same
    optimum. Deterministic as GLOP's default (one thread)."""

    def solve(self, *, time_limit_seconds: float, relative_gap: float) -> Any:


        if self.kind is not mathopt.SolverType.GLOP:
            return super().solve(time_limit_seconds=time_limit_seconds, relative_gap=relative_gap)
        params = mathopt.SolveParameters(time_limit=datetime.timedelta(seconds=max(0.5, time_limit_seconds)),
                                         random_seed=0, enable_output=False,
                                         lp_algorithm=mathopt.LPAlgorithm.DUAL_SIMPLEX)
        with _quiet_stdout():
            return mathopt.solve(self.model, self.kind, params=params)


class DualSimplexPlacementModel(PlacementModel):
    """PlacementModel whose LP relaxation GLOP solves by its dual simplex."""

    def __init__(self, data: PlacementInput, **kwargs: Any) -> None:
        super().__init__(data, **kwargs)
        if self.relax:
            self.solver.__class__ = _DualSimplexMathOpt


class _SearchLP(DualSimplexPlacementModel):
    """planner.solve's PlacementModel, remembering the values of the chunk-size LPs it solves (by
    the input object) so that the MIP step fixes to them without solving the LP again."""

    stash: dict[int, tuple[PlacementInput, dict[str, float], float]] = {}

    def solve(self, **kwargs: Any) -> PlacementSolution:
        sol = super().solve(**kwargs)
        if self.relax and self.capacity is None:
            _SearchLP.stash[id(self.original)] = (self.original, _lp_values(self), sol.bound_seconds)
        return sol


def _stashed(data: PlacementInput) -> tuple[dict[str, float] | None, float]:
    """The search LP's values and its (valid) lower bound for `data`; (None, 0) if not solved."""
    found = _SearchLP.stash.get(id(data))
    return (found[1], found[2]) if found is not None and found[0] is data else (None, 0.0)


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

    saved = solve_mod._solve_mip, solve_mod.PlacementModel
    solve_mod._solve_mip, solve_mod.PlacementModel = replacement, _SearchLP
    try:
        yield
    finally:
        solve_mod._solve_mip, solve_mod.PlacementModel = saved
        _SearchLP.stash.clear()


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
        mips = "; ".join(f"{m.get('pins', '')} {m.get('attempt')}: {m.get('fractional', '?')} fractional, {m.get('fixed', '?')} fixed, "
                         f"nodes {m.get('nodes', '?')}, {m.get('seconds', math.nan):.2f} s"
                         + (f", root bound {m['root bound']}" if "root bound" in m else "") for m in self.mips)
        return (f"objective {r.model_objective_seconds:.4f} bound {r.lower_bound_seconds:.4f} simulated "
                f"{r.simulated_seconds:.4f} true gap {100 * self.true_gap:.2f}% chosen: {r.chosen} [MIPs: {mips}]")


def solve_scaled_report(trace: Any, hardware: Any, *, trace_digest: str, time_limit_s: float = 60.0) -> ScaledReport:
    """planner.solve.solve_report with the MIP step solved by LP-integral fixing."""

    mips: list[dict[str, Any]] = []
    best = [math.inf]  # the best MIP objective so far (chunk sizes come in LP order)

    def step(data, lp_flags, budget, lp_modes=None):
        stats: dict[str, Any] = {}
        mips.append(stats)

        values, lp_bound = _stashed(data)
        sol = solve_mip_fixed(data, lp_flags, budget, lp_modes, stats=stats, lp_values=values)
        # the MIP's own bound holds for the pinned, partly fixed model only: the valid lower bound
        # of this chunk size is the unpinned LP's (planner.solve keeps the larger of the two), or
        # the root node's where neither the LP nor the physical bound is within ROOT_BOUND_GAP
        bound = lp_bound
        best[0] = min(best[0], sol.objective_seconds)
        # only where it can matter: the header's bound is the least over the chunk sizes, so a
        # chunk size whose LP is already above the best plan's needs no tighter bound
        target = best[0] * (1 - ROOT_BOUND_GAP)
        if max(lp_bound, physical_lower_bound_seconds(data)) < target:
            start = time.perf_counter()
            bound = max(bound, root_bound_seconds(data))
            stats["root bound"] = f"{bound:.4f} s ({time.perf_counter() - start:.2f} s)"
        return dataclasses.replace(sol, bound_seconds=min(sol.objective_seconds, bound))

    started = time.perf_counter()
    with _mip_step(step):
        report = solve_report(trace, hardware, trace_digest=trace_digest, time_limit_s=time_limit_s)
    return ScaledReport(report, mips, time.perf_counter() - started)


__all__ = ["ScaledReport", "solve_mip_fixed", "solve_scaled_report"]
