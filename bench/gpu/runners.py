"""One measurement of the GPU kit, run in its own process (`bench/gpu/kit.py` starts one per run, so
an OOM, a hang or a crashed DeepSpeed op costs that run only).

    python bench/gpu/runners.py record  --workload gpt-1.3b --out W/           # trace.msgpack (+ meta fallback)
    python bench/gpu/runners.py tide    --workload gpt-1.3b --budget-gb 16 --hardware hw.toml --trace W/trace.msgpack --result r.json
    python bench/gpu/runners.py plain   --workload gpt-1.3b --result r.json    # torch.autocast bf16 + AdamW(fused=True)
    python bench/gpu/runners.py ds-offload | ds-infinity --workload ... --nvme-dir /tmp/x --result r.json

Every run trains the same model (seed 0) on the same batches (`make_batch(seed=step)`) for up to
--steps steps, stopping early when --seconds have passed (at least 2 steps when it can), and writes
one JSON object: the loss per step, the iteration times (median of the steps after the first),
TFLOPS on the model FLOPs (below), `torch.cuda.max_memory_allocated` over the training loop, and the
share of host<->device copy time hidden under compute kernels in one profiled step after the timed
ones (CUPTI's device timestamps of every copy and kernel, through `torch.profiler`: the copies of a
system whose code we do not own, DeepSpeed, can be seen no other way). tide's run adds the predicted
iteration time and bytes per channel of its schedule and whether the bytes moved equal them.

Model FLOPs per iteration (forward + backward, no recompute; Megatron-LM's count, Narayanan et al.
2021 §5.1, for our GPT with its tied head): 6 * params * tokens + 12 * n_layer * batch * seq^2 * n_embd.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `python bench/gpu/runners.py` from anywhere
    sys.path.insert(0, str(REPO))

GB = 1e9

# The workloads of issue 19: GPT-3 family shapes (Brown et al. 2020, Table 2.1: 1.3B = 24 x 2048,
# 16 heads; 6.7B = 32 x 4096, 32 heads), vocabulary 50257, sequence 1024. Batches are chosen so one
# step stays well inside the kit's time budget on one H100 and the 6.7B activations fit a 40 GB DEVICE
# budget with recompute; every system gets the same batch and sequence.
WORKLOADS: dict[str, dict[str, Any]] = {
    "gpt-1.3b": dict(n_layer=24, n_head=16, n_embd=2048, batch=8, seq=1024),
    "gpt-6.7b": dict(n_layer=32, n_head=32, n_embd=4096, batch=4, seq=1024),
    # CI's smoke run of this file on the CPU (--device cpu), not a kit workload
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, batch=2, seq=16, vocab=64),
}
VOCAB = 50257
DEVICE = "cuda"  # --device: cpu only for the CI smoke run (tests/test_gpu_kit.py)
LR = 1e-4


def workload_spec(name: str):  # noqa: ANN201 - executor.models.ModelSpec
    from executor.models import GPTConfig, ModelSpec

    if name not in WORKLOADS:
        raise SystemExit(f"--workload {name!r}: expected one of {', '.join(WORKLOADS)}")
    w = WORKLOADS[name]
    config = GPTConfig(n_layer=w["n_layer"], n_head=w["n_head"], n_embd=w["n_embd"], vocab_size=w.get("vocab", VOCAB),
                       block_size=w["seq"]).to_dict()
    return ModelSpec(family="gpt", config=config, batch=w["batch"], seq=w["seq"])


def param_count(name: str) -> int:
    """Parameters of the workload, counted on the meta device (nothing allocated)."""
    from executor.models import build_model

    model = build_model(workload_spec(name), device="meta")
    return sum(p.numel() for p in model.parameters())


def model_flops(name: str, params: int | None = None) -> float:
    w = WORKLOADS[name]
    n = param_count(name) if params is None else params
    tokens = w["batch"] * w["seq"]
    return 6.0 * n * tokens + 12.0 * w["n_layer"] * w["batch"] * w["seq"] ** 2 * w["n_embd"]


# ----------------------------------------------------------------------------- measuring


def _cuda() -> bool:
    return DEVICE.startswith("cuda")


def _sync() -> None:
    import torch

    if _cuda():
        torch.cuda.synchronize()


def copy_overlap(step: Any, workdir: Path) -> dict[str, Any]:
    """Run `step()` once under torch.profiler (CUDA activity) and return the copy/compute overlap:
    the share of host<->device copy time during which a compute kernel ran (device timestamps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])) as prof:
        step()
        _sync()
    path = workdir / "profile-trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text()).get("traceEvents", [])
    path.unlink(missing_ok=True)
    copies, kernels = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if cat == "gpu_memcpy" and ("HtoD" in name or "DtoH" in name):
            copies.append(span)
        elif cat == "kernel":
            kernels.append(span)
    return {"copy_seconds": sum(b - a for a, b in copies) / 1e6, "copies": len(copies),
            "kernel_seconds": sum(b - a for a, b in _union(kernels)) / 1e6,
            "hidden_share": _hidden_share(copies, kernels)}


