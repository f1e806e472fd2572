"""A plain Accelerate loop with tide, on a LoRA-style model (issue 20): a frozen base with small
trainable adapters trains like plain PyTorch, and optimizer state (M, V) exists only for the
chunks that hold the adapters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

import executor  # noqa: E402
from executor.integrations import EngineOptimizer  # noqa: E402
from planner.layout import build_layout  # noqa: E402
from planner.materialize import Decisions, EvictionRule, materialize  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from planner.problem import build_problem  # noqa: E402
from schemas._base import digest_bytes  # noqa: E402
from schemas.schedule import ActivationMode, ChunkList, ChunkPlan, Op, Tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS, DIM, RANK = 8, 64, 4


class LoraLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.base.requires_grad_(False)  # the frozen base
        self.lora_a = nn.Parameter(torch.randn(RANK, DIM) * 0.01)
        self.lora_b = nn.Parameter(torch.randn(DIM, RANK) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


class LoraNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([nn.Sequential(LoraLinear(), nn.GELU()) for _ in range(4)])
        self.head = nn.Linear(DIM, 1)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return self.head(x).pow(2).mean()


def build() -> LoraNet:
    torch.manual_seed(0)
    return LoraNet()


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, DIM, generator=g) for _ in range(STEPS)]


def schedule_for(model: nn.Module):
    """Planner decisions forcing eviction (PARAM chunks leave DEVICE), OS on HOST."""
    trace = executor.record(model, batches()[0], timing_iterations=1)
    problem = build_problem(trace, resolve_hardware("cpu-emulated"), trace_digest=digest_bytes(trace.to_msgpack()))
    layout = build_layout(problem, chunk_elements=4096)
    cap = max(c.elements for c in layout.chunks) * 4
    for chunks in range(2, 16):
        try:
            return trace, materialize(problem, Decisions(
                policy="tide", layout=layout,
                chunk_plans=tuple(ChunkPlan(chunk=c.id, os_tier=Tier.HOST, optimizer_tier=Tier.HOST) for c in layout.chunks),
                activation_modes=(ActivationMode.KEEP,) * len(problem.blocks),
                param_device_budget_bytes=(cap * chunks,) * len(problem.moments), persistent_chunks=frozenset(),
                optimizer_overlap=False, prefetch=True, eviction=EvictionRule.BELADY_CLEAN_FIRST))
        except Exception:  # noqa: BLE001 - too small a budget: one chunk more
            continue
    raise AssertionError("no feasible budget")


def test_lora_under_accelerate_trains_like_plain_pytorch_with_os_for_adapters_only():
    from accelerate import Accelerator

    model = build()
    trace, schedule = schedule_for(model)
    assert {t.trainable for t in trace.tensors} == {True, False}
    assert any(a.op is Op.EVICT and a.src is Tier.DEVICE for a in schedule.actions)

    # optimizer state only where the adapters are: every M/V chunk holds trainable tensors only
    trainable = {t.id for t in trace.tensors if t.trainable}
    slots = schedule.layout.tensors
    os_chunks = {r.chunk for r in schedule.initial_residency if r.list in (ChunkList.M, ChunkList.V) and r.tiers}
    assert os_chunks == {s.chunk for s in slots if s.tensor in trainable}
    assert all(s.tensor in trainable for s in slots if s.chunk in os_chunks)
    os_bytes = sum(schedule.layout.chunks[c].elements * 4 * 2 for c in os_chunks)  # M and V, fp32
    adapter_bytes = sum(t.bytes for t in trace.tensors if t.trainable)
    frozen_bytes = sum(t.bytes for t in trace.tensors if not t.trainable)
    assert 2 * adapter_bytes <= os_bytes < 2 * frozen_bytes  # far below what the base would need

    # plain PyTorch: AdamW(fused) on the adapters
    ref = build()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0, fused=True)
    plain = []
    for x in batches():
        loss = ref(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain.append(loss.item())

    # the Accelerate loop: prepare, accelerator.backward, optimizer.step
    engine = executor.run(model, schedule, lr=1e-2, weight_decay=0.0, device="cpu")
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, EngineOptimizer(engine))
    losses = []
    for x in batches():
        loss = model(x)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-6, atol=0)
    assert losses[-1] < losses[0]
    state = engine.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state["model"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert len(state["optimizer"]["state"]) == len(trainable)  # moments for the adapters only
    assert engine.stats().optimizer_state_bytes == os_bytes  # fp32 training: M and V, no MASTER list
    # engine.stats(): HOST holds the PARAM chunks, and GRAD + M + V of the adapters' chunks only; with
    # optimizer state for every chunk (frozen ones too) it would need 2 x all chunks more
    chunk_bytes = [c.elements * 4 for c in schedule.layout.chunks]
    adapters_only = sum(chunk_bytes) + 3 * sum(chunk_bytes[c] for c in os_chunks)
    peak = engine.stats().peak_bytes_per_tier[Tier.HOST]
    assert sum(chunk_bytes) + os_bytes <= peak <= adapters_only < 3 * sum(chunk_bytes)
