"""`executor.run(model, schedule)`: replay a schedule inside an ordinary PyTorch training loop.

    engine = executor.run(model, "schedule.msgpack", lr=3e-4, weight_decay=0.1)
    for batch in batches:
        loss = model(**batch)
        loss.backward()            # fp16: engine.backward(loss), which scales the loss first
        engine.step()              # the OPTIMIZER moment(s); also what engine.optimizer.step() runs
        engine.zero_grad()         # grads live in GRAD chunks that die at the step: nothing to clear

Attach (`Engine.__init__`): the model's params (names incl. tied names, shapes, dtypes) are compared
with `schedule.layout`; on any difference ALL of them are listed and nothing is touched. Then the
chunk store is built per `initial_residency`, the params are copied into their chunks, and every
`param.data` points into its PARAM chunk on DEVICE, or at an empty placeholder while the chunk is
elsewhere (PatrickStar §6.2, Algorithms 1-2); the original storage is freed.

Replay: `MomentHooks` (executor/hooks.py) report every moment; the engine checks the event against
`schedule.moments[m]` (phase, kind, module) and raises `ExecutorError` BEFORE changing any state when
they differ, then applies the actions of moment m in list order (ACTION SEMANTICS in
schemas/schedule.py) and waits for the PARAM chunks moment m's work touches. The engine never decides.

Grads: a post-accumulate-grad hook per Parameter (tied params are one Parameter) adds `param.grad`
into the param's slot of its GRAD chunk on DEVICE and sets `param.grad = None`.

Saved tensors: when the schedule evicts PARAM chunks from DEVICE, tensors autograd saves whose
storage is a DEVICE PARAM payload (a weight, `weight.t()`...) are saved as (chunk, offset, size,
stride) through `torch.autograd.graph.saved_tensors_hooks` and rebuilt from the chunk's DEVICE payload
of the moment backward needs them, so they never pin (or read a reused buffer of) an evicted chunk.

Activations, per the schedule's plan: KEEP (nothing to do); RECOMPUTE (the block's forward runs
under `torch.utils.checkpoint`, non-reentrant, so only its input is saved and the forward reruns in
its backward); SWAP_HOST (what the block saves in forward is captured by the same saved-tensor
hooks, storage by storage, and moved whole by ACT_OFFLOAD / ACT_RELOAD on the copy engine; the
first unpack in backward waits for the reload). SWAP_NVME is refused at attach.

NVME tier (`nvme_dir=`): chunks on NVME live in preallocated files (`executor.nvme.NvmeStore`,
O_DIRECT where the filesystem allows); HOST<->NVME copies are the schedule's FETCH / WRITE_BACK
actions on the NVME_READ / NVME_WRITE channels, so only dirty chunks are written. The files are
removed by `detach()` (or when the engine is collected).

Gradient accumulation (`grad_accumulation_steps=N`): call `engine.step()` after every micro-step;
every micro-step replays ALL moments of the schedule, including the OPTIMIZER moment, and only the
last of N runs the OPTIMIZER_STEP actions. Grads accumulate in the GRAD chunks: on the first N-1
micro-steps an EVICT that would drop the last copy of a GRAD chunk keeps it (a DEVICE copy is first
written back to HOST) and the next ALLOCATE brings the accumulated chunk back instead of zeros.
Those extra copies are counted on their channels, so with N > 1 the bytes per micro-step exceed the
prediction by exactly that traffic (with N = 1 they equal it).
"""

from __future__ import annotations

import enum
import functools
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn

from executor import state as state_io
from executor.errors import ExecutorError
from executor.hooks import MomentEvent, MomentHooks, find_blocks, find_units
from executor.optim import ChunkAdam, ChunkAdamW, DynamicLossScaler
from executor.stats import EngineStats
from executor.store import COPY_CHANNELS, TORCH_DTYPES, ChunkStore
from schemas.schedule import ActivationMode, Channel, ChunkList, Op, Schedule, TensorSlot, Tier
from schemas.trace import DType, MomentKind, Phase

_RERECORD = ("the model no longer does what was recorded: re-record it with `python -m executor record ...` "
             "and re-solve with `python -m planner solve ...`")
_PRECISIONS = {"fp32": DType.FLOAT32, "float32": DType.FLOAT32, "bf16": DType.BFLOAT16, "bfloat16": DType.BFLOAT16,
               "fp16": DType.FLOAT16, "float16": DType.FLOAT16}


class EngineState(enum.Enum):
    """Where the engine is in the replay; changed only by `Engine._enter`."""

    IDLE = "idle"  # attached, between iterations: the next event must be moment 0 (root pre_forward)
    REPLAYING = "replaying"  # inside an iteration: moments 0..cursor-1 were applied
    FAILED = "failed"  # a replay check failed mid-iteration; every later event raises
    DETACHED = "detached"  # `detach()` ran: hooks removed, params hold plain tensors again


_ENGINE_TRANSITIONS = {
    (EngineState.IDLE, EngineState.REPLAYING), (EngineState.REPLAYING, EngineState.IDLE),
    (EngineState.IDLE, EngineState.FAILED), (EngineState.REPLAYING, EngineState.FAILED),
    (EngineState.IDLE, EngineState.DETACHED), (EngineState.REPLAYING, EngineState.DETACHED),
    (EngineState.FAILED, EngineState.DETACHED),
}


class _Place(NamedTuple):
    """A param's place in its chunk."""

    param: nn.Parameter
    slot: TensorSlot


