"""Checkpoints of a chunk-sharded job in the plain single-file format, from any world size into any other.

With world_size > 1 a rank holds only the chunks it owns (`Chunk.owner_rank`): PARAM (and MASTER,
M, V) of one chunk per comm group, and the `step` counts of the params in those chunks. The
checkpoint file is the one of `executor.state` (plain `model.state_dict()` / `AdamW.state_dict()`
keyed by param names), so it does not depend on the layout or the world size:

- `save_sharded`: every rank calls it; the owned chunks of every list are gathered to rank 0
  (`torch.distributed.gather`, one chunk list and comm group at a time), the step counts are
  merged (each from its owner), and rank 0 writes the file with `executor.state.save` (atomic).
  Rank 0 holds the full model + optimizer state in host memory for the write (the file is one
  `torch.save` of it anyway). Like `executor.state.save` the file carries the digest of its
  content and of the schedule the ranks run (`schedule_digest`, `schedule_world_size`).
- `load_sharded`: every rank reads the file and keeps what it owns: `executor.state.restore`
  through a view of the full layout whose non-owned chunks read as zeros and drop writes; the
  optimizer `step` of params in non-owned chunks is removed again (their owner steps them). A file
  whose content was changed, or saved under another schedule of the same world size, is refused
  by every rank before anything is written; one of another world size loads (a re-shard).

Both take the rank-local store as an `executor.state.ChunkSource` over the FULL layout that is
only ever asked for owned chunks (`OwnedChunks` is a plain one: the tests' store and a reference
for the engine). With world_size 1 every chunk is owned and these are `state.save` / `state.restore`.

For the engine's replay, `runs_on_rank` says which actions a rank performs and `StoreCollectives`
runs ALL_GATHER / REDUCE_SCATTER over a chunk store (the engine's `ChunkStore`: `allocate`,
`tensor`, `device_tensor`, `numel`, `dtypes`), keeping each in-flight collective with its buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from executor import state
from executor.collectives import CollectiveWork, CommGroupCollectives, GroupState
from executor.dtypes import TORCH_DTYPES
from executor.errors import ExecutorError
from executor.optim import ChunkAdamW
from schemas.schedule import Action, ChunkLayout, ChunkList, Op, Schedule, Tier

__all__ = ["OwnedChunks", "StoreCollectives", "all_gather_params", "gather_full_chunks", "load_sharded", "owned_view",
           "runs_on_rank", "save_sharded"]

_STATE_LISTS = (ChunkList.PARAM, ChunkList.MASTER, ChunkList.M, ChunkList.V)  # GRAD is not state


class OwnedChunks:
    """Flat buffers of the chunks one rank owns, for every chunk list (zeros at first)."""

    def __init__(self, layout: ChunkLayout, *, rank: int, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.rank = rank
        self.buffers: dict[tuple[ChunkList, int], Tensor] = {
            (lst, c.id): torch.zeros(c.elements, dtype=TORCH_DTYPES[layout.list_dtypes[lst]], device=device)
            for lst in layout.lists for c in layout.chunks if c.owner_rank == rank
        }

    def chunk(self, lst: ChunkList, chunk: int) -> Tensor:
        """The live buffer (no copy)."""
        try:
            return self.buffers[(lst, chunk)]
        except KeyError:
            raise ExecutorError(f"rank {self.rank} asked for {lst.value} chunk {chunk}, owned by rank "
                                f"{self.layout.chunks[chunk].owner_rank}; only owned chunks live here") from None

    def read_chunk(self, lst: ChunkList, chunk: int) -> Tensor:
        return self.chunk(lst, chunk).clone()

    def write_chunk(self, lst: ChunkList, chunk: int, tensor: Tensor) -> None:
        self.chunk(lst, chunk).copy_(tensor)


class _OwnedView:
    """The full layout seen from one rank: non-owned chunks read as zeros and ignore writes. Its
    `schedule` (the local store's, or the one given) is what `executor.state.restore` checks a
    checkpoint's `schedule_digest` against."""

    def __init__(self, local: state.ChunkSource, rank: int, schedule: Schedule | None = None) -> None:
        self.layout = local.layout
        self.local = local
        self.rank = rank
        self.schedule = schedule if schedule is not None else getattr(local, "schedule", None)

    def read_chunk(self, lst: ChunkList, chunk: int) -> Tensor:
        c = self.layout.chunks[chunk]
        if c.owner_rank == self.rank:
            return self.local.read_chunk(lst, chunk)
        return torch.zeros(c.elements, dtype=TORCH_DTYPES[self.layout.list_dtypes[lst]])

    def write_chunk(self, lst: ChunkList, chunk: int, tensor: Tensor) -> None:
        if self.layout.chunks[chunk].owner_rank == self.rank:
            self.local.write_chunk(lst, chunk, tensor)


def owned_view(local: state.ChunkSource, rank: int, schedule: Schedule | None = None) -> state.ChunkSource:
    """A ChunkSource over the full layout that keeps only what `rank` owns (see `_OwnedView`)."""
    return _OwnedView(local, rank, schedule)


class _FullChunks:
    """Every chunk of every state list, gathered on rank 0 (a ChunkSource for executor.state); its
    `schedule` is the one the checkpoint records the digest of."""

    def __init__(self, layout: ChunkLayout, chunks: dict[tuple[ChunkList, int], Tensor],
                 schedule: Schedule | None = None) -> None:
        self.layout = layout
        self.chunks = chunks
        self.schedule = schedule

    def read_chunk(self, lst: ChunkList, chunk: int) -> Tensor:
        return self.chunks[(lst, chunk)]

    def write_chunk(self, lst: ChunkList, chunk: int, tensor: Tensor) -> None:  # pragma: no cover - read only
        raise ExecutorError("gathered chunks are read only")


def _comm_device(collectives: CommGroupCollectives) -> torch.device:
    """Where tensors must be for the process group: NCCL talks between GPUs only, gloo takes CPU tensors."""
    if collectives.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dist_ready(world_size: int) -> None:
    if world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ExecutorError(f"a checkpoint of world_size={world_size} needs torch.distributed initialized on every rank")


def gather_full_chunks(local: state.ChunkSource, collectives: CommGroupCollectives, *, dst: int = 0
                       ) -> dict[tuple[ChunkList, int], Tensor] | None:
    """Every rank calls this; rank `dst` gets {(list, chunk): CPU tensor} of every chunk of every
    state list (PARAM, MASTER, M, V present in the layout), the others None."""
    layout, ws, rank = collectives.layout, collectives.world_size, collectives.rank
    _dist_ready(ws)
    out: dict[tuple[ChunkList, int], Tensor] = {}
    for lst in (x for x in _STATE_LISTS if x in layout.lists):
        for g in range(collectives.n_groups):
            mine = local.read_chunk(lst, collectives.owned_chunk(g)).detach()
            if ws == 1:
                out[(lst, g)] = mine.to("cpu", copy=True)
                continue
            mine = mine.to(_comm_device(collectives))
            parts = [torch.empty_like(mine) for _ in range(ws)] if rank == dst else None
            torch.distributed.gather(mine, gather_list=parts, dst=dst, group=collectives.process_group)
            if parts is not None:
                for r, part in enumerate(parts):
                    out[(lst, g * ws + r)] = part.to("cpu")
    return out if rank == dst else None


def all_gather_params(local: state.ChunkSource, collectives: CommGroupCollectives) -> dict[int, Tensor]:
    """Every rank calls this and gets every PARAM chunk (CPU tensors), each from its owner: one
    all-gather per comm group (`Engine.detach` gives every rank plain params back)."""
    device = _comm_device(collectives)
    out: dict[int, Tensor] = {}
    for g in range(collectives.n_groups):
        mine = local.read_chunk(ChunkList.PARAM, collectives.owned_chunk(g))
        shard = torch.zeros(collectives.capacity_elements(g), dtype=mine.dtype, device=device)
        shard[:mine.numel()].copy_(mine)
        parts = [torch.empty_like(shard) for _ in range(collectives.world_size)]
        torch.distributed.all_gather(parts, shard, group=collectives.process_group)
        for chunk, part in zip(collectives.group_chunks(g), parts, strict=True):
            out[chunk] = part[:collectives.layout.chunks[chunk].elements].to("cpu")
    return out


class _StepsOnly:
    """What `executor.state.optimizer_state_dict` reads from an optimizer, with merged step counts."""

    def __init__(self, optimizer: ChunkAdamW, steps: dict[nn.Parameter, Tensor]) -> None:
        self.param_groups = optimizer.param_groups
        self.entry_of = optimizer.entry_of
        self.state = {p: {"step": s} for p, s in steps.items()}


def _merged_steps(optimizer: ChunkAdamW, collectives: CommGroupCollectives) -> dict[nn.Parameter, Tensor]:
    """Each param's `step` from the rank owning its chunk (-1: no state yet), on every rank."""
    layout = collectives.layout
    slot_of = {s.tensor: s for s in layout.tensors}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    values = torch.full((len(params),), -1.0, dtype=torch.float64)
    for i, p in enumerate(params):
        chunk = slot_of[optimizer.entry_of(p).tensor].chunk
        step = optimizer.state.get(p, {}).get("step")
        if collectives.owns(chunk) and step is not None:
            values[i] = float(step)
    if collectives.world_size > 1:
        values = values.to(_comm_device(collectives))
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=collectives.process_group)
    return {p: torch.tensor(float(v), dtype=torch.float32) for p, v in zip(params, values.tolist()) if v >= 0}


