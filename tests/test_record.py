"""executor.record: the trace of one iteration is complete, true and deterministic (issue 3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from executor.cli import main as executor_main
from executor.errors import ExecutorError
from executor.models import GPT, GPTConfig, build_model, make_batch, model_spec
from executor.recorder import record
from schemas.trace import MomentKind as K
from schemas.trace import Phase, Recording, TimeSource, Trace

TINY = dict(n_head=2, n_embd=16, vocab_size=32, block_size=8)


def record_gpt(n_layer: int = 2, device: str = "cpu", **kw) -> Trace:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=n_layer, **TINY)
    with torch.device(device):
        model = GPT(config)
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    return record(model, {"idx": idx, "targets": idx}, model_name="tiny-gpt", model_config=config.to_dict(), **kw)


def structure(trace: Trace) -> list[tuple]:
    return [(m.phase, m.kind, m.module, m.block, m.tensors, m.flops, m.non_model_bytes) for m in trace.moments]


def activations(trace: Trace) -> list[tuple]:
    return [(a.block, a.bytes, a.produced_at, a.consumed_at, a.recompute_flops) for a in trace.activations]


@pytest.fixture(scope="module")
def gpt_cpu() -> Trace:
    return record_gpt(2)


@pytest.fixture(scope="module")
def gpt_meta() -> Trace:
    return record_gpt(2, device="meta")


@pytest.mark.parametrize("n_layer", [1, 3])
def test_moment_count_follows_the_structure(n_layer):
    trace = record_gpt(n_layer, device="meta")
    units = n_layer + 3  # wte, wpe, the blocks, ln_f
    assert len(trace.moments) == (2 + 2 * units) * 2 + 1  # root + units, forward and backward, optimizer
    assert len(trace.blocks) == n_layer
    assert [b.module for b in trace.blocks] == [f"h.{i}" for i in range(n_layer)]
    for b in range(n_layer):
        kinds = [m.kind for m in trace.moments if m.block == b]
        assert kinds == [K.PRE_FORWARD, K.POST_FORWARD, K.PRE_BACKWARD, K.POST_BACKWARD]
    assert trace.moments[-1].phase is Phase.OPTIMIZER


def test_tensors_are_the_parameters_once_each(gpt_cpu):
    model = GPT(GPTConfig(n_layer=2, **TINY))
    assert len(gpt_cpu.tensors) == len(list(model.parameters()))
    assert gpt_cpu.param_count == sum(p.numel() for p in model.parameters())
    # ids in first-access order: the embedding first, the blocks' params next, ln_f last
    assert gpt_cpu.tensors[0].names == ("wte.weight",)
    assert gpt_cpu.tensors[-1].names[0].startswith("ln_f.")


@pytest.mark.parametrize("name,names", [
    ("hf-gpt2-tiny", ("transformer.wte.weight", "lm_head.weight")),
    ("hf-llama-tiny", ("model.embed_tokens.weight", "lm_head.weight")),
])
def test_hf_models_record_and_tied_weight_appears_once_with_both_names(name, names):
    spec = model_spec(name)
    trace = record(build_model(spec), make_batch(spec), model_name=name, model_config=spec.config)
    tied = [t for t in trace.tensors if len(t.names) > 1]
    assert [t.names for t in tied] == [names]
    all_names = [n for t in trace.tensors for n in t.names]
    assert len(all_names) == len(set(all_names))
    # the tied tensor is touched by the embedding and by the head, forward and backward
    touched_by = {m.module for m in trace.moments if tied[0].id in m.tensors and m.phase is not Phase.OPTIMIZER}
    assert {names[0].rsplit(".", 1)[0], "lm_head"} <= touched_by
    assert len(trace.blocks) == 2
    assert Trace.from_msgpack(trace.to_msgpack()) == trace


def test_functional_use_is_attributed_to_the_moment_whose_work_it_is(gpt_cpu):
    wte = next(t.id for t in gpt_cpu.tensors if t.names == ("wte.weight",))
    ln_f = {t.id for t in gpt_cpu.tensors if t.names[0].startswith("ln_f.")}
    by_event = {(m.kind, m.module): m for m in gpt_cpu.moments}
    # F.linear(x, self.wte.weight) runs in the root's forward, right after ln_f returns
    assert by_event[(K.POST_FORWARD, "ln_f")].tensors == (wte,)
    assert set(by_event[(K.PRE_FORWARD, "ln_f")].tensors) == ln_f
    assert by_event[(K.PRE_FORWARD, "wte")].tensors == (wte,)
    # its backward runs first in backward: mirrored onto the root's pre_backward
    assert by_event[(K.PRE_BACKWARD, "")].tensors == (wte,)
    assert set(by_event[(K.PRE_BACKWARD, "ln_f")].tensors) == ln_f
    assert by_event[(K.PRE_BACKWARD, "wte")].tensors == (wte,)
    assert by_event[(K.POST_FORWARD, "ln_f")].flops == 2 * 2 * 8 * 16 * 32  # (B*T, C) @ (C, V)


def test_backward_moments_mirror_forward_accesses(gpt_cpu):
    fwd = {m.module: m.tensors for m in gpt_cpu.moments if m.kind is K.PRE_FORWARD}
    bwd = {m.module: m.tensors for m in gpt_cpu.moments if m.kind is K.PRE_BACKWARD}
    for block in ("h.0", "h.1"):
        assert set(bwd[block]) == set(fwd[block]) and fwd[block]
    assert all(not m.tensors for m in gpt_cpu.moments if m.kind is K.POST_BACKWARD)
    opt = gpt_cpu.moments[-1]
    assert opt.tensors == tuple(t.id for t in gpt_cpu.tensors)


def test_block_non_model_peak_covers_the_activations_it_saves(gpt_cpu):
    saved = gpt_cpu.block_activation_bytes()
    assert all(s > 0 for s in saved)
    for b, block in enumerate(gpt_cpu.blocks):
        work = next(m for m in gpt_cpu.moments if m.module == block.module and m.kind is K.PRE_FORWARD)
        assert work.non_model_bytes >= saved[b]
        assert block.input_bytes == 2 * 8 * 16 * 4  # (B, T, C) float32
        assert block.forward_flops == work.flops > 0


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16, bias=False) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_non_model_accounting_by_hand():
    """Live non-parameter storage, counted from the op that creates it until it is freed.

    x: (4, 16) float32 = 256 bytes, alive from the start (the batch). Each Linear's mm output is
    256 bytes. The loss (`out.sum()`, 4 bytes) comes after the root's post_forward; the output (256) dies
    when loss_fn returns, before backward's seed grad (4 bytes): 768 - 256 + 4 + 4 = 520 when backward
    starts. In backward the weight grad (1024 bytes) is non-model data until it lands in .grad."""
    torch.manual_seed(0)
    trace = record(TwoLinear(), torch.randn(4, 16), loss_fn=lambda m, batch: m(batch).sum(), model_name="two-linear")
    forward = [m.non_model_bytes for m in trace.moments if m.phase is Phase.FORWARD]
    assert forward == [256, 512, 512, 768, 768, 772]
    by_event = {(m.kind, m.module): m for m in trace.moments}
    assert by_event[(K.PRE_BACKWARD, "")].non_model_bytes == 520
    # layers.1 backward: + grad of its input (256) + grad of its weight (1024) on top of 520
    assert by_event[(K.PRE_BACKWARD, "layers.1")].non_model_bytes == 520 + 256 + 1024
    # each block saves its input (the mm needs it for the weight grad), never the weight itself
    assert [(a.block, a.bytes) for a in trace.activations] == [(0, 256), (1, 256)]
    assert trace.activations[1].recompute_flops == 2 * 4 * 16 * 16


class SplitSave(nn.Module):
    """Saves two views of one storage: one activation, counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 32)])

    def forward(self, x):
        h = self.blocks[0](x)  # (4, 32) float32 = 512 bytes
        a, b = h.split(16, dim=1)
        big = torch.ones(4096, dtype=torch.float32)  # 16 KiB, freed when forward returns
        return (a * b).sum() + big.sum() * 0


