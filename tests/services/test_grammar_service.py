"""The grammar service and RemoteGrammarBackend over real gRPC on loopback: the masks.

For the same opens, commits and drafts over several steps and sequences, the remote backend's
masks equal a LocalGrammarBackend's byte for byte. Also: budgets and seq ids crossing the service,
Validate, a matcher rebuilt from replay tokens on a restarted service, health and reflection and
per-step timing.

Malformed steps, client errors and deadlines: test_grammar_service_errors.py; the `specd grammar`
command: test_grammar_cli.py.
"""

from __future__ import annotations

import random
import statistics
import time

import grpc
import pytest
import torch

from services.grammar.server import load_grammar, start_server
from specd.grammar.backend import GrammarSpec, GrammarStep, MaskResult
from specd.grammar.errors import GrammarCompileError
from specd.grammar.local import LocalGrammarBackend
from specd.clients.errors import GrammarRejectedError
from specd.clients.grammar import RemoteGrammarBackend
from specd.v1 import grammar_pb2, grammar_pb2_grpc
from tests.conftest import JSONSCHEMABENCH as SCHEMAS
from tests.services.conftest import _allowed

K = 3


def _specs() -> list[GrammarSpec]:
    """Real function-calling and GitHub schemas, plus the other kinds."""
    files = sorted((SCHEMAS / "Glaiveai2K").glob("*.json"))[:4] + sorted((SCHEMAS / "Github_easy").glob("*.json"))[:2]
    return [GrammarSpec("json_schema", f.read_text()) for f in files] + [
        GrammarSpec("json_object"), GrammarSpec("regex", r"(yes|no)-[0-9]{2,6}")]


class Driver:
    """Plays an engine against a reference LocalGrammarBackend: drafts that mostly follow the
    grammar (sometimes not), commits of an accepted prefix plus one allowed token, closes of
    terminated sequences. The same calls go to every backend under test."""

    def __init__(self, local: LocalGrammarBackend, seed: int = 0, draft_lengths=(0, K, K, K),
                 max_tokens: int | None = None) -> None:
        self.local = local
        self.max_tokens = max_tokens  # each sequence's budget (None: none is sent)
        self.draft_lengths = draft_lengths
        self.vocab_size = local.compiler_cache.vocab_size
        self.eos = set(local.compiler_cache.eos_token_ids)
        self.rng = random.Random(seed)
        self.commits: dict[int, list[int]] = {}  # pending commits of the next step
        self.history: dict[int, list[int]] = {}  # all committed tokens of each open seq
        self.specs: dict[int, GrammarSpec] = {}  # each seq's grammar

    def _pick(self, row: torch.Tensor) -> int:
        allowed = _allowed(row, self.vocab_size)
        non_stop = [t for t in allowed if t not in self.eos]
        return self.rng.choice(non_stop if non_stop and self.rng.random() < 0.95 else allowed)

    def drafts(self, seq_id: int) -> list[int]:
        fork = self.local.get(seq_id).fork_drafts()
        out = []
        for _ in range(self.rng.choice(self.draft_lengths)):
            token = self._pick(fork.next_mask()) if self.rng.random() < 0.85 else self.rng.randrange(self.vocab_size)
            fork.advance(token)
            out.append(token)
        return out

    def step(self, seq_ids: list[int]) -> GrammarStep:
        budgets = {} if self.max_tokens is None else {
            s: max(1, self.max_tokens - len(self.history[s]) - len(self.commits.get(s, []))) for s in seq_ids}
        step = GrammarStep(commits=dict(self.commits), drafts={s: self.drafts(s)[:budgets.get(s, K + 1) - 1]
                                                               for s in seq_ids}, budgets=budgets)
        self.commits = {}
        return step

    def after(self, step: GrammarStep, results: dict[int, MaskResult]) -> list[int]:
        """Record the tokens committed by this step; returns the sequences that terminated."""
        for seq_id, tokens in step.commits.items():
            self.history[seq_id] += tokens
        done = []
        for seq_id, result in results.items():
            if result.terminated:
                done.append(seq_id)
                continue
            num_accepted = self.rng.randint(0, result.num_valid_drafts)
            bonus = self._pick(result.bitmask[num_accepted])
            self.commits[seq_id] = step.drafts[seq_id][:num_accepted] + [bonus]
        return done


