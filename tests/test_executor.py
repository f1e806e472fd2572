"""The executor trains exactly like plain PyTorch while replaying a schedule (issue 6).

Schedules here are hand-built by `executor_support.build_schedule` (an explicit PatrickStar-like
policy that forces eviction and puts OS on HOST); tests/test_executor_planner.py runs the same
checks on schedules made by the planner from recorded traces.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import executor
import executor.runtime
import executor.store
from executor.errors import ExecutorError
from executor.models import GPT, GPTConfig, build_gpt2
from executor.runtime import EngineState
from executor_support import build_schedule, device_peak
from schemas.schedule import Channel, ChunkList, Op, Tier
from schemas.trace import DType, Phase

STEPS = 20
LR, WD = 1e-2, 0.1


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_gpt(seed: int = 0, n_layer: int = 2) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, vocab_size=64, block_size=16))


def gpt_batches(n: int, vocab: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 16), generator=gen) for _ in range(n)]


def gpt_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model(idx, idx)


def hf_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model(input_ids=idx, labels=idx).loss


def plain_groups(model: nn.Module, wd: float = WD) -> list[dict]:
    seen, decay, no_decay = set(), [], []
    for _, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def plain_run(model: nn.Module, loss_fn, batches, *, clip: float | None = None, accumulate: int = 1) -> list[float]:
    opt = torch.optim.AdamW(plain_groups(model), lr=LR, fused=True)
    losses = []
    for i, b in enumerate(batches):
        loss = loss_fn(model, b)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses


def engine_run(engine, model: nn.Module, loss_fn, batches, *, accumulate: int = 1, check_bytes=None) -> list[float]:
    losses = []
    for b in batches:
        loss = loss_fn(model, b)
        (loss / accumulate).backward()
        losses.append(loss.item())
        engine.step()
        engine.zero_grad()
        if check_bytes is not None:
            check_bytes(engine)
    return losses


def params_of(engine, model: nn.Module) -> dict[str, torch.Tensor]:
    return engine.state_dict()["model"]


def assert_same(engine, ref: nn.Module, got_losses, want_losses, *, rel: float = 1e-6) -> None:
    assert len(got_losses) == len(want_losses)
    for a, b in zip(got_losses, want_losses):
        assert abs(a - b) <= rel * abs(b), (got_losses, want_losses)
    got = params_of(engine, None)
    for name, p in ref.named_parameters():
        diff = (got[name].float() - p.detach().float()).abs().max().item()
        scale = p.detach().float().abs().max().item() + 1e-12
        assert diff <= rel * scale, f"{name}: max abs diff {diff}"


def bytes_checker(schedule):
    want = {ch: n for ch, n in schedule.prediction.bytes_per_channel.items() if n}

    def check(engine) -> None:
        stats = engine.stats()
        assert stats.bytes_per_channel == want
        assert stats.peak_bytes_per_tier[Tier.DEVICE] <= schedule.budgets.device_bytes
    return check


# ----------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("overlap", [False, True], ids=["step-after-backward", "cpu-step-overlapped"])
def test_fp32_gpt_with_eviction_and_os_on_host_trains_like_plain_adamw(overlap):
    model, batches = small_gpt(), gpt_batches(STEPS)
    ref = copy.deepcopy(model)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward(), chunk_elements=4096, overlap=overlap)
    assert schedule.prediction.bytes_per_channel[Channel.H2D] > 0  # eviction is really forced
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    got = engine_run(engine, model, gpt_loss, batches, check_bytes=bytes_checker(schedule))
    want = plain_run(ref, gpt_loss, batches)
    assert got == want  # aim: bit-identical
    assert_same(engine, ref, got, want, rel=0.0)
    stats = engine.stats()
    assert stats.iterations == STEPS and stats.bytes_match(schedule)
    assert stats.seconds_per_phase[Phase.FORWARD] > 0 and stats.seconds_per_phase[Phase.BACKWARD] > 0
    assert stats.stall_seconds >= 0 and stats.iteration_seconds > 0
    assert "bytes H2D" in stats.table(schedule)


def test_hf_gpt2_with_eviction_trains_like_plain_adamw():
    model = build_gpt2(dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    ref = copy.deepcopy(model)
    batches = gpt_batches(STEPS)
    schedule = build_schedule(model, lambda m: hf_loss(m, batches[0]).backward(), chunk_elements=4096)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    got = engine_run(engine, model, hf_loss, batches, check_bytes=bytes_checker(schedule))
    want = plain_run(ref, hf_loss, batches)
    assert_same(engine, ref, got, want)


def test_nothing_offloaded_moves_no_bytes_and_trains_identically():
    model, batches = small_gpt(), gpt_batches(5)
    ref = copy.deepcopy(model)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward(), offload_blocks=False,
                              os_tier=Tier.DEVICE)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    got = engine_run(engine, model, gpt_loss, batches)
    assert engine.stats().bytes_per_channel == {}
    assert_same(engine, ref, got, plain_run(ref, gpt_loss, batches), rel=0.0)


def test_grad_clipping_across_tiers_matches_clip_grad_norm():
    model, batches = small_gpt(), gpt_batches(8)
    ref = copy.deepcopy(model)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, grad_clip_norm=0.05)
    got = engine_run(engine, model, gpt_loss, batches)
    assert_same(engine, ref, got, plain_run(ref, gpt_loss, batches, clip=0.05), rel=0.0)


def test_gradient_accumulation_matches_plain_accumulation():
    model, batches = small_gpt(), gpt_batches(8)
    ref = copy.deepcopy(model)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, grad_accumulation_steps=2)
    got = engine_run(engine, model, gpt_loss, batches, accumulate=2)
    assert_same(engine, ref, got, plain_run(ref, gpt_loss, batches, accumulate=2))


def test_gradient_accumulation_with_overlapped_cpu_steps():
    model, batches = small_gpt(), gpt_batches(6)
    ref = copy.deepcopy(model)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward(), overlap=True)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, grad_accumulation_steps=3)
    got = engine_run(engine, model, gpt_loss, batches, accumulate=3)
    assert_same(engine, ref, got, plain_run(ref, gpt_loss, batches, accumulate=3))


def test_lr_scheduler_on_engine_optimizer_matches_plain():
    model, batches = small_gpt(), gpt_batches(6)
    ref = copy.deepcopy(model)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    sched_a = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5)
    opt = torch.optim.AdamW(plain_groups(ref), lr=LR, fused=True)
    sched_b = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    got, want = [], []
    for b in batches:
        loss = gpt_loss(model, b)
        loss.backward()
        engine.step()
        sched_a.step()
        got.append(loss.item())
        loss = gpt_loss(ref, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched_b.step()
        want.append(loss.item())
    assert engine.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"] < LR
    assert_same(engine, ref, got, want, rel=0.0)


def test_bf16_matches_a_plain_mixed_precision_loop():
    model, batches = small_gpt(), gpt_batches(10)
    master_model = copy.deepcopy(model)  # fp32 masters of the reference
    schedule = build_schedule(model.to(torch.bfloat16), lambda m: gpt_loss(m, batches[0]).backward(),
                              compute=DType.BFLOAT16)
    model = copy.deepcopy(master_model)  # the engine takes the fp32 model and keeps masters itself
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, precision="bf16")
    got = engine_run(engine, model, gpt_loss, batches, check_bytes=bytes_checker(schedule))
    # reference: bf16 compute copy, fp32 masters, fused AdamW on the masters, copy back
    compute = copy.deepcopy(master_model).to(torch.bfloat16)
    opt = torch.optim.AdamW(plain_groups(master_model), lr=LR, fused=True)
    pairs = list(zip(master_model.parameters(), compute.parameters()))
    want = []
    for b in batches:
        loss = gpt_loss(compute, b)
        loss.backward()
        want.append(loss.item())
        for master, p in pairs:
            master.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in pairs:
                p.copy_(master)
    assert got == want
    sd = engine.state_dict()
    for name, p in compute.named_parameters():
        assert torch.equal(sd["model"][name], p.detach()), name
    for name, p in master_model.named_parameters():
        if name in sd["master"]:
            assert torch.equal(sd["master"][name], p.detach()), name


def test_fp16_loss_scaling_skips_overflowing_steps():
    model, batches = small_gpt(), gpt_batches(4)
    schedule = build_schedule(model.to(torch.float16), lambda m: gpt_loss(m, batches[0]).backward(),
                              compute=DType.FLOAT16)
    model = small_gpt()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    before = engine.state_dict()["model"]
    engine.scaler.scale = 2.0**40  # overflows fp16 grads: the step must be skipped and the scale halved
    loss = gpt_loss(model, batches[0])
    engine.backward(loss)
    engine.step()
    after = engine.state_dict()["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.scaler.scale == 2.0**39
    engine.scaler.scale = 2.0**8
    for b in batches:
        engine.backward(gpt_loss(model, b))
        engine.step()
    after = engine.state_dict()["model"]
    assert not all(torch.equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------------- unusual models


class Unusual(nn.Module):
    """Tied weights, a layer used twice, functional use, an unused param, a frozen param, buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.shared = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(16))  # used functionally by the root
        self.unused = nn.Parameter(torch.randn(4, 4))  # never gets a grad
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, 16))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.offset
        for block in self.blocks:
            x = x + block(x)
        x = self.shared(self.shared(x))  # used twice
        x = self.frozen(x) * self.scale
        x = x @ self.blocks[0][0].weight.t()  # a block's weight used outside it, through a view
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, 32), idx.view(-1))


