"""The stage-time predictor: a materialized schedule's stage times and totals by the cost model
(`planner.costmodel`), the `prediction` a schedule carries and the header's objective for the
baselines (see `predict_stages`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from planner.costmodel import (
    PAGEABLE_POLICIES,
    cpu_adam_threads,
    dram_bytes,
    dram_bytes_per_s,
    optimizer_step_price,
    transfer_seconds,
)
from planner.errors import InfeasibleError
from planner.problem import Problem
from planner.replay import ResidencyReplay
from schemas.schedule import ActivationMode, Channel, Op, Prediction, Schedule, Stage, Tier, action_channels
from schemas.trace import Phase


def predict_stages(problem: Problem, schedule: Schedule, deadlines: Sequence[int],
                   replay: ResidencyReplay) -> tuple[tuple[Stage, ...], Prediction]:
    """Stage times by the cost model and the iteration's totals.

    T_s = max(compute + recompute + GPU Adam, CPU Adam, H2D, D2H, NVMe reads + writes, inter-GPU)
    (Fuyou Eq. 2, 5). A transfer (and a CPU Adam step) counts in the stages between its issue and
    its deadline (a prefetch's first use; the end of the iteration for steps): each resource serves
    its queue in issue order during the stage, and what is still queued at a deadline lengthens
    the deadline's stage. Stage lengths are found in a few passes, each filling the resources into
    the lengths of the previous one.

    Prices as the simulator's (`planner.costmodel`): DEVICE <-> HOST copies of a system that stages
    through pageable memory at the pageable rates; H2D and D2H at the both-ways rates in a stage that
    issues both; CPU Adam at its rate with copies beside it when the schedule moves bytes over PCIe or
    the SSDs; host DRAM one more FIFO resource that every copy leg through host memory and every CPU
    Adam step draws on.
    """
    hw = problem.hardware
    stages = problem.stages
    n_stages = len(stages)
    base = [0.0] * n_stages  # the stage's work: compute, recompute, optimizer steps
    device_opt = [0.0] * n_stages
    cpu_opt = [0.0] * n_stages
    for st in stages:
        base[st.id] = sum(problem.moments[m].compute_seconds for m in range(st.first_moment, st.last_moment + 1))
    recompute_flops = 0
    for p in schedule.activation_plans:
        if p.mode is ActivationMode.RECOMPUTE:
            base[problem.stage_of_moment[problem.blocks[p.block].backward_moments[0]]] += p.recompute_seconds
            recompute_flops += p.recompute_flops
    totals: dict[Channel, int] = {}
    transfers: dict[str, list[tuple[int, int, float]]] = {}  # resource -> (release stage, deadline stage, seconds)
    pageable_policy = schedule.header.policy in PAGEABLE_POLICIES
    dram_rate = dram_bytes_per_s(hw)
    host_copies = any(a.bytes > 0 and any(ch is not Channel.INTER_GPU for ch in action_channels(a))
                      for a in schedule.actions if a.op is not Op.OPTIMIZER_STEP)
    channel_busy: dict[Channel, float] = {}
    issued: dict[int, set[Channel]] = {}  # stage -> the PCIe directions its actions use
    for a in schedule.actions:
        if a.op is not Op.OPTIMIZER_STEP:
            issued.setdefault(problem.stage_of_moment[a.moment], set()).update(action_channels(a))
    for a, deadline in zip(schedule.actions, deadlines):
        s = problem.stage_of_moment[a.moment]
        if a.op is Op.OPTIMIZER_STEP:
            params = schedule.layout.chunks[a.chunk].used_elements
            if a.dst is Tier.HOST:
                overlapped = problem.moments[a.moment].phase is not Phase.OPTIMIZER
                price = optimizer_step_price(hw, Tier.HOST, params, with_copies=host_copies,
                                             threads=cpu_adam_threads(hw, overlapped=overlapped))
                cpu_opt[s] += price.seconds
                if dram_rate < math.inf:
                    transfers.setdefault("DRAM", []).append((s, n_stages - 1, price.dram_bytes / dram_rate))
            else:
                device_opt[s] += optimizer_step_price(hw, Tier.DEVICE, params).seconds
            continue
        chans = action_channels(a)
        # DEVICE <-> HOST only: the NVMe path goes through pinned bounce buffers (costmodel.PAGEABLE_POLICIES)
        pageable = pageable_policy and bool(chans) and set(chans) <= {Channel.H2D, Channel.D2H}
        duplex = {Channel.H2D, Channel.D2H} <= issued.get(s, set())
        if dram_rate < math.inf and a.bytes > 0:
            transfers.setdefault("DRAM", []).append(
                (s, max(s, problem.stage_of_moment[deadline]), dram_bytes(hw, chans, a.bytes, pageable=pageable) / dram_rate))
        for ch in chans:
            totals[ch] = totals.get(ch, 0) + a.bytes
            seconds = transfer_seconds(hw, ch, a.bytes, pageable=pageable, duplex=duplex)
            channel_busy[ch] = channel_busy.get(ch, 0.0) + seconds
            if not math.isfinite(seconds):
                raise InfeasibleError(f"moment {a.moment}: {a.op.value} moves {a.bytes} bytes over {ch.value}, which "
                                      f"hardware {hw.name!r} does not have (no SSD, or one GPU); keep data off that path")
            resource = "NVME" if ch in (Channel.NVME_READ, Channel.NVME_WRITE) else ch.value
            transfers.setdefault(resource, []).append((s, max(s, problem.stage_of_moment[deadline]), seconds))
    for i, sec in enumerate(cpu_opt):
        if sec > 0:  # CPU Adam is a FIFO too: what a stage cannot hide runs on in later stages
            transfers.setdefault(Channel.CPU_OPTIMIZER.value, []).append((i, n_stages - 1, sec))
    # every resource works while the stage lasts, whichever resource makes it last: fill each one into
    # the stage lengths of the previous pass (the first pass: the device's work alone)
    work = [base[i] + device_opt[i] for i in range(n_stages)]
    seconds = list(work)
    for _ in range(_PASSES):
        room, seconds = seconds, list(work)
        for resource, items in sorted(transfers.items()):
            for i, busy in enumerate(_fifo_stage_seconds(items, room)):
                seconds[i] = max(seconds[i], busy)
    out = tuple(Stage(id=st.id, name=st.name, phase=st.phase, block=st.block, first_moment=st.first_moment,
                      last_moment=st.last_moment, predicted_seconds=seconds[st.id]) for st in stages)
    busy = {ch: channel_busy.get(ch, 0.0) for ch in totals}
    busy[Channel.COMPUTE] = sum(base) + sum(device_opt)
    busy[Channel.CPU_OPTIMIZER] = sum(cpu_opt)
    prediction = Prediction(
        iteration_seconds=sum(seconds),
        flops=problem.model_flops + recompute_flops,
        bytes_per_channel={ch: int(v) for ch, v in sorted(totals.items())},
        busy_seconds_per_channel=dict(sorted(busy.items())),
        peak_bytes_per_tier=replay.peak_bytes_per_tier,
    )
    return out, prediction


_PASSES = 3  # stage lengths settle in two or three passes


def _fifo_stage_seconds(items: list[tuple[int, int, float]], room: Sequence[float]) -> list[float]:
    """Busy seconds of one channel per stage. A channel serves its transfers in the order they are
    issued (a FIFO, like the executor's streams and the simulator), in the time each stage lasts;
    when a transfer is due (its deadline stage) it and everything queued before it must finish in
    that stage, which lengthens it."""
    by_release: dict[int, list[tuple[int, float]]] = {}
    for release, deadline, sec in items:
        by_release.setdefault(release, []).append((deadline, sec))
    queue: deque[list[float]] = deque()  # [deadline, remaining seconds], in issue order
    out = [0.0] * len(room)
    for s in range(len(room)):
        queue.extend([deadline, sec] for deadline, sec in by_release.get(s, ()))
        due = max((i for i, item in enumerate(queue) if item[0] <= s), default=-1)
        used = 0.0
        for _ in range(due + 1):  # forced: what is due and what is queued ahead of it
            used += queue.popleft()[1]
        while queue and used < room[s]:
            head = queue[0]
            take = min(head[1], room[s] - used)
            head[1] -= take
            used += take
            if head[1] <= 0.0:
                queue.popleft()
        out[s] = used
    return out


__all__ = ["predict_stages"]
