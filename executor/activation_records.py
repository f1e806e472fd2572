"""What the activation manager (executor/activations.py) keeps: the state of each block, one record
per saved storage (where its bytes are, the copies in flight), and the plan helpers (which
checkpoints a schedule offloads, a block's call as f(*tensors))."""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from executor.copies import Ready
from executor.errors import ExecutorError
from schemas.schedule import ActivationMode, Channel, Op, Schedule, Tier

SWAP_TIER = {ActivationMode.SWAP_HOST: Tier.HOST, ActivationMode.SWAP_NVME: Tier.NVME}


class BlockState(enum.Enum):
    IDLE = enum.auto()  # entered at construction; nothing captured yet
    CAPTURING = enum.auto()  # pre_forward: the block's forward runs under our saved-tensor hooks
    SAVED = enum.auto()  # post_forward: its saved tensors are held / on their way to the tier / only its input
    RELOADING = enum.auto()  # prefetch(): copies back to DEVICE started
    BACKWARD = enum.auto()  # the grad of the block's output arrived: its backward runs


_TRANSITIONS = {
    (BlockState.IDLE, BlockState.CAPTURING),
    (BlockState.CAPTURING, BlockState.SAVED),
    (BlockState.CAPTURING, BlockState.IDLE),  # the forward raised
    (BlockState.SAVED, BlockState.RELOADING),
    (BlockState.SAVED, BlockState.BACKWARD),
    (BlockState.RELOADING, BlockState.BACKWARD),
    # the next forward (next iteration, or a block called again in the same forward)
    (BlockState.SAVED, BlockState.CAPTURING),
    (BlockState.RELOADING, BlockState.CAPTURING),
    (BlockState.BACKWARD, BlockState.CAPTURING),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationStats:
    """Counters since construction or the last `reset_stats()`."""

    offloaded_bytes: dict[Tier, int]
    """bytes sent away from DEVICE, per destination tier (HOST, NVME)"""
    reloaded_bytes: dict[Tier, int]
    """bytes brought back to DEVICE, per source tier"""
    bytes_per_channel: dict[Channel, int]
    """D2H/H2D for every swap, NVME_WRITE/NVME_READ in addition for SWAP_NVME"""
    saved_bytes_per_block: tuple[int, ...]
    """bytes of the storages each block saved (deduplicated; the recorder's activation bytes)"""
    offloaded_bytes_per_block: tuple[int, ...]
    reloaded_bytes_per_block: tuple[int, ...]
    live_bytes: int
    """bytes the manager holds on DEVICE now"""
    peak_live_bytes: int
    stall_seconds: float
    """time unpacks waited for a reload"""


class Alias:
    """A tensor stored as the engine's token (a param in its chunk) or, without alias_pack, as itself."""

    __slots__ = ("token", "tensor")

    def __init__(self, token: Any, tensor: torch.Tensor | None) -> None:
        self.token, self.tensor = token, tensor


class Record:
    """One storage a block saved, deduplicated; where its bytes are and the copies in flight.

    `device` is a 1-D uint8 tensor over the DEVICE bytes (the original storage, or its reload), None
    while the bytes are only on HOST/NVME. `tier` is where it is swapped to (None: it stays on
    DEVICE). `offload` / `reload` are the `Ready`s of the copies (executor/copies.py: a future on the
    CPU, a CUDA event on a GPU; an NVME swap's offload is its file write, which follows the copy)."""

    __slots__ = ("manager", "block", "mode", "tier", "nbytes", "home", "device", "host", "nvme_offset",
                 "offload", "reload", "live", "__weakref__")

    def __init__(self, manager: Any, block: int, mode: ActivationMode, tier: Tier | None,
                 storage: Any, device: torch.device) -> None:
        self.manager, self.block, self.mode, self.tier = manager, block, mode, tier
        self.nbytes = storage.nbytes()
        self.home = device  # the DEVICE the tensor was saved on (reloads go back there)
        self.device = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.host: torch.Tensor | None = None
        self.nvme_offset = -1
        self.offload: Ready | None = None
        self.reload: Ready | None = None
        # DEVICE copies counted in the manager's live bytes: the original until its offload is done,
        # the reload from its start; both can overlap when the worker is behind
        self.live = 0

    def __del__(self) -> None:
        manager = self.manager
        if manager is not None and self.live:
            manager.hold(self, -self.live)


class Saved:
    """What autograd holds instead of a swapped or counted tensor: its record and its view."""

    __slots__ = ("record", "dtype", "offset", "size", "stride")

    def __init__(self, record: Record, t: torch.Tensor) -> None:
        self.record, self.dtype = record, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


class Block:
    __slots__ = ("index", "name", "module", "mode", "swap_tier", "state", "records", "generator", "hooks_ctx",
                 "own", "nvme_cursor")

    def __init__(self, index: int, name: str, module: nn.Module, mode: ActivationMode,
                 checkpoint_tier: Tier | None) -> None:
        self.index, self.name, self.module, self.mode = index, name, module, mode
        # where what the block saves goes: SWAP modes' tier, or an offloaded checkpoint's; None: stays
        self.swap_tier = SWAP_TIER.get(mode, checkpoint_tier)
        self.state = BlockState.IDLE
        self.records: list[weakref.ref[Record]] = []  # weak: autograd owns the records
        self.generator: Any = None  # RECOMPUTE: the checkpoint generator between pre and post forward
        self.hooks_ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        # an offloaded checkpoint while it is saved: storage key -> the block's own record
        self.own: dict[int, weakref.ref[Record]] | None = None
        self.nvme_cursor = 0  # next free byte in this block's NVMe file (executor/nvme.py, Note [activation files])

    def move(self, to: BlockState) -> None:
        if (self.state, to) not in _TRANSITIONS:
            raise ExecutorError(f"activations of block {self.index} ({self.name!r}): cannot go from "
                                f"{self.state.name} to {to.name}; this is a bug in the caller's hook order")
        self.state = to

    def live_records(self) -> list[Record]:
        out = [r for ref in self.records if (r := ref()) is not None]
        self.records = [weakref.ref(r) for r in out]
        return out


def checkpoint_tiers(schedule: Schedule) -> dict[int, Tier]:
    """RECOMPUTE blocks of `schedule` whose checkpoint an ACT_OFFLOAD moves, and to which tier."""
    recompute = {p.block for p in schedule.activation_plans if p.mode is ActivationMode.RECOMPUTE}
    return {a.block: a.dst for a in schedule.actions if a.op is Op.ACT_OFFLOAD and a.block in recompute}


def resolve_checkpoint_tiers(names: Sequence[str], modes: Sequence[ActivationMode],
                      given: Mapping[int | str, Tier]) -> list[Tier | None]:
    out: list[Tier | None] = [None] * len(names)
    index = {n: i for i, n in enumerate(names)}
    for key, tier in given.items():
        i = index.get(key) if isinstance(key, str) else key
        if not isinstance(i, int) or not 0 <= i < len(names):
            raise ExecutorError(f"activation plan: checkpoint_tiers names block {key!r}, which is not one of the "
                                f"{len(names)} blocks; give block indices or names from find_blocks(model)")
        if modes[i] is not ActivationMode.RECOMPUTE:
            raise ExecutorError(f"activation plan: checkpoint_tiers offloads the checkpoint of block {i} "
                                f"({names[i]!r}), which is {modes[i].value}, not RECOMPUTE; only a RECOMPUTE "
                                "block has a checkpoint")
        if Tier(tier) not in (Tier.HOST, Tier.NVME):
            raise ExecutorError(f"activation plan: checkpoint of block {i} ({names[i]!r}) offloaded to "
                                f"{Tier(tier).value}; expected HOST or NVME")
        out[i] = Tier(tier)
    return out


def positional_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """The block's call as f(*tensors): every tensor of its input, keyword and nested ones too, goes
    positionally through the checkpoint's save of its inputs (our hooks); the rest stays in f."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in where]
    for i in where:
        leaves[i] = None  # f must not hold the tensors: the hooks decide where they live

    def rerun(*ts: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(where, ts, strict=True):
            filled[i] = t
        a, kw = pytree.tree_unflatten(filled, spec)
        return module(*a, **kw)

    return rerun, tensors


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def recompute_contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()
