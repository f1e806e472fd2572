"""What each action of a schedule does in the simulator (`planner.simulate`): copies and evictions with
their channels, optimizer steps, activation offload and reload, collectives, and the end-of-iteration
checks (every chunk stepped once, residency back to where it started).
"""

from __future__ import annotations

import dataclasses

from schemas import Schedule
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
    Tier,
    action_channels,
)

from schemas.residency import Refusal, ResidencyRefused
from schemas.trace import Phase

from planner.costmodel import (channel_bytes_per_s, cpu_adam_beside_copies, cpu_adam_threads, dram_bytes, nvme_two_way_facets,
                               optimizer_step_price, pcie_two_way_facets)
from planner.sim_result import Interval, ScheduleViolation, ViolationKind
from planner.sim_state import (DEVICE_INDEX, HOST_INDEX, ActState, BlockState, Calendar, CopyKind, SimState, drop, hold,
                               hold_until_landed, resync_slot, scatter, tier_bit)

# Note [simulator channels]:
# H2D, D2H, INTER_GPU and COMPUTE are independent servers. NVMe is ONE simplex server per
# SSD set: reads and writes queue on it together (Fuyou §4.3, "SSD I/O is simplex"), reads at
# `count * read rate`, writes at `count * write rate`, each at most the host-side cap
# (`nvme.host_cap_gb_per_s`); where the file measured the SSDs reading and writing at once
# (`nvme.mixed_*`), a read server and a write server instead, each at its rate alone, sharing the
# SSDs as a two-way link (Note [two-way links in the simulator]). Each copy runs at the rates the
# hardware file measured at its size (`links.copy_rates`, `nvme.chunk_rates`; none: the flat rates,
# issue 17). H2D/D2H run at the pinned rates alone, sharing the PCIe link both ways where the file
# measured the both-ways (`duplex_*`) rates (the same Note); DEVICE <-> HOST copies of a
# schedule whose header says its HOST copies are pageable (`header.host_staging`) at the pageable rates;
# such a copy also holds the work of the moment that issued it until it is done (pageable
# cudaMemcpyAsync blocks the issuing thread: `blocks_host`), so those systems' copies and compute
# run in series, as Fuyou §3 measured DeepSpeed's.
# Host DRAM is shared bandwidth: every copy leg through host memory and every CPU Adam step
# reserves its DRAM bytes / `host.dram_gb_per_s` in the DRAM's free time from when it starts
# (`Calendar`, not a queue in placement order) and cannot end before its reservation does, so the
# iteration is never shorter than the DRAM bytes / bandwidth.
# CPU_OPTIMIZER runs OPTIMIZER_STEP on HOST at the cost model's one price of a step
# (`costmodel.optimizer_step_price`): the CPU Adam rate at the chunk size with the executor's thread
# count (`costmodel.cpu_adam_threads`: all cores, or half of them for a step overlapped with
# backward on an emulated DEVICE), at the rate measured with copies beside it while a PCIe or SSD
# copy runs on its node (Note [CPU Adam beside copies]); an OPTIMIZER_STEP on DEVICE queues on COMPUTE at
# `device.optimizer_params_per_s`. On an emulated DEVICE (`device.kind = "cpu-emulated"`) the
# device's compute IS the host's cores, so CPU_OPTIMIZER queues on the rank's COMPUTE server in
# issue order: a CPU step overlapped with backward delays the backward work issued after it (busy
# time is still reported per channel). Conservative: the executor's optimizer worker runs at the
# lowest CPU priority, so backward goes first there; the work on the cores is the same.
# A copy between DEVICE and NVME crosses HOST: it occupies both
# channels of its path at once (pipelined through a bounce buffer) and its bytes count on both.

