"""The schedule format (`tide.schedule`, msgpack): everything the executor replays, decided offline.

The schedule repeats every iteration. `initial_residency` says which tiers hold a valid copy of
each chunk of each chunk list when an iteration starts; the actions, replayed in order, must
bring every chunk back to that state by the end of the iteration (steady state).

Action semantics (shared by the simulator and the executor; one moment = DESIGN.md §2):
- actions with `moment == m` run at moment m's event, in list order, before m's work;
- FETCH copies `list`/`chunk` from `src` to `dst` and the work of moment m waits for it;
  PREFETCH starts the same copy, and the first moment that needs the chunk waits for it;
- WRITE_BACK copies a dirty chunk from `src` down to `dst` (the lower copy was stale);
- EVICT drops the copy on `src`; another tier still holds a valid copy unless the data is dead
  (a GRAD chunk after its optimizer step);
- ALLOCATE creates a zero-filled chunk on `dst` (GRAD at the chunk's first backward use);
- OPTIMIZER_STEP updates the chunk's optimizer state and params on `dst` (DEVICE or HOST): GRAD,
  the OS lists and PARAM must be valid there, and afterwards copies on other tiers are stale;
- ACT_OFFLOAD / ACT_RELOAD move the activations `block` saved to `dst` and back to DEVICE;
- ALL_GATHER / REDUCE_SCATTER act on the comm group `chunk` over the INTER_GPU channel. A REDUCE_SCATTER
  with a `bucket` acts on those chunks of the comm group only (a per-bucket reduce-scatter, ZeRO-3's
  `reduce_bucket_size`): each chunk's grads are reduced into its owner's copy and leave the other
  ranks' DEVICE; the comm group's other chunks are reduced by later buckets. An ALL_GATHER with a `bucket`
  broadcasts those chunks from their owners (the comm group's chunks holding params; the others are padding,
  left as allocated) and leaves every chunk of the comm group on every rank's DEVICE.
Copies are copies: the source stays valid until an EVICT.

Integrity: the file's last top-level field, `content_digest`, is "sha256:" + the sha256 of the
msgpack of every other top-level field (`format`, `format_version` and the schedule, in file
order), written by `Schedule.to_msgpack` and checked on every read before anything else is
believed. A schedule edited or corrupted after the planner wrote it (one flipped bit in a chunk
id trains three params never; issue 21) is refused with one line instead of replayed.
"""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path

from schemas._base import (
    atomic_write_bytes,
    check_numbers,
    check_header,
    check_schema,
    constrained,
    digest_bytes,
    from_plain,
    frozen,
    pack_msgpack,
    read_bytes,
    require,
    to_plain,
    unpack_msgpack,
)
from schemas.trace import DTYPE_BYTES, DType, MomentKind, Phase

SCHEDULE_FORMAT = "tide.schedule"
# 2: the `content_digest` field (issue 21); `header.host_staging` and `header.optimizer_swap` were added to
# format 2 as optional fields (absent: PINNED, PIPELINED, what every earlier file meant), so earlier format-2
# files still read; `chunk_plans[i].grad_in_param_slot` likewise (absent: false)
SCHEDULE_VERSION = 2
_KIND = "schedule"
_FIX = "re-run `python -m planner solve TRACE --hardware HW -o SCHEDULE`"


class Tier(StrEnum):
    DEVICE = "DEVICE"
    HOST = "HOST"
    NVME = "NVME"


class ChunkList(StrEnum):
    PARAM = "PARAM"  # params in the compute dtype
    GRAD = "GRAD"  # grads in the compute dtype (exist from first backward use to the optimizer step)
    MASTER = "MASTER"  # fp32 master params (mixed precision only; with fp32 compute PARAM is the master)
    M = "M"  # Adam first moment
    V = "V"  # Adam second moment


OS_LISTS = (ChunkList.MASTER, ChunkList.M, ChunkList.V)


