"""Several ranks (issue 9): comm-group collectives, sharded checkpoints, and a 2-rank gloo run.

The end-to-end test launches `tests/dist_scripts/train_sharded.py` under
`python -m torch.distributed.run --standalone --nproc-per-node 2` (gloo, CPU) and checks it against
one plain PyTorch process on the same global batch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from conftest import HARDWARE, REPO, TRACES
from executor import state
from executor.collectives import CommGroupCollectives, GroupState
from executor.distributed import OwnedChunks, load_sharded, save_sharded
from executor.errors import ExecutorError
from executor.models import build_model, make_batch, model_spec
from executor.optim import ChunkAdamW
from planner.errors import PlannerError
from planner.layout import build_layout
from planner.materialize import materialize, uniform_decisions
from planner.problem import build_problem
from schemas import Trace
from schemas.hardware import Hardware
from schemas.schedule import Channel, ChunkList, Op, Schedule

SCRIPT = REPO / "tests" / "dist_scripts" / "train_sharded.py"
DIGEST = "sha256:" + "0" * 64
LR, WEIGHT_DECAY = 1e-3, 0.01  # as in the script
STEPS, SAVE_AT = 10, 5
CHUNK_ELEMENTS = 65536
DEVICE_BYTES = 14_000_000  # small enough that block params leave DEVICE after forward and are gathered again


def _gloo_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


needs_gloo = pytest.mark.skipif(not _gloo_available(), reason="torch.distributed with the gloo backend is not available "
                                                              "in this torch build")


def hardware(tmp_path: Path, world_size: int) -> Hardware:
    """cpu-emulated with `world_size` ranks (a node each: gpus_per_node stays 1) and links of 1 GB/s:
    with 2 ranks the NIC stage, (N-1)/N of the gathered bytes, is the one-node ring's (p-1)/p."""
    text = (HARDWARE / "cpu-emulated.toml").read_text()
    text = text.replace("inter_gpu_gb_per_s = 0.0", "inter_gpu_gb_per_s = 1.0\ninter_node_gb_per_s = 1.0")
    text = text.replace("world_size = 1", f"world_size = {world_size}")
    path = tmp_path / f"cpu-emulated-{world_size}.toml"
    path.write_text(text)
    return Hardware.read(path)


def schedule_for(tmp_path: Path, world_size: int) -> Schedule:
    # the shipped trace is of one process; a trace recorded per rank has the same moments
    trace = Trace.read(TRACES / "gpt-small.msgpack")
    trace = dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, world_size=world_size))
    problem = build_problem(trace, hardware(tmp_path, world_size), trace_digest=DIGEST,
                            device_bytes=DEVICE_BYTES if world_size > 1 else None)
    layout = build_layout(problem, chunk_elements=CHUNK_ELEMENTS)
    return materialize(problem, uniform_decisions(problem, layout))


def max_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)).item() for k in b)


# ----------------------------------------------------------------------------- one process


def test_world_size_one_collectives_are_copies_with_guarded_states(tmp_path) -> None:
    layout = schedule_for(tmp_path, 1).layout
    coll = CommGroupCollectives(layout)
    assert (coll.world_size, coll.rank, coll.n_groups) == (1, 0, len(layout.chunks))
    shard = torch.arange(float(layout.chunks[0].elements))
    out = torch.zeros_like(shard)
    work = coll.all_gather(ChunkList.PARAM, 0, shard, out)
    assert coll.state(ChunkList.PARAM, 0) is GroupState.GATHERING
    with pytest.raises(ExecutorError, match="cannot go from GATHERING to GATHERING"):
        coll.all_gather(ChunkList.PARAM, 0, shard, out)
    assert work.wait() is out and torch.equal(out, shard)
    assert coll.state(ChunkList.PARAM, 0) is GroupState.GATHERED
    with pytest.raises(ExecutorError, match="cannot go from GATHERED to REDUCING"):
        coll.reduce_scatter(ChunkList.PARAM, 0, out, shard)
    coll.release(ChunkList.PARAM, 0)
    with pytest.raises(ExecutorError, match="cannot go from RELEASED to RELEASED"):
        coll.release(ChunkList.PARAM, 0)
    with pytest.raises(ExecutorError, match="flat shard of"):
        coll.all_gather(ChunkList.PARAM, 0, shard[:-1], out)
    with pytest.raises(ExecutorError, match="1 chunk buffers"):
        coll.all_gather(ChunkList.PARAM, 0, shard, [out, out])
    listed = [torch.zeros_like(shard)]  # the chunk-list form (a store allocating chunk by chunk)
    coll.all_gather(ChunkList.PARAM, 0, shard, listed).wait()
    assert torch.equal(listed[0], shard)
    grads = torch.full_like(shard, 3.0)
    coll.reduce_scatter(ChunkList.GRAD, 0, [grads], listed[0]).wait()
    assert torch.equal(listed[0], grads) and coll.state(ChunkList.GRAD, 0) is GroupState.REDUCED
    assert coll.stats.inter_gpu_bytes == 0  # one rank moves nothing between GPUs


