"""Discrete-event replay of a schedule on a hardware profile: the predictor and the schedule checker.

`simulate(schedule, hardware)` replays one iteration using only the schedule (its moments carry
compute seconds, FLOPs, non-model bytes and parameter tensors; its activation plans carry bytes and
recompute seconds) and returns a `SimResult`, or raises `ScheduleViolation` naming the moment, the
action index, the chunk list and the chunk of the first rule the schedule breaks.

Model (the action semantics of `schemas/schedule.py`, one moment = DESIGN.md §2):

- Time. Moment m's event happens when moment m-1's work ends (moment 0 at t=0). Its actions are
  issued then, in list order. Each channel is a FIFO server: an action starts when it is issued,
  the channel is free, and its inputs are ready, and lasts bytes / bandwidth. Moment m's work
  (on COMPUTE) starts after the previous work, after every FETCH of moment m, after every chunk
  its tensors need is on DEVICE (an earlier PREFETCH may still be in flight), and after the
  activations of a block whose backward starts at m are back on DEVICE; it lasts the moment's
  compute seconds plus, at the first backward moment of a RECOMPUTE block, its recompute seconds.
  The time the work waits past its event is a stall. The iteration ends when the last work and the
  last transfer or optimizer step are done.
- Ranks. With world_size > 1 every rank has its own H2D, D2H and COMPUTE server: a chunk's copies
  and its DEVICE optimizer step run on its owner rank's, the moments' work on all of them at once
  (SPMD); each node's ranks share its SSDs and its CPU optimizer (one server each per node), and
  collectives share one cluster-wide server, priced intra- vs inter-node by
  `Hardware.collective_seconds` (the slower of the NVLink and the NIC stage of a hierarchical ring). Bytes and busy
  seconds of local copies are summed over ranks; a collective's bytes are what each rank sends
  (the schedule's convention), counted once. A collective starts when its inputs are on DEVICE
  (an ALL_GATHER after the owners' copies of the group arrived, a REDUCE_SCATTER after the grads
  were written) and its outputs are ready when it ends.
- Memory per rank and per node. DEVICE capacity is per rank: a copy of a chunk on DEVICE is held
  by its owner rank only (a FETCH/PREFETCH/WRITE_BACK to DEVICE, which the owner does, and the
  optimizer state) or by every rank (PARAM and GRAD at the start of the iteration, after an
  ALL_GATHER, an ALLOCATE on DEVICE or a backward write); the DEVICE peak is the busiest rank's.
  HOST and NVME capacities are per node (`cluster.gpus_per_node` ranks share them): a chunk's copy
  there counts on its owner's node, and swapped activations once per rank of the node (each rank
  swaps its own). With one rank all of this is the plain sum.
- Channels. H2D, D2H, INTER_GPU and COMPUTE are independent servers. NVMe is ONE simplex server per
  SSD set: reads and writes queue on it together (Fuyou §4.3, "SSD I/O is simplex"), reads at
  `count * read rate`, writes at `count * write rate`, each at most the host-side cap
  (`nvme.host_cap_gb_per_s`). H2D/D2H run at the pinned rates; at the both-ways (`duplex_*`) rates
  when the other direction's server is still busy as the copy starts; DEVICE <-> HOST copies of a
  policy that stages through pageable memory (`costmodel.PAGEABLE_POLICIES`) at the pageable rates;
  such a copy also holds the work of the moment that issued it until it is done (pageable
  cudaMemcpyAsync blocks the issuing thread: `_blocks_host`), so those systems' copies and compute
  run in series, as Fuyou §3 measured DeepSpeed's.
  Host DRAM is one more shared server: every copy leg through host memory and every CPU Adam step
  reserves its DRAM bytes / `host.dram_gb_per_s` on it as it starts and cannot end before its
  reservation does, so the iteration is never shorter than the DRAM bytes / bandwidth.
  CPU_OPTIMIZER runs OPTIMIZER_STEP on HOST at the CPU Adam rate at the chunk size with all cores
  (`costmodel.cpu_adam_params_per_s`), at the rate measured with copies beside it when a PCIe or SSD
  server is busy as the step starts; an OPTIMIZER_STEP on DEVICE queues on COMPUTE at
  `device.optimizer_params_per_s`. On an emulated DEVICE (`device.kind = "cpu-emulated"`) the
  device's compute IS the host's cores, so CPU_OPTIMIZER queues on the rank's COMPUTE server in
  issue order: a CPU step overlapped with backward delays the backward work issued after it (busy
  time is still reported per channel). Conservative: the executor's optimizer worker runs at the
  lowest CPU priority, so backward goes first there; the work on the cores is the same.
  A copy between DEVICE and NVME crosses HOST: it occupies both
  channels of its path at once (pipelined through a bounce buffer) and its bytes count on both.
- Validity. Per (list, chunk, tier) the simulator tracks whether the tier holds a copy and whether
  it is valid. Copies make the destination valid when issued (its arrival time is tracked
  separately); backward work that writes a GRAD chunk makes other copies stale; an optimizer step
  makes copies of PARAM and the OS lists on other tiers stale and the GRAD chunk dead.
- Memory, per moment after its actions: DEVICE = chunks held + non-model bytes + activations;
  HOST and NVME = chunks held + activations swapped there. The trace's non-model bytes are recorded
  with every block's activations kept, so between a block's last forward moment and its first
  backward moment the simulator subtracts what the activation plan moved away: a RECOMPUTE block
  keeps only its input bytes, a swapped block holds nothing on DEVICE while offloaded.
  ACT_OFFLOAD / ACT_RELOAD of a RECOMPUTE block move its kept input (the checkpoint) to HOST or NVME
  and back: how ZeRO-Infinity and Fuyou keep activation checkpoints off the GPU (Fuyou §2.2, §4.5).
  Capacity is checked against `schedule.budgets` per moment (and, without the non-model bytes,
  after every action, because the executor's store allocates as it goes).

Simplifications (documented so nobody mistakes them for physics): one iteration in isolation (the
next iteration's first fetches do not overlap this one's tail), the CPU thread issues actions
instantly, PCIe links are full duplex, collectives cost `Hardware.collective_seconds`, staging
buffers in HOST for NVMe copies are not counted, a copy's rate is fixed when it starts (not re-shared
as other traffic comes and goes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from rich.console import Console
from rich.table import Table

from schemas import Hardware, Schedule
from schemas._base import digest_bytes, read_bytes
from schemas.hardware import DeviceKind
from schemas.schedule import (
    COPY_PATH,
    OS_LISTS,
    TIER_INDEX,
    TIERS,
    Action,
    ActivationMode,
    Channel,
    ChunkList,
    Op,
    SolverStatus,
    Tier,
    action_channels,
)
from schemas.trace import DTYPE_BYTES, Phase

from schemas.residency import Refusal, ResidencyRefused, ValidCopies

from planner.costmodel import (
    PAGEABLE_POLICIES,
    adam_dram_bytes,
    channel_bytes_per_s,
    cpu_adam_params_per_s,
    dram_bytes,
    dram_bytes_per_s,
)
from planner.errors import PlannerError
from planner.presets import hardware_for
from planner.sim_result import Interval, MemorySample, ScheduleViolation, SimResult, ViolationKind


# ----------------------------------------------------------------------------- state


# array index of each tier in the simulator's per-tier lists (schemas.schedule.TIER_INDEX)
_DEVICE, _HOST, _NVME = (TIER_INDEX[t] for t in TIERS)


class _ActState(StrEnum):
    """Where a block's saved activations are."""

    ABSENT = "ABSENT"  # before the block's forward ends (counted in the recorded non-model bytes)
    ON_DEVICE = "ON_DEVICE"  # after forward (KEEP, RECOMPUTE's input, SWAP before offload) or after reload
    OFFLOADED = "OFFLOADED"  # SWAP: on HOST or NVME between ACT_OFFLOAD and ACT_RELOAD
    CONSUMED = "CONSUMED"  # the block's backward started


