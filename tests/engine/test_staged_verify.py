"""The verify batch staged while drafts are out (specd/engine/staging.py, LlamaRunner.stage).

The engine stages the next step's verify batch (slots, the static path's buffers) right after it
sends that step's draft requests ahead; the step's forward then writes only the draft ids. The
runner undoes a stage on any other call. What must hold: nothing observable changes. Outputs,
greedy and sampled, and every sequence's drafted / accepted counts equal those of the same
engine with staging off, under admissions, aborts, preemption (a cache too small for the batch)
and drafts shorter than staged (n-gram lookups that find nothing); and the stage is actually
taken, most steps. The runner is the static path's CPU twin (what CUDA graphs replay on the GPU).
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from specd.engine.builder import build_engine
from specd.engine.engine import SpecEngine
from specd import settings

STAGE_VERIFY_ENV = settings.STAGE_VERIFY.name
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.models.base import SequenceChunk
from specd.models.llama_runner import LlamaRunner
from specd.proposers.base import DraftProposal
from specd.sampling_params import SamplingParams
from tests.engine.test_draft_ahead import AsyncNgram
from tests.engine.test_greedy_lossless import make_requests

K = 3
CONFIG = PytorchEngineConfig(max_batch_size=8, block_size=8, session_len=256)


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models["target-llama"]


class FullDrafts(AsyncNgram):
    """n-gram drafts padded to the k asked with a fixed token (any proposal is lossless): every
    chunk as long as staged, as the replay drafter and the model drafters answer."""

    def propose_async(self, requests):
        answered = super().propose_async(requests)
        answered._proposals = [DraftProposal(torch.cat([p.token_ids, torch.full(
            (r.num_draft_tokens - p.token_ids.numel(),), 4, dtype=torch.long)]))
            for r, p in zip(requests, answered._proposals)]
        return answered


def static_engine(target, stage: bool | str | None, config: PytorchEngineConfig = CONFIG, method: str = "ngram",
                  draft=None, wrapper=AsyncNgram, carry: int | None = None) -> SpecEngine:
    """An engine over the static-path runner whose proposer answers "asynchronously" (drafts
    sent ahead, as the remote drafters do), staging on or off (a string: SPECD_STAGE_VERIFY's
    value as given; None: unset, the default)."""
    spec = SpeculativeConfig(method=method, num_speculative_tokens=K, model=str(draft) if draft else "")
    plain = build_engine(target, config, spec)
    runner = LlamaRunner(str(target), config, use_static_path=True)
    if plain.runner.aux_layer_ids != runner.aux_layer_ids:
        runner.set_aux_hidden_layers(plain.runner.aux_layer_ids)
    env = {k: v for k, v in os.environ.items() if k != STAGE_VERIFY_ENV}
    if stage is not None:
        env[STAGE_VERIFY_ENV] = stage if isinstance(stage, str) else "1" if stage else "0"
    with mock.patch.dict(os.environ, env, clear=True):
        # Fixed k: every step drafts (staging's subject), the same ks in every run.
        return SpecEngine(runner, wrapper(plain.proposer), K, max_batch_size=config.max_batch_size,
                          max_model_len=config.session_len, draft_carry=carry, adaptive=False)


def outcome(seqs) -> list[tuple]:
    return [(s.output_token_ids, s.finish_reason, s.stats.num_draft_tokens, s.stats.num_accepted_tokens)
            for s in seqs]


def sampled(params: list[SamplingParams]) -> list[SamplingParams]:
    return [SamplingParams(**{**p.__dict__, "temperature": 0.8, "top_p": 0.9, "seed": 100 + i})
            for i, p in enumerate(params)]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_staging_changes_nothing(target, kind):
    """Plain n-gram drafts: often fewer than staged (no match), then some steps run unstaged."""
    prompts, params = make_requests(512, seed=5)
    if kind == "sampled":
        params = sampled(params)
    off = static_engine(target, stage=False)
    want = outcome(off.generate(prompts, params))
    on = static_engine(target, stage=True)
    got = outcome(on.generate(prompts, params))
    assert got == want
    if kind == "greedy":
        target_only = build_engine(target, CONFIG).generate(prompts, params)
        assert [g[0] for g in got] == [s.output_token_ids for s in target_only]
    assert off.runner.num_staged_forwards == 0 and on.runner.num_staged_forwards > 0
    assert not on.runner.staged
    assert on.runner.kv_cache.allocator.num_free_blocks == on.runner.kv_cache.num_blocks


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_full_drafts_stage_every_step_but_the_first(target, kind):
    prompts, params = make_requests(512, seed=6)
    if kind == "sampled":
        params = sampled(params)
    off = static_engine(target, stage=False, wrapper=FullDrafts, carry=0)
    want = outcome(off.generate(prompts, params))
    on = static_engine(target, stage=True, wrapper=FullDrafts, carry=0)
    assert outcome(on.generate(prompts, params)) == want
    # The first step's drafts were asked in the step (its sequences were just admitted); steps
    # where nobody drafts (every budget spent) are decode steps queued ahead, not staged.
    assert on.runner.num_staged_forwards == on.stats.num_drafted_steps - 1 > 5


def test_staging_is_on_by_default_and_0_turns_it_off(target):
    """SPECD_STAGE_VERIFY unset: staged; "0" stages nothing."""
    prompts, params = make_requests(512, seed=6)
    default = static_engine(target, stage=None, wrapper=FullDrafts, carry=0)
    default.generate(prompts, params)
    assert default.runner.num_staged_forwards == default.stats.num_drafted_steps - 1 > 5
    off = static_engine(target, stage=False, wrapper=FullDrafts, carry=0)
    off.generate(prompts, params)
    assert off.stats.num_steps > 5 and off.runner.num_staged_forwards == 0


@pytest.mark.parametrize("value", ["off", "true", "2", "late"])
def test_an_unknown_staging_mode_is_refused_with_the_variable_named(target, value):
    with pytest.raises(ValueError, match=f"SPECD_STAGE_VERIFY='{value}': expected 0 or 1"):
        static_engine(target, stage=value, wrapper=FullDrafts, carry=0)


def test_a_full_batch_with_requests_queued_still_stages(target):
    """Requests waiting while the batch is full: no admission is due, so the stage stays."""
    config = PytorchEngineConfig(max_batch_size=4, block_size=8, session_len=256)
    prompts, params = make_requests(512, seed=7)
    off = static_engine(target, stage=False, config=config, wrapper=FullDrafts, carry=0)
    want = outcome(off.generate(prompts, params))
    on = static_engine(target, stage=True, config=config, wrapper=FullDrafts, carry=0)
    staged_while_queued = 0
    seqs = [on.add_request(p, sp) for p, sp in zip(prompts, params)]
    while on.has_unfinished():
        queued, before = len(on.waiting), on.runner.num_staged_forwards
        on.step()
        staged_while_queued += queued > 0 and on.runner.num_staged_forwards > before
    assert outcome(seqs) == want
    assert staged_while_queued > 3


def test_admissions_and_aborts_between_steps(target):
    """Requests arriving and aborted while a batch is staged: the stage is undone first, and
    the outcome is the unstaged engine's."""
    prompts, params = make_requests(512, seed=9)

    def run(stage: bool):
        engine = static_engine(target, stage=stage)
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], params[:3])]
        late = list(zip(prompts[3:], params[3:]))
        step = 0
        while engine.has_unfinished():
            engine.step()
            step += 1
            if step % 2 == 0 and late:
                seqs.append(engine.add_request(*late.pop()))
            if step == 5:
                engine.abort(seqs[1])
        return engine, outcome(seqs)

    off, want = run(stage=False)
    on, got = run(stage=True)
    assert got == want and got[1][1] == "abort"
    assert on.runner.num_staged_forwards > 0
    assert on.runner.kv_cache.allocator.num_free_blocks == on.runner.kv_cache.num_blocks


