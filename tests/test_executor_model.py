"""The model stays a model while attached (issue 21): `model.state_dict()` gives the real values,
evaluation between steps leaves the training untouched, drift is refused before anything changes,
and an out-of-memory error of the DEVICE becomes one clear line with nothing lost."""

from __future__ import annotations


import pytest
import torch

import executor
from executor.errors import ExecutorError
from executor.runtime import EngineState
from schemas.schedule import Op, Tier
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
    # its own NVMe directory: the first engine still holds its directory's lock (executor/nvme.py)
    engine2 = executor.run(model2, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path / "second")
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


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", "hf-qwen2"])
def test_hf_generate_between_steps(name, tmp_path):
    """GPT-2, Llama and Qwen2 (rotary embeddings, RMSNorm, grouped-query attention, a KV cache of
    another layout than GPT-2's): greedy `generate` under no_grad while attached equals the plain model's, and
    the training after it equals a run that never generated, loss for loss and bit for bit."""
    build, loss_fn, vocab, schedule, model, engine = attached(name, "swap-host", tmp_path)
    assert any(a.op is Op.EVICT and a.src is Tier.DEVICE for a in schedule.actions)  # params fetched as needed
    ref = build()
    batches = gpt_batches(4, vocab=vocab)
    engine_run(engine, model, loss_fn, batches[:2])
    plain_run(ref, loss_fn, batches[:2])
    prompt = batches[2][:1, :4]
    model.eval()
    ref.eval()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        generated = model.generate(prompt, **kw)
        assert torch.equal(generated, ref.generate(prompt, **kw))
    assert generated.shape == (1, 10)
    model.train()
    assert engine.state is EngineState.IDLE and engine.evaluations >= 6
    got = engine_run(engine, model, loss_fn, batches[2:])

    model2 = build()  # the same run without the generate
    engine2 = executor.run(model2, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path / "second")
    want = engine_run(engine2, model2, loss_fn, batches)
    assert got == want[2:]
    a, b = engine.state_dict(), engine2.state_dict()
    for key in ("model", "optimizer"):
        for index, value in a[key].items() if key == "model" else a[key]["state"].items():
            other = b[key][index] if key == "model" else b[key]["state"][index]
            if key == "model":
                assert torch.equal(value, other), index
            else:
                assert all(torch.equal(value[k], other[k]) for k in ("step", "exp_avg", "exp_avg_sq")), index
    assert engine.bytes_per_channel() == engine2.bytes_per_channel()  # generation bytes are counted apart


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


# ----------------------------------------------------------------------------- drift, refused before anything changes

def test_model_mismatch_is_one_short_line_with_a_count(tmp_path):
    from executor.models import GPT, GPTConfig

    schedule = plan("gpt")
    torch.manual_seed(0)
    other = GPT(GPTConfig(n_layer=12, n_head=2, n_embd=32, vocab_size=80, block_size=16))
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(ExecutorError) as info:
        executor.run(other, schedule)
    message = str(info.value)
    assert "\n" not in message and len(message) < 600, message
    assert "'wte.weight': shape (80, 32), the schedule expects (64, 32)" in message
    assert "more" in message and "re-record" in message
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())


@pytest.mark.parametrize("change", ["module-added", "module-missing", "dtype"])
def test_a_changed_model_is_refused_at_attach_and_left_untouched(change):
    build, *_ = MODELS["gpt"]
    schedule = plan("gpt")
    model = build()
    if change == "module-added":
        model.extra = torch.nn.Linear(4, 4)
        expect = "'extra.weight': in the model, not in the schedule"
    elif change == "module-missing":
        del model.h[2]
        expect = "'h.2.ln_1.weight': in the schedule, not in the model"
    else:
        model.to(torch.float64)
        expect = "dtype torch.float64"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ExecutorError, match="re-record") as info:
        executor.run(model, schedule)
    assert expect in str(info.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_another_moment_sequence_at_the_first_iteration_changes_nothing(tmp_path):
    build, loss_fn, vocab, _, model, engine = attached("gpt", "host", tmp_path)
    initial = {k: v.clone() for k, v in build().state_dict().items()}
    model.h = torch.nn.ModuleList([model.h[1], model.h[0], model.h[2]])  # same modules, another order
    with pytest.raises(ExecutorError, match=r"expects FORWARD pre_forward of 'h.0'.*re-record"):
        loss_fn(model, gpt_batches(1, vocab=vocab)[0])
    got = engine.state_dict()  # still readable: the refusal came before any step
    assert all(torch.equal(got["model"][k], v) for k, v in initial.items())
    assert all(torch.equal(t, torch.zeros_like(t)) for s in got["optimizer"]["state"].values()
               for k, t in s.items() if k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("factor", [2, 8])
def test_a_larger_batch_is_refused_naming_the_batch_before_anything_changes(factor, tmp_path):
    build, loss_fn, vocab, _, model, engine = attached("gpt", "swap-host", tmp_path)
    batches = gpt_batches(2, vocab=vocab)
    engine_run(engine, model, loss_fn, batches[:1])
    before = engine.state_dict()
    big = batches[1].repeat(factor, 1)
    with pytest.raises(ExecutorError, match=r"larger than the recorded one \(batch size or sequence length\)") as info:
        loss_fn(model, big)
    assert "block 'h.0'" in str(info.value) and "budget" not in str(info.value)
    after = engine.state_dict()
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())
    # a smaller batch (a short last batch) trains
    build2 = executor.run(model2 := build(), plan("gpt", swap=True), lr=LR, nvme_dir=tmp_path)
    engine_run(build2, model2, loss_fn, [batches[0][:1]])


# ----------------------------------------------------------------------------- out of memory when the budget lies

def test_out_of_memory_in_a_chunk_allocation_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    import executor.store

    _, loss_fn, vocab, _, model, engine = attached("gpt", "host", tmp_path)
    batches = gpt_batches(2, vocab=vocab)
    engine_run(engine, model, loss_fn, batches[:1])
    before = engine.state_dict()

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    engine.store.pools[Tier.DEVICE]._trim(0)  # no cached buffer: the next DEVICE allocation is a new one
    monkeypatch.setattr(executor.store, "_empty", no_memory)
    with pytest.raises(ExecutorError, match=r"out of memory on cpu: moment \d+ action \d+ \(\w+\).* needed \d+ bytes"
                                            r".*re-solve with a smaller `--device-memory-gb`") as info:
        loss_fn(model, batches[1]).backward()
    assert "\n" not in str(info.value)
    assert engine.state is EngineState.FAILED
    after = engine.state_dict()  # nothing lost: the state of the last step
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())
    with pytest.raises(ExecutorError, match="replay stopped earlier"):
        loss_fn(model, batches[1])


