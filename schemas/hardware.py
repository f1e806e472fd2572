"""The hardware format (`tide.hardware`, TOML written by people): one machine's capacities and rates.

Units are in the field names: `_gb` is 10^9 bytes, `_gb_per_s` 10^9 bytes per second, `_tflops`
10^12 FLOP/s. The planner reads the derived byte/second properties; people read the TOML.
Every preset in `traces/hardware/` carries a comment naming the source of each number; a number
whose comment says "tide estimate" has none, and `planner show` / `validate` list those
(`estimated_fields`).

Format version 1 grew optional fields (shape-dependent compute rates, CPU Adam vs threads, DRAM
bandwidth, pageable and bidirectional copies, mixed SSD traffic and a host-side SSD cap, a GPU
memory margin): every one has a default that means "not measured" (0, or an empty table) and
states what a reader assumes then, so every older TOML still loads and means what it meant. The
version stays 1 because nothing an old file says changes meaning; a reader that needs a new field
checks it is non-zero.
"""

from __future__ import annotations

import math
import tomllib
from enum import StrEnum
from pathlib import Path

import tomli_w

from schemas.trace import DType
from schemas._base import (
    FormatError,
    atomic_write_bytes,
    check_numbers,
    check_header,
    check_schema,
    constrained,
    digest_bytes,
    from_plain,
    frozen,
    pack_msgpack,
    read_bytes,
    require,
    to_plain,
)

HARDWARE_FORMAT = "tide.hardware"
HARDWARE_VERSION = 1
_KIND = "hardware profile"
_FIX = "edit the TOML (see traces/hardware/*.toml for commented examples) or re-run `python -m executor profile`"
GB = 1e9


class DeviceKind(StrEnum):
    CUDA = "cuda"  # a real GPU
    CPU_EMULATED = "cpu-emulated"  # a CPU pool standing in for the GPU (CI, laptops)


@frozen
class MatmulRate:
    """One measured GEMM shape: (m x k) @ (k x n) in `dtype`, at `tflops` (2*m*n*k FLOP per call)."""

    dtype: DType
    m: int = constrained(minimum=1)
    n: int = constrained(minimum=1)
    k: int = constrained(minimum=1)
    tflops: float = constrained(exclusiveMinimum=0)  # sustained 10^12 FLOP/s of this shape


@frozen
class AttentionRate:
    """One measured causal attention shape through the fused kernel (SDPA): (batch, heads, tokens, head_dim).

    FLOPs are counted as torch.utils.flop_counter counts SDPA (4*b*h*t^2*d forward, twice that
    backward, causal masking not discounted), so the rate applies to the FLOPs a trace records."""

    dtype: DType
    batch: int = constrained(minimum=1)
    heads: int = constrained(minimum=1)
    tokens: int = constrained(minimum=1)
    head_dim: int = constrained(minimum=1)
    forward_tflops: float = constrained(exclusiveMinimum=0)
    backward_tflops: float = constrained(minimum=0, default=0.0)  # 0: not measured (use forward_tflops)


@frozen
class AdamRate:
    """CPU Adam at `threads` threads on one chunk of `HostSpec.adam_chunk_params` fp32 params."""

    threads: int = constrained(minimum=1)
    params_per_s: float = constrained(exclusiveMinimum=0)  # alone
    params_per_s_with_copies: float = constrained(minimum=0, default=0.0)  # while host memcpy / SSD traffic runs beside it; 0: not measured
    # the executor's mixed-precision step alone (`ChunkAdamW.step_chunk`: half-precision grad cast, the fused kernel
    # over the fp32 master, the copy back into PARAM); 0: not measured (priced as `params_per_s`)
    mixed_precision_params_per_s: float = constrained(minimum=0, default=0.0)


