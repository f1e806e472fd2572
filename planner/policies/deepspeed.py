"""DeepSpeed: ZeRO-2 + offload_optimizer (ZeRO-Offload), ZeRO-3 + offload_param/optimizer "cpu"
(ZeRO-3 Offload) and ZeRO-3 offloaded to "nvme" (ZeRO-Infinity); docs/baselines.md §1-3.

Config defaults quoted from DeepSpeed `38327e07`: `deepspeed/runtime/zero/config.py`,
`offload_config.py`. Pageable copies (Z3.12, pin_memory false) and the serial fetch/compute dataflow
Fuyou measured (ZI.7) are the simulator's: a copy through pageable memory runs at the preset's pageable
rate and holds its moment's work (`Decisions.host_staging`, `planner.sim_actions.blocks_host`).
Not modelled (each listed in docs/baselines.md): per-sub-module gathers (a chunk of the layout is the
unit that moves), the reuse distance (Z3.4), the fp32 grads swapped to the SSDs in backward (ZI.4).
"""

from __future__ import annotations

from planner.errors import PlannerError
from planner.materialize import Decisions, EvictionRule, Reservation
from planner.policies._common import (
    budget,
    chunk_plans,
    everything,
    has_nvme,
    policy_layout,
)
from planner.policies.patrickstar import patrickstar_layout
from planner.problem import Problem
from schemas.schedule import ActivationMode, ChunkList, HostStaging, Tier
from schemas.trace import Phase

PREFETCH_BUCKET_ELEMENTS = 50_000_000  # stage3_prefetch_bucket_size default 5e7 (config.py:208; Z3.2)
MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters default 1e9 (config.py:231; Z3.3)
PARAM_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold default 1e5 (config.py:214; Z3.5)
SUB_GROUP_ELEMENTS = 1_000_000_000  # sub_group_size default 1e9 (config.py:168; Z3.7)
NVME_PARAM_BUFFER_COUNT = 5  # offload_param.buffer_count default (offload_config.py:33; ZI.1)
NVME_PARAM_BUFFER_ELEMENTS = 100_000_000  # offload_param.buffer_size default 1e8 (offload_config.py:36; ZI.1)
FP32_GRAD_BYTES = 4  # the CPU fp32 grad partition, bytes per param (stage_1_and_2.py / stage3.py; Z2.4, Z3.10)
# reduce_bucket_size default 5e8 elements (config.py:109; v0.4.3 constants.py:67): the contiguous-gradient
# ("ipg") buffers on the GPU are allocated at this size whatever the model (Z2.3, Z3.10)
REDUCE_BUCKET_ELEMENTS = 500_000_000
# DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json at bdf8e59a (2021-04-18,
# the config PatrickStar §9.1 names in its footnote 3): reduce_bucket_size and stage3_prefetch_bucket_size 1e7
EXAMPLE_BUCKET_ELEMENTS = 10_000_000


def _grad_partition(problem: Problem) -> Reservation:
    """The fp32 grad partition on the CPU (Z2.4, Z3.10): 4 B/param. The schedule already holds the
    fp16 GRAD chunks on HOST from their backward to the CPU step, so 4 - 2 B/param are reserved;
    the node holds its ranks' partitions."""
    grad_item = problem.list_itemsize(ChunkList.GRAD)
    share = problem.ranks_per_node / problem.world_size
    nbytes = int((FP32_GRAD_BYTES - grad_item) * problem.trace.param_count * share)
    return Reservation(tier=Tier.HOST, bytes=max(0, nbytes),
                       what="fp32 grad partition on the CPU beyond the fp16 GRAD chunks (Z2.4/Z3.10: 4 B/param)")


def _largest_param(problem: Problem) -> int:
    return max((t.numel for t in problem.trace.tensors if t.trainable), default=0)


