"""tide against plain AdamW(fused) on one small GPT, param by param (the GPU kit's `diag` step).

    python bench/gpu/diag.py [os-host | os-split | nvme | device]

Trains two steps with tide (the schedule of tests/test_executor_planner.plan, recorded on this
machine's device) and with plain PyTorch, and prints the losses, then per param: the grad tide's
hook saw at step 0 against the reference's grad, and the param after step 0. Where the first
differing grad appears in backward order says which saved tensor or chunk was wrong; run it once
more with CUDA_LAUNCH_BLOCKING=1 to tell a race (the difference goes away) from a wrong computation.
It found the first H100 run's stale saved params (bench/RESULTS.md, "GPU (issue 19)").
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

import executor  # noqa: E402
from executor.binding import ParamBinding  # noqa: E402
from test_executor import LR, WD, gpt_batches, gpt_loss, plain_groups  # noqa: E402
from test_executor_planner import gpt_model, plan  # noqa: E402

VARIANTS = ("os-host", "os-split", "nvme", "device")


def compare(variant: str) -> dict[str, tuple[float | None, float]]:
    """Per param: (max |grad diff| at step 0 or None if tide's hook saw none, max |param diff| after it)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    schedule = plan("gpt", os_split=variant == "os-split", nvme=variant == "nvme",
                    budget_chunks=64 if variant == "device" else 8, device=device)
    batches = [b.to(device) for b in gpt_batches(2)]
    seen: dict[str, torch.Tensor] = {}
    grad_ready = ParamBinding._grad_ready

    def spy(self: ParamBinding, param: torch.Tensor, slot) -> None:  # noqa: ANN001 - TensorSlot
        if param.grad is not None and slot.names[0] not in seen:
            seen[slot.names[0]] = param.grad.detach().clone()
        grad_ready(self, param, slot)

    ParamBinding._grad_ready = spy
    try:
        model = gpt_model()
        engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tempfile.mkdtemp(), device=device)
        tide_losses, tide_after = [], {}
        for i, b in enumerate(batches):
            loss = gpt_loss(model, b)
            loss.backward()
            tide_losses.append(loss.item())
            engine.step()
            engine.zero_grad()
            if i == 0:
                tide_after = {k: v.detach().float().cpu().clone() for k, v in engine.state_dict()["model"].items()}
        engine.detach()
    finally:
        ParamBinding._grad_ready = grad_ready

    ref = gpt_model().to(device)
    opt = torch.optim.AdamW(plain_groups(ref), lr=LR, fused=True)
    ref_losses, ref_grads, ref_after = [], {}, {}
    for i, b in enumerate(batches):
        loss = gpt_loss(ref, b)
        loss.backward()
        ref_losses.append(loss.item())
        if i == 0:
            ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        if i == 0:
            ref_after = {n: p.detach().float().cpu().clone() for n, p in ref.named_parameters()}

    print(f"variant {variant} on {device}: tide losses {tide_losses}, plain {ref_losses}")
    out = {}
    for name, g in ref_grads.items():
        mine = seen.get(name)
        grad_diff = None if mine is None else (mine.float() - g.float()).abs().max().item()
        param_diff = (tide_after[name] - ref_after[name]).abs().max().item()
        out[name] = (grad_diff, param_diff)
        print(f"{name:28s} |g| {g.abs().max().item():.3e}  grad diff "
              f"{'none seen' if grad_diff is None else f'{grad_diff:.3e}'}  param diff after step 0 {param_diff:.3e}")
    return out


if __name__ == "__main__":
    variant = sys.argv[1] if len(sys.argv) > 1 else "os-host"
    if variant not in VARIANTS:
        raise SystemExit(f"diag.py {variant!r}: expected one of {', '.join(VARIANTS)}")
    torch.set_num_threads(1)
    compare(variant)
