"""The cost model: seconds for bytes on a channel, for FLOPs on the device, for Adam on a tier,
and the time of a stage as the max over its channels (Fuyou Eq. 2 and 5, §4.5).

Every channel is its own resource and they overlap perfectly inside a stage; the NVMe drives are
simplex, so a stage's NVMe reads and writes share their time (Fuyou Eq. 4, 7). The CPU optimizer
is a channel of its own when it overlaps backward (Fuyou §4.3); a DEVICE optimizer step is device
compute. Bandwidths are per rank; with several ranks each rank moves its own share.

Prices come from what the hardware file measures (issue 17): a meta trace's FLOPs at the GEMM and
attention rates of the shapes the model runs (`moment_seconds`), CPU Adam at the chunk size with the
host's threads (and its slower rate while copies run beside it), pageable copy rates for systems
that stage through pageable memory (`PAGEABLE_POLICIES`), the both-ways rate while H2D and D2H run
at once, the SSDs behind the host-side cap, and one host DRAM bandwidth that CPU Adam, the DMA
copies and the SSD traffic share (`dram_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from schemas._base import frozen
from schemas.hardware import Hardware
from schemas.schedule import Channel, Tier
from schemas.trace import DType, Moment, Phase, Trace

# DeepSpeed allocates its CPU copies in pageable memory unless `pin_memory` is set, and it is off by
# default for offload_param and offload_optimizer (docs/baselines.md Z3.12: `offload_config.py:45,72`;
# Fuyou §5.5: ZeRO-Infinity "uses pageable memories"). Its NVMe path goes through a pinned buffer pool
# (ZI.1, `partitioned_param_swapper.py`), so only DEVICE <-> HOST copies are pageable. Colossal-AI
# Gemini's CPU chunks are pageable too: GeminiPlugin `pin_memory` defaults to False
# (`colossalai/booster/plugin/gemini_plugin.py`; docs/baselines.md GM.8). PatrickStar pins its CPU
# chunks (`patrickstar/core/chunk_data.py:153`, `pin_memory=(device.type == "cpu")`) and Fuyou its
# buffers (Fuyou §5.5), so neither is here.
PAGEABLE_POLICIES = frozenset({"zero2-offload", "zero3-offload", "zero-infinity", "gemini"})

# tensor-core FP16 and BF16 run at the same rate on Volta-Hopper (NVIDIA A100/H100/Ada datasheets list
# equal dense FP16 and BF16 TFLOPS), so a table measured in one 16-bit type prices the other
_SAME_RATE = {DType.FLOAT16: DType.BFLOAT16, DType.BFLOAT16: DType.FLOAT16}


def nvme_cap_bytes_per_s(hardware: Hardware) -> float:
    """All SSDs together through the host (`nvme.host_cap_gb_per_s`; inf when not given)."""
    cap = hardware.nvme.host_cap_gb_per_s * 1e9
    return cap if cap > 0 else math.inf


def channel_bytes_per_s(hardware: Hardware, channel: Channel, *, pageable: bool = False, duplex: bool = False) -> float:
    """Bandwidth of a byte channel (0.0 when the machine has no such path, e.g. no SSD).

    NVMe: count x per-SSD rate, at most the host-side cap. H2D/D2H: pinned by default; `pageable`
    at the pageable rate, `duplex` at the rate while the other direction runs too (each only where the
    file measured it: 0 there means "as pinned / full duplex", the format's rule)."""
    if channel in (Channel.H2D, Channel.D2H):
        links = hardware.links
        rate = hardware.h2d_bytes_per_s if channel is Channel.H2D else hardware.d2h_bytes_per_s
        if pageable:
            slow = links.h2d_pageable_gb_per_s if channel is Channel.H2D else links.d2h_pageable_gb_per_s
            rate = min(rate, slow * 1e9) if slow > 0 else rate
        if duplex:
            both = links.duplex_h2d_gb_per_s if channel is Channel.H2D else links.duplex_d2h_gb_per_s
            rate = min(rate, both * 1e9) if both > 0 else rate
        return rate
    if channel is Channel.NVME_READ:
        return min(hardware.nvme_read_bytes_per_s, nvme_cap_bytes_per_s(hardware))
    if channel is Channel.NVME_WRITE:
        return min(hardware.nvme_write_bytes_per_s, nvme_cap_bytes_per_s(hardware))
    return {Channel.INTER_GPU: hardware.inter_gpu_bytes_per_s}[channel]


def device_capacity_bytes(hardware: Hardware) -> int:
    """DEVICE bytes a plan may fill: the usable fraction less the allocator margin (`memory_margin_gb`)."""
    return max(0, hardware.device_bytes - hardware.device_margin_bytes)


def cpu_adam_params_per_s(hardware: Hardware, *, with_copies: bool = False) -> float:
    """Fused CPU Adam at the chunk size the file measured, with all the host's cores (the CPU optimizer
    is one per node), at the rate measured with host copies / SSD traffic beside it when `with_copies`
    (findings 2026-11-23: the rate of one chunk-sized tensor, and it falls while copies share DRAM)."""
    return hardware.cpu_adam_params_per_s(hardware.host.cores, with_copies=with_copies)


def dram_bytes_per_s(hardware: Hardware) -> float:
    """Host DRAM bandwidth CPU Adam, DMA and SSD traffic share; inf when the file does not give it. Never
    below what the file's own CPU Adam rate already moves (params/s x DRAM bytes per param): a measured
    consumer proves the memory serves at least that (the cpu-emulated profile's 2-thread memcpy figure,
    6.57 GB/s, is below the 32 GB/s its measured fused AdamW moves)."""
    rate = hardware.host_dram_bytes_per_s
    if rate <= 0:
        return math.inf
    return max(rate, cpu_adam_params_per_s(hardware) * hardware.host.adam_dram_bytes_per_param)


def dram_bytes(hardware: Hardware, channels: tuple[Channel, ...], nbytes: float, *, pageable: bool = False) -> float:
    """Host DRAM bytes one copy moves: each leg of its path that ends in host memory (H2D/D2H DMA, an
    SSD read/write) passes the bytes through DRAM once, so DEVICE <-> NVMe through its bounce buffer is
    two passes; a pageable copy is first memcpy'd to the driver's pinned staging buffer (read + write,
    CUDA C++ Best Practices Guide §9.1.1). INTER_GPU never touches host memory."""
    legs = sum(1 for ch in channels if ch is not Channel.INTER_GPU)
    if pageable and any(ch in (Channel.H2D, Channel.D2H) for ch in channels):
        legs += 2
    return legs * nbytes


def adam_dram_bytes(hardware: Hardware, params: float) -> float:
    """Host DRAM bytes of CPU Adam over `params` (`host.adam_dram_bytes_per_param`, 28 for fp32 AdamW)."""
    return params * hardware.host.adam_dram_bytes_per_param


def transfer_seconds(hardware: Hardware, channel: Channel, nbytes: float, *, pageable: bool = False,
                     duplex: bool = False) -> float:
    """Seconds to move `nbytes` over `channel`; inf when there are bytes but no path."""
    if nbytes <= 0:
        return 0.0
    rate = channel_bytes_per_s(hardware, channel, pageable=pageable, duplex=duplex)
    return nbytes / rate if rate > 0 else math.inf


def compute_seconds(hardware: Hardware, flops: float) -> float:
    return flops / hardware.device_flops_per_s


def matmul_flops_per_s(hardware: Hardware, m: int, n: int, k: int, dtype: DType) -> float:
    """GEMM rate of this shape from `device.matmul_rates` (the other 16-bit type's rows when the file
    measured that one), else `compute_tflops`."""
    have = {r.dtype for r in hardware.device.matmul_rates}
    if dtype not in have and _SAME_RATE.get(dtype) in have:
        dtype = _SAME_RATE[dtype]
    return hardware.matmul_flops_per_s(m, n, k, dtype)


def attention_flops_per_s(hardware: Hardware, batch_heads: int, tokens: int, head_dim: int, dtype: DType,
                          *, backward: bool) -> float:
    """Fused-attention rate at (batch x heads, tokens, head_dim): log-log interpolation in
    batch*heads*tokens^2*head_dim over `device.attention_rates` (clamped at the ends; forward or backward
    column, backward falling back to forward when not measured), else `compute_tflops`."""
    rows = [r for r in hardware.device.attention_rates if r.dtype == dtype]
    if not rows and _SAME_RATE.get(dtype) is not None:
        rows = [r for r in hardware.device.attention_rates if r.dtype == _SAME_RATE[dtype]]
    if not rows:
        return hardware.device_flops_per_s
    pts = sorted((r.batch * r.heads * r.tokens ** 2 * r.head_dim,
                  (r.backward_tflops or r.forward_tflops) if backward else r.forward_tflops) for r in rows)
    size = batch_heads * tokens ** 2 * head_dim
    if size <= pts[0][0]:
        return pts[0][1] * 1e12
    if size >= pts[-1][0]:
        return pts[-1][1] * 1e12
    for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
        if s0 <= size <= s1:
            if s1 == s0:
                return max(t0, t1) * 1e12
            w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0))) * 1e12
    return pts[-1][1] * 1e12


