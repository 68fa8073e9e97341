"""StaticBatchKV.attend (specd/proposers/head_kv.py): the draft heads' fixed-shape attention read
straight from the block pools, against BatchKV's gathered attention.

On CPU in float32 it runs the PyTorch twin (static_attention.static_paged_attention); in fp16 /
bf16 the Triton paged kernel: here through Triton's interpreter in fp16 (a subprocess: the variable
must be set before the kernel is decorated; the interpreter's bf16 dot gives garbage, ~8e8, for
the verifier's kernel as for this), and on CUDA directly in bf16, the drafter's dtype.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.interpreted import run_interpreted

# A prelude: case(device, dtype) -> (StaticBatchKV's attention, BatchKV's, kernel_applies, the two
# caches' pools). Two sequences with 20 and 3 cached positions bring 3 and 1 new ones (a catch-up
# and a draft step in one Q = 4 layout), a padding row beside them, block tables wider than needed.
CASE = """
import torch
from specd.models.kernels import paged_decode_attention
from specd.proposers.head_kv import BLOCK, SCRATCH_BLOCK, BatchKV, HeadKVCache, StaticBatchKV

def case(device, dtype, block_size, heads=8, kv_heads=2, dim=32, num_q=4):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    caches = [HeadKVCache(device, initial_blocks=8, block_size=block_size) for _ in range(2)]
    handles = [(c.acquire(), c.acquire()) for c in caches]
    past = [rand(1, kv_heads, n, dim) for n in (20, 3)]
    for cache, pair in zip(caches, handles):
        for handle, p in zip(pair, past):
            BatchKV(cache, [handle], [0], [p.shape[2]]).update(p, -p)
    a, b = handles[1]
    new_k, new_v, q = rand(2, kv_heads, 3, dim), rand(2, kv_heads, 3, dim), rand(2, heads, 3, dim)
    scale = dim ** -0.5
    eager = BatchKV(caches[0], list(handles[0]), [20, 3], [3, 1])
    want = eager.attend(q, new_k, new_v, scale)  # [2, 3, heads, dim]
    table = torch.full((3, 4), SCRATCH_BLOCK, device=device)
    for row, (handle, n) in enumerate(((a, 23), (b, 4))):
        blocks = caches[1].reserve(handle, n)
        table[row, :len(blocks)] = torch.tensor(blocks, device=device)
    static = StaticBatchKV(caches[1], table, torch.tensor([20, 3, 0], device=device),
                           torch.tensor([3, 1, 0], device=device), num_q)
    pad = lambda t: torch.cat([torch.cat([t, rand(2, t.shape[1], num_q - 3, dim)], dim=2),
                               rand(1, t.shape[1], num_q, dim)])  # noqa: E731 - padding rows and a row
    got = static.attend(pad(q), pad(new_k), pad(new_v), scale)  # [3, Q, heads, dim]
    q_rows = pad(q).transpose(1, 2).reshape(-1, heads, dim)
    applies = paged_decode_attention.kernel_applies(q_rows, caches[1].pools[0])
    return got, want, applies, caches

def report(device, dtype, block_size):
    got, want, applies, caches = case(device, dtype, block_size)
    err_seq0 = (got[0, :3].float() - want[0].float()).abs().max().item()
    err_seq1 = (got[1, :1].float() - want[1, :1].float()).abs().max().item()
    stored = max((p[1:].float() - s[1:].float()).abs().max().item() for p, s in zip(*(c.pools for c in caches)))
    return applies, err_seq0, err_seq1, stored
"""


def _check(applies: bool, err_seq0: float, err_seq1: float, stored: float, kernel: bool, atol: float) -> None:
    assert applies == kernel
    assert err_seq0 <= atol and err_seq1 <= atol, (err_seq0, err_seq1)
    assert stored == 0.0  # the valid new entries stored alike, in the same slots (scratch aside)


@pytest.mark.parametrize("block_size", [16, 64])
def test_twin_attends_as_batch_kv_float32(block_size):
    namespace: dict = {}
    exec(CASE, namespace)
    _check(*namespace["report"]("cpu", torch.float32, block_size), kernel=False, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the device runs the kernel itself (below); the GPU "
                    "image's Triton interpreter fails on the kernel's key loop")
def test_paged_kernel_attends_as_batch_kv_interpreted():
    out = run_interpreted("print(*report('cpu', torch.float16, 16)); print(*report('cpu', torch.float16, 64))",
                          prelude=CASE)
    lines = out.splitlines()
    assert len(lines) == 2, out
    for line in lines:  # 16- and 64-position blocks: 16- and 64-key tiles
        applies, *errors = line.split()
        _check(applies == "True", *map(float, errors), kernel=True, atol=5e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel on the device")
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_kernel_attends_as_batch_kv_cuda(block_size):
    namespace: dict = {}
    exec(CASE, namespace)
    _check(*namespace["report"]("cuda", torch.bfloat16, block_size), kernel=True, atol=2e-2)
