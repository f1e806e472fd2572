"""Hypothesis strategies for VALID traces, hardware profiles and schedules (small sizes, fast).

Every object drawn here passes `validate_trace` / `validate_hardware` / `validate_schedule`: dense
ids, references that resolve, bytes == numel * itemsize, tensors inside their chunks without
overlap, stages covering the moments, actions sorted by moment with the fields their op needs.
They say nothing about whether a schedule makes sense dynamically (that is the simulator's job).

Use: `@given(trace=traces())`, `@given(hw=hardwares())`, `@given(schedule=schedules())`.
`example_trace()`, `example_hardware()` and `example_schedule()` are small fixed objects for tests
that need one concrete valid file.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from hypothesis import strategies as st

from schemas.hardware import (
    AdamRate,
    AttentionRate,
    ClusterSpec,
    DeviceKind,
    DeviceSpec,
    Hardware,
    HostSpec,
    LinkSpec,
    MatmulRate,
    NvmeSpec,
)
from schemas.schedule import (
    COPY_OPS,
    Action,
    ActivationMode,
    ActivationPlan,
    Budgets,
    Channel,
    Chunk,
    ChunkLayout,
    ChunkList,
    ChunkPlan,
    MomentRef,
    Op,
    Prediction,
    Residency,
    Schedule,
    ScheduleHeader,
    SolverStatus,
    Stage,
    TensorSlot,
    Tier,
)
from schemas.trace import (
    DTYPE_BYTES,
    Activation,
    Block,
    DType,
    Moment,
    MomentKind,
    OptimizerKind,
    Phase,
    Recording,
    TensorInfo,
    TimeSource,
    Trace,
    TraceMeta,
)

# msgpack holds 64-bit ints; stay well inside them
MAX_INT = 2**62
PHASE_ORDER = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)

texts = st.text(max_size=12)
names = st.text(min_size=1, max_size=12)
counts = st.integers(min_value=0, max_value=MAX_INT)
seconds = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
# what a trace may record for one piece of work (schemas.trace.MAX_RECORDED_SECONDS: one day)
recorded_seconds = st.floats(min_value=0.0, max_value=86_400.0, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
# params/s: schemas.hardware.PLAUSIBLE refuses less than 1 param/s
params_rate = st.floats(min_value=1.0, max_value=1e12, allow_nan=False, allow_infinity=False)
fractions = st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False)
digests = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64).map(lambda h: "sha256:" + h)

# a model config: JSON-able values (no NaN: JSON has none, and NaN != NaN would break equality)
json_scalars = st.none() | st.booleans() | st.integers(-MAX_INT, MAX_INT) | seconds | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)


@functools.cache
def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    """st.integers, built once per range (building strategies inside draws costs as much as drawing)."""
    return st.integers(low, high)


@functools.cache
def _pick(options: Any) -> st.SearchStrategy[Any]:
    """st.sampled_from over an enum or a tuple, built once."""
    return st.sampled_from(options)


def _unique_names(draw: Any, n: int) -> list[str]:
    """n distinct non-empty names (hypothesis text, made unique by an index suffix)."""
    out: list[str] = []
    for i in range(n):
        base = draw(names)
        out.append(base if base not in out else f"{base}.{i}")
    return out


# ----------------------------------------------------------------------------- trace


@st.composite
def trace_metas(draw: Any) -> TraceMeta:
    return TraceMeta(
        model_name=draw(names),
        model_config=draw(st.dictionaries(texts, json_values, max_size=4)),
        batch_shape=tuple(draw(st.lists(st.integers(0, 4096), max_size=3))),
        compute_dtype=draw(_pick(DType)),
        world_size=draw(_ints(1, 16)),
        torch_version=draw(texts),
        device=draw(texts),
        recording=draw(_pick(Recording)),
        time_source=draw(_pick(TimeSource)),
        optimizer=draw(_pick(OptimizerKind)),
    )


@st.composite
def traces(draw: Any, *, max_tensors: int = 6, max_blocks: int = 3, max_moments: int = 10, max_activations: int = 5) -> Trace:
    """A valid Trace: tensors, blocks, moments in phase order, activations consumed after production."""
    n_tensors = draw(_ints(0, max_tensors))
    all_names = _unique_names(draw, n_tensors * 2)
    tensors = []
    for i in range(n_tensors):
        shape = tuple(draw(st.lists(st.integers(0, 64), max_size=3)))
        dtype = draw(_pick(DType))
        tied = draw(st.booleans())
        tensors.append(TensorInfo(
            id=i, names=tuple(all_names[2 * i: 2 * i + (2 if tied else 1)]), shape=shape, dtype=dtype,
            bytes=math.prod(shape) * DTYPE_BYTES[dtype], trainable=draw(st.booleans()),
        ))
    n_blocks = draw(_ints(0, max_blocks))
    blocks = [
        Block(id=i, module=draw(names), forward_flops=draw(counts), forward_seconds=draw(recorded_seconds), input_bytes=draw(counts))
        for i in range(n_blocks)
    ]
    n_moments = draw(_ints(1, max_moments))
    phases = sorted(draw(st.lists(_pick(PHASE_ORDER), min_size=n_moments, max_size=n_moments)), key=PHASE_ORDER.index)
    tensor_lists = st.lists(st.integers(0, n_tensors - 1), max_size=4) if n_tensors else st.just([])
    moments = [
        Moment(
            id=i, phase=phase, kind=draw(_pick(MomentKind)), module=draw(texts),
            block=draw(_ints(-1, n_blocks - 1)), tensors=tuple(draw(tensor_lists)),
            compute_seconds=draw(recorded_seconds), flops=draw(counts), non_model_bytes=draw(counts),
        )
        for i, phase in enumerate(phases)
    ]
    activations = []
    if n_moments >= 2:
        for i in range(draw(_ints(0, max_activations))):
            produced = draw(_ints(0, n_moments - 2))
            consumed = draw(st.lists(st.integers(produced + 1, n_moments - 1), min_size=1, max_size=3))
            activations.append(Activation(
                id=i, block=draw(_ints(-1, n_blocks - 1)), bytes=draw(counts), produced_at=produced,
                consumed_at=tuple(consumed), recompute_flops=draw(counts), recompute_seconds=draw(recorded_seconds),
            ))
    return Trace(meta=draw(trace_metas()), tensors=tuple(tensors), blocks=tuple(blocks), moments=tuple(moments),
                 activations=tuple(activations))


# ----------------------------------------------------------------------------- hardware


@st.composite
def hardwares(draw: Any) -> Hardware:
    """A valid Hardware: positive finite capacities and rates, NVMe rates when SSDs exist, consistent GPUs."""
    n_ssd = draw(_ints(0, 16))
    ssd_number = positive if n_ssd else st.just(0.0) | positive
    world_size = draw(_ints(1, 64))
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    gpus_per_node = draw(st.sampled_from(divisors) | st.integers(world_size + 1, world_size + 8))
    return Hardware(
        name=draw(names),
        description=draw(texts),
        device=DeviceSpec(kind=draw(_pick(DeviceKind)), name=draw(texts), memory_gb=draw(positive),
                          usable_fraction=draw(fractions), compute_tflops=draw(positive), optimizer_params_per_s=draw(params_rate),
                          matmul_rates=tuple(MatmulRate(dtype=draw(_pick(DType)), m=draw(_ints(1, 1 << 16)), n=draw(_ints(1, 1 << 16)),
                                                        k=draw(_ints(1, 1 << 16)), tflops=draw(positive))
                                             for _ in range(draw(_ints(0, 2)))),
                          attention_rates=tuple(AttentionRate(dtype=draw(_pick(DType)), batch=draw(_ints(1, 64)), heads=draw(_ints(1, 128)),
                                                              tokens=draw(_ints(1, 1 << 16)), head_dim=draw(_ints(1, 256)),
                                                              forward_tflops=draw(positive), backward_tflops=draw(positive))
                                                for _ in range(draw(_ints(0, 2))))),
        host=HostSpec(memory_gb=draw(positive), usable_fraction=draw(fractions), optimizer_params_per_s=draw(params_rate),
                      cores=draw(_ints(1, 512)), dram_gb_per_s=draw(positive),
                      adam_chunk_params=draw(_ints(1, 1 << 30)),
                      adam_rates=tuple(AdamRate(threads=t, params_per_s=draw(positive), params_per_s_with_copies=draw(positive))
                                       for t in draw(st.lists(_ints(1, 512), max_size=3, unique=True)))),
        nvme=NvmeSpec(count=n_ssd, capacity_gb_each=draw(ssd_number), read_gb_per_s_each=draw(ssd_number),
                      write_gb_per_s_each=draw(ssd_number), usable_fraction=draw(fractions)),
        links=LinkSpec(h2d_gb_per_s=draw(positive), d2h_gb_per_s=draw(positive),
                       inter_gpu_gb_per_s=draw(positive if world_size > 1 else st.just(0.0) | positive),
                       duplex_h2d_gb_per_s=draw(positive), h2d_pageable_gb_per_s=draw(positive),
                       inter_node_gb_per_s=draw(positive if world_size > gpus_per_node else st.just(0.0) | positive)),
        cluster=ClusterSpec(world_size=world_size, gpus_per_node=gpus_per_node),
    )


# ----------------------------------------------------------------------------- schedule


def _shape_of(draw: Any, numel: int) -> tuple[int, ...]:
    options = [(numel,), (1, numel)] + ([()] if numel == 1 else [])
    return draw(st.sampled_from(options))


@st.composite
def chunk_layouts(draw: Any, *, world_size: int = 1, n_blocks: int = 0, max_chunks: int = 3) -> ChunkLayout:
    """Chunks of up to 2x chunk_elements; tensors at increasing offsets inside them, never overlapping."""
    chunk_elements = draw(_ints(1, 256))
    extra = draw(st.lists(_pick((ChunkList.GRAD, ChunkList.MASTER, ChunkList.M, ChunkList.V)), unique=True))
    lists = (ChunkList.PARAM, *extra)
    list_dtypes = {lst: draw(_pick(DType)) for lst in lists}
    chunks, spans = [], []
    # several ranks: whole comm groups of world_size chunks, as planner/layout.py pads them (and
    # validate_schedule requires: no more ranks than chunks)
    n_chunks = draw(_ints(0, max_chunks)) if world_size == 1 else world_size * draw(_ints(1, max(1, max_chunks // world_size)))
    for i in range(n_chunks):
        elements = draw(_ints(1, 2 * chunk_elements))
        # 2k sorted cut points -> k disjoint [start, end) spans inside the chunk
        cuts = sorted(draw(st.lists(st.integers(0, elements), max_size=6)))
        if len(cuts) % 2:
            cuts = cuts[:-1]
        pieces = [(cuts[j], cuts[j + 1]) for j in range(0, len(cuts), 2)]
        spans += [(i, start, end - start) for start, end in pieces]
        chunks.append(Chunk(
            id=i, elements=elements, used_elements=draw(_ints(0, elements)), block=draw(_ints(-1, n_blocks - 1)),
            comm_group=i // world_size, owner_rank=i % world_size,
        ))
    tensor_ids = draw(st.permutations(range(len(spans))))
    all_names = _unique_names(draw, len(spans))
    slots = tuple(
        TensorSlot(tensor=tensor_ids[k], names=(all_names[k],), shape=_shape_of(draw, numel), chunk=chunk,
                   offset_elements=offset, numel=numel, trainable=draw(st.booleans()))
        for k, (chunk, offset, numel) in enumerate(spans)
    )
    return ChunkLayout(chunk_elements=chunk_elements, lists=lists, list_dtypes=list_dtypes, chunks=tuple(chunks), tensors=slots)


_OP_NEEDS_CHUNK = {Op.FETCH, Op.PREFETCH, Op.WRITE_BACK, Op.EVICT, Op.ALLOCATE, Op.OPTIMIZER_STEP}
_OP_NEEDS_BLOCK = {Op.ACT_OFFLOAD, Op.ACT_RELOAD}


@st.composite
def _action(draw: Any, *, moment: int, lists: tuple[ChunkList, ...], n_chunks: int, n_blocks: int) -> Action:
    ops = [op for op in Op if (op not in _OP_NEEDS_CHUNK or n_chunks) and (op not in _OP_NEEDS_BLOCK or n_blocks)]
    op = draw(st.sampled_from(ops))
    tiers = _pick(Tier)
    fields: dict[str, Any] = {"moment": moment, "op": op, "bytes": draw(counts)}
    if op in COPY_OPS:
        src, dst = draw(st.permutations(list(Tier)))[:2]
        fields |= {"list": draw(_pick(lists)), "chunk": draw(_ints(0, n_chunks - 1)), "src": src, "dst": dst}
    elif op is Op.EVICT:
        fields |= {"list": draw(_pick(lists)), "chunk": draw(_ints(0, n_chunks - 1)), "src": draw(tiers)}
    elif op is Op.ALLOCATE:
        fields |= {"list": draw(_pick(lists)), "chunk": draw(_ints(0, n_chunks - 1)), "dst": draw(tiers)}
    elif op is Op.OPTIMIZER_STEP:
        fields |= {"chunk": draw(_ints(0, n_chunks - 1)), "dst": draw(_pick((Tier.DEVICE, Tier.HOST)))}
    elif op is Op.ACT_OFFLOAD:
        fields |= {"block": draw(_ints(0, n_blocks - 1)), "dst": draw(_pick((Tier.HOST, Tier.NVME)))}
    elif op is Op.ACT_RELOAD:
        fields |= {"block": draw(_ints(0, n_blocks - 1)), "src": draw(_pick((Tier.HOST, Tier.NVME)))}
    else:  # collectives: chunk is the comm group
        fields |= {"list": draw(_pick(lists)), "chunk": draw(_ints(0, 8))}
    if op not in (Op.EVICT, Op.ALLOCATE):
        fields["channel"] = draw(_pick(Channel))
    return Action(**fields)


@st.composite
def schedules(draw: Any, *, max_moments: int = 6, max_blocks: int = 3, max_actions: int = 8) -> Schedule:
    """A valid Schedule (structurally: references resolve, ids dense, actions sorted)."""
    world_size = draw(_ints(1, 4))
    n_blocks = draw(_ints(0, max_blocks))
    layout = draw(chunk_layouts(world_size=world_size, n_blocks=n_blocks))
    n_chunks = len(layout.chunks)
    placed = [t.tensor for t in layout.tensors]
    header = ScheduleHeader(
        planner_version=draw(texts), policy=draw(names), model_name=draw(texts), trace_digest=draw(digests),
        hardware_name=draw(texts), hardware_digest=draw(digests), world_size=world_size,
        solver_status=draw(_pick(SolverStatus)), objective_seconds=draw(seconds),
        lower_bound_seconds=draw(seconds), gap=draw(seconds), notes=tuple(draw(st.lists(texts, max_size=3))),
    )
    n_moments = draw(_ints(1, max_moments))
    phases = sorted(draw(st.lists(_pick(PHASE_ORDER), min_size=n_moments, max_size=n_moments)), key=PHASE_ORDER.index)
    tensor_lists = st.lists(st.sampled_from(placed), max_size=3) if placed else st.just([])
    moments = tuple(
        MomentRef(id=i, phase=phase, kind=draw(_pick(MomentKind)), module=draw(texts),
                  block=draw(_ints(-1, n_blocks - 1)), tensors=tuple(draw(tensor_lists)),
                  compute_seconds=draw(seconds), flops=draw(counts), non_model_bytes=draw(counts))
        for i, phase in enumerate(phases)
    )
    # stage boundaries: a sorted subset of 1..n_moments-1 splits the moments into consecutive runs
    cuts = sorted(draw(st.sets(st.integers(1, n_moments - 1), max_size=4))) if n_moments > 1 else []
    bounds = [0, *cuts, n_moments]
    stages = tuple(
        Stage(id=i, name=draw(texts), phase=moments[bounds[i]].phase, block=draw(_ints(-1, n_blocks - 1)),
              first_moment=bounds[i], last_moment=bounds[i + 1] - 1, predicted_seconds=draw(seconds))
        for i in range(len(bounds) - 1)
    )
    pairs = [(lst, c) for lst in layout.lists for c in range(n_chunks)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=8)) if pairs else []
    residency = tuple(
        Residency(list=lst, chunk=c, tiers=tuple(draw(st.lists(_pick(Tier), unique=True, max_size=3))))
        for lst, c in chosen
    )
    activation_plans = tuple(
        ActivationPlan(block=i, module=draw(texts), mode=draw(_pick(ActivationMode)), bytes=draw(counts),
                       input_bytes=draw(counts), recompute_seconds=draw(seconds), recompute_flops=draw(counts))
        for i in range(n_blocks)
    )
    action_moments = sorted(draw(st.lists(st.integers(0, n_moments - 1), max_size=max_actions)))
    actions = tuple(
        draw(_action(moment=m, lists=layout.lists, n_chunks=n_chunks, n_blocks=n_blocks)) for m in action_moments
    )
    # grad_in_param_slot (PS.2) where validate_schedule allows it: a MASTER list, a GRAD no wider than PARAM
    dtypes = layout.list_dtypes
    slot_ok = (ChunkList.GRAD in dtypes and ChunkList.MASTER in dtypes
               and DTYPE_BYTES[dtypes[ChunkList.GRAD]] <= DTYPE_BYTES[dtypes[ChunkList.PARAM]])
    chunk_plans = tuple(
        ChunkPlan(chunk=i, os_tier=draw(_pick(Tier)), optimizer_tier=draw(_pick((Tier.DEVICE, Tier.HOST))),
                  grad_in_param_slot=draw(st.booleans()) if slot_ok else False)
        for i in range(n_chunks)
    )
    prediction = Prediction(
        iteration_seconds=draw(seconds), flops=draw(counts),
        bytes_per_channel=draw(st.dictionaries(_pick(Channel), counts)),
        busy_seconds_per_channel=draw(st.dictionaries(_pick(Channel), seconds)),
        peak_bytes_per_tier=draw(st.dictionaries(_pick(Tier), counts)),
    )
    return Schedule(
        header=header,
        budgets=Budgets(device_bytes=draw(counts), host_bytes=draw(counts), nvme_bytes=draw(counts)),
        layout=layout, chunk_plans=chunk_plans, activation_plans=activation_plans, moments=moments, stages=stages,
        initial_residency=residency, actions=actions, prediction=prediction,
    )


# ----------------------------------------------------------------------------- fixed examples


def example_trace(*, n_blocks: int = 2) -> Trace:
    """A tiny GPT-like trace: embedding + n_blocks blocks of 2 tensors + head tied to the embedding."""
    tensors = [TensorInfo(id=0, names=("wte.weight", "lm_head.weight"), shape=(64, 16), dtype=DType.FLOAT32,
                          bytes=64 * 16 * 4, trainable=True)]
    for b in range(n_blocks):
        for k, shape in enumerate([(16, 48), (48,)]):
            tensors.append(TensorInfo(id=len(tensors), names=(f"h.{b}.w{k}",), shape=shape, dtype=DType.FLOAT32,
                                      bytes=math.prod(shape) * 4, trainable=True))
    blocks = [Block(id=b, module=f"h.{b}", forward_flops=100_000, forward_seconds=0.001, input_bytes=2048) for b in range(n_blocks)]
    moments: list[Moment] = []

    def add(phase: Phase, kind: MomentKind, module: str, block: int, tensors_: tuple[int, ...], nmb: int) -> None:
        moments.append(Moment(id=len(moments), phase=phase, kind=kind, module=module, block=block, tensors=tensors_,
                              compute_seconds=0.001, flops=100_000, non_model_bytes=nmb))

    add(Phase.FORWARD, MomentKind.PRE_FORWARD, "", -1, (0,), 4096)
    for b in range(n_blocks):
        add(Phase.FORWARD, MomentKind.PRE_FORWARD, f"h.{b}", b, (1 + 2 * b, 2 + 2 * b), 8192 + 1024 * b)
    add(Phase.FORWARD, MomentKind.POST_FORWARD, "", -1, (0,), 16384)
    add(Phase.BACKWARD, MomentKind.PRE_BACKWARD, "", -1, (0,), 20000)
    for b in reversed(range(n_blocks)):
        add(Phase.BACKWARD, MomentKind.PRE_BACKWARD, f"h.{b}", b, (1 + 2 * b, 2 + 2 * b), 12000)
    add(Phase.BACKWARD, MomentKind.POST_BACKWARD, "", -1, (), 1000)
    add(Phase.OPTIMIZER, MomentKind.OPTIMIZER_STEP, "", -1, (), 0)
    activations = [
        Activation(id=b, block=b, bytes=4096, produced_at=1 + b, consumed_at=(len(moments) - 3 - b,),
                   recompute_flops=100_000, recompute_seconds=0.001)
        for b in range(n_blocks)
    ]
    meta = TraceMeta(model_name="tiny-gpt", model_config={"n_layer": n_blocks, "n_embd": 16}, batch_shape=(2, 8),
                     compute_dtype=DType.FLOAT32, world_size=1, torch_version="2.13.0", device="cpu",
                     recording=Recording.REAL, time_source=TimeSource.MEASURED, optimizer=OptimizerKind.ADAMW)
    return Trace(meta=meta, tensors=tuple(tensors), blocks=tuple(blocks), moments=tuple(moments), activations=tuple(activations))


def example_hardware() -> Hardware:
    return Hardware(
        name="tiny", description="a made-up machine for tests",
        device=DeviceSpec(kind=DeviceKind.CPU_EMULATED, name="pool", memory_gb=0.001, usable_fraction=1.0,
                          compute_tflops=0.01, optimizer_params_per_s=1e8),
        host=HostSpec(memory_gb=1.0, usable_fraction=0.5, optimizer_params_per_s=1e8, cores=2),
        nvme=NvmeSpec(count=1, capacity_gb_each=1.0, read_gb_per_s_each=1.0, write_gb_per_s_each=0.5, usable_fraction=0.9),
        links=LinkSpec(h2d_gb_per_s=4.0, d2h_gb_per_s=4.0, inter_gpu_gb_per_s=0.0),
        cluster=ClusterSpec(world_size=1, gpus_per_node=1),
    )


def example_schedule() -> Schedule:
    """A tiny schedule over `example_trace()`: 2 chunks, PARAM on DEVICE, OS on HOST, one block swapped."""
    trace = example_trace()
    chunk_elements = 2048
    # tensor 0 (1024 elements) goes to chunk 0; the block tensors share chunk 1
    slots, offsets = [], {0: 0, 1: 0}
    for t in trace.tensors:
        chunk = 0 if t.id == 0 else 1
        slots.append(TensorSlot(tensor=t.id, names=t.names, shape=t.shape, chunk=chunk, offset_elements=offsets[chunk],
                                numel=t.numel, trainable=True))
        offsets[chunk] += t.numel
    layout = ChunkLayout(
        chunk_elements=chunk_elements, lists=(ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V),
        list_dtypes={lst: DType.FLOAT32 for lst in (ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V)},
        chunks=(Chunk(id=0, elements=chunk_elements, used_elements=offsets[0], block=-1, comm_group=0, owner_rank=0),
                Chunk(id=1, elements=chunk_elements, used_elements=offsets[1], block=0, comm_group=1, owner_rank=0)),
        tensors=tuple(slots),
    )
    moments = tuple(MomentRef(id=m.id, phase=m.phase, kind=m.kind, module=m.module, block=m.block, tensors=m.tensors,
                              compute_seconds=m.compute_seconds, flops=m.flops, non_model_bytes=m.non_model_bytes)
                    for m in trace.moments)
    fwd = [m.id for m in moments if m.phase is Phase.FORWARD]
    bwd = [m.id for m in moments if m.phase is Phase.BACKWARD]
    opt = [m.id for m in moments if m.phase is Phase.OPTIMIZER]
    stages = (
        Stage(id=0, name="forward", phase=Phase.FORWARD, block=-1, first_moment=fwd[0], last_moment=fwd[-1], predicted_seconds=0.005),
        Stage(id=1, name="backward", phase=Phase.BACKWARD, block=-1, first_moment=bwd[0], last_moment=bwd[-1], predicted_seconds=0.006),
        Stage(id=2, name="optimizer", phase=Phase.OPTIMIZER, block=-1, first_moment=opt[0], last_moment=opt[-1], predicted_seconds=0.001),
    )
    cb = chunk_elements * 4  # bytes of one fp32 chunk
    actions = (
        Action(moment=1, op=Op.ACT_OFFLOAD, block=0, dst=Tier.HOST, channel=Channel.D2H, bytes=4096),
        Action(moment=bwd[0], op=Op.ALLOCATE, list=ChunkList.GRAD, chunk=0, dst=Tier.DEVICE),
        Action(moment=bwd[0], op=Op.ALLOCATE, list=ChunkList.GRAD, chunk=1, dst=Tier.DEVICE),
        Action(moment=bwd[1], op=Op.ACT_RELOAD, block=0, src=Tier.HOST, channel=Channel.H2D, bytes=4096),
        Action(moment=bwd[-1], op=Op.WRITE_BACK, list=ChunkList.GRAD, chunk=0, src=Tier.DEVICE, dst=Tier.HOST, channel=Channel.D2H, bytes=cb),
        Action(moment=bwd[-1], op=Op.WRITE_BACK, list=ChunkList.GRAD, chunk=1, src=Tier.DEVICE, dst=Tier.HOST, channel=Channel.D2H, bytes=cb),
        Action(moment=bwd[-1], op=Op.EVICT, list=ChunkList.GRAD, chunk=0, src=Tier.DEVICE),
        Action(moment=bwd[-1], op=Op.EVICT, list=ChunkList.GRAD, chunk=1, src=Tier.DEVICE),
        Action(moment=opt[0], op=Op.OPTIMIZER_STEP, chunk=0, dst=Tier.HOST, channel=Channel.CPU_OPTIMIZER),
        Action(moment=opt[0], op=Op.OPTIMIZER_STEP, chunk=1, dst=Tier.HOST, channel=Channel.CPU_OPTIMIZER),
        Action(moment=opt[0], op=Op.FETCH, list=ChunkList.PARAM, chunk=0, src=Tier.HOST, dst=Tier.DEVICE, channel=Channel.H2D, bytes=cb),
        Action(moment=opt[0], op=Op.FETCH, list=ChunkList.PARAM, chunk=1, src=Tier.HOST, dst=Tier.DEVICE, channel=Channel.H2D, bytes=cb),
        Action(moment=opt[0], op=Op.EVICT, list=ChunkList.GRAD, chunk=0, src=Tier.HOST),
        Action(moment=opt[0], op=Op.EVICT, list=ChunkList.GRAD, chunk=1, src=Tier.HOST),
    )
    return Schedule(
        header=ScheduleHeader(planner_version="0.1.0", policy="tide", model_name="tiny-gpt", trace_digest="sha256:" + "0" * 64,
                              hardware_name="tiny", hardware_digest=example_hardware().digest, world_size=1,
                              solver_status=SolverStatus.OPTIMAL, objective_seconds=0.012, lower_bound_seconds=0.012, gap=0.0,
                              notes=("hand-made for tests",)),
        budgets=Budgets(device_bytes=1_000_000, host_bytes=500_000_000, nvme_bytes=900_000_000),
        layout=layout,
        chunk_plans=(ChunkPlan(chunk=0, os_tier=Tier.HOST, optimizer_tier=Tier.HOST),
                     ChunkPlan(chunk=1, os_tier=Tier.HOST, optimizer_tier=Tier.HOST)),
        activation_plans=(
            ActivationPlan(block=0, module="h.0", mode=ActivationMode.SWAP_HOST, bytes=4096, input_bytes=2048,
                           recompute_seconds=0.001, recompute_flops=100_000),
            ActivationPlan(block=1, module="h.1", mode=ActivationMode.KEEP, bytes=4096, input_bytes=2048,
                           recompute_seconds=0.001, recompute_flops=100_000),
        ),
        moments=moments, stages=stages,
        initial_residency=tuple(
            [Residency(list=ChunkList.PARAM, chunk=c, tiers=(Tier.DEVICE, Tier.HOST)) for c in (0, 1)]
            + [Residency(list=lst, chunk=c, tiers=(Tier.HOST,)) for lst in (ChunkList.M, ChunkList.V) for c in (0, 1)]
        ),
        actions=actions,
        prediction=Prediction(
            iteration_seconds=0.012, flops=1_000_000,
            bytes_per_channel={Channel.H2D: 2 * cb + 4096, Channel.D2H: 2 * cb + 4096},
            busy_seconds_per_channel={Channel.H2D: 3e-6, Channel.D2H: 3e-6, Channel.COMPUTE: 0.011},
            peak_bytes_per_tier={Tier.DEVICE: 60_000, Tier.HOST: 50_000},
        ),
    )
