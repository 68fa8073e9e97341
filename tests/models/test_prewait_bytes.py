"""SPECD_GEMM_PREWAIT_BYTES: one size for every skinny GEMM, or a default and sizes per product."""

from __future__ import annotations

import pytest

from specd.models.kernels.l2_prefetch import PREWAIT_BYTES, prewait_bytes


def test_one_size_for_every_product():
    assert prewait_bytes("1024", 6144, 4096) == prewait_bytes("1024", 4096, 14336) == 1024
    assert prewait_bytes("0", 6144, 4096) == 0


def test_sizes_by_product_shape_over_a_default():
    spec = "512,6144/4096:4096,4096/14336:0"
    assert prewait_bytes(spec, 6144, 4096) == 4096  # qkv at 8B
    assert prewait_bytes(spec, 4096, 14336) == 0  # down_proj
    assert prewait_bytes(spec, 4096, 4096) == 512  # o_proj: the default
    assert prewait_bytes("6144/4096:2048", 4096, 4096) == PREWAIT_BYTES  # no default given


@pytest.mark.parametrize("spec", ["lots", "512,qkv:1024", "512,6144/4096:x", "6144/4096/1:64"])
def test_a_malformed_setting_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="SPECD_GEMM_PREWAIT_BYTES"):
        prewait_bytes(spec, 6144, 4096)