@frozen
class CopyRate:
    """DEVICE <-> HOST copy rates measured with copies of `chunk_bytes` each (a row of `links.copy_rates`);
    each column means what the `links` field of the same name means, 0: not measured at this size."""

    chunk_bytes: int = constrained(minimum=1)
    h2d_gb_per_s: float = constrained(exclusiveMinimum=0)
    d2h_gb_per_s: float = constrained(exclusiveMinimum=0)
    h2d_pageable_gb_per_s: float = constrained(minimum=0, default=0.0)
    d2h_pageable_gb_per_s: float = constrained(minimum=0, default=0.0)
    duplex_h2d_gb_per_s: float = constrained(minimum=0, default=0.0)
    duplex_d2h_gb_per_s: float = constrained(minimum=0, default=0.0)


@frozen
class SsdRate:
    """One SSD's rates measured with reads/writes of `chunk_bytes` each (a row of `nvme.chunk_rates`);
    each column means what the `nvme` field of the same name means, 0: not measured at this size."""

    chunk_bytes: int = constrained(minimum=1)
    read_gb_per_s_each: float = constrained(exclusiveMinimum=0)
    write_gb_per_s_each: float = constrained(exclusiveMinimum=0)
    mixed_read_gb_per_s_each: float = constrained(minimum=0, default=0.0)
    mixed_write_gb_per_s_each: float = constrained(minimum=0, default=0.0)


def rate_at_size(rows: tuple, column: str, nbytes: float, flat: float) -> float:
    """GB/s of `column` for one copy of `nbytes`: linear in log(size) between the rows that measured it
    (value > 0), clamped to the first/last such row outside them; `flat` (the field without a size)
    when no row measured it or no size is given (nbytes <= 0)."""
    pts = sorted((r.chunk_bytes, getattr(r, column)) for r in rows if getattr(r, column) > 0)
    if not pts or nbytes <= 0:
        return flat
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1]
    for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
        if s0 <= nbytes <= s1:
            if s1 == s0:
                return max(v0, v1)
            w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return v0 + w * (v1 - v0)
    return pts[-1][1]  # unreachable: the loop covers [first, last]


@frozen
class DeviceSpec:
    """The accelerator (one per rank)."""

    kind: DeviceKind
    name: str  # marketing name, e.g. "NVIDIA GeForce RTX 4090"
    memory_gb: float = constrained(exclusiveMinimum=0)
    usable_fraction: float = constrained(exclusiveMinimum=0, maximum=1)  # the rest is CUDA context, fragmentation
    compute_tflops: float = constrained(exclusiveMinimum=0)  # sustained rate of transformer blocks in the compute dtype
    optimizer_params_per_s: float = constrained(exclusiveMinimum=0)  # Adam on the device, params per second
    memory_margin_gb: float = constrained(minimum=0, default=0.0)
    """DEVICE memory a plan leaves free for the caching allocator (fragmentation, cuBLAS/attention
    workspaces), on top of `usable_fraction`; 0: none beyond it"""
    matmul_rates: tuple[MatmulRate, ...] = constrained(default=())
    """GEMM throughput by shape, to interpolate (log-log in m*n*k) for each matmul of a trace; empty:
    every FLOP runs at `compute_tflops`"""
    attention_rates: tuple[AttentionRate, ...] = constrained(default=())
    """fused-attention throughput by shape; empty: attention FLOPs run at `compute_tflops`"""


@frozen
class HostSpec:
    """CPU memory and the CPU optimizer (shared by the ranks of a node)."""

    memory_gb: float = constrained(exclusiveMinimum=0)
    usable_fraction: float = constrained(exclusiveMinimum=0, maximum=1)
    optimizer_params_per_s: float = constrained(exclusiveMinimum=0)  # fused CPU Adam, params per second
    cores: int = constrained(minimum=1)
    dram_gb_per_s: float = constrained(minimum=0, default=0.0)
    """host DRAM bandwidth shared by CPU Adam, DMA copies and SSD traffic (reads + writes, GB/s); 0: not
    given (nothing is priced as shared)"""
    adam_chunk_params: int = constrained(minimum=0, default=0)
    """fp32 params per tensor the `adam_rates` were measured on (a chunk: Adam's rate falls once a
    tensor outgrows the caches); 0: not measured"""
    adam_rates: tuple[AdamRate, ...] = constrained(default=())
    """CPU Adam rate vs threads at `adam_chunk_params`; empty: `optimizer_params_per_s` at any thread count"""
    adam_dram_bytes_per_param: float = constrained(minimum=0, default=28.0)
    """DRAM bytes CPU Adam moves per param: 28 for fp32 AdamW (reads param, grad, exp_avg, exp_avg_sq,
    writes param, exp_avg, exp_avg_sq: 7 x 4 B, torch `_fused_adamw_` / DeepSpeed `Step_AVX`)"""


