"""Bad input of every kind gives one clear line naming the file and the field; the CLI exits 2; writes are atomic.

Each case builds a broken file from a valid one (tests/strategies.py's examples, a shipped preset),
reads it with the format's class and checks the FormatError; then `python -m planner validate` runs
on every case file (its main() in this process; a few in real children) and must exit 2 with one line
on stderr.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pytest

import schemas._base as base
from conftest import HARDWARE, REPO
from planner.cli import main as planner_main
from schemas import FormatError, Hardware, Schedule, Trace, atomic_write_bytes, load_any
from schemas.schedule import DIGEST_FIELD, Op, seal
from strategies import example_schedule, example_trace

PRESET = HARDWARE / "cpu-emulated.toml"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    reader: Any  # Trace, Schedule or Hardware
    build: Callable[[Path], Path]  # writes the bad file under the folder, returns its path
    path: str | None  # field path the message must contain (None: a whole-file problem)
    words: tuple[str, ...] = ()  # more text the message must contain


# ----------------------------------------------------------------------------- builders


def _good_trace_bytes() -> bytes:
    return example_trace().to_msgpack()


def _good_schedule_bytes() -> bytes:
    return example_schedule().to_msgpack()


def _raw(payload: bytes, suffix: str = ".msgpack") -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        path = folder / f"bad{suffix}"
        path.write_bytes(payload)
        return path

    return build


def _mutated(good: Callable[[], bytes], change: Callable[[dict[str, Any]], None], *,
             reseal: bool = True) -> Callable[[Path], Path]:
    """A file decoded, changed and encoded again; a schedule gets the digest of its new content unless
    `reseal` is False (so each case reaches the check it is about, not the content digest)."""

    def build(folder: Path) -> Path:
        data = copy.deepcopy(msgpack.unpackb(good(), raw=False))
        change(data)
        if reseal and isinstance(data, dict) and DIGEST_FIELD in data:
            data = seal(data)
        path = folder / "bad.msgpack"
        path.write_bytes(msgpack.packb(data, use_bin_type=True))
        return path

    return build


def _toml(edit: Callable[[str], str]) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        path = folder / "bad.toml"
        path.write_text(edit(PRESET.read_text(encoding="utf-8")), encoding="utf-8")
        return path

    return build


def _set(*keys: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


def _apply(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        for c in changes:
            c(data)

    return change


def _first_action(op: Op) -> int:
    return next(i for i, a in enumerate(example_schedule().actions) if a.op is op)


def _replace(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)

    return edit


# ----------------------------------------------------------------------------- the cases


def _whole_file_cases(reader: Any, good: Callable[[], bytes], label: str) -> list[Case]:
    return [
        Case(f"{label}-truncated", reader, lambda f: _raw(good()[: len(good()) // 2])(f), None, ("truncated",)),
        Case(f"{label}-corrupt", reader, lambda f: _raw(b"\xc1" + good()[1:])(f), None, ("corrupt",)),
        Case(f"{label}-trailing-garbage", reader, lambda f: _raw(good() + b"\x00garbage")(f), None, ("trailing",)),
        Case(f"{label}-empty", reader, _raw(b""), None, ("empty",)),
        Case(f"{label}-not-a-map", reader, _raw(msgpack.packb([1, 2, 3])), "(top level)"),
    ]


TRACE = Trace
TRACE_CASES = _whole_file_cases(Trace, _good_trace_bytes, "trace") + [
    Case("trace-wrong-type", TRACE, _mutated(_good_trace_bytes, _set("moments", 2, "flops", value="many")),
         "moments[2].flops", ("an integer", "'many'")),
    Case("trace-bool-for-int", TRACE, _mutated(_good_trace_bytes, _set("tensors", 1, "bytes", value=True)),
         "tensors[1].bytes", ("an integer",)),
    Case("trace-bad-enum", TRACE, _mutated(_good_trace_bytes, _set("moments", 3, "phase", value="SIDEWAYS")),
         "moments[3].phase", ("one of FORWARD/BACKWARD/OPTIMIZER", "'SIDEWAYS'")),
    Case("trace-unknown-top", TRACE, _mutated(_good_trace_bytes, _set("colour", value="blue")), "colour", ("unknown field",)),
    Case("trace-unknown-nested", TRACE, _mutated(_good_trace_bytes, _set("tensors", 1, "colour", value="blue")),
         "tensors[1].colour", ("unknown field",)),
    Case("trace-missing-field", TRACE, _mutated(_good_trace_bytes, lambda d: d["tensors"][1].pop("dtype")),
         "tensors[1].dtype", ("required",)),
    Case("trace-other-format", TRACE, _mutated(_good_trace_bytes, _set("format", value="tide.schedule")), "format",
         ("tide.trace",)),
    Case("trace-future-version", TRACE, _mutated(_good_trace_bytes, _set("format_version", value=99)), "format_version",
         ("format 99", "upgrade")),
    Case("trace-older-version", TRACE, _mutated(_good_trace_bytes, _set("format_version", value=0)), "format_version",
         ("format 0", "re-record")),
    Case("trace-nan-seconds", TRACE, _mutated(_good_trace_bytes, _set("moments", 2, "compute_seconds", value=float("nan"))),
         "moments[2].compute_seconds", ("finite",)),
    Case("trace-inf-seconds", TRACE, _mutated(_good_trace_bytes, _set("blocks", 0, "forward_seconds", value=float("inf"))),
         "blocks[0].forward_seconds", ("finite",)),
    Case("trace-negative-bytes", TRACE, _mutated(_good_trace_bytes, _set("tensors", 2, "bytes", value=-4)),
         "tensors[2].bytes", (">= 0",)),
    Case("trace-zero-world-size", TRACE, _mutated(_good_trace_bytes, _set("meta", "world_size", value=0)),
         "meta.world_size", (">= 1",)),
    Case("trace-bytes-disagree", TRACE, _mutated(_good_trace_bytes, _set("tensors", 1, "bytes", value=7)),
         "tensors[1].bytes", ("shape x dtype",)),
    Case("trace-ids-not-dense", TRACE, _mutated(_good_trace_bytes, _set("tensors", 1, "id", value=5)), "tensors[1].id",
         ("dense",)),
    Case("trace-dangling-moment-tensor", TRACE, _mutated(_good_trace_bytes, lambda d: d["moments"][2]["tensors"].append(99)),
         "moments[2].tensors[2]", ("tensor id", "99")),
    Case("trace-dangling-activation-moment", TRACE,
         _mutated(_good_trace_bytes, _set("activations", 0, "produced_at", value=99)), "activations[0].produced_at",
         ("moment id", "99")),
    Case("trace-dangling-activation-consumer", TRACE,
         _mutated(_good_trace_bytes, _set("activations", 0, "consumed_at", value=[99])), "activations[0].consumed_at[0]",
         ("99",)),
    Case("trace-dangling-block", TRACE, _mutated(_good_trace_bytes, _set("moments", 1, "block", value=7)), "moments[1].block",
         ("block id",)),
    Case("trace-int-beyond-64-bit", TRACE, _mutated(_good_trace_bytes, _set("tensors", 1, "bytes", value=2**64 - 1)),
         "tensors[1].bytes", ("64-bit", str(2**64 - 1))),
    Case("trace-phases-out-of-order", TRACE, _mutated(_good_trace_bytes, _set("moments", 0, "phase", value="OPTIMIZER")),
         "moments[1].phase", ("in order",)),
]

HW = Hardware
HW_CASES = [
    Case("hw-truncated", HW, _toml(lambda t: t[: t.index("[host]")]), "host", ("required",)),
    Case("hw-corrupt", HW, _raw(b"\xff\xfe\x00\x01binary", ".toml"), None, ("UTF-8",)),
    Case("hw-syntax", HW, _toml(lambda t: t.replace("[device]", "[device")), None, ("syntax",)),
    Case("hw-trailing-garbage", HW, _toml(lambda t: t + "\n}}} garbage\n"), None, ("syntax",)),
    Case("hw-empty", HW, _raw(b"", ".toml"), "format", ("tide.hardware",)),
    Case("hw-wrong-type", HW, _toml(_replace("cores = 2", 'cores = "two"')), "host.cores", ("an integer", "'two'")),
    Case("hw-bad-enum", HW, _toml(_replace('kind = "cpu-emulated"', 'kind = "tpu"')), "device.kind", ("one of cuda/cpu-emulated",)),
    Case("hw-unknown-top", HW, _toml(_replace("name = ", "colour = 1\nname = ")), "colour", ("unknown field",)),
    Case("hw-unknown-nested", HW, _toml(_replace("[links]", "[links]\ncolour = 1")), "links.colour", ("unknown field",)),
    Case("hw-missing-field", HW, _toml(lambda t: "\n".join(l for l in t.splitlines() if not l.startswith("cores"))),
         "host.cores", ("required",)),
    Case("hw-other-format", HW, _toml(_replace('format = "tide.hardware"', 'format = "tide.trace"')), "format",
         ("tide.hardware",)),
    Case("hw-future-version", HW, _toml(_replace("format_version = 1", "format_version = 2")), "format_version",
         ("format 2", "upgrade")),
    Case("hw-older-version", HW, _toml(_replace("format_version = 1", "format_version = 0")), "format_version", ("format 0",)),
    Case("hw-nan", HW, _toml(_replace("memory_gb = 1.0", "memory_gb = nan")), "device.memory_gb", ("finite",)),
    Case("hw-inf", HW, _toml(_replace("h2d_gb_per_s = 4.0", "h2d_gb_per_s = inf")), "links.h2d_gb_per_s", ("finite",)),
    Case("hw-negative-bandwidth", HW, _toml(_replace("d2h_gb_per_s = 4.0", "d2h_gb_per_s = -4.0")), "links.d2h_gb_per_s",
         ("> 0",)),
    Case("hw-zero-memory", HW, _toml(_replace("memory_gb = 1.0", "memory_gb = 0.0")), "device.memory_gb", ("> 0",)),
    Case("hw-zero-bandwidth", HW, _toml(_replace("h2d_gb_per_s = 4.0", "h2d_gb_per_s = 0")), "links.h2d_gb_per_s", ("> 0",)),
    Case("hw-absurd-bandwidth", HW, _toml(_replace("h2d_gb_per_s = 4.0", "h2d_gb_per_s = 1e-300")), "links.h2d_gb_per_s",
         ("between 1e-06 and 1e+06 GB/s", "1e-300")),
    Case("hw-fraction-above-one", HW, _toml(_replace("usable_fraction = 0.5", "usable_fraction = 1.5")),
         "host.usable_fraction", ("<= 1",)),
    Case("hw-ssd-without-rate", HW, _toml(_replace("read_gb_per_s_each = 1.0", "read_gb_per_s_each = 0.0")),
         "nvme.read_gb_per_s_each", ("positive",)),
    # hardware fuzz cases 1066... of issue 21: JSON Schema counts 1e300 as an integer, msgpack then failed on the digest
    Case("hw-float-beyond-64-bit", HW, _toml(_replace("k = 256,", "k = 1e+300,")), "device.matmul_rates[0].k",
         ("64-bit", "found 1e+300")),
    Case("hw-int-beyond-64-bit", HW, _toml(_replace("cores = 2", "cores = 99999999999999999999")), "host.cores",
         ("64-bit", "99999999999999999999")),
    Case("hw-gpus-without-link", HW, _toml(_replace("world_size = 1", "world_size = 2")), "links.inter_gpu_gb_per_s",
         ("world_size=2",)),
]

SCHED = Schedule
_FETCH = _first_action(Op.FETCH)
_ACT = _first_action(Op.ACT_OFFLOAD)
SCHEDULE_CASES = _whole_file_cases(Schedule, _good_schedule_bytes, "schedule") + [
    Case("schedule-wrong-type", SCHED, _mutated(_good_schedule_bytes, _set("header", "world_size", value="one")),
         "header.world_size", ("an integer",)),
    Case("schedule-list-for-map", SCHED, _mutated(_good_schedule_bytes, _set("budgets", value=[1, 2, 3])), "budgets",
         ("a map",)),
    Case("schedule-bad-enum", SCHED, _mutated(_good_schedule_bytes, _set("actions", 0, "op", value="TELEPORT")),
         "actions[0].op", ("one of FETCH",)),
    Case("schedule-bad-channel-key", SCHED,
         _mutated(_good_schedule_bytes, _set("prediction", "bytes_per_channel", value={"WIFI": 1})),
         "prediction.bytes_per_channel", ("'WIFI'",)),
    Case("schedule-bad-digest", SCHED, _mutated(_good_schedule_bytes, _set("header", "trace_digest", value="md5:abc")),
         "header.trace_digest", ("sha256",)),
    Case("schedule-unknown-top", SCHED, _mutated(_good_schedule_bytes, _set("colour", value=1)), "colour", ("unknown field",)),
    Case("schedule-unknown-nested", SCHED, _mutated(_good_schedule_bytes, _set("layout", "chunks", 0, "colour", value=1)),
         "layout.chunks[0].colour", ("unknown field",)),
    Case("schedule-other-format", SCHED, _mutated(_good_schedule_bytes, _set("format", value="tide.trace")), "format",
         ("tide.schedule",)),
    Case("schedule-future-version", SCHED, _mutated(_good_schedule_bytes, _set("format_version", value=99)),
         "format_version", ("format 99", "upgrade", "planner solve")),
    Case("schedule-edited-after-writing", SCHED,
         _mutated(_good_schedule_bytes, lambda d: d["actions"][_FETCH].update(bytes=d["actions"][_FETCH]["bytes"] + 1),
                  reseal=False), DIGEST_FIELD,
         ("content digest does not match", "changed after the planner wrote it", "planner solve")),
    Case("schedule-without-digest", SCHED, _mutated(_good_schedule_bytes, lambda d: d.pop(DIGEST_FIELD)), DIGEST_FIELD,
         ("content digest",)),
    Case("schedule-older-version", SCHED, _mutated(_good_schedule_bytes, _set("format_version", value=0)),
         "format_version", ("format 0", "planner solve")),
    Case("schedule-nan", SCHED, _mutated(_good_schedule_bytes, _set("prediction", "iteration_seconds", value=float("nan"))),
         "prediction.iteration_seconds", ("finite",)),
    Case("schedule-inf-in-map", SCHED,
         _mutated(_good_schedule_bytes, _set("prediction", "busy_seconds_per_channel", "H2D", value=float("inf"))),
         "prediction.busy_seconds_per_channel.H2D", ("finite",)),
    Case("schedule-negative-budget", SCHED, _mutated(_good_schedule_bytes, _set("budgets", "device_bytes", value=-1)),
         "budgets.device_bytes", (">= 0",)),
    Case("schedule-int-beyond-64-bit", SCHED, _mutated(_good_schedule_bytes, _set("budgets", "device_bytes", value=2**64 - 1)),
         "budgets.device_bytes", ("64-bit",)),
    # Action.bucket (a per-bucket REDUCE_SCATTER, Note [reduce-scatter per bucket]): only on a REDUCE_SCATTER
    Case("schedule-bucket-on-a-fetch", SCHED, _mutated(_good_schedule_bytes, _set("actions", _FETCH, "bucket", value=[0])),
         f"actions[{_FETCH}].bucket", ("only a REDUCE_SCATTER",)),
    Case("schedule-more-ranks-than-chunks", SCHED,
         _mutated(_good_schedule_bytes, _set("header", "world_size", value=2**63 - 1)), "header.world_size",
         ("at most the number of chunks", str(2**63 - 1))),
    Case("schedule-zero-chunk-size", SCHED, _mutated(_good_schedule_bytes, _set("layout", "chunk_elements", value=0)),
         "layout.chunk_elements", (">= 1",)),
    Case("schedule-dangling-tensor-chunk", SCHED, _mutated(_good_schedule_bytes, _set("layout", "tensors", 1, "chunk", value=9)),
         "layout.tensors[1].chunk", ("chunk id", "9")),
    Case("schedule-dangling-action-chunk", SCHED, _mutated(_good_schedule_bytes, _set("actions", _FETCH, "chunk", value=9)),
         f"actions[{_FETCH}].chunk", ("chunk id", "9")),
    Case("schedule-dangling-action-block", SCHED, _mutated(_good_schedule_bytes, _set("actions", _ACT, "block", value=9)),
         f"actions[{_ACT}].block", ("block id",)),
    Case("schedule-dangling-action-moment", SCHED, _mutated(_good_schedule_bytes, _set("actions", -1, "moment", value=99)),
         f"actions[{len(example_schedule().actions) - 1}].moment", ("moment below", "99")),
    Case("schedule-dangling-moment-tensor", SCHED,
         _mutated(_good_schedule_bytes, lambda d: d["moments"][1]["tensors"].append(99)), "moments[1].tensors[2]", ("99",)),
    Case("schedule-dangling-residency", SCHED, _mutated(_good_schedule_bytes, _set("initial_residency", 0, "chunk", value=9)),
         "initial_residency[0].chunk", ("chunk id",)),
    Case("schedule-overlapping-tensors", SCHED,
         _mutated(_good_schedule_bytes, _set("layout", "tensors", 2, "offset_elements", value=10)), "layout.tensors[",
         ("overlap",)),
    Case("schedule-tensor-outside-chunk", SCHED,
         _mutated(_good_schedule_bytes, _set("layout", "tensors", 1, "offset_elements", value=2047)), "layout.tensors[1]",
         ("inside chunk",)),
    Case("schedule-numel-disagrees", SCHED, _mutated(_good_schedule_bytes, _set("layout", "tensors", 1, "numel", value=3)),
         "layout.tensors[1].numel", ("product of shape",)),
    Case("schedule-actions-unsorted", SCHED, _mutated(_good_schedule_bytes, _set("actions", 1, "moment", value=0)),
         "actions[1].moment", ("sorted",)),
    Case("schedule-action-missing-src", SCHED, _mutated(_good_schedule_bytes, _set("actions", _FETCH, "src", value=None)),
         f"actions[{_FETCH}].src", ("FETCH",)),
    Case("schedule-copy-to-itself", SCHED, _mutated(_good_schedule_bytes, _set("actions", _FETCH, "src", value="DEVICE")),
         f"actions[{_FETCH}].dst", ("other than",)),
    Case("schedule-stages-short", SCHED, _mutated(_good_schedule_bytes, lambda d: d["stages"].pop()), "stages",
         ("covering",)),
    Case("schedule-list-without-dtype", SCHED, _mutated(_good_schedule_bytes, lambda d: d["layout"]["list_dtypes"].pop("GRAD")),
         "layout.list_dtypes", ("GRAD",)),
    Case("schedule-missing-chunk-plan", SCHED, _mutated(_good_schedule_bytes, lambda d: d["chunk_plans"].pop()), "chunk_plans",
         ("one plan per chunk",)),
]

ALL_CASES = TRACE_CASES + HW_CASES + SCHEDULE_CASES


def _assert_one_clear_line(message: str, path: Path, case: Case) -> None:
    assert "\n" not in message, message
    assert str(path) in message, message
    assert "Fix:" in message or "check the path" in message, message
    if case.path is not None:
        assert f": {case.path}" in message, message
    for word in case.words:
        assert word in message, (word, message)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_bad_file_gives_one_clear_line(case: Case, tmp_path: Path) -> None:
    path = case.build(tmp_path)
    with pytest.raises(FormatError) as info:
        case.reader.read(path)
    _assert_one_clear_line(str(info.value), path, case)


@pytest.mark.parametrize("reader", [Trace, Schedule, Hardware], ids=lambda r: r.__name__)
def test_missing_file_and_directory(reader: Any, tmp_path: Path) -> None:
    missing = tmp_path / "nope.msgpack"
    with pytest.raises(FormatError, match="no such file") as info:
        reader.read(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(FormatError, match="directory") as info:
        reader.read(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_load_any_rejects_unknown_format(tmp_path: Path) -> None:
    path = tmp_path / "other.msgpack"
    path.write_bytes(msgpack.packb({"format": "tide.model", "format_version": 1}))
    with pytest.raises(FormatError, match="tide.model") as info:
        load_any(str(path))
    assert str(path) in str(info.value)


def _validate_in_process(path: Path) -> tuple[int, str, str]:
    """`python -m planner validate PATH` as `planner/__main__.py` runs it (`SystemExit(main(argv))`), in
    this interpreter: (exit code, stdout, stderr). An exception escaping main() is the traceback a user
    would see, and fails the test as one."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = planner_main(["validate", str(path)])
    return code, out.getvalue(), err.getvalue()


