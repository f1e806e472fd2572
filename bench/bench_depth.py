"""Where the solve time of a deep model goes (issue 18, "scale with depth").

    python bench/bench_depth.py [--blocks 32,64,96,128,256,512] [--preset a100-80g-12ssd]
                                [--time-limit 60]

Builds the depth ladder from `planner.families.gpt_trace` (hidden 4096, 32 heads, sequence 1024,
batch 8, fp16: what issue 18 measured) and runs the real `planner.solve.solve_report` with its
stages wrapped in timers: layout + placement input per chunk size, LP (GLOP), MIP (HiGHS: build and
solve apart, with its nodes and termination), materialize, simulate, the PatrickStar OS-margin
bisection, the physical bound. (The LP-integral fixing of the prototype
`planner.placement_scaled` now lives in `planner.solve._solve_mip`.)

True gap = (simulated - valid lower bound) / simulated: the header's gap.
CPU seconds on the shared 2-core CI box: ratios from one run, not absolutes.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import planner.bounds as bounds_mod  # noqa: E402
import planner.layout as layout_mod  # noqa: E402
import planner.materialize as materialize_mod  # noqa: E402
import planner.placement as placement_mod  # noqa: E402
import planner.simulate as simulate_mod  # noqa: E402
import planner.solve as solve_mod  # noqa: E402
from planner.families import gpt_trace  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from schemas._base import digest_bytes  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
MIPS: list[str] = []
_DEPTH = [0]  # nested timers (materialize inside the OS margin) count once, in the outer one


def _timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outer = _DEPTH[0] == 0
        _DEPTH[0] += 1
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
            if outer:
                TIMES[label] += time.process_time() - start
                COUNTS[label] += 1
    return wrapper


def _instrument() -> None:
    """Wrap the stages of solve_report (module attributes are looked up at call time)."""
    model_cls = placement_mod.PlacementModel
    init, solve = model_cls.__init__, model_cls.solve

    def timed_init(self, data, *args, **kwargs):
        start = time.process_time()
        init(self, data, *args, **kwargs)
        key = "build LP" if self.relax else "build MIP"
        TIMES[key] += time.process_time() - start
        COUNTS[key] += 1

    def timed_solve(self, *args, **kwargs):
        key = "LP" if self.relax else "MIP"
        start = time.process_time()
        try:
            return solve(self, *args, **kwargs)
        finally:
            TIMES[key] += time.process_time() - start
            COUNTS[key] += 1
            result = getattr(self, "result", None)
            if not self.relax and result is not None:
                stats = result.solve_stats
                pinned = "modes pinned" if self.fixed_modes is not None else "modes free"
                MIPS.append(f"chunk {max(g.elements for g in self.original.chunk_classes)} el, {len(self.original.chunk_classes)} chunk classes {len(self.original.stages)} stages {pinned}: "
                            f"{result.termination.reason.name} nodes={stats.node_count} "
                            f"obj={result.objective_value():.1f} bound={result.termination.objective_bounds.dual_bound:.1f} "
                            f"{time.process_time() - start:.2f} s")

    model_cls.__init__ = timed_init
    model_cls.solve = timed_solve
    materialize_mod.materialize = _timed("materialize", materialize_mod.materialize)
    simulate_mod.simulate = _timed("simulate", simulate_mod.simulate)
    solve_mod._os_margin = _timed("os margin (materialize bisection)", solve_mod._os_margin)
    solve_mod.placement_input = _timed("placement input", solve_mod.placement_input)
    layout_mod.build_layout = _timed("layout", layout_mod.build_layout)
    solve_mod.materialize = _timed("materialize", solve_mod.materialize)  # solve's own names
    materialize_mod.simulate = _timed("simulate", materialize_mod.simulate)  # the replays of materialize_replayed
    solve_mod.lower_bound = _timed("physical bound", bounds_mod.lower_bound)
    solve_mod.root_bound_seconds = _timed("root node bound", solve_mod.root_bound_seconds)
    solve_mod._fixed = _timed("LP-integral fixing (build + MIP)", solve_mod._fixed)
    solve_mod._least_demanding = _timed("least demanding (explain)", solve_mod._least_demanding)


def depth_trace(blocks: int):
    trace = gpt_trace(layers=blocks, hidden=4096, heads=32, seq=1024, batch=8, dtype="float16", name=f"gpt-{blocks}x4096")
    return trace, digest_bytes(trace.to_msgpack())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="32,64,96,128,256,512")
    parser.add_argument("--preset", default="a100-80g-12ssd")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--named", default="", help="traces of bench/bench_solve.py instead (e.g. 175b)")
    args = parser.parse_args()
    _instrument()
    hw = resolve_hardware(args.preset)
    runs = args.named.split(",") if args.named else [int(x) for x in args.blocks.split(",")]
    for n in runs:
        if isinstance(n, str):
            sys.path.insert(0, str(REPO / "bench"))
            from bench_solve import load

            trace, digest, _ = load(n)
        else:
            trace, digest = depth_trace(n)
        if True:
            TIMES.clear()
            COUNTS.clear()
            MIPS.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                report = solve_mod.solve_report(trace, hw, trace_digest=digest, time_limit_s=args.time_limit)
                h = report.schedule.header
                true_gap = (report.simulated_seconds - h.lower_bound_seconds) / report.simulated_seconds
                outcome = (f"objective {h.objective_seconds:.4f} bound {h.lower_bound_seconds:.4f} simulated "
                           f"{report.simulated_seconds:.4f} true gap {100 * true_gap:.2f}% chosen: {report.chosen}")
            except Exception as exc:  # noqa: BLE001 (a bench prints what happened)
                outcome = f"FAILED {type(exc).__name__}: {str(exc)[:160]}"
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"\n== {n} {'blocks' if isinstance(n, int) else ''}, {args.preset}: today's solve {wall:.2f} s wall, {cpu:.2f} s CPU; {outcome}")
            for key in sorted(TIMES, key=lambda k: -TIMES[k]):
                print(f"   {key:36s} {TIMES[key]:8.2f} s CPU  x{COUNTS[key]}")
            for line in MIPS:
                print(f"   MIP {line}")
        sys.stdout.flush()
    print("\nmachine: 2-core shared CPU CI box; CPU seconds of this process (HiGHS and GLOP run one thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