def test_layout_of_another_world_size_is_refused(tmp_path) -> None:
    layout = schedule_for(tmp_path, 2).layout
    with pytest.raises(ExecutorError, match="owner_rank"):
        CommGroupCollectives(layout, world_size=1, rank=0)


def test_collective_bytes_follow_the_schedule_convention(tmp_path) -> None:
    schedule = schedule_for(tmp_path, 2)
    collectives = [a for a in schedule.actions if a.op in (Op.ALL_GATHER, Op.REDUCE_SCATTER)]
    assert collectives and sum(a.bytes for a in collectives) == schedule.prediction.bytes_per_channel[Channel.INTER_GPU]
    for a in collectives:  # (world_size - 1) x one chunk's capacity in the list's dtype, per rank
        assert a.bytes == (2 - 1) * schedule.layout.chunks[2 * a.chunk].elements * 4


def test_sharded_checkpoint_round_trip_in_one_process(tmp_path) -> None:
    """world_size 1: save_sharded/load_sharded are executor.state's save/restore."""
    schedule = schedule_for(tmp_path, 1)
    spec = model_spec("gpt-small")
    model = build_model(spec, seed=3)
    coll = CommGroupCollectives(schedule.layout)
    local = OwnedChunks(schedule.layout, rank=0)
    opt = ChunkAdamW(model.parameters(), schedule.layout, model=model, lr=LR)
    path = tmp_path / "init.pt"
    torch.save({"format": state.CHECKPOINT_FORMAT, "model": model.state_dict()}, path)
    load_sharded(path, local, coll, model=model, optimizer=opt)
    save_sharded(tmp_path / "again.pt", local, coll, model=model, optimizer=opt)
    again = state.load(tmp_path / "again.pt")
    assert max_relative(again["model"], model.state_dict()) == 0.0
    assert again["optimizer"]["state"] == {}  # nothing stepped yet: as a fresh torch AdamW


def _edited(schedule: Schedule) -> Schedule:
    """The same layout under another content digest (a re-solved or edited plan)."""
    return dataclasses.replace(schedule, header=dataclasses.replace(schedule.header, notes=(*schedule.header.notes, "edited")))


def test_sharded_checkpoint_names_its_schedule_and_refuses_another(tmp_path) -> None:
    """save_sharded records the running schedule's digest (as executor.state.save); load_sharded under
    another schedule of the same world size is refused in one line naming both, before any write."""
    schedule = schedule_for(tmp_path, 1)
    model = build_model(model_spec("gpt-small"), seed=3)
    coll = CommGroupCollectives(schedule.layout)
    local = OwnedChunks(schedule.layout, rank=0)
    opt = ChunkAdamW(model.parameters(), schedule.layout, model=model, lr=LR)
    torch.save({"format": state.CHECKPOINT_FORMAT, "model": model.state_dict()}, tmp_path / "init.pt")
    load_sharded(tmp_path / "init.pt", local, coll, model=model, optimizer=opt, schedule=schedule)  # no digest: any schedule
    save_sharded(tmp_path / "ckpt.pt", local, coll, model=model, optimizer=opt, schedule=schedule)
    ckpt = state.load(tmp_path / "ckpt.pt")
    assert (ckpt["schedule_digest"], ckpt["schedule_world_size"]) == (schedule.content_digest(), 1)
    other = _edited(schedule)
    fresh = OwnedChunks(schedule.layout, rank=0)
    with pytest.raises(state.StateError) as info:
        load_sharded(tmp_path / "ckpt.pt", fresh, coll, model=model, optimizer=opt, schedule=other)
    message = str(info.value)
    assert "\n" not in message and schedule.content_digest()[:19] in message and other.content_digest()[:19] in message
    assert "attach the schedule it was saved with" in message
    assert all(not t.any() for t in fresh.buffers.values())  # nothing written
    load_sharded(tmp_path / "ckpt.pt", fresh, coll, model=model, optimizer=opt, schedule=schedule)
    assert torch.equal(fresh.buffers[(ChunkList.PARAM, 0)], local.buffers[(ChunkList.PARAM, 0)])
    with pytest.raises(ExecutorError, match="not the one whose layout"):
        save_sharded(tmp_path / "x.pt", local, coll, model=model, schedule=schedule_for(tmp_path, 2))