# Note [two-way links in the simulator]:
# A PCIe link (per rank) moving H2D and D2H at once, and SSDs (per node) reading and writing at once
# where the file measured their mixed rates, are shared resources, priced the way host DRAM is. The
# link's both-ways region is costmodel.two_way_rows: R bytes one way and W the other need at least
# max_k a_k R + b_k W seconds, the least time of any overlap at the rates alone and both at once
# (LP duality). The simulator keeps one `Calendar` per facet k (`costmodel.two_way_facets`: the rows
# that charge both directions, named so that the names hold at every copy size) and link; a copy of n
# bytes reserves a_k n seconds (the other direction: b_k n) in each facet's free time from its start
# on, at the facets of its own size (and pageable or pinned rates), and cannot end before its
# reservations do (as `_draw_dram`). Its direction's server still runs it at its rate alone, FIFO
# (the CUDA stream, the SSD queue). Over any interval the copies then satisfy every row, so no replay
# beats `two_way_rows` and the placement model's own rows (`pcie_time_rows`, `nvme_time_rows`) bound
# every replay (issue 17 item 4). Before, a copy fixed its rate at its start (alone if the other
# direction was idle, both-ways if busy) and kept it: an H2D started alone ran at 25.5 GB/s while
# D2H copies started under it ran at the both-ways 24 GB/s, outside the region; and a copy started
# under the other direction kept the slower rate after it ended (Fuyou 175B x a100-80g-12ssd at batch
# 32: NVMe reads 130.6 s busy at the mixed 26.4 GB/s, 49.4 s now; bench/RESULTS.md, l17).
# Physics, computed (tests/test_two_way_links.py replays it): 1 GB each way at 25.5 / 26 GB/s alone
# and 12.5 / 24 GB/s both ways. Processor sharing (both at the both-ways rates while both run, then
# the rest alone) ends D2H at 41.67 ms and H2D at 60.46 ms. The calendars
# end the copy placed first at its time alone (H2D 39.22 ms, or D2H 38.46 ms) and the other at 60.46
# ms: the same makespan, which is the rows' least time (60.46 ms); only who finishes first differs,
# the simulator granting the link to the copy it places first, a FIFO, where the hardware interleaves.
# A copy on an idle link ends at its time alone (no facet charges more than 1 / rate alone per byte:
# the rows are vertices of the dual, a r <= 1), and one that overlaps the other direction in part
# waits only for the facets' busy time it cannot fill.
# SSDs without measured mixed rates stay one simplex server (Fuyou Eq. 4; the rows are its own);
# presets whose mixed rates do not pay (mr/r + mw/w <= 1: a100-80g-12ssd's 12 x 2.2 GB/s against
# 78 / 40.8 GB/s alone) reserve the simplex row (1/r, 1/w) in their calendar, reads and writes then
# sharing the drives' time as on a simplex server.


def _transfer(sim: SimState, channels: tuple[Channel, ...], nbytes: int, issue: float, ready: float, label: str,
              *, m: int, i: int, action: Action, rank: int = 0, node_ranks: int = 1) -> float:
    """Queue a transfer on every channel of its path (on `rank`'s links); returns when it completes.
    `node_ranks`: how many ranks of the node move the same bytes at once (activations: every rank
    swaps its own), which the node's shared SSDs carry together."""
    kind = sim.copy_kinds.get((channels, nbytes, rank, node_ranks))
    if kind is None:
        kind = _copy_kind(sim, channels, nbytes, rank, node_ranks, m=m, i=i, action=action)
    start = max(issue, ready)
    for server in kind.servers:
        if server.free_at > start:
            start = server.free_at
    end = max(start + kind.duration, _draw_dram(sim, kind.dram_seconds, start))  # (Note [simulator channels])
    for calendar, seconds in kind.link_draws:  # both ways on one link (Note [two-way links in the simulator])
        reserved = calendar.reserve(start, seconds)
        if reserved > end:
            end = reserved
    if kind.copy:  # CPU Adam runs slower meanwhile (Note [CPU Adam beside copies])
        _slow_steps(sim, kind.node, start, end)
    for ch, server, busy in zip(channels, kind.servers, kind.busy_seconds):
        server.free_at = end
        sim.bytes_per_channel[ch] = sim.bytes_per_channel.get(ch, 0) + nbytes
        sim.busy[ch] = sim.busy.get(ch, 0.0) + busy
        if kind.duration > 0:
            sim.timeline.append(Interval(channel=ch, start_seconds=start, end_seconds=end, label=label))
    if end > sim.last_end:
        sim.last_end = end
    return end


