"""`planner.solve`: determinism, gap, the exact optimum, infeasibility explanations, the CLI."""

from __future__ import annotations

import dataclasses
import functools
import gc
import re

import pytest

from planner.cli import main
from planner.errors import InfeasibleError, PlannerError
from planner.families import gpt_trace
from planner.layout import build_layout
from planner.placement import PlacementModel
from planner.placement_input import placement_input
from planner.presets import resolve_hardware
from planner.problem import build_problem
from planner.solve import TIE_TOLERANCE, solve, solve_report
from planner.solve_cli import default_output_path
from schemas import Schedule, Trace
from schemas._base import digest_bytes
from schemas.schedule import Channel, Tier

from conftest import TRACES

HW = "rtx4090-768g-12ssd"  # transfers matter next to its compute: the placement has real choices


def _trace(layers: int, **kw):
    return _trace_cached(layers, tuple(sorted(kw.items())))


@functools.cache
def _trace_cached(layers: int, kw: tuple):
    # the written-out variant (scores and full logits kept): the instances these targets were set on. With
    # the fused default (issue 17 item 3) the 2-layer instance stops FEASIBLE at a 5.0% gap: a finding
    # for the planner's bound (issue 17 item 4), not hidden by loosening the 2% here
    args = dict(layers=layers, hidden=256, heads=4, seq=128, batch=4, vocab=4096, dtype="float32", attention="math", loss="full")
    args.update(kw)
    return gpt_trace(**args)


@functools.cache
def _report(layers: int, device_factor: float | None, **kw):
    """solve_report of `_trace(layers)` with DEVICE = `device_factor` x its param bytes (None: the
    preset's), computed once per worker: several tests check different things of the same solve (the
    solver is deterministic: test_same_inputs_give_identical_bytes). Reports are frozen; tests only read."""
    trace = _trace(layers)
    device = None if device_factor is None else int(_param_bytes(trace) * device_factor)
    return solve_report(trace, resolve_hardware(HW), trace_digest=_digest(trace), device_bytes=device, **kw)


def _digest(trace) -> str:
    return digest_bytes(trace.to_msgpack())


def _param_bytes(trace) -> int:
    return sum(t.bytes for t in trace.tensors)


@pytest.fixture(scope="module")
def hw():
    return resolve_hardware(HW)


def test_same_inputs_give_identical_bytes(hw):
    trace = _trace(3)
    device = _param_bytes(trace) * 5
    a = solve(trace, hw, trace_digest=_digest(trace), device_bytes=device)
    b = solve(trace, hw, trace_digest=_digest(trace), device_bytes=device)
    assert a.to_msgpack() == b.to_msgpack()


@pytest.mark.parametrize("layers, device_factor", [(2, None), (3, 5.0), (6, 4.0)])
def test_header_gap_is_the_true_gap_next_to_the_mip_gap(hw, layers, device_factor):
    report = _report(layers, device_factor)
    h = report.schedule.header
    assert h.objective_seconds == report.simulated_seconds  # the header's time is the simulator's
    assert 0 < h.lower_bound_seconds <= h.objective_seconds
    assert h.gap == pytest.approx((report.simulated_seconds - h.lower_bound_seconds) / report.simulated_seconds)
    # the MIP's own gap: its model objective over its chunk size's valid model bound (LP or root). 12%:
    # 6 layers went from 9.8% to 11.7% when the SSDs' mixed-rate rows (issue 17 item 2, the host cap
    # makes mixing pay) lowered the LP (0.928 -> 0.908 ms) and the pinned MIP stayed at 1.028 ms; its
    # replay went from 1.304 to 0.963 ms (true gap 28.8% -> 5.7%) with the DRAM calendar
    assert -1e-9 <= report.mip_gap <= 0.12


@pytest.mark.parametrize("layers, device_factor", [(2, None), (3, 5.0), (6, 4.0)])
def test_bound_holds_for_every_replay_of_a_solve(hw, layers, device_factor):
    """Issue 17 item 4: the header's bound is no more than any plan the solve replayed (tide's
    placements and every reference decision set) nor than the baselines' own schedules."""
    from planner.problem import build_problem

    trace = _trace(layers)
    device = None if device_factor is None else int(_param_bytes(trace) * device_factor)
    report = _report(layers, device_factor)
    bound = report.schedule.header.lower_bound_seconds
    assert len(report.evaluated) > 3
    assert_bound_holds(bound, report.evaluated, build_problem(trace, hw, trace_digest=_digest(trace), device_bytes=device))


