"""What the engine measured, next to what the schedule predicted (DESIGN.md §5 "Counters")."""

from __future__ import annotations

from dataclasses import dataclass

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


__all__ = ["EngineStats"]
