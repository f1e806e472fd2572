"""Baseline schedules: the same trace and hardware scheduled the way well-known systems do it.

Every policy (`pytorch`, `zero-offload`, `zero-infinity`, `patrickstar`, `gemini`, `fuyou`) is a
`PolicyPlan` — the decisions the system takes (where PARAM and the optimizer state live, which PARAM
chunks stay on the GPU, activation plan per block, how much GPU memory it lets itself use, eviction
rule, prefetch or fetch on demand, CPU Adam overlapped with backward or after it) — turned into a
complete schedule by `replay_policy`, a greedy replay of the system's runtime over the moments.
The plan's fields mirror `planner.materialize.Decisions`; the baselines replay them here instead of
calling `materialize` because several behaviours are the systems' own and not tide's decisions
(fetch on demand without lookahead, DeepSpeed's live-parameter cap, activation checkpoints kept on
HOST, Fuyou's pipelined NVMe optimizer), and because a baseline must imitate a runtime, not
optimise.

Every schedule goes through `planner.simulate.simulate`. A policy is INFEASIBLE (`InfeasibleError`,
naming the tier, the moment and the bytes) where the real system runs out of memory: the replay
finds no chunk to evict, the simulator's capacity check fails, or a system-specific rule quoted in
the policy's docstring fails.

Several ranks (`hardware.cluster.world_size` = p > 1; the trace is one rank's work, data parallel):
every system but Fuyou (single-GPU only: an INFEASIBLE row that says so) runs with p ranks as it
does for real. Sharded systems (ZeRO-2/3, PatrickStar, Gemini) move comm groups of p chunks, one per
rank (PatrickStar §7): the owners copy their chunks and the group is all-gathered before use, the
grads reduce-scattered before each owner moves its chunk to the optimizer's tier, and each rank
steps only its own chunks; PyTorch DDP keeps everything on every rank and all-reduces the grads.
Collectives go over INTER_GPU with the bytes each rank sends; DEVICE memory is per rank and HOST
per node, as `planner.simulate` counts them. With several ranks the chunks are packed in order
across blocks (the systems' own layouts), not padded per block as tide's layout does.

Simplifications common to all baselines (the systems differ more in details than modelled here):
- one chunk size for every policy: the one wasting the fewest elements (Gemini's criterion) among
  64 Mi elements (PatrickStar's default) and the layout's candidates that hold every block tensor;
  DeepSpeed's per-parameter fetches are modelled as per-chunk fetches of the same bytes;
- grads live in their own GRAD list (PatrickStar reuses the PARAM chunk's memory for them, §6.2);
- a copy between NVMe and the GPU is one action crossing HOST (no staging buffers counted);
- the iteration is replayed in isolation (no overlap with the next iteration's start).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable
from enum import StrEnum

from planner import __version__
from planner.errors import InfeasibleError, PlannerError
from planner.layout import build_layout, candidate_chunk_sizes, wasted_elements
from planner.problem import Problem, device_non_model_bytes
from planner.simulate import ScheduleViolation, SimResult, ViolationKind, simulate
from schemas._base import frozen
from schemas.schedule import (
    Action,
    ActivationMode,
    ActivationPlan,
    Budgets,
    Channel,
    Chunk,
    ChunkLayout,
    ChunkList,
    ChunkPlan,
    Op,
    Prediction,
    Residency,
    Schedule,
    ScheduleHeader,
    SolverStatus,
    TensorSlot,
    Tier,
    copy_channel,
)
from schemas.trace import Phase

GB = 1e9
DEFAULT_CHUNK_ELEMENTS = 64 * 1024 * 1024  # PatrickStar's default chunk size (elements)
PREFETCH_HORIZON_MOMENTS = 16  # how far ahead a prefetching policy looks for chunks to bring in
DEFER_HOST_FRACTION = 0.25  # HOST share that delayed OS write-backs may hold (Fuyou §4.3)


class DataParallel(StrEnum):
    """How a system splits model data over the ranks of data-parallel training (world_size > 1)."""

    SHARDED = "SHARDED"  # ZeRO / chunk comm groups: each rank owns 1/p of the chunks and their OS (PatrickStar §7)
    REPLICATED = "REPLICATED"  # DDP: every rank holds everything, grads all-reduced


class Eviction(StrEnum):
    """Which DEVICE chunk leaves when room is needed."""

    FARTHEST_NEXT_USE = "FARTHEST_NEXT_USE"  # Belady: the chunk needed latest (PatrickStar §8.3)
    LRU = "LRU"  # least recently used (a FIFO prefetch buffer, Fuyou §4.4)


@frozen
class PolicyPlan:
    """The decisions one system takes for one problem (mirrors planner.materialize.Decisions)."""

    policy: str
    layout: ChunkLayout
    param_home: Tier  # where PARAM lives off DEVICE (DEVICE: it never leaves)
    persistent: frozenset[int]  # PARAM chunks that never leave DEVICE
    chunk_plans: tuple[ChunkPlan, ...]  # OS tier and optimizer tier per chunk
    activation_modes: tuple[ActivationMode, ...]  # per block
    activation_tier: Tier | None  # where SWAP blocks go, and RECOMPUTE inputs (None: inputs stay on DEVICE)
    device_limit_bytes: int  # DEVICE bytes the system lets itself fill
    max_live_param_bytes: int | None  # cap on PARAM bytes on DEVICE (DeepSpeed stage3_max_live_parameters)
    optimizer_overlap: bool  # CPU Adam of a chunk as soon as its grads are final (Fuyou §4.3)
    prefetch: bool  # bring chunks in ahead of use (else on demand, the work waits)
    eviction: Eviction
    os_pipeline: bool  # read the next chunk's OS from NVMe before writing this one back (Fuyou §4.3)
    notes: tuple[str, ...]
    data_parallel: DataParallel = DataParallel.SHARDED  # with world_size > 1


# ----------------------------------------------------------------------------- policies


def _chunk_elements(problem: Problem) -> int:
    """The chunk size wasting the fewest elements among 64 Mi (PatrickStar's default) and the layout's
    candidates that hold the largest tensor of a block (Gemini's search_chunk_configuration criterion)."""
    tensors = problem.trace.tensors
    largest = max((tensors[t].numel for b in problem.blocks for t in b.tensors), default=0)
    sizes = sorted({s for s in (*candidate_chunk_sizes(problem), DEFAULT_CHUNK_ELEMENTS) if s >= largest}) or [largest]
    return min(sizes, key=lambda s: (wasted_elements(build_layout(problem, chunk_elements=s)), s))


def policy_layout(problem: Problem) -> ChunkLayout:
    """The policy's chunk layout: tide's (planner.layout) with one rank; with several ranks the
    layout of the systems being imitated, which pack tensors into chunks in order across block
    boundaries (PatrickStar's chunk list, Gemini's, DeepSpeed's flat partitions) and pad only the
    last comm group, instead of padding every block to whole groups."""
    if problem.world_size == 1:
        return build_layout(problem, chunk_elements=_chunk_elements(problem))
    return _packed_layout(problem)


def _packed_layout(problem: Problem) -> ChunkLayout:
    """Tensors in first-access order appended to the current chunk, a new chunk when the next one
    does not fit (PatrickStar §6.1), chunks of one size >= the largest tensor (that tensor's size,
    64 Mi elements or a power of two), the one needing the least memory: the chunks' capacity (the
    waste, Gemini's criterion) plus one gathered comm group; the chunk count padded to whole comm
    groups of world_size, `owner_rank = id % world_size`."""
    tensors = problem.trace.tensors
    largest = max((t.numel for t in tensors), default=1)
    ws = problem.world_size

    def pack(size: int) -> list[list[tuple[int, int]]]:
        chunks: list[list[tuple[int, int]]] = [[]]
        used = 0
        for tid in problem.tensor_order:
            numel = tensors[tid].numel
            if used + numel > size and chunks[-1]:
                chunks.append([])
                used = 0
            chunks[-1].append((tid, used))
            used += numel
        chunks += [[] for _ in range(-len(chunks) % ws)]
        return chunks

    total = sum(t.numel for t in tensors)
    powers = {1 << k for k in range(max(0, largest - 1).bit_length(), max(1, total).bit_length() + 1)}
    sizes = sorted({s for s in (*powers, DEFAULT_CHUNK_ELEMENTS, largest) if s >= largest})
    # the least memory: every chunk (padding included) plus one comm group gathered on a rank
    size = min(sizes, key=lambda s: (len(pack(s)) * s + ws * s, s))
    chunks = pack(size)
    block_of = problem.tensor_block
    out_chunks = tuple(
        Chunk(id=i, elements=size, used_elements=sum(tensors[t].numel for t, _ in slots),
              block=block_of[slots[0][0]] if slots else -1, comm_group=i // ws, owner_rank=i % ws)
        for i, slots in enumerate(chunks))
    slots = tuple(TensorSlot(tensor=t, names=tensors[t].names, shape=tensors[t].shape, chunk=i, offset_elements=off,
                             numel=tensors[t].numel, trainable=tensors[t].trainable)
                  for i, cs in enumerate(chunks) for t, off in cs)
    return ChunkLayout(chunk_elements=size, lists=problem.lists, list_dtypes={x: problem.list_dtype(x) for x in problem.lists},
                       chunks=out_chunks, tensors=slots)


def _largest_moment_groups(problem: Problem, layout: ChunkLayout) -> int:
    """Elements of the comm groups one moment needs gathered, the most over the moments."""
    chunk_of = {t.tensor: t.chunk for t in layout.tensors}
    group_elements: dict[int, int] = {}
    for c in layout.chunks:
        group_elements[c.comm_group] = group_elements.get(c.comm_group, 0) + c.elements
    return max((sum(group_elements[g] for g in {layout.chunks[chunk_of[t]].comm_group for t in m.tensors if t in chunk_of})
                for m in problem.moments), default=0)


def _plan(problem: Problem, policy: str, *, os_tier: Tier | Callable[[int], Tier], optimizer_tier: Tier | Callable[[int], Tier],
          **kw: object) -> PolicyPlan:
    layout = kw.pop("layout", None) or policy_layout(problem)
    os_of = os_tier if callable(os_tier) else (lambda c, t=os_tier: t)
    opt_of = optimizer_tier if callable(optimizer_tier) else (lambda c, t=optimizer_tier: t)
    plans = tuple(ChunkPlan(chunk=c.id, os_tier=os_of(c.id), optimizer_tier=opt_of(c.id)) for c in layout.chunks)
    defaults: dict[str, object] = dict(persistent=frozenset(), activation_tier=None, device_limit_bytes=problem.device_bytes,
                                       max_live_param_bytes=None, optimizer_overlap=False, prefetch=False,
                                       eviction=Eviction.FARTHEST_NEXT_USE, os_pipeline=False, notes=())
    defaults.update(kw)
    if defaults["persistent"] == "all":
        defaults["persistent"] = frozenset(c.id for c in layout.chunks)
    return PolicyPlan(policy=policy, layout=layout, chunk_plans=plans, **defaults)  # type: ignore[arg-type]


def pytorch(problem: Problem) -> Schedule:
    """Plain PyTorch: params, grads and Adam state all on the GPU, `torch.optim.AdamW` on the GPU.

    Fits only if all model data (16 bytes/param in mixed precision, PatrickStar §9.2.1: "2 x 18 =
    36 GB" for 2B) plus the non-model peak fits on the device. Activations are kept; when that does
    not fit, the replay tries `torch.utils.checkpoint` on every block (what a PyTorch user does next,
    and how PatrickStar ran its PyTorch baseline, §9.1).

    Several ranks: DistributedDataParallel. Every rank holds all model data (each chunk its own
    group, owned by rank 0, so the busiest rank holds all the OS) and runs the whole AdamW; the
    grads of each chunk are all-reduced as soon as its backward is done (DDP's bucketed all-reduce
    overlapping backward), a ring all-reduce moving 2 (p-1)/p of the grad bytes per rank
    (reduce-scatter + all-gather actions of (p-1)/p each).
    """
    n = len(problem.blocks)
    ddp = problem.world_size > 1
    kw: dict[str, object] = dict(os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE, param_home=Tier.DEVICE, persistent="all")
    if ddp:  # no comm groups: every rank has every chunk
        kw.update(layout=build_layout(dataclasses.replace(problem, world_size=1),
                                      chunk_elements=_chunk_elements(dataclasses.replace(problem, world_size=1))),
                  data_parallel=DataParallel.REPLICATED)
    what = f"DDP over {problem.world_size} ranks: " if ddp else ""
    try:
        return replay_policy(problem, _plan(problem, "pytorch", activation_modes=(ActivationMode.KEEP,) * n,
                          notes=(f"{what}everything on DEVICE, GPU AdamW, activations kept",), **kw))
    except InfeasibleError:
        return replay_policy(problem, _plan(problem, "pytorch", activation_modes=(ActivationMode.RECOMPUTE,) * n,
                          notes=(f"{what}everything on DEVICE, GPU AdamW, activation checkpointing per block",), **kw))


def zero_offload(problem: Problem) -> Schedule:
    """DeepSpeed ZeRO-Offload (ZeRO stage 2 + offload_optimizer cpu; Ren et al. 2021, Fuyou §2.2, §5.1).

    fp16 params stay on the GPU for the whole iteration; grads go D2H as soon as the block's backward
    has produced them; fp32 master params and Adam moments live in CPU memory; DeepSpeedCPUAdam runs
    after backward (no overlap: the open-source version has no delayed update, Fuyou §2.2); updated
    fp16 params are copied back H2D. Activation checkpoint per transformer block, checkpoints offloaded
    to CPU memory (Fuyou §5.1). OOM where the fp16 params plus the activations do not fit the GPU
    (PatrickStar §8.4) or the OS and grads do not fit CPU memory.

    Several ranks (ZeRO stage 2, DeepSpeed `stage_1_and_2.py`): fp16 params replicated on every GPU;
    grads reduce-scattered (one comm group per bucket of chunks) as soon as they are final, each rank
    offloading its partition; OS partitioned, each rank's partition in the shared CPU memory and
    updated by its CPU Adam; the updated fp16 partitions copied up and all-gathered: 4 (p-1)/p x M
    fp16 bytes between GPUs per iteration. PatrickStar §7 and §9.2 credit ZeRO-Offload's broadcasts
    with 10 (p-1)/p x M; DeepSpeed's current all-gather is modelled.
    """
    n = len(problem.blocks)
    return replay_policy(problem, _plan(problem, "zero-offload", os_tier=Tier.HOST, optimizer_tier=Tier.HOST, param_home=Tier.HOST,
                      persistent="all", activation_modes=(ActivationMode.RECOMPUTE,) * n,
                      activation_tier=Tier.HOST,
                      notes=("fp16 params persistent on DEVICE, grads to HOST, CPU Adam after backward",
                             "activation checkpoints per block, offloaded to HOST")))


ZERO_INFINITY_HOST_BYTES_PER_PARAM = 6  # fp32 grad partition (4) + fp16 param swap buffer (2), see zero_infinity()
ZERO_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed stage3_max_live_parameters default


def zero_infinity(problem: Problem) -> Schedule:
    """DeepSpeed ZeRO-Infinity (ZeRO-3, offload_param and offload_optimizer to nvme; Fuyou §2.2, §3, §5.1).

    fp16 params and fp32 OS live on the SSDs (on CPU memory when the machine has none); each
    submodule's params are fetched on demand before its forward/backward and released after
    (at most `stage3_max_live_parameters` = 1e9 params live on the GPU); no overlap of transfers
    with compute to speak of (Fuyou §3 Fig. 2a: P (SSD->CPU), P (CPU->GPU), compute and A (GPU->CPU)
    serialised); activation checkpoint per block, checkpoints on CPU memory, never on SSD (Fuyou
    §2.2); grads to CPU; DeepSpeedCPUAdam after backward, streaming OS in and out of the SSDs chunk
    by chunk without overlapping reads and writes (Fuyou §4.3 describes that as its improvement).

    CPU memory rule (not in the schedule's lists): DeepSpeed keeps fp32 grad partitions (4 B/param)
    and fp16 param swap buffers (2 B/param) in CPU memory, so it needs 6 B/param of HOST plus the
    checkpoints; this is why ZeRO-Infinity's maximum model size follows CPU memory, not GPU memory
    (Fuyou §5.2, Fig. 1a). Simplification: the prefetch bucket (stage3_prefetch_bucket_size) is
    modelled as fetch on demand, which is what Fuyou measured.

    Several ranks (ZeRO stage 3): params, grads and OS partitioned; each rank fetches its partition
    of a submodule's params and all-gathers them before use, in forward and again in backward,
    and reduce-scatters the grads: 6 (p-1)/p x M fp16 bytes between GPUs (the all-gather scheme of
    PatrickStar §7). The CPU memory rule is per node: the partitions of its ranks add up to the
    whole model, and every rank keeps its own activation checkpoints there.
    """
    n = len(problem.blocks)
    home = Tier.NVME if problem.hardware.nvme.count > 0 else Tier.HOST
    params = problem.trace.param_count
    ranks = problem.ranks_per_node
    need = ZERO_INFINITY_HOST_BYTES_PER_PARAM * params + ranks * sum(b.input_bytes for b in problem.blocks)
    if need > problem.host_bytes:
        per = f" x {ranks} ranks sharing the node" if ranks > 1 else ""
        raise InfeasibleError(f"zero-infinity: HOST runs out: DeepSpeed keeps fp32 grads and fp16 swap buffers in CPU "
                              f"memory ({ZERO_INFINITY_HOST_BYTES_PER_PARAM} B/param x {params / 1e9:.2f} B params) plus "
                              f"activation checkpoints{per} = {need / GB:.1f} GB > {problem.host_bytes / GB:.1f} GB usable; "
                              f"it needs at least {need / GB:.1f} GB of host memory")
    itemsize = problem.list_itemsize(ChunkList.PARAM)
    layout = policy_layout(problem)
    # DeepSpeed fetches per submodule; the replay's unit is a gathered comm group, and with many
    # ranks the groups one moment needs may hold more than the cap: the cap is then what they hold
    live = max(ZERO_MAX_LIVE_PARAMETERS, _largest_moment_groups(problem, layout) if problem.world_size > 1 else 0)
    return replay_policy(problem, _plan(problem, "zero-infinity", layout=layout, os_tier=home, optimizer_tier=Tier.HOST,
                      param_home=home, activation_modes=(ActivationMode.RECOMPUTE,) * n, activation_tier=Tier.HOST,
                      max_live_param_bytes=live * itemsize,
                      notes=(f"fp16 params and OS on {home.value}, fetched on demand, CPU Adam after backward",
                             "activation checkpoints per block on HOST")))


PATRICKSTAR_GPU_RATIO = 0.8  # overall_gpu_mem_ratio: the share of GPU memory PatrickStar manages
PATRICKSTAR_MARGIN_USE_RATIO = 0.8  # margin_use_ratio: the share of the GPU margin OS chunks may take


def patrickstar(problem: Problem) -> Schedule:
    """PatrickStar (Fang et al.; papers/000 §6-§8).

    Params in fp16 chunks that move between GPU and CPU on access (Algorithm 1, no prefetch), evicting
    the chunk whose next use is farthest (§8.3); OS chunks placed in the GPU margin — GPU memory
    (x overall_gpu_mem_ratio 0.8) minus the peak non-model data and the fp16 params — up to
    margin_use_ratio 0.8 of it, the rest on CPU (§8.2); Adam after backward, on the GPU for OS chunks
    there and on the CPU for the others; activation checkpointing, no activation offload; no NVMe.
    OOM when model data do not fit CPU + GPU, or a moment's chunks plus non-model data do not fit
    the GPU (§9.2.1). Simplification: the embedding runs on the GPU like everything else.

    Several ranks (§7, Algorithms 3-4): chunks form comm groups of p, one per rank; a group is
    all-gathered at its first use in forward, released after it, all-gathered again in backward,
    its grads reduce-scattered when its backward is done: 6 (p-1)/p x M fp16 bytes between GPUs.
    Each rank puts the OS of its own chunks in its own GPU margin (chunks of a group are equal, so
    every rank decides the same for its chunk of a group); the margin subtracts the fp16 chunks
    of the whole model, as with one GPU (a rank registers every chunk, local or remote).
    """
    n = len(problem.blocks)
    modes = (ActivationMode.RECOMPUTE,) * n
    limit = min(problem.device_bytes, int(problem.hardware.device.memory_gb * GB * PATRICKSTAR_GPU_RATIO))
    layout = policy_layout(problem)
    peak_nm = max(device_non_model_bytes(problem, modes, None))
    param_bytes = sum(c.elements for c in layout.chunks) * problem.list_itemsize(ChunkList.PARAM)
    margin = max(0, limit - peak_nm - param_bytes)
    os_room = int(margin * PATRICKSTAR_MARGIN_USE_RATIO)
    per_element = sum(problem.list_itemsize(x) for x in problem.os_lists)
    on_gpu: set[int] = set()
    ws = problem.world_size
    for g in range(0, len(layout.chunks), ws):  # chunk order: each rank fills its margin with its own chunks' OS
        group = layout.chunks[g:g + ws]
        cost = max(c.elements for c in group) * per_element  # on each rank: its chunk of the group
        if cost <= os_room:
            on_gpu.update(c.id for c in group)
            os_room -= cost
    return replay_policy(problem, _plan(problem, "patrickstar", layout=layout,
                      os_tier=lambda c: Tier.DEVICE if c in on_gpu else Tier.HOST,
                      optimizer_tier=lambda c: Tier.DEVICE if c in on_gpu else Tier.HOST,
                      param_home=Tier.HOST, activation_modes=modes, device_limit_bytes=limit,
                      notes=(f"fp16 chunks on demand, farthest-next-use eviction, {len(on_gpu)}/{len(layout.chunks)} "
                             f"OS chunks in the GPU margin ({margin / GB:.2f} GB x {PATRICKSTAR_MARGIN_USE_RATIO})",
                             "Adam after backward, activation checkpointing on DEVICE")))


GEMINI_STEADY_CUDA_CAP_RATIO = 0.9  # ColossalAI AutoPlacementPolicy steady_cuda_cap_ratio


def gemini(problem: Problem) -> Schedule:
    """Colossal-AI Gemini, placement_policy="auto" (ColossalAI 0.3.x `GeminiDDP`, `AutoPlacementPolicy`).

    Chunk-based like PatrickStar (Gemini descends from it): param chunks move between GPU and CPU by
    the runtime memory statistics, up to steady_cuda_cap_ratio 0.9 of the GPU, evicting chunks
    needed farthest in the future; OS on CPU (gpu_margin_mem_ratio defaults to 0.0, so the margin
    is not used); CPU Adam after backward; activation checkpointing per block with the checkpoints
    kept on the GPU — Colossal-AI cannot offload them, which is why it fails on an RTX 4090 for
    GPT-3 13B (Fuyou §5.1, §5.3); no NVMe tier here (Fuyou ran OS on SSDs through its
    tensor-NVMe extension; not modelled).

    Several ranks: GeminiDDP shards every chunk over the ranks (ZeRO-3 with chunks, like PatrickStar
    §7): all-gather before use in forward and backward, reduce-scatter of the grads, each rank's
    OS shard on the shared CPU.
    """
    n = len(problem.blocks)
    limit = min(problem.device_bytes, int(problem.hardware.device.memory_gb * GB * GEMINI_STEADY_CUDA_CAP_RATIO))
    return replay_policy(problem, _plan(problem, "gemini", os_tier=Tier.HOST, optimizer_tier=Tier.HOST, param_home=Tier.HOST,
                      activation_modes=(ActivationMode.RECOMPUTE,) * n, device_limit_bytes=limit,
                      notes=("auto placement: chunks on demand, OS on HOST, CPU Adam after backward",
                             "activation checkpoints kept on DEVICE")))


def fuyou(problem: Problem) -> Schedule:
    """Fuyou (Liao et al. 2024; papers/003 §4).

    fp16 params and fp32 OS on the SSDs (CPU memory when the machine has none); the synchronous
    out-of-core CPU Adam overlaps backward — a chunk is updated as soon as its grads are final,
    with delayed write-back so NVMe reads of the next chunk overlap the update (§4.3); GPU-memory
    aware FIFO prefetching of params and activations into what the profiled peak leaves free (§4.4);
    activation checkpoint per block offloaded (to CPU memory when it fits, else SSD), plus full
    activation swapping of the number of blocks its cost model picks (§4.5, Eq. 1-12), in SBF
    order (Eq. 12). Simplification: Fuyou swaps individual layers inside a block in SBF order; a
    schedule's activation plan is per block, so the swap amount D_f is chosen in whole blocks,
    ordered by SBF = recompute FLOPs / swap bytes (then backward order: the first block to be
    needed first).

    Fuyou is a single-GPU system ("Fuyou is evaluated for a single-GPU-training scenario", §5.7; it
    has no data-parallel mode): with world_size > 1 it is not feasible, and the row says so.
    """
    if problem.world_size > 1:
        raise InfeasibleError(f"fuyou: single-GPU system (Fuyou §5.7: evaluated and built for one GPU, no "
                              f"data-parallel mode), not feasible with world_size={problem.world_size}; "
                              "compare it on a one-GPU profile")
    home = Tier.NVME if problem.hardware.nvme.count > 0 else Tier.HOST
    modes, act_tier, note = fuyou_activation_plan(problem, home)
    plan_kw = dict(os_tier=home, optimizer_tier=Tier.HOST, param_home=home, activation_tier=act_tier,
                   optimizer_overlap=True, prefetch=True, eviction=Eviction.LRU, os_pipeline=home is Tier.NVME)
    try:
        return replay_policy(problem, _plan(problem, "fuyou", activation_modes=modes,
                          notes=(f"params and OS on {home.value}, CPU Adam overlapped with backward, FIFO prefetch", note),
                          **plan_kw))
    except InfeasibleError:
        if all(m is ActivationMode.RECOMPUTE for m in modes):
            raise
        # the swap amount is bounded by memory too (Eq. 11's D_start is the safe start): fall back to it
        modes = (ActivationMode.RECOMPUTE,) * len(problem.blocks)
        return replay_policy(problem, _plan(problem, "fuyou", activation_modes=modes,
                          notes=(f"params and OS on {home.value}, CPU Adam overlapped with backward, FIFO prefetch",
                                 "activation swap did not fit: checkpoints only (D_f = D_start)"), **plan_kw))


def fuyou_activation_plan(problem: Problem, home: Tier) -> tuple[tuple[ActivationMode, ...], Tier, str]:
    """How many blocks to swap (Fuyou Eq. 1-12 at block granularity) and where activations go."""
    hw = problem.hardware
    blocks = problem.blocks
    n = len(blocks)
    p = problem.trace.param_count
    param_bytes = p * problem.list_itemsize(ChunkList.PARAM)
    os_bytes = p * sum(problem.list_itemsize(x) for x in problem.os_lists)
    fwd = sum(m.compute_seconds for m in problem.moments if m.phase is Phase.FORWARD)
    bwd = sum(m.compute_seconds for m in problem.moments if m.phase is Phase.BACKWARD)
    t_opt = p / hw.host.optimizer_params_per_s
    bw_gpu = min(hw.h2d_bytes_per_s, hw.d2h_bytes_per_s)
    ssd = home is Tier.NVME
    s2c = hw.nvme_read_bytes_per_s if ssd else math.inf
    c2s = hw.nvme_write_bytes_per_s if ssd else math.inf
    inputs = sum(b.input_bytes for b in blocks)
    # activations go to HOST when they fit next to what HOST must hold anyway, else to the SSDs
    host_model = 0 if ssd else param_bytes + os_bytes + param_bytes  # params, OS and grads live on HOST without SSDs
    all_acts = sum(b.activation_bytes for b in blocks)
    act_tier = Tier.HOST if host_model + all_acts + inputs <= problem.host_bytes or not ssd else Tier.NVME
    act_ssd = act_tier is Tier.NVME

    def t_iter(swapped: list[int]) -> tuple[float, float, float]:
        d_f = inputs + sum(blocks[b].activation_bytes - blocks[b].input_bytes for b in swapped)
        rc = sum(blocks[b].recompute_seconds for b in range(n) if b not in set(swapped))
        t_f = max(fwd, max(param_bytes, d_f) / bw_gpu,  # Eq. 2, 3
                  (param_bytes / s2c if ssd else 0) + (d_f / c2s if act_ssd else 0))  # Eq. 4
        gpu_bo = max(param_bytes, param_bytes + d_f) / bw_gpu  # Eq. 6
        ssd_bo = ((os_bytes + param_bytes) / s2c + (os_bytes + param_bytes) / c2s if ssd else 0) \
            + (d_f / s2c if act_ssd else 0)  # Eq. 7
        t_bo = max(bwd + rc, t_opt, gpu_bo, ssd_bo)  # Eq. 5, 8
        return t_f + t_bo, bwd + rc - max(gpu_bo, ssd_bo), d_f  # Eq. 1, Eq. 9

    # SBF order (Eq. 12): recompute FLOPs per swapped byte, ties: the block needed first in backward
    order = sorted(range(n), key=lambda b: (-(blocks[b].recompute_flops / max(1, blocks[b].activation_bytes)), -b))
    best_time, t_max, d_start = t_iter([])
    rates = [bw_gpu] + ([c2s, s2c] if act_ssd else [])
    d_max = max(0.0, t_max) * min(rates)  # Eq. 10
    best_k = 0
    for k in range(1, n + 1):
        time, _, d_f = t_iter(order[:k])
        if d_f - d_start > d_max:  # Eq. 11 (D_start <= D_f <= D_max, counted beyond the checkpoints)
            break
        if time < best_time:
            best_time, best_k = time, k
    swapped = set(order[:best_k])
    swap_mode = ActivationMode.SWAP_NVME if act_ssd else ActivationMode.SWAP_HOST
    modes = tuple(swap_mode if b in swapped else ActivationMode.RECOMPUTE for b in range(n))
    return modes, act_tier, (f"Eq. 1-12: swap {best_k}/{n} blocks to {act_tier.value} (predicted {best_time:.3f} s), "
                             "checkpoints of the rest offloaded")


POLICIES: dict[str, Callable[[Problem], Schedule]] = {
    "pytorch": pytorch,
    "zero-offload": zero_offload,
    "zero-infinity": zero_infinity,
    "patrickstar": patrickstar,
    "gemini": gemini,
    "fuyou": fuyou,
}


def baseline(name: str, problem: Problem) -> Schedule:
    """The schedule of baseline `name`; InfeasibleError where that system runs out of memory."""
    if name not in POLICIES:
        raise PlannerError(f"unknown baseline {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name](problem)


# ----------------------------------------------------------------------------- the replay


def replay_policy(problem: Problem, plan: PolicyPlan) -> Schedule:
    """Turn a policy's decisions into a complete schedule, simulate it, and return it with its prediction."""
    schedule, result = _replay_once(problem, plan, None)
    if plan.os_pipeline and plan.optimizer_overlap:
        # second pass: place the delayed write-backs after the updates the first pass timed
        step_end = {int(i.label.split()[1]): i.end_seconds for i in result.timeline
                    if i.channel is Channel.CPU_OPTIMIZER and i.label.startswith("adam ")}
        try:
            second = _replay_once(problem, plan, (result.moment_start_seconds, step_end))
        except InfeasibleError:
            second = None
        if second is not None and second[1].iteration_seconds < result.iteration_seconds:
            schedule, result = second
    return _with_prediction(schedule, result)


def _replay_once(problem: Problem, plan: PolicyPlan,
                 timing: tuple[tuple[float, ...], dict[int, float]] | None) -> tuple[Schedule, SimResult]:
    replay = _Replay(problem, plan, timing)
    actions = replay.run()
    schedule = _assemble(problem, plan, actions, replay.initial_residency())
    try:
        return schedule, simulate(schedule, problem.hardware)
    except ScheduleViolation as exc:
        if exc.kind is ViolationKind.CAPACITY:
            raise InfeasibleError(f"{plan.policy}: {exc}") from None
        raise


class _NoRoom(Exception):
    pass


class _Replay:
    """Greedy replay of one system's runtime: fetch what a moment needs, evict by the policy's rule.

    The unit that moves is a comm group (PatrickStar §7): one chunk with one rank; with several
    ranks and a sharded policy, `world_size` chunks, one per rank: fetched by their owners and
    all-gathered before use, released together, their grads reduce-scattered before the owners
    move them to the optimizer's tier. DEVICE bytes are per rank (every rank holds a gathered
    group; the optimizer state of its own chunks only). With a REPLICATED policy (DDP) every chunk
    is its own group owned by rank 0 and the grads of each are all-reduced (reduce-scatter +
    all-gather, ring) when final.
    """

    def __init__(self, problem: Problem, plan: PolicyPlan,
                 timing: tuple[tuple[float, ...], dict[int, float]] | None = None) -> None:
        self.problem, self.plan, self.timing = problem, plan, timing
        self.deferred: list[tuple[int, int]] = []  # (due moment, chunk) of delayed OS write-backs
        self.deferred_bytes = 0
        lay = plan.layout
        self.lists = problem.lists
        self.n = len(lay.chunks)
        self.world = problem.world_size
        self.replicated = plan.data_parallel is DataParallel.REPLICATED
        members: dict[int, list[int]] = {}
        for c in lay.chunks:
            members.setdefault(c.comm_group, []).append(c.id)
        self.gchunks = [members[g] for g in sorted(members)]
        self.G = len(self.gchunks)
        self.group_of = [0] * self.n
        for g, cs in enumerate(self.gchunks):
            for c in cs:
                self.group_of[c] = g
        self.collective = self.world > 1 and not self.replicated  # groups gathered and reduce-scattered
        item = {x: problem.list_itemsize(x) for x in self.lists}
        self.cpb = [c.elements * item[ChunkList.PARAM] for c in lay.chunks]
        self.cgb = [c.elements * item[ChunkList.GRAD] for c in lay.chunks]
        self.osb = [c.elements * sum(item[x] for x in problem.os_lists) for c in lay.chunks]
        tensor_chunk = {t.tensor: t.chunk for t in lay.tensors}
        trainable = {t.tensor for t in lay.tensors if t.trainable}
        trainable_chunk = {t.chunk for t in lay.tensors if t.trainable}
        self.tchunks = [[c for c in cs if c in trainable_chunk] for cs in self.gchunks]
        self.pb = [sum(self.cpb[c] for c in cs) for cs in self.gchunks]  # a gathered group, on every rank
        self.gb = [sum(self.cgb[c] for c in cs) for cs in self.tchunks]
        self.trainable_groups = [g for g in range(self.G) if self.tchunks[g]]
        self.opt_tier = [plan.chunk_plans[cs[0]].optimizer_tier if cs else Tier.HOST for cs in self.tchunks]
        for g, cs in enumerate(self.tchunks):
            if len({plan.chunk_plans[c].optimizer_tier for c in cs}) > 1:
                raise PlannerError(f"{plan.policy}: comm group {g} mixes optimizer tiers; a group steps in one place")
        self.persistent = {self.group_of[c] for c in plan.persistent}
        if plan.param_home is Tier.DEVICE:
            self.persistent = set(range(self.G))
        T = len(problem.moments)
        self.T = T
        self.opt_moment = problem.optimizer_moment
        self.needs: list[list[int]] = []
        self.writes: list[list[int]] = []
        self.uses: list[list[int]] = [[] for _ in range(self.G)]
        self.last_grad = [-1] * self.G
        for m in problem.moments:
            if m.phase is Phase.OPTIMIZER:
                self.needs.append([])
                self.writes.append([])
                continue
            gs = sorted({self.group_of[tensor_chunk[t]] for t in m.tensors if t in tensor_chunk})
            self.needs.append(gs)
            for g in gs:
                self.uses[g].append(m.id)
            w = sorted({self.group_of[tensor_chunk[t]] for t in m.tensors if t in trainable}) \
                if m.phase is Phase.BACKWARD else []
            self.writes.append(w)
            for g in w:
                self.last_grad[g] = m.id
        # sharded groups are released after their last use in forward and again in backward, and
        # gathered anew at the next use (PatrickStar Alg. 4, ZeRO-3's release after a submodule,
        # Gemini's re-shard): the chunk scheme's 6 (p-1)/p x M. Simplification: the owner's own
        # chunk leaves DEVICE too (an EVICT acts on every rank) and comes back over its PCIe link.
        self.release_at: dict[int, list[int]] = {}
        if self.collective:
            for g in range(self.G):
                if g in {self.group_of[c] for c in plan.persistent} or plan.param_home is Tier.DEVICE:
                    continue
                for phase in (Phase.FORWARD, Phase.BACKWARD):
                    last = [m for m in self.uses[g] if problem.moments[m].phase is phase]
                    if last:
                        self.release_at.setdefault(last[-1] + 1, []).append(g)
        self.finals: dict[int, list[int]] = {}
        for g in self.trainable_groups:
            if self.last_grad[g] >= 0:
                self.finals.setdefault(self.last_grad[g] + 1, []).append(g)
        self._activation_timeline()
        # DEVICE state (per rank), in groups
        self.dev_param: dict[int, int] = {}  # group -> last use moment (LRU)
        self.dev_grad: set[int] = set()
        self.grad_on_host: set[int] = set()
        self.reduced: set[int] = set()  # groups whose grads were reduced since they were last written
        self.stepped: set[int] = set()
        # optimizer state kept on DEVICE: each rank holds its own chunks' (the busiest rank counts)
        os_per_rank = [0] * self.world
        for c in range(self.n):
            if plan.chunk_plans[c].os_tier is Tier.DEVICE and lay.chunks[c].used_elements:
                os_per_rank[lay.chunks[c].owner_rank] += self.osb[c]
        self.os_device = max(os_per_rank)
        self.occ = sum(self.pb[g] for g in self.persistent) + self.os_device
        self.param_occ = sum(self.pb[g] for g in self.persistent)
        for g in self.persistent:
            self.dev_param[g] = -1
        self.actions: list[Action] = []

    # -- activations -------------------------------------------------------------------------
    def _activation_timeline(self) -> None:
        p, plan = self.problem, self.plan
        modes = plan.activation_modes
        self.offload_at: dict[int, list[int]] = {}
        self.reload_at: dict[int, list[int]] = {}
        blocks = p.blocks
        bwd_first = [b.backward_moments[0] for b in blocks]
        for b, blk in enumerate(blocks):
            fl, bf = blk.forward_moments[1], blk.backward_moments[0]
            if fl < 0 or bf <= fl:
                continue
            moved = modes[b] in (ActivationMode.SWAP_HOST, ActivationMode.SWAP_NVME) or (
                modes[b] is ActivationMode.RECOMPUTE and plan.activation_tier is not None)
            if not moved:
                continue
            self.offload_at.setdefault(fl, []).append(b)
            r = bf
            if plan.prefetch:  # bring it back while the block after it (in forward order) runs its backward
                later = [bwd_first[x] for x in range(len(blocks)) if 0 <= bwd_first[x] < bf]
                r = max(later) if later else bf
                r = max(r, fl + 1)
            self.reload_at.setdefault(r, []).append(b)
        self.block_tier = {}
        for b in range(len(blocks)):
            if modes[b] is ActivationMode.SWAP_NVME:
                self.block_tier[b] = Tier.NVME
            elif modes[b] is ActivationMode.SWAP_HOST:
                self.block_tier[b] = Tier.HOST
            else:
                self.block_tier[b] = plan.activation_tier or Tier.HOST
        self.nm = device_non_model_bytes(p, modes, {b: (blocks[b].forward_moments[1], r)
                                              for r, bs in self.reload_at.items() for b in bs})
        self.budget = [self.plan.device_limit_bytes - x for x in self.nm]

    # -- the walk ------------------------------------------------------------------------------
    def run(self) -> list[Action]:
        try:
            for m in range(self.T):
                self._moment(m)
        except _NoRoom as exc:
            raise InfeasibleError(f"{self.plan.policy}: {exc}") from None
        return self.actions

    def _moment(self, m: int) -> None:
        p = self.problem
        modes = self.plan.activation_modes
        for b in self.offload_at.get(m, ()):
            tier = self.block_tier[b]
            nbytes = p.blocks[b].input_bytes if modes[b] is ActivationMode.RECOMPUTE else p.blocks[b].activation_bytes
            self._emit(m, Op.ACT_OFFLOAD, block=b, dst=tier, bytes=nbytes,
                       channel=copy_channel(Tier.DEVICE, tier))
        for b in self.reload_at.get(m, ()):
            tier = self.block_tier[b]
            nbytes = p.blocks[b].input_bytes if modes[b] is ActivationMode.RECOMPUTE else p.blocks[b].activation_bytes
            self._emit(m, Op.ACT_RELOAD, block=b, src=tier, bytes=nbytes,
                       channel=copy_channel(tier, Tier.DEVICE))
        for g in self.release_at.get(m, ()):
            if g in self.dev_param:
                self._evict_param(m, g)
        if m == self.opt_moment:
            self._optimizer_moment(m)
            return
        if p.moments[m].phase is Phase.OPTIMIZER:
            return
        host_final = []
        for g in self.finals.get(m, ()):
            if self.opt_tier[g] is Tier.HOST:
                self._grad_down(m, g)
                host_final.append(g)
            else:
                self._reduce(m, g)  # DEVICE step later: the grads stay, averaged
        need_p = [g for g in self.needs[m] if g not in self.dev_param]
        need_g = [g for g in self.writes[m] if g not in self.dev_grad]
        protect = set(self.needs[m]) | set(self.writes[m])
        self._make_room(m, sum(self.pb[g] for g in need_p) + sum(self.gb[g] for g in need_g), protect,
                        param_bytes=sum(self.pb[g] for g in need_p))
        for g in need_p:
            self._fetch_param(m, g, Op.FETCH)
        for g in self.needs[m]:
            self.dev_param[g] = m
        for g in need_g:
            if g in self.grad_on_host:  # accumulated again later in backward (tied weights): bring the partial sum back
                for c in self.tchunks[g]:
                    self._emit(m, Op.FETCH, list=ChunkList.GRAD, chunk=c, src=Tier.HOST, dst=Tier.DEVICE,
                               channel=Channel.H2D, bytes=self.cgb[c])
                    self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.HOST)
                self.grad_on_host.discard(g)
            else:
                for c in self.tchunks[g]:
                    self._emit(m, Op.ALLOCATE, list=ChunkList.GRAD, chunk=c, dst=Tier.DEVICE)
            self.dev_grad.add(g)
            self.occ += self.gb[g]
        self.reduced.difference_update(self.writes[m])
        if self.plan.prefetch:
            self._prefetch(m, protect)
        # after this moment's fetches and prefetches: each channel is FIFO, so queuing the optimizer's
        # NVMe traffic first would hold the params the GPU is waiting for behind the CPU's Adam
        self._flush_deferred(m)
        if self.plan.optimizer_overlap and host_final:
            self._host_steps(m, host_final)

    def _emit(self, m: int, op: Op, **kw: object) -> None:
        self.actions.append(Action(moment=m, op=op, **kw))  # type: ignore[arg-type]

    def _next_use(self, g: int, m: int) -> int:
        uses = self.uses[g]
        i = bisect.bisect_left(uses, m)
        return uses[i] if i < len(uses) else self.T + 1

    def _make_room(self, m: int, need: int, protect: set[int], *, param_bytes: int = 0,
                   victim_after: int | None = None, grads_ok: bool = True) -> bool:
        """Evict until `need` more bytes fit at moment m; with victim_after, only groups used later than it."""
        cap = self.plan.max_live_param_bytes
        while self.occ + need > self.budget[m] or (cap is not None and self.param_occ + param_bytes > cap):
            param_only = not (self.occ + need > self.budget[m])
            victim = self._victim(m, protect, victim_after, grads_ok and not param_only)
            if victim is None:
                if victim_after is not None:
                    return False
                if param_only:
                    raise _NoRoom(f"DEVICE runs out at moment {m} ({self._where(m)}): the chunks this moment needs exceed "
                                  f"the live-parameter cap of {cap / GB:.2f} GB")
                raise _NoRoom(f"DEVICE runs out at moment {m} ({self._where(m)}): chunks {self.occ / GB:.2f} GB + "
                              f"{need / GB:.2f} GB needed, but {max(0, self.budget[m]) / GB:.2f} GB are left after "
                              f"{self.nm[m] / GB:.2f} GB of non-model data and activations "
                              f"(the policy uses {self.plan.device_limit_bytes / GB:.2f} GB of DEVICE"
                              f"{' per rank' if self.world > 1 else ''}); "
                              f"at least {(self.nm[m] + need + self._pinned(protect)) / GB:.2f} GB of DEVICE would be "
                              "needed at that moment")
            kind, g = victim
            if kind == "P":
                self._evict_param(m, g)
            else:
                self._reduce(m, g)
                for c in self.tchunks[g]:
                    self._emit(m, Op.WRITE_BACK, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE, dst=Tier.HOST,
                               channel=Channel.D2H, bytes=self.cgb[c])
                    self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE)
                self.dev_grad.discard(g)
                self.grad_on_host.add(g)
                self.occ -= self.gb[g]
        return True

    def _pinned(self, protect: set[int]) -> int:
        """Bytes on DEVICE that cannot leave now: persistent and needed PARAM groups, OS on DEVICE, needed grads."""
        params = sum(self.pb[g] for g in self.dev_param if g in protect or g in self.persistent)
        grads = sum(self.gb[g] for g in self.dev_grad if g in protect)
        return params + grads + self.os_device

    def _where(self, m: int) -> str:
        mm = self.problem.moments[m]
        return f"{mm.kind.value} {mm.module or '(root)'}"

    def _victim(self, m: int, protect: set[int], after: int | None, grads_ok: bool) -> tuple[str, int] | None:
        """A clean PARAM group by the policy's rule; a (dirty) GRAD group only when no PARAM group can go."""
        lru = self.plan.eviction is Eviction.LRU
        best: tuple[float, int] | None = None
        for g, last in self.dev_param.items():
            if g in protect or g in self.persistent:
                continue
            nu = self._next_use(g, m)
            if after is not None and nu <= after:
                continue
            key = float(-last) if lru else float(nu)
            if best is None or key > best[0]:
                best = (key, g)
        if best is not None:
            return ("P", best[1])
        if not grads_ok or after is not None:
            return None
        grads = [g for g in self.dev_grad if g not in protect]
        if not grads:
            return None
        return ("G", max(grads, key=lambda g: (self._next_grad_use(g, m), g)))

    def _next_grad_use(self, g: int, m: int) -> int:
        if self.last_grad[g] >= m:
            return self._next_use(g, m)
        return self.opt_moment

    def _fetch_param(self, m: int, g: int, op: Op, *, gather: bool = True) -> None:
        """Each owner copies its chunk of the group up; then the group is all-gathered (PatrickStar Alg. 3).
        Without `gather` (an optimizer step, which needs only the owners' own chunks) no all-gather."""
        home = self.plan.param_home
        channel = copy_channel(home, Tier.DEVICE)
        for c in self.gchunks[g]:
            self._emit(m, op, list=ChunkList.PARAM, chunk=c, src=home, dst=Tier.DEVICE, channel=channel, bytes=self.cpb[c])
        if self.collective and gather:
            self._collective(m, Op.ALL_GATHER, ChunkList.PARAM, g)
        self.dev_param[g] = m
        self.occ += self.pb[g]
        self.param_occ += self.pb[g]

    def _evict_param(self, m: int, g: int) -> None:
        for c in self.gchunks[g]:
            self._emit(m, Op.EVICT, list=ChunkList.PARAM, chunk=c, src=Tier.DEVICE)
        del self.dev_param[g]
        self.occ -= self.pb[g]
        self.param_occ -= self.pb[g]

    def _collective(self, m: int, op: Op, lst: ChunkList, g: int) -> None:
        """A collective over comm group g: each rank sends (world_size - 1) shards (the schedule's convention)."""
        per_rank = (self.world - 1) * max(self.cpb[c] if lst is ChunkList.PARAM else self.cgb[c] for c in self.gchunks[g])
        self._emit(m, op, list=lst, chunk=g, channel=Channel.INTER_GPU, bytes=per_rank)

    def _reduce(self, m: int, g: int) -> None:
        """Average group g's grads over the ranks: reduce-scatter to the owners (sharded, PatrickStar
        Alg. 4), or all-reduce (DDP: ring reduce-scatter + all-gather, 2 (p-1)/p of the grads per rank)."""
        if self.world == 1 or g in self.reduced or g not in self.dev_grad:
            return
        self.reduced.add(g)
        if self.collective:
            self._collective(m, Op.REDUCE_SCATTER, ChunkList.GRAD, g)
            return
        lay = self.plan.layout
        for c in self.tchunks[g]:
            half = (self.world - 1) * lay.chunks[c].used_elements * self.problem.list_itemsize(ChunkList.GRAD) // self.world
            self._emit(m, Op.REDUCE_SCATTER, list=ChunkList.GRAD, chunk=lay.chunks[c].comm_group,
                       channel=Channel.INTER_GPU, bytes=half)
            self._emit(m, Op.ALL_GATHER, list=ChunkList.GRAD, chunk=lay.chunks[c].comm_group,
                       channel=Channel.INTER_GPU, bytes=half)

    def _prefetch(self, m: int, protect: set[int]) -> None:
        scheduled: set[int] = set()
        min_budget = self.budget[m]
        for k in range(m + 1, min(self.T, m + 1 + PREFETCH_HORIZON_MOMENTS)):
            if self.problem.moments[k].phase is Phase.OPTIMIZER:
                break
            min_budget = min(min_budget, self.budget[k])
            for g in self.needs[k]:
                if g in self.dev_param or g in scheduled:
                    continue
                # do no harm (Cao et al. 1995): room from free space or from groups used after g
                free = min_budget - self.occ
                cap = self.plan.max_live_param_bytes
                if self.pb[g] > free or (cap is not None and self.param_occ + self.pb[g] > cap):
                    saved = self.budget[m]
                    self.budget[m] = min_budget
                    ok = self._make_room(m, self.pb[g], protect | set(self.needs[k]), param_bytes=self.pb[g],
                                         victim_after=k, grads_ok=False)
                    self.budget[m] = saved
                    if not ok:
                        return
                self._fetch_param(m, g, Op.PREFETCH)
                self.dev_param[g] = m
                scheduled.add(g)

    # -- grads and the optimizer -------------------------------------------------------------
    def _grad_down(self, m: int, g: int) -> None:
        if g in self.dev_grad:
            self._reduce(m, g)
            for c in self.tchunks[g]:  # each owner moves its (averaged) chunk
                self._emit(m, Op.WRITE_BACK, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE, dst=Tier.HOST,
                           channel=Channel.D2H, bytes=self.cgb[c])
                self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE)
            self.dev_grad.discard(g)
            self.occ -= self.gb[g]
            self.grad_on_host.add(g)

    def _host_steps(self, m: int, groups: list[int]) -> None:
        """CPU Adam for `groups` at moment m: OS (and params) in from NVMe, step, back out.

        The reads are PREFETCHes: the moment's work does not wait for the optimizer's inputs."""
        home = self.plan.param_home
        os_lists = [x for x in self.problem.os_lists]
        pending_writes: list[int] = []

        def reads(c: int) -> None:
            for x in os_lists:
                if self.plan.chunk_plans[c].os_tier is Tier.NVME:
                    self._emit(m, Op.PREFETCH, list=x, chunk=c, src=Tier.NVME, dst=Tier.HOST, channel=Channel.NVME_READ,
                               bytes=self.osb[c] // len(os_lists))
            if home is Tier.NVME:
                self._emit(m, Op.PREFETCH, list=ChunkList.PARAM, chunk=c, src=Tier.NVME, dst=Tier.HOST,
                           channel=Channel.NVME_READ, bytes=self.cpb[c])

        for g in groups:
            for c in self.tchunks[g]:
                reads(c)
                if self.plan.os_pipeline:
                    for w in pending_writes:  # delayed write-back: after the next chunk's reads are queued
                        self._writes(m, w)
                    pending_writes.clear()
                self._emit(m, Op.OPTIMIZER_STEP, chunk=c, dst=Tier.HOST, channel=Channel.CPU_OPTIMIZER)
                self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.HOST)
                if c == self.tchunks[g][-1]:
                    self.grad_on_host.discard(g)
                    self.stepped.add(g)
                    self._updated_params_back(m, g)
                if self.plan.os_pipeline and self.timing is not None:
                    self._defer(m, c)
                elif self.plan.os_pipeline:
                    pending_writes.append(c)
                else:
                    self._writes(m, c)
        for w in pending_writes:
            self._writes(m, w)

    def _updated_params_back(self, m: int, g: int) -> None:
        """After a HOST step: a persistent group gets its updated chunks copied up by their owners
        (and all-gathered: ZeRO's all-gather of the updated fp16 partitions), others leave DEVICE."""
        if g not in self.dev_param:
            return
        if g in self.persistent:  # copy-back of the updated fp16 params (the GPU waits only when it uses them)
            for c in self.tchunks[g]:
                self._emit(m, Op.PREFETCH, list=ChunkList.PARAM, chunk=c, src=Tier.HOST, dst=Tier.DEVICE,
                           channel=Channel.H2D, bytes=self.cpb[c])
            if self.collective:
                self._collective(m, Op.ALL_GATHER, ChunkList.PARAM, g)
        else:
            self._evict_param(m, g)

    def _defer(self, m: int, c: int) -> None:
        """Fuyou's delayed write-back: write chunk c's OS back at the first moment after its update ends
        (known from a first replay), so the FIFO NVMe queue never holds params behind a pending update;
        HOST holds at most DEFER_HOST_FRACTION of its budget for such chunks."""
        starts, step_end = self.timing
        end = step_end.get(c, 0.0)
        due = next((k for k in range(m + 1, self.opt_moment) if starts[k] >= end), self.opt_moment)
        size = self._write_bytes(c)
        while self.deferred and self.deferred_bytes + size > DEFER_HOST_FRACTION * self.problem.host_bytes:
            _, old = self.deferred.pop(0)
            self.deferred_bytes -= self._write_bytes(old)
            self._writes(m, old)
        self.deferred.append((due, c))
        self.deferred_bytes += size

    def _flush_deferred(self, m: int, *, everything: bool = False) -> None:
        keep = []
        for due, c in self.deferred:
            if everything or due <= m:
                self._writes(m, c)
                self.deferred_bytes -= self._write_bytes(c)
            else:
                keep.append((due, c))
        self.deferred = keep

    def _write_bytes(self, c: int) -> int:
        return self.osb[c] + (self.cpb[c] if self.plan.param_home is Tier.NVME else 0)

    def _writes(self, m: int, c: int) -> None:
        for x in self.problem.os_lists:
            if self.plan.chunk_plans[c].os_tier is Tier.NVME:
                self._emit(m, Op.WRITE_BACK, list=x, chunk=c, src=Tier.HOST, dst=Tier.NVME,
                           channel=Channel.NVME_WRITE, bytes=self.osb[c] // len(self.problem.os_lists))
                self._emit(m, Op.EVICT, list=x, chunk=c, src=Tier.HOST)
        if self.plan.param_home is Tier.NVME:
            self._emit(m, Op.WRITE_BACK, list=ChunkList.PARAM, chunk=c, src=Tier.HOST, dst=Tier.NVME,
                       channel=Channel.NVME_WRITE, bytes=self.cpb[c])
            self._emit(m, Op.EVICT, list=ChunkList.PARAM, chunk=c, src=Tier.HOST)

    def _optimizer_moment(self, m: int) -> None:
        self._flush_deferred(m, everything=True)
        host = [g for g in self.trainable_groups if g not in self.stepped and self.opt_tier[g] is Tier.HOST]
        for g in host:
            self._grad_down(m, g)
        if host:
            self._host_steps(m, host)
        for g in self.trainable_groups:
            if g in self.stepped or self.opt_tier[g] is not Tier.DEVICE:
                continue
            self._reduce(m, g)
            need = (self.pb[g] if g not in self.dev_param else 0) + (self.gb[g] if g not in self.dev_grad else 0)
            self._make_room(m, need, {g}, param_bytes=self.pb[g] if g not in self.dev_param else 0)
            if g not in self.dev_param:
                self._fetch_param(m, g, Op.FETCH, gather=g in self.persistent)
            if g not in self.dev_grad:
                for c in self.tchunks[g]:
                    self._emit(m, Op.FETCH, list=ChunkList.GRAD, chunk=c, src=Tier.HOST, dst=Tier.DEVICE,
                               channel=Channel.H2D, bytes=self.cgb[c])
                    self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.HOST)
                self.grad_on_host.discard(g)
                self.dev_grad.add(g)
                self.occ += self.gb[g]
            home = self.plan.param_home
            for c in self.tchunks[g]:
                self._emit(m, Op.OPTIMIZER_STEP, chunk=c, dst=Tier.DEVICE, channel=Channel.COMPUTE)
                self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE)
                if home is not Tier.DEVICE:  # the home copy is stale now: copy back down
                    self._emit(m, Op.WRITE_BACK, list=ChunkList.PARAM, chunk=c, src=Tier.DEVICE, dst=home,
                               channel=copy_channel(Tier.DEVICE, home), bytes=self.cpb[c])
            self.stepped.add(g)
            self.dev_grad.discard(g)
            self.occ -= self.gb[g]
            if g not in self.persistent:
                self._evict_param(m, g)
            elif self.collective:  # the other ranks' copies of the owners' updated chunks
                self._collective(m, Op.ALL_GATHER, ChunkList.PARAM, g)
        # steady state: DEVICE holds exactly the persistent groups again
        for g in sorted(self.dev_param):
            if g not in self.persistent:
                for c in self.gchunks[g]:
                    self._emit(m, Op.EVICT, list=ChunkList.PARAM, chunk=c, src=Tier.DEVICE)
        for g in sorted(self.dev_grad):
            for c in self.tchunks[g]:
                self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE)
        for g in sorted(self.grad_on_host):
            for c in self.tchunks[g]:
                self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.HOST)

    def initial_residency(self) -> tuple[Residency, ...]:
        out = []
        home = self.plan.param_home
        for c in range(self.n):
            tiers = [Tier.DEVICE] if self.group_of[c] in self.persistent else []
            if home is not Tier.DEVICE:
                tiers.append(home)
            out.append(Residency(list=ChunkList.PARAM, chunk=c, tiers=tuple(tiers)))
            if self.plan.layout.chunks[c].used_elements == 0:
                continue  # a comm group's padding: gathered with its group, but nothing to optimize
            for x in self.problem.os_lists:
                out.append(Residency(list=x, chunk=c, tiers=(self.plan.chunk_plans[c].os_tier,)))
        return tuple(out)


