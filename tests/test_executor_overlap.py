"""CPU optimizer steps overlapped with backward (issue 7 item 3) and the opt-in one-step-stale mode
(item 4), on schedules the planner makes from recorded traces.

Overlap: a HOST step the schedule places at a backward moment runs on the engine's optimizer worker
while backward goes on; its completion travels with the chunk's HOST payloads. It must give exactly
the synchronous result: the overlapped schedule and the non-overlapped one (`optimizer_overlap=False`,
i.e. `planner solve --no-optimizer-overlap`) train bit for bit alike, fp32 and bf16, OS on HOST and
on NVME (Fuyou's delayed write-back pipeline).
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

import executor
from executor.errors import ExecutorError
from executor.models import GPT, GPTConfig
from executor.recorder import record
from executor.runtime import EngineState
from planner.layout import build_layout
from planner.materialize import Decisions, EvictionRule, materialize
from planner.presets import resolve_hardware
from planner.problem import build_problem
from schemas._base import digest_bytes
from schemas.schedule import ActivationMode, Channel, ChunkList, ChunkPlan, Op, Phase, Tier
from test_executor import LR, WD, bytes_checker, gpt_batches, plain_groups

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 6
CHUNK_ELEMENTS = 4096


def gpt_model(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64, block_size=16)).to(dtype)


def loss_fn(model, idx):
    return model(idx, idx)


@functools.cache
def problem_for(dtype: torch.dtype):
    batch = gpt_batches(1)[0]
    trace = record(gpt_model(dtype), {"idx": batch, "targets": batch}, model_name=f"gpt-{dtype}")
    return build_problem(trace, resolve_hardware("cpu-emulated"), trace_digest=digest_bytes(trace.to_msgpack()))


@functools.cache
def schedule_for(dtype: torch.dtype, os_tier: Tier, overlap: bool, budget_chunks: int = 8):
    """OS on `os_tier` (stepped on HOST), eviction forced; only `optimizer_overlap` differs."""
    problem = problem_for(dtype)
    layout = build_layout(problem, chunk_elements=CHUNK_ELEMENTS)
    cap = max(c.elements for c in layout.chunks) * 4
    plans = tuple(ChunkPlan(chunk=c.id, os_tier=os_tier, optimizer_tier=Tier.HOST) for c in layout.chunks)
    for chunks in range(budget_chunks, 4 * budget_chunks):  # the smallest budget the layout allows
        decisions = Decisions(policy="tide", layout=layout, chunk_plans=plans,
                              activation_modes=(ActivationMode.KEEP,) * len(problem.blocks),
                              param_device_budget_bytes=(cap * chunks,) * len(problem.moments),
                              persistent_chunks=frozenset(), optimizer_overlap=overlap, prefetch=True,
                              eviction=EvictionRule.BELADY_CLEAN_FIRST)
        try:
            return materialize(problem, decisions)
        except Exception:  # noqa: BLE001 - too small a budget: one chunk more
            continue
    raise AssertionError("no feasible budget")


def backward_steps(schedule) -> list[int]:
    optimizer_moment = next(m.id for m in schedule.moments if m.phase is Phase.OPTIMIZER)
    return [a.chunk for a in schedule.actions if a.op is Op.OPTIMIZER_STEP and a.moment < optimizer_moment]


def train(schedule, dtype: torch.dtype, tmp_path, *, steps: int = STEPS, **kwargs):
    """Losses, the final state dict, the names of the threads that ran HOST steps and how many steps
    went to the optimizer worker."""
    model = gpt_model(torch.float32)  # the engine keeps fp32 masters itself with a bf16 schedule
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tmp_path, **kwargs)
    threads: set[str] = set()
    step_chunk = engine.optimizer.step_chunk

    def spy(chunk, **kw):
        if kw["exp_avg"].device.type == "cpu":
            threads.add(threading.current_thread().name)
        return step_chunk(chunk, **kw)

    engine.optimizer.step_chunk = spy
    submitted = [0]
    if engine._step_worker is not None:
        submit = engine._step_worker.submit

        def counted(fn):
            submitted[0] += 1
            return submit(fn)

        engine._step_worker.submit = counted
    check = bytes_checker(schedule)
    losses = []
    for b in gpt_batches(steps):
        loss = loss_fn(model, b)
        loss.backward()
        losses.append(loss.item())
        engine.step()
        check(engine)
    state = engine.state_dict()
    engine.detach()
    return losses, state, threads, submitted[0]


def assert_identical(a: dict, b: dict) -> None:
    for part in ("model", "master"):
        assert a.get(part, {}).keys() == b.get(part, {}).keys()
        for name, t in a.get(part, {}).items():
            assert torch.equal(t, b[part][name]), f"{part} {name}"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"optimizer state {i} {k}"


# ----------------------------------------------------------------------------------- overlap == sync


@pytest.mark.parametrize("os_tier", [Tier.HOST, Tier.NVME], ids=["os-host", "os-nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlapped_cpu_steps_train_bit_for_bit_like_the_synchronous_schedule(dtype, os_tier, tmp_path):
    overlapped, synchronous = schedule_for(dtype, os_tier, True), schedule_for(dtype, os_tier, False)
    assert backward_steps(overlapped) and not backward_steps(synchronous)
    if os_tier is Tier.NVME:  # the delayed write-back pipeline is there: OS read, stepped, written back
        assert any(a.op is Op.WRITE_BACK and a.list is ChunkList.M and a.dst is Tier.NVME for a in overlapped.actions)
    got_losses, got, got_threads, submitted = train(overlapped, dtype, tmp_path / "a")
    want_losses, want, want_threads, _ = train(synchronous, dtype, tmp_path / "b")
    assert got_losses == want_losses
    assert_identical(got, want)
    # every step placed in backward went to the optimizer worker (which of them its thread ran and which
    # the training thread took over at the end depends on timing)...
    assert submitted == STEPS * len(backward_steps(overlapped))
    assert got_threads <= {"tide-optim", "MainThread"}
    assert want_threads == {"MainThread"}  # ...and the synchronous schedule steps inline


def test_fp32_overlap_matches_plain_fused_adamw(tmp_path):
    """The overlapped engine is also plain PyTorch's AdamW(fused=True), bit for bit."""
    losses, state, _, _ = train(schedule_for(torch.float32, Tier.HOST, True), torch.float32, tmp_path)
    ref = gpt_model()
    opt = torch.optim.AdamW(plain_groups(ref), lr=LR, fused=True)
    want = []
    for b in gpt_batches(STEPS):
        loss = loss_fn(ref, b)
        loss.backward()
        want.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert losses == want
    for name, p in ref.named_parameters():
        assert torch.equal(state["model"][name], p.detach()), name


