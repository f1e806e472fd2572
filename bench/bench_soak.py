"""Soak: N iterations of the small GPT with HOST and NVMe offload; nothing may grow (issue 21, item 7).

    PYTHONPATH=. python bench/bench_soak.py [--iterations 2000] [--sample-every 20] [--warmup 100]

The schedule is the kill harness's (tests/kill_harness.py: the executor tests' small GPT, PARAM
homes on HOST/NVME, OS of even chunks on NVME, CPU Adam overlapped with backward). Every iteration
the bytes the engine moved per channel must equal the schedule's prediction (EngineStats.bytes_match);
every `--sample-every` iterations it samples RSS, open file descriptors, threads and the bytes on
disk under nvme_dir, and prints the least-squares slope of each after the warm-up (per 1000
iterations) with the first and last sample.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _disk_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512  # allocated, not apparent
            except FileNotFoundError:
                pass
    return total


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--sample-every", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    import executor
    from kill_harness import write_schedule
    from schemas import Schedule
    from test_executor import LR, WD, gpt_batches
    from test_executor_planner import gpt_model

    work = Path(tempfile.mkdtemp(prefix="tide-soak-"))
    write_schedule(work / "schedule.msgpack")
    schedule = Schedule.read(work / "schedule.msgpack")
    nvme = work / "nvme"
    nvme.mkdir()
    model = gpt_model()
    batches = gpt_batches(64)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=nvme)
    series: dict[str, list[float]] = {"rss_bytes": [], "open_fds": [], "threads": [], "disk_bytes": []}
    xs: list[float] = []
    mismatches = 0
    start = time.perf_counter()
    for i in range(args.iterations):
        b = batches[i % len(batches)]
        model(b, b).backward()
        engine.step()
        if not engine.stats().bytes_match(schedule):
            mismatches += 1
            if mismatches <= 3:
                print(f"iteration {i}: bytes {engine.stats().bytes_per_channel} != prediction "
                      f"{schedule.prediction.bytes_per_channel}", flush=True)
        if (i + 1) % args.sample_every == 0:
            xs.append(i + 1)
            series["rss_bytes"].append(_rss_bytes())
            series["open_fds"].append(len(os.listdir("/proc/self/fd")))
            series["threads"].append(threading.active_count())
            series["disk_bytes"].append(_disk_bytes(nvme))
        if (i + 1) % 500 == 0:
            print(f"  {i + 1} iterations, {time.perf_counter() - start:.0f} s, rss {_rss_bytes() / 1e6:.1f} MB", flush=True)
    seconds = time.perf_counter() - start
    engine.detach()
    keep = [k for k, x in enumerate(xs) if x > args.warmup]
    print(f"soak: {args.iterations} iterations in {seconds:.0f} s ({os.cpu_count()} cores, shared: timings noisy); "
          f"bytes per iteration == prediction: {args.iterations - mismatches}/{args.iterations}")
    print(f"{'series':12s} {'first':>14s} {'last':>14s} {'slope per 1000 it':>20s}   (after {args.warmup} warm-up iterations)")
    for name, ys in series.items():
        sel_x, sel_y = [xs[k] for k in keep], [ys[k] for k in keep]
        slope = _slope(sel_x, sel_y) * 1000
        first, last = (sel_y[0], sel_y[-1]) if sel_y else (0, 0)
        print(f"{name:12s} {first:14,.0f} {last:14,.0f} {slope:20,.1f}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
