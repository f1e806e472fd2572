"""The planner's core inputs: the problem, the cost model, analytic GPT traces, the chunk layout."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from conftest import TRACES
from planner.costmodel import nvme_seconds, optimizer_seconds, transfer_seconds
from planner.errors import PlannerError
from planner.families import gpt_param_count, gpt_trace
from planner.layout import build_layout, candidate_chunk_sizes, wasted_elements
from planner.presets import resolve_hardware
from planner.problem import build_problem
from schemas import Trace
from schemas.schedule import Channel, ChunkList, Tier
from schemas.trace import DType, Phase, trace_digest

DIGEST = "sha256:" + "0" * 64
L, H, A, S, B, V = 3, 64, 4, 32, 2, 1000


def tiny(**kw):
    args = dict(layers=L, hidden=H, heads=A, seq=S, batch=B, vocab=V)
    args.update(kw)
    return gpt_trace(**args)


def problem_of(trace, hardware="cpu-emulated", **kw):
    return build_problem(trace, resolve_hardware(hardware), trace_digest=DIGEST, **kw)


# ----------------------------------------------------------------------------- families


def test_gpt_trace_counts_and_bytes_of_a_tiny_config() -> None:
    t = tiny(attention="math", loss="full")  # the written-out variant: scores and full logits kept
    assert len(t.tensors) == 2 + 12 * L + 2
    assert t.param_count == gpt_param_count(layers=L, hidden=H, vocab=V, positions=S)
    assert len(t.moments) == 4 * L + 17  # 2 + 2 (L + 3) forward, 2 + 2 (L + 3) backward, the step
    assert [m.phase for m in t.moments].count(Phase.OPTIMIZER) == 1
    tokens, x = B * S, B * S * H * 2
    block = t.block_activation_bytes()
    assert block == [16 * x + A * S * S * B * 2 + S * S + 4 * tokens * 4] * L
    forward = [m for m in t.moments if m.module == "h.0" and m.kind.value == "pre_forward"][0]
    backward = [m for m in t.moments if m.module == "h.0" and m.kind.value == "pre_backward"][0]
    assert forward.flops == 24 * H * H * tokens + 4 * B * S * S * H
    assert backward.flops == 2 * forward.flops
    assert forward.tensors == tuple(range(2, 14))  # the block's 12 tensors, in init order
    assert t.blocks[0].input_bytes == x
    # the tied head touches wte after ln_f, and in the root's backward (the loss and the head)
    head = [m for m in t.moments if m.module == "ln_f" and m.kind.value == "post_forward"][0]
    assert head.tensors == (0,) and head.flops == 2 * V * H * tokens
    assert Trace.from_msgpack(t.to_msgpack()) == t  # valid and lossless

    # the default, as training runs it: fused attention keeps an fp32 logsumexp instead of the scores and
    # the mask, and its backward is charged 5 matmuls; the chunked head keeps no logits and recomputes them
    fused = tiny()
    assert fused.block_activation_bytes() == [16 * x + A * tokens * 4 + 4 * tokens * 4] * L
    forward = [m for m in fused.moments if m.module == "h.0" and m.kind.value == "pre_forward"][0]
    backward = [m for m in fused.moments if m.module == "h.0" and m.kind.value == "pre_backward"][0]
    assert forward.flops == 24 * H * H * tokens + 4 * B * S * S * H
    assert backward.flops == 2 * forward.flops + 2 * B * S * S * H
    root = [m for m in fused.moments if m.module == "" and m.kind.value == "pre_backward"][0]
    assert root.flops == 3 * 2 * V * H * tokens
    head_kept = sum(a.bytes for a in fused.activations if a.block == -1) - sum(a.bytes for a in t.activations if a.block == -1)
    assert head_kept == tokens * 4 - B * S * V * 2 - 2  # + the logsumexp, - the fp16 logits and the loss scalar
    with pytest.raises(ValueError, match="attention sdpa"):
        tiny(attention="flash")


def test_gpt_trace_dtype_sets_the_bytes() -> None:
    assert sum(tiny(dtype="float32").block_activation_bytes()) > sum(tiny().block_activation_bytes())
    assert tiny(dtype="float32").tensors[0].bytes == V * H * 4
    with pytest.raises(ValueError, match="hidden % heads"):
        tiny(heads=5)


@pytest.mark.parametrize("name, config", [
    ("gpt-small.msgpack", dict(layers=4, heads=4, hidden=128, dtype="float32")),
    ("gpt3-1.3b.msgpack", dict(layers=24, heads=16, hidden=2048, dtype="float16")),
])
def test_gpt_trace_matches_the_recorded_trace(name: str, config: dict) -> None:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"{path} not shipped")
    recorded = Trace.read(path)
    batch, seq = recorded.meta.batch_shape
    analytic = gpt_trace(seq=seq, batch=batch, vocab=recorded.meta.model_config["vocab_size"], **config)
    assert analytic.tensors == recorded.tensors
    keys = lambda m: (m.phase, m.kind, m.module, m.block, m.tensors, m.flops)  # noqa: E731
    assert [keys(m) for m in analytic.moments] == [keys(m) for m in recorded.moments]
    acts = lambda t: [(a.block, a.bytes, a.produced_at, a.consumed_at) for a in t.activations]  # noqa: E731
    assert acts(analytic) == acts(recorded)
    assert [(b.module, b.forward_flops, b.input_bytes) for b in analytic.blocks] == \
        [(b.module, b.forward_flops, b.input_bytes) for b in recorded.blocks]
    ours = np.array([m.non_model_bytes for m in analytic.moments])
    theirs = np.array([m.non_model_bytes for m in recorded.moments])
    assert ours.max() == pytest.approx(theirs.max(), rel=0.01)
    assert np.all(np.abs(ours - theirs) <= 0.15 * theirs.max())


# ----------------------------------------------------------------------------- problem


def test_stages_are_maximal_runs_of_phase_and_block() -> None:
    p = problem_of(tiny())
    assert p.stages[0].first_moment == 0 and p.stages[-1].last_moment == len(p.moments) - 1
    for a, b in zip(p.stages, p.stages[1:]):
        assert b.first_moment == a.last_moment + 1
        assert (a.phase, a.block) != (b.phase, b.block)
    for st in p.stages:
        assert {(p.moments[m].phase, p.moments[m].block) for m in range(st.first_moment, st.last_moment + 1)} == {(st.phase, st.block)}
        assert all(p.stage_of_moment[m] == st.id for m in range(st.first_moment, st.last_moment + 1))
    assert sum(st.phase is Phase.FORWARD and st.block >= 0 for st in p.stages) == L


def test_problem_lists_follow_the_compute_dtype() -> None:
    assert problem_of(tiny()).lists == (ChunkList.PARAM, ChunkList.GRAD, ChunkList.MASTER, ChunkList.M, ChunkList.V)
    fp32 = problem_of(tiny(dtype="float32"))
    assert fp32.lists == (ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V)
    assert fp32.list_itemsize(ChunkList.PARAM) == 4 and problem_of(tiny()).list_itemsize(ChunkList.PARAM) == 2
    assert problem_of(tiny()).list_itemsize(ChunkList.M) == 4


def test_problem_resolves_times_blocks_and_capacities() -> None:
    hw = resolve_hardware("cpu-emulated")
    p = problem_of(tiny(), device_bytes=123, host_bytes=456)
    assert (p.device_bytes, p.host_bytes, p.nvme_bytes) == (123, 456, hw.nvme_bytes)
    for m in p.moments:
        assert m.compute_seconds == pytest.approx(m.flops / hw.device_flops_per_s)
    b0 = p.blocks[0]
    assert b0.tensors == tuple(range(2, 14))
    assert b0.param_bytes == sum(p.trace.tensors[t].numel for t in b0.tensors) * 2
    assert p.moments[b0.forward_moments[0]].kind.value == "pre_forward"
    assert p.moments[b0.backward_moments[1]].kind.value == "post_backward"
    assert b0.recompute_seconds == pytest.approx(b0.recompute_flops / hw.device_flops_per_s)
    assert p.tensor_order[0] == 0 and sorted(p.tensor_order) == list(range(len(p.trace.tensors)))
    assert p.moments[p.optimizer_moment].phase is Phase.OPTIMIZER


def test_measured_times_are_kept_and_the_recorded_optimizer_step_is_not_charged_twice() -> None:
    """Forward and backward keep their recorded times. The OPTIMIZER moment's recorded time is the plain
    optimizer step; the schedule's OPTIMIZER_STEP actions are that work, costed on their own channel,
    so the moment itself carries no compute."""
    path = TRACES / "gpt-small.msgpack"
    if not path.exists():
        pytest.skip("gpt-small not shipped")
    raw = path.read_bytes()
    trace = Trace.from_msgpack(raw)
    p = build_problem(trace, resolve_hardware(None), trace_digest=trace_digest(raw))
    work = [m.phase is not Phase.OPTIMIZER for m in trace.moments]
    assert [m.compute_seconds for m, w in zip(p.moments, work) if w] == [
        m.compute_seconds for m, w in zip(trace.moments, work) if w]
    assert p.compute_dtype is DType.FLOAT32
    recorded = [m for m in trace.moments if m.phase is Phase.OPTIMIZER]
    assert recorded and recorded[0].compute_seconds > 0  # the trace did time the step
    assert [m.compute_seconds for m in p.moments if m.phase is Phase.OPTIMIZER] == [0.0] * len(recorded)
    assert p.compute_seconds == pytest.approx(sum(m.compute_seconds for m in trace.moments) - sum(
        m.compute_seconds for m in recorded))


def test_world_size_disagreement_is_named() -> None:
    with pytest.raises(PlannerError, match="world_size=2.*world_size=1"):
        problem_of(tiny(world_size=2))


# ----------------------------------------------------------------------------- cost model


def test_costmodel_channels_and_stage_max() -> None:
    hw = resolve_hardware("rtx4090-768g-12ssd")
    # the arithmetic below is written around a 48 GB/s host cap (the preset's own cap is its PCIe lanes)
    hw = dataclasses.replace(hw, nvme=dataclasses.replace(hw.nvme, host_cap_gb_per_s=48.0))
    assert transfer_seconds(hw, Channel.H2D, 25e9) == pytest.approx(25e9 / hw.h2d_bytes_per_s)
    assert transfer_seconds(hw, Channel.H2D, 0) == 0.0
    # 12 SSDs read behind the 48 GB/s host-side cap; reads alone at the cap, writes alone at 12 x 3.4
    read, write = min(hw.nvme_read_bytes_per_s, 48e9), min(hw.nvme_write_bytes_per_s, 48e9)
    assert read == 48e9 < hw.nvme_read_bytes_per_s
    assert nvme_seconds(hw, 1e9, 0) == pytest.approx(1e9 / read)
    assert nvme_seconds(hw, 0, 1e9) == pytest.approx(1e9 / write)
    # both at once: 12 x 2.2 GB/s each way (nvme.mixed_*), 52.8 GB/s together, held to the 48 GB/s cap:
    # 2 GB take 2/48 s, less than the simplex sum 1/48 + 1/40.8 (mixing pays behind the cap)
    assert nvme_seconds(hw, 1e9, 1e9) == pytest.approx(2e9 / 48e9)
    assert nvme_seconds(hw, 1e9, 1e9) < 1e9 / read + 1e9 / write
    simplex = dataclasses.replace(hw, nvme=dataclasses.replace(hw.nvme, mixed_read_gb_per_s_each=0.0,
                                                               mixed_write_gb_per_s_each=0.0))
    assert nvme_seconds(simplex, 1e9, 1e9) == pytest.approx(1e9 / read + 1e9 / write)  # unmeasured: simplex (Fuyou Eq. 4)
    # mixing that does not pay (mr/r + mw/w <= 1, no cap): the drives serialize, the simplex sum
    slow = dataclasses.replace(simplex, nvme=dataclasses.replace(hw.nvme, host_cap_gb_per_s=0.0, mixed_read_gb_per_s_each=1.0,
                                                                 mixed_write_gb_per_s_each=1.0))
    r, w = hw.nvme_read_bytes_per_s, hw.nvme_write_bytes_per_s
    assert nvme_seconds(slow, 1e9, 1e9) == pytest.approx(1e9 / r + 1e9 / w)
    assert optimizer_seconds(hw, Tier.HOST, 10**9) == pytest.approx(1e9 / hw.cpu_adam_params_per_s(hw.host.cores))
    assert optimizer_seconds(hw, Tier.DEVICE, 10**9) == pytest.approx(1e9 / hw.device.optimizer_params_per_s)
    no_ssd = resolve_hardware("rtx4090-128g")
    assert math.isinf(transfer_seconds(no_ssd, Channel.NVME_READ, 1))


# ----------------------------------------------------------------------------- layout


def test_layout_first_access_order_identical_offsets_and_blocks() -> None:
    p = problem_of(tiny())
    layout = build_layout(p, chunk_elements=8192)
    assert layout.lists == p.lists and set(layout.list_dtypes) == set(p.lists)
    rank = {t: i for i, t in enumerate(p.tensor_order)}
    firsts = []
    for chunk in layout.chunks:  # inside a chunk, and from chunk to chunk, tensors come in first-access order
        slots = sorted((s for s in layout.tensors if s.chunk == chunk.id), key=lambda s: s.offset_elements)
        assert [rank[s.tensor] for s in slots] == sorted(rank[s.tensor] for s in slots)
        firsts.append(rank[slots[0].tensor])
    assert firsts == sorted(firsts)
    assert sorted(s.tensor for s in layout.tensors) == list(range(len(p.trace.tensors)))  # each tensor once
    for chunk in layout.chunks:
        slots = [s for s in layout.tensors if s.chunk == chunk.id]
        assert {p.tensor_block[s.tensor] for s in slots} == {chunk.block}  # never spans blocks
        assert chunk.used_elements == sum(s.numel for s in slots) <= chunk.elements
        ends = 0
        for s in sorted(slots, key=lambda s: s.offset_elements):
            assert s.offset_elements >= ends
            ends = s.offset_elements + s.numel
    # one (chunk, offset) per tensor serves every list: the same index in PARAM, MASTER, M, V
    assert len({(s.chunk, s.offset_elements) for s in layout.tensors}) == len(layout.tensors)


def test_oversize_tensor_gets_its_own_chunk() -> None:
    p = problem_of(tiny())
    layout = build_layout(p, chunk_elements=4096)  # wte (1000 x 64) and the block's matrices are bigger
    for slot in layout.tensors:
        if slot.numel > 4096:
            own = layout.chunks[slot.chunk]
            assert own.elements == own.used_elements == slot.numel and slot.offset_elements == 0
            assert [s.tensor for s in layout.tensors if s.chunk == slot.chunk] == [slot.tensor]
    assert all(c.elements == 4096 for c in layout.chunks if c.used_elements <= 4096)
    # the small tensors of a block keep sharing the chunk that was open around its big ones
    for b in range(L):
        partly = [c for c in layout.chunks if c.block == b and c.used_elements < c.elements]
        assert len(partly) <= 2 and sum(c.used_elements for c in partly) == 13 * H  # biases and LayerNorms


def test_tied_tensor_is_placed_once_where_first_used() -> None:
    p = problem_of(tiny())
    uses = [m.id for m in p.moments if 0 in m.tensors and m.phase is not Phase.OPTIMIZER]
    assert len(uses) == 4  # wte forward, the head, the head's backward, wte backward
    layout = build_layout(p, chunk_elements=1 << 20)
    assert [s.tensor for s in layout.tensors].count(0) == 1
    assert layout.tensors[0].tensor == 0 and layout.tensors[0].chunk == 0


def test_comm_groups_with_several_ranks() -> None:
    hw = resolve_hardware("v100-32g-240g-8gpu")
    ws = hw.cluster.world_size
    p = build_problem(tiny(world_size=ws), hw, trace_digest=DIGEST)
    layout = build_layout(p, chunk_elements=8192)
    assert len(layout.chunks) % ws == 0
    for c in layout.chunks:
        assert c.comm_group == c.id // ws and c.owner_rank == c.id % ws
    for g in range(len(layout.chunks) // ws):
        group = layout.chunks[g * ws:(g + 1) * ws]
        assert len({c.elements for c in group}) == 1 and len({c.block for c in group}) == 1
    assert any(c.used_elements == 0 for c in layout.chunks)  # padding


def test_candidate_chunk_sizes_are_bounded_powers_of_two_and_a_block() -> None:
    from planner.layout import _packing_size

    p = problem_of(tiny())
    sizes = candidate_chunk_sizes(p)
    assert sizes == sorted(set(sizes)) and 1 <= len(sizes) <= 8
    block = [p.trace.tensors[t].numel for t in p.tensor_order if p.tensor_block[t] == 0]
    whole_block = sum(block)
    assert whole_block in sizes  # one chunk per block: never dominated (fewest chunks, no waste)
    packed = {_packing_size(block, k) for k in (2, 3, 4)} - {None}
    assert all(s & (s - 1) == 0 or s == 4 * H * H or s == whole_block or s in packed for s in sizes)
    shape = {}
    for size in sizes:
        layout = build_layout(p, chunk_elements=size)
        shape[size] = (len(layout.chunks), wasted_elements(layout))
        assert wasted_elements(layout) >= 0
    # no candidate is dominated: another with no more chunks and no more waste
    for a in sizes:
        assert not any(b != a and shape[b] != shape[a] and shape[b][0] <= shape[a][0] and shape[b][1] <= shape[a][1]
                       for b in sizes)


def test_packing_size_packs_a_block_into_k_chunks() -> None:
    from planner.layout import _first_fit_chunks, _packing_size

    numels = [2, 300, 3, 100, 2, 400, 4, 400, 1]  # LayerNorm, qkv, bias, proj, LayerNorm, fc1, bias, fc2, bias
    for k in (2, 3, 4):
        size = _packing_size(numels, k)
        assert size is not None and _first_fit_chunks(numels, size) <= k
        assert _first_fit_chunks(numels, size - max(1, sum(numels) // 1024) - 1) > k or size == max(numels)
    assert _packing_size(numels, 20) is None  # fewer tensors than chunks


def test_layout_is_deterministic() -> None:
    p = problem_of(tiny())
    assert build_layout(p, chunk_elements=8192) == build_layout(p, chunk_elements=8192)


def test_costmodel_prices_what_the_profile_measures() -> None:
    """Issue 17 items 1-2: pageable, both-ways, with-copies and shape-dependent rates, the margin."""
    from planner.costmodel import (
        channel_bytes_per_s, cpu_adam_params_per_s, device_capacity_bytes, dram_bytes, dram_bytes_per_s, moment_seconds,
    )
    hw = resolve_hardware("rtx4090-768g-12ssd")
    # the figures below are written around these rates (the preset's own are sourced and move)
    hw = dataclasses.replace(hw, links=dataclasses.replace(hw.links, duplex_h2d_gb_per_s=21.0, duplex_d2h_gb_per_s=21.0,
                                                           h2d_pageable_gb_per_s=10.0, d2h_pageable_gb_per_s=10.0),
                             host=dataclasses.replace(hw.host, dram_gb_per_s=409.6))
    assert channel_bytes_per_s(hw, Channel.H2D, pageable=True) == pytest.approx(10e9)
    assert channel_bytes_per_s(hw, Channel.D2H, duplex=True) == pytest.approx(21e9)
    assert cpu_adam_params_per_s(hw, with_copies=True) == pytest.approx(1.2e9)
    assert cpu_adam_params_per_s(hw) == pytest.approx(1.5e9)
    assert device_capacity_bytes(hw) == hw.device_bytes - int(1e9)
    assert dram_bytes_per_s(hw) == pytest.approx(409.6e9)
    # DEVICE <-> NVMe passes host memory twice (bounce buffer); a pageable copy three times
    assert dram_bytes(hw, (Channel.NVME_READ, Channel.H2D), 100) == 200
    assert dram_bytes(hw, (Channel.H2D,), 100, pageable=True) == 300
    # a GPT-3 13B block at batch 8: the MLP GEMMs at the table's 164 TFLOPS, attention slower
    from planner.families import gpt_trace
    trace = gpt_trace(layers=1, hidden=5120, heads=40, seq=1024, batch=8)
    block = next(m for m in trace.moments if m.block == 0 and m.flops > 0)
    seconds = moment_seconds(hw, trace, block)
    assert seconds > block.flops / hw.device_flops_per_s  # attention at 110 TFLOPS, not 164
    assert seconds < block.flops / 110e12
    flat = dataclasses.replace(hw, device=dataclasses.replace(hw.device, matmul_rates=(), attention_rates=()))
    assert moment_seconds(flat, trace, block) == pytest.approx(block.flops / hw.device_flops_per_s)
    # batch 1: the GEMMs run slower per FLOP (158.6 vs 164 TFLOPS, both measured)
    small = gpt_trace(layers=1, hidden=5120, heads=40, seq=1024, batch=1)
    b1 = next(m for m in small.moments if m.block == 0 and m.flops > 0)
    assert moment_seconds(hw, small, b1) / b1.flops > seconds / block.flops


def test_two_way_rows_are_the_least_time_of_any_overlap() -> None:
    """costmodel.two_way_rows (LP duality): where running both directions at once pays, the rows are
    the exact least time; where it does not, the simplex sum; every row a lower bound of any mix."""
    from planner.costmodel import pcie_time_rows, two_way_rows

    def least(rows, r_bytes, w_bytes):
        return max(a * r_bytes + b * w_bytes for a, b in rows)

    # PCIe 25 GB/s each way alone, 21 + 21 both at once (rtx4090-768g-12ssd): both at once pays
    rows = two_way_rows(25.0, 25.0, 21.0, 21.0)
    assert least(rows, 21.0, 21.0) == pytest.approx(1.0)  # one second both ways at once
    assert least(rows, 46.0, 21.0) == pytest.approx(2.0)  # then 25 more bytes alone
    assert least(rows, 25.0, 0.0) == pytest.approx(1.0)
    assert least(rows, 46.0, 21.0) > (46.0 + 21.0) / 42.0  # the placement model's old row (H + D) / 42: 1.6 s
    # mixing that does not pay: the simplex sum
    assert least(two_way_rows(6.0, 3.0, 2.0, 1.0), 6.0, 3.0) == pytest.approx(2.0)
    # unmeasured both-ways rates: simplex
    assert least(two_way_rows(6.0, 3.0, 0.0, 0.0), 6.0, 3.0) == pytest.approx(2.0)
    # a cap on both together
    assert least(two_way_rows(10.0, 10.0, 10.0, 10.0, cap=10.0), 5.0, 5.0) == pytest.approx(1.0)
    hw = resolve_hardware("rtx4090-768g-12ssd")
    hw = dataclasses.replace(hw, links=dataclasses.replace(hw.links, h2d_gb_per_s=25.0, d2h_gb_per_s=25.0,
                                                           duplex_h2d_gb_per_s=21.0, duplex_d2h_gb_per_s=21.0))
    assert least(pcie_time_rows(hw), 46e9, 21e9) == pytest.approx(2.0)


def test_cpu_adam_is_never_faster_with_copies_beside_it() -> None:
    """A loaded profile run measured Adam faster with copies than alone (noise): priced at the rate alone."""
    from planner.costmodel import cpu_adam_params_per_s
    from schemas.hardware import AdamRate

    hw = resolve_hardware("cpu-emulated")
    noisy = dataclasses.replace(hw, host=dataclasses.replace(hw.host, adam_rates=(
        AdamRate(threads=2, params_per_s=1.47e8, params_per_s_with_copies=8.33e8),)))
    assert cpu_adam_params_per_s(noisy, with_copies=True) == pytest.approx(1.47e8)
    assert cpu_adam_params_per_s(hw, with_copies=True) == pytest.approx(3.98e8)  # below the rate alone: as measured
