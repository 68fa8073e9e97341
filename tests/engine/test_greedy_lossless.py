"""Greedy losslessness: speculative decoding emits exactly the target's own greedy tokens.

For every method and k in {1, 3, 5}, a batch of prompts of mixed lengths with per-request
max_new_tokens and stop tokens decodes token-for-token like target-only greedy decoding.
"""

from __future__ import annotations

import random

import pytest

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams

# method -> (target checkpoint, draft checkpoint or None)
METHODS = {
    "eagle3": ("target-llama", "draft-eagle3"),
    "draft_model": ("target-llama", "draft-llama-small"),
    "ngram": ("target-llama", None),
    "deepseek_mtp": ("target-deepseek-mtp", None),
    "qwen3_5_mtp": ("target-qwen3_5-mtp", None),
}
NUM_PROMPTS = 8


def make_requests(vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of mixed lengths (some repetitive, so n-gram lookup finds matches), mixed limits."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(NUM_PROMPTS):
        length = rng.choice([1, 3, 7, 12, 20, 33])
        prompt = [rng.randrange(4, vocab_size) for _ in range(length)]
        if i % 3 == 0:
            prompt = (prompt * 3)[: 3 * length]
        prompts.append(prompt)
        stop = [rng.randrange(4, vocab_size) for _ in range(3)] if i % 2 else []
        params.append(SamplingParams(temperature=0.0, max_new_tokens=rng.choice([5, 11, 24]),
                                     stop_token_ids=stop, ignore_eos=(i % 4 == 1)))
    return prompts, params


def decode(target, draft, method, k, prompts, params):
    spec = None
    if method is not None:
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model=str(draft) if draft else "")
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=NUM_PROMPTS, block_size=8), spec)
    seqs = engine.generate(prompts, params)
    return [s.output_token_ids for s in seqs], [s.finish_reason for s in seqs], seqs


_baselines: dict[str, tuple] = {}


def baseline(tiny_models, target_name):
    if target_name not in _baselines:
        target = tiny_models[target_name]
        from specd.models.loader import load_target_runner

        vocab = load_target_runner(target, PytorchEngineConfig(max_batch_size=1)).info.vocab_size
        prompts, params = make_requests(vocab)
        _baselines[target_name] = (prompts, params, *decode(target, None, None, 0, prompts, params)[:2])
    return _baselines[target_name]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculative_equals_target_greedy(tiny_models, method, k):
    target_name, draft_name = METHODS[method]
    prompts, params, want_tokens, want_reasons = baseline(tiny_models, target_name)
    draft = tiny_models[draft_name] if draft_name else None
    got_tokens, got_reasons, seqs = decode(tiny_models[target_name], draft, method, k, prompts, params)
    for i in range(NUM_PROMPTS):
        assert got_tokens[i] == want_tokens[i], f"{method} k={k} prompt {i}: tokens differ"
        assert got_reasons[i] == want_reasons[i]
    drafted = sum(s.stats.num_draft_tokens for s in seqs)
    assert drafted > 0, "speculation never ran"
    for s in seqs:
        assert len(s.stats.accepted_per_position) <= k
        assert s.stats.num_accepted_tokens <= s.stats.num_draft_tokens


def test_target_only_greedy_equals_transformers_generate(tiny_models):
    """The baseline itself is right: our runner's greedy equals transformers' generate."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts, params, want_tokens, _ = baseline(tiny_models, "target-llama")
    model = AutoModelForCausalLM.from_pretrained(tiny_models["target-llama"], dtype=torch.float32).eval()
    for prompt, p, got in zip(prompts, params, want_tokens):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(got), do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == got
