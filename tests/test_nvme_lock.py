"""One run per NVMe directory (issue 21, item 5): a second store on the same directory -- in this
process or another -- is refused with one line and the first is unharmed; a crashed run's files are
recognized (no live run holds the lock) and removed, never read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from executor.errors import ExecutorError
from executor.nvme import LOCK_NAME, NvmeStore
from schemas.schedule import ChunkList

LISTS = {ChunkList.PARAM: (torch.float32, [1000, 37])}

HOLDER = textwrap.dedent("""
    import sys, time, torch
    from executor.nvme import NvmeStore
    from schemas.schedule import ChunkList
    store = NvmeStore(sys.argv[1], lists={ChunkList.PARAM: (torch.float32, [1000, 37])})
    store.write(ChunkList.PARAM, 0, torch.ones(1000))
    print(store.directory, flush=True)
    time.sleep(60)
""")


def test_a_second_store_on_the_same_directory_is_refused_and_the_first_is_unharmed(tmp_path) -> None:
    with NvmeStore(tmp_path, lists=LISTS) as first:
        first.write(ChunkList.PARAM, 0, torch.arange(1000, dtype=torch.float32))
        with pytest.raises(ExecutorError) as info:
            NvmeStore(tmp_path, lists=LISTS)
        message = str(info.value)
        assert "\n" not in message and "in use by another tide run" in message and f"pid {os.getpid()}" in message
        assert "its own nvme_dir" in message
        out = torch.empty(1000)
        first.read(ChunkList.PARAM, 0, out)
        assert torch.equal(out, torch.arange(1000, dtype=torch.float32))
        assert len(list(tmp_path.glob("tide-nvme-*"))) == 1  # the refused store made nothing
    with NvmeStore(tmp_path, lists=LISTS) as again:  # released at close
        assert again.notes == [] or not any("removed" in n for n in again.notes)


def test_another_process_is_refused_and_a_killed_ones_files_are_removed_not_read(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        their_dir = holder.stdout.readline().strip()
        assert their_dir, "the holder did not start"
        with pytest.raises(ExecutorError, match=rf"in use by another tide run \(pid {holder.pid}\)"):
            NvmeStore(tmp_path, lists=LISTS)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.isdir(their_dir)  # SIGKILL ran no cleanup: a crashed run's files
    with NvmeStore(tmp_path, lists=LISTS) as store:
        assert not os.path.exists(their_dir)
        assert any(os.path.basename(their_dir) in note for note in store.notes)
        out = torch.full((1000,), 7.0)
        store.write(ChunkList.PARAM, 0, out)
        store.read(ChunkList.PARAM, 0, out)
        assert torch.equal(out, torch.full((1000,), 7.0))
    assert (tmp_path / LOCK_NAME).exists()
