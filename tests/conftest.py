"""Shared test settings: paths and the hypothesis profile (CI: 2 cores, keep it quick)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "traces"
HARDWARE = TRACES / "hardware"

settings.register_profile("tide", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tide")
