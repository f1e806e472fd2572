"""`planner diff`: the sections, the identical case, the thresholds and the three renderers.

Schedules here are made by hand (valid, small, with known numbers) so each assertion pins one
section; tests/test_diff_solved.py diffs schedules the planner really solved.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.diff import diff_files, diff_schedules, render_json, render_markdown, render_text
from schemas.schedule import (
    Action,
    ActivationMode,
    ActivationPlan,
    Budgets,
    Channel,
    Chunk,
    ChunkLayout,
    ChunkList,
    ChunkPlan,
    MomentRef,
    Op,
    Prediction,
    Residency,
    Schedule,
    ScheduleHeader,
    SolverStatus,
    Stage,
    TensorSlot,
    Tier,
)
from schemas.trace import DType, MomentKind, Phase
from strategies import schedules

MB = 10**6


def toy_schedule(*, n_blocks: int = 4, device_bytes: int = 10**9, chunk_elements: int = 1000, persistent: int = 3,
                 recompute: tuple[int, ...] = (), os_host: tuple[int, ...] = (), trace_hex: str = "a",
                 tensor_chunk: dict[int, int] | None = None) -> Schedule:
    """One chunk per block (two 400-element fp32 tensors); `persistent` PARAM chunks stay on DEVICE,
    the rest are fetched in forward; each fetched chunk makes its backward stage 10 ms slower."""
    tensor_chunk = tensor_chunk or {}
    tensors, chunks = [], []
    for b in range(n_blocks):
        for k in range(2):
            tid = len(tensors)
            tensors.append(TensorSlot(tensor=tid, names=(f"h.{b}.w{k}",), shape=(400,), chunk=tensor_chunk.get(tid, b),
                                      offset_elements=400 * k, numel=400, trainable=True))
        chunks.append(Chunk(id=b, elements=chunk_elements, used_elements=800, block=b, comm_group=b, owner_rank=0))
    lists = (ChunkList.PARAM, ChunkList.GRAD, ChunkList.M, ChunkList.V)
    layout = ChunkLayout(chunk_elements=chunk_elements, lists=lists, list_dtypes={x: DType.FLOAT32 for x in lists},
                         chunks=tuple(chunks), tensors=tuple(tensors))
    moments, stages = [], []

    def add(phase: Phase, kind: MomentKind, b: int, seconds: float, stage_seconds: float, name: str) -> None:
        m = len(moments)
        moments.append(MomentRef(id=m, phase=phase, kind=kind, module=f"h.{b}" if b >= 0 else "", block=b,
                                 tensors=(2 * b, 2 * b + 1) if b >= 0 else (), compute_seconds=seconds, flops=10**9,
                                 non_model_bytes=MB))
        stages.append(Stage(id=m, name=name, phase=phase, block=b, first_moment=m, last_moment=m, predicted_seconds=stage_seconds))

    for b in range(n_blocks):
        add(Phase.FORWARD, MomentKind.PRE_FORWARD, b, 0.01, 0.01 + (0.002 if b in recompute else 0.0), f"forward h.{b}")
    for b in reversed(range(n_blocks)):
        add(Phase.BACKWARD, MomentKind.PRE_BACKWARD, b, 0.02, 0.02 + (0.01 if b >= persistent else 0.0), f"backward h.{b}")
    add(Phase.OPTIMIZER, MomentKind.OPTIMIZER_STEP, -1, 0.0, 0.005, "optimizer")
    residency = []
    for c in range(n_blocks):
        residency.append(Residency(list=ChunkList.PARAM, chunk=c, tiers=(Tier.DEVICE, Tier.HOST) if c < persistent else (Tier.HOST,)))
        for lst in (ChunkList.M, ChunkList.V):
            residency.append(Residency(list=lst, chunk=c, tiers=(Tier.HOST,) if c in os_host else (Tier.DEVICE,)))
    actions = tuple(Action(moment=b, op=Op.FETCH, list=ChunkList.PARAM, chunk=b, src=Tier.HOST, dst=Tier.DEVICE,
                           channel=Channel.H2D, bytes=4 * chunk_elements) for b in range(persistent, n_blocks))
    plans = tuple(ChunkPlan(chunk=c, os_tier=Tier.HOST if c in os_host else Tier.DEVICE,
                            optimizer_tier=Tier.HOST if c in os_host else Tier.DEVICE) for c in range(n_blocks))
    activations = tuple(ActivationPlan(block=b, module=f"h.{b}", mode=ActivationMode.RECOMPUTE if b in recompute else ActivationMode.KEEP,
                                       bytes=MB, input_bytes=MB // 10, recompute_seconds=0.002, recompute_flops=10**9)
                        for b in range(n_blocks))
    seconds = sum(s.predicted_seconds for s in stages)
    fetched = n_blocks - persistent
    prediction = Prediction(iteration_seconds=seconds, flops=10**10, bytes_per_channel={Channel.H2D: 4 * chunk_elements * fetched},
                            busy_seconds_per_channel={Channel.H2D: 0.001 * fetched, Channel.COMPUTE: 0.12},
                            peak_bytes_per_tier={Tier.DEVICE: MB * (persistent + 1), Tier.HOST: 10 * MB})
    header = ScheduleHeader(planner_version="0.1.0", policy="tide", model_name="toy", trace_digest="sha256:" + trace_hex * 64,
                            hardware_name="toy-hw", hardware_digest="sha256:" + "b" * 64, world_size=1,
                            solver_status=SolverStatus.OPTIMAL, objective_seconds=seconds, lower_bound_seconds=0.9 * seconds,
                            gap=0.1, notes=())
    return Schedule(header=header, budgets=Budgets(device_bytes=device_bytes, host_bytes=10**10, nvme_bytes=0), layout=layout,
                    chunk_plans=plans, activation_plans=activations, moments=tuple(moments), stages=tuple(stages),
                    initial_residency=tuple(residency), actions=actions, prediction=prediction)


@pytest.fixture
def pair(tmp_path):
    """(old path, new path): new has half the DEVICE budget, fewer persistent chunks, two OS chunks on HOST
    and three recomputed blocks -- slower, with a smaller DEVICE peak."""
    old = toy_schedule()
    new = toy_schedule(device_bytes=5 * 10**8, persistent=1, recompute=(0, 1, 3), os_host=(2, 3))
    a, b = tmp_path / "old.msgpack", tmp_path / "new.msgpack"
    old.write(a)
    new.write(b)
    return a, b


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(["diff", *map(str, argv)])
    return code, capsys.readouterr().out


def test_same_file_is_one_identical_line(pair, capsys):
    code, out = run_cli(capsys, pair[0], pair[0])
    assert code == 0
    assert out.count("\n") == 1 and out.startswith("identical: ")


def test_equal_objects_are_identical_without_the_same_bytes():
    d = diff_schedules(toy_schedule(), toy_schedule())
    assert d.identical
    assert render_text(d).startswith("identical: ") and "\n" not in render_text(d)
    assert json.loads(render_json(d))["identical"] is True
    assert d.failures(slower_pct=0, peak_grows_pct=0) == []


def test_identical_files_pass_the_thresholds(pair, capsys):
    code, out = run_cli(capsys, pair[1], pair[1], "--fail-if-slower", "0", "--fail-if-peak-grows", "0")
    assert code == 0 and out.startswith("identical: ")


def test_sections_report_every_change(pair):
    d = diff_files(*pair)
    assert not d.identical
    assert [c.name for c in d.inputs] == ["budget DEVICE"]  # same trace and hardware: only the budget differs
    it = d.prediction.iteration_seconds
    assert it.new > it.old and it.percent == pytest.approx(100 * (0.161 - 0.135) / 0.135)
    peaks = {c.name: c for c in d.prediction.peak_bytes}
    assert peaks["DEVICE"].old == 4 * MB and peaks["DEVICE"].new == 2 * MB and peaks["DEVICE"].percent == -50.0
    assert not peaks["HOST"].changed
    # residency: PARAM chunks 1 and 2 left DEVICE, OS of chunks 2 and 3 (M and V) went to HOST
    assert d.residency.comparable
    assert d.residency.moved_chunks == 2 + 4
    cells = {(lst, tier): c for lst, tier, c in d.residency.per_list_tier}
    assert (cells[(ChunkList.PARAM, Tier.DEVICE)].old, cells[(ChunkList.PARAM, Tier.DEVICE)].new) == (3, 1)
    assert (cells[(ChunkList.M, Tier.HOST)].old, cells[(ChunkList.M, Tier.HOST)].new) == (0, 2)
    assert ("os_tier", Tier.DEVICE, Tier.HOST, 2, 2 * 2 * 4000) in d.residency.plan_transitions
    # activations: blocks 0-1 and 3 now recompute, as two ranges
    assert d.activations.changed_blocks == 3
    assert [(r.first_block, r.last_block, r.new_mode) for r in d.activations.ranges] == [(0, 1, "RECOMPUTE"), (3, 3, "RECOMPUTE")]
    # actions: 1 -> 3 H2D fetches of 4 kB
    h2d = next(c for c in d.actions.per_channel if c.channel is Channel.H2D)
    assert (h2d.actions.old, h2d.actions.new, h2d.bytes.old, h2d.bytes.new) == (1, 3, 4000, 12000)
    assert d.layout.tensors_moved == 0 and not d.layout.chunk_elements.changed


def test_text_is_short_and_in_order(pair, capsys):
    code, out = run_cli(capsys, *pair)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) <= 40
    heads = [line for line in lines if line and not line.startswith(" ")]
    assert heads[1:] == ["inputs differ", "prediction", "chunk layout", "residency at iteration start",
                         "activation plan", "actions per channel"]
    assert "+19.3%" in out and "-50.0%" in out
    assert "KEEP->RECOMPUTE 3 blocks (3.00 MB): 0-1, 3" in out


def test_fail_if_slower(pair, capsys):
    old, new = pair
    code, out = run_cli(capsys, old, new, "--fail-if-slower", "1")
    assert code == 1 and "FAIL: predicted iteration time grew +19.3%" in out
    assert run_cli(capsys, old, new, "--fail-if-slower", "25")[0] == 0  # within the limit
    assert run_cli(capsys, new, old, "--fail-if-slower", "1")[0] == 0  # faster the other way round


def test_fail_if_peak_grows(pair, capsys):
    old, new = pair
    assert run_cli(capsys, old, new, "--fail-if-peak-grows", "1")[0] == 0  # DEVICE peak shrinks
    code, out = run_cli(capsys, new, old, "--fail-if-peak-grows", "1")
    assert code == 1 and "FAIL: peak DEVICE grew +100.0%" in out
    assert run_cli(capsys, new, old, "--fail-if-peak-grows", "100")[0] == 0  # exactly at the limit is not a breach


def test_markdown_has_every_section(pair, capsys):
    code, out = run_cli(capsys, *pair, "--markdown", "--fail-if-slower", "1")
    assert code == 1
    for title in ("Inputs differ", "Prediction", "Chunk layout", "Residency at iteration start", "Activation plan",
                  "Actions per channel"):
        assert f"#### {title}\n\n| | |\n| --- | --- |\n" in out
    assert "**FAIL:** predicted iteration time grew" in out
    table_rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert all(line.count("|") == 3 for line in table_rows)  # no stray pipes break the table


def test_json_parses_with_deltas(pair, capsys):
    code, out = run_cli(capsys, *pair, "--json", "--fail-if-peak-grows", "0")
    assert code == 0
    data = json.loads(out)
    assert set(data) >= {"inputs", "prediction", "layout", "residency", "activations", "actions", "failures"}
    it = data["prediction"]["iteration_seconds"]
    assert it["delta"] == pytest.approx(it["new"] - it["old"]) and it["percent"] > 19
    assert data["inputs"]["budget DEVICE"]["percent"] == -50.0
    assert data["actions"]["per_channel"]["H2D"]["bytes"]["new"] == 12000
    assert data["activations"]["ranges"][0] == {"first_block": 0, "last_block": 1, "old": "KEEP", "new": "RECOMPUTE", "bytes": 2 * MB}
    assert data["failures"] == []


def test_different_traces_state_inputs_first_and_match_tensors_by_name():
    old = toy_schedule()
    # another trace: bigger chunks, and tensor 1 (h.0.w1) placed in chunk 1 at offset 400
    new = toy_schedule(trace_hex="c", chunk_elements=2000, tensor_chunk={1: 1})
    new = dataclasses.replace(new, layout=dataclasses.replace(new.layout, tensors=tuple(
        dataclasses.replace(t, offset_elements=800) if t.tensor == 1 else t for t in new.layout.tensors)))
    d = diff_schedules(old, new)
    text = render_text(d)
    assert text.splitlines()[1] == "inputs differ"
    assert "trace_digest" in text.splitlines()[2]
    assert d.layout.tensors_moved == 1 and d.layout.largest_moves[0].name == "h.0.w1"
    assert d.layout.largest_moves[0].new_chunk == 1 and d.layout.largest_moves[0].new_offset_elements == 800
    assert not d.residency.comparable and "not comparable" in text  # chunk ids mean other tensors now


def test_growth_from_zero_has_no_percentage_but_fails_peak_check():
    old = toy_schedule()
    new = dataclasses.replace(old, prediction=dataclasses.replace(
        old.prediction, peak_bytes_per_tier={**old.prediction.peak_bytes_per_tier, Tier.NVME: 10 * MB}))
    d = diff_schedules(old, new)
    nvme = next(c for c in d.prediction.peak_bytes if c.name == "NVME")
    assert nvme.percent is None and "(new)" in render_text(d)
    assert d.failures(peak_grows_pct=1000) == [next(iter(d.failures(peak_grows_pct=1000)))]
    assert "peak NVME grew new" in d.failures(peak_grows_pct=1000)[0]
    json.loads(render_json(d))  # None, never inf: valid JSON


def test_ninety_six_blocks_fit_one_screen():
    blocks = 96
    old = toy_schedule(n_blocks=blocks, persistent=90)
    new = toy_schedule(n_blocks=blocks, persistent=10, recompute=tuple(range(0, 96, 2)), os_host=tuple(range(40)))
    text = render_text(diff_schedules(old, new))
    assert len(text.splitlines()) <= 40 and max(len(line) for line in text.splitlines()) <= 200


def test_bad_file_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\x93not a schedule")
    good = tmp_path / "good.msgpack"
    toy_schedule().write(good)
    code = main(["diff", str(good), str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "bad.msgpack" in err


@settings(max_examples=40)
@given(a=schedules(), b=schedules())
def test_any_two_valid_schedules_render(a, b):
    d = diff_schedules(a, b)
    assert d.identical == (a == b)
    for text in (render_text(d), render_markdown(d), render_json(d)):
        assert text
    assert diff_schedules(a, a).identical


@settings(max_examples=30)
@given(pct=st.floats(min_value=0, max_value=50))
def test_thresholds_are_monotone(pct):
    d = diff_schedules(toy_schedule(), toy_schedule(persistent=1))
    slower = d.slower_percent
    assert bool(d.failures(slower_pct=pct)) == (slower > pct)


def test_schedules_differing_only_in_notes_say_where():
    """A golden check that fails must show why: here the planner's reasoning changed, not the plan."""
    old = toy_schedule()
    long_note = "simulated plans (" + ", ".join(f"plan {i}: 1.{i:03d} s" for i in range(60)) + ")"
    old = dataclasses.replace(old, header=dataclasses.replace(old.header, notes=("first", long_note)))
    new = dataclasses.replace(old, header=dataclasses.replace(old.header, notes=(
        "first", long_note.replace("plan 41: 1.041 s", "plan 41: 1.052 s"), "added")))
    d = diff_schedules(old, new)
    assert not d.identical and [c.name for c in d.notes] == ["note 2", "note 3"]
    text = render_text(d)
    line = next(x for x in text.splitlines() if x.strip().startswith("note 2"))
    assert "plan 41: 1.041 s" in line and "plan 41: 1.052 s" in line and len(line) < 320  # excerpt, not the whole note
    assert "(none) -> added" in text
    assert "#### Planner notes differ" in render_markdown(d)
    notes = json.loads(render_json(d))["notes"]
    assert notes["note 2"]["new"] == new.header.notes[1] and notes["note 3"] == {"old": "", "new": "added"}
