"""Shared test settings: paths, one torch thread, the hypothesis profile (CI: 2 cores, keep it quick)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "traces"
HARDWARE = TRACES / "hardware"

# One intra-op thread in every test process and every child it starts (torch reads OMP_NUM_THREADS when
# it is first imported, after this file): the README runs `pytest -n 2 --dist loadgroup` on 2 cores, so a second
# OpenMP thread per worker only spins against the other worker. Measured on this 2-core box at load
# ~8 (other jobs beside the suite): the HF Trainer fixture of tests/test_integrations_hf.py took 84 s
# with 2 threads, 3 s with 1 (its module fixture ran before the function-scoped `one_torch_thread`),
# and the suite's tests that set no thread count ran at the same disadvantage. A user who sets
# OMP_NUM_THREADS keeps theirs.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # a plugin imported torch before this file: tell it directly
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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


# Under `pytest -n 2 --dist loadgroup` (the README's command) each of these modules runs on one xdist
# worker: its tests share an expensive setup (a module-scoped fixture or a functools.cache: a torchrun
# launch, an HF Trainer run, solves several tests read, recorded models) that would otherwise run
# once on each worker that gets one of its tests.
SHARED_SETUP_MODULES = frozenset({
    "test_activations_engine", "test_diff_solved", "test_distributed", "test_executor_distributed",
    "test_executor_overlap", "test_executor_planner", "test_golden", "test_integrations_hf", "test_record",
    "test_solve",
})

# The longest single tests (tens of seconds each; `pytest --durations`, bench/RESULTS.md "The test
# suite"), handed out first so that no worker is left alone with one of them at the end. Only modules
# without a module-scoped fixture: moving their tests apart from their siblings costs nothing.
LONGEST_FIRST = (
    "tests/test_golden.py::test_committed_golden_schedules_are_current",
    "tests/test_kill.py::test_killed_training_resumes_bit_identically",
    "tests/test_examples.py::",
    "tests/test_executor_demo.py::",
    "tests/test_gpu_kit.py::test_dry_run_writes_json_and_summary_with_every_gpu_step_skipped",
    "tests/test_schemas_roundtrip.py::test_schedule_msgpack_round_trip",
    "tests/test_schemas_roundtrip.py::test_trace_msgpack_round_trip",
    "tests/test_executor_nodes.py::",
    "tests/test_optim_async.py::test_async_mode_is_exactly_one_step_stale_and_differs_from_sync",
    "tests/test_import_boundary.py::test_executor_never_imports_planner",
    "tests/test_schemas_roundtrip.py::test_hardware_toml_round_trip",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        if module in SHARED_SETUP_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))

    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: every other test keeps its place