@dataclass(slots=True)
class _Server:
    """A FIFO channel (or a simplex set of channels) with its bandwidth per channel."""

    free_at: float = 0.0


@dataclass(slots=True)
class _Block:
    plan_mode: ActivationMode
    bytes: int
    input_bytes: int
    recompute_seconds: float
    recompute_flops: int
    fwd_last: int = -1
    bwd_first: int = -1
    state: _ActState = _ActState.ABSENT
    tier: Tier | None = None  # where an offloaded block's activations are
    ready_at: float = 0.0  # when reloaded activations are on DEVICE

    def moved_bytes(self) -> int:
        """What ACT_OFFLOAD moves: the saved activations, or a RECOMPUTE block's kept input (its checkpoint)."""
        return self.input_bytes if self.plan_mode is ActivationMode.RECOMPUTE else self.bytes

    def device_bytes(self) -> int:
        """Bytes this block holds on DEVICE while in its held window (fwd_last <= m < bwd_first)."""
        if self.state is _ActState.OFFLOADED:
            return 0
        if self.plan_mode is ActivationMode.RECOMPUTE:
            return self.input_bytes
        return self.bytes


@dataclass(slots=True)
class _Sim:
    schedule: Schedule
    hardware: Hardware
    lists: tuple[ChunkList, ...]
    list_index: dict[ChunkList, int]
    chunk_bytes: list[list[int]]  # [list][chunk]
    copies: ValidCopies  # which tiers hold a (valid) copy of each chunk: the residency rules
    ready: list[list[list[float]]]  # [list][chunk][tier] when the copy there is complete
    stepped: list[int]
    world: int
    owner: list[int]  # per chunk: its owner rank
    node_of: list[int]  # per rank: its node
    ranks_in_node: list[int]  # per node: how many ranks it hosts
    replicated: list[list[bool]]  # [list][chunk] a DEVICE copy is held by every rank (else by the owner only)
    place_bytes: list[list[list[int]]]  # [tier][rank (DEVICE) or node (HOST, NVME)][list]
    place_total: list[list[int]]  # [tier][rank or node]: sum over lists
    groups: dict[int, tuple[int, ...]]  # comm group -> its chunks
    servers: dict[tuple[Channel, int], _Server]  # per (channel, rank); NVMe, CPU and collectives shared
    rate: dict[Channel, float]
    pageable: bool = False  # DEVICE <-> HOST copies at the pageable rates (costmodel.PAGEABLE_POLICIES)
    dram: _Server = field(default_factory=_Server)  # host DRAM, shared by copies and CPU Adam
    dram_rate: float = float("inf")
    dram_busy: float = 0.0
    bytes_per_channel: dict[Channel, int] = field(default_factory=dict)
    busy: dict[Channel, float] = field(default_factory=dict)
    timeline: list[Interval] = field(default_factory=list)
    last_end: float = 0.0


def _bit(t: int) -> int:
    return 1 << int(t)


# ----------------------------------------------------------------------------- simulate


