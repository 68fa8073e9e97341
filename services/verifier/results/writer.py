"""The result writer: the step's result pipeline goes out on a thread of its own, overlapping the
next engine step instead of leaving the accelerator idle for a Redis round trip.

The loop hands over step n's flush (`start`) and carries on with step n+1; it waits for that
flush (`wait`) only when it hands over the next one, so at most one flush is in flight and they
reach Redis strictly in order: step n's deltas before step n+1's, and a request's XACK + XDEL in
the same pipeline as (after) its final, as with a synchronous flush.

The writer thread runs `ResultFlush.execute` and nothing else: the pipeline is filled on the loop's
thread (ResultQueue.prepare), and the outcome is brought back there by `wait`, which answers the
riders (ResultQueue.complete) or, when the round trip failed, puts the flush's results back in
front of the queue (ResultQueue.requeue) and raises the writer's exception where a synchronous
flush would have raised it. The engine, which is not thread-safe, is never touched by the writer.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from services.verifier.results.flush import PipelineRider, ResultFlush, ResultQueue


class ResultWriter:
    """At most one ResultQueue flush in flight on a background thread."""

    def __init__(self, result_queue: ResultQueue) -> None:
        self.result_queue = result_queue
        self._pool: ThreadPoolExecutor | None = None  # one thread, started with the first flush
        self._flush: ResultFlush | None = None  # in flight
        self._future: Future | None = None  # its round trip on the writer thread

    @property
    def in_flight(self) -> bool:
        """A flush handed over and not yet waited for."""
        return self._flush is not None

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

    def start(self, riders: list[PipelineRider] = ()) -> bool:
        """Send what the ResultQueue holds, and the riders, in the background; False if nothing to
        send. The previous flush must have been waited for."""
        if self._flush is not None:
            raise RuntimeError("a flush is in flight: wait() for it first (flushes go out in order)")
        flush = self.result_queue.prepare(riders)
        if flush is None:
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-result-writer")
        self._flush, self._future = flush, self._pool.submit(flush.execute)
        return True

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
