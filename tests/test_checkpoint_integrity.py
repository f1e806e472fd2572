"""Checkpoint files survive crashes and refuse lies (issue 21, item 4): the folder is fsynced after the
rename, a killed save's temp file is removed by the next save, and a checkpoint names its content and
its schedule by digest; a changed file, a foreign schedule or pickled code is refused with one line."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch

import schemas._base as base
from executor import state
from executor.optim import ChunkAdamW
from test_optim_support import FakeStore, TinyLM, bind, layout_for, param_groups


class _Schedule:
    def __init__(self, digest: str) -> None:
        self.digest = digest

    def content_digest(self) -> str:
        return self.digest


def _store(schedule_digest: str | None = None):
    torch.manual_seed(0)
    model = TinyLM()
    store = FakeStore(layout_for(model, chunk_elements=150))
    if schedule_digest is not None:
        store.schedule = _Schedule(schedule_digest)
    bind(model, store)
    return model, store, ChunkAdamW(param_groups(model), store.layout, model=model)


def test_the_folder_is_fsynced_after_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_replace = base.os.replace
    monkeypatch.setattr(base.os, "replace", lambda a, b: (events.append("rename"), real_replace(a, b)))
    monkeypatch.setattr(base, "fsync_directory", lambda folder: events.append(f"fsync {Path(folder).name}"))
    base.atomic_write_bytes(tmp_path / "f.bin", b"x")
    assert events == ["rename", f"fsync {tmp_path.name}"]


def test_a_killed_saves_temp_file_is_removed_by_the_next_save(tmp_path: Path) -> None:
    model, store, opt = _store()
    path = tmp_path / "ckpt.pt"
    stale = tmp_path / ".ckpt.pt.abc123.tmp"  # what atomic_write_bytes leaves when SIGKILLed before its rename
    stale.write_bytes(b"\0" * 4096)
    other = tmp_path / ".other.pt.abc123.tmp"  # another target's: not ours to remove
    other.write_bytes(b"x")
    state.save(path, store, model=model, optimizer=opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.abc123.tmp", "ckpt.pt"]


def test_a_changed_checkpoint_is_refused_with_one_line(tmp_path: Path) -> None:
    model, store, opt = _store()
    path = tmp_path / "ckpt.pt"
    state.save(path, store, model=model, optimizer=opt)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["content_digest"] == state.checkpoint_digest(ckpt)
    ckpt["model"]["fc1.weight"][0, 0] += 1.0
    torch.save(ckpt, path)
    with pytest.raises(state.StateError) as info:
        state.load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "content digest does not match" in message


def test_a_checkpoint_of_another_schedule_is_refused_before_anything_changes(tmp_path: Path) -> None:
    model, store, opt = _store("sha256:" + "a" * 64)
    path = tmp_path / "ckpt.pt"
    state.save(path, store, model=model, optimizer=opt)
    assert state.load(path)["schedule_digest"] == "sha256:" + "a" * 64
    model2, store2, opt2 = _store("sha256:" + "b" * 64)
    before = copy.deepcopy(store2.buffers)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(state.StateError, match="saved under schedule sha256:aaaa.*this engine runs sha256:bbbb") as info:
        state.restore(state.load(path), store2, model=model2, optimizer=opt2)
    assert "\n" not in str(info.value)
    assert all(torch.equal(before[k], store2.buffers[k]) for k in before)
    model3, store3, opt3 = _store("sha256:" + "a" * 64)
    state.restore(state.load(path), store3, model=model3, optimizer=opt3)  # the schedule it was saved with loads


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_a_pickled_object_is_refused_in_one_line_without_torchs_advice(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"format": state.CHECKPOINT_FORMAT, "model": _Evil()}, path, pickle_module=pickle)
    with pytest.raises(state.StateError) as info:
        state.load(path)
    message = str(info.value)
    assert "\n" not in message and "weights_only=False" not in message and "pickled objects" in message, message
    assert len(message) - len(str(path)) < 200, message


def test_a_truncated_checkpoint_is_one_short_line(tmp_path: Path) -> None:
    model, store, opt = _store()
    path = tmp_path / "ckpt.pt"
    state.save(path, store, model=model, optimizer=opt)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(state.StateError) as info:
        state.load(path)
    assert "\n" not in str(info.value) and len(str(info.value)) - len(str(path)) < 200, str(info.value)
