"""The drafter service and RemoteProposer over real gRPC on loopback.

For every method, an engine whose proposer is a RemoteProposer decodes exactly the target's own
greedy tokens, and every step's remote drafts (and q) equal a local proposer's for the same inputs.
Also: two drafters splitting one batch, health and reflection, malformed steps ending only their
stream, deadlines and per-step timing.

The tensor codec, sampling parameters on the wire and the hash ring: test_drafter_wire.py; the
`specd drafter` command: test_drafter_cli.py.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from services.drafter.server import load_drafter, start_server
from services.drafter.servicer import DrafterServicer
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.proposers.base import DraftProposal, DraftRequest
from specd.proposers.factory import build_proposer
from specd.clients.draft_step import sampling_params_to_pb
from specd.clients.drafter import RemoteProposer
from specd.clients.errors import DrafterRejectedError, DrafterUnavailableError
from specd.sampling_params import SamplingParams
from specd.transport.tensor_codec import tensor_to_pb
from specd.v1 import drafter_pb2, drafter_pb2_grpc

METHODS = {  # method -> (target checkpoint, draft checkpoint or None)
    "eagle3": ("target-llama", "draft-eagle3"),
    "draft_model": ("target-llama", "draft-llama-small"),
    "ngram": ("target-llama", None),
    "deepseek_mtp": ("target-deepseek-mtp", None),
    "qwen3_5_mtp": ("target-qwen3_5-mtp", None),
}
K = 3
ENGINE_CONFIG = PytorchEngineConfig(max_batch_size=8, block_size=8)


def spec_for(tiny_models, method: str) -> SpeculativeConfig:
    draft = METHODS[method][1]
    return SpeculativeConfig(method=method, num_speculative_tokens=K,
                             model=str(tiny_models[draft]) if draft else "")


def make_requests(num: int = 6, sampled: bool = False):
    """Prompts of mixed lengths (some repetitive, so n-gram lookup finds matches)."""
    gen = torch.Generator().manual_seed(0)
    prompts, params = [], []
    for i in range(num):
        length = [1, 4, 9, 17, 30, 6, 12, 3][i % 8]
        prompt = torch.randint(4, 512, (length,), generator=gen).tolist()
        prompts.append((prompt * 3)[:3 * length] if i % 3 == 0 else prompt)
        params.append(SamplingParams(temperature=0.8 if sampled and i % 2 else 0.0, top_k=40 * (i % 3),
                                     seed=100 + i, max_new_tokens=[6, 13, 20][i % 3], ignore_eos=True))
    return prompts, params


class TeeProposer:
    """Hands the engine the remote drafts after checking they equal the local proposer's."""

    def __init__(self, remote: RemoteProposer, local) -> None:
        self.remote, self.local = remote, local
        self.method, self.hidden_kind = remote.method, remote.hidden_kind
        self.aux_layer_ids = remote.aux_layer_ids
        self.num_steps_compared = 0

    draft_constraints = None

    def open(self, seq_id, params, grammar=None):
        self.remote.open(seq_id, params, grammar=grammar)
        self.local.open(seq_id, params, grammar=grammar)

    def close(self, seq_id):
        self.remote.close(seq_id)
        self.local.close(seq_id)

    def propose(self, requests):
        got, want = self.remote.propose(requests), self.local.propose(requests)
        for r, g, w in zip(requests, got, want):
            assert g.token_ids.tolist() == w.token_ids.tolist(), f"seq {r.seq_id}: drafts differ"
            assert (g.probs is None) == (w.probs is None)
            if w.probs is not None:
                assert torch.equal(g.probs, w.probs), f"seq {r.seq_id}: q differs"
        self.num_steps_compared += 1
        return got


@pytest.fixture(scope="module")
def drafters(tiny_models):
    """drafters(method, index=0) -> a running in-process DrafterServer, started once."""
    running = {}

    def get(method: str, index: int = 0):
        if (method, index) not in running:
            target = tiny_models[METHODS[method][0]]
            servicer = load_drafter(target, spec_for(tiny_models, method), target,
                                    max_num_draft_tokens=8)
            running[method, index] = start_server(servicer, "127.0.0.1", 0, max_workers=8)
        return running[method, index]
    yield get
    for server in running.values():
        server.stop(0.5)


_baselines: dict[tuple, list[list[int]]] = {}


def target_greedy(tiny_models, target_name: str, prompts, params) -> list[list[int]]:
    key = (target_name, len(prompts))
    if key not in _baselines:
        engine = build_engine(tiny_models[target_name], ENGINE_CONFIG)
        _baselines[key] = [s.output_token_ids for s in engine.generate(prompts, params)]
    return _baselines[key]


