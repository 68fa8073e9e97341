"""Draft masking for proposers: a forked grammar matcher per constrained sequence.

For each draft position the fork fills the bitmask, the proposer masks its logits before choosing
the token, and the fork advances with that token (lmdeploy's scheme). The proposer's own copy of
the committed state is soft state: it is rebuilt from the committed output tokens, which arrive
with every DraftRequest, so a restarted drafter masks exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.grammar.backend import GrammarSpec


@dataclass
class _Constrained:
    committed: object  # SequenceGrammar: the committed output tokens
    fork: object  # DraftGrammar: the drafts of the current step
    num_committed: int = 0


class DraftConstraints:
    """Per-sequence grammar forks; unconstrained sequences are simply absent."""

    def __init__(self, compiler_cache) -> None:
        # A GrammarCompilerCache, or a zero-argument factory of one: a drafter then pays for the
        # tokenizer's grammar tables only when the first constrained request arrives.
        self._compiler = compiler_cache
        self._seqs: dict[int, _Constrained] = {}

    @property
    def compiler(self):
        if callable(self._compiler):
            self._compiler = self._compiler()
        return self._compiler

    def open(self, seq_id: int, spec: GrammarSpec | None) -> None:
        if spec is None:
            return
        committed = self.compiler.sequence_grammar(spec)
        self._seqs[seq_id] = _Constrained(committed, committed.fork_drafts())

    def close(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def is_constrained(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def begin(self, seq_id: int, output_token_ids: list[int]) -> None:
        """Catch the committed state up with the sequence's output, then fork it for drafting."""
        c = self._seqs.get(seq_id)
        if c is None:
            return
        new = output_token_ids[c.num_committed:]
        if new:
            c.committed.commit(new)
            c.num_committed = len(output_token_ids)
        c.fork.reset()

    def masks(self, seq_ids: list[int]) -> torch.Tensor | None:
        """[B, W] int32 next-token bitmasks (all-ones rows for unconstrained sequences), or None."""
        if not any(s in self._seqs for s in seq_ids):
            return None
        rows = []
        for s in seq_ids:
            c = self._seqs.get(s)
            rows.append(c.fork.next_mask() if c is not None
                        else torch.full((self.compiler.bitmask_width,), -1, dtype=torch.int32))
        return torch.stack(rows)

    def advance(self, seq_id: int, token_id: int) -> bool:
        """Move the fork past a chosen draft; False when the grammar forbids it (stop drafting)."""
        c = self._seqs.get(seq_id)
        return True if c is None else c.fork.advance(token_id)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] with the bitmask rows [B, W] applied (a no-op when bitmask is None)."""
    if bitmask is None:
        return logits
    from specd.grammar.masking import apply_bitmask

    return apply_bitmask(logits, bitmask.to(logits.device))
