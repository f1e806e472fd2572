"""Frozen parameters (LoRA-style fine-tuning, issue 20): the layout never puts a frozen tensor in a
chunk with a trainable one, and materialize gives optimizer state only to chunks with trainable
tensors; with every tensor trainable the layout is unchanged."""

from __future__ import annotations

import dataclasses

from planner.families import gpt_trace
from planner.layout import build_layout
from planner.presets import resolve_hardware
from planner.problem import build_problem


def _problem(trace):
    return build_problem(trace, resolve_hardware("cpu-emulated"), trace_digest="sha256:" + "0" * 64)


def _frozen_but_biases(trace):
    """Every matrix frozen, the small vectors (biases, norms) trainable, as in bias-only tuning."""
    tensors = tuple(dataclasses.replace(t, trainable=len(t.shape) == 1) for t in trace.tensors)
    trainable = {t.id for t in tensors if t.trainable}
    moments = tuple(dataclasses.replace(m, tensors=tuple(i for i in m.tensors if i in trainable))
                    if m.phase.value == "optimizer" else m for m in trace.moments)
    return dataclasses.replace(trace, tensors=tensors, moments=moments)


def test_frozen_and_trainable_tensors_never_share_a_chunk():
    trace = gpt_trace(layers=2, hidden=64, heads=2, seq=32, batch=2, vocab=1000)
    problem = _problem(_frozen_but_biases(trace))
    layout = build_layout(problem, chunk_elements=8192)
    kinds = {}
    for s in layout.tensors:
        kinds.setdefault(s.chunk, set()).add(s.trainable)
    assert all(len(k) == 1 for k in kinds.values())
    assert {True, False} == {k for ks in kinds.values() for k in ks}
    # all trainable: one chunk may hold both the matrices and the vectors, as before
    mixed = build_layout(_problem(trace), chunk_elements=8192)
    assert len(mixed.chunks) < len(layout.chunks)
