"""Overlapped decoding (specd/engine/overlap.py): a decode step is queued before the last one's
tokens reach the host, its first tokens read on the device, and the output is the synchronous
loop's own, token for token, greedy and sampled, on the eager path and on the static path (the CUDA
graphs' CPU twin), through stops, aborts, admissions and sequences that need the host's history.

The reference is the same runner without first_token_ids (`takes_first_token_ids = False`): the
engine then waits for each step's tokens before it queues the next."""

from __future__ import annotations

import pytest

from specd.engine.engine import SpecEngine
from specd.messages import PytorchEngineConfig
from specd.models.llama_runner import LlamaRunner
from specd.sampling_params import SamplingParams
from tests.engine.test_greedy_lossless import make_requests

CONFIG = PytorchEngineConfig(max_batch_size=8, block_size=8, session_len=256)


class CountingRunner(LlamaRunner):
    """Counts the forwards that read first tokens on the device (queued ahead of the host)."""

    num_carried_forwards = 0

    def forward(self, chunks, **kwargs):
        if kwargs.get("first_token_ids") is not None:
            self.num_carried_forwards += 1
        return super().forward(chunks, **kwargs)


class HostTokensRunner(LlamaRunner):
    takes_first_token_ids = False


def engine_over(runner_class, target, static: bool) -> SpecEngine:
    runner = runner_class(str(target), CONFIG, use_static_path=static or None)
    return SpecEngine(runner, None, 0, max_batch_size=CONFIG.max_batch_size, max_model_len=CONFIG.session_len)


def sampled(params: list[SamplingParams]) -> list[SamplingParams]:
    return [SamplingParams(**{**p.__dict__, "temperature": 0.8, "top_p": 0.9, "seed": 7 + i})
            for i, p in enumerate(params)]


def outcome(seqs) -> list[tuple]:
    return [(s.output_token_ids, s.finish_reason) for s in seqs]


def all_blocks_free(engine: SpecEngine) -> bool:
    kv = engine.runner.kv_cache
    return kv.allocator.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_overlapped_decode_is_the_synchronous_loops_output(tiny_models, static, sampling):
    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=5)  # stop tokens, ignore_eos, mixed max_new_tokens
    if sampling:
        params = sampled(params)
    want = outcome(engine_over(HostTokensRunner, target, static).generate(prompts, params))
    engine = engine_over(CountingRunner, target, static)
    assert outcome(engine.generate(prompts, params)) == want
    assert engine.runner.num_carried_forwards > 0.5 * engine.stats.num_steps  # it did run ahead
    assert all_blocks_free(engine)  # the steps decoded past a stop gave their slots back


def test_stops_aborts_and_admissions_while_a_step_is_in_flight(tiny_models):
    """A stop token found on landing drops the step queued past it; an abort between steps drops
    the sequence's row when its step lands; a request added mid-run joins the next step."""
    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=6)
    params = [SamplingParams(**{**p.__dict__, "max_new_tokens": 24}) for p in params]
    want = outcome(engine_over(HostTokensRunner, target, False).generate(prompts, params))

    engine = engine_over(CountingRunner, target, False)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts[:5], params[:5])]
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None and seqs[2] in engine._in_flight.batch
    num_before_abort = seqs[2].num_output_tokens
    assert engine.abort(seqs[2])  # its step is in flight: that token is dropped on landing
    seqs += [engine.add_request(p, sp) for p, sp in zip(prompts[5:], params[5:])]
    while engine.has_unfinished():
        engine.step()
    got = outcome(seqs)
    assert got[:2] + got[3:] == want[:2] + want[3:]
    aborted = seqs[2].output_token_ids
    assert seqs[2].finish_reason == "abort" and aborted == want[2][0][:num_before_abort]
    assert len(aborted) == num_before_abort
    assert engine.runner.num_carried_forwards > 0
    assert all_blocks_free(engine)


def test_sequences_that_need_their_history_take_the_synchronous_step(tiny_models):
    """A repetition penalty reads the tokens so far: while such a request runs, every step lands
    before the next is queued; the others' output is unchanged either way."""
    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=7)
    params[3] = SamplingParams(**{**params[3].__dict__, "repetition_penalty": 1.3, "max_new_tokens": 6})
    params[5] = SamplingParams(**{**params[5].__dict__, "min_new_tokens": 4})
    want = outcome(engine_over(HostTokensRunner, target, False).generate(prompts, params))
    engine = engine_over(CountingRunner, target, False)
    assert outcome(engine.generate(prompts, params)) == want
    assert all_blocks_free(engine)

    penalized = engine_over(CountingRunner, target, False)
    penalized.generate(prompts[3:4], params[3:4])
    assert penalized.runner.num_carried_forwards == 0


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_steps_where_adaptive_drafting_drafts_nothing_overlap(tiny_models, sampling):
    """With a proposer whose drafts never pay (every draft missed; drafting costly), adaptive
    drafting settles on k = 0: those steps queue ahead as without a proposer, the drafter is not
    asked in them, and its probes still come back. The output is the synchronous loop's with the
    same proposer and policy, token for token (greedy: also the target-only loop's)."""
    from specd.engine.draft_policy import DraftLengthPolicy
    from specd.proposers.replay import ReplayProposer, load_references, write_references
    from tests.engine.draft_costs import FixedCost
    from tests.engine.test_adaptive_drafting import Recording

    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=8)
    params = [SamplingParams(**{**p.__dict__, "max_new_tokens": 40}) for p in params]
    if sampling:
        params = sampled(params)
    target_only = outcome(engine_over(HostTokensRunner, target, False).generate(prompts, params))
    refs = target.parent / "overlap_refs.jsonl"
    write_references(refs, [(p, out) for p, (out, _) in zip(prompts, target_only)])

    def speculative(runner_class):
        proposer = Recording(ReplayProposer(load_references(refs), 512, 1.0))  # every draft corrupted
        policy = DraftLengthPolicy(3, method="replay", cost=FixedCost(3, depth_share=0.3))
        engine = SpecEngine(runner_class(str(target), CONFIG), proposer, 3, max_batch_size=CONFIG.max_batch_size,
                            max_model_len=CONFIG.session_len, draft_policy=policy)
        return engine, proposer, outcome(engine.generate(prompts, params))

    _, _, want = speculative(HostTokensRunner)
    engine, proposer, got = speculative(CountingRunner)
    assert got == want
    if not sampling:
        assert got == target_only
    stats = engine.stats
    assert engine.runner.num_carried_forwards > 0.5 * stats.num_steps  # undrafted steps ran ahead
    assert 0 < proposer.num_calls <= stats.num_steps - stats.num_undrafted_steps  # probes, no k = 0 calls
    assert all_blocks_free(engine)
