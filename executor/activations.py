"""The activation plan: per block KEEP, RECOMPUTE, SWAP_HOST or SWAP_NVME on an unmodified model
(DESIGN.md §5 "Activations"; Fuyou §4.4 pipelined activation swapping).

`ActivationManager(model, modes)` puts thin forward pre/post hooks on the blocks (`find_blocks`)
and saved-tensor hooks around their forward; what each mode does, how saved storages are counted,
the byte counters and the copy worker's failures are the notes [activation modes], [saved-tensor
dedup], [activation counters] and [copy worker failures] below. Copies go through the engine's copy
engine (executor/copies.py) and NVMe files through its `NvmeStore` (executor/nvme.py, Note [activation
files]); a manager built alone makes its own of each.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator

from executor.activation_records import (
    ActivationStats,
    Alias,
    Block,
    BlockState,
    Record,
    Saved,
    checkpoint_tiers,
    in_backward,
    positional_call,
    recompute_contexts,
    resolve_checkpoint_tiers,
)
from executor.activation_io import SwapIO, release
from executor.copies import CpuCopyEngine, CudaCopyEngine, Ready
from executor.errors import ExecutorError
from executor.hooks import find_blocks, tensors_in
from executor.nvme import NvmeStore
from executor.store import out_of_memory
from schemas.schedule import COPY_PATH, ActivationMode, ActivationPlan, Channel, Schedule, Tier

__all__ = ["ActivationManager", "ActivationStats", "BlockState", "checkpoint_tiers"]


def _device_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A reloaded record's DEVICE buffer (a module function so tests can inject an out-of-memory error)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The copy worker's one primitive on the CPU (a module function so tests can make it fail)."""
    dst.copy_(src)


def _landed_well(ready: Ready) -> bool:
    """Whether an offload copy is done and did not fail (a failed one stays for a wait to raise)."""
    return ready.done() and ready.succeeded()


# ----------------------------------------------------------------------------- the manager


# Note [activation modes]
# The hooks per mode:
# - KEEP: the block's forward runs under our `saved_tensors_hooks`, which only count what it saves
#   (the tensors stay where they are, on DEVICE, until backward).
# - RECOMPUTE: non-reentrant activation checkpointing of the block, the way
#   `torch.distributed._composable.checkpoint` does it -- the forward hooks drive
#   `torch.utils.checkpoint._checkpoint_without_reentrant_generator` -- so only the block's input is
#   saved (through our hooks: counted like KEEP) and the forward reruns inside the block's backward,
#   with the RNG state of the original forward. Every tensor of the input, positional or keyword,
#   also inside tuples, lists and dicts (`torch.utils._pytree`), is saved that way: a keyword tensor
#   would otherwise be held by the checkpoint's closure, out of the hooks' reach.
# - SWAP_HOST / SWAP_NVME: each tensor the block saves is copied, whole storage at a time, to HOST
#   (pinned memory when DEVICE is CUDA) by the engine's copy engine (executor/copies.py: on the CPU its
#   ONE worker thread, on a GPU its D2H / H2D streams, created once; a `Ready` -- a future, or a CUDA
#   event -- travels with every in-flight buffer), and the manager drops its DEVICE reference once the
#   copy is done (Note [offload landing]). SWAP_NVME continues from HOST into the block's file in the
#   engine's `NvmeStore` (4096-aligned offsets and buffers, Note [activation files] in
#   executor/nvme.py), then frees the HOST copy.
#   Reloads are prefetched: `prefetch(block)` starts bringing a block back, and (with
#   `auto_prefetch`) it is called for the next swapped block in backward order as soon as a block's
#   backward begins (the grad of its output arrives) and for the first one when the backward of the
#   whole model begins, so reloads overlap the backward of later blocks; an unpack waits for its
#   reload (or starts it, if nobody prefetched).
# - RECOMPUTE with an offloaded checkpoint (`checkpoint_tiers={block: HOST | NVME}`; the engine takes
#   them from the schedule's ACT_OFFLOAD actions on RECOMPUTE blocks): the block's input, its
#   checkpoint, is swapped and reloaded like a SWAP block's saved tensors. Its records are the
#   block's own, deduplicated within the block only: a storage some other block saves as well (the
#   previous block's output that block saved itself, a mask every block receives) is copied once for
#   each block it is an input of, never shared with the other block's record. So the block moves
#   exactly what the recorder counts as its `input_bytes` (the storages of its tensor inputs, model
#   data excluded), which is what the planner's ACT_OFFLOAD / ACT_RELOAD carry.


