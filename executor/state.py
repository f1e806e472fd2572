"""Model and optimizer state in the plain PyTorch formats, read from and written to chunks.

Everything here talks to a *store*: any object with `.layout` (the schedule's ChunkLayout),
`.read_chunk(list, chunk) -> Tensor` (the flat chunk, wherever its valid copy lives) and
`.write_chunk(list, chunk, tensor)`. The engine's chunk store is one; the tests use a dict.

Formats (what a plain PyTorch loop reads and writes):
- `model_state_dict`: `{name: tensor}` with the keys `model.state_dict()` would give for params
  (and, when the model is passed, its buffers, in the model's key order). Tied weights appear under
  every name, as in `model.state_dict()`, but as ONE tensor object: `torch.save` stores it once and
  `load_state_dict(strict=True)` into a plain model works. Values are CPU tensors in the PARAM
  list's dtype (the compute dtype, what the model holds).
- `optimizer_state_dict`: `torch.optim.AdamW.state_dict()`'s format: `state` keyed by param index
  in param_groups order (`step` a 0-dim float32 tensor, as fused AdamW keeps it, `exp_avg`,
  `exp_avg_sq` shaped like the param), `param_groups` with the hyper-parameters and `params` index
  lists. A plain AdamW over the same params loads it, and `load_optimizer_state_dict` loads a plain
  AdamW's.
- mixed precision: the fp32 MASTER copies are not part of either plain format, so
  `master_state_dict` gives them by name; a checkpoint (`save`) carries them under "master".
  Without them, loading falls back to the PARAM values cast to fp32 (what a plain loop restarting
  from a bf16 model would do).

`save` / `load` write a checkpoint atomically: `torch.save` into bytes, then
`schemas.atomic_write_bytes` (temp file, fsync, rename, fsync of the folder; a temp file a killed
save left behind is removed by the next save). A checkpoint carries `content_digest` (sha256 over
every other entry, tensors by dtype, shape and bytes: `checkpoint_digest`) and, when the store runs
a schedule, `schedule_digest` (that schedule's `content_digest`) and `schedule_world_size`. `load`
refuses a file whose content digest does not match (a checkpoint without one, built by hand, loads
unchecked), `restore` one saved under another schedule of the same world size (another world size
is a re-shard: executor/distributed.py), and values no optimizer can step from (`check_checkpoint`:
settings out of range, NaN/Inf in a weight, master copy or Adam moment): one line each, before
anything is written.
"""

from __future__ import annotations

import hashlib
import io
import math
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from executor.errors import ExecutorError
from executor.optim import ChunkAdamW
from schemas import atomic_write_bytes
from schemas.schedule import ChunkLayout, ChunkList, TensorSlot

__all__ = [
    "CHECKPOINT_FORMAT", "ChunkSource", "StateError", "check_checkpoint", "check_optimizer_state_dict", "checkpoint_digest", "load", "load_master_state_dict", "load_model_state_dict",
    "load_optimizer_state_dict", "master_state_dict", "model_state_dict", "optimizer_state_dict", "restore", "save",
]

CHECKPOINT_FORMAT = "tide.checkpoint"


class StateError(ExecutorError, ValueError):
    """A state dict does not fit the model / optimizer / layout (one line: what, where, the fix)."""


class ChunkSource(Protocol):
    layout: ChunkLayout

    def read_chunk(self, list: ChunkList, chunk: int) -> Tensor: ...  # noqa: A002 - the schemas' word

    def write_chunk(self, list: ChunkList, chunk: int, tensor: Tensor) -> None: ...  # noqa: A002


def _view(flat: Tensor, slot: TensorSlot) -> Tensor:
    return flat[slot.offset_elements:slot.offset_elements + slot.numel].view(slot.shape)