class _ChunkRef(NamedTuple):
    """A saved tensor that lives in a PARAM chunk: rebuilt from the chunk's DEVICE payload on unpack."""

    chunk: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class _SavedRef(NamedTuple):
    """A tensor a SWAP_HOST block saved for backward: its storage (moved whole) and its view."""

    block: int
    storage: int  # index into the block's storages
    dtype: torch.dtype
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class _BlockActivations:
    """The storages one SWAP_HOST block saved in forward, deduplicated, on DEVICE or HOST.

    A copy is a copy of the whole storage (what the recorder counts as the activation's bytes); the
    copy's Ready travels with the storage and `get` waits for it, so the reload overlaps the
    backward of later blocks and only the first unpack of this block can stall.
    """

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # data_ptr of a DEVICE storage -> index
        self.storages: list[torch.Tensor] = []  # uint8 views of each storage where it lives now
        self.ready: list[Any] = []  # the copy that wrote it, or None
        self.tier = Tier.DEVICE

    def add(self, block: int, tensor: torch.Tensor) -> _SavedRef:
        storage = tensor.untyped_storage()
        i = self.index.get(storage.data_ptr())
        if i is None:
            i = self.index[storage.data_ptr()] = len(self.storages)
            self.storages.append(torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage))
            self.ready.append(None)
        return _SavedRef(block, i, tensor.dtype, tensor.storage_offset(), tensor.size(), tensor.stride())

    def move(self, to: Tier, store: ChunkStore, *, pin: bool, device: torch.device) -> int:
        if self.tier is to:
            raise ExecutorError(f"schedule violation: activations moved to {to.value}, where they already are")
        nbytes = 0
        target = device if to is Tier.DEVICE else torch.device("cpu")
        for i, src in enumerate(self.storages):
            dst = torch.empty(src.numel(), dtype=torch.uint8, device=target, pin_memory=pin and to is Tier.HOST)
            after = [self.ready[i]] if self.ready[i] is not None else []
            channel = Channel.D2H if to is Tier.HOST else Channel.H2D
            if store.on_gpu:
                self.ready[i] = store.copies.copy(dst, src, after=after, channel=channel)
            else:
                self.ready[i] = store.copies.copy(dst, src, after=after)
            self.storages[i] = dst  # the source is freed once its copy (which holds it) is done
            nbytes += src.numel()
        self.tier = to
        return nbytes

    def get(self, ref: _SavedRef, store: ChunkStore) -> torch.Tensor:
        if self.tier is not Tier.DEVICE:
            raise ExecutorError("schedule violation: backward needs activations still on HOST (no ACT_RELOAD before it)")
        ready = self.ready[ref.storage]
        if ready is not None:
            if store.on_gpu:
                ready.wait_on_device()
            else:
                store.stall_seconds += ready.wait()
            self.ready[ref.storage] = None
        raw = self.storages[ref.storage]
        out = torch.empty(0, dtype=ref.dtype, device=raw.device)
        return out.set_(raw.untyped_storage(), ref.offset, ref.size, ref.stride)


