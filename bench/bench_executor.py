"""Executor overhead and prediction accuracy (issue 6 targets).

1. Unlimited budget (everything on DEVICE, the planner's `pytorch` schedule): typical iteration time
   (the statistic of 2. below) of the executor vs plain PyTorch with `torch.optim.AdamW(fused=True)`, same model, same batch,
   iterations interleaved (engine, plain, engine, ...) so both see the same machine noise.
   Target: ratio <= 1.05.
2. Offloading forced (DEVICE budget a fraction of the model data), the schedule solved once on a
   hardware profile measured on this machine by `python -m executor profile`, then its prediction's
   inputs measured again *in the same minutes* as the iterations they predict (issue 17 item 6; this
   VM's speed drifts ~20% within minutes, so a recording made before the run prices another machine):
   `--rounds` rounds, each a short probe of the copy and CPU Adam rates (executor/profile.py
   `prices_measured_now`), then recorded plain PyTorch runs (executor/recorder.py `Retimer`: the
   recorder's own clock and statistic) interleaved one by one with the engine's offloaded iterations.
   Each round is predicted by simulating the same schedule on that round's trace times and rates (not
   rescaled by a factor); measured / predicted is pooled as sum measured / sum predicted over rounds,
   each round's the typical iteration (a 20%-trimmed mean: `typical_runs`). Target (issue 17): within
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
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import executor
from executor.models import build_model, make_batch, model_spec
from executor.profile import prices_measured_now
from executor.recorder import (
    Retimer,
    record,
    typical_moment_seconds,
    typical_runs,
    typical_seconds,
    with_compute_seconds,
)
from planner.policies import baseline
from planner.layout import build_layout, candidate_chunk_sizes
from planner.materialize import Decisions, EvictionRule, materialize
from planner.costmodel import channel_bytes_per_s
from planner.presets import resolve_hardware
from planner.problem import build_problem
from planner.simulate import simulate
from schemas import Hardware
from schemas._base import digest_bytes
from schemas.schedule import ActivationMode, Channel, ChunkList, ChunkPlan, Tier
from schemas.trace import DTYPE_BYTES, Phase, TimeSource

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


def predicted_parts(sim, schedule) -> dict[str, float]:
    """The simulated iteration by resource (the keys `measured_parts` measures): each phase's wall,
    forward + backward, stalls, the engine's moment actions (priced at 0), DEVICE Adam steps on the
    compute channel, CPU Adam busy, and each copy channel's busy seconds and bytes."""
    phase = simulated_phase_seconds(sim, schedule)
    parts = {f"phase {p.value}": s for p, s in phase.items()}
    parts |= {
        "iteration": sim.iteration_seconds,
        "fwd+bwd": phase.get(Phase.FORWARD, 0.0) + phase.get(Phase.BACKWARD, 0.0),
        "stalls": sim.stall_seconds,
        "actions": 0.0,
        "DEVICE Adam": sum(i.end_seconds - i.start_seconds for i in sim.timeline
                           if i.channel is Channel.COMPUTE and i.label.startswith("adam")),
        "CPU Adam busy": sim.busy_seconds_per_channel.get(Channel.CPU_OPTIMIZER, 0.0),
    }
    for ch in (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE):
        parts[f"copy {ch.value}"] = sim.busy_seconds_per_channel.get(ch, 0.0)
        parts[f"bytes {ch.value}"] = float(sim.bytes_per_channel.get(ch, 0))
    return parts


