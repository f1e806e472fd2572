"""`python -m planner maxsize --family gpt3 --hardware H`: the largest model each policy can train.

A size is feasible for a policy when its schedule replays in the simulator within every tier's
capacity; the sizes are analytic traces (`planner.families.gpt_trace`). The search over the GPT-3
ladder is Note [maxsize ladder] above `max_size`; tide's two-level search is
Note [maxsize tide search] above `tide_may_fit`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

from planner.policies import POLICIES, baseline, policy_layout
from planner.compare import TIDE
from planner.errors import InfeasibleError, PlannerError
from planner.families import gpt_param_count, gpt_trace
from planner.layout import build_layout, candidate_chunk_sizes
from planner.materialize import materialize
from planner.placement import PlacementInfeasible, PlacementModel, placement_feasible, placement_input
from planner.presets import resolve_hardware
from planner.problem import build_problem
from planner.simulate import ScheduleViolation, simulate
from planner.solution import build_schedule
from planner.reference import reference_decisions
from schemas import Hardware
from schemas._base import frozen

# (layers, hidden, heads) of Fuyou Table 4, GPT-3 13B ... 805B
GPT3_LADDER: tuple[tuple[int, int, int], ...] = (
    (40, 5120, 40), (60, 6656, 52), (80, 8192, 64), (88, 11264, 88),
    (96, 12288, 96), (112, 14336, 112), (128, 16384, 128), (160, 20480, 160),
)
TRACE_SOURCE = ("traces: planner.families.gpt_trace (analytic GPT-2-style traces, equivalent to a meta-device "
                "recording of the model: same moments, parameter shapes, FLOPs and activation bytes)")
_DIGEST = "sha256:" + "0" * 64  # analytic traces have no file; schedules made here are not written


@frozen
class MaxSize:
    """The largest model of the family one policy trains on the hardware (layers 0: none fits)."""

    policy: str
    layers: int
    hidden: int
    heads: int
    params: int
    checked: int  # how many sizes were scheduled to find it


TIDE_LP_SECONDS = 60.0  # feasibility LP of one size (512 layers x 16384: ~6 s on the 2-core CI box)
TIDE_MIP_SECONDS = 60.0  # the confirming feasibility MIP of one chunk size


def _trace(layers: int, hidden: int, heads: int, *, batch: int, seq: int):
    return gpt_trace(layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, positions=max(seq, 1024),
                     name=f"gpt3-{layers}x{hidden}")


def feasible_fn(policy: str, hardware: Hardware, *, batch: int, seq: int,
                use_mip: bool = True) -> Callable[[int, int, int], bool]:
    """`fn(layers, hidden, heads)`: does `policy` fit that model on `hardware`? (tide: a confirmed plan:
    one of its reference decision sets, else, with `use_mip`, a plan of the placement MIP)"""

    def fn(layers: int, hidden: int, heads: int) -> bool:
        trace = _trace(layers, hidden, heads, batch=batch, seq=seq)
        if policy == TIDE:
            problem = build_problem(trace, hardware, trace_digest=_DIGEST)
            return tide_reference_fits(problem) or (use_mip and tide_plan_fits(problem, hardware))
        try:
            baseline(policy, build_problem(trace, hardware, trace_digest=_DIGEST))
            return True
        except InfeasibleError:
            return False

    return fn


# Note [maxsize tide search]:
# tide's search is two-level, so that a preset takes minutes, not hours: the binary search asks the
# placement model's LP relaxation with memory rows only (`placement.placement_feasible`, GLOP, the
# smallest chunk size: finest granularity, least DEVICE), a necessary condition; the sizes it ends on,
# and the sizes the baselines reached (they are searched first), are then confirmed biggest first by
# a real plan: one of tide's reference decision sets (`tide_reference_fits`: the baselines' decisions
# run through tide's engine, seconds per size), else an integral point of the placement MIP's memory
# rows (`tide_plan_fits`, minutes at the largest sizes: a plan that fits, not the fastest one; `solve`
# finds the fastest), materialized and replayed by the simulator. A refuted size steps its layer count
# down by binary search with the reference sets only. Since every size a baseline reaches is offered
# to tide's confirmation, tide's answer is at least every baseline's wherever its reference decision
# sets can express what that baseline does.


def tide_may_fit(problem) -> bool:
    """Necessary condition for tide: the memory rows of the placement LP (smallest chunk size) have a
    solution. False is a proof for that chunk size (the LP relaxes the MIP)."""
    size = min(candidate_chunk_sizes(problem))
    if problem.world_size > 1:
        # with p ranks the smallest chunk is not the least memory: the comm groups' padding and the
        # chunk's capacity (OS is charged on it) decide, so every candidate size is asked (LPs of
        # memory rows, 0.1-0.2 s each at 55B on a100-40g-angel-8gpu)
        return any(placement_feasible(placement_input(problem, build_layout(problem, chunk_elements=s, groups_span_blocks=True)),
                                      time_limit_seconds=TIDE_LP_SECONDS) is not False
                   for s in sorted(candidate_chunk_sizes(problem)))
    data = placement_input(problem, build_layout(problem, chunk_elements=size))
    return placement_feasible(data, time_limit_seconds=TIDE_LP_SECONDS) is not False


def tide_reference_fits(problem) -> bool:
    """Sufficient condition, fast (seconds where the MIP takes minutes): one of tide's reference
    decision sets (`planner.reference.reference_decisions`: what the baselines decide, run through tide's
    engine) on the baselines' chunk layout, materialized within every capacity and replayed by the
    simulator. It is what makes tide's largest model at least every baseline's."""
    layout = policy_layout(problem)
    for _, decisions in reference_decisions(problem, layout):
        try:
            simulate(materialize(problem, decisions), problem.hardware)
        except (PlannerError, ScheduleViolation):  # InfeasibleError is a PlannerError
            continue
        return True
    return False


def tide_plan_fits(problem, hardware: Hardware) -> bool:
    """Sufficient condition: a plan of the placement MIP (PARAM may be homed on NVME), materialized,
    that the simulator replays within every capacity. Chunk sizes smallest first; the first that works."""
    for size in sorted(candidate_chunk_sizes(problem)):
        # with several ranks comm groups span blocks, as in planner.solve (Note [layout comm groups])
        layout = build_layout(problem, chunk_elements=size, groups_span_blocks=problem.world_size > 1)
        data = placement_input(problem, layout)
        try:
            # any integral plan will do, not the fastest: the memory rows only (no time rows, no
            # objective), HiGHS stops at its first integral point (1650B: ~50 s instead of no
            # solution within 60 s for the full MIP)
            sol = PlacementModel(data, feasibility=True).solve(time_limit_seconds=TIDE_MIP_SECONDS, gap=1.0)
            schedule = build_schedule(problem, layout, data, sol)
            simulate(schedule, hardware)  # a schedule the simulator rejects is no size of tide's
        except (PlacementInfeasible, PlannerError):
            continue
        return True
    return False


def tide_fast_fn(hardware: Hardware, *, batch: int, seq: int) -> Callable[[int, int, int], bool]:
    """`fn(layers, hidden, heads)`: tide_may_fit of that model (the binary search's fast check)."""

    def fn(layers: int, hidden: int, heads: int) -> bool:
        return tide_may_fit(build_problem(_trace(layers, hidden, heads, batch=batch, seq=seq), hardware,
                                          trace_digest=_DIGEST))

    return fn


# Note [maxsize ladder]:
# For every width of the GPT-3 ladder (Fuyou Table 4: hidden size and heads of GPT-3 13B ... 805B)
# the layer count is binary-searched between 1 and 4x the Table 4 layer count of that width
# (feasibility is monotone in layers: more layers, more model data and the same per-layer peak); the
# widths are tried in ascending order until not even one layer fits; the answer is the feasible
# (layers, width) with the most parameters.
# A size is feasible for a policy when its schedule replays in the simulator within every tier's
# capacity (baselines: `planner.policies`; tide: the placement MIP of `planner.placement`
# materialized by `planner.solve.build_schedule`).
#
# The candidate traces come from `planner.families.gpt_trace`: analytic traces of the GPT-2-style
# model with the moments, parameter shapes, FLOPs and activation bytes a meta-device recording
# (`python -m executor record --meta`) of that model would give; nothing is recorded or downloaded.


def max_size(fits: Callable[[int, int, int], bool], *, ladder: Sequence[tuple[int, int, int]] = GPT3_LADDER,
             max_layers_factor: int = 4, policy: str = "",
             confirm: Callable[[int, int, int], bool] | None = None,
             step_confirm: Callable[[int, int, int], bool] | None = None,
             hints: Sequence[tuple[int, int, int]] = ()) -> MaxSize:
    """Binary search of the layer count per width; the widths in ascending order until none fits.

    With `confirm`, `fits` is only a necessary condition: after the search the widths' answers, and
    the `hints` (sizes other policies reached), are confirmed biggest first (`_confirmed_best`), so
    a preset usually needs one confirming plan; a refuted width steps its layer count down with
    `step_confirm` (default: `confirm`)."""
    best = MaxSize(policy=policy, layers=0, hidden=0, heads=0, params=0, checked=0)
    checked = 0
    found: list[tuple[int, int, int]] = []  # with confirm: (layers, hidden, heads) the fast check allows
    for table_layers, hidden, heads in ladder:
        lo, hi = 0, max_layers_factor * table_layers  # lo fits (0: nothing yet), hi + 1 does not
        checked += 1
        if not fits(1, hidden, heads):
            break  # a wider model of one layer does not fit either
        lo = 1
        if fits(hi, hidden, heads):
            lo = hi
        else:
            hi -= 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                checked += 1
                if fits(mid, hidden, heads):
                    lo = mid
                else:
                    hi = mid - 1
        checked += 1
        if confirm is not None:
            found.append((lo, hidden, heads))
            continue
        params = gpt_param_count(layers=lo, hidden=hidden)
        if params > best.params:
            best = MaxSize(policy=policy, layers=lo, hidden=hidden, heads=heads, params=params, checked=0)
    if confirm is not None:
        best, more = _confirmed_best([*found, *hints], confirm, policy, step_confirm=step_confirm)
        checked += more
    return MaxSize(policy=policy, layers=best.layers, hidden=best.hidden, heads=best.heads, params=best.params,
                   checked=checked)


def _confirmed_best(found: Sequence[tuple[int, int, int]], confirm: Callable[[int, int, int], bool],
                    policy: str, *, step_confirm: Callable[[int, int, int], bool] | None = None) -> tuple[MaxSize, int]:
    """The largest confirmed size: the widths' fast answers, biggest first; one that is refuted steps
    its layer count down (binary search with `step_confirm`) and the next width may still beat it."""
    step_confirm = step_confirm or confirm
    best = MaxSize(policy=policy, layers=0, hidden=0, heads=0, params=0, checked=0)
    checked = 0
    for layers, hidden, heads in sorted(found, key=lambda x: -gpt_param_count(layers=x[0], hidden=x[1])):
        if gpt_param_count(layers=layers, hidden=hidden) <= best.params:
            break  # sorted: nothing left can beat it
        checked += 1
        if not confirm(layers, hidden, heads):
            ok, bad = 0, layers  # confirmed layer count (0: none), smallest refuted one
            while ok + 1 < bad:
                mid = (ok + bad) // 2
                if gpt_param_count(layers=mid, hidden=hidden) <= best.params:
                    ok = mid  # not better than the best anyway: no need to confirm it
                    continue
                checked += 1
                if step_confirm(mid, hidden, heads):
                    ok = mid
                else:
                    bad = mid
            layers = ok
        if layers and gpt_param_count(layers=layers, hidden=hidden) > best.params:
            best = MaxSize(policy=policy, layers=layers, hidden=hidden, heads=heads,
                           params=gpt_param_count(layers=layers, hidden=hidden), checked=0)
    return best, checked


def max_sizes(hardware: Hardware, *, policies: Sequence[str], batch: int = 1, seq: int = 1024,
              ladder: Sequence[tuple[int, int, int]] = GPT3_LADDER) -> list[MaxSize]:
    for policy in policies:
        if policy != TIDE and policy not in POLICIES:
            raise PlannerError(f"unknown policy {policy!r}; choose from {', '.join([TIDE, *POLICIES])}")
    # the baselines first: the sizes they reach are tide's hints (confirmed by its reference decision
    # sets in seconds, so the slow MIP confirmation is only tried above them)
    found = {policy: max_size(feasible_fn(policy, hardware, batch=batch, seq=seq), ladder=ladder, policy=policy)
             for policy in policies if policy != TIDE}
    if TIDE in policies:
        hints = [(r.layers, r.hidden, r.heads) for r in found.values() if r.layers]
        found[TIDE] = max_size(tide_fast_fn(hardware, batch=batch, seq=seq), ladder=ladder, policy=TIDE,
                               confirm=feasible_fn(TIDE, hardware, batch=batch, seq=seq),
                               step_confirm=feasible_fn(TIDE, hardware, batch=batch, seq=seq, use_mip=False),
                               hints=hints)
    return [found[p] for p in policies]


# ----------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "maxsize",
        description="Search layer count (binary search, up to 4x the Table 4 count) and width (the GPT-3 ladder of "
                    "Fuyou Table 4) for the largest model each policy schedules within the hardware's capacities. "
                    + TRACE_SOURCE + ".")
    p.add_argument("--family", choices=["gpt3"], default="gpt3", help="model family (default: gpt3)")
    p.add_argument("--hardware", metavar="NAME|FILE", help="hardware preset or TOML (default: cpu-emulated)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch size (default: 1, as Fuyou §5.2)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (default: 1024, Fuyou Table 4)")
    p.add_argument("--policies", nargs="+", metavar="POLICY", choices=[TIDE, *POLICIES],
                   help=f"policies (default: all of {', '.join([TIDE, *POLICIES])})")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.seq < 1:
        raise PlannerError(f"--batch and --seq must be positive, found batch={args.batch} seq={args.seq}")
    hardware = resolve_hardware(args.hardware)
    policies = args.policies or [TIDE, *POLICIES]
    results = max_sizes(hardware, policies=policies, batch=args.batch, seq=args.seq)
    if args.json:
        print(json.dumps({"family": args.family, "hardware": hardware.name, "batch": args.batch, "seq": args.seq,
                          "trace_source": TRACE_SOURCE,
                          "results": [{"policy": r.policy, "params": r.params, "layers": r.layers, "hidden": r.hidden,
                                       "heads": r.heads, "sizes_checked": r.checked} for r in results]}, indent=2))
        return 0
    table = Table(title=f"largest GPT-3-family model on {hardware.name} (batch {args.batch}, seq {args.seq})")
    for col in ("policy", "params (B)", "layers", "hidden", "heads", "sizes checked"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        table.add_row(r.policy, f"{r.params / 1e9:.1f}" if r.params else "none fits", str(r.layers), str(r.hidden),
                      str(r.heads), str(r.checked))
    console = Console(width=max(Console().width, 120))
    console.print(table)
    console.print(TRACE_SOURCE + ".")
    return 0


__all__ = ["GPT3_LADDER", "MaxSize", "TRACE_SOURCE", "feasible_fn", "max_size", "max_sizes", "register",
           "tide_may_fit", "tide_plan_fits", "tide_reference_fits"]
