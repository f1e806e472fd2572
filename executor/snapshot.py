"""Leave a model as it was found: `with ModelSnapshot(model): ...` restores, on the way out (also
after an error), every parameter's and buffer's values, device and tensor object, every grad
(None stays None) and the RNG states (torch CPU, CUDA when already initialized, python, numpy).

Recording runs real training iterations (executor/recorder.py); no user expects a profiling pass to
change their weights, so the recorder works inside one of these.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn


class ModelSnapshot:
    """Copies of a model's state on the CPU (the meta device's own tensors on meta: no memory)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> ModelSnapshot:
        self.params: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        for p in self.model.parameters():  # each shared parameter once
            grad = p.grad
            self.params.append((p, p.data, _copy(p.data), grad, None if grad is None else _copy(grad)))
        # where each parameter object sits: `.to()` across tensor types (cpu -> meta) replaces them
        self.slots = [(module, name, p) for module in self.model.modules()
                      for name, p in module._parameters.items() if p is not None]
        self.buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = [
            (module, name, buf, _copy(buf))
            for module in self.model.modules() for name, buf in module._buffers.items() if buf is not None]
        self.rng_cpu = torch.random.get_rng_state()
        self.rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.rng_python = random.getstate()
        self.rng_numpy = np.random.get_state()
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for module, name, p in self.slots:
                module._parameters[name] = p
            for p, data, values, grad, grad_values in self.params:
                p.data = data  # the original tensor (and device), if anything moved the model
                data.copy_(values)
                if grad is not None:
                    grad.copy_(grad_values)
                p.grad = grad
            for module, name, buf, values in self.buffers:
                module._buffers[name] = buf
                buf.copy_(values)
        torch.random.set_rng_state(self.rng_cpu)
        if self.rng_cuda is not None:
            torch.cuda.set_rng_state_all(self.rng_cuda)
        random.setstate(self.rng_python)
        np.random.set_state(self.rng_numpy)


def _copy(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":
        return t.detach().clone()
    return t.detach().to("cpu", copy=True)