def _assert_same(got: dict[int, MaskResult], want: dict[int, MaskResult]) -> None:
    assert list(got) == list(want)
    for seq_id in want:
        g, w = got[seq_id], want[seq_id]
        assert g.bitmask.dtype == torch.int32 and g.bitmask.shape == w.bitmask.shape, seq_id
        assert g.bitmask.numpy().tobytes() == w.bitmask.contiguous().numpy().tobytes(), seq_id
        assert (g.num_valid_drafts, g.terminated, g.num_closing_rows) == (
            w.num_valid_drafts, w.terminated, w.num_closing_rows), seq_id


def _run_lockstep(backends, local: LocalGrammarBackend, driver: Driver, specs, num_steps: int) -> list[int]:
    """Open len(specs) sequences on every backend, step them all, comparing every answer with the
    local backend's; returns the sequences still open."""
    for seq_id, spec in enumerate(specs):
        for b in (local, *backends):
            b.open(seq_id, spec)
        driver.history[seq_id], driver.specs[seq_id] = [], spec
    live, next_id = list(range(len(specs))), len(specs)
    for i in range(num_steps):
        step = driver.step(live)
        want = local.step(step)
        for b in backends:
            _assert_same(b.step(step), want)
        for seq_id in driver.after(step, want):
            live.remove(seq_id)
            for b in (local, *backends):
                b.close(seq_id)
        if i == 3:  # a sequence finishes mid-flight, another one arrives
            gone = live.pop(0)
            driver.commits.pop(gone, None)
            for b in (local, *backends):
                b.close(gone)
        if i == 4:
            for b in (local, *backends):
                b.open(next_id, specs[1])
            driver.history[next_id], driver.specs[next_id] = [], specs[1]
            live.append(next_id)
    return live


def test_remote_masks_equal_local(grammar_server):
    cache = grammar_server.servicer.compiler_cache
    local = LocalGrammarBackend(cache)
    with RemoteGrammarBackend(grammar_server.address) as remote:
        assert _run_lockstep([remote], local, Driver(local, seed=1), _specs(), num_steps=12)
        assert remote.last_rpc_seconds > 0 and remote.last_mask_seconds > 0
        assert grammar_server.servicer.num_open_sequences == len(remote)
    deadline = time.monotonic() + 5  # the stream's end drops its matchers
    while grammar_server.servicer.num_streams and time.monotonic() < deadline:
        time.sleep(0.01)
    assert grammar_server.servicer.num_open_sequences == 0


def test_budgets_cross_the_service(grammar_server):
    """remaining_tokens reaches the matchers: masks near the end close the grammar, as locally."""
    cache = grammar_server.servicer.compiler_cache
    local = LocalGrammarBackend(cache)
    driver = Driver(local, seed=5, max_tokens=20)
    closing = []
    original = local.step

    def step(step: GrammarStep):
        results = original(step)
        closing.extend(r.num_closing_rows for r in results.values())
        return results

    local.step = step
    with RemoteGrammarBackend(grammar_server.address) as remote:
        _run_lockstep([remote], local, driver, _specs(), num_steps=20)
    assert any(closing)
    finished = [h for h in driver.history.values() if h and h[-1] in driver.eos]
    assert finished and all(len(h) <= 20 for h in finished)


def test_the_service_masks_encoded_surrogates(grammar_server):
    """The allowed rows (specd/grammar/allowed_rows.py) hold on the service's matchers, for a JSON
    schema and a regex: after a drafted or committed byte ED no byte A0..BF (a UTF-16 surrogate)."""
    vocab = grammar_server.servicer.compiler_cache.tokenizer_info.decoded_vocab
    byte = {bytes(t)[0]: i for i, t in enumerate(vocab) if len(t) == 1}
    lead, surrogate_second, valid_second = byte[0xED], byte[0xA0], byte[0x9F]
    specs = {0: GrammarSpec("json_schema", '{"type": "string"}'), 1: GrammarSpec("regex", r'".{0,8}"')}
    quote = byte[ord('"')]
    with RemoteGrammarBackend(grammar_server.address) as remote:
        for seq_id, spec in specs.items():
            remote.open(seq_id, spec)
        results = remote.step(GrammarStep(commits={}, drafts={s: [quote, lead, surrogate_second] for s in specs}))
        for result in results.values():
            assert result.num_valid_drafts == 2
            assert surrogate_second not in _allowed(result.bitmask[2], 512)
            assert valid_second in _allowed(result.bitmask[2], 512)
        results = remote.step(GrammarStep(commits={s: [quote, lead] for s in specs}, drafts={s: [] for s in specs}))
        assert all(surrogate_second not in _allowed(r.bitmask[0], 512) for r in results.values())
        with pytest.raises(GrammarRejectedError, match="not allowed"):
            remote.step(GrammarStep(commits={0: [surrogate_second]}, drafts={0: []}))