def moment_seconds(hardware: Hardware, trace: Trace, moment: Moment) -> float:
    """Device seconds of a meta (FLOP-only) moment at the shapes the model runs.

    The moment's GEMMs are its 2-D parameters applied to the batch's tokens (batch_shape product;
    forward 2*tokens*out*in FLOPs, backward twice that: the input and the weight gradient, Narayanan et
    al. 2021 §5.1), each at the matmul table's rate for (tokens x in) @ (in x out); the FLOPs left over
    are attention (the only other op torch.utils.flop_counter counts in a transformer block), at the
    attention table's rate for (batch x heads, seq, head_dim) from the trace's model config (GPT
    `n_head`/`n_embd`, HF `num_attention_heads`/`hidden_size`). Without tables this is FLOPs /
    `compute_tflops`, as before. Where the 2-D params would account for more than the recorded FLOPs
    (an embedding lookup, a tied head used once), the GEMM time is scaled down to the recorded FLOPs."""
    flops = moment.flops
    if flops <= 0:
        return 0.0
    hw = hardware
    if not hw.device.matmul_rates and not hw.device.attention_rates:
        return flops / hw.device_flops_per_s
    dtype = trace.meta.compute_dtype
    tokens = math.prod(trace.meta.batch_shape) if trace.meta.batch_shape else 1
    backward = moment.phase is Phase.BACKWARD
    per_token = 4 if backward else 2
    gemm_flops = 0.0
    gemm_seconds = 0.0
    for t in moment.tensors:
        shape = trace.tensors[t].shape
        if len(shape) != 2:
            continue
        out_f, in_f = shape
        f = per_token * tokens * out_f * in_f
        gemm_flops += f
        gemm_seconds += f / matmul_flops_per_s(hw, tokens, out_f, in_f, dtype)
    if gemm_flops > flops:  # fewer GEMMs than params suggest (lookups): keep their mean rate
        gemm_seconds *= flops / gemm_flops
        gemm_flops = flops
    rest = flops - gemm_flops
    if rest <= 0:
        return gemm_seconds
    cfg = trace.meta.model_config
    heads = cfg.get("n_head", cfg.get("num_attention_heads"))
    hidden = cfg.get("n_embd", cfg.get("hidden_size"))
    shape = trace.meta.batch_shape
    if not heads or not hidden or len(shape) < 2:
        return gemm_seconds + rest / hw.device_flops_per_s
    batch, seq = math.prod(shape[:-1]), shape[-1]
    rate = attention_flops_per_s(hw, int(batch) * int(heads), int(seq), int(hidden) // int(heads), dtype,
                                 backward=backward)
    return gemm_seconds + rest / rate


