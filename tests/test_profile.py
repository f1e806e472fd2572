"""`python -m executor profile` writes a hardware TOML that schemas accept, with measured numbers."""

from __future__ import annotations

import subprocess
import sys

import torch

from executor.cli import main
from schemas.hardware import DeviceKind, Hardware


def test_profile_writes_a_valid_measured_hardware_file(tmp_path, capsys) -> None:
    out = tmp_path / "hw.toml"
    rc = main(["profile", "-o", str(out), "--quick", "--device-memory-gb", "2.5", "--nvme-dir", str(tmp_path / "ssd"),
               "--name", "ci-box"])
    assert rc == 0
    hw = Hardware.read(out)
    assert hw.name == "ci-box"
    assert hw.device.kind == (DeviceKind.CUDA if torch.cuda.is_available() else DeviceKind.CPU_EMULATED)
    if not torch.cuda.is_available():
        assert hw.device.memory_gb == 2.5
    for value in (hw.device.compute_tflops, hw.device.optimizer_params_per_s, hw.host.memory_gb, hw.host.optimizer_params_per_s,
                  hw.nvme.read_gb_per_s_each, hw.nvme.write_gb_per_s_each, hw.nvme.capacity_gb_each,
                  hw.links.h2d_gb_per_s, hw.links.d2h_gb_per_s):
        assert value > 0
    assert hw.host.cores >= 1 and hw.nvme.count == 1
    assert "measured by `python -m executor profile`" in hw.description
    assert list((tmp_path / "ssd").iterdir()) == []  # the NVMe probe cleaned up
    assert "wrote" in capsys.readouterr().out


def test_profile_bad_argument_is_one_line_exit_2(tmp_path) -> None:
    run = subprocess.run([sys.executable, "-m", "executor", "profile", "-o", str(tmp_path / "x.toml"), "--device-memory-gb", "0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "--device-memory-gb must be positive" in run.stderr
    assert not (tmp_path / "x.toml").exists()
