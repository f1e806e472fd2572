"""Fuzz every reader and CLI with >= 3000 mutated files per format (issue 21, item 6); prints the counts.

    PYTHONPATH=. python bench/bench_fuzz.py [--cases 3000] [--seed 0] [--format F ...]

The mutators, readers and limits (one line, exit 2, <= 2 s per read, bounded allocation) are in
tests/fuzz.py; a failing case replays with `python tests/fuzz.py --format F --seed S --case I`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fuzz import ALLOC_FACTOR, FORMATS, MAX_SECONDS, fuzz  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", nargs="*", choices=FORMATS, default=list(FORMATS))
    args = parser.parse_args()
    failed = 0
    for fmt in args.format:
        start = time.perf_counter()
        outcome = fuzz(fmt, seed=args.seed, cases=args.cases)
        seconds = time.perf_counter() - start
        print(f"{fmt}: {args.cases} mutated files, seed {args.seed}, {seconds:.0f} s; slowest read "
              f"{outcome.slowest_seconds:.3f} s (limit {MAX_SECONDS} s); worst allocation "
              f"{100 * outcome.worst_alloc_ratio:.1f}% of {ALLOC_FACTOR} x file + constant", flush=True)
        for key, count in sorted(outcome.counts.items()):
            print(f"  {key:40s} {count}")
        print(f"  failures: {len(outcome.failures)}")
        for failure in outcome.failures[:20]:
            print("  FAIL", failure)
        failed += len(outcome.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
