"""Per-request sampling parameters: the engine's domain type, built from GenerationConfig."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from specd.messages import GREEDY_BELOW_TEMPERATURE, ConfigError, GenerationConfig


@dataclass
class SamplingParams:
    """Validated sampling parameters of one request.

    temperature == 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy. top_k == 0 and top_p == 1 and min_p == 0 disable those filters.
    presence_penalty / frequency_penalty (OpenAI's, over the output so far) and logit_bias (token
    id -> a value added to its logit) change the logits before the filters (specd/sampling.py).
    seed keys the counter-based random stream: the noise for the token at position j depends only on
    (seed, j), so a request resumed elsewhere regenerates the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int = 0
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Log probabilities of each output token (specd/engine/logprobs.py): None off, else the chosen
    # token's plus that many top alternatives (0..MAX_LOGPROBS). "raw": log_softmax of the target's
    # logits; "processed": log of the distribution the token was sampled from.
    logprobs: int | None = None
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            # NaN passes every range test below (comparisons with NaN are False): refuse it first.
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name}: must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        self.logit_bias = _token_biases(self.logit_bias)
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed: must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids: must be >= 0, got {min(self.stop_token_ids)}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs: must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode: expected one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling reads the tokens so far (a penalty over them)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @classmethod
    def from_generation_config(cls, gen: GenerationConfig) -> "SamplingParams":
        greedy = gen.is_greedy
        seed = gen.random_seed if gen.random_seed is not None else random.getrandbits(62)
        return cls(
            temperature=0.0 if greedy else gen.temperature,
            top_k=gen.top_k,
            top_p=gen.top_p,
            min_p=gen.min_p,
            repetition_penalty=gen.repetition_penalty,
            presence_penalty=gen.presence_penalty,
            frequency_penalty=gen.frequency_penalty,
            logit_bias=dict(gen.logit_bias or {}),
            seed=seed % (2**63),
            max_new_tokens=gen.max_new_tokens,
            min_new_tokens=gen.min_new_tokens or 0,
            ignore_eos=gen.ignore_eos,
            stop_token_ids=list(gen.stop_token_ids or []),
            stop_words=list(gen.stop_words or []),
            include_stop_str_in_output=gen.include_stop_str_in_output,
            skip_special_tokens=gen.skip_special_tokens,
            logprobs=gen.logprobs,
            logprobs_mode=gen.logprobs_mode,
        )


MAX_LOGPROBS = 20  # top alternatives a request may ask for (OpenAI's top_logprobs bound)
LOGPROBS_MODES = ("raw", "processed")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


def _token_biases(bias) -> dict[int, float]:
    """logit_bias with int keys (JSON and the OpenAI API carry token ids as strings), checked."""
    if not isinstance(bias, dict):
        raise ConfigError(f"logit_bias: must map token ids to numbers, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"logit_bias: keys must be token ids, got {key!r}") from None
        if token < 0:
            raise ConfigError(f"logit_bias: token ids must be >= 0, got {token}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) > MAX_LOGIT_BIAS:
            raise ConfigError(f"logit_bias: values must be numbers in [-100, 100], got {value!r} for {key}")
        out[token] = float(value)
    return out
