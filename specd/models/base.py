"""The target-model runner contract that the engine drives.

A runner owns the target's weights and its KV cache. The engine feeds it, per sequence, the new
tokens to append at the end of that sequence's cache (a whole prompt at prefill, the last token
plus k draft tokens at verification) and rolls rejected tokens back with `truncate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specd.models.append_plan import AppendPlan


@dataclass
class ModelInfo:
    """What the engine and the drafters need to know about a target model."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = ""


@dataclass
class SequenceChunk:
    """New tokens of one sequence, appended at the end of its cache (position = cached length)."""

    seq_id: int
    token_ids: list[int]


@dataclass
class ForwardOutput:
    """Results for the concatenated tokens of a batch, in the order of the chunks given.

    Rows for chunk i are `offsets[i]:offsets[i + 1]`.
    """

    logits: torch.Tensor  # [num_tokens, vocab] float32; [num_chunks, vocab] when last_logits_only
    offsets: list[int]  # [num_chunks + 1] row offsets
    hidden_states: torch.Tensor | None = None  # [num_tokens, hidden] final hidden (after the final norm)
    aux_hidden_states: torch.Tensor | None = None  # [num_tokens, num_aux * hidden] EAGLE-3 features
    # The forward was asked for each chunk's last token's logits only (a prefill samples one
    # token per sequence): logits has a row per chunk; the hidden states keep every row.
    last_logits_only: bool = False

    def rows(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])

    def last_logits(self) -> torch.Tensor:
        """[num_chunks, vocab]: each chunk's last token's logits, however the forward was asked."""
        if self.last_logits_only:
            return self.logits
        return self.logits[last_rows(self.offsets, self.logits.device)]


def chunk_offsets(query_lens: list[int]) -> list[int]:
    """[0, n0, n0 + n1, ...]: where each chunk's rows start in the batch's outputs."""
    offsets = [0]
    for n in query_lens:
        offsets.append(offsets[-1] + n)
    return offsets


def last_rows(offsets: list[int], device: torch.device) -> torch.Tensor:
    """[num_chunks] int64: the row of each chunk's last token, from the chunks' row offsets."""
    return torch.tensor(offsets[1:], device=device) - 1


class TargetRunner(Protocol):
    """Target model + KV cache. Implemented by LlamaRunner (ours) and HFRunner (transformers).

    Optional: `stage` / `staged` (a verify batch's host work done while its drafts are out:
    specd/engine/staging.py) and `on_launch`, a hook the runner calls right before a forward's
    first device work (the engine's device clock marks it: specd/engine/device_clock.py), and
    `takes_first_token_ids` (True: forward accepts first_token_ids, [num_chunks] int64 on the
    device, chunk i's first token where >= 0 over the host's placeholder; the engine then queues
    a decode step before the last one's tokens reach the host: specd/engine/overlap.py)."""

    info: ModelInfo
    device: torch.device

    def add_sequence(self, seq_id: int) -> None:
        """Open an empty cache for a sequence."""

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether the cache has room to append num_tokens to the sequence (alone)."""

    def plan_appends(self) -> AppendPlan:
        """The cache's room, for planning a whole batch's appends together (append_plan.py)."""

    def forward(self, chunks: list[SequenceChunk], *, want_hidden: bool = False,
                want_aux_hidden: bool = False, last_logits_only: bool = False) -> ForwardOutput:
        """Append each chunk to its sequence's cache and return logits for every new token, or
        with last_logits_only for each chunk's last token only (ForwardOutput.last_logits_only).
        Why the flag: a prefill samples one token per sequence, and the float32 logits of every
        prompt token are [tokens, vocab]: 1.2 GiB for 2,400 tokens of a 128k vocabulary, 4 GiB
        for the default 8,192-token prefill budget, enough to run the verifier out of memory."""

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first `length` tokens of the sequence's cache (rollback of rejected drafts)."""

    def free(self, seq_id: int) -> None:
        """Release the sequence's cache."""

    def num_cached(self, seq_id: int) -> int:
        """Tokens currently in the sequence's cache."""

    def set_aux_hidden_layers(self, layer_ids: list[int]) -> None:
        """Which layers' inputs `aux_hidden_states` concatenates (EAGLE-3)."""

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings, [n] -> [n, hidden] (borrowed by EAGLE-3 / MTP heads)."""

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output projection, [n, hidden] -> [n, vocab] (shared by MTP heads)."""


def check_chunks(chunks: list[SequenceChunk]) -> None:
    """The batch rules every runner enforces: non-empty, one chunk per sequence, no empty chunk."""
    if not chunks:
        raise ValueError("forward needs at least one chunk")
    seq_ids = [c.seq_id for c in chunks]
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"a sequence may appear once per batch, got seq ids {seq_ids}")
    for c in chunks:
        if not c.token_ids:
            raise ValueError(f"chunk of sequence {c.seq_id} has no tokens")
