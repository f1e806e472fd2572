"""The replay of a baseline policy: a `PolicyPlan` (what one system decides) turned into a complete
schedule by a greedy replay of that system's runtime over the moments (fetch what a moment needs,
evict by the system's rule, its optimizer steps and activation copies), checked by the simulator.
See `planner.baselines` for the policies and what the replay simplifies.
"""

from __future__ import annotations

import bisect
import dataclasses
from enum import StrEnum

from planner import __version__
from planner.errors import InfeasibleError, PlannerError
from planner.problem import Problem, device_non_model_bytes
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
    copy_channel,
)
from schemas.trace import Phase

GB = 1e9
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


__all__ = ["DataParallel", "Eviction", "PolicyPlan", "replay_policy"]
