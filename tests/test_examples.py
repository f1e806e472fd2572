"""examples/finetune_hf.py runs end to end (issue 20): record, profile, solve, fine-tune with
TideTrainer, resume from the half-way checkpoint to the same parameters, save and reload."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("transformers")


def test_finetune_hf_example_runs_and_resumes_to_the_same_parameters(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "finetune_hf.py"), "--steps", "4", "--quick",
                           "--profile", "--workdir", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "same step-4 parameters: True" in done.stdout
    assert "from_pretrained gives them back: True" in done.stdout
    assert (tmp_path / "my.toml").is_file() and (tmp_path / "schedule.msgpack").is_file()
