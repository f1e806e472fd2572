"""`planner.mathopt_solver`'s rows in bulk (Note [rows in bulk]): the model it builds is MathOpt's own,
bit for bit, so a faster build never changes a plan."""

from __future__ import annotations

import dataclasses
import math

import pytest
from ortools.math_opt.python import mathopt

import planner.mathopt_solver as ms
from planner.mathopt_solver import MathOptSolver, evaluate_linear, flat_linear
from planner.placement import PlacementModel, SparsePlacementModel
from schemas.schedule import ActivationMode, Tier
from tests.test_placement import synthetic


def _mathopt_add(self, bounded, name=""):
    """MathOpt's own row path (what Add did before the bulk rows)."""
    self._rows += 1
    self._flush()
    return self._model.add_linear_constraint(bounded, name=name)


def _exported(build) -> bytes:
    return build().solver.model.export_model().SerializeToString(deterministic=True)


@pytest.mark.parametrize("variant", ["mip", "lp_sparse", "ranks", "feasibility", "capacity"])
def test_bulk_rows_build_mathopts_model_bit_for_bit(monkeypatch, variant):
    data = dataclasses.replace(synthetic(layers=4, device_mib=12), checkpoint_offload=True, stream_optimizer=True)
    if variant == "ranks":
        data = dataclasses.replace(data, ranks=4, ranks_per_node=2, collective_intra_bytes_per_s=5e9,
                                   collective_inter_bytes_per_s=1e9, dram_bytes_per_s=2e10, adam_dram_bytes_per_element=16)
    build = {
        "mip": lambda: PlacementModel(data, fixed_flags={"any_stream": 1}),
        "lp_sparse": lambda: SparsePlacementModel(data, relax=True, lp_solver="HIGHS_IPM"),
        "ranks": lambda: PlacementModel(data),
        "feasibility": lambda: PlacementModel(data, relax=True, feasibility=True),
        "capacity": lambda: PlacementModel(data, capacity_variable=Tier.HOST),
    }[variant]
    bulk = _exported(build)
    monkeypatch.setattr(MathOptSolver, "Add", _mathopt_add)
    monkeypatch.setattr(MathOptSolver, "Minimize", lambda self, expr: self.model.minimize(expr))
    assert _exported(build) == bulk  # names, bounds, every coefficient: the same bytes


def test_flat_linear_adds_the_same_floats_in_the_same_order():
    m = mathopt.Model()
    x, y, z = (m.add_variable(name=n) for n in "xyz")
    # repeated variables, nested products and sums, constants: an order-sensitive sum of floats
    expr = (0.1 * x + 0.2 * (x - 0.3 * y) + sum([z * 1e-17, x * 0.7, 1.0]) - (y + 0.1) * 3.3
            + mathopt.LinearExpression(2.0 * z + 0.3) * 0.1 + 1e16 * x - 1e16 * x)
    flat = mathopt.LinearExpression(expr)
    terms, offset = flat_linear(expr)
    assert terms == dict(flat.terms) and list(terms) == list(flat.terms) and offset == flat.offset
    values = {x: 1.1, y: -2.2, z: 3.3}
    by_id = {v.id: x for v, x in values.items()}
    assert evaluate_linear(expr, by_id) == mathopt.evaluate_expression(expr, values)
    assert evaluate_linear(5, by_id) == 5.0
    assert flat_linear(x) == ({x: 1.0}, 0.0)


def test_rows_mathopt_refuses_are_refused_and_odd_rows_keep_their_order():
    solver = MathOptSolver("HIGHS")
    x, y = solver.NumVar(0, 1, "x"), solver.NumVar(0, 1, "y")
    solver.Add(x + y <= 1, "first")
    solver.Add(x == y, "var_eq_var")  # MathOpt's own path, after the pending row
    solver.Add(x >= 0.5, "third")
    assert [c.name for c in solver.model.linear_constraints()] == ["first", "var_eq_var", "third"]
    with pytest.raises(TypeError):
        solver.Add(True, "bool")
    with pytest.raises(ValueError):
        solver.Add(x + math.inf <= 1, "infinite offset")
    assert ms.flat_linear(2 * x + 1)[1] == 1.0


