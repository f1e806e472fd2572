"""Moment events: the module boundaries of one training iteration, seen by hooks.

The recorder (`executor.record`) and the runtime (`executor.run`) both attach `MomentHooks` to an
unmodified model, so both see the same sequence of moments (DESIGN.md §2: a moment is an event and
the work that follows it until the next event).

Units are the modules whose boundaries are moments: the repeating blocks (`find_blocks`) and every
module outside the blocks that directly owns parameters (`find_units`). The root module ("") is not
a unit; it has events of its own around everything else. Events, in execution order:

    root pre_forward
      unit pre_forward / unit post_forward           (forward_pre / forward hooks)
    root post_forward
    root pre_backward                               (grad of the root's output arrives)
      unit pre_backward                             (grad of the unit's output arrives)
      unit post_backward                            (its backward is done, see below)
    root post_backward                              (autograd engine callback at the end of backward)

`post_backward` of a unit is detected like FSDP2's `RegisterPostBackwardFunction`: an identity
autograd Function is applied to the unit's forward inputs that require grad; its backward runs when
the grads of those inputs are complete, i.e. when the unit's backward is done. A unit none of whose
inputs require grad (an embedding fed with token ids) falls back to post-accumulate-grad hooks on its
trainable parameters: it is done when each of them has its grad. Anything still open when the engine
finishes (a parameter that got no grad) is closed then, before root post_backward, in the order it
was opened. A unit whose post_backward arrives before its pre_backward (its outputs were hidden in an
object we do not look into) gets both, pre first, so events always come in pairs.

Every unit fires each event at most once per iteration (the root's pre_forward starts a new one):
a unit called twice in one forward (a shared layer) reports its first call only, and forward calls
during backward (activation recomputation by `torch.utils.checkpoint`) fire nothing. Reentrant
checkpointing (`use_reentrant=True`) runs the checkpointed units' forward under `no_grad`, so those
units get no backward events (their backward is part of the enclosing moment): prefer the
non-reentrant form, as PyTorch does. A unit whose outputs need no grad (frozen and fed no grad),
and any forward run under `no_grad`, fire forward events only.
The OPTIMIZER moment is not a module boundary: the caller emits it.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from schemas.trace import MomentKind, Phase

from executor.errors import ExecutorError

ROOT = ""


class MomentEvent(NamedTuple):
    kind: MomentKind
    phase: Phase
    module: str  # fully qualified module name, "" for the root
    block: int  # index into the blocks list, -1 outside any block


class UnitState(enum.Enum):
    IDLE = enum.auto()  # entered at install and at every root pre_forward (a new iteration)
    FORWARD = enum.auto()  # pre_forward fired; the unit's forward is running
    FORWARD_DONE = enum.auto()  # post_forward fired; waiting for the grad of its output
    BACKWARD = enum.auto()  # pre_backward fired; the unit's backward is running
    BACKWARD_DONE = enum.auto()  # post_backward fired; nothing more this iteration


_TRANSITIONS = {
    (UnitState.IDLE, UnitState.FORWARD),
    (UnitState.FORWARD, UnitState.FORWARD_DONE),
    (UnitState.FORWARD_DONE, UnitState.BACKWARD),
    (UnitState.BACKWARD, UnitState.BACKWARD_DONE),
}


def _param_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module) -> list[str]:
    """Fully qualified names of the repeating blocks: the children of the `nn.ModuleList` that holds
    the most parameters (the first such list on a tie); [] when the model has no such list."""
    best_name, best_list, best_numel = "", None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            numel = _param_numel(module)
            if numel > best_numel:
                best_name, best_list, best_numel = name, module, numel
    if best_list is None:
        return []
    prefix = f"{best_name}." if best_name else ""
    return [f"{prefix}{child}" for child, _ in best_list.named_children()]


def find_units(model: nn.Module, blocks: list[str]) -> list[str]:
    """The blocks plus every module outside the blocks that directly owns parameters, in
    `named_modules` order (the root is never a unit: it has events of its own)."""
    block_set = set(blocks)
    units = []
    for name, module in model.named_modules():
        if name == ROOT:
            continue
        if name in block_set:
            units.append(name)
        elif any(name.startswith(f"{b}.") for b in block_set):
            continue
        elif next(module.parameters(recurse=False), None) is not None:
            units.append(name)
    return units


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Tensors inside a module's output: a tensor, tuples/lists, dicts and `ModelOutput`s (a dict)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in tensors_in(v)]
    return []


class _Unit:
    """Per-unit hook state (the root uses one too)."""

    __slots__ = ("name", "module", "block", "state", "params", "by_params", "grads_seen")

    def __init__(self, name: str, module: nn.Module, block: int) -> None:
        self.name, self.module, self.block = name, module, block
        self.state = UnitState.IDLE
        # trainable params, deduplicated: the fallback signal of post_backward
        self.params = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
        self.by_params = False  # this iteration: post_backward from param grads (no input requires grad)
        self.grads_seen: set[int] = set()

    def move(self, to: UnitState) -> bool:
        """Guarded transition; False (and no change) when not allowed: the event already fired."""
        if (self.state, to) not in _TRANSITIONS:
            return False
        self.state = to
        return True

    @property
    def root_open(self) -> bool:
        """The root's forward started and its post_forward did not fire (yet)."""
        return self._root.state is UnitState.FORWARD

    def reset(self) -> None:
        self.state, self.by_params, self.grads_seen = UnitState.IDLE, False, set()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the grads of all of them are complete."""

    @staticmethod
    def forward(ctx: Any, hooks: MomentHooks, unit: _Unit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks, ctx.unit = hooks, unit
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hooks._post_backward(ctx.unit)
        return (None, None, *grads)


class MomentHooks:
    """Calls `on_event(MomentEvent)` at every moment boundary of the model (see the module docstring).

    `install()`/`remove()` are idempotent; used as a context manager it installs on entry and removes
    on exit. `on_event` runs synchronously inside the hooks (in the autograd thread during backward).
    """

    def __init__(self, model: nn.Module, *, blocks: list[str], units: list[str],
                 on_event: Callable[[MomentEvent], None]) -> None:
        modules = dict(model.named_modules())
        for name in [*blocks, *units]:
            if name == ROOT or name not in modules:
                raise ExecutorError(f"moment hooks: module {name!r} is not a submodule of the model; "
                                    "expected names from find_blocks()/find_units(model, blocks)")
        missing = [b for b in blocks if b not in units]
        if missing:
            raise ExecutorError(f"moment hooks: blocks {missing} are not among the units; pass "
                                "units=find_units(model, blocks)")
        self.model = model
        self.blocks = list(blocks)
        self._on_event = on_event
        block_index = {name: i for i, name in enumerate(blocks)}
        self._root = _Unit(ROOT, model, -1)
        self._units = [_Unit(name, modules[name], block_index.get(name, -1)) for name in units]
        self._open: list[_Unit] = []  # units in BACKWARD, in the order they entered it
        self._handles: list[Any] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    # -- install / remove ---------------------------------------------------------------------
    def install(self) -> None:
        if self._handles:
            return
        root = self.model
        self._handles += [root.register_forward_pre_hook(self._root_pre_forward),
                          root.register_forward_hook(self._root_post_forward)]
        for unit in self._units:
            self._handles += [
                unit.module.register_forward_pre_hook(functools.partial(self._unit_pre_forward, unit), with_kwargs=True),
                unit.module.register_forward_hook(functools.partial(self._unit_post_forward, unit)),
            ]
            for p in unit.params:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._param_grad_ready, unit)))
        self._root.reset()
        for unit in self._units:
            unit.reset()

    @property
    def root_open(self) -> bool:
        """The root's forward started and its post_forward did not fire (yet)."""
        return self._root.state is UnitState.FORWARD

    def reset(self) -> None:
        """Every unit back to IDLE: after a forward that raised before its end (the next root
        pre_forward would otherwise be taken for a call inside it)."""
        self._root.reset()
        for unit in self._units:
            unit.reset()
        self._open.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> MomentHooks:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- events -------------------------------------------------------------------------------
    def _emit(self, unit: _Unit, kind: MomentKind, phase: Phase) -> None:
        self._on_event(MomentEvent(kind, phase, unit.name, unit.block))

    def _root_pre_forward(self, module: nn.Module, args: tuple) -> None:
        if self._root.state is UnitState.FORWARD or torch._C._current_graph_task_id() != -1:
            return  # the root called again inside its own forward, or recomputed during backward
        self._root.reset()
        for unit in self._units:
            unit.reset()
        self._open.clear()
        self._root.move(UnitState.FORWARD)
        self._emit(self._root, MomentKind.PRE_FORWARD, Phase.FORWARD)

    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._root.move(UnitState.FORWARD_DONE):
            return
        self._emit(self._root, MomentKind.POST_FORWARD, Phase.FORWARD)
        self._watch_output_grads(output, self._root_grad_arrived)

    def _unit_pre_forward(self, unit: _Unit, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not self.installed or not unit.move(UnitState.FORWARD):
            return None  # a repeated call, a recomputation, or hooks removed
        self._emit(unit, MomentKind.PRE_FORWARD, Phase.FORWARD)
        if not torch.is_grad_enabled():
            return None
        flat, spec = pytree.tree_flatten((args, kwargs))
        needs = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        unit.by_params = not needs
        if not needs:
            return None
        outs = _PostBackward.apply(self, unit, *(flat[i] for i in needs))
        for i, out in zip(needs, outs, strict=True):
            flat[i] = out
        return pytree.tree_unflatten(flat, spec)

    def _unit_post_forward(self, unit: _Unit, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.installed or not unit.move(UnitState.FORWARD_DONE):
            return
        self._emit(unit, MomentKind.POST_FORWARD, Phase.FORWARD)
        self._watch_output_grads(output, functools.partial(self._unit_grad_arrived, unit))

    def _watch_output_grads(self, output: Any, on_grad: Callable[[torch.Tensor], None]) -> None:
        if not torch.is_grad_enabled():
            return
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(on_grad)

    # backward: tensor hooks and the engine callback run in the autograd thread
    def _root_grad_arrived(self, grad: torch.Tensor) -> None:
        self._begin_backward()

    def _begin_backward(self) -> None:
        if not self.installed or not self._root.move(UnitState.BACKWARD):
            return
        self._emit(self._root, MomentKind.PRE_BACKWARD, Phase.BACKWARD)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _unit_grad_arrived(self, unit: _Unit, grad: torch.Tensor) -> None:
        self._pre_backward(unit)

    def _pre_backward(self, unit: _Unit) -> None:
        if self._root.state is UnitState.FORWARD_DONE:
            self._begin_backward()  # the root's output was not on the way to the loss
        if not self.installed or not unit.move(UnitState.BACKWARD):
            return
        self._open.append(unit)
        self._emit(unit, MomentKind.PRE_BACKWARD, Phase.BACKWARD)

    def _post_backward(self, unit: _Unit) -> None:
        if unit.state is UnitState.FORWARD_DONE:
            self._pre_backward(unit)  # keep events in pairs
        if not self.installed or not unit.move(UnitState.BACKWARD_DONE):
            return
        self._open.remove(unit)
        self._emit(unit, MomentKind.POST_BACKWARD, Phase.BACKWARD)

    def _param_grad_ready(self, unit: _Unit, param: torch.Tensor) -> None:
        if not unit.by_params or unit.state not in (UnitState.FORWARD_DONE, UnitState.BACKWARD):
            return
        unit.grads_seen.add(id(param))
        if len(unit.grads_seen) == len(unit.params):
            self._post_backward(unit)

    def _end_backward(self) -> None:
        for unit in list(self._open):
            self._post_backward(unit)
        if self._root.move(UnitState.BACKWARD_DONE):
            self._emit(self._root, MomentKind.POST_BACKWARD, Phase.BACKWARD)


__all__ = ["MomentEvent", "MomentHooks", "UnitState", "find_blocks", "find_units", "tensors_in"]