class _ChunkCache:
    """Reads each chunk once; writes back only the chunks that were changed."""

    def __init__(self, store: ChunkSource) -> None:
        self.store = store
        self.flat: dict[tuple[ChunkList, int], Tensor] = {}
        self.dirty: set[tuple[ChunkList, int]] = set()

    def get(self, lst: ChunkList, chunk: int) -> Tensor:
        key = (lst, chunk)
        if key not in self.flat:
            self.flat[key] = self.store.read_chunk(lst, chunk).detach().to("cpu", copy=True)
        return self.flat[key]

    def set_slot(self, lst: ChunkList, slot: TensorSlot, value: Tensor) -> None:
        _view(self.get(lst, slot.chunk), slot).copy_(value)
        self.dirty.add((lst, slot.chunk))

    def flush(self) -> None:
        for key in sorted(self.dirty):
            self.store.write_chunk(key[0], key[1], self.flat[key])
        self.dirty.clear()


# ------------------------------------------------------------------------------- model


def model_state_dict(store: ChunkSource, model: nn.Module | None = None) -> dict[str, Tensor]:
    """Params from the PARAM chunks (+ the model's buffers), keyed like `model.state_dict()`."""
    cache = _ChunkCache(store)
    by_name: dict[str, Tensor] = {}
    for slot in store.layout.tensors:
        value = _view(cache.get(ChunkList.PARAM, slot.chunk), slot).clone()
        for name in slot.names:
            by_name[name] = value  # tied: the same tensor object under every name
    if model is None:
        return by_name
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        out[key] = by_name[key] if key in by_name else value.detach().clone()
    for key, value in by_name.items():  # in the layout but hidden from model.state_dict() (unusual)
        out.setdefault(key, value)
    return out


def master_state_dict(store: ChunkSource) -> dict[str, Tensor]:
    """fp32 MASTER copies by (first) param name; empty when training in fp32 (PARAM is the master)."""
    if ChunkList.MASTER not in store.layout.lists:
        return {}
    cache = _ChunkCache(store)
    return {slot.names[0]: _view(cache.get(ChunkList.MASTER, slot.chunk), slot).clone() for slot in store.layout.tensors}


def load_model_state_dict(store: ChunkSource, state_dict: Mapping[str, Tensor], model: nn.Module | None = None, *,
                          strict: bool = True, master: Mapping[str, Tensor] | None = None) -> None:
    """Write params into the PARAM chunks (and MASTER: from `master` by name, else the params in fp32).

    A tied param may appear under any of its names. Buffers go into `model` when it is given.
    strict: every param present, no unknown keys (buffers of `model` are known).
    """
    _check_tensor_map(state_dict, "model state dict")
    if master is not None:
        _check_tensor_map(master, "master state dict")
    layout = store.layout
    known: set[str] = {n for s in layout.tensors for n in s.names}
    buffers = dict(model.named_buffers()) if model is not None else {}
    if strict:
        unknown = sorted(k for k in state_dict if k not in known and k not in buffers)
        missing = [s.names[0] for s in layout.tensors if not any(n in state_dict for n in s.names)]
        if unknown or missing:
            raise StateError(f"model state dict does not match the schedule's layout: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {unknown[:5]}{'...' if len(unknown) > 5 else ''}; "
                             "load a checkpoint of this model (or pass strict=False)")
    cache = _ChunkCache(store)
    has_master = ChunkList.MASTER in layout.lists
    for slot in layout.tensors:
        name = next((n for n in slot.names if n in state_dict), None)
        if name is None:
            continue
        value = state_dict[name]
        if tuple(value.shape) != tuple(slot.shape):
            raise StateError(f"model state dict: {name!r} has shape {tuple(value.shape)}, the model has {tuple(slot.shape)}; "
                             "load a checkpoint of this model")
        cache.set_slot(ChunkList.PARAM, slot, value.detach())
        if has_master:
            m = master.get(slot.names[0]) if master else None
            cache.set_slot(ChunkList.MASTER, slot, (m if m is not None else value).detach().float())
    cache.flush()
    if model is not None:
        with torch.no_grad():
            for key, buf in buffers.items():
                if key in state_dict and buf is not None:
                    buf.copy_(state_dict[key])


