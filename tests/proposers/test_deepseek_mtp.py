"""DeepSeek-V3 MTP: the tiny target's layout, and drafts equal to transformers' own MtpModel
(loaded from the same checkpoint by its own conversion mapping) run as a full recompute."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel

from specd.proposers.deepseek_mtp import CHAIN_AFTER_NORM, DeepseekMTPProposer
from specd.sampling_params import SamplingParams
from specd.tiny_models.deepseek_mtp import NUM_LAYERS, write_tiny_deepseek_mtp_target

DTYPE = torch.float64
PREFIX = f"model.layers.{NUM_LAYERS}."


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target-deepseek-mtp")
    return write_tiny_deepseek_mtp_target(path, 512, seed=3)


@pytest.fixture(scope="module")
def target(target_dir):
    # grouped_mm (the default experts kernel) has no float64
    return DeepseekV3ForCausalLM.from_pretrained(str(target_dir), dtype=DTYPE,
                                                 experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def rows_fn(sim, target):
    return sim.target_rows_fn(target, None)


class HFMtpReference:
    """transformers' MtpModel pieces, over the whole pair sequence with a causal mask."""

    def __init__(self, target, causal_mask) -> None:
        self.causal_mask = causal_mask
        # MtpModel finds the MTP tensors by the class's ignore pattern, written for L = 61.
        target._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{NUM_LAYERS}\..*"]
        self.mtp = MtpModel.from_pretrained(target).eval()
        self.layer = self.mtp.layers[0]

    def project(self, rows):
        return rows

    def forward(self, ids, hidden, positions):
        layer, emb = self.layer, self.mtp.embed_tokens(ids[None])
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden[None])], -1))
        out = layer.mtp_block(x, attention_mask=self.causal_mask(len(ids)),
                              position_ids=positions[None],
                              position_embeddings=self.mtp.rotary_emb(x, positions[None]))[0]
        return self.layer.post_norm(out) if CHAIN_AFTER_NORM else out

    def logits(self, chain):
        return self.mtp.shared_head(chain if CHAIN_AFTER_NORM else self.layer.post_norm(chain))


@pytest.fixture(scope="module")
def reference(sim, target):
    return HFMtpReference(target, sim.causal_mask)


def test_writer_layout(target_dir, target):
    tensors = load_file(str(target_dir / "model.safetensors"))
    mtp = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
    experts = {f"mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")}
    attn = {f"self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj",
                                              "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                              "o_proj")}
    shared = {f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}
    own = {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
           "shared_head.norm.weight", "shared_head.head.weight", "input_layernorm.weight",
           "post_attention_layernorm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
    assert set(mtp) == experts | attn | shared | own
    assert mtp["eh_proj.weight"].shape == (64, 128)
    assert mtp["mlp.experts.3.gate_proj.weight"].shape == (32, 64)
    assert mtp["self_attn.kv_a_proj_with_mqa.weight"].shape == (32 + 8, 64)
    torch.testing.assert_close(mtp["embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert not any(k.startswith(f"model.layers.{NUM_LAYERS + 1}.") for k in tensors)
    cfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == NUM_LAYERS
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] == 4
    # transformers loads the target, ignoring the MTP layer
    assert len(target.model.layers) == NUM_LAYERS


def test_matches_full_recompute(sim, target_dir, reference, rows_fn, static_steps):
    proposer = DeepseekMTPProposer(target_dir, dtype=DTYPE, static_steps=static_steps)
    assert (proposer.method, proposer.hidden_kind) == ("deepseek_mtp", "final")
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=3),
              SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.3, seed=5)]
    prompts = [[10, 11, 12], [40] * 5, [7]]
    verifier = sim.check_against_reference(proposer, reference, rows_fn, params, prompts,
                                           num_steps=6, seed=1)
    sim.check_sampled_probs(verifier)


def test_batch_equals_alone(sim, target_dir, rows_fn, static_steps):
    sim.check_batch_equals_alone(
        lambda: DeepseekMTPProposer(target_dir, dtype=DTYPE, static_steps=static_steps), rows_fn)


def test_falls_back_to_target_embeddings_and_head(tmp_path, sim, target_dir, reference, rows_fn):
    """Without the MTP layer's embed_tokens / shared_head.head, the target's own are used."""
    tensors = load_file(str(target_dir / "model.safetensors"))
    del tensors[PREFIX + "embed_tokens.weight"], tensors[PREFIX + "shared_head.head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((target_dir / "config.json").read_bytes())
    proposer = DeepseekMTPProposer(tmp_path, dtype=DTYPE)
    sim.check_against_reference(proposer, reference, rows_fn, [SamplingParams()],
                                [[20, 21, 22, 23]], num_steps=2, seed=2)


def test_float32_router_stays_float32(target_dir):
    proposer = DeepseekMTPProposer(target_dir, dtype=torch.bfloat16)
    assert proposer.head.layer.mlp.gate.weight.dtype == torch.float32
    assert proposer.head.eh_proj.weight.dtype == torch.bfloat16
