"""The kernels' experiment settings (read at capture time; the step bench's --step-env-variants)."""

from __future__ import annotations

import pytest

from specd.models.kernels import paged_decode_attention as pda
from specd.models.kernels.norm_act import _norm_warps


def test_attention_programs_override_sets_the_key_chunks(monkeypatch):
    monkeypatch.delenv(pda.TARGET_PROGRAMS_ENV, raising=False)
    # batch 1, 8 KV heads, 1088 keys in 64-key tiles: 17 tiles, the default 264 programs want 33 each
    assert pda.num_splits(1, 8, 1088, 64) == 17
    monkeypatch.setenv(pda.TARGET_PROGRAMS_ENV, "64")
    assert pda.num_splits(1, 8, 1088, 64) == 8
    monkeypatch.setenv(pda.TARGET_PROGRAMS_ENV, "0")
    with pytest.raises(ValueError, match="positive"):
        pda.num_splits(1, 8, 1088, 64)


def test_norm_warps_override_is_validated(monkeypatch):
    """SPECD_NORM_WARPS (an experiment's setting for the norm's launch) takes powers of two only;
    unset, 4 warps up to 4,096 columns and 8 above."""
    monkeypatch.delenv("SPECD_NORM_WARPS", raising=False)
    assert (_norm_warps(4096), _norm_warps(8192)) == (4, 8)
    monkeypatch.setenv("SPECD_NORM_WARPS", "16")
    assert _norm_warps(4096) == 16
    monkeypatch.setenv("SPECD_NORM_WARPS", "12")
    with pytest.raises(ValueError, match="SPECD_NORM_WARPS"):
        _norm_warps(4096)
