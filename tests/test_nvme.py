"""executor.nvme: chunk lists on files -- round trips, clear errors that lose nothing, cleanup."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from executor.errors import ExecutorError
from executor.nvme import ALIGN_BYTES, LOCK_NAME, NvmeStore, aligned_empty
from schemas.schedule import ChunkList

LISTS = {
    ChunkList.PARAM: (torch.bfloat16, [1000, 1000, 37]),  # odd sizes: slots are padded to 4 KiB
    ChunkList.M: (torch.float32, [1000, 1000, 37]),
    ChunkList.V: (torch.float32, [1000, 1000, 37]),
}


def _random(lst: ChunkList, chunk: int, seed: int) -> torch.Tensor:
    dtype, elements = LISTS[lst]
    return torch.randn(elements[chunk], generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("direct_io", [None, False])
def test_round_trip_of_random_chunks_across_lists(tmp_path, direct_io) -> None:
    with NvmeStore(tmp_path, lists=LISTS, workers=3, direct_io=direct_io) as store:
        if direct_io is False:
            assert not store.direct_io
        files = [store.path(lst) for lst in LISTS]
        assert all(f.stat().st_size % ALIGN_BYTES == 0 and f.stat().st_size >= 3 * ALIGN_BYTES for f in files)
        data = {(lst, c): _random(lst, c, seed=i) for i, (lst, c) in enumerate((l, c) for l in LISTS for c in range(3))}
        data[(ChunkList.M, 0)] = aligned_empty(1000, torch.float32).copy_(data[(ChunkList.M, 0)])  # zero-copy write
        futures = [store.write_async(lst, c, t) for (lst, c), t in data.items()]
        for f in futures:
            f.result()
        # rewrite one chunk (dirty), then a read queued right behind it sees the new bytes
        newer = _random(ChunkList.M, 1, seed=99)
        store.write_async(ChunkList.M, 1, newer)
        out = torch.empty(1000)
        store.read_async(ChunkList.M, 1, out).result()
        assert torch.equal(out, newer)
        data[(ChunkList.M, 1)] = newer
        # half the destinations aligned (zero-copy path), half not (staging path)
        outs = {k: (aligned_empty(v.numel(), v.dtype) if i % 2 else torch.empty_like(v)) for i, (k, v) in enumerate(data.items())}
        for f in [store.read_async(lst, c, outs[(lst, c)]) for (lst, c) in data]:
            f.result()
        for k, v in data.items():
            assert torch.equal(outs[k], v), k
        assert store.bytes_written == sum(v.numel() * v.element_size() for v in data.values()) + newer.numel() * 4
    assert not any(f.exists() for f in files) and not store.directory.exists()  # removed on exit


def test_bad_arguments_and_closed_store(tmp_path) -> None:
    store = NvmeStore(tmp_path, lists=LISTS, workers=1)
    with pytest.raises(ValueError, match="contiguous torch.float32 tensor of 1000 elements"):
        store.write(ChunkList.M, 0, torch.zeros(999))
    with pytest.raises(ValueError, match="chunks 0..2"):
        store.write(ChunkList.M, 3, torch.zeros(1000))
    with pytest.raises(ValueError, match="no chunk list MASTER"):
        store.write(ChunkList.MASTER, 0, torch.zeros(1000))
    store.close()
    store.close()  # idempotent
    with pytest.raises(ExecutorError, match="closed"):
        store.write(ChunkList.M, 0, torch.zeros(1000))


def test_disk_full_mid_training_is_clear_and_loses_nothing(tmp_path, monkeypatch) -> None:
    with NvmeStore(tmp_path, lists=LISTS, workers=2) as store:
        src = _random(ChunkList.M, 0, seed=1)
        keep = src.clone()
        store.write(ChunkList.M, 1, _random(ChunkList.M, 1, seed=2))

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(ExecutorError, match=r"disk full.*m\.bin, M chunk 0 at byte 0.*free space") as info:
            store.write(ChunkList.M, 0, src)
        assert "\n" not in str(info.value)
        assert torch.equal(src, keep)  # the in-memory chunk is intact
        with pytest.raises(ExecutorError, match="M chunk 0 .* is lost"):  # never serve stale bytes
            store.read(ChunkList.M, 0, torch.empty(1000))
        monkeypatch.undo()
        store.write(ChunkList.M, 0, src)  # after the fix the chunk is written and readable again
        out = torch.empty(1000)
        store.read(ChunkList.M, 0, out)
        assert torch.equal(out, keep)


def test_preallocation_beyond_a_file_size_limit_fails_before_training(tmp_path) -> None:
    # A real kernel error instead of a mock: RLIMIT_FSIZE makes fallocate fail like a full disk would.
    code = textwrap.dedent(f"""
        import resource, signal, torch
        from executor.nvme import NvmeStore
        from executor.errors import ExecutorError
        from schemas.schedule import ChunkList
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            NvmeStore({str(tmp_path)!r}, lists={{ChunkList.M: (torch.float32, [1 << 20] * 4)}})
        except ExecutorError as exc:
            print("ERR", exc)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERR NVME tier:" in run.stdout, run.stdout + run.stderr
    assert "m.bin" in run.stdout and ("size limit" in run.stdout or "disk full" in run.stdout)
    # nothing left behind but the (empty-of-data) lock file: removing it would race with the next run's open
    assert [p.name for p in tmp_path.iterdir()] in ([], [LOCK_NAME])


