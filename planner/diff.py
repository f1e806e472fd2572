"""`python -m planner diff OLD NEW`: what changed between two schedules, and what it costs.

A schedule under version control changes when the planner, the model or the hardware changes; CI
shows the change as this diff. The sections, in order:

1. inputs (only where they differ): trace and hardware digests, hardware name, policy, planner
   version, budgets per tier -- stated first, because everything below follows from them;
2. prediction: iteration time, time per phase (sum of its stages' predicted seconds) and the
   stages that changed most, peak bytes per tier -- each with its delta and percentage;
3. chunk layout: chunk size, chunk count, lists, tensors that moved to another chunk or offset
   (matched by name, so schedules of different traces compare where they can);
4. residency at the start of the iteration: chunks per chunk list and tier, the chunks whose tiers
   changed (largest by bytes), OS tier and optimizer tier changes per chunk;
5. activation plan: blocks whose mode changed, as ranges of blocks;
6. actions: count and bytes per channel, count per op;
7. the planner's notes (only where they differ): its reasoning, e.g. the simulated time of every
   candidate plan -- excerpted around the first difference here, whole in `--json`.

Everything is aggregated, with the top movers listed, so a 96-block model fits one screen.
Identical schedules (same bytes, or equal objects) give exactly one line starting "identical:".
`--fail-if-slower PCT` / `--fail-if-peak-grows PCT` turn a regression into exit code 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from schemas._base import frozen, read_bytes
from schemas.schedule import Channel, ChunkList, Op, Schedule, Tier
from schemas.trace import DTYPE_BYTES

TOP_MOVERS = 3  # largest movers listed per section: enough to act on, short enough for one screen
TOP_STAGES = 3


# ----------------------------------------------------------------------------- data


@frozen
class Change:
    """One number before and after; `delta` and `percent` derive from them."""

    name: str
    old: float
    new: float
    unit: str  # "bytes", "seconds" or "count"

    @property
    def delta(self) -> float:
        return self.new - self.old

    @property
    def changed(self) -> bool:
        return self.old != self.new

    @property
    def percent(self) -> float | None:
        """Relative change in percent; None when old is 0 (growth from nothing has no ratio)."""
        if self.old == 0:
            return None if self.new != 0 else 0.0
        pct = 100.0 * (self.new - self.old) / abs(self.old)
        return pct if math.isfinite(pct) else None  # a subnormal `old` overflows: no meaningful ratio either


@frozen
class TextChange:
    """A non-numeric field before and after (digests, names, lists)."""

    name: str
    old: str
    new: str


@frozen
class TensorMove:
    """A tensor whose (chunk, offset) differs; matched by its first name."""

    name: str
    bytes: int  # in the compute dtype (PARAM list)
    old_chunk: int
    old_offset_elements: int
    new_chunk: int
    new_offset_elements: int


@frozen
class LayoutDiff:
    chunk_elements: Change
    chunk_bytes: Change  # one PARAM chunk
    chunks: Change
    lists: TextChange | None  # None: the same lists
    tensors_compared: int  # present in both (by name)
    tensors_added: int
    tensors_removed: int
    tensors_moved: int
    moved_bytes: int
    largest_moves: tuple[TensorMove, ...]


@frozen
class ChunkMove:
    """One (list, chunk) whose tiers at the start of the iteration changed."""

    list: ChunkList
    chunk: int
    bytes: int
    old_tiers: tuple[Tier, ...]
    new_tiers: tuple[Tier, ...]


@frozen
class ResidencyTransition:
    """All chunks of one list whose tiers changed the same way."""

    list: ChunkList
    old_tiers: tuple[Tier, ...]
    new_tiers: tuple[Tier, ...]
    chunks: int
    bytes: int


@frozen
class PlanMove:
    """One chunk whose OS tier or optimizer tier changed."""

    field: str  # "os_tier" or "optimizer_tier"
    chunk: int
    bytes: int  # the chunk's optimizer state (MASTER + M + V, or M + V in fp32)
    old: Tier
    new: Tier


@frozen
class ResidencyDiff:
    comparable: bool  # chunk ids mean the same tensors in both (same chunk size and count)
    per_list_tier: tuple[tuple[ChunkList, Tier, Change], ...]  # chunks holding a copy at iteration start
    moved_chunks: int
    moved_bytes: int
    transitions: tuple[ResidencyTransition, ...]  # grouped by (list, old tiers, new tiers), most bytes first
    largest_moves: tuple[ChunkMove, ...]
    os_tier: tuple[Change, ...]  # chunks per OS tier
    optimizer_tier: tuple[Change, ...]  # chunks per optimizer tier
    plan_transitions: tuple[tuple[str, Tier, Tier, int, int], ...]  # (field, old, new, chunks, bytes)
    largest_plan_moves: tuple[PlanMove, ...]


@frozen
class BlockRangeChange:
    """Consecutive blocks whose activation mode changed the same way."""

    first_block: int
    last_block: int
    old_mode: str
    new_mode: str
    bytes: int  # saved-for-backward bytes of these blocks (new schedule)


@frozen
class ActivationDiff:
    blocks: Change
    mode_counts: tuple[Change, ...]  # blocks per mode
    changed_blocks: int
    ranges: tuple[BlockRangeChange, ...]


@frozen
class ChannelDiff:
    channel: Channel
    actions: Change
    bytes: Change
    busy_seconds: Change  # the planner's prediction


@frozen
class ActionDiff:
    total: Change
    per_channel: tuple[ChannelDiff, ...]
    per_op: tuple[Change, ...]


@frozen
class StageChange:
    name: str
    seconds: Change


@frozen
class PredictionDiff:
    iteration_seconds: Change
    phase_seconds: tuple[Change, ...]  # sum of predicted stage seconds per phase
    stages_comparable: bool  # same stage names in the same order
    largest_stage_changes: tuple[StageChange, ...]
    peak_bytes: tuple[Change, ...]  # per tier
    flops: Change
    objective_seconds: Change
    lower_bound_seconds: Change


@frozen
class ScheduleDiff:
    """Everything `planner diff` reports; `identical` short-circuits the rest."""

    identical: bool
    old_label: str
    new_label: str
    inputs: tuple[TextChange | Change, ...]
    prediction: PredictionDiff
    layout: LayoutDiff
    residency: ResidencyDiff
    activations: ActivationDiff
    actions: ActionDiff
    notes: tuple[TextChange, ...]  # header notes that differ, by position

    @property
    def slower_percent(self) -> float:
        """How much slower NEW's predicted iteration is, in percent (negative: faster)."""
        pct = self.prediction.iteration_seconds.percent
        return math.inf if pct is None else pct

    def peak_growth_percent(self) -> dict[Tier, float]:
        out: dict[Tier, float] = {}
        for change in self.prediction.peak_bytes:
            pct = change.percent
            out[Tier(change.name)] = math.inf if pct is None else pct
        return out

    def failures(self, *, slower_pct: float | None = None, peak_grows_pct: float | None = None) -> list[str]:
        """One line per breached threshold (empty: within limits)."""
        out: list[str] = []
        if self.identical:
            return out
        it = self.prediction.iteration_seconds
        if slower_pct is not None and it.new > it.old and self.slower_percent > slower_pct:
            out.append(f"predicted iteration time grew {_pct(it.percent)} "
                       f"({_seconds(it.old)} -> {_seconds(it.new)}), limit --fail-if-slower {slower_pct:g}%")
        if peak_grows_pct is not None:
            for change in self.prediction.peak_bytes:
                growth = math.inf if change.percent is None else change.percent
                if change.new > change.old and growth > peak_grows_pct:
                    out.append(f"peak {change.name} grew {_pct(change.percent)} "
                               f"({_bytes(change.old)} -> {_bytes(change.new)}), limit --fail-if-peak-grows {peak_grows_pct:g}%")
        return out


