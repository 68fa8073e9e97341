"""Cancellation: which running requests the client gave up on, asked once per step.

The gateway sets `specd:cancel:<id>` (with a TTL) when a client disconnects or times out
(Gateway.abandon -> ResultReader.cancel). Each step the verifier MGETs the keys of the requests it
runs, as one more command of the step's result pipeline, so cancellation costs no extra round
trip; a hit aborts the request (its KV blocks are freed) and acknowledges its entry. With the
result writer thread (services/verifier/results/writer.py) the answer is read a step later: the request
runs one more step, whose tokens are dropped, and a request that finished in that step is still
cancelled (no final).
"""

from __future__ import annotations

from specd.transport.redis_streams import CANCEL_PREFIX, cancel_key


class CancelPoll:
    """One step's MGET over the cancel keys of `request_ids` (a ResultQueue.flush rider)."""

    def __init__(self, request_ids: list[str], prefix: str = CANCEL_PREFIX) -> None:
        self.request_ids = request_ids
        self.prefix = prefix
        self.cancelled: list[str] = []  # filled by `answer`

    def queue(self, pipe) -> int:
        if not self.request_ids:
            return 0
        pipe.mget([cancel_key(rid, self.prefix) for rid in self.request_ids])
        return 1

    def answer(self, replies: list) -> None:
        if not replies or isinstance(replies[0], Exception):
            return  # asked again next step
        self.cancelled = [rid for rid, value in zip(self.request_ids, replies[0]) if value is not None]
