"""DrafterDiscovery: re-resolves the drafter names on its own thread, off the step's path.

A verifier names its drafters (`drafter:50061` under compose, a headless Service in Kubernetes)
and a name's addresses change while it runs: a scale-out adds replicas, a replaced pod comes back
on a new IP. DNS can take seconds to answer, so the lookups run here, every `interval_s`, and only
the result crosses over: RemoteProposer takes the latest address list on the engine thread (which
owns the ring) and connects, drops and moves sequences from there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("specd.clients.discovery")


class DrafterDiscovery:
    """Calls `resolve()` (-> ["host:port", ...]) every interval_s; `take()` hands over a list that
    differs from the last one handed over, once. A resolver that raises or answers nothing leaves
    the drafters as they are: a DNS hiccup must not empty the ring."""

    def __init__(self, resolve: Callable[[], list[str]], interval_s: float, current: list[str]) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._resolve = resolve
        self._published = list(current)  # last list handed over (or the one the proposer started with)
        self._latest: list[str] | None = None  # a change not taken yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.num_resolutions = 0
        self.num_failures = 0
        self._thread = threading.Thread(target=self._run, name="drafter-discovery", daemon=True)
        self._thread.start()

    def take(self) -> list[str] | None:
        """The new address list if it changed since the last take, else None (engine thread)."""
        with self._lock:
            latest, self._latest = self._latest, None
        return latest

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)  # a resolver stuck in DNS is a daemon thread: not waited for

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                addresses = list(dict.fromkeys(self._resolve()))
            except Exception as err:  # noqa: BLE001 - any resolver failure keeps the drafters as they are
                self.num_failures += 1
                log.warning("drafter names did not resolve; keeping the current drafters: %s", err)
                continue
            self.num_resolutions += 1
            if not addresses:
                self.num_failures += 1
                log.warning("drafter names resolved to nothing; keeping the current drafters")
                continue
            if set(addresses) != set(self._published):  # order alone is no change
                self._published = addresses
                with self._lock:
                    self._latest = addresses