def memory_at_peak(step: Any) -> dict[str, Any]:
    """Run `step()` once more under the CUDA allocator's history (`torch.cuda.memory._record_memory_history`)
    and say what is allocated at its peak (`live_at_peak`): the 16 GB and fits runs of session 24 allocated
    ~3 GB more than their schedules predict, outside the engine's count of chunks and activations."""
    import torch

    _sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=500_000)
    try:
        step()
        _sync()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return live_at_peak(snapshot["device_traces"][torch.cuda.current_device()], before_bytes=before)


def live_at_peak(events: list[dict[str, Any]], *, before_bytes: int, top: int = 12) -> dict[str, Any]:
    """From the allocator's trace of one step (events with action alloc / free_completed, addr, size, frames):
    the peak of what was allocated before the step plus what the step allocated less what it freed, and the
    blocks the step allocated that are live then, grouped by the innermost frames of this repository (executor/,
    bench/), the largest first. `before_bytes`: allocated when the trace began (chunks held, persistent buffers)."""
    def replay(stop: int | None) -> tuple[int, int, dict[int, dict[str, Any]]]:
        live: dict[int, dict[str, Any]] = {}
        now = peak = peak_at = 0
        for i, event in enumerate(events[:stop]):
            action, addr = event.get("action"), event.get("addr")
            if action == "alloc":
                if addr in live:  # a block reused before its free completed: the old one is gone
                    now -= live.pop(addr)["size"]
                live[addr] = event
                now += event["size"]
                if now > peak:
                    peak, peak_at = now, i + 1
            elif action == "free_completed":  # a block of the step, or one allocated before it (a chunk evicted)
                now -= live.pop(addr)["size"] if addr in live else event["size"]
        return peak, peak_at, live

    peak, peak_at, _ = replay(None)
    _, _, live = replay(peak_at)
    groups: dict[str, list[int]] = {}
    for event in live.values():
        frames = [f for f in event.get("frames", ())
                  if any(part in f.get("filename", "") for part in ("/executor/", "/bench/"))][:3]
        where = " < ".join(f"{Path(f['filename']).name}:{f.get('line')} {f.get('name')}" for f in frames) or "(no frame of tide)"
        bytes_count = groups.setdefault(where, [0, 0])
        bytes_count[0] += event["size"]
        bytes_count[1] += 1
    largest = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"before_bytes": before_bytes, "step_peak_bytes": peak, "peak_bytes": before_bytes + peak,
            "live_at_peak": [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in largest]}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _hidden_share(copies: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> float | None:
    """Share of the copies' time covered by the union of kernel intervals (None: no copies)."""
    total = sum(b - a for a, b in copies)
    if total <= 0:
        return None
    busy = _union(kernels)
    hidden = 0.0
    for a, b in copies:
        for c, d in busy:
            if d <= a:
                continue
            if c >= b:
                break
            hidden += min(b, d) - max(a, c)
    return hidden / total


def host_memory() -> dict[str, Any]:
    """Peak RSS and, where torch has them, the pinned allocator's stats: torch's CachingHostAllocator
    rounds each pinned block up to a power of two, so pinned bytes well above the schedule's HOST peak
    say how much of it went to rounding."""
    import resource

    import torch

    out: dict[str, Any] = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if _cuda() and stats is not None:
        with contextlib.suppress(Exception):
            out["pinned"] = {k: v for k, v in stats().items() if "bytes" in k or "segment" in k}
    return out


# the process's deadline (perf_counter), set by main from --deadline-seconds: the loop leaves room for what
# follows it (one profiled step, the engine's detach, the result) so the kit never kills a run that
# measured something
DEADLINE = math.inf


def train_loop(step: Any, *, steps: int, seconds: float, name: str) -> dict[str, Any]:
    """Call step(i) -> loss (a float) up to `steps` times, stopping (after at least 2 steps) once
    `seconds` have passed or when two more steps and the profiled one would pass the process's
    deadline. Returns losses, per-step seconds and the peak allocated bytes."""
    import torch

    _sync()
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    start = time.perf_counter()
    stopped = None
    for i in range(steps):
        t0 = time.perf_counter()
        losses.append(float(step(i)))  # .item() inside: the step's kernels are done
        _sync()
        times.append(time.perf_counter() - t0)
        print(f"[{name}] step {i}: loss {losses[-1]:.4f} ({times[-1]:.2f} s)", flush=True)
        if not math.isfinite(losses[-1]):
            stopped = f"loss is {losses[-1]} at step {i}"
            break
        now = time.perf_counter()
        if i >= 1 and i + 1 < steps and (now - start > seconds or now + 3 * max(times[1:]) + 5 > DEADLINE):
            stopped = f"time limit: {i + 1} of {steps} steps in {now - start:.0f} s"
            break
    timed = times[1:] or times
    return {"losses": losses, "step_seconds": times, "iteration_seconds": statistics.median(timed),
            "steps_done": len(losses), "stopped_early": stopped,
            "max_memory_allocated_bytes": int(torch.cuda.max_memory_allocated()) if _cuda() else 0,
            "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved()) if _cuda() else 0}


def _finish(result: dict[str, Any], workload: str, budget_bytes: int | None) -> dict[str, Any]:
    flops = model_flops(workload)
    result["model_flops"] = flops
    if result.get("iteration_seconds"):
        result["tflops"] = flops / result["iteration_seconds"] / 1e12
    if budget_bytes is not None and _cuda():
        result["budget_bytes"] = budget_bytes
        result["peak_within_budget"] = result["max_memory_allocated_bytes"] <= budget_bytes
    return result


# ----------------------------------------------------------------------------- the systems


def run_record(args: argparse.Namespace) -> dict[str, Any]:
    """Record one iteration on the GPU in bf16 (real compute times); on OOM, on the meta device."""
    import torch

    from executor.models import build_model, make_batch
    from executor import record

    spec = workload_spec(args.workload)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"family": spec.family, "batch": spec.batch, "seq": spec.seq, **spec.config}
    how, why = DEVICE, None
    start = time.perf_counter()
    try:
        model = build_model(spec, device=DEVICE, dtype=torch.bfloat16)
        trace = record(model, make_batch(spec, device=DEVICE), model_name=args.workload, model_config=config,
                       timing_iterations=args.timing_iterations)
    except torch.OutOfMemoryError as exc:
        why = f"real recording ran out of GPU memory ({str(exc).splitlines()[0][:160]}); recorded on meta (FLOPs times)"
        model = None
        torch.cuda.empty_cache()
        how = "meta"
        model = build_model(spec, device="meta", dtype=torch.bfloat16)
        trace = record(model, make_batch(spec, device="meta"), model_name=args.workload, model_config=config)
    path = out / "trace.msgpack"
    trace.write(path)
    return {"trace": str(path), "recorded_on": how, "fallback": why, "seconds": time.perf_counter() - start,
            "moments": len(trace.moments), "params": trace.param_count}


def solve(trace: str, hardware: str, budget_gb: float | None, out: Path, *, time_limit: float) -> Path:
    schedule = out / f"schedule-{budget_gb or 'full'}.msgpack"
    command = [sys.executable, "-m", "planner", "solve", trace, "--hardware", hardware, "-o", str(schedule),
               "--time-limit", str(time_limit)]
    if budget_gb is not None:
        command += ["--device-memory-gb", str(budget_gb)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"planner solve failed (exit {done.returncode}): {last}")
    return schedule


def run_tide(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import executor
    from executor.models import build_model, make_batch
    from schemas import Schedule
    from schemas.schedule import BYTE_CHANNELS, Tier

    spec = workload_spec(args.workload)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.schedule:  # an earlier run's plan of the same trace, budget and profile (the kit's spare-core run)
        schedule_path, solve_seconds = Path(args.schedule), None
    else:
        schedule_path = solve(args.trace, args.hardware, args.budget_gb, work, time_limit=args.solve_seconds)
        solve_seconds = time.perf_counter() - t0
    schedule = Schedule.read(schedule_path)
    print(f"[tide {args.workload}] schedule ready in {time.perf_counter() - t0:.1f} s", flush=True)  # a timed-out run's log says how far it got
    nvme_dir = Path(args.nvme_dir) / f"tide-{args.workload}-{args.budget_gb}"
    nvme_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(spec, device=DEVICE, dtype=torch.bfloat16)
    engine = executor.run(model, schedule, lr=LR, nvme_dir=nvme_dir, device=DEVICE, optimizer_threads=args.optimizer_threads)
    print(f"[tide {args.workload}] model built and attached at {time.perf_counter() - t0:.1f} s", flush=True)
    if _cuda():
        torch.cuda.empty_cache()

    def step(i: int) -> float:
        loss = model(**make_batch(spec, device=DEVICE, seed=i))
        loss.backward()
        engine.step()
        return loss.item()

    result = train_loop(step, steps=args.steps, seconds=args.seconds, name=f"tide {args.workload}")
    stats = engine.stats()
    result["overlap"] = copy_overlap(lambda: step(args.steps), work)
    if _cuda():
        try:
            result["memory_at_peak"] = memory_at_peak(lambda: step(args.steps + 1))
        except Exception as exc:  # noqa: BLE001 - a diagnostic: its failure must not cost the run's figures
            result["memory_at_peak"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    pred = schedule.prediction
    budget = int(args.budget_gb * GB) if args.budget_gb is not None else None
    result.update(
        schedule=str(schedule_path), solve_seconds=solve_seconds, policy=schedule.header.policy, solver_status=schedule.header.solver_status.value,
        schedule_device_bytes=schedule.budgets.device_bytes,
        predicted_iteration_seconds=pred.iteration_seconds,
        measured_over_predicted=(result["iteration_seconds"] / pred.iteration_seconds
                                 if pred.iteration_seconds > 0 else None),
        bytes_per_channel={ch.value: n for ch, n in stats.bytes_per_channel.items()},
        predicted_bytes_per_channel={ch.value: n for ch, n in pred.bytes_per_channel.items()
                                     if n and ch in BYTE_CHANNELS},
        bytes_match=stats.bytes_match(schedule), stall_seconds=stats.stall_seconds,
        peak_chunk_bytes_per_tier={t.value: n for t, n in stats.peak_bytes_per_tier.items()},
        engine_device_peak_ok=stats.peak_bytes_per_tier[Tier.DEVICE] <= schedule.budgets.device_bytes,
        uses_nvme=any(Tier.NVME in r.tiers for r in schedule.initial_residency),
        # where the time went, against the schedule's prediction (the engine's own table)
        seconds_per_phase={ph.value: s for ph, s in stats.seconds_per_phase.items()},
        optimizer_seconds_per_tier={t.value: s for t, s in stats.optimizer_seconds_per_tier.items()},
        # the first H100 runs: HOST steps took 3-5x the profile's rate; their CPU time and thread count
        # tell contention (busy << wall) from a slow kernel (busy ~ wall x threads)
        optimizer_busy_seconds_per_tier={t.value: s for t, s in stats.optimizer_busy_seconds_per_tier.items()},
        optimizer_threads=engine.optimizer_threads, torch_threads=torch.get_num_threads(),
        peak_activation_bytes=stats.peak_activation_bytes,
        predicted_busy_seconds_per_channel={ch.value: s for ch, s in pred.busy_seconds_per_channel.items() if s},
        stats_table=stats.table(schedule),
        host_memory=host_memory(),
    )
    engine.detach()
    return _finish(result, args.workload, budget)


def run_plain(args: argparse.Namespace) -> dict[str, Any]:
    """Plain PyTorch mixed precision: fp32 params, torch.autocast(bf16), AdamW(fused=True), the same
    param groups as tide's default (decay on matrices only)."""
    import torch

    from executor.models import build_model, make_batch
    from executor.runtime import default_param_groups

    spec = workload_spec(args.workload)
    model = build_model(spec, device=DEVICE, dtype=torch.float32)
    groups = default_param_groups(model, weight_decay=0.01)
    for g in groups:
        g.pop("param_names", None)
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)

    def step(i: int) -> float:
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            loss = model(**make_batch(spec, device=DEVICE, seed=i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    result = train_loop(step, steps=args.steps, seconds=args.seconds, name=f"plain {args.workload}")
    result["overlap"] = copy_overlap(lambda: step(args.steps), Path(args.workdir))
    return _finish(result, args.workload, None)


# DeepSpeed 0.19.8's defaults that size ZeRO-Infinity's param swap-in pool (deepspeed/runtime/zero/config.py
# stage3_max_live_parameters and stage3_prefetch_bucket_size; swap_tensor/utils.py MIN_SWAPPABLE_BYTES)
DS_MAX_LIVE_PARAMETERS = int(1e9)
DS_PREFETCH_BUCKET_SIZE = int(5e7)
DS_MIN_SWAPPABLE_BYTES = 1024**2


def swap_in_buffer_count(numels: list[int], *, element_bytes: int = 2) -> int:
    """Buffers ZeRO-Infinity's param swap-in pool needs so that no fetch finds it empty.

    Each param swapped in from NVMe holds one whole buffer, whatever its size, until ZeRO-3 releases it
    (partitioned_param_swapper.py `swap_in` / `remove_partition_and_release_buffers`); ZeRO-3 keeps up to
    `stage3_max_live_parameters` elements available (partitioned_param_coordinator.py
    `__max_n_available_params`) and prefetches one bucket more; a param smaller than 1 MiB is never swapped
    (`swappable_tensor`). So the pool must hold the most swappable params whose elements fit in that
    (the smallest first), plus the one being fetched. The first H100 run stopped at step 1 with 5 buffers
    (DeepSpeed's default) and the H200 run with 12 (one per 1e8 live elements): "Not enough swap in
    buffers 0 for 1 params" with 12 params holding the 12 buffers (bench/RESULTS.md, session 24)."""
    sizes = sorted(n for n in numels if n * element_bytes >= DS_MIN_SWAPPABLE_BYTES)
    live, count = 0, 0
    for n in sizes:
        if live + n > DS_MAX_LIVE_PARAMETERS + DS_PREFETCH_BUCKET_SIZE:
            break
        live, count = live + n, count + 1
    return max(5, min(len(sizes), count + 1))  # 5: DeepSpeed's default buffer_count (offload_config.py)


def deepspeed_config(kind: str, *, batch: int, nvme_dir: str, numels: list[int]) -> dict[str, Any]:
    """ZeRO-3 with params and optimizer state on CPU (ZeRO-Offload) or on NVMe (ZeRO-Infinity).

    Values are DeepSpeed's documented defaults (deepspeed/runtime/zero/offload_config.py,
    deepspeed/runtime/swap_tensor/aio_config.py) except: bf16 on (as tide's runs), buffer_size at
    least the largest param (DeepSpeed refuses smaller NVMe param buffers), buffer_count from
    `swap_in_buffer_count`, and AdamW as tide's. `numels`: the model's param sizes."""
    offload_param: dict[str, Any] = {"device": "cpu", "pin_memory": True}
    offload_optimizer: dict[str, Any] = {"device": "cpu", "pin_memory": True}
    extra: dict[str, Any] = {}
    if kind == "ds-infinity":
        buffer_size = max(int(1e8), max(numels))
        offload_param = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True,
                         "buffer_count": swap_in_buffer_count(numels), "buffer_size": buffer_size}
        offload_optimizer = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 4}
        extra["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                        "overlap_events": True}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": offload_param, "offload_optimizer": offload_optimizer,
                              "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **extra,
    }


def run_deepspeed(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    import deepspeed

    from executor.models import build_model, make_batch
    from executor.runtime import default_param_groups

    spec = workload_spec(args.workload)
    deepspeed.init_distributed(dist_backend="nccl" if _cuda() else "gloo", auto_mpi_discovery=False)
    nvme = Path(args.nvme_dir) / f"{args.system}-{args.workload}"
    nvme.mkdir(parents=True, exist_ok=True)
    numels = [p.numel() for p in build_model(spec, device="meta").parameters()]
    config = deepspeed_config(args.system, batch=spec.batch, nvme_dir=str(nvme), numels=numels)
    t0 = time.perf_counter()
    # the same initial weights as tide's and plain PyTorch's runs (build_model, seed 0, on the GPU: one
    # RNG stream), so the loss curves start together; deepspeed.initialize converts the params to
    # ZeRO-3 partitions and offloads them (zero.Init would draw other init values). 6.7B in fp32 is
    # 27 GB on the GPU for a moment.
    model = build_model(spec, device=DEVICE, dtype=torch.float32)
    # the tied head is used in GPT.forward outside wte's own forward: ZeRO-3 must know to gather it
    deepspeed.zero.register_external_parameter(model, model.wte.weight)
    groups = default_param_groups(model, weight_decay=0.01)
    for g in groups:
        g.pop("param_names", None)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    setup = time.perf_counter() - t0
    print(f"[{args.system} {args.workload}] deepspeed.initialize done in {setup:.1f} s", flush=True)

    def step(i: int) -> float:
        batch = make_batch(spec, device=engine.device, seed=i)
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        return loss.item()

    result = train_loop(step, steps=args.steps, seconds=args.seconds, name=f"{args.system} {args.workload}")
    result["overlap"] = copy_overlap(lambda: step(args.steps), Path(args.workdir))
    result.update(setup_seconds=setup, deepspeed_version=deepspeed.__version__, config=config)
    return _finish(result, args.workload, None)


SYSTEMS = {"record": run_record, "tide": run_tide, "plain": run_plain, "ds-offload": run_deepspeed,
           "ds-infinity": run_deepspeed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("system", choices=sorted(SYSTEMS))
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--result", type=Path, help="JSON result to write (default: stdout)")
    p.add_argument("--out", default=None, help="record: the folder for trace.msgpack")
    p.add_argument("--trace", default=None, help="tide: the trace to solve")
    p.add_argument("--hardware", default=None, help="tide: hardware TOML or preset for the planner")
    p.add_argument("--budget-gb", type=float, default=None, help="tide: DEVICE budget (default: the profile's memory)")
    p.add_argument("--solve-seconds", type=float, default=20.0,
                   help="planner time limit (default 20: the 1.3B trace reaches a 1%% gap in ~40 s on 2 loaded cores)")
    p.add_argument("--schedule", default=None, help="tide: train this schedule instead of solving the trace")
    p.add_argument("--optimizer-threads", type=int, default=None,
                   help="tide: intra-op threads of the CPU optimizer worker (default: the executor's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seconds", type=float, default=60.0, help="stop after the step that passes this many seconds")
    p.add_argument("--deadline-seconds", type=float, default=math.inf,
                   help="this process's whole wall time: the loop stops early enough to finish inside it")
    p.add_argument("--timing-iterations", type=int, default=2)
    p.add_argument("--nvme-dir", default=tempfile.gettempdir())
    p.add_argument("--workdir", default=None)
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only for CI's smoke run of this file")
    args = p.parse_args(argv)
    global DEVICE, DEADLINE
    DEVICE = args.device
    DEADLINE = time.perf_counter() + args.deadline_seconds
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="tide-gpu-")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)  # the profiled step writes its trace there
    if args.system == "tide" and (args.trace is None or args.hardware is None):
        p.error("tide needs --trace and --hardware")
    if args.system == "record" and args.out is None:
        p.error("record needs --out")
    started = time.perf_counter()
    try:
        result = {"ok": True, **SYSTEMS[args.system](args)}
    except BaseException as exc:  # noqa: BLE001 - the kit records every failure and goes on
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ''}",
                  "traceback": traceback.format_exc()[-3000:]}
    result.update(system=args.system, workload=args.workload, wall_seconds=time.perf_counter() - started)
    text = json.dumps(result, indent=1, default=str)
    if args.result:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.result.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(args.result)
    else:
        print(text)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
