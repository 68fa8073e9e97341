"""Reading the request stream ahead: the next iteration's XREADGROUP runs on a thread of its own
while the engine steps, so admission costs the loop no Redis round trip while it is busy.

Why: a loop with free batch slots asked Redis for new requests at the start of every iteration,
a round trip that queues behind the result flush sent just before: 0.7 ms of a 5.9 ms step at
batch 1 on the H200 (the "rest" phase, BENCHMARKS.md), on every step, for every running request.
Read ahead, the entries wait in the reply until the next admit takes them.

What changes: a request that arrives after the read left is read by the next one, so it may be
admitted one step later than before (at most a step of time to first token, against ~0.7 ms off
every step). While the engine is idle the loop still reads synchronously, with BLOCK, so an idle
verifier answers at once. Entries the read claimed are pending for this consumer until admitted;
a verifier that dies first leaves them to the reclaim scan of the others, as with any entry.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class ReadAhead:
    """At most one XREADGROUP in flight on a background thread."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # one thread, started with the first read
        self._future: Future | None = None

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def start(self, read) -> None:
        """Run read() (the XREADGROUP call) in the background; take its reply with `take`."""
        assert self._future is None, "a read is already in flight"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-read-ahead")
        self._future = self._pool.submit(read)

    def take(self):
        """The reply of the read in flight (waiting for it), raising what it raised; None when no
        read was in flight."""
        future, self._future = self._future, None
        return None if future is None else future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