def measured_parts(stats, clocks: dict[str, float], seconds: float) -> dict[str, float]:
    """The measured iteration by resource (`predicted_parts`' keys, and the walls beside the busy times):
    `stats` and `clocks` are the typical iteration's (`typical_stats`), `seconds` its wall."""
    phase = stats.seconds_per_phase
    parts = {f"phase {p.value}": s for p, s in phase.items()}
    parts |= {
        "iteration": seconds,
        "fwd+bwd": phase.get(Phase.FORWARD, 0.0) + phase.get(Phase.BACKWARD, 0.0),
        "stalls": stats.stall_seconds,
        "actions": clocks.get("actions", 0.0),
        "DEVICE Adam": stats.optimizer_seconds_per_tier.get(Tier.DEVICE, 0.0),
        # busy (CPU time of the 1-thread worker's steps), not wall: the worker runs at nice 19 beside
        # backward, so its wall time counts the time backward preempts it (executor/stepping._busy_clock)
        "CPU Adam busy": stats.optimizer_busy_seconds_per_tier.get(Tier.HOST, 0.0),
        "CPU Adam wall": stats.optimizer_seconds_per_tier.get(Tier.HOST, 0.0),
    }
    parts |= {k: v for k, v in clocks.items() if k.startswith("copy ")}  # "copy H2D", "copy wall H2D", ...
    return parts


