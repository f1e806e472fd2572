"""`python -m executor profile -o FILE.toml`: measure this machine and write a tide.hardware TOML.

What is measured (each for a fraction of a second; the whole command takes well under 30 s):
- compute: dense matmul throughput, fp32 (and bf16 on a GPU, which becomes `compute_tflops` there:
  transformer blocks run in the compute dtype);
- DEVICE<->HOST: on a GPU, pinned host <-> device copies; on a CPU-only machine, chunk-sized
  `copy_` calls on one worker thread between two CPU buffers -- exactly what the emulated DEVICE
  does (executor/store.py);
- NVMe read/write: `executor.nvme.NvmeStore` (O_DIRECT where the filesystem allows) in a temporary
  folder under --nvme-dir, chunks written then read back;
- optimizer: torch's fused AdamW kernel, params per second, on the CPU (and on the GPU);
- host memory (sysconf), cores (the CPUs this process may use), free disk space.
On a CPU-only machine the DEVICE is emulated: its memory is --device-memory-gb (default 1.0), its
compute rate and optimizer rate are the CPU's.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from executor.errors import ExecutorError
from executor.nvme import NvmeStore, aligned_empty
from schemas.hardware import ClusterSpec, DeviceKind, DeviceSpec, Hardware, HostSpec, LinkSpec, NvmeSpec
from schemas.schedule import ChunkList

__all__ = ["measure", "register", "run"]

_MIB = 1 << 20


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


def nvme_gb_per_s(directory: Path, *, total_bytes: int, chunk_bytes: int, workers: int = 4) -> tuple[float, float, bool]:
    """(read, write) GB/s through NvmeStore, and whether it used O_DIRECT."""
    n = max(1, total_bytes // chunk_bytes)
    elements = chunk_bytes // 4
    bufs = [aligned_empty(elements, torch.float32).normal_() for _ in range(min(n, workers))]
    with NvmeStore(directory, lists={ChunkList.M: (torch.float32, [elements] * n)}, workers=workers) as store:
        start = time.perf_counter()
        for f in [store.write_async(ChunkList.M, c, bufs[c % len(bufs)]) for c in range(n)]:
            f.result()
        store.sync()
        write_s = time.perf_counter() - start
        if not store.direct_io:  # buffered: do not time the page cache
            fd = os.open(store.path(ChunkList.M), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        start = time.perf_counter()
        futures = []
        for c in range(n):
            if c >= len(bufs):
                futures[c - len(bufs)].result()  # its buffer is reused
            futures.append(store.read_async(ChunkList.M, c, bufs[c % len(bufs)]))
        for f in futures:
            f.result()
        read_s = time.perf_counter() - start
        direct = store.direct_io
    return n * chunk_bytes / read_s / 1e9, n * chunk_bytes / write_s / 1e9, direct


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
            nvme_mib: int = 256, quick: bool = False) -> tuple[Hardware, dict[str, Any]]:
    """Measure this machine; returns the Hardware and the raw figures (for printing)."""
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    cpu = torch.device("cpu")
    scale = 0.3 if quick else 1.0
    figures: dict[str, Any] = {}
    figures["cpu_fp32_tflops"] = matmul_tflops(cpu, torch.float32, n=512 if quick else 1024, seconds=0.6 * scale)
    figures["cpu_adamw_params_per_s"] = adamw_params_per_s(cpu, numel=(1 << 20) if quick else (4 << 20), seconds=0.5 * scale)
    if cuda:
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(0)
        figures["device_name"] = props.name
        figures["device_fp32_tflops"] = matmul_tflops(dev, torch.float32, n=4096, seconds=0.6 * scale)
        figures["device_bf16_tflops"] = matmul_tflops(dev, torch.bfloat16, n=8192, seconds=0.6 * scale)
        figures["device_adamw_params_per_s"] = adamw_params_per_s(dev, numel=64 << 20, seconds=0.5 * scale)
        h2d, d2h = copy_gb_per_s(cuda=True, nbytes=256 * _MIB, seconds=0.5 * scale)
        memory_gb = props.total_memory / 1e9 if device_memory_gb is None else device_memory_gb
        compute = figures["device_bf16_tflops"]
    else:
        h2d, d2h = copy_gb_per_s(cuda=False, nbytes=(16 if quick else 64) * _MIB, seconds=0.5 * scale)
        memory_gb = 1.0 if device_memory_gb is None else device_memory_gb
        compute = figures["cpu_fp32_tflops"]
    figures["h2d_gb_per_s"], figures["d2h_gb_per_s"] = h2d, d2h
    base = Path(nvme_dir) if nvme_dir else Path(tempfile.gettempdir())
    try:
        base.mkdir(parents=True, exist_ok=True)
        free_gb = shutil.disk_usage(base).free / 1e9
    except OSError as exc:
        raise ExecutorError(f"profile: cannot use --nvme-dir {base}: {exc.strerror or exc}; pass a writable directory on the SSD to measure") from None
    read, write, direct = nvme_gb_per_s(base, total_bytes=nvme_mib * _MIB, chunk_bytes=min(32, nvme_mib) * _MIB)
    figures.update(nvme_read_gb_per_s=read, nvme_write_gb_per_s=write, nvme_direct_io=direct, nvme_free_gb=free_gb)
    figures["host_memory_gb"] = _host_memory_gb()
    figures["cores"] = _cores()
    figures["seconds"] = time.perf_counter() - started

    host = socket.gethostname()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    kind = DeviceKind.CUDA if cuda else DeviceKind.CPU_EMULATED
    device_name = figures.get("device_name", f"CPU pool (emulated device) on {platform.processor() or platform.machine()}")
    description = (
        f"measured by `python -m executor profile` on {host} at {when} (torch {torch.__version__}, {figures['seconds']:.1f} s): "
        + (f"GPU {device_name}: bf16 matmul {figures['device_bf16_tflops']:.1f} TFLOPS, fp32 {figures['device_fp32_tflops']:.1f}; "
           f"pinned H2D/D2H copies; fused AdamW on GPU {figures['device_adamw_params_per_s']:.3g} params/s; " if cuda else
           f"DEVICE emulated by a {memory_gb:g} GB CPU pool: compute = fp32 matmul {compute:.3f} TFLOPS, "
           "H2D/D2H = one worker thread's copy_ between two CPU buffers; ")
        + f"CPU fused AdamW {figures['cpu_adamw_params_per_s']:.3g} params/s; NVMe through NvmeStore "
        f"({'O_DIRECT' if direct else 'buffered, page cache dropped'}) in {base}, capacity = free space there"
    )
    hw = Hardware(
        name=name or f"measured-{host}",
        description=description,
        device=DeviceSpec(kind=kind, name=device_name, memory_gb=_sig(memory_gb),
                          usable_fraction=0.9 if cuda else 1.0,  # CUDA context and fragmentation; the pool is exact
                          compute_tflops=_sig(compute),
                          optimizer_params_per_s=_sig(figures.get("device_adamw_params_per_s", figures["cpu_adamw_params_per_s"]))),
        host=HostSpec(memory_gb=_sig(figures["host_memory_gb"]),
                      usable_fraction=0.8 if cuda else 0.5,  # CPU-only: the emulated pool and the process share it
                      optimizer_params_per_s=_sig(figures["cpu_adamw_params_per_s"]), cores=int(figures["cores"])),
        nvme=NvmeSpec(count=1, capacity_gb_each=_sig(max(free_gb, 1e-3)), read_gb_per_s_each=_sig(read),
                      write_gb_per_s_each=_sig(write), usable_fraction=0.9),
        links=LinkSpec(h2d_gb_per_s=_sig(h2d), d2h_gb_per_s=_sig(d2h), inter_gpu_gb_per_s=0.0),
        cluster=ClusterSpec(world_size=1, gpus_per_node=1),
    )
    return hw, figures


def run(args: argparse.Namespace) -> int:
    if args.device_memory_gb is not None and not args.device_memory_gb > 0:
        raise ExecutorError(f"profile: --device-memory-gb must be positive, found {args.device_memory_gb}")
    hw, figures = measure(device_memory_gb=args.device_memory_gb, nvme_dir=args.nvme_dir, name=args.name,
                          quick=args.quick)
    hw.write(args.output)
    print(f"wrote {args.output} ({hw.device.kind}, {figures['seconds']:.1f} s)")
    print(f"  compute {hw.device.compute_tflops:.3f} TFLOPS, H2D {hw.links.h2d_gb_per_s:.2f} GB/s, D2H {hw.links.d2h_gb_per_s:.2f} GB/s")
    print(f"  NVMe read {hw.nvme.read_gb_per_s_each:.2f} GB/s, write {hw.nvme.write_gb_per_s_each:.2f} GB/s "
          f"({'O_DIRECT' if figures['nvme_direct_io'] else 'buffered'})")
    print(f"  AdamW CPU {hw.host.optimizer_params_per_s:.3g} params/s, device {hw.device.optimizer_params_per_s:.3g} params/s")
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
    p.set_defaults(func=run)
