"""The planner's solve: a trace and a hardware profile in, a schedule out (DESIGN.md §4); its command
line is `planner.solve_cli`.

Placement LP per chunk size, the placement MIP for the promising ones, each plan materialized and
replayed in the simulator beside the reference decision sets (`planner.reference`); the fastest
replay is the schedule. The steps are in Note [solve steps] and the same-bytes guarantee in
Note [solve determinism], both above `solve_report`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from planner.policies import policy_layout
from planner.policies.patrickstar import patrickstar_layout
from planner.bounds import decisions_bound, explain_infeasible, lower_bound
from planner.costmodel import cpu_adam_beside_copies, cpu_adam_threads, optimizer_step_price
from planner.errors import InfeasibleError, PlannerError
from planner.exact import solve_exact_report
from planner.policies.angel import decide as angel_decide
from planner.reference import os_margin_decisions, reference_decisions
from planner.layout import build_layout, candidate_chunk_sizes, wasted_elements
from planner.mathopt_solver import BOUND_ONLY
from planner.materialize import Decisions, SolverStats, drop_ahead, materialize, materialize_replayed, replay_ahead
from planner.placement import (
    MIP_RELATIVE_GAP,
    PlacementAbove,
    PlacementInfeasible,
    PlacementInput,
    PlacementModel,
    PlacementSolution,
    SparsePlacementModel,
    minimal_capacity,
    placement_input,
    root_bound_seconds,
)
from planner.problem import build_problem
from planner import replays
from planner.replays import replay_memo
from planner.sim_result import SimResult
from planner.simulate import ScheduleViolation
from planner.solution import (
    POLICY,
    Candidate,
    SolveReport,
    build_schedule,
    decisions_from_placement,
    with_header_stats,
    with_simulated_prediction,
)
from schemas._base import frozen
from schemas.hardware import Hardware
from schemas.schedule import Channel, ChunkLayout, Schedule, SolverStatus, Tier
from schemas.trace import Trace

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIME_LIMIT_SECONDS = 60.0
TIE_TOLERANCE = 1e-3  # candidates within 0.1% of the best predicted time count as a tie
MIN_MIPS = 2  # chunk sizes whose placement MIP is solved (and simulated) at least
FLAG_EPSILON = 1e-6  # an LP value above this pins a mechanism switch on
REPLAN_ATTEMPTS = 2  # placements with HOST cut by a paced schedule's shortfall
# from this many blocks on, the MIP keeps the LP's activation mode per block (its argmax): 175B (96
# blocks) 23 -> 3 s CPU for a model objective 1% higher. Not at 40: GPT-3 13B x rtx4090-768g-12ssd,
# chunk 105084630, the pinned modes' fixed MIP 8.336 s (model) against 7.742 s with the modes free
# (LP-integral fixing frees only the fractional ones), 0.3-0.6 s CPU either way (bench/RESULTS.md "t13").
# 48 keeps the pin on every trace of 60 blocks or more (PatrickStar's 12B and 4B) as measured before
PIN_MODES_BLOCKS = 48
# a polish with free modes (the dense pinned-switch MIP) only below this many blocks, one rank:
# GPT-3 13B x a100-80g-12ssd (40 blocks), chunk 105084630, it took 11-13 s CPU (loaded box) for the
# fixed plan's model objective (5.6774 s); 175B x a100: Note in `_solve_mip` (bench/RESULTS.md "t13", "p18")
FREE_MODE_POLISH_MAX_BLOCKS = 32
# below this many blocks a MIP plan is also replayed with the whole DEVICE as its budget, not only its own
# (Note [the plan's own budget]), the simulator judging. The 3-block toy of tests/test_solve.py (rtx4090-768g-12ssd)
# replays its fastest MIP plan in 0.5703 ms with the whole DEVICE's budget, 0.6199 ms at best with its own. Since
# wb17's held write-backs (Note [write-backs in flight] in planner/device_cache.py) neither budget wins everywhere
# (session 7, quiet box, bench/RESULTS.md "Session 7"; own -> whole): GPT-3 13B (40 blocks) x rtx4090-768g-12ssd
# 8.646 -> 8.544 s, x a100-80g-12ssd 6.221 -> 6.150 s; GPT-3 175B (96 blocks) x a100-80g-12ssd chunk 1812099072
# 116.877 -> 113.804 s but chunk 605212776 118.051 -> 120.159 s; both cost 175B 9.5 CPU s in all. Not from 128
# blocks on, where the replays of a deep trace are what its CPU target (issue 18: 512 blocks in 60 s) cannot pay
# twice, and where lp17 measured the own budget faster (256 blocks x 4096 on a100-80g-12ssd 36.13 -> 32.27 s)
BOTH_BUDGETS_MAX_BLOCKS = 128
# below this many blocks (one rank) the REPLAYED_AGAIN fastest MIP plans are replayed once more each with
# `Decisions.tail_prefetches_first` (Note [a tail's prefetches before its write-backs] in planner/emit.py; GPT-3
# 175B, 96 blocks: ~0.7 CPU s each), and then the fastest ones once more with their optimizer chains balanced where
# they end whole steps apart (Note [the optimizer's two chains]; 175B x a100-80g-12ssd: ~0.2 CPU s); not deeper,
# where 512 blocks x 4096 is at its 60 CPU s target (issue 18) without them
REPLAY_AGAIN_MAX_BLOCKS = 128
# Note [one base for the variants]:
# Each variant above changes the emission of a replayed plan, and which plan it improves most is the simulator's
# to say: the fastest replay is not always the best base. Session 14 measured a second base paying on GPT-3 175B x
# rtx4090-768g-12ssd (its second fastest MIP replay, "paced, full budget", 128.351 s, gave 121.372 and 119.644 s
# against the fastest's 122.344 and 120.439 s), so from then on the two fastest were varied. Since sessions 15-23's
# emissions (the re-pace on the replay's clock, the chains balanced twice) the fastest base wins everywhere measured,
# and the second base's two replays (one variant each) were ~2 of 175B's ~16 CPU s: re-measured in session 25
# (bench/RESULTS.md "Session 25"), one base replays the same chosen plan and bound on every case we run: the six
# goldens (only their notes' runner-up lists change), bench_solve's GPT-3 13B and 175B pairs (175B x rtx4090:
# 118.467 s from the fastest base, the second base's variants 129.10 and 122.33 s; x a100: 112.125 s, the second's
# 116.02 and 113.64 s), the depth ladder's 32-96 blocks, the rank ladder's one-rank rung and bench/published.py
# (the same 32 rows). With one base 175B solved in 8.15 and 8.56 wall s (rtx4090, a100; bench_solve, Python
# reference 0.861 CPU s) where session 24 measured 11.33 and 12.75 s (0.742): issue 18 asks 10 s.
REPLAYED_AGAIN = 1
# the steps at the end of a chain whose mean spacing estimates one more (or one fewer) step's seconds
CHAIN_STEPS_MEASURED = 10
FIX_TOLERANCE = 1e-6  # an LP value this close to an integer is fixed there (LP-integral fixing, _solve_mip)
RELEASE_STAGES = 6  # second try: chunk classes used within this many stages of a fractional variable are freed
# HiGHS nodes per placement MIP: the fixed MIPs close in 1-5 nodes (bench/bench_depth.py, 32-512
# blocks, hidden 4096); the limit makes a hard case stop at the same incumbent on any machine
MIP_NODE_LIMIT = 500
# the pinned (unfixed) MIP that polishes a fixed plan more than 1% above the LP: GPT-3 13B closes in
# a few nodes; 64 blocks x 4096 branched 749 nodes before its time limit (bench_depth.py), so cut there
POLISH_NODE_LIMIT = 100
# no polish from this depth on: at 256 blocks x 4096 (a100-80g-12ssd) the polishing MIPs took 7.4 and
# 10.7 s CPU of a 44 s solve for no better plan (bench/bench_depth.py), and under load the second
# reached its safety-net time limit, which would let the machine's speed decide the plan
POLISH_MAX_BLOCKS = 128
# the root node's bound is computed where the LP and physical bounds are further than this below the
# best model objective (32 blocks x 4096: LP 8.9% below, root 2.9%, bench/bench_depth.py; 175B on
# a100-80g-12ssd: LP 4.0% below, the root 24.6 s wall for no gain, so not there), and again after the
# replays where they are further than this below the fastest replay (issue 17's 5% true-gap target):
# GPT-3 13B x a100-80g-12ssd, LP 4.4% below the MIP but 6.1% below its replay, the roots (1.4-2.8 s
# CPU each) raise the bound 5.429 -> 5.587 s, true gap 3.35% (bench/RESULTS.md "t13"); at 3% below
# the model objective instead, 175B x a100 computed a second root, 9.5 -> 21.2 s CPU
ROOT_BOUND_GAP = 0.05
# ... the second pass (against the fastest replay) only below this many blocks: since sim17's simulator
# (evicted bytes held until their copies land, Note [simulator evictions]) every deep trace replays more
# than 5% above its LP, and the root nodes of 96-256 blocks cost 20-80 CPU s for a bound the LP nearly
# gives (bench_solve, 2026-11-24 08:05 UTC: 256 blocks 104 CPU s with it; 13B, 40 blocks, is where t13
# measured it paying off)
ROOT_AFTER_REPLAY_MAX_BLOCKS = 64
# Note [the proven bound up to 128 blocks]:
# Above BESIDE_COPIES_MAX_BLOCKS blocks (planner/placement_input.py) the placement model prices every CPU Adam step
# at its rate with copies beside it, for the solve's time; its LP is then below every replay of the solve (each
# checked) but not proven below every plan: a replay whose steps run beside no copy can beat it (Note [CPU Adam
# beside copies, in the model] in planner/placement_time.py). Up to PROVEN_BOUND_MAX_BLOCKS the solve also
# solves, for the header's bound only, the LPs at the rate alone charged the time lost beside copies
# (`_adam_alone_bound`), which bound every plan (issue 17 item 4). Measured on this tree (bench/RESULTS.md,
# session 15, 2-core box): GPT-3 175B (96 blocks) x rtx4090-768g-12ssd, two chunk sizes, 2.9 CPU s timed
# alone (+1.5 in bench_solve, a noisy box) on a 21 CPU s solve, the bound 114.045 -> 113.113 s; deeper, one
# such LP costs 15-19 CPU s at 512 blocks (session 13), over issue 18's 60 s for the solve, so there the
# header says its bound was checked only, and `solve_report(prove_bound=True)` (`planner solve --prove-bound`)
# proves it at any depth. These LPs give a bound only, so IPX stops without crossover
# (planner.mathopt_solver.BOUND_ONLY; 256 blocks, chunk 67257720: 7.8 instead of 20.9 CPU s). Measured with it
# (bench/RESULTS.md, session 16, bench_solve --prove-bound, hidden 4096 on a100-80g-12ssd): 256 blocks 68.8 CPU s
# (49.4 without), bound 30.947 s, true gap 4.38%; 512 blocks 167.6 CPU s (113.0 without, session 15), bound
# 64.067 s, true gap 3.75%. Since session 25, up to PROVEN_BOUND_MAX_BLOCKS, they are one job (`_alone_jobs`), the
# chunk sizes in the order of their LPs' bounds, each after the first solved only against the least so far (Note [an
# LP stopped above a bound] in planner/mathopt_solver.py): the same least, GPT-3 175B's second LP in 0.38-0.64
# instead of 1.03-1.13 CPU s.
PROVEN_BOUND_MAX_BLOCKS = 128
# the words of a header note saying its bound was checked against the solve's replays only (planner.compare reads it)
UNPROVEN_BOUND = "not proven for every plan"
LP_SOLVER = "HIGHS_IPM"  # the chunk-size search's LP (planner.mathopt_solver)
# every solver call's safety-net time limit (or --time-limit where larger): LPs stop at their optimum
# and MIPs at their gap or node limit long before it (512 blocks: ~16 s of CPU per LP under load)
SAFETY_SECONDS = 300.0


def solve(trace: Trace, hardware: Hardware, *, trace_digest: str, time_limit_s: float = DEFAULT_TIME_LIMIT_SECONDS,
          exact: bool = False, device_bytes: int | None = None, optimizer_overlap: bool = True,
          checkpoint_offload: bool = True, jobs: int = 1) -> Schedule:
    """Plan `trace` on `hardware` and return the schedule (raises InfeasibleError / PlannerError).

    `checkpoint_offload=False` keeps every RECOMPUTE block's input on DEVICE (by default the planner
    may park it on HOST; the executor replays either). `jobs`: processes that replay candidate plans (Note
    [replays ahead] in planner/replays.py); the same schedule with any number."""
    return solve_report(trace, hardware, trace_digest=trace_digest, time_limit_s=time_limit_s, exact=exact,
                        device_bytes=device_bytes, optimizer_overlap=optimizer_overlap,
                        checkpoint_offload=checkpoint_offload, jobs=jobs).schedule


# Note [solve steps]:
# 1. Chunk size: every candidate of `planner.layout.candidate_chunk_sizes` is laid out and its
#    placement LP relaxation solved (HiGHS's interior point on the sparse rows; with crossover for the sizes
#    whose MIP is likely: Note [the LP of an unlikely chunk size, for its value]).
# 2. Placement: the aggregated MIP of `planner.placement` (HiGHS, mechanism switches pinned to the
#    rounded LP and every count the LP has integral fixed, see `_solve_mip`) for at least the MIN_MIPS best candidates by LP, and further
#    ones while their LP can beat the best MIP (branch and bound over chunk sizes).
# 3. Decisions -> `planner.materialize` (actions, steady state, prediction), eviction
#    BELADY_CLEAN_FIRST with prefetch at the first harmless opportunity; each placement twice: the
#    overlapped CPU steps' SSD traffic paced by the placement's timeline, and issued at once; each with
#    the PARAM+GRAD budget cut to the placement's own bytes per stage (Note [the plan's own budget]; the
#    whole DEVICE's too below BOTH_BUDGETS_MAX_BLOCKS blocks, or where the cut one fails).
# 4. The simulator is the judge (DESIGN.md §4.5): every materialized placement and the reference
#    decision sets (`reference_decisions`: what Fuyou, ZeRO-Offload, PatrickStar/Gemini and PyTorch
#    decide, expressed as tide Decisions and materialized by tide's engine) are replayed by
#    `planner.simulate`; the fastest replay is the schedule (a tie, within 0.1%, goes to a placement
#    and to the layout that wastes less, but never to a plan slower than the best reference decision
#    set). So tide can do everything a baseline decides, and is never slower than those decision sets
#    by construction.
# 5. Header (one prediction, an honest bound): objective = the simulator's replay of the chosen
#    schedule, and the schedule's `prediction` is that replay too (`planner show` == `planner
#    simulate`); lower bound = max(the least valid model bound over the chunk sizes: unpinned LP at
#    its optimum or the unpinned root node; the physical limit `planner.bounds.lower_bound`);
#    gap = the true gap (simulated - bound) / simulated, never clipped. The MIP's own gap (to its
#    restricted model's dual bound) is printed beside it. The notes list every replay.
#
# Note [solve determinism]:
# Determinism: one solver thread, fixed seeds, LPs to their optimum, MIPs that stop at their gap or
# their node limit (the wall-clock limit is only a safety net), no clock read to decide anything,
# sorted iteration everywhere, and no wall-clock time in the file (solve seconds are printed, never
# written): the same inputs give the same bytes. With several jobs too: the workers compute outcomes the solve
# reads in the one-job order, and HiGHS solves one model at a time (Note [replays ahead] in planner/replays.py).


def solve_report(trace: Trace, hardware: Hardware, *, trace_digest: str,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_SECONDS, exact: bool = False,
                 device_bytes: int | None = None, optimizer_overlap: bool = True, checkpoint_offload: bool = True,
                 prove_bound: bool = False, progress: Callable[[str], None] | None = None,
                 jobs: int = 1) -> SolveReport:
    """`prove_bound`: the header's bound proven for every plan at any depth, not only up to PROVEN_BOUND_MAX_BLOCKS
    blocks (Note [the proven bound up to 128 blocks]: one more LP per chunk size). `jobs`: processes that replay
    candidate plans, this one included (Note [replays ahead] in planner/replays.py); the same bytes with any number."""
    # a plan replayed twice is replayed once (Note [replay memo] in planner.materialize), and ahead of need in
    # jobs - 1 workers; no cyclic garbage collection meanwhile (Note [no cyclic GC during a solve])
    with _cyclic_gc_paused(), replay_memo(jobs=jobs) as memo:
        report = _solve_report(trace, hardware, trace_digest=trace_digest, time_limit_s=time_limit_s, exact=exact,
                               device_bytes=device_bytes, optimizer_overlap=optimizer_overlap,
                               checkpoint_offload=checkpoint_offload, prove_bound=prove_bound, progress=progress,
                               jobs=jobs)
        return dataclasses.replace(report, worker_cpu_seconds=memo.worker_cpu_seconds)


# Note [no cyclic GC during a solve]:
# A solve allocates millions of small objects (every replay's actions, intervals and residency, the MathOpt
# models' variables and rows) and keeps many of them to the end (each replay it may choose), and CPython's cyclic
# collector traverses every tracked object at each full collection, which the allocations keep triggering;
# almost none of it is garbage in a cycle (reference counting frees the rest). In a worker forked with the
# problem each collection also writes to every inherited object's GC header, so the pages it shares with the
# solve are copied (the Python docs' gc.freeze: "call gc.disable() early in the parent process, gc.freeze()
# right before fork()"). So a solve runs with the cyclic collector off, its workers too (they are forked from
# it), and restores the collector's state when it returns. Measured (bench/RESULTS.md, session 22; 2-core box,
# the same bytes every time): 512 blocks x 4096 (a100-80g-12ssd, 2 jobs) 65.7 -> 56.7 wall s, its peak RSS
# 503 -> 515 MB (what the cycles it leaves hold); GPT-3 175B x a100-80g-12ssd 15.0 -> 12.1 s, x
# rtx4090-768g-12ssd 14.5 -> 12.3 s (one job 21.7 -> 20.7 s).
@contextlib.contextmanager
def _cyclic_gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _solve_report(trace: Trace, hardware: Hardware, *, trace_digest: str, time_limit_s: float, exact: bool,
                  device_bytes: int | None, optimizer_overlap: bool, checkpoint_offload: bool,
                  prove_bound: bool, progress: Callable[[str], None] | None, jobs: int) -> SolveReport:
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    problem = build_problem(trace, hardware, trace_digest=trace_digest, device_bytes=device_bytes)
    if exact:
        return solve_exact_report(problem, optimizer_overlap=optimizer_overlap, time_limit_s=time_limit_s,
                                  started=started, progress=say)
    sizes = candidate_chunk_sizes(problem)
    # PARAM homed on NVME only when no plan with every PARAM on HOST exists: the placement model
    # charges an NVMe-homed fetch as if the SSDs were free in its stage, while in the simulator they
    # queue behind the optimizer state's traffic (measured on 175B / a100-80g-12ssd: model 106 s,
    # simulator 191 s, against 118.5 s for the HOST-homed plan). It is what lets the largest
    # models fit (Fuyou's layout), where HOST cannot hold a copy of every PARAM.
    placed: dict[int, Decisions] = {}  # every solved MIP's decisions (by the solution's id), made once

    def ahead(layout, data: PlacementInput, sol: PlacementSolution) -> None:
        """A solved MIP's plan replayed ahead in its budget and pacing variants (Note [replays ahead]), while the
        search goes on: the stage loop below replays them in this order."""
        placed[id(sol)] = decisions_from_placement(problem, layout, data, sol)
        replay_ahead(problem, [(d, _stats(sol)) for d in _mip_plan_replays(problem, placed[id(sol)], sol)])

    if jobs > 1:  # the reference sets on the baselines' layout, ahead for a worker with nothing else to do
        reference = policy_layout(problem)
        replay_ahead(problem, [(d, None) for d, _ in _reference_sets(
            problem, {reference.chunk_elements: (reference, None)}, optimizer_overlap=optimizer_overlap,
            checkpoint_offload=checkpoint_offload, margin=False, say=lambda _msg: None)], spare=True)
    nvme_home = False
    search = _search(problem, sizes, time_limit_s=time_limit_s, optimizer_overlap=optimizer_overlap,
                     checkpoint_offload=checkpoint_offload, nvme_home=nvme_home, say=say, jobs=jobs,
                     prove_bound=prove_bound, solved_mip=ahead)
    if not search[2] and problem.nvme_bytes > 0 and hardware.nvme_read_bytes_per_s > 0:
        say("no plan with every PARAM on HOST: PARAM may live on NVME")
        nvme_home = True
        search = _search(problem, sizes, time_limit_s=time_limit_s, optimizer_overlap=optimizer_overlap,
                         checkpoint_offload=checkpoint_offload, nvme_home=nvme_home, say=say, jobs=jobs,
                         prove_bound=prove_bound, solved_mip=ahead)
    candidates, inputs, solved, bounds, flags, lp_modes, lp_bounds, rooted = search
    # With several ranks the placement model is rank-aware (issue 18 item 1) but keeps no local-only
    # chunk (docs/rank-aware-placement.md §7): the reference decision sets run even where it finds no plan
    if not solved and problem.world_size == 1:
        raise explain_infeasible(_least_demanding(inputs), what=f"{trace.meta.model_name} on {hardware.name}")
    by_size = {c.chunk_elements: c for c in candidates}
    # The simulator is the judge (DESIGN.md §4.5): every solved placement is materialized and
    # replayed, and so are the reference decision sets (what the baselines decide, expressed as
    # tide Decisions and materialized by tide's engine), so that tide can express everything a
    # baseline does and is never slower than one by construction; the fastest replay wins.
    # Above BESIDE_COPIES_MAX_BLOCKS blocks, on a profile whose copies slow CPU Adam, the model prices every
    # step at its rate with copies, a replay at its rate alone while no copy runs (planner.sim_actions.
    # _optimizer_step): its LP is then no bound of every plan. The LPs at the rate alone, charged what a step
    # loses beside copies (every other price the model's, the two-way rows included), are: solved where the
    # model's bound is above a replay, and up to PROVEN_BOUND_MAX_BLOCKS for the header's bound (Note [the
    # proven bound up to 128 blocks]; with several jobs the workers solve those from the search on)
    priced_with_copies = _priced_with_copies(problem, [d for _, d in inputs.values()])
    to_prove = _proves_alone(problem, priced_with_copies, prove_bound)
    evaluated: list[Evaluated] = []
    unreplayed: list[tuple[str, float]] = []  # (what, its bound): sets whose work cannot end before the fastest replay
    again = problem.world_size == 1 and len(problem.blocks) < REPLAY_AGAIN_MAX_BLOCKS  # the variants below
    for size in sorted(solved, key=lambda x: (solved[x].objective_seconds, x)):
        layout, data = inputs[size]
        decisions = placed[id(solved[size])]  # every solved MIP went through `ahead` (`_search`'s `solved_mip`)
        # as a reference decision set (`_replay_reference`): no variant below changes the work the placement
        # fixes, so none is replayed where that work cannot end within TIE_TOLERANCE of the fastest replay so far
        # (GPT-3 175B x rtx4090-768g-12ssd: chunk 1812099072's plan at least 132.04 s, the fastest replay then
        # 128.24 s; its 4 replays took 1.4 of the solve's CPU s, bench/RESULTS.md session 19)
        if _cannot_win(problem, decisions, evaluated, unreplayed, what=f"placement MIP, chunk size {size} (every variant)"):
            drop_ahead(problem, [(d, _stats(solved[size])) for d in _mip_plan_replays(problem, decisions, solved[size])])
            continue
        say(f"chunk size {size}: materialize and simulate")
        # the plan's own budget, the whole DEVICE's only where that does not survive (Note [the plan's own budget])
        budgets = _mip_plan_budgets(problem, decisions, solved[size])
        both = len(problem.blocks) < BOTH_BUDGETS_MAX_BLOCKS
        for paced in (True, False):  # the optimizer's SSD traffic at the CPU's pace, or at once
            found = []
            for chosen_budget, budget_label in budgets:
                one = _evaluate(problem, dataclasses.replace(chosen_budget, pace_optimizer_io=paced),
                                what=f"placement MIP, chunk size {size}{', paced' if paced else ''}{budget_label}",
                                chunk_elements=size, wasted=by_size[size].wasted_elements, placement=solved[size],
                                data=data)
                if one is not None:
                    found.append(one)
                    if not both:
                        break
            if found:
                evaluated.extend(found)
            elif paced:
                # Paced steps keep the grads the CPU has not reached on HOST, which the placement's
                # HOST rows do not see (a backlog row per stage made the 175B MIP time out): plan
                # again with HOST cut by what the paced schedule was short (DESIGN.md §4.5: iterate)
                found = _replan_for_host(problem, layout, data, solved[size], flags.get(size, {}),
                                         lp_modes.get(size), size=size, wasted=by_size[size].wasted_elements,
                                         budget=max(SAFETY_SECONDS, time_limit_s))
                if found is not None:
                    evaluated.append(found)
            if decisions.device_steps_in_backward:
                # and every GPU step in the OPTIMIZER moment: stepping in backward holds a group's PARAM
                # until its reduce-scatter lands, which can cost more than it saves (PatrickStar 4B on 2 x 8
                # V100: 3.4822 s in backward vs 3.4800 s; Note [DEVICE steps in backward]): both replayed
                late = _evaluate(problem, dataclasses.replace(decisions, pace_optimizer_io=paced, device_steps_in_backward=False),
                                 what=f"placement MIP, chunk size {size}{', paced' if paced else ''}, GPU steps after backward",
                                 chunk_elements=size, wasted=by_size[size].wasted_elements, placement=solved[size], data=data)
                if late is not None:
                    evaluated.append(late)
            if again:  # the variants of the fastest so far, ahead: those of the fastest at the end, most often
                replay_ahead(problem, [(d, _stats(best.placement)) for best, (d, _) in _variants_of_fastest(
                    evaluated, _tail_prefetches_first, REPLAYED_AGAIN)])
    # the fastest MIP replay once more with a block's tail issuing the prefetches needed next before its grad
    # write-backs (Note [a tail's prefetches before its write-backs] in planner/emit.py), the simulator judging:
    # applied to every MIP plan it cost elsewhere (175B x a100-80g-12ssd 113.438 -> 114.281 s, bench/RESULTS.md r8)
    if again:
        # re-paced on its replay's clock where the CPU starved, as the plan it varies (Note [pacing by the
        # replay] in planner/materialize.py): GPT-3 175B x rtx4090-768g-12ssd 124.332 -> 123.089 s (paced on the
        # estimate only), and its chains then end five steps apart (below). Paced on the estimate only until
        # session 10, when this emission took that solve past its 10 CPU s; Note [no polish within the gap]
        # gave the CPU back (bench/RESULTS.md "s10")
        _replay_fastest_again(problem, evaluated, _tail_prefetches_first, fastest=REPLAYED_AGAIN)
        # then the fastest with its two optimizer chains ending together (Note [the optimizer's two chains]):
        # only where the replay's chains end whole steps apart
        for _ in range(2):  # twice: the fastest may now be the first round's balanced replay
            _replay_fastest_again(problem, evaluated, lambda e: balanced_chains(e.decisions, e.replay),
                                  fastest=REPLAYED_AGAIN)
    # on the baselines' own layout every reference set; on the best placement's layout Fuyou's too; each
    # replayed unless the work it fixes cannot end before the fastest replay so far (`unreplayed`)
    reference = policy_layout(problem)
    layouts = {reference.chunk_elements: (reference, None)}
    best_placed = min(evaluated, key=lambda e: (e.simulated_seconds, e.chunk_elements), default=None)
    if best_placed is not None and best_placed.chunk_elements not in layouts:
        layouts[best_placed.chunk_elements] = (best_placed.decisions.layout, "fuyou")
    references = _reference_sets(problem, layouts, optimizer_overlap=optimizer_overlap,
                                 checkpoint_offload=checkpoint_offload, margin=True, say=say)
    # those that can still win, ahead (Note [replays ahead])
    replay_ahead(problem, [(d, None) for d, _ in references if _work_bound_loses(problem, d, evaluated) is None])
    for decisions, what in references:
        _replay_reference(problem, decisions, evaluated, unreplayed, what=what)
    if not evaluated and not solved:
        raise explain_infeasible(_least_demanding(inputs), what=f"{trace.meta.model_name} on {hardware.name}")
    if not evaluated:
        raise PlannerError(f"{trace.meta.model_name} on {hardware.name}: no placement or reference plan survived "
                           "materialize and the simulator; please report this trace and hardware")
    fastest = min(e.simulated_seconds for e in evaluated)
    best_reference = min((e.simulated_seconds for e in evaluated if e.placement is None), default=math.inf)
    # a tie may prefer a placement, never over a faster reference decision set (what a baseline decides)
    ties = [e for e in evaluated if e.simulated_seconds <= min(fastest * (1 + TIE_TOLERANCE), best_reference)]
    chosen = min(ties, key=lambda e: (e.placement is None, e.wasted_elements, e.simulated_seconds, e.chunk_elements))
    data = chosen.data or (inputs[max(solved)][1] if solved else _least_demanding(inputs))
    # Only valid bounds (issue 17 item 4): the physical limit of any schedule (planner.bounds.lower_bound,
    # which lets off-GPU OS stream to the GPU as the MIP does), and with one rank the placement
    # model's: per chunk size the unpinned LP solved to its optimum or the unpinned root node,
    # the least over the chunk sizes. Never the dual bound of a MIP with pinned switches, modes or
    # fixed counts (it bounds that restriction only), never clipped to the objective.
    # The model's bound holds for the simulator only where the model prices no plan above its replay;
    # where a replay of this solve is faster than it, it is no bound of the replays (measured: a
    # 2-block GPT on rtx4090-768g-12ssd with everything on DEVICE replays 3.8% under the LP) and
    # the header falls back to the physical limit, saying so in the notes.
    physical = lower_bound(problem).seconds
    # (with several ranks too, issue 18 item 3: the rank-aware rows count what materialize replays per rank)
    fastest_replay = min(e.simulated_seconds for e in evaluated)
    if problem.world_size == 1 and solved and len(problem.blocks) < ROOT_AFTER_REPLAY_MAX_BLOCKS:
        # the bound against the fastest replay (the true gap), not only against the model objective
        _root_bounds(problem, inputs, bounds, rooted, fastest_replay, max(SAFETY_SECONDS, time_limit_s), say)
    relaxation_bound = min(bounds.values()) if bounds else 0.0
    model_bound_valid = relaxation_bound <= fastest_replay
    root_above = ""
    if not model_bound_valid and lp_bounds:
        # the root nodes' cuts can prove more than the simulator charges where the model is pessimistic
        # about a plan (32 blocks x 4096 on a100-80g-12ssd: root 2.5092 s, a replay 2.4987 s, the LPs
        # 2.4004 / 2.4949 s): the LPs alone are still below every replay, so they are the model's bound
        lp_only = min(lp_bounds.values())
        if lp_only <= fastest_replay:
            root_above = (f"the root node's bound {relaxation_bound:.6g} s is above a replay ({fastest_replay:.6g} s): "
                          f"the model's bound is its LP's, {lp_only:.6g} s")
            relaxation_bound, model_bound_valid = lp_only, True
    # the LPs at CPU Adam's rate alone (above), or only now where the model's bound is above a replay
    adam_alone = ""
    if lp_bounds and (not model_bound_valid or to_prove):
        alone = _adam_alone_bound(problem, {k: inputs[k][1] for k, v in lp_bounds.items() if math.isfinite(v)},
                                  lp_bounds, max(SAFETY_SECONDS, time_limit_s), say, nvme_home=nvme_home)
        if 0.0 < alone <= fastest_replay:
            adam_alone = (f"the header's bound is the LP with CPU Adam at its rate alone charged the time lost beside "
                          f"copies, {alone:.6g} s, proven for every plan (the model's LP at the rate with copies, "
                          f"{relaxation_bound:.6g} s, is below every replay of this solve)" if model_bound_valid else
                          f"the model's bound {relaxation_bound:.6g} s is above a replay ({fastest_replay:.6g} s): "
                          f"the header's bound is its LP with CPU Adam at its rate alone, {alone:.6g} s")
            relaxation_bound, model_bound_valid = alone, True
    unproven = model_bound_valid and priced_with_copies and not adam_alone
    bound = max(relaxation_bound if model_bound_valid else 0.0, physical, 0.0)
    sol = chosen.placement or min(solved.values(), key=lambda x: x.objective_seconds, default=None)
    model_objective = chosen.placement.objective_seconds if chosen.placement is not None else math.nan
    # the MIP's own gap: its model objective against the valid model bound of its chunk size (the
    # LP, or the root node's; the dual bound of a pinned, partly fixed MIP bounds that restriction only)
    mip_gap = math.nan
    if chosen.placement is not None and chosen.placement.objective_seconds > 0:
        own = bounds.get(chosen.chunk_elements, 0.0)
        mip_gap = (chosen.placement.objective_seconds - own) / chosen.placement.objective_seconds
    notes = _notes(candidates, chosen, evaluated, unreplayed, relaxation_bound, physical)
    if root_above:
        notes = (root_above,) + notes
    if adam_alone:
        notes = (adam_alone,) + notes
    if not model_bound_valid:
        notes = (f"the model's bound {relaxation_bound:.6g} s is above a replay ({fastest_replay:.6g} s): the "
                 "header's bound is the physical limit",) + notes
    elif unproven and bound == relaxation_bound:
        # above PROVEN_BOUND_MAX_BLOCKS blocks (Note [the proven bound up to 128 blocks]): say what it is
        notes = (f"the LP bound prices every CPU Adam step at its rate with copies beside it: below every replay of "
                 f"this solve (each checked), {UNPROVEN_BOUND}; the LP at the rate alone charged the time lost "
                 "beside copies is the strict bound (`planner solve --prove-bound` solves it)",) + notes
    schedule = dataclasses.replace(chosen.schedule, header=dataclasses.replace(chosen.schedule.header, notes=notes))
    # one prediction: the header's time and the schedule's prediction are the simulator's replay
    schedule = with_simulated_prediction(schedule, chosen.replay)
    schedule = with_header_stats(schedule, chosen.simulated_seconds, SolverStatus.FEASIBLE, bound)
    return SolveReport(schedule=schedule, placement=sol, data=data, candidates=tuple(candidates),
                       chunk_elements=chosen.chunk_elements, model_objective_seconds=model_objective,
                       lower_bound_seconds=schedule.header.lower_bound_seconds,
                       physical_bound_seconds=physical, relaxation_bound_seconds=relaxation_bound,
                       solve_seconds=time.perf_counter() - started, simulated_seconds=chosen.simulated_seconds,
                       evaluated=tuple((e.what, e.simulated_seconds) for e in evaluated), chosen=chosen.what,
                       mip_gap=mip_gap)


@frozen
class Evaluated:
    """One materialized plan and its replay in the simulator."""

    what: str
    decisions: object  # planner.materialize.Decisions
    schedule: Schedule
    simulated_seconds: float
    chunk_elements: int
    wasted_elements: int
    replay: object  # planner.sim_result.SimResult of the schedule
    placement: PlacementSolution | None = None  # None: a reference decision set
    data: PlacementInput | None = None


# Note [the plan's own budget]:
# `decisions_from_placement` gives materialize all the room the DEVICE leaves PARAM+GRAD at each moment, and
# materialize's Belady pass fills it (prefetching early, keeping more). Since sim17 a D2H copy's source bytes
# stay on DEVICE until it lands and an allocation that finds no room waits for copies in flight (Note
# [simulator evictions] in planner/sim_actions.py), so a budget filled to the brim makes the work wait for the
# previous stage's grad write-backs: GPT-3 175B x a100-80g-12ssd, chunk 605212776, every backward stage replayed
# 0.142 s (one block's grads at 25.5 GB/s) over the model's. The MIP's own PARAM+GRAD bytes per stage
# (`PlacementSolution.param_bytes_per_stage`) leave the room its plan did not fill. Measured with the budget cut to them at every moment of the stage (one run each,
# 2-core box under load ~8, bench/RESULTS.md "lp17"): 256 blocks x 4096 on a100-80g-12ssd 36.13 -> 32.27 s; GPT-3
# 175B x a100 120.16 -> 116.18 s, x rtx4090 130.76 -> 130.31 s; GPT-3 13B x rtx4090 8.603 -> 8.516 s, x a100 6.320 ->
# 6.191 s. One rank only (the multi-rank model counts gathered comm groups, not materialize's entries); where
# materialize or the simulator refuses the cut budget, the whole DEVICE's, labelled "full budget".
def _own_budget(problem, decisions, sol: PlacementSolution):
    """`decisions` with its PARAM+GRAD budget at each moment at most the placement's bytes of the moment's stage
    (Note [the plan's own budget]); `decisions` itself with several ranks or where that cuts nothing."""
    if problem.world_size > 1 or not sol.param_bytes_per_stage:
        return decisions
    budget = list(decisions.param_device_budget_bytes)
    for st in problem.stages:
        # (the model's bytes are MiB floats: rounded up, never below the plan's integral chunks)
        cap = math.ceil(sol.param_bytes_per_stage[st.id] * (1 + 1e-9))
        for m in range(st.first_moment, st.last_moment + 1):
            budget[m] = min(budget[m], cap)
    if tuple(budget) == tuple(decisions.param_device_budget_bytes):
        return decisions
    return dataclasses.replace(decisions, param_device_budget_bytes=tuple(budget))


def _stats(placement: PlacementSolution | None) -> SolverStats | None:
    """What a schedule's header says of the placement MIP it comes from (None: a reference decision set)."""
    if placement is None:
        return None
    return SolverStats(status=placement.status, objective_seconds=placement.objective_seconds,
                       lower_bound_seconds=placement.bound_seconds, gap=placement.gap)


def _mip_plan_budgets(problem, decisions: Decisions, sol: PlacementSolution) -> tuple[tuple[Decisions, str], ...]:
    """(decisions, label) per PARAM+GRAD budget a MIP plan is replayed with, in order: its own, and the whole
    DEVICE's (Note [the plan's own budget])."""
    own = _own_budget(problem, decisions, sol)
    return ((own, ""), (decisions, ", full budget")) if own is not decisions else ((decisions, ""),)


def _mip_plan_replays(problem, decisions: Decisions, sol: PlacementSolution) -> list[Decisions]:
    """The decisions a MIP plan is replayed with, in the order `_solve_report` replays them where each survives:
    per pacing its budgets (the whole DEVICE's only below BOTH_BUDGETS_MAX_BLOCKS blocks) and, where it steps
    on DEVICE in backward, every GPU step after backward (Note [replays ahead])."""
    budgets = _mip_plan_budgets(problem, decisions, sol)
    out = []
    for paced in (True, False):
        out += [dataclasses.replace(d, pace_optimizer_io=paced)
                for d, _ in budgets[:None if len(problem.blocks) < BOTH_BUDGETS_MAX_BLOCKS else 1]]
        if decisions.device_steps_in_backward:
            out.append(dataclasses.replace(decisions, pace_optimizer_io=paced, device_steps_in_backward=False))
    return out


def _evaluate(problem, decisions, *, what: str, chunk_elements: int, wasted: int,
              placement: PlacementSolution | None = None, data: PlacementInput | None = None) -> Evaluated | None:
    """Materialize and simulate; None when the plan does not survive either (it runs out of a tier
    once every action is placed, or breaks a rule of the simulator)."""
    try:
        schedule, replay = materialize_replayed(problem, decisions, stats=_stats(placement))
    except (InfeasibleError, ScheduleViolation, PlannerError) as exc:
        log.info("%s: dropped (%s)", what, exc)
        return None
    return Evaluated(what=what, decisions=decisions, schedule=schedule, simulated_seconds=replay.iteration_seconds,
                     chunk_elements=chunk_elements, wasted_elements=wasted, placement=placement, data=data,
                     replay=replay)


def _tail_prefetches_first(e: Evaluated) -> tuple[Decisions, str] | None:
    """A MIP replay's decisions with a block's tail issuing its prefetches first (Note [a tail's prefetches before its
    write-backs] in planner/emit.py), where it holds write-backs."""
    if not e.decisions.hold_write_backs:
        return None
    return dataclasses.replace(e.decisions, tail_prefetches_first=True), "a tail's prefetches first"


def _variants_of_fastest(evaluated: list[Evaluated], variant: Callable[[Evaluated], tuple[Decisions, str] | None],
                         fastest: int) -> list[tuple[Evaluated, tuple[Decisions, str]]]:
    """(replay, its variant) for the `fastest` fastest MIP replays that have one."""
    placed = sorted((e for e in evaluated if e.placement is not None), key=lambda e: (e.simulated_seconds, e.what))
    return [(best, found) for best in placed[:fastest] if (found := variant(best)) is not None]


def _replay_fastest_again(problem, evaluated: list[Evaluated],
                          variant: Callable[[Evaluated], tuple[Decisions, str] | None], *, fastest: int = 1) -> None:
    """The `fastest` fastest MIP replays once more each with `variant`'s decisions (None: nothing to try),
    appended to `evaluated` where they survive; the simulator judges them with the others."""
    variants = _variants_of_fastest(evaluated, variant, fastest)
    replay_ahead(problem, [(decisions, _stats(best.placement)) for best, (decisions, _) in variants])
    for best, (decisions, how) in variants:
        again = _evaluate(problem, decisions, what=f"{best.what}, {how}", chunk_elements=best.chunk_elements,
                          wasted=best.wasted_elements, placement=best.placement, data=best.data)
        if again is not None:
            evaluated.append(again)


# Note [the optimizer's two chains]:
# With OS off the GPU the tail after backward runs two chains of optimizer steps side by side: CPU Adam
# steps (the CPU; an NVMe OS read and written on the SSDs) and DEVICE steps (their OS up and down the PCIe
# link, from HOST or through it from the SSDs). The placement MIP splits the chunks between them on its
# stage rows; the replay ends when the later chain's last step (and its write-back) does. Measured on GPT-3
# 175B x a100-80g-12ssd (the chosen MIP plan, chunk 1812099072, paced, full budget, 113.438 s; bench/RESULTS.md
# "g175"): 69 CPU steps and 29 DEVICE steps, the last CPU step ending 3.84 s after the last DEVICE step,
# the steps 1.48 s (CPU) and 1.91 s (DEVICE) apart at the end, and the SSDs idle 1.2 s in the last 2.5 s
# waiting for the CPU. Moving a chunk from the later chain to the other takes about one of its steps
# off the later chain and adds one to the other, so while the chains end more than both spacings apart
# each move ends the iteration a whole step earlier with the other chain still ending first. Applied to
# the fastest MIP replay: m = floor(difference / (both spacings)) chunks, the ones the later chain steps
# last (each spacing the mean over its last CHAIN_STEPS_MEASURED steps), moved and replayed once more;
# the simulator judges. There: one chunk, 113.438 -> 112.533 s (CPU 111.32, DEVICE 110.72 s; two
# chunks: 113.550 s, the DEVICE chain then last, as the rule predicts). GPT-3 175B x rtx4090-768g-12ssd's
# chains end 0.97 s apart with spacings 0.53 + 0.57 s: no move (one would replay 124.125 instead of
# 124.219 s). Where the DEVICE chain ends later its last steps go to the CPU: GPT-3 13B x rtx4090-768g-12ssd
# 8.3188 -> 8.2421 s (4 chunks), PatrickStar's 4B x rtx4090-768g-12ssd 2.452 -> 2.372 s (10 chunks; the goldens).
# Only a step whose OS lives below DEVICE (HOST or NVME) changes chain; one rank.
# Since session 15 m is whichever of floor(difference / both spacings) and one more ends the later of the two
# chains earliest (a move pays while the difference exceeds the other chain's spacing, even where the other
# chain then ends last), and the fastest replay is balanced a second time. On GPT-3 175B x
# rtx4090-768g-12ssd the first round moves 4 chunks (121.372 -> 119.644 s), the second one more (chains
# then 0.62 s apart, spacings ~0.5 + 0.55 s: 119.644 -> 119.374 s; a further move either way replays slower,
# 119.753 / 119.644 s). PatrickStar's 4B golden tries 2 moves where it tried 1 (2.348 s against 2.333 s,
# neither chosen); the other goldens replay the same plans (bench/RESULTS.md, session 15).
def balanced_chains(decisions: Decisions, replay: SimResult) -> tuple[Decisions, str] | None:
    """`decisions` with the chunks the later optimizer chain of `replay` steps last moved to the other
    chain (Note [the optimizer's two chains]), and what was moved; None where no move ends the later chain
    earlier by the chains' step spacings."""
    ends: dict[str, list[tuple[float, int]]] = {"CPU": [], "GPU": []}
    for iv in replay.timeline:
        if iv.step_chunk is not None:
            ends["CPU" if iv.channel is Channel.CPU_OPTIMIZER else "GPU"].append((iv.end_seconds, iv.step_chunk))
    if min(len(v) for v in ends.values()) < 2:
        return None
    spacing = {}
    for chain, v in ends.items():
        v.sort()
        j = min(CHAIN_STEPS_MEASURED, len(v) - 1)
        spacing[chain] = (v[-1][0] - v[-1 - j][0]) / j
    late = max(ends, key=lambda k: (ends[k][-1][0], k))
    early = "GPU" if late == "CPU" else "CPU"
    last, first = ends[late][-1][0], ends[early][-1][0]
    # m moves end the later chain at last - m x its spacing and the other at first + m x its own: the m either
    # side of where they meet whose later end is earliest (the lesser on a tie; none where it gains nothing)
    meet = int((last - first) // (spacing["CPU"] + spacing["GPU"]))
    moves = min((meet, meet + 1), key=lambda m: (max(last - m * spacing[late], first + m * spacing[early]), m))
    plans = list(decisions.chunk_plans)
    at = {p.chunk: k for k, p in enumerate(plans)}
    target = Tier.DEVICE if late == "CPU" else Tier.HOST
    chosen = [c for _, c in reversed(ends[late])
              if c in at and plans[at[c]].os_tier in (Tier.HOST, Tier.NVME)][:min(moves, len(ends[late]) - 1)]
    if not chosen:
        return None
    for c in chosen:
        plans[at[c]] = dataclasses.replace(plans[at[c]], optimizer_tier=target)
    how = (f"{len(chosen)} step{'s' if len(chosen) > 1 else ''} moved from the {late} to the {early} "
           f"(chunk{'s' if len(chosen) > 1 else ''} {', '.join(str(c) for c in sorted(chosen))})")
    return dataclasses.replace(decisions, chunk_plans=tuple(plans)), how


def _reference_sets(problem, layouts: dict[int, tuple[ChunkLayout, str | None]], *, optimizer_overlap: bool,
                    checkpoint_offload: bool, margin: bool, say: Callable[[str], None]) -> list[tuple[Decisions, str]]:
    """(decisions, what) of the reference decision sets, in the order they are replayed: per layout (the sets whose
    name starts with its prefix; None: all of them, and with `margin` PatrickStar's with the OS its DEVICE margin
    holds, `planner.reference.os_margin_decisions`), then the Angel-PTM-like ones (with `optimizer_overlap`)."""
    references: list[tuple[Decisions, str]] = []
    for size, (layout, only) in sorted(layouts.items()):
        say(f"chunk size {size}: reference decision sets")
        for name, decisions in reference_decisions(problem, layout, optimizer_overlap=optimizer_overlap,
                                                   checkpoint_offload=checkpoint_offload):
            if only is not None and not name.startswith(only):
                continue
            if margin and only is None and name == "patrickstar-like":  # and the same with the OS the margin holds
                found = os_margin_decisions(problem, layout, optimizer_overlap=optimizer_overlap,
                                            checkpoint_offload=checkpoint_offload)
                if found is not None:
                    margin_name, margin_decisions = found
                    references.append((margin_decisions, f"{margin_name} decisions, chunk size {size}"))
            for paced in (False, True) if name.startswith("fuyou") else (False,):
                references.append((dataclasses.replace(decisions, pace_optimizer_io=paced),
                                   f"{name} decisions, chunk size {size}{', paced' if paced else ''}"))
    # the Angel-PTM-like decision sets (planner.policies.angel, on their own layout and eviction rule)
    # too: they are the strongest baseline on 13B x a100-80g-12ssd, where tide's materialization of the
    # same placement on its layout replayed 0.8% slower (bench/RESULTS.md l17); replayed here, tide is
    # never slower than what that baseline decides either
    for i, decisions in enumerate(angel_decide(problem) if optimizer_overlap else ()):
        references.append((dataclasses.replace(decisions, policy=POLICY, notes=tuple(
            f"angel-like reference set: {n}" for n in decisions.notes)),
            f"angel-like decisions {i + 1}, chunk size {decisions.layout.chunk_elements}"))
    return references


def _cannot_win(problem, decisions: Decisions, evaluated: list[Evaluated], unreplayed: list[tuple[str, float]],
                *, what: str) -> bool:
    """Whether the work `decisions` fix cannot end within TIE_TOLERANCE of the fastest replay so far
    (planner.bounds.decisions_bound); if so, (`what`, that bound) goes into `unreplayed`."""
    bound = _work_bound_loses(problem, decisions, evaluated)
    if bound is None:
        return False
    unreplayed.append((what, bound))
    return True


def _work_bound_loses(problem, decisions: Decisions, evaluated: list[Evaluated]) -> float | None:
    """The least time of the work `decisions` fix (planner.bounds.decisions_bound) where it cannot end within
    TIE_TOLERANCE of the fastest replay so far, else None."""
    bound = decisions_bound(problem, decisions).seconds
    fastest = min((e.simulated_seconds for e in evaluated), default=math.inf)
    return None if bound <= fastest * (1 + TIE_TOLERANCE) else bound


def _replay_reference(problem, decisions: Decisions, evaluated: list[Evaluated], unreplayed: list[tuple[str, float]],
                      *, what: str) -> None:
    """A reference decision set materialized and replayed into `evaluated`, or, where the work it fixes cannot end
    within TIE_TOLERANCE of the fastest replay so far (planner.bounds.decisions_bound), its bound into
    `unreplayed`: it could be neither chosen nor the faster reference that a tie yields to. On the depth ladder's
    256 blocks x 4096 (a100-80g-12ssd) 9 of its 10 replayable sets, ~1 s of CPU each (bench/RESULTS.md, session 17)."""
    if _cannot_win(problem, decisions, evaluated, unreplayed, what=what):
        return
    found = _evaluate(problem, decisions, what=what, chunk_elements=decisions.layout.chunk_elements,
                      wasted=wasted_elements(decisions.layout))
    if found is not None:
        evaluated.append(found)


def _beside(jobs: int, fn: Callable[[], T]) -> Callable[[], T]:
    """A call (made once) that returns `fn()`: computed from now on in a thread where `jobs` > 1 (HiGHS, which
    releases the GIL, beside the solve's Python: Note [one HiGHS solve at a time] in planner/mathopt_solver.py), the
    call waiting for it; with one job `fn` itself, computed when called."""
    if jobs < 2:
        return fn
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # raised where the call reads it
            future.set_exception(exc)

    # a daemon: an interrupted solve exits without waiting for HiGHS to finish an LP nobody reads
    threading.Thread(target=work, name="tide-highs", daemon=True).start()
    return future.result


def _priced_with_copies(problem, datas: list[PlacementInput]) -> bool:
    """Whether the placement model prices CPU Adam at its rate with copies on a profile whose copies slow it, so
    that its LP bounds the solve's replays only (Note [the proven bound up to 128 blocks])."""
    beside = cpu_adam_beside_copies(problem.hardware, threads=cpu_adam_threads(problem.hardware, overlapped=True),
                                    mixed_precision=problem.mixed_precision)
    return beside < 1.0 and any(d.cpu_adam_beside_copies == 1.0 for d in datas)


def _proves_alone(problem, priced_with_copies: bool, prove_bound: bool) -> bool:
    """Whether the solve proves the header's bound with `_adam_alone_bound` whatever its replays give (Note [the
    proven bound up to 128 blocks])."""
    return priced_with_copies and (prove_bound or len(problem.blocks) <= PROVEN_BOUND_MAX_BLOCKS)


def _adam_alone_bound(problem, inputs: dict[int, PlacementInput], bounds: dict[int, float], safety: float,
                      say: Callable[[str], None], *, nvme_home: bool) -> float:
    """The least of `_alone_lp` over the chunk sizes of `inputs` (the search's, with `nvme_home`, in the order of
    `bounds`: `_alone_jobs`, worked out by the workers where it has them, Note [replays ahead]); 0.0 when one stops
    short of its optimum (no bound)."""
    least = math.inf
    for key, args in _alone_jobs(problem, inputs, bounds, safety, nvme_home=nvme_home):
        say(f"chunk size{'s' if len(key[1]) > 1 else ''} {', '.join(map(str, key[1]))}: LP with CPU Adam alone")
        value = _computed(problem, key, _alone_lps, *args)
        if value <= 0.0:
            return 0.0
        least = min(least, value)
    return least if math.isfinite(least) else 0.0


def _alone_jobs(problem, inputs: dict[int, PlacementInput], bounds: dict[int, float], safety: float, *,
                nvme_home: bool) -> list[tuple[tuple, tuple]]:
    """(memo key, `_alone_lps`' arguments) of the jobs that solve the proven bound's LPs, the chunk sizes by their LP's
    bound (at the rate with copies), the least first: the likeliest least LP at the rate alone. Up to
    PROVEN_BOUND_MAX_BLOCKS blocks one job, each LP after the first solved against the least so far (Note [an LP
    stopped above a bound] in planner/mathopt_solver.py); deeper (`--prove-bound`) one job per chunk size, each
    solved through: there an LP takes 7-19 CPU s and the jobs run side by side (256 blocks x 4096, a100-80g-12ssd:
    the second size's LP 0.2% above the first, the dual simplex took 12.2 s where IPX takes ~7 s, and as one job
    the solve took 40.1 wall s against 33.9 s; bench/RESULTS.md, session 25)."""
    sizes = tuple(sorted(inputs, key=lambda x: (bounds.get(x, math.inf), x)))
    groups = [sizes] if len(problem.blocks) <= PROVEN_BOUND_MAX_BLOCKS else [(x,) for x in sizes]
    return [(("alone LPs", group, nvme_home), (tuple(inputs[x] for x in group), safety)) for group in groups]


def _alone_lps(problem, datas: tuple[PlacementInput, ...], safety: float) -> float:
    """The least of `_alone_lp` over `datas` (inf where no plan fits, 0.0: no bound), each after the first solved only
    to tell whether it is below the least so far (Note [an LP stopped above a bound] in planner/mathopt_solver.py):
    the same least."""
    least = math.inf
    for data in datas:
        value = _alone_lp(problem, data, safety, above_seconds=least if math.isfinite(least) else None)
        if value is None:
            continue
        if value <= 0.0:
            return 0.0
        least = min(least, value)
    return least


def _alone_lp(problem, data: PlacementInput, safety: float, *, above_seconds: float | None = None) -> float | None:
    """The bound of `data`'s LP with CPU Adam at its fastest rate alone (either thread count a replay steps with:
    costmodel.optimizer_step_price without copies) and charged the least time lost beside copies (Note [CPU Adam
    beside copies, in the model]); None where no plan fits; `above_seconds` where it is proven above them; 0.0 (no
    bound) where it stops short of its optimum."""
    hw, threads = problem.hardware, (problem.hardware.host.cores, cpu_adam_threads(problem.hardware, overlapped=True))
    alone = min(optimizer_step_price(hw, Tier.HOST, 1, threads=t, mixed_precision=problem.mixed_precision).seconds
                for t in threads)
    beside = max(cpu_adam_beside_copies(hw, threads=t, mixed_precision=problem.mixed_precision) for t in threads)
    data = dataclasses.replace(data, cpu_adam_seconds_per_element=alone, cpu_adam_beside_copies=beside)
    try:
        lp = SparsePlacementModel(data, relax=True, lp_solver=BOUND_ONLY).solve(time_limit_seconds=safety,
                                                                                above_seconds=above_seconds)
    except PlacementAbove:
        return above_seconds
    except PlacementInfeasible as exc:
        # stopped short of its optimum (time, numerics): no bound, rather than a chunk size left out of the least
        return 0.0 if "no solution within" in str(exc) else None
    return lp.bound_seconds


def _computed(problem, key: tuple, run: Callable[..., T], *args, meanwhile: Callable[[], bool] = lambda: False) -> T:
    """`run(problem, *args)`, read from the open memo (computed once, perhaps by a worker: Note [replays ahead]; the
    solve doing `meanwhile`'s work while it waits for one: `ReplayMemo.outcome`)."""
    memo = replays.current()
    return run(problem, *args) if memo is None else memo.outcome(problem, key, None, run, *args, meanwhile=meanwhile)


def _search(problem, sizes: list[int], *, time_limit_s: float, optimizer_overlap: bool,
            checkpoint_offload: bool, nvme_home: bool, say: Callable[[str], None], jobs: int = 1,
            prove_bound: bool = False,
            solved_mip: Callable[[ChunkLayout, PlacementInput, PlacementSolution], None] = lambda *_: None):
    """LP per chunk size, then branch and bound over chunk sizes with the MIP; `solved_mip(layout, data, solution)`
    as each MIP is solved.

    Returns (candidates, inputs, solved MIPs, valid bounds per chunk size, LP switch values, LP
    modes, the LPs alone); `solved` is empty when none fits. Nothing here reads the clock to decide: the solver
    calls stop at their optimum, gap or node limit (`time_limit_s` is each call's safety net), so
    a loaded machine gives the same schedule."""
    candidates: list[Candidate] = []
    inputs: dict[int, tuple[object, PlacementInput]] = {}
    flags: dict[int, dict[str, float]] = {}
    lp_modes: dict[int, tuple] = {}
    lp_values: dict[int, dict[str, float]] = {}
    lp_models: dict[int, SparsePlacementModel] = {}  # unpinned, solved here or by a worker: each becomes its MIP
    bounds: dict[int, float] = {}
    safety = max(SAFETY_SECONDS, time_limit_s)  # each solver call's safety net, never the normal stop
    # with several ranks the systems' packing (tensors across block boundaries, only the last comm
    # group padded: planner.policies.policy_layout) is a candidate too (issue 18 item 1, measured in
    # bench/RESULTS.md "Rank-aware placement"), and tide's own layouts let comm groups span blocks
    # instead of padding every block to whole comm groups (Note [layout comm groups]; measured on
    # v100-32g-240g-8gpu, simulated: 4B 3.491 -> 3.430 s, 12B 10.84 -> 10.76 s, 1.3B unchanged)
    # With several ranks also PatrickStar's comm groups (§7: the one-rank chunks, world_size consecutive
    # ones a comm group, the oversize embedding in a group of its own; Angel-PTM's pages grouped alike,
    # planner/policies/angel.py AP.1): small gathered groups, so little DEVICE goes to the comm groups in
    # use and their grads and more to OS and activations (measured, v100-32g-240g-8gpu, simulated: 12B
    # 10.665 -> 10.008 s, bench/RESULTS.md "Issue 18, session 4"). A layout whose chunk size is already
    # a candidate is left out (the candidates are keyed by chunk size).
    extra: dict[int, object] = {}
    if problem.world_size > 1:
        for lay in (policy_layout(problem), patrickstar_layout(problem)):
            if lay.chunk_elements not in sizes and lay.chunk_elements not in extra:
                extra[lay.chunk_elements] = lay
    layouts = {size: extra[size] if size in extra else
               build_layout(problem, chunk_elements=size, groups_span_blocks=problem.world_size > 1)
               for size in sizes + list(extra)}
    # Note [the LP of an unlikely chunk size, for its value]: every size's LP is solved first (the search's
    # order and the bound), but only the sizes whose MIP is solved need its vertex (LP-integral fixing, the
    # switches and modes to pin), and the crossover to it costs (the depth ladder's chunk 268435456, hidden 4096,
    # a100-80g-12ssd, timed alone: 512 blocks 11.5 CPU s with it, 8.9-10.0 without; 256 blocks 3.6-4.9 against
    # 3.0-3.1 s; bench/RESULTS.md, session 20). The MIN_MIPS sizes that waste the fewest elements are solved
    # with it; the others without (their value and bound), and again with it only where the search then
    # reaches their MIP: the same plans.
    likely = _vertex_first(layouts, ranks=problem.world_size)

    def lp_built(size: int) -> SparsePlacementModel | None:
        """`size`'s LP on the sparse DEVICE rows, for HiGHS's interior point to a vertex (Note [the placement LP on
        HiGHS's interior point] in planner/mathopt_solver.py), keeping what its MIP reads; None where no plan fits."""
        try:
            return SparsePlacementModel(inputs[size][1], relax=True, lp_solver=LP_SOLVER)
        except PlacementInfeasible:
            return None

    def solve_lp(size: int) -> float:
        """Build and solve `size`'s LP to a vertex: its value (inf where no plan fits)."""
        lp_model = lp_built(size)
        return lp_solved(size, lp_model, lp_model and functools.partial(_solved_vertex, lp_model, safety))

    def lp_solved(size: int, lp_model: SparsePlacementModel | None,
                  solution: Callable[[], _Vertex | None] | None) -> float:
        """Record `size`'s LP (`lp_model`, built here; None where a worker built it), solved to a vertex by
        `solution()` (here, or in a worker with its MIP's fixed plan: `_vertex_mip`); its value (inf where no plan
        fits)."""
        try:
            found = solution() if solution is not None else None
        except PlacementInfeasible:
            found = None
        if found is None:
            bounds[size] = math.inf
            return math.inf
        # a worker's comes with its MIP's fixed plan, polished where that reads no leader (Note [a size's MIP in a
        # worker])
        vertex, worked = found if lp_model is None else (found, None)
        lp, flags[size], lp_values[size] = vertex
        # 0 unless the LP solver reached the LP's optimum; a bound of every replay: the simulator
        # charges both ways on a link in the rows this LP charges (Note [two-way links in the
        # simulator] in planner/sim_actions.py)
        bounds[size] = lp.bound_seconds
        lp_modes[size] = lp.activation_modes
        if lp_model is None:
            solved_ahead(size, *worked)
        else:
            lp_models[size] = lp_model
        return lp.objective_seconds

    for size, layout in layouts.items():
        data = placement_input(problem, layout, optimizer_overlap=optimizer_overlap)
        inputs[size] = (layout, dataclasses.replace(data, param_nvme_home=nvme_home, checkpoint_offload=checkpoint_offload))
    # With several jobs (Note [replays ahead]) the workers solve every likely size's LP but the first to its
    # vertex (Note [a vertex LP in a worker]) and then its MIP fixing (Note [a size's MIP in a worker]), then the LPs
    # solved for their value alone; the first likely size's LP is solved here by HiGHS in a thread (`_beside`)
    memo = replays.current()
    vertices = [x for x in layouts if x in likely]
    unlikely = [(("value LP", size, nvme_home), None, (inputs[size][1], safety))
                for size in layouts if size not in likely]
    elsewhere: set[int] = set()  # the likely sizes whose vertex a worker solves
    if memo is not None:
        if memo.ahead(problem, _vertex_mip, [(("vertex LP and MIP", size, nvme_home), None, (inputs[size][1], safety))
                                             for size in vertices[1:]]):
            elsewhere = set(vertices[1:])
        memo.ahead(problem, _value_lp, unlikely)
    values: dict[int, float] = {}

    fixed_ahead: dict[int, _Fixed | PlacementInfeasible] = {}  # fixed plans solved ahead, to be polished
    mips_ahead: dict[int, PlacementSolution | PlacementInfeasible] = {}  # plans solved ahead, their replays named

    def fixed_mip(size: int) -> _Fixed | PlacementInfeasible:
        """`size`'s MIP's fixed plan (`_fixed_mip`), or why it has none."""
        try:
            return _fixed_mip(inputs[size][1], flags.get(size, {}), safety, lp_modes.get(size),
                              lp_values=lp_values.get(size), lp_model=lp_models.pop(size, None))
        except PlacementInfeasible as exc:
            return exc

    def polished(size: int, fixed: _Fixed | PlacementInfeasible,
                 leader_seconds: float | None) -> PlacementSolution | PlacementInfeasible | None:
        """`size`'s placement MIP from its fixed plan (`_polished`; None where its polish reads a leader not known
        yet), or why it has none."""
        if isinstance(fixed, PlacementInfeasible):
            return fixed
        try:
            return _polished(inputs[size][1], flags.get(size, {}), lp_modes.get(size), fixed, safety,
                             lp_bound_seconds=bounds[size], leader_seconds=leader_seconds)
        except PlacementInfeasible as exc:
            return exc

    def mip(size: int, leader_seconds: float) -> PlacementSolution | PlacementInfeasible:
        """`size`'s placement MIP (`_solve_mip`: its fixed plan, solved ahead here or by a worker or now, polished
        here), or why it has none."""
        return polished(size, fixed_ahead.pop(size) if size in fixed_ahead else fixed_mip(size), leader_seconds)

    def solved_ahead(size: int, fixed: _Fixed | PlacementInfeasible,
                     plan: PlacementSolution | PlacementInfeasible | None = None) -> None:
        """`size`'s fixed plan, solved before the branch and bound reaches it: its MIP's plan at once (`plan`, where
        a worker polished it), its replays named (`solved_mip`), where its polish reads no leader; else kept for the
        branch and bound to polish."""
        if plan is None:
            plan = polished(size, fixed, None)
        if plan is None:
            fixed_ahead[size] = fixed
            return
        mips_ahead[size] = plan
        if isinstance(plan, PlacementSolution):
            solved_mip(*inputs[size], plan)

    # Note [MIPs while a worker solves an LP]: a size's fixed plan does not depend on the sizes solved before it
    # (Note [a size's MIP in a worker]), so while it waits for what a worker solves, the search solves the fixed
    # plan of a likely size whose vertex it has (the least LP value first), for the branch and bound below to read
    # where it reaches that size (`solved_ahead`: with its replays named where its polish reads no leader), then
    # replays what it named itself (`ReplayMemo.work_here`). Measured (bench/RESULTS.md, session 22, then at
    # POLISH_MAX_BLOCKS blocks or more only): the 512-block ladder rung's search waited 13 s for a value LP (a
    # worker's), the 256-block rung's 4.5 s for a vertex LP. A size the branch and bound does not reach costs its
    # MIP and replays, never a plan.
    def meanwhile() -> bool:
        """One piece of the work above: whether there was one."""
        if not elsewhere:
            return False
        ready = [x for x in lp_models if x in likely and x not in mips_ahead and x not in fixed_ahead]
        if not ready:
            return memo.work_here()
        size = min(ready, key=lambda x: (values.get(x, math.inf), wasted_elements(layouts[x]), x))
        solved_ahead(size, fixed_mip(size))
        return True

    solving: tuple | None = None  # (size, its LP model, its solution): solved while the next one is built
    for size in vertices:
        say(f"chunk size {size}: LP relaxation")
        lp_model = None if size in elsewhere else lp_built(size)
        if solving is not None:
            values[solving[0]] = lp_solved(*solving)
        if size in elsewhere:
            solution = functools.partial(_computed, problem, ("vertex LP and MIP", size, nvme_home), _vertex_mip,
                                         inputs[size][1], safety, meanwhile=meanwhile)
        else:
            solution = lp_model and _beside(jobs, functools.partial(_solved_vertex, lp_model, safety))
        solving = (size, lp_model, solution)
    if solving is not None:
        values[solving[0]] = lp_solved(*solving)
    for key, _, args in unlikely:
        say(f"chunk size {key[1]}: LP relaxation, for its value")
        values[key[1]], bounds[key[1]] = _computed(problem, key, _value_lp, *args, meanwhile=meanwhile)
    # and the LPs of the header's proven bound (`_adam_alone_bound`: read after the replays), named after the MIP
    # plans' replays that the solve may have named by now (Note [a size's MIP in a worker]), which it reads first
    if memo is not None and _proves_alone(problem, _priced_with_copies(problem, [d for _, d in inputs.values()]),
                                          prove_bound):
        # what `_adam_alone_bound` reads where no MIP turns out infeasible
        finite = {x: inputs[x][1] for x in layouts if math.isfinite(bounds[x])}
        memo.ahead(problem, _alone_lps, [(key, None, args) for key, args in
                                         _alone_jobs(problem, finite, bounds, safety, nvme_home=nvme_home)])
    for size, layout in layouts.items():
        candidates.append(Candidate(chunk_elements=size, relaxation_seconds=values[size],
                                    wasted_elements=wasted_elements(layout), chunks=len(layout.chunks)))
    feasible = [c for c in candidates if math.isfinite(c.relaxation_seconds)]
    # Branch and bound over chunk sizes: solve the MIP of the candidates in LP order until the next
    # LP value cannot beat the best plan found; every candidate then has a valid bound (its LP, or
    # the root node of its unpinned MIP), and the smallest of them bounds every plan of the model.
    solved: dict[int, PlacementSolution] = {}
    order = sorted(feasible, key=lambda c: (c.relaxation_seconds, c.wasted_elements, c.chunk_elements))
    for cand in order:
        best = min((x.objective_seconds for x in solved.values()), default=math.inf)
        # the model is optimistic about some plans (the simulator is the judge): the best MIN_MIPS
        # chunk sizes by LP are solved even when their LP cannot beat the best model objective
        if cand.relaxation_seconds >= best * (1 - TIE_TOLERANCE) and len(solved) >= MIN_MIPS:
            break
        size = cand.chunk_elements
        say(f"chunk size {size}: placement MIP")
        if size not in likely and not math.isfinite(solve_lp(size)):
            continue
        named = size in mips_ahead  # its plan's replays named already
        sol = mips_ahead.pop(size) if named else mip(size, best)
        if isinstance(sol, PlacementInfeasible):
            if "no solution within" in str(sol) and not solved:
                raise PlannerError(f"the placement MIP found no integral plan within its node limit "
                                   f"({MIP_NODE_LIMIT} nodes) or --time-limit {time_limit_s:g} s; raise --time-limit "
                                   "or report this trace and hardware") from sol
            if "infeasible" in str(sol):
                bounds[size] = math.inf
            continue
        solved[size] = sol
        if not named:
            solved_mip(*inputs[size], sol)
    # where the LP is loose: the root node of the unpinned MIP (deterministic, node limit 1); only
    # for chunk sizes whose bound can set the header's (the least one), and only where the
    # physical limit does not already close the gap
    best = min((x.objective_seconds for x in solved.values()), default=math.inf)
    lp_bounds = dict(bounds)  # the LPs alone, before any root node (solve_report's fallback)
    rooted: set[int] = set()
    if math.isfinite(best):
        _root_bounds(problem, inputs, bounds, rooted, best, safety, say)
    return candidates, inputs, solved, bounds, flags, lp_modes, lp_bounds, rooted


_Vertex = tuple[PlacementSolution, dict[str, float], dict[str, float]]  # an LP's solution, switches, values
_Fixed = tuple[PlacementSolution, int | None]  # a MIP's fixed plan and its pin set (`_fixed_mip`)
# a size's fixed plan (or why it has none) and its MIP's plan where its polish reads no leader (else None)
_Mip = tuple[_Fixed | PlacementInfeasible, PlacementSolution | PlacementInfeasible | None]


def _solved_vertex(lp_model: SparsePlacementModel, safety: float) -> _Vertex:
    """`lp_model` (an LP to a vertex) solved: its solution, the values of its switches and of every variable (what
    its MIP reads: `_solve_mip`)."""
    lp = lp_model.solve(time_limit_seconds=safety)
    return lp, lp_model.flag_values(), {v.name: float(lp_model.values[v]) for v in lp_model.solver.model.variables()}


# Note [a vertex LP in a worker]:
# The chunk-size search solves the MIN_MIPS likely sizes' LPs to a vertex (their MIPs fix what the LP makes
# integral) and the others' for their value; every value is read before the first MIP. The solved LP model
# of a likely size becomes its MIP (`PlacementModel.as_mip`), so until session 22 every vertex LP was solved in
# the solve's own process, one after another, while a worker solved the value LPs: on the 2-core box the
# search's LPs were its serial part (256 blocks x 4096 on a100-80g-12ssd: 5.5 + 9.0 s of HiGHS, the 512-block
# ladder rung 19.4 + 16.9 s, each after the other). With workers (Note [replays ahead] in planner/replays.py)
# a worker now solves every likely size's LP but the first and ships back what the search reads of it (the
# solution, the switches' and every variable's values: `_Vertex`), while HiGHS solves the first one here. The
# values are those of the same model built from the same input and solved by the same serial IPX, so the schedule
# is the same bytes (tests/test_replays.py, the goldens). The value LPs join the vertex LPs' batch, so the search,
# while a worker solves a vertex it reads, solves a value LP itself. Measured (bench/RESULTS.md, session 22): 256
# blocks 31.5 -> 27.6 wall s. Since session 23 the worker goes on to the size's MIP: Note [a size's MIP in a worker].
#
# Note [a size's MIP in a worker]:
# A size's MIP is LP-integral fixing under the pin sets (`_fixed_mip`, steps 1-3 of `_solve_mip`), which reads
# that size's LP alone, then the polish (`_polished`, step 4), which with one rank also reads the best model
# objective of the sizes the branch and bound solved before it (Note [the polish refines the leader]). So the
# worker that solves a likely size's vertex LP goes on to its fixed plan, on the model it just solved (`as_mip`
# reads no solved state: the MIP is the model the constructor builds, tests/test_mathopt_rows.py), and ships both
# back (`_vertex_mip`); the solve builds no model of that size. While it waits for them, the solve solves its own
# likely size's fixed plan (`meanwhile`). A fixed plan whose polish reads no leader (at POLISH_MAX_BLOCKS blocks or
# more, within the MIP's gap of its LP, modes free at FREE_MODE_POLISH_MAX_BLOCKS blocks or more, several ranks) is
# its size's plan at once, polished where the worker solved it (since session 26: with several ranks the polishes,
# each chunk size's switch releases, were most of a solve, all in the solve's process while the worker idled): its
# replays are named then (`solved_mip`), and the solve replays them while it waits (`ReplayMemo.work_here`); the
# others wait for the branch and bound to polish them. The LPs of the proven bound,
# read last, are named after the search's LPs, behind those replays. The branch and bound reads every plan in the
# order it does with one job: the same bytes (tests/test_replays.py, the goldens). Until session 22 every MIP below
# POLISH_MAX_BLOCKS blocks was solved in the solve's process after every LP, one after the other (GPT-3 13B x
# a100-80g-12ssd: 1.26 + 0.96 s, its first MIP replay at 3.5 s of a 5.3-s solve; GPT-3 175B x rtx4090-768g-12ssd:
# chunk 1812099072's seven fixing MIPs, 2.3 s, none of its plans replayed). Measured: bench/RESULTS.md, session 23.
def _vertex_mip(problem, data: PlacementInput, safety: float) -> tuple[_Vertex, _Mip] | None:
    """In a worker: `data`'s LP built and solved to a vertex (Note [a vertex LP in a worker]), and its MIP's fixed
    plan or why it has none, with the plan polished where its polish reads no leader (Note [a size's MIP in a
    worker]); None where no plan fits."""
    try:
        lp_model = SparsePlacementModel(data, relax=True, lp_solver=LP_SOLVER)
        vertex = _solved_vertex(lp_model, safety)
    except PlacementInfeasible:
        return None
    lp, lp_flags, lp_values = vertex
    try:
        fixed = _fixed_mip(data, lp_flags, safety, lp.activation_modes, lp_values=lp_values, lp_model=lp_model)
    except PlacementInfeasible as exc:
        return vertex, (exc, None)
    try:
        plan = _polished(data, lp_flags, lp.activation_modes, fixed, safety, lp_bound_seconds=lp.bound_seconds,
                         leader_seconds=None)
    except PlacementInfeasible as exc:
        plan = exc
    return vertex, (fixed, plan)


def _value_lp(problem, data: PlacementInput, safety: float) -> tuple[float, float]:
    """(value, bound) of `data`'s LP solved without crossover (Note [the LP of an unlikely chunk size, for its value]);
    (inf, inf) where no plan fits. In a worker where the solve has workers (Note [replays ahead])."""
    try:
        lp = SparsePlacementModel(data, relax=True, lp_solver=BOUND_ONLY).solve(time_limit_seconds=safety)
    except PlacementInfeasible:
        return math.inf, math.inf
    return lp.objective_seconds, lp.bound_seconds


# Note [every size likely with several ranks]:
# With one rank a chunk size whose LP wastes more elements than MIN_MIPS others is rarely reached by the branch and
# bound, so its LP is solved for its value alone (Note [the LP of an unlikely chunk size, for its value]) and to a
# vertex, with its MIP, in the solve's process only where the branch and bound reaches it. With several ranks the
# comm groups make the waste a poor guide (PatrickStar's 4B on 2 x 4 V100: the size that wins, 21285139, was the
# unlikely one), the LPs are small (0.05-0.25 s) and each size's polish, which reads no leader there, is most of
# the solve (5-25 s of switch releases per size): so every size is likely, and with several jobs a worker solves
# every size's vertex, fixed plan and polish but the first's (`_vertex_mip`) while the solve polishes the first.
# The values are then the vertex LPs' (with crossover), with one job too: the same bytes with any number of jobs,
# and, measured, the same bytes as before on the rank ladder and PatrickStar's node (below). Measured
# (bench/RESULTS.md, session 26; 2 jobs, wall s, the 2-core box; with the polishes in the worker and Note [root nodes
# ahead]): pstar-gpt-4b on v100-32g-240g-2x8gpu at 2 / 4 / 8 / 16 ranks 23.9 / 20.8 / 51.9 / 42.8 -> 19.5 / 13.0 /
# 29.9 / 25.3 s; on v100-32g-240g-8gpu 1.3B 0.4 s, 4B 14.5 -> 9.4 s, 12B 19.4 -> 11.0 s, GPT-3 13B 10.7 -> 7.6 s.
def _vertex_first(layouts: dict[int, ChunkLayout], *, ranks: int) -> set[int]:
    """The chunk sizes whose LP is solved to a vertex at once: the MIN_MIPS that waste the fewest elements (Note
    [the LP of an unlikely chunk size, for its value]); with several ranks every size (Note [every size likely with
    several ranks])."""
    if ranks > 1:
        return set(layouts)
    return set(sorted(layouts, key=lambda x: (wasted_elements(layouts[x]), x))[:MIN_MIPS])


def _root_bounds(problem, inputs, bounds: dict[int, float], rooted: set[int], target: float, safety: float,
                 say: Callable[[str], None]) -> None:
    """While the least bound (or the physical limit) is more than ROOT_BOUND_GAP below `target`, the
    unpinned root node's bound for the chunk size whose LP is the least (each size once: `rooted`); with several
    jobs the roots it may read named ahead for an idle worker (Note [root nodes ahead])."""
    physical = lower_bound(problem).seconds
    below = target * (1 - ROOT_BOUND_GAP)
    # only a size whose bound is below `below` is ever rooted (it is the least bound when it is), in this order
    maybe = [] if physical >= below else sorted((x for x in bounds if x not in rooted and bounds[x] < below),
                                                key=lambda x: (bounds[x], x))
    jobs = [(("root node", x, inputs[x][1].param_nvme_home), None, (inputs[x][1], safety)) for x in maybe]
    memo = replays.current()
    named = memo is not None and len(jobs) > 1 and memo.ahead(problem, _root_bound, jobs, spare=True)
    while bounds and max(physical, min(bounds.values())) < below:
        size = min((x for x in bounds if x not in rooted), key=lambda x: (bounds[x], x), default=None)
        if size is None or bounds[size] > min(bounds.values()):
            break  # the least bound is already a root node's
        rooted.add(size)
        say(f"chunk size {size}: root node bound")
        bounds[size] = max(bounds[size], _computed(problem, ("root node", size, inputs[size][1].param_nvme_home),
                                                   _root_bound, inputs[size][1], safety))
    if named:
        memo.drop(problem, [(key, None) for key, _, _ in jobs if key[1] not in rooted])


def _root_bound(problem, data: PlacementInput, safety: float) -> float:
    """`root_bound_seconds` of `data`, perhaps in a worker (Note [root nodes ahead])."""
    return root_bound_seconds(data, time_limit_seconds=safety)


# Note [root nodes ahead]:
# `_root_bounds` computes the root node's bound of one chunk size at a time, the least bound first, until the least
# bound is within ROOT_BOUND_GAP of the target; each root is a HiGHS call of seconds in the solve's process. With
# several jobs, the roots it may compute (each size whose bound is below the line, in its order) are named ahead as
# spare work (`ReplayMemo.ahead(..., spare=True)`: an idle worker takes the first), so that while the solve reads
# one root a worker computes another; the roots it did not read are dropped (a worker on one is killed and forked
# anew). Each root is the same HiGHS call with the same input wherever it runs (node limit 1): the same bound, the
# same bytes with any number of jobs. Measured (bench/RESULTS.md, session 26): PatrickStar's 4B on 2 x 4 V100 (the
# rank ladder's 8-rank rung, 2 jobs), three roots of 5.2, 1.3 and 3.3 s one after another, now 5.2 s in all; the depth
# ladder's 32 blocks (single rank, two roots) the same wall time within the box's noise (three interleaved pairs).


def _replan_for_host(problem, layout, data: PlacementInput, sol: PlacementSolution, lp_flags: dict[str, float],
                     lp_modes: tuple | None, *, size: int, wasted: int, budget: float) -> Evaluated | None:
    """The placement again with HOST smaller by the paced schedule's shortfall (twice at most), paced."""
    for attempt in range(REPLAN_ATTEMPTS):
        decisions = dataclasses.replace(decisions_from_placement(problem, layout, data, sol), pace_optimizer_io=True)
        short = _host_shortfall_bytes(problem, decisions)
        if short <= 0 or short >= data.host_bytes:
            return None
        data = dataclasses.replace(data, host_bytes=data.host_bytes - int(short * 1.01))
        try:
            sol = _solve_mip(data, lp_flags, budget, lp_modes)
        except PlacementInfeasible:
            return None
        decisions = dataclasses.replace(decisions_from_placement(problem, layout, data, sol), pace_optimizer_io=True)
        found = _evaluate(problem, decisions, what=f"placement MIP, chunk size {size}, paced, HOST replanned",
                          chunk_elements=size, wasted=wasted, placement=sol, data=data)
        if found is not None:
            return found
    return None


def _host_shortfall_bytes(problem, decisions) -> int:
    """How many bytes more than its capacity HOST would need for these decisions (0: they fit)."""
    unbounded = dataclasses.replace(problem, host_bytes=10**18)
    try:
        schedule = materialize(unbounded, decisions)
    except PlannerError:
        return 0
    return max(0, schedule.prediction.peak_bytes_per_tier.get(Tier.HOST, 0) - problem.host_bytes)


def _pin_tries(data: PlacementInput, lp_flags: dict[str, float],
               lp_modes: tuple | None) -> list[tuple[dict[str, int], tuple | None]]:
    """The pins in order: switches and (PIN_MODES_BLOCKS blocks or more) modes, switches only, then
    the switches released one at a time, least used by the LP first."""
    pinned = {k: int(v > FLAG_EPSILON) for k, v in lp_flags.items()}
    tries: list[tuple[dict[str, int], tuple | None]] = []
    if lp_modes is not None and len(data.blocks) >= PIN_MODES_BLOCKS:
        tries.append((dict(pinned), lp_modes))
    tries.append((dict(pinned), None))
    for _, name in sorted((v, k) for k, v in lp_flags.items() if pinned[k]):
        pinned[name] = 0
        tries.append((dict(pinned), None))
    return tries


def _solve_mip(data: PlacementInput, lp_flags: dict[str, float], budget: float,
               lp_modes: tuple | None = None, *, lp_values: dict[str, float] | None = None,
               lp_model: SparsePlacementModel | None = None, lp_bound_seconds: float = 0.0,
               leader_seconds: float = math.inf) -> PlacementSolution:
    """The placement MIP, by LP-integral fixing (a relax-and-fix dive, Wolsey 1998 §12.5) under
    pinned mechanism switches and (on traces of PIN_MODES_BLOCKS blocks or more; 175B: 23 s -> 3 s
    of CPU for a model objective 1% higher) activation modes:

    1. take the unpinned LP's values (`lp_values`, from the chunk-size search) or solve the pinned LP;
    2. fix every integer variable whose LP value is integral; HiGHS closes the fractional rest at its
       root (1-5 nodes measured at 32-512 blocks, hidden 4096, bench/bench_depth.py; before, 64
       blocks branched 749 nodes into its time limit among 150-470 fractional counts);
    3. if that leaves no plan, free the chunk classes used within RELEASE_STAGES of a fractional variable;
       then the next pin set (modes released, then the switches one at a time); the pinned MIP
       without fixing is the last resort;
    4. below POLISH_MAX_BLOCKS blocks, the pinned MIP without fixing under POLISH_NODE_LIMIT nodes
       too, and the better of the two (a tie to the pinned MIP's); not with one rank where the modes
       are free at FREE_MODE_POLISH_MAX_BLOCKS blocks or more (the free-mode dense MIP). `lp_model`,
       the unpinned LP of `lp_values` (solved here, or its values by a worker), becomes the first pin set's MIP
       (`PlacementModel.as_mip`: the same model, not built again), and that MIP pinned anew each next one
       (`PlacementModel.repin`).
       No polish where the fixed plan is already within the MIP's own gap (MIP_RELATIVE_GAP) of
       `lp_bound_seconds`, the unpinned LP's bound: Note [no polish within the gap];
       with one rank, none where the fixed plan trails `leader_seconds`, the best model objective of the chunk
       sizes solved before: Note [the polish refines the leader].
    Every HiGHS call stops at its gap or its node limit (`budget` seconds is only the safety net),
    so the plan does not depend on the machine's speed. The solution's bound is the restricted
    model's: no bound of the placement model (planner.solve takes the LP's or the root's)."""
    return _polished(data, lp_flags, lp_modes, _fixed_mip(data, lp_flags, budget, lp_modes, lp_values=lp_values,
                                                          lp_model=lp_model),
                     budget, lp_bound_seconds=lp_bound_seconds, leader_seconds=leader_seconds)


def _fixed_mip(data: PlacementInput, lp_flags: dict[str, float], budget: float, lp_modes: tuple | None, *,
               lp_values: dict[str, float] | None, lp_model: SparsePlacementModel | None) -> _Fixed:
    """Steps 1-3 of `_solve_mip`: the plan LP-integral fixing finds and the index in `_pin_tries` of the pin set
    that found it (None: the last resort, the pinned or unpinned MIP without fixing, which is not polished).
    Depends on the chunk size's LP only, so a worker may solve it (Note [a size's MIP in a worker])."""
    tries = _pin_tries(data, lp_flags, lp_modes) if lp_flags else []
    for k, (flags, modes) in enumerate(tries):
        # the first pin set's MIP is the solved LP (`as_mip`), each next one that MIP pinned anew (`repin`)
        sol = _fixed(data, flags, modes, lp_values, budget, lp_model=lp_model if lp_values is not None else None)
        if sol is not None:
            return sol, k
    for flags, modes in tries:
        try:
            return SparsePlacementModel(data, fixed_flags=flags, fixed_modes=modes).solve(
                time_limit_seconds=budget, node_limit=MIP_NODE_LIMIT), None
        except PlacementInfeasible as exc:
            if "no solution within" in str(exc):
                break
    return SparsePlacementModel(data).solve(time_limit_seconds=budget, node_limit=MIP_NODE_LIMIT), None


def _polished(data: PlacementInput, lp_flags: dict[str, float], lp_modes: tuple | None, fixed: _Fixed, budget: float,
              *, lp_bound_seconds: float, leader_seconds: float | None) -> PlacementSolution | None:
    """Step 4 of `_solve_mip`: the fixed plan, or the pinned MIP's under a node limit where that is better; None
    where that depends on `leader_seconds` and it is None (not known yet: Note [a size's MIP in a worker])."""
    sol, pin = fixed
    if pin is None:
        return sol
    tries = _pin_tries(data, lp_flags, lp_modes)
    flags, modes = tries[pin]
    if len(data.blocks) >= POLISH_MAX_BLOCKS:
        return sol  # too deep to polish
    if sol.objective_seconds * (1 - MIP_RELATIVE_GAP) <= lp_bound_seconds:
        return sol  # Note [no polish within the gap]
    if data.ranks == 1 and modes is None and len(data.blocks) >= FREE_MODE_POLISH_MAX_BLOCKS:
        # modes free (below PIN_MODES_BLOCKS, or the modes' pin was tried and left no fixed plan): a
        # polish would be the free-mode MIP on the dense rows, the cost PIN_MODES_BLOCKS avoids. Measured (175B on
        # a100-80g-12ssd, chunk 605212776, CPU s on the shared 2-core box): 10.4 of the solve's 17.3 s
        # for a plan replaying 118.78 s against the fixed plan's 117.44 s and the chosen 112.85 s;
        # with the fixed plan as a MathOpt solution hint 10.1 s, the same plan; on the sparse rows
        # 16.1 s; modes pinned, infeasible (bench/RESULTS.md "Issue 18: the 175B polish").
        # The several-rank switch releases below keep their polish (measured apart, not here).
        return sol
    if data.ranks == 1:  # Note [the polish refines the leader]
        if leader_seconds is None:
            return None
        if sol.objective_seconds > leader_seconds:
            return sol
    # Fixing can cost a few percent against the pinned MIP where the LP is loose (GPT-3 13B on
    # rtx4090-768g-12ssd: 7.426 s fixed vs 7.279 s pinned, model objective): the pinned MIP
    # under a node limit too, the better plan of the two (ties to the fixed one). On the dense
    # rows: both close at the root within the 1% gap, at different incumbents (175B on
    # a100-80g-12ssd, chunk 605212776: 93.21 s dense, 93.58 s sparse; 7.0 vs 2.3 s CPU)
    try:
        polished = PlacementModel(data, fixed_flags=flags, fixed_modes=modes).solve(
            time_limit_seconds=budget, node_limit=POLISH_NODE_LIMIT, lean_search=True)
    except PlacementInfeasible:
        polished = None
    # a tie goes to the pinned MIP's plan: alternative optima of the model replay differently
    # (pstar-gpt-1b on v100-32g-240g: both 0.524382 s in the model, 0.523796 vs 0.525377 s simulated)
    best = polished if polished is not None and polished.objective_seconds <= sol.objective_seconds else sol
    if data.ranks > 1:
        # With p ranks a switch on costs DEVICE the plan may not use: `any_stream` charges the optimizer
        # stage a streamed step's transient of O + p·P (a whole gathered comm group), where the LP
        # streams a fraction. So the switches the LP turned on are released one at a time too (the
        # later pin sets), polished alike, the best model objective kept (a tie to the earlier). Measured:
        # PatrickStar's 4B on v100-32g-240g-8gpu, packed layout: any_stream pinned 3.644 s, released
        # 3.487 s (model), every OS on DEVICE. One rank keeps the first pin set (its goldens).
        later_tries = tries[pin + 1:]
        # and each switch released alone: the cumulative releases above never turn off only a
        # switch the LP used more (any_sharded_step's transient of p·P where the LP shards a
        # fraction, with any_stream kept: the 4-rank 0.5 GB case of tests/test_placement_ranks.py)
        for name in sorted(k for k, v in flags.items() if v):
            alone = (dict(flags, **{name: 0}), None)
            if alone not in later_tries:
                later_tries.append(alone)
        for later, later_modes in later_tries:
            try:
                other = PlacementModel(data, fixed_flags=later, fixed_modes=later_modes).solve(
                    time_limit_seconds=budget, node_limit=POLISH_NODE_LIMIT, lean_search=True)
            except PlacementInfeasible:
                continue
            if other.objective_seconds < best.objective_seconds * (1 - 1e-9):
                best = other
    return best


# Note [no polish within the gap]:
# Every plan of the pinned MIP, the polish's included, costs at least the unpinned LP's bound (a
# restriction of the model costs no less than its relaxation), so where the fixed plan is within
# MIP_RELATIVE_GAP of that bound no polish can gain more than the gap every MIP solve of the placement
# stops at: HiGHS would prove the fixed plan optimal to its tolerance. Measured (GPT-3 175B x
# rtx4090-768g-12ssd, chunk 605212776, CPU s on the 2-core box, bench/RESULTS.md "s10"): the fixed plan
# 115.004 s against the LP's 114.045 s (0.84%); the polish took 2.28 of the solve's ~10.1 CPU s (HiGHS's
# root node: cuts and a sub-MIP) for a plan 0.43% better in the model and 0.09% in the simulator.
# Where the fixed plan is further off (175B x a100-80g-12ssd, chunk 1812099072: 120.14 s against 109.42 s)
# the polish runs as before. With several ranks the switch releases below are polishes too, skipped alike:
# the rank ladder (pstar-gpt-4b, 1-16 ranks) and the 8 x V100 compares replay the same plans as before.


# Note [the polish refines the leader]:
# The polish is HiGHS's search for a better plan than the fixed one at one chunk size. With one rank it
# runs only where the fixed plan is no worse in the model than the best objective of the chunk sizes
# solved before it (the first size solved always qualifies): it refines the plan the model leads with,
# as the replay variants refine the fastest replays (`_replay_fastest_again`), and a trailing chunk size
# keeps its fixed plan, which is still replayed and judged by the simulator. Measured on the depth ladder's
# 64 blocks x 4096 (a100-80g-12ssd, CPU s on the 2-core box, session 19): chunk 201379840's fixed plan
# 6.682 s trailed chunk 67257720's polished 6.355 s by 5.1%; its polish took 24.1 of the solve's 36.7 s
# (100 nodes on the dense rows, stopped by POLISH_NODE_LIMIT) for 6.665 s, still 4.9% behind; without it
# the solve took 9.9 s for the same plan (6.3824 s replayed). Several ranks keep every polish: there the
# polish is also the switch releases, which gained 4.5% in the model (PatrickStar's 4B, v100-32g-240g-8gpu).
# What it gives up: a trailing size's polished plan can still replay fastest. On the GPT-3 1.3B golden
# (rtx4090-768g-12ssd) chunk 50358272's polished plan had won at 0.557554 s; unpolished it replays 0.609 s, and
# chunk 16818876's plan with its replay variants wins at 0.553960 s (bench/RESULTS.md, session 19).


def _fixed(data: PlacementInput, flags: dict[str, int], modes: tuple | None, lp_values: dict[str, float] | None,
           budget: float, *, lp_model: SparsePlacementModel | None = None) -> PlacementSolution | None:
    """One pin set: fix to the LP's integral values, then release the chunk classes near the fractional
    ones; None when neither leaves a plan. `lp_model` (the unpinned LP of `lp_values`, or the MIP an earlier pin
    set made of it), or else the pinned LP solved here, becomes the MIP."""
    values = lp_values
    if values is None:
        try:
            lp_model = SparsePlacementModel(data, relax=True, fixed_flags=flags, fixed_modes=modes, lp_solver=LP_SOLVER)
            lp_model.solve(time_limit_seconds=budget)
        except PlacementInfeasible:
            return None
        values = {v.name: float(lp_model.values[v]) for v in lp_model.solver.model.variables()}
    # the solved LP becomes the MIP, or the MIP of the previous pin set is pinned anew (PlacementModel.as_mip,
    # .repin: the model the constructor builds, not built again)
    if lp_model is None:
        model = SparsePlacementModel(data, fixed_flags=flags, fixed_modes=modes)
    elif lp_model.relax:
        model = lp_model.as_mip(fixed_flags=flags, fixed_modes=modes)
    else:
        model = lp_model.repin(fixed_flags=flags, fixed_modes=modes)
    ids, names, lo, hi = model.solver.integer_variables()
    fractional = [n for n in names if n in values and abs(values[n] - round(values[n])) > FIX_TOLERANCE]
    skip = set(fractional)
    rounded = np.array([float(round(values[n])) if n in values else math.nan for n in names])
    classes = [_chunk_class_of(n) for n in names]
    outside = ~((lo <= rounded) & (rounded <= hi))  # (a NaN is outside)
    for free_classes in (set(), _chunk_classes_near(data, fractional)):
        free = outside | np.array([n in skip or g in free_classes for n, g in zip(names, classes)], dtype=bool)
        model.solver.set_bounds(ids, np.where(free, lo, rounded), np.where(free, hi, rounded))
        try:
            return model.solve(time_limit_seconds=budget, node_limit=MIP_NODE_LIMIT)
        except PlacementInfeasible as exc:
            log.info("LP-integral fixing (%d fractional, %d chunk classes freed): %s", len(fractional), len(free_classes), exc)
    return None


def _chunk_class_of(name: str) -> int | None:
    """The chunk class id in a per-class variable's name (`keep[g,i]`, `os_host[g]`, ...), else None."""
    if "[" not in name or name.startswith(("act[", "stage_time", "suffix", "checkpoint")):
        return None
    head = name[name.index("[") + 1:].split(",")[0].rstrip("]")
    return int(head) if head.isdigit() else None


def _chunk_classes_near(data: PlacementInput, names: list[str]) -> set[int]:
    """Chunk classes used within RELEASE_STAGES stages of a chunk class that has a fractional variable."""
    hot = {g for g in (_chunk_class_of(k) for k in names) if g is not None}
    stages = {s for g in hot for s in data.chunk_classes[g].use_stages}
    out = set(hot)
    for g in data.chunk_classes:
        if any(abs(s - t) <= RELEASE_STAGES for s in g.use_stages for t in stages):
            out.add(g.id)
    return out


def _least_demanding(inputs: dict[int, tuple[object, PlacementInput]]) -> PlacementInput:
    """The chunk size whose plan needs the least DEVICE (LP relaxation): the one to explain with."""
    def need(size: int) -> float:
        found = minimal_capacity(inputs[size][1], Tier.DEVICE, relax_others=True, relax=True)
        return math.inf if found is None else found[0]

    return inputs[min(sorted(inputs), key=need)][1]


def _notes(candidates: list[Candidate], chosen: Evaluated, evaluated: list[Evaluated],
           unreplayed: list[tuple[str, float]], relaxation: float, physical: float) -> tuple[str, ...]:
    sizes = ", ".join(f"{c.chunk_elements}: {c.relaxation_seconds:.6g} s" if math.isfinite(c.relaxation_seconds)
                      else f"{c.chunk_elements}: does not fit" for c in candidates)
    replays = ", ".join(f"{e.what}: {e.simulated_seconds:.6g} s" for e in evaluated)
    out = [f"placement LP per chunk size ({sizes}); LP bound {relaxation:.6g} s, physical bound {physical:.6g} s",
           f"simulated plans ({replays})"]
    if unreplayed:
        out.append("not replayed, the work they fix alone slower than a replay above (planner.bounds.decisions_bound): "
                   + ", ".join(f"{what}: at least {bound:.6g} s" for what, bound in unreplayed))
    out.append(f"chosen: {chosen.what} (simulated {chosen.simulated_seconds:.6g} s)")
    if chosen.placement is not None:
        sol = chosen.placement
        out.append(f"placement MIP ({sol.solver}): {sol.status.value}, model objective {sol.objective_seconds:.6g} s")
    return tuple(out) + tuple(chosen.schedule.header.notes)


__all__ = ["Candidate", "SolveReport", "build_schedule", "decisions_from_placement", "reference_decisions", "solve",
           "solve_report"]