def _copy_kind(sim: SimState, channels: tuple[Channel, ...], nbytes: int, rank: int, node_ranks: int,
               *, m: int, i: int, action: Action) -> CopyKind:
    """What every copy of `nbytes` over `channels` on `rank`'s links costs, made once per replay (`_transfer`)."""
    for ch in channels:
        if sim.rate[ch] <= 0:
            raise ScheduleViolation(ViolationKind.CHANNEL, f"{ch.value} has no bandwidth on hardware "
                                    f"{sim.hardware.name!r} (no SSDs or a single GPU?)", moment=m, action_index=i,
                                    list_=action.list, chunk=action.chunk if action.chunk >= 0 else None)
    pageable = sim.pageable and all(ch in _PCIE_CHANNELS for ch in channels)
    rates = []
    for ch in channels:  # each direction at its rate alone at this copy's size (links.copy_rates, nvme.chunk_rates)
        if ch in (Channel.H2D, Channel.D2H):
            rates.append(channel_bytes_per_s(sim.hardware, ch, pageable=pageable, nbytes=nbytes))
        elif ch in (Channel.NVME_READ, Channel.NVME_WRITE) and sim.hardware.nvme.chunk_rates:
            rates.append(channel_bytes_per_s(sim.hardware, ch, nbytes=nbytes))
        else:
            rates.append(sim.rate[ch])
    # a node's SSDs serve every rank of the node (the simulator replays one rank: its NVMe share is q x)
    moved = [nbytes * (node_ranks if ch in (Channel.NVME_READ, Channel.NVME_WRITE) else 1) for ch in channels]
    draws = []
    for ch, n in zip(channels, moved):
        if ch in _LINK_OF:
            draws += [(calendar, per_byte * n) for calendar, per_byte in _link_facets(sim, ch, rank, pageable, nbytes)]
    kind = CopyKind(servers=tuple(sim.servers[(ch, rank)] for ch in channels),
                    duration=max(n / r for n, r in zip(moved, rates)),
                    dram_seconds=_dram_seconds(sim, dram_bytes(sim.hardware, channels, nbytes, pageable=pageable)),
                    link_draws=tuple(draws), copy=any(ch in _COPY_CHANNELS for ch in channels),
                    node=sim.node_of[rank], busy_seconds=tuple(nbytes / r for r in rates))
    sim.copy_kinds[(channels, nbytes, rank, node_ranks)] = kind
    return kind


_COPY_OPS = frozenset({Op.FETCH, Op.PREFETCH, Op.WRITE_BACK, Op.ACT_OFFLOAD, Op.ACT_RELOAD})
_PCIE_CHANNELS = frozenset({Channel.H2D, Channel.D2H})
# a chunk copy's timeline label before its chunk number, per (op, list): "prefetch PARAM "
_LABELS = {(op, lst): f"{op.value.lower()} {lst.value} " for op in Op for lst in ChunkList}
# the channels whose traffic the CPU Adam rate "with copies" was measured beside (executor/profile.py
# `_Load`: memcpy through host DRAM and SSD writes); the simulator's old rule tested the same servers
_COPY_CHANNELS = frozenset({Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE})


