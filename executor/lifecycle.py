"""The engine's lifecycle: its state machine (`EngineState`, guarded transitions) and what a failure
leaves (`EngineFailure`, Note [failures]).

`Lifecycle` is a part of `executor.runtime.Engine` (a mixin, like `ParamBinding`): it enters states,
marks the engine FAILED, refuses the model's next forward after a failure, and says when the state
may be read or changed (`_require_idle`, `_require_consistent`, `model.state_dict()` while attached).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from executor.errors import ExecutorError


class EngineState(enum.Enum):
    """Where the engine is in the replay; changed only by `Engine._enter`."""

    IDLE = "idle"  # attached, between iterations: the next event must be moment 0 (root pre_forward)
    REPLAYING = "replaying"  # inside an iteration: moments 0..cursor-1 were applied
    EVALUATING = "evaluating"  # between iterations, inside an evaluation forward (executor/evaluation.py)
    FAILED = "failed"  # a replay check failed mid-iteration; every later event raises
    DETACHED = "detached"  # `detach()` ran: hooks removed, params hold plain tensors again


_ENGINE_TRANSITIONS = {
    (EngineState.IDLE, EngineState.REPLAYING), (EngineState.REPLAYING, EngineState.IDLE),
    (EngineState.IDLE, EngineState.FAILED), (EngineState.REPLAYING, EngineState.FAILED),
    (EngineState.IDLE, EngineState.DETACHED), (EngineState.REPLAYING, EngineState.DETACHED),
    (EngineState.FAILED, EngineState.DETACHED),
    (EngineState.IDLE, EngineState.EVALUATING), (EngineState.EVALUATING, EngineState.IDLE),
    (EngineState.EVALUATING, EngineState.DETACHED),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineFailure:
    """Where the replay failed and what state it left (see Note [failures] in executor/lifecycle.py)."""

    message: str  # the ExecutorError line
    iteration: int  # micro-steps completed before it
    moment: int  # the moment being applied
    steps: int  # optimizer steps every chunk in `updated_chunks` has taken
    updated_chunks: frozenset[int]  # chunks stepped in the failed iteration
    pending_chunks: frozenset[int]  # chunks that were still to be stepped in it

    @property
    def torn(self) -> bool:
        """Some chunks took the failed iteration's step and others did not."""
        return bool(self.updated_chunks) and bool(self.pending_chunks)


