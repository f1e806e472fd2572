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
from schemas.residency import Refusal, ResidencyRefused, ValidCopies
from schemas.schedule import TIER_INDEX, ActivationMode, ChunkList, Op, Schedule, Tier
from schemas.trace import DType, Phase

RERECORD = ("the model no longer does what was recorded: re-record it with `python -m executor record ...` "
             "and re-solve with `python -m planner solve ...`")
SHOWN_DIFFERENCES = 3  # an error stays one readable line; check_model(...) returns every difference
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
    check_residency(schedule)
    problems = check_model(model, schedule, compute=compute)
    if problems:
        shown = problems[:SHOWN_DIFFERENCES]
        more = f"; and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise ExecutorError(f"the model does not match the schedule ({len(problems)} differences): "
                            + "; ".join(shown) + f"{more} (executor.attach.check_model lists them all). {RERECORD}")


def check_schedule_supported(schedule: Schedule, *, grad_clip_norm: float | None, compute: DType,
                              nvme_dir: str | Path | None) -> None:
    # PatrickStar's grad in the param slot (PS.2) is a baseline's decision the simulator prices; tide's
    # own plans never set it, and the executor keeps separate GRAD chunk buffers, so it refuses the schedule
    # rather than allocate memory the plan did not count (issue 16)
    slotted = [p.chunk for p in schedule.chunk_plans if p.grad_in_param_slot]
    if slotted:
        raise ExecutorError(f"chunk_plans[{slotted[0]}].grad_in_param_slot is true ({len(slotted)} chunks): the executor "
                            "keeps grads in their own GRAD chunks and cannot replay a schedule that counts them in the "
                            f"param chunk's slot (policy {schedule.header.policy!r}, a baseline's decision); run a tide "
                            "schedule from `python -m planner solve TRACE --hardware HW -o SCHEDULE`")
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