# Note [CPU Adam beside copies]:
# A CPU Adam step runs at its rate alone while no copy runs on its node and at the rate measured with
# copies beside it (`host.adam_rates[].params_per_s_with_copies`, executor/profile.py `_Load`: a memcpy
# thread and SSD writes through host DRAM) while some copy does, instant by instant, for its whole
# duration, as DRAM and the cores are shared: `Coverage` keeps, per node, the union of the intervals
# in which an H2D, D2H or NVMe copy runs. A step placed after the copies it overlaps is timed through
# them (`Coverage.run`: 1 s alone per second outside, `slow` = rate with / rate alone inside); a copy
# placed after a step it overlaps (issued at a later moment, while the step still runs) charges the
# steps under the part of its interval no other copy covered yet `1 - slow` seconds (at the rate alone) of
# work per second of overlap, which the node's CPU optimizer server makes up before its next step (and the
# iteration's end): the step placed first keeps its own end, as the two-way links' calendars grant the copy
# placed first (Note [two-way links in the simulator]), and the make-up runs like a step, through the copies
# (`Coverage.run`) and slowed by copies placed after it (`Coverage.place_step`). So the CPU does at most
# (T - V) + slow x V of work at the rate alone in T seconds of which copies run V, the physics the placement
# model's rows assume (Note [CPU Adam beside copies, in the model] in planner/placement_time.py). Until session
# 17 the make-up ran at the rate alone even beside copies, a replay beating that row: a test box's Fuyou-like
# set replayed 1.537 s against the row's 1.585 s (1.678 s now; GPT-3 13B x rtx4090-768g-12ssd's golden 8.126 ->
# 8.245 s, 175B x a100-80g-12ssd's 112.533 -> 114.030 s; bench/RESULTS.md, session 17). One rate with copies
# whatever their number or direction: the profile measured one mix. Never faster than before for a step that
# ran alone, never slower than the with-copies rate throughout. Before (session 5, sim17), a step took
# the with-copies rate for its whole duration if a copy server was busy as it started and the alone
# rate otherwise: a step started alone ran at the alone rate under copies started later (97% of the
# GPT-3 175B golden's CPU Adam time ran under copies), one started under a short copy at the slow rate
# after it ended.


def _slow_steps(sim: SimState, node: int, start: float, end: float) -> None:
    """A copy runs on `node` over [start, end): the steps placed there already lose time under its new part."""
    cov = sim.coverage[node]
    pieces = cov.add(start, end)
    if not pieces or not cov.steps:
        return
    server = sim.servers[(Channel.CPU_OPTIMIZER, sim.node_of.index(node))]
    for lost, slow in cov.lost_seconds(pieces):
        # made up after the server's last work, at the rate alone outside copies and `slow` of it beside them,
        # and slowed by copies placed later as a step is
        begin = server.free_at
        server.free_at = cov.run(begin, lost, slow)
        cov.place_step(begin, server.free_at, slow)
        sim.busy[Channel.CPU_OPTIMIZER] = sim.busy.get(Channel.CPU_OPTIMIZER, 0.0) + server.free_at - begin
    sim.last_end = max(sim.last_end, server.free_at)


def blocks_host(a: Action) -> bool:
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


def _dram_seconds(sim: SimState, nbytes: float) -> float:
    """The host DRAM time `nbytes` take (0 when the profile gives no DRAM bandwidth)."""
    return nbytes / sim.dram_rate if nbytes > 0 and sim.dram_rate != float("inf") else 0.0


def _draw_dram(sim: SimState, seconds: float, start: float) -> float:
    """Reserve `seconds` of host DRAM bandwidth (`_dram_seconds`) from `start`, in the time DRAM is not reserved
    yet; returns when the reservation ends (`start` for none)."""
    if seconds <= 0:
        return start
    sim.dram_busy += seconds
    return sim.dram.reserve(start, seconds)


# the link each byte channel shares with the other direction, and which coefficient of its facets it pays
_LINK_OF = {Channel.H2D: ("pcie", 0), Channel.D2H: ("pcie", 1),
            Channel.NVME_READ: ("nvme", 0), Channel.NVME_WRITE: ("nvme", 1)}


def _link_facets(sim: SimState, ch: Channel, rank: int, pageable: bool, nbytes: int) -> list[tuple[Calendar, float]]:
    """The two-way facets of `ch`'s link (PCIe per rank, SSDs per node) as (calendar, seconds per byte) for a copy of
    `nbytes` in `ch`'s direction: `a` per byte for the first direction (H2D, NVMe read), `b` for the second, at the
    rates of a copy of that size; none on a full-duplex link or simplex SSDs, whose servers already price them."""
    kind, side = _LINK_OF[ch]
    place = rank if kind == "pcie" else sim.node_of[rank]
    facets = (pcie_two_way_facets(sim.hardware, pageable=pageable, nbytes=nbytes)
              if kind == "pcie" else nvme_two_way_facets(sim.hardware, nbytes=nbytes))
    return [(sim.links.setdefault((kind, place, name), Calendar()), row[side]) for name, row in facets.items()]


