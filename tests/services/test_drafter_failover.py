"""Drafter death with real gRPC servers: the engine keeps decoding target-only for the requests of a
drafter that went away (greedy output unchanged), resyncs them on the surviving drafter, and puts
a restarted drafter back on the ring; a drafter past the step deadline costs one deadline. The
death is also met on the static path's CPU twin with the next verify batch staged while the
drafts are out (specd/engine/staging.py): a staged batch waits on the drafter that dies."""

from __future__ import annotations

import os
import time
from unittest import mock

import pytest
import torch

from services.drafter.server import load_drafter, start_server
from services.drafter.servicer import DrafterServicer
from specd.engine.builder import build_engine
from specd.engine.engine import SpecEngine
from specd import settings

STAGE_VERIFY_ENV = settings.STAGE_VERIFY.name
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.models.llama_runner import LlamaRunner
from specd.proposers.base import DraftProposal
from specd.clients.drafter import RemoteProposer
from specd.sampling_params import SamplingParams
from specd.transport.ports import free_port
from tests.services.test_drafter import SlowProposer, make_requests, target_greedy

ENGINE_CONFIG = PytorchEngineConfig(max_batch_size=8, block_size=8)
DRAFTS = {"ngram": None, "eagle3": "draft-eagle3"}


def spec(tiny_models, method):
    """Fixed k: every step asks the drafters (adaptive drafting asks nothing in steps where no
    sequence drafts, which measured timings decide), so a failover shows within the steps counted."""
    draft = DRAFTS[method]
    return SpeculativeConfig(method=method, num_speculative_tokens=3, model=str(tiny_models[draft]) if draft else "",
                             adaptive=False)


def serve(tiny_models, method, port=0):
    servicer = load_drafter(tiny_models["target-llama"], spec(tiny_models, method), tiny_models["target-llama"])
    return start_server(servicer, "127.0.0.1", port, max_workers=8)


def staged_engine(tiny_models, proposer) -> SpecEngine:
    """The engine over the static path's CPU twin, staging its verify batches."""
    runner = LlamaRunner(str(tiny_models["target-llama"]), ENGINE_CONFIG, use_static_path=True)
    if proposer.aux_layer_ids:
        runner.set_aux_hidden_layers(list(proposer.aux_layer_ids))
    with mock.patch.dict(os.environ, {STAGE_VERIFY_ENV: "1"}):
        return SpecEngine(runner, proposer, 3, max_batch_size=ENGINE_CONFIG.max_batch_size,
                          max_model_len=runner.info.max_position_embeddings)


def drafted(seqs) -> int:
    return sum(s.stats.num_draft_tokens for s in seqs)


def step_until(engine, done, max_steps: int) -> int:
    """Engine steps until done() (at most max_steps, asserted); returns how many ran."""
    for n in range(1, max_steps + 1):
        engine.step()
        if done():
            return n
    raise AssertionError(f"not done after {max_steps} steps")


@pytest.mark.parametrize("staged", [False, True], ids=["default", "staged"])
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_killed_drafter_falls_back_then_resyncs_on_the_survivor(tiny_models, method, staged):
    servers = [serve(tiny_models, method), serve(tiny_models, method)]
    prompts, params = make_requests(8)
    want = target_greedy(tiny_models, "target-llama", prompts, params)
    try:
        with RemoteProposer([s.address for s in servers], deadline_s=2.0) as remote:
            engine = (staged_engine(tiny_models, remote) if staged else
                      build_engine(tiny_models["target-llama"], ENGINE_CONFIG, spec(tiny_models, method),
                                   proposer=remote))
            seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            for _ in range(3):
                engine.step()
            assert engine.runner.staged == staged  # (a staged batch waits on the victim's drafts)
            # The victim is the drafter holding more of the running batch: the ring places sequences
            # by the servers' (random) ports, so either may hold them, and rarely one holds them all.
            running = [s for s in seqs if not s.is_finished]
            held = {srv.address: [s for s in running if remote.drafter_of(s.seq_id) == srv.address] for srv in servers}
            victim = max(servers, key=lambda srv: len(held[srv.address]))
            survivor = next(srv for srv in servers if srv is not victim)
            on_victim = held[victim.address]
            assert on_victim, "no running sequence after three steps: the requests are too short for this test"
            opened_before = survivor.servicer.num_sequences_opened
            victim.stop(0)  # the drafter dies mid-generation
            # Its requests go target-only at once: the step after the kill still uses the drafts
            # it sent ahead of the kill (specd/engine/drafting.py), the next finds it gone.
            t0 = time.perf_counter()
            steps = step_until(engine, lambda: remote.num_failovers == 1, max_steps=2)
            assert time.perf_counter() - t0 < 2.0 * steps and remote.num_failovers == 1
            assert remote.addresses == [survivor.address]
            before = drafted(on_victim)
            while engine.has_unfinished():
                engine.step()
            # Resynced on the survivor with their whole history: speculation resumed.
            assert survivor.servicer.num_sequences_opened >= opened_before + len(on_victim)
            assert drafted(on_victim) > before
            if staged:
                assert engine.runner.num_staged_forwards > 0 and not engine.runner.staged
                kv = engine.runner.kv_cache
                assert kv.allocator.num_free_blocks == kv.num_blocks
    finally:
        for s in servers:
            s.stop(0)
    assert [s.output_token_ids for s in seqs] == want


