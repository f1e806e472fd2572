"""MomentHooks: the moment events of an iteration, in order, once each (executor/hooks.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from executor.errors import ExecutorError
from executor.hooks import MomentEvent, MomentHooks, find_blocks, find_units
from executor.models import GPT, GPTConfig, build_model, make_batch, model_spec
from schemas.trace import MomentKind as K
from schemas.trace import Phase

FWD, BWD = Phase.FORWARD, Phase.BACKWARD


def tiny_gpt(n_layer: int = 2, device: str = "cpu") -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, block_size=8))


def tokens(device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)


def run_iterations(model: nn.Module, step, n: int = 1) -> list[list[MomentEvent]]:
    blocks = find_blocks(model)
    events: list[MomentEvent] = []
    per_iteration = []
    with MomentHooks(model, blocks=blocks, units=find_units(model, blocks), on_event=events.append):
        for _ in range(n):
            start = len(events)
            step()
            per_iteration.append(events[start:])
    return per_iteration


def expected_gpt_events(n_layer: int) -> list[tuple]:
    units = [("wte", -1), ("wpe", -1), *((f"h.{i}", i) for i in range(n_layer)), ("ln_f", -1)]
    fwd = [(K.PRE_FORWARD, FWD, "", -1)]
    for name, block in units:
        fwd += [(K.PRE_FORWARD, FWD, name, block), (K.POST_FORWARD, FWD, name, block)]
    fwd.append((K.POST_FORWARD, FWD, "", -1))
    bwd = [(K.PRE_BACKWARD, BWD, "", -1)]
    for name, block in reversed(units):
        bwd += [(K.PRE_BACKWARD, BWD, name, block), (K.POST_BACKWARD, BWD, name, block)]
    bwd.append((K.POST_BACKWARD, BWD, "", -1))
    return fwd + bwd


@pytest.mark.parametrize("n_layer", [1, 3])
def test_events_follow_the_structure_in_order_once_per_iteration(n_layer):
    model, idx = tiny_gpt(n_layer), tokens()
    iterations = run_iterations(model, lambda: model(idx, idx).backward(), n=2)
    expected = expected_gpt_events(n_layer)
    assert len(expected) == 4 * (n_layer + 3) + 4
    for events in iterations:
        assert [tuple(e) for e in events] == expected


def test_meta_device_gives_the_same_events():
    cpu, meta = tiny_gpt(2), tiny_gpt(2, device="meta")
    idx_cpu, idx_meta = tokens(), tokens("meta")
    (ev_cpu,) = run_iterations(cpu, lambda: cpu(idx_cpu, idx_cpu).backward())
    (ev_meta,) = run_iterations(meta, lambda: meta(idx_meta, idx_meta).backward())
    assert ev_cpu == ev_meta


def test_install_twice_and_remove_are_idempotent():
    model, idx = tiny_gpt(1), tokens()
    blocks = find_blocks(model)
    events: list[MomentEvent] = []
    hooks = MomentHooks(model, blocks=blocks, units=find_units(model, blocks), on_event=events.append)
    hooks.install()
    hooks.install()
    model(idx, idx).backward()
    assert len(events) == len(expected_gpt_events(1))
    hooks.remove()
    hooks.remove()
    model(idx, idx).backward()
    assert len(events) == len(expected_gpt_events(1))


def test_checkpoint_recomputation_fires_no_extra_events():
    model, idx = tiny_gpt(2), tokens()
    plain = run_iterations(model, lambda: model(idx, idx).backward())[0]
    for block in model.h:  # recompute each block in backward (non-reentrant checkpoint)
        block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
    recomputed = run_iterations(model, lambda: model(idx, idx).backward())[0]
    assert recomputed == plain


def test_forward_without_grad_fires_forward_events_only_and_next_iteration_is_complete():
    model, idx = tiny_gpt(1), tokens()

    def no_grad_then_train():
        with torch.no_grad():
            model(idx, idx)
        model(idx, idx).backward()

    (events,) = run_iterations(model, no_grad_then_train)
    n_forward = len(expected_gpt_events(1)) // 2
    assert all(e.phase is FWD for e in events[:n_forward])
    assert [tuple(e) for e in events[n_forward:]] == expected_gpt_events(1)


class DictUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return {"y": self.lin(x), "aux": (torch.zeros(1),)}


class TupleUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, scale):
        return self.lin(x) * scale, x.detach()


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x):
        return self.lin(x)


class Mixed(nn.Module):
    """Units returning a dict and a tuple, one taking a kwarg, one whose output needs no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = Frozen()
        self.layers = nn.ModuleList([DictUnit(), DictUnit()])
        self.tail = TupleUnit()

    def forward(self, x):
        x = self.frozen(x)  # input and params need no grad: no backward events
        for layer in self.layers:
            x = layer(x)["y"]
        y, _ = self.tail(x, scale=torch.tensor(2.0, requires_grad=True))
        return y.sum()


