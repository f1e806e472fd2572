"""Discrete-event replay of a schedule on a hardware profile: the predictor and the schedule checker.

`simulate(schedule, hardware)` replays one iteration using only the schedule (its moments carry
compute seconds, FLOPs, non-model bytes and parameter tensors; its activation plans carry bytes and
recompute seconds) and returns a `SimResult`, or raises `ScheduleViolation` naming the moment, the
action index, the chunk list and the chunk of the first rule the schedule breaks. The rules follow
the action semantics of `schemas/schedule.py`; each sits beside its code as a Note:
Note [simulator time], Note [simulator memory per moment] and Note [simulator simplifications] here; Note [simulator ranks] and Note [simulator memory per rank and node] in
`planner/sim_state.py`; Note [simulator channels], Note [two-way links in the simulator], Note [CPU Adam
beside copies], Note [simulator evictions] and Note [simulator validity] in `planner/sim_actions.py`.
"""

from __future__ import annotations

from schemas import Hardware, Schedule
from schemas.schedule import TIER_INDEX, TIERS, ActivationMode, Channel, ChunkList, Op, SolverStatus
from schemas.trace import Phase

from planner.errors import PlannerError
from planner.sim_result import Interval, MemorySample, ScheduleViolation, SimResult, ViolationKind
from planner.sim_state import (
    DEVICE_INDEX,
    HOST_INDEX,
    NVME_INDEX,
    ActState,
    block_states,
    busiest,
    hold,
    land,
    land_oldest,
    landing_bytes,
    place_name,
    setup,
    used_bytes,
)
from planner.sim_actions import apply_action, blocks_host, check_end

# ----------------------------------------------------------------------------- simulate


# Note [simulator time]:
# Moment m's event happens when moment m-1's work ends (moment 0 at t=0). Its actions are
# issued then, in list order. Each channel is a FIFO server: an action starts when it is issued,
# the channel is free, and its inputs are ready, and lasts bytes / bandwidth. Moment m's work
# (on COMPUTE) starts after the previous work, after every FETCH of moment m (and, for a policy
# staging through pageable memory, every DEVICE <-> HOST copy of moment m: `blocks_host`), after every chunk
# its tensors need is on DEVICE (an earlier PREFETCH may still be in flight), and after the
# activations of a block whose backward starts at m are back on DEVICE, and after the training thread
# got past the moment's actions (an ACT_RELOAD, or an allocation that needs DEVICE bytes a copy still
# reads, waits: Note [simulator evictions]; later actions of the moment are issued then); it lasts the moment's
# compute seconds plus, at the first backward moment of a RECOMPUTE block, its recompute seconds.
# The time the work waits past its event is a stall. The iteration ends when the last work and the
# last transfer or optimizer step are done.
#
# Note [simulator simplifications]:
# Simplifications (documented so nobody mistakes them for physics): one iteration in isolation (the
# next iteration's first fetches do not overlap this one's tail), the CPU thread issues actions
# instantly (but for the waits the executor makes, above), collectives cost `Hardware.collective_seconds`, staging buffers in HOST for NVMe copies
# are not counted, a copy runs at its rate alone and a two-way link's (or DRAM's) shared time goes to
# the transfer placed first (Calendars: not re-shared as other traffic comes and goes; the totals are
# the link's, Note [two-way links in the simulator]), a CPU Adam step slowed by a copy issued after it
# keeps its own end and its node's CPU optimizer makes up the work lost before its next step, at the
# with-copies rate where copies still run (Note [CPU Adam beside copies] in planner/sim_actions.py), an allocation that needs DEVICE bytes still read by a copy
# in flight waits for all such copies after it was placed, not before (Note [simulator evictions] in
# planner/sim_actions.py).