def test_show_header_time_is_the_simulated_time(tmp_path, capsys):
    """One prediction: `planner show`'s header time (objective and prediction) == `planner simulate`."""
    import json

    schedule = _report(3, 5.0).schedule
    path = tmp_path / "s.schedule.msgpack"
    schedule.write(path)
    assert main(["show", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(path), "--hardware", HW, "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert shown["header"]["objective_seconds"] == simulated["iteration_seconds"]
    assert shown["prediction"]["iteration_seconds"] == simulated["iteration_seconds"]


@pytest.mark.parametrize("layers, device_factor", [(2, 5.0), (3, 5.0), (4, None)])
def test_default_planner_within_two_percent_of_exact(hw, layers, device_factor):
    """The schedule the default planner ships replays within 2% of the exact CP-SAT mode's, and its placement model,
    on the input of the chunk size the exact model found best, is within 2% of that model. (Until session 18 this
    compared the chosen plans' model objectives only, which are of whichever chunk size replays fastest; with the
    refresh uploads priced and a streamed GPU step's kept chunk charged one too, the 3-layer default shipped a plan
    replaying 0.698 ms against the exact mode's 0.630 ms; without that charge, 255c69c, it replays 0.572 ms.)"""
    default = _report(layers, device_factor)
    exact = _report(layers, device_factor, exact=True)
    assert exact.schedule.header.policy == default.schedule.header.policy == "tide"
    assert default.simulated_seconds <= exact.simulated_seconds * 1.02
    trace = _trace(layers)
    device = None if device_factor is None else int(_param_bytes(trace) * device_factor)
    problem = build_problem(trace, hw, trace_digest=_digest(trace), device_bytes=device)
    data = placement_input(problem, build_layout(problem, chunk_elements=exact.chunk_elements))
    ours = PlacementModel(data).solve()
    assert ours.objective_seconds <= exact.model_objective_seconds * 1.02


def test_infeasible_explains_tier_stage_bytes_and_minimal_capacity(hw):
    trace = _trace(2)
    with pytest.raises(InfeasibleError) as info:
        solve(trace, hw, trace_digest=_digest(trace), device_bytes=1_000_000)
    message = str(info.value)
    assert "DEVICE runs out at stage" in message
    assert "bytes short" in message
    found = re.search(r"DEVICE >= [0-9.]+ [KMGT]?B \(([0-9]+) bytes\)", message)
    assert found, message
    assert "0.00 GB" not in message  # sizes in the unit that shows the number (issue 21)
    need = int(found.group(1))
    assert need > 1_000_000
    # the capacity it names is enough
    schedule = solve(trace, hw, trace_digest=_digest(trace), device_bytes=need)
    assert schedule.prediction.peak_bytes_per_tier


def test_less_device_memory_moves_more_and_is_not_faster(hw):
    roomy = _report(4, 8.0).schedule
    tight = _report(4, 4.0).schedule
    assert tight.header.objective_seconds >= roomy.header.objective_seconds * (1 - 1e-9)
    h2d = lambda s: s.prediction.bytes_per_channel.get(Channel.H2D, 0)  # noqa: E731
    assert h2d(tight) > h2d(roomy)


@pytest.mark.xfail(strict=True, reason=(
    "known miss since session 26 (bench/RESULTS.md): with the polish's lean search (Note [a polish's work in nodes]) "
    "the serial solve polishes to a plan that replays 501 us, against the overlapped solve's 572 us. Cause, measured: "
    "the model prices a CPU step at its chunk's capacity (131072 elements) where the executor and the simulator step "
    "the elements its tensors use (one chunk holds 512), so the serial model prices 27% above its replay and the "
    "overlapped solve steers away from the plan. Pricing steps by used elements makes this pass (overlapped 509 us, "
    "serial 521 us) but moved GPT-3 175B x rtx4090-768g-12ssd from 118.47 to 125.29 s (tried, not kept)"))
def test_no_optimizer_overlap_is_not_faster(hw):
    overlap = _report(3, 5.0).schedule
    serial = _report(3, 5.0, optimizer_overlap=False).schedule
    assert serial.header.objective_seconds >= overlap.header.objective_seconds * (1 - 1e-9)
    assert any("optimizer" in n or "MIP" in n for n in serial.header.notes)


def test_world_size_mismatch_is_named(hw):
    trace = _trace(2, world_size=2)
    with pytest.raises(PlannerError, match="world_size"):
        solve(trace, hw, trace_digest=_digest(trace))


def test_cli_end_to_end(tmp_path, capsys):
    trace = _trace(3)
    path = tmp_path / "gpt3.msgpack"
    trace.write(path)
    assert main(["solve", str(path), "--hardware", HW]) == 0
    out = capsys.readouterr().out
    written = default_output_path(path, HW)
    assert written.name == f"gpt3.{HW}.schedule.msgpack"
    schedule = Schedule.read(written)
    assert schedule.header.trace_digest == digest_bytes(path.read_bytes())
    assert "status" in out and "gap" in out and "solved in" in out
    # -o, --device-memory-gb and --json; the file carries no wall clock: same bytes again
    other = tmp_path / "again.msgpack"
    assert main(["solve", str(path), "--hardware", HW, "-o", str(other), "--json"]) == 0
    assert '"gap"' in capsys.readouterr().out
    assert other.read_bytes() == written.read_bytes()


def test_cli_infeasible_exit_code(tmp_path, capsys):
    path = tmp_path / "t.msgpack"
    _trace(2).write(path)
    assert main(["solve", str(path), "--hardware", HW, "--device-memory-gb", "0.001", "-o", str(tmp_path / "s")]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "DEVICE" in err and err.count("\n") == 1


@pytest.mark.skipif(not (TRACES / "gpt-small.msgpack").exists(), reason="traces/gpt-small.msgpack not shipped yet")
def test_cli_solves_the_shipped_small_trace_with_the_default_hardware(tmp_path, capsys):
    out = tmp_path / "small.schedule.msgpack"
    assert main(["solve", str(TRACES / "gpt-small.msgpack"), "-o", str(out)]) == 0
    schedule = Schedule.read(out)
    assert schedule.header.hardware_name == "cpu-emulated"
    assert schedule.header.gap <= 0.02


def test_simulator_replays_the_schedule_within_its_budgets(hw):
    simulate = pytest.importorskip("planner.simulate").simulate
    device = int(_param_bytes(_trace(4)) * 4)
    schedule = _report(4, 4.0).schedule
    result = simulate(schedule, hw)  # raises ScheduleViolation on a broken schedule
    assert result.peak_bytes_per_tier[Tier.DEVICE] <= device
    assert result.peak_bytes_per_tier[Tier.DEVICE] == schedule.prediction.peak_bytes_per_tier[Tier.DEVICE]


def test_exact_refuses_big_layouts(hw, monkeypatch):
    import planner.exact
    from planner.exact import solve_exact
    from planner.layout import build_layout
    from planner.placement import placement_input
    from planner.problem import build_problem

    trace = _trace(2)
    problem = build_problem(trace, hw, trace_digest=_digest(trace))
    layout = build_layout(problem, chunk_elements=1024)
    monkeypatch.setattr(planner.exact, "MAX_EXACT_CHUNKS", len(layout.chunks) - 1)
    with pytest.raises(PlannerError, match="--exact"):
        solve_exact(placement_input(problem, layout))


def test_params_homed_on_nvme_when_host_cannot_hold_them():
    """HOST (0.3 GB) cannot hold a copy of every PARAM next to the optimizer's staging: only a plan
    that homes PARAM on NVME (Fuyou's layout) fits, and the simulator accepts it."""
    from planner.simulate import simulate
    from schemas.schedule import ChunkList
    from test_baselines import box, small_trace

    # the written-out variant, the instance this was set on: on the fused default (issue 17 item 3) HiGHS found
    # no integral plan within the 30 s on a loaded 2-core machine (the written-out one took 33 s there too)
    tr = small_trace(attention="math", loss="full")
    hw = box(device_gb=1.0, host_gb=0.3, ssds=2)
    schedule = solve(tr, hw, trace_digest=_digest(tr), time_limit_s=30)
    on_nvme = [c for c in schedule.initial_residency if c.list is ChunkList.PARAM and c.tiers == (Tier.NVME,)]
    assert on_nvme, "expected PARAM chunks homed on NVME"
    result = simulate(schedule, hw)
    assert result.peak_bytes_per_tier[Tier.HOST] <= hw.host_bytes
    with pytest.raises(InfeasibleError):  # without SSDs there is nowhere else to put them
        solve(tr, box(device_gb=1.0, host_gb=0.3, ssds=0), trace_digest=_digest(tr), time_limit_s=30)


def test_on_demand_fetch_fits_a_block_with_no_room_to_prefetch():
    """A 16384-wide block (6.4 GB of PARAM, as many GRAD) on a 24 GB RTX 4090: no room to bring the
    next block up while one works; fetching at the use fits (Fuyou trains this width there)."""
    from planner.simulate import simulate

    tr = gpt_trace(layers=4, hidden=16384, heads=128, seq=1024, batch=1, positions=1024)
    hw = resolve_hardware("rtx4090-768g-12ssd")
    schedule = solve(tr, hw, trace_digest=_digest(tr), time_limit_s=30)
    result = simulate(schedule, hw)
    assert result.peak_bytes_per_tier[Tier.DEVICE] <= hw.device_bytes


def test_the_simulator_picks_the_plan_and_tide_is_never_slower_than_its_references_or_the_baselines(hw):
    """Every solved placement and every reference decision set (the baselines' decisions through tide's
    engine) is replayed; the fastest replay is the schedule, so tide is no slower than any of them."""
    from planner.policies import POLICIES, baseline
    from planner.problem import build_problem
    from planner.simulate import simulate

    trace = _trace(4)
    device = int(_param_bytes(trace) * 4)
    report = _report(4, 4.0)
    seconds = simulate(report.schedule, hw).iteration_seconds
    assert seconds == pytest.approx(report.simulated_seconds)
    # each reference set replayed, or named unreplayed with a bound above the fastest replay (planner.bounds.
    # decisions_bound; test_decisions_bound.py checks such a bound against replays)
    unreplayed = " ".join(n for n in report.schedule.header.notes if n.startswith("not replayed"))
    assert all(float(b) > seconds for b in re.findall(r"at least ([0-9.e+-]+) s", unreplayed))
    assert {"fuyou-like", "zero-offload-like", "patrickstar-like", "angel-like"} <= {
        w.split(" decisions")[0] for w, _ in report.evaluated} | set(re.findall(r"([a-z-]+-like)[^:]* decisions", unreplayed))
    # and the fastest MIP plan once more with a block's tail prefetches before its write-backs
    assert any(w.endswith("a tail's prefetches first") for w, _ in report.evaluated)
    assert all(seconds <= t * (1 + 1e-9) for _, t in report.evaluated)
    assert report.chosen in {w for w, _ in report.evaluated}
    assert any(report.chosen in n for n in report.schedule.header.notes)
    problem = build_problem(trace, hw, trace_digest=_digest(trace), device_bytes=device)
    for name in POLICIES:
        try:
            other = simulate(baseline(name, problem), hw).iteration_seconds
        except InfeasibleError:
            continue
        assert seconds <= other * (1 + 1e-9), name


def test_a_tie_never_goes_to_a_plan_slower_than_a_reference_decision_set():
    """The 0.1% tie rule prefers the placement, but tide must never be slower than what a baseline
    decides: gpt-small on a 0.05 GB emulated DEVICE once chose its placement (1.60924 s) over the
    pytorch-like decisions (1.60898 s)."""
    raw = (TRACES / "gpt-small.msgpack").read_bytes()
    trace = Trace.from_msgpack(raw)
    report = solve_report(trace, resolve_hardware("cpu-emulated"), trace_digest=digest_bytes(raw), device_bytes=50_000_000)
    references = [seconds for what, seconds in report.evaluated if "decisions" in what]
    placements = [seconds for what, seconds in report.evaluated if what.startswith("placement MIP")]
    assert references and placements  # both kinds were replayed
    # the tie rule itself: within TIE_TOLERANCE of the fastest replay (where it may prefer the layout
    # that wastes less: chunk size 66220's placement replays 0.02% faster than the chosen 32768's)
    # and never slower than the fastest reference decision set
    fastest = min(seconds for _, seconds in report.evaluated)
    assert report.simulated_seconds <= min(references)
    assert report.simulated_seconds <= fastest * (1 + TIE_TOLERANCE)


def test_every_chunk_size_that_fits_gets_its_lp_value():
    """The chunk-size LP (HiGHS's interior point with crossover, planner.solve.LP_SOLVER) reaches its
    optimum on every candidate of gpt-small on a 0.05 GB emulated DEVICE: GLOP's primal simplex
    stopped IMPRECISE on the 66220-element LP, which the search then counted as "does not fit"."""
    raw = (TRACES / "gpt-small.msgpack").read_bytes()
    trace = Trace.from_msgpack(raw)
    report = solve_report(trace, resolve_hardware("cpu-emulated"), trace_digest=digest_bytes(raw), device_bytes=50_000_000)
    assert len(report.candidates) >= 3
    assert all(0 < c.relaxation_seconds < float("inf") for c in report.candidates), report.candidates
    assert report.relaxation_bound_seconds <= report.simulated_seconds


@pytest.mark.parametrize("vertex_first", ["least waste", "most waste"])
def test_only_the_chunk_sizes_whose_mip_is_solved_get_an_lp_vertex(monkeypatch, vertex_first):
    """Note [the LP of an unlikely chunk size, for its value]: gpt-small on a 0.05 GB emulated DEVICE has three
    chunk sizes; the one wasting the most elements is solved without crossover and never MIP'd. Where the sizes
    solved first are the wrong ones (`most waste`), the search solves the others' LPs to a vertex before their
    MIPs, and the schedule is the same bytes."""
    import planner.placement_solution as solution_mod
    import planner.solve as solve_mod

    raw = (TRACES / "gpt-small.msgpack").read_bytes()
    trace = Trace.from_msgpack(raw)

    def plan() -> tuple[bytes, list[tuple[str, bool]]]:
        calls: list[tuple[str, bool]] = []  # (solver, relaxation) of every placement solve, in order
        real = solution_mod.SolutionExtraction.solve

        def solve_recorded(self, **kw):
            calls.append((self.solver_name, self.relax))
            return real(self, **kw)
        with monkeypatch.context() as m:
            m.setattr(solution_mod.SolutionExtraction, "solve", solve_recorded)
            schedule = solve(trace, resolve_hardware("cpu-emulated"), trace_digest=digest_bytes(raw),
                             device_bytes=50_000_000)
        return schedule.to_msgpack(), calls

    default_bytes, default_calls = plan()
    if vertex_first == "most waste":
        real_first = solve_mod._vertex_first
        monkeypatch.setattr(solve_mod, "_vertex_first",
                            lambda layouts, *, ranks: set(layouts) - real_first(layouts, ranks=ranks))
    got, calls = plan()
    first_pass = calls[:3]  # the three sizes' LPs, before any MIP
    mips = sum(not relax for _, relax in calls)
    vertices = sum(name == solve_mod.LP_SOLVER for name, relax in calls if relax)
    assert got == default_bytes and mips == solve_mod.MIN_MIPS
    assert all(relax for _, relax in first_pass)
    if vertex_first == "least waste":  # the two sizes MIP'd had their vertex in the first pass, the third none
        assert [name for name, _ in first_pass].count(solve_mod.BOUND_ONLY) == 1 and vertices == mips
    else:  # the most wasteful size's vertex in the first pass, unused; the two MIP'd sizes' just before their MIPs
        assert [name for name, _ in first_pass].count(solve_mod.BOUND_ONLY) == 2 and vertices == mips + 1
        assert calls != default_calls


def test_a_root_bound_above_a_replay_falls_back_to_the_lp_not_the_physical_limit(hw, monkeypatch):
    """32 blocks x 4096 on a100-80g-12ssd: the root node proved 2.5092 s, a MIP plan replays 2.4987 s,
    and the header fell back to the physical limit (1.875 s, true gap 25%); the LPs (2.4004 s) are below
    every replay and are the model's bound then. Here a root node that proves too much is simulated."""
    import planner.solve as solve_mod

    monkeypatch.setattr(solve_mod, "ROOT_BOUND_GAP", -1.0)  # compute the root bound of every chunk size
    monkeypatch.setattr(solve_mod, "root_bound_seconds", lambda data, **kw: 1e3)
    trace = _trace(6)
    report = solve_mod.solve_report(trace, hw, trace_digest=_digest(trace), device_bytes=int(_param_bytes(trace) * 4.0))
    h = report.schedule.header
    # the LP values (their bounds are these less the tie-breaker's share, SECONDARY_WEIGHT)
    lp = min(c.relaxation_seconds for c in report.candidates)
    assert report.physical_bound_seconds < h.lower_bound_seconds <= lp <= report.simulated_seconds
    assert h.lower_bound_seconds == pytest.approx(lp, rel=1e-3)
    assert any("root node's bound" in note for note in h.notes)
    assert all(h.lower_bound_seconds <= s * (1 + 1e-9) for _, s in report.evaluated)


def assert_bound_holds(bound: float, evaluated, problem) -> None:
    """`bound` is no more than any plan a solve replayed (`evaluated`: (what, seconds) pairs) nor than
    any baseline's schedule of `problem` that fits (at least one must)."""
    from planner.policies import POLICIES, baseline
    from planner.simulate import simulate

    for what, seconds in evaluated:
        assert bound <= seconds * (1 + 1e-9), what
    replayed = 0
    for name in POLICIES:
        try:
            schedule = baseline(name, problem)
        except (InfeasibleError, PlannerError):
            continue
        assert bound <= simulate(schedule, problem.hardware).iteration_seconds * (1 + 1e-9), name
        replayed += 1
    assert replayed >= 1


@functools.cache
def _angel_13b():
    """GPT-3 13B x a100-80g-12ssd: the problem, the Angel-PTM-like schedule's placement input and its replay."""
    from planner.placement_input import placement_input
    from planner.policies import baseline
    from planner.problem import build_problem
    from planner.simulate import simulate

    trace = Trace.from_msgpack((TRACES / "gpt3-13b.msgpack").read_bytes(), source="gpt3-13b.msgpack")
    hw = resolve_hardware("a100-80g-12ssd")
    problem = build_problem(trace, hw, trace_digest=_digest(trace))
    schedule = baseline("angel", problem)
    return problem, placement_input(problem, schedule.layout), simulate(schedule, hw).iteration_seconds


def test_the_lp_on_a_baselines_layout_is_below_its_replay():
    """Issue 17 item 4: GPT-3 13B x a100-80g-12ssd, where the angel baseline overlaps 70 GB of H2D with
    36 GB of D2H: the placement LP on the angel plan's own layout, at the MIP's own rows
    (costmodel.pcie_time_rows), stays below its replay; planner.solve's bound is this LP (where it is
    above a replay of the solve, the LP at CPU Adam's rate alone). Until session 5 it did not (a strict
    xfail: LP 5.988 s over the 5.831 s replay), an artifact of two optimistic simulator rules: a CPU Adam
    step that started with no copy running kept its rate alone under the copies started later, and
    evicted DEVICE bytes were free before the write-backs reading them landed; the replay is ~6.57 s
    without them (sim17, Note [CPU Adam beside copies], Note [simulator evictions])."""
    from planner.placement import PlacementModel

    _, data, replay = _angel_13b()
    lp = PlacementModel(data, relax=True).solve()
    assert lp.bound_seconds <= replay * (1 + 1e-9)


def test_the_lp_charging_cpu_adam_beside_copies_is_below_its_replay_and_above_the_rate_alone():
    """Note [CPU Adam beside copies, in the model], GPT-3 13B (40 blocks) x a100-80g-12ssd: the model prices
    every CPU step at CPU Adam's rate alone (the fastest a replay steps) and charges what the steps lose
    beside copies (the simulator's rule, `cpu_adam_beside_copies` = 1.2e9 / 1.5e9 on the preset). Its LP on
    the angel baseline's layout stays below that baseline's replay, and above the LP at the rate alone
    without the rows (the bound solve fell back to before session 13)."""
    from planner.costmodel import cpu_adam_threads, optimizer_step_price
    from planner.placement import PlacementModel

    problem, data, replay = _angel_13b()
    alone = optimizer_step_price(problem.hardware, Tier.HOST, 1, threads=cpu_adam_threads(problem.hardware, overlapped=True))
    assert data.cpu_adam_seconds_per_element == alone.seconds and data.cpu_adam_beside_copies == pytest.approx(0.8)
    lp = PlacementModel(data, relax=True).solve()
    without = PlacementModel(dataclasses.replace(data, cpu_adam_beside_copies=1.0), relax=True).solve()
    assert without.bound_seconds < lp.bound_seconds <= replay * (1 + 1e-9)


def test_an_lp_with_cpu_adam_alone_is_solved_against_the_least_so_far_and_gives_the_same_least():
    """Note [an LP stopped above a bound] (planner/mathopt_solver.py): of the proven bound's LPs (one per chunk
    size), each after the first is solved by HiGHS's dual simplex against the least so far. Where its bound is
    above that least the solve stops and reports the least itself (not its own value); where it is below, the
    LP is solved through. Either order gives the least of the LPs solved apart. GPT-3 13B x a100-80g-12ssd on
    the angel layout, and the same input with the PCIe link at half its rate (a higher LP)."""
    from planner.solve import _alone_lp, _alone_lps

    problem, fast, _ = _angel_13b()
    slow = dataclasses.replace(fast, h2d_bytes_per_s=fast.h2d_bytes_per_s / 2, d2h_bytes_per_s=fast.d2h_bytes_per_s / 2)
    apart = [_alone_lp(problem, d, 60.0) for d in (fast, slow)]
    assert apart[0] < apart[1]
    # stopped above: the cutoff comes back, not the LP's own (higher) bound
    assert _alone_lp(problem, slow, 60.0, above_seconds=apart[0]) == apart[0]
    # solved through below the cutoff: the LP's own bound
    assert _alone_lp(problem, fast, 60.0, above_seconds=apart[1]) == pytest.approx(apart[0], rel=1e-7)
    assert _alone_lps(problem, (fast, slow), 60.0) == apart[0]
    assert _alone_lps(problem, (slow, fast), 60.0) == pytest.approx(apart[0], rel=1e-7)


def test_an_lp_with_cpu_adam_alone_stopped_short_leaves_no_bound(monkeypatch):
    """Where one of the proven bound's LPs stops short of its optimum (its time limit, HiGHS's numerics), the header
    gets no bound from them (0.0), never the least of the others: the chunk size left out could hold a cheaper plan."""
    import planner.solve as solve_mod
    from planner.placement import PlacementInfeasible

    problem, data, _ = _angel_13b()
    least = solve_mod._alone_lps(problem, (data,), 60.0)
    assert least > 0.0

    solve, calls = solve_mod.SparsePlacementModel.solve, []

    def second_stops(self, **kw):  # the first LP solves; the second stops at its time limit
        calls.append(kw)
        if len(calls) == 2:
            raise PlacementInfeasible("HIGHS_IPM_BOUND: no solution within 60 s (TIME_LIMIT)")
        return solve(self, **kw)

    monkeypatch.setattr(solve_mod.SparsePlacementModel, "solve", second_stops)
    assert solve_mod._alone_lps(problem, (data, data), 60.0) == 0.0
    assert len(calls) == 2 and calls[1]["above_seconds"] == least


def test_the_header_bound_of_13b_on_a100_is_the_lp_and_holds_for_every_replay():
    """GPT-3 13B x a100-80g-12ssd: the LPs (CPU Adam at its rate alone, charged the time lost beside copies:
    Note [CPU Adam beside copies, in the model]) are below every replay of the solve and the Angel-PTM-like
    baseline's, so the header's bound is the least LP (5.851 s since session 13), not the physical limit
    (3.443 s). Until session 5 the LPs were above the angel replay (an artifact of optimistic simulator
    rules: the test above) and the bound fell back to the LPs at CPU Adam's rate alone without the rows
    (5.427 s, a note saying so); that fallback (solve._adam_alone_bound) is not reached here now."""
    problem, _, angel = _angel_13b()
    report = solve_report(problem.trace, problem.hardware, trace_digest=problem.trace_digest)
    h = report.schedule.header
    assert not any("CPU Adam at its rate alone" in note for note in h.notes), h.notes
    assert report.physical_bound_seconds < h.lower_bound_seconds
    assert h.lower_bound_seconds == pytest.approx(report.relaxation_bound_seconds, rel=1e-12)
    assert all(h.lower_bound_seconds <= s * (1 + 1e-9) for _, s in report.evaluated)
    assert h.lower_bound_seconds <= angel * (1 + 1e-9)


def _record_polishes(monkeypatch, solve_mod) -> list:
    """`solve_mod.PlacementModel` replaced by a polish MIP that records its fixed modes (the list
    returned) and solves to a 1.0 s objective."""
    import types

    built: list = []

    class Polish:
        def __init__(self, data, *, fixed_flags, fixed_modes):
            built.append(fixed_modes)

        def solve(self, **kw):
            return types.SimpleNamespace(objective_seconds=1.0)

    monkeypatch.setattr(solve_mod, "PlacementModel", Polish)
    return built


@pytest.mark.parametrize("modes_pin_holds", [True, False])
def test_no_free_mode_polish_where_the_modes_pin_failed_on_a_deep_trace(monkeypatch, modes_pin_holds):
    """At PIN_MODES_BLOCKS blocks or more with one rank, a fixed plan from a pin set whose modes are free
    (the modes' pin left none) is not polished by the free-mode dense MIP (175B x a100-80g-12ssd: 10.4 s
    of CPU for a plan replaying slower); where the modes' pin holds, the polish runs as before."""
    import types

    import planner.solve as solve_mod

    modes = ("pinned-modes",)
    tries = [({"any_stream": 1}, modes), ({"any_stream": 1}, None)]
    monkeypatch.setattr(solve_mod, "_pin_tries", lambda data, flags, lp_modes: tries)
    fixed = types.SimpleNamespace(objective_seconds=2.0)
    monkeypatch.setattr(solve_mod, "_fixed", lambda data, flags, m, values, budget, lp_model=None:
                        fixed if (m is not None) == modes_pin_holds else None)
    built = _record_polishes(monkeypatch, solve_mod)
    data = types.SimpleNamespace(blocks=[None] * solve_mod.PIN_MODES_BLOCKS, ranks=1)
    sol = solve_mod._solve_mip(data, {"any_stream": 1.0}, 1.0, modes)
    if modes_pin_holds:
        assert built == [modes] and sol.objective_seconds == 1.0
    else:
        assert built == [] and sol is fixed


@pytest.mark.parametrize("blocks", [31, 40])
def test_no_free_mode_polish_from_32_blocks_below_the_modes_pin(monkeypatch, blocks):
    """Below PIN_MODES_BLOCKS the modes are never pinned (GPT-3 13B, 40 blocks: the LP's argmax modes
    cost 8% of model objective); the free-mode dense polish runs only below FREE_MODE_POLISH_MAX_BLOCKS
    (13B x a100-80g-12ssd: 11-13 s CPU for the fixed plan's objective), with one rank."""
    import types

    import planner.solve as solve_mod

    assert solve_mod.FREE_MODE_POLISH_MAX_BLOCKS <= 40 < solve_mod.PIN_MODES_BLOCKS
    data = types.SimpleNamespace(blocks=[None] * blocks, ranks=1)
    assert all(m is None for _, m in solve_mod._pin_tries(data, {"any_stream": 1.0}, ("lp-modes",)))
    fixed = types.SimpleNamespace(objective_seconds=2.0)
    monkeypatch.setattr(solve_mod, "_fixed", lambda data, flags, m, values, budget, lp_model=None: fixed)
    built = _record_polishes(monkeypatch, solve_mod)
    sol = solve_mod._solve_mip(data, {"any_stream": 1.0}, 1.0, ("lp-modes",))
    if blocks < solve_mod.FREE_MODE_POLISH_MAX_BLOCKS:
        assert built == [None] and sol.objective_seconds == 1.0
    else:
        assert built == [] and sol is fixed


@pytest.mark.parametrize("lp_bound", [1.97, 1.99])
def test_no_polish_where_the_fixed_plan_is_within_the_mip_gap_of_the_lp(monkeypatch, lp_bound):
    """Note [no polish within the gap]: every plan of the pinned MIP costs at least the unpinned LP's bound,
    so a fixed plan within MIP_RELATIVE_GAP (1%) of it is not polished (GPT-3 175B x rtx4090-768g-12ssd:
    2.3 of ~10 CPU s for 0.09% in the simulator); 1.5% above it, the polish runs as before."""
    import types

    import planner.solve as solve_mod

    assert solve_mod.MIP_RELATIVE_GAP == 0.01
    data = types.SimpleNamespace(blocks=[None] * 4, ranks=1)
    fixed = types.SimpleNamespace(objective_seconds=2.0)
    monkeypatch.setattr(solve_mod, "_fixed", lambda data, flags, m, values, budget, lp_model=None: fixed)
    built = _record_polishes(monkeypatch, solve_mod)
    sol = solve_mod._solve_mip(data, {"any_stream": 1.0}, 1.0, None, lp_bound_seconds=lp_bound)
    if lp_bound >= 2.0 * (1 - solve_mod.MIP_RELATIVE_GAP):
        assert built == [] and sol is fixed
    else:
        assert built == [None] and sol.objective_seconds == 1.0


@pytest.mark.parametrize(("ranks", "leader"), [(1, 1.9), (1, 2.0), (1, float("inf")), (2, 1.9)])
def test_one_rank_polishes_only_the_chunk_size_that_leads_the_model(monkeypatch, ranks, leader):
    """Note [the polish refines the leader]: with one rank a fixed plan (2.0 s) that trails the best model
    objective of the chunk sizes solved before it (1.9 s) keeps its fixed plan (64 blocks x 4096: 24 of 37 CPU s
    polished a size 5% behind, still behind after); a tie or a lead is polished as before, and so is every
    plan with several ranks (their switch releases)."""
    import types

    import planner.solve as solve_mod

    data = types.SimpleNamespace(blocks=[None] * 4, ranks=ranks)
    fixed = types.SimpleNamespace(objective_seconds=2.0)
    monkeypatch.setattr(solve_mod, "_fixed", lambda data, flags, m, values, budget, lp_model=None: fixed)
    built = _record_polishes(monkeypatch, solve_mod)
    sol = solve_mod._solve_mip(data, {"any_stream": 1.0}, 1.0, None, lp_bound_seconds=1.0, leader_seconds=leader)
    if ranks == 1 and leader < 2.0:
        assert built == [] and sol is fixed
    else:
        assert built and sol.objective_seconds == 1.0


def test_a_placement_plan_whose_work_ends_after_the_fastest_replay_is_not_replayed(monkeypatch):
    """A chunk size's placement plan is replayed unless the work it fixes cannot end within TIE_TOLERANCE of the
    fastest replay so far (planner.bounds.decisions_bound, as for the reference sets): with every bound at 1e9 s
    the first chunk size is replayed (nothing before it) and the second is named in the notes, not replayed."""
    import planner.solve as solve_mod

    real = solve_mod.decisions_bound
    monkeypatch.setattr(solve_mod, "decisions_bound", lambda problem, d: dataclasses.replace(real(problem, d), seconds=1e9))
    trace = _trace(2)
    report = solve_report(trace, resolve_hardware(HW), trace_digest=_digest(trace))
    replayed = {re.search(r"chunk size (\d+)", w).group(1) for w, _ in report.evaluated if w.startswith("placement MIP")}
    skipped = re.findall(r"placement MIP, chunk size (\d+) \(every variant\): at least 1e\+09 s", " ".join(report.schedule.header.notes))
    assert len(replayed) == 1 and len(skipped) == 1 and not replayed & set(skipped), (replayed, skipped)


def test_gpt3_13b_on_a100_is_won_by_the_mip_with_a_true_gap_within_5_percent():
    """Issue 17 item 5, GPT-3 13B x a100-80g-12ssd: with CPU steps at CPU Adam's rate alone, charged the time
    lost beside copies (session 13: 6.029 s, bound 5.851 s, 2.96%), and the modes free below PIN_MODES_BLOCKS, the placement MIP's plan replays faster than every reference
    decision set (the Angel-PTM-like set, 5.831 s, won before), and the header's bound (<= every replay,
    the angel baseline's too) is within 5% of it (bench/RESULTS.md "t13": 5.7805 s, bound 5.5867 s). A strict
    xfail from sim17 (evicted DEVICE bytes held until their copies land: 6.555 s, true gap 8.7%) until session 6:
    the plan replayed at its own budget (Note [the plan's own budget] in planner/solve.py; RESULTS "lp17": 3.07%)
    and the prefetch pass holding written-back grads and offloads until they land (Note [write-backs in flight]
    in planner/device_cache.py; RESULTS "wb17": 2.72%)."""
    problem, _, angel = _angel_13b()
    report = solve_report(problem.trace, problem.hardware, trace_digest=problem.trace_digest)
    h = report.schedule.header
    assert report.chosen.startswith("placement MIP"), report.chosen
    assert report.simulated_seconds < angel
    assert all(h.lower_bound_seconds <= s * (1 + 1e-9) for _, s in report.evaluated)
    assert h.lower_bound_seconds <= angel * (1 + 1e-9)
    assert h.gap <= 0.05


def _chains_replay(cpu: list[tuple[float, int]], gpu: list[tuple[float, int]]):
    """A replay whose timeline holds CPU Adam steps (end, chunk) and DEVICE steps (end, chunk), 1 s each."""
    import types

    from planner.sim_result import Interval

    timeline = [Interval(channel=Channel.CPU_OPTIMIZER, start_seconds=e - 1.0, end_seconds=e, label=f"adam {c}",
                         step_chunk=c) for e, c in cpu]
    timeline += [Interval(channel=Channel.COMPUTE, start_seconds=e - 1.0, end_seconds=e, label=f"adam {c}",
                          step_chunk=c) for e, c in gpu]
    timeline.append(Interval(channel=Channel.COMPUTE, start_seconds=0.0, end_seconds=1.0, label="backward h.0"))
    return types.SimpleNamespace(timeline=tuple(timeline))


@dataclasses.dataclass(frozen=True)
class _Plans:
    chunk_plans: tuple


def _plans(tiers: list[tuple[Tier, Tier]]) -> _Plans:
    from schemas.schedule import ChunkPlan

    return _Plans(chunk_plans=tuple(ChunkPlan(chunk=c, os_tier=os, optimizer_tier=opt) for c, (os, opt) in enumerate(tiers)))


def test_balanced_chains_moves_the_later_chains_last_steps_only_when_they_end_whole_steps_apart():
    """Note [the optimizer's two chains] (planner/solve.py): the chunk the later chain steps last changes chain,
    floor(difference / both spacings) of them; none where the chains end closer than both spacings (GPT-3 175B
    x rtx4090-768g-12ssd: 0.97 s apart, spacings 0.53 + 0.57 s), and never one whose OS lives on DEVICE."""
    from planner.solve import balanced_chains

    nvme_gpu, nvme_cpu = (Tier.NVME, Tier.DEVICE), (Tier.NVME, Tier.HOST)
    d = _plans([(Tier.DEVICE, Tier.DEVICE), nvme_gpu, nvme_gpu, nvme_cpu, nvme_cpu, nvme_cpu])
    # 175B x a100-80g-12ssd's shape: the CPU chain (chunks 5, 4, 3) ends 3.84 s after the DEVICE chain (1, 2)
    replay = _chains_replay(cpu=[(109.95, 5), (111.43, 4), (112.905, 3)], gpu=[(107.155, 1), (109.066, 2)])
    moved, how = balanced_chains(d, replay)
    assert [p.optimizer_tier for p in moved.chunk_plans] == [Tier.DEVICE] * 4 + [Tier.HOST] * 2
    assert "chunk 3" in how and "from the CPU to the GPU" in how
    # closer than both spacings (1.0 + 1.0 s): no move
    assert balanced_chains(d, _chains_replay(cpu=[(9.0, 5), (10.0, 4), (11.5, 3)], gpu=[(9.5, 1), (10.5, 2)])) is None
    # the DEVICE chain later by more than twice both spacings: its two last steps go to the CPU
    replay = _chains_replay(cpu=[(1.0, 5), (2.0, 4)], gpu=[(3.0, 3), (4.0, 1), (5.0, 2), (6.5, 0)])
    d2 = _plans([(Tier.DEVICE, Tier.DEVICE), nvme_gpu, nvme_gpu, nvme_gpu, nvme_cpu, nvme_cpu])
    moved, how = balanced_chains(d2, replay)
    # chunk 0's OS lives on DEVICE: it stays; the next two the DEVICE chain steps last (2 and 1) move
    assert [p.optimizer_tier for p in moved.chunk_plans] == [Tier.DEVICE, Tier.HOST, Tier.HOST, Tier.DEVICE, Tier.HOST, Tier.HOST]
    assert "chunks 1, 2" in how
    # a chain of one step gives no spacing: no move
    assert balanced_chains(d, _chains_replay(cpu=[(20.0, 3)], gpu=[(1.0, 1), (2.0, 2)])) is None


@pytest.mark.parametrize("enabled", [True, False])
def test_a_solve_runs_without_the_cyclic_gc_and_leaves_it_as_it_found_it(enabled):
    # Note [no cyclic GC during a solve]: paused for the solve (its progress callback runs inside it), restored after
    seen = []
    (gc.enable if enabled else gc.disable)()
    try:
        _report(3, 5.0, progress=lambda _msg: seen.append(gc.isenabled()))
        assert seen and not any(seen)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
