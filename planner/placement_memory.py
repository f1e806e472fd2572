"""The memory rows of the placement model: bytes per tier and stage (DEVICE, HOST, NVME) as sparse
running sums over the model's variables, bounded by each tier's capacity. A mixin of
`planner.placement.PlacementModel`, which owns the variables.
"""

from __future__ import annotations

from typing import Any

from schemas.schedule import ActivationMode, Tier
from planner.placement_terms import NVME_STREAM_STAGED_CHUNKS, act_windows, stage_runs


def node_factors(d: Any, g: Any) -> tuple[int, int]:
    """(PARAM, owner) multipliers from one rank's bytes of chunk class g to its busiest node's: every
    rank of the node holds its local PARAM chunk of each comm group (q of them; a padding chunk too:
    materialize fetches whole comm groups), but only the owners of trainable chunks hold OS and grads
    and step (ranks 0..t-1 of each comm group, so node 0 holds min(t, q)). (1, 1) with one rank."""
    if d.ranks <= 1:
        return 1, 1
    return d.ranks_per_node, min(g.trainable_chunks, d.ranks_per_node) if g.trainable else 0


def scaled(expr: Any, factor: float) -> Any:
    """expr * factor, the same expression where the factor is 1 (the one-rank rows stay as they were)."""
    if factor == 0:
        return 0
    return expr if factor == 1 else expr * factor


