"""Which waiting requests start now (SpecEngine.admit's choice, before their prefill)."""

from __future__ import annotations

from collections import deque

from specd.engine.sequence import Sequence
from specd.models.base import TargetRunner


def take_admissions(waiting: deque[Sequence], running: list[Sequence], runner: TargetRunner, *,
                    max_batch_size: int, max_prefill_tokens: int, num_speculative_tokens: int,
                    max_model_len: int) -> list[Sequence]:
    """Pop from the front of `waiting` the sequences that start now, their caches added in the
    runner: while the batch has room, within the prefill token budget (the first one always),
    and while the cache has room, planned together: the running sequences' next token first (an
    admission never forces a preemption), then each admitted prompt and its first drafts. Raises
    where the cache cannot hold a single request."""
    admitted: list[Sequence] = []
    budget = max_prefill_tokens
    plan = runner.plan_appends()
    for s in running:
        plan.take(s.seq_id, 1)
    while waiting and len(running) + len(admitted) < max_batch_size:
        seq = waiting[0]
        if admitted and seq.num_tokens > budget:
            break
        runner.add_sequence(seq.seq_id)
        # Its prompt and first drafts; a sequence never caches more than the context length
        # less one (the last token is sampled, not cached), so a prompt near it still fits.
        need = min(seq.num_tokens + num_speculative_tokens, max_model_len - 1)
        if not plan.take(seq.seq_id, need):
            runner.free(seq.seq_id)
            if not running and not admitted:
                raise RuntimeError("the KV cache cannot hold a single request; raise num_gpu_blocks")
            break
        waiting.popleft()
        budget -= seq.num_tokens
        admitted.append(seq)
    return admitted


def defer_shared_prompts(admitted: list[Sequence], waiting: deque[Sequence], runner: TargetRunner,
                         block_size: int, prefill_tokens) -> list[Sequence]:
    """Of sequences admitted together, those whose prompt starts with the same uncached block as
    an earlier one go back to the front of the queue (their caches freed): admitted a step later,
    they find that prompt in the prefix cache instead of prefilling it again (n choices of one
    request, the same system prompt arriving at once). prefill_tokens(seq): what it would prefill."""
    kept, deferred, firsts = [], [], set()
    for seq in admitted:
        tokens = prefill_tokens(seq)
        first = tuple(tokens[:block_size]) if len(tokens) > block_size else None
        if first is not None and first in firsts and kept and not runner.first_block_cached(tokens):
            runner.free(seq.seq_id)
            deferred.append(seq)
            continue
        if first is not None:
            firsts.add(first)
        kept.append(seq)
    waiting.extendleft(reversed(deferred))
    return kept
