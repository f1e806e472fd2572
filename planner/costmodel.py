"""The cost model: seconds for bytes on a channel, for FLOPs on the device, and the one price of an
Adam step (`optimizer_step_price`). The simulator (`planner.simulate`) is the only predictor of an
iteration; the placement model's rows (`planner.placement`) use these prices too.

Bandwidths are per rank; with several ranks each rank moves its own share. SSDs without measured
mixed rates are simplex, reads and writes sharing their time (Fuyou Eq. 4, 7); with them, reads and
writes may overlap at the mixed rates (`nvme_time_rows`). The CPU optimizer overlaps backward
(Fuyou §4.3); a DEVICE optimizer step is device compute.

Prices come from what the hardware file measures (issue 17): a meta trace's FLOPs at the GEMM and
attention rates of the shapes the model runs (`moment_seconds`), CPU Adam at the chunk size with the
executor's thread count (and its slower rate while copies run beside it), pageable copy rates for
schedules whose header says their HOST copies are pageable (`header.host_staging`, set by the policy:
DeepSpeed and Gemini, each citing its `pin_memory` default), the both-ways rate while H2D and
D2H run at once, the SSDs' mixed rates behind the host-side cap, and one host DRAM bandwidth that CPU
Adam, the DMA copies and the SSD traffic share (`dram_bytes`).
"""

from __future__ import annotations

import functools
import math

from schemas._base import frozen
from schemas.hardware import DeviceKind, Hardware, rate_at_size
from schemas.schedule import Channel, Tier
from schemas.trace import DType, Moment, Phase, Trace

# tensor-core FP16 and BF16 run at the same rate on Volta-Hopper (NVIDIA A100/H100/Ada datasheets list
# equal dense FP16 and BF16 TFLOPS), so a table measured in one 16-bit type prices the other
_SAME_RATE = {DType.FLOAT16: DType.BFLOAT16, DType.BFLOAT16: DType.FLOAT16}


def nvme_cap_bytes_per_s(hardware: Hardware) -> float:
    """All SSDs together through the host (`nvme.host_cap_gb_per_s`; inf when not given)."""
    cap = hardware.nvme.host_cap_gb_per_s * 1e9
    return cap if cap > 0 else math.inf


def nvme_mixed(hardware: Hardware) -> bool:
    """The file measured the SSDs' rates while reading and writing at once (`nvme.mixed_*`): reads and
    writes are then two servers that slow each other down while both run; otherwise the drives are
    simplex, reads and writes sharing their time (the format's rule for 0, Fuyou Eq. 4)."""
    return hardware.nvme.mixed_read_gb_per_s_each > 0 and hardware.nvme.mixed_write_gb_per_s_each > 0


def _link_gb_per_s(hardware: Hardware, name: str, nbytes: float) -> float:
    """`links.<name>` for one copy of `nbytes` (`links.copy_rates`, where measured at sizes; else flat)."""
    flat = getattr(hardware.links, name)
    rows = hardware.links.copy_rates
    return rate_at_size(rows, name, nbytes, flat) if rows and nbytes > 0 else flat


def _ssd_gb_per_s(hardware: Hardware, name: str, nbytes: float) -> float:
    """`nvme.<name>` (one SSD) for one read/write of `nbytes` (`nvme.chunk_rates`, where measured; else flat)."""
    flat = getattr(hardware.nvme, name)
    rows = hardware.nvme.chunk_rates
    return rate_at_size(rows, name, nbytes, flat) if rows and nbytes > 0 else flat


