"""tide under the trainers people use: `executor.integrations.hf` (Hugging Face `Trainer`) and
`EngineOptimizer`, the engine's optimizer as a plain `torch.optim.Optimizer` for Accelerate's
`prepare` (executor/integrations/optimizer.py). Nothing here is imported by the rest of the executor."""

from executor.integrations.optimizer import EngineOptimizer

__all__ = ["EngineOptimizer"]
