"""Record a trace: one training iteration of an unmodified `nn.Module` (DESIGN.md §3).

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
  CUDA events on a GPU; the fastest whole iteration), so the tracing overhead is not in the times; 0 on
  the meta device, where the planner derives times from FLOPs (`time_source = flops`).
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

The iteration runs 2 + `timing_iterations` times on a real device (warm-up, instrumented, timed)
and twice on the meta device (instrumented, checked). Every run must produce the same sequence of
moments or recording stops: a model whose module sequence depends on the data or on its state
cannot be replayed from a schedule. Recording trains the model for those iterations (the optimizer
steps, except on the meta device where there is nothing to update). Python's cycle collector is
paused during the instrumented run so storage lifetimes, and the trace, are deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from schemas.trace import (
    Activation,
    Block,
    DType,
    Moment,
    MomentKind,
    OptimizerKind,
    Phase,
    Recording,
    TensorInfo,
    TimeSource,
    Trace,
    TraceMeta,
)

from executor.errors import ExecutorError
from executor.hooks import MomentEvent, MomentHooks, find_blocks, find_units, tensors_in

_DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16}
# The recorded optimizer moment is timed, so it runs the kernels the executor runs: torch's fused
# Adam/AdamW (the default on the CPU is a per-tensor Python loop, ~10x slower). The meta device has
# no fused kernels and no times, so it takes the default.
_OPTIMIZERS = {
    OptimizerKind.ADAMW: lambda params, fused: torch.optim.AdamW(params, lr=1e-4, fused=fused),
    OptimizerKind.ADAM: lambda params, fused: torch.optim.Adam(params, lr=1e-4, fused=fused),
    OptimizerKind.SGD: lambda params, fused: torch.optim.SGD(params, lr=1e-4),
}
_MIRROR = {
    MomentKind.PRE_BACKWARD: MomentKind.POST_FORWARD,
    MomentKind.POST_BACKWARD: MomentKind.PRE_FORWARD,
}

Batch = Any  # a tensor (positional), a tuple/list of positional args, or a dict of keyword args


# ----------------------------------------------------------------------------- helpers


def _storage_key(t: torch.Tensor) -> tuple[int, Any] | None:
    """(key, storage) of a dense tensor's storage; the key is the StorageImpl address, unique while
    the storage lives (it also works on the meta device, where every data pointer is 0)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested, or a subclass without storage
    return storage._cdata, storage


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _call_model(model: nn.Module, batch: Batch) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def default_loss(output: Any, batch: Batch) -> torch.Tensor:
    """The loss inside a model's output: a one-element tensor, `output.loss` / `output["loss"]`
    (HF models given labels), or the first one-element tensor of a tuple."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return output.loss
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.numel() == 1:
                return item
    raise ExecutorError(f"record: no loss in the model's output ({type(output).__name__}); expected a "
                        "scalar tensor or an output with .loss; pass loss_fn=lambda output, batch: ...")


def _batch_shape(batch: Batch) -> tuple[int, ...]:
    tensors = tensors_in(list(batch.values()) if isinstance(batch, dict) else batch)
    if not tensors:
        raise ExecutorError("record: the batch holds no tensor; expected a tensor, a tuple of args or a dict of kwargs")
    return tuple(tensors[0].shape)


# ----------------------------------------------------------------------------- the tape



# FLOP formulas torch's flop counter lacks. The CPU flash-attention kernel (what SDPA runs on a CPU and
# what executor.models records attention with on the meta device) does the same matmuls as the GPU
# flash kernel, so it takes the same formulas (torch.utils.flop_counter's sdpa_flop_count: 2 matmuls
# forward, 4 backward, causal masking not discounted, as for the GPU kernels)
_EXTRA_FLOPS: dict[Any, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_val=None, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad_out, q, k, v, *args, out_val=None, **kwargs: sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape),
    # in-place addmm (a weight grad accumulated chunk by chunk): the flop counter knows only addmm
    torch.ops.aten.addmm_:
        lambda acc, a, b, *args, out_val=None, **kwargs: 2 * a.shape[0] * a.shape[1] * b.shape[1],
}

class _MomentLog:
    """What one moment's work did (mutable while recording, frozen into a `Moment` at the end)."""

    __slots__ = ("event", "accessed", "flops", "peak_bytes", "seconds")

    def __init__(self, event: MomentEvent, live_bytes: int) -> None:
        self.event = event
        self.accessed: dict[int, None] = {}  # tensor id -> None, in first-access order
        self.flops = 0
        self.peak_bytes = live_bytes
        self.seconds = 0.0


