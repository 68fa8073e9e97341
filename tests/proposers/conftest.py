"""Shared pieces of the draft-head tests: tiny checkpoints, a simulated verifier, a full recompute.

The simulated verifier commits a random number of each step's drafts plus one new token and sends
the target's hidden rows for the newly committed positions, computed by plain transformers over
the whole committed sequence. The reference drafts recompute the whole pair sequence at every draft
step (no KV cache), through an implementation independent of the proposer's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from specd.proposers.base import DraftRequest
from specd.random import SALT_DRAFT
from specd.sampling import (SamplingTensors, apply_repetition_penalty, processed_probs,
                            sample_from_probs)
from specd.sampling_params import SamplingParams

VOCAB = 512
DTYPE = torch.float64  # exact enough that greedy comparisons never hinge on a near-tie


def target_rows_fn(model, layer_ids: list[int] | None):
    """tokens -> target hidden rows [len, H*]: aux (inputs of layer_ids, concatenated) or final."""
    @torch.no_grad()
    def rows(tokens: list[int]) -> torch.Tensor:
        hs = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        if layer_ids is None:
            return hs[-1][0]  # after the final norm
        return torch.cat([hs[i] for i in layer_ids], dim=-1)[0]  # hs[i] is the input of layer i
    return rows


def causal_mask(seq: int) -> torch.Tensor:
    """Additive causal mask [1, 1, S, S] for transformers' attention modules."""
    upper = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return torch.zeros(seq, seq, dtype=DTYPE).masked_fill(upper, float("-inf"))[None, None]


def choose(logits: torch.Tensor, params: SamplingParams, position: int, context: list[int]):
    """The draft token (and q for sampled requests) from one row of logits [1, V]."""
    if params.is_greedy:
        return int(logits.argmax()), None
    st = SamplingTensors.from_params([params])
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, [torch.tensor(context)], st.repetition_penalty)
    q = processed_probs(logits.float(), st)
    token = sample_from_probs(q, st.seeds, torch.tensor([position]), SALT_DRAFT)
    return int(token), q[0]


@torch.no_grad()
def full_recompute_drafts(ref, tokens: list[int], rows: torch.Tensor, k: int,
                          params: SamplingParams):
    """Drafts by rerunning the head over every pair (committed and drafted) at each step."""
    hidden = ref.project(rows.to(DTYPE))  # [n, H], pairs (h_p, x_{p+1})
    ids = list(tokens[1:])
    drafts, qs = [], []
    for j in range(k):
        chain = ref.forward(torch.tensor(ids), hidden, torch.arange(len(ids)))  # [S, H]
        token, q = choose(ref.logits(chain[-1:]).float(), params, len(tokens) + j, tokens + drafts)
        drafts.append(token)
        qs.append(q)
        ids.append(token)
        hidden = torch.cat([hidden, chain[-1:]])
    return drafts, (None if params.is_greedy or not qs else torch.stack(qs))


@dataclass
class SimSeq:
    """One sequence as the verifier sees it."""

    seq_id: int
    params: SamplingParams
    tokens: list[int]  # committed
    num_sent: int = 0  # tokens already sent to the proposer
    history: list = field(default_factory=list)  # (drafts, probs) per step


class Verifier:
    """Drives a proposer over several steps for a set of sequences."""

    def __init__(self, proposer, rows_fn, seed: int = 0) -> None:
        self.proposer, self.rows_fn, self.rng = proposer, rows_fn, random.Random(seed)
        self.seqs: dict[int, SimSeq] = {}

    def open(self, seq_id: int, prompt: list[int], params: SamplingParams) -> None:
        self.proposer.open(seq_id, params)
        self.seqs[seq_id] = SimSeq(seq_id, params, list(prompt) + [self.rng.randrange(4, VOCAB)])

    def request(self, seq_id: int, k: int) -> DraftRequest:
        s = self.seqs[seq_id]
        first = s.num_sent == 0
        rows = self.rows_fn(s.tokens)[s.num_sent - (0 if first else 1): len(s.tokens) - 1]
        return DraftRequest(seq_id, s.tokens[s.num_sent:], rows.to(DTYPE), k)

    def step(self, ks: dict[int, int]):
        """Propose for the given sequences (seq_id -> k) in one batch, then commit; returns
        {seq_id: (tokens committed before the step, drafts, probs)}."""
        requests = [self.request(i, k) for i, k in ks.items()]
        outs = self.proposer.propose(requests)
        result = {}
        for r, out in zip(requests, outs):
            s = self.seqs[r.seq_id]
            assert out.token_ids.dtype == torch.long
            assert out.token_ids.shape == (r.num_draft_tokens,)
            result[r.seq_id] = (list(s.tokens), out.token_ids.tolist(), out.probs)
            s.history.append((out.token_ids.tolist(), out.probs))
            s.num_sent = len(s.tokens)
            drafts = out.token_ids.tolist()
            accepted = self.rng.randint(0, len(drafts))
            s.tokens += drafts[:accepted] + [self.rng.randrange(4, VOCAB)]
        return result