# ----------------------------------------------------------------------------- computing


def _list_bytes(schedule: Schedule, lst: ChunkList) -> int:
    """Bytes per element of a chunk list (GRAD shares the compute dtype of PARAM)."""
    dtypes = schedule.layout.list_dtypes
    dtype = dtypes.get(lst) or dtypes[ChunkList.PARAM]
    return DTYPE_BYTES[dtype]


def _chunk_bytes(schedule: Schedule, lst: ChunkList, chunk: int) -> int:
    return schedule.layout.chunks[chunk].elements * _list_bytes(schedule, lst)


def _os_bytes(schedule: Schedule, chunk: int) -> int:
    lists = [x for x in schedule.layout.lists if x in (ChunkList.MASTER, ChunkList.M, ChunkList.V)]
    return sum(_chunk_bytes(schedule, x, chunk) for x in lists)


def _inputs(old: Schedule, new: Schedule) -> tuple[TextChange | Change, ...]:
    out: list[TextChange | Change] = []
    for field in ("trace_digest", "model_name", "hardware_name", "hardware_digest", "policy", "planner_version", "world_size"):
        a, b = getattr(old.header, field), getattr(new.header, field)
        if a != b:
            out.append(TextChange(name=field, old=str(a), new=str(b)))
    for tier, field in ((Tier.DEVICE, "device_bytes"), (Tier.HOST, "host_bytes"), (Tier.NVME, "nvme_bytes")):
        a, b = getattr(old.budgets, field), getattr(new.budgets, field)
        if a != b:
            out.append(Change(name=f"budget {tier.value}", old=a, new=b, unit="bytes"))
    return tuple(out)


