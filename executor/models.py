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


ATTENTIONS = ("sdpa", "math")
LOSSES = ("chunked", "full")


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
    attention: str = "sdpa"
    """"sdpa": `F.scaled_dot_product_attention`, the fused kernel training runs (flash / memory-efficient
    on a GPU, the flash kernel on a CPU), which keeps q, k, v, the output and a (B, heads, T) logsumexp
    for backward; "math": the scores written out, which keeps the (B, heads, T, T) softmax as well"""
    loss: str = "chunked"
    """"chunked": fused linear + cross-entropy over `loss_chunk_tokens` tokens at a time, keeping only the
    hidden states and a per-token logsumexp (the logits of a chunk are recomputed in backward, as fused
    linear-cross-entropy kernels do); "full": `F.linear` then `F.cross_entropy`, which keeps the
    (B*T, vocab) log-softmax for backward"""
    loss_chunk_tokens: int = 1024
    """tokens per chunk of the chunked loss"""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "loss_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ExecutorError(f"GPTConfig.{name}: expected a positive integer, found {value!r}")
        if self.n_embd % self.n_head:
            raise ExecutorError(f"GPTConfig.n_embd: expected a multiple of n_head={self.n_head}, found {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ExecutorError(f"GPTConfig.dropout: expected a probability in [0, 1), found {self.dropout}")
        if self.attention not in ATTENTIONS:
            raise ExecutorError(f"GPTConfig.attention: expected one of {', '.join(ATTENTIONS)}, found {self.attention!r}")
        if self.loss not in LOSSES:
            raise ExecutorError(f"GPTConfig.loss: expected one of {', '.join(LOSSES)}, found {self.loss!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ExecutorError(f"GPTConfig: unknown key {unknown[0]!r}; expected one of {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention through the fused kernel training runs: what it saves for backward is q, k, v,
    the output and a (B, heads, T) fp32 logsumexp, never the (B, heads, T, T) scores.

    On CPU and GPU this is `F.scaled_dot_product_attention` (flash or memory-efficient on a GPU, the
    CPU flash kernel on a CPU). On the meta device SDPA has no fused kernel and falls back to the math
    path, so the meta recording calls the CPU flash op, whose meta function gives the same saved
    tensors as the CPU run (and, up to its rng state, as the GPU flash kernel: Dao et al. 2022 §3.1
    keeps O and the softmax statistics)."""
    if q.device.type == "meta":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal=True)[0]
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `x @ weight.T` against `targets`, `chunk` tokens at a time.

    Forward keeps x (already alive), the targets and a per-token fp32 logsumexp; the logits of a chunk
    exist only while that chunk is processed (in the compute dtype, upcast to fp32 chunk by chunk for
    the softmax). Backward recomputes each chunk's logits: one extra head matmul, the price fused
    linear-cross-entropy kernels pay to never hold (tokens, vocab) logits."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        n = x.shape[0]
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 softmax for half precision, as F.cross_entropy's kernels
        lse = torch.empty(n, dtype=acc, device=x.device)
        total = torch.zeros((), dtype=acc, device=x.device)
        for s in range(0, n, chunk):
            logits = F.linear(x[s:s + chunk], weight).to(acc)
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[s:s + chunk].unsqueeze(1)).squeeze(1)
            total = total + (lse[s:s + chunk] - picked).sum()
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.chunk = chunk
        return (total / n).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, targets, lse = ctx.saved_tensors
        n, chunk = x.shape[0], ctx.chunk
        scale = grad.to(lse.dtype) / n
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        # the weight grad accumulates in place in the weight's dtype, chunk by chunk (as Liger-Kernel's fused
        # linear cross-entropy does): no (vocab, hidden) temporary beyond the grad itself
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for s in range(0, n, chunk):
            xs = x[s:s + chunk]
            probs = (F.linear(xs, weight).to(lse.dtype) - lse[s:s + chunk].unsqueeze(1)).exp_()
            probs.scatter_add_(1, targets[s:s + chunk].unsqueeze(1),
                               torch.full((xs.shape[0], 1), -1.0, dtype=probs.dtype, device=probs.device))
            g = (probs * scale).to(x.dtype)
            if grad_x is not None:
                grad_x[s:s + chunk] = g @ weight
            if grad_w is not None:
                grad_w.addmm_(g.t(), xs)
        return grad_x, grad_w, None, None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.attention = config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.attention == "sdpa":
            y = _fused_attention(q, k, v, self.dropout if self.training else 0.0)
        else:
            # the math path, written out: the (B, nh, T, T) softmax is kept for backward
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            if self.dropout > 0:
                att = F.dropout(att, self.dropout, self.training)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
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
        if targets is not None and self.config.loss == "chunked":
            return _ChunkedLinearCrossEntropy.apply(x.view(B * T, -1), self.wte.weight, targets.reshape(-1),
                                                    self.config.loss_chunk_tokens)
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
           "make_batch", "model_spec", "parse_dtype", "ATTENTIONS", "LOSSES"]
