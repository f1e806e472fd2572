"""Evaluation between iterations: a forward under `torch.no_grad()` or with `model.eval()`.

`Evaluation` is a part of `executor.runtime.Engine` (a mixin, like `ParamBinding`). When the root's
forward starts while the engine is IDLE and grad is disabled or the model is not training, the
engine enters EVALUATING instead of replaying moment 0: the forward is not one of the schedule's
iterations, so nothing of it is replayed and no activation is saved or swapped. Each unit's PARAM
chunks (the schedule's needs of the matching forward moment, plus the unit's own params) are fetched
onto DEVICE on demand, from wherever they live (NVME through HOST), within the DEVICE budget: a chunk
this evaluation fetched and no open unit needs is given back first when the next one would not fit.
At the root's post_forward every payload the evaluation changed goes back to the state it had (a
fetched copy is evicted, a stale copy it refreshed is stale again), so the next training step replays
exactly as if the evaluation had not happened. Its copies are counted apart
(`engine.eval_bytes_per_channel()`), so the bytes per training iteration still equal the prediction.

A backward through an evaluation forward is refused (one line, nothing changed): call `model.train()`
(and leave `no_grad`) before the training forward. An evaluation forward in the middle of an
iteration (between a training forward and `engine.step()`) is refused too, and so is one with
several ranks (a rank holds only its own chunks).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from executor.errors import ExecutorError
from executor.hooks import MomentEvent
from executor.store import ChunkStore, CopyState
from schemas.schedule import COPY_CHANNEL, Channel, ChunkList, Schedule, Tier
from schemas.trace import MomentKind, Phase


class Evaluation:
    """The engine's evaluation forwards (module docstring)."""

    store: ChunkStore
    schedule: Schedule
    model: nn.Module

    def _setup_evaluation(self, model: nn.Module) -> None:
        chunk_of = {id(place.param): place.slot.chunk for places in self._places.values() for place in places}
        modules = dict(model.named_modules())
        blocks = set(self._blocks)
        own: dict[str, set[int]] = {}
        for name in ["", *self._units]:  # a block's params are its subtree's; another unit's its own
            params = modules[name].parameters(recurse=name in blocks)
            own[name] = {chunk_of[id(p)] for p in params if id(p) in chunk_of}
        needs: dict[tuple[MomentKind, str], set[int]] = defaultdict(set)
        for m in self.schedule.moments:
            if m.phase is Phase.FORWARD:
                needs[(m.kind, m.module)].update(self._needs[m.id])
        for name, chunks in own.items():
            needs[(MomentKind.PRE_FORWARD, name)].update(chunks)
        self._eval_needs = {key: frozenset(v) for key, v in needs.items()}
        self._eval_before: dict[tuple[int, Tier], CopyState] = {}  # payloads changed -> their state before
        self._eval_fetched: list[int] = []  # PARAM chunks this evaluation put on DEVICE, oldest first
        self._eval_open: list[set[int]] = []  # per open unit, the chunks its forward still computes with
        self._eval_bytes: dict[Channel, int] = defaultdict(int)
        self.evaluations = 0  # evaluation forwards since attach

    def eval_bytes_per_channel(self) -> dict[Channel, int]:
        """Bytes the evaluation forwards copied since attach (kept apart from the iterations')."""
        return dict(self._eval_bytes)

    def _is_evaluation(self) -> bool:
        return not torch.is_grad_enabled() or not self.model.training

    def _begin_evaluation(self) -> None:
        if self.comm is not None:  # a rank holds only its own chunks' HOST/NVME copies
            raise ExecutorError("an evaluation forward (model.eval() or torch.no_grad()) with world_size > 1 is not "
                                "supported: evaluate after engine.detach(), or on a model loaded from engine.save()")
        self._enter_evaluating()
        self.activations.paused = True
        self._eval_open = [set()]
        self.evaluations += 1

    def _evaluation_event(self, event: MomentEvent) -> None:
        if event.phase is not Phase.FORWARD:
            self._end_evaluation()
            raise ExecutorError("backward through an evaluation forward (model.eval() or torch.no_grad()): call "
                                "model.train() and run the training forward with grad enabled")
        need = self._eval_needs.get((event.kind, event.module), frozenset())
        if event.kind is MomentKind.PRE_FORWARD and event.module:
            self._eval_open.append(set(need))
        elif event.kind is MomentKind.POST_FORWARD:
            if event.module == "":
                self._end_evaluation()
                return
            if len(self._eval_open) > 1:
                self._eval_open.pop()
            self._use(need)
        else:
            self._use(need)
        try:
            for chunk in sorted(need):
                self._eval_fetch(chunk, event)
        except ExecutorError:
            self._end_evaluation()
            raise

    def _use(self, need: frozenset[int]) -> None:
        """The work after this event computes with `need`: an open unit keeps what it used (its forward
        goes on after its children's); outside every unit only the current work's chunks are pinned."""
        if len(self._eval_open) > 1:
            self._eval_open[-1].update(need)
        else:
            self._eval_open[0] = set(need)

    def _eval_fetch(self, chunk: int, event: MomentEvent) -> None:
        store = self.store
        if store.device_tensor(ChunkList.PARAM, chunk) is not None:
            return
        tiers = store.valid_tiers(ChunkList.PARAM, chunk)
        if not tiers:
            raise ExecutorError(f"evaluation: PARAM chunk {chunk} has no valid copy between iterations")
        why = f"evaluation, {event.kind.value} of {event.module or '<root>'!r}"
        src = tiers[0]
        if src is Tier.NVME:  # through HOST, as the schedule's own NVME fetches go
            self._remember(chunk, Tier.HOST)
            store.copy(ChunkList.PARAM, chunk, Tier.NVME, Tier.HOST, COPY_CHANNEL[(Tier.NVME, Tier.HOST)], why=why,
                       counter=self._eval_bytes)
            src = Tier.HOST
        self._make_room(store.nbytes(ChunkList.PARAM, chunk), why=why)
        self._remember(chunk, Tier.DEVICE)
        store.copy(ChunkList.PARAM, chunk, src, Tier.DEVICE, COPY_CHANNEL[(src, Tier.DEVICE)], why=why,
                   counter=self._eval_bytes)
        store.wait(ChunkList.PARAM, chunk, Tier.DEVICE)
        self._eval_fetched.append(chunk)

    def _remember(self, chunk: int, tier: Tier) -> None:
        self._eval_before.setdefault((chunk, tier), self.store.state(ChunkList.PARAM, chunk, tier))

    def _make_room(self, nbytes: int, *, why: str) -> None:
        """Give back chunks this evaluation fetched and no open unit needs until `nbytes` more fit."""
        pool = self.store.pools[Tier.DEVICE]
        if pool.capacity_bytes is None:
            return
        pinned = set().union(*self._eval_open)
        for chunk in [c for c in self._eval_fetched if c not in pinned]:
            if pool.in_use_bytes + pool.other_bytes() + nbytes <= pool.capacity_bytes:
                return
            self._give_back(chunk)
        if pool.in_use_bytes + pool.other_bytes() + nbytes > pool.capacity_bytes:
            raise ExecutorError(
                f"{why}: {nbytes} more bytes of params do not fit the DEVICE budget ({pool.in_use_bytes} of "
                f"{pool.capacity_bytes} bytes held between iterations); evaluate a smaller model part at a time, "
                "or re-solve with a larger `--device-memory-gb`")

    def _give_back(self, chunk: int) -> None:
        """PARAM chunk back to the state it had before the evaluation, on every tier the evaluation changed."""
        for tier in (Tier.DEVICE, Tier.HOST):
            before = self._eval_before.pop((chunk, tier), None)
            if before is None:
                continue
            if before in (CopyState.ABSENT, CopyState.RETIRING):  # RETIRING: evicted, copies still landing
                self.store.evict(ChunkList.PARAM, chunk, tier, why="the end of an evaluation")
            elif before is CopyState.STALE:
                self.store.mark_stale(ChunkList.PARAM, chunk, tier)
        if chunk in self._eval_fetched:
            self._eval_fetched.remove(chunk)

    def _end_evaluation(self) -> None:
        """Every payload the evaluation changed goes back to its state; the engine is IDLE again."""
        if self.state is not self._evaluating_state():
            return
        try:
            for chunk in list(self._eval_fetched):
                self._give_back(chunk)
            for chunk, _ in list(self._eval_before):  # a HOST copy whose DEVICE fetch did not happen
                self._give_back(chunk)
        finally:
            self._eval_open = []
            self.activations.paused = False
            self._leave_evaluating()

    # the engine's state machine (executor/lifecycle.py)
    def _enter_evaluating(self) -> None:
        raise NotImplementedError

    def _leave_evaluating(self) -> None:
        raise NotImplementedError

    def _evaluating_state(self) -> Any:
        raise NotImplementedError