def _notes(old: Schedule, new: Schedule) -> tuple[TextChange, ...]:
    pairs = itertools.zip_longest(old.header.notes, new.header.notes, fillvalue="")
    return tuple(TextChange(name=f"note {i + 1}", old=a, new=b) for i, (a, b) in enumerate(pairs) if a != b)


def _layout(old: Schedule, new: Schedule) -> LayoutDiff:
    lo, ln = old.layout, new.layout
    old_slots = {t.names[0]: t for t in lo.tensors}
    new_slots = {t.names[0]: t for t in ln.tensors}
    common = [name for name in new_slots if name in old_slots]
    moves: list[TensorMove] = []
    for name in common:
        a, b = old_slots[name], new_slots[name]
        if (a.chunk, a.offset_elements) != (b.chunk, b.offset_elements):
            moves.append(TensorMove(name=name, bytes=b.numel * _list_bytes(new, ChunkList.PARAM), old_chunk=a.chunk,
                                    old_offset_elements=a.offset_elements, new_chunk=b.chunk,
                                    new_offset_elements=b.offset_elements))
    moves.sort(key=lambda m: (-m.bytes, m.name))
    lists_a, lists_b = " ".join(x.value for x in lo.lists), " ".join(x.value for x in ln.lists)
    return LayoutDiff(
        chunk_elements=Change(name="chunk size", old=lo.chunk_elements, new=ln.chunk_elements, unit="elements"),
        chunk_bytes=Change(name="chunk bytes (PARAM)", old=lo.chunk_elements * _list_bytes(old, ChunkList.PARAM),
                           new=ln.chunk_elements * _list_bytes(new, ChunkList.PARAM), unit="bytes"),
        chunks=Change(name="chunks", old=len(lo.chunks), new=len(ln.chunks), unit="count"),
        lists=None if lists_a == lists_b else TextChange(name="lists", old=lists_a, new=lists_b),
        tensors_compared=len(common),
        tensors_added=len(new_slots.keys() - old_slots.keys()),
        tensors_removed=len(old_slots.keys() - new_slots.keys()),
        tensors_moved=len(moves),
        moved_bytes=sum(m.bytes for m in moves),
        largest_moves=tuple(moves[:TOP_MOVERS]),
    )


def _residency(old: Schedule, new: Schedule) -> ResidencyDiff:
    comparable = (old.layout.chunk_elements == new.layout.chunk_elements
                  and [c.elements for c in old.layout.chunks] == [c.elements for c in new.layout.chunks])
    lists = list(dict.fromkeys([*old.layout.lists, *new.layout.lists]))

    def counts(s: Schedule) -> Counter[tuple[ChunkList, Tier]]:
        return Counter((r.list, tier) for r in s.initial_residency for tier in r.tiers)

    ca, cb = counts(old), counts(new)
    per_list_tier = tuple((lst, tier, Change(name=f"{lst.value} {tier.value}", old=ca[(lst, tier)], new=cb[(lst, tier)], unit="count"))
                          for lst in lists for tier in Tier)

    moves: list[ChunkMove] = []
    plan_moves: list[PlanMove] = []
    transitions: Counter[tuple[str, Tier, Tier]] = Counter()
    transition_bytes: Counter[tuple[str, Tier, Tier]] = Counter()
    if comparable:
        ra = {(r.list, r.chunk): tuple(sorted(r.tiers)) for r in old.initial_residency}
        rb = {(r.list, r.chunk): tuple(sorted(r.tiers)) for r in new.initial_residency}
        for key in sorted(ra.keys() | rb.keys()):
            a, b = ra.get(key, ()), rb.get(key, ())
            if a != b:
                lst, chunk = key
                moves.append(ChunkMove(list=lst, chunk=chunk, bytes=_chunk_bytes(new if key in rb else old, lst, chunk),
                                       old_tiers=a, new_tiers=b))
        for pa, pb in zip(old.chunk_plans, new.chunk_plans):
            for field in ("os_tier", "optimizer_tier"):
                a, b = getattr(pa, field), getattr(pb, field)
                if a != b:
                    size = _os_bytes(new, pb.chunk)
                    plan_moves.append(PlanMove(field=field, chunk=pb.chunk, bytes=size, old=a, new=b))
                    transitions[(field, a, b)] += 1
                    transition_bytes[(field, a, b)] += size
    moves.sort(key=lambda m: (-m.bytes, m.list.value, m.chunk))
    groups: dict[tuple[ChunkList, tuple[Tier, ...], tuple[Tier, ...]], list[int]] = {}
    for m in moves:
        group = groups.setdefault((m.list, m.old_tiers, m.new_tiers), [0, 0])
        group[0] += 1
        group[1] += m.bytes
    grouped = sorted((ResidencyTransition(list=lst, old_tiers=a, new_tiers=b, chunks=n, bytes=nb)
                      for (lst, a, b), (n, nb) in groups.items()),
                     key=lambda t: (-t.bytes, t.list.value, t.old_tiers, t.new_tiers))
    plan_moves.sort(key=lambda m: (-m.bytes, m.field, m.chunk))

    def tier_counts(field: str) -> tuple[Change, ...]:
        a = Counter(getattr(p, field) for p in old.chunk_plans)
        b = Counter(getattr(p, field) for p in new.chunk_plans)
        return tuple(Change(name=t.value, old=a[t], new=b[t], unit="count") for t in Tier if a[t] or b[t])

    return ResidencyDiff(
        comparable=comparable,
        per_list_tier=per_list_tier,
        moved_chunks=len(moves),
        moved_bytes=sum(m.bytes for m in moves),
        transitions=tuple(grouped),
        largest_moves=tuple(moves[:TOP_MOVERS]),
        os_tier=tier_counts("os_tier"),
        optimizer_tier=tier_counts("optimizer_tier"),
        plan_transitions=tuple((f, a, b, n, transition_bytes[(f, a, b)]) for (f, a, b), n in sorted(transitions.items())),
        largest_plan_moves=tuple(m for field in ("os_tier", "optimizer_tier")
                                 for m in [x for x in plan_moves if x.field == field][:TOP_MOVERS]),
    )


