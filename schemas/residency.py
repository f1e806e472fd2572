"""Which tiers hold a (valid) copy of each chunk of each chunk list, action by action.

The one set of residency rules of the schedule format (see `schemas.schedule`): the simulator and
the planner's materializer step through it, and the executor can refuse at attach what they reject.
- a copy (FETCH, PREFETCH, WRITE_BACK) needs a valid copy on its source;
- EVICT drops a held copy; dropping the last valid copy of live data is refused (a GRAD chunk is
  dead from its optimizer step until ALLOCATE or the backward writes it again);
- ALLOCATE makes a fresh zero chunk on its tier (copies elsewhere are stale);
- the backward's grad writes leave GRAD valid on DEVICE only;
- OPTIMIZER_STEP needs its inputs valid (and GRAD live) on its tier and leaves them valid there only;
  GRAD is dead afterwards.
- a chunk whose grad lives in its param's slot (`ChunkPlan.grad_in_param_slot`, PatrickStar PS.2): its
  final grad write (the backward of its last use) overwrites the DEVICE PARAM copy, which is stale from
  then on, and its step does not read PARAM (it writes it back from the fp32 master); a copy of that
  final grad onto another tier overwrites PARAM's copy there too (the slot moves with the chunk). Callers
  count PARAM and GRAD of such a chunk once on a tier holding both (`slot_overlap`): on DEVICE always
  (the partial grads before the last use are the moment's temporaries), elsewhere from the final
  grad's copy there on.
Tiers are bits by `schemas.schedule.TIER_INDEX` (bit 0: DEVICE), lists are indices into `lists`.
The state machine only says yes or no (`ResidencyRefused` names the rule broken); each caller words
its own error and counts its own bytes (`hold`, `copy`, `allocate` and `gather` say when a tier
newly holds a copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from schemas.schedule import TIER_INDEX, ChunkList, Tier

DEVICE_BIT = 1 << TIER_INDEX[Tier.DEVICE]


class Refusal(StrEnum):
    NO_SOURCE = "NO_SOURCE"  # a copy from a tier without a valid copy
    NOT_HELD = "NOT_HELD"  # an EVICT from a tier that holds no copy
    LAST_COPY = "LAST_COPY"  # an EVICT of the last valid copy of live data
    STEP_INPUT = "STEP_INPUT"  # an optimizer step without a valid (GRAD: live) input on its tier


class ResidencyRefused(Exception):
    """An action the residency rules refuse; `list_index` is the list concerned (a step: the input missing)."""

    def __init__(self, refusal: Refusal, *, list_index: int, chunk: int, tier: int, stale: bool = False) -> None:
        self.refusal, self.list_index, self.chunk, self.tier = refusal, list_index, chunk, tier
        self.stale = stale  # NO_SOURCE: the source holds a stale copy (else none)
        super().__init__(f"{refusal.value}: list {list_index}, chunk {chunk}, tier {tier}")


class ValidCopies:
    """held[list][chunk] and valid[list][chunk] as tier bitmasks, and which GRAD chunks are live."""

    __slots__ = ("lists", "index", "held", "valid", "grad_live", "slotted", "final", "in_slot", "_grad", "_param")

    def __init__(self, lists: Sequence[ChunkList], n_chunks: int, *, slotted: Sequence[bool] = ()) -> None:
        self.lists = tuple(lists)
        self.index = {x: i for i, x in enumerate(self.lists)}
        self.held = [[0] * n_chunks for _ in self.lists]
        self.valid = [[0] * n_chunks for _ in self.lists]
        self.grad_live = [False] * n_chunks
        # per chunk: its grad lives in its PARAM chunk's DEVICE slot (`ChunkPlan.grad_in_param_slot`)
        self.slotted = tuple(slotted) if slotted else (False,) * n_chunks
        self.final = [False] * n_chunks  # a slotted chunk's final grad is written (until its step)
        self.in_slot = [0] * n_chunks  # tiers (bits) other than DEVICE where its GRAD copy took PARAM's slot
        self._grad = self.index.get(ChunkList.GRAD, -1)
        self._param = self.index.get(ChunkList.PARAM, -1)

    def is_valid(self, li: int, c: int, t: int) -> bool:
        return bool(self.valid[li][c] >> t & 1)

    def holds(self, li: int, c: int, t: int) -> bool:
        return bool(self.held[li][c] >> t & 1)

    def hold(self, li: int, c: int, t: int) -> bool:
        """Tier t holds a copy (valid or not, the caller says); True when it did not before."""
        bit = 1 << t
        if self.held[li][c] & bit:
            return False
        self.held[li][c] |= bit
        return True

    def start(self, li: int, c: int, t: int) -> bool:
        """The iteration starts with a valid copy on tier t (`Schedule.initial_residency`)."""
        new = self.hold(li, c, t)
        self.valid[li][c] |= 1 << t
        return new

    def copy(self, li: int, c: int, src: int, dst: int) -> bool:
        if not self.valid[li][c] >> src & 1:
            raise ResidencyRefused(Refusal.NO_SOURCE, list_index=li, chunk=c, tier=src, stale=self.holds(li, c, src))
        new = self.hold(li, c, dst)
        self.valid[li][c] |= 1 << dst
        if li == self._grad and self.final[c]:
            self.valid[self._param][c] &= ~(1 << dst)  # the final grad lands in the param's slot there
            self.in_slot[c] |= 1 << dst
        return new

    def evict(self, li: int, c: int, src: int) -> None:
        bit = 1 << src
        if not self.held[li][c] & bit:
            raise ResidencyRefused(Refusal.NOT_HELD, list_index=li, chunk=c, tier=src)
        live = li != self._grad or self.grad_live[c]
        if live and self.valid[li][c] == bit:
            raise ResidencyRefused(Refusal.LAST_COPY, list_index=li, chunk=c, tier=src)
        self.held[li][c] &= ~bit
        self.valid[li][c] &= ~bit
        if li == self._grad:
            self.in_slot[c] &= ~bit

    def allocate(self, li: int, c: int, dst: int) -> bool:
        new = self.hold(li, c, dst)
        self.valid[li][c] = 1 << dst
        if li == self._grad:
            self.grad_live[c] = True
        return new

    def gather(self, li: int, c: int) -> bool:
        """An ALL_GATHER leaves a valid copy of the chunk on DEVICE."""
        new = self.hold(li, c, TIER_INDEX[Tier.DEVICE])
        self.valid[li][c] |= DEVICE_BIT
        return new

    def write_grads(self, c: int, *, final: bool = False) -> None:
        """The backward accumulated into GRAD chunk c on DEVICE (the caller checked a valid copy was there);
        `final`: the chunk's last backward write, which in a param slot overwrites the DEVICE PARAM copy."""
        self.valid[self._grad][c] = DEVICE_BIT
        self.grad_live[c] = True
        if final and self.slotted[c]:
            self.valid[self._param][c] &= ~DEVICE_BIT
            self.final[c] = True

    def slot_overlap(self, c: int, t: int = 0) -> bool:
        """Tier t holds both PARAM and GRAD of a slotted chunk c in one slot: one chunk's bytes, not two
        (DEVICE: always; another tier: from the final grad's copy there, which overwrote PARAM's, until
        that GRAD copy leaves; the step writes PARAM back into the same slot)."""
        if not self.slotted[c] or (t != 0 and not self.in_slot[c] >> t & 1):
            return False
        return bool((self.held[self._param][c] & self.held[self._grad][c]) >> t & 1)

    def step(self, c: int, t: int, inputs: Sequence[int]) -> None:
        """OPTIMIZER_STEP of chunk c on tier t over the lists `inputs` (PARAM, GRAD, the OS lists)."""
        for li in inputs:
            if li == self._param and self.slotted[c]:  # written back from the master into its slot there
                if not self.held[li][c] >> t & 1:  # (PatrickStar PS.9), not read: the slot must be held
                    raise ResidencyRefused(Refusal.STEP_INPUT, list_index=li, chunk=c, tier=t)
                continue
            if not self.valid[li][c] >> t & 1 or (li == self._grad and not self.grad_live[c]):
                raise ResidencyRefused(Refusal.STEP_INPUT, list_index=li, chunk=c, tier=t)
        self.final[c] = False
        for li in inputs:
            if li == self._grad:
                self.grad_live[c] = False
            else:
                self.valid[li][c] = 1 << t

    def ends_as_started(self, li: int, c: int, started: int) -> bool:
        """Steady state: the tiers hold what they held at the start (`started`), and (GRAD aside,
        whose copies may be dead) every one of them valid."""
        if li == self._grad:
            return self.held[li][c] == started
        return self.held[li][c] == started and self.valid[li][c] == started


__all__ = ["DEVICE_BIT", "Refusal", "ResidencyRefused", "ValidCopies"]
