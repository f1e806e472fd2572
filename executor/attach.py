"""What `executor.run` checks before it touches anything: the arguments, what the schedule asks of
this executor, and the model against the schedule's layout (every difference, listed at once)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from executor.activations import checkpoint_tiers
from executor.dtypes import TORCH_DTYPES
from executor.errors import ExecutorError
from schemas.schedule import ActivationMode, ChunkList, Op, Schedule, Tier
from schemas.trace import DType, Phase

RERECORD = ("the model no longer does what was recorded: re-record it with `python -m executor record ...` "
             "and re-solve with `python -m planner solve ...`")
PRECISIONS = {"fp32": DType.FLOAT32, "float32": DType.FLOAT32, "bf16": DType.BFLOAT16, "bfloat16": DType.BFLOAT16,
               "fp16": DType.FLOAT16, "float16": DType.FLOAT16}


def check_attach(model: nn.Module, schedule: Schedule, *, precision: str | None, optimizer: str,
                 grad_clip_norm: float | None, grad_accumulation_steps: int, nvme_dir: str | Path | None) -> None:
    """Every argument and the schedule's own demands; raises one `ExecutorError` line."""
    compute = schedule.layout.list_dtypes[ChunkList.PARAM]
    if precision is not None:
        wanted = PRECISIONS.get(str(precision).lower())
        if wanted is None:
            raise ExecutorError(f"precision={precision!r}: expected one of fp32, bf16, fp16 (or None: the schedule's)")
        if wanted is not compute:
            raise ExecutorError(f"precision={precision!r}: the schedule computes in {compute.value}; record and "
                                f"solve with that precision, or pass precision=None")
    if optimizer not in ("adamw", "adam"):
        raise ExecutorError(f"optimizer={optimizer!r}: expected 'adamw' or 'adam'")
    if grad_accumulation_steps < 1:
        raise ExecutorError(f"grad_accumulation_steps={grad_accumulation_steps}: expected 1 or more")
    if grad_clip_norm is not None and not grad_clip_norm > 0:
        raise ExecutorError(f"grad_clip_norm={grad_clip_norm}: expected a positive number or None")
    check_schedule_supported(schedule, grad_clip_norm=grad_clip_norm, compute=compute, nvme_dir=nvme_dir)
    problems = check_model(model, schedule, compute=compute)
    if problems:
        raise ExecutorError(f"the model does not match the schedule ({len(problems)} differences): "
                            + "; ".join(problems) + f". {RERECORD}")


def check_schedule_supported(schedule: Schedule, *, grad_clip_norm: float | None, compute: DType,
                              nvme_dir: str | Path | None) -> None:
    nvme_blocks = [p.block for p in schedule.activation_plans if p.mode is ActivationMode.SWAP_NVME]
    if nvme_blocks and nvme_dir is None:
        raise ExecutorError(f"the schedule swaps the activations of blocks {nvme_blocks} to NVME: pass nvme_dir= "
                            "(a directory on the SSD) to executor.run")
    if uses_nvme(schedule) and nvme_dir is None:
        raise ExecutorError("the schedule puts chunks on NVME: pass nvme_dir= (a directory on the SSD) to "
                            "executor.run")
    # offloaded recompute checkpoints: the manager moves each block's whole input (its `input_bytes`,
    # executor/activations.py), so an ACT_OFFLOAD / ACT_RELOAD carrying other bytes cannot be replayed
    plans = {p.block: p for p in schedule.activation_plans}
    checkpoints = checkpoint_tiers(schedule)
    if any(tier is Tier.NVME for tier in checkpoints.values()) and nvme_dir is None:
        raise ExecutorError(f"the schedule offloads the recompute checkpoints of blocks "
                            f"{sorted(b for b, t in checkpoints.items() if t is Tier.NVME)} to NVME: pass nvme_dir= "
                            "(a directory on the SSD) to executor.run")
    odd = sorted({(a.block, a.bytes) for a in schedule.actions
                  if a.op in (Op.ACT_OFFLOAD, Op.ACT_RELOAD) and a.block in checkpoints
                  and a.bytes != plans[a.block].input_bytes})
    if odd:
        block, nbytes = odd[0]
        raise ExecutorError(f"the schedule moves {nbytes} bytes of the recompute checkpoint of block {block}, but "
                            f"its input (what the executor moves) is {plans[block].input_bytes} bytes "
                            f"(activation_plans[{block}].input_bytes; {len(odd)} such actions): re-solve with "
                            "`python -m planner solve ... --no-checkpoint-offload`")
    optimizer_moment = next((m.id for m in schedule.moments if m.phase is Phase.OPTIMIZER), len(schedule.moments))
    overlapped = any(a.op is Op.OPTIMIZER_STEP and a.moment < optimizer_moment for a in schedule.actions)
    if overlapped and (grad_clip_norm is not None or compute is DType.FLOAT16):
        why = "grad-norm clipping" if grad_clip_norm is not None else "fp16 loss scaling"
        raise ExecutorError(f"the schedule overlaps CPU optimizer steps with backward, but {why} needs every grad "
                            "before the first step: re-solve with `python -m planner solve ... --no-optimizer-overlap`")


def check_model(model: nn.Module, schedule: Schedule, *, compute: DType) -> list[str]:
    """Every difference between the model's params and the schedule's layout (empty: they match)."""
    named = list(model.named_parameters(remove_duplicate=False))
    by_name = dict(named)
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, p in named:
        names_of[id(p)].append(name)
    allowed = {TORCH_DTYPES[compute], torch.float32}
    problems: list[str] = []
    in_layout: set[str] = set()
    for slot in schedule.layout.tensors:
        in_layout.update(slot.names)
        present = [n for n in slot.names if n in by_name]
        for n in slot.names:
            if n not in by_name:
                problems.append(f"param {n!r}: in the schedule, not in the model")
        if not present:
            continue
        p = by_name[present[0]]
        if any(by_name[n] is not p for n in present) or sorted(names_of[id(p)]) != sorted(slot.names):
            problems.append(f"param {present[0]!r}: the schedule ties {list(slot.names)}, the model ties "
                            f"{sorted(names_of[id(p)])}")
        if tuple(p.shape) != tuple(slot.shape):
            problems.append(f"param {present[0]!r}: shape {tuple(p.shape)}, the schedule expects {tuple(slot.shape)}")
        if p.dtype not in allowed:
            problems.append(f"param {present[0]!r}: dtype {p.dtype}, the schedule computes in {compute.value} "
                            f"(expected float32 or {compute.value})")
        if p.requires_grad != slot.trainable:
            problems.append(f"param {present[0]!r}: requires_grad={p.requires_grad}, the schedule says "
                            f"trainable={slot.trainable}")
        if p.device.type == "meta":
            problems.append(f"param {present[0]!r}: on the meta device; build the model with real weights")
    for name, _ in named:
        if name not in in_layout:
            problems.append(f"param {name!r}: in the model, not in the schedule")
    return problems


def uses_nvme(schedule: Schedule) -> bool:
    return any(Tier.NVME in r.tiers for r in schedule.initial_residency) or any(
        Tier.NVME in (a.src, a.dst) for a in schedule.actions if a.op not in (Op.ACT_OFFLOAD, Op.ACT_RELOAD))


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExecutorError(f"device={device!r}: no CUDA device here; pass device='cpu' (emulated DEVICE) or 'auto'")
    if dev.type not in ("cpu", "cuda"):
        raise ExecutorError(f"device={device!r}: expected 'auto', 'cpu' or 'cuda[:i]'")
    return dev
