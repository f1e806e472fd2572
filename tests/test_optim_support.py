"""Helpers shared by the optimizer/state/nvme tests (no tests here): a chunk layout built straight
from a model, and a fake chunk store (dict of flat tensors) that stands in for the engine's."""

from __future__ import annotations

import torch
from torch import nn

from schemas.schedule import Chunk, ChunkLayout, ChunkList, TensorSlot
from schemas.trace import DType

TORCH_DTYPE = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}


def layout_for(model: nn.Module, *, chunk_elements: int, compute: DType = DType.FLOAT32, reverse: bool = False) -> ChunkLayout:
    """Tensors packed in named_parameters order (or reversed, so chunk order != param order); tied
    params once with all their names; a tensor larger than a chunk gets a chunk of its own size."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    order = list(params)
    if reverse:
        order.reverse()
    chunks: list[list[int]] = []  # [elements, used]
    slots = []
    for tid, key in enumerate(order):
        p = params[key]
        n = p.numel()
        if n > chunk_elements:
            chunks.append([n, n])
            cid, off = len(chunks) - 1, 0
        else:
            if not chunks or chunks[-1][0] != chunk_elements or chunks[-1][1] + n > chunk_elements:
                chunks.append([chunk_elements, 0])
            cid, off = len(chunks) - 1, chunks[-1][1]
            chunks[-1][1] += n
        slots.append(TensorSlot(tensor=tid, names=tuple(names[key]), shape=tuple(p.shape), chunk=cid,
                                offset_elements=off, numel=n, trainable=p.requires_grad))
    lists = (ChunkList.PARAM, ChunkList.GRAD) + ((ChunkList.MASTER,) if compute != DType.FLOAT32 else ()) + (ChunkList.M, ChunkList.V)
    dtypes = {lst: (compute if lst in (ChunkList.PARAM, ChunkList.GRAD) else DType.FLOAT32) for lst in lists}
    return ChunkLayout(chunk_elements=chunk_elements, lists=lists, list_dtypes=dtypes,
                       chunks=tuple(Chunk(id=i, elements=e, used_elements=u, block=-1, comm_group=i, owner_rank=0)
                                    for i, (e, u) in enumerate(chunks)),
                       tensors=tuple(slots))


class FakeStore:
    """Flat chunk buffers per chunk list (what the engine's store gives executor.state)."""

    def __init__(self, layout: ChunkLayout) -> None:
        self.layout = layout
        self.buffers = {
            (lst, c.id): torch.zeros(c.elements, dtype=TORCH_DTYPE[layout.list_dtypes[lst]])
            for lst in layout.lists for c in layout.chunks
        }

    def read_chunk(self, lst: ChunkList, chunk: int) -> torch.Tensor:
        return self.buffers[(lst, chunk)].clone()

    def write_chunk(self, lst: ChunkList, chunk: int, tensor: torch.Tensor) -> None:
        self.buffers[(lst, chunk)].copy_(tensor)

    def slot_view(self, lst: ChunkList, slot: TensorSlot) -> torch.Tensor:
        return self.buffers[(lst, slot.chunk)][slot.offset_elements:slot.offset_elements + slot.numel].view(slot.shape)


def bind(model: nn.Module, store: FakeStore) -> None:
    """Copy the model's params into the PARAM (and MASTER) chunks and point param.data at them."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for slot in store.layout.tensors:
            p = by_name[slot.names[0]]
            view = store.slot_view(ChunkList.PARAM, slot)
            if ChunkList.MASTER in store.layout.lists:
                store.slot_view(ChunkList.MASTER, slot).copy_(p.detach().float())
            view.copy_(p.detach())
            p.data = view


def grads_to_chunks(model: nn.Module, store: FakeStore) -> set[int]:
    """Copy param.grad into the GRAD chunks; returns the tensor ids whose grad is None."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    missing = set()
    for slot in store.layout.tensors:
        p = by_name[slot.names[0]]
        if p.grad is None:
            missing.add(slot.tensor)
            store.slot_view(ChunkList.GRAD, slot).zero_()
        else:
            store.slot_view(ChunkList.GRAD, slot).copy_(p.grad)
        p.grad = None
    return missing


class TinyLM(nn.Module):
    """Tied embedding/head, norms with biases, a parameter used twice, an unused parameter."""

    def __init__(self, vocab: int = 37, dim: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.ones(dim))
        self.unused = nn.Parameter(torch.randn(5))
        self.register_buffer("mask", torch.ones(dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln1(x)))) * self.scale
        x = self.ln2(x) * self.scale * self.mask  # scale used twice
        return self.head(x)


def lm_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def param_groups(model: nn.Module, *, decay_lr: float = 3e-3, no_decay_lr: float = 1e-3) -> list[dict]:
    """No weight decay on norms and biases (1-D params), another lr for them."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=0.1, lr=decay_lr), dict(params=no_decay, weight_decay=0.0, lr=no_decay_lr)]
