"""The first token of sequences just prefilled: sampled from each prompt's last logits row.

Sampled at the sequence's own position with its own seed, like every later token (specd/random.py),
so a request's output does not depend on the batch it was admitted with. The grammar's mask and
min_new_tokens' stop suppression apply as in a verify step; a grammar that allows only a stop
token keeps it (keep_grammar_rows: a complete output stops anyway). Sequences that ask for
logprobs get them from the same rows (specd/engine/logprobs.py).
"""

from __future__ import annotations

import torch

from specd.engine.constraints import ConstraintTracker, keep_grammar_rows, mask_rows
from specd.engine.logprobs import TokenLogprob, first_token_logprobs
from specd.engine.sequence import Sequence
from specd.engine.stop import StopChecker
from specd.models.base import ForwardOutput
from specd.random import SALT_SAMPLE
from specd.sampling import SamplingTensors, apply_logit_bias, apply_repetition_penalty, processed_probs, sample_from_probs


def sample_first_tokens(out: ForwardOutput, seqs: list[Sequence], constraints: ConstraintTracker,
                        stop: StopChecker) -> tuple[list[int], list[TokenLogprob | None]]:
    """out: the prefill forward over seqs' chunks, in order (each chunk's last token's logits are
    what is sampled: out.last_logits()). Opens each sequence's grammar matcher
    (constraints.open). Returns one token id per sequence, and its logprobs where it asked."""
    device = out.logits.device
    st = SamplingTensors.from_params([s.params for s in seqs], device)
    raw_logits = logits = out.last_logits()  # [len(seqs), vocab]
    # logit_bias, then the repetition penalty over the prompt (presence and frequency count the
    # output, empty here): verify's order (verify.penalized_logits).
    if any(s.params.logit_bias for s in seqs):
        logits = apply_logit_bias(logits, [s.params.logit_bias for s in seqs])
    if any(s.params.repetition_penalty != 1.0 for s in seqs):
        logits = apply_repetition_penalty(
            logits, [torch.tensor(s.prompt_token_ids) for s in seqs], st.repetition_penalty)
    for seq in seqs:
        constraints.open(seq)
    masks = constraints.masks(seqs, [[] for _ in seqs])
    grammar_logits = mask_rows(logits, list(range(len(seqs))), masks)
    logits = suppress_early_stop(grammar_logits, seqs, stop)
    if logits is not grammar_logits and any(m is not None for m in masks):
        logits = keep_grammar_rows(grammar_logits, logits)
    probs = None
    if all(s.params.is_greedy for s in seqs):  # one-hot rows: their token, no noise drawn
        tokens = logits.float().argmax(dim=-1)  # [len(seqs)]
    else:
        positions = torch.tensor([s.num_tokens for s in seqs], device=device)
        probs = processed_probs(logits, st)  # [len(seqs), vocab]
        tokens = sample_from_probs(probs, st.seeds, positions, SALT_SAMPLE)

    def processed_rows(index: torch.Tensor) -> torch.Tensor:  # [A] -> [A, vocab]
        return probs[index] if probs is not None else processed_probs(logits[index], st.index_select(index))

    logprobs = first_token_logprobs(seqs, raw_logits, processed_rows, tokens)
    token_ids = tokens.tolist()  # the prefill's sync; the logprobs are read behind it
    rows = logprobs.read() if logprobs is not None else {}
    return token_ids, [rows[i][0] if i in rows else None for i in range(len(seqs))]


def suppress_early_stop(logits: torch.Tensor, seqs: list[Sequence], stop: StopChecker) -> torch.Tensor:
    """logits: [len(seqs), vocab], one row per sequence. EOS and stop tokens masked (-inf) in the
    rows of sequences below min_new_tokens; the same tensor when no row needs it."""
    if all(s.params.min_new_tokens <= s.num_output_tokens for s in seqs):
        return logits
    logits = logits.clone()
    for i, s in enumerate(seqs):
        if s.params.min_new_tokens > s.num_output_tokens:
            logits[i, sorted(stop.stop_token_ids(s))] = float("-inf")
    return logits