@frozen
class NvmeSpec:
    """SSDs (count 0: none). Each SSD is simplex: its reads and writes share its time."""

    count: int = constrained(minimum=0)
    capacity_gb_each: float = constrained(minimum=0)
    read_gb_per_s_each: float = constrained(minimum=0)
    write_gb_per_s_each: float = constrained(minimum=0)
    usable_fraction: float = constrained(exclusiveMinimum=0, maximum=1)
    mixed_read_gb_per_s_each: float = constrained(minimum=0, default=0.0)
    """read rate of one SSD while it also writes (50/50 sequential, GB/s); 0: not measured (reads and
    writes share the SSD's time at the rates above)"""
    mixed_write_gb_per_s_each: float = constrained(minimum=0, default=0.0)
    """write rate of one SSD while it also reads; 0: not measured"""
    host_cap_gb_per_s: float = constrained(minimum=0, default=0.0)
    """all SSDs together, reads + writes, through the host (PCIe lanes, root complex, RAID/striping,
    page cache); 0: no cap beyond count x per-SSD rates"""
    chunk_rates: tuple[SsdRate, ...] = constrained(default=())
    """the per-SSD rates by the size of one read/write (`rate_at_size`: a copy of that size is priced at
    the interpolated rate instead of the flat field); empty: every size at the flat rates"""


@frozen
class LinkSpec:
    """Transfer paths between tiers and between GPUs."""

    h2d_gb_per_s: float = constrained(exclusiveMinimum=0)
    d2h_gb_per_s: float = constrained(exclusiveMinimum=0)
    inter_gpu_gb_per_s: float = constrained(minimum=0)  # per-GPU bus bandwidth of collectives; 0 with one GPU
    h2d_pageable_gb_per_s: float = constrained(minimum=0, default=0.0)
    """host-to-device copy rate from pageable (not pinned) memory; 0: not measured (all copies pinned)"""
    d2h_pageable_gb_per_s: float = constrained(minimum=0, default=0.0)
    """device-to-host copy rate into pageable memory; 0: not measured"""
    duplex_h2d_gb_per_s: float = constrained(minimum=0, default=0.0)
    """pinned host-to-device rate while a device-to-host copy runs at once; 0: not measured (full duplex,
    each direction at its own rate)"""
    duplex_d2h_gb_per_s: float = constrained(minimum=0, default=0.0)
    """pinned device-to-host rate while a host-to-device copy runs at once; 0: not measured"""
    inter_node_gb_per_s: float = constrained(minimum=0, default=0.0)
    """one node's network bandwidth to the other nodes, one direction (its NIC: 100 Gb/s = 12.5 GB/s),
    shared by the node's `cluster.gpus_per_node` GPUs; 0: one node (required > 0 when
    cluster.world_size > cluster.gpus_per_node)"""
    copy_rates: tuple[CopyRate, ...] = constrained(default=())
    """the DEVICE <-> HOST rates by the size of one copy (`rate_at_size`: a copy of that size is priced
    at the interpolated rate instead of the flat field; small copies pay the per-copy latency);
    empty: every size at the flat rates"""


@frozen
class ClusterSpec:
    """How many ranks train together: `world_size` ranks on world_size / gpus_per_node nodes (a
    multiple of gpus_per_node, or fewer ranks than one node's GPUs)."""

    world_size: int = constrained(minimum=1)
    gpus_per_node: int = constrained(minimum=1)

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def ranks_per_node(self) -> int:
        return min(self.world_size, self.gpus_per_node)


