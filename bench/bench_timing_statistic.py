"""Which statistic the recorder prices moments with (issue 17 item 6): measured on this machine.

The recorder times `timing_iterations` (5) whole iterations and the executor bench then compares ten
training-loop iterations with that price. This bench times N plain PyTorch iterations (forward,
backward, fused AdamW: what the recorder times) back to back and replays that pairing over every
window of the sequence: a "recording" from 5 consecutive iterations, then a "bench" from the next 10.
For each pairing of statistics it prints bench / recording over the windows (median, range, and the
share of windows outside 0.95-1.05): the pairing whose ratio sits at 1.00 with the least spread is the
one that lets measured / predicted speak about the executor and the prices rather than the statistic.

    python bench/bench_timing_statistic.py                        # gpt2-124m, batch 4, seq 256, 40 iterations
    python bench/bench_timing_statistic.py --model gpt-small --iterations 200

Timings on a shared machine are noisy: report the load (`uptime`) beside the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from executor.models import build_model, make_batch, model_spec
from executor.recorder import typical_seconds

RECORD_RUNS = 5  # executor.record's default timing_iterations
BENCH_RUNS = 10  # bench/bench_executor.py --offload-iters 10 (the check line)

STATISTICS = {
    "fastest": min,
    "median": statistics.median,
    "20%-trimmed mean": typical_seconds,
    "mean": statistics.fmean,
}
# (recording's statistic, bench's statistic): session 4 paired the fastest run with a median
PAIRINGS = [("fastest", "median"), ("median", "median"), ("20%-trimmed mean", "20%-trimmed mean"), ("mean", "mean")]


def pairing_rows(times: list[float]) -> list[tuple[str, str]]:
    """bench / recording over every window (5 recorded runs, then 10 bench runs) of `times`."""
    rows = []
    windows = range(len(times) - RECORD_RUNS - BENCH_RUNS + 1)
    for rec_stat, bench_stat in PAIRINGS:
        ratios = [STATISTICS[bench_stat](times[i + RECORD_RUNS:i + RECORD_RUNS + BENCH_RUNS])
                  / STATISTICS[rec_stat](times[i:i + RECORD_RUNS]) for i in windows]
        if not ratios:
            continue
        outside = sum(not 0.95 <= r <= 1.05 for r in ratios) / len(ratios)
        rows.append((f"bench {bench_stat} / recording {rec_stat} ({len(ratios)} windows)",
                     f"median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}, "
                     f"{outside:.0%} outside 0.95-1.05"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=40, help="timed plain PyTorch iterations (>= 15)")
    args = ap.parse_args()
    if args.iterations < RECORD_RUNS + BENCH_RUNS:
        ap.error(f"--iterations: at least {RECORD_RUNS + BENCH_RUNS}")
    torch.manual_seed(0)
    spec = model_spec(args.model, batch=args.batch, seq=args.seq)
    model, batch = build_model(spec), make_batch(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> float:
        start = time.perf_counter()
        model(**batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for _ in range(2):  # warm-up, as the recorder's warm-up and instrumented runs
        step()
    times = [step() for _ in range(args.iterations)]
    print(f"model {args.model}, batch {args.batch}, seq {args.seq}, {torch.get_num_threads()} threads, "
          f"{args.iterations} iterations: " + " ".join(f"{t:.3f}" for t in times))
    rows = [(f"whole sample: {name} s", f"{fn(times):.4f}") for name, fn in STATISTICS.items()]
    rows.append(("whole sample: mean / median", f"{statistics.fmean(times) / statistics.median(times):.3f}"))
    rows.append(("whole sample: median / fastest", f"{statistics.median(times) / min(times):.3f}"))
    rows += pairing_rows(times)
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