# ----------------------------------------------------------------------------------- real concurrency


def test_backward_goes_on_while_a_cpu_step_runs(tmp_path):
    """The worker's first step starts during backward (the training thread lets it, at the last backward
    moment) and is then held until backward has ENDED: if the training thread waited for it anywhere
    after that, this would never finish (the holds give up after 20 s)."""
    from schemas.trace import MomentKind

    schedule = schedule_for(torch.float32, Tier.HOST, True)
    model = gpt_model()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    started, release = threading.Event(), threading.Event()
    held: list[bool] = []
    reached: list[bool] = []
    step_chunk = engine.optimizer.step_chunk

    def held_step(chunk, **kw):
        if threading.current_thread().name == "tide-optim" and not started.is_set():
            started.set()
            held.append(release.wait(timeout=20))
        return step_chunk(chunk, **kw)

    on_event = engine.hooks._on_event

    def at_event(event):
        if event.kind is MomentKind.POST_BACKWARD and event.module == "":
            reached.append(started.wait(timeout=20))  # a step is running on the worker now
        return on_event(event)

    engine.optimizer.step_chunk = held_step
    engine.hooks._on_event = at_event
    b = gpt_batches(1)[0]
    loss = loss_fn(model, b)
    loss.backward()  # every overlapped step was submitted during this; the first one is still held
    assert reached == [True] and not release.is_set()
    release.set()  # only now, on the training thread, after backward
    engine.step()
    assert held == [True]  # the held step ended after backward, and engine.step() waited for it
    assert engine.stats().optimizer_seconds_per_tier[Tier.HOST] > 0
    engine.detach()