@frozen
class Hardware:
    """A machine's capacities and rates."""

    name: str = constrained(minLength=1)
    description: str
    device: DeviceSpec
    host: HostSpec
    nvme: NvmeSpec
    links: LinkSpec
    cluster: ClusterSpec

    # -- derived (bytes, seconds) ------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """DEVICE capacity the planner may fill, per rank."""
        return int(self.device.memory_gb * GB * self.device.usable_fraction)

    @property
    def host_bytes(self) -> int:
        """HOST capacity the planner may fill, per node."""
        return int(self.host.memory_gb * GB * self.host.usable_fraction)

    @property
    def nvme_bytes(self) -> int:
        return int(self.nvme.count * self.nvme.capacity_gb_each * GB * self.nvme.usable_fraction)

    @property
    def nvme_read_bytes_per_s(self) -> float:
        return self.nvme.count * self.nvme.read_gb_per_s_each * GB

    @property
    def nvme_write_bytes_per_s(self) -> float:
        return self.nvme.count * self.nvme.write_gb_per_s_each * GB

    @property
    def h2d_bytes_per_s(self) -> float:
        return self.links.h2d_gb_per_s * GB

    @property
    def d2h_bytes_per_s(self) -> float:
        return self.links.d2h_gb_per_s * GB

    @property
    def intra_node_bytes_per_s(self) -> float:
        """Per-GPU bus bandwidth of a collective inside one node (`links.inter_gpu_gb_per_s`)."""
        return self.links.inter_gpu_gb_per_s * GB

    @property
    def inter_node_bytes_per_s(self) -> float:
        """One node's NIC bandwidth (`links.inter_node_gb_per_s`), shared by its GPUs; 0 on one node."""
        return self.links.inter_node_gb_per_s * GB

    def collective_seconds(self, per_rank_bytes: float) -> float:
        """Seconds of one ring all-gather or reduce-scatter over the cluster's `world_size` ranks that
        sends `per_rank_bytes` = (p-1)/p * S per rank (S: the whole gathered buffer; the schedule's
        and the executor's convention, executor/collectives.py).

        On one node (N = 1): (p-1)/p * S / inter_gpu (the ring's per-GPU bus bandwidth; NCCL
        doc/PERFORMANCE.md of nccl-tests: all-gather/reduce-scatter busBw = algBw * (n-1)/n).
        On N nodes x q GPUs, hierarchically (NCCL's ring crosses each node boundary once per ring,
        one ring per GPU/NIC rail; equivalently the 2-level scheme of Horovod/BlueConnect, Cho et
        al. 2019 §3): every GPU exchanges (q-1)/q * S with its node's peers over the intra-node link,
        and each node's NIC carries (N-1)/N * S (its q GPUs' shares together) to the other nodes. The
        two stages pipeline (NCCL splits a collective into chunks), so the slower one sets the time:

            seconds = max((q-1)/q * S / intra_node, (N-1)/N * S / nic)
        """
        p, q, n = self.cluster.world_size, self.cluster.ranks_per_node, self.cluster.nodes
        if p <= 1 or per_rank_bytes <= 0:
            return 0.0
        whole = per_rank_bytes * p / (p - 1)
        intra = (q - 1) / q * whole / self.intra_node_bytes_per_s if q > 1 else 0.0
        # no NIC given (a profile built in code; a file is refused by validate_hardware): not priced
        inter = (n - 1) / n * whole / self.inter_node_bytes_per_s if n > 1 and self.inter_node_bytes_per_s > 0 else 0.0
        return max(intra, inter)

    @property
    def inter_gpu_bytes_per_s(self) -> float:
        """The INTER_GPU channel's rate: bytes one rank sends per second of a collective over the whole
        cluster (`collective_seconds`); the intra-node bus bandwidth on one node."""
        if self.cluster.nodes <= 1 or self.cluster.world_size <= 1 or self.inter_node_bytes_per_s <= 0:
            return self.intra_node_bytes_per_s
        return GB / self.collective_seconds(GB)

    @property
    def device_flops_per_s(self) -> float:
        return self.device.compute_tflops * 1e12

    @property
    def device_margin_bytes(self) -> int:
        """DEVICE bytes a plan should leave free for the allocator (not yet subtracted from device_bytes)."""
        return int(self.device.memory_margin_gb * GB)

    @property
    def host_dram_bytes_per_s(self) -> float:
        """Host DRAM bandwidth; 0 when not given."""
        return self.host.dram_gb_per_s * GB

    def cpu_adam_params_per_s(self, threads: int | None = None, *, with_copies: bool = False,
                              mixed_precision: bool = False) -> float:
        """CPU Adam params/s at `threads` (default: all cores) from `adam_rates` (the row with the most
        threads not above it; linear below the first row), or `optimizer_params_per_s` without rows.
        `mixed_precision`: the executor's mixed-precision step where the row measured it (`mixed_precision_params_per_s`, never
        above the fp32 kernel's rate: it is that kernel and two passes more), with copies beside it slowed
        by the same factor (the column is measured alone)."""
        rows = sorted(self.host.adam_rates, key=lambda r: r.threads)
        if not rows:
            return self.host.optimizer_params_per_s
        want = self.host.cores if threads is None else threads
        below = [r for r in rows if r.threads <= want]
        row = below[-1] if below else rows[0]
        rate = row.params_per_s_with_copies if with_copies and row.params_per_s_with_copies > 0 else row.params_per_s
        if mixed_precision and row.mixed_precision_params_per_s > 0:
            rate *= min(1.0, row.mixed_precision_params_per_s / row.params_per_s)
        return rate if below else rate * want / row.threads

    def matmul_flops_per_s(self, m: int, n: int, k: int, dtype: DType) -> float:
        """FLOP/s of one (m x k) @ (k x n) GEMM: log-log interpolation in m*n*k over the `matmul_rates`
        of `dtype` (clamped at the ends), or `compute_tflops` when there are none."""
        rows = sorted((r.m * r.n * r.k, r.tflops) for r in self.device.matmul_rates if r.dtype == dtype)
        if not rows:
            return self.device_flops_per_s
        size = m * n * k
        if size <= rows[0][0]:
            return rows[0][1] * 1e12
        if size >= rows[-1][0]:
            return rows[-1][1] * 1e12
        for (s0, t0), (s1, t1) in zip(rows, rows[1:]):
            if s0 <= size <= s1:
                if s1 == s0:
                    return max(t0, t1) * 1e12
                w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0))) * 1e12
        return rows[-1][1] * 1e12  # unreachable: the loop covers [first, last]

    @property
    def digest(self) -> str:
        plain = to_plain(self)
        if not self.links.inter_node_gb_per_s:
            # a one-node profile keeps the digest it had before the field existed (schedules name it)
            plain["links"] = {k: v for k, v in plain["links"].items() if k != "inter_node_gb_per_s"}
        # likewise a profile without the by-size tables (every preset today)
        if not self.links.copy_rates:
            plain["links"] = {k: v for k, v in plain["links"].items() if k != "copy_rates"}
        if not self.nvme.chunk_rates:
            plain["nvme"] = {k: v for k, v in plain["nvme"].items() if k != "chunk_rates"}
        # and CPU Adam rows without the mixed-precision column
        plain["host"]["adam_rates"] = [{k: v for k, v in row.items() if k != "mixed_precision_params_per_s" or v}
                                       for row in plain["host"]["adam_rates"]]
        return digest_bytes(pack_msgpack(plain))

    # -- IO ---------------------------------------------------------------------------------
    def to_toml(self) -> str:
        validate_hardware(self, source="(hardware being written)")
        return tomli_w.dumps({"format": HARDWARE_FORMAT, "format_version": HARDWARE_VERSION, **to_plain(self)})

    def write(self, path: str | Path) -> None:
        atomic_write_bytes(path, self.to_toml().encode("utf-8"))

    @classmethod
    def from_toml(cls, text: str, *, source: str = "(text)") -> Hardware:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise FormatError(_KIND, source, "", f"valid TOML, found a syntax error ({exc})", _FIX) from None
        check_header(_KIND, source, data, HARDWARE_FORMAT, HARDWARE_VERSION, _FIX)
        check_schema(_KIND, source, "hardware.schema.json", data, fix=_FIX)
        data = {k: v for k, v in data.items() if k not in ("format", "format_version")}
        hardware = from_plain(cls, data)
        validate_hardware(hardware, source=source)
        return hardware

    @classmethod
    def read(cls, path: str | Path) -> Hardware:
        raw = read_bytes(_KIND, path)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(_KIND, str(path), "", "UTF-8 TOML text, found binary data", _FIX) from None
        return cls.from_toml(text, source=str(path))


