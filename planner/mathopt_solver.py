"""The linear solver the placement model is built on: the few pywraplp-style calls it makes, on an
OR-Tools MathOpt model (HiGHS for the MIP; GLOP, or HiGHS's interior point method with crossover,
"HIGHS_IPM", for its relaxation), with HiGHS's banner kept off the CLI's stdout.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
from typing import Any

from ortools.math_opt.python import mathopt


class MathOptSolver:
    """The few calls the model makes, on an OR-Tools MathOpt model.

    MathOpt rather than pywraplp: through pywraplp a HiGHS MIP stopped by its time limit reports
    no solution at all, while MathOpt returns the incumbent and the proven bound."""

    _TYPES = {"HIGHS": mathopt.SolverType.HIGHS, "HIGHS_IPM": mathopt.SolverType.HIGHS, "GLOP": mathopt.SolverType.GLOP,
              "PDLP": mathopt.SolverType.PDLP}

    def __init__(self, name: str) -> None:
        self.name = name
        self.kind = self._TYPES[name]
        # Note [GLOP's primal simplex]: its dual simplex was 2x faster on the 256-block LP (1.99 s vs
        # 3.84 s CPU, bench/bench_depth.py), but with the shared host-DRAM and both-ways PCIe rows it
        # ran for over 12 minutes on gpt-small's LP (cpu-emulated, 0.05 GB), past its time limit, where
        # the primal simplex solves the whole problem in 0.5 s (measured 2026-11-23, this CI machine)
        self.model = mathopt.Model(name="placement")
        self._rows = 0

    @staticmethod
    def infinity() -> float:
        return math.inf

    def NumVar(self, lo: float, hi: float, name: str) -> Any:  # noqa: N802 (pywraplp's spelling)
        return self.model.add_variable(lb=lo, ub=hi, name=name)

    def IntVar(self, lo: float, hi: float, name: str) -> Any:  # noqa: N802
        return self.model.add_variable(lb=lo, ub=hi, is_integer=True, name=name)

    def BoolVar(self, name: str) -> Any:  # noqa: N802
        return self.model.add_binary_variable(name=name)

    def Add(self, bounded: Any, name: str = "") -> Any:  # noqa: N802
        self._rows += 1
        return self.model.add_linear_constraint(bounded, name=name)

    def Minimize(self, expr: Any) -> None:  # noqa: N802
        self.model.minimize(expr)

    def NumVariables(self) -> int:  # noqa: N802
        return sum(1 for _ in self.model.variables())

    def NumConstraints(self) -> int:  # noqa: N802
        return self._rows

    def solve(self, *, time_limit_seconds: float, relative_gap: float, node_limit: int | None = None) -> Any:
        """`node_limit` (HiGHS): stop after that many branch-and-bound nodes, so that the outcome does
        not depend on the machine's speed; the time limit is then only a safety net."""
        params = mathopt.SolveParameters(
            time_limit=datetime.timedelta(seconds=max(0.5, time_limit_seconds)),
            random_seed=0,  # deterministic (HiGHS runs its MIP search on one thread)
            enable_output=False,
        )
        if self.kind is mathopt.SolverType.HIGHS:
            params.relative_gap_tolerance = relative_gap
            if node_limit is not None:
                params.node_limit = node_limit
        if self.name == "HIGHS_IPM":
            # Note [the placement LP on HiGHS's interior point]: the chunk-size search's LP, on the
            # sparse DEVICE rows (placement.SparsePlacementModel), by HiGHS's IPX with crossover (a
            # vertex, as LP-integral fixing needs). Measured on the 512-block LP (hidden 4096,
            # a100-80g-12ssd, chunk 67257720; 22.6k columns, 27.3k rows; CPU seconds on the 2-core
            # CI box at load ~12, 2026-11-23): IPX 7.8 s, HiGHS dual simplex 17.8 s (31.7k pivots),
            # GLOP primal on the dense rows 37 s average over the 3 chunk sizes; at 128 blocks
            # 0.6-0.8 s for every one. GLOP also stops IMPRECISE on gpt-small's 66220-element LP
            # (cpu-emulated, 0.05 GB), which HiGHS solves.
            params.lp_algorithm = mathopt.LPAlgorithm.BARRIER
            # (MathOpt refuses `threads` for HiGHS; IPX and its crossover run serially: the same
            # bytes twice is checked by tests/test_solve.py and bench/bench_solve.py --twice)
        with quiet_stdout():
            result = mathopt.solve(self.model, self.kind, params=params)
            if self.kind is mathopt.SolverType.GLOP and result.termination.reason is mathopt.TerminationReason.IMPRECISE:
                # GLOP's primal simplex gave up on the numerics (gpt-small on cpu-emulated at 0.05 GB, once
                # CPU Adam was priced at the worker's 1 thread beside the both-ways PCIe row): the same LP
                # through HiGHS's simplex, deterministic too, reaches its optimum
                result = mathopt.solve(self.model, mathopt.SolverType.HIGHS, params=params)
            return result


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


__all__ = ["MathOptSolver", "quiet_stdout"]
