"""The placement model's answer: `PlacementSolution` (per chunk class, block and stage), the solver call
and the reading of its values back into bytes and seconds (a mixin of `planner.placement.PlacementModel`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from ortools.math_opt.python import mathopt

from schemas._base import frozen
from schemas.schedule import ActivationMode, SolverStatus
from planner.mathopt_solver import BOUND_ONLY, evaluate_linear
from planner.placement_terms import ACT_MODES, BYTE_UNIT, MIP_RELATIVE_GAP, SECONDARY_TERMS, SECONDARY_WEIGHT, TIME_UNIT


log = logging.getLogger(__name__)


@frozen
class PlacementSolution:
    """The solved placement, per chunk class / block / stage."""

    status: SolverStatus
    objective_seconds: float  # sum of stage times of this solution
    bound_seconds: float  # the solver's proven lower bound for this model
    relaxed: bool  # LP relaxation (fractional counts): a bound, not a plan
    resident: tuple[tuple[float, ...], ...]  # [chunk class][stage] PARAM chunks on DEVICE
    incoming: tuple[tuple[float, ...], ...]  # [chunk class][stage] PARAM chunks arriving during the stage
    persistent: tuple[float, ...]  # [chunk class] chunks that never leave DEVICE
    os_counts: tuple[dict[str, float], ...]  # [chunk class] chunks with OS on DEVICE / HOST / NVME
    activation_modes: tuple[ActivationMode, ...]  # [block] (argmax for a relaxation)
    checkpoint_offload: bool = False  # RECOMPUTE blocks' inputs wait on HOST (materialize's checkpoint_tier)
    stage_seconds: tuple[float, ...]
    device_bytes_per_stage: tuple[float, ...]
    host_bytes_per_stage: tuple[float, ...]
    param_bytes_per_stage: tuple[float, ...]  # PARAM + GRAD bytes on DEVICE (materialize's budget)
    nvme_bytes: float
    channel_bytes: dict[str, float]  # H2D, D2H, NVME_READ, NVME_WRITE per iteration
    solve_seconds: float  # wall clock (printed, never written into a schedule)
    solver: str
    param_nvme: tuple[float, ...] = ()  # [chunk class] PARAM chunks homed on NVME (materialize's param_home_tiers)
    rs_buckets: tuple[float, ...] = ()  # [chunk class] comm groups reduce-scattered per bucket (Decisions.reduce_scatter_buckets)
    # [chunk class] kept chunks uploaded again (`refresh`) in a stage of the next iteration's forward, not before it ends
    refreshed_in_forward: tuple[float, ...] = ()

    @property
    def gap(self) -> float:
        if self.objective_seconds <= 0:
            return 0.0
        return max(0.0, (self.objective_seconds - self.bound_seconds) / self.objective_seconds)


class PlacementInfeasible(Exception):
    """The model has no solution at the given capacities (explained by planner.bounds)."""


class PlacementAbove(Exception):
    """The relaxation's optimum is proven above the seconds it was solved against (`SolutionExtraction.solve`'s
    `above_seconds`), its value not computed (Note [an LP stopped above a bound] in planner/mathopt_solver.py)."""


class SolutionExtraction:
    """Solve the built model and read the solution out of it."""

    def solve(self, *, time_limit_seconds: float = 60.0, gap: float = MIP_RELATIVE_GAP,
              node_limit: int | None = None, above_seconds: float | None = None,
              lean_search: bool = False) -> PlacementSolution:
        """The solution; with `above_seconds` (a relaxation), PlacementAbove where its bound is proven above it;
        `lean_search`: `MathOptSolver.solve`'s (Note [a polish's work in nodes] in planner/mathopt_solver.py)."""
        start = time.perf_counter()
        # the bound in the model's objective (`bound_seconds` below, inverted)
        raw_above = (None if above_seconds is None else
                     above_seconds / TIME_UNIT * (1 + SECONDARY_TERMS * SECONDARY_WEIGHT))
        try:
            result = self.solver.solve(time_limit_seconds=time_limit_seconds, relative_gap=gap, node_limit=node_limit,
                                       objective_bound=raw_above, lean_search=lean_search)
        except Exception as exc:  # HiGHS reports numerical trouble as a status error (pybind11 StatusNotOk)
            raise PlacementInfeasible(f"{self.solver_name}: no solution within {time_limit_seconds:g} s "
                                      f"(solver error: {str(exc)[:200]})") from None
        seconds = time.perf_counter() - start
        reason = result.termination.reason
        log.info("placement %s (%s): %s, %d variables, %d constraints, %.2f s", self.solver_name,
                 "LP" if self.relax else "MIP", reason.name, self.solver.NumVariables(), self.solver.NumConstraints(), seconds)
        if reason in (mathopt.TerminationReason.INFEASIBLE, mathopt.TerminationReason.INFEASIBLE_OR_UNBOUNDED):
            raise PlacementInfeasible(f"{self.solver_name}: infeasible")
        if raw_above is not None and result.termination.limit is mathopt.Limit.OBJECTIVE:
            raise PlacementAbove(f"{self.solver_name}: its bound is above {above_seconds:g} s")
        if not result.has_primal_feasible_solution():
            raise PlacementInfeasible(f"{self.solver_name}: no solution within {time_limit_seconds:g} s ({reason.name})")
        self.values = result.variable_values()
        self._values_by_id = {var.id: x for var, x in self.values.items()}
        self.result = result
        return self._solution(reason is mathopt.TerminationReason.OPTIMAL, seconds)

    def _value(self, expr: Any) -> float:
        # mathopt.evaluate_expression's value, without its per-node flattening (planner.mathopt_solver)
        return float(evaluate_linear(expr, self._values_by_id))

    def _solution(self, optimal: bool, seconds: float) -> PlacementSolution:
        d, n = self.data, len(self.data.stages)
        t, b = TIME_UNIT, BYTE_UNIT
        objective = sum(self._value(v) for v in self.stage_time) * t  # sum T_s, without the tie-breaker
        # an LP stopped before its optimum (time or iteration limit) proves nothing: its bound is 0
        if self.relax:
            raw_bound = self.result.objective_value() if optimal else 0.0
            if optimal and self.solver_name == BOUND_ONLY:  # no vertex: the lesser of its primal and dual
                raw_bound = min(raw_bound, self.result.termination.objective_bounds.dual_bound)
        else:
            raw_bound = self.result.termination.objective_bounds.dual_bound
            raw_bound = raw_bound if math.isfinite(raw_bound) else 0.0
        if self.capacity is None:
            raw_bound /= 1 + SECONDARY_TERMS * SECONDARY_WEIGHT
        bound = min(max(raw_bound, 0.0) * t, objective)
        ours = SolverStatus.OPTIMAL if optimal else SolverStatus.FEASIBLE

        def val(v: Any) -> float:  # integral counts come back as 2.9999999: snap them
            x = self._value(v)
            return x if self.relax else float(round(x))

        resident, incoming, refreshed_in_forward = [], [], []
        for gi, g in enumerate(d.chunk_classes):
            late = 0.0  # refreshes in the wrap gap's stages after the optimizer stage: the next forward's
            for gap in self.gaps[gi]:
                if gap.wraps and self.refresh[gi] and d.optimizer_stage in gap.stages:
                    forward = gap.stages[gap.stages.index(d.optimizer_stage) + 1:]
                    late = sum(val(r) for s, r in zip(gap.lookahead, self.refresh[gi]) if s in forward)
            refreshed_in_forward.append(late)
            res = [0.0] * n
            inc = [0.0] * n
            for s in g.use_stages:
                res[s] = float(g.count)
            if not self.gaps[gi]:
                res = [val(self.persistent[gi])] * n
            for i, gap in enumerate(self.gaps[gi]):
                keep = val(self.keep[gi][i])
                arrived = 0.0
                look = dict(zip(gap.lookahead, self.incoming[gi][i]))
                for s in gap.stages:
                    if s in look:
                        inc[s] += val(look[s])
                        arrived += val(look[s])
                    res[s] = keep + arrived
            resident.append(tuple(res))
            incoming.append(tuple(inc))
        modes = []
        for choice in self.act:
            modes.append(max(ACT_MODES, key=lambda m: (self._value(choice[m]), -ACT_MODES.index(m))))
        channel_bytes = {k: b * sum(self._value(e) for e in self.channels[k]) for k in ("H2D", "D2H", "NVME_READ", "NVME_WRITE")}
        channel_bytes["NVME_READ"] += b * sum(self._value(e) for e in self.channels["OS_READ"])
        channel_bytes["NVME_WRITE"] += b * sum(self._value(e) for e in self.channels["OS_WRITE"])
        return PlacementSolution(
            status=ours,
            objective_seconds=float(objective),
            bound_seconds=float(bound),
            relaxed=self.relax,
            resident=tuple(resident),
            incoming=tuple(incoming),
            persistent=tuple(val(v) for v in self.persistent),
            param_nvme=tuple(val(v) for v in self.param_nvme),
            refreshed_in_forward=tuple(refreshed_in_forward),
            rs_buckets=tuple(self._value(v) if self.relax else float(math.ceil(self._value(v) - 1e-6)) for v in self.rs_bucket),
            os_counts=tuple({"DEVICE": val(a), "HOST": val(h), "NVME": val(c), "STREAM": val(x), "NVME_STREAM": val(y)}
                            for a, h, c, x, y in zip(self.os_device, self.os_host, self.os_nvme, self.os_stream,
                                                     self.os_nvme_stream)),
            activation_modes=tuple(modes),
            checkpoint_offload=bool(round(self._value(self.ckpt))) if not self.relax else self._value(self.ckpt) > 0.5,
            stage_seconds=tuple(self._value(v) * t for v in self.stage_time),
            device_bytes_per_stage=tuple(self._value(self._device_expr(s)) * b for s in range(n)),
            host_bytes_per_stage=tuple(self._value(self._host_expr(s)) * b for s in range(n)),
            param_bytes_per_stage=tuple(self._value(self._param_expr(s)) * b for s in range(n)),
            nvme_bytes=self._value(self._nvme_expr()) * b,
            channel_bytes=channel_bytes,
            solve_seconds=seconds,
            solver=f"{self.solver_name} {'LP' if self.relax else 'MIP'}",
        )

    def capacity_value(self) -> float:
        assert self.capacity is not None
        return self._value(self.capacity) * BYTE_UNIT


__all__ = ["PlacementAbove", "PlacementInfeasible", "PlacementSolution", "SolutionExtraction"]
