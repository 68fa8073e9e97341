"""`specd train family` at toy size on CPU: losses fall, checkpoints load through the normal
loaders and serve losslessly, and the training-time test trains exactly what inference drafts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.proposers.base import DraftRequest
from specd.proposers.deepseek_mtp import DeepseekMTPProposer
from specd.proposers.eagle3 import Eagle3Proposer
from specd.sampling_params import SamplingParams
from specd.train.corpus import split_stdlib
from specd.train.family import NAMES, Budget, train_family
from specd.train.loop import LoopConfig
from specd.train.ttt import ttt_mask, ttt_step_logits


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    out = tmp_path_factory.mktemp("family")
    record = train_family(out, Budget.toy(), device="cpu", log=lambda msg: None)
    return out, record


@pytest.mark.parametrize("stage", ["target", "eagle3", "mtp", "draft"])
def test_every_stage_lowers_its_loss(family, stage):
    _, record = family
    assert record[stage]["steps"] == Budget.toy().target.steps
    assert record[stage]["last_loss"] < record[stage]["first_loss"] - 0.05, record[stage]


def test_target_learns_held_out_text(family):
    _, record = family
    assert record["target"]["held_out_nll"] < record["target"]["held_out_nll_before"] - 0.3


def test_training_record_is_written(family):
    out, record = family
    saved = json.loads((out / "TRAINING.json").read_text())
    assert saved["corpus"]["train_files"] > saved["corpus"]["held_out_files"] > 0
    assert saved["corpus"]["chat_examples"] > 0 and saved["self_distillation"]["rows"] > 0
    assert set(saved["paths"]) == {"target", "eagle3", "mtp", "draft"}


def test_chat_examples_use_the_served_template(family):
    out, _ = family
    tok = AutoTokenizer.from_pretrained(str(out / NAMES["target"]))
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                       add_generation_prompt=True)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids  # the special token, not its letters


@pytest.mark.parametrize("method", ["eagle3", "deepseek_mtp", "draft_model", "ngram"])
def test_trained_family_serves_losslessly(family, method):
    out, _ = family
    drafts = {"eagle3": NAMES["eagle3"], "deepseek_mtp": NAMES["mtp"], "draft_model": NAMES["draft"]}
    target = out / NAMES["target"]
    prompts = [[5, 17, 40, 9, 33], [12, 8, 8, 101, 7, 64, 3 + 2]]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    base = build_engine(target, PytorchEngineConfig(max_batch_size=4), None).generate(prompts, params)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3,
                             model=str(out / drafts[method]) if method in drafts else "")
    seqs = build_engine(target, PytorchEngineConfig(max_batch_size=4), spec).generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in base]
    assert sum(s.stats.num_drafts for s in seqs) > 0


def _proposal_and_ttt(proposer, head_logits, first_hidden_fn, target, prefix):
    """The proposer's sampled draft distributions q [k, V] for `prefix`, and the TTT logits of the
    same chain (the drafted tokens as the window's continuation)."""
    k = 3
    proposer.open(0, SamplingParams(temperature=1.0, seed=7))
    with torch.no_grad():
        out = target(torch.tensor([prefix[:-1]]), output_hidden_states=True)
    rows = first_hidden_fn(out.hidden_states)[0]
    prop = proposer.propose([DraftRequest(seq_id=0, new_token_ids=list(prefix),
                                          new_hidden_states=rows, num_draft_tokens=k)])[0]
    ids = torch.tensor([list(prefix) + prop.token_ids.tolist()[:k - 1]])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        logits = ttt_step_logits(proposer.head, head_logits, ids,
                                 proposer.head.project_target(first_hidden_fn(hs)), k)
    n = len(prefix) - 1
    return prop.probs, [logits[j][0, n - 1 + j] for j in range(k)]


def test_ttt_equals_eagle3_inference_drafts(family):
    out, _ = family
    target = LlamaForCausalLM.from_pretrained(str(out / NAMES["target"]), dtype=torch.float64)
    proposer = Eagle3Proposer(out / NAMES["eagle3"], out / NAMES["target"], dtype=torch.float64)
    head = proposer.head
    aux = proposer.aux_layer_ids
    q, ttt = _proposal_and_ttt(proposer, lambda o: head.lm_head(head.norm(o)),
                               lambda hs: torch.cat([hs[i] for i in aux], dim=-1), target,
                               [5, 17, 40, 9, 33, 12, 8])
    draft_ids = torch.arange(head.cfg.draft_vocab_size) + head.d2t
    for j in range(3):
        torch.testing.assert_close(q[j][draft_ids].double(), torch.softmax(ttt[j], -1),
                                   atol=1e-5, rtol=1e-4)


def test_ttt_equals_mtp_inference_drafts(family):
    out, _ = family
    target = LlamaForCausalLM.from_pretrained(str(out / NAMES["target"]), dtype=torch.float64)
    proposer = DeepseekMTPProposer(out / NAMES["mtp"], dtype=torch.float64,
                                   target_path=out / NAMES["target"])
    q, ttt = _proposal_and_ttt(proposer, proposer.head.logits, lambda hs: hs[-1], target,
                               [5, 17, 40, 9, 33, 12, 8])
    for j in range(3):
        torch.testing.assert_close(q[j].double(), torch.softmax(ttt[j].double(), -1), atol=1e-5,
                                   rtol=1e-4)


def test_ttt_mask_is_the_drafting_view():
    # Step 2 over 4 pairs: committed keys up to t - 2, the step-1 entry one row back, itself.
    m = ttt_mask(4, 2, torch.device("cpu"))[0, 0].int()
    committed, step1, own = m[:, :4], m[:, 4:8], m[:, 8:]
    assert committed.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert step1.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    assert own.tolist() == torch.eye(4, dtype=torch.int).tolist()


def test_split_is_stable_and_disjoint():
    a, b = split_stdlib(), split_stdlib()
    assert a == b and not set(a.train) & set(a.held_out)
    assert 0.01 < len(a.held_out) / (len(a.train) + len(a.held_out)) < 0.1


@pytest.mark.parametrize("bad", [dict(steps=0, lr=1e-3), dict(steps=5, lr=0.0),
                                 dict(steps=5, lr=1e-3, time_budget_s=-1.0)])
def test_loop_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        LoopConfig(**bad)
