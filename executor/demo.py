"""`python -m executor demo`: the whole path on the small GPT, on this machine, in under a minute.

1. record one training iteration of `gpt-small` on the CPU (executor.record) -> trace.msgpack;
2. solve it with a DEVICE budget too small for the model data, so chunks must move
   (`python -m planner solve ... --device-memory-gb X`, run as a subprocess: the executor never
   imports the planner) -> schedule.msgpack;
3. train a few steps with `executor.run`, printing the loss per step, then the bytes moved per
   channel and the predicted vs measured iteration time.
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
from executor.errors import ExecutorError
from executor.models import build_model, make_batch, model_spec
from executor.recorder import record
from schemas import Schedule
from schemas.schedule import BYTE_CHANNELS, Tier

GB = 1e9


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="record, solve and train the small GPT with offloading (the README's first command)",
        description="Record gpt-small on the CPU, solve it with a DEVICE budget that forces offloading, "
                    "train a few steps with the executor; print loss, bytes per channel, predicted vs measured time.")
    p.add_argument("--model", default="gpt-small", help="a name from executor.models.MODELS (default gpt-small)")
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument("--hardware", default="cpu-emulated", help="hardware preset or TOML for the planner (default cpu-emulated)")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="DEVICE budget for the solver (default: the non-model peak plus half the model data)")
    p.add_argument("--workdir", type=Path, default=None, help="keep trace.msgpack and schedule.msgpack here")
    p.add_argument("--lr", type=float, default=1e-3)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ExecutorError(f"--steps: expected 1 or more, found {args.steps}")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return _demo(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="tide-demo-") as tmp:
        return _demo(args, Path(tmp))


def _demo(args: argparse.Namespace, workdir: Path) -> int:
    torch.manual_seed(0)
    spec = model_spec(args.model)
    model = build_model(spec)
    batch = make_batch(spec)
    n_params = sum(p.numel() for p in model.parameters())

    start = time.perf_counter()
    trace = record(copy.deepcopy(model), batch, model_name=args.model,
                   model_config={"family": spec.family, "batch": spec.batch, "seq": spec.seq, **spec.config})
    trace_path = workdir / "trace.msgpack"
    trace.write(trace_path)
    model_bytes = n_params * 16  # fp32 params, grads, Adam m and v
    non_model_bytes = max(m.non_model_bytes for m in trace.moments)
    device_gb = args.device_memory_gb or round((non_model_bytes + model_bytes // 2) / GB, 6)
    print(f"1. recorded {args.model} ({n_params / 1e6:.2f}M params, model data {model_bytes / 1e6:.1f} MB, "
          f"non-model peak {non_model_bytes / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s -> {trace_path}")

    schedule_path = workdir / "schedule.msgpack"
    command = [sys.executable, "-m", "planner", "solve", str(trace_path), "--hardware", args.hardware,
               "--device-memory-gb", str(device_gb), "--no-checkpoint-offload", "-o", str(schedule_path)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ExecutorError(f"`{' '.join(command[1:])}` failed (exit {done.returncode}): {last}")
    schedule = Schedule.read(schedule_path)
    moved = sum(n for ch, n in schedule.prediction.bytes_per_channel.items() if ch in BYTE_CHANNELS)
    print(f"2. solved with a DEVICE budget of {device_gb * 1e3:.1f} MB in {time.perf_counter() - start:.1f} s "
          f"({schedule.header.solver_status.value}, policy {schedule.header.policy}): {len(schedule.actions)} actions, "
          f"{moved / 1e6:.1f} MB moved per iteration -> {schedule_path}")

    engine = executor.run(model, schedule, lr=args.lr)
    print(f"3. training {args.steps} steps with executor.run")
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = model(**batch)
        loss.backward()
        engine.step()
        times.append(time.perf_counter() - start)
        print(f"   step {step}: loss {loss.item():.4f}  ({times[-1] * 1e3:.0f} ms)")
    stats = engine.stats()
    print()
    print(stats.table(schedule))
    measured = statistics.median(times[1:] or times)
    predicted = schedule.prediction.iteration_seconds
    print()
    host_match = stats.peak_bytes_per_tier[Tier.HOST] == schedule.prediction.peak_bytes_per_tier.get(Tier.HOST, 0)
    print(f"bytes per channel measured == predicted: {stats.bytes_match(schedule)}; peak HOST bytes measured == "
          f"predicted: {host_match}; peak DEVICE chunk bytes {stats.peak_bytes_per_tier[Tier.DEVICE]:,} <= budget "
          f"{schedule.budgets.device_bytes:,}")
    print(f"iteration time: predicted {predicted * 1e3:.1f} ms, measured median {measured * 1e3:.1f} ms "
          f"(ratio {measured / predicted:.2f}; the simulator does not price the engine's per-action Python work, "
          "which weighs most on a model this small: `python bench/bench_executor.py` compares the two on a "
          "larger one)" if predicted > 0 else f"iteration time: measured median {measured * 1e3:.1f} ms")
    engine.detach()
    return 0


__all__ = ["register"]