def test_preemption_under_a_small_cache(target):
    """A cache too small for the batch: steps preempt and re-admit; staged or not, the same."""
    config = PytorchEngineConfig(max_batch_size=8, block_size=8, session_len=256, num_gpu_blocks=12)
    prompts, params = make_requests(512, seed=2)
    off = static_engine(target, stage=False, config=config)
    want = outcome(off.generate(prompts, params))
    on = static_engine(target, stage=True, config=config)
    assert outcome(on.generate(prompts, params)) == want
    assert on.runner.num_staged_forwards > 0 and on.stats.num_preemptions > 0


def test_aux_hidden_proposer(tiny_models):
    """EAGLE-3 (the target's aux hidden rows feed the drafter): staged with the aux layers."""
    target, draft = tiny_models["target-llama"], tiny_models["draft-eagle3"]
    prompts, params = make_requests(512, seed=4)
    off = static_engine(target, stage=False, method="eagle3", draft=draft)
    want = outcome(off.generate(prompts, params))
    on = static_engine(target, stage=True, method="eagle3", draft=draft)
    assert outcome(on.generate(prompts, params)) == want
    assert on.runner.num_staged_forwards > 0


# ---- the runner's contract ------------------------------------------------------------------

@pytest.fixture()
def runner(target):
    r = LlamaRunner(str(target), CONFIG, use_static_path=True)
    for seq_id, prompt in ((0, [5, 6, 7, 8, 9]), (1, [11, 12, 13])):
        r.add_sequence(seq_id)
        r.forward([SequenceChunk(seq_id, prompt)])
    return r


