"""Several nodes in the planner (issue 18 item 2): the hardware format's NIC, collectives priced intra-
vs inter-node, per-node CPU optimizer, the 2 x 8 V100 preset through `compare`."""

from __future__ import annotations

import pytest

from conftest import TRACES
from planner.compare import TIDE, compare
from planner.policies import baseline
from planner.presets import resolve_hardware
from planner.problem import build_problem
from planner.simulate import simulate
from schemas import Trace
from schemas._base import FormatError
from schemas.schedule import Channel
from test_distributed import DIGEST
from test_executor_nodes import WORLD, cluster, schedule_for


def test_two_nodes_price_collectives_over_the_nic(tmp_path) -> None:
    """Same bytes per rank on one node or two; the NIC stage makes the collectives slower."""
    one_node = cluster(tmp_path, gpus_per_node=WORLD)
    two_nodes = cluster(tmp_path)
    assert (one_node.cluster.nodes, two_nodes.cluster.nodes) == (1, 2)
    per_rank = 3 * 1_000_000  # (p-1) x 1 MB
    assert one_node.collective_seconds(per_rank) == pytest.approx(per_rank / 1e9)  # (p-1)/p S / intra
    # max((q-1)/q S / intra, (N-1)/N S / nic) = max(0.5 x 4 MB / 1 GB/s, 0.5 x 4 MB / 0.5 GB/s)
    assert two_nodes.collective_seconds(per_rank) == pytest.approx(4e-3)
    s1, s2 = schedule_for(one_node), schedule_for(two_nodes)
    assert s2.prediction.bytes_per_channel[Channel.INTER_GPU] == s1.prediction.bytes_per_channel[Channel.INTER_GPU] > 0
    r1, r2 = simulate(s1, one_node), simulate(s2, two_nodes)
    assert r2.busy_seconds_per_channel[Channel.INTER_GPU] == pytest.approx(4 / 3 * r1.busy_seconds_per_channel[Channel.INTER_GPU])  # 4e-3 / 3e-3, as above


def test_more_ranks_than_a_node_needs_a_nic(tmp_path) -> None:
    with pytest.raises(FormatError, match="links.inter_node_gb_per_s: .*positive NIC bandwidth"):
        cluster(tmp_path, inter_node_gb_per_s=0.0)




def test_each_node_steps_its_ranks_on_its_own_cpu() -> None:
    """ZeRO-2-Offload's CPU Adam on 2 x 8 V100: the two nodes' CPUs step at once; on one node of 8
    the node's one CPU steps its ranks' partitions one after another."""
    trace = Trace.read(TRACES / "pstar-gpt-1b.msgpack")
    overlaps = {}
    for name in ("v100-32g-240g-2x8gpu", "v100-32g-240g-8gpu"):
        hw = resolve_hardware(name)
        result = simulate(baseline("zero2-offload", build_problem(trace, hw, trace_digest=DIGEST)), hw)
        steps = sorted((i.start_seconds, i.end_seconds) for i in result.timeline if i.channel is Channel.CPU_OPTIMIZER)
        overlaps[name] = sum(1 for a, b in zip(steps, steps[1:]) if b[0] < a[1])
    assert overlaps["v100-32g-240g-8gpu"] == 0 < overlaps["v100-32g-240g-2x8gpu"]


def test_preset_two_nodes_of_eight() -> None:
    hw = resolve_hardware("v100-32g-240g-2x8gpu")
    assert (hw.cluster.world_size, hw.cluster.nodes, hw.cluster.ranks_per_node) == (16, 2, 8)
    # the 12.5 GB/s NIC, not NVLink, sets a 2-node collective's time: (N-1)/N S / nic
    assert hw.collective_seconds(15e9) == pytest.approx(0.5 * 16e9 / 12.5e9)
    one = resolve_hardware("v100-32g-240g-8gpu")
    assert one.inter_gpu_bytes_per_s == 130e9 and one.links.inter_node_gb_per_s == 0


def test_compare_has_a_row_per_multi_node_policy_on_two_nodes() -> None:
    trace = Trace.read(TRACES / "gpt-small.msgpack")  # small: tide's solve is most of the time
    hw = resolve_hardware("v100-32g-240g-2x8gpu")
    c = compare(trace, hw, trace_digest=DIGEST, policies=[TIDE, "zero3-offload", "gemini", "patrickstar"])
    assert c.world_size == 16 and [r.policy for r in c.rows] == [TIDE, "zero3-offload", "gemini", "patrickstar"]
    assert all(r.feasible for r in c.rows), [r.reason for r in c.rows]
