"""Adam/AdamW over flat chunk buffers, with torch's fused kernels (DESIGN.md §5 "Optimizer").

`ChunkAdamW` is a real `torch.optim.Optimizer`: its `param_groups` hold the model's
`nn.Parameter`s (so LR schedulers, `add_param_group` and per-group hyper-parameters work as usual),
but the optimizer state lives in the chunk lists, not in `self.state`. The engine drives it chunk
by chunk with `step_chunk`, on DEVICE or on the CPU as the schedule says, handing it the flat 1-D
buffers of one chunk (PARAM, GRAD, MASTER or None, M, V). Inside, the chunk's tensors are cut into
per-tensor views, grouped by param group, and passed to `torch._fused_adamw_` / `torch._fused_adam_`
-- the kernels `torch.optim.AdamW(fused=True)` calls -- with per-param `step` tensors, so every
element sees exactly the arithmetic of the plain optimizer (the kernels are element-wise).

Equivalence with plain PyTorch (what tests/test_optim.py checks):
- fp32: `master=None`, PARAM is the master; bit-identical to `torch.optim.AdamW(fused=True)`.
- mixed precision (bf16/fp16 PARAM, fp32 MASTER): the GRAD chunk is cast to fp32 (a scratch
  buffer), MASTER is updated, then copied into PARAM (one tile at a time: cache-sized on the CPU, a bounded
  scratch on a GPU; bit for bit the same: Note [mixed-precision steps in tiles]). The reference loop is: fp32 master copies,
  `master.grad = param.grad.float()`, fused AdamW on the masters, `param.copy_(master)`.
- `grad_scale` multiplies grads (1/loss scale x clip coefficient). It is handed to the kernel as
  its `grad_scale` argument (the kernel divides by it, as with `GradScaler`), i.e. as 1/grad_scale:
  exact for power-of-two loss scales, within one rounding of `clip_grad_norm_` for clipping.
- a param whose grad is None in plain PyTorch (unused this iteration) is skipped by torch; pass its
  trace tensor id in `skip_tensors` and it is skipped here too (no step, no decay).

`DynamicLossScaler` is fp16 loss scaling with GradScaler's rule; `grad_norms` + `clip_coefficient`
give global grad-norm clipping from chunks on any tier (per-tensor norms, combined like
`torch.nn.utils.clip_grad_norm_`). `step_chunk(hyperparameters=)` takes the param groups' settings
as they were when the step was decided (steps run off the training thread: executor/cpu_steps.py).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from schemas.schedule import ChunkLayout, TensorSlot

__all__ = ["CPU_TILE_ELEMENTS", "DEVICE_TILE_ELEMENTS", "ChunkAdam", "ChunkAdamW", "ChunkEntry", "DynamicLossScaler", "clip_coefficient"]


_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "maximize", "decoupled_weight_decay")

# Note [mixed-precision steps in tiles]:
# A bf16/fp16 step makes three passes: the GRAD cast into an fp32 scratch, the fused kernel over the fp32
# MASTER, the MASTER copied back into PARAM. Over a whole chunk each pass streams the chunk through DRAM
# (28 B/param for the kernel, 6 more for each of the other two). On the CPU the chunk goes through them one
# tile of `CPU_TILE_ELEMENTS` at a time, so the scratch a tile casts and the master it copies back are still
# in cache when the next pass reads them: the DRAM traffic is the kernel's alone. The arithmetic is the same
# element by element (the kernels are element-wise; the steps are bumped once per tensor), so the result is
# bit-identical to one pass over the chunk. Measured with bench/bench_cpu_adam.py on the 2-core CI box (one
# 50M-param chunk, bf16): 1.71-1.74x the fp32 kernel's time in whole passes, 1.27-1.45x in 1M-element tiles (256K:
# 1.70x, 2M: 1.53x in a first sweep; bench/RESULTS.md, session 12). There the casts are compute-bound, so tiles
# cannot reach 1.0x.
# On a GPU the tiles bound the scratch instead, to `DEVICE_TILE_ELEMENTS`: the scratch is GPU memory no plan
# counts (it sits in the hardware's memory margin). In whole passes it was the largest chunk a bf16 plan steps
# on DEVICE: 1.26 GB in the GPT-3 13B x rtx4090-768g-12ssd golden (its margin: 1 GB) and 2.47 GB in the 175B x
# a100-80g-12ssd one (2 GB); found while looking for the H200 runs' 3 GB over their predicted peak, which it
# is not (their chunks: 0.41 GB of scratch at most; bench/RESULTS.md, session 24). 16M elements (64 MiB) are
# ~0.13 ms of the H200's measured 1.2e11 params/s GPU Adam, long beside a tile's three launches, which queue
# asynchronously. The CUDA kernels are element-wise too (ATen's
# FusedAdamKernel.cu through multi_tensor_apply: the same arithmetic per element; a cut at 64 elements keeps
# the vector loads aligned), so the tiles leave every bit as it was.
CPU_TILE_ELEMENTS = 1 << 20  # 4 MiB of fp32 scratch per tile
DEVICE_TILE_ELEMENTS = 1 << 24  # 64 MiB of fp32 scratch on a GPU
# torch's fused CPU Adam kernels (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) split a tensor among threads
# in units of one 64-byte cache line and run Vectorized<float> over each (16 floats with AVX-512): a cut at a
# multiple of 64 elements is a boundary of both on any vector width up to 64 floats.
TILE_ALIGN_ELEMENTS = 64


def _tiles(entries: Sequence[ChunkEntry], tile_elements: int | None) -> Iterator[list[tuple[ChunkEntry, int, int]]]:
    """The entries as (entry, first element, elements) spans, `tile_elements` at most per yield (None: all
    of them whole, in one yield). A tensor is cut only at multiples of `TILE_ALIGN_ELEMENTS` into itself: the fused CPU
    kernels run a vector loop and a scalar tail, whose roundings differ, over cache-line units counted
    from a tensor's start, so a cut anywhere else changes which elements take the tail."""
    spans: list[tuple[ChunkEntry, int, int]] = []
    room = tile_elements
    for e in entries:
        at = 0
        while at < e.numel:
            left = e.numel - at
            n = left if room is None or left <= room else room - room % TILE_ALIGN_ELEMENTS
            if n:
                spans.append((e, at, n))
                at += n
                if room is not None:
                    room -= n
            if room is not None and (n < left or room == 0):
                yield spans
                spans, room = [], tile_elements
    if spans:
        yield spans


