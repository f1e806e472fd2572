"""The `tide` console script (issue 20): every command listed, dispatched to `python -m planner` or
`python -m executor` in a child interpreter, so the dispatcher itself imports neither."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import HARDWARE, REPO
from executor import tide

EVERY = ["record", "solve", "show", "simulate", "compare", "maxsize", "diff", "plot", "profile", "demo", "validate"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_help_lists_every_command(capsys):
    assert tide.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.split()]
    assert sorted(listed) == sorted(EVERY)


def test_no_command_prints_usage_and_fails(capsys):
    assert tide.main([]) == 2
    assert "usage: tide" in capsys.readouterr().out


def test_unknown_command_is_one_line(capsys):
    assert tide.main(["sovle"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'sovle'" in err and err.count("\n") == 1


def test_commands_run_the_package_cli_in_a_child(tmp_path):
    done = subprocess.run([sys.executable, "-m", "executor.tide", "validate", str(HARDWARE / "cpu-emulated.toml")],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bad = subprocess.run([sys.executable, "-m", "executor.tide", "show", str(tmp_path / "missing.msgpack"), "-q"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_the_dispatcher_imports_neither_torch_nor_the_planner():
    probe = "import sys, executor.tide; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'planner'))))"
    done = subprocess.run([sys.executable, "-c", "import json; " + probe], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_progress_passes_the_childs_output_and_exit_code_through(capsys):
    child = [sys.executable, "-c", "import sys; print('out line'); print('err line', file=sys.stderr); sys.exit(3)"]
    assert tide.run_with_progress(child, "tide test") == 3
    captured = capsys.readouterr()
    assert "out line" in captured.out and "err line" in captured.err


@pytest.mark.parametrize("flag", ["--quiet", "-q"])
def test_quiet_is_tides_flag_except_for_record(monkeypatch, flag):
    calls = []
    monkeypatch.setattr(tide.subprocess, "call", lambda argv: calls.append(argv) or 0)
    assert tide.main(["solve", "t.msgpack", flag]) == 0
    assert tide.main(["profile", "-o", "x.toml", flag]) == 0
    assert tide.main(["record", "gpt-small", "-o", "t.msgpack", flag]) == 0
    assert calls[0][1:] == ["-m", "planner", "solve", "t.msgpack"]
    assert calls[1][1:] == ["-m", "executor", "profile", "-o", "x.toml"]
    assert calls[2][1:] == ["-m", "executor", "record", "gpt-small", "-o", "t.msgpack", flag]
