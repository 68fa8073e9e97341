"""How many KV blocks a runner allocates on a GPU: what it can use, capped by the memory fraction."""

from __future__ import annotations

import torch

from specd.messages import PytorchEngineConfig
from specd.models import runner_setup
from specd.models.hf_config import LlamaArchConfig
from specd.models.kv_cache import PagedKVCache


def _config() -> LlamaArchConfig:
    return LlamaArchConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=4096)


def test_a_gpu_cache_never_takes_more_than_max_batch_full_sessions(monkeypatch):
    free = 100 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    config, cuda = _config(), torch.device("cuda")
    per_block = PagedKVCache.bytes_per_block(2, 64, 2, 16, torch.bfloat16)
    small = PytorchEngineConfig(max_batch_size=8, block_size=64, session_len=1000)
    # 8 sessions of ceil(1000 / 64) = 16 blocks, not 80% of 100 GiB (a drafter's small cache)
    assert runner_setup.num_cache_blocks(small, config, 1000, torch.bfloat16, cuda) == 8 * 16
    tight = PytorchEngineConfig(max_batch_size=8, block_size=64, session_len=1000, cache_max_entry_count=0.5)
    free = 10 * per_block  # the memory fraction binds: half of 10 blocks' worth
    assert runner_setup.num_cache_blocks(tight, config, 1000, torch.bfloat16, cuda) == 5
