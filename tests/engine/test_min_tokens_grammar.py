"""min_new_tokens against a grammar that is already complete: the grammar wins, nothing crashes.

Stop suppression (min_new_tokens) masks EOS; a terminated grammar allows only EOS. Together they
could leave an all -inf row (NaN probabilities)."""

from __future__ import annotations

import pytest

from specd.engine.builder import build_engine
from specd.grammar.backend import GrammarSpec
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.local import LocalGrammarBackend
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.models.loader import load_tokenizer
from specd.sampling_params import SamplingParams


@pytest.mark.parametrize("method", [None, "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_complete_grammar_stops_before_min_new_tokens(tiny_models, method, temperature):
    target = tiny_models["target-llama"]
    cache = GrammarCompilerCache.from_model_dir(target)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3) if method else None
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=4, block_size=16), spec,
                          grammar_backend=LocalGrammarBackend(cache))
    grammar = GrammarSpec("regex", "(yes|no)")
    params = SamplingParams(max_new_tokens=16, min_new_tokens=8, temperature=temperature, seed=3)
    (seq,) = engine.generate([[5, 6, 7, 8, 9]], [params], [grammar])
    text = load_tokenizer(target).decode(seq.output_token_ids, skip_special_tokens=True)
    assert seq.finish_reason == "stop" and text in ("yes", "no"), (seq.finish_reason, text)
    assert seq.num_output_tokens < 8  # the grammar ended it before min_new_tokens