def _activations(old: Schedule, new: Schedule) -> ActivationDiff:
    pa, pb = old.activation_plans, new.activation_plans
    ma, mb = Counter(p.mode for p in pa), Counter(p.mode for p in pb)
    modes = list(dict.fromkeys([p.mode for p in pa] + [p.mode for p in pb]))
    ranges: list[BlockRangeChange] = []
    changed = 0
    for a, b in zip(pa, pb):
        if a.mode == b.mode:
            continue
        changed += 1
        last = ranges[-1] if ranges else None
        if last and last.last_block == b.block - 1 and (last.old_mode, last.new_mode) == (a.mode.value, b.mode.value):
            ranges[-1] = BlockRangeChange(first_block=last.first_block, last_block=b.block, old_mode=last.old_mode,
                                          new_mode=last.new_mode, bytes=last.bytes + b.bytes)
        else:
            ranges.append(BlockRangeChange(first_block=b.block, last_block=b.block, old_mode=a.mode.value,
                                           new_mode=b.mode.value, bytes=b.bytes))
    return ActivationDiff(
        blocks=Change(name="blocks", old=len(pa), new=len(pb), unit="count"),
        mode_counts=tuple(Change(name=m.value, old=ma[m], new=mb[m], unit="count") for m in modes),
        changed_blocks=changed,
        ranges=tuple(ranges),
    )


def _actions(old: Schedule, new: Schedule) -> ActionDiff:
    def per_channel(s: Schedule) -> tuple[Counter[Channel], Counter[Channel]]:
        n: Counter[Channel] = Counter()
        b: Counter[Channel] = Counter()
        for a in s.actions:
            if a.channel is not None:
                n[a.channel] += 1
                b[a.channel] += a.bytes
        return n, b

    na, ba = per_channel(old)
    nb, bb = per_channel(new)
    ops_a, ops_b = Counter(a.op for a in old.actions), Counter(a.op for a in new.actions)
    busy_a, busy_b = old.prediction.busy_seconds_per_channel, new.prediction.busy_seconds_per_channel
    channels = [c for c in Channel if na[c] or nb[c] or busy_a.get(c) or busy_b.get(c)]
    return ActionDiff(
        total=Change(name="actions", old=len(old.actions), new=len(new.actions), unit="count"),
        per_channel=tuple(ChannelDiff(
            channel=c,
            actions=Change(name=c.value, old=na[c], new=nb[c], unit="count"),
            bytes=Change(name=c.value, old=ba[c], new=bb[c], unit="bytes"),
            busy_seconds=Change(name=c.value, old=busy_a.get(c, 0.0), new=busy_b.get(c, 0.0), unit="seconds"),
        ) for c in channels),
        per_op=tuple(Change(name=op.value, old=ops_a[op], new=ops_b[op], unit="count") for op in Op if ops_a[op] or ops_b[op]),
    )