def simulate(schedule: Schedule, hardware: Hardware) -> SimResult:
    """Replay one iteration of `schedule` on `hardware`; raise ScheduleViolation on any broken rule."""
    if schedule.header.solver_status is SolverStatus.INFEASIBLE:
        raise PlannerError(f"schedule of policy {schedule.header.policy!r} is INFEASIBLE "
                           f"({'; '.join(schedule.header.notes) or 'no notes'}): there is nothing to replay")
    sim = _setup(schedule, hardware)
    moments = schedule.moments
    n_moments = len(moments)
    layout = schedule.layout
    tensor_chunk = {t.tensor: t.chunk for t in layout.tensors}
    trainable = {t.tensor for t in layout.tensors if t.trainable}
    pi = sim.list_index[ChunkList.PARAM]
    gi = sim.list_index.get(ChunkList.GRAD)

    # chunks each moment's work needs on DEVICE, and the last backward moment writing each GRAD chunk
    needs: list[tuple[int, ...]] = []
    writes: list[tuple[int, ...]] = []
    last_grad_write = [-1] * len(layout.chunks)
    for m in moments:
        if m.phase is Phase.OPTIMIZER:
            needs.append(())
            writes.append(())
            continue
        chunks = sorted({tensor_chunk[t] for t in m.tensors if t in tensor_chunk})
        needs.append(tuple(chunks))
        if m.phase is Phase.BACKWARD and gi is not None:
            w = tuple(sorted({tensor_chunk[t] for t in m.tensors if t in trainable and t in tensor_chunk}))
            writes.append(w)
            for c in w:
                last_grad_write[c] = m.id
        else:
            writes.append(())

    blocks = _blocks(schedule)
    # blocks whose held window contains moment m: fwd_last <= m < bwd_first
    window_start: dict[int, list[int]] = {}
    window_end: dict[int, list[int]] = {}
    bwd_first_of: dict[int, int] = {}
    for b, blk in enumerate(blocks):
        if blk.fwd_last >= 0 and blk.bwd_first > blk.fwd_last:
            window_start.setdefault(blk.fwd_last, []).append(b)
            window_end.setdefault(blk.bwd_first, []).append(b)
            bwd_first_of[blk.bwd_first] = b

    actions = schedule.actions
    by_moment: list[list[int]] = [[] for _ in range(n_moments)]
    for i, a in enumerate(actions):
        by_moment[a.moment].append(i)

    budgets = {_DEVICE: schedule.budgets.device_bytes, _HOST: schedule.budgets.host_bytes,
               _NVME: schedule.budgets.nvme_bytes}
    act_bytes = [0, 0, 0]  # activation bytes per tier (DEVICE: held-window part only)
    held_act_recorded = 0  # bytes of kept activations the recorded non-model curve includes right now
    peaks = [0, 0, 0]
    memory: list[MemorySample] = []
    starts: list[float] = []
    stall = 0.0
    compute_busy = 0.0
    world = schedule.header.world_size
    computes = [sim.servers[(Channel.COMPUTE, r)] for r in range(world)]
    event = 0.0
    flops = sum(m.flops for m in moments)
    recompute_flops = 0

    for m_ref in moments:
        m = m_ref.id
        # blocks entering their held window now: their activations are on DEVICE (recorded curve)
        for b in window_start.get(m, ()):
            blk = blocks[b]
            blk.state = _ActState.ON_DEVICE
            held_act_recorded += blk.bytes
            act_bytes[_DEVICE] += blk.device_bytes()
        deps = event
        for i in by_moment[m]:
            a = actions[i]
            end = _apply(sim, a, i, event, blocks, act_bytes, last_grad_write)
            if a.op is Op.FETCH or (sim.pageable and _blocks_host(a)):
                deps = max(deps, end)
            for t in TIER_INDEX.values():
                used = _used(sim, t, act_bytes)
                if used > budgets[t]:
                    raise ScheduleViolation(ViolationKind.CAPACITY, f"{TIERS[t].value} holds {used} bytes of chunks and "
                                            f"activations after this action, budget {budgets[t]}"
                                            f"{_place_name(sim, t, _busiest(sim, t))}",
                                            moment=m, action_index=i, list_=a.list, chunk=a.chunk if a.chunk >= 0 else None)

        # blocks leaving it (after the moment's actions, which may reload them): their backward starts
        for b in window_end.get(m, ()):
            blk = blocks[b]
            if blk.state is _ActState.OFFLOADED:
                raise ScheduleViolation(ViolationKind.ACTIVATIONS, f"block {b}'s backward starts but its activations "
                                        f"({blk.bytes} bytes) are still on {blk.tier.value}; reload them first",
                                        moment=m, block=b)
            held_act_recorded -= blk.bytes
            act_bytes[_DEVICE] -= blk.device_bytes()
            blk.state = _ActState.CONSUMED

        # the work: its chunks on DEVICE (and arrived), its block's activations back
        for c in needs[m]:
            if not sim.copies.is_valid(pi, c, _DEVICE):
                raise ScheduleViolation(ViolationKind.USE_BEFORE_ARRIVAL,
                                        f"the work of {m_ref.kind.value} {m_ref.module or '(root)'} needs PARAM chunk {c} "
                                        "on DEVICE and no valid copy is there", moment=m, list_=ChunkList.PARAM, chunk=c)
            deps = max(deps, sim.ready[pi][c][_DEVICE])
        for c in writes[m]:
            if not sim.copies.is_valid(gi, c, _DEVICE):
                raise ScheduleViolation(ViolationKind.USE_BEFORE_ARRIVAL,
                                        f"the backward work of {m_ref.module or '(root)'} accumulates GRAD chunk {c} "
                                        "on DEVICE and no valid copy is there (ALLOCATE or fetch it first)",
                                        moment=m, list_=ChunkList.GRAD, chunk=c)
            deps = max(deps, sim.ready[gi][c][_DEVICE])
        extra = 0.0
        if m in bwd_first_of:
            blk = blocks[bwd_first_of[m]]
            deps = max(deps, blk.ready_at)
            if blk.plan_mode is ActivationMode.RECOMPUTE:
                extra = blk.recompute_seconds
                recompute_flops += blk.recompute_flops

        start = max(deps, *(c.free_at for c in computes))
        stall += max(0.0, deps - event)
        duration = m_ref.compute_seconds + extra
        end = start + duration
        for c in computes:  # every rank runs the same work (SPMD)
            c.free_at = end
        compute_busy += duration
        if duration > 0:
            sim.timeline.append(Interval(channel=Channel.COMPUTE, start_seconds=start, end_seconds=end,
                                         label=f"{m_ref.phase.value.lower()} {m_ref.module or '(root)'}"))
        starts.append(start)
        for c in writes[m]:
            if sim.world > 1:
                _hold(sim, gi, c, _DEVICE, everywhere=True)  # every rank accumulates its own grads
            sim.copies.write_grads(c)  # DEVICE only: copies elsewhere are stale now
            sim.ready[gi][c][_DEVICE] = end

        # memory during the work
        recorded_nm = m_ref.non_model_bytes
        non_model = max(0, recorded_nm - held_act_recorded)
        for t in TIER_INDEX.values():
            place = _busiest(sim, t)
            chunk_b = {lst: sim.place_bytes[t][place][li] for li, lst in enumerate(sim.lists)}
            nm = non_model if t == _DEVICE else 0
            acts = act_bytes[t] * (1 if t == _DEVICE else sim.ranks_in_node[place])
            total = sum(chunk_b.values()) + acts + nm
            if total > budgets[t]:
                raise ScheduleViolation(ViolationKind.CAPACITY,
                                        f"{TIERS[t].value} needs {total} bytes during the work of "
                                        f"{m_ref.kind.value} {m_ref.module or '(root)'} (chunks {sum(chunk_b.values())}, "
                                        f"activations {acts}, non-model {nm}), budget {budgets[t]}"
                                        f"{_place_name(sim, t, place)}", moment=m)
            peaks[t] = max(peaks[t], total)
            memory.append(MemorySample(moment=m, tier=TIERS[t], non_model_bytes=nm, activation_bytes=acts,
                                       chunk_bytes=chunk_b))
        event = end

    _check_end(sim, schedule, last_grad_write, n_moments)
    iteration = max(event, sim.last_end, *(s.free_at for s in sim.servers.values()))
    busy = {ch: sim.busy.get(ch, 0.0) for ch in Channel}
    busy[Channel.COMPUTE] += compute_busy
    return SimResult(
        iteration_seconds=iteration,
        tflops=world * flops / iteration / 1e12 if iteration > 0 else 0.0,  # every rank does this work
        flops=flops,
        recompute_flops=recompute_flops,
        bytes_per_channel={ch: sim.bytes_per_channel.get(ch, 0) for ch in Channel},
        busy_seconds_per_channel=busy,
        peak_bytes_per_tier={TIERS[t]: peaks[t] for t in TIER_INDEX.values()},
        stall_seconds=stall,
        compute_seconds=compute_busy,
        moment_start_seconds=tuple(starts),
        memory=tuple(memory),
        timeline=tuple(sorted(sim.timeline, key=lambda i: (i.start_seconds, i.channel.value))),
    )


