"""Drafters that come and go while a verifier runs, with real gRPC drafters on loopback and a
resolver the test swaps in for DNS: a drafter that appears gets connected, takes the requests that
now hash to it (moved between steps) and new ones; one that leaves DNS hands its requests to the
others and is not reconnected; greedy output equals target-only decoding throughout."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from services.verifier import server as verifier_server
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig
from specd.clients.discovery import DrafterDiscovery
from specd.clients.drafter import RemoteProposer
from specd.sampling_params import SamplingParams
from specd.transport.ports import free_port
from tests.services.test_drafter import make_requests
from tests.services.test_drafter_failover import drafted, serve, spec

REFRESH_S = 0.05
NUM_REQUESTS = 16  # with two drafters, each gets some of them unless the ring is very unlucky
CONFIG = PytorchEngineConfig(max_batch_size=NUM_REQUESTS, block_size=8)


class FakeDNS:
    """The resolver: whatever addresses the test put there last (read from the discovery thread)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)
        self.num_calls = 0

    def __call__(self) -> list[str]:
        self.num_calls += 1
        return list(self.addresses)


def long_requests():
    prompts, _ = make_requests(NUM_REQUESTS)
    return prompts, [SamplingParams(max_new_tokens=40, ignore_eos=True)] * len(prompts)


def target_only(tiny_models, prompts, params):
    return [s.output_token_ids for s in build_engine(tiny_models["target-llama"], CONFIG).generate(prompts, params)]


