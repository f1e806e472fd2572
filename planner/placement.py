"""Global placement (DESIGN.md §4.2): where PARAM chunks, optimizer state and activations live per stage.

One mixed-integer model over the stages of an iteration (forward / backward of each block, the
optimizer), solved through OR-Tools' linear solver wrapper: HiGHS for the integer model, GLOP or
(planner.solve's chunk-size search) HiGHS's interior point for its relaxation (the DESIGN.md hint:
the LP of this shape is tight and fast; CP-SAT is not).
`PlacementModel` owns the variables; its memory rows, time rows and solution extraction live in
`planner.placement_memory`, `planner.placement_time` and `planner.placement_solution`. The model's
input (chunk classes, blocks, stages) is built in `planner.placement_input`; the solver calls go
through `planner.mathopt_solver`. Why it looks as it does: Note [placement chunk classes] (above
`PlacementModel`) and Note [placement mechanism switches] (above `_flag`) here;
Note [placement cost model] and Note [placement data flow] in `placement_time.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ortools.math_opt.python import mathopt

from planner.mathopt_solver import MathOptSolver
from planner.placement_input import BlockData, ChunkClass, PlacementInput, StageData, chunk_class_summary, placement_input
from planner.placement_terms import (
    ACT_MODES,
    INFINITE_BYTES,
    LOOKAHEAD_BUDGET,
    LOOKAHEAD_STAGES,
    MIP_RELATIVE_GAP,
    SECONDARY_TERMS,
    SECONDARY_WEIGHT,
    TIME_UNIT,
    Gap,
    act_windows,
    chunk_class_gaps,
    is_zero,
    scaled_input,
    stage_runs,
)
from planner.placement_memory import MemoryRows
from planner.placement_solution import PlacementAbove, PlacementInfeasible, PlacementSolution, SolutionExtraction
from planner.placement_time import TimeRows
from schemas.schedule import ActivationMode, Tier


# Note [placement chunk classes]:
# Chunks that are touched by exactly the same stages are interchangeable, so they are aggregated into
# a *chunk class* and the model counts them instead of carrying one boolean per chunk: between two uses of
# a chunk class, `keep[g,i]` chunks stay on DEVICE and `incoming[g,i,k]` arrive in the k-th stage before
# the next use (how many PARAM chunks of g are on DEVICE in stage s, `resident[g][s]` of the
# solution, follows). 175B stays a few thousand rows; every row is sparse (running sums), which
# is what keeps the simplex fast.



class PlacementModel(MemoryRows, TimeRows, SolutionExtraction):
    """The aggregated placement MIP (or its LP relaxation) of one PlacementInput.

    Per chunk class g (count_g interchangeable chunks) and gap i between two uses (DESIGN.md §8.7 names):
      keep[g,i]        chunks that stay on DEVICE through the gap (the rest leave after the use)
      incoming[g,i,k]  chunks arriving during the k-th lookahead stage before the next use
      refresh[g,k]     kept chunks re-uploaded in place after the CPU Adam rewrote them (wrap gap)
      on_demand[g,i]   chunks fetched at the next use itself (no room to prefetch; the use waits)
      persistent[g]    chunks that never leave DEVICE (<= every keep, >= os_device; >= os_device - os_sharded with p ranks)
      param_nvme[g]    chunks whose PARAM lives on NVME, not HOST (fetched through HOST at every use)
      os_device[g] + os_host[g] + os_nvme[g] = count_g (trainable)
      os_sharded[g]    (p > 1) of the os_device ones, those not persistent (persistent + os_sharded >= os_device)
    Per block: act[b,mode] in {0,1}, one mode. Per stage: stage_time[s].
    During a use stage all of the class's chunks are on DEVICE; between uses the kept ones plus
    those that already arrived: resident[g,s] is derived, never a variable of its own.
    """

    def __init__(self, data: PlacementInput, *, relax: bool = False, capacity_variable: Tier | None = None,
                 lp_solver: str = "GLOP", lookahead: int | None = None, feasibility: bool = False,
                 fixed_flags: dict[str, int] | None = None,
                 fixed_modes: Sequence[ActivationMode] | None = None, late_arrivals: bool = True) -> None:
        self.original = data
        self.with_late_arrivals = late_arrivals  # Note [late arrivals] in planner.placement_time
        self.fixed_modes = tuple(fixed_modes) if fixed_modes is not None else None
        self.flags: dict[str, Any] = {}
        self.integral: list[Any] = []  # the variables that are integers in the MIP (`as_mip`)
        self.fixed_flags = dict(fixed_flags or {})
        # rows mixing 1e11 bytes and 0.1 s stall the simplex: the model works in MiB and milliseconds
        self.data = scaled_input(data)
        self.relax = relax
        # prefetch depth: every stage of a gap for small models, fewer for big ones (model size)
        self.lookahead = lookahead if lookahead is not None else max(LOOKAHEAD_STAGES, LOOKAHEAD_BUDGET // max(1, len(data.chunk_classes)))
        # minimal-capacity mode: the capacity of one tier becomes a variable and the objective
        self.capacity_variable = capacity_variable
        self.solver = MathOptSolver(lp_solver if relax else "HIGHS")
        self.solver_name = self.solver.name
        self._add_variables()
        self._add_memory_constraints()
        if feasibility:  # only the memory rows decide whether a plan exists: no time rows, no objective
            self.channels = self._channel_exprs()  # for the solution's bytes per channel
            return
        self._add_time_constraints()
        self._add_objective()

    # -- variables -----------------------------------------------------------------------

    def _int(self, lo: float, hi: float, name: str) -> Any:
        v = self.solver.NumVar(lo, hi, name) if self.relax else self.solver.IntVar(lo, hi, name)
        self.integral.append(v)
        return v

    def _bool(self, name: str) -> Any:
        v = self.solver.NumVar(0, 1, name) if self.relax else self.solver.BoolVar(name)
        self.integral.append(v)
        return v

    def as_mip(self, *, fixed_flags: dict[str, int] | None = None,
               fixed_modes: Sequence[ActivationMode] | None = None) -> PlacementModel:
        """This relaxation (unpinned, or pinned as asked; solved or not: no solved state is read) turned into the
        MIP that `type(self)(data, fixed_flags=..., fixed_modes=...)` builds (integrality switched on, switches
        and modes pinned) instead of building that MIP again: the same model bit for bit
        (tests/test_mathopt_rows.py), so the same plan. 256 blocks x 4096: a build is ~0.5 s of the
        solve's CPU, one per MIP."""
        modes = tuple(fixed_modes) if fixed_modes is not None else None
        assert self.relax and ((not self.fixed_flags and self.fixed_modes is None)
                               or (self.fixed_flags == dict(fixed_flags or {}) and self.fixed_modes == modes)), \
            "a relaxation pinned otherwise"
        self.relax = False
        self.solver.use("HIGHS")
        self.solver_name = self.solver.name
        for v in self.integral:
            v.integer = True
        if not self.fixed_flags and self.fixed_modes is None:
            # the integer variables' bounds as built, unpinned: what `repin` restores
            self._built_bounds = [(v.lower_bound, v.upper_bound) for v in self.integral]
        return self._pin(fixed_flags, modes if modes is not None else self.fixed_modes)

    def repin(self, *, fixed_flags: dict[str, int] | None = None,
              fixed_modes: Sequence[ActivationMode] | None = None) -> PlacementModel:
        """This MIP (`as_mip`'s) with every integer variable's bounds as built, whatever was fixed since, and the
        switches and modes pinned anew: the MIP `type(self)(data, fixed_flags=..., fixed_modes=...)` builds, not
        built again (pins are bounds only; tests/test_mathopt_rows.py). planner.solve's next pin set after one
        that left no plan (GPT-3 175B x rtx4090-768g-12ssd, chunk 1812099072: three such builds, ~0.4 CPU s each)."""
        assert not self.relax and hasattr(self, "_built_bounds"), "repin a MIP made by as_mip"
        for v, (lo, hi) in zip(self.integral, self._built_bounds):
            v.lower_bound, v.upper_bound = lo, hi
        return self._pin(fixed_flags, fixed_modes)

    def _pin(self, fixed_flags: dict[str, int] | None, fixed_modes: Sequence[ActivationMode] | None) -> PlacementModel:
        """Pin the switches and the modes (the bounds the constructor gives them with these pins)."""
        self.fixed_flags = dict(fixed_flags or {})
        for name, v in self.flags.items():
            self._pin_flag(name, v)
        self.fixed_modes = tuple(fixed_modes) if fixed_modes is not None else None
        for i, (b, choice) in enumerate(zip(self.data.blocks, self.act)):
            self._pin_modes(i, b, choice)
        return self

    # Note [placement mechanism switches]:
    # Mechanism switches (`any_stream`, `any_nvme_stream`, `any_nvme_os`, `any_nvme_param`: some chunk
    # uses the mechanism, which reserves its staging room) are big-M binaries that make the relaxation
    # weak; `fixed_flags` pins them (planner.solve pins them to the rounded LP and, on big traces, the
    # activation modes too), which is what keeps the 175B MIP at seconds instead of its time limit.
    # The model is optimistic where the SSDs' FIFO and the CPU's pace interact (it charges transfers per
    # stage, the simulator queues them): planner.solve therefore replays every plan in the simulator.
    # Note [sharded DEVICE steps]:
    # With one rank a chunk whose OS lives on DEVICE keeps its PARAM there (`persistent >= os_device`):
    # the step writes it in place and nothing else holds it. With p ranks "persistent" keeps the
    # gathered comm group, p chunks of PARAM, on every rank for the whole iteration, where the step
    # needs the owner's 1/p only. ZeRO-3 with its optimizer state on the GPU keeps only the partition
    # (DeepSpeed docs/code-docs/source/zero3.rst: stage 1 "each process updates only its partition",
    # stage 3 partitions the 16-bit params and "will automatically collect and partition them during
    # the forward and backward passes": `partitioned_param_coordinator.py` fetch_sub_module /
    # release_sub_module); PatrickStar §7 gathers a comm group for its use and releases the remote
    # chunks after it. Here such a comm group
    # (`os_sharded`) is materialize's non-persistent PARAM entry with a DEVICE step, the path the
    # streamed OS already takes (planner.device_cache, planner.emit._device_step): fetched (local
    # chunk H2D, then ALL_GATHER) for its uses, its owner's chunk up for the step in the optimizer
    # stage and written back after it (HOST holds the local chunk between uses). Not built: keeping
    # the local chunk on DEVICE between uses (`keep_local`, docs/rank-aware-placement.md §2).
    def _flag(self, name: str) -> Any:
        """A 0/1 switch of a whole mechanism (any chunk streamed, any OS on NVME, ...): the big-M rows
        behind it are what makes the relaxation weak and the MIP slow, so `fixed_flags` may pin it
        (solve pins them to the rounded LP values: a HiGHS MIP of 175B went from > 60 s to 3 s)."""
        v = self._bool(name)
        self.flags[name] = v
        self._pin_flag(name, v)
        return v

    def _pin_flag(self, name: str, v: Any) -> None:
        if name in self.fixed_flags:
            v.lower_bound = v.upper_bound = float(self.fixed_flags[name])

    def flag_values(self) -> dict[str, float]:
        """The solved values of the mechanism switches (after `solve`)."""
        return {k: self._value(v) for k, v in sorted(self.flags.items())}

    def _add_variables(self) -> None:
        d, n = self.data, len(self.data.stages)
        inf = self.solver.infinity()
        self.stage_time = [self.solver.NumVar(0, inf, f"stage_time[{s}]") for s in range(n)]
        self.gaps: list[tuple[Gap, ...]] = []
        self.keep: list[list[Any]] = []
        self.incoming: list[list[list[Any]]] = []  # [g][gap][k] aligned with gap.lookahead
        self.refresh: list[list[Any]] = []  # [g][k] aligned with the wrap gap's lookahead
        self.persistent, self.os_device, self.os_host, self.os_nvme, self.os_stream = [], [], [], [], []
        self.os_nvme_stream: list[Any] = []  # [g] OS on NVME streamed NVME -> HOST -> DEVICE for GPU Adam
        self.os_sharded: list[Any] = []  # [g] (p > 1) DEVICE-stepped comm groups not persistent: Note [sharded DEVICE steps]
        # [g] (p > 1) comm groups whose grads are reduce-scattered per bucket: Note [reduce-scatter per bucket]
        # in planner/device_cache.py (0 where every chunk of the comm group is final in one stage)
        self.rs_bucket: list[Any] = []
        self.param_nvme: list[Any] = []  # [g] PARAM chunks whose home is NVME (fetched through HOST every use)
        self.nvme_incoming: list[list[list[Any]]] = []  # [g][gap][k] the part of incoming[g,gap,k] read from NVME
        self.on_demand: list[list[Any]] = []  # [g][gap] chunks fetched at the next use itself (no prefetch room)
        self.nvme_on_demand: list[list[Any]] = []  # [g][gap] the part of on_demand read from NVME
        for g in d.chunk_classes:
            gaps = chunk_class_gaps(g, n, d.optimizer_stage, d.optimizer_overlap, self.lookahead)
            self.gaps.append(gaps)
            pers = self._int(0, g.count, f"persistent[{g.id}]")
            n_os = g.count if g.trainable else 0
            od = self._int(0, n_os, f"os_device[{g.id}]")
            oh = self._int(0, n_os, f"os_host[{g.id}]")
            on = self._int(0, n_os if d.has_nvme else 0, f"os_nvme[{g.id}]")
            # OS on HOST, streamed to the DEVICE for GPU Adam in the optimizer stage (and back): beats
            # CPU Adam where the CPU optimizer, not the link, is the bottleneck
            st = self._int(0, n_os if d.stream_optimizer else 0, f"os_stream[{g.id}]")
            # OS on NVME streamed through HOST to the DEVICE for GPU Adam (and back): what frees the
            # largest models from the CPU optimizer rate when HOST cannot hold their OS
            sn = self._int(0, n_os if (d.stream_optimizer and d.has_nvme) else 0, f"os_nvme_stream[{g.id}]")
            self.persistent.append(pers)
            self.os_device.append(od)
            self.os_host.append(oh)
            self.os_nvme.append(on)
            self.os_stream.append(st)
            self.os_nvme_stream.append(sn)
            self.solver.Add(od + oh + on + st + sn == n_os, f"os_all[{g.id}]")
            # PARAM homed on NVME (Fuyou's layout: frees the HOST copy, costs an SSD read per fetch):
            # only chunks that leave DEVICE and, when trainable, step on the CPU (materialize reads
            # them from NVME for the step and writes them back)
            pn = self._int(0, g.count if (d.has_nvme and d.param_nvme_home) else 0, f"param_nvme[{g.id}]")
            self.solver.Add(pn + pers + st + sn <= g.count, f"param_nvme_room[{g.id}]")
            self.param_nvme.append(pn)
            # GPU Adam needs PARAM and GRAD on DEVICE at the optimizer step: such chunks stay
            if d.ranks == 1 or not g.trainable:
                self.solver.Add(pers >= od, f"os_device_persistent[{g.id}]")
                self.os_sharded.append(0)
            else:
                # with p ranks a DEVICE-stepped comm group need not stay gathered (Note [sharded
                # DEVICE steps]): os_sharded of them are gathered for their uses only
                sh = self._int(0, n_os, f"os_sharded[{g.id}]")
                self.solver.Add(sh <= od, f"os_sharded_device[{g.id}]")
                self.solver.Add(pers + sh >= od, f"os_device_persistent[{g.id}]")
                self.os_sharded.append(sh)
            # continuous: bucketing more comm groups only frees DEVICE (and adds a chunk's bytes of INTER_GPU per
            # comm group), so the extraction rounds it up (`PlacementSolution.rs_buckets`) and the MIP branches
            # on nothing new
            self.rs_bucket.append(self.solver.NumVar(0, g.count, f"rs_bucket[{g.id}]") if g.bucket_held_chunks else 0)
            keeps, incs, refresh, nincs, dems, ndems = [], [], [], [], [], []
            for i, gap in enumerate(gaps):
                keep = self._int(0, g.count, f"keep[{g.id},{i}]")
                inc = [self._int(0, g.count, f"incoming[{g.id},{i},{k}]") for k in range(len(gap.lookahead))]
                # fetched when the work needs them (materialize's FETCH): no DEVICE room before the
                # use, but the work waits for the copy (a serial row of the use stage)
                dem = self._int(0, g.count, f"on_demand[{g.id},{i}]")
                self.solver.Add(keep >= pers, f"keep_persistent[{g.id},{i}]")
                self.solver.Add(keep + sum(inc) + dem == g.count, f"arrive[{g.id},{i}]")
                ninc: list[Any] = []
                ndem: Any = 0
                if pn.upper_bound > 0:
                    # NVMe-homed chunks are fetched for every use (through HOST): they are part of the
                    # arrivals (continuous split: which arrivals they are is materialize's choice)
                    ninc = [self.solver.NumVar(0, g.count, f"nvme_incoming[{g.id},{i},{k}]") for k in range(len(gap.lookahead))]
                    for k, x in enumerate(ninc):
                        self.solver.Add(x <= inc[k], f"nvme_incoming_part[{g.id},{i},{k}]")
                    ndem = self.solver.NumVar(0, g.count, f"nvme_on_demand[{g.id},{i}]")
                    self.solver.Add(ndem <= dem, f"nvme_on_demand_part[{g.id},{i}]")
                    self.solver.Add(sum(ninc) + ndem == pn, f"nvme_incoming_all[{g.id},{i}]")
                nincs.append(ninc)
                dems.append(dem)
                ndems.append(ndem)
                if gap.wraps and g.trainable:
                    # the CPU Adam rewrote the HOST copy: kept chunks without GPU Adam are stale and
                    # are uploaded again in place before the next forward uses them. A GPU step (OS on
                    # DEVICE or streamed) updates the DEVICE copy itself: at least keep - (GPU-stepped) are stale
                    refresh = [self._int(0, g.count, f"refresh[{g.id},{k}]") for k in range(len(gap.lookahead))]
                    self.solver.Add(sum(refresh) >= keep - od - st - sn, f"stale_after_step[{g.id}]")
                keeps.append(keep)
                incs.append(inc)
            if not gaps:  # never touched by forward/backward work: only the persistent ones are on DEVICE
                keeps.append(pers)
            self.keep.append(keeps)
            self.incoming.append(incs)
            self.nvme_incoming.append(nincs)
            self.on_demand.append(dems)
            self.nvme_on_demand.append(ndems)
            self.refresh.append(refresh)
        self.act = [{m: self._bool(f"act[{b.id},{m.value}]") for m in ACT_MODES} for b in d.blocks]
        for i, (b, choice) in enumerate(zip(d.blocks, self.act)):
            self.solver.Add(sum(choice.values()) == 1, f"one_mode[{b.id}]")
            self._pin_modes(i, b, choice)
        # RECOMPUTE blocks' inputs (checkpoints) offloaded to HOST: one global choice (materialize's
        # Decisions.checkpoint_tier); ckpt_block[b] = act[b,RECOMPUTE] AND ckpt, linearized
        self.ckpt: Any = 0
        self.ckpt_block: list[Any] = [0] * len(d.blocks)
        if d.checkpoint_offload:
            self.ckpt = self._bool("checkpoint_offload")
            for i, (b, choice) in enumerate(zip(d.blocks, self.act)):
                if b.forward_stage < 0 or b.backward_stage < 0:
                    continue
                z = self.solver.NumVar(0, 1, f"checkpoint_offloaded[{b.id}]")
                r = choice[ActivationMode.RECOMPUTE]
                self.solver.Add(z <= r, f"ckpt_r[{b.id}]")
                self.solver.Add(z <= self.ckpt, f"ckpt_g[{b.id}]")
                self.solver.Add(z >= r + self.ckpt - 1, f"ckpt_and[{b.id}]")
                self.ckpt_block[i] = z
        self.capacity = None
        if self.capacity_variable is not None:
            self.capacity = self.solver.NumVar(0, inf, f"capacity[{self.capacity_variable.value}]")

    def _pin_modes(self, i: int, b: BlockData, choice: dict[ActivationMode, Any]) -> None:
        """Block i's mode bounds: pinned to `fixed_modes` (solve: the LP's choice on big traces), no
        SWAP_NVME without SSDs, only KEEP for a block without forward or backward."""
        if self.fixed_modes is not None:
            for m, v in choice.items():
                v.lower_bound = v.upper_bound = 1.0 if m is self.fixed_modes[i] else 0.0
        if not self.data.has_nvme:
            choice[ActivationMode.SWAP_NVME].upper_bound = 0
        if b.forward_stage < 0 or b.backward_stage < 0:  # no forward or no backward: nothing to plan
            for m in ACT_MODES[1:]:
                choice[m].upper_bound = 0