def default_param_groups(model: nn.Module, *, weight_decay: float) -> list[dict[str, Any]]:
    """The common AdamW grouping: decay on matrices, none on norms, biases and other 1-D params."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append((name, p))
    groups = [{"params": [p for _, p in g], "param_names": [n for n, _ in g], "weight_decay": wd}
              for g, wd in ((decay, weight_decay), (no_decay, 0.0)) if g]
    return groups


def check_model(model: nn.Module, schedule: Schedule, *, compute: DType) -> list[str]:
    """Every difference between the model's params and the schedule's layout (empty: they match)."""
    named = list(model.named_parameters(remove_duplicate=False))
    by_name = dict(named)
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, p in named:
        names_of[id(p)].append(name)
    allowed = {TORCH_DTYPES[compute], torch.float32}
    problems: list[str] = []
    in_layout: set[str] = set()
    for slot in schedule.layout.tensors:
        in_layout.update(slot.names)
        present = [n for n in slot.names if n in by_name]
        for n in slot.names:
            if n not in by_name:
                problems.append(f"param {n!r}: in the schedule, not in the model")
        if not present:
            continue
        p = by_name[present[0]]
        if any(by_name[n] is not p for n in present) or sorted(names_of[id(p)]) != sorted(slot.names):
            problems.append(f"param {present[0]!r}: the schedule ties {list(slot.names)}, the model ties "
                            f"{sorted(names_of[id(p)])}")
        if tuple(p.shape) != tuple(slot.shape):
            problems.append(f"param {present[0]!r}: shape {tuple(p.shape)}, the schedule expects {tuple(slot.shape)}")
        if p.dtype not in allowed:
            problems.append(f"param {present[0]!r}: dtype {p.dtype}, the schedule computes in {compute.value} "
                            f"(expected float32 or {compute.value})")
        if p.requires_grad != slot.trainable:
            problems.append(f"param {present[0]!r}: requires_grad={p.requires_grad}, the schedule says "
                            f"trainable={slot.trainable}")
        if p.device.type == "meta":
            problems.append(f"param {present[0]!r}: on the meta device; build the model with real weights")
    for name, _ in named:
        if name not in in_layout:
            problems.append(f"param {name!r}: in the model, not in the schedule")
    return problems


class Engine:
    """Replays one schedule on one model; see the module docstring. Build it with `executor.run`."""

    def __init__(self, model: nn.Module, schedule: Schedule, *, params: Iterable[Any] | None = None,
                 optimizer: str = "adamw", lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, grad_clip_norm: float | None = None,
                 precision: str | None = None, grad_accumulation_steps: int = 1, nvme_dir: str | Path | None = None,
                 device: str | torch.device = "auto") -> None:
        self.schedule = schedule
        self.model = model
        layout = schedule.layout
        compute = layout.list_dtypes[ChunkList.PARAM]
        # ---- arguments and the schedule's own demands, all checked before anything is touched
        if precision is not None:
            wanted = _PRECISIONS.get(str(precision).lower())
            if wanted is None:
                raise ExecutorError(f"precision={precision!r}: expected one of fp32, bf16, fp16 (or None: the schedule's)")
            if wanted is not compute:
                raise ExecutorError(f"precision={precision!r}: the schedule computes in {compute.value}; record and "
                                    f"solve with that precision, or pass precision=None")
        if optimizer not in ("adamw", "adam"):
            raise ExecutorError(f"optimizer={optimizer!r}: expected 'adamw' or 'adam'")
        if grad_accumulation_steps < 1:
            raise ExecutorError(f"grad_accumulation_steps={grad_accumulation_steps}: expected 1 or more")
        if grad_clip_norm is not None and not grad_clip_norm > 0:
            raise ExecutorError(f"grad_clip_norm={grad_clip_norm}: expected a positive number or None")
        self._check_schedule_supported(schedule, grad_clip_norm=grad_clip_norm, compute=compute, nvme_dir=nvme_dir)
        problems = check_model(model, schedule, compute=compute)
        if problems:
            raise ExecutorError(f"the model does not match the schedule ({len(problems)} differences): "
                                + "; ".join(problems) + f". {_RERECORD}")
        self.device = _resolve_device(device)
        # before any param is re-pointed: find_blocks weighs modules by their params' sizes
        self._blocks = find_blocks(model)
        self._units = find_units(model, self._blocks)
        self.compute_dtype = TORCH_DTYPES[compute]
        self.grad_clip_norm = grad_clip_norm
        self.accumulation_steps = grad_accumulation_steps
        self.scaler = DynamicLossScaler() if compute is DType.FLOAT16 else None
        self._has_master = ChunkList.MASTER in layout.lists

        # ---- the optimizer holds the model's Parameters (LR schedulers work on it)
        if params is None:
            params = default_param_groups(model, weight_decay=weight_decay)
        cls = ChunkAdamW if optimizer == "adamw" else ChunkAdam
        self.optimizer = cls(params, layout, model=model, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.optimizer.set_step_driver(self._step_now)

        # ---- the layout, per chunk and per moment
        by_name = dict(model.named_parameters(remove_duplicate=False))
        self._slots = {s.tensor: s for s in layout.tensors}
        self._places: dict[int, list[_Place]] = defaultdict(list)
        for s in layout.tensors:
            self._places[s.chunk].append(_Place(by_name[s.names[0]], s))
        self._trainable = {s.tensor for s in layout.tensors if s.trainable}
        slot_of_name = {n: s for s in layout.tensors for n in s.names}
        self._clip_order = [slot_of_name[n] for n, p in model.named_parameters() if p.requires_grad]
        self._trainable_by_chunk: dict[int, list[int]] = defaultdict(list)
        for s in layout.tensors:
            if s.trainable:
                self._trainable_by_chunk[s.chunk].append(s.tensor)
        # per chunk, the element ranges no trainable tensor covers (padding, frozen params)
        self._grad_gaps: dict[int, list[tuple[int, int]]] = {}
        for c in layout.chunks:
            spans = sorted((self._slots[t].offset_elements, self._slots[t].offset_elements + self._slots[t].numel)
                           for t in self._trainable_by_chunk.get(c.id, ()))
            gaps, pos = [], 0
            for start, end in spans:
                if start > pos:
                    gaps.append((pos, start))
                pos = max(pos, end)
            if pos < c.elements:
                gaps.append((pos, c.elements))
            self._grad_gaps[c.id] = gaps
        self._unfilled: dict[int, set[int]] = {}  # GRAD chunks allocated without zeros -> slots not yet written
        self._actions: list[list[tuple[int, Any]]] = [[] for _ in schedule.moments]
        for i, a in enumerate(schedule.actions):
            self._actions[a.moment].append((i, a))
        # PARAM chunks the work of each forward/backward moment computes with; the OPTIMIZER moment's
        # needs are its OPTIMIZER_STEP actions' (on the tier each names)
        self._needs = [sorted({self._slots[t].chunk for t in m.tensors}) if m.phase is not Phase.OPTIMIZER else []
                       for m in schedule.moments]
        self._optimizer_moments = [m.id for m in schedule.moments if m.phase is Phase.OPTIMIZER]
        if not self._optimizer_moments or self._optimizer_moments[-1] != len(schedule.moments) - 1:
            raise ExecutorError("invalid schedule: its last moment must be the OPTIMIZER moment; re-solve it with "
                                "`python -m planner solve`")
        self._first_optimizer_moment = self._optimizer_moments[0]
        self._evicts_params = any(a.op is Op.EVICT and a.list is ChunkList.PARAM and a.src is Tier.DEVICE
                                  for a in schedule.actions)
        # SWAP_HOST blocks: what their forward saves is captured (between the block's pre_forward and
        # post_forward events) and moved by ACT_OFFLOAD / ACT_RELOAD
        self._swapped = {p.module: p.block for p in schedule.activation_plans if p.mode is ActivationMode.SWAP_HOST}
        self._capturing: int | None = None
        self._activations: dict[int, _BlockActivations] = {}

        # ---- the chunk store, filled per initial_residency; params move into it
        nvme = None
        if _uses_nvme(schedule):
            from executor.nvme import NvmeStore, nvme_lists

            nvme = NvmeStore(nvme_dir, lists=nvme_lists(layout, schedule.initial_residency, schedule.actions))
        self.store = ChunkStore(layout, device_capacity_bytes=schedule.budgets.device_bytes, device=self.device,
                                nvme=nvme)
        self._placeholder = {dt: torch.empty(0, dtype=dt, device=self.device) for dt in (self.compute_dtype,)}
        self._device_storage: dict[int, int] = {}  # data_ptr of a DEVICE PARAM payload -> chunk
        self.store.on_device_change = self._on_device_change
        self._fill_store(by_name)
        for module_buffer in model.buffers():  # buffers stay plain tensors, on the compute device
            if module_buffer.device != self.device:
                module_buffer.data = module_buffer.data.to(self.device)

        # ---- replay state
        self.state = EngineState.IDLE
        self.cursor = 0
        self.micro_step = 0  # index in the accumulation window
        self.iterations = 0  # micro-steps replayed to their last moment
        self._grad_seen: set[int] = set()
        self._found_inf = False
        self._grad_scale = 1.0
        self._clip_coefficient: float | None = None
        self._failure = ""
        self._stats = _Counters()
        self._last_event_seconds = 0.0
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._saved_hooks_on = False
        self._grad_handles = []
        for places in self._places.values():
            for place in places:
                if place.slot.trainable and place.param is by_name[place.slot.names[0]]:
                    self._grad_handles.append(place.param.register_post_accumulate_grad_hook(
                        lambda p, slot=place.slot: self._grad_ready(p, slot)))
        # RECOMPUTE blocks: their forward runs under torch.utils.checkpoint (non-reentrant), so only
        # the block's input is saved and the forward reruns inside the block's backward (its PARAM
        # chunks are on DEVICE then, by the schedule); MomentHooks sees no events from the rerun
        modules = dict(model.named_modules())
        self._recomputed: list[nn.Module] = []
        for plan in schedule.activation_plans:
            if plan.mode is ActivationMode.RECOMPUTE:
                if plan.module not in modules:
                    raise ExecutorError(f"the schedule recomputes block {plan.block} ({plan.module!r}), which is not a "
                                        f"module of the model. {_RERECORD}")
                block = modules[plan.module]
                block.forward = functools.partial(_checkpointed, block.forward)
                self._recomputed.append(block)
        # registered after the grad hooks, so a unit's post_backward (which may fire from a param
        # grad hook) always sees its grads already in the GRAD chunk
        self.hooks = MomentHooks(model, blocks=self._blocks, units=self._units, on_event=self._on_event)
        self.hooks.install()

    # ------------------------------------------------------------------------------ the loop API
    def step(self) -> None:
        """The OPTIMIZER moment(s): call once after every `loss.backward()` (every micro-step)."""
        self.optimizer.step()  # routed back to `_step_now`, so LR schedulers see a step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: grads live in GRAD chunks that die at the optimizer step."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with the fp16 loss scale applied first."""
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()

    def stats(self) -> EngineStats:
        """Counters of the last complete iteration (bytes, stalls, seconds per phase) and peaks since attach."""
        return self._stats.snapshot(self)

    def state_dict(self) -> dict[str, Any]:
        """{"model": plain model state dict, "optimizer": plain AdamW state dict[, "master", "loss_scaler"]}."""
        self._require_idle("state_dict()")
        out: dict[str, Any] = {"model": state_io.model_state_dict(self, self.model),
                               "optimizer": state_io.optimizer_state_dict(self, self.optimizer)}
        master = state_io.master_state_dict(self)
        if master:
            out["master"] = master
        if self.scaler is not None:
            out["loss_scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._require_idle("load_state_dict()")
        state_io.restore({**state_dict}, self, model=self.model, optimizer=self.optimizer, loss_scaler=self.scaler)

    def save(self, path: str | Path) -> None:
        """Checkpoint atomically (executor.state.save): model, optimizer, masters, loss scaler."""
        self._require_idle("save()")
        state_io.save(path, self, model=self.model, optimizer=self.optimizer, loss_scaler=self.scaler)

    def load(self, path: str | Path) -> None:
        self._require_idle("load()")
        state_io.restore(state_io.load(path), self, model=self.model, optimizer=self.optimizer, loss_scaler=self.scaler)

    def detach(self) -> None:
        """Remove the hooks and give every param a plain tensor with its current value again."""
        if self.state is EngineState.DETACHED:
            return
        self.hooks.remove()
        for block in self._recomputed:
            del block.forward  # the class's forward again
        for h in self._grad_handles:
            h.remove()
        self._pop_saved_hooks()
        self.store.settle()
        for chunk, places in self._places.items():
            flat = self.read_chunk(ChunkList.PARAM, chunk)
            for place in places:
                s = place.slot
                place.param.data = flat[s.offset_elements:s.offset_elements + s.numel].view(s.shape).clone()
        self.store.on_device_change = lambda lst, chunk, tensor: None
        self.store.close()
        self._enter(EngineState.DETACHED)

    # ---- the ChunkSource protocol of executor.state
    @property
    def layout(self):  # noqa: ANN201 - schemas.schedule.ChunkLayout
        return self.schedule.layout

    def read_chunk(self, list: ChunkList, chunk: int) -> torch.Tensor:  # noqa: A002 - the schemas' word
        """A CPU copy of the chunk's current data, from whichever tier holds a valid copy."""
        self.store.settle()
        tiers = self.store.valid_tiers(list, chunk)
        if not tiers:
            raise ExecutorError(f"{list.value} chunk {chunk} has no valid copy between iterations")
        if tiers[0] is Tier.NVME:
            return self.store.read_nvme(list, chunk)
        return self.store.tensor(list, chunk, tiers[0], why="read_chunk").detach().to("cpu", copy=True)

    def write_chunk(self, list: ChunkList, chunk: int, tensor: torch.Tensor) -> None:  # noqa: A002
        """Write the chunk into every valid copy (stale copies stay stale: the schedule refreshes them)."""
        self.store.settle()
        tiers = self.store.valid_tiers(list, chunk)
        if not tiers:
            raise ExecutorError(f"{list.value} chunk {chunk} has no valid copy between iterations")
        for tier in tiers:
            if tier is Tier.NVME:
                self.store.write_nvme(list, chunk, tensor.reshape(-1))
            else:
                self.store.tensor(list, chunk, tier, why="write_chunk").copy_(tensor.reshape(-1))

    # ------------------------------------------------------------------------------ attach
    @staticmethod
    def _check_schedule_supported(schedule: Schedule, *, grad_clip_norm: float | None, compute: DType,
                                  nvme_dir: str | Path | None) -> None:
        if schedule.header.world_size != 1:
            raise ExecutorError(f"the schedule is for world_size={schedule.header.world_size}; this executor runs one "
                                "process (re-solve for world_size 1)")
        for p in schedule.activation_plans:
            if p.mode is ActivationMode.SWAP_NVME:
                raise ExecutorError(f"the schedule's activation plan for block {p.block} ({p.module}) is {p.mode.value}; "
                                    "this executor swaps activations to HOST only: re-solve on a hardware profile "
                                    "whose [nvme] count is 0, or with more HOST memory")
        if _uses_nvme(schedule) and nvme_dir is None:
            raise ExecutorError("the schedule puts chunks on NVME: pass nvme_dir= (a directory on the SSD) to "
                                "executor.run")
        optimizer_moment = next((m.id for m in schedule.moments if m.phase is Phase.OPTIMIZER), len(schedule.moments))
        overlapped = any(a.op is Op.OPTIMIZER_STEP and a.moment < optimizer_moment for a in schedule.actions)
        if overlapped and (grad_clip_norm is not None or compute is DType.FLOAT16):
            why = "grad-norm clipping" if grad_clip_norm is not None else "fp16 loss scaling"
            raise ExecutorError(f"the schedule overlaps CPU optimizer steps with backward, but {why} needs every grad "
                                "before the first step: re-solve with `python -m planner solve ... --no-optimizer-overlap`")

    def _fill_store(self, by_name: dict[str, nn.Parameter]) -> None:
        layout = self.schedule.layout
        resident: dict[tuple[ChunkList, int], tuple[Tier, ...]] = {(r.list, r.chunk): r.tiers
                                                                    for r in self.schedule.initial_residency}
        # read every original before the first `place` re-points a param (MASTER needs the fp32 values)
        originals = {place.slot.tensor: place.param.detach() for places in self._places.values() for place in places}
        for chunk in layout.chunks:
            places = self._places.get(chunk.id, [])
            for lst in layout.lists:
                tiers = resident.get((lst, chunk.id), ())
                if not tiers:
                    continue
                data = None
                if lst in (ChunkList.PARAM, ChunkList.MASTER):
                    data = torch.zeros(chunk.elements, dtype=self.store.dtypes[lst])
                    for place in places:
                        s = place.slot
                        data[s.offset_elements:s.offset_elements + s.numel].copy_(originals[s.tensor].reshape(-1))
                for tier in tiers:
                    self.store.place(lst, chunk.id, tier, data)
        # a param whose PARAM chunk starts off DEVICE was not re-pointed by `place`: free it now
        for chunk, places in self._places.items():
            if self.store.device_tensor(ChunkList.PARAM, chunk) is None:
                for place in places:
                    place.param.data = self._placeholder[self.compute_dtype]

    # ------------------------------------------------------------------------------ replay
    def _on_event(self, event: MomentEvent) -> None:
        now = time.perf_counter()
        m = self.cursor
        if self.state is EngineState.FAILED:
            raise ExecutorError(f"the replay stopped earlier ({self._failure}); build a new engine after fixing it")
        if self.state is EngineState.DETACHED:
            return
        moments = self.schedule.moments
        if m >= len(moments):
            self._fail(f"moment {m}: the model reported {_describe(event)} after the schedule's last moment. {_RERECORD}")
        ref = moments[m]
        if (ref.phase, ref.kind, ref.module) != (event.phase, event.kind, event.module):
            hint = ""
            if m == self._first_optimizer_moment and event.phase is not Phase.OPTIMIZER:
                hint = " (call engine.step() after every loss.backward())"
            elif m == 0 or event.kind is MomentKind.PRE_FORWARD and event.module == "":
                hint = " (one forward and one backward per iteration, then engine.step())"
            self._fail(f"moment {m}: the schedule expects {ref.phase.value} {ref.kind.value} of "
                       f"{ref.module or '<root>'!r}, the model did {_describe(event)}{hint}. {_RERECORD}")
        if m == 0:
            self._enter(EngineState.REPLAYING)
            self._stats.begin_iteration(self)
            self._push_saved_hooks()
        else:
            self._stats.add_phase(moments[m - 1].phase, now - self._last_event_seconds, last_backward=(m == self._first_optimizer_moment))
        if ref.module in self._swapped:
            block = self._swapped[ref.module]
            if ref.kind is MomentKind.PRE_FORWARD:
                self._capturing = block
                self._activations[block] = _BlockActivations()
            elif ref.kind is MomentKind.POST_FORWARD:
                self._capturing = None
            elif ref.kind is MomentKind.POST_BACKWARD:
                self._activations.pop(block, None)  # its backward is done: nothing unpacks them again
        if ref.kind is MomentKind.PRE_BACKWARD and ref.module == "":
            self._pop_saved_hooks()  # forward is over: nothing more is saved
        with torch.profiler.record_function(f"tide.moment[{m}]"):
            self._apply(m)
        self.cursor = m + 1
        self._last_event_seconds = now  # the actions' time belongs to moment m's work

    def _apply(self, m: int) -> None:
        store = self.store
        final = self.micro_step == self.accumulation_steps - 1
        for index, a in self._actions[m]:
            why = f"moment {m} action {index} ({a.op.value})"
            op = a.op
            if a.list is ChunkList.GRAD and op is not Op.ALLOCATE:
                self._fill_gaps(a.chunk)  # the chunk is read (copied) or dropped: no unset element left
            if op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK):
                store.copy(a.list, a.chunk, a.src, a.dst, a.channel, why=why)
                if op is Op.FETCH:
                    store.wait(a.list, a.chunk, a.dst)
            elif op is Op.EVICT:
                if a.list is ChunkList.GRAD and not final and store.valid_tiers(a.list, a.chunk) == [a.src]:
                    # accumulating: the grads of this chunk are not dead yet, keep them on HOST
                    if a.src is Tier.HOST:
                        continue
                    store.copy(a.list, a.chunk, Tier.DEVICE, Tier.HOST, Channel.D2H, why=f"{why}, kept for accumulation")
                store.evict(a.list, a.chunk, a.src, why=why)
            elif op is Op.ALLOCATE:
                tiers = store.valid_tiers(a.list, a.chunk) if a.list is ChunkList.GRAD else []
                if a.dst in tiers:
                    continue  # accumulating in place
                if tiers:  # accumulating: bring the partial sums back instead of zeros
                    store.copy(a.list, a.chunk, tiers[0], a.dst, COPY_CHANNELS[(tiers[0], a.dst)], why=f"{why}, accumulated grads")
                    store.evict(a.list, a.chunk, tiers[0], why=f"{why}, accumulated grads moved")
                else:
                    if a.list is ChunkList.GRAD:
                        # no memset: each grad is copied into its slot on arrival, the gaps are zeroed
                        # before the chunk is first read (plain PyTorch does not zero grads either)
                        store.allocate(a.list, a.chunk, a.dst, why=why, zero=False)
                        self._unfilled[a.chunk] = set(self._trainable_by_chunk.get(a.chunk, ()))
                    else:
                        store.allocate(a.list, a.chunk, a.dst, why=why)
            elif op is Op.ACT_OFFLOAD:
                self._activations_move(a.block, Tier.HOST, a.channel, why=why)
            elif op is Op.ACT_RELOAD:
                self._activations_move(a.block, Tier.DEVICE, a.channel, why=why)
            elif op is Op.OPTIMIZER_STEP:
                if final and not self._found_inf:
                    self._optimizer_step(a.chunk, a.dst, why=why)
            else:
                raise ExecutorError(f"{why}: {op.value} is not supported by this executor; re-solve without it")
        for chunk in self._needs[m]:
            store.tensor(ChunkList.PARAM, chunk, Tier.DEVICE, why=f"the work of moment {m}")

    def _optimizer_step(self, chunk: int, tier: Tier, *, why: str) -> None:
        store = self.store
        self._fill_gaps(chunk)
        start = time.perf_counter()
        lists = [ChunkList.PARAM, ChunkList.M, ChunkList.V] + ([ChunkList.MASTER] if self._has_master else [])
        for lst in lists:
            store.drop_readers(lst, chunk, tier)  # a write-back still reading the old values
        payload = {lst: store.tensor(lst, chunk, tier, why=why) for lst in [*lists, ChunkList.GRAD]}
        skip = [t for t in self._trainable_by_chunk.get(chunk, ()) if t not in self._grad_seen]
        grad_scale = self._grad_scale
        if self._clip_coefficient is not None and payload[ChunkList.GRAD].dtype == torch.float32:
            # what clip_grad_norm_ does (grads *= coefficient), so fp32 clipping stays bit-identical
            payload[ChunkList.GRAD].mul_(self._clip_coefficient)
            grad_scale = self.scaler.inv_scale if self.scaler is not None else 1.0
        self.optimizer.step_chunk(chunk, param=payload[ChunkList.PARAM], grad=payload[ChunkList.GRAD],
                                  master=payload.get(ChunkList.MASTER), exp_avg=payload[ChunkList.M],
                                  exp_avg_sq=payload[ChunkList.V], grad_scale=grad_scale, skip_tensors=skip)
        for lst in lists:
            store.updated(lst, chunk, tier)
        self._stats.optimizer_seconds[tier] += time.perf_counter() - start

    def _step_now(self) -> None:
        """The OPTIMIZER moment(s), driven by optimizer.step()."""
        if self.state is EngineState.FAILED:
            raise ExecutorError(f"the replay stopped earlier ({self._failure}); build a new engine after fixing it")
        if self.cursor != self._first_optimizer_moment:
            raise ExecutorError(f"engine.step() at moment {self.cursor}: the schedule's optimizer moment is "
                                f"{self._first_optimizer_moment}; call it once after every loss.backward()")
        final = self.micro_step == self.accumulation_steps - 1
        self._grad_scale, self._found_inf, self._clip_coefficient = 1.0, False, None
        if final:
            self._prepare_step()
        for _ in self._optimizer_moments:
            self._on_event(MomentEvent(MomentKind.OPTIMIZER_STEP, Phase.OPTIMIZER, "", -1))
        if final:
            for chunk in list(self._unfilled):
                self._fill_gaps(chunk)
            for chunk in range(len(self.schedule.layout.chunks)):  # a GRAD chunk kept across iterations
                for tier in self.store.valid_tiers(ChunkList.GRAD, chunk):
                    self.store.tensor(ChunkList.GRAD, chunk, tier, why="clearing dead grads").zero_()
            if self.scaler is not None:
                self.scaler.update(self._found_inf)
            self._grad_seen.clear()
        self._stats.add_phase(Phase.OPTIMIZER, time.perf_counter() - self._last_event_seconds, last_backward=False)
        self.micro_step = (self.micro_step + 1) % self.accumulation_steps
        self.iterations += 1
        self.cursor = 0
        self._enter(EngineState.IDLE)
        self._stats.end_iteration(self)

    def _prepare_step(self) -> None:
        """Before the first OPTIMIZER_STEP of the window: loss-scale overflow and the clip coefficient."""
        if self.scaler is None and self.grad_clip_norm is None:
            return
        inv_scale = self.scaler.inv_scale if self.scaler is not None else 1.0
        flats: dict[int, torch.Tensor] = {}
        for chunk in self._trainable_by_chunk:
            self._fill_gaps(chunk)
            tiers = self.store.valid_tiers(ChunkList.GRAD, chunk)
            if not tiers:
                raise ExecutorError(f"schedule violation: GRAD chunk {chunk} has no valid copy at the optimizer moment")
            flats[chunk] = self.store.tensor(ChunkList.GRAD, chunk, tiers[0], why="the optimizer moment")
            if self.scaler is not None:
                self.scaler.check(flats[chunk])
        self._found_inf = self.scaler.found_inf() if self.scaler is not None else False
        coefficient = 1.0
        if self.grad_clip_norm is not None and not self._found_inf:
            # per-tensor norms in model.parameters() order, combined as clip_grad_norm_ does, so the
            # coefficient is the plain loop's to the last bit wherever the GRAD chunks live
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            for slot in self._clip_order:
                if slot.tensor in self._grad_seen:
                    view = flats[slot.chunk][slot.offset_elements:slot.offset_elements + slot.numel]
                    groups[(view.device, view.dtype)].append(view)
            norms = [n.float().to(self.device) for views in groups.values() for n in torch._foreach_norm(views, 2.0)]
            if norms:
                total = torch.linalg.vector_norm(torch.stack(norms), 2.0) * inv_scale
                coefficient = float(torch.clamp(self.grad_clip_norm / (total + 1e-6), max=1.0))
        self._clip_coefficient = coefficient if self.grad_clip_norm is not None else None
        self._grad_scale = coefficient * inv_scale

    # ------------------------------------------------------------------------------ hooks' work
    def _grad_ready(self, param: nn.Parameter, slot: TensorSlot) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        flat = self.store.tensor(ChunkList.GRAD, slot.chunk, Tier.DEVICE, why=f"the grad of {slot.names[0]!r}")
        view = flat[slot.offset_elements:slot.offset_elements + slot.numel].view(slot.shape)
        unfilled = self._unfilled.get(slot.chunk)
        if unfilled is not None and slot.tensor in unfilled:
            view.copy_(grad)  # the slot's first grad since ALLOCATE (0 + g == g)
            unfilled.discard(slot.tensor)
        else:
            view.add_(grad)
        self._grad_seen.add(slot.tensor)

    def _fill_gaps(self, chunk: int) -> None:
        """Zero what no grad was copied into since ALLOCATE: unused params' slots, frozen params', padding."""
        unfilled = self._unfilled.pop(chunk, None)
        if unfilled is None:
            return
        tiers = self.store.valid_tiers(ChunkList.GRAD, chunk)
        flat = self.store.tensor(ChunkList.GRAD, chunk, tiers[0], why="zeroing grads no param produced")
        for start, end in self._grad_gaps[chunk]:
            flat[start:end].zero_()
        for tensor in unfilled:
            s = self._slots[tensor]
            flat[s.offset_elements:s.offset_elements + s.numel].zero_()

    def _on_device_change(self, lst: ChunkList, chunk: int, tensor: torch.Tensor | None) -> None:
        if lst is not ChunkList.PARAM:
            return
        if tensor is None:
            self._device_storage = {k: v for k, v in self._device_storage.items() if v != chunk}
            for place in self._places.get(chunk, ()):
                place.param.data = self._placeholder[self.compute_dtype]
            return
        self._device_storage[tensor.untyped_storage().data_ptr()] = chunk
        for place in self._places.get(chunk, ()):
            s = place.slot
            place.param.data = tensor[s.offset_elements:s.offset_elements + s.numel].view(s.shape)

    def _push_saved_hooks(self) -> None:
        if not (self._evicts_params or self._swapped) or self._saved_hooks_on:
            return
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self._saved_hooks_on = True

    def _pop_saved_hooks(self) -> None:
        if self._saved_hooks_on:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks_on = False

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device == self.device and tensor.dtype == self.compute_dtype:
            chunk = self._device_storage.get(tensor.untyped_storage().data_ptr())
            if chunk is not None:
                return _ChunkRef(chunk, tensor.storage_offset(), tensor.size(), tensor.stride())
        if self._capturing is not None and tensor.layout is torch.strided:
            return self._activations[self._capturing].add(self._capturing, tensor)
        return tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _ChunkRef):
            flat = self.store.tensor(ChunkList.PARAM, packed.chunk, Tier.DEVICE, why="backward (a param saved in forward)")
            return flat.as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _SavedRef):
            acts = self._activations.get(packed.block)
            if acts is None:
                raise ExecutorError(f"block {packed.block}'s saved activations are gone (its backward already ended)")
            return acts.get(packed, self.store)
        return packed

    def _activations_move(self, block: int, to: Tier, channel: Channel, *, why: str) -> None:
        acts = self._activations.get(block)
        if acts is None:
            raise ExecutorError(f"schedule violation: {why} moves block {block}'s activations, which were not captured")
        nbytes = acts.move(to, self.store, pin=self.store.on_gpu, device=self.device)
        self.store.bytes_per_channel[channel] += nbytes

    # ------------------------------------------------------------------------------ states
    def _enter(self, to: EngineState) -> None:
        if self.state is to:
            return
        if (self.state, to) not in _ENGINE_TRANSITIONS:
            raise ExecutorError(f"internal error: engine cannot go from {self.state.value} to {to.value}")
        self.state = to

    def _fail(self, message: str) -> None:
        self._failure = message
        self._pop_saved_hooks()
        self._enter(EngineState.FAILED)
        raise ExecutorError(message)

    def _require_idle(self, what: str) -> None:
        if self.state is not EngineState.IDLE:
            raise ExecutorError(f"engine.{what} between iterations only (after engine.step()), the engine is "
                                f"{self.state.value} at moment {self.cursor}")


