"""`python -m planner diff OLD NEW`: what changed between two schedules, and what it costs.

A schedule under version control changes when the planner, the model or the hardware changes; CI
shows the change as this diff. Its sections and exit codes: Note [diff sections] above
`diff_schedules`.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections import Counter
from pathlib import Path
from typing import Any

from planner.diff_render import render_json, render_markdown, render_text, to_json
from planner.diff_types import (
    ActionDiff,
    ActivationDiff,
    BlockRangeChange,
    Change,
    ChannelDiff,
    ChunkMove,
    LayoutDiff,
    PlanMove,
    PredictionDiff,
    ResidencyDiff,
    ResidencyTransition,
    ScheduleDiff,
    StageChange,
    TensorMove,
    TextChange,
)
from schemas._base import read_bytes
from schemas.schedule import Channel, ChunkList, Op, Schedule, Tier
from schemas.trace import DTYPE_BYTES

TOP_MOVERS = 3  # largest movers listed per section: enough to act on, short enough for one screen
TOP_STAGES = 3


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
    for field in ("trace_digest", "model_name", "hardware_name", "hardware_digest", "policy", "planner_version", "world_size",
                  "host_staging"):
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


# Note [diff sections]:
# A schedule under version control changes when the planner, the model or the hardware changes; CI
# shows the change as this diff. The sections, in order:
#
# 1. inputs (only where they differ): trace and hardware digests, hardware name, policy, host staging, planner
#    version, budgets per tier -- stated first, because everything below follows from them;
# 2. prediction: iteration time, time per phase (sum of its stages' predicted seconds) and the
#    stages that changed most, peak bytes per tier -- each with its delta and percentage;
# 3. chunk layout: chunk size, chunk count, lists, tensors that moved to another chunk or offset
#    (matched by name, so schedules of different traces compare where they can);
# 4. residency at the start of the iteration: chunks per chunk list and tier, the chunks whose tiers
#    changed (largest by bytes), OS tier and optimizer tier changes per chunk;
# 5. activation plan: blocks whose mode changed, as ranges of blocks;
# 6. actions: count and bytes per channel, count per op;
# 7. the planner's notes (only where they differ): its reasoning, e.g. the simulated time of every
#    candidate plan -- excerpted around the first difference here, whole in `--json`.
#
# Everything is aggregated, with the top movers listed, so a 96-block model fits one screen.
# Identical schedules (same bytes, or equal objects) give exactly one line starting "identical:".
# `--fail-if-slower PCT` / `--fail-if-peak-grows PCT` turn a regression into exit code 1.


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
