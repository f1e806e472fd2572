"""executor/activations.py: per-block KEEP / RECOMPUTE / SWAP_HOST / SWAP_NVME on unmodified models.

Every mix of modes must train exactly like plain PyTorch; swapped bytes per block are the
recorder's activation bytes; swapping and recomputation lower the peak of live activation bytes;
reloads start before the block's backward; NVMe files go away on close; a failing copy worker
raises ExecutorError instead of hanging.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from conftest import TRACES

import executor.activations as activations
from executor.activations import ActivationManager, BlockState
from executor.errors import ExecutorError
from executor.models import build_model, make_batch, model_spec
from schemas.schedule import ActivationMode, ActivationPlan, Channel, Tier

KEEP, RECOMPUTE, SWAP_HOST, SWAP_NVME = (ActivationMode.KEEP, ActivationMode.RECOMPUTE, ActivationMode.SWAP_HOST,
                                         ActivationMode.SWAP_NVME)
GPT = model_spec("gpt-small", batch=2, seq=32)
HF = model_spec("hf-gpt2-tiny")
GPT_DROPOUT = dataclasses.replace(GPT, config={**GPT.config, "dropout": 0.1})  # recompute must replay the RNG


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _train(spec, modes, *, steps=3, tmp_path=None, device="cpu", **kwargs):
    """(losses, grads per step, final params, manager) of `steps` AdamW steps, with a manager when
    modes is not None."""
    model = build_model(spec, seed=0, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = None
    if modes is not None:
        manager = ActivationManager(model, modes, nvme_dir=tmp_path, record_events=True, **kwargs)
    losses, grads = [], []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # dropout masks: the same draws in every run
        loss = _loss(model(**make_batch(spec, seed=step, device=device)))
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return losses, grads, [p.detach().clone() for p in model.parameters()], manager


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=1e-6, atol=0), (x - y).abs().max()


@pytest.mark.parametrize("spec,modes", [
    (GPT, [KEEP, RECOMPUTE, SWAP_HOST, SWAP_NVME]),
    (GPT, [SWAP_NVME, SWAP_HOST, RECOMPUTE, KEEP]),
    (HF, [RECOMPUTE, SWAP_HOST]),
    (HF, [SWAP_NVME, RECOMPUTE]),
    (GPT_DROPOUT, [RECOMPUTE, SWAP_HOST, RECOMPUTE, SWAP_NVME]),
], ids=["gpt-mixed", "gpt-mixed-reversed", "hf-recompute-host", "hf-nvme-recompute", "gpt-dropout"])
def test_any_mix_of_modes_trains_like_plain_pytorch(spec, modes, tmp_path):
    ref_losses, ref_grads, ref_params, _ = _train(spec, None)
    losses, grads, params, manager = _train(spec, modes, tmp_path=tmp_path)
    try:
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
        for g, rg in zip(grads, ref_grads, strict=True):
            _assert_same(g, rg)
        _assert_same(params, ref_params)
        stats = manager.stats()
        for i, mode in enumerate(modes):
            swapped = mode in (SWAP_HOST, SWAP_NVME)
            assert stats.offloaded_bytes_per_block[i] == (stats.saved_bytes_per_block[i] if swapped else 0)
            assert stats.reloaded_bytes_per_block[i] == stats.offloaded_bytes_per_block[i]
        assert stats.live_bytes == 0  # everything released once backward is over
    finally:
        manager.close()


def test_swapped_bytes_per_block_are_the_recorders_activation_bytes(tmp_path):
    from executor.recorder import record

    trace = record(build_model(GPT, seed=0), make_batch(GPT), model_name="gpt-small", timing_iterations=1)
    per_block = collections.Counter()
    for a in trace.activations:
        per_block[a.block] += a.bytes
    model = build_model(GPT, seed=0)
    modes = [SWAP_HOST, SWAP_NVME, SWAP_HOST, SWAP_NVME]
    with ActivationManager(model, modes, nvme_dir=tmp_path) as manager:
        model(**make_batch(GPT)).backward()
        stats = manager.stats()
    expected = tuple(per_block[b] for b in range(len(modes)))
    assert stats.saved_bytes_per_block == expected
    assert stats.offloaded_bytes_per_block == expected
    assert stats.reloaded_bytes_per_block == expected
    host, nvme = expected[0] + expected[2], expected[1] + expected[3]
    assert stats.offloaded_bytes == {Tier.HOST: host, Tier.NVME: nvme}
    assert stats.reloaded_bytes == {Tier.HOST: host, Tier.NVME: nvme}
    # the planner's channels: an NVME swap crosses D2H then NVME_WRITE, and back NVME_READ then H2D
    assert stats.bytes_per_channel == {Channel.D2H: host + nvme, Channel.H2D: host + nvme,
                                       Channel.NVME_WRITE: nvme, Channel.NVME_READ: nvme}


def test_bytes_equal_the_shipped_gpt_small_trace_and_so_the_schedules_act_offload_bytes(tmp_path):
    """The planner's ACT_OFFLOAD/ACT_RELOAD bytes are `trace.block_activation_bytes()`, and RECOMPUTE
    keeps `trace.blocks[b].input_bytes`."""
    from schemas.trace import Trace

    path = TRACES / "gpt-small.msgpack"
    if not path.exists():
        pytest.skip("traces/gpt-small.msgpack not shipped")
    trace = Trace.read(path)
    spec = model_spec("gpt-small")
    assert trace.meta.batch_shape == (spec.batch, spec.seq)
    model = build_model(spec, seed=0)
    with ActivationManager(model, [SWAP_HOST, SWAP_NVME, RECOMPUTE, KEEP], nvme_dir=tmp_path) as manager:
        model(**make_batch(spec)).backward()
        stats = manager.stats()
    expected = trace.block_activation_bytes()
    assert stats.offloaded_bytes_per_block[:2] == tuple(expected[:2])
    assert stats.reloaded_bytes_per_block[:2] == tuple(expected[:2])
    assert stats.saved_bytes_per_block[3] == expected[3]
    assert stats.saved_bytes_per_block[2] == trace.blocks[2].input_bytes


def test_recompute_keeps_only_the_block_input():
    model = build_model(GPT, seed=0)
    with ActivationManager(model, [RECOMPUTE] * 4) as manager:
        model(**make_batch(GPT)).backward()
        stats = manager.stats()
    input_bytes = GPT.batch * GPT.seq * GPT.config["n_embd"] * 4  # (B, T, C) fp32
    assert stats.saved_bytes_per_block == (input_bytes,) * 4
    assert stats.offloaded_bytes == {Tier.HOST: 0, Tier.NVME: 0}


def test_swap_and_recompute_lower_the_peak_of_live_activation_bytes(tmp_path):
    peaks = {}
    for name, modes in {"keep": [KEEP] * 4, "recompute": [RECOMPUTE] * 4, "host": [SWAP_HOST] * 4,
                        "nvme": [SWAP_NVME] * 4, "mixed": [SWAP_HOST, RECOMPUTE, SWAP_NVME, KEEP]}.items():
        *_, manager = _train(GPT, modes, steps=1, tmp_path=tmp_path)
        peaks[name] = manager.stats().peak_live_bytes
        saved = sum(manager.stats().saved_bytes_per_block)
        manager.close()
        if name == "keep":
            assert peaks[name] == saved  # every block's saved tensors are held until backward
    # a RECOMPUTE block holds only its input: strictly lower whatever the copy worker does
    for name in ("recompute", "mixed"):
        assert peaks[name] < peaks["keep"], peaks
    # a swapped tensor is released when its copy is done; how far the copy worker lags behind the
    # forward depends on the machine's load, so the swap peaks are checked where they are
    # deterministic: once every offload is done, a swapped block holds nothing on DEVICE
    for name, mode in (("host", SWAP_HOST), ("nvme", SWAP_NVME)):
        model = build_model(GPT, seed=0, device="cpu")
        manager = ActivationManager(model, [mode] * 4, nvme_dir=tmp_path, auto_prefetch=False)
        loss = _loss(model(**make_batch(GPT, seed=0, device="cpu")))
        for block in range(4):
            manager.wait_offloaded(block)
        held_after_forward = manager.stats().live_bytes
        loss.backward()
        manager.close()
        assert held_after_forward == 0, (name, held_after_forward, peaks)


def test_reloads_are_prefetched_before_each_blocks_backward(tmp_path):
    *_, manager = _train(GPT, [SWAP_HOST, SWAP_NVME, SWAP_HOST, SWAP_NVME], steps=1, tmp_path=tmp_path)
    events = manager.events
    manager.close()
    n = 4
    for b in range(n):
        prefetch, backward = events.index(("prefetch", b)), events.index(("backward", b))
        assert events.index(("saved", n - 1)) < prefetch < backward  # after the forward, before its backward
        if b < n - 1:
            # block b comes back while block b+1 runs its backward (Fuyou §4.4), not all at once
            assert events.index(("backward", b + 1)) < prefetch
    assert events.count(("wait", 0)) <= 1


def test_explicit_prefetch_without_auto_prefetch_trains_the_same(tmp_path):
    ref_losses, _, ref_params, _ = _train(GPT, None, steps=2)
    model = build_model(GPT, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with ActivationManager(model, [SWAP_HOST] * 4, auto_prefetch=False, record_events=True) as manager:
        for step in range(2):
            loss = model(**make_batch(GPT, seed=step))
            manager.prefetch(3)  # what the engine does at the schedule's ACT_RELOAD moments
            manager.prefetch(3)  # idempotent
            loss.backward()  # blocks 0..2 are reloaded on demand by their unpacks
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        assert [e for e in manager.events if e[0] == "prefetch"] == [("prefetch", 3)] * 2
        assert manager.stats().reloaded_bytes_per_block == manager.stats().offloaded_bytes_per_block
    assert losses == ref_losses
    _assert_same([p.detach() for p in model.parameters()], ref_params)


def test_alias_pack_stores_params_as_tokens(tmp_path):
    ref_losses, ref_grads, _, _ = _train(GPT, None, steps=1)
    model = build_model(GPT, seed=0)
    by_storage = {p.untyped_storage()._cdata: name for name, p in model.named_parameters()}
    params = dict(model.named_parameters())
    packed, unpacked = [], []

    def alias_pack(t):
        name = by_storage.get(t.untyped_storage()._cdata)
        if name is not None:
            packed.append(name)
            return (name, t.storage_offset(), t.size(), t.stride())
        return None

    def alias_unpack(token):
        name, offset, size, stride = token
        unpacked.append(name)
        return params[name].detach().as_strided(size, stride, offset)

    with ActivationManager(model, [SWAP_HOST, RECOMPUTE, SWAP_NVME, KEEP], nvme_dir=tmp_path,
                           alias_pack=alias_pack, alias_unpack=alias_unpack) as manager:
        loss = model(**make_batch(GPT, seed=0))
        loss.backward()
        saved = manager.stats().saved_bytes_per_block
    assert loss.item() == ref_losses[0]
    _assert_same([p.grad for p in model.parameters()], ref_grads[0])
    assert packed and sorted(packed) == sorted(unpacked)
    assert all(name.startswith(("h.0.", "h.1.", "h.2.", "h.3.")) for name in packed)
    # params are never counted as activations: the bytes are the same as without aliasing
    *_, plain = _train(GPT, [SWAP_HOST, RECOMPUTE, SWAP_NVME, KEEP], steps=1, tmp_path=tmp_path)
    assert plain.stats().saved_bytes_per_block == saved
    plain.close()


def test_nvme_files_are_removed_on_close(tmp_path):
    *_, manager = _train(GPT, [SWAP_NVME, KEEP, SWAP_NVME, SWAP_HOST], steps=1, tmp_path=tmp_path)
    files = manager.nvme_files()
    assert len(files) == 2 and all(f.exists() and f.parent == manager.nvme_dir for f in files)
    assert manager.nvme_dir.parent == tmp_path
    manager.close()
    manager.close()  # idempotent
    assert not manager.nvme_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_failing_copy_worker_raises_executor_error(monkeypatch, tmp_path):
    def broken(dst, src):
        raise RuntimeError("simulated DMA failure")

    # the offload fails during forward: the block's post_forward reports it (or its unpack, if later)
    model = build_model(GPT, seed=0)
    with ActivationManager(model, [KEEP, SWAP_HOST, KEEP, KEEP]) as manager:
        monkeypatch.setattr(activations, "_copy_bytes", broken)
        with pytest.raises(ExecutorError, match=r"block 1 \('h.1'\).*copy worker: RuntimeError: simulated DMA"):
            model(**make_batch(GPT)).backward()
        monkeypatch.undo()
        assert manager.blocks[1].state in (BlockState.SAVED, BlockState.BACKWARD)

    # the reload fails during backward: the unpack raises, autograd passes it on
    model = build_model(GPT, seed=0)
    with ActivationManager(model, [KEEP, KEEP, SWAP_NVME, KEEP], nvme_dir=tmp_path) as manager:
        loss = model(**make_batch(GPT))
        manager.wait_offloaded(2)
        monkeypatch.setattr(activations, "_copy_bytes", broken)
        with pytest.raises(ExecutorError, match=r"block 2 .*the reload .*SWAP_NVME.*simulated DMA"):
            loss.backward()
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_nvme_dir_is_one_clear_error(tmp_path):
    with pytest.raises(ExecutorError, match="nvme_dir"):
        ActivationManager(build_model(GPT), [SWAP_NVME] * 4, nvme_dir=tmp_path / "missing" / "dir")
    with pytest.raises(ExecutorError, match="no nvme_dir was given"):
        ActivationManager(build_model(GPT), [SWAP_NVME] * 4)


def test_bad_plans_are_refused_before_touching_the_model():
    model = build_model(GPT)
    with pytest.raises(ExecutorError, match="3 modes for 4 blocks"):
        ActivationManager(model, [KEEP] * 3)
    with pytest.raises(ExecutorError, match=r"modes given for \['h.9'\]"):
        ActivationManager(model, {"h.9": RECOMPUTE})
    with pytest.raises(ExecutorError, match="alias_pack and alias_unpack together"):
        ActivationManager(model, [KEEP] * 4, alias_pack=lambda t: None)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_from_plans_and_mapping_select_the_same_modes():
    model = build_model(GPT)
    plans = [ActivationPlan(block=i, module=f"h.{i}", mode=m, bytes=0, input_bytes=0, recompute_seconds=0.0,
                            recompute_flops=0) for i, m in enumerate([RECOMPUTE, KEEP, SWAP_HOST, KEEP])]
    with ActivationManager.from_plans(model, plans) as a:
        assert a.modes == (RECOMPUTE, KEEP, SWAP_HOST, KEEP)
    with ActivationManager(model, {"h.0": RECOMPUTE, "h.2": SWAP_HOST}) as b:
        assert b.modes == (RECOMPUTE, KEEP, SWAP_HOST, KEEP)
        b.prefetch(1)  # a KEEP block: nothing to bring back, no state change
        assert b.blocks[1].state is BlockState.IDLE


def test_eval_forward_under_no_grad_saves_nothing(tmp_path):
    model = build_model(GPT, seed=0)
    with ActivationManager(model, [RECOMPUTE, SWAP_HOST, SWAP_NVME, KEEP], nvme_dir=tmp_path) as manager:
        with torch.no_grad():
            model(**make_batch(GPT))
        assert manager.stats().saved_bytes_per_block == (0, 0, 0, 0)
        model(**make_batch(GPT)).backward()  # and training goes on afterwards
        assert all(manager.stats().saved_bytes_per_block)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned HOST, side stream, events)")
def test_cuda_swap_and_recompute_train_like_plain_pytorch(tmp_path):
    modes = [SWAP_HOST, RECOMPUTE, SWAP_NVME, KEEP]
    ref_losses, ref_grads, ref_params, _ = _train(GPT, None, device="cuda")
    losses, grads, params, manager = _train(GPT, modes, tmp_path=tmp_path, device="cuda")
    try:
        assert losses == ref_losses
        for g, rg in zip(grads, ref_grads, strict=True):
            _assert_same(g, rg)
        _assert_same(params, ref_params)
        stats = manager.stats()
        assert stats.offloaded_bytes_per_block[0] == stats.saved_bytes_per_block[0] > 0
        assert stats.reloaded_bytes_per_block[2] == stats.saved_bytes_per_block[2] > 0
        assert stats.live_bytes == 0
    finally:
        manager.close()


@pytest.mark.parametrize("manager_first", [True, False])
def test_moment_events_and_an_outer_pack_hook_are_unchanged_by_the_manager(tmp_path, manager_first):
    """What the engine sees: the same moment sequence (recomputation fires nothing), and its own
    saved-tensor hooks (pushed around the whole forward) still see every save outside the blocks;
    whichever hooks are registered first."""
    from executor.hooks import MomentHooks, find_blocks, find_units

    def run(modes):
        model = build_model(GPT, seed=0)
        blocks = find_blocks(model)
        events, outer = [], []
        hooks = MomentHooks(model, blocks=blocks, units=find_units(model, blocks), on_event=events.append)
        if not manager_first:
            hooks.install()
        manager = ActivationManager(model, modes, nvme_dir=tmp_path) if modes else None
        hooks.install()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: outer.append(t.shape) or t, lambda t: t):
            loss = model(**make_batch(GPT))
        loss.backward()
        hooks.remove()
        if manager is not None:
            manager.close()
        return events, outer, loss.item(), [p.grad for p in model.parameters()]

    plain_events, plain_outer, plain_loss, plain_grads = run(None)
    events, outer, loss, grads = run([RECOMPUTE, SWAP_HOST, SWAP_NVME, KEEP])
    assert events == plain_events
    assert 0 < len(outer) < len(plain_outer)  # the blocks' saves went to the manager, the rest to the outer hook
    assert loss == plain_loss
    _assert_same(grads, plain_grads)


# ----------------------------------------------------------------------- offloaded recompute checkpoints


@pytest.mark.parametrize("spec,modes,tiers", [
    (GPT, [RECOMPUTE, RECOMPUTE, RECOMPUTE, KEEP], {0: Tier.HOST, "h.1": Tier.NVME}),
    (GPT_DROPOUT, [RECOMPUTE, SWAP_HOST, RECOMPUTE, RECOMPUTE], {0: Tier.HOST, 2: Tier.HOST, 3: Tier.NVME}),
    (HF, [RECOMPUTE, RECOMPUTE], {0: Tier.HOST, 1: Tier.HOST}),
], ids=["gpt-host-nvme", "gpt-dropout", "hf-shared-mask"])
def test_offloaded_checkpoints_train_like_plain_pytorch(spec, modes, tiers, tmp_path):
    ref_losses, ref_grads, ref_params, _ = _train(spec, None)
    losses, grads, params, manager = _train(spec, modes, tmp_path=tmp_path, checkpoint_tiers=tiers)
    try:
        assert losses == ref_losses
        for g, rg in zip(grads, ref_grads, strict=True):
            _assert_same(g, rg)
        _assert_same(params, ref_params)
        stats = manager.stats()
        names = [b.name for b in manager.blocks]
        offloaded = {i if isinstance(i, int) else names.index(i) for i in tiers}
        assert set(manager.checkpoint_tiers) == offloaded
        for i, mode in enumerate(modes):
            swapped = mode is SWAP_HOST or i in offloaded
            assert stats.offloaded_bytes_per_block[i] == (stats.saved_bytes_per_block[i] if swapped else 0)
            assert stats.reloaded_bytes_per_block[i] == stats.offloaded_bytes_per_block[i]
        nvme = sum(stats.saved_bytes_per_block[i] for i in offloaded if manager.checkpoint_tiers[i] is Tier.NVME)
        assert stats.offloaded_bytes[Tier.NVME] == stats.bytes_per_channel[Channel.NVME_WRITE] == nvme
        assert stats.live_bytes == 0
    finally:
        manager.close()


def test_an_offloaded_checkpoint_is_off_device_from_the_forward_to_its_reload(tmp_path):
    model = build_model(GPT, seed=0)
    input_bytes = GPT.batch * GPT.seq * GPT.config["n_embd"] * 4  # (B, T, C) fp32
    with ActivationManager(model, [RECOMPUTE] * 4, checkpoint_tiers={1: Tier.HOST, 2: Tier.NVME}, nvme_dir=tmp_path,
                           auto_prefetch=False, record_events=True) as manager:
        loss = model(**make_batch(GPT))
        for block in range(4):
            manager.wait_offloaded(block)
        assert manager.live_bytes == 2 * input_bytes  # blocks 0 and 3 keep their inputs, 1 and 2 hold nothing
        manager.prefetch(2)  # the schedule's ACT_RELOAD, before the block's backward
        manager.prefetch(2)  # idempotent
        loss.backward()  # block 1 is reloaded on demand by its recomputation
        stats = manager.stats()
        assert stats.saved_bytes_per_block == (input_bytes,) * 4
        assert stats.offloaded_bytes_per_block == stats.reloaded_bytes_per_block == (0, input_bytes, input_bytes, 0)
        assert stats.bytes_per_channel == {Channel.D2H: 2 * input_bytes, Channel.H2D: 2 * input_bytes,
                                           Channel.NVME_WRITE: input_bytes, Channel.NVME_READ: input_bytes}
        assert [e for e in manager.events if e[0] == "prefetch"] == [("prefetch", 2)]
        assert manager.live_bytes == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec", [HF, model_spec("hf-llama-tiny")], ids=["hf-gpt2", "hf-llama"])
def test_offloaded_checkpoint_bytes_are_the_recorders_input_bytes(spec):
    """HF GPT-2 passes every block the same attention mask and position_ids (a keyword), Llama the
    rotary (cos, sin) as a keyword tuple: each offloaded checkpoint moves all of its inputs, its own
    copy -- the recorder's `input_bytes` -- and recomputes from them exactly."""
    from executor.recorder import record

    trace = record(build_model(spec, seed=0), make_batch(spec), model_name=spec.family, timing_iterations=1)
    ref = build_model(spec, seed=0)
    _loss(ref(**make_batch(spec))).backward()
    model = build_model(spec, seed=0)
    with ActivationManager(model, [RECOMPUTE, RECOMPUTE], checkpoint_tiers={0: Tier.HOST, 1: Tier.HOST}) as manager:
        _loss(model(**make_batch(spec))).backward()
        stats = manager.stats()
    expected = tuple(b.input_bytes for b in trace.blocks)
    assert stats.offloaded_bytes_per_block == stats.reloaded_bytes_per_block == expected
    hidden = spec.batch * spec.seq * spec.config.get("n_embd", spec.config.get("hidden_size", 0)) * 4
    assert expected[0] == expected[1] > hidden  # more than the hidden state: the shared inputs too
    _assert_same([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


def test_a_failing_checkpoint_offload_raises_executor_error(monkeypatch):
    def broken(dst, src):
        raise RuntimeError("simulated DMA failure")

    model = build_model(GPT, seed=0)
    with ActivationManager(model, [KEEP, RECOMPUTE, KEEP, KEEP], checkpoint_tiers={1: Tier.HOST}):
        monkeypatch.setattr(activations, "_copy_bytes", broken)
        with pytest.raises(ExecutorError, match=r"block 1 \('h.1'\).*RECOMPUTE checkpoint\).*simulated DMA"):
            model(**make_batch(GPT)).backward()
        monkeypatch.undo()


def test_bad_checkpoint_tiers_are_refused(tmp_path):
    model = build_model(GPT)
    with pytest.raises(ExecutorError, match=r"block 1 \('h.1'\), which is KEEP, not RECOMPUTE"):
        ActivationManager(model, [RECOMPUTE, KEEP, KEEP, KEEP], checkpoint_tiers={1: Tier.HOST})
    with pytest.raises(ExecutorError, match="names block 'h.7'"):
        ActivationManager(model, [RECOMPUTE] * 4, checkpoint_tiers={"h.7": Tier.HOST})
    with pytest.raises(ExecutorError, match="offloaded to DEVICE; expected HOST or NVME"):
        ActivationManager(model, [RECOMPUTE] * 4, checkpoint_tiers={0: Tier.DEVICE})
    with pytest.raises(ExecutorError, match="no nvme_dir was given"):
        ActivationManager(model, [RECOMPUTE] * 4, checkpoint_tiers={0: Tier.NVME})
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned HOST, side stream, events)")
def test_cuda_offloaded_checkpoints_train_like_plain_pytorch(tmp_path):
    modes, tiers = [RECOMPUTE, SWAP_HOST, RECOMPUTE, RECOMPUTE], {0: Tier.HOST, 3: Tier.NVME}
    ref_losses, ref_grads, ref_params, _ = _train(GPT, None, device="cuda")
    losses, grads, params, manager = _train(GPT, modes, tmp_path=tmp_path, device="cuda", checkpoint_tiers=tiers)
    try:
        assert losses == ref_losses
        for g, rg in zip(grads, ref_grads, strict=True):
            _assert_same(g, rg)
        _assert_same(params, ref_params)
        stats = manager.stats()
        for b in (0, 3):
            assert stats.offloaded_bytes_per_block[b] == stats.reloaded_bytes_per_block[b]
            assert stats.offloaded_bytes_per_block[b] == stats.saved_bytes_per_block[b] > 0
        assert stats.offloaded_bytes_per_block[2] == 0 and stats.live_bytes == 0
    finally:
        manager.close()
