"""Crash consistency proven by killing (issue 21, item 4): a CI-sized run of tests/kill_harness.py.

A training loop with HOST and NVMe offload is SIGKILLed at seeded points (during engine.save before
and after the rename, during an NVMe write-back, during an overlapped CPU optimizer step, between
steps); each resume starts from the newest checkpoint and every checkpoint equals, bit for bit, the
unkilled run's. bench/bench_kill.py runs 200 kills.
"""

from __future__ import annotations

from kill_harness import KINDS, kill_points, run_chain

CI_KILLS = 8  # ~one worker start each; bench/bench_kill.py does 200
CI_SEED = 1


def test_kill_points_cover_every_kind() -> None:
    kinds = {p.split(":")[0] for p in kill_points(CI_SEED, CI_KILLS, 12)}
    assert kinds == set(KINDS), kinds  # the CI seed was picked so that the sample covers every kind


def test_killed_training_resumes_bit_identically(tmp_path) -> None:
    figures = run_chain(tmp_path, kills=CI_KILLS, seed=CI_SEED, log=lambda line: None)
    assert figures["failures"] == [], figures["failures"]
    assert figures["kills"] >= CI_KILLS // 2 and figures["resumes"] >= figures["kills"], figures
    assert figures["mismatches"] == 0 and figures["checkpoints_compared"] >= 6
    assert figures["stale_tmp_left"] == 0