def test_a_failed_cpu_step_raises_one_executor_error_and_fails_the_engine(tmp_path):
    schedule = schedule_for(torch.float32, Tier.HOST, True)
    model = gpt_model()
    engine = executor.run(model, schedule, lr=LR, weight_decay=WD)
    victim = backward_steps(schedule)[0]
    step_chunk = engine.optimizer.step_chunk

    def failing(chunk, **kw):
        if chunk == victim:
            raise RuntimeError("simulated kernel failure")
        return step_chunk(chunk, **kw)

    engine.optimizer.step_chunk = failing
    b = gpt_batches(1)[0]
    with pytest.raises(ExecutorError, match=f"CPU optimizer step of chunk {victim} failed: simulated kernel failure"):
        loss_fn(model, b).backward()
        engine.step()
    assert engine.state is EngineState.FAILED
    assert "simulated kernel failure" in engine.failure.message
    with pytest.raises(ExecutorError, match="the replay stopped earlier"):
        loss_fn(model, b)
    failure = engine.failure
    assert victim not in failure.updated_chunks  # its step failed: it did not take one
    if failure.torn:  # other chunks took the step before it surfaced: no consistent state to save
        with pytest.raises(ExecutorError, match="tore the optimizer step"):
            engine.state_dict()
    else:  # it surfaced before any other step landed: nothing changed
        assert not failure.updated_chunks
        for name, p in gpt_model().named_parameters():
            assert torch.equal(engine.state_dict()["model"][name], p.detach()), name
    engine.detach()  # and the model gets its params back


def test_overlapped_steps_use_the_hyperparameters_of_their_iteration(tmp_path):
    """An LR scheduler stepping after engine.step() never races a step still on the worker."""
    losses = {}
    for overlap in (True, False):
        model = gpt_model()
        engine = executor.run(model, schedule_for(torch.float32, Tier.HOST, overlap), lr=LR, weight_decay=WD)
        sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
        got = []
        for b in gpt_batches(4):
            loss = loss_fn(model, b)
            loss.backward()
            got.append(loss.item())
            engine.step()
            sched.step()
        losses[overlap] = (got, engine.state_dict()["model"])
        engine.detach()
    assert losses[True][0] == losses[False][0]
    for name, t in losses[True][1].items():
        assert torch.equal(t, losses[False][1][name]), name


def test_optimizer_threads_is_checked():
    with pytest.raises(ExecutorError, match="optimizer_threads=0"):
        executor.run(gpt_model(), schedule_for(torch.float32, Tier.HOST, True), optimizer_threads=0)


# ----------------------------------------------------------------------------------- stale mode (item 4)


def stale_reference(steps: int):
    """Plain PyTorch one-step staleness: at the step of iteration t the params used next are the
    fp32 master holding updates 1..t-1, and update t (from this iteration's grads) is applied after."""
    compute, master = gpt_model(), gpt_model()
    opt = torch.optim.AdamW(plain_groups(master), lr=LR, fused=True)
    losses = []
    for b in gpt_batches(steps):
        loss = loss_fn(compute, b)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for c, m in zip(compute.parameters(), master.parameters()):
                m.grad = c.grad
                c.grad = None
                c.copy_(m)  # publish updates through t-1, then apply g_t in the background
        opt.step()
        opt.zero_grad()
    return losses, master


def test_stale_optimizer_is_exactly_one_step_stale_and_differs_from_sync(tmp_path, capsys):
    steps = 12
    schedule = schedule_for(torch.float32, Tier.HOST, True)
    stale_losses, stale_state, _, _ = train(schedule, torch.float32, tmp_path, steps=steps, stale_optimizer=True)
    sync_losses, sync_state, _, _ = train(schedule, torch.float32, tmp_path, steps=steps)
    ref_losses, ref_master = stale_reference(steps)
    # 1. what it computes: the one-step-stale update, to the bit (state_dict() drains the last update)
    assert stale_losses == ref_losses
    for name, p in ref_master.named_parameters():
        assert torch.equal(stale_state["model"][name], p.detach()), name
    # 2. it is not the synchronous engine: iteration 2 still runs on the initial params
    assert stale_losses[0] == sync_losses[0] and stale_losses[1] != sync_losses[1]
    sync_flat = torch.cat([t.reshape(-1) for t in sync_state["model"].values()])
    stale_flat = torch.cat([stale_state["model"][n].reshape(-1) for n in sync_state["model"]])
    drift = ((stale_flat - sync_flat).norm() / sync_flat.norm()).item()  # all params as one vector
    gap = abs(stale_losses[-1] - sync_losses[-1]) / sync_losses[-1]
    with capsys.disabled():
        print(f"\nstale_optimizer=True vs synchronous engine after {steps} steps (lr {LR}): relative param "
              f"difference {drift:.2e}, final loss {stale_losses[-1]:.4f} vs {sync_losses[-1]:.4f} ({100 * gap:.1f}%)")
    assert drift > 1e-4  # a real difference, not rounding
    assert stale_losses[-1] < stale_losses[0]  # and yet it trains