def test_out_of_memory_in_an_activation_reload_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    import executor.activations

    _, loss_fn, vocab, _, model, engine = attached("gpt", "swap-host", tmp_path)
    batches = gpt_batches(2, vocab=vocab)
    engine_run(engine, model, loss_fn, batches[:1])
    before = engine.state_dict()

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(executor.activations, "_device_empty", no_memory)
    loss = loss_fn(model, batches[1])
    with pytest.raises(ExecutorError, match=r"out of memory on cpu: the reload of a saved tensor of block \d"):
        loss.backward()
    assert engine.state is EngineState.FAILED
    after = engine.state_dict()
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())


# ----------------------------------------------------------------------------- attach refuses what the simulator rejects

def _mutated(schedule, index, **changes):
    import dataclasses

    actions = list(schedule.actions)
    actions[index] = dataclasses.replace(actions[index], **changes)
    return dataclasses.replace(schedule, actions=tuple(actions))


@pytest.mark.parametrize("mutation", ["step-chunk-shifted", "write-back-dropped"])
def test_attach_refuses_a_schedule_the_simulator_rejects(mutation):
    import dataclasses

    from planner.simulate import ScheduleViolation, simulate
    from planner.presets import resolve_hardware
    from schemas.schedule import ChunkList, Op

    build, *_ = MODELS["gpt"]
    schedule = plan("gpt")
    if mutation == "step-chunk-shifted":  # the bit flip of issue 21: three params never updated
        i = next(i for i, a in enumerate(schedule.actions) if a.op is Op.OPTIMIZER_STEP)
        bad = _mutated(schedule, i, chunk=schedule.actions[i].chunk + 1)
        expect = r"invalid schedule: .*(drops the last valid copy|steps the chunk a second time|never steps)"
    else:
        i = next(i for i, a in enumerate(schedule.actions) if a.op is Op.WRITE_BACK and a.list is ChunkList.GRAD)
        bad = dataclasses.replace(schedule, actions=schedule.actions[:i] + schedule.actions[i + 1:])
        expect = r"invalid schedule: .*(drops the last valid copy|needs a valid)"
    with pytest.raises(ScheduleViolation):
        simulate(bad, resolve_hardware("cpu-emulated"))
    model = build()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(ExecutorError, match=expect) as info:
        executor.run(model, bad)
    assert "\n" not in str(info.value) and "planner simulate" in str(info.value)
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1])


def test_evaluation_stays_within_the_device_budget_by_giving_chunks_back(tmp_path):
    build, loss_fn, vocab, schedule, model, engine = attached("gpt", "host", tmp_path)
    batches = gpt_batches(3, vocab=vocab)
    ref = build()
    engine_run(engine, model, loss_fn, batches[:1])
    plain_run(ref, loss_fn, batches[:1])
    # between steps, room for one unit's chunks and one more (the schedule's budget is not tight for this
    # tiny model): the evaluation must give chunks back as it goes
    pool = engine.store.pools[Tier.DEVICE]
    widest = max(len(need) for need in engine._eval_needs.values())  # the most chunks one unit computes with
    budget, pool.capacity_bytes = pool.capacity_bytes, pool.in_use_bytes + (widest + 1) * max(
        4 * c.elements for c in schedule.layout.chunks)
    pool.peak_bytes = pool.in_use_bytes
    assert sum(4 * c.elements for c in schedule.layout.chunks) > pool.capacity_bytes
    with torch.no_grad():
        got, want = loss_fn(model, batches[2]), loss_fn(ref, batches[2])
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert pool.peak_bytes <= pool.capacity_bytes
    pool.capacity_bytes = 1  # nothing fits: one clear line, and the training state is untouched
    with pytest.raises(ExecutorError, match="do not fit the DEVICE budget"), torch.no_grad():
        loss_fn(model, batches[2])
    assert engine.state is EngineState.IDLE
    pool.capacity_bytes = budget
    assert engine_run(engine, model, loss_fn, batches[1:2]) == pytest.approx(plain_run(ref, loss_fn, batches[1:2]),
                                                                              rel=1e-6)


def test_an_evaluation_forward_that_raises_leaves_the_training_untouched(tmp_path):
    build, loss_fn, vocab, _, model, engine = attached("gpt", "host", tmp_path)
    batches = gpt_batches(3, vocab=vocab)
    want = plain_run(build(), loss_fn, batches)
    got = engine_run(engine, model, loss_fn, batches[:1])
    with pytest.raises(IndexError), torch.no_grad():
        model(torch.full((2, 16), vocab + 5))  # the user's own error, inside the forward
    assert engine.state is EngineState.IDLE
    got += engine_run(engine, model, loss_fn, batches[1:])
    assert got == pytest.approx(want, rel=1e-6)