def _zero2_device_buffers(problem: Problem, layout) -> tuple[Reservation, ...]:
    """ZeRO-2's own GPU buffers (ZeRO-Offload's tutorial config: contiguous_gradients and overlap_comm
    true): two contiguous-gradient buffers of reduce_bucket_size elements ("double buffers to avoid data
    access conflict when overlap_comm is enabled", `stage_1_and_2.py` `backward`) and, with the optimizer
    on the CPU, `temp_grad_buffer_for_gpu_offload` of the largest param (`stage_1_and_2.py` `__init__`).
    A param's grad is copied into the bucket as it is produced, so the GRAD chunks the schedule holds on
    DEVICE for one backward moment are inside the buckets: that much less is reserved. Counted all iteration (the
    buckets live from backward to the step; forward's budget is the tighter for it)."""
    item = problem.list_itemsize(ChunkList.GRAD)
    buckets = max(0, 2 * REDUCE_BUCKET_ELEMENTS * item - _moment_grad_bytes(problem, layout))
    return (Reservation(tier=Tier.DEVICE, bytes=buckets,
                        what="two ipg grad buckets of reduce_bucket_size 5e8 less the GRAD chunk they hold (Z2.3: "
                             "stage_1_and_2.py backward, contiguous_gradients + overlap_comm)"),
            Reservation(tier=Tier.DEVICE, bytes=_largest_param(problem) * item,
                        what="temp_grad_buffer_for_gpu_offload of the largest param (stage_1_and_2.py __init__, cpu_offload)"))


