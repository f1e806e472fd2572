"""The instrumented iteration of a recording (DESIGN.md §3): per moment, what its work touched.

Used by executor/recorder.py, which runs the iteration with `MomentHooks` and these modes on; per
moment (an event and the work that follows it until the next event) it writes down:

`record(model, batch, ...)` runs the iteration with `MomentHooks` (the same hooks the runtime uses, so
the trace's moments are the runtime's moments) and writes down, per moment (an event and the work
that follows it until the next event):

- tensors: the parameters the work touches. In forward they are seen directly: a `TorchFunctionMode`
  maps every `nn.Parameter` object appearing in the arguments of a torch function to its tensor id,
  so shared parameters (recorded once, with all their names), parameters used by a module that does
  not own them and functional use (`F.linear(x, self.wte.weight)` in a parent's forward) are all
  attributed to the moment whose work they are in. In backward autograd hides parameter identity,
  so a backward moment gets the parameters of the forward work it mirrors: the work after backward
  event `B_j` is the backward of the forward work between the mirrors of `B_{j+1}` and `B_j`
  (pre_backward of a module mirrors its post_forward, post_backward its pre_forward), e.g. the
  work after `pre_backward h.3` touches what the work after `pre_forward h.3` touched. The optimizer
  moment touches every trainable parameter.
- flops: summed over the aten ops of the work (`torch.utils.flop_counter`'s formulas, per op in a
  dispatch mode; ops without a formula count 0, as in `FlopCounterMode`, but nothing is decomposed,
  so the ops that run are the real ones).
- compute_seconds: timed in separate, un-instrumented iterations (a monotonic clock on the CPU,
  CUDA events on a GPU; the typical iteration: executor/recorder.py `typical_runs`), so the tracing
  overhead is not in the times; 0 on the meta device, where the planner derives times from FLOPs (`time_source = flops`).
- non_model_bytes: the peak of non-model data during the work (PatrickStar issue #190). On the CPU
  and the meta device it comes from an accounting of live storage: every storage an aten op
  outputs (seen by the dispatch mode) that is not model data (parameters, their grads, optimizer
  state) is counted once, deduplicated by storage (views and in-place results share it), from the
  op that creates it until the storage is freed (a finalizer on the storage); the batch counts from
  the start. The peak is taken after every op; temporaries inside one aten kernel are not seen.
  Grads are non-model data while they flow and become model data when they land in `param.grad`.
  The optimizer step runs outside the accounting: its moment holds what is alive when it starts.
  On CUDA it is `torch.cuda.max_memory_allocated()` over the work minus the model data allocated
  at its start (params, grads, optimizer state).

Activations are the tensors saved for backward (`saved_tensors_hooks`), deduplicated by storage and
never model data:
- bytes: the whole storage;
- produced_at: the moment whose forward work first saved it (a block's saved input is the block's
  activation); tensors saved while recomputing in backward are transient, not activations;
- consumed_at: the backward moments that unpacked it; one never unpacked is held by the graph to
  the end of backward, so the last backward moment consumes it;
- block: the block of produced_at;
- recompute_flops / recompute_seconds: the aten op that created the storage (0 for the batch).

"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from schemas.trace import Phase

from executor.hooks import MomentEvent, tensors_in


# FLOP formulas torch's flop counter lacks. The CPU flash-attention kernel (what SDPA runs on a CPU and
# what executor.models records attention with on the meta device) does the same matmuls as the GPU
# flash kernel, so it takes the same formulas (torch.utils.flop_counter's sdpa_flop_count: 2 matmuls
# forward, 4 backward, causal masking not discounted, as for the GPU kernels)
_EXTRA_FLOPS: dict[Any, Any] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_val=None, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad_out, q, k, v, *args, out_val=None, **kwargs: sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape),
    # in-place addmm (a weight grad accumulated chunk by chunk): the flop counter knows only addmm
    torch.ops.aten.addmm_:
        lambda acc, a, b, *args, out_val=None, **kwargs: 2 * a.shape[0] * a.shape[1] * b.shape[1],
}


def storage_key(t: torch.Tensor) -> tuple[int, Any] | None:
    """(key, storage) of a dense tensor's storage; the key is the StorageImpl address, unique while
    the storage lives (it also works on the meta device, where every data pointer is 0)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested, or a subclass without storage
    return storage._cdata, storage



class MomentLog:
    """What one moment's work did (mutable while recording, frozen into a `Moment` at the end)."""

    __slots__ = ("event", "accessed", "flops", "peak_bytes", "seconds")

    def __init__(self, event: MomentEvent, live_bytes: int) -> None:
        self.event = event
        self.accessed: dict[int, None] = {}  # tensor id -> None, in first-access order
        self.flops = 0
        self.peak_bytes = live_bytes
        self.seconds = 0.0


class ActivationLog:
    __slots__ = ("bytes", "produced_at", "consumed_at", "flops", "seconds")

    def __init__(self, nbytes: int, produced_at: int, flops: int, seconds: float) -> None:
        self.bytes, self.produced_at, self.flops, self.seconds = nbytes, produced_at, flops, seconds
        self.consumed_at: set[int] = set()


