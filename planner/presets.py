"""Hardware profiles by name or path; the embedded default.

`--hardware` takes a TOML path or the name of a preset in `traces/hardware/` (e.g. `rtx4090-128g`).
With no `--hardware` the planner uses DEFAULT_HARDWARE, the `cpu-emulated` preset: the machine
class CI and the README's quickstart run on (2 cores, 24 GB, DEVICE emulated by a 1 GB CPU pool),
so that `python -m planner solve traces/gpt-small.msgpack` plans something the executor can replay
right here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from planner.errors import PlannerError
from schemas import Hardware, Schedule

PRESET_DIR = Path(__file__).resolve().parent.parent / "traces" / "hardware"
DEFAULT_HARDWARE = "cpu-emulated"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def resolve_hardware(spec: str | None) -> Hardware:
    """A Hardware from a path, a preset name, or None (the default preset)."""
    spec = spec or DEFAULT_HARDWARE
    path = Path(spec)
    if path.suffix == ".toml" or path.exists():
        return Hardware.read(path)
    preset = PRESET_DIR / f"{spec}.toml"
    if not preset.exists():
        raise PlannerError(f"hardware {spec!r}: no such file and no such preset; presets: {', '.join(preset_names())}")
    return Hardware.read(preset)


def hardware_for(schedule: Schedule, spec: str | None, *, source: str) -> Hardware:
    """The hardware to replay `schedule` on: `spec` if given, else the preset its header names; a
    warning on stderr when it is not the hardware the schedule was solved for."""
    name = schedule.header.hardware_name
    if spec:
        hardware = resolve_hardware(spec)
    elif (PRESET_DIR / f"{name}.toml").exists():
        hardware = resolve_hardware(name)
    else:
        raise PlannerError(f"{source}: solved for hardware {name!r}, which is not a preset; pass --hardware NAME|FILE")
    if hardware.digest != schedule.header.hardware_digest:
        print(f"warning: hardware {hardware.name!r} differs from the one the schedule was solved for "
              f"({name!r}, digest {schedule.header.hardware_digest[:19]}...)", file=sys.stderr)
    return hardware
