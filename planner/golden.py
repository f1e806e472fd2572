"""Golden schedules: the planner's output for each shipped trace, committed under `traces/golden/`.

CI runs `python -m planner.golden --check`: it solves every (trace, preset, options) case of
`CASES` in memory and compares the bytes with `traces/golden/<name>.schedule.msgpack`. A change
in the planner's output that was not regenerated on purpose fails with the `planner diff` of the
committed schedule against the new one (exit 1).

To accept a change on purpose, regenerate and commit them (the one-liner of traces/golden/README.md):

    python -m planner.golden --write

Which cases, and why: Note [golden cases] above `CASES`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from schemas import FormatError, Schedule, Trace
from schemas._base import atomic_write_bytes, frozen
from schemas.trace import trace_digest

from planner.cli import run_reporting_errors
from planner.diff import diff_schedules, render_text
from planner.errors import PlannerError
from planner.presets import resolve_hardware
from planner.replays import available_cpus
from planner.solve import solve

REPO = Path(__file__).resolve().parent.parent
TRACE_DIR = REPO / "traces"
GOLDEN_DIR = TRACE_DIR / "golden"
SUFFIX = ".schedule.msgpack"


@frozen
class GoldenCase:
    """One committed schedule: `python -m planner solve traces/<trace>.msgpack --hardware <hardware>
    [--device-memory-gb <device_memory_gb>] -o traces/golden/<name>.schedule.msgpack`."""

    name: str  # file stem under traces/golden/
    trace: str  # file stem under traces/
    hardware: str  # preset name (traces/hardware/<hardware>.toml)
    device_memory_gb: float | None = None  # DEVICE budget override (None: the preset's)
    why: str = ""  # what the case covers

    @property
    def trace_path(self) -> Path:
        return TRACE_DIR / f"{self.trace}.msgpack"

    @property
    def golden_path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}{SUFFIX}"

    def command(self) -> str:
        memory = f" --device-memory-gb {self.device_memory_gb:g}" if self.device_memory_gb is not None else ""
        return (f"python -m planner solve traces/{self.trace}.msgpack --hardware {self.hardware}{memory} "
                f"-o traces/golden/{self.name}{SUFFIX}")


# Note [golden cases]:
# Cases are chosen so that `--check` stays under 60 s on a 2-core CI machine (`--check` prints the
# seconds per case; about 20 s in all when measured): each shipped trace on the preset of the paper
# it comes from, and the small real trace with a DEVICE budget small enough to force offloading.
# Left out for time: pstar-gpt-4b and pstar-gpt-12b on v100-32g-240g (49 s and 33 s to solve).
CASES: tuple[GoldenCase, ...] = (
    GoldenCase(name="gpt-small.cpu-emulated-0.05gb", trace="gpt-small", hardware="cpu-emulated", device_memory_gb=0.05,
               why="the real CPU trace with a DEVICE budget that forces chunk eviction and OS on HOST"),
    GoldenCase(name="gpt3-1.3b.rtx4090-768g-12ssd", trace="gpt3-1.3b", hardware="rtx4090-768g-12ssd",
               why="a model that nearly fits one consumer GPU"),
    GoldenCase(name="gpt3-13b.rtx4090-768g-12ssd", trace="gpt3-13b", hardware="rtx4090-768g-12ssd",
               why="Fuyou's GPT-3 13B on its RTX 4090 server (Fuyou Table 4)"),
    GoldenCase(name="gpt3-175b.a100-80g-12ssd", trace="gpt3-175b", hardware="a100-80g-12ssd",
               why="Fuyou's GPT-3 175B on the A100-80GB server with 12 SSDs: NVMe tier, 96 blocks"),
    GoldenCase(name="pstar-gpt-1b.v100-32g-240g", trace="pstar-gpt-1b", hardware="v100-32g-240g",
               why="PatrickStar's 1B GPT on its V100 node (PatrickStar Table 2)"),
    GoldenCase(name="pstar-gpt-4b.rtx4090-768g-12ssd", trace="pstar-gpt-4b", hardware="rtx4090-768g-12ssd",
               why="PatrickStar's 4B GPT (PatrickStar Table 2) on the consumer box; its V100 solve takes ~50 s"),
)


@frozen
class Outcome:
    """What `--check` found for one case."""

    case: GoldenCase
    ok: bool
    seconds: float  # solve time
    message: str  # one line: "unchanged", "missing", "changed", or the error
    diff: str = ""  # `planner diff` text of committed vs regenerated


def regenerate(case: GoldenCase) -> bytes:
    """Solve the case in memory; the bytes `--write` commits."""
    payload = case.trace_path.read_bytes() if case.trace_path.exists() else None
    if payload is None:
        raise PlannerError(f"golden case {case.name}: trace {case.trace_path} is missing; restore it or drop the case from "
                           f"planner/golden.py CASES")
    trace = Trace.from_msgpack(payload, source=str(case.trace_path))
    hardware = resolve_hardware(case.hardware)
    device_bytes = None if case.device_memory_gb is None else int(case.device_memory_gb * 1e9)
    # with the jobs `planner solve` takes by default: the committed bytes are those of any number of jobs
    schedule = solve(trace, hardware, trace_digest=trace_digest(payload), device_bytes=device_bytes, jobs=available_cpus())
    return schedule.to_msgpack()


def check_case(case: GoldenCase, *, golden_dir: Path = GOLDEN_DIR) -> Outcome:
    path = golden_dir / f"{case.name}{SUFFIX}"
    start = time.perf_counter()
    fresh = regenerate(case)
    seconds = time.perf_counter() - start
    if not path.exists():
        return Outcome(case=case, ok=False, seconds=seconds, message=f"missing {path}: run `python -m planner.golden --write`")
    committed = path.read_bytes()
    if committed == fresh:
        return Outcome(case=case, ok=True, seconds=seconds, message="unchanged")

    new = Schedule.from_msgpack(fresh, source=f"(regenerated {case.name})")
    try:
        old = Schedule.from_msgpack(committed, source=str(path))
    except FormatError as exc:
        return Outcome(case=case, ok=False, seconds=seconds, message=f"changed: the committed file no longer reads ({exc})")
    d = diff_schedules(old, new, old_label=f"committed {path.name}", new_label="regenerated",
                       identical=False)  # equal objects with different bytes still fail: the file must be byte-identical
    if old == new:
        return Outcome(case=case, ok=False, seconds=seconds,
                       message="changed: same schedule, different bytes (encoding changed)", diff=render_text(d))
    return Outcome(case=case, ok=False, seconds=seconds, message="changed", diff=render_text(d))


def stale_files(cases: Sequence[GoldenCase], *, golden_dir: Path = GOLDEN_DIR) -> list[Path]:
    """Golden files no case produces (a renamed or removed case)."""
    names = {f"{c.name}{SUFFIX}" for c in cases}
    return sorted(p for p in golden_dir.glob(f"*{SUFFIX}") if p.name not in names)


def check(cases: Sequence[GoldenCase] = CASES, *, golden_dir: Path = GOLDEN_DIR, out=sys.stdout) -> int:
    """Print one line per case (and the diff of each changed one); 0 if all unchanged, else 1."""
    failed = 0
    total = 0.0
    for case in cases:
        try:
            outcome = check_case(case, golden_dir=golden_dir)
        except (PlannerError, FormatError) as exc:  # one broken case must not hide the others' diffs
            outcome = Outcome(case=case, ok=False, seconds=0.0, message=f"cannot regenerate: {exc}")
        total += outcome.seconds
        print(f"{'ok  ' if outcome.ok else 'FAIL'} {case.name}: {outcome.message} ({outcome.seconds:.1f} s)", file=out)
        if outcome.diff:
            print("    " + outcome.diff.replace("\n", "\n    "), file=out)
        failed += not outcome.ok
    for path in stale_files(CASES, golden_dir=golden_dir):
        print(f"FAIL {path.name}: no case in planner/golden.py CASES produces it; delete it (git rm) or add the case", file=out)
        failed += 1
    if failed:
        print(f"{failed} golden schedule(s) differ. If the change is intended, regenerate and commit them: "
              f"python -m planner.golden --write", file=out)
    else:
        print(f"all {len(cases)} golden schedules unchanged ({total:.1f} s solving)", file=out)
    return 1 if failed else 0


def write(cases: Sequence[GoldenCase] = CASES, *, golden_dir: Path = GOLDEN_DIR, out=sys.stdout) -> int:
    for case in cases:
        path = golden_dir / f"{case.name}{SUFFIX}"
        start = time.perf_counter()
        fresh = regenerate(case)
        seconds = time.perf_counter() - start
        before = path.read_bytes() if path.exists() else None
        atomic_write_bytes(path, fresh)
        state = "unchanged" if before == fresh else ("written" if before is None else "updated")
        print(f"{state} {path.relative_to(REPO) if path.is_relative_to(REPO) else path} ({seconds:.1f} s)", file=out)
    for path in stale_files(CASES, golden_dir=golden_dir):
        print(f"note: {path.name} is produced by no case; delete it (git rm) unless you mean to add the case back", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m planner.golden",
        description="Check (CI) or regenerate (on purpose) the golden schedules under traces/golden/.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="solve each case in memory and compare with the committed file")
    mode.add_argument("--write", action="store_true", help="regenerate and overwrite the committed files")
    mode.add_argument("--list", action="store_true", help="print the cases and the solve command of each")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="restrict to these case names")
    args = parser.parse_args(argv)
    cases = CASES
    if args.only:
        known = {c.name for c in CASES}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            print(f"error: no golden case {unknown[0]!r}; cases: {', '.join(sorted(known))}", file=sys.stderr)
            return 2
        cases = tuple(c for c in CASES if c.name in args.only)
    if args.list:
        for case in cases:
            print(f"{case.name}: {case.why}\n    {case.command()}")
        return 0

    return run_reporting_errors(lambda: check(cases) if args.check else write(cases))


if __name__ == "__main__":
    raise SystemExit(main())
