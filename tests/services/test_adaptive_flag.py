"""The adaptive draft-length and prefix-caching switches, from `specd serve api_server` through the stack to the
verifier's SpeculativeConfig: on by default, --no-speculative-adaptive turns it off."""

from __future__ import annotations

import pytest

from services.launcher.supervisor import Stack, StackConfig


@pytest.mark.parametrize("adaptive", [True, False])
def test_the_switch_reaches_the_verifiers_speculative_config(monkeypatch, adaptive):
    from services.verifier.server import VerifierConfig
    from specd.cli import build_parser

    serve = ["serve", "api_server", "m", "--speculative-algorithm", "ngram"]
    parsed = build_parser().parse_args(serve + ([] if adaptive else ["--no-speculative-adaptive"]))
    assert parsed.speculative_adaptive is adaptive
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, args, env=None: spawned.setdefault(name, args))
    monkeypatch.setattr(Stack, "_wait_grpc_health", lambda self, *a, **k: None)
    monkeypatch.setattr(Stack, "_wait_http_health", lambda self, *a, **k: None)
    Stack(StackConfig(model="m", redis_url="redis://127.0.0.1:1", speculative_algorithm="ngram",
                      speculative_adaptive=adaptive)).start()
    verifier = build_parser().parse_args(spawned["verifier"])  # the command line the verifier gets
    assert verifier.speculative_adaptive is adaptive
    config = VerifierConfig(model="m", redis_url="redis://x", speculative_algorithm="ngram",
                            speculative_adaptive=verifier.speculative_adaptive)
    assert config.speculative_config().adaptive is adaptive


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_reaches_the_verifiers_engine_config(monkeypatch, caching):
    """`serve api_server --no-enable-prefix-caching` (lmdeploy's flag; on by default) reaches the
    verifier's PytorchEngineConfig."""
    from services.verifier.server import VerifierConfig
    from specd.cli import build_parser

    serve = ["serve", "api_server", "m"] + ([] if caching else ["--no-enable-prefix-caching"])
    parsed = build_parser().parse_args(serve)
    assert parsed.enable_prefix_caching is caching
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, args, env=None: spawned.setdefault(name, args))
    monkeypatch.setattr(Stack, "_wait_grpc_health", lambda self, *a, **k: None)
    monkeypatch.setattr(Stack, "_wait_http_health", lambda self, *a, **k: None)
    Stack(StackConfig(model="m", redis_url="redis://127.0.0.1:1", enable_prefix_caching=caching)).start()
    verifier = build_parser().parse_args(spawned["verifier"])
    assert verifier.enable_prefix_caching is caching
    config = VerifierConfig(model="m", redis_url="redis://x", enable_prefix_caching=verifier.enable_prefix_caching)
    assert config.engine_config().enable_prefix_caching is caching
