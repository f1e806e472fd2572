"""The replays of one solve: each plan materialized and simulated once (Note [replay memo] in
planner/materialize.py), and the plans (and LPs) the solve reads next computed ahead of need on the
machine's other cores (Note [replays ahead]).

`planner.solve` opens `replay_memo(jobs=...)`; `planner.materialize.materialize_replayed` looks each plan up
in it (`ReplayMemo.outcome`); the solve names what it will read next (`ReplayMemo.ahead`).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import enum
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from planner import mathopt_solver
from planner.errors import PlannerError

log = logging.getLogger(__name__)

# Note [replays ahead]:
# A solve replays its candidate plans one after another and reads each replay in that order: which plans
# cannot win (`_cannot_win`), which two are the bases of the replay variants, which is chosen. Materializing
# and simulating a plan is a pure function of the problem, the decisions and the solver stats (no clock, no
# state kept between calls), so it can run before it is read, anywhere. With `jobs` > 1 a solve names the
# plans it will read next (the MIP plan's budget and pacing variants as soon as its MIP is solved, the
# variants of the fastest replays so far while it still reads the others, the reference decision sets that can
# still win; those on the baselines' layout from the start, for a worker with nothing else to do: `spare`) and
# jobs - 1 worker processes, forked from the solve with the problem in their memory, replay them in that order
# while the solve goes on: HiGHS solving the next LP or MIP, or replaying a plan itself. When the solve
# reads a plan no worker has taken yet, it replays it itself (and hands the next ones to idle workers); when
# a worker is replaying the plan it reads, it replays the next plan of the same batch no worker has taken.
# A plan the solve will not read after all (a chunk size whose plans cannot win) is taken back, and a worker
# replaying it is killed and forked anew. The LPs of the chunk-size search go to the workers the same way: at the
# search's start every likely chunk size's LP to a vertex but the first, each with its MIP fixing (Notes [a vertex
# LP in a worker] and [a size's MIP in a worker] in planner/solve.py), and those solved for their value alone (Note
# [the LP of an unlikely chunk size, for its value]); after the search's LPs those of the header's proven bound (Note
# [the proven bound up to 128 blocks]). While the solve waits for one, it may do work of its own (`outcome`'s
# `meanwhile`: Note [MIPs while a worker solves an LP]) or replay plans named ahead (`work_here`).
# The solve reads every outcome in the order it does with one job, so the schedule is the same bytes with any
# number of jobs (tests/test_replays.py compares them; goldens); a worker that fails to return an outcome (it
# died, or its error does not pickle) has its plan replayed by the solve itself.
# Workers are forked only where the OS can fork (they get the problem without pickling it; Linux, macOS; elsewhere
# a solve does everything itself), and only while no HiGHS solve runs in the solve's process (Note [one HiGHS
# solve at a time] in planner/mathopt_solver.py). A worker solves LPs (HiGHS's interior point, serial) and, since
# session 23, a likely chunk size's MIP fixing (Note [a size's MIP in a worker] in planner/solve.py). Session 13
# kept MIPs out of workers: a 60-variable MIP in a child forked after a MIP had taken 1.25 s against milliseconds in
# its parent (HiGHS's MIP hands tasks to its scheduler's threads, which a fork does not copy). Re-measured with
# ortools 9.15 (bench/RESULTS.md, session 23) it does not recur: a 60-variable MIP 3.86-4.07 s in the parent (in a
# thread, then the main thread) and 3.86-3.99 s in children forked after; GPT-3 13B's fixing 0.92 s in a worker
# forked after the solve's MIPs, 0.94 s in one forked before.
#
# Note [replies unpickled where read]:
# A worker's reply travels pickled, and the feeding thread keeps its bytes: the solve unpickles it where it reads
# it (`ReplayMemo.outcome`). Unpickled by the feeding thread, a 512-block replay's schedule and timeline (~0.8 s)
# held the GIL against the solve's own replay and kept the worker idle until its next plan was sent: on the
# 512-block ladder rung (hidden 4096, a100-80g-12ssd) the worker sat idle 1.1-2.9 s between replays, 7.5 s in the
# solve's last 23 s (bench/RESULTS.md, session 22); and a reply never read (a spare reference set that cannot
# win) is never unpickled.


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_jobs_option(parser: argparse.ArgumentParser, *, help: str) -> None:
    """`--jobs N` of `planner solve` and `planner compare` (default: `available_cpus()`), read by `checked_jobs`."""
    parser.add_argument("--jobs", metavar="N", type=int, default=available_cpus(), help=help)


def checked_jobs(jobs: int) -> int:
    """`--jobs`, refused (PlannerError) below 1."""
    if jobs < 1:
        raise PlannerError(f"--jobs must be at least 1, found {jobs}")
    return jobs


class _State(enum.Enum):
    HERE = "here"  # the solve replays it itself (no worker has it)
    PENDING = "pending"  # named ahead, no worker has started it
    RUNNING = "running"  # a worker replays it
    REPLIED = "replied"  # a worker's reply is in
    LOST = "lost"  # its worker died: the solve replays it itself


@dataclasses.dataclass(slots=True, eq=False)
class _Entry:
    """One plan of the memo: what replays it, and its outcome once known (mutable: it settles once)."""

    problem: object
    stats: object
    plan: object  # the decisions as the memo compares them (planner.materialize._memo_plan)
    run: Callable[..., Any]  # run(problem, *args): the replay (schedule, SimResult), or raises
    args: tuple
    batch: int = -1  # the `ahead` call that named it (-1: none)
    spare: bool = False  # only for a worker with nothing else to do
    state: _State = _State.HERE
    reply: bytes | None = None  # a worker's (kind, value, CPU seconds), pickled (`_in_worker`): unpickled if read
    outcome: tuple[bool, Any] | None = None  # (True, value) or (False, the PlannerError run raised)


def _in_worker(problem: object, run: Callable[..., Any], args: tuple) -> tuple[str, Any, float]:
    """One replay in a worker: ("ok", value), ("raised", a PlannerError) or ("again", None) where the outcome
    cannot travel back whole (the solve replays it itself), with the worker's CPU seconds."""
    started = time.process_time()
    try:
        out: tuple[str, Any] = ("ok", run(problem, *args))
    except PlannerError as exc:  # the outcomes a solve reads (a plan that does not survive)
        out = ("raised", exc)
    except Exception:  # a bug: replayed by the solve, where its traceback is the solve's own
        out = ("again", None)
    if out[0] == "raised":
        try:
            pickle.loads(pickle.dumps(out[1]))
        except Exception:  # an exception whose constructor takes other arguments than its args
            out = ("again", None)
    return (*out, time.process_time() - started)


