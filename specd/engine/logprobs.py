"""Log probabilities of emitted tokens, for the requests that ask (SamplingParams.logprobs).

Two modes, as vLLM's: "raw" is log_softmax of the target's logits before any request processing;
"processed" is the log of the distribution the token was sampled from (logit_bias, penalties,
temperature, top-k/p, min-p, grammar masks and min_new_tokens applied; -inf where excluded, and a
greedy row is one-hot: 0 for its token).

Exact under speculation: a token emitted at verified row j (an accepted draft, the recovered or
the bonus token) gets row j's logprobs, and row j is the target's distribution after the same
prefix a target-only step would have seen. The recovered token is sampled from a residual, but
target-only decoding samples that position from row j's distribution: that is its logprob.

Cost only for requests that ask: their rows are picked out, computed and gathered on the device,
and read on the host right after the step's one device-to-host sync (commit), never before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Below any finite logprob float32 logits can produce, above -inf: excluded tokens tie at -inf,
# and ranking them at -(TIE_BASE + id) orders them by id, so top-N is deterministic.
TIE_BASE = 1e10


class TokenLogprob(NamedTuple):
    """One emitted token's logprob and its top alternatives, [(token_id, logprob)] by logprob desc."""

    logprob: float
    top: list[tuple[int, float]]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> torch.Tensor:
    """logprobs [R, V] float32, token_ids [R] int64 (-1: no token, any value read) ->
    [R, 1 + 2 * num_top] float64: the token's logprob, num_top ids, their logprobs (desc; ties at
    -inf by ascending id). float64 holds any token id exactly."""
    assert logprobs.ndim == 2 and token_ids.shape == logprobs.shape[:1]
    chosen = logprobs.gather(1, token_ids.clamp(min=0)[:, None]).double()  # [R, 1]
    if num_top == 0:
        return chosen
    ids = torch.arange(logprobs.shape[1], device=logprobs.device, dtype=torch.float64)  # [V]
    key = torch.where(torch.isneginf(logprobs), -(TIE_BASE + ids), logprobs.double())  # [R, V]
    top_ids = key.topk(num_top, dim=-1).indices  # [R, N], by key desc
    return torch.cat([chosen, top_ids.double(), logprobs.gather(1, top_ids).double()], dim=1)


def unpack(row: list[float], num_top: int) -> TokenLogprob:
    """One row of gather_logprobs, read on the host, cut to num_top alternatives."""
    width = (len(row) - 1) // 2
    return TokenLogprob(row[0], [(int(row[1 + n]), row[1 + width + n]) for n in range(num_top)])


def row_logprobs(raw_logits: torch.Tensor | None, processed_probs: torch.Tensor | None,
                 is_processed: list[bool]) -> torch.Tensor:
    """Per row the logprobs of its mode, [R, V] float32. raw_logits / processed_probs [R, V]: each
    may be None where no row has that mode (it is not computed then)."""
    raw = None if raw_logits is None else torch.log_softmax(raw_logits.float(), dim=-1)
    processed = None if processed_probs is None else processed_probs.float().log()
    if processed is None:
        return raw
    if raw is None:
        return processed
    mask = torch.tensor(is_processed).to(raw.device, non_blocking=True)[:, None]  # [R, 1]
    return torch.where(mask, processed, raw)


class StepLogprobs:
    """The logprobs of one step's emitted rows, on the device until commit reads them.

    packed: [A, R, 1 + 2M] float64, one row per asking request (A) and verified row (R), M the
    most alternatives any of them asks for; rows[i]: batch index -> its row in packed."""

    def __init__(self, packed: torch.Tensor, rows: dict[int, int], num_top: dict[int, int]) -> None:
        self.packed, self.rows, self.num_top = packed, rows, num_top

    def read(self) -> dict[int, list[TokenLogprob]]:
        """batch index -> one TokenLogprob per verified row (commit keeps those it emits)."""
        host = self.packed.tolist()
        return {i: [unpack(r, self.num_top[i]) for r in host[a]] for i, a in self.rows.items()}


def asking(batch: list) -> list[int]:
    """Batch indices of the sequences that asked for logprobs."""
    return [i for i, s in enumerate(batch) if s.params.logprobs is not None]


def verify_logprobs(batch: list, logits: torch.Tensor, offsets: list[int], num_drafts: list[int],
                    target_probs: torch.Tensor, token_ids: torch.Tensor) -> StepLogprobs | None:
    """The verify step's logprobs for the sequences that ask; None when none does.

    logits: the forward's rows, request i's k_i + 1 from offsets[i]; target_probs [B, K + 1, V]
    (target_probs_of: row j after drafts 0..j-1); token_ids [B, K + 1]: the token emitted at
    each row, -1 past the last (rejection_sample's output_token_ids)."""
    ask = asking(batch)
    if not ask:
        return None
    device = target_probs.device
    num_rows, vocab = target_probs.shape[1], target_probs.shape[2]
    is_processed = [batch[i].params.logprobs_mode == "processed" for i in ask]
    is_processed_rows = [p for p in is_processed for _ in range(num_rows)]
    raw = processed = None
    if not all(is_processed):  # row j of request i; padding rows repeat its last (never emitted)
        index = [offsets[i] + min(j, num_drafts[i]) for i in ask for j in range(num_rows)]
        raw = logits[torch.tensor(index).to(device, non_blocking=True)]  # [A * R, V]
    ask_index = torch.tensor(ask).to(device, non_blocking=True)
    if any(is_processed):
        processed = target_probs[ask_index].reshape(-1, vocab)  # [A * R, V]
    lp = row_logprobs(raw, processed, is_processed_rows)
    num_top = {i: batch[i].params.logprobs for i in ask}
    packed = gather_logprobs(lp, token_ids[ask_index].reshape(-1), max(num_top.values()))
    return StepLogprobs(packed.view(len(ask), num_rows, -1), {i: a for a, i in enumerate(ask)}, num_top)


def first_token_logprobs(seqs: list, raw_logits: torch.Tensor, processed_probs_of, token_ids: torch.Tensor
                         ) -> StepLogprobs | None:
    """The prefill's first tokens' logprobs for the sequences that ask; None when none does.

    raw_logits [S, V]: each sequence's last prompt row; processed_probs_of(index [A]) -> [A, V]:
    the distribution those rows sample from (computed only where asked); token_ids [S]."""
    ask = asking(seqs)
    if not ask:
        return None
    device = raw_logits.device
    index = torch.tensor(ask).to(device, non_blocking=True)
    is_processed = [seqs[i].params.logprobs_mode == "processed" for i in ask]
    raw = raw_logits[index] if not all(is_processed) else None
    processed = processed_probs_of(index) if any(is_processed) else None
    num_top = {i: seqs[i].params.logprobs for i in ask}
    packed = gather_logprobs(row_logprobs(raw, processed, is_processed), token_ids[index],
                             max(num_top.values()))
    return StepLogprobs(packed[:, None], {i: a for a, i in enumerate(ask)}, num_top)
