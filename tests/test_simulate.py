"""The simulator: analytic times on hand-built schedules, and every kind of violation caught where it happens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings

from planner.cli import main
from planner.errors import PlannerError
from planner.simulate import ScheduleViolation, ViolationKind, simulate
from schemas.hardware import DeviceKind
from schemas.schedule import Action, ActivationMode, Budgets, Channel, ChunkList, HostStaging, Op, Schedule, SolverStatus, Tier
from strategies import hardwares, schedules
from test_simulate_builders import ELEMENTS as ELEMENTS_
from test_simulate_builders import (
    CHUNK_BYTES,
    RESIDENT,
    D,
    G,
    H,
    M,
    N,
    P,
    host_step_prefix,
    resident_specs,
    tiny_hardware,
    tiny_schedule,
)

HW = tiny_hardware()


def test_all_resident_time_is_compute_plus_device_adam() -> None:
    r = simulate(tiny_schedule(resident_specs(), RESIDENT), HW)
    # 1 + 1 forward, 2 + 2 backward, two GPU Adam steps of 0.1 s each
    assert r.iteration_seconds == pytest.approx(6.2)
    assert r.stall_seconds == 0
    assert r.tflops == pytest.approx(6.0 / 6.2)
    assert all(v == 0 for v in r.bytes_per_channel.values())
    # backward of block 0: two PARAM + two GRAD chunks, recorded non-model bytes (activations included)
    assert r.peak_bytes_per_tier[Tier.DEVICE] == 4 * CHUNK_BYTES + 10_000
    assert r.peak_bytes_per_tier[Tier.HOST] == 0
    assert r.moment_start_seconds[:5] == pytest.approx((0, 1, 1, 2, 2))


def test_one_fetch_stalls_bytes_over_bandwidth_and_cpu_adam_waits_for_grads() -> None:
    specs = [
        *host_step_prefix(),
        (8, Op.OPTIMIZER_STEP, None, 1, None, D),
        (8, Op.OPTIMIZER_STEP, None, 0, None, H),
        (8, Op.EVICT, G, 0, H, None),
        (8, Op.EVICT, G, 1, D, None),
    ]
    r = simulate(tiny_schedule(specs, {(P, 0): (H,), (P, 1): (D,)}), HW)
    assert r.stall_seconds == pytest.approx(2.0)  # two 1 GB fetches at 1 GB/s, nothing to hide them behind
    assert r.bytes_per_channel[Channel.H2D] == 2 * CHUNK_BYTES
    assert r.bytes_per_channel[Channel.D2H] == CHUNK_BYTES
    # grads reach HOST at 9 s; CPU Adam over 250 M params at 125 M/s takes 2 s
    assert r.busy_seconds_per_channel[Channel.CPU_OPTIMIZER] == pytest.approx(2.0)
    assert r.iteration_seconds == pytest.approx(11.0)


def _prefetch_specs(op: Op, moment: int) -> list:
    return [
        (0, Op.FETCH, P, 0, H, D),
        (moment, op, P, 1, H, D),
        (4, Op.ALLOCATE, G, 1, None, D),
        (6, Op.ALLOCATE, G, 0, None, D),
        (8, Op.OPTIMIZER_STEP, None, 0, None, D),
        (8, Op.OPTIMIZER_STEP, None, 1, None, D),
        (8, Op.WRITE_BACK, P, 0, D, H),
        (8, Op.WRITE_BACK, P, 1, D, H),
        (8, Op.EVICT, P, 0, D, None),
        (8, Op.EVICT, P, 1, D, None),
        (8, Op.EVICT, G, 0, D, None),
        (8, Op.EVICT, G, 1, D, None),
    ]


def test_prefetch_hides_the_transfer_behind_compute() -> None:
    residency = {(P, 0): (H,), (P, 1): (H,)}
    hidden = simulate(tiny_schedule(_prefetch_specs(Op.PREFETCH, 0), residency), HW)
    on_demand = simulate(tiny_schedule(_prefetch_specs(Op.FETCH, 2), residency), HW)
    assert hidden.moment_start_seconds[2] == pytest.approx(2.0)  # arrived while block 0 computed
    assert on_demand.moment_start_seconds[2] == pytest.approx(3.0)  # waited 1 s for it
    assert on_demand.stall_seconds - hidden.stall_seconds == pytest.approx(1.0)
    # copy-back after the optimizer: the write-backs wait for the steps (7.1, 7.2) and queue on D2H
    assert hidden.iteration_seconds == pytest.approx(9.1)


def _nvme_write_then_read() -> Schedule:
    """Chunk 1 written back HOST -> NVMe while chunk 0 is read NVMe -> HOST -> DEVICE, both 1 GB."""
    specs = [
        (0, Op.WRITE_BACK, P, 1, H, N),
        (0, Op.FETCH, P, 0, N, H),
        (0, Op.FETCH, P, 0, H, D),
        (1, Op.EVICT, P, 0, H, None),
        (1, Op.EVICT, P, 1, N, None),
        (7, Op.EVICT, P, 0, D, None),
    ]
    return tiny_schedule(specs, {(P, 0): (N,), (P, 1): (D, H)}, lists=(P,))


def test_nvme_is_simplex_reads_wait_for_writes() -> None:
    # the write: 1 GB at 0.5 GB/s, 0..2 s on the drive; the read at 1 GB/s after it, 2..3 s; H2D 3..4 s
    r = simulate(_nvme_write_then_read(), HW)
    assert r.moment_start_seconds[0] == pytest.approx(4.0)
    assert r.busy_seconds_per_channel[Channel.NVME_WRITE] == pytest.approx(2.0)
    assert r.busy_seconds_per_channel[Channel.NVME_READ] == pytest.approx(1.0)
    assert r.bytes_per_channel[Channel.NVME_READ] == r.bytes_per_channel[Channel.NVME_WRITE] == CHUNK_BYTES


def test_nvme_to_device_in_one_action_crosses_both_channels() -> None:
    specs = [(0, Op.FETCH, P, 0, N, D), (7, Op.EVICT, P, 0, D, None)]
    r = simulate(tiny_schedule(specs, {(P, 0): (N,), (P, 1): (D,)}, lists=(P,)), HW)
    assert r.bytes_per_channel[Channel.NVME_READ] == r.bytes_per_channel[Channel.H2D] == CHUNK_BYTES
    assert r.moment_start_seconds[0] == pytest.approx(1.0)  # pipelined through HOST: the slower leg


def _violation(specs: list, residency: dict, **kw: object) -> ScheduleViolation:
    with pytest.raises(ScheduleViolation) as info:
        simulate(tiny_schedule(specs, residency, **kw), HW)
    return info.value


def test_use_before_arrival_names_moment_and_chunk() -> None:
    v = _violation(resident_specs(), {(P, 0): (D,), (P, 1): (H,)})
    assert (v.kind, v.moment, v.list, v.chunk, v.action_index) == (ViolationKind.USE_BEFORE_ARRIVAL, 2, P, 1, None)
    assert "moment 2" in str(v) and "chunk 1" in str(v)


def test_backward_without_grad_chunk_is_use_before_arrival() -> None:
    specs = [s for s in resident_specs() if not (s[1] is Op.ALLOCATE and s[3] == 1)]
    v = _violation(specs, RESIDENT)
    assert (v.kind, v.moment, v.list, v.chunk) == (ViolationKind.USE_BEFORE_ARRIVAL, 4, G, 1)


def test_copy_from_a_tier_without_a_valid_copy() -> None:
    v = _violation([(0, Op.FETCH, P, 0, N, D), *resident_specs()], RESIDENT)
    assert (v.kind, v.moment, v.action_index, v.list, v.chunk) == (ViolationKind.COPY_WITHOUT_SOURCE, 0, 0, P, 0)


def test_copy_from_a_stale_copy_after_the_optimizer_step() -> None:
    specs = resident_specs() + [(8, Op.FETCH, P, 0, H, D)]
    v = _violation(specs, {(P, 0): (D, H), (P, 1): (D,)})
    assert (v.kind, v.moment, v.list, v.chunk) == (ViolationKind.COPY_WITHOUT_SOURCE, 8, P, 0)
    assert "stale" in str(v)


def test_evict_of_the_last_valid_copy() -> None:
    v = _violation([(1, Op.EVICT, P, 0, D, None), *resident_specs()], RESIDENT)
    assert (v.kind, v.moment, v.list, v.chunk) == (ViolationKind.EVICT_LAST_COPY, 1, P, 0)


def test_evict_of_a_dead_grad_is_fine_but_a_live_one_is_not() -> None:
    specs = [s for s in resident_specs() if s[1] is not Op.EVICT or s[3] != 0] + [(7, Op.EVICT, G, 0, D, None)]
    v = _violation(specs, RESIDENT)
    assert (v.kind, v.moment, v.list, v.chunk) == (ViolationKind.EVICT_LAST_COPY, 7, G, 0)


def test_capacity_exceeded_on_device() -> None:
    v = _violation(resident_specs(), RESIDENT, budgets=Budgets(device_bytes=3 * CHUNK_BYTES + 50_000,
                                                               host_bytes=CHUNK_BYTES, nvme_bytes=0))
    # the ALLOCATE of GRAD chunk 0 at moment 6 is the fourth chunk
    assert (v.kind, v.moment, v.chunk) == (ViolationKind.CAPACITY, 6, 0)
    assert v.action_index is not None


def test_capacity_counts_non_model_bytes_of_the_work() -> None:
    v = _violation(resident_specs(), RESIDENT, budgets=Budgets(device_bytes=2 * CHUNK_BYTES + 5_000,
                                                               host_bytes=0, nvme_bytes=0))
    assert (v.kind, v.moment, v.action_index) == (ViolationKind.CAPACITY, 0, None)


def test_steady_state_broken() -> None:
    v = _violation([(0, Op.WRITE_BACK, P, 0, D, H), *resident_specs()], RESIDENT)
    assert (v.kind, v.moment, v.list, v.chunk) == (ViolationKind.STEADY_STATE, 8, P, 0)


def test_optimizer_step_before_final_grads() -> None:
    specs = [s for s in resident_specs() if not (s[1] is Op.OPTIMIZER_STEP and s[3] == 0)]
    specs.append((6, Op.OPTIMIZER_STEP, None, 0, None, D))
    v = _violation(specs, RESIDENT)
    assert (v.kind, v.moment, v.chunk) == (ViolationKind.OPTIMIZER_EARLY, 6, 0)


def test_optimizer_step_without_grads_on_its_tier() -> None:
    specs = [s for s in resident_specs() if not (s[1] is Op.OPTIMIZER_STEP and s[3] == 0)]
    specs.insert(2, (8, Op.OPTIMIZER_STEP, None, 0, None, H))
    v = _violation(specs, RESIDENT)
    assert (v.kind, v.moment, v.chunk) == (ViolationKind.OPTIMIZER_INPUTS, 8, 0)


def test_missing_optimizer_step() -> None:
    specs = [s for s in resident_specs() if not (s[1] is Op.OPTIMIZER_STEP and s[3] == 1)]
    specs = [s for s in specs if not (s[1] is Op.EVICT and s[3] == 1)]
    specs.append((8, Op.EVICT, G, 1, D, None))
    v = _violation(specs, RESIDENT)
    assert v.kind in (ViolationKind.OPTIMIZER_COUNT, ViolationKind.EVICT_LAST_COPY)
    assert v.chunk == 1


def test_swapped_activations_must_be_reloaded_before_backward() -> None:
    v = _violation([(1, Op.ACT_OFFLOAD, 0, H), *resident_specs()], RESIDENT,
                   modes=(ActivationMode.SWAP_HOST, ActivationMode.KEEP))
    assert (v.kind, v.moment, v.block) == (ViolationKind.ACTIVATIONS, 6, 0)


def test_activation_swap_moves_bytes_and_memory() -> None:
    specs = [(1, Op.ACT_OFFLOAD, 0, H), (4, Op.ACT_RELOAD, 0, H), *resident_specs()]
    r = simulate(tiny_schedule(specs, RESIDENT, modes=(ActivationMode.SWAP_HOST, ActivationMode.KEEP),
                               activation_bytes=1_000_000), HW)
    assert r.bytes_per_channel[Channel.D2H] == r.bytes_per_channel[Channel.H2D] == 1_000_000
    assert r.peak_bytes_per_tier[Tier.HOST] == 1_000_000
    host_at_2 = next(s for s in r.memory if s.moment == 2 and s.tier is Tier.HOST)
    assert host_at_2.activation_bytes == 1_000_000
    # the offload, issued at 1 s, lands at 1.001 s: during moment 2's work (from 1 s) its bytes are still on
    # DEVICE (the caching allocator frees them when the copy's event fires: Note [simulator evictions]),
    # at moment 3 (from 2 s) they are gone: what is left is block 1's (KEEP, its held window starts there)
    device_at = {m: next(s for s in r.memory if s.moment == m and s.tier is Tier.DEVICE) for m in (2, 3)}
    assert r.moment_start_seconds[2] == pytest.approx(1.0) and r.moment_start_seconds[3] == pytest.approx(2.0)
    assert device_at[2].activation_bytes == 1_000_000
    assert device_at[3].activation_bytes == 1_000_000


def test_late_reload_stalls_the_backward() -> None:
    big = 2 * CHUNK_BYTES  # 2 s each way at 1 GB/s
    specs = [(1, Op.ACT_OFFLOAD, 0, H), (6, Op.ACT_RELOAD, 0, H), *resident_specs()]
    r = simulate(tiny_schedule(specs, RESIDENT, modes=(ActivationMode.SWAP_HOST, ActivationMode.KEEP),
                               activation_bytes=big), HW)
    assert r.moment_start_seconds[6] == pytest.approx(r.moment_start_seconds[5] + 2.0)


def test_recompute_adds_its_seconds_and_frees_device_memory() -> None:
    keep = simulate(tiny_schedule(resident_specs(), RESIDENT, activation_bytes=1_000_000), HW)
    rec = simulate(tiny_schedule(resident_specs(), RESIDENT, activation_bytes=1_000_000,
                                 modes=(ActivationMode.RECOMPUTE, ActivationMode.KEEP)), HW)
    assert rec.iteration_seconds == pytest.approx(keep.iteration_seconds + 0.5)
    assert rec.recompute_flops == int(0.5e12) and rec.flops == keep.flops
    dev = {r: next(s for s in x.memory if s.moment == 4 and s.tier is Tier.DEVICE) for r, x in (("k", keep), ("r", rec))}
    assert dev["k"].activation_bytes == 1_000_000 and dev["r"].activation_bytes == 100_000


def test_infeasible_schedule_is_not_replayed() -> None:
    s = tiny_schedule(resident_specs(), RESIDENT)
    s = dataclasses.replace(s, header=dataclasses.replace(s.header, solver_status=SolverStatus.INFEASIBLE))
    with pytest.raises(PlannerError, match="INFEASIBLE"):
        simulate(s, HW)


def test_channel_without_bandwidth_is_a_violation() -> None:
    specs = [(0, Op.WRITE_BACK, P, 1, H, N), (1, Op.EVICT, P, 1, N, None)]
    with pytest.raises(ScheduleViolation) as info:
        simulate(tiny_schedule(specs, {(P, 0): (D,), (P, 1): (D, H)}, lists=(P,)), tiny_hardware(nvme_count=0))
    assert info.value.kind is ViolationKind.CHANNEL


def test_cli_json_and_hardware_resolution(tmp_path, capsys) -> None:
    path = tmp_path / "s.msgpack"
    tiny_schedule(resident_specs(), RESIDENT).write(path)
    hw = tmp_path / "tiny.toml"
    HW.write(hw)
    assert main(["simulate", str(path), "--hardware", str(hw), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iteration_seconds"] == pytest.approx(6.2)
    assert out["bytes_per_channel"]["H2D"] == 0
    # the header's hardware "tiny" is no preset: a one-line error, exit 2
    assert main(["simulate", str(path)]) == 2
    assert "not a preset" in capsys.readouterr().err
    # table output works too
    assert main(["simulate", str(path), "--hardware", str(hw)]) == 0
    assert "iteration" in capsys.readouterr().out


def test_cli_reports_violation_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "bad.msgpack"
    tiny_schedule(resident_specs(), {(P, 0): (D,), (P, 1): (H,)}).write(path)
    hw = tmp_path / "tiny.toml"
    HW.write(hw)
    assert main(["simulate", str(path), "--hardware", str(hw)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert len(err) == 1 and "use before arrival" in err[0] and "chunk 1" in err[0]


def test_grad_lists_absent_needs_no_steps() -> None:
    r = simulate(tiny_schedule([], {(P, 0): (D,), (P, 1): (D,)}, lists=(P,)), HW)
    assert r.iteration_seconds == pytest.approx(6.0)
    assert ChunkList.GRAD not in {k for s in r.memory for k in s.chunk_bytes}


def test_recompute_checkpoint_offload_moves_only_the_input() -> None:
    specs = [(1, Op.ACT_OFFLOAD, 0, H), (6, Op.ACT_RELOAD, 0, H), *resident_specs()]
    r = simulate(tiny_schedule(specs, RESIDENT, modes=(ActivationMode.RECOMPUTE, ActivationMode.KEEP),
                               activation_bytes=1_000_000), HW)
    assert r.bytes_per_channel[Channel.D2H] == r.bytes_per_channel[Channel.H2D] == 100_000  # input_bytes
    host_at_3 = next(s for s in r.memory if s.moment == 3 and s.tier is Tier.HOST)
    device_at_3 = next(s for s in r.memory if s.moment == 3 and s.tier is Tier.DEVICE)
    assert host_at_3.activation_bytes == 100_000
    assert device_at_3.activation_bytes == 1_000_000  # only block 1's kept activations


def test_activation_ops_on_a_kept_block_are_violations() -> None:
    v = _violation([(1, Op.ACT_OFFLOAD, 0, H), *resident_specs()], RESIDENT)
    assert (v.kind, v.moment, v.block, v.action_index) == (ViolationKind.ACTIVATIONS, 1, 0, 0)


def test_cli_checks_the_trace_digest(tmp_path, capsys) -> None:
    from planner.families import gpt_trace

    path = tmp_path / "s.msgpack"
    tiny_schedule(resident_specs(), RESIDENT).write(path)
    hw = tmp_path / "tiny.toml"
    HW.write(hw)
    trace = tmp_path / "t.msgpack"
    gpt_trace(layers=1, hidden=64, heads=2, seq=8, batch=1, vocab=64).write(trace)
    assert main(["simulate", str(path), "--hardware", str(hw), "--trace", str(trace)]) == 2
    assert "not the trace the schedule was solved from" in capsys.readouterr().err


def test_evict_of_an_absent_copy_and_a_wrong_channel() -> None:
    v = _violation([(1, Op.EVICT, P, 0, H, None), *resident_specs()], RESIDENT)
    assert (v.kind, v.moment, v.chunk) == (ViolationKind.EVICT_ABSENT, 1, 0)
    v = _violation([(0, Op.FETCH, P, 0, H, D, Channel.D2H), *resident_specs()], {(P, 0): (D, H), (P, 1): (D,)})
    assert (v.kind, v.moment, v.action_index) == (ViolationKind.CHANNEL, 0, 0)


@settings(max_examples=150)
@given(schedule=schedules(), hw=hardwares())
def test_any_valid_file_is_replayed_or_rejected_with_a_planner_error(schedule, hw) -> None:
    try:
        r = simulate(schedule, hw)
    except PlannerError:
        return
    assert r.iteration_seconds >= 0 and len(r.moment_start_seconds) == len(schedule.moments)


def test_each_rank_has_its_own_pcie_link() -> None:
    specs = [(0, Op.FETCH, P, 0, H, D), (0, Op.FETCH, P, 1, H, D), (7, Op.EVICT, P, 0, D, None),
             (7, Op.EVICT, P, 1, D, None)]
    one = tiny_schedule(specs, {(P, 0): (H,), (P, 1): (H,)}, lists=(P,))
    layout = dataclasses.replace(one.layout, chunks=tuple(dataclasses.replace(c, owner_rank=c.id, comm_group=0)
                                                          for c in one.layout.chunks))
    two = dataclasses.replace(one, layout=layout, header=dataclasses.replace(one.header, world_size=2))
    assert simulate(one, HW).moment_start_seconds[0] == pytest.approx(2.0)  # one link: 1 s + 1 s
    assert simulate(two, HW).moment_start_seconds[0] == pytest.approx(1.0)  # a link per rank, in parallel


# ----------------------------------------------------------------------------- several ranks


def _ranks(schedule, world: int, *, groups: bool = True):
    """The schedule with its two chunks owned by ranks 0 and 1 of `world` (one comm group when `groups`)."""
    layout = dataclasses.replace(schedule.layout, chunks=tuple(
        dataclasses.replace(c, owner_rank=c.id % world, comm_group=0 if groups else c.id) for c in schedule.layout.chunks))
    return dataclasses.replace(schedule, layout=layout, header=dataclasses.replace(schedule.header, world_size=world))


def _world_hw(world: int, gpus_per_node: int):
    return dataclasses.replace(HW, cluster=dataclasses.replace(HW.cluster, world_size=world, gpus_per_node=gpus_per_node),
                               links=dataclasses.replace(HW.links, inter_gpu_gb_per_s=2.0))


def test_optimizer_state_on_device_counts_on_its_owner_rank_only() -> None:
    one = tiny_schedule([], {(P, 0): (D,), (P, 1): (D,), (M, 0): (D,), (M, 1): (D,)}, lists=(P, M))
    two = _ranks(one, 2)
    single = simulate(one, HW).peak_bytes_per_tier[Tier.DEVICE]
    per_rank = simulate(two, _world_hw(2, 2)).peak_bytes_per_tier[Tier.DEVICE]
    # PARAM is on every rank (both chunks), the Adam moment only on the owner: one chunk less per rank
    assert single == 4 * CHUNK_BYTES + 10_000
    assert per_rank == 3 * CHUNK_BYTES + 10_000
    # the budget is per rank: 3 chunks fit with two ranks, not with one
    tight = Budgets(device_bytes=3 * CHUNK_BYTES + 10_000, host_bytes=0, nvme_bytes=0)
    simulate(dataclasses.replace(two, budgets=tight), _world_hw(2, 2))
    with pytest.raises(ScheduleViolation) as info:
        simulate(dataclasses.replace(one, budgets=tight), HW)
    assert info.value.kind is ViolationKind.CAPACITY


def test_host_is_per_node_swapped_activations_once_per_rank_of_the_node() -> None:
    specs = [(1, Op.ACT_OFFLOAD, 0, H), (4, Op.ACT_RELOAD, 0, H), *resident_specs()]
    one = tiny_schedule(specs, RESIDENT, modes=(ActivationMode.SWAP_HOST, ActivationMode.KEEP), activation_bytes=1_000_000)
    two = _ranks(one, 2, groups=False)
    node = simulate(two, _world_hw(2, 2))  # both ranks on one node: each swaps its own activations there
    nodes = simulate(two, _world_hw(2, 1))  # a node per rank
    assert node.peak_bytes_per_tier[Tier.HOST] == 2_000_000
    assert nodes.peak_bytes_per_tier[Tier.HOST] == 1_000_000
    with pytest.raises(ScheduleViolation, match="node 0, shared by 2 ranks") as info:
        simulate(dataclasses.replace(two, budgets=dataclasses.replace(two.budgets, host_bytes=1_500_000)), _world_hw(2, 2))
    assert info.value.kind is ViolationKind.CAPACITY


def test_all_gather_waits_for_the_owners_copies_and_the_work_for_the_all_gather() -> None:
    # both chunks fetched by their owners (1 s each on their own links, in parallel), then gathered:
    # (2 - 1) x 1 GB per rank at 2 GB/s = 0.5 s
    specs = [(0, Op.FETCH, P, 0, H, D), (0, Op.FETCH, P, 1, H, D), (7, Op.EVICT, P, 0, D, None),
             (7, Op.EVICT, P, 1, D, None)]
    two = _ranks(tiny_schedule(specs, {(P, 0): (H,), (P, 1): (H,)}, lists=(P,)), 2)
    gather = Action(moment=0, op=Op.ALL_GATHER, list=P, chunk=0, channel=Channel.INTER_GPU, bytes=CHUNK_BYTES)
    two = dataclasses.replace(two, actions=(*two.actions[:2], gather, *two.actions[2:]))
    r = simulate(two, _world_hw(2, 2))
    assert r.bytes_per_channel[Channel.INTER_GPU] == CHUNK_BYTES
    assert r.moment_start_seconds[0] == pytest.approx(1.5)
    interval = next(i for i in r.timeline if i.channel is Channel.INTER_GPU)
    assert interval.start_seconds == pytest.approx(1.0)
    assert r.tflops == pytest.approx(2 * r.flops / r.iteration_seconds / 1e12)  # both ranks compute


def test_cpu_steps_share_the_cores_of_an_emulated_device() -> None:
    """On an emulated DEVICE, backward and the CPU optimizer run on the same cores: a step overlapped
    with backward is not free there, as it is beside a GPU."""
    specs = [
        (4, Op.ALLOCATE, G, 1, None, D),
        (5, Op.WRITE_BACK, G, 1, D, H),  # 1 s: grads of chunk 1 final after backward h.1
        (5, Op.EVICT, G, 1, D, None),
        (5, Op.OPTIMIZER_STEP, None, 1, None, H),  # 2 s of CPU Adam, issued before backward h.0
        (5, Op.EVICT, G, 1, H, None),
        (6, Op.ALLOCATE, G, 0, None, D),
        (8, Op.OPTIMIZER_STEP, None, 0, None, D),
        (8, Op.EVICT, G, 0, D, None),
        (8, Op.FETCH, P, 1, H, D),  # the updated params back for the next iteration
    ]
    schedule = tiny_schedule(specs, {(P, 0): (D,), (P, 1): (D, H)})
    assert HW.device.kind is DeviceKind.CPU_EMULATED
    gpu = dataclasses.replace(HW, device=dataclasses.replace(HW.device, kind=DeviceKind.CUDA))
    beside, shared = simulate(schedule, gpu), simulate(schedule, HW)
    # GPU: backward h.0 4-6 s beside the step 5-7 s; the fetch of chunk 1 after the step, 7-8 s
    assert beside.iteration_seconds == pytest.approx(8.0)
    # emulated: the step holds the cores 5-7 s, backward h.0 7-9 s, GPU Adam 9-9.1 s, fetch 9-10 s
    assert shared.iteration_seconds == pytest.approx(10.0)
    for r in (beside, shared):  # the work itself is the same, still reported per channel
        assert r.busy_seconds_per_channel[Channel.CPU_OPTIMIZER] == pytest.approx(2.0)
        assert r.busy_seconds_per_channel[Channel.COMPUTE] == pytest.approx(6.1)


def test_prices_pageable_policy_and_shared_dram() -> None:
    """Issue 17: DeepSpeed's copies stage through pageable memory (slower than the same schedule
    pinned); host DRAM is one shared server (the iteration lasts at least its bytes / bandwidth)."""
    import dataclasses as dc

    from planner.presets import resolve_hardware

    path = Path(__file__).resolve().parent.parent / "traces/golden/pstar-gpt-4b.rtx4090-768g-12ssd.schedule.msgpack"
    s = Schedule.read(path)
    hw = resolve_hardware("rtx4090-768g-12ssd")
    pinned = simulate(s, hw)
    assert pinned.bytes_per_channel[Channel.H2D] > 0
    pageable = simulate(dc.replace(s, header=dc.replace(s.header, host_staging=HostStaging.PAGEABLE)), hw)
    assert pageable.iteration_seconds > pinned.iteration_seconds
    # the header's field decides, not the policy's name (issue 16/17: a decision the schedule carries)
    renamed = simulate(dc.replace(s, header=dc.replace(s.header, policy="zero3-offload")), hw)
    assert renamed.iteration_seconds == pinned.iteration_seconds
    moved = sum(pinned.bytes_per_channel[ch] for ch in (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE))
    slow = dc.replace(hw, host=dc.replace(hw.host, dram_gb_per_s=2.0, adam_dram_bytes_per_param=0.0))  # copies alone
    narrow = simulate(s, slow)
    assert narrow.iteration_seconds >= moved / 2e9 > pinned.iteration_seconds


def test_nvme_reads_and_writes_overlap_at_the_mixed_rates() -> None:
    """SSDs measured reading and writing at once (nvme.mixed_*): a read and a write server, each at its
    rate alone, sharing the drives' two-way facets (Note [two-way links in the simulator]): the read
    issued while the write runs no longer waits for it (simplex above: read done at 3 s), and the pair
    takes the least time the mixed rates allow (costmodel.nvme_time_rows), never less."""
    from planner.costmodel import nvme_time_rows

    hw = dataclasses.replace(HW, nvme=dataclasses.replace(HW.nvme, mixed_read_gb_per_s_each=0.8,
                                                          mixed_write_gb_per_s_each=0.4))
    # the write (placed first) at 0.5 GB/s alone, 0..2 s; the read ends when the rows say both are
    # done, 2.25 s (max of 1 + 0.5 and 0.25 + 2 s per GB each way: processor sharing's makespan too,
    # where both run at 0.8 / 0.4 GB/s to 1.25 s, then the write alone); H2D 2.25..3.25 s
    least = max(a + b for a, b in nvme_time_rows(hw)) * CHUNK_BYTES
    assert least == pytest.approx(2.25)
    r = simulate(_nvme_write_then_read(), hw)
    assert r.moment_start_seconds[0] == pytest.approx(least + 1.0)
    assert r.busy_seconds_per_channel[Channel.NVME_READ] == pytest.approx(1.0)  # at its rate alone
    assert r.busy_seconds_per_channel[Channel.NVME_WRITE] == pytest.approx(2.0)
    # a host-side cap holds both together: 0.8 + 0.4 GB/s squeezed into 0.6 GB/s, the rates alone
    # capped too (read 0.6 GB/s): the pair needs 3.5 s
    capped = dataclasses.replace(hw, nvme=dataclasses.replace(hw.nvme, host_cap_gb_per_s=0.6))
    least = max(a + b for a, b in nvme_time_rows(capped)) * CHUNK_BYTES
    assert least == pytest.approx(3.5)
    r = simulate(_nvme_write_then_read(), capped)
    assert r.moment_start_seconds[0] == pytest.approx(least + 1.0)
    assert r.busy_seconds_per_channel[Channel.NVME_READ] == pytest.approx(1 / 0.6)


def _cpu_step_specs(step_moment: int) -> list:
    return [
        *host_step_prefix(),
        (step_moment, Op.OPTIMIZER_STEP, None, 0, None, H),
        (8, Op.OPTIMIZER_STEP, None, 1, None, D),
        (8, Op.EVICT, G, 0, H, None),
        (8, Op.EVICT, G, 1, D, None),
    ]


@pytest.mark.parametrize("kind", [DeviceKind.CPU_EMULATED, DeviceKind.CUDA])
def test_cpu_adam_is_priced_at_the_executors_thread_count(kind) -> None:
    """costmodel.optimizer_step_price with the executor's threads: on an emulated DEVICE a step
    overlapped with backward runs on the optimizer worker with half the cores (the 1-thread row here),
    a step at the OPTIMIZER moment with all of them; on a GPU machine every step has all cores."""
    from schemas.hardware import AdamRate
    hw = dataclasses.replace(HW, device=dataclasses.replace(HW.device, kind=kind), host=dataclasses.replace(
        HW.host, adam_chunk_params=ELEMENTS_, adam_rates=(AdamRate(threads=1, params_per_s=ELEMENTS_ / 1.0),
                                                          AdamRate(threads=2, params_per_s=ELEMENTS_ / 0.5))))
    residency = {(P, 0): (H,), (P, 1): (D,)}
    overlapped = simulate(tiny_schedule(_cpu_step_specs(7), residency), hw)
    at_the_end = simulate(tiny_schedule(_cpu_step_specs(8), residency), hw)
    assert at_the_end.busy_seconds_per_channel[Channel.CPU_OPTIMIZER] == pytest.approx(0.5)
    want = 1.0 if kind is DeviceKind.CPU_EMULATED else 0.5
    assert overlapped.busy_seconds_per_channel[Channel.CPU_OPTIMIZER] == pytest.approx(want)


def test_dram_is_shared_bandwidth_not_a_queue_in_placement_order() -> None:
    """A copy queued behind a busy channel reserves DRAM when it runs, not when the simulator places
    it: a later-placed copy on an idle link is not held behind it (the DRAM FIFO did that: GPT-3 175B
    on a100-80g-12ssd replayed 152 s with it, 108 s without)."""
    from planner.sim_state import Calendar

    cal = Calendar()
    assert cal.reserve(10.0, 1.0) == pytest.approx(11.0)  # placed first, runs at 10 s
    assert cal.reserve(0.0, 1.0) == pytest.approx(1.0)  # placed second, runs at once: not after 11 s
    assert cal.reserve(9.5, 1.0) == pytest.approx(11.5)  # 0.5 s before the busy 10..11, the rest after it
    assert cal.reserve(0.5, 2.0) == pytest.approx(3.0)  # inside 0..1: from 1 on
    assert (cal.starts, cal.ends) == ([0.0, 9.5], [3.0, 11.5])
