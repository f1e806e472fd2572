"""PatrickStar's grad in the param chunk's slot (PS.2, issue 16): `ChunkPlan.grad_in_param_slot`, an optional
schedule field that the residency replay and the simulator count once on DEVICE, that old files read as
false, and that the executor refuses at attach."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest
from conftest import REPO
from test_simulate_builders import (
    CHUNK_BYTES,
    D,
    G,
    H,
    P,
    resident_specs,
    tiny_hardware,
    tiny_schedule,
)

from planner.replay import replay_residency
from planner.simulate import ScheduleViolation, simulate
from schemas import FormatError, Schedule
from schemas.schedule import ChunkList, Op, Tier, seal

MASTER = ChunkList.MASTER
GOLDEN = REPO / "traces" / "golden" / "gpt-small.cpu-emulated-0.05gb.schedule.msgpack"
LISTS = (P, G, MASTER)
SPECS = resident_specs()  # everything on DEVICE, stepped there
RESIDENT = {(P, 0): (D,), (P, 1): (D,), (MASTER, 0): (D,), (MASTER, 1): (D,)}


def _slotted(s: Schedule, chunks: set[int]) -> Schedule:
    plans = tuple(dataclasses.replace(p, grad_in_param_slot=p.chunk in chunks) for p in s.chunk_plans)
    return dataclasses.replace(s, chunk_plans=plans)


def _peaks(s: Schedule) -> tuple[int, int]:
    return replay_residency(s).peak_bytes_per_tier[Tier.DEVICE], simulate(s, tiny_hardware()).peak_bytes_per_tier[Tier.DEVICE]


@pytest.mark.parametrize("chunks", [{0}, {0, 1}])
def test_the_slot_counts_once_in_the_replay_and_the_simulator(chunks: set[int]) -> None:
    """Moment 6 holds PARAM 0, 1, MASTER 0, 1 and GRAD 0, 1 on DEVICE: six chunks, or one less per slotted
    chunk, whose GRAD lives in its PARAM's bytes; replay and simulator agree on both."""
    plain = tiny_schedule(SPECS, RESIDENT, lists=LISTS)
    slotted = _slotted(plain, chunks)
    replay_plain, sim_plain = _peaks(plain)
    replay_slot, sim_slot = _peaks(slotted)
    assert replay_plain == sim_plain and replay_slot == sim_slot
    assert replay_plain - replay_slot == len(chunks) * CHUNK_BYTES


def test_the_final_grad_makes_the_param_in_the_slot_stale() -> None:
    """After its last backward write the slot holds the grad: copying PARAM 0 from DEVICE is refused (it
    is not without the flag), and the DEVICE step writes PARAM back without reading it."""
    specs = [*SPECS, (7, Op.WRITE_BACK, P, 0, D, H), (8, Op.EVICT, P, 0, H, None)]
    assert simulate(tiny_schedule(specs, RESIDENT, lists=LISTS), tiny_hardware()).iteration_seconds > 0
    with pytest.raises(ScheduleViolation, match="stale"):
        simulate(_slotted(tiny_schedule(specs, RESIDENT, lists=LISTS), {0}), tiny_hardware())


def test_the_field_round_trips_and_old_files_read_as_false(tmp_path: Path) -> None:
    raw = GOLDEN.read_bytes()
    data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    assert all("grad_in_param_slot" not in p for p in data["chunk_plans"])
    s = Schedule.from_msgpack(raw)
    assert not any(p.grad_in_param_slot for p in s.chunk_plans)
    assert s.to_msgpack() == raw  # written only when true: old files and goldens keep their bytes
    mixed = ChunkList.MASTER in s.layout.lists
    if mixed:
        slotted = _slotted(s, {0})
        written = msgpack.unpackb(slotted.to_msgpack(), raw=False, strict_map_key=False)["chunk_plans"]
        assert written[0]["grad_in_param_slot"] is True and "grad_in_param_slot" not in written[1]
        assert Schedule.from_msgpack(slotted.to_msgpack()) == slotted


def test_the_field_round_trips_on_a_mixed_precision_schedule() -> None:
    s = _slotted(tiny_schedule(SPECS, RESIDENT, lists=LISTS), {1})
    back = Schedule.from_msgpack(s.to_msgpack())
    assert back == s and [p.grad_in_param_slot for p in back.chunk_plans] == [False, True]
    assert s.content_digest() != tiny_schedule(SPECS, RESIDENT, lists=LISTS).content_digest()


def test_a_bad_value_and_a_meaningless_flag_are_one_line(tmp_path: Path) -> None:
    data = msgpack.unpackb(GOLDEN.read_bytes(), raw=False, strict_map_key=False)
    data["chunk_plans"][0]["grad_in_param_slot"] = "yes"
    with pytest.raises(FormatError) as exc:
        Schedule.from_msgpack(msgpack.packb(seal(data), use_bin_type=True))
    assert "grad_in_param_slot" in str(exc.value) and "\n" not in str(exc.value)
    # without a MASTER list PARAM is what the step reads: the grad cannot overwrite it
    fp32 = _slotted(tiny_schedule(SPECS, {(P, 0): (D,), (P, 1): (D,)}, lists=(P, G)), {0})
    with pytest.raises(FormatError) as exc:
        Schedule.from_msgpack(fp32.to_msgpack())
    assert "chunk_plans[0].grad_in_param_slot" in str(exc.value) and "MASTER" in str(exc.value)


