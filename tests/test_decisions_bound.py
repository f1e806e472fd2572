"""planner.bounds.decisions_bound (Note [the bound of a set of decisions]): no replay of a set of decisions is
faster, and solve leaves a reference decision set unreplayed only where that bound is above its fastest replay,
choosing the same plan as when it replays them all."""

from __future__ import annotations

import dataclasses
import re

import pytest

import planner.solve
from planner.bounds import decisions_bound
from planner.errors import PlannerError
from planner.materialize import materialize_replayed
from planner.policies import policy_layout
from planner.policies.angel import decide as angel_decide
from planner.problem import build_problem
from planner.reference import reference_decisions
from planner.sim_result import ScheduleViolation
from planner.solve import solve_report
from schemas.hardware import AdamRate
from schemas.schedule import Channel, Tier
from test_baselines import DIGEST, box, ranks_box, small_trace

def _slowed(hw, *, kept: float = 0.5):
    """`hw` whose CPU Adam keeps `kept` of its speed while copies run (Note [CPU Adam beside copies])."""
    rate = AdamRate(threads=hw.host.cores, params_per_s=1e8, params_per_s_with_copies=1e8 * kept)
    return dataclasses.replace(hw, host=dataclasses.replace(hw.host, adam_chunk_params=1 << 22, adam_rates=(rate,)))


HARDWARE = {
    "roomy": lambda: box(),
    "OS on NVME": lambda: box(device_gb=0.5, host_gb=1.0),  # 1.7 GB of model data: HOST holds no OS
    "OS on NVME, CPU Adam slowed beside copies": lambda: _slowed(box(device_gb=0.5, host_gb=1.0)),
    "4 ranks": lambda: ranks_box(device_gb=0.5),
}


@pytest.mark.parametrize("name", list(HARDWARE))
def test_no_replay_beats_the_bound_of_its_decisions(name):
    problem = build_problem(small_trace(), HARDWARE[name](), trace_digest=DIGEST)
    sets = list(reference_decisions(problem, policy_layout(problem))) + [(f"angel {i}", d)
                                                                          for i, d in enumerate(angel_decide(problem))]
    replayed, resources = 0, set()
    for what, decisions in sets:
        for paced in (False, True):
            d = dataclasses.replace(decisions, pace_optimizer_io=paced)
            bound = decisions_bound(problem, d)
            try:
                _, replay = materialize_replayed(problem, d)
            except (PlannerError, ScheduleViolation):
                continue
            assert bound.seconds <= replay.iteration_seconds * (1 + 1e-9), (what, paced, bound, replay.iteration_seconds)
            # the compute share is work the replay's COMPUTE server does (every rank's: busy seconds summed)
            assert bound.seconds_per_resource["COMPUTE"] <= replay.busy_seconds_per_channel[Channel.COMPUTE] * (1 + 1e-9)
            replayed += 1
            resources |= {k for k, v in bound.seconds_per_resource.items() if v > 0}
    assert replayed >= 4
    assert {"COMPUTE", "CPU_OPTIMIZER"} <= resources
    if name.startswith("OS on NVME"):  # a set with its OS on the SSDs is bounded by them too
        assert any(p.os_tier is Tier.NVME for _, d in sets for p in d.chunk_plans)
        assert "NVME" in resources


def test_solve_skips_only_what_cannot_win(monkeypatch):
    hw = box(device_gb=0.5, host_gb=1.0)
    pruned = solve_report(small_trace(), hw, trace_digest=DIGEST)
    notes = [n for n in pruned.schedule.header.notes if n.startswith("not replayed")]
    assert len(notes) == 1
    bounds = [float(x) for x in re.findall(r"at least ([0-9.e+-]+) s", notes[0])]
    assert bounds and min(bounds) > pruned.simulated_seconds
    # every reference set replayed: the same choice, the same schedule but for the notes
    monkeypatch.setattr(planner.solve, "decisions_bound", lambda problem, d: dataclasses.replace(
        decisions_bound(problem, d), seconds=0.0))
    every = solve_report(small_trace(), hw, trace_digest=DIGEST)
    assert not any(n.startswith("not replayed") for n in every.schedule.header.notes)
    assert len(every.evaluated) > len(pruned.evaluated)
    assert every.chosen == pruned.chosen and every.simulated_seconds == pruned.simulated_seconds
    assert every.schedule.actions == pruned.schedule.actions
    unreplayed = {w for w, _ in every.evaluated} - {w for w, _ in pruned.evaluated}

    def named(what: str) -> bool:  # a placement plan left unreplayed is named once for all its variants
        plan = re.match(r"placement MIP, chunk size \d+", what)
        return what in notes[0] or (plan is not None and f"{plan.group(0)} (every variant)" in notes[0])

    assert all(named(w) for w in unreplayed), (unreplayed, notes[0])
    assert all(s > pruned.simulated_seconds for w, s in every.evaluated if w in unreplayed)
