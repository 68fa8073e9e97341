"""A draft head's forwards (EAGLE-3, MTP) through fixed shapes, replayed as CUDA graphs on CUDA.

Why: a head is one decoder layer, ~40 kernels a forward, each a launch of 10-40 us of host time on
the GPU machines, plus BatchKV's host work, against ~0.1-0.3 ms to read its weights at 8B: run
eagerly, an 8B EAGLE-3 drafter took ~6 ms of its own per round trip at batch 1, k = 3 (H100), where
its device work is ~1 ms.

`HeadGraphs.forward` maps a batch onto a layout (B, Q, NB): the batch padded to a bucket size B, Q
new positions a sequence (1 for a draft step; a catch-up's longest, rounded up to a power of two up
to MAX_STATIC_QUERY), block tables padded to a bucketed width NB (graph_layout.py). One packed int64
buffer a layout holds the integer inputs and takes one host-to-device copy a forward; the hidden
rows are copied in on the device. The output is the head's hidden state at each sequence's last new
position, [B, H].

On CPU, and where a capture failed, the same body runs eagerly through the same buffers, so tests
compare the captured code's drafts with the eager path's. When HeadKVCache reallocates its pools
(its generation moves), the graphs are dropped and captured again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from specd.models.graph_layout import batch_buckets, width_bucket
from specd.proposers.head_kv import HeadKVCache, StaticBatchKV

logger = logging.getLogger(__name__)

MAX_STATIC_QUERY = 16  # catch-ups of up to 15 accepted drafts + 1; a prompt's takes the eager path
MAX_STATIC_CONTEXT = 8192  # positions gathered a sequence; beyond, the eager path
MAX_STATIC_BATCH = 128


@dataclass
class _Layout:
    """One (B, Q, NB) layout's static buffers; `graph` once captured (CUDA)."""

    batch: int
    qlen: int
    width: int
    packed: torch.Tensor  # int64 [B*Q ids | B*NB table | B past | B new | B*Q hidden rows]
    hidden: torch.Tensor  # [B*Q, H]
    last: torch.Tensor | None = None  # [B, H] output
    graph: torch.cuda.CUDAGraph | None = None
    capture_tried: bool = False

    def views(self) -> tuple[torch.Tensor, ...]:
        b, q, nb = self.batch, self.qlen, self.width
        ids, table, past, new, rows = self.packed.split([b * q, b * nb, b, b, b * q])
        return ids.view(b, q), table.view(b, nb), past, new, rows