def test_unusual_model_trains_like_plain_adamw():
    torch.manual_seed(0)
    model = Unusual()
    ref = copy.deepcopy(model)
    batches = gpt_batches(10, vocab=32)
    schedule = build_schedule(model, lambda m: m(batches[0]).backward(), chunk_elements=512, offload_blocks=False)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    got = engine_run(engine, model, lambda m, b: m(b), batches)
    want = plain_run(ref, lambda m, b: m(b), batches)
    assert_same(engine, ref, got, want, rel=0.0)
    assert torch.equal(engine.state_dict()["model"]["unused"], ref.unused.detach())


class ViewLinear(nn.Module):
    """Saves a VIEW of its weight for backward (`x @ w.t()`): a tensor aliasing chunk memory."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t())


class ViewNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(ViewLinear() for _ in range(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("saved_tensor_hooks", [True, False])
def test_saved_param_views_are_rebuilt_from_the_chunk_after_eviction(saved_tensor_hooks, monkeypatch):
    """Each block's chunk is evicted after its forward and its DEVICE buffer reused by the next block:
    a saved `w.t()` must be rebuilt from the chunk fetched again in backward, not read the old buffer."""
    torch.manual_seed(0)
    model = ViewNet()
    ref = copy.deepcopy(model)
    batches = gpt_batches(3, vocab=32)
    schedule = build_schedule(model, lambda m: m(batches[0]).backward(), chunk_elements=256)
    if not saved_tensor_hooks:  # shows the test can fail: without the hooks the grads are wrong
        monkeypatch.setattr(executor.runtime.Engine, "_push_saved_hooks", lambda self: None)
        monkeypatch.setattr(executor.runtime.Engine, "_pack", lambda self, t: t)  # the blocks' aliasing too
        # and an evicted buffer is reused at once, as on an idle machine: under load a copy still in flight
        # kept it RETIRING, the next block got a new buffer and the stale view read the right values
        free = executor.store.Pool.free

        def free_now(self, tensor, *, after=None, what="a buffer", on_retired=None):
            for ready in after or ():
                ready.wait()
            free(self, tensor, what=what)
            if on_retired is not None:
                on_retired()

        monkeypatch.setattr(executor.store.Pool, "free", free_now)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    got = engine_run(engine, model, lambda m, b: m(b), batches)
    want = plain_run(ref, lambda m, b: m(b), batches)
    if saved_tensor_hooks:
        assert_same(engine, ref, got, want, rel=0.0)
    else:
        assert got[1:] != want[1:]


# ----------------------------------------------------------------------------------- checks and errors


def test_device_budget_is_a_hard_limit():
    model, batches = small_gpt(), gpt_batches(1)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    tight = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward(),
                           device_bytes=device_peak(schedule) - 1)
    engine = executor.run(model, tight, lr=LR)
    with pytest.raises(ExecutorError, match="DEVICE budget exceeded"):
        engine_run(engine, model, gpt_loss, batches)


def test_activation_bytes_count_against_the_device_budget():
    """A budget with room for every chunk but not for the activations the blocks keep fails loudly;
    with the activations swapped out the same budget is enough."""
    model, batches = small_gpt(), gpt_batches(2)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    chunks_only = dataclasses.replace(schedule, budgets=dataclasses.replace(schedule.budgets,
                                                                           device_bytes=device_peak(schedule)))
    engine = executor.run(model, chunks_only, lr=LR)
    with pytest.raises(ExecutorError, match="DEVICE budget exceeded.*activation bytes"):
        engine_run(engine, model, gpt_loss, batches)
    assert engine.state is EngineState.FAILED
    # the full budget (chunks + activations) trains, and the engine reports the activation peak
    model = small_gpt()
    engine = executor.run(model, schedule, lr=LR)
    engine_run(engine, model, gpt_loss, batches, check_bytes=bytes_checker(schedule))
    assert engine.stats().peak_activation_bytes > 0


def test_attach_mismatch_names_the_first_differences_and_leaves_the_model_untouched():
    schedule = build_schedule(small_gpt(), lambda m: gpt_loss(m, gpt_batches(1)[0]).backward())
    torch.manual_seed(0)
    other = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=80, block_size=16))
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in other.named_parameters()}
    with pytest.raises(ExecutorError) as info:
        executor.run(other, schedule)
    message = str(info.value)
    assert "'wte.weight': shape (80, 32), the schedule expects (64, 32)" in message
    assert "(13 differences)" in message and "and 10 more" in message  # the first few, and a count
    assert "re-record" in message
    for n, p in other.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1])
    assert not other._forward_pre_hooks and not other.h[0]._forward_pre_hooks


def test_replay_check_stops_on_another_module_order_before_any_state_changes():
    model, batches = small_gpt(n_layer=3), gpt_batches(2)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    engine = executor.run(model, schedule, lr=LR)
    engine_run(engine, model, gpt_loss, batches[:1])
    model.h = nn.ModuleList([model.h[1], model.h[0], model.h[2]])  # same modules, another order
    moved = dict(engine.store.bytes_per_channel)
    with pytest.raises(ExecutorError, match=r"expects FORWARD pre_forward of 'h.0', the model did FORWARD pre_forward of 'h.1'.*re-record"):
        gpt_loss(model, batches[1])
    assert engine.state is EngineState.FAILED
    # moments 0..k-1 ran; the failing moment changed nothing: no copy was started for it
    assert engine.store.bytes_per_channel[Channel.H2D] - moved.get(Channel.H2D, 0) == \
        sum(a.bytes for a in schedule.actions if a.moment < engine.cursor and a.channel is Channel.H2D)
    with pytest.raises(ExecutorError, match="replay stopped earlier"):
        engine.step()


def test_forgetting_step_is_a_clear_error():
    model, batches = small_gpt(), gpt_batches(2)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    executor.run(model, schedule, lr=LR)
    gpt_loss(model, batches[0]).backward()
    with pytest.raises(ExecutorError, match=r"call engine.step\(\) after every loss.backward\(\)"):
        gpt_loss(model, batches[1])


def test_overlapped_schedule_with_clipping_is_refused_at_attach():
    model, batches = small_gpt(), gpt_batches(1)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward(), overlap=True)
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ExecutorError, match="--no-optimizer-overlap"):
        executor.run(model, schedule, grad_clip_norm=1.0)
    assert ptrs == [p.data_ptr() for p in model.parameters()]


def test_state_dict_round_trip_continues_identically(tmp_path):
    batches = gpt_batches(8)
    model = small_gpt()
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    engine_run(engine, model, gpt_loss, batches[:4])
    engine.save(tmp_path / "ckpt.pt")
    straight = engine_run(engine, model, gpt_loss, batches[4:])
    final = engine.state_dict()["model"]

    resumed_model = small_gpt(seed=123)  # other initial values: everything must come from the checkpoint
    resumed = executor.run(resumed_model, schedule, lr=LR, weight_decay=WD)
    resumed.load(tmp_path / "ckpt.pt")
    again = engine_run(resumed, resumed_model, gpt_loss, batches[4:])
    assert again == straight
    for k, v in resumed.state_dict()["model"].items():
        assert torch.equal(v, final[k]), k
    # plain PyTorch reads the checkpoint
    plain = small_gpt(seed=5)
    plain.load_state_dict(torch.load(tmp_path / "ckpt.pt")["model"])


def test_detach_gives_back_plain_params():
    model, batches = small_gpt(), gpt_batches(3)
    ref = copy.deepcopy(model)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    engine_run(engine, model, gpt_loss, batches)
    plain_run(ref, gpt_loss, batches)
    engine.detach()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(gpt_loss(model, batches[0]), gpt_loss(ref, batches[0]))


def test_executor_never_imports_planner():
    code = "import sys, executor, executor.runtime, executor.store, executor.stats; " \
           "sys.exit(1 if any(m.startswith('planner') for m in sys.modules) else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_chunks_of_params_never_leave_their_place_in_the_store():
    model, batches = small_gpt(), gpt_batches(2)
    schedule = build_schedule(model, lambda m: gpt_loss(m, batches[0]).backward())
    engine = executor.run(model, schedule, lr=LR)
    engine_run(engine, model, gpt_loss, batches)
    # steady state: after an iteration each chunk is where initial_residency says
    for r in schedule.initial_residency:
        assert sorted(engine.store.valid_tiers(r.list, r.chunk)) == sorted(r.tiers), (r.list, r.chunk)
    assert all(not engine.store.valid_tiers(ChunkList.GRAD, c.id) for c in schedule.layout.chunks)


def test_a_device_is_named_as_its_tensors_report_it(monkeypatch):
    """`device="cuda"` resolves to `cuda:<current>` and "cpu:0" to "cpu" (torch.device("cuda") != "cuda:0",
    torch.device("cpu:0") != "cpu"), so the engine's device compares equal to its tensors'."""
    from executor.attach import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu:0") == resolve_device("cpu") == torch.zeros(1).device


@pytest.mark.parametrize("named_as_given", [False, True])
def test_cpu_0_trains_like_cpu_when_chunks_are_evicted(named_as_given, monkeypatch):
    """The first H100 run's bug, on the CPU: with device="cpu:0" the binding did not recognize saved
    params as chunk data, kept the buffers of evicted chunks for backward, and trained wrongly with no
    error (step 1: 3.8818 against 3.9119). `named_as_given`: the engine keeps torch.device("cpu:0") as
    given (no `resolve_device`): the binding recognizes a saved param by its storage alone, so it still
    trains bit for bit."""
    from test_executor_planner import gpt_model, plan

    if named_as_given:
        monkeypatch.setattr(executor.runtime, "resolve_device", torch.device)

    schedule = plan("gpt")  # PARAM chunks evicted in forward, fetched again for backward
    assert any(a.op is Op.EVICT and a.list is ChunkList.PARAM for a in schedule.actions)
    batches = gpt_batches(3)
    model, ref = gpt_model(), gpt_model()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, device="cpu:0")
    assert (engine.device == torch.device("cpu:0")) is named_as_given
    assert engine_run(engine, model, gpt_loss, batches) == plain_run(ref, gpt_loss, batches)
    engine.detach()


def test_adam_turns_the_key_bias_rounding_noise_into_lr_sized_steps():
    """Why tests/test_cuda.py does not compare the key third of `c_attn.bias`: its gradient is zero in
    exact arithmetic (softmax drops the per-query constant q . b_k), so what backward computes there is
    rounding noise, and Adam's g / sqrt(v) makes lr-sized steps of it. Two correct AdamW implementations
    (PyTorch's fused and foreach kernels, which round differently) disagree there by O(1) in norm after
    20 steps, while the query and value thirds, and every other param, agree far inside 1e-5."""
    batches = gpt_batches(STEPS)

    def train(**impl) -> nn.Module:
        model = small_gpt()
        opt = torch.optim.AdamW(plain_groups(model), lr=LR, **impl)
        for b in batches:
            gpt_loss(model, b).backward()
            opt.step()
            opt.zero_grad()
        return model

    fused, foreach = dict(train(fused=True).named_parameters()), dict(train(foreach=True).named_parameters())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm()).item()

    for name, p in foreach.items():
        if name.endswith("attn.c_attn.bias"):
            (q1, k1, v1), (q2, k2, v2) = fused[name].chunk(3), p.chunk(3)
            assert rel(k1, k2) > 0.1, name  # the noise, amplified to lr-sized steps
            assert rel(q1, q2) < 1e-5 and rel(v1, v2) < 1e-5, name
        else:
            assert rel(fused[name], p) < 1e-5, name