def load_master_state_dict(store: ChunkSource, master: Mapping[str, Tensor]) -> None:
    """Write fp32 MASTER copies by name (from `master_state_dict`)."""
    if ChunkList.MASTER not in store.layout.lists:
        return
    cache = _ChunkCache(store)
    for slot in store.layout.tensors:
        if slot.names[0] in master:
            cache.set_slot(ChunkList.MASTER, slot, master[slot.names[0]].float())
    cache.flush()


# ------------------------------------------------------------------------------- optimizer


def _params_in_order(optimizer: ChunkAdamW) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_dict(store: ChunkSource, optimizer: ChunkAdamW) -> dict[str, Any]:
    """`torch.optim.AdamW.state_dict()` format from the M/V chunks and the optimizer's step counts."""
    layout = store.layout
    slot_of = {s.tensor: s for s in layout.tensors}
    cache = _ChunkCache(store)
    state: dict[int, dict[str, Tensor]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in optimizer.param_groups:
        indices = []
        for p in group["params"]:
            entry = optimizer.entry_of(p)
            step = optimizer.state.get(p, {}).get("step")
            if step is not None:  # torch keeps no state for a param that never stepped
                slot = slot_of[entry.tensor]
                state[index] = {
                    "step": step.detach().to("cpu", torch.float32, copy=True),
                    "exp_avg": _view(cache.get(ChunkList.M, slot.chunk), slot).clone(),
                    "exp_avg_sq": _view(cache.get(ChunkList.V, slot.chunk), slot).clone(),
                }
            indices.append(index)
            index += 1
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = indices
        groups.append(packed)
    return {"state": state, "param_groups": groups}


def check_optimizer_state_dict(store: ChunkSource, optimizer: ChunkAdamW, state_dict: Any) -> None:
    """What `load_optimizer_state_dict` checks before it writes anything (one StateError line): the
    torch.optim structure, the group sizes, each setting and each param's step and moments."""
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    saved_state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(state_dict, Mapping) or not isinstance(saved_groups, list) or not isinstance(saved_state, Mapping):
        raise StateError("optimizer state dict: expected keys 'state' and 'param_groups' (torch.optim format); "
                         "pass optimizer.state_dict() of an Adam/AdamW")
    for g, saved in enumerate(saved_groups):
        params = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(params, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in params):
            raise StateError(f"optimizer state dict: param_groups[{g}] has no 'params' list of indices, found "
                             f"{_short(params if isinstance(saved, Mapping) else saved)}; pass optimizer.state_dict() of an Adam/AdamW")
    if len(saved_groups) != len(optimizer.param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, optimizer.param_groups)
    ):
        raise StateError(f"optimizer state dict: param group sizes {[len(s['params']) for s in saved_groups]} do not match "
                         f"this optimizer's {[len(g['params']) for g in optimizer.param_groups]}; build the optimizer "
                         "with the same param groups as the one that saved it")
    slot_of = {s.tensor: s for s in store.layout.tensors}
    for g, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):  # all checks before the first write
        _check_hyperparameters(saved, group, g)
        for saved_index, p in zip(saved["params"], group["params"]):
            st = saved_state.get(saved_index)
            if st is not None:
                _check_param_state(st, saved_index, slot_of[optimizer.entry_of(p).tensor])


