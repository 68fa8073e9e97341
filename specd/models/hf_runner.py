"""HFRunner: the generic TargetRunner over transformers' AutoModelForCausalLM.

For architectures our compact model does not cover (DeepSeek-V3 MLA + MoE, Qwen3.5 hybrid
linear attention, ...): correct rather than fast. Each sequence keeps its own transformers cache
and token history; a batch runs one model call per chunk.

Rollback. A cache made only of plain `DynamicLayer`s is cropped in place. Any other cache
(linear-attention / recurrent state that cannot be un-applied, sliding-window layers that already
dropped old keys) is deep-copied before every forward; `truncate` restores that snapshot and
re-runs the kept tokens, or rebuilds from scratch when asked to go back past it.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specd.messages import PytorchEngineConfig
from specd.models.base import check_chunks, chunk_offsets, ForwardOutput, ModelInfo, SequenceChunk
from specd.models.append_plan import AppendPlan
from specd.models.runner_setup import default_aux_layer_ids, select_device, select_dtype


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def is_croppable(cache: Any) -> bool:
    """Whether `cache.crop` restores exactly the state of a shorter sequence."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and hasattr(cache, "crop") and all(type(layer) is DynamicLayer for layer in layers)


@dataclass
class _HFSequence:
    tokens: list[int] = field(default_factory=list)  # every token in the cache, in order
    cache: Any = None  # None until the first forward (the model builds the right cache type)
    snapshot: Any = None  # deep copy of `cache` taken before the last forward
    snapshot_len: int = 0
    has_snapshot: bool = False


class HFRunner:
    """TargetRunner over any transformers causal LM, one forward per chunk."""

    def __init__(self, model_dir: str | Path, engine_config: PytorchEngineConfig | None = None) -> None:
        from transformers import AutoModelForCausalLM

        engine_config = engine_config or PytorchEngineConfig()
        self.model_dir = Path(model_dir)
        self.device = select_device(engine_config)
        self.dtype = select_dtype(engine_config, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device)
        self.model.eval()
        # transformers 5 renamed `past_key_values` to `cache` on most models; support both.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        text = self.model.config.get_text_config()
        eos = _as_id_list(getattr(text, "eos_token_id", None))
        gen = getattr(self.model, "generation_config", None)
        for token_id in _as_id_list(getattr(gen, "eos_token_id", None)):
            if token_id not in eos:
                eos.append(token_id)
        self.info = ModelInfo(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_hidden_layers=text.num_hidden_layers,
            max_position_embeddings=getattr(text, "max_position_embeddings", 0) or 0,
            eos_token_ids=eos,
            architecture=(self.model.config.architectures or [type(self.model).__name__])[0],
        )
        self.session_len = engine_config.session_len or self.info.max_position_embeddings or (1 << 30)
        self.aux_layer_ids = default_aux_layer_ids(self.info.num_hidden_layers)
        self._seqs: dict[int, _HFSequence] = {}

    # cache lifecycle ----------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _HFSequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no cache (call add_sequence first)") from None

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has a cache")
        self._seqs[seq_id] = _HFSequence()

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return len(self._seq(seq_id).tokens) + num_tokens <= self.session_len

    def plan_appends(self) -> AppendPlan:
        """transformers' caches grow as needed: only the session length bounds an append."""
        return AppendPlan(0, lambda s: len(self._seq(s).tokens), lambda s, n: 0, self.session_len)

    def free(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def num_cached(self, seq_id: int) -> int:
        return len(self._seq(seq_id).tokens)

    def set_aux_hidden_layers(self, layer_ids: list[int]) -> None:
        num_layers = self.info.num_hidden_layers
        if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
            raise ValueError(f"aux hidden layer ids must be in [0, {num_layers}), got {list(layer_ids)}")
        self.aux_layer_ids = list(layer_ids)

    def truncate(self, seq_id: int, length: int) -> None:
        seq = self._seq(seq_id)
        num_tokens = len(seq.tokens)
        if not 0 <= length <= num_tokens:
            raise ValueError(f"truncate: length {length} outside [0, {num_tokens}] for sequence {seq_id}")
        if length == num_tokens:
            return
        kept = seq.tokens[:length]
        if length > 0 and is_croppable(seq.cache):
            seq.cache.crop(length - num_tokens)  # a negative count removes that many tokens
            seq.tokens = kept
            seq.snapshot, seq.has_snapshot = None, False
            return
        if seq.has_snapshot and seq.snapshot_len <= length:
            seq.cache, seq.tokens = seq.snapshot, kept[:seq.snapshot_len]
        else:  # further back than the snapshot: rebuild the state from the token history
            seq.cache, seq.tokens = None, []
        seq.snapshot, seq.has_snapshot = None, False
        if len(seq.tokens) < length:
            self._run(seq, kept[len(seq.tokens):], with_hidden=False)

    # compute ------------------------------------------------------------------------------------

    def _run(self, seq: _HFSequence, token_ids: list[int], with_hidden: bool) -> Any:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        with torch.no_grad():
            out = self.model(input_ids=input_ids, use_cache=True, output_hidden_states=with_hidden,
                             **{self._cache_kwarg: seq.cache})
        cache = getattr(out, "cache", None)  # not `or`: an empty Cache has len 0, hence is falsy
        seq.cache = cache if cache is not None else getattr(out, "past_key_values", None)
        seq.tokens.extend(token_ids)
        return out

    def forward(self, chunks: list[SequenceChunk], *, want_hidden: bool = False,
                want_aux_hidden: bool = False, last_logits_only: bool = False) -> ForwardOutput:
        """Append each chunk to its sequence (one model call per chunk); logits for every token
        (each chunk's last only, last_logits_only: the others are dropped as each call returns)."""
        check_chunks(chunks)
        for c in chunks:
            if not self.can_append(c.seq_id, len(c.token_ids)):
                raise ValueError(f"sequence {c.seq_id} would exceed session_len={self.session_len}")
        logits, hidden, aux = [], [], []
        for c in chunks:
            seq = self._seq(c.seq_id)
            if not is_croppable(seq.cache):
                seq.snapshot = copy.deepcopy(seq.cache) if seq.cache is not None else None
                seq.snapshot_len, seq.has_snapshot = len(seq.tokens), True
            out = self._run(seq, list(c.token_ids), with_hidden=want_hidden or want_aux_hidden)
            logits.append(out.logits[0, -1:].float() if last_logits_only else out.logits[0].float())  # [n or 1, vocab]
            if want_hidden:
                hidden.append(out.hidden_states[-1][0])  # after the final norm
            if want_aux_hidden:
                # hidden_states[i] (i < L) is the input of decoder layer i.
                aux.append(torch.cat([out.hidden_states[i][0] for i in self.aux_layer_ids], dim=-1))
        return ForwardOutput(
            logits=torch.cat(logits),
            offsets=chunk_offsets([len(c.token_ids) for c in chunks]),
            hidden_states=torch.cat(hidden) if want_hidden else None,
            aux_hidden_states=torch.cat(aux) if want_aux_hidden else None,
            last_logits_only=last_logits_only,
        )

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model.get_input_embeddings()(token_ids.to(self.device))

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            head = self.model.get_output_embeddings()
            return head(hidden.to(device=self.device, dtype=head.weight.dtype)).float()