class Channel(StrEnum):
    H2D = "H2D"
    D2H = "D2H"
    NVME_READ = "NVME_READ"
    NVME_WRITE = "NVME_WRITE"
    INTER_GPU = "INTER_GPU"
    COMPUTE = "COMPUTE"
    CPU_OPTIMIZER = "CPU_OPTIMIZER"


BYTE_CHANNELS = (Channel.H2D, Channel.D2H, Channel.NVME_READ, Channel.NVME_WRITE, Channel.INTER_GPU)


class Op(StrEnum):
    FETCH = "FETCH"
    PREFETCH = "PREFETCH"
    WRITE_BACK = "WRITE_BACK"
    EVICT = "EVICT"
    ALLOCATE = "ALLOCATE"
    OPTIMIZER_STEP = "OPTIMIZER_STEP"
    ACT_OFFLOAD = "ACT_OFFLOAD"
    ACT_RELOAD = "ACT_RELOAD"
    ALL_GATHER = "ALL_GATHER"
    REDUCE_SCATTER = "REDUCE_SCATTER"


COPY_OPS = (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK)

# ----------------------------------------------------------------------------- action rules
# The one place that says which tier pair moves over which channel; the planner's materializer and
# simulator and the executor's store all read these (DESIGN.md §2: one SSD is simplex, and a copy
# between DEVICE and NVME crosses HOST).

TIERS = (Tier.DEVICE, Tier.HOST, Tier.NVME)
TIER_INDEX: dict[Tier, int] = {tier: i for i, tier in enumerate(TIERS)}  # array index, top tier first

# the channel a copy between two adjacent tiers is scheduled on (an action's `channel` field)
COPY_CHANNEL: dict[tuple[Tier, Tier], Channel] = {
    (Tier.HOST, Tier.DEVICE): Channel.H2D,
    (Tier.DEVICE, Tier.HOST): Channel.D2H,
    (Tier.NVME, Tier.HOST): Channel.NVME_READ,
    (Tier.HOST, Tier.NVME): Channel.NVME_WRITE,
}

# every channel a copy from src to dst crosses, in order (DEVICE <-> NVME goes through HOST)
COPY_PATH: dict[tuple[Tier, Tier], tuple[Channel, ...]] = {
    **{pair: (channel,) for pair, channel in COPY_CHANNEL.items()},
    (Tier.NVME, Tier.DEVICE): (Channel.NVME_READ, Channel.H2D),
    (Tier.DEVICE, Tier.NVME): (Channel.D2H, Channel.NVME_WRITE),
}



def copy_channel(src: Tier, dst: Tier) -> Channel:
    """The channel a copy from src to dst names in its action: the adjacent pair's (COPY_CHANNEL), and
    for DEVICE <-> NVME the SSD's side of the path (the simplex one the planner schedules around)."""
    path = COPY_PATH[(src, dst)]
    return next((ch for ch in path if ch in (Channel.NVME_READ, Channel.NVME_WRITE)), path[0])


class ActivationMode(StrEnum):
    KEEP = "KEEP"  # saved tensors stay on DEVICE until backward
    RECOMPUTE = "RECOMPUTE"  # only the block input is kept; forward reruns in backward
    SWAP_HOST = "SWAP_HOST"  # saved tensors go to HOST after forward, come back before backward
    SWAP_NVME = "SWAP_NVME"  # same, through HOST to the SSDs


class HostStaging(StrEnum):
    """How the system that made the schedule holds its HOST copies of chunks for DEVICE <-> HOST copies."""

    PINNED = "PINNED"  # page-locked host memory: DMA at the pinned rates, the issuing thread goes on (tide)
    # pageable host memory: the driver stages each copy through its own pinned buffer, at the pageable
    # rates (`links.*_pageable_gb_per_s`), and the issuing thread waits for it (CUDA Runtime API, "API
    # synchronization behavior"); a baseline's property (DeepSpeed, Gemini: `pin_memory` off by default)
    PAGEABLE = "PAGEABLE"


