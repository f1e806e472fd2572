"""`planner.exact` prices the SSDs with the placement MIP's two-way rows (costmodel.nvme_time_rows:
simplex, the mixed rates, the host-side cap), so the exact optimum and the MIP's agree on SSD-bound plans."""

from __future__ import annotations

import dataclasses

import pytest

from planner.costmodel import two_way_rows
from planner.exact import ExactModel, split_chunk_classes
from planner.placement import PlacementModel
from test_placement import synthetic

MIB = 2**20


def _ssd_bound(rows):
    """Four blocks whose activations only fit by swapping one to the SSDs (HOST too small, recompute 1 s)."""
    d = synthetic(layers=4, chunks=1, device_mib=24, act_mib=4)
    return dataclasses.replace(d, host_bytes=8 * MIB, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
                               nvme_time_rows=rows,
                               blocks=tuple(dataclasses.replace(b, recompute_seconds=1.0) for b in d.blocks))


@pytest.mark.parametrize("name, rows", [
    ("simplex", two_way_rows(1e9, 1e9, 0.0, 0.0)),
    ("host cap 0.2 GB/s", two_way_rows(1e9, 1e9, 0.0, 0.0, 0.2e9)),
])
def test_exact_and_mip_price_the_ssds_alike(name: str, rows) -> None:
    data = _ssd_bound(rows)
    exact = ExactModel(split_chunk_classes(data)).solve()
    mip = PlacementModel(data).solve()
    assert "SWAP_NVME" in {m.value for m in exact.activation_modes}
    assert exact.objective_seconds == pytest.approx(mip.objective_seconds, rel=0.02), name


def test_a_host_cap_slows_the_exact_plan() -> None:
    """The rates alone are 1 GB/s each way; the cap holds both to 0.2 GB/s: the one-way rows of
    before (R / read + W / write at the rates alone) missed it."""
    free = ExactModel(split_chunk_classes(_ssd_bound(two_way_rows(1e9, 1e9, 0.0, 0.0)))).solve()
    capped = ExactModel(split_chunk_classes(_ssd_bound(two_way_rows(1e9, 1e9, 0.0, 0.0, 0.2e9)))).solve()
    assert capped.objective_seconds > 2 * free.objective_seconds
    # reads and writes measured at once: never slower than simplex
    mixed = ExactModel(split_chunk_classes(_ssd_bound(two_way_rows(1e9, 1e9, 0.9e9, 0.9e9)))).solve()
    assert mixed.objective_seconds <= free.objective_seconds