class _Counters:
    """Counters of the iteration in progress and of the last complete one."""

    def __init__(self) -> None:
        self.bytes_at_start: dict[Any, int] = {}
        self.stall_at_start = 0.0
        self.iteration_start = 0.0
        self.phase_seconds: dict[Phase, float] = defaultdict(float)
        self.optimizer_seconds: dict[Tier, float] = defaultdict(float)
        self.last: dict[str, Any] = {}

    def begin_iteration(self, engine: Engine) -> None:
        self.bytes_at_start = dict(engine.store.bytes_per_channel)
        self.stall_at_start = engine.store.stall_seconds
        self.iteration_start = time.perf_counter()
        self.phase_seconds = defaultdict(float)
        self.optimizer_seconds = defaultdict(float)

    def add_phase(self, phase: Phase, seconds: float, *, last_backward: bool) -> None:
        if not last_backward:  # from root post_backward to engine.step() is the user's time
            self.phase_seconds[phase] += seconds

    def end_iteration(self, engine: Engine) -> None:
        store = engine.store
        self.last = {
            "bytes_per_channel": {ch: n - self.bytes_at_start.get(ch, 0) for ch, n in store.bytes_per_channel.items()},
            "stall_seconds": store.stall_seconds - self.stall_at_start,
            "iteration_seconds": time.perf_counter() - self.iteration_start,
            "seconds_per_phase": dict(self.phase_seconds),
            "optimizer_seconds_per_tier": dict(self.optimizer_seconds),
        }

    def snapshot(self, engine: Engine) -> EngineStats:
        last = self.last
        return EngineStats(
            iterations=engine.iterations,
            bytes_per_channel={ch: n for ch, n in last.get("bytes_per_channel", {}).items() if n},
            total_bytes_per_channel={ch: n for ch, n in engine.store.bytes_per_channel.items() if n},
            stall_seconds=last.get("stall_seconds", 0.0),
            peak_bytes_per_tier={tier: pool.peak_bytes for tier, pool in engine.store.pools.items()},
            seconds_per_phase=last.get("seconds_per_phase", {}),
            optimizer_seconds_per_tier=last.get("optimizer_seconds_per_tier", {}),
            iteration_seconds=last.get("iteration_seconds", 0.0),
        )