class SparsePlacementModel(PlacementModel):
    """PlacementModel with the DEVICE rows kept sparse: the same model, reformulated (planner.solve
    builds its MIP and, on HiGHS's interior point, its LP on it, see below).

    Measured (bench/bench_depth.py, hidden 4096, chunk 67257720 elements): the DEVICE rows held
    20,916 nonzeros over 520 rows at 128 blocks and 74,548 over 1,032 at 256 (40 -> 72 per row:
    quadratic in depth), half of the model's nonzeros. The cause: a chunk arriving in stage k
    counts in every DEVICE row from k to its use, and the wrap gap's arrivals in the optimizer
    stage (updated params coming back up) stay until the block's forward in the next iteration,
    so the forward stage s row carries one term per block after s. Here those intervals go
    through running sums (`_interval_sums`, as the kept chunks already do): O(1) terms per row
    (75,315 instead of 138,781 nonzeros at 256 blocks, build 1.07 instead of 1.74 s). GLOP needs
    twice the pivots on it (18,836 vs 9,234); HiGHS's interior point is faster on it (512 blocks:
    7.8 s against 12.6 s CPU on the dense rows, Note [the placement LP on HiGHS's interior point]
    in planner/mathopt_solver.py), which is how planner.solve solves its LP.
    """

    ARRIVALS_AS_RUNNING_SUMS = True

    def _build_memory_terms(self) -> None:
        super()._build_memory_terms()
        n = len(self.data.stages)
        items: list[tuple[int, int, Any]] = []
        for gi, g in enumerate(self.data.chunk_classes):
            for i, gap in enumerate(self.gaps[gi]):
                pos = {s: j for j, s in enumerate(gap.stages)}
                for k, s_in in enumerate(gap.lookahead):
                    for first, last in stage_runs(gap.stages[pos[s_in]:]):
                        items.append((first, last, self.incoming[gi][i][k] * (g.param_bytes * self.data.ranks)))
        running = self._interval_sums("arrived_params", items)
        self.arrived = [[running[s]] if not is_zero(running[s]) else [] for s in range(n)]