# Plausible ranges of the rates and capacities: wide (a thousand times beyond any machine on either
# side) so that no real profile is refused, narrow enough that a typo such as 1e-300 GB/s is named
# here instead of surfacing as "does not fit ... none helps" from the solver (issue 21). Upper ends:
# NVLink 5 moves 1.8 TB/s per GPU and a B200 does ~2.3 PFLOPS dense bf16 (NVIDIA Blackwell datasheet);
# lower ends: 1 KB/s, 1 MFLOPS, 1 KB of memory, 1 param/s.
_RATE_GB_PER_S = (1e-6, 1e6, "GB/s")
_SIZE_GB = (1e-6, 1e6, "GB")
PLAUSIBLE: dict[str, tuple[float, float, str]] = {
    "device.memory_gb": _SIZE_GB,
    "device.compute_tflops": (1e-6, 1e6, "TFLOPS"),
    "device.optimizer_params_per_s": (1.0, 1e15, "params/s"),
    "host.memory_gb": _SIZE_GB,
    "host.optimizer_params_per_s": (1.0, 1e15, "params/s"),
    "nvme.capacity_gb_each": _SIZE_GB,
    "nvme.read_gb_per_s_each": _RATE_GB_PER_S,
    "nvme.write_gb_per_s_each": _RATE_GB_PER_S,
    "links.h2d_gb_per_s": _RATE_GB_PER_S,
    "links.d2h_gb_per_s": _RATE_GB_PER_S,
    "links.inter_gpu_gb_per_s": _RATE_GB_PER_S,
}
_ZERO_MEANS_NONE = {"nvme.capacity_gb_each", "nvme.read_gb_per_s_each", "nvme.write_gb_per_s_each",
                    "links.inter_gpu_gb_per_s"}


