"""The engine's activation plan runs through ActivationManager (executor/runtime.py): with the
schedule evicting block PARAM chunks from DEVICE, the blocks' saved weights must be stored as the
engine's chunk references (alias_pack), or backward reads reused chunk buffers; swapped blocks go
to HOST and NVME, a recomputed block reruns its forward. The hand-built schedule has no
ACT_RELOAD actions: the unpacks start the reloads.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from executor_support import build_schedule

import executor
from executor.models import GPT, GPTConfig
from schemas.schedule import ActivationMode, Channel, Tier

LR, WD = 1e-2, 0.1
MODES = [ActivationMode.SWAP_HOST, ActivationMode.RECOMPUTE, ActivationMode.SWAP_NVME, ActivationMode.KEEP]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _plain(model, batches):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, fused=True)
    losses = []
    for idx in batches:
        loss = model(idx, idx)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def test_engine_with_evicted_params_and_mixed_activation_modes_trains_like_plain_adamw(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(4)]
    schedule = build_schedule(model, lambda m: m(batches[0], batches[0]).backward(), chunk_elements=4096)
    plans = tuple(dataclasses.replace(p, mode=MODES[p.block]) for p in schedule.activation_plans)
    schedule = dataclasses.replace(schedule, activation_plans=plans)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)
    assert engine._evicts_params  # the case aliasing exists for
    assert engine.activations.modes == tuple(MODES)
    losses = []
    for idx in batches:
        loss = model(idx, idx)
        loss.backward()
        losses.append(loss.item())
        engine.step()
        engine.zero_grad()
    stats = engine.activations.stats()
    assert list(tmp_path.rglob("*.act"))  # block 2's NVMe file, while attached
    want = _plain(ref, batches)
    assert losses == pytest.approx(want, rel=1e-6, abs=0)
    got = engine.state_dict()["model"]
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name], p.detach(), rtol=1e-6, atol=1e-7), name
    assert stats.offloaded_bytes_per_block[0] == stats.saved_bytes_per_block[0] > 0
    assert stats.offloaded_bytes_per_block[2] == stats.saved_bytes_per_block[2] > 0
    assert stats.offloaded_bytes_per_block[1] == stats.offloaded_bytes_per_block[3] == 0
    # the swaps are the engine's bytes too: D2H/H2D for both, NVME_WRITE/NVME_READ for block 2
    total = engine.stats().total_bytes_per_channel
    assert total[Channel.NVME_WRITE] == stats.bytes_per_channel[Channel.NVME_WRITE] == stats.offloaded_bytes[Tier.NVME]
    assert total[Channel.D2H] >= stats.bytes_per_channel[Channel.D2H] > 0
    engine.detach()
    assert not list(tmp_path.rglob("*.act"))  # removed on a clean exit
