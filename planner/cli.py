"""`python -m planner COMMAND ...`: every command lives in its own module with `register(subparsers)`.

Errors the user can fix (bad files, infeasible models) print one line to stderr and exit 2 (3 for
infeasible); nothing reaches the user as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from schemas import FormatError

from planner.errors import PlannerError

# command name -> module defining register(subparsers); the order is the order of `--help`
COMMANDS = {
    "validate": "planner.show",
    "show": "planner.show",
    "solve": "planner.solve",
    "simulate": "planner.simulate",
    "compare": "planner.compare",
    "maxsize": "planner.maxsize",
    "diff": "planner.diff",
    "plot": "planner.plot",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m planner",
        description="tide planner: solve, check and compare memory schedules for training big models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    registered: set[str] = set()
    for module_name in dict.fromkeys(COMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise  # a module that exists but imports something missing is a real bug
            continue  # a command whose issue has not landed yet
        module.register(sub)
        registered.add(module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
