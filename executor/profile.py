"""`python -m executor profile -o FILE.toml`: measure this machine and write a tide.hardware TOML.

What is measured (each for a fraction of a second; the default run takes about a minute on a
2-core machine, `--quick` a few seconds):
- compute: dense matmul throughput (fp32, and bf16 on a GPU, which becomes `compute_tflops` there:
  transformer blocks run in the compute dtype), and a sweep over transformer-shaped GEMMs
  (tokens x hidden -> 3*hidden / 4*hidden ...) and causal SDPA attention shapes (forward and
  backward), timed with CUDA events on a GPU: `device.matmul_rates`, `device.attention_rates`;
- DEVICE<->HOST: on a GPU, pinned and pageable host <-> device copies each way, and pinned both ways
  at once (two streams); on a CPU-only machine, chunk-sized `copy_` calls on a worker thread
  between two CPU buffers -- exactly what the emulated DEVICE does (executor/store.py) -- and two
  such workers at once for "both ways"; all of it again at a few copy sizes (1, 4, 16, 64 MiB;
  1 and 16 with --quick): `links.copy_rates`, what the planner prices a copy of a chunk at;
- host DRAM bandwidth: a multi-threaded copy of a buffer far larger than the caches (bytes read +
  written per second);
- CPU Adam: torch's fused AdamW kernel on one chunk-sized tensor (`--adam-chunk-mparams`, default 16M
  params; 4M with --quick) at 1, 2, 4 ... cores threads, alone and while a memcpy thread and an SSD
  writer run beside it (the DRAM contention a training step sees), and the executor's own
  mixed-precision step (`ChunkAdamW.step_chunk`, bf16 PARAM/GRAD + fp32 MASTER) alone: `host.adam_rates`;
- NVMe read/write alone and mixed (reads and writes at once): `executor.nvme.NvmeStore` (O_DIRECT
  where the filesystem allows) in a temporary folder under --nvme-dir, and again at a few read/write
  sizes (1, 4 MiB; 1 with --quick): `nvme.chunk_rates`;
- optimizer on the GPU: fused AdamW params per second;
- host memory (sysconf), cores (the CPUs this process may use), free disk space.
On a CPU-only machine the DEVICE is emulated: its memory is --device-memory-gb (default 1.0), its
compute rate and optimizer rate are the CPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from executor.errors import ExecutorError
from executor.nvme import NvmeStore, aligned_empty
from schemas import atomic_write_bytes
from schemas.hardware import (
    AdamRate,
    AttentionRate,
    ClusterSpec,
    CopyRate,
    DeviceKind,
    DeviceSpec,
    Hardware,
    HostSpec,
    LinkSpec,
    MatmulRate,
    NvmeSpec,
    SsdRate,
)
from executor.optim import ChunkAdamW
from schemas.schedule import Chunk, ChunkLayout, ChunkList, TensorSlot
from schemas.trace import DType

__all__ = ["measure", "prices_measured_now", "register", "run"]

_MIB = 1 << 20
# copy sizes of the by-size tables: a chunk of tide's layouts is a few MiB to a few tens (planner.layout
# candidates); the flat figures are measured at 256 MiB (GPU) / 16-64 MiB (emulated) and 32 MiB (SSDs)
COPY_SIZES_MIB = (1, 4, 16, 64)
COPY_SIZES_MIB_QUICK = (1, 16)
SSD_SIZES_MIB = (1, 4)
SSD_SIZES_MIB_QUICK = (1,)
_COPY_COLUMNS = ("h2d_gb_per_s", "d2h_gb_per_s", "h2d_pageable_gb_per_s", "d2h_pageable_gb_per_s",
                 "duplex_h2d_gb_per_s", "duplex_d2h_gb_per_s")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _timed(fn, *, seconds: float, sync=lambda: None, min_reps: int = 2) -> float:
    """Seconds per call of fn: one warm-up, then repeat until `seconds` have passed."""
    fn()
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        if reps >= min_reps and time.perf_counter() - start >= seconds:
            break
    sync()
    return (time.perf_counter() - start) / reps


def matmul_tflops(device: torch.device, dtype: torch.dtype, *, n: int, seconds: float = 0.6) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_call = _timed(lambda: torch.mm(a, b), seconds=seconds, sync=sync)
    return 2 * n**3 / per_call / 1e12


def copy_gb_per_s(*, cuda: bool, nbytes: int, seconds: float = 0.5) -> tuple[float, float]:
    """(h2d, d2h) GB/s."""
    if cuda:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        sync = torch.cuda.synchronize
        h2d = _timed(lambda: dev.copy_(host, non_blocking=True), seconds=seconds, sync=sync)
        d2h = _timed(lambda: host.copy_(dev, non_blocking=True), seconds=seconds, sync=sync)
        return nbytes / h2d / 1e9, nbytes / d2h / 1e9
    # the emulated DEVICE: one worker thread doing copy_ between two CPU buffers
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    with ThreadPoolExecutor(max_workers=1) as worker:
        there = _timed(lambda: worker.submit(b.copy_, a).result(), seconds=seconds)
        back = _timed(lambda: worker.submit(a.copy_, b).result(), seconds=seconds)
    return nbytes / there / 1e9, nbytes / back / 1e9


def adamw_params_per_s(device: torch.device, *, numel: int, seconds: float = 0.5) -> float:
    p, g, m, v = (torch.randn(numel, device=device) for _ in range(4))
    v.abs_()
    step = torch.ones((), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one() -> None:
        torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, maximize=False)

    return numel / _timed(one, seconds=seconds, sync=sync)


def mixed_step_params_per_s(*, numel: int, seconds: float = 0.5) -> float:
    """The executor's own mixed-precision CPU step (`ChunkAdamW.step_chunk` with a bf16 PARAM and GRAD and
    an fp32 MASTER: the grad cast, the fused kernel, the copy back, in tiles; Note [mixed-precision CPU
    steps in tiles]) over one chunk of `numel` params: what a mixed-precision plan's HOST steps cost."""
    layout = ChunkLayout(
        chunk_elements=numel, lists=(ChunkList.PARAM, ChunkList.GRAD, ChunkList.MASTER, ChunkList.M, ChunkList.V),
        list_dtypes={ChunkList.PARAM: DType.BFLOAT16, ChunkList.GRAD: DType.BFLOAT16, ChunkList.MASTER: DType.FLOAT32,
                     ChunkList.M: DType.FLOAT32, ChunkList.V: DType.FLOAT32},
        chunks=(Chunk(id=0, elements=numel, used_elements=numel, block=0, comm_group=0, owner_rank=0),),
        tensors=(TensorSlot(tensor=0, names=("w",), shape=(numel,), chunk=0, offset_elements=0, numel=numel, trainable=True),))
    weight = torch.nn.Parameter(torch.empty(numel, dtype=torch.bfloat16))
    optimizer = ChunkAdamW([("w", weight)], layout, lr=1e-4)
    master, m, v = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    param, grad = master.to(torch.bfloat16), torch.randn(numel).to(torch.bfloat16)
    return numel / _timed(lambda: optimizer.step_chunk(0, param=param, grad=grad, master=master, exp_avg=m, exp_avg_sq=v),
                          seconds=seconds)


