"""`EngineOptimizer(engine)`: the engine's optimizer as a `torch.optim.Optimizer` that trainers and
Accelerate can wrap, save and reload.

`engine.optimizer` keeps its state in the chunks and refuses `state_dict()`; Accelerate's
`AcceleratedOptimizer` and HF `Trainer` call `state_dict()` / `load_state_dict()` on whatever
optimizer they are given (to move it to the device, to checkpoint it). This view shares the
engine optimizer's `param_groups` (so LR schedulers attached to either change the engine's lr), runs
`engine.step()` on `step()`, and its state dict holds the hyper-parameters only: the moments live
in the engine's checkpoint (`engine.save(path)`), which the integrations write beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class EngineOptimizer(torch.optim.Optimizer):
    def __init__(self, engine: Any) -> None:
        inner = engine.optimizer
        super().__init__([p for g in inner.param_groups for p in g["params"]], dict(inner.defaults))
        self.engine = engine
        self.param_groups = inner.param_groups  # the same dicts: a scheduler's lr is the engine's lr

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Hyper-parameters per group; the moments are in the engine's checkpoint (`engine.save`)."""
        return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                              for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"EngineOptimizer.load_state_dict: {len(groups)} param groups, expected "
                             f"{len(self.param_groups)}; was it saved from this engine's optimizer?")
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
