"""The executor's own HOST optimizer step against the kernel the planner prices it at.

    python bench/bench_cpu_adam.py [--n-embd 2048] [--threads N] [--reps 5]

The planner prices a HOST Adam step at `host.adam_rates` (planner/costmodel.py `optimizer_step_price`),
which `executor profile` measures as torch's fused AdamW over ONE fp32 tensor. The executor steps a
chunk with `ChunkAdamW.step_chunk` (executor/optim.py): in fp32 that is the same kernel over the
chunk's tensors; in bf16/fp16 it is three passes (the half-precision grad cast into an fp32 scratch,
the fused kernel over the fp32 master, the master copied back into the half-precision PARAM), made one
cache-sized tile at a time (Note [mixed-precision steps in tiles]). This bench times them on one
GPT block's params (the widths of GPT-3 1.3B by default), on the CPU, in one process, in interleaved
rounds, the bf16 step also in whole passes (as before the tiles), and prints params/s and the ratio to
the priced kernel. `executor profile` measures the tiled bf16 step as `adam_rates[].mixed_precision_params_per_s`,
which prices the HOST steps of bf16/fp16 models. The first H100 runs took 3-5x
the priced time for their HOST steps (bench/RESULTS.md, "GPU (issue 19)"); this measures one
mechanism of that, the mixed-precision passes, on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from executor import record  # noqa: E402
from executor.models import GPT, GPTConfig  # noqa: E402
from executor import optim  # noqa: E402
from executor.optim import ChunkAdamW  # noqa: E402
from planner.layout import build_layout  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from planner.problem import build_problem  # noqa: E402


def fused_fp32_step(numel: int):  # noqa: ANN201
    """What `executor profile` measures for `host.adam_rates`: fused AdamW over one fp32 tensor."""
    p, g, m, v = (torch.randn(numel) for _ in range(4))
    step = torch.zeros(())

    def once() -> None:
        step.add_(1)
        torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, maximize=False)
    return once


def chunk_step(optimizer: ChunkAdamW, chunk: int, numel: int, *, half: torch.dtype | None,
               tile_elements: int | None = optim.CPU_TILE_ELEMENTS):  # noqa: ANN201
    """ChunkAdamW.step_chunk over one chunk as the engine calls it: fp32 (PARAM is the master) or mixed
    (half-precision PARAM and GRAD, fp32 MASTER), in tiles of `tile_elements` (None: whole passes, as
    before Note [mixed-precision steps in tiles])."""
    m, v = torch.zeros(numel), torch.zeros(numel)
    if half is None:
        param, grad, master = torch.randn(numel), torch.randn(numel), None
    else:
        master = torch.randn(numel)
        param, grad = master.to(half), torch.randn(numel).to(half)

    def once() -> None:
        saved, optim.CPU_TILE_ELEMENTS = optim.CPU_TILE_ELEMENTS, tile_elements
        try:
            optimizer.step_chunk(chunk, param=param, grad=grad, master=master, exp_avg=m, exp_avg_sq=v)
        finally:
            optim.CPU_TILE_ELEMENTS = saved
    return once


def interleaved_medians(steps: list, reps: int) -> list[float]:  # noqa: ANN001
    """Median seconds of each step, timed in `reps` rounds that run every step once (a noisy machine's
    slow spells fall on all of them alike); one untimed round first (first touch, scratch buffers)."""
    for fn in steps:
        fn()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(reps):
        for fn, ts in zip(steps, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


@contextlib.contextmanager
def beside(kind: str):  # noqa: ANN201
    """A second Python thread runs while the block does. "launches": small torch ops with Python between them, as a
    training thread's forward launches kernels (each op releases the GIL, as the step's ops do); "python": pure
    Python, which gives the GIL up only at the interpreter's switch interval (`sys.getswitchinterval()`, 5 ms)."""
    stop = threading.Event()
    small = torch.zeros(16)

    def launches() -> None:
        while not stop.is_set():
            for _ in range(20):
                small.add_(1)
            sum(range(200))

    def python() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    thread = threading.Thread(target={"launches": launches, "python": python}[kind], daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-embd", type=int, default=2048, help="the block's width (GPT-3 1.3B: 2048)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=max(1, args.n_embd // 128), n_embd=args.n_embd, vocab_size=64, block_size=16))
    batch = torch.randint(0, 64, (1, 16))
    trace = record(model, {"idx": batch, "targets": batch}, model_name="bench-cpu-adam")
    problem = build_problem(trace, resolve_hardware("cpu-emulated"), trace_digest="bench")
    block_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("h.0."))
    layout = build_layout(problem, chunk_elements=block_params)  # the block in one chunk, as a 1.3B plan packs it
    optimizer = ChunkAdamW(model.parameters(), layout, model=model, lr=1e-4)
    chunk = max(layout.chunks, key=lambda c: c.used_elements)
    numel = chunk.elements
    variants = [("fused AdamW, one fp32 tensor (what the planner prices)", fused_fp32_step(numel)),
                ("ChunkAdamW.step_chunk, fp32", chunk_step(optimizer, chunk.id, numel, half=None)),
                ("ChunkAdamW.step_chunk, bf16 PARAM/GRAD + fp32 MASTER, in tiles",
                 chunk_step(optimizer, chunk.id, numel, half=torch.bfloat16)),
                ("ChunkAdamW.step_chunk, bf16, whole passes (before tiles)",
                 chunk_step(optimizer, chunk.id, numel, half=torch.bfloat16, tile_elements=None))]
    seconds = interleaved_medians([fn for _, fn in variants], args.reps)
    rows = [(what, numel / s) for (what, _), s in zip(variants, seconds)]
    priced = rows[0][1]
    tensors = sum(1 for slot in layout.tensors if slot.chunk == chunk.id)
    print(f"one chunk of {numel / 1e6:.1f}M params ({tensors} tensors of one n_embd={args.n_embd} GPT block), "
          f"{args.threads} threads, median of {args.reps}")
    for what, rate in rows:
        print(f"  {what:66s} {rate:10.3g} params/s  {priced / rate:5.2f}x the priced time")
    # Beside a busy Python thread a step loses twice: on every core it shares one with that thread (a parallel
    # region waits for its slowest thread), and each of its ops gives the GIL up and must take it back (three
    # per tile in bf16). The H200 run's HOST steps took 2.4x their price beside training (bench/RESULTS.md,
    # session 24).
    mixed = variants[2:]
    print(f"the bf16 steps beside a second Python thread (time relative to the same step alone; {args.reps} rounds)")
    for kind in ("launches", "python"):
        with beside(kind):
            busy = interleaved_medians([fn for _, fn in mixed], args.reps)
        for (what, _), alone, s in zip(mixed, seconds[2:], busy):
            print(f"  beside {kind:8s} {what.split(', ', 1)[1]:55s} {numel / s:10.3g} params/s  {s / alone:6.2f}x alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
