"""Every single-bit flip of a shipped schedule: does any load and replay differently? (issue 21, item 1)

    PYTHONPATH=. python bench/bench_bitflip.py [SCHEDULE] [--hardware NAME|FILE]

For each bit of the file: flip it, `Schedule.from_msgpack`; a flip must fail to load with one line
(`FormatError`, no newline) or load a schedule that replays identically (`simulate` equal). Prints
the counts per outcome, the reasons of the refusals (their field path), and every silent change
(the figure issue 21 asks to be 0). Default schedule: the 18 kB gpt-small golden of the issue.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.presets import resolve_hardware  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from schemas import FormatError, Schedule  # noqa: E402

DEFAULT = REPO / "traces" / "golden" / "gpt-small.cpu-emulated-0.05gb.schedule.msgpack"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schedule", nargs="?", default=str(DEFAULT))
    parser.add_argument("--hardware", help="hardware to replay on (default: the preset in the header)")
    args = parser.parse_args()
    payload = Path(args.schedule).read_bytes()
    original = Schedule.from_msgpack(payload)
    hardware = resolve_hardware(args.hardware or original.header.hardware_name)
    expected = simulate(original, hardware)
    outcomes: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    silent: list[int] = []
    start = time.perf_counter()
    for bit in range(len(payload) * 8):
        flipped = bytearray(payload)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            schedule = Schedule.from_msgpack(bytes(flipped), source="flipped")
        except FormatError as exc:
            if "\n" in str(exc):
                outcomes["refused, several lines"] += 1
            else:
                outcomes["refused, one line"] += 1
            reasons[exc.path or "(whole file)"] += 1
            continue
        except Exception as exc:  # noqa: BLE001 - the bench counts what the tests forbid
            outcomes[f"crashed ({type(exc).__name__})"] += 1
            continue
        if schedule == original:
            outcomes["loaded, same schedule"] += 1
        elif simulate(schedule, hardware) == expected:
            outcomes["loaded, replays identically"] += 1
        else:
            outcomes["loaded, replays DIFFERENTLY"] += 1
            silent.append(bit)
    seconds = time.perf_counter() - start
    print(f"{args.schedule}: {len(payload)} bytes, {len(payload) * 8} single-bit flips in {seconds:.1f} s")
    for outcome, count in outcomes.most_common():
        print(f"  {outcome:32s} {count}")
    print("  refusals by field:", ", ".join(f"{k} {v}" for k, v in reasons.most_common(6)))
    print(f"silent wrong schedules: {len(silent)}" + (f" (bits {silent[:10]})" if silent else ""))
    return 1 if silent or any(k.startswith(("crashed", "refused, several")) for k in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
