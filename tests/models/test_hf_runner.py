"""HFRunner: transformers' own models behind the TargetRunner contract, including rollback of
caches that cannot be cropped (Qwen3.5 linear attention, Mistral's sliding window)."""

from __future__ import annotations

import pytest
import torch

from specd.messages import PytorchEngineConfig
from specd.models.base import SequenceChunk
from specd.models.hf_runner import HFRunner, is_croppable

TOL = 1e-4


def make_runner(path) -> HFRunner:
    return HFRunner(path, PytorchEngineConfig(device_type="cpu", session_len=256, runner="hf"))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3", "qwen3_5"])
def test_logits_match_transformers(kind, checkpoint, hf_model):
    path = checkpoint(kind)
    runner, ref_model = make_runner(path), hf_model(path)
    a, b = prompt(9, 1), prompt(5, 2)
    runner.add_sequence(0)
    runner.add_sequence(1)
    out = runner.forward([SequenceChunk(0, a), SequenceChunk(1, b)])
    out2 = runner.forward([SequenceChunk(0, [7, 8])])
    worst = max((out.logits[out.rows(0)] - reference(ref_model, a)).abs().max().item(),
                (out.logits[out.rows(1)] - reference(ref_model, b)).abs().max().item(),
                (out2.logits - reference(ref_model, a + [7, 8])[-2:]).abs().max().item())
    print(f"HFRunner {kind}: max |logits - transformers| = {worst:.3g}")
    assert worst < TOL
    assert runner.num_cached(0) == 11 and runner.num_cached(1) == 5


def test_last_logits_only_gives_each_chunks_last_row(checkpoint, hf_model):
    path = checkpoint("llama")
    runner, ref_model = make_runner(path), hf_model(path)
    a, b = prompt(9, 1), prompt(5, 2)
    runner.add_sequence(0)
    runner.add_sequence(1)
    out = runner.forward([SequenceChunk(0, a), SequenceChunk(1, b)], last_logits_only=True)
    assert out.logits.shape[0] == 2 and out.offsets == [0, 9, 14]
    ref = torch.stack([reference(ref_model, a)[-1], reference(ref_model, b)[-1]])
    assert (out.last_logits() - ref).abs().max().item() < TOL


@pytest.mark.parametrize("kind,croppable", [("llama", True), ("deepseek_v3", True),
                                            ("qwen3_5", False), ("mistral", False)])
def test_truncate_then_rerun_equals_fresh(kind, croppable, checkpoint, hf_model):
    path = checkpoint(kind)
    runner, ref_model = make_runner(path), hf_model(path)
    base, drafts, fixes = prompt(12, 3), prompt(4, 4), prompt(3, 5)  # 12 + 4 > mistral's window 8
    runner.add_sequence(0)
    runner.forward([SequenceChunk(0, base)])
    runner.forward([SequenceChunk(0, drafts)])
    assert is_croppable(runner._seqs[0].cache) == croppable
    runner.truncate(0, 13)  # back into the last forward: crop or snapshot + re-run
    assert runner.num_cached(0) == 13
    out = runner.forward([SequenceChunk(0, fixes)])
    expected = reference(ref_model, base + drafts[:1] + fixes)
    torch.testing.assert_close(out.logits, expected[-3:], atol=TOL, rtol=0)
    runner.truncate(0, 5)  # past the snapshot: rebuilt from the token history
    out = runner.forward([SequenceChunk(0, [9, 10])])
    torch.testing.assert_close(out.logits, reference(ref_model, base[:5] + [9, 10])[-2:], atol=TOL, rtol=0)
    runner.truncate(0, 0)
    assert runner.num_cached(0) == 0
    out = runner.forward([SequenceChunk(0, [11])])
    torch.testing.assert_close(out.logits, reference(ref_model, [11]), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_hidden_states(kind, checkpoint, hf_model):
    path = checkpoint(kind)
    runner, ref_model = make_runner(path), hf_model(path)
    runner.set_aux_hidden_layers([1, 3])
    tokens = prompt(6, 6)
    runner.add_sequence(0)
    out = runner.forward([SequenceChunk(0, tokens)], want_hidden=True, want_aux_hidden=True)
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.aux_hidden_states, torch.cat([ref[1][0], ref[3][0]], -1), atol=TOL, rtol=0)
    torch.testing.assert_close(out.hidden_states, ref[-1][0], atol=TOL, rtol=0)
    torch.testing.assert_close(runner.lm_head(out.hidden_states), out.logits, atol=TOL, rtol=0)
    assert runner.embed_tokens(torch.tensor(tokens)).shape == (6, 64)


def test_model_info_and_limits(checkpoint):
    runner = make_runner(checkpoint("llama"))
    assert runner.info.eos_token_ids == [2, 3]
    assert runner.info.architecture == "LlamaForCausalLM"
    runner.add_sequence(0)
    assert runner.can_append(0, 256) and not runner.can_append(0, 257)
    with pytest.raises(ValueError):
        runner.forward([SequenceChunk(0, [])])
    with pytest.raises(ValueError):
        runner.truncate(0, 1)
