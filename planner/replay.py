"""The residency replay of a materialized schedule: the rules of `schemas.residency`, action by
action, and the bytes each tier holds during each moment's work (what `planner.materialize` checks
the capacities with and reports as the predicted peaks). Raises ReplayError naming the moment,
the action and the chunk.
"""

from __future__ import annotations

from planner.errors import PlannerError
from schemas._base import frozen
from schemas.residency import Refusal, ResidencyRefused, ValidCopies
from schemas.schedule import TIER_INDEX, ActivationMode, ActivationPlan, ChunkList, Op, Schedule, Tier
from schemas.trace import DTYPE_BYTES, Phase


class ReplayError(PlannerError):
    """A schedule's actions break the residency bookkeeping (a materialize bug, or a hand-made schedule)."""


@frozen
class ResidencyReplay:
    """Bytes per tier during each moment's work, from replaying the actions (and the checks passed)."""

    device_bytes: tuple[int, ...]  # chunks + non-model (incl. activations kept on DEVICE), max over the moment
    host_bytes: tuple[int, ...]
    nvme_bytes: tuple[int, ...]
    fetched_chunks: int  # FETCH/PREFETCH actions to DEVICE

    @property
    def peak_bytes_per_tier(self) -> dict[Tier, int]:
        return {Tier.DEVICE: max(self.device_bytes), Tier.HOST: max(self.host_bytes), Tier.NVME: max(self.nvme_bytes)}