def run(model: nn.Module, schedule: Schedule | str | Path, **kwargs: Any) -> Engine:
    """Attach `model` to `schedule` (a Schedule or a schedule file) and return the engine; see `Engine`.

    Keyword arguments: params (iterable of Parameters or param groups; default: decay on matrices,
    none on norms/biases), optimizer ("adamw" | "adam"), lr, betas, eps, weight_decay,
    grad_clip_norm (global, across tiers; None: off), precision ("fp32" | "bf16" | "fp16", None: the
    schedule's), grad_accumulation_steps, nvme_dir (reserved for the NVME tier), device ("auto" |
    "cpu" | "cuda[:i]"; "cpu" emulates DEVICE with a CPU pool of the schedule's budget).
    """
    if not isinstance(schedule, Schedule):
        schedule = Schedule.read(schedule)
    return Engine(model, schedule, **kwargs)


def _uses_nvme(schedule: Schedule) -> bool:
    return any(Tier.NVME in r.tiers for r in schedule.initial_residency) or any(
        Tier.NVME in (a.src, a.dst) for a in schedule.actions if a.op not in (Op.ACT_OFFLOAD, Op.ACT_RELOAD))


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExecutorError(f"device={device!r}: no CUDA device here; pass device='cpu' (emulated DEVICE) or 'auto'")
    if dev.type not in ("cpu", "cuda"):
        raise ExecutorError(f"device={device!r}: expected 'auto', 'cpu' or 'cuda[:i]'")
    return dev


def _describe(event: MomentEvent) -> str:
    return f"{event.phase.value} {event.kind.value} of {event.module or '<root>'!r}"


__all__ = ["Engine", "EngineState", "check_model", "default_param_groups", "run"]
