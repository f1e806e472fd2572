"""Issue 18 (depth): the sparse DEVICE rows (`planner.placement.SparsePlacementModel`) are the same LP, and the
LP-integral fixing of `planner.solve._solve_mip` gives a plan of the plain MIP's quality."""

from __future__ import annotations

import pytest

from planner.placement import PlacementModel, SparsePlacementModel
from planner.solve import _fixed, _solve_mip
from test_placement import synthetic


def _device_nonzeros(model: PlacementModel) -> int:
    return sum(1 for e in model.solver.model.linear_constraint_matrix_entries()
               if e.linear_constraint.name.startswith("device_memory"))


@pytest.mark.parametrize("device_mib", [20, 40])
def test_sparse_rows_are_the_same_lp_with_fewer_nonzeros(device_mib):
    data = synthetic(layers=8, chunks=2, device_mib=device_mib)
    dense, sparse = PlacementModel(data, relax=True), SparsePlacementModel(data, relax=True)
    a = dense.solve().objective_seconds
    b = sparse.solve().objective_seconds
    assert b == pytest.approx(a, rel=1e-7)
    assert _device_nonzeros(sparse) < _device_nonzeros(dense)


def test_fixing_to_the_lp_finds_a_plan_no_worse_than_todays_mip_within_its_gap():
    data = synthetic(layers=8, chunks=2, device_mib=20)
    lp = PlacementModel(data, relax=True)
    relaxed = lp.solve()
    values = {v.name: float(lp.values[v]) for v in lp.solver.model.variables()}
    flags = {k: int(v > 1e-6) for k, v in lp.flag_values().items()}
    fixed = _fixed(data, flags, None, values, 30.0)  # the fixing itself, no fallback, no polish
    assert fixed is not None
    today = PlacementModel(data).solve()
    assert fixed.objective_seconds >= relaxed.objective_seconds * (1 - 1e-6)
    assert fixed.objective_seconds <= today.objective_seconds * 1.02


def test_solve_mip_is_no_worse_than_the_fixed_plan_and_within_its_gap_of_the_lp():
    data = synthetic(layers=8, chunks=2, device_mib=20)
    lp = PlacementModel(data, relax=True)
    relaxed = lp.solve()
    values = {v.name: float(lp.values[v]) for v in lp.solver.model.variables()}
    sol = _solve_mip(data, lp.flag_values(), 30.0, None, lp_values=values)
    flags = {k: int(v > 1e-6) for k, v in lp.flag_values().items()}
    assert sol.objective_seconds <= _fixed(data, flags, None, values, 30.0).objective_seconds * (1 + 1e-9)
    assert sol.objective_seconds >= relaxed.objective_seconds * (1 - 1e-6)
