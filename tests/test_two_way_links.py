"""The simulator's two-way links (PCIe both ways, SSDs reading and writing at once) as shared resources:
Note [two-way links in the simulator] in planner/sim_actions.py, issue 17 item 4."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from planner.costmodel import nvme_time_rows, pcie_time_rows
from planner.presets import resolve_hardware
from planner.sim_actions import _transfer
from planner.sim_state import setup
from schemas.schedule import Channel

PCIE = (Channel.H2D, Channel.D2H)
NVME = (Channel.NVME_READ, Channel.NVME_WRITE)


@functools.cache
def _schedule():
    from planner.families import gpt_trace
    from planner.policies import baseline
    from planner.problem import build_problem

    trace = gpt_trace(layers=2, hidden=256, heads=4, seq=128, batch=4, vocab=4096, dtype="float32")
    return baseline("angel", build_problem(trace, resolve_hardware("a100-80g-12ssd"), trace_digest="t"))


def _hardware(**links):
    """a100-80g-12ssd (both-ways PCIe rates measured: 12.5 / 24 GB/s) without host DRAM contention, so
    that only the links price the copies; SSD mixed rates that pay (12 x 4.5 GB/s both ways against
    78 / 40.8 GB/s alone: 54/78 + 54/40.8 > 1), so the SSDs' calendars are not the simplex row."""
    hw = resolve_hardware("a100-80g-12ssd")
    return dataclasses.replace(hw, links=dataclasses.replace(hw.links, **links),
                               host=dataclasses.replace(hw.host, dram_gb_per_s=0.0),
                               nvme=dataclasses.replace(hw.nvme, mixed_read_gb_per_s_each=4.5, mixed_write_gb_per_s_each=4.5))


@pytest.mark.parametrize("first", PCIE)
def test_one_gigabyte_each_way_ends_when_the_links_region_says(first):
    """1 GB each way at 25.5 / 26 GB/s alone, 12.5 / 24 GB/s both ways: the second copy ends at the
    rows' least time, 60.46 ms, where processor sharing (both at the both-ways rates, then H2D alone)
    ends too (D2H at 41.67 ms, H2D at 60.46 ms); the copy placed first ends at its time alone. Before,
    each copy fixed its rate at its start: the one started alone kept it, the other ran at its both-ways
    rate and the pair ended at max(39.2, 1/24 GB/s = 41.7 ms) for H2D first, under the link's 60.46 ms."""
    hw = _hardware(h2d_gb_per_s=25.5, d2h_gb_per_s=26.0)
    sim = setup(_schedule(), hw)
    second = Channel.D2H if first is Channel.H2D else Channel.H2D
    alone = {Channel.H2D: 1 / 25.5, Channel.D2H: 1 / 26.0}  # seconds for 1 GB
    e1 = _transfer(sim, (first,), 10**9, 0.0, 0.0, "a", m=0, i=0, action=None)
    e2 = _transfer(sim, (second,), 10**9, 0.0, 0.0, "b", m=0, i=1, action=None)
    least = max(a + b for a, b in pcie_time_rows(hw)) * 1e9  # the rows' least time for 1 GB each way
    d2h_ps = 1 / 24.0
    h2d_ps = d2h_ps + (1 - 12.5 * d2h_ps) / 25.5  # processor sharing's makespan
    assert least == pytest.approx(h2d_ps, rel=1e-12)
    assert e1 == pytest.approx(alone[first], rel=1e-12)
    assert e2 == pytest.approx(least, rel=1e-12)


@pytest.mark.parametrize("link", ["pcie", "nvme"])
@pytest.mark.parametrize("seed", range(6))
def test_copies_both_ways_never_beat_the_two_way_rows(link, seed):
    """Copies of random sizes both ways, issued at random times: from the first start to the last end
    the link took at least max_k a_k R + b_k W (costmodel.two_way_rows at the copies' size, the rows the
    placement model charges). Fails where a copy keeps the rate it started with."""
    hw = _hardware()
    sim = setup(_schedule(), hw)
    rng = random.Random(seed)
    pair = PCIE if link == "pcie" else NVME
    size = 1 << 22  # one copy size: the preset's flat rates
    end = 0.0
    for k in range(200):
        ch = pair[rng.random() < 0.5]
        issue = rng.uniform(0.0, 2e-3) if k % 7 == 0 else 0.0
        done = _transfer(sim, (ch,), size * rng.randint(1, 8), issue, 0.0, "c", m=0, i=k, action=None)
        end = max(end, done)
    moved = {ch: sim.bytes_per_channel.get(ch, 0) for ch in pair}
    rows = pcie_time_rows(hw, nbytes=size) if link == "pcie" else nvme_time_rows(hw, nbytes=size)
    assert any(a > 0 and b > 0 for a, b in rows)
    for a, b in rows:
        assert end >= (a * moved[pair[0]] + b * moved[pair[1]]) * (1 - 1e-9), (a, b)
