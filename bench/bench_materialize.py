"""How long `planner.materialize` takes to turn decisions into a schedule (target: < 2 s for 96 blocks).

    python bench/bench_materialize.py

The GPT-3 175B shape of the brief (96 layers, hidden 12288, 96 heads, seq 1024, batch 8) comes from
`planner.families.gpt_trace` (no file needed); every shipped trace is timed too. Decisions: chunk
size = each problem's second candidate, OS on NVME where the preset has SSDs (else HOST), CPU Adam
overlapping backward, activations swapped to NVME (HOST without SSDs), Belady with prefetch, the
largest PARAM budget the DEVICE allows. Each row: the best of 3 runs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.errors import InfeasibleError  # noqa: E402
from planner.families import gpt_trace  # noqa: E402
from planner.layout import build_layout, candidate_chunk_sizes  # noqa: E402
from planner.materialize import materialize, uniform_decisions  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from planner.problem import build_problem  # noqa: E402
from schemas import Trace  # noqa: E402
from schemas.schedule import ActivationMode, Tier  # noqa: E402
from schemas.trace import trace_digest  # noqa: E402

DIGEST = "sha256:" + "0" * 64


def time_one(label: str, trace: Trace, preset: str, digest: str = DIGEST) -> None:
    hw = resolve_hardware(preset)
    problem = build_problem(trace, hw, trace_digest=digest)
    layout = build_layout(problem, chunk_elements=candidate_chunk_sizes(problem)[1])
    ssd = hw.nvme.count > 0
    decisions = uniform_decisions(problem, layout, os_tier=Tier.NVME if ssd else Tier.HOST,
                                  activation_mode=ActivationMode.SWAP_NVME if ssd else ActivationMode.SWAP_HOST)
    best, schedule, error = float("inf"), None, ""
    for _ in range(3):
        start = time.perf_counter()
        try:
            schedule = materialize(problem, decisions)
        except InfeasibleError as exc:
            error = str(exc).split(":")[0]
        best = min(best, time.perf_counter() - start)
    blocks, chunks = len(problem.blocks), len(layout.chunks)
    if schedule is None:
        print(f"{label:<24} {preset:<20} {blocks:>6} {chunks:>7} {'-':>8} {best:>9.3f}  infeasible ({error})")
        return
    print(f"{label:<24} {preset:<20} {blocks:>6} {chunks:>7} {len(schedule.actions):>8} {best:>9.3f}  "
          f"predicted {schedule.prediction.iteration_seconds:.2f} s/iteration")


def main() -> int:
    print(f"{'trace':<24} {'hardware':<20} {'blocks':>6} {'chunks':>7} {'actions':>8} {'seconds':>9}")
    time_one("gpt_trace 96x12288 b8", gpt_trace(layers=96, hidden=12288, heads=96, seq=1024, batch=8), "a100-80g-12ssd")
    for path in sorted((REPO / "traces").glob("*.msgpack")):
        raw = path.read_bytes()
        trace = Trace.from_msgpack(raw, source=str(path))
        for preset in ("rtx4090-768g-12ssd", "a100-80g-12ssd"):
            time_one(path.stem, trace, preset, trace_digest(raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
