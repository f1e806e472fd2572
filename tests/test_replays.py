"""`planner.replays`: plans replayed ahead in worker processes (Note [replays ahead]) give the solve the outcomes it
would compute itself, whatever the workers do, and a solve with several jobs writes the same bytes as with one."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest

from planner.cli import main
from planner.errors import PlannerError
from planner.presets import resolve_hardware
from planner.replays import replay_memo
import planner.solve as solve_module
from planner.solve import solve_report
from schemas import Trace
from schemas._base import digest_bytes, read_bytes

from conftest import TRACES

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers are forked")

PROBLEM = ("the problem",)  # what a run receives: the workers get the memo's problem object by fork
SOLVE = os.getpid()  # the test's own process: a worker is any other


def square(problem, x: int) -> tuple[int, int, int]:
    """The value, and the process that computed it."""
    assert problem == PROBLEM
    return x * x, os.getpid(), x


def slow(problem, x: int, seconds: float) -> tuple[int, int]:
    time.sleep(seconds)
    return x, os.getpid()


def fails(problem, x: int):
    raise PlannerError(f"plan {x} does not survive")


class Unpicklable(PlannerError):
    def __init__(self, x: int, why: str) -> None:  # pickle calls it with one argument: it cannot come back whole
        super().__init__(f"{why} {x}")


def fails_oddly(problem, x: int):
    raise Unpicklable(x, "odd")


def dies_in_a_worker(problem, x: int) -> tuple[int, int]:
    if os.getpid() != SOLVE:
        os._exit(3)
    return x, os.getpid()


def test_a_plan_read_after_a_worker_replayed_it_is_the_workers_outcome():
    with replay_memo(jobs=2) as memo:
        memo.ahead(PROBLEM, square, [("a", None, (3,))])
        time.sleep(0.5)  # the worker replays it meanwhile
        value, pid, _ = memo.outcome(PROBLEM, "a", None, square, 3)
        assert value == 9 and pid != SOLVE
        assert memo.worker_cpu_seconds > 0.0
        assert memo.outcome(PROBLEM, "a", None, square, 3)[1] == pid  # read once more: the same outcome


def test_one_job_replays_every_plan_in_the_solve_and_names_nothing_ahead():
    with replay_memo(jobs=1) as memo:
        memo.ahead(PROBLEM, square, [("a", None, (4,))])
        assert memo.outcome(PROBLEM, "a", None, square, 4)[:2] == (16, SOLVE)
        assert memo.worker_cpu_seconds == 0.0
        assert not memo.ahead(PROBLEM, square, [("b", None, (5,))])  # says so


def test_while_a_worker_replays_the_plan_read_the_solve_replays_the_next_ones_of_its_batch():
    with replay_memo(jobs=2) as memo:
        memo.ahead(PROBLEM, slow, [(k, None, (k, 1.0 if k == 0 else 0.0)) for k in range(3)])
        time.sleep(0.3)  # the worker has started plan 0 (1 s)
        assert memo.outcome(PROBLEM, 0, None, slow, 0, 1.0)[1] != SOLVE
        # plans 1 and 2 were pending while the solve waited: it replayed them itself
        assert memo.outcome(PROBLEM, 1, None, slow, 1, 0.0) == (1, SOLVE)
        assert memo.outcome(PROBLEM, 2, None, slow, 2, 0.0) == (2, SOLVE)


def test_while_a_worker_computes_the_one_read_the_solve_does_its_own_work_then_what_it_named_ahead():
    with replay_memo(jobs=2) as memo:
        memo.ahead(PROBLEM, slow, [("long", None, ("long", 1.0))])
        memo.ahead(PROBLEM, square, [("later", None, (7,))])  # another batch
        memo.ahead(PROBLEM, square, [("spare", None, (8,))], spare=True)
        time.sleep(0.3)  # the worker has started "long" (1 s)
        done = []

        def meanwhile() -> bool:  # its own work first, one piece a call, then a plan named ahead
            if not done:
                done.append("own")
                return True
            if memo.work_here():
                done.append("named")
                return True
            return False

        assert memo.outcome(PROBLEM, "long", None, slow, "long", 1.0, meanwhile=meanwhile)[1] != SOLVE
        assert done == ["own", "named"]  # the spare plan is a worker's
        assert memo.outcome(PROBLEM, "later", None, square, 7)[1] == SOLVE


def test_a_plan_that_does_not_survive_raises_the_same_error_from_a_worker():
    with replay_memo(jobs=2) as memo:
        memo.ahead(PROBLEM, fails, [("x", None, (7,))])
        time.sleep(0.3)
        with pytest.raises(PlannerError, match="plan 7 does not survive"):
            memo.outcome(PROBLEM, "x", None, fails, 7)
        # an error that cannot travel back whole is raised by the solve's own replay
        memo.ahead(PROBLEM, fails_oddly, [("y", None, (8,))])
        time.sleep(0.3)
        with pytest.raises(Unpicklable, match="odd 8"):
            memo.outcome(PROBLEM, "y", None, fails_oddly, 8)


def test_a_worker_that_dies_leaves_its_plan_to_the_solve():
    with replay_memo(jobs=2) as memo:
        memo.ahead(PROBLEM, dies_in_a_worker, [("d", None, (5,))])
        time.sleep(0.3)
        assert memo.outcome(PROBLEM, "d", None, dies_in_a_worker, 5) == (5, SOLVE)
        memo.ahead(PROBLEM, square, [("after", None, (2,))])  # no workers from then on: the solve replays
        assert memo.outcome(PROBLEM, "after", None, square, 2)[:2] == (4, SOLVE)


def test_a_plan_dropped_while_a_worker_replays_it_costs_that_worker_not_the_next_plans():
    with replay_memo(jobs=2) as memo:
        memo.ahead(PROBLEM, slow, [("long", None, ("long", 30.0))])
        time.sleep(0.3)  # the worker is in its 30 s
        started = time.perf_counter()
        memo.drop(PROBLEM, [("long", None)])
        memo.ahead(PROBLEM, square, [("next", None, (6,))])
        time.sleep(0.5)
        value, pid, _ = memo.outcome(PROBLEM, "next", None, square, 6)
        assert value == 36 and pid != SOLVE  # a fresh worker replayed it, long before the dropped plan's 30 s
        assert time.perf_counter() - started < 10.0
        # a dropped plan read after all is replayed by the solve
        assert memo.outcome(PROBLEM, "long", None, slow, "long", 0.0) == ("long", SOLVE)


def test_another_problem_than_the_workers_is_replayed_by_the_solve():
    with replay_memo(jobs=2) as memo:
        memo.ahead(PROBLEM, square, [("a", None, (3,))])
        other = tuple(["the problem"])  # equal, but another object: a solve's side problem
        memo.ahead(other, square, [("a", None, (3,))])
        assert memo.outcome(other, "a", None, square, 3)[1] == SOLVE


def _solve(path: str, preset: str, jobs: int):
    raw = read_bytes("trace", path)
    return solve_report(Trace.from_msgpack(raw, source=path), resolve_hardware(preset), trace_digest=digest_bytes(raw),
                        jobs=jobs)


FIXED_MIP = solve_module._fixed_mip
FIXED_MIPS = None  # the folder fixed_mip_saying_where writes to (a test's tmp_path)


def fixed_mip_saying_where(*args, **kwargs):
    """planner.solve._fixed_mip, leaving a file named by the process that solved it."""
    (FIXED_MIPS / str(os.getpid())).touch()
    return FIXED_MIP(*args, **kwargs)


def test_a_solve_with_two_jobs_writes_the_bytes_of_a_solve_with_one(tmp_path, monkeypatch):
    # PatrickStar's 1B on its V100 node: a likely chunk size's LP to a vertex and its MIP's fixed plan solved by a
    # worker (Note [a size's MIP in a worker]), the other's MIP by the solve while it waits for them, the MIP plans'
    # replays named ahead, several reference sets
    one = _solve(str(TRACES / "pstar-gpt-1b.msgpack"), "v100-32g-240g", jobs=1)
    monkeypatch.setattr(sys.modules[__name__], "FIXED_MIPS", tmp_path)
    monkeypatch.setattr(solve_module, "_fixed_mip", fixed_mip_saying_where)
    two = _solve(str(TRACES / "pstar-gpt-1b.msgpack"), "v100-32g-240g", jobs=2)
    where = sorted(p.name for p in tmp_path.iterdir())
    assert str(SOLVE) in where and len(where) == 2  # a MIP here, the other in a worker
    assert two.worker_cpu_seconds > 0.0  # the workers replayed some
    assert one.worker_cpu_seconds == 0.0
    assert two.schedule.to_msgpack() == one.schedule.to_msgpack()
    assert two.evaluated == one.evaluated and two.chosen == one.chosen


POLISHED = solve_module._polished


def polished_saying_where(data, *args, **kwargs):
    """planner.solve._polished, leaving a file named by the process that polished a plan of several ranks."""
    plan = POLISHED(data, *args, **kwargs)
    if plan is not None and data.ranks > 1:
        (FIXED_MIPS / str(os.getpid())).touch()
    return plan


def test_with_several_ranks_a_worker_polishes_the_sizes_it_solves_and_the_bytes_are_one_jobs(tmp_path, monkeypatch):
    # Note [every size likely with several ranks]: every chunk size's LP solved to a vertex (none for its value
    # alone), a worker solving and polishing the MIP of every size but the first, the solve polishing the first
    # (PatrickStar's 1B on its 8 x V100 node); the same bytes as one job
    value_lps = []
    value_lp = solve_module._value_lp
    monkeypatch.setattr(solve_module, "_value_lp", lambda *a: (value_lps.append(a), value_lp(*a))[1])
    one = _solve(str(TRACES / "pstar-gpt-1b.msgpack"), "v100-32g-240g-8gpu", jobs=1)
    assert not value_lps
    monkeypatch.setattr(sys.modules[__name__], "FIXED_MIPS", tmp_path)
    monkeypatch.setattr(solve_module, "_polished", polished_saying_where)
    two = _solve(str(TRACES / "pstar-gpt-1b.msgpack"), "v100-32g-240g-8gpu", jobs=2)
    where = sorted(p.name for p in tmp_path.iterdir())
    assert str(SOLVE) in where and len(where) == 2  # polished here and in a worker
    assert two.schedule.to_msgpack() == one.schedule.to_msgpack()
    assert two.evaluated == one.evaluated and two.chosen == one.chosen


ROOT_BOUND = solve_module._root_bound


def root_saying_where(problem, data, safety):
    """planner.solve._root_bound, leaving a file named by the process that computed it; 1 s slower in the solve's (a
    worker takes the other meanwhile)."""
    (FIXED_MIPS / str(os.getpid())).touch()
    if os.getpid() == SOLVE:
        time.sleep(1.0)
    return ROOT_BOUND(problem, data, safety)


def test_the_root_nodes_a_solve_may_read_are_named_ahead_and_give_one_jobs_bounds(tmp_path, monkeypatch):
    # Note [root nodes ahead]: two chunk sizes whose LPs are far below the target, so both roots are read; with two
    # jobs one is computed by a worker while the solve computes the other, the same bounds as with one job
    import types

    from planner.placement import PlacementModel
    from test_placement import synthetic

    monkeypatch.setattr(solve_module, "lower_bound", lambda problem: types.SimpleNamespace(seconds=0.0))
    inputs = {size: (None, synthetic(device_mib=mib)) for size, mib in ((1, 40), (2, 30))}
    lps = {size: PlacementModel(data, relax=True).solve().bound_seconds for size, (_, data) in inputs.items()}
    target = 10 * max(lps.values())

    def rooted_bounds(jobs: int) -> dict[int, float]:
        bounds, rooted = dict(lps), set()
        with replay_memo(jobs=jobs):
            solve_module._root_bounds(("the problem",), inputs, bounds, rooted, target, 60.0, lambda _msg: None)
        assert rooted == {1, 2}
        return bounds

    one = rooted_bounds(1)
    monkeypatch.setattr(sys.modules[__name__], "FIXED_MIPS", tmp_path)
    monkeypatch.setattr(solve_module, "_root_bound", root_saying_where)
    assert rooted_bounds(2) == one
    assert str(SOLVE) in (where := sorted(p.name for p in tmp_path.iterdir())) and len(where) == 2


VERTEX_MIP = solve_module._vertex_mip


def slow_vertex_mip(problem, data, safety):
    """planner.solve._vertex_mip, 2 s slower in a worker."""
    if os.getpid() != SOLVE:
        time.sleep(2.0)
    return VERTEX_MIP(problem, data, safety)


@pytest.mark.parametrize("polish_max_blocks", [1, solve_module.POLISH_MAX_BLOCKS])
def test_the_search_solves_a_mip_while_a_worker_solves_an_lp(monkeypatch, polish_max_blocks):
    # Note [MIPs while a worker solves an LP]: with a polish (pstar-gpt-1b's 24 blocks) and without one (as on a model
    # of POLISH_MAX_BLOCKS blocks or more), the solve's own size's MIP is solved while it waits for the worker's
    monkeypatch.setattr(solve_module, "POLISH_MAX_BLOCKS", polish_max_blocks)
    one = _solve(str(TRACES / "pstar-gpt-1b.msgpack"), "v100-32g-240g", jobs=1)
    events = []
    computed = solve_module._computed

    def computed_saying_when(problem, key, *args, **kw):
        out = computed(problem, key, *args, **kw)
        events.append(key[0])
        return out

    monkeypatch.setattr(solve_module, "_vertex_mip", slow_vertex_mip)
    monkeypatch.setattr(solve_module, "_fixed_mip", lambda *a, **kw: (events.append("MIP"), FIXED_MIP(*a, **kw))[1])
    monkeypatch.setattr(solve_module, "_computed", computed_saying_when)
    two = _solve(str(TRACES / "pstar-gpt-1b.msgpack"), "v100-32g-240g", jobs=2)
    assert events.index("MIP") < events.index("vertex LP and MIP")  # solved while the worker's was being read
    assert events.count("MIP") == 1  # the worker's size's MIP: the worker's
    assert two.schedule.to_msgpack() == one.schedule.to_msgpack()
    assert two.evaluated == one.evaluated


def test_cli_refuses_fewer_than_one_job(tmp_path, capsys):
    code = main(["solve", str(TRACES / "pstar-gpt-1b.msgpack"), "--jobs", "0", "-o", str(tmp_path / "s.msgpack")])
    assert code == 2
    assert "--jobs must be at least 1, found 0" in capsys.readouterr().err
    assert not (tmp_path / "s.msgpack").exists()