def _running_schedule(local: state.ChunkSource, schedule: Schedule | None, collectives: CommGroupCollectives
                      ) -> Schedule | None:
    """The schedule the ranks run: `schedule` if given, else the local store's (the engine's)."""
    running = schedule if schedule is not None else getattr(local, "schedule", None)
    if running is not None and running.layout != collectives.layout:
        raise ExecutorError("the schedule given to save_sharded/load_sharded is not the one whose layout the "
                            "collectives run; pass the schedule the ranks were attached with")
    return running


def save_sharded(path: str | Path, local: state.ChunkSource, collectives: CommGroupCollectives, *,
                 model: nn.Module | None = None, optimizer: ChunkAdamW | None = None, loss_scaler: Any = None,
                 extra: Mapping[str, Any] | None = None, schedule: Schedule | None = None) -> None:
    """Every rank calls this; rank 0 writes one plain checkpoint (`executor.state.save` format),
    carrying the digest of its content and of the schedule the ranks run (`schedule`, or the local
    store's `schedule`, as the engine has)."""
    running = _running_schedule(local, schedule, collectives)
    chunks = gather_full_chunks(local, collectives)
    steps = _merged_steps(optimizer, collectives) if optimizer is not None else None
    if collectives.rank == 0:
        assert chunks is not None
        full = _FullChunks(collectives.layout, chunks, running)
        opt = _StepsOnly(optimizer, steps) if optimizer is not None else None
        state.save(path, full, model=model, optimizer=opt, loss_scaler=loss_scaler, extra=extra)  # type: ignore[arg-type]
    if collectives.world_size > 1:
        torch.distributed.barrier(group=collectives.process_group)  # the file exists when any rank returns


