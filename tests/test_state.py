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


def _set_path(tree, path, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


@pytest.mark.parametrize(("path", "value", "words"), [
    (("optimizer", "state", 0, "step"), torch.tensor(float("nan")), "state[0].step"),
    (("optimizer", "state", 0, "step"), -3, "whole number >= 0"),
    (("optimizer", "state", 1, "exp_avg"), 7, "state[1].exp_avg: expected a floating-point tensor"),
    (("optimizer", "state", 1), "junk", "state[1]: expected a map"),
    (("optimizer", "param_groups", 0, "lr"), float("nan"), "param_groups[0].lr: expected a finite number >= 0"),
    (("optimizer", "param_groups", 1, "lr"), "fast", "param_groups[1].lr"),
    (("optimizer", "param_groups", 0, "betas"), (1.5, 0.9), "param_groups[0].betas"),
    (("optimizer", "param_groups", 0, "betas"), (), "param_groups[0].betas"),
    (("optimizer", "param_groups", 0, "eps"), float("inf"), "param_groups[0].eps"),
    (("optimizer", "param_groups", 0, "maximize"), 1, "param_groups[0].maximize: expected True or False"),
    (("optimizer", "param_groups", 0, "params"), None, "param_groups[0] has no 'params'"),
    (("model", "fc1.weight"), 3, "'fc1.weight': expected a tensor"),
    (("model",), [1, 2], "checkpoint: model"),
    (("loss_scaler",), {"scale": 0.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5,
                        "_growth_tracker": 0}, "loss_scaler.scale"),
], ids=lambda v: str(v)[:40])
def test_restore_refuses_values_that_cannot_train_before_writing(path, value, words) -> None:
    """A checkpoint whose digest matches (resealed, or built by hand) but holds a NaN step, a NaN lr, an
    int where a tensor belongs...: one StateError line, and the chunks and groups are untouched
    (the checkpoint fuzz of issue 21 reached AttributeError / TypeError inside restore or the kernel)."""
    torch.manual_seed(0)
    model, store, opt = _chunk_form(TinyLM())
    _chunk_train(model, opt, store, _batches(1, seed=3))
    ckpt = {"format": state.CHECKPOINT_FORMAT, "model": state.model_state_dict(store, model),
            "optimizer": state.optimizer_state_dict(store, opt), "loss_scaler": DynamicLossScaler().state_dict()}
    _set_path(ckpt, path, value)
    ckpt["content_digest"] = state.checkpoint_digest(ckpt)
    model2, store2, opt2 = _chunk_form(TinyLM())
    before = {k: v.clone() for k, v in store2.buffers.items()}
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups])
    with pytest.raises(state.StateError) as info:
        state.restore(ckpt, store2, model=model2, optimizer=opt2, loss_scaler=DynamicLossScaler())
    message = str(info.value)
    assert words in message and "\n" not in message, message
    assert all(torch.equal(before[k], store2.buffers[k]) for k in before)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups] == groups_before