def validate_hardware(hw: Hardware, *, source: str) -> None:
    """Semantic rules: every number finite; NVMe rates present when SSDs are; GPUs consistent."""

    def req(cond: bool, path: str, message: str) -> None:
        require(cond, _KIND, source, path, message, _FIX)

    check_numbers(_KIND, source, hw, fix=_FIX)
    for section in ("device", "host", "nvme", "links", "cluster"):
        spec = getattr(hw, section)
        for name in spec.__slots__:
            value = getattr(spec, name)
            if isinstance(value, float):
                req(math.isfinite(value), f"{section}.{name}", f"a finite number, found {value}")
    for path, (low, high, unit) in PLAUSIBLE.items():
        section, name = path.split(".")
        value = getattr(getattr(hw, section), name)
        if value == 0 and path in _ZERO_MEANS_NONE:
            continue  # no SSDs / one GPU: checked below
        req(low <= value <= high, path, f"a value between {low:g} and {high:g} {unit}, found {value:g}")
    if hw.nvme.count > 0:
        for name in ("capacity_gb_each", "read_gb_per_s_each", "write_gb_per_s_each"):
            req(getattr(hw.nvme, name) > 0, f"nvme.{name}", f"a positive number when nvme.count={hw.nvme.count}, found {getattr(hw.nvme, name)}")
    if hw.cluster.world_size > 1:
        req(hw.links.inter_gpu_gb_per_s > 0, "links.inter_gpu_gb_per_s",
            f"a positive bandwidth when cluster.world_size={hw.cluster.world_size}, found {hw.links.inter_gpu_gb_per_s}")
    for table, rows in (("links.copy_rates", hw.links.copy_rates), ("nvme.chunk_rates", hw.nvme.chunk_rates)):
        sizes = [r.chunk_bytes for r in rows]
        req(len(set(sizes)) == len(sizes), table, f"one row per chunk_bytes, found sizes {sizes}")
        for i, r in enumerate(rows):
            for name in r.__slots__:
                value = getattr(r, name)
                if isinstance(value, float) and value != 0:
                    req(_RATE_GB_PER_S[0] <= value <= _RATE_GB_PER_S[1], f"{table}[{i}].{name}",
                        f"a value between {_RATE_GB_PER_S[0]:g} and {_RATE_GB_PER_S[1]:g} GB/s, found {value:g}")
    threads = [r.threads for r in hw.host.adam_rates]
    req(len(set(threads)) == len(threads), "host.adam_rates", f"one row per thread count, found threads {threads}")
    req(not hw.host.adam_rates or hw.host.adam_chunk_params > 0, "host.adam_chunk_params",
        "the chunk size (fp32 params) the adam_rates were measured at, found 0")
    req(hw.device.memory_margin_gb == 0 or hw.device.memory_margin_gb < hw.device.memory_gb * hw.device.usable_fraction,
        "device.memory_margin_gb",
        f"less than the usable DEVICE memory ({hw.device.memory_gb * hw.device.usable_fraction:g} GB), found {hw.device.memory_margin_gb}")
    req(hw.cluster.world_size % hw.cluster.gpus_per_node == 0 or hw.cluster.world_size < hw.cluster.gpus_per_node,
        "cluster.gpus_per_node", f"a divisor of world_size={hw.cluster.world_size}, found {hw.cluster.gpus_per_node}")
    if hw.cluster.world_size > hw.cluster.gpus_per_node:
        req(hw.links.inter_node_gb_per_s > 0, "links.inter_node_gb_per_s",
            f"a positive NIC bandwidth per node when cluster.world_size={hw.cluster.world_size} spans "
            f"{hw.cluster.nodes} nodes of gpus_per_node={hw.cluster.gpus_per_node}, found {hw.links.inter_node_gb_per_s}")


