"""The engine on several ranks, run by torchrun in tests/test_executor_distributed.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_scripts/train_engine.py \
        --schedule S.msgpack --init INIT.pt --out DIR [--steps 10 --save-at 5 --eps E] \
        [--resume ONE.pt] [--accumulate N --accumulate-steps K --accumulate-schedule SA.msgpack] \
        [--fp16-schedule S16.msgpack --fp16-steps K \
         --fp16-init-scale X --fp16-poison STEP:PARAM]

Every rank attaches `executor.run` to the same model (values from --init) with a world_size=2
schedule and trains its rows of each global batch: rank r of ws with N micro-steps trains rows
[(r*N + k)*B/(ws*N), (r*N + k + 1)*B/(ws*N)) at micro-step k, each loss divided by N (N = 1: rows
[r*B/ws, (r+1)*B/ws)). The engine replays the schedule's ALL_GATHER / REDUCE_SCATTER over gloo.
One launch runs several phases, each on a fresh model and engine (one torchrun start is most of a
test's time):

- main: --steps steps; DIR/stats_rank{r}.json, DIR/step{save_at}.pt and DIR/final.pt (engine.save
  on every rank: one plain checkpoint written by rank 0);
- resume (--resume): loads a checkpoint written by ONE process at step save_at and trains steps
  save_at..steps-1; DIR/resumed_final.pt, DIR/stats_resumed_rank{r}.json;
- accumulate (--accumulate N --accumulate-schedule S): gradient accumulation over N micro-steps per
  step on schedule S (optimizer steps after backward), grad-norm clipping
  at ACCUMULATE_CLIP (Adam eps ACCUMULATE_EPS, large enough that the update depends on the grads'
  scale, so a wrong average shows); DIR/accumulate_final.pt, DIR/stats_accumulate_rank{r}.json (one
  entry per micro-step);
- fp16 (--fp16-schedule): the fp32 model on an fp16 schedule (fp32 masters), loss scale starting at
  --fp16-init-scale so the first steps overflow, and with --fp16-poison STEP:PARAM rank 0's grad of
  PARAM set to inf at STEP (an overflow only the rank owning PARAM's chunk sees in its reduced
  grads); DIR/fp16_final.pt, DIR/stats_fp16_rank{r}.json (the loss scale and optimizer steps taken
  after every step).

The executor package never imports the planner; neither does this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import executor
from executor import state
from executor.models import build_model, make_batch, model_spec
from schemas.schedule import Schedule

LR, WEIGHT_DECAY = 1e-3, 0.01  # as tests/dist_scripts/train_sharded.py and tests/test_distributed.py
ACCUMULATE_EPS, ACCUMULATE_CLIP = 1e-3, 5.0  # as tests/test_executor_distributed.py


def attach(schedule: Schedule, init: dict[str, torch.Tensor], **kwargs):  # noqa: ANN201
    model = build_model(model_spec("gpt-small"), seed=1234)
    model.load_state_dict(init)
    engine = executor.run(model, schedule, params=model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, device="cpu",
                          **kwargs)
    return model, engine


def train(model, engine, steps: range, *, accumulate: int = 1, save_at: int | None = None,  # noqa: ANN001
          out: Path | None = None, poison: tuple[int, str] | None = None) -> list[dict]:
    """Train `steps` on this rank's rows; one record per micro-step. `poison` (step, param name):
    rank 0's grad of that param is inf at that step (an fp16 overflow on one rank only)."""
    spec = model_spec("gpt-small")
    rank, ws = dist.get_rank(), dist.get_world_size()
    rows_per_micro = spec.batch // (ws * accumulate)
    records = []
    for step in steps:
        batch = make_batch(spec, seed=100 + step)
        for k in range(accumulate):
            start = (rank * accumulate + k) * rows_per_micro
            rows = slice(start, start + rows_per_micro)
            loss = model(batch["idx"][rows], batch["targets"][rows]) / accumulate
            handle = None
            if poison is not None and (step, rank) == (poison[0], 0):
                param = dict(model.named_parameters())[poison[1]]
                handle = param.register_hook(lambda grad: torch.full_like(grad, float("inf")))
            engine.backward(loss)  # plain loss.backward(), or scaled first with fp16
            if handle is not None:
                handle.remove()
            engine.step()
            engine.zero_grad()
            records.append({"step": step, "micro_step": k, "loss": loss.item(),
                            "bytes_per_channel": {ch.value: n for ch, n in engine.stats().bytes_per_channel.items()},
                            "steps_applied": engine.steps_applied,
                            "loss_scale": engine.scaler.scale if engine.scaler is not None else None})
        if save_at is not None and step + 1 == save_at:
            engine.save(out / f"step{save_at}.pt")
    return records