def _setup(schedule: Schedule, hardware: Hardware) -> _Sim:
    layout = schedule.layout
    lists = tuple(layout.lists)
    list_index = {lst: i for i, lst in enumerate(lists)}
    n = len(layout.chunks)
    chunk_bytes = [[c.elements * DTYPE_BYTES[layout.list_dtypes[lst]] for c in layout.chunks] for lst in lists]
    ready = [[[0.0, 0.0, 0.0] for _ in range(n)] for _ in lists]
    world = schedule.header.world_size
    per_node = max(1, min(hardware.cluster.gpus_per_node, world))
    node_of = [r // per_node for r in range(world)]
    n_nodes = node_of[-1] + 1
    places = {_DEVICE: world, _HOST: n_nodes, _NVME: n_nodes}
    # per node: the SSD set (one simplex server for reads and writes) and the CPU optimizer, shared by
    # the node's ranks (PatrickStar §9.1's 12 cores serve its 8 ranks); collectives: one cluster-wide
    # server priced by Hardware.collective_seconds (intra- vs inter-node)
    nvme = [_Server() for _ in range(n_nodes)]
    cpu = [_Server() for _ in range(n_nodes)]
    collectives = _Server()

    def server(ch: Channel, rank: int) -> _Server:
        if ch in (Channel.NVME_READ, Channel.NVME_WRITE):
            return nvme[node_of[rank]]
        if ch is Channel.CPU_OPTIMIZER:
            return cpu[node_of[rank]]
        return collectives if ch is Channel.INTER_GPU else _Server()

    servers = {(ch, rank): server(ch, rank) for ch in Channel for rank in range(schedule.header.world_size)}
    if hardware.device.kind is DeviceKind.CPU_EMULATED:  # one set of cores computes and steps
        for rank in range(world):
            servers[(Channel.CPU_OPTIMIZER, rank)] = servers[(Channel.COMPUTE, rank)]
    rate = {ch: channel_bytes_per_s(hardware, ch)  # pinned; NVMe behind the host-side cap
            for ch in (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE, Channel.INTER_GPU)}
    sim = _Sim(schedule=schedule, hardware=hardware, lists=lists, list_index=list_index, chunk_bytes=chunk_bytes,
               copies=ValidCopies(lists, n), ready=ready, stepped=[0] * n, world=world,
               owner=[c.owner_rank for c in layout.chunks], node_of=node_of,
               ranks_in_node=[node_of.count(k) for k in range(n_nodes)],
               replicated=[[False] * n for _ in lists],
               place_bytes=[[[0] * len(lists) for _ in range(places[t])] for t in TIER_INDEX.values()],
               place_total=[[0] * places[t] for t in TIER_INDEX.values()],
               servers=servers, rate=rate, groups=_comm_groups(layout),
               pageable=schedule.header.policy in PAGEABLE_POLICIES, dram_rate=dram_bytes_per_s(hardware))
    for r in schedule.initial_residency:
        li = list_index[r.list]
        for tier in r.tiers:
            # PARAM and GRAD on DEVICE: every rank's copy (what the iteration computes with); OS: the owner's
            _hold(sim, li, r.chunk, TIER_INDEX[tier], everywhere=r.list in (ChunkList.PARAM, ChunkList.GRAD))
            sim.copies.start(li, r.chunk, TIER_INDEX[tier])
    return sim


# ----------------------------------------------------------------------------- memory per rank / node


def _comm_groups(layout) -> dict[int, tuple[int, ...]]:
    groups: dict[int, list[int]] = {}
    for c in layout.chunks:
        groups.setdefault(c.comm_group, []).append(c.id)
    return {g: tuple(cs) for g, cs in groups.items()}


def _add(sim: _Sim, t: int, place: int, li: int, nbytes: int) -> None:
    sim.place_bytes[t][place][li] += nbytes
    sim.place_total[t][place] += nbytes


def _hold(sim: _Sim, li: int, c: int, t: int, *, everywhere: bool = False) -> None:
    """Tier t now holds a copy of (list li, chunk c): the owner's (or, on DEVICE, every rank's)."""
    size = sim.chunk_bytes[li][c]
    owner = sim.owner[c]
    if t != _DEVICE:
        if sim.copies.hold(li, c, t):
            _add(sim, t, sim.node_of[owner], li, size)
        return
    if sim.copies.hold(li, c, t):
        sim.replicated[li][c] = False
        _add(sim, t, owner, li, size)
    if everywhere and not sim.replicated[li][c]:
        sim.replicated[li][c] = True
        for r in range(sim.world):
            if r != owner:
                _add(sim, t, r, li, size)


def _drop(sim: _Sim, li: int, c: int, t: int) -> None:
    """Tier t no longer holds its copy (sim.copies.evict said so): its bytes leave the owner (or every rank)."""
    size = sim.chunk_bytes[li][c]
    owner = sim.owner[c]
    if t != _DEVICE:
        _add(sim, t, sim.node_of[owner], li, -size)
        return
    for r in (range(sim.world) if sim.replicated[li][c] else (owner,)):
        _add(sim, t, r, li, -size)
    sim.replicated[li][c] = False


def _busiest(sim: _Sim, t: int) -> int:
    """The rank (DEVICE) or node (HOST, NVME) holding the most chunk bytes."""
    totals = sim.place_total[t]
    return 0 if len(totals) == 1 else max(range(len(totals)), key=totals.__getitem__)


def _used(sim: _Sim, t: int, act_bytes: list[int]) -> int:
    """Chunks and activations on the busiest rank (DEVICE) or node (HOST, NVME)."""
    if t == _DEVICE:
        return max(sim.place_total[t]) + act_bytes[t]
    return max(total + act_bytes[t] * sim.ranks_in_node[k] for k, total in enumerate(sim.place_total[t]))


def _place_name(sim: _Sim, t: int, place: int) -> str:
    if sim.world == 1:
        return ""
    return f" (rank {place}, per-rank budget)" if t == _DEVICE else f" (node {place}, shared by {sim.ranks_in_node[place]} ranks)"


def _blocks(schedule: Schedule) -> list[_Block]:
    blocks = [_Block(plan_mode=p.mode, bytes=p.bytes, input_bytes=p.input_bytes, recompute_seconds=p.recompute_seconds,
                     recompute_flops=p.recompute_flops) for p in schedule.activation_plans]
    for m in schedule.moments:
        if 0 <= m.block < len(blocks):
            blk = blocks[m.block]
            if m.phase is Phase.FORWARD:
                blk.fwd_last = m.id
            elif m.phase is Phase.BACKWARD and blk.bwd_first < 0:
                blk.bwd_first = m.id
    return blocks


def _transfer(sim: _Sim, channels: tuple[Channel, ...], nbytes: int, issue: float, ready: float, label: str,
              *, m: int, i: int, action: Action, rank: int = 0, node_ranks: int = 1) -> float:
    """Queue a transfer on every channel of its path (on `rank`'s links); returns when it completes.
    `node_ranks`: how many ranks of the node move the same bytes at once (activations: every rank
    swaps its own), which the node's shared SSDs carry together."""
    for ch in channels:
        if sim.rate[ch] <= 0:
            raise ScheduleViolation(ViolationKind.CHANNEL, f"{ch.value} has no bandwidth on hardware "
                                    f"{sim.hardware.name!r} (no SSDs or a single GPU?)", moment=m, action_index=i,
                                    list_=action.list, chunk=action.chunk if action.chunk >= 0 else None)
    start = max(issue, ready, *(sim.servers[(ch, rank)].free_at for ch in channels))
    pageable = sim.pageable and set(channels) <= {Channel.H2D, Channel.D2H}
    other = {Channel.H2D: Channel.D2H, Channel.D2H: Channel.H2D}
    rates = {}
    for ch in channels:
        if ch in other:  # both ways at once: the other direction still busy as this copy starts
            duplex = sim.servers[(other[ch], rank)].free_at > start
            rates[ch] = channel_bytes_per_s(sim.hardware, ch, pageable=pageable, duplex=duplex)
        else:
            rates[ch] = sim.rate[ch]
    # a node's SSDs serve every rank of the node (the simulator replays one rank: its NVMe share is q x)
    duration = max(nbytes * (node_ranks if ch in (Channel.NVME_READ, Channel.NVME_WRITE) else 1) / rates[ch]
                   for ch in channels)
    end = max(start + duration, _draw_dram(sim, dram_bytes(sim.hardware, channels, nbytes, pageable=pageable), start))
    for ch in channels:
        sim.servers[(ch, rank)].free_at = end
        sim.bytes_per_channel[ch] = sim.bytes_per_channel.get(ch, 0) + nbytes
        sim.busy[ch] = sim.busy.get(ch, 0.0) + nbytes / rates[ch]
        if duration > 0:
            sim.timeline.append(Interval(channel=ch, start_seconds=start, end_seconds=end, label=label))
    sim.last_end = max(sim.last_end, end)
    return end


_COPY_OPS = frozenset({Op.FETCH, Op.PREFETCH, Op.WRITE_BACK, Op.ACT_OFFLOAD, Op.ACT_RELOAD})


def _blocks_host(a: Action) -> bool:
    """A DEVICE <-> HOST copy through pageable memory holds the thread that issues the moment's work
    until it is done: cudaMemcpyAsync to pageable host memory returns only once the copy has
    completed, and from pageable memory only once the buffer is staged for DMA (CUDA Runtime API,
    "API synchronization behavior"), the staging being the pageable rate's bottleneck; DeepSpeed's
    one-rank fetch then synchronizes its stream (`partition_parameters.py` `NoGatherCoalescedHandle.wait`,
    called from `fetch_sub_module` before the sub-module's kernels and before its prefetches are issued).
    So the moment's work cannot start before it: Fuyou §3 (Fig. 2a) measured ZeRO-Infinity's
    CPU->GPU, compute and GPU->CPU "serialized" (docs/baselines.md ZI.7)."""
    if a.op not in _COPY_OPS:
        return False
    channels = action_channels(a)
    return bool(channels) and set(channels) <= {Channel.H2D, Channel.D2H}


def _draw_dram(sim: _Sim, nbytes: float, start: float) -> float:
    """Reserve `nbytes` of host DRAM bandwidth from `start` (after what is reserved already); returns
    when the reservation ends (`start` when the profile gives no DRAM bandwidth)."""
    if nbytes <= 0 or sim.dram_rate == float("inf"):
        return start
    begin = max(start, sim.dram.free_at)
    sim.dram.free_at = begin + nbytes / sim.dram_rate
    sim.dram_busy += nbytes / sim.dram_rate
    return sim.dram.free_at


def _apply(sim: _Sim, a: Action, i: int, issue: float, blocks: list[_Block], act_bytes: list[int],
           last_grad_write: list[int]) -> float:
    """Apply action `i` issued at time `issue`; returns when it completes."""
    m = a.moment
    if a.op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK):
        li = _list(sim, a, i)
        c = a.chunk
        if a.src == a.dst:
            raise ScheduleViolation(ViolationKind.BAD_ACTION, f"{a.op.value} from {a.src.value} to itself",
                                    moment=m, action_index=i, list_=a.list, chunk=c)
        path = _path(a, i)
        if a.channel not in path:
            raise ScheduleViolation(ViolationKind.CHANNEL, f"{a.op.value} {a.src.value}->{a.dst.value} crosses "
                                    f"{'+'.join(ch.value for ch in path)}, the action names {a.channel.value}",
                                    moment=m, action_index=i, list_=a.list, chunk=c)
        s, d = TIER_INDEX[a.src], TIER_INDEX[a.dst]
        if not sim.copies.is_valid(li, c, s):
            raise ScheduleViolation(ViolationKind.COPY_WITHOUT_SOURCE,
                                    f"{a.op.value} {a.list.value} chunk {c} from {a.src.value}, which holds "
                                    f"{'a stale copy' if sim.copies.holds(li, c, s) else 'no copy'}",
                                    moment=m, action_index=i, list_=a.list, chunk=c)
        nbytes = a.bytes or sim.chunk_bytes[li][c]
        end = _transfer(sim, path, nbytes, issue, sim.ready[li][c][s], f"{a.op.value.lower()} {a.list.value} {c}",
                        m=m, i=i, action=a, rank=sim.schedule.layout.chunks[c].owner_rank)
        _hold(sim, li, c, d)
        sim.copies.copy(li, c, s, d)
        sim.ready[li][c][d] = end
        return end
    if a.op is Op.EVICT:
        li = _list(sim, a, i)
        c, s = a.chunk, TIER_INDEX[a.src]
        try:
            sim.copies.evict(li, c, s)
        except ResidencyRefused as exc:
            if exc.refusal is Refusal.NOT_HELD:
                raise ScheduleViolation(ViolationKind.EVICT_ABSENT, f"EVICT {a.list.value} chunk {c} from "
                                        f"{a.src.value}, which holds no copy", moment=m, action_index=i, list_=a.list,
                                        chunk=c) from None
            raise ScheduleViolation(ViolationKind.EVICT_LAST_COPY, f"EVICT {a.list.value} chunk {c} from {a.src.value} "
                                    "drops its last valid copy (write it back first)",
                                    moment=m, action_index=i, list_=a.list, chunk=c) from None
        _drop(sim, li, c, s)
        return issue
    if a.op is Op.ALLOCATE:
        li = _list(sim, a, i)
        c, d = a.chunk, TIER_INDEX[a.dst]
        _hold(sim, li, c, d, everywhere=True)  # on DEVICE every rank allocates its own
        sim.copies.allocate(li, c, d)  # a fresh zero chunk: other copies are stale
        sim.ready[li][c][d] = issue
        return issue
    if a.op is Op.OPTIMIZER_STEP:
        return _optimizer_step(sim, a, i, issue, last_grad_write)
    if a.op in (Op.ACT_OFFLOAD, Op.ACT_RELOAD):
        return _activation(sim, a, i, issue, blocks, act_bytes)
    if a.op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
        # comm group `chunk`: bytes over INTER_GPU, once the group's copies on DEVICE are there (the
        # owners' fetched shards, the written grads); afterwards every chunk of the group is ready on
        # DEVICE (an all-gather leaves a copy on every rank)
        li = _list(sim, a, i)
        group = sim.groups.get(a.chunk, ())
        inputs = [sim.ready[li][c][_DEVICE] for c in group if sim.copies.is_valid(li, c, _DEVICE)]
        end = _transfer(sim, (Channel.INTER_GPU,), a.bytes, issue, max(inputs, default=issue),
                        f"{a.op.value.lower()} {a.chunk}", m=m, i=i, action=a)
        for c in group:
            if a.op is Op.ALL_GATHER:
                _hold(sim, li, c, _DEVICE, everywhere=True)
                sim.copies.gather(li, c)
                sim.ready[li][c][_DEVICE] = end
            elif sim.copies.is_valid(li, c, _DEVICE):
                sim.ready[li][c][_DEVICE] = end
        return end
    raise ScheduleViolation(ViolationKind.BAD_ACTION, f"unknown op {a.op}", moment=m, action_index=i)