class ActivationManager:
    """Applies a per-block ActivationMode to `model` (Note [activation modes]).

    model: the unmodified model; blocks: fqn of its blocks (default `find_blocks(model)`).
    modes: one ActivationMode per block (a sequence in block order, or a mapping by block fqn --
        missing blocks KEEP).
    checkpoint_tiers: RECOMPUTE blocks whose checkpoint (input) is offloaded, to HOST or NVME, by
        block index or fqn (the schedule's ACT_OFFLOAD on a RECOMPUTE block; `from_schedule`).
    alias_pack / alias_unpack: the engine's param aliasing (both or neither).
    nvme_dir: where SWAP_NVME files (and checkpoints offloaded to NVME) go (required then, unless
        `nvme` is given): the manager's own `NvmeStore` there (locked, its folder removed by close()).
    copies / nvme: the engine's copy engine and NVMe store, shared with its chunks (default: the
        manager makes its own on first use, and close() closes them).
    auto_prefetch: start reloads by the backward of the previous block (False: only `prefetch()`,
        e.g. at the schedule's ACT_RELOAD moments); prefetch_ahead: how many swapped blocks ahead
        (the depth of Fuyou §4.4's prefetch FIFO: each reloaded block is DEVICE memory held early).
    record_events: keep `events`, a list of (what, block) in order: "capture", "saved",
        "prefetch", "backward", "wait" (tests and debugging).
    on_failure: called with the error line before a failed copy is raised (the engine marks itself
        FAILED: the error surfaces in the model's own hooks, not in the engine's).
    """

    def __init__(self, model: nn.Module, modes: Sequence[ActivationMode] | Mapping[str, ActivationMode], *,
                 blocks: Sequence[str] | None = None,
                 checkpoint_tiers: Mapping[int | str, Tier] | None = None,
                 alias_pack: Callable[[torch.Tensor], object | None] | None = None,
                 alias_unpack: Callable[[object], torch.Tensor] | None = None,
                 nvme_dir: str | os.PathLike[str] | None = None, auto_prefetch: bool = True,
                 prefetch_ahead: int = 1, record_events: bool = False, install: bool = True,
                 on_failure: Callable[[str], None] | None = None,
                 copies: CpuCopyEngine | CudaCopyEngine | None = None, nvme: NvmeStore | None = None) -> None:
        names = list(find_blocks(model) if blocks is None else blocks)
        modules = dict(model.named_modules())
        unknown = [n for n in names if n not in modules or n == ""]
        if unknown:
            raise ExecutorError(f"activation plan: blocks {unknown} are not submodules of the model; expected "
                                "names from executor.hooks.find_blocks(model)")
        if isinstance(modes, Mapping):
            extra = sorted(set(modes) - set(names))
            if extra:
                raise ExecutorError(f"activation plan: modes given for {extra}, which are not blocks of the model "
                                    f"(blocks: {names[:4]}{'...' if len(names) > 4 else ''})")
            mode_list = [ActivationMode(modes.get(n, ActivationMode.KEEP)) for n in names]
        else:
            mode_list = [ActivationMode(m) for m in modes]
            if len(mode_list) != len(names):
                raise ExecutorError(f"activation plan: {len(mode_list)} modes for {len(names)} blocks; give one "
                                    "ActivationMode per block, in block order")
        tiers = resolve_checkpoint_tiers(names, mode_list, checkpoint_tiers or {})
        if (alias_pack is None) != (alias_unpack is None):
            raise ExecutorError("activation plan: pass alias_pack and alias_unpack together (or neither)")
        if prefetch_ahead < 1:
            raise ExecutorError(f"activation plan: prefetch_ahead={prefetch_ahead}; expected at least 1 block")
        self.model = model
        self.blocks = [Block(i, n, modules[n], m, tiers[i])
                       for i, (n, m) in enumerate(zip(names, mode_list, strict=True))]
        self._alias_pack, self._alias_unpack = alias_pack, alias_unpack
        self.auto_prefetch, self.prefetch_ahead = auto_prefetch, prefetch_ahead
        self._on_failure = on_failure
        self.events: list[tuple[str, int]] | None = [] if record_events else None

        self._io = SwapIO(copies=copies, nvme=nvme, nvme_dir=nvme_dir,
                          needs_nvme=any(b.swap_tier is Tier.NVME for b in self.blocks))
        self._offloading = 0  # live bytes whose offload copy is in flight
        self._landing: list[tuple[Ready, weakref.ref[Record], int]] = []  # CUDA offloads not seen landed yet
        # every offload whose DEVICE -> HOST copy may be in flight, oldest first: (issue time in
        # perf_counter_ns, its landing, the record), for `oldest_offload` (Note [offload landing])
        self._in_flight: deque[tuple[int, Ready, weakref.ref[Record]]] = deque()
        self._lock = threading.Lock()
        self._by_storage: dict[int, tuple[weakref.ref, weakref.ref[Record]]] = {}
        self._param_storages: set[int] = set()
        self._root_backward_seen = False
        # True while the engine evaluates between iterations: the forward saves nothing for backward
        self.paused = False
        self._handles: list[Any] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, release, self._io.owned, self._io.nvme)
        self.reset_stats()
        if install:
            self.install()

    @classmethod
    def from_plans(cls, model: nn.Module, plans: Sequence[ActivationPlan], **kwargs: Any) -> ActivationManager:
        """From a schedule's `activation_plans` (block ids in order, module names as recorded)."""
        blocks = [p.module for p in sorted(plans, key=lambda p: p.block)]
        return cls(model, [p.mode for p in sorted(plans, key=lambda p: p.block)], blocks=blocks, **kwargs)

    @classmethod
    def from_schedule(cls, model: nn.Module, schedule: Schedule, **kwargs: Any) -> ActivationManager:
        """From a schedule: its `activation_plans`, and the checkpoints its ACT_OFFLOAD actions move."""
        return cls.from_plans(model, schedule.activation_plans, checkpoint_tiers=checkpoint_tiers(schedule), **kwargs)

    @property
    def modes(self) -> tuple[ActivationMode, ...]:
        return tuple(b.mode for b in self.blocks)

    @property
    def checkpoint_tiers(self) -> dict[int, Tier]:
        """RECOMPUTE blocks whose checkpoint is offloaded, and where to."""
        return {b.index: b.swap_tier for b in self.blocks
                if b.mode is ActivationMode.RECOMPUTE and b.swap_tier is not None}

    # -- install / remove / close ---------------------------------------------------------------
    def install(self) -> None:
        if self._handles or self._closed:
            return
        for b in self.blocks:
            self._handles += [
                b.module.register_forward_pre_hook(functools.partial(self._pre_forward, b), with_kwargs=True),
                # prepend + always_call: leave the checkpoint generator and our hooks before anything else
                # runs, even when the forward raised (as torch.distributed._composable.checkpoint does)
                b.module.register_forward_hook(functools.partial(self._post_forward, b), prepend=True,
                                               always_call=True),
            ]
        self._handles.append(self.model.register_forward_hook(self._root_post_forward))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def close(self) -> None:
        """Wait for copies in flight, remove the hooks and the NVMe files (with the folder and the store
        when the manager made its own)."""
        if self._closed:
            return
        self._closed = True
        self.remove()
        self._finalizer()
        self._landing = []
        self._in_flight.clear()

    def __enter__(self) -> ActivationManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hooks (thin) ---------------------------------------------------------------------------
    def _pre_forward(self, b: Block, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.paused or in_backward():
            return  # a recomputation inside backward: its saved tensors are transient
        b.move(BlockState.CAPTURING)
        self._log("capture", b.index)
        self._harvest()
        if not b.live_records():
            b.nvme_cursor = 0  # nothing of the previous forward is still held: reuse the file
        self._param_storages = self._model_storages()
        b.hooks_ctx = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, b), self._unpack)
        b.hooks_ctx.__enter__()
        if b.mode is ActivationMode.RECOMPUTE:
            # saves the block input through our hooks (counted; swapped when the checkpoint is
            # offloaded), then pushes the checkpoint's own hooks
            rerun, tensors = positional_call(module, args, kwargs)
            b.own = {} if b.swap_tier is not None else None
            try:
                b.generator = _checkpoint_without_reentrant_generator(
                    rerun, True, recompute_contexts, _DEFAULT_DETERMINISM_MODE, False, True, *tensors)
                next(b.generator)
            finally:
                b.own = None

    def _post_forward(self, b: Block, module: nn.Module, args: tuple, output: Any) -> None:
        if self.paused or b.state is not BlockState.CAPTURING or in_backward():
            return
        gen, b.generator = b.generator, None
        ctx, b.hooks_ctx = b.hooks_ctx, None
        try:
            if gen is not None:
                try:
                    next(gen)
                except StopIteration:
                    pass
                else:
                    raise ExecutorError(f"activations of block {b.index} ({b.name!r}): the checkpoint generator "
                                        "did not finish at post_forward")
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        b.move(BlockState.SAVED)
        self._log("saved", b.index)
        self._raise_failed(b)
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._block_grad_arrived, b))

    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.paused or in_backward() or not torch.is_grad_enabled():
            return
        self._root_backward_seen = False
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(self._root_grad_arrived)

    def _root_grad_arrived(self, grad: torch.Tensor) -> None:
        if self._root_backward_seen:
            return
        self._root_backward_seen = True
        if self.auto_prefetch:
            self._prefetch_before(len(self.blocks))

    def _block_grad_arrived(self, b: Block, grad: torch.Tensor) -> None:
        if b.state not in (BlockState.SAVED, BlockState.RELOADING):
            return  # another output of the same block: its backward began already
        if self.auto_prefetch:
            self.prefetch(b.index)  # nobody prefetched it: start now, the unpacks wait
        b.move(BlockState.BACKWARD)
        self._log("backward", b.index)
        if self.auto_prefetch:
            self._prefetch_before(b.index)  # comes back while this block's backward runs

    # Note [saved-tensor dedup]
    # Saved tensors are deduplicated by storage exactly as the recorder (`executor/record.py`) counts
    # activations: one record per storage, owned by the first block that saves it, its bytes the whole
    # storage; model data (params) is never an activation (an offloaded checkpoint's records are the
    # exception above). The engine passes `alias_pack(tensor) ->
    # token | None` / `alias_unpack(token) -> tensor`: a tensor for which alias_pack returns a token is
    # stored as that token (a param in its chunk: never copied, never swapped). Without alias_pack, a
    # tensor sharing a storage with one of the model's params is kept as is.
    # -- pack / unpack ---------------------------------------------------------------------------
    def _pack(self, b: Block, t: torch.Tensor) -> Any:
        if self._alias_pack is not None:
            token = self._alias_pack(t)
            if token is not None:
                return Alias(token, None)
        if t.layout is not torch.strided or t.device.type == "meta":
            return Alias(None, t)  # nothing we can copy byte for byte: kept as is, not counted
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return Alias(None, t)
        key = storage._cdata
        if key in self._param_storages:
            return Alias(None, t)  # model data is never an activation
        if b.own is not None:  # an offloaded checkpoint: the block's own copy (Note [activation modes])
            found_own = b.own.get(key)
            record = found_own() if found_own is not None else None
            if record is None:
                record = self._capture(b, storage, t.device)
                b.own[key] = weakref.ref(record)
            return Saved(record, t)
        found = self._by_storage.get(key)
        record = found[1]() if found is not None and found[0]() is storage else None
        if record is None:
            record = self._capture(b, storage, t.device)
            ref = weakref.ref(storage, functools.partial(self._forget, key))
            self._by_storage[key] = (ref, weakref.ref(record))
        return Saved(record, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, Alias):
            return packed.tensor if packed.token is None else self._alias_unpack(packed.token)
        record: Record = packed.record
        raw = self._device_bytes(record)
        out = torch.empty(0, dtype=packed.dtype, device=raw.device)
        return out.set_(raw.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _forget(self, key: int, ref: weakref.ref) -> None:
        found = self._by_storage.get(key)
        if found is not None and found[0] is ref:
            del self._by_storage[key]

    # -- the unit of work: capture, offload, reload ------------------------------------------------
    def _capture(self, b: Block, storage: Any, device: torch.device) -> Record:
        record = Record(self, b.index, b.mode, b.swap_tier, storage, device)
        b.records.append(weakref.ref(record))
        self._saved_per_block[b.index] += record.nbytes
        self.hold(record, 1)
        if record.tier is not None:
            self._offload(b, record)
        return record

    # Note [offload landing]
    # An offload has landed when its DEVICE -> HOST copy is done: its bytes stop counting as live and
    # in flight then (the NVME write that follows reads HOST only). On the CPU the copy worker books it
    # in the copy job itself, before the copy's future completes, so a wait for the offload sees it; a
    # CUDA event calls nothing back, so the manager books the landed ones whenever it is asked
    # (`_harvest`: counters, `wait_offloaded`, a block's next forward). Dropping the DEVICE reference early is
    # safe on a GPU: the copy engine records the source on its stream, so the allocator does not hand
    # the memory out before the copy ends. Until it lands, the bytes count on DEVICE (`live_bytes`); the
    # engine's budget check waits for the oldest offloads in flight when the DEVICE bytes would not fit
    # otherwise (`oldest_offload`; Note [activations] in executor/runtime.py).
    def _offload(self, b: Block, record: Record) -> None:
        tier = record.tier
        src, record.device = record.device, None
        with self._lock:
            self._offloading += record.nbytes
        landed: Future = Future()  # the CPU copy job's landing (an NVME swap's `offload` is its file write)
        landing = self._io.offload(b, record, src, cpu_copy=functools.partial(self._copy_and_land, record, landed))
        del src
        if landing is not None:
            with self._lock:
                self._landing.append((landing, weakref.ref(record), record.nbytes))
        while self._in_flight and _landed_well(self._in_flight[0][1]):
            self._in_flight.popleft()
        self._in_flight.append((time.perf_counter_ns(), landing or Ready(future=landed), weakref.ref(record)))
        with self._lock:
            self._offloaded[tier] += record.nbytes
            self._offloaded_per_block[b.index] += record.nbytes
            for channel in COPY_PATH[(Tier.DEVICE, tier)]:  # an NVME swap crosses HOST
                self._channels[channel] += record.nbytes

    def _copy_and_land(self, record: Record, landed: Future, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy worker (CPU): the offload copy, then its landing (Note [offload landing])."""
        try:
            _copy_bytes(dst, src)
        except BaseException as exc:
            landed.set_exception(exc)
            raise
        self._landed(record, record.nbytes)
        landed.set_result(None)

    def _landed(self, record: Record | None, nbytes: int) -> None:
        with self._lock:
            self._offloading -= nbytes
        if record is not None:
            self.hold(record, -1)

    def _harvest(self) -> None:
        """Book the CUDA offloads that have landed (Note [offload landing])."""
        if not self._landing:
            return
        with self._lock:
            done = [x[0].done() for x in self._landing]
            landed = [x for x, d in zip(self._landing, done, strict=True) if d]
            self._landing = [x for x, d in zip(self._landing, done, strict=True) if not d]
        for _, ref, nbytes in landed:
            self._landed(ref(), nbytes)  # a record autograd already freed gave its live bytes back then

    def oldest_offload(self) -> tuple[int, Callable[[], float]] | None:
        """The oldest offload whose copy has not landed yet: (its issue time in perf_counter_ns, a call
        that waits for it and returns the seconds waited), or None (`executor.store.Pool.oldest_other`)."""
        while self._in_flight and _landed_well(self._in_flight[0][1]):
            self._in_flight.popleft()
        self._harvest()
        if not self._in_flight:
            return None
        return self._in_flight[0][0], self._wait_oldest_offload

    def _wait_oldest_offload(self) -> float:
        """Block until the oldest offload in flight landed; a failed one raises ExecutorError."""
        _, ready, ref = self._in_flight.popleft()
        start = time.perf_counter()
        record = ref()
        if record is not None:
            self._result(ready, record, "offload")
        else:
            try:
                ready.wait()
            except Exception as exc:  # noqa: BLE001 - one clear line, as `_result` gives
                raise ExecutorError(f"activations: the offload of a saved tensor failed in the copy worker: "
                                    f"{type(exc).__name__}: {exc}") from exc
        self._harvest()
        return time.perf_counter() - start  # a stall the pool counts (`Pool.stall_seconds`)

    def prefetch(self, block: int) -> None:
        """Start bringing `block`'s swapped activations back to DEVICE (a no-op when they are not
        swapped, already coming back, or nothing was captured)."""
        b = self.blocks[block]
        if b.swap_tier is None or b.state is not BlockState.SAVED:
            return
        b.move(BlockState.RELOADING)
        self._log("prefetch", block)
        for record in b.live_records():
            self._reload(record)

    def wait_offloaded(self, block: int) -> None:
        """Wait until `block`'s offload copies are done (e.g. at the schedule's ACT_OFFLOAD moment);
        raises ExecutorError if one failed."""
        for record in self.blocks[block].live_records():
            if record.offload is not None:
                self._result(record.offload, record, "offload")
        self._harvest()

    def _reload(self, record: Record) -> None:
        if record.reload is not None or record.device is not None:
            return
        tier = record.tier
        try:
            dst = _device_empty(record.nbytes, record.home)
        except torch.OutOfMemoryError as exc:
            b = self.blocks[record.block]
            error = out_of_memory(f"the reload of a saved tensor of block {b.index} ({b.name!r})", record.nbytes,
                                  record.home, exc)
            if self._on_failure is not None:
                self._on_failure(str(error))
            raise error from exc
        self.hold(record, 1)
        self._io.reload(record, dst, cpu_copy=_copy_bytes)
        with self._lock:
            self._reloaded[tier] += record.nbytes
            self._reloaded_per_block[record.block] += record.nbytes
            for channel in COPY_PATH[(tier, Tier.DEVICE)]:
                self._channels[channel] += record.nbytes

    def _device_bytes(self, record: Record) -> torch.Tensor:
        """The record's bytes on DEVICE, waiting for (or starting) the reload."""
        if record.tier is not None:
            if record.reload is None:
                self._reload(record)  # nobody prefetched it (auto_prefetch off and no prefetch call)
            if record.reload is not None:
                start = time.perf_counter()
                if not record.reload.done():
                    self._log("wait", record.block)
                self._result(record.reload, record, "reload", on_device=True)
                record.host = None
                with self._lock:
                    self._stall += time.perf_counter() - start
        return record.device

    # Note [copy worker failures]
    # A failure in the copy engine or the NVMe store (a copy, a file write or read) is stored with the
    # buffer's `Ready` (a reload waits for its offload, so it fails with it) and raised as
    # `ExecutorError` at the block's post_forward (for offloads already finished by then), at
    # `wait_offloaded`, or at the unpack that needs the data -- never a hang. `close()` waits for the
    # copies in flight, removes the NVMe files, and removes the hooks.
    def _result(self, ready: Ready, record: Record, what: str, *, on_device: bool = False) -> None:
        try:
            if on_device:
                ready.wait_on_device()  # a GPU's compute stream waits for the copy's event
            else:
                ready.wait()
        except ExecutorError as exc:
            if self._on_failure is not None:
                self._on_failure(str(exc))
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the worker becomes one clear line
            b = self.blocks[record.block]
            kind = f"{b.mode.value} checkpoint" if b.mode is ActivationMode.RECOMPUTE else b.mode.value
            error = ExecutorError(f"activations of block {b.index} ({b.name!r}): the {what} of a saved tensor "
                                  f"({record.nbytes} bytes, {kind}) failed in the copy worker: "
                                  f"{type(exc).__name__}: {exc}")
            if self._on_failure is not None:
                self._on_failure(str(error))
            raise error from exc

    def _raise_failed(self, b: Block) -> None:
        for record in b.live_records():
            if record.offload is not None and record.offload.done():
                self._result(record.offload, record, "offload")  # raises only when it failed


    # Note [activation counters]
    # Byte counters (`stats()`): bytes offloaded per destination tier and reloaded per source tier, per
    # block and per channel (an NVME swap moves its bytes over D2H then NVME_WRITE, and back over
    # NVME_READ then H2D, as the planner counts them), saved bytes per block, and the live bytes the
    # manager holds on DEVICE with their peak. Live bytes: a KEEP/RECOMPUTE record from its pack until
    # autograd releases it; a swapped record (SWAP, offloaded checkpoint) from its pack until its offload
    # copy is done, and again from its reload until autograd releases it.
    # -- counters ------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        n = len(self.blocks)
        with self._lock:
            self._offloaded = {Tier.HOST: 0, Tier.NVME: 0}
            self._reloaded = {Tier.HOST: 0, Tier.NVME: 0}
            self._channels = {c: 0 for c in (Channel.D2H, Channel.H2D, Channel.NVME_WRITE, Channel.NVME_READ)}
            self._saved_per_block = [0] * n
            self._offloaded_per_block = [0] * n
            self._reloaded_per_block = [0] * n
            self._live = getattr(self, "_live", 0)
            self._peak = self._live
            self._stall = 0.0

    def stats(self) -> ActivationStats:
        self._harvest()
        with self._lock:
            return ActivationStats(
                offloaded_bytes=dict(self._offloaded), reloaded_bytes=dict(self._reloaded),
                bytes_per_channel=dict(self._channels), saved_bytes_per_block=tuple(self._saved_per_block),
                offloaded_bytes_per_block=tuple(self._offloaded_per_block),
                reloaded_bytes_per_block=tuple(self._reloaded_per_block),
                live_bytes=self._live, peak_live_bytes=self._peak, stall_seconds=self._stall)

    def saved_bytes(self, block: int) -> int:
        """Bytes block `block` saved for backward since the counters were reset (what the recorder counts)."""
        return self._saved_per_block[block]

    @property
    def live_bytes(self) -> int:
        """Bytes the manager holds on DEVICE now."""
        self._harvest()
        return self._live

    @property
    def offloading_bytes(self) -> int:
        """The part of `live_bytes` whose offload copy is in flight (released when it lands)."""
        self._harvest()
        return self._offloading

    def hold(self, record: Record, copies: int) -> None:
        """`copies` more (or fewer) DEVICE copies of `record` are held."""
        with self._lock:
            record.live += copies
            self._live += copies * record.nbytes
            self._peak = max(self._peak, self._live)

    # -- helpers ---------------------------------------------------------------------------------
    def _prefetch_before(self, block: int) -> None:
        """Prefetch the next `prefetch_ahead` swapped blocks below `block` (the next ones in backward order)."""
        left = self.prefetch_ahead
        for i in range(block - 1, -1, -1):
            if left == 0:
                return
            if self.blocks[i].swap_tier is not None and self.blocks[i].state is not BlockState.IDLE:
                self.prefetch(i)
                left -= 1

    def _model_storages(self) -> set[int]:
        out = set()
        for p in self.model.parameters():
            try:
                out.add(p.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError, TypeError):
                continue
        return out

    def _log(self, what: str, block: int) -> None:
        if self.events is not None:
            self.events.append((what, block))

    def nvme_files(self) -> list[Path]:
        """The NVMe files made so far (for tests and reports)."""
        return self._io.files()

    @property
    def nvme_dir(self) -> Path | None:
        """The folder of the NVMe files (the store's run folder)."""
        return self._io.nvme.directory if self._io.nvme is not None else None

