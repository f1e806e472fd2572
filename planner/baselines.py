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
from planner.problem import Problem
from planner.simulate import ScheduleViolation, SimResult, ViolationKind, simulate
from schemas._base import frozen
from schemas.schedule import (
    Action,
    ActivationMode,
    ActivationPlan,
    Budgets,
    Channel,
    ChunkLayout,
    ChunkList,
    ChunkPlan,
    Op,
    Prediction,
    Residency,
    Schedule,
    ScheduleHeader,
    SolverStatus,
    Tier,
)
from schemas.trace import Phase

GB = 1e9
DEFAULT_CHUNK_ELEMENTS = 64 * 1024 * 1024  # PatrickStar's default chunk size (elements)
PREFETCH_HORIZON_MOMENTS = 16  # how far ahead a prefetching policy looks for chunks to bring in
DEFER_HOST_FRACTION = 0.25  # HOST share that delayed OS write-backs may hold (Fuyou §4.3)


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


# ----------------------------------------------------------------------------- policies


def _chunk_elements(problem: Problem) -> int:
    """The chunk size wasting the fewest elements among 64 Mi (PatrickStar's default) and the layout's
    candidates that hold the largest tensor of a block (Gemini's search_chunk_configuration criterion)."""
    tensors = problem.trace.tensors
    largest = max((tensors[t].numel for b in problem.blocks for t in b.tensors), default=0)
    sizes = sorted({s for s in (*candidate_chunk_sizes(problem), DEFAULT_CHUNK_ELEMENTS) if s >= largest}) or [largest]
    return min(sizes, key=lambda s: (wasted_elements(build_layout(problem, chunk_elements=s)), s))


