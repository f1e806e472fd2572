"""The activation plan (executor.activations.ActivationManager): iteration time, peak live activation
bytes and bytes moved per mode, next to plain PyTorch, same run.

    python bench/bench_activations.py [--layers 6] [--hidden 512] [--batch 8] [--seq 256] [--iters 10]
                                      [--threads 2] [--device cpu|cuda] [--nvme-dir DIR]

Every block gets the same mode; "prefetch off" is SWAP_HOST with reloads started only by the
unpacks that need them (what overlap buys). Times are the median iteration (forward + backward +
AdamW step) after 2 warm-up iterations; on the CPU, DEVICE and HOST are the same memory, so a swap
costs a real copy but saves nothing: read the times as ratios from one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from executor.activations import ActivationManager
from executor.models import GPT, GPTConfig
from schemas.schedule import ActivationMode

MIB = 1 << 20


def _run(args: argparse.Namespace, mode: ActivationMode | None, *, auto_prefetch: bool, nvme_dir: str) -> tuple:
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = GPTConfig(n_layer=args.layers, n_head=max(1, args.hidden // 64), n_embd=args.hidden,
                       vocab_size=4096, block_size=args.seq)
    model = GPT(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    manager = None
    if mode is not None:
        manager = ActivationManager(model, [mode] * args.layers, nvme_dir=nvme_dir, auto_prefetch=auto_prefetch)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    times = []
    for i in range(2 + args.iters):
        if i == 2 and manager is not None:
            manager.reset_stats()
        start = time.perf_counter()
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    stats = manager.stats() if manager is not None else None
    if manager is not None:
        manager.close()
    return statistics.median(times), stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nvme-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    nvme_dir = args.nvme_dir or tempfile.gettempdir()
    rows = [("plain PyTorch", None, True), ("KEEP", ActivationMode.KEEP, True),
            ("RECOMPUTE", ActivationMode.RECOMPUTE, True), ("SWAP_HOST", ActivationMode.SWAP_HOST, True),
            ("SWAP_HOST prefetch off", ActivationMode.SWAP_HOST, False),
            ("SWAP_NVME", ActivationMode.SWAP_NVME, True),
            ("plain PyTorch (again)", None, True)]  # how much the machine drifted during the run
    print(f"GPT {args.layers} layers, hidden {args.hidden}, batch {args.batch}, seq {args.seq}, fp32, "
          f"{args.device}, {args.threads} threads, median of {args.iters} iterations")
    print(f"{'mode':<24}{'iter s':>9}{'x plain':>9}{'peak live MiB':>15}{'offloaded MiB/it':>18}"
          f"{'stall s/it':>12}")
    base = None
    for name, mode, auto in rows:
        seconds, stats = _run(args, mode, auto_prefetch=auto, nvme_dir=nvme_dir)
        base = base or seconds
        if stats is None:
            print(f"{name:<24}{seconds:>9.3f}{seconds / base:>9.2f}{'-':>15}{'-':>18}{'-':>12}")
            continue
        moved = sum(stats.offloaded_bytes.values()) / args.iters / MIB
        print(f"{name:<24}{seconds:>9.3f}{seconds / base:>9.2f}{stats.peak_live_bytes / MIB:>15.1f}"
              f"{moved:>18.1f}{stats.stall_seconds / args.iters:>12.4f}")


if __name__ == "__main__":
    main()
