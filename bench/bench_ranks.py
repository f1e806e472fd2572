"""The rank ladder (issue 18 item 2/4): tide and the multi-GPU baselines on 1, 2, 4, 8, 16 ranks.

    python bench/bench_ranks.py [--trace traces/pstar-gpt-4b.msgpack] [--ranks 1,2,4,8,16]
                                [--hardware v100-32g-240g-2x8gpu]

One rank runs on one node; r >= 2 ranks on 2 nodes of r/2 GPUs (the preset's node: PatrickStar §9.1's
V100 node, its host memory and CPU shared by the node's ranks, one 100 Gb/s NIC per node), so the
ladder's top rung is the preset itself (2 x 8). For each rung: wall seconds of tide's solve (layout
candidates, LPs, MIPs, the reference decision sets, materialize + simulate), tide's simulated iteration
seconds, the winning plan (the MIP's or a replayed reference decision set), the best baseline and
tide / best baseline (its iteration seconds over tide's: > 1 is tide faster). CPU timings on a shared
machine: noisy, ratios from one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.compare import TIDE, compare  # noqa: E402
from planner.policies import POLICIES  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from schemas import Hardware, Trace  # noqa: E402
from schemas._base import digest_bytes, read_bytes  # noqa: E402

MULTI_GPU = [p for p in POLICIES if p != "fuyou"]  # Fuyou is single-GPU (FY.10)


def rung(hardware: Hardware, ranks: int) -> Hardware:
    """The preset with `ranks` ranks: one node for 1, else 2 nodes of ranks / 2."""
    per_node = 1 if ranks == 1 else ranks // 2
    cluster = dataclasses.replace(hardware.cluster, world_size=ranks, gpus_per_node=per_node)
    return dataclasses.replace(hardware, name=f"{hardware.name}@{ranks}", cluster=cluster)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(REPO / "traces" / "pstar-gpt-4b.msgpack"))
    parser.add_argument("--ranks", default="1,2,4,8,16")
    parser.add_argument("--hardware", default="v100-32g-240g-2x8gpu")
    args = parser.parse_args()
    raw = read_bytes("trace", args.trace)
    trace, digest = Trace.from_msgpack(raw, source=args.trace), digest_bytes(raw)
    base = resolve_hardware(args.hardware)
    print(f"{trace.meta.model_name} on {base.name} rungs; tide / best = best baseline's iteration s / tide's")
    print(f"{'ranks':>5} {'nodes':>5} {'solve s':>8} {'tide it s':>10} {'winner':<44} {'best baseline':<22} {'tide/best':>9}")
    for ranks in (int(r) for r in args.ranks.split(",")):
        hw = rung(base, ranks)
        start = time.perf_counter()
        mine = compare(trace, hw, trace_digest=digest, policies=[TIDE])
        solve_s = time.perf_counter() - start
        theirs = compare(trace, hw, trace_digest=digest, policies=MULTI_GPU if ranks > 1 else list(POLICIES))
        tide = mine.rows[0]
        ok = [r for r in theirs.rows if r.result is not None]
        best = min(ok, key=lambda r: r.result.iteration_seconds, default=None)
        if tide.result is None:
            winner, tide_s = f"infeasible: {tide.reason[:36]}", "-"
        else:
            chosen = next((n for n in tide.schedule.header.notes if n.startswith("chosen: ")), "chosen: ?")
            winner = chosen.removeprefix("chosen: ").split(" (simulated")[0]  # the MIP's plan or a reference set
            winner, tide_s = winner[:44], f"{tide.result.iteration_seconds:.3f}"
        best_txt = f"{best.policy} {best.result.iteration_seconds:.3f}" if best else "none feasible"
        ratio = (f"{best.result.iteration_seconds / tide.result.iteration_seconds:.2f}x"
                 if best and tide.result is not None else "-")
        print(f"{ranks:>5} {hw.cluster.nodes:>5} {solve_s:>8.1f} {tide_s:>10} {winner:<44} {best_txt:<22} {ratio:>9}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
