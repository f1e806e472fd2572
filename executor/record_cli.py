"""`python -m executor record`: a named model (executor/models.py) or the user's own, built by a
factory they name (`--module my_pkg.my_model:build`), recorded with `executor.record` into a trace."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from executor.errors import ExecutorError
from executor.models import MODELS, build_model, make_batch, model_spec, parse_dtype
from executor.recorder import record


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "record", help="record one training iteration of a model into a trace file",
        description="Record one training iteration (forward, backward, optimizer step) of a named model, or of "
                    "your own with --module PKG.MOD:FACTORY, and write its trace (msgpack). --meta records "
                    "shapes only on the meta device. The model is left as it was (weights, grads, RNG).")
    p.add_argument("model", metavar="MODEL_NAME", nargs="?", help=f"one of: {', '.join(MODELS)} (or use --module)")
    p.add_argument("-o", "--output", required=True, type=Path, help="trace file to write (.msgpack)")
    p.add_argument("--module", metavar="PKG.MOD:FACTORY", default=None,
                   help="your model: FACTORY() returns an nn.Module, or (module, batch); imported with the "
                        "current directory on the path")
    p.add_argument("--batch-module", metavar="PKG.MOD:FN", default=None,
                   help="FN() returns one batch (a tensor, a tuple of args or a dict of kwargs); called once per "
                        "recorded iteration; required with --module unless FACTORY returns (module, batch)")
    p.add_argument("--loss-module", metavar="PKG.MOD:FN", default=None,
                   help="FN(model, batch) returns the scalar loss (default: the loss inside the model's output)")
    p.add_argument("--name", default=None, help="the trace's model name (default: MODEL_NAME or the class name)")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device (no memory, no times)")
    p.add_argument("--device", default="cpu", help="device of a real recording: cpu or cuda[:N] (default cpu)")
    p.add_argument("--batch", type=int, default=None, help="sequences per batch of a named model (default: the model's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence of a named model (default: the model's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="parameter (compute) dtype (default float32)")
    p.add_argument("--optimizer", default="adamw", help="adamw, adam or sgd (default adamw)")
    p.add_argument("--attention", default=None, choices=["sdpa", "math"],
                   help="our GPT's attention: sdpa (fused, the default) or math (scores written out and kept)")
    p.add_argument("--loss", default=None, choices=["chunked", "full"],
                   help="our GPT's loss head: chunked (no full logits kept, the default) or full (F.cross_entropy on all logits)")
    p.add_argument("--timing-iterations", type=int, default=5,
                   help="timed iterations of a real recording; times are their mean less the fastest and "
                        "slowest fifth (default 5)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.module is None):
        raise ExecutorError("record: give either a MODEL_NAME or --module PKG.MOD:FACTORY (exactly one)")
    device = "meta" if args.meta else args.device
    try:
        torch.device(device)
    except RuntimeError:
        raise ExecutorError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ExecutorError(f"--device {device}: this torch build sees no GPU; record on cpu or with --meta")
    start = time.perf_counter()
    dtype = parse_dtype(args.dtype)
    if args.module is not None:
        model, batch, loss_fn, name, config = _user_model(args, device, dtype)
    else:
        model, batch, loss_fn, name, config = _named_model(args, device, dtype)
    with _progress(f"recording {name}", quiet=args.quiet):
        trace = record(model, batch, loss_fn=loss_fn, optimizer=args.optimizer, model_name=name, model_config=config,
                       timing_iterations=args.timing_iterations)
    trace.write(args.output)
    elapsed = time.perf_counter() - start
    print(f"recorded {name} ({trace.meta.recording.value}, {trace.meta.device}): {len(trace.moments)} moments, "
          f"{len(trace.tensors)} tensors ({trace.param_count / 1e6:.1f}M params), {len(trace.blocks)} blocks, "
          f"{len(trace.activations)} activations -> {args.output} ({elapsed:.1f} s)", file=sys.stderr)
    return 0


def _named_model(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple:
    spec = model_spec(args.model, batch=args.batch, seq=args.seq)
    flags = {k: v for k, v in (("attention", args.attention), ("loss", args.loss)) if v is not None}
    if flags and spec.family != "gpt":
        raise ExecutorError(f"--{next(iter(flags))}: only our GPT models take it; {args.model} is {spec.family}")
    if flags:
        spec = dataclasses.replace(spec, config={**spec.config, **flags})
    model = build_model(spec, device=device, dtype=dtype)
    batch = make_batch(spec, device=device)
    config = {"family": spec.family, "batch": spec.batch, "seq": spec.seq, **spec.config}
    return model, batch, None, args.name or args.model, config


def _user_model(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple:
    factory = resolve(args.module, "--module")
    with torch.device("meta") if device == "meta" else contextlib.nullcontext():
        built = _call(factory, "--module", args.module)
    batch: Any = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        built, batch = built
    if not isinstance(built, nn.Module):
        raise ExecutorError(f"--module {args.module}: the factory returned a {type(built).__name__}; expected an "
                            "nn.Module or a (module, batch) pair")
    if args.batch_module is not None:
        make = resolve(args.batch_module, "--batch-module")
        batch = lambda: _call(make, "--batch-module", args.batch_module)  # noqa: E731 (one batch per iteration)
    if batch is None:
        raise ExecutorError(f"--module {args.module}: no batch; pass --batch-module PKG.MOD:FN or return "
                            "(module, batch) from the factory")
    loss_fn = resolve(args.loss_module, "--loss-module") if args.loss_module else None
    model = built.to(device=device, dtype=dtype)
    config = {"module": args.module, **({"batch_module": args.batch_module} if args.batch_module else {})}
    return model, batch, loss_fn, args.name or type(model).__name__, config


def resolve(spec: str, flag: str) -> Callable:
    """`pkg.mod:attr` -> the object, imported with the current directory on sys.path."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ExecutorError(f"{flag} {spec!r}: expected PKG.MOD:NAME, e.g. my_pkg.my_model:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ExecutorError(f"{flag} {spec!r}: cannot import {module_name!r} ({exc}); run from the directory that "
                            "holds it or put it on PYTHONPATH") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ExecutorError(f"{flag} {spec!r}: module {module_name!r} has no {attr!r}; check the name after ':'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ExecutorError(f"{flag} {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def _call(fn: Callable, flag: str, spec: str) -> Any:
    try:
        return fn()
    except ExecutorError:
        raise
    except Exception as exc:  # the user's code: one line naming it
        text = " ".join(str(exc).split())[:300]
        raise ExecutorError(f"{flag} {spec}: raised {type(exc).__name__}: {text}; fix that function") from exc


@contextlib.contextmanager
def _progress(what: str, *, quiet: bool) -> Iterator[None]:
    """A rich spinner with the elapsed time on stderr when it is a terminal (and not --quiet)."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(f"{what} ..."):
        yield
