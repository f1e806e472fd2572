"""The executor on schedules the planner makes from recorded traces: record -> plan -> train (issue 6).

Each model is recorded for real on the CPU (executor.record), planned by the planner's
`materialize` with decisions that force eviction (a PARAM budget far below the model) and put
the OS on HOST (or split it between DEVICE and HOST), and trained for 20 steps against plain
PyTorch with `torch.optim.AdamW(fused=True)`. The tests import the planner; the executor does not.
"""

from __future__ import annotations

import functools

import pytest
import torch

import executor
from executor.errors import ExecutorError
from executor.models import GPT, GPTConfig, build_gpt2
from executor.recorder import record
from planner.layout import build_layout
from planner.materialize import Decisions, EvictionRule, materialize
from planner.presets import resolve_hardware
from planner.problem import build_problem
from schemas._base import digest_bytes
from schemas.schedule import ActivationMode, Channel, ChunkList, ChunkPlan, Op, Tier
from test_executor import (
    LR, STEPS, WD, Unusual, assert_same, bytes_checker, engine_run, gpt_batches, plain_run,
)

CHUNK_ELEMENTS = 4096
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gpt_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64, block_size=16))


def hf_model():
    torch.manual_seed(0)
    return build_gpt2(dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))


def hf_llama():
    """A tiny Llama from a config (no download): RMSNorm, rotary embeddings, SwiGLU MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))


def hf_qwen2():
    """A tiny Qwen2 from a config: grouped-query attention (one KV head for two), q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))


def unusual_model() -> Unusual:
    torch.manual_seed(0)
    return Unusual()


MODELS = {
    "gpt": (gpt_model, lambda b: {"idx": b, "targets": b}, lambda m, b: m(b, b), 64),
    "hf-gpt2": (hf_model, lambda b: {"input_ids": b, "labels": b}, lambda m, b: m(input_ids=b, labels=b).loss, 64),
    "unusual": (unusual_model, lambda b: b, lambda m, b: m(b), 32),
    "hf-llama": (hf_llama, lambda b: {"input_ids": b, "labels": b}, lambda m, b: m(input_ids=b, labels=b).loss, 64),
    "hf-qwen2": (hf_qwen2, lambda b: {"input_ids": b, "labels": b}, lambda m, b: m(input_ids=b, labels=b).loss, 64),
}


@functools.cache
def recorded(name: str, device: str = "cpu"):
    """device: where the model records. A CUDA run needs a CUDA recording: its kernels save other
    tensors for backward than the CPU's (SDPA's logsumexp and RNG seeds), so its activations differ."""
    build, as_batch, _, vocab = MODELS[name]
    trace = record(build().to(device), as_batch(gpt_batches(1, vocab=vocab)[0].to(device)), model_name=name)
    hardware = resolve_hardware("cpu-emulated")
    problem = build_problem(trace, hardware, trace_digest=digest_bytes(trace.to_msgpack()))
    return trace, problem


