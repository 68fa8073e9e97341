"""The verify / decode step through static buffers, replayed as CUDA graphs on CUDA.

A verify step appends k+1 tokens per sequence (decode: 1) to caches of varying length; a CUDA graph
needs fixed shapes. `StaticForward` maps a batch onto a fixed layout (static_attention.py): the
batch padded to a bucket size B (1, 2, 4, ..., max_batch_size), Q rows per sequence (the longest
chunk), block tables padded to a bucketed width NB. One packed int64 buffer holds every input and is
filled by ONE host-to-device copy a step, the graph's first node, from a pinned host buffer: a
step's fill is numpy writes, and the replay is the step's one CUDA call before its kernels (each
call costs 10-40 us of host time on the H200 machine). An event recorded after the copy node
guards the buffer when the host runs a whole step ahead of the device.

For each (B, Q, NB, aux layers) key the first batch that needs it captures a graph (CUDA) or, on
CPU and with graphs off, runs the same body eagerly, so CPU tests prove the static path's logits
equal the eager path's. `fused` runs the body through specd's Triton kernels (fused_forward.py);
the PyTorch body (LlamaForCausalLM.forward) is its twin. Padding rows and slots write to the KV
cache's scratch block.

A prefill (chunk longer than `max_query_len`) has Q rounded up to a power of two and runs static
while B * Q stays within `max_prefill_rows`: the eager path costs ~40 ms of Python and launches a
forward at 8B whatever the prompt's length (BENCHMARKS.md, "Verify step (GPU)"), which at batch 1
weighs on every first token. Longer prefills, batches above the largest bucket and contexts above
`max_context` take the eager path (`applies` says which).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from specd import settings
from specd.models.fused_forward import fused_forward
from specd.models.graph_chain import GraphChain
from specd.models.graph_layout import batch_buckets, width_bucket
from specd.models.kv_cache import PagedKVCache
from specd.models.static_attention import StaticAttentionMetadata
from specd.models.static_entry import PreparedBatch, StaticEntry

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUERY_LEN = 16  # k + 1 up to 15 drafts; longer chunks are prefill-like (Q bucketed)
# Prefill-like batches go static while B * Q (Q rounded up to a power of two) stays within this: at
# 256 rows a 128K-vocab graph holds 131 MB of logits, and at most 10 (B, Q) prefill buckets exist.
DEFAULT_MAX_PREFILL_ROWS = 256
DEFAULT_MAX_CONTEXT = 8192  # tokens gathered per slot; beyond, the eager path (no graph)
# A diagnostic (read at capture): a directory to dump each captured graph into
# (CUDAGraph.debug_dump: its nodes and edges, as DOT).


class StaticForward:
    """Fixed-shape forwards of a LlamaForCausalLM over a PagedKVCache (see the module doc)."""

    def __init__(self, model, kv_cache: PagedKVCache, *, max_batch_size: int,
                 use_cuda_graphs: bool, max_query_len: int = DEFAULT_MAX_QUERY_LEN,
                 max_context: int = DEFAULT_MAX_CONTEXT, fused: bool = False, max_prefill_rows: int = DEFAULT_MAX_PREFILL_ROWS) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.buckets = batch_buckets(max_batch_size)
        self.max_query_len = max_query_len
        self.max_prefill_rows = max_prefill_rows
        self.max_context = max_context
        self.device = kv_cache.device
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.fused = fused
        self._entries: dict[tuple, StaticEntry] = {}
        self._prefill_prepared: set[tuple[int, ...]] = set()  # aux-layer sets whose prefill layouts exist
        self._pool = None  # one memory pool shared by every graph (they never run concurrently)
        # Chunk i's first token where >= 0, over the host's placeholder (LlamaRunner.forward's
        # first_token_ids): every graph reads it after its input copy, so a token sampled on the
        # device one step earlier feeds this step without a trip through the host.
        self.first_tokens = torch.full((self.buckets[-1],), -1, dtype=torch.int64, device=self.device)
        self._first_tokens_set = False  # first_tokens holds a batch's tokens (else all -1)
        self.num_static_forwards = 0  # counters the tests and the bench read
        self.num_captures = 0
        self.num_capture_failures = 0  # layouts left without a graph: it did not fit (_capture_failed)
        self.capture_seconds = 0.0  # warm-up + capture, all graphs: the loop stalls that long

    @property
    def copy_in_graph(self) -> bool:
        """Whether new layouts' graphs copy their inputs in the replay (under CUDA graphs)."""
        return self.use_cuda_graphs

    # ---- layout --------------------------------------------------------------------------------
    def _bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def _width(self, ctx_lens: list[int], qlen: int) -> int:
        # Keys up to ctx + Q - 1: padding rows reach past a short chunk's end (see static_attention).
        return width_bucket(-(-(max(ctx_lens) + qlen) // self.block_size))

    def _qlen(self, query_lens: list[int]) -> int:
        """Q of the batch: its longest chunk, rounded up to a power of two past max_query_len (so
        prefills of any length share a few graphs)."""
        qlen = max(query_lens)
        return qlen if qlen <= self.max_query_len else 1 << (qlen - 1).bit_length()

    def applies(self, query_lens: list[int], ctx_lens: list[int]) -> bool:
        """Whether this batch (tokens per chunk, cached tokens before it) fits the static path."""
        return self.layout(query_lens, ctx_lens) is not None

    def layout(self, query_lens: list[int], ctx_lens: list[int]) -> tuple[int, int, int] | None:
        """(B, Q, NB) of this batch, or None where it does not fit the static path."""
        qlen, batch = self._qlen(query_lens), self._bucket(len(query_lens))
        if batch is None or (qlen > self.max_query_len and batch * qlen > self.max_prefill_rows):
            return None
        width = self._width(ctx_lens, qlen)
        return (batch, qlen, width) if width * self.block_size <= self.max_context else None

    def _new_entry(self, batch: int, qlen: int, width: int, copy_in_graph: bool | None = None) -> StaticEntry:
        return StaticEntry.new(batch, qlen, width, self.device, self.kv_cache.scratch_block, self.block_size,
                               self.copy_in_graph if copy_in_graph is None else copy_in_graph)

    def _fill(self, entry: StaticEntry, token_ids: list[list[int]], ctx_lens: list[int],
              slots: list[list[int]], block_tables: list[list[int]]) -> int:
        """Write one batch into the entry's buffers (one host-to-device copy on CUDA: the graph's
        own first node, else here; no device synchronisation); returns T, the number of real
        tokens (the first T gather rows)."""
        if entry.copied is not None and not entry.copied.query():
            entry.copied.synchronize()  # the last replay has not read the pinned buffer yet
        entry.host_array[:] = entry.blank
        ids, pos, slot, ctx, tables, rows = entry.host_views
        q, num_seqs = entry.qlen, len(token_ids)
        if num_seqs:
            # Whole-batch numpy writes, not six small ones per sequence (74 -> ~25 us at batch
            # 64 on the CPU here; on every step's critical path before the replay).
            ctx[:num_seqs] = ctx_lens
            pos[:num_seqs * q].reshape(num_seqs, q)[:] += ctx[:num_seqs, None]
            pad = self.kv_cache.scratch_block
            tables[:num_seqs] = [t + [pad] * (entry.width - len(t)) for t in block_tables]
        total = self._write_token_ids(entry, token_ids)
        if total == num_seqs * q:  # a verify / decode batch: every chunk full
            slot[:total] = [x for s in slots for x in s]
            rows[:total] = entry.row_numbers[:total]
        else:  # prefill-like: chunks of different lengths padded to Q rows each
            done = 0
            for i, s in enumerate(slots):
                n, row = len(s), i * q
                slot[row:row + n] = s
                rows[done:done + n] = np.arange(row, row + n)
                done += n
        self._copy_if_eager(entry)
        return total

    def _write_token_ids(self, entry: StaticEntry, token_ids: list[list[int]]) -> int:
        """The chunks' token ids into the host buffer (chunk i's at rows i * Q .. when they are
        not all Q long); returns T, the number of real tokens."""
        ids, q = entry.host_views[0], entry.qlen
        total = sum(map(len, token_ids))
        if total == len(token_ids) * q:
            ids[:total] = [t for toks in token_ids for t in toks]
        else:
            for i, toks in enumerate(token_ids):
                ids[i * q:i * q + len(toks)] = toks
        return total

    def _copy_if_eager(self, entry: StaticEntry) -> None:
        if entry.host is not entry.packed and not entry.copy_in_graph:
            # Eager on CUDA: from pageable memory the driver stages the bytes before returning, so
            # the host buffer may be rewritten at once, no event needed. (Graphs copy in the replay.)
            entry.packed.copy_(entry.host, non_blocking=True)

    def _copy_inputs(self, entry: StaticEntry) -> None:
        """The fill's copy as captured: pinned host -> device, then the event that frees the host side."""
        entry.packed.copy_(entry.host, non_blocking=True)
        entry.copied.record()

    def _padding_fill(self, entry: StaticEntry) -> None:
        """Inputs of an all-padding batch: what warm-up and capture run on (writes scratch only)."""
        self._fill(entry, [], [], [], [])

    # ---- running -------------------------------------------------------------------------------
    def _body(self, entry: StaticEntry, aux_layer_ids: tuple[int, ...]) -> None:
        """The forward over the entry's buffers."""
        input_ids, positions, slots, ctx_lens, tables, _ = entry.views()
        first = input_ids.view(entry.batch, entry.qlen)[:, 0]  # [B], a view: written in place
        carried = self.first_tokens[:entry.batch]
        first.copy_(torch.where(carried >= 0, carried, first))
        meta = StaticAttentionMetadata(ctx_lens=ctx_lens, block_tables=tables, slot_mapping=slots,
                                       query_len=entry.qlen, block_size=self.block_size)
        if self.fused:
            hidden, aux = fused_forward(self.model, input_ids, positions, meta, self.kv_cache, aux_layer_ids)
        else:
            hidden, aux = self.model(input_ids, positions, meta, self.kv_cache, aux_layer_ids)
        entry.hidden, entry.aux = hidden, aux
        entry.logits = self.model.compute_logits(hidden)  # [B * Q, V] float32

    def _entry(self, batch: int, qlen: int, width: int, aux_layer_ids: tuple[int, ...]) -> StaticEntry:
        key = (batch, qlen, width, aux_layer_ids)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(batch, qlen, width)
            if self.use_cuda_graphs:
                try:
                    self._capture(entry, aux_layer_ids)
                except torch.OutOfMemoryError:
                    entry = self._capture_failed(batch, qlen, width)
            self._entries[key] = entry
        return entry

    def _capture_failed(self, batch: int, qlen: int, width: int) -> StaticEntry:
        """A layout whose graph did not fit in memory runs its body eagerly through the same
        buffers from now on (captures happen mid-serving, as new layouts come: a step that fails
        there fails every request the engine holds). Outside a capture the allocator can hand its
        cached blocks back and retry, which a capture cannot; the eager body frees as it goes."""
        self.num_capture_failures += 1
        if not any(e.graphs for e in self._entries.values()):
            self._pool = None  # the failed graph took its pool with it (see drop_graphs)
        torch.cuda.empty_cache()
        logger.warning("CUDA graph batch=%d q=%d blocks=%d did not fit in memory: this layout runs "
                       "without a graph (slower); lower cache_max_entry_count to leave graphs room",
                       batch, qlen, width)
        return self._new_entry(batch, qlen, width, copy_in_graph=False)

    def prefill_layouts(self) -> list[tuple[int, int]]:
        """Every (B, Q) a prefill may take: Q a power of two past max_query_len, B * Q within
        max_prefill_rows."""
        out = []
        for batch in self.buckets:
            qlen = 1 << self.max_query_len.bit_length()  # the first power of two past max_query_len
            while batch * qlen <= self.max_prefill_rows:
                out.append((batch, qlen))
                qlen *= 2
        return out

    def _prepare_prefill_layouts(self, aux_layer_ids: tuple[int, ...]) -> None:
        """At the first prefill, capture (CUDA) or allocate every prefill layout of fresh sequences
        (no cached context: their width follows from Q) at once. Why: which (B, Q) a prefill takes
        depends on how requests happen to arrive together, so lazy captures (~0.5 s each at 8B)
        would land on later requests, at random; at most 10 of them cost once, up front."""
        if aux_layer_ids in self._prefill_prepared:
            return
        self._prefill_prepared.add(aux_layer_ids)
        for batch, qlen in self.prefill_layouts():
            self._entry(batch, qlen, self._width([0], qlen), aux_layer_ids)

    def drop_graphs(self) -> None:
        """Forget every captured graph and its buffers; the next batches capture again (what a
        changed launch setting, e.g. kernels/pdl.py's, needs: a graph keeps its capture's)."""
        self._entries.clear()
        self._prefill_prepared.clear()
        # The pool went with its last graph (torch frees a private pool whose graphs are all gone);
        # capturing into its stale handle trips the allocator's use-count assert.
        self._pool = None

    def _capture(self, entry: StaticEntry, aux_layer_ids: tuple[int, ...]) -> None:
        """Warm up on a side stream (lazy kernel and cuBLAS init must not be captured), then capture."""
        t0 = time.perf_counter()
        self._padding_fill(entry)
        if entry.copy_in_graph:
            entry.packed.copy_(entry.host)  # the padding batch (the captured copy runs at each replay)
            # external: recorded as a node of the graph (a plain event would be a capture-internal edge)
            entry.copied = torch.cuda.Event(external=True)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                self._body(entry, aux_layer_ids)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        chain = GraphChain(self._pool, self.device, debug=bool(settings.GRAPH_DEBUG_DIR.get()))
        with chain, torch.no_grad():
            if entry.copy_in_graph:
                self._copy_inputs(entry)
            self._body(entry, aux_layer_ids)
        debug_dir = settings.GRAPH_DEBUG_DIR.get()
        if debug_dir:
            os.makedirs(debug_dir, exist_ok=True)
            for part, graph in enumerate(chain.graphs):
                graph.debug_dump(os.path.join(
                    debug_dir, f"graph-{self.num_captures}-b{entry.batch}-q{entry.qlen}-part{part}.dot"))
        entry.graphs = tuple(chain.graphs)
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - t0
        logger.info("captured CUDA graph batch=%d q=%d blocks=%d aux=%s parts=%d", entry.batch, entry.qlen,
                    entry.width, list(aux_layer_ids), len(entry.graphs))

    def forward(self, token_ids: list[list[int]], ctx_lens: list[int], slots: list[list[int]],
                block_tables: list[list[int]], aux_layer_ids: tuple[int, ...] = (), want_hidden: bool = True,
                layout: tuple[int, int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Run one batch (its slots already reserved in the cache); rows of the real tokens only.

        token_ids[i], slots[i]: chunk i's new tokens and their cache slots; ctx_lens[i]: tokens
        cached before them; block_tables[i]: the sequence's blocks (covering the new tokens).
        Returns (logits [T, V] float32, hidden [T, H] or None unless want_hidden, aux
        [T, n_aux * H] or None), T = all new tokens in chunk order: fresh tensors, not views of
        the static outputs. layout: what layout() said for this batch, if the caller asked already.
        """
        return self.run(self.prepare(token_ids, ctx_lens, slots, block_tables, aux_layer_ids, layout),
                        want_hidden)

    def prepare(self, token_ids: list[list[int]], ctx_lens: list[int], slots: list[list[int]],
                block_tables: list[list[int]], aux_layer_ids: tuple[int, ...] = (),
                layout: tuple[int, int, int] | None = None) -> PreparedBatch:
        """forward's host work before the launch: the batch written into its layout's buffers
        (captured first where the layout is new). Nothing reads them until `run`; until then
        `rewrite_token_ids` may replace the token ids (the same chunk lengths)."""
        layout = layout or self.layout([len(t) for t in token_ids], ctx_lens)
        if layout is None:
            raise ValueError("StaticForward.forward: the batch is outside its buckets (see applies)")
        batch, qlen, width = layout
        aux_layer_ids = tuple(aux_layer_ids)
        if qlen > self.max_query_len:
            self._prepare_prefill_layouts(aux_layer_ids)
        entry = self._entry(batch, qlen, width, aux_layer_ids)
        total = self._fill(entry, token_ids, ctx_lens, slots, block_tables)
        return PreparedBatch(entry, aux_layer_ids, total, tuple(map(len, token_ids)))

    def rewrite_token_ids(self, prepared: PreparedBatch, token_ids: list[list[int]]) -> None:
        """Replace a prepared batch's token ids (chunk lengths as prepared): a verify step staged
        before its drafts arrived (LlamaRunner.stage)."""
        if tuple(map(len, token_ids)) != prepared.chunk_lens:
            raise ValueError(f"rewrite_token_ids: chunk lengths {[len(t) for t in token_ids]}, "
                             f"prepared {list(prepared.chunk_lens)}")
        self._write_token_ids(prepared.entry, token_ids)
        self._copy_if_eager(prepared.entry)

    def run(self, prepared: PreparedBatch, want_hidden: bool = True, logit_rows: list[int] | None = None,
            first_token_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Launch a prepared batch; its outputs as forward returns them. logit_rows: the logits of
        these rows of the batch only (each chunk's last: ForwardOutput.last_logits_only); the
        graph's lm_head covers every row all the same (a static prefill is 256 rows at most).
        first_token_ids: [num_chunks] on the device, chunk i's first token where >= 0."""
        entry = prepared.entry
        if first_token_ids is not None or self._first_tokens_set:
            self.first_tokens.fill_(-1)
            if first_token_ids is not None:
                self.first_tokens[:first_token_ids.numel()].copy_(first_token_ids)
            self._first_tokens_set = first_token_ids is not None
        if entry.graphs:
            for graph in entry.graphs:
                graph.replay()
        else:
            with torch.no_grad():
                self._body(entry, prepared.aux_layer_ids)
        self.num_static_forwards += 1
        index = entry.real_rows[:prepared.total]  # on the device already: the fill's copy carried it
        # index_select copies: the static outputs are overwritten by the next replay, while the
        # engine keeps hidden rows across steps (drafter features). Each gather is a launch on
        # the step's critical path: only the wanted ones.
        aux = entry.aux.index_select(0, index) if entry.aux is not None else None
        hidden = entry.hidden.index_select(0, index) if want_hidden else None
        if logit_rows is not None:
            index = index.index_select(0, torch.tensor(logit_rows, device=index.device))
        return entry.logits.index_select(0, index), hidden, aux