def _prediction(old: Schedule, new: Schedule) -> PredictionDiff:
    def phase_sums(s: Schedule) -> dict[str, float]:
        out: dict[str, float] = {}
        for st in s.stages:
            out[st.phase.value] = out.get(st.phase.value, 0.0) + st.predicted_seconds
        return out

    fa, fb = phase_sums(old), phase_sums(new)
    phases = list(dict.fromkeys([*fa, *fb]))
    comparable = [st.name for st in old.stages] == [st.name for st in new.stages]
    stage_changes: list[StageChange] = []
    if comparable:
        for sa, sb in zip(old.stages, new.stages):
            if sa.predicted_seconds != sb.predicted_seconds:
                stage_changes.append(StageChange(name=sb.name, seconds=Change(name=sb.name, old=sa.predicted_seconds,
                                                                              new=sb.predicted_seconds, unit="seconds")))
    stage_changes.sort(key=lambda c: (-abs(c.seconds.delta), c.name))
    pa, pb = old.prediction, new.prediction
    return PredictionDiff(
        iteration_seconds=Change(name="iteration", old=pa.iteration_seconds, new=pb.iteration_seconds, unit="seconds"),
        phase_seconds=tuple(Change(name=p, old=fa.get(p, 0.0), new=fb.get(p, 0.0), unit="seconds") for p in phases),
        stages_comparable=comparable,
        largest_stage_changes=tuple(stage_changes[:TOP_STAGES]),
        peak_bytes=tuple(Change(name=t.value, old=pa.peak_bytes_per_tier.get(t, 0), new=pb.peak_bytes_per_tier.get(t, 0), unit="bytes")
                         for t in Tier if pa.peak_bytes_per_tier.get(t, 0) or pb.peak_bytes_per_tier.get(t, 0)),
        flops=Change(name="flops", old=pa.flops, new=pb.flops, unit="count"),
        objective_seconds=Change(name="objective", old=old.header.objective_seconds, new=new.header.objective_seconds, unit="seconds"),
        lower_bound_seconds=Change(name="lower bound", old=old.header.lower_bound_seconds,
                                   new=new.header.lower_bound_seconds, unit="seconds"),
    )


def diff_schedules(old: Schedule, new: Schedule, *, old_label: str = "OLD", new_label: str = "NEW",
                   identical: bool | None = None) -> ScheduleDiff:
    """Compare two schedules; `identical` may be passed when the caller compared the files' bytes."""
    return ScheduleDiff(
        identical=(old == new) if identical is None else identical,
        old_label=old_label,
        new_label=new_label,
        inputs=_inputs(old, new),
        prediction=_prediction(old, new),
        layout=_layout(old, new),
        residency=_residency(old, new),
        activations=_activations(old, new),
        actions=_actions(old, new),
        notes=_notes(old, new),
    )


# ----------------------------------------------------------------------------- formatting