_ESTIMATE = "tide estimate"


def estimated_fields(text: str) -> tuple[str, ...]:
    """The fields of a hardware TOML whose comment says "tide estimate" (numbers with no source), as
    dotted paths: `host.optimizer_params_per_s`, or `device.matmul_rates[2]` for a row of a table."""
    found: list[str] = []
    section, array, row = "", "", -1
    for raw in text.splitlines():
        line = raw.strip()
        code, _, comment = line.partition("#")
        code = code.strip()
        if code.startswith("[") and not array:
            section, row = code.strip("[]").strip(), -1
            continue
        if array:  # inside a multi-line array of inline tables
            if code.startswith("{"):
                row += 1
                if _ESTIMATE in comment:
                    found.append(f"{array}[{row}]")
            if code.startswith("]"):
                array = ""
            continue
        key, eq, value = code.partition("=")
        if not eq:
            continue
        path = f"{section}.{key.strip()}" if section else key.strip()
        if _ESTIMATE in comment:
            found.append(path)
        if value.strip().startswith("[") and "]" not in value:
            array, row = path, -1
    return tuple(found)


__all__ = ["AdamRate", "AttentionRate", "CopyRate", "DeviceKind", "SsdRate", "rate_at_size", "Hardware", "HARDWARE_FORMAT", "HARDWARE_VERSION",
           "MatmulRate", "estimated_fields", "validate_hardware"]