class MemoryRows:
    """DEVICE, HOST and NVME bytes per stage, and the capacity rows over them."""

    # arrived chunks through running sums (planner.placement.SparsePlacementModel) instead of one term
    # per stage until the use: the dense terms are then not built at all (quadratic in depth)
    ARRIVALS_AS_RUNNING_SUMS = False

    def _interval_sums(self, name: str, items: list[tuple[int, int, Any]]) -> list[Any]:
        """Per stage s, the sum of the expressions whose interval [first, last] contains s.

        A running sum (one variable per stage where it changes) instead of one term per stage and
        item keeps every row sparse: dense rows are what makes the simplex slow at 175B.
        """
        n = len(self.data.stages)
        starts: list[list[Any]] = [[] for _ in range(n + 1)]
        ends: list[list[Any]] = [[] for _ in range(n + 1)]
        for first, last, expr in items:
            if first > last:
                continue
            starts[first].append(expr)
            ends[last + 1].append(expr)
        out: list[Any] = []
        prev: Any = 0
        for s in range(n):
            if not starts[s] and not ends[s]:
                out.append(prev)
                continue
            v = self.solver.NumVar(0, self.solver.infinity(), f"{name}[{s}]")
            self.solver.Add(v == prev + sum(starts[s]) - sum(ends[s]), f"{name}_run[{s}]")
            out.append(v)
            prev = v
        return out

    def _build_memory_terms(self) -> None:
        d, n = self.data, len(self.data.stages)
        p = d.ranks  # a comm group gathered on DEVICE is p chunks; its OS and HOST copy are the local chunk's
        inf = self.solver.infinity()
        self.device_static = self.solver.NumVar(0, inf, "device_static")  # OS on DEVICE
        self.solver.Add(self.device_static == sum(self.os_device[gi] * g.os_bytes for gi, g in enumerate(d.chunk_classes)),
                        "device_static_sum")
        # per node (q ranks): PARAM copies of every rank's local chunks, OS of the owners' (node_factors)
        fac = [node_factors(d, g) for g in d.chunk_classes]
        self.host_static = self.solver.NumVar(0, inf, "host_static")  # HOST copies of PARAM + OS on HOST
        self.solver.Add(self.host_static == sum(scaled((g.count - self.os_device[gi] - self.param_nvme[gi]) * g.param_bytes, fac[gi][0])
                                                + scaled((self.os_host[gi] + self.os_stream[gi]) * g.os_bytes, fac[gi][1])
                                                # sharded DEVICE steps: the local chunk's home copy
                                                + scaled(self.os_sharded[gi] * g.param_bytes, fac[gi][0])
                                                for gi, g in enumerate(d.chunk_classes)), "host_static_sum")
        self.use_bytes = [0.0] * n  # PARAM bytes of the chunk classes a stage's work touches
        self.arrived: list[list[Any]] = [[] for _ in range(n)]  # incoming chunks already on DEVICE in s (bytes)
        self.arriving: list[list[Any]] = [[] for _ in range(n)]  # the part of `arrived` arriving during s itself
        kept: list[tuple[int, int, Any]] = []
        staging: list[tuple[int, int, Any]] = []
        grads: list[tuple[int, int, Any]] = []
        host_grads: list[tuple[int, int, Any]] = []
        for gi, g in enumerate(d.chunk_classes):
            for s in g.use_stages:
                self.use_bytes[s] += g.count * g.param_bytes * p
            for i, gap in enumerate(self.gaps[gi]):
                for first, last in stage_runs(gap.stages):
                    kept.append((first, last, self.keep[gi][i] * (g.param_bytes * p)))
                pos = {s: j for j, s in enumerate(gap.stages)}
                for k, s_in in enumerate(gap.lookahead):
                    if not self.ARRIVALS_AS_RUNNING_SUMS:  # (else the subclass writes them as running sums)
                        for s in gap.stages[pos[s_in]:]:  # arrived chunks occupy DEVICE until the use
                            self.arrived[s].append(self.incoming[gi][i][k] * (g.param_bytes * p))
                    self.arriving[s_in].append(self.incoming[gi][i][k] * (g.param_bytes * p))
                    if self.nvme_incoming[gi][i]:
                        # the staging copy of an NVMe-homed chunk stays on HOST until the use
                        for first, last in stage_runs(gap.stages[pos[s_in]:]):
                            staging.append((first, last, scaled(self.nvme_incoming[gi][i][k] * g.param_bytes, fac[gi][0])))
            if not self.gaps[gi]:
                kept.append((0, n - 1, self.persistent[gi] * (g.param_bytes * p)))
            if not g.trainable:
                continue
            if g.first_backward_stage >= 0:
                # grads accumulate on DEVICE over the chunk's backward uses, then GPU Adam chunks keep them
                if p == 1:
                    grads.append((g.first_backward_stage, g.last_backward_stage, g.count * g.param_bytes))
                    grads.append((g.last_backward_stage + 1, n - 1, self.os_device[gi] * g.param_bytes))
                else:
                    # with p ranks every rank holds the comm group's t trainable chunks' grads until the
                    # reduce-scatter after the last backward use (PatrickStar §7); from then on a rank
                    # keeps its own chunk's reduced grads only, and materialize keeps that local GRAD of
                    # every DEVICE-stepped comm group (streamed OS too) until its step, never written back
                    # in between (planner.device_cache: a GRAD entry is unevictable while ws > 1 and
                    # shrinks to the local chunk at its reduce-scatter, `bytes_at`)
                    t = g.trainable_chunks
                    grads.append((g.first_backward_stage, g.last_backward_stage, g.count * g.param_bytes * t))
                    # reduce-scattered per bucket: a chunk leaves the other ranks after its own last backward stage
                    for k, held in enumerate(g.bucket_held_chunks):
                        if held != t:
                            s = g.first_backward_stage + k
                            grads.append((s, s, self.rs_bucket[gi] * (g.param_bytes * (held - t))))
                    stepped = self.os_device[gi] + self.os_stream[gi] + self.os_nvme_stream[gi]
                    grads.append((g.last_backward_stage + 1, n - 1, stepped * g.param_bytes))
                # CPU Adam grads wait on HOST for their step (consumed at once when it overlaps backward)
                last = g.last_backward_stage if d.optimizer_overlap else n - 1
                streamed = self.os_stream[gi] + self.os_nvme_stream[gi]
                host_grads.append((g.last_backward_stage, last,
                                   scaled((g.count - self.os_device[gi] - streamed) * g.param_bytes, fac[gi][1])))
                # streamed chunks' grads wait on HOST for the optimizer stage
                host_grads.append((g.last_backward_stage, n - 1, scaled(streamed * g.param_bytes, fac[gi][1])))
                if d.optimizer_overlap:
                    # OS living on NVME is staged on HOST from the chunk's first backward use (read
                    # early, so the SSDs work while the device computes) until its CPU step
                    host_grads.append((g.first_backward_stage, g.last_backward_stage,
                                       scaled(self.os_nvme[gi] * g.os_bytes, fac[gi][1])))
        saved: list[tuple[int, int, Any]] = []
        host_acts: list[tuple[int, int, Any]] = []
        for bi, (b, choice) in enumerate(zip(d.blocks, self.act)):
            if b.forward_stage < 0 or b.backward_stage < 0:
                continue
            recompute, swap, offload, reload = act_windows(b, n)
            swapped = choice[ActivationMode.SWAP_HOST] + choice[ActivationMode.SWAP_NVME]
            ckpt = self.ckpt_block[bi]
            if len(recompute):
                saved.append((recompute.start, recompute.stop - 1,
                              (b.activation_bytes - b.input_bytes) * choice[ActivationMode.RECOMPUTE]))
            if len(swap):
                saved.append((swap.start, swap.stop - 1, b.activation_bytes * swapped + b.input_bytes * ckpt))
            host_acts.append((offload, reload, scaled(b.activation_bytes * choice[ActivationMode.SWAP_HOST] + b.input_bytes * ckpt,
                                                      d.ranks_per_node)))
        trainable = [(gi, g) for gi, g in enumerate(d.chunk_classes) if g.trainable]
        if d.has_nvme and trainable:
            # OS living on NVME passes through HOST for its CPU step. With overlap the write-back of
            # one chunk overlaps the read of the next: one more chunk of OS is staged on HOST during
            # backward; after backward the steps take one chunk at a time in the optimizer stage
            self.any_nvme_os = self._flag("any_nvme_os")
            for gi, g in trainable:
                self.solver.Add(self.os_nvme[gi] <= g.count * self.any_nvme_os, f"any_nvme_os[{g.id}]")
            staged = max(g.os_bytes * node_factors(d, g)[1] for _, g in trainable) * self.any_nvme_os
            backward = [g for _, g in trainable if g.first_backward_stage >= 0]
            if d.optimizer_overlap and backward:
                first = min(g.first_backward_stage for g in backward)
                last = max(g.last_backward_stage for g in backward)
                host_grads.append((first, last, staged))
                # steps the CPU reaches only after backward run as materialize's tail chain: the
                # next chunk's OS is read while the previous one's is written back
                host_grads.append((d.optimizer_stage, d.optimizer_stage, 2 * staged))
            else:
                host_grads.append((d.optimizer_stage, d.optimizer_stage, staged))
        pn_classes = [(gi, g) for gi, g in enumerate(d.chunk_classes) if self.param_nvme[gi].upper_bound > 0]
        if pn_classes:
            # a CPU step of an NVMe-homed chunk reads its PARAM to HOST and writes it back (and the
            # write-back of one step overlaps the next): two chunks of PARAM staged on HOST
            any_pn = self._flag("any_nvme_param")
            for gi, g in pn_classes:
                self.solver.Add(self.param_nvme[gi] <= g.count * any_pn, f"any_nvme_param[{g.id}]")
            staging.append((0, n - 1, 2 * max(g.param_bytes * node_factors(d, g)[0] for _, g in pn_classes) * any_pn))
        self.stream_transient: Any = 0
        if d.stream_optimizer and trainable:
            # a streamed GPU Adam step holds one chunk's OS, PARAM and GRAD on DEVICE at a time
            self.any_stream = self._flag("any_stream")
            for gi, g in trainable:
                self.solver.Add(self.os_stream[gi] + self.os_nvme_stream[gi] <= g.count * self.any_stream,
                                f"any_stream[{g.id}]")
            if p == 1:
                self.stream_transient = max(g.os_bytes + 2 * g.param_bytes for _, g in trainable) * self.any_stream
            else:
                # with several ranks the step's PARAM comes up as materialize's whole comm-group entry
                # (p chunks of budget, planner.device_cache) beside the owner's OS; its grads are
                # already counted (they stay on DEVICE until the step)
                self.stream_transient = max(g.os_bytes + p * g.param_bytes for _, g in trainable) * self.any_stream
            if d.has_nvme:
                # NVMe-streamed steps are pipelined (materialize reads the next chunk's OS before this
                # one's write-back): up to two chunks' OS staged on HOST in the optimizer stage
                any_ns = self._flag("any_nvme_stream")
                for gi, g in trainable:
                    self.solver.Add(self.os_nvme_stream[gi] <= g.count * any_ns, f"any_nvme_stream[{g.id}]")
                host_grads.append((d.optimizer_stage, d.optimizer_stage,
                                   NVME_STREAM_STAGED_CHUNKS * max(g.os_bytes * node_factors(d, g)[1] for _, g in trainable) * any_ns))
        if p > 1 and trainable:
            # a sharded DEVICE step (Note [sharded DEVICE steps]) brings materialize's whole comm-group
            # PARAM entry up for the step, p chunks of budget, beside its OS and grads (counted already)
            self.any_sharded = self._flag("any_sharded_step")
            for gi, g in trainable:
                self.solver.Add(self.os_sharded[gi] <= g.count * self.any_sharded, f"any_sharded_step[{g.id}]")
            self.stream_transient = self.stream_transient + max(p * g.param_bytes for _, g in trainable) * self.any_sharded
        self.kept_bytes = self._interval_sums("kept_params", kept)
        self.grad_bytes = self._interval_sums("device_grads", grads)
        self.saved_bytes = self._interval_sums("activation_saved", saved)
        self.host_grad_bytes = self._interval_sums("host_grads", host_grads)
        self.host_act_bytes = self._interval_sums("host_activations", host_acts)
        self.host_staging_bytes = self._interval_sums("host_param_staging", staging)

    def _param_expr(self, s: int) -> Any:
        """PARAM + GRAD bytes on DEVICE in stage s (the budget materialize gets)."""
        return self.use_bytes[s] + self.kept_bytes[s] + sum(self.arrived[s]) + self.grad_bytes[s]

    # Note [placement non-model baseline]:
    # The non-model curve (`MomentRef.non_model_bytes`, recorded with every activation kept) is the
    # baseline of DEVICE memory; activation plans subtract what they free.
    def _device_expr(self, s: int) -> Any:
        d = self.data
        transient = self.stream_transient if s == d.optimizer_stage else 0
        return d.stages[s].non_model_bytes + self.device_static + self._param_expr(s) - self.saved_bytes[s] + transient

    def _device_rows(self, s: int) -> list[Any]:
        """DEVICE bytes in stage s, as the rows the capacity bounds. The chunks arriving during s for
        the next use are issued at the first moment with room (materialize's prefetch), which is at
        the latest the stage's last moment, when the work's peak of non-model bytes is over. So two
        rows: the work's peak without them, and the stage's last moment with them (the simulator
        and materialize count memory per moment, not per stage)."""
        d = self.data
        st = d.stages[s]
        full = self._device_expr(s)
        if not self.arriving[s] or st.tail_non_model_bytes >= st.non_model_bytes:
            return [full]
        return [full - sum(self.arriving[s]), full - st.non_model_bytes + st.tail_non_model_bytes]

    def _host_expr(self, s: int) -> Any:
        # per node (the terms carry their node factors: node_factors, q ranks' activations)
        return self.host_static + self.host_grad_bytes[s] + self.host_act_bytes[s] + self.host_staging_bytes[s]

    def _nvme_expr(self) -> Any:
        d = self.data
        expr = 0
        # per node: the node's SSDs hold its ranks' local chunks and activations (node_factors)
        for gi, g in enumerate(d.chunk_classes):
            fp, fo = node_factors(d, g)
            expr += scaled((self.os_nvme[gi] + self.os_nvme_stream[gi]) * g.os_bytes, fo) + scaled(self.param_nvme[gi] * g.param_bytes, fp)
        for b, choice in zip(d.blocks, self.act):
            expr += scaled(b.activation_bytes * choice[ActivationMode.SWAP_NVME], d.ranks_per_node)
        return expr

    def _cap(self, tier: Tier, given: float) -> Any:
        return self.capacity if self.capacity_variable is tier else given

    def _add_memory_constraints(self) -> None:
        d = self.data
        self._build_memory_terms()
        for s in range(len(d.stages)):
            for r, row in enumerate(self._device_rows(s)):
                self.solver.Add(row <= self._cap(Tier.DEVICE, d.device_bytes), f"device_memory[{s},{r}]")
            self.solver.Add(self._host_expr(s) <= self._cap(Tier.HOST, d.host_bytes), f"host_memory[{s}]")
        self.solver.Add(self._nvme_expr() <= self._cap(Tier.NVME, d.nvme_bytes), "nvme_memory")


__all__ = ["MemoryRows"]
