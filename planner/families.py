"""Analytic traces of model families, without torch (tests, `maxsize`, and sizes nobody recorded).

`gpt_trace` builds the trace that `python -m executor record --meta` records for tide's own GPT
(`executor.models.GPT`); what it reproduces exactly and what it models is Note [gpt trace] above
`gpt_trace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schemas.trace import (
    DTYPE_BYTES,
    Activation,
    Block,
    DType,
    Moment,
    MomentKind,
    OptimizerKind,
    Phase,
    Recording,
    TensorInfo,
    TimeSource,
    Trace,
    TraceMeta,
)

GPT2_VOCAB = 50257
_INDEX_BYTES = 8  # token and position ids are int64
_LN_STAT_BYTES = 4  # LayerNorm keeps fp32 mean and rstd per token
_MASK_SLACK_BYTES = 983040  # what the recorder's forward peak adds beyond the formula (mask and small buffers)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Sizes:
    """Byte sizes of one configuration."""

    itemsize: int
    hidden: int  # s b h elements x itemsize: one hidden-state tensor
    attention: int  # a s^2 b elements x itemsize: one attention-score tensor
    logits: int  # b s V x itemsize
    wte: int  # the embedding (and its grad)
    tokens: int


# Note [gpt trace]:
# `gpt_trace` builds the trace that `python -m executor record --meta` records for tide's own GPT
# (`executor.models.GPT`, nanoGPT-like: learned positions, pre-LayerNorm blocks of nn.Linear layers
# with biases, no dropout, LM head tied to `wte` and applied functionally in the root's forward).
# Attention is the fused SDPA kernel and the loss head the chunked linear + cross-entropy by default
# (`attention="sdpa"`, `loss="chunked"`, as the model records them); `attention="math"` /
# `loss="full"` give the written-out variants (the scores and the full logits kept). Units are the modules with moments of their own (`executor.hooks`): `wte`,
# `wpe`, the blocks `h.0 .. h.L-1`, `ln_f`; the moment sequence is
#
#     root pre_forward, (wte, wpe, h.0 .. h.L-1, ln_f) pre/post_forward   [head + loss after ln_f]
#     root post_forward, root pre_backward                                 [loss + head backward]
#     (ln_f, h.L-1 .. h.0, wpe, wte) pre/post_backward, root post_backward, optimizer_step
#
# What is exact (equal to a meta recording of the same config): tensors (names, shapes, order), the
# moment sequence and the tensors each moment touches, FLOPs (a unit's forward: 2 x weight-matrix
# params x tokens, plus 4 b s^2 h for a block's attention, QK^T and AV; the head 2 V h tokens;
# backward twice the forward, Narayanan et al. 2021), and the activations a block saves: 16 s b h
# elements (LayerNorm inputs 2; inputs of c_attn, attention c_proj, c_fc 3; q, k, v 3; GELU input
# and MLP c_proj input 4 + 4; cf. Korthikanti et al. 2022 Eq. 1, here without dropout masks) and the
# LayerNorm statistics; with SDPA the fp32 (a, s, b) logsumexp, written out the a s^2 b softmax and
# the s x s causal mask. SDPA's backward FLOPs are torch's flop-counter figure (5 matmuls: 10 b s^2 h,
# the scores recomputed); the chunked head's backward recomputes the logits (3 x its forward). What is a model: the transient
# part of the non-model bytes (buffers alive only during one unit's work), fitted to the recorder's
# meta traces of GPT-3 1.3B / 175B and PatrickStar 4B: a block's forward peaks in attention at
# 2 a s^2 b - 9 s b h elements over what it saves; its backward holds the embedding's grad and the
# flowing hidden grads (5 s b h, or the softmax grad + 2 s b h, whichever is more).


def gpt_trace(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    vocab: int = GPT2_VOCAB,
    positions: int | None = None,
    dtype: str = "bfloat16",
    world_size: int = 1,
    name: str | None = None,
    attention: str = "sdpa",
    loss: str = "chunked",
    loss_chunk_tokens: int = 1024,
) -> Trace:
    """The trace of one training iteration of tide's GPT (see the module docstring)."""
    if attention not in ("sdpa", "math") or loss not in ("chunked", "full") or loss_chunk_tokens < 1:
        raise ValueError(f"gpt_trace: attention sdpa|math, loss chunked|full and a positive loss_chunk_tokens expected, "
                         f"found {attention!r}, {loss!r}, {loss_chunk_tokens}")
    if min(layers, hidden, heads, seq, batch, vocab, world_size) < 1 or hidden % heads:
        raise ValueError(f"gpt_trace: positive sizes with hidden % heads == 0 expected, found layers={layers} "
                         f"hidden={hidden} heads={heads} seq={seq} batch={batch} vocab={vocab} world_size={world_size}")
    compute_dtype = DType(dtype)
    itemsize = DTYPE_BYTES[compute_dtype]
    positions = positions or seq
    tensors = _gpt_tensors(layers, hidden, vocab, positions, compute_dtype)
    sizes = _Sizes(itemsize=itemsize, hidden=seq * batch * hidden * itemsize, attention=heads * seq * seq * batch * itemsize,
                   logits=batch * seq * vocab * itemsize, wte=vocab * hidden * itemsize, tokens=batch * seq)
    moments, activations, block_flops = _moments(tensors, layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch,
                                                 vocab=vocab, sizes=sizes, sdpa=attention == "sdpa",
                                                 chunk=min(loss_chunk_tokens, seq * batch) if loss == "chunked" else 0)
    blocks = tuple(Block(id=i, module=f"h.{i}", forward_flops=block_flops, forward_seconds=0.0, input_bytes=sizes.hidden)
                   for i in range(layers))
    meta = TraceMeta(
        model_name=name or f"gpt-{layers}x{hidden}",
        model_config={"family": "gpt", "batch": batch, "seq": seq, "n_layer": layers, "n_head": heads, "n_embd": hidden,
                      "vocab_size": vocab, "block_size": positions, "dropout": 0.0, "bias": True,
                      "attention": attention, "loss": loss, "loss_chunk_tokens": loss_chunk_tokens},
        batch_shape=(batch, seq),
        compute_dtype=compute_dtype,
        world_size=world_size,
        torch_version="none (planner.families, analytic)",
        device="meta",
        recording=Recording.META,
        time_source=TimeSource.FLOPS,
        optimizer=OptimizerKind.ADAMW,
    )
    return Trace(meta=meta, tensors=tensors, blocks=blocks, moments=moments, activations=activations)


