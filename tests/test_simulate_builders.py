"""Small hand-built schedules for the simulator's tests (no test functions here).

`tiny_schedule` makes a 2-block model, one tensor and one chunk per block (chunk c = block c),
fp32 with SGD-like lists (PARAM, GRAD) unless `lists` says otherwise, and the moments

    0 pre_forward h.0   (chunk 0, 1 s)     4 pre_backward h.1  (chunk 1, 2 s)
    1 post_forward h.0                     5 post_backward h.1
    2 pre_forward h.1   (chunk 1, 1 s)     6 pre_backward h.0  (chunk 0, 2 s)
    3 post_forward h.1                     7 post_backward h.0
                                           8 optimizer_step

on a machine with 1 GB/s links, 1 GB/s NVMe reads, 0.5 GB/s NVMe writes (one SSD), so a chunk
of CHUNK_BYTES takes 1 s on H2D/D2H. Tests pass actions as compact tuples.
"""

from __future__ import annotations

from schemas.hardware import ClusterSpec, DeviceKind, DeviceSpec, Hardware, HostSpec, LinkSpec, NvmeSpec
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
from schemas.trace import DType, MomentKind, Phase

ELEMENTS = 250_000_000  # fp32: 1e9 bytes
CHUNK_BYTES = ELEMENTS * 4
DIGEST = "sha256:" + "0" * 64
D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
P, G, M, V = ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V


def tiny_hardware(*, nvme_count: int = 1) -> Hardware:
    return Hardware(
        name="tiny", description="test machine",
        device=DeviceSpec(kind=DeviceKind.CPU_EMULATED, name="emu", memory_gb=100.0, usable_fraction=1.0,
                          compute_tflops=1.0, optimizer_params_per_s=ELEMENTS * 10.0),
        host=HostSpec(memory_gb=1000.0, usable_fraction=1.0, optimizer_params_per_s=ELEMENTS / 2.0, cores=2),
        nvme=NvmeSpec(count=nvme_count, capacity_gb_each=1000.0 if nvme_count else 0.0,
                      read_gb_per_s_each=1.0 if nvme_count else 0.0, write_gb_per_s_each=0.5 if nvme_count else 0.0,
                      usable_fraction=1.0),
        links=LinkSpec(h2d_gb_per_s=1.0, d2h_gb_per_s=1.0, inter_gpu_gb_per_s=0.0),
        cluster=ClusterSpec(world_size=1, gpus_per_node=1),
    )


def tiny_moments() -> tuple[MomentRef, ...]:
    rows = [
        (Phase.FORWARD, MomentKind.PRE_FORWARD, "h.0", 0, (0,), 1.0),
        (Phase.FORWARD, MomentKind.POST_FORWARD, "h.0", 0, (), 0.0),
        (Phase.FORWARD, MomentKind.PRE_FORWARD, "h.1", 1, (1,), 1.0),
        (Phase.FORWARD, MomentKind.POST_FORWARD, "h.1", 1, (), 0.0),
        (Phase.BACKWARD, MomentKind.PRE_BACKWARD, "h.1", 1, (1,), 2.0),
        (Phase.BACKWARD, MomentKind.POST_BACKWARD, "h.1", 1, (), 0.0),
        (Phase.BACKWARD, MomentKind.PRE_BACKWARD, "h.0", 0, (0,), 2.0),
        (Phase.BACKWARD, MomentKind.POST_BACKWARD, "h.0", 0, (), 0.0),
        (Phase.OPTIMIZER, MomentKind.OPTIMIZER_STEP, "", -1, (), 0.0),
    ]
    return tuple(MomentRef(id=i, phase=ph, kind=k, module=mod, block=b, tensors=t, compute_seconds=s,
                           flops=int(s * 1e12), non_model_bytes=10_000)
                 for i, (ph, k, mod, b, t, s) in enumerate(rows))


Spec = tuple  # (moment, op, list|block, chunk, src, dst[, channel])


def action(spec: Spec) -> Action:
    """(moment, op, list, chunk, src, dst) for chunk ops; (moment, op, block, src|dst) for activations."""
    m, op = spec[0], spec[1]
    if op in (Op.ACT_OFFLOAD, Op.ACT_RELOAD):
        block, tier = spec[2], spec[3]
        path = {(Op.ACT_OFFLOAD, H): Channel.D2H, (Op.ACT_RELOAD, H): Channel.H2D,
                (Op.ACT_OFFLOAD, N): Channel.NVME_WRITE, (Op.ACT_RELOAD, N): Channel.NVME_READ}
        kw = {"src": tier} if op is Op.ACT_RELOAD else {"dst": tier}
        return Action(moment=m, op=op, block=block, channel=path[(op, tier)], **kw)
    lst, chunk, src, dst = spec[2], spec[3], spec[4], spec[5]
    channel = spec[6] if len(spec) > 6 else None
    if op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK) and channel is None:
        channel = {(H, D): Channel.H2D, (D, H): Channel.D2H, (N, H): Channel.NVME_READ, (H, N): Channel.NVME_WRITE,
                   (N, D): Channel.NVME_READ, (D, N): Channel.D2H}[(src, dst)]
    if op is Op.OPTIMIZER_STEP:
        return Action(moment=m, op=op, chunk=chunk, dst=dst, channel=Channel.COMPUTE if dst is D else Channel.CPU_OPTIMIZER)
    return Action(moment=m, op=op, list=lst, chunk=chunk, src=src, dst=dst, channel=channel,
                  bytes=CHUNK_BYTES if op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK) else 0)


