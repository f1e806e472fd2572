"""A schedule cannot lie (issue 21, item 1): its content digest refuses any edit made after the planner
wrote it, and `planner validate` replays a (resealed) schedule through the simulator's checks.

The flip test is a seeded CI-sized sample; `bench/bench_bitflip.py` runs every single-bit flip.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgpack
import pytest

from conftest import REPO
from planner.cli import main as planner_main
from planner.presets import resolve_hardware
from planner.simulate import simulate
from schemas import FormatError, Schedule
from schemas.schedule import Op, seal

GOLDEN = REPO / "traces" / "golden" / "gpt-small.cpu-emulated-0.05gb.schedule.msgpack"
TRACE = REPO / "traces" / "gpt-small.msgpack"
WITH_COPIES = REPO / "traces" / "golden" / "pstar-gpt-1b.v100-32g-240g.schedule.msgpack"  # gpt-small's has none
FLIP_SAMPLE = 96  # flips per CI run; the exhaustive count is bench/bench_bitflip.py's
FLIP_SEED = 21


def flip(payload: bytes, bit: int) -> bytes:
    out = bytearray(payload)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_single_bit_flips_fail_to_load_with_one_line_or_change_nothing() -> None:
    payload = GOLDEN.read_bytes()
    original = Schedule.from_msgpack(payload)
    hardware = resolve_hardware(original.header.hardware_name)
    expected = simulate(original, hardware)
    bits = random.Random(FLIP_SEED).sample(range(len(payload) * 8), FLIP_SAMPLE)
    loaded = 0
    for bit in bits:
        try:
            schedule = Schedule.from_msgpack(flip(payload, bit), source="flipped.msgpack")
        except FormatError as exc:
            message = str(exc)
            assert "\n" not in message and "flipped.msgpack" in message and "Fix:" in message, (bit, message)
            continue
        loaded += 1
        assert schedule == original or simulate(schedule, hardware) == expected, f"bit {bit} changed the replay silently"
    assert loaded < FLIP_SAMPLE  # the sample did flip content


def test_an_edit_after_writing_is_refused_by_the_digest(tmp_path: Path) -> None:
    data = msgpack.unpackb(GOLDEN.read_bytes(), raw=False)
    data["header"]["trace_digest"] = "sha256:" + "0" * 64
    path = tmp_path / "edited.msgpack"
    path.write_bytes(msgpack.packb(data, use_bin_type=True))
    with pytest.raises(FormatError, match="content digest does not match: the file was changed after the planner wrote it"):
        Schedule.read(path)


def _resealed(tmp_path: Path, change: Any, source: Path = GOLDEN) -> Path:
    data = msgpack.unpackb(source.read_bytes(), raw=False)
    change(data)
    path = tmp_path / "resealed.msgpack"
    path.write_bytes(msgpack.packb(seal(data), use_bin_type=True))
    Schedule.read(path)  # the digest is right: only the semantic checks can tell
    return path


def _validate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = planner_main(["validate", *argv])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return code, err


def _step_of_next_chunk(data: dict[str, Any]) -> None:
    """The flip of issue 21: an OPTIMIZER_STEP's chunk changed by one (its own chunk is never stepped)."""
    steps = [a for a in data["actions"] if a["op"] == Op.OPTIMIZER_STEP.value]
    steps[0]["chunk"] = steps[1]["chunk"]


def test_validate_replays_a_resealed_schedule_that_skips_an_optimizer_step(tmp_path: Path, capsys) -> None:
    code, err = _validate(capsys, str(GOLDEN))
    assert code == 0, err
    path = _resealed(tmp_path, _step_of_next_chunk)
    code, err = _validate(capsys, str(path))
    assert code == 2 and "schedule violation" in err and "re-solve" in err, err


def test_validate_checks_bytes_per_channel_against_the_prediction(tmp_path: Path, capsys) -> None:
    def inflate(data: dict[str, Any]) -> None:
        data["prediction"]["bytes_per_channel"]["H2D"] += 4096

    code, err = _validate(capsys, str(_resealed(tmp_path, inflate, WITH_COPIES)))
    assert code == 2 and "bytes_per_channel does not match" in err and "H2D" in err, err


def test_validate_checks_a_copy_moves_its_chunk(tmp_path: Path, capsys) -> None:
    def shrink(data: dict[str, Any]) -> None:
        copy = next(a for a in data["actions"] if a["op"] == Op.FETCH.value or a["op"] == Op.PREFETCH.value)
        copy["bytes"] -= 4

    code, err = _validate(capsys, str(_resealed(tmp_path, shrink, WITH_COPIES)))
    assert code == 2 and "not their chunk's size" in err, err


def test_validate_checks_the_trace_digest(tmp_path: Path, capsys) -> None:
    code, err = _validate(capsys, str(GOLDEN), "--trace", str(TRACE))
    assert code == 0, err

    def other_trace(data: dict[str, Any]) -> None:
        data["header"]["trace_digest"] = "sha256:" + "1" * 64

    code, err = _validate(capsys, str(_resealed(tmp_path, other_trace)), "--trace", str(TRACE))
    assert code == 2 and "header.trace_digest" in err and "not the digest of the trace given" in err, err