def test_activations_and_live_bytes_are_deduplicated_by_storage():
    torch.manual_seed(0)
    trace = record(SplitSave(), torch.randn(4, 8), loss_fn=lambda m, batch: m(batch), model_name="split")
    h = [a for a in trace.activations if a.bytes == 4 * 32 * 4]
    assert len(h) == 1  # a and b: two views of h's storage, one activation
    root_work = next(m for m in trace.moments if m.kind is K.POST_FORWARD and m.module == "blocks.0")
    assert root_work.non_model_bytes >= 16384  # the temporary counts while it lives
    opt = trace.moments[-1]
    assert opt.non_model_bytes < 16384  # and not after it was freed


def test_cpu_and_meta_recordings_agree(gpt_cpu, gpt_meta):
    assert gpt_cpu.tensors == gpt_meta.tensors
    assert structure(gpt_cpu) == structure(gpt_meta)
    assert activations(gpt_cpu) == activations(gpt_meta)
    assert [dataclasses.replace(b, forward_seconds=0.0) for b in gpt_cpu.blocks] == list(gpt_meta.blocks)
    assert gpt_cpu.meta.recording is Recording.REAL and gpt_cpu.meta.time_source is TimeSource.MEASURED
    assert gpt_meta.meta.recording is Recording.META and gpt_meta.meta.time_source is TimeSource.FLOPS
    assert all(m.compute_seconds == 0 for m in gpt_meta.moments)
    assert sum(m.compute_seconds for m in gpt_cpu.moments) > 0


