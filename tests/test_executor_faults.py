"""Issue 7 fault tests: the NVME directory fills up or turns read-only in the middle of training.

The engine raises one clear `ExecutorError` line, enters FAILED and refuses every later step; what
was in memory is intact. A failure inside the optimizer step would leave it TORN (some chunks took the
step, the others did not: state_dict()/save() refuse); a write-back that fails after its source was
evicted does not (issue 17: the EVICT does not wait for it, and the source is kept as the valid copy).
A failure outside it leaves a CONSISTENT state: save() works and the checkpoint loads into a plain
model and a plain AdamW that continue exactly like an uninterrupted plain loop.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import executor
from executor.errors import ExecutorError
from executor.runtime import EngineState
from schemas.schedule import ChunkList, Tier
from test_executor import LR, WD, gpt_batches, plain_groups
from test_executor_planner import gpt_model, plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GOOD_STEPS = 2


def _loss(model, b):
    return model(b, b)


def _plain_states(n: int, batches) -> list[dict[str, torch.Tensor]]:
    """Plain PyTorch params after 0..n steps."""
    model = gpt_model()
    opt = torch.optim.AdamW(plain_groups(model), lr=LR, fused=True)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    for b in batches[:n]:
        _loss(model, b).backward()
        opt.step()
        opt.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _failing_pwrite(code: int):
    def pwrite(fd, data, offset):
        raise OSError(code, os.strerror(code))
    return pwrite


def _train(engine, model, batches) -> None:
    for b in batches:
        _loss(model, b).backward()
        engine.step()


def _fail_one_iteration(engine, model, batch) -> ExecutorError:
    with pytest.raises(ExecutorError) as info:
        _train(engine, model, [batch])
    message = str(info.value)
    assert "\n" not in message
    assert engine.state is EngineState.FAILED and engine.failure is not None
    assert engine.failure.message == message and engine.failure.iteration == GOOD_STEPS
    with pytest.raises(ExecutorError, match="the replay stopped earlier"):  # refuses every later step
        _loss(model, batch).backward()
    with pytest.raises(ExecutorError, match="the replay stopped earlier"):
        engine.step()
    return info.value


def test_disk_full_during_the_os_write_back_keeps_the_step_in_memory_and_every_chunk_intact(tmp_path, monkeypatch):
    """The write-backs to NVME fail after their HOST sources were evicted: the EVICTs did not wait for
    them, so every chunk took the step; the failure is raised by the end of the step, and the evicted
    buffers are kept as the valid copies (Note [retiring payloads] in executor/store.py), so the state is
    the step's, whole: nothing is torn, and save() writes it."""
    schedule = plan("gpt", nvme=True)  # OS of even chunks and most PARAM homes on NVME
    model, batches = gpt_model(), gpt_batches(GOOD_STEPS + 1)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)
    _train(engine, model, batches[:GOOD_STEPS])
    monkeypatch.setattr(os, "pwrite", _failing_pwrite(errno.ENOSPC))
    error = _fail_one_iteration(engine, model, batches[GOOD_STEPS])
    monkeypatch.undo()
    assert "disk full" in str(error) and str(tmp_path) in str(error)
    failure = engine.failure
    assert not failure.torn and failure.steps == GOOD_STEPS + 1 and not engine._lost
    # in memory every PARAM chunk holds exactly its new values
    states = _plain_states(GOOD_STEPS + 1, batches)
    for chunk in range(len(schedule.layout.chunks)):
        flat = engine.read_chunk(ChunkList.PARAM, chunk)
        for slot in (s for s in schedule.layout.tensors if s.chunk == chunk):
            got = flat[slot.offset_elements:slot.offset_elements + slot.numel].view(slot.shape)
            assert torch.equal(got, states[GOOD_STEPS + 1][slot.names[0]]), (chunk, slot.names[0])
    engine.save(tmp_path / "after.pt")  # the whole state of step 3, optimizer state included
    ckpt = torch.load(tmp_path / "after.pt", weights_only=True)
    plain = gpt_model()
    plain.load_state_dict(ckpt["model"])
    for name, value in states[GOOD_STEPS + 1].items():
        assert torch.equal(plain.state_dict()[name], value), name
    opt = torch.optim.AdamW(plain_groups(plain), lr=LR, fused=True)
    opt.load_state_dict(ckpt["optimizer"])  # the M and V whose NVME write failed come from HOST
    engine.detach()  # still possible: files removed, params plain again
    assert not list(tmp_path.rglob("*.bin"))


def test_read_only_directory_during_an_activation_swap_keeps_a_consistent_state(tmp_path, monkeypatch):
    schedule = plan("gpt", swap=True, swap_tier=Tier.NVME)
    model, batches = gpt_model(), gpt_batches(GOOD_STEPS + 3)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=nvme)
    _train(engine, model, batches[:GOOD_STEPS])
    nvme.chmod(0o500)  # read-only from now on (root ignores it for open files: the write fails as EROFS)
    monkeypatch.setattr(os, "pwrite", _failing_pwrite(errno.EROFS))
    try:
        error = _fail_one_iteration(engine, model, batches[GOOD_STEPS])
    finally:
        monkeypatch.undo()
        nvme.chmod(0o700)
    assert "activation file" in str(error) and "Read-only file system" in str(error)
    assert not engine.failure.torn and engine.failure.steps == GOOD_STEPS
    engine.save(tmp_path / "after.pt")  # the state of the last complete step
    ckpt = torch.load(tmp_path / "after.pt", weights_only=True)
    plain = gpt_model()
    plain.load_state_dict(ckpt["model"])
    states = _plain_states(GOOD_STEPS, batches)
    for name, value in states[GOOD_STEPS].items():
        assert torch.equal(plain.state_dict()[name], value), name
    # ...and continues in a plain loop exactly like the uninterrupted plain loop
    opt = torch.optim.AdamW(plain_groups(plain), lr=LR, fused=True)
    opt.load_state_dict(ckpt["optimizer"])
    ref = gpt_model()
    ref_opt = torch.optim.AdamW(plain_groups(ref), lr=LR, fused=True)
    for model_, opt_, steps in ((ref, ref_opt, batches), (plain, opt, batches[GOOD_STEPS:])):
        for b in steps:
            _loss(model_, b).backward()
            opt_.step()
            opt_.zero_grad()
    for (name, got), want in zip(plain.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    engine.detach()
    assert not list(nvme.rglob("*.act"))
