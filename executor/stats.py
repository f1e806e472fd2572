"""What the engine measured, next to what the schedule predicted (DESIGN.md §5 "Counters"), and
the per-iteration counters the engine keeps to fill it."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from schemas.schedule import BYTE_CHANNELS, Channel, Schedule, Tier
from schemas.trace import Phase


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """Counters of the last complete iteration (micro-step), peaks since attach."""

    iterations: int  # micro-steps replayed to their last moment since attach
    bytes_per_channel: dict[Channel, int]  # bytes copied in the last iteration (== the schedule's prediction)
    total_bytes_per_channel: dict[Channel, int]  # since attach
    stall_seconds: float  # last iteration: seconds the training thread waited for copies
    peak_bytes_per_tier: dict[Tier, int]  # chunk bytes held at once per tier, since attach
    seconds_per_phase: dict[Phase, float]  # last iteration, wall seconds from each moment to the next
    optimizer_seconds_per_tier: dict[Tier, float]  # last iteration: seconds in ChunkAdamW.step_chunk
    iteration_seconds: float  # last iteration: root pre_forward to the end of engine.step()
    peak_activation_bytes: int = 0  # since attach: activation bytes held on DEVICE at once (ActivationManager)
    optimizer_state_bytes: int = 0  # MASTER, M and V the store holds now, once per chunk whatever its tiers
    # last iteration: seconds the steps kept a core busy (stepping._busy_clock: CPU time of a 1-thread
    # step, which leaves out the time backward preempts the nice-19 worker; wall time otherwise)
    optimizer_busy_seconds_per_tier: dict[Tier, float] = field(default_factory=dict)

    def bytes_match(self, schedule: Schedule) -> bool:
        """Whether the last iteration moved exactly the bytes the schedule predicts on every channel."""
        predicted = {ch: n for ch, n in schedule.prediction.bytes_per_channel.items() if n and ch in BYTE_CHANNELS}
        return predicted == {ch: n for ch, n in self.bytes_per_channel.items() if n}

    def table(self, schedule: Schedule | None = None) -> str:
        """A plain-text table: measured (and predicted, when the schedule is given)."""
        rows: list[tuple[str, str, str]] = []
        pred = schedule.prediction if schedule is not None else None
        for ch in BYTE_CHANNELS:
            got = self.bytes_per_channel.get(ch, 0)
            want = pred.bytes_per_channel.get(ch, 0) if pred else None
            if got or want:
                rows.append((f"bytes {ch.value}", f"{got:,}", "" if want is None else f"{want:,}"))
        for tier in (Tier.DEVICE, Tier.HOST):
            got = self.peak_bytes_per_tier.get(tier, 0)
            want = pred.peak_bytes_per_tier.get(tier) if pred else None
            rows.append((f"peak chunk bytes {tier.value}", f"{got:,}", "" if want is None else f"{want:,} (incl. non-model)"))
        rows.append(("peak activation bytes DEVICE", f"{self.peak_activation_bytes:,}", ""))
        rows.append(("optimizer state bytes", f"{self.optimizer_state_bytes:,}", ""))
        for phase in Phase:
            if phase in self.seconds_per_phase:
                rows.append((f"seconds {phase.value}", f"{self.seconds_per_phase[phase]:.4f}", ""))
        rows.append(("stall seconds", f"{self.stall_seconds:.4f}", ""))
        rows.append(("iteration seconds", f"{self.iteration_seconds:.4f}",
                     "" if pred is None else f"{pred.iteration_seconds:.4f}"))
        width = max(len(r[0]) for r in rows)
        lines = [f"{'':{width}}  {'measured':>16}  {'predicted' if pred else ''}"]
        lines += [f"{name:{width}}  {got:>16}  {want}".rstrip() for name, got, want in rows]
        return "\n".join(lines)


class IterationCounters:
    """Counters of the iteration in progress and of the last complete one; `engine` is the
    `executor.runtime.Engine` they count (its byte, stall and peak counters)."""

    def __init__(self) -> None:
        self.bytes_at_start: dict[Any, int] = {}
        self.stall_at_start = 0.0
        self.iteration_start = 0.0
        self.phase_seconds: dict[Phase, float] = defaultdict(float)
        self.optimizer_seconds: dict[Tier, float] = defaultdict(float)
        self.optimizer_busy_seconds: dict[Tier, float] = defaultdict(float)
        self.last: dict[str, Any] = {}

    def begin_iteration(self, engine: Any) -> None:
        self.bytes_at_start = engine.bytes_per_channel()
        self.stall_at_start = engine.stall_seconds()
        self.iteration_start = time.perf_counter()
        self.phase_seconds = defaultdict(float)
        self.optimizer_seconds = defaultdict(float)
        self.optimizer_busy_seconds = defaultdict(float)

    def add_phase(self, phase: Phase, seconds: float, *, last_backward: bool) -> None:
        if not last_backward:  # from root post_backward to engine.step() is the user's time
            self.phase_seconds[phase] += seconds

    def end_iteration(self, engine: Any) -> None:
        self.last = {
            "bytes_per_channel": {ch: n - self.bytes_at_start.get(ch, 0) for ch, n in engine.bytes_per_channel().items()},
            "stall_seconds": engine.stall_seconds() - self.stall_at_start,
            "iteration_seconds": time.perf_counter() - self.iteration_start,
            "seconds_per_phase": dict(self.phase_seconds),
            "optimizer_seconds_per_tier": dict(self.optimizer_seconds),
            "optimizer_busy_seconds_per_tier": dict(self.optimizer_busy_seconds),
        }

    def snapshot(self, engine: Any) -> EngineStats:
        last = self.last
        return EngineStats(
            iterations=engine.iterations,
            bytes_per_channel={ch: n for ch, n in last.get("bytes_per_channel", {}).items() if n},
            total_bytes_per_channel={ch: n for ch, n in engine.bytes_per_channel().items() if n},
            stall_seconds=last.get("stall_seconds", 0.0),
            peak_bytes_per_tier={tier: pool.peak_bytes for tier, pool in engine.store.pools.items()},
            seconds_per_phase=last.get("seconds_per_phase", {}),
            optimizer_seconds_per_tier=last.get("optimizer_seconds_per_tier", {}),
            optimizer_busy_seconds_per_tier=last.get("optimizer_busy_seconds_per_tier", {}),
            iteration_seconds=last.get("iteration_seconds", 0.0),
            peak_activation_bytes=engine.activations.stats().peak_live_bytes,
            optimizer_state_bytes=engine.optimizer_state_bytes(),
        )


__all__ = ["EngineStats", "IterationCounters"]