def test_a_one_process_trace_is_one_rank_of_the_hardware_world(tmp_path) -> None:
    """Issue 9 item 1: the world size comes from the hardware; a trace recorded by one process is
    the per-rank work of data parallel and plans to the same schedule as a trace of every rank."""
    trace = Trace.read(TRACES / "gpt-small.msgpack")
    assert trace.meta.world_size == 1
    problem = build_problem(trace, hardware(tmp_path, 2), trace_digest=DIGEST, device_bytes=DEVICE_BYTES)
    assert problem.world_size == 2
    schedule = materialize(problem, uniform_decisions(problem, build_layout(problem, chunk_elements=CHUNK_ELEMENTS)))
    assert schedule == schedule_for(tmp_path, 2)  # the trace with meta.world_size=2
    three = dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, world_size=3))
    with pytest.raises(PlannerError, match="world_size=3.*cluster.world_size=2"):
        build_problem(three, hardware(tmp_path, 2), trace_digest=DIGEST)


def test_inter_gpu_bytes_against_patrickstar_formula(tmp_path) -> None:
    """PatrickStar §7: the chunk scheme moves 2 (p-1)/p x 2M (all-gathers) + (p-1)/p x 2M
    (reduce-scatter) = 6 (p-1)/p x M bytes per rank for M fp16 params, i.e. 3 (p-1)/p x M x itemsize
    (fp32 here). tide gathers every group at least once and at most twice (a group used across the
    turn from forward to backward stays), so it moves at most that; the PatrickStar baseline, which
    releases every group after its forward use, exactly that."""
    world = 2
    schedule = schedule_for(tmp_path, world)
    layout = schedule.layout
    itemsize = 4
    m_padded = sum(c.elements for c in layout.chunks)  # the chunks' capacity: what the collectives move
    groups = len(layout.chunks) // world
    gathers = [a for a in schedule.actions if a.op is Op.ALL_GATHER]
    reduces = [a for a in schedule.actions if a.op is Op.REDUCE_SCATTER]
    predicted = schedule.prediction.bytes_per_channel[Channel.INTER_GPU]
    assert predicted == sum(a.bytes for a in gathers + reduces)
    assert len(reduces) == groups and groups <= len(gathers) < 2 * groups
    formula = 3 * (world - 1) * m_padded * itemsize // world
    assert (len(gathers) + len(reduces)) * (world - 1) * (m_padded // len(layout.chunks)) * itemsize == predicted
    assert 2 * (world - 1) * m_padded * itemsize // world <= predicted < formula
    from planner.policies import baseline
    from planner.simulate import simulate

    trace = Trace.read(TRACES / "gpt-small.msgpack")
    hw = hardware(tmp_path, world)
    pstar = baseline("patrickstar", build_problem(trace, hw, trace_digest=DIGEST))
    sim = simulate(pstar, hw)
    pstar_m = sum(c.elements for c in pstar.layout.chunks)
    assert sim.bytes_per_channel[Channel.INTER_GPU] == 3 * (world - 1) * pstar_m * itemsize // world
    assert simulate(schedule, hw).bytes_per_channel[Channel.INTER_GPU] == predicted  # the judge agrees


@pytest.mark.parametrize("world", [2, 4])
def test_a_reduce_scatter_leaves_each_rank_its_own_grads(tmp_path, world) -> None:
    """Issue 18 item 1 (PatrickStar §7): after a comm group's reduce-scatter a rank keeps its own
    chunk's grads only. GPU Adam keeps the grads on DEVICE until the step: at the OPTIMIZER moment
    the replay counts each rank's own chunks, below the same schedule without its reduce-scatters
    (where every rank holds every chunk's grads), and the simulator's per-rank peak is the replay's."""
    from planner.replay import replay_residency
    from planner.simulate import simulate
    from schemas.schedule import Tier

    trace = Trace.read(TRACES / "gpt-small.msgpack")
    trace = dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, world_size=world))
    hw = hardware(tmp_path, world)
    problem = build_problem(trace, hw, trace_digest=DIGEST)
    layout = build_layout(problem, chunk_elements=CHUNK_ELEMENTS)
    schedule = materialize(problem, uniform_decisions(problem, layout, os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE))
    reduces = [a for a in schedule.actions if a.op is Op.REDUCE_SCATTER]
    kept = dataclasses.replace(schedule, actions=tuple(a for a in schedule.actions if a.op is not Op.REDUCE_SCATTER))
    opt = problem.optimizer_moment
    freed = replay_residency(kept).device_bytes[opt] - replay_residency(schedule).device_bytes[opt]
    grad_chunk = min(c.elements for c in layout.chunks) * 4  # fp32 grads
    assert reduces and freed >= (world - 1) * grad_chunk
    assert simulate(schedule, hw).peak_bytes_per_tier[Tier.DEVICE] == max(replay_residency(schedule).device_bytes)


