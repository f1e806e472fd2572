"""The copy engine: DEVICE<->HOST copies off the training thread, each with a `Ready` to wait on.

On a GPU, one CUDA stream per direction, created once, and a CUDA event travels with every copy
(`CudaCopyEngine`). On a CPU-only machine DEVICE is emulated and the copies are real memcpys on ONE
worker thread, a future travelling with every copy (`CpuCopyEngine`), so ordering and overlap run in
CI as on a GPU. The chunk store (executor/store.py) and the activation manager
(executor/activations.py) both copy through the engine's one copy engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from schemas.schedule import Channel

class Ready:
    """Completion of one in-flight copy: a future (emulated DEVICE) or a CUDA event."""

    __slots__ = ("_future", "_event")

    def __init__(self, *, future: Future | None = None, event: torch.cuda.Event | None = None) -> None:
        self._future, self._event = future, event

    # A future may resolve to another `Ready`: a copy issued later, off the training thread (an
    # activation reload whose H2D copy is issued by the NVMe thread once the read landed); waiting for
    # it is waiting for both.
    def done(self) -> bool:
        if self._future is not None:
            if not self._future.done():
                return False
            inner = self._future.result() if self._future.exception() is None else None
            return not isinstance(inner, Ready) or inner.done()
        return self._event is None or self._event.query()

    def succeeded(self) -> bool:
        """Wait for the copy; whether it landed without failing (a failed one is left for a `wait` to raise)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the question asked
            return False
        return True

    def on_done(self, fn: Callable[[], None]) -> bool:
        """Run `fn()` when a future-carried copy ends (on the thread that ends it); False for a CUDA event,
        which calls nothing back: the caller polls `done()`."""
        if self._future is None:
            return False
        self._future.add_done_callback(lambda f: fn())
        return True

    def wait_on_device(self) -> None:
        """Make the compute stream wait for the copy without blocking the host (CUDA); else `wait`."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        elif self._future is not None:
            self._wait_future()
            inner = self._inner(block=True)
            if inner is not None:
                inner.wait_on_device()  # the later copy: the compute stream waits for its event

    def _inner(self, *, block: bool = False) -> Ready | None:
        if not block and not self._future.done():
            return None
        result = self._future.result()  # re-raises a failed copy
        return result if isinstance(result, Ready) else None

    def wait(self) -> float:
        """Block the calling (host) thread until the copy landed; returns the seconds waited (a stall)."""
        if self.done():
            if self._future is not None:
                self._inner()  # re-raise a failed copy
            return 0.0
        start = time.perf_counter()
        if self._future is not None:
            self._wait_future()
            inner = self._inner(block=True)
            if inner is not None:
                inner.wait()
        elif self._event is not None:
            self._event.synchronize()
        return time.perf_counter() - start

    def _wait_future(self) -> None:
        run_here = getattr(self._future, "run_here", None)
        if run_here is not None:  # a CPU optimizer step still queued: the training thread runs it
            run_here()
        self._future.result()  # re-raises a failed copy


class CpuCopyEngine:
    """Emulated DEVICE: DEVICE<->HOST copies are real memcpys on ONE worker thread (a DMA engine)."""

    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tide-copy")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: list[Ready],
             fn: Callable[[torch.Tensor, torch.Tensor], object] | None = None) -> Ready:
        """`fn(dst, src)` (default `dst.copy_(src)`) on the worker; the activation manager passes its own
        primitive, so its tests can make a copy fail."""
        # `after`: what still writes src (an earlier copy on this FIFO worker, an NVME read on the
        # NVME store's threads, a CPU optimizer step on its worker): waited for off the training thread
        fn = fn or _copy
        if not after:
            return Ready(future=self._worker.submit(fn, dst, src))

        def copy_after() -> None:
            for ready in after:
                ready.wait()  # re-raises a failed one: this copy fails too
            fn(dst, src)

        waiting = [r for r in after if not r.done() and r._future is not None]
        if not waiting:
            return Ready(future=self._worker.submit(copy_after))
        # src is written on ANOTHER thread (a step, an NVME read): queue the copy only when that ends,
        # so it does not hold up the copies queued behind it on this FIFO worker (head-of-line blocking)
        outer: Future = Future()
        left = [len(waiting)]
        lock = threading.Lock()

        def on_done(_: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    inner = self._worker.submit(copy_after)
                except RuntimeError as exc:  # the worker is shut down: the engine is closing
                    outer.set_exception(exc)
                    return
                inner.add_done_callback(lambda f: _forward(f, outer))

        for r in waiting:
            r._future.add_done_callback(on_done)
        return Ready(future=outer)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _forward(inner: Future, outer: Future) -> None:
    exc = inner.exception()
    if exc is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(inner.result())


class CudaCopyEngine:
    """Real DEVICE: one stream per direction, created once; a CUDA event travels with each copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams = {Channel.H2D: torch.cuda.Stream(device), Channel.D2H: torch.cuda.Stream(device)}

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: list[Ready], channel: Channel,
             after_compute: bool = True) -> Ready:
        """after_compute=False: issued from a thread other than the training thread (an activation
        reload, once its NVMe read landed), whose `after` carries the event of the compute stream's
        last use of `dst` instead."""
        stream = self._streams[channel]
        for ready in after:  # src is itself still arriving: on another stream, or from NVME
            if ready._event is not None:
                stream.wait_event(ready._event)
            else:
                ready.wait()
        if after_compute:
            # the copy must see everything the compute stream wrote to src (grads, optimizer updates)
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            for t in (src, dst):  # the caching allocator must not hand these out before the copy ends
                if t.is_cuda:
                    t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return Ready(event=event)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)


__all__ = ["CpuCopyEngine", "CudaCopyEngine", "Ready"]
