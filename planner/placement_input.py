"""The placement model's input: stages, blocks and chunk classes (interchangeable chunks, counted
instead of carried one by one) with their bytes and the hardware's capacities and rates, built
from a Problem and a chunk layout (`placement_input`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from planner.costmodel import (
    channel_bytes_per_s,
    cpu_adam_beside_copies,
    cpu_adam_threads,
    dram_bytes_per_s,
    nvme_time_rows,
    optimizer_step_price,
    pcie_time_rows,
)
from planner.problem import Problem
from schemas._base import frozen
from schemas.schedule import Channel, ChunkLayout, ChunkList, Phase, Tier
from schemas.trace import DTYPE_BYTES

# Up to this many blocks the model prices CPU Adam at its rate alone and charges what a step loses beside
# copies (Note [CPU Adam beside copies, in the model] in planner/placement_time.py); deeper at the rate with
# copies, as before. Measured on rtx4090-768g-12ssd: PatrickStar's 12B (60 blocks) 8.064 -> 7.833 s and 4B
# (64) 2.372 -> 2.317 s with the rows (4B: 6.1 -> 13.5 CPU s); GPT-3 175B (96 blocks) replayed 121.4 / 113.5 s
# with them against 120.8 / 112.5 s without (rtx4090 / a100-80g-12ssd), and 512 blocks x 4096 solved in 92
# CPU s instead of 58 (issue 18's target: 60) for a plan replaying 64.9 s instead of 66.6 s (bench/RESULTS.md
# "Session 13")
BESIDE_COPIES_MAX_BLOCKS = 64


@frozen
class ChunkClass:
    """Interchangeable chunks: same stages touch them, same size, same trainability."""

    id: int
    chunks: tuple[int, ...]  # chunk ids (layout order)
    param_bytes: int  # PARAM (and GRAD) bytes of one chunk, compute dtype
    os_bytes: int  # optimizer-state bytes of one chunk (MASTER + M + V, or M + V in fp32)
    elements: int  # elements of one chunk (optimizer work)
    trainable: bool  # has grads and optimizer state
    use_stages: tuple[int, ...]  # stages whose work touches these chunks (sorted)
    first_backward_stage: int  # first backward stage touching them, -1 if none
    last_backward_stage: int  # grads final after this stage (optimizer may start), -1 if none
    # ranks per comm group (world_size): `chunks` holds whole comm groups of this many consecutive
    # chunks, one owned per rank (PatrickStar §7), and the model counts comm groups: every rank holds
    # its own (local) chunk of each, so one set of counts describes every rank (issue 18 item 1)
    comm_group_size: int = 1
    # chunks of each comm group holding trainable tensors (planner.layout pads a block's run of chunks
    # to whole comm groups with empty ones): materialize's GRAD entry is these chunks' (device_cache),
    # and only their owners step (at most min(t, q) of them on one node; the padding is appended, so
    # in tide's layout they are the comm group's first chunks, owned by ranks 0..t-1)
    trainable_chunks: int = 1
    # per use stage (aligned with use_stages): the compute of that stage from the latest moment at
    # which one of these chunks is first needed there to the stage's end (the work the chunk's copy
    # cannot overlap once that moment is reached; Note [late arrivals] in planner.placement_time)
    use_tail_seconds: tuple[float, ...] = ()
    # reduce-scatter per bucket (p > 1, Note [reduce-scatter per bucket] in planner/device_cache.py), per
    # backward stage from first_backward_stage to last_backward_stage: the chunks of a comm group's GRAD a rank
    # holds when each chunk is reduced into its owner after its own last backward stage (the chunks not final
    # yet, plus its own among the final ones), and the chunks that become final in the stage (one reduce of
    # a chunk's bytes each); the largest over the class's comm groups. () when every chunk of the comm group
    # is final in the same stage (a bucket is then the whole group: nothing to choose)
    bucket_held_chunks: tuple[int, ...] = ()
    bucket_final_chunks: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        """Comm groups of the class (chunks when world_size is 1): what the model's variables count."""
        return len(self.chunks) // self.comm_group_size


@frozen
class BlockData:
    """A block's activation choice and where it acts."""

    id: int
    activation_bytes: int  # saved for backward (KEEP holds it, SWAP moves it)
    input_bytes: int  # what RECOMPUTE keeps instead
    recompute_seconds: float
    forward_stage: int  # stage of the block's forward (the activations appear there)
    backward_stage: int  # stage of the block's backward (they are needed there)


