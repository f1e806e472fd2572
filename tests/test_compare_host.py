"""compare's peak columns count HOST as the capacity check does: a system's chunks and activations
plus its own buffers (the 12B compare showed 199-202 GB for tide/gemini next to zero3-offload's
refusal naming 179 GB: that 179 GB is 204 GB usable less zero3's 24.6 GB fp32 grad partition, which
the column never showed for a system that reserves buffers)."""

from __future__ import annotations

import pytest

from planner.compare import compare
from planner.errors import InfeasibleError
from planner.policies import baseline
from schemas.schedule import Tier
from test_baselines import DIGEST, box, problem, small_trace


def test_the_host_column_counts_the_systems_own_buffers() -> None:
    hw = box(host_gb=64.0)
    c = compare(small_trace(), hw, trace_digest=DIGEST, policies=["zero3-offload", "patrickstar"])
    z3, ps = c.row("zero3-offload"), c.row("patrickstar")
    held = c.usable_bytes_per_tier[Tier.HOST] - z3.schedule.budgets.host_bytes
    assert held > 0  # the fp32 grad partition (Z2.4/Z3.10)
    assert z3.peak_bytes(Tier.HOST) == z3.result.peak_bytes_per_tier[Tier.HOST] + held
    assert z3.to_json()["peak_host_gb"] == pytest.approx(z3.peak_bytes(Tier.HOST) / 1e9)
    assert z3.peak_bytes(Tier.HOST) <= c.usable_bytes_per_tier[Tier.HOST]
    # a system without buffers: the simulated peak alone
    assert ps.peak_bytes(Tier.HOST) == ps.result.peak_bytes_per_tier[Tier.HOST]


def test_the_refusal_names_the_usable_capacity_and_the_buffers() -> None:
    """Where the buffers make it run out, the line says both numbers: usable, and what the buffers leave."""
    p = problem(box(host_gb=2.0))
    with pytest.raises(InfeasibleError) as info:
        baseline("zero3-offload", p)
    text = str(info.value)
    assert f"{p.host_bytes} usable less" in text and "system's own buffers" in text
