"""The planning problem: a trace seen through one hardware profile (DESIGN.md §2, §4).

`build_problem` resolves everything the planner needs once, so the layout, the OR-Tools models,
`materialize` and the baselines all read the same numbers; what it resolves is
Note [problem contents] above `build_problem`.
"""

from __future__ import annotations

import functools

from planner.costmodel import device_capacity_bytes, moment_seconds
from planner.errors import PlannerError
from schemas._base import frozen
from schemas.hardware import Hardware
from schemas.schedule import ChunkList, MomentRef, Stage
from schemas.trace import DTYPE_BYTES, DType, Moment, Phase, TimeSource, Trace

NO_MOMENTS = (-1, -1)  # (first, last) of a block that has no moment in a phase


@frozen
class BlockInfo:
    """One repeating block as the planner sees it."""

    id: int
    module: str
    tensors: tuple[int, ...]  # trace tensor ids first used in this block (runtime order)
    param_bytes: int  # bytes of `tensors` in the compute dtype
    activation_bytes: int  # bytes the block saves for backward (what KEEP holds, SWAP moves)
    input_bytes: int  # what RECOMPUTE keeps instead
    recompute_seconds: float  # forward of the block once more, on this hardware
    recompute_flops: int
    forward_moments: tuple[int, int]  # (first, last) moment of its forward, NO_MOMENTS if none
    backward_moments: tuple[int, int]  # (first, last) moment of its backward, NO_MOMENTS if none


@frozen
class Problem:
    """A trace on a hardware profile: the one input of every planner algorithm."""

    trace: Trace
    hardware: Hardware
    trace_digest: str  # "sha256:..." of the trace file's bytes
    moments: tuple[MomentRef, ...]  # compute seconds resolved for `hardware`
    blocks: tuple[BlockInfo, ...]
    stages: tuple[Stage, ...]  # predicted_seconds=0; materialize fills them in
    device_bytes: int  # DEVICE capacity per rank (after overrides)
    host_bytes: int  # HOST capacity per node (shared by its ranks)
    nvme_bytes: int  # NVME capacity per node
    compute_dtype: DType
    lists: tuple[ChunkList, ...]  # PARAM, GRAD, [MASTER], M, V
    world_size: int  # ranks training together: hardware.cluster.world_size
    tensor_order: tuple[int, ...]  # every trace tensor id, first-access order (never-used tensors last)
    tensor_block: tuple[int, ...]  # per tensor id: the block that first uses it, -1 outside blocks
    stage_of_moment: tuple[int, ...]  # per moment: its stage id

    # -- derived views -------------------------------------------------------------------
    @property
    def mixed_precision(self) -> bool:
        return self.compute_dtype is not DType.FLOAT32

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing one node's HOST memory, CPU and SSDs."""
        return min(self.world_size, self.hardware.cluster.gpus_per_node)

    @property
    def optimizer_moment(self) -> int:
        """The first OPTIMIZER moment (where steps that do not overlap backward run)."""
        for m in self.moments:
            if m.phase is Phase.OPTIMIZER:
                return m.id
        return len(self.moments) - 1

    def list_dtype(self, chunk_list: ChunkList) -> DType:
        return self.compute_dtype if chunk_list in (ChunkList.PARAM, ChunkList.GRAD) else DType.FLOAT32

    def list_itemsize(self, chunk_list: ChunkList) -> int:
        return DTYPE_BYTES[self.list_dtype(chunk_list)]

    @property
    def os_lists(self) -> tuple[ChunkList, ...]:
        """Optimizer state lists (PARAM is the master with fp32 compute, so it is not among them)."""
        return _os_lists(self.lists)  # (emit asks for them per chunk: one tuple per list set)

    @property
    def model_flops(self) -> int:
        return sum(m.flops for m in self.moments)

    @property
    def compute_seconds(self) -> float:
        return sum(m.compute_seconds for m in self.moments)

    def stage_non_model_bytes(self, stage: Stage) -> int:
        """Peak recorded non-model bytes over the stage (every block's activations kept)."""
        return max(self.moments[m].non_model_bytes for m in range(stage.first_moment, stage.last_moment + 1))


@functools.cache
def _os_lists(lists: tuple[ChunkList, ...]) -> tuple[ChunkList, ...]:
    return tuple(x for x in lists if x in (ChunkList.MASTER, ChunkList.M, ChunkList.V))


