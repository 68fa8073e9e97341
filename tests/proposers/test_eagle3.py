"""EAGLE-3: the tiny head's layout, and drafts equal to a naive full recompute of its maths."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specd.proposers.base import DraftRequest
from specd.proposers.draft_constraints import DraftConstraints
from specd.proposers.eagle3 import Eagle3Proposer
from specd.sampling_params import SamplingParams
from specd.tiny_models.eagle3 import write_tiny_eagle3

DTYPE = torch.float64


@pytest.fixture(scope="module")
def target_dir(llama_target_dir):
    return llama_target_dir


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_dir):
    return write_tiny_eagle3(tmp_path_factory.mktemp("draft-eagle3"), target_dir, seed=1)


@pytest.fixture(scope="module")
def target(target_dir):
    return LlamaForCausalLM.from_pretrained(str(target_dir), dtype=DTYPE).eval()


@pytest.fixture(scope="module")
def rows_fn(sim, target):
    return sim.target_rows_fn(target, [2, 4, 5])  # L = 8: layers 2, L // 2, L - 3


class NaiveEagle3:
    """SafeAILab's midlayer written out plainly: one sequence, no cache, causal attention."""

    def __init__(self, draft_dir, target) -> None:
        self.cfg = json.loads((draft_dir / "config.json").read_text())
        self.w = {k: (v.to(DTYPE) if v.is_floating_point() else v)
                  for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        self.embed = target.model.embed_tokens.weight.detach().to(DTYPE)

    def rms(self, x, name):
        eps = self.cfg["rms_norm_eps"]
        return self.w[name] * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def project(self, rows):
        return rows @ self.w["fc.weight"].T

    def forward(self, ids, hidden, positions):
        w, c = self.w, self.cfg
        nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        x = torch.cat([self.rms(self.embed[ids], "midlayer.input_layernorm.weight"),
                       self.rms(hidden, "midlayer.hidden_norm.weight")], dim=-1)  # [S, 2H]
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, nh, d)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, nkv, d)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, nkv, d)
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, dtype=DTYPE) / d))
        angle = positions[:, None].to(DTYPE) * inv_freq[None]  # [S, d / 2]
        cos = torch.cat([angle.cos()] * 2, -1)[:, None]  # [S, 1, d]
        sin = torch.cat([angle.sin()] * 2, -1)[:, None]

        def rope(t):
            return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin
        q, k = rope(q), rope(k).repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("shd,thd->hst", q, k) / d ** 0.5
        seq = len(ids)
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(seq, nh * d)
        h = hidden + attn @ w["midlayer.self_attn.o_proj.weight"].T
        m = self.rms(h, "midlayer.post_attention_layernorm.weight")
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        return h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    def logits(self, chain):
        draft = self.rms(chain, "norm.weight") @ self.w["lm_head.weight"].T  # [N, draft_vocab]
        full = torch.full((chain.shape[0], self.cfg["vocab_size"]), float("-inf"), dtype=DTYPE)
        full[:, torch.arange(draft.shape[1]) + self.w["d2t"]] = draft
        return full


