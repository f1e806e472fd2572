"""One run per NVMe directory (issue 21 item 5): an exclusive `fcntl.flock` on
`<directory>/tide-nvme.lock`, held by `executor.nvme.NvmeStore` from construction to `close()` (the
kernel drops it when the process dies, SIGKILL included).

A second store on the same directory -- another process, a rank given the same path, a second engine
whose only NVMe use is activations -- is refused with one line naming the holder's pid; the first is
untouched. Holding the lock proves that no live run owns a `tide-nvme-*` subfolder there (nor a
`tide-act-*` one, which no run makes any more), so those are a crashed run's: they are never read
(each store reads only its own fresh subfolder) and are removed, so a crash does not keep the SSD full.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from executor.errors import ExecutorError

__all__ = ["DirectoryLock", "LOCK_NAME", "RUN_PREFIX"]

LOCK_NAME = "tide-nvme.lock"
RUN_PREFIX = "tide-nvme-"  # each store's private subfolder: tide-nvme-<pid>-<random>


# folders no run makes any more: the activation manager's own `tide-act-*` folder (unlocked, outside
# any store) before its NVMe files moved into the store's run folder (Note [activation files])
_LEGACY_PREFIXES = ("tide-act-",)
_LOCK_TRIES = 8  # a holder that removes the lock file at release may race a new one this many times


class DirectoryLock:
    """An exclusive, non-blocking flock on `<directory>/tide-nvme.lock`; released by `release()` or exit.

    remove_on_release: unlink the lock file (while still holding it) at release, so the directory is
    left as found (a standalone activation manager). Safe because every holder checks, once locked,
    that the path still names the file it locked, and tries again otherwise."""

    def __init__(self, directory: Path, *, remove_on_release: bool = False) -> None:
        self.path = directory / LOCK_NAME
        self.remove_on_release = remove_on_release
        self.fd: int | None = None
        for _ in range(_LOCK_TRIES):
            fd = self._open(directory)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ExecutorError(f"NVME directory {directory} is in use by another tide run ({holder}); give "
                                        "each run and each rank its own nvme_dir, or wait for that run to end") from None
                raise ExecutorError(f"NVME directory {directory}: cannot lock {LOCK_NAME} ({exc.strerror or exc}); "
                                    "use a local filesystem that supports flock") from None
            if _same_file(fd, self.path):
                self.fd = fd
                break
            os.close(fd)  # its holder removed it after we opened it: lock the file the path names now
        else:
            raise ExecutorError(f"NVME directory {directory}: {LOCK_NAME} kept changing under us ({_LOCK_TRIES} tries); "
                                "another tide run is starting and stopping there: give each run its own nvme_dir")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()}\n".encode(), 0)

    def _open(self, directory: Path) -> int:
        try:
            if not directory.is_dir():
                directory.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ExecutorError(f"NVME directory {directory}: cannot create the lock file {LOCK_NAME} "
                                f"({exc.strerror or exc}); pass an nvme_dir tide can write to") from None

    def stale_runs(self, keep: Path | None = None) -> list[Path]:
        """Subfolders of runs that no longer hold the lock (we do): a crashed run's files."""
        return sorted(p for prefix in (RUN_PREFIX, *_LEGACY_PREFIXES) for p in self.path.parent.glob(f"{prefix}*")
                      if p.is_dir() and p != keep)

    def release(self) -> None:
        if self.fd is not None:
            if self.remove_on_release:
                try:
                    self.path.unlink()  # while locked: a run waiting on this file sees it gone and retries
                except OSError:
                    pass
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.startswith("pid ") else "pid unknown"