@frozen
class StageData:
    id: int
    name: str
    phase: Phase
    compute_seconds: float  # sum of the moments' compute
    non_model_bytes: int  # max of the moments' non-model curve (all activations kept)
    tail_non_model_bytes: int = -1  # the curve at the stage's last moment (-1: same as the max)
    # the stage's peak moment (the last moment with the largest non-model bytes): the compute up to
    # and including it, and the PARAM + GRAD chunk bytes its own work needs on DEVICE then (-1: not
    # known, no late-arrival row; Note [late arrivals] in planner.placement_time)
    peak_compute_seconds: float = -1.0
    peak_need_bytes: int = 0


@frozen
class PlacementInput:
    """Everything the placement model needs, in bytes and seconds (built from a Problem + layout)."""

    chunk_classes: tuple[ChunkClass, ...]
    blocks: tuple[BlockData, ...]
    stages: tuple[StageData, ...]
    device_bytes: int
    host_bytes: int
    nvme_bytes: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    nvme_read_bytes_per_s: float  # 0 when there are no SSDs
    nvme_write_bytes_per_s: float
    cpu_adam_seconds_per_element: float
    gpu_adam_seconds_per_element: float
    optimizer_overlap: bool  # CPU Adam runs during backward as soon as a chunk's grads are final
    optimizer_stage: int  # the stage holding the optimizer step (the last stage)
    stream_optimizer: bool = True  # OS on HOST may be streamed to the DEVICE for GPU Adam
    checkpoint_offload: bool = True  # RECOMPUTE inputs may wait on HOST (one choice for all blocks)
    param_nvme_home: bool = True  # non-persistent CPU-stepped PARAM may live on NVME instead of HOST (Fuyou)
    duplex_bytes_per_s: float = 0.0  # H2D + D2H together while both run (links.duplex_*); 0: full duplex
    dram_bytes_per_s: float = 0.0  # host DRAM shared by copies, SSD traffic and CPU Adam; 0: not priced
    adam_dram_bytes_per_element: float = 0.0  # host DRAM bytes CPU Adam moves per param
    # CPU Adam's rate with copies beside it over its rate alone (<= 1). Below 1 `cpu_adam_seconds_per_element`
    # is the rate alone and the CPU rows charge the time a step loses while copies run (Note [CPU Adam beside
    # copies, in the model] in planner/placement_time.py); 1: every step at `cpu_adam_seconds_per_element`
    cpu_adam_beside_copies: float = 1.0
    # data-parallel ranks (issue 18 item 1; docs/rank-aware-placement.md): p = cluster.world_size,
    # q = ranks per node sharing HOST, NVME, the CPU optimizer and DRAM. DEVICE rows are per rank
    # (the local 1/p of the OS, the gathered p chunks of a comm group in use), HOST/NVME rows per node
    ranks: int = 1
    ranks_per_node: int = 1
    # per-rank INTER_GPU bytes ((p-1) chunks per all-gather / reduce-scatter, the schedule's
    # convention) per second of the collective's two hierarchical stages (Hardware.collective_seconds:
    # intra-node ring (q-1)/q * S over links.inter_gpu_gb_per_s, the node's NIC (N-1)/N * S over
    # links.inter_node_gb_per_s); 0: that stage does not exist (one GPU per node, one node)
    collective_intra_bytes_per_s: float = 0.0
    collective_inter_bytes_per_s: float = 0.0
    nvme_time_rows: tuple[tuple[float, float], ...] = ()
    """(seconds per read byte, per write byte) rows: the SSDs need at least max_k a_k R + b_k W for R bytes
    read and W written (costmodel.nvme_time_rows: mixed reads and writes, the host cap); empty: simplex
    at the two rates above (R / read + W / write)"""
    pcie_time_rows: tuple[tuple[float, float], ...] = ()
    """(seconds per H2D byte, per D2H byte) rows of the link both ways (costmodel.pcie_time_rows: the
    links.duplex_* rates while both run); empty: each direction alone at its rate"""

    def nvme_rows(self) -> tuple[tuple[float, float], ...]:
        """The SSD time rows, the simplex row when none were given."""
        if self.nvme_time_rows:
            return self.nvme_time_rows
        return ((1.0 / (self.nvme_read_bytes_per_s or 1.0), 1.0 / (self.nvme_write_bytes_per_s or 1.0)),)

    @property
    def has_nvme(self) -> bool:
        return self.nvme_bytes > 0 and self.nvme_read_bytes_per_s > 0 and self.nvme_write_bytes_per_s > 0

    def with_capacity(self, tier: Tier, value: int) -> PlacementInput:
        field = {Tier.DEVICE: "device_bytes", Tier.HOST: "host_bytes", Tier.NVME: "nvme_bytes"}[tier]
        return dataclasses.replace(self, **{field: value})


