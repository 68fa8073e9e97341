"""Qwen3.5 MTP: the tiny target's layout, and drafts equal to transformers' own MtpModel (loaded
from the same checkpoint by its own conversion mapping) run as a full recompute."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM
from transformers.modeling_layers import MtpModel

from specd.proposers.qwen3_5_mtp import Qwen35MTPProposer
from specd.sampling_params import SamplingParams
from specd.tiny_models.qwen3_5_mtp import write_tiny_qwen3_5_mtp_target

DTYPE = torch.float64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_qwen3_5_mtp_target(tmp_path_factory.mktemp("target-qwen3_5-mtp"), 512, seed=4)


@pytest.fixture(scope="module")
def target(target_dir):
    return Qwen3_5ForCausalLM.from_pretrained(str(target_dir), dtype=DTYPE).eval()


@pytest.fixture(scope="module")
def rows_fn(sim, target):
    return sim.target_rows_fn(target, None)


class HFMtpReference:
    """transformers' MtpModel layer (fc, norms, decoder layer, mtp.norm) over all the pairs."""

    def __init__(self, target, causal_mask) -> None:
        self.causal_mask = causal_mask
        # Qwen3.5's config carries mtp_num_hidden_layers; MtpModel reads these two instead.
        target.config.num_mtp_layers = 1
        target.config.mtp_layer_types = ["full_attention"]
        self.mtp = MtpModel.from_pretrained(target).eval()

    def project(self, rows):
        return rows

    def forward(self, ids, hidden, positions):
        emb = self.mtp.embed_tokens(ids[None])
        out = self.mtp.layers[0](emb, hidden[None],
                                 position_embeddings=self.mtp.rotary_emb(emb, positions[None]),
                                 attention_mask=self.causal_mask(len(ids)),
                                 position_ids=positions[None], cache=None)
        return out[0]  # after post_norm (mtp.norm): the state fed back

    def logits(self, chain):
        return self.mtp.shared_head(chain)


@pytest.fixture(scope="module")
def reference(sim, target):
    return HFMtpReference(target, sim.causal_mask)


def test_writer_layout(target_dir, target):
    tensors = load_file(str(target_dir / "model.safetensors"))
    mtp = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
    layer = {f"layers.0.self_attn.{n}.weight"
             for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    layer |= {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    layer |= {"layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"}
    own = {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"}
    assert set(mtp) == layer | own
    assert mtp["fc.weight"].shape == (64, 128)
    assert mtp["layers.0.self_attn.q_proj.weight"].shape == (2 * 4 * 16, 64)  # query and gate
    cfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["model_type"] == "qwen3_5_text"
    assert cfg["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert len(target.model.layers) == 4  # transformers loads the target, ignoring mtp.*


def test_matches_full_recompute(sim, target_dir, reference, rows_fn, static_steps):
    proposer = Qwen35MTPProposer(target_dir, dtype=DTYPE, static_steps=static_steps)
    assert (proposer.method, proposer.hidden_kind) == ("qwen3_5_mtp", "final")
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=3),
              SamplingParams(temperature=1.1, top_k=40, repetition_penalty=1.3, seed=5)]
    prompts = [[10, 11, 12], [40] * 5, [7]]
    verifier = sim.check_against_reference(proposer, reference, rows_fn, params, prompts,
                                           num_steps=6, seed=1)
    sim.check_sampled_probs(verifier)


def test_batch_equals_alone(sim, target_dir, rows_fn, static_steps):
    sim.check_batch_equals_alone(
        lambda: Qwen35MTPProposer(target_dir, dtype=DTYPE, static_steps=static_steps), rows_fn)


def test_multimodal_checkpoint_layout(tmp_path, sim, target_dir, reference, rows_fn):
    """Qwen3.5 releases are multimodal: `model.language_model.*` tensors, a nested text_config."""
    tensors = load_file(str(target_dir / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((target_dir / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": text, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    proposer = Qwen35MTPProposer(tmp_path, dtype=DTYPE)
    sim.check_against_reference(proposer, reference, rows_fn, [SamplingParams()],
                                [[20, 21, 22, 23]], num_steps=2, seed=2)


def test_tied_embeddings_without_lm_head(tmp_path, target_dir):
    tensors = load_file(str(target_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((target_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    head = Qwen35MTPProposer(tmp_path).head
    torch.testing.assert_close(head.lm_head.weight, tensors["model.embed_tokens.weight"])
