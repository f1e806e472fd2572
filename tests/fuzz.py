"""Fuzzing the readers (issue 21, item 6): mutated traces, schedules, hardware profiles and checkpoints.

Every mutated file goes through its reader (`Trace.read`, `Schedule.read`, `Hardware.read`,
`executor.state.load`) and the CLIs that read it (`planner validate`, `planner show`, and for a
schedule `planner simulate`); each must either accept it or refuse it with ONE line (a `FormatError`
/ `StateError`, exit 2 and one stderr line for a CLI): no traceback, no other exception, no read
longer than `MAX_SECONDS` (bench only: tests assert no time), no allocation above `ALLOC_FACTOR` x the file size + `ALLOC_CONSTANT_BYTES`
(tracemalloc peak of the reader).

Mutators: single and multiple bit flips, truncation, byte insert and delete, and field-level
mutations (decode, replace one value somewhere in the tree by another type or an extreme value,
encode: msgpack for traces and schedules, TOML for hardware, torch.save for checkpoints). A schedule
or checkpoint mutated field by field is resealed (its digest recomputed) half of the time, so the
checks behind the digest are fuzzed too. Case i of a format uses `random.Random(f"{seed}:{format}:{i}")`:
a failure replays with `python tests/fuzz.py --format F --seed S --case I`.

    tests/test_fuzz.py      a seeded sample in CI
    bench/bench_fuzz.py     >= 3000 per format, with the counts
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import random
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FORMATS = ("trace", "schedule", "hardware", "checkpoint")
MAX_SECONDS = 2.0  # per read (issue 21)
ALLOC_FACTOR = 64  # tracemalloc peak <= ALLOC_FACTOR * file bytes + ALLOC_CONSTANT_BYTES
ALLOC_CONSTANT_BYTES = 16 << 20

EXTREMES: tuple[Any, ...] = (None, True, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 1e-300, -0.0, 1e300, math.inf, -math.inf,
                             math.nan, "", "x" * 300, "DEVICE", "sha256:" + "0" * 64, [], [1, 2, 3], {}, {"a": 1}, b"\x00")


# ----------------------------------------------------------------------------- seeds (the valid files)


def seed_files(folder: Path) -> dict[str, Path]:
    """One valid file per format, made fresh (small: every case reads one)."""
    import torch

    sys.path.insert(0, str(HERE))
    folder.mkdir(parents=True, exist_ok=True)
    out = {
        "trace": REPO / "traces" / "gpt-small.msgpack",
        "schedule": REPO / "traces" / "golden" / "gpt-small.cpu-emulated-0.05gb.schedule.msgpack",
        "hardware": REPO / "traces" / "hardware" / "cpu-emulated.toml",
    }
    from executor import state
    from executor.optim import ChunkAdamW
    from test_optim_support import FakeStore, TinyLM, bind, layout_for, param_groups
    from test_state import _batches, _chunk_train

    torch.manual_seed(0)
    model = TinyLM()
    store = FakeStore(layout_for(model, chunk_elements=150))
    bind(model, store)
    opt = ChunkAdamW(param_groups(model), store.layout, model=model)
    _chunk_train(model, opt, store, _batches(1, seed=0))  # optimizer state to fuzz too
    ckpt = folder / "seed.pt"
    state.save(ckpt, store, model=model, optimizer=opt, extra={"iteration": 1})
    out["checkpoint"] = ckpt
    return out


# ----------------------------------------------------------------------------- mutators


def _bits(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 8))):
        i = rng.randrange(len(out) * 8)
        out[i // 8] ^= 1 << (i % 8)
    return bytes(out)


def _truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))]


def _insert(rng: random.Random, data: bytes) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + bytes(rng.randrange(256) for _ in range(rng.choice((1, 1, 4, 64)))) + data[i:]


def _delete(rng: random.Random, data: bytes) -> bytes:
    i = rng.randrange(len(data))
    return data[:i] + data[i + rng.choice((1, 1, 4, 64)):]


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree[:50]):  # enough variety; keeps huge lists cheap
            out += _paths(v, (*prefix, i))
    return out


def _mutate_tree(rng: random.Random, tree: Any, extremes: tuple[Any, ...] = EXTREMES) -> Any:
    tree = copy.deepcopy(tree)
    paths = [p for p in _paths(tree) if p]
    if not paths:
        return rng.choice(extremes)
    path = rng.choice(paths)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    action = rng.random()
    if action < 0.1 and isinstance(parent, dict):
        del parent[path[-1]]
    elif action < 0.2 and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[path[-1]]))
    elif action < 0.3 and isinstance(parent[path[-1]], (int, float)) and not isinstance(parent[path[-1]], bool):
        parent[path[-1]] = parent[path[-1]] + rng.choice((-1, 1))
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(extremes))
    return tree


def _field_msgpack(rng: random.Random, data: bytes, *, reseal: bool) -> bytes:
    import msgpack

    tree = msgpack.unpackb(data, raw=False)
    tree = _mutate_tree(rng, tree)
    if reseal and isinstance(tree, dict) and "content_digest" in tree:
        from schemas.schedule import seal

        with contextlib.suppress(Exception):
            tree = seal(tree)
    return msgpack.packb(tree, use_bin_type=True)


def _field_toml(rng: random.Random, data: bytes) -> bytes:
    import tomllib

    import tomli_w

    tree = tomllib.loads(data.decode())
    extremes = tuple(v for v in EXTREMES if v is not None and not isinstance(v, bytes))  # TOML has no null
    tree = _mutate_tree(rng, tree, extremes)
    try:
        return tomli_w.dumps(tree).encode()
    except (TypeError, ValueError):
        return data


def _field_checkpoint(rng: random.Random, data: bytes, *, reseal: bool) -> bytes:
    import torch

    from executor import state

    ckpt = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    plain = _to_tree(ckpt)
    paths = [p for p in _paths(plain) if p]
    path = rng.choice(paths)
    parent = ckpt
    for key in path[:-1]:
        parent = parent[key]
    value = parent[path[-1]]
    if isinstance(value, torch.Tensor) and rng.random() < 0.6:
        choice = rng.random()
        if choice < 0.4 and value.numel():
            flat = value.detach().clone().reshape(-1)
            flat[rng.randrange(flat.numel())] = rng.choice((0.0, 1e30, float("nan")))
            parent[path[-1]] = flat.view(value.shape)
        elif choice < 0.7:
            parent[path[-1]] = value.reshape(-1)[: max(0, value.numel() - 1)].clone()
        else:
            parent[path[-1]] = value.to(torch.float16)
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice([v for v in EXTREMES if not isinstance(v, bytes)]))
    if reseal and isinstance(ckpt, dict) and "content_digest" in ckpt:
        with contextlib.suppress(Exception):
            ckpt["content_digest"] = state.checkpoint_digest(ckpt)
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    return buffer.getvalue()


def _to_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_tree(v) for v in value]
    return 0  # tensors, scalars and tuples (immutable: replaced whole) are leaves


MUTATORS = ("bits", "truncate", "insert", "delete", "field")


def mutate(fmt: str, data: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(MUTATORS)
    if kind == "bits":
        return kind, _bits(rng, data)
    if kind == "truncate":
        return kind, _truncate(rng, data)
    if kind == "insert":
        return kind, _insert(rng, data)
    if kind == "delete":
        return kind, _delete(rng, data)
    reseal = rng.random() < 0.5
    if fmt == "hardware":
        return kind, _field_toml(rng, data)
    if fmt == "checkpoint":
        return kind, _field_checkpoint(rng, data, reseal=reseal)
    return kind, _field_msgpack(rng, data, reseal=reseal)


# ----------------------------------------------------------------------------- readers and CLIs


def _readers(fmt: str) -> list[tuple[str, Callable[[Path], Any]]]:
    from executor import state
    from planner.cli import main as planner_main
    from schemas import Hardware, Schedule, Trace

    def cli(*argv: str) -> Callable[[Path], Any]:
        def run(path: Path) -> Any:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = planner_main([*argv[:1], str(path), *argv[1:]])
            text = err.getvalue().strip()
            lines = [line for line in text.splitlines() if not line.startswith("warning:")]
            if code not in (0, 2) or len(lines) > 1 or (code == 2 and not lines):
                raise AssertionError(f"planner {argv[0]}: exit {code}, stderr {text[:300]!r}")
            if code == 2:
                raise CliRefused(lines[0])
            return code

        return run

    common = [("planner validate", cli("validate")), ("planner show", cli("show", "--json"))]
    if fmt == "trace":
        return [("Trace.read", Trace.read), *common]
    if fmt == "schedule":
        return [("Schedule.read", Schedule.read), *common, ("planner simulate", cli("simulate", "--json"))]
    if fmt == "hardware":
        return [("Hardware.read", Hardware.read), *common]
    return [("state.load", state.load)]


class CliRefused(Exception):
    """A CLI exited 2 with one line on stderr: the refusal the fuzzer expects."""


def _expected_errors() -> tuple[type[BaseException], ...]:
    from executor.state import StateError
    from schemas import FormatError

    return (FormatError, StateError, CliRefused)


@dataclass
class Outcome:
    counts: Counter = field(default_factory=Counter)  # "accepted" / "refused" per reader
    failures: list[str] = field(default_factory=list)
    slowest_seconds: float = 0.0
    worst_alloc_ratio: float = 0.0  # peak / (file bytes * ALLOC_FACTOR + constant)


def _read(reader: Callable[[Path], Any], path: Path, expected: tuple[type[BaseException], ...]) -> tuple[str, str]:
    """(accepted/refused/crashed, problem or "")."""
    try:
        reader(path)
        return "accepted", ""
    except expected as exc:
        return "refused", (f"several lines: {str(exc)[:200]!r}" if "\n" in str(exc) else "")
    except Exception as exc:  # noqa: BLE001 - what the fuzzer is for
        return "crashed", f"{type(exc).__name__}: {str(exc)[:200]}"


def run_case(fmt: str, seed: int, case: int, seed_bytes: bytes, folder: Path, outcome: Outcome, *, timed: bool) -> None:
    """One mutated file through every reader: the answer and the allocation (tracemalloc); with `timed`,
    also a second read without tracemalloc (which slows Python several times) against MAX_SECONDS."""
    rng = random.Random(f"{seed}:{fmt}:{case}")
    kind, data = mutate(fmt, seed_bytes, rng)
    suffix = ".toml" if fmt == "hardware" else (".pt" if fmt == "checkpoint" else ".msgpack")
    path = folder / f"case{suffix}"
    path.write_bytes(data)
    expected = _expected_errors()
    for name, reader in _readers(fmt):
        where = f"{fmt} case {case} ({kind}) {name}"
        tracemalloc.start()
        try:
            result, problem = _read(reader, path, expected)
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        outcome.counts[f"{name}: {result}"] += 1
        if problem:
            outcome.failures.append(f"{where}: {problem}")
        budget = ALLOC_FACTOR * len(data) + ALLOC_CONSTANT_BYTES
        outcome.worst_alloc_ratio = max(outcome.worst_alloc_ratio, peak / budget)
        if peak > budget:
            outcome.failures.append(f"{where}: allocated {peak} B > {budget} B")
        if timed:
            start = time.perf_counter()
            _read(reader, path, expected)
            seconds = time.perf_counter() - start
            outcome.slowest_seconds = max(outcome.slowest_seconds, seconds)
            if seconds > MAX_SECONDS:
                outcome.failures.append(f"{where}: {seconds:.2f} s > {MAX_SECONDS} s")


def fuzz(fmt: str, *, seed: int, cases: int, folder: Path | None = None, only: int | None = None,
         timed: bool = True) -> Outcome:
    """`timed=False` in CI: no timing assertion in tests (bench/bench_fuzz.py checks MAX_SECONDS)."""
    folder = folder or Path(tempfile.mkdtemp(prefix="tide-fuzz-"))
    seed_path = seed_files(folder / "seeds")[fmt]
    seed_bytes = seed_path.read_bytes()
    for _, reader in _readers(fmt):  # imports and caches warm: the time limit is for the read itself
        reader(seed_path)
    outcome = Outcome()
    for case in ([only] if only is not None else range(cases)):
        run_case(fmt, seed, case, seed_bytes, folder, outcome, timed=timed)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--case", type=int, help="replay one case")
    args = parser.parse_args(argv)
    outcome = fuzz(args.format, seed=args.seed, cases=args.cases, only=args.case)
    for key, count in sorted(outcome.counts.items()):
        print(f"  {key:40s} {count}")
    for failure in outcome.failures:
        print("FAIL", failure)
    return 1 if outcome.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
