"""The baseline systems as they run, each a small module that only decides (as Checkmate's
strategies do): it returns `planner.materialize.Decisions`, one or more in the order the system (or
its user) would try them, and tide's one materializer turns them into a schedule. The simulator is
the judge: every schedule is replayed by `planner.simulate` and carries its prediction.

How each system runs, rule by rule with sources: docs/baselines.md; each rule is quoted beside its
decision in the modules. A policy is INFEASIBLE (`InfeasibleError`, naming the tier, the moment and
the bytes) where the real system runs out of memory: none of its decision sets fits.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.errors import InfeasibleError, PlannerError
from planner.materialize import (
    Decisions,
    materialize_replayed,
    with_simulated_prediction,
)
from planner.policies import angel, deepspeed, fuyou, gemini, patrickstar, pytorch
from planner.policies._common import policy_layout
from planner.problem import Problem
from planner.simulate import ScheduleViolation, ViolationKind
from schemas.schedule import Schedule

# name -> the decision sets of that system, in the order it tries them
POLICIES: dict[str, Callable[..., tuple[Decisions, ...]]] = {
    "pytorch": pytorch.decide,
    "zero2-offload": deepspeed.zero2_offload,
    "zero3-offload": deepspeed.zero3_offload,
    "zero-infinity": deepspeed.zero_infinity,
    "patrickstar": patrickstar.decide,
    "gemini": gemini.decide,
    "fuyou": fuyou.decide,
    "angel": angel.decide,
}


def decisions(name: str, problem: Problem, **options: object) -> tuple[Decisions, ...]:
    """What system `name` decides for `problem` (with its options, e.g. offload_ratio for ZeRO-3)."""
    if name not in POLICIES:
        raise PlannerError(f"unknown baseline {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name](problem, **options)


def baseline(name: str, problem: Problem, **options: object) -> Schedule:
    """The schedule of baseline `name`: its first decision set that fits, materialized and replayed by
    the simulator (the prediction is the simulator's). InfeasibleError where that system runs out."""
    try:
        tried = decisions(name, problem, **options)
    except InfeasibleError as exc:
        raise InfeasibleError(_named(name, str(exc))) from None
    last: InfeasibleError | None = None
    for d in tried:
        try:
            schedule, result = materialize_replayed(problem, d)
        except InfeasibleError as exc:
            last = exc
            continue
        except ScheduleViolation as exc:
            if exc.kind is not ViolationKind.CAPACITY:
                raise
            last = InfeasibleError(str(exc))
            continue
        return with_simulated_prediction(schedule, result)  # peaks too: the simulator's
    raise InfeasibleError(_named(name, str(last)))


def _named(name: str, message: str) -> str:
    """The message naming the policy once, as its prefix (the materializer's own messages say
    "under policy 'x'", which the prefix makes redundant)."""
    message = message.replace(f" under policy {name!r}", "")
    return message if message.startswith(f"{name}: ") else f"{name}: {message}"


__all__ = ["POLICIES", "baseline", "decisions", "policy_layout", "with_simulated_prediction"]
