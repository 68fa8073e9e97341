"""The verify batch staged while a real drafter service drafts (SpecEngine._stage_next_verify):
the engine's static-path runner (the CPU twin of the CUDA graphs) against drafters on loopback,
over the fast step path, one of them killed mid-generation. Output is the target's greedy output
either way, and the stage is taken."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from specd.engine.engine import STAGE_VERIFY_ENV, SpecEngine
from specd.models.llama_runner import LlamaRunner
from specd.proposers.remote import RemoteProposer
from tests.services.test_drafter import make_requests, target_greedy
from tests.services.test_drafter_failover import ENGINE_CONFIG, serve


def static_engine(tiny_models, method: str, proposer, stage: bool) -> SpecEngine:
    target = tiny_models["target-llama"]
    runner = LlamaRunner(str(target), ENGINE_CONFIG, use_static_path=True, compile_mode="0")
    aux = getattr(proposer, "aux_layer_ids", None)
    if aux:
        runner.set_aux_hidden_layers(list(aux))
    with mock.patch.dict(os.environ, {STAGE_VERIFY_ENV: "1" if stage else "0"}):
        return SpecEngine(runner, proposer, 3, max_batch_size=ENGINE_CONFIG.max_batch_size,
                          max_model_len=runner.info.max_position_embeddings)


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_staged_against_drafter_services(tiny_models, method):
    servers = [serve(tiny_models, method), serve(tiny_models, method)]
    prompts, params = make_requests(8)
    want = target_greedy(tiny_models, "target-llama", prompts, params)
    try:
        with RemoteProposer([s.address for s in servers], deadline_s=2.0) as remote:
            engine = static_engine(tiny_models, method, remote, stage=True)
            seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            for _ in range(4):
                engine.step()
            servers[0].stop(0)  # a drafter dies with a staged batch waiting on its drafts
            while engine.has_unfinished():
                engine.step()
            assert [s.output_token_ids for s in seqs] == want
            assert engine.runner.num_staged_forwards > 0, engine.stats.num_steps
            assert not engine.runner.staged
            kv = engine.runner.kv_cache
            assert kv.allocator.num_free_blocks == kv.num_blocks
    finally:
        for s in servers:
            s.stop(0)