def _serve(conn: Connection, problem: object) -> None:
    """A worker: replays what it is sent, one at a time, until its pipe closes (or the solve kills it: a Ctrl-C in
    the terminal is the solve's to handle, which then stops its workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            run, args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_in_worker(problem, run, args))


class _Workers:
    """Worker processes forked with the problem, each replaying one plan at a time, fed by a thread as each
    becomes idle: a plan no worker has started waits here, where the solve can take it back (`take`)."""

    def __init__(self, count: int, problem: object) -> None:
        self._ctx = multiprocessing.get_context("fork")
        self._problem = problem
        self._cv = threading.Condition()
        self._pending: list[_Entry] = []
        self._busy: dict[Connection, _Entry] = {}
        self._idle: list[Connection] = []
        self._processes: dict[Connection, multiprocessing.Process] = {}  # every worker started, by its pipe
        self.broken = False
        self._closed = False
        self._wanted = 0  # workers to fork in place of killed ones
        for _ in range(count):
            self._start_one()
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._feed, name="tide-replays", daemon=True)
        self._thread.start()

    def _start_one(self) -> None:
        """One more idle worker, forked now with the problem in its memory, while no HiGHS solve runs in this
        process (Note [one HiGHS solve at a time] in planner/mathopt_solver.py)."""
        mine, theirs = self._ctx.Pipe()
        with mathopt_solver.ONE_HIGHS_SOLVE, warnings.catch_warnings():
            # Python >= 3.12 warns that forking a process with threads may deadlock the child in a lock another
            # thread held: no HiGHS solve runs (the lock above), and the child takes none of this module's locks
            warnings.simplefilter("ignore", DeprecationWarning)
            process = self._ctx.Process(target=_serve, args=(theirs, self._problem), daemon=True, name="tide-replay")
            process.start()
        theirs.close()
        with self._cv:
            self._processes[mine] = process
            self._idle.append(mine)

    def abandon(self, entry: _Entry) -> None:
        """`entry` will not be read: not started where it is pending, and where a worker replays it, that worker
        killed and a fresh one forked in its place (a replay of a few seconds, against a fork's milliseconds)."""
        with self._cv:
            if entry.state is _State.PENDING:
                self._pending.remove(entry)
            elif entry.state is _State.RUNNING and not self.broken:
                conn = next(c for c, e in self._busy.items() if e is entry)
                del self._busy[conn]  # the feeding thread drops its reply (none comes: its end of the pipe closes)
                self._processes[conn].kill()
                self._wanted += 1  # forked by the feeding thread, once no HiGHS solve runs
            else:
                return
            entry.state = _State.HERE
        self._wake_w.send_bytes(b"")

    def submit(self, entry: _Entry) -> None:
        with self._cv:
            entry.state = _State.PENDING
            self._pending.append(entry)
        self._wake_w.send_bytes(b"")

    def take(self, entry: _Entry) -> bool:
        """Whether `entry` was pending (it is the solve's now)."""
        with self._cv:
            if entry.state is not _State.PENDING:
                return False
            self._pending.remove(entry)
            entry.state = _State.HERE
            return True

    def take_next(self, batch: int | None) -> _Entry | None:
        """The first pending entry of `batch` (None: of any batch, not a spare one), taken (None: none)."""
        with self._cv:
            entry = next((e for e in self._pending if (e.batch == batch if batch is not None else not e.spare)), None)
            if entry is not None:
                self._pending.remove(entry)
                entry.state = _State.HERE
            return entry

    def wait(self, entry: _Entry) -> None:
        with self._cv:
            self._cv.wait_for(lambda: entry.state is not _State.RUNNING)

    def close(self) -> None:
        with self._cv:
            self._closed = True
        self._wake_w.send_bytes(b"")
        self._thread.join()  # it forks no worker from now on
        for process in self._processes.values():  # now, not after the plans they replay for nobody
            process.kill()
        for conn, process in self._processes.items():
            process.join()
            conn.close()
        self._wake_r.close()
        self._wake_w.close()

    def _feed(self) -> None:
        try:
            while self._feed_once():
                pass
        except Exception:  # whatever stops the feeding: every plan a worker had is the solve's to replay
            log.warning("replay workers stopped; the solve replays the rest itself", exc_info=True)
            with self._cv:
                self.broken = True
                for entry in self._busy.values():
                    entry.state = _State.LOST
                self._cv.notify_all()

    def _feed_once(self) -> bool:
        """Fork the workers wanted, hand pending plans to idle workers, then wait for a reply or a wake-up; False
        once closed."""
        while self._wanted and not self._closed:
            self._start_one()
            with self._cv:
                self._wanted -= 1
        with self._cv:
            if self._closed:
                return False
            while self._idle and self._pending and not self.broken:
                entry = next((e for e in self._pending if not e.spare), self._pending[0])
                self._pending.remove(entry)
                conn = self._idle.pop()
                entry.state = _State.RUNNING
                self._busy[conn] = entry
                try:
                    conn.send((entry.run, entry.args))
                except OSError:  # the worker died: its plan is the solve's, and so is every later one
                    del self._busy[conn]
                    self.broken, entry.state = True, _State.LOST
                    self._cv.notify_all()
            conns = list(self._busy)
        for conn in multiprocessing.connection.wait([*conns, self._wake_r]):
            if conn is self._wake_r:
                self._wake_r.recv_bytes()
                continue
            try:
                reply = conn.recv_bytes()  # not unpickled here: Note [replies unpickled where read]
            except (EOFError, OSError):  # the worker died (or was killed by `close`)
                reply = None
            with self._cv:
                entry = self._busy.pop(conn, None)
                if entry is None:  # its worker was killed (`abandon`)
                    continue
                if reply is None:
                    self.broken = True
                    entry.state = _State.LOST
                else:
                    entry.reply, entry.state = reply, _State.REPLIED
                    self._idle.append(conn)
                self._cv.notify_all()
        return True


class ReplayMemo:
    """The replays of one solve (Note [replay memo] in planner/materialize.py, Note [replays ahead])."""

    def __init__(self, *, jobs: int) -> None:
        self.jobs = jobs
        self.worker_cpu_seconds = 0.0  # the workers' CPU seconds (the solve's own process does not count them)
        self._entries: list[_Entry] = []
        self._batches = 0
        self._workers: _Workers | None = None
        self._workers_problem: object = None

    def ahead(self, problem: object, run: Callable[..., Any], plans: list[tuple[object, object, tuple]], *,
              spare: bool = False) -> bool:
        """For each (plan, stats, args) of `plans`, in order, `run(problem, *args)` (the replay of `plan`) started
        in a worker, for `outcome` to read later; with `spare`, only in a worker that has nothing else to do. One call
        names one batch: while the solve waits for a plan of the batch that a worker replays, it replays the
        batch's next plans itself, never those of another batch (which it may never read: a chunk size whose plans
        cannot win). Whether workers take them (False: `outcome` computes each where it is read)."""
        workers = self._pool(problem)
        if workers is None:
            return False
        self._batches += 1
        for plan, stats, args in plans:
            if self._find(problem, plan, stats) is None:
                entry = _Entry(problem=problem, stats=stats, plan=plan, run=run, args=args, batch=self._batches,
                               spare=spare)
                self._entries.append(entry)
                workers.submit(entry)
        return True

    def drop(self, problem: object, plans: list[tuple[object, object]]) -> None:
        """The (plan, stats) of `plans` will not be read: those no worker has started are not started."""
        for plan, stats in plans:
            entry = self._find(problem, plan, stats)
            if entry is not None and entry.outcome is None and entry.state in (_State.PENDING, _State.RUNNING):
                self._workers.abandon(entry)
                self._entries.remove(entry)

    def outcome(self, problem: object, plan: object, stats: object, run: Callable[..., Any], *args: Any,
                meanwhile: Callable[[], bool] = lambda: False) -> Any:
        """`run(problem, *args)`'s value (or its exception), computed once per plan. While a worker computes it,
        the solve calls `meanwhile()` (other work of its own, one piece a call: whether there was one), then
        replays the next plans of its batch itself, before it waits."""
        entry = self._find(problem, plan, stats)
        if entry is None:
            entry = _Entry(problem=problem, stats=stats, plan=plan, run=run, args=args)
            self._entries.append(entry)
        workers = self._workers
        while entry.outcome is None:
            if entry.state in (_State.HERE, _State.LOST) or workers.take(entry):
                self._here(entry)  # no worker has it: replayed here
            elif entry.state is _State.REPLIED:
                kind, value, cpu_seconds = pickle.loads(entry.reply)
                self.worker_cpu_seconds += cpu_seconds
                if kind == "again":
                    self._here(entry)
                else:
                    entry.outcome = (kind == "ok", value)
            elif meanwhile():
                pass
            elif (other := workers.take_next(entry.batch)) is not None:
                self._here(other)  # a worker replays it: meanwhile the next one of its batch, here
            else:
                workers.wait(entry)
        ok, value = entry.outcome
        if not ok:
            raise value
        return value

    def work_here(self) -> bool:
        """The first plan named ahead that no worker has started (of any batch, not a spare one) replayed here, for
        `outcome` to read later: whether there was one (the solve's work while it waits for a worker's where what
        it named is what it reads next)."""
        entry = self._workers.take_next(None) if self._workers is not None else None
        if entry is None:
            return False
        self._here(entry)
        return True

    def close(self) -> None:
        """Stop the workers (a plan named ahead and never read is dropped unfinished)."""
        if self._workers is not None:
            self._workers.close()

    def _find(self, problem: object, plan: object, stats: object) -> _Entry | None:
        return next((e for e in self._entries if e.problem is problem and e.stats == stats and e.plan == plan), None)

    @staticmethod
    def _here(entry: _Entry) -> None:
        try:
            entry.outcome = (True, entry.run(entry.problem, *entry.args))
        except PlannerError as exc:
            entry.outcome = (False, exc)

    def _pool(self, problem: object) -> _Workers | None:
        """The workers for `problem` (started at its first plan named ahead); None with one job, where the OS
        cannot fork, after a worker died, or for another problem than the workers' (a solve's side problems are
        replayed by the solve itself)."""
        if self._workers is None:
            if self.jobs < 2 or self._workers_problem is not None:
                return None
            if "fork" not in multiprocessing.get_all_start_methods():
                return None
            self._workers_problem = problem
            try:
                self._workers = _Workers(self.jobs - 1, problem)
            except (OSError, AssertionError):  # no processes to be had (a daemonic process may start none)
                return None
        if problem is not self._workers_problem or self._workers.broken:
            return None
        return self._workers


_MEMO: contextvars.ContextVar[ReplayMemo | None] = contextvars.ContextVar("replay_memo", default=None)


@contextlib.contextmanager
def replay_memo(*, jobs: int = 1) -> Iterator[ReplayMemo]:
    """Within it, `planner.materialize.materialize_replayed` replays each plan once, and with `jobs` > 1 the plans
    named by `ahead` in jobs - 1 worker processes (Note [replays ahead])."""
    memo = ReplayMemo(jobs=jobs)
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)
        memo.close()


def current() -> ReplayMemo | None:
    """The open memo, if any."""
    return _MEMO.get()
