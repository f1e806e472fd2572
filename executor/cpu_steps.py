"""CPU optimizer steps off the training thread (the engine's two ways to overlap them).

`StepWorker` is the ONE thread the engine runs HOST steps on while backward goes on (Fuyou §4.3,
synchronous: the engine waits for every step at the OPTIMIZER moment). `OneStepStaleUpdater` is the
opt-in asynchronous mode (Angel-PTM Algorithm 2, one step of staleness): it changes convergence,
see its docstring. Both call `ChunkAdamW.step_chunk` (executor/optim.py) with the param groups'
settings taken when the step was decided.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import weakref
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from executor.optim import ChunkAdamW

__all__ = ["OneStepStaleUpdater", "StepWorker"]


class StepWorker:
    """ONE thread running CPU optimizer steps beside the training thread, in submission order.

    threads: its intra-op threads (with torch's OpenMP backend the count belongs to the calling
      thread: setting it on the worker leaves the training thread's count as it was).
    background: run at the lowest CPU priority (Linux thread nice 19): when backward computes on the
      same cores (emulated DEVICE) the steps take only the cycles it leaves, and `run_queued` lets the
      training thread do what is left at full speed once backward is over.
    `submit(fn)` returns a Future; `run_queued()` runs on the CALLING thread every step not started
    yet (in order), so at the OPTIMIZER moment the training thread works instead of waiting; and the
    thread that created the worker (the training thread), when it must wait for one step still
    queued, runs that step itself (`run_here`; store.Ready.wait calls it) instead of waiting for the
    worker to get through the steps before it.
    """

    def __init__(self, *, threads: int, background: bool = False, name: str = "tide-optim") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"optimizer threads must be a positive int, found {threads!r}")
        self.threads, self.background = threads, background
        self._queue = _StepQueue(owner=threading.get_ident())
        # the thread holds the queue, not the worker: a worker nobody shut down still ends its thread
        # when it is collected (as ThreadPoolExecutor does)
        self._thread = threading.Thread(target=_step_loop, args=(self._queue, threads, background), name=name,
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.close)

    def submit(self, fn: Callable[[], Any]) -> Future:
        future = _StepFuture(self._queue)
        with self._queue.wake:
            if self._queue.closed:
                raise RuntimeError("StepWorker.submit after shutdown")
            self._queue.jobs.append((future, fn))
            self._queue.wake.notify()
        return future

    def run_queued(self) -> None:
        while (job := self._queue.take()) is not None:
            _run_job(*job)

    def shutdown(self) -> None:
        self._queue.close()
        self._thread.join()


class _StepQueue:
    """The steps not started yet, shared by the worker thread and the owner (training) thread."""

    def __init__(self, *, owner: int) -> None:
        self.jobs: collections.deque[tuple[Future, Callable[[], Any]]] = collections.deque()
        self.wake = threading.Condition()
        self.closed = False
        self.owner = owner

    def take(self) -> tuple[Future, Callable[[], Any]] | None:
        with self.wake:
            return self.jobs.popleft() if self.jobs else None

    def run_here(self, future: Future) -> None:
        """On the owner thread: run this step now if it is still queued (else the caller waits for it)."""
        if threading.get_ident() != self.owner:
            return
        with self.wake:
            job = next((j for j in self.jobs if j[0] is future), None)
            if job is None:
                return
            self.jobs.remove(job)
        _run_job(*job)

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()


def _step_loop(queue: _StepQueue, threads: int, background: bool) -> None:
    torch.set_num_threads(threads)
    if background and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except OSError:  # not allowed here: the worker just competes at normal priority
            pass
    while True:
        with queue.wake:
            while not queue.jobs and not queue.closed:
                queue.wake.wait()
            if not queue.jobs:
                return
            job = queue.jobs.popleft()
        _run_job(*job)


class _StepFuture(Future):
    """A step's future: whoever waits for it on the owner thread may run it if still queued."""

    def __init__(self, queue: _StepQueue) -> None:
        super().__init__()
        self._queue = queue

    def run_here(self) -> None:
        self._queue.run_here(self)


def _run_job(future: Future, fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the step
        future.set_exception(exc)
    else:
        future.set_result(result)


class OneStepStaleUpdater:
    """OPT-IN asynchronous optimizer (Angel-PTM §4.3, Algorithm 2) with exactly one step of
    staleness. It CHANGES CONVERGENCE: the grad of iteration t is computed at the params of
    iteration t-2's update, not t-1's (w_t = w_{t-1} - AdamW(grad at w_{t-2})). Use it only behind
    an explicit flag; tests/test_optim_async.py measures how far it drifts from the synchronous step.

    Why: the CPU update of a chunk no longer has to finish before the next iteration's forward
    uses that chunk; it overlaps the whole next iteration (the GPU never waits for the CPU/SSD).

    Deterministic (unlike Angel's lock-free version, where the staleness is 0 or 1 by timing):
    - `submit(chunk, ...)` when the chunk's grads of iteration t are final: the grad is copied into
      one of two buffered-grad slots (Angel's g'), the update job is queued, not started;
    - `publish(chunk, param)` before the chunk's params are used in iteration t+1: waits for the job
      of iteration t-1, copies its result (master) into PARAM (Angel's p'), then starts the job of
      iteration t, which runs in the background during iteration t+1;
    - `drain(params)` (before a checkpoint or at the end): runs every outstanding job and publishes.
    The master is updated only between two publishes of its chunk, so PARAM never sees a half update.
    With fp32 training (master=None) the updater keeps its own fp32 master per chunk, because PARAM
    must stay readable by the forward while the update runs. M/V buffers passed to `submit` must stay
    where they are until the chunk's next `publish` returns.
    """

    def __init__(self, optimizer: ChunkAdamW, *, workers: int = 1, threads: int | None = None) -> None:
        self.optimizer = optimizer
        if threads is None:
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tide-stale-adam")
        else:  # intra-op threads per worker (the training thread keeps its own count)
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tide-stale-adam",
                                            initializer=torch.set_num_threads, initargs=(threads,))
        self._grads: dict[int, list[Tensor]] = {}  # two buffered-grad slots per chunk
        self._flip: dict[int, int] = {}  # the slot the next submit uses
        self._masters: dict[int, Tensor] = {}  # masters: given (mixed precision) or own (fp32)
        self._pending: dict[int, Callable[[], None]] = {}  # submitted, waits for the chunk's next publish
        self._running: dict[int, Future[None]] = {}  # started, published at the chunk's next publish

    def submit(self, chunk: int, *, param: Tensor, grad: Tensor, master: Tensor | None, exp_avg: Tensor,
               exp_avg_sq: Tensor, grad_scale: float = 1.0, skip_tensors: Collection[int] = ()) -> None:
        if chunk in self._pending:
            raise RuntimeError(f"OneStepStaleUpdater: chunk {chunk} was submitted twice without publish(); "
                               "call publish(chunk, param) before the chunk's params are used in every iteration")
        slots = self._grads.get(chunk)
        if slots is None:
            slots = self._grads[chunk] = [torch.empty_like(grad), torch.empty_like(grad)]
        flip = self._flip.get(chunk, 0)
        buffered = slots[flip].copy_(grad)  # the caller's GRAD chunk is reused by the next backward
        self._flip[chunk] = 1 - flip
        if master is None:
            master = self._masters.get(chunk)
            if master is None:
                master = self._masters[chunk] = param.detach().float().clone()
        else:
            self._masters[chunk] = master
        self._pending[chunk] = functools.partial(
            self.optimizer.step_chunk, chunk, param=None, grad=buffered, master=master, exp_avg=exp_avg,
            exp_avg_sq=exp_avg_sq, grad_scale=grad_scale, skip_tensors=frozenset(skip_tensors),
            hyperparameters=self.optimizer.hyperparameters())  # the job runs later: today's LR, not the scheduler's next

    @property
    def outstanding(self) -> list[int]:
        """Chunks with an update submitted or running that no publish has copied into PARAM yet."""
        return sorted(set(self._running) | set(self._pending))

    def publish(self, chunk: int, param: Tensor) -> None:
        running = self._running.pop(chunk, None)
        if running is not None:
            running.result()
            self._copy_out(chunk, param)
        job = self._pending.pop(chunk, None)
        if job is not None:
            self._running[chunk] = self._pool.submit(job)

    def drain(self, params: Mapping[int, Tensor]) -> None:
        """Apply every outstanding update now and publish it (params: chunk -> PARAM buffer)."""
        for chunk in sorted(set(self._running) | set(self._pending)):
            running = self._running.pop(chunk, None)
            if running is not None:
                running.result()
            job = self._pending.pop(chunk, None)
            if job is not None:
                job()
            self._copy_out(chunk, params[chunk])

    @torch.no_grad()
    def _copy_out(self, chunk: int, param: Tensor) -> None:
        master = self._masters[chunk]
        views = [(param[e.offset:e.offset + e.numel], master[e.offset:e.offset + e.numel])
                 for _, entries in self.optimizer.entries(chunk) for e in entries]
        if views:
            torch._foreach_copy_([p for p, _ in views], [m for _, m in views])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
