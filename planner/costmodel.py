"""The cost model: seconds for bytes on a channel, for FLOPs on the device, for Adam on a tier,
and the time of a stage as the max over its channels (Fuyou Eq. 2 and 5, §4.5).

Every channel is its own resource and they overlap perfectly inside a stage; the NVMe drives are
simplex, so a stage's NVMe reads and writes share their time (Fuyou Eq. 4, 7). The CPU optimizer
is a channel of its own when it overlaps backward (Fuyou §4.3); a DEVICE optimizer step is device
compute. Bandwidths are per rank; with several ranks each rank moves its own share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from schemas._base import frozen
from schemas.hardware import Hardware
from schemas.schedule import Channel, Tier


def channel_bytes_per_s(hardware: Hardware, channel: Channel) -> float:
    """Bandwidth of a byte channel (0.0 when the machine has no such path, e.g. no SSD)."""
    return {
        Channel.H2D: hardware.h2d_bytes_per_s,
        Channel.D2H: hardware.d2h_bytes_per_s,
        Channel.NVME_READ: hardware.nvme_read_bytes_per_s,
        Channel.NVME_WRITE: hardware.nvme_write_bytes_per_s,
        Channel.INTER_GPU: hardware.inter_gpu_bytes_per_s,
    }[channel]


def transfer_seconds(hardware: Hardware, channel: Channel, nbytes: float) -> float:
    """Seconds to move `nbytes` over `channel`; inf when there are bytes but no path."""
    if nbytes <= 0:
        return 0.0
    rate = channel_bytes_per_s(hardware, channel)
    return nbytes / rate if rate > 0 else math.inf


def compute_seconds(hardware: Hardware, flops: float) -> float:
    return flops / hardware.device_flops_per_s


def optimizer_seconds(hardware: Hardware, tier: Tier, params: int) -> float:
    """Adam over `params` parameters on DEVICE (GPU Adam) or HOST (fused CPU Adam)."""
    if tier is Tier.DEVICE:
        return params / hardware.device.optimizer_params_per_s
    if tier is Tier.HOST:
        return params / hardware.host.optimizer_params_per_s
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
    "StageLoad", "channel_bytes_per_s", "channel_seconds", "compute_seconds", "nvme_seconds", "optimizer_seconds",
    "stage_seconds", "transfer_seconds",
]
