"""What a replay in the simulator reports: the result (time, bytes and busy time per channel, peaks,
memory per moment, the channel timeline), and the violation that stops a schedule breaking a rule.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from planner.errors import PlannerError
from schemas._base import frozen
from schemas.schedule import Channel, ChunkList, Tier


@frozen
class MemorySample:
    """Bytes on one tier during one moment's work (after the moment's actions)."""

    moment: int
    tier: Tier
    non_model_bytes: int  # DEVICE only: the work's peak minus activations held elsewhere
    activation_bytes: int  # activations kept, reloaded or swapped to this tier
    chunk_bytes: dict[ChunkList, int]  # bytes of held chunk copies per chunk list

    @property
    def total_bytes(self) -> int:
        return self.non_model_bytes + self.activation_bytes + sum(self.chunk_bytes.values())


@frozen
class Interval:
    """One busy interval of one channel."""

    channel: Channel
    start_seconds: float
    end_seconds: float
    label: str
    step_chunk: int | None = None  # an OPTIMIZER_STEP's: the chunk it steps (None for every other interval)


@frozen
class SimResult:
    """What one replayed iteration costs on the hardware."""

    iteration_seconds: float
    tflops: float  # model FLOPs (without recompute) of all ranks together / iteration seconds / 1e12
    flops: int  # model FLOPs of one iteration of one rank (without recompute)
    recompute_flops: int
    bytes_per_channel: dict[Channel, int]
    busy_seconds_per_channel: dict[Channel, float]
    peak_bytes_per_tier: dict[Tier, int]
    stall_seconds: float  # total time the work waited for data past its event
    compute_seconds: float  # busy time of the work itself (incl. recompute, excl. GPU optimizer steps)
    moment_start_seconds: tuple[float, ...]
    memory: tuple[MemorySample, ...]
    timeline: tuple[Interval, ...]

    def to_json(self, *, detail: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "iteration_seconds": self.iteration_seconds,
            "tflops": self.tflops,
            "flops": self.flops,
            "recompute_flops": self.recompute_flops,
            "stall_seconds": self.stall_seconds,
            "compute_seconds": self.compute_seconds,
            "bytes_per_channel": {k.value: v for k, v in self.bytes_per_channel.items()},
            "busy_seconds_per_channel": {k.value: v for k, v in self.busy_seconds_per_channel.items()},
            "peak_bytes_per_tier": {k.value: v for k, v in self.peak_bytes_per_tier.items()},
        }
        if detail:
            out["moment_start_seconds"] = list(self.moment_start_seconds)
            out["memory"] = [
                {"moment": s.moment, "tier": s.tier.value, "non_model_bytes": s.non_model_bytes,
                 "activation_bytes": s.activation_bytes, "chunk_bytes": {k.value: v for k, v in s.chunk_bytes.items()}}
                for s in self.memory
            ]
            out["timeline"] = [[i.channel.value, i.start_seconds, i.end_seconds, i.label] for i in self.timeline]
        return out




class ViolationKind(StrEnum):
    USE_BEFORE_ARRIVAL = "use before arrival"  # the work needs a chunk that is not valid on DEVICE
    COPY_WITHOUT_SOURCE = "copy from a tier without a valid copy"
    EVICT_LAST_COPY = "evict of the last valid copy of live data"
    EVICT_ABSENT = "evict of a copy the tier does not hold"
    CAPACITY = "capacity exceeded"
    STEADY_STATE = "steady state broken"
    OPTIMIZER_INPUTS = "optimizer step without its inputs on its tier"
    OPTIMIZER_EARLY = "optimizer step before the final grads"
    OPTIMIZER_COUNT = "optimizer steps per chunk"
    ACTIVATIONS = "activation plan broken"
    CHANNEL = "channel does not connect the tiers"
    BAD_ACTION = "malformed action"


class ScheduleViolation(PlannerError):
    """A schedule breaks the action semantics; names moment, action index, chunk list and chunk."""

    def __init__(self, kind: ViolationKind, message: str, *, moment: int, action_index: int | None = None,
                 list_: ChunkList | None = None, chunk: int | None = None, block: int | None = None) -> None:
        self.kind, self.moment, self.action_index = kind, moment, action_index
        self.list, self.chunk, self.block = list_, chunk, block
        where = [f"moment {moment}"]
        where.append(f"action {action_index}" if action_index is not None else "the moment's work")
        if list_ is not None:
            where.append(f"list {list_.value}")
        if chunk is not None:
            where.append(f"chunk {chunk}")
        if block is not None:
            where.append(f"block {block}")
        super().__init__(f"schedule violation ({kind.value}) at {', '.join(where)}: {message}. "
                         "Fix: re-solve the schedule; if the planner produced it, this is a planner bug")


__all__ = ["Interval", "MemorySample", "ScheduleViolation", "SimResult", "ViolationKind"]
