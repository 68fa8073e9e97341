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
