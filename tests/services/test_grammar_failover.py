"""Grammar service death with real gRPC servers: the engine's RemoteGrammarBackend rebuilds every
matcher by replaying the accepted tokens on the other replica, or on the same address once the
service is back, and constrained output equals a run that never lost its matchers."""

from __future__ import annotations

import threading
import time

import pytest

from services.grammar.server import load_grammar, start_server
from specd.engine.builder import build_engine
from specd.grammar.backend import GrammarSpec
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.local import LocalGrammarBackend
from specd.clients.grammar import RemoteGrammarBackend
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams
from specd.transport.ports import free_port

ENGINE_CONFIG = PytorchEngineConfig(max_batch_size=8, block_size=16)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
SPECS = [GrammarSpec("json_object"), GrammarSpec("regex", r"(yes|no|maybe)( [0-9]{1,3}){1,9}"),
         GrammarSpec("ebnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+ | [0-9]+')]


@pytest.fixture(scope="module")
def workload(target):
    prompts = [[5 + i, 9, 13 + 2 * i] * (1 + i % 2) for i in range(6)]
    params = [SamplingParams(max_new_tokens=40) for _ in prompts]
    grammars = [SPECS[i % len(SPECS)] for i in range(6)]
    engine = build_engine(target, ENGINE_CONFIG, NGRAM,
                          grammar_backend=LocalGrammarBackend(GrammarCompilerCache.from_model_dir(target)))
    want = [s.output_token_ids for s in engine.generate(prompts, params, grammars)]
    return prompts, params, grammars, want


def run_with_a_fault(target, workload, backend, fault, steps_before=4):
    prompts, params, grammars, want = workload
    engine = build_engine(target, ENGINE_CONFIG, NGRAM, grammar_backend=backend)
    seqs = [engine.add_request(p, sp, g) for p, sp, g in zip(prompts, params, grammars)]
    for _ in range(steps_before):
        engine.step()
    assert any(not s.is_finished for s in seqs)
    fault()
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == want


def test_killed_replica_fails_over_to_the_other(target, workload):
    replicas = [start_server(load_grammar(target), host="127.0.0.1") for _ in range(2)]
    try:
        backend = RemoteGrammarBackend(",".join(r.address for r in replicas))
        assert backend.address == replicas[0].address
        run_with_a_fault(target, workload, backend, lambda: replicas[0].stop(0))
        assert backend.num_recoveries >= 1 and backend.address == replicas[1].address
        assert replicas[1].servicer.num_streams == 1
        backend.shutdown()
    finally:
        for r in replicas:
            r.stop(0)


def test_restarted_service_gets_the_matchers_back(target, workload):
    port = free_port()
    server = [start_server(load_grammar(target), host="127.0.0.1", port=port)]
    backend = RemoteGrammarBackend(f"127.0.0.1:{port}", recover_timeout_s=30)

    def kill_and_restart_later():
        server[0].stop(0)
        threading.Timer(1.0, lambda: server.append(start_server(load_grammar(target), host="127.0.0.1",
                                                                port=port))).start()
    t0 = time.monotonic()
    try:
        run_with_a_fault(target, workload, backend, kill_and_restart_later)
    finally:
        backend.shutdown()
        for s in server:
            s.stop(0)
    assert backend.num_recoveries >= 1 and len(server) == 2
    assert time.monotonic() - t0 >= 1.0  # it waited for the restart instead of failing


def test_no_replica_within_the_recovery_time_raises(target):
    port = free_port()
    backend = RemoteGrammarBackend(f"127.0.0.1:{port}", deadline_s=0.3, recover_timeout_s=1.0)
    backend.open(0, SPECS[0])
    from specd.grammar.backend import GrammarStep
    from specd.clients.errors import GrammarUnavailableError

    t0 = time.monotonic()
    with pytest.raises(GrammarUnavailableError) as info:
        backend.step(GrammarStep(drafts={0: []}))
    assert 1.0 <= time.monotonic() - t0 < 5 and info.value.lost_seq_ids == [0]
    backend.shutdown()


class FailingAfter:
    """A grammar backend that answers `steps` steps, then fails as a service gone for good does."""

    def __init__(self, backend, steps: int) -> None:
        self.backend, self.steps = backend, steps

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def step(self, step):
        from specd.clients.errors import GrammarUnavailableError

        self.steps -= 1
        if self.steps < 0:
            raise GrammarUnavailableError("127.0.0.1:1", "no replica answered within 0.0 s")
        return self.backend.step(step)


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_lost_grammar_service_fails_the_constrained_requests_only(target, workload, fail_at):
    """Past its recovery time the engine finishes the constrained sequences with an error and
    frees them; the unconstrained ones of the same batch come out as target-only decoding."""
    prompts, params, grammars, constrained = workload
    plain = build_engine(target, ENGINE_CONFIG, NGRAM).generate(prompts, params)
    backend = FailingAfter(LocalGrammarBackend(GrammarCompilerCache.from_model_dir(target)), fail_at)
    engine = build_engine(target, ENGINE_CONFIG, NGRAM, grammar_backend=backend)
    mixed = [g if i % 2 else None for i, g in enumerate(grammars)]
    seqs = [engine.add_request(p, sp, g) for p, sp, g in zip(prompts, params, mixed)]
    reported = []
    while engine.has_unfinished():
        reported += engine.step()
    assert sorted(s.seq_id for s in reported) == sorted(s.seq_id for s in seqs)  # each reported once
    num_failed = 0
    for seq, grammar, want, want_constrained in zip(seqs, mixed, plain, constrained):
        if grammar is None:
            assert seq.output_token_ids == want.output_token_ids
        elif seq.finish_reason == "error":
            num_failed += 1
            assert "structured output" in seq.error
        else:  # it ended before the service went
            assert seq.output_token_ids == want_constrained
    assert num_failed >= 2
    kv = engine.runner.kv_cache
    assert kv.allocator.num_free_blocks == kv.num_blocks


def test_the_verifier_answers_503_for_constrained_requests_when_the_grammar_service_is_gone(
        redis_url, client, target):
    """Through a VerifierWorker with a real grammar service that dies mid-run, no replica: the
    constrained request's result is an error naming structured output, the other one finishes."""
    from services.verifier.claims import ClaimConfig
    from services.verifier.worker import VerifierWorker, WorkerConfig
    from specd.transport.redis_streams import QueuedRequest, ResultEntry, result_key
    import redis as redis_lib

    server = start_server(load_grammar(target), host="127.0.0.1")
    backend = RemoteGrammarBackend(server.address, deadline_s=0.5, recover_timeout_s=0.5)
    engine = build_engine(target, ENGINE_CONFIG, NGRAM, grammar_backend=backend)
    stream = "grammar-gone:requests"
    worker = VerifierWorker(engine, redis_lib.Redis.from_url(redis_url),
                            WorkerConfig(consumer="w", request_stream=stream, log_interval_s=0,
                                         claims=ClaimConfig(idle_ms=30_000)))
    worker.ensure_group()
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for rid, fmt in (("gg-json", {"type": "json_object"}), ("gg-plain", None)):
        client.xadd(stream, QueuedRequest(rid, [5, 9, 13], params, response_format=fmt).to_fields())
    try:
        for _ in range(3):
            worker.run_once()
        server.stop(0)
        deadline = time.monotonic() + 60
        while worker.active or worker.writer.has_pending:
            assert time.monotonic() < deadline
            worker.run_once()
    finally:
        backend.shutdown()
        server.stop(0)
    kinds = {}
    for rid in ("gg-json", "gg-plain"):
        entries = [ResultEntry.from_fields(f) for _, f in client.xrange(result_key(rid))]
        kinds[rid] = entries[-1]
    assert kinds["gg-json"].kind == "error" and kinds["gg-json"].code == 503
    assert "structured output" in kinds["gg-json"].message
    assert kinds["gg-plain"].kind == "final" and kinds["gg-plain"].finish_reason == "length"
