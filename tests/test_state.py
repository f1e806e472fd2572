"""executor.state: plain PyTorch state dicts from chunks, both ways, and atomic checkpoint files."""

from __future__ import annotations

import copy

import pytest
import torch

from executor import state
from executor.optim import ChunkAdamW, DynamicLossScaler
from schemas.schedule import ChunkList
from schemas.trace import DType
from test_optim_support import FakeStore, TinyLM, bind, grads_to_chunks, layout_for, lm_loss, param_groups


def _batches(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 37, (3, 9), generator=g) for _ in range(n)]


def _chunk_train(model, opt, store, batches) -> None:
    has_master = ChunkList.MASTER in store.layout.lists
    for batch in batches:
        lm_loss(model, batch).backward()
        skipped = grads_to_chunks(model, store)
        for c in opt.chunks:
            opt.step_chunk(c, param=store.buffers[(ChunkList.PARAM, c)], grad=store.buffers[(ChunkList.GRAD, c)],
                           master=store.buffers[(ChunkList.MASTER, c)] if has_master else None,
                           exp_avg=store.buffers[(ChunkList.M, c)], exp_avg_sq=store.buffers[(ChunkList.V, c)],
                           skip_tensors=skipped)


def _plain_train(model, opt, batches) -> None:
    for batch in batches:
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()


def _chunk_form(template: TinyLM, chunk_elements: int = 150):
    model = copy.deepcopy(template)
    layout = layout_for(model, chunk_elements=chunk_elements, reverse=True)
    store = FakeStore(layout)
    bind(model, store)
    opt = ChunkAdamW(param_groups(model), layout, model=model)
    return model, store, opt


def test_plain_trained_then_loaded_into_chunks_continues_identically(tmp_path) -> None:
    torch.manual_seed(0)
    plain = TinyLM()
    fresh = copy.deepcopy(plain)
    plain.mask.fill_(0.5)  # a buffer that must travel with the model state
    plain_opt = torch.optim.AdamW(param_groups(plain), fused=True)
    _plain_train(plain, plain_opt, _batches(3, seed=1))
    torch.save({"model": plain.state_dict(), "optimizer": plain_opt.state_dict()}, tmp_path / "plain.pt")

    model, store, opt = _chunk_form(fresh)
    saved = torch.load(tmp_path / "plain.pt", weights_only=True)
    state.load_model_state_dict(store, saved["model"], model)
    state.load_optimizer_state_dict(store, opt, saved["optimizer"])
    assert model.mask[0] == 0.5
    assert opt.step_count(model.fc1.weight) == 3 and opt.step_count(model.unused) == 0

    more = _batches(3, seed=2)
    _plain_train(plain, plain_opt, more)
    _chunk_train(model, opt, store, more)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_chunks_saved_then_loaded_into_plain_torch_continue_identically(tmp_path) -> None:
    torch.manual_seed(0)
    template = TinyLM()
    model, store, opt = _chunk_form(template)
    _chunk_train(model, opt, store, _batches(3, seed=3))
    path = tmp_path / "ckpt.pt"
    state.save(path, store, model=model, optimizer=opt, extra={"iteration": 3})
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]  # no temp file left behind

    ckpt = torch.load(path, weights_only=True)
    # tied weights: every name, one tensor object (stored once)
    assert ckpt["model"]["emb.weight"].data_ptr() == ckpt["model"]["head.weight"].data_ptr()
    plain = copy.deepcopy(template)
    plain.load_state_dict(ckpt["model"], strict=True)
    plain_opt = torch.optim.AdamW(param_groups(plain), fused=True)
    plain_opt.load_state_dict(ckpt["optimizer"])
    assert ckpt["extra"]["iteration"] == 3

    # and the chunk form restored from the same file into a fresh store
    model2, store2, opt2 = _chunk_form(template)
    state.restore(state.load(path), store2, model=model2, optimizer=opt2)

    more = _batches(3, seed=4)
    _plain_train(plain, plain_opt, more)
    _chunk_train(model, opt, store, more)
    _chunk_train(model2, opt2, store2, more)
    for (name, p), q, r in zip(plain.named_parameters(), model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), name


def test_round_trip_of_every_list_and_group_hyperparameters() -> None:
    torch.manual_seed(0)
    template = TinyLM().to(torch.bfloat16)
    model = copy.deepcopy(template)
    layout = layout_for(model, chunk_elements=128, compute=DType.BFLOAT16)
    store = FakeStore(layout)
    bind(model, store)
    opt = ChunkAdamW(param_groups(model), layout, model=model)
    _chunk_train(model, opt, store, _batches(2, seed=5))
    opt.param_groups[1]["lr"] = 0.123
    scaler = DynamicLossScaler(init_scale=4.0)
    ckpt = {"format": state.CHECKPOINT_FORMAT, "model": state.model_state_dict(store, model),
            "optimizer": state.optimizer_state_dict(store, opt), "master": state.master_state_dict(store),
            "loss_scaler": scaler.state_dict()}
    assert ckpt["model"]["fc1.weight"].dtype == torch.bfloat16 and ckpt["master"]["fc1.weight"].dtype == torch.float32
    assert not torch.equal(ckpt["master"]["fc1.weight"].bfloat16().float(), ckpt["master"]["fc1.weight"])  # masters carry more bits

    model2 = copy.deepcopy(template)
    store2 = FakeStore(layout)
    bind(model2, store2)
    opt2 = ChunkAdamW(param_groups(model2), layout, model=model2)
    scaler2 = DynamicLossScaler()
    state.restore(ckpt, store2, model=model2, optimizer=opt2, loss_scaler=scaler2)
    for lst in (ChunkList.PARAM, ChunkList.MASTER, ChunkList.M, ChunkList.V):
        for c in layout.chunks:
            assert torch.equal(store.buffers[(lst, c.id)], store2.buffers[(lst, c.id)]), (lst, c.id)
    assert opt2.param_groups[1]["lr"] == 0.123 and scaler2.scale == 4.0
    assert opt2.step_count(model2.fc2.weight) == 2


def test_bad_state_is_one_clear_error(tmp_path) -> None:
    torch.manual_seed(0)
    model, store, opt = _chunk_form(TinyLM())
    sd = state.model_state_dict(store, model)
    with pytest.raises(state.StateError, match=r"missing \['fc1.weight'\]"):
        state.load_model_state_dict(store, {k: v for k, v in sd.items() if k != "fc1.weight"}, model)
    with pytest.raises(state.StateError, match="unexpected"):
        state.load_model_state_dict(store, {**sd, "extra.weight": torch.zeros(1)}, model)
    with pytest.raises(state.StateError, match="shape"):
        state.load_model_state_dict(store, {**sd, "fc1.weight": torch.zeros(3, 3)}, model)
    with pytest.raises(state.StateError, match="group sizes"):
        state.load_optimizer_state_dict(store, opt, {"state": {}, "param_groups": [{"params": [0]}]})
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(state.StateError, match="junk.pt"):
        state.load(tmp_path / "junk.pt")
    with pytest.raises(state.StateError, match="no such file"):
        state.load(tmp_path / "missing.pt")