class OptimizerSwap(StrEnum):
    """How the system that made the schedule steps chunks whose optimizer state lives on NVME on HOST."""

    PIPELINED = "PIPELINED"  # reads of the next step may run while this one computes and writes back (tide)
    # one at a time: a step's NVMe reads start after the SSD writes issued before them (DeepSpeed
    # offload_optimizer pipeline_read/pipeline_write false: swap in, wait, step, swap out, wait)
    SERIAL = "SERIAL"


class SolverStatus(StrEnum):
    OPTIMAL = "OPTIMAL"  # proven optimal for the model solved
    FEASIBLE = "FEASIBLE"  # feasible, gap to the bound in the header
    HEURISTIC = "HEURISTIC"  # a rule-based policy (baselines), no proof
    INFEASIBLE = "INFEASIBLE"  # the policy cannot run this model on this hardware (baselines only)


@frozen
class ScheduleHeader:
    """Who made the schedule, from what, and how good it is.

    For tide's solve, `objective_seconds` is the simulator's replay of this schedule (the same time
    as `prediction.iteration_seconds` and `planner simulate`), `lower_bound_seconds` a valid bound
    (no plan the simulator can replay is faster: the physical limit, or the placement model's
    unpinned LP / root node where that is not above any replay), and `gap` the true gap
    (objective - bound) / objective, never clipped. The placement MIP's own gap is printed by
    `planner solve` and `compare`, and its model objective is in the notes."""

    planner_version: str
    policy: str = constrained(minLength=1)  # "tide", or the baseline it imitates
    model_name: str
    trace_digest: str = constrained(pattern="^sha256:[0-9a-f]{64}$")
    hardware_name: str
    hardware_digest: str = constrained(pattern="^sha256:[0-9a-f]{64}$")
    world_size: int = constrained(minimum=1)
    solver_status: SolverStatus
    # tide's solve: the simulator's replay of this schedule (= prediction.iteration_seconds)
    objective_seconds: float = constrained(minimum=0)
    lower_bound_seconds: float = constrained(minimum=0)  # a valid bound: no plan the simulator can replay is faster
    # the true gap (objective - lower bound) / objective, never clipped (the MIP's own gap is in the notes)
    gap: float = constrained(minimum=0)
    notes: tuple[str, ...]  # why the policy did what it did, and anything infeasible
    # DEVICE <-> HOST copies through pinned or pageable host memory (the simulator prices them so; the
    # executor always pins, PAGEABLE is a baseline's property it need not emulate). Optional in format 2
    # and written only when PAGEABLE (`_plain`): a file without it is PINNED, which every format-2 file
    # written before the field meant (only `planner solve` writes schedules, and tide pins), so those
    # files, the golden schedules among them, keep their bytes and digests
    host_staging: HostStaging = HostStaging.PINNED
    # HOST steps of NVMe optimizer state pipelined or one at a time (the simulator prices them so; the
    # executor pipelines). Optional in format 2 as `host_staging`, written only when SERIAL (`_plain`)
    optimizer_swap: OptimizerSwap = OptimizerSwap.PIPELINED


@frozen
class Budgets:
    """Bytes the executor may use per tier (DEVICE enforced as a hard limit)."""

    device_bytes: int = constrained(minimum=0)
    host_bytes: int = constrained(minimum=0)
    nvme_bytes: int = constrained(minimum=0)


@frozen
class Chunk:
    """One chunk index; the same index exists in every chunk list."""

    id: int = constrained(minimum=0)
    elements: int = constrained(minimum=1)  # capacity (a tensor larger than chunk_elements gets its own size)
    used_elements: int = constrained(minimum=0)
    block: int = constrained(minimum=-1)  # the block that first uses it, -1 outside blocks
    comm_group: int = constrained(minimum=0)
    owner_rank: int = constrained(minimum=0)


