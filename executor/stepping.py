"""Optimizer steps, grad-norm clipping and fp16 loss scaling of the engine, per schedule action.

`OptimizerSteps` is a part of `executor.runtime.Engine` (a mixin: it works on the engine's `store`,
`optimizer`, `scaler` and the slots `executor.binding.ParamBinding` set up): an OPTIMIZER_STEP runs
inline (DEVICE steps, HOST steps of the OPTIMIZER moment), on the optimizer worker while backward
goes on (Note [CPU optimizer steps]), or one step stale (Note [asynchronous mode]); `_prepare_step`
decides the loss-scale overflow and the clip coefficient before the first step of an iteration.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from executor.errors import ExecutorError
from executor.cpu_steps import OneStepStaleUpdater, StepWorker
from executor.optim import ChunkAdamW, DynamicLossScaler
from executor.store import ChunkStore
from schemas.schedule import ChunkList, Op, Schedule, Tier
from schemas.trace import Phase

# Note [CPU optimizer steps]
# CPU optimizer steps overlapped with backward (Fuyou §4.3): an OPTIMIZER_STEP on HOST that the
# schedule places at a backward moment (`planner solve --no-optimizer-overlap` places none there) runs
# on the engine's optimizer worker -- ONE thread, created at attach like the store's copy worker --
# while backward goes on. Its completion is a `Ready` carried by the chunk's HOST payloads
# (`ChunkStore.in_place`): PARAM/MASTER/M/V are ARRIVING with it and GRAD lists it as a user, so every
# later action on them is ordered after it: a copy (the H2D of the updated PARAM, a WRITE_BACK to NVME)
# waits for it off the training thread (emulated DEVICE: queued on the copy thread once the step ended,
# so the copies behind it are not held up; on a GPU an H2D copy is still issued after a host-side wait
# for the step, so a schedule that re-fetches a stepped PARAM during backward waits there); an EVICT
# of the grads does not wait (the buffer is reused after the step); an EVICT of PARAM/OS from HOST
# waits (it follows their NVME write, whose failure must leave the HOST copy: the delayed write-back
# of the previous group therefore waits at the next group's step, and a step still queued then is run
# by the training thread itself); state_dict(), save() and detach() wait. The OPTIMIZER moment waits
# for every step: engine.step() returns with all done. The training thread's waits for steps count as
# stalls in `stats()`. Everything a step uses (the skipped tensors, the grad scale, every param
# group's lr/betas/eps/weight decay) is taken when it is submitted, so the result is bit-identical to
# the inline step whatever the timing. A step that fails
# raises one `ExecutorError` on the training thread (at the next moment, at the next use of its chunk,
# or in engine.step()) and the engine enters FAILED. DEVICE steps (kernels on the compute stream) and
# the HOST steps of the OPTIMIZER moment run inline; with world_size > 1 every step runs inline.
# Threads: with torch's OpenMP backend the intra-op thread count belongs to the calling thread, so the
# worker sets its own (`optimizer_threads=`; default: `torch.get_num_threads()` when DEVICE is a GPU,
# whose training thread mostly waits, and half of it on an emulated DEVICE, where backward computes on
# the same cores) and the training thread keeps its count. `torch.set_num_threads` also records the
# count as the default for threads torch initializes later (its autograd device threads); none exist
# on a CPU-only run, and on a GPU they launch kernels. On an emulated DEVICE the worker also runs at
# the lowest CPU priority (Linux thread nice 19), so steps take only the cycles backward leaves instead
# of stretching its parallel regions; and at the OPTIMIZER moment the training thread runs the steps
# not started yet itself, with all its threads (`executor.optim.StepWorker.run_queued`), rather than
# waiting. The fused CPU kernels are element-wise, so which thread runs a step (and with how many
# intra-op threads) does not change a bit of its result.

# Note [asynchronous mode]
# Asynchronous mode (`stale_optimizer=True`, Angel-PTM Algorithm 2; it CHANGES CONVERGENCE): the HOST
# step of a chunk in iteration t is queued with a copy of its grads and runs in the background during
# iteration t+1; the chunk's step of iteration t+1 publishes it into PARAM. The forward of iteration
# t+1 thus sees updates 1..t-1 only: exactly one step of staleness, deterministic
# (`executor.optim.OneStepStaleUpdater`; tests/test_executor_overlap.py measures the drift from the
# synchronous engine). The OS of HOST-stepped chunks must stay on HOST (checked at attach); DEVICE steps
# stay synchronous; not with world_size > 1. state_dict(), save(), load() and detach() first apply the
# outstanding update, so a checkpoint is the synchronous state after the last step (and training on
# from it is one update less stale once).


def default_param_groups(model: nn.Module, *, weight_decay: float) -> list[dict[str, Any]]:
    """The common AdamW grouping: decay on matrices, none on norms, biases and other 1-D params."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append((name, p))
    groups = [{"params": [p for _, p in g], "param_names": [n for n, _ in g], "weight_decay": wd}
              for g, wd in ((decay, weight_decay), (no_decay, 0.0)) if g]
    return groups


