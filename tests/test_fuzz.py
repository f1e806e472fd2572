"""Fuzz the readers and CLIs (issue 21, item 6): a seeded sample per format; bench/bench_fuzz.py runs
>= 3000 per format. A failing case replays with `python tests/fuzz.py --format F --seed S --case I`."""

from __future__ import annotations

import pytest

from fuzz import FORMATS, fuzz

CI_CASES = {"trace": 40, "schedule": 40, "hardware": 60, "checkpoint": 60}  # ~60 s in all on 2 busy cores
CI_SEED = 21


@pytest.mark.parametrize("fmt", FORMATS)
def test_mutated_files_are_accepted_or_refused_with_one_line(fmt: str, tmp_path) -> None:
    outcome = fuzz(fmt, seed=CI_SEED, cases=CI_CASES[fmt], folder=tmp_path, timed=False)  # time: bench only
    assert outcome.failures == [], "\n".join(outcome.failures[:10])
    assert sum(n for k, n in outcome.counts.items() if k.endswith("refused")) > 0  # the mutators do break files
