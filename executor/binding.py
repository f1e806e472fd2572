"""Parameter <-> chunk binding: where each param lives in its chunks, and the hooks that keep it there.

`ParamBinding` is a part of `executor.runtime.Engine` (a mixin: it works on the engine's `store`,
`schedule`, `device` and `compute_dtype`) that owns the per-chunk view of the layout and three
mechanisms (PatrickStar §6.2, Algorithms 1-2):

- params: every `param.data` points into its PARAM chunk on DEVICE, or at an empty placeholder
  while the chunk is elsewhere (`_on_device_change`, called by the store);
- grads: a post-accumulate-grad hook per Parameter (tied params are one Parameter) adds
  `param.grad` into the param's slot of its GRAD chunk on DEVICE and sets `param.grad = None`;
- saved tensors: see the note "saved params" below.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import torch
from torch import nn

from executor.dtypes import TORCH_DTYPES
from executor.errors import ExecutorError
from executor.store import ChunkStore
from schemas.schedule import OS_LISTS, ChunkList, Schedule, TensorSlot, Tier

# Note "saved params": when the schedule evicts PARAM chunks from DEVICE, tensors autograd saves whose
# storage is a DEVICE PARAM payload (a weight, `weight.t()`...) are saved as (chunk, offset, size,
# stride) through `torch.autograd.graph.saved_tensors_hooks` and rebuilt from the chunk's DEVICE
# payload of the moment backward needs them, so they never pin (or read a reused buffer of) an
# evicted chunk. The activation manager stores such a tensor as the same `ChunkRef` (never copied,
# never swapped).


class _Place(NamedTuple):
    """A param's place in its chunk."""

    param: nn.Parameter
    slot: TensorSlot


