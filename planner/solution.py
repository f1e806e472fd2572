"""What a solve produces: a placement solution turned into Decisions and a schedule, and the report.

`decisions_from_placement` turns the placement model's counts per chunk class into concrete chunks
(OS tier, optimizer tier, persistent PARAM, PARAM home); `build_schedule` materializes them;
`with_header_stats` writes the objective, bound and gap into the header. `planner.solve` and
`planner.exact` both end here.
"""

from __future__ import annotations

import dataclasses
import math

from planner.materialize import Decisions, EvictionRule, SolverStats, materialize, param_budget_bytes
from planner.errors import PlannerError
from planner.placement import PlacementInput, PlacementSolution
from planner.problem import Problem
from planner.policies import with_simulated_prediction  # one prediction: the simulator's (stages too)
from schemas._base import frozen
from schemas.schedule import ChunkLayout, ChunkPlan, Schedule, SolverStatus, Tier

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
    placement: PlacementSolution | None  # None: no placement MIP solved (several ranks, reference plans only)
    data: PlacementInput
    candidates: tuple[Candidate, ...]
    chunk_elements: int
    model_objective_seconds: float  # the chosen placement model's own objective (nan: a reference decision set)
    lower_bound_seconds: float
    physical_bound_seconds: float
    relaxation_bound_seconds: float
    solve_seconds: float  # wall clock (never written into the schedule)
    simulated_seconds: float = math.nan  # the chosen plan's replay in planner.simulate
    evaluated: tuple[tuple[str, float], ...] = ()  # (plan, simulated seconds) of every plan replayed
    chosen: str = ""  # which of them won
    mip_gap: float = math.nan  # the chosen placement MIP's own gap (to its restricted model's dual bound)
    worker_cpu_seconds: float = 0.0  # CPU seconds of the solve's replay workers (Note [replays ahead])

    @property
    def true_gap(self) -> float:
        """(simulated - valid lower bound) / simulated: the header's `gap`."""
        return self.schedule.header.gap


def with_header_stats(schedule: Schedule, objective: float | PlacementSolution, status: SolverStatus | float,
                      bound: float | None = None) -> Schedule:
    """Header: objective = the chosen plan's iteration time (planner.solve passes the simulator's
    replay of the schedule), its valid lower bound and the true gap (objective - bound) / objective,
    never clipped: a bound above the objective is a bug and fails here, naming both.

    Also called as with_header_stats(schedule, placement_solution, bound)."""
    if isinstance(objective, PlacementSolution):
        sol, bound = objective, float(status)  # type: ignore[arg-type]
        objective, status = sol.objective_seconds, sol.status
    assert bound is not None and isinstance(status, SolverStatus)
    bound = max(0.0, bound)
    if bound > objective * (1 + 1e-9):
        raise PlannerError(f"lower bound {bound:.6g} s above the plan's time {objective:.6g} s: the bound is not "
                           "valid for this plan; please report this trace and hardware")
    gap = max(0.0, (objective - bound) / objective) if objective > 0 else 0.0  # max: rounding only (see above)
    status = SolverStatus.OPTIMAL if gap <= 1e-3 else SolverStatus.FEASIBLE
    header = dataclasses.replace(schedule.header, solver_status=status, objective_seconds=objective,
                                 lower_bound_seconds=bound, gap=gap)
    return dataclasses.replace(schedule, header=header)


def padded_comm_groups(layout: ChunkLayout, world_size: int) -> set[int]:
    """Comm groups of `world_size` chunks holding trainable params in fewer than world_size - 1 of them."""
    if world_size <= 1:
        return set()
    trainable = {slot.chunk for slot in layout.tensors if slot.trainable}
    n_groups = len(layout.chunks) // world_size
    return {g for g in range(n_groups)
            if 0 < sum(c in trainable for c in range(g * world_size, (g + 1) * world_size)) < world_size - 1}


