"""Which drafters serve a RemoteProposer (specd/clients/drafter.py says when each change happens):
the live streams, the hash ring over them, each open sequence's drafter (or none: parked), losing
a drafter, reconnecting it, following DNS, and moving sequences to the drafters that join the ring.
Only the engine thread changes the ring; the reconnect and discovery threads hand over through
queues.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import queue
import threading
from collections.abc import Callable

from specd.clients.discovery import DrafterDiscovery
from specd.clients.drafter_stream import DrafterStream
from specd.clients.errors import DrafterError, DrafterUnavailableError

log = logging.getLogger("specd.clients.drafter")


def contract(info) -> tuple:
    """What every drafter of one proposer must agree on."""
    return info.method, info.hidden_kind, list(info.aux_layer_ids), info.vocab_size


class HashRing:
    """Consistent hashing of integer keys onto nodes: adding or removing a node moves only the
    keys of the arcs it gains or loses (about 1/N of them), `replicas` virtual points per node."""

    def __init__(self, nodes: list[str] = (), replicas: int = 64) -> None:
        self.replicas = replicas
        self._points: list[tuple[int, str]] = []  # sorted (hash, node)
        for node in nodes:
            self.add(node)

    @staticmethod
    def _hash(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    @property
    def nodes(self) -> list[str]:
        return sorted({node for _, node in self._points})

    def add(self, node: str) -> None:
        if node in self.nodes:
            raise ValueError(f"drafter {node} is already on the ring")
        for i in range(self.replicas):
            bisect.insort(self._points, (self._hash(f"{node}#{i}"), node))

    def remove(self, node: str) -> None:
        self._points = [p for p in self._points if p[1] != node]

    def lookup(self, key: int) -> str:
        if not self._points:
            raise LookupError("the hash ring has no drafters")
        i = bisect.bisect(self._points, (self._hash(str(key)), "")) % len(self._points)
        return self._points[i][1]


class DrafterMembership:
    """The drafters at `addresses` and the sequences they hold. connect(address, timeout_s) opens a
    DrafterStream; connect_timeout_s bounds the first Info, reconnect_timeout_s each later attempt,
    retried every reconnect_backoff_s doubling up to reconnect_max_backoff_s; deadline_s bounds the
    probe step a reconnected drafter must answer. resolve() names the drafters anew every
    refresh_s on a background thread (0: the addresses stay as given).

    `drafters` (address -> live stream), `ring`, `owner` (open seq id -> its drafter, None while
    parked) and `parked` belong to the engine thread, which also calls every method."""

    def __init__(self, addresses: list[str], connect: Callable[[str, float], DrafterStream], *,
                 connect_timeout_s: float, deadline_s: float, reconnect_timeout_s: float,
                 reconnect_backoff_s: float, reconnect_max_backoff_s: float,
                 resolve: Callable[[], list[str]] | None = None, refresh_s: float = 0.0) -> None:
        self._connect = connect
        self.deadline_s = deadline_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.reconnect_backoff_s = reconnect_backoff_s
        self.reconnect_max_backoff_s = reconnect_max_backoff_s
        self.wanted = list(dict.fromkeys(addresses))  # what the names resolve to: live or being connected
        self.drafters: dict[str, DrafterStream] = {}  # live ones
        self.owner: dict[int, DrafterStream | None] = {}  # open seq id -> its drafter (None: parked)
        self.parked: set[int] = set()  # open, without draft state: waiting for a live drafter
        self._revived: queue.SimpleQueue = queue.SimpleQueue()  # (stream, its cancel event) from connect threads
        self._reconnecting: dict[str, threading.Event] = {}  # address -> cancels its connect thread
        self.rebalance = False  # a drafter joined the ring: move the sequences that hash to it
        self._closed = threading.Event()
        self._discovery: DrafterDiscovery | None = None
        self.num_failovers = 0  # drafters lost over the proposer's life (tests, logs)
        self.num_reconnects = 0  # drafters (back) on the ring after the start, new ones included
        self.num_removed = 0  # addresses that left DNS
        self.num_moved = 0  # sequences moved to a drafter that joined the ring
        failures: list[DrafterError] = []
        for address in self.wanted:
            try:
                self.drafters[address] = connect(address, connect_timeout_s)
            except DrafterError as err:
                failures.append(err)
        if not self.drafters:
            raise failures[0]
        infos = {a: d.info for a, d in self.drafters.items()}
        self.info = next(iter(infos.values()))  # the first live drafter's Info: the proposer's contract
        self.contract = contract(self.info)
        if any(contract(i) != self.contract for i in infos.values()):
            self.shutdown()
            raise ValueError("addresses: the drafters disagree on method / hidden states / vocab: "
                             + "; ".join(f"{a}: {contract(i)}" for a, i in infos.items()))
        self.max_num_draft_tokens = min(i.max_num_draft_tokens for i in infos.values())
        self.ring = HashRing(list(self.drafters))
        for err in failures:  # unreachable at start: joins the ring once it answers
            log.warning("drafter unreachable at start, reconnecting in the background: %s", err)
            self._start_reconnect(err.address)
        if refresh_s > 0:
            self._discovery = DrafterDiscovery(resolve, refresh_s, self.wanted)

    def lookup(self, seq_id: int) -> DrafterStream:
        """The live drafter the ring gives seq_id (some drafter must be live)."""
        return self.drafters[self.ring.lookup(seq_id)]

    def lose(self, drafter: DrafterStream, err: DrafterError) -> list[int]:
        """Drop a failed drafter: park its sequences, reconnect in the background; returns them."""
        lost = self._drop(drafter, err)
        self.num_failovers += 1
        log.warning("drafter lost, %d sequences decode target-only until resynced: %s", len(lost), err)
        if drafter.address in self.wanted:
            self._start_reconnect(drafter.address)
        return lost

    def _drop(self, drafter: DrafterStream, err: DrafterError) -> list[int]:
        """Take a drafter off the ring, end its stream and park its sequences; returns them."""
        lost = sorted(s for s, d in self.owner.items() if d is drafter)
        for seq_id in lost:
            self.owner[seq_id] = None
        self.parked.update(lost)
        self.drafters.pop(drafter.address, None)
        self.ring.remove(drafter.address)
        drafter.error = drafter.error or err
        drafter.shutdown(timeout_s=0.1)
        return lost

    def _start_reconnect(self, address: str, first_delay_s: float | None = None) -> None:
        if address in self._reconnecting or self._closed.is_set():
            return
        cancel = threading.Event()
        self._reconnecting[address] = cancel
        delay = self.reconnect_backoff_s if first_delay_s is None else first_delay_s
        threading.Thread(target=self._reconnect, args=(address, cancel, delay), daemon=True,
                         name=f"drafter-reconnect-{address}").start()

    def _reconnect(self, address: str, cancel: threading.Event, delay: float) -> None:
        """Runs in its own thread: Info with backoff until the drafter answers with our contract,
        or until the address leaves DNS (`cancel`) or the proposer shuts down."""
        while not self._closed.wait(delay) and not cancel.is_set():
            delay = min(max(delay, self.reconnect_backoff_s) * 2, self.reconnect_max_backoff_s)
            try:
                stream = self._connect(address, self.reconnect_timeout_s)
            except DrafterError:
                continue
            if contract(stream.info) != self.contract:
                log.error("drafter %s came back running %s, expected %s; not used", address,
                          contract(stream.info), self.contract)
                stream.shutdown()
                continue
            if stream.info.max_num_draft_tokens < self.max_num_draft_tokens:  # it would refuse our steps
                log.error("drafter %s drafts at most %d tokens, the others %d; not used", address,
                          stream.info.max_num_draft_tokens, self.max_num_draft_tokens)
                stream.shutdown()
                continue
            try:  # back when it answers a step in time, not only Info: a drafter still inside a slow
                stream.probe(self.deadline_s)  # step (the one that missed) would miss the next one too
            except DrafterError:
                stream.shutdown()
                continue
            self._revived.put((stream, cancel))  # handed to the engine thread, which owns the ring
            return

    def absorb(self) -> None:
        """Apply what the background threads found (engine thread only: no lock on the ring)."""
        if self._discovery is not None:
            wanted = self._discovery.take()
            if wanted is not None:
                self._follow(wanted)
        while not self._revived.empty():
            stream, cancel = self._revived.get()
            if self._closed.is_set() or self._reconnecting.get(stream.address) is not cancel:
                stream.shutdown()  # closed, or the address left DNS while it connected
                continue
            del self._reconnecting[stream.address]
            self.drafters[stream.address] = stream
            self.ring.add(stream.address)
            self.rebalance = True
            self.num_reconnects += 1
            log.info("drafter on the ring: %s (%d parked sequences to resync)", stream.address,
                     len(self.parked))

    def _follow(self, wanted: list[str]) -> None:
        """Make the drafters what DNS says: connect new addresses, drop those that are gone."""
        added = [a for a in wanted if a not in self.wanted]
        removed = [a for a in self.wanted if a not in wanted]
        self.wanted = list(wanted)
        for address in removed:
            cancel = self._reconnecting.pop(address, None)
            if cancel is not None:  # dead or still connecting: stop trying
                cancel.set()
            drafter = self.drafters.get(address)
            lost = self._drop(drafter, DrafterUnavailableError(address, "left DNS")) if drafter else []
            self.num_removed += 1
            log.info("drafter left DNS: %s (%d sequences resync on the others)", address, len(lost))
        for address in added:
            log.info("drafter appeared in DNS, connecting: %s", address)
            self._start_reconnect(address, first_delay_s=0.0)

    def move_to_ring_owners(self) -> None:
        """Sequences whose hash lands on another live drafter than theirs go there: those not
        sent yet just change owner; the others are closed on the old drafter and parked (their
        draft state cannot move), for take_resync to name."""
        self.rebalance = False
        moved = 0
        for seq_id, owner in list(self.owner.items()):
            if owner is None:
                continue
            target = self.drafters[self.ring.lookup(seq_id)]
            if target is owner:
                continue
            moved += 1
            pending = owner.pending_open.pop(seq_id, None)
            if pending is not None:
                target.pending_open[seq_id] = pending
                self.owner[seq_id] = target
                continue
            owner.pending_close.append(seq_id)
            self.owner[seq_id] = None
            self.parked.add(seq_id)
        self.num_moved += moved
        if moved:
            log.info("rebalanced: %d sequences move to the drafters that joined the ring", moved)

    def shutdown(self) -> None:
        """End every stream (each drafter drops these sequences) and stop the background threads."""
        self._closed.set()
        if self._discovery is not None:
            self._discovery.stop()
        for drafter in self.drafters.values():
            drafter.shutdown()
        self.drafters.clear()
        while not self._revived.empty():
            self._revived.get()[0].shutdown()
        self.owner.clear()
        self.parked.clear()