# Note [simulator evictions]:
# DEVICE bytes leave when the copies reading them have landed, not when their EVICT or ACT_OFFLOAD is
# issued: a chunk's DEVICE copy stays until every copy reading it (a WRITE_BACK, a copy to another
# tier) and the copy writing it have ended; a swapped block's activations (or an offloaded checkpoint)
# until its offload copy has. That is the GPU's rule: the copy engine records its source on the copy's
# stream (executor/copies.py `record_stream`), so PyTorch's caching allocator hands the memory out only
# once the copy's event has fired, and an allocation that finds no room first waits for every
# outstanding event (c10/cuda/CUDACachingAllocator.cpp: `release_cached_blocks` calls
# `synchronize_and_free_events`). So the simulator keeps those bytes (`SimState.landing`, per rank) until
# the copy lands; when an action or the moment's work would go over the DEVICE budget with them, the
# training thread (or the work) waits for them, the oldest issued first, until it fits (`land_oldest`:
# the executor's pool, below, waits so; the action that needed them keeps its start: the simulator placed
# it first). Until session 14 it waited for all of them, as the caching allocator's own
# `synchronize_and_free_events` does, while the executor gives the allocator back only what it waited
# for, oldest first (`Pool.make_room`). The same schedules replayed (bench/RESULTS.md "Session 14"): GPT-3
# 175B x rtx4090-768g-12ssd's chosen plan 120.784 -> 119.027 s; PatrickStar's 4B golden 2.3174 -> 2.3214 s
# (slower though no single wait is longer: the thread issues its next actions earlier, and a list schedule
# on shared links is not monotone in that; the copies that gain it not traced); the other
# goldens the same. HOST and NVME copies are freed as issued.
# ACT_RELOAD waits on the training thread for the block's offload (the executor's `wait_offloaded`).
# The executor follows the same rule (session 6, Note [retiring payloads] in executor/store.py): an EVICT
# returns at once and the payload's bytes stay counted against the DEVICE budget until its readers land
# (RETIRING); an allocation, or a moment's budget check, that finds no room waits for the oldest retiring
# buffers and offloads in flight, and counts their activation bytes until they land. Before, its EVICT
# blocked the training thread until every copy reading the payload had landed (modelled literally, branch
# sim17-evict-blocks: GPT-3 175B's golden replayed in 202 s instead of 132 s).
# Before sim17 (session 5), every EVICT and ACT_OFFLOAD freed its DEVICE bytes as it was issued.
#
# Note [simulator validity]:
# Per (list, chunk, tier) the simulator tracks whether the tier holds a copy and whether
# it is valid. Copies make the destination valid when issued (its arrival time is tracked
# separately); backward work that writes a GRAD chunk makes other copies stale; an optimizer step
# makes copies of PARAM and the OS lists on other tiers stale and the GRAD chunk dead.


def apply_action(sim: SimState, a: Action, i: int, issue: float, blocks: list[BlockState], act_bytes: list[int],
                 last_grad_write: list[int]) -> float:
    """Apply action `i` issued at time `issue`; returns when it completes."""
    apply = _APPLY.get(a.op)
    if apply is None:
        raise ScheduleViolation(ViolationKind.BAD_ACTION, f"unknown op {a.op}", moment=a.moment, action_index=i)
    return apply(sim, a, i, issue, blocks, act_bytes, last_grad_write)


