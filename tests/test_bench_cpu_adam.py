"""bench/bench_cpu_adam.py runs: the executor's own HOST step, fp32 and mixed precision, against the
kernel the planner prices (a tiny block here; the figures are in bench/RESULTS.md)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import bench_cpu_adam  # noqa: E402


def test_bench_times_the_priced_kernel_and_both_precisions(capsys):
    assert bench_cpu_adam.main(["--n-embd", "64", "--reps", "1", "--threads", "1"]) == 0
    rows = re.findall(r"^  (.+?)\s+([0-9.e+]+) params/s\s+([0-9.]+)x the priced time$", capsys.readouterr().out, re.M)
    assert [r[0].split(",")[0] for r in rows] == ["fused AdamW"] + ["ChunkAdamW.step_chunk"] * 3
    assert all(float(rate) > 0 for _, rate, _ in rows) and float(rows[0][2]) == 1.0