def _bucket_profile(chunk_ids: list[int], ws: int, backward: list[int], uses: dict[int, set[int]],
                    trainable_chunk: dict[int, bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """ChunkClass.bucket_held_chunks / bucket_final_chunks of a class's comm groups (() if nothing to choose)."""
    if not backward:
        return (), ()
    fb, lb = min(backward), max(backward)
    back = set(backward)
    held = [0] * (lb - fb + 1)
    finals = [0] * (lb - fb + 1)
    t = 0
    for k in range(0, len(chunk_ids), ws):
        group = [c for c in chunk_ids[k:k + ws] if trainable_chunk[c]]
        t = max(t, len(group))
        last = [max((s for s in uses.get(c, ()) if s in back), default=lb) for c in group]
        for i, s in enumerate(range(fb, lb + 1)):
            held[i] = max(held[i], sum(1 for x in last if x >= s) + (1 if any(x < s for x in last) else 0))
            finals[i] = max(finals[i], sum(1 for x in last if x == s))
    # nothing to choose unless some stage holds fewer chunks (two chunks final in two stages: 1 + own 1)
    return (tuple(held), tuple(finals)) if min(held) < t else ((), ())


def placement_input(problem: Problem, layout: ChunkLayout, *, optimizer_overlap: bool = True) -> PlacementInput:
    """Aggregate a Problem (planner.problem) and a ChunkLayout into the model's input.

    Chunks are sorted into chunk classes by the stages that touch them (plus size and trainability); a block's
    activation plan acts between the stage of its forward and the stage of its backward.
    """
    hw = problem.hardware
    stages = problem.stages
    n_stages = len(stages)
    stage_of_moment: dict[int, int] = {}
    for st in stages:
        for m in range(st.first_moment, st.last_moment + 1):
            stage_of_moment[m] = st.id
    ws = max(1, problem.world_size)
    chunk_of_tensor: dict[int, int] = {}
    trainable_chunk: dict[int, bool] = defaultdict(bool)
    for slot in layout.tensors:
        chunk_of_tensor.setdefault(slot.tensor, slot.chunk)
        trainable_chunk[slot.chunk] |= slot.trainable
    uses: dict[int, set[int]] = defaultdict(set)
    first_use: dict[tuple[int, int], int] = {}  # (chunk, stage) -> the first moment of the stage needing it
    last_use: dict[tuple[int, int], int] = {}  # (chunk, stage) -> the last moment of the stage needing it
    param_item = DTYPE_BYTES[problem.compute_dtype]
    chunk_bytes = {c.id: c.elements * param_item for c in layout.chunks}
    stage_data = []
    suffix_compute: dict[int, float] = {}  # moment -> compute from it to its stage's end
    for st in stages:
        compute = 0.0
        peak = 0
        peak_at = st.first_moment
        tail = problem.moments[st.last_moment].non_model_bytes
        for m in range(st.first_moment, st.last_moment + 1):
            mom = problem.moments[m]
            compute += mom.compute_seconds
            if mom.non_model_bytes >= peak:
                peak, peak_at = mom.non_model_bytes, m
            if mom.phase is Phase.OPTIMIZER:
                continue  # the optimizer touches every chunk; where it steps is the chunk plans' decision
            for t in mom.tensors:
                if t in chunk_of_tensor:
                    uses[chunk_of_tensor[t]].add(st.id)
                    first_use.setdefault((chunk_of_tensor[t], st.id), m)
                    last_use[(chunk_of_tensor[t], st.id)] = m
        left = 0.0
        for m in range(st.last_moment, st.first_moment - 1, -1):
            left += problem.moments[m].compute_seconds
            suffix_compute[m] = left
        peak_mom = problem.moments[peak_at]
        need = 0
        if peak_mom.phase is not Phase.OPTIMIZER and ws == 1:
            needed = sorted({chunk_of_tensor[t] for t in peak_mom.tensors if t in chunk_of_tensor})
            # PARAM of every chunk the peak moment's work touches, GRAD of the trainable ones it writes
            # (the simulator's `needs` / `writes` of that moment: both must be valid on DEVICE then)
            need = sum(chunk_bytes[c] for c in needed)
            if peak_mom.phase is Phase.BACKWARD and ChunkList.GRAD in problem.lists:
                trainable_tensors = {x.tensor for x in layout.tensors if x.trainable}
                need += sum(chunk_bytes[c] for c in sorted({chunk_of_tensor[t] for t in peak_mom.tensors
                                                               if t in chunk_of_tensor and t in trainable_tensors}))
        stage_data.append(StageData(id=st.id, name=st.name, phase=st.phase, compute_seconds=compute, non_model_bytes=peak,
                                    tail_non_model_bytes=tail,
                                    peak_compute_seconds=compute - suffix_compute[peak_at] + peak_mom.compute_seconds,
                                    peak_need_bytes=need))
    optimizer_stage = n_stages - 1
    for st in stages:
        if st.phase is Phase.OPTIMIZER:
            optimizer_stage = st.id
    os_item = 4 * sum(1 for lst in problem.lists if lst in (ChunkList.MASTER, ChunkList.M, ChunkList.V))
    pcie_copy = layout.chunk_elements * param_item  # one PARAM/GRAD chunk: the size PCIe copies are priced at
    ssd_copy = layout.chunk_elements * 4 if os_item else pcie_copy  # one chunk of an fp32 OS list
    # with several ranks a comm group's chunks (consecutive, one capacity: planner.layout) move and
    # step together (materialize's cache entries are comm groups): classes are sets of comm groups,
    # keyed by the union of their chunks' uses (a padding chunk has none)
    members: dict[int, list[int]] = {}
    for c in layout.chunks:
        members.setdefault(c.id // ws, []).append(c.id)
    keyed: dict[tuple, list[int]] = {}
    for cg in sorted(members):
        ids = members[cg]
        use = tuple(sorted(set().union(*(uses.get(c, ()) for c in ids))))
        key = (use, layout.chunks[ids[0]].elements, any(trainable_chunk[c] for c in ids), sum(trainable_chunk[c] for c in ids))
        keyed.setdefault(key, []).extend(ids)
    classes = []
    for gid, ((use, elements, trainable, n_trainable), chunk_ids) in enumerate(sorted(keyed.items(), key=lambda kv: kv[1][0])):
        backward = [s for s in use if stages[s].phase is Phase.BACKWARD]
        # from the latest first-use moment of the class's chunks in each use stage (the least work left)
        tails = tuple(min((suffix_compute[first_use[(c, s)]] for c in chunk_ids if (c, s) in first_use), default=0.0)
                      for s in use)
        held, finals = _bucket_profile(chunk_ids, ws, backward, uses, trainable_chunk) if ws > 1 and trainable else ((), ())
        classes.append(ChunkClass(
            id=gid, chunks=tuple(chunk_ids), param_bytes=elements * param_item, os_bytes=elements * os_item,
            elements=elements, trainable=trainable, use_stages=use,
            first_backward_stage=min(backward) if backward else -1,
            last_backward_stage=max(backward) if backward else -1, comm_group_size=ws,
            trainable_chunks=n_trainable, use_tail_seconds=tails,
            bucket_held_chunks=held, bucket_final_chunks=finals))
    blocks = []
    for b in problem.blocks:
        p = stage_of_moment[b.forward_moments[1]]
        c = stage_of_moment[b.backward_moments[0]]
        blocks.append(BlockData(id=b.id, activation_bytes=b.activation_bytes, input_bytes=min(b.input_bytes, b.activation_bytes),
                                recompute_seconds=b.recompute_seconds, forward_stage=p, backward_stage=c))
    # (costmodel.optimizer_step_price, with the executor's threads for an overlapped step or not)
    threads = cpu_adam_threads(hw, overlapped=optimizer_overlap)
    adam_alone, adam_with_copies = (optimizer_step_price(hw, Tier.HOST, 1, with_copies=w, threads=threads,
                                                         mixed_precision=problem.mixed_precision).seconds for w in (False, True))
    beside_copies = (cpu_adam_beside_copies(hw, threads=threads, mixed_precision=problem.mixed_precision)
                     if len(problem.blocks) <= BESIDE_COPIES_MAX_BLOCKS else 1.0)
    return PlacementInput(
        chunk_classes=tuple(classes), blocks=tuple(blocks), stages=tuple(stage_data),
        device_bytes=problem.device_bytes, host_bytes=problem.host_bytes, nvme_bytes=problem.nvme_bytes,
        # tide's executor copies through pinned buffers (the pinned rates); the SSDs behind the host-side
        # cap; CPU Adam at the chunk size with all cores, at its rate alone and slowed beside copies, or
        # above BESIDE_COPIES_MAX_BLOCKS blocks at its rate with copies (Note [CPU Adam beside copies, in
        # the model] in planner/placement_time.py; costmodel). The chunk
        # size is this model's input: PCIe priced at one PARAM chunk per copy, the SSDs at one chunk of
        # an OS list per read/write (what the simulator's copies of this layout move; the by-size tables
        # of the hardware file, none: the flat rates)
        h2d_bytes_per_s=channel_bytes_per_s(hw, Channel.H2D, nbytes=pcie_copy),
        d2h_bytes_per_s=channel_bytes_per_s(hw, Channel.D2H, nbytes=pcie_copy),
        nvme_read_bytes_per_s=channel_bytes_per_s(hw, Channel.NVME_READ, nbytes=ssd_copy),
        nvme_write_bytes_per_s=channel_bytes_per_s(hw, Channel.NVME_WRITE, nbytes=ssd_copy),
        cpu_adam_seconds_per_element=adam_alone if beside_copies < 1.0 else adam_with_copies,
        cpu_adam_beside_copies=beside_copies,
        duplex_bytes_per_s=(channel_bytes_per_s(hw, Channel.H2D, duplex=True, nbytes=pcie_copy)
                            + channel_bytes_per_s(hw, Channel.D2H, duplex=True, nbytes=pcie_copy)
                            if hw.links.duplex_h2d_gb_per_s > 0 and hw.links.duplex_d2h_gb_per_s > 0 else 0.0),
        dram_bytes_per_s=0.0 if math.isinf(dram_bytes_per_s(hw)) else dram_bytes_per_s(hw),
        adam_dram_bytes_per_element=hw.host.adam_dram_bytes_per_param,
        gpu_adam_seconds_per_element=optimizer_step_price(hw, Tier.DEVICE, 1).seconds,
        nvme_time_rows=nvme_time_rows(hw, nbytes=ssd_copy), pcie_time_rows=pcie_time_rows(hw, nbytes=pcie_copy),
        optimizer_overlap=optimizer_overlap, optimizer_stage=optimizer_stage,
        ranks=ws, ranks_per_node=problem.ranks_per_node if ws > 1 else 1,
        **_collective_rates(hw, ws),
    )


def _collective_rates(hw, p: int) -> dict[str, float]:
    """Per-rank INTER_GPU bytes per second of each stage of a hierarchical ring collective, from
    Hardware.collective_seconds' formula: a collective sending B = (p-1)/p * S per rank takes
    max((q-1)/q * S / intra, (N-1)/N * S / nic); as rates of B, intra * (p-1)/p * q/(q-1) and
    nic * (p-1)/p * N/(N-1)."""
    if p <= 1:
        return {}
    q, n = hw.cluster.ranks_per_node, hw.cluster.nodes
    out = {}
    if q > 1 and hw.intra_node_bytes_per_s > 0:
        out["collective_intra_bytes_per_s"] = hw.intra_node_bytes_per_s * (p - 1) / p * q / (q - 1)
    if n > 1 and hw.inter_node_bytes_per_s > 0:
        out["collective_inter_bytes_per_s"] = hw.inter_node_bytes_per_s * (p - 1) / p * n / (n - 1)
    return out


def chunk_class_summary(data: PlacementInput) -> str:
    return f"{len(data.chunk_classes)} chunk classes, {sum(len(g.chunks) for g in data.chunk_classes)} chunks, {len(data.stages)} stages, {len(data.blocks)} blocks"


__all__ = ["BlockData", "ChunkClass", "PlacementInput", "StageData", "chunk_class_summary", "placement_input"]
