"""Baseline schedules: the same trace and hardware scheduled the way well-known systems do it.

Every policy (`pytorch`, `zero-offload`, `zero-infinity`, `patrickstar`, `gemini`, `fuyou`) is a
`PolicyPlan` (planner.policy_replay) — the decisions the system takes (where PARAM and the optimizer state live, which PARAM
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

import dataclasses
import math
from collections.abc import Callable

from planner.errors import InfeasibleError, PlannerError
from planner.layout import build_layout, candidate_chunk_sizes, wasted_elements
from planner.policy_replay import GB, DataParallel, Eviction, PolicyPlan, replay_policy
from planner.problem import Problem, device_non_model_bytes
from schemas.schedule import (
    ActivationMode,
    Chunk,
    ChunkLayout,
    ChunkList,
    ChunkPlan,
    Schedule,
    TensorSlot,
    Tier,
)
from schemas.trace import Phase

DEFAULT_CHUNK_ELEMENTS = 64 * 1024 * 1024  # PatrickStar's default chunk size (elements)
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


__all__ = ["Eviction", "POLICIES", "PolicyPlan", "baseline", "fuyou_activation_plan", "replay_policy"]
