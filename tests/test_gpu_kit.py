"""The GPU kit (bench/gpu, issue 19) does not rot between GPU sessions: its dry run passes on the
CPU, and the pieces that turn a device run into figures (wheel list, overlap, checks) are right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.gpu import kit, runners  # noqa: E402


def test_dry_run_writes_json_and_summary_with_every_gpu_step_skipped(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(["bash", str(REPO / "bench/gpu/run.sh"), "--dry", "--part", "all"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu.json").read_text())
    steps = doc["steps"]
    assert doc["dry"] is True
    for name in ("env", "wheels", "imports", "configs"):
        assert steps[name]["status"] == "ok", (name, steps[name])
    gpu = [n for n in steps if n not in ("env", "wheels", "imports", "configs")]
    assert {"profile", "pytest-cuda", "record-gpt-1.3b", "record-gpt-6.7b", *(r.name for r in kit.RUNS)} <= set(gpu)
    assert all(steps[n]["status"] == "skipped-dry" for n in gpu)
    # the workloads really need offloading at their budgets (16 bytes per param of model data)
    assert steps["configs"]["gpt-1.3b"]["model_data_bytes"] > 16e9
    assert steps["configs"]["gpt-6.7b"]["model_data_bytes"] > 40e9
    summary = (tmp_path / "summary.md").read_text()
    assert "| tide-1.3b-16gb | skipped-dry |" in summary and (tmp_path / "kit.log").exists()


def test_wheel_check_names_a_missing_package(tmp_path, monkeypatch):
    lines = [line for line in kit.WHEELS_TXT.read_text().splitlines() if not line.startswith("pydantic==")]
    (tmp_path / "wheels.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(kit, "WHEELS_TXT", tmp_path / "wheels.txt")
    monkeypatch.setattr(kit, "WHL_DIR", tmp_path / "absent")
    with pytest.raises(RuntimeError, match="pydantic: needed on the device"):
        kit.step_wheels(None)
    (tmp_path / "wheels.txt").write_text("ortools==1 wheel\nortools==2 wheel\n")
    with pytest.raises(ValueError, match="listed twice"):
        kit.read_wheels_txt()


def test_copy_time_hidden_under_kernels():
    copies = [(0.0, 10.0), (20.0, 30.0)]
    kernels = [(5.0, 8.0), (7.0, 12.0), (25.0, 40.0)]  # overlapping kernels count once
    assert runners._hidden_share(copies, kernels) == pytest.approx((5.0 + 5.0) / 20.0)
    assert runners._hidden_share([], kernels) is None
    assert runners._hidden_share(copies, []) == 0.0


def test_checks_compare_tide_with_each_baseline():
    ok = {"status": "ok"}
    results = {
        "pytest-cuda": {"status": "ok"},
        "tide-1.3b-16gb": {**ok, "iteration_seconds": 1.0, "measured_over_predicted": 1.1, "bytes_match": True,
                           "peak_within_budget": True},
        "ds-offload-1.3b": {**ok, "iteration_seconds": 1.5},
        "ds-infinity-1.3b": {**ok, "iteration_seconds": 1.5},
        "tide-1.3b-fits": {**ok, "iteration_seconds": 0.5, "measured_over_predicted": 1.3},
        "plain-1.3b": {**ok, "iteration_seconds": 0.49},
    }
    got = kit.checks(results)
    assert got["cuda_suite_green"] is True
    offload = got["tide-1.3b-16gb"]
    assert offload["within_15_percent"] and offload["speedup_vs_ds-offload"] == pytest.approx(1.5)
    assert offload["meets_ds-offload"] and not offload["meets_ds-infinity"]  # 1.5x < 2x
    assert "speedup_vs_plain" not in offload  # plain PyTorch is the bar only where everything fits
    fits = got["tide-1.3b-fits"]
    assert fits["meets_plain"] and not fits["within_15_percent"] and "meets_ds-offload" not in fits


def test_a_failing_step_is_recorded_and_the_next_one_runs(tmp_path):
    def boom(_):
        raise RuntimeError("no such op")

    k = kit.Kit(out=tmp_path, dry=False, part="a", hardware=None, budget_seconds=60, work=tmp_path, nvme_dir=tmp_path)
    kit.execute(k, [kit.Step("first", 5, boom, gpu=False), kit.Step("second", 5, lambda _: {"x": 1}, gpu=False),
                    kit.Step("third", 5, lambda _: {}, gpu=False, needs=("first",))])
    doc = json.loads((tmp_path / "gpu.json").read_text())["steps"]
    assert doc["first"]["status"] == "failed" and "no such op" in doc["first"]["error"]
    assert doc["second"] == {**doc["second"], "status": "ok", "x": 1}
    assert doc["third"]["status"] == "skipped" and "first" in doc["third"]["reason"]


def test_runners_smoke_on_the_cpu(tmp_path, one_torch_thread):
    """record -> tide -> plain of bench/gpu/runners.py on a tiny GPT on the CPU: the code a GPU
    session runs for real goes through once in CI (the DeepSpeed runs need DeepSpeed and a GPU)."""
    common = ["--workload", "tiny", "--device", "cpu", "--workdir", str(tmp_path / "w")]
    assert runners.main(["record", *common, "--out", str(tmp_path), "--timing-iterations", "1",
                         "--result", str(tmp_path / "record.json")]) == 0
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["recorded_on"] == "cpu" and record["params"] > 0
    assert runners.main(["tide", *common, "--trace", record["trace"], "--hardware", "cpu-emulated", "--budget-gb", "0.0003",
                         "--optimizer-threads", "1", "--steps", "2", "--nvme-dir", str(tmp_path / "n"), "--result", str(tmp_path / "tide.json")]) == 0
    tide = json.loads((tmp_path / "tide.json").read_text())
    assert tide["bytes_match"] and tide["predicted_bytes_per_channel"]["H2D"] > 0  # 0.3 MB forces offloading
    assert tide["steps_done"] == 2 and tide["measured_over_predicted"] > 0 and tide["tflops"] > 0
    assert tide["optimizer_threads"] == 1  # the kit's spare-cores run passes its count through
    # the spare-cores run trains the schedule the run before it solved: the same plan, no second solve
    assert runners.main(["tide", *common, "--trace", record["trace"], "--hardware", "cpu-emulated", "--budget-gb", "0.0003",
                         "--schedule", tide["schedule"], "--steps", "2", "--nvme-dir", str(tmp_path / "n2"),
                         "--result", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["solve_seconds"] is None and again["losses"] == tide["losses"] and again["bytes_match"]
    assert runners.main(["plain", *common, "--steps", "2", "--result", str(tmp_path / "plain.json")]) == 0
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert len(plain["losses"]) == 2 and abs(plain["losses"][0] - tide["losses"][0]) < 0.1  # same model, same batch


def test_diag_finds_no_difference_where_tide_is_bit_identical():
    """bench/gpu/diag.py on the CPU, where tide trains bit-identically to plain AdamW: every grad its
    hooks saw and every param after one step equal the reference's (the GPU kit reads the same table
    to locate a difference on CUDA)."""
    from bench.gpu import diag

    diffs = diag.compare("os-host")
    assert len(diffs) > 10
    assert all(g == 0.0 and p == 0.0 for g, p in diffs.values()), {n: d for n, d in diffs.items() if d != (0.0, 0.0)}


def test_zero_infinity_swap_pool_holds_every_param_zero3_may_keep_live():
    """One buffer per swapped param (any size): the pool holds the most params whose elements fit in
    ZeRO-3's live limit plus a prefetch bucket, the smallest first, plus the one being fetched."""
    mib = runners.DS_MIN_SWAPPABLE_BYTES // 2  # elements of the smallest swapped bf16 param
    small, big = 10**8, 4 * 10**8
    live = runners.DS_MAX_LIVE_PARAMETERS + runners.DS_PREFETCH_BUCKET_SIZE
    assert live // small == 10  # so ten 1e8-element params fit, and an eleventh does not
    numels = [10**5, mib - 1] * 50 + [small] * 30 + [big] * 3  # the first 100 are never swapped (< 1 MiB)
    assert runners.swap_in_buffer_count(numels) == 11
    assert runners.swap_in_buffer_count([mib] * 3 + [big]) == 5  # 4 would do; DeepSpeed's default 5 is the floor
    many = [mib] * 2000  # 2000 x 0.5M = 1.05e9: all fit, so all of them (no extra beyond the params there are)
    assert runners.swap_in_buffer_count(many) == 2000
    config = runners.deepspeed_config("ds-infinity", batch=1, nvme_dir="/x", numels=[small] * 30 + [big])
    assert config["zero_optimization"]["offload_param"]["buffer_count"] == 11
    assert config["zero_optimization"]["offload_param"]["buffer_size"] == big
    offload = runners.deepspeed_config("ds-offload", batch=1, nvme_dir="/x", numels=[small])
    assert offload["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_live_at_peak_names_what_is_allocated_at_the_step_peak():
    """The allocator's trace replayed: the peak is where the live bytes are most, and what is live there is
    grouped by the innermost frames of tide's files."""
    model = {"filename": "/r/executor/models.py", "line": 40, "name": "forward"}
    loss = {"filename": "/r/executor/models.py", "line": 90, "name": "loss"}
    torch_frame = {"filename": "/site/torch/nn/functional.py", "line": 1, "name": "linear"}
    events = [
        {"action": "alloc", "addr": 0, "size": 5, "frames": [torch_frame]},
        {"action": "alloc", "addr": 1, "size": 100, "frames": [torch_frame, model]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [torch_frame, model]},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 99, "size": 40},  # a block allocated before the step (an evicted chunk)
        {"action": "alloc", "addr": 3, "size": 300, "frames": [loss]},   # the peak: 5 + 50 - 40 + 300
        {"action": "free_completed", "addr": 3, "size": 300},
        {"action": "alloc", "addr": 4, "size": 200, "frames": [model]},  # 5 + 50 - 40 + 200 < 315
    ]
    got = runners.live_at_peak(events, before_bytes=1000)
    assert got["step_peak_bytes"] == 315 and got["peak_bytes"] == 1315
    assert got["live_at_peak"] == [{"where": "models.py:90 loss", "bytes": 300, "blocks": 1},
                                   {"where": "models.py:40 forward", "bytes": 50, "blocks": 1},
                                   {"where": "(no frame of tide)", "bytes": 5, "blocks": 1}]