class HeadGraphs:
    """Fixed-shape forwards of `head` (module doc) over `cache`; CUDA graphs when `use_cuda_graphs`
    and the cache is on CUDA."""

    def __init__(self, head: nn.Module, cache: HeadKVCache, dtype: torch.dtype,
                 use_cuda_graphs: bool = True, max_batch_size: int = MAX_STATIC_BATCH) -> None:
        if cache.block_size < MAX_STATIC_QUERY:  # a row's padding entries go to the scratch block's slots
            raise ValueError(f"kv_block_size: the fixed-shape forwards need blocks of at least "
                             f"{MAX_STATIC_QUERY} positions, got {cache.block_size}")
        self.head = head
        self.cache = cache
        self.dtype = dtype
        self.device = cache.device
        self.buckets = batch_buckets(max_batch_size)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self._layouts: dict[tuple[int, int, int], _Layout] = {}
        self._generation = cache.generation
        self._pool = None  # one memory pool for every graph (they never run concurrently)
        self.num_static_forwards = 0  # counters the tests and the bench read
        self.num_captures = 0
        self.num_capture_failures = 0
        self.capture_seconds = 0.0

    def layout(self, past_lens: list[int], query_lens: list[int]) -> tuple[int, int, int] | None:
        """(B, Q, NB) of this batch, or None where it does not fit (the eager path takes it)."""
        qlen = max(query_lens)
        batch = next((b for b in self.buckets if b >= len(query_lens)), None)
        longest = max(p + q for p, q in zip(past_lens, query_lens))
        if batch is None or qlen > MAX_STATIC_QUERY or longest > MAX_STATIC_CONTEXT:
            return None
        qlen = 1 << (qlen - 1).bit_length()
        return batch, qlen, width_bucket(-(-longest // self.cache.block_size))

    def forward(self, handles: list[int], past_lens: list[int], query_lens: list[int],
                ids: list[list[int]] | torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """The head over a batch: sequence i brings query_lens[i] new positions after past_lens[i]
        cached ones; ids: their token ids (host lists, or a device tensor [n] when each brings one),
        rows [sum(query_lens), H]: their hidden inputs in order. Returns the head's output at each
        sequence's last new position [n, H], a view of a static buffer that the next forward of the
        same layout overwrites; None where the batch does not fit (nothing was run)."""
        key = self.layout(past_lens, query_lens)
        if key is None:
            return None
        for h, p, q in zip(handles, past_lens, query_lens):
            self.cache.reserve(h, p + q)
        self.cache.grow()
        if self.cache.generation != self._generation:  # the pools moved: the graphs read the old
            self.drop_graphs()
            self._generation = self.cache.generation
        entry = self._layouts.get(key) or self._new_layout(*key, rows.shape[1])
        if self.use_cuda_graphs and not entry.capture_tried and self.cache.pools is not None:
            self._capture(entry)  # (the pools exist once a first forward has run)
        self._fill(entry, handles, past_lens, query_lens, ids, rows)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._body(entry)
        self.num_static_forwards += 1
        return entry.last[:len(handles)]

    def drop_graphs(self) -> None:
        self._layouts.clear()
        self._pool = None  # torch frees a private pool with its last graph

    # ---- buffers -------------------------------------------------------------------------------
    def _new_layout(self, batch: int, qlen: int, width: int, hidden_size: int) -> _Layout:
        size = batch * qlen * 2 + batch * width + 2 * batch
        entry = _Layout(batch, qlen, width, torch.zeros(size, dtype=torch.long, device=self.device),
                        torch.zeros(batch * qlen, hidden_size, dtype=self.dtype, device=self.device))
        self._layouts[(batch, qlen, width)] = entry
        return entry

    def _fill(self, entry: _Layout, handles: list[int], past_lens: list[int], query_lens: list[int],
              ids: list[list[int]] | torch.Tensor, rows: torch.Tensor) -> None:
        """The batch into the layout's buffers: one host-to-device copy of the integers, then the
        hidden rows (and device ids) by device copies."""
        b, q, nb, n = entry.batch, entry.qlen, entry.width, len(handles)
        host = torch.zeros(entry.packed.shape[0], dtype=torch.long)
        ids_h, table_h, past_h, new_h, rows_h = host.split([b * q, b * nb, b, b, b * q])  # padding: 0
        table_h.view(b, nb)[:n] = self.cache.block_tables(handles, nb)
        past_h[:n] = torch.tensor(past_lens)
        new_h[:n] = torch.tensor(query_lens)
        flat = [i * q + j for i, m in enumerate(query_lens) for j in range(m)]
        rows_h[:len(flat)] = torch.tensor(flat)
        if not isinstance(ids, torch.Tensor):
            ids_h.view(b, q)[:n] = torch.tensor([t + [0] * (q - len(t)) for t in ids])
        entry.packed.copy_(host, non_blocking=True)  # pageable: staged before it returns
        if isinstance(ids, torch.Tensor):
            entry.views()[0][:n, 0].copy_(ids)
        entry.hidden.index_copy_(0, entry.views()[4][:len(flat)], rows.to(self.dtype))

    def _body(self, entry: _Layout) -> None:
        ids, table, past, new, _ = entry.views()
        kv = StaticBatchKV(self.cache, table, past, new, entry.qlen)
        positions = past[:, None] + torch.arange(entry.qlen, device=self.device)  # [B, Q]
        hidden = entry.hidden.view(entry.batch, entry.qlen, -1)
        out = self.head(ids, hidden, positions, kv)  # [B, Q, H]
        last = (new - 1).clamp(min=0)
        entry.last = out[torch.arange(entry.batch, device=self.device), last]  # [B, H]

    # ---- capture -------------------------------------------------------------------------------
    def _capture(self, entry: _Layout) -> None:
        """Warm up on a side stream (lazy initialisation must not be captured), then capture.
        A layout whose capture fails runs its body eagerly from then on; a failure other than
        memory (an op a graph cannot hold, as the MoE routing of some MTP layers may be) turns
        the graphs off for every layout."""
        t0 = time.perf_counter()
        entry.capture_tried = True
        entry.packed.zero_()  # all padding (SCRATCH_BLOCK is 0): the warm-up writes scratch only
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._body(entry)  # all-padding inputs: it writes the scratch block only
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._body(entry)
        except Exception as err:  # noqa: BLE001 - any capture failure leaves the layout eager
            self.num_capture_failures += 1
            if not isinstance(err, torch.OutOfMemoryError):
                self.use_cuda_graphs = False
            if not any(e.graph for e in self._layouts.values()):
                self._pool = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            logger.warning("draft head CUDA graph batch=%d q=%d blocks=%d not captured (%s): %s",
                           entry.batch, entry.qlen, entry.width, err,
                           "this layout runs eagerly" if self.use_cuda_graphs else "the head runs eagerly")
            return
        entry.graph = graph
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - t0
        logger.info("captured draft head CUDA graph batch=%d q=%d blocks=%d", entry.batch,
                    entry.qlen, entry.width)