def run_remote(tiny_models, method, addresses, prompts, params):
    target_name = METHODS[method][0]
    spec = spec_for(tiny_models, method)
    target = tiny_models[target_name]
    with RemoteProposer(addresses) as remote:
        local = build_proposer(spec, target, remote.vocab_size, ENGINE_CONFIG, torch.device("cpu"),
                               torch.float32)
        tee = TeeProposer(remote, local)
        engine = build_engine(target, ENGINE_CONFIG, spec, proposer=tee)
        seqs = engine.generate(prompts, params)
        remote.flush()  # the finished sequences' closes
        assert tee.num_steps_compared > 0
        assert remote.last_rpc_seconds > 0
        return seqs, remote, tee


@pytest.mark.parametrize("method", list(METHODS))
def test_remote_greedy_equals_target_greedy(tiny_models, drafters, method):
    server = drafters(method)
    prompts, params = make_requests()
    want = target_greedy(tiny_models, METHODS[method][0], prompts, params)
    seqs, remote, _ = run_remote(tiny_models, method, [server.address], prompts, params)
    assert [s.output_token_ids for s in seqs] == want
    assert sum(s.stats.num_draft_tokens for s in seqs) > 0, "speculation never ran"
    assert remote.aux_layer_ids == list(getattr(server.servicer.proposer, "aux_layer_ids", []) or [])
    assert server.servicer.num_open_sequences == 0
    # the heads' rows travelled beside the step messages (the fast path's ROWS frames)
    assert (server.servicer.num_steps_with_attached_rows > 0) == (remote.hidden_kind != "none")


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_sampled_drafts_and_q_match_local(tiny_models, drafters, method):
    prompts, params = make_requests(sampled=True)
    run_remote(tiny_models, method, [drafters(method).address], prompts, params)  # TeeProposer checks q


def test_two_drafters_split_the_batch(tiny_models, drafters):
    a, b = drafters("draft_model", 0), drafters("draft_model", 1)
    opened = (a.servicer.num_sequences_opened, b.servicer.num_sequences_opened)
    prompts, params = make_requests(num=8)
    want = target_greedy(tiny_models, "target-llama", prompts, params)
    seqs, remote, _ = run_remote(tiny_models, "draft_model", [a.address, b.address], prompts, params)
    assert [s.output_token_ids for s in seqs] == want
    assert a.servicer.num_sequences_opened > opened[0] and b.servicer.num_sequences_opened > opened[1]
    assert a.servicer.num_open_sequences == b.servicer.num_open_sequences == 0


def test_health_and_reflection(drafters):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    server = drafters("ngram")
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specd.v1.Drafter"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(answers).list_services_response.service}
        assert {"specd.v1.Drafter", "grpc.health.v1.Health"} <= names


def _open(seq_id: int) -> drafter_pb2.OpenSequence:
    return drafter_pb2.OpenSequence(seq_id=seq_id, params=sampling_params_to_pb(SamplingParams()))


def _steps(stub, *messages):
    return list(stub.DraftSteps(iter(messages), timeout=10))


@pytest.mark.parametrize("case", ["unknown_seq", "k_too_large", "hidden_width", "hidden_rows", "hidden_ints",
                                  "hidden_step_rows", "hidden_step_width", "hidden_step_ints", "token_out_of_vocab",
                                  "duplicate_open"])
