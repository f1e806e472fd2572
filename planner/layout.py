"""Chunk layout (DESIGN.md §4.1; PatrickStar §6.1, §7): tensors packed into fixed-size chunks for a
given chunk size, and the candidate chunk sizes the planner prices. How tensors are packed:
Note [layout rules] above `build_layout`. Which chunk size is best is a cost question (the planner
evaluates `candidate_chunk_sizes` with the cost model); this module only builds a layout for a
given size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.problem import Problem
from schemas.schedule import Chunk, ChunkLayout, TensorSlot

MIN_CHUNK_ELEMENTS = 1 << 10  # below this, per-chunk bookkeeping costs more than the copy
MAX_CHUNK_ELEMENTS = 1 << 31  # 4-8 GiB per chunk: beyond that a chunk is a whole model


@dataclass(slots=True)
class _OpenChunk:
    """A chunk being filled."""

    block: int
    elements: int
    used_elements: int = 0
    slots: list[tuple[int, int]] = field(default_factory=list)  # (tensor id, offset)


# Note [layout rules]:
# Tensors are packed into fixed-size chunks in the order the iteration first touches them (runtime
# order, so a chunk's neighbours are used together), tied parameters once. Every chunk list (PARAM,
# GRAD, MASTER, M, V) uses the same layout: a tensor has the same chunk and offset in all of them.
#
# - A chunk never spans two blocks: a block boundary starts a new chunk, so the chunks of a block
#   are interchangeable for the placement model and a block's chunks can leave DEVICE together.
#   `chunk.block` is the block that first uses it (-1 outside blocks).
# - Inside a block, a tensor goes into the first of the block's chunks with room for it (first fit,
#   in first-access order), so the small tensors (biases, LayerNorms) fill the gaps the big ones
#   leave instead of opening half-empty chunks.
# - A chunk never mixes trainable and frozen tensors (`TensorInfo.trainable`, requires_grad): GRAD,
#   MASTER, M and V are kept for chunks holding trainable tensors only, so a frozen base with small
#   adapters (LoRA) gets optimizer state for the adapters alone. With every tensor trainable the
#   layout is what it was.
# - A tensor larger than the chunk gets a chunk of its own, exactly its size (never an error).
# - With world_size > 1 the chunks of a block are padded with empty chunks to whole comm groups of
#   world_size consecutive chunks, `owner_rank = index % world_size`, all chunks of a comm group of one
#   capacity (all-gather and reduce-scatter need equal shards).


def build_layout(problem: Problem, *, chunk_elements: int, groups_span_blocks: bool = False) -> ChunkLayout:
    """Pack the trace's tensors into chunks of `chunk_elements` (see the module docstring).

    groups_span_blocks (world_size > 1): consecutive blocks' chunks share comm groups, padded once at
    the end, instead of padding every block to whole comm groups (Note [layout comm groups])"""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, found {chunk_elements}")
    tensors = problem.trace.tensors
    chunks: list[_OpenChunk] = []
    open_by_trainable: dict[bool, list[_OpenChunk]] = {True: [], False: []}  # the current block run's, first fit
    run_block: int | None = None
    for tid in problem.tensor_order:
        numel = tensors[tid].numel
        block = problem.tensor_block[tid]
        if block != run_block:  # a block boundary: no chunk spans it
            open_by_trainable, run_block = {True: [], False: []}, block
        open_chunks = open_by_trainable[tensors[tid].trainable]
        if numel > chunk_elements:  # a chunk of its own, exactly its size
            chunks.append(_OpenChunk(block=block, elements=numel, used_elements=numel, slots=[(tid, 0)]))
            continue
        target = next((c for c in open_chunks if c.used_elements + numel <= c.elements), None)
        if target is None:
            target = _OpenChunk(block=block, elements=chunk_elements)
            chunks.append(target)
            open_chunks.append(target)
        target.slots.append((tid, target.used_elements))
        target.used_elements += numel
    if problem.world_size > 1:
        chunks = _comm_groups(chunks, problem.world_size, chunk_elements, span_blocks=groups_span_blocks)
    ws = problem.world_size
    out_chunks = tuple(
        Chunk(id=i, elements=max(c.elements, 1), used_elements=c.used_elements, block=c.block,
              comm_group=i // ws, owner_rank=i % ws)
        for i, c in enumerate(chunks)
    )
    slots = tuple(
        TensorSlot(tensor=tid, names=tensors[tid].names, shape=tensors[tid].shape, chunk=i, offset_elements=offset,
                   numel=tensors[tid].numel, trainable=tensors[tid].trainable)
        for i, c in enumerate(chunks) for tid, offset in c.slots
    )
    return ChunkLayout(
        chunk_elements=chunk_elements,
        lists=problem.lists,
        list_dtypes={x: problem.list_dtype(x) for x in problem.lists},
        chunks=out_chunks,
        tensors=slots,
    )


# Note [layout comm groups]:
# Padding every block to whole comm groups keeps a block's chunks together (they leave DEVICE
# together), but when a block fills few chunks of a comm group the padding dominates: GPT 8192-wide
# blocks are 3 chunks of ~268M elements, so with 8 ranks 5 of every 8 chunks are padding, and every
# rank still holds its padding chunk's PARAM on HOST and gathers it on DEVICE (measured: 55B on
# a100-40g-angel-8gpu, the placement LP needs 1139 GB of HOST against 870). `groups_span_blocks`
# lets a comm group take the next block's chunks (PatrickStar §7 packs comm groups over the whole
# chunk list; its chunks span blocks too), so only the last comm group is padded.


def _comm_groups(chunks: list[_OpenChunk], world_size: int, chunk_elements: int, *,
                 span_blocks: bool = False) -> list[_OpenChunk]:
    """Pad each block's run of chunks (with span_blocks: the whole list) to whole comm groups of
    world_size; one capacity per comm group."""
    out: list[_OpenChunk] = []
    i = 0
    while i < len(chunks):
        j = len(chunks) if span_blocks else i
        while j < len(chunks) and chunks[j].block == chunks[i].block:
            j += 1
        run = chunks[i:j]
        run += [_OpenChunk(block=chunks[i].block, elements=chunk_elements) for _ in range(-len(run) % world_size)]
        for g in range(0, len(run), world_size):
            comm_group = run[g:g + world_size]
            capacity = max(c.elements for c in comm_group)
            for c in comm_group:
                c.elements = capacity
            out += comm_group
        i = j
    return out


def candidate_chunk_sizes(problem: Problem, *, count: int = 6) -> list[int]:
    """Chunk sizes worth evaluating: powers of two around the largest tensor used in a block, that
    tensor's exact size, and the size that holds one whole block per chunk, bounded.

    Tensors bigger than every candidate (e.g. a large vocabulary's embedding) simply get chunks of
    their own size, so the candidates follow the blocks, not the outliers.
    """
    tensors = problem.trace.tensors
    block_elements = [sum(tensors[t].numel for t in b.tensors) for b in problem.blocks]
    in_blocks = [tensors[t].numel for b in problem.blocks for t in b.tensors]
    largest = max(in_blocks or [t.numel for t in tensors] or [1])
    whole_block = max(block_elements or [largest])
    top = min(MAX_CHUNK_ELEMENTS, 1 << math.ceil(math.log2(max(whole_block, 1))))
    k = math.ceil(math.log2(max(largest, 1)))
    sizes = {min(max(1 << e, MIN_CHUNK_ELEMENTS), top) for e in range(k - 1, k - 1 + count)}
    for exact in (largest, whole_block):  # a chunk per largest tensor / per block: transformer blocks pack tightly
        sizes.add(min(max(exact, MIN_CHUNK_ELEMENTS), MAX_CHUNK_ELEMENTS))
    # a block in exactly k chunks with (almost) no waste: the smallest size that first-fit packs the
    # largest block into k chunks. Powers of two and the largest tensor waste up to half a chunk
    # per block (175B at 604M elements: 25% of PARAM), and small chunks are what lets the optimizer
    # state of a chunk be streamed through a small DEVICE (one OS chunk of 1.8G elements is 21.7 GB)
    biggest = max(problem.blocks, key=lambda b: sum(tensors[t].numel for t in b.tensors), default=None)
    if biggest is not None:
        order = [tensors[t].numel for t in problem.tensor_order if problem.tensor_block[t] == biggest.id]
        for k in PACKED_CHUNKS_PER_BLOCK:
            size = _packing_size(order, k)
            if size is not None:
                sizes.add(min(max(size, MIN_CHUNK_ELEMENTS), MAX_CHUNK_ELEMENTS))
    return _undominated(problem, sorted(sizes))


def _undominated(problem: Problem, sizes: list[int]) -> list[int]:
    """Drop a size when another packs the model into no more chunks with no more wasted elements
    (it holds the same tensors in as few or fewer, fuller chunks: it moves and stores less)."""
    shape = {}
    for size in sizes:
        layout = build_layout(problem, chunk_elements=size, groups_span_blocks=problem.world_size > 1)  # as planner.solve
        shape[size] = (len(layout.chunks), wasted_elements(layout))
        if problem.world_size > 1:
            # with p ranks every block pads to whole comm groups, so counts tie and the least waste
            # alone would win; but padding chunks carry no optimizer state, and the OS of the
            # trainable chunks (their capacity) is what fills HOST: a third measure (measured,
            # PatrickStar's 12B on v100-32g-240g-8gpu: 33554432 wastes least, 21.8e9 elements, yet
            # its trainable chunks hold 1.7x the OS of a chunk per block and the placement LP does
            # not fit, where a chunk per block does)
            trainable = {x.chunk for x in layout.tensors if x.trainable}
            shape[size] += (sum(c.elements for c in layout.chunks if c.id in trainable),)
    return [s for s in sizes
            if not any(o != s and all(a <= b for a, b in zip(shape[o], shape[s]))
                       and shape[o] != shape[s] for o in sizes)]


PACKED_CHUNKS_PER_BLOCK = (2, 3, 4)


def _first_fit_chunks(numels: list[int], size: int) -> int:
    """Chunks `build_layout` opens for one block's tensors (first fit, oversized ones on their own)."""
    used: list[int] = []
    count = 0
    for n in numels:
        if n > size:
            count += 1
            continue
        for i, u in enumerate(used):
            if u + n <= size:
                used[i] += n
                break
        else:
            used.append(n)
            count += 1
    return count


def _packing_size(numels: list[int], k: int) -> int | None:
    """The smallest chunk size (to 1/1024 of the block) with which first fit packs the block into at
    most k chunks, none of them a tensor's own oversized chunk; None when k chunks cannot hold it."""
    total = sum(numels)
    if not numels or k < 1 or len(numels) < k:
        return None
    lo, hi = max(max(numels), math.ceil(total / k)), total
    if _first_fit_chunks(numels, hi) > k:
        return None
    step = max(1, total // 1024)
    while hi - lo > step:
        mid = (lo + hi) // 2
        if _first_fit_chunks(numels, mid) <= k:
            hi = mid
        else:
            lo = mid
    return hi if _first_fit_chunks(numels, lo) > k else lo


def chunk_bytes(layout: ChunkLayout, itemsize: int) -> list[int]:
    """Capacity of each chunk in bytes for a list of `itemsize`-byte elements."""
    return [c.elements * itemsize for c in layout.chunks]


def wasted_elements(layout: ChunkLayout) -> int:
    """Capacity not holding any tensor (the memory cost of a chunk size)."""
    return sum(c.elements - c.used_elements for c in layout.chunks)


__all__ = ["MAX_CHUNK_ELEMENTS", "MIN_CHUNK_ELEMENTS", "build_layout", "candidate_chunk_sizes", "chunk_bytes", "wasted_elements"]