def _validate_in_a_child(path: Path) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "planner", "validate", str(path)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_validate_exits_2_with_one_line(tmp_path: Path) -> None:
    """Every bad case (plus a missing file and a directory) through `python -m planner validate`.

    Each case runs through the CLI's main() in this process (a fresh interpreter per case cost ~0.3 s
    of imports each, 85 of them); the process boundary itself (`python -m planner`, its exit status,
    no traceback) is checked with real children on the missing file and the first case of each format.
    """
    targets: list[tuple[str, Path]] = []
    for case in ALL_CASES:
        folder = tmp_path / case.name
        folder.mkdir()
        targets.append((case.name, case.build(folder)))
    targets += [("missing", tmp_path / "missing.msgpack"), ("directory", tmp_path)]
    in_children = {"missing", TRACE_CASES[0].name, HW_CASES[0].name, SCHEDULE_CASES[0].name}

    def run(target: tuple[str, Path]) -> tuple[str, Path, tuple[int, str, str]]:
        return target[0], target[1], _validate_in_a_child(target[1])

    with ThreadPoolExecutor(max_workers=2) as pool:
        children = list(pool.map(run, [t for t in targets if t[0] in in_children]))
    results = [(name, path, _validate_in_process(path)) for name, path in targets] + children
    assert len(children) == len(in_children)
    for name, path, (code, stdout, stderr) in results:
        assert code == 2, (name, code, stderr)
        assert "Traceback" not in stderr, (name, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, (name, stderr)
        assert str(path) in lines[0], (name, lines[0])
        assert stdout == "", (name, stdout)


# ----------------------------------------------------------------------------- atomic writes


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_invalid_object_is_never_written(tmp_path: Path) -> None:
    trace = example_trace()
    bad = dataclasses.replace(trace, tensors=(dataclasses.replace(trace.tensors[0], bytes=1), *trace.tensors[1:]))
    with pytest.raises(FormatError, match=r"tensors\[0\]\.bytes") as info:
        bad.write(tmp_path / "t.msgpack")
    assert "(trace being written)" in str(info.value)
    assert _listing(tmp_path) == []

    schedule = example_schedule()
    bad_schedule = dataclasses.replace(schedule, stages=schedule.stages[:-1])
    with pytest.raises(FormatError, match="stages"):
        bad_schedule.write(tmp_path / "s.msgpack")
    assert _listing(tmp_path) == []


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "t.msgpack"
    example_trace().write(target)
    before = target.read_bytes()
    trace = example_trace(n_blocks=3)
    bad = dataclasses.replace(trace, moments=trace.moments[::-1])  # ids no longer dense
    with pytest.raises(FormatError):
        bad.write(target)
    assert target.read_bytes() == before
    assert _listing(tmp_path) == ["t.msgpack"]


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_interrupted_write_leaves_nothing_behind(failing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "out.msgpack"
    target.write_bytes(b"old")

    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(base.os, failing, boom)
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"new contents")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert _listing(tmp_path) == ["out.msgpack"]


def test_atomic_write_replaces_and_sets_usual_permissions(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.bin"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert _listing(target.parent) == ["out.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
