"""NaN / Inf inside a checkpoint's weights or Adam moments is refused at restore with one line naming
the file and the tensor, before anything is written; `load` finds them in its digest pass, so no
tensor is read twice (issue 21 leftovers)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from executor import state
from test_checkpoint_integrity import _store
from test_state import _batches, _chunk_train


def _saved(tmp_path: Path):
    model, store, opt = _store()
    _chunk_train(model, opt, store, _batches(1, seed=0))  # Adam moments and steps exist
    path = tmp_path / "ckpt.pt"
    state.save(path, store, model=model, optimizer=opt)
    return model, store, opt, path


def _poison(path: Path, where: str, value: float) -> str:
    """Put `value` in one tensor of the file and reseal it (a checkpoint saved from a run that diverged)."""
    ckpt = torch.load(path, weights_only=True)
    if where == "model":
        name = next(iter(ckpt["model"]))
        ckpt["model"][name].view(-1)[3] = value
        label = f"model[{name!r}]"
    else:
        index = next(iter(ckpt["optimizer"]["state"]))
        ckpt["optimizer"]["state"][index][where].view(-1)[0] = value
        label = f"optimizer state[{index!r}][{where!r}]"
    ckpt["content_digest"] = state.checkpoint_digest(ckpt)
    torch.save(ckpt, path)
    return label


@pytest.mark.parametrize("where, value", [("model", float("nan")), ("exp_avg", float("inf")),
                                          ("exp_avg_sq", float("nan"))])
def test_nonfinite_weights_and_moments_are_refused_before_anything_is_written(tmp_path: Path, where: str,
                                                                              value: float) -> None:
    model, store, opt, path = _saved(tmp_path)
    label = _poison(path, where, value)
    before = {k: v.clone() for k, v in store.buffers.items()}
    ckpt = state.load(path)  # the digest matches: the file is what was saved
    with pytest.raises(state.StateError) as info:
        state.restore(ckpt, store, model=model, optimizer=opt)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and label in message and "NaN or Inf" in message
    assert all(torch.equal(before[k], store.buffers[k]) for k in before)
    # built in memory (not through load): scanned there, named as such
    copied = copy.deepcopy(ckpt)
    with pytest.raises(state.StateError, match=r"checkpoint \(in memory\)"):
        state.restore(copied, store, model=model, optimizer=opt)
    assert all(torch.equal(before[k], store.buffers[k]) for k in before)


def test_load_reads_each_tensor_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NaN/Inf scan rides on the digest's pass: restore of a loaded checkpoint scans nothing again,
    and a clean checkpoint restores as before."""
    model, store, opt, path = _saved(tmp_path)
    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1])
    ckpt = state.load(path)
    scanned = len(calls)
    assert scanned > 0
    state.restore(ckpt, store, model=model, optimizer=opt)
    assert len(calls) == scanned
    assert type(ckpt) is dict  # a plain dict still: torch.save of it loads back with weights_only


def test_a_buffer_may_hold_minus_inf() -> None:
    """Model entries that are not params of the layout (buffers: causal masks hold -inf) are not refused."""
    ckpt = {"format": state.CHECKPOINT_FORMAT, "model": {"w": torch.ones(3), "mask": torch.full((2,), float("-inf"))}}
    state.check_checkpoint(ckpt, params={"w"})
    with pytest.raises(state.StateError, match=r"model\['mask'\]"):
        state.check_checkpoint(ckpt)