def gpt_param_count(*, layers: int, hidden: int, vocab: int = GPT2_VOCAB, positions: int = 1024) -> int:
    """Parameters of tide's GPT (tied embedding counted once)."""
    return layers * (12 * hidden * hidden + 13 * hidden) + vocab * hidden + positions * hidden + 2 * hidden


def _gpt_tensors(layers: int, h: int, vocab: int, positions: int, dtype: DType) -> tuple[TensorInfo, ...]:
    """Parameters in `named_parameters()` order; nn.Linear weights are (out, in)."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (vocab, h)), ("wpe.weight", (positions, h))]
    for i in range(layers):
        p = f"h.{i}"
        shapes += [
            (f"{p}.ln_1.weight", (h,)), (f"{p}.ln_1.bias", (h,)),
            (f"{p}.attn.c_attn.weight", (3 * h, h)), (f"{p}.attn.c_attn.bias", (3 * h,)),
            (f"{p}.attn.c_proj.weight", (h, h)), (f"{p}.attn.c_proj.bias", (h,)),
            (f"{p}.ln_2.weight", (h,)), (f"{p}.ln_2.bias", (h,)),
            (f"{p}.mlp.c_fc.weight", (4 * h, h)), (f"{p}.mlp.c_fc.bias", (4 * h,)),
            (f"{p}.mlp.c_proj.weight", (h, 4 * h)), (f"{p}.mlp.c_proj.bias", (h,)),
        ]
    shapes += [("ln_f.weight", (h,)), ("ln_f.bias", (h,))]
    itemsize = DTYPE_BYTES[dtype]
    return tuple(
        TensorInfo(id=i, names=(name,), shape=shape, dtype=dtype, bytes=math.prod(shape) * itemsize, trainable=True)
        for i, (name, shape) in enumerate(shapes)
    )


@dataclass(slots=True)
class _Draft:
    """A moment being built: its non-model bytes are known once every activation is placed."""

    phase: Phase
    kind: MomentKind
    module: str
    block: int
    tensors: tuple[int, ...] = ()
    flops: int = 0
    transient_bytes: int = 0  # buffers alive only during this moment's work


@dataclass(slots=True)
class _Saved:
    """An activation being built (consumers are filled in when the backward moments exist)."""

    block: int
    bytes: int
    produced_at: int
    consumer: str  # unit whose backward consumes it ("" = the root's: loss and head)
    recompute_flops: int = 0


def _block_saved(sizes: _Sizes, seq: int, flops_fc: int, *, sdpa: bool = False, heads: int = 1, flops_qkv: int = 0,
                 flops_att: int = 0) -> list[tuple[int, int]]:
    """(bytes, recompute FLOPs) of what one block's forward saves, in autograd's order."""
    x, stats = sizes.hidden, sizes.tokens * _LN_STAT_BYTES
    if sdpa:  # q, k, v are views of c_attn's output; the kernel keeps its output and an fp32 logsumexp
        return [
            (x, 0), (stats, 0), (stats, 0), (x, 0),  # ln_1: input, mean, rstd; c_attn input
            (3 * x, flops_qkv),  # c_attn output (q, k, v)
            # SDPA logsumexp (b, a, s) fp32, and its output: laid out (b, s, a, d) by the kernel, so the
            # transpose + contiguous before c_proj is a view and c_proj's input is the same storage
            (heads * sizes.tokens * 4, flops_att), (x, flops_att),
            (x, 0), (stats, 0), (stats, 0), (x, 0),  # ln_2: input, mean, rstd; c_fc input
            (4 * x, flops_fc), (4 * x, 0),  # gelu input (c_fc output), c_proj input (gelu output)
        ]
    return [
        (x, 0), (stats, 0), (stats, 0), (x, 0),  # ln_1: input, mean, rstd; c_attn input
        (x, 0), (x, 0),  # q, k
        (seq * seq, 0),  # causal mask (s x s bools)
        (sizes.attention, 0),  # softmax output
        (x, 0), (x, 0),  # v, c_proj input
        (x, 0), (stats, 0), (stats, 0), (x, 0),  # ln_2: input, mean, rstd; c_fc input
        (4 * x, flops_fc), (4 * x, 0),  # gelu input (c_fc output), c_proj input (gelu output)
    ]


def _moments(tensors: tuple[TensorInfo, ...], *, layers: int, hidden: int, heads: int, seq: int, batch: int, vocab: int,
             sizes: _Sizes, sdpa: bool, chunk: int) -> tuple[tuple[Moment, ...], tuple[Activation, ...], int]:
    h, tokens = hidden, sizes.tokens
    ids = {t.names[0]: t.id for t in tensors}
    block_ids = [tuple(ids[n] for n in ids if n.startswith(f"h.{i}.")) for i in range(layers)]
    att_flops = 4 * batch * seq * seq * h
    block_flops = 2 * 12 * h * h * tokens + att_flops  # matmul weights only (biases, LN: noise)
    # torch's flop counter charges SDPA's backward 5 matmuls (the scores recomputed), the written-out one 4
    block_backward_flops = 2 * block_flops + (att_flops // 2 if sdpa else 0)
    head_flops = 2 * vocab * h * tokens
    fc_flops = 2 * tokens * h * 4 * h
    x, att, logits = sizes.hidden, sizes.attention, sizes.logits
    idx_bytes, pos_bytes = tokens * _INDEX_BYTES, seq * _INDEX_BYTES
    stats = tokens * _LN_STAT_BYTES
    grads_flowing = sizes.wte + x  # backward: the tied embedding's grad (from the head) and the hidden grad

    drafts: list[_Draft] = []
    saved: list[_Saved] = []

    def moment(phase: Phase, kind: MomentKind, module: str, block: int = -1, tensors_: tuple[int, ...] = (),
               flops: int = 0, transient: int = 0) -> int:
        drafts.append(_Draft(phase, kind, module, block, tensors_, flops, transient))
        return len(drafts) - 1

    F, B = Phase.FORWARD, Phase.BACKWARD
    moment(F, MomentKind.PRE_FORWARD, "", transient=idx_bytes + pos_bytes)
    at = moment(F, MomentKind.PRE_FORWARD, "wte", -1, (ids["wte.weight"],), transient=x)
    saved.append(_Saved(block=-1, bytes=idx_bytes, produced_at=at, consumer="wte"))
    moment(F, MomentKind.POST_FORWARD, "wte", transient=x)
    at = moment(F, MomentKind.PRE_FORWARD, "wpe", -1, (ids["wpe.weight"],), transient=x + seq * h * sizes.itemsize)
    saved.append(_Saved(block=-1, bytes=pos_bytes, produced_at=at, consumer="wpe"))
    moment(F, MomentKind.POST_FORWARD, "wpe", transient=2 * x + seq * h * sizes.itemsize)
    # fitted to the recorder's meta traces (module docstring): written out, the forward peaks in the
    # scores; fused, in the block's widest intermediate
    forward_peak = 2 * x if sdpa else max(2 * att - 9 * x + _MASK_SLACK_BYTES, 2 * x)
    for i in range(layers):
        at = moment(F, MomentKind.PRE_FORWARD, f"h.{i}", i, block_ids[i], block_flops, transient=forward_peak)
        for nbytes, rflops in _block_saved(sizes, seq, fc_flops, sdpa=sdpa, heads=heads, flops_qkv=2 * tokens * h * 3 * h,
                                           flops_att=att_flops):
            saved.append(_Saved(block=i, bytes=nbytes, produced_at=at, consumer=f"h.{i}",
                                recompute_flops=rflops))
        moment(F, MomentKind.POST_FORWARD, f"h.{i}", i, transient=x)
    at = moment(F, MomentKind.PRE_FORWARD, "ln_f", -1, (ids["ln_f.weight"], ids["ln_f.bias"]), transient=x)
    saved += [_Saved(block=-1, bytes=n, produced_at=at, consumer="ln_f") for n in (x, stats, stats)]
    # the head and the loss run in the work after ln_f's post_forward (no module boundary of their own)
    if chunk:
        # one chunk's logits at a time: in the compute dtype, and (half precision) upcast to fp32 with a
        # softmax temporary; kept: the hidden states and an fp32 logsumexp per token. Backward holds the
        # weight grad (accumulated in place), the hidden grad and one chunk's logits, fp32 probabilities
        # and their scaled copies (fitted to the recorder's meta traces of GPT-3 1.3B / 13B / 175B)
        cv, half = chunk * vocab, sizes.itemsize != 4
        head_forward = cv * (sizes.itemsize + 8 if half else 4) + chunk * 4 + 4
        head_backward = sizes.wte + x + cv * (sizes.itemsize + 12 if half else 9) + 8  # fp32: the CPU recording
        at = moment(F, MomentKind.POST_FORWARD, "ln_f", -1, (ids["wte.weight"],), head_flops, transient=head_forward)
        saved += [_Saved(block=-1, bytes=n, produced_at=at, consumer="") for n in (x, tokens * 4)]
        moment(F, MomentKind.POST_FORWARD, "", transient=4)
        backward_at = {"": moment(B, MomentKind.PRE_BACKWARD, "", -1, (ids["wte.weight"],), 3 * head_flops,
                                  transient=head_backward)}
    else:
        at = moment(F, MomentKind.POST_FORWARD, "ln_f", -1, (ids["wte.weight"],), head_flops, transient=logits + sizes.itemsize)
        saved += [_Saved(block=-1, bytes=n, produced_at=at, consumer="") for n in (x, logits, sizes.itemsize)]
        moment(F, MomentKind.POST_FORWARD, "", transient=4)
        backward_at = {"": moment(B, MomentKind.PRE_BACKWARD, "", -1, (ids["wte.weight"],), 2 * head_flops,
                                  transient=2 * logits + sizes.itemsize)}
    backward_at["ln_f"] = moment(B, MomentKind.PRE_BACKWARD, "ln_f", -1, (ids["ln_f.weight"], ids["ln_f.bias"]),
                                 transient=grads_flowing + x)
    moment(B, MomentKind.POST_BACKWARD, "ln_f", transient=grads_flowing)
    # written out: the softmax grad; fused: the MLP's c_fc backward (its 4h-wide grad and weight grad)
    backward_peak = max(5 * x, 4 * x + 4 * h * h * sizes.itemsize) if sdpa else max(5 * x, att + 2 * x)
    for i in reversed(range(layers)):
        backward_at[f"h.{i}"] = moment(B, MomentKind.PRE_BACKWARD, f"h.{i}", i, block_ids[i], block_backward_flops,
                                       transient=grads_flowing + backward_peak)
        moment(B, MomentKind.POST_BACKWARD, f"h.{i}", i, transient=grads_flowing)
    backward_at["wpe"] = moment(B, MomentKind.PRE_BACKWARD, "wpe", -1, (ids["wpe.weight"],),
                                transient=grads_flowing + 2 * seq * h * sizes.itemsize)
    moment(B, MomentKind.POST_BACKWARD, "wpe", transient=grads_flowing)
    backward_at["wte"] = moment(B, MomentKind.PRE_BACKWARD, "wte", -1, (ids["wte.weight"],), transient=3 * sizes.wte)
    # the token ids stay referenced by the caller until the step
    moment(B, MomentKind.POST_BACKWARD, "wte", transient=idx_bytes + 4)
    moment(B, MomentKind.POST_BACKWARD, "", transient=idx_bytes + 4)
    moment(Phase.OPTIMIZER, MomentKind.OPTIMIZER_STEP, "", -1, tuple(t.id for t in tensors if t.trainable),
           transient=idx_bytes)

    activations = []
    for s in saved:
        consumers = (backward_at[s.consumer],)
        if s.consumer == "wte":  # the token ids: the loss's targets and the embedding's backward
            consumers = (backward_at[""], backward_at["wte"])
        activations.append(Activation(id=len(activations), block=s.block, bytes=s.bytes, produced_at=s.produced_at,
                                      consumed_at=consumers, recompute_flops=s.recompute_flops, recompute_seconds=0.0))
    alive = [0] * (len(drafts) + 1)
    for a in activations:
        alive[a.produced_at] += a.bytes
        alive[max(a.consumed_at) + 1] -= a.bytes
    moments, live = [], 0
    for i, d in enumerate(drafts):
        live += alive[i]
        moments.append(Moment(id=i, phase=d.phase, kind=d.kind, module=d.module, block=d.block, tensors=d.tensors,
                              compute_seconds=0.0, flops=d.flops, non_model_bytes=live + d.transient_bytes))
    return tuple(moments), tuple(activations), block_flops


__all__ = ["GPT2_VOCAB", "gpt_param_count", "gpt_trace"]
