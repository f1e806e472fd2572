"""executor.profile.prices_measured_now: the drifting prices (copy rates, CPU Adam rates) measured again,
everything else kept (bench/bench_executor.py prices each round of its offload phase with it)."""

from __future__ import annotations

import dataclasses

import pytest

from executor.errors import ExecutorError
from executor.profile import prices_measured_now
from planner.presets import resolve_hardware
from schemas.hardware import AdamRate, CopyRate, DeviceKind

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_MIB = 1 << 20


def _placeholder():
    """The emulated preset with placeholder rates no machine measures (1e-3 GB/s, 1 param/s), at small
    sizes so the probe takes a fraction of a second."""
    hw = resolve_hardware("cpu-emulated")
    rows = tuple(CopyRate(chunk_bytes=n, h2d_gb_per_s=1e-3, d2h_gb_per_s=1e-3) for n in (_MIB // 4, _MIB))
    links = dataclasses.replace(hw.links, h2d_gb_per_s=1e-3, d2h_gb_per_s=1e-3, copy_rates=rows)
    host = dataclasses.replace(hw.host, adam_chunk_params=1 << 16,
                               adam_rates=(AdamRate(threads=1, params_per_s=1.0, params_per_s_with_copies=1.0),))
    return dataclasses.replace(hw, links=links, host=host)


def test_prices_measured_now_measures_the_copy_and_adam_rates_at_the_files_sizes_and_keeps_the_rest(tmp_path):
    hw = _placeholder()
    now = prices_measured_now(hw, seconds=0.01, nvme_dir=str(tmp_path))
    assert [r.chunk_bytes for r in now.links.copy_rates] == [_MIB // 4, _MIB]
    assert all(r.h2d_gb_per_s > 0.01 and r.d2h_gb_per_s > 0.01 and r.duplex_h2d_gb_per_s > 0 for r in now.links.copy_rates)
    assert now.links.h2d_gb_per_s == now.links.copy_rates[-1].h2d_gb_per_s  # the flat fields: the largest row's
    assert [r.threads for r in now.host.adam_rates] == [1] and now.host.adam_rates[0].params_per_s > 1e3
    assert now.host.adam_rates[0].params_per_s_with_copies > 1e3
    assert now.device == hw.device and now.nvme == hw.nvme and now.cluster == hw.cluster
    assert now.host.memory_gb == hw.host.memory_gb and now.host.adam_chunk_params == hw.host.adam_chunk_params
    assert now.description.startswith(hw.description) and "measured again at" in now.description


def test_prices_measured_now_refuses_a_cuda_profile_without_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hw = _placeholder()
    cuda = dataclasses.replace(hw, device=dataclasses.replace(hw.device, kind=DeviceKind.CUDA))
    with pytest.raises(ExecutorError, match="no GPU"):
        prices_measured_now(cuda)
