"""Where the placement model and the simulator disagree, per stage (issue 17 item 5, issue 18 item 3).

    python bench/bench_stage_gap.py --trace 175b --preset rtx4090-768g-12ssd [--top 8]
    python bench/bench_stage_gap.py --blocks 64 --preset a100-80g-12ssd

Runs `planner.solve.solve_report` and, for every placement MIP plan it replays, prints the model's
objective against the replay, then for the best MIP plan the stages where the model's stage_time and
the simulator's stage time (the replayed schedule's `predicted_seconds`) differ most, with the
simulator's busy seconds per channel inside each such stage, so the mechanism can be named.
Also the true gap of the solve: (simulated - bound) / simulated. CPU seconds on a shared box.

`--waits` (issue 17 item 5, issue 18 item 3): the best MIP plan replayed once more with the simulator's
`land` and `apply_action` observed (not changed), and every second the work waited past its event split
by phase and by what it waited for: the training thread held for DEVICE bytes a copy in flight still
reads (Note [simulator evictions]; by the list of the copy that lands last: GRAD / PARAM / OS write-back
or activation offload), the thread held by an ACT_RELOAD for its offload, the work's own allocation held
for DEVICE bytes, and data not there yet (by the channel of the copy that arrives last). Per phase and
channel it then says whether the waits are forced by the plan (the channel's busy seconds in the phase
exceed the phase's compute: no ordering hides the excess) or an ordering / budget artifact (the channel
has idle time in the phase, so the bytes could have moved while the work ran).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import planner.simulate as simulate_mod  # noqa: E402
import planner.solve as solve_mod  # noqa: E402
from bench_solve import depth_trace, load  # noqa: E402
from planner.costmodel import pcie_time_rows  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from schemas.schedule import Channel, Op  # noqa: E402


def _lines(marker: str) -> set[int]:
    """Line numbers in planner/simulate.py holding `marker` (where `land` is called from)."""
    src, _ = inspect.getsourcelines(simulate_mod)  # a module's source starts at line 1
    return {1 + k for k, line in enumerate(src) if marker in line}


def _kind(a) -> str:
    """What a copy whose DEVICE bytes are held is: its list and op (an EVICT names the list read)."""
    if a.op is Op.ACT_OFFLOAD:
        return "ACT offload"
    lst = a.list.value if a.list is not None else "?"
    return f"{lst} write-back" if lst in ("PARAM", "GRAD") else "OS write-back"


def replay_waits(schedule, hardware) -> dict:
    """Replay `schedule` observing the simulator; per moment: its stall split by cause (see the module doc)."""
    action_line = _lines("host = land_oldest(")
    work_line = _lines("deps = max(deps, land_oldest(")
    start_line = _lines("land(sim, start)")
    label: dict[int, tuple[str, Channel]] = {}  # id(landing entry) -> (kind, channel of the copy reading it)
    last_copy: dict[tuple, Channel] = {}  # (list, chunk) -> channel of the last copy reading its DEVICE copy
    thread: dict[int, list] = defaultdict(list)  # moment -> [(cause, seconds)]
    work_bytes_wait: dict[int, tuple[str, Channel, float]] = {}
    per_moment: dict[int, tuple[float, float, float]] = {}  # moment -> (event, host, deps)
    data_ready: dict[int, tuple[float, str]] = {}
    orig_land, orig_oldest, orig_apply = simulate_mod.land, simulate_mod.land_oldest, simulate_mod.apply_action
    state = {"host": None, "m": -1}
    fetched: dict[int, tuple[float, str]] = {}  # moment -> (latest FETCH end, what)

    def spy_apply(sim, a, i, issue, blocks, act_bytes, last_grad_write):
        if state["m"] != a.moment:
            state["m"], state["host"] = a.moment, None
        if state["host"] is not None and issue > state["host"] and a.op is Op.ACT_RELOAD:
            thread[a.moment].append(("thread: ACT_RELOAD waits for its offload", issue - state["host"]))
        n = len(sim.landing)
        end = orig_apply(sim, a, i, issue, blocks, act_bytes, last_grad_write)
        state["host"] = issue
        if a.op is Op.FETCH:  # the work waits for its moment's FETCHes
            lst = a.list.value if a.list.value in ("PARAM", "GRAD") else "OS"
            fetched[a.moment] = max(fetched.get(a.moment, (0.0, "")), (end, f"{lst} FETCH"))
        if a.op in (Op.WRITE_BACK, Op.FETCH, Op.PREFETCH) and a.src is not None and a.src.value == "DEVICE":
            last_copy[(a.list, a.chunk)] = a.channel
        for x in sim.landing[n:]:
            ch = a.channel if a.op is Op.ACT_OFFLOAD else last_copy.get((a.list, a.chunk), Channel.D2H)
            label[id(x)] = (_kind(a), ch)
        return end

    def spy_oldest(sim, t, fits):
        frame = sys._getframe(1)
        before = list(sim.landing)
        end = orig_oldest(sim, t, fits)
        left = {id(x) for x in sim.landing}
        waited = [x for x in before if id(x) not in left]
        if end > t and waited:
            kind, ch = label.get(id(max(waited, key=lambda x: x[0])), ("?", Channel.D2H))  # the last to land
            m = frame.f_locals["m"]
            if frame.f_lineno in action_line:
                thread[m].append((f"thread: DEVICE bytes of {kind} in flight ({ch.value})", end - t))
                state["host"] = end
            elif frame.f_lineno in work_line:
                work_bytes_wait[m] = (kind, ch, end - t)
        return end

    def spy_land(sim, t):
        frame = sys._getframe(1)
        line = frame.f_lineno
        if line in start_line:
            f = frame.f_locals
            m = f["m"]
            per_moment[m] = (f["event"], f["host"], f["deps"])
            # the data the work waited for: the latest of its chunks, grads and activations
            best = max((f["event"], ""), fetched.get(m, (0.0, "")))
            for c in f["needs"][m]:
                best = max(best, (sim.ready[f["pi"]][c][0], "PARAM"))
            for c in f["writes"][m]:
                best = max(best, (sim.ready[f["gi"]][c][0], "GRAD"))
            if m in f["bwd_first_of"]:
                best = max(best, (f["blocks"][f["bwd_first_of"][m]].ready_at, "ACT"))
            data_ready[m] = best
        return orig_land(sim, t)

    simulate_mod.land, simulate_mod.land_oldest, simulate_mod.apply_action = spy_land, spy_oldest, spy_apply
    try:
        result = simulate_mod.simulate(schedule, hardware)
    finally:
        simulate_mod.land, simulate_mod.land_oldest, simulate_mod.apply_action = orig_land, orig_oldest, orig_apply
    # which channel brought each moment's late data: the copy arriving last onto DEVICE before the work
    arrivals = sorted((iv.end_seconds, iv.channel.value) for iv in result.timeline
                      if iv.channel in (Channel.H2D, Channel.NVME_READ, Channel.D2H, Channel.NVME_WRITE,
                                        Channel.INTER_GPU))
    import bisect
    out: dict = {"moments": [], "result": result, "thread": thread}
    for mom in schedule.moments:
        m = mom.id
        if m not in per_moment:
            continue
        event, host, deps = per_moment[m]
        stall = max(0.0, deps - event)
        causes: dict[str, float] = defaultdict(float)
        if stall > 0:
            th = max(0.0, host - event)
            data_t, what = data_ready[m]
            bw = work_bytes_wait.get(m)
            pre = deps - (bw[2] if bw else 0.0)  # deps before the work's own DEVICE-bytes wait
            if th >= data_t - event and th > 0:  # the thread was the last to be ready
                known = sum(s for _, s in thread[m])
                for cause, s in thread[m]:
                    causes[cause] += min(s, th) * (th / known if known > th else 1.0)
                if known < th:
                    causes["thread: other"] += th - known
            elif pre > event:
                k = bisect.bisect_right(arrivals, (data_t + 1e-12, "~")) - 1
                ch = arrivals[k][1] if k >= 0 and abs(arrivals[k][0] - data_t) < 1e-9 else "?"
                what = what if " FETCH" not in what else what.replace(" FETCH", "")
                causes[f"data: {what} not there ({ch})"] += pre - event
            if bw:
                causes[f"work: DEVICE bytes of {bw[0]} in flight ({bw[1].value})"] += deps - max(pre, event)
        out["moments"].append((m, mom.phase.value, stall, dict(causes), event, deps + mom.compute_seconds))
    return out


def waits_report(schedule, hardware) -> None:
    """Print the wait table of one replay (see the module doc)."""
    w = replay_waits(schedule, hardware)
    r = w["result"]
    # a moment's window: from its event (the previous work's end) to its work's end; the OPTIMIZER
    # moment's to the iteration's end (the tail: copies and steps after the last work)
    windows: dict[str, list[float]] = {}
    for _, ph, _, _, lo, hi in w["moments"]:
        win = windows.setdefault(ph, [lo, hi])
        win[0], win[1] = min(win[0], lo), max(win[1], hi)
    if "OPTIMIZER" in windows:
        windows["OPTIMIZER"][1] = r.iteration_seconds
    busy: dict[tuple[str, str], float] = defaultdict(float)
    for iv in r.timeline:
        for ph, (lo, hi) in windows.items():
            a, b = max(lo, iv.start_seconds), min(hi, iv.end_seconds)
            if b > a:
                busy[(ph, iv.channel.value)] += b - a
    link_bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for a in schedule.actions:
        if a.channel in (Channel.H2D, Channel.D2H) and a.bytes:
            link_bytes[schedule.moments[a.moment].phase.value][a.channel.value] += a.bytes
    by: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    total: dict[str, float] = defaultdict(float)
    for _, ph, stall, causes, _, _ in w["moments"]:
        total[ph] += stall
        for k, v in causes.items():
            by[ph][k] += v
        if stall - sum(causes.values()) > 1e-9:
            by[ph]["unattributed"] += stall - sum(causes.values())
    held: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # every thread wait, on the path or not
    for m, items in w["thread"].items():
        for cause, v in items:
            held[schedule.moments[m].phase.value][cause.removeprefix("thread: ")] += v
    print(f"waits of the replay ({r.iteration_seconds:.3f} s; stall {r.stall_seconds:.3f} s)")
    for ph in ("FORWARD", "BACKWARD", "OPTIMIZER"):
        if ph not in windows:
            continue
        lo, hi = windows[ph]
        span = hi - lo
        compute = busy.get((ph, "COMPUTE"), 0.0)
        print(f"  {ph}: {span:.3f} s wall, COMPUTE busy {compute:.3f} s, work waited {total[ph]:.3f} s")
        for k, v in sorted(by[ph].items(), key=lambda x: -x[1]):
            print(f"    {v:8.3f} s  {k}")
        # forced: the busiest copy channel's seconds in the phase beyond COMPUTE's (the work cannot end
        # before the bytes the plan puts on that channel in the phase have moved, whatever the order);
        # the rest of the waits is materialize's ordering or budget (the channel idled meanwhile)
        copies = ("H2D", "D2H", "NVME_READ", "NVME_WRITE", "INTER_GPU")
        # the PCIe link moves both ways on shared rows (costmodel.pcie_time_rows, the simulator's two-way
        # link): its least time for the phase's H2D and D2H bytes (issued by the phase's actions)
        need = {ch: busy.get((ph, ch), 0.0) for ch in copies}
        need["PCIe rows"] = max(a * link_bytes[ph].get("H2D", 0) + b * link_bytes[ph].get("D2H", 0)
                                for a, b in pcie_time_rows(hardware))
        top = max(need, key=need.__getitem__)
        forced = min(total[ph], max(0.0, need[top] - compute))
        print(f"    => forced by the plan {forced:.3f} s ({top} {need[top]:.3f} s vs COMPUTE "
              f"{compute:.3f} s), artifact {total[ph] - forced:.3f} s")
        for k, v in sorted(held[ph].items(), key=lambda x: -x[1]):
            print(f"    (the training thread held {v:.3f} s in all: {k})")
        for ch in (*copies, "CPU_OPTIMIZER"):
            b = busy.get((ph, ch), 0.0)
            if b > 0:
                waited = sum(v for k, v in by[ph].items() if f"({ch})" in k)
                print(f"    {ch:>13} busy {b:8.3f} s, idle {span - b:7.3f} s; waits naming it {waited:7.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=None, help="13b or 175b")
    ap.add_argument("--blocks", type=int, default=0)
    ap.add_argument("--preset", default="rtx4090-768g-12ssd")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--waits", action="store_true", help="split the best MIP plan's waits by phase and cause")
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
    if args.waits:
        waits_report(best.schedule, hw)


if __name__ == "__main__":
    main()
