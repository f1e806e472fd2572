"""`python -m planner COMMAND ...`: every command lives in its own module with `register(subparsers)`.

Only the module of the command that runs is imported (`validate` must not pay for OR-Tools);
`--help` lists every command from the light registry below without importing any of them.
Errors the user can fix (bad files, infeasible models) print one line to stderr and exit 2 (3 for
infeasible); nothing reaches the user as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from schemas import FormatError

from planner.errors import PlannerError

# command name -> module defining register(subparsers); the order is the order of `--help`
COMMANDS = {
    "validate": "planner.show",
    "show": "planner.show",
    "solve": "planner.solve_cli",
    "simulate": "planner.simulate_cli",
    "compare": "planner.compare",
    "maxsize": "planner.maxsize",
    "diff": "planner.diff",
    "plot": "planner.plot",
}

# the one-line help `--help` lists; the command's own module holds its arguments and description
COMMAND_HELP = {
    "validate": "check a trace, schedule or hardware profile",
    "show": "summarise a trace, schedule or hardware profile",
    "solve": "plan a trace on a hardware profile and write the schedule",
    "simulate": "replay a schedule on a hardware profile: time, bytes per channel, peaks, violations",
    "compare": "tide and the baselines (DeepSpeed, PatrickStar, Gemini, Fuyou, PyTorch) on one trace",
    "maxsize": "the largest GPT-3-family model each policy can train on the hardware",
    "diff": "what changed between two schedules, and what it costs",
    "plot": "draw a schedule: memory per tier over the iteration, and the channel timeline",
}


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The command argv names (its first positional argument), if it is one we know."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; the command argv names gets its full arguments, every other one a placeholder."""
    parser = argparse.ArgumentParser(
        prog="python -m planner",
        description="tide planner: solve, check and compare memory schedules for training big models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen_command(argv)
    real = COMMANDS[chosen] if chosen is not None else None
    for name, module_name in COMMANDS.items():
        if module_name != real:
            sub.add_parser(name, help=COMMAND_HELP[name])
        elif name == chosen:
            # register() adds every command of its module; only the chosen one is parsed
            importlib.import_module(module_name).register(_OnlyOne(sub, name))
    return parser


class _OnlyOne:
    """A subparsers stand-in that keeps the one command asked for and drops its module's others."""

    def __init__(self, sub: argparse._SubParsersAction, name: str) -> None:
        self._sub, self._name = sub, name

    def add_parser(self, name: str, **kwargs: object) -> argparse.ArgumentParser:
        if name == self._name:
            return self._sub.add_parser(name, help=COMMAND_HELP[name], **kwargs)
        return argparse.ArgumentParser(add_help=False)  # a sibling command, not run this time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return run_reporting_errors(lambda: args.func(args))


def run_reporting_errors(call: Callable[[], int | None]) -> int:
    """Run a command; errors the user can fix become one line on stderr and an exit code."""
    try:
        return int(call() or 0)
    except FormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PlannerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `python -m planner show ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
