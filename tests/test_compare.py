"""compare (rows, lower bound, CLI) and maxsize (search, CLI) on small analytic traces."""

from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.compare import TIDE, compare, lower_bound
from planner.errors import PlannerError
from planner.maxsize import GPT3_LADDER, TRACE_SOURCE, feasible_fn, max_size
from planner.problem import build_problem
from schemas.schedule import Channel
from test_baselines import DIGEST, RANKS, box, ranks_box, small_trace

BASELINES = ["pytorch", "zero2-offload", "zero3-offload", "zero-infinity", "patrickstar", "gemini", "fuyou", "angel"]


def test_compare_has_a_row_per_policy_and_a_valid_lower_bound() -> None:
    hw = box(device_gb=1.5)  # ZeRO-3's default 5e8-element grad bucket (1 GB, stage3.py) fits; PyTorch does not
    c = compare(small_trace(), hw, trace_digest=DIGEST, policies=BASELINES)
    assert [r.policy for r in c.rows] == BASELINES
    pytorch = c.row("pytorch")
    assert not pytorch.feasible and "DEVICE" in pytorch.reason and pytorch.result is None
    for r in c.rows:  # printed "policy: reason": the reason does not name the policy again
        assert not r.reason.startswith(f"{r.policy}:") and repr(r.policy) not in r.reason, r.reason
    feasible = [r for r in c.rows if r.feasible]
    assert len(feasible) >= 4
    best = c.best_baseline_seconds()
    for r in feasible:
        assert r.result.iteration_seconds >= c.lower_bound.seconds * (1 - 1e-9)
        assert r.speedup_vs_best_baseline == pytest.approx(best / r.result.iteration_seconds)
    assert max(r.speedup_vs_best_baseline for r in feasible) == pytest.approx(1.0)


def test_lower_bound_is_compute_when_everything_fits_and_grows_with_transfers() -> None:
    roomy = build_problem(small_trace(), box(device_gb=64.0), trace_digest=DIGEST)
    lb = lower_bound(roomy)
    assert lb.resource == "COMPUTE" and lb.seconds == pytest.approx(roomy.compute_seconds)
    # a fast GPU behind a slow link, too small for the params: the link sets the bound
    tight = build_problem(small_trace(), box(device_gb=0.3, tflops=1e4, link_gb_per_s=0.5), trace_digest=DIGEST)
    lb = lower_bound(tight)
    assert lb.resource in ("H2D", "D2H", "CPU_OPTIMIZER") and lb.seconds > tight.compute_seconds


def test_compare_unknown_policy() -> None:
    with pytest.raises(PlannerError, match="unknown policy"):
        compare(small_trace(), box(), trace_digest=DIGEST, policies=["deepspeed-magic"])


def test_tide_row_is_present() -> None:
    c = compare(small_trace(), box(), trace_digest=DIGEST, policies=[TIDE, "fuyou"])
    tide = c.row(TIDE)
    # planner.solve may not exist yet; either way the row says so or carries a simulated schedule
    assert tide.feasible == (tide.result is not None)
    if not tide.feasible:
        assert tide.reason
    else:  # both gaps are reported; the true one is tide's simulated time against its valid bound
        sim = tide.result.iteration_seconds
        assert c.tide_true_gap == pytest.approx((sim - c.tide_bound_seconds) / sim)
        assert c.tide_bound_seconds <= min(r.result.iteration_seconds for r in c.rows if r.result is not None)
        assert "tide_mip_gap" in c.to_json()
        # the ceiling is best baseline / bound: tide's own speed-up (a replayed plan) never exceeds it
        assert c.speedup_ceiling() == pytest.approx(c.best_baseline_seconds() / c.tide_bound_seconds)
        assert tide.speedup_vs_best_baseline <= c.speedup_ceiling() + 1e-12