def _bytes(n: float) -> str:
    """Decimal units, like the hardware profiles (1 GB = 10^9 bytes)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"


def _seconds(s: float) -> str:
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{sign}{s * 1e6:.1f} us"
    if s < 1:
        return f"{sign}{s * 1e3:.2f} ms"
    return f"{sign}{s:.3f} s"


def _count(n: float) -> str:
    return f"{int(n):,}" if float(n).is_integer() else f"{n:.4g}"


def _pct(p: float | None) -> str:
    return "new" if p is None else f"{p:+.1f}%"


def _value(x: float, unit: str) -> str:
    return {"bytes": _bytes, "seconds": _seconds}.get(unit, _count)(x)


def _signed(x: float, unit: str) -> str:
    return "+" + _value(x, unit) if x >= 0 else _value(x, unit)


def _change(c: Change) -> str:
    if not c.changed:
        return f"{_value(c.old, c.unit)} (unchanged)"
    return f"{_value(c.old, c.unit)} -> {_value(c.new, c.unit)}  {_signed(c.delta, c.unit)} ({_pct(c.percent)})"


def _tiers(tiers: Sequence[Tier]) -> str:
    return "+".join(t.value for t in tiers) or "nowhere"


def _blocks(r: BlockRangeChange) -> str:
    return f"block {r.first_block}" if r.first_block == r.last_block else f"blocks {r.first_block}-{r.last_block}"


def _ranges_text(ranges: Sequence[BlockRangeChange], limit: int = 6) -> str:
    """Per kind of change: how many blocks, their bytes, and which (ranges, the first few)."""
    kinds: dict[tuple[str, str], list[BlockRangeChange]] = {}
    for r in ranges:
        kinds.setdefault((r.old_mode, r.new_mode), []).append(r)
    parts = []
    for (a, b), items in kinds.items():
        n = sum(r.last_block - r.first_block + 1 for r in items)
        where = ", ".join(str(r.first_block) if r.first_block == r.last_block else f"{r.first_block}-{r.last_block}"
                          for r in items[:limit])
        if len(items) > limit:
            where += f", ... {items[-1].last_block}"
        parts.append(f"{a}->{b} {n} block{'s' if n != 1 else ''} ({_bytes(sum(r.bytes for r in items))}): {where}")
    return "; ".join(parts)


def _sections(d: ScheduleDiff) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(label, text)]) shared by the text and markdown renderers."""
    sections: list[tuple[str, list[tuple[str, str]]]] = []
    if d.inputs:
        rows = []
        for c in d.inputs:
            rows.append((c.name, _change(c) if isinstance(c, Change) else f"{_short(c.old)} -> {_short(c.new)}"))
        sections.append(("inputs differ", rows))

    p = d.prediction
    rows = [("iteration time", _change(p.iteration_seconds))]
    rows += [(f"{c.name} stages", _change(c)) for c in p.phase_seconds if c.changed]
    if p.largest_stage_changes:
        rows.append(("largest stage changes", ", ".join(f"{s.name} {_signed(s.seconds.delta, 'seconds')}"
                                                        for s in p.largest_stage_changes)))
    elif not p.stages_comparable:
        rows.append(("stages", "different stage structure; compared per phase only"))
    rows += [(f"peak {c.name}", _change(c)) for c in p.peak_bytes]
    if p.lower_bound_seconds.changed:
        rows.append(("lower bound", _change(p.lower_bound_seconds)))
    if p.flops.changed:
        rows.append(("model FLOPs", _change(p.flops)))
    sections.append(("prediction", rows))

    lay = d.layout
    size = lay.chunk_elements
    rows = [("chunk size", f"{_count(size.old)} -> {_count(size.new)} elements ({_pct(size.percent)}), "
                           f"{_bytes(lay.chunk_bytes.old)} -> {_bytes(lay.chunk_bytes.new)} per PARAM chunk" if size.changed
             else f"{_count(size.old)} elements = {_bytes(lay.chunk_bytes.old)} per PARAM chunk (unchanged)"),
            ("chunks", _change(lay.chunks))]
    if lay.lists:
        rows.append(("chunk lists", f"{lay.lists.old} -> {lay.lists.new}"))
    moved = f"{lay.tensors_moved} of {lay.tensors_compared} ({_bytes(lay.moved_bytes)})"
    if lay.largest_moves:
        moved += "; largest: " + ", ".join(
            f"{m.name} {_bytes(m.bytes)} chunk {m.old_chunk}@{m.old_offset_elements} -> {m.new_chunk}@{m.new_offset_elements}"
            for m in lay.largest_moves)
    rows.append(("tensors moved", moved))
    if lay.tensors_added or lay.tensors_removed:
        rows.append(("tensors", f"{lay.tensors_added} only in {d.new_label}, {lay.tensors_removed} only in {d.old_label}"))
    sections.append(("chunk layout", rows))

    r = d.residency
    rows = []
    lists = list(dict.fromkeys(lst for lst, _, _ in r.per_list_tier))
    for lst in lists:
        cells = [(tier, c) for l2, tier, c in r.per_list_tier if l2 == lst and (c.old or c.new)]
        if not cells:
            continue
        text = ", ".join(f"{tier.value} {_count(c.old)}" + (f"->{_count(c.new)}" if c.changed else "") for tier, c in cells)
        rows.append((f"{lst.value} chunks", text))
    if r.comparable:
        moved = f"{r.moved_chunks} ({_bytes(r.moved_bytes)})"
        if r.transitions:
            moved += ": " + ", ".join(f"{t.list.value} {_tiers(t.old_tiers)}->{_tiers(t.new_tiers)} {t.chunks} ({_bytes(t.bytes)})"
                                      for t in r.transitions[:4])
            if len(r.transitions) > 4:
                moved += f", ... {len(r.transitions) - 4} more kinds"
        rows.append(("chunks moved", moved))
        if r.largest_moves and r.largest_moves[0].bytes * r.moved_chunks > r.moved_bytes:  # sizes vary: name the big ones
            rows.append(("largest movers", ", ".join(f"{m.list.value}#{m.chunk} {_bytes(m.bytes)} {_tiers(m.old_tiers)}->{_tiers(m.new_tiers)}"
                                                     for m in r.largest_moves)))
        for field, title in (("os_tier", "OS tier"), ("optimizer_tier", "optimizer on")):
            trans = [t for t in r.plan_transitions if t[0] == field]
            counts = r.os_tier if field == "os_tier" else r.optimizer_tier
            text = ", ".join(f"{c.name} {_count(c.old)}" + (f"->{_count(c.new)}" if c.changed else "") for c in counts)
            if trans:
                text += "; moved " + ", ".join(f"{a.value}->{b.value} {n} chunks ({_bytes(nb)})" for _, a, b, n, nb in trans)
                largest = [m for m in r.largest_plan_moves if m.field == field]
                n_moved, moved_bytes = sum(t[3] for t in trans), sum(t[4] for t in trans)
                if largest and largest[0].bytes * n_moved > moved_bytes:  # sizes vary: name the big ones
                    text += "; largest: " + ", ".join(f"#{m.chunk} {_bytes(m.bytes)}" for m in largest)
            rows.append((title, text))
    else:
        rows.append(("chunks moved", "layouts differ: chunk ids are not comparable, counts only"))
    sections.append(("residency at iteration start", rows))

    a = d.activations
    rows = [("modes", ", ".join(f"{c.name} {_count(c.old)}" + (f"->{_count(c.new)}" if c.changed else "") for c in a.mode_counts)
             or "no blocks")]
    if a.blocks.changed:
        rows.append(("blocks", _change(a.blocks)))
    rows.append(("blocks changed", f"{a.changed_blocks}" + (f": {_ranges_text(a.ranges)}" if a.ranges else "")))
    sections.append(("activation plan", rows))

    act = d.actions
    rows = [("actions", _change(act.total))]
    for ch in act.per_channel:
        parts = []
        if ch.actions.old or ch.actions.new:
            parts.append(f"{_count(ch.actions.old)}->{_count(ch.actions.new)} actions" if ch.actions.changed
                         else f"{_count(ch.actions.old)} actions")
        if ch.bytes.old or ch.bytes.new:
            parts.append(_change(ch.bytes))
        busy = ch.busy_seconds
        parts.append(f"busy {_seconds(busy.old)} -> {_seconds(busy.new)} ({_pct(busy.percent)})" if busy.changed
                     else f"busy {_seconds(busy.old)}")
        rows.append((ch.channel.value, ", ".join(parts)))
    rows.append(("per op", ", ".join(f"{c.name} {_count(c.old)}" + (f"->{_count(c.new)}" if c.changed else "") for c in act.per_op)))
    sections.append(("actions per channel", rows))
    if d.notes:
        sections.append(("planner notes differ", [(c.name, _excerpt(c.old, c.new)) for c in d.notes]))
    return sections


