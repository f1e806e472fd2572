"""Golden schedules: CI fails when the planner's output changes without `python -m planner.golden --write`."""

from __future__ import annotations

import functools
import importlib.util
import io
import shutil

import pytest

from planner import golden

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("planner.solve") is None, reason="planner.solve has not landed yet"),
    pytest.mark.skipif(not all(c.trace_path.exists() for c in golden.CASES), reason="shipped traces missing"),
    pytest.mark.usefixtures("solve_each_case_once"),
]

_regenerate = functools.cache(golden.regenerate)


@pytest.fixture
def solve_each_case_once(monkeypatch):
    """golden.regenerate solves a case once per worker: each test here checks CASES[0] (and the full
    check every case) through golden.check/write, and the solver is deterministic (the full check's
    byte-identical comparison is what proves it). tests/conftest.py keeps this module on one worker."""
    monkeypatch.setattr(golden, "regenerate", _regenerate)


@pytest.mark.slow  # ~20 s: solves every golden case, as CI must
def test_committed_golden_schedules_are_current():
    out = io.StringIO()
    code = golden.check(out=out)
    assert code == 0, "golden schedules differ from the planner's output; if intended run " \
                      "`python -m planner.golden --write`:\n" + out.getvalue()


def test_a_changed_schedule_fails_with_its_diff(tmp_path):
    case = golden.CASES[0]  # the small real trace: fast
    other = golden.GoldenCase(name=case.name, trace=case.trace, hardware=case.hardware,
                              device_memory_gb=(case.device_memory_gb or 1.0) * 2)
    (tmp_path / f"{case.name}{golden.SUFFIX}").write_bytes(golden.regenerate(other))
    out = io.StringIO()
    assert golden.check((case,), golden_dir=tmp_path, out=out) == 1
    text = out.getvalue()
    assert f"FAIL {case.name}: changed" in text
    assert "budget DEVICE" in text and "python -m planner.golden --write" in text


def test_missing_and_stale_files_fail(tmp_path):
    case = golden.CASES[0]
    shutil.copy(case.golden_path, tmp_path / "old-name.schedule.msgpack")
    out = io.StringIO()
    assert golden.check((case,), golden_dir=tmp_path, out=out) == 1
    assert "missing" in out.getvalue() and "old-name.schedule.msgpack: no case" in out.getvalue()


def test_write_then_check_passes(tmp_path):
    case = golden.CASES[0]
    assert golden.write((case,), golden_dir=tmp_path, out=io.StringIO()) == 0
    assert golden.check((case,), golden_dir=tmp_path, out=io.StringIO()) == 0


def test_the_header_says_which_bound_is_proven():
    """Note [CPU Adam beside copies, in the model]: up to 64 blocks (GPT-3 13B, 40) the LP charges CPU Adam's time
    lost beside copies and bounds every plan, so its header has no caveat; deeper (GPT-3 175B, 96) the model
    prices every step at the rate with copies, and up to 128 blocks the solve solves the LP at the rate alone for
    the header's bound (Note [the proven bound up to 128 blocks]): no caveat either, and the note says which LP
    the bound is. The committed goldens are the planner's output (the test above)."""
    from schemas import Schedule

    from planner.solve import UNPROVEN_BOUND as caveat
    notes = {c.name: Schedule.read(c.golden_path).header.notes for c in golden.CASES}
    assert not any(caveat in n for n in notes["gpt3-13b.rtx4090-768g-12ssd"])
    assert not any(caveat in n for n in notes["pstar-gpt-4b.rtx4090-768g-12ssd"])  # 64 blocks: the last with the rows
    assert not any(caveat in n for n in notes["gpt3-175b.a100-80g-12ssd"])
    assert any("rate alone charged the time lost beside copies" in n and "proven for every plan" in n
               for n in notes["gpt3-175b.a100-80g-12ssd"])
