"""The NVME tier: chunk lists in preallocated files, aligned I/O on a pool of worker threads
(DESIGN.md §5 "Chunk store"; Fuyou §4.3-4.4, Angel-PTM §5 "Allocator").

One file per chunk list under a directory the user chooses, preallocated at start
(`posix_fallocate`: a full disk is found before training, not in the middle of it), each chunk in
its own slot at a 4096-byte-aligned offset. I/O is direct (`O_DIRECT`, no page cache: what an SSD
tier needs so that the OS does not keep a second copy of the model in CPU memory) where the
filesystem accepts it -- probed with one aligned write and read -- and buffered otherwise, with a
note in `notes`. A CPU buffer that is itself 4096-aligned (`aligned_empty`; CUDA's pinned memory
is page-aligned) moves without a copy; anything else (a GPU tensor, a misaligned buffer under
O_DIRECT) goes through an aligned staging buffer (pinned when CUDA is present), one per worker,
made on first use and sized for the largest chunk. The caller writes only dirty chunks (the
schedule's WRITE_BACK actions); the store never decides. The activation manager's swapped bytes go
to growable per-block files in the same run folder (Note [activation files]).

Failures (disk full, file too large, permission denied, read-only filesystem, a short read) raise
`ExecutorError` naming the file, chunk list, chunk and the fix. The caller's tensors are never
left half-changed: a write only reads its source; a read fills a destination that holds no valid
data (or, with keep_on_error=True, lands in a staging buffer first and is copied only when
complete). A chunk whose write failed is marked lost; reading it raises instead of returning
stale bytes. Files are removed on `close()` / context exit (and by a finalizer if the store is
dropped without closing).

One run per directory: the store holds the directory's lock (executor/nvme_lock.py) from
construction to `close()`; holding it, the store removes a crashed run's folders, with a note.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from executor.dtypes import TORCH_DTYPES
from executor.errors import ExecutorError
from executor.nvme_lock import LOCK_NAME, RUN_PREFIX, DirectoryLock
from schemas.schedule import Action, ChunkLayout, ChunkList, Residency, Tier

__all__ = ["ALIGN_BYTES", "DirectoryLock", "LOCK_NAME", "NvmeStore", "StoreState", "aligned_empty", "nvme_lists"]

ALIGN_BYTES = 4096  # O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical block size; 4 KiB covers all
_MAX_IO_BYTES = 1 << 30  # Linux moves at most ~2 GiB per call; keep each call well under


def nvme_lists(layout: ChunkLayout, initial_residency: Sequence[Residency], actions: Sequence[Action]
               ) -> dict[ChunkList, tuple[torch.dtype, list[int]]]:
    """The `lists` argument of NvmeStore for a schedule: a slot for every chunk the schedule ever
    puts on NVME (initial residency or an action from/to NVME), none (0 elements) for the others,
    so the files hold exactly what the schedule needs.

        NvmeStore(dir, lists=nvme_lists(s.layout, s.initial_residency, s.actions))
    """
    touched: dict[ChunkList, set[int]] = {}
    for r in initial_residency:
        if Tier.NVME in r.tiers:
            touched.setdefault(r.list, set()).add(r.chunk)
    for a in actions:
        if a.list is not None and a.chunk >= 0 and Tier.NVME in (a.src, a.dst):
            touched.setdefault(a.list, set()).add(a.chunk)
    return {lst: (TORCH_DTYPES[layout.list_dtypes[lst]], [c.elements if c.id in chunks else 0 for c in layout.chunks])
            for lst, chunks in sorted(touched.items())}


class StoreState(StrEnum):
    OPEN = "OPEN"  # files allocated, I/O accepted (entered in __init__)
    CLOSED = "CLOSED"  # files removed, I/O refused (entered in close(); never left)


@dataclass(frozen=True, slots=True, kw_only=True)
class _ListFile:
    path: Path
    fd: int
    dtype: torch.dtype
    elements: tuple[int, ...]  # per chunk
    offsets: tuple[int, ...]  # byte offset of each chunk's slot (aligned)
    slot_bytes: tuple[int, ...]  # aligned slot size of each chunk
    total_bytes: int


def _round_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


def _aligned_empty(nbytes: int, *, pin: bool) -> Tensor:
    """A uint8 tensor whose data pointer is ALIGN_BYTES-aligned (O_DIRECT's rule for buffers)."""
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % ALIGN_BYTES
    return raw[shift:shift + nbytes]


def aligned_empty(numel: int, dtype: torch.dtype, *, pin_memory: bool = False) -> Tensor:
    """A flat tensor whose data is 4096-byte aligned: HOST chunk buffers allocated with it move to
    and from the NVME tier without a staging copy."""
    item = torch.empty((), dtype=dtype).element_size()
    return _aligned_empty(numel * item, pin=pin_memory).view(dtype)


def _bytes_view(t: Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _remove_files(fds: list[int], paths: list[Path], directory: Path | None) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    if directory is not None:
        try:
            directory.rmdir()
        except OSError:
            pass


def _release_lock(lock: DirectoryLock) -> None:
    lock.release()


class NvmeStore:
    """Chunk lists on files; see the module docstring.

    directory: where the files go (created if needed; one private subfolder per store).
    lists: for each chunk list, (dtype, element count of every chunk).
    workers: I/O threads (and staging buffers).
    direct_io: True requires O_DIRECT, False never uses it, None probes and falls back.
    remove_lock_file: leave the directory as found at close() (DirectoryLock's remove_on_release).
    """

    def __init__(self, directory: str | os.PathLike[str], *, lists: Mapping[ChunkList, tuple[torch.dtype, Sequence[int]]],
                 workers: int = 4, direct_io: bool | None = None, remove_lock_file: bool = False) -> None:
        if workers < 1:
            raise ValueError(f"NvmeStore: workers must be >= 1, found {workers}")
        self.state = StoreState.OPEN
        self.notes: list[str] = []
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._inflight: dict[tuple, Future[None]] = {}  # (list, chunk) or ("act", block, offset) -> last transfer
        self._lost: set[tuple[ChunkList, int]] = set()
        self._files: dict[ChunkList, _ListFile] = {}
        self._act_fds: dict[int, int] = {}  # block -> fd of its activation file (Note [activation files])
        base = Path(directory)
        # before anything is made: a refused store changes nothing
        self._dir_lock = DirectoryLock(base, remove_on_release=remove_lock_file)
        weakref.finalize(self, _release_lock, self._dir_lock)
        for stale in self._dir_lock.stale_runs():
            shutil.rmtree(stale, ignore_errors=True)
            self.notes.append(f"removed {stale.name}: the files of a run that ended without closing its store")
        self.directory = base / f"{RUN_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fds: list[int] = []
        paths: list[Path] = []
        self._fds, self._paths = fds, paths  # the finalizer's lists: activation files join them when made
        # Registered first so that a failure half-way through construction removes what was made.
        self._finalizer = weakref.finalize(self, _remove_files, fds, paths, self.directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            self._finalizer()
            self._dir_lock.release()
            raise self._os_error(exc, "create the NVME directory", self.directory) from None
        try:
            self.direct_io = self._probe_direct(direct_io)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct_io else 0)
            for lst, (dtype, elements) in lists.items():
                item = torch.empty((), dtype=dtype).element_size()
                offsets, slots, pos = [], [], 0
                for n in elements:
                    offsets.append(pos)
                    slots.append(_round_up(int(n) * item))
                    pos += slots[-1]
                path = self.directory / f"{ChunkList(lst).value.lower()}.bin"
                try:
                    fd = os.open(path, flags, 0o600)
                except OSError as exc:
                    raise self._os_error(exc, f"create the {lst} file", path) from None
                fds.append(fd)
                paths.append(path)
                self._preallocate(fd, path, pos, lst)
                self._files[ChunkList(lst)] = _ListFile(path=path, fd=fd, dtype=dtype, elements=tuple(int(n) for n in elements),
                                                         offsets=tuple(offsets), slot_bytes=tuple(slots), total_bytes=pos)
        except BaseException:
            self._finalizer()
            self._dir_lock.release()
            self.state = StoreState.CLOSED
            raise
        self._largest_slot = max((max(f.slot_bytes, default=0) for f in self._files.values()), default=0)
        self.pinned = torch.cuda.is_available()
        # One staging buffer per worker, allocated on first use: aligned CPU tensors only ever need
        # a block for their last partial 4 KiB, so a full-chunk buffer is made only when needed.
        self._free_staging: list[Tensor | None] = [None] * workers
        self._staging_ready = threading.Condition(self._lock)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tide-nvme")

    # -- setup -----------------------------------------------------------------------------------
    def _probe_direct(self, wanted: bool | None) -> bool:
        if wanted is False:
            return False
        if not hasattr(os, "O_DIRECT"):
            reason = "this OS has no O_DIRECT"
        else:
            probe = self.directory / ".direct-probe"
            try:
                fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
                try:
                    buf = _aligned_empty(ALIGN_BYTES, pin=False).fill_(7)
                    if os.pwrite(fd, _bytes_view(buf), 0) != ALIGN_BYTES or os.preadv(fd, [_bytes_view(buf)], 0) != ALIGN_BYTES:
                        raise OSError(errno.EIO, "short probe")
                    return True
                finally:
                    os.close(fd)
            except OSError as exc:
                reason = f"the filesystem refused O_DIRECT ({exc.strerror or exc})"
            finally:
                try:
                    probe.unlink()
                except OSError:
                    pass
        if wanted:
            raise ExecutorError(f"NVME directory {self.directory.parent}: direct I/O was required but {reason}; "
                                "put the NVME directory on a local SSD filesystem (ext4, xfs) or pass direct_io=None")
        self.notes.append(f"buffered I/O in {self.directory.parent}: {reason} (the page cache will hold copies of NVME chunks)")
        return False

    def _preallocate(self, fd: int, path: Path, nbytes: int, lst: ChunkList) -> None:
        if nbytes == 0:
            return
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
                raise self._os_error(exc, f"preallocate {nbytes} bytes for the {lst} chunks", path) from None
        self.notes.append(f"{path.name}: the filesystem cannot preallocate; the file is sparse and a full disk shows up at the first write")
        try:
            os.ftruncate(fd, nbytes)
        except OSError as exc:
            raise self._os_error(exc, f"size the {lst} file to {nbytes} bytes", path) from None

    @staticmethod
    def _os_error(exc: OSError, what: str, path: Path, *, chunk: str = "") -> ExecutorError:
        code = exc.errno
        where = f"{path}{chunk}"
        if code in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space on that filesystem, or point the NVME directory at a disk with room (or give the planner a smaller nvme capacity)"
            return ExecutorError(f"NVME tier: disk full: could not {what} ({where}); {fix}")
        if code == errno.EFBIG:
            return ExecutorError(f"NVME tier: file size limit reached: could not {what} ({where}); "
                                 "raise the file size limit (ulimit -f) or use a filesystem that allows larger files")
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            return ExecutorError(f"NVME tier: permission denied ({os.strerror(code)}): could not {what} ({where}); "
                                 "make the NVME directory writable by this user, or choose another directory")
        return ExecutorError(f"NVME tier: could not {what} ({where}): {exc.strerror or exc}; check the disk and the NVME directory")

    # -- I/O -------------------------------------------------------------------------------------
    def write_async(self, lst: ChunkList, chunk: int, src: Tensor, *, after: Sequence[Any] = ()) -> Future[None]:
        """Write chunk `chunk` of `lst` from `src` (any device, the chunk's dtype and element count).

        `src` must stay unchanged until the future is done (it is read, never modified).
        after: transfers that must land first (e.g. the copy still filling `src`): Futures, or
          objects with `wait()` (the chunk store's `Ready`); waited for on the I/O thread.
        """
        file = self._check(lst, chunk, src, "src")
        return self._submit((lst, chunk), lambda: self._write(file, lst, chunk, src), after)

    def read_async(self, lst: ChunkList, chunk: int, dst: Tensor, *, keep_on_error: bool = False,
                   after: Sequence[Any] = ()) -> Future[None]:
        """Read chunk `chunk` of `lst` into `dst`.

        The read lands straight in `dst` when it can (CPU, and 4096-aligned under O_DIRECT: allocate
        with `aligned_empty`), so a failed read leaves `dst` undefined -- a read only ever fills a
        buffer for a chunk memory does not hold. keep_on_error=True reads through a staging buffer
        instead and changes `dst` only when the whole read succeeded. after: as in `write_async`
        (e.g. copies still reading the old content of `dst`).
        """
        file = self._check(lst, chunk, dst, "dst")
        return self._submit((lst, chunk), lambda: self._read(file, lst, chunk, dst, keep_on_error), after)

    def write(self, lst: ChunkList, chunk: int, src: Tensor) -> None:
        self.write_async(lst, chunk, src).result()

    def read(self, lst: ChunkList, chunk: int, dst: Tensor, *, keep_on_error: bool = False) -> None:
        self.read_async(lst, chunk, dst, keep_on_error=keep_on_error).result()

    def _check(self, lst: ChunkList, chunk: int, t: Tensor, label: str) -> _ListFile:
        if self.state is not StoreState.OPEN:
            raise ExecutorError(f"NVME tier: the store in {self.directory} is closed; no I/O after close()")
        file = self._files.get(lst)
        if file is None:
            raise ValueError(f"NvmeStore: no chunk list {lst} on NVME (lists: {[x.value for x in self._files]})")
        if not 0 <= chunk < len(file.elements):
            raise ValueError(f"NvmeStore: {lst} has chunks 0..{len(file.elements) - 1}, found chunk {chunk}")
        if file.elements[chunk] == 0:
            raise ValueError(f"NvmeStore: {lst} chunk {chunk} has no slot on NVME (the schedule never puts it there)")
        if t.dtype != file.dtype or t.numel() != file.elements[chunk] or not t.is_contiguous():
            raise ValueError(f"NvmeStore: {label} for {lst} chunk {chunk} must be a contiguous {file.dtype} tensor of "
                             f"{file.elements[chunk]} elements, found {t.dtype} with {t.numel()} elements")
        return file

    def _submit(self, key: tuple, work, after: Sequence[Any]) -> Future[None]:
        with self._lock:
            previous = self._inflight.get(key)

            def run() -> None:
                if previous is not None:  # same chunk: keep the caller's order (a read after a write sees it)
                    try:
                        previous.result()
                    except Exception:
                        pass
                for dep in after:  # a failed dependency fails this transfer too
                    dep.result() if isinstance(dep, Future) else dep.wait()
                work()

            future = self._pool.submit(run)
            self._inflight[key] = future
        future.add_done_callback(lambda f, key=key: self._retire(key, f))
        return future

    def _retire(self, key: tuple, future: Future[None]) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    def _take_staging(self, nbytes: int) -> Tensor:
        with self._staging_ready:
            while not self._free_staging:
                self._staging_ready.wait()
            buf = self._free_staging.pop()
        if buf is None or buf.numel() < nbytes:
            buf = _aligned_empty(ALIGN_BYTES if nbytes <= ALIGN_BYTES else self._largest_slot, pin=self.pinned)
        return buf

    @property
    def staging_bytes(self) -> int:
        """Host memory held in staging buffers right now (those not in use)."""
        with self._lock:
            return sum(b.numel() for b in self._free_staging if b is not None)

    def _give_staging(self, buf: Tensor) -> None:
        with self._staging_ready:
            self._free_staging.append(buf)
            self._staging_ready.notify()

    def _where(self, file: _ListFile, lst: ChunkList, chunk: int) -> str:
        return f", {lst} chunk {chunk} at byte {file.offsets[chunk]}"

    def _write(self, file: _ListFile, lst: ChunkList, chunk: int, src: Tensor) -> None:
        nbytes = file.elements[chunk] * src.element_size()
        staging = None
        try:
            if src.device.type == "cpu" and (not self.direct_io or src.data_ptr() % ALIGN_BYTES == 0):
                # Zero-copy from the caller's memory; under O_DIRECT only whole aligned blocks, the
                # last partial block goes through a staging buffer padded to the block size.
                head = nbytes if not self.direct_io else nbytes // ALIGN_BYTES * ALIGN_BYTES
                if head:
                    self._io(os.pwrite, file, lst, chunk, _bytes_view(src)[:head], "write", at=0)
                if head < nbytes:
                    staging = self._take_staging(ALIGN_BYTES)
                    staging[:nbytes - head].copy_(src.reshape(-1).view(torch.uint8)[head:])
                    self._io(os.pwrite, file, lst, chunk, _bytes_view(staging[:ALIGN_BYTES]), "write", at=head)
            else:  # another device (pinned staging then disk) or a misaligned buffer under O_DIRECT
                staging = self._take_staging(file.slot_bytes[chunk])
                staging[:nbytes].copy_(src.reshape(-1).view(torch.uint8))
                length = file.slot_bytes[chunk] if self.direct_io else nbytes
                self._io(os.pwrite, file, lst, chunk, _bytes_view(staging[:length]), "write", at=0)
        except OSError as exc:
            self._lost.add((lst, chunk))
            raise self._os_error(exc, f"write {nbytes} bytes", file.path, chunk=self._where(file, lst, chunk)) from None
        except ExecutorError:
            self._lost.add((lst, chunk))
            raise
        finally:
            if staging is not None:
                self._give_staging(staging)
        self._lost.discard((lst, chunk))
        with self._lock:
            self.bytes_written += nbytes

    def _read(self, file: _ListFile, lst: ChunkList, chunk: int, dst: Tensor, keep_on_error: bool) -> None:
        if (lst, chunk) in self._lost:
            raise ExecutorError(f"NVME tier: {lst} chunk {chunk} in {file.path} is lost: its last write failed; "
                                "keep the in-memory copy (it was never evicted) and fix the disk error reported before")
        nbytes = file.elements[chunk] * dst.element_size()
        staging = None
        try:
            if not keep_on_error and dst.device.type == "cpu" and (not self.direct_io or dst.data_ptr() % ALIGN_BYTES == 0):
                head = nbytes if not self.direct_io else nbytes // ALIGN_BYTES * ALIGN_BYTES
                if head:
                    self._io(os.preadv, file, lst, chunk, _bytes_view(dst)[:head], "read", at=0)
                if head < nbytes:
                    staging = self._take_staging(ALIGN_BYTES)
                    self._io(os.preadv, file, lst, chunk, _bytes_view(staging[:ALIGN_BYTES]), "read", at=head)
                    dst.reshape(-1).view(torch.uint8)[head:].copy_(staging[:nbytes - head])
            else:
                staging = self._take_staging(file.slot_bytes[chunk])
                length = file.slot_bytes[chunk] if self.direct_io else nbytes
                self._io(os.preadv, file, lst, chunk, _bytes_view(staging[:length]), "read", at=0)
                dst.reshape(-1).view(torch.uint8).copy_(staging[:nbytes])  # only after the whole read succeeded
        except OSError as exc:
            raise self._os_error(exc, f"read {nbytes} bytes", file.path, chunk=self._where(file, lst, chunk)) from None
        finally:
            if staging is not None:
                self._give_staging(staging)
        with self._lock:
            self.bytes_read += nbytes

    def _io(self, call, file: _ListFile, lst: ChunkList, chunk: int, view: memoryview, verb: str, *, at: int) -> None:
        """pwrite/preadv the whole view at byte `at` of the chunk's slot, looping over partial transfers."""
        done, total, base = 0, len(view), file.offsets[chunk] + at
        while done < total:
            piece = view[done:done + min(total - done, _MAX_IO_BYTES)]
            n = call(file.fd, piece, base + done) if call is os.pwrite else call(file.fd, [piece], base + done)
            if n <= 0:
                if verb == "read":
                    raise ExecutorError(f"NVME tier: short read of {lst} chunk {chunk} from {file.path}: got {done} of "
                                        f"{total} bytes at byte {base} (the file was truncated or changed outside tide); "
                                        "do not touch files in the NVME directory while training")
                raise OSError(errno.EIO, f"wrote {done} of {total} bytes")
            done += n

    # Note [activation files]
    # The activation manager (executor/activations.py) swaps a block's saved tensors to NVME in one
    # growable file per block, `block<i>.act`, in this store's run folder: the activations use the same
    # directory lock (a second run on the directory is refused even when only activations go to NVME),
    # the same I/O threads and direct-I/O decision, the same error lines, and the same cleanup (the
    # files go with the run folder at close(), and a crashed run's with its stale `tide-nvme-*` folder).
    # The caller hands 4096-aligned CPU uint8 buffers whose length is a multiple of 4096, at
    # 4096-aligned offsets (O_DIRECT's rules), and orders a read after the write of the same bytes with
    # `after`. One activation manager per store: the files are named by block index.
    def act_write_async(self, block: int, offset: int, src: Tensor, *, after: Sequence[Any] = ()) -> Future[None]:
        """Write `src` at byte `offset` of block `block`'s activation file (Note [activation files])."""
        self._check_act(offset, src, "src")
        return self._submit(("act", block, offset), lambda: self._act_io(os.pwrite, block, offset, src), after)

    def act_read_async(self, block: int, offset: int, dst: Tensor, *, after: Sequence[Any] = ()) -> Future[None]:
        """Fill `dst` from byte `offset` of block `block`'s activation file (Note [activation files])."""
        self._check_act(offset, dst, "dst")
        return self._submit(("act", block, offset), lambda: self._act_io(os.preadv, block, offset, dst), after)

    def act_path(self, block: int) -> Path:
        return self.directory / f"block{block}.act"

    def act_files(self) -> list[Path]:
        """The activation files made so far, in block order."""
        with self._lock:
            return [self.act_path(b) for b in sorted(self._act_fds)]

    def remove_act_files(self) -> None:
        """Close and remove every activation file (the activation manager closes; chunk files stay)."""
        self.wait()
        with self._lock:
            fds, self._act_fds = self._act_fds, {}
        for block, fd in fds.items():
            path = self.act_path(block)
            if fd in self._fds:
                self._fds.remove(fd)
            if path in self._paths:
                self._paths.remove(path)
            _remove_files([fd], [path], None)

    def _check_act(self, offset: int, t: Tensor, label: str) -> None:
        if self.state is not StoreState.OPEN:
            raise ExecutorError(f"NVME tier: the store in {self.directory} is closed; no I/O after close()")
        if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
            raise ValueError(f"NvmeStore: an activation {label} must be a contiguous CPU uint8 tensor, found {t.dtype} "
                             f"on {t.device}")
        if self.direct_io and (offset % ALIGN_BYTES or t.numel() % ALIGN_BYTES or t.data_ptr() % ALIGN_BYTES):
            raise ValueError(f"NvmeStore: an activation {label} must be {ALIGN_BYTES}-aligned in offset ({offset}), length "
                             f"({t.numel()}) and address under O_DIRECT (allocate it with aligned_empty)")

    def _act_fd(self, block: int) -> int:
        with self._lock:
            fd = self._act_fds.get(block)
            if fd is not None:
                return fd
            path = self.act_path(block)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct_io else 0), 0o600)
            except OSError as exc:
                raise ExecutorError(f"activation file {path}: cannot open ({exc.strerror}); pass a writable nvme_dir "
                                    "with free space") from None
            self._act_fds[block] = fd
            self._fds.append(fd)
            self._paths.append(path)
            return fd

    def _act_io(self, call, block: int, offset: int, t: Tensor) -> None:
        """pwrite/preadv all of `t` at `offset` of the block's file, looping over partial transfers."""
        fd, path, view, done = self._act_fd(block), self.act_path(block), _bytes_view(t), 0
        writing = call is os.pwrite
        try:
            while done < len(view):
                piece = view[done:done + min(len(view) - done, _MAX_IO_BYTES)]
                n = call(fd, piece, offset + done) if writing else call(fd, [piece], offset + done)
                if n <= 0:
                    if writing:
                        raise OSError(errno.EIO, f"wrote {done} of {len(view)} bytes")
                    raise ExecutorError(f"activation file {path}: short read ({done} of {len(view)} bytes at {offset}); "
                                        "the file was changed by someone else")
                done += n
        except OSError as exc:
            if not writing:
                raise ExecutorError(f"activation file {path}: read of {len(view)} bytes at {offset} failed "
                                    f"({exc.strerror})") from None
            fix = ("make nvme_dir writable or pass another one" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
                   else "free space on the SSD or pass another nvme_dir")
            raise ExecutorError(f"activation file {path}: write of {len(view)} bytes at {offset} failed "
                                f"({exc.strerror}); {fix}") from None
        with self._lock:
            if writing:
                self.bytes_written += len(view)
            else:
                self.bytes_read += len(view)

    # -- lifetime --------------------------------------------------------------------------------
    def path(self, lst: ChunkList) -> Path:
        return self._files[lst].path

    @property
    def file_bytes(self) -> int:
        """Bytes preallocated on disk (all lists, aligned slots)."""
        return sum(f.total_bytes for f in self._files.values())

    def wait(self) -> None:
        """Block until every submitted transfer is done (errors stay with their futures)."""
        with self._lock:
            pending = list(self._inflight.values())
        for f in pending:
            try:
                f.result()
            except Exception:
                pass

    def sync(self) -> None:
        """Wait, then fsync every file (buffered mode: the data reached the disk)."""
        self.wait()
        for f in self._files.values():
            os.fsync(f.fd)

    def close(self) -> None:
        """Finish in-flight transfers, close and remove the files. Idempotent."""
        if self.state is StoreState.CLOSED:
            return
        self.state = StoreState.CLOSED
        self.wait()
        self._pool.shutdown(wait=True)
        self._finalizer()
        self._dir_lock.release()  # after the files are gone: the next run finds a clean directory

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
