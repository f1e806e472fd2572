"""Comm-group collectives on this machine: seconds and per-rank GB/s of ALL_GATHER and REDUCE_SCATTER.

    python bench/bench_distributed.py [--ranks 2] [--repeats 20]

Relaunches itself under `python -m torch.distributed.run --standalone` (gloo on CPU, NCCL when every
rank has a GPU) and times `executor.collectives.CommGroupCollectives` on synthetic comm groups of
several chunk sizes, in both buffer forms (one contiguous group buffer / a list of chunk buffers).
Bytes are the schedule's per-rank convention: (world_size - 1) x chunk capacity bytes per call.
Numbers are one run on a shared machine: compare rows, not machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHUNK_ELEMENTS = (1 << 16, 1 << 20, 1 << 22)  # 256 KiB .. 16 MiB chunks in fp32


def _worker(repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from executor.collectives import CommGroupCollectives
    from schemas.schedule import Chunk, ChunkLayout, ChunkList
    from schemas.trace import DType

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    rows = []
    for elements in CHUNK_ELEMENTS:
        chunks = tuple(Chunk(id=i, elements=elements, used_elements=elements, block=-1, comm_group=i // ws, owner_rank=i % ws)
                       for i in range(ws))
        layout = ChunkLayout(chunk_elements=elements, lists=(ChunkList.PARAM, ChunkList.GRAD),
                             list_dtypes={ChunkList.PARAM: DType.FLOAT32, ChunkList.GRAD: DType.FLOAT32},
                             chunks=chunks, tensors=())
        coll = CommGroupCollectives(layout)
        shard = torch.randn(elements, device=device)
        full = torch.empty(ws * elements, device=device)
        parts = [torch.empty(elements, device=device) for _ in range(ws)]
        for op, form in (("ALL_GATHER", "contiguous"), ("ALL_GATHER", "chunk list"),
                         ("REDUCE_SCATTER", "contiguous"), ("REDUCE_SCATTER", "chunk list")):
            buffers = full if form == "contiguous" else parts
            seconds = []
            for i in range(repeats + 2):
                dist.barrier()
                if use_cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if op == "ALL_GATHER":
                    coll.all_gather(ChunkList.PARAM, 0, shard, buffers).wait()
                    coll.release(ChunkList.PARAM, 0)
                else:
                    coll.reduce_scatter(ChunkList.GRAD, 0, buffers, shard).wait()
                    coll.release(ChunkList.GRAD, 0)
                if use_cuda:
                    torch.cuda.synchronize()
                if i >= 2:  # warm-up: connections, allocator
                    seconds.append(time.perf_counter() - start)
            nbytes = coll.collective_bytes(ChunkList.PARAM, 0)
            median = statistics.median(seconds)
            rows.append((op, form, elements * 4 / 2**20, nbytes, median, nbytes / median / 1e9))
    if rank == 0:
        print(f"backend {dist.get_backend()}, world_size {ws}, {repeats} repeats, median seconds per call")
        print(f"{'op':<15} {'form':<11} {'chunk MiB':>9} {'bytes/rank':>12} {'seconds':>10} {'GB/s/rank':>10}")
        for op, form, mib, nbytes, sec, rate in rows:
            print(f"{op:<15} {form:<11} {mib:>9.2f} {nbytes:>12,} {sec:>10.5f} {rate:>10.2f}")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        _worker(args.repeats)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           __file__, "--repeats", str(args.repeats)]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}).returncode


if __name__ == "__main__":
    raise SystemExit(main())
