"""Where a swapped saved tensor's bytes travel: DEVICE -> HOST (-> NVME) and back.

`SwapIO` is the transfer part of the activation manager (executor/activations.py): it starts each
record's offload and reload through the engine's copy engine (executor/copies.py) and NVMe store
(executor/nvme.py, Note [activation files]) and leaves a `Ready` on the record; the manager keeps the
hooks, the records and the counters. A manager built alone gets a copy engine of its own (made on the
first swap) and a locked NVMe store of its own, which `release` closes; the engine's are shared and
stay the engine's.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from executor.activation_records import Block, Record
from executor.copies import CpuCopyEngine, CudaCopyEngine, Ready
from executor.errors import ExecutorError
from executor.nvme import ALIGN_BYTES, NvmeStore, StoreState, aligned_empty
from schemas.schedule import Channel, Tier

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def padded(nbytes: int) -> int:
    """A swapped record's share of its block's NVMe file: whole 4096-byte blocks (O_DIRECT's unit)."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class SwapIO:
    """The copies of swapped records (module docstring)."""

    def __init__(self, *, copies: CpuCopyEngine | CudaCopyEngine | None, nvme: NvmeStore | None,
                 nvme_dir: str | os.PathLike[str] | None, needs_nvme: bool) -> None:
        self.owned: dict[str, Any] = {}  # what `release` closes: the copy engine and store made here
        self.nvme = nvme if needs_nvme else None
        if self.nvme is None and needs_nvme:
            if nvme_dir is None:
                raise ExecutorError("activation plan: a block swaps to NVME but no nvme_dir was given; pass "
                                    "nvme_dir=<a directory on the SSD>")
            if not Path(nvme_dir).is_dir():
                raise ExecutorError(f"activation plan: nvme_dir={str(nvme_dir)!r} is not a directory; pass an "
                                    "existing, writable directory on the SSD")
            # the directory is left as found: the lock file goes at close() too
            self.nvme = self.owned["nvme"] = NvmeStore(nvme_dir, lists={}, remove_lock_file=True)
        self.copies = copies  # None: made on the first swap (`copy_engine`)

    def copy_engine(self, device: torch.device) -> CpuCopyEngine | CudaCopyEngine:
        """The engine's copy engine, or (a manager built alone) its own, made on the first swap."""
        if self.copies is None:
            self.copies = CudaCopyEngine(device) if device.type == "cuda" else CpuCopyEngine()
            self.owned["copies"] = self.copies
        return self.copies

    def offload(self, b: Block, record: Record, src: torch.Tensor, *, cpu_copy: CopyFn) -> Ready | None:
        """Start `record`'s DEVICE -> HOST copy of `src` (then its NVME write) and set `record.offload`.
        Returns the copy's `Ready` when its landing must be polled (a CUDA event), None when `cpu_copy`
        runs on the copy worker and books the landing itself (Note [offload landing])."""
        cuda = src.device.type == "cuda"
        if record.tier is Tier.NVME:  # aligned and padded: the file write goes straight from it (O_DIRECT)
            record.nvme_offset = b.nvme_cursor
            b.nvme_cursor += padded(record.nbytes)
            record.host = aligned_empty(padded(record.nbytes), torch.uint8, pin_memory=cuda)
        else:
            record.host = torch.empty(record.nbytes, dtype=torch.uint8, pin_memory=cuda)
        copies = self.copy_engine(src.device)
        host = record.host[:record.nbytes]
        if isinstance(copies, CudaCopyEngine):  # starts once the kernels producing the tensor are done
            copied = landing = copies.copy(host, src, after=[], channel=Channel.D2H)
        else:
            copied, landing = copies.copy(host, src, after=[], fn=cpu_copy), None
        record.offload = copied
        if record.tier is Tier.NVME:
            written = self.nvme.act_write_async(b.index, record.nvme_offset, record.host, after=[copied])
            written.add_done_callback(lambda f, ref=weakref.ref(record), host=record.host: _written(ref, host, f))
            record.offload = Ready(future=written)
        return landing

    def reload(self, record: Record, dst: torch.Tensor, *, cpu_copy: CopyFn) -> None:
        """Start bringing `record` back into `dst` (after its offload) and set `record.reload`."""
        copies = self.copy_engine(dst.device)
        cuda = isinstance(copies, CudaCopyEngine)
        if record.tier is Tier.NVME:  # NVME -> HOST on the store's threads once the write landed; then H2D
            host = aligned_empty(padded(record.nbytes), torch.uint8, pin_memory=cuda)
            read = self.nvme.act_read_async(record.block, record.nvme_offset, host, after=[record.offload])
            if cuda:
                record.reload = _copy_when_read(copies, read, dst, host[:record.nbytes])
            else:
                record.reload = copies.copy(dst, host[:record.nbytes], after=[Ready(future=read)], fn=cpu_copy)
        elif cuda:  # after the offload's event, and after the compute stream's last use of dst's memory
            host = record.host
            record.reload = copies.copy(dst, host, after=[record.offload], channel=Channel.H2D)
        else:
            host = record.host
            record.reload = copies.copy(dst, host, after=[record.offload], fn=cpu_copy)
        record.device = dst
        record.host = host  # kept until the unpack waited for the copy

    def files(self) -> list[Path]:
        return self.nvme.act_files() if self.nvme is not None else []


def release(owned: dict[str, Any], nvme: NvmeStore | None) -> None:
    """close() and the finalizer: the copies in flight land, then the NVMe files go (with the store and
    its folder when the manager made its own); the engine's copy engine and store stay its own."""
    copies = owned.pop("copies", None)
    if copies is not None:
        copies.close()
    if nvme is not None:
        if owned.pop("nvme", None) is not None:
            nvme.close()
        elif nvme.state is StoreState.OPEN:
            nvme.remove_act_files()


def _written(ref: weakref.ref[Record], host: torch.Tensor, future: Future) -> None:
    """NVMe thread: the block's file holds the record's bytes now; its HOST copy goes."""
    record = ref()
    if record is not None and future.exception() is None and record.host is host:
        record.host = None


def _copy_when_read(copies: CudaCopyEngine, read: Future, dst: torch.Tensor, host: torch.Tensor) -> Ready:
    """A GPU reload from NVME: the H2D copy is issued by the NVMe thread once the read landed, so the
    training thread never waits for the disk here; it waits for the copy's event at the unpack. The
    copy is ordered after the compute stream's last use of `dst`'s memory by an event recorded now."""
    allocated = torch.cuda.Event()
    allocated.record()  # dst may reuse memory the compute stream still reads: copy after it
    issued: Future = Future()

    def issue(done: Future) -> None:
        try:
            done.result()
            issued.set_result(copies.copy(dst, host, after=[Ready(event=allocated)], channel=Channel.H2D,
                                          after_compute=False))
        except BaseException as exc:  # noqa: BLE001 - the unpack raises it as one line
            issued.set_exception(exc)

    read.add_done_callback(issue)
    return Ready(future=issued)
