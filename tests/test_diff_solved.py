"""`planner diff` on schedules the planner solved: less DEVICE memory moves chunks and costs time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from planner import golden
from planner.cli import main
from planner.diff import diff_files

TRACE = "traces/gpt3-1.3b.msgpack"  # transfer-bound on a 4090: less DEVICE memory costs time


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    d = tmp_path_factory.mktemp("solved")
    big, small = d / "big.msgpack", d / "small.msgpack"
    # `planner solve TRACE --hardware rtx4090-768g-12ssd` is a golden case: its committed file is that
    # command's output byte for byte (tests/test_golden.py solves it afresh and compares), so the test
    # reads it instead of solving the 1.3B model a second time in the suite
    (case,) = [c for c in golden.CASES if c.trace_path.name == Path(TRACE).name and c.hardware == "rtx4090-768g-12ssd"
               and c.device_memory_gb is None]
    shutil.copyfile(case.golden_path, big)
    assert main(["solve", TRACE, "--hardware", "rtx4090-768g-12ssd", "--device-memory-gb", "6", "-o", str(small)]) == 0
    return big, small


def test_less_device_memory_moves_chunks_and_costs_time(solved, capsys):
    d = diff_files(*solved)
    assert not d.identical
    assert any(c.name == "budget DEVICE" for c in d.inputs)
    assert d.residency.moved_chunks + d.layout.tensors_moved > 0  # chunks (or the tensors in them) moved
    device = [c for lst, tier, c in d.residency.per_list_tier if tier.value == "DEVICE" and lst.value == "PARAM"][0]
    assert device.new < device.old  # fewer PARAM chunks start on DEVICE
    assert d.prediction.iteration_seconds.new > d.prediction.iteration_seconds.old
    capsys.readouterr()
    assert main(["diff", *map(str, solved), "--fail-if-slower", "1"]) == 1
    assert "FAIL: predicted iteration time grew" in capsys.readouterr().out
    assert main(["diff", *map(str, reversed(solved)), "--fail-if-slower", "1"]) == 0


def test_solved_schedule_against_itself(solved, capsys):
    assert main(["diff", str(solved[0]), str(solved[0])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("identical: ") and out.count("\n") == 1