def _moment_grad_bytes(problem: Problem, layout) -> int:
    """The most GRAD bytes (whole comm groups) one backward moment writes on DEVICE."""
    ws = problem.world_size
    chunk_of = {t.tensor: t.chunk for t in layout.tensors if t.trainable}
    group_bytes = ws * layout.chunk_elements * problem.list_itemsize(ChunkList.GRAD)
    return max((group_bytes * len({chunk_of[t] // ws for t in m.tensors if t in chunk_of})
                for m in problem.moments if m.phase is Phase.BACKWARD), default=0)


def _zero3_device_buffers(problem: Problem, layout) -> tuple[Reservation, ...]:
    """ZeRO-3's contiguous-gradient buffer on the GPU: one of reduce_bucket_size elements
    (`stage3.py` `__init__`: `__ipg_bucket_flat_buffer`, contiguous_gradients default true, config.py:98),
    less the GRAD comm group the schedule holds in it."""
    item = problem.list_itemsize(ChunkList.GRAD)
    held = _moment_grad_bytes(problem, layout)
    return (Reservation(tier=Tier.DEVICE, bytes=max(0, REDUCE_BUCKET_ELEMENTS * item - held),
                        what="ipg grad bucket of reduce_bucket_size 5e8 less the GRAD comm groups it holds "
                             "(stage3.py __ipg_bucket_flat_buffer)"),)


def _zero3_host_grads(problem: Problem) -> Reservation:
    """ZeRO-3 with offload_optimizer cpu keeps on the CPU, all iteration, an fp16 grad partition
    (`stage3.py` `__init__`: `grad_partitions_flat_buffer`, gradient_accumulation_dtype = fp16 here) and an
    fp32 grad buffer per sub-group (`initialize_optimizer_states`: `subgroup_gradient_buffer`): 2 + 4
    B/param. The schedule already holds the fp16 GRAD chunks on HOST from their backward to the step
    (2 B/param), so the other 4 are reserved; the node holds its ranks' partitions."""
    share = problem.ranks_per_node / problem.world_size
    # the fp16 partition has the GRAD list's dtype, so what is beyond the GRAD chunks is the fp32 buffer
    nbytes = int(FP32_GRAD_BYTES * problem.trace.param_count * share)
    return Reservation(tier=Tier.HOST, bytes=nbytes,
                       what="fp32 grads and the fp16 grad partition on the CPU beyond the GRAD chunks (Z3.10: stage3.py "
                            "grad_partitions_flat_buffer + subgroup_gradient_buffer, 6 B/param)")


def _modes(problem: Problem) -> tuple[ActivationMode, ...]:
    # activation checkpoint per transformer block (Megatron --checkpoint-activations; Z2.8; Fuyou §5.1)
    return (ActivationMode.RECOMPUTE,) * len(problem.blocks)


def zero2_offload(problem: Problem, *, cpu_checkpointing: bool = False, delayed_update: bool = False) -> tuple[Decisions, ...]:
    """ZeRO-2 + offload_optimizer cpu (Ren et al. 2021): fp16 params on the GPU all iteration (Z2.1),
    fp32 master + Adam m, v on the CPU stepped by DeepSpeedCPUAdam (Z2.2) after the whole backward
    (global norm and overflow check first, Z2.5), grads leave the GPU during backward (Z2.3), the
    updated fp16 copy goes H2D after the step (Z2.6). Checkpoints stay on the GPU unless
    `cpu_checkpointing` (Megatron-DeepSpeed default false, Z2.8). `delayed_update`: the paper's
    one-step delayed parameter update (DPU, Ren et al. §5; not in open-source DeepSpeed, Z2.7),
    modelled as CPU steps overlapping backward (a one-iteration replay cannot move them into the next
    iteration's forward).

    Several ranks: fp16 params replicated, grads reduce-scattered as they are final, each rank's
    OS partition on the shared CPU, updated partitions copied up and all-gathered."""
    layout = policy_layout(problem)
    plans = chunk_plans(layout, Tier.HOST, Tier.HOST)
    modes = _modes(problem)
    ckpt = Tier.HOST if cpu_checkpointing else None
    reserved = (_grad_partition(problem), *_zero2_device_buffers(problem, layout))
    notes = ("zero2-offload (the system's): fp16 params persistent on DEVICE, OS on HOST, grads to HOST during "
             "backward, CPU Adam " + ("overlapped (DPU option)" if delayed_update else "after backward")
             + f", checkpoints per block on {'HOST' if ckpt else 'DEVICE'}; reserved: "
             + ", ".join(r.what.split(" (")[0] for r in reserved),)
    return (Decisions(policy="zero2-offload", layout=layout, chunk_plans=plans, activation_modes=modes,
                      param_device_budget_bytes=budget(problem, layout, plans, modes, ckpt, reserved=reserved),
                      persistent_chunks=everything(layout), optimizer_overlap=delayed_update, prefetch=False,
                      eviction=EvictionRule.FARTHEST_NEXT_USE, checkpoint_tier=ckpt, reserved_bytes=reserved,
                      host_staging=HostStaging.PAGEABLE,  # offload_optimizer pin_memory default false (offload_config.py:72; Z3.12)
                      notes=notes),)


def _persistent_small(layout) -> frozenset[int]:
    """Chunks holding only params below stage3_param_persistence_threshold (biases, LayerNorms; Z3.5)
    stay on the GPU all iteration."""
    big = {t.chunk for t in layout.tensors if t.numel >= PARAM_PERSISTENCE_THRESHOLD}
    return frozenset(c.id for c in layout.chunks if c.used_elements and c.id not in big)


def _zero3_layout(problem: Problem):
    # several ranks: every param is partitioned over the ranks and gathered per sub-module (Z3.1, Z3.13), so
    # the unit gathered at once is about one tensor: tide's one-rank chunks (a block's largest tensor)
    # grouped world_size at a time, the oversize embedding in a group of its own (`patrickstar_layout`'s
    # grouping), rather than a packing whose every chunk is sized by the embedding
    return patrickstar_layout(problem)


def _zero3(problem: Problem, name: str, home: Tier, layout, *, offload_ratio: float, cpu_checkpointing: bool,
           reserved: tuple[Reservation, ...], what: str, nvme_optimizer: bool = False) -> Decisions:
    ws = problem.world_size
    n_groups = -(-len(layout.chunks) // ws)
    # offload_optimizer.ratio (Z3.8): the first int(ratio x n) sub-groups on the CPU, the rest stepped on
    # the GPU by AdamW with their OS there; sub-groups in order, here comm groups of chunks in order
    on_cpu = int(offload_ratio * n_groups)
    plans = chunk_plans(layout, lambda c: home if c // ws < on_cpu else Tier.DEVICE,
                        lambda c: Tier.HOST if c // ws < on_cpu else Tier.DEVICE)
    modes = _modes(problem)
    ckpt = Tier.HOST if cpu_checkpointing else None  # ZI.6: on CPU memory, never on SSD
    item = problem.list_itemsize(ChunkList.PARAM)
    # at most stage3_max_live_parameters gathered (Z3.3), plus the GRADs being reduced. DeepSpeed fetches
    # per sub-module; the unit here is a chunk (or a comm group of them), so where one moment's chunks
    # (PARAM + GRAD) hold more than the cap, the cap is what that moment needs
    cap = max(MAX_LIVE_PARAMETERS * item * 2, _largest_moment_bytes(problem, layout))
    homes = (home,) * len(layout.chunks) if home is not Tier.HOST else ()
    ratio = f", offload_optimizer.ratio {offload_ratio}" if offload_ratio < 1 else ""
    return Decisions(
        policy=name, layout=layout, chunk_plans=plans, activation_modes=modes,
        param_device_budget_bytes=budget(problem, layout, plans, modes, ckpt, reserved=reserved, cap_bytes=cap),
        persistent_chunks=_persistent_small(layout), optimizer_overlap=False, prefetch=True,
        prefetch_bucket_bytes=PREFETCH_BUCKET_ELEMENTS * item, eviction=EvictionRule.FARTHEST_NEXT_USE,
        checkpoint_tier=ckpt, param_home_tiers=homes, reserved_bytes=reserved,
        host_staging=HostStaging.PAGEABLE,  # offload_param/optimizer pin_memory default false (offload_config.py:45,72; Z3.12)
        # a gathered param is freed after its sub-module's post-hook (Z3.1: `release_sub_module`), also with
        # one rank: with offload_param the partition's home is the CPU (or the SSDs) and the GPU copy goes;
        # only a reuse within stage3_max_reuse_distance would keep it (Z3.4, not modelled)
        release_between_phases=True,
        # ZI.4: NVMe sub-groups stepped one at a time (pipeline_read/pipeline_write false), their fp32 grads
        # swapped to the SSDs in backward and read back with the OS (stage3.py partition_grads ->
        # swap_out_gradients; _optimizer_states_and_gradient_swap_in)
        serial_optimizer_swap=nvme_optimizer, grad_swap_bytes_per_element=FP32_GRAD_BYTES if nvme_optimizer else 0,
        # Z3.10: stage3.py `partition_grads` (v0.9.3, the release Fuyou §5.1 ran, as at 38327e07) copies each
        # fp16 grad partition into the CPU grad buffer (`grad_buffer.copy_`), brings it back
        # (`grad_buffer.to(grad_partition.device)`: "ensure grad buffer is a CUDA buffer to speed up the next few
        # operations"), then sends it again: for NVMe sub-groups `grad_buffer.float()` (converted on the GPU)
        # to the swapper, 4 B/param; else `fp32_grad_tensor.copy_(grad_buffer)`, a blocking copy that
        # converts on the CPU (PyTorch `copy_` across devices), 2 B/param. So 2 + 2 + 4 (or 2) B/param
        # cross PCIe instead of 2
        grad_recopy_bytes_per_element=(FP32_GRAD_BYTES if nvme_optimizer else problem.list_itemsize(ChunkList.GRAD))
        if offload_ratio > 0 else 0,
        notes=(f"{name} (the system's): {what}, fetched per use with the default prefetch bucket (5e7 elements) "
               f"under stage3_max_live_parameters, released after use; CPU Adam after backward{ratio}; "
               f"checkpoints per block on {'HOST' if ckpt else 'DEVICE'}; "
               + ", ".join(r.what.split(" (")[0] for r in reserved) + " reserved",))


def _largest_moment_bytes(problem: Problem, layout) -> int:
    """PARAM + GRAD bytes of the comm groups one moment uses, the most over the moments."""
    ws = problem.world_size
    chunk_of = {t.tensor: t.chunk for t in layout.tensors}
    group_bytes: dict[int, int] = {}
    for c in layout.chunks:
        group_bytes[c.id // ws] = group_bytes.get(c.id // ws, 0) + c.elements * problem.list_itemsize(ChunkList.PARAM)
    return max((2 * sum(group_bytes[g] for g in {chunk_of[t] // ws for t in m.tensors if t in chunk_of})
                for m in problem.moments), default=0)


def zero3_offload(problem: Problem, *, offload_ratio: float = 1.0, cpu_checkpointing: bool = True,
                  delayed_update: bool = False, gpu_params: bool = False) -> tuple[Decisions, ...]:
    """ZeRO-3 + offload_param and offload_optimizer "cpu" (docs/baselines.md §2): fp16 params on the
    CPU, gathered to the GPU per use and released after (Z3.1), prefetching the next uses up to the
    bucket (Z3.2) under the live-parameter cap (Z3.3), small params persistent (Z3.5), OS on the CPU
    except the (1 - ratio) share stepped on the GPU (Z3.8), optimizer after backward (Z3.9), the
    CPU grad buffers (Z3.10). Checkpoints offloaded to CPU memory, as Fuyou ran its
    "ZeRO-Offload" (Fuyou §5.1: "offload checkpoints to CPU memory"); DeepSpeed's own default keeps
    them on the GPU (`cpu_checkpointing=False`). `delayed_update`: not in DeepSpeed (Z3.11), refused.

    `gpu_params`: no `offload_param` section (only the optimizer offloaded), as PatrickStar §9.1 ran
    DeepSpeed v0.4.3 (`_zero3_v043_gpu_params`)."""
    if delayed_update:
        raise PlannerError("zero3-offload: the one-step delayed update exists for ZeRO-2 only (Ren et al. §5; "
                           "DeepSpeed stage3.py has none, docs/baselines.md Z3.11); use zero2-offload")
    if gpu_params:
        return (_zero3_v043_gpu_params(problem, cpu_checkpointing=cpu_checkpointing),)
    layout = _zero3_layout(problem)
    return (_zero3(problem, "zero3-offload", Tier.HOST, layout, offload_ratio=offload_ratio,
                   cpu_checkpointing=cpu_checkpointing,
                   reserved=(_zero3_host_grads(problem), *_zero3_device_buffers(problem, layout)),
                   what="fp16 params and OS on HOST"),)


def _moment_param_elements(problem: Problem) -> int:
    """The most param elements one moment's work uses (the sub-modules gathered for it)."""
    tensors = problem.trace.tensors
    return max((sum(tensors[t].numel for t in m.tensors if t < len(tensors) and tensors[t].trainable)
                for m in problem.moments), default=0)


def _zero3_v043_gpu_params(problem: Problem, *, cpu_checkpointing: bool) -> Decisions:
    """DeepSpeed v0.4.3 ZeRO-3 with offload_optimizer cpu and no offload_param, the config of
    DeepSpeedExamples `Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json` at bdf8e59a (the
    example PatrickStar §9.1 ran, "zero3 stage, ZeRO-Offload/Infinity", with --checkpoint-in-cpu from
    `ds_pretrain_gpt2-zero3.sh`). PatrickStar §9.2.1: DeepSpeed "can train the model for which overall
    param fp16 and peak non-model data must be in GPU". On one GPU (v0.4.3 `stage3.py`):
    - the fp16 partitions (the whole model) stay on the GPU (`fp16_partitioned_groups_flat`);
    - a gathered param is a second full copy beside its partition, even with one rank
      (`partition_parameters.py` `_allgather_param`: `flat_tensor = torch.zeros(aligned_param_size)`),
      live from the sub-module's fetch to its release: the largest moment's params plus the prefetch
      bucket (1e7 in the example), at most stage3_max_live_parameters (1e9);
    - `temp_grad_buffer_for_gpu_offload` and `temp_grad_gpu_buffer`, each of the largest param
      (`stage3.py` `__init__`, offload_optimizer);
    - two contiguous-gradient buffers of reduce_bucket_size (1e7 in the example; `stage3.py` `backward`,
      overlap_comm default true for stage 3, v0.4.3 constants.py:60);
    - OS and CPU Adam on the CPU after backward, the fp32 grads on the CPU (4 B/param)."""
    if problem.world_size > 1:
        raise PlannerError("zero3-offload[gpu_params] models one rank (PatrickStar Table 3's 1-GPU DeepSpeed row); "
                           "with several ranks use zero3-offload or zero-infinity")
    layout = policy_layout(problem)
    plans = chunk_plans(layout, Tier.HOST, Tier.HOST)
    modes = _modes(problem)
    ckpt = Tier.HOST if cpu_checkpointing else None
    item = problem.list_itemsize(ChunkList.PARAM)
    gathered = min(MAX_LIVE_PARAMETERS, _moment_param_elements(problem) + EXAMPLE_BUCKET_ELEMENTS)
    reserved = (
        _grad_partition(problem),
        Reservation(tier=Tier.DEVICE, bytes=gathered * item,
                    what="gathered copies beside the fp16 partitions (partition_parameters.py _allgather_param, one rank: "
                         "the largest moment's params + the 1e7 prefetch bucket)"),
        Reservation(tier=Tier.DEVICE, bytes=2 * _largest_param(problem) * item,
                    what="temp_grad_buffer_for_gpu_offload + temp_grad_gpu_buffer (v0.4.3 stage3.py __init__)"),
        Reservation(tier=Tier.DEVICE, bytes=2 * EXAMPLE_BUCKET_ELEMENTS * item,
                    what="two ipg grad buckets of the example's reduce_bucket_size 1e7 (v0.4.3 stage3.py backward)"),
    )
    return Decisions(
        policy="zero3-offload", layout=layout, chunk_plans=plans, activation_modes=modes,
        param_device_budget_bytes=budget(problem, layout, plans, modes, ckpt, reserved=reserved),
        persistent_chunks=everything(layout), optimizer_overlap=False, prefetch=False,
        eviction=EvictionRule.FARTHEST_NEXT_USE, checkpoint_tier=ckpt, reserved_bytes=reserved,
        host_staging=HostStaging.PAGEABLE,  # v0.4.3 cpu_offload_use_pin_memory default false (constants.py:85)
        notes=("zero3-offload (the system's): DeepSpeed v0.4.3 as PatrickStar ran it (no offload_param): fp16 params "
               "on DEVICE all iteration, OS on HOST, CPU Adam after backward, checkpoints per block on "
               f"{'HOST' if ckpt else 'DEVICE'}; reserved: " + ", ".join(r.what.split(" (")[0] for r in reserved),))


def zero_infinity(problem: Problem, *, offload_ratio: float = 1.0) -> tuple[Decisions, ...]:
    """ZeRO-3 with offload_param and offload_optimizer "nvme" (docs/baselines.md §3): as ZeRO-3
    Offload with params and OS on the SSDs (HOST without SSDs), swapped through a pinned pool of
    buffer_count x buffer_size fp16 elements (ZI.1: 5 x 1e8 = 1 GB), the optimizer's NVMe reads and
    writes not overlapped (pipeline_read/write false, ZI.4: materialize's DEVICE-less HOST step
    writes each chunk back before the next), checkpoints on CPU memory (ZI.6)."""
    home = Tier.NVME if has_nvme(problem) else Tier.HOST
    # HOST: the fp16 GRAD chunks + 2 B/param, as before issue 16's third pass (docs/baselines.md ZI.4: the
    # real code keeps the fp16 grad partition on the CPU and swaps the fp32 grads to the SSDs through
    # buffer_count x sub-group pinned buffers; what else bounds its CPU memory at Fuyou Fig. 4's 135B
    # is not found, so the 4 B/param that reproduce it stay)
    layout = _zero3_layout(problem)
    share = problem.ranks_per_node / problem.world_size
    host_grads = Reservation(tier=Tier.HOST, bytes=int(FP32_GRAD_BYTES * problem.trace.param_count * share),
                             what="fp16 grad partition on the CPU + 2 B/param (the GRAD chunks go to the SSDs; ZI.4)")
    reserved = [host_grads if home is Tier.NVME else _grad_partition(problem), *_zero3_device_buffers(problem, layout)]
    if home is Tier.NVME:
        pool = NVME_PARAM_BUFFER_COUNT * NVME_PARAM_BUFFER_ELEMENTS * problem.list_itemsize(ChunkList.PARAM)
        reserved.append(Reservation(tier=Tier.HOST, bytes=pool * problem.ranks_per_node,
                                    what="pinned NVMe param swap pool (ZI.1: 5 x 1e8 fp16 elements per rank)"))
    return (_zero3(problem, "zero-infinity", home, layout, offload_ratio=offload_ratio, cpu_checkpointing=True,
                   reserved=tuple(reserved), what=f"fp16 params and OS on {home.value}",
                   nvme_optimizer=home is Tier.NVME),)
