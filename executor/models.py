"""Models tide records and trains: a small nanoGPT-like GPT of our own, and HF `transformers` GPT-2 /
Llama built from configs (no download), plus the named configs of the shipped traces.

Named configs (`MODELS`): "gpt-small" is CI-sized (a real CPU record takes a few seconds);
"gpt2-124m" is GPT-2 small; "gpt3-1.3b" / "gpt3-13b" / "gpt3-175b" follow the GPT-3 paper (Brown et
al. 2020, Table 2.1; 13B uses hidden 5120 as in Fuyou Table 4); "pstar-gpt-1b" / "-4b" / "-12b" are
PatrickStar's GPT-like models (Table 2: 16 heads, sequence 1024). The big ones use sequence 1024,
vocabulary 50257 and batch 8 per GPU: the planner takes the batch as given, so the batch of a trace
is part of its identity (re-record with `--batch` for another one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from executor.errors import ExecutorError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Shape of our GPT (nanoGPT's `GPTConfig`, keyword-only and checked)."""

    n_layer: int = 4
    """number of transformer blocks"""
    n_head: int = 4
    """attention heads per block; must divide n_embd"""
    n_embd: int = 128
    """hidden size"""
    vocab_size: int = 512
    """tokens in the vocabulary"""
    block_size: int = 64
    """longest sequence the position embedding covers"""
    dropout: float = 0.0
    """dropout probability (0 keeps recordings deterministic)"""
    bias: bool = True
    """biases in Linear and LayerNorm layers, like GPT-2"""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ExecutorError(f"GPTConfig.{name}: expected a positive integer, found {value!r}")
        if self.n_embd % self.n_head:
            raise ExecutorError(f"GPTConfig.n_embd: expected a multiple of n_head={self.n_head}, found {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ExecutorError(f"GPTConfig.dropout: expected a probability in [0, 1), found {self.dropout}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ExecutorError(f"GPTConfig: unknown key {unknown[0]!r}; expected one of {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        # the math path, written out: SDPA picks different fused kernels (and saves different
        # tensors) on CPU and on the meta device, and the two recordings must agree
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        if self.dropout > 0:
            att = F.dropout(att, self.dropout, self.training)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        y = self.c_proj(y)
        return F.dropout(y, self.dropout, self.training) if self.dropout > 0 else y


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_proj(F.gelu(self.c_fc(x)))
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-like decoder. The LM head is tied to `wte` and applied functionally in the root's
    forward (`F.linear(x, self.wte.weight)`): there is no `lm_head` module, so the tracer has to
    see parameter use that no module boundary announces."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """idx: (B, T) token ids. Returns logits (B, T, V), or the mean cross-entropy loss when
        targets (B, T) are given."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ExecutorError(f"GPT.forward: sequence of {T} tokens, the model covers block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)  # tied head, used functionally
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ----------------------------------------------------------------------------- named models

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A named model: which family, its config, and the batch it is recorded with."""

    family: str
    """"gpt" (ours), "hf-gpt2" (GPT2LMHeadModel) or "hf-llama" (LlamaForCausalLM)"""
    config: dict[str, Any]
    """keyword arguments of the family's config class"""
    batch: int
    """sequences per batch"""
    seq: int
    """tokens per sequence"""

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


def _gpt(n_layer: int, n_head: int, n_embd: int, *, vocab: int = 50257, seq: int = 1024, batch: int = 8) -> ModelSpec:
    config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab, block_size=seq).to_dict()
    return ModelSpec(family="gpt", config=config, batch=batch, seq=seq)


