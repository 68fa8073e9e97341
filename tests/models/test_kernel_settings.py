"""The kernels' experiment settings (read at capture time; the step bench's --step-env-variants)."""

from __future__ import annotations

import pytest

from specd.models.kernels import paged_decode_attention as pda


def test_attention_programs_override_sets_the_key_chunks(monkeypatch):
    monkeypatch.delenv(pda.TARGET_PROGRAMS_ENV, raising=False)
    # batch 1, 8 KV heads, 1088 keys in 64-key tiles: 17 tiles, the default 264 programs want 33 each
    assert pda.num_splits(1, 8, 1088, 64) == 17
    monkeypatch.setenv(pda.TARGET_PROGRAMS_ENV, "64")
    assert pda.num_splits(1, 8, 1088, 64) == 8
    monkeypatch.setenv(pda.TARGET_PROGRAMS_ENV, "0")
    with pytest.raises(ValueError, match="positive"):
        pda.num_splits(1, 8, 1088, 64)

