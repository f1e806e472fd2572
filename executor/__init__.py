"""tide's executor: record a trace of one iteration, and replay a schedule inside an ordinary
PyTorch training loop (DESIGN.md §5). Never imports planner.

`executor.record(model, batch, loss_fn=...)` records any `nn.Module` (executor/recorder.py; the model
is left as it was); `executor.run(model, schedule, ...)` attaches a model to a schedule and returns
the `Engine` the training loop uses (executor/runtime.py). Both load on first use, so
`python -m executor` and `executor.errors` stay light.
"""

from typing import Any

__all__ = ["record", "run"]


def __getattr__(name: str) -> Any:
    if name in ("run", "Engine"):
        from executor import runtime

        return getattr(runtime, name)
    if name == "record":
        from executor.recorder import record

        return record
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
