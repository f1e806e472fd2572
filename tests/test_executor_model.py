"""The model stays a model while attached (issue 21): `model.state_dict()` gives the real values,
evaluation between steps leaves the training untouched, drift is refused before anything changes,
and an out-of-memory error of the DEVICE becomes one clear line with nothing lost."""

from __future__ import annotations

import copy

import pytest
import torch

import executor
from executor.errors import ExecutorError
from executor.runtime import EngineState
from schemas.schedule import Tier
from test_executor import LR, WD, bytes_checker, engine_run, gpt_batches, plain_run
from test_executor_planner import MODELS, plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = {"host": dict(), "nvme": dict(nvme=True), "swap-host": dict(swap=True)}


def attached(name: str, variant: str, tmp_path):
    build, _, loss_fn, vocab = MODELS[name]
    schedule = plan(name, **VARIANTS[variant])
    model = build()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)
    return build, loss_fn, vocab, schedule, model, engine


# ----------------------------------------------------------------------------- state_dict while attached

@pytest.mark.parametrize("variant", ["host", "nvme"])
def test_model_state_dict_while_attached_equals_the_engine_checkpoint(variant, tmp_path):
    build, loss_fn, vocab, schedule, model, engine = attached("gpt", variant, tmp_path)
    homes = {r.tiers for r in schedule.initial_residency}
    assert any(Tier.DEVICE not in t for t in homes)  # some params live off DEVICE between steps
    engine_run(engine, model, loss_fn, gpt_batches(3, vocab=vocab))
    assert any(p.numel() == 0 for p in model.parameters())  # placeholders: what state_dict used to return
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    engine.save(tmp_path / "engine.pt")
    fresh = build()
    fresh.load_state_dict(torch.load(tmp_path / "plain.pt"))
    want = torch.load(tmp_path / "engine.pt")["model"]
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, want[name]), name
    sub = model.h[1].state_dict()  # a submodule's state dict too
    assert all(torch.equal(v, want[f"h.1.{k}"]) for k, v in sub.items())


def test_model_state_dict_in_the_middle_of_an_iteration_is_refused(tmp_path):
    _, loss_fn, vocab, _, model, engine = attached("gpt", "host", tmp_path)
    loss = loss_fn(model, gpt_batches(1, vocab=vocab)[0])
    with pytest.raises(ExecutorError, match=r"model.state_dict\(\) between iterations only"):
        model.state_dict()
    loss.backward()
    engine.step()
    assert all(v.numel() for v in model.state_dict().values())


# ----------------------------------------------------------------------------- evaluation between steps

@pytest.mark.parametrize("variant", ["host", "nvme", "swap-host"])
def test_evaluation_every_5_steps_leaves_the_training_identical(variant, tmp_path):
    build, loss_fn, vocab, schedule, model, engine = attached("gpt", variant, tmp_path)
    batches = gpt_batches(12, vocab=vocab)
    held_out = gpt_batches(13, vocab=vocab)[-1]
    ref = build()
    check = bytes_checker(schedule)
    got, plain_eval = [], []
    for i, b in enumerate(batches):
        got += engine_run(engine, model, loss_fn, [b], check_bytes=check)
        if i % 5 == 4:
            model.eval()
            with torch.no_grad():
                value = loss_fn(model, held_out)
            model.train()
            assert engine.state is EngineState.IDLE
            plain_eval.append(value.item())
    assert engine.evaluations == 2 and sum(engine.eval_bytes_per_channel().values()) > 0

    # the same run without evaluations, on a fresh engine
    model2 = build()
    engine2 = executor.run(model2, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)
    want = engine_run(engine2, model2, loss_fn, batches)
    assert got == want
    a, b = engine.state_dict(), engine2.state_dict()
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    assert engine.bytes_per_channel() == engine2.bytes_per_channel()  # evaluation bytes are counted apart
    # and the evaluation computed what plain PyTorch computes at that point
    plain_losses = plain_run(ref, loss_fn, batches[:5])
    ref.eval()
    with torch.no_grad():
        assert abs(loss_fn(ref, held_out).item() - plain_eval[0]) <= 1e-6 * abs(plain_eval[0])
    assert plain_losses == pytest.approx(got[:5], rel=1e-6)


def test_hf_generate_between_steps(tmp_path):
    build, loss_fn, vocab, schedule, model, engine = attached("hf-gpt2", "swap-host", tmp_path)
    ref = build()
    batches = gpt_batches(3, vocab=vocab)
    engine_run(engine, model, loss_fn, batches[:2])
    plain_run(ref, loss_fn, batches[:2])
    prompt = batches[2][:1, :4]
    model.eval()
    ref.eval()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    model.train()
    ref.train()
    assert engine.state is EngineState.IDLE and engine.evaluations >= 6
    got = engine_run(engine, model, loss_fn, batches[2:])  # training goes on as plain PyTorch's
    assert got[0] == pytest.approx(loss_fn(ref, batches[2]).item(), rel=1e-6)


def test_backward_through_an_evaluation_forward_is_refused_and_changes_nothing(tmp_path):
    _, loss_fn, vocab, _, model, engine = attached("gpt", "host", tmp_path)
    batches = gpt_batches(2, vocab=vocab)
    engine_run(engine, model, loss_fn, batches[:1])
    before = engine.state_dict()
    model.eval()
    loss = loss_fn(model, batches[1])  # grad enabled, eval mode: an evaluation
    with pytest.raises(ExecutorError, match=r"call model.train\(\)"):
        loss.backward()
    model.train()
    assert engine.state is EngineState.IDLE
    after = engine.state_dict()
    assert all(torch.equal(v, after["model"][k]) for k, v in before["model"].items())
    engine_run(engine, model, loss_fn, batches[1:])
