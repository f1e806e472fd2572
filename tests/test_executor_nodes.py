"""Several nodes (issue 18 item 2): the engine under `torchrun --nnodes 2`, 2 nodes x 2 gloo processes.

Two torchrun launchers on this machine, `--node-rank 0` and `--node-rank 1`, meet by static
rendezvous at 127.0.0.1:PORT and run `tests/dist_scripts/train_engine.py` (the 2-rank script of
tests/test_executor_distributed.py, which reads the world size from torch.distributed) on a
world_size=4 schedule planned for a cpu-emulated cluster of 2 nodes x 2 ranks. The ranks train like
one process on the global batch (fp32, <= 1e-6 relative) and every rank's INTER_GPU bytes per
iteration equal the schedule's prediction (collectives are counted per rank: (p-1) x capacity per
gather or reduce-scatter, wherever the peers are).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from conftest import HARDWARE, REPO, TRACES
from executor import state
from executor.models import build_model, model_spec
from planner.layout import build_layout
from planner.materialize import materialize, uniform_decisions
from planner.problem import build_problem
from schemas import Trace
from schemas.hardware import Hardware
from schemas.schedule import Channel, Op, Schedule
from test_distributed import CHUNK_ELEMENTS, DIGEST, max_relative, needs_gloo
from test_executor_distributed import plain_accumulated

SCRIPT = REPO / "tests" / "dist_scripts" / "train_engine.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
STEPS, SAVE_AT = 4, 2
DEVICE_BYTES = 14_000_000  # as test_distributed: block params leave DEVICE after forward and are gathered again
# Adam eps as test_executor_distributed's accumulate phase. 4 ranks sum their grads in gloo's order, one
# process in its own: ~1e-7 relative apart, which the default eps 1e-8 turns into +-lr steps on the
# elements whose true grad is zero (the attention key biases: 7e-4 relative on c_attn.bias after 4
# steps, measured here); with 1e-3 the update depends on the grads' scale and the runs stay <= 1e-6.
EPS = 1e-3


def cluster(tmp_path: Path, *, inter_node_gb_per_s: float = 0.5, gpus_per_node: int = PER_NODE) -> Hardware:
    """cpu-emulated as `WORLD` ranks on nodes of `gpus_per_node`, an intra-node link of 1 GB/s."""
    text = (HARDWARE / "cpu-emulated.toml").read_text()
    text = text.replace("inter_gpu_gb_per_s = 0.0", f"inter_gpu_gb_per_s = 1.0\ninter_node_gb_per_s = {inter_node_gb_per_s}")
    text = text.replace("world_size = 1", f"world_size = {WORLD}").replace("gpus_per_node = 1", f"gpus_per_node = {gpus_per_node}")
    path = tmp_path / f"cpu-emulated-{WORLD}x{gpus_per_node}-{inter_node_gb_per_s}.toml"
    path.write_text(text)
    return Hardware.read(path)


def schedule_for(hardware: Hardware) -> Schedule:
    """The even comm groups reduce-scattered per bucket
    (Note [reduce-scatter per bucket] in planner/device_cache.py), the odd ones once per group."""
    trace = Trace.read(TRACES / "gpt-small.msgpack")  # one process's trace = one rank's share
    trace = dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, world_size=WORLD))
    problem = build_problem(trace, hardware, trace_digest=DIGEST, device_bytes=DEVICE_BYTES)
    layout = build_layout(problem, chunk_elements=CHUNK_ELEMENTS)
    even = frozenset(range(0, len(layout.chunks) // WORLD, 2))
    return materialize(problem, dataclasses.replace(uniform_decisions(problem, layout), reduce_scatter_buckets=even))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_gloo
def test_two_nodes_of_two_ranks_train_like_one_process(tmp_path) -> None:
    schedule = schedule_for(cluster(tmp_path))
    scatters = [a for a in schedule.actions if a.op is Op.REDUCE_SCATTER]
    assert any(a.bucket for a in scatters) and any(not a.bucket for a in scatters)  # both kinds replayed
    # comm group 0 (2 of 4 chunks hold params) is also gathered chunk by chunk (planner.emit `gather_per_chunk`)
    assert any(a.op is Op.ALL_GATHER and a.bucket for a in schedule.actions)
    schedule.write(tmp_path / "schedule.msgpack")
    init = build_model(model_spec("gpt-small"), seed=0).state_dict()
    torch.save({"format": state.CHECKPOINT_FORMAT, "model": init}, tmp_path / "init.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    port = _free_port()
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT),
         "--schedule", str(tmp_path / "schedule.msgpack"), "--init", str(tmp_path / "init.pt"),
         "--out", str(tmp_path), "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--eps", str(EPS)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in range(NODES)]
    outputs = []
    try:
        for p in launchers:
            outputs.append(p.communicate(timeout=150)[0])
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    # one process, the global batch as WORLD accumulated parts (each loss / WORLD), fused AdamW
    reference, _ = plain_accumulated(init, range(STEPS), parts=WORLD, eps=EPS, clip=float("inf"))
    got = state.load(tmp_path / "final.pt")["model"]
    assert max_relative(got, reference.state_dict()) <= 1e-6
    assert max_relative(got, init) > 1e-3  # it trained
    predicted = schedule.prediction.bytes_per_channel[Channel.INTER_GPU]
    for rank in range(WORLD):
        stats = json.loads((tmp_path / f"stats_rank{rank}.json").read_text())
        assert stats["world_size"] == WORLD
        assert [it["bytes_per_channel"].get(Channel.INTER_GPU.value, 0) for it in stats["iterations"]] == [predicted] * STEPS