def test_compare_cli_json(tmp_path, capsys) -> None:
    trace_path = tmp_path / "t.msgpack"
    small_trace().write(trace_path)
    hw_path = tmp_path / "box.toml"
    box(device_gb=1.0).write(hw_path)
    rc = main(["compare", str(trace_path), "--hardware", str(hw_path), "--json", "--policies", "pytorch", "fuyou"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in out["rows"]}
    assert rows["pytorch"]["feasible"] is False and rows["fuyou"]["feasible"] is True
    assert rows["fuyou"]["iteration_seconds"] >= out["lower_bound"]["seconds"]
    assert set(rows["fuyou"]["gb_per_channel"]) >= {"H2D", "D2H", "NVME_READ", "NVME_WRITE"}
    rc = main(["compare", str(trace_path), "--hardware", str(hw_path), "--policies", "gemini"])
    assert rc == 0 and "gemini" in capsys.readouterr().out


def test_compare_with_several_ranks_rows_for_every_multi_gpu_system(tmp_path, capsys) -> None:
    """Issue 9 item 3: tide and the multi-GPU baselines on a 4-rank box, each row replayed by the simulator;
    Fuyou (one GPU only) is a row that says why; the lower bound counts the grads' all-reduce."""
    hw = ranks_box()
    c = compare(small_trace(), hw, trace_digest=DIGEST)
    assert c.world_size == RANKS and [r.policy for r in c.rows] == [TIDE, *BASELINES]
    fuyou = c.row("fuyou")
    assert not fuyou.feasible and "single-GPU" in fuyou.reason
    for r in c.rows:
        if r.policy == "fuyou":
            continue
        assert r.feasible, r.reason
        assert r.schedule.header.world_size == RANKS
        assert r.result.bytes_per_channel[Channel.INTER_GPU] > 0  # data parallel: grads are averaged
        assert r.result.iteration_seconds >= c.lower_bound.seconds * (1 - 1e-9)
    assert c.lower_bound.seconds_per_resource["INTER_GPU"] > 0
    trace_path, hw_path = tmp_path / "t.msgpack", tmp_path / "ranks.toml"
    small_trace().write(trace_path)
    hw.write(hw_path)
    assert main(["compare", str(trace_path), "--hardware", str(hw_path), "--json", "--policies", "patrickstar", "fuyou"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == RANKS
    rows = {r["policy"]: r for r in out["rows"]}
    assert rows["patrickstar"]["gb_per_channel"]["INTER_GPU"] > 0 and rows["fuyou"]["feasible"] is False
    assert main(["compare", str(trace_path), "--hardware", str(hw_path), "--policies", "pytorch", "fuyou"]) == 0
    text = capsys.readouterr().out
    assert "GPU-GPU GB" in text and "4 ranks" in text and "single-GPU system" in text


def test_lower_bound_with_ranks_shares_pcie_and_gpu_memory() -> None:
    one = build_problem(small_trace(), box(device_gb=0.3, tflops=1e4, link_gb_per_s=0.5), trace_digest=DIGEST)
    four = build_problem(small_trace(), ranks_box(device_gb=0.3, tflops=1e4, link_gb_per_s=0.5), trace_digest=DIGEST)
    lb1, lb4 = lower_bound(one), lower_bound(four)
    assert "INTER_GPU" not in lb1.seconds_per_resource
    assert lb4.seconds_per_resource["H2D"] < lb1.seconds_per_resource["H2D"]
    m_bytes = four.trace.param_count * 2
    assert lb4.seconds_per_resource["INTER_GPU"] == pytest.approx(
        2 * (RANKS - 1) / RANKS * m_bytes / four.hardware.inter_gpu_bytes_per_s)


def test_max_size_binary_search_finds_the_largest_feasible_size() -> None:
    ladder = ((10, 64, 4), (10, 128, 4), (10, 256, 4))
    limit = {64: 23, 128: 12, 256: 0}  # 256 wide: not even one layer fits
    calls: list[tuple[int, int]] = []

    def fits(layers: int, hidden: int, heads: int) -> bool:
        calls.append((layers, hidden))
        return layers <= limit[hidden]

    best = max_size(fits, ladder=ladder, policy="x")
    # 23 x 64 wide vs 12 x 128 wide: the more parameters win
    from planner.families import gpt_param_count

    expected = max(((23, 64), (12, 128)), key=lambda lh: gpt_param_count(layers=lh[0], hidden=lh[1]))
    assert (best.layers, best.hidden) == expected
    assert best.checked == len(calls) and len(calls) < 30


def test_maxsize_real_policies_on_a_small_box() -> None:
    hw = box(device_gb=2.0, host_gb=4.0, ssds=0)
    ladder = ((2, 256, 4), (2, 512, 8))
    sizes = {p: max_size(feasible_fn(p, hw, batch=1, seq=64), ladder=ladder, max_layers_factor=8, policy=p)
             for p in ("pytorch", "patrickstar")}
    assert sizes["pytorch"].params > 0
    assert sizes["patrickstar"].params >= sizes["pytorch"].params  # chunks offload what PyTorch cannot


def test_maxsize_cli_says_how_traces_are_made(tmp_path, capsys) -> None:
    hw_path = tmp_path / "box.toml"
    box(device_gb=0.05, host_gb=0.1, ssds=0).write(hw_path)
    rc = main(["maxsize", "--family", "gpt3", "--hardware", str(hw_path), "--policies", "pytorch", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace_source"] == TRACE_SOURCE and out["results"][0]["params"] == 0  # nothing of GPT-3 width fits
    assert GPT3_LADDER[0] == (40, 5120, 40)
    assert main(["maxsize", "--hardware", str(hw_path), "--policies", "pytorch", "--batch", "0"]) == 2


def test_maxsize_with_several_ranks_uses_one_process_traces() -> None:
    """Issue 9 item 3: families' traces are one rank's (world_size 1) and plan on a multi-rank box:
    DDP trains no more than one GPU does (every rank holds everything), Fuyou (one GPU only)
    nothing, the sharded systems something."""
    ladder = ((2, 256, 4), (2, 512, 8))
    one, four = box(device_gb=2.0, host_gb=4.0, ssds=0), ranks_box(device_gb=2.0, host_gb=4.0, ssds=0)

    def size(policy: str, hw) -> int:
        return max_size(feasible_fn(policy, hw, batch=1, seq=64), ladder=ladder, max_layers_factor=8, policy=policy).params

    assert size("pytorch", four) == size("pytorch", one) > 0  # DDP: every rank holds everything
    assert size("patrickstar", four) > 0 and size("zero-infinity", four) > 0
    assert size("fuyou", four) == 0 < size("fuyou", one)


# (DeepSpeed's default 1 GB grad bucket does not fit 0.4 GB, where it was the only baseline left)
@pytest.mark.parametrize("device_gb", [2.0, 1.5, 1.0, 0.5])
def test_tide_with_several_ranks_is_no_slower_than_any_feasible_baseline(device_gb: float) -> None:
    """Issue 5 target 1 with several ranks: tide's planner replays the baselines' decisions through
    its own engine (OS sharded over the owners, the DEVICE margin filled with OS, a group's grads
    released once reduce-scattered) and keeps the fastest."""
    c = compare(small_trace(), ranks_box(device_gb=device_gb), trace_digest=DIGEST)
    baselines = [r for r in c.rows if r.policy != TIDE and r.feasible]
    tide = c.row(TIDE)
    assert baselines and tide.feasible, tide.reason
    assert tide.result.iteration_seconds <= min(r.result.iteration_seconds for r in baselines) * (1 + 1e-9)


def test_compare_says_when_tides_bound_holds_only_for_the_solves_replays(monkeypatch, capsys) -> None:
    """Note [CPU Adam beside copies, in the model]: where the model prices CPU Adam at its rate with copies (above
    BESIDE_COPIES_MAX_BLOCKS blocks; patched to 0 here) on a profile where copies slow it, its LP is checked against
    the solve's replays only. Up to PROVEN_BOUND_MAX_BLOCKS the solve then solves the LP at the rate alone for the
    header's bound, proven (Note [the proven bound up to 128 blocks]); above it (patched to 0) the header's bound is
    the checked one and compare says so instead of "no plan beats that bound"."""
    import dataclasses

    import planner.placement_input as placement_input
    import planner.solve as solve_mod
    from planner.compare import print_comparison
    from schemas.hardware import AdamRate

    hw = box(device_gb=1.0)
    hw = dataclasses.replace(hw, host=dataclasses.replace(hw.host, adam_chunk_params=1 << 20, adam_rates=(
        AdamRate(threads=hw.host.cores, params_per_s=1e9, params_per_s_with_copies=5e8),)))
    proven = compare(small_trace(), hw, trace_digest=DIGEST, policies=[TIDE, "fuyou"])
    monkeypatch.setattr(placement_input, "BESIDE_COPIES_MAX_BLOCKS", 0)
    alone = compare(small_trace(), hw, trace_digest=DIGEST, policies=[TIDE, "fuyou"])
    monkeypatch.setattr(solve_mod, "PROVEN_BOUND_MAX_BLOCKS", 0)
    checked = compare(small_trace(), hw, trace_digest=DIGEST, policies=[TIDE, "fuyou"])
    assert proven.row(TIDE).feasible and alone.row(TIDE).feasible and checked.row(TIDE).feasible
    assert proven.tide_bound_proven and alone.tide_bound_proven and not checked.tide_bound_proven
    # the same plans, the header's bound from another LP: the one at the rate alone, below every replay
    assert alone.row(TIDE).result.iteration_seconds == checked.row(TIDE).result.iteration_seconds
    assert alone.tide_bound_seconds != checked.tide_bound_seconds
    assert alone.tide_bound_seconds <= min(r.result.iteration_seconds for r in alone.rows if r.feasible)
    print_comparison(checked)
    assert "no plan the solve replayed beats that bound" in capsys.readouterr().out.replace("\n", " ")
    # `planner solve --prove-bound` proves it at any depth: the LP at the rate alone again, whatever the limit
    forced = solve_mod.solve_report(small_trace(), hw, trace_digest=DIGEST, prove_bound=True).schedule.header
    assert not any(solve_mod.UNPROVEN_BOUND in n for n in forced.notes)
    assert forced.lower_bound_seconds == alone.tide_bound_seconds
