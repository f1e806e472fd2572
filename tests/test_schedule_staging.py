"""Pinned or pageable HOST copies: a decision the schedule carries (`header.host_staging`), set by the
policies that stage through pageable memory, read by the simulator, shown and diffed (issues 16/17)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgpack
import pytest

from conftest import REPO
from planner.cli import main as planner_main
from planner.diff import diff_schedules, render_text
from planner.families import gpt_trace
from planner.policies import POLICIES, baseline
from planner.problem import build_problem
from planner.simulate import simulate
from schemas import FormatError, Schedule
from schemas.hardware import ClusterSpec, DeviceKind, DeviceSpec, Hardware, HostSpec, LinkSpec, NvmeSpec
from schemas.schedule import HostStaging, seal

GOLDEN = REPO / "traces" / "golden" / "gpt-small.cpu-emulated-0.05gb.schedule.msgpack"
PIN_MEMORY_OFF_BY_DEFAULT = {"zero2-offload", "zero3-offload", "zero-infinity", "gemini"}  # DeepSpeed and Gemini


def _box() -> Hardware:
    return Hardware(
        name="box", description="test box",
        device=DeviceSpec(kind=DeviceKind.CUDA, name="gpu", memory_gb=4.0, usable_fraction=1.0, compute_tflops=10.0,
                          optimizer_params_per_s=1e10),
        host=HostSpec(memory_gb=16.0, usable_fraction=1.0, optimizer_params_per_s=1e8, cores=8),
        nvme=NvmeSpec(count=2, capacity_gb_each=100.0, read_gb_per_s_each=2.0, write_gb_per_s_each=1.0,
                      usable_fraction=1.0),
        links=LinkSpec(h2d_gb_per_s=10.0, d2h_gb_per_s=10.0, inter_gpu_gb_per_s=0.0, h2d_pageable_gb_per_s=3.0,
                       d2h_pageable_gb_per_s=3.0),
        cluster=ClusterSpec(world_size=1, gpus_per_node=1),
    )


def _resealed(tmp_path: Path, change) -> Path:
    data = msgpack.unpackb(GOLDEN.read_bytes(), raw=False, strict_map_key=False)
    change(data)
    out = tmp_path / "changed.schedule.msgpack"
    out.write_bytes(msgpack.packb(seal(data), use_bin_type=True))
    return out


def test_a_format_2_file_without_the_field_reads_as_pinned_and_keeps_its_bytes() -> None:
    """Compat: files written before the field (every golden) carry no `host_staging` and read as
    PINNED, what they meant (only `planner solve` writes schedules, and tide pins); a PINNED schedule
    is written without the field, so it keeps its bytes and its content digest."""
    raw = GOLDEN.read_bytes()
    assert "host_staging" not in msgpack.unpackb(raw, raw=False, strict_map_key=False)["header"]
    s = Schedule.from_msgpack(raw)
    assert s.header.host_staging is HostStaging.PINNED
    assert s.to_msgpack() == raw
    paged = dataclasses.replace(s, header=dataclasses.replace(s.header, host_staging=HostStaging.PAGEABLE))
    assert msgpack.unpackb(paged.to_msgpack(), raw=False, strict_map_key=False)["header"]["host_staging"] == "PAGEABLE"
    assert paged.content_digest() != s.content_digest()


def test_the_field_round_trips_and_a_bad_value_is_one_line(tmp_path: Path) -> None:
    s = Schedule.read(GOLDEN)
    paged = dataclasses.replace(s, header=dataclasses.replace(s.header, host_staging=HostStaging.PAGEABLE))
    back = Schedule.from_msgpack(paged.to_msgpack())
    assert back.header.host_staging is HostStaging.PAGEABLE and back == paged
    bad = _resealed(tmp_path, lambda d: d["header"].__setitem__("host_staging", "PAGED"))
    with pytest.raises(FormatError) as exc:
        Schedule.read(bad)
    assert "header.host_staging" in str(exc.value) and "\n" not in str(exc.value)


def test_the_simulator_prices_the_field_not_the_policy_name() -> None:
    """Pageable copies run at the pageable rate and hold their moment: slower; renaming the policy
    alone changes nothing (there is no list of policy names any more)."""
    p = build_problem(gpt_trace(layers=8, hidden=1024, heads=8, seq=128, batch=2, vocab=8192), _box(),
                      trace_digest="sha256:" + "0" * 64)
    s = baseline("zero3-offload", p)
    assert s.header.host_staging is HostStaging.PAGEABLE
    pinned = dataclasses.replace(s, header=dataclasses.replace(s.header, host_staging=HostStaging.PINNED))
    renamed = dataclasses.replace(pinned, header=dataclasses.replace(pinned.header, policy="tide"))
    slow, fast, same = (simulate(x, p.hardware) for x in (s, pinned, renamed))
    assert slow.iteration_seconds == pytest.approx(s.prediction.iteration_seconds)
    assert slow.iteration_seconds > fast.iteration_seconds == same.iteration_seconds


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_policy_sets_its_staging(name: str) -> None:
    """DeepSpeed (offload_config.py pin_memory false) and Gemini (GeminiPlugin pin_memory false) are
    pageable; PatrickStar, Fuyou and PyTorch pin (or copy nothing); tide's own solve pins."""
    p = build_problem(gpt_trace(layers=4, hidden=512, heads=8, seq=128, batch=2, vocab=8192), _box(),
                      trace_digest="sha256:" + "0" * 64)
    s = baseline(name, p)
    want = HostStaging.PAGEABLE if name in PIN_MEMORY_OFF_BY_DEFAULT else HostStaging.PINNED
    assert s.header.host_staging is want


def test_show_and_diff_name_the_staging(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = Schedule.read(GOLDEN)
    paged = dataclasses.replace(s, header=dataclasses.replace(s.header, host_staging=HostStaging.PAGEABLE))
    text = render_text(diff_schedules(s, paged))
    assert "host_staging" in text and "PINNED" in text and "PAGEABLE" in text
    path = tmp_path / "paged.schedule.msgpack"
    paged.write(path)
    assert planner_main(["show", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["header"]["host_staging"] == "PAGEABLE"
    assert planner_main(["show", str(path)]) == 0
    assert "pageable HOST copies" in capsys.readouterr().out