def chunk_lists(compute_dtype: DType) -> tuple[ChunkList, ...]:
    if compute_dtype is DType.FLOAT32:
        return (ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V)
    return (ChunkList.PARAM, ChunkList.GRAD, ChunkList.MASTER, ChunkList.M, ChunkList.V)


# Note [problem contents]:
# `build_problem` resolves everything the planner needs once, so the layout, the OR-Tools models,
# `materialize` and the baselines all read the same numbers:
#
# - moments as the schedule stores them (`MomentRef`), compute seconds resolved for the hardware
#   (measured traces keep their times; meta traces get their GEMM and attention FLOPs at the rates the
#   hardware's tables give for the shapes the model runs, `costmodel.moment_seconds`);
# - blocks with their tensors (those *first used* in the block), parameter and activation bytes and
#   the moments of their forward and backward;
# - stages: maximal runs of consecutive moments with the same (phase, block);
# - capacities per tier (after overrides; DEVICE less the allocator margin `device.memory_margin_gb`) and the chunk lists of the compute dtype (mixed precision
#   adds the fp32 MASTER list; with fp32 compute PARAM is the master);
# - the world size: the hardware's `cluster.world_size`. A trace recorded by one process (meta
#   world_size 1) is one rank's share of data-parallel training (its batch is the per-rank batch),
#   so it is planned for every rank of the hardware; a trace recorded under torchrun with several
#   ranks must agree with the hardware. DEVICE capacity is per rank; HOST and NVME capacities are
#   per node (`cluster.gpus_per_node` ranks share them, `Problem.ranks_per_node`).


def build_problem(
    trace: Trace,
    hardware: Hardware,
    *,
    trace_digest: str,
    device_bytes: int | None = None,
    host_bytes: int | None = None,
    nvme_bytes: int | None = None,
) -> Problem:
    """Resolve `trace` on `hardware`; capacities default to the hardware's usable bytes (DEVICE: less the
    allocator margin the profile keeps free; an explicit `device_bytes` is the budget as given)."""
    _check_agreement(trace, hardware)
    moments = _moment_refs(trace, hardware)
    tensor_order, tensor_block = _first_access(trace)
    blocks = _block_infos(trace, hardware, tensor_order, tensor_block)
    stages = _stages(moments, blocks)
    stage_of_moment = [0] * len(moments)
    for st in stages:
        for m in range(st.first_moment, st.last_moment + 1):
            stage_of_moment[m] = st.id
    return Problem(
        trace=trace,
        hardware=hardware,
        trace_digest=trace_digest,
        moments=moments,
        blocks=blocks,
        stages=stages,
        device_bytes=device_capacity_bytes(hardware) if device_bytes is None else int(device_bytes),
        host_bytes=hardware.host_bytes if host_bytes is None else int(host_bytes),
        nvme_bytes=hardware.nvme_bytes if nvme_bytes is None else int(nvme_bytes),
        compute_dtype=trace.meta.compute_dtype,
        lists=chunk_lists(trace.meta.compute_dtype),
        world_size=hardware.cluster.world_size,
        tensor_order=tensor_order,
        tensor_block=tensor_block,
        stage_of_moment=tuple(stage_of_moment),
    )


def _check_agreement(trace: Trace, hardware: Hardware) -> None:
    # one process's trace is one rank's work in data parallel: plan it for the hardware's ranks
    if trace.meta.world_size not in (1, hardware.cluster.world_size):
        raise PlannerError(
            f"trace {trace.meta.model_name!r} was recorded with world_size={trace.meta.world_size} but hardware "
            f"{hardware.name!r} has cluster.world_size={hardware.cluster.world_size}; record the trace with the same "
            "number of ranks (or with one process: its batch is then the per-rank batch) or pick a matching hardware "
            "profile")
    if not any(m.phase is Phase.OPTIMIZER for m in trace.moments):
        raise PlannerError(f"trace {trace.meta.model_name!r} has no OPTIMIZER moment; re-record it with "
                           "`python -m executor record ...` (the recorder emits the optimizer step)")


