"""Who owns a request-stream entry: heartbeats for our own, reclaiming those of dead verifiers.

A verifier owns an entry from XREADGROUP (or XAUTOCLAIM) until it XACKs it. Redis counts how long
each pending entry has been idle, so liveness needs no extra keys:
  - heartbeat: a live verifier resets the idle time of its running requests' entries (XCLAIM to
    itself with JUSTID, min-idle 0) every `heartbeat_ms`, pipelined with the step's results. The
    script claims only entries still in *its* pending list and returns the others: an entry a
    survivor reclaimed (we stalled past the idle limit, or lost Redis for that long) is its
    request now, and this verifier drops it instead of racing the new owner (a step later with
    the result writer thread, services/verifier/results/writer.py; that step's tokens are not written).
  - reclaim: a verifier with room XAUTOCLAIMs entries idle past `idle_ms` (their owner stopped
    heartbeating: dead, hung, or cut off) and reads each one's result stream in the same round
    trip, which says where the request stands (specd/transport/resume.py). A request is resumed
    from the tokens already written, answered already (a final is there: only the XACK was lost),
    or failed as poisonous after `max_deliveries` claims (it may be what kills verifiers).
`idle_ms` must exceed the longest step, or a slow live verifier loses its requests to others
(safe: it drops them when its heartbeat finds them gone, but the work is done twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.messages import ConfigError
from specd.transport.redis_streams import RESULT_PREFIX, ResultEntry, result_key
from specd.transport.resume import ResultGapError, ResumePoint, replay_results

# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] how many entries the consumer may have
# pending at most, ARGV[4..] entry ids this verifier runs. Refreshes those still pending for this
# consumer; returns the ids that are not (lost). One XPENDING over the consumer's own pending list,
# not one per entry: Redis commands per generated token are the Redis tier's ceiling.
_HEARTBEAT = """
local mine = {}
for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[3]), ARGV[2])) do
  mine[p[1]] = true
