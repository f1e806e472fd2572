"""tide's executor: record a trace of one iteration, and replay a schedule inside an ordinary
PyTorch training loop (DESIGN.md §5). Never imports planner.

`executor.run(model, schedule, ...)` attaches a model to a schedule and returns the `Engine` the
training loop uses (executor/runtime.py). It is loaded on first use, so `python -m executor` and
`executor.errors` stay light.
"""

from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    if name in ("run", "Engine"):
        from executor import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