def decisions_from_placement(problem: Problem, layout: ChunkLayout, data: PlacementInput, sol: PlacementSolution, *,
                             notes: tuple[str, ...] = ()) -> Decisions:
    """planner.materialize.Decisions from a placement solution (counts -> concrete chunks)."""
    plans: dict[int, ChunkPlan] = {}
    persistent: set[int] = set()
    for g, counts, pers in zip(data.chunk_classes, sol.os_counts, sol.persistent):
        n_dev, n_host, n_stream = int(counts["DEVICE"]), int(counts["HOST"]), int(counts.get("STREAM", 0))
        n_nvme_stream = int(counts.get("NVME_STREAM", 0))
        n_pers = int(pers)
        for jc, chunk in enumerate(g.chunks):  # chunks of a chunk class are interchangeable: take them in order
            j = jc // g.comm_group_size  # the counts are of comm groups: a comm group's chunks share its plan
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
            elif j < n_dev + n_host + n_stream + n_nvme_stream:  # OS streamed from NVME for GPU Adam
                plans[chunk] = ChunkPlan(chunk=chunk, os_tier=Tier.NVME, optimizer_tier=Tier.DEVICE)
            else:
                plans[chunk] = ChunkPlan(chunk=chunk, os_tier=Tier.NVME, optimizer_tier=Tier.HOST)
    chunk_plans = tuple(plans[c.id] for c in layout.chunks)
    # PARAM homed on NVME: the chunk class's last chunks that leave DEVICE and step on the CPU (the model's
    # rows param_nvme + persistent + streamed <= count guarantee there are enough of them)
    home = {c.id: Tier.HOST for c in layout.chunks}
    for g, pers, n_nvme in zip(data.chunk_classes, sol.persistent, sol.param_nvme or (0.0,) * len(data.chunk_classes)):
        left = int(n_nvme)
        size = g.comm_group_size  # counts of comm groups (one chunk each with one rank)
        for j in reversed(range(len(g.chunks) // size)):
            if left <= 0:
                break
            group = g.chunks[j * size:(j + 1) * size]
            if j >= int(pers) and plans[group[0]].optimizer_tier is Tier.HOST:
                for chunk in group:
                    home[chunk] = Tier.NVME
                left -= 1
    param_home_tiers = tuple(home[c.id] for c in layout.chunks)
    # the chunks the model has on DEVICE and current when the iteration ends besides the persistent ones: kept or
    # arrived by the optimizer stage, less the kept ones it uploads again only in the next forward (materialize
    # fetches those there) (Note [PARAM kept across the iteration's end] in planner/device_cache.py): the class's
    # HOST-homed chunks with their OS off DEVICE besides its persistent ones (one rank: with several the kept
    # comm groups are gathered again after their owners' steps, which materialize does for persistent ones only)
    wrap_kept: set[int] = set()
    if problem.world_size == 1:
        late = sol.refreshed_in_forward or (0.0,) * len(data.chunk_classes)
        for g, pers, resident, later in zip(data.chunk_classes, sol.persistent, sol.resident, late):
            left = int(round(resident[data.optimizer_stage] - later)) - int(pers)
            # GPU-stepped (streamed OS) ones first: the model's stale_after_step row counts them first
            for chunk in sorted(g.chunks, key=lambda c: (plans[c].optimizer_tier is not Tier.DEVICE, c)):
                if left <= 0:
                    break
                if chunk not in persistent and plans[chunk].os_tier is not Tier.DEVICE and home[chunk] is Tier.HOST:
                    wrap_kept.add(chunk)
                    left -= 1
    # comm groups reduce-scattered per bucket: the class's first ones (Note [reduce-scatter per bucket])
    buckets: set[int] = set()
    for g, n_bucket in zip(data.chunk_classes, sol.rs_buckets or (0.0,) * len(data.chunk_classes)):
        size = g.comm_group_size
        for j in range(min(int(n_bucket), len(g.chunks) // size)):
            buckets.add(g.chunks[j * size] // size)
    # and the comm groups whose trainable chunks are fewer than p-1 among padding: reduced chunk by chunk they
    # move fewer bytes than a ring reduce-scatter over the padding (`emit.reduce_per_chunk_is_cheaper`)
    buckets |= padded_comm_groups(layout, problem.world_size)
    if all(t is Tier.HOST for t in param_home_tiers):
        param_home_tiers = ()
    modes = tuple(sol.activation_modes)
    # The budget is all the room the DEVICE leaves PARAM+GRAD at each moment under this plan's OS
    # tiers and activation modes. The plan's own PARAM+GRAD bytes per stage (the resident counts,
    # `sol.param_bytes_per_stage`) always fit in it; the extra room only lets materialize's
    # Belady eviction keep more and prefetch earlier (measured on the shipped 1.3B/12B/13B traces:
    # the same predicted time, 1-25% fewer H2D bytes than budgets cut to the resident counts).
    checkpoint_tier = Tier.HOST if getattr(sol, "checkpoint_offload", False) else None
    hint = moment_seconds(problem, sol)
    budget = param_budget_bytes(problem, layout, chunk_plans, modes, checkpoint_tier, offload_in_flight=True,
                                moment_seconds=hint)
    return Decisions(
        policy=POLICY, layout=layout, chunk_plans=chunk_plans, activation_modes=modes,
        param_device_budget_bytes=budget, persistent_chunks=frozenset(persistent), wrap_kept_chunks=frozenset(wrap_kept),
        optimizer_overlap=data.optimizer_overlap, prefetch=True, eviction=EvictionRule.BELADY_CLEAN_FIRST,
        notes=notes, checkpoint_tier=checkpoint_tier, param_home_tiers=param_home_tiers,
        moment_seconds_hint=hint, pace_optimizer_io=any(x > 0 for x in sol.stage_seconds), pace_on_replay=True,
        spill_idle_grads=True, reduce_scatter_buckets=frozenset(buckets), hold_write_backs=True,
        # several ranks: GPU steps in backward where the OS is on DEVICE (Note [DEVICE steps in backward])
        device_steps_in_backward=data.optimizer_overlap and problem.world_size > 1,
    )


def moment_seconds(problem: Problem, sol: PlacementSolution) -> tuple[float, ...]:
    """Each moment's share of its stage's placement time (in proportion to its compute; evenly when
    the stage computes nothing): the timeline materialize paces the overlapped CPU steps' SSD
    traffic by, the same one the placement's HOST rows assume."""
    out = [0.0] * len(problem.moments)
    for st, seconds in zip(problem.stages, sol.stage_seconds):
        ids = range(st.first_moment, st.last_moment + 1)
        compute = sum(problem.moments[m].compute_seconds for m in ids)
        for m in ids:
            share = problem.moments[m].compute_seconds / compute if compute > 0 else 1.0 / len(ids)
            out[m] = seconds * share
    return tuple(out)


def build_schedule(problem: Problem, layout: ChunkLayout, data: PlacementInput, sol: PlacementSolution, *,
                   notes: tuple[str, ...] = ()) -> Schedule:
    """The schedule of one placement solution (materialized, its solver stats in the header)."""
    decisions = decisions_from_placement(problem, layout, data, sol, notes=notes)
    stats = SolverStats(status=sol.status, objective_seconds=sol.objective_seconds,
                        lower_bound_seconds=sol.bound_seconds, gap=sol.gap)
    return materialize(problem, decisions, stats=stats)


__all__ = ["Candidate", "POLICY", "SolveReport", "build_schedule", "decisions_from_placement", "moment_seconds",
           "with_header_stats", "with_simulated_prediction"]