end
local owned, lost = {}, {}
for i = 4, #ARGV do
  if mine[ARGV[i]] then owned[#owned + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
end
if #owned > 0 then  -- XCLAIM key group consumer min-idle id... JUSTID: the options after the ids
  local args = {KEYS[1], ARGV[1], ARGV[2], 0}
  for _, id in ipairs(owned) do args[#args + 1] = id end
  args[#args + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(args))
end
return lost
"""


@dataclass
class ClaimConfig:
    """Liveness timing of the entries of one verifier."""

    idle_ms: int = 30_000  # reclaim entries idle this long; 0 turns reclaim and heartbeats off
    heartbeat_ms: int = 0  # 0: idle_ms / 4
    scan_ms: int = 0  # how often to look for idle entries; 0: idle_ms / 2
    max_deliveries: int = 5  # claims of one entry before it is failed as poisonous

    def __post_init__(self) -> None:
        if self.idle_ms < 0:
            raise ConfigError(f"idle_ms (--reclaim-idle-ms): must be >= 0, got {self.idle_ms}")
        if self.idle_ms and self.idle_ms < 100:
            raise ConfigError(f"idle_ms (--reclaim-idle-ms): must be 0 (off) or >= 100, got {self.idle_ms}")
        self.heartbeat_ms = self.heartbeat_ms or self.idle_ms // 4
        self.scan_ms = self.scan_ms or self.idle_ms // 2
        if self.idle_ms and not 0 < self.heartbeat_ms < self.idle_ms:
            raise ConfigError(f"heartbeat_ms: must be in (0, idle_ms={self.idle_ms}), got {self.heartbeat_ms}")
        if self.max_deliveries < 2:
            raise ConfigError(f"max_deliveries: must be >= 2 (one delivery plus a reclaim), "
                              f"got {self.max_deliveries}")

    @property
    def enabled(self) -> bool:
        return self.idle_ms > 0


@dataclass
class ClaimedEntry:
    """An entry taken over from another consumer, with where its request stands."""

    entry_id: bytes | str
    fields: dict | None  # None: the entry was deleted (answered) while pending
    resume: ResumePoint | None  # None: its result stream could not be read back (a gap)
    num_deliveries: int


class HeartbeatRider:
    """The heartbeat as a part of the result pipeline (see ResultQueue.flush)."""

    def __init__(self, script, stream: str, group: str, consumer: str, sent_at: float = 0.0) -> None:
        self.script, self.stream, self.group, self.consumer = script, stream, group, consumer
        self.sent_at = sent_at  # time.monotonic() when queued: the next one is due heartbeat_ms later
        self.entry_ids: list = []
        self.lost: list = []  # filled by `answer`
        self.answered = False

    def queue(self, pipe) -> int:
        # The consumer's pending list holds its running entries and the few answered ones whose XACK
        # is on its way; a generous bound keeps the single XPENDING from cutting it short.
        bound = 2 * len(self.entry_ids) + 1024
        self.script(keys=[self.stream], args=[self.group, self.consumer, bound, *self.entry_ids], client=pipe)
        return 1

    def answer(self, replies: list) -> None:
        reply = replies[0]
        if isinstance(reply, Exception):
            return
        self.answered = True
        self.lost = list(reply or [])


class Claims:
    """Heartbeat and reclaim for one consumer of one request stream."""

    def __init__(self, client, stream: str, group: str, consumer: str, config: ClaimConfig,
                 result_prefix: str = RESULT_PREFIX) -> None:
        self.client = client
        self.stream, self.group, self.consumer = stream, group, consumer
        self.config = config
        self.result_prefix = result_prefix
        self._script = client.register_script(_HEARTBEAT)
        self._cursor = "0-0"  # XAUTOCLAIM's scan position
        self._next_heartbeat = 0.0
        self._next_scan = 0.0

    # ---- heartbeat ------------------------------------------------------------------------------
    def heartbeat_due(self, now: float) -> bool:
        return self.config.enabled and now >= self._next_heartbeat

    def heartbeat(self, entry_ids: list, now: float) -> HeartbeatRider:
        """A rider for the next result pipeline that refreshes entry_ids (call when due); once it
        is answered, pass its `sent_at` to `heartbeat_sent`."""
        rider = HeartbeatRider(self._script, self.stream, self.group, self.consumer, now)
        rider.entry_ids = list(entry_ids)
        return rider

    def heartbeat_sent(self, now: float) -> None:
        self._next_heartbeat = now + self.config.heartbeat_ms / 1000

    # ---- reclaim --------------------------------------------------------------------------------
    def scan_due(self, now: float) -> bool:
        return self.config.enabled and now >= self._next_scan

    def reclaim(self, count: int, now: float) -> list[ClaimedEntry]:
        """Claim up to `count` entries idle past idle_ms, with their resume points (two round trips)."""
        reply = self.client.xautoclaim(self.stream, self.group, self.consumer, self.config.idle_ms,
                                       start_id=self._cursor, count=count)
        cursor, entries = reply[0], reply[1]
        self._cursor = cursor.decode() if isinstance(cursor, bytes) else cursor
        # A pass over the pending list ends when the cursor wraps; until then, go on next iteration.
        self._next_scan = now + (self.config.scan_ms / 1000 if self._cursor == "0-0" else 0.0)
        claimed = []
        if any(entry_id is None for entry_id, _ in entries):  # Redis 6.2: a deleted entry comes back as nil
            entries = [(i, f) for i, f in entries if i is not None]
            claimed += self._deleted_pending()
        if not entries:
            return claimed
        pipe = self.client.pipeline(transaction=False)
        for entry_id, fields in entries:
            pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
            request_id = _field(fields, "id")
            if request_id is not None:
                pipe.xrange(result_key(request_id, self.result_prefix))
        replies = iter(pipe.execute(raise_on_error=False))
        for entry_id, fields in entries:
            pending = next(replies)
            deliveries = pending[0]["times_delivered"] if isinstance(pending, list) and pending else 1
            resume = None
            if _field(fields, "id") is not None:
                results = next(replies)
                try:
                    if not isinstance(results, Exception):
                        resume = replay_results([ResultEntry.from_fields(f) for _, f in results])
                except (ResultGapError, ValueError, KeyError):
                    resume = None
            claimed.append(ClaimedEntry(entry_id, fields or None, resume, int(deliveries)))
        return claimed

    def _deleted_pending(self) -> list[ClaimedEntry]:
        """Our pending ids whose entries are gone, for the caller to acknowledge: XAUTOCLAIM on
        Redis 6.2 claims a deleted entry but names it only as nil."""
        pending = self.client.xpending_range(self.stream, self.group, min="-", max="+",
                                             count=10_000, consumername=self.consumer)  # rare path
        ids = [p["message_id"] for p in pending]
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.stream, min=entry_id, max=entry_id, count=1)
        return [ClaimedEntry(entry_id, None, None, 0)
                for entry_id, found in zip(ids, pipe.execute(raise_on_error=False)) if found == []]


def _field(fields: dict | None, name: str) -> str | None:
    if not fields:
        return None
    value = fields.get(name.encode(), fields.get(name))
    return value.decode(errors="replace") if isinstance(value, bytes) else value