def channel_bytes_per_s(hardware: Hardware, channel: Channel, *, pageable: bool = False, duplex: bool = False,
                        mixed: bool = False, nbytes: float = 0.0) -> float:
    """Bandwidth of a byte channel (0.0 when the machine has no such path, e.g. no SSD).

    NVMe: count x per-SSD rate, at most the host-side cap; `mixed`: the rate while the other direction
    runs too (`nvme.mixed_*`, where measured), both directions together at most the cap. H2D/D2H:
    pinned by default; `pageable` at the pageable rate, `duplex` at the rate while the other direction
    runs too (each only where the file measured it: 0 there means "as pinned / full duplex", the
    format's rule). `nbytes`: the size of one copy (a chunk of one list, a block's activations): each
    rate is then the one the file measured at that size (`links.copy_rates`, `nvme.chunk_rates`,
    interpolated in log size); 0 or no table: the flat fields, the same for every size."""
    if channel in (Channel.H2D, Channel.D2H):
        h2d = channel is Channel.H2D
        rate = _link_gb_per_s(hardware, "h2d_gb_per_s" if h2d else "d2h_gb_per_s", nbytes) * 1e9
        if pageable:
            slow = _link_gb_per_s(hardware, "h2d_pageable_gb_per_s" if h2d else "d2h_pageable_gb_per_s", nbytes)
            rate = min(rate, slow * 1e9) if slow > 0 else rate
        if duplex:
            both = _link_gb_per_s(hardware, "duplex_h2d_gb_per_s" if h2d else "duplex_d2h_gb_per_s", nbytes)
            rate = min(rate, both * 1e9) if both > 0 else rate
        return rate
    if channel in (Channel.NVME_READ, Channel.NVME_WRITE):
        nv = hardware.nvme
        read_alone = nv.count * _ssd_gb_per_s(hardware, "read_gb_per_s_each", nbytes) * 1e9
        write_alone = nv.count * _ssd_gb_per_s(hardware, "write_gb_per_s_each", nbytes) * 1e9
        if mixed and nvme_mixed(hardware):
            # never above a direction's rate alone (a drive does not read faster because it also
            # writes: a profile's mixed figure above it is noise, e.g. a VM disk's cache); the cap holds
            # reads + writes together
            r = min(nv.count * _ssd_gb_per_s(hardware, "mixed_read_gb_per_s_each", nbytes) * 1e9, read_alone)
            w = min(nv.count * _ssd_gb_per_s(hardware, "mixed_write_gb_per_s_each", nbytes) * 1e9, write_alone)
            share = min(1.0, nvme_cap_bytes_per_s(hardware) / (r + w))
            return (r if channel is Channel.NVME_READ else w) * share
        alone = read_alone if channel is Channel.NVME_READ else write_alone
        return min(alone, nvme_cap_bytes_per_s(hardware))
    return {Channel.INTER_GPU: hardware.inter_gpu_bytes_per_s}[channel]


def fastest_bytes_per_s(hardware: Hardware, channel: Channel) -> float:
    """The fastest pinned, one-way rate a copy of any size gets on `channel` (`channel_bytes_per_s` at
    each size the file's table measured; without a table the flat rate): what a lower bound may charge."""
    rows = (hardware.links.copy_rates if channel in (Channel.H2D, Channel.D2H)
            else hardware.nvme.chunk_rates if channel in (Channel.NVME_READ, Channel.NVME_WRITE) else ())
    if not rows:
        return channel_bytes_per_s(hardware, channel)
    return max(channel_bytes_per_s(hardware, channel, nbytes=r.chunk_bytes) for r in rows)


def two_way_facets(r: float, w: float, mr: float, mw: float, cap: float = math.inf) -> dict[str, tuple[float, float]]:
    """The rows of `two_way_rows` that charge both directions (a > 0 and b > 0), by a name that does not
    depend on the rates: "first" (1/r, (1 - mr/r)/mw), "second" ((1 - mw/w)/mr, 1/w) where running
    both at once pays, both the simplex row (1/r, 1/w) where it does not (mr, mw 0: never at once),
    "cap" (1/cap, 1/cap) under a cap on both together. The simulator keeps one `sim_state.Calendar`
    per name and link (Note [two-way links in the simulator] in planner/sim_actions.py): the names
    stay the same at every copy size, whose rates differ. A facet whose coefficient of one direction
    is 0 (both-ways rates equal to the rates alone: full duplex) is that direction's own server."""
    if r <= 0 or w <= 0:
        return {}
    if mr <= 0 or mw <= 0 or mr / r + mw / w <= 1:
        out = {"first": (1 / r, 1 / w), "second": (1 / r, 1 / w)}
    else:
        out = {"first": (1 / r, (1 - mr / r) / mw), "second": ((1 - mw / w) / mr, 1 / w)}
    if math.isfinite(cap):
        out["cap"] = (1 / cap, 1 / cap)
    return {k: (a, b) for k, (a, b) in out.items() if a > 0 and b > 0}