class ChunkRef(NamedTuple):
    """A saved tensor that lives in a PARAM chunk: rebuilt from the chunk's DEVICE payload on unpack."""

    chunk: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class ParamBinding:
    """The engine's param/grad/saved-tensor binding to the chunks (module docstring)."""

    store: ChunkStore
    schedule: Schedule
    device: torch.device
    compute_dtype: torch.dtype
    _evicts_params: bool
    _grad_seen: set[int]
    _saved_hooks: torch.autograd.graph.saved_tensors_hooks | None
    _saved_hooks_on: bool

    def _bind_layout(self, model: nn.Module, by_name: dict[str, nn.Parameter]) -> None:
        """The layout per chunk: each param's place, the trainable slots, the grad gaps."""
        layout = self.schedule.layout
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

    def _register_grad_hooks(self, by_name: dict[str, nn.Parameter]) -> list[Any]:
        """One post-accumulate-grad hook per trainable Parameter (once for tied names)."""
        handles = []
        for places in self._places.values():
            for place in places:
                if place.slot.trainable and place.param is by_name[place.slot.names[0]]:
                    handles.append(place.param.register_post_accumulate_grad_hook(
                        lambda p, slot=place.slot: self._grad_ready(p, slot)))
        return handles

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
                    # several ranks: a rank holds the chunks it owns, plus every PARAM chunk on DEVICE
                    if (self.comm is None or (tier is Tier.DEVICE and lst is ChunkList.PARAM)
                            or chunk.owner_rank == self.rank):
                        self.store.place(lst, chunk.id, tier, data)
        # a param whose PARAM chunk starts off DEVICE was not re-pointed by `place`: free it now
        for chunk, places in self._places.items():
            if self.store.device_tensor(ChunkList.PARAM, chunk) is None:
                for place in places:
                    place.param.data = self._placeholder[self.compute_dtype]

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
        self._device_storage[(tensor.device.type, tensor.untyped_storage().data_ptr())] = chunk
        for place in self._places.get(chunk, ()):
            s = place.slot
            place.param.data = tensor[s.offset_elements:s.offset_elements + s.numel].view(s.shape)

    # Note [state_dict while attached]
    # `model.state_dict()` (of the model or any submodule) while attached returns the real values:
    # a state-dict hook on every module that owns params replaces each param's entry (a placeholder
    # or a view into a reusable chunk buffer) by a CPU copy read from its PARAM chunk, wherever it
    # lives (executor.state reads the same way). It costs nothing per iteration (it runs only when
    # state_dict is called); in the middle of an iteration it raises (the chunks are moving).
    # `param.data` itself stays a placeholder while its chunk is off DEVICE: read params through
    # `model.state_dict()` or `engine.state_dict()`, not `named_parameters()`.
    def _register_state_dict_hooks(self, model: nn.Module) -> list[Any]:
        slot_of = {id(place.param): place.slot for places in self._places.values() for place in places}
        handles = []
        self._sd_cache: dict[int, torch.Tensor] | None = None
        self._sd_off = False  # the engine's own state_dict reads the chunks itself
        for module in model.modules():
            own = [(local, slot_of[id(p)]) for local, p in module._parameters.items()
                   if p is not None and id(p) in slot_of]
            if own:
                handles.append(module._register_state_dict_hook(
                    lambda mod, sd, prefix, meta, own=own: self._fill_state_dict(sd, prefix, own)))
        handles.append(model.register_state_dict_pre_hook(self._state_dict_begins))
        handles.append(model._register_state_dict_hook(self._state_dict_ends))
        return handles

    def _state_dict_begins(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._sd_cache = {}  # one read per chunk for the whole model.state_dict()

    def _state_dict_ends(self, module: nn.Module, sd: Any, prefix: str, meta: Any) -> None:
        self._sd_cache = None

    def _fill_state_dict(self, sd: Any, prefix: str, own: list[tuple[str, TensorSlot]]) -> None:
        if self._sd_off:
            return
        self._state_dict_allowed()
        cache = self._sd_cache if self._sd_cache is not None else {}
        for local, s in own:
            key = prefix + local
            if key not in sd:
                continue
            if s.chunk not in cache:
                cache[s.chunk] = self.read_chunk(ChunkList.PARAM, s.chunk)
            value = cache.get(-1 - s.tensor)  # tied names: one tensor under every name, as in PyTorch
            if value is None:
                value = cache[-1 - s.tensor] = cache[s.chunk][s.offset_elements:s.offset_elements + s.numel].view(
                    s.shape).clone()
            sd[key] = value

    def _state_dict_allowed(self) -> None:  # the engine's: raises in the middle of an iteration
        raise NotImplementedError

    def _push_saved_hooks(self) -> None:
        if not self._evicts_params or self._saved_hooks_on:
            return
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self._saved_hooks_on = True

    def _pop_saved_hooks(self) -> None:
        if self._saved_hooks_on:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks_on = False

    def _pack(self, tensor: torch.Tensor) -> Any:
        # recognized by its storage alone, never by comparing devices: "cuda" != "cuda:0" once made evicted
        # chunks' buffers be saved raw (wrong grads, bench/RESULTS.md "GPU (issue 19), session 11")
        if tensor.dtype == self.compute_dtype:
            chunk = self._device_storage.get((tensor.device.type, tensor.untyped_storage().data_ptr()))
            if chunk is not None:
                return ChunkRef(chunk, tensor.storage_offset(), tensor.size(), tensor.stride())
        return tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, ChunkRef):
            flat = self.store.tensor(ChunkList.PARAM, packed.chunk, Tier.DEVICE, why="backward (a param saved in forward)")
            return flat.as_strided(packed.size, packed.stride, packed.offset)
        return packed

    # ---- the ChunkSource protocol of executor.state
    @property
    def layout(self):  # noqa: ANN201 - schemas.schedule.ChunkLayout
        return self.schedule.layout

    def read_chunk(self, list: ChunkList, chunk: int) -> torch.Tensor:  # noqa: A002 - the schemas' word
        """A CPU copy of the chunk's current data, from whichever tier holds a valid copy."""
        self.store.settle()
        tiers = self.store.valid_tiers(list, chunk)
        if not tiers and list in OS_LISTS and chunk not in self._stepped_chunks():
            # a chunk holding no trainable tensor (frozen params, a comm group's padding) has no optimizer
            # state (planner/emit.py initial_residency); it reads as zeros, as its owner's share of a gather
            layout = self.schedule.layout
            return torch.zeros(layout.chunks[chunk].elements, dtype=TORCH_DTYPES[layout.list_dtypes[list]])
        if not tiers:
            raise ExecutorError(f"{list.value} chunk {chunk} has no valid copy between iterations")
        if tiers[0] is Tier.NVME:
            return self.store.read_nvme(list, chunk)
        return self.store.tensor(list, chunk, tiers[0], why="read_chunk").detach().to("cpu", copy=True)

    def _stepped_chunks(self) -> frozenset[int]:
        """Chunks holding at least one trainable tensor: the ones with optimizer state."""
        if getattr(self, "_stepped", None) is None:
            self._stepped = frozenset(s.chunk for s in self.schedule.layout.tensors if s.trainable)
        return self._stepped

    def write_chunk(self, list: ChunkList, chunk: int, tensor: torch.Tensor) -> None:  # noqa: A002
        """Write the chunk into every valid copy (stale copies stay stale: the schedule refreshes them)."""
        self.store.settle()
        tiers = self.store.valid_tiers(list, chunk)
        if not tiers and list in OS_LISTS and chunk not in self._stepped_chunks():
            return  # no optimizer state to write (see read_chunk)
        if not tiers:
            raise ExecutorError(f"{list.value} chunk {chunk} has no valid copy between iterations")
        for tier in tiers:
            if tier is Tier.NVME:
                self.store.write_nvme(list, chunk, tensor.reshape(-1))
            else:
                self.store.tensor(list, chunk, tier, why="write_chunk").copy_(tensor.reshape(-1))