def test_malformed_step_ends_only_its_stream(drafters, case):
    method = "eagle3" if case.startswith("hidden") else "ngram"
    server = drafters(method)
    width = server.servicer.hidden_size or 8
    hidden = {"hidden_width": torch.zeros(2, width + 1), "hidden_rows": torch.zeros(3, width),
              "hidden_step_width": torch.zeros(2, width + 1), "hidden_ints": torch.zeros(2, width, dtype=torch.int32),
              "hidden_step_ints": torch.zeros(2, width, dtype=torch.int32)}.get(case, torch.zeros(2, width))
    seq = drafter_pb2.SequenceDraftInput(seq_id=1, new_token_ids=[5, 6, 7], num_draft_tokens=2)
    step_rows = None
    if case.startswith("hidden_step"):  # the step's one tensor (proto: DraftStepRequest.hidden_states)
        seq.num_hidden_rows = 3 if case == "hidden_step_rows" else 2
        step_rows = tensor_to_pb(hidden)
    elif method == "eagle3":
        tensor_to_pb(hidden, seq.new_hidden_states)
    if case == "unknown_seq":
        seq.seq_id = 7
    if case == "k_too_large":
        seq.num_draft_tokens = 99
    if case == "token_out_of_vocab":
        seq.new_token_ids.append(10**6)
    message = drafter_pb2.DraftStepRequest(open=[_open(1)] + ([_open(1)] if case == "duplicate_open" else []),
                                           sequences=[seq], hidden_states=step_rows)
    want_code, want_text = {"unknown_seq": (grpc.StatusCode.INVALID_ARGUMENT, "unknown seq id 7"),
                            "k_too_large": (grpc.StatusCode.INVALID_ARGUMENT, "num_draft_tokens"),
                            "hidden_width": (grpc.StatusCode.INVALID_ARGUMENT, f"expects {width}"),
                            "hidden_rows": (grpc.StatusCode.INVALID_ARGUMENT, "expected 2 rows"),
                            "hidden_step_rows": (grpc.StatusCode.INVALID_ARGUMENT, "hidden_states: shape [2, "),
                            "hidden_step_width": (grpc.StatusCode.INVALID_ARGUMENT, f"expects {width}"),
                            "hidden_ints": (grpc.StatusCode.INVALID_ARGUMENT, "seq 1: expected floats"),
                            "hidden_step_ints": (grpc.StatusCode.INVALID_ARGUMENT, "hidden_states: expected floats"),
                            "token_out_of_vocab": (grpc.StatusCode.INVALID_ARGUMENT, "outside"),
                            "duplicate_open": (grpc.StatusCode.FAILED_PRECONDITION, "already open")}[case]
    with grpc.insecure_channel(server.address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            _steps(stub, message)
        assert err.value.code() == want_code and want_text in err.value.details()
        # The server keeps serving: a well-formed stream on the same server still drafts.
        ok = drafter_pb2.SequenceDraftInput(seq_id=1, new_token_ids=[5, 6, 7], num_draft_tokens=2)
        if method == "eagle3":
            tensor_to_pb(torch.zeros(2, width), ok.new_hidden_states)
        answers = _steps(stub, drafter_pb2.DraftStepRequest(step_id=4, open=[_open(1)], sequences=[ok]))
        assert answers[0].step_id == 4 and len(answers[0].sequences[0].token_ids) <= 2
    deadline = time.monotonic() + 5
    while server.servicer.num_open_sequences and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.servicer.num_open_sequences == 0  # both streams' sequences were closed


def test_both_wire_forms_of_hidden_rows_draft_alike(drafters):
    """A sequence's rows in its own tensor (new_hidden_states) or as its share of the step's one
    tensor (hidden_states + num_hidden_rows), also mixed in one step: the same drafts."""
    server = drafters("eagle3")
    width = server.servicer.hidden_size
    gen = torch.Generator().manual_seed(3)
    prompt_rows, next_rows = torch.randn(3, width, generator=gen), torch.randn(2, width, generator=gen)
    tokens = [[5, 6, 7, 8], [9, 10]]

    def seq(seq_id, step, own):
        item = drafter_pb2.SequenceDraftInput(seq_id=seq_id, new_token_ids=tokens[step], num_draft_tokens=3)
        rows = (prompt_rows, next_rows)[step]
        if own:
            tensor_to_pb(rows, item.new_hidden_states)
        else:
            item.num_hidden_rows = rows.shape[0]
        return item

    messages = [drafter_pb2.DraftStepRequest(step_id=step, open=[_open(1), _open(2), _open(3)] if step == 0 else [],
                                             sequences=[seq(1, step, True), seq(2, step, False), seq(3, step, False)],
                                             hidden_states=tensor_to_pb(torch.cat([(prompt_rows, next_rows)[step]] * 2)))
                for step in (0, 1)]
    with grpc.insecure_channel(server.address) as channel:
        answers = _steps(drafter_pb2_grpc.DrafterStub(channel), *messages)
    for answer in answers:
        drafts = [list(s.token_ids) for s in answer.sequences]
        assert len(drafts[0]) == 3 and drafts[0] == drafts[1] == drafts[2]
    assert server.servicer.Info(drafter_pb2.DrafterInfoRequest(), None).takes_step_hidden_states


def test_rejected_step_raises_drafter_rejected_error(drafters):
    with RemoteProposer([drafters("ngram").address]) as remote:
        remote.open(0, SamplingParams())
        with pytest.raises(DrafterRejectedError, match="num_draft_tokens") as err:
            remote.propose([DraftRequest(0, [5, 6], None, 99)])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


class SlowProposer:
    """A proposer that takes `delay_s` per step (a stuck drafter)."""

    method, hidden_kind = "ngram", "none"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def open(self, seq_id, params):
        pass

    def close(self, seq_id):
        pass

    def propose(self, requests):
        time.sleep(self.delay_s)
        return [DraftProposal(torch.empty(0, dtype=torch.long)) for _ in requests]


def test_missed_deadline_falls_back_to_no_drafts_and_unreachable_raises():
    server = start_server(DrafterServicer(SlowProposer(1.0), vocab_size=16), "127.0.0.1", 0)
    try:
        remote = RemoteProposer([server.address], deadline_s=0.2)
        remote.open(3, SamplingParams())
        t0 = time.perf_counter()
        proposals = remote.propose([DraftRequest(3, [1, 2], None, 2)])
        assert time.perf_counter() - t0 < 0.9  # the deadline, not the drafter's 1 s
        assert proposals[0].token_ids.numel() == 0 and remote.num_failovers == 1
        assert remote.drafter_of(3) is None and remote.addresses == []  # parked, off the ring
        t0 = time.perf_counter()  # no live drafter: target-only at once, no waiting
        assert remote.propose([DraftRequest(3, [], None, 2)])[0].token_ids.numel() == 0
        assert time.perf_counter() - t0 < 0.1 and remote.take_resync() == []
        remote.close(3)
        remote.shutdown()
    finally:
        server.stop(0)
    with pytest.raises(DrafterUnavailableError, match="Info failed"):
        RemoteProposer([server.address], connect_timeout_s=0.3)


def test_step_timing_batch_of_8(drafters):
    """Per-step RPC overhead (round trip minus model time) on loopback, batch 8, EAGLE-3 rows."""
    server = drafters("eagle3")
    width = server.servicer.hidden_size
    with RemoteProposer([server.address]) as remote:
        for i in range(8):
            remote.open(i, SamplingParams())
        remote.propose([DraftRequest(i, [5, 6, 7, 8], torch.randn(3, width), 3) for i in range(8)])
        overheads = []
        for _ in range(20):
            remote.propose([DraftRequest(i, [9, 10], torch.randn(2, width), 3) for i in range(8)])
            overheads.append(remote.last_rpc_seconds - remote.last_draft_seconds)
        overheads.sort()
        print(f"drafter RPC overhead, batch 8: p50 {overheads[10] * 1e3:.2f} ms")
        assert 0 < remote.last_draft_seconds < remote.last_rpc_seconds
        assert overheads[10] < 0.05
        # the round trip's split: its parts lie within it, and the drafter's own time holds its propose
        rt = remote.last_round_trip
        assert remote.num_round_trips == 21 and rt is not None
        assert min(rt.queued, rt.transit, rt.waited) >= 0 and rt.handle >= remote.last_draft_seconds
        assert rt.propose == remote.last_draft_seconds > 0  # one drafter: its propose is the step's
        assert rt.queued + rt.transit + rt.handle <= remote.last_rpc_seconds
        # its send: every part measured, all within the time until the request left
        assert min(rt.to_host, rt.encode, rt.write) >= 0 and rt.encode > 0 and rt.write > 0
        assert rt.to_host + rt.encode + rt.write <= rt.queued + rt.write + 1e-6
        # sent ahead and collected 50 ms later: the wait is what is left of the round trip
        pending = remote.propose_async([DraftRequest(i, [11], torch.randn(1, width), 3) for i in range(8)])
        time.sleep(0.05)
        pending.result()
        rt = remote.last_round_trip
        assert remote.num_round_trips == 22 and rt.waited < 0.05 < remote.last_rpc_seconds


@pytest.mark.parametrize("eager_mode", [False, True])
def test_eager_mode_reaches_the_proposer(monkeypatch, tiny_models, eager_mode):
    """`specd drafter --eager-mode` turns the drafter's CUDA graphs off: the engine config it builds
    the proposer with says so (the graphs themselves are CUDA's: tests/proposers/test_head_graphs_cuda.py)."""
    import specd.proposers.factory as factory

    seen = []

    def spy(spec, target, vocab, engine_config, device, dtype):
        seen.append(engine_config.eager_mode)
        return build_proposer(spec, target, vocab, engine_config, device, dtype)

    monkeypatch.setattr(factory, "build_proposer", spy)
    servicer = load_drafter(tiny_models["draft-eagle3"], spec_for(tiny_models, "eagle3"),
                            tiny_models["target-llama"], eager_mode=eager_mode)
    assert seen == [eager_mode] and servicer.proposer.method == "eagle3"