def _plan(problem: Problem, policy: str, *, os_tier: Tier | Callable[[int], Tier], optimizer_tier: Tier | Callable[[int], Tier],
          **kw: object) -> PolicyPlan:
    layout = kw.pop("layout", None) or build_layout(problem, chunk_elements=_chunk_elements(problem))
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
    """
    n = len(problem.blocks)
    try:
        return replay_policy(problem, _plan(problem, "pytorch", os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE, param_home=Tier.DEVICE,
                          persistent="all", activation_modes=(ActivationMode.KEEP,) * n,
                          notes=("everything on DEVICE, GPU AdamW, activations kept",)))
    except InfeasibleError:
        return replay_policy(problem, _plan(problem, "pytorch", os_tier=Tier.DEVICE, optimizer_tier=Tier.DEVICE, param_home=Tier.DEVICE,
                          persistent="all", activation_modes=(ActivationMode.RECOMPUTE,) * n,
                          notes=("everything on DEVICE, GPU AdamW, activation checkpointing per block",)))


def zero_offload(problem: Problem) -> Schedule:
    """DeepSpeed ZeRO-Offload (ZeRO stage 2 + offload_optimizer cpu; Ren et al. 2021, Fuyou §2.2, §5.1).

    fp16 params stay on the GPU for the whole iteration; grads go D2H as soon as the block's backward
    has produced them; fp32 master params and Adam moments live in CPU memory; DeepSpeedCPUAdam runs
    after backward (no overlap: the open-source version has no delayed update, Fuyou §2.2); updated
    fp16 params are copied back H2D. Activation checkpoint per transformer block, checkpoints offloaded
    to CPU memory (Fuyou §5.1). OOM where the fp16 params plus the activations do not fit the GPU
    (PatrickStar §8.4) or the OS and grads do not fit CPU memory.
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
    """
    n = len(problem.blocks)
    home = Tier.NVME if problem.hardware.nvme.count > 0 else Tier.HOST
    params = problem.trace.param_count
    need = ZERO_INFINITY_HOST_BYTES_PER_PARAM * params + sum(b.input_bytes for b in problem.blocks)
    if need > problem.host_bytes:
        raise InfeasibleError(f"zero-infinity: HOST runs out: DeepSpeed keeps fp32 grads and fp16 swap buffers in CPU "
                              f"memory ({ZERO_INFINITY_HOST_BYTES_PER_PARAM} B/param x {params / 1e9:.2f} B params) plus "
                              f"activation checkpoints = {need / GB:.1f} GB > {problem.host_bytes / GB:.1f} GB usable; "
                              f"it needs at least {need / GB:.1f} GB of host memory")
    itemsize = problem.list_itemsize(ChunkList.PARAM)
    return replay_policy(problem, _plan(problem, "zero-infinity", os_tier=home, optimizer_tier=Tier.HOST, param_home=home,
                      activation_modes=(ActivationMode.RECOMPUTE,) * n, activation_tier=Tier.HOST,
                      max_live_param_bytes=ZERO_MAX_LIVE_PARAMETERS * itemsize,
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
    """
    n = len(problem.blocks)
    modes = (ActivationMode.RECOMPUTE,) * n
    limit = min(problem.device_bytes, int(problem.hardware.device.memory_gb * GB * PATRICKSTAR_GPU_RATIO))
    layout = build_layout(problem, chunk_elements=_chunk_elements(problem))
    peak_nm = max(_non_model_curve(problem, modes, None))
    param_bytes = sum(c.elements for c in layout.chunks) * problem.list_itemsize(ChunkList.PARAM)
    margin = max(0, limit - peak_nm - param_bytes)
    os_room = int(margin * PATRICKSTAR_MARGIN_USE_RATIO)
    per_element = sum(problem.list_itemsize(x) for x in problem.os_lists)
    on_gpu: set[int] = set()
    for c in layout.chunks:  # chunk order: PatrickStar fills the margin as it places OS chunks
        cost = c.elements * per_element
        if cost <= os_room:
            on_gpu.add(c.id)
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
    """
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
    """Greedy replay of one system's runtime: fetch what a moment needs, evict by the policy's rule."""

    def __init__(self, problem: Problem, plan: PolicyPlan,
                 timing: tuple[tuple[float, ...], dict[int, float]] | None = None) -> None:
        self.problem, self.plan, self.timing = problem, plan, timing
        self.deferred: list[tuple[int, int]] = []  # (due moment, chunk) of delayed OS write-backs
        self.deferred_bytes = 0
        lay = plan.layout
        self.lists = problem.lists
        self.n = len(lay.chunks)
        self.persistent = set(plan.persistent)
        if plan.param_home is Tier.DEVICE:
            self.persistent = set(range(self.n))
        item = {x: problem.list_itemsize(x) for x in self.lists}
        self.pb = [c.elements * item[ChunkList.PARAM] for c in lay.chunks]
        self.gb = [c.elements * item[ChunkList.GRAD] for c in lay.chunks]
        self.osb = [c.elements * sum(item[x] for x in problem.os_lists) for c in lay.chunks]
        tensor_chunk = {t.tensor: t.chunk for t in lay.tensors}
        trainable = {t.tensor for t in lay.tensors if t.trainable}
        self.trainable_chunks = sorted({t.chunk for t in lay.tensors if t.trainable})
        T = len(problem.moments)
        self.T = T
        self.opt_moment = problem.optimizer_moment
        self.needs: list[list[int]] = []
        self.writes: list[list[int]] = []
        self.uses: list[list[int]] = [[] for _ in range(self.n)]
        self.last_grad = [-1] * self.n
        for m in problem.moments:
            if m.phase is Phase.OPTIMIZER:
                self.needs.append([])
                self.writes.append([])
                continue
            cs = sorted({tensor_chunk[t] for t in m.tensors if t in tensor_chunk})
            self.needs.append(cs)
            for c in cs:
                self.uses[c].append(m.id)
            w = sorted({tensor_chunk[t] for t in m.tensors if t in trainable}) if m.phase is Phase.BACKWARD else []
            self.writes.append(w)
            for c in w:
                self.last_grad[c] = m.id
        self.finals: dict[int, list[int]] = {}
        for c in self.trainable_chunks:
            if self.last_grad[c] >= 0:
                self.finals.setdefault(self.last_grad[c] + 1, []).append(c)
        self._activation_timeline()
        # DEVICE state
        self.dev_param: dict[int, int] = {}  # chunk -> last use moment (LRU)
        self.dev_grad: set[int] = set()
        self.grad_on_host: set[int] = set()
        self.stepped: set[int] = set()
        self.occ = sum(self.pb[c] for c in self.persistent) + sum(
            self.osb[c] for c in range(self.n) if plan.chunk_plans[c].os_tier is Tier.DEVICE)
        self.param_occ = sum(self.pb[c] for c in self.persistent)
        for c in self.persistent:
            self.dev_param[c] = -1
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
        self.nm = _non_model_curve(p, modes, {b: (blocks[b].forward_moments[1], r)
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
                       channel=Channel.D2H if tier is Tier.HOST else Channel.NVME_WRITE)
        for b in self.reload_at.get(m, ()):
            tier = self.block_tier[b]
            nbytes = p.blocks[b].input_bytes if modes[b] is ActivationMode.RECOMPUTE else p.blocks[b].activation_bytes
            self._emit(m, Op.ACT_RELOAD, block=b, src=tier, bytes=nbytes,
                       channel=Channel.H2D if tier is Tier.HOST else Channel.NVME_READ)
        if m == self.opt_moment:
            self._optimizer_moment(m)
            return
        if p.moments[m].phase is Phase.OPTIMIZER:
            return
        host_final = []
        for c in self.finals.get(m, ()):
            if self.plan.chunk_plans[c].optimizer_tier is Tier.HOST:
                self._grad_down(m, c)
                host_final.append(c)
        need_p = [c for c in self.needs[m] if c not in self.dev_param]
        need_g = [c for c in self.writes[m] if c not in self.dev_grad]
        protect = set(self.needs[m]) | set(self.writes[m])
        self._make_room(m, sum(self.pb[c] for c in need_p) + sum(self.gb[c] for c in need_g), protect,
                        param_bytes=sum(self.pb[c] for c in need_p))
        for c in need_p:
            self._fetch_param(m, c, Op.FETCH)
        for c in self.needs[m]:
            self.dev_param[c] = m
        for c in need_g:
            if c in self.grad_on_host:  # accumulated again later in backward (tied weights): bring the partial sum back
                self._emit(m, Op.FETCH, list=ChunkList.GRAD, chunk=c, src=Tier.HOST, dst=Tier.DEVICE,
                           channel=Channel.H2D, bytes=self.gb[c])
                self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.HOST)
                self.grad_on_host.discard(c)
            else:
                self._emit(m, Op.ALLOCATE, list=ChunkList.GRAD, chunk=c, dst=Tier.DEVICE)
            self.dev_grad.add(c)
            self.occ += self.gb[c]
        if self.plan.prefetch:
            self._prefetch(m, protect)
        # after this moment's fetches and prefetches: each channel is FIFO, so queuing the optimizer's
        # NVMe traffic first would hold the params the GPU is waiting for behind the CPU's Adam
        self._flush_deferred(m)
        if self.plan.optimizer_overlap and host_final:
            self._host_steps(m, host_final)

    def _emit(self, m: int, op: Op, **kw: object) -> None:
        self.actions.append(Action(moment=m, op=op, **kw))  # type: ignore[arg-type]

    def _next_use(self, c: int, m: int) -> int:
        uses = self.uses[c]
        i = bisect.bisect_left(uses, m)
        return uses[i] if i < len(uses) else self.T + 1

    def _make_room(self, m: int, need: int, protect: set[int], *, param_bytes: int = 0,
                   victim_after: int | None = None, grads_ok: bool = True) -> bool:
        """Evict until `need` more bytes fit at moment m; with victim_after, only chunks used later than it."""
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
                              f"(the policy uses {self.plan.device_limit_bytes / GB:.2f} GB of DEVICE); "
                              f"at least {(self.nm[m] + need + self._pinned(protect)) / GB:.2f} GB of DEVICE would be "
                              "needed at that moment")
            kind, c = victim
            if kind == "P":
                self._emit(m, Op.EVICT, list=ChunkList.PARAM, chunk=c, src=Tier.DEVICE)
                del self.dev_param[c]
                self.occ -= self.pb[c]
                self.param_occ -= self.pb[c]
            else:
                self._emit(m, Op.WRITE_BACK, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE, dst=Tier.HOST,
                           channel=Channel.D2H, bytes=self.gb[c])
                self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE)
                self.dev_grad.discard(c)
                self.grad_on_host.add(c)
                self.occ -= self.gb[c]
        return True

    def _pinned(self, protect: set[int]) -> int:
        """Bytes on DEVICE that cannot leave now: persistent and needed PARAM chunks, OS on DEVICE, needed grads."""
        params = sum(self.pb[c] for c in self.dev_param if c in protect or c in self.persistent)
        grads = sum(self.gb[c] for c in self.dev_grad if c in protect)
        return params + grads + sum(self.osb[c] for c in range(self.n) if self.plan.chunk_plans[c].os_tier is Tier.DEVICE)

    def _where(self, m: int) -> str:
        mm = self.problem.moments[m]
        return f"{mm.kind.value} {mm.module or '(root)'}"

    def _victim(self, m: int, protect: set[int], after: int | None, grads_ok: bool) -> tuple[str, int] | None:
        """A clean PARAM chunk by the policy's rule; a (dirty) GRAD chunk only when no PARAM chunk can go."""
        lru = self.plan.eviction is Eviction.LRU
        best: tuple[float, int] | None = None
        for c, last in self.dev_param.items():
            if c in protect or c in self.persistent:
                continue
            nu = self._next_use(c, m)
            if after is not None and nu <= after:
                continue
            key = float(-last) if lru else float(nu)
            if best is None or key > best[0]:
                best = (key, c)
        if best is not None:
            return ("P", best[1])
        if not grads_ok or after is not None:
            return None
        grads = [c for c in self.dev_grad if c not in protect]
        if not grads:
            return None
        return ("G", max(grads, key=lambda c: (self._next_grad_use(c, m), c)))

    def _next_grad_use(self, c: int, m: int) -> int:
        if self.last_grad[c] >= m:
            return self._next_use(c, m)
        return self.opt_moment

    def _fetch_param(self, m: int, c: int, op: Op) -> None:
        home = self.plan.param_home
        channel = Channel.H2D if home is Tier.HOST else Channel.NVME_READ
        self._emit(m, op, list=ChunkList.PARAM, chunk=c, src=home, dst=Tier.DEVICE, channel=channel, bytes=self.pb[c])
        self.dev_param[c] = m
        self.occ += self.pb[c]
        self.param_occ += self.pb[c]

    def _prefetch(self, m: int, protect: set[int]) -> None:
        scheduled: set[int] = set()
        min_budget = self.budget[m]
        for k in range(m + 1, min(self.T, m + 1 + PREFETCH_HORIZON_MOMENTS)):
            if self.problem.moments[k].phase is Phase.OPTIMIZER:
                break
            min_budget = min(min_budget, self.budget[k])
            for c in self.needs[k]:
                if c in self.dev_param or c in scheduled:
                    continue
                # do no harm (Cao et al. 1995): room from free space or from chunks used after c
                free = min_budget - self.occ
                cap = self.plan.max_live_param_bytes
                if self.pb[c] > free or (cap is not None and self.param_occ + self.pb[c] > cap):
                    saved = self.budget[m]
                    self.budget[m] = min_budget
                    ok = self._make_room(m, self.pb[c], protect | set(self.needs[k]), param_bytes=self.pb[c],
                                         victim_after=k, grads_ok=False)
                    self.budget[m] = saved
                    if not ok:
                        return
                self._fetch_param(m, c, Op.PREFETCH)
                self.dev_param[c] = m
                scheduled.add(c)

    # -- grads and the optimizer -------------------------------------------------------------
    def _grad_down(self, m: int, c: int) -> None:
        if c in self.dev_grad:
            self._emit(m, Op.WRITE_BACK, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE, dst=Tier.HOST,
                       channel=Channel.D2H, bytes=self.gb[c])
            self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE)
            self.dev_grad.discard(c)
            self.occ -= self.gb[c]
            self.grad_on_host.add(c)

    def _host_steps(self, m: int, chunks: list[int]) -> None:
        """CPU Adam for `chunks` at moment m: OS (and params) in from NVMe, step, back out.

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
                           channel=Channel.NVME_READ, bytes=self.pb[c])

        for c in chunks:
            reads(c)
            if self.plan.os_pipeline:
                for w in pending_writes:  # delayed write-back: after the next chunk's reads are queued
                    self._writes(m, w)
                pending_writes.clear()
            self._emit(m, Op.OPTIMIZER_STEP, chunk=c, dst=Tier.HOST, channel=Channel.CPU_OPTIMIZER)
            self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.HOST)
            self.grad_on_host.discard(c)
            self.stepped.add(c)
            if c in self.dev_param:
                if c in self.persistent:  # copy-back of the updated fp16 params (the GPU waits only when it uses them)
                    self._emit(m, Op.PREFETCH, list=ChunkList.PARAM, chunk=c, src=Tier.HOST, dst=Tier.DEVICE,
                               channel=Channel.H2D, bytes=self.pb[c])
                else:
                    self._emit(m, Op.EVICT, list=ChunkList.PARAM, chunk=c, src=Tier.DEVICE)
                    del self.dev_param[c]
                    self.occ -= self.pb[c]
                    self.param_occ -= self.pb[c]
            if self.plan.os_pipeline and self.timing is not None:
                self._defer(m, c)
            elif self.plan.os_pipeline:
                pending_writes.append(c)
            else:
                self._writes(m, c)
        for w in pending_writes:
            self._writes(m, w)

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
        return self.osb[c] + (self.pb[c] if self.plan.param_home is Tier.NVME else 0)

    def _writes(self, m: int, c: int) -> None:
        for x in self.problem.os_lists:
            if self.plan.chunk_plans[c].os_tier is Tier.NVME:
                self._emit(m, Op.WRITE_BACK, list=x, chunk=c, src=Tier.HOST, dst=Tier.NVME,
                           channel=Channel.NVME_WRITE, bytes=self.osb[c] // len(self.problem.os_lists))
                self._emit(m, Op.EVICT, list=x, chunk=c, src=Tier.HOST)
        if self.plan.param_home is Tier.NVME:
            self._emit(m, Op.WRITE_BACK, list=ChunkList.PARAM, chunk=c, src=Tier.HOST, dst=Tier.NVME,
                       channel=Channel.NVME_WRITE, bytes=self.pb[c])
            self._emit(m, Op.EVICT, list=ChunkList.PARAM, chunk=c, src=Tier.HOST)

    def _optimizer_moment(self, m: int) -> None:
        self._flush_deferred(m, everything=True)
        host = [c for c in self.trainable_chunks if c not in self.stepped
                and self.plan.chunk_plans[c].optimizer_tier is Tier.HOST]
        for c in host:
            self._grad_down(m, c)
        if host:
            self._host_steps(m, host)
        for c in self.trainable_chunks:
            if c in self.stepped or self.plan.chunk_plans[c].optimizer_tier is not Tier.DEVICE:
                continue
            need = (self.pb[c] if c not in self.dev_param else 0) + (self.gb[c] if c not in self.dev_grad else 0)
            self._make_room(m, need, {c}, param_bytes=self.pb[c] if c not in self.dev_param else 0)
            if c not in self.dev_param:
                self._fetch_param(m, c, Op.FETCH)
            if c not in self.dev_grad:
                self._emit(m, Op.FETCH, list=ChunkList.GRAD, chunk=c, src=Tier.HOST, dst=Tier.DEVICE,
                           channel=Channel.H2D, bytes=self.gb[c])
                self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.HOST)
                self.grad_on_host.discard(c)
                self.dev_grad.add(c)
                self.occ += self.gb[c]
            self._emit(m, Op.OPTIMIZER_STEP, chunk=c, dst=Tier.DEVICE, channel=Channel.COMPUTE)
            self.stepped.add(c)
            self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE)
            self.dev_grad.discard(c)
            self.occ -= self.gb[c]
            home = self.plan.param_home
            if home is not Tier.DEVICE:  # the home copy is stale now: copy back down
                self._emit(m, Op.WRITE_BACK, list=ChunkList.PARAM, chunk=c, src=Tier.DEVICE, dst=home,
                           channel=Channel.D2H if home is Tier.HOST else Channel.NVME_WRITE, bytes=self.pb[c])
            if c not in self.persistent:
                self._emit(m, Op.EVICT, list=ChunkList.PARAM, chunk=c, src=Tier.DEVICE)
                del self.dev_param[c]
                self.occ -= self.pb[c]
                self.param_occ -= self.pb[c]
        # steady state: DEVICE holds exactly the persistent chunks again
        for c in sorted(self.dev_param):
            if c not in self.persistent:
                self._emit(m, Op.EVICT, list=ChunkList.PARAM, chunk=c, src=Tier.DEVICE)
        for c in sorted(self.dev_grad):
            self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.DEVICE)
        for c in sorted(self.grad_on_host):
            self._emit(m, Op.EVICT, list=ChunkList.GRAD, chunk=c, src=Tier.HOST)

    def initial_residency(self) -> tuple[Residency, ...]:
        out = []
        home = self.plan.param_home
        for c in range(self.n):
            tiers = [Tier.DEVICE] if c in self.persistent else []
            if home is not Tier.DEVICE:
                tiers.append(home)
            out.append(Residency(list=ChunkList.PARAM, chunk=c, tiers=tuple(tiers)))
            for x in self.problem.os_lists:
                out.append(Residency(list=x, chunk=c, tiers=(self.plan.chunk_plans[c].os_tier,)))
        return tuple(out)


def _non_model_curve(problem: Problem, modes: tuple[ActivationMode, ...],
                     offloaded: dict[int, tuple[int, int]] | None) -> list[int]:
    """DEVICE bytes of non-model data and activations per moment, as planner.simulate counts them.

    `offloaded[b] = (from, to)`: block b's activations (or RECOMPUTE input) are off DEVICE for moments
    from <= m < to.
    """
    T = len(problem.moments)
    held = [0] * (T + 1)  # recorded activation bytes of blocks inside their window
    act = [0] * (T + 1)
    for b, blk in enumerate(problem.blocks):
        fl, bf = blk.forward_moments[1], blk.backward_moments[0]
        if fl < 0 or bf <= fl:
            continue
        keep = blk.input_bytes if modes[b] is ActivationMode.RECOMPUTE else blk.activation_bytes
        for m in range(fl, bf):
            held[m] += blk.activation_bytes
            off = offloaded is not None and b in offloaded and offloaded[b][0] <= m < offloaded[b][1]
            if not off:
                act[m] += keep
    return [max(0, problem.moments[m].non_model_bytes - held[m]) + act[m] for m in range(T)]


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
