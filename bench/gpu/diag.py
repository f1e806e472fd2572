"""Diagnose a CUDA fp32 mismatch: tide vs plain AdamW(fused) on one small GPT, step by step.

    python bench/gpu/diag.py [variant]      (os-host | os-split | nvme | device)

Prints the losses of both, then per param: the grad tide's hook saw vs the reference's grad (step 0),
and the param after step 0. Run it twice, once with CUDA_LAUNCH_BLOCKING=1, to tell a race from a
wrong computation.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

import executor  # noqa: E402
from executor import binding  # noqa: E402
from test_executor import LR, WD, gpt_batches, gpt_loss, plain_groups  # noqa: E402
from test_executor_planner import gpt_model, plan  # noqa: E402

variant = sys.argv[1] if len(sys.argv) > 1 else "os-host"
torch.set_num_threads(1)
schedule = plan("gpt", os_split=variant == "os-split", nvme=variant == "nvme",
                budget_chunks=64 if variant == "device" else 8)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
batches = [b.to(DEV) for b in gpt_batches(2)]

seen: dict[str, torch.Tensor] = {}
orig = binding.ParamBinding._grad_ready


def spy(self, param, slot):  # noqa: ANN001, ANN202
    if param.grad is not None and slot.names[0] not in seen:
        seen[slot.names[0]] = param.grad.detach().clone()
    return orig(self, param, slot)


binding.ParamBinding._grad_ready = spy
model = gpt_model()
import tempfile  # noqa: E402

engine = executor.run(model, schedule, lr=LR, weight_decay=WD, nvme_dir=tempfile.mkdtemp(), device=DEV)
tide_losses = []
after0 = None
for i, b in enumerate(batches):
    loss = gpt_loss(model, b)
    loss.backward()
    tide_losses.append(loss.item())
    engine.step()
    engine.zero_grad()
    if i == 0:
        after0 = {k: v.detach().float().cpu().clone() for k, v in engine.state_dict()["model"].items()}
engine.detach()

ref = gpt_model().to(DEV)
opt = torch.optim.AdamW(plain_groups(ref), lr=LR, fused=True)
ref_losses, ref_grads, ref_after0 = [], {}, {}
for i, b in enumerate(batches):
    loss = gpt_loss(ref, b)
    loss.backward()
    ref_losses.append(loss.item())
    if i == 0:
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    opt.step()
    opt.zero_grad()
    if i == 0:
        ref_after0 = {n: p.detach().float().cpu().clone() for n, p in ref.named_parameters()}

print(f"variant {variant}: tide {tide_losses} ref {ref_losses}")
print("optimizer tiers per chunk:", {p.chunk: (p.os_tier.value, p.optimizer_tier.value)
                                      for p in getattr(schedule, "chunk_plans", ())} if hasattr(schedule, "chunk_plans") else "")
for name, g in ref_grads.items():
    mine = seen.get(name)
    gd = None if mine is None else (mine.float() - g.float()).abs().max().item()
    pd = (after0[name] - ref_after0[name]).abs().max().item()
    print(f"{name:28s} |g| {g.abs().max().item():.3e}  grad diff {gd if gd is None else f'{gd:.3e}'}  "
          f"param diff after step 0 {pd:.3e}")
