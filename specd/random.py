"""Counter-based random numbers: noise as a pure function of (seed, position, salt, index).

No torch.Generator is involved. The uniform for one (seed, position, salt, index) depends on those
four integers only, not on the batch it is computed in, its row, the device or any earlier call.
That is what lets a request resumed on another worker, or verified in a different batch,
regenerate exactly the tokens it already emitted (docs/design.md, "Sampling seeded by (request
seed, token position)").

The hash is splitmix64 (Steele, Lea, Flood 2014) written in int64 tensor ops. Two things differ from
the C version: torch's `>>` on int64 is arithmetic, so shifts are masked to make them logical; and
multiplication wraps modulo 2**64, which is exactly the unsigned arithmetic splitmix64 wants.

Salts separate the independent streams at one position. Each (position, salt) is consumed at most
once along a committed sequence, which is what keeps the draws independent (see specd.rejection).
"""

from __future__ import annotations

import torch

SALT_SAMPLE = 1  # the target's own sample: plain decoding and the bonus token
SALT_ACCEPT = 2  # the uniform of the accept test for the draft at this position
SALT_DRAFT = 3  # the drafter's sampling of its draft tokens
SALT_RESIDUAL = 4  # the recovered token, sampled from the residual distribution


def _to_int64(c: int) -> int:
    """The int64 with the same 64 bits as the unsigned constant c."""
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN_GAMMA = _to_int64(0x9E3779B97F4A7C15)  # splitmix64's increment, 2**64 / golden ratio
_MIX_MUL_1 = _to_int64(0xBF58476D1CE4E5B9)
_MIX_MUL_2 = _to_int64(0x94D049BB133111EB)
_UNIT_BITS = 23  # float32 holds (2b + 1) / 2**24 exactly for b < 2**23, so no rounding to 0 or 1


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits: arithmetic shift, then clear the copied sign bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser, a bijection on 64-bit words: int64 [...] -> int64 [...]."""
    assert x.dtype == torch.int64, f"mix64 needs int64, got {x.dtype}"
    x = (x ^ _shift_right(x, 30)) * _MIX_MUL_1
    x = (x ^ _shift_right(x, 27)) * _MIX_MUL_2
    return x ^ _shift_right(x, 31)


def _to_unit_float(bits: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 2**23) -> float32 (2 * bits + 1) / 2**24, strictly inside (0, 1).

    Every step is exact in float32, so the result is bit-identical on every device; the extremes
    are 2**-24 and 1 - 2**-24.
    """
    return (bits.to(torch.float32) * 2.0 + 1.0) * (2.0 ** -(_UNIT_BITS + 1))


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, salt: int | torch.Tensor,
                   num: int) -> torch.Tensor:
    """Uniforms in (0, 1), one row per (seed, position), `num` independent values per row.

    seeds: [N] int64, the request's seed.
    positions: [N] int64, the absolute token position the noise is for.
    salt: one stream id for all rows (SALT_*), or [N] int64 with one per row.
    num: values per row; value i of a row is the same whatever `num` is (a prefix property).
    Returns [N, num] float32 on the inputs' device.

    Memory: a few int64 temporaries of [N, num]; with num = vocab, that is 8 bytes x N x vocab each.
    """
    assert seeds.ndim == 1, f"seeds must be [N], got {tuple(seeds.shape)}"
    assert positions.shape == seeds.shape, "positions must be [N] like seeds"
    device = seeds.device
    salt = torch.as_tensor(salt, dtype=torch.int64, device=device)
    assert salt.ndim == 0 or salt.shape == seeds.shape, "salt must be an int or [N] like seeds"
    # Chain the three keys through the bijection: for fixed other keys, distinct values of any one
    # key give distinct states. The gamma offset keeps seed 0 away from mix64's fixed point at 0.
    state = mix64(seeds.to(torch.int64) + _GOLDEN_GAMMA)  # [N]
    state = mix64(state + positions.to(device=device, dtype=torch.int64))  # [N]
    state = mix64(state + salt)  # [N]
    # splitmix64's output stream from that state: value i is mix64(state + (i + 1) * gamma).
    steps = torch.arange(1, num + 1, dtype=torch.int64, device=device) * _GOLDEN_GAMMA  # [num]
    words = mix64(state[:, None] + steps[None, :])  # [N, num]
    return _to_unit_float(_shift_right(words, 64 - _UNIT_BITS))  # top 23 bits -> [N, num]
