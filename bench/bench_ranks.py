"""The rank ladder alone (issue 18 item 4): `bench/bench_solve.py`'s rank ladder, tide and the best
multi-GPU baseline on 1, 2, 4, 8, 16 ranks (one rank on one node, r >= 2 on 2 nodes of r/2 GPUs).

    python bench/bench_ranks.py [--trace traces/pstar-gpt-4b.msgpack] [--ranks 1,2,4,8,16]
                                [--hardware v100-32g-240g-2x8gpu] [--jobs N]

Columns: those of bench/bench_solve.py (wall and CPU seconds of the solve, simulated seconds, the
header's bound, the true gap, the MIP's gap, the winner), then the best baseline and its seconds over
tide's (> 1: tide faster). Each solve runs with `--jobs` jobs (default: the CPUs this process may use, as
`planner solve`). CPU timings on a shared machine: noisy, ratios from one run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_solve import rank_ladder  # noqa: E402
from planner.replays import available_cpus  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(REPO / "traces" / "pstar-gpt-4b.msgpack"))
    parser.add_argument("--ranks", default="1,2,4,8,16")
    parser.add_argument("--hardware", default="v100-32g-240g-2x8gpu")
    parser.add_argument("--jobs", type=int, default=available_cpus(), help="jobs per solve, as `planner solve --jobs`")
    args = parser.parse_args()
    rank_ladder(args.ranks, args.trace, args.hardware, jobs=args.jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
