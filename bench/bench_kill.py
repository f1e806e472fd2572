"""200 SIGKILLs of a training loop with HOST and NVMe offload; every resume must reach bit-identical
checkpoints (issue 21, item 4). The harness and what it checks: tests/kill_harness.py.

    PYTHONPATH=. python bench/bench_kill.py [--kills 200] [--seed 0] [--workdir DIR]

Prints one line per kill and the figures (kills per kind, resumes, failed resumes, checkpoints
compared, mismatches, stale temp files or NVMe folders left); exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from kill_harness import run_chain  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir")
    args = parser.parse_args()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tide-bench-kill-"))
    figures = run_chain(workdir, kills=args.kills, seed=args.seed, log=lambda line: print(line, flush=True))
    print(json.dumps(figures, indent=2))
    return 0 if not figures["failures"] and not figures["stale_tmp_left"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
