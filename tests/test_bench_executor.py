"""bench/bench_executor.py's diagnosis (issue 17 item 6): its clocks on a running engine, and which
resource it names as mispriced when measured / predicted is outside 0.90-1.10."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import executor
from executor.models import GPT, GPTConfig
from executor.recorder import typical_seconds
from executor_support import build_schedule
from schemas.schedule import Channel, Tier
from schemas.trace import Phase

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_executor", REPO / "bench" / "bench_executor.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_executor"] = bench
_spec.loader.exec_module(bench)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_instruments_time_each_channel_and_the_engine_actions_without_changing_the_run():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    schedule = build_schedule(model, lambda m: m(idx, idx).backward(), chunk_elements=4096)
    engine = executor.run(model, schedule, lr=1e-2)
    clocks = bench.Instruments(engine)
    for _ in range(2):
        model(idx, idx).backward()
        engine.step()
        took = clocks.take()
        assert engine.stats().bytes_match(schedule)  # the clocks change nothing the engine does
        moved = {ch.value for ch, n in schedule.prediction.bytes_per_channel.items() if n and ch in (Channel.H2D, Channel.D2H)}
        assert moved and {k.removeprefix("copy ") for k in took if k.startswith("copy ") and "wall" not in k} == moved
        assert all(took[f"copy {ch}"] > 0 and took[f"copy wall {ch}"] > 0 for ch in moved)
        assert took["actions"] > 0
    engine.detach()


def _case(*, fwd: float, bwd: float, stall: float, host_busy: float, h2d_busy: float, actions: float):
    """Measured engine stats and bench clocks vs a simulated iteration of 1.0 s forward, 2.0 s backward,
    no stalls, CPU Adam busy 0.5 s, H2D busy 0.2 s."""
    schedule = SimpleNamespace(moments=[SimpleNamespace(phase=Phase.FORWARD), SimpleNamespace(phase=Phase.BACKWARD)])
    sim = SimpleNamespace(moment_start_seconds=(0.0, 1.0), iteration_seconds=3.0, stall_seconds=0.0, timeline=(),
                          busy_seconds_per_channel={Channel.CPU_OPTIMIZER: 0.5, Channel.H2D: 0.2},
                          bytes_per_channel={Channel.H2D: 1000})
    stats = SimpleNamespace(seconds_per_phase={Phase.FORWARD: fwd, Phase.BACKWARD: bwd}, stall_seconds=stall,
                            optimizer_seconds_per_tier={Tier.HOST: host_busy}, optimizer_busy_seconds_per_tier={Tier.HOST: host_busy})
    got = bench.measured_parts(stats, {"copy H2D": h2d_busy, "actions": actions}, fwd + bwd)
    rows = dict(bench.mispriced_rows(got, bench.predicted_parts(sim, schedule), plain=fwd + bwd - actions))
    return rows["offload: mispriced resource"], rows.get("offload: busy time off its price by > 10% (beside the training thread)")


def test_inside_the_band_names_nothing():
    named, busy = _case(fwd=1.05, bwd=2.05, stall=0.0, host_busy=0.5, h2d_busy=0.2, actions=0.05)
    assert named == "none (inside 0.90-1.10)" and busy is None


def test_outside_the_band_names_the_resource_off_by_most_and_the_busy_times_off_their_price():
    # the engine's per-moment actions cost 0.6 s the simulator does not price; compute is as recorded
    named, busy = _case(fwd=1.3, bwd=2.3, stall=0.0, host_busy=0.5, h2d_busy=0.4, actions=0.6)
    assert named.startswith("engine moment actions") and "+0.600 s of the +0.600 s" in named
    assert busy.startswith("H2D copies") and "x2.00" in busy and "CPU Adam" not in busy
    # stalls waiting for copies
    named, _ = _case(fwd=1.0, bwd=2.8, stall=0.8, host_busy=0.5, h2d_busy=0.2, actions=0.0)
    assert named.startswith("copies (stalls")
    # the machine is slower than the recording: compute
    named, busy = _case(fwd=1.5, bwd=3.0, stall=0.0, host_busy=0.2, h2d_busy=0.2, actions=0.0)
    assert named.startswith("compute") and busy.startswith("CPU Adam steps (busy) x0.40")


def test_typical_stats_keep_and_drop_whole_iterations():
    """The per-part figures are the mean over the iterations the recorder's statistic keeps (by the
    iteration's wall time), so they add up like one iteration's."""
    def it(fwd: float) -> SimpleNamespace:
        return SimpleNamespace(seconds_per_phase={Phase.FORWARD: fwd}, stall_seconds=fwd / 10,
                               optimizer_seconds_per_tier={}, optimizer_busy_seconds_per_tier={})

    import dataclasses

    @dataclasses.dataclass
    class Stats:
        seconds_per_phase: dict
        stall_seconds: float
        optimizer_seconds_per_tier: dict
        optimizer_busy_seconds_per_tier: dict

    times = [1.0, 9.0, 2.0, 3.0, 0.5]  # keeps iterations 0, 2, 3
    per_iteration = [Stats(**vars(it(t))) for t in times]
    stats, clocks = bench.typical_stats(per_iteration, times, [{"actions": t} for t in times])
    assert stats.seconds_per_phase[Phase.FORWARD] == pytest.approx(typical_seconds(times)) == pytest.approx(2.0)
    assert stats.stall_seconds == pytest.approx(0.2) and clocks == {"actions": pytest.approx(2.0)}


# ----------------------------------------------------------------------------- rounds (issue 17 item 6, bx6)


@pytest.fixture(scope="module")
def tiny_offloaded():
    """A tiny GPT's trace (recorded) and its offloaded schedule on the emulated DEVICE's preset."""
    from executor.recorder import record
    from planner.presets import resolve_hardware
    from schemas._base import digest_bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"idx": idx, "targets": idx}
    trace = record(model, batch, timing_iterations=1)
    hardware = resolve_hardware("cpu-emulated")
    n_params = sum(p.numel() for p in model.parameters())
    device_bytes = max(m.non_model_bytes for m in trace.moments) + n_params * 8
    schedule, _ = bench.offloaded_schedule(trace, hardware, digest_bytes(trace.to_msgpack()), device_bytes)
    assert sum(schedule.prediction.bytes_per_channel.values()) > 0  # it offloads
    return model, batch, trace, hardware, schedule


def test_with_compute_seconds_prices_the_trace_by_the_runs_with_the_recorders_statistic(tiny_offloaded):
    from executor.errors import ExecutorError
    from executor.recorder import with_compute_seconds

    _, _, trace, _, _ = tiny_offloaded
    n = len(trace.moments)
    runs = [[0.01 * (i + 1)] * n for i in range(5)]  # totals 1x..5x: the typical run is the mean of 2x, 3x, 4x
    priced = with_compute_seconds(trace, runs)
    assert [m.compute_seconds for m in priced.moments] == pytest.approx([0.03] * n)
    for b in priced.blocks:
        forward = [m for m in priced.moments if m.block == b.id and m.phase is Phase.FORWARD]
        assert forward and b.forward_seconds == pytest.approx(0.03 * len(forward))
    assert priced.tensors == trace.tensors and priced.activations == trace.activations
    with pytest.raises(ExecutorError, match=f"{n} moments"):
        with_compute_seconds(trace, [[0.01] * (n - 1)])


def test_retimed_schedule_is_the_schedule_on_its_own_trace_and_moves_only_prices(tiny_offloaded):
    from executor.recorder import with_compute_seconds

    _, _, trace, _, schedule = tiny_offloaded
    assert bench.retimed_schedule(schedule, trace) == schedule  # the planner's own rules for a measured trace
    doubled = bench.retimed_schedule(schedule, with_compute_seconds(trace, [[2 * m.compute_seconds for m in trace.moments]]))
    assert doubled.actions == schedule.actions and doubled.layout == schedule.layout
    assert [m.compute_seconds for m in doubled.moments] == pytest.approx([2 * m.compute_seconds for m in schedule.moments])


def test_each_round_is_predicted_on_its_own_recorded_runs_and_probed_rates(tiny_offloaded):
    """run_rounds re-simulates the one schedule per round on that round's recorded times and rates, and
    the pooled ratio is sum measured / sum predicted: priced by the recording the plan was solved on
    (or by another round's runs, or the profile before the probe) the predictions below differ."""
    import dataclasses

    from executor.recorder import with_compute_seconds
    from planner.simulate import simulate

    base, batch, trace, hardware, schedule = tiny_offloaded
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    model.load_state_dict(base.state_dict())
    engine = executor.run(model, schedule, lr=1e-4)
    instruments = bench.Instruments(engine)

    def step():
        model(**batch).backward()
        engine.step()

    scale = {0: 3.0, 1: 7.0}  # round r's recorded runs: every moment r-dependent, far from the recording
    calls = []

    def retime():
        r = len(calls) // 2
        calls.append(r)
        return [scale[r] * m.compute_seconds + 1e-3 * len(calls) for m in trace.moments]

    probed = []

    def probe():  # round 1's copies 1000x slower: a prediction that ignores the probe misses it
        slow = len(probed) == 1
        links = dataclasses.replace(hardware.links, h2d_gb_per_s=hardware.links.h2d_gb_per_s / (1000 if slow else 1),
                                    d2h_gb_per_s=hardware.links.d2h_gb_per_s / (1000 if slow else 1), copy_rates=())
        probed.append(dataclasses.replace(hardware, links=links))
        return probed[-1]

    step()
    instruments.take()
    rounds = bench.run_rounds(rounds=2, per_round=2, schedule=schedule, trace=trace, engine=engine,
                              instruments=instruments, offload_step=step, retime=retime, probe=probe, log=lambda s: None)
    engine.detach()
    assert len(rounds) == 2 and calls == [0, 0, 1, 1]
    for r, rnd in enumerate(rounds):
        runs = [[scale[r] * m.compute_seconds + 1e-3 * (2 * r + i + 1) for m in trace.moments] for i in range(2)]
        assert [x for run in rnd.recorded_runs for x in run] == pytest.approx([x for run in runs for x in run])
        want = simulate(bench.retimed_schedule(schedule, with_compute_seconds(trace, runs)), probed[r])
        assert rnd.predicted["iteration"] == pytest.approx(want.iteration_seconds)
        assert rnd.hardware is probed[r] and rnd.measured["iteration"] == pytest.approx(sum(rnd.engine_seconds) / 2)
        on_recording = simulate(schedule, hardware).iteration_seconds
        assert rnd.predicted["iteration"] > 2 * on_recording
    # round 1's copies at 1/1000 the rate: its prediction holds them, beyond 7/3 of round 0's compute-bound one
    assert rounds[1].predicted["copy H2D"] == pytest.approx(1000 * rounds[0].predicted["copy H2D"], rel=1e-6)
    assert rounds[1].predicted["iteration"] > rounds[0].predicted["iteration"] * 7 / 3
    assert bench.pooled_ratio(rounds) == pytest.approx(
        sum(r.measured["iteration"] for r in rounds) / sum(r.predicted["iteration"] for r in rounds))
    pooled = bench.mean_parts([r.predicted for r in rounds])
    assert pooled["iteration"] == pytest.approx(sum(r.predicted["iteration"] for r in rounds) / 2)
    rows = dict(bench.round_rows(rounds, trace, schedule))
    assert rows["offload: measured / simulated, pooled: sum measured / sum predicted (issue 17 target 0.90-1.10)"] == \
        f"{bench.pooled_ratio(rounds):.3f}"
    opt = next(i for i, m in enumerate(trace.moments) if m.phase is Phase.OPTIMIZER)
    recorded_step = sum(scale[r] * trace.moments[opt].compute_seconds + 1e-3 * (2 * r + 1.5) for r in (0, 1)) / 2
    assert rows["offload: of the rounds' recordings, plain PyTorch's optimizer step s (pooled)"] == f"{recorded_step:.3f}"
