"""Fine-tune a (tiny) Llama on a text file with Hugging Face `Trainer`, tide placing its memory.

    python examples/finetune_hf.py                                  # the shipped text, 40 steps
    python examples/finetune_hf.py --profile                        # solve for THIS machine (tide profile)
    python examples/finetune_hf.py --steps 4 --quick                # what CI runs (a few seconds)

The five steps a user takes with their own model (swap `build_model` for yours, e.g.
`AutoModelForCausalLM.from_pretrained(local_dir)`):
1. record one training iteration: `executor.record(model, batch)` (the model is left untouched);
2. describe the machine: `tide profile -o my.toml` (or a preset such as cpu-emulated);
3. solve: `tide solve trace.msgpack --hardware my.toml -o schedule.msgpack`;
4. train with `TideTrainer(..., schedule=...)`, saving a checkpoint half way;
5. resume from that checkpoint in a fresh process-like setup and check it lands on the same
   parameters; save with `save_model` and reload with `from_pretrained`.
The tokenizer is bytes (vocabulary 256), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import executor
from executor.integrations.hf import TideTrainer

HERE = Path(__file__).resolve().parent


def build_model(seq: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    return LlamaForCausalLM(config)


def text_dataset(path: Path, seq: int) -> list[dict[str, torch.Tensor]]:
    """Byte tokens in fixed-length windows (tide replays one shape: every batch is the recorded one)."""
    ids = torch.tensor(list(path.read_bytes()), dtype=torch.long)
    rows = ids[: len(ids) // seq * seq].view(-1, seq)
    return [{"input_ids": r, "labels": r} for r in rows]


def tide(*args: str) -> None:
    """`tide ARGS...` (the console script; here through the interpreter running this example)."""
    done = subprocess.run([sys.executable, "-m", "executor.tide", *args, "--quiet"], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"tide {' '.join(args)} failed: {done.stderr.strip()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=HERE / "data" / "harbour.txt")
    p.add_argument("--workdir", type=Path, default=Path("finetune-out"))
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (even: a checkpoint is saved half way)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hardware", default="cpu-emulated", help="a preset name or a TOML (default cpu-emulated)")
    p.add_argument("--profile", action="store_true", help="measure this machine first (tide profile -o my.toml)")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="DEVICE budget for the solver (default: small enough to force offloading)")
    p.add_argument("--quick", action="store_true", help="CI: shorter sequences, a quick profile")
    args = p.parse_args()
    if args.steps < 2 or args.steps % 2:
        p.error("--steps: expected an even number of at least 2")
    if args.quick:
        args.seq, args.batch = 32, 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    data = text_dataset(args.data, args.seq)
    batch = {k: torch.stack([data[i][k] for i in range(args.batch)]) for k in ("input_ids", "labels")}

    # 1. record (the model is left bit-identical: recording's training steps are undone)
    model = build_model(args.seq)
    start = time.perf_counter()
    trace = executor.record(model, batch, timing_iterations=1 if args.quick else 3)
    trace_path = args.workdir / "trace.msgpack"
    trace.write(trace_path)
    print(f"1. recorded {trace.meta.model_name}: {trace.param_count / 1e6:.2f}M params, {len(trace.moments)} moments "
          f"({time.perf_counter() - start:.1f} s) -> {trace_path}")

    # 2. the machine
    hardware = args.hardware
    if args.profile:
        hardware = str(args.workdir / "my.toml")
        tide("profile", "-o", hardware, *(["--quick"] if args.quick else []))
        print(f"2. profiled this machine -> {hardware}")
    else:
        print(f"2. hardware profile: {hardware}")

    # 3. solve; by default a DEVICE budget of the non-model peak + half the model data forces offloading
    budget = args.device_memory_gb or (max(m.non_model_bytes for m in trace.moments) + trace.param_count * 8) / 1e9
    schedule = args.workdir / "schedule.msgpack"
    tide("solve", str(trace_path), "--hardware", hardware, "--device-memory-gb", f"{budget:.6f}",
         "--no-optimizer-overlap", "--no-checkpoint-offload", "-o", str(schedule))
    print(f"3. solved for a DEVICE budget of {budget * 1e3:.2f} MB -> {schedule}")

    # 4. fine-tune, checkpoint half way
    def training_args(out: Path) -> TrainingArguments:
        return TrainingArguments(output_dir=str(out), per_device_train_batch_size=args.batch, max_steps=args.steps,
                                 learning_rate=3e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2,
                                 save_strategy="steps", save_steps=args.steps // 2, logging_steps=max(1, args.steps // 4),
                                 report_to=[], use_cpu=not torch.cuda.is_available(), seed=0, disable_tqdm=True)

    trainer = TideTrainer(model=model, args=training_args(args.workdir / "run"), train_dataset=data, schedule=schedule)
    result = trainer.train()
    stats = trainer.engine.stats()
    print(f"4. fine-tuned {args.steps} steps: train loss {result.training_loss:.4f}; bytes moved per iteration "
          f"{ {ch.value: n for ch, n in stats.bytes_per_channel.items() if n} }")

    # 5. resume from the half-way checkpoint, then save and reload
    resumed = TideTrainer(model=build_model(args.seq), args=training_args(args.workdir / "resumed"), train_dataset=data,
                          schedule=schedule)
    resumed.train(resume_from_checkpoint=str(args.workdir / "run" / f"checkpoint-{args.steps // 2}"))
    final, again = trainer.engine.state_dict()["model"], resumed.engine.state_dict()["model"]
    same = all(torch.equal(final[k], again[k]) for k in final)
    out = args.workdir / "model"
    trainer.save_model(str(out))
    reloaded = LlamaForCausalLM.from_pretrained(str(out))
    reloaded_same = all(torch.equal(v, final[k]) for k, v in reloaded.state_dict().items() if k in final)
    print(f"5. resumed from checkpoint-{args.steps // 2}: same step-{args.steps} parameters: {same}; "
          f"saved -> {out}, from_pretrained gives them back: {reloaded_same}")
    return 0 if same and reloaded_same else 1


if __name__ == "__main__":
    raise SystemExit(main())
