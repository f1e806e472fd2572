"""The engine's activation plan runs through ActivationManager (executor/runtime.py): with the
schedule evicting block PARAM chunks from DEVICE, the blocks' saved weights must be stored as the
engine's chunk references (alias_pack), or backward reads reused chunk buffers; swapped blocks go
to HOST and NVME, a recomputed block reruns its forward. The hand-built schedule has no
ACT_RELOAD actions: the unpacks start the reloads.

Offloaded recompute checkpoints (ACT_OFFLOAD / ACT_RELOAD on a RECOMPUTE block) are tested on
schedules the planner makes from recorded traces, including the `python -m planner solve` command.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from executor_support import build_schedule
from torch import nn

import executor
from executor.activations import checkpoint_tiers
from executor.models import GPT, GPTConfig, build_gpt2
from executor.recorder import record
from schemas._base import digest_bytes
from schemas.schedule import ActivationMode, Channel, ChunkList, Op, Schedule, Tier

LR, WD = 1e-2, 0.1
MODES = [ActivationMode.SWAP_HOST, ActivationMode.RECOMPUTE, ActivationMode.SWAP_NVME, ActivationMode.KEEP]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


# ----------------------------------------------------------------------- offloaded recompute checkpoints
# A RECOMPUTE block whose checkpoint (its input) the planner parks on HOST or NVME: ACT_OFFLOAD /
# ACT_RELOAD on a RECOMPUTE block. Recorded for real on the CPU, planned by the planner (materialize
# with explicit decisions, `solve`, and the `python -m planner solve` command), replayed by the
# engine: the same losses and params as plain PyTorch, the predicted bytes on every channel, and
# chunks + activations on DEVICE within the schedule's budget at every moment.

KEEP, RECOMPUTE, SWAP_HOST = ActivationMode.KEEP, ActivationMode.RECOMPUTE, ActivationMode.SWAP_HOST
CKPT_STEPS = 6
CKPT_LR = 1e-2
CHUNK_ELEMENTS = 4096


class TanhBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, gate, *, extra):
        return torch.tanh(self.lin(x) * gate + extra["bias"])


class Chained(nn.Module):
    """The checkpoint's corner cases: a block's output is saved by that block itself (tanh saves its
    result) and is the next block's input; a root param (`gate`) is an input of every block; a
    tensor nested in a keyword dict (`extra`) is an input of every block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(TanhBlock() for _ in range(3))
        self.gate = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 32)

    def forward(self, idx):
        x = self.emb(idx)
        extra = {"bias": torch.linspace(-0.1, 0.1, 16, device=idx.device)}
        for block in self.blocks:
            x = block(x, self.gate, extra=extra)
        return F.cross_entropy(self.head(x).view(-1, 32), idx.view(-1))


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64, block_size=16))


def _hf():
    torch.manual_seed(0)
    return build_gpt2(dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))


def _chained():
    torch.manual_seed(0)
    return Chained()


# name -> (build, batch for the recorder, loss, vocabulary)
CKPT_MODELS = {
    "gpt": (_gpt, lambda b: {"idx": b, "targets": b}, lambda m, b: m(b, b), 64),
    "hf-gpt2": (_hf, lambda b: {"input_ids": b, "labels": b}, lambda m, b: m(input_ids=b, labels=b).loss, 64),
    "chained": (_chained, lambda b: b, lambda m, b: m(b), 32),
}


def _batches(n, vocab):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 16), generator=gen) for _ in range(n)]


@functools.cache
def _recorded(name):
    build, as_batch, _, vocab = CKPT_MODELS[name]
    torch.set_num_threads(1)
    trace = record(build(), as_batch(_batches(1, vocab)[0]), model_name=name, timing_iterations=1)
    return trace, digest_bytes(trace.to_msgpack())


def _hardware():
    from planner.presets import resolve_hardware

    return resolve_hardware("cpu-emulated")


def _tight_schedule(name, modes, tier):
    """Explicit decisions (`modes`, checkpoints of RECOMPUTE blocks on `tier`, OS on HOST) on the
    smallest DEVICE the planner accepts: PARAM chunks are evicted, every byte counts."""
    from planner.errors import PlannerError
    from planner.layout import build_layout
    from planner.materialize import Decisions, EvictionRule, materialize, non_model_curve, param_budget_bytes
    from planner.problem import build_problem
    from schemas.schedule import ChunkPlan

    trace, digest = _recorded(name)
    problem = build_problem(trace, _hardware(), trace_digest=digest)
    layout = build_layout(problem, chunk_elements=CHUNK_ELEMENTS)
    plans = tuple(ChunkPlan(chunk=c.id, os_tier=Tier.HOST, optimizer_tier=Tier.HOST) for c in layout.chunks)
    floor = int(non_model_curve(problem, modes, tier).max())
    chunk_bytes = max(c.elements for c in layout.chunks) * 4
    for k in range(1, 64):
        problem = build_problem(trace, _hardware(), trace_digest=digest, device_bytes=floor + k * chunk_bytes)
        decisions = Decisions(policy="tide", layout=layout, chunk_plans=plans, activation_modes=tuple(modes),
                              param_device_budget_bytes=param_budget_bytes(problem, layout, plans, modes, tier),
                              persistent_chunks=frozenset(), optimizer_overlap=True, prefetch=True,
                              eviction=EvictionRule.BELADY_CLEAN_FIRST, checkpoint_tier=tier)
        try:
            return problem, materialize(problem, decisions)
        except PlannerError:
            continue
    raise AssertionError("no DEVICE budget fits")


