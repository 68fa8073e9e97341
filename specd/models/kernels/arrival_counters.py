"""Arrival counters: how the last program of a group to finish knows it is the last.

A kernel whose programs each store a partial result (attention's key chunks, a split-K GEMM's K
ranges) can finish the job in the group's last program instead of a second kernel: every program
stores its partial, then counts itself in with an atomic add (acq_rel: its stores are released
with the count, and the last one sees every other's); the program that reads count == group size
- 1 combines the partials and sets the counter back to 0 before the kernel ends.

Ownership: one set per (owner, purpose), the owner being the caller's object that serialises its
kernels (fused_forward passes its PagedKVCache: one model's layers run one after another on one
stream, and each group's last program resets its counter, so one buffer serves every layer and
replay). Two owners never share: the in-process pipeline's drafter and target may run at the same
time on two streams, and shared counters would count each other's programs. Callers that pass no
owner share one set (tests, one model).
Per size, never grown in place: a captured graph keeps the buffer's address, so replacing it with
a bigger one would leave older graphs counting in freed memory. And never allocated while
capturing: a torch.zeros there is a memset node in every replay, from the graph's pool; the eager
warm-up runs before each capture (cuda_graphs.py) allocate it.
"""

from __future__ import annotations

import weakref

import torch

_counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHARED = type("SharedCounters", (), {})()  # the owner of callers that pass none (object() takes no weakref)


def arrival_counters(owner: object | None, purpose: str, device: torch.device | str, size: int) -> torch.Tensor:
    """owner's zeroed int32 counters [size] for purpose on device (see above), made at first use."""
    buffers = _counters.setdefault(_SHARED if owner is None else owner, {})
    key = (purpose, torch.device(device), size)
    if key not in buffers:
        if key[1].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{purpose}: arrival counters must be allocated before a CUDA graph capture "
                               "(run the layout once eagerly first)")
        buffers[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buffers[key]
