"""The result writer: the step's result pipeline goes out on a thread of its own, overlapping the
next engine step instead of leaving the accelerator idle for a Redis round trip.

The loop hands over step n's flush (`start`) and carries on with step n+1; it waits for that
flush (`wait`) only when it hands over the next one, so at most one flush is in flight and they
reach Redis strictly in order: step n's deltas before step n+1's, and a request's XACK + XDEL in
the same pipeline as (after) its final, as with a synchronous flush.

With `hold`, a flush handed over waits for `release` (the engine's next launch, when the worker
sets SPECD_VERIFIER_FLUSH_AFTER_LAUNCH=1) or the next `wait`: redis-py packs the pipeline's
commands on the writer thread, holding the GIL (~1 ms at batch 128 on a CPU, 2-4x that on the GPU
VMs), and a flush started at the step's end competes with the next step's launch for it; held,
it competes with the host work that overlaps the forward instead. An experiment until timed on
the GPU (the e2e suffix -flushlate).

The writer thread runs `ResultFlush.execute` and nothing else: the pipeline is filled on the loop's
thread (ResultQueue.prepare), and the outcome is brought back there by `wait`, which answers the
riders (ResultQueue.complete) or, when the round trip failed, puts the flush's results back in
front of the queue (ResultQueue.requeue) and raises the writer's exception where a synchronous
flush would have raised it. The engine, which is not thread-safe, is never touched by the writer.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from services.verifier.results.flush import ResultFlush, PipelineRider, ResultQueue


class ResultWriter:
    """At most one ResultQueue flush in flight on a background thread."""

    def __init__(self, result_queue: ResultQueue) -> None:
        self.result_queue = result_queue
        self._pool: ThreadPoolExecutor | None = None  # one thread, started with the first flush
        self._flush: ResultFlush | None = None  # in flight (or held)
        self._future: Future | None = None  # None while the flush is held

    @property
    def in_flight(self) -> bool:
        """A flush handed over and not yet waited for (held ones included)."""
        return self._flush is not None

    @property
    def held(self) -> bool:
        return self._flush is not None and self._future is None

    @property
    def has_pending(self) -> bool:
        """Results queued or on their way: not yet known to be written."""
        return self.in_flight or self.result_queue.has_pending

    def is_finishing(self, entry_id: bytes | str) -> bool:
        """Whether the entry's XACK + XDEL is queued or in flight: its request was answered here,
        and a reclaim scan that finds it still pending must leave it alone."""
        if self._flush is not None and self._flush.is_finishing(entry_id):
            return True
        return self.result_queue.is_finishing(entry_id)

    def start(self, riders: list[PipelineRider] = (), *, hold: bool = False) -> bool:
        """Send what the ResultQueue holds, and the riders, in the background; False if nothing to send.
        The previous flush must have been waited for. hold: prepared now, sent at `release` (or
        the next `wait`)."""
        if self._flush is not None:
            raise RuntimeError("a flush is in flight: wait() for it first (flushes go out in order)")
        flush = self.result_queue.prepare(riders)
        if flush is None:
            return False
        self._flush = flush
        if not hold:
            self.release()
        return True

    def release(self) -> None:
        """Send the held flush, if one is held (a no-op otherwise)."""
        if self._flush is None or self._future is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-result-writer")
        self._future = self._pool.submit(self._flush.execute)

    def flush(self, riders: list[PipelineRider] = ()) -> ResultFlush | None:
        """Send now, on the caller's thread (nothing to overlap with, or async_emit off); None if
        there was nothing to send. Raises as ResultQueue.flush does, keeping the queue."""
        if self._flush is not None:
            raise RuntimeError("a flush is in flight: wait() for it first (flushes go out in order)")
        return self.result_queue.send(riders)

    def wait(self) -> ResultFlush | None:
        """The flush in flight once written, with its riders answered; None if there was none.

        Raises what the round trip raised (redis.ConnectionError when Redis is unreachable), after
        putting its results back in the ResultQueue for the next flush.
        """
        if self._flush is None:
            return None
        self.release()  # a held flush goes now: it is waited for
        flush, future = self._flush, self._future
        try:
            future.result()  # an interrupt (KeyboardInterrupt) here leaves the flush in flight
        except Exception:
            self._flush = self._future = None
            self.result_queue.requeue(flush)
            raise
        self._flush = self._future = None
        self.result_queue.complete(flush)
        return flush

    def close(self) -> None:
        """Stop the thread; call `wait` first (a flush still in flight is finished, not dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