def replay_residency(schedule: Schedule) -> ResidencyReplay:
    """Replay the actions' bookkeeping: copies from valid sources only, PARAM on DEVICE for every
    moment's work and GRAD for every backward write, optimizer inputs present, and the iteration
    ending where it started. Raises ReplayError naming the moment, action and chunk."""
    layout = schedule.layout
    lists = tuple(layout.lists)
    n_chunks = len(layout.chunks)
    size = {x: [c.elements * DTYPE_BYTES[layout.list_dtypes[x]] for c in layout.chunks] for x in lists}
    copies = ValidCopies(lists, n_chunks, slotted=[p.grad_in_param_slot for p in schedule.chunk_plans])
    li = copies.index
    tier_bytes = [0, 0, 0]
    # With several ranks DEVICE is per rank (Note [simulator memory per rank and node], the same rules):
    # a copy there is its owner's only (a FETCH/PREFETCH/WRITE_BACK, which the owner does, and the
    # OS) or every rank's (PARAM and GRAD at the start, after an ALL_GATHER or an ALLOCATE); a
    # reduce-scatter leaves each rank its own chunk's grads (PatrickStar §7). DEVICE bytes: the
    # busiest rank's
    os_lists = [x for x in lists if x in (ChunkList.MASTER, ChunkList.M, ChunkList.V)]
    ws = schedule.header.world_size
    per_owner = ws > 1
    rank_bytes = [0] * ws
    everyone: set[tuple[ChunkList, int]] = set()  # (list, chunk) whose DEVICE copy every rank holds
    group_chunks: dict[int, list[int]] = {}
    for ch in layout.chunks:
        group_chunks.setdefault(ch.comm_group, []).append(ch.id)

    def count(x: ChunkList, c: int, t: int, sign: int, *, everywhere: bool = False) -> None:
        """A copy of (x, c) on tier t appeared (+1: the caller checked it is new) or left (-1)."""
        if not per_owner or t != 0:
            tier_bytes[t] += sign * size[x][c]
        elif sign < 0:
            for r in (range(ws) if (x, c) in everyone else (layout.chunks[c].owner_rank,)):
                rank_bytes[r] -= size[x][c]
            everyone.discard((x, c))
        else:
            rank_bytes[layout.chunks[c].owner_rank] += size[x][c]
            if everywhere:
                spread(x, c)
        if x in (ChunkList.PARAM, ChunkList.GRAD):
            resync_slot(c)

    def spread(x: ChunkList, c: int) -> None:
        """A DEVICE copy held by its owner is now every rank's (gathered, or allocated everywhere)."""
        if (x, c) not in everyone:
            everyone.add((x, c))
            for r in range(ws):
                if r != layout.chunks[c].owner_rank:
                    rank_bytes[r] += size[x][c]
            if x in (ChunkList.PARAM, ChunkList.GRAD):
                resync_slot(c)

    slot_saved: dict[tuple[int, int], list[int]] = {}  # (tier, chunk) -> bytes not paid, per rank (DEVICE)

    def resync_slot(c: int) -> None:
        """A chunk whose grad lives in its param's slot (PatrickStar PS.2): a place holding both its PARAM
        and its GRAD in one slot (`ValidCopies.slot_overlap`) pays for one chunk (GRAD's bytes taken off,
        at most PARAM's); the same rule as the simulator's `sim_state.resync_slot`."""
        if not copies.slotted[c]:
            return
        saved = min(size[ChunkList.PARAM][c], size[ChunkList.GRAD][c])
        owner = layout.chunks[c].owner_rank
        spread_both = (ChunkList.PARAM, c) in everyone and (ChunkList.GRAD, c) in everyone
        for t in range(3):
            both = copies.slot_overlap(c, t)
            per_rank = per_owner and t == 0
            now = [saved if both and (not per_rank or r == owner or spread_both) else 0
                   for r in range(ws if per_rank else 1)]
            before = slot_saved.get((t, c), [0] * len(now))
            for r in range(len(now)):
                if per_rank:
                    rank_bytes[r] -= now[r] - before[r]
                else:
                    tier_bytes[t] -= now[r] - before[r]
            slot_saved[(t, c)] = now

    def totals() -> list[int]:
        return [tier_bytes[0] + (max(rank_bytes) if per_owner else rank_bytes[0]), tier_bytes[1], tier_bytes[2]]

    for r in schedule.initial_residency:
        for tier in r.tiers:
            if copies.start(li[r.list], r.chunk, TIER_INDEX[tier]):
                count(r.list, r.chunk, TIER_INDEX[tier], 1, everywhere=r.list in (ChunkList.PARAM, ChunkList.GRAD))
    chunk_of = {t.tensor: t.chunk for t in layout.tensors}
    trainable = {t.tensor for t in layout.tensors if t.trainable}
    by_moment: list[list[int]] = [[] for _ in schedule.moments]
    for i, a in enumerate(schedule.actions):
        by_moment[a.moment].append(i)
    modes = [p.mode for p in schedule.activation_plans]
    act_tier: dict[int, Tier] = {}
    act_bytes = [0, 0, 0]
    fwd_last, bwd_first = _activation_windows(schedule)
    held_recorded = 0
    device, host, nvme = [], [], []
    fetched = 0

    def fail(m: int, i: int | None, what: str) -> ReplayError:
        where = f"moment {m}" + (f", action {i} ({schedule.actions[i].op.value} {schedule.actions[i].list} "
                                 f"chunk {schedule.actions[i].chunk})" if i is not None else "")
        return ReplayError(f"residency replay of policy {schedule.header.policy!r}: {where}: {what}")

    last_write = [-1] * n_chunks  # per chunk: the moment of its last backward grad write
    for m in schedule.moments:
        if m.phase is Phase.BACKWARD:
            for t in m.tensors:
                if t in trainable:
                    last_write[chunk_of[t]] = m.id
    entering: dict[int, list[int]] = {}  # moment -> blocks whose forward ends there (held window starts)
    leaving: dict[int, list[int]] = {}  # moment -> blocks whose backward starts there
    for b in range(len(modes)):
        entering.setdefault(fwd_last[b], []).append(b)
        leaving.setdefault(bwd_first[b], []).append(b)
    for m in schedule.moments:
        for b in entering.get(m.id, ()):
            held_recorded += schedule.activation_plans[b].bytes
            act_bytes[0] += _act_device_bytes(schedule.activation_plans[b])
        peak_model = totals()
        for i in by_moment[m.id]:
            a = schedule.actions[i]
            if a.op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK):
                d = TIER_INDEX[a.dst]
                try:
                    if copies.copy(li[a.list], a.chunk, TIER_INDEX[a.src], d):
                        count(a.list, a.chunk, d, 1)
                except ResidencyRefused:
                    raise fail(m.id, i, f"copies from {a.src.value}, which holds no valid copy") from None
                fetched += a.dst is Tier.DEVICE and a.op is not Op.WRITE_BACK
            elif a.op is Op.EVICT:
                s = TIER_INDEX[a.src]
                try:
                    copies.evict(li[a.list], a.chunk, s)
                except ResidencyRefused as exc:
                    raise fail(m.id, i, f"evicts from {a.src.value}, which holds no copy"
                               if exc.refusal is Refusal.NOT_HELD else "drops the last valid copy") from None
                count(a.list, a.chunk, s, -1)
            elif a.op is Op.ALLOCATE:
                if copies.allocate(li[a.list], a.chunk, TIER_INDEX[a.dst]):
                    count(a.list, a.chunk, TIER_INDEX[a.dst], 1, everywhere=True)
                elif per_owner and a.dst is Tier.DEVICE:
                    spread(a.list, a.chunk)  # every rank allocates its own
            elif a.op is Op.OPTIMIZER_STEP:
                try:  # afterwards PARAM and the OS valid on dst only, GRAD dead (its copies freed by EVICTs)
                    copies.step(a.chunk, TIER_INDEX[a.dst], [li[x] for x in (ChunkList.PARAM, ChunkList.GRAD, *os_lists)])
                except ResidencyRefused as exc:
                    raise fail(m.id, i, f"steps on {a.dst.value} without a valid {lists[exc.list_index].value} "
                                        "copy there") from None
            elif a.op is Op.ACT_OFFLOAD:
                act_tier[a.block] = a.dst
                act_bytes[0] -= _act_device_bytes(schedule.activation_plans[a.block])
                act_bytes[TIER_INDEX[a.dst]] += a.bytes
            elif a.op is Op.ACT_RELOAD:
                if act_tier.pop(a.block, None) is not a.src:
                    raise fail(m.id, i, f"reloads block {a.block}'s activations from {a.src.value}, they are not there")
                act_bytes[TIER_INDEX[a.src]] -= a.bytes
                act_bytes[0] += _act_device_bytes(schedule.activation_plans[a.block])
            elif a.op is Op.REDUCE_SCATTER and per_owner and (a.bucket or len(group_chunks.get(a.chunk, ())) == ws):
                # a sharded comm group (a DDP all-reduce's half acts on a chunk in a comm group of its own):
                # every rank keeps its own chunk's reduced grads, the others' leave its DEVICE (a per-bucket
                # one: those of its bucket's chunks)
                for c in a.bucket or group_chunks[a.chunk]:
                    if (a.list, c) in everyone and copies.holds(li[a.list], c, 0):
                        count(a.list, c, 0, -1)
                        count(a.list, c, 0, 1)
            elif a.op is Op.ALL_GATHER and a.list is not ChunkList.GRAD:  # a GRAD one: DDP's all-reduce, in place
                for c in range(a.chunk * schedule.header.world_size,
                               min((a.chunk + 1) * schedule.header.world_size, n_chunks)):
                    if copies.gather(li[a.list], c):
                        count(a.list, c, 0, 1, everywhere=True)
                    elif per_owner:
                        spread(a.list, c)
            now = totals()
            if now[0] > peak_model[0] or now[1] > peak_model[1] or now[2] > peak_model[2]:
                peak_model = [max(p, x) for p, x in zip(peak_model, now)]
        for b in leaving.get(m.id, ()):
            if b in act_tier:
                raise fail(m.id, None, f"block {b}'s backward starts with its activations on {act_tier[b].value}")
            held_recorded -= schedule.activation_plans[b].bytes
            act_bytes[0] -= _act_device_bytes(schedule.activation_plans[b])
        if m.phase is not Phase.OPTIMIZER:
            for t in m.tensors:
                c = chunk_of[t]
                if not copies.is_valid(li[ChunkList.PARAM], c, 0):
                    raise fail(m.id, None, f"the work of {m.module or '(root)'} needs PARAM chunk {c} on DEVICE")
            for t in m.tensors:  # after every PARAM check: a slotted chunk's last write makes its PARAM stale
                c = chunk_of[t]
                if m.phase is Phase.BACKWARD and t in trainable:
                    if not copies.is_valid(li[ChunkList.GRAD], c, 0):
                        raise fail(m.id, None, f"the backward of {m.module or '(root)'} writes GRAD chunk {c}, not on DEVICE")
                    copies.write_grads(c, final=m.id == last_write[c])
        # during the actions the chunks alone; during the work the chunks, the non-model bytes and activations
        non_model = max(0, m.non_model_bytes - held_recorded) + act_bytes[0]
        now = totals()
        device.append(max(peak_model[0], now[0] + non_model))
        host.append(max(peak_model[1], now[1] + act_bytes[1]))
        nvme.append(max(peak_model[2], now[2] + act_bytes[2]))
    _check_steady_state(schedule, copies, fail)
    return ResidencyReplay(device_bytes=tuple(device), host_bytes=tuple(host), nvme_bytes=tuple(nvme),
                           fetched_chunks=fetched)