def _views(buf: Tensor, spans: Sequence[tuple[ChunkEntry, int, int]]) -> list[Tensor]:
    """The spans' elements of one chunk buffer (PARAM, GRAD, MASTER, M or V: the same offsets in each)."""
    return [buf[e.offset + a:e.offset + a + n] for e, a, n in spans]


def _cut(buf: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Consecutive views of `buf` of the given sizes."""
    return list(torch.split(buf[:sum(sizes)], list(sizes)))


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkEntry:
    """One trainable tensor inside a chunk."""

    param: nn.Parameter
    tensor: int  # trace tensor id (TensorSlot.tensor)
    offset: int  # elements from the chunk start (same in every chunk list)
    numel: int


class ChunkAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) or Adam over chunk buffers; see the module docstring.

    params: like torch.optim: an iterable of Parameters, of (name, Parameter) pairs, or of param
      group dicts (e.g. no weight decay on norms and biases). Each param is found in `layout` by name:
      from the group's `param_names` (named params) or from `model.named_parameters()`.
    layout: the schedule's chunk layout (tensor -> chunk, offset, numel).
    model: the module the params belong to (needed unless the params come with names).
    """

    def __init__(
        self,
        params: Iterable[Any],
        layout: ChunkLayout,
        *,
        model: nn.Module | None = None,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        decoupled_weight_decay: bool = True,
        maximize: bool = False,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            # AMSGrad needs a fourth state list (max_exp_avg_sq) the chunk layout does not have.
            raise ValueError("ChunkAdamW: amsgrad=True is not supported (no chunk list for max_exp_avg_sq); use amsgrad=False")
        if not 0.0 <= eps or not 0.0 <= weight_decay or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"ChunkAdamW: invalid hyper-parameters eps={eps} weight_decay={weight_decay} betas={betas}")
        self.layout = layout
        self._slot_by_name: dict[str, TensorSlot] = {n: s for s in layout.tensors for n in s.names}
        self._names_of: dict[Tensor, str] = {}
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self._names_of.setdefault(p, name)
        self._by_chunk: dict[int, list[tuple[int, list[ChunkEntry]]]] = {}
        self._entry_of: dict[Tensor, ChunkEntry] = {}
        self._scratch = threading.local()  # fp32 grad cast buffers, per thread and device (CPU steps may run on workers)
        self._step_driver: Callable[[], Any] | None = None
        # The keys torch.optim.AdamW(fused=True) keeps in its groups, so state dicts interchange.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False,
                        fused=True, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)

    # -- param groups -> chunk entries ----------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        names = group.get("param_names")
        per_chunk: dict[int, list[ChunkEntry]] = {}
        for i, p in enumerate(group["params"]):
            name = names[i] if names is not None else self._names_of.get(p)
            if name is None:
                raise ValueError(f"ChunkAdamW: param group {index}, param {i} (shape {tuple(p.shape)}) has no name: "
                                 "pass model=... or named parameters (model.named_parameters())")
            slot = self._slot_by_name.get(name)
            if slot is None:
                raise ValueError(f"ChunkAdamW: param {name!r} is not in the schedule's chunk layout; "
                                 "re-record the trace and re-solve for this model")
            if tuple(p.shape) != tuple(slot.shape) or p.numel() != slot.numel:
                raise ValueError(f"ChunkAdamW: param {name!r} has shape {tuple(p.shape)}, the layout says {tuple(slot.shape)}; "
                                 "re-record the trace and re-solve for this model")
            if p in self._entry_of:
                raise ValueError(f"ChunkAdamW: param {name!r} appears in more than one param group")
            entry = ChunkEntry(param=p, tensor=slot.tensor, offset=slot.offset_elements, numel=slot.numel)
            self._entry_of[p] = entry
            per_chunk.setdefault(slot.chunk, []).append(entry)
        for chunk, entries in per_chunk.items():
            entries.sort(key=lambda e: e.offset)
            self._by_chunk.setdefault(chunk, []).append((index, entries))

    @property
    def chunks(self) -> list[int]:
        """Chunk ids holding at least one param of this optimizer, ascending."""
        return sorted(self._by_chunk)

    def entries(self, chunk: int) -> list[tuple[int, list[ChunkEntry]]]:
        """(param group index, tensors in chunk order) for one chunk."""
        return self._by_chunk.get(chunk, [])

    def entry_of(self, param: nn.Parameter) -> ChunkEntry:
        """Where one of this optimizer's params lives in the chunks."""
        return self._entry_of[param]

    def hyperparameters(self) -> tuple[dict[str, Any], ...]:
        """A snapshot of every param group's step settings (lr, betas, eps, weight decay...)."""
        return tuple({k: group[k] for k in _HYPERPARAMETERS} for group in self.param_groups)

    def step_count(self, param: nn.Parameter) -> int:
        state = self.state.get(param)
        return int(state["step"].item()) if state and "step" in state else 0

    # -- the update ------------------------------------------------------------------------------
    @torch.no_grad()
    def step_chunk(
        self,
        chunk: int,
        *,
        param: Tensor | None,
        grad: Tensor,
        master: Tensor | None,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        grad_scale: float = 1.0,
        found_inf: Tensor | None = None,
        skip_tensors: Collection[int] = (),
        hyperparameters: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """One Adam(W) step of every trainable tensor in `chunk`, in place.

        param/grad/master/exp_avg/exp_avg_sq: flat 1-D buffers of this chunk in the PARAM, GRAD,
          MASTER (None: fp32, PARAM is the master), M and V lists, all on one device. With a master,
          param=None updates the master only (the copy into PARAM happens elsewhere, later).
        grad_scale: multiplies the grads (1/loss scale x clip coefficient).
        found_inf: optional 0-dim float tensor; when it is 1 the kernels leave everything unchanged
          and the step counts stay as they were (GradScaler semantics).
        skip_tensors: trace tensor ids whose grad is None this iteration (torch skips those).
        hyperparameters: per param group, what `hyperparameters()` returned when the step was decided
          (a step run later on a worker thread must not see an LR scheduler's newer values); None:
          the param groups as they are now.
        """
        groups = self._by_chunk.get(chunk)
        if not groups:
            return
        if param is None and master is None:
            raise ValueError(f"ChunkAdamW.step_chunk(chunk={chunk}): param=None needs a master buffer")
        target = param if master is None else master
        device = target.device
        for label, buf in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("master", master)):
            if buf is None:
                continue
            if buf.dim() != 1 or buf.device != device:
                raise ValueError(f"ChunkAdamW.step_chunk(chunk={chunk}): {label} must be a flat 1-D buffer on {device}, "
                                 f"found shape {tuple(buf.shape)} on {buf.device}")
        if target.dtype != torch.float32 or exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
            raise ValueError(f"ChunkAdamW.step_chunk(chunk={chunk}): {'master' if master is not None else 'param'}, exp_avg "
                             f"and exp_avg_sq must be float32, found {target.dtype}, {exp_avg.dtype}, {exp_avg_sq.dtype}; "
                             "with a bf16/fp16 PARAM list pass the fp32 MASTER chunk as master=")
        # The fused kernels need grads in the master's dtype: a half-precision GRAD is cast into a reused
        # fp32 scratch, one tile at a time (Note [mixed-precision steps in tiles]).
        cast = grad.dtype != torch.float32
        tile_elements = (CPU_TILE_ELEMENTS if device.type == "cpu" else DEVICE_TILE_ELEMENTS) if cast else None
        scale_t = None
        if grad_scale != 1.0:
            if not math.isfinite(grad_scale) or grad_scale <= 0:
                raise ValueError(f"ChunkAdamW.step_chunk(chunk={chunk}): grad_scale must be a positive finite number, found {grad_scale}")
            scale_t = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device)
        if found_inf is not None:
            found_inf = found_inf.to(device=device, dtype=torch.float32)
        skip = skip_tensors if isinstance(skip_tensors, (set, frozenset)) else frozenset(skip_tensors)
        for index, entries in groups:
            group = self.param_groups[index] if hyperparameters is None else hyperparameters[index]
            live = [e for e in entries if e.param.requires_grad and e.tensor not in skip]
            if not live:
                continue
            steps = [self._step_tensor(e.param, device) for e in live]
            step_of = dict(zip((e.tensor for e in live), steps))
            beta1, beta2 = group["betas"]
            # As torch.optim.adam._fused_adam: bump the steps, run the kernel, undo on overflow.
            torch._foreach_add_(steps, 1)
            kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
            for spans in _tiles(live, tile_elements):
                p_views = _views(target, spans)
                if cast:
                    g_views = _cut(self._fp32_scratch(device, sum(n for _, _, n in spans)), [n for _, _, n in spans])
                    torch._foreach_copy_(g_views, _views(grad, spans))
                else:
                    g_views = _views(grad, spans)
                kernel(p_views, g_views, _views(exp_avg, spans), _views(exp_avg_sq, spans), [],
                       [step_of[e.tensor] for e, _, _ in spans], amsgrad=False, lr=group["lr"], beta1=beta1,
                       beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                       grad_scale=scale_t, found_inf=found_inf)
                if master is not None and param is not None:
                    torch._foreach_copy_(_views(param, spans), p_views)
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf] * len(steps))

    def _step_tensor(self, p: nn.Parameter, device: torch.device) -> Tensor:
        """The param's `step` (0-dim float32, as fused AdamW keeps it), on the device stepping it."""
        state = self.state[p]
        step = state.get("step")
        if step is None:
            step = state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        elif step.device != device:
            step = state["step"] = step.to(device)
        return step

    def _fp32_scratch(self, device: torch.device, numel: int) -> Tensor:
        buffers = self._scratch.__dict__.setdefault("by_device", {})
        buf = buffers.get(device)
        if buf is None or buf.numel() < numel:
            buf = buffers[device] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel]

    @torch.no_grad()
    def grad_norms(self, chunk: int, grad: Tensor, *, norm_type: float = 2.0, skip_tensors: Collection[int] = ()) -> Tensor:
        """Per-tensor norms (float32, on grad's device) of this chunk's trainable grads.

        Feed the results of every chunk, wherever it lives, to `clip_coefficient`.
        """
        views = [grad[e.offset:e.offset + e.numel] for _, entries in self._by_chunk.get(chunk, [])
                 for e in entries if e.param.requires_grad and e.tensor not in skip_tensors]
        if not views:
            return torch.zeros(0, dtype=torch.float32, device=grad.device)
        norms = torch._foreach_norm(views, norm_type)
        return torch.stack(norms).float()

    # -- the torch.optim surface ------------------------------------------------------------------
    def set_step_driver(self, driver: Callable[[], Any] | None) -> None:
        """What `step()` runs: the engine's step (which calls `step_chunk` for every chunk).

        Routing `optimizer.step()` to the engine keeps the plain loop shape and lets LR schedulers
        see that the optimizer stepped.
        """
        self._step_driver = driver

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._step_driver is None:
            raise RuntimeError("ChunkAdamW.step(): no engine attached; the executor engine drives this optimizer "
                               "chunk by chunk (engine.step(), or attach one with set_step_driver)")
        self._step_driver()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        raise RuntimeError("ChunkAdamW.state_dict(): the optimizer state lives in the chunks; use "
                           "executor.state.optimizer_state_dict(store, optimizer) (or the engine's state_dict())")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        raise RuntimeError("ChunkAdamW.load_state_dict(): the optimizer state lives in the chunks; use "
                           "executor.state.load_optimizer_state_dict(store, optimizer, state_dict)")


