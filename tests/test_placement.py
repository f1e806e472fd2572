"""`planner.placement` on hand-built inputs: the model's rows do what the docstring says."""

from __future__ import annotations

import dataclasses

import pytest

from planner.exact import ExactModel, split_chunk_classes
from planner.placement import (
    MIP_RELATIVE_GAP,
    BlockData,
    ChunkClass,
    PlacementInfeasible,
    PlacementInput,
    PlacementModel,
    StageData,
    minimal_capacity,
)
from schemas.schedule import ActivationMode, Phase, SolverStatus, Tier

MIB = 2**20


def synthetic(layers: int = 3, chunks: int = 2, *, device_mib: float = 64, act_mib: float = 4, compute_s: float = 1e-3,
              overlap: bool = True, nvme: bool = True) -> PlacementInput:
    """A GPT-like iteration: embedding stage, one forward and one backward stage per block, optimizer."""
    elements = MIB // 4  # 1 MiB fp32 PARAM chunks
    stages = [StageData(id=0, name="forward embedding", phase=Phase.FORWARD, compute_seconds=1e-5, non_model_bytes=MIB)]
    for b in range(layers):
        stages.append(StageData(id=len(stages), name=f"forward {b}", phase=Phase.FORWARD, compute_seconds=compute_s,
                                non_model_bytes=int((b + 1) * act_mib * MIB)))
    for b in reversed(range(layers)):
        stages.append(StageData(id=len(stages), name=f"backward {b}", phase=Phase.BACKWARD, compute_seconds=2 * compute_s,
                                non_model_bytes=int((b + 2) * act_mib * MIB)))
    stages.append(StageData(id=len(stages), name="optimizer", phase=Phase.OPTIMIZER, compute_seconds=0, non_model_bytes=0))
    n = len(stages)
    fwd, bwd = (lambda b: 1 + b), (lambda b: 2 * layers - b)
    classes = []
    for b in range(layers):
        classes.append(ChunkClass(id=b, chunks=tuple(range(b * chunks, (b + 1) * chunks)), param_bytes=MIB, os_bytes=2 * MIB,
                                elements=elements, trainable=True, use_stages=(fwd(b), bwd(b)),
                                first_backward_stage=bwd(b), last_backward_stage=bwd(b)))
    blocks = [BlockData(id=b, activation_bytes=int(act_mib * MIB), input_bytes=int(act_mib * MIB) // 8,
                        recompute_seconds=compute_s, forward_stage=fwd(b), backward_stage=bwd(b)) for b in range(layers)]
    return PlacementInput(
        chunk_classes=tuple(classes), blocks=tuple(blocks), stages=tuple(stages), device_bytes=int(device_mib * MIB),
        host_bytes=10**12, nvme_bytes=10**12 if nvme else 0, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
        nvme_read_bytes_per_s=2e9 if nvme else 0.0, nvme_write_bytes_per_s=1e9 if nvme else 0.0,
        cpu_adam_seconds_per_element=1e-9, gpu_adam_seconds_per_element=1e-11, optimizer_overlap=overlap,
        optimizer_stage=n - 1)


def test_everything_fits_means_compute_bound_and_no_traffic():
    data = synthetic(device_mib=10_000)
    sol = PlacementModel(data).solve()
    assert sol.status is SolverStatus.OPTIMAL
    compute = sum(st.compute_seconds for st in data.stages)
    gpu_adam = sum(g.count * g.elements for g in data.chunk_classes) * data.gpu_adam_seconds_per_element
    # the MIP stops within MIP_RELATIVE_GAP of its bound: the iteration is the compute, give or take that
    assert compute * (1 - 1e-6) <= sol.objective_seconds <= (compute + gpu_adam) * (1 + MIP_RELATIVE_GAP)
    assert all(m is ActivationMode.KEEP for m in sol.activation_modes)


def test_memory_rows_hold_and_lp_bounds_the_mip():
    data = synthetic(device_mib=40)
    lp = PlacementModel(data, relax=True).solve()
    mip = PlacementModel(data).solve()
    assert lp.objective_seconds <= mip.objective_seconds * (1 + 1e-6)
    assert mip.bound_seconds <= mip.objective_seconds
    assert max(mip.device_bytes_per_stage) <= data.device_bytes + 1
    # every count integral and within its chunk class
    for g, row, pers in zip(data.chunk_classes, mip.resident, mip.persistent):
        assert all(float(x).is_integer() and 0 <= x <= g.count for x in row)
        assert all(x >= pers for x in row)
        for s in g.use_stages:
            assert row[s] == g.count


