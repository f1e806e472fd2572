"""The executor's CUDA paths on a real GPU (issue 19): skipped without one, run by `pytest -m cuda`
(and by `bash bench/gpu/run.sh` on a lent machine).

Each test mirrors a CPU test (tests/test_executor.py, tests/test_executor_planner.py) with the same
models, schedules and reference loops, the model and the batches on CUDA: DEVICE is the GPU (two copy
streams, CUDA events, pinned HOST buffers), HOST steps run on the CPU beside it.

Tolerances, measured on an H100 (bench/RESULTS.md, section "GPU"). fp32 against plain
`torch.optim.AdamW(fused=True)` on CUDA: every step's loss within 1e-5 relative (measured: 4.0e-7 at
worst over 20 steps, every variant), and every param within 1e-5 in norm, ||tide - ref|| / ||ref||
(measured: 7.6e-6 at worst, an attention weight), not the CPU suite's bit-identity: the engine steps
HOST/NVME chunks with the fused *CPU* AdamW kernel and the reference with the fused *CUDA* one, which
round differently, and cuBLAS may pick other GEMM kernels for params that are views into a chunk.
Not 1e-6: those roundings, carried through 20 Adam steps at lr 1e-2, reach 7.6e-6 on the H100.
One exception, with its mechanism: the KEY third of each attention's `c_attn.bias` has no gradient in
exact arithmetic (q . b_k is the same for every key of a query, and softmax drops a per-query
constant), so its computed gradient is rounding noise (~1e-9), which Adam's g / sqrt(v) turns into
steps of size lr whatever the noise's scale; two correct AdamW implementations (PyTorch's fused and
foreach, both on the CPU) already disagree there by 120% in norm while the query and value thirds agree
to 2e-6 (tests/test_executor.py::test_adam_turns_the_key_bias_rounding_noise_into_lr_sized_steps).
Those elements are not compared. A wrong copy, a stale chunk or a race shows up at 1e-3 and above (the
first H100 run's stale saved params: 6e-3 in loss at step 1). Where both sides use the same kernels on
the same data, the tests ask for equality (overlapped vs inline CPU steps, a resumed checkpoint, the
same run twice).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch

import executor
from executor.errors import ExecutorError
from executor.runtime import EngineState
from executor_support import build_schedule
from schemas.schedule import ActivationMode, Channel, Op, Tier
from schemas.trace import DType, Phase
from test_executor import LR, STEPS, WD, bytes_checker, engine_run, gpt_batches, gpt_loss, plain_groups, plain_run, small_gpt
from test_executor_planner import MODELS, gpt_model, plan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("one_torch_thread"),
]
REL = 1e-5  # see the module docstring


def cuda_batches(n: int, vocab: int = 64) -> list[torch.Tensor]:
    return [b.cuda() for b in gpt_batches(n, vocab=vocab)]


def compared_parts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The parts of a param compared with the reference: all of it, except the key third of an
    attention's fused qkv bias (module docstring: its gradient is rounding noise)."""
    if name.endswith("attn.c_attn.bias"):
        q, _, v = tensor.chunk(3)
        return [(f"{name}[query]", q), (f"{name}[value]", v)]
    return [(name, tensor)]


def param_differences(engine, ref: torch.nn.Module) -> dict[str, float]:
    """||tide - ref|| / ||ref|| per compared part."""
    state = engine.state_dict()["model"]
    out = {}
    for name, p in ref.named_parameters():
        mine, theirs = state[name].detach().double().cpu(), p.detach().double().cpu()
        for (label, a), (_, b) in zip(compared_parts(name, mine), compared_parts(name, theirs)):
            out[label] = ((a - b).norm() / (b.norm() + 1e-30)).item()
    return out


def assert_close(engine, ref: torch.nn.Module, got: list[float], want: list[float], *, rel: float = REL) -> None:
    assert len(got) == len(want)
    diffs = param_differences(engine, ref)
    report = os.environ.get("TIDE_CUDA_DIFFS")  # the GPU kit sets it: the measured figures come back
    if report:
        worst = dict(sorted(diffs.items(), key=lambda kv: -kv[1])[:5])
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
                "loss_rel_max": max(abs(a - b) / abs(b) for a, b in zip(got, want)), "worst_params_norm_rel": worst}
        with open(report, "a") as fh:
            fh.write(json.dumps(line) + "\n")
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rel * abs(b), f"step {i}: loss {a} vs {b}; all: {got} vs {want}"
    for label, diff in diffs.items():
        assert diff <= rel, f"{label}: ||tide - ref|| / ||ref|| = {diff:.3g} > {rel:g}"


