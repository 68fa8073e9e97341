"""The skinny GEMM's launch shapes: the Hopper table of block shapes measured inside the 8B graph."""

from __future__ import annotations


def test_gemm_hopper_table(monkeypatch):
    from types import SimpleNamespace

    import torch

    from specd.models import skinny_gemm as sg

    # the Hopper table: the 8B qkv at 4 rows on compute capability 9.0 only, never on CPU
    gpu_rows = SimpleNamespace(shape=(4, 4096), is_cuda=True, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sg.tuned_config(gpu_rows, 6144, 4096, False, 1) == {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                                                              "num_stages": 4}
    assert sg.tuned_config(SimpleNamespace(shape=(20, 4096), is_cuda=True, device="cuda:0"), 6144, 4096, False, 1) is None
    assert sg.tuned_config(torch.zeros(4, 4096), 6144, 4096, False, 1) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert sg.tuned_config(gpu_rows, 6144, 4096, False, 1) is None
