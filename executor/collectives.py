"""The schedule's collectives over `torch.distributed` (DESIGN.md §5 "Several GPUs"; PatrickStar §7).

With world_size > 1 the chunk layout forms *comm groups* of `world_size` consecutive chunks of one
capacity; chunk `g * world_size + r` is owned by rank r (`Chunk.comm_group`, `Chunk.owner_rank`,
built by `planner.layout`). A rank keeps the PARAM/MASTER/M/V copies of the chunks it owns and runs
their optimizer step; the other chunks of a group exist on it only while the group is gathered.

- ALL_GATHER (PARAM, group g): every rank contributes its owned chunk; the result is one contiguous
  buffer of `world_size * capacity` elements in rank order, so chunk `g * world_size + r` is the
  slice `[r * capacity, (r + 1) * capacity)` (`chunk_view`).
- REDUCE_SCATTER (GRAD, group g): every rank passes its full group buffer of local grads; each rank
  receives the reduced (averaged by default: data parallelism over the global batch) slice of the
  chunk it owns.
- Instead of one contiguous group buffer, both take a sequence of `world_size` chunk buffers in
  rank order (`dist.all_gather` / `dist.reduce_scatter` with tensor lists): what a chunk store that
  allocates chunk by chunk has. The owned chunk's buffer may be one of them (aliasing the shard):
  gloo handles it (tested), NCCL's list forms go through a flat temporary.

One `CommGroupCollectives` per engine, over the default process group (NCCL on GPU, gloo on CPU),
created once. Every call returns a `CollectiveWork` that carries its buffer: wait on it before
reading the buffer (on the CPU with gloo the work runs on gloo's threads; on GPU on NCCL's stream).

Byte counters follow the planner's convention (`planner.materialize._Emitter.collective`): one
collective of a group whose chunks hold `capacity_bytes` (chunk capacity x the list's itemsize)
counts `(world_size - 1) * capacity_bytes` for this rank, which is what a ring all-gather or ring
reduce-scatter sends (and receives) per rank. Summed over one iteration it equals the schedule's
`prediction.bytes_per_channel[INTER_GPU]` (collectives are counted per rank there, not summed).

Backend notes (torch 2.13): gloo on the CPU has `reduce_scatter_single`/`reduce_scatter_tensor`;
older builds raised for it. Then (and only then) the fallback is an all_reduce of the whole group
buffer and a copy of the owned slice: 2x the bytes of a reduce-scatter (counted as such, so the
byte check against the schedule fails loudly instead of hiding it), and a contiguous `full` holds
the reduced sum afterwards (a chunk list is concatenated first and left as it was). Averaging uses
ReduceOp.AVG on NCCL (no overflow in fp16/bf16 from summing first); on other backends SUM and a
division when the work is waited on (gloo's AVG is version-dependent). gloo reduces bf16 and fp16
too (checked on torch 2.13).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from executor.errors import ExecutorError
from schemas.schedule import Channel, ChunkLayout, ChunkList, Op
from schemas.trace import DTYPE_BYTES

__all__ = ["CollectiveStats", "CollectiveWork", "CommGroupCollectives", "GroupState"]


class GroupState(enum.Enum):
    """State of one (chunk list, comm group) on this rank; changed only through `_move`."""

    RELEASED = "released"  # start of an iteration and after `release`: only the owned chunk is valid here
    GATHERING = "gathering"  # all_gather issued, the group buffer is being filled (PARAM)
    GATHERED = "gathered"  # the all_gather was waited on: every chunk of the group is valid in the buffer
    REDUCING = "reducing"  # reduce_scatter issued (GRAD), the owned shard is being filled
    REDUCED = "reduced"  # the reduce_scatter was waited on: the owned shard holds the reduced grads


_TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    GroupState.RELEASED: frozenset({GroupState.GATHERING, GroupState.REDUCING}),
    GroupState.GATHERING: frozenset({GroupState.GATHERED}),
    GroupState.GATHERED: frozenset({GroupState.RELEASED}),
    GroupState.REDUCING: frozenset({GroupState.REDUCED}),
    GroupState.REDUCED: frozenset({GroupState.RELEASED}),
}


@dataclass(slots=True)
class CollectiveStats:
    """Per-rank counters of the INTER_GPU channel (see the module docstring for the convention)."""

    all_gather_count: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_count: int = 0
    reduce_scatter_bytes: int = 0

    @property
    def inter_gpu_bytes(self) -> int:
        """Bytes this rank sent (= received, ring algorithms) over INTER_GPU; the schedule's number."""
        return self.all_gather_bytes + self.reduce_scatter_bytes

    def bytes_per_channel(self) -> dict[Channel, int]:
        return {Channel.INTER_GPU: self.inter_gpu_bytes} if self.inter_gpu_bytes else {}

    def as_dict(self) -> dict[str, int]:
        return {"all_gather_count": self.all_gather_count, "all_gather_bytes": self.all_gather_bytes,
                "reduce_scatter_count": self.reduce_scatter_count, "reduce_scatter_bytes": self.reduce_scatter_bytes,
                "inter_gpu_bytes": self.inter_gpu_bytes}

    def reset(self) -> None:
        self.all_gather_count = self.all_gather_bytes = self.reduce_scatter_count = self.reduce_scatter_bytes = 0