def test_the_executor_refuses_it_at_attach() -> None:
    from executor.attach import check_schedule_supported
    from executor.errors import ExecutorError

    s = _slotted(tiny_schedule(SPECS, RESIDENT, lists=LISTS), {1})
    with pytest.raises(ExecutorError) as exc:
        check_schedule_supported(s, grad_clip_norm=None, compute=s.layout.list_dtypes[P], nvme_dir=None)
    assert "chunk_plans[1].grad_in_param_slot" in str(exc.value) and "planner solve" in str(exc.value)
    check_schedule_supported(_slotted(s, set()), grad_clip_norm=None, compute=s.layout.list_dtypes[P], nvme_dir=None)


@pytest.mark.parametrize("ranks", [1, 2])
def test_patrickstar_schedules_carry_the_flag_and_hold_less_on_device(ranks: int) -> None:
    """PatrickStar puts every grad in its param chunk's slot (PS.2); the replay and the simulator agree on
    its DEVICE peak, and the same decisions without the slot need more DEVICE (backward: PARAM + GRAD)."""
    from test_baselines import box, problem, ranks_box

    from planner.materialize import materialize
    from planner.policies import decisions

    hw = box(device_gb=8.0) if ranks == 1 else ranks_box(ranks, device_gb=8.0)
    p = problem(hw)
    (d,) = decisions("patrickstar", p)
    assert all(plan.grad_in_param_slot for plan in d.chunk_plans)
    s = materialize(p, d)
    assert all(plan.grad_in_param_slot for plan in s.chunk_plans)
    assert Schedule.from_msgpack(s.to_msgpack()) == s
    peak = simulate(s, hw).peak_bytes_per_tier[Tier.DEVICE]
    assert replay_residency(s).peak_bytes_per_tier[Tier.DEVICE] == peak
    plain = materialize(p, dataclasses.replace(d, chunk_plans=tuple(
        dataclasses.replace(x, grad_in_param_slot=False) for x in d.chunk_plans)))
    assert simulate(plain, hw).peak_bytes_per_tier[Tier.DEVICE] > peak


def test_a_final_grad_written_back_takes_the_params_host_slot() -> None:
    """CPU Adam (PatrickStar's HOST steps): the final grad written back to HOST overwrites the PARAM copy
    there (the slot moves with the chunk), so HOST holds 14 B/param, not 16: at moment 7 HOST holds PARAM
    0, 1, MASTER 0, 1 and GRAD 0, 1 (six chunks) without the flag, four with it; replay and simulator agree."""
    specs = [
        (0, Op.FETCH, P, 0, H, D), (2, Op.FETCH, P, 1, H, D),
        (4, Op.ALLOCATE, G, 1, None, D),
        (5, Op.WRITE_BACK, G, 1, D, H), (5, Op.EVICT, G, 1, D, None), (5, Op.EVICT, P, 1, D, None),
        (6, Op.ALLOCATE, G, 0, None, D),
        (7, Op.WRITE_BACK, G, 0, D, H), (7, Op.EVICT, G, 0, D, None), (7, Op.EVICT, P, 0, D, None),
        (8, Op.OPTIMIZER_STEP, None, 0, None, H), (8, Op.OPTIMIZER_STEP, None, 1, None, H),
        (8, Op.EVICT, G, 0, H, None), (8, Op.EVICT, G, 1, H, None),
    ]
    homes = {(P, 0): (H,), (P, 1): (H,), (MASTER, 0): (H,), (MASTER, 1): (H,)}
    plain = tiny_schedule(specs, homes, lists=LISTS)
    slotted = _slotted(plain, {0, 1})

    def host(s: Schedule) -> tuple[int, int]:
        return replay_residency(s).peak_bytes_per_tier[Tier.HOST], simulate(s, tiny_hardware()).peak_bytes_per_tier[Tier.HOST]

    (rp, sp), (rs, ss) = host(plain), host(slotted)
    assert rp == sp and rs == ss and rp - rs == 2 * CHUNK_BYTES
    # and the PARAM copy on HOST is the grad now: fetching it before the step is refused
    with pytest.raises(ScheduleViolation, match="stale"):
        simulate(_slotted(tiny_schedule([*specs, (7, Op.FETCH, P, 1, H, D), (8, Op.EVICT, P, 1, D, None)], homes,
                                        lists=LISTS), {0, 1}), tiny_hardware())


def test_a_slotted_step_needs_the_slot_it_writes_param_into() -> None:
    """The step writes PARAM into the chunk's slot on its tier rather than reading it, so that tier must
    hold a PARAM copy (stale is fine): a DEVICE step after PARAM 0 left DEVICE is refused."""
    homes = {**RESIDENT, (P, 0): (D, H)}
    steps = [
        (4, Op.ALLOCATE, G, 1, None, D), (6, Op.ALLOCATE, G, 0, None, D),
        (8, Op.OPTIMIZER_STEP, None, 0, None, D), (8, Op.OPTIMIZER_STEP, None, 1, None, D),
        (8, Op.EVICT, G, 0, D, None), (8, Op.EVICT, G, 1, D, None),
        (8, Op.WRITE_BACK, P, 0, D, H),
    ]
    assert simulate(_slotted(tiny_schedule(steps, homes, lists=LISTS), {0}), tiny_hardware()).iteration_seconds > 0
    gone = [(7, Op.EVICT, P, 0, D, None), *steps[:-1]]
    with pytest.raises(ScheduleViolation, match="OPTIMIZER_STEP on DEVICE needs a valid PARAM"):
        simulate(_slotted(tiny_schedule(gone, homes, lists=LISTS), {0}), tiny_hardware())
