"""ChunkAdamW over flat chunks == torch.optim.AdamW(fused=True) on the plain model."""

from __future__ import annotations

import copy

import pytest
import torch

from executor import optim
from executor.optim import ChunkAdam, ChunkAdamW, DynamicLossScaler, clip_coefficient
from schemas.schedule import ChunkList
from schemas.trace import DType
from test_optim_support import FakeStore, TinyLM, bind, grads_to_chunks, layout_for, lm_loss, param_groups


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 37, (3, 9), generator=g) for _ in range(n)]


def _step_all(opt: ChunkAdamW, store: FakeStore, **kwargs) -> None:
    has_master = ChunkList.MASTER in store.layout.lists
    for c in opt.chunks:
        opt.step_chunk(c, param=store.buffers[(ChunkList.PARAM, c)], grad=store.buffers[(ChunkList.GRAD, c)],
                       master=store.buffers[(ChunkList.MASTER, c)] if has_master else None,
                       exp_avg=store.buffers[(ChunkList.M, c)], exp_avg_sq=store.buffers[(ChunkList.V, c)], **kwargs)


def _pair(chunk_elements: int = 200, reverse: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    ref = TinyLM()
    model = copy.deepcopy(ref)
    layout = layout_for(model, chunk_elements=chunk_elements, reverse=reverse)
    store = FakeStore(layout)
    bind(model, store)
    return ref, model, layout, store


@pytest.mark.parametrize("adam_cls,torch_cls", [(ChunkAdamW, torch.optim.AdamW), (ChunkAdam, torch.optim.Adam)])
def test_bit_identical_to_fused_torch_with_groups_and_scheduler(adam_cls, torch_cls) -> None:
    ref, model, layout, store = _pair()
    assert len(layout.chunks) > 3  # several chunks, one tensor larger than a chunk
    ref_opt = torch_cls(param_groups(ref), fused=True, betas=(0.8, 0.95), eps=1e-7)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=[3e-2, 1e-2], total_steps=20)
    opt = adam_cls(param_groups(model), layout, model=model, betas=(0.8, 0.95), eps=1e-7)
    if adam_cls is ChunkAdam:  # Adam's L2 decay path
        for g, rg in zip(opt.param_groups, ref_opt.param_groups):
            g["weight_decay"] = rg["weight_decay"] = 0.05
    opt.set_step_driver(lambda: _step_all(opt, store, skip_tensors=skipped))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[3e-2, 1e-2], total_steps=20)
    for batch in _batches(6):
        lm_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        lm_loss(model, batch).backward()
        skipped = grads_to_chunks(model, store)
        opt.step()
        sched.step()
    assert skipped == {layout.tensors[[s.names for s in layout.tensors].index(("unused",))].tensor}
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), name
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != 3e-3
    # steps per param as torch keeps them (the unused param never stepped)
    assert opt.step_count(model.fc1.weight) == 6 and opt.step_count(model.unused) == 0
    assert model.unused.data.equal(ref.unused.data)