@frozen
class TensorSlot:
    """Where a parameter lives: the same chunk and offset in every chunk list."""

    tensor: int = constrained(minimum=0)  # trace tensor id
    names: tuple[str, ...] = constrained(minItems=1)
    shape: tuple[int, ...]
    chunk: int = constrained(minimum=0)
    offset_elements: int = constrained(minimum=0)
    numel: int = constrained(minimum=0)
    trainable: bool


@frozen
class ChunkLayout:
    """Chunk size, chunk lists and the tensor -> (chunk, offset) map."""

    chunk_elements: int = constrained(minimum=1)
    lists: tuple[ChunkList, ...] = constrained(minItems=1)
    list_dtypes: dict[ChunkList, DType]
    chunks: tuple[Chunk, ...]
    tensors: tuple[TensorSlot, ...]


@frozen
class ChunkPlan:
    """Where a chunk's optimizer state lives and where its optimizer step runs."""

    chunk: int = constrained(minimum=0)
    os_tier: Tier
    optimizer_tier: Tier  # DEVICE (GPU Adam) or HOST (CPU Adam)
    # PatrickStar's grad in the param chunk's slot (PS.2: `patrickstar/core/hook.py`
    # `post_sub_module_backward_function`, "The memory space of the last updated param fp16 is covered
    # by grad fp16"; paper §6.2): the backward write of the chunk's last use puts its final GRAD into the
    # DEVICE bytes of its PARAM copy (that PARAM copy is dead from then on), so DEVICE holds one chunk's
    # worth for PARAM and GRAD together; the partial grads before it are the moment's non-model temporaries;
    # the optimizer step writes PARAM back into the slot. Optional in format 2, written only when true
    # (`_plain`): a file without it is false, what every earlier file meant, so they keep their bytes
    grad_in_param_slot: bool = False


@frozen
class Residency:
    """Tiers holding a valid copy of one chunk at the start (and end) of every iteration."""

    list: ChunkList
    chunk: int = constrained(minimum=0)
    tiers: tuple[Tier, ...]


@frozen
class ActivationPlan:
    """What happens to the activations one block saves for backward."""

    block: int = constrained(minimum=0)
    module: str
    mode: ActivationMode
    bytes: int = constrained(minimum=0)  # bytes the block saves for backward (what KEEP holds, SWAP moves)
    input_bytes: int = constrained(minimum=0)  # what RECOMPUTE keeps instead
    recompute_seconds: float = constrained(minimum=0)  # extra compute in backward under RECOMPUTE
    recompute_flops: int = constrained(minimum=0)


@frozen
class MomentRef:
    """A moment as the schedule sees it: copied from the trace, times resolved for the hardware.

    The executor's replay check compares (phase, kind, module) with what the model does; the
    simulator needs the rest, so a schedule can be simulated without its trace.
    """

    id: int = constrained(minimum=0)
    phase: Phase
    kind: MomentKind
    module: str
    block: int = constrained(minimum=-1)
    tensors: tuple[int, ...]  # trace tensor ids the following work touches (their PARAM chunks must be on DEVICE)
    compute_seconds: float = constrained(minimum=0)  # measured, or flops / hardware rate for meta traces
    flops: int = constrained(minimum=0)
    non_model_bytes: int = constrained(minimum=0)  # peak during the following work (with every block's activations kept)


@frozen
class Stage:
    """Consecutive moments the planner treats as one unit of time."""

    id: int = constrained(minimum=0)
    name: str
    phase: Phase
    block: int = constrained(minimum=-1)
    first_moment: int = constrained(minimum=0)
    last_moment: int = constrained(minimum=0)
    predicted_seconds: float = constrained(minimum=0)


