"""Copy rates by chunk size (issue 17 item 1, "what the planner prices"): `links.copy_rates` and
`nvme.chunk_rates` in the hardware format, interpolated by the size of one copy, priced the same by
the simulator and the placement model; without the tables, every number is what it was."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import REPO
from planner.costmodel import channel_bytes_per_s, nvme_time_rows
from planner.layout import build_layout
from planner.placement_input import placement_input
from planner.presets import resolve_hardware
from planner.problem import build_problem
from planner.simulate import simulate
from schemas import FormatError, Hardware, Schedule, Trace
from schemas.hardware import CopyRate, SsdRate, rate_at_size
from schemas.schedule import Channel

MIB = 1 << 20
GOLDEN = REPO / "traces" / "golden"


def _with_tables(hw: Hardware, *, small_gb_per_s: float, ssd_small_gb_per_s: float | None = None) -> Hardware:
    """`hw` with copies of 1 MiB and less at `small_gb_per_s`, 64 MiB and more at the flat rates."""
    lk = hw.links
    rows = (CopyRate(chunk_bytes=MIB, h2d_gb_per_s=small_gb_per_s, d2h_gb_per_s=small_gb_per_s),
            CopyRate(chunk_bytes=64 * MIB, h2d_gb_per_s=lk.h2d_gb_per_s, d2h_gb_per_s=lk.d2h_gb_per_s))
    nv = hw.nvme
    ssd = () if ssd_small_gb_per_s is None else (
        SsdRate(chunk_bytes=MIB, read_gb_per_s_each=ssd_small_gb_per_s, write_gb_per_s_each=ssd_small_gb_per_s),
        SsdRate(chunk_bytes=64 * MIB, read_gb_per_s_each=nv.read_gb_per_s_each, write_gb_per_s_each=nv.write_gb_per_s_each))
    return dataclasses.replace(hw, links=dataclasses.replace(lk, copy_rates=rows),
                               nvme=dataclasses.replace(nv, chunk_rates=ssd))


def test_rate_at_size_interpolates_in_log_size_and_clamps() -> None:
    rows = (CopyRate(chunk_bytes=MIB, h2d_gb_per_s=2.0, d2h_gb_per_s=1.0),
            CopyRate(chunk_bytes=16 * MIB, h2d_gb_per_s=10.0, d2h_gb_per_s=9.0, duplex_h2d_gb_per_s=5.0))
    assert rate_at_size(rows, "h2d_gb_per_s", 4 * MIB, 99.0) == pytest.approx(6.0)  # halfway in log size
    assert rate_at_size(rows, "h2d_gb_per_s", 1024, 99.0) == 2.0 and rate_at_size(rows, "d2h_gb_per_s", 1 << 30, 99.0) == 9.0
    assert rate_at_size(rows, "duplex_h2d_gb_per_s", MIB, 7.0) == 5.0  # one row measured it: that row's value
    assert rate_at_size(rows, "h2d_pageable_gb_per_s", MIB, 7.0) == 7.0  # no row measured it: the flat field
    assert rate_at_size(rows, "h2d_gb_per_s", 0, 99.0) == 99.0  # no size: the flat field


def test_a_slow_small_copy_rate_makes_small_chunk_copies_slower_in_the_simulator() -> None:
    s = Schedule.read(GOLDEN / "gpt-small.cpu-emulated-0.05gb.schedule.msgpack")  # 128 KiB chunks
    hw = resolve_hardware("cpu-emulated")
    flat = simulate(s, hw)
    slow = simulate(s, _with_tables(hw, small_gb_per_s=hw.links.h2d_gb_per_s / 20))
    assert slow.busy_seconds_per_channel[Channel.H2D] > 5 * flat.busy_seconds_per_channel[Channel.H2D] > 0
    assert slow.iteration_seconds > flat.iteration_seconds
    # a table that says the flat rate at every size prices exactly as no table
    same = simulate(s, _with_tables(hw, small_gb_per_s=hw.links.h2d_gb_per_s))
    assert same.iteration_seconds == flat.iteration_seconds


def test_the_placement_model_prices_the_layouts_chunk_size_as_the_simulator() -> None:
    trace = Trace.read(REPO / "traces" / "gpt-small.msgpack")
    hw = _with_tables(resolve_hardware("rtx4090-768g-12ssd"), small_gb_per_s=2.0, ssd_small_gb_per_s=0.5)
    p = build_problem(trace, hw, trace_digest="sha256:" + "0" * 64)
    rates = {}
    for elements in (1 << 16, 1 << 24):
        layout = build_layout(p, chunk_elements=elements)
        data = placement_input(p, layout)
        param = elements * 4  # fp32 PARAM chunks: one copy's bytes
        assert data.h2d_bytes_per_s == channel_bytes_per_s(hw, Channel.H2D, nbytes=param)
        assert data.nvme_read_bytes_per_s == channel_bytes_per_s(hw, Channel.NVME_READ, nbytes=elements * 4)
        assert data.nvme_time_rows == nvme_time_rows(hw, nbytes=elements * 4)
        rates[elements] = data.h2d_bytes_per_s
    assert rates[1 << 16] < rates[1 << 24] == hw.h2d_bytes_per_s  # 256 KiB copies slower than 64 MiB ones


def test_the_bound_charges_the_fastest_size() -> None:
    """A lower bound does not know the sizes of the copies: it charges the fastest rate of any size."""
    from planner.bounds import lower_bound
    from planner.costmodel import fastest_bytes_per_s, nvme_seconds

    hw = resolve_hardware("rtx4090-768g-12ssd")
    fast = dataclasses.replace(hw, links=dataclasses.replace(hw.links, copy_rates=(
        CopyRate(chunk_bytes=MIB, h2d_gb_per_s=1.0, d2h_gb_per_s=1.0),
        CopyRate(chunk_bytes=64 * MIB, h2d_gb_per_s=2 * hw.links.h2d_gb_per_s, d2h_gb_per_s=2 * hw.links.d2h_gb_per_s))))
    assert fastest_bytes_per_s(fast, Channel.H2D) == 2 * hw.h2d_bytes_per_s
    assert fastest_bytes_per_s(hw, Channel.H2D) == hw.h2d_bytes_per_s
    trace = Trace.read(REPO / "traces" / "gpt3-13b.msgpack")
    digest = "sha256:" + "0" * 64
    flat, quick = (lower_bound(build_problem(trace, h, trace_digest=digest)) for h in (hw, fast))
    assert quick.seconds <= flat.seconds and quick.seconds_per_resource != flat.seconds_per_resource
    uncapped = dataclasses.replace(hw, nvme=dataclasses.replace(hw.nvme, host_cap_gb_per_s=0.0))
    ssd = _with_tables(uncapped, small_gb_per_s=1.0, ssd_small_gb_per_s=2 * hw.nvme.read_gb_per_s_each)
    assert nvme_seconds(ssd, 1e9, 0) == pytest.approx(nvme_seconds(uncapped, 1e9, 0) / 2)


def test_without_tables_prices_and_digests_are_what_they_were() -> None:
    """Absent tables: every size at the flat rates, and every preset keeps its digest (the goldens' headers
    name it, so no schedule goes stale)."""
    hw = resolve_hardware("rtx4090-768g-12ssd")
    for ch in (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE):
        assert channel_bytes_per_s(hw, ch, nbytes=MIB) == channel_bytes_per_s(hw, ch)
    for path in sorted(GOLDEN.glob("*.schedule.msgpack")):
        s = Schedule.read(path)
        assert resolve_hardware(s.header.hardware_name).digest == s.header.hardware_digest, path.name


def test_tables_are_validated(tmp_path) -> None:
    hw = resolve_hardware("cpu-emulated")
    twice = dataclasses.replace(hw, links=dataclasses.replace(hw.links, copy_rates=(
        CopyRate(chunk_bytes=MIB, h2d_gb_per_s=1.0, d2h_gb_per_s=1.0),) * 2))
    with pytest.raises(FormatError, match="links.copy_rates"):
        Hardware.from_toml(_toml(twice))
    absurd = dataclasses.replace(hw, nvme=dataclasses.replace(hw.nvme, chunk_rates=(
        SsdRate(chunk_bytes=MIB, read_gb_per_s_each=1e-300, write_gb_per_s_each=1.0),)))
    with pytest.raises(FormatError, match=r"nvme.chunk_rates\[0\].read_gb_per_s_each"):
        Hardware.from_toml(_toml(absurd))
    good = _with_tables(hw, small_gb_per_s=1.0, ssd_small_gb_per_s=0.5)
    path = tmp_path / "hw.toml"
    good.write(path)
    assert Hardware.read(path) == good and good.digest != hw.digest


def _toml(hw: Hardware) -> str:
    """The TOML of `hw` without the writer's validation (to hand the reader a bad file)."""
    import tomli_w

    from schemas._base import to_plain
    from schemas.hardware import HARDWARE_FORMAT, HARDWARE_VERSION
    return tomli_w.dumps({"format": HARDWARE_FORMAT, "format_version": HARDWARE_VERSION, **to_plain(hw)})
