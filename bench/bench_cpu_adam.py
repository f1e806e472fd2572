"""The executor's own HOST optimizer step against the kernel the planner prices it at.

    python bench/bench_cpu_adam.py [--n-embd 2048] [--threads N] [--reps 5]

The planner prices a HOST Adam step at `host.adam_rates` (planner/costmodel.py `optimizer_step_price`),
which `executor profile` measures as torch's fused AdamW over ONE fp32 tensor. The executor steps a
chunk with `ChunkAdamW.step_chunk` (executor/optim.py): in fp32 that is the same kernel over the
chunk's tensors; in bf16/fp16 it is three passes (the half-precision grad cast into an fp32 scratch,
the fused kernel over the fp32 master, the master copied back into the half-precision PARAM). This
bench times all three on one GPT block's params (the widths of GPT-3 1.3B by default), on the CPU, in
one process, and prints params/s and the ratio to the priced kernel. The first H100 runs took 3-5x
the priced time for their HOST steps (bench/RESULTS.md, "GPU (issue 19)"); this measures one
mechanism of that, the mixed-precision passes, on any machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from executor import record  # noqa: E402
from executor.models import GPT, GPTConfig  # noqa: E402
from executor.optim import ChunkAdamW  # noqa: E402
from planner.layout import build_layout  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from planner.problem import build_problem  # noqa: E402


def fused_fp32_rate(numel: int, reps: int) -> float:
    """What `executor profile` measures for `host.adam_rates`: fused AdamW over one fp32 tensor."""
    p, g, m, v = (torch.randn(numel) for _ in range(4))
    step = torch.zeros(())

    def once() -> None:
        step.add_(1)
        torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, maximize=False)
    return numel / _median_seconds(once, reps)


def _median_seconds(fn, reps: int) -> float:  # noqa: ANN001
    fn()  # first touch, scratch buffers
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_chunk_rate(optimizer: ChunkAdamW, chunk: int, numel: int, *, half: torch.dtype | None, reps: int) -> float:
    """ChunkAdamW.step_chunk over one chunk as the engine calls it: fp32 (PARAM is the master) or mixed
    (half-precision PARAM and GRAD, fp32 MASTER)."""
    m, v = torch.zeros(numel), torch.zeros(numel)
    if half is None:
        param, grad, master = torch.randn(numel), torch.randn(numel), None
    else:
        master = torch.randn(numel)
        param, grad = master.to(half), torch.randn(numel).to(half)

    def once() -> None:
        optimizer.step_chunk(chunk, param=param, grad=grad, master=master, exp_avg=m, exp_avg_sq=v)
    return numel / _median_seconds(once, reps)


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
    priced = fused_fp32_rate(numel, args.reps)
    rows = [("fused AdamW, one fp32 tensor (what the planner prices)", priced),
            ("ChunkAdamW.step_chunk, fp32", step_chunk_rate(optimizer, chunk.id, numel, half=None, reps=args.reps)),
            ("ChunkAdamW.step_chunk, bf16 PARAM/GRAD + fp32 MASTER", step_chunk_rate(optimizer, chunk.id, numel, half=torch.bfloat16, reps=args.reps))]
    tensors = sum(1 for slot in layout.tensors if slot.chunk == chunk.id)
    print(f"one chunk of {numel / 1e6:.1f}M params ({tensors} tensors of one n_embd={args.n_embd} GPT block), "
          f"{args.threads} threads, median of {args.reps}")
    for what, rate in rows:
        print(f"  {what:58s} {rate:10.3g} params/s  {priced / rate:5.2f}x the priced time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
