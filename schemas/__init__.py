"""tide's three file formats: trace, hardware profile, schedule (DESIGN.md §3).

Each format is a JSON Schema document (`schemas/*.schema.json`, the contract), a tree of frozen
dataclasses mirroring it, and IO that validates on every read and before every write. Bad input
raises `FormatError` with one line naming the file, the field path, what was expected and the fix.
"""

from schemas._base import FormatError, atomic_write_bytes, read_bytes, unpack_msgpack
from schemas.hardware import Hardware
from schemas.schedule import Schedule
from schemas.trace import Trace

__all__ = ["FormatError", "Hardware", "Schedule", "Trace", "atomic_write_bytes", "load_any", "sniff_format"]


def sniff_format(path: str) -> str:
    """'trace', 'schedule' or 'hardware' from the file's `format` field (TOML = hardware)."""
    raw = read_bytes("file", path)
    if path.endswith(".toml"):
        return "hardware"
    data = unpack_msgpack("file", path, raw, "pass a tide trace (.msgpack), schedule (.msgpack) or hardware profile (.toml)")
    fmt = data.get("format") if isinstance(data, dict) else None
    kinds = {"tide.trace": "trace", "tide.schedule": "schedule", "tide.hardware": "hardware"}
    if fmt not in kinds:
        raise FormatError("file", path, "format", f"one of {sorted(kinds)}, found {fmt!r}",
                          "pass a tide trace, schedule or hardware profile")
    return kinds[fmt]


def load_any(path: str) -> Trace | Schedule | Hardware:
    kind = sniff_format(path)
    return {"trace": Trace, "schedule": Schedule, "hardware": Hardware}[kind].read(path)