def test_restarted_drafter_rejoins_and_speculation_resumes(tiny_models):
    port = free_port()
    server = serve(tiny_models, "ngram", port)
    prompts, _ = make_requests(8)
    params = [SamplingParams(max_new_tokens=48, ignore_eos=True)] * len(prompts)
    want = [s.output_token_ids for s in build_engine(tiny_models["target-llama"], ENGINE_CONFIG).generate(prompts, params)]
    with RemoteProposer([server.address], deadline_s=2.0, reconnect_backoff_s=0.05) as remote:
        engine = build_engine(tiny_models["target-llama"], ENGINE_CONFIG, spec(tiny_models, "ngram"), proposer=remote)
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        engine.step()
        server.stop(0)  # the only drafter: everything decodes target-only
        step_until(engine, lambda: remote.addresses == [], max_steps=2)  # (drafts sent ahead first)
        assert remote.addresses == [] and remote.num_parked > 0
        stalled = drafted(seqs)
        engine.step()
        assert drafted(seqs) == stalled  # no drafter, no drafts, and no waiting on one either
        server = serve(tiny_models, "ngram", port)  # restarted on the same address
        try:
            deadline = time.monotonic() + 20
            while remote.num_reconnects == 0:
                assert time.monotonic() < deadline, "the drafter was not reconnected"
                engine.step() if engine.has_unfinished() else time.sleep(0.05)
            live = [s for s in seqs if not s.is_finished]
            assert live, "requests should still be running when the drafter is back"
            while engine.has_unfinished():
                engine.step()
            assert remote.num_parked == 0 and server.servicer.num_sequences_opened >= len(live)
            assert drafted(seqs) > stalled  # speculation resumed on the restarted drafter
        finally:
            server.stop(0)
    assert [s.output_token_ids for s in seqs] == want


def test_slow_drafter_costs_one_deadline_then_decoding_goes_on(tiny_models):
    server = start_server(DrafterServicer(SlowProposer(3.0), vocab_size=512), "127.0.0.1", 0)
    prompts, params = make_requests(4)
    try:
        with RemoteProposer([server.address], deadline_s=0.3) as remote:
            engine = build_engine(tiny_models["target-llama"], ENGINE_CONFIG,
                                  SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
                                  proposer=remote)
            t0 = time.perf_counter()
            seqs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - t0
    finally:
        server.stop(0)
    t0 = time.perf_counter()
    reference = build_engine(tiny_models["target-llama"], ENGINE_CONFIG).generate(prompts, params)
    alone = time.perf_counter() - t0
    print(f"\n4 requests through a drafter 10x past the 0.3 s deadline: {elapsed:.2f} s "
          f"({alone:.2f} s without a drafter, {remote.num_failovers} failovers)")
    # One missed deadline, not one per step: the drafter rejoins only once it answers a step in
    # time (after its slow one), and each rejoin may cost one more deadline, never the drafter's 3 s.
    assert 1 <= remote.num_failovers <= 1 + remote.num_reconnects
    assert elapsed < alone + 0.3 * remote.num_failovers + 2.0
    assert [s.output_token_ids for s in seqs] == [r.output_token_ids for r in reference]


class MalformedProposer(SlowProposer):
    """A drafter's bug or version skew: answers drafts the verifier must not verify."""

    def __init__(self, fault: str) -> None:
        super().__init__(0.0)
        self.fault = fault

    def propose(self, requests):
        if self.fault == "out of vocabulary":
            return [DraftProposal(torch.full((r.num_draft_tokens,), 10_000, dtype=torch.long)) for r in requests]
        if self.fault == "too many":
            return [DraftProposal(torch.full((r.num_draft_tokens + 2,), 7, dtype=torch.long)) for r in requests]
        return [DraftProposal(torch.full((r.num_draft_tokens,), 7, dtype=torch.long),
                              torch.full((r.num_draft_tokens, 3), 1 / 3)) for r in requests]  # q rows of 3


@pytest.mark.parametrize("fault", ["out of vocabulary", "too many", "q rows"])
def test_malformed_drafts_are_a_lost_drafter_not_a_failed_step(tiny_models, fault):
    """Before, drafts past the vocabulary reached the embedding (on CUDA a device assert, the
    verifier lost) and too many drafts failed the engine's step (every request failed)."""
    server = start_server(DrafterServicer(MalformedProposer(fault), vocab_size=512), "127.0.0.1", 0)
    prompts, params = make_requests(4)
    try:
        with RemoteProposer([server.address], deadline_s=2.0) as remote:
            engine = build_engine(tiny_models["target-llama"], ENGINE_CONFIG,
                                  SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
                                  proposer=remote)
            seqs = engine.generate(prompts, params)
            assert remote.num_failovers >= 1
    finally:
        server.stop(0)
    assert [s.output_token_ids for s in seqs] == target_greedy(tiny_models, "target-llama", prompts, params)
