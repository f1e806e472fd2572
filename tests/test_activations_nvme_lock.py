"""Activations on NVME use the engine's one NVMe store (issue 15 item 4, issue 21 item 5): the same
directory lock as the chunks -- a second engine on the same nvme_dir is refused even when only
activations go to NVME, and the first is unharmed -- and a crashed run's activation files (the old
`tide-act-*` folders, or a `tide-nvme-*` run folder holding `*.act` files) are removed at attach,
never read."""

from __future__ import annotations

import os

import pytest
import torch

import executor
from executor.errors import ExecutorError
from schemas.schedule import ActivationMode, Op, Tier
from test_executor import LR, WD, gpt_batches
from test_executor_planner import gpt_model, plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _activation_only_nvme():
    schedule = plan("gpt", swap=True, swap_tier=Tier.NVME)
    # what makes the case: NVME holds activations and nothing else
    assert any(p.mode is ActivationMode.SWAP_NVME for p in schedule.activation_plans)
    assert not any(Tier.NVME in r.tiers for r in schedule.initial_residency)
    assert not any(Tier.NVME in (a.src, a.dst) for a in schedule.actions if a.op not in (Op.ACT_OFFLOAD, Op.ACT_RELOAD))
    return schedule


def _step(engine, model, batch) -> float:
    loss = model(batch, batch)
    loss.backward()
    engine.step()
    return loss.item()


def test_a_second_engine_on_the_same_nvme_dir_is_refused_with_activation_only_nvme(tmp_path):
    schedule = _activation_only_nvme()
    batches = gpt_batches(3)
    first_model = gpt_model()
    first = executor.run(first_model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)
    try:
        _step(first, first_model, batches[0])
        assert list(tmp_path.rglob("*.act"))  # the activations went to NVME, under the lock
        second_model = gpt_model()
        before = {k: v.clone() for k, v in second_model.state_dict().items()}
        with pytest.raises(ExecutorError) as info:
            executor.run(second_model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)
        message = str(info.value)
        assert "\n" not in message and "in use by another tide run" in message and f"pid {os.getpid()}" in message
        # refused before it touched the model: plain params, no hooks left behind
        assert all(torch.equal(v, before[k]) for k, v in second_model.state_dict().items())
        assert not second_model._forward_hooks and not second_model._forward_pre_hooks
        # the first is unharmed: it trains on like an engine that never saw the second
        losses = [_step(first, first_model, b) for b in batches[1:]]
    finally:
        first.detach()
    ref_model = gpt_model()
    ref = executor.run(ref_model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)  # released at detach
    ref_losses = [_step(ref, ref_model, b) for b in batches]
    ref.detach()
    assert losses == ref_losses[1:]
    assert not list(tmp_path.rglob("*.act"))


def test_a_crashed_runs_activation_files_are_removed_at_attach_and_never_read(tmp_path):
    schedule = _activation_only_nvme()
    # what a SIGKILLed run leaves: the activation manager's own folder of earlier versions, and a
    # store's run folder with activation files, both full of garbage that must never be read
    legacy = tmp_path / "tide-act-k1ll3d"
    crashed = tmp_path / "tide-nvme-999999-deadbeef"
    for folder in (legacy, crashed):
        folder.mkdir()
        for block in range(3):
            (folder / f"block{block}.act").write_bytes(os.urandom(1 << 16))
    batches = gpt_batches(2)
    model = gpt_model()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)
    assert not legacy.exists() and not crashed.exists()
    notes = " ".join(engine.store.nvme.notes)
    assert legacy.name in notes and crashed.name in notes
    losses = [_step(engine, model, b) for b in batches]
    engine.detach()
    ref_model = gpt_model()
    ref = executor.run(ref_model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path / "clean")
    assert [_step(ref, ref_model, b) for b in batches] == losses
    ref.detach()
    assert not list(tmp_path.rglob("*.act"))