class _ActivationLog:
    __slots__ = ("bytes", "produced_at", "consumed_at", "flops", "seconds")

    def __init__(self, nbytes: int, produced_at: int, flops: int, seconds: float) -> None:
        self.bytes, self.produced_at, self.flops, self.seconds = nbytes, produced_at, flops, seconds
        self.consumed_at: set[int] = set()


class _Tape:
    """The instrumented iteration: moments, parameter accesses, FLOPs, live storage, activations."""

    def __init__(self, param_ids: dict[int, int], model_keys: set[int], sync: Callable[[], None]) -> None:
        self.param_ids = param_ids  # id(nn.Parameter) -> tensor id
        self.model_keys = model_keys  # storage keys of model data
        self.sync = sync
        self.moments: list[_MomentLog] = []
        self.live: dict[int, int] = {}  # storage key -> bytes, non-model storage alive now
        self.live_bytes = 0
        self.producer: dict[int, tuple[int, float]] = {}  # storage key -> (flops, seconds) of the op creating it
        self.activations: list[_ActivationLog] = []
        self.activation_of: dict[int, int] = {}  # storage key -> activation index, while the storage lives
        self.busy = False  # our own bookkeeping runs torch functions too: do not count them

    @property
    def current(self) -> int:
        return len(self.moments) - 1

    def on_event(self, event: MomentEvent) -> None:
        self.moments.append(_MomentLog(event, self.live_bytes))

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
        found = _storage_key(t)
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
        found = _storage_key(t)
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
            found = _storage_key(t)
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
                self.activations.append(_ActivationLog(storage.nbytes(), self.current, flops, seconds))
                self.activation_of[key] = index
            return (index, t)
        finally:
            self.busy = False

    def unpack(self, packed: Any) -> torch.Tensor:
        index, t = packed
        if index >= 0 and self.moments and self.current > self.activations[index].produced_at:
            self.activations[index].consumed_at.add(self.current)
        return t


class _ParamAccessMode(TorchFunctionMode):
    """Sees every torch function call; notes the `nn.Parameter` objects among its arguments."""

    def __init__(self, tape: _Tape) -> None:
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


class _OpMode(TorchDispatchMode):
    """Sees every aten op (forward and backward): FLOPs, seconds, storages it creates."""

    def __init__(self, tape: _Tape, *, timed: bool) -> None:
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


class _Clock:
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


# ----------------------------------------------------------------------------- record


