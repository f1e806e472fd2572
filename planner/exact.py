"""`--exact`: one CP-SAT model over the whole problem, one boolean per chunk and stage (DESIGN.md §4.4).

For small traces (2-4 blocks) this is the optimum the default planner is measured against: the
same cost model as `planner.placement`, but without its decomposition and restrictions — no
aggregation of chunks into counts, a chunk may arrive in *any* stage before its use (the
placement model looks LOOKAHEAD_STAGES back), and every candidate chunk size is solved to
optimality rather than pruned by LP values.

Integers only: Note [exact integer scaling] in `ExactModel._choose_time_unit`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from ortools.sat.python import cp_model

from planner.bounds import explain_infeasible, lower_bound
from planner.errors import PlannerError
from planner.layout import build_layout, candidate_chunk_sizes, wasted_elements
from planner.placement import (
    ACT_MODES,
    PlacementInfeasible,
    PlacementInput,
    PlacementSolution,
    act_windows,
    chunk_class_gaps,
    placement_input,
)
from planner.problem import Problem
from planner.simulate import simulate
from planner.solution import Candidate, SolveReport, build_schedule, with_header_stats, with_simulated_prediction
from schemas.schedule import ActivationMode, ChunkLayout, SolverStatus

MAX_EXACT_CHUNKS = 400  # beyond this the per-chunk model is not "small": use the default planner
EXACT_LOOKAHEAD = 10**6  # any stage of a gap


def split_chunk_classes(data: PlacementInput) -> PlacementInput:
    """The same input with one chunk class per chunk (per-chunk decisions)."""
    classes = []
    for g in data.chunk_classes:
        for c in g.chunks:
            classes.append(dataclasses.replace(g, id=len(classes), chunks=(c,)))
    return dataclasses.replace(data, chunk_classes=tuple(classes))


class ExactModel:
    """CP-SAT over every chunk (count 1 per chunk class): booleans resident / arriving / refreshed per
    stage, OS tier and persistence per chunk, activation mode per block, integer stage times."""

    def __init__(self, data: PlacementInput) -> None:
        self.data = data
        self.model = cp_model.CpModel()
        self.n = len(data.stages)
        self._choose_time_unit()
        self._add_variables()
        self._add_memory_constraints()
        self._add_time_constraints()
        self._add_objective()

    # -- scaling -------------------------------------------------------------------------
    # Note [exact integer scaling]:
    # Integer scaling (CP-SAT has no continuous variables): bytes stay bytes; time is counted in units
    # small enough that the cheapest nonzero item costs >= 100 units, each item's duration rounded up.
    def _choose_time_unit(self) -> None:
        d = self.data
        items = [st.compute_seconds for st in d.stages]
        for g in d.chunk_classes:
            items += [g.param_bytes / d.h2d_bytes_per_s, g.param_bytes / d.d2h_bytes_per_s,
                      g.elements * d.cpu_adam_seconds_per_element, g.elements * d.gpu_adam_seconds_per_element]
            if d.has_nvme:
                items.append(g.os_bytes / d.nvme_write_bytes_per_s)
        for b in d.blocks:
            items += [b.recompute_seconds, b.activation_bytes / d.h2d_bytes_per_s]
        positive = [x for x in items if x > 0]
        total = sum(positive) * 4 + 1e-12
        unit = min(positive) / 100 if positive else 1e-6
        self.unit = max(unit, total / 1e12)  # keep every sum far below 2^63

    def _t(self, seconds: float) -> int:
        return int(math.ceil(seconds / self.unit - 1e-9)) if seconds > 0 else 0

    # -- variables -----------------------------------------------------------------------
    def _add_variables(self) -> None:
        d, n, m = self.data, self.n, self.model
        # seconds per SSD byte: the slowest coefficient of the SSDs' time rows (a host cap's row may be
        # slower than writing alone)
        ssd = max(1.0 / max(d.nvme_write_bytes_per_s, 1.0), *(max(a, b) for a, b in d.nvme_rows()))
        horizon = self._t(sum(st.compute_seconds for st in d.stages)) * 10 + self._t(
            sum(g.param_bytes * 4 / d.h2d_bytes_per_s + g.os_bytes * 4 * ssd
                + g.elements * d.cpu_adam_seconds_per_element for g in d.chunk_classes)
            + sum(b.activation_bytes * 4 / d.h2d_bytes_per_s + b.recompute_seconds for b in d.blocks)) + 10
        self.horizon = horizon
        self.stage_time = [m.NewIntVar(0, horizon, f"stage_time[{s}]") for s in range(n)]
        self.res, self.arr, self.refresh = [], [], []
        self.pers, self.od, self.oh, self.on = [], [], [], []
        self.gaps = []
        for g in d.chunk_classes:
            gaps = chunk_class_gaps(g, n, d.optimizer_stage, d.optimizer_overlap, EXACT_LOOKAHEAD)
            self.gaps.append(gaps)
            res = [m.NewBoolVar(f"resident[{g.id},{s}]") for s in range(n)]
            arr = [m.NewBoolVar(f"arrive[{g.id},{s}]") for s in range(n)]
            ref = [m.NewBoolVar(f"refresh[{g.id},{s}]") for s in range(n)]
            pers = m.NewBoolVar(f"persistent[{g.id}]")
            od, oh, on = (m.NewBoolVar(f"os_{t}[{g.id}]") for t in ("device", "host", "nvme"))
            m.Add(od + oh + on == (1 if g.trainable else 0))
            if not d.has_nvme:
                m.Add(on == 0)
            m.Add(pers >= od)
            uses = set(g.use_stages)
            allowed_arrival: set[int] = set()
            wrap_window: set[int] = set()
            for gap in gaps:
                allowed_arrival |= set(gap.lookahead)
                if gap.wraps:
                    wrap_window = set(gap.lookahead)
            for s in range(n):
                m.Add(res[s] >= pers)
                if s in uses:
                    m.Add(res[s] == 1)
                nxt = (s + 1) % n
                # on DEVICE in s+1 only if it was in s or arrived during s
                m.Add(res[nxt] <= res[s] + arr[s])
                if s not in allowed_arrival:
                    m.Add(arr[s] == 0)
                if s not in wrap_window or not g.trainable:
                    m.Add(ref[s] == 0)
                m.Add(arr[s] + res[s] <= 1)  # an arriving chunk is not resident yet
            if g.trainable and gaps and wrap_window:
                # CPU-stepped chunks come back updated before the first forward use
                m.Add(sum(arr[s] + ref[s] for s in wrap_window) >= 1 - od)
            self.res.append(res)
            self.arr.append(arr)
            self.refresh.append(ref)
            self.pers.append(pers)
            self.od.append(od)
            self.oh.append(oh)
            self.on.append(on)
        self.act = []
        for b in d.blocks:
            choice = {mode: m.NewBoolVar(f"act[{b.id},{mode.value}]") for mode in ACT_MODES}
            m.AddExactlyOne(choice.values())
            if not d.has_nvme:
                m.Add(choice[ActivationMode.SWAP_NVME] == 0)
            if b.forward_stage < 0 or b.backward_stage < 0:
                for mode in ACT_MODES[1:]:
                    m.Add(choice[mode] == 0)
            self.act.append(choice)
        self.any_nvme_os = m.NewBoolVar("any_nvme_os")
        for on in self.on:
            m.Add(on <= self.any_nvme_os)

    # -- memory --------------------------------------------------------------------------
    def _param_terms(self, s: int) -> list[Any]:
        d = self.data
        terms: list[Any] = []
        for gi, g in enumerate(d.chunk_classes):
            terms.append((self.res[gi][s] + self.arr[gi][s]) * g.param_bytes)
            if g.trainable and g.first_backward_stage >= 0:
                if g.first_backward_stage <= s <= g.last_backward_stage:
                    terms.append(g.param_bytes)
                elif s > g.last_backward_stage:
                    terms.append(self.od[gi] * g.param_bytes)
        return terms

    def _device_terms(self, s: int) -> list[Any]:
        d = self.data
        terms = [int(d.stages[s].non_model_bytes)] + self._param_terms(s)
        for gi, g in enumerate(d.chunk_classes):
            terms.append(self.od[gi] * g.os_bytes)
        for b, choice in zip(d.blocks, self.act):
            if b.forward_stage < 0 or b.backward_stage < 0:
                continue
            recompute, swap, _, _ = act_windows(b, self.n)
            if s in recompute:
                terms.append(-(b.activation_bytes - b.input_bytes) * choice[ActivationMode.RECOMPUTE])
            if s in swap:
                terms.append(-b.activation_bytes * (choice[ActivationMode.SWAP_HOST] + choice[ActivationMode.SWAP_NVME]))
        return terms

    def _host_terms(self, s: int) -> list[Any]:
        d = self.data
        terms: list[Any] = []
        trainable = [g for g in d.chunk_classes if g.trainable and g.first_backward_stage >= 0]
        for gi, g in enumerate(d.chunk_classes):
            terms.append((1 - self.od[gi]) * g.param_bytes + self.oh[gi] * g.os_bytes)
            if g.trainable and g.first_backward_stage >= 0:
                last = g.last_backward_stage if d.optimizer_overlap else self.n - 1
                if g.last_backward_stage <= s <= last:
                    terms.append((1 - self.od[gi]) * g.param_bytes)
                if d.optimizer_overlap and g.first_backward_stage <= s <= g.last_backward_stage:
                    terms.append(self.on[gi] * g.os_bytes)
        stepped = [g for g in d.chunk_classes if g.trainable]
        if d.has_nvme and stepped:  # as planner.placement: one more chunk of NVME OS staged on HOST
            staged = max(g.os_bytes for g in stepped) * self.any_nvme_os
            if d.optimizer_overlap and trainable:
                if min(g.first_backward_stage for g in trainable) <= s <= max(g.last_backward_stage for g in trainable):
                    terms.append(staged)
            elif s == d.optimizer_stage:
                terms.append(staged)
        for b, choice in zip(d.blocks, self.act):
            if b.forward_stage < 0 or b.backward_stage < 0:
                continue
            _, _, offload, reload = act_windows(b, self.n)
            if offload <= s <= reload:
                terms.append(b.activation_bytes * choice[ActivationMode.SWAP_HOST])
        return terms

    def _add_memory_constraints(self) -> None:
        d, m = self.data, self.model
        for s in range(self.n):
            m.Add(sum(self._device_terms(s)) <= int(d.device_bytes))
            m.Add(sum(self._host_terms(s)) <= int(d.host_bytes))
        nvme = [self.on[gi] * g.os_bytes for gi, g in enumerate(d.chunk_classes)]
        nvme += [b.activation_bytes * c[ActivationMode.SWAP_NVME] for b, c in zip(d.blocks, self.act)]
        m.Add(sum(nvme) <= int(d.nvme_bytes))

    # -- time ----------------------------------------------------------------------------
    def _add_time_constraints(self) -> None:
        d, m, n = self.data, self.model, self.n
        h2d: list[list[Any]] = [[] for _ in range(n)]
        d2h: list[list[Any]] = [[] for _ in range(n)]
        # SSD bytes per stage, read and written apart, as (boolean, bytes): priced by the same two-way
        # rows as the placement MIP (costmodel.nvme_time_rows via PlacementInput.nvme_rows: simplex,
        # or the mixed rates and the host cap where measured): t >= a*R + b*W for each row (a, b)
        nvme_r: list[list[tuple[Any, float]]] = [[] for _ in range(n)]
        nvme_w: list[list[tuple[Any, float]]] = [[] for _ in range(n)]
        compute: list[list[Any]] = [[self._t(st.compute_seconds)] for st in d.stages]
        cpu_rel: list[list[Any]] = [[] for _ in range(n)]
        os_r: list[list[tuple[Any, float]]] = [[] for _ in range(n)]  # the CPU steps' OS traffic, by release stage
        os_w: list[list[tuple[Any, float]]] = [[] for _ in range(n)]
        rows = d.nvme_rows()

        def ssd(reads: list[tuple[Any, float]], writes: list[tuple[Any, float]], a: float, b: float) -> list[Any]:
            return [x * self._t(nbytes * a) for x, nbytes in reads] + [x * self._t(nbytes * b) for x, nbytes in writes]
        for gi, g in enumerate(d.chunk_classes):
            up = self._t(g.param_bytes / d.h2d_bytes_per_s)
            for s in range(n):
                h2d[s].append((self.arr[gi][s] + self.refresh[gi][s]) * up)
            if not g.trainable:
                continue
            release = g.last_backward_stage if (d.optimizer_overlap and g.last_backward_stage >= 0) else d.optimizer_stage
            grads_at = g.last_backward_stage if g.last_backward_stage >= 0 else d.optimizer_stage
            d2h[grads_at].append((1 - self.od[gi]) * self._t(g.param_bytes / d.d2h_bytes_per_s))
            cpu_rel[release].append((1 - self.od[gi]) * self._t(g.elements * d.cpu_adam_seconds_per_element))
            os_r[release].append((self.on[gi], g.os_bytes))
            os_w[release].append((self.on[gi], g.os_bytes))
            compute[d.optimizer_stage].append(self.od[gi] * self._t(g.elements * d.gpu_adam_seconds_per_element))
        for b, choice in zip(d.blocks, self.act):
            if b.forward_stage < 0 or b.backward_stage < 0:
                continue
            _, _, offload, reload = act_windows(b, n)
            swapped = choice[ActivationMode.SWAP_HOST] + choice[ActivationMode.SWAP_NVME]
            d2h[offload].append(swapped * self._t(b.activation_bytes / d.d2h_bytes_per_s))
            h2d[reload].append(swapped * self._t(b.activation_bytes / d.h2d_bytes_per_s))
            nvme_w[offload].append((choice[ActivationMode.SWAP_NVME], b.activation_bytes))
            nvme_r[reload].append((choice[ActivationMode.SWAP_NVME], b.activation_bytes))
            compute[b.backward_stage].append(choice[ActivationMode.RECOMPUTE] * self._t(b.recompute_seconds))
        for s in range(n):
            t = self.stage_time[s]
            for terms in (compute[s], h2d[s], d2h[s]):
                m.Add(t >= sum(terms))
            for a, b in rows:
                if nvme_r[s] or nvme_w[s]:
                    m.Add(t >= sum(ssd(nvme_r[s], nvme_w[s], a, b)))
        # the CPU optimizer and its SSD traffic: every suffix long enough for what it releases
        for s in range(n):
            suffix = sum(self.stage_time[s:])
            cpu = [x for r in range(s, n) for x in cpu_rel[r]]
            if cpu:
                m.Add(suffix >= sum(cpu))
            reads = [x for r in range(s, n) for x in os_r[r] + nvme_r[r]]
            writes = [x for r in range(s, n) for x in os_w[r] + nvme_w[r]]
            if reads or writes:
                for a, b in rows:
                    m.Add(suffix >= sum(ssd(reads, writes, a, b)))
        if not d.optimizer_overlap:
            o = d.optimizer_stage
            m.Add(self.stage_time[o] >= sum(cpu_rel[o]))
            if os_r[o] or os_w[o] or nvme_r[o] or nvme_w[o]:
                for a, b in rows:
                    m.Add(self.stage_time[o] >= sum(ssd(os_r[o] + nvme_r[o], os_w[o] + nvme_w[o], a, b)))

    def _add_objective(self) -> None:
        self.model.Minimize(sum(self.stage_time))

    # -- solve ---------------------------------------------------------------------------
    def solve(self, *, time_limit_seconds: float = 60.0) -> PlacementSolution:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.5, time_limit_seconds)
        solver.parameters.num_workers = 1  # deterministic
        solver.parameters.random_seed = 0
        start = time.perf_counter()
        status = solver.Solve(self.model)
        seconds = time.perf_counter() - start
        if status == cp_model.INFEASIBLE:
            raise PlacementInfeasible("CP-SAT: infeasible")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise PlacementInfeasible(f"CP-SAT: no solution within {time_limit_seconds:g} s")
        return self._solution(solver, status, seconds)

    def _solution(self, solver: cp_model.CpSolver, status: int, seconds: float) -> PlacementSolution:
        d, n, u = self.data, self.n, self.unit

        def v(x: Any) -> float:
            return float(solver.Value(x))

        resident = tuple(tuple(v(r) + v(a) for r, a in zip(res, arr)) for res, arr in zip(self.res, self.arr))
        incoming = tuple(tuple(v(a) + v(f) for a, f in zip(arr, ref)) for arr, ref in zip(self.arr, self.refresh))
        modes = tuple(next(mode for mode in ACT_MODES if solver.Value(c[mode])) for c in self.act)
        param_bytes = tuple(float(sum(solver.Value(t) if not isinstance(t, int) else t for t in self._param_terms(s)))
                            for s in range(n))
        device = tuple(float(sum(solver.Value(t) if not isinstance(t, int) else t for t in self._device_terms(s)))
                       for s in range(n))
        host = tuple(float(sum(solver.Value(t) if not isinstance(t, (int, float)) else t for t in self._host_terms(s)))
                     for s in range(n))
        objective = solver.ObjectiveValue() * u
        bound = min(solver.BestObjectiveBound() * u, objective)
        return PlacementSolution(
            status=SolverStatus.OPTIMAL if status == cp_model.OPTIMAL else SolverStatus.FEASIBLE,
            objective_seconds=objective, bound_seconds=max(bound, 0.0), relaxed=False,
            resident=resident, incoming=incoming,
            persistent=tuple(v(p) for p in self.pers),
            os_counts=tuple({"DEVICE": v(a), "HOST": v(b), "NVME": v(c)} for a, b, c in zip(self.od, self.oh, self.on)),
            activation_modes=modes,
            stage_seconds=tuple(v(t) * u for t in self.stage_time),
            device_bytes_per_stage=device, host_bytes_per_stage=host, param_bytes_per_stage=param_bytes,
            nvme_bytes=float(sum(v(on) * g.os_bytes for on, g in zip(self.on, d.chunk_classes))),
            channel_bytes={}, solve_seconds=seconds, solver="CP-SAT exact",
        )


def solve_exact(data: PlacementInput, *, time_limit_seconds: float = 60.0) -> PlacementSolution:
    """The per-chunk CP-SAT optimum of one layout's placement (raises PlacementInfeasible)."""
    split = split_chunk_classes(data)
    if len(split.chunk_classes) > MAX_EXACT_CHUNKS:
        raise PlannerError(f"--exact is for small traces: this layout has {len(split.chunk_classes)} chunks "
                           f"(at most {MAX_EXACT_CHUNKS}); drop --exact to use the default planner")
    return ExactModel(split).solve(time_limit_seconds=time_limit_seconds)


