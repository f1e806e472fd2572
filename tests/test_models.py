"""executor.models: our GPT, the HF builders and the named configs of the shipped traces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.errors import ExecutorError
from executor.models import MODELS, GPT, GPTConfig, build_model, make_batch, model_spec, parse_dtype


def gpt_param_count(n_layer: int, n_embd: int, vocab: int, seq: int) -> int:
    """Per block: qkv (3h^2+3h), proj (h^2+h), fc (4h^2+4h), proj (4h^2+h), two LayerNorms (4h)."""
    h = n_embd
    return n_layer * (12 * h * h + 13 * h) + vocab * h + seq * h + 2 * h


def test_config_is_checked():
    with pytest.raises(ExecutorError, match="n_embd: expected a multiple of n_head=3"):
        GPTConfig(n_head=3, n_embd=128)
    with pytest.raises(ExecutorError, match="n_layer: expected a positive integer"):
        GPTConfig(n_layer=0)
    with pytest.raises(ExecutorError, match="unknown key 'n_layers'"):
        GPTConfig.from_dict({"n_layers": 2})
    with pytest.raises(TypeError):
        GPTConfig(4)  # keyword-only
    config = GPTConfig(n_layer=2, n_embd=32, n_head=2)
    assert GPTConfig.from_dict(config.to_dict()) == config


def test_gpt_head_is_the_embedding_applied_functionally():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    assert not any("lm_head" in name for name, _ in model.named_modules())
    idx = torch.randint(0, 32, (2, 8))
    logits = model(idx)
    assert logits.shape == (2, 8, 32)
    x = model.wte(idx) + model.wpe(torch.arange(8))
    for block in model.h:
        x = block(x)
    torch.testing.assert_close(logits, F.linear(model.ln_f(x), model.wte.weight))
    loss = model(idx, idx)
    assert loss.shape == () and loss.requires_grad
    with pytest.raises(ExecutorError, match="block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("name,nominal", [
    ("gpt2-124m", 124e6), ("gpt3-1.3b", 1.3e9), ("gpt3-13b", 13e9), ("gpt3-175b", 175e9),
    ("pstar-gpt-1b", 1.1e9), ("pstar-gpt-4b", 4.2e9), ("pstar-gpt-12b", 12.3e9),
])
def test_named_configs_have_the_published_sizes(name, nominal):
    spec = MODELS[name]
    model = build_model(spec, device="meta")
    count = sum(p.numel() for p in model.parameters())
    c = spec.config
    assert count == gpt_param_count(c["n_layer"], c["n_embd"], c["vocab_size"], c["block_size"])
    assert abs(count - nominal) / nominal < 0.03
    assert (spec.seq, spec.batch, c["vocab_size"]) == (1024, 8, 50257)


def test_gpt3_and_patrickstar_shapes():
    shapes = {n: (MODELS[n].config["n_layer"], MODELS[n].config["n_embd"], MODELS[n].config["n_head"])
              for n in ("gpt3-1.3b", "gpt3-13b", "gpt3-175b", "pstar-gpt-1b", "pstar-gpt-4b", "pstar-gpt-12b")}
    assert shapes == {"gpt3-1.3b": (24, 2048, 16), "gpt3-13b": (40, 5120, 40), "gpt3-175b": (96, 12288, 96),
                      "pstar-gpt-1b": (20, 2048, 16), "pstar-gpt-4b": (64, 2304, 16), "pstar-gpt-12b": (60, 4096, 16)}


@pytest.mark.parametrize("name,tied", [("hf-gpt2-tiny", ("transformer.wte.weight", "lm_head.weight")),
                                       ("hf-llama-tiny", ("model.embed_tokens.weight", "lm_head.weight"))])
def test_hf_builders_make_tied_models_without_download(name, tied):
    spec = model_spec(name)
    model = build_model(spec)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params[tied[0]] is params[tied[1]]
    batch = make_batch(spec)
    assert batch["input_ids"].shape == (spec.batch, spec.seq)
    assert model(**batch).loss.shape == ()


def test_spec_overrides_and_batches():
    spec = model_spec("gpt-small", batch=3, seq=128)
    assert (spec.batch, spec.seq) == (3, 128) and spec.config["block_size"] == 128  # grown to fit
    batch = make_batch(spec, device="meta")
    assert batch["idx"].shape == (3, 128) and batch["idx"].device.type == "meta"
    assert torch.equal(make_batch(spec)["idx"], make_batch(spec)["idx"])  # seeded
    with pytest.raises(ExecutorError, match="unknown; expected one of gpt-small"):
        model_spec("gpt-9")
    with pytest.raises(ExecutorError, match="--seq: expected a positive"):
        model_spec("gpt-small", seq=0)
    with pytest.raises(ExecutorError, match="dtype 'float64'"):
        parse_dtype("float64")
    model = build_model(model_spec("gpt-small"), dtype=parse_dtype("bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.training


def test_sdpa_and_chunked_loss_train_like_the_written_out_math() -> None:
    """Fused attention and the chunked loss head change what is kept for backward, not the numbers."""
    base = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, loss_chunk_tokens=7)
    idx = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for attention, loss in (("math", "full"), ("sdpa", "chunked")):
        torch.manual_seed(1)
        model = GPT(GPTConfig(attention=attention, loss=loss, **base)).double()
        value = model(idx, idx)
        value.backward()
        results.append((value.detach(), [p.grad for p in model.parameters()]))
    (ref_loss, ref_grads), (loss_value, grads) = results
    torch.testing.assert_close(loss_value, ref_loss, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ExecutorError, match="GPTConfig.attention"):
        GPTConfig(attention="flash3")
    with pytest.raises(ExecutorError, match="GPTConfig.loss"):
        GPTConfig(loss="none")