class _Recorder:
    def __init__(self, model: nn.Module, batch: Batch | Callable[[], Batch], *, loss_fn: Callable | None,
                 optimizer: str, model_name: str, model_config: dict[str, Any], timing_iterations: int = 5) -> None:
        self.model, self.batch_source = model, batch
        if not isinstance(timing_iterations, int) or timing_iterations < 1:
            raise ExecutorError(f"record: timing_iterations must be a positive integer, found {timing_iterations!r}")
        self.timing_iterations = timing_iterations
        self.loss_fn = loss_fn or default_loss
        self.model_name, self.model_config = model_name, model_config
        try:
            self.optimizer_kind = OptimizerKind(str(optimizer).lower())
        except ValueError:
            raise ExecutorError(f"record: optimizer {optimizer!r} is not supported; expected one of "
                                f"{', '.join(k.value for k in OptimizerKind)}") from None
        try:
            json.dumps(model_config)
        except (TypeError, ValueError) as exc:
            raise ExecutorError(f"record: model_config must be JSON-able (plain numbers, strings, lists, dicts): {exc}") from None
        self._collect_tensors()
        first = next(iter(self.params))
        self.device = first.device
        self.meta = self.device.type == "meta"
        self.blocks = find_blocks(model)
        self.units = find_units(model, self.blocks)
        trainable = [p for p in self.params if p.requires_grad]
        if not trainable:
            raise ExecutorError(f"record: model {model_name!r} has no trainable parameter (all requires_grad=False); "
                                "nothing to train or place")
        self.optimizer = _OPTIMIZERS[self.optimizer_kind](trainable, fused=None if self.meta else True)

    # -- tensors ------------------------------------------------------------------------------
    def _collect_tensors(self) -> None:
        names: dict[int, list[str]] = {}
        self.params: dict[nn.Parameter, None] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
            self.params[p] = None
        if not self.params:
            raise ExecutorError(f"record: model {self.model_name!r} ({type(self.model).__name__}) has no parameters; "
                                "tide places parameters, grads and optimizer state: give it a model that has some")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ExecutorError(f"record: parameters live on several devices {sorted(map(str, devices))}; "
                                "move the whole model to one device (or build it on 'meta') first")
        dtypes = {p.dtype for p in self.params}
        bad = [d for d in dtypes if d not in _DTYPES]
        if bad or len(dtypes) > 1:
            raise ExecutorError(f"record: parameter dtypes {sorted(map(str, dtypes))}; expected one of float32, "
                                "bfloat16, float16 for all parameters: convert with model.to(dtype)")
        self.compute_dtype = _DTYPES[dtypes.pop()]
        self.names = names

    # -- one iteration --------------------------------------------------------------------------
    def _next_batch(self) -> Batch:
        source = self.batch_source
        if not callable(source):
            return source
        try:
            return source()
        except ExecutorError:
            raise
        except Exception as exc:  # the user's batch function: say so instead of a traceback
            raise ExecutorError(f"record: the batch function raised {_one_line(exc)}; fix the batch function") from exc

    def _forward_backward(self, batch: Batch) -> None:
        try:
            output = _call_model(self.model, batch)
            loss = self.loss_fn(output, batch)
        except ExecutorError:
            raise
        except Exception as exc:
            raise ExecutorError(f"record: model {self.model_name!r} raised {_one_line(exc)} in forward on the batch "
                                f"of shape {_batch_shape(batch)}; check that the batch matches the model's forward "
                                "(shapes, dtypes, device)") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ExecutorError("record: the loss must be a one-element tensor that requires grad; "
                                f"found {type(loss).__name__} {getattr(loss, 'shape', '')}; check loss_fn")
        try:
            loss.backward()
        except Exception as exc:
            raise ExecutorError(f"record: backward raised {_one_line(exc)}") from exc

    def _optimizer_step(self) -> None:
        if not self.meta:  # on the meta device there are no values to update
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _iteration(self, on_event: Callable[[MomentEvent], None], *, instrument: _Tape | None = None,
                   clock: _Clock | None = None, batch: Batch | None = None) -> None:
        batch = self._next_batch() if batch is None else batch
        self.optimizer.zero_grad(set_to_none=True)
        with MomentHooks(self.model, blocks=self.blocks, units=self.units, on_event=on_event):
            if instrument is None:
                self._forward_backward(batch)
            else:
                with (torch.autograd.graph.saved_tensors_hooks(instrument.pack, instrument.unpack),
                      _ParamAccessMode(instrument), _OpMode(instrument, timed=not self.meta)):
                    self._forward_backward(batch)
        on_event(MomentEvent(MomentKind.OPTIMIZER_STEP, Phase.OPTIMIZER, "", -1))
        self._optimizer_step()
        if clock is not None:
            clock.mark()

    def _check_same(self, first: list[MomentEvent], other: list[MomentEvent], which: str) -> None:
        if first == other:
            return
        for i, (a, b) in enumerate(zip(first, other)):
            if a != b:
                raise ExecutorError(
                    f"record: the module sequence changed between two recorded iterations: moment {i} was "
                    f"{a.kind.value} {a.module or '(root)'!r} in the first and {b.kind.value} {b.module or '(root)'!r} "
                    f"in the {which}; tide replays one fixed sequence: make the forward's control flow independent "
                    "of the data and of the step (fixed shapes, no data-dependent branches)")
        raise ExecutorError(
            f"record: the module sequence changed between two recorded iterations: {len(first)} moments in the "
            f"first, {len(other)} in the {which}; tide replays one fixed sequence: make the forward's control "
            "flow independent of the data and of the step")

    def run(self) -> Trace:
        first_batch = self._next_batch()
        shape = _batch_shape(first_batch)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        warmup: list[MomentEvent] = []
        if not self.meta:
            self._iteration(warmup.append, batch=first_batch)
            first_batch = None
        tape = self._instrumented(first_batch, sync)
        events = [m.event for m in tape.moments]
        if warmup:
            self._check_same(warmup, events, "second")
        seconds, cuda_non_model = self._timed(events)
        return self._build(tape, seconds, cuda_non_model, shape)

    def _instrumented(self, batch: Batch | None, sync: Callable[[], None]) -> _Tape:
        model_keys = {found[0] for p in self.params if (found := _storage_key(p)) is not None}
        tape = _Tape(self._provisional_ids(), model_keys, sync)
        batch = self._next_batch() if batch is None else batch
        for t in tensors_in(list(batch.values()) if isinstance(batch, dict) else batch):
            found = _storage_key(t)
            if found is not None and found[0] not in tape.live:
                tape.track_storage(*found)
        handles = [p.register_post_accumulate_grad_hook(lambda p: tape.became_model_data(p.grad))
                   for p in self.params if p.requires_grad]
        modules = dict(self.model.named_modules())
        self.block_input_bytes: dict[str, int] = {}
        handles += [modules[name].register_forward_pre_hook(self._capture_input(name, model_keys), with_kwargs=True)
                    for name in self.blocks]
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._iteration(tape.on_event, instrument=tape, batch=batch)
        finally:
            for h in handles:
                h.remove()
            if was_enabled:
                gc.enable()
        del batch
        return tape

    def _capture_input(self, name: str, model_keys: set[int]) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.block_input_bytes.setdefault(name, _input_bytes(args, kwargs, model_keys))
        return hook

    def _provisional_ids(self) -> dict[int, int]:
        """Tensor ids are assigned after the instrumented run (first-access order); until then the
        tape notes accesses by a provisional index: the position in `self.params`."""
        return {id(p): i for i, p in enumerate(self.params)}

    def _timed(self, events: list[MomentEvent]) -> tuple[list[float], list[int] | None]:
        """compute_seconds per moment from the fastest of `timing_iterations` un-instrumented
        iterations, taken whole (on a shared machine other work only ever adds time, so the
        least-disturbed run is the best estimate of the model's own cost; a median carried load
        spikes into the plan, and the per-moment minimum over runs summed to less than any real
        iteration: 10% under the executor's median on a quiet 2-core box), zeros on the meta device;
        on CUDA also the allocator's peak minus model data per moment (the largest seen)."""
        if self.meta:
            timed: list[MomentEvent] = []
            self._iteration(timed.append)
            self._check_same(events, timed, "second")
            return [0.0] * len(events), None
        runs = [self._timed_once(events) for _ in range(self.timing_iterations)]
        seconds = min((r[0] for r in runs), key=sum)
        if self.device.type != "cuda":
            return seconds, None
        return seconds, [max(r[1][i] for r in runs) for i in range(len(events))]

    def _timed_once(self, events: list[MomentEvent]) -> tuple[list[float], list[int]]:
        clock = _Clock(self.device)
        timed: list[MomentEvent] = []
        peaks: list[int] = []
        cuda = self.device.type == "cuda"
        start_model = 0

        def close_peak() -> None:
            peaks.append(max(0, torch.cuda.max_memory_allocated(self.device) - start_model))

        def on_event(event: MomentEvent) -> None:
            nonlocal start_model
            if cuda:
                if timed:
                    close_peak()
                start_model = self._model_bytes()
                torch.cuda.reset_peak_memory_stats(self.device)
            timed.append(event)
            clock.mark()

        self._iteration(on_event, clock=clock)
        if cuda:
            close_peak()
        self._check_same(events, timed, "third")
        return clock.intervals_seconds(), peaks

    def _model_bytes(self) -> int:
        total = 0
        for p in self.params:
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        return total

    # -- the trace ------------------------------------------------------------------------------
    def _build(self, tape: _Tape, seconds: list[float], cuda_non_model: list[int] | None,
               shape: tuple[int, ...]) -> Trace:
        params = list(self.params)
        # tensor ids in first-access order (runtime order, DESIGN.md §4.1), then the never-used ones
        order: dict[int, None] = {}
        for log in tape.moments:
            order.update(log.accessed)
        order.update(dict.fromkeys(range(len(params))))
        new_id = {old: new for new, old in enumerate(order)}
        tensors = tuple(
            TensorInfo(id=new, names=tuple(self.names[id(params[old])]), shape=tuple(params[old].shape),
                       dtype=self.compute_dtype, bytes=params[old].numel() * params[old].element_size(),
                       trainable=params[old].requires_grad)
            for old, new in new_id.items())
        events = [log.event for log in tape.moments]
        accessed = [[new_id[i] for i in log.accessed] for log in tape.moments]
        accessed = self._mirror_backward(events, accessed)
        opt = next(i for i, e in enumerate(events) if e.phase is Phase.OPTIMIZER)
        accessed[opt] = [t.id for t in tensors if t.trainable]
        non_model = cuda_non_model or [log.peak_bytes for log in tape.moments]
        moments = tuple(
            Moment(id=i, phase=e.phase, kind=e.kind, module=e.module, block=e.block, tensors=tuple(accessed[i]),
                   compute_seconds=float(seconds[i]), flops=tape.moments[i].flops, non_model_bytes=int(non_model[i]))
            for i, e in enumerate(events))
        last_backward = max(i for i, e in enumerate(events) if e.phase is Phase.BACKWARD)
        activations = tuple(
            Activation(id=i, block=events[a.produced_at].block, bytes=a.bytes, produced_at=a.produced_at,
                       consumed_at=tuple(sorted(a.consumed_at)) or (last_backward,), recompute_flops=a.flops,
                       recompute_seconds=float(a.seconds))
            for i, a in enumerate(tape.activations))
        blocks = tuple(
            Block(id=b, module=name, forward_flops=sum(m.flops for m in moments if m.block == b and m.phase is Phase.FORWARD),
                  forward_seconds=sum(m.compute_seconds for m in moments if m.block == b and m.phase is Phase.FORWARD),
                  input_bytes=self.block_input_bytes.get(name, 0))
            for b, name in enumerate(self.blocks))
        meta = TraceMeta(
            model_name=self.model_name, model_config=self.model_config, batch_shape=shape,
            compute_dtype=self.compute_dtype, world_size=_world_size(), torch_version=torch.__version__,
            device=self._device_name(), recording=Recording.META if self.meta else Recording.REAL,
            time_source=TimeSource.FLOPS if self.meta else TimeSource.MEASURED, optimizer=self.optimizer_kind)
        return Trace(meta=meta, tensors=tensors, blocks=blocks, moments=moments, activations=activations)

    @staticmethod
    def _mirror_backward(events: list[MomentEvent], accessed: list[list[int]]) -> list[list[int]]:
        """Backward moment B_j touches the forward work between mirror(B_{j+1}) and mirror(B_j)."""
        forward_index = {(e.kind, e.module): i for i, e in enumerate(events) if e.phase is Phase.FORWARD}
        backward = [i for i, e in enumerate(events) if e.phase is Phase.BACKWARD]

        def mirror(i: int) -> int | None:
            e = events[i]
            if e.module == "" and e.kind is MomentKind.PRE_BACKWARD:
                return forward_index.get((MomentKind.POST_FORWARD, ""))
            if e.module == "" and e.kind is MomentKind.POST_BACKWARD:
                return forward_index.get((MomentKind.PRE_FORWARD, ""))
            return forward_index.get((_MIRROR[e.kind], e.module))

        out = [list(a) for a in accessed]
        for j, b in enumerate(backward):
            hi = mirror(b)
            lo = mirror(backward[j + 1]) if j + 1 < len(backward) else None
            touched: dict[int, None] = {}
            if hi is not None and lo is not None and lo < hi:
                for f in range(hi - 1, lo - 1, -1):  # backward runs the forward work in reverse
                    touched.update(dict.fromkeys(accessed[f]))
            out[b] = list(touched)
        return out

    def _device_name(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return str(self.device)


def _input_bytes(args: tuple, kwargs: dict, model_keys: set[int]) -> int:
    """A block's checkpoint: the storages of its tensor inputs, once each, model data excluded (a param
    passed in is never copied: executor/activations.py moves exactly these bytes when it is offloaded)."""
    seen: dict[int, int] = {}
    for t in tensors_in([list(args), list(kwargs.values())]):
        found = _storage_key(t)
        if found is not None and found[0] not in model_keys:
            seen[found[0]] = found[1].nbytes()
    return sum(seen.values())


def record(model: nn.Module, batch: Batch | Callable[[], Batch], *, loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
           optimizer: str = "adamw", device: str | torch.device | None = None, model_name: str,
           model_config: dict[str, Any] | None = None, timing_iterations: int = 5) -> Trace:
    """Record one training iteration of `model` as a `Trace` (see the module docstring).

    model: an `nn.Module` in training mode, all parameters on one device: "cpu", "cuda:N" (a real
        run) or "meta" (shapes only: nothing is allocated, times come from FLOPs at plan time).
    batch: the model's input (a tensor, a tuple of positional args or a dict of kwargs), or a function
        returning one per call (called once per recorded iteration).
    loss_fn: (output, batch) -> scalar loss; by default the loss inside the output (`default_loss`).
    optimizer: "adamw", "adam" or "sgd" (the optimizer the schedule will run).
    device: where to record; the model and every batch are moved there first (default: where the
        model's parameters are).
    timing_iterations: un-instrumented iterations timed on a real device; the moments'
        compute_seconds come from the fastest of them, taken whole.
    The model is trained for the recorded iterations (2 + timing_iterations optimizer steps on a real device).
    Raises ExecutorError with one line on bad input; nothing is written (the caller writes the trace).
    """
    if device is not None:
        model = model.to(device)
        batch = _moved(batch, torch.device(device))
    recorder = _Recorder(model, batch, loss_fn=loss_fn, optimizer=optimizer, model_name=model_name,
                         model_config=dict(model_config or {}), timing_iterations=timing_iterations)
    return recorder.run()


def _moved(batch: Batch | Callable[[], Batch], device: torch.device) -> Batch | Callable[[], Batch]:
    def move(b: Batch) -> Batch:
        return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, b)

    return (lambda: move(batch())) if callable(batch) else move(batch)