def solve_exact_report(problem: Problem, *, optimizer_overlap: bool, time_limit_s: float, started: float,
                       progress: Callable[[str], None]) -> SolveReport:
    """`solve --exact`: every candidate chunk size solved by CP-SAT; the best becomes the schedule."""
    sizes = candidate_chunk_sizes(problem)
    results: dict[int, tuple[ChunkLayout, PlacementInput, PlacementSolution]] = {}
    candidates = []
    deadline = started + time_limit_s
    for i, size in enumerate(sizes):
        progress(f"chunk size {size}: exact CP-SAT")
        layout = build_layout(problem, chunk_elements=size)
        data = placement_input(problem, layout, optimizer_overlap=optimizer_overlap)
        split = split_chunk_classes(data)
        left = (deadline - time.perf_counter()) / max(1, len(sizes) - i)
        try:
            sol = solve_exact(data, time_limit_seconds=max(1.0, left))
            results[size] = (layout, split, sol)
            value = sol.objective_seconds
        except PlacementInfeasible:
            value = math.inf
        candidates.append(Candidate(chunk_elements=size, relaxation_seconds=value,
                                    wasted_elements=wasted_elements(layout), chunks=len(layout.chunks)))
    if not results:
        layout = build_layout(problem, chunk_elements=min(sizes))
        raise explain_infeasible(placement_input(problem, layout, optimizer_overlap=optimizer_overlap),
                                 what=f"{problem.trace.meta.model_name} on {problem.hardware.name}")
    best = min(results, key=lambda s: (results[s][2].objective_seconds, s))
    layout, split, sol = results[best]
    bound = min(r[2].bound_seconds for r in results.values())
    physical = lower_bound(problem).seconds  # valid for any schedule tide's materializer emits
    notes = (f"exact: CP-SAT over every chunk for chunk sizes {', '.join(str(s) for s in sizes)}; "
             f"chunk size {best} is optimal at {sol.objective_seconds:.6g} s",)
    schedule = build_schedule(problem, layout, split, sol, notes=notes)
    # one prediction and an honest bound, as planner.solve: the header's time is the simulator's, and
    # the model's bound counts only where it is not above that replay
    replay = simulate(schedule, problem.hardware)
    schedule = with_simulated_prediction(schedule, replay)
    model_bound = bound if bound <= replay.iteration_seconds else 0.0
    schedule = with_header_stats(schedule, replay.iteration_seconds, sol.status, max(model_bound, physical))
    return SolveReport(schedule=schedule, placement=sol, data=split, candidates=tuple(candidates), chunk_elements=best,
                       model_objective_seconds=sol.objective_seconds, lower_bound_seconds=schedule.header.lower_bound_seconds,
                       physical_bound_seconds=physical, relaxation_bound_seconds=bound,
                       solve_seconds=time.perf_counter() - started, simulated_seconds=replay.iteration_seconds,
                       mip_gap=sol.gap)


__all__ = ["ExactModel", "MAX_EXACT_CHUNKS", "solve_exact", "solve_exact_report", "split_chunk_classes"]