class Lifecycle:
    """The engine's states and failures (module docstring)."""

    state: EngineState
    cursor: int  # the next moment to apply
    failure: EngineFailure | None

    # Note [failures]
    # Failures (a disk full or read-only NVME directory, a failed copy, a schedule violation): the engine
    # raises one `ExecutorError` line, enters FAILED and refuses every later moment ("the replay stopped
    # earlier ..."); `engine.failure` says where. Nothing in memory is lost: a chunk is never evicted from
    # HOST before its NVME write landed, and a copy that failed is dropped, not used. `state_dict()` /
    # `save()` still work after a failure when the state is CONSISTENT: every trainable chunk has taken
    # the same number of optimizer steps (`engine.failure.steps` of them), i.e. the failure came before
    # the first OPTIMIZER_STEP of its iteration or after the last one. A failure between them leaves the
    # step TORN (some chunks updated, the others not; each chunk itself is intact, old or new): then
    # `state_dict()` / `save()` refuse, naming the chunks, and the last checkpoint is the state to go back
    # to. Making every step transactional would need a second copy of the model's OS, which is what
    # offloading exists to avoid.

    def _enter(self, to: EngineState) -> None:
        if self.state is to:
            return
        if (self.state, to) not in _ENGINE_TRANSITIONS:
            raise ExecutorError(f"internal error: engine cannot go from {self.state.value} to {to.value}")
        self.state = to

    def _fail(self, message: str) -> None:
        self._mark_failed(message)
        raise ExecutorError(message)

    def _mark_failed(self, message: str) -> None:
        if self.state is EngineState.FAILED:
            return
        self._settle_steps()  # the CPU steps in flight end; a failed one's chunk took no step
        final = self.micro_step == self.accumulation_steps - 1
        updated = frozenset(self._stepped)
        pending = (self._step_chunks - updated) if updated or final else frozenset()
        if updated and not pending:  # every chunk took this iteration's step
            self.steps_applied += 1
            self._stepped.clear()
        self._failure = message
        self.failure = EngineFailure(message=message, iteration=self.iterations, moment=self.cursor,
                                     steps=self.steps_applied, updated_chunks=updated,
                                     pending_chunks=pending if updated else frozenset())
        self._pop_saved_hooks()
        self._enter(EngineState.FAILED)
        # every copy in flight lands or fails now; a failed one's payload is dropped, never read
        self._lost = self.store.recover()

    def _refuse_if_failed(self, module: nn.Module, args: Any) -> None:
        if self.state is EngineState.FAILED:
            raise ExecutorError(f"the replay stopped earlier ({self._failure}); build a new engine after fixing it")
        self._forward_depth += 1

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)
        if (self._forward_depth == 0 and self.state in (EngineState.IDLE, EngineState.EVALUATING)
                and self.hooks.root_open):
            # an evaluation forward raised before the root's post_forward: give everything back, and
            # the hooks forget that forward, so the next one starts a new moment 0
            self._end_evaluation()
            self.hooks.reset()

    def _failed_elsewhere(self, message: str) -> None:
        """The activation manager's copy worker failed (raised to the user by the manager's hook)."""
        if self.state is EngineState.REPLAYING or self.state is EngineState.IDLE:
            self._mark_failed(message)

    def _require_consistent(self, what: str) -> None:
        """Between iterations, or after a failure that left a consistent state (Note [failures])."""
        self._end_evaluation()
        if self.state is not EngineState.FAILED:
            self._require_idle(what)
            return
        failure = self.failure
        if failure.torn:
            raise ExecutorError(
                f"engine.{what}: the failure at moment {failure.moment} of iteration {failure.iteration} tore the "
                f"optimizer step: chunks {sorted(failure.updated_chunks)} took step {failure.steps + 1}, chunks "
                f"{sorted(failure.pending_chunks)} did not; no consistent state is in memory, go back to the last "
                f"checkpoint ({failure.message})")
        if self._lost:
            raise ExecutorError(f"engine.{what}: after the failure ({failure.message}) no valid copy is left of "
                                + ", ".join(f"{lst.value} chunk {c}" for lst, c in self._lost))

    @contextlib.contextmanager
    def _own_state_dict(self) -> Iterator[None]:
        """executor.state reads the chunks itself: the model's state-dict hooks stand aside."""
        self._sd_off = True
        try:
            yield
        finally:
            self._sd_off = False

    def _state_dict_allowed(self) -> None:
        """model.state_dict() while attached (Note [state_dict while attached] in executor/binding.py)."""
        if self.state is EngineState.REPLAYING:
            raise ExecutorError(f"model.state_dict() between iterations only (after engine.step()): the engine is "
                                f"{self.state.value} at moment {self.cursor} and the chunks are moving")
        self._require_consistent("state_dict() (via model.state_dict())")
        if self.comm is not None:
            raise ExecutorError("model.state_dict() with world_size > 1: a rank holds only its own chunks; call "
                                "engine.save(path) on every rank (rank 0 writes one plain checkpoint)")

    def _enter_evaluating(self) -> None:
        self._enter(EngineState.EVALUATING)

    def _leave_evaluating(self) -> None:
        self._enter(EngineState.IDLE)

    def _evaluating_state(self) -> EngineState:
        return EngineState.EVALUATING

    def _require_idle(self, what: str) -> None:
        self._end_evaluation()  # an evaluation forward that raised before its end
        if self.state is not EngineState.IDLE:
            raise ExecutorError(f"engine.{what} between iterations only (after engine.step()), the engine is "
                                f"{self.state.value} at moment {self.cursor}")

