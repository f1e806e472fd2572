"""Write the JSON Schema documents from the dataclasses: `python -m schemas.generate [--check]`."""

from __future__ import annotations

import argparse
import json
import sys

from schemas._base import SCHEMA_DIR, atomic_write_bytes, json_schema
from schemas.hardware import HARDWARE_FORMAT, HARDWARE_VERSION, Hardware
from schemas.schedule import SCHEDULE_FORMAT, SCHEDULE_VERSION, Schedule
from schemas.trace import TRACE_FORMAT, TRACE_VERSION, Trace

DOCUMENTS = {
    "trace.schema.json": (Trace, TRACE_FORMAT, TRACE_VERSION, "tide trace: one recorded training iteration"),
    "hardware.schema.json": (Hardware, HARDWARE_FORMAT, HARDWARE_VERSION, "tide hardware profile"),
    "schedule.schema.json": (Schedule, SCHEDULE_FORMAT, SCHEDULE_VERSION, "tide schedule: the plan the executor replays"),
}


# top-level fields a file carries after its dataclass's (schemas/schedule.py: the content digest)
TRAILERS = {
    "schedule.schema.json": {"content_digest": {
        "type": "string", "pattern": "^sha256:[0-9a-f]{64}$",
        "description": "sha256 of the msgpack of every other top-level field, in file order"}},
}


def render(name: str) -> str:
    root, fmt, version, title = DOCUMENTS[name]
    doc = json_schema(root, format_name=fmt, format_version=version, title=title, trailer=TRAILERS.get(name))
    return json.dumps(doc, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schemas.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed document is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name in DOCUMENTS:
        text = render(name)
        path = SCHEMA_DIR / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            atomic_write_bytes(path, text.encode("utf-8"))
    if stale:
        print(f"out of date: {', '.join(stale)}; run `python -m schemas.generate`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
