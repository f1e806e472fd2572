"""Recording cost: time, peak memory, trace size and load time (issue 3 targets for GPT-3 175B on
the meta device: record <= 60 s and <= 4 GB, trace <= 20 MB, load <= 2 s).

Each recording runs `python -m executor record` in its own process, so its peak RSS
(`os.wait4`'s `ru_maxrss`: the whole process, interpreter and torch included) is its own.

    python bench/bench_record.py                 # the default models
    python bench/bench_record.py gpt3-175b       # just one
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from schemas.trace import Trace  # noqa: E402

# model -> extra CLI arguments; the big ones on the meta device like the shipped traces
RUNS = {
    "gpt-small": [],
    "gpt3-1.3b": ["--meta", "--dtype", "float16"],
    "gpt3-13b": ["--meta", "--dtype", "float16"],
    "pstar-gpt-12b": ["--meta", "--dtype", "float16"],
    "gpt3-175b": ["--meta", "--dtype", "float16"],
}
TARGETS = {"gpt3-175b": {"record_s": 60.0, "peak_rss_mb": 4096.0, "trace_mb": 20.0, "load_s": 2.0}}


def measure(model: str, extra: list[str], out_dir: Path) -> dict[str, float]:
    out = out_dir / f"{model}.msgpack"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "executor", "record", model, "-o", str(out), *extra],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    record_s = time.perf_counter() - start
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"recording {model} failed: {stderr.strip()}")
    loads = []
    for _ in range(3):
        t0 = time.perf_counter()
        trace = Trace.read(out)
        loads.append(time.perf_counter() - t0)
    return {
        "record_s": record_s,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # Linux reports KiB
        "trace_mb": out.stat().st_size / 1e6,
        "load_s": min(loads),
        "moments": len(trace.moments),
        "activations": len(trace.activations),
        "params_b": trace.param_count / 1e9,
    }


def main(argv: list[str]) -> int:
    models = argv or list(RUNS)
    table = Table(title="python -m executor record (machine: see the report)")
    for col in ("model", "how", "params (B)", "moments", "activations", "record s", "peak RSS MB", "trace MB", "load s", "targets"):
        table.add_column(col, justify="left" if col in ("model", "how", "targets") else "right")
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            extra = RUNS.get(model, ["--meta"])
            r = measure(model, extra, Path(tmp))
            target = TARGETS.get(model)
            verdict = "-"
            if target:
                ok = all(r[k] <= v for k, v in target.items())
                verdict = ("met" if ok else "MISSED") + " (<= " + ", ".join(f"{k} {v:g}" for k, v in target.items()) + ")"
            table.add_row(model, "meta" if "--meta" in extra else "cpu", f"{r['params_b']:.3f}", str(r["moments"]),
                          str(r["activations"]), f"{r['record_s']:.1f}", f"{r['peak_rss_mb']:.0f}",
                          f"{r['trace_mb']:.3f}", f"{r['load_s']:.3f}", verdict)
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
