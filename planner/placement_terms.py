"""The terms the placement model (`planner.placement`) is written in: its units (MiB, milliseconds),
the gaps between two uses of a chunk class with their prefetch stages, a block's activation windows,
and the solver constants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from planner.placement_input import BlockData, ChunkClass, PlacementInput
from schemas._base import frozen
from schemas.schedule import ActivationMode


ACT_MODES = (ActivationMode.KEEP, ActivationMode.RECOMPUTE, ActivationMode.SWAP_HOST, ActivationMode.SWAP_NVME)
INFINITE_BYTES = 10**18  # capacity used when a tier is "unbounded" (minimal-capacity searches)


def act_windows(b: BlockData, n_stages: int) -> tuple[range, range, int, int]:
    """(recompute savings stages, swap savings stages, offload stage, reload stage) of a block.

    Matches planner.materialize: a swapped block is offloaded at its last forward moment and
    reloaded at the start of the stage before its backward; RECOMPUTE keeps only the input from
    the end of the forward to the start of the backward.
    """
    p, c = b.forward_stage, b.backward_stage
    recompute = range(p + 1, c)
    offload = p
    reload = c - 1 if c - 1 > p else c
    swap = range(p + 1, reload)
    return recompute, swap, offload, reload


@frozen
class Gap:
    """Stages between two consecutive uses of a chunk class (cyclic: the last gap wraps the iteration)."""

    stages: tuple[int, ...]  # in time order
    lookahead: tuple[int, ...]  # the stages (a suffix of `stages`) where chunks may arrive
    wraps: bool  # contains the optimizer stage: CPU-stepped chunks come back updated


BYTE_UNIT = float(2**20)  # the model's bytes are MiB
TIME_UNIT = 1e-3  # the model's seconds are milliseconds
LOOKAHEAD_STAGES = 3  # the least prefetch depth: stages before its use in which a chunk may arrive
LOOKAHEAD_BUDGET = 200  # arrival variables per gap summed over chunk classes (depth = budget / classes)
MIP_RELATIVE_GAP = 1e-2  # stop the MIP once proven within 1% of its bound (the header's gap target is 2%)
SECONDARY_WEIGHT = 1e-4  # weight of moved/recomputed/CPU work in the objective (a tie-breaker)
NVME_STREAM_STAGED_CHUNKS = 2  # OS chunks of NVMe-streamed GPU steps staged on HOST at once (one read ahead)
SECONDARY_TERMS = 5  # channels that work is spread over: H2D, D2H, NVMe, CPU optimizer, compute


def scaled_input(d: PlacementInput) -> PlacementInput:
    """The same input in MiB and milliseconds (floats; the model never needs integral bytes)."""
    b, t = BYTE_UNIT, TIME_UNIT
    return dataclasses.replace(
        d,
        chunk_classes=tuple(dataclasses.replace(g, param_bytes=g.param_bytes / b, os_bytes=g.os_bytes / b,
                                                use_tail_seconds=tuple(x / t for x in g.use_tail_seconds))
                            for g in d.chunk_classes),
        blocks=tuple(dataclasses.replace(x, activation_bytes=x.activation_bytes / b, input_bytes=x.input_bytes / b,
                                         recompute_seconds=x.recompute_seconds / t) for x in d.blocks),
        stages=tuple(dataclasses.replace(st, compute_seconds=st.compute_seconds / t, non_model_bytes=st.non_model_bytes / b,
                                         tail_non_model_bytes=(st.tail_non_model_bytes if st.tail_non_model_bytes >= 0
                                                               else st.non_model_bytes) / b,
                                         peak_compute_seconds=(st.peak_compute_seconds / t if st.peak_compute_seconds >= 0
                                                               else -1.0),
                                         peak_need_bytes=st.peak_need_bytes / b)
                     for st in d.stages),
        device_bytes=d.device_bytes / b, host_bytes=d.host_bytes / b, nvme_bytes=d.nvme_bytes / b,
        h2d_bytes_per_s=d.h2d_bytes_per_s * t / b, d2h_bytes_per_s=d.d2h_bytes_per_s * t / b,
        nvme_read_bytes_per_s=d.nvme_read_bytes_per_s * t / b, nvme_write_bytes_per_s=d.nvme_write_bytes_per_s * t / b,
        cpu_adam_seconds_per_element=d.cpu_adam_seconds_per_element / t,
        gpu_adam_seconds_per_element=d.gpu_adam_seconds_per_element / t,
        duplex_bytes_per_s=d.duplex_bytes_per_s * t / b,
        collective_intra_bytes_per_s=d.collective_intra_bytes_per_s * t / b,
        collective_inter_bytes_per_s=d.collective_inter_bytes_per_s * t / b, dram_bytes_per_s=d.dram_bytes_per_s * t / b, adam_dram_bytes_per_element=d.adam_dram_bytes_per_element / b,
        nvme_time_rows=tuple((x * b / t, y * b / t) for x, y in d.nvme_time_rows),
        pcie_time_rows=tuple((x * b / t, y * b / t) for x, y in d.pcie_time_rows),
    )


def chunk_class_gaps(g: ChunkClass, n_stages: int, optimizer_stage: int, optimizer_overlap: bool,
               lookahead: int = LOOKAHEAD_STAGES) -> tuple[Gap, ...]:
    """The gaps of a chunk class, each with the stages where its chunks may arrive for the next use."""
    uses = g.use_stages
    if not uses:
        return ()
    gaps = []
    for i, u in enumerate(uses):
        nxt = uses[(i + 1) % len(uses)]
        wraps = i == len(uses) - 1
        stages = tuple(s % n_stages for s in range(u + 1, nxt + (n_stages if wraps else 0)))
        if not stages:
            continue
        window = stages
        if wraps and g.trainable and not optimizer_overlap:
            # Adam after backward: the updated params exist only from the optimizer stage on
            window = stages[stages.index(optimizer_stage):] if optimizer_stage in stages else stages
        look = window[-lookahead:]
        if wraps and optimizer_stage in window and optimizer_stage not in look:
            # the optimizer stage leaves the links idle: the natural time to bring updated params up
            look = window[window.index(optimizer_stage):window.index(optimizer_stage) + 1] + look
        gaps.append(Gap(stages=stages, lookahead=look, wraps=wraps))
    return tuple(gaps)


def is_zero(expr: Any) -> bool:
    return isinstance(expr, (int, float)) and expr == 0


def stage_runs(stages: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs [first, last] of a stage sequence (a wrapping gap gives two)."""
    runs: list[tuple[int, int]] = []
    for s in stages:
        if runs and s == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs


__all__ = [
    "ACT_MODES",
    "BYTE_UNIT",
    "INFINITE_BYTES",
    "LOOKAHEAD_BUDGET",
    "LOOKAHEAD_STAGES",
    "MIP_RELATIVE_GAP",
    "NVME_STREAM_STAGED_CHUNKS",
    "SECONDARY_TERMS",
    "SECONDARY_WEIGHT",
    "TIME_UNIT",
    "Gap",
    "act_windows",
    "chunk_class_gaps",
    "is_zero",
    "scaled_input",
    "stage_runs",
]