def assert_on_gpu(engine) -> None:
    """DEVICE is the GPU and HOST buffers are pinned (async copies need page-locked memory)."""
    assert engine.device.type == "cuda"
    assert engine.store.on_gpu and engine.store.pools[Tier.HOST].pin
    assert all(p.device.type == "cuda" for p in engine.model.parameters() if p.numel())


# ----------------------------------------------------------------------------------- fp32 equivalence

FP32_CASES = ["os-host", "os-split", "cpu-overlap", "nvme", "nvme+overlap"]


@pytest.mark.parametrize("variant", FP32_CASES)
def test_cuda_fp32_offload_trains_like_fused_adamw(variant, tmp_path):
    """HOST (pinned) and NVME offload on a GPU against plain AdamW(fused=True) on the GPU (mirrors
    test_recorded_and_planned_models_train_like_plain_pytorch)."""
    schedule = plan("gpt", os_split=variant == "os-split", overlap="overlap" in variant, nvme="nvme" in variant,
                    device="cuda")
    model, ref = gpt_model(), gpt_model().cuda()
    batches = cuda_batches(STEPS)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path, device="cuda")
    assert_on_gpu(engine)
    got = engine_run(engine, model, gpt_loss, batches, check_bytes=bytes_checker(schedule))
    want = plain_run(ref, gpt_loss, batches)
    assert_close(engine, ref, got, want)
    stats = engine.stats()
    assert stats.bytes_match(schedule) and stats.bytes_per_channel[Channel.H2D] > 0
    assert 0 < stats.peak_bytes_per_tier[Tier.DEVICE] <= schedule.budgets.device_bytes
    if "nvme" in variant:
        assert stats.bytes_per_channel[Channel.NVME_READ] > 0 and stats.bytes_per_channel[Channel.NVME_WRITE] > 0
    engine.detach()


def test_cuda_run_is_deterministic():
    """The same schedule trained twice gives the same bits: a missing stream wait (a copy racing the
    kernels that read or write its buffer) would show up as a difference that moves between runs."""
    schedule = plan("gpt", overlap=True, device="cuda")
    runs = []
    for _ in range(2):
        model = gpt_model()
        engine = executor.run(model, schedule, lr=LR, weight_decay=WD, device="cuda")
        runs.append((engine_run(engine, model, gpt_loss, cuda_batches(STEPS)), engine.state_dict()["model"]))
        engine.detach()
    assert runs[0][0] == runs[1][0]
    for name, tensor in runs[0][1].items():
        assert torch.equal(tensor, runs[1][1][name]), name


def test_cuda_overlapped_cpu_optimizer_is_bit_identical_to_the_inline_one():
    """Fuyou §4.3 overlap on a GPU: CPU steps run on the worker while backward's kernels go on, and
    the result is the same bits as stepping after backward (mirrors the CPU overlap tests)."""
    results = []
    for overlap in (False, True):
        schedule = plan("gpt", overlap=overlap, device="cuda")
        model = gpt_model()
        engine = executor.run(model, schedule, lr=LR, weight_decay=WD, device="cuda")
        in_backward = [a for a in schedule.actions
                       if a.op is Op.OPTIMIZER_STEP and schedule.moments[a.moment].phase is Phase.BACKWARD]
        assert bool(in_backward) == overlap  # the overlapped schedule really steps during backward
        losses = engine_run(engine, model, gpt_loss, cuda_batches(STEPS), check_bytes=bytes_checker(schedule))
        results.append((losses, engine.state_dict()))
        engine.detach()
    assert results[0][0] == results[1][0]
    for part in ("model", "master"):
        for name, tensor in results[0][1].get(part, {}).items():
            assert torch.equal(tensor, results[1][1][part][name]), (part, name)


# ----------------------------------------------------------------------------------- bf16


