"""The linear solver the placement model is built on: the few pywraplp-style calls it makes, on an
OR-Tools MathOpt model (HiGHS for the MIP; GLOP, or HiGHS's interior point method with crossover,
"HIGHS_IPM", for its relaxation; without crossover, "HIGHS_IPM_BOUND", for an LP solved for its bound
alone), with HiGHS's banner kept off the CLI's stdout.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import math
import os
import sys
import threading
from typing import Any

import numpy as np
from ortools.math_opt.elemental.python import enums
from ortools.math_opt.python import bounded_expressions, mathopt, variables
from ortools.math_opt.solvers import highs_pb2


BOUND_ONLY = "HIGHS_IPM_BOUND"  # HiGHS's interior point without crossover: an LP solved for its bound alone

# Note [one HiGHS solve at a time]:
# A solve with several jobs runs HiGHS in a thread beside its Python work (planner.solve: the next chunk size's LP,
# the LPs that prove the bound; MathOpt's solve call releases the GIL, measured: the other thread ran at 96% of its
# speed alone). Two HiGHS instances solving at once in one process have crashed (HiGHS issues #810 and #3141, its
# task scheduler), so every solve call takes this lock: HiGHS solves one model at a time here, from any thread.
# planner.replays forks its workers only while holding it, so a worker never starts inside a HiGHS solve (whose
# locks and half-done state the fork would copy); a child starts with the lock free.
ONE_HIGHS_SOLVE = threading.Lock()


def _free_in_child() -> None:
    global ONE_HIGHS_SOLVE
    ONE_HIGHS_SOLVE = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_in_child)


class MathOptSolver:
    """The few calls the model makes, on an OR-Tools MathOpt model.

    MathOpt rather than pywraplp: through pywraplp a HiGHS MIP stopped by its time limit reports
    no solution at all, while MathOpt returns the incumbent and the proven bound."""

    _TYPES = {"HIGHS": mathopt.SolverType.HIGHS, "HIGHS_IPM": mathopt.SolverType.HIGHS,
              BOUND_ONLY: mathopt.SolverType.HIGHS, "GLOP": mathopt.SolverType.GLOP, "PDLP": mathopt.SolverType.PDLP}

    def __init__(self, name: str) -> None:
        self.use(name)
        # Note [GLOP's primal simplex]: its dual simplex was 2x faster on the 256-block LP (1.99 s vs
        # 3.84 s CPU, bench/bench_depth.py), but with the shared host-DRAM and both-ways PCIe rows it
        # ran for over 12 minutes on gpt-small's LP (cpu-emulated, 0.05 GB), past its time limit, where
        # the primal simplex solves the whole problem in 0.5 s (measured 2026-11-23, this CI machine)
        self._model = mathopt.Model(name="placement")
        self._rows = 0
        # rows added but not yet in the MathOpt model (Note [rows in bulk])
        self._pending_names: list[str] = []
        self._pending_bounds: list[tuple[float, float]] = []
        self._pending_terms: list[dict[Any, float]] = []

    def use(self, name: str) -> None:
        """Solve with this solver from now on (the same model: a relaxation turned into its MIP)."""
        self.name = name
        self.kind = self._TYPES[name]

    @property
    def model(self) -> mathopt.Model:
        """The MathOpt model with every row added so far."""
        self._flush()
        return self._model

    @staticmethod
    def infinity() -> float:
        return math.inf

    def NumVar(self, lo: float, hi: float, name: str) -> Any:  # noqa: N802 (pywraplp's spelling)
        return self._model.add_variable(lb=lo, ub=hi, name=name)

    def IntVar(self, lo: float, hi: float, name: str) -> Any:  # noqa: N802
        return self._model.add_variable(lb=lo, ub=hi, is_integer=True, name=name)

    def BoolVar(self, name: str) -> Any:  # noqa: N802
        return self._model.add_binary_variable(name=name)

    # Note [rows in bulk]:
    # MathOpt's `add_linear_constraint` flattens the expression tree through one Python method call
    # per node and writes the row into the C++ model one coefficient at a time: at 256 blocks
    # (hidden 4096, a100-80g-12ssd) 160k rows and 800k coefficients took 20.5 of the solve's 37 s of
    # model building (cProfile, bench/RESULTS.md "Solve time: fewer and faster model builds").
    # `Add` flattens with `flat_linear` (MathOpt's own algorithm, so every coefficient is the same
    # float) and keeps the row; `_flush` adds the pending rows in the order they were added (the same
    # ids) and writes their bounds and coefficients in three bulk calls, before anything reads the
    # model (`model`, `solve`). The model is the same one: tests/test_mathopt_rows.py compares the
    # exported model with MathOpt's own rows.
    def Add(self, bounded: Any, name: str = "") -> Any:  # noqa: N802
        """Add the row `bounded` (lb <= expr <= ub); it reaches the model at the next `model`/`solve`."""
        self._rows += 1
        if type(bounded) not in _BOUNDED:  # VarEqVar, a bool, a bad type: MathOpt's path (and its errors)
            self._flush()
            return self._model.add_linear_constraint(bounded, name=name)
        terms, offset = flat_linear(bounded.expression)
        if math.isinf(offset):  # what MathOpt refuses (its message)
            self._flush()
            return self._model.add_linear_constraint(bounded, name=name)
        self._pending_names.append(name)
        self._pending_bounds.append((bounded.lower_bound - offset, bounded.upper_bound - offset))
        self._pending_terms.append(terms)
        return None

    def _flush(self) -> None:
        if not self._pending_names:
            return
        elemental = self._model._elemental  # noqa: SLF001 (MathOpt's bulk interface)
        # one add_element per row: add_named_elements pads every name to the longest with NULs
        add, row_type = elemental.add_element, enums.ElementType.LINEAR_CONSTRAINT
        ids = np.array([add(row_type, name) for name in self._pending_names], dtype=np.int64)
        bounds = np.array(self._pending_bounds, dtype=np.float64).reshape(-1, 2)
        keys = ids.reshape(-1, 1)
        elemental.set_attrs(enums.DoubleAttr1.LINEAR_CONSTRAINT_LOWER_BOUND, keys, bounds[:, 0].copy())
        elemental.set_attrs(enums.DoubleAttr1.LINEAR_CONSTRAINT_UPPER_BOUND, keys, bounds[:, 1].copy())
        rows = [(row, var.id, coef) for row, terms in zip(ids.tolist(), self._pending_terms) for var, coef in terms.items()]
        if rows:
            elemental.set_attrs(enums.DoubleAttr2.LINEAR_CONSTRAINT_COEFFICIENT,
                                np.array([(r, v) for r, v, _ in rows], dtype=np.int64),
                                np.array([c for _, _, c in rows], dtype=np.float64))
        self._pending_names, self._pending_bounds, self._pending_terms = [], [], []

    def Minimize(self, expr: Any) -> None:  # noqa: N802
        """What `model.minimize(expr)` sets (offset, coefficients, direction), flattened by `flat_linear`
        and its coefficients written in one bulk call (Note [rows in bulk])."""
        terms, offset = flat_linear(expr)
        objective = self.model.objective
        objective.clear()
        objective.offset = offset
        if terms:
            self._model._elemental.set_attrs(  # noqa: SLF001
                enums.DoubleAttr1.OBJECTIVE_LINEAR_COEFFICIENT,
                np.array([v.id for v in terms], dtype=np.int64).reshape(-1, 1), np.array(list(terms.values()), dtype=np.float64))
        objective.is_maximize = False

    def NumVariables(self) -> int:  # noqa: N802
        return self.model._elemental.get_num_elements(enums.ElementType.VARIABLE)  # noqa: SLF001

    def integer_variables(self) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
        """(ids, names, lower bounds, upper bounds) of the integer variables, in id order, read in bulk: what
        `model.variables()` and each variable's properties give, one C++ call per attribute (Note [rows in bulk])."""
        elemental = self.model._elemental  # noqa: SLF001
        ids = np.sort(elemental.get_elements(enums.ElementType.VARIABLE))
        ids = ids[elemental.get_attrs(enums.BoolAttr1.VARIABLE_INTEGER, ids.reshape(-1, 1))]
        keys = ids.reshape(-1, 1)
        return (ids, elemental.get_element_names(enums.ElementType.VARIABLE, ids).tolist(),
                elemental.get_attrs(enums.DoubleAttr1.VARIABLE_LOWER_BOUND, keys),
                elemental.get_attrs(enums.DoubleAttr1.VARIABLE_UPPER_BOUND, keys))

    def set_bounds(self, ids: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> None:
        """The variables `ids` bounded by `lower` and `upper` (what setting each one's `lower_bound` and `upper_bound`
        does, in two bulk calls)."""
        elemental, keys = self.model._elemental, ids.reshape(-1, 1)  # noqa: SLF001
        elemental.set_attrs(enums.DoubleAttr1.VARIABLE_LOWER_BOUND, keys, np.ascontiguousarray(lower, dtype=np.float64))
        elemental.set_attrs(enums.DoubleAttr1.VARIABLE_UPPER_BOUND, keys, np.ascontiguousarray(upper, dtype=np.float64))

    def NumConstraints(self) -> int:  # noqa: N802
        return self._rows

    def solve(self, *, time_limit_seconds: float, relative_gap: float, node_limit: int | None = None,
              objective_bound: float | None = None, lean_search: bool = False) -> Any:
        """`node_limit` (HiGHS): stop after that many branch-and-bound nodes, so that the outcome does
        not depend on the machine's speed; the time limit is then only a safety net. `objective_bound` (an LP on
        HiGHS): stop once its optimum is proven above it (Note [an LP stopped above a bound]). `lean_search` (a MIP
        on HiGHS under a node limit): no root restart, no strong branching (Note [a polish's work in nodes])."""
        params = mathopt.SolveParameters(
            time_limit=datetime.timedelta(seconds=max(0.5, time_limit_seconds)),
            random_seed=0,  # deterministic (HiGHS runs its MIP search on one thread)
            enable_output=False,
        )
        if self.kind is mathopt.SolverType.HIGHS:
            params.relative_gap_tolerance = relative_gap
            if node_limit is not None:
                params.node_limit = node_limit
        if objective_bound is not None:  # Note [an LP stopped above a bound]: the dual simplex, presolve off
            assert self.kind is mathopt.SolverType.HIGHS, "an objective bound is HiGHS's"
            params.lp_algorithm = mathopt.LPAlgorithm.DUAL_SIMPLEX
            params.highs = highs_pb2.HighsOptionsProto(string_options={"presolve": "off"},
                                                       double_options={"objective_bound": objective_bound})
        elif lean_search:  # Note [a polish's work in nodes]
            assert self.kind is mathopt.SolverType.HIGHS and node_limit is not None, "a lean search is HiGHS's, in nodes"
            params.highs = highs_pb2.HighsOptionsProto(bool_options={"mip_allow_restart": False},
                                                       int_options={"mip_pscost_minreliable": 0})
        elif self.name in ("HIGHS_IPM", BOUND_ONLY):
            # Note [the placement LP on HiGHS's interior point]: the chunk-size search's LP, on the
            # sparse DEVICE rows (placement.SparsePlacementModel), by HiGHS's IPX with crossover (a
            # vertex, as LP-integral fixing needs). Measured on the 512-block LP (hidden 4096,
            # a100-80g-12ssd, chunk 67257720; 22.6k columns, 27.3k rows; CPU seconds on the 2-core
            # CI box at load ~12, 2026-11-23): IPX 7.8 s, HiGHS dual simplex 17.8 s (31.7k pivots),
            # GLOP primal on the dense rows 37 s average over the 3 chunk sizes; at 128 blocks
            # 0.6-0.8 s for every one. GLOP also stops IMPRECISE on gpt-small's 66220-element LP
            # (cpu-emulated, 0.05 GB), which HiGHS solves.
            params.lp_algorithm = mathopt.LPAlgorithm.BARRIER
            if self.name == BOUND_ONLY:
                # an LP solved for its bound alone needs no vertex: IPX stops at its optimal primal-dual pair,
                # without crossover (the 256-block LP with CPU Adam alone, hidden 4096, a100-80g-12ssd: 7.8 s
                # instead of 20.9 s CPU, the same objective to 1e-10; bench/RESULTS.md, session 16)
                params.highs = highs_pb2.HighsOptionsProto(string_options={"run_crossover": "off"})
            # (MathOpt refuses `threads` for HiGHS; IPX and its crossover run serially: the same
            # bytes twice is checked by tests/test_solve.py and bench/bench_solve.py --twice)
        model = self.model
        # one HiGHS solve at a time in this process (Note [one HiGHS solve at a time])
        with ONE_HIGHS_SOLVE, quiet_stdout():
            result = mathopt.solve(model, self.kind, params=params, model_params=_PRIMAL_ONLY)
            if self.kind is mathopt.SolverType.GLOP and result.termination.reason is mathopt.TerminationReason.IMPRECISE:
                # GLOP's primal simplex gave up on the numerics (gpt-small on cpu-emulated at 0.05 GB, once
                # CPU Adam was priced at the worker's 1 thread beside the both-ways PCIe row): the same LP
                # through HiGHS's simplex, deterministic too, reaches its optimum
                result = mathopt.solve(model, mathopt.SolverType.HIGHS, params=params, model_params=_PRIMAL_ONLY)
            return result


# Note [an LP stopped above a bound]:
# Where a solve needs the least of several LPs' values (planner.solve's proven bound, one LP per chunk size), an LP
# after the first only has to tell whether it is below the least so far. HiGHS's dual simplex stops once the dual
# objective of its basis is above the `objective_bound` option: a proven lower bound of the LP's optimum, checked
# with the costs unperturbed (HiGHS, HEkkDual::reachedExactObjectiveBound: "costs will be perturbed, so need to
# check whether exact dual objective value exceeds the prescribed upper bound"), and MathOpt then reports
# NO_SOLUTION_FOUND with Limit.OBJECTIVE. Presolve off: with it on, HiGHS solved on to the optimum. Measured
# (bench/RESULTS.md, session 25, GPT-3 175B's LPs with CPU Adam alone, chunk 1812099072 after chunk 605212776, CPU s on
# the 2-core box): rtx4090-768g-12ssd 0.38 s instead of IPX's 1.13 s, a100-80g-12ssd 0.64 instead of 1.03 s;
# solved through to an optimum below the bound the dual simplex took 1.5-2.0 s where IPX took 1.0-1.25 s.

# Note [a polish's work in nodes]:
# A polish (planner.solve `_polished`: the pinned MIP under POLISH_NODE_LIMIT nodes) bounds its search in nodes, so
# that the machine's speed never decides the plan; but HiGHS spends work the node limit does not count before its
# first branch: a root restart (the MIP presolved again once reduced-cost fixing has fixed enough columns, then a
# new root with its cuts) and reliability branching's strong branching (HiGHS's options, HighsOptions.h:
# `mip_pscost_minreliable`, "minimal number of observations before pseudo costs are considered reliable", 8 by
# default; until then a branching candidate is scored by an LP per direction). A lean search turns both
# off (`mip_allow_restart` false, `mip_pscost_minreliable` 0: pseudocosts from the first branch), so its work is
# its nodes. Measured (bench/RESULTS.md, session 26; CPU s, 2-core box): GPT-1.3B (24 x 2048, batch 8) at a 16 GB
# DEVICE budget on measured-nvidia-h200.toml, chunk 16818876: the polish 12.7 -> 5.1 s, the solve 20.0 -> 12.7 s
# (one job), the same model objective (0.192069 s; an alternative optimum, replayed 0.20457 -> 0.20308 s); each
# option alone 8.8 and 7.9 s. The rank ladder (pstar-gpt-4b, 2 x 8 V100), where every chunk size is polished with
# its switch releases: 8 ranks 60.7 -> 52.1 s, 16 ranks 47.7 -> 43.0 s, the same plans. The goldens, the depth
# ladder, bench/published.py and bench/bench_compare_multi.py give the same plans and bytes as without it.
# Session 24 measured the options on the captured 1.3B polish MIP alone: 26.3 -> 10.7 s, the same incumbent.

# The placement reads the primal values only: no dual values or reduced costs are handed back (MathOpt
# filters what it returns, the solve is the same), which were half of parsing an LP's result (256 blocks:
# 0.8 of MathOpt's 1.9 s under cProfile, bench/RESULTS.md "Solve time: fewer and faster model builds")
_PRIMAL_ONLY = mathopt.ModelSolveParameters(dual_values_filter=mathopt.SparseVectorFilter(filtered_items=()),
                                            reduced_costs_filter=mathopt.SparseVectorFilter(filtered_items=()))

_BOUNDED = (bounded_expressions.BoundedExpression, bounded_expressions.UpperBoundedExpression,
            bounded_expressions.LowerBoundedExpression)


def flat_linear(expr: Any) -> tuple[dict[Any, float], float]:
    """(coefficient per variable, offset) of a linear expression: `mathopt.LinearExpression(expr)`'s
    terms and offset, by the same breadth-first walk adding the same products in the same order (so
    the same floats), with the node types dispatched here instead of one method call per node.
    An expression with a node type it does not know goes through MathOpt's own flattening."""
    terms: dict[Any, float] = {}
    offset = 0.0
    queue = collections.deque([(expr, 1.0)])
    pop, push = queue.popleft, queue.append
    while queue:
        node, scale = pop()
        kind = type(node)
        if kind is _VARIABLE:
            terms[node] = terms.get(node, 0.0) + scale
        elif kind is _TERM:
            var = node._variable  # noqa: SLF001
            terms[var] = terms.get(var, 0.0) + node._coefficient * scale  # noqa: SLF001
        elif kind is _SUM:
            for item in node._elements:  # noqa: SLF001
                if isinstance(item, (int, float)):
                    offset += scale * float(item)
                else:
                    push((item, scale))
        elif kind is _PRODUCT:
            push((node._linear, node._scalar * scale))  # noqa: SLF001
        elif kind is _EXPRESSION:
            for var, coef in node._terms.items():  # noqa: SLF001
                terms[var] = terms.get(var, 0.0) + coef * scale
            offset += scale * node._offset  # noqa: SLF001
        elif isinstance(node, (int, float)):  # the whole expression is a number
            offset += scale * float(node)
        else:  # another node type (or not linear): MathOpt's own flattening of the whole (and its errors)
            flat = variables.LinearExpression(expr)
            return dict(flat.terms), flat.offset
    return terms, offset


def evaluate_linear(expr: Any, values_by_id: dict[int, float]) -> float:
    """`mathopt.evaluate_expression(expr, values)` for a linear expression (the same sum in the same
    order: offset, then the terms by variable id), on `flat_linear`. `values_by_id`: the solution's
    values keyed by variable id (`result.variable_values()` is keyed by other Variable objects than
    the model's, so every lookup there compares two variables through MathOpt's `==`)."""
    if isinstance(expr, (int, float)):
        return float(expr)
    terms, result = flat_linear(expr)
    for vid, coef in sorted((var.id, coef) for var, coef in terms.items()):
        result += coef * values_by_id[vid]
    return result


_VARIABLE, _TERM, _SUM = variables.Variable, variables.LinearTerm, variables.LinearSum
_PRODUCT, _EXPRESSION = variables.LinearProduct, variables.LinearExpression


@contextlib.contextmanager
def quiet_stdout():
    """HiGHS prints its banner on the process's stdout (fd 1), where the CLI's summary goes."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no real fd 1 (embedded): nothing to protect
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


__all__ = ["ONE_HIGHS_SOLVE", "MathOptSolver", "evaluate_linear", "flat_linear", "quiet_stdout"]