def step_until(engine, condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        assert engine.has_unfinished(), f"the requests finished before: {what}"
        engine.step()


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_new_drafter_in_dns_takes_moved_and_new_requests(tiny_models, method):
    first = serve(tiny_models, method)
    prompts, params = long_requests()
    want = target_only(tiny_models, prompts + prompts[:4], params + params[:4])
    dns = FakeDNS([first.address])
    second = None
    try:
        with RemoteProposer([first.address], deadline_s=5.0, resolve=dns, refresh_s=REFRESH_S) as remote:
            engine = build_engine(tiny_models["target-llama"], CONFIG, spec(tiny_models, method), proposer=remote)
            seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            for _ in range(2):
                engine.step()
            assert first.servicer.num_open_sequences == NUM_REQUESTS
            second = serve(tiny_models, method)  # scale-out: a replica starts, then DNS lists it
            dns.addresses = [first.address, second.address]
            t0 = time.perf_counter()
            step_until(engine, lambda: second.address in remote.addresses, "the new drafter never joined")
            joined_s = time.perf_counter() - t0
            # The next take_resync (between steps) moves what now hashes to it; eagle3's moved
            # requests are preempted there and re-prefilled and reopened one step later.
            engine.step()
            engine.step()
            moved = [s for s in seqs if not s.is_finished and remote.drafter_of(s.seq_id) == second.address]
            assert moved and remote.num_moved >= len(moved)
            remote.flush()  # closes of requests that finished in the last step
            # Moved, not copied: the first drafter freed them, the second holds them.
            assert second.servicer.num_open_sequences == len(moved)
            assert first.servicer.num_open_sequences == len(
                [s for s in seqs if not s.is_finished and remote.drafter_of(s.seq_id) == first.address])
            drafted_at_move = drafted(moved)
            late = [engine.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]  # new requests
            while engine.has_unfinished():
                engine.step()
            assert drafted(moved) > drafted_at_move  # speculation went on, on the new drafter
            assert second.servicer.num_sequences_opened >= len(moved)
            print(f"\n{method}: joined the ring {joined_s * 1000:.0f} ms after DNS listed it; "
                  f"{len(moved)}/{NUM_REQUESTS} requests moved")
    finally:
        first.stop(0)
        if second is not None:
            second.stop(0)
    assert [s.output_token_ids for s in seqs + late] == want


def test_drafter_gone_from_dns_hands_over_and_is_not_reconnected(tiny_models):
    servers = [serve(tiny_models, "ngram"), serve(tiny_models, "ngram")]
    keeper, leaver = servers
    prompts, params = long_requests()
    want = target_only(tiny_models, prompts, params)
    dns = FakeDNS([s.address for s in servers])
    try:
        with RemoteProposer(dns.addresses, deadline_s=5.0, resolve=dns, refresh_s=REFRESH_S,
                            reconnect_backoff_s=0.05, reconnect_max_backoff_s=0.1) as remote:
            engine = build_engine(tiny_models["target-llama"], CONFIG, spec(tiny_models, "ngram"), proposer=remote)
            seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            for _ in range(2):
                engine.step()
            on_leaver = [s for s in seqs if remote.drafter_of(s.seq_id) == leaver.address]
            assert on_leaver and leaver.servicer.num_open_sequences == len(on_leaver)
            opened_before = keeper.servicer.num_sequences_opened
            dns.addresses = [keeper.address]  # scale-in / pod replaced: the replica leaves DNS
            step_until(engine, lambda: remote.addresses == [keeper.address], "the drafter was not dropped")
            assert remote.num_removed == 1 and remote.num_failovers == 0
            engine.step()  # resync: its requests reopen on the keeper with their whole history
            assert keeper.servicer.num_sequences_opened >= opened_before + len(on_leaver)
            drafted_at_move = drafted(on_leaver)
            # The leaver still runs and answers, yet is never dialled again: several refreshes and
            # reconnect backoffs later it holds no stream of ours.
            until = time.monotonic() + 1.0
            while time.monotonic() < until and engine.has_unfinished():
                engine.step()
            assert remote.num_reconnects == 0 and leaver.address not in remote.addresses
            assert leaver.servicer.num_streams == 0 and leaver.servicer.num_open_sequences == 0
            while engine.has_unfinished():
                engine.step()
            assert drafted(on_leaver) > drafted_at_move  # speculation resumed on the keeper
            remote.flush()
            assert keeper.servicer.num_open_sequences == 0  # finished requests closed there too
    finally:
        for s in servers:
            s.stop(0)
    assert [s.output_token_ids for s in seqs] == want


def test_dead_drafter_leaving_dns_stops_its_reconnects_and_can_come_back(tiny_models):
    live = serve(tiny_models, "ngram")
    port = free_port()
    dead = f"127.0.0.1:{port}"  # nothing listens yet: reconnected in the background from the start
    dns = FakeDNS([live.address, dead])
    revived = None
    try:
        with RemoteProposer(dns.addresses, connect_timeout_s=0.5, resolve=dns, refresh_s=REFRESH_S,
                            reconnect_timeout_s=0.2, reconnect_backoff_s=0.05,
                            reconnect_max_backoff_s=0.1) as remote:
            dns.addresses = [live.address]
            deadline = time.monotonic() + 10
            while remote.wanted_addresses != [live.address]:
                assert time.monotonic() < deadline, "the refresh never applied"
                remote.flush()
                time.sleep(REFRESH_S)
            # Its reconnect thread ends (without the address answering: it was told to stop).
            while any(t.name == f"drafter-reconnect-{dead}" for t in threading.enumerate()):
                assert time.monotonic() < deadline, "the reconnect thread kept trying"
                time.sleep(0.05)
            revived = serve(tiny_models, "ngram", port)  # the address answers now, but is out of DNS
            time.sleep(1.0)  # ten reconnect backoffs
            remote.flush()
            assert remote.num_reconnects == 0 and remote.addresses == [live.address]
            assert revived.servicer.num_streams == 0
            dns.addresses = [live.address, dead]  # back in DNS: connected again
            while dead not in remote.addresses:
                assert time.monotonic() < deadline + 10, "the address did not rejoin"
                remote.flush()
                time.sleep(REFRESH_S)
            assert remote.num_reconnects == 1
    finally:
        live.stop(0)
        if revived is not None:
            revived.stop(0)


# ---- the resolution itself, without drafters -----------------------------------------------
def test_discovery_hands_over_changes_once_and_keeps_drafters_on_dns_failure():
    answers = iter([["a:1"], ["b:1", "a:1"], ["a:1", "b:1"], OSError("SERVFAIL"), [], ["b:1"]])
    done = threading.Event()

    def resolve():
        answer = next(answers, None)
        if answer is None:
            done.set()
            return ["b:1"]
        if isinstance(answer, Exception):
            raise answer
        return answer

    discovery = DrafterDiscovery(resolve, 0.01, current=["a:1"])
    try:
        assert done.wait(5.0)
        time.sleep(0.05)
        # Only the last change not taken is handed over, once; the same set in another order, a
        # failure and an empty answer are no change at all.
        assert discovery.take() == ["b:1"]
        assert discovery.take() is None
    finally:
        discovery.stop()
    assert discovery.num_failures == 2


def test_discovery_answers_each_change_in_turn():
    dns = FakeDNS(["a:1"])
    discovery = DrafterDiscovery(dns, 0.01, current=["a:1"])
    try:
        time.sleep(0.05)
        assert discovery.take() is None  # what it started with is no change
        dns.addresses = ["a:1", "b:1"]
        deadline = time.monotonic() + 5
        while (latest := discovery.take()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert latest == ["a:1", "b:1"] and discovery.take() is None
    finally:
        discovery.stop()
    assert dns.num_calls >= 2


def test_resolve_drafters_keeps_a_name_s_last_addresses_when_dns_fails(monkeypatch):
    table = {"drafter": ["10.0.0.3", "10.0.0.7"]}

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in table[host]]

    monkeypatch.setattr(verifier_server.socket, "getaddrinfo", getaddrinfo)
    last: dict[str, list[str]] = {}
    assert verifier_server.resolve_drafters(["drafter:50061"], last) == ["10.0.0.3:50061", "10.0.0.7:50061"]
    table["drafter"] = ["10.0.0.3", "10.0.0.7", "10.0.0.9"]  # scaled out
    assert verifier_server.resolve_drafters(["drafter:50061"], last)[-1] == "10.0.0.9:50061"
    del table["drafter"]  # DNS hiccup: the replicas stay, not the bare name
    assert verifier_server.resolve_drafters(["drafter:50061"], last) == \
        ["10.0.0.3:50061", "10.0.0.7:50061", "10.0.0.9:50061"]
    assert verifier_server.resolve_drafters(["drafter:50061"]) == ["drafter:50061"]  # no memory: as given
