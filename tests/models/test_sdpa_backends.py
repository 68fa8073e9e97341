"""The variable-shape attention calls run without cuDNN's SDPA (specd/models/sdpa_backends.py):
cuDNN builds a plan for every new shape, ~39 ms of host time a call on an H100."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specd.models.attention import AttentionMetadata, torch_paged_attention
from specd.models.kv_cache import PagedKVCache


def spy_on_sdpa(monkeypatch, module) -> list[bool]:
    """Record, at each SDPA call through `module.F`, whether cuDNN's kernel was allowed."""
    seen, real = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(module.F, "scaled_dot_product_attention", spy)
    return seen


def test_the_paged_twin_attends_without_cudnn(monkeypatch):
    from specd.models import attention

    seen = spy_on_sdpa(monkeypatch, attention)
    cache = PagedKVCache(1, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    cache.add_sequence(0)
    slots = cache.append_slots(0, 5)
    meta = AttentionMetadata.build([5], [5], cache.block_tables([0]), slots, 4, torch.device("cpu"))
    out = torch_paged_attention(torch.randn(5, 4, 8), cache.k_caches[0], cache.v_caches[0], meta, 8 ** -0.5)
    assert out.shape == (5, 4, 8)
    assert seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the setting is restored after the call


def test_the_eagle3_drafter_attends_without_cudnn(monkeypatch):
    from bench.drafter_head import cudnn_attention_allowed, make_head, make_proposer, time_steps
    from specd.proposers import eagle3_head

    seen = spy_on_sdpa(monkeypatch, eagle3_head)
    cpu = torch.device("cpu")
    proposer = make_proposer(make_head("small", cpu, torch.float32), cpu, torch.float32, static_steps=False)
    times, _ = time_steps(proposer, batch=2, steps=2, k=3)
    assert len(times) == 2 and all(t > 0 for t in times)
    # the prompts' catch-up and every draft step after the first: 1 + 2 + 2 x (1 + 2) calls
    assert len(seen) == 9 and not any(seen)
    seen.clear()
    with cudnn_attention_allowed():  # the bench's A/B side: SDPA's own choice
        time_steps(proposer, batch=1, steps=1, k=2)
    assert seen and all(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
