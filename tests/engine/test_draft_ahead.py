"""Drafting ahead (specd/engine/drafting.py): with a proposer that answers asynchronously, the
next step's draft requests go out right after each commit and the step collects them first.

A local n-gram proposer wrapped to answer "asynchronously" stands in for the remote drafters
(tests/services cover those: failover, chaos, refresh): it computes at send time, which is what
makes the ordering questions here testable. Output must stay the target's greedy output exactly
however the batch changes between a send and its use.
"""

from __future__ import annotations

import pytest

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams
from tests.engine.test_greedy_lossless import make_requests

CONFIG = PytorchEngineConfig(max_batch_size=8, block_size=8, session_len=256)


class _Answered:
    def __init__(self, proposals):
        self._proposals = proposals

    def result(self):
        return self._proposals


class AsyncNgram:
    """The engine's own n-gram proposer behind propose_async; counts both kinds of call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.method, self.hidden_kind = inner.method, inner.hidden_kind
        self.draft_constraints = None
        self.num_sync, self.num_async = 0, 0
        self.sent_ahead: list[list[int]] = []  # seq ids of every propose_async

    def open(self, seq_id, params, grammar=None):
        self.inner.open(seq_id, params)

    def close(self, seq_id):
        self.inner.close(seq_id)

    def propose(self, requests):
        self.num_sync += 1
        return self.inner.propose(requests)

    def propose_async(self, requests):
        self.num_async += 1
        self.sent_ahead.append([r.seq_id for r in requests])
        return _Answered(self.inner.propose(requests))


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models["target-llama"]


def engine_with(target, draft_ahead: bool):
    # Fixed k: which steps draft depends on the budgets alone, not on measured costs.
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    plain = build_engine(target, CONFIG, config)
    proposer = AsyncNgram(plain.proposer)
    engine = build_engine(target, CONFIG, config, proposer=proposer)
    engine.drafting.ahead = draft_ahead
    return engine, proposer


def test_drafts_sent_ahead_are_used_and_output_is_the_targets(target):
    prompts, params = make_requests(512, seed=3)
    want = [s.output_token_ids for s in build_engine(target, CONFIG).generate(prompts, params)]
    engine, proposer = engine_with(target, draft_ahead=True)
    done = engine.generate(prompts, params)
    assert [s.output_token_ids for s in done] == want
    assert sum(s.stats.num_accepted_tokens for s in done) > 0  # the drafts sent ahead were verified
    # One exchange per step that drafts, sent ahead; a same-step call only where an admission
    # brought tokens the drafter had not seen (all 8 admitted in the first step here); none for
    # steps where nobody drafts (every budget spent).
    assert proposer.num_async == engine.stats.num_drafted_steps - 1 and proposer.num_sync == 1
    off, off_proposer = engine_with(target, draft_ahead=False)
    assert [s.output_token_ids for s in off.generate(prompts, params)] == want
    assert off_proposer.num_async == 0
    assert off_proposer.num_sync == off.stats.num_drafted_steps


def test_batch_changes_between_send_and_use(target):
    """An abort and an admission after the drafts went out, and drafts cut to less cache room:
    the aborted sequence's drafts are dropped, the admitted one drafts in the step itself, the
    others keep at most the k that fits now; output stays the target's."""
    prompts, params = make_requests(512, seed=4)
    params = [SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True) for _ in prompts]
    want = [s.output_token_ids for s in build_engine(target, CONFIG).generate(prompts, params)]
    engine, proposer = engine_with(target, draft_ahead=True)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts[:6], params[:6])]
    engine.step()
    engine.step()
    assert proposer.sent_ahead[-1] == [s.seq_id for s in seqs]
    engine.abort(seqs[0])
    late = engine.add_request(prompts[6], params[6])
    syncs = proposer.num_sync
    real_k = engine._num_drafts
    engine._num_drafts = lambda seq: min(1, real_k(seq))  # as if admissions took the cache room
    drafted_before = {s.seq_id: s.stats.num_draft_tokens for s in seqs[1:]}
    engine.step()
    engine._num_drafts = real_k
    assert proposer.num_sync == syncs + 1  # the admitted sequence, drafted in its first step
    assert all(s.stats.num_draft_tokens - drafted_before[s.seq_id] <= 1 for s in seqs[1:])
    assert seqs[0].seq_id not in proposer.sent_ahead[-1]
    while engine.has_unfinished():
        engine.step()
    for seq, expected in zip(seqs[1:] + [late], want[1:7]):
        assert seq.output_token_ids == expected


def test_commit_times_its_send_and_stage_parts(target):
    """Sending the next step's requests is timed as a part of commit (the verifier's "send_ahead"
    phase): a send that takes 20 ms shows there, not elsewhere."""
    import time

    class SlowSend(AsyncNgram):
        def propose_async(self, requests):
            time.sleep(0.02)
            return super().propose_async(requests)

    plain = build_engine(target, CONFIG, SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    proposer = SlowSend(plain.proposer)
    engine = build_engine(target, CONFIG, SpeculativeConfig(method="ngram", num_speculative_tokens=3),
                          proposer=proposer)
    prompts, params = make_requests(512, seed=5)
    engine.generate(prompts, params)
    t = engine.stats.timings
    assert proposer.num_async >= 2
    assert 0.02 * proposer.num_async <= t.send_ahead < 0.02 * proposer.num_async + 0.5
    assert t.send_ahead + t.stage <= t.commit and t.stage >= 0
