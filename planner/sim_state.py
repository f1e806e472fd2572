"""The simulator's state (`planner.simulate`): servers, blocks' activations, per-rank and per-node bytes
per tier, and the setup of one replay from a schedule and a hardware profile.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from schemas import Hardware, Schedule
from schemas.hardware import DeviceKind
from schemas.schedule import TIER_INDEX, TIERS, ActivationMode, Channel, ChunkList, HostStaging, OptimizerSwap, Tier
from schemas.trace import DTYPE_BYTES, Phase

from schemas.residency import ValidCopies

from planner.costmodel import channel_bytes_per_s, dram_bytes_per_s, nvme_mixed
from planner.sim_result import Interval

# ----------------------------------------------------------------------------- state


# array index of each tier in the simulator's per-tier lists (schemas.schedule.TIER_INDEX)
DEVICE_INDEX, HOST_INDEX, NVME_INDEX = (TIER_INDEX[t] for t in TIERS)


class ActState(StrEnum):
    """Where a block's saved activations are."""

    ABSENT = "ABSENT"  # before the block's forward ends (counted in the recorded non-model bytes)
    ON_DEVICE = "ON_DEVICE"  # after forward (KEEP, RECOMPUTE's input, SWAP before offload) or after reload
    OFFLOADED = "OFFLOADED"  # SWAP: on HOST or NVME between ACT_OFFLOAD and ACT_RELOAD
    CONSUMED = "CONSUMED"  # the block's backward started


@dataclass(slots=True)
class Server:
    """A FIFO channel (or a simplex set of channels) with its bandwidth per channel."""

    free_at: float = 0.0


@dataclass(slots=True)
class BlockState:
    plan_mode: ActivationMode
    bytes: int
    input_bytes: int
    recompute_seconds: float
    recompute_flops: int
    fwd_last: int = -1
    bwd_first: int = -1
    state: ActState = ActState.ABSENT
    tier: Tier | None = None  # where an offloaded block's activations are
    ready_at: float = 0.0  # when reloaded activations are on DEVICE

    def moved_bytes(self) -> int:
        """What ACT_OFFLOAD moves: the saved activations, or a RECOMPUTE block's kept input (its checkpoint)."""
        return self.input_bytes if self.plan_mode is ActivationMode.RECOMPUTE else self.bytes

    def device_bytes(self) -> int:
        """Bytes this block holds on DEVICE while in its held window (fwd_last <= m < bwd_first)."""
        if self.state is ActState.OFFLOADED:
            return 0
        if self.plan_mode is ActivationMode.RECOMPUTE:
            return self.input_bytes
        return self.bytes


class Calendar:
    """A shared bandwidth (host DRAM; a facet of a two-way link: Note [two-way links in the simulator] in
    planner/sim_actions.py): busy time reserved in the free time from a start on.

    Not a FIFO: the simulator places actions in moment order, but a copy queued behind a busy channel
    starts later than a copy placed after it on an idle one, and DRAM serves both as their bytes flow.
    A FIFO on "free after the last reservation" made the idle channel's copy wait for the queued one
    (GPT-3 175B on a100-80g-12ssd: 152.1 s replayed, 108.4 s without the DRAM server, while the
    iteration moves ~22 s of DRAM bytes). A reservation fills the free gaps from its start on (DRAM
    bandwidth is divisible), so the DRAM is never busier than its bandwidth and never idle while a
    started transfer still needs it."""

    __slots__ = ("ends", "starts")

    def __init__(self) -> None:
        self.starts: list[float] = []  # disjoint busy intervals, sorted
        self.ends: list[float] = []

    def reserve(self, start: float, seconds: float) -> float:
        """Take `seconds` of free time from `start` on; returns when the last of it ends."""
        if not self.ends or start > self.ends[-1]:  # after every busy interval (the common case): a new one
            self.starts.append(start)
            self.ends.append(start + seconds)
            return start + seconds
        if seconds > 0 and start >= self.starts[-1]:  # inside the last one: it grows by `seconds`
            self.ends[-1] += seconds
            return self.ends[-1]
        i = bisect.bisect_right(self.ends, start)  # the first busy interval ending after start
        t, need = start, seconds
        while need > 0:
            if i < len(self.starts) and self.starts[i] <= t:
                t = self.ends[i]  # inside a busy interval: skip to its end
                i += 1
                continue
            gap_end = self.starts[i] if i < len(self.starts) else math.inf
            take = min(need, gap_end - t)
            need -= take
            t += take
        # everything in [start, t] is busy now: merge the intervals it touches into one
        lo = bisect.bisect_left(self.ends, start)
        hi = bisect.bisect_right(self.starts, t)
        merged_start = min(start, self.starts[lo]) if lo < hi else start
        merged_end = max(t, self.ends[hi - 1]) if lo < hi else t
        self.starts[lo:hi] = [merged_start]
        self.ends[lo:hi] = [merged_end]
        return t