class ChunkAdam(ChunkAdamW):
    """Adam (L2 weight decay added to the grad), torch.optim.Adam(fused=True) semantics."""

    def __init__(self, params: Iterable[Any], layout: ChunkLayout, *, weight_decay: float = 0.0, **kwargs: Any) -> None:
        kwargs.setdefault("decoupled_weight_decay", False)
        super().__init__(params, layout, weight_decay=weight_decay, **kwargs)


# ------------------------------------------------------------------------------- clipping


def clip_coefficient(norms: Iterable[Tensor], max_norm: float, *, norm_type: float = 2.0,
                     grad_scale: float = 1.0) -> tuple[float, float]:
    """(total norm, clip coefficient) from per-tensor norms gathered over all chunks.

    Same arithmetic as `torch.nn.utils.clip_grad_norm_`: total = norm of the per-tensor norms,
    coefficient = min(1, max_norm / (total + 1e-6)). `grad_scale` multiplies the norms first (the
    grads are still loss-scaled when measured). Fold the coefficient into `step_chunk(grad_scale=)`.
    A non-finite total gives coefficient 1.0 here: the loss scaler skips such steps anyway.
    """
    parts = [n.detach().float().cpu().reshape(-1) for n in norms]
    flat = torch.cat(parts) if parts else torch.zeros(0)
    if grad_scale != 1.0:
        flat = flat * grad_scale
    if flat.numel() == 0:
        return 0.0, 1.0
    total = torch.linalg.vector_norm(flat, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    total_f = float(total)
    return total_f, float(coef) if math.isfinite(total_f) else 1.0


# ------------------------------------------------------------------------------- loss scaling


class DynamicLossScaler:
    """fp16 dynamic loss scaling (GradScaler's rule): start at 2**16, x2 after `growth_interval`
    good steps in a row, x0.5 and skip the step when any grad is inf/nan.

    Per iteration: `loss * scaler.scale` backward; `check(grad)` on every GRAD chunk (any tier,
    accumulates a found-inf flag per device without changing the grads); `found_inf()` before the
    first optimizer step (one sync); if False step every chunk with grad_scale=1/scale (x clip);
    then `update(found)`.
    """

    def __init__(self, *, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"DynamicLossScaler: invalid settings init_scale={init_scale} growth_factor={growth_factor} "
                             f"backoff_factor={backoff_factor} growth_interval={growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # consecutive steps without inf/nan since the last change of scale
        self._found: dict[torch.device, Tensor] = {}

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self.scale

    @torch.no_grad()
    def check(self, grad: Tensor) -> None:
        """Record whether `grad` (any dtype, any device) holds an inf or nan; grads are untouched."""
        found = self._found.get(grad.device)
        if found is None:
            found = self._found[grad.device] = torch.zeros((), dtype=torch.float32, device=grad.device)
        one = torch.ones((), dtype=torch.float32, device=grad.device)
        # The AMP kernel GradScaler uses; with inv_scale 1 it only sets the flag (x*1 == x).
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found, one)

    def found_inf(self) -> bool:
        """Whether any checked grad since the last `update` was inf/nan (syncs each device once)."""
        return any(bool(f.item()) for f in self._found.values())

    def update(self, found_inf: bool | None = None) -> None:
        """Adjust the scale after an iteration; clears the found-inf flags."""
        if found_inf is None:
            found_inf = self.found_inf()
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        self._found.clear()

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.good_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Accepts its own state dict and torch.amp.GradScaler's (same keys)."""
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.good_steps = int(state["_growth_tracker"])
