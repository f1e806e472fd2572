"""`python -m executor COMMAND ...`: every command lives in its own module with `register(subparsers)`.

Commands whose module is not there (yet) are left out of the parser instead of breaking the CLI; a
module that exists but fails to import is a bug and raises. Errors the user can fix print one line to
stderr and exit 2; nothing reaches the user as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from schemas import FormatError

from executor.errors import ExecutorError

# command name -> module defining register(subparsers); the order is the order of `--help`
COMMANDS = {
    "record": "executor.record_cli",
    "profile": "executor.profile",
    "demo": "executor.demo",
}


def _module_exists(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m executor",
        description="tide executor: record a trace of one training iteration, profile this machine, run a demo.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in dict.fromkeys(COMMANDS.values()):
        if _module_exists(module_name):
            importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FormatError, ExecutorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