def _device_meter(engine):
    """The most chunk + activation bytes the engine holds on DEVICE, sampled after every moment's
    actions and every chunk allocation (the points where it enforces the budget)."""
    pool = engine.store.pools[Tier.DEVICE]
    peak = [0]

    def sample():  # evicted chunks whose copies are in flight and offloads in flight count (Note [activations])
        peak[0] = max(peak[0], pool.held_bytes + engine._activation_device_bytes())

    check, allocate = engine._check_device_budget, pool.allocate

    def checked(m):
        check(m)  # waits for bytes in flight to land when they do not fit
        sample()

    def allocated(*args, **kwargs):
        out = allocate(*args, **kwargs)
        sample()
        return out

    engine._check_device_budget, pool.allocate = checked, allocated
    return peak


def _reload_log(manager):
    """(block, started by prefetch) for every reload the manager starts: the schedule's ACT_RELOAD
    prefetches, or an unpack that found nothing coming back."""
    log, in_prefetch = [], [False]
    prefetch, reload = manager.prefetch, manager._reload

    def prefetching(block):
        in_prefetch[0] = True
        try:
            prefetch(block)
        finally:
            in_prefetch[0] = False

    def reloading(record):
        log.append((record.block, in_prefetch[0]))
        reload(record)

    manager.prefetch, manager._reload = prefetching, reloading
    return log


def _plain_ckpt(model, loss_fn, batches):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=CKPT_LR, fused=True)
    losses = []
    for b in batches:
        loss = loss_fn(model, b)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _replay_and_compare(schedule, name, *, steps=CKPT_STEPS, nvme_dir=None):
    """Train `steps` under the engine and plainly; check bytes and DEVICE every step; return the engine."""
    build, _, loss_fn, vocab = CKPT_MODELS[name]
    model, ref = build(), build()
    batches = _batches(steps, vocab)
    engine = executor.run(model, schedule, lr=CKPT_LR, weight_decay=WD, nvme_dir=nvme_dir)
    peak = _device_meter(engine)
    reloads = _reload_log(engine.activations)
    losses = []
    for b in batches:
        loss = loss_fn(model, b)
        loss.backward()
        losses.append(loss.item())
        engine.step()
        engine.zero_grad()
        stats = engine.stats()
        assert stats.bytes_match(schedule), (stats.bytes_per_channel, schedule.prediction.bytes_per_channel)
    assert 0 < peak[0] <= schedule.budgets.device_bytes
    # every checkpoint came back by its ACT_RELOAD, before the block's backward needed it
    checkpoints = checkpoint_tiers(schedule)
    assert {b for b, _ in reloads} >= set(checkpoints)
    assert all(prefetched for b, prefetched in reloads if b in checkpoints)
    want = _plain_ckpt(ref, loss_fn, batches)
    assert losses == want  # bit-identical: the same kernels on the same bytes
    got = engine.state_dict()["model"]
    for pname, p in ref.named_parameters():
        assert torch.equal(got[pname], p.detach()), pname
    return engine


def _offloaded_checkpoints(schedule):
    """{block: tier} of RECOMPUTE blocks with ACT_OFFLOAD, checked against the plan's input_bytes."""
    found = checkpoint_tiers(schedule)
    plans = {p.block: p for p in schedule.activation_plans}
    for a in schedule.actions:
        if a.op in (Op.ACT_OFFLOAD, Op.ACT_RELOAD) and a.block in found:
            assert plans[a.block].mode is RECOMPUTE and a.bytes == plans[a.block].input_bytes > 0
    return found


CKPT_CASES = [("gpt", (KEEP, RECOMPUTE, RECOMPUTE), Tier.HOST),
              ("hf-gpt2", (RECOMPUTE, RECOMPUTE), Tier.HOST),
              ("chained", (KEEP, RECOMPUTE, RECOMPUTE), Tier.HOST),
              ("gpt", (SWAP_HOST, RECOMPUTE, RECOMPUTE), Tier.NVME)]


