"""`executor.record`: a trace of one training iteration of an unmodified `nn.Module` (DESIGN.md §3).

What each moment's record holds, and how it is measured, is in executor/tape.py. The iteration
runs 2 + `timing_iterations` times on a real device (warm-up, instrumented, timed) and twice on the
meta device; every run must produce the same sequence of moments (a model whose module sequence
depends on the data or its state cannot be replayed). Recording leaves the model as it found it:
parameters, buffers, grads and the RNG states (torch, CUDA, python, numpy) are restored afterwards.
Python's cycle collector is paused during the instrumented run so the trace is deterministic.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

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
from executor.snapshot import ModelSnapshot
from executor.tape import Clock, OpMode, ParamAccessMode, Tape, input_bytes, storage_key

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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def call_model(model: nn.Module, batch: Batch) -> Any:
    """The model's forward on a batch: a dict is keyword args, a tuple/list positional args."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_in(output: Any) -> torch.Tensor:
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
                        "scalar tensor or an output with .loss; pass loss_fn=lambda model, batch: ...")


def default_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """`loss_fn` by default: the loss inside `model(batch)`'s output (see `call_model`, `loss_in`)."""
    return loss_in(call_model(model, batch))


def _batch_shape(batch: Batch) -> tuple[int, ...]:
    tensors = tensors_in(list(batch.values()) if isinstance(batch, dict) else batch)
    if not tensors:
        raise ExecutorError("record: the batch holds no tensor; expected a tensor, a tuple of args or a dict of kwargs")
    return tuple(tensors[0].shape)



# ----------------------------------------------------------------------------- the typical iteration


