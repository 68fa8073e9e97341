"""LlamaRunner: the TargetRunner over our compact Llama-family model and a paged KV cache.

One `forward` runs every chunk of the batch (a 50-token prefill next to a 5-token verify chunk of
another sequence) as ONE model call over the flattened tokens; rollback of rejected drafts is a
block-table truncation (kv_cache.py), so nothing is recomputed or copied.

Verify and decode batches (every chunk at most `max_query_len` tokens, the batch within the
largest bucket), and prefills of up to `max_prefill_rows` padded rows, run through `StaticForward`
(cuda_graphs.py): captured CUDA graphs on CUDA unless `eager_mode`, and the same static-buffer code
without capture when a test asks for it on CPU.
With `tp > 1` the model is sharded over the torch.distributed group (tensor_parallel.py).
`gemm` (or SPECD_GEMM) picks the linears' kernel: "auto" takes the skinny Triton GEMM for few-row
products on CUDA (skinny_gemm.py), "torch" always F.linear; the runner holds it around its
forward and logits calls (linear.py). `kernels` (or SPECD_KERNELS) "auto" runs the static path
through specd's Triton kernels where they apply (fused_forward.py), "off" through PyTorch ops.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specd import settings
from specd.messages import PytorchEngineConfig
from specd.models.attention import AttentionMetadata
from specd.models.base import check_chunks, chunk_offsets, ForwardOutput, last_rows, ModelInfo, SequenceChunk
from specd.models.append_plan import AppendPlan
from specd.models.cuda_graphs import StaticForward
from specd.models.hf_config import LlamaArchConfig
from specd.models.kernels.pdl import pdl_launches, resolve_pdl_mode
from specd.models.kv_cache import CacheFullError, PagedKVCache
from specd.models.linear import gemm_backend, resolve_gemm_backend
from specd.models.llama import LlamaForCausalLM, load_llama
from specd.models.runner_setup import default_aux_layer_ids, kv_cache_for, select_device, select_dtype
from specd.models.static_entry import PreparedBatch


class LlamaRunner:
    """TargetRunner for LlamaForCausalLM / Qwen2 / Qwen3 / Mistral checkpoints."""

    takes_first_token_ids = True  # forward reads chunks' first tokens from the device (base.py)

    def __init__(self, model_dir: str | Path, engine_config: PytorchEngineConfig | None = None, *,
                 model: LlamaForCausalLM | None = None, config: LlamaArchConfig | None = None,
                 use_static_path: bool | None = None, gemm: str | None = None, kernels: str | None = None, pdl: str | None = None,
                 kv_cache: PagedKVCache | None = None) -> None:
        """model/config: an already built model (the bench's random weights) instead of loading.
        kv_cache: another runner's cache over the same model, shared (the step bench times three
        paths one at a time: one 8B cache of 18 GB at batch 128, not three); its shape must be
        this runner's.

        use_static_path: None follows the config (static path with CUDA graphs on CUDA unless
        eager_mode; CPU eager); True on CPU runs the static-buffer path without capture (tests).
        gemm: "auto" | "torch" (linear.py); None reads SPECD_GEMM, default "auto".
        kernels: "auto" | "off" (fused_forward.py); None reads SPECD_KERNELS, default "auto".
        pdl: "auto" | "off" (kernels/pdl.py); None reads SPECD_PDL, default "auto".
        """
        kernels = kernels or settings.KERNELS.get()
        if kernels not in ("auto", "off"):
            raise ValueError(f"kernels: expected auto or off, got {kernels!r}")
        self.gemm = resolve_gemm_backend(gemm)
        self.pdl = resolve_pdl_mode(pdl)
        engine_config = engine_config or PytorchEngineConfig()
        self.model_dir = Path(model_dir)
        self.engine_config = engine_config
        self.config = config or LlamaArchConfig.from_model_dir(self.model_dir)
        self.parallel = None
        if engine_config.tp > 1:
            from specd.models.tensor_parallel import ParallelConfig, check_divisible

            check_divisible(self.config, engine_config.tp)
            self.parallel = ParallelConfig.from_default_group(engine_config.tp)
        self.device = select_device(engine_config)
        if self.device.type == "cuda" and self.parallel is not None:
            self.device = torch.device("cuda", self.parallel.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.dtype = select_dtype(engine_config, self.device)
        if model is None:
            model = load_llama(self.model_dir, self.config, self.dtype, self.device)
        self.model: LlamaForCausalLM = model
        if self.parallel is not None:
            from specd.models.tensor_parallel import shard_llama_

            shard_llama_(self.model, self.parallel)
        tp = engine_config.tp
        self.session_len = engine_config.session_len or self.config.max_position_embeddings
        # cos/sin of every position, gathered per step (the KV cache below is sized after it)
        self.model.model.rotary_emb.reserve(self.session_len, self.dtype)
        self.block_size = engine_config.block_size
        self.kv_cache = kv_cache_for(engine_config, self.config, self.session_len, self.dtype, self.device,
                                     tp, self.parallel, shared=kv_cache)
        if use_static_path is None:
            use_static_path = self.device.type == "cuda" and not engine_config.eager_mode
        self.static: StaticForward | None = None
        self._staged: _StagedBatch | None = None  # stage(): a verify batch waiting for its drafts
        self.num_staged_forwards = 0  # forwards that took a staged batch (tests, bench)
        self.num_eager_forwards = 0  # forwards outside the static path (a long prefill; metrics)
        # Called right before a forward's first device work, its host work done (the engine's
        # device clock marks it there: device_clock.py).
        self.on_launch: Callable[[], None] | None = None
        if use_static_path:
            from specd.models import fused_forward

            fused = kernels == "auto" and fused_forward.applies(self.model, self.kv_cache)
            self.static = StaticForward(self.model, self.kv_cache,
                                        max_batch_size=engine_config.max_batch_size,
                                        use_cuda_graphs=not engine_config.eager_mode, fused=fused)
        self.info = ModelInfo(
            vocab_size=self.config.vocab_size,
            hidden_size=self.config.hidden_size,
            num_hidden_layers=self.config.num_hidden_layers,
            max_position_embeddings=self.config.max_position_embeddings,
            eos_token_ids=list(self.config.eos_token_ids),
            architecture=self.config.architecture,
        )
        self.aux_layer_ids = default_aux_layer_ids(self.config.num_hidden_layers)

    # cache lifecycle ----------------------------------------------------------------------------
    # Each of these first undoes a staged batch (stage): the caches are then as the last forward
    # left them, whatever was staged.

    def add_sequence(self, seq_id: int) -> None:
        self.unstage()
        self.kv_cache.add_sequence(seq_id)

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        if self._staged is not None:  # (inline: asked for every sequence two or three times a step)
            self.unstage()
        within_session = self.kv_cache.num_tokens(seq_id) + num_tokens <= self.session_len
        return within_session and self.kv_cache.can_append(seq_id, num_tokens)

    @property
    def max_cached_tokens(self) -> int:
        """Tokens the whole cache holds: the longest sequence it can ever serve."""
        return self.kv_cache.num_blocks * self.block_size

    def plan_appends(self) -> AppendPlan:
        """The free blocks, for planning a step's appends together (append_plan.py)."""
        self.unstage()
        kv = self.kv_cache
        return AppendPlan(kv.allocator.num_free_blocks, kv.num_tokens, kv.num_new_blocks, self.session_len,
                          block_size=kv.block_size)

    @property
    def prefix_caching(self) -> bool:
        return self.kv_cache.prefix_caching

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """A new sequence takes the cached blocks its prompt starts with; returns their tokens
        (kv_cache.PagedKVCache.match_prefix): the prefill starts after them."""
        self.unstage()
        return self.kv_cache.match_prefix(seq_id, token_ids)

    def first_block_cached(self, token_ids: list[int]) -> bool:
        return self.kv_cache.first_block_cached(token_ids)

    def register_prefix(self, seq_id: int, token_ids: list[int]) -> None:
        """Offer the sequence's full blocks of these committed tokens to later prompts."""
        self.kv_cache.register_prefix(seq_id, token_ids)

    def truncate(self, seq_id: int, length: int) -> None:
        self.unstage()
        self.kv_cache.truncate(seq_id, length)

    def free(self, seq_id: int) -> None:
        self.unstage()
        self.kv_cache.free(seq_id)

    def num_cached(self, seq_id: int) -> int:
        self.unstage()
        return self.kv_cache.num_tokens(seq_id)

    # staging ------------------------------------------------------------------------------------

    @property
    def staged(self) -> bool:
        """Whether a staged batch waits for its forward."""
        return self._staged is not None

    def stage(self, chunks: list[SequenceChunk], *, want_aux_hidden: bool = False) -> bool:
        """Do a verify batch's host work before its draft tokens exist: its slots reserved, the
        static path's buffers filled, token ids past the known ones placeholders. Why: the engine
        stages while the drafters work (it would only wait), and the step's launch is then the
        token ids and the replay (specd/engine/staging.py).

        The next forward of the same sequences with the same chunk lengths (and aux flag) takes
        it; any other forward, and every other cache call, undoes it first, so a staged batch is
        never seen. False, with nothing staged, where the batch would not take the static path
        or does not fit the cache now."""
        self.unstage()
        if self.static is None:
            return False
        try:
            starts = self._check_batch(chunks)
        except (ValueError, CacheFullError):
            return False
        query_lens = [len(c.token_ids) for c in chunks]
        layout = self.static.layout(query_lens, starts)
        if layout is None:
            return False
        slots = [self.kv_cache.append_slots(c.seq_id, n) for c, n in zip(chunks, query_lens)]
        try:
            # Under the runner's kernel settings, as forward: a layout met first here is captured
            # here, and its graph serves every later forward of that layout, staged or not.
            # (Without them, staged stacks captured cuBLAS graphs without PDL: 360
            # launches instead of 263, every forward of those layouts ~0.37 ms slower on an H100.)
            with self._kernel_settings():
                prepared = self._prepare_static(chunks, starts, slots, layout, want_aux_hidden)
        except BaseException:
            for c, s in zip(chunks, starts):
                self.kv_cache.truncate(c.seq_id, s)
            raise
        self._staged = _StagedBatch(tuple(c.seq_id for c in chunks), starts, slots, layout, want_aux_hidden,
                                    prepared)
        return True

    def unstage(self) -> None:
        """Undo a staged batch (its slots back), if one waits."""
        staged, self._staged = self._staged, None
        if staged is not None:  # last staged first: the free list gets back its very order
            for seq_id, start in reversed(list(zip(staged.seq_ids, staged.starts))):
                self.kv_cache.truncate(seq_id, start)

    def _take_staged(self, chunks: list[SequenceChunk], want_aux_hidden: bool) -> _StagedBatch | None:
        """The staged batch, ready to run, if this forward is the one it was staged for: the
        same sequences in the same order, each chunk as long as staged or shorter (drafters may
        return fewer drafts) within the same layout. Its token ids are written; chunks that came
        back shorter give their extra slots back and the buffers are filled again. Else the stage
        is undone and None."""
        staged = self._staged
        if staged is None:
            return None
        lens = tuple(len(c.token_ids) for c in chunks)
        ours = (staged.want_aux_hidden == want_aux_hidden and len(chunks) == len(staged.seq_ids)
                and all(c.seq_id == s for c, s in zip(chunks, staged.seq_ids)))
        if ours and lens == staged.prepared.chunk_lens:
            self._staged = None
            self.static.rewrite_token_ids(staged.prepared, [c.token_ids for c in chunks])
            return staged
        if (ours and all(0 < n <= m for n, m in zip(lens, staged.prepared.chunk_lens))
                and self.static.layout(list(lens), staged.starts) == staged.layout):
            self._staged = None
            for seq_id, start, n, m in zip(staged.seq_ids, staged.starts, lens, staged.prepared.chunk_lens):
                if n < m:
                    self.kv_cache.truncate(seq_id, start + n)
            slots = [s[:n] for s, n in zip(staged.slots, lens)]
            return replace(staged, prepared=self._prepare_static(chunks, staged.starts, slots, staged.layout,
                                                                 want_aux_hidden))
        self.unstage()
        return None

    def set_aux_hidden_layers(self, layer_ids: list[int]) -> None:
        self.unstage()
        num_layers = self.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i < num_layers]
        if bad or not layer_ids:
            raise ValueError(f"aux hidden layer ids must be in [0, {num_layers}), got {list(layer_ids)}")
        self.aux_layer_ids = list(layer_ids)

    # compute ------------------------------------------------------------------------------------

    def _check_batch(self, chunks: list[SequenceChunk]) -> list[int]:
        """Validate the batch against the caches; returns each chunk's start (tokens cached)."""
        check_chunks(chunks)
        starts = [self.kv_cache.num_tokens(c.seq_id) for c in chunks]
        for c, start in zip(chunks, starts):
            if start + len(c.token_ids) > self.session_len:
                raise ValueError(f"sequence {c.seq_id} would exceed session_len={self.session_len}")
        allocator = self.kv_cache.allocator
        # A chunk of n tokens takes at most n // block_size + 1 new blocks: with that many free for
        # the batch (the usual case) the exact count, a call a chunk, is not needed.
        bound = sum(len(c.token_ids) for c in chunks) // self.block_size + len(chunks)
        if allocator.can_allocate(bound):
            return starts
        need = sum(self.kv_cache.num_new_blocks(c.seq_id, len(c.token_ids)) for c in chunks)
        if not allocator.can_allocate(need):
            raise CacheFullError(f"batch needs {need} new KV blocks, {allocator.num_free_blocks} free")
        return starts

    def forward(self, chunks: list[SequenceChunk], *, want_hidden: bool = False,
                want_aux_hidden: bool = False, last_logits_only: bool = False,
                first_token_ids: torch.Tensor | None = None) -> ForwardOutput:
        """Append every chunk to its cache in one model call; logits for every new token (or
        each chunk's last, last_logits_only: the eager path then runs lm_head on those rows only).
        first_token_ids: [num_chunks] int64 on the device; where >= 0 it is chunk i's first token,
        whose host value is a placeholder (a token the last step sampled and the host has not
        read yet: the overlapped decode, specd/engine/overlap.py)."""
        with self._kernel_settings():
            return self._forward(chunks, want_hidden, want_aux_hidden, last_logits_only, first_token_ids)

    @contextmanager
    def _kernel_settings(self):
        """The runner's GEMM backend and PDL mode for what launches inside, and
        for the graphs captured inside (a graph keeps its capture's settings)."""
        with gemm_backend(self.gemm), pdl_launches(self.pdl):
            yield

    def _forward(self, chunks: list[SequenceChunk], want_hidden: bool, want_aux_hidden: bool,
                 last_logits_only: bool, first_token_ids: torch.Tensor | None = None) -> ForwardOutput:
        held = self._staged
        if held is not None:
            try:
                staged = self._take_staged(chunks, want_aux_hidden)
                if staged is not None:  # staged for this batch: the host work is done
                    self.num_staged_forwards += 1
                    return self._static_run(staged.prepared, chunks, want_hidden, last_logits_only,
                                            first_token_ids)
            except BaseException:  # leave the caches as they were before the stage
                self._staged = None
                for seq_id, start in zip(held.seq_ids, held.starts):
                    self.kv_cache.truncate(seq_id, start)
                raise
        starts = self._check_batch(chunks)
        query_lens = [len(c.token_ids) for c in chunks]
        slots = [self.kv_cache.append_slots(c.seq_id, n) for c, n in zip(chunks, query_lens)]  # per chunk
        try:
            layout = self.static.layout(query_lens, starts) if self.static is not None else None
            if layout is not None:
                prepared = self._prepare_static(chunks, starts, slots, layout, want_aux_hidden)
                return self._static_run(prepared, chunks, want_hidden, last_logits_only, first_token_ids)
            self.num_eager_forwards += 1
            meta = AttentionMetadata.build(
                query_lens=query_lens,
                seq_lens=[s + n for s, n in zip(starts, query_lens)],
                block_tables=self.kv_cache.block_tables([c.seq_id for c in chunks]),
                slot_mapping=[slot for chunk_slots in slots for slot in chunk_slots],
                block_size=self.block_size, device=self.device)
            input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long,
                                     device=self.device)  # [T]
            offsets = chunk_offsets(query_lens)
            if first_token_ids is not None:
                first_rows = torch.tensor(offsets[:-1], device=self.device)  # [chunks]
                input_ids[first_rows] = torch.where(first_token_ids >= 0, first_token_ids, input_ids[first_rows])
            positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)]
                                  ).to(self.device)  # [T]
            if self.on_launch is not None:
                self.on_launch()
            with torch.no_grad():
                hidden, aux = self.model(input_ids, positions, meta, self.kv_cache,
                                         self.aux_layer_ids if want_aux_hidden else ())
                wanted = hidden.index_select(0, last_rows(offsets, hidden.device)) if last_logits_only else hidden
                logits = self.model.compute_logits(wanted)  # [T or chunks, vocab] float32
        except BaseException:
            for c, s in zip(chunks, starts):  # leave the caches as they were
                self.kv_cache.truncate(c.seq_id, s)
            raise
        return ForwardOutput(logits=logits, offsets=offsets, hidden_states=hidden if want_hidden else None,
                             aux_hidden_states=aux, last_logits_only=last_logits_only)

    def _prepare_static(self, chunks: list[SequenceChunk], starts: list[int], slots: list[list[int]],
                        layout: tuple[int, int, int], want_aux_hidden: bool) -> PreparedBatch:
        return self.static.prepare(
            [c.token_ids for c in chunks], starts, slots,
            [self.kv_cache.block_table_view(c.seq_id) for c in chunks],
            tuple(self.aux_layer_ids) if want_aux_hidden else (), layout=layout)

    def _static_run(self, prepared: PreparedBatch, chunks: list[SequenceChunk], want_hidden: bool,
                    last_logits_only: bool = False, first_token_ids: torch.Tensor | None = None) -> ForwardOutput:
        if self.on_launch is not None:
            self.on_launch()
        offsets = chunk_offsets([len(c.token_ids) for c in chunks])
        logits, hidden, aux = self.static.run(prepared, want_hidden=want_hidden,
                                              logit_rows=[o - 1 for o in offsets[1:]] if last_logits_only else None,
                                              first_token_ids=first_token_ids)
        return ForwardOutput(logits=logits, offsets=offsets, hidden_states=hidden if want_hidden else None,
                             aux_hidden_states=aux, last_logits_only=last_logits_only)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[n] -> [n, hidden] in the model dtype."""
        with torch.no_grad():
            return self.model.model.embed_tokens(token_ids.to(self.device))

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        with torch.no_grad(), gemm_backend(self.gemm), pdl_launches(self.pdl):
            return self.model.compute_logits(hidden.to(device=self.device, dtype=self.dtype))


@dataclass(frozen=True)
class _StagedBatch:
    """A verify batch staged before its drafts (LlamaRunner.stage): its slots reserved."""

    seq_ids: tuple[int, ...]
    starts: list[int]  # tokens cached before it: where unstage truncates back to
    slots: list[list[int]]  # reserved for each chunk as staged
    layout: tuple[int, int, int]
    want_aux_hidden: bool
    prepared: PreparedBatch