@pytest.mark.parametrize(("name", "modes", "tier"), CKPT_CASES,
                         ids=["gpt-host", "hf-gpt2-shared-mask-host", "chained-host", "gpt-swap-nvme"])
def test_offloaded_recompute_checkpoints_train_like_plain_pytorch(name, modes, tier, tmp_path):
    problem, schedule = _tight_schedule(name, modes, tier)
    recompute = [b for b, m in enumerate(modes) if m is RECOMPUTE]
    assert _offloaded_checkpoints(schedule) == {b: tier for b in recompute}  # not vacuous
    assert any(a.op is Op.EVICT and a.src is Tier.DEVICE and a.list is ChunkList.PARAM for a in schedule.actions)
    engine = _replay_and_compare(schedule, name, nvme_dir=tmp_path)
    assert engine.activations.checkpoint_tiers == {b: tier for b in recompute}
    stats = engine.activations.stats()
    for b in recompute:  # each checkpoint went down and came back once per step, whole
        nbytes = schedule.activation_plans[b].input_bytes
        assert stats.offloaded_bytes_per_block[b] == stats.reloaded_bytes_per_block[b] == CKPT_STEPS * nbytes
    # (the SWAP_HOST block of the NVME case goes to HOST: only checkpoints reach the checkpoint tier)
    assert stats.offloaded_bytes[tier] == CKPT_STEPS * sum(schedule.activation_plans[b].input_bytes for b in recompute)
    assert stats.live_bytes == 0
    if tier is Tier.NVME:
        assert list(tmp_path.rglob("*.act"))
    engine.detach()
    assert not list(tmp_path.rglob("*.act"))


def test_checkpoint_bytes_are_the_block_inputs_without_params_and_per_block():
    """What the recorder counts as a block's input_bytes (and the planner moves) for the corner
    cases: the root param passed in is not counted; the previous block's output, which that block
    saved itself, and the shared keyword tensor are counted for every block that takes them."""
    trace, _ = _recorded("chained")
    x_bytes, extra_bytes = 2 * 16 * 16 * 4, 16 * 4  # (B, T, C) fp32 hidden state; the (16,) bias
    assert [b.input_bytes for b in trace.blocks] == [x_bytes + extra_bytes] * 3
    # block 1's input is block 0's tanh output: block 0 saved it first, so it is block 0's activation
    per_block = collections.Counter()
    for a in trace.activations:
        per_block[a.block] += a.bytes
    assert per_block[0] == per_block[1] + x_bytes


def test_solved_schedule_with_offloaded_checkpoints_trains_like_plain_pytorch():
    """`planner.solve` (checkpoint offload on, the default) on a DEVICE so small that it recomputes
    blocks and parks their checkpoints on HOST."""
    budget, schedule = _solved_with_checkpoint_offload("gpt")
    assert schedule.budgets.device_bytes == budget
    assert _offloaded_checkpoints(schedule)
    _replay_and_compare(schedule, "gpt", steps=8)


@functools.cache
def _solved_with_checkpoint_offload(name):
    """The largest DEVICE budget (a fraction of the recorded non-model peak, 1% steps) at which
    `solve` offloads recompute checkpoints; which one depends on the recorded times."""
    from planner.errors import PlannerError
    from planner.solve import solve

    trace, digest = _recorded(name)
    peak = max(m.non_model_bytes for m in trace.moments)
    for percent in range(100, 70, -1):
        budget = peak * percent // 100
        try:
            schedule = solve(trace, _hardware(), trace_digest=digest, device_bytes=budget, time_limit_s=20)
        except PlannerError:
            continue
        if checkpoint_tiers(schedule):
            return budget, schedule
    raise AssertionError(f"solve never offloaded a recompute checkpoint of {name}")


def test_planner_solve_command_default_output_replays(tmp_path):
    """The user's path: `python -m planner solve TRACE --device-memory-gb X` (defaults otherwise,
    so checkpoint offload is on), then `executor.run` on the file it wrote."""
    budget, _ = _solved_with_checkpoint_offload("gpt")
    trace, _ = _recorded("gpt")
    trace_path, out = tmp_path / "gpt.trace.msgpack", tmp_path / "gpt.schedule.msgpack"
    trace.write(trace_path)
    gb = repr((budget + 0.5) / 1e9)  # the command takes GB; int(gb * 1e9) gives `budget` back
    from planner.cli import main as planner_main

    # the command's main(), in this process: a child would only add ~2 s of imports (planner, OR-Tools)
    assert planner_main(["solve", str(trace_path), "--device-memory-gb", gb, "-o", str(out)]) == 0
    schedule = Schedule.read(out)
    assert schedule.budgets.device_bytes == budget
    assert _offloaded_checkpoints(schedule)
    _replay_and_compare(schedule, "gpt", steps=4)
