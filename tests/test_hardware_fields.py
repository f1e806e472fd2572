"""The hardware format's measured-price fields: optional (old files load and mean what they meant),
validated, interpolated, and every "tide estimate" of a preset is listed."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from schemas import FormatError, Hardware
from schemas.hardware import estimated_fields
from schemas.trace import DType

HARDWARE = Path(__file__).resolve().parents[1] / "traces" / "hardware"
PRESETS = sorted(HARDWARE.glob("*.toml"))
NEW_KEYS = {
    "device": ("memory_margin_gb", "matmul_rates", "attention_rates"),
    "host": ("dram_gb_per_s", "adam_chunk_params", "adam_dram_bytes_per_param"),
    "nvme": ("mixed_read_gb_per_s_each", "mixed_write_gb_per_s_each", "host_cap_gb_per_s"),
    "links": ("h2d_pageable_gb_per_s", "d2h_pageable_gb_per_s", "duplex_h2d_gb_per_s", "duplex_d2h_gb_per_s"),
}

OLD = """format = "tide.hardware"
format_version = 1
name = "old"
description = "a file written before the measured-price fields"
[device]
kind = "cuda"
name = "gpu"
memory_gb = 24.0
usable_fraction = 0.9
compute_tflops = 100.0
optimizer_params_per_s = 1e10
[host]
memory_gb = 64.0
usable_fraction = 0.8
optimizer_params_per_s = 1.5e9  # tide estimate
cores = 8
[nvme]
count = 0
capacity_gb_each = 0.0
read_gb_per_s_each = 0.0
write_gb_per_s_each = 0.0
usable_fraction = 0.9
[links]
h2d_gb_per_s = 25.0
d2h_gb_per_s = 25.0
inter_gpu_gb_per_s = 0.0
[cluster]
world_size = 1
gpus_per_node = 1
"""


def test_a_file_without_the_new_fields_loads_with_the_documented_defaults() -> None:
    hw = Hardware.from_toml(OLD)
    assert hw.device.matmul_rates == () and hw.device.attention_rates == () and hw.device.memory_margin_gb == 0.0
    assert hw.host.adam_rates == () and hw.host.dram_gb_per_s == 0.0 and hw.host.adam_dram_bytes_per_param == 28.0
    assert hw.links.duplex_h2d_gb_per_s == 0.0 and hw.nvme.host_cap_gb_per_s == 0.0
    # with no table, every shape runs at the flat rate and CPU Adam at the flat rate: what the file meant
    assert hw.matmul_flops_per_s(8, 8, 8, DType.BFLOAT16) == hw.device_flops_per_s
    assert hw.cpu_adam_params_per_s(3) == 1.5e9
    assert estimated_fields(OLD) == ("host.optimizer_params_per_s",)


def test_tables_are_interpolated_and_checked() -> None:
    text = OLD.replace("optimizer_params_per_s = 1e10\n", """optimizer_params_per_s = 1e10
matmul_rates = [
    { dtype = "bfloat16", m = 1024, n = 1024, k = 1024, tflops = 10.0 },
    { dtype = "bfloat16", m = 8192, n = 8192, k = 8192, tflops = 100.0 },  # tide estimate
]
""").replace("cores = 8\n", """cores = 8
adam_chunk_params = 1000000
adam_rates = [
    { threads = 1, params_per_s = 1e8, params_per_s_with_copies = 5e7 },
    { threads = 4, params_per_s = 3e8 },
]
""")
    hw = Hardware.from_toml(text)
    assert hw.matmul_flops_per_s(1024, 1024, 1024, DType.BFLOAT16) == pytest.approx(10e12)
    assert hw.matmul_flops_per_s(16384, 16384, 16384, DType.BFLOAT16) == pytest.approx(100e12)  # clamped
    # geometric middle of the sizes -> geometric middle of the rates (log-log)
    assert hw.matmul_flops_per_s(2896, 2896, 2896, DType.BFLOAT16) == pytest.approx((10 * 100) ** 0.5 * 1e12, rel=1e-3)
    assert hw.matmul_flops_per_s(2048, 2048, 2048, DType.FLOAT32) == hw.device_flops_per_s  # no float32 rows
    assert hw.cpu_adam_params_per_s(1) == 1e8 and hw.cpu_adam_params_per_s(1, with_copies=True) == 5e7
    assert hw.cpu_adam_params_per_s(3) == 1e8 and hw.cpu_adam_params_per_s() == 3e8  # default: all 8 cores -> the 4-thread row
    assert hw.cpu_adam_params_per_s(4, with_copies=True) == 3e8  # not measured with copies: the rate alone
    assert estimated_fields(text) == ("device.matmul_rates[1]", "host.optimizer_params_per_s")
    assert Hardware.from_toml(hw.to_toml()) == hw

    with pytest.raises(FormatError, match=r"host.adam_rates: one row per thread count"):
        Hardware.from_toml(text.replace("threads = 4", "threads = 1"))
    with pytest.raises(FormatError, match=r"host.adam_chunk_params"):
        Hardware.from_toml(text.replace("adam_chunk_params = 1000000", "adam_chunk_params = 0"))
    with pytest.raises(FormatError, match=r"device.memory_margin_gb"):
        Hardware.from_toml(OLD.replace("compute_tflops = 100.0", "compute_tflops = 100.0\nmemory_margin_gb = 30.0"))
    with pytest.raises(FormatError, match=r"tflops"):
        Hardware.from_toml(text.replace("tflops = 10.0", "tflops = 0.0"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_sets_every_new_field_with_a_source_comment(preset: Path) -> None:
    text = preset.read_text(encoding="utf-8")
    Hardware.read(preset)
    # a profile measured by `python -m executor profile` has one source for every number: that run,
    # named with its machine and date in the description (lines it did not measure say "tide estimate")
    measured = re.search(r'^description = "measured by `python -m executor profile` on .+ at \d{4}-', text, re.M)
    section = ""
    seen: dict[str, str] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\[\w+\]$", line.strip()):
            section = line.strip()[1:-1]
        table = re.match(r"^\[\[(\w+)\.(\w+)\]\]$", line.strip())  # a table written row by row
        if table and table.group(2) in NEW_KEYS.get(table.group(1), ()):
            seen[f"{table.group(1)}.{table.group(2)}"] = "the profile run" if measured else ""
            continue
        key = line.split("=")[0].strip()
        if key in NEW_KEYS.get(section, ()):
            comment = line.partition("#")[2].strip()
            if not comment and line.rstrip().endswith("["):  # a table: each row carries its own comment
                rows = list(itertools.takewhile(lambda r: r.strip().startswith("{"), lines[i + 1:]))
                comment = "rows" if rows and all("#" in r for r in rows) else ""
            seen[f"{section}.{key}"] = comment or ("the profile run" if measured else "")
    missing = [f"{s}.{k}" for s, keys in NEW_KEYS.items() for k in keys if f"{s}.{k}" not in seen]
    assert not missing, f"{preset.name} lacks {missing}"
    unsourced = [k for k, c in seen.items() if not c]
    assert not unsourced, f"{preset.name}: no source comment on {unsourced}"
