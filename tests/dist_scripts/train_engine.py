"""The engine on several ranks, run by torchrun in tests/test_executor_distributed.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_scripts/train_engine.py \
        --schedule S.msgpack --init INIT.pt --out DIR [--steps 10 --save-at 5]

Every rank attaches `executor.run` to the same model (values from --init) with a world_size=2
schedule and trains rows [r*B/ws, (r+1)*B/ws) of each global batch: the engine replays the
schedule's ALL_GATHER / REDUCE_SCATTER over gloo. Writes DIR/stats_rank{r}.json (bytes per channel of
every iteration, losses), DIR/step{save_at}.pt and DIR/final.pt (engine.save on every rank: one
plain checkpoint written by rank 0). The executor package never imports the planner; neither does this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import executor
from executor import state
from executor.models import build_model, make_batch, model_spec
from schemas.schedule import Schedule

LR, WEIGHT_DECAY = 1e-3, 0.01  # as tests/dist_scripts/train_sharded.py and tests/test_distributed.py


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--init", required=True, help="plain checkpoint to start from (executor.state format)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-at", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a test must not hang for 30 min
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = Path(args.out)
    schedule = Schedule.read(args.schedule)
    spec = model_spec("gpt-small")
    model = build_model(spec, seed=1234)
    model.load_state_dict(state.load(args.init)["model"])
    engine = executor.run(model, schedule, params=model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, device="cpu")
    per_rank = spec.batch // ws
    iterations = []
    for step in range(args.steps):
        batch = make_batch(spec, seed=100 + step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = model(batch["idx"][rows], batch["targets"][rows])
        loss.backward()
        engine.step()
        engine.zero_grad()
        iterations.append({"loss": loss.item(),
                           "bytes_per_channel": {ch.value: n for ch, n in engine.stats().bytes_per_channel.items()}})
        if step + 1 == args.save_at:
            engine.save(out / f"step{args.save_at}.pt")
    engine.save(out / "final.pt")
    (out / f"stats_rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": ws, "iterations": iterations}))
    engine.detach()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
