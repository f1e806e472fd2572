"""Hugging Face Trainer with tide (issue 20): the same losses and parameters as the plain Trainer,
offloading forced, gradient accumulation and clipping by the engine, checkpoint at step 10 resumes
to the same step-20 parameters, and the saved model reloads with from_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import executor  # noqa: E402
from executor.integrations.hf import ENGINE_CHECKPOINT, TideTrainer  # noqa: E402
from planner.cli import main as planner_main  # noqa: E402
from schemas.schedule import Channel, Op, Schedule, Tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS, BATCH, SEQ, ACCUM, VOCAB = 20, 2, 16, 2, 64


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ))


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS * BATCH * ACCUM, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def solve_forced(model: torch.nn.Module, batch: dict, workdir: Path) -> Path:
    """Record `model` (left untouched) and solve with a DEVICE budget of the non-model peak plus half
    the model data (as `python -m executor demo` does), so chunks must be offloaded."""
    trace = executor.record(model, batch, timing_iterations=1)
    trace_path, schedule_path = workdir / "trace.msgpack", workdir / "schedule.msgpack"
    trace.write(trace_path)
    model_bytes = sum(p.numel() for p in model.parameters()) * 16
    budget_gb = (max(m.non_model_bytes for m in trace.moments) + model_bytes // 2) / 1e9
    # `python -m planner solve` as its main(), in this process: a child would only add ~2 s of imports
    assert planner_main(["solve", str(trace_path), "--device-memory-gb", f"{budget_gb:.6f}", "--no-checkpoint-offload",
                         "--no-optimizer-overlap", "-o", str(schedule_path)]) == 0
    return schedule_path


def arguments(out: Path, **overrides) -> TrainingArguments:
    kw = dict(output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
              max_steps=STEPS, learning_rate=3e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=3, logging_steps=1,
              save_strategy="steps", save_steps=10, report_to=[], use_cpu=True, seed=0, optim="adamw_torch_fused",
              disable_tqdm=True)
    return TrainingArguments(**{**kw, **overrides})


def losses(trainer: Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def assert_close(a: dict, b: dict, rtol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol * max(1.0, b[k].abs().max().item()), msg=k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    data = dataset()
    plain_model = tiny_llama()
    plain = Trainer(model=plain_model, args=arguments(tmp / "plain"), train_dataset=data)
    plain.train()

    model = tiny_llama()
    schedule = solve_forced(model, {"input_ids": data[0]["input_ids"].repeat(BATCH, 1),
                                    "labels": data[0]["labels"].repeat(BATCH, 1)}, tmp)
    tide = TideTrainer(model=model, args=arguments(tmp / "tide"), train_dataset=data, schedule=schedule)
    tide.train()
    return dict(tmp=tmp, data=data, schedule=schedule, plain=plain, plain_model=plain_model, tide=tide)


def test_trainer_with_tide_matches_the_plain_trainer_with_offloading_forced(runs):
    schedule = Schedule.read(runs["schedule"])
    assert any(a.op is Op.EVICT and a.src is Tier.DEVICE for a in schedule.actions)
    tide = runs["tide"]
    assert tide.engine.stats().bytes_per_channel.get(Channel.H2D, 0) > 0
    plain_losses, tide_losses = losses(runs["plain"]), losses(tide)
    assert len(plain_losses) == len(tide_losses) == STEPS
    torch.testing.assert_close(torch.tensor(tide_losses), torch.tensor(plain_losses), rtol=1e-6, atol=0)
    assert not torch.equal(tiny_llama().model.norm.weight, runs["plain_model"].model.norm.weight)  # it trained
    lrs = [e["learning_rate"] for e in tide.state.log_history if "learning_rate" in e]
    assert lrs == [e["learning_rate"] for e in runs["plain"].state.log_history if "learning_rate" in e]
    assert_close(tide.engine.state_dict()["model"], runs["plain_model"].state_dict())


def test_checkpoint_at_step_10_resumes_to_the_same_step_20_params(runs):
    checkpoint = runs["tmp"] / "tide" / "checkpoint-10"
    assert (checkpoint / ENGINE_CHECKPOINT).is_file() and (checkpoint / "scheduler.pt").is_file()
    model = tiny_llama()
    resumed = TideTrainer(model=model, args=arguments(runs["tmp"] / "resumed"), train_dataset=runs["data"],
                          schedule=runs["schedule"])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert_close(resumed.engine.state_dict()["model"], runs["tide"].engine.state_dict()["model"], rtol=0)
    torch.testing.assert_close(torch.tensor(losses(resumed)[-10:]), torch.tensor(losses(runs["tide"])[-10:]),
                               rtol=0, atol=0)


def test_saved_model_reloads_with_from_pretrained(runs):
    out = runs["tmp"] / "saved"
    runs["tide"].save_model(str(out))
    reloaded = LlamaForCausalLM.from_pretrained(str(out))
    assert_close(reloaded.state_dict(), runs["plain_model"].state_dict())


def test_trainer_refuses_its_own_optimizer_and_evaluation(runs, tmp_path):
    model = tiny_llama()
    with pytest.raises(executor.errors.ExecutorError, match="the engine's optimizer is the Trainer's"):
        TideTrainer(model=model, args=arguments(tmp_path), train_dataset=runs["data"], schedule=runs["schedule"],
                    optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=SEQ))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ))


@pytest.mark.parametrize("build", [_gpt2, _qwen2], ids=["gpt2", "qwen2"])
def test_other_families_from_a_local_save_train_like_the_plain_trainer(build, tmp_path):
    """GPT-2 and Qwen2 built from configs, saved with save_pretrained and reloaded from the local dir."""
    torch.manual_seed(0)
    original = build()
    original.save_pretrained(tmp_path / "local")
    cls = type(original)
    data = dataset()[: 4 * BATCH]

    def arguments4(out: Path) -> TrainingArguments:
        return arguments(out, gradient_accumulation_steps=1, max_steps=4, save_strategy="no")

    plain_model = cls.from_pretrained(tmp_path / "local")
    plain = Trainer(model=plain_model, args=arguments4(tmp_path / "plain"), train_dataset=data)
    plain.train()
    model = cls.from_pretrained(tmp_path / "local")
    batch = {k: torch.stack([data[i][k] for i in range(BATCH)]) for k in ("input_ids", "labels")}
    schedule = solve_forced(model, batch, tmp_path)
    tide = TideTrainer(model=model, args=arguments4(tmp_path / "tide"), train_dataset=data, schedule=schedule)
    tide.train()
    torch.testing.assert_close(torch.tensor(losses(tide)), torch.tensor(losses(plain)), rtol=1e-6, atol=0)
    assert_close(tide.engine.state_dict()["model"], plain_model.state_dict())
