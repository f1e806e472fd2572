"""A minimal chunk-sharded training loop over `executor.collectives`, run by torchrun in the tests.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_scripts/train_sharded.py \
        --schedule S.msgpack --init INIT.pt --out DIR [--steps 10 --save-at 5]

It is NOT the engine: parameters stay in host memory (no tiers, no copies); it replays only what
several ranks add, at the schedule's moments (seen through `executor.hooks.MomentHooks`):
ALL_GATHER (the owned PARAM chunk into the comm group's buffer the params point into; odd groups
pass the buffer as a list of chunk views, the other form of the API), EVICT of
PARAM from DEVICE (the group is released and its buffer poisoned with NaN, so any use of a
released param shows in the result), REDUCE_SCATTER (the grads of the group's params, averaged; each
rank keeps its owned chunk) and OPTIMIZER_STEP of owned chunks (`ChunkAdamW.step_chunk`). The data
parallel batch: rank r trains rows [r*B/ws, (r+1)*B/ws) of the global batch.

Writes DIR/stats_rank{r}.json (collective counters per iteration), DIR/step{save_at}.pt (a
checkpoint saved by all ranks, plain format) and DIR/final.pt (likewise, after the last step).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from executor.collectives import CollectiveWork, CommGroupCollectives, GroupState
from executor import state
from executor.distributed import OwnedChunks, StoreCollectives, load_sharded, runs_on_rank, save_sharded
from executor.hooks import MomentEvent, MomentHooks, find_blocks, find_units
from executor.models import build_model, make_batch, model_spec
from executor.optim import ChunkAdamW
from schemas.schedule import Action, Channel, ChunkList, Op, Schedule, Tier
from schemas.trace import MomentKind, Phase

LR, WEIGHT_DECAY = 1e-3, 0.01


class ShardedLoop:
    """Replays the collectives of `schedule` on `model` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, schedule: Schedule, coll: CommGroupCollectives, local: OwnedChunks,
                 optimizer: ChunkAdamW, *, fault: str = "none") -> None:
        self.model, self.schedule, self.coll, self.local, self.opt = model, schedule, coll, local, optimizer
        self.fault = fault  # "skip-backward-gathers": the test that the NaN poison catches a missed gather
        self.ws = coll.world_size
        self.actions: dict[int, list] = defaultdict(list)
        for a in schedule.actions:
            self.actions[a.moment].append(a)
        layout = schedule.layout
        self.chunk_of = {s.tensor: s.chunk for s in layout.tensors}
        by_name = dict(model.named_parameters(remove_duplicate=False))
        self.group_slots: dict[int, list] = defaultdict(list)
        for s in layout.tensors:
            self.group_slots[s.chunk // self.ws].append((s, by_name[s.names[0]]))
        self.param_full = {g: torch.full((coll.group_elements(g),), math.nan) for g in range(coll.n_groups)}
        self.grad_full = {g: torch.zeros(coll.group_elements(g)) for g in range(coll.n_groups)}
        with torch.no_grad():
            for g, items in self.group_slots.items():
                for s, p in items:
                    view = coll.chunk_view(self.param_full[g], s.chunk)
                    p.data = view[s.offset_elements:s.offset_elements + s.numel].view(s.shape)
        self.gathers: dict[int, CollectiveWork] = {}
        self.reductions: dict[int, CollectiveWork] = {}
        self.snapshots: dict[int, torch.Tensor] = {}
        self.skipped: set[int] = set()
        blocks = find_blocks(model)
        self.hooks = MomentHooks(model, blocks=blocks, units=find_units(model, blocks), on_event=self._on_event)
        self.hooks.install()
        self.moment = 0

    # -- one iteration -----------------------------------------------------------------------
    def train_step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        self.moment = 0
        loss = self.model(idx, targets)
        loss.backward()
        self._on_event(MomentEvent(MomentKind.OPTIMIZER_STEP, Phase.OPTIMIZER, "", -1))
        if self.moment != len(self.schedule.moments):
            raise RuntimeError(f"replayed {self.moment} moments, the schedule has {len(self.schedule.moments)}")
        for g, snap in self.snapshots.items():  # the reduce-scatter saw the final grads
            now = torch.zeros_like(snap)
            self._grads_into(g, now)
            if not torch.allclose(now, snap, rtol=0.0, atol=0.0, equal_nan=True):  # bitwise, NaN == NaN
                raise RuntimeError(f"comm group {g}: grads changed after its REDUCE_SCATTER (the schedule reduced too early)")
        self.snapshots.clear()
        for work in self.reductions.values():  # owned chunks without trainable params: reduced, never stepped
            work.wait()
        self.reductions.clear()
        for g in range(self.coll.n_groups):
            if self.coll.state(ChunkList.GRAD, g) is GroupState.REDUCED:  # an owned chunk without trainable params
                self.coll.release(ChunkList.GRAD, g)
            for lst in (ChunkList.PARAM, ChunkList.GRAD):
                if self.coll.state(lst, g) is not GroupState.RELEASED:
                    raise RuntimeError(f"comm group {g} of {lst.value} is {self.coll.state(lst, g).name} at the end "
                                       "of the iteration (not steady state)")
        for p in self.model.parameters():
            p.grad = None
        return float(loss)

    def _on_event(self, ev: MomentEvent) -> None:
        m = self.moment
        want = self.schedule.moments[m]
        if (ev.phase, ev.kind, ev.module) != (want.phase, want.kind, want.module):
            raise RuntimeError(f"moment {m}: the model did {ev}, the schedule expects {want.phase} {want.kind} {want.module!r}")
        for a in self.actions.get(m, ()):
            self._act(a)
        if want.phase is not Phase.OPTIMIZER and self.fault == "none":
            for t in want.tensors:  # the work of this moment uses these params: gathered, waited on
                g = self.chunk_of[t] // self.ws
                if g in self.gathers:
                    self.gathers.pop(g).wait()
                if self.coll.state(ChunkList.PARAM, g) is not GroupState.GATHERED:
                    raise RuntimeError(f"moment {m} uses tensor {t} of comm group {g}, which is not gathered")
        self.moment += 1

    def _act(self, a) -> None:
        coll, ws = self.coll, self.ws
        if a.op is Op.ALL_GATHER:
            if self.fault == "skip-backward-gathers" and self.schedule.moments[a.moment].phase is Phase.BACKWARD:
                return
            g = a.chunk
            self.gathers[g] = coll.all_gather(ChunkList.PARAM, g, self.local.chunk(ChunkList.PARAM, coll.owned_chunk(g)),
                                              self._buffers(self.param_full[g], g))
        elif a.op is Op.EVICT and a.list is ChunkList.PARAM and a.src is Tier.DEVICE:
            g = a.chunk // ws
            if g in self.gathers:
                self.gathers.pop(g).wait()
            if coll.state(ChunkList.PARAM, g) is GroupState.GATHERED:
                coll.release(ChunkList.PARAM, g)
                self.param_full[g].fill_(math.nan)  # a released group must not be read
        elif a.op is Op.REDUCE_SCATTER:
            g = a.chunk
            full = self.grad_full[g]
            self._grads_into(g, full)
            self.snapshots[g] = full.clone()
            self.reductions[g] = coll.reduce_scatter(ChunkList.GRAD, g, self._buffers(full, g),
                                                     self.local.chunk(ChunkList.GRAD, coll.owned_chunk(g)))
        elif a.op is Op.OPTIMIZER_STEP and coll.owns(a.chunk):
            g = a.chunk // ws
            if g in self.reductions:
                self.reductions.pop(g).wait()
            if coll.state(ChunkList.GRAD, g) is not GroupState.REDUCED:
                raise RuntimeError(f"OPTIMIZER_STEP of chunk {a.chunk}: its grads were not reduce-scattered")
            c, chunk = a.chunk, self.local.chunk
            self.opt.step_chunk(c, param=chunk(ChunkList.PARAM, c), grad=chunk(ChunkList.GRAD, c), master=None,
                                exp_avg=chunk(ChunkList.M, c), exp_avg_sq=chunk(ChunkList.V, c), skip_tensors=self.skipped)
            coll.release(ChunkList.GRAD, g)

    def _buffers(self, full: torch.Tensor, g: int) -> torch.Tensor | list[torch.Tensor]:
        """Odd groups use the chunk-list form of the collectives (what a chunk-by-chunk store passes)."""
        return [self.coll.chunk_view(full, c) for c in self.coll.group_chunks(g)] if g % 2 else full

    def _grads_into(self, g: int, full: torch.Tensor) -> None:
        full.zero_()
        for s, p in self.group_slots[g]:
            view = self.coll.chunk_view(full, s.chunk)[s.offset_elements:s.offset_elements + s.numel]
            if p.grad is None:
                self.skipped.add(s.tensor)
            else:
                self.skipped.discard(s.tensor)
                view.copy_(p.grad.reshape(-1))


def check_store_collectives(schedule: Schedule, init: dict[str, torch.Tensor]) -> dict:
    """`StoreCollectives` over the engine's real `ChunkStore` (CPU-emulated DEVICE): every group
    gathered into DEVICE payloads, grads reduce-scattered, released; returns its counters."""
    from executor.store import ChunkStore

    layout = schedule.layout
    store = ChunkStore(layout, device_capacity_bytes=1 << 30, device=torch.device("cpu"))
    sc = StoreCollectives(layout, store)
    coll, rank = sc.collectives, sc.collectives.rank
    expected = {c.id: torch.zeros(c.elements) for c in layout.chunks}
    for s in layout.tensors:
        expected[s.chunk][s.offset_elements:s.offset_elements + s.numel] = init[s.names[0]].reshape(-1)
    action = lambda op, lst, g: Action(moment=0, op=op, list=lst, chunk=g, channel=Channel.INTER_GPU)  # noqa: E731
    for g in range(coll.n_groups):
        store.place(ChunkList.PARAM, coll.owned_chunk(g), Tier.DEVICE, expected[coll.owned_chunk(g)])
        sc.apply(action(Op.ALL_GATHER, ChunkList.PARAM, g), why=f"check: gather {g}")
        for c in coll.group_chunks(g):
            if layout.chunks[c].used_elements:  # grads exist for chunks holding params
                store.allocate(ChunkList.GRAD, c, Tier.DEVICE, why="check")
                store.tensor(ChunkList.GRAD, c, Tier.DEVICE, why="check").fill_(rank + 1 + c)
        sc.apply(action(Op.REDUCE_SCATTER, ChunkList.GRAD, g), why=f"check: reduce {g}")
    for g in range(coll.n_groups):
        for c in coll.group_chunks(g):
            sc.wait(ChunkList.PARAM, c)
            if not torch.equal(store.tensor(ChunkList.PARAM, c, Tier.DEVICE, why="check"), expected[c]):
                raise RuntimeError(f"StoreCollectives: PARAM chunk {c} gathered wrong")
        own = coll.owned_chunk(g)
        sc.wait(ChunkList.GRAD, own)
        if layout.chunks[own].used_elements:
            want = (coll.world_size + 1) / 2 + own  # mean over ranks of rank + 1 + chunk
            if not torch.all(store.tensor(ChunkList.GRAD, own, Tier.DEVICE, why="check") == want):
                raise RuntimeError(f"StoreCollectives: GRAD chunk {own} reduced wrong")
        for c in coll.group_chunks(g):
            store.evict(ChunkList.PARAM, c, Tier.DEVICE, why="check")
            sc.evicted(ChunkList.PARAM, c)
    sc.end_iteration()
    if any(coll.state(lst, g) is not GroupState.RELEASED for lst in (ChunkList.PARAM, ChunkList.GRAD)
           for g in range(coll.n_groups)):
        raise RuntimeError("StoreCollectives: groups left gathered or reduced")
    store.close()
    mine = sum(runs_on_rank(a, layout, rank) for a in schedule.actions)
    return {**sc.stats.as_dict(), "actions_run_here": mine}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--init", required=True, help="plain checkpoint to start from (executor.state format)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-at", type=int, default=5)
    parser.add_argument("--fault", choices=("none", "skip-backward-gathers"), default="none")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a test must not hang for 30 min
    rank, ws = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    schedule = Schedule.read(args.schedule)
    spec = model_spec("gpt-small")
    model = build_model(spec, seed=1234)  # values come from --init
    store_check = check_store_collectives(schedule, state.load(args.init)["model"])
    coll = CommGroupCollectives(schedule.layout)
    local = OwnedChunks(schedule.layout, rank=rank)
    opt = ChunkAdamW(model.parameters(), schedule.layout, model=model, lr=LR, weight_decay=WEIGHT_DECAY)
    load_sharded(args.init, local, coll, model=model, optimizer=opt, schedule=schedule)
    agreed = [float(coll.all_reduce_scalar(torch.tensor([rank + 1.0]), op=op)) for op in ("sum", "max")]
    loop = ShardedLoop(model, schedule, coll, local, opt, fault=args.fault)
    per_rank = spec.batch // ws
    iterations = []
    for step in range(args.steps):
        batch = make_batch(spec, seed=100 + step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        before = coll.stats.as_dict()
        loss = loop.train_step(batch["idx"][rows], batch["targets"][rows])
        after = coll.stats.as_dict()
        iterations.append({"loss": loss, **{k: after[k] - before[k] for k in after}})
        if step + 1 == args.save_at:
            save_sharded(out / f"step{args.save_at}.pt", local, coll, model=model, optimizer=opt, extra={"step": step + 1},
                         schedule=schedule)
    save_sharded(out / "final.pt", local, coll, model=model, optimizer=opt, extra={"step": args.steps}, schedule=schedule)
    # the same checkpoint under another schedule of this world size (a re-solved plan): refused by every
    # rank, nothing written
    edited = dataclasses.replace(schedule, header=dataclasses.replace(schedule.header, notes=(*schedule.header.notes, "re-solved")))
    before = {key: t.clone() for key, t in local.buffers.items()}
    try:
        load_sharded(out / "final.pt", local, coll, model=model, optimizer=opt, schedule=edited)
        refused = ""
    except state.StateError as exc:
        refused = str(exc)
    foreign = {"refused": refused, "unchanged": all(torch.equal(before[k], local.buffers[k]) for k in before),
               "running": edited.content_digest(), "saved": schedule.content_digest()}
    (out / f"stats_rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": ws, "backend": coll.backend,
                                                            "store_check": store_check, "agreed": agreed, "foreign": foreign,
                                                            "iterations": iterations}))
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