def _moment_refs(trace: Trace, hardware: Hardware) -> tuple[MomentRef, ...]:
    """The trace's moments with their compute time on `hardware`. The OPTIMIZER moment carries none:
    its work is the schedule's OPTIMIZER_STEP actions, costed at the hardware's optimizer rates on
    the tier each runs on, so the recorded time of the plain optimizer step is not charged again."""
    measured = trace.meta.time_source is TimeSource.MEASURED

    def seconds(m: Moment) -> float:
        if m.phase is Phase.OPTIMIZER:
            return 0.0
        return m.compute_seconds if measured else moment_seconds(hardware, trace, m)

    return tuple(
        MomentRef(id=m.id, phase=m.phase, kind=m.kind, module=m.module, block=m.block, tensors=m.tensors,
                  compute_seconds=seconds(m), flops=m.flops, non_model_bytes=m.non_model_bytes)
        for m in trace.moments
    )


def _first_access(trace: Trace) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Tensors in the order the iteration first touches them, and the block of that first touch."""
    block_of = [-1] * len(trace.tensors)
    seen: dict[int, None] = {}
    for m in trace.moments:
        if m.phase is Phase.OPTIMIZER:
            continue  # the optimizer touches everything; its order says nothing about locality
        for t in m.tensors:
            if t not in seen:
                seen[t] = None
                block_of[t] = m.block
    order = list(seen) + [t.id for t in trace.tensors if t.id not in seen]
    return tuple(order), tuple(block_of)


def _block_infos(trace: Trace, hardware: Hardware, order: tuple[int, ...], block_of: tuple[int, ...]) -> tuple[BlockInfo, ...]:
    itemsize = DTYPE_BYTES[trace.meta.compute_dtype]
    activation_bytes = trace.block_activation_bytes()
    measured = trace.meta.time_source is TimeSource.MEASURED
    spans: dict[tuple[Phase, int], list[int]] = {}
    fwd: dict[int, list[float]] = {}  # block -> [forward seconds, forward FLOPs] on this hardware
    for m in trace.moments:
        if m.block >= 0 and m.phase is not Phase.OPTIMIZER:
            span = spans.setdefault((m.phase, m.block), [m.id, m.id])
            span[1] = m.id
            if m.phase is Phase.FORWARD and not measured:
                acc = fwd.setdefault(m.block, [0.0, 0.0])
                acc[0] += moment_seconds(hardware, trace, m)
                acc[1] += m.flops

    def recompute_seconds(b) -> float:
        """The block's forward once more: its FLOPs at the rate its forward moments run at."""
        if measured:
            return b.forward_seconds
        secs, flops = fwd.get(b.id, (0.0, 0.0))
        return b.forward_flops * secs / flops if flops > 0 else b.forward_flops / hardware.device_flops_per_s
    infos = []
    for b in trace.blocks:
        tensors = tuple(t for t in order if block_of[t] == b.id)
        infos.append(BlockInfo(
            id=b.id,
            module=b.module,
            tensors=tensors,
            param_bytes=sum(trace.tensors[t].numel for t in tensors) * itemsize,
            activation_bytes=activation_bytes[b.id],
            input_bytes=b.input_bytes,
            recompute_seconds=recompute_seconds(b),
            recompute_flops=b.forward_flops,
            forward_moments=tuple(spans.get((Phase.FORWARD, b.id), NO_MOMENTS)),
            backward_moments=tuple(spans.get((Phase.BACKWARD, b.id), NO_MOMENTS)),
        ))
    return tuple(infos)


def _stages(moments: tuple[MomentRef, ...], blocks: tuple[BlockInfo, ...]) -> tuple[Stage, ...]:
    """Maximal runs of consecutive moments with the same (phase, block)."""
    stages: list[Stage] = []
    first = 0
    for m in range(1, len(moments) + 1):
        if m < len(moments) and (moments[m].phase, moments[m].block) == (moments[first].phase, moments[first].block):
            continue
        phase, block = moments[first].phase, moments[first].block
        where = blocks[block].module if block >= 0 else ("all chunks" if phase is Phase.OPTIMIZER else "outside blocks")
        stages.append(Stage(id=len(stages), name=f"{phase.value.lower()} {where}", phase=phase, block=block,
                            first_moment=first, last_moment=m - 1, predicted_seconds=0.0))
        first = m
    return tuple(stages)


__all__ = ["BlockInfo", "NO_MOMENTS", "Problem", "build_problem", "chunk_lists"]
