"""`planner plot`: the PNG exists, and what it draws is exactly the simulator's numbers."""

from __future__ import annotations

import struct

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from planner.policies import baseline  # noqa: E402
from planner.cli import main  # noqa: E402
from planner.families import gpt_trace  # noqa: E402
from planner.plot import GB, make_figure, plot_series  # noqa: E402
from planner.presets import resolve_hardware  # noqa: E402
from planner.problem import build_problem  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from schemas.schedule import ChunkList, Tier  # noqa: E402
from schemas.trace import trace_digest  # noqa: E402


@pytest.fixture(scope="module")
def hardware():
    return resolve_hardware("cpu-emulated")


@pytest.fixture(scope="module")
def schedule(hardware):
    """Fuyou's policy on a small GPT: every lane busy (H2D, D2H, NVMe, CPU optimizer), activations swapped."""
    trace = gpt_trace(layers=4, hidden=256, heads=4, seq=128, batch=4, dtype="float32")
    problem = build_problem(trace, hardware, trace_digest=trace_digest(trace.to_msgpack()))
    return baseline("fuyou", problem)


def test_series_are_the_simulators_numbers(schedule, hardware):
    sim = simulate(schedule, hardware)
    series = plot_series(schedule, hardware)
    assert series["moment_start_seconds"] == list(sim.moment_start_seconds)
    assert series["iteration_seconds"] == sim.iteration_seconds
    n = len(schedule.moments)
    for tier in Tier:
        samples = sorted((s for s in sim.memory if s.tier is tier), key=lambda s: s.moment)
        expected = {"non_model": [s.non_model_bytes for s in samples], "activations": [s.activation_bytes for s in samples]}
        for lst in schedule.layout.lists:
            expected[lst.value] = [s.chunk_bytes.get(lst, 0) for s in samples]
        if tier.value not in series["tiers"]:
            assert not any(any(v) for v in expected.values()), f"{tier} holds bytes but is not plotted"
            continue
        drawn = series["tiers"][tier.value]
        for layer, values in expected.items():
            assert drawn["layers"].get(layer, [0] * n) == values, f"{tier} {layer}"
        assert drawn["total_bytes"] == [sum(v[m] for v in expected.values()) for m in range(n)]
        assert drawn["budget_bytes"] == {Tier.DEVICE: schedule.budgets.device_bytes, Tier.HOST: schedule.budgets.host_bytes,
                                         Tier.NVME: schedule.budgets.nvme_bytes}[tier]
        # the peak also counts what a moment holds between its actions, which no moment's work shows
        assert drawn["peak_bytes"] == sim.peak_bytes_per_tier.get(tier, 0) >= max(drawn["total_bytes"])
    intervals = {}
    for iv in sim.timeline:
        if iv.end_seconds > iv.start_seconds:
            intervals.setdefault(iv.channel.value, []).append((iv.start_seconds, iv.end_seconds - iv.start_seconds))
    assert series["lanes"] == intervals
    # the fixture is chosen so that the chart shows the interesting parts
    assert {"COMPUTE", "H2D", "NVME_READ", "NVME_WRITE", "CPU_OPTIMIZER"} <= set(series["lanes"])
    assert any(series["tiers"]["HOST"]["layers"].get("activations", []))


def test_figure_artists_carry_the_series(schedule, hardware):
    series = plot_series(schedule, hardware)
    fig = make_figure(schedule, series)
    try:
        artists = {a.get_gid(): a for ax in fig.axes for a in [*ax.lines, *ax.collections] if a.get_gid()}
        for tier, data in series["tiers"].items():
            total = artists[f"total:{tier}"]
            expected = [v / GB for v in data["total_bytes"]]
            assert list(total.get_ydata()) == pytest.approx([*expected, expected[-1]])
            assert list(total.get_xdata()) == pytest.approx([*series["moment_start_seconds"], series["iteration_seconds"]])
            assert list(artists[f"budget:{tier}"].get_ydata()) == pytest.approx([data["budget_bytes"] / GB] * 2)
            bottom = [0.0] * len(expected)
            for layer, values in data["layers"].items():
                top = [b + v / GB for b, v in zip(bottom, values)]
                ys = artists[f"layer:{tier}:{layer}"].get_paths()[0].vertices[:, 1]
                assert max(ys) == pytest.approx(max(top)) and min(ys) == pytest.approx(min(bottom))
                bottom = top
        for channel, bars in series["lanes"].items():
            paths = artists[f"lane:{channel}"].get_paths()
            assert len(paths) == len(bars)
            for path, (start, width) in zip(paths, bars):
                xs = path.vertices[:, 0]
                assert min(xs) == pytest.approx(start) and max(xs) == pytest.approx(start + width)
        labels = [t.get_text() for t in fig.axes[-1].get_yticklabels()]
        assert labels[0] == "CPU optimizer" and labels[-1] == "GPU compute"  # compute on top, read top-down
        assert all(ax.get_ylabel().endswith("(GB)") for ax in fig.axes[:-1])
        assert "seconds" in fig.axes[-1].get_xlabel()
    finally:
        plt.close(fig)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_cli_writes_a_png(schedule, tmp_path, capsys):
    path = tmp_path / "s.msgpack"
    schedule.write(path)
    out = tmp_path / "s.png"
    assert main(["plot", str(path), "-o", str(out)]) == 0  # hardware: the preset named in the schedule
    width, height = _png_size(out.read_bytes())
    assert width == 12 * 110 and 900 < height < 2000  # 12 in at 110 dpi; one panel per tier plus the lanes
    assert out.stat().st_size > 20_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_cli_unknown_hardware_is_one_line(schedule, tmp_path, capsys):
    path = tmp_path / "s.msgpack"
    schedule.write(path)
    assert main(["plot", str(path), "-o", str(tmp_path / "x.png"), "--hardware", "no-such-box"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-box" in err
    assert not (tmp_path / "x.png").exists()


def test_chunk_lists_keep_their_colours(schedule, hardware):
    series = plot_series(schedule, hardware)
    layers = {layer for data in series["tiers"].values() for layer in data["layers"]}
    assert layers <= {"non_model", "activations", *(x.value for x in ChunkList)}