def plan(name: str, *, os_split: bool = False, overlap: bool = False, budget_chunks: int = 8, recompute: bool = False,
         swap: bool = False, nvme: bool = False, swap_tier: Tier = Tier.HOST, device: str = "cpu", wrap: bool = False):
    """A schedule forcing eviction: PARAM+GRAD on DEVICE capped at `budget_chunks` chunks. `wrap`: every other
    chunk whose OS lives off DEVICE kept on DEVICE across the iteration's end (Decisions.wrap_kept_chunks)."""
    _, problem = recorded(name, device)
    layout = build_layout(problem, chunk_elements=CHUNK_ELEMENTS)
    cap = max(c.elements for c in layout.chunks) * 4

    def plan_of(c: int) -> ChunkPlan:
        if nvme:
            return ChunkPlan(chunk=c, os_tier=Tier.NVME if c % 2 == 0 else Tier.HOST, optimizer_tier=Tier.HOST)
        if os_split and c % 3 == 0:
            return ChunkPlan(chunk=c, os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE)
        if os_split and c % 3 == 1:
            return ChunkPlan(chunk=c, os_tier=Tier.HOST, optimizer_tier=Tier.DEVICE)
        return ChunkPlan(chunk=c, os_tier=Tier.HOST, optimizer_tier=Tier.HOST)

    swap_mode = ActivationMode.SWAP_NVME if swap_tier is Tier.NVME else ActivationMode.SWAP_HOST

    def mode(b: int) -> ActivationMode:
        if recompute and swap:
            return (ActivationMode.RECOMPUTE, swap_mode, ActivationMode.KEEP)[b % 3]
        if recompute or swap:
            return (ActivationMode.RECOMPUTE if recompute else swap_mode) if b % 2 == 0 else ActivationMode.KEEP
        return ActivationMode.KEEP

    for chunks in range(budget_chunks, 4 * budget_chunks):  # the smallest budget the layout allows
        decisions = Decisions(policy="tide", layout=layout, chunk_plans=tuple(plan_of(c.id) for c in layout.chunks),
                              activation_modes=tuple(mode(b) for b in range(len(problem.blocks))),
                              param_device_budget_bytes=(cap * chunks,) * len(problem.moments),
                              persistent_chunks=frozenset(), optimizer_overlap=overlap, prefetch=True,
                              eviction=EvictionRule.BELADY_CLEAN_FIRST,
                              param_home_tiers=tuple(Tier.NVME if nvme and c.id % 3 else Tier.HOST
                                                     for c in layout.chunks) if nvme else (),
                              wrap_kept_chunks=frozenset(c.id for c in layout.chunks if wrap and c.id % 2 == 0
                                                         and plan_of(c.id).os_tier is not Tier.DEVICE))
        try:
            schedule = materialize(problem, decisions)
        except Exception:  # noqa: BLE001 - too small a budget: try one chunk more
            continue
        # (materialize drops the keeps where the budget cannot hold them to the end: one chunk more)
        if not wrap or any(r.list is ChunkList.PARAM and Tier.DEVICE in r.tiers for r in schedule.initial_residency):
            return schedule
    raise AssertionError("no feasible budget")


CASES = [("gpt", v) for v in ("os-host", "os-split", "cpu-overlap", "recompute", "swap-host", "recompute+swap",
                              "nvme", "nvme+overlap", "swap-nvme", "recompute+swap-nvme", "nvme+swap-nvme",
                              "os-split+wrap", "cpu-overlap+wrap")] + [
    ("hf-gpt2", "os-split"), ("hf-gpt2", "swap-host"), ("hf-gpt2", "swap-nvme"), ("unusual", "cpu-overlap"),
    ("unusual", "recompute+swap")]


@pytest.mark.parametrize(("name", "variant"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_recorded_and_planned_models_train_like_plain_pytorch(name, variant, tmp_path):
    build, _, loss_fn, vocab = MODELS[name]
    schedule = plan(name, os_split="os-split" in variant, overlap="overlap" in variant,
                    recompute="recompute" in variant, swap="swap" in variant,
                    nvme="nvme" in variant.replace("swap-nvme", ""),
                    swap_tier=Tier.NVME if "swap-nvme" in variant else Tier.HOST, wrap="wrap" in variant)
    evicted = [a for a in schedule.actions if a.op is Op.EVICT and a.src is Tier.DEVICE]
    if "wrap" in variant:  # some chunk starts (and ends) the iteration on DEVICE without being persistent
        assert any(r.list is ChunkList.PARAM and Tier.DEVICE in r.tiers for r in schedule.initial_residency)
    assert evicted and schedule.prediction.bytes_per_channel.get(Channel.H2D, 0) > 0
    model, ref = build(), build()
    batches = gpt_batches(STEPS, vocab=vocab)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path)
    modes = engine.activations.modes  # the one activation mechanism runs the schedule's plan
    assert (ActivationMode.RECOMPUTE in modes) == ("recompute" in variant)
    assert (ActivationMode.SWAP_NVME in modes) == ("swap-nvme" in variant)
    got = engine_run(engine, model, loss_fn, batches, check_bytes=bytes_checker(schedule))
    want = plain_run(ref, loss_fn, batches)
    assert_same(engine, ref, got, want, rel=0.0)
    stats = engine.stats()
    assert stats.peak_bytes_per_tier[Tier.HOST] == schedule.prediction.peak_bytes_per_tier[Tier.HOST]
    assert 0 < stats.peak_bytes_per_tier[Tier.DEVICE] <= schedule.budgets.device_bytes
    if "nvme" in variant:
        assert stats.bytes_per_channel[Channel.NVME_READ] > 0 and stats.bytes_per_channel[Channel.NVME_WRITE] > 0
        files = list(tmp_path.rglob("*.bin")) + list(tmp_path.rglob("*.act"))
        assert files  # the chunk / activation files exist while training...
        engine.detach()
        assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob("*.act"))  # ...and are removed