# ----------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    from executor.models import MODELS

    p = subparsers.add_parser(
        "record", help="record one training iteration of a named model into a trace file",
        description="Record one training iteration (forward, backward, optimizer step) of a named model "
                    "and write its trace (msgpack). --meta records shapes only on the meta device.")
    p.add_argument("model", metavar="MODEL_NAME", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("-o", "--output", required=True, type=Path, help="trace file to write (.msgpack)")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device (no memory, no times)")
    p.add_argument("--device", default="cpu", help="device of a real recording: cpu or cuda[:N] (default cpu)")
    p.add_argument("--batch", type=int, default=None, help="sequences per batch (default: the model's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="parameter (compute) dtype (default float32)")
    p.add_argument("--optimizer", default="adamw", help="adamw, adam or sgd (default adamw)")
    p.add_argument("--attention", default=None, choices=["sdpa", "math"],
                   help="our GPT's attention: sdpa (fused, the default) or math (scores written out and kept)")
    p.add_argument("--loss", default=None, choices=["chunked", "full"],
                   help="our GPT's loss head: chunked (no full logits kept, the default) or full (F.cross_entropy on all logits)")
    p.add_argument("--timing-iterations", type=int, default=5,
                   help="timed iterations of a real recording; times are per-moment minima (default 5)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from executor.models import build_model, make_batch, model_spec, parse_dtype

    spec = model_spec(args.model, batch=args.batch, seq=args.seq)
    flags = {k: v for k, v in (("attention", args.attention), ("loss", args.loss)) if v is not None}
    if flags and spec.family != "gpt":
        raise ExecutorError(f"--{next(iter(flags))}: only our GPT models take it; {args.model} is {spec.family}")
    if flags:
        spec = dataclasses.replace(spec, config={**spec.config, **flags})
    device = "meta" if args.meta else args.device
    try:
        torch.device(device)
    except RuntimeError:
        raise ExecutorError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ExecutorError(f"--device {device}: this torch build sees no GPU; record on cpu or with --meta")
    start = time.perf_counter()
    model = build_model(spec, device=device, dtype=parse_dtype(args.dtype))
    batch = make_batch(spec, device=device)
    config = {"family": spec.family, "batch": spec.batch, "seq": spec.seq, **spec.config}
    trace = record(model, batch, optimizer=args.optimizer, model_name=args.model, model_config=config,
                   timing_iterations=args.timing_iterations)
    trace.write(args.output)
    elapsed = time.perf_counter() - start
    print(f"recorded {args.model} ({trace.meta.recording.value}, {trace.meta.device}): {len(trace.moments)} moments, "
          f"{len(trace.tensors)} tensors ({trace.param_count / 1e6:.1f}M params), {len(trace.blocks)} blocks, "
          f"{len(trace.activations)} activations -> {args.output} ({elapsed:.1f} s)", file=sys.stderr)
    return 0


__all__ = ["default_loss", "record", "register"]


def _world_size() -> int:
    """The ranks this recording will train with: the initialized process group's size, else 1.

    Each rank records the same per-rank work (its share of the global batch); the planner then
    checks the trace's world size against the hardware profile's `cluster.world_size`.
    """
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