def load_optimizer_state_dict(store: ChunkSource, optimizer: ChunkAdamW, state_dict: Mapping[str, Any]) -> None:
    """Inverse of `optimizer_state_dict`; also loads a plain `torch.optim.AdamW` / `Adam` state dict
    over the same params in the same group structure. M/V of params without state become zero."""
    check_optimizer_state_dict(store, optimizer, state_dict)
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    slot_of = {s.tensor: s for s in store.layout.tensors}
    cache = _ChunkCache(store)
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for key, value in saved.items():
            if key not in ("params", "param_names") and key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
        for saved_index, p in zip(saved["params"], group["params"]):
            entry = optimizer.entry_of(p)
            slot = slot_of[entry.tensor]
            st = saved_state.get(saved_index)
            if st is None:
                optimizer.state.pop(p, None)
                cache.set_slot(ChunkList.M, slot, torch.zeros(slot.shape))
                cache.set_slot(ChunkList.V, slot, torch.zeros(slot.shape))
                continue
            step = st["step"]
            step = step.detach().to("cpu", torch.float32, copy=True).reshape(()) if isinstance(step, Tensor) else torch.tensor(float(step))
            optimizer.state[p] = {"step": step}
            cache.set_slot(ChunkList.M, slot, st["exp_avg"].detach().float())
            cache.set_slot(ChunkList.V, slot, st["exp_avg_sq"].detach().float())
    cache.flush()


# ------------------------------------------------------------------------------- checkpoint files


