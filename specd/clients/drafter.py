"""RemoteProposer: the Proposer protocol over one or more drafter services (services/drafter).

Each drafter gets one long-lived DraftSteps stream (specd/clients/drafter_stream.py); open() and
close() ride along with the next step message. propose() splits the batch over the live drafters
by a consistent-hash ring, sends to each at once and puts the drafts back in request order;
propose_async() sends a step's requests right after the previous commit and collects the drafts
when the step begins, so the round trip overlaps the verifier's own work (one step in flight).

Failure costs speed, never output. A drafter that breaks its stream or misses the step deadline
leaves the ring, and its sequences are parked: no drafts (target-only decoding emits what
speculation would) and their draft state gone. A thread per dead drafter reconnects with backoff;
once any drafter is live, `take_resync()` names the parked sequences and the engine reopens them
with their whole history (SpecEngine._resync_drafts). Only a step the drafter refuses as
malformed (DrafterRejectedError, a bug on this side) raises.

With `resolve` and `refresh_s`, a DrafterDiscovery thread re-resolves the drafter names: an address
that appears connects like a reconnecting drafter, one that leaves DNS is dropped like a dead one.
A drafter joining the ring takes the sequences whose hash now lands on it, between steps, through
the same park-and-resync path. Only the engine thread touches the ring (DrafterMembership,
specd/clients/membership.py); the discovery and reconnect threads hand over through queues.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from specd.clients.draft_step import draft_step_parts
from specd.clients.drafter_stream import DrafterStream
from specd.clients.errors import DrafterError, DrafterRejectedError
from specd.clients.membership import DrafterMembership
from specd.proposers.base import DraftProposal, DraftRequest, HiddenKind, hidden_rows_to_host
from specd.sampling_params import SamplingParams
from specd.transport.tensor_codec import tensor_from_pb
from specd.v1 import drafter_pb2

log = logging.getLogger("specd.clients.drafter")

HIDDEN_KIND_FROM_PB: dict[int, HiddenKind] = {drafter_pb2.HIDDEN_KIND_NONE: "none",
                                              drafter_pb2.HIDDEN_KIND_FINAL: "final",
                                              drafter_pb2.HIDDEN_KIND_AUX: "aux"}


@dataclass(frozen=True)
class DraftRoundTrip:
    """Where one step's round trip went, for the drafter that answered last (seconds): queued,
    from the engine's send until gRPC's sender thread took the request (it needs the GIL, which
    the engine thread holds while it works); transit, from then until the answer reached the
    reader thread, less handle, the drafter's own time for the step (propose: the proposer's call
    inside it, the rest its parsing, checks and answer); waited,
    how long the engine then blocked collecting it (the step's draft phase, when sent ahead).
    The send, on the engine thread (the verifier's commit): to_host, the step's hidden rows
    copied to the host (a wait for the device); encode, the step messages built; write, their
    serialisation and hand-off (the fast path's socket write; gRPC: the hand-off wait)."""

    queued: float
    transit: float
    handle: float
    waited: float
    to_host: float = 0.0
    encode: float = 0.0
    write: float = 0.0
    propose: float = 0.0


class RemoteProposer:
    """Proposer whose draft state lives on drafter services at `addresses` ("host:port").

    deadline_s bounds one step's round trip (past it the step goes on without that drafter's
    drafts); connect_timeout_s bounds the first Info, reconnect_timeout_s each later attempt,
    retried every reconnect_backoff_s doubling up to reconnect_max_backoff_s. hidden_dtype casts
    hidden rows before sending (None: as the target produced them). After each propose,
    last_rpc_seconds is the step's wall time here and last_draft_seconds the slowest drafter's
    model time (the rest is transport), and last_round_trip its split (DraftRoundTrip;
    num_round_trips counts them). resolve() names the drafters anew (the verifier expands
    DNS names, services/verifier/server.py resolve_drafters); it is called every refresh_s on a
    background thread (0: the addresses stay as given).
    """

    draft_constraints = None  # remote drafters mask drafts themselves

    def __init__(self, addresses: list[str], *, deadline_s: float = 10.0, connect_timeout_s: float = 10.0,
                 hidden_dtype: torch.dtype | None = None, reconnect_timeout_s: float = 1.0,
                 reconnect_backoff_s: float = 0.1, reconnect_max_backoff_s: float = 2.0,
                 credentials: grpc.ChannelCredentials | None = None,
                 resolve: Callable[[], list[str]] | None = None, refresh_s: float = 0.0) -> None:
        if not addresses:
            raise ValueError("addresses: need at least one drafter address")
        if refresh_s < 0 or (refresh_s > 0 and resolve is None):
            raise ValueError(f"refresh_s: must be >= 0 and needs resolve when > 0, got {refresh_s}")
        if deadline_s <= 0 or reconnect_timeout_s <= 0 or not 0 < reconnect_backoff_s <= reconnect_max_backoff_s:
            raise ValueError("deadline_s, reconnect_timeout_s: must be > 0; need 0 < reconnect_backoff_s "
                             "<= reconnect_max_backoff_s")
        self.deadline_s = deadline_s
        self.hidden_dtype = hidden_dtype
        self._write_seconds = 0.0  # of the step being sent: in DrafterStream.send (the send split)
        self.credentials = credentials  # TLS for the drafter channels; None: plaintext
        self.members = DrafterMembership(
            addresses, self._connect, connect_timeout_s=connect_timeout_s, deadline_s=deadline_s,
            reconnect_timeout_s=reconnect_timeout_s, reconnect_backoff_s=reconnect_backoff_s,
            reconnect_max_backoff_s=reconnect_max_backoff_s, resolve=resolve, refresh_s=refresh_s)
        first = self.members.info
        self.method: str = first.method
        self.hidden_kind: HiddenKind = HIDDEN_KIND_FROM_PB[first.hidden_kind]
        self.aux_layer_ids: list[int] = list(first.aux_layer_ids)  # build_engine sets the runner's
        self.vocab_size = int(first.vocab_size)
        self.max_num_draft_tokens = self.members.max_num_draft_tokens
        self.last_rpc_seconds = 0.0
        self.last_draft_seconds = 0.0
        self.last_round_trip: DraftRoundTrip | None = None
        self.num_round_trips = 0
        self._in_flight: PendingDrafts | None = None  # a sent step not collected yet

    def _connect(self, address: str, timeout_s: float) -> DrafterStream:
        return DrafterStream(address, timeout_s, self.credentials, send_timeout_s=self.deadline_s)

    @property
    def addresses(self) -> list[str]:
        """The live drafters."""
        return list(self.members.drafters)

    @property
    def wanted_addresses(self) -> list[str]:
        """Every drafter address the names resolve to (last refresh), live or being connected."""
        return list(self.members.wanted)

    @property
    def num_parked(self) -> int:
        return len(self.members.parked)

    # membership figures (tests, logs): drafters lost, (back) on the ring, gone from DNS; sequences moved
    num_failovers = property(lambda self: self.members.num_failovers)
    num_reconnects = property(lambda self: self.members.num_reconnects)
    num_removed = property(lambda self: self.members.num_removed)
    num_moved = property(lambda self: self.members.num_moved)

    def drafter_of(self, seq_id: int) -> str | None:
        """The address that holds (or would hold) the sequence's draft state; None while parked."""
        members = self.members
        if seq_id in members.owner:
            owner = members.owner[seq_id]
            return owner.address if owner is not None else None
        return members.ring.lookup(seq_id) if members.drafters else None

    # ---- the Proposer protocol --------------------------------------------------------------
    def open(self, seq_id: int, params: SamplingParams, grammar=None) -> None:
        members = self.members
        if seq_id in members.owner:
            raise ValueError(f"seq {seq_id}: already open")
        members.absorb()
        if not members.drafters:  # no drafter at all: decode target-only until one is back
            members.owner[seq_id] = None
            members.parked.add(seq_id)
            return
        drafter = members.lookup(seq_id)
        drafter.pending_open[seq_id] = (params, grammar)
        members.owner[seq_id] = drafter

    def close(self, seq_id: int) -> None:
        drafter = self.members.owner.pop(seq_id, None)
        self.members.parked.discard(seq_id)
        if drafter is None or drafter.error is not None:
            return
        if drafter.pending_open.pop(seq_id, None) is None:  # never sent: nothing to close remotely
            drafter.pending_close.append(seq_id)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        return self.propose_async(requests).result()

    def propose_async(self, requests: list[DraftRequest]) -> "PendingDrafts":
        """Send the step now, collect its drafts later (`result()`): the engine sends the next
        step's requests right after a commit and collects them when that step begins, so the
        drafters draft while the verifier writes results and admits (specd/engine/drafting.py).
        A stream carries one step at a time: a step still in flight is collected first."""
        self._settle()
        t0 = time.perf_counter()
        members = self.members
        members.absorb()
        groups: dict[str, list[int]] = {}  # live drafter address -> indices into requests
        for i, r in enumerate(requests):
            if r.seq_id not in members.owner:
                raise ValueError(f"seq {r.seq_id}: propose before open")
            owner = members.owner[r.seq_id]
            if owner is not None:  # parked sequences: no drafts, their tokens are not needed
                groups.setdefault(owner.address, []).append(i)
        targets = [d for a, d in members.drafters.items() if a in groups or d.pending_open or d.pending_close]
        t_rows = time.perf_counter()
        wire = hidden_rows_to_host(requests, self.hidden_dtype) if self.hidden_kind != "none" else requests
        t_encode = time.perf_counter()
        self._write_seconds = 0.0
        sent = {d.address: self._send(d, [wire[i] for i in groups.get(d.address, [])]) for d in targets}
        t_sent = time.perf_counter()
        self._in_flight = PendingDrafts(self, requests, groups, targets, sent, t0)
        self._in_flight.send_split = (t_encode - t_rows, t_sent - t_encode - self._write_seconds, self._write_seconds)
        return self._in_flight

    def _settle(self) -> None:
        """Collect the step in flight, if any (its PendingDrafts keeps the answer for its owner)."""
        if self._in_flight is not None:
            self._in_flight.result()

    def _receive(self, pending: "PendingDrafts") -> list[DraftProposal]:
        """Wait for a sent step's answers (the deadline counts from now) and map them back."""
        requests, groups = pending.requests, pending.groups
        deadline = time.monotonic() + self.deadline_s
        collect_at = time.perf_counter()
        responses = {}
        for d in pending.targets:  # every stream is drained, so step ids stay in sync
            try:
                responses[d.address] = d.receive(pending.sent[d.address], deadline)
            except DrafterRejectedError as err:
                err.lost_seq_ids = self.members.lose(d, err)
                raise
            except DrafterError as err:
                self.members.lose(d, err)
        out: list[DraftProposal | None] = [None] * len(requests)
        for address, indices in groups.items():
            answer = responses.get(address)
            if answer is None:
                continue  # lost this step: target-only for its sequences
            seqs = answer.sequences
            if [s.seq_id for s in seqs] != [requests[i].seq_id for i in indices]:
                self.members.lose(self.members.drafters[address],
                                  DrafterError(address, "answered for other sequences"))
                continue
            # One tensor per answer, split into views: a tensor per sequence cost ~3 us each (a
            # batch of 64 spent 0.2 ms of the step's critical path on them here).
            ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long)
            proposals = [DraftProposal(token_ids, tensor_from_pb(seq.probs) if seq.HasField("probs") else None)
                         for seq, token_ids in zip(seqs, ids.split([len(s.token_ids) for s in seqs]))]
            fault = self._malformed(ids, proposals, [requests[i].num_draft_tokens for i in indices])
            if fault is not None:  # a drafter's bug or a version skew must not reach the forward
                self.members.lose(self.members.drafters[address],
                                  DrafterError(address, f"answered malformed drafts: {fault}"))
                continue
            for i, proposal in zip(indices, proposals):
                out[i] = proposal
        out = [p if p is not None else DraftProposal(torch.empty(0, dtype=torch.long)) for p in out]
        self.last_draft_seconds = max((r.draft_time_us for r in responses.values()), default=0) / 1e6
        done = time.perf_counter()
        self.last_rpc_seconds = done - pending.sent_at
        last = max((d for d in pending.targets if d.address in responses), key=lambda d: d.last_arrived_at,
                   default=None)
        if last is not None:
            handle = responses[last.address].handle_time_us / 1e6
            self.last_round_trip = DraftRoundTrip(
                queued=max(0.0, last.last_left_at - pending.sent_at),
                transit=max(0.0, last.last_arrived_at - last.last_left_at - handle),
                handle=handle, waited=done - collect_at, to_host=pending.send_split[0],
                encode=pending.send_split[1], write=pending.send_split[2],
                propose=responses[last.address].draft_time_us / 1e6)
            self.num_round_trips += 1
        return out

    def _malformed(self, ids: torch.Tensor, proposals: list[DraftProposal], asked: list[int]) -> str | None:
        """What is wrong with an answer's drafts, or None: more drafts than asked (the engine
        would fail the step), ids outside the vocabulary (the embedding would read past its
        table: on CUDA a device assert, the process lost), q rows not [n, vocab]."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            return f"token ids outside [0, {self.vocab_size})"
        for p, k in zip(proposals, asked):
            n = p.token_ids.numel()
            if n > k:
                return f"{n} drafts where {k} were asked"
            if p.probs is not None and tuple(p.probs.shape) != (n, self.vocab_size):
                return f"draft probabilities of shape {tuple(p.probs.shape)} for {n} drafts"
        return None

    # ---- beyond the protocol ----------------------------------------------------------------
    def take_resync(self) -> list[int]:
        """Parked sequences a live drafter can take now; the caller closes and reopens each with
        its whole history (their draft state is gone). Empty while no drafter is live.

        Called between steps (a step in flight is collected first), this is also where sequences
        move to a drafter that joined the ring: they are parked here and named with the rest."""
        self._settle()
        members = self.members
        members.absorb()
        if not members.drafters:
            return []
        if members.rebalance:
            members.move_to_ring_owners()
        if not members.parked:
            return []
        seq_ids = sorted(members.parked)
        members.parked.clear()
        return seq_ids

    def flush(self) -> None:
        """Send buffered opens and closes now (an idle verifier frees its drafters' state)."""
        self.propose([])

    def shutdown(self) -> None:
        """End every stream (each drafter drops this proposer's sequences) and close channels."""
        self.members.shutdown()

    def __enter__(self) -> "RemoteProposer":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- helpers -----------------------------------------------------------------------------
    def _send(self, drafter: DrafterStream, requests: list[DraftRequest]) -> int:
        """Build and queue one step message; returns its step id. The step's rows go beside the
        message where the drafter reads them so (DrafterStream.takes_attached_rows), else inside."""
        message, rows = draft_step_parts(requests, opens=drafter.pending_open, closes=drafter.pending_close,
                                         with_hidden=self.hidden_kind != "none", hidden_dtype=self.hidden_dtype,
                                         one_tensor=drafter.info.takes_step_hidden_states)
        drafter.pending_open, drafter.pending_close = {}, []
        step_id = drafter.next_step_id
        t0 = time.perf_counter()
        drafter.send(message, rows)
        self._write_seconds += time.perf_counter() - t0
        return step_id


class PendingDrafts:
    """One sent step of a RemoteProposer: `result()` waits for its drafts, once (later calls
    return the same list), in request order; `requests` are the step's requests."""

    def __init__(self, proposer: RemoteProposer, requests: list[DraftRequest], groups: dict[str, list[int]],
                 targets: list[DrafterStream], sent: dict[str, int], sent_at: float) -> None:
        self.proposer = proposer
        self.requests = requests
        self.groups, self.targets, self.sent, self.sent_at = groups, targets, sent, sent_at
        self._proposals: list[DraftProposal] | None = None
        self._error: BaseException | None = None  # what receiving raised: raised again, not retried
        self.send_split = (0.0, 0.0, 0.0)  # seconds: rows to the host, messages built, written

    def result(self) -> list[DraftProposal]:
        if self._proposals is None and self._error is None:
            if self.proposer._in_flight is self:
                self.proposer._in_flight = None  # settled, also when receiving raises
            try:
                self._proposals = self.proposer._receive(self)
            except BaseException as err:
                self._error = err
                raise
        if self._error is not None:
            raise self._error
        return self._proposals
