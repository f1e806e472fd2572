"""Several GPUs (issue 9 item 3): tide and the multi-GPU baselines on PatrickStar's 8-GPU node, side by side,
the bytes between GPUs against PatrickStar §7's formula, and the simulator next to PatrickStar's 8-GPU figures.

    python bench/bench_compare_multi.py                 # the four shipped traces, all policies
    python bench/bench_compare_multi.py --no-tide       # baselines only (seconds instead of minutes)
    python bench/bench_compare_multi.py --traces gpt3-1.3b pstar-gpt-4b

Each shipped trace was recorded by one process: on `v100-32g-240g-8gpu` it is one rank's work in
data parallel (per-rank batch = the trace's batch; 8 ranks; 240 GB of host memory shared by them).

Published (PatrickStar, papers/000 §9.2, 8x V100 32 GB, 240 GB host; their batch per GPU is the best
of 4..64, ours is the trace's):
  - Table 3, max model scale on 8 GPUs: PyTorch DDP 1B, DeepSpeed-DP (ZeRO-Offload) 4B, PatrickStar 12B;
  - §9.2.3: 377 TFLOPS for the 12B model on 8 GPUs (all GPUs together);
  - Table 4, speedup of 8 GPUs over 1: 4B 8.32x, 12B 11.18x (superlinear: PCIe traffic moves to NVLink).
The simulator is NOT tuned to them; the differences are explained in the report.
Every `planner.policies` system is a row, the Angel-PTM-like baseline (`angel`, papers/004 §4) included; its own
testbed's figure (Table 5: 55B on 8x A100 40 GB) is `angel-ptm` in bench/published.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.policies import POLICIES, baseline  # noqa: E402
from planner.compare import TIDE, compare, print_comparison  # noqa: E402
from planner.errors import InfeasibleError  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from planner.problem import build_problem  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from schemas import Trace  # noqa: E402
from schemas._base import digest_bytes, read_bytes  # noqa: E402
from schemas.schedule import Channel, ChunkList  # noqa: E402

PRESET = "v100-32g-240g-8gpu"
ONE_GPU = "v100-32g-240g"
TRACES = ("gpt3-1.3b", "pstar-gpt-4b", "pstar-gpt-12b", "gpt3-13b")
GB = 1e9
# PatrickStar §9.2: Table 3 (8 GPUs), §9.2.3 and Table 4
PUBLISHED_MAX_SCALE_8GPU = {"pytorch": "1B", "zero2-offload": "4B", "patrickstar": "12B"}
PUBLISHED_TFLOPS_8GPU = {"pstar-gpt-12b": 377.0}
PUBLISHED_SPEEDUP_8_OVER_1 = {"pstar-gpt-4b": 8.32, "pstar-gpt-12b": 11.18}


def load(name: str) -> tuple[Trace, str]:
    path = REPO / "traces" / f"{name}.msgpack"
    payload = read_bytes("trace", path)
    return Trace.from_msgpack(payload, source=str(path)), digest_bytes(payload)


def collective_check(comparison, trace: Trace, world: int) -> list[str]:
    """INTER_GPU bytes per rank of each feasible row against 6 (p-1)/p x M (fp16; 3 (p-1)/p x M x itemsize)."""
    lines = []
    m = trace.param_count
    for row in comparison.rows:
        if row.schedule is None:
            continue
        s = row.schedule
        itemsize = 2 if s.layout.list_dtypes[ChunkList.PARAM].value in ("float16", "bfloat16") else 4
        padded = sum(c.elements for c in s.layout.chunks)
        moved = row.result.bytes_per_channel[Channel.INTER_GPU]
        formula = 3 * (world - 1) / world * m * itemsize
        formula_padded = 3 * (world - 1) / world * padded * itemsize
        lines.append(f"  {row.policy:<14} INTER_GPU {moved / GB:8.3f} GB per rank | 6(p-1)/p*M: {formula / GB:8.3f} GB "
                     f"(x{moved / formula:5.2f}) | with the chunks' padding ({padded / 1e9:.2f} G elements): "
                     f"{formula_padded / GB:8.3f} GB (x{moved / formula_padded:5.2f})")
    return lines


def published(names: list[str], results: dict[str, object]) -> None:
    print("\nPatrickStar §9.2 (8x V100) next to the simulator")
    hw1, hw8 = resolve_hardware(ONE_GPU), resolve_hardware(PRESET)
    print(" Table 3, max model scale on 8 GPUs -> which shipped models each system can train in the simulator:")
    for policy, scale in PUBLISHED_MAX_SCALE_8GPU.items():
        ok = [n for n in names if results[n].row(policy).feasible]
        print(f"  {policy:<13} published max {scale:>4}; simulator feasible on: {', '.join(ok) or 'none'}")
    print(" §9.2.3 / Table 4, PatrickStar throughput (per-rank batch = the trace's batch):")
    for name in names:
        if name not in PUBLISHED_SPEEDUP_8_OVER_1 and name not in PUBLISHED_TFLOPS_8GPU:
            continue
        trace, digest = load(name)
        row8 = results[name].row("patrickstar")
        try:
            one = simulate(baseline("patrickstar", build_problem(trace, hw1, trace_digest=digest)), hw1)
        except InfeasibleError as exc:
            print(f"  {name}: 1 GPU infeasible in the simulator ({exc})")
            continue
        if row8.result is None:
            print(f"  {name}: 8 GPUs infeasible in the simulator ({row8.reason})")
            continue
        t8 = row8.result.tflops
        speedup = t8 / one.tflops
        pub_t = PUBLISHED_TFLOPS_8GPU.get(name)
        pub_s = PUBLISHED_SPEEDUP_8_OVER_1.get(name)
        print(f"  {name}: 8 GPUs {t8:6.1f} TFLOPS" + (f" (published {pub_t:.0f}, x{t8 / pub_t:.2f})" if pub_t else "")
              + f"; 1 GPU {one.tflops:6.1f} TFLOPS; 8-over-1 speedup {speedup:5.2f}"
              + (f" (published {pub_s:.2f})" if pub_s else ""))
    print(f"  ({PRESET}: {hw8.device.compute_tflops:g} TFLOPS per GPU is the V100's fp16 spec peak, so simulated "
          "compute runs at 100% of peak; PatrickStar measured ~47 TFLOPS per GPU at 12B)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=list(TRACES))
    ap.add_argument("--no-tide", action="store_true", help="baselines only (tide's solve takes minutes on big traces)")
    args = ap.parse_args(argv)
    hw = resolve_hardware(PRESET)
    policies = [*([] if args.no_tide else [TIDE]), *POLICIES]
    results = {}
    for name in args.traces:
        trace, digest = load(name)
        started = time.perf_counter()
        c = compare(trace, hw, trace_digest=digest, policies=policies)
        results[name] = c
        print_comparison(c)
        print(f"  ({time.perf_counter() - started:.1f} s to schedule and simulate every row)")
        print(f" bytes between GPUs per rank vs PatrickStar §7 (M = {trace.param_count / 1e9:.2f} B params):")
        for line in collective_check(c, trace, hw.cluster.world_size):
            print(line)
        print()
    published(args.traces, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
