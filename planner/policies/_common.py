"""What every policy module shares: the systems' chunk layout and the budget a system lets itself use.

A policy module only decides (as Checkmate's strategies do): it returns `planner.materialize.Decisions`
and `planner.policies.run` turns them into a schedule with tide's one materializer. Nothing here
emits an action.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.layout import build_layout, candidate_chunk_sizes, wasted_elements
from planner.materialize import Reservation, param_budget_bytes
from planner.problem import Problem
from schemas.schedule import ActivationMode, Chunk, ChunkLayout, ChunkList, ChunkPlan, TensorSlot, Tier
from schemas.trace import Phase

GB = 1e9
DEFAULT_CHUNK_ELEMENTS = 64 * 1024 * 1024  # PatrickStar's default chunk size (elements), client.py default_chunk_size


def chunk_elements(problem: Problem) -> int:
    """The chunk size wasting the fewest elements among 64 Mi (PatrickStar's default) and the layout's
    candidates that hold the largest tensor of a block (Gemini's search_chunk_configuration criterion,
    docs/baselines.md GM.1)."""
    tensors = problem.trace.tensors
    largest = max((tensors[t].numel for b in problem.blocks for t in b.tensors), default=0)
    sizes = sorted({s for s in (*candidate_chunk_sizes(problem), DEFAULT_CHUNK_ELEMENTS) if s >= largest}) or [largest]
    return min(sizes, key=lambda s: (wasted_elements(build_layout(problem, chunk_elements=s)), s))


def policy_layout(problem: Problem, *, replicated: bool = False) -> ChunkLayout:
    """The systems' chunk layout: tide's (planner.layout) with one rank (or replicated, DDP: every
    chunk its own comm group); with several sharding ranks the systems' own packing, tensors in order
    across block boundaries (PatrickStar's chunk list, Gemini's, DeepSpeed's flat partitions), only
    the last comm group padded."""
    if problem.world_size == 1 or replicated:
        one = dataclasses.replace(problem, world_size=1) if problem.world_size > 1 else problem
        return build_layout(one, chunk_elements=chunk_elements(one))
    return _packed_layout(problem)


def _packed_layout(problem: Problem) -> ChunkLayout:
    """Tensors in first-access order appended to the current chunk, a new chunk when the next one
    does not fit (PatrickStar §6.1, `chunk_tensor_index.py` `try_insert_tensor`), chunks of one size
    >= the largest tensor (that tensor's size, 64 Mi elements or a power of two), the one needing the
    least memory: the chunks' capacity (the waste, Gemini's criterion) plus one gathered comm group;
    the chunk count padded to whole comm groups of world_size, `owner_rank = id % world_size`."""
    tensors = problem.trace.tensors
    largest = max((t.numel for t in tensors), default=1)
    ws = problem.world_size

    def pack(size: int) -> list[list[tuple[int, int]]]:
        chunks: list[list[tuple[int, int]]] = [[]]
        used = 0
        for tid in problem.tensor_order:
            numel = tensors[tid].numel
            if used + numel > size and chunks[-1]:
                chunks.append([])
                used = 0
            chunks[-1].append((tid, used))
            used += numel
        chunks += [[] for _ in range(-len(chunks) % ws)]
        return chunks

    total = sum(t.numel for t in tensors)
    powers = {1 << k for k in range(max(0, largest - 1).bit_length(), max(1, total).bit_length() + 1)}
    sizes = sorted({s for s in (*powers, DEFAULT_CHUNK_ELEMENTS, largest) if s >= largest})
    size = min(sizes, key=lambda s: (len(pack(s)) * s + ws * s, s))
    chunks = pack(size)
    block_of = problem.tensor_block
    out_chunks = tuple(
        Chunk(id=i, elements=size, used_elements=sum(tensors[t].numel for t, _ in slots),
              block=block_of[slots[0][0]] if slots else -1, comm_group=i // ws, owner_rank=i % ws)
        for i, slots in enumerate(chunks))
    slots = tuple(TensorSlot(tensor=t, names=tensors[t].names, shape=tensors[t].shape, chunk=i, offset_elements=off,
                             numel=tensors[t].numel, trainable=tensors[t].trainable)
                  for i, cs in enumerate(chunks) for t, off in cs)
    return ChunkLayout(chunk_elements=size, lists=problem.lists, list_dtypes={x: problem.list_dtype(x) for x in problem.lists},
                       chunks=out_chunks, tensors=slots)


def chunk_plans(layout: ChunkLayout, os_tier, optimizer_tier) -> tuple[ChunkPlan, ...]:
    """One plan per chunk; a tier or a function of the chunk id."""
    os_of = os_tier if callable(os_tier) else (lambda c: os_tier)
    opt_of = optimizer_tier if callable(optimizer_tier) else (lambda c: optimizer_tier)
    return tuple(ChunkPlan(chunk=c.id, os_tier=os_of(c.id), optimizer_tier=opt_of(c.id)) for c in layout.chunks)


def budget(problem: Problem, layout: ChunkLayout, plans: Sequence[ChunkPlan], modes: Sequence[ActivationMode],
           checkpoint_tier: Tier | None, *, device_limit_bytes: int | None = None,
           reserved: Sequence[Reservation] = (), cap_bytes: int | None = None) -> tuple[int, ...]:
    """PARAM+GRAD bytes per moment the system lets itself use on DEVICE: what the DEVICE allows after
    non-model data and OS (`param_budget_bytes`, tide's one non-model curve), within the share of the
    GPU the system manages (`device_limit_bytes`), minus its DEVICE buffers, at most `cap_bytes`."""
    usable = problem.device_bytes if device_limit_bytes is None else min(problem.device_bytes, device_limit_bytes)
    usable -= sum(r.bytes for r in reserved if r.tier is Tier.DEVICE)
    limited = dataclasses.replace(problem, device_bytes=max(0, usable)) if usable != problem.device_bytes else problem
    out = param_budget_bytes(limited, layout, plans, modes, checkpoint_tier)
    return out if cap_bytes is None else tuple(min(b, cap_bytes) for b in out)


def moment_need_bytes(problem: Problem, layout: ChunkLayout) -> tuple[int, ...]:
    """Per moment: the PARAM bytes of the comm groups its work uses, plus their GRAD bytes in backward
    (what a system that keeps nothing else on the GPU holds then; the PARAM+GRAD budget unit)."""
    ws = problem.world_size
    item = problem.list_itemsize(ChunkList.PARAM)
    chunk_of = {t.tensor: t.chunk for t in layout.tensors}
    trainable = {t.tensor for t in layout.tensors if t.trainable}
    group_bytes: dict[int, int] = {}
    for c in layout.chunks:
        group_bytes[c.id // ws] = group_bytes.get(c.id // ws, 0) + c.elements * item
    out = []
    for m in problem.moments:
        if m.phase is Phase.OPTIMIZER:
            out.append(0)
            continue
        params = {chunk_of[t] // ws for t in m.tensors if t in chunk_of}
        grads = {chunk_of[t] // ws for t in m.tensors if t in chunk_of and t in trainable} \
            if m.phase is Phase.BACKWARD else set()
        out.append(sum(group_bytes[g] for g in params) + sum(group_bytes[g] for g in grads))
    return tuple(out)


def has_nvme(problem: Problem) -> bool:
    return problem.hardware.nvme.count > 0 and problem.nvme_bytes > 0 and problem.hardware.nvme_read_bytes_per_s > 0


def everything(layout: ChunkLayout) -> frozenset[int]:
    return frozenset(c.id for c in layout.chunks)
