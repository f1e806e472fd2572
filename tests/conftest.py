"""Shared test settings: paths and the hypothesis profile (CI: 2 cores, keep it quick)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "traces"
HARDWARE = TRACES / "hardware"

settings.register_profile("tide", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tide")


@pytest.fixture
def one_torch_thread():
    """Tiny models on the 2-core CI box: one intra-op thread (more only make OpenMP spin)."""
    import torch  # here, not at the top: the planner's tests run without torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