def root_bound_seconds(data: PlacementInput, *, time_limit_seconds: float = 120.0) -> float:
    """A valid lower bound of the unpinned placement model, tighter than its LP: the dual bound of
    HiGHS's root node (cuts included), node limit 1 so that it does not depend on the machine's
    speed (the time limit is a safety net: a root stopped by it may return a weaker bound, never an
    invalid one). Measured at 32 blocks (hidden 4096, a100-80g-12ssd, chunk 67257720,
    bench/bench_depth.py): LP 2.1194 s, root 2.2164 s. 0.0 when HiGHS stops without a bound."""
    # without the late-arrival rows (a model with fewer rows: its bound is still a bound): with them the
    # root of GPT-3 13B x rtx4090-768g-12ssd took 9.4 instead of 2.9 s CPU (bench/bench_stage_gap.py)
    model = PlacementModel(data, late_arrivals=False)
    try:
        result = model.solver.solve(time_limit_seconds=time_limit_seconds, relative_gap=MIP_RELATIVE_GAP, node_limit=1)
    except Exception:  # numerical trouble reported as a status error: no bound
        return 0.0
    bound = result.termination.objective_bounds.dual_bound
    if not math.isfinite(bound):
        return 0.0
    return max(0.0, bound / (1 + SECONDARY_TERMS * SECONDARY_WEIGHT) * TIME_UNIT)