def simulate(schedule: Schedule, hardware: Hardware) -> SimResult:
    """Replay one iteration of `schedule` on `hardware`; raise ScheduleViolation on any broken rule."""
    if schedule.header.solver_status is SolverStatus.INFEASIBLE:
        raise PlannerError(f"schedule of policy {schedule.header.policy!r} is INFEASIBLE "
                           f"({'; '.join(schedule.header.notes) or 'no notes'}): there is nothing to replay")
    sim = setup(schedule, hardware)
    moments = schedule.moments
    n_moments = len(moments)
    layout = schedule.layout
    tensor_chunk = {t.tensor: t.chunk for t in layout.tensors}
    trainable = {t.tensor for t in layout.tensors if t.trainable}
    pi = sim.list_index[ChunkList.PARAM]
    gi = sim.list_index.get(ChunkList.GRAD)

    # chunks each moment's work needs on DEVICE, and the last backward moment writing each GRAD chunk
    needs: list[tuple[int, ...]] = []
    writes: list[tuple[int, ...]] = []
    last_grad_write = [-1] * len(layout.chunks)
    for m in moments:
        if m.phase is Phase.OPTIMIZER:
            needs.append(())
            writes.append(())
            continue
        chunks = sorted({tensor_chunk[t] for t in m.tensors if t in tensor_chunk})
        needs.append(tuple(chunks))
        if m.phase is Phase.BACKWARD and gi is not None:
            w = tuple(sorted({tensor_chunk[t] for t in m.tensors if t in trainable and t in tensor_chunk}))
            writes.append(w)
            for c in w:
                last_grad_write[c] = m.id
        else:
            writes.append(())

    blocks = block_states(schedule)
    # blocks whose held window contains moment m: fwd_last <= m < bwd_first
    window_start: dict[int, list[int]] = {}
    window_end: dict[int, list[int]] = {}
    bwd_first_of: dict[int, int] = {}
    for b, blk in enumerate(blocks):
        if blk.fwd_last >= 0 and blk.bwd_first > blk.fwd_last:
            window_start.setdefault(blk.fwd_last, []).append(b)
            window_end.setdefault(blk.bwd_first, []).append(b)
            bwd_first_of[blk.bwd_first] = b

    actions = schedule.actions
    by_moment: list[list[int]] = [[] for _ in range(n_moments)]
    for i, a in enumerate(actions):
        by_moment[a.moment].append(i)

    budgets = {DEVICE_INDEX: schedule.budgets.device_bytes, HOST_INDEX: schedule.budgets.host_bytes,
               NVME_INDEX: schedule.budgets.nvme_bytes}
    device_budget = budgets[DEVICE_INDEX]
    act_reload, fetch = Op.ACT_RELOAD, Op.FETCH  # (an enum member is an attribute lookup: once, not per action)
    act_bytes = [0, 0, 0]  # activation bytes per tier (DEVICE: held-window part only)
    held_act_recorded = 0  # bytes of kept activations the recorded non-model curve includes right now
    peaks = [0, 0, 0]
    memory: list[MemorySample] = []
    starts: list[float] = []
    stall = 0.0
    compute_busy = 0.0
    world = schedule.header.world_size
    computes = [sim.servers[(Channel.COMPUTE, r)] for r in range(world)]
    event = 0.0
    flops = sum(m.flops for m in moments)
    recompute_flops = 0

    for m_ref in moments:
        m = m_ref.id
        # blocks entering their held window now: their activations are on DEVICE (recorded curve)
        for b in window_start.get(m, ()):
            blk = blocks[b]
            blk.state = ActState.ON_DEVICE
            held_act_recorded += blk.bytes
            act_bytes[DEVICE_INDEX] += blk.device_bytes()
        deps = event
        host = event  # the training thread: it waits in an ACT_RELOAD, or for DEVICE bytes still read (Note [simulator evictions])
        for i in by_moment[m]:
            a = actions[i]
            if a.op is act_reload and 0 <= a.block < len(blocks) and blocks[a.block].state is ActState.OFFLOADED:
                host = max(host, blocks[a.block].ready_at)  # the executor's wait_offloaded
            land(sim, host)
            end = apply_action(sim, a, i, host, blocks, act_bytes, last_grad_write)
            if a.op is fetch or (sim.pageable and blocks_host(a)):
                deps = max(deps, end)
            on_device = used_bytes(sim, DEVICE_INDEX, act_bytes)
            if sim.landing and on_device > device_budget:  # the allocation waits for copies in flight
                host = land_oldest(sim, host, lambda: used_bytes(sim, DEVICE_INDEX, act_bytes) <= device_budget)
                on_device = used_bytes(sim, DEVICE_INDEX, act_bytes)
            # the peak counts what a moment holds between its actions too, as the executor's pools do (the grads a
            # moment writes back to HOST and steps there before evicting them: `executor demo`'s HOST peak was
            # measured 851,968 B over the per-moment prediction, four GRAD chunks of moment 20); a peak never exceeds
            # its budget (both checks raise first), so only bytes above the peak can be above the budget
            for t, used in ((DEVICE_INDEX, on_device), (HOST_INDEX, used_bytes(sim, HOST_INDEX, act_bytes)),
                            (NVME_INDEX, used_bytes(sim, NVME_INDEX, act_bytes))):
                if used > peaks[t]:
                    peaks[t] = used
                    if used > budgets[t]:
                        raise ScheduleViolation(ViolationKind.CAPACITY, f"{TIERS[t].value} holds {used} bytes of chunks "
                                                f"and activations after this action, budget {budgets[t]}"
                                                f"{place_name(sim, t, busiest(sim, t))}", moment=m, action_index=i,
                                                list_=a.list, chunk=a.chunk if a.chunk >= 0 else None)

        # blocks leaving it (after the moment's actions, which may reload them): their backward starts
        for b in window_end.get(m, ()):
            blk = blocks[b]
            if blk.state is ActState.OFFLOADED:
                raise ScheduleViolation(ViolationKind.ACTIVATIONS, f"block {b}'s backward starts but its activations "
                                        f"({blk.bytes} bytes) are still on {blk.tier.value}; reload them first",
                                        moment=m, block=b)
            held_act_recorded -= blk.bytes
            act_bytes[DEVICE_INDEX] -= blk.device_bytes()
            blk.state = ActState.CONSUMED

        deps = max(deps, host)
        # the work: its chunks on DEVICE (and arrived), its block's activations back
        for c in needs[m]:
            if not sim.copies.is_valid(pi, c, DEVICE_INDEX):
                raise ScheduleViolation(ViolationKind.USE_BEFORE_ARRIVAL,
                                        f"the work of {m_ref.kind.value} {m_ref.module or '(root)'} needs PARAM chunk {c} "
                                        "on DEVICE and no valid copy is there", moment=m, list_=ChunkList.PARAM, chunk=c)
            deps = max(deps, sim.ready[pi][c][DEVICE_INDEX])
        for c in writes[m]:
            if not sim.copies.is_valid(gi, c, DEVICE_INDEX):
                raise ScheduleViolation(ViolationKind.USE_BEFORE_ARRIVAL,
                                        f"the backward work of {m_ref.module or '(root)'} accumulates GRAD chunk {c} "
                                        "on DEVICE and no valid copy is there (ALLOCATE or fetch it first)",
                                        moment=m, list_=ChunkList.GRAD, chunk=c)
            deps = max(deps, sim.ready[gi][c][DEVICE_INDEX])
        extra = 0.0
        if m in bwd_first_of:
            blk = blocks[bwd_first_of[m]]
            deps = max(deps, blk.ready_at)
            if blk.plan_mode is ActivationMode.RECOMPUTE:
                extra = blk.recompute_seconds
                recompute_flops += blk.recompute_flops

        recorded_nm = m_ref.non_model_bytes
        non_model = max(0, recorded_nm - held_act_recorded)
        if sim.landing:  # the work's own allocations wait for the copies in flight when it needs their bytes
            land(sim, max(deps, host))
            deps = max(deps, land_oldest(sim, max(deps, host),
                                         lambda: used_bytes(sim, DEVICE_INDEX, act_bytes) + non_model <= budgets[DEVICE_INDEX]))
        start = max(deps, *(c.free_at for c in computes))
        land(sim, start)
        stall += max(0.0, deps - event)
        duration = m_ref.compute_seconds + extra
        end = start + duration
        for c in computes:  # every rank runs the same work (SPMD)
            c.free_at = end
        compute_busy += duration
        if duration > 0:
            sim.timeline.append(Interval(channel=Channel.COMPUTE, start_seconds=start, end_seconds=end,
                                         label=f"{m_ref.phase.value.lower()} {m_ref.module or '(root)'}"))
        starts.append(start)
        for c in writes[m]:
            if sim.world > 1:
                hold(sim, gi, c, DEVICE_INDEX, everywhere=True)  # every rank accumulates its own grads
            # DEVICE only: copies elsewhere are stale now (the last write of a chunk whose grad lives in its
            # param's slot also makes its DEVICE PARAM copy stale: schemas.residency)
            sim.copies.write_grads(c, final=m == last_grad_write[c])
            sim.ready[gi][c][DEVICE_INDEX] = end

        # Note [simulator memory per moment]:
        # Per moment, after its actions: DEVICE = chunks held + non-model bytes + activations;
        # HOST and NVME = chunks held + activations swapped there. The trace's non-model bytes are recorded
        # with every block's activations kept, so between a block's last forward moment and its first
        # backward moment the simulator subtracts what the activation plan moved away: a RECOMPUTE block
        # keeps only its input bytes, a swapped block holds nothing on DEVICE while offloaded.
        # ACT_OFFLOAD / ACT_RELOAD of a RECOMPUTE block move its kept input (the checkpoint) to HOST or NVME
        # and back: how ZeRO-Infinity and Fuyou keep activation checkpoints off the GPU (Fuyou §2.2, §4.5).
        # Capacity is checked against `schedule.budgets` per moment (and, without the non-model bytes,
        # after every action, because the executor's store allocates as it goes).

        for t in TIER_INDEX.values():
            place = busiest(sim, t)
            chunk_b = {lst: sim.place_bytes[t][place][li] for li, lst in enumerate(sim.lists)}
            nm = non_model if t == DEVICE_INDEX else 0
            acts = act_bytes[t] + landing_bytes(sim, place) if t == DEVICE_INDEX else act_bytes[t] * sim.ranks_in_node[place]
            total = sum(chunk_b.values()) + acts + nm
            if total > budgets[t]:
                raise ScheduleViolation(ViolationKind.CAPACITY,
                                        f"{TIERS[t].value} needs {total} bytes during the work of "
                                        f"{m_ref.kind.value} {m_ref.module or '(root)'} (chunks {sum(chunk_b.values())}, "
                                        f"activations {acts}, non-model {nm}), budget {budgets[t]}"
                                        f"{place_name(sim, t, place)}", moment=m)
            peaks[t] = max(peaks[t], total)
            memory.append(MemorySample(moment=m, tier=TIERS[t], non_model_bytes=nm, activation_bytes=acts,
                                       chunk_bytes=chunk_b))
        event = end

    check_end(sim, schedule, last_grad_write, n_moments)
    iteration = max(event, sim.last_end, *(s.free_at for s in sim.servers.values()))
    busy = {ch: sim.busy.get(ch, 0.0) for ch in Channel}
    busy[Channel.COMPUTE] += compute_busy
    return SimResult(
        iteration_seconds=iteration,
        tflops=world * flops / iteration / 1e12 if iteration > 0 else 0.0,  # every rank does this work
        flops=flops,
        recompute_flops=recompute_flops,
        bytes_per_channel={ch: sim.bytes_per_channel.get(ch, 0) for ch in Channel},
        busy_seconds_per_channel=busy,
        peak_bytes_per_tier={TIERS[t]: peaks[t] for t in TIER_INDEX.values()},
        stall_seconds=stall,
        compute_seconds=compute_busy,
        moment_start_seconds=tuple(starts),
        memory=tuple(memory),
        timeline=tuple(sorted(sim.timeline, key=lambda i: (i.start_seconds, i.channel))),  # a StrEnum: by its value
    )


__all__ = ["Interval", "MemorySample", "ScheduleViolation", "SimResult", "ViolationKind", "simulate"]
