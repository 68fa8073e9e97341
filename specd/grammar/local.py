"""LocalGrammarBackend: the GrammarBackend contract in-process (engine, drafter, grammar service).

It owns one SequenceGrammar per constrained sequence; compiled grammars come from a shared
GrammarCompilerCache, so many sequences with the same response_format compile it once.
"""

from __future__ import annotations

from specd.grammar.backend import GrammarSpec, GrammarStep, MaskResult
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.errors import GrammarNotOpenError
from specd.grammar.matcher import SequenceGrammar


class LocalGrammarBackend:
    """Holds the real matchers of the constrained sequences of one engine (or one service)."""

    def __init__(self, compiler_cache: GrammarCompilerCache) -> None:
        self.compiler_cache = compiler_cache
        self._seqs: dict[int, SequenceGrammar] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def open(self, seq_id: int, spec: GrammarSpec, replay_token_ids: list[int] | None = None) -> None:
        """Create seq_id's matcher (replacing any), replaying its already accepted tokens.

        GrammarCompileError when spec does not compile; GrammarViolation when the replayed tokens do
        not follow it (then no matcher is left open for seq_id).
        """
        self._seqs.pop(seq_id, None)
        grammar = self.compiler_cache.sequence_grammar(spec)
        if replay_token_ids:
            grammar.commit(replay_token_ids)
        self._seqs[seq_id] = grammar

    def get(self, seq_id: int) -> SequenceGrammar:
        """seq_id's matcher (an in-process drafter forks its DraftGrammar from it)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise GrammarNotOpenError(f"grammar: sequence {seq_id} has no open matcher") from None

    def step(self, step: GrammarStep) -> dict[int, MaskResult]:
        """Commit every sequence's accepted tokens, then mask along each sequence's drafts.

        Every seq in step.drafts gets a result, an empty draft list included (row 0 only); rows
        near the end of a step.budgets entry close the output (SequenceGrammar.mask_along).
        """
        for seq_id, tokens in step.commits.items():
            if tokens:
                self.get(seq_id).commit(tokens)
        return {seq_id: self.get(seq_id).mask_along(drafts, step.budgets.get(seq_id))
                for seq_id, drafts in step.drafts.items()}

    def close(self, seq_id: int) -> None:
        """Drop seq_id's matcher (closing an unknown id is a no-op: aborts may race finishes)."""
        self._seqs.pop(seq_id, None)