def _excerpt(old: str, new: str, before: int = 40, after: int = 80) -> str:
    """Both texts from a little before their first difference: a long note stays one readable line."""
    k = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    start = max(0, k - before)

    def cut(text: str) -> str:
        if not text:
            return "(none)"
        return ("..." if start else "") + text[start:k + after] + ("..." if len(text) > k + after else "")

    return f"{cut(old)} -> {cut(new)}"


def _short(text: str) -> str:
    """Digests shortened to 12 hex digits: enough to tell them apart on screen."""
    return text[:19] if text.startswith("sha256:") else text


def _identical_line(d: ScheduleDiff) -> str:
    return (f"identical: {d.old_label} and {d.new_label} are the same schedule "
            f"(predicted {_seconds(d.prediction.iteration_seconds.old)} per iteration)")


def render_text(d: ScheduleDiff) -> str:
    if d.identical:
        return _identical_line(d)
    lines = [f"schedule diff: {d.old_label} -> {d.new_label}"]
    for title, rows in _sections(d):
        lines.append(title)
        width = max(len(label) for label, _ in rows)
        lines += [f"  {label:<{width}}  {text}" for label, text in rows]
    return "\n".join(lines)


def render_markdown(d: ScheduleDiff) -> str:
    if d.identical:
        return _identical_line(d).replace(d.old_label, f"`{d.old_label}`").replace(d.new_label, f"`{d.new_label}`")
    lines = [f"### Schedule diff: `{d.old_label}` → `{d.new_label}`", ""]
    for title, rows in _sections(d):
        lines += [f"#### {title[0].upper()}{title[1:]}", "", "| | |", "| --- | --- |"]
        lines += [f"| {label} | {text.replace('|', '/')} |" for label, text in rows]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _change_json(c: Change) -> dict[str, Any]:
    return {"old": c.old, "new": c.new, "delta": c.delta, "percent": c.percent, "unit": c.unit}


