"""Global placement (DESIGN.md §4.2): where PARAM chunks, optimizer state and activations live per stage.

One mixed-integer model over the stages of an iteration (forward / backward of each block, the
optimizer), solved through OR-Tools' linear solver wrapper: HiGHS for the integer model, GLOP for
its relaxation (the DESIGN.md hint: the LP of this shape is tight and fast; CP-SAT is not).

Chunks that are touched by exactly the same stages are interchangeable, so they are aggregated into
a *group* and the model counts them instead of carrying one boolean per chunk: between two uses of
a group, `keep[g,i]` chunks stay on DEVICE and `incoming[g,i,k]` arrive in the k-th stage before
the next use (how many PARAM chunks of g are on DEVICE in stage s, `resident[g][s]` of the
solution, follows). 175B stays a few thousand rows; every row is sparse (running sums), which
is what keeps the simplex fast.

The cost model is Fuyou's (§4.5, Eq. 2 and 5) applied per stage: a stage lasts as long as its
busiest channel, and the iteration is the sum of the stages:

    T_s >= compute_s + recompute_s (+ GPU Adam in the optimizer stage)
    T_s >= H2D bytes_s / BW_H2D            T_s >= D2H bytes_s / BW_D2H
    T_s >= NVMe reads_s / BW_read + NVMe writes_s / BW_write        (an SSD is simplex, Eq. 4)
    sum_{s' >= s} T_s' >= CPU Adam work released at or after s       (Fuyou §4.3: the CPU optimizer
                                                                      overlaps backward, in order)
Data flow per chunk (what the time rows charge):
- a PARAM chunk that must be on DEVICE in stage s+1 and is not in stage s arrives during stage s
  (prefetch, `incoming[g,s]`): it costs H2D time in s and DEVICE memory in s (double buffering);
- grads of chunks whose Adam runs on the CPU go D2H in their last backward stage; their updated
  params (HOST copy) must come up again before the next forward uses them (stale DEVICE copies);
- chunks whose optimizer state lives on DEVICE run GPU Adam and keep params and grads on DEVICE;
- OS on HOST or NVME may instead be streamed to the DEVICE for GPU Adam in the optimizer stage
  (OS, PARAM and GRAD up, OS and PARAM down; from NVME also read from and written back to the
  SSDs, two chunks of it staged on HOST): what frees the largest models from the CPU optimizer
  (175B: 116 s of CPU Adam at 1.5e9 params/s) when HOST cannot hold their OS;
- OS on NVME is read and written once per iteration by the CPU Adam (no grads through the SSDs
  thanks to the overlap, Fuyou §4.3); when the CPU falls behind backward, the grads it has not
  reached wait on HOST into the optimizer stage (a row of their own, `cpu_optimizer_lag`);
- PARAM homed on NVME (Fuyou's layout, for models whose PARAM copies do not fit on HOST): read
  from the SSDs for every fetch (staged on HOST until the use) and for its CPU step, written back
  after it; a chunk fetched on demand (at its use, no room to prefetch) makes the use wait;
- activations: KEEP holds the block's saved bytes on DEVICE until its backward; RECOMPUTE keeps
  only the input and reruns the forward in backward; SWAP_HOST / SWAP_NVME move them out in the
  stage after the forward and back in the stage before the backward (Fuyou §4.4 pipelining).

The model's input (chunk classes, blocks, stages) is built in `planner.placement_input`; the solver
calls go through `planner.mathopt_solver`.

The non-model curve (`MomentRef.non_model_bytes`, recorded with every activation kept) is the
baseline of DEVICE memory; activation plans subtract what they free.

Mechanism switches (`any_stream`, `any_nvme_stream`, `any_nvme_os`, `any_nvme_param`: some chunk
uses the mechanism, which reserves its staging room) are big-M binaries that make the relaxation
weak; `fixed_flags` pins them (planner.solve pins them to the rounded LP and, on big traces, the
activation modes too), which is what keeps the 175B MIP at seconds instead of its time limit.
The model is optimistic where the SSDs' FIFO and the CPU's pace interact (it charges transfers per
stage, the simulator queues them): planner.solve therefore replays every plan in the simulator.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from ortools.math_opt.python import mathopt

from planner.mathopt_solver import MathOptSolver
from planner.placement_input import BlockData, GroupData, PlacementInput, StageData, group_summary, placement_input
from schemas._base import frozen
from schemas.schedule import ActivationMode, SolverStatus, Tier

log = logging.getLogger(__name__)

ACT_MODES = (ActivationMode.KEEP, ActivationMode.RECOMPUTE, ActivationMode.SWAP_HOST, ActivationMode.SWAP_NVME)
INFINITE_BYTES = 10**18  # capacity used when a tier is "unbounded" (minimal-capacity searches)


# ----------------------------------------------------------------------------- solution


@frozen
class PlacementSolution:
    """The solved placement, per group / block / stage."""

    status: SolverStatus
    objective_seconds: float  # sum of stage times of this solution
    bound_seconds: float  # the solver's proven lower bound for this model
    relaxed: bool  # LP relaxation (fractional counts): a bound, not a plan
    resident: tuple[tuple[float, ...], ...]  # [group][stage] PARAM chunks on DEVICE
    incoming: tuple[tuple[float, ...], ...]  # [group][stage] PARAM chunks arriving during the stage
    persistent: tuple[float, ...]  # [group] chunks that never leave DEVICE
    os_counts: tuple[dict[str, float], ...]  # [group] chunks with OS on DEVICE / HOST / NVME
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
    param_nvme: tuple[float, ...] = ()  # [group] PARAM chunks homed on NVME (materialize's param_home_tiers)

    @property
    def gap(self) -> float:
        if self.objective_seconds <= 0:
            return 0.0
        return max(0.0, (self.objective_seconds - self.bound_seconds) / self.objective_seconds)


class PlacementInfeasible(Exception):
    """The model has no solution at the given capacities (explained by planner.bounds)."""


# ----------------------------------------------------------------------------- the model


def act_windows(b: BlockData, n_stages: int) -> tuple[range, range, int, int]:
    """(recompute savings stages, swap savings stages, offload stage, reload stage) of a block.

    Matches planner.materialize: a swapped block is offloaded at its last forward moment and
    reloaded at the start of the stage before its backward; RECOMPUTE keeps only the input from
    the end of the forward to the start of the backward.
    """
    p, c = b.forward_stage, b.backward_stage
    recompute = range(p + 1, c)
    offload = p
    reload = c - 1 if c - 1 > p else c
    swap = range(p + 1, reload)
    return recompute, swap, offload, reload


@frozen
class _Gap:
    """Stages between two consecutive uses of a group (cyclic: the last gap wraps the iteration)."""

    stages: tuple[int, ...]  # in time order
    lookahead: tuple[int, ...]  # the stages (a suffix of `stages`) where chunks may arrive
    wraps: bool  # contains the optimizer stage: CPU-stepped chunks come back updated


BYTE_UNIT = float(2**20)  # the model's bytes are MiB
TIME_UNIT = 1e-3  # the model's seconds are milliseconds
LOOKAHEAD_STAGES = 3  # the least prefetch depth: stages before its use in which a chunk may arrive
LOOKAHEAD_BUDGET = 200  # arrival variables per gap summed over groups (depth = budget / groups)
MIP_RELATIVE_GAP = 1e-2  # stop the MIP once proven within 1% of its bound (the header's gap target is 2%)
SECONDARY_WEIGHT = 1e-4  # weight of moved/recomputed/CPU work in the objective (a tie-breaker)
NVME_STREAM_STAGED_CHUNKS = 2  # OS chunks of NVMe-streamed GPU steps staged on HOST at once (one read ahead)
SECONDARY_TERMS = 5  # channels that work is spread over: H2D, D2H, NVMe, CPU optimizer, compute


def _scaled(d: PlacementInput) -> PlacementInput:
    """The same input in MiB and milliseconds (floats; the model never needs integral bytes)."""
    b, t = BYTE_UNIT, TIME_UNIT
    return dataclasses.replace(
        d,
        groups=tuple(dataclasses.replace(g, param_bytes=g.param_bytes / b, os_bytes=g.os_bytes / b) for g in d.groups),
        blocks=tuple(dataclasses.replace(x, activation_bytes=x.activation_bytes / b, input_bytes=x.input_bytes / b,
                                         recompute_seconds=x.recompute_seconds / t) for x in d.blocks),
        stages=tuple(dataclasses.replace(st, compute_seconds=st.compute_seconds / t, non_model_bytes=st.non_model_bytes / b,
                                         tail_non_model_bytes=(st.tail_non_model_bytes if st.tail_non_model_bytes >= 0
                                                               else st.non_model_bytes) / b)
                     for st in d.stages),
        device_bytes=d.device_bytes / b, host_bytes=d.host_bytes / b, nvme_bytes=d.nvme_bytes / b,
        h2d_bytes_per_s=d.h2d_bytes_per_s * t / b, d2h_bytes_per_s=d.d2h_bytes_per_s * t / b,
        nvme_read_bytes_per_s=d.nvme_read_bytes_per_s * t / b, nvme_write_bytes_per_s=d.nvme_write_bytes_per_s * t / b,
        cpu_adam_seconds_per_element=d.cpu_adam_seconds_per_element / t,
        gpu_adam_seconds_per_element=d.gpu_adam_seconds_per_element / t,
        duplex_bytes_per_s=d.duplex_bytes_per_s * t / b, dram_bytes_per_s=d.dram_bytes_per_s * t / b, adam_dram_bytes_per_element=d.adam_dram_bytes_per_element / b,
        nvme_time_rows=tuple((x * b / t, y * b / t) for x, y in d.nvme_time_rows),
        pcie_time_rows=tuple((x * b / t, y * b / t) for x, y in d.pcie_time_rows),
    )


def group_gaps(g: GroupData, n_stages: int, optimizer_stage: int, optimizer_overlap: bool,
               lookahead: int = LOOKAHEAD_STAGES) -> tuple[_Gap, ...]:
    """The gaps of a group, each with the stages where its chunks may arrive for the next use."""
    uses = g.use_stages
    if not uses:
        return ()
    gaps = []
    for i, u in enumerate(uses):
        nxt = uses[(i + 1) % len(uses)]
        wraps = i == len(uses) - 1
        stages = tuple(s % n_stages for s in range(u + 1, nxt + (n_stages if wraps else 0)))
        if not stages:
            continue
        window = stages
        if wraps and g.trainable and not optimizer_overlap:
            # Adam after backward: the updated params exist only from the optimizer stage on
            window = stages[stages.index(optimizer_stage):] if optimizer_stage in stages else stages
        look = window[-lookahead:]
        if wraps and optimizer_stage in window and optimizer_stage not in look:
            # the optimizer stage leaves the links idle: the natural time to bring updated params up
            look = window[window.index(optimizer_stage):window.index(optimizer_stage) + 1] + look
        gaps.append(_Gap(stages=stages, lookahead=look, wraps=wraps))
    return tuple(gaps)


class PlacementModel:
    """The aggregated placement MIP (or its LP relaxation) of one PlacementInput.

    Per group g (count_g interchangeable chunks) and gap i between two uses (DESIGN.md §8.7 names):
      keep[g,i]        chunks that stay on DEVICE through the gap (the rest leave after the use)
      incoming[g,i,k]  chunks arriving during the k-th lookahead stage before the next use
      refresh[g,k]     kept chunks re-uploaded in place after the CPU Adam rewrote them (wrap gap)
      on_demand[g,i]   chunks fetched at the next use itself (no room to prefetch; the use waits)
      persistent[g]    chunks that never leave DEVICE (<= every keep, >= os_device)
      param_nvme[g]    chunks whose PARAM lives on NVME, not HOST (fetched through HOST at every use)
      os_device[g] + os_host[g] + os_nvme[g] = count_g (trainable)
    Per block: act[b,mode] in {0,1}, one mode. Per stage: stage_time[s].
    During a use stage all of the group's chunks are on DEVICE; between uses the kept ones plus
    those that already arrived: resident[g,s] is derived, never a variable of its own.
    """

    def __init__(self, data: PlacementInput, *, relax: bool = False, capacity_variable: Tier | None = None,
                 lp_solver: str = "GLOP", lookahead: int | None = None, feasibility: bool = False,
                 fixed_flags: dict[str, int] | None = None,
                 fixed_modes: Sequence[ActivationMode] | None = None) -> None:
        self.original = data
        self.fixed_modes = tuple(fixed_modes) if fixed_modes is not None else None
        self.flags: dict[str, Any] = {}
        self.fixed_flags = dict(fixed_flags or {})
        # rows mixing 1e11 bytes and 0.1 s stall the simplex: the model works in MiB and milliseconds
        self.data = _scaled(data)
        self.relax = relax
        # prefetch depth: every stage of a gap for small models, fewer for big ones (model size)
        self.lookahead = lookahead if lookahead is not None else max(LOOKAHEAD_STAGES, LOOKAHEAD_BUDGET // max(1, len(data.groups)))
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
        return self.solver.NumVar(lo, hi, name) if self.relax else self.solver.IntVar(lo, hi, name)

    def _bool(self, name: str) -> Any:
        return self.solver.NumVar(0, 1, name) if self.relax else self.solver.BoolVar(name)

    def _flag(self, name: str) -> Any:
        """A 0/1 switch of a whole mechanism (any chunk streamed, any OS on NVME, ...): the big-M rows
        behind it are what makes the relaxation weak and the MIP slow, so `fixed_flags` may pin it
        (solve pins them to the rounded LP values: a HiGHS MIP of 175B went from > 60 s to 3 s)."""
        v = self._bool(name)
        self.flags[name] = v
        if name in self.fixed_flags:
            v.lower_bound = v.upper_bound = float(self.fixed_flags[name])
        return v

    def flag_values(self) -> dict[str, float]:
        """The solved values of the mechanism switches (after `solve`)."""
        return {k: self._value(v) for k, v in sorted(self.flags.items())}

    def _add_variables(self) -> None:
        d, n = self.data, len(self.data.stages)
        inf = self.solver.infinity()
        self.stage_time = [self.solver.NumVar(0, inf, f"stage_time[{s}]") for s in range(n)]
        self.gaps: list[tuple[_Gap, ...]] = []
        self.keep: list[list[Any]] = []
        self.incoming: list[list[list[Any]]] = []  # [g][gap][k] aligned with gap.lookahead
        self.refresh: list[list[Any]] = []  # [g][k] aligned with the wrap gap's lookahead
        self.persistent, self.os_device, self.os_host, self.os_nvme, self.os_stream = [], [], [], [], []
        self.os_nvme_stream: list[Any] = []  # [g] OS on NVME streamed NVME -> HOST -> DEVICE for GPU Adam
        self.param_nvme: list[Any] = []  # [g] PARAM chunks whose home is NVME (fetched through HOST every use)
        self.nvme_incoming: list[list[list[Any]]] = []  # [g][gap][k] the part of incoming[g,gap,k] read from NVME
        self.on_demand: list[list[Any]] = []  # [g][gap] chunks fetched at the next use itself (no prefetch room)
        self.nvme_on_demand: list[list[Any]] = []  # [g][gap] the part of on_demand read from NVME
        for g in d.groups:
            gaps = group_gaps(g, n, d.optimizer_stage, d.optimizer_overlap, self.lookahead)
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
            self.solver.Add(pers >= od, f"os_device_persistent[{g.id}]")
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
                    # are uploaded again in place before the next forward uses them
                    refresh = [self._int(0, g.count, f"refresh[{g.id},{k}]") for k in range(len(gap.lookahead))]
                    self.solver.Add(sum(refresh) >= keep - od, f"stale_after_step[{g.id}]")
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
            if self.fixed_modes is not None:  # pinned (solve: the LP's choice on big traces)
                for m, v in choice.items():
                    v.lower_bound = v.upper_bound = 1.0 if m is self.fixed_modes[i] else 0.0
            if not d.has_nvme:
                choice[ActivationMode.SWAP_NVME].upper_bound = 0
            if b.forward_stage < 0 or b.backward_stage < 0:  # no forward or no backward: nothing to plan
                for m in ACT_MODES[1:]:
                    choice[m].upper_bound = 0
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

    # -- memory --------------------------------------------------------------------------
    def _interval_sums(self, name: str, items: list[tuple[int, int, Any]]) -> list[Any]:
        """Per stage s, the sum of the expressions whose interval [first, last] contains s.

        A running sum (one variable per stage where it changes) instead of one term per stage and
        item keeps every row sparse: dense rows are what makes the simplex slow at 175B.
        """
        n = len(self.data.stages)
        starts: list[list[Any]] = [[] for _ in range(n + 1)]
        ends: list[list[Any]] = [[] for _ in range(n + 1)]
        for first, last, expr in items:
            if first > last:
                continue
            starts[first].append(expr)
            ends[last + 1].append(expr)
        out: list[Any] = []
        prev: Any = 0
        for s in range(n):
            if not starts[s] and not ends[s]:
                out.append(prev)
                continue
            v = self.solver.NumVar(0, self.solver.infinity(), f"{name}[{s}]")
            self.solver.Add(v == prev + sum(starts[s]) - sum(ends[s]), f"{name}_run[{s}]")
            out.append(v)
            prev = v
        return out

    def _build_memory_terms(self) -> None:
        d, n = self.data, len(self.data.stages)
        inf = self.solver.infinity()
        self.device_static = self.solver.NumVar(0, inf, "device_static")  # OS on DEVICE
        self.solver.Add(self.device_static == sum(self.os_device[gi] * g.os_bytes for gi, g in enumerate(d.groups)),
                        "device_static_sum")
        self.host_static = self.solver.NumVar(0, inf, "host_static")  # HOST copies of PARAM + OS on HOST
        self.solver.Add(self.host_static == sum((g.count - self.os_device[gi] - self.param_nvme[gi]) * g.param_bytes
                                                + (self.os_host[gi] + self.os_stream[gi]) * g.os_bytes
                                                for gi, g in enumerate(d.groups)), "host_static_sum")
        self.use_bytes = [0.0] * n  # PARAM bytes of the groups a stage's work touches
        self.arrived: list[list[Any]] = [[] for _ in range(n)]  # incoming chunks already on DEVICE in s (bytes)
        self.arriving: list[list[Any]] = [[] for _ in range(n)]  # the part of `arrived` arriving during s itself
        kept: list[tuple[int, int, Any]] = []
        staging: list[tuple[int, int, Any]] = []
        grads: list[tuple[int, int, Any]] = []
        host_grads: list[tuple[int, int, Any]] = []
        for gi, g in enumerate(d.groups):
            for s in g.use_stages:
                self.use_bytes[s] += g.count * g.param_bytes
            for i, gap in enumerate(self.gaps[gi]):
                for first, last in _runs(gap.stages):
                    kept.append((first, last, self.keep[gi][i] * g.param_bytes))
                pos = {s: j for j, s in enumerate(gap.stages)}
                for k, s_in in enumerate(gap.lookahead):
                    for s in gap.stages[pos[s_in]:]:  # arrived chunks occupy DEVICE until the use
                        self.arrived[s].append(self.incoming[gi][i][k] * g.param_bytes)
                    self.arriving[s_in].append(self.incoming[gi][i][k] * g.param_bytes)
                    if self.nvme_incoming[gi][i]:
                        # the staging copy of an NVMe-homed chunk stays on HOST until the use
                        for first, last in _runs(gap.stages[pos[s_in]:]):
                            staging.append((first, last, self.nvme_incoming[gi][i][k] * g.param_bytes))
            if not self.gaps[gi]:
                kept.append((0, n - 1, self.persistent[gi] * g.param_bytes))
            if not g.trainable:
                continue
            if g.first_backward_stage >= 0:
                # grads accumulate on DEVICE over the chunk's backward uses, then GPU Adam chunks keep them
                grads.append((g.first_backward_stage, g.last_backward_stage, g.count * g.param_bytes))
                grads.append((g.last_backward_stage + 1, n - 1, self.os_device[gi] * g.param_bytes))
                # CPU Adam grads wait on HOST for their step (consumed at once when it overlaps backward)
                last = g.last_backward_stage if d.optimizer_overlap else n - 1
                streamed = self.os_stream[gi] + self.os_nvme_stream[gi]
                host_grads.append((g.last_backward_stage, last,
                                   (g.count - self.os_device[gi] - streamed) * g.param_bytes))
                # streamed chunks' grads wait on HOST for the optimizer stage
                host_grads.append((g.last_backward_stage, n - 1, streamed * g.param_bytes))
                if d.optimizer_overlap:
                    # OS living on NVME is staged on HOST from the chunk's first backward use (read
                    # early, so the SSDs work while the device computes) until its CPU step
                    host_grads.append((g.first_backward_stage, g.last_backward_stage, self.os_nvme[gi] * g.os_bytes))
        saved: list[tuple[int, int, Any]] = []
        host_acts: list[tuple[int, int, Any]] = []
        for bi, (b, choice) in enumerate(zip(d.blocks, self.act)):
            if b.forward_stage < 0 or b.backward_stage < 0:
                continue
            recompute, swap, offload, reload = act_windows(b, n)
            swapped = choice[ActivationMode.SWAP_HOST] + choice[ActivationMode.SWAP_NVME]
            ckpt = self.ckpt_block[bi]
            if len(recompute):
                saved.append((recompute.start, recompute.stop - 1,
                              (b.activation_bytes - b.input_bytes) * choice[ActivationMode.RECOMPUTE]))
            if len(swap):
                saved.append((swap.start, swap.stop - 1, b.activation_bytes * swapped + b.input_bytes * ckpt))
            host_acts.append((offload, reload, b.activation_bytes * choice[ActivationMode.SWAP_HOST] + b.input_bytes * ckpt))
        trainable = [(gi, g) for gi, g in enumerate(d.groups) if g.trainable]
        if d.has_nvme and trainable:
            # OS living on NVME passes through HOST for its CPU step. With overlap the write-back of
            # one chunk overlaps the read of the next: one more chunk of OS is staged on HOST during
            # backward; after backward the steps take one chunk at a time in the optimizer stage
            self.any_nvme_os = self._flag("any_nvme_os")
            for gi, g in trainable:
                self.solver.Add(self.os_nvme[gi] <= g.count * self.any_nvme_os, f"any_nvme_os[{g.id}]")
            staged = max(g.os_bytes for _, g in trainable) * self.any_nvme_os
            backward = [g for _, g in trainable if g.first_backward_stage >= 0]
            if d.optimizer_overlap and backward:
                first = min(g.first_backward_stage for g in backward)
                last = max(g.last_backward_stage for g in backward)
                host_grads.append((first, last, staged))
                # steps the CPU reaches only after backward run as materialize's tail chain: the
                # next chunk's OS is read while the previous one's is written back
                host_grads.append((d.optimizer_stage, d.optimizer_stage, 2 * staged))
            else:
                host_grads.append((d.optimizer_stage, d.optimizer_stage, staged))
        pn_groups = [(gi, g) for gi, g in enumerate(d.groups) if self.param_nvme[gi].upper_bound > 0]
        if pn_groups:
            # a CPU step of an NVMe-homed chunk reads its PARAM to HOST and writes it back (and the
            # write-back of one step overlaps the next): two chunks of PARAM staged on HOST
            any_pn = self._flag("any_nvme_param")
            for gi, g in pn_groups:
                self.solver.Add(self.param_nvme[gi] <= g.count * any_pn, f"any_nvme_param[{g.id}]")
            staging.append((0, n - 1, 2 * max(g.param_bytes for _, g in pn_groups) * any_pn))
        self.stream_transient: Any = 0
        if d.stream_optimizer and trainable:
            # a streamed GPU Adam step holds one chunk's OS, PARAM and GRAD on DEVICE at a time
            self.any_stream = self._flag("any_stream")
            for gi, g in trainable:
                self.solver.Add(self.os_stream[gi] + self.os_nvme_stream[gi] <= g.count * self.any_stream,
                                f"any_stream[{g.id}]")
            self.stream_transient = max(g.os_bytes + 2 * g.param_bytes for _, g in trainable) * self.any_stream
            if d.has_nvme:
                # NVMe-streamed steps are pipelined (materialize reads the next chunk's OS before this
                # one's write-back): up to two chunks' OS staged on HOST in the optimizer stage
                any_ns = self._flag("any_nvme_stream")
                for gi, g in trainable:
                    self.solver.Add(self.os_nvme_stream[gi] <= g.count * any_ns, f"any_nvme_stream[{g.id}]")
                host_grads.append((d.optimizer_stage, d.optimizer_stage,
                                   NVME_STREAM_STAGED_CHUNKS * max(g.os_bytes for _, g in trainable) * any_ns))
        self.kept_bytes = self._interval_sums("kept_params", kept)
        self.grad_bytes = self._interval_sums("device_grads", grads)
        self.saved_bytes = self._interval_sums("activation_saved", saved)
        self.host_grad_bytes = self._interval_sums("host_grads", host_grads)
        self.host_act_bytes = self._interval_sums("host_activations", host_acts)
        self.host_staging_bytes = self._interval_sums("host_param_staging", staging)

    def _param_expr(self, s: int) -> Any:
        """PARAM + GRAD bytes on DEVICE in stage s (the budget materialize gets)."""
        return self.use_bytes[s] + self.kept_bytes[s] + sum(self.arrived[s]) + self.grad_bytes[s]

    def _device_expr(self, s: int) -> Any:
        d = self.data
        transient = self.stream_transient if s == d.optimizer_stage else 0
        return d.stages[s].non_model_bytes + self.device_static + self._param_expr(s) - self.saved_bytes[s] + transient

    def _device_rows(self, s: int) -> list[Any]:
        """DEVICE bytes in stage s, as the rows the capacity bounds. The chunks arriving during s for
        the next use are issued at the first moment with room (materialize's prefetch), which is at
        the latest the stage's last moment, when the work's peak of non-model bytes is over. So two
        rows: the work's peak without them, and the stage's last moment with them (the simulator
        and materialize count memory per moment, not per stage)."""
        d = self.data
        st = d.stages[s]
        full = self._device_expr(s)
        if not self.arriving[s] or st.tail_non_model_bytes >= st.non_model_bytes:
            return [full]
        return [full - sum(self.arriving[s]), full - st.non_model_bytes + st.tail_non_model_bytes]

    def _host_expr(self, s: int) -> Any:
        return self.host_static + self.host_grad_bytes[s] + self.host_act_bytes[s] + self.host_staging_bytes[s]

    def _nvme_expr(self) -> Any:
        d = self.data
        expr = 0
        for gi, g in enumerate(d.groups):
            expr += (self.os_nvme[gi] + self.os_nvme_stream[gi]) * g.os_bytes + self.param_nvme[gi] * g.param_bytes
        for b, choice in zip(d.blocks, self.act):
            expr += b.activation_bytes * choice[ActivationMode.SWAP_NVME]
        return expr

    def _cap(self, tier: Tier, given: float) -> Any:
        return self.capacity if self.capacity_variable is tier else given

    def _add_memory_constraints(self) -> None:
        d = self.data
        self._build_memory_terms()
        for s in range(len(d.stages)):
            for r, row in enumerate(self._device_rows(s)):
                self.solver.Add(row <= self._cap(Tier.DEVICE, d.device_bytes), f"device_memory[{s},{r}]")
            self.solver.Add(self._host_expr(s) <= self._cap(Tier.HOST, d.host_bytes), f"host_memory[{s}]")
        self.solver.Add(self._nvme_expr() <= self._cap(Tier.NVME, d.nvme_bytes), "nvme_memory")

    # -- time ----------------------------------------------------------------------------
    def _channel_exprs(self) -> dict[str, list[Any]]:
        """Per stage: bytes per channel, compute, and CPU/NVMe optimizer work released (expressions)."""
        d, n = self.data, len(self.data.stages)
        h2d: list[Any] = [0] * n
        d2h: list[Any] = [0] * n
        nvme_read: list[Any] = [0] * n
        nvme_write: list[Any] = [0] * n
        compute: list[Any] = [st.compute_seconds for st in d.stages]
        on_demand: list[Any] = [0] * n  # seconds the work of s waits for chunks fetched at its start
        rd = d.nvme_read_bytes_per_s or 1.0
        cpu_released: list[Any] = [0] * n  # CPU Adam time whose grads become final in stage s
        os_read: list[Any] = [0] * n  # NVMe OS bytes to read / write for those steps
        os_write: list[Any] = [0] * n
        for gi, g in enumerate(d.groups):
            for i, gap in enumerate(self.gaps[gi]):
                for k, s in enumerate(gap.lookahead):
                    h2d[s] += self.incoming[gi][i][k] * g.param_bytes
                    if self.nvme_incoming[gi][i]:
                        nvme_read[s] += self.nvme_incoming[gi][i][k] * g.param_bytes
                use = (gap.stages[-1] + 1) % n
                h2d[use] += self.on_demand[gi][i] * g.param_bytes
                on_demand[use] += self.on_demand[gi][i] * (g.param_bytes / d.h2d_bytes_per_s)
                if not _is_zero(self.nvme_on_demand[gi][i]):
                    nvme_read[use] += self.nvme_on_demand[gi][i] * g.param_bytes
                    on_demand[use] += self.nvme_on_demand[gi][i] * (g.param_bytes / rd)
                    if gap.wraps and self.refresh[gi]:
                        h2d[s] += self.refresh[gi][k] * g.param_bytes
            if not g.trainable:
                continue
            release = g.last_backward_stage if (d.optimizer_overlap and g.last_backward_stage >= 0) else d.optimizer_stage
            grads_at = g.last_backward_stage if g.last_backward_stage >= 0 else d.optimizer_stage
            streamed = self.os_stream[gi] + self.os_nvme_stream[gi]
            cpu_chunks = g.count - self.os_device[gi] - streamed
            d2h[grads_at] += (cpu_chunks + streamed) * g.param_bytes
            cpu_released[release] += cpu_chunks * (g.elements * d.cpu_adam_seconds_per_element)
            # streamed GPU Adam: OS, PARAM and GRAD up, OS and PARAM down, in the optimizer stage
            o = d.optimizer_stage
            h2d[o] += streamed * (g.os_bytes + 2 * g.param_bytes)
            d2h[o] += streamed * (g.os_bytes + g.param_bytes)
            compute[o] += streamed * (g.elements * d.gpu_adam_seconds_per_element)
            # NVMe-streamed OS: read from and written back to the SSDs in the optimizer stage
            nvme_read[o] += self.os_nvme_stream[gi] * g.os_bytes
            nvme_write[o] += self.os_nvme_stream[gi] * g.os_bytes
            # NVMe-homed PARAM: read for the CPU step, written back after it
            os_read[release] += self.os_nvme[gi] * g.os_bytes + self.param_nvme[gi] * g.param_bytes
            os_write[release] += self.os_nvme[gi] * g.os_bytes + self.param_nvme[gi] * g.param_bytes
            compute[d.optimizer_stage] += self.os_device[gi] * (g.elements * d.gpu_adam_seconds_per_element)
        for bi, (b, choice) in enumerate(zip(d.blocks, self.act)):
            if b.forward_stage < 0 or b.backward_stage < 0:
                continue
            _, _, offload, reload = act_windows(b, n)
            swapped = choice[ActivationMode.SWAP_HOST] + choice[ActivationMode.SWAP_NVME]
            d2h[offload] += b.activation_bytes * swapped
            h2d[reload] += b.activation_bytes * swapped
            if not _is_zero(self.ckpt_block[bi]):  # an offloaded checkpoint goes down and comes back
                d2h[offload] += b.input_bytes * self.ckpt_block[bi]
                h2d[reload] += b.input_bytes * self.ckpt_block[bi]
            nvme_write[offload] += b.activation_bytes * choice[ActivationMode.SWAP_NVME]
            nvme_read[reload] += b.activation_bytes * choice[ActivationMode.SWAP_NVME]
            compute[b.backward_stage] += b.recompute_seconds * choice[ActivationMode.RECOMPUTE]
        return {"H2D": h2d, "D2H": d2h, "NVME_READ": nvme_read, "NVME_WRITE": nvme_write, "COMPUTE": compute,
                "ON_DEMAND": on_demand,
                "CPU_RELEASED": cpu_released, "OS_READ": os_read, "OS_WRITE": os_write}

    def _add_time_constraints(self) -> None:
        d, n = self.data, len(self.data.stages)
        inf = self.solver.infinity()
        ch = self.channels = self._channel_exprs()
        rd = d.nvme_read_bytes_per_s or 1.0
        nvme_rows = d.nvme_rows()
        for s in range(n):
            t = self.stage_time[s]
            self.solver.Add(t >= ch["COMPUTE"][s], f"time_compute[{s}]")
            if not _is_zero(ch["ON_DEMAND"][s]):
                self.solver.Add(t >= ch["COMPUTE"][s] + ch["ON_DEMAND"][s], f"time_on_demand[{s}]")
            self.solver.Add(t >= ch["H2D"][s] * (1.0 / d.h2d_bytes_per_s), f"time_h2d[{s}]")
            self.solver.Add(t >= ch["D2H"][s] * (1.0 / d.d2h_bytes_per_s), f"time_d2h[{s}]")
            # both ways at once at the links.duplex_* rates: the least time of any overlap (costmodel.pcie_time_rows)
            for k, (a, b) in enumerate(d.pcie_time_rows):
                if a > 0 and b > 0:  # the one-way rows are the two above
                    self.solver.Add(t >= ch["H2D"][s] * a + ch["D2H"][s] * b, f"time_pcie_both_ways[{s},{k}]")
            for k, (a, b) in enumerate(nvme_rows):  # costmodel.nvme_time_rows: simplex, or mixed and the cap
                self.solver.Add(t >= ch["NVME_READ"][s] * a + ch["NVME_WRITE"][s] * b, f"time_nvme[{s},{k}]")
        # The CPU optimizer (and the SSD traffic of its OS) is a queue: work released in stage s runs
        # in s or later, so every suffix of the iteration must be long enough for the work released
        # in it (the LP form of one machine with release times; Fuyou §4.3's overlap).
        self.suffix = [self.solver.NumVar(0, inf, f"suffix_time[{s}]") for s in range(n)]
        for s in range(n):
            later = self.suffix[s + 1] if s + 1 < n else 0
            self.solver.Add(self.suffix[s] == self.stage_time[s] + later, f"suffix[{s}]")
        cpu_tail: Any = 0
        nvme_tails: list[Any] = [0] * len(nvme_rows)  # per SSD time row
        cpu_tail_at: list[Any] = [0] * (n + 1)  # CPU work released at or after stage s
        for s in reversed(range(n)):
            cpu_here = ch["CPU_RELEASED"][s]
            if not _is_zero(cpu_here):
                v = self.solver.NumVar(0, inf, f"cpu_optimizer_tail[{s}]")  # running sums keep rows sparse
                self.solver.Add(v == cpu_tail + cpu_here, f"cpu_optimizer_tail_run[{s}]")
                cpu_tail = v
            for k, (a, b) in enumerate(nvme_rows):
                nvme_here = (ch["OS_READ"][s] + ch["NVME_READ"][s]) * a + (ch["OS_WRITE"][s] + ch["NVME_WRITE"][s]) * b
                if not _is_zero(nvme_here):
                    v = self.solver.NumVar(0, inf, f"nvme_tail[{s},{k}]")
                    self.solver.Add(v == nvme_tails[k] + nvme_here, f"nvme_tail_run[{s},{k}]")
                    nvme_tails[k] = v
                if not _is_zero(nvme_tails[k]):
                    self.solver.Add(self.suffix[s] >= nvme_tails[k], f"nvme_suffix[{s},{k}]")
            cpu_tail_at[s] = cpu_tail
            if not _is_zero(cpu_tail):
                self.solver.Add(self.suffix[s] >= cpu_tail, f"cpu_optimizer_suffix[{s}]")
        if d.dram_bytes_per_s > 0:
            # host DRAM is shared (costmodel.dram_bytes): every PCIe / SSD byte passes it once per leg
            # and CPU Adam moves adam_dram_bytes_per_element per param; the iteration lasts at least
            # all of it / the bandwidth (one row: the CPU and SSD queues may run it in later stages)
            moved: Any = 0
            for s in range(n):
                moved += ch["H2D"][s] + ch["D2H"][s] + ch["NVME_READ"][s] + ch["NVME_WRITE"][s]
                moved += ch["OS_READ"][s] + ch["OS_WRITE"][s]
                moved += ch["CPU_RELEASED"][s] * (d.adam_dram_bytes_per_element / d.cpu_adam_seconds_per_element)
            if not _is_zero(moved):
                self.solver.Add(self.suffix[0] >= moved * (1.0 / d.dram_bytes_per_s), "time_host_dram")
        o = d.optimizer_stage
        trainable = [g for g in d.groups if g.trainable and g.elements > 0]
        bounded_host = self.capacity_variable is Tier.HOST or d.host_bytes < INFINITE_BYTES / BYTE_UNIT / 2
        if bounded_host and d.optimizer_overlap and trainable and not _is_zero(cpu_tail_at[0]):
            # When the CPU optimizer falls behind backward, the grads of the steps it has not reached
            # wait on HOST when the optimizer stage starts: CPU work released in [s, o) minus the
            # time of [s, o), for the worst s, at the CPU's rate in grad bytes, in the HOST row of
            # the optimizer stage (the plain rows count a grad only in its release stage). One row
            # per release stage at the optimizer stage only: a backlog row per stage made the 175B
            # MIP time out; solve re-plans with less HOST where a paced schedule still runs out.
            self.cpu_lag = self.solver.NumVar(0, inf, "cpu_optimizer_lag")
            for s in range(o):
                if _is_zero(cpu_tail_at[s]) or (s > 0 and cpu_tail_at[s] is cpu_tail_at[s - 1]):
                    continue
                self.solver.Add(self.cpu_lag >= cpu_tail_at[s] - cpu_tail_at[o] - (self.suffix[s] - self.suffix[o]),
                                f"cpu_optimizer_lag[{s}]")
            bytes_per_time = max(g.param_bytes / g.elements for g in trainable) / d.cpu_adam_seconds_per_element
            self.solver.Add(self._host_expr(o) + self.cpu_lag * bytes_per_time <= self._cap(Tier.HOST, d.host_bytes),
                            "host_memory_cpu_lag")
        if not d.optimizer_overlap:
            # Adam after backward: the optimizer stage alone carries the CPU step and its SSD traffic
            o = d.optimizer_stage
            self.solver.Add(self.stage_time[o] >= ch["CPU_RELEASED"][o], "time_cpu_optimizer")
            for k, (a, b) in enumerate(nvme_rows):
                self.solver.Add(self.stage_time[o] >= (ch["OS_READ"][o] + ch["NVME_READ"][o]) * a
                                + (ch["OS_WRITE"][o] + ch["NVME_WRITE"][o]) * b, f"time_nvme_optimizer[{k}]")

    def _add_objective(self) -> None:
        if self.capacity is not None:
            self.solver.Minimize(self.capacity)
            return
        # Among plans of equal time prefer the one that moves, recomputes and steps on the CPU least
        # (it is time the simulator and the executor cannot always hide). That work is at most
        # SECONDARY_TERMS x sum T_s, so the LP value / (1 + SECONDARY_TERMS x SECONDARY_WEIGHT) stays
        # a lower bound on sum T_s.
        d, ch = self.data, self.channels
        # the SSDs' work at the least coefficients of their time rows: never above a stage's SSD time
        rows = d.nvme_rows()
        ra, wb = min(a for a, _ in rows), min(b for _, b in rows)
        work = 0
        for s in range(len(d.stages)):
            work += ch["H2D"][s] * (1.0 / d.h2d_bytes_per_s) + ch["D2H"][s] * (1.0 / d.d2h_bytes_per_s)
            work += (ch["NVME_READ"][s] + ch["OS_READ"][s]) * ra + (ch["NVME_WRITE"][s] + ch["OS_WRITE"][s]) * wb
            work += ch["CPU_RELEASED"][s] + (ch["COMPUTE"][s] - d.stages[s].compute_seconds)
        self.secondary = work
        self.solver.Minimize(sum(self.stage_time) + SECONDARY_WEIGHT * work)

    # -- solve ---------------------------------------------------------------------------
    def solve(self, *, time_limit_seconds: float = 60.0, gap: float = MIP_RELATIVE_GAP,
              node_limit: int | None = None) -> PlacementSolution:
        start = time.perf_counter()
        try:
            result = self.solver.solve(time_limit_seconds=time_limit_seconds, relative_gap=gap, node_limit=node_limit)
        except Exception as exc:  # HiGHS reports numerical trouble as a status error (pybind11 StatusNotOk)
            raise PlacementInfeasible(f"{self.solver_name}: no solution within {time_limit_seconds:g} s "
                                      f"(solver error: {str(exc)[:200]})") from None
        seconds = time.perf_counter() - start
        reason = result.termination.reason
        log.info("placement %s (%s): %s, %d variables, %d constraints, %.2f s", self.solver_name,
                 "LP" if self.relax else "MIP", reason.name, self.solver.NumVariables(), self.solver.NumConstraints(), seconds)
        if reason in (mathopt.TerminationReason.INFEASIBLE, mathopt.TerminationReason.INFEASIBLE_OR_UNBOUNDED):
            raise PlacementInfeasible(f"{self.solver_name}: infeasible")
        if not result.has_primal_feasible_solution():
            raise PlacementInfeasible(f"{self.solver_name}: no solution within {time_limit_seconds:g} s ({reason.name})")
        self.values = result.variable_values()
        self.result = result
        return self._solution(reason is mathopt.TerminationReason.OPTIMAL, seconds)

    def _value(self, expr: Any) -> float:
        if isinstance(expr, (int, float)):
            return float(expr)
        return float(mathopt.evaluate_expression(expr, self.values))

    def _solution(self, optimal: bool, seconds: float) -> PlacementSolution:
        d, n = self.data, len(self.data.stages)
        t, b = TIME_UNIT, BYTE_UNIT
        objective = sum(self._value(v) for v in self.stage_time) * t  # sum T_s, without the tie-breaker
        # an LP stopped before its optimum (time or iteration limit) proves nothing: its bound is 0
        if self.relax:
            raw_bound = self.result.objective_value() if optimal else 0.0
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

        resident, incoming = [], []
        for gi, g in enumerate(d.groups):
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


def _is_zero(expr: Any) -> bool:
    return isinstance(expr, (int, float)) and expr == 0


def _runs(stages: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs [first, last] of a stage sequence (a wrapping gap gives two)."""
    runs: list[tuple[int, int]] = []
    for s in stages:
        if runs and s == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs


class SparsePlacementModel(PlacementModel):
    """PlacementModel with the DEVICE rows kept sparse: the same model, reformulated (the MIP of
    planner.solve is built on it; its LP is not, see below).

    Measured (bench/bench_depth.py, hidden 4096, chunk 67257720 elements): the DEVICE rows held
    20,916 nonzeros over 520 rows at 128 blocks and 74,548 over 1,032 at 256 (40 -> 72 per row:
    quadratic in depth), half of the model's nonzeros. The cause: a chunk arriving in stage k
    counts in every DEVICE row from k to its use, and the wrap gap's arrivals in the optimizer
    stage (updated params coming back up) stay until the block's forward in the next iteration,
    so the forward stage s row carries one term per block after s. Here those intervals go
    through running sums (`_interval_sums`, as the kept chunks already do): O(1) terms per row
    (75,315 instead of 138,781 nonzeros at 256 blocks, build 1.07 instead of 1.74 s). GLOP needs
    twice the pivots on it (18,836 vs 9,234), so only the MIP uses it.
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


def root_bound_seconds(data: PlacementInput, *, time_limit_seconds: float = 120.0) -> float:
    """A valid lower bound of the unpinned placement model, tighter than its LP: the dual bound of
    HiGHS's root node (cuts included), node limit 1 so that it does not depend on the machine's
    speed (the time limit is a safety net: a root stopped by it may return a weaker bound, never an
    invalid one). Measured at 32 blocks (hidden 4096, a100-80g-12ssd, chunk 67257720,
    bench/bench_depth.py): LP 2.1194 s, root 2.2164 s. 0.0 when HiGHS stops without a bound."""
    model = PlacementModel(data)
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
    "ACT_MODES", "BlockData", "GroupData", "PlacementInfeasible", "PlacementInput", "PlacementModel",
    "PlacementSolution", "SparsePlacementModel", "StageData", "group_summary", "minimal_capacity", "placement_feasible", "placement_input",
    "root_bound_seconds", "solve_placement",
]