def _path(a: Action, i: int) -> tuple[Channel, ...]:
    if (a.src, a.dst) not in COPY_PATH:
        raise ScheduleViolation(ViolationKind.BAD_ACTION, f"{a.op.value} from {a.src} to {a.dst}: no such path",
                                moment=a.moment, action_index=i, list_=a.list, chunk=a.chunk if a.chunk >= 0 else None,
                                block=a.block if a.block >= 0 else None)
    return COPY_PATH[(a.src, a.dst)]


def _list(sim: _Sim, a: Action, i: int) -> int:
    if a.list not in sim.list_index:
        raise ScheduleViolation(ViolationKind.BAD_ACTION, f"list {a.list} is not in the layout", moment=a.moment,
                                action_index=i, chunk=a.chunk)
    return sim.list_index[a.list]


def _optimizer_step(sim: _Sim, a: Action, i: int, issue: float, last_grad_write: list[int]) -> float:
    m, c, d = a.moment, a.chunk, TIER_INDEX[a.dst]
    if m <= last_grad_write[c]:
        raise ScheduleViolation(ViolationKind.OPTIMIZER_EARLY, f"chunk {c}'s grads are still written by the backward "
                                f"work of moment {last_grad_write[c]}", moment=m, action_index=i, chunk=c)
    sim.stepped[c] += 1
    if sim.stepped[c] > 1:
        raise ScheduleViolation(ViolationKind.OPTIMIZER_COUNT, f"chunk {c} stepped twice in one iteration",
                                moment=m, action_index=i, chunk=c)
    inputs = [sim.list_index[lst] for lst in (ChunkList.PARAM, ChunkList.GRAD, *OS_LISTS) if lst in sim.list_index]
    try:
        sim.copies.step(c, d, inputs)  # afterwards the inputs are valid on d only, GRAD dead
    except ResidencyRefused as exc:
        lst = sim.lists[exc.list_index]
        raise ScheduleViolation(ViolationKind.OPTIMIZER_INPUTS, f"OPTIMIZER_STEP on {a.dst.value} needs a valid "
                                f"{lst.value} copy there", moment=m, action_index=i, list_=lst, chunk=c) from None
    ready = max(issue, *(sim.ready[li][c][d] for li in inputs))
    params = sim.schedule.layout.chunks[c].used_elements
    server_key = (Channel.CPU_OPTIMIZER if d == _HOST else Channel.COMPUTE, sim.schedule.layout.chunks[c].owner_rank)
    start = max(ready, sim.servers[server_key].free_at)
    if d == _HOST:
        # with copies beside it: a PCIe or SSD server still busy as the step starts (findings 2026-11-23)
        copies = any(srv.free_at > start for (ch, _), srv in sim.servers.items()
                     if ch in (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE))
        channel, rate = Channel.CPU_OPTIMIZER, cpu_adam_params_per_s(sim.hardware, with_copies=copies)
    elif d == _DEVICE:
        channel, rate = Channel.COMPUTE, sim.hardware.device.optimizer_params_per_s
    else:
        raise ScheduleViolation(ViolationKind.BAD_ACTION, "OPTIMIZER_STEP runs on DEVICE or HOST, found NVME",
                                moment=m, action_index=i, chunk=c)
    server = sim.servers[server_key]
    end = start + params / rate
    if d == _HOST:
        end = max(end, _draw_dram(sim, adam_dram_bytes(sim.hardware, params), start))
    server.free_at = end
    sim.busy[channel] = sim.busy.get(channel, 0.0) + params / rate
    sim.timeline.append(Interval(channel=channel, start_seconds=start, end_seconds=end, label=f"adam {c}"))
    sim.last_end = max(sim.last_end, end)
    for li in inputs:
        if sim.lists[li] is not ChunkList.GRAD:
            sim.ready[li][c][d] = end
    return end


