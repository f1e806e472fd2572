"""Issue 17: an EVICT does not wait for the copies reading the payload, and the DEVICE bytes stay
counted until they land (Note [retiring payloads] in executor/store.py, Note [activations] in
executor/runtime.py) -- the rule of the simulator and the planner (Note [simulator evictions] in
planner/sim_actions.py).

Copies are held on the emulated DEVICE's copy worker by a gate (`executor.copies._copy`, the copy
worker's primitive; `executor.activations._copy_bytes` for activation swaps), so "in flight" is
deterministic: nothing here asserts a duration.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import executor
import executor.activations
import executor.copies
from executor.errors import ExecutorError
from executor.nvme import NvmeStore
from executor.store import ChunkStore, CopyState
from schemas.schedule import Channel, Chunk, ChunkLayout, ChunkList, TensorSlot, Tier
from schemas.trace import DType
from test_executor import LR, WD, gpt_batches
from test_executor_planner import gpt_model, plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P, G = ChunkList.PARAM, ChunkList.GRAD
D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
ELEMENTS = 64
CHUNK_BYTES = ELEMENTS * 4


class Gate:
    """The copy worker's primitive, held until `release` (then copying, or failing when `fail`)."""

    def __init__(self, copy, *, fail: bool = False) -> None:
        self.release, self.fail, self._copy = threading.Event(), fail, copy

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.release.wait(timeout=10):  # bounded: a test that waits for it fails instead of hanging
            raise TimeoutError("the gated copy was never released")
        if self.fail:
            raise RuntimeError("injected copy failure")
        self._copy(dst, src)


def store(*, device_chunks: int, nvme: NvmeStore | None = None) -> ChunkStore:
    lists = (P, G)
    layout = ChunkLayout(chunk_elements=ELEMENTS, lists=lists, list_dtypes={x: DType.FLOAT32 for x in lists},
                         chunks=tuple(Chunk(id=c, elements=ELEMENTS, used_elements=ELEMENTS, block=-1, comm_group=c,
                                            owner_rank=0) for c in range(3)),
                         tensors=tuple(TensorSlot(tensor=c, names=(f"w{c}",), shape=(ELEMENTS,), chunk=c,
                                                  offset_elements=0, numel=ELEMENTS, trainable=True)
                                       for c in range(3)))
    return ChunkStore(layout, device_capacity_bytes=device_chunks * CHUNK_BYTES, device=torch.device("cpu"), nvme=nvme)


