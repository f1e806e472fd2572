"""What `planner.diff` finds between two schedules: a change with its delta and percentage, and one
record per section (inputs, prediction, layout, residency, activations, actions)."""

from __future__ import annotations

import math

from schemas._base import frozen
from schemas.schedule import Channel, ChunkList, Tier


# text of numbers, shared by the failure messages here and planner.diff_render


def format_bytes(n: float) -> str:
    """Decimal units, like the hardware profiles (1 GB = 10^9 bytes)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"


def format_seconds(s: float) -> str:
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{sign}{s * 1e6:.1f} us"
    if s < 1:
        return f"{sign}{s * 1e3:.2f} ms"
    return f"{sign}{s:.3f} s"


def format_count(n: float) -> str:
    return f"{int(n):,}" if float(n).is_integer() else f"{n:.4g}"


def format_pct(p: float | None) -> str:
    return "new" if p is None else f"{p:+.1f}%"


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
            out.append(f"predicted iteration time grew {format_pct(it.percent)} "
                       f"({format_seconds(it.old)} -> {format_seconds(it.new)}), limit --fail-if-slower {slower_pct:g}%")
        if peak_grows_pct is not None:
            for change in self.prediction.peak_bytes:
                growth = math.inf if change.percent is None else change.percent
                if change.new > change.old and growth > peak_grows_pct:
                    out.append(f"peak {change.name} grew {format_pct(change.percent)} "
                               f"({format_bytes(change.old)} -> {format_bytes(change.new)}), limit --fail-if-peak-grows {peak_grows_pct:g}%")
        return out


__all__ = ["ActionDiff", "ActivationDiff", "BlockRangeChange", "Change", "ChannelDiff", "ChunkMove", "LayoutDiff",
           "PlanMove", "PredictionDiff", "ResidencyDiff", "ResidencyTransition", "ScheduleDiff", "StageChange",
           "TensorMove", "TextChange", "format_bytes", "format_count", "format_pct", "format_seconds"]