class Coverage:
    """When some copy (H2D, D2H, NVMe read or write) runs on a node: a union of disjoint intervals, and the
    CPU Adam steps placed there so far, for Note [CPU Adam beside copies] in planner/sim_actions.py."""

    __slots__ = ("ends", "starts", "step_ends", "steps")

    def __init__(self) -> None:
        self.starts: list[float] = []  # disjoint copy-busy intervals, sorted
        self.ends: list[float] = []
        self.steps: list[tuple[float, float, float]] = []  # (start, end, slow) of each step, FIFO (sorted)
        self.step_ends: list[float] = []

    def add(self, start: float, end: float) -> list[tuple[float, float]]:
        """Mark [start, end) busy; returns the pieces of it that were not busy before."""
        if end <= start:
            return []
        if not self.ends or start > self.ends[-1]:  # after every busy interval (the common case): all new
            self.starts.append(start)
            self.ends.append(end)
            return [(start, end)]
        if start >= self.starts[-1]:  # from inside the last one: what passes its end is new
            if end <= self.ends[-1]:
                return []
            piece = (self.ends[-1], end)
            self.ends[-1] = end
            return [piece]
        lo = bisect.bisect_left(self.ends, start)  # the first interval ending at or after start
        hi = bisect.bisect_right(self.starts, end)  # past the last interval starting at or before end
        new, t = [], start
        for k in range(lo, hi):
            if self.starts[k] > t:
                new.append((t, self.starts[k]))
            t = max(t, self.ends[k])
        if t < end:
            new.append((t, end))
        merged_start = min(start, self.starts[lo]) if lo < hi else start
        merged_end = max(end, self.ends[hi - 1]) if lo < hi else end
        self.starts[lo:hi] = [merged_start]
        self.ends[lo:hi] = [merged_end]
        return new

    def run(self, start: float, seconds_alone: float, slow: float) -> float:
        """When a step that needs `seconds_alone` at its rate alone ends if it starts at `start`, running at
        its rate alone outside the busy intervals and at `slow` times it inside them."""
        t, left = start, seconds_alone
        k = bisect.bisect_right(self.ends, start)  # the first interval ending after start
        while left > 0:
            if k < len(self.starts) and self.starts[k] <= t:  # inside a busy interval: slow
                span = self.ends[k] - t
                if left <= span * slow:
                    return t + left / slow
                left -= span * slow
                t = self.ends[k]
                k += 1
                continue
            gap = (self.starts[k] if k < len(self.starts) else math.inf) - t
            if left <= gap:
                return t + left
            left -= gap
            t += gap
        return t

    def place_step(self, start: float, end: float, slow: float) -> None:
        # a step starting where the last one ends, at the same `slow`, extends it: what a copy's piece takes from
        # two such steps (overlap x (1 - slow) each) is what it takes from their union, and making up the two
        # losses one after the other ends where making up their sum does (`run` is additive). The node's CPU
        # optimizer runs its steps and make-ups back to back, so without this a 512-block replay kept ~138k
        # steps here, each a make-up of a few microseconds, and `lost_seconds` walked them (bench/RESULTS.md,
        # session 20)
        if self.steps and self.steps[-1][1] == start and self.steps[-1][2] == slow:
            self.steps[-1] = (self.steps[-1][0], end, slow)
            self.step_ends[-1] = end
            return
        self.steps.append((start, end, slow))
        self.step_ends.append(end)

    def lost_seconds(self, pieces: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """The work the steps placed so far lose to newly busy `pieces`, as (seconds at the rate alone, the share
        of it the step keeps beside copies) per step that loses some: per second of overlap 1 - slow (what a
        step at the slower rate leaves undone)."""
        lost: dict[int, float] = {}
        for a, b in pieces:
            k = bisect.bisect_right(self.step_ends, a)
            while k < len(self.steps) and self.steps[k][0] < b:
                s, e, slow = self.steps[k]
                if min(b, e) > max(a, s) and slow < 1.0:
                    lost[k] = lost.get(k, 0.0) + (min(b, e) - max(a, s)) * (1.0 - slow)
                k += 1
        return [(seconds, self.steps[k][2]) for k, seconds in sorted(lost.items())]


@dataclass(frozen=True, slots=True)
class CopyKind:
    """What every copy of one size over one path on one rank's links costs (planner.sim_actions._transfer)."""

    servers: tuple[Server, ...]  # per channel of the path, its FIFO server
    duration: float  # seconds at its rates alone: the slowest channel's (NVMe bytes times the node's ranks)
    dram_seconds: float  # its host DRAM reservation (0: none)
    link_draws: tuple[tuple[Calendar, float], ...]  # (two-way facet, seconds reserved there) per facet of its links
    copy: bool  # whether CPU Adam on its node runs slower beside it (Note [CPU Adam beside copies])
    node: int
    busy_seconds: tuple[float, ...]  # per channel, its bytes at its rate alone


@dataclass(slots=True)
class SimState:
    schedule: Schedule
    hardware: Hardware
    lists: tuple[ChunkList, ...]
    list_index: dict[ChunkList, int]
    chunk_bytes: list[list[int]]  # [list][chunk]
    copies: ValidCopies  # which tiers hold a (valid) copy of each chunk: the residency rules
    ready: list[list[list[float]]]  # [list][chunk][tier] when the copy there is complete
    # [list][chunk][tier] when the last copy reading the copy there ends (an EVICT waits for it: Note
    # [simulator evictions] in planner/sim_actions.py)
    read_until: list[list[list[float]]]
    stepped: list[int]
    world: int
    owner: list[int]  # per chunk: its owner rank
    node_of: list[int]  # per rank: its node
    ranks_in_node: list[int]  # per node: how many ranks it hosts
    replicated: list[list[bool]]  # [list][chunk] a DEVICE copy is held by every rank (else by the owner only)
    place_bytes: list[list[list[int]]]  # [tier][rank (DEVICE) or node (HOST, NVME)][list]
    place_total: list[list[int]]  # [tier][rank or node]: sum over lists
    comm_groups: dict[int, tuple[int, ...]]  # comm group -> its chunks
    servers: dict[tuple[Channel, int], Server]  # per (channel, rank); NVMe, CPU and collectives shared
    rate: dict[Channel, float]
    # what a copy costs, per (channels, bytes, rank, node ranks): made once per replay by planner.sim_actions._copy_kind
    copy_kinds: dict[tuple[tuple[Channel, ...], int, int, int], CopyKind] = field(default_factory=dict)
    pageable: bool = False  # DEVICE <-> HOST copies at the pageable rates (the header's host_staging)
    serial_swap: bool = False  # NVMe reads of the OPTIMIZER moment wait for earlier NVMe writes (the header's optimizer_swap)
    dram: Calendar = field(default_factory=lambda: Calendar())  # host DRAM, shared by copies and CPU Adam
    # the two-way links' facets ((kind "pcie" per rank or "nvme" per node, place, facet name) -> its busy
    # time: Note [two-way links in the simulator] in planner/sim_actions.py), created on first use
    links: dict[tuple[str, int, str], Calendar] = field(default_factory=dict)
    # (end, bytes) of each activation offload in flight: DEVICE bytes held until it lands (Note [activation
    # offloads land] in planner/simulate.py)
    # (end, bytes, ranks holding them or None for every rank) of each copy still reading bytes that were
    # evicted or offloaded from DEVICE: held until it lands (Note [simulator evictions])
    landing: list[tuple[float, int, tuple[int, ...] | None]] = field(default_factory=list)
    # (kept with `landing` by `hold_until_landed`, `land_oldest` and `land`: used_bytes and land run once per
    # action) the bytes of every entry, and the earliest end among them
    landing_bytes_total: int = 0
    landing_next_end: float = math.inf
    # per node: when copies run there, and its CPU Adam steps (Note [CPU Adam beside copies])
    coverage: list[Coverage] = field(default_factory=list)
    dram_rate: float = float("inf")
    dram_busy: float = 0.0
    bytes_per_channel: dict[Channel, int] = field(default_factory=dict)
    busy: dict[Channel, float] = field(default_factory=dict)
    timeline: list[Interval] = field(default_factory=list)
    last_end: float = 0.0
    # per slotted chunk (ChunkPlan.grad_in_param_slot): the GRAD bytes each rank does not pay on DEVICE
    # because its PARAM copy's slot holds them (Note [simulator memory per rank and node])
    slot_saved: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (tier, chunk) -> per place


def tier_bit(t: int) -> int:
    return 1 << int(t)


# Note [simulator ranks]:
# With world_size > 1 every rank has its own H2D, D2H and COMPUTE server: a chunk's copies
# and its DEVICE optimizer step run on its owner rank's, the moments' work on all of them at once
# (SPMD); each node's ranks share its SSDs and its CPU optimizer (one server each per node), and
# collectives share one cluster-wide server, priced intra- vs inter-node by
# `Hardware.collective_seconds` (the slower of the NVLink and the NIC stage of a hierarchical ring). Bytes and busy
# seconds of local copies are summed over ranks; a collective's bytes are what each rank sends
# (the schedule's convention), counted once. A collective starts when its inputs are on DEVICE
# (an ALL_GATHER after the owners' copies of the comm group arrived, a REDUCE_SCATTER after the grads
# were written) and its outputs are ready when it ends.


def setup(schedule: Schedule, hardware: Hardware) -> SimState:
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
    places = {DEVICE_INDEX: world, HOST_INDEX: n_nodes, NVME_INDEX: n_nodes}
    # per node: the SSD set (one simplex server for reads and writes) and the CPU optimizer, shared by
    # the node's ranks (PatrickStar §9.1's 12 cores serve its 8 ranks); collectives: one cluster-wide
    # server priced by Hardware.collective_seconds (intra- vs inter-node)
    nvme = [Server() for _ in range(n_nodes)]
    # SSDs measured reading and writing at once (nvme.mixed_*): a read and a write server per node, each at
    # its rate alone, that share the SSDs' two-way facets (Note [two-way links in the simulator] in
    # planner/sim_actions.py); otherwise one simplex server (Fuyou Eq. 4)
    nvme_write = [Server() for _ in range(n_nodes)] if nvme_mixed(hardware) else nvme
    cpu = [Server() for _ in range(n_nodes)]
    collectives = Server()

    def server(ch: Channel, rank: int) -> Server:
        if ch is Channel.NVME_READ:
            return nvme[node_of[rank]]
        if ch is Channel.NVME_WRITE:
            return nvme_write[node_of[rank]]
        if ch is Channel.CPU_OPTIMIZER:
            return cpu[node_of[rank]]
        return collectives if ch is Channel.INTER_GPU else Server()

    servers = {(ch, rank): server(ch, rank) for ch in Channel for rank in range(schedule.header.world_size)}
    if hardware.device.kind is DeviceKind.CPU_EMULATED:  # one set of cores computes and steps
        for rank in range(world):
            servers[(Channel.CPU_OPTIMIZER, rank)] = servers[(Channel.COMPUTE, rank)]
    rate = {ch: channel_bytes_per_s(hardware, ch)  # pinned; NVMe behind the host-side cap
            for ch in (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE, Channel.INTER_GPU)}
    sim = SimState(schedule=schedule, hardware=hardware, lists=lists, list_index=list_index, chunk_bytes=chunk_bytes,
               copies=ValidCopies(lists, n, slotted=[p.grad_in_param_slot for p in schedule.chunk_plans]), ready=ready,
               read_until=[[[0.0, 0.0, 0.0] for _ in range(n)] for _ in lists], stepped=[0] * n, world=world,
               owner=[c.owner_rank for c in layout.chunks], node_of=node_of,
               ranks_in_node=[node_of.count(k) for k in range(n_nodes)],
               replicated=[[False] * n for _ in lists],
               place_bytes=[[[0] * len(lists) for _ in range(places[t])] for t in TIER_INDEX.values()],
               place_total=[[0] * places[t] for t in TIER_INDEX.values()],
               servers=servers, rate=rate, comm_groups=_comm_groups(layout),
               pageable=schedule.header.host_staging is HostStaging.PAGEABLE, dram_rate=dram_bytes_per_s(hardware),
               serial_swap=schedule.header.optimizer_swap is OptimizerSwap.SERIAL,
               coverage=[Coverage() for _ in range(n_nodes)])
    for r in schedule.initial_residency:
        li = list_index[r.list]
        for tier in r.tiers:
            # PARAM and GRAD on DEVICE: every rank's copy (what the iteration computes with); OS: the owner's
            hold(sim, li, r.chunk, TIER_INDEX[tier], everywhere=r.list in (ChunkList.PARAM, ChunkList.GRAD))
            sim.copies.start(li, r.chunk, TIER_INDEX[tier])
    return sim


# ----------------------------------------------------------------------------- memory per rank / node


def _comm_groups(layout) -> dict[int, tuple[int, ...]]:
    members: dict[int, list[int]] = {}
    for c in layout.chunks:
        members.setdefault(c.comm_group, []).append(c.id)
    return {g: tuple(cs) for g, cs in members.items()}


def _add(sim: SimState, t: int, place: int, li: int, nbytes: int) -> None:
    sim.place_bytes[t][place][li] += nbytes
    sim.place_total[t][place] += nbytes


# Note [simulator memory per rank and node]:
# DEVICE capacity is per rank: a copy of a chunk on DEVICE is held
# by its owner rank only (a FETCH/PREFETCH/WRITE_BACK to DEVICE, which the owner does, and the
# optimizer state) or by every rank (PARAM and GRAD at the start of the iteration, after an
# ALL_GATHER, an ALLOCATE on DEVICE or a backward write); the DEVICE peak is the busiest rank's.
# HOST and NVME capacities are per node (`cluster.gpus_per_node` ranks share them): a chunk's copy
# there counts on its owner's node, and swapped activations once per rank of the node (each rank
# swaps its own). With one rank all of this is the plain sum. A chunk whose grad lives in its param's
# slot (PatrickStar PS.2) counts once where one slot holds both its PARAM and its GRAD (`resync_slot`:
# the GRAD bytes are taken off again, as `planner.replay` does).


def resync_slot(sim: SimState, c: int) -> None:
    """Re-count slotted chunk c's slots after its PARAM or GRAD copies changed (held, or a final grad's copy
    taking PARAM's slot): a place holding both in one slot (`ValidCopies.slot_overlap`) pays for one
    chunk (GRAD's bytes are taken off, at most PARAM's). DEVICE per rank, the other tiers on the owner's node."""
    if not sim.copies.slotted[c]:
        return
    pi, gi = sim.list_index[ChunkList.PARAM], sim.list_index[ChunkList.GRAD]
    saved = min(sim.chunk_bytes[pi][c], sim.chunk_bytes[gi][c])
    owner = sim.owner[c]
    for t in TIER_INDEX.values():
        both = sim.copies.slot_overlap(c, t)
        if t == DEVICE_INDEX:
            now = [saved if both and (r == owner or (sim.replicated[pi][c] and sim.replicated[gi][c])) else 0
                   for r in range(sim.world)]
        else:
            now = [saved if both and k == sim.node_of[owner] else 0 for k in range(len(sim.place_total[t]))]
        before = sim.slot_saved.get((t, c), [0] * len(now))
        for place in range(len(now)):
            if now[place] != before[place]:
                _add(sim, t, place, gi, before[place] - now[place])
        sim.slot_saved[(t, c)] = now


def hold(sim: SimState, li: int, c: int, t: int, *, everywhere: bool = False) -> None:
    """Tier t now holds a copy of (list li, chunk c): the owner's (or, on DEVICE, every rank's)."""
    size = sim.chunk_bytes[li][c]
    owner = sim.owner[c]
    if t != DEVICE_INDEX:
        if sim.copies.hold(li, c, t):
            _add(sim, t, sim.node_of[owner], li, size)
            resync_slot(sim, c)
        return
    if sim.copies.hold(li, c, t):
        sim.replicated[li][c] = False
        _add(sim, t, owner, li, size)
    if everywhere and not sim.replicated[li][c]:
        sim.replicated[li][c] = True
        for r in range(sim.world):
            if r != owner:
                _add(sim, t, r, li, size)
    resync_slot(sim, c)


def drop(sim: SimState, li: int, c: int, t: int) -> None:
    """Tier t no longer holds its copy (sim.copies.evict said so): its bytes leave the owner (or every rank)."""
    size = sim.chunk_bytes[li][c]
    owner = sim.owner[c]
    if t != DEVICE_INDEX:
        _add(sim, t, sim.node_of[owner], li, -size)
        resync_slot(sim, c)
        return
    for r in (range(sim.world) if sim.replicated[li][c] else (owner,)):
        _add(sim, t, r, li, -size)
    sim.replicated[li][c] = False
    resync_slot(sim, c)


def scatter(sim: SimState, li: int, chunks: tuple[int, ...]) -> None:
    """A comm group's grads were reduce-scattered: each rank keeps its own chunk's reduced grads, the
    others' copies leave its DEVICE (PatrickStar §7; Note [materialize ranks]). Counted when the
    collective is issued, as the schedule's residency replay does."""
    for c in chunks:
        if sim.replicated[li][c] and sim.copies.holds(li, c, DEVICE_INDEX):
            size = sim.chunk_bytes[li][c]
            for r in range(sim.world):
                if r != sim.owner[c]:
                    _add(sim, DEVICE_INDEX, r, li, -size)
            sim.replicated[li][c] = False
            resync_slot(sim, c)


def busiest(sim: SimState, t: int) -> int:
    """The rank (DEVICE) or node (HOST, NVME) holding the most chunk bytes."""
    totals = sim.place_total[t]
    return 0 if len(totals) == 1 else max(range(len(totals)), key=totals.__getitem__)


def used_bytes(sim: SimState, t: int, act_bytes: list[int]) -> int:
    """Chunks and activations on the busiest rank (DEVICE) or node (HOST, NVME)."""
    totals = sim.place_total[t]
    if t == DEVICE_INDEX:
        if not sim.landing:
            return max(totals) + act_bytes[t]
        if len(totals) == 1:  # one rank holds every landing copy's bytes
            return totals[0] + sim.landing_bytes_total + act_bytes[t]
        return max(total + landing_bytes(sim, r) for r, total in enumerate(totals)) + act_bytes[t]
    if len(totals) == 1:
        return totals[0] + act_bytes[t] * sim.ranks_in_node[0]
    return max(total + act_bytes[t] * sim.ranks_in_node[k] for k, total in enumerate(totals))


def landing_bytes(sim: SimState, rank: int) -> int:
    """DEVICE bytes on `rank` still read by a copy in flight after their EVICT or ACT_OFFLOAD."""
    return sum(b for _, b, ranks in sim.landing if ranks is None or rank in ranks)


def land_oldest(sim: SimState, t: float, fits: Callable[[], bool]) -> float:
    """Wait for the copies in flight, oldest issued first, until `fits()` (or none is left): each gives its
    DEVICE bytes back as it lands. Returns when the last one waited for lands (`t` if none). The executor's
    rule (executor/store.py `Pool.make_room`: the oldest retiring buffer or activation offload, until the
    allocation fits; Note [simulator evictions])."""
    end = t
    waited = False
    while sim.landing and not fits():
        lands, nbytes, _ = sim.landing.pop(0)
        sim.landing_bytes_total -= nbytes
        end = max(end, lands)
        waited = True
    if waited:
        sim.landing_next_end = min((x[0] for x in sim.landing), default=math.inf)
    return end


def hold_until_landed(sim: SimState, lands: float, nbytes: int, ranks: tuple[int, ...] | None) -> None:
    """`nbytes` of DEVICE stay held (on `ranks`, None: every rank) until a copy landing at `lands` (Note
    [simulator evictions])."""
    sim.landing.append((lands, nbytes, ranks))
    sim.landing_bytes_total += nbytes
    sim.landing_next_end = min(sim.landing_next_end, lands)


def land(sim: SimState, t: float) -> None:
    """The copies that have landed by `t` give their DEVICE bytes back."""
    if sim.landing and sim.landing_next_end <= t:
        sim.landing[:] = [x for x in sim.landing if x[0] > t]
        sim.landing_bytes_total = sum(x[1] for x in sim.landing)
        sim.landing_next_end = min((x[0] for x in sim.landing), default=math.inf)


def place_name(sim: SimState, t: int, place: int) -> str:
    if sim.world == 1:
        return ""
    return f" (rank {place}, per-rank budget)" if t == DEVICE_INDEX else f" (node {place}, shared by {sim.ranks_in_node[place]} ranks)"


def block_states(schedule: Schedule) -> list[BlockState]:
    blocks = [BlockState(plan_mode=p.mode, bytes=p.bytes, input_bytes=p.input_bytes, recompute_seconds=p.recompute_seconds,
                     recompute_flops=p.recompute_flops) for p in schedule.activation_plans]
    for m in schedule.moments:
        if 0 <= m.block < len(blocks):
            blk = blocks[m.block]
            if m.phase is Phase.FORWARD:
                blk.fwd_last = m.id
            elif m.phase is Phase.BACKWARD and blk.bwd_first < 0:
                blk.bwd_first = m.id
    return blocks