def _activation(sim: _Sim, a: Action, i: int, issue: float, blocks: list[_Block], act_bytes: list[int]) -> float:
    m, b = a.moment, a.block
    blk = blocks[b]
    if blk.plan_mode is ActivationMode.KEEP:
        raise ScheduleViolation(ViolationKind.ACTIVATIONS, f"{a.op.value} for a block planned {blk.plan_mode.value}",
                                moment=m, action_index=i, block=b)
    moved = blk.moved_bytes()
    nbytes = a.bytes or moved
    if a.op is Op.ACT_OFFLOAD:
        if blk.state is not _ActState.ON_DEVICE:
            raise ScheduleViolation(ViolationKind.ACTIVATIONS, f"ACT_OFFLOAD while the block's activations are "
                                    f"{blk.state.value} (offload after its forward, before its backward)",
                                    moment=m, action_index=i, block=b)
        path = _path(dataclasses.replace(a, src=Tier.DEVICE), i)
        if a.channel not in path:
            raise ScheduleViolation(ViolationKind.CHANNEL, f"ACT_OFFLOAD to {a.dst.value} crosses "
                                    f"{'+'.join(ch.value for ch in path)}, the action names {a.channel.value}",
                                    moment=m, action_index=i, block=b)
        end = _transfer(sim, path, nbytes, issue, issue, f"offload act {b}", m=m, i=i, action=a, node_ranks=sim.ranks_in_node[0])
        act_bytes[_DEVICE] -= blk.device_bytes()
        blk.state, blk.tier = _ActState.OFFLOADED, a.dst
        act_bytes[TIER_INDEX[a.dst]] += moved
        blk.ready_at = end  # a reload cannot start before the offload is done
        return end
    if blk.state is not _ActState.OFFLOADED or blk.tier is not a.src:
        raise ScheduleViolation(ViolationKind.ACTIVATIONS, f"ACT_RELOAD from {a.src.value} while the block's "
                                f"activations are {blk.state.value}{' on ' + blk.tier.value if blk.tier else ''}",
                                moment=m, action_index=i, block=b)
    path = _path(dataclasses.replace(a, dst=Tier.DEVICE), i)
    if a.channel not in path:
        raise ScheduleViolation(ViolationKind.CHANNEL, f"ACT_RELOAD from {a.src.value} crosses "
                                f"{'+'.join(ch.value for ch in path)}, the action names {a.channel.value}",
                                moment=m, action_index=i, block=b)
    end = _transfer(sim, path, nbytes, issue, blk.ready_at, f"reload act {b}", m=m, i=i, action=a, node_ranks=sim.ranks_in_node[0])
    act_bytes[TIER_INDEX[a.src]] -= moved
    blk.state, blk.tier, blk.ready_at = _ActState.ON_DEVICE, None, end
    act_bytes[_DEVICE] += blk.device_bytes()
    return end