def load_sharded(checkpoint: str | Path | Mapping[str, Any], local: state.ChunkSource,
                 collectives: CommGroupCollectives, *, model: nn.Module | None = None,
                 optimizer: ChunkAdamW | None = None, loss_scaler: Any = None, strict: bool = True,
                 schedule: Schedule | None = None) -> None:
    """Every rank calls this with a plain checkpoint (path or `executor.state.load` result) from any
    world size; each rank keeps its owned chunks (and the step counts of their params).

    As `executor.state.restore`: a file whose content digest does not match, or one saved under
    another schedule of the same world size than the one running (`schedule`, or the local store's),
    is refused in one line before anything is written; one of another world size is re-sharded."""
    running = _running_schedule(local, schedule, collectives)
    ckpt = state.load(checkpoint) if isinstance(checkpoint, (str, Path)) else checkpoint
    state.restore(ckpt, owned_view(local, collectives.rank, running), model=model, optimizer=optimizer,
                  loss_scaler=loss_scaler, strict=strict)
    if optimizer is not None:
        slot_of = {s.tensor: s for s in collectives.layout.tensors}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not collectives.owns(slot_of[optimizer.entry_of(p).tensor].chunk):
                    optimizer.state.pop(p, None)  # its owner steps it and keeps its count


# ------------------------------------------------------------------------------- the engine's replay