def save(path: str | Path, store: ChunkSource, *, model: nn.Module | None = None, optimizer: ChunkAdamW | None = None,
         loss_scaler: Any = None, extra: Mapping[str, Any] | None = None) -> None:
    """Write a checkpoint atomically: {"format", "model", "optimizer"?, "master"?, "loss_scaler"?, "extra"?}.

    `torch.load(path)["model"]` loads into a plain model, `["optimizer"]` into a plain AdamW.
    """
    ckpt: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "model": model_state_dict(store, model)}
    if optimizer is not None:
        ckpt["optimizer"] = optimizer_state_dict(store, optimizer)
    master = master_state_dict(store)
    if master:
        ckpt["master"] = master
    if loss_scaler is not None:
        ckpt["loss_scaler"] = loss_scaler.state_dict()
    if extra:
        ckpt["extra"] = dict(extra)
    schedule = getattr(store, "schedule", None)
    if schedule is not None and hasattr(schedule, "content_digest"):
        ckpt["schedule_digest"] = schedule.content_digest()
        world_size = _world_size(schedule)
        if world_size is not None:
            ckpt["schedule_world_size"] = world_size
    ckpt["content_digest"] = checkpoint_digest(ckpt)
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save` (tensors on the CPU); one line if it is not one, or was changed."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise StateError(f"checkpoint {path}: no such file; check the path") from None
    except IsADirectoryError:
        raise StateError(f"checkpoint {path}: a directory, not a file; pass the checkpoint file") from None
    except Exception as exc:  # torch raises many kinds for a truncated or foreign file
        raise StateError(f"checkpoint {path}: {_load_failure(exc)}; pass a file written by executor.state.save") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise StateError(f"checkpoint {path}: expected format {CHECKPOINT_FORMAT!r}; pass a file written by executor.state.save")
    found = ckpt.get("content_digest")
    scan = _FiniteScan(str(path))
    if found is None:
        # built by hand (a plain `torch.save` with our format key) or by an older tide: no digest to check,
        # only the values (`check_checkpoint`)
        scan.walk(ckpt)
        return ckpt
    try:
        h = hashlib.sha256()
        _hash_value(h, {k: v for k, v in ckpt.items() if k != "content_digest"}, scan=scan)
        expected = "sha256:" + h.hexdigest()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise StateError(f"checkpoint {path}: holds a value tide does not save ({type(exc).__name__}); "
                         "pass a file written by executor.state.save") from None
    if found != expected:  # a digest that is not a string mismatches too
        raise StateError(f"checkpoint {path}: content digest does not match: the file was changed after it was "
                         "saved; resume from an earlier checkpoint")
    return ckpt


def _load_failure(exc: Exception) -> str:
    """torch.load's reason in a few words (its messages run to several lines of advice)."""
    text = str(exc)
    if "weights_only" in text or isinstance(exc, getattr(__import__("pickle"), "UnpicklingError")):
        return "holds pickled objects other than tensors and plain data, which tide never loads (they can run code)"
    first = " ".join(text.split("\n", 1)[0].split()).split(". ", 1)[0][:80]  # its first sentence
    return f"not a readable torch checkpoint ({type(exc).__name__}{': ' + first if first else ''})"


def checkpoint_digest(ckpt: Mapping[str, Any]) -> str:
    """sha256 over every entry but `content_digest`: keys in sorted order, tensors as dtype, shape and bytes."""
    h = hashlib.sha256()
    _hash_value(h, {k: v for k, v in ckpt.items() if k != "content_digest"})
    return "sha256:" + h.hexdigest()


def _hash_value(h: Any, value: Any, *, scan: _FiniteScan | None = None, path: tuple = ()) -> None:
    """Feed `value` to the sha256 `h`; with `scan`, also look for NaN/Inf in the weight and moment
    tensors it names, block by block while each block is in cache (`_FiniteScan`)."""
    if isinstance(value, Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(value.shape)}:".encode())
        scanned = scan is not None and value.is_floating_point() and _scanned(path)
        if scanned:
            scan.start()
        for begin in range(0, t.numel(), _BLOCK_ELEMENTS):
            block = t[begin:begin + _BLOCK_ELEMENTS]
            h.update(block.view(torch.uint8).numpy())  # the buffer itself, no copy
            if scanned:
                scan.check(block)
        if scanned:
            scan.done(value)
    elif isinstance(value, Mapping):
        h.update(f"D{len(value)}:".encode())
        for key in sorted(value, key=repr):
            _hash_value(h, key)
            _hash_value(h, value[key], scan=scan, path=(*path, key))
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}:".encode())
        for item in value:
            _hash_value(h, item, scan=scan, path=path)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    else:
        raise TypeError(f"cannot digest a {type(value).__name__}")


# ------------------------------------------------------------------------------- checks of what a checkpoint holds
# A checkpoint's digest proves the file is what `save` wrote, not that what was written (or built by
# hand, or resealed) is something to train from: a NaN `step` or `lr`, an `int` where a tensor
# belongs, a scaler with scale 0. Each is refused here with one line before anything is written
# (the checkpoint fuzz of issue 21 reached AttributeError/TypeError inside restore and the fused kernel).

_STATE_FIX = "resume from a checkpoint written by executor.state.save (or optimizer.state_dict() of an Adam/AdamW)"


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, Tensor) else f"a tensor of shape {tuple(value.shape)}"
    return text if len(text) <= 60 else text[:57] + "..."


def _check_tensor_map(values: Any, what: str) -> None:
    if not isinstance(values, Mapping):
        raise StateError(f"{what}: expected a map of names to tensors, found {_short(values)}; {_STATE_FIX}")
    for key, value in values.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise StateError(f"{what}: {key!r}: expected a tensor under a name, found {_short(value)}; {_STATE_FIX}")


def _real(value: Any) -> float | None:
    """A real number (int, float, or a one-element tensor) as a float; None for anything else."""
    if isinstance(value, Tensor):
        return float(value.reshape(-1)[0]) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


# The ranges torch.optim.Adam/AdamW refuse at construction (torch/optim/adam.py __init__: "Invalid
# learning rate", "Invalid epsilon value", "Invalid beta parameter at index i", "Invalid weight_decay
# value"), plus finiteness, which torch does not check and the fused kernel silently propagates.
_GROUP_RANGES: dict[str, tuple[float, float, str]] = {
    "lr": (0.0, math.inf, "a finite number >= 0"),
    "eps": (0.0, math.inf, "a finite number >= 0"),
    "weight_decay": (0.0, math.inf, "a finite number >= 0"),
}


def _check_hyperparameters(saved: Mapping[str, Any], group: Mapping[str, Any], g: int) -> None:
    """Each saved setting has the kind of value this optimizer's group holds (a finite number for a
    number, True/False for a flag, a pair of betas in [0, 1))."""
    for key, value in saved.items():
        if key in ("params", "param_names") or key not in group:
            continue
        where = f"optimizer state dict: param_groups[{g}].{key}"
        current = group[key]
        if key == "betas":
            betas = [_real(b) for b in value] if isinstance(value, (list, tuple)) and len(value) == 2 else [None]
            if any(b is None or not 0.0 <= b < 1.0 for b in betas):
                raise StateError(f"{where}: expected two numbers in [0, 1), found {_short(value)}; {_STATE_FIX}")
        elif key == "amsgrad":
            if value is not False:
                raise StateError(f"{where}: expected False (ChunkAdamW has no max_exp_avg_sq chunk list), found "
                                 f"{_short(value)}; load the state of an optimizer without amsgrad")
        elif key in ("maximize", "decoupled_weight_decay"):  # the flags the kernel reads; foreach/fused/... may be None
            if not isinstance(value, bool):
                raise StateError(f"{where}: expected True or False, found {_short(value)}; {_STATE_FIX}")
        elif _real(current) is not None or key in _GROUP_RANGES:
            low, high, words = _GROUP_RANGES.get(key, (-math.inf, math.inf, "a finite number"))
            number = _real(value)
            if number is None or not math.isfinite(number) or not low <= number <= high:
                raise StateError(f"{where}: expected {words}, found {_short(value)}; {_STATE_FIX}")


def _check_param_state(st: Any, index: Any, slot: TensorSlot) -> None:
    where = f"optimizer state dict: state[{index}]"
    if not isinstance(st, Mapping):
        raise StateError(f"{where}: expected a map with 'step', 'exp_avg', 'exp_avg_sq', found {_short(st)}; {_STATE_FIX}")
    for key in ("step", "exp_avg", "exp_avg_sq"):
        if key not in st:
            raise StateError(f"{where} has no {key!r}; pass an Adam/AdamW state dict")
    step = _real(st["step"])
    if step is None or not math.isfinite(step) or step < 0 or step != int(step):
        raise StateError(f"{where}.step: expected a whole number >= 0 (steps taken), found {_short(st['step'])}; {_STATE_FIX}")
    for key in ("exp_avg", "exp_avg_sq"):
        value = st[key]
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise StateError(f"{where}.{key}: expected a floating-point tensor, found {_short(value)}; {_STATE_FIX}")
        if tuple(value.shape) != tuple(slot.shape):
            raise StateError(f"optimizer state dict: state[{index}][{key!r}] has shape {tuple(value.shape)}, "
                             f"param {slot.names[0]!r} has {tuple(slot.shape)}; the param groups are in another order")


def _check_loss_scaler(saved: Any) -> None:
    """A DynamicLossScaler / torch.amp.GradScaler state: the bounds DynamicLossScaler.__init__ enforces."""
    rules = {"scale": (lambda x: 0 < x < math.inf, "a finite number > 0"),
             "growth_factor": (lambda x: 1 < x < math.inf, "a finite number > 1"),
             "backoff_factor": (lambda x: 0 < x < 1, "a number in (0, 1)"),
             "growth_interval": (lambda x: x >= 1 and x == int(x) and x < 2**63, "a whole number >= 1"),
             "_growth_tracker": (lambda x: x >= 0 and x == int(x) and x < 2**63, "a whole number >= 0")}
    if not isinstance(saved, Mapping):
        raise StateError(f"checkpoint: loss_scaler: expected the scaler's state_dict(), found {_short(saved)}; {_STATE_FIX}")
    for key, (ok, words) in rules.items():
        number = _real(saved.get(key))
        if number is None or math.isnan(number) or not ok(number):
            raise StateError(f"checkpoint: loss_scaler.{key}: expected {words}, found {_short(saved.get(key))}; {_STATE_FIX}")


def check_checkpoint(ckpt: Any, *, params: set[str] | None = None) -> None:
    """The entries `restore` reads have the shape `save` gives them (one line on the first that does not),
    and no weight, master copy or Adam moment holds NaN or Inf (`params`: the layout's param names, so
    that a buffer's -inf mask is not refused; None: every model entry).

    The per-param optimizer state is checked against the layout by `load_optimizer_state_dict`, also
    before it writes anything."""
    if not isinstance(ckpt, Mapping) or "model" not in ckpt:
        raise StateError(f"checkpoint: expected a map with a 'model' entry, found {_short(ckpt)}; {_STATE_FIX}")
    _check_tensor_map(ckpt["model"], "checkpoint: model")
    if ckpt.get("master") is not None:
        _check_tensor_map(ckpt["master"], "checkpoint: master")
    if "optimizer" in ckpt and not isinstance(ckpt["optimizer"], Mapping):
        raise StateError(f"checkpoint: optimizer: expected optimizer.state_dict(), found {_short(ckpt['optimizer'])}; {_STATE_FIX}")
    if "loss_scaler" in ckpt:
        _check_loss_scaler(ckpt["loss_scaler"])
    _check_finite(ckpt, params)


def _world_size(schedule: Any) -> int | None:
    """The ranks a schedule runs on (`header.world_size`); None for an object without a header."""
    value = getattr(getattr(schedule, "header", None), "world_size", None)
    return value if isinstance(value, int) else None


def restore(ckpt: Mapping[str, Any], store: ChunkSource, *, model: nn.Module | None = None,
            optimizer: ChunkAdamW | None = None, loss_scaler: Any = None, strict: bool = True) -> None:
    """Apply a checkpoint (from `load`) to the chunks, the optimizer, the model's buffers and the scaler.

    A checkpoint saved under a schedule is refused by a store that runs another one (before anything
    is written): the layout may place the same names elsewhere, and resuming silently would hide it.
    """
    check_checkpoint(ckpt, params={n for s in store.layout.tensors for n in s.names})
    saved_under = ckpt.get("schedule_digest")
    schedule = getattr(store, "schedule", None)
    if saved_under is not None and schedule is not None and hasattr(schedule, "content_digest"):
        running = schedule.content_digest()
        saved_world, running_world = ckpt.get("schedule_world_size"), _world_size(schedule)
        # another world size is a re-shard (executor/distributed.py: the file is plain, keyed by name,
        # and loads into any world size), which needs another schedule; the same world size under
        # another schedule is an edited or re-solved plan: refused
        resharding = isinstance(saved_world, int) and running_world is not None and saved_world != running_world
        if saved_under != running and not resharding:
            raise StateError(f"checkpoint was saved under schedule {str(saved_under)[:19]}..., this engine runs "
                             f"{running[:19]}...; attach the schedule it was saved with, or load its 'model' and "
                             "'optimizer' entries with model.load_state_dict / optimizer.load_state_dict")
    if optimizer is not None and "optimizer" in ckpt:  # before the model is written: all or nothing
        check_optimizer_state_dict(store, optimizer, ckpt["optimizer"])
    load_model_state_dict(store, ckpt["model"], model, strict=strict, master=ckpt.get("master"))
    if optimizer is not None and "optimizer" in ckpt:
        load_optimizer_state_dict(store, optimizer, ckpt["optimizer"])
    if loss_scaler is not None and "loss_scaler" in ckpt:
        loss_scaler.load_state_dict(ckpt["loss_scaler"])


# ------------------------------------------------------------------------------- NaN / Inf in weights and moments
# A NaN or Inf in a weight, a fp32 master copy or an Adam moment is not something to train from: the
# fused kernel propagates it silently to every param it touches. `check_checkpoint` refuses it with one
# line naming the file and the tensor, before anything is written. `load` looks for it in the digest's
# pass over each tensor (each 4 Mi-element block is hashed and its min/max taken while it is in cache)
# and remembers each tensor's verdict by the tensor object (a weak reference: nothing is kept alive),
# so restoring a loaded checkpoint reads no tensor again; a checkpoint built in memory is scanned once
# by `check_checkpoint`. A tensor changed in place after `load` keeps its verdict. Model entries that
# are not params of the layout (buffers, which may hold -inf masks) are not refused.

_BLOCK_ELEMENTS = 1 << 22  # 16 MB of fp32: stays in cache between the hash and the min/max
_VERDICTS: dict[int, tuple[weakref.ref, str, bool]] = {}  # id(tensor) -> (the tensor, its file, finite)


def _scanned(path: tuple) -> bool:
    """The tensors the NaN/Inf check covers: ("model" | "master", name), ("optimizer", "state", i,
    "exp_avg" | "exp_avg_sq")."""
    return ((len(path) == 2 and path[0] in ("model", "master"))
            or (len(path) == 4 and path[:2] == ("optimizer", "state") and path[3] in ("exp_avg", "exp_avg_sq")))


def _finite(block: Tensor) -> bool:
    """No NaN and no Inf: NaN propagates into both the min and the max, +-Inf shows in one of them."""
    if not block.numel():
        return True
    low, high = torch.aminmax(block)
    return math.isfinite(float(low)) and math.isfinite(float(high))


class _FiniteScan:
    """Verdicts of `load`'s digest pass (`_hash_value(scan=...)`), remembered per tensor."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.ok = True

    def start(self) -> None:
        self.ok = True

    def check(self, block: Tensor) -> None:
        if self.ok:
            self.ok = _finite(block)

    def done(self, t: Tensor) -> None:
        key = id(t)
        _VERDICTS[key] = (weakref.ref(t, lambda _, k=key: _VERDICTS.pop(k, None)), self.source, self.ok)

    def walk(self, ckpt: Mapping[str, Any]) -> None:
        """The same verdicts for a checkpoint without a digest (one pass over each tensor)."""
        for _, t in _weights_and_moments(ckpt):
            self.start()
            flat = t.detach().reshape(-1)
            for begin in range(0, flat.numel(), _BLOCK_ELEMENTS):
                self.check(flat[begin:begin + _BLOCK_ELEMENTS])
            self.done(t)


def _weights_and_moments(ckpt: Mapping[str, Any]) -> list[tuple[tuple, Tensor]]:
    out: list[tuple[tuple, Any]] = []
    for entry in ("model", "master"):
        values = ckpt.get(entry)
        if isinstance(values, Mapping):
            out += [((entry, name), t) for name, t in values.items()]
    opt = ckpt.get("optimizer")
    saved = opt.get("state") if isinstance(opt, Mapping) else None
    if isinstance(saved, Mapping):
        out += [(("optimizer", "state", i, key), st.get(key)) for i, st in saved.items() if isinstance(st, Mapping)
                for key in ("exp_avg", "exp_avg_sq")]
    return [(path, t) for path, t in out if isinstance(t, Tensor) and t.is_floating_point()]


def _check_finite(ckpt: Mapping[str, Any], params: set[str] | None) -> None:
    """One line on the first weight / master / moment tensor holding NaN or Inf (model entries: only
    the layout's params when `params` is given; buffers may hold -inf masks)."""
    for path, t in _weights_and_moments(ckpt):
        if path[0] == "model" and params is not None and path[1] not in params:
            continue  # a buffer
        known = _VERDICTS.get(id(t))
        if known is not None and known[0]() is t:
            where, finite = f"checkpoint {known[1]}", known[2]
        else:  # built in memory: read it now, once
            flat = t.detach().reshape(-1)
            where = "checkpoint (in memory)"
            finite = all(_finite(flat[b:b + _BLOCK_ELEMENTS]) for b in range(0, flat.numel(), _BLOCK_ELEMENTS))
        if not finite:
            what = f"{path[0]}[{path[1]!r}]" if len(path) == 2 else f"optimizer state[{path[2]!r}][{path[3]!r}]"
            raise StateError(f"{where}: {what} holds NaN or Inf; resume from an earlier checkpoint (training from it "
                             "would spread them to every param the optimizer steps)")
