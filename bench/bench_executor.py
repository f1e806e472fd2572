"""Executor overhead and prediction accuracy (issue 6 targets).

1. Unlimited budget (everything on DEVICE, the planner's `pytorch` schedule): typical iteration time
   (the statistic of 2. below) of the executor vs plain PyTorch with `torch.optim.AdamW(fused=True)`, same model, same batch,
   iterations interleaved (engine, plain, engine, ...) so both see the same machine noise.
   Target: ratio <= 1.05.
2. Offloading forced (DEVICE budget a fraction of the model data) on a hardware profile measured on
   this machine by `python -m executor profile`: the typical iteration time (a 20%-trimmed mean of the
   timed iterations, the statistic the recorder prices moments with: executor/recorder.py
   `typical_runs`) vs the simulator's prediction for the schedule. Target (issue 17): within
   0.90-1.10, and when not, the resource the simulator mispriced: compute, the engine's moment
   actions on the training thread (not priced), copy busy time per channel (the copy worker's
   measured seconds vs the simulator's busy seconds), stalls, CPU / DEVICE Adam steps.

    python bench/bench_executor.py                       # GPT-2-small config, batch 4, seq 256, fp32
    python bench/bench_executor.py --model gpt-small --iters 20 --offload-iters 20   # quick

Prints a table; CPU timings are ratios from one run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import executor
from executor.models import build_model, make_batch, model_spec
from executor.recorder import record, typical_runs, typical_seconds
from planner.policies import baseline
from planner.layout import build_layout, candidate_chunk_sizes
from planner.materialize import Decisions, EvictionRule, materialize
from planner.presets import resolve_hardware
from planner.problem import build_problem
from planner.simulate import simulate
from schemas import Hardware
from schemas._base import digest_bytes
from schemas.schedule import ActivationMode, Channel, ChunkList, ChunkPlan, Tier
from schemas.trace import Phase

GB = 1e9


def _loss(model, batch):
    return model(**batch)


def offloaded_schedule(trace, hardware, digest: str, device_bytes: int):
    """The planner's schedule for a DEVICE budget of `device_bytes` (solve when it is there)."""
    try:
        from planner.solve import solve
    except ImportError:
        solve = None
    if solve is not None:
        return solve(trace, hardware, trace_digest=digest, device_bytes=device_bytes), "planner.solve"
    problem = build_problem(trace, hardware, trace_digest=digest, device_bytes=device_bytes)
    sizes = candidate_chunk_sizes(problem)
    layout = build_layout(problem, chunk_elements=sizes[len(sizes) // 2])
    chunk_bytes = max(c.elements for c in layout.chunks) * problem.list_itemsize(ChunkList.PARAM)
    plans = tuple(ChunkPlan(chunk=c.id, os_tier=Tier.HOST, optimizer_tier=Tier.HOST) for c in layout.chunks)
    budget = chunk_bytes * 2
    while True:
        d = Decisions(policy="tide", layout=layout, chunk_plans=plans,
                      activation_modes=(ActivationMode.KEEP,) * len(problem.blocks),
                      param_device_budget_bytes=(budget,) * len(problem.moments), persistent_chunks=frozenset(),
                      optimizer_overlap=True, prefetch=True, eviction=EvictionRule.BELADY_CLEAN_FIRST)
        try:
            return materialize(problem, d), "planner.materialize (OS on HOST, overlapped CPU Adam)"
        except Exception:  # noqa: BLE001 - the budget below one block's chunks: grow it
            budget += chunk_bytes
            if budget > device_bytes:
                raise


def simulated_phase_seconds(sim, schedule) -> dict[Phase, float]:
    """Wall seconds of each phase in the simulated iteration: from each moment's start to the next
    (the last to the iteration's end), as the engine counts `seconds_per_phase`."""
    starts = list(sim.moment_start_seconds) + [sim.iteration_seconds]
    out: dict[Phase, float] = {}
    for m, (a, b) in zip(schedule.moments, zip(starts, starts[1:])):
        out[m.phase] = out.get(m.phase, 0.0) + max(0.0, b - a)
    return out


class Instruments:
    """Bench-side clocks on an engine (nothing in executor/ changes): the emulated DEVICE's copy worker's
    busy seconds per channel (each chunk copy's memcpy timed on the worker, CPU time and wall time;
    activation copies count as "activations") and the training thread's seconds in the engine's moment actions (`Engine._apply`)
    less the stalls and DEVICE optimizer steps inside them: the per-moment cost the simulator does not
    price. Cumulative; `take()` returns what the last iteration added. CPU only (a GPU's copies are
    asynchronous: their busy time needs CUDA events, not a host clock)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        # busy = CPU time of the worker thread in the memcpy (page faults included), as the CPU Adam steps'
        # busy clock: on 2 cores the worker runs beside a 2-thread backward, so its wall time also counts
        # the time it waits for a core; the wall time is kept beside it
        self.copy_seconds: dict[str, float] = defaultdict(float)
        self.copy_wall_seconds: dict[str, float] = defaultdict(float)
        self.action_seconds = 0.0
        self._channel: str | None = None
        self._last: dict[str, float] = {}
        store = engine.store
        if store.on_gpu:
            self.enabled = False
            return
        self.enabled = True
        store_copy, worker_copy, apply = store.copy, store.copies.copy, engine._apply

        def copy_on_channel(lst, chunk, src, dst, channel, **kwargs):
            self._channel = channel.value
            try:
                return store_copy(lst, chunk, src, dst, channel, **kwargs)
            finally:
                self._channel = None

        def timed_copy(dst, src, *, after, fn=None, **kwargs):
            channel, inner = self._channel or "activations", fn or (lambda d, s: d.copy_(s))

            def run(d, s):
                start, start_cpu = time.perf_counter(), time.thread_time()
                try:
                    return inner(d, s)
                finally:
                    self.copy_seconds[channel] += time.thread_time() - start_cpu
                    self.copy_wall_seconds[channel] += time.perf_counter() - start

            return worker_copy(dst, src, after=after, fn=run, **kwargs)

        def timed_apply(m):
            stall, device_adam = engine.stall_seconds(), self._device_adam()
            start = time.perf_counter()
            try:
                return apply(m)
            finally:
                self.action_seconds += (time.perf_counter() - start - (engine.stall_seconds() - stall)
                                        - (self._device_adam() - device_adam))

        store.copy, store.copies.copy, engine._apply = copy_on_channel, timed_copy, timed_apply

    def _device_adam(self) -> float:
        return self.engine._stats.optimizer_seconds.get(Tier.DEVICE, 0.0)

    def take(self) -> dict[str, float]:
        now = ({f"copy {k}": v for k, v in self.copy_seconds.items()}
               | {f"copy wall {k}": v for k, v in self.copy_wall_seconds.items()} | {"actions": self.action_seconds})
        out = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last = now
        return out


def mispriced_rows(stats, sim, schedule, measured: float, *, instruments: dict[str, float] | None = None,
                   plain: float | None = None, recorded: float | None = None) -> list[tuple[str, str]]:
    """Measured vs predicted per resource (issue 17 item 6), each the typical iteration's: compute
    (forward + backward wall less the stalls and the engine's actions), the engine's moment actions on
    the training thread (the simulator prices none), copies (the stalls the training thread waits for
    them, and each channel's busy seconds on the copy worker vs the simulator's), CPU / DEVICE optimizer
    steps (seconds in ChunkAdamW.step_chunk vs the simulator's busy time) and the optimizer phase's
    wall. Outside 0.90-1.10 the resource with the largest |measured - predicted| on the training
    thread is named as mispriced, and every busy time off its prediction by more than 10% is listed."""
    instruments = instruments or {}
    sim_phase = simulated_phase_seconds(sim, schedule)
    got_phase = stats.seconds_per_phase
    device_adam = sum(i.end_seconds - i.start_seconds for i in sim.timeline
                      if i.channel is Channel.COMPUTE and i.label.startswith("adam"))
    fb = (Phase.FORWARD, Phase.BACKWARD)
    actions = instruments.get("actions", 0.0)
    # on the training thread: what the iteration's wall is made of
    thread = {
        "compute (fwd+bwd wall - stalls - engine actions)": (
            sum(got_phase.get(p, 0.0) for p in fb) - stats.stall_seconds - actions,
            sum(sim_phase.get(p, 0.0) for p in fb) - sim.stall_seconds),
        "engine moment actions, less stalls (not priced)": (actions, 0.0),
        "copies (stalls waiting for them)": (stats.stall_seconds, sim.stall_seconds),
        "DEVICE Adam steps": (stats.optimizer_seconds_per_tier.get(Tier.DEVICE, 0.0), device_adam),
    }
    # beside it: busy time of the copy worker per channel and of the CPU optimizer worker
    beside = {
        # busy (CPU time of the 1-thread worker's steps), not wall: the worker runs at nice 19 beside
        # backward, so its wall time counts the time backward preempts it (executor/stepping._busy_clock)
        "CPU Adam steps (busy)": (stats.optimizer_busy_seconds_per_tier.get(Tier.HOST, 0.0),
                                  sim.busy_seconds_per_channel.get(Channel.CPU_OPTIMIZER, 0.0)),
    }
    for ch in (Channel.H2D, Channel.D2H):
        if sim.bytes_per_channel.get(ch, 0) and f"copy {ch.value}" in instruments:
            beside[f"{ch.value} copies (copy worker busy, {sim.bytes_per_channel[ch]:,} B)"] = (
                instruments[f"copy {ch.value}"], sim.busy_seconds_per_channel.get(ch, 0.0))
    rows = [(f"offload: {name} measured / predicted s", f"{got:.3f} / {want:.3f}")
            for name, (got, want) in (thread | beside).items()]
    for ch in (Channel.H2D, Channel.D2H):
        if f"copy wall {ch.value}" in instruments:
            rows.append((f"offload: {ch.value} copies wall on the copy worker (incl. waiting for a core) s",
                         f"{instruments[f'copy wall {ch.value}']:.3f}"))
    rows.append(("offload: CPU Adam steps wall (incl. preemption by backward) s",
                 f"{stats.optimizer_seconds_per_tier.get(Tier.HOST, 0.0):.3f}"))
    for phase in Phase:
        if phase in got_phase or phase in sim_phase:
            rows.append((f"offload: {phase.value.lower()} phase wall measured / predicted s",
                         f"{got_phase.get(phase, 0.0):.3f} / {sim_phase.get(phase, 0.0):.3f}"))
    for ch in (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE):
        if sim.bytes_per_channel.get(ch, 0) and f"copy {ch.value}" not in instruments:
            rows.append((f"offload: predicted {ch.value} busy s (bytes {sim.bytes_per_channel[ch]:,}; not timed here)",
                         f"{sim.busy_seconds_per_channel.get(ch, 0.0):.3f}"))
    ratio = measured / sim.iteration_seconds if sim.iteration_seconds else float("inf")
    if 0.90 <= ratio <= 1.10:
        rows.append(("offload: mispriced resource", "none (inside 0.90-1.10)"))
    else:
        worst = max(thread, key=lambda k: abs(thread[k][0] - thread[k][1]))
        got, want = thread[worst]
        rows.append(("offload: mispriced resource", f"{worst}: measured {got:.3f} s vs predicted {want:.3f} s "
                                                    f"({got - want:+.3f} s of the {measured - sim.iteration_seconds:+.3f} s)"))
        off = [f"{name} x{got / want:.2f}" for name, (got, want) in beside.items()
               if want > 0 and not 0.90 <= got / want <= 1.10]
        rows.append(("offload: busy time off its price by > 10% (beside the training thread)", "; ".join(off) or "none"))
        if plain is not None and recorded is not None:
            # plain PyTorch run interleaved with the engine is off the recording by as much: the machine
            # (other load, or drift since the recording), not the executor nor the prices
            rows.append(("offload: of it, the machine (plain PyTorch interleaved - recorded) s", f"{plain - recorded:+.3f}"))
            rows.append(("offload: of it, the executor (engine - plain PyTorch, typical) s", f"{measured - plain:+.3f}"))
    return rows


def typical_stats(per_iteration: list, times: list[float], instruments: list[dict[str, float]]):
    """The per-phase wall seconds, stalls, optimizer seconds and instrument clocks of the typical
    iteration: the mean over the iterations `typical_runs(times)` keeps (the recorder's statistic,
    dropped and kept whole, so the parts add up as in one iteration). `engine.stats()` holds the last
    iteration only: one sample, as noisy as one iteration."""
    kept = typical_runs(times)
    last = per_iteration[-1]

    def mean(get):
        return sum(get(per_iteration[i]) for i in kept) / len(kept)

    phases = {p for s in per_iteration for p in s.seconds_per_phase}
    tiers = {t for s in per_iteration for t in s.optimizer_seconds_per_tier}
    stats = dataclasses.replace(
        last,
        seconds_per_phase={p: mean(lambda s, p=p: s.seconds_per_phase.get(p, 0.0)) for p in phases},
        stall_seconds=mean(lambda s: s.stall_seconds),
        optimizer_seconds_per_tier={t: mean(lambda s, t=t: s.optimizer_seconds_per_tier.get(t, 0.0)) for t in tiers},
        optimizer_busy_seconds_per_tier={t: mean(lambda s, t=t: s.optimizer_busy_seconds_per_tier.get(t, 0.0))
                                         for t in tiers})
    keys = {k for d in instruments for k in d}
    clocks = {k: sum(instruments[i].get(k, 0.0) for i in kept) / len(kept) for k in keys}
    return stats, clocks


def load_rows(trace, times: list[float], plain_times: list[float], measured: float) -> list[tuple[str, str]]:
    """The measured/simulated ratio split into the executor's own cost (engine / plain PyTorch, run
    interleaved) and the machine's (plain PyTorch's typical iteration / the trace's recorded one: the
    recorder's statistic since session 5, the fastest of its runs in traces recorded before)."""
    recorded = sum(m.compute_seconds for m in trace.moments)
    plain = typical_seconds(plain_times)
    return [
        ("offload: plain PyTorch typical / median / fastest s/iter (interleaved)",
         f"{plain:.3f} / {statistics.median(plain_times):.3f} / {min(plain_times):.3f}"),
        ("offload: engine median / fastest s/iter", f"{statistics.median(times):.3f} / {min(times):.3f}"),
        ("offload: recorded iteration s (trace: the recorder's typical of its runs)", f"{recorded:.3f}"),
        ("offload: executor's own cost: engine / plain PyTorch, typical (interleaved)", f"{measured / plain:.3f}"),
        ("offload: machine vs recording: plain PyTorch typical / recorded", f"{plain / recorded:.3f}"),
        ("offload: fastest / fastest: engine / plain PyTorch", f"{min(times) / min(plain_times):.3f}"),
    ]


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20, help="timed iterations of each loop (unlimited budget)")
    ap.add_argument("--offload-iters", type=int, default=10, help="timed iterations with offloading")
    ap.add_argument("--device-fraction", type=float, default=0.5,
                    help="DEVICE budget as a fraction of the model data bytes (offloaded part)")
    ap.add_argument("--hardware", default=None, help="hardware TOML (default: measure with `python -m executor profile`)")
    ap.add_argument("--skip-unlimited", action="store_true")
    ap.add_argument("--skip-offload", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    spec = model_spec(args.model, batch=args.batch, seq=args.seq)
    batch = make_batch(spec)
    base = build_model(spec)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model {args.model}: {n_params / 1e6:.1f}M params, batch {args.batch}, seq {args.seq}, fp32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    start = time.perf_counter()
    trace = record(copy.deepcopy(base), batch, model_name=args.model)
    digest = digest_bytes(trace.to_msgpack())
    print(f"recorded in {time.perf_counter() - start:.1f} s: {len(trace.moments)} moments", flush=True)
    rows: list[tuple[str, str]] = []

    if not args.skip_unlimited:
        problem = build_problem(trace, resolve_hardware("cpu-emulated"), trace_digest=digest, device_bytes=1 << 40)
        schedule = baseline("pytorch", problem)
        model, plain = copy.deepcopy(base), copy.deepcopy(base)
        engine = executor.run(model, schedule, lr=1e-4, weight_decay=0.0, params=model.parameters())
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

        def engine_step():
            _loss(model, batch).backward()
            engine.step()

        def plain_step():
            _loss(plain, batch).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(2):  # warm-up
            engine_step()
            plain_step()
        t_engine, t_plain = [], []
        for i in range(args.iters):
            t_engine.append(timed(engine_step))
            t_plain.append(timed(plain_step))
            print(f"  iteration {i}: executor {t_engine[-1]:.3f} s, plain {t_plain[-1]:.3f} s", flush=True)
        me, mp = typical_seconds(t_engine), typical_seconds(t_plain)
        rows += [("unlimited: executor typical s/iter", f"{me:.3f}"), ("unlimited: plain PyTorch typical s/iter", f"{mp:.3f}"),
                 ("unlimited: ratio executor/plain (target <= 1.05)", f"{me / mp:.3f}"),
                 ("unlimited: bytes moved per iteration", str(sum(engine.stats().bytes_per_channel.values())))]
        engine.detach()
        del model, plain, engine, opt

    if not args.skip_offload:
        with tempfile.TemporaryDirectory() as tmp:
            if args.hardware is None:
                hw_path = Path(tmp) / "hw.toml"
                subprocess.run([sys.executable, "-m", "executor", "profile", "-o", str(hw_path), "--device-memory-gb", "1.0"],
                               check=True)
                hardware = Hardware.read(hw_path)
            else:
                hardware = resolve_hardware(args.hardware)
        model_bytes = n_params * 16  # fp32 params, grads, Adam m and v
        non_model_bytes = max(m.non_model_bytes for m in trace.moments)  # activations stay on DEVICE
        device_bytes = non_model_bytes + int(model_bytes * args.device_fraction)
        schedule, how = offloaded_schedule(trace, hardware, digest, device_bytes)
        sim = simulate(schedule, hardware)
        model, plain = copy.deepcopy(base), copy.deepcopy(base)
        engine = executor.run(model, schedule, lr=1e-4, weight_decay=0.0, params=model.parameters())
        instruments = Instruments(engine)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

        def offload_step():
            _loss(model, batch).backward()
            engine.step()

        def plain_step():
            _loss(plain, batch).backward()
            opt.step()
            opt.zero_grad()

        offload_step()  # warm-up
        plain_step()
        instruments.take()
        # plain PyTorch interleaved with the engine (engine, plain, engine, ...): on this shared machine
        # other helpers' load moves both alike, so engine / plain is the executor's own cost, and plain /
        # (the trace's forward+backward+optimizer) is the machine's state vs the recording's fastest run
        times, plain_times, per_iteration, clocks = [], [], [], []
        for i in range(args.offload_iters):
            times.append(timed(offload_step))
            per_iteration.append(engine.stats())
            clocks.append(instruments.take())
            plain_times.append(timed(plain_step))
            print(f"  offloaded iteration {i}: {times[-1]:.3f} s, plain PyTorch {plain_times[-1]:.3f} s", flush=True)
        measured = typical_seconds(times)  # the recorder's statistic (executor/recorder.py typical_runs)
        stats = engine.stats()  # bytes and peaks: the same every iteration
        typical, typical_clocks = typical_stats(per_iteration, times, clocks)
        rows += [
            ("offload: schedule from", how),
            ("offload: DEVICE budget bytes", f"{device_bytes:,} (non-model peak + {args.device_fraction:.0%} of "
                                             f"{model_bytes:,} model data bytes)"),
            ("offload: bytes per channel measured == predicted", str(stats.bytes_match(schedule))),
            ("offload: bytes moved per iteration", f"{sum(stats.bytes_per_channel.values()):,}"),
            ("offload: peak DEVICE chunk bytes", f"{stats.peak_bytes_per_tier[Tier.DEVICE]:,}"),
            ("offload: stall seconds per iteration (typical)", f"{typical.stall_seconds:.3f}"),
            ("offload: measured typical s/iter (20%-trimmed mean)", f"{measured:.3f}"),
            ("offload: simulator s/iter", f"{sim.iteration_seconds:.3f}"),
            ("offload: of which recorded forward+backward s (trace)",
             f"{sum(m.compute_seconds for m in trace.moments if m.phase is not Phase.OPTIMIZER):.3f}"),
            ("offload: measured forward+backward s (engine stats, typical)",
             f"{typical.seconds_per_phase.get(Phase.FORWARD, 0) + typical.seconds_per_phase.get(Phase.BACKWARD, 0):.3f}"),
            ("offload: measured/simulated (issue 17 target 0.90-1.10)", f"{measured / sim.iteration_seconds:.3f}"),
        ]
        rows += load_rows(trace, times, plain_times, measured)
        rows += mispriced_rows(typical, sim, schedule, measured, instruments=typical_clocks,
                               plain=typical_seconds(plain_times),
                               recorded=sum(m.compute_seconds for m in trace.moments))
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'figure':{width}}  value")
    for name, value in rows:
        print(f"{name:{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