# ----------------------------------------------------------------------------- two ranks (gloo)


def plain_run(init: dict[str, torch.Tensor], steps: range, optimizer_state: dict | None = None, *, micro_batches: int = 2):
    """One process, the global batch, torch's fused AdamW: the reference.

    The global batch runs as `micro_batches` accumulated halves (rank r's rows), each loss scaled by
    1/micro_batches (exact: a power of two), so the grads are bitwise the ranks' averaged grads. One
    batched forward of all rows is the same math but rounds differently, and Adam turns rounding
    noise on elements whose true grad is zero (the attention key biases: softmax ignores a constant
    added to every key) into +-lr steps: 8e-4 relative on c_attn.bias after 10 steps (measured).
    """
    spec = model_spec("gpt-small")
    model = build_model(spec, seed=1234)
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    if optimizer_state is not None:
        opt.load_state_dict(copy.deepcopy(optimizer_state))  # torch keeps (and bumps) the given step tensors
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the torchrun workers (OMP_NUM_THREADS=1): same kernels, same rounding
    try:
        losses = []
        rows = spec.batch // micro_batches
        for step in steps:
            batch = make_batch(spec, seed=100 + step)
            total = 0.0
            for r in range(micro_batches):
                part = slice(r * rows, (r + 1) * rows)
                loss = model(batch["idx"][part], batch["targets"][part]) / micro_batches
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
    finally:
        torch.set_num_threads(threads)
    return model, losses


def launch_two_ranks(script: Path, tmp: Path, *, steps: int = STEPS, extra: tuple[str, ...] = ()
                     ) -> tuple[Path, Schedule, dict[str, torch.Tensor]]:
    """Plan a world_size=2 schedule and a common initial model in `tmp`, then run `script` under
    torchrun with 2 gloo ranks (one thread each); (tmp, schedule, initial state dict)."""
    schedule = schedule_for(tmp, 2)
    schedule.write(tmp / "schedule.msgpack")
    init = build_model(model_spec("gpt-small"), seed=0).state_dict()
    torch.save({"format": state.CHECKPOINT_FORMAT, "model": init}, tmp / "init.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "--schedule", str(tmp / "schedule.msgpack"), "--init", str(tmp / "init.pt"), "--out", str(tmp),
           "--steps", str(steps), "--save-at", str(min(SAVE_AT, steps)), *extra]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return tmp, schedule, init


@cache
def _two_rank_run(root: str, fault: str = "none", steps: int = STEPS) -> tuple[Path, Schedule, dict[str, torch.Tensor]]:
    return launch_two_ranks(SCRIPT, Path(root), steps=steps, extra=("--fault", fault))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _two_rank_run(str(tmp_path_factory.mktemp("two_ranks")))


@needs_gloo
def test_two_ranks_train_like_one_process(two_ranks) -> None:
    tmp, _, init = two_ranks
    reference, _ = plain_run(init, range(STEPS))
    final = state.load(tmp / "final.pt")
    assert final["extra"] == {"step": STEPS}
    assert max_relative(final["model"], reference.state_dict()) <= 1e-6
    assert max_relative(final["model"], init) > 1e-3  # it did train


@needs_gloo
def test_bytes_per_rank_equal_the_schedule(two_ranks) -> None:
    tmp, schedule, _ = two_ranks
    predicted = {op: sum(a.bytes for a in schedule.actions if a.op is op) for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER)}
    counts = {op: sum(1 for a in schedule.actions if a.op is op) for op in predicted}
    # the schedule gathers some groups twice (released after forward, gathered again in backward)
    assert counts[Op.ALL_GATHER] > schedule.layout.chunks[-1].comm_group + 1
    for rank in (0, 1):
        stats = json.loads((tmp / f"stats_rank{rank}.json").read_text())
        assert stats["backend"] == "gloo" and len(stats["iterations"]) == STEPS
        assert stats["agreed"] == [3.0, 2.0]  # all_reduce_scalar: sum and max of rank + 1
        for it in stats["iterations"]:
            assert it["all_gather_bytes"] == predicted[Op.ALL_GATHER]
            assert it["reduce_scatter_bytes"] == predicted[Op.REDUCE_SCATTER]
            assert it["all_gather_count"] == counts[Op.ALL_GATHER]
            assert it["inter_gpu_bytes"] == schedule.prediction.bytes_per_channel[Channel.INTER_GPU]