def _assemble(problem: Problem, plan: PolicyPlan, actions: list[Action], residency: tuple[Residency, ...]) -> Schedule:
    acts = tuple(ActivationPlan(block=b.id, module=b.module, mode=plan.activation_modes[b.id], bytes=b.activation_bytes,
                                input_bytes=b.input_bytes, recompute_seconds=b.recompute_seconds,
                                recompute_flops=b.recompute_flops) for b in problem.blocks)
    header = ScheduleHeader(planner_version=__version__, policy=plan.policy, model_name=problem.trace.meta.model_name,
                            trace_digest=problem.trace_digest, hardware_name=problem.hardware.name,
                            hardware_digest=problem.hardware.digest, world_size=problem.world_size,
                            solver_status=SolverStatus.HEURISTIC, objective_seconds=0.0, lower_bound_seconds=0.0,
                            gap=0.0, notes=plan.notes)
    return Schedule(
        header=header,
        budgets=Budgets(device_bytes=problem.device_bytes, host_bytes=problem.host_bytes, nvme_bytes=problem.nvme_bytes),
        layout=plan.layout,
        chunk_plans=plan.chunk_plans,
        activation_plans=acts,
        moments=problem.moments,
        stages=problem.stages,
        initial_residency=residency,
        actions=tuple(actions),
        prediction=Prediction(iteration_seconds=0.0, flops=0, bytes_per_channel={}, busy_seconds_per_channel={},
                              peak_bytes_per_tier={}),
    )


def _with_prediction(schedule: Schedule, r: SimResult) -> Schedule:
    starts = list(r.moment_start_seconds) + [r.iteration_seconds]
    stages = tuple(dataclasses.replace(st, predicted_seconds=max(0.0, starts[st.last_moment + 1] - starts[st.first_moment]))
                   for st in schedule.stages)
    prediction = Prediction(iteration_seconds=r.iteration_seconds, flops=r.flops + r.recompute_flops,
                            bytes_per_channel=dict(r.bytes_per_channel),
                            busy_seconds_per_channel=dict(r.busy_seconds_per_channel),
                            peak_bytes_per_tier=dict(r.peak_bytes_per_tier))
    header = dataclasses.replace(schedule.header, objective_seconds=r.iteration_seconds)
    return dataclasses.replace(schedule, header=header, stages=stages, prediction=prediction)


__all__ = ["Eviction", "POLICIES", "PolicyPlan", "baseline", "fuyou_activation_plan", "replay_policy"]
