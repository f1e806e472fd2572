"""Where the placement model and the simulator disagree, per stage (issue 17 item 5, issue 18 item 3).

    python bench/bench_stage_gap.py --trace 175b --preset rtx4090-768g-12ssd [--top 8]
    python bench/bench_stage_gap.py --blocks 64 --preset a100-80g-12ssd

Runs `planner.solve.solve_report` and, for every placement MIP plan it replays, prints the model's
objective against the replay, then for the best MIP plan the stages where the model's stage_time and
the simulator's stage time (the replayed schedule's `predicted_seconds`) differ most, with the
simulator's busy seconds per channel inside each such stage, so the mechanism can be named.
Also the true gap of the solve: (simulated - bound) / simulated. CPU seconds on a shared box.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import planner.solve as solve_mod  # noqa: E402
from bench_solve import depth_trace, load  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=None, help="13b or 175b")
    ap.add_argument("--blocks", type=int, default=0)
    ap.add_argument("--preset", default="rtx4090-768g-12ssd")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    if args.blocks:
        trace, digest = depth_trace(args.blocks)
    else:
        trace, digest, _ = load(args.trace)
    hw = resolve_hardware(args.preset)
    seen = []
    original = solve_mod._evaluate

    def spy(problem, decisions, **kw):
        found = original(problem, decisions, **kw)
        if found is not None:
            seen.append(found)
        return found

    solve_mod._evaluate = spy
    cpu = time.process_time()
    r = solve_mod.solve_report(trace, hw, trace_digest=digest)
    cpu = time.process_time() - cpu
    h = r.schedule.header
    print(f"solve {cpu:.1f} s CPU; chosen {r.chosen}: simulated {r.simulated_seconds:.4f} s, bound "
          f"{h.lower_bound_seconds:.4f} s, true gap {100 * h.gap:.2f}% (LP {r.relaxation_bound_seconds:.4f}, physical "
          f"{r.physical_bound_seconds:.4f})")
    for what, s in r.evaluated:
        print(f"  replay {what}: {s:.4f}")
    placed = [e for e in seen if e.placement is not None]
    if not placed:
        return
    best = min(placed, key=lambda e: e.simulated_seconds)
    sol = best.placement
    print(f"best MIP plan {best.what}: model {sol.objective_seconds:.4f} vs replay {best.simulated_seconds:.4f} "
          f"({100 * (best.simulated_seconds / sol.objective_seconds - 1):+.1f}%)")
    stages = best.schedule.stages
    rows = []
    tl = best.replay.timeline
    for st, model in zip(stages, sol.stage_seconds):
        rows.append((st.predicted_seconds - model, st, model))
    tot_pos = sum(d for d, _, _ in rows if d > 0)
    tot_neg = sum(d for d, _, _ in rows if d < 0)
    print(f"sum over stages: sim - model = {tot_pos:+.3f} s (stages slower) {tot_neg:+.3f} s (faster)")
    starts = list(best.replay.moment_start_seconds) + [best.replay.iteration_seconds]
    by_phase = {}
    for d, st, _ in rows:
        by_phase[st.phase.value] = by_phase.get(st.phase.value, 0.0) + d
    print("by phase:", {k: round(v, 3) for k, v in by_phase.items()})
    for d, st, model in sorted(rows, key=lambda x: -abs(x[0]))[: args.top]:
        a, b = starts[st.first_moment], starts[st.last_moment + 1]
        busy = {}
        for iv in tl:
            lo, hi = max(a, iv.start_seconds), min(b, iv.end_seconds)
            if hi > lo:
                busy[iv.channel.value] = busy.get(iv.channel.value, 0.0) + hi - lo
        print(f"  stage {st.id} {st.name}: model {model:.4f} sim {st.predicted_seconds:.4f} ({d:+.4f}) busy "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(busy.items())))
    print(f"model channel bytes: { {k: round(v / 1e9, 2) for k, v in sol.channel_bytes.items()} } GB")
    print(f"sim channel bytes: { {k.value: round(v / 1e9, 2) for k, v in best.replay.bytes_per_channel.items() if v} } GB")
    print(f"sim busy: { {k.value: round(v, 2) for k, v in best.replay.busy_seconds_per_channel.items() if v} } s")


if __name__ == "__main__":
    main()
