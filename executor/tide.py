"""The `tide` console script: one command line for `python -m executor` and `python -m planner`.

`tide COMMAND ARGS...` runs `python -m <package> COMMAND ARGS...` in a child interpreter, so the
import rule holds (this module imports neither package: `tide solve` never loads torch, `tide
record` never loads the planner). It lives in executor/ because executor/__init__ is import-light
(no torch) and the executor is the user's side of tide (record, profile, the training loop); the
planner package must stay free of anything that could pull torch in.

Commands that can take a while (record, solve, simulate, compare, maxsize) show a rich spinner with
the elapsed time on stderr when it is a terminal; `--quiet` (or `-q`) turns it off. The child's
output is passed through unchanged (with the spinner on, it comes through pipes, so the child
prints plain text instead of colours).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import IO

# command -> (package whose CLI runs it, one line for --help); the order is the order of --help
COMMANDS: dict[str, tuple[str, str]] = {
    "record": ("executor", "record one training iteration of a model (named, or yours with --module) into a trace"),
    "profile": ("executor", "measure this machine into a hardware profile (TOML) for --hardware"),
    "solve": ("planner", "plan a trace on a hardware profile and write the schedule"),
    "show": ("planner", "summarise a trace, schedule or hardware profile"),
    "validate": ("planner", "check a trace, schedule or hardware profile"),
    "simulate": ("planner", "replay a schedule on a hardware profile: time, bytes per channel, peaks"),
    "compare": ("planner", "tide and the baselines (DeepSpeed, PatrickStar, Gemini, Fuyou, PyTorch) on one trace"),
    "maxsize": ("planner", "the largest GPT-3-family model each policy can train on the hardware"),
    "diff": ("planner", "what changed between two schedules, and what it costs"),
    "plot": ("planner", "draw a schedule: memory per tier over the iteration, and the channel timeline"),
    "demo": ("executor", "record, solve and train a small GPT on this machine, offloading forced"),
}
SLOW = frozenset({"record", "solve", "simulate", "compare", "maxsize"})
QUIET_FLAGS = ("--quiet", "-q")


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: tide COMMAND [ARGS...] [--quiet]", "",
             "tide: record a PyTorch training iteration, plan where its memory lives (GPU, CPU, NVMe), replay it.",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`tide COMMAND --help` shows a command's options; `tide X` is `python -m executor X` or "
              "`python -m planner X`.", "--quiet, -q: no progress display (record, solve, simulate, compare, maxsize)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"error: tide: unknown command {command!r}; expected one of: {', '.join(COMMANDS)} (tide --help)",
              file=sys.stderr)
        return 2
    package = COMMANDS[command][0]
    quiet = any(flag in rest for flag in QUIET_FLAGS)
    if command != "record":  # only `record` draws progress of its own: for the others the flag is tide's
        rest = [a for a in rest if a not in QUIET_FLAGS]
    child = [sys.executable, "-m", package, command, *rest]
    wants_help = any(a in ("-h", "--help") for a in rest)
    if command in SLOW and not quiet and not wants_help and sys.stderr.isatty():
        if command == "record":
            child.append("--quiet")  # one spinner: tide's
        return run_with_progress(child, f"tide {command}")
    try:
        return subprocess.call(child)
    except KeyboardInterrupt:
        return 130


def run_with_progress(child: list[str], label: str) -> int:
    """Run `child` with a rich spinner and the elapsed seconds; its output lines print above it."""
    from rich.console import Console

    console = Console(stderr=True)
    proc = subprocess.Popen(child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    start = time.monotonic()
    with console.status(f"{label} ...") as status:  # rich redirects sys.stdout/err above the spinner
        readers = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout), daemon=True),
                   threading.Thread(target=_pump, args=(proc.stderr, sys.stderr), daemon=True)]
        for reader in readers:
            reader.start()
        try:
            while proc.poll() is None:
                status.update(f"{label} ... {time.monotonic() - start:.0f} s")
                time.sleep(0.2)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            return 130
        for reader in readers:
            reader.join()
    return proc.returncode


def _pump(src: IO[str], dst: IO[str]) -> None:
    for line in src:
        dst.write(line)
        dst.flush()


if __name__ == "__main__":
    raise SystemExit(main())