def test_a_lean_search_passes_highs_its_options_and_bounds_the_same_mip(monkeypatch):
    """Note [a polish's work in nodes] (planner/mathopt_solver.py): a lean search hands HiGHS no root restart and
    no strong branching, options HiGHS knows (an unknown option name fails the solve), and its plan is the same
    model's: between the LP and the plain search's plan plus the MIP gap, with a valid dual bound."""
    import planner.mathopt_solver as mathopt_solver

    data = synthetic(device_mib=40)
    seen = []
    solve = mathopt_solver.mathopt.solve

    def recorded(model, kind, *, params, **kw):
        seen.append(params.highs)
        return solve(model, kind, params=params, **kw)

    monkeypatch.setattr(mathopt_solver.mathopt, "solve", recorded)
    lean = PlacementModel(data).solve(node_limit=100, lean_search=True)
    plain = PlacementModel(data).solve(node_limit=100)
    assert seen[0].bool_options["mip_allow_restart"] is False and seen[0].int_options["mip_pscost_minreliable"] == 0
    assert not seen[1].bool_options and not seen[1].int_options
    lp = PlacementModel(data, relax=True).solve()
    assert lp.objective_seconds * (1 - 1e-6) <= lean.objective_seconds <= plain.objective_seconds * (1 + MIP_RELATIVE_GAP)
    assert lean.bound_seconds <= lean.objective_seconds
    with pytest.raises(PlacementInfeasible, match="in nodes"):  # the solver error, named
        PlacementModel(data).solve(lean_search=True)


def test_aggregation_loses_nothing():
    data = synthetic(layers=3, chunks=3, device_mib=40)
    aggregated = PlacementModel(data).solve()
    per_chunk = PlacementModel(split_chunk_classes(data)).solve()
    assert aggregated.objective_seconds == pytest.approx(per_chunk.objective_seconds, rel=1e-2)


def test_matches_the_exact_cp_sat_model():
    data = synthetic(layers=3, chunks=2, device_mib=30)
    ours = PlacementModel(data).solve()
    exact = ExactModel(split_chunk_classes(data)).solve()
    assert ours.objective_seconds <= exact.objective_seconds * 1.02
    assert exact.objective_seconds <= ours.objective_seconds * 1.02


def test_tighter_device_is_never_faster():
    times = [PlacementModel(synthetic(device_mib=m)).solve().objective_seconds for m in (200, 40, 30)]
    assert times[0] <= times[1] * (1 + 1e-6) <= times[2] * (1 + 1e-6) ** 2


def test_without_ssds_no_nvme_choice():
    sol = PlacementModel(synthetic(device_mib=30, nvme=False)).solve()
    assert all(c["NVME"] == 0 for c in sol.os_counts)
    assert ActivationMode.SWAP_NVME not in sol.activation_modes


def test_infeasible_and_minimal_capacity():
    data = synthetic(device_mib=5)
    with pytest.raises(PlacementInfeasible):
        PlacementModel(data).solve()
    need, stage = minimal_capacity(data, Tier.DEVICE, relax_others=True)
    assert need > data.device_bytes and 0 <= stage < len(data.stages)
    sol = PlacementModel(dataclasses.replace(data, device_bytes=need + 1)).solve()
    assert max(sol.device_bytes_per_stage) <= need + 1


def test_overlap_hides_the_cpu_optimizer():
    slow_cpu = dict(device_mib=30)
    overlap = PlacementModel(dataclasses.replace(synthetic(**slow_cpu), cpu_adam_seconds_per_element=2e-8)).solve()
    serial = PlacementModel(dataclasses.replace(synthetic(overlap=False, **slow_cpu), cpu_adam_seconds_per_element=2e-8)).solve()
    assert overlap.objective_seconds < serial.objective_seconds


@pytest.mark.parametrize("relax", [False, True])
@pytest.mark.parametrize("device_mib", [20, 28, 40])
def test_every_chunk_the_cpu_steps_comes_back_up(device_mib, relax):
    """A chunk stepped by CPU Adam is rewritten on HOST: whether it arrives for its next use or is kept on DEVICE
    across the iteration's end and uploaded again in place (`refresh`), its PARAM crosses H2D at least once an
    iteration. (Until session 18 the refresh uploads were priced only beside NVMe on-demand fetches: a plan
    keeping every chunk and stepping them on the CPU moved 0 bytes H2D.)"""
    data = synthetic(device_mib=device_mib)
    sol = PlacementModel(data, relax=relax).solve()
    cpu_stepped = sum((counts["HOST"] + counts["NVME"]) * g.param_bytes
                      for g, counts in zip(data.chunk_classes, sol.os_counts) if g.trainable)
    assert cpu_stepped > 0
    assert sol.channel_bytes["H2D"] >= cpu_stepped * (1 - 1e-9)


