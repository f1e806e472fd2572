"""CPU optimizer overlapped with backward (issue 7 item 3): iteration time with overlap / without.

Two schedules of the same model, same DEVICE budget and same decisions (OS on HOST, CPU AdamW, the
planner's `materialize`), differing only in `optimizer_overlap`: with it, each chunk's HOST step is
placed right after its grads are final and runs on the engine's optimizer worker while backward
goes on (Fuyou §4.3); without it, every step runs at the OPTIMIZER moment, after backward. The
iterations of the two engines are interleaved (overlap, sync, overlap, ...) so both see the same
machine noise; the figure is the ratio of the medians. Beside it: the ratio the simulator predicts
for the two schedules on the hardware profile measured on this machine by `python -m executor profile`
(as bench/bench_executor.py does). Target: measured ratio < 1.

    python bench/bench_overlap.py                          # GPT-2-small config, batch 4, seq 256, fp32
    python bench/bench_overlap.py --model gpt-small --iters 10
    OMP_NUM_THREADS=1 python bench/bench_overlap.py --batch 1 --seq 64 --iters 30
        # backward on one core, the optimizer worker on the other: a GPU machine's layout, where
        # the CPU is free during backward (by default backward takes every core, and on a 2-core
        # box the overlapped steps can only take cycles from it)

Prints a table; CPU timings are ratios from one run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import executor
from executor.models import build_model, make_batch, model_spec
from executor.recorder import record
from planner.layout import build_layout, candidate_chunk_sizes
from planner.materialize import materialize, uniform_decisions
from planner.presets import resolve_hardware
from planner.problem import build_problem
from planner.simulate import simulate
from schemas import Hardware
from schemas._base import digest_bytes
from schemas.schedule import Op, Tier
from schemas.trace import Phase


def schedules(trace, hardware, digest: str, device_bytes: int):
    """(overlapped, synchronous) schedules: OS on HOST, CPU AdamW, same layout and DEVICE budget."""
    problem = build_problem(trace, hardware, trace_digest=digest, device_bytes=device_bytes)
    sizes = candidate_chunk_sizes(problem)
    layout = build_layout(problem, chunk_elements=sizes[len(sizes) // 2])
    out = []
    for overlap in (True, False):
        decisions = uniform_decisions(problem, layout, os_tier=Tier.HOST, optimizer_tier=Tier.HOST,
                                      optimizer_overlap=overlap)
        out.append(materialize(problem, decisions))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10, help="timed iterations of each engine (median)")
    ap.add_argument("--device-fraction", type=float, default=0.5,
                    help="DEVICE budget: the non-model peak + this fraction of the model data bytes")
    ap.add_argument("--optimizer-threads", type=int, default=None,
                    help="intra-op threads of the optimizer worker (default: the engine's)")
    ap.add_argument("--hardware", default=None, help="hardware TOML (default: measure with `python -m executor profile`)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    spec = model_spec(args.model, batch=args.batch, seq=args.seq)
    batch = make_batch(spec)
    base = build_model(spec)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model {args.model}: {n_params / 1e6:.1f}M params, batch {args.batch}, seq {args.seq}, fp32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads on the training thread", flush=True)
    trace = record(copy.deepcopy(base), batch, model_name=args.model)
    digest = digest_bytes(trace.to_msgpack())
    with tempfile.TemporaryDirectory() as tmp:
        if args.hardware is None:
            hw_path = Path(tmp) / "hw.toml"
            subprocess.run([sys.executable, "-m", "executor", "profile", "-o", str(hw_path), "--device-memory-gb", "1.0"],
                           check=True)
            hardware = Hardware.read(hw_path)
        else:
            hardware = resolve_hardware(args.hardware)
    model_bytes = n_params * 16  # fp32 params, grads, Adam m and v
    device_bytes = max(m.non_model_bytes for m in trace.moments) + int(model_bytes * args.device_fraction)
    overlapped, synchronous = schedules(trace, hardware, digest, device_bytes)
    sim_overlap, sim_sync = simulate(overlapped, hardware), simulate(synchronous, hardware)

    engines = {}
    for name, schedule in (("overlap", overlapped), ("sync", synchronous)):
        model = copy.deepcopy(base)
        engines[name] = (model, executor.run(model, schedule, lr=1e-4, weight_decay=0.0, params=model.parameters(),
                                             optimizer_threads=args.optimizer_threads))

    def step(name: str) -> float:
        model, engine = engines[name]
        start = time.perf_counter()
        model(**batch).backward()
        engine.step()
        return time.perf_counter() - start

    for _ in range(2):  # warm-up: pools and caches filled
        step("overlap")
        step("sync")
    times: dict[str, list[float]] = {"overlap": [], "sync": []}
    stalls: dict[str, list[float]] = {"overlap": [], "sync": []}
    backward: dict[str, list[float]] = {"overlap": [], "sync": []}
    optimizer: dict[str, list[float]] = {"overlap": [], "sync": []}
    for i in range(args.iters):
        for name in ("overlap", "sync") if i % 2 == 0 else ("sync", "overlap"):
            times[name].append(step(name))
            stats = engines[name][1].stats()
            stalls[name].append(stats.stall_seconds)
            backward[name].append(stats.seconds_per_phase.get(Phase.BACKWARD, 0.0))
            optimizer[name].append(stats.seconds_per_phase.get(Phase.OPTIMIZER, 0.0))
        print(f"  iteration {i}: overlap {times['overlap'][-1]:.3f} s, sync {times['sync'][-1]:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    host_steps = sum(1 for a in overlapped.actions if a.op is Op.OPTIMIZER_STEP and a.dst is Tier.HOST)
    rows = [
        ("hardware profile", hardware.name),
        ("DEVICE budget bytes", f"{device_bytes:,} (non-model peak + {args.device_fraction:.0%} of {model_bytes:,})"),
        ("HOST optimizer steps (chunks)", str(host_steps)),
        ("optimizer worker intra-op threads", str(engines["overlap"][1].optimizer_threads)),
        ("bytes measured == predicted (overlap, sync)",
         f"{engines['overlap'][1].stats().bytes_match(overlapped)}, {engines['sync'][1].stats().bytes_match(synchronous)}"),
        ("overlap: median s/iter", f"{med['overlap']:.3f}"),
        ("sync:    median s/iter", f"{med['sync']:.3f}"),
        ("overlap: median backward s / OPTIMIZER moment s / stall s",
         f"{statistics.median(backward['overlap']):.3f} / {statistics.median(optimizer['overlap']):.3f} / "
         f"{statistics.median(stalls['overlap']):.3f}"),
        ("sync:    median backward s / OPTIMIZER moment s / stall s",
         f"{statistics.median(backward['sync']):.3f} / {statistics.median(optimizer['sync']):.3f} / "
         f"{statistics.median(stalls['sync']):.3f}"),
        ("simulated s/iter overlap / sync", f"{sim_overlap.iteration_seconds:.3f} / {sim_sync.iteration_seconds:.3f}"),
        ("MEASURED ratio overlap/sync (target < 1)", f"{med['overlap'] / med['sync']:.3f}"),
        ("PREDICTED ratio overlap/sync (planner.simulate)", f"{sim_overlap.iteration_seconds / sim_sync.iteration_seconds:.3f}"),
        ("  recorded plain fused AdamW step s (the trace's OPTIMIZER moment; not charged again)",
         f"{sum(m.compute_seconds for m in trace.moments if m.phase is Phase.OPTIMIZER):.3f}"),
    ]
    for _, engine in engines.values():
        engine.detach()
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'figure':{width}}  value")
    for name, value in rows:
        print(f"{name:{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
