"""A drafter on the verifier's GPU: the launcher caps its KV cache, and a draft cache that fills
costs drafts, never the verifier's requests."""

from __future__ import annotations

import pytest

from services.launcher.supervisor import SHARED_GPU_DRAFTER_CACHE_FRACTION, Stack, StackConfig, shares_a_gpu
from specd.messages import PytorchEngineConfig
from specd.models.loader import load_target_runner
from specd.proposers.base import DraftRequest
from specd.proposers.draft_model import DraftModelProposer
from specd.sampling_params import SamplingParams


def test_shares_a_gpu_names_one_cuda_device_however_written():
    assert shares_a_gpu("cuda", "cuda:0") and shares_a_gpu("cuda:1", "cuda:1")
    assert not shares_a_gpu("cuda:1", "cuda") and not shares_a_gpu("cpu", "cpu")
    assert not shares_a_gpu("cpu", "cuda")


@pytest.mark.parametrize("drafter_device,capped", [(None, True), ("cuda:0", True), ("cuda:1", False)])
def test_the_stack_caps_the_drafters_cache_on_the_verifiers_gpu(monkeypatch, drafter_device, capped):
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, args, env=None: spawned.setdefault(name, args))
    monkeypatch.setattr(Stack, "_wait_grpc_health", lambda self, *a, **k: None)
    monkeypatch.setattr(Stack, "_wait_http_health", lambda self, *a, **k: None)
    config = StackConfig(model="m", redis_url="redis://127.0.0.1:1", speculative_algorithm="draft_model",
                         speculative_draft_model="d", device="cuda", drafter_device=drafter_device)
    Stack(config).start()
    args = spawned["drafter"]
    if capped:
        assert args[args.index("--cache-max-entry-count") + 1] == str(SHARED_GPU_DRAFTER_CACHE_FRACTION)
    else:
        assert "--cache-max-entry-count" not in args


@pytest.mark.parametrize("eager_mode", [False, True])
def test_eager_mode_reaches_the_verifier_and_the_drafter(monkeypatch, eager_mode):
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, args, env=None: spawned.setdefault(name, args))
    monkeypatch.setattr(Stack, "_wait_grpc_health", lambda self, *a, **k: None)
    monkeypatch.setattr(Stack, "_wait_http_health", lambda self, *a, **k: None)
    Stack(StackConfig(model="m", redis_url="redis://127.0.0.1:1", speculative_algorithm="eagle3",
                      speculative_draft_model="d", device="cuda", eager_mode=eager_mode)).start()
    assert [("--eager-mode" in spawned[name]) for name in ("verifier", "drafter")] == [eager_mode] * 2
    from services.verifier.server import VerifierConfig
    from specd.cli import build_parser

    parsed = build_parser().parse_args(spawned["verifier"])  # the command line the verifier gets
    config = VerifierConfig(model="m", redis_url="redis://x", eager_mode=parsed.eager_mode)
    assert config.engine_config().eager_mode is eager_mode


def test_a_full_draft_cache_gives_fewer_drafts_not_an_error(tiny_models):
    def proposer(num_blocks: int) -> DraftModelProposer:
        runner = load_target_runner(tiny_models["draft-llama-small"], PytorchEngineConfig(
            device_type="cpu", block_size=4, num_gpu_blocks=num_blocks, session_len=64, max_batch_size=2))
        return DraftModelProposer(runner, target_vocab_size=runner.info.vocab_size)

    greedy = SamplingParams(temperature=0.0)
    long_prompt, short_prompt = list(range(5, 25)), list(range(30, 40))  # 20 and 10 tokens
    tight, roomy = proposer(num_blocks=6), proposer(num_blocks=64)  # 24 tokens of cache, and plenty
    for p in (tight, roomy):
        p.open(0, greedy)
        first = p.propose([DraftRequest(0, long_prompt, None, 3)])
        assert len(first[0].token_ids) == 3  # 20 + 3 tokens fit in 6 blocks of 4
        p.open(1, greedy)
    # The tight cache cannot also catch up sequence 1's 10 tokens: no drafts this step, no error.
    out = tight.propose([DraftRequest(0, [7], None, 3), DraftRequest(1, short_prompt, None, 3)])
    assert [len(o.token_ids) for o in out] == [0, 0] and tight.num_cache_full_steps == 1
    # Sequence 0 finishes and frees its blocks: sequence 1 catches up and drafts as in a roomy cache.
    tight.close(0)
    again = tight.propose([DraftRequest(1, [41], None, 3)])
    roomy.propose([DraftRequest(0, [7], None, 3), DraftRequest(1, short_prompt, None, 3)])
    expected = roomy.propose([DraftRequest(1, [41], None, 3)])
    assert again[0].token_ids.tolist() == expected[0].token_ids.tolist() and len(expected[0].token_ids) == 3