def _check_end(sim: _Sim, schedule: Schedule, last_grad_write: list[int], n_moments: int) -> None:
    last = n_moments - 1
    trainable_chunks = {t.chunk for t in schedule.layout.tensors if t.trainable}
    for c in sorted(trainable_chunks):
        if sim.stepped[c] == 0 and ChunkList.GRAD in sim.list_index:
            raise ScheduleViolation(ViolationKind.OPTIMIZER_COUNT, f"chunk {c} holds trainable params and is never "
                                    "stepped", moment=last, chunk=c)
    initial: dict[tuple[ChunkList, int], int] = {}
    for r in schedule.initial_residency:
        initial[(r.list, r.chunk)] = sum(_bit(TIER_INDEX[t]) for t in r.tiers)
    for li, lst in enumerate(sim.lists):
        for c in range(len(schedule.layout.chunks)):
            want = initial.get((lst, c), 0)
            if sim.copies.ends_as_started(li, c, want):
                continue
            held, valid = sim.copies.held[li][c], sim.copies.valid[li][c]
            have = held if lst is ChunkList.GRAD else valid
            stale = held & ~valid
            raise ScheduleViolation(ViolationKind.STEADY_STATE,
                                    f"the iteration ends with {lst.value} chunk {c} valid on {_names(have)}"
                                    f"{' and stale on ' + _names(stale) if stale and lst is not ChunkList.GRAD else ''}, "
                                    f"it started valid on {_names(want)}", moment=last, list_=lst, chunk=c)


