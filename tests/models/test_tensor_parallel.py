"""Tensor parallelism (tp=2, gloo, 2 CPU processes) against tp=1: logits and greedy tokens.

Each rank builds a LlamaRunner with tp=2 (its shard: half the heads, half the KV heads, half
the MLP), runs the same prefill / ragged verify / rollback script as the unsharded runner, on the
eager and on the static-buffer path, and an engine decodes greedily; rank 0 reports to the test.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from specd.messages import PytorchEngineConfig
from specd.models.base import SequenceChunk
from specd.models.llama_runner import LlamaRunner

TOL = 1e-4


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _script(runner: LlamaRunner) -> list[torch.Tensor]:
    outs = []
    for s, n in ((0, 11), (1, 3), (2, 6)):
        runner.add_sequence(s)
    outs.append(runner.forward([SequenceChunk(s, _tokens(n, s)) for s, n in ((0, 11), (1, 3), (2, 6))]).logits)
    outs.append(runner.forward([SequenceChunk(0, _tokens(4, 10)), SequenceChunk(1, _tokens(2, 11)),
                                SequenceChunk(2, _tokens(1, 12))]).logits)
    runner.truncate(0, 13)
    outs.append(runner.forward([SequenceChunk(0, _tokens(4, 20)), SequenceChunk(2, _tokens(4, 21))]).logits)
    for s in range(3):
        runner.free(s)
    return outs


def _greedy(runner: LlamaRunner) -> list[list[int]]:
    from specd.engine.engine import SpecEngine
    from specd.proposers.ngram import NgramProposer
    from specd.sampling_params import SamplingParams

    engine = SpecEngine(runner, NgramProposer(1, 3), 3, max_batch_size=4, max_model_len=128)
    prompts = [(_tokens(5, 30 + i) * 3)[:12 + i] for i in range(3)]
    seqs = engine.generate(prompts, [SamplingParams(max_new_tokens=16, ignore_eos=True) for _ in prompts])
    return [s.output_token_ids for s in seqs]


def _config(tp: int) -> PytorchEngineConfig:
    return PytorchEngineConfig(block_size=4, max_batch_size=4, session_len=128, device_type="cpu", tp=tp)


def _rank_main(rank: int, world: int, path: str, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {}
        for static in (False, True):
            runner = LlamaRunner(path, _config(world), use_static_path=static)
            assert runner.kv_cache.k_caches[0].shape[2] == runner.config.num_key_value_heads // world
            out[f"logits_static={static}"] = _script(runner)
            out[f"greedy_static={static}"] = _greedy(runner)
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases (sharded), tied embeddings
def test_tp2_equals_tp1(kind, checkpoint):
    from specd.transport.ports import free_port

    path = str(checkpoint(kind))
    want_logits = _script(LlamaRunner(path, _config(1)))
    want_greedy = _greedy(LlamaRunner(path, _config(1)))
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(2, path, free_port(), results), nprocs=2, join=True,
                           start_method="spawn")
        results = dict(results)
    for rank in (0, 1):
        for static in (False, True):
            got = results[rank][f"logits_static={static}"]
            worst = max((a - b).abs().max().item() for a, b in zip(want_logits, got))
            print(f"{kind} rank {rank} static={static}: max |tp2 - tp1| = {worst:.3g}")
            assert worst < TOL
            assert results[rank][f"greedy_static={static}"] == want_greedy


def test_tp_without_a_process_group_is_refused(checkpoint):
    with pytest.raises(RuntimeError, match="tp=2"):
        LlamaRunner(checkpoint("llama"), _config(2))
