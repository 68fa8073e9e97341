"""Planning one step's cache appends together.

`can_append(seq, n)` asks whether one sequence alone has room; a step appends to every sequence
of its batch at once, and eight sequences that each fit the last free block do not fit it
together (the forward then fails with CacheFullError, and with it every request of the batch).
An AppendPlan is made once per plan and hands out the free blocks as the plan claims them:
`take(seq, n)` claims room for n tokens past what the sequence holds, counting what was claimed
for it and for every other sequence before.
"""

from __future__ import annotations

from collections.abc import Callable


class AppendPlan:
    """The free blocks of a cache as one step's appends are planned (see the module doc)."""

    def __init__(self, free_blocks: int, num_tokens: Callable[[int], int],
                 new_blocks: Callable[[int, int], int], session_len: int | None,
                 block_size: int | None = None) -> None:
        """free_blocks: free now; num_tokens(seq): tokens it holds; new_blocks(seq, n): blocks
        an append of n tokens would allocate; session_len: tokens a sequence may hold (None: no
        limit); block_size: tokens a block holds (None: unknown, `fits_everyone` says False)."""
        self.free_blocks = free_blocks
        self._num_tokens = num_tokens
        self._new_blocks = new_blocks
        self.session_len = session_len
        self.block_size = block_size
        self._claimed: dict[int, int] = {}  # seq id -> blocks claimed for it so far

    def fits_everyone(self, num_seqs: int, num_tokens: int) -> bool:
        """Whether num_seqs sequences can each take num_tokens, whatever they hold: an append of
        n tokens allocates at most ceil(n / block_size) blocks. (Session lengths not counted.)
        Why: the step's plan claims sequence by sequence, ~3 us each; with the cache roomy, as
        it mostly is, the answer is known up front (drafting.plan_draft_lengths)."""
        if self.block_size is None:
            return False
        return num_seqs * -(-num_tokens // self.block_size) <= self.free_blocks

    def take(self, seq_id: int, num_tokens: int) -> bool:
        """Claim room for num_tokens past seq's cached tokens (all it holds claimed, not added:
        take(s, 1) then take(s, 4) claims room for 4); False, claiming nothing, if it does not fit."""
        if self.session_len is not None and self._num_tokens(seq_id) + num_tokens > self.session_len:
            return False
        claimed = self._claimed.get(seq_id, 0)
        need = self._new_blocks(seq_id, num_tokens) - claimed
        if need > self.free_blocks:
            return False
        if need > 0:
            self.free_blocks -= need
            self._claimed[seq_id] = claimed + need
        return True
