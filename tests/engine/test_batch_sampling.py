"""BatchSamplingTensors: a steady batch reuses its device tensors; any change of the batch (a
sequence gone, one joined, the order) builds them again from the sequences' parameters."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specd.engine.verify import BatchSamplingTensors
from specd.sampling_params import SamplingParams


def seq(seq_id: int, temperature: float):
    return SimpleNamespace(seq_id=seq_id, params=SamplingParams(temperature=temperature, seed=seq_id))


def test_a_steady_batch_copies_nothing_and_a_changed_one_is_rebuilt():
    cache = BatchSamplingTensors()
    a, b, c = seq(1, 0.5), seq(2, 0.0), seq(3, 1.5)
    first = cache.get([a, b], torch.device("cpu"))
    assert cache.get([a, b], torch.device("cpu")) is first
    assert torch.allclose(first.temperature, torch.tensor([0.5, 0.0]))
    changed = cache.get([a, c], torch.device("cpu"))  # b finished, c joined
    assert changed is not first and torch.allclose(changed.temperature, torch.tensor([0.5, 1.5]))
    reordered = cache.get([c, a], torch.device("cpu"))
    assert torch.allclose(reordered.temperature, torch.tensor([1.5, 0.5]))
    assert reordered.seeds.tolist() == [3, 1]