def runs_on_rank(action: Action, layout: ChunkLayout, rank: int) -> bool:
    """Whether `rank` performs `action` (planner.materialize: "copies to and from HOST/NVME and
    optimizer steps of a chunk are done by its owner rank, DEVICE copies and EVICTs from DEVICE by
    every rank"). Collectives and activation actions: every rank. ALLOCATE on DEVICE (grads of the
    whole group accumulate on every rank before the reduce-scatter): every rank. Everything else
    about a chunk: its owner only (the non-owned DEVICE copies come from ALL_GATHER)."""
    if action.op in (Op.ALL_GATHER, Op.REDUCE_SCATTER) or action.chunk < 0:
        return True
    if action.op is Op.EVICT and action.src is Tier.DEVICE:
        return True
    if action.op is Op.ALLOCATE and action.dst is Tier.DEVICE:
        return True
    return layout.chunks[action.chunk].owner_rank == rank


class StoreCollectives:
    """ALL_GATHER / REDUCE_SCATTER of the schedule over a chunk store's DEVICE payloads (one per engine).

    - `apply(action)` at an ALL_GATHER: zero-filled DEVICE payloads for the group's non-owned PARAM
      chunks (`store.allocate`), then one all-gather from the owned chunk into all of them; at a
      REDUCE_SCATTER: the group's DEVICE GRAD payloads (zeros for chunks without trainable params)
      reduce-scattered (averaged) into the owned one; with a `bucket`, each of its chunks reduced into its
      owner's payload (`CommGroupCollectives.reduce_chunk`), the other ranks' payloads dropped when it lands.
    - `wait(list, chunk)` before anything reads or writes a chunk of a group with a collective in
      flight: the moment's work, a copy, an eviction, an optimizer step.
    - Once a REDUCE_SCATTER is waited on, the group's non-owned GRAD payloads leave this rank's DEVICE
      (a rank keeps its own chunk's reduced grads only, PatrickStar §7; the planner counts them gone
      from the collective on: planner.replay, planner.sim_state.scatter). `land_scatters()` at the
      start of every moment waits for the ones issued before it, so they are gone by the next moment's
      work as the schedule's budget assumes; the schedule's later EVICT of such a chunk from DEVICE is
      then done here already (`scattered`).
    - `evicted(list, chunk)` after an EVICT from DEVICE: the group is released.
    - `end_iteration()` after the OPTIMIZER moment: lands what is left (grads of owned chunks
      without trainable params) and releases it.
    """

    def __init__(self, layout: ChunkLayout, store: Any, *, collectives: CommGroupCollectives | None = None) -> None:
        self.collectives = collectives if collectives is not None else CommGroupCollectives(layout)
        self.store = store
        self.pending: dict[tuple[ChunkList, int], CollectiveWork] = {}
        self.pending_chunks: dict[int, CollectiveWork] = {}  # GRAD chunk -> its per-bucket reduce in flight
        self.scattered: set[int] = set()  # non-owned GRAD chunks dropped from DEVICE after their reduce-scatter

    @property
    def stats(self):  # noqa: ANN201 - executor.collectives.CollectiveStats
        return self.collectives.stats

    def runs_here(self, action: Action) -> bool:
        return runs_on_rank(action, self.collectives.layout, self.collectives.rank)

    def apply(self, action: Action, *, why: str) -> None:
        coll, store, g = self.collectives, self.store, action.chunk
        chunks = coll.group_chunks(g)
        if action.op is Op.ALL_GATHER:
            own = coll.owned_chunk(g)
            for c in chunks:
                # a chunk the schedule kept on DEVICE (a persistent group's chunk without trainable
                # params is not evicted around its HOST step) is simply overwritten
                if c != own and store.device_tensor(ChunkList.PARAM, c) is None:
                    store.allocate(ChunkList.PARAM, c, Tier.DEVICE, why=f"{why}, filled by the all-gather")
            buffers = [store.tensor(ChunkList.PARAM, c, Tier.DEVICE, why=why) for c in chunks]
            # with a `bucket`: those chunks broadcast from their owners, the padding chunks left as allocated
            self.pending[(ChunkList.PARAM, g)] = coll.all_gather(ChunkList.PARAM, g, buffers[coll.rank], buffers,
                                                                 sources=action.bucket)
        elif action.op is Op.REDUCE_SCATTER and action.bucket:
            # per bucket (Note [reduce-scatter per bucket], planner/device_cache.py): each chunk reduced into
            # its owner's GRAD payload; the others drop theirs when it lands
            for c in action.bucket:
                buffer = store.device_tensor(ChunkList.GRAD, c)
                if buffer is None:  # not allocated here (no trainable params in it): contributes zeros
                    buffer = torch.zeros(store.numel(c), dtype=store.dtypes[ChunkList.GRAD], device=store.device)
                else:
                    buffer = store.tensor(ChunkList.GRAD, c, Tier.DEVICE, why=why)
                self.pending_chunks[c] = coll.reduce_chunk(ChunkList.GRAD, c, buffer)
        elif action.op is Op.REDUCE_SCATTER:
            present = {c: store.device_tensor(ChunkList.GRAD, c) for c in chunks}
            like = next((t for t in present.values() if t is not None), None)
            buffers = []
            for c in chunks:
                if present[c] is None:  # no trainable params in it: contributes zeros
                    device = like.device if like is not None else store.device
                    buffers.append(torch.zeros(store.numel(c), dtype=store.dtypes[ChunkList.GRAD], device=device))
                else:
                    buffers.append(store.tensor(ChunkList.GRAD, c, Tier.DEVICE, why=why))
            self.pending[(ChunkList.GRAD, g)] = coll.reduce_scatter(ChunkList.GRAD, g, buffers, buffers[coll.rank])
        else:
            raise ExecutorError(f"{why}: StoreCollectives applies ALL_GATHER and REDUCE_SCATTER, found {action.op.value}")

    def wait(self, lst: ChunkList, chunk: int) -> None:
        work = self.pending.pop((lst, chunk // self.collectives.world_size), None)
        if work is not None:
            self._land(work)
        if lst is ChunkList.GRAD and chunk in self.pending_chunks:
            self._land(self.pending_chunks.pop(chunk))

    def _land(self, work: CollectiveWork) -> None:
        work.wait()
        if work.op is not Op.REDUCE_SCATTER:
            return
        if work.chunk >= 0:  # one chunk of a per-bucket reduce-scatter: its owner keeps it
            c = work.chunk
            if not self.collectives.owns(c) and self.store.device_tensor(ChunkList.GRAD, c) is not None:
                self.store.evict(ChunkList.GRAD, c, Tier.DEVICE, why=f"per-bucket reduce-scatter of chunk {c} landed: "
                                 "its owner keeps the grads")
                self.scattered.add(c)
            return
        own = self.collectives.owned_chunk(work.comm_group)
        for c in self.collectives.group_chunks(work.comm_group):
            if c != own and self.store.device_tensor(ChunkList.GRAD, c) is not None:
                self.store.evict(ChunkList.GRAD, c, Tier.DEVICE, why=f"reduce-scatter of comm group {work.comm_group} "
                                 "landed: only the owned chunk's grads stay")
                self.scattered.add(c)

    def land_scatters(self) -> None:
        """Wait for the reduce-scatters in flight and drop the non-owned grads they reduced."""
        for key in [k for k, w in self.pending.items() if w.op is Op.REDUCE_SCATTER]:
            self._land(self.pending.pop(key))
        for c in list(self.pending_chunks):
            self._land(self.pending_chunks.pop(c))

    def dropped(self, action: Action) -> bool:
        """Whether `action` is an EVICT from DEVICE of a GRAD chunk this rank already dropped at its
        reduce-scatter (nothing left to do)."""
        if action.op is Op.EVICT and action.list is ChunkList.GRAD and action.src is Tier.DEVICE and action.chunk in self.scattered:
            self.scattered.discard(action.chunk)
            return True
        return False

    def evicted(self, lst: ChunkList, chunk: int) -> None:
        g = chunk // self.collectives.world_size
        self.wait(lst, chunk)
        if self.collectives.state(lst, g) in (GroupState.GATHERED, GroupState.REDUCED):
            self.collectives.release(lst, g)

    def end_iteration(self) -> None:
        for work in [*self.pending.values(), *self.pending_chunks.values()]:
            self._land(work)
        self.pending.clear()
        self.pending_chunks.clear()
        self.scattered.clear()
        for g in range(self.collectives.n_groups):
            if self.collectives.state(ChunkList.GRAD, g) is GroupState.REDUCED:
                self.collectives.release(ChunkList.GRAD, g)
