"""The trace format (`tide.trace`, msgpack): one recorded training iteration.

Moments are the clock. Moment `m` is an event (a module boundary or the optimizer step) *and* the
work that follows it until moment `m+1`: the parameters that work touches (`tensors`), its compute
time and FLOPs, and the peak of non-model bytes during it. (Measured at moment `m+1` this is "the
peak since the previous moment", PatrickStar issue #190; it is stored on the moment whose work
caused it, because that is the moment the planner must make room for.)
"""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path
from typing import Any

from schemas._base import (
    FormatError,
    atomic_write_bytes,
    check_numbers,
    check_header,
    check_schema,
    constrained,
    digest_bytes,
    from_plain,
    frozen,
    pack_msgpack,
    read_bytes,
    require,
    to_plain,
    unpack_msgpack,
)

TRACE_FORMAT = "tide.trace"
TRACE_VERSION = 1
_KIND = "trace"
_FIX = "re-record it with `python -m executor record ...`"


class DType(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


DTYPE_BYTES: dict[DType, int] = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2}


class Phase(StrEnum):
    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
    OPTIMIZER = "OPTIMIZER"


class MomentKind(StrEnum):
    PRE_FORWARD = "pre_forward"
    POST_FORWARD = "post_forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
    OPTIMIZER_STEP = "optimizer_step"


class Recording(StrEnum):
    REAL = "real"  # one iteration actually ran; times measured
    META = "meta"  # shapes only, on torch.device("meta"); times derived at plan time from FLOPs


class TimeSource(StrEnum):
    MEASURED = "measured"  # compute_seconds were timed (CUDA events or a monotonic clock)
    FLOPS = "flops"  # compute_seconds are 0; the planner derives them from flops / hardware rate