def write_stats(out: Path, name: str, records: list[dict]) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    (out / f"{name}_rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": ws, "iterations": records}))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--init", required=True, help="plain checkpoint to start from (executor.state format)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-at", type=int, default=5)
    parser.add_argument("--eps", type=float, help="Adam eps of the main phase (default: the engine's)")
    parser.add_argument("--resume", help="a checkpoint of step --save-at written by one process")
    parser.add_argument("--accumulate", type=int, default=0, help="micro-steps per step of the accumulate phase")
    parser.add_argument("--accumulate-steps", type=int, default=4)
    parser.add_argument("--accumulate-schedule", help="a world_size=2 schedule stepping after backward (clipping)")
    parser.add_argument("--accumulate-clip", default=str(ACCUMULATE_CLIP),
                        help="grad-norm clipping of the accumulate phase, or 'none' (a schedule stepping in backward)")
    parser.add_argument("--fp16-schedule", help="a world_size=2 fp16 schedule for the fp16 phase")
    parser.add_argument("--fp16-steps", type=int, default=6)
    parser.add_argument("--fp16-init-scale", type=float, default=2.0**16)
    parser.add_argument("--fp16-poison", help="STEP:PARAM: rank 0's grad of PARAM is inf at STEP")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a test must not hang for 30 min
    torch.set_num_threads(1)
    out = Path(args.out)
    schedule = Schedule.read(args.schedule)
    init = state.load(args.init)["model"]

    model, engine = attach(schedule, init, **({"eps": args.eps} if args.eps is not None else {}))
    write_stats(out, "stats", train(model, engine, range(args.steps), save_at=args.save_at, out=out))
    engine.save(out / "final.pt")
    engine.detach()

    if args.resume:
        model, engine = attach(schedule, init)
        engine.load(args.resume)
        write_stats(out, "stats_resumed", train(model, engine, range(args.save_at, args.steps)))
        engine.save(out / "resumed_final.pt")
        engine.detach()

    if args.accumulate:
        model, engine = attach(Schedule.read(args.accumulate_schedule), init, eps=ACCUMULATE_EPS,
                               grad_clip_norm=None if args.accumulate_clip == "none" else float(args.accumulate_clip),
                               grad_accumulation_steps=args.accumulate)
        write_stats(out, "stats_accumulate", train(model, engine, range(args.accumulate_steps),
                                                   accumulate=args.accumulate))
        engine.save(out / "accumulate_final.pt")
        engine.detach()

    if args.fp16_schedule:
        model, engine = attach(Schedule.read(args.fp16_schedule), init)
        engine.scaler.scale = args.fp16_init_scale
        poison = None
        if args.fp16_poison:
            step, name = args.fp16_poison.split(":", 1)
            poison = (int(step), name)
        write_stats(out, "stats_fp16", train(model, engine, range(args.fp16_steps), poison=poison))
        engine.save(out / "fp16_final.pt")
        engine.detach()

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()  # every result is written and the process group destroyed by now
    # Note [exit without finalization]: about 1 run in 15 a rank aborted AFTER main returned ("terminate
    # called without an active exception"; faulthandler: no Python frame left, so in the interpreter's
    # finalization / C++ static destructors, CI 2026-11-23). Not root-caused (gloo or torch teardown,
    # see the session's closing note); the results this test checks are complete, so skip finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