@pytest.mark.parametrize("nvme", [True, False])
@pytest.mark.parametrize("solved", [True, False])  # unsolved: a likely size's LP a worker solves (planner.solve)
def test_a_relaxation_becomes_the_pinned_mip_bit_for_bit(nvme, solved):
    data = dataclasses.replace(synthetic(layers=4, device_mib=24, nvme=nvme), checkpoint_offload=True)
    lp = SparsePlacementModel(data, relax=True, lp_solver="HIGHS_IPM")
    if solved:
        lp.solve()
    flags = {name: 1 for name in sorted(lp.flags)[:1]}
    modes = (ActivationMode.RECOMPUTE, ActivationMode.KEEP, ActivationMode.SWAP_HOST, ActivationMode.KEEP)
    built = SparsePlacementModel(data, fixed_flags=flags, fixed_modes=modes)
    turned = lp.as_mip(fixed_flags=flags, fixed_modes=modes)
    assert turned.solver.name == "HIGHS" and not turned.relax
    assert (turned.solver.model.export_model().SerializeToString(deterministic=True)
            == built.solver.model.export_model().SerializeToString(deterministic=True))
    assert turned.solve().objective_seconds == built.solve().objective_seconds
    # a relaxation pinned as asked (planner.solve's replan) too; pinned otherwise, it refuses
    pinned = SparsePlacementModel(data, relax=True, fixed_flags=flags, fixed_modes=modes, lp_solver="HIGHS_IPM")
    pinned.solve()
    assert (pinned.as_mip(fixed_flags=flags, fixed_modes=modes).solver.model.export_model().SerializeToString(deterministic=True)
            == built.solver.model.export_model().SerializeToString(deterministic=True))
    with pytest.raises(AssertionError):
        SparsePlacementModel(data, relax=True, fixed_flags=flags).as_mip(fixed_flags={})


@pytest.mark.parametrize("nvme", [True, False])
def test_a_mip_pinned_anew_is_the_mip_built_with_those_pins_bit_for_bit(nvme):
    """`PlacementModel.repin`: the MIP of one pin set, its counts fixed since (planner.solve's LP-integral fixing),
    pinned to other switches and no modes is the model a fresh build with those pins makes."""
    data = dataclasses.replace(synthetic(layers=4, device_mib=24, nvme=nvme), checkpoint_offload=True)
    lp = SparsePlacementModel(data, relax=True, lp_solver="HIGHS_IPM")
    lp.solve()
    names = sorted(lp.flags)
    modes = (ActivationMode.RECOMPUTE, ActivationMode.KEEP, ActivationMode.SWAP_HOST, ActivationMode.KEEP)
    mip = lp.as_mip(fixed_flags={name: 1 for name in names}, fixed_modes=modes)
    for v in mip.integral[:20]:  # fixed as a failed pin set leaves them
        v.lower_bound = v.upper_bound = max(v.lower_bound, min(v.upper_bound, 1.0))
    flags = {name: int(k % 2 == 0) for k, name in enumerate(names)}
    again = mip.repin(fixed_flags=flags)
    built = SparsePlacementModel(data, fixed_flags=flags)
    assert again.fixed_flags == flags and again.fixed_modes is None
    assert (again.solver.model.export_model().SerializeToString(deterministic=True)
            == built.solver.model.export_model().SerializeToString(deterministic=True))


@pytest.mark.parametrize("nvme", [True, False])
def test_an_lp_solved_for_its_bound_without_crossover_bounds_as_the_vertex_does(nvme):
    # HIGHS_IPM_BOUND stops IPX at its optimal primal-dual pair (no crossover, no vertex): the same optimum
    # within IPX's tolerance, never above what the vertex LP proves by more than that
    data = dataclasses.replace(synthetic(layers=4, device_mib=24, nvme=nvme), checkpoint_offload=True)
    vertex = SparsePlacementModel(data, relax=True, lp_solver="HIGHS_IPM").solve()
    solved = SparsePlacementModel(data, relax=True, lp_solver="HIGHS_IPM_BOUND").solve()
    assert solved.bound_seconds > 0.0
    assert solved.bound_seconds == pytest.approx(vertex.bound_seconds, rel=1e-7)
    assert solved.bound_seconds <= vertex.bound_seconds * (1 + 1e-7)