MODELS: dict[str, ModelSpec] = {
    "gpt-small": _gpt(4, 4, 128, vocab=512, seq=64, batch=4),
    "gpt2-124m": _gpt(12, 12, 768, seq=1024, batch=8),
    "gpt3-1.3b": _gpt(24, 16, 2048),
    "gpt3-13b": _gpt(40, 40, 5120),
    "gpt3-175b": _gpt(96, 96, 12288),
    "pstar-gpt-1b": _gpt(20, 16, 2048),
    "pstar-gpt-4b": _gpt(64, 16, 2304),
    "pstar-gpt-12b": _gpt(60, 16, 4096),
    # HF models, tiny: they prove the recorder works on unmodified third-party code
    "hf-gpt2-tiny": ModelSpec(family="hf-gpt2", config=dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256,
                                                            n_positions=64), batch=2, seq=32),
    "hf-llama-tiny": ModelSpec(family="hf-llama", config=dict(num_hidden_layers=2, num_attention_heads=4,
                                                              num_key_value_heads=2, hidden_size=64,
                                                              intermediate_size=128, vocab_size=256,
                                                              max_position_embeddings=64), batch=2, seq=32),
}


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ExecutorError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def build_gpt2(config: dict[str, Any]) -> nn.Module:
    """HF `GPT2LMHeadModel` from a config dict (no download; eager attention, no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel  # lazy: transformers takes seconds to import

    cfg = GPT2Config(**{"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False,
                        "bos_token_id": None, "eos_token_id": None, **config})
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # GPT-2 configs name none; say it instead of a warning per process
    return model


def build_llama(config: dict[str, Any]) -> nn.Module:
    """HF `LlamaForCausalLM` from a config dict (no download; eager attention, tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: transformers takes seconds to import

    cfg = LlamaConfig(**{"tie_word_embeddings": True, "use_cache": False, "bos_token_id": None,
                         "eos_token_id": None, "pad_token_id": None, **config})
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    return model


_BUILDERS: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    "gpt": lambda config: GPT(GPTConfig.from_dict(config)),
    "hf-gpt2": build_gpt2,
    "hf-llama": build_llama,
}


def model_spec(name: str, *, batch: int | None = None, seq: int | None = None) -> ModelSpec:
    """The named spec, with batch/sequence overridden (the position table grows to fit `seq`)."""
    if name not in MODELS:
        raise ExecutorError(f"model {name!r}: unknown; expected one of {', '.join(MODELS)}")
    spec = MODELS[name]
    config = dict(spec.config)
    if seq is not None:
        if seq < 1:
            raise ExecutorError(f"--seq: expected a positive number of tokens, found {seq}")
        key = {"gpt": "block_size", "hf-gpt2": "n_positions", "hf-llama": "max_position_embeddings"}[spec.family]
        config[key] = max(config[key], seq)
    if batch is not None and batch < 1:
        raise ExecutorError(f"--batch: expected a positive number of sequences, found {batch}")
    return dataclasses.replace(spec, config=config, batch=batch or spec.batch, seq=seq or spec.seq)


def build_model(spec: ModelSpec, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> nn.Module:
    """The model of `spec`, in training mode, with its parameters on `device` in `dtype`.

    On the meta device nothing is allocated and initialisation is skipped (shapes only)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = _BUILDERS[spec.family](spec.config)
    return model.to(dtype=dtype).train()


def make_batch(spec: ModelSpec, *, device: str | torch.device = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of random tokens as keyword arguments of the model's forward (inputs and targets)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq), generator=gen).to(device)
    if spec.family == "gpt":
        return {"idx": tokens, "targets": tokens}
    # explicit mask and positions: without them HF inspects token values (`.item()`), which the
    # meta device cannot do; with them CPU and meta run the same ops
    positions = torch.arange(spec.seq, device=device).expand(spec.batch, spec.seq)
    mask = torch.ones(spec.batch, spec.seq, dtype=torch.long, device=device)
    return {"input_ids": tokens, "labels": tokens, "attention_mask": mask, "position_ids": positions}


__all__ = ["GPT", "GPTConfig", "MODELS", "ModelSpec", "build_gpt2", "build_llama", "build_model",
           "make_batch", "model_spec", "parse_dtype"]