def typical_runs(totals_seconds: list[float]) -> list[int]:
    """Indices of the runs whose mean is the typical iteration: all but the fastest and the slowest
    fifth (at least one each side from 3 runs on, so 3 or 4 runs give the median), in run order.

    The one statistic the recorder prices moments with and bench/bench_executor.py measures the
    executor by: what a training loop's throughput sees is the mean iteration, and the trim keeps
    another process's burst (or the first run's warm-up) from moving it; the fastest run is a
    machine nobody trains on (bench/bench_timing_statistic.py measures the three on this machine;
    20% on each side is the trimming R. Wilcox recommends as a default in "Introduction to Robust
    Estimation and Hypothesis Testing")."""
    n = len(totals_seconds)
    if n == 0:
        raise ValueError("typical_runs: no runs")
    cut = max(1, n // 5) if n >= 3 else 0
    order = sorted(range(n), key=lambda i: (totals_seconds[i], i))
    return sorted(order[cut:n - cut])


def typical_seconds(samples_seconds: list[float]) -> float:
    """The typical iteration of `samples_seconds` (see `typical_runs`): a 20%-trimmed mean."""
    kept = typical_runs(samples_seconds)
    return sum(samples_seconds[i] for i in kept) / len(kept)


def typical_moment_seconds(runs_seconds: list[list[float]]) -> list[float]:
    """Each moment's seconds in the typical iteration of `runs_seconds` (one list of per-moment seconds
    per timed run): runs kept or dropped whole by their total (`typical_runs`), each moment the mean over
    the kept runs, so the moments sum to `typical_seconds` of the totals exactly."""
    if not runs_seconds:
        raise ValueError("typical_moment_seconds: no runs")
    n = len(runs_seconds[0])
    if any(len(r) != n for r in runs_seconds):
        raise ValueError(f"typical_moment_seconds: runs of {sorted({len(r) for r in runs_seconds})} moments; "
                         "every run must time the same moments")
    kept = [runs_seconds[i] for i in typical_runs([sum(r) for r in runs_seconds])]
    return [sum(r[i] for r in kept) / len(kept) for i in range(n)]


def with_compute_seconds(trace: Trace, runs_seconds: list[list[float]]) -> Trace:
    """`trace` priced by other timed runs of the same iteration (`Retimer.run`): each moment's
    compute_seconds the typical iteration's (`typical_moment_seconds`, the recorder's statistic) and each
    block's forward_seconds the sum over its forward moments, as `record` builds them. Everything else
    (bytes, FLOPs, activations, their recompute seconds from the instrumented run) is the trace's."""
    if trace.meta.recording is not Recording.REAL:
        raise ExecutorError(f"with_compute_seconds: trace {trace.meta.model_name!r} is a {trace.meta.recording.value} "
                            "recording (times from FLOPs); only a real recording's times can be measured again")
    if any(len(r) != len(trace.moments) for r in runs_seconds):
        raise ExecutorError(f"with_compute_seconds: runs of {sorted({len(r) for r in runs_seconds})} moments for trace "
                            f"{trace.meta.model_name!r} of {len(trace.moments)} moments; time runs of the same model and batch")
    seconds = typical_moment_seconds(runs_seconds)
    moments = tuple(dataclasses.replace(m, compute_seconds=float(s)) for m, s in zip(trace.moments, seconds))
    blocks = tuple(dataclasses.replace(b, forward_seconds=sum(m.compute_seconds for m in moments
                                                              if m.block == b.id and m.phase is Phase.FORWARD))
                   for b in trace.blocks)
    return dataclasses.replace(trace, moments=moments, blocks=blocks)


class Retimer:
    """The recorder's timed runs again, one at a time, on demand: what a bench needs to price a trace
    in the same minutes as the iterations it predicts (bench/bench_executor.py, issue 17 item 6: on a
    shared VM whose speed drifts ~20% within minutes, a recording made minutes earlier prices another
    machine).

    Built on a model and batch the trace was recorded from; one warm-up iteration (the optimizer's state
    is allocated there, as `record` warms up) checks the module sequence against the trace's. Each
    `run()` is one un-instrumented iteration timed per moment exactly as `record`'s `timing_iterations`
    runs are (moment hooks, the same clock, fused optimizer step) and returns its per-moment seconds;
    `with_compute_seconds(trace, runs)` prices the trace with them. Unlike `record`, the model is
    trained by the runs (real optimizer steps, no snapshot restored): give it a copy."""

    def __init__(self, model: nn.Module, batch: Batch | Callable[[], Batch], trace: Trace, *,
                 loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ExecutorError(f"Retimer: model is a {type(model).__name__}; expected a torch.nn.Module")
        self._recorder = _Recorder(model, batch, loss_fn=loss_fn, optimizer=trace.meta.optimizer.value,
                                   model_name=trace.meta.model_name, model_config=dict(trace.meta.model_config))
        if self._recorder.meta:
            raise ExecutorError("Retimer: the model is on the meta device; times need a real device")
        self._events = [MomentEvent(m.kind, m.phase, m.module, m.block) for m in trace.moments]
        warmup: list[MomentEvent] = []
        self._recorder._iteration(warmup.append)
        self._recorder._check_same(self._events, warmup, "warm-up iteration of the Retimer")

    def run(self) -> list[float]:
        """One timed iteration: each moment's seconds, in the trace's moment order."""
        return self._recorder._timed_once(self._events)[0]


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
            loss = self.loss_fn(self.model, batch)
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

    def _iteration(self, on_event: Callable[[MomentEvent], None], *, instrument: Tape | None = None,
                   clock: Clock | None = None, batch: Batch | None = None) -> None:
        batch = self._next_batch() if batch is None else batch
        self.optimizer.zero_grad(set_to_none=True)
        with MomentHooks(self.model, blocks=self.blocks, units=self.units, on_event=on_event):
            if instrument is None:
                self._forward_backward(batch)
            else:
                with (torch.autograd.graph.saved_tensors_hooks(instrument.pack, instrument.unpack),
                      ParamAccessMode(instrument), OpMode(instrument, timed=not self.meta)):
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

    def _instrumented(self, batch: Batch | None, sync: Callable[[], None]) -> Tape:
        model_keys = {found[0] for p in self.params if (found := storage_key(p)) is not None}
        tape = Tape(self._provisional_ids(), model_keys, sync)
        batch = self._next_batch() if batch is None else batch
        for t in tensors_in(list(batch.values()) if isinstance(batch, dict) else batch):
            found = storage_key(t)
            if found is not None and found[0] not in tape.live:
                tape.track_storage(*found)
        handles = [p.register_post_accumulate_grad_hook(lambda p: tape.became_model_data(p.grad))
                   for p in self.params if p.requires_grad]
        modules = dict(self.model.named_modules())
        self.blockinput_bytes: dict[str, int] = {}
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
            self.blockinput_bytes.setdefault(name, input_bytes(args, kwargs, model_keys))
        return hook

    def _provisional_ids(self) -> dict[int, int]:
        """Tensor ids are assigned after the instrumented run (first-access order); until then the
        tape notes accesses by a provisional index: the position in `self.params`."""
        return {id(p): i for i, p in enumerate(self.params)}

    def _timed(self, events: list[MomentEvent]) -> tuple[list[float], list[int] | None]:
        """compute_seconds per moment from `timing_iterations` un-instrumented iterations: the
        typical iteration (`typical_runs`: a 20%-trimmed mean of whole iterations, the statistic
        bench/bench_executor.py compares the executor's iterations with), zeros on the meta device;
        on CUDA also the allocator's peak minus model data per moment (the largest seen).

        Runs are kept or dropped whole (by their total), and each moment takes the mean over the
        kept runs, so the moments sum to the typical iteration exactly. Until session 5 this was the
        fastest whole run: on a shared VM a training loop's iterations were 1.12-1.19x that run
        (bench/RESULTS.md, "Session 4 ... the final tree"), so the plan was priced on a machine
        nobody trains on; traces recorded before keep those times (valid, only slightly optimistic)."""
        if self.meta:
            timed: list[MomentEvent] = []
            self._iteration(timed.append)
            self._check_same(events, timed, "second")
            return [0.0] * len(events), None
        runs = [self._timed_once(events) for _ in range(self.timing_iterations)]
        seconds = typical_moment_seconds([r[0] for r in runs])
        if self.device.type != "cuda":
            return seconds, None
        return seconds, [max(r[1][i] for r in runs) for i in range(len(events))]

    def _timed_once(self, events: list[MomentEvent]) -> tuple[list[float], list[int]]:
        clock = Clock(self.device)
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
    def _build(self, tape: Tape, seconds: list[float], cuda_non_model: list[int] | None,
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
                  input_bytes=self.blockinput_bytes.get(name, 0))
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



def record(model: nn.Module, batch: Batch | Callable[[], Batch], *,
           loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None, optimizer: str = "adamw",
           device: str | torch.device | None = None, model_name: str | None = None,
           model_config: dict[str, Any] | None = None, timing_iterations: int = 5) -> Trace:
    """Record one training iteration of `model` as a `Trace` (see the module docstring).

    model: an `nn.Module` in training mode, all parameters on one device: "cpu", "cuda:N" (a real
        run) or "meta" (shapes only: nothing is allocated, times come from FLOPs at plan time).
        Frozen parameters (`requires_grad=False`) are recorded as not trainable.
    batch: the model's input (a tensor, a tuple of positional args or a dict of kwargs), or a function
        returning one per call (called once per recorded iteration).
    loss_fn: (model, batch) -> scalar loss, for any forward signature; by default the loss inside
        `model(batch)`'s output (`default_loss`: a scalar, `output.loss`, `output["loss"]`).
    optimizer: "adamw", "adam" or "sgd" (the optimizer the schedule will run).
    device: where to record; the model and every batch are moved there first, and the model moved
        back afterwards (default: where the model's parameters are).
    model_name: the trace's name for the model (default: its class name).
    timing_iterations: un-instrumented iterations timed on a real device; the moments'
        compute_seconds are the mean over them less the fastest and slowest fifth, dropped whole
        (`typical_runs`; with 1 or 2 the mean of all). More runs: a steadier price, longer recording.
    The model is left bit-identical: parameters, buffers, grads (None stays None) and the RNG
    states recording used (torch CPU, CUDA when initialized, python `random`, numpy) are restored.
    Raises ExecutorError with one line on bad input; nothing is written (the caller writes the trace).
    """
    if not isinstance(model, nn.Module):
        raise ExecutorError(f"record: model is a {type(model).__name__}; expected a torch.nn.Module")
    name = model_name or type(model).__name__
    with ModelSnapshot(model):
        if device is not None:
            model.to(device)
            batch = _moved(batch, torch.device(device))
        recorder = _Recorder(model, batch, loss_fn=loss_fn, optimizer=optimizer, model_name=name,
                             model_config=dict(model_config or {}), timing_iterations=timing_iterations)
        return recorder.run()


def _moved(batch: Batch | Callable[[], Batch], device: torch.device) -> Batch | Callable[[], Batch]:
    def move(b: Batch) -> Batch:
        return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, b)

    return (lambda: move(batch())) if callable(batch) else move(batch)


__all__ = ["Retimer", "call_model", "default_loss", "loss_in", "record", "typical_moment_seconds", "typical_runs",
           "typical_seconds", "with_compute_seconds"]


def _world_size() -> int:
    """The ranks this recording will train with: the initialized process group's size, else 1.

    Each rank records the same per-rank work (its share of the global batch); the planner then
    checks the trace's world size against the hardware profile's `cluster.world_size`.
    """
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