@dataclass(slots=True, eq=False)
class _Works:
    """Several torch.distributed works waited on as one (an all-gather broadcast chunk by chunk)."""

    works: list[Any]

    def wait(self) -> None:
        for w in self.works:
            w.wait()


@dataclass(slots=True, eq=False)
class CollectiveWork:
    """An in-flight collective and the buffer it fills: `wait()` before reading `buffer`."""

    op: Op
    list: ChunkList
    comm_group: int
    buffer: Tensor | Sequence[Tensor]  # ALL_GATHER: the group buffer (or chunk buffers); REDUCE_SCATTER: the owned shard
    _owner: CommGroupCollectives
    _work: Any = None  # torch.distributed Work, None when it completed synchronously
    _divide_by: int = 1  # SUM then divide (averaging on backends without a reliable AVG)
    _fallback_full: Tensor | None = None  # all_reduce fallback: copy the owned slice out of it on wait
    done: bool = field(default=False)
    chunk: int = -1  # a per-bucket reduce of this one chunk into its owner (`reduce_chunk`); -1: the whole group

    def wait(self) -> Tensor | Sequence[Tensor]:
        """Block until the collective completed (idempotent); returns the filled buffer."""
        if self.done:
            return self.buffer
        if self._work is not None:
            self._work.wait()
        if self._fallback_full is not None:
            self.buffer.copy_(self._owner.chunk_view(self._fallback_full, self._owner.owned_chunk(self.comm_group)))  # type: ignore[union-attr]
        if self._divide_by != 1:
            self.buffer.div_(self._divide_by)  # type: ignore[union-attr]
        self.done = True
        if self.chunk >= 0:  # a chunk's reduce moves no group state: the group's other chunks reduce on their own
            return self.buffer
        target = GroupState.GATHERED if self.op is Op.ALL_GATHER else GroupState.REDUCED
        self._owner._move(self.list, self.comm_group, target)
        return self.buffer