def check_against_reference(proposer, ref, rows_fn, params_list, prompts, num_steps: int,
                            seed: int):
    """Several steps with rollback; every step's drafts equal the full recompute's."""
    verifier = Verifier(proposer, rows_fn, seed)
    rng = random.Random(seed + 100)
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        verifier.open(i, prompt, params)
    for _ in range(num_steps):
        ks = {i: rng.randint(0, 4) for i in verifier.seqs}
        for i, (committed, drafts, probs) in verifier.step(ks).items():
            params = verifier.seqs[i].params
            rows = rows_fn(committed)[: len(committed) - 1]
            want, want_q = full_recompute_drafts(ref, committed, rows, ks[i], params)
            assert drafts == want, f"seq {i} after {len(committed)} tokens"
            if params.is_greedy or ks[i] == 0:
                assert probs is None
            else:
                assert probs.shape == (ks[i], VOCAB) and probs.dtype == torch.float32
                torch.testing.assert_close(probs, want_q, atol=1e-6, rtol=1e-5)
    return verifier


def check_sampled_probs(verifier, allowed: torch.Tensor | None = None) -> None:
    """q rows of sampled steps sum to 1, give the drafted token q > 0, and stay in `allowed`."""
    seen = 0
    for s in verifier.seqs.values():
        for drafts, probs in s.history:
            if probs is None:
                continue
            seen += 1
            torch.testing.assert_close(probs.sum(-1), torch.ones(len(drafts)), atol=1e-5, rtol=0)
            assert (probs[torch.arange(len(drafts)), torch.tensor(drafts)] > 0).all()
            if allowed is not None:
                assert (probs[:, ~allowed] == 0).all()
    assert seen, "no sampled step happened"


def check_batch_equals_alone(make_proposer, rows_fn, seed: int = 0, num_steps: int = 4) -> None:
    """Three sequences of different lengths drafted in one batch == each drafted alone."""
    prompts = [[5, 9, 17], list(range(20, 41)), [7] * 9]
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=11),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=12)]
    batched = Verifier(make_proposer(), rows_fn, seed)
    alone = [Verifier(make_proposer(), rows_fn, seed) for _ in prompts]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        batched.open(i, prompt, p)
        alone[i].open(i, prompt, p)
        alone[i].seqs[i].tokens = list(batched.seqs[i].tokens)
    schedule = [{0: 3, 1: 0, 2: 2}, {0: 1, 1: 4, 2: 3}, {0: 0, 1: 2, 2: 4}, {0: 4, 1: 1, 2: 0}]
    for ks in schedule[:num_steps]:
        together = batched.step(ks)
        for i, k in ks.items():
            single = alone[i].step({i: k})[i]
            assert single[0] == together[i][0] and single[1] == together[i][1], f"seq {i}"
            if together[i][2] is None:
                assert single[2] is None
            else:
                torch.testing.assert_close(single[2], together[i][2], atol=1e-6, rtol=1e-5)
            alone[i].seqs[i].tokens = list(batched.seqs[i].tokens)  # commit the same tokens


@pytest.fixture(scope="session")
def llama_target_dir(tmp_path_factory):
    """A tiny Llama target (8 layers: EAGLE-3 reads layers 2, 4 and 5) saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("target-llama")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(params=[False, True], ids=["eager", "static"])
def static_steps(request):
    """Both forward paths of the heads: eager, and the fixed shapes CUDA graphs replay (on CPU
    they run eagerly through the same buffers: specd/proposers/head_graphs.py)."""
    return request.param


@pytest.fixture(scope="session")
def sim():
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    return SimpleNamespace(VOCAB=VOCAB, DTYPE=DTYPE, target_rows_fn=target_rows_fn,
                           causal_mask=causal_mask, Verifier=Verifier,
                           check_against_reference=check_against_reference,
                           check_sampled_probs=check_sampled_probs,
                           check_batch_equals_alone=check_batch_equals_alone,
                           full_recompute_drafts=full_recompute_drafts)
