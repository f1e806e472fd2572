"""The semantic checks of a schedule beyond its format: what `python -m planner validate SCHEDULE` runs.

Loading a schedule (`Schedule.read`) checks its content digest, its JSON Schema and its static
rules (ids, references, tensors inside chunks). That proves the file is what a planner wrote, not
that what was written replays correctly: a hand-edited schedule resealed with a fresh digest, or a
planner bug, can still drop the last valid copy of a chunk or skip a param's optimizer step. So
`verify_schedule` replays it through the simulator's public entry point (`planner.simulate.simulate`,
which raises `ScheduleViolation` for a copy without a valid source, an EVICT of the last valid copy,
a chunk of trainable params stepped zero or two times, use before arrival, capacity, steady state)
and then checks what the simulator does not:

- every copy action's `bytes` is the size of its chunk in its list's dtype (what the executor moves);
- the bytes per channel the replay counts equal the schedule's `prediction.bytes_per_channel`, the
  figure the executor compares its measured bytes with every iteration;
- with a trace, the schedule's `header.trace_digest` is that trace's digest.
"""

from __future__ import annotations

from schemas import Hardware, Schedule
from schemas.schedule import COPY_OPS, Channel
from schemas.trace import DTYPE_BYTES

from planner.errors import PlannerError
from planner.simulate import SimResult, simulate

# a mismatch list is cut to this many entries in the one-line error (the count says how many more)
SHOWN_DIFFERENCES = 3


def verify_schedule(schedule: Schedule, hardware: Hardware, *, source: str, trace_digest: str | None = None) -> SimResult:
    """Raise PlannerError (one line naming `source`) unless the schedule replays correctly."""
    if trace_digest is not None and trace_digest != schedule.header.trace_digest:
        raise PlannerError(f"{source}: header.trace_digest {schedule.header.trace_digest[:19]}... is not the digest of the "
                           f"trace given ({trace_digest[:19]}...); pass the trace it was solved from, or re-solve it")
    _check_action_bytes(schedule, source)
    result = simulate(schedule, hardware)
    predicted = {ch: n for ch, n in schedule.prediction.bytes_per_channel.items() if n}
    replayed = {ch: n for ch, n in result.bytes_per_channel.items() if n}
    wrong = [f"{ch.value} predicted {predicted.get(ch, 0)} B, the actions move {replayed.get(ch, 0)} B"
             for ch in Channel if predicted.get(ch, 0) != replayed.get(ch, 0)]
    if wrong:
        raise PlannerError(f"{source}: prediction.bytes_per_channel does not match the actions: {_first(wrong)}; "
                           "re-solve the schedule")
    return result


def _check_action_bytes(schedule: Schedule, source: str) -> None:
    layout = schedule.layout
    wrong = []
    for i, a in enumerate(schedule.actions):
        if a.op not in COPY_OPS:
            continue
        size = layout.chunks[a.chunk].elements * DTYPE_BYTES[layout.list_dtypes[a.list]]
        if a.bytes != size:
            wrong.append(f"actions[{i}] ({a.op.value} {a.list.value} chunk {a.chunk}) says {a.bytes} B, the chunk is {size} B")
    if wrong:
        raise PlannerError(f"{source}: copy actions whose bytes are not their chunk's size: {_first(wrong)}; "
                           "re-solve the schedule")


def _first(items: list[str]) -> str:
    shown = "; ".join(items[:SHOWN_DIFFERENCES])
    more = len(items) - SHOWN_DIFFERENCES
    return shown + (f" (and {more} more)" if more > 0 else "")


__all__ = ["verify_schedule"]