def tiny_schedule(specs: list[Spec], residency: dict[tuple[ChunkList, int], tuple[Tier, ...]], *,
                  lists: tuple[ChunkList, ...] = (P, G), budgets: Budgets | None = None,
                  modes: tuple[ActivationMode, ActivationMode] = (ActivationMode.KEEP, ActivationMode.KEEP),
                  activation_bytes: int = 1000, moments: tuple[MomentRef, ...] | None = None) -> Schedule:
    chunks = tuple(Chunk(id=c, elements=ELEMENTS, used_elements=ELEMENTS, block=c, comm_group=c, owner_rank=0)
                   for c in range(2))
    tensors = tuple(TensorSlot(tensor=c, names=(f"h.{c}.weight",), shape=(ELEMENTS,), chunk=c, offset_elements=0,
                               numel=ELEMENTS, trainable=True) for c in range(2))
    layout = ChunkLayout(chunk_elements=ELEMENTS, lists=lists, list_dtypes={lst: DType.FLOAT32 for lst in lists},
                         chunks=chunks, tensors=tensors)
    moments = moments or tiny_moments()
    stages = tuple(Stage(id=i, name=f"s{i}", phase=m.phase, block=m.block, first_moment=i, last_moment=i,
                         predicted_seconds=0.0) for i, m in enumerate(moments))
    acts = tuple(ActivationPlan(block=b, module=f"h.{b}", mode=modes[b], bytes=activation_bytes,
                                input_bytes=activation_bytes // 10, recompute_seconds=0.5,
                                recompute_flops=int(0.5e12)) for b in range(2))
    actions = tuple(sorted((action(s) for s in specs), key=lambda a: a.moment))
    header = ScheduleHeader(planner_version="test", policy="test", model_name="tiny", trace_digest=DIGEST,
                            hardware_name="tiny", hardware_digest=DIGEST, world_size=1,
                            solver_status=SolverStatus.HEURISTIC, objective_seconds=0.0, lower_bound_seconds=0.0,
                            gap=0.0, notes=())
    return Schedule(
        header=header,
        budgets=budgets or Budgets(device_bytes=10 * CHUNK_BYTES, host_bytes=10 * CHUNK_BYTES, nvme_bytes=10 * CHUNK_BYTES),
        layout=layout,
        chunk_plans=tuple(ChunkPlan(chunk=c, os_tier=D, optimizer_tier=D) for c in range(2)),
        activation_plans=acts,
        moments=moments,
        stages=stages,
        initial_residency=tuple(Residency(list=lst, chunk=c, tiers=tiers) for (lst, c), tiers in residency.items()),
        actions=actions,
        prediction=Prediction(iteration_seconds=0.0, flops=0, bytes_per_channel={}, busy_seconds_per_channel={},
                              peak_bytes_per_tier={}),
    )


def resident_specs() -> list[Spec]:
    """Everything on DEVICE: grads allocated at first backward use, stepped on DEVICE, freed after."""
    return [
        (4, Op.ALLOCATE, G, 1, None, D),
        (6, Op.ALLOCATE, G, 0, None, D),
        (8, Op.OPTIMIZER_STEP, None, 0, None, D),
        (8, Op.OPTIMIZER_STEP, None, 1, None, D),
        (8, Op.EVICT, G, 0, D, None),
        (8, Op.EVICT, G, 1, D, None),
    ]


def host_step_prefix() -> list[Spec]:
    """Chunk 0's PARAM lives on HOST (fetched for forward and backward); its grads go back to HOST at
    moment 7 for a CPU step there, chunk 1 stays on DEVICE (the specs up to the steps)."""
    return [
        (0, Op.FETCH, P, 0, H, D),
        (1, Op.EVICT, P, 0, D, None),
        (4, Op.ALLOCATE, G, 1, None, D),
        (6, Op.FETCH, P, 0, H, D),
        (6, Op.ALLOCATE, G, 0, None, D),
        (7, Op.WRITE_BACK, G, 0, D, H),
        (7, Op.EVICT, G, 0, D, None),
        (7, Op.EVICT, P, 0, D, None),
    ]


RESIDENT = {(P, 0): (D,), (P, 1): (D,)}
