"""SpecEngine.abort: a dropped sequence frees its KV blocks and draft state; the others go on."""

from __future__ import annotations

from specd.engine.builder import build_engine
from specd.engine.sequence import SequenceStatus
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams


def test_abort_running_and_waiting(tiny_models):
    engine = build_engine(tiny_models["target-llama"], PytorchEngineConfig(max_batch_size=2, block_size=8),
                          SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    cache = engine.runner.kv_cache
    free_before = cache.allocator.num_free_blocks
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    a, b, c = (engine.add_request([5 + i, 6, 7, 8] * 3, params) for i in range(3))
    engine.step()  # a and b run, c waits (batch of 2)
    assert a in engine.running and c in engine.waiting

    assert engine.abort(a) and engine.abort(c)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "abort" and a.output_token_ids
    assert not cache.has_sequence(a.seq_id) and a.seq_id not in engine.proposer._indexes
    assert [s.seq_id for s in engine.running] == [b.seq_id] and not engine.waiting
    assert not engine.abort(a)  # already gone

    while engine.has_unfinished():
        engine.step()
    assert b.finish_reason == "length" and b.num_output_tokens == 20
    assert cache.allocator.num_free_blocks == free_before