def _act_device_bytes(p: ActivationPlan) -> int:
    """What a block holds on DEVICE between its forward and backward when not offloaded."""
    return p.input_bytes if p.mode is ActivationMode.RECOMPUTE else p.bytes


def _activation_windows(schedule: Schedule) -> tuple[list[int], list[int]]:
    n = len(schedule.activation_plans)
    fwd_last, bwd_first = [-1] * n, [-1] * n
    for m in schedule.moments:
        if 0 <= m.block < n:
            if m.phase is Phase.FORWARD:
                fwd_last[m.block] = m.id
            elif m.phase is Phase.BACKWARD and bwd_first[m.block] < 0:
                bwd_first[m.block] = m.id
    return fwd_last, bwd_first


def _check_steady_state(schedule: Schedule, copies: ValidCopies, fail) -> None:
    want: dict[tuple[ChunkList, int], int] = {}
    for r in schedule.initial_residency:
        want[(r.list, r.chunk)] = sum(1 << TIER_INDEX[t] for t in r.tiers)
    last = len(schedule.moments) - 1
    for li, x in enumerate(copies.lists):
        for c, mask in enumerate(copies.held[li]):
            expected = want.get((x, c), 0)
            if not copies.ends_as_started(li, c, expected):
                raise fail(last, None, f"the iteration ends with {x.value} chunk {c} held on tiers {mask:03b} "
                                       f"(valid {copies.valid[li][c]:03b}), it started on {expected:03b} "
                                       "(bits NVME,HOST,DEVICE)")


__all__ = ["ReplayError", "ResidencyReplay", "replay_residency"]
