"""The kernels' experiment settings (read at capture time; the step bench's --step-env-variants)."""

from __future__ import annotations

import pytest


def test_gemm_block_shape_pins_and_the_hopper_table(monkeypatch):
    from types import SimpleNamespace

    import torch

    from specd.models import skinny_gemm as sg

    monkeypatch.delenv(sg.GEMM_CONFIG_ENV, raising=False)
    assert sg.pinned_config(4096, 4096, 2) is None
    monkeypatch.setenv(sg.GEMM_CONFIG_ENV, "6144/4096/1:16/256/4/4+4096/4096/2:64/128/4/4")
    assert sg.pinned_config(4096, 4096, 2) == {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    assert sg.pinned_config(4096, 4096, 1) is None  # another split: not pinned
    monkeypatch.setenv(sg.GEMM_CONFIG_ENV, "4096/4096/2:64/4096/4/4")  # BLOCK_K past K / S
    with pytest.raises(ValueError, match="does not divide"):
        sg.pinned_config(4096, 4096, 2)
    monkeypatch.setenv(sg.GEMM_CONFIG_ENV, "4096/4096/2:64,128")
    with pytest.raises(ValueError, match="expected N/K/S"):
        sg.pinned_config(4096, 4096, 2)
    monkeypatch.setenv(sg.GEMM_SPLITS_ENV, "4096/4096:4")
    assert sg.split_k_for(4096, 4096) == 4 and sg.split_k_for(4096, 14336) == 2
    monkeypatch.delenv(sg.GEMM_SPLITS_ENV)
    # the Hopper table: the 8B qkv at 4 rows on compute capability 9.0 only, never on CPU
    gpu_rows = SimpleNamespace(shape=(4, 4096), is_cuda=True, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sg.tuned_config(gpu_rows, 6144, 4096, False, 1) == {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                                                              "num_stages": 4}
    assert sg.tuned_config(SimpleNamespace(shape=(20, 4096), is_cuda=True, device="cuda:0"), 6144, 4096, False, 1) is None
    assert sg.tuned_config(torch.zeros(4, 4096), 6144, 4096, False, 1) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert sg.tuned_config(gpu_rows, 6144, 4096, False, 1) is None
