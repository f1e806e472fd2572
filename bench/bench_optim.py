"""ChunkAdamW.step_chunk over flat chunks vs torch.optim.AdamW(fused=True).step on the same params.

    python bench/bench_optim.py [--layers 12] [--hidden 768] [--chunk-mib 64] [--steps 5]

A GPT-2-small-like set of param tensors (per layer: 4 h x h + 2 h x 4h matrices, biases, norms;
two param groups: decay / no decay), packed into chunks of --chunk-mib fp32. Both run the same
fused kernel; the figure is the overhead of cutting chunks into per-tensor views and grouping them
(target: ratio ~1.0). Median step time of --steps steps after one warm-up; ratio from one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from executor.optim import ChunkAdamW
from schemas.schedule import Chunk, ChunkLayout, ChunkList, TensorSlot
from schemas.trace import DType


def _params(layers: int, hidden: int) -> list[tuple[str, nn.Parameter]]:
    out = []
    for i in range(layers):
        for name, shape in (("qkv.weight", (3 * hidden, hidden)), ("qkv.bias", (3 * hidden,)), ("proj.weight", (hidden, hidden)),
                            ("proj.bias", (hidden,)), ("fc.weight", (4 * hidden, hidden)), ("fc.bias", (4 * hidden,)),
                            ("out.weight", (hidden, 4 * hidden)), ("out.bias", (hidden,)), ("ln1.weight", (hidden,)),
                            ("ln1.bias", (hidden,)), ("ln2.weight", (hidden,)), ("ln2.bias", (hidden,))):
            out.append((f"h.{i}.{name}", nn.Parameter(torch.randn(shape) * 0.02)))
    return out


def _layout(named: list[tuple[str, nn.Parameter]], chunk_elements: int) -> ChunkLayout:
    chunks, slots, used = [], [], chunk_elements
    for tid, (name, p) in enumerate(named):
        if used + p.numel() > chunk_elements:
            chunks.append(Chunk(id=len(chunks), elements=max(chunk_elements, p.numel()), used_elements=0, block=-1,
                                comm_group=len(chunks), owner_rank=0))
            used = 0
        slots.append(TensorSlot(tensor=tid, names=(name,), shape=tuple(p.shape), chunk=len(chunks) - 1,
                                offset_elements=used, numel=p.numel(), trainable=True))
        used += p.numel()
    lists = (ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V)
    return ChunkLayout(chunk_elements=chunk_elements, lists=lists, list_dtypes={x: DType.FLOAT32 for x in lists},
                       chunks=tuple(chunks), tensors=tuple(slots))


def _groups(named):
    return [dict(params=[p for n, p in named if p.dim() >= 2], weight_decay=0.1),
            dict(params=[p for n, p in named if p.dim() < 2], weight_decay=0.0)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    named = _params(args.layers, args.hidden)
    n_params = sum(p.numel() for _, p in named)
    for _, p in named:
        p.grad = torch.randn_like(p) * 1e-3
    ref = torch.optim.AdamW(_groups(named), lr=1e-4, fused=True)

    layout = _layout(named, args.chunk_mib * (1 << 20) // 4)
    bufs = {(lst, c.id): torch.zeros(c.elements) for lst in layout.lists for c in layout.chunks}
    by_name = dict(named)
    for s in layout.tensors:
        for lst, src in ((ChunkList.PARAM, by_name[s.names[0]].detach()), (ChunkList.GRAD, by_name[s.names[0]].grad)):
            bufs[(lst, s.chunk)][s.offset_elements:s.offset_elements + s.numel].copy_(src.reshape(-1))
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if p.dim() < 2]
    opt = ChunkAdamW([dict(params=[p for _, p in decay], param_names=[n for n, _ in decay], weight_decay=0.1),
                      dict(params=[p for _, p in no_decay], param_names=[n for n, _ in no_decay], weight_decay=0.0)],
                     layout, lr=1e-4)

    def chunk_step() -> None:
        for c in opt.chunks:
            opt.step_chunk(c, param=bufs[(ChunkList.PARAM, c)], grad=bufs[(ChunkList.GRAD, c)], master=None,
                           exp_avg=bufs[(ChunkList.M, c)], exp_avg_sq=bufs[(ChunkList.V, c)])

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    plain_s = timed(ref.step)
    chunk_s = timed(chunk_step)
    plain_s2 = timed(ref.step)  # again, to see the noise of this shared machine
    print(f"fused AdamW step, {n_params / 1e6:.1f}M fp32 params, {len(layout.chunks)} chunks of {args.chunk_mib} MiB, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'path':44} {'step s':>8} {'Mparams/s':>10}")
    for label, sec in (("torch.optim.AdamW(fused=True).step", plain_s), ("ChunkAdamW.step_chunk over all chunks", chunk_s),
                       ("torch.optim.AdamW(fused=True).step (again)", plain_s2)):
        print(f"{label:44} {sec:8.3f} {n_params / sec / 1e6:10.1f}")
    print(f"ratio chunked / plain (mean of both plain runs): {chunk_s / ((plain_s + plain_s2) / 2):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
