"""`python -m planner validate` and `show` on every preset, on hand-made and generated files, and `--help`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from conftest import HARDWARE, REPO, TRACES
from planner.cli import COMMANDS, main
from schemas import Hardware, Schedule, Trace
from schemas.hardware import estimated_fields
from schemas.schedule import ActivationMode, ActivationPlan
from strategies import example_schedule, example_trace, schedules, traces

PRESETS = sorted(HARDWARE.glob("*.toml"))
SHIPPED = sorted(TRACES.glob("*.msgpack")) + sorted((TRACES / "golden").glob("*.msgpack"))
SCREEN_LINES = 60  # `show` must summarise, not list: a big model still fits one screen


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_show_and_validate_every_preset(preset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hw = Hardware.read(preset)
    code, out, err = _run(capsys, "show", str(preset))
    assert (code, err) == (0, "")
    assert hw.name in out
    for number in (hw.device_bytes, hw.host_bytes, hw.nvme_bytes):
        assert f"{number:,}" in out
    assert "links.h2d_gb_per_s" in out and "GB/s" in out
    assert len(out.splitlines()) <= SCREEN_LINES

    code, out, _ = _run(capsys, "show", str(preset), "--json")
    summary = json.loads(out)
    assert summary["kind"] == "hardware" and summary["name"] == hw.name
    assert summary["derived"]["device_bytes"] == hw.device_bytes
    assert summary["derived"]["nvme_read_bytes_per_s"] == hw.nvme_read_bytes_per_s
    fields = {row["field"]: row["value"] for row in summary["rows"]}
    assert fields["device.memory_gb"] == hw.device.memory_gb and fields["cluster.world_size"] == hw.cluster.world_size

    code, out, _ = _run(capsys, "validate", str(preset))
    estimates = estimated_fields(preset.read_text(encoding="utf-8"))
    expected = [f"ok: {preset} is a valid tide hardware (format 1)"]
    if estimates:  # the numbers without a source are named, so a reader knows which to check
        expected.append(f"  tide estimates (no source, check them): {', '.join(estimates)}")
    assert code == 0 and out.rstrip().splitlines() == expected


def test_show_preset_as_a_real_command() -> None:
    """The same through a fresh interpreter, as a user runs it."""
    preset = HARDWARE / "cpu-emulated.toml"
    proc = subprocess.run([sys.executable, "-m", "planner", "show", str(preset)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cpu-emulated" in proc.stdout and f"{Hardware.read(preset).device_bytes:,}" in proc.stdout


def test_show_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = example_trace()
    path = tmp_path / "tiny.msgpack"
    trace.write(path)
    code, out, err = _run(capsys, "show", str(path))
    assert (code, err) == (0, "")
    peak = max(m.non_model_bytes for m in trace.moments)
    for text in ("tiny-gpt", f"{trace.param_count:,}", f"{trace.param_bytes:,}", "1 tied", "wte.weight = lm_head.weight",
                 f"{peak:,}", "FORWARD", "BACKWARD", "OPTIMIZER", "h.0", "h.1"):
        assert text in out, text

    code, out, _ = _run(capsys, "show", str(path), "--json")
    summary = json.loads(out)
    assert summary["kind"] == "trace"
    assert summary["params"] == {"count": trace.param_count, "bytes": trace.param_bytes, "tensors": 5, "trainable_tensors": 5,
                                 "tied_tensors": 1, "tied_examples": [["wte.weight", "lm_head.weight"]]}
    assert summary["peak_non_model"]["bytes"] == peak
    assert summary["peak_non_model"]["moment"] == next(m.id for m in trace.moments if m.non_model_bytes == peak)
    assert {k: v["moments"] for k, v in summary["moments"]["per_phase"].items()} == {"FORWARD": 4, "BACKWARD": 4, "OPTIMIZER": 1}
    assert summary["compute"]["flops"] == sum(m.flops for m in trace.moments)
    assert summary["activations"]["bytes"] == sum(a.bytes for a in trace.activations)
    assert [b["bytes"] for b in summary["activations"]["blocks"]] == trace.block_activation_bytes()

    code, out, _ = _run(capsys, "validate", str(path), "--json")
    assert json.loads(out) == {"ok": True, "file": str(path), "kind": "trace", "format": "tide.trace", "format_version": 1}


def test_show_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schedule = example_schedule()
    path = tmp_path / "tiny.schedule.msgpack"
    schedule.write(path)
    code, out, err = _run(capsys, "show", str(path))
    assert (code, err) == (0, "")
    for text in ("tide", "OPTIMAL", "2 chunks of 2,048 elements", "SWAP_HOST", "KEEP", "OPTIMIZER_STEP", "FETCH", "20,480",
                 "1,000,000", "60,000"):
        assert text in out, text

    summary = json.loads(_run(capsys, "show", str(path), "--json")[1])
    assert summary["kind"] == "schedule"
    assert set(summary) >= {"header", "budgets", "layout", "residency_at_start", "os_tiers", "optimizer_tiers",
                            "activation_plan", "prediction", "actions"}
    assert summary["header"]["solver_status"] == "OPTIMAL" and summary["header"]["gap"] == 0.0
    assert summary["layout"]["chunks"] == 2 and summary["layout"]["chunk_elements"] == 2048
    used = sum(t.numel for t in schedule.layout.tensors)
    assert summary["layout"]["wasted_elements"] == 2 * 2048 - used
    assert summary["layout"]["lists"]["PARAM"]["wasted_bytes"] == (2 * 2048 - used) * 4
    assert summary["residency_at_start"]["PARAM"] == {"DEVICE": 2, "HOST": 2, "NVME": 0, "nowhere": 0}
    assert summary["residency_at_start"]["GRAD"]["nowhere"] == 2
    assert summary["os_tiers"] == {"DEVICE": 0, "HOST": 2, "NVME": 0}
    assert summary["activation_plan"]["per_mode"] == {"KEEP": 1, "SWAP_HOST": 1}
    assert summary["actions"]["per_op"]["EVICT"] == 4 and summary["actions"]["count"] == len(schedule.actions)
    assert summary["prediction"]["bytes_per_channel"] == {"H2D": 20480, "D2H": 20480}
    assert summary["prediction"]["peak_bytes_per_tier"] == {"DEVICE": 60_000, "HOST": 50_000}


def test_big_files_fit_one_screen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = example_trace(n_blocks=96)
    trace.write(tmp_path / "big.msgpack")
    code, out, _ = _run(capsys, "show", str(tmp_path / "big.msgpack"))
    assert code == 0 and len(out.splitlines()) <= SCREEN_LINES
    assert f"{len(trace.tensors):,} tensors" in out

    schedule = example_schedule()
    plans = tuple(ActivationPlan(block=b, module=f"h.{b}", mode=ActivationMode.RECOMPUTE, bytes=1, input_bytes=1,
                                 recompute_seconds=0.0, recompute_flops=0) for b in range(96))
    dataclasses.replace(schedule, activation_plans=plans).write(tmp_path / "big.schedule.msgpack")
    code, out, _ = _run(capsys, "show", str(tmp_path / "big.schedule.msgpack"))
    assert code == 0 and len(out.splitlines()) <= SCREEN_LINES
    assert "RECOMPUTE 96" in out


@pytest.mark.skipif(not SHIPPED, reason="no shipped traces or golden schedules yet")
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_show_shipped_files(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "show", str(path))
    assert (code, err) == (0, "")
    assert len(out.splitlines()) <= SCREEN_LINES
    assert json.loads(_run(capsys, "show", str(path), "--json")[1])["kind"] in ("trace", "schedule")


@settings(max_examples=40, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=traces(), schedule=schedules())
def test_show_any_valid_file(trace: Trace, schedule: Schedule, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Edge cases the hand-made files lack: no tensors, no blocks, zero seconds, empty maps, odd names."""
    for obj, name in ((trace, "t.msgpack"), (schedule, "s.msgpack")):
        obj.write(tmp_path / name)
        for extra in ((), ("--json",)):
            code, out, err = _run(capsys, "show", str(tmp_path / name), *extra)
            assert (code, err) == (0, "")
        json.loads(out)


