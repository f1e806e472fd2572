"""materialize: decisions -> a complete, valid, steady-state schedule, checked by replaying it."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import TRACES
from planner.errors import InfeasibleError
from planner.families import gpt_trace
from planner.layout import build_layout
from planner.materialize import (
    Decisions,
    EvictionRule,
    SolverStats,
    materialize,
    param_budget_bytes,
    replay_residency,
    uniform_decisions,
)
from planner.presets import resolve_hardware
from planner.problem import build_problem
from planner.simulate import simulate
from schemas import Schedule, Trace
from schemas.schedule import ActivationMode, Channel, ChunkList, Op, SolverStatus, Tier, action_channels
from schemas.trace import Phase, trace_digest

DIGEST = "sha256:" + "0" * 64
HW = resolve_hardware("cpu-emulated")
TRACE = gpt_trace(layers=4, hidden=64, heads=4, seq=32, batch=2, vocab=1000)
FP32 = gpt_trace(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=1000, dtype="float32")
CHUNK = 16384


def problem(trace=TRACE, device_bytes=20_000_000, hardware=HW, **kw):
    return build_problem(trace, hardware, trace_digest=DIGEST, device_bytes=device_bytes, **kw)


def layout_of(p, chunk=CHUNK):
    return build_layout(p, chunk_elements=chunk)


def check(schedule: Schedule, decisions: Decisions, hardware=HW) -> None:
    """Everything a schedule must satisfy, replayed three ways."""
    assert Schedule.from_msgpack(schedule.to_msgpack()) == schedule  # valid and lossless
    replay_residency(schedule)  # copies from valid copies, chunks present when used, steady state
    sim = simulate(schedule, hardware)  # the simulator agrees: no violation, same bytes
    moved: dict[Channel, int] = {}
    for a in schedule.actions:
        for ch in action_channels(a):
            moved[ch] = moved.get(ch, 0) + a.bytes
    # the prediction is the simulator's: it lists every channel, those no action uses at 0 bytes
    predicted = schedule.prediction.bytes_per_channel
    assert {ch: v for ch, v in predicted.items() if v} == {ch: v for ch, v in moved.items() if v}
    assert set(predicted) == set(Channel)
    assert {ch: v for ch, v in sim.bytes_per_channel.items() if v} == {ch: v for ch, v in moved.items() if v}
    assert schedule.prediction.iteration_seconds == pytest.approx(sum(s.predicted_seconds for s in schedule.stages))
    for tier, peak in schedule.prediction.peak_bytes_per_tier.items():
        # ours also counts copies alive only between two actions of one moment
        assert sim.peak_bytes_per_tier[tier] <= peak <= getattr(schedule.budgets, f"{tier.value.lower()}_bytes")
    assert schedule.prediction.peak_bytes_per_tier[Tier.DEVICE] <= schedule.budgets.device_bytes
    _check_param_budget(schedule, decisions)


def _check_param_budget(schedule: Schedule, decisions: Decisions) -> None:
    """PARAM+GRAD bytes on DEVICE never exceed the moment's budget, after any action."""
    itemsize = {x: 4 if schedule.layout.list_dtypes[x].value == "float32" else 2 for x in schedule.layout.lists}
    size = lambda x, c: schedule.layout.chunks[c].elements * itemsize[x]  # noqa: E731
    on_device = {(r.list, r.chunk) for r in schedule.initial_residency if Tier.DEVICE in r.tiers and r.list is ChunkList.PARAM}
    used = sum(size(x, c) for x, c in on_device)
    for a in schedule.actions:
        key = (a.list, a.chunk)
        if a.list in (ChunkList.PARAM, ChunkList.GRAD):
            if a.op in (Op.FETCH, Op.PREFETCH, Op.ALLOCATE) and a.dst is Tier.DEVICE and key not in on_device:
                on_device.add(key)
                used += size(*key)
            elif a.op is Op.EVICT and a.src is Tier.DEVICE:
                on_device.discard(key)
                used -= size(*key)
        assert used <= decisions.param_device_budget_bytes[a.moment], f"over budget at action {a}"


def fetches(schedule: Schedule) -> int:
    return sum(a.op in (Op.FETCH, Op.PREFETCH) and a.dst is Tier.DEVICE and a.list in (ChunkList.PARAM, ChunkList.GRAD)
               for a in schedule.actions)


def h2d_bytes(schedule: Schedule) -> int:
    return schedule.prediction.bytes_per_channel.get(Channel.H2D, 0)