def test_recording_twice_gives_the_same_trace_times_aside(gpt_cpu):
    again = record_gpt(2)
    assert again.tensors == gpt_cpu.tensors
    assert structure(again) == structure(gpt_cpu)
    assert activations(again) == activations(gpt_cpu)
    assert again.meta == gpt_cpu.meta


def test_meta_records_shapes_dtypes_and_batch(gpt_meta):
    assert gpt_meta.meta.batch_shape == (2, 8)
    assert gpt_meta.meta.device == "meta"
    assert gpt_meta.meta.model_config["n_layer"] == 2
    half = record_gpt(1, device="meta", optimizer="sgd")
    assert half.meta.optimizer.value == "sgd"


# ----------------------------------------------------------------------------- bad input


def test_model_without_parameters_is_refused():
    with pytest.raises(ExecutorError, match="has no parameters"):
        record(nn.ReLU(), torch.randn(2, 2), loss_fn=lambda m, b: m(b).sum(), model_name="relu")


def test_batch_function_that_raises_is_reported():
    def bad_batch():
        raise ValueError("tokenizer exploded")

    with pytest.raises(ExecutorError, match="batch function raised ValueError: tokenizer exploded"):
        record(TwoLinear(), bad_batch, loss_fn=lambda m, b: m(b).sum(), model_name="two-linear")


def test_batch_that_does_not_fit_the_model_is_reported():
    with pytest.raises(ExecutorError, match=r"raised RuntimeError: .* in forward on the batch of shape \(4, 5\)"):
        record(TwoLinear(), torch.randn(4, 5), loss_fn=lambda m, b: m(b).sum(), model_name="two-linear")


class Flaky(nn.Module):
    """Skips its second layer from the second call on: the module sequence changes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = self.layers[0](x)
        return self.layers[1](x) if self.calls == 1 else x


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_module_sequence_that_changes_between_iterations_is_refused(device):
    with torch.device(device):
        model, x = Flaky(), torch.randn(2, 4)
    with pytest.raises(ExecutorError, match="module sequence changed between two recorded iterations: moment 3"):
        record(model, x, loss_fn=lambda m, b: m(b).sum(), model_name="flaky")


def test_unsupported_optimizer_is_refused():
    with pytest.raises(ExecutorError, match="optimizer 'lamb' is not supported; expected one of adamw, adam, sgd"):
        record(TwoLinear(), torch.randn(4, 16), loss_fn=lambda m, b: m(b).sum(), optimizer="lamb", model_name="x")


def test_timing_iterations_must_be_positive():
    with pytest.raises(ExecutorError, match="timing_iterations must be a positive integer, found 0"):
        record(TwoLinear(), torch.randn(4, 16), loss_fn=lambda m, b: m(b).sum(), model_name="x", timing_iterations=0)


def test_output_without_loss_is_refused():
    with pytest.raises(ExecutorError, match="no loss in the model's output"):
        record(TwoLinear(), torch.randn(4, 16), model_name="two-linear")


# ----------------------------------------------------------------------------- CLI


def test_cli_records_a_valid_trace(tmp_path, capsys):
    out = tmp_path / "t.msgpack"
    assert executor_main(["record", "gpt-small", "--meta", "--batch", "2", "--seq", "16", "-o", str(out)]) == 0
    trace = Trace.read(out)
    assert trace.meta.batch_shape == (2, 16) and trace.meta.model_name == "gpt-small"
    assert len(trace.blocks) == 4
    assert "recorded gpt-small" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["record", "gpt-small", "--meta", "--optimizer", "lamb"], "optimizer 'lamb' is not supported"),
    (["record", "no-such-model", "--meta"], "model 'no-such-model': unknown"),
    (["record", "gpt-small", "--meta", "--batch", "0"], "--batch: expected a positive number"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "t.msgpack"
    assert executor_main([*argv, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device,timing,calls", [("cpu", 3, 2 + 3), ("cpu", 1, 2 + 1), ("meta", 3, 2)])
def test_batch_function_and_device_argument(device, timing, calls):
    """A batch function is called once per recorded iteration; `device=` moves model and batches."""
    made = []

    def batch_fn():
        made.append(1)
        return torch.randn(4, 16)

    torch.manual_seed(0)
    trace = record(TwoLinear(), batch_fn, loss_fn=lambda m, b: m(b).sum(), device=device, model_name="two-linear",
                   timing_iterations=timing)
    assert len(made) == calls
    assert trace.meta.device == device
    assert [m.non_model_bytes for m in trace.moments if m.phase is Phase.FORWARD] == [256, 512, 512, 768, 768, 772]


class CheckpointingModel(nn.Module):
    """A model that checkpoints its own layers: tensors saved during recomputation are transient."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.reentrant)
        return x.sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_that_checkpoints_itself_records_only_forward_saves(reentrant):
    torch.manual_seed(0)
    x = torch.randn(4, 16, requires_grad=reentrant)  # reentrant checkpoint needs an input with grad
    trace = record(CheckpointingModel(reentrant), x, loss_fn=lambda m, b: m(b), model_name="ckpt")
    # reentrant checkpointing runs the layers' forward under no_grad: they get no backward events
    assert len(trace.moments) == (4 * 2 + 4 + 1 if not reentrant else 6 + 2 + 1)
    assert {trace.moments[a.produced_at].phase for a in trace.activations} <= {Phase.FORWARD}
    # at most each checkpointed layer's input is kept (4 x 16 float32), nothing from inside the layers
    assert all(a.bytes == 256 for a in trace.activations)
    assert Trace.from_msgpack(trace.to_msgpack()) == trace