def test_seq_ids_are_scoped_per_stream(grammar_server):
    """Two verifiers both use seq 0 with different grammars."""
    cache = grammar_server.servicer.compiler_cache
    specs = _specs()
    with RemoteGrammarBackend(grammar_server.address) as a, RemoteGrammarBackend(grammar_server.address) as b:
        for remote, spec in ((a, specs[0]), (b, specs[-1])):
            local = LocalGrammarBackend(cache)
            _run_lockstep([remote], local, Driver(local, seed=2), [spec], num_steps=4)


def test_validate(grammar_server):
    with RemoteGrammarBackend(grammar_server.address) as remote:
        remote.validate(_specs()[0])
        with pytest.raises(GrammarCompileError, match="not valid JSON"):
            remote.validate(GrammarSpec("json_schema", "{not json"))
        with pytest.raises(GrammarCompileError, match=r"invalid regex"):
            remote.validate(GrammarSpec("regex", "(unclosed"))
    with grpc.insecure_channel(grammar_server.address) as channel:
        reply = grammar_pb2_grpc.GrammarStub(channel).Validate(
            grammar_pb2.GrammarSpec(kind="json_schema", source='{"type": "nonsense"}'), timeout=10)
        assert not reply.ok and "JSON schema" in reply.error
        reply = grammar_pb2_grpc.GrammarStub(channel).Validate(grammar_pb2.GrammarSpec(kind="yaml"), timeout=10)
        assert not reply.ok and "unknown grammar kind" in reply.error


def test_rebuilt_matcher_equals_long_lived(grammar_server, tiny_models):
    """A restarted service (fresh process state) rebuilds matchers from the accepted tokens."""
    cache = grammar_server.servicer.compiler_cache
    local = LocalGrammarBackend(cache)
    driver = Driver(local, seed=3)
    specs = _specs()[:4]
    restarted = start_server(load_grammar(tiny_models["target-llama"]), host="127.0.0.1")
    try:
        with RemoteGrammarBackend(grammar_server.address) as long_lived, \
                RemoteGrammarBackend(restarted.address) as rebuilt:
            live = _run_lockstep([long_lived], local, driver, specs, num_steps=6)
            for seq_id in live:  # the replay includes the commits not yet sent to long_lived
                replay = driver.history[seq_id] + driver.commits.get(seq_id, [])
                rebuilt.open(seq_id, driver.specs[seq_id], replay_token_ids=replay)
            assert live
            step = driver.step(live)
            want = local.step(step)
            _assert_same(long_lived.step(step), want)
            _assert_same(rebuilt.step(GrammarStep(drafts=step.drafts)), want)
    finally:
        restarted.stop(0)


def test_health_and_reflection(grammar_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(grammar_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specd.v1.Grammar"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(answers).list_services_response.service}
        assert {"specd.v1.Grammar", "grpc.health.v1.Health"} <= names


def test_step_timing_8_sequences_k3(grammar_server):
    cache = grammar_server.servicer.compiler_cache
    specs = (_specs()[:4] * 2)[:8]
    local = LocalGrammarBackend(cache)
    driver = Driver(local, seed=4, draft_lengths=(K,))
    rpc, mask = [], []
    with RemoteGrammarBackend(grammar_server.address) as remote:
        for seq_id, spec in enumerate(specs):
            remote.open(seq_id, spec)
            local.open(seq_id, spec)
            driver.history[seq_id] = []
        remote.flush()
        live = list(range(8))
        for _ in range(20):
            step = driver.step(live)
            want = local.step(step)
            _assert_same(remote.step(step), want)
            rpc.append(remote.last_rpc_seconds)
            mask.append(remote.last_mask_seconds)
            for seq_id in driver.after(step, want):
                live.remove(seq_id)
    rpc_ms, mask_ms = statistics.median(rpc) * 1e3, statistics.median(mask) * 1e3
    print(f"\ngrammar step, 8 sequences x k={K}: median rpc {rpc_ms:.2f} ms, of which matchers {mask_ms:.2f} ms")
    assert rpc_ms < 100
