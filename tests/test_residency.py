"""The residency rules (schemas/residency.py) the simulator and the materializer share."""

from __future__ import annotations

import pytest

from schemas.residency import Refusal, ResidencyRefused, ValidCopies
from schemas.schedule import TIER_INDEX, ChunkList, Tier

D, H, N = (TIER_INDEX[t] for t in (Tier.DEVICE, Tier.HOST, Tier.NVME))
LISTS = (ChunkList.PARAM, ChunkList.GRAD, ChunkList.M)
P, G, M = range(3)


def _refused(call, refusal: Refusal) -> ResidencyRefused:
    with pytest.raises(ResidencyRefused) as info:
        call()
    assert info.value.refusal is refusal
    return info.value


def test_a_copy_needs_a_valid_source_and_eviction_keeps_one() -> None:
    v = ValidCopies(LISTS, 2)
    assert v.start(P, 0, H) and not v.start(P, 0, H)
    assert _refused(lambda: v.copy(P, 0, D, H), Refusal.NO_SOURCE).stale is False
    assert v.copy(P, 0, H, D) and not v.copy(P, 0, H, D)
    _refused(lambda: v.evict(P, 1, D), Refusal.NOT_HELD)
    v.evict(P, 0, H)
    _refused(lambda: v.evict(P, 0, D), Refusal.LAST_COPY)
    assert v.holds(P, 0, D) and not v.holds(P, 0, H)


def test_a_step_makes_other_copies_stale_and_grad_dead() -> None:
    v = ValidCopies(LISTS, 1)
    for li in (P, M):
        v.start(li, 0, H)
    v.copy(P, 0, H, D)
    _refused(lambda: v.step(0, H, (P, G, M)), Refusal.STEP_INPUT)  # no grads yet
    v.allocate(G, 0, D)
    v.write_grads(0)
    info = _refused(lambda: v.step(0, H, (P, G, M)), Refusal.STEP_INPUT)
    assert info.list_index == G  # the grads are on DEVICE, the step on HOST
    v.copy(G, 0, D, H)
    v.step(0, H, (P, G, M))
    assert not v.is_valid(P, 0, D) and v.is_valid(P, 0, H)
    assert _refused(lambda: v.copy(P, 0, D, H), Refusal.NO_SOURCE).stale is True
    _refused(lambda: v.step(0, H, (P, G, M)), Refusal.STEP_INPUT)  # GRAD is dead: no second step
    v.evict(G, 0, D)
    v.evict(G, 0, H)  # dead grads: dropping the last copy is fine
    v.evict(P, 0, D)
    assert v.ends_as_started(P, 0, 1 << H) and v.ends_as_started(G, 0, 0) and v.ends_as_started(M, 0, 1 << H)


def test_allocate_and_gather() -> None:
    v = ValidCopies(LISTS, 1)
    v.start(P, 0, H)
    assert v.gather(P, 0) and v.is_valid(P, 0, D)
    v.start(M, 0, H)
    v.copy(M, 0, H, D)
    v.allocate(M, 0, D)  # a fresh zero chunk: the HOST copy is stale now
    assert not v.is_valid(M, 0, H) and v.holds(M, 0, H)
    assert not v.ends_as_started(M, 0, 1 << H)