def test_read_only_directory_is_a_clear_error(tmp_path, monkeypatch) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.geteuid() == 0:  # root ignores directory permissions: make the kernel's answer explicit
            real_mkdir = os.mkdir

            def denied(path, *args, **kwargs):
                if str(path).startswith(str(ro)):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
                return real_mkdir(path, *args, **kwargs)

            monkeypatch.setattr(os, "mkdir", denied)
        with pytest.raises(ExecutorError, match=r"permission denied.*ro/tide-nvme-.*writable"):
            NvmeStore(ro, lists=LISTS)
    finally:
        os.chmod(ro, 0o700)


def test_filesystem_turning_read_only_mid_training(tmp_path, monkeypatch) -> None:
    with NvmeStore(tmp_path, lists=LISTS, workers=1) as store:
        src = _random(ChunkList.PARAM, 2, seed=3)
        keep = src.clone()

        def erofs(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        monkeypatch.setattr(os, "pwrite", erofs)
        with pytest.raises(ExecutorError, match="permission denied .*PARAM chunk 2"):
            store.write_async(ChunkList.PARAM, 2, src).result()
        assert torch.equal(src, keep)


def test_short_read_leaves_destination_unchanged(tmp_path) -> None:
    with NvmeStore(tmp_path, lists=LISTS, workers=1) as store:
        store.write(ChunkList.V, 2, _random(ChunkList.V, 2, seed=4))
        os.truncate(store.path(ChunkList.V), 2 * ALIGN_BYTES)  # someone cut the file: chunk 2 is gone
        dst = torch.full((37,), 5.0)
        with pytest.raises(ExecutorError, match=r"short read of V chunk 2 .*v\.bin"):
            store.read(ChunkList.V, 2, dst, keep_on_error=True)
        assert torch.equal(dst, torch.full((37,), 5.0))
        with pytest.raises(ExecutorError, match=r"short read of V chunk 2"):  # zero-copy path: same error
            store.read(ChunkList.V, 2, aligned_empty(37, torch.float32))


def test_files_removed_when_store_is_dropped(tmp_path) -> None:
    store = NvmeStore(tmp_path, lists=LISTS)
    directory = store.directory
    assert directory.exists()
    del store
    import gc

    gc.collect()
    assert not directory.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_go_through_pinned_staging(tmp_path) -> None:
    with NvmeStore(tmp_path, lists=LISTS, workers=2) as store:
        assert store.pinned
        src = _random(ChunkList.M, 0, seed=5).cuda()
        store.write(ChunkList.M, 0, src)
        dst = torch.empty(1000, device="cuda")
        store.read(ChunkList.M, 0, dst)
        assert torch.equal(dst, src)


def test_slots_only_for_chunks_the_schedule_puts_on_nvme(tmp_path) -> None:
    from schemas.schedule import Action, Channel, Chunk, ChunkLayout, Op, Residency, Tier
    from schemas.trace import DType

    layout = ChunkLayout(chunk_elements=1024, lists=(ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V),
                         list_dtypes={ChunkList.PARAM: DType.BFLOAT16, ChunkList.GRAD: DType.BFLOAT16,
                                      ChunkList.M: DType.FLOAT32, ChunkList.V: DType.FLOAT32},
                         chunks=tuple(Chunk(id=i, elements=1024, used_elements=1000, block=i, comm_group=i, owner_rank=0)
                                      for i in range(3)), tensors=())
    residency = [Residency(list=ChunkList.M, chunk=1, tiers=(Tier.NVME,)), Residency(list=ChunkList.V, chunk=0, tiers=(Tier.HOST,))]
    actions = [Action(moment=3, op=Op.WRITE_BACK, list=ChunkList.PARAM, chunk=2, src=Tier.HOST, dst=Tier.NVME,
                      channel=Channel.NVME_WRITE, bytes=2048)]
    from executor.nvme import nvme_lists

    lists = nvme_lists(layout, residency, actions)
    assert lists == {ChunkList.M: (torch.float32, [0, 1024, 0]), ChunkList.PARAM: (torch.bfloat16, [0, 0, 1024])}
    with NvmeStore(tmp_path, lists=lists, workers=1) as store:
        assert store.file_bytes == 4096 + 4096  # M chunk 1 (4 KiB), PARAM chunk 2 (2 KiB padded to a 4 KiB slot)
        with pytest.raises(ValueError, match="M chunk 0 has no slot on NVME"):
            store.write(ChunkList.M, 0, torch.zeros(0))


def test_transfer_waits_for_its_dependencies(tmp_path) -> None:
    import threading
    from concurrent.futures import Future

    with NvmeStore(tmp_path, lists=LISTS, workers=2) as store:
        src = torch.zeros(1000)
        filled: Future = Future()
        gate = threading.Event()

        def fill() -> None:  # stands for a DEVICE->HOST copy still writing src
            gate.wait(5)
            src.fill_(3.0)
            filled.set_result(None)

        threading.Thread(target=fill).start()
        written = store.write_async(ChunkList.M, 0, src, after=[filled])
        assert not written.done()
        gate.set()
        written.result()
        out = torch.empty(1000)
        store.read(ChunkList.M, 0, out)
        assert torch.equal(out, torch.full((1000,), 3.0))
        failed: Future = Future()
        failed.set_exception(RuntimeError("the copy into src failed"))
        with pytest.raises(RuntimeError, match="copy into src failed"):
            store.write_async(ChunkList.M, 1, src, after=[failed]).result()


def test_aligned_buffers_need_no_full_size_staging(tmp_path) -> None:
    lists = {ChunkList.M: (torch.float32, [1 << 18] * 2)}  # 1 MiB chunks
    with NvmeStore(tmp_path, lists=lists, workers=2) as store:
        src = aligned_empty(1 << 18, torch.float32).normal_()
        store.write(ChunkList.M, 0, src)
        dst = aligned_empty(1 << 18, torch.float32)
        store.read(ChunkList.M, 0, dst)
        assert torch.equal(src, dst)
        assert store.staging_bytes <= 2 * ALIGN_BYTES  # zero-copy: no chunk-sized staging was made
        store.read(ChunkList.M, 0, torch.empty(1 << 18), keep_on_error=True)
        assert store.staging_bytes >= 1 << 20  # the staged path made one chunk-sized buffer