class Tape:
    """The instrumented iteration: moments, parameter accesses, FLOPs, live storage, activations."""

    def __init__(self, param_ids: dict[int, int], model_keys: set[int], sync: Callable[[], None]) -> None:
        self.param_ids = param_ids  # id(nn.Parameter) -> tensor id
        self.model_keys = model_keys  # storage keys of model data
        self.sync = sync
        self.moments: list[MomentLog] = []
        self.live: dict[int, int] = {}  # storage key -> bytes, non-model storage alive now
        self.live_bytes = 0
        self.producer: dict[int, tuple[int, float]] = {}  # storage key -> (flops, seconds) of the op creating it
        self.activations: list[ActivationLog] = []
        self.activation_of: dict[int, int] = {}  # storage key -> activation index, while the storage lives
        self.busy = False  # our own bookkeeping runs torch functions too: do not count them

    @property
    def current(self) -> int:
        return len(self.moments) - 1

    def on_event(self, event: MomentEvent) -> None:
        self.moments.append(MomentLog(event, self.live_bytes))

    # -- parameter access (forward) -----------------------------------------------------------
    def access(self, param: nn.Parameter) -> None:
        tid = self.param_ids.get(id(param))
        if tid is not None and self.moments and self.moments[-1].event.phase is Phase.FORWARD:
            self.moments[-1].accessed[tid] = None

    # -- ops ---------------------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any, seconds: float) -> None:
        packet = getattr(func, "_overloadpacket", None)
        formula = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, flops, seconds)
        if self.moments:  # (the root's pre_forward is the first event: nothing runs before it)
            log = self.moments[-1]
            log.flops += flops
            log.peak_bytes = max(log.peak_bytes, self.live_bytes)

    def _track(self, t: torch.Tensor, flops: int, seconds: float) -> None:
        found = storage_key(t)
        if found is None:
            return
        key, storage = found
        if key in self.live or key in self.model_keys:
            return  # a view or an in-place result: the storage is counted already
        self.track_storage(key, storage)
        self.producer[key] = (flops, seconds)

    def track_storage(self, key: int, storage: Any) -> None:
        nbytes = storage.nbytes()
        self.live[key] = nbytes
        self.live_bytes += nbytes
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)
        self.model_keys.discard(key)
        self.producer.pop(key, None)
        self.activation_of.pop(key, None)

    def became_model_data(self, t: torch.Tensor) -> None:
        """A grad landed in `param.grad`: from now on it is model data."""
        found = storage_key(t)
        if found is None:
            return
        key, storage = found
        if key in self.live:
            self.live_bytes -= self.live.pop(key)
        elif key not in self.model_keys:
            weakref.finalize(storage, self._freed, key)  # forget the key when it is freed
        self.model_keys.add(key)

    # -- saved tensors --------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        self.busy = True
        try:
            found = storage_key(t)
            if (found is None or found[0] in self.model_keys or not self.moments
                    or self.moments[-1].event.phase is not Phase.FORWARD):
                return (-1, t)  # model data, or saved by a recomputation in backward (transient)
            key, storage = found
            index = self.activation_of.get(key)
            if index is None:
                if key not in self.live:  # created outside the dispatch mode (e.g. by a C++ kernel's view)
                    self.track_storage(key, storage)
                flops, seconds = self.producer.get(key, (0, 0.0))
                index = len(self.activations)
                self.activations.append(ActivationLog(storage.nbytes(), self.current, flops, seconds))
                self.activation_of[key] = index
            return (index, t)
        finally:
            self.busy = False

    def unpack(self, packed: Any) -> torch.Tensor:
        index, t = packed
        if index >= 0 and self.moments and self.current > self.activations[index].produced_at:
            self.activations[index].consumed_at.add(self.current)
        return t


class ParamAccessMode(TorchFunctionMode):
    """Sees every torch function call; notes the `nn.Parameter` objects among its arguments."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.tape.busy and getattr(func, "__name__", "") != "__get__":
            for x in (*args, *kwargs.values()):
                if isinstance(x, nn.Parameter):
                    self.tape.access(x)
                elif isinstance(x, (tuple, list)):
                    for y in x:
                        if isinstance(y, nn.Parameter):
                            self.tape.access(y)
        return func(*args, **kwargs)


class OpMode(TorchDispatchMode):
    """Sees every aten op (forward and backward): FLOPs, seconds, storages it creates."""

    def __init__(self, tape: Tape, *, timed: bool) -> None:
        super().__init__()
        self.tape, self.timed = tape, timed

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.timed:
            self.tape.sync()
            start = time.perf_counter()
            out = func(*args, **kwargs)
            self.tape.sync()
            seconds = time.perf_counter() - start
        else:
            out, seconds = func(*args, **kwargs), 0.0
        self.tape.busy = True
        try:
            self.tape.on_op(func, args, kwargs, out, seconds)
        finally:
            self.tape.busy = False
        return out


# ----------------------------------------------------------------------------- clocks


class Clock:
    """Timestamps of moment events in the timed iteration: a monotonic clock, or CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]



def input_bytes(args: tuple, kwargs: dict, model_keys: set[int]) -> int:
    """A block's checkpoint: the storages of its tensor inputs, once each, model data excluded (a param
    passed in is never copied: executor/activations.py moves exactly these bytes when it is offloaded)."""
    seen: dict[int, int] = {}
    for t in tensors_in([list(args), list(kwargs.values())]):
        found = storage_key(t)
        if found is not None and found[0] not in model_keys:
            seen[found[0]] = found[1].nbytes()
    return sum(seen.values())