def check_residency(schedule: Schedule) -> None:
    """Replay the schedule's actions once through the residency rules (`schemas.residency`, the ones
    `planner simulate` applies) and refuse, in one line, a copy without a valid source, an EVICT of the
    last valid copy of live data, work or an optimizer step without its chunks valid where it runs, a
    trainable chunk not stepped exactly once per iteration, or an iteration that does not end as it
    started. A one-time cost at attach; the per-iteration replay stays free of checks (the store's
    state transitions remain the backstop)."""
    layout = schedule.layout
    lists = layout.lists
    li = {lst: i for i, lst in enumerate(lists)}
    n = len(layout.chunks)
    copies = ValidCopies(lists, n)
    for r in schedule.initial_residency:
        for tier in r.tiers:
            copies.start(li[r.list], r.chunk, TIER_INDEX[tier])
    started = {(r.list, r.chunk): sum(1 << TIER_INDEX[t] for t in r.tiers) for r in schedule.initial_residency}
    chunk_of = {s.tensor: s.chunk for s in layout.tensors}
    trainable = {s.tensor for s in layout.tensors if s.trainable}
    pi, gi = li[ChunkList.PARAM], li.get(ChunkList.GRAD)
    step_inputs = [li[lst] for lst in (ChunkList.PARAM, ChunkList.GRAD, ChunkList.MASTER, ChunkList.M, ChunkList.V)
                   if lst in li]
    by_moment: list[list[int]] = [[] for _ in schedule.moments]
    for i, a in enumerate(schedule.actions):
        if 0 <= a.moment < len(by_moment):
            by_moment[a.moment].append(i)
    stepped = [0] * n
    device = TIER_INDEX[Tier.DEVICE]
    several = schedule.header.world_size > 1  # a rank's view: collectives bring what other ranks own

    def refuse(where: str, what: str) -> None:
        raise ExecutorError(f"invalid schedule: {where} {what}; `python -m planner simulate` rejects it too: "
                            "re-solve with `python -m planner solve ...` (or restore the file you were given)")

    for m in schedule.moments:
        for i in by_moment[m.id]:
            a = schedule.actions[i]
            where = f"moment {m.id} action {i} ({a.op.value}"
            where += f" {a.list.value} chunk {a.chunk})" if a.list is not None else f" chunk {a.chunk})"
            try:
                if a.op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK):
                    copies.copy(li[a.list], a.chunk, TIER_INDEX[a.src], TIER_INDEX[a.dst])
                elif a.op is Op.EVICT:
                    copies.evict(li[a.list], a.chunk, TIER_INDEX[a.src])
                elif a.op is Op.ALLOCATE:
                    copies.allocate(li[a.list], a.chunk, TIER_INDEX[a.dst])
                elif a.op is Op.ALL_GATHER:
                    for c in (ch.id for ch in layout.chunks if ch.comm_group == a.chunk):
                        copies.gather(li[a.list], c)
                elif a.op is Op.OPTIMIZER_STEP:
                    stepped[a.chunk] += 1
                    if stepped[a.chunk] > 1:
                        refuse(where, "steps the chunk a second time in one iteration")
                    copies.step(a.chunk, TIER_INDEX[a.dst], step_inputs)
            except ResidencyRefused as exc:
                if several:
                    continue  # other ranks' shards: the simulator's multi-rank view, not replayed here
                what = {Refusal.NO_SOURCE: f"copies from {a.src.value if a.src else '?'}, which holds "
                                           f"{'a stale copy' if exc.stale else 'no copy'}",
                        Refusal.NOT_HELD: f"evicts from {a.src.value if a.src else '?'}, which holds no copy",
                        Refusal.LAST_COPY: "drops the last valid copy of live data (write it back first)",
                        Refusal.STEP_INPUT: f"needs a valid {lists[exc.list_index].value} copy on "
                                            f"{a.dst.value if a.dst else '?'}"}[exc.refusal]
                refuse(where, what)
        if m.phase is Phase.OPTIMIZER or several:
            continue
        for c in sorted({chunk_of[t] for t in m.tensors if t in chunk_of}):
            if not copies.is_valid(pi, c, device):
                refuse(f"moment {m.id} ({m.phase.value} {m.kind.value} of {m.module or '<root>'!r}):",
                       f"its work needs PARAM chunk {c} on DEVICE, where no valid copy is")
        if m.phase is Phase.BACKWARD and gi is not None:
            for c in sorted({chunk_of[t] for t in m.tensors if t in trainable and t in chunk_of}):
                if not copies.is_valid(gi, c, device):
                    refuse(f"moment {m.id} ({m.phase.value} {m.kind.value} of {m.module or '<root>'!r}):",
                           f"its backward accumulates GRAD chunk {c} on DEVICE, where no valid copy is")
                copies.write_grads(c)
    if several:
        return
    if gi is not None:
        missed = sorted({s.chunk for s in layout.tensors if s.trainable} - {c for c in range(n) if stepped[c]})
        if missed:
            refuse("the iteration:", f"never steps chunks {missed[:5]}{' ...' if len(missed) > 5 else ''}, which hold "
                   f"trainable params ({len(missed)} chunks)")
    for lst in lists:
        for c in range(n):
            if not copies.ends_as_started(li[lst], c, started.get((lst, c), 0)):
                refuse("the iteration:", f"ends with {lst.value} chunk {c} elsewhere than it started (the next "
                       "iteration would not replay)")


def uses_nvme(schedule: Schedule) -> bool:
    return any(Tier.NVME in r.tiers for r in schedule.initial_residency) or any(
        Tier.NVME in (a.src, a.dst) for a in schedule.actions if a.op not in (Op.ACT_OFFLOAD, Op.ACT_RELOAD))


def activations_use_nvme(schedule: Schedule) -> bool:
    """A block swaps to NVME, or a recompute checkpoint is offloaded there."""
    return (any(p.mode is ActivationMode.SWAP_NVME for p in schedule.activation_plans)
            or Tier.NVME in checkpoint_tiers(schedule).values())


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExecutorError(f"device={device!r}: no CUDA device here; pass device='cpu' (emulated DEVICE) or 'auto'")
    if dev.type not in ("cpu", "cuda"):
        raise ExecutorError(f"device={device!r}: expected 'auto', 'cpu' or 'cuda[:i]'")
    # The device as a tensor on it reports it: `cuda:<i>` always with its index, `cpu` never with one
    # (torch.device("cuda") != torch.device("cuda", 0), torch.device("cpu", 0) != torch.device("cpu")),
    # so the engine's comparisons with its tensors' devices hold (its module buffers' placement). The
    # binding no longer compares devices (Note "saved params"): comparing them kept evicted chunks'
    # buffers for backward on the first H100 run (wrong grads), "cuda" against "cuda:0"
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if dev.type == "cpu" else dev
