"""A kernel setting that a runner applies to the thread running its forward, and to it alone.

Why per thread: a runner sets its GEMM backend and PDL mode around each forward
(and each CUDA-graph capture, which keeps what was set then). As module globals, two runners
forwarding on two threads of one process (an in-process drafter server beside an engine, as the
service tests run them) interleaved their saves and restores, and a setting leaked out of its
scope: a later forward outside any runner ran under "auto" instead of the plain default.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadSetting(Generic[T]):
    """`get()`: this thread's value (`default` outside any scope); `swap(v)` sets it, returning the
    previous value, which the scope's exit swaps back."""

    def __init__(self, default: T) -> None:
        self.default = default
        self._local = threading.local()

    def get(self) -> T:
        return getattr(self._local, "value", self.default)

    def swap(self, value: T) -> T:
        previous = self.get()
        self._local.value = value
        return previous