def test_writer_layout(draft_dir):
    tensors = load_file(str(draft_dir / "model.safetensors"))
    attn = [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"]
    mlp = [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    norms = [f"midlayer.{n}.weight"
             for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")]
    top = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
    assert set(tensors) == {*top, *attn, *mlp, *norms}
    assert tensors["fc.weight"].shape == (64, 192)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # input 2H
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (32, 128)
    assert tensors["lm_head.weight"].shape == (256, 64)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (256,)
    assert t2d.dtype == torch.bool and t2d.shape == (512,)
    target_ids = torch.arange(256) + d2t
    assert (target_ids.diff() > 0).all() and t2d[target_ids].all() and int(t2d.sum()) == 256
    assert t2d[:4].all()  # special tokens stay draftable
    cfg = json.loads((draft_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["hidden_size"]) == (512, 256, 64)


def test_loads_borrowing_target_embeddings(draft_dir, target_dir, target):
    proposer = Eagle3Proposer(draft_dir, target_dir, dtype=DTYPE)
    assert (proposer.method, proposer.hidden_kind) == ("eagle3", "aux")
    assert proposer.aux_layer_ids == [2, 4, 5]
    torch.testing.assert_close(proposer.head.embed_tokens.weight,
                               target.model.embed_tokens.weight.to(DTYPE))


def test_matches_full_recompute(sim, draft_dir, target_dir, target, rows_fn, static_steps):
    proposer = Eagle3Proposer(draft_dir, target_dir, dtype=DTYPE, static_steps=static_steps)
    ref = NaiveEagle3(draft_dir, target)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=3),
              SamplingParams(temperature=1.2, top_k=30, repetition_penalty=1.2, seed=4)]
    prompts = [[10, 11, 12, 13], [40] * 2, [99]]
    verifier = sim.check_against_reference(proposer, ref, rows_fn, params, prompts, num_steps=6,
                                           seed=0)
    assert not static_steps or proposer.graphs.num_static_forwards > 0
    t2d = load_file(str(draft_dir / "model.safetensors"))["t2d"]
    sim.check_sampled_probs(verifier, allowed=t2d)
    for s in verifier.seqs.values():  # every draft is a draftable target id
        assert all(bool(t2d[t]) for drafts, _ in s.history for t in drafts)


def test_greedy_batch_matches_full_recompute(sim, draft_dir, target_dir, target, rows_fn, static_steps):
    """All greedy: the drafts stay on the device between steps, every sequence at its own k."""
    proposer = Eagle3Proposer(draft_dir, target_dir, dtype=DTYPE, static_steps=static_steps)
    prompts = [[10, 11, 12, 13], [40] * 2, [99], list(range(100, 130))]
    sim.check_against_reference(proposer, NaiveEagle3(draft_dir, target), rows_fn,
                                [SamplingParams()] * len(prompts), prompts, num_steps=8, seed=5)
    assert not static_steps or proposer.graphs.num_static_forwards > 0


def test_greedy_batch_without_grammars_keeps_the_device_path(sim, draft_dir, target_dir, target, rows_fn,
                                                             static_steps):
    """Structured output enabled (the services' drafters always have it) but no sequence with a
    grammar: the greedy drafts still stay on the device between steps (head.greedy_tokens, one
    wait a propose), not the per-step logits and host argmax of the grammar path, and they equal
    the full recompute's; the grammar tables are never built."""
    proposer = Eagle3Proposer(draft_dir, target_dir, dtype=DTYPE, static_steps=static_steps)

    def no_compiler():
        raise AssertionError("an unconstrained batch built the grammar compiler")
    proposer.draft_constraints = DraftConstraints(no_compiler)
    head, calls = proposer.head, []
    greedy_tokens = head.greedy_tokens
    head.greedy_tokens = lambda hidden: (calls.append(hidden.shape[0]), greedy_tokens(hidden))[1]
    prompts = [[10, 11, 12, 13], [40] * 2, [99]]
    sim.check_against_reference(proposer, NaiveEagle3(draft_dir, target), rows_fn,
                                [SamplingParams()] * len(prompts), prompts, num_steps=5, seed=7)
    assert calls, "the greedy batch took the grammar path"


def test_batch_equals_alone(sim, draft_dir, target_dir, rows_fn, static_steps):
    sim.check_batch_equals_alone(
        lambda: Eagle3Proposer(draft_dir, target_dir, dtype=DTYPE, static_steps=static_steps), rows_fn)


def test_zero_draft_tokens_ingests_only(sim, draft_dir, target_dir, target, rows_fn, static_steps):
    proposer = Eagle3Proposer(draft_dir, target_dir, dtype=DTYPE, static_steps=static_steps)
    tokens = [3, 50, 60, 70, 80]
    proposer.open(0, SamplingParams())
    rows = rows_fn(tokens + [90, 91])
    out = proposer.propose([DraftRequest(0, tokens, rows[:4].to(DTYPE), 0)])
    assert out[0].token_ids.shape == (0,) and out[0].probs is None
    out = proposer.propose([DraftRequest(0, [90], rows[4:5].to(DTYPE), 0)])
    assert out[0].token_ids.shape == (0,)
    out = proposer.propose([DraftRequest(0, [91], rows[5:6].to(DTYPE), 3)])
    ref = NaiveEagle3(draft_dir, target)
    want, _ = sim.full_recompute_drafts(ref, tokens + [90, 91], rows[:6], 3, SamplingParams())
    assert out[0].token_ids.tolist() == want


def test_aux_layer_ids_from_config(tmp_path, draft_dir, target_dir):
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).write_bytes((draft_dir / name).read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert Eagle3Proposer(tmp_path, target_dir).aux_layer_ids == [1, 3, 6]


def test_bfloat16_runs(draft_dir, target_dir, rows_fn):
    proposer = Eagle3Proposer(draft_dir, target_dir, dtype=torch.bfloat16)
    tokens = [3, 50, 60, 70]
    proposer.open(0, SamplingParams(temperature=1.0, seed=1))
    out = proposer.propose([DraftRequest(0, tokens, rows_fn(tokens)[:3].to(torch.bfloat16), 4)])[0]
    assert out.token_ids.shape == (4,)
    assert out.probs.shape == (4, 512) and out.probs.dtype == torch.float32


def test_greedy_tokens_are_the_logits_argmax(draft_dir, target_dir):
    head = Eagle3Proposer(draft_dir, target_dir, dtype=DTYPE).head
    hidden = torch.randn(64, 64, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    assert torch.equal(head.greedy_tokens(hidden), head.logits(hidden).argmax(dim=-1))
