"""Property-based round trips of the three formats: read(write(x)) == x, and writing is byte-deterministic."""

from __future__ import annotations

from hypothesis import given, settings

from schemas import Hardware, Schedule, Trace
from strategies import hardwares, schedules, traces

ROUND_TRIPS = settings(max_examples=1000, database=None)


@ROUND_TRIPS
@given(trace=traces())
def test_trace_msgpack_round_trip(trace: Trace) -> None:
    payload = trace.to_msgpack()
    back = Trace.from_msgpack(payload, source="round trip")
    assert back == trace
    assert back.to_msgpack() == payload  # same object, same bytes
    assert trace.to_msgpack() == payload


@ROUND_TRIPS
@given(hw=hardwares())
def test_hardware_toml_round_trip(hw: Hardware) -> None:
    text = hw.to_toml()
    back = Hardware.from_toml(text, source="round trip")
    assert back == hw
    assert back.to_toml() == text
    assert back.digest == hw.digest


@ROUND_TRIPS
@given(schedule=schedules())
def test_schedule_msgpack_round_trip(schedule: Schedule) -> None:
    payload = schedule.to_msgpack()
    back = Schedule.from_msgpack(payload, source="round trip")
    assert back == schedule
    assert back.to_msgpack() == payload
    assert schedule.to_msgpack() == payload


@settings(max_examples=50, database=None)
@given(trace=traces(), schedule=schedules(), hw=hardwares())
def test_files_round_trip(tmp_path_factory, trace: Trace, schedule: Schedule, hw: Hardware) -> None:
    """Through real files (atomic write, read) as the CLIs use them."""
    folder = tmp_path_factory.mktemp("rt")
    trace.write(folder / "t.msgpack")
    schedule.write(folder / "s.msgpack")
    hw.write(folder / "h.toml")
    assert Trace.read(folder / "t.msgpack") == trace
    assert Schedule.read(folder / "s.msgpack") == schedule
    assert Hardware.read(folder / "h.toml") == hw
    assert sorted(p.name for p in folder.iterdir()) == ["h.toml", "s.msgpack", "t.msgpack"]  # no temp files left


def test_presets_round_trip() -> None:
    from conftest import HARDWARE

    for path in sorted(HARDWARE.glob("*.toml")):
        hw = Hardware.read(path)
        assert Hardware.from_toml(hw.to_toml()) == hw, path.name