def test_stale_optimizer_needs_the_os_on_host():
    with pytest.raises(ExecutorError, match=r"stale_optimizer=True: the optimizer state of chunks .* HOST"):
        executor.run(gpt_model(), schedule_for(torch.float32, Tier.NVME, True), stale_optimizer=True, nvme_dir="/tmp")


# ----------------------------------------------------------------------------------- the store's side


def two_chunk_store():
    from executor.store import ChunkStore
    from schemas.schedule import Chunk, ChunkLayout, TensorSlot
    from schemas.trace import DType

    lists = (ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V)
    layout = ChunkLayout(chunk_elements=64, lists=lists, list_dtypes={x: DType.FLOAT32 for x in lists},
                         chunks=tuple(Chunk(id=c, elements=64, used_elements=64, block=-1, comm_group=c, owner_rank=0)
                                      for c in range(2)),
                         tensors=tuple(TensorSlot(tensor=c, names=(f"w{c}",), shape=(64,), chunk=c, offset_elements=0,
                                                  numel=64, trainable=True) for c in range(2)))
    store = ChunkStore(layout, device_capacity_bytes=1 << 20, device=torch.device("cpu"))
    for c in range(2):
        for lst in lists:
            store.place(lst, c, Tier.HOST, torch.full((64,), float(c)))
    return store


def test_a_step_in_flight_orders_the_copies_and_evicts_of_its_payloads():
    from executor.cpu_steps import StepWorker
    from executor.store import CopyState

    store = two_chunk_store()
    worker = StepWorker(threads=1)
    release = threading.Event()
    grad = store.tensor(ChunkList.GRAD, 0, Tier.HOST, why="test")

    def step(t):
        assert release.wait(timeout=20)
        t[ChunkList.PARAM].add_(t[ChunkList.GRAD] + 1)

    ready = store.in_place(0, Tier.HOST, writes=[ChunkList.PARAM, ChunkList.M, ChunkList.V], reads=[ChunkList.GRAD],
                           submit=worker.submit, run=step)
    assert store.state(ChunkList.PARAM, 0, Tier.HOST) is CopyState.ARRIVING
    store.copy(ChunkList.PARAM, 0, Tier.HOST, Tier.DEVICE, Channel.H2D, why="the stepped chunk")  # after the step
    store.copy(ChunkList.PARAM, 1, Tier.HOST, Tier.DEVICE, Channel.H2D, why="another chunk")  # queued behind it
    store.wait(ChunkList.PARAM, 1, Tier.DEVICE)  # lands while the step is held: no head-of-line blocking
    in_use = store.pools[Tier.HOST].in_use_bytes
    store.evict(ChunkList.GRAD, 0, Tier.HOST, why="grads read by the step")  # returns at once...
    assert store.pools[Tier.HOST].in_use_bytes == in_use - 64 * 4
    fresh = store.pools[Tier.HOST].allocate(torch.float32, 64, what="test")
    assert fresh.data_ptr() != grad.data_ptr()  # ...and its buffer is not handed out while the step reads it
    assert not ready.done()
    release.set()
    assert torch.equal(store.tensor(ChunkList.PARAM, 0, Tier.DEVICE, why="test"), torch.ones(64))  # 0 + (0 + 1)
    store.wait(ChunkList.PARAM, 0, Tier.HOST)  # states change when waited for, as for copies
    assert store.state(ChunkList.PARAM, 0, Tier.HOST) is CopyState.VALID
    worker.shutdown()
    store.close()