def test_cpu_steps_beside_copies_are_charged_the_time_they_lose():
    """Note [CPU Adam beside copies, in the model]: with `cpu_adam_beside_copies` below 1 the CPU rows add
    (1 - beside) x the copy time of every suffix to its CPU work. Where the CPU optimizer sets the time and
    copies run beside it the plan lengthens, by at most that share of all its copy time; at 1 the model is
    the one-price model."""
    slow = dataclasses.replace(synthetic(device_mib=30, nvme=False), cpu_adam_seconds_per_element=2e-8)
    free = PlacementModel(slow, relax=True).solve()
    assert free.objective_seconds == pytest.approx(
        PlacementModel(dataclasses.replace(slow, cpu_adam_beside_copies=1.0), relax=True).solve().objective_seconds, rel=1e-9)
    beside = PlacementModel(dataclasses.replace(slow, cpu_adam_beside_copies=0.5), relax=True).solve()
    copies_s = beside.channel_bytes["H2D"] / slow.h2d_bytes_per_s + beside.channel_bytes["D2H"] / slow.d2h_bytes_per_s
    # (+0.7% here since the refresh uploads are priced, session 18: the plan then moves fewer bytes beside the CPU)
    assert free.objective_seconds * 1.002 < beside.objective_seconds <= free.objective_seconds + 0.5 * copies_s * (1 + 1e-6)


def test_slow_cpu_streams_nvme_optimizer_state_to_the_device():
    """OS that only fits on NVME (HOST holds little) with a CPU optimizer 100x slower than the GPU's:
    the model streams it NVME -> HOST -> DEVICE for GPU Adam instead of stepping it on the CPU."""
    # DEVICE holds half the OS next to the work; HOST (10 MiB) the PARAM copies, grads and two chunks
    # of OS staged, not the other half of the OS (6 MiB)
    data = dataclasses.replace(synthetic(device_mib=22), host_bytes=10 * MIB, cpu_adam_seconds_per_element=1e-6)
    sol = PlacementModel(data).solve()
    assert sum(c["NVME_STREAM"] for c in sol.os_counts) > 0
    assert sum(c["HOST"] + c["STREAM"] for c in sol.os_counts) * 2 * MIB <= data.host_bytes
    fast_cpu = PlacementModel(dataclasses.replace(data, cpu_adam_seconds_per_element=1e-12)).solve()
    assert sum(c["NVME_STREAM"] for c in fast_cpu.os_counts) < sum(c["NVME_STREAM"] for c in sol.os_counts)
    # streamed chunks' OS crosses the SSDs twice (read and write-back) in the optimizer stage
    assert sol.channel_bytes["NVME_READ"] >= sum(c["NVME_STREAM"] for c in sol.os_counts) * 2 * MIB


def test_pinned_flags_are_respected_and_reported():
    data = synthetic(device_mib=30)
    lp = PlacementModel(data, relax=True)
    lp.solve()
    flags = lp.flag_values()
    assert set(flags) >= {"any_stream", "any_nvme_os"} and all(0 <= v <= 1 + 1e-9 for v in flags.values())
    off = PlacementModel(data, fixed_flags={k: 0 for k in flags}).solve()
    assert all(c["STREAM"] == c["NVME"] == c["NVME_STREAM"] == 0 for c in off.os_counts)  # every switch off
    free = PlacementModel(data).solve()
    assert free.objective_seconds <= off.objective_seconds * (1 + MIP_RELATIVE_GAP)


def test_cpu_lag_counts_waiting_grads_on_host():
    """A CPU optimizer far slower than backward leaves grads waiting on HOST when the optimizer stage
    starts: with HOST just big enough for everything else the plan must step fewer chunks on the CPU."""
    base = dataclasses.replace(synthetic(device_mib=200, nvme=False), cpu_adam_seconds_per_element=1e-6)
    roomy = PlacementModel(base).solve()
    need = max(roomy.host_bytes_per_stage)
    tight = PlacementModel(dataclasses.replace(base, host_bytes=int(need))).solve()
    cpu = lambda sol: sum(c["HOST"] for c in sol.os_counts)  # noqa: E731
    assert cpu(tight) <= cpu(roomy)
    assert max(tight.host_bytes_per_stage) <= need + 1