class CommGroupCollectives:
    """ALL_GATHER / REDUCE_SCATTER of comm groups on the default process group (one per engine).

    layout: the schedule's chunk layout; it must be sharded for this world size (comm groups of
      world_size consecutive chunks, owner = index % world_size, one capacity per group).
    world_size / rank: default from `torch.distributed` when it is initialized, else 1 / 0 (then
      the collectives are local copies and count no bytes).
    """

    def __init__(self, layout: ChunkLayout, *, world_size: int | None = None, rank: int | None = None,
                 process_group: Any = None) -> None:
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        self.process_group = process_group
        self.world_size = world_size if world_size is not None else (dist.get_world_size(process_group) if initialized else 1)
        self.rank = rank if rank is not None else (dist.get_rank(process_group) if initialized else 0)
        if self.world_size > 1 and not initialized:
            raise ExecutorError(f"the schedule is for world_size={self.world_size} but torch.distributed is not initialized; "
                                "launch with `torchrun --nproc-per-node N` and call torch.distributed.init_process_group()")
        if initialized and self.world_size != dist.get_world_size(process_group):
            raise ExecutorError(f"the schedule is for world_size={self.world_size}, this job runs "
                                f"{dist.get_world_size(process_group)} ranks; re-solve with cluster.world_size="
                                f"{dist.get_world_size(process_group)} in the hardware profile or launch that many")
        self.layout = layout
        self.backend = dist.get_backend(process_group) if initialized else "local"
        self._check_layout()
        self.n_groups = len(layout.chunks) // self.world_size
        self.stats = CollectiveStats()
        self._state: dict[tuple[ChunkList, int], GroupState] = {}
        self._native_reduce_scatter = True

    # -- layout ------------------------------------------------------------------------------
    def _check_layout(self) -> None:
        ws, chunks = self.world_size, self.layout.chunks
        if len(chunks) % ws:
            raise ExecutorError(f"chunk layout: {len(chunks)} chunks do not form whole comm groups of world_size={ws}; "
                                "re-solve the schedule for this world size")
        for c in chunks:
            if c.comm_group != c.id // ws or c.owner_rank != c.id % ws:
                raise ExecutorError(f"chunk layout: chunk {c.id} has comm_group={c.comm_group}, owner_rank={c.owner_rank}, "
                                    f"expected {c.id // ws} and {c.id % ws} for world_size={ws}; re-solve the schedule "
                                    "with cluster.world_size set to the number of ranks")
            if c.elements != chunks[c.comm_group * ws].elements:
                raise ExecutorError(f"chunk layout: chunk {c.id} has {c.elements} elements, its comm group {c.comm_group} "
                                    f"{chunks[c.comm_group * ws].elements}; all chunks of a group need one capacity "
                                    "(build the layout with planner.layout)")

    def group_chunks(self, comm_group: int) -> range:
        return range(comm_group * self.world_size, (comm_group + 1) * self.world_size)

    def owned_chunk(self, comm_group: int) -> int:
        return comm_group * self.world_size + self.rank

    def owns(self, chunk: int) -> bool:
        return self.layout.chunks[chunk].owner_rank == self.rank

    def owned_chunks(self) -> list[int]:
        return [g * self.world_size + self.rank for g in range(self.n_groups)]

    def capacity_elements(self, comm_group: int) -> int:
        return self.layout.chunks[comm_group * self.world_size].elements

    def group_elements(self, comm_group: int) -> int:
        """Elements of the contiguous group buffer (`world_size * capacity`)."""
        return self.world_size * self.capacity_elements(comm_group)

    def chunk_view(self, full: Tensor, chunk: int) -> Tensor:
        """Chunk `chunk`'s slice of its comm group's buffer."""
        cap = self.layout.chunks[chunk].elements
        start = (chunk % self.world_size) * cap
        return full[start:start + cap]

    def capacity_bytes(self, lst: ChunkList, comm_group: int) -> int:
        return self.capacity_elements(comm_group) * DTYPE_BYTES[self.layout.list_dtypes[lst]]

    def collective_bytes(self, lst: ChunkList, comm_group: int) -> int:
        """Per-rank INTER_GPU bytes of one collective of this group (the schedule's `Action.bytes`)."""
        return (self.world_size - 1) * self.capacity_bytes(lst, comm_group)

    # -- state -------------------------------------------------------------------------------
    def state(self, lst: ChunkList, comm_group: int) -> GroupState:
        return self._state.get((lst, comm_group), GroupState.RELEASED)

    def _move(self, lst: ChunkList, comm_group: int, to: GroupState) -> None:
        now = self.state(lst, comm_group)
        if to not in _TRANSITIONS[now]:
            raise ExecutorError(f"comm group {comm_group} of {lst.value}: cannot go from {now.name} to {to.name} "
                                f"(a schedule replayed out of order, or a collective not waited on)")
        self._state[(lst, comm_group)] = to

    def release(self, lst: ChunkList, comm_group: int) -> None:
        """The group's gathered chunks (or reduced shard) are no longer needed on this rank."""
        self._move(lst, comm_group, GroupState.RELEASED)

    def _check_buffers(self, what: str, comm_group: int, shard: Tensor, full: Tensor | Sequence[Tensor]) -> None:
        if not 0 <= comm_group < self.n_groups:
            raise ExecutorError(f"{what}: comm group {comm_group} is not in the layout (0..{self.n_groups - 1})")
        cap = self.capacity_elements(comm_group)
        parts = [full] if isinstance(full, Tensor) else list(full)
        if isinstance(full, Tensor):
            ok = full.dim() == 1 and full.numel() == cap * self.world_size and full.is_contiguous()
        else:
            ok = len(parts) == self.world_size and all(t.dim() == 1 and t.numel() == cap for t in parts)
        if shard.dim() != 1 or shard.numel() != cap or not ok:
            raise ExecutorError(f"{what} of comm group {comm_group}: expected a flat shard of {cap} elements and a flat "
                                f"contiguous group buffer of {cap * self.world_size} (or {self.world_size} chunk buffers of "
                                f"{cap}), found shapes {tuple(shard.shape)} and {[tuple(t.shape) for t in parts]}")
        if any(t.dtype != shard.dtype or t.device != shard.device for t in parts):
            raise ExecutorError(f"{what} of comm group {comm_group}: shard and group buffers must share dtype and device, "
                                f"found {shard.dtype}/{shard.device} and {[f'{t.dtype}/{t.device}' for t in parts]}")

    # -- collectives -------------------------------------------------------------------------
    def all_gather(self, lst: ChunkList, comm_group: int, local_shard: Tensor,
                   out: Tensor | Sequence[Tensor], *, sources: Sequence[int] = ()) -> CollectiveWork:
        """Gather the group's chunks (this rank's: `local_shard`) into `out`, in rank order.

        sources: an ALL_GATHER's `bucket` (planner.emit `gather_per_chunk`): only these chunks are broadcast
        from their owners into the chunk buffers `out`, each chunk's capacity bytes counted once (a ring
        broadcast: nccl-tests doc/PERFORMANCE.md, busBw = algBw); the other (padding) buffers stay as they are."""
        self._check_buffers("ALL_GATHER", comm_group, local_shard, out)
        self._move(lst, comm_group, GroupState.GATHERING)
        work = CollectiveWork(op=Op.ALL_GATHER, list=lst, comm_group=comm_group, buffer=out, _owner=self)
        if sources:
            if isinstance(out, Tensor) or any(c // self.world_size != comm_group for c in sources):
                raise ExecutorError(f"ALL_GATHER of comm group {comm_group} per chunk {list(sources)}: expected chunk "
                                    "buffers and chunks of that comm group")
            if self.world_size > 1:
                dist = torch.distributed
                work._work = _Works([dist.broadcast(out[c % self.world_size], src=self.layout.chunks[c].owner_rank,
                                                    group=self.process_group, async_op=True) for c in sources])
                self.stats.all_gather_bytes += sum(self.layout.chunks[c].elements for c in sources) * DTYPE_BYTES[
                    self.layout.list_dtypes[lst]]
            self.stats.all_gather_count += 1
            return work
        if self.world_size == 1:
            (out if isinstance(out, Tensor) else out[0]).copy_(local_shard)
        elif isinstance(out, Tensor):
            dist = torch.distributed
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work._work = gather(out, local_shard, group=self.process_group, async_op=True)
        else:
            work._work = torch.distributed.all_gather(list(out), local_shard, group=self.process_group, async_op=True)
        self.stats.all_gather_count += 1
        self.stats.all_gather_bytes += self.collective_bytes(lst, comm_group)
        return work

    def reduce_scatter(self, lst: ChunkList, comm_group: int, full: Tensor | Sequence[Tensor], out_shard: Tensor, *,
                       average: bool = True) -> CollectiveWork:
        """Reduce the group buffers of all ranks; this rank gets its owned chunk's slice in `out_shard`.

        average: divide by world_size (grads of a data-parallel global batch), else sum."""
        self._check_buffers("REDUCE_SCATTER", comm_group, out_shard, full)
        self._move(lst, comm_group, GroupState.REDUCING)
        work = CollectiveWork(op=Op.REDUCE_SCATTER, list=lst, comm_group=comm_group, buffer=out_shard, _owner=self)
        nbytes = self.collective_bytes(lst, comm_group)
        if self.world_size == 1:
            out_shard.copy_(full if isinstance(full, Tensor) else full[0])
        else:
            dist = torch.distributed
            if average and self.backend == "nccl":
                op = dist.ReduceOp.AVG
            else:
                op = dist.ReduceOp.SUM
                work._divide_by = self.world_size if average else 1
            if self._native_reduce_scatter:
                try:
                    if isinstance(full, Tensor):
                        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                        work._work = scatter(out_shard, full, op=op, group=self.process_group, async_op=True)
                    else:
                        work._work = dist.reduce_scatter(out_shard, list(full), op=op, group=self.process_group,
                                                         async_op=True)
                except (RuntimeError, NotImplementedError):  # an older gloo: no reduce_scatter
                    self._native_reduce_scatter = False
            if not self._native_reduce_scatter:
                flat = full if isinstance(full, Tensor) else torch.cat(list(full))
                work._work = dist.all_reduce(flat, op=op, group=self.process_group, async_op=True)
                work._fallback_full = flat
                nbytes *= 2  # a ring all-reduce moves twice a reduce-scatter's bytes
        self.stats.reduce_scatter_count += 1
        self.stats.reduce_scatter_bytes += nbytes
        return work

    def reduce_chunk(self, lst: ChunkList, chunk: int, buffer: Tensor, *, average: bool = True) -> CollectiveWork:
        """A per-bucket reduce-scatter's part for one chunk (Note [reduce-scatter per bucket] in
        planner/device_cache.py): every rank's `buffer` of the chunk is reduced into its owner's, averaged there;
        the other ranks' buffers are undefined afterwards (they drop them). Counts the chunk's capacity bytes:
        a ring reduce sends the whole buffer once per rank (nccl-tests doc/PERFORMANCE.md: reduce busBw = algBw),
        the schedule's `Action.bytes` of a bucket."""
        cap = self.layout.chunks[chunk].elements
        if buffer.dim() != 1 or buffer.numel() != cap:
            raise ExecutorError(f"REDUCE_SCATTER of chunk {chunk}'s bucket: expected a flat buffer of {cap} elements, "
                                f"found shape {tuple(buffer.shape)}")
        owner = self.layout.chunks[chunk].owner_rank
        work = CollectiveWork(op=Op.REDUCE_SCATTER, list=lst, comm_group=self.layout.chunks[chunk].comm_group,
                              buffer=buffer, _owner=self, chunk=chunk)
        if self.world_size > 1:
            dist = torch.distributed
            if average and self.backend == "nccl":
                op = dist.ReduceOp.AVG
            else:
                op = dist.ReduceOp.SUM
                work._divide_by = self.world_size if average and owner == self.rank else 1
            work._work = dist.reduce(buffer, dst=owner, op=op, group=self.process_group, async_op=True)
        self.stats.reduce_scatter_count += 1
        self.stats.reduce_scatter_bytes += cap * DTYPE_BYTES[self.layout.list_dtypes[lst]] if self.world_size > 1 else 0
        return work

    # -- small agreements between ranks (not schedule traffic: a few bytes, not counted) ---------
    def all_reduce_scalar(self, value: Tensor, *, op: str = "sum") -> Tensor:
        """Sum or max of a small tensor over the ranks, in place (returned). For the engine: the global
        grad norm of clipping (sum of the squared norms of each rank's OWNED chunks) and fp16's
        found-inf flag (max), so every rank takes the same decision."""
        if op not in ("sum", "max"):
            raise ExecutorError(f"all_reduce_scalar: op must be 'sum' or 'max', found {op!r}")
        if self.world_size > 1:
            dist = torch.distributed
            reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
            if self.backend == "nccl" and value.device.type != "cuda":
                moved = value.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(moved, op=reduce_op, group=self.process_group)
                value.copy_(moved)
            else:
                dist.all_reduce(value, op=reduce_op, group=self.process_group)
        return value