def two_way_rows(r: float, w: float, mr: float, mw: float, cap: float = math.inf) -> tuple[tuple[float, float], ...]:
    """Linear rows (seconds per byte one way, per byte the other way) whose max is the least time a
    link that moves R bytes one way at r alone and W the other way at w alone, or both at once at mr
    and mw (0: not measured, never at once: simplex), needs: t >= a*R + b*W for each row.

    The link spends time x on R alone, y on W alone and z on both: R = x r + z mr, W = y w + z mw,
    minimize x + y + z. That LP's value is the max over its dual's vertices (LP duality): (1/r, 0),
    (0, 1/w), and (1/r, 1/w) when mr/r + mw/w <= 1 (running both at once never pays: the simplex
    sum, Fuyou Eq. 4), else (1/r, (1 - mr/r)/mw) and ((1 - mw/w)/mr, 1/w); with a cap on both
    together also (1/cap, 1/cap) (`two_way_facets`). The simulator charges every copy in each of these
    rows (Note [two-way links in the simulator] in planner/sim_actions.py), so no replay beats them
    over any interval. Only rows no other row dominates are returned."""
    if r <= 0 or w <= 0:
        return ()
    rows = [(1 / r, 0.0), (0.0, 1 / w), *two_way_facets(r, w, mr, mw, cap).values()]
    rows = list(dict.fromkeys(rows))
    return tuple(x for x in rows if not any(y != x and y[0] >= x[0] and y[1] >= x[1] for y in rows))


def _nvme_rates(hardware: Hardware, nbytes: float) -> tuple[float, float, float, float, float]:
    """(read, write alone; read, write while both run, 0 where not measured; the host cap)."""
    mixed = nvme_mixed(hardware)
    return (channel_bytes_per_s(hardware, Channel.NVME_READ, nbytes=nbytes),
            channel_bytes_per_s(hardware, Channel.NVME_WRITE, nbytes=nbytes),
            channel_bytes_per_s(hardware, Channel.NVME_READ, mixed=True, nbytes=nbytes) if mixed else 0.0,
            channel_bytes_per_s(hardware, Channel.NVME_WRITE, mixed=True, nbytes=nbytes) if mixed else 0.0,
            nvme_cap_bytes_per_s(hardware))


def _pcie_rates(hardware: Hardware, pageable: bool, nbytes: float) -> tuple[float, float, float, float]:
    """(H2D, D2H alone; H2D, D2H both ways at once, 0 where not measured: full duplex)."""
    h, d = (channel_bytes_per_s(hardware, ch, pageable=pageable, nbytes=nbytes) for ch in (Channel.H2D, Channel.D2H))
    links = hardware.links
    if links.duplex_h2d_gb_per_s <= 0 or links.duplex_d2h_gb_per_s <= 0:
        return h, d, 0.0, 0.0
    hb, db = (channel_bytes_per_s(hardware, ch, pageable=pageable, duplex=True, nbytes=nbytes)
              for ch in (Channel.H2D, Channel.D2H))
    return h, d, hb, db


def nvme_time_rows(hardware: Hardware, *, nbytes: float = 0.0) -> tuple[tuple[float, float], ...]:
    """`two_way_rows` of the SSDs (seconds per read byte, per write byte): rates alone behind the host
    cap, the mixed rates (`nvme.mixed_*`, both under the cap) where measured, else simplex; each at
    the size of one read/write `nbytes` (`channel_bytes_per_s`)."""
    return two_way_rows(*_nvme_rates(hardware, nbytes))


def nvme_two_way_facets(hardware: Hardware, *, nbytes: float = 0.0) -> dict[str, tuple[float, float]]:
    """`two_way_facets` of the SSDs where they read and write at once (`nvme_mixed`; simplex SSDs are
    one server in the simulator, which their rows already describe): (per read byte, per write byte)."""
    return two_way_facets(*_nvme_rates(hardware, nbytes)) if nvme_mixed(hardware) else {}


def pcie_time_rows(hardware: Hardware, *, pageable: bool = False, nbytes: float = 0.0) -> tuple[tuple[float, float], ...]:
    """`two_way_rows` of the PCIe link (seconds per H2D byte, per D2H byte): each direction at its
    rate alone, both at once at the `links.duplex_*` rates where measured; not measured: full duplex
    (two rows, each direction on its own); each at the size of one copy `nbytes` (`channel_bytes_per_s`)."""
    h, d, hb, db = _pcie_rates(hardware, pageable, nbytes)
    if hb <= 0 or db <= 0:
        return two_way_rows(h, d, h, d)  # full duplex: the one-way rows alone
    return two_way_rows(h, d, hb, db)