def test_dict_and_tuple_outputs_kwargs_and_units_without_backward():
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(3, 4)
    assert find_blocks(model) == ["layers.0", "layers.1"]
    assert find_units(model, find_blocks(model)) == ["frozen.lin", "layers.0", "layers.1", "tail.lin"]
    (events,) = run_iterations(model, lambda: model(x).backward())
    got = [(e.kind, e.module) for e in events]
    assert got == [
        (K.PRE_FORWARD, ""), (K.PRE_FORWARD, "frozen.lin"), (K.POST_FORWARD, "frozen.lin"),
        (K.PRE_FORWARD, "layers.0"), (K.POST_FORWARD, "layers.0"),
        (K.PRE_FORWARD, "layers.1"), (K.POST_FORWARD, "layers.1"),
        (K.PRE_FORWARD, "tail.lin"), (K.POST_FORWARD, "tail.lin"), (K.POST_FORWARD, ""),
        (K.PRE_BACKWARD, ""), (K.PRE_BACKWARD, "tail.lin"), (K.POST_BACKWARD, "tail.lin"),
        (K.PRE_BACKWARD, "layers.1"), (K.POST_BACKWARD, "layers.1"),
        (K.PRE_BACKWARD, "layers.0"), (K.POST_BACKWARD, "layers.0"), (K.POST_BACKWARD, ""),
    ]
    assert [e.block for e in events if e.module == "layers.1"] == [1, 1, 1, 1]


def test_post_backward_from_param_grads_when_no_input_needs_grad():
    """The first layer sees a leaf input without grad: its post_backward comes from its params."""
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    layers = model[0]
    blocks = find_blocks(model)
    assert blocks == ["0.0", "0.1"]
    events: list[MomentEvent] = []
    x = torch.randn(2, 4)
    hooks = MomentHooks(model, blocks=blocks, units=find_units(model, blocks), on_event=events.append)
    with hooks:
        # call the root so the iteration starts; the list is used by hand inside a wrapper
        model.forward = lambda inp: layers[1](layers[0](inp))
        model(x).sum().backward()
    kinds = [(e.kind, e.module) for e in events if e.phase is BWD]
    assert kinds == [(K.PRE_BACKWARD, ""), (K.PRE_BACKWARD, "0.1"), (K.POST_BACKWARD, "0.1"),
                     (K.PRE_BACKWARD, "0.0"), (K.POST_BACKWARD, "0.0"), (K.POST_BACKWARD, "")]
    assert kinds.index((K.POST_BACKWARD, "0.0")) < kinds.index((K.POST_BACKWARD, ""))


def test_hf_gpt2_events():
    spec = model_spec("hf-gpt2-tiny")
    model, batch = build_model(spec), make_batch(spec)
    (events,) = run_iterations(model, lambda: model(**batch).loss.backward())
    units = ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"]
    assert [e.module for e in events if e.kind is K.PRE_FORWARD] == ["", *units]
    assert [e.module for e in events if e.kind is K.POST_BACKWARD] == [*reversed(units), ""]
    assert len(events) == 4 * len(units) + 4


def test_find_blocks_and_units_of_our_gpt():
    model = tiny_gpt(3)
    blocks = find_blocks(model)
    assert blocks == ["h.0", "h.1", "h.2"]
    assert find_units(model, blocks) == ["wte", "wpe", "h.0", "h.1", "h.2", "ln_f"]
    assert find_blocks(nn.Linear(2, 2)) == []
    assert find_units(nn.Sequential(nn.Linear(2, 2)), []) == ["0"]


def test_bad_unit_names_are_refused():
    model = tiny_gpt(1)
    with pytest.raises(ExecutorError, match="'nope' is not a submodule"):
        MomentHooks(model, blocks=[], units=["nope"], on_event=print)
    with pytest.raises(ExecutorError, match="not among the units"):
        MomentHooks(model, blocks=["h.0"], units=["wte"], on_event=print)


def test_an_iteration_after_a_failed_backward_is_complete():
    model, idx = tiny_gpt(1), tokens()

    def boom(grad):
        raise RuntimeError("boom")

    def failing_then_good():
        # the embedding's output grad comes late in backward: the root is already in BACKWARD
        def watch(module, args, out):
            out.register_hook(boom)

        handle = model.wte.register_forward_hook(watch)
        with pytest.raises(RuntimeError, match="boom"):
            model(idx, idx).backward()
        handle.remove()
        model(idx, idx).backward()

    (events,) = run_iterations(model, failing_then_good)
    n = len(expected_gpt_events(1))
    assert (K.PRE_BACKWARD, "h.0") in [(e.kind, e.module) for e in events[:-n]]  # the failed one got that far
    assert [tuple(e) for e in events[-n:]] == expected_gpt_events(1)


class CheckpointedStack(nn.Module):
    """The parent checkpoints each layer's __call__: recomputation re-enters the layers' hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x.sum()


def test_recomputation_through_module_call_is_ignored():
    torch.manual_seed(0)
    model, x = CheckpointedStack(), torch.randn(2, 4, requires_grad=True)
    (events,) = run_iterations(model, lambda: model(x).backward())
    got = [(e.kind, e.module) for e in events]
    assert len(got) == len(set(got)) == 4 * 2 + 4
    assert got[6:] == [(K.PRE_BACKWARD, ""), (K.PRE_BACKWARD, "layers.1"), (K.POST_BACKWARD, "layers.1"),
                       (K.PRE_BACKWARD, "layers.0"), (K.POST_BACKWARD, "layers.0"), (K.POST_BACKWARD, "")]