@frozen
class Action:
    """One thing the executor does at a moment (see the module docstring)."""

    moment: int = constrained(minimum=0)
    op: Op
    list: ChunkList | None = None
    chunk: int = constrained(minimum=-1, default=-1)  # chunk id (comm group id for collectives), -1: none
    block: int = constrained(minimum=-1, default=-1)  # block id for activation ops, -1: none
    src: Tier | None = None
    dst: Tier | None = None
    channel: Channel | None = None
    bytes: int = constrained(minimum=0, default=0)
    # REDUCE_SCATTER / ALL_GATHER only: the chunk ids (consecutive, ascending, inside comm group `chunk`) of a per-bucket
    # reduce-scatter, whose grads are final at this moment, or of an all-gather broadcasting its comm group's
    # chunks that hold params (planner.emit `gather_per_chunk`); () = the whole comm group. Optional in format 2,
    # written only when not empty (`_plain`), so files without it keep their bytes and meaning
    bucket: tuple[int, ...] = ()


def action_channels(action: Action) -> tuple[Channel, ...]:
    """Byte channels an action's bytes cross: its own, plus HOST's other side for DEVICE<->NVME paths
    (COPY_PATH; activations move between DEVICE and their `dst`/`src`). An optimizer step moves no bytes."""
    if action.channel is None or action.op is Op.OPTIMIZER_STEP:
        return ()
    if action.op is Op.ACT_OFFLOAD:
        pair = (Tier.DEVICE, action.dst)
    elif action.op is Op.ACT_RELOAD:
        pair = (action.src, Tier.DEVICE)
    else:
        pair = (action.src, action.dst)
    path = COPY_PATH.get(pair, ())  # type: ignore[arg-type]
    return path if len(path) > 1 else (action.channel,)


@frozen
class Prediction:
    """What the planner's cost model expects one iteration to cost."""

    iteration_seconds: float = constrained(minimum=0)
    flops: int = constrained(minimum=0)  # model FLOPs of one iteration (incl. recompute)
    bytes_per_channel: dict[Channel, int]
    busy_seconds_per_channel: dict[Channel, float]
    peak_bytes_per_tier: dict[Tier, int]


@frozen
class Schedule:
    """A complete plan for one iteration, replayed every iteration."""

    header: ScheduleHeader
    budgets: Budgets
    layout: ChunkLayout
    chunk_plans: tuple[ChunkPlan, ...]
    activation_plans: tuple[ActivationPlan, ...]
    moments: tuple[MomentRef, ...] = constrained(minItems=1)
    stages: tuple[Stage, ...] = constrained(minItems=1)
    initial_residency: tuple[Residency, ...]
    actions: tuple[Action, ...]
    prediction: Prediction

    # -- IO ---------------------------------------------------------------------------------
    def to_msgpack(self) -> bytes:
        validate_schedule(self, source="(schedule being written)")
        return pack_msgpack(seal({"format": SCHEDULE_FORMAT, "format_version": SCHEDULE_VERSION, **_plain(self)}))

    def write(self, path: str | Path) -> None:
        atomic_write_bytes(path, self.to_msgpack())

    @classmethod
    def from_msgpack(cls, payload: bytes, *, source: str = "(bytes)") -> Schedule:
        data = unpack_msgpack(_KIND, source, payload, _FIX)
        check_header(_KIND, source, data, SCHEDULE_FORMAT, SCHEDULE_VERSION, _FIX)
        check_content_digest(data, source=source)
        check_schema(_KIND, source, "schedule.schema.json", data, fix=_FIX)
        data = {k: v for k, v in data.items() if k not in ("format", "format_version", DIGEST_FIELD)}
        schedule = from_plain(cls, data)
        validate_schedule(schedule, source=source)
        return schedule

    @classmethod
    def read(cls, path: str | Path) -> Schedule:
        return cls.from_msgpack(read_bytes(_KIND, path), source=str(path))

    def content_digest(self) -> str:
        """The `content_digest` its file carries (a checkpoint names the schedule it belongs to with it)."""
        return content_digest({"format": SCHEDULE_FORMAT, "format_version": SCHEDULE_VERSION, **_plain(self)})