def _cuda_timed(fn, *, seconds: float, min_reps: int = 3) -> float:
    """Seconds per call of fn on the current CUDA stream, timed with CUDA events (one warm-up)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps, wall = 0, time.perf_counter()
    start.record()
    while True:
        fn()
        reps += 1
        if reps >= min_reps and time.perf_counter() - wall >= seconds:
            break
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def matmul_sweep(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int]], *,
                 seconds: float) -> list[dict[str, Any]]:
    """TFLOPS of (m x k) @ (k x n) for each shape (2*m*n*k FLOP per call)."""
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        if device.type == "cuda":
            per_call = _cuda_timed(lambda: torch.mm(a, b), seconds=seconds)
        else:
            per_call = _timed(lambda: torch.mm(a, b), seconds=seconds)
        rows.append({"dtype": _DTYPE_NAMES[dtype], "m": m, "n": n, "k": k, "tflops": 2 * m * n * k / per_call / 1e12})
    return rows


def attention_sweep(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int, int]], *,
                    seconds: float) -> list[dict[str, Any]]:
    """Forward and backward TFLOPS of causal `F.scaled_dot_product_attention` for each (batch, heads,
    tokens, head_dim), FLOPs counted as torch.utils.flop_counter counts SDPA (4*b*h*t^2*d forward,
    8*b*h*t^2*d backward: the figures a recorded trace carries)."""

    rows = []
    for b, h, t, d in shapes:
        q, k, v = (torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        timed = _cuda_timed if device.type == "cuda" else _timed

        def fwd() -> torch.Tensor:
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        fwd_s = timed(fwd, seconds=seconds)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn_like(out)
        both_s = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad),
                       seconds=seconds)
        flops = 4 * b * h * t * t * d
        rows.append({"dtype": _DTYPE_NAMES[dtype], "batch": b, "heads": h, "tokens": t, "head_dim": d,
                     "forward_tflops": flops / fwd_s / 1e12,
                     "backward_tflops": 2 * flops / max(both_s - fwd_s, 1e-9) / 1e12})
    return rows


def dram_gb_per_s(*, nbytes: int, threads: int, seconds: float) -> float:
    """Host DRAM bandwidth: a `threads`-way parallel copy between two buffers far larger than the
    caches; each byte is read once and written once, so 2*nbytes move per copy."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per_call = _timed(lambda: b.copy_(a), seconds=seconds)
    finally:
        torch.set_num_threads(before)
    return 2 * nbytes / per_call / 1e9