def test_cuda_bf16_matches_a_reference_mixed_precision_loop():
    """Mirrors test_bf16_matches_a_plain_mixed_precision_loop: bf16 compute copy on the GPU, fp32
    masters stepped by fused AdamW on the CPU (where the engine's HOST steps run), copied back.
    Not bit-exact on a GPU: bf16 GEMMs over params at chunk offsets may take other cuBLAS kernels than
    over fresh tensors, and one bf16 rounding apart (3.9e-3) grows over the steps; a stale or missing
    copy is far above the bound."""
    model, batches = small_gpt(), gpt_batches(10)
    master_model = copy.deepcopy(model)
    # recorded on the GPU, as it runs (CUDA kernels save other tensors for backward than the CPU's)
    schedule = build_schedule(model.to(torch.bfloat16).cuda(), lambda m: gpt_loss(m, batches[0].cuda()).backward(),
                              compute=DType.BFLOAT16)
    model = copy.deepcopy(master_model)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, precision="bf16", device="cuda")
    assert_on_gpu(engine)
    got = engine_run(engine, model, gpt_loss, [b.cuda() for b in batches], check_bytes=bytes_checker(schedule))
    compute = copy.deepcopy(master_model).to(torch.bfloat16).cuda()
    opt = torch.optim.AdamW(plain_groups(master_model), lr=LR, fused=True)  # CPU masters
    pairs = list(zip(master_model.parameters(), compute.parameters()))
    want = []
    for b in batches:
        loss = gpt_loss(compute, b.cuda())
        loss.backward()
        want.append(loss.item())
        for master, p in pairs:
            master.grad = p.grad.float().cpu()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in pairs:
                p.copy_(master)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 2e-2 * abs(b), (i, got, want)
    masters = engine.state_dict()["master"]
    for name, p in master_model.named_parameters():
        if name in masters:
            diff = (masters[name].float().cpu() - p.detach()).abs().max().item()
            assert diff <= 2e-2 * (p.detach().abs().max().item() + 1e-12), name


# ----------------------------------------------------------------------------------- activations


@pytest.mark.parametrize("variant", ["recompute", "swap-host", "recompute+swap", "swap-nvme"])
def test_cuda_activation_swap_and_recompute_train_like_plain(variant, tmp_path):
    """The engine's activation plan on a GPU: saved tensors go to pinned HOST (or NVME) on the side
    stream and come back before backward; recomputed blocks rerun their forward."""
    schedule = plan("gpt", recompute="recompute" in variant, swap="swap" in variant,
                    swap_tier=Tier.NVME if variant == "swap-nvme" else Tier.HOST, device="cuda")
    model, ref = gpt_model(), gpt_model().cuda()
    batches = cuda_batches(STEPS)
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path, device="cuda")
    modes = engine.activations.modes
    assert (ActivationMode.RECOMPUTE in modes) == ("recompute" in variant)
    got = engine_run(engine, model, gpt_loss, batches, check_bytes=bytes_checker(schedule))
    want = plain_run(ref, gpt_loss, batches)
    assert_close(engine, ref, got, want)
    if "swap" in variant:
        moved = engine.activations.stats().bytes_per_channel
        assert moved[Channel.D2H] > 0 and moved[Channel.H2D] == moved[Channel.D2H]
    engine.detach()


# ----------------------------------------------------------------------------------- checkpoints


def test_cuda_checkpoint_round_trip_continues_identically(tmp_path):
    """Mirrors test_state_dict_round_trip_continues_identically with NVME chunks on a GPU."""
    schedule = plan("gpt", nvme=True, overlap=True, device="cuda")
    batches = cuda_batches(8)
    model = gpt_model()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path / "a", device="cuda")
    engine_run(engine, model, gpt_loss, batches[:4])
    engine.save(tmp_path / "ckpt.pt")
    straight = engine_run(engine, model, gpt_loss, batches[4:])
    final = engine.state_dict()["model"]
    engine.detach()

    torch.manual_seed(123)
    resumed_model = MODELS["gpt"][0]()
    for p in resumed_model.parameters():  # other values: everything must come from the checkpoint
        torch.nn.init.normal_(p.data)
    resumed = executor.run(resumed_model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path / "b", device="cuda")
    resumed.load(tmp_path / "ckpt.pt")
    again = engine_run(resumed, resumed_model, gpt_loss, batches[4:])
    assert again == straight
    for name, tensor in resumed.state_dict()["model"].items():
        assert torch.equal(tensor, final[name]), name
    resumed.detach()
    plain = gpt_model()  # plain PyTorch reads it (CPU tensors: loads anywhere)
    plain.load_state_dict(torch.load(tmp_path / "ckpt.pt", map_location="cpu")["model"])