def _plain(s: Schedule) -> dict:
    """The schedule's plain data as its file holds it: `header.host_staging` only when not PINNED,
    `header.optimizer_swap` only when not PIPELINED, `chunk_plans[i].grad_in_param_slot` only when true,
    `actions[i].bucket` only when not empty."""
    plain = to_plain(s)
    plain["chunk_plans"] = [p if p.get("grad_in_param_slot") else {k: v for k, v in p.items() if k != "grad_in_param_slot"}
                            for p in plain["chunk_plans"]]
    plain["actions"] = [a if a.get("bucket") else {k: v for k, v in a.items() if k != "bucket"} for a in plain["actions"]]
    if s.header.host_staging is HostStaging.PINNED:
        plain["header"] = {k: v for k, v in plain["header"].items() if k != "host_staging"}
    if s.header.optimizer_swap is OptimizerSwap.PIPELINED:
        plain["header"] = {k: v for k, v in plain["header"].items() if k != "optimizer_swap"}
    return plain


DIGEST_FIELD = "content_digest"


def content_digest(data: dict) -> str:
    """The digest a schedule's plain data (format and version included, `content_digest` excluded) must carry."""
    return digest_bytes(pack_msgpack({k: v for k, v in data.items() if k != DIGEST_FIELD}))


def seal(data: dict) -> dict:
    """`data` (plain schedule with format and version) with its `content_digest` as the last field."""
    body = {k: v for k, v in data.items() if k != DIGEST_FIELD}
    return {**body, DIGEST_FIELD: content_digest(body)}


def check_content_digest(data: dict, *, source: str) -> None:
    """One line unless the plain data carries the digest of its own content (see the module docstring)."""
    found = data.get(DIGEST_FIELD)
    require(isinstance(found, str), _KIND, source, DIGEST_FIELD,
            f"the schedule's content digest (a string), found {_short(found)}", _FIX)
    require(found == content_digest(data), _KIND, source, DIGEST_FIELD,
            "content digest does not match: the file was changed after the planner wrote it", _FIX)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_OP_FIELDS: dict[Op, tuple[str, ...]] = {
    Op.FETCH: ("list", "chunk", "src", "dst", "channel"),
    Op.PREFETCH: ("list", "chunk", "src", "dst", "channel"),
    Op.WRITE_BACK: ("list", "chunk", "src", "dst", "channel"),
    Op.EVICT: ("list", "chunk", "src"),
    Op.ALLOCATE: ("list", "chunk", "dst"),
    Op.OPTIMIZER_STEP: ("chunk", "dst", "channel"),
    Op.ACT_OFFLOAD: ("block", "dst", "channel"),
    Op.ACT_RELOAD: ("block", "src", "channel"),
    Op.ALL_GATHER: ("list", "chunk", "channel"),
    Op.REDUCE_SCATTER: ("list", "chunk", "channel"),
}


