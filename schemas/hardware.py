"""The hardware format (`tide.hardware`, TOML written by people): one machine's capacities and rates.

Units are in the field names: `_gb` is 10^9 bytes, `_gb_per_s` 10^9 bytes per second, `_tflops`
10^12 FLOP/s. The planner reads the derived byte/second properties; people read the TOML.
Every preset in `traces/hardware/` carries a comment naming the source of each number.
"""

from __future__ import annotations

import math
import tomllib
from enum import StrEnum
from pathlib import Path

from schemas._base import (
    FormatError,
    atomic_write_bytes,
    check_finite,
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
class DeviceSpec:
    """The accelerator (one per rank)."""

    kind: DeviceKind
    name: str  # marketing name, e.g. "NVIDIA GeForce RTX 4090"
    memory_gb: float = constrained(exclusiveMinimum=0)
    usable_fraction: float = constrained(exclusiveMinimum=0, maximum=1)  # the rest is CUDA context, fragmentation
    compute_tflops: float = constrained(exclusiveMinimum=0)  # sustained rate of transformer blocks in the compute dtype
    optimizer_params_per_s: float = constrained(exclusiveMinimum=0)  # Adam on the device, params per second


@frozen
class HostSpec:
    """CPU memory and the CPU optimizer (shared by the ranks of a node)."""

    memory_gb: float = constrained(exclusiveMinimum=0)
    usable_fraction: float = constrained(exclusiveMinimum=0, maximum=1)
    optimizer_params_per_s: float = constrained(exclusiveMinimum=0)  # fused CPU Adam, params per second
    cores: int = constrained(minimum=1)


@frozen
class NvmeSpec:
    """SSDs (count 0: none). Each SSD is simplex: its reads and writes share its time."""

    count: int = constrained(minimum=0)
    capacity_gb_each: float = constrained(minimum=0)
    read_gb_per_s_each: float = constrained(minimum=0)
    write_gb_per_s_each: float = constrained(minimum=0)
    usable_fraction: float = constrained(exclusiveMinimum=0, maximum=1)


@frozen
class LinkSpec:
    """Transfer paths between tiers and between GPUs."""

    h2d_gb_per_s: float = constrained(exclusiveMinimum=0)
    d2h_gb_per_s: float = constrained(exclusiveMinimum=0)
    inter_gpu_gb_per_s: float = constrained(minimum=0)  # per-GPU bus bandwidth of collectives; 0 with one GPU


@frozen
class ClusterSpec:
    """How many ranks train together."""

    world_size: int = constrained(minimum=1)
    gpus_per_node: int = constrained(minimum=1)


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
    def inter_gpu_bytes_per_s(self) -> float:
        return self.links.inter_gpu_gb_per_s * GB

    @property
    def device_flops_per_s(self) -> float:
        return self.device.compute_tflops * 1e12

    @property
    def digest(self) -> str:
        return digest_bytes(pack_msgpack(to_plain(self)))

    # -- IO ---------------------------------------------------------------------------------
    def to_toml(self) -> str:
        import tomli_w

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

    check_finite(_KIND, source, hw, fix=_FIX)
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
    req(hw.cluster.world_size % hw.cluster.gpus_per_node == 0 or hw.cluster.world_size < hw.cluster.gpus_per_node,
        "cluster.gpus_per_node", f"a divisor of world_size={hw.cluster.world_size}, found {hw.cluster.gpus_per_node}")


__all__ = ["DeviceKind", "Hardware", "HARDWARE_FORMAT", "HARDWARE_VERSION", "validate_hardware"]
