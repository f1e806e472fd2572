"""Errors the planner's CLI turns into one line and an exit code, never a traceback."""

from __future__ import annotations


class PlannerError(Exception):
    """A problem with the user's input that the planner explains (exit code 2)."""

    exit_code = 2


class InfeasibleError(PlannerError):
    """The model cannot be trained on this hardware; the message says which tier, where, by how much,
    and the smallest capacity that would work (exit code 3)."""

    exit_code = 3
