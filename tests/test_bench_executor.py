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
    rows = dict(bench.mispriced_rows(stats, sim, schedule, fwd + bwd, instruments={"copy H2D": h2d_busy, "actions": actions},
                                     plain=fwd + bwd - actions, recorded=3.0))
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