def pcie_two_way_facets(hardware: Hardware, *, pageable: bool = False, nbytes: float = 0.0) -> dict[str, tuple[float, float]]:
    """`two_way_facets` of the PCIe link (per H2D byte, per D2H byte); none when full duplex."""
    h, d, hb, db = _pcie_rates(hardware, pageable, nbytes)
    return two_way_facets(h, d, hb, db) if hb > 0 and db > 0 else {}


def device_capacity_bytes(hardware: Hardware) -> int:
    """DEVICE bytes a plan may fill: the usable fraction less the allocator margin (`memory_margin_gb`)."""
    return max(0, hardware.device_bytes - hardware.device_margin_bytes)


def cpu_adam_threads(hardware: Hardware, *, overlapped: bool) -> int:
    """Threads the executor's CPU optimizer steps with (executor/stepping.py `_setup_cpu_steps`): every
    core on a GPU machine (the cores are free while the GPU computes); on an emulated DEVICE the
    backward computes on the same cores, so a step overlapped with backward runs on the optimizer
    worker with half of them (`max(1, cores // 2)`) and a step at the OPTIMIZER moment on the training
    thread with all of them."""
    cores = hardware.host.cores
    if overlapped and hardware.device.kind is DeviceKind.CPU_EMULATED:
        return max(1, cores // 2)
    return cores


def cpu_adam_params_per_s(hardware: Hardware, *, with_copies: bool = False, threads: int | None = None,
                          mixed_precision: bool = False) -> float:
    """Fused CPU Adam at the chunk size the file measured (`host.adam_chunk_params`; one size is
    measured, so every chunk is priced at it), with `threads` threads (default: all the host's cores,
    the CPU optimizer is one per node), at the rate measured with host copies / SSD traffic beside it
    when `with_copies` (findings 2026-11-23: the rate of one chunk-sized tensor, and it falls while
    copies share DRAM). Never faster with copies than alone: copies beside it take DRAM bandwidth and
    cores, so a profile's higher figure with copies is noise (a loaded machine measured 1.47e8 alone
    and 8.33e8 with copies at 2 threads, bench_executor 2026-11-23)."""
    t = hardware.host.cores if threads is None else threads
    alone = hardware.cpu_adam_params_per_s(t, mixed_precision=mixed_precision)
    return min(alone, hardware.cpu_adam_params_per_s(t, with_copies=True, mixed_precision=mixed_precision)) if with_copies else alone


@frozen
class OptimizerPrice:
    """What one Adam step over a chunk costs: seconds on its resource and the host DRAM bytes it draws."""

    seconds: float
    dram_bytes: float  # 0 on DEVICE (HBM is not the host's DRAM)


def optimizer_step_price(hardware: Hardware, tier: Tier, params: float, *, with_copies: bool = False,
                         threads: int | None = None, mixed_precision: bool = False) -> OptimizerPrice:
    """THE price of an Adam step over `params` params of one chunk, used by every caller (simulator,
    placement model, bounds, policies, emit's pacing).

    DEVICE: `device.optimizer_params_per_s` (GPU Adam is HBM-bound; no host DRAM). HOST: fused CPU
    Adam at `threads` threads (default: all cores; `cpu_adam_threads` gives the executor's count) from
    the `host.adam_rates` table at its chunk size, at its rate with copies beside it when
    `with_copies`; it moves `host.adam_dram_bytes_per_param` bytes per param through host DRAM (28 for
    fp32 AdamW), which the callers draw from the shared DRAM bandwidth (`dram_bytes_per_s`).

    `mixed_precision`: the model trains in bf16/fp16 with fp32 masters (`Problem.mixed_precision`; a schedule with a
    MASTER list). A HOST step then also casts the half-precision grads and copies the masters back into
    PARAM (Note [mixed-precision steps in tiles] in executor/optim.py), priced at the profile's
    measured `adam_rates[].mixed_precision_params_per_s` where it has one (the fp32 rate where not: every preset).
    Every policy's steps get this one price: DeepSpeed's ZeRO-3 makes the same two passes on the CPU
    (stage3.py `partition_grads`: `fp32_grad_tensor.copy_(grad_buffer)`, a D2H copy whose dtype
    conversion runs on the CPU; the fp32 -> fp16 partition `copy_` after the step)."""
    if tier is Tier.DEVICE:
        return OptimizerPrice(seconds=params / hardware.device.optimizer_params_per_s, dram_bytes=0.0)
    if tier is Tier.HOST:
        rate = cpu_adam_params_per_s(hardware, with_copies=with_copies, threads=threads, mixed_precision=mixed_precision)
        return OptimizerPrice(seconds=params / rate, dram_bytes=adam_dram_bytes(hardware, params))
    raise ValueError(f"the optimizer runs on DEVICE or HOST, not {tier}")


def cpu_adam_beside_copies(hardware: Hardware, *, threads: int | None = None, mixed_precision: bool = False,
                           params: float = 1.0) -> float:
    """The share of its speed alone a CPU Adam step keeps while copies run on its node (rate with copies / rate
    alone, <= 1; 1 where the file measured no slowdown): the simulator's rule (Note [CPU Adam beside copies] in
    planner/sim_actions.py) and the placement model's (Note [CPU Adam beside copies, in the model]). `params`: the
    step's size (the share is the same at any, up to rounding; the simulator passes its step's)."""
    alone = optimizer_step_price(hardware, Tier.HOST, params, threads=threads, mixed_precision=mixed_precision).seconds
    slowed = optimizer_step_price(hardware, Tier.HOST, params, with_copies=True, threads=threads,
                                  mixed_precision=mixed_precision).seconds
    return min(1.0, alone / slowed) if slowed > 0 else 1.0


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
    return _dram_legs(channels, pageable) * nbytes


@functools.cache  # (the simulator asks once per copy)
def _dram_legs(channels: tuple[Channel, ...], pageable: bool) -> int:
    legs = sum(1 for ch in channels if ch is not Channel.INTER_GPU)
    if pageable and any(ch in (Channel.H2D, Channel.D2H) for ch in channels):
        legs += 2
    return legs


def adam_dram_bytes(hardware: Hardware, params: float) -> float:
    """Host DRAM bytes of CPU Adam over `params` (`host.adam_dram_bytes_per_param`, 28 for fp32 AdamW)."""
    return params * hardware.host.adam_dram_bytes_per_param


def transfer_seconds(hardware: Hardware, channel: Channel, nbytes: float, *, pageable: bool = False,
                     duplex: bool = False, copy_bytes: float = 0.0) -> float:
    """Seconds to move `nbytes` over `channel` in copies of `copy_bytes` each (0: at the flat rates);
    inf when there are bytes but no path."""
    if nbytes <= 0:
        return 0.0
    rate = channel_bytes_per_s(hardware, channel, pageable=pageable, duplex=duplex, nbytes=copy_bytes)
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


def optimizer_seconds(hardware: Hardware, tier: Tier, params: int, *, with_copies: bool = False,
                      threads: int | None = None) -> float:
    """Seconds of Adam over `params` parameters on DEVICE or HOST (`optimizer_step_price`)."""
    return optimizer_step_price(hardware, tier, params, with_copies=with_copies, threads=threads).seconds


def nvme_seconds(hardware: Hardware, read_bytes: float, write_bytes: float) -> float:
    """The least time the SSDs read and write these bytes in (`nvme_time_rows`: simplex drives add
    reads and writes up, Fuyou Eq. 4; drives measured mixed may run both at once). With rates by size
    (`nvme.chunk_rates`) the copies' sizes are not known here: each direction at its fastest size's
    rate, both under the host cap."""
    if read_bytes <= 0 and write_bytes <= 0:
        return 0.0
    if hardware.nvme.chunk_rates:
        r, w = fastest_bytes_per_s(hardware, Channel.NVME_READ), fastest_bytes_per_s(hardware, Channel.NVME_WRITE)
        if r <= 0 or w <= 0:
            return math.inf
        return max(read_bytes / r, write_bytes / w, (read_bytes + write_bytes) / nvme_cap_bytes_per_s(hardware))
    rows = nvme_time_rows(hardware)
    if not rows:
        return math.inf
    return max(a * read_bytes + b * write_bytes for a, b in rows)


__all__ = [
    "OptimizerPrice", "adam_dram_bytes", "attention_flops_per_s", "channel_bytes_per_s",
    "compute_seconds", "cpu_adam_beside_copies", "cpu_adam_params_per_s", "cpu_adam_threads", "device_capacity_bytes", "dram_bytes",
    "dram_bytes_per_s", "fastest_bytes_per_s", "matmul_flops_per_s", "moment_seconds", "nvme_cap_bytes_per_s", "nvme_mixed", "nvme_seconds",
    "nvme_time_rows", "nvme_two_way_facets", "pcie_time_rows", "pcie_two_way_facets", "two_way_facets", "two_way_rows",
    "optimizer_seconds", "optimizer_step_price", "transfer_seconds",
]