def _busy_clock() -> Any:
    """A clock of the seconds a step keeps a core busy, for comparison with the simulator's busy time:
    the calling thread's CPU time when it steps with one intra-op thread (the optimizer worker on an
    emulated DEVICE, at nice 19 beside backward: its wall time also counts the time backward preempts
    it), its wall time otherwise (CPU time of one thread would miss the other intra-op threads' work)."""
    if torch.get_num_threads() == 1:
        start = time.thread_time()
        return lambda: time.thread_time() - start
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


class OptimizerSteps:
    """The engine's optimizer steps, clipping and loss scaling (module docstring)."""

    store: ChunkStore
    optimizer: ChunkAdamW
    scaler: DynamicLossScaler | None
    device: torch.device
    grad_clip_norm: float | None
    _has_master: bool

    def _optimizer_step(self, chunk: int, tier: Tier, *, why: str) -> None:
        store = self.store
        self._fill_gaps(chunk)
        start, busy = time.perf_counter(), _busy_clock()
        lists = [ChunkList.PARAM, ChunkList.M, ChunkList.V] + ([ChunkList.MASTER] if self._has_master else [])
        for lst in lists:
            store.drop_readers(lst, chunk, tier)  # a write-back still reading the old values
        payload = {lst: store.tensor(lst, chunk, tier, why=why) for lst in [*lists, ChunkList.GRAD]}
        skip = [t for t in self._trainable_by_chunk.get(chunk, ()) if t not in self._grad_seen]
        grad_scale = self._grad_scale
        if self._clip_coefficient is not None and payload[ChunkList.GRAD].dtype == torch.float32:
            # what clip_grad_norm_ does (grads *= coefficient), so fp32 clipping stays bit-identical
            payload[ChunkList.GRAD].mul_(self._clip_coefficient)
            grad_scale = self.scaler.inv_scale if self.scaler is not None else 1.0
        self.optimizer.step_chunk(chunk, param=payload[ChunkList.PARAM], grad=payload[ChunkList.GRAD],
                                  master=payload.get(ChunkList.MASTER), exp_avg=payload[ChunkList.M],
                                  exp_avg_sq=payload[ChunkList.V], grad_scale=grad_scale, skip_tensors=skip)
        self._stepped.add(chunk)  # before `updated`, which may raise a failed copy of another tier
        for lst in lists:
            store.updated(lst, chunk, tier)
        self._stats.optimizer_seconds[tier] += time.perf_counter() - start
        self._stats.optimizer_busy_seconds[tier] += busy()

    def _setup_cpu_steps(self, schedule: Schedule, *, stale: bool, threads: int | None) -> None:
        """Checked before anything is touched: the optimizer worker for overlapped HOST steps, or the
        one-step-stale updater (`stale_optimizer=True`)."""
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ExecutorError(f"optimizer_threads={threads!r}: expected a positive int or None (the default)")
        if threads is None:
            # a GPU leaves the cores to the CPU optimizer; an emulated DEVICE computes backward on
            # them, so the worker takes half and the training thread keeps its own count
            threads = torch.get_num_threads() if self.device.type == "cuda" else max(1, torch.get_num_threads() // 2)
        self.optimizer_threads = threads
        self._step_worker = None
        self._steps_in_flight: list[Any] = []
        self._failed_steps: list[int] = []  # chunks whose CPU step failed (appended on the worker)
        self._step_stall_seconds = 0.0
        self._stats_lock = threading.Lock()
        self._stale: OneStepStaleUpdater | None = None
        host_steps = [a for a in schedule.actions if a.op is Op.OPTIMIZER_STEP and a.dst is Tier.HOST]
        optimizer_moment = next(m.id for m in schedule.moments if m.phase is Phase.OPTIMIZER)
        if stale:
            if schedule.header.world_size > 1:
                raise ExecutorError("stale_optimizer=True with world_size > 1: not supported; train synchronously")
            host_chunks = {a.chunk for a in host_steps}
            os_lists = {ChunkList.M, ChunkList.V, ChunkList.MASTER}
            resident = {(r.list, r.chunk): r.tiers for r in schedule.initial_residency}
            moved = sorted({a.chunk for a in schedule.actions if a.list in os_lists and a.chunk in host_chunks}
                           | {c for c in host_chunks for lst in os_lists & set(schedule.layout.lists)
                              if Tier.HOST not in resident.get((lst, c), ())})
            if moved:
                raise ExecutorError(
                    f"stale_optimizer=True: the optimizer state of chunks {moved} does not stay on HOST (a stale "
                    "update runs during the next iteration and needs it there); solve with the OS on HOST, or train "
                    "synchronously (stale_optimizer=False)")
            self._stale = OneStepStaleUpdater(self.optimizer, threads=threads)
            return
        if schedule.header.world_size == 1 and any(a.moment < optimizer_moment for a in host_steps):
            # created once, like the store's copy worker; on an emulated DEVICE backward computes on
            # the same cores, so the steps take what it leaves (the training thread does the rest)
            self._step_worker = StepWorker(threads=threads, background=self.device.type != "cuda")

    def _submit_step(self, chunk: int, *, why: str) -> None:
        """A HOST step placed during backward: runs on the optimizer worker while backward goes on.

        Same arguments as the inline step, decided now on the training thread (skipped tensors,
        grad scale, the param groups' settings); the store orders every later use of the chunk's
        payloads after it (ChunkStore.in_place)."""
        store = self.store
        self._fill_gaps(chunk)
        lists = [ChunkList.PARAM, ChunkList.M, ChunkList.V] + ([ChunkList.MASTER] if self._has_master else [])
        skip = frozenset(t for t in self._trainable_by_chunk.get(chunk, ()) if t not in self._grad_seen)
        grad_scale, hyper = self._grad_scale, self.optimizer.hyperparameters()
        optimizer, stats = self.optimizer, self._stats

        def run(t: dict[ChunkList, torch.Tensor]) -> None:
            start, busy = time.perf_counter(), _busy_clock()
            optimizer.step_chunk(chunk, param=t[ChunkList.PARAM], grad=t[ChunkList.GRAD],
                                 master=t.get(ChunkList.MASTER), exp_avg=t[ChunkList.M], exp_avg_sq=t[ChunkList.V],
                                 grad_scale=grad_scale, skip_tensors=skip, hyperparameters=hyper)
            with self._stats_lock:
                stats.optimizer_seconds[Tier.HOST] += time.perf_counter() - start
                stats.optimizer_busy_seconds[Tier.HOST] += busy()

        def submit(job: Any) -> Any:
            def guarded() -> None:
                try:
                    job()
                except Exception as exc:  # noqa: BLE001 - re-raised on the training thread as one line
                    self._failed_steps.append(chunk)
                    raise ExecutorError(f"{why}: the CPU optimizer step of chunk {chunk} failed: {exc}") from exc
            return self._step_worker.submit(guarded)

        ready = store.in_place(chunk, Tier.HOST, writes=lists, reads=[ChunkList.GRAD], submit=submit, run=run)
        self._steps_in_flight.append(ready)
        self._stepped.add(chunk)  # before `updated`, which may raise a failed copy of another tier
        for lst in lists:
            store.updated(lst, chunk, Tier.HOST)

    def _poll_steps(self) -> None:
        """Re-raise a CPU step that failed; forget the ones done."""
        still = []
        for ready in self._steps_in_flight:
            if ready.done():
                ready.wait()  # raises the step's ExecutorError
            else:
                still.append(ready)
        self._steps_in_flight = still

    def _settle_steps(self) -> None:
        """After a failure: every CPU step in flight ends (failed or not); the chunks whose step failed
        are not counted as stepped (`EngineFailure.updated_chunks` says what really changed)."""
        in_flight, self._steps_in_flight = self._steps_in_flight, []
        for ready in in_flight:
            try:
                ready.wait()
            except Exception:  # noqa: BLE001 - the failure being reported, or one more of the same kind
                pass
        self._stepped.difference_update(self._failed_steps)

    def _wait_steps(self) -> None:
        """Every CPU step in flight ends; the time waited is a stall."""
        in_flight, self._steps_in_flight = self._steps_in_flight, []
        for ready in in_flight:
            self._step_stall_seconds += ready.wait()

    def _stale_step(self, chunk: int, *, why: str) -> None:
        """stale_optimizer=True: queue this iteration's update of the chunk, and publish (copy into
        PARAM) the previous iteration's, which ran in the background since (Angel-PTM Algorithm 2; Note [asynchronous mode])."""
        store = self.store
        self._fill_gaps(chunk)
        lists = [ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V] + (
            [ChunkList.MASTER] if self._has_master else [])
        t = {lst: store.tensor(lst, chunk, Tier.HOST, why=why) for lst in lists}
        skip = [s for s in self._trainable_by_chunk.get(chunk, ()) if s not in self._grad_seen]
        self._stale.submit(chunk, param=t[ChunkList.PARAM], grad=t[ChunkList.GRAD], master=t.get(ChunkList.MASTER),
                           exp_avg=t[ChunkList.M], exp_avg_sq=t[ChunkList.V], grad_scale=self._grad_scale,
                           skip_tensors=skip)
        store.drop_readers(ChunkList.PARAM, chunk, Tier.HOST)  # a copy still reading the old values
        start = time.perf_counter()
        try:
            self._stale.publish(chunk, t[ChunkList.PARAM])
        except Exception as exc:  # noqa: BLE001 - the previous update failed on the worker
            raise ExecutorError(f"{why}: the stale optimizer update of chunk {chunk} failed: {exc}") from exc
        self._step_stall_seconds += time.perf_counter() - start
        self._stepped.add(chunk)
        store.updated(ChunkList.PARAM, chunk, Tier.HOST)

    def _drain_stale(self) -> None:
        """stale_optimizer=True, before state leaves or is replaced: apply every outstanding update now
        and publish it into every valid PARAM copy (the synchronous state after the last step)."""
        if self._stale is None or not self._stale.outstanding:
            return
        chunks = self._stale.outstanding
        params = {c: self.read_chunk(ChunkList.PARAM, c) for c in chunks}
        self._stale.drain(params)
        for c in chunks:
            self.write_chunk(ChunkList.PARAM, c, params[c])

    def _restart_stale(self) -> None:
        """After a load: a fresh updater (its fp32 masters are taken again from the loaded PARAM chunks)."""
        if self._stale is not None:
            self._stale.close()
            self._stale = OneStepStaleUpdater(self.optimizer, threads=self.optimizer_threads)

    def _close_cpu_steps(self) -> None:
        if self._stale is not None:
            self._stale.close()
        if self._step_worker is not None:
            self.store.settle()  # the steps in flight end (their payloads wait for them)
            self._step_worker.shutdown()
            self._step_worker = None

    def _prepare_step(self) -> None:
        """Before the first OPTIMIZER_STEP of the window: loss-scale overflow and the clip coefficient."""
        if self.scaler is None and self.grad_clip_norm is None:
            return
        inv_scale = self.scaler.inv_scale if self.scaler is not None else 1.0
        flats: dict[int, torch.Tensor] = {}
        for chunk in self._trainable_by_chunk:
            if self.comm is not None:
                if not self.comm.collectives.owns(chunk):
                    continue  # its owner holds the reduced grads
                self.comm.wait(ChunkList.GRAD, chunk)  # a reduce-scatter still filling it
            self._fill_gaps(chunk)
            tiers = self.store.valid_tiers(ChunkList.GRAD, chunk)
            if not tiers:
                raise ExecutorError(f"schedule violation: GRAD chunk {chunk} has no valid copy at the optimizer moment")
            flats[chunk] = self.store.tensor(ChunkList.GRAD, chunk, tiers[0], why="the optimizer moment")
            if self.scaler is not None:
                self.scaler.check(flats[chunk])
        self._found_inf = self.scaler.found_inf() if self.scaler is not None else False
        if self.scaler is not None and self.comm is not None:
            # a rank sees only its owned reduced grads: the ranks agree on "any inf anywhere", so
            # every rank skips (or steps) together and their loss scales stay equal
            flag = torch.tensor(1.0 if self._found_inf else 0.0, dtype=torch.float32)
            self._found_inf = bool(self.comm.collectives.all_reduce_scalar(flag, op="max").item())
        coefficient = 1.0
        if self.grad_clip_norm is not None and not self._found_inf:
            # per-tensor norms in model.parameters() order, combined as clip_grad_norm_ does, so the
            # coefficient is the plain loop's to the last bit wherever the GRAD chunks live
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            for slot in self._clip_order:
                if slot.tensor in self._grad_seen and slot.chunk in flats:
                    view = flats[slot.chunk][slot.offset_elements:slot.offset_elements + slot.numel]
                    groups[(view.device, view.dtype)].append(view)
            norms = [n.float().to(self.device) for views in groups.values() for n in torch._foreach_norm(views, 2.0)]
            if self.comm is not None:  # the owned grads' squared norm, summed over the ranks
                squared = torch.stack(norms).square().sum() if norms else torch.zeros((), device=self.device)
                norms = [self.comm.collectives.all_reduce_scalar(squared, op="sum").to(self.device).sqrt()]
            if norms:
                total = torch.linalg.vector_norm(torch.stack(norms), 2.0) * inv_scale
                coefficient = float(torch.clamp(self.grad_clip_norm / (total + 1e-6), max=1.0))
        self._clip_coefficient = coefficient if self.grad_clip_norm is not None else None
        self._grad_scale = coefficient * inv_scale