class OptimizerKind(StrEnum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


@frozen
class TraceMeta:
    """Where and how the trace was recorded."""

    model_name: str = constrained(minLength=1)
    model_config: dict[str, Any]  # the config the model was built from (JSON-able)
    batch_shape: tuple[int, ...]  # shape of the input batch, e.g. (B, T)
    compute_dtype: DType  # dtype of params in forward/backward
    world_size: int = constrained(minimum=1)
    torch_version: str
    device: str  # "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)", "meta"
    recording: Recording
    time_source: TimeSource
    optimizer: OptimizerKind


@frozen
class TensorInfo:
    """One parameter tensor; tied parameters appear once with all their names."""

    id: int = constrained(minimum=0)
    names: tuple[str, ...] = constrained(minItems=1)
    shape: tuple[int, ...]
    dtype: DType
    bytes: int = constrained(minimum=0)  # numel * itemsize
    trainable: bool  # requires_grad

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@frozen
class Block:
    """A repeating unit (e.g. a transformer layer): the unit of activation plans and stages."""

    id: int = constrained(minimum=0)
    module: str = constrained(minLength=1)  # fully qualified module name
    forward_flops: int = constrained(minimum=0)  # recompute cost in FLOPs
    forward_seconds: float = constrained(minimum=0)  # recompute cost in seconds (0 when time_source=flops)
    input_bytes: int = constrained(minimum=0)  # kept when the block is recomputed (its input)


@frozen
class Moment:
    """An event of the iteration and the work that follows it until the next moment."""

    id: int = constrained(minimum=0)
    phase: Phase
    kind: MomentKind
    module: str  # fully qualified module name, "" for the root module
    block: int = constrained(minimum=-1)  # -1 outside any block
    tensors: tuple[int, ...]  # parameter ids the following work touches
    compute_seconds: float = constrained(minimum=0)
    flops: int = constrained(minimum=0)
    non_model_bytes: int = constrained(minimum=0)  # peak during the following work


@frozen
class Activation:
    """One tensor saved for backward (deduplicated by storage)."""

    id: int = constrained(minimum=0)
    block: int = constrained(minimum=-1)
    bytes: int = constrained(minimum=0)
    produced_at: int = constrained(minimum=0)  # moment
    consumed_at: tuple[int, ...] = constrained(minItems=1)  # moments (backward)
    recompute_flops: int = constrained(minimum=0)  # FLOPs of the op that produced it
    recompute_seconds: float = constrained(minimum=0)


@frozen
class Trace:
    """A recorded training iteration."""

    meta: TraceMeta
    tensors: tuple[TensorInfo, ...]
    blocks: tuple[Block, ...]
    moments: tuple[Moment, ...] = constrained(minItems=1)
    activations: tuple[Activation, ...]

    # -- derived views -------------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def param_count(self) -> int:
        return sum(t.numel for t in self.tensors)

    def moments_of(self, phase: Phase) -> tuple[Moment, ...]:
        return tuple(m for m in self.moments if m.phase is phase)

    def block_activation_bytes(self) -> list[int]:
        """Bytes saved for backward by each block (the block-level view of `activations`)."""
        out = [0] * len(self.blocks)
        for act in self.activations:
            if act.block >= 0:
                out[act.block] += act.bytes
        return out

    # -- IO -------------------------------------------------------------------------------
    def to_msgpack(self) -> bytes:
        validate_trace(self, source="(trace being written)")
        return pack_msgpack({"format": TRACE_FORMAT, "format_version": TRACE_VERSION, **to_plain(self)})

    def write(self, path: str | Path) -> None:
        atomic_write_bytes(path, self.to_msgpack())

    @classmethod
    def from_msgpack(cls, payload: bytes, *, source: str = "(bytes)") -> Trace:
        data = unpack_msgpack(_KIND, source, payload, _FIX)
        check_header(_KIND, source, data, TRACE_FORMAT, TRACE_VERSION, _FIX)
        check_schema(_KIND, source, "trace.schema.json", data, fix=_FIX)
        data = {k: v for k, v in data.items() if k not in ("format", "format_version")}
        trace = from_plain(cls, data)
        validate_trace(trace, source=source)
        return trace

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        return cls.from_msgpack(read_bytes(_KIND, path), source=str(path))


def trace_digest(payload: bytes) -> str:
    return digest_bytes(payload)


# The longest a recorded piece of work may plausibly take: one day. A moment's work is one module's
# forward or backward, and the longest such piece tide can meet is a GPT-3 175B block on a CPU-emulated
# DEVICE (about 7.5 TFLOP forward at batch 1 x 2048 tokens, 6 x 1.75e11 / 96 x 2048 FLOPs per block;
# 15 GFLOPS on the 2-core CI machine's fp32 matmul, traces/hardware/cpu-emulated.toml: ~500 s forward,
# ~1000 s backward), two orders of magnitude below. Beyond it the number is a clock in the wrong unit
# or a corrupted file, and the placement model's rows lose their precision (a block at 1e7 s made the
# MIP find no integral plan, issue 21's leftovers): refused here with the field named.
MAX_RECORDED_SECONDS = 86_400.0


def validate_trace(trace: Trace, *, source: str) -> None:
    """Semantic rules the JSON Schema cannot express."""

    def req(cond: bool, path: str, message: str) -> None:
        require(cond, _KIND, source, path, message, _FIX)

    check_numbers(_KIND, source, trace, fix=_FIX)
    names: set[str] = set()
    for i, t in enumerate(trace.tensors):
        req(t.id == i, f"tensors[{i}].id", f"ids dense and in order, expected {i}, found {t.id}")
        req(all(d >= 0 for d in t.shape), f"tensors[{i}].shape", f"non-negative sizes, found {list(t.shape)}")
        expected = t.numel * DTYPE_BYTES[t.dtype]
        req(t.bytes == expected, f"tensors[{i}].bytes", f"shape x dtype = {expected} bytes, found {t.bytes}")
        for name in t.names:
            req(name not in names, f"tensors[{i}].names", f"each name once, found {name!r} twice")
            names.add(name)
    for i, b in enumerate(trace.blocks):
        req(b.id == i, f"blocks[{i}].id", f"ids dense and in order, expected {i}, found {b.id}")
        req(math.isfinite(b.forward_seconds), f"blocks[{i}].forward_seconds", "a finite number")
        req(b.forward_seconds <= MAX_RECORDED_SECONDS, f"blocks[{i}].forward_seconds", _plausible(b.forward_seconds))
    n_tensors, n_blocks, n_moments = len(trace.tensors), len(trace.blocks), len(trace.moments)
    phase_rank = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.OPTIMIZER: 2}
    last_rank = 0
    for i, m in enumerate(trace.moments):
        req(m.id == i, f"moments[{i}].id", f"ids dense and in order, expected {i}, found {m.id}")
        req(m.block < n_blocks, f"moments[{i}].block", f"a block id below {n_blocks} or -1, found {m.block}")
        req(math.isfinite(m.compute_seconds), f"moments[{i}].compute_seconds", f"a finite number, found {m.compute_seconds}")
        req(m.compute_seconds <= MAX_RECORDED_SECONDS, f"moments[{i}].compute_seconds",
            _plausible(m.compute_seconds) + f" ({m.phase.value.lower()} {m.kind.value} {m.module or '(root)'})")
        for j, tid in enumerate(m.tensors):
            req(0 <= tid < n_tensors, f"moments[{i}].tensors[{j}]", f"a tensor id below {n_tensors}, found {tid}")
        rank = phase_rank[m.phase]
        req(rank >= last_rank, f"moments[{i}].phase", f"phases in order FORWARD, BACKWARD, OPTIMIZER, found {m.phase} after a later phase")
        last_rank = rank
    for i, a in enumerate(trace.activations):
        req(a.id == i, f"activations[{i}].id", f"ids dense and in order, expected {i}, found {a.id}")
        req(a.block < n_blocks, f"activations[{i}].block", f"a block id below {n_blocks} or -1, found {a.block}")
        req(a.produced_at < n_moments, f"activations[{i}].produced_at", f"a moment id below {n_moments}, found {a.produced_at}")
        for j, c in enumerate(a.consumed_at):
            req(a.produced_at < c < n_moments, f"activations[{i}].consumed_at[{j}]",
                f"a moment after produced_at={a.produced_at} and below {n_moments}, found {c}")
        req(math.isfinite(a.recompute_seconds), f"activations[{i}].recompute_seconds", "a finite number")
        req(a.recompute_seconds <= MAX_RECORDED_SECONDS, f"activations[{i}].recompute_seconds", _plausible(a.recompute_seconds))


def _plausible(seconds: float) -> str:
    return (f"at most {MAX_RECORDED_SECONDS:g} s (one day for one piece of work; a clock in the wrong unit?), "
            f"found {seconds:g}")


__all__ = [
    "Activation", "Block", "DType", "DTYPE_BYTES", "FormatError", "Moment", "MomentKind", "OptimizerKind",
    "MAX_RECORDED_SECONDS", "Phase", "Recording", "TensorInfo", "TimeSource", "Trace", "TraceMeta", "TRACE_FORMAT", "TRACE_VERSION",
    "trace_digest", "validate_trace",
]
