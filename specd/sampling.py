"""The target's sampling math as pure tensor functions: penalties, filters, and seeded sampling.

`processed_probs` is the one definition of the distribution a request samples from; the rejection
sampler verifies drafts against exactly these probabilities, which is what makes speculative
decoding lossless for sampled requests and not only for greedy ones.

Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)): it picks token v with probability
p(v), needs no cumulative sum, no host sync, and its noise comes from specd.random, so a token
depends only on (seed, position, salt) and its distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specd.random import hashed_uniform
from specd.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the device: one row per request, or per verified position."""

    temperature: torch.Tensor  # [B] float32 (greedy rows hold 0; processed_probs ignores it there)
    top_k: torch.Tensor  # [B] int64, 0 disables
    top_p: torch.Tensor  # [B] float32, 1 disables
    min_p: torch.Tensor  # [B] float32, 0 disables
    repetition_penalty: torch.Tensor  # [B] float32, 1 disables
    presence_penalty: torch.Tensor  # [B] float32, 0 disables
    frequency_penalty: torch.Tensor  # [B] float32, 0 disables
    seeds: torch.Tensor  # [B] int64
    is_greedy: torch.Tensor  # [B] bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu"
                    ) -> "SamplingTensors":
        """One row per request, in the order given. The copies to a CUDA device are asynchronous
        (non_blocking, staged by the driver): issued behind a forward, they do not wait for it."""

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.int64),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            repetition_penalty=column([p.repetition_penalty for p in params], torch.float32),
            presence_penalty=column([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=column([p.frequency_penalty for p in params], torch.float32),
            seeds=column([p.seed for p in params], torch.int64),
            is_greedy=column([p.is_greedy for p in params], torch.bool),
        )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def index_select(self, index: torch.Tensor) -> "SamplingTensors":
        """Rows picked by index [M] int64 (repeats allowed) -> a SamplingTensors of M rows."""
        assert index.ndim == 1, f"index must be [M], got {tuple(index.shape)}"
        return SamplingTensors(**{f.name: getattr(self, f.name).index_select(0, index)
                                  for f in fields(self)})

    def repeat_interleave(self, counts: torch.Tensor | list[int],
                          output_size: int | None = None) -> "SamplingTensors":
        """Repeat row i counts[i] times, in order: one row per request -> one per verified position.

        The engine verifies k_i + 1 positions of request i, so counts = num_draft_tokens + 1.
        Pass output_size (= sum of counts) to spare a device-to-host sync on CUDA.
        """
        counts = torch.as_tensor(counts, dtype=torch.int64, device=self.temperature.device)
        assert counts.shape == (self.num_rows,), "counts must be [B]"
        rows = torch.arange(self.num_rows, device=counts.device)
        return self.index_select(rows.repeat_interleave(counts, output_size=output_size))


def apply_repetition_penalty(logits: torch.Tensor,
                             prev_token_ids: list[torch.Tensor] | torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """CTRL / Hugging Face repetition penalty: for every token already in a row's context, a
    positive logit is divided by the penalty and a negative one multiplied by it.

    logits: [N, V].
    prev_token_ids: one 1-D LongTensor per row, or [N, L] int64 padded with -1. Repeats are fine.
        For a verified position j of a request, the context includes its drafts before j.
    penalty: [N]; rows with penalty 1 come back unchanged.
    Returns a new [N, V] tensor; the input is not modified.
    """
    assert logits.ndim == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    num_rows, vocab = logits.shape
    assert penalty.shape == (num_rows,), "penalty must be [N]"
    if isinstance(prev_token_ids, list):
        assert len(prev_token_ids) == num_rows, "one prev_token_ids tensor per row"
        if num_rows == 0:
            return logits.clone()
        prev_token_ids = torch.nn.utils.rnn.pad_sequence(
            [t.to(device=logits.device, dtype=torch.int64).reshape(-1) for t in prev_token_ids],
            batch_first=True, padding_value=-1)
    assert prev_token_ids.ndim == 2 and prev_token_ids.shape[0] == num_rows, \
        "prev_token_ids must be [N, L]"
    # Padding points at an extra sink column, so no padding entry can overwrite a real token's
    # penalised logit (scatter order among duplicate indices is unspecified on CUDA).
    with_sink = torch.cat([logits, logits.new_zeros(num_rows, 1)], dim=1)  # [N, V + 1]
    index = torch.where(prev_token_ids >= 0, prev_token_ids.to(logits.device), vocab)  # [N, L]
    scores = with_sink.gather(1, index)  # [N, L]
    factor = penalty.to(logits.dtype)[:, None]  # [N, 1]
    scores = torch.where(scores < 0, scores * factor, scores / factor)
    return with_sink.scatter(1, index, scores)[:, :vocab]


def apply_presence_frequency_penalties(logits: torch.Tensor, output_token_ids: list[torch.Tensor],
                                       presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties: a token's logit less frequency x its count in the row's output so far,
    less presence once it occurs at all. (The prompt is not counted, as in vLLM and OpenAI.)

    logits: [N, V]. output_token_ids: one 1-D LongTensor per row, the output before that row's
    position (drafts before it included). presence, frequency: [N]; 0 leaves a row unchanged.
    Returns a new [N, V] tensor.
    """
    assert logits.ndim == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    num_rows, vocab = logits.shape
    assert len(output_token_ids) == num_rows and presence.shape == frequency.shape == (num_rows,)
    if num_rows == 0:
        return logits.clone()
    index = torch.nn.utils.rnn.pad_sequence(
        [t.to(dtype=torch.int64).reshape(-1) for t in output_token_ids], batch_first=True,
        padding_value=vocab).to(logits.device)  # [N, L]; padding counts in a sink column
    counts = torch.zeros(num_rows, vocab + 1, device=logits.device, dtype=logits.dtype)
    counts = counts.scatter_add_(1, index, torch.ones_like(index, dtype=logits.dtype))[:, :vocab]  # [N, V]
    penalty = (frequency.to(logits.dtype)[:, None] * counts
               + presence.to(logits.dtype)[:, None] * (counts > 0).to(logits.dtype))
    return logits - penalty


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float]]) -> torch.Tensor:
    """Add biases[i][token] to row i's logit of each token named (OpenAI's logit_bias).

    logits: [N, V]; biases: one dict per row (empty: unchanged). Returns a new [N, V] tensor.
    Token ids must be < V (the engine checks them when a request is added).
    """
    rows = [i for i, b in enumerate(biases) for _ in b]
    if not rows:
        return logits.clone()
    tokens = [t for b in biases for t in b]
    values = [v for b in biases for v in b.values()]
    device = logits.device
    index = (torch.tensor(rows).to(device, non_blocking=True), torch.tensor(tokens).to(device, non_blocking=True))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype).to(device, non_blocking=True),
                            accumulate=True)


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The exact distribution each row samples from: [N, V] logits -> [N, V] float32 probabilities.

    Sampled rows: temperature, then top-k (ties with the k-th logit are kept), top-p (the smallest
    set of most likely tokens whose mass reaches top_p; the top token always stays), min-p (drop
    tokens below min_p x the top probability), renormalised. Greedy rows: one-hot at argmax of
    `logits` (ties -> lowest index, as torch.argmax). Apply penalties to `logits` beforehand.
    """
    assert logits.ndim == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    num_rows, vocab = logits.shape
    assert st.num_rows == num_rows, f"{st.num_rows} sampling rows for {num_rows} logit rows"
    logits = logits.float()
    # Greedy rows carry temperature 0; dividing by 1 keeps their (discarded) path free of NaN.
    temperature = torch.where(st.is_greedy, 1.0, st.temperature)  # [N]
    scaled = logits / temperature[:, None]  # [N, V]
    # One stable sort serves all three filters: they all act on the tokens ranked by probability.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [N, V] each

    k = torch.where(st.top_k > 0, st.top_k, vocab).clamp(1, vocab)  # [N]
    kth_logit = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
    keep = sorted_logits >= kth_logit  # [N, V]
    sorted_probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # [N, V]

    # Mass strictly before each rank: a token stays while the ones above it hold < top_p.
    # top_p == 1 is exempt, so float error in the cumsum cannot drop the tail.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V]
    top_p = st.top_p[:, None]  # [N, 1]
    keep &= (mass_before < top_p) | (top_p >= 1.0)
    # Ratios to the top probability do not change with renormalisation, so test them before it.
    keep &= sorted_probs >= st.min_p[:, None] * sorted_probs[:, :1]

    sorted_probs = sorted_probs * keep
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)  # [N, V]

    greedy = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(st.is_greedy[:, None], greedy, probs)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      salt: int | torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from probs [N, V] by the exponential race: [N] int64.

    probs need not sum to 1 (any non-negative weights with a positive entry per row work).
    seeds, positions: [N] int64; salt: an int or [N] int64 (see specd.random).
    argmax of p / E with E ~ Exp(1) i.i.d. picks v with probability p(v). E = -log(u) with u < 1 is
    > 0, so a token of probability 0 can never win over a positive one, and a one-hot row returns
    its token exactly. The uniforms are bit-identical across devices; float log may differ by an
    ulp between CPU and CUDA, which could only flip an exact near-tie.
    """
    assert probs.ndim == 2, f"probs must be [N, V], got {tuple(probs.shape)}"
    assert seeds.shape == (probs.shape[0],), "seeds must be [N]"
    noise = -torch.log(hashed_uniform(seeds, positions, salt, probs.shape[1]))  # [N, V], Exp(1)
    return (probs.float() / noise).argmax(dim=-1)