class _Load:
    """DRAM traffic beside the CPU Adam probe: a thread copying a large buffer (one core of memcpy,
    numpy releases the GIL) and, with a directory, a thread writing chunks through the NVMe store."""

    def __init__(self, *, nbytes: int, nvme_dir: Path | None) -> None:


        self._stop = threading.Event()
        src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
        self._threads = [threading.Thread(target=self._copy, args=(src, dst), daemon=True)]
        self._nvme_dir = nvme_dir
        if nvme_dir is not None:
            self._threads.append(threading.Thread(target=self._ssd, daemon=True))

    def _copy(self, src: Any, dst: Any) -> None:

        while not self._stop.is_set():
            np.copyto(dst, src)

    def _ssd(self) -> None:
        elements = (8 * _MIB) // 4
        buf = aligned_empty(elements, torch.float32).fill_(1.0)
        with tempfile.TemporaryDirectory(dir=self._nvme_dir) as tmp, \
                NvmeStore(tmp, lists={ChunkList.M: (torch.float32, [elements] * 4)}, workers=1) as store:
            c = 0
            while not self._stop.is_set():
                store.write(ChunkList.M, c % 4, buf)
                c += 1

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def adam_thread_sweep(*, numel: int, thread_counts: list[int], seconds: float, load_bytes: int,
                      nvme_dir: Path | None) -> list[dict[str, Any]]:
    """CPU fused AdamW params/s on one `numel` tensor at each thread count, alone and with `_Load`, and the
    executor's mixed-precision step alone (`mixed_step_params_per_s`)."""
    before = torch.get_num_threads()
    rows = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            alone = adamw_params_per_s(torch.device("cpu"), numel=numel, seconds=seconds)
            with _Load(nbytes=load_bytes, nvme_dir=nvme_dir):
                loaded = adamw_params_per_s(torch.device("cpu"), numel=numel, seconds=seconds)
            mixed = mixed_step_params_per_s(numel=numel, seconds=seconds)
            rows.append({"threads": threads, "params_per_s": alone, "params_per_s_with_copies": loaded,
                         "mixed_precision_params_per_s": mixed})
    finally:
        torch.set_num_threads(before)
    return rows


def _thread_counts(cores: int) -> list[int]:
    counts, t = [], 1
    while t < cores:
        counts.append(t)
        t *= 2
    return counts + [cores]


