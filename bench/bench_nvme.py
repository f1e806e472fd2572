"""NVME tier throughput (executor.nvme.NvmeStore) next to plain sequential-file baselines, same run.

    python bench/bench_nvme.py [--dir DIR] [--total-mib 1024] [--chunk-mib 64] [--workers 4] [--rounds 3]

Page cache, honestly: the store uses O_DIRECT when the filesystem accepts it, so neither its writes
nor its reads touch the page cache. The baselines are (a) one thread, sequential, O_DIRECT, 8 MiB
blocks -- what `dd oflag=direct`/`iflag=direct` does -- and (b) one thread, sequential, buffered,
8 MiB blocks, the write timed *including* fsync and the file's cached pages dropped with
posix_fadvise(DONTNEED) before it is read back. The store is also run in buffered mode under the
same rule (sync() timed, cache dropped before reads). Each figure is the median of --rounds rounds;
the target is store >= 80% of the best baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from executor.nvme import ALIGN_BYTES, NvmeStore, _aligned_empty, _bytes_view, aligned_empty
from schemas.schedule import ChunkList

MIB = 1 << 20
BLOCK = 8 * MIB


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def baseline(directory: Path, total: int, *, direct: bool) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one sequential file, one thread, 8 MiB blocks."""
    path = directory / f"baseline-{'direct' if direct else 'buffered'}.bin"
    buf = _aligned_empty(BLOCK, pin=False).random_(0, 255)
    view = _bytes_view(buf)
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, total, BLOCK):
            os.pwrite(fd, view, off)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        if not direct:
            _drop_cache(path)
        t0 = time.perf_counter()
        for off in range(0, total, BLOCK):
            os.preadv(fd, [view], off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return total / write_s / 1e9, total / read_s / 1e9


def store_run(directory: Path, total: int, chunk_bytes: int, workers: int, *, direct: bool) -> tuple[float, float, bool]:
    n = total // chunk_bytes
    elements = chunk_bytes // 4
    # HOST chunk buffers as the engine allocates them (aligned: no staging copy), reused round-robin
    src = [aligned_empty(elements, torch.float32).normal_() for _ in range(min(n, workers * 2))]
    dst = [aligned_empty(elements, torch.float32).zero_() for _ in range(min(n, workers * 2))]
    with NvmeStore(directory, lists={ChunkList.M: (torch.float32, [elements] * n)}, workers=workers,
                   direct_io=None if direct else False) as store:
        t0 = time.perf_counter()
        futures = [store.write_async(ChunkList.M, c, src[c % len(src)]) for c in range(n)]
        for f in futures:
            f.result()
        store.sync()
        write_s = time.perf_counter() - t0
        if not store.direct_io:
            _drop_cache(store.path(ChunkList.M))
        t0 = time.perf_counter()
        # dst buffers are reused round-robin; a read waits for the one that used its buffer before
        futures = []
        for c in range(n):
            if c >= len(dst):
                futures[c - len(dst)].result()
            futures.append(store.read_async(ChunkList.M, c, dst[c % len(dst)]))
        for f in futures:
            f.result()
        read_s = time.perf_counter() - t0
        used_direct = store.direct_io
    return total / write_s / 1e9, total / read_s / 1e9, used_direct


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: the temp dir)")
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    total = args.total_mib * MIB
    chunk = args.chunk_mib * MIB
    assert total % chunk == 0 and chunk % ALIGN_BYTES == 0
    rows: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tide-bench-nvme-") as tmp:
        directory = Path(tmp)
        direct_seen = False
        for _ in range(args.rounds):
            rows.setdefault("baseline: sequential file, O_DIRECT, 1 thread", []).append(baseline(directory, total, direct=True))
            rows.setdefault("baseline: sequential file, buffered+fsync, 1 thread", []).append(baseline(directory, total, direct=False))
            w, r, direct_seen = store_run(directory, total, chunk, args.workers, direct=True)
            rows.setdefault(f"NvmeStore ({'O_DIRECT' if direct_seen else 'buffered'}, {args.workers} workers)", []).append((w, r))
            w, r, _ = store_run(directory, total, chunk, args.workers, direct=False)
            rows.setdefault(f"NvmeStore (buffered+sync, {args.workers} workers)", []).append((w, r))
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in rows.items()}
    best_w = max(v[0] for k, v in med.items() if k.startswith("baseline"))
    best_r = max(v[1] for k, v in med.items() if k.startswith("baseline"))
    print(f"NVME tier throughput: {args.total_mib} MiB per pass, {args.chunk_mib} MiB chunks, median of {args.rounds} rounds, "
          f"dir {args.dir or tempfile.gettempdir()}, torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"{'path':58} {'write GB/s':>10} {'read GB/s':>10} {'write %best':>11} {'read %best':>10}")
    for k, (w, r) in med.items():
        print(f"{k:58} {w:10.2f} {r:10.2f} {100 * w / best_w:10.0f}% {100 * r / best_r:9.0f}%")
    store_key = next(k for k in med if k.startswith("NvmeStore (O_DIRECT") or k.startswith("NvmeStore (buffered,"))
    ok = med[store_key][0] >= 0.8 * best_w and med[store_key][1] >= 0.8 * best_r
    print(f"target (store >= 80% of the best baseline, write and read): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