def test_bad_input_through_show_and_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(example_trace().to_msgpack()[:-5])
    code, out, err = _run(capsys, "show", str(bad))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and str(bad) in err
    code, out, err = _run(capsys, "validate", str(bad), "--json")
    assert code == 2 and len(err.strip().splitlines()) == 1
    answer = json.loads(out)
    assert answer["ok"] is False and str(bad) in answer["error"]


def test_rich_markup_in_names_is_printed_as_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = example_trace()
    meta = dataclasses.replace(trace.meta, model_name="[bold]gpt[/bold]")
    dataclasses.replace(trace, meta=meta).write(tmp_path / "t.msgpack")
    code, out, _ = _run(capsys, "show", str(tmp_path / "t.msgpack"))
    assert code == 0 and "[bold]gpt[/bold]" in out


def _existing_commands() -> list[str]:
    return [name for name, module in COMMANDS.items() if importlib.util.find_spec(module) is not None]


@pytest.mark.parametrize("command", _existing_commands())
def test_help_for_every_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m planner " + command)


def test_top_level_help_lists_commands() -> None:
    proc = subprocess.run([sys.executable, "-m", "planner", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("validate", "show"):
        assert command in proc.stdout


# run `python -m planner ARGS...` in this fresh interpreter, then print the top-level modules it loaded
_LOADED_BY_COMMAND = r"""
import json, runpy, sys
sys.argv = ["python -m planner", *sys.argv[1:]]
try:
    runpy.run_module("planner", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def _modules_loaded_by(*argv: str) -> tuple[int, set[str]]:
    proc = subprocess.run([sys.executable, "-c", _LOADED_BY_COMMAND, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report["code"], set(report["modules"])


def test_validate_imports_no_solver() -> None:
    """`validate` loads only its own command's module: no OR-Tools (it cost ~1.5 s a call), no other command."""
    code, modules = _modules_loaded_by("validate", str(TRACES / "gpt3-175b.msgpack"))
    assert code == 0
    assert "ortools" not in modules
    assert "planner" in modules  # the probe saw the command's own imports


def test_top_level_help_imports_no_command_module() -> None:
    code, modules = _modules_loaded_by("--help")
    assert code == 0
    assert "ortools" not in modules and "rich" not in modules