def in_thread(fn):
    """Run fn() on a thread; returns (thread, errors)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def test_evict_returns_while_a_write_back_reads_the_payload_and_an_allocation_that_needs_its_bytes_waits(monkeypatch):
    s = store(device_chunks=2)
    s.allocate(G, 0, D, why="backward's grads")
    s.tensor(G, 0, D, why="test").fill_(7.0)
    gate = Gate(executor.copies._copy)
    monkeypatch.setattr(executor.copies, "_copy", gate)
    s.copy(G, 0, D, H, Channel.D2H, why="the grads' write-back")
    write_back = s._payloads[(G, 0, H)].ready
    s.evict(G, 0, D, why="the grads leave DEVICE")
    assert not write_back.done()  # EVICT returned without waiting for the copy reading the payload
    pool = s.pools[D]
    assert s.state(G, 0, D) is CopyState.RETIRING and s.valid_tiers(G, 0) == [H]  # the schedule sees it gone
    assert (pool.in_use_bytes, pool.retiring_bytes, pool.held_bytes) == (0, CHUNK_BYTES, CHUNK_BYTES)
    s.allocate(P, 1, D, why="fits beside the retiring bytes")  # no wait
    assert not write_back.done() and s.stall_seconds == 0.0
    # chunk 2 needs the retiring bytes: the allocation waits for the write-back to land
    t, errors = in_thread(lambda: s.allocate(P, 2, D, why="needs the retiring bytes"))
    t.join(timeout=0.5)
    assert t.is_alive()  # held by the gate: it waits instead of raising or taking the buffer
    gate.release.set()
    t.join(timeout=20)
    assert not t.is_alive() and not errors, errors
    assert s.stall_seconds > 0.0  # the wait is a stall
    assert s.state(G, 0, D) is CopyState.ABSENT and pool.retiring_bytes == 0
    assert pool.held_bytes == 2 * CHUNK_BYTES <= pool.capacity_bytes
    assert torch.equal(s.tensor(G, 0, H, why="test"), torch.full((ELEMENTS,), 7.0))
    s.close()


def test_a_failed_write_back_after_evict_keeps_the_evicted_buffer_as_the_valid_copy(monkeypatch):
    s = store(device_chunks=2)
    s.allocate(P, 0, D, why="a DEVICE optimizer step's params")
    s.tensor(P, 0, D, why="test").fill_(5.0)  # the only copy
    gate = Gate(executor.copies._copy, fail=True)
    monkeypatch.setattr(executor.copies, "_copy", gate)
    s.copy(P, 0, D, H, Channel.D2H, why="the write-back")
    s.evict(P, 0, D, why="the params leave DEVICE")  # returns: the write-back has not failed yet
    assert s.state(P, 0, D) is CopyState.RETIRING
    gate.release.set()  # ...now it fails
    s.allocate(P, 1, D, why="fits")
    with pytest.raises(ExecutorError, match=r"a copy reading PARAM chunk 0 on DEVICE failed after its EVICT: "
                                            r"RuntimeError: injected copy failure"):
        s.allocate(P, 2, D, why="needs the evicted buffer's bytes")  # never hands out the last copy's buffer
    assert s.recover() == []  # no chunk lost its last valid copy
    assert s.state(P, 0, D) is CopyState.VALID and s.state(P, 0, H) is CopyState.ABSENT
    assert torch.equal(s.tensor(P, 0, D, why="test"), torch.full((ELEMENTS,), 5.0))
    assert s.pools[D].retiring_bytes == 0 and s.pools[D].in_use_bytes == 2 * CHUNK_BYTES
    monkeypatch.undo()
    s.close()


def test_a_failed_nvme_write_back_after_evicting_host_keeps_the_host_copy(tmp_path, monkeypatch):
    """The PARAM write-back HOST -> NVME fails (disk full, the fault tests' injection) after EVICT HOST."""
    nvme = NvmeStore(tmp_path, lists={P: (torch.float32, [ELEMENTS] * 3)}, workers=1)
    s = store(device_chunks=2, nvme=nvme)
    s.place(P, 0, N, torch.zeros(ELEMENTS))
    s.place(P, 0, H, torch.full((ELEMENTS,), 3.0))
    s.updated(P, 0, H)  # a CPU step made the NVME copy stale: the HOST copy is the only valid one
    release = threading.Event()

    def pwrite(fd, data, offset):
        release.wait(timeout=10)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", pwrite)
    s.copy(P, 0, H, N, Channel.NVME_WRITE, why="the PARAM write-back")
    s.evict(P, 0, H, why="the params leave HOST")
    assert s.state(P, 0, H) is CopyState.RETIRING
    release.set()
    assert s.recover() == []
    monkeypatch.undo()
    assert s.state(P, 0, H) is CopyState.VALID and s.state(P, 0, N) is CopyState.ABSENT
    assert torch.equal(s.tensor(P, 0, H, why="test"), torch.full((ELEMENTS,), 3.0))
    s.close()


def test_an_activation_offload_in_flight_counts_on_device_until_it_lands(monkeypatch):
    schedule = plan("gpt", swap=True, budget_chunks=64)  # every PARAM prefetch is queued before the offloads
    model, batch = gpt_model(), gpt_batches(1)[0]
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    gate = Gate(executor.activations._copy_bytes)
    monkeypatch.setattr(executor.activations, "_copy_bytes", gate)
    loss = model(batch, batch)  # blocks 0 and 2 swap to HOST: their offload copies are held by the gate
    act, pool = engine.activations, engine.store.pools[D]
    in_flight, live = act.offloading_bytes, act.live_bytes
    assert in_flight > 0
    assert engine._activation_device_bytes() == live  # counted on DEVICE until the copy lands
    # a budget they fit only once their offloads landed: the check waits for them instead of raising
    pool.capacity_bytes = pool.held_bytes + live - 1
    t, errors = in_thread(lambda: engine._check_device_budget(engine.cursor))
    t.join(timeout=0.5)
    assert t.is_alive()
    gate.release.set()
    t.join(timeout=20)
    assert not t.is_alive() and not errors, errors
    # it returns once enough has landed to fit, which may leave the other block's offload still in flight
    assert engine._activation_device_bytes() < live
    for block in range(len(act.blocks)):
        act.wait_offloaded(block)
    assert act.offloading_bytes == 0 and act.live_bytes == live - in_flight
    assert engine.store.stall_seconds > 0.0
    # bytes that no wait can make fit raise
    pool.capacity_bytes = pool.held_bytes + act.live_bytes - 1
    with pytest.raises(ExecutorError, match="DEVICE budget exceeded"):
        engine._check_device_budget(engine.cursor)
    del loss
    engine.detach()
