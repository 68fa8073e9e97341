"""Tests for specd.random: the counter-based uniforms are exact, deterministic and uniform."""

import pytest
import torch
from scipy import stats

from specd.random import (SALT_ACCEPT, SALT_DRAFT, SALT_RESIDUAL, SALT_SAMPLE, _to_unit_float,
                          hashed_uniform, mix64)

MASK64 = (1 << 64) - 1


def reference_mix64(x: int) -> int:
    """splitmix64's finaliser on unsigned Python ints, the C reference."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def test_mix64_matches_unsigned_reference():
    # Edge words exercise the sign bit: a wrong (arithmetic) shift or a saturating multiply breaks these.
    values = [0, 1, -1, 2**63 - 1, -2**63, 0x123456789ABCDEF, -0x5555555555555555]
    values += torch.randint(-2**63, 2**63 - 1, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & MASK64 for g in got] == [reference_mix64(v) for v in values]


def test_unit_float_extremes_stay_strictly_inside_zero_one():
    u = _to_unit_float(torch.tensor([0, 2**23 - 1], dtype=torch.int64))
    assert u.dtype == torch.float32
    assert u[0].item() == 2.0 ** -24 and u[1].item() == 1.0 - 2.0 ** -24
    assert 0.0 < u[0].item() and u[1].item() < 1.0


def test_deterministic_and_in_range():
    seeds = torch.arange(1000, dtype=torch.int64) * 7919
    positions = torch.arange(1000, dtype=torch.int64) % 37
    a = hashed_uniform(seeds, positions, SALT_SAMPLE, 64)
    b = hashed_uniform(seeds.clone(), positions.clone(), SALT_SAMPLE, 64)
    assert a.shape == (1000, 64) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert (a > 0).all() and (a < 1).all()


def test_independent_of_batch_composition_and_num():
    seeds = torch.tensor([5, 2**62 + 3, 0, 17, 5], dtype=torch.int64)
    positions = torch.tensor([0, 9, 1, 4, 1], dtype=torch.int64)
    full = hashed_uniform(seeds, positions, SALT_ACCEPT, 16)
    perm = torch.tensor([3, 0, 4])
    sub = hashed_uniform(seeds[perm], positions[perm], SALT_ACCEPT, 16)
    assert torch.equal(sub, full[perm])
    for i in range(len(seeds)):  # each row alone, as if it were the only request in the batch
        assert torch.equal(hashed_uniform(seeds[i:i + 1], positions[i:i + 1], SALT_ACCEPT, 16)[0],
                           full[i])
    assert torch.equal(hashed_uniform(seeds, positions, SALT_ACCEPT, 5), full[:, :5])
    # A per-row salt tensor gives the same rows as the scalar salt.
    per_row = torch.full((5,), SALT_ACCEPT, dtype=torch.int64)
    assert torch.equal(hashed_uniform(seeds, positions, per_row, 16), full)


def test_streams_differ_by_seed_position_and_salt():
    base = hashed_uniform(torch.tensor([1]), torch.tensor([10]), SALT_SAMPLE, 32)
    for seeds, positions, salt in [([2], [10], SALT_SAMPLE), ([1], [11], SALT_SAMPLE),
                                   ([1], [10], SALT_ACCEPT), ([1], [10], SALT_DRAFT),
                                   ([1], [10], SALT_RESIDUAL)]:
        other = hashed_uniform(torch.tensor(seeds), torch.tensor(positions), salt, 32)
        assert not torch.equal(base, other)


def test_empty_batch():
    empty = torch.zeros(0, dtype=torch.int64)
    assert hashed_uniform(empty, empty, SALT_SAMPLE, 4).shape == (0, 4)


def test_uniformity_ks():
    # Consecutive seeds and positions are the worst case for a weak hash; they must still look uniform.
    seeds = torch.arange(2000, dtype=torch.int64)
    positions = torch.arange(2000, dtype=torch.int64) // 10
    u = hashed_uniform(seeds, positions, SALT_SAMPLE, 100)  # [2000, 100]
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    for column in (0, 1, 99):  # every index of the stream, not only the pooled values
        assert stats.kstest(u[:, column].numpy(), "uniform").pvalue > 1e-3
    # Neighbouring streams (positions t and t + 1, salts) are uncorrelated.
    next_pos = hashed_uniform(seeds, positions + 1, SALT_SAMPLE, 100)
    accept = hashed_uniform(seeds, positions, SALT_ACCEPT, 100)
    for other in (next_pos, accept):
        corr = torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1].item()
        assert abs(corr) < 0.01


def test_follows_input_device():
    seeds = torch.arange(8, dtype=torch.int64)
    assert hashed_uniform(seeds, seeds, SALT_SAMPLE, 3).device == seeds.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_for_bit():
    seeds = torch.randint(0, 2**62, (512,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(512, dtype=torch.int64)
    cpu = hashed_uniform(seeds, positions, SALT_DRAFT, 1000)
    gpu = hashed_uniform(seeds.cuda(), positions.cuda(), SALT_DRAFT, 1000)
    assert gpu.device.type == "cuda"
    assert torch.equal(cpu, gpu.cpu())
