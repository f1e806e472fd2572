"""Recording a user's own model (issue 20): `executor.record` from the package, any forward
signature through `loss_fn(model, batch)`, the model left bit-identical, and the CLI's --module."""

from __future__ import annotations

import random
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import executor
from executor.cli import main as executor_main
from schemas.trace import Trace


class Odd(nn.Module):
    """Buffers (batch norm), randomness (dropout), a keyword-only forward and a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(16, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, *, x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(torch.relu(self.norm(self.inp(x))))
        logits = self.frozen(self.head(h)) * scale
        return logits, h


def _state(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "ids": [id(p) for p in model.parameters()] + [p.data_ptr() for p in model.parameters()],
        "torch": torch.random.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k
    for n in a["grads"]:
        assert (a["grads"][n] is None) == (b["grads"][n] is None), n
        if a["grads"][n] is not None:
            assert torch.equal(a["grads"][n], b["grads"][n]), n
    assert a["ids"] == b["ids"]
    assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]
    assert np.array_equal(a["numpy"], b["numpy"])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_record_leaves_the_model_params_buffers_grads_and_rng_as_they_were(device, one_torch_thread):
    torch.manual_seed(0)
    model = Odd()
    model.train()
    # a user mid-training: some grads hold values, others are None
    model(x=torch.randn(4, 8), scale=1.0)[0].sum().backward()
    model.head.bias.grad = None
    random.seed(3)
    np.random.seed(3)
    batch = {"x": torch.randn(4, 8), "y": torch.tensor([0, 1, 2, 0]), "scale": 2.0}
    before = _state(model)

    def loss_fn(m, batch):  # touches python's and numpy's RNGs too
        noise = random.random() + float(np.random.rand())
        logits, _ = m(x=batch["x"], scale=batch["scale"] + 0 * noise)
        return nn.functional.cross_entropy(logits, batch["y"])

    trace = executor.record(model, batch, loss_fn=loss_fn, device=device, timing_iterations=1)
    _assert_same(before, _state(model))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert trace.meta.model_name == "Odd"
    trainable = {n: t.trainable for t in trace.tensors for n in t.names}
    assert trainable["frozen.weight"] is False and trainable["head.weight"] is True


def test_a_failing_recording_also_restores_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.randn(2, 4)
    before = _state(model)
    calls = []

    def loss_fn(m, batch):
        calls.append(1)
        if len(calls) == 3:  # the warm-up step has trained the model by now
            raise RuntimeError("boom")
        return m(batch).sum()

    with pytest.raises(executor.errors.ExecutorError, match="boom"):
        executor.record(model, x, loss_fn=loss_fn)
    _assert_same(before, _state(model))


def test_hf_output_loss_and_dict_batch_need_no_loss_fn():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    trace = executor.record(model, {"input_ids": ids, "labels": ids}, timing_iterations=1)
    assert trace.meta.model_name == "LlamaForCausalLM" and len(trace.blocks) == 2


def test_cli_records_the_users_own_model_from_a_factory(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_model_u20.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

        def batch():
            return torch.randn(4, 8)

        def loss(model, batch):
            return model(batch).pow(2).mean()

        def build_with_batch():
            return build(), batch()
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    out = tmp_path / "t.msgpack"
    argv = ["record", "--module", "my_model_u20:build", "--batch-module", "my_model_u20:batch",
            "--loss-module", "my_model_u20:loss", "--timing-iterations", "1", "-o", str(out), "--quiet"]
    assert executor_main(argv) == 0
    trace = Trace.read(out)
    assert trace.meta.model_name == "Sequential" and len(trace.tensors) == 4
    assert executor_main(["record", "--module", "my_model_u20:build_with_batch", "--meta", "--name", "mine",
                          "--loss-module", "my_model_u20:loss", "-o", str(out)]) == 0
    assert Trace.read(out).meta.model_name == "mine"
    capsys.readouterr()


@pytest.mark.parametrize("argv,message", [
    (["--module", "nowhere_u20:build"], "cannot import 'nowhere_u20'"),
    (["--module", "my_model_u20"], "expected PKG.MOD:NAME"),
    (["--module", "my_model_u20:nothing"], "has no 'nothing'"),
    (["--module", "my_model_u20:build"], "no batch; pass --batch-module"),
    (["gpt-small", "--module", "my_model_u20:build"], "exactly one"),
])
def test_cli_module_bad_input_is_one_line(tmp_path, monkeypatch, capsys, argv, message):
    (tmp_path / "my_model_u20.py").write_text("from torch import nn\ndef build():\n    return nn.Linear(2, 2)\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "t.msgpack"
    assert executor_main(["record", *argv, "--meta", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()