def mean_parts(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each part's mean over rounds (a part a round lacks counts 0 there): the pooled iteration, whose
    "iteration" is sum measured / rounds, so the pooled ratio is sum measured / sum predicted."""
    keys = {k for r in rounds for k in r}
    return {k: sum(r.get(k, 0.0) for r in rounds) / len(rounds) for k in sorted(keys)}


def mispriced_rows(got: dict[str, float], want: dict[str, float], *, plain: float | None = None) -> list[tuple[str, str]]:
    """Measured vs predicted per resource (issue 17 item 6), `got` from `measured_parts` and `want` from
    `predicted_parts` (one round's, or pooled by `mean_parts`): compute (forward + backward wall less
    the stalls and the engine's actions), the engine's moment actions on the training thread (the
    simulator prices none), copies (the stalls the training thread waits for them, and each channel's
    busy seconds on the copy worker vs the simulator's), CPU / DEVICE optimizer steps and each phase's
    wall. Outside 0.90-1.10 the resource with the largest |measured - predicted| on the training thread
    is named as mispriced, and every busy time off its prediction by more than 10% is listed. `plain`:
    plain PyTorch's iteration in the same minutes, to split the difference into the executor's own cost
    and the rest."""
    thread = {
        "compute (fwd+bwd wall - stalls - engine actions)": (got["fwd+bwd"] - got["stalls"] - got["actions"],
                                                              want["fwd+bwd"] - want["stalls"]),
        "engine moment actions, less stalls (not priced)": (got["actions"], 0.0),
        "copies (stalls waiting for them)": (got["stalls"], want["stalls"]),
        "DEVICE Adam steps": (got["DEVICE Adam"], want["DEVICE Adam"]),
    }
    beside = {"CPU Adam steps (busy)": (got["CPU Adam busy"], want["CPU Adam busy"])}
    for ch in (Channel.H2D, Channel.D2H):
        if want.get(f"bytes {ch.value}") and f"copy {ch.value}" in got:
            beside[f"{ch.value} copies (copy worker busy, {want[f'bytes {ch.value}']:,.0f} B)"] = (
                got[f"copy {ch.value}"], want[f"copy {ch.value}"])
    rows = [(f"offload: {name} measured / predicted s", f"{g:.3f} / {w:.3f}") for name, (g, w) in (thread | beside).items()]
    for ch in (Channel.H2D, Channel.D2H):
        if f"copy wall {ch.value}" in got:
            rows.append((f"offload: {ch.value} copies wall on the copy worker (incl. waiting for a core) s",
                         f"{got[f'copy wall {ch.value}']:.3f}"))
    rows.append(("offload: CPU Adam steps wall (incl. preemption by backward) s", f"{got.get('CPU Adam wall', 0.0):.3f}"))
    for phase in Phase:
        key = f"phase {phase.value}"
        if key in got or key in want:
            rows.append((f"offload: {phase.value.lower()} phase wall measured / predicted s",
                         f"{got.get(key, 0.0):.3f} / {want.get(key, 0.0):.3f}"))
    for ch in (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE):
        if want.get(f"bytes {ch.value}") and f"copy {ch.value}" not in got:
            rows.append((f"offload: predicted {ch.value} busy s (bytes {want[f'bytes {ch.value}']:,.0f}; not timed here)",
                         f"{want[f'copy {ch.value}']:.3f}"))
    # the emulated DEVICE computes on the host's cores, where the copy worker and the CPU Adam worker
    # run too: their CPU seconds are taken from compute, which the simulator runs beside them for free
    # (a GPU's copy engines and the host's cores are other hardware). Printed always: it names the part
    # of the compute row that is the machine's shared cores rather than the recorded prices.
    workers = got["CPU Adam busy"] + sum(got.get(f"copy {ch.value}", 0.0) for ch in (Channel.H2D, Channel.D2H))
    compute_got, compute_want = thread["compute (fwd+bwd wall - stalls - engine actions)"]
    rows.append(("offload: compute measured - predicted s vs CPU s of the copy + CPU Adam workers (same cores)",
                 f"{compute_got - compute_want:+.3f} vs {workers:.3f}"))
    measured, predicted = got["iteration"], want["iteration"]
    ratio = measured / predicted if predicted else float("inf")
    if 0.90 <= ratio <= 1.10:
        rows.append(("offload: mispriced resource", "none (inside 0.90-1.10)"))
    else:
        worst = max(thread, key=lambda k: abs(thread[k][0] - thread[k][1]))
        g, w = thread[worst]
        rows.append(("offload: mispriced resource", f"{worst}: measured {g:.3f} s vs predicted {w:.3f} s "
                                                    f"({g - w:+.3f} s of the {measured - predicted:+.3f} s)"))
        off = [f"{name} x{g / w:.2f}" for name, (g, w) in beside.items() if w > 0 and not 0.90 <= g / w <= 1.10]
        rows.append(("offload: busy time off its price by > 10% (beside the training thread)", "; ".join(off) or "none"))
        if plain is not None:
            # plain PyTorch in the same rounds, timed beside the engine: what is left after the executor's own
            # cost is the prices of the machine those rounds ran on
            rows.append(("offload: of it, the executor (engine - plain PyTorch, same rounds) s", f"{measured - plain:+.3f}"))
            rows.append(("offload: of it, plain PyTorch - predicted (the prices) s", f"{plain - predicted:+.3f}"))
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


def retimed_schedule(schedule, trace):
    """`schedule` priced by `trace`, another timing of the iteration it was planned from
    (`executor.recorder.with_compute_seconds`): each moment's compute_seconds as planner/problem.py
    `_moment_refs` resolves a measured trace's (the OPTIMIZER moment none: its work is the schedule's
    OPTIMIZER_STEP actions) and each block's recompute_seconds its forward seconds (`_block_infos`).
    The actions, layout and budgets are the schedule's: the plan stays, only the prices move."""
    if trace.meta.time_source is not TimeSource.MEASURED:
        raise ValueError(f"retimed_schedule: trace {trace.meta.model_name!r} has times from {trace.meta.time_source.value}; "
                         "a schedule is priced again only by measured times")
    if [(m.phase, m.kind, m.module) for m in trace.moments] != [(m.phase, m.kind, m.module) for m in schedule.moments]:
        raise ValueError(f"retimed_schedule: trace {trace.meta.model_name!r} ({len(trace.moments)} moments) is not the "
                         f"iteration the schedule ({len(schedule.moments)} moments) was planned from")
    moments = tuple(dataclasses.replace(ref, compute_seconds=0.0 if m.phase is Phase.OPTIMIZER else m.compute_seconds)
                    for ref, m in zip(schedule.moments, trace.moments))
    forward = {b.id: b.forward_seconds for b in trace.blocks}
    activations = tuple(dataclasses.replace(a, recompute_seconds=forward[a.block]) for a in schedule.activation_plans)
    return dataclasses.replace(schedule, moments=moments, activation_plans=activations)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Round:
    """One round of the offload phase: its prices (the copy/Adam probe, the recorded runs) and the
    engine's iterations they predict, all taken within the same minute."""

    hardware: Hardware  # the profile with this round's copy and CPU Adam rates (`prices_measured_now`)
    recorded_runs: tuple[tuple[float, ...], ...]  # per-moment seconds of each recorded run (`Retimer.run`)
    plain_seconds: tuple[float, ...]  # wall of the same runs: plain PyTorch's iterations in this round
    engine_seconds: tuple[float, ...]  # wall of the engine's offloaded iterations
    sim: Any  # the schedule simulated on this round's trace times and rates
    measured: dict[str, float]  # `measured_parts` of the round's typical engine iteration
    predicted: dict[str, float]  # `predicted_parts` of `sim`

    @property
    def ratio(self) -> float:
        return self.measured["iteration"] / self.predicted["iteration"]


def predict_round(schedule, trace, runs: list[list[float]], hardware: Hardware):
    """The simulator's iteration for `schedule` priced by this round: the trace's compute times from
    `runs` (the recorder's statistic over them) and `hardware`'s rates."""
    return simulate(retimed_schedule(schedule, with_compute_seconds(trace, runs)), hardware)


def run_rounds(*, rounds: int, per_round: int, schedule, trace, engine, instruments, offload_step: Callable[[], None],
               retime: Callable[[], list[float]], probe: Callable[[], Hardware],
               log: Callable[[str], None] = print) -> list[Round]:
    """The offload phase (issue 17 item 6): `rounds` rounds, each a probe of the drifting prices
    (`probe`: copy and CPU Adam rates), then `per_round` pairs of (a recorded run of plain PyTorch,
    `retime`: its per-moment seconds; an offloaded iteration of the engine), each round predicted by
    simulating the same `schedule` (solved once) on that round's recorded times and rates. The engine is
    warmed up by the caller; `instruments.take()` is called after each engine iteration."""
    out = []
    for r in range(rounds):
        hardware = probe()
        runs, plain, times, per_iteration, clocks = [], [], [], [], []
        for i in range(per_round):
            start = time.perf_counter()
            runs.append(retime())
            plain.append(time.perf_counter() - start)
            times.append(timed(offload_step))
            per_iteration.append(engine.stats())
            clocks.append(instruments.take())
            log(f"  round {r} iteration {i}: offloaded {times[-1]:.3f} s, plain PyTorch (recorded) {plain[-1]:.3f} s")
        sim = predict_round(schedule, trace, runs, hardware)
        stats, typical_clocks = typical_stats(per_iteration, times, clocks)
        out.append(Round(hardware=hardware, recorded_runs=tuple(tuple(x) for x in runs), plain_seconds=tuple(plain),
                         engine_seconds=tuple(times), sim=sim,
                         measured=measured_parts(stats, typical_clocks, typical_seconds(times)),
                         predicted=predicted_parts(sim, retimed_schedule(schedule, with_compute_seconds(trace, runs)))))
        log(f"  round {r}: measured {out[-1].measured['iteration']:.3f} s, predicted {sim.iteration_seconds:.3f} s, "
            f"ratio {out[-1].ratio:.3f}")
    return out


def pooled_ratio(rounds: list[Round]) -> float:
    """Sum of the rounds' measured typical iterations / sum of their predictions."""
    return sum(r.measured["iteration"] for r in rounds) / sum(r.predicted["iteration"] for r in rounds)


def _optimizer_seconds(r: Round, trace) -> float:
    """The round's recorded OPTIMIZER moment seconds (the recorder's statistic over its runs)."""
    seconds = typical_moment_seconds([list(x) for x in r.recorded_runs])
    return sum(s for m, s in zip(trace.moments, seconds) if m.phase is Phase.OPTIMIZER)


def round_rows(rounds: list[Round], trace, schedule) -> list[tuple[str, str]]:
    """Per round: its prices (recorded plain PyTorch iteration, the probed copy rate at the schedule's
    largest chunk, CPU Adam beside copies), its prediction, measurement and ratio; then the pooled
    figures, the executor's own cost and the drift since the recording the plan was solved on."""
    chunk_bytes = max(c.elements for c in schedule.layout.chunks) * DTYPE_BYTES[schedule.layout.list_dtypes[ChunkList.PARAM]]
    rows = []
    for i, r in enumerate(rounds):
        h2d = channel_bytes_per_s(r.hardware, Channel.H2D, nbytes=chunk_bytes) / GB
        adam = r.hardware.host.adam_rates[-1].params_per_s_with_copies if r.hardware.host.adam_rates else 0.0
        recorded = typical_seconds([sum(x) for x in r.recorded_runs])
        rows.append((f"offload: round {i}: recorded / predicted / measured s, ratio; probe H2D GB/s, CPU Adam /s",
                     f"{recorded:.3f} / {r.predicted['iteration']:.3f} / {r.measured['iteration']:.3f}, {r.ratio:.3f}; "
                     f"{h2d:.2f}, {adam:.3g}"))
    plain = sum(typical_seconds(list(r.plain_seconds)) for r in rounds) / len(rounds)
    measured = sum(r.measured["iteration"] for r in rounds) / len(rounds)
    recorded = sum(typical_seconds([sum(x) for x in r.recorded_runs]) for r in rounds) / len(rounds)
    first = sum(m.compute_seconds for m in trace.moments)
    ratios = [r.ratio for r in rounds]
    rows += [
        ("offload: per-round ratios min / max", f"{min(ratios):.3f} / {max(ratios):.3f}"),
        ("offload: measured / simulated, pooled: sum measured / sum predicted (issue 17 target 0.90-1.10)",
         f"{pooled_ratio(rounds):.3f}"),
        *([("offload: the same, the HOST steps priced at the fp32 kernel's rate (the bf16 step's column dropped)",
            f"{fp32_priced_ratio(rounds, schedule, trace):.3f}")] if ChunkList.MASTER in schedule.layout.lists else []),
        ("offload: executor's own cost: engine / plain PyTorch (same rounds, typical per round, pooled)", f"{measured / plain:.3f}"),
        ("offload: machine drift, not in the prediction: rounds' recordings / the recording solved on",
         f"{recorded / first:.3f} ({recorded:.3f} / {first:.3f} s)"),
        # plain PyTorch's fused AdamW step, which the schedule replaces by CPU Adam steps overlapped with backward:
        # on the emulated DEVICE those run on the same cores as compute, so they are hidden only on real hardware
        ("offload: of the rounds' recordings, plain PyTorch's optimizer step s (pooled)",
         f"{sum(_optimizer_seconds(r, trace) for r in rounds) / len(rounds):.3f}"),
    ]
    return rows


def fp32_priced_ratio(rounds: list[Round], schedule, trace) -> float:
    """`pooled_ratio` with every round's `adam_rates[].mixed_precision_params_per_s` dropped: what a bf16
    model's prediction was before the profile measured the executor's bf16 step."""
    predicted = 0.0
    for r in rounds:
        rows = tuple(dataclasses.replace(x, mixed_precision_params_per_s=0.0) for x in r.hardware.host.adam_rates)
        hardware = dataclasses.replace(r.hardware, host=dataclasses.replace(r.hardware.host, adam_rates=rows))
        predicted += predict_round(schedule, trace, [list(x) for x in r.recorded_runs], hardware).iteration_seconds
    return sum(r.measured["iteration"] for r in rounds) / predicted


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's params (bfloat16: mixed precision, fp32 MASTER chunks, the HOST steps priced at the "
                         "profile's mixed_precision_params_per_s)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20, help="timed iterations of each loop (unlimited budget)")
    ap.add_argument("--offload-iters", type=int, default=10, help="timed iterations with offloading (all rounds)")
    # 2 rounds of 5 for --offload-iters 10: each round's recording is `record`'s own (5 timed runs, the 20%-trimmed
    # mean, which drops another helper's burst on either side); the interleaving, not the round's length, is what
    # follows the VM's drift (bench/RESULTS.md "bx6")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of the offload phase: each re-measures the prices (recorded runs, copy and CPU Adam "
                         "rates) beside --offload-iters / --rounds offloaded iterations, interleaved one by one")
    ap.add_argument("--device-fraction", type=float, default=0.5,
                    help="DEVICE budget as a fraction of the model data bytes (offloaded part)")
    ap.add_argument("--hardware", default=None, help="hardware TOML (default: measure with `python -m executor profile`)")
    ap.add_argument("--skip-unlimited", action="store_true")
    ap.add_argument("--skip-offload", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    spec = model_spec(args.model, batch=args.batch, seq=args.seq)
    batch = make_batch(spec)
    base = build_model(spec, dtype=getattr(torch, args.dtype))
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model {args.model}: {n_params / 1e6:.1f}M params, batch {args.batch}, seq {args.seq}, {args.dtype}, "
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
        if args.rounds < 1 or args.offload_iters < args.rounds or args.offload_iters % args.rounds:
            raise SystemExit(f"--offload-iters {args.offload_iters} must be a positive multiple of --rounds {args.rounds}")
        with tempfile.TemporaryDirectory() as tmp:
            if args.hardware is None:
                hw_path = Path(tmp) / "hw.toml"
                subprocess.run([sys.executable, "-m", "executor", "profile", "-o", str(hw_path), "--device-memory-gb", "1.0"],
                               check=True)
                hardware = Hardware.read(hw_path)
            else:
                hardware = resolve_hardware(args.hardware)
        model_bytes = n_params * 16  # fp32 params, grads, Adam m and v (bf16: 2 + 2 + a 4-byte master + m and v)
        non_model_bytes = max(m.non_model_bytes for m in trace.moments)  # activations stay on DEVICE
        device_bytes = non_model_bytes + int(model_bytes * args.device_fraction)
        schedule, how = offloaded_schedule(trace, hardware, digest, device_bytes)  # solved once: the rounds move prices only
        sim = simulate(schedule, hardware)
        model, plain = copy.deepcopy(base), copy.deepcopy(base)
        engine = executor.run(model, schedule, lr=1e-4, weight_decay=0.0, params=model.parameters())
        instruments = Instruments(engine)
        # plain PyTorch is timed by the recorder's clock (a Retimer on its own copy of the model, fused AdamW):
        # each run is both plain PyTorch beside the engine and the round's recording of the compute prices
        retimer = Retimer(plain, batch, trace)

        def offload_step():
            _loss(model, batch).backward()
            engine.step()

        offload_step()  # warm-up
        instruments.take()
        rounds = run_rounds(rounds=args.rounds, per_round=args.offload_iters // args.rounds, schedule=schedule, trace=trace,
                            engine=engine, instruments=instruments, offload_step=offload_step, retime=retimer.run,
                            probe=lambda: prices_measured_now(hardware, seconds=0.1))
        stats = engine.stats()  # bytes and peaks: the same every iteration
        got, want = mean_parts([r.measured for r in rounds]), mean_parts([r.predicted for r in rounds])
        plain_pooled = sum(typical_seconds(list(r.plain_seconds)) for r in rounds) / len(rounds)
        rows += [
            ("offload: schedule from", how),
            ("offload: DEVICE budget bytes", f"{device_bytes:,} (non-model peak + {args.device_fraction:.0%} of "
                                             f"{model_bytes:,} model data bytes)"),
            ("offload: bytes per channel measured == predicted", str(stats.bytes_match(schedule))),
            ("offload: bytes moved per iteration", f"{sum(stats.bytes_per_channel.values()):,}"),
            ("offload: peak DEVICE chunk bytes", f"{stats.peak_bytes_per_tier[Tier.DEVICE]:,}"),
            ("offload: simulator s/iter on the recording and profile solved on (not the target)", f"{sim.iteration_seconds:.3f}"),
            ("offload: rounds x offloaded iterations (each beside a recorded plain PyTorch run)",
             f"{args.rounds} x {args.offload_iters // args.rounds}"),
            ("offload: stall seconds per iteration (pooled)", f"{got['stalls']:.3f}"),
            ("offload: measured s/iter (pooled: mean of the rounds' typical)", f"{got['iteration']:.3f}"),
            ("offload: simulator s/iter (pooled: mean of the rounds' predictions)", f"{want['iteration']:.3f}"),
        ]
        rows += round_rows(rounds, trace, schedule)
        rows += mispriced_rows(got, want, plain=plain_pooled)
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'figure':{width}}  value")
    for name, value in rows:
        print(f"{name:{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
