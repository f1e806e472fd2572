"""A trace recording absurd seconds (a clock in the wrong unit, a corrupted file) is refused when it is
read, naming the field and the op, instead of surfacing from the solver as "does not fit ... none
helps" or "no integral plan" (issue 21 leftovers)."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest

from conftest import REPO
from schemas import FormatError, Trace
from schemas.trace import MAX_RECORDED_SECONDS

TRACE = REPO / "traces" / "gpt-small.msgpack"


def _with(path, field: str, seconds: float) -> bytes:
    data = msgpack.unpackb(TRACE.read_bytes(), raw=False, strict_map_key=False)
    if field == "moments":
        m = next(m for m in data["moments"] if m["block"] == 1 and m["phase"] == "FORWARD")
        m["compute_seconds"] = seconds
    elif field == "blocks":
        data["blocks"][1]["forward_seconds"] = seconds
    else:
        next(a for a in data["activations"] if a["block"] == 1)["recompute_seconds"] = seconds
    payload = msgpack.packb(data, use_bin_type=True)
    path.write_bytes(payload)
    return payload


@pytest.mark.parametrize("field, where", [("moments", "compute_seconds"), ("blocks", "forward_seconds"),
                                          ("activations", "recompute_seconds")])
def test_absurd_seconds_are_refused_naming_the_field(tmp_path, field: str, where: str) -> None:
    payload = _with(tmp_path / "t.msgpack", field, 1e7)
    with pytest.raises(FormatError) as exc:
        Trace.from_msgpack(payload)
    text = str(exc.value)
    assert f"{field}[" in text and where in text and "1e+07" in text and "\n" not in text
    if field == "moments":
        assert "forward" in text and "h.1" in text  # the op: phase, kind and module
    Trace.from_msgpack(_with(tmp_path / "ok.msgpack", field, MAX_RECORDED_SECONDS))  # a long day is still a day


def test_planner_solve_names_the_field_exit_2(tmp_path) -> None:
    _with(tmp_path / "t.msgpack", "moments", 1e7)
    run = subprocess.run([sys.executable, "-m", "planner", "solve", str(tmp_path / "t.msgpack"), "--hardware", "cpu-emulated",
                          "-o", str(tmp_path / "s.msgpack")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 2, run.stderr
    assert "compute_seconds" in run.stderr and "none helps" not in run.stderr
    assert not (tmp_path / "s.msgpack").exists()
