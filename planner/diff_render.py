"""`planner.diff` as text (one screen, top movers only), markdown and JSON."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from schemas.schedule import Tier

from planner.diff_types import BlockRangeChange, Change, ScheduleDiff, format_bytes, format_count, format_pct, format_seconds


def _value(x: float, unit: str) -> str:
    return {"bytes": format_bytes, "seconds": format_seconds}.get(unit, format_count)(x)


def _signed(x: float, unit: str) -> str:
    return "+" + _value(x, unit) if x >= 0 else _value(x, unit)


def _change(c: Change) -> str:
    if not c.changed:
        return f"{_value(c.old, c.unit)} (unchanged)"
    return f"{_value(c.old, c.unit)} -> {_value(c.new, c.unit)}  {_signed(c.delta, c.unit)} ({format_pct(c.percent)})"


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
        parts.append(f"{a}->{b} {n} block{'s' if n != 1 else ''} ({format_bytes(sum(r.bytes for r in items))}): {where}")
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
    rows = [("chunk size", f"{format_count(size.old)} -> {format_count(size.new)} elements ({format_pct(size.percent)}), "
                           f"{format_bytes(lay.chunk_bytes.old)} -> {format_bytes(lay.chunk_bytes.new)} per PARAM chunk" if size.changed
             else f"{format_count(size.old)} elements = {format_bytes(lay.chunk_bytes.old)} per PARAM chunk (unchanged)"),
            ("chunks", _change(lay.chunks))]
    if lay.lists:
        rows.append(("chunk lists", f"{lay.lists.old} -> {lay.lists.new}"))
    moved = f"{lay.tensors_moved} of {lay.tensors_compared} ({format_bytes(lay.moved_bytes)})"
    if lay.largest_moves:
        moved += "; largest: " + ", ".join(
            f"{m.name} {format_bytes(m.bytes)} chunk {m.old_chunk}@{m.old_offset_elements} -> {m.new_chunk}@{m.new_offset_elements}"
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
        text = ", ".join(f"{tier.value} {format_count(c.old)}" + (f"->{format_count(c.new)}" if c.changed else "") for tier, c in cells)
        rows.append((f"{lst.value} chunks", text))
    if r.comparable:
        moved = f"{r.moved_chunks} ({format_bytes(r.moved_bytes)})"
        if r.transitions:
            moved += ": " + ", ".join(f"{t.list.value} {_tiers(t.old_tiers)}->{_tiers(t.new_tiers)} {t.chunks} ({format_bytes(t.bytes)})"
                                      for t in r.transitions[:4])
            if len(r.transitions) > 4:
                moved += f", ... {len(r.transitions) - 4} more kinds"
        rows.append(("chunks moved", moved))
        if r.largest_moves and r.largest_moves[0].bytes * r.moved_chunks > r.moved_bytes:  # sizes vary: name the big ones
            rows.append(("largest movers", ", ".join(f"{m.list.value}#{m.chunk} {format_bytes(m.bytes)} {_tiers(m.old_tiers)}->{_tiers(m.new_tiers)}"
                                                     for m in r.largest_moves)))
        for field, title in (("os_tier", "OS tier"), ("optimizer_tier", "optimizer on")):
            trans = [t for t in r.plan_transitions if t[0] == field]
            counts = r.os_tier if field == "os_tier" else r.optimizer_tier
            text = ", ".join(f"{c.name} {format_count(c.old)}" + (f"->{format_count(c.new)}" if c.changed else "") for c in counts)
            if trans:
                text += "; moved " + ", ".join(f"{a.value}->{b.value} {n} chunks ({format_bytes(nb)})" for _, a, b, n, nb in trans)
                largest = [m for m in r.largest_plan_moves if m.field == field]
                n_moved, moved_bytes = sum(t[3] for t in trans), sum(t[4] for t in trans)
                if largest and largest[0].bytes * n_moved > moved_bytes:  # sizes vary: name the big ones
                    text += "; largest: " + ", ".join(f"#{m.chunk} {format_bytes(m.bytes)}" for m in largest)
            rows.append((title, text))
    else:
        rows.append(("chunks moved", "layouts differ: chunk ids are not comparable, counts only"))
    sections.append(("residency at iteration start", rows))

    a = d.activations
    rows = [("modes", ", ".join(f"{c.name} {format_count(c.old)}" + (f"->{format_count(c.new)}" if c.changed else "") for c in a.mode_counts)
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
            parts.append(f"{format_count(ch.actions.old)}->{format_count(ch.actions.new)} actions" if ch.actions.changed
                         else f"{format_count(ch.actions.old)} actions")
        if ch.bytes.old or ch.bytes.new:
            parts.append(_change(ch.bytes))
        busy = ch.busy_seconds
        parts.append(f"busy {format_seconds(busy.old)} -> {format_seconds(busy.new)} ({format_pct(busy.percent)})" if busy.changed
                     else f"busy {format_seconds(busy.old)}")
        rows.append((ch.channel.value, ", ".join(parts)))
    rows.append(("per op", ", ".join(f"{c.name} {format_count(c.old)}" + (f"->{format_count(c.new)}" if c.changed else "") for c in act.per_op)))
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
            f"(predicted {format_seconds(d.prediction.iteration_seconds.old)} per iteration)")


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


__all__ = ["render_json", "render_markdown", "render_text", "to_json"]