def test_swap_nvme_without_nvme_dir_is_refused_at_attach():
    schedule = plan("gpt", swap=True, swap_tier=Tier.NVME)
    model = gpt_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ExecutorError, match="swaps the activations of blocks .* to NVME: pass nvme_dir="):
        executor.run(model, schedule, lr=LR)
    for n, p in model.named_parameters():  # nothing was touched
        assert torch.equal(p.detach(), before[n]), n


@pytest.mark.parametrize(("name", "overlap"), [("gpt", True), ("hf-gpt2", False), ("unusual", True)],
                         ids=["gpt-overlap", "hf-gpt2-no-overlap", "unusual-overlap"])
def test_solved_schedules_train_like_plain_pytorch(name, overlap):
    """`planner.solve` with a DEVICE budget of the non-model peak plus 40% of the model data."""
    from planner.solve import solve

    trace, _ = recorded(name)
    model_bytes = sum(t.bytes for t in trace.tensors) * 4  # fp32 params, grads, m, v
    device_bytes = max(m.non_model_bytes for m in trace.moments) + int(0.4 * model_bytes)
    schedule = solve(trace, resolve_hardware("cpu-emulated"), trace_digest=digest_bytes(trace.to_msgpack()),
                     device_bytes=device_bytes, optimizer_overlap=overlap, time_limit_s=20,
                     checkpoint_offload=False)
    assert schedule.prediction.bytes_per_channel.get(Channel.H2D, 0) > 0  # it offloads
    build, _, loss_fn, vocab = MODELS[name]
    model, ref = build(), build()
    batches = gpt_batches(STEPS, vocab=vocab)
    clip = None if overlap else 0.5  # clipping needs every grad before the first step
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, grad_clip_norm=clip)
    got = engine_run(engine, model, loss_fn, batches, check_bytes=bytes_checker(schedule))
    assert_same(engine, ref, got, plain_run(ref, loss_fn, batches, clip=clip), rel=0.0)


def test_offloaded_recompute_checkpoints_of_other_bytes_are_refused_at_attach():
    """The planner may park a RECOMPUTE block's input on HOST, and the executor replays that
    (tests/test_activations_engine.py); a checkpoint whose ACT_OFFLOAD carries other bytes than the
    block's input_bytes cannot be replayed byte for byte, and is refused before touching the model."""
    import dataclasses

    _, problem = recorded("gpt")
    layout = build_layout(problem, chunk_elements=CHUNK_ELEMENTS)
    from planner.materialize import uniform_decisions

    decisions = dataclasses.replace(uniform_decisions(problem, layout, activation_mode=ActivationMode.RECOMPUTE),
                                    checkpoint_tier=Tier.HOST)
    schedule = materialize(problem, decisions)
    assert any(a.op is Op.ACT_OFFLOAD for a in schedule.actions)
    executor.run(gpt_model(), schedule, lr=LR).detach()  # as planned: attaches
    plans = tuple(dataclasses.replace(p, input_bytes=p.input_bytes + 8) for p in schedule.activation_plans)
    schedule = dataclasses.replace(schedule, activation_plans=plans)
    model = gpt_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ExecutorError, match="moves 4096 bytes of the recompute checkpoint of block 0, but its "
                                            "input .* is 4104 bytes .* --no-checkpoint-offload"):
        executor.run(model, schedule, lr=LR)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
