"""The engine with world_size > 1 (issue 9): `executor.run` under torchrun, 2 ranks, gloo on the CPU.

A world_size=2 schedule is planned here (the test imports the planner; the executor and the torchrun
script do not) for the shipped gpt-small trace, `tests/dist_scripts/train_engine.py` trains 10 steps
on every rank with its half of each global batch, and the result is compared with one plain PyTorch
process on the same global batches (tests/test_distributed.py `plain_run`): same parameters (fp32,
<= 1e-6 relative), INTER_GPU bytes per rank and iteration == the schedule's prediction, and the
checkpoint the 2 ranks wrote at step 5 loads into a 1-process engine that continues identically.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import executor
import executor.errors
from conftest import REPO
from executor import state
from executor.models import build_model, make_batch, model_spec
from schemas.schedule import Channel, Op
from test_distributed import LR, SAVE_AT, launch_two_ranks, STEPS, WEIGHT_DECAY, max_relative, needs_gloo, plain_run, schedule_for

SCRIPT = REPO / "tests" / "dist_scripts" / "train_engine.py"


@pytest.fixture(scope="module")
def two_rank_engine(tmp_path_factory):
    return launch_two_ranks(SCRIPT, Path(tmp_path_factory.mktemp("engine_two_ranks")))


@needs_gloo
def test_two_rank_engine_trains_like_one_plain_process(two_rank_engine) -> None:
    tmp, schedule, init = two_rank_engine
    assert any(a.op is Op.ALL_GATHER for a in schedule.actions) and schedule.header.world_size == 2
    reference, losses = plain_run(init, range(STEPS))
    final = state.load(tmp / "final.pt")
    assert max_relative(final["model"], reference.state_dict()) <= 1e-6
    assert max_relative(final["model"], init) > 1e-3  # it did train
    ranks = [json.loads((tmp / f"stats_rank{r}.json").read_text()) for r in range(2)]
    for step, want in enumerate(losses):  # the ranks' mean loss is the global batch's
        got = sum(r["iterations"][step]["loss"] for r in ranks) / 2
        assert got == pytest.approx(want, rel=1e-5)


@needs_gloo
def test_inter_gpu_bytes_per_rank_equal_the_prediction(two_rank_engine) -> None:
    tmp, schedule, _ = two_rank_engine
    predicted = schedule.prediction.bytes_per_channel[Channel.INTER_GPU]
    assert predicted > 0
    for r in range(2):
        stats = json.loads((tmp / f"stats_rank{r}.json").read_text())
        assert [it["bytes_per_channel"].get(Channel.INTER_GPU.value, 0) for it in stats["iterations"]] == \
            [predicted] * STEPS


@needs_gloo
def test_checkpoint_of_two_ranks_continues_identically_in_one_process(two_rank_engine, tmp_path) -> None:
    tmp, _, init = two_rank_engine
    one = schedule_for(tmp_path, 1)
    spec = model_spec("gpt-small")
    model = build_model(spec, seed=1234)
    engine = executor.run(model, one, params=model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                          grad_accumulation_steps=2, device="cpu")
    engine.load(tmp / f"step{SAVE_AT}.pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the torchrun workers: same kernels, same rounding
    try:
        rows = spec.batch // 2
        for step in range(SAVE_AT, STEPS):  # the global batch as the two ranks' halves, accumulated
            batch = make_batch(spec, seed=100 + step)
            for r in range(2):
                part = slice(r * rows, (r + 1) * rows)
                (model(batch["idx"][part], batch["targets"][part]) / 2).backward()
                engine.step()
    finally:
        torch.set_num_threads(threads)
    reference, _ = plain_run(init, range(STEPS))
    assert max_relative(engine.state_dict()["model"], reference.state_dict()) <= 1e-6
    assert max_relative(engine.state_dict()["model"], state.load(tmp / "final.pt")["model"]) <= 1e-6


def test_gradient_accumulation_with_several_ranks_is_refused_before_anything_is_touched(tmp_path) -> None:
    schedule = schedule_for(tmp_path, 2)
    model = build_model(model_spec("gpt-small"), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(executor.errors.ExecutorError, match="grad_accumulation_steps=2 with world_size=2: not supported"):
        executor.run(model, schedule, grad_accumulation_steps=2, device="cpu")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