def _names(mask: int) -> str:
    names = [TIERS[t].value for t in TIER_INDEX.values() if mask & _bit(t)]
    return "+".join(names) if names else "no tier"


# ----------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        description="Discrete-event replay of one iteration of SCHEDULE on the hardware: iteration seconds, TFLOPS, "
                    "bytes and busy seconds per channel, peak bytes per tier, stalls. A schedule that breaks the "
                    "action semantics (use before arrival, capacity, last copy evicted, steady state) is an error "
                    "naming the moment, action and chunk.")
    p.add_argument("schedule", metavar="SCHEDULE", help="schedule file (.msgpack)")
    p.add_argument("--trace", metavar="TRACE", help="the trace the schedule was solved from (checks its digest)")
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help="hardware preset or TOML (default: the preset named in the schedule's header)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--detail", action="store_true", help="with --json: per-moment memory and the channel timeline")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    schedule = Schedule.read(args.schedule)
    hardware = hardware_for(schedule, args.hardware, source=args.schedule)
    if args.trace:
        digest = digest_bytes(read_bytes("trace", args.trace))
        if digest != schedule.header.trace_digest:
            raise PlannerError(f"{args.trace}: digest {digest[:19]}... is not the trace the schedule was solved from "
                               f"({schedule.header.trace_digest[:19]}...); re-solve or pass the right trace")
    result = simulate(schedule, hardware)
    if args.json:
        print(json.dumps({"schedule": str(args.schedule), "policy": schedule.header.policy, "hardware": hardware.name,
                          **result.to_json(detail=args.detail)}, indent=2))
        return 0
    _print(result, schedule, hardware, Path(args.schedule).name)
    return 0


def _print(result: SimResult, schedule: Schedule, hardware: Hardware, name: str) -> None:
    console = Console()
    console.print(f"[bold]{name}[/bold]: policy {schedule.header.policy}, model {schedule.header.model_name}, "
                  f"hardware {hardware.name}")
    console.print(f"iteration {result.iteration_seconds:.4f} s, {result.tflops:.2f} TFLOPS, "
                  f"stalls {result.stall_seconds:.4f} s, predicted {schedule.prediction.iteration_seconds:.4f} s")
    table = Table(title="channels")
    for col in ("channel", "GB", "busy s", "busy %"):
        table.add_column(col, justify="right" if col != "channel" else "left")
    for ch in Channel:
        busy = result.busy_seconds_per_channel[ch]
        table.add_row(ch.value, f"{result.bytes_per_channel.get(ch, 0) / 1e9:.3f}", f"{busy:.4f}",
                      f"{100 * busy / result.iteration_seconds:.1f}" if result.iteration_seconds else "-")
    console.print(table)
    peaks = Table(title="peak bytes per tier")
    for col in ("tier", "peak GB", "budget GB"):
        peaks.add_column(col, justify="right" if col != "tier" else "left")
    budget = {Tier.DEVICE: schedule.budgets.device_bytes, Tier.HOST: schedule.budgets.host_bytes,
              Tier.NVME: schedule.budgets.nvme_bytes}
    for tier in Tier:
        peaks.add_row(tier.value, f"{result.peak_bytes_per_tier[tier] / 1e9:.3f}", f"{budget[tier] / 1e9:.3f}")
    console.print(peaks)


__all__ = ["Interval", "MemorySample", "ScheduleViolation", "SimResult", "ViolationKind", "register", "simulate"]
