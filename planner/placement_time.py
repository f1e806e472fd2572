"""The time rows and the objective of the placement model: bytes per channel and stage, the stage
times they bound (Fuyou's per-stage cost model), the CPU optimizer's queue, and the tie-breaker.
A mixin of `planner.placement.PlacementModel`, which owns the variables.
"""

from __future__ import annotations

from typing import Any

from schemas.schedule import ActivationMode, Tier
from planner.placement_memory import node_factors, scaled
from planner.placement_terms import BYTE_UNIT, INFINITE_BYTES, SECONDARY_WEIGHT, act_windows, is_zero


# Note [placement cost model]:
# The cost model is Fuyou's (§4.5, Eq. 2 and 5) applied per stage: a stage lasts as long as its
# busiest channel, and the iteration is the sum of the stages:
#
#     T_s >= compute_s + recompute_s (+ GPU Adam in the optimizer stage)
#     T_s >= H2D bytes_s / BW_H2D            T_s >= D2H bytes_s / BW_D2H
#     T_s >= NVMe reads_s / BW_read + NVMe writes_s / BW_write        (an SSD is simplex, Eq. 4)
#     sum_{s' >= s} T_s' >= CPU Adam work released at or after s       (Fuyou §4.3: the CPU optimizer
#                                                                       overlaps backward, in order)
#
# Note [placement data flow]:
# Data flow per chunk (what the time rows charge):
# - a PARAM chunk that must be on DEVICE in stage s+1 and is not in stage s arrives during stage s
#   (prefetch, `incoming[g,s]`): it costs H2D time in s and DEVICE memory in s (double buffering);
# - grads of chunks whose Adam runs on the CPU go D2H in their last backward stage; their updated
#   params (HOST copy) must come up again before the next forward uses them (stale DEVICE copies);
# - chunks whose optimizer state lives on DEVICE run GPU Adam and keep params and grads on DEVICE;
# - OS on HOST or NVME may instead be streamed to the DEVICE for GPU Adam in the optimizer stage
#   (OS, PARAM and GRAD up, OS and PARAM down; from NVME also read from and written back to the
#   SSDs, two chunks of it staged on HOST): what frees the largest models from the CPU optimizer
#   (175B: 116 s of CPU Adam at 1.5e9 params/s) when HOST cannot hold their OS;
# - OS on NVME is read and written once per iteration by the CPU Adam (no grads through the SSDs
#   thanks to the overlap, Fuyou §4.3); when the CPU falls behind backward, the grads it has not
#   reached wait on HOST into the optimizer stage (a row of their own, `cpu_optimizer_lag`);
# - PARAM homed on NVME (Fuyou's layout, for models whose PARAM copies do not fit on HOST): read
#   from the SSDs for every fetch (staged on HOST until the use) and for its CPU step, written back
#   after it; a chunk fetched on demand (at its use, no room to prefetch) makes the use wait;
# - activations: KEEP holds the block's saved bytes on DEVICE until its backward; RECOMPUTE keeps
#   only the input and reruns the forward in backward; SWAP_HOST / SWAP_NVME move them out in the
#   stage after the forward and back in the stage before the backward (Fuyou §4.4 pipelining).
#
# Note [CPU Adam beside copies, in the model]:
# The simulator runs a CPU Adam step at the rate alone while no H2D, D2H or NVMe copy runs on its node and
# at `cpu_adam_beside_copies` of that speed while one does (the profile's rate with copies over its rate
# alone; Note [CPU Adam beside copies] in planner/sim_actions.py). Over the stages from s on, the CPU then
# runs at most the suffix's length less (1 - beside) x the time copies run in it, and that time is at least
# the sum over those stages of each stage's busiest copy row (its H2D, D2H, both-ways and SSD rows), and at
# least the SSD queue's work released from s on (`nvme_tails`). So the CPU rows price every step at the rate
# alone and read
#
#     sum_{s' >= s} T_s' >= CPU Adam work released at or after s + (1 - beside) x copy time from s on,
#
# a row every replay satisfies (it follows the simulator's rule, not a measured price): with it the LP is the
# bound of every plan, not only of the plans a solve replays (issue 17 item 4), where a price with copies for
# every step is not (a replay whose steps run beside no copy beats it). Before session 13 the model priced a
# step of HOST-homed OS at the rate alone and one of NVME-homed OS at the rate with copies, and solved again
# with every step at the latter, the simulator judging (two searches); measured on the same trees
# (bench/RESULTS.md "Session 13"): GPT-3 13B x rtx4090-768g-12ssd 8.242 -> 8.127 s, x a100-80g-12ssd 6.145 ->
# 6.029 s, 1.3B x rtx4090 552.8 -> 551.9 ms, PatrickStar's 4B 2.372 -> 2.317 s, the other goldens as fast
# (gpt-small +32 us), in one search instead of two (13B: ~8.4 -> ~2.9 CPU s). Above BESIDE_COPIES_MAX_BLOCKS
# blocks (planner/placement_input.py) every step is priced at the rate with copies and `cpu_adam_beside_copies`
# is 1: no rows.
#
# (The lag row, `cpu_optimizer_lag`, prices the CPU's backlog at the rate with copies: it is a HOST
# estimate, not a bound, and at the rate alone the 256-block paced plans ran out of HOST and were re-planned.)