def cache_state(r: LlamaRunner):
    kv = r.kv_cache
    return [(kv.num_tokens(s), kv.block_table(s)) for s in (0, 1)], list(kv.allocator._free)


def test_a_staged_forward_equals_the_plain_one(runner):
    chunks = [SequenceChunk(0, [21, 22, 23, 24]), SequenceChunk(1, [31, 32])]
    before = cache_state(runner)
    plain = runner.forward(chunks).logits
    after_plain = cache_state(runner)
    for c in chunks:
        runner.truncate(c.seq_id, before[0][c.seq_id][0])
    assert runner.stage([SequenceChunk(0, [21, 0, 0, 0]), SequenceChunk(1, [31, 0])])
    assert runner.staged
    staged = runner.forward(chunks).logits
    assert runner.num_staged_forwards == 1 and not runner.staged
    torch.testing.assert_close(staged, plain, rtol=0, atol=0)
    assert cache_state(runner) == after_plain


def test_a_layout_met_first_by_the_stage_is_prepared_under_the_runners_settings(runner, monkeypatch):
    """A graph keeps its capture's kernel settings and serves every later forward of its layout,
    staged or not; so the stage, where a layout may be met (and captured) first, must prepare it
    under the runner's GEMM backend and PDL mode, as forward does. (Captured outside them, staged
    stacks replayed cuBLAS graphs without PDL, ~0.37 ms slower.)"""
    from specd.models import linear
    from specd.models.cuda_graphs import StaticForward
    from specd.models.kernels import pdl

    seen = []  # the settings in force at each prepare (where a new layout is captured)
    prepare = StaticForward.prepare

    def spy(self, *args, **kwargs):
        seen.append((linear.active_backend(), pdl.active_mode()))
        return prepare(self, *args, **kwargs)
    monkeypatch.setattr(StaticForward, "prepare", spy)
    runner.gemm, runner.pdl = "auto", "auto"  # not the settings outside any runner's scope
    outside = (linear.active_backend(), pdl.active_mode())
    assert outside == ("torch", "off")
    assert runner.stage([SequenceChunk(0, [21, 0, 0, 0]), SequenceChunk(1, [31, 0])])
    runner.forward([SequenceChunk(0, [21, 22, 23, 24]), SequenceChunk(1, [31, 32])])  # takes the stage
    runner.forward([SequenceChunk(0, [25]), SequenceChunk(1, [33])])  # unstaged: prepared in forward
    assert runner.num_staged_forwards == 1
    assert seen == [("auto", "auto")] * 2
    assert (linear.active_backend(), pdl.active_mode()) == outside  # restored


@pytest.mark.parametrize("other_call", [
    lambda r: r.can_append(0, 1),
    lambda r: r.num_cached(1),
    lambda r: r.truncate(0, 5),
    lambda r: r.add_sequence(7),
    lambda r: r.free(1),
    lambda r: r.forward([SequenceChunk(0, [21, 22])]),  # another batch: lengths differ
    lambda r: r.forward([SequenceChunk(1, [31, 32]), SequenceChunk(0, [21, 22, 23, 24])]),  # order
    lambda r: r.forward([SequenceChunk(0, [21, 22, 23, 24]), SequenceChunk(1, [31, 32])],
                        want_aux_hidden=True),
])
def test_any_other_call_undoes_the_stage_first(runner, other_call):
    before = cache_state(runner)
    assert runner.stage([SequenceChunk(0, [21, 0, 0, 0]), SequenceChunk(1, [31, 0])])
    assert cache_state(runner) != before  # the slots are reserved while staged
    other_call(runner)
    assert not runner.staged and runner.num_staged_forwards == 0


def test_unstage_restores_the_cache_exactly(runner):
    before = cache_state(runner)
    assert runner.stage([SequenceChunk(0, [21] * 4), SequenceChunk(1, [31] * 6)])  # seq 1 takes a block
    runner.unstage()
    assert cache_state(runner) == before  # block tables and the free list's order


def test_no_stage_where_the_static_path_does_not_apply(target):
    eager = LlamaRunner(str(target), CONFIG, use_static_path=False)
    eager.add_sequence(0)
    eager.forward([SequenceChunk(0, [5, 6, 7])])
    assert not eager.stage([SequenceChunk(0, [8, 0, 0, 0])]) and not eager.staged
    small = PytorchEngineConfig(max_batch_size=8, block_size=8, session_len=256, num_gpu_blocks=2)
    full = LlamaRunner(str(target), small, use_static_path=True)
    full.add_sequence(0)
    full.forward([SequenceChunk(0, [5] * 16)])  # both blocks filled
    assert not full.stage([SequenceChunk(0, [8, 0, 0, 0])]) and not full.staged  # no room: nothing staged
    assert full.num_cached(0) == 16