def solve_placement(data: PlacementInput, *, relax: bool = False, time_limit_seconds: float = 60.0) -> PlacementSolution:
    """Build and solve the placement model (raises PlacementInfeasible)."""
    return PlacementModel(data, relax=relax).solve(time_limit_seconds=time_limit_seconds)


def placement_feasible(data: PlacementInput, *, relax: bool = True, time_limit_seconds: float = 30.0) -> bool | None:
    """Does the model have a solution at the capacities of `data`? Memory rows only (the time rows
    never make it infeasible). With relax (the LP) a False is proof that no integral plan exists;
    a True is only necessary. None: undecided within the time limit."""
    model = PlacementModel(data, relax=relax, feasibility=True)
    try:
        result = model.solver.solve(time_limit_seconds=time_limit_seconds, relative_gap=1.0)
    except Exception:  # numerical trouble reported as a status error: undecided
        return None
    reason = result.termination.reason
    if reason in (mathopt.TerminationReason.INFEASIBLE, mathopt.TerminationReason.INFEASIBLE_OR_UNBOUNDED):
        return False
    return True if result.has_primal_feasible_solution() else None


def minimal_capacity(data: PlacementInput, tier: Tier, *, relax_others: bool, relax: bool = False,
                     time_limit_seconds: float = 5.0) -> tuple[int, int] | None:
    """The smallest capacity of `tier` with which the model is feasible, and the stage that needs it.

    With relax_others the other tiers are unbounded (what this tier needs on its own); otherwise
    they keep their capacities. None when no capacity of this tier helps. When the MIP stops at
    its time limit the best capacity found is returned: it works, it may not be the smallest.
    """
    probe = data
    if relax_others:
        for other in Tier:
            if other is not tier:
                probe = probe.with_capacity(other, INFINITE_BYTES)
    model = PlacementModel(probe, capacity_variable=tier, relax=relax)
    try:
        sol = model.solve(time_limit_seconds=time_limit_seconds)
    except PlacementInfeasible:
        return None
    need = int(math.ceil(model.capacity_value() - 1e-6))
    if tier is Tier.DEVICE:
        per_stage = sol.device_bytes_per_stage
    elif tier is Tier.HOST:
        per_stage = sol.host_bytes_per_stage
    else:
        return need, -1
    stage = max(range(len(per_stage)), key=lambda s: (per_stage[s], -s))
    return need, stage


__all__ = [
    "ACT_MODES", "INFINITE_BYTES", "MIP_RELATIVE_GAP", "BlockData", "ChunkClass", "PlacementAbove", "PlacementInfeasible", "PlacementInput",
    "PlacementModel", "act_windows", "chunk_class_gaps",
    "PlacementSolution", "SparsePlacementModel", "StageData", "chunk_class_summary", "minimal_capacity", "placement_feasible", "placement_input",
    "root_bound_seconds", "solve_placement",
]