@needs_gloo
def test_store_collectives_over_the_engine_chunk_store(two_ranks) -> None:
    """StoreCollectives on executor.store.ChunkStore: each group gathered into DEVICE payloads and
    reduced (the script raises on wrong values); one collective of each kind per group."""
    tmp, schedule, _ = two_ranks
    n_groups = len(schedule.layout.chunks) // 2
    per_group = 4 * schedule.layout.chunks[0].elements  # (2 - 1) x capacity x 4 bytes, all groups alike here
    assert {c.elements for c in schedule.layout.chunks} == {schedule.layout.chunks[0].elements}
    runs = []
    for rank in (0, 1):
        check = json.loads((tmp / f"stats_rank{rank}.json").read_text())["store_check"]
        assert check["all_gather_count"] == check["reduce_scatter_count"] == n_groups
        assert check["inter_gpu_bytes"] == 2 * n_groups * per_group
        runs.append(check["actions_run_here"])
    # collectives and DEVICE evictions/allocations run everywhere, the rest on the owner only
    everywhere = sum(1 for a in schedule.actions if a.op in (Op.ALL_GATHER, Op.REDUCE_SCATTER)
                     or (a.op is Op.EVICT and a.src.value == "DEVICE") or (a.op is Op.ALLOCATE and a.dst.value == "DEVICE"))
    assert sum(runs) == len(schedule.actions) + everywhere


@needs_gloo
def test_checkpoint_of_two_ranks_continues_in_one_process(two_ranks, tmp_path) -> None:
    tmp, _, _ = two_ranks
    ckpt = state.load(tmp / f"step{SAVE_AT}.pt")
    # a plain model + torch AdamW continue from it exactly where the two ranks went on
    continued, _ = plain_run(ckpt["model"], range(SAVE_AT, STEPS), optimizer_state=ckpt["optimizer"])
    final = state.load(tmp / "final.pt")
    assert max_relative(continued.state_dict(), final["model"]) <= 1e-6
    # and world size 1 through the chunk path: every chunk owned, same state back out
    one = schedule_for(tmp_path, 1)
    model = build_model(model_spec("gpt-small"), seed=7)
    local = OwnedChunks(one.layout, rank=0)
    coll = CommGroupCollectives(one.layout)
    opt = ChunkAdamW(model.parameters(), one.layout, model=model, lr=LR, weight_decay=WEIGHT_DECAY)
    load_sharded(ckpt, local, coll, model=model, optimizer=opt, schedule=one)  # another world size: a re-shard
    save_sharded(tmp_path / "one.pt", local, coll, model=model, optimizer=opt)
    again = state.load(tmp_path / "one.pt")
    assert max_relative(again["model"], ckpt["model"]) == 0.0
    for index, st in ckpt["optimizer"]["state"].items():
        assert float(st["step"]) == SAVE_AT
        assert torch.equal(again["optimizer"]["state"][index]["exp_avg_sq"], st["exp_avg_sq"])
    assert copy.deepcopy(again["optimizer"]["param_groups"]) == ckpt["optimizer"]["param_groups"]


@needs_gloo
def test_two_rank_checkpoint_names_its_schedule_and_every_rank_refuses_another(two_ranks) -> None:
    tmp, schedule, _ = two_ranks
    for name in (f"step{SAVE_AT}.pt", "final.pt"):
        ckpt = state.load(tmp / name)
        assert (ckpt["schedule_digest"], ckpt["schedule_world_size"]) == (schedule.content_digest(), 2), name
    for rank in (0, 1):
        foreign = json.loads((tmp / f"stats_rank{rank}.json").read_text())["foreign"]
        assert foreign["saved"] == schedule.content_digest() and foreign["running"] != foreign["saved"]
        assert foreign["saved"][:19] in foreign["refused"] and foreign["running"][:19] in foreign["refused"], foreign
        assert "\n" not in foreign["refused"] and foreign["unchanged"], foreign


@needs_gloo
def test_a_missed_gather_shows_in_the_result(tmp_path) -> None:
    """The end-to-end check can fail: a loop that skips the backward all-gathers computes with
    released (NaN-poisoned) params instead of silently using stale ones."""
    tmp, _, _ = _two_rank_run(str(tmp_path), fault="skip-backward-gathers", steps=1)
    final = state.load(tmp / "final.pt")["model"]
    assert any(torch.isnan(t).any() for t in final.values())