def test_chunk_order_does_not_matter_and_fp32_master_none_updates_param_in_place() -> None:
    ref, model, layout, store = _pair(chunk_elements=97, reverse=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = ChunkAdamW(model.parameters(), layout, model=model, lr=1e-2)
    for batch in _batches(3, seed=1):
        lm_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        lm_loss(model, batch).backward()
        skipped = grads_to_chunks(model, store)
        for c in reversed(opt.chunks):  # backward order, as the overlapped CPU optimizer runs
            opt.step_chunk(c, param=store.buffers[(ChunkList.PARAM, c)], grad=store.buffers[(ChunkList.GRAD, c)],
                           master=None, exp_avg=store.buffers[(ChunkList.M, c)],
                           exp_avg_sq=store.buffers[(ChunkList.V, c)], skip_tensors=skipped)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    # the moments live in the chunks, in torch's layout
    slot = next(s for s in layout.tensors if s.names[0] == "fc1.weight")
    assert torch.equal(store.slot_view(ChunkList.M, slot), ref_opt.state[ref.fc1.weight]["exp_avg"])
    assert torch.equal(store.slot_view(ChunkList.V, slot), ref_opt.state[ref.fc1.weight]["exp_avg_sq"])


@pytest.mark.parametrize("tile_elements", [optim.CPU_TILE_ELEMENTS, 150])
def test_bf16_mixed_precision_matches_reference_master_loop(tile_elements: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 150-element tiles cut the larger tensors at multiples of 64 elements and put pieces of several
    # tensors in one tile
    # (Note [mixed-precision steps in tiles]): still bit-identical to the reference loop
    monkeypatch.setattr(optim, "CPU_TILE_ELEMENTS", tile_elements)
    torch.manual_seed(0)
    ref = TinyLM().to(torch.bfloat16)
    model = copy.deepcopy(ref)
    layout = layout_for(model, chunk_elements=300, compute=DType.BFLOAT16)
    store = FakeStore(layout)
    bind(model, store)
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    opt = ChunkAdamW(model.parameters(), layout, model=model, lr=1e-2)
    for batch in _batches(4, seed=2):
        lm_loss(ref, batch).backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        lm_loss(model, batch).backward()
        skipped = grads_to_chunks(model, store)
        _step_all(opt, store, skip_tensors=skipped)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(p, q)
    slot = next(s for s in layout.tensors if s.names[0] == "fc2.weight")
    assert torch.equal(store.slot_view(ChunkList.MASTER, slot), masters[[n for n, _ in ref.named_parameters()].index("fc2.weight")])


def test_tiles_cover_every_element_once_in_order() -> None:
    entries = [optim.ChunkEntry(param=torch.nn.Parameter(torch.zeros(n * 64)), tensor=i, offset=o * 64, numel=n * 64)
               for i, (o, n) in enumerate([(0, 5), (5, 16), (24, 1), (25, 9)])]
    tiles = list(optim._tiles(entries, 7 * 64 + 10))  # cuts inside a tensor land on multiples of 64 elements
    assert [[(e.tensor, a // 64, n / 64) for e, a, n in t] for t in tiles] == [
        [(0, 0, 5), (1, 0, 2)], [(1, 2, 7)], [(1, 9, 7)], [(2, 0, 1), (3, 0, 6)], [(3, 6, 3)]]
    flat = [(e.offset + a + i) for t in tiles for e, a, n in t for i in range(n)]
    assert flat == [o for e in entries for o in range(e.offset, e.offset + e.numel)]
    assert list(optim._tiles(entries, None)) == [[(e, 0, e.numel) for e in entries]]


def test_grad_scale_and_found_inf_match_gradscaler() -> None:
    ref, model, layout, store = _pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    opt = ChunkAdamW(model.parameters(), layout, model=model, lr=1e-2)
    mine = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    for i, batch in enumerate(_batches(5, seed=3)):
        poison = i == 2  # an overflow at step 2: skipped, scale halved
        loss = lm_loss(ref, batch)
        scaler.scale(loss * (float("inf") if poison else 1.0)).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        loss = lm_loss(model, batch)
        mine.scale_loss(loss * (float("inf") if poison else 1.0)).backward()
        skipped = grads_to_chunks(model, store)
        for c in opt.chunks:
            mine.check(store.buffers[(ChunkList.GRAD, c)])
        found = mine.found_inf()
        assert found == poison
        if not found:
            _step_all(opt, store, grad_scale=mine.inv_scale, skip_tensors=skipped)
        mine.update(found)
        assert mine.scale == scaler.get_scale()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert opt.step_count(model.fc1.weight) == ref_opt.state[ref.fc1.weight]["step"].item() == 4


def test_found_inf_tensor_leaves_state_unchanged() -> None:
    _, model, layout, store = _pair()
    opt = ChunkAdamW(model.parameters(), layout, model=model)
    lm_loss(model, _batches(1)[0]).backward()
    grads_to_chunks(model, store)
    before = {k: v.clone() for k, v in store.buffers.items()}
    _step_all(opt, store, found_inf=torch.ones(()))
    assert all(torch.equal(before[k], v) for k, v in store.buffers.items())
    assert opt.step_count(model.fc1.weight) == 0


def test_global_clipping_across_chunks_matches_clip_grad_norm() -> None:
    ref, model, layout, store = _pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = ChunkAdamW(model.parameters(), layout, model=model, lr=1e-2)
    for batch in _batches(4, seed=4):
        lm_loss(ref, batch).backward()
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        lm_loss(model, batch).backward()
        skipped = grads_to_chunks(model, store)
        norms = [opt.grad_norms(c, store.buffers[(ChunkList.GRAD, c)], skip_tensors=skipped) for c in opt.chunks]
        total, coef = clip_coefficient(norms, 0.5)
        assert total == pytest.approx(float(ref_total), rel=1e-6)
        assert coef < 1.0  # clipping is active
        _step_all(opt, store, grad_scale=coef, skip_tensors=skipped)
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


def test_clip_coefficient_inf_norm_and_no_clip() -> None:
    norms = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    assert clip_coefficient(norms, 100.0) == (13.0, 1.0)
    total, coef = clip_coefficient([torch.tensor([1.0, 5.0])], 1.0, norm_type=float("inf"))
    assert total == 5.0 and coef == pytest.approx(1 / (5 + 1e-6))


def test_loss_scaler_growth_and_backoff_follow_gradscaler_rule() -> None:
    s = DynamicLossScaler()
    assert s.scale == 2.0**16
    for _ in range(1999):
        s.update(False)
    assert s.scale == 2.0**16
    s.update(False)
    assert s.scale == 2.0**17 and s.good_steps == 0
    s.update(True)
    assert s.scale == 2.0**16
    g = torch.tensor([1.0, float("nan")], dtype=torch.float16)
    s.check(torch.ones(3, dtype=torch.float16))
    assert not s.found_inf()
    s.check(g)
    assert s.found_inf() and torch.isnan(g[1])  # grads untouched
    s2 = DynamicLossScaler()
    s2.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
    assert s2.scale == 8.0


def test_bad_inputs_are_clear() -> None:
    _, model, layout, store = _pair()
    with pytest.raises(ValueError, match="no name"):
        ChunkAdamW(model.parameters(), layout)
    with pytest.raises(ValueError, match="not in the schedule's chunk layout"):
        other = torch.nn.Linear(2, 2)
        ChunkAdamW(other.named_parameters(), layout)
    with pytest.raises(ValueError, match="amsgrad"):
        ChunkAdamW(model.parameters(), layout, model=model, amsgrad=True)
    opt = ChunkAdamW(model.parameters(), layout, model=model)
    with pytest.raises(RuntimeError, match="no engine attached"):
        opt.step()
    c = opt.chunks[0]
    with pytest.raises(ValueError, match="float32"):
        opt.step_chunk(c, param=store.buffers[(ChunkList.PARAM, c)].half(), grad=store.buffers[(ChunkList.GRAD, c)],
                       master=None, exp_avg=store.buffers[(ChunkList.M, c)], exp_avg_sq=store.buffers[(ChunkList.V, c)])


def test_named_params_need_no_model() -> None:
    _, model, layout, store = _pair()
    opt = ChunkAdamW(model.named_parameters(), layout)
    assert len(opt.chunks) == len({s.chunk for s in layout.tensors})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_step_chunk_on_cuda_matches_fused_cuda_adamw() -> None:
    torch.manual_seed(0)
    ref = TinyLM().cuda()
    model = copy.deepcopy(ref)
    layout = layout_for(model, chunk_elements=200)
    bufs = {(lst, c.id): torch.zeros(c.elements, device="cuda") for lst in layout.lists for c in layout.chunks}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    for s in layout.tensors:
        view = bufs[(ChunkList.PARAM, s.chunk)][s.offset_elements:s.offset_elements + s.numel].view(s.shape)
        view.copy_(by_name[s.names[0]].detach())
        by_name[s.names[0]].data = view
    ref_opt = torch.optim.AdamW(param_groups(ref), fused=True)
    opt = ChunkAdamW(param_groups(model), layout, model=model)
    for batch in _batches(3):
        batch = batch.cuda()
        lm_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        lm_loss(model, batch).backward()
        skipped = set()
        for s in layout.tensors:
            p = by_name[s.names[0]]
            g = bufs[(ChunkList.GRAD, s.chunk)][s.offset_elements:s.offset_elements + s.numel]
            if p.grad is None:
                skipped.add(s.tensor)
            else:
                g.copy_(p.grad.reshape(-1))
            p.grad = None
        for c in opt.chunks:
            opt.step_chunk(c, param=bufs[(ChunkList.PARAM, c)], grad=bufs[(ChunkList.GRAD, c)], master=None,
                           exp_avg=bufs[(ChunkList.M, c)], exp_avg_sq=bufs[(ChunkList.V, c)], skip_tensors=skipped)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_a_gpu_steps_a_bf16_chunk_through_a_bounded_fp32_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU the grads are cast in tiles of DEVICE_TILE_ELEMENTS, so the fp32 scratch (GPU memory no
    plan counts) stays that size whatever the chunk (Note [mixed-precision steps in tiles]). On the meta
    device: the shapes and the allocations are real, the numbers are not (tests/test_cuda.py has the bits)."""
    monkeypatch.setattr(optim, "DEVICE_TILE_ELEMENTS", 128)
    model = TinyLM().to(torch.bfloat16)
    layout = layout_for(model, chunk_elements=300, compute=DType.BFLOAT16)
    opt = ChunkAdamW(model.parameters(), layout, model=model, lr=1e-2)
    chunk = max(layout.chunks, key=lambda c: c.elements)
    assert chunk.elements > 2 * 128

    def meta(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(chunk.elements, dtype=dtype, device="meta")

    opt.step_chunk(chunk.id, param=meta(torch.bfloat16), grad=meta(torch.bfloat16), master=meta(torch.float32),
                   exp_avg=meta(torch.float32), exp_avg_sq=meta(torch.float32))
    assert opt._scratch.by_device[torch.device("meta")].numel() <= 128  # in whole passes: the chunk's elements
