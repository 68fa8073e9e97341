"""The capture of one stretch of stream work into a CUDA graph (cuda_graphs.py's captures).

What torch.cuda.graph does (synchronise, hand the allocator's cached blocks back, capture on a
side stream into the given pool), with the graph kept in `graphs` (StaticEntry replays them in
order; one graph since the two-part capture was removed: BENCHMARKS.md, "Tried and removed").
"""

from __future__ import annotations

import torch


class GraphChain:
    """`with chain:` captures the stream work inside into one CUDA graph in `pool` (graphs[0]),
    as torch.cuda.graph does."""

    def __init__(self, pool, device: torch.device, debug: bool = False) -> None:
        self.pool = pool
        self.debug = debug
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._stream = torch.cuda.Stream(device)
        self._stream_ctx = None

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        if self.debug:
            graph.enable_debug_mode()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def __enter__(self) -> "GraphChain":
        torch.cuda.synchronize()
        # A graph allocates from its private pool only: blocks the allocator keeps cached for
        # ordinary tensors (an eager prefill's activations) are out of its reach until handed back.
        # (An 8B capture at batch 128 ran out of memory for 252 MB with 6.7 GB cached this way.)
        torch.cuda.empty_cache()
        self._stream_ctx = torch.cuda.stream(self._stream)
        self._stream_ctx.__enter__()
        self._begin()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.graphs[-1].capture_end()
        except Exception:
            if exc[0] is None:
                raise
            # The body's error (an OOM: StaticForward leaves that layout eager) is the one to
            # raise; ending the capture it broke may fail as well.
        finally:
            self._stream_ctx.__exit__(*exc)