# ----------------------------------------------------------------------------------- a budget that lies


def test_cuda_oom_when_the_budget_lies_names_the_moment_and_loses_nothing():
    """The schedule's DEVICE budget claims memory the GPU does not have (here: a process memory
    fraction leaves room for the activations of a tiny batch, not for one 4 MB chunk). The engine must
    stop with one ExecutorError line naming the moment and the action, enter FAILED, and keep every
    chunk: the state is the one before the failed iteration, and it can still be saved."""
    torch.manual_seed(0)
    from executor.models import GPT, GPTConfig

    def build() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, vocab_size=64, block_size=16))

    batches = cuda_batches(1)
    schedule = build_schedule(build().cuda(), lambda m: gpt_loss(m, batches[0]).backward(), chunk_elements=1 << 20)
    schedule = dataclasses.replace(schedule, budgets=dataclasses.replace(schedule.budgets, device_bytes=1 << 40))
    model = build()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, device="cuda")
    before = {k: v.clone() for k, v in engine.state_dict()["model"].items()}
    # from here the GPU has room for the tiny batch's activations (a 2 MB block of the caching
    # allocator), not for the 20 MB segment the first FETCH of a 4 MB block chunk asks for; no freed
    # chunk buffer is cached yet (nothing was evicted), so that FETCH must allocate
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (4 << 20)) / total)
    try:
        with pytest.raises(ExecutorError) as info:
            engine_run(engine, model, gpt_loss, batches)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    message = str(info.value)
    assert "\n" not in message and "moment" in message and "memory" in message.lower(), message
    assert engine.state is EngineState.FAILED and engine.failure is not None and not engine.failure.torn
    after = engine.state_dict()["model"]
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    engine.detach()


# ----------------------------------------------------------------------------------- recording


def test_cuda_recording_times_moments_with_cuda_events():
    """A real recording on the GPU: per-moment times from CUDA events, the non-model peak from
    torch.cuda.max_memory_allocated (executor/recorder.py)."""
    from executor import record

    model = gpt_model().cuda()
    b = gpt_batches(1)[0].cuda()
    trace = record(model, {"idx": b, "targets": b}, model_name="gpt", timing_iterations=2)
    assert "cuda" in trace.meta.device
    work = [m for m in trace.moments if m.compute_seconds > 0]
    assert work and sum(m.compute_seconds for m in trace.moments) > 0
    assert max(m.non_model_bytes for m in trace.moments) > 0


def test_cuda_bf16_step_in_bounded_tiles_is_bit_identical_to_whole_passes(monkeypatch):
    """A bf16 chunk stepped on the GPU in tiles of DEVICE_TILE_ELEMENTS (a bounded fp32 scratch: Note
    [mixed-precision steps in tiles]) gives every bit that whole passes give, and the scratch stays a tile."""
    from executor import optim
    from executor.optim import ChunkAdamW
    from test_optim_support import TinyLM, layout_for

    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    layout = layout_for(model, chunk_elements=300, compute=DType.BFLOAT16)
    chunk = max(layout.chunks, key=lambda c: c.elements)
    g = torch.Generator(device="cuda").manual_seed(1)
    start = {k: torch.randn(chunk.elements, generator=g, device="cuda") for k in ("master", "grad", "m")}
    start["v"] = start["m"].square()
    results = []
    for tile in (1 << 30, 128):  # whole passes, then tiles that cut the chunk's tensors
        monkeypatch.setattr(optim, "DEVICE_TILE_ELEMENTS", tile)
        opt = ChunkAdamW(model.parameters(), layout, model=model, lr=1e-2)
        bufs = {k: v.clone() for k, v in start.items()}
        param = bufs["master"].to(torch.bfloat16)
        for _ in range(3):
            opt.step_chunk(chunk.id, param=param, grad=bufs["grad"].to(torch.bfloat16), master=bufs["master"],
                           exp_avg=bufs["m"], exp_avg_sq=bufs["v"])
        results.append((param, bufs["master"], bufs["m"], bufs["v"]))
        scratch = opt._scratch.by_device[torch.device("cuda", torch.cuda.current_device())]
        assert scratch.numel() <= min(tile, chunk.elements)
    for whole, tiled in zip(*results):
        assert torch.equal(whole, tiled)
