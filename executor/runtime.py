"""`executor.run(model, schedule)`: replay a schedule inside an ordinary PyTorch training loop.

    engine = executor.run(model, "schedule.msgpack", lr=3e-4, weight_decay=0.1)
    for batch in batches:
        loss = model(**batch)
        loss.backward()            # fp16: engine.backward(loss), which scales the loss first
        engine.step()              # the OPTIMIZER moment(s); also what engine.optimizer.step() runs
        engine.zero_grad()         # grads live in GRAD chunks that die at the step: nothing to clear

Attach (`Engine.__init__`): the model's params (names incl. tied names, shapes, dtypes) are compared
with `schedule.layout`; on any difference ALL of them are listed and nothing is touched. Then the
chunk store is built per `initial_residency`, the params are copied into their chunks, and every
`param.data` points into its PARAM chunk (executor/binding.py); the original storage is freed.

Replay: `MomentHooks` (executor/hooks.py) report every moment; the engine checks the event against
`schedule.moments[m]` (phase, kind, module) and raises `ExecutorError` BEFORE changing any state when
they differ, then applies the actions of moment m in list order (ACTION SEMANTICS in
schemas/schedule.py) and waits for the PARAM chunks moment m's work touches. The engine never decides.

Between iterations a forward under `torch.no_grad()` or with `model.eval()` is an evaluation, not a
replay (EVALUATING, executor/evaluation.py); `model.state_dict()` reads the chunks (Note [state_dict
while attached] in executor/binding.py); a larger batch than recorded is refused (Note [batch drift]
in executor/drift.py).

The engine dispatches; its parts live beside it: the param/grad/saved-tensor binding to the chunks
in executor/binding.py, optimizer steps, clipping and loss scaling in executor/stepping.py, the
state machine and failures in executor/lifecycle.py, the moment and batch drift checks in
executor/drift.py, the chunk store in executor/store.py, activations in executor/activations.py.
The notes below (Note [activations], [NVME tier], [several ranks], [gradient accumulation]) sit
next to the code they explain.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from executor import state as state_io
from executor.activations import ActivationManager
from executor.attach import RERECORD, activations_use_nvme, check_attach, check_model, resolve_device, uses_nvme
from executor.binding import ChunkRef, ParamBinding
from executor.distributed import StoreCollectives, all_gather_params, load_sharded, save_sharded
from executor.drift import DriftChecks
from executor.dtypes import TORCH_DTYPES
from executor.errors import ExecutorError
from executor.evaluation import Evaluation
from executor.hooks import MomentEvent, MomentHooks, find_blocks, find_units
from executor.lifecycle import EngineFailure, EngineState, Lifecycle
from executor.nvme import NvmeStore, nvme_lists
from executor.optim import ChunkAdam, ChunkAdamW, DynamicLossScaler
from executor.stats import EngineStats, IterationCounters
from executor.stepping import OptimizerSteps, default_param_groups
from executor.store import ChunkStore, out_of_memory
from schemas.schedule import COPY_CHANNEL, OS_LISTS, Channel, ChunkList, Op, Schedule, Tier
from schemas.trace import DTYPE_BYTES, DType, MomentKind, Phase


class Engine(Lifecycle, DriftChecks, ParamBinding, OptimizerSteps, Evaluation):
    """Replays one schedule on one model; see the module docstring and its notes. Build it with `executor.run`."""

    def __init__(self, model: nn.Module, schedule: Schedule, *, params: Iterable[Any] | None = None,
                 optimizer: str = "adamw", lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, grad_clip_norm: float | None = None,
                 precision: str | None = None, grad_accumulation_steps: int = 1, nvme_dir: str | Path | None = None,
                 device: str | torch.device = "auto", stale_optimizer: bool = False,
                 optimizer_threads: int | None = None) -> None:
        self.schedule = schedule
        self.model = model
        layout = schedule.layout
        compute = layout.list_dtypes[ChunkList.PARAM]
        # ---- arguments, the schedule's own demands and the model, all checked before anything is touched
        check_attach(model, schedule, precision=precision, optimizer=optimizer, grad_clip_norm=grad_clip_norm,
                     grad_accumulation_steps=grad_accumulation_steps, nvme_dir=nvme_dir)
        self.device = resolve_device(device)
        # before any param is re-pointed: find_blocks weighs modules by their params' sizes
        self._blocks = find_blocks(model)
        self._units = find_units(model, self._blocks)
        self.compute_dtype = TORCH_DTYPES[compute]
        self.grad_clip_norm = grad_clip_norm
        self.accumulation_steps = grad_accumulation_steps
        self.scaler = DynamicLossScaler() if compute is DType.FLOAT16 else None
        self._has_master = ChunkList.MASTER in layout.lists

        # ---- the optimizer holds the model's Parameters (LR schedulers work on it)
        if params is None:
            params = default_param_groups(model, weight_decay=weight_decay)
        cls = ChunkAdamW if optimizer == "adamw" else ChunkAdam
        self.optimizer = cls(params, layout, model=model, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.optimizer.set_step_driver(self._step_now)
        self._setup_cpu_steps(schedule, stale=stale_optimizer, threads=optimizer_threads)

        # ---- the layout, per chunk and per moment
        by_name = dict(model.named_parameters(remove_duplicate=False))
        self._bind_layout(model, by_name)
        self._actions: list[list[tuple[int, Any]]] = [[] for _ in schedule.moments]
        for i, a in enumerate(schedule.actions):
            self._actions[a.moment].append((i, a))
        # PARAM chunks the work of each forward/backward moment computes with; the OPTIMIZER moment's
        # needs are its OPTIMIZER_STEP actions' (on the tier each names)
        self._needs = [sorted({self._slots[t].chunk for t in m.tensors}) if m.phase is not Phase.OPTIMIZER else []
                       for m in schedule.moments]
        self._optimizer_moments = [m.id for m in schedule.moments if m.phase is Phase.OPTIMIZER]
        if not self._optimizer_moments or self._optimizer_moments[-1] != len(schedule.moments) - 1:
            raise ExecutorError("invalid schedule: its last moment must be the OPTIMIZER moment; re-solve it with "
                                "`python -m planner solve`")
        self._first_optimizer_moment = self._optimizer_moments[0]
        self._evicts_params = any(a.op is Op.EVICT and a.list is ChunkList.PARAM and a.src is Tier.DEVICE
                                  for a in schedule.actions)

        # ---- the chunk store, filled per initial_residency; params move into it
        # one NVMe store (and its directory lock) for chunks and activations alike (Note [NVME tier])
        nvme = None
        if uses_nvme(schedule) or activations_use_nvme(schedule):
            nvme = NvmeStore(nvme_dir, lists=nvme_lists(layout, schedule.initial_residency, schedule.actions))
        self.store = ChunkStore(layout, device_capacity_bytes=schedule.budgets.device_bytes, device=self.device,
                                nvme=nvme)
        self._placeholder = {dt: torch.empty(0, dtype=dt, device=self.device) for dt in (self.compute_dtype,)}
        self._device_storage: dict[tuple[str, int], int] = {}  # (device type, data_ptr) of a DEVICE PARAM payload -> chunk
        self.store.on_device_change = self._on_device_change
        # several ranks: the schedule's collectives over this rank's store (executor/distributed.py)
        self.comm = StoreCollectives(layout, self.store) if schedule.header.world_size > 1 else None
        self.rank = self.comm.collectives.rank if self.comm is not None else 0
        self._fill_store(by_name)
        for module_buffer in model.buffers():  # buffers stay plain tensors, on the compute device
            if module_buffer.device != self.device:
                module_buffer.data = module_buffer.data.to(self.device)

        # ---- replay state
        self.state = EngineState.IDLE
        self.cursor = 0
        self.micro_step = 0  # index in the accumulation window
        self.iterations = 0  # micro-steps replayed to their last moment
        self._grad_seen: set[int] = set()
        self._found_inf = False
        self._grad_scale = 1.0
        self._clip_coefficient: float | None = None
        self._failure = ""
        self.failure: EngineFailure | None = None
        self.steps_applied = 0  # optimizer steps every trainable chunk has taken
        self._stepped: set[int] = set()  # chunks stepped in this iteration
        self._step_chunks = frozenset(a.chunk for a in schedule.actions if a.op is Op.OPTIMIZER_STEP
                                      and (self.comm is None or self.comm.runs_here(a)))
        self._lost: list[tuple[ChunkList, int]] = []  # chunks left without a valid copy by a failure
        self._stats = IterationCounters()
        self._last_event_seconds = 0.0
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._saved_hooks_on = False
        self._grad_handles = self._register_grad_hooks(by_name)
        self._grad_handles += self._register_state_dict_hooks(model)  # Note [state_dict while attached]
        # registered after the grad hooks, so a unit's post_backward (which may fire from a param
        # grad hook) always sees its grads already in the GRAD chunk
        # first of all forward hooks: after a failure the model's next forward stops here, before the
        # hooks of an iteration that never finished see it
        self._refuse_handle = model.register_forward_pre_hook(self._refuse_if_failed, prepend=True)
        self.hooks = MomentHooks(model, blocks=self._blocks, units=self._units, on_event=self._on_event)
        self.hooks.install()
        # after the hooks' own root post_forward; always_call: also when the forward raised
        self._forward_depth = 0
        self._after_handle = model.register_forward_hook(self._after_forward, always_call=True)
        # after MomentHooks: a block's pre_forward moment (its FETCHes) runs before the manager starts
        # capturing, and the manager's post_forward (prepended) finishes before the moment's EVICTs
        modules = dict(model.named_modules())
        missing = [p.module for p in schedule.activation_plans if p.module not in modules]
        if missing:
            self.hooks.remove()
            self._refuse_handle.remove()
            self._after_handle.remove()
            raise ExecutorError(f"the schedule's activation plan names blocks {missing}, which are not modules of "
                                f"the model. {RERECORD}")
        self.activations = ActivationManager.from_schedule(
            model, schedule,
            alias_pack=lambda t: (r if isinstance(r := self._pack(t), ChunkRef) else None),
            alias_unpack=self._unpack, copies=self.store.copies, nvme=self.store.nvme, auto_prefetch=False,
            on_failure=self._failed_elsewhere)
        self.store.pools[Tier.DEVICE].other_bytes = self._activation_device_bytes
        self.store.pools[Tier.DEVICE].oldest_other = self.activations.oldest_offload
        self._setup_evaluation(model)
        self._setup_batch_check(schedule)

    # Note [activations]
    # Activations, per the schedule's plan, are one mechanism: `executor.activations.ActivationManager`
    # (KEEP, RECOMPUTE via non-reentrant checkpointing driven by block hooks, SWAP_HOST and SWAP_NVME via
    # saved-tensor hooks; `nvme_dir=` is required when a block swaps to NVME). A RECOMPUTE block with an
    # ACT_OFFLOAD in the schedule has its checkpoint (its input, `ActivationPlan.input_bytes`: the block's
    # own copy of each input storage, params excluded) swapped to the action's tier the same way; an
    # ACT_OFFLOAD / ACT_RELOAD of a checkpoint carrying other bytes than `input_bytes` is refused at
    # attach. The engine hands it its param aliasing (a saved tensor living in a DEVICE PARAM chunk is
    # stored as a `ChunkRef`, never copied or swapped) and turns off its own reload heuristics
    # (`auto_prefetch=False`): the offload copy starts when the tensor is saved, so ACT_OFFLOAD does
    # nothing (a failed copy is raised at the block's post_forward), and ACT_RELOAD (the offload's
    # deadline) waits for the block's offload copies and starts its prefetch, so a checkpoint is back
    # before the block's backward reruns its forward; an unpack waits for its reload. The activation
    # bytes held on DEVICE count against the DEVICE budget together with the chunks: every chunk
    # allocation and every moment checks chunk bytes + activation bytes <= the budget. Bytes whose offload
    # copy is in flight count until it lands, as the simulator and the planner count them (Note
    # [simulator evictions] in planner/sim_actions.py, Note [offloads in flight] in planner/decisions.py),
    # and so do evicted chunks whose copies are in flight (Note [retiring payloads] in executor/store.py):
    # over the budget, the training thread first waits for the oldest of those to land (stall seconds),
    # and raises `ExecutorError` ("DEVICE budget exceeded") only when nothing in flight is left to wait for.
    #
    # Note [NVME tier]
    # NVME tier (`nvme_dir=`): chunks on NVME live in preallocated files (`executor.nvme.NvmeStore`,
    # O_DIRECT where the filesystem allows); HOST<->NVME copies are the schedule's FETCH / WRITE_BACK
    # actions on the NVME_READ / NVME_WRITE channels, so only dirty chunks are written. Swapped
    # activations go to per-block files of the same store (Note [activation files] in executor/nvme.py),
    # and their copies through the store's copy engine: one copy engine, one NVMe file layer, one
    # directory lock -- a second engine on the directory is refused even when only activations go to
    # NVME, and a crashed run's files are removed at attach, never read. The files are removed by
    # `detach()` (or when the engine is collected).
    #
    # Note [several ranks]
    # Several ranks (`schedule.header.world_size > 1`, launched by torchrun, the default process group
    # initialized before `executor.run`): `executor.distributed.StoreCollectives` runs the schedule's
    # ALL_GATHER / REDUCE_SCATTER over this rank's store (gloo on the CPU, NCCL on GPUs). A rank holds the
    # chunks it owns (`Chunk.owner_rank`: their HOST/NVME copies, OS and optimizer steps) plus the PARAM
    # chunks on DEVICE; it performs the actions `runs_on_rank` gives it, waits for a group's collective
    # before touching its chunks, releases the group when it is evicted from DEVICE, and lands what is
    # left after the OPTIMIZER moment. Grads are averaged by the reduce-scatter (each rank's batch is its
    # share of the global batch). Clipping: the owned grads' squared norms, summed over the ranks.
    # `save()` / `load()` (called on every rank) write and read ONE plain checkpoint
    # (`save_sharded` / `load_sharded`) that loads into any world size; `state_dict()` is refused (a rank
    # holds only its chunks); `detach()` all-gathers the PARAM chunks so every rank gets plain params back.
    # fp16 loss scaling: a rank checks its owned (reduced) grads for inf/nan and the flag is all-reduced
    # (max), so every rank skips or steps together and the loss scales stay equal. Gradient accumulation:
    # see below. Stats: INTER_GPU bytes are this rank's.

    # ------------------------------------------------------------------------------ the loop API
    def step(self) -> None:
        """The OPTIMIZER moment(s): call once after every `loss.backward()` (every micro-step)."""
        self.optimizer.step()  # routed back to `_step_now`, so LR schedulers see a step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: grads live in GRAD chunks that die at the optimizer step."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with the fp16 loss scale applied first."""
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()

    def stats(self) -> EngineStats:
        """Counters of the last complete iteration (bytes, stalls, seconds per phase) and peaks since attach."""
        return self._stats.snapshot(self)

    def bytes_per_channel(self) -> dict[Channel, int]:
        """Bytes copied since attach per channel: chunk copies (the store) + activation swaps (the manager)."""
        out = defaultdict(int, self.store.bytes_per_channel)
        for ch, n in self.activations.stats().bytes_per_channel.items():
            out[ch] += n
        if self.comm is not None:  # this rank's all-gathers and reduce-scatters
            out[Channel.INTER_GPU] += self.comm.stats.inter_gpu_bytes
        return dict(out)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (MASTER, M, V) the store holds a valid copy of, each chunk once: a
        chunk with no trainable tensor (frozen base weights, LoRA) has none."""
        layout = self.schedule.layout
        return sum(layout.chunks[c].elements * DTYPE_BYTES[layout.list_dtypes[lst]]
                   for lst in OS_LISTS if lst in layout.lists
                   for c in range(len(layout.chunks)) if self.store.valid_tiers(lst, c))

    def stall_seconds(self) -> float:
        """Seconds the training thread waited since attach: for chunk copies, activation reloads and
        CPU optimizer steps (a step's wait inside a copy's is counted once, in the store)."""
        return self.store.stall_seconds + self.activations.stats().stall_seconds + self._step_stall_seconds

    def state_dict(self) -> dict[str, Any]:
        """{"model": plain model state dict, "optimizer": plain AdamW state dict[, "master", "loss_scaler"]}."""
        self._require_consistent("state_dict()")
        self._drain_stale()
        if self.comm is not None:
            raise ExecutorError("engine.state_dict() with world_size > 1: a rank holds only its own chunks; call "
                                "engine.save(path) on every rank (rank 0 writes one plain checkpoint)")
        with self._own_state_dict():
            out: dict[str, Any] = {"model": state_io.model_state_dict(self, self.model),
                                   "optimizer": state_io.optimizer_state_dict(self, self.optimizer)}
        master = state_io.master_state_dict(self)
        if master:
            out["master"] = master
        if self.scaler is not None:
            out["loss_scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._require_idle("load_state_dict()")
        self._drain_stale()
        state_io.restore({**state_dict}, self, model=self.model, optimizer=self.optimizer, loss_scaler=self.scaler)
        self._restart_stale()

    def save(self, path: str | Path) -> None:
        """Checkpoint atomically (executor.state.save): model, optimizer, masters, loss scaler."""
        self._require_consistent("save()")
        self._drain_stale()
        with self._own_state_dict():
            if self.comm is not None:  # every rank calls it; rank 0 writes the one plain file
                save_sharded(path, self, self.comm.collectives, model=self.model, optimizer=self.optimizer,
                             loss_scaler=self.scaler)
                return
            state_io.save(path, self, model=self.model, optimizer=self.optimizer, loss_scaler=self.scaler)

    def load(self, path: str | Path) -> None:
        self._require_idle("load()")
        self._drain_stale()
        if self.comm is not None:  # every rank keeps what it owns
            load_sharded(path, self, self.comm.collectives, model=self.model, optimizer=self.optimizer,
                         loss_scaler=self.scaler)
            return
        state_io.restore(state_io.load(path), self, model=self.model, optimizer=self.optimizer, loss_scaler=self.scaler)
        self._restart_stale()

    def detach(self) -> None:
        """Remove the hooks and give every param a plain tensor with its current value again."""
        if self.state is EngineState.DETACHED:
            return
        self.hooks.remove()
        self._refuse_handle.remove()
        self._after_handle.remove()
        self.activations.close()
        for h in self._grad_handles:
            h.remove()
        self._pop_saved_hooks()
        if self.state is not EngineState.FAILED:
            self._drain_stale()
        self._close_cpu_steps()
        self.store.settle()
        # several ranks: every rank calls detach(); the owners' PARAM chunks are gathered everywhere
        full = all_gather_params(self, self.comm.collectives) if self.comm is not None else None
        for chunk, places in self._places.items():
            flat = full[chunk] if full is not None else self.read_chunk(ChunkList.PARAM, chunk)
            for place in places:
                s = place.slot
                place.param.data = flat[s.offset_elements:s.offset_elements + s.numel].view(s.shape).clone()
        self.store.on_device_change = lambda lst, chunk, tensor: None
        self.store.close()
        self._enter(EngineState.DETACHED)

    # ------------------------------------------------------------------------------ attach


    # ------------------------------------------------------------------------------ replay
    def _on_event(self, event: MomentEvent) -> None:
        now = time.perf_counter()
        m = self.cursor
        if self.state is EngineState.FAILED:
            raise ExecutorError(f"the replay stopped earlier ({self._failure}); build a new engine after fixing it")
        if self.state is EngineState.DETACHED:
            return
        if self.state is EngineState.EVALUATING:
            if not (event.kind is MomentKind.PRE_FORWARD and event.module == ""):
                self._evaluation_event(event)
                return
            self._end_evaluation()  # the last evaluation forward raised before its end: a new forward starts
        if m == 0 and self.state is EngineState.IDLE:
            if event.kind is MomentKind.PRE_FORWARD and event.module == "" and self._is_evaluation():
                self._begin_evaluation()
                self._evaluation_event(event)
                return
            if event.phase is Phase.BACKWARD:
                raise ExecutorError("backward without a training forward: the last forward ran as an evaluation "
                                    "(model.eval() or torch.no_grad()); call model.train() and run the training "
                                    "forward with grad enabled before loss.backward()")
        elif event.kind is MomentKind.PRE_FORWARD and event.module == "" and self._is_evaluation():
            self._fail(f"moment {m}: an evaluation forward (model.eval() or torch.no_grad()) in the middle of an "
                       "iteration; evaluate between engine.step() and the next training forward")
        moments = self.schedule.moments
        ref = self._check_event(m, event)
        if event.block >= 0 and event.phase is Phase.FORWARD and event.module in self._act_expected:
            self._check_batch(m, event)
        if m == 0:
            self._enter(EngineState.REPLAYING)
            self._stats.begin_iteration(self)
            self._push_saved_hooks()
        else:
            self._stats.add_phase(moments[m - 1].phase, now - self._last_event_seconds, last_backward=(m == self._first_optimizer_moment))
        if ref.kind is MomentKind.PRE_BACKWARD and ref.module == "":
            self._pop_saved_hooks()  # forward is over: nothing more is saved
        try:
            with torch.profiler.record_function(f"tide.moment[{m}]"):
                self._apply(m)
            self._check_device_budget(m)
        except ExecutorError as exc:
            if self.state is not EngineState.FAILED:
                self._fail(str(exc))
            raise
        except torch.OutOfMemoryError as exc:  # an allocation outside the store (an optimizer step's temporaries)
            self._fail(f"moment {m}: {out_of_memory('its actions', None, self.device, exc)}")
        self.cursor = m + 1
        self._last_event_seconds = now  # the actions' time belongs to moment m's work

    # Note [gradient accumulation]
    # Gradient accumulation (`grad_accumulation_steps=N`): call `engine.step()` after every micro-step;
    # every micro-step replays ALL moments of the schedule, including the OPTIMIZER moment, and only the
    # last of N runs the OPTIMIZER_STEP actions. Grads accumulate in the GRAD chunks: on the first N-1
    # micro-steps an EVICT that would drop the last copy of a GRAD chunk keeps it (a DEVICE copy is first
    # written back to HOST) and the next ALLOCATE brings the accumulated chunk back instead of zeros.
    # Those extra copies are counted on their channels, so with N > 1 the bytes per micro-step exceed the
    # prediction by exactly that traffic (with N = 1 they equal it); a WRITE_BACK of a PARAM chunk whose step
    # was skipped on the first N-1 (a DEVICE step, in backward or not) is skipped too: its home copy is current. Several ranks (DDP `no_sync`): on the
    # first N-1 micro-steps the REDUCE_SCATTERs are skipped and every rank keeps the full grads of every
    # group (the GRAD EVICTs above keep non-owned chunks too); the last micro-step reduce-scatters the
    # accumulated sums. The reduce-scatter averages over the ranks and the loop divides each micro-step's
    # loss by N (as with one rank), so the step sees the mean over ranks x micro-steps: the grads of one
    # process running the whole global batch as ws x N parts, each loss divided by ws x N. Per micro-step
    # the bytes differ from the prediction by exactly the accumulation traffic: the kept GRAD copies on
    # D2H/H2D, and on INTER_GPU the skipped reduce-scatters (the first N-1 micro-steps move the
    # prediction minus the schedule's REDUCE_SCATTER bytes, the last one the prediction).
    def _apply(self, m: int) -> None:
        store = self.store
        if self._steps_in_flight:
            self._poll_steps()  # a CPU step that failed on the worker stops the replay here
        final = self.micro_step == self.accumulation_steps - 1
        comm = self.comm
        if comm is not None:
            comm.land_scatters()  # the grads reduce-scattered in an earlier moment leave DEVICE before this one
        for index, a in self._actions[m]:
            why = f"moment {m} action {index} ({a.op.value})"
            op = a.op
            if comm is not None:
                if not comm.runs_here(a):
                    continue
                if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
                    if op is Op.REDUCE_SCATTER and not final:
                        continue  # accumulating (DDP no_sync): the group's full grads stay on this rank
                    if op is Op.REDUCE_SCATTER:  # every grad slot of the group (bucket) set before it is summed
                        for c in a.bucket or comm.collectives.group_chunks(a.chunk):
                            if store.device_tensor(ChunkList.GRAD, c) is not None:
                                self._fill_gaps(c)
                    comm.apply(a, why=why)
                    continue
                if a.chunk >= 0:
                    comm.wait(a.list or ChunkList.GRAD, a.chunk)
                if comm.dropped(a):
                    continue  # the reduce-scatter left this rank the owned chunk's grads only
            if a.list is ChunkList.GRAD and op is not Op.ALLOCATE:
                self._fill_gaps(a.chunk)  # the chunk is read (copied) or dropped: no unset element left
            if (op is Op.WRITE_BACK and a.list is ChunkList.PARAM and (not final or self._found_inf)
                    and a.dst in store.valid_tiers(a.list, a.chunk)):
                continue  # its OPTIMIZER_STEP was skipped (an accumulating micro-step, an fp16 overflow): home is current
            if op in (Op.FETCH, Op.PREFETCH, Op.WRITE_BACK):
                store.copy(a.list, a.chunk, a.src, a.dst, a.channel, why=why)
                if op is Op.FETCH:
                    store.wait(a.list, a.chunk, a.dst)
            elif op is Op.EVICT:
                if a.list is ChunkList.GRAD and not final and store.valid_tiers(a.list, a.chunk) == [a.src]:
                    # accumulating: the grads of this chunk are not dead yet, keep them on HOST
                    if a.src is Tier.HOST:
                        continue
                    store.copy(a.list, a.chunk, Tier.DEVICE, Tier.HOST, Channel.D2H, why=f"{why}, kept for accumulation")
                store.evict(a.list, a.chunk, a.src, why=why)
                if comm is not None and a.src is Tier.DEVICE:
                    comm.evicted(a.list, a.chunk)
            elif op is Op.ALLOCATE:
                tiers = store.valid_tiers(a.list, a.chunk) if a.list is ChunkList.GRAD else []
                if a.dst in tiers:
                    continue  # accumulating in place
                if tiers:  # accumulating: bring the partial sums back instead of zeros
                    store.copy(a.list, a.chunk, tiers[0], a.dst, COPY_CHANNEL[(tiers[0], a.dst)], why=f"{why}, accumulated grads")
                    store.evict(a.list, a.chunk, tiers[0], why=f"{why}, accumulated grads moved")
                else:
                    if a.list is ChunkList.GRAD:
                        # no memset: each grad is copied into its slot on arrival, the gaps are zeroed
                        # before the chunk is first read (plain PyTorch does not zero grads either)
                        store.allocate(a.list, a.chunk, a.dst, why=why, zero=False)
                        self._unfilled[a.chunk] = set(self._trainable_by_chunk.get(a.chunk, ()))
                    else:
                        store.allocate(a.list, a.chunk, a.dst, why=why)
            elif op is Op.ACT_OFFLOAD:
                # the manager started each copy when the tensor was saved (a SWAP block's saved tensors, a
                # RECOMPUTE block's offloaded checkpoint); failures raise at post_forward
                pass
            elif op is Op.ACT_RELOAD:
                self.activations.wait_offloaded(a.block)  # the offload's deadline: before its reload
                self.activations.prefetch(a.block)
            elif op is Op.OPTIMIZER_STEP:
                if final and not self._found_inf:
                    if self._stale is not None and a.dst is Tier.HOST:
                        self._stale_step(a.chunk, why=why)
                    elif self._step_worker is not None and a.dst is Tier.HOST and m < self._first_optimizer_moment:
                        self._submit_step(a.chunk, why=why)
                    else:  # DEVICE steps (kernels on the compute stream) and HOST steps of the OPTIMIZER moment
                        self._optimizer_step(a.chunk, a.dst, why=why)
            else:
                raise ExecutorError(f"{why}: {op.value} is not supported by this executor; re-solve without it")
        for chunk in self._needs[m]:
            if comm is not None:
                comm.wait(ChunkList.PARAM, chunk)
            store.tensor(ChunkList.PARAM, chunk, Tier.DEVICE, why=f"the work of moment {m}")


    def _step_now(self) -> None:
        """The OPTIMIZER moment(s), driven by optimizer.step()."""
        if self.state is EngineState.FAILED:
            raise ExecutorError(f"the replay stopped earlier ({self._failure}); build a new engine after fixing it")
        if self.cursor != self._first_optimizer_moment:
            raise ExecutorError(f"engine.step() at moment {self.cursor}: the schedule's optimizer moment is "
                                f"{self._first_optimizer_moment}; call it once after every loss.backward()")
        final = self.micro_step == self.accumulation_steps - 1
        self._grad_scale, self._found_inf, self._clip_coefficient = 1.0, False, None
        if final:
            self._prepare_step()
        if self._step_worker is not None and self.state is EngineState.REPLAYING:
            self._step_worker.run_queued()  # backward is over: the steps not started yet run here, at full speed
        for _ in self._optimizer_moments:
            self._on_event(MomentEvent(MomentKind.OPTIMIZER_STEP, Phase.OPTIMIZER, "", -1))
        if self._steps_in_flight:  # engine.step() returns with every CPU step of the iteration done
            try:
                self._wait_steps()
            except ExecutorError as exc:
                self._mark_failed(str(exc))
                raise
        try:  # ...and every copy reading an evicted chunk landed (Note [retiring payloads] in executor/store.py)
            self.store.land_evicted()
        except ExecutorError as exc:
            self._mark_failed(str(exc))
            raise
        if self.comm is not None:
            self.comm.end_iteration()
        if final:
            for chunk in list(self._unfilled):
                self._fill_gaps(chunk)
            for chunk in range(len(self.schedule.layout.chunks)):  # a GRAD chunk kept across iterations
                for tier in self.store.valid_tiers(ChunkList.GRAD, chunk):
                    self.store.tensor(ChunkList.GRAD, chunk, tier, why="clearing dead grads").zero_()
            if self.scaler is not None:
                self.scaler.update(self._found_inf)
            self._grad_seen.clear()
            if self._stepped:
                self.steps_applied += 1
            self._stepped.clear()
        self._stats.add_phase(Phase.OPTIMIZER, time.perf_counter() - self._last_event_seconds, last_backward=False)
        self.micro_step = (self.micro_step + 1) % self.accumulation_steps
        self.iterations += 1
        self.cursor = 0
        self._enter(EngineState.IDLE)
        self._stats.end_iteration(self)


    def _activation_device_bytes(self) -> int:
        """Activation bytes on DEVICE as the simulator and the planner count them: an offload copy in
        flight counts until it lands (Note [activations])."""
        return self.activations.live_bytes

    def _check_device_budget(self, m: int) -> None:
        """Chunks + activations held on DEVICE after moment m's actions: over the budget, wait for the
        oldest bytes in flight to land; still over it is a bug, raised loudly (Note [activations])."""
        pool = self.store.pools[Tier.DEVICE]
        if not pool.make_room(0):
            live = self._activation_device_bytes()
            self._fail(f"DEVICE budget exceeded at moment {m}: {pool.held_bytes} chunk bytes + {live} activation "
                       f"bytes > {pool.capacity_bytes}; the schedule does not fit its own budget (re-solve it with "
                       "`python -m planner solve`, and check it with `python -m planner simulate`)")


def run(model: nn.Module, schedule: Schedule | str | Path, **kwargs: Any) -> Engine:
    """Attach `model` to `schedule` (a Schedule or a schedule file) and return the engine; see `Engine`.

    Keyword arguments: params (iterable of Parameters or param groups; default: decay on matrices,
    none on norms/biases), optimizer ("adamw" | "adam"), lr, betas, eps, weight_decay,
    grad_clip_norm (global, across tiers; None: off), precision ("fp32" | "bf16" | "fp16", None: the
    schedule's), grad_accumulation_steps, nvme_dir (a directory for the NVME tier: chunks and SWAP_NVME activations; required when
    the schedule uses NVME), device ("auto" |
    "cpu" | "cuda[:i]"; "cpu" emulates DEVICE with a CPU pool of the schedule's budget),
    optimizer_threads (intra-op threads of the CPU optimizer worker; None: Note [CPU optimizer steps] in executor/stepping.py),
    stale_optimizer (False; True: the one-step-stale asynchronous mode, which CHANGES CONVERGENCE --
    Note [asynchronous mode] in executor/stepping.py).
    """
    if not isinstance(schedule, Schedule):
        schedule = Schedule.read(schedule)
    return Engine(model, schedule, **kwargs)


__all__ = ["Engine", "EngineFailure", "EngineState", "check_model", "default_param_groups", "run"]
