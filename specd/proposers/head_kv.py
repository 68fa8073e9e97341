"""The draft heads' KV cache (EAGLE-3, MTP): one buffer per cached tensor, a slot per sequence.

A head has one attention layer; what it caches per position is a few tensors (k and v, or MLA's
two latents), each [heads, dim] per position. `HeadKVCache` keeps each as a buffer
[slots, capacity, heads, dim]: a sequence owns a slot while it is open and its entries are the
first `length` positions of that slot (the length lives with the sequence, so dropping last
step's speculative entries is a number, not a copy). `BatchKV` is one forward's view of a batch:
the past of every sequence gathered in one index_select per tensor, padded to the longest, the
new entries copied in with one index_copy_ per tensor (positions are rows of the buffer seen as
[slots * capacity, heads, dim]), and the mask that keeps sequences apart.

Why not a tensor per sequence (as before): the batch was then copied together one sequence at a
time and each cache grown by a concatenation, every draft step: ~1,200 small copies a propose at
batch 64 (bench/drafter_head.py's profile, run 68), most of an 8B EAGLE-3 drafter's host time
once cuDNN's plans were gone.
"""

from __future__ import annotations

import torch


class HeadKVCache:
    """Buffers [num_slots, capacity, heads_t, dim_t], one per cached tensor t, on `device`. They
    are allocated at the first write (their shapes and dtype come from the head's tensors) and
    grow by doubling, in slots and in capacity, keeping what they hold."""

    def __init__(self, device: torch.device | str, initial_slots: int = 8, initial_capacity: int = 256) -> None:
        self.device = torch.device(device)
        self.buffers: list[torch.Tensor] | None = None
        self.num_slots, self.capacity = initial_slots, initial_capacity
        self._free = list(range(initial_slots))[::-1]  # pop() gives the lowest first

    def acquire(self) -> int:
        """A free slot (the cache grows when none is left)."""
        if not self._free:
            self._grow(2 * self.num_slots, self.capacity)
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def capacity_for(self, length: int) -> int:
        """The capacity `ensure(..., length)` leaves: this one, or doubled until it holds length."""
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        return capacity

    def ensure(self, new: tuple[torch.Tensor, ...], length: int) -> None:
        """Room for `length` positions a slot, in buffers shaped after `new` ([B, heads, S, dim] each)."""
        if self.buffers is None:
            self.capacity = self.capacity_for(length)
            self.buffers = [t.new_zeros(self.num_slots, self.capacity, t.shape[1], t.shape[3]) for t in new]
        elif length > self.capacity:
            self._grow(self.num_slots, self.capacity_for(length))

    def _grow(self, num_slots: int, capacity: int) -> None:
        if self.buffers is not None:
            grown = []
            for buf in self.buffers:
                bigger = buf.new_zeros(num_slots, capacity, buf.shape[2], buf.shape[3])
                bigger[:buf.shape[0], :buf.shape[1]] = buf
                grown.append(bigger)
            self.buffers = grown
        self._free = list(range(num_slots - 1, self.num_slots - 1, -1)) + self._free
        self.num_slots, self.capacity = num_slots, capacity


class BatchKV:
    """One forward's keys over a batch of sequences in a HeadKVCache.

    slots[i], past_lens[i]: sequence i's slot and cached positions; query_lens[i]: its new ones.
    Keys of the batch are [past padded to max_past | new], so query j of sequence i sees its own
    past (slots < past_lens[i]) and new slots max_past .. max_past + j. `update` writes the valid
    new entries to positions past_lens[i] .. past_lens[i] + query_lens[i] - 1 of slot i; the
    caller then adds query_lens[i] to the sequence's length.
    """

    def __init__(self, cache: HeadKVCache, slots: list[int], past_lens: list[int], query_lens: list[int]) -> None:
        self.cache = cache
        self.past_lens, self.query_lens = past_lens, query_lens
        self.max_past = max(past_lens)
        device = cache.device
        batch, num_q = len(slots), max(query_lens)
        # (b, j) of every valid new entry, and the row update() copies it to in the buffers seen as
        # [slots * capacity, heads, dim]: slot b, position past_lens[b] + j (the capacity is the
        # one update's ensure() will leave). All the host's integers go over in one copy (each is
        # a wait on the device otherwise); a draft step's one position a sequence needs no (b, j).
        self._needed = max(p + q for p, q in zip(past_lens, query_lens))
        capacity = cache.capacity_for(self._needed)
        one_each = num_q == 1
        rows = [(b, j) for b, q in enumerate(query_lens) for j in range(q)]
        ints = torch.tensor([*past_lens, *query_lens, *slots,
                             *(slots[b] * capacity + past_lens[b] + j for b, j in rows),
                             *(() if one_each else (b for b, _ in rows)), *(() if one_each else (j for _, j in rows))],
                            dtype=torch.long).to(device)
        past_t, query_t, self._slots, self._dest, *pairs = ints.split(
            [batch, batch, batch, len(rows)] + ([] if one_each else [len(rows), len(rows)]))
        self._row_b, self._row_j = pairs if pairs else (None, None)
        past_ok = torch.arange(self.max_past, device=device)[None, :] < past_t[:, None]  # [B, max_past]
        # Every query sees at least its own slot, so no row is fully masked and padded rows stay
        # finite; valid queries never see padded keys, which all come after them.
        causal = torch.ones(num_q, num_q, dtype=torch.bool, device=device).tril()  # [S, S]
        mask = torch.cat([past_ok[:, None, :].expand(-1, num_q, -1),
                          causal[None].expand(batch, -1, -1)], dim=-1)  # [B, S, past + S]
        valid_q = torch.arange(num_q, device=device)[None, :] < query_t[:, None]  # [B, S]
        mask[:, :, :self.max_past] &= valid_q[:, :, None]
        self.mask = mask[:, None]  # [B, 1, S, max_past + S] bool, True = attend

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """New entries [B, heads, S, dim] each -> the batch's keys [B, heads, max_past + S, dim];
        the valid ones are stored in the cache."""
        cache = self.cache
        cache.ensure(new, self._needed)
        out = []
        for buf, fresh in zip(cache.buffers, new):
            fresh = fresh.to(buf.dtype)
            past = buf[:, :self.max_past].index_select(0, self._slots).transpose(1, 2)  # [B, heads, max_past, dim]
            out.append(torch.cat([past, fresh], dim=2))
            valid = fresh[:, :, 0] if self._row_b is None else fresh[self._row_b, :, self._row_j]  # [N, heads, dim]
            buf.view(-1, buf.shape[2], buf.shape[3]).index_copy_(0, self._dest, valid)
        return tuple(out)