LATE_ARRIVAL_MAX_BLOCKS = 256  # deeper models get no late-arrival rows (solve time; measured above them)


class TimeRows:
    """Channel bytes per stage, the stage-time rows over them, and the objective."""

    def _channel_exprs(self) -> dict[str, list[Any]]:
        """Per stage: bytes per channel, compute, and CPU/NVMe optimizer work released (expressions)."""
        d, n = self.data, len(self.data.stages)
        h2d: list[Any] = [0] * n
        d2h: list[Any] = [0] * n
        nvme_read: list[Any] = [0] * n
        nvme_write: list[Any] = [0] * n
        compute: list[Any] = [st.compute_seconds for st in d.stages]
        on_demand: list[Any] = [0] * n  # seconds the work of s waits for chunks fetched at its start
        rd = d.nvme_read_bytes_per_s or 1.0
        cpu_released: list[Any] = [0] * n  # CPU Adam time whose grads become final in stage s
        cpu_elements: list[Any] = [0] * n  # the params those steps update (their host DRAM traffic)
        os_read: list[Any] = [0] * n  # NVMe OS bytes to read / write for those steps
        os_write: list[Any] = [0] * n
        # INTER_GPU bytes per rank (p > 1): (p-1) chunks per all-gather of an arriving comm group and
        # per reduce-scatter of its grads (materialize's collectives, planner.emit: (ws-1) x chunk bytes)
        inter_gpu: list[Any] = [0] * n
        peers = d.ranks - 1
        coll_rate = min((r for r in (d.collective_intra_bytes_per_s, d.collective_inter_bytes_per_s) if r > 0), default=0.0)
        for gi, g in enumerate(d.chunk_classes):
            # the node's SSDs and CPU optimizer serve its ranks: per-node multipliers (1, 1 with one rank)
            fp, fo = node_factors(d, g)
            for i, gap in enumerate(self.gaps[gi]):
                for k, s in enumerate(gap.lookahead):
                    h2d[s] += self.incoming[gi][i][k] * g.param_bytes
                    if self.nvme_incoming[gi][i]:
                        nvme_read[s] += scaled(self.nvme_incoming[gi][i][k] * g.param_bytes, fp)
                    if gap.wraps and self.refresh[gi]:  # the kept chunks the CPU Adam rewrote, uploaded again
                        h2d[s] += self.refresh[gi][k] * g.param_bytes
                use = (gap.stages[-1] + 1) % n
                h2d[use] += self.on_demand[gi][i] * g.param_bytes
                on_demand[use] += self.on_demand[gi][i] * (g.param_bytes / d.h2d_bytes_per_s)
                if peers:
                    # every arriving comm group is all-gathered after its local chunk's fetch; the use of
                    # an on-demand one waits for its gather too; the kept ones of the wrap gap are
                    # gathered again after their owners' steps (emit: ALL_GATHER after the step)
                    for k, s in enumerate(gap.lookahead):
                        inter_gpu[s] += self.incoming[gi][i][k] * (g.param_bytes * peers)
                    inter_gpu[use] += self.on_demand[gi][i] * (g.param_bytes * peers)
                    if coll_rate > 0:
                        on_demand[use] += self.on_demand[gi][i] * (g.param_bytes * peers / coll_rate)
                    if gap.wraps and g.trainable:
                        inter_gpu[d.optimizer_stage] += self.keep[gi][i] * (g.param_bytes * peers)
                if not is_zero(self.nvme_on_demand[gi][i]):
                    nvme_read[use] += scaled(self.nvme_on_demand[gi][i] * g.param_bytes, fp)
                    on_demand[use] += self.nvme_on_demand[gi][i] * (g.param_bytes / rd)
            if not g.trainable:
                continue
            release = g.last_backward_stage if (d.optimizer_overlap and g.last_backward_stage >= 0) else d.optimizer_stage
            grads_at = g.last_backward_stage if g.last_backward_stage >= 0 else d.optimizer_stage
            streamed = self.os_stream[gi] + self.os_nvme_stream[gi]
            cpu_chunks = g.count - self.os_device[gi] - streamed
            d2h[grads_at] += (cpu_chunks + streamed) * g.param_bytes
            if peers:  # the comm group's grads reduce-scattered after its last backward use (PatrickStar §7)
                inter_gpu[grads_at] += g.count * g.param_bytes * peers
                # or per bucket (Note [reduce-scatter per bucket], planner/device_cache.py): a ring reduce of
                # each chunk's bytes into its owner in the stage it becomes final
                if g.bucket_final_chunks:
                    inter_gpu[grads_at] -= self.rs_bucket[gi] * (g.param_bytes * peers)
                    for k, n_final in enumerate(g.bucket_final_chunks):
                        if n_final:
                            inter_gpu[g.first_backward_stage + k] += self.rs_bucket[gi] * (g.param_bytes * n_final)
            # (PatrickStar §9.1: one node's CPU cores step all its ranks' chunks; the simulator's NVMe and
            # CPU servers are per node, planner.sim_state)
            cpu_released[release] += scaled(cpu_chunks * (g.elements * d.cpu_adam_seconds_per_element), fo)
            cpu_elements[release] += scaled(cpu_chunks * g.elements, fo)
            # streamed GPU Adam: OS, PARAM and GRAD up, OS and PARAM down, in the optimizer stage
            o = d.optimizer_stage
            h2d[o] += streamed * (g.os_bytes + 2 * g.param_bytes)
            d2h[o] += streamed * (g.os_bytes + g.param_bytes)
            compute[o] += streamed * (g.elements * d.gpu_adam_seconds_per_element)
            if peers:
                # a sharded DEVICE step (Note [sharded DEVICE steps]): the owner's PARAM chunk up from
                # HOST for the step and written back after it (emit: FETCH, OPTIMIZER_STEP, WRITE_BACK)
                h2d[o] += self.os_sharded[gi] * g.param_bytes
                d2h[o] += self.os_sharded[gi] * g.param_bytes
            # NVMe-streamed OS: read from and written back to the SSDs in the optimizer stage
            nvme_read[o] += scaled(self.os_nvme_stream[gi] * g.os_bytes, fo)
            nvme_write[o] += scaled(self.os_nvme_stream[gi] * g.os_bytes, fo)
            # NVMe-homed PARAM: read for the CPU step, written back after it
            os_read[release] += scaled(self.os_nvme[gi] * g.os_bytes, fo) + scaled(self.param_nvme[gi] * g.param_bytes, fp)
            os_write[release] += scaled(self.os_nvme[gi] * g.os_bytes, fo) + scaled(self.param_nvme[gi] * g.param_bytes, fp)
            compute[d.optimizer_stage] += self.os_device[gi] * (g.elements * d.gpu_adam_seconds_per_element)
        for bi, (b, choice) in enumerate(zip(d.blocks, self.act)):
            if b.forward_stage < 0 or b.backward_stage < 0:
                continue
            _, _, offload, reload = act_windows(b, n)
            swapped = choice[ActivationMode.SWAP_HOST] + choice[ActivationMode.SWAP_NVME]
            d2h[offload] += b.activation_bytes * swapped
            h2d[reload] += b.activation_bytes * swapped
            if not is_zero(self.ckpt_block[bi]):  # an offloaded checkpoint goes down and comes back
                d2h[offload] += b.input_bytes * self.ckpt_block[bi]
                h2d[reload] += b.input_bytes * self.ckpt_block[bi]
            nvme_write[offload] += scaled(b.activation_bytes * choice[ActivationMode.SWAP_NVME], d.ranks_per_node)
            nvme_read[reload] += scaled(b.activation_bytes * choice[ActivationMode.SWAP_NVME], d.ranks_per_node)
            compute[b.backward_stage] += b.recompute_seconds * choice[ActivationMode.RECOMPUTE]
        return {"INTER_GPU": inter_gpu, "H2D": h2d, "D2H": d2h, "NVME_READ": nvme_read, "NVME_WRITE": nvme_write, "COMPUTE": compute,
                "ON_DEMAND": on_demand,
                "CPU_RELEASED": cpu_released, "CPU_ELEMENTS": cpu_elements, "OS_READ": os_read, "OS_WRITE": os_write}

    def _add_time_constraints(self) -> None:
        d, n = self.data, len(self.data.stages)
        inf = self.solver.infinity()
        ch = self.channels = self._channel_exprs()
        nvme_rows = d.nvme_rows()
        for s in range(n):
            t = self.stage_time[s]
            self.solver.Add(t >= ch["COMPUTE"][s], f"time_compute[{s}]")
            if not is_zero(ch["ON_DEMAND"][s]):
                self.solver.Add(t >= ch["COMPUTE"][s] + ch["ON_DEMAND"][s], f"time_on_demand[{s}]")
            self.solver.Add(t >= ch["H2D"][s] * (1.0 / d.h2d_bytes_per_s), f"time_h2d[{s}]")
            self.solver.Add(t >= ch["D2H"][s] * (1.0 / d.d2h_bytes_per_s), f"time_d2h[{s}]")
            # both ways at once at the links.duplex_* rates: the least time of any overlap (costmodel.pcie_time_rows)
            for k, (a, b) in enumerate(d.pcie_time_rows):
                if a > 0 and b > 0:  # the one-way rows are the two above
                    self.solver.Add(t >= ch["H2D"][s] * a + ch["D2H"][s] * b, f"time_pcie_both_ways[{s},{k}]")
            for k, (a, b) in enumerate(nvme_rows):  # costmodel.nvme_time_rows: simplex, or mixed and the cap
                self.solver.Add(t >= ch["NVME_READ"][s] * a + ch["NVME_WRITE"][s] * b, f"time_nvme[{s},{k}]")
            if not is_zero(ch["INTER_GPU"][s]):
                # the collectives' own channel (the simulator's INTER_GPU server), its intra-node ring and
                # the node's NIC priced apart (Hardware.collective_seconds: the slower stage sets the time)
                if d.collective_intra_bytes_per_s > 0:
                    self.solver.Add(t >= ch["INTER_GPU"][s] * (1.0 / d.collective_intra_bytes_per_s), f"time_inter_gpu_intra[{s}]")
                if d.collective_inter_bytes_per_s > 0:
                    self.solver.Add(t >= ch["INTER_GPU"][s] * (1.0 / d.collective_inter_bytes_per_s), f"time_inter_gpu_inter[{s}]")
        self._add_late_arrival_rows()
        # The CPU optimizer (and the SSD traffic of its OS) is a queue: work released in stage s runs
        # in s or later, so every suffix of the iteration must be long enough for the work released
        # in it (the LP form of one machine with release times; Fuyou §4.3's overlap).
        self.suffix = [self.solver.NumVar(0, inf, f"suffix_time[{s}]") for s in range(n)]
        for s in range(n):
            later = self.suffix[s + 1] if s + 1 < n else 0
            self.solver.Add(self.suffix[s] == self.stage_time[s] + later, f"suffix[{s}]")
        cpu_tail: Any = 0
        nvme_tails: list[Any] = [0] * len(nvme_rows)  # per SSD time row
        cpu_tail_at: list[Any] = [0] * (n + 1)  # CPU work released at or after stage s
        lost = 1.0 - d.cpu_adam_beside_copies  # Note [CPU Adam beside copies, in the model]
        copy_tail: Any = 0  # copy time from stage s on
        for s in reversed(range(n)):
            if lost > 0:
                copy_tail = self._copy_tail(ch, nvme_rows, s, copy_tail)
            cpu_here = ch["CPU_RELEASED"][s]
            if not is_zero(cpu_here):
                v = self.solver.NumVar(0, inf, f"cpu_optimizer_tail[{s}]")  # running sums keep rows sparse
                self.solver.Add(v == cpu_tail + cpu_here, f"cpu_optimizer_tail_run[{s}]")
                cpu_tail = v
            for k, (a, b) in enumerate(nvme_rows):
                nvme_here = (ch["OS_READ"][s] + ch["NVME_READ"][s]) * a + (ch["OS_WRITE"][s] + ch["NVME_WRITE"][s]) * b
                if not is_zero(nvme_here):
                    v = self.solver.NumVar(0, inf, f"nvme_tail[{s},{k}]")
                    self.solver.Add(v == nvme_tails[k] + nvme_here, f"nvme_tail_run[{s},{k}]")
                    nvme_tails[k] = v
                if not is_zero(nvme_tails[k]):
                    self.solver.Add(self.suffix[s] >= nvme_tails[k], f"nvme_suffix[{s},{k}]")
            cpu_tail_at[s] = cpu_tail
            if is_zero(cpu_tail):
                continue
            self.solver.Add(self.suffix[s] >= cpu_tail + copy_tail * lost, f"cpu_optimizer_suffix[{s}]")
            for k in range(len(nvme_rows)) if lost > 0 else ():
                if not is_zero(nvme_tails[k]):
                    self.solver.Add(self.suffix[s] >= cpu_tail + nvme_tails[k] * lost, f"cpu_optimizer_suffix_nvme[{s},{k}]")
        if d.dram_bytes_per_s > 0:
            # host DRAM is shared (costmodel.dram_bytes): every PCIe / SSD byte passes it once per leg
            # and CPU Adam moves adam_dram_bytes_per_element per param; the iteration lasts at least
            # all of it / the bandwidth (one row: the CPU and SSD queues may run it in later stages)
            moved: Any = 0
            for s in range(n):
                moved += ch["H2D"][s] + ch["D2H"][s] + ch["NVME_READ"][s] + ch["NVME_WRITE"][s]
                moved += ch["OS_READ"][s] + ch["OS_WRITE"][s]
                moved += ch["CPU_RELEASED"][s] * (d.adam_dram_bytes_per_element / d.cpu_adam_seconds_per_element)
            if not is_zero(moved):
                if d.ranks_per_node > 1:  # the node's DRAM carries its q ranks' PCIe traffic (SSD, CPU: scaled above)
                    moved += sum(ch["H2D"][s] + ch["D2H"][s] for s in range(n)) * (d.ranks_per_node - 1)
                self.solver.Add(self.suffix[0] >= moved * (1.0 / d.dram_bytes_per_s), "time_host_dram")
        o = d.optimizer_stage
        trainable = [g for g in d.chunk_classes if g.trainable and g.elements > 0]
        bounded_host = self.capacity_variable is Tier.HOST or d.host_bytes < INFINITE_BYTES / BYTE_UNIT / 2
        if bounded_host and d.optimizer_overlap and trainable and not is_zero(cpu_tail_at[0]):
            # When the CPU optimizer falls behind backward, the grads of the steps it has not reached
            # wait on HOST when the optimizer stage starts: CPU work released in [s, o) minus the
            # time of [s, o), for the worst s, at the CPU's rate in grad bytes, in the HOST row of
            # the optimizer stage (the plain rows count a grad only in its release stage). One row
            # per release stage at the optimizer stage only: a backlog row per stage made the 175B
            # MIP time out; solve re-plans with less HOST where a paced schedule still runs out.
            self.cpu_lag = self.solver.NumVar(0, inf, "cpu_optimizer_lag")
            for s in range(o):
                if is_zero(cpu_tail_at[s]) or (s > 0 and cpu_tail_at[s] is cpu_tail_at[s - 1]):
                    continue
                self.solver.Add(self.cpu_lag >= (cpu_tail_at[s] - cpu_tail_at[o]) * (1.0 / d.cpu_adam_beside_copies)
                                - (self.suffix[s] - self.suffix[o]), f"cpu_optimizer_lag[{s}]")
            # (at the rate alone: the most grad bytes a second of lag can hold back)
            bytes_per_time = max(g.param_bytes / g.elements for g in trainable) / d.cpu_adam_seconds_per_element
            self.solver.Add(self._host_expr(o) + self.cpu_lag * bytes_per_time <= self._cap(Tier.HOST, d.host_bytes),
                            "host_memory_cpu_lag")
        if not d.optimizer_overlap:
            # Adam after backward: the optimizer stage alone carries the CPU step and its SSD traffic
            o = d.optimizer_stage
            self.solver.Add(self.stage_time[o] >= ch["CPU_RELEASED"][o], "time_cpu_optimizer")
            for k, (a, b) in enumerate(nvme_rows):
                self.solver.Add(self.stage_time[o] >= (ch["OS_READ"][o] + ch["NVME_READ"][o]) * a
                                + (ch["OS_WRITE"][o] + ch["NVME_WRITE"][o]) * b, f"time_nvme_optimizer[{k}]")

    def _copy_tail(self, ch: dict[str, list[Any]], nvme_rows, s: int, later: Any) -> Any:
        """The copy time from stage s on: stage s's busiest copy row plus `later` (a running sum)."""
        d, inf = self.data, self.solver.infinity()
        here = self.solver.NumVar(0, inf, f"copy_time[{s}]")
        rows = [(ch["H2D"][s], 1.0 / d.h2d_bytes_per_s, ch["D2H"][s], 0.0),
                (ch["H2D"][s], 0.0, ch["D2H"][s], 1.0 / d.d2h_bytes_per_s)]
        rows += [(ch["H2D"][s], a, ch["D2H"][s], b) for a, b in d.pcie_time_rows if a > 0 and b > 0]
        rows += [(ch["NVME_READ"][s], a, ch["NVME_WRITE"][s], b) for a, b in nvme_rows]
        for k, (x, a, y, b) in enumerate(rows):
            if not (is_zero(x) and is_zero(y)):
                self.solver.Add(here >= x * a + y * b, f"copy_time_row[{s},{k}]")
        tail = self.solver.NumVar(0, inf, f"copy_tail[{s}]")
        self.solver.Add(tail == later + here, f"copy_tail_run[{s}]")
        return tail

    # (Up to LATE_ARRIVAL_MAX_BLOCKS blocks: at 512 blocks x 4096 on a100-80g-12ssd the rows took the
    # solve from 50.4 to 70.7 s CPU, over issue 18's 60 s, for a true gap of 3.53% instead of 3.68%;
    # at 256 blocks 20.4 vs 18.1 s, 3.51% vs 3.65%; bench/bench_solve.py, 2-core box, 2026-11-24.)
    # Note [late arrivals]:
    # The DEVICE rows let chunks arriving in stage s for the next stage's use take their room at s's
    # last moment (`_device_rows`), and the H2D row lets their copy run through all of s. In the
    # simulator a copy that does not fit beside the stage's peak is issued only after the peak
    # moment's work (planner.device_cache.prefetch_early: the first tick with room), so it overlaps
    # only the work after the peak, and the next stage waits for the rest. Measured on GPT-3 175B x
    # rtx4090-768g-12ssd (bench/bench_stage_gap.py): every backward stage is one 0.375 s moment and a
    # zero-compute tail; the next block's 3 x 1.21 GB of PARAM arrive at the tail, 0.17 s of H2D the
    # model overlapped and the simulator serialized (96 stages, ~17 s of a 23.6 s model-vs-replay gap).
    # The row, per stage s with arrivals for s+1: late_s >= (those arrivals) - (capacity - M_s), where
    # M_s is a lower bound on what any replay holds on DEVICE at s's peak moment m* besides them (the
    # model's bytes of s without the arrivals, with the chunk classes used in s and the grads counted
    # only for the chunks m*'s own work needs: `StageData.peak_need_bytes`), so at least late_s of
    # them are issued after m*'s work; their copy at the fastest H2D rate then ends before the use
    # moment u of s+1, and the work from u on follows: T_s + T_{s+1} >= (compute of s up to m*) +
    # late_s / h2d + (compute of s+1 from u on). Every replay satisfies it (the bound stays a bound:
    # tests/test_solve.py replays every plan of a solve against it). One rank only (the multi-rank
    # model's DEVICE rows follow materialize's comm-group entries, and its bound is not used).
    def _add_late_arrival_rows(self) -> None:
        d, n = self.data, len(self.data.stages)
        if len(d.blocks) > LATE_ARRIVAL_MAX_BLOCKS:
            return
        if d.ranks > 1 or self.capacity_variable is Tier.DEVICE or not getattr(self, "with_late_arrivals", True):
            return
        arrivals: list[Any] = [0] * n  # PARAM bytes arriving in s for a use in s + 1
        after_use: list[float] = [float("inf")] * n  # least compute of s + 1 from such a use on
        for gi, g in enumerate(d.chunk_classes):
            if not g.use_tail_seconds:
                continue
            for i, gap in enumerate(self.gaps[gi]):
                if not gap.lookahead:
                    continue
                s = gap.lookahead[-1]
                use = gap.stages[-1] + 1
                if s != gap.stages[-1] or use >= n or use not in g.use_stages:
                    continue  # wraps the iteration: no row
                arrivals[s] += self.incoming[gi][i][-1] * g.param_bytes
                after_use[s] = min(after_use[s], g.use_tail_seconds[g.use_stages.index(use)])
        self.late_arrivals: dict[int, Any] = {}
        inf = self.solver.infinity()
        for s in range(n - 1):
            st = d.stages[s]
            if is_zero(arrivals[s]) or st.peak_compute_seconds < 0:
                continue
            held = (self._device_expr(s) - sum(self.arriving[s]) - self.use_bytes[s] - self.grad_bytes[s]
                    + st.peak_need_bytes)
            late = self.solver.NumVar(0, inf, f"late_arrivals[{s}]")
            self.solver.Add(late >= arrivals[s] - (d.device_bytes - held), f"late_arrivals_bytes[{s}]")
            self.solver.Add(self.stage_time[s] + self.stage_time[s + 1]
                            >= st.peak_compute_seconds + late * (1.0 / d.h2d_bytes_per_s) + after_use[s],
                            f"time_late_arrivals[{s}]")
            self.late_arrivals[s] = late

    def _add_objective(self) -> None:
        if self.capacity is not None:
            self.solver.Minimize(self.capacity)
            return
        # Among plans of equal time prefer the one that moves, recomputes and steps on the CPU least
        # (it is time the simulator and the executor cannot always hide). That work is at most
        # SECONDARY_TERMS x sum T_s, so the LP value / (1 + SECONDARY_TERMS x SECONDARY_WEIGHT) stays
        # a lower bound on sum T_s.
        d, ch = self.data, self.channels
        # the SSDs' work at the least coefficients of their time rows: never above a stage's SSD time
        rows = d.nvme_rows()
        ra, wb = min(a for a, _ in rows), min(b for _, b in rows)
        work = 0
        for s in range(len(d.stages)):
            work += ch["H2D"][s] * (1.0 / d.h2d_bytes_per_s) + ch["D2H"][s] * (1.0 / d.d2h_bytes_per_s)
            work += (ch["NVME_READ"][s] + ch["OS_READ"][s]) * ra + (ch["NVME_WRITE"][s] + ch["OS_WRITE"][s]) * wb
            work += ch["CPU_RELEASED"][s] + (ch["COMPUTE"][s] - d.stages[s].compute_seconds)
        self.secondary = work
        self.solver.Minimize(sum(self.stage_time) + SECONDARY_WEIGHT * work)


__all__ = ["TimeRows"]
