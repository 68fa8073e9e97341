"""RotaryEmbedding's table of every position: gathered rows equal the computed ones bit for bit."""

from __future__ import annotations

import pytest
import torch

from bench.step import arch_config, random_model
from specd.messages import PytorchEngineConfig
from specd.models.base import SequenceChunk
from specd.models.llama import RotaryEmbedding
from specd.models.llama_runner import LlamaRunner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gathered_tables_equal_computed_ones(dtype):
    rotary = RotaryEmbedding(arch_config("small"))
    positions = torch.tensor([0, 1, 63, 64, 65, 200, 511, 7])
    computed = rotary(positions, dtype)
    rotary.reserve(512, dtype)
    gathered = rotary(positions, dtype)
    for a, b in zip(gathered, computed):
        assert torch.equal(a, b) and a.dtype == dtype and a.shape == (8, rotary.config.head_dim)
    # views of one [T, 2D] gather: the row stride the kernels are given, the same for both
    assert gathered[0].stride() == gathered[1].stride() == (2 * rotary.config.head_dim, 1)
    # another dtype than the table's: computed, not gathered from it
    assert all(torch.equal(a, b) for a, b in zip(rotary(positions, torch.float64), (
        RotaryEmbedding(arch_config("small"))(positions, torch.float64))))


def test_positions_past_the_table_read_its_last_row():
    """A static prefill's padding rows near the end of the context: no out-of-range gather."""
    rotary = RotaryEmbedding(arch_config("small"))
    rotary.reserve(16, torch.float32)
    cos, sin = rotary(torch.tensor([15, 16, 40]), torch.float32)
    assert torch.equal(cos[1], cos[0]) and torch.equal(sin[2], sin[0])


def test_the_runner_reserves_its_session_length_and_steps_the_same():
    cfg = arch_config("small")
    model = random_model(cfg, torch.float32, torch.device("cpu"))
    ec = PytorchEngineConfig(max_batch_size=2, block_size=16, num_gpu_blocks=16, session_len=96,
                             device_type="cpu", dtype="float32")
    runner = LlamaRunner(".", ec, model=model, config=cfg, use_static_path=True)
    rotary = model.model.rotary_emb
    assert rotary._table is not None and rotary._table.shape == (96, 2 * cfg.head_dim)

    def steps():
        for s in (0, 1):
            runner.add_sequence(s)
        out = [runner.forward([SequenceChunk(0, list(range(3, 40))), SequenceChunk(1, [5, 6, 7])]).logits,
               runner.forward([SequenceChunk(0, [1, 2, 3, 4]), SequenceChunk(1, [9])]).logits]
        for s in (0, 1):
            runner.free(s)
        return out

    with_table = steps()
    rotary._table = None
    for a, b in zip(with_table, steps()):
        assert torch.equal(a, b)