def _chunk_copy(sim: SimState, a: Action, i: int, issue: float, *_) -> float:
    """FETCH, PREFETCH, WRITE_BACK: a chunk's copy from one tier to another."""
    m = a.moment
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
    ready = sim.ready[li][c][s]
    if sim.serial_swap and a.src is Tier.NVME and sim.schedule.moments[m].phase is Phase.OPTIMIZER:
        # one sub-group at a time (the header's optimizer_swap SERIAL): after the SSD writes before it
        ready = max(ready, sim.servers[(Channel.NVME_WRITE, sim.schedule.layout.chunks[c].owner_rank)].free_at)
    end = _transfer(sim, path, nbytes, issue, ready, f"{_LABELS[(a.op, a.list)]}{c}",
                    m=m, i=i, action=a, rank=sim.owner[c])
    hold(sim, li, c, d)
    sim.copies.copy(li, c, s, d)
    resync_slot(sim, c)  # a slotted chunk's final grad takes its PARAM's slot there (PS.2)
    sim.ready[li][c][d] = end
    until = sim.read_until[li][c]
    if end > until[s]:  # Note [simulator evictions]
        until[s] = end
    return end


def _evict(sim: SimState, a: Action, i: int, issue: float, *_) -> float:
    """EVICT: a tier drops its copy of a chunk."""
    m = a.moment
    li = _list(sim, a, i)
    c, s = a.chunk, TIER_INDEX[a.src]
    # its bytes are free once what still reads or writes the copy has landed (Note [simulator evictions])
    lands = max(issue, sim.read_until[li][c][s], sim.ready[li][c][s])
    ranks = tuple(range(sim.world)) if sim.replicated[li][c] else (sim.owner[c],)
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
    drop(sim, li, c, s)
    sim.read_until[li][c][s] = 0.0
    if lands > issue and s == DEVICE_INDEX:
        hold_until_landed(sim, lands, sim.chunk_bytes[li][c], ranks)
    return issue


def _allocate(sim: SimState, a: Action, i: int, issue: float, *_) -> float:
    """ALLOCATE: a fresh chunk of zeros (grads) on a tier."""
    li = _list(sim, a, i)
    c, d = a.chunk, TIER_INDEX[a.dst]
    hold(sim, li, c, d, everywhere=True)  # on DEVICE every rank allocates its own
    sim.copies.allocate(li, c, d)  # a fresh zero chunk: other copies are stale
    sim.ready[li][c][d] = issue
    return issue


def _collective(sim: SimState, a: Action, i: int, issue: float, *_) -> float:
    """ALL_GATHER, REDUCE_SCATTER: a comm group's collective."""
    m = a.moment
    # comm group `chunk`: bytes over INTER_GPU, once the comm group's copies on DEVICE are there (the
    # owners' fetched shards, the written grads); afterwards every chunk of the comm group is ready on
    # DEVICE (an all-gather leaves a copy on every rank)
    li = _list(sim, a, i)
    # a per-bucket REDUCE_SCATTER acts on its bucket's chunks only (Note [reduce-scatter per bucket])
    comm_group = a.bucket or sim.comm_groups.get(a.chunk, ())
    inputs = [sim.ready[li][c][DEVICE_INDEX] for c in comm_group if sim.copies.is_valid(li, c, DEVICE_INDEX)]
    end = _transfer(sim, (Channel.INTER_GPU,), a.bytes, issue, max(inputs, default=issue),
                    f"{a.op.value.lower()} {a.chunk}", m=m, i=i, action=a)
    if a.op is Op.ALL_GATHER:  # per chunk (a `bucket`): the chunks holding params broadcast, the padding allocated
        comm_group = sim.comm_groups.get(a.chunk, ())
    for c in comm_group:
        if a.op is Op.ALL_GATHER:
            hold(sim, li, c, DEVICE_INDEX, everywhere=True)
            sim.copies.gather(li, c)
            sim.ready[li][c][DEVICE_INDEX] = end
        elif sim.copies.is_valid(li, c, DEVICE_INDEX):
            sim.ready[li][c][DEVICE_INDEX] = end
    if a.op is Op.REDUCE_SCATTER and (a.bucket or len(comm_group) == sim.world) and sim.world > 1:
        scatter(sim, li, comm_group)  # (a DDP all-reduce's half acts on a comm group of one chunk)
    return end


