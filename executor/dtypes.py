"""The torch dtype of each `schemas.trace.DType`: the one table the store, the NVME tier and the
collectives build their buffers from."""

from __future__ import annotations

import torch

from schemas.trace import DType

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
}

__all__ = ["TORCH_DTYPES"]
