"""`python -m executor demo`: record -> `python -m planner solve` -> train, end to end (the README's main job)."""

from __future__ import annotations

import os
import subprocess
import sys

from schemas import Schedule


def test_demo_records_solves_and_trains_with_offloading(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "executor", "demo", "--steps", "3", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("loss ") == 3
    assert "bytes per channel measured == predicted: True" in out
    # the HOST pool's peak, the grads a moment writes back and steps there included (the simulator's peak counts
    # between a moment's actions too: before, measured 851,968 B over the prediction)
    assert "peak HOST bytes measured == predicted: True" in out
    assert "iteration time: predicted" in out
    schedule = Schedule.read(tmp_path / "schedule.msgpack")
    assert sum(schedule.prediction.bytes_per_channel.values()) > 0  # the budget forces offloading


def test_demo_reports_a_solver_failure_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "executor", "demo", "--steps", "1", "--workdir", str(tmp_path),
                           "--device-memory-gb", "0.000001"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "planner solve" in lines[0]