def validate_schedule(s: Schedule, *, source: str) -> None:
    """Semantic rules: dense ids, references that resolve, tensors inside their chunks, sorted actions.

    Dynamic rules (use after arrival, capacity, steady state) belong to the simulator
    (`planner.simulate`), which the tests run on every schedule they make.
    """

    def req(cond: bool, path: str, message: str) -> None:
        require(cond, _KIND, source, path, message, _FIX)

    check_numbers(_KIND, source, s, fix=_FIX)
    lay = s.layout
    n_chunks, n_moments = len(lay.chunks), len(s.moments)
    req(set(lay.list_dtypes) == set(lay.lists), "layout.list_dtypes", f"a dtype for each of {[x.value for x in lay.lists]}")
    req(ChunkList.PARAM in lay.lists, "layout.lists", "PARAM among the chunk lists")
    # with several ranks the layout pads chunks to whole comm groups of world_size, one chunk per rank
    # (planner/layout.py `_comm_groups`), so no rank owns nothing; this also bounds the per-rank state
    # the simulator and executor allocate by the file's size (world_size = 2**63-1, resealed, ran the
    # simulator out of memory: issue 21 fuzz)
    ws = s.header.world_size
    req(ws == 1 or ws <= n_chunks, "header.world_size",
        f"at most the number of chunks ({n_chunks}: whole comm groups of world_size chunks), found {ws}")
    for i, c in enumerate(lay.chunks):
        req(c.id == i, f"layout.chunks[{i}].id", f"ids dense and in order, expected {i}, found {c.id}")
        req(c.used_elements <= c.elements, f"layout.chunks[{i}].used_elements", f"at most elements={c.elements}, found {c.used_elements}")
        req(c.owner_rank < s.header.world_size, f"layout.chunks[{i}].owner_rank", f"a rank below world_size={s.header.world_size}")
    spans: dict[int, list[tuple[int, int, int]]] = {}
    placed: set[int] = set()
    for i, t in enumerate(lay.tensors):
        req(t.tensor not in placed, f"layout.tensors[{i}].tensor", f"each tensor placed once, found tensor {t.tensor} twice")
        placed.add(t.tensor)
        req(t.numel == math.prod(t.shape), f"layout.tensors[{i}].numel", f"the product of shape {list(t.shape)} = {math.prod(t.shape)}, found {t.numel}")
        req(0 <= t.chunk < n_chunks, f"layout.tensors[{i}].chunk", f"a chunk id below {n_chunks}, found {t.chunk}")
        end = t.offset_elements + t.numel
        req(end <= lay.chunks[t.chunk].elements, f"layout.tensors[{i}]",
            f"inside chunk {t.chunk} ({lay.chunks[t.chunk].elements} elements), found it ends at {end}")
        spans.setdefault(t.chunk, []).append((t.offset_elements, end, i))
    for chunk, items in spans.items():
        items.sort()
        for (_, end_a, a), (start_b, _, b) in zip(items, items[1:]):
            req(start_b >= end_a, f"layout.tensors[{b}]", f"no overlap in chunk {chunk}, found it overlaps layout.tensors[{a}]")
    req(len(s.chunk_plans) == n_chunks, "chunk_plans", f"one plan per chunk ({n_chunks}), found {len(s.chunk_plans)}")
    for i, p in enumerate(s.chunk_plans):
        req(p.chunk == i, f"chunk_plans[{i}].chunk", f"plans in chunk order, expected {i}, found {p.chunk}")
        req(p.optimizer_tier in (Tier.DEVICE, Tier.HOST), f"chunk_plans[{i}].optimizer_tier", f"DEVICE or HOST, found {p.optimizer_tier}")
        if p.grad_in_param_slot:  # the final grad is written into the PARAM chunk's bytes: it must have a GRAD list and fit
            req(ChunkList.MASTER in lay.lists, f"chunk_plans[{i}].grad_in_param_slot",
                "false without a MASTER list: with PARAM the master copy the step reads it, so the grad cannot "
                "overwrite it (PatrickStar keeps fp32 masters, PS.9), found true")
            req(ChunkList.GRAD in lay.lists, f"chunk_plans[{i}].grad_in_param_slot",
                "false for a layout without a GRAD list (no grad to put in the param slot), found true")
            req(ChunkList.GRAD not in lay.lists
                or DTYPE_BYTES[lay.list_dtypes[ChunkList.GRAD]] <= DTYPE_BYTES[lay.list_dtypes[ChunkList.PARAM]],
                f"chunk_plans[{i}].grad_in_param_slot",
                f"false when GRAD's dtype ({lay.list_dtypes.get(ChunkList.GRAD)}) is wider than PARAM's "
                f"({lay.list_dtypes.get(ChunkList.PARAM)}): the grad would not fit the param's slot, found true")
    for i, m in enumerate(s.moments):
        req(m.id == i, f"moments[{i}].id", f"ids dense and in order, expected {i}, found {m.id}")
        for j, tid in enumerate(m.tensors):
            req(tid in placed, f"moments[{i}].tensors[{j}]", f"a tensor placed in layout.tensors, found tensor {tid}")
    expected_first = 0
    for i, st in enumerate(s.stages):
        req(st.id == i, f"stages[{i}].id", f"ids dense and in order, expected {i}, found {st.id}")
        req(st.first_moment == expected_first and st.first_moment <= st.last_moment < n_moments, f"stages[{i}]",
            f"moments {expected_first}..(<{n_moments}) continuing the previous stage, found {st.first_moment}..{st.last_moment}")
        expected_first = st.last_moment + 1
    req(expected_first == n_moments, "stages", f"stages covering all {n_moments} moments, found they end at {expected_first - 1}")
    seen: set[tuple[ChunkList, int]] = set()
    for i, r in enumerate(s.initial_residency):
        req(r.list in lay.lists, f"initial_residency[{i}].list", f"one of {[x.value for x in lay.lists]}, found {r.list}")
        req(r.chunk < n_chunks, f"initial_residency[{i}].chunk", f"a chunk id below {n_chunks}, found {r.chunk}")
        req((r.list, r.chunk) not in seen, f"initial_residency[{i}]", f"each (list, chunk) once, found {r.list}/{r.chunk} twice")
        seen.add((r.list, r.chunk))
    n_blocks = len(s.activation_plans)
    for i, p in enumerate(s.activation_plans):
        req(p.block == i, f"activation_plans[{i}].block", f"plans in block order, expected {i}, found {p.block}")
    last = 0
    for i, a in enumerate(s.actions):
        path = f"actions[{i}]"
        req(a.moment < n_moments, f"{path}.moment", f"a moment below {n_moments}, found {a.moment}")
        req(a.moment >= last, f"{path}.moment", f"actions sorted by moment, found {a.moment} after {last}")
        last = a.moment
        for name in _OP_FIELDS[a.op]:
            value = getattr(a, name)
            req(value is not None and value != -1, f"{path}.{name}", f"a value for a {a.op} action, found none")
        if a.op in COPY_OPS:
            req(a.src != a.dst, f"{path}.dst", f"a tier other than src={a.src} for a {a.op} action, found {a.dst}")
        if a.list is not None:
            req(a.list in lay.lists, f"{path}.list", f"one of {[x.value for x in lay.lists]}, found {a.list}")
        if a.op not in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ACT_OFFLOAD, Op.ACT_RELOAD) and a.chunk != -1:
            req(a.chunk < n_chunks, f"{path}.chunk", f"a chunk id below {n_chunks}, found {a.chunk}")
        if a.block != -1:
            req(a.block < n_blocks, f"{path}.block", f"a block id below {n_blocks}, found {a.block}")
        if a.bucket:
            req(a.op in (Op.REDUCE_SCATTER, Op.ALL_GATHER), f"{path}.bucket",
                f"empty for a {a.op} action (only a REDUCE_SCATTER or an ALL_GATHER has a bucket)")
            first = a.chunk * ws
            req(list(a.bucket) == list(range(a.bucket[0], a.bucket[0] + len(a.bucket))) and first <= a.bucket[0]
                and a.bucket[-1] < min(first + ws, n_chunks), f"{path}.bucket",
                f"consecutive ascending chunk ids inside comm group {a.chunk} (chunks {first}..{min(first + ws, n_chunks) - 1}), "
                f"found {list(a.bucket)}")


__all__ = [
    "Action", "ActivationMode", "ActivationPlan", "BYTE_CHANNELS", "Budgets", "Channel", "Chunk", "ChunkLayout",
    "ChunkList", "ChunkPlan", "HostStaging", "COPY_OPS", "MomentRef", "Op", "OptimizerSwap", "OS_LISTS", "Prediction", "Residency", "Schedule",
    "ScheduleHeader", "SCHEDULE_FORMAT", "SCHEDULE_VERSION", "SolverStatus", "Stage", "TensorSlot", "Tier",
    "COPY_CHANNEL", "COPY_PATH", "TIERS", "TIER_INDEX", "action_channels", "copy_channel", "validate_schedule",
    "DIGEST_FIELD", "check_content_digest", "content_digest", "seal",
]
