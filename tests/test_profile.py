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
    # the measured prices the planner reads: shape tables, Adam vs threads at chunk size (alone and beside
    # copy/SSD traffic), DRAM, pageable and both-ways copies, mixed SSD traffic
    assert hw.device.matmul_rates and all(r.tflops > 0 for r in hw.device.matmul_rates)
    assert hw.device.attention_rates and all(r.forward_tflops > 0 and r.backward_tflops > 0 for r in hw.device.attention_rates)
    assert [r.threads for r in hw.host.adam_rates][-1] == hw.host.cores and hw.host.adam_rates[0].threads == 1
    assert all(r.params_per_s > 0 and r.params_per_s_with_copies > 0 and r.mixed_precision_params_per_s > 0 for r in hw.host.adam_rates)
    assert hw.host.adam_chunk_params == 4_000_000  # --quick's chunk
    for value in (hw.host.dram_gb_per_s, hw.links.h2d_pageable_gb_per_s, hw.links.d2h_pageable_gb_per_s,
                  hw.links.duplex_h2d_gb_per_s, hw.links.duplex_d2h_gb_per_s, hw.nvme.mixed_read_gb_per_s_each,
                  hw.nvme.mixed_write_gb_per_s_each):
        assert value > 0
    # the same rates by copy size (issue 17: what a chunk's copy is priced at): --quick's 1 and 16 MiB
    # copies (and the flat figures' own size), SSD reads/writes of 1 MiB and the flat 32 MiB
    sizes = [r.chunk_bytes >> 20 for r in hw.links.copy_rates]
    assert sizes == sorted(sizes) and {1, 16} <= set(sizes)
    assert all(r.h2d_gb_per_s > 0 and r.d2h_gb_per_s > 0 and r.duplex_h2d_gb_per_s > 0 for r in hw.links.copy_rates)
    assert [r.chunk_bytes >> 20 for r in hw.nvme.chunk_rates] == [1, 32]
    assert all(r.read_gb_per_s_each > 0 and r.mixed_write_gb_per_s_each > 0 for r in hw.nvme.chunk_rates)
    assert "measured by `python -m executor profile`" in hw.description
    # the NVMe probe cleaned up; only the directory lock stays (executor/nvme.py: removing it would race a next run)
    assert [p.name for p in (tmp_path / "ssd").iterdir()] in ([], ["tide-nvme.lock"])
    assert "wrote" in capsys.readouterr().out


def test_profile_bad_chunk_is_one_line_exit_2(tmp_path) -> None:
    run = subprocess.run([sys.executable, "-m", "executor", "profile", "-o", str(tmp_path / "x.toml"), "--adam-chunk-mparams", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "--adam-chunk-mparams must be positive" in run.stderr


def test_profile_bad_argument_is_one_line_exit_2(tmp_path) -> None:
    run = subprocess.run([sys.executable, "-m", "executor", "profile", "-o", str(tmp_path / "x.toml"), "--device-memory-gb", "0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "--device-memory-gb must be positive" in run.stderr
    assert not (tmp_path / "x.toml").exists()