def _path(a: Action, i: int) -> tuple[Channel, ...]:
    if (a.src, a.dst) not in COPY_PATH:
        raise ScheduleViolation(ViolationKind.BAD_ACTION, f"{a.op.value} from {a.src} to {a.dst}: no such path",
                                moment=a.moment, action_index=i, list_=a.list, chunk=a.chunk if a.chunk >= 0 else None,
                                block=a.block if a.block >= 0 else None)
    return COPY_PATH[(a.src, a.dst)]


def _list(sim: SimState, a: Action, i: int) -> int:
    if a.list not in sim.list_index:
        raise ScheduleViolation(ViolationKind.BAD_ACTION, f"list {a.list} is not in the layout", moment=a.moment,
                                action_index=i, chunk=a.chunk)
    return sim.list_index[a.list]


def _optimizer_step(sim: SimState, a: Action, i: int, issue: float, _blocks, _act_bytes,
                    last_grad_write: list[int]) -> float:
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
    server_key = (Channel.CPU_OPTIMIZER if d == HOST_INDEX else Channel.COMPUTE, sim.schedule.layout.chunks[c].owner_rank)
    start = max(ready, sim.servers[server_key].free_at)
    if d == HOST_INDEX:
        # the executor's thread count: a step overlapped with backward (issued before the OPTIMIZER
        # moment) runs on its optimizer worker, which on an emulated DEVICE has half the cores
        threads = cpu_adam_threads(sim.hardware, overlapped=sim.schedule.moments[m].phase is not Phase.OPTIMIZER)
        channel = Channel.CPU_OPTIMIZER
        mixed_precision = ChunkList.MASTER in sim.lists  # fp32 masters of half-precision params
        price = optimizer_step_price(sim.hardware, Tier.HOST, params, threads=threads, mixed_precision=mixed_precision)
        slow = cpu_adam_beside_copies(sim.hardware, threads=threads, mixed_precision=mixed_precision, params=params)
        cov = sim.coverage[sim.node_of[server_key[1]]]
        end = cov.run(start, price.seconds, slow)  # Note [CPU Adam beside copies]
    elif d == DEVICE_INDEX:
        channel, price = Channel.COMPUTE, optimizer_step_price(sim.hardware, Tier.DEVICE, params)
        end = start + price.seconds
    else:
        raise ScheduleViolation(ViolationKind.BAD_ACTION, "OPTIMIZER_STEP runs on DEVICE or HOST, found NVME",
                                moment=m, action_index=i, chunk=c)
    server = sim.servers[server_key]
    busy = end - start
    end = max(end, _draw_dram(sim, _dram_seconds(sim, price.dram_bytes), start))
    if d == HOST_INDEX:
        cov.place_step(start, end, slow)
    server.free_at = end
    sim.busy[channel] = sim.busy.get(channel, 0.0) + busy
    sim.timeline.append(Interval(channel=channel, start_seconds=start, end_seconds=end, label=f"adam {c}",
                                 step_chunk=c))
    sim.last_end = max(sim.last_end, end)
    for li in inputs:
        if sim.lists[li] is not ChunkList.GRAD:
            sim.ready[li][c][d] = end
        elif d == HOST_INDEX:
            # the grads a CPU step read are dead: their HOST buffer goes after the step (store.evict, `p.users`)
            sim.ready[li][c][d] = 0.0
    return end


def _activation_path(a: Action, i: int, what: str) -> tuple[Channel, ...]:
    """The channels an activation copy crosses; the one it names must be among them."""
    path = _path(a, i)
    if a.channel not in path:
        raise ScheduleViolation(ViolationKind.CHANNEL, f"{what} crosses {'+'.join(ch.value for ch in path)}, "
                                f"the action names {a.channel.value}", moment=a.moment, action_index=i, block=a.block)
    return path