CASES = {
    "cpu adam, loose": dict(),
    "cpu adam, tight": dict(param_budget=450_000),
    "gpu adam, os on device": dict(os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE),
    "gpu adam, os on host, tight": dict(optimizer_tier=Tier.DEVICE, param_budget=450_000),
    "os and params on nvme": dict(os_tier=Tier.NVME, param_home=Tier.NVME, param_budget=450_000),
    "gpu adam, nvme, no overlap": dict(os_tier=Tier.NVME, optimizer_tier=Tier.DEVICE, param_home=Tier.NVME,
                                       param_budget=450_000, optimizer_overlap=False),
    "swap to host": dict(activation_mode=ActivationMode.SWAP_HOST, param_budget=450_000),
    "swap to nvme": dict(activation_mode=ActivationMode.SWAP_NVME),
    "recompute": dict(activation_mode=ActivationMode.RECOMPUTE, prefetch=False),
    "all persistent": dict(persistent_chunks="all"),
    "some persistent, lru": dict(persistent_chunks=[0, 1], optimizer_overlap=False, eviction=EvictionRule.LRU,
                                 param_budget=600_000),
    "farthest next use": dict(eviction=EvictionRule.FARTHEST_NEXT_USE, param_budget=450_000),
    "gpu adam, os streamed from nvme": dict(os_tier=Tier.NVME, optimizer_tier=Tier.DEVICE, param_budget=450_000),
    "os on nvme, paced cpu steps": dict(os_tier=Tier.NVME, param_home=Tier.NVME, param_budget=450_000,
                                        pace_optimizer_io=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_materialized_schedules_are_valid_and_steady(name: str) -> None:
    p = problem()
    layout = layout_of(p)
    assert len(layout.chunks) == 19  # wte, wpe, 4 x 4 per block, ln_f
    kw = dict(CASES[name])
    if kw.get("persistent_chunks") == "all":
        kw["persistent_chunks"] = range(len(layout.chunks))
    pace = kw.pop("pace_optimizer_io", False)
    decisions = dataclasses.replace(uniform_decisions(p, layout, **kw), pace_optimizer_io=pace)
    check(materialize(p, decisions), decisions)


def _nvme_os_order(schedule: Schedule) -> list[tuple[str, int]]:
    """("r"/"w", chunk) of the MASTER-or-M (first OS list) copies on the NVMe channels, in action order."""
    first = next(x for x in schedule.layout.lists if x not in (ChunkList.PARAM, ChunkList.GRAD))
    return [("r" if a.channel is Channel.NVME_READ else "w", a.chunk) for a in schedule.actions
            if a.list is first and a.channel in (Channel.NVME_READ, Channel.NVME_WRITE)]


def test_streamed_device_steps_read_the_next_os_before_writing_this_one_back() -> None:
    """The SSDs are one FIFO: a write-back queued before the next read would hold that read behind
    the whole DEVICE round trip of the step; the reads run one step ahead instead."""
    p = problem()
    decisions = uniform_decisions(p, layout_of(p), os_tier=Tier.NVME, optimizer_tier=Tier.DEVICE, param_budget=450_000)
    order = _nvme_os_order(materialize(p, decisions))
    chunks = [c for kind, c in order if kind == "r"]
    assert len(chunks) == len(set(chunks)) >= 3
    for k in range(len(chunks) - 1):  # read k+1 comes before write k
        assert order.index(("r", chunks[k + 1])) < order.index(("w", chunks[k]))


def test_paced_cpu_steps_are_valid_and_write_back_after_their_step() -> None:
    """With a CPU optimizer much slower than backward the steps are issued at its pace (later than
    their grads are final), and every OS write-back still follows its own step. Whether pacing is
    faster depends on the plan: `planner.solve` replays both and keeps the faster."""
    host = HW.host  # every CPU Adam price 50x slower: the flat rate and the measured table the cost model reads
    rates = tuple(dataclasses.replace(r, params_per_s=r.params_per_s / 50, params_per_s_with_copies=r.params_per_s_with_copies / 50)
                  for r in host.adam_rates)
    slow = dataclasses.replace(HW, host=dataclasses.replace(host, optimizer_params_per_s=host.optimizer_params_per_s / 50,
                                                            adam_rates=rates))
    p = problem(hardware=slow)
    base = uniform_decisions(p, layout_of(p), os_tier=Tier.NVME, param_home=Tier.NVME, param_budget=450_000,
                             activation_mode=ActivationMode.SWAP_NVME)
    steps_in_backward = {}
    for pace in (False, True):
        decisions = dataclasses.replace(base, pace_optimizer_io=pace)
        schedule = materialize(p, decisions)
        check(schedule, decisions, slow)
        step_at = {a.chunk: i for i, a in enumerate(schedule.actions) if a.op is Op.OPTIMIZER_STEP}
        for i, a in enumerate(schedule.actions):
            if a.channel is Channel.NVME_WRITE and a.list in (ChunkList.MASTER, ChunkList.M, ChunkList.V):
                assert i > step_at[a.chunk]
        steps_in_backward[pace] = [a.moment for a in schedule.actions if a.op is Op.OPTIMIZER_STEP]
    assert steps_in_backward[True] != steps_in_backward[False]
    assert all(a >= b for a, b in zip(steps_in_backward[True], steps_in_backward[False]))  # never earlier


def test_fp32_and_the_recorded_small_trace() -> None:
    p = problem(FP32)
    assert ChunkList.MASTER not in p.lists
    for kw in (dict(), dict(optimizer_tier=Tier.DEVICE, param_budget=900_000)):
        d = uniform_decisions(p, layout_of(p), **kw)
        check(materialize(p, d), d)
    path = TRACES / "gpt-small.msgpack"
    if path.exists():
        raw = path.read_bytes()
        p = build_problem(Trace.from_msgpack(raw), HW, trace_digest=trace_digest(raw))
        d = uniform_decisions(p, build_layout(p, chunk_elements=65536), os_tier=Tier.NVME,
                              activation_mode=ActivationMode.SWAP_HOST)
        check(materialize(p, d), d)


def test_several_ranks_gather_and_reduce_scatter() -> None:
    hw = dataclasses.replace(HW, cluster=dataclasses.replace(HW.cluster, world_size=2, gpus_per_node=2),
                             links=dataclasses.replace(HW.links, inter_gpu_gb_per_s=10.0))
    trace = gpt_trace(layers=4, hidden=64, heads=4, seq=32, batch=2, vocab=1000, world_size=2)
    p = problem(trace, hardware=hw)
    layout = layout_of(p)
    for kw in (dict(param_budget=1_500_000), dict(optimizer_tier=Tier.DEVICE, optimizer_overlap=False),
               dict(persistent_chunks=[0, 1])):
        d = uniform_decisions(p, layout, **kw)
        s = materialize(p, d)
        check(s, d, hw)
        ops = [a.op for a in s.actions]
        assert Op.ALL_GATHER in ops and Op.REDUCE_SCATTER in ops
        assert all(a.channel is Channel.INTER_GPU for a in s.actions if a.op in (Op.ALL_GATHER, Op.REDUCE_SCATTER))


def test_belady_never_fetches_more_than_lru() -> None:
    p = problem()
    layout = layout_of(p)
    for budget in (450_000, 600_000, 900_000):
        counts = {}
        for rule in EvictionRule:
            d = uniform_decisions(p, layout, param_budget=budget, eviction=rule, prefetch=False)
            counts[rule] = fetches(materialize(p, d))
        assert counts[EvictionRule.BELADY_CLEAN_FIRST] <= counts[EvictionRule.LRU]
        assert counts[EvictionRule.FARTHEST_NEXT_USE] <= counts[EvictionRule.LRU]


def test_tight_budget_moves_more_than_a_loose_one() -> None:
    p = problem()
    layout = layout_of(p)
    loose = materialize(p, uniform_decisions(p, layout))
    tight = materialize(p, uniform_decisions(p, layout, param_budget=450_000))
    assert h2d_bytes(tight) > h2d_bytes(loose)
    assert fetches(tight) > fetches(loose)


def test_prefetch_moves_fetches_earlier_without_moving_more() -> None:
    p = problem()
    layout = layout_of(p)
    on_demand = materialize(p, uniform_decisions(p, layout, param_budget=600_000, prefetch=False))
    early = materialize(p, uniform_decisions(p, layout, param_budget=600_000))
    assert Op.PREFETCH not in {a.op for a in on_demand.actions if a.list is ChunkList.PARAM}
    assert any(a.op is Op.PREFETCH for a in early.actions)
    assert early.prediction.bytes_per_channel == on_demand.prediction.bytes_per_channel
    assert early.prediction.iteration_seconds <= on_demand.prediction.iteration_seconds
    assert sum(a.moment for a in early.actions if a.dst is Tier.DEVICE and a.list is ChunkList.PARAM) < \
        sum(a.moment for a in on_demand.actions if a.dst is Tier.DEVICE and a.list is ChunkList.PARAM)


def test_cpu_optimizer_overlaps_backward_only_when_asked() -> None:
    p = problem()
    layout = layout_of(p)
    for overlap in (True, False):
        s = materialize(p, uniform_decisions(p, layout, optimizer_overlap=overlap))
        phases = {s.moments[a.moment].phase for a in s.actions if a.op is Op.OPTIMIZER_STEP}
        assert phases == ({Phase.BACKWARD} if overlap else {Phase.OPTIMIZER})  # the last grads are final before the step
        assert sum(a.op is Op.OPTIMIZER_STEP for a in s.actions) == len(layout.chunks)


def test_activation_modes_become_copies_or_recompute_time() -> None:
    p = problem()
    layout = layout_of(p)
    keep = materialize(p, uniform_decisions(p, layout))
    swap = materialize(p, uniform_decisions(p, layout, activation_mode=ActivationMode.SWAP_HOST))
    recompute = materialize(p, uniform_decisions(p, layout, activation_mode=ActivationMode.RECOMPUTE))
    offloads = [a for a in swap.actions if a.op is Op.ACT_OFFLOAD]
    reloads = [a for a in swap.actions if a.op is Op.ACT_RELOAD]
    assert [a.block for a in offloads] == [0, 1, 2, 3] and sorted(a.block for a in reloads) == [0, 1, 2, 3]
    for off, rel in zip(offloads, sorted(reloads, key=lambda a: a.block)):
        assert off.bytes == rel.bytes == p.blocks[off.block].activation_bytes and off.moment < rel.moment
        assert rel.moment < p.blocks[off.block].backward_moments[0]
    assert not any(a.op in (Op.ACT_OFFLOAD, Op.ACT_RELOAD) for a in recompute.actions)
    assert recompute.prediction.flops == keep.prediction.flops + sum(b.recompute_flops for b in p.blocks)
    assert recompute.prediction.iteration_seconds > keep.prediction.iteration_seconds
    assert recompute.prediction.peak_bytes_per_tier[Tier.DEVICE] < keep.prediction.peak_bytes_per_tier[Tier.DEVICE]


def test_impossible_budget_names_the_numbers() -> None:
    p = problem()
    layout = layout_of(p)
    with pytest.raises(InfeasibleError, match=r"budget too small at moment \d+ .*bytes short"):
        materialize(p, uniform_decisions(p, layout, param_budget=100_000))
    small = problem(device_bytes=1_000_000)
    with pytest.raises(InfeasibleError, match=r"DEVICE runs out at moment \d+.*smallest DEVICE capacity that would work is \d+"):
        materialize(small, uniform_decisions(small, layout))
    tiny_host = problem(host_bytes=1_000)
    with pytest.raises(InfeasibleError, match=r"HOST runs out .*smallest HOST capacity"):
        materialize(tiny_host, uniform_decisions(tiny_host, layout))


def test_smallest_capacity_in_the_message_works() -> None:
    layout = layout_of(problem())
    small = problem(device_bytes=1_000_000)
    with pytest.raises(InfeasibleError) as info:
        materialize(small, uniform_decisions(small, layout))
    smallest = int(str(info.value).split("would work is ")[1].split()[0])
    enough = problem(device_bytes=smallest)
    d = uniform_decisions(enough, layout)
    check(materialize(enough, d), d)


def test_same_inputs_same_bytes_and_header() -> None:
    p = problem()
    layout = layout_of(p)
    d = uniform_decisions(p, layout, param_budget=450_000, os_tier=Tier.NVME)
    a, b = materialize(p, d), materialize(p, d)
    assert a.to_msgpack() == b.to_msgpack()
    assert a.header.solver_status is SolverStatus.HEURISTIC and a.header.trace_digest == DIGEST
    assert a.header.objective_seconds == a.prediction.iteration_seconds
    stats = SolverStats(status=SolverStatus.OPTIMAL, objective_seconds=1.0, lower_bound_seconds=0.99, gap=0.01)
    solved = materialize(p, d, stats=stats)
    assert solved.header.solver_status is SolverStatus.OPTIMAL and solved.header.gap == 0.01


def test_default_budget_leaves_room_for_non_model_and_os() -> None:
    p = problem()
    layout = layout_of(p)
    d = uniform_decisions(p, layout, os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE)
    budget = param_budget_bytes(p, layout, d.chunk_plans, d.activation_modes)
    assert all(0 <= b < p.device_bytes for b in budget)
    s = materialize(p, d)
    assert s.prediction.peak_bytes_per_tier[Tier.DEVICE] <= p.device_bytes


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40)
@given(
    layers=st.integers(1, 3),
    dtype=st.sampled_from(["bfloat16", "float32"]),
    chunk=st.sampled_from([4096, 16384, 65536]),
    budget_fraction=st.floats(0.2, 1.5),
    os_tier=st.sampled_from(list(Tier)),
    device_step=st.booleans(),
    param_home=st.sampled_from([Tier.HOST, Tier.NVME]),
    mode=st.sampled_from(list(ActivationMode)),
    persistent=st.integers(0, 3),
    overlap=st.booleans(),
    prefetch=st.booleans(),
    rule=st.sampled_from(list(EvictionRule)),
)
def test_any_decisions_give_a_valid_schedule_or_an_explanation(layers, dtype, chunk, budget_fraction, os_tier, device_step,
                                                                param_home, mode, persistent, overlap, prefetch, rule) -> None:
    trace = gpt_trace(layers=layers, hidden=64, heads=4, seq=32, batch=2, vocab=1000, dtype=dtype)
    p = problem(trace)
    layout = layout_of(p, chunk)
    model_bytes = sum(c.elements for c in layout.chunks) * p.list_itemsize(ChunkList.PARAM)
    optimizer_tier = Tier.DEVICE if device_step or os_tier is Tier.DEVICE else Tier.HOST
    d = uniform_decisions(p, layout, param_budget=int(2 * model_bytes * budget_fraction), os_tier=os_tier,
                          optimizer_tier=optimizer_tier, param_home=param_home, activation_mode=mode,
                          persistent_chunks=range(min(persistent, len(layout.chunks))), optimizer_overlap=overlap,
                          prefetch=prefetch, eviction=rule)
    try:
        schedule = materialize(p, d)
    except InfeasibleError as exc:
        assert "bytes" in str(exc) and "moment" in str(exc)
        return
    check(schedule, d)


@pytest.mark.parametrize("name", ["cpu adam, tight", "gpu adam, os on host, tight", "swap to host"])
def test_one_moments_param_copies_go_in_the_order_of_their_first_use(name: str) -> None:
    """The links are FIFOs: copies issued at one moment go in the order their data is needed (by chunk
    id, GPT-3 175B's backward tails queued a chunk needed two stages later ahead of the next stage's)."""
    p = problem()
    kw = dict(CASES[name])
    schedule = materialize(p, uniform_decisions(p, layout_of(p), **kw))
    chunk_of = {t.tensor: t.chunk for t in schedule.layout.tensors}
    needs = [set() if m.phase is Phase.OPTIMIZER else {chunk_of[t] for t in m.tensors if t in chunk_of}
             for m in schedule.moments]

    def first_use(c: int, m: int) -> int:
        return next((k for k in range(m, len(needs)) if c in needs[k]), len(needs))

    seen = 0
    for m in range(len(schedule.moments)):
        uses = [first_use(a.chunk, m) for a in schedule.actions
                if a.moment == m and a.list is ChunkList.PARAM and a.dst is Tier.DEVICE and a.op in (Op.FETCH, Op.PREFETCH)]
        assert uses == sorted(uses), f"moment {m}: first uses {uses}"
        seen += len(set(uses)) > 1
    assert seen  # some moment issues copies for different uses


def test_an_idle_embedding_grad_is_spilled_over_a_crowded_gap_only_when_faster() -> None:
    # Note [idle grads]: the tied embedding's GRAD is used by the head's backward and the embedding's,
    # with the blocks' backward between; at 400 kB of PARAM budget the blocks' fetches lack room beside it
    from planner import device_cache as dc
    from planner.materialize import _emission, _finished
    trace = gpt_trace(layers=8, hidden=64, heads=4, seq=32, batch=2, vocab=1000)
    p = problem(trace)
    d = dataclasses.replace(uniform_decisions(p, layout_of(p), param_budget=400_000), spill_idle_grads=True)
    plan = dc.cache_plan(p, d)
    intervals = dc.demand_pass(plan)
    dc.trim_intervals(intervals, len(plan.tick_moment))
    before = [(iv.entry, iv.start, iv.end) for iv in intervals]
    spilled = dc.spill_idle_grads(plan, intervals)
    assert spilled is not None and [(iv.entry, iv.start, iv.end) for iv in intervals] == before  # a new list
    grads = [iv for iv in spilled if iv.entry & 1 == dc.GRAD_ENTRY]
    split = [e for e in {iv.entry for iv in grads} if sum(iv.entry == e for iv in grads) > 1]
    assert split
    for e in split:
        stays = sorted((iv for iv in grads if iv.entry == e), key=lambda iv: iv.start)
        assert stays[0].write_back and not stays[1].allocate
        assert stays[1].start - stays[0].end >= dc.IDLE_GRAD_MIN_TICKS - 1
    schedule, _ = _finished(p, d, None, _emission(p, d, plan, spilled, None))
    check(schedule, d)  # the round trip is a valid schedule: written back to HOST, fetched back before its use
    assert any(a.list is ChunkList.GRAD and a.src is Tier.HOST and a.dst is Tier.DEVICE for a in schedule.actions)
    # materialize keeps the faster of the two: here the round trip costs more than the room it makes
    kept = materialize(p, d)
    plain = materialize(p, dataclasses.replace(d, spill_idle_grads=False))
    assert kept.prediction.iteration_seconds == min(plain.prediction.iteration_seconds,
                                                    schedule.prediction.iteration_seconds)
    assert kept.actions == plain.actions


def test_replay_memo_replays_a_plan_once_under_any_name(monkeypatch) -> None:
    import planner.materialize as mat
    from planner.replays import replay_memo
    p = problem()
    d = uniform_decisions(p, layout_of(p), param_budget=450_000, os_tier=Tier.NVME)
    twin = dataclasses.replace(d, policy="twin", notes=("another name, the same plan",))
    other = dataclasses.replace(d, prefetch=False)
    expected = [mat.materialize_replayed(p, x) for x in (d, twin, other)]
    calls = []
    real = mat._materialize_replayed
    monkeypatch.setattr(mat, "_materialize_replayed", lambda *a: calls.append(a[1].policy) or real(*a))
    with replay_memo():
        got = [mat.materialize_replayed(p, x) for x in (d, twin, other, d)]
        # another problem object (planner.solve's HOST-shortfall probe) is not the same plan
        mat.materialize_replayed(dataclasses.replace(p), d)
    assert calls == ["tide", "tide", "tide"]  # d, other, d on the copied problem: the twin and the repeat are not replayed
    for (schedule, replay), (want, want_replay) in zip(got, expected + [expected[0]]):
        assert schedule.to_msgpack() == want.to_msgpack() and replay == want_replay
    mat.materialize_replayed(p, d)
    assert len(calls) == 4  # outside the memo every call replays


def test_streamed_device_steps_swap_their_os_so_the_link_moves_both_ways(monkeypatch) -> None:
    # Note [streamed write-back after the next fetch] in planner/emit.py: on a link with measured
    # both-ways rates (a100-80g-12ssd), step k's OS goes down between step k+1's OS fetches, and the
    # replay is faster than fetch k, step k, write-back k, fetch k+1 (which runs the link one way at a time)
    import planner.emit as emit

    hw = resolve_hardware("a100-80g-12ssd")
    assert hw.links.duplex_h2d_gb_per_s > 0
    p = problem(device_bytes=20_000_000, hardware=hw)
    decisions = uniform_decisions(p, layout_of(p), os_tier=Tier.HOST, optimizer_tier=Tier.DEVICE, param_budget=450_000)
    swapped = materialize(p, decisions)
    check(swapped, decisions, hardware=hw)
    os_lists = {ChunkList.MASTER, ChunkList.M, ChunkList.V}
    opt = [a for a in swapped.actions if a.moment == p.optimizer_moment and a.list in os_lists
           and a.op in (Op.FETCH, Op.WRITE_BACK)]
    steps = [a.chunk for a in swapped.actions if a.op is Op.OPTIMIZER_STEP and a.dst is Tier.DEVICE]
    assert len(steps) >= 2
    first_fetch = {}
    for i, a in enumerate(opt):
        if a.op is Op.FETCH:
            first_fetch.setdefault(a.chunk, i)
    last_write = {a.chunk: i for i, a in enumerate(opt) if a.op is Op.WRITE_BACK}
    # every step but the last writes its OS back after the next step's OS started coming up
    assert all(last_write[c] > first_fetch[n] for c, n in zip(steps, steps[1:]))
    monkeypatch.setattr(emit, "_may_defer_write_back", lambda *a, **k: False)
    serial = materialize(p, decisions)
    check(serial, decisions, hardware=hw)
    assert swapped.prediction.iteration_seconds < serial.prediction.iteration_seconds


def _nvme_streamed_steps():
    """a100-80g-12ssd, OS on NVME stepped on DEVICE: the NVMe-streamed DEVICE steps of the tests below."""
    hw = resolve_hardware("a100-80g-12ssd")
    p = problem(device_bytes=20_000_000, hardware=hw)
    return hw, p, uniform_decisions(p, layout_of(p), os_tier=Tier.NVME, optimizer_tier=Tier.DEVICE, param_budget=450_000)


def test_nvme_streamed_device_steps_swap_their_os_with_two_staged_on_host(monkeypatch) -> None:
    # Note [streamed write-back after the next fetch], OS on NVME: step k's OS goes down (D2H, then on to
    # the SSDs) between step k+1's OS fetches, step k+2's reads follow it so HOST stages two steps' OS at
    # most (the placement model's NVME_STREAM_STAGED_CHUNKS), and the replay beats the serial order
    import planner.emit as emit

    hw, p, decisions = _nvme_streamed_steps()
    swapped = materialize(p, decisions)
    check(swapped, decisions, hardware=hw)
    os_lists = {ChunkList.MASTER, ChunkList.M, ChunkList.V}
    opt = [a for a in swapped.actions if a.moment == p.optimizer_moment and a.list in os_lists]
    steps = [a.chunk for a in swapped.actions if a.op is Op.OPTIMIZER_STEP and a.dst is Tier.DEVICE]
    assert len(steps) >= 3
    first_fetch, last_down, staged, most = {}, {}, set(), 0
    for i, a in enumerate(opt):
        if a.op is Op.FETCH and a.dst is Tier.DEVICE:
            first_fetch.setdefault(a.chunk, i)
        if a.op is Op.WRITE_BACK and a.src is Tier.DEVICE:
            last_down[a.chunk] = i
        if a.op is Op.FETCH and a.src is Tier.NVME:
            staged.add((a.list, a.chunk))
        if a.op is Op.EVICT and a.src is Tier.HOST:
            staged.discard((a.list, a.chunk))
        most = max(most, len({c for _, c in staged}))
    assert all(last_down[c] > first_fetch[n] for c, n in zip(steps, steps[1:]))
    assert most <= 2
    monkeypatch.setattr(emit, "_may_defer_write_back", lambda *a, **k: False)
    serial = materialize(p, decisions)
    check(serial, decisions, hardware=hw)
    assert swapped.prediction.iteration_seconds < serial.prediction.iteration_seconds


def test_pacing_estimate_prices_streamed_steps_at_the_links_both_ways_rows() -> None:
    # planner.emit._estimated_tick_seconds paces the overlapped CPU steps' SSD traffic: a streamed DEVICE
    # step moves its OS up and down (and PARAM, GRAD up, PARAM down), which the simulator charges at the
    # link's both-ways rows (costmodel.pcie_time_rows), not at each direction's rate alone
    from planner.costmodel import pcie_time_rows
    from planner.device_cache import cache_plan
    from planner.emit import _estimated_tick_seconds

    hw = resolve_hardware("a100-80g-12ssd")
    p = problem(device_bytes=20_000_000, hardware=hw)
    decisions = uniform_decisions(p, layout_of(p), os_tier=Tier.HOST, optimizer_tier=Tier.DEVICE, param_budget=450_000)
    plan = cache_plan(p, decisions)
    est = _estimated_tick_seconds(plan)
    checked = 0
    for g, tick in plan.device_step_tick.items():
        if tick + 1 >= len(est):
            continue
        up = down = 0
        for c in plan.trainable_chunks[g]:
            os_bytes = sum(plan.chunk_bytes[x][c] for x in p.os_lists)
            up += os_bytes + 2 * plan.chunk_bytes[ChunkList.PARAM][c]
            down += os_bytes + plan.chunk_bytes[ChunkList.PARAM][c]
        rows = max(a * up + b * down for a, b in pcie_time_rows(hw))
        assert rows > max(up / hw.h2d_bytes_per_s, down / hw.d2h_bytes_per_s)  # the rows charge more here
        assert est[tick + 1] - est[tick] == pytest.approx(rows)
        checked += 1
    assert checked >= 2


def test_offloaded_activations_stay_on_device_until_their_copy_lands() -> None:
    """Note [offloads in flight]: a swapped block's activations count on DEVICE from its offload
    until the first moment estimated to start after the copy lands, at most until its reload."""
    from planner.decisions import activation_moments, non_model_curve, offload_landing_moments

    p = problem()
    modes = (ActivationMode.SWAP_HOST,) * len(p.blocks)
    n = len(p.moments)
    plain = non_model_curve(p, modes).astype(int)
    # moments that take no time: no copy lands before the reload, the block is held all along
    held = non_model_curve(p, modes, offload_in_flight=True, moment_seconds=(0.0,) * n).astype(int)
    # moments of an hour: every copy lands during its offload moment
    landed = non_model_curve(p, modes, offload_in_flight=True, moment_seconds=(3600.0,) * n).astype(int)
    want_held, want_landed = plain.copy(), plain.copy()
    swapped = 0
    for b, info in enumerate(p.blocks):
        fwd_last, reload, _ = activation_moments(p, b)
        if fwd_last < 0 or reload <= fwd_last:
            continue
        swapped += 1
        want_held[fwd_last:reload] += info.activation_bytes
        want_landed[fwd_last] += info.activation_bytes
    assert swapped >= 2
    assert held.tolist() == want_held.tolist()
    assert landed.tolist() == want_landed.tolist()
    landing = offload_landing_moments(p, modes, moment_seconds=(0.0,) * n)
    assert all(m == activation_moments(p, b)[1] for b, m in landing.items())
    layout = layout_of(p)
    d = uniform_decisions(p, layout, os_tier=Tier.HOST, optimizer_tier=Tier.HOST)
    hint = (0.0,) * n
    tight = param_budget_bytes(p, layout, d.chunk_plans, modes, offload_in_flight=True, moment_seconds=hint)
    loose = param_budget_bytes(p, layout, d.chunk_plans, modes)
    assert all(a <= b for a, b in zip(tight, loose)) and tight != loose


def test_a_plan_with_no_room_for_offloads_in_flight_still_runs_waiting_for_them() -> None:
    # Note [offloads in flight]: where keeping the offloaded activations until they land leaves a moment's
    # chunks no room, materialize falls back to the budget that frees them as issued (the work waits)
    from planner.decisions import non_model_curve
    from planner.errors import PlannerError

    modes = (ActivationMode.SWAP_HOST,) * len(problem().blocks)
    base = problem()
    n = len(base.moments)
    hint = (0.0,) * n  # no copy lands before its reload: every swapped block is held until then
    extra = int((non_model_curve(base, modes, offload_in_flight=True, moment_seconds=hint)
                 - non_model_curve(base, modes)).max())
    assert extra > 0
    for device in range(int(non_model_curve(base, modes).max()), 20_000_000, max(1, extra // 4)):
        p = problem(device_bytes=device)
        layout = layout_of(p)
        d = uniform_decisions(p, layout, os_tier=Tier.HOST, optimizer_tier=Tier.HOST, activation_mode=ActivationMode.SWAP_HOST)
        held = dataclasses.replace(d, moment_seconds_hint=hint, param_device_budget_bytes=param_budget_bytes(
            p, layout, d.chunk_plans, modes, offload_in_flight=True, moment_seconds=hint))
        try:
            plain = materialize(p, d)
        except PlannerError:
            continue
        schedule = materialize(p, held)  # the held budget alone has no room here: it falls back
        assert schedule.actions == plain.actions
        return
    raise AssertionError("no DEVICE size where only the plain budget fits")


def test_nvme_streamed_reads_go_before_the_swap_into_the_stale_steps_room() -> None:
    # Note [streamed reads before the swap]: at step k's tick, step k+1's OS is read from NVME before the swap
    # (step k-1's OS down, step k's up), once step k-1's stale OS staged on HOST has left it; HOST stages two
    # steps' OS as before (step k-1's write-back passes through HOST list by list)
    hw, p, decisions = _nvme_streamed_steps()
    schedule = materialize(p, decisions)
    check(schedule, decisions, hardware=hw)
    os_lists = {ChunkList.MASTER, ChunkList.M, ChunkList.V}
    steps = [a.chunk for a in schedule.actions if a.op is Op.OPTIMIZER_STEP and a.dst is Tier.DEVICE]
    first: dict[tuple, int] = {}
    for i, a in enumerate(schedule.actions):
        if a.moment == p.optimizer_moment and a.list in os_lists:
            first.setdefault((a.op, a.src, a.dst, a.chunk), i)
    swaps = 0
    for prev, nxt in zip(steps, steps[2:]):
        down = first.get((Op.WRITE_BACK, Tier.DEVICE, Tier.HOST, prev))
        stale = first.get((Op.EVICT, Tier.HOST, None, prev))
        read = first[(Op.FETCH, Tier.NVME, Tier.HOST, nxt)]
        assert down is not None and stale is not None
        assert stale < read < down
        swaps += 1
    assert swaps >= 3
    staged, most = set(), 0
    for a in schedule.actions:
        if a.moment == p.optimizer_moment and a.list in os_lists:
            if a.dst is Tier.HOST:
                staged.add((a.list, a.chunk))
            elif a.op is Op.EVICT and a.src is Tier.HOST:
                staged.discard((a.list, a.chunk))
            most = max(most, len(staged))
    assert most <= 2 * len(os_lists) + 1  # two steps' OS and one list in transit


def test_streamed_reads_go_after_the_swap_where_host_has_no_room_for_them(monkeypatch) -> None:
    # the reads before the swap hold one OS list more on HOST than the placement model counts: where the
    # schedule then overflows a tier, materialize emits them after the swap (read_ahead=False)
    import planner.materialize as m

    hw, p, decisions = _nvme_streamed_steps()
    emit = m.emit_actions
    after = []

    def emit_actions(plan, intervals, **kw):
        if kw.get("read_ahead", True):
            raise InfeasibleError("HOST runs out (a stand-in for a plan without the room)")
        after.append(kw)
        return emit(plan, intervals, **kw)

    monkeypatch.setattr(m, "emit_actions", emit_actions)
    schedule = materialize(p, decisions)
    check(schedule, decisions, hardware=hw)
    assert after
    monkeypatch.setattr(m, "emit_actions", lambda plan, intervals, **kw: emit(plan, intervals, **{**kw, "read_ahead": False}))
    assert materialize(p, decisions).actions == schedule.actions


def test_paced_plans_are_paced_again_on_their_replays_clock_and_the_faster_kept(monkeypatch) -> None:
    # Note [pacing by the replay]: the CPU steps' SSD traffic paced on the first replay's clock instead of the
    # estimate; here (CPU Adam at half its rate, OS and PARAM on NVME) the second emission replays faster
    import planner.materialize as m
    from planner.device_cache import cache_plan, estimated_tick_seconds
    from planner.emit import replayed_tick_seconds

    host = HW.host
    rates = tuple(dataclasses.replace(r, params_per_s=r.params_per_s / 2, params_per_s_with_copies=r.params_per_s_with_copies / 2)
                  for r in host.adam_rates)
    slow = dataclasses.replace(HW, host=dataclasses.replace(host, optimizer_params_per_s=host.optimizer_params_per_s / 2,
                                                            adam_rates=rates))
    p = problem(hardware=slow)
    decisions = dataclasses.replace(uniform_decisions(p, layout_of(p), os_tier=Tier.NVME, param_home=Tier.NVME,
                                                      param_budget=450_000), pace_optimizer_io=True, pace_on_replay=True)
    repaced = materialize(p, decisions)
    check(repaced, decisions, slow)
    estimated = materialize(p, dataclasses.replace(decisions, pace_on_replay=False))  # a baseline's: the estimate only
    assert repaced.prediction.iteration_seconds < estimated.prediction.iteration_seconds
    monkeypatch.setattr(m, "paces_host_io", lambda plan: False)
    assert materialize(p, decisions).actions == estimated.actions
    # the clock: forward and backward ticks at the replay's moment starts, the OPTIMIZER moment's at the estimate's spacing
    plan = cache_plan(p, decisions)
    starts = simulate(estimated, slow).moment_start_seconds
    clock, est = replayed_tick_seconds(plan, starts), estimated_tick_seconds(plan)
    opt = plan.first_tick[p.optimizer_moment]
    assert clock[:opt] == [starts[m] for m in plan.tick_moment[:opt]]
    assert [b - a for a, b in zip(clock[opt:], clock[opt + 1:])] == pytest.approx([b - a for a, b in zip(est[opt:], est[opt + 1:])])
    # no pacing (no CPU step overlapped with NVMe OS): one emission
    plain = dataclasses.replace(decisions, pace_optimizer_io=False)
    monkeypatch.undo()
    assert not m.paces_host_io(cache_plan(p, plain))


@pytest.mark.parametrize("budget", [None, 450_000], ids=["loose", "tight"])
@pytest.mark.parametrize("kw", [dict(), dict(optimizer_tier=Tier.DEVICE, os_tier=Tier.NVME)], ids=["cpu adam", "streamed os"])
def test_chunks_kept_across_the_iteration_end_start_and_end_on_device(kw, budget) -> None:
    """Note [PARAM kept across the iteration's end]: a wrap-kept chunk is on DEVICE when the iteration starts (no
    copy brings it), its PARAM is current on DEVICE again at the end (the CPU's update uploaded after its step, the
    DEVICE step's written home and kept, or, evicted after its last use where the budget is tight, fetched again
    after every other copy), and the schedule is steady (`check` replays it)."""
    p = problem()
    layout = layout_of(p)
    base = uniform_decisions(p, layout, **kw, **({"param_budget": budget} if budget else {}))
    kept = frozenset(range(2, len(layout.chunks), 3))
    decisions = dataclasses.replace(base, wrap_kept_chunks=kept)
    schedule = materialize(p, decisions)
    check(schedule, decisions)
    start = {r.chunk: r.tiers for r in schedule.initial_residency if r.list is ChunkList.PARAM}
    assert all(start[c] == (Tier.DEVICE, Tier.HOST) for c in kept)
    assert all(Tier.DEVICE not in start[c] for c in set(range(len(layout.chunks))) - kept)
    steps = {a.chunk: i for i, a in enumerate(schedule.actions) if a.op is Op.OPTIMIZER_STEP}
    fetched_again = 0
    for c in kept:
        last = max(i for i, a in enumerate(schedule.actions) if a.list is ChunkList.PARAM and a.chunk == c
                   and a.op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK, Op.EVICT))
        a = schedule.actions[last]
        assert last > steps[c], c
        assert (a.op, a.dst) in ((Op.PREFETCH, Tier.DEVICE), (Op.WRITE_BACK, Tier.HOST)), (c, a)
        fetched_again += a.op is Op.PREFETCH and not any(
            b.op is Op.EVICT and b.list is ChunkList.PARAM and b.chunk == c for b in schedule.actions[last - 1:last])
    if budget is None:  # fewer H2D bytes than the same decisions fetching those chunks at the forward's start
        assert h2d_bytes(schedule) <= h2d_bytes(materialize(p, base))
    elif not kw:  # the tight budget evicts some after their last backward use: fetched again at the end (streamed
        assert fetched_again > 0  # OS: the last use is the OPTIMIZER moment's step, and they stay)