def to_json(d: ScheduleDiff) -> dict[str, Any]:
    """A plain dict for scripts: every Change as {old, new, delta, percent, unit}."""
    if d.identical:
        return {"identical": True, "old": d.old_label, "new": d.new_label}
    p, lay, r, a, act = d.prediction, d.layout, d.residency, d.activations, d.actions
    return {
        "identical": False,
        "old": d.old_label,
        "new": d.new_label,
        "inputs": {c.name: (_change_json(c) if isinstance(c, Change) else {"old": c.old, "new": c.new}) for c in d.inputs},
        "prediction": {
            "iteration_seconds": _change_json(p.iteration_seconds),
            "phase_seconds": {c.name: _change_json(c) for c in p.phase_seconds},
            "stages_comparable": p.stages_comparable,
            "largest_stage_changes": [{"stage": s.name, **_change_json(s.seconds)} for s in p.largest_stage_changes],
            "peak_bytes": {c.name: _change_json(c) for c in p.peak_bytes},
            "flops": _change_json(p.flops),
            "objective_seconds": _change_json(p.objective_seconds),
            "lower_bound_seconds": _change_json(p.lower_bound_seconds),
        },
        "layout": {
            "chunk_elements": _change_json(lay.chunk_elements),
            "chunk_bytes": _change_json(lay.chunk_bytes),
            "chunks": _change_json(lay.chunks),
            "lists": None if lay.lists is None else {"old": lay.lists.old.split(), "new": lay.lists.new.split()},
            "tensors_compared": lay.tensors_compared,
            "tensors_added": lay.tensors_added,
            "tensors_removed": lay.tensors_removed,
            "tensors_moved": lay.tensors_moved,
            "moved_bytes": lay.moved_bytes,
            "largest_moves": [{"tensor": m.name, "bytes": m.bytes, "old": [m.old_chunk, m.old_offset_elements],
                               "new": [m.new_chunk, m.new_offset_elements]} for m in lay.largest_moves],
        },
        "residency": {
            "comparable": r.comparable,
            "chunks_per_list_tier": {f"{lst.value}/{tier.value}": _change_json(c) for lst, tier, c in r.per_list_tier},
            "moved_chunks": r.moved_chunks,
            "moved_bytes": r.moved_bytes,
            "transitions": [{"list": t.list.value, "old": [x.value for x in t.old_tiers], "new": [x.value for x in t.new_tiers],
                             "chunks": t.chunks, "bytes": t.bytes} for t in r.transitions],
            "largest_moves": [{"list": m.list.value, "chunk": m.chunk, "bytes": m.bytes, "old": [t.value for t in m.old_tiers],
                               "new": [t.value for t in m.new_tiers]} for m in r.largest_moves],
            "os_tier": {c.name: _change_json(c) for c in r.os_tier},
            "optimizer_tier": {c.name: _change_json(c) for c in r.optimizer_tier},
            "plan_transitions": [{"field": f, "old": x.value, "new": y.value, "chunks": n, "bytes": b}
                                 for f, x, y, n, b in r.plan_transitions],
        },
        "activations": {
            "blocks": _change_json(a.blocks),
            "modes": {c.name: _change_json(c) for c in a.mode_counts},
            "changed_blocks": a.changed_blocks,
            "ranges": [{"first_block": x.first_block, "last_block": x.last_block, "old": x.old_mode, "new": x.new_mode,
                        "bytes": x.bytes} for x in a.ranges],
        },
        "actions": {
            "total": _change_json(act.total),
            "per_channel": {c.channel.value: {"actions": _change_json(c.actions), "bytes": _change_json(c.bytes),
                                              "busy_seconds": _change_json(c.busy_seconds)} for c in act.per_channel},
            "per_op": {c.name: _change_json(c) for c in act.per_op},
        },
        "notes": {c.name: {"old": c.old, "new": c.new} for c in d.notes},
    }


def render_json(d: ScheduleDiff, failures: Iterable[str] = ()) -> str:
    data = to_json(d)
    data["failures"] = list(failures)
    # inf/nan would make invalid JSON; percent is None (not inf) for growth from zero
    return json.dumps(data, indent=2, allow_nan=False)


# ----------------------------------------------------------------------------- CLI


def diff_files(old_path: str | Path, new_path: str | Path) -> ScheduleDiff:
    """Read both schedules (validated) and diff them; equal bytes short-circuit to identical."""
    raw_old, raw_new = read_bytes("schedule", old_path), read_bytes("schedule", new_path)
    old = Schedule.from_msgpack(raw_old, source=str(old_path))
    new = old if raw_new == raw_old else Schedule.from_msgpack(raw_new, source=str(new_path))
    return diff_schedules(old, new, old_label=str(old_path), new_label=str(new_path),
                          identical=True if raw_old == raw_new else None)


def _run(args: argparse.Namespace) -> int:
    d = diff_files(args.old, args.new)
    failures = d.failures(slower_pct=args.fail_if_slower, peak_grows_pct=args.fail_if_peak_grows)
    if args.format == "json":
        print(render_json(d, failures))
    elif args.format == "markdown":
        print(render_markdown(d), end="")
        for line in failures:
            print(f"\n**FAIL:** {line}")
    else:
        print(render_text(d))
        for line in failures:
            print(f"FAIL: {line}")
    return 1 if failures else 0


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a percentage such as 1 or 2.5, found {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a finite percentage >= 0, found {text!r}")
    return value


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "diff",
        description="Compare two schedules: inputs, predicted time and peaks, chunk layout, residency, "
                    "activation plan and actions per channel, each with delta and percentage.",
    )
    p.add_argument("old", metavar="OLD", help="the schedule before (.msgpack)")
    p.add_argument("new", metavar="NEW", help="the schedule after (.msgpack)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", dest="format", action="store_const", const="markdown", help="markdown for a pull-request comment")
    fmt.add_argument("--json", dest="format", action="store_const", const="json", help="JSON for scripts")
    p.set_defaults(format="text")
    p.add_argument("--fail-if-slower", type=_percent, metavar="PCT",
                   help="exit 1 when NEW's predicted iteration time exceeds OLD's by more than PCT percent")
    p.add_argument("--fail-if-peak-grows", type=_percent, metavar="PCT",
                   help="exit 1 when any tier's predicted peak in NEW exceeds OLD's by more than PCT percent")
    p.set_defaults(func=_run)


__all__ = ["ScheduleDiff", "Change", "diff_files", "diff_schedules", "register", "render_json", "render_markdown",
           "render_text", "to_json"]
