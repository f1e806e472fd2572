"""Hand-built schedules for the executor tests (no planner): a simple, fully explicit policy.

Policy (PatrickStar-like, written out as schedule actions):
- chunks never span units; the PARAM chunks of non-block units (embeddings, final norm, a tied
  head) stay on DEVICE; block PARAM chunks live on HOST and, with `offload_blocks`, are FETCHed at
  the block's pre_forward / pre_backward and EVICTed at its post_forward / post_backward;
- GRAD: ALLOCATE on DEVICE at the unit's first backward moment, WRITE_BACK to HOST + EVICT at its
  post_backward (the root's for persistent chunks) when the optimizer step of the chunk runs on
  HOST; kept on DEVICE when it runs there;
- OS (MASTER, M, V) on `os_tier`; the OPTIMIZER_STEP runs there, at the OPTIMIZER moment, or (with
  `overlap`) for HOST block chunks right after their grads reached HOST;
- after a HOST step a DEVICE PARAM copy is stale: EVICT + FETCH again; after a DEVICE step the HOST
  PARAM copy is refreshed by a WRITE_BACK (block chunks) so the next iteration starts the same.
The DEVICE budget is the policy's own peak of chunk bytes plus the peak of the activation bytes the
blocks save (measured with an all-KEEP ActivationManager on a copy of the model): both count against
it in the engine. `prediction.peak_bytes_per_tier[DEVICE]` is the chunk peak alone (one byte less
must fail).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from executor.hooks import MomentEvent, MomentHooks, find_blocks, find_units
from schemas.schedule import (
    Action, ActivationMode, ActivationPlan, Budgets, Channel, Chunk, ChunkLayout, ChunkList, ChunkPlan, MomentRef, Op,
    Prediction, Residency, Schedule, ScheduleHeader, SolverStatus, Stage, TensorSlot, Tier,
)
from schemas.trace import DTYPE_BYTES, DType, MomentKind, Phase

DIGEST = "sha256:" + "0" * 64


def record_events(model: nn.Module, iteration: Callable[[nn.Module], None]) -> list[MomentEvent]:
    """The moment events of one iteration of a copy of `model` (the model itself is untouched)."""
    twin = copy.deepcopy(model)
    blocks = find_blocks(twin)
    events: list[MomentEvent] = []
    with MomentHooks(twin, blocks=blocks, units=find_units(twin, blocks), on_event=events.append):
        iteration(twin)
    events.append(MomentEvent(MomentKind.OPTIMIZER_STEP, Phase.OPTIMIZER, "", -1))
    return events


def activation_peak_bytes(model: nn.Module, iteration: Callable[[nn.Module], None]) -> int:
    """The peak of the activation bytes the blocks of a copy of `model` hold in one iteration, all KEEP."""
    from executor.activations import ActivationManager

    twin = copy.deepcopy(model)
    with ActivationManager(twin, {}) as manager:
        iteration(twin)
        return manager.stats().peak_live_bytes


def build_schedule(model: nn.Module, iteration: Callable[[nn.Module], None], *, compute: DType = DType.FLOAT32,
                   chunk_elements: int = 4096, offload_blocks: bool = True, os_tier: Tier = Tier.HOST,
                   overlap: bool = False, device_bytes: int | None = None) -> Schedule:
    if offload_blocks and os_tier is Tier.DEVICE:
        raise NotImplementedError("this test policy steps on DEVICE only when nothing is offloaded")
    events = record_events(model, iteration)
    blocks = find_blocks(model)
    units = find_units(model, blocks)
    modules = dict(model.named_modules())
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of[id(p)].append(name)
    # tensors grouped by owning unit (first unit in `units` order that holds them), root last
    owner: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for unit in [*units, ""]:
        for p in modules[unit].parameters():
            if id(p) not in owner:
                owner[id(p)], params[id(p)] = unit, p
    # layout: per unit, tensors in chunks of at most chunk_elements (a bigger tensor gets its own)
    slots: list[TensorSlot] = []
    chunks: list[Chunk] = []
    unit_chunks: dict[str, list[int]] = defaultdict(list)
    tensor_ids: dict[int, int] = {}
    for unit in [*units, ""]:
        fill = None
        for pid, p in params.items():
            if owner[pid] != unit:
                continue
            n = p.numel()
            if fill is None or fill[1] + n > chunk_elements:
                fill = [len(chunks), 0]
                chunks.append(None)  # placeholder, sized below
                unit_chunks[unit].append(fill[0])
            tid = len(slots)
            tensor_ids[pid] = tid
            slots.append(TensorSlot(tensor=tid, names=tuple(names_of[pid]), shape=tuple(p.shape), chunk=fill[0],
                                    offset_elements=fill[1], numel=n, trainable=p.requires_grad))
            fill[1] += n
    used: dict[int, int] = defaultdict(int)
    for s in slots:
        used[s.chunk] = max(used[s.chunk], s.offset_elements + s.numel)
    block_of_unit = {b: i for i, b in enumerate(blocks)}
    chunk_unit = {c: u for u, cs in unit_chunks.items() for c in cs}
    chunks = [Chunk(id=c, elements=max(chunk_elements, used[c]), used_elements=used[c],
                    block=block_of_unit.get(chunk_unit[c], -1), comm_group=c, owner_rank=0) for c in range(len(chunks))]
    lists = [ChunkList.PARAM, ChunkList.GRAD] + ([ChunkList.MASTER] if compute is not DType.FLOAT32 else []) + [
        ChunkList.M, ChunkList.V]
    dtypes = {lst: (compute if lst in (ChunkList.PARAM, ChunkList.GRAD) else DType.FLOAT32) for lst in lists}
    os_lists = [lst for lst in lists if lst not in (ChunkList.PARAM, ChunkList.GRAD)]
    layout = ChunkLayout(chunk_elements=chunk_elements, lists=tuple(lists), list_dtypes=dtypes, chunks=tuple(chunks),
                         tensors=tuple(slots))

    def nbytes(lst: ChunkList, c: int) -> int:
        return chunks[c].elements * DTYPE_BYTES[dtypes[lst]]

    offloaded = {c for u in blocks for c in unit_chunks[u]} if offload_blocks else set()
    persistent = [c for c in range(len(chunks)) if c not in offloaded]
    trainable_chunks = sorted({s.chunk for s in slots if s.trainable})
    host_step = os_tier is Tier.HOST

    actions: list[Action] = []
    moments: list[MomentRef] = []

    def act(m: int, op: Op, lst: ChunkList | None = None, c: int = -1, src: Tier | None = None,
            dst: Tier | None = None) -> None:
        channel, n = None, 0
        if op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK):
            channel = Channel.H2D if dst is Tier.DEVICE else Channel.D2H
            n = nbytes(lst, c)
        elif op is Op.OPTIMIZER_STEP:
            channel = Channel.CPU_OPTIMIZER if dst is Tier.HOST else Channel.COMPUTE
        actions.append(Action(moment=m, op=op, list=lst, chunk=c, src=src, dst=dst, channel=channel, bytes=n))

    unit_tensors = {u: tuple(tensor_ids[id(p)] for p in modules[u].parameters()) for u in units}
    stepped: set[int] = set()

    def step(m: int, c: int) -> None:
        stepped.add(c)
        act(m, Op.OPTIMIZER_STEP, c=c, dst=os_tier)
        if host_step:
            act(m, Op.EVICT, ChunkList.GRAD, c, src=Tier.HOST)
            if c in persistent:  # the DEVICE compute copy is stale now
                act(m, Op.EVICT, ChunkList.PARAM, c, src=Tier.DEVICE)
                act(m, Op.FETCH, ChunkList.PARAM, c, src=Tier.HOST, dst=Tier.DEVICE)
        else:
            act(m, Op.EVICT, ChunkList.GRAD, c, src=Tier.DEVICE)

    def release_grads(m: int, cs: list[int]) -> None:
        for c in cs:
            if c not in trainable_chunks:
                continue
            if host_step:
                act(m, Op.WRITE_BACK, ChunkList.GRAD, c, src=Tier.DEVICE, dst=Tier.HOST)
                act(m, Op.EVICT, ChunkList.GRAD, c, src=Tier.DEVICE)
                if overlap and c in offloaded:
                    step(m, c)

    for m, ev in enumerate(events):
        tensors: tuple[int, ...] = ()
        unit = ev.module
        if ev.kind is MomentKind.PRE_FORWARD and unit:
            tensors = unit_tensors[unit]
            for c in unit_chunks[unit]:
                if c in offloaded:
                    act(m, Op.FETCH, ChunkList.PARAM, c, src=Tier.HOST, dst=Tier.DEVICE)
        elif ev.kind is MomentKind.POST_FORWARD and unit:
            for c in unit_chunks[unit]:
                if c in offloaded:
                    act(m, Op.EVICT, ChunkList.PARAM, c, src=Tier.DEVICE)
        elif ev.kind is MomentKind.PRE_BACKWARD and unit == "":
            for c in persistent:
                if c in trainable_chunks:
                    act(m, Op.ALLOCATE, ChunkList.GRAD, c, dst=Tier.DEVICE)
        elif ev.kind is MomentKind.PRE_BACKWARD:
            tensors = unit_tensors[unit]
            for c in unit_chunks[unit]:
                if c in offloaded:
                    act(m, Op.FETCH, ChunkList.PARAM, c, src=Tier.HOST, dst=Tier.DEVICE)
                    if c in trainable_chunks:
                        act(m, Op.ALLOCATE, ChunkList.GRAD, c, dst=Tier.DEVICE)
        elif ev.kind is MomentKind.POST_BACKWARD and unit:
            cs = [c for c in unit_chunks[unit] if c in offloaded]
            for c in cs:
                act(m, Op.EVICT, ChunkList.PARAM, c, src=Tier.DEVICE)
            release_grads(m, cs)
        elif ev.kind is MomentKind.POST_BACKWARD:
            release_grads(m, [c for c in persistent])
        elif ev.phase is Phase.OPTIMIZER:
            for c in trainable_chunks:
                if c not in stepped:
                    step(m, c)
        moments.append(MomentRef(id=m, phase=ev.phase, kind=ev.kind, module=ev.module, block=ev.block, tensors=tensors,
                                 compute_seconds=0.0, flops=0, non_model_bytes=0))

    residency = []
    for c in range(len(chunks)):
        tiers = (Tier.DEVICE, Tier.HOST) if c in persistent and host_step else (
            (Tier.DEVICE,) if c in persistent else (Tier.HOST,))
        residency.append(Residency(list=ChunkList.PARAM, chunk=c, tiers=tiers))
        for lst in os_lists:
            residency.append(Residency(list=lst, chunk=c, tiers=(os_tier,)))

    # replay the residency to find the DEVICE peak and the bytes per channel
    on_device = {(r.list, r.chunk) for r in residency if Tier.DEVICE in r.tiers}
    current = sum(nbytes(lst, c) for lst, c in on_device)
    peak = current
    per_channel: dict[Channel, int] = defaultdict(int)
    for a in actions:
        if a.op in (Op.FETCH, Op.WRITE_BACK, Op.PREFETCH):
            per_channel[a.channel] += a.bytes
        if a.dst is Tier.DEVICE and a.op in (Op.FETCH, Op.ALLOCATE) and (a.list, a.chunk) not in on_device:
            on_device.add((a.list, a.chunk))
            current += nbytes(a.list, a.chunk)
        elif a.op is Op.EVICT and a.src is Tier.DEVICE:
            on_device.discard((a.list, a.chunk))
            current -= nbytes(a.list, a.chunk)
        peak = max(peak, current)
    header = ScheduleHeader(planner_version="test", policy="test-blockwise", model_name=type(model).__name__,
                            trace_digest=DIGEST, hardware_name="cpu-emulated", hardware_digest=DIGEST, world_size=1,
                            solver_status=SolverStatus.HEURISTIC, objective_seconds=0.0, lower_bound_seconds=0.0,
                            gap=0.0, notes=())
    return Schedule(
        header=header,
        budgets=Budgets(device_bytes=peak + activation_peak_bytes(model, iteration) if device_bytes is None
                        else device_bytes, host_bytes=1 << 40, nvme_bytes=0),
        layout=layout,
        chunk_plans=tuple(ChunkPlan(chunk=c, os_tier=os_tier, optimizer_tier=os_tier) for c in range(len(chunks))),
        activation_plans=tuple(ActivationPlan(block=i, module=b, mode=ActivationMode.KEEP, bytes=0, input_bytes=0,
                                              recompute_seconds=0.0, recompute_flops=0) for i, b in enumerate(blocks)),
        moments=tuple(moments),
        stages=(Stage(id=0, name="all", phase=Phase.FORWARD, block=-1, first_moment=0, last_moment=len(moments) - 1,
                      predicted_seconds=0.0),),
        initial_residency=tuple(residency),
        actions=tuple(actions),
        prediction=Prediction(iteration_seconds=0.0, flops=0, bytes_per_channel=dict(per_channel),
                              busy_seconds_per_channel={}, peak_bytes_per_tier={Tier.DEVICE: peak}),
    )


def device_peak(schedule: Schedule) -> int:
    return schedule.prediction.peak_bytes_per_tier[Tier.DEVICE]


def clone_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