def cuda_copy_rates(*, nbytes: int, seconds: float) -> dict[str, float]:
    """Pinned and pageable H2D / D2H GB/s each way alone, and pinned both ways at once (two streams)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    rates = {
        "h2d_gb_per_s": nbytes / _cuda_timed(lambda: dev.copy_(pinned, non_blocking=True), seconds=seconds) / 1e9,
        "d2h_gb_per_s": nbytes / _cuda_timed(lambda: pinned.copy_(dev, non_blocking=True), seconds=seconds) / 1e9,
        # a pageable copy is staged through a pinned bounce buffer by the driver and is synchronous
        "h2d_pageable_gb_per_s": nbytes / _timed(lambda: dev.copy_(pageable), seconds=seconds, sync=torch.cuda.synchronize) / 1e9,
        "d2h_pageable_gb_per_s": nbytes / _timed(lambda: pageable.copy_(dev), seconds=seconds, sync=torch.cuda.synchronize) / 1e9,
    }
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    reps = max(3, int(seconds * rates["h2d_gb_per_s"] * 1e9 / nbytes))
    events = {name: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for name in ("up", "down")}
    torch.cuda.synchronize()
    for name, stream, (dst, src) in (("up", up, (dev2, pinned2)), ("down", down, (pinned, dev))):
        with torch.cuda.stream(stream):
            events[name][0].record(stream)
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            events[name][1].record(stream)
    torch.cuda.synchronize()
    rates["duplex_h2d_gb_per_s"] = reps * nbytes / (events["up"][0].elapsed_time(events["up"][1]) / 1e3) / 1e9
    rates["duplex_d2h_gb_per_s"] = reps * nbytes / (events["down"][0].elapsed_time(events["down"][1]) / 1e3) / 1e9
    return rates


def emulated_copy_rates(*, nbytes: int, seconds: float) -> dict[str, float]:
    """The emulated DEVICE: one worker thread's `copy_` between two CPU buffers each way; "both ways"
    is two workers at once (what the store's H2D and D2H workers do). Pinned and pageable are the
    same memory here."""
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    c, d = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    with ThreadPoolExecutor(max_workers=2) as pool:
        there = _timed(lambda: pool.submit(b.copy_, a).result(), seconds=seconds)
        back = _timed(lambda: pool.submit(a.copy_, b).result(), seconds=seconds)

        def both() -> None:
            f1, f2 = pool.submit(b.copy_, a), pool.submit(c.copy_, d)
            f1.result()
            f2.result()

        both_s = _timed(both, seconds=seconds)
    h2d, d2h = nbytes / there / 1e9, nbytes / back / 1e9
    return {"h2d_gb_per_s": h2d, "d2h_gb_per_s": d2h, "h2d_pageable_gb_per_s": h2d, "d2h_pageable_gb_per_s": d2h,
            "duplex_h2d_gb_per_s": nbytes / both_s / 1e9, "duplex_d2h_gb_per_s": nbytes / both_s / 1e9}


def nvme_gb_per_s(directory: Path, *, total_bytes: int, chunk_bytes: int, workers: int = 4) -> dict[str, Any]:
    """Read and write GB/s through NvmeStore alone, then mixed (the first half of the chunks read back
    while the second half is rewritten, at once), and whether it used O_DIRECT."""
    n = max(2, total_bytes // chunk_bytes)
    elements = chunk_bytes // 4
    bufs = [aligned_empty(elements, torch.float32).normal_() for _ in range(min(n, workers))]

    def drop_cache(store: NvmeStore) -> None:
        if not store.direct_io:  # buffered: do not time the page cache
            fd = os.open(store.path(ChunkList.M), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def run(ops: list[tuple[str, int]]) -> float:
        """Seconds for the (verb, chunk) ops, at most len(bufs) in flight (a buffer is reused once its op is done)."""
        start = time.perf_counter()
        futures: list[Any] = []
        for i, (verb, c) in enumerate(ops):
            if i >= len(bufs):
                futures[i - len(bufs)].result()
            buf = bufs[i % len(bufs)]
            futures.append(store.write_async(ChunkList.M, c, buf) if verb == "w" else store.read_async(ChunkList.M, c, buf))
        for f in futures:
            f.result()
        store.sync()
        return time.perf_counter() - start

    with NvmeStore(directory, lists={ChunkList.M: (torch.float32, [elements] * n)}, workers=workers) as store:
        write_s = run([("w", c) for c in range(n)])
        drop_cache(store)
        read_s = run([("r", c) for c in range(n)])
        drop_cache(store)
        half = n // 2
        mixed_s = run([op for c in range(half) for op in (("r", c), ("w", half + c))])
        direct = store.direct_io
    return {"read": n * chunk_bytes / read_s / 1e9, "write": n * chunk_bytes / write_s / 1e9,
            "mixed_read": half * chunk_bytes / mixed_s / 1e9, "mixed_write": half * chunk_bytes / mixed_s / 1e9,
            "direct": direct}


def prices_measured_now(hardware: Hardware, *, seconds: float = 0.05, nvme_dir: str | None = None) -> Hardware:
    """`hardware` with the prices that drift with the machine's load measured again, now, in about a
    second: the DEVICE <-> HOST copy rates (the flat fields and every row of `links.copy_rates`, each at
    its own copy size; the flat fields are the largest row's, as `measure` writes them) and the CPU Adam
    rates (`host.adam_rates` at `host.adam_chunk_params`, alone and beside memcpy + SSD writes). The
    same probes as `measure`, each timed for `seconds` instead of 0.1-0.5 s: bench/bench_executor.py
    calls it between the iterations it predicts (issue 17 item 6), so the prediction is priced on the
    machine those iterations ran on. Everything else (compute, SSDs, DRAM, memory) is `hardware`'s."""
    cuda = hardware.device.kind is DeviceKind.CUDA
    if cuda and not torch.cuda.is_available():
        raise ExecutorError(f"profile: hardware {hardware.name!r} is a CUDA profile but this process sees no GPU; "
                            "measure again on the machine it describes")
    probe = (lambda nbytes: cuda_copy_rates(nbytes=nbytes, seconds=seconds)) if cuda else \
        (lambda nbytes: emulated_copy_rates(nbytes=nbytes, seconds=seconds))
    sizes = sorted({r.chunk_bytes for r in hardware.links.copy_rates}) or [64 * _MIB]
    rates = {nbytes: probe(nbytes) for nbytes in sizes}
    flat = rates[sizes[-1]]
    links = dataclasses.replace(
        hardware.links, **{k: _sig(flat[k]) for k in _COPY_COLUMNS},
        copy_rates=tuple(CopyRate(chunk_bytes=n, **{k: _sig(r[k]) for k in _COPY_COLUMNS}) for n, r in rates.items())
        if hardware.links.copy_rates else ())
    host = hardware.host
    if host.adam_rates and host.adam_chunk_params:
        rows = adam_thread_sweep(numel=host.adam_chunk_params, thread_counts=[r.threads for r in host.adam_rates],
                                 seconds=seconds, load_bytes=128 * _MIB,
                                 nvme_dir=Path(nvme_dir) if nvme_dir else Path(tempfile.gettempdir()))
        host = dataclasses.replace(host, adam_rates=tuple(_adam_rate(r) for r in rows))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return dataclasses.replace(hardware, links=links, host=host,
                               description=f"{hardware.description}; copy and CPU Adam rates measured again at {when}")


def _adam_rate(row: dict[str, Any]) -> AdamRate:
    return AdamRate(threads=row["threads"], params_per_s=_sig(row["params_per_s"]),
                    params_per_s_with_copies=_sig(row["params_per_s_with_copies"]),
                    mixed_precision_params_per_s=_sig(row["mixed_precision_params_per_s"]))


def _sig(x: float, digits: int = 4) -> float:
    """Round to `digits` significant digits: the TOML is read by people, and the last digits are noise."""
    return float(f"{x:.{digits - 1}e}")


def _host_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure(*, device_memory_gb: float | None = None, nvme_dir: str | None = None, name: str | None = None,
            nvme_mib: int = 256, quick: bool = False, adam_chunk_mparams: float | None = None) -> tuple[Hardware, dict[str, Any]]:
    """Measure this machine; returns the Hardware and the raw figures (for printing)."""
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    cpu = torch.device("cpu")
    scale = 0.3 if quick else 1.0
    cores = _cores()
    figures: dict[str, Any] = {"cores": cores}
    base = Path(nvme_dir) if nvme_dir else Path(tempfile.gettempdir())
    try:
        base.mkdir(parents=True, exist_ok=True)
        free_gb = shutil.disk_usage(base).free / 1e9
    except OSError as exc:
        raise ExecutorError(f"profile: cannot use --nvme-dir {base}: {exc.strerror or exc}; pass a writable directory on the SSD to measure") from None

    figures["cpu_fp32_tflops"] = matmul_tflops(cpu, torch.float32, n=512 if quick else 1024, seconds=0.6 * scale)
    figures["cpu_adamw_params_per_s"] = adamw_params_per_s(cpu, numel=(1 << 20) if quick else (4 << 20), seconds=0.5 * scale)
    # CPU Adam at chunk size vs threads, alone and beside memcpy + SSD traffic (findings 2026-11-23: a
    # 4M-param tensor runs at 2.35e9 params/s, one 50M-param chunk at 1.14e9 on the 2-core CI machine)
    chunk = int((adam_chunk_mparams if adam_chunk_mparams is not None else (4 if quick else 16)) * 1e6)
    figures["adam_chunk_params"] = chunk
    figures["adam_rates"] = adam_thread_sweep(numel=chunk, thread_counts=_thread_counts(cores), seconds=0.5 * scale,
                                              load_bytes=(32 if quick else 128) * _MIB, nvme_dir=base)
    figures["dram_gb_per_s"] = dram_gb_per_s(nbytes=(64 if quick else 256) * _MIB, threads=cores, seconds=0.5 * scale)
    if cuda:
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(0)
        figures["device_name"] = props.name
        figures["device_fp32_tflops"] = matmul_tflops(dev, torch.float32, n=4096, seconds=0.6 * scale)
        figures["device_bf16_tflops"] = matmul_tflops(dev, torch.bfloat16, n=8192, seconds=0.6 * scale)
        figures["device_adamw_params_per_s"] = adamw_params_per_s(dev, numel=64 << 20, seconds=0.5 * scale)
        # transformer GEMMs at tokens = batch*seq rows: QKV (h -> 3h), MLP up (h -> 4h), down (4h -> h)
        tokens = [1024, 4096] if quick else [512, 2048, 8192, 32768]
        hiddens = [2048] if quick else [1024, 2048, 4096, 8192]
        shapes = sorted({(t, f * h, h) for t in tokens for h in hiddens for f in (3, 4)} | {(t, h, 4 * h) for t in tokens for h in hiddens})
        figures["matmul_rates"] = matmul_sweep(dev, torch.bfloat16, shapes, seconds=0.1 * scale)
        att = [(1, 16, 1024, 128)] if quick else [(b, 16, t, d) for b in (1, 8) for t in (512, 1024, 2048, 4096) for d in (64, 128)]
        figures["attention_rates"] = attention_sweep(dev, torch.bfloat16, att, seconds=0.1 * scale)
        figures.update(cuda_copy_rates(nbytes=256 * _MIB, seconds=0.5 * scale))
        flat_copy_mib = 256
        figures["copy_rates"] = {mib: cuda_copy_rates(nbytes=mib * _MIB, seconds=0.1 * scale)
                                 for mib in (COPY_SIZES_MIB_QUICK if quick else COPY_SIZES_MIB)}
        torch.cuda.empty_cache()  # what the sweeps left in the caching allocator is not the context
        free_b, total_b = torch.cuda.mem_get_info()
        figures["cuda_context_gb"] = max(0, total_b - free_b - torch.cuda.memory_reserved()) / 1e9
        memory_gb = props.total_memory / 1e9 if device_memory_gb is None else device_memory_gb
        compute = figures["device_bf16_tflops"]
    else:
        shapes = [(256, 768, 256), (512, 1536, 512)] if quick else \
            [(256, 3 * 256, 256), (1024, 4 * 512, 512), (2048, 3 * 768, 768), (2048, 4 * 1024, 1024), (4096, 1024, 4096)]
        figures["matmul_rates"] = matmul_sweep(cpu, torch.float32, shapes, seconds=0.3 * scale)
        att = [(1, 4, 256, 32)] if quick else [(1, 4, 256, 32), (4, 8, 512, 64), (2, 16, 1024, 64)]
        figures["attention_rates"] = attention_sweep(cpu, torch.float32, att, seconds=0.3 * scale)
        flat_copy_mib = 16 if quick else 64
        figures.update(emulated_copy_rates(nbytes=flat_copy_mib * _MIB, seconds=0.5 * scale))
        figures["copy_rates"] = {mib: emulated_copy_rates(nbytes=mib * _MIB, seconds=0.1 * scale)
                                 for mib in (COPY_SIZES_MIB_QUICK if quick else COPY_SIZES_MIB) if mib != flat_copy_mib}
        memory_gb = 1.0 if device_memory_gb is None else device_memory_gb
        compute = figures["cpu_fp32_tflops"]
    figures["copy_rates"][flat_copy_mib] = {k: figures[k] for k in _COPY_COLUMNS}  # the flat figures' own size
    ssd_mib = min(32, nvme_mib)
    nvme = nvme_gb_per_s(base, total_bytes=nvme_mib * _MIB, chunk_bytes=ssd_mib * _MIB)
    figures["ssd_rates"] = {mib: nvme_gb_per_s(base, total_bytes=max(4 * mib, 16 if quick else 64) * _MIB, chunk_bytes=mib * _MIB)
                            for mib in (SSD_SIZES_MIB_QUICK if quick else SSD_SIZES_MIB) if mib < ssd_mib}
    figures["ssd_rates"][ssd_mib] = nvme
    figures.update(nvme_read_gb_per_s=nvme["read"], nvme_write_gb_per_s=nvme["write"], nvme_mixed_read_gb_per_s=nvme["mixed_read"],
                   nvme_mixed_write_gb_per_s=nvme["mixed_write"], nvme_direct_io=nvme["direct"], nvme_free_gb=free_gb)
    figures["host_memory_gb"] = _host_memory_gb()
    figures["seconds"] = time.perf_counter() - started

    host = socket.gethostname()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    kind = DeviceKind.CUDA if cuda else DeviceKind.CPU_EMULATED
    device_name = figures.get("device_name", f"CPU pool (emulated device) on {platform.processor() or platform.machine()}")
    direct = nvme["direct"]
    # the allocator margin: on a GPU, what the CUDA context already holds plus 2% of the memory for
    # fragmentation (a tide estimate: PatrickStar §8.2 keeps a "margin" of the same kind, unsized);
    # the emulated pool is allocated exactly, so none
    margin_gb = min(figures["cuda_context_gb"] + 0.02 * memory_gb, 0.5 * 0.9 * memory_gb) if cuda else 0.0
    description = (
        f"measured by `python -m executor profile` on {host} at {when} (torch {torch.__version__}, {figures['seconds']:.1f} s): "
        + (f"GPU {device_name}: bf16 matmul {figures['device_bf16_tflops']:.1f} TFLOPS, fp32 {figures['device_fp32_tflops']:.1f}; "
           f"pinned/pageable H2D/D2H copies, both ways on two streams; fused AdamW on GPU {figures['device_adamw_params_per_s']:.3g} params/s; "
           "memory margin = CUDA context + 2% (tide estimate); " if cuda else
           f"DEVICE emulated by a {memory_gb:g} GB CPU pool: compute = fp32 matmul {compute:.3f} TFLOPS, "
           "H2D/D2H = one worker thread's copy_ between two CPU buffers (pinned = pageable), both ways = two workers; ")
        + f"CPU fused AdamW {figures['cpu_adamw_params_per_s']:.3g} params/s on 4M params, "
        f"adam_rates on one {chunk / 1e6:g}M-param chunk alone / beside a memcpy thread and an SSD writer / the executor's bf16 step alone; "
        f"DRAM = {cores}-thread copy; NVMe through NvmeStore "
        f"({'O_DIRECT' if direct else 'buffered, page cache dropped'}) in {base}, capacity = free space there, no host cap measured (one directory)"
    )
    hw = Hardware(
        name=name or f"measured-{host}",
        description=description,
        device=DeviceSpec(kind=kind, name=device_name, memory_gb=_sig(memory_gb),
                          usable_fraction=0.9 if cuda else 1.0,  # CUDA context and fragmentation; the pool is exact
                          compute_tflops=_sig(compute),
                          optimizer_params_per_s=_sig(figures.get("device_adamw_params_per_s", figures["cpu_adamw_params_per_s"])),
                          memory_margin_gb=_sig(margin_gb) if margin_gb else 0.0,
                          matmul_rates=tuple(MatmulRate(dtype=DType(r["dtype"]), m=r["m"], n=r["n"], k=r["k"], tflops=_sig(r["tflops"]))
                                             for r in figures["matmul_rates"]),
                          attention_rates=tuple(AttentionRate(dtype=DType(r["dtype"]), batch=r["batch"], heads=r["heads"], tokens=r["tokens"],
                                                              head_dim=r["head_dim"], forward_tflops=_sig(r["forward_tflops"]),
                                                              backward_tflops=_sig(r["backward_tflops"]))
                                                for r in figures["attention_rates"])),
        host=HostSpec(memory_gb=_sig(figures["host_memory_gb"]),
                      usable_fraction=0.8 if cuda else 0.5,  # CPU-only: the emulated pool and the process share it
                      optimizer_params_per_s=_sig(figures["cpu_adamw_params_per_s"]), cores=int(cores),
                      dram_gb_per_s=_sig(figures["dram_gb_per_s"]), adam_chunk_params=chunk,
                      adam_rates=tuple(_adam_rate(r) for r in figures["adam_rates"])),
        nvme=NvmeSpec(count=1, capacity_gb_each=_sig(max(free_gb, 1e-3)), read_gb_per_s_each=_sig(nvme["read"]),
                      write_gb_per_s_each=_sig(nvme["write"]), usable_fraction=0.9,
                      mixed_read_gb_per_s_each=_sig(nvme["mixed_read"]), mixed_write_gb_per_s_each=_sig(nvme["mixed_write"]),
                      chunk_rates=tuple(SsdRate(chunk_bytes=mib * _MIB, read_gb_per_s_each=_sig(r["read"]),
                                                write_gb_per_s_each=_sig(r["write"]), mixed_read_gb_per_s_each=_sig(r["mixed_read"]),
                                                mixed_write_gb_per_s_each=_sig(r["mixed_write"]))
                                        for mib, r in sorted(figures["ssd_rates"].items()))),
        links=LinkSpec(h2d_gb_per_s=_sig(figures["h2d_gb_per_s"]), d2h_gb_per_s=_sig(figures["d2h_gb_per_s"]), inter_gpu_gb_per_s=0.0,
                       h2d_pageable_gb_per_s=_sig(figures["h2d_pageable_gb_per_s"]),
                       d2h_pageable_gb_per_s=_sig(figures["d2h_pageable_gb_per_s"]),
                       duplex_h2d_gb_per_s=_sig(figures["duplex_h2d_gb_per_s"]),
                       duplex_d2h_gb_per_s=_sig(figures["duplex_d2h_gb_per_s"]),
                       copy_rates=tuple(CopyRate(chunk_bytes=mib * _MIB, **{k: _sig(r[k]) for k in _COPY_COLUMNS})
                                        for mib, r in sorted(figures["copy_rates"].items()))),
        cluster=ClusterSpec(world_size=1, gpus_per_node=1),
    )
    return hw, figures


def run(args: argparse.Namespace) -> int:
    if args.device_memory_gb is not None and not args.device_memory_gb > 0:
        raise ExecutorError(f"profile: --device-memory-gb must be positive, found {args.device_memory_gb}")
    if args.adam_chunk_mparams is not None and not args.adam_chunk_mparams > 0:
        raise ExecutorError(f"profile: --adam-chunk-mparams must be positive, found {args.adam_chunk_mparams}")
    hw, figures = measure(device_memory_gb=args.device_memory_gb, nvme_dir=args.nvme_dir, name=args.name,
                          quick=args.quick, adam_chunk_mparams=args.adam_chunk_mparams)
    text = hw.to_toml()
    if hw.device.memory_margin_gb:  # its 2% share has no source: `validate` and `show` list it
        text = re.sub(r"^(memory_margin_gb = \S+)$", r"\1  # tide estimate: the CUDA context, measured, + 2% of the "
                      "memory for the allocator's fragmentation", text, count=1, flags=re.M)
    atomic_write_bytes(args.output, text.encode("utf-8"))
    print(f"wrote {args.output} ({hw.device.kind}, {figures['seconds']:.1f} s)")
    print(f"  compute {hw.device.compute_tflops:.3f} TFLOPS, H2D {hw.links.h2d_gb_per_s:.2f} GB/s, D2H {hw.links.d2h_gb_per_s:.2f} GB/s")
    print(f"  pageable H2D {hw.links.h2d_pageable_gb_per_s:.2f} GB/s, D2H {hw.links.d2h_pageable_gb_per_s:.2f} GB/s; both ways at once "
          f"H2D {hw.links.duplex_h2d_gb_per_s:.2f} + D2H {hw.links.duplex_d2h_gb_per_s:.2f} GB/s")
    print(f"  NVMe read {hw.nvme.read_gb_per_s_each:.2f} GB/s, write {hw.nvme.write_gb_per_s_each:.2f} GB/s, mixed "
          f"{hw.nvme.mixed_read_gb_per_s_each:.2f} + {hw.nvme.mixed_write_gb_per_s_each:.2f} GB/s "
          f"({'O_DIRECT' if figures['nvme_direct_io'] else 'buffered'})")
    for r in hw.links.copy_rates:
        print(f"  copies of {r.chunk_bytes / _MIB:g} MiB: H2D {r.h2d_gb_per_s:.2f} GB/s, D2H {r.d2h_gb_per_s:.2f}, pageable "
              f"{r.h2d_pageable_gb_per_s:.2f} / {r.d2h_pageable_gb_per_s:.2f}, both ways {r.duplex_h2d_gb_per_s:.2f} + "
              f"{r.duplex_d2h_gb_per_s:.2f}")
    for r in hw.nvme.chunk_rates:
        print(f"  SSD reads/writes of {r.chunk_bytes / _MIB:g} MiB: read {r.read_gb_per_s_each:.2f} GB/s, write "
              f"{r.write_gb_per_s_each:.2f}, mixed {r.mixed_read_gb_per_s_each:.2f} + {r.mixed_write_gb_per_s_each:.2f}")
    print(f"  host DRAM {hw.host.dram_gb_per_s:.2f} GB/s ({hw.host.cores}-thread copy, read + write)")
    print(f"  AdamW CPU {hw.host.optimizer_params_per_s:.3g} params/s (4M params), device {hw.device.optimizer_params_per_s:.3g} params/s")
    for r in hw.host.adam_rates:
        print(f"  AdamW CPU on a {hw.host.adam_chunk_params / 1e6:g}M chunk, {r.threads} threads: {r.params_per_s:.3g} params/s alone, "
              f"{r.params_per_s_with_copies:.3g} beside memcpy + SSD writes; the executor's bf16 mixed-precision step "
              f"{r.mixed_precision_params_per_s:.3g} alone")
    for r in hw.device.matmul_rates:
        print(f"  matmul {r.dtype.value} {r.m}x{r.k} @ {r.k}x{r.n}: {r.tflops:.3g} TFLOPS")
    for r in hw.device.attention_rates:
        print(f"  SDPA {r.dtype.value} b={r.batch} h={r.heads} t={r.tokens} d={r.head_dim}: {r.forward_tflops:.3g} TFLOPS fwd, "
              f"{r.backward_tflops:.3g} bwd")
    print(f"  host {hw.host.memory_gb:.1f} GB, {hw.host.cores} cores, device {hw.device.memory_gb:g} GB")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="measure this machine and write a hardware TOML",
                              description=__doc__.split("\n")[0])
    p.add_argument("-o", "--output", required=True, help="the hardware TOML to write (e.g. hw.toml)")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="DEVICE memory in GB (default: the GPU's memory; 1.0 for the emulated DEVICE on a CPU-only machine)")
    p.add_argument("--nvme-dir", default=None, help="a directory on the SSD to measure (default: the temp dir)")
    p.add_argument("--name", default=None, help="profile name (default: measured-HOSTNAME)")
    p.add_argument("--quick", action="store_true", help="shorter, smaller measurements (tests)")
    p.add_argument("--adam-chunk-mparams", type=float, default=None,
                   help="CPU Adam chunk size in millions of fp32 params (default 16; 4 with --quick)")
    p.set_defaults(func=run)