def test_compute_seconds_are_the_typical_iteration_of_whole_runs(monkeypatch):
    """Moment times are the mean over whole runs less the fastest and slowest fifth (the statistic the
    executor bench compares with), never the fastest run (a machine nobody trains on) and never a
    mix of per-moment extremes: the moments sum to the typical iteration."""
    import executor.recorder as rec

    real = rec._Recorder._timed_once
    # totals 0.6, 0.5 (fastest: dropped), 0.7, 3.0 (another process's burst: dropped), 0.8
    runs = iter([[0.1, 0.5], [0.4, 0.1], [0.3, 0.4], [2.9, 0.1], [0.5, 0.3]])

    def fake(self, events):
        seconds, peaks = real(self, events)
        pattern = next(runs)
        return [pattern[0]] + [pattern[1] / (len(seconds) - 1)] * (len(seconds) - 1), peaks

    monkeypatch.setattr(rec._Recorder, "_timed_once", fake)
    trace = record(TwoLinear(), torch.randn(4, 16), loss_fn=lambda m, b: m(b).sum(), model_name="x", timing_iterations=5)
    got = [m.compute_seconds for m in trace.moments]
    assert got[0] == pytest.approx((0.1 + 0.3 + 0.5) / 3)
    assert got[1:] == pytest.approx([(0.5 + 0.4 + 0.3) / 3 / (len(got) - 1)] * (len(got) - 1))
    assert sum(got) == pytest.approx((0.6 + 0.7 + 0.8) / 3)


@pytest.mark.parametrize("totals,kept", [
    ([1.0], [0]), ([2.0, 1.0], [0, 1]), ([3.0, 1.0, 2.0], [2]), ([4.0, 1.0, 3.0, 2.0], [2, 3]),
    ([5.0, 1.0, 4.0, 2.0, 3.0], [2, 3, 4]), ([float(i) for i in range(10, 0, -1)], [2, 3, 4, 5, 6, 7]),
    ([1.0, 1.0, 1.0], [1]),  # ties: the earlier run counts as the faster
])
def test_typical_runs_trim_a_fifth_each_side(totals, kept):
    from executor.recorder import typical_runs, typical_seconds

    assert typical_runs(totals) == kept
    assert typical_seconds(totals) == pytest.approx(sum(totals[i] for i in kept) / len(kept))


def test_fused_attention_and_chunked_loss_keep_no_scores_and_no_logits() -> None:
    """The default records what training runs (SDPA, chunked loss head); the written-out variant is an
    option recorded in the model config, and keeps the (B, heads, T, T) softmax and the (B*T, V) log-softmax."""
    def meta(**flags) -> Trace:
        config = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=512, block_size=64, **flags)
        with torch.device("meta"):
            model = GPT(config)
        idx = torch.zeros(2, 64, dtype=torch.long, device="meta")
        return record(model, {"idx": idx, "targets": idx}, model_name="tiny", model_config=config.to_dict())

    fused, math_ = meta(), meta(attention="math", loss="full")
    assert fused.meta.model_config["attention"] == "sdpa" and math_.meta.model_config["attention"] == "math"
    scores = 2 * 2 * 64 * 64 * 4  # (B, heads, T, T) fp32 softmax
    logits = 2 * 64 * 512 * 4  # (B*T, V) fp32 log-softmax
    block = [b.id for b in fused.blocks if b.module == "h.0"][0]

    in_block = [sum(a.bytes for a in t.activations if a.block == block) for t in (fused, math_)]
    assert in_block[1] - in_block[0] >= scores
    total = [sum(a.bytes for a in t.activations) for t in (fused, math_)]
    assert total[1] - total[0] >= scores + logits
    assert [b.forward_flops for b in fused.blocks if b.id == block] == [b.forward_flops for b in math_.blocks if b.id == block]
