"""Drift refused before anything changes: the model's moment against the schedule's, and a batch
larger than the recorded one (Note [batch drift]).

`DriftChecks` is a part of `executor.runtime.Engine` (a mixin): each check runs before the moment's
actions, and a failed one marks the engine FAILED and raises one line naming what changed.
"""

from __future__ import annotations

from executor.attach import RERECORD
from executor.hooks import MomentEvent
from schemas.schedule import ActivationMode, MomentRef, Schedule
from schemas.trace import MomentKind, Phase

# Note [batch drift]: a block may save a little more than recorded for a batch of the recorded shape
# (measured: 1.10x for the tiny GPT-2 of tests/test_integrations_hf.py fed by the HF Trainer, whose
# collator adds an attention mask the recording did not have); a doubled batch saves 2x (1.99x-2.0x
# measured on the tests' GPT). 1.5 sits between the two; a real overflow is also caught by the
# DEVICE budget check of every moment (Note [activations]).
BATCH_DRIFT_RATIO = 1.5


class DriftChecks:
    """The engine's drift checks (module docstring)."""

    schedule: Schedule

    def _setup_batch_check(self, schedule: Schedule) -> None:
        # Note [batch drift]: per block, the activation bytes the recording saw it save for backward (what
        # it keeps: RECOMPUTE keeps its input). The hand-built schedules of tests carry 0: unknown, unchecked.
        index = {b.name: b.index for b in self.activations.blocks}
        self._act_expected = {
            p.module: (index[p.module], p.input_bytes if p.mode is ActivationMode.RECOMPUTE else p.bytes)
            for p in schedule.activation_plans if (p.bytes or p.input_bytes)}
        self._act_before: dict[int, int] = {}

    def _check_event(self, m: int, event: MomentEvent) -> MomentRef:
        """The schedule's moment m if the event is it; else the engine FAILS and raises, changing nothing else."""
        moments = self.schedule.moments
        if m >= len(moments):
            self._fail(f"moment {m}: the model reported {_describe(event)} after the schedule's last moment. {RERECORD}")
        ref = moments[m]
        if (ref.phase, ref.kind, ref.module) != (event.phase, event.kind, event.module):
            hint = ""
            if m == self._first_optimizer_moment and event.phase is not Phase.OPTIMIZER:
                hint = " (call engine.step() after every loss.backward())"
            elif m == 0 or event.kind is MomentKind.PRE_FORWARD and event.module == "":
                hint = " (one forward and one backward per iteration, then engine.step())"
            self._fail(f"moment {m}: the schedule expects {ref.phase.value} {ref.kind.value} of "
                       f"{ref.module or '<root>'!r}, the model did {_describe(event)}{hint}. {RERECORD}")
        return ref

    # Note [batch drift]
    # A batch larger than the recorded one (batch size, sequence length) makes every block save more
    # activation bytes than the schedule planned for, so its DEVICE memory no longer holds (or holds by
    # chance). At each block's post_forward the engine compares what the block saved in this forward
    # (the activation manager counts as the recorder does, so an unchanged batch gives exactly the
    # plan's bytes) with the plan, and refuses one over BATCH_DRIFT_RATIO x the plan naming the batch: at
    # the first block, before any param, grad or optimizer state changed. Smaller batches (a short last
    # batch) are allowed; a slightly larger count of the same batch shape too (below).
    def _check_batch(self, m: int, event: MomentEvent) -> None:
        index, want = self._act_expected[event.module]
        saved = self.activations.saved_bytes(index)
        if event.kind is MomentKind.PRE_FORWARD:
            self._act_before[index] = saved
            return
        got = saved - self._act_before.pop(index, saved)
        if got > BATCH_DRIFT_RATIO * want:
            self._fail(f"moment {m}: block {event.module!r} saved {got} bytes of activations for backward, the "
                       f"recorded batch {want} ({got / want:.3g}x): this batch is larger than the recorded one "
                       "(batch size or sequence length), so the schedule's memory plan no longer holds; train with "
                       "batches of the recorded shape (or smaller), or re-record with this batch (`python -m "
                       "executor record ...`) and re-solve (`python -m planner solve ...`)")


def _describe(event: MomentEvent) -> str:
    return f"{event.phase.value} {event.kind.value} of {event.module or '<root>'!r}"
