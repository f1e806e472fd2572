"""Kill harness (issue 21, item 4): train with HOST and NVMe offload in a subprocess, SIGKILL it at seeded
random points, resume from the last checkpoint, and compare every checkpoint with an unkilled run's.

    python tests/kill_harness.py --kills 10 --seed 0 [--workdir DIR]     # what tests/test_kill.py and
                                                                         # bench/bench_kill.py run

The schedule (the small GPT of the executor tests; OS of even chunks on NVME, odd on HOST, PARAM
homes on HOST/NVME, CPU optimizer steps overlapped with backward) is written once; every worker is
`python tests/kill_harness.py worker ...`: it attaches the engine, loads the newest checkpoint
`ckpt-<iteration>.pt` if there is one, trains the remaining iterations (the batch of iteration i is
always the same tensor) and saves a checkpoint every `--every` iterations. A kill point is a kind
and a count, drawn from the seed; the worker SIGKILLs itself (a real SIGKILL: no cleanup, no
flush) when the count-th event of that kind happens:

- `save-before-rename`: inside `engine.save`, the temp file written and fsynced, before the rename;
- `save-before-dirsync`: inside `engine.save`, after the rename, before the folder's fsync;
- `nvme-write`: the count-th `pwrite` of the NVMe store (a WRITE_BACK of PARAM / OS chunks);
- `cpu-step`: the count-th CPU Adam chunk step (these run on the optimizer thread, overlapped);
- `between-steps`: right after `engine.step()` of iteration count returned.

A chain of workers, each with the next kill point, runs until the training finishes; then every
checkpoint must equal, bit for bit (params, optimizer state), the unkilled run's at the same
iteration, no `*.tmp` may be left beside the checkpoints, and every resume must have started from
the newest checkpoint on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KINDS = ("save-before-rename", "save-before-dirsync", "nvme-write", "cpu-step", "between-steps")
ITERATIONS = 12  # per chain; checkpoints every EVERY iterations
EVERY = 2


# ----------------------------------------------------------------------------- worker (the killed process)


def _kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(kind: str, count: int) -> None:
    """Patch the one call of `kind` to SIGKILL this process at its count-th event."""
    seen = {"n": 0}

    def tick() -> None:
        seen["n"] += 1
        if seen["n"] == count:
            _kill_now()

    import schemas._base as base

    if kind == "save-before-rename":
        real_replace = os.replace

        def replace(a, b):  # noqa: ANN001
            if str(b).endswith(".pt"):
                tick()
            return real_replace(a, b)

        base.os.replace = replace  # the same os module everywhere: fine in a worker that dies anyway
    elif kind == "save-before-dirsync":
        real_sync = base.fsync_directory

        def fsync_directory(folder):  # noqa: ANN001
            tick()
            return real_sync(folder)

        base.fsync_directory = fsync_directory
    elif kind == "nvme-write":
        real_pwrite = os.pwrite

        def pwrite(fd, data, offset):  # noqa: ANN001
            tick()
            return real_pwrite(fd, data, offset)

        os.pwrite = pwrite
    elif kind == "cpu-step":
        from executor.optim import ChunkAdamW

        real_step = ChunkAdamW.step_chunk

        def step_chunk(self, *args, **kwargs):  # noqa: ANN001
            tick()
            return real_step(self, *args, **kwargs)

        ChunkAdamW.step_chunk = step_chunk


def _checkpoints(folder: Path) -> dict[int, Path]:
    out = {}
    for p in folder.glob("ckpt-*.pt"):
        m = re.fullmatch(r"ckpt-(\d+)\.pt", p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    import executor
    from schemas import Schedule
    from test_executor import LR, WD, gpt_batches
    from test_executor_planner import gpt_model

    ckpt_dir, nvme_dir = Path(args.ckpt_dir), Path(args.nvme_dir)
    schedule = Schedule.read(args.schedule)
    model = gpt_model()
    batches = gpt_batches(args.iterations)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=nvme_dir)
    saved = _checkpoints(ckpt_dir)
    start = max(saved, default=0)
    if start:
        engine.load(saved[start])
    print(f"resumed {start}", flush=True)
    if args.kill:
        kind, count = args.kill.split(":")
        if kind != "between-steps":
            _arm(kind, int(count))
    for i in range(start, args.iterations):
        model(batches[i], batches[i]).backward()
        engine.step()
        if args.kill and args.kill == f"between-steps:{i + 1}":
            _kill_now()
        if (i + 1) % args.every == 0:
            engine.save(ckpt_dir / f"ckpt-{i + 1:04d}.pt")
    engine.detach()
    print("done", flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def write_schedule(path: Path) -> None:
    sys.path.insert(0, str(HERE))
    import torch

    torch.set_num_threads(1)
    from test_executor_planner import plan

    plan("gpt", nvme=True, overlap=True).write(path)


def _run_worker(schedule: Path, ckpt_dir: Path, nvme_dir: Path, kill: str | None, iterations: int, every: int
                ) -> tuple[int, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--schedule", str(schedule), "--ckpt-dir", str(ckpt_dir),
           "--nvme-dir", str(nvme_dir), "--iterations", str(iterations), "--every", str(every)]
    if kill:
        cmd += ["--kill", kill]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return run.returncode, run.stdout + run.stderr


def kill_points(seed: int, kills: int, iterations: int) -> list[str]:
    """Seeded kill points; counts small enough that most trip before the worker finishes."""
    rng = random.Random(seed)
    points = []
    for _ in range(kills):
        kind = rng.choice(KINDS)
        count = {"save-before-rename": rng.randint(1, 2), "save-before-dirsync": rng.randint(1, 2),
                 "nvme-write": rng.randint(1, 400), "cpu-step": rng.randint(1, 60),
                 "between-steps": rng.randint(1, iterations)}[kind]
        points.append(f"{kind}:{count}")
    return points


def _state(path: Path) -> dict:
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return {"model": ckpt["model"], "optimizer": ckpt["optimizer"]}


def _equal(a, b) -> bool:  # noqa: ANN001
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def run_chain(workdir: Path, *, kills: int, seed: int, iterations: int = ITERATIONS, every: int = EVERY,
              log=print) -> dict:  # noqa: ANN001
    """The unkilled reference, then kill chains until `kills` kills happened; returns the figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    schedule = workdir / "schedule.msgpack"
    if not schedule.exists():
        write_schedule(schedule)
    ref = workdir / "reference"
    if not (ref / f"ckpt-{iterations:04d}.pt").exists():
        (ref / "nvme").mkdir(parents=True, exist_ok=True)
        code, out = _run_worker(schedule, ref, ref / "nvme", None, iterations, every)
        if code != 0:
            raise RuntimeError(f"reference run failed ({code}): {out[-2000:]}")
    reference = {i: _state(p) for i, p in _checkpoints(ref).items()}
    figures = {"kills": 0, "kills_by_kind": {}, "resumes": 0, "failed_resumes": 0, "checkpoints_compared": 0,
               "mismatches": 0, "stale_tmp_left": 0, "workers": 0, "chains": 0, "failures": []}
    points = kill_points(seed, kills, iterations)
    chain_no = 0
    started = time.perf_counter()
    while points:
        chain_no += 1
        figures["chains"] += 1
        run_dir = workdir / f"chain-{chain_no}"
        (run_dir / "nvme").mkdir(parents=True, exist_ok=True)
        after_kill = False
        while True:
            kill = points.pop(0) if points else None
            before = max(_checkpoints(run_dir), default=0)
            code, out = _run_worker(schedule, run_dir, run_dir / "nvme", kill, iterations, every)
            figures["workers"] += 1
            resumed = re.search(r"resumed (\d+)", out)
            if after_kill:  # a restart after a kill: it must start from the newest checkpoint (0: none yet)
                figures["resumes"] += 1
                if resumed is None or int(resumed.group(1)) != before:
                    figures["failed_resumes"] += 1
                    figures["failures"].append(f"chain {chain_no}: resume from {before} failed: {out[-800:]}")
            after_kill = code == -signal.SIGKILL
            if code == -signal.SIGKILL:
                figures["kills"] += 1
                kind = kill.split(":")[0]
                figures["kills_by_kind"][kind] = figures["kills_by_kind"].get(kind, 0) + 1
                log(f"  chain {chain_no}: killed at {kill} (checkpoints up to {max(_checkpoints(run_dir), default=0)})")
                continue
            if code != 0:
                figures["failed_resumes"] += 1
                figures["failures"].append(f"chain {chain_no}: worker exited {code} with kill {kill}: {out[-800:]}")
                break
            break  # finished (a kill point that never tripped is used up: the chain ends)
        for i, path in _checkpoints(run_dir).items():
            figures["checkpoints_compared"] += 1
            if not _equal(_state(path), reference[i]):
                figures["mismatches"] += 1
                figures["failures"].append(f"chain {chain_no}: checkpoint {i} differs from the unkilled run's")
        figures["stale_tmp_left"] += len(list(run_dir.glob("*.tmp"))) + len(list(run_dir.glob(".*.tmp")))
        leftovers = [p for p in (run_dir / "nvme").iterdir() if p.name.startswith("tide-nvme-")]
        figures["stale_tmp_left"] += len(leftovers)
    figures["seconds"] = round(time.perf_counter() - started, 1)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    w.add_argument("--schedule", required=True)
    w.add_argument("--ckpt-dir", required=True)
    w.add_argument("--nvme-dir", required=True)
    w.add_argument("--iterations", type=int, default=ITERATIONS)
    w.add_argument("--every", type=int, default=EVERY)
    w.add_argument("--kill", help="KIND:COUNT")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir")
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tide-kill-"))
    figures = run_chain(workdir, kills=args.kills, seed=args.seed)
    print(json.dumps(figures, indent=2))
    return 0 if not figures["failures"] and not figures["stale_tmp_left"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
