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
a schedule, `schedule_digest` (that schedule's `content_digest`). `load` refuses a file whose
content digest does not match (a checkpoint without one, built by hand, loads unchecked), `restore` one saved under another schedule: one line each.
"""

from __future__ import annotations

import hashlib
import io
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
    "CHECKPOINT_FORMAT", "ChunkSource", "StateError", "checkpoint_digest", "load", "load_master_state_dict", "load_model_state_dict",
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


def load_optimizer_state_dict(store: ChunkSource, optimizer: ChunkAdamW, state_dict: Mapping[str, Any]) -> None:
    """Inverse of `optimizer_state_dict`; also loads a plain `torch.optim.AdamW` / `Adam` state dict
    over the same params in the same group structure. M/V of params without state become zero."""
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, Mapping):
        raise StateError("optimizer state dict: expected keys 'state' and 'param_groups' (torch.optim format); "
                         "pass optimizer.state_dict() of an Adam/AdamW")
    if len(saved_groups) != len(optimizer.param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, optimizer.param_groups)
    ):
        raise StateError(f"optimizer state dict: param group sizes {[len(s['params']) for s in saved_groups]} do not match "
                         f"this optimizer's {[len(g['params']) for g in optimizer.param_groups]}; build the optimizer "
                         "with the same param groups as the one that saved it")
    slot_of = {s.tensor: s for s in store.layout.tensors}
    cache = _ChunkCache(store)
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for key, value in saved.items():
            if key not in ("params", "param_names") and key in group:
                group[key] = value
        for saved_index, p in zip(saved["params"], group["params"]):
            entry = optimizer.entry_of(p)
            slot = slot_of[entry.tensor]
            st = saved_state.get(saved_index)
            if st is None:
                optimizer.state.pop(p, None)
                cache.set_slot(ChunkList.M, slot, torch.zeros(slot.shape))
                cache.set_slot(ChunkList.V, slot, torch.zeros(slot.shape))
                continue
            for key in ("step", "exp_avg", "exp_avg_sq"):
                if key not in st:
                    raise StateError(f"optimizer state dict: state[{saved_index}] has no {key!r}; pass an Adam/AdamW state dict")
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(st[key].shape) != tuple(slot.shape):
                    raise StateError(f"optimizer state dict: state[{saved_index}][{key!r}] has shape {tuple(st[key].shape)}, "
                                     f"param {slot.names[0]!r} has {tuple(slot.shape)}; the param groups are in another order")
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
    if found is None:
        return ckpt  # built by hand (a plain `torch.save` with our format key) or by an older tide: nothing to check
    try:
        expected = checkpoint_digest(ckpt)
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


def _hash_value(h: Any, value: Any) -> None:
    if isinstance(value, Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(value.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, Mapping):
        h.update(f"D{len(value)}:".encode())
        for key in sorted(value, key=repr):
            _hash_value(h, key)
            _hash_value(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}:".encode())
        for item in value:
            _hash_value(h, item)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    else:
        raise TypeError(f"cannot digest a {type(value).__name__}")


def restore(ckpt: Mapping[str, Any], store: ChunkSource, *, model: nn.Module | None = None,
            optimizer: ChunkAdamW | None = None, loss_scaler: Any = None, strict: bool = True) -> None:
    """Apply a checkpoint (from `load`) to the chunks, the optimizer, the model's buffers and the scaler.

    A checkpoint saved under a schedule is refused by a store that runs another one (before anything
    is written): the layout may place the same names elsewhere, and resuming silently would hide it.
    """
    saved_under = ckpt.get("schedule_digest")
    schedule = getattr(store, "schedule", None)
    if saved_under is not None and schedule is not None and hasattr(schedule, "content_digest"):
        running = schedule.content_digest()
        if saved_under != running:
            raise StateError(f"checkpoint was saved under schedule {str(saved_under)[:19]}..., this engine runs "
                             f"{running[:19]}...; attach the schedule it was saved with, or load its 'model' and "
                             "'optimizer' entries with model.load_state_dict / optimizer.load_state_dict")
    load_model_state_dict(store, ckpt["model"], model, strict=strict, master=ckpt.get("master"))
    if optimizer is not None and "optimizer" in ckpt:
        load_optimizer_state_dict(store, optimizer, ckpt["optimizer"])
    if loss_scaler is not None and "loss_scaler" in ckpt:
        loss_scaler.load_state_dict(ckpt["loss_scaler"])