def _activation(sim: SimState, a: Action, i: int, issue: float, blocks: list[BlockState], act_bytes: list[int],
                _last_grad_write) -> float:
    m, b = a.moment, a.block
    blk = blocks[b]
    if blk.plan_mode is ActivationMode.KEEP:
        raise ScheduleViolation(ViolationKind.ACTIVATIONS, f"{a.op.value} for a block planned {blk.plan_mode.value}",
                                moment=m, action_index=i, block=b)
    moved = blk.moved_bytes()
    nbytes = a.bytes or moved
    if a.op is Op.ACT_OFFLOAD:
        if blk.state is not ActState.ON_DEVICE:
            raise ScheduleViolation(ViolationKind.ACTIVATIONS, f"ACT_OFFLOAD while the block's activations are "
                                    f"{blk.state.value} (offload after its forward, before its backward)",
                                    moment=m, action_index=i, block=b)
        path = _activation_path(dataclasses.replace(a, src=Tier.DEVICE), i, f"ACT_OFFLOAD to {a.dst.value}")
        end = _transfer(sim, path, nbytes, issue, issue, f"offload act {b}", m=m, i=i, action=a, node_ranks=sim.ranks_in_node[0])
        freed = blk.device_bytes()
        act_bytes[DEVICE_INDEX] -= freed
        if freed and end > issue:
            hold_until_landed(sim, end, freed, None)  # held on DEVICE until the copy lands (Note [simulator evictions])
        blk.state, blk.tier = ActState.OFFLOADED, a.dst
        act_bytes[TIER_INDEX[a.dst]] += moved
        blk.ready_at = end  # a reload cannot start before the offload is done
        return end
    if blk.state is not ActState.OFFLOADED or blk.tier is not a.src:
        raise ScheduleViolation(ViolationKind.ACTIVATIONS, f"ACT_RELOAD from {a.src.value} while the block's "
                                f"activations are {blk.state.value}{' on ' + blk.tier.value if blk.tier else ''}",
                                moment=m, action_index=i, block=b)
    path = _activation_path(dataclasses.replace(a, dst=Tier.DEVICE), i, f"ACT_RELOAD from {a.src.value}")
    end = _transfer(sim, path, nbytes, issue, blk.ready_at, f"reload act {b}", m=m, i=i, action=a, node_ranks=sim.ranks_in_node[0])
    act_bytes[TIER_INDEX[a.src]] -= moved
    blk.state, blk.tier, blk.ready_at = ActState.ON_DEVICE, None, end
    act_bytes[DEVICE_INDEX] += blk.device_bytes()
    return end


# what each op does (`apply_action`), each called with (sim, action, its index, issue time, blocks, activation bytes per
# tier, last backward moment writing each GRAD chunk)
_APPLY = {Op.FETCH: _chunk_copy, Op.PREFETCH: _chunk_copy, Op.WRITE_BACK: _chunk_copy, Op.EVICT: _evict,
          Op.ALLOCATE: _allocate, Op.OPTIMIZER_STEP: _optimizer_step, Op.ACT_OFFLOAD: _activation,
          Op.ACT_RELOAD: _activation, Op.ALL_GATHER: _collective, Op.REDUCE_SCATTER: _collective}


def check_end(sim: SimState, schedule: Schedule, last_grad_write: list[int], n_moments: int) -> None:
    last = n_moments - 1
    trainable_chunks = {t.chunk for t in schedule.layout.tensors if t.trainable}
    for c in sorted(trainable_chunks):
        if sim.stepped[c] == 0 and ChunkList.GRAD in sim.list_index:
            raise ScheduleViolation(ViolationKind.OPTIMIZER_COUNT, f"chunk {c} holds trainable params and is never "
                                    "stepped", moment=last, chunk=c)
    initial: dict[tuple[ChunkList, int], int] = {}
    for r in schedule.initial_residency:
        initial[(r.list, r.chunk)] = sum(tier_bit(TIER_INDEX[t]) for t in r.tiers)
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
    names = [TIERS[t].value for t in TIER_INDEX.values() if mask & tier_bit(t)]
    return "+".join(names) if names else "no tier"