def test_late_arrivals_charge_the_copies_that_fit_only_after_the_peak():
    """Note [late arrivals]: every backward stage is its work at the peak, then a zero-compute tail; the
    next block's chunks fit only at the tail, so their copy runs after the work and the next stage waits
    (T_s + T_{s+1} >= peak work + late bytes / H2D + the next stage's work). Without the peak data (-1)
    the model overlaps that copy with the stage."""
    base = synthetic(layers=3, chunks=2, device_mib=20, act_mib=1, compute_s=1e-3, nvme=False)
    # the peak moment's work needs the block's own 2 chunks and their grads; the next block's 2 chunks
    # (2 MiB, 2 ms at 1 GB/s) find no room beside it
    stages = tuple(dataclasses.replace(st, peak_compute_seconds=st.compute_seconds, peak_need_bytes=4 * MIB,
                                       non_model_bytes=int(14 * MIB) if st.phase is Phase.BACKWARD else st.non_model_bytes,
                                       tail_non_model_bytes=int(1 * MIB) if st.phase is Phase.BACKWARD else -1)
                   for st in base.stages)
    classes = tuple(dataclasses.replace(g, use_tail_seconds=tuple(base.stages[s].compute_seconds for s in g.use_stages))
                    for g in base.chunk_classes)
    late = dataclasses.replace(base, stages=stages, chunk_classes=classes, stream_optimizer=False)
    blind = dataclasses.replace(late, stages=tuple(dataclasses.replace(st, peak_compute_seconds=-1.0) for st in stages))
    with_row = PlacementModel(late, relax=True).solve()
    without = PlacementModel(blind, relax=True).solve()
    assert with_row.objective_seconds > without.objective_seconds * (1 + 1e-3)


@pytest.mark.parametrize("link", ["pcie", "nvme"])
@pytest.mark.parametrize("first", [0, 1])
def test_pcie_rows_hold_for_copies_the_simulator_overlaps(first, link):
    """Issue 17 item 4: the placement model's own two-way rows (PCIe, and SSDs with mixed rates) hold
    for every overlap the simulator replays. A copy once kept the rate it started with, so an H2D
    started alone ran at the pinned rate while D2H copies started under it ran at the both-ways rate
    (or the reverse; reads and writes alike): more than the link's region (costmodel.two_way_rows).
    Now every copy reserves its share of each facet (Note [two-way links in the simulator])."""
    from planner.families import gpt_trace
    from planner.placement_input import placement_input
    from planner.policies import baseline
    from planner.presets import resolve_hardware
    from planner.problem import build_problem
    from planner.sim_actions import _transfer
    from planner.sim_state import setup
    from schemas.schedule import Channel

    hw = resolve_hardware("a100-80g-12ssd")  # both-ways rates measured: H2D 12.5 of 25.5 GB/s; SSDs mixed
    assert hw.links.duplex_h2d_gb_per_s > 0 and hw.links.duplex_d2h_gb_per_s > 0
    assert hw.nvme.mixed_read_gb_per_s_each > 0 and hw.nvme.mixed_write_gb_per_s_each > 0
    trace = gpt_trace(layers=2, hidden=256, heads=4, seq=128, batch=4, vocab=4096, dtype="float32")
    problem = build_problem(trace, hw, trace_digest="t")
    schedule = baseline("angel", problem)
    data = placement_input(problem, schedule.layout)
    # the MIP's rows, at the size of the copies below (one size: the flat rates of the preset)
    rows, pair = ((data.pcie_time_rows, (Channel.H2D, Channel.D2H)) if link == "pcie"
                  else (data.nvme_rows(), (Channel.NVME_READ, Channel.NVME_WRITE)))
    assert any(x > 0 and y > 0 for x, y in rows)  # a row charging both ways: the case under test
    # a long copy one way started alone, then copies the other way issued under it until it ends
    sim = setup(schedule, hw)
    a, b = pair if first == 0 else pair[::-1]
    moved = {a: 1 << 30, b: 0}
    end = _transfer(sim, (a,), moved[a], 0.0, 0.0, "long", m=0, i=0, action=None)
    t, piece = 0.0, 1 << 24
    while True:
        done = _transfer(sim, (b,), piece, t, 0.0, "short", m=0, i=1, action=None)
        end = max(end, done)
        moved[b] += piece
        t = done
        if moved[b] >= moved[a]:
            break
    for x, y in rows:  # every replay lasts at least each row: end >= x * first-way bytes + y * other-way bytes
        assert end >= (x * moved[pair[0]] + y * moved[pair[1]]) * (1 - 1e-9), (x, y)
