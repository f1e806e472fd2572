"""Hugging Face `Trainer` with tide placing the memory: `TideTrainer(schedule=..., model=..., args=...)`.

    trace = executor.record(model, batch)                    # {"input_ids": ..., "labels": ...}
    #  tide solve trace.msgpack --hardware my.toml -o model.schedule.msgpack
    trainer = TideTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                          schedule="model.schedule.msgpack")
    trainer.train()                                          # or train(resume_from_checkpoint=...)
    trainer.save_model(out_dir)                              # -> from_pretrained(out_dir)

What it changes in `Trainer`, and nothing else:
- the optimizer is the engine's (`executor.run(model, schedule, ...)` at construction, with the
  TrainingArguments' lr, betas, eps, weight decay and Trainer's own decay/no-decay param groups),
  seen through `EngineOptimizer`; Trainer's LR scheduler attaches to it as usual;
- gradient accumulation and clipping are the engine's (`grad_accumulation_steps`,
  `grad_clip_norm` = `args.max_grad_norm`): after a micro-step that does not step, `engine.step()`
  replays the OPTIMIZER moment; Trainer's own clipping is skipped (the grads are in chunks) and
  the logged grad_norm is None. Clipping needs every grad before the first step: solve with
  `--no-optimizer-overlap` when `max_grad_norm > 0` (the engine refuses an overlapped schedule);
- the model stays where the engine put it (`Trainer` does not move it);
- checkpoints: the weights are written with `save_pretrained` from the engine's plain state dict,
  the optimizer with `engine.save()` (`tide_engine.pt`, a plain PyTorch checkpoint) beside the
  scheduler; `resume_from_checkpoint` reloads both through `engine.load()`, where Trainer loads its
  optimizer (after building the LR scheduler).
Not supported: evaluation during training (the engine replays one training iteration; evaluate
after `engine.detach()`), DeepSpeed/FSDP/DDP through Trainer (tide's own multi-GPU path is
`torchrun` + `executor.run`), `torch.compile`. Batches must keep the recorded shape, and with
gradient accumulation each epoch's batches must be a multiple of the accumulation steps.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Trainer

import executor
from executor.errors import ExecutorError
from executor.integrations.optimizer import EngineOptimizer

ENGINE_CHECKPOINT = "tide_engine.pt"
SCHEDULER_NAME = "scheduler.pt"  # the name Trainer uses (transformers.trainer.SCHEDULER_NAME)


class TideTrainer(Trainer):
    """A `transformers.Trainer` whose model memory tide places (module docstring)."""

    def __init__(self, *args: Any, schedule: Any, engine_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise ExecutorError("TideTrainer: optimizers=(optimizer, ...) given; the engine's optimizer is the "
                                "Trainer's: pass optimizers=(None, scheduler) or leave it out")
        super().__init__(*args, **kwargs)
        a = self.args
        if a.eval_strategy != "no":
            raise ExecutorError(f"TideTrainer: eval_strategy={a.eval_strategy!r}; evaluation during training is not "
                                "replayed by the engine: set eval_strategy='no' and evaluate after engine.detach()")
        decay = set(self.get_decay_parameter_names(self.model))
        named = list(self.model.named_parameters())
        groups = [{"params": [p for n, p in named if n in decay and p.requires_grad], "weight_decay": a.weight_decay},
                  {"params": [p for n, p in named if n not in decay and p.requires_grad], "weight_decay": 0.0}]
        options = dict(params=[g for g in groups if g["params"]], lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                       eps=a.adam_epsilon, weight_decay=a.weight_decay,
                       grad_clip_norm=a.max_grad_norm if a.max_grad_norm and a.max_grad_norm > 0 else None,
                       grad_accumulation_steps=a.gradient_accumulation_steps)
        options.update(engine_kwargs or {})
        self.engine = executor.run(self.model, schedule, **options)
        self.optimizer = EngineOptimizer(self.engine)
        self._micro_steps = 0

    # -- the loop --------------------------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        return self.optimizer

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro_steps += 1
        n = self.args.gradient_accumulation_steps
        if not self.accelerator.sync_gradients:
            self.engine.step()  # a micro-step: the engine replays the OPTIMIZER moment, grads accumulate
        elif self._micro_steps != n:
            raise ExecutorError(f"TideTrainer: an optimizer step after {self._micro_steps} micro-batches, expected "
                                f"gradient_accumulation_steps={n}; make the batches per epoch a multiple of {n} "
                                "(or set max_steps so no epoch ends mid-step)")
        else:
            self._micro_steps = 0  # Trainer's optimizer.step() comes next: the engine's N-th micro-step
        return loss

    def _clip_grad_norm(self, model: Any) -> None:
        return None  # the engine clips (grad_clip_norm), across every tier

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> None:
        return None  # the grads live in chunks, not in param.grad

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        return None  # the engine placed the params

    # -- checkpoints -----------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None:
            state_dict = self.engine.state_dict()["model"]
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.args.should_save:
            self.engine.save(os.path.join(output_dir, ENGINE_CHECKPOINT))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        path = os.path.join(resume_from_checkpoint, ENGINE_CHECKPOINT)
        if not os.path.isfile(path):
            raise ExecutorError(f"TideTrainer: {path} not found; resume from a checkpoint a TideTrainer saved "
                                "(it holds the engine's model and optimizer state)")
        # loaded in _load_optimizer_and_scheduler, where Trainer loads an optimizer: after the LR scheduler
        # is built (building it resets the groups' lr, which the checkpoint then restores)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.engine.load(os.path.join(checkpoint, ENGINE_CHECKPOINT))  # model, moments, step counts, groups' lr
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))


__all__ = ["ENGINE_CHECKPOINT", "TideTrainer"]
