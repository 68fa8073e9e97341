"""LlamaRunner against transformers on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from specd.messages import PytorchEngineConfig
from specd.models.base import SequenceChunk
from specd.models.kv_cache import CacheFullError
from specd.models.llama_runner import LlamaRunner

LLAMA_FAMILY = ["llama", "qwen2", "qwen3", "mistral"]
TOL = 1e-4


def make_runner(path, **overrides) -> LlamaRunner:
    config = dict(block_size=4, max_batch_size=4, session_len=128, device_type="cpu")
    config.update(overrides)
    return LlamaRunner(path, PytorchEngineConfig(**config))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def run_alone(runner: LlamaRunner, seq_id: int, tokens: list[int]) -> torch.Tensor:
    runner.add_sequence(seq_id)
    out = runner.forward([SequenceChunk(seq_id, tokens)])
    runner.free(seq_id)
    return out.logits


@pytest.mark.parametrize("kind", LLAMA_FAMILY)
def test_logits_match_transformers(kind, checkpoint, hf_model):
    path = checkpoint(kind)
    runner, ref_model = make_runner(path), hf_model(path)
    worst = 0.0
    for seed, n in ((0, 1), (1, 7), (2, 37)):  # 37 > mistral's window of 8, crosses blocks
        tokens = prompt(n, seed)
        ours = run_alone(runner, seed, tokens)
        with torch.no_grad():
            ref = ref_model(torch.tensor([tokens])).logits[0]
        worst = max(worst, (ours - ref).abs().max().item())
    print(f"{kind}: max |logits - transformers| = {worst:.3g}")
    assert worst < TOL


@pytest.mark.parametrize("kind", LLAMA_FAMILY)
def test_batched_varlen_equals_alone(kind, checkpoint):
    runner = make_runner(checkpoint(kind))
    prompts = {10: prompt(50, 10), 11: prompt(3, 11), 12: prompt(9, 12)}
    alone = {s: run_alone(runner, 100 + s, p) for s, p in prompts.items()}
    # Verification-shaped batch: sequence 11 and 12 already hold a prefix and get 4-token chunks
    # while sequence 10 prefills 50 tokens, all in one forward.
    runner.add_sequence(11)
    runner.add_sequence(12)
    runner.forward([SequenceChunk(11, prompts[11][:1]), SequenceChunk(12, prompts[12][:5])])
    runner.add_sequence(10)
    out = runner.forward([SequenceChunk(11, prompts[11][1:]), SequenceChunk(10, prompts[10]),
                          SequenceChunk(12, prompts[12][5:])])
    assert out.offsets == [0, 2, 52, 56]
    assert out.logits.shape == (56, 256) and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits[out.rows(0)], alone[11][1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[out.rows(1)], alone[10], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[out.rows(2)], alone[12][5:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", LLAMA_FAMILY)
def test_prefill_then_decode_equals_full_forward(kind, checkpoint):
    runner = make_runner(checkpoint(kind))
    tokens = prompt(21, 3)
    full = run_alone(runner, 0, tokens)
    runner.add_sequence(1)
    rows = [runner.forward([SequenceChunk(1, tokens[:6])]).logits]
    for t in tokens[6:]:
        rows.append(runner.forward([SequenceChunk(1, [t])]).logits)
    assert runner.num_cached(1) == 21
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", LLAMA_FAMILY)
def test_rollback_then_new_tokens_equals_fresh_run(kind, checkpoint):
    runner = make_runner(checkpoint(kind))
    base, drafts, fixes = prompt(11, 4), prompt(4, 5), prompt(3, 6)
    runner.add_sequence(0)
    runner.forward([SequenceChunk(0, base)])
    runner.forward([SequenceChunk(0, drafts)])  # 11 + 4 = 15 tokens: blocks of 4 -> 4 blocks
    used = runner.kv_cache.allocator.num_free_blocks
    runner.truncate(0, 12)  # keep 1 draft; 12 tokens -> 3 blocks, one returned
    assert runner.num_cached(0) == 12
    assert runner.kv_cache.allocator.num_free_blocks == used + 1
    out = runner.forward([SequenceChunk(0, fixes)])
    fresh = run_alone(runner, 1, base + drafts[:1] + fixes)
    torch.testing.assert_close(out.logits, fresh[-3:], atol=1e-5, rtol=0)


def test_sharded_checkpoint_loads_identically(checkpoint):
    single, sharded = checkpoint("llama"), checkpoint("llama", sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = make_runner(single), make_runner(sharded)
    for (name, p), (name_b, q) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert name == name_b and torch.equal(p, q), name
    tokens = prompt(13, 7)
    assert torch.equal(run_alone(a, 0, tokens), run_alone(b, 0, tokens))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_aux_and_final_hidden_states_match_transformers(kind, checkpoint, hf_model):
    path = checkpoint(kind)
    runner, ref_model = make_runner(path), hf_model(path)
    assert runner.aux_layer_ids == [2, 2, 1]  # (2, L // 2, L - 3) for L = 4
    runner.set_aux_hidden_layers([0, 3, 1])
    tokens = prompt(17, 8)
    runner.add_sequence(0)
    out = runner.forward([SequenceChunk(0, tokens)], want_hidden=True, want_aux_hidden=True)
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected_aux = torch.cat([ref[0][0], ref[3][0], ref[1][0]], dim=-1)
    assert out.aux_hidden_states.shape == (17, 3 * 64)
    torch.testing.assert_close(out.aux_hidden_states, expected_aux, atol=TOL, rtol=0)
    torch.testing.assert_close(out.hidden_states, ref[-1][0], atol=TOL, rtol=0)
    torch.testing.assert_close(runner.lm_head(out.hidden_states), out.logits, atol=1e-6, rtol=0)
    embeds = runner.embed_tokens(torch.tensor(tokens))
    torch.testing.assert_close(embeds, ref[0][0], atol=0, rtol=0)
    with pytest.raises(ValueError):
        runner.set_aux_hidden_layers([4])


def test_hidden_states_only_when_asked(checkpoint):
    runner = make_runner(checkpoint("qwen2"))
    runner.add_sequence(0)
    out = runner.forward([SequenceChunk(0, prompt(5, 9))])
    assert out.hidden_states is None and out.aux_hidden_states is None


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_last_logits_only_gives_each_chunks_last_row_and_every_hidden_row(static, checkpoint):
    """A prefill asks for each chunk's last token's logits only (the engine samples one token a
    sequence): the same rows as the full forward's, one per chunk, with every hidden row kept."""
    path = checkpoint("llama")
    chunks = [(0, prompt(13, 1)), (1, prompt(2, 2)), (2, prompt(7, 3))]
    outs = []
    for last_only in (False, True):
        runner = LlamaRunner(path, PytorchEngineConfig(block_size=4, max_batch_size=4, session_len=128,
                                                       device_type="cpu"), use_static_path=static)
        for seq_id, _ in chunks:
            runner.add_sequence(seq_id)
        outs.append(runner.forward([SequenceChunk(s, t) for s, t in chunks], want_aux_hidden=True,
                                   last_logits_only=last_only))
        assert (runner.num_eager_forwards == 0) == static  # 22 rows: a static prefill when asked for
    full, last = outs
    assert full.logits.shape[0] == 22 and last.logits.shape[0] == 3 and last.last_logits_only
    # (eager: lm_head over 3 rows instead of 22 blocks its float32 sums otherwise: rounding apart)
    torch.testing.assert_close(last.logits, full.logits[[12, 14, 21]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last.last_logits(), full.last_logits(), atol=1e-5, rtol=1e-5)
    assert last.offsets == full.offsets == [0, 13, 15, 22]
    torch.testing.assert_close(last.aux_hidden_states, full.aux_hidden_states, atol=0, rtol=0)


def test_cache_capacity_and_failure_leave_state_unchanged(checkpoint):
    runner = make_runner(checkpoint("llama"), num_gpu_blocks=4, session_len=64)  # 16 tokens of cache
    runner.add_sequence(0)
    runner.add_sequence(1)
    assert runner.can_append(0, 16) and not runner.can_append(0, 17)
    runner.forward([SequenceChunk(0, prompt(10, 1))])
    assert not runner.can_append(1, 7) and runner.can_append(1, 4)
    with pytest.raises(CacheFullError):
        runner.forward([SequenceChunk(1, prompt(4, 2)), SequenceChunk(0, prompt(6, 3))])
    assert runner.num_cached(0) == 10 and runner.num_cached(1) == 0
    runner.free(0)
    assert runner.kv_cache.allocator.num_free_blocks == 4
    with pytest.raises(ValueError):
        runner.forward([SequenceChunk(1, [1]), SequenceChunk(1, [2])])
    runner.add_sequence(2)
    assert not runner.can_append(2, 65)  # session_len bound


def test_dtype_and_block_defaults(checkpoint):
    runner = LlamaRunner(checkpoint("qwen2"), PytorchEngineConfig(device_type="cpu", block_size=16,
                                                                  max_batch_size=2, session_len=40))
    assert runner.dtype == torch.float32 and runner.device.type == "cpu"
    assert runner.kv_cache.num_blocks == 2 * 3  # ceil(40 / 16) blocks per sequence
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight  # tied