def optimizer_seconds(hardware: Hardware, tier: Tier, params: int, *, with_copies: bool = False) -> float:
    """Adam over `params` parameters on DEVICE (GPU Adam) or HOST (fused CPU Adam; `with_copies`: while
    DMA / SSD traffic runs beside it)."""
    if tier is Tier.DEVICE:
        return params / hardware.device.optimizer_params_per_s
    if tier is Tier.HOST:
        return params / cpu_adam_params_per_s(hardware, with_copies=with_copies)
    raise ValueError(f"the optimizer runs on DEVICE or HOST, not {tier}")


def nvme_seconds(hardware: Hardware, read_bytes: float, write_bytes: float) -> float:
    """One simplex device per SSD: reads and writes add up (Fuyou Eq. 4)."""
    return transfer_seconds(hardware, Channel.NVME_READ, read_bytes) + transfer_seconds(hardware, Channel.NVME_WRITE, write_bytes)


@frozen
class StageLoad:
    """Work one stage puts on each resource."""

    compute_seconds: float = 0.0  # forward/backward work on the device
    recompute_seconds: float = 0.0  # forward rerun for RECOMPUTE blocks (in their first backward stage)
    device_optimizer_seconds: float = 0.0  # GPU Adam steps (device compute)
    cpu_optimizer_seconds: float = 0.0  # CPU Adam steps, overlapping the device's work
    bytes_per_channel: Mapping[Channel, int] | None = None


def channel_seconds(hardware: Hardware, load: StageLoad) -> dict[Channel, float]:
    """Busy seconds of each resource for `load` (NVMe reads and writes both charged to the drives)."""
    moved = dict(load.bytes_per_channel or {})
    nvme = nvme_seconds(hardware, moved.get(Channel.NVME_READ, 0), moved.get(Channel.NVME_WRITE, 0))
    return {
        Channel.COMPUTE: load.compute_seconds + load.recompute_seconds + load.device_optimizer_seconds,
        Channel.H2D: transfer_seconds(hardware, Channel.H2D, moved.get(Channel.H2D, 0)),
        Channel.D2H: transfer_seconds(hardware, Channel.D2H, moved.get(Channel.D2H, 0)),
        Channel.NVME_READ: nvme,  # the simplex drives: reads + writes
        Channel.NVME_WRITE: nvme,
        Channel.INTER_GPU: transfer_seconds(hardware, Channel.INTER_GPU, moved.get(Channel.INTER_GPU, 0)),
        Channel.CPU_OPTIMIZER: load.cpu_optimizer_seconds,
    }


def stage_seconds(hardware: Hardware, load: StageLoad) -> float:
    """T_s = max over channels (Fuyou Eq. 2, 5): every resource overlaps the others inside a stage."""
    return max(channel_seconds(hardware, load).values())


__all__ = [
    "PAGEABLE_POLICIES", "StageLoad", "adam_dram_bytes", "attention_flops_per_s", "channel_bytes_per_s",
    "channel_seconds", "compute_seconds", "cpu_adam_params_per_s", "device_capacity_bytes", "dram_bytes",
    "dram_bytes_per_s", "matmul_flops_per_s", "moment_seconds", "nvme_cap_bytes_per_s", "nvme_seconds",
    "optimizer_seconds", "stage_seconds", "transfer_seconds",
]
