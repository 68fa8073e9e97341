"""User-facing configuration and result types, with lmdeploy's field names.

`from lmdeploy.messages import SpeculativeConfig` becomes `from specd.messages import
SpeculativeConfig`; every dataclass validates itself on construction and names the bad field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

SPECULATIVE_METHODS = ("eagle3", "deepseek_mtp", "qwen3_5_mtp", "draft_model", "ngram", "replay")
# "replay" is bench-only (specd/proposers/replay.py): it drafts a precomputed greedy continuation.

# Temperatures this small sample the argmax anyway, and dividing logits by them overflows to NaN
# (as vLLM does, they decode greedily).
GREEDY_BELOW_TEMPERATURE = 1e-5


class ConfigError(ValueError):
    """A configuration or request parameter is invalid; the message names the field."""


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


def _refuse_unsupported(config: Any, defaults: dict[str, Any]) -> None:
    """lmdeploy's fields that specd does not implement yet: kept so that lmdeploy code constructs
    the config unchanged, refused when set, so no setting is silently ignored."""
    for name, default in defaults.items():
        _require(getattr(config, name) == default, name,
                 f"is not supported by specd yet; leave it at {default!r}")


@dataclass
class PytorchEngineConfig:
    """How the target model runs. Field names follow lmdeploy's PytorchEngineConfig."""

    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 ("auto": bf16 on CUDA, fp32 on CPU)
    tp: int = 1  # tensor-parallel ranks; > 1 needs a torch.distributed group of tp processes
    session_len: int | None = None  # max tokens per sequence; None: the model's context length
    max_batch_size: int = 128
    cache_max_entry_count: float = 0.8  # fraction of free GPU memory for the KV cache
    block_size: int = 64  # tokens per KV-cache block
    num_gpu_blocks: int = 0  # 0: derived from cache_max_entry_count (GPU) or session_len (CPU)
    num_cpu_blocks: int = 0  # not supported: no host-memory KV swap
    max_prefill_token_num: int = 8192
    device_type: str = "auto"  # auto | cpu | cuda
    eager_mode: bool = False  # False: CUDA graphs for verify/decode steps on CUDA (CPU: always eager)
    # Full blocks of committed tokens are kept and shared by prompts that start with them (the
    # target's cache; engines whose drafter needs the target's hidden states prefill in full).
    enable_prefix_caching: bool = True
    runner: Literal["auto", "llama", "hf"] = "auto"  # "hf": transformers' AutoModelForCausalLM
    download_dir: str | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "float32", "float16", "bfloat16"), "dtype",
                 f"expected auto, float32, float16 or bfloat16, got {self.dtype!r}")
        _require(isinstance(self.tp, int) and self.tp >= 1, "tp", f"must be >= 1, got {self.tp!r}")
        _require(self.max_batch_size >= 1, "max_batch_size", f"must be >= 1, got {self.max_batch_size}")
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
                 f"must be a power of two, got {self.block_size}")
        _require(self.session_len is None or self.session_len >= 1, "session_len",
                 f"must be >= 1, got {self.session_len}")
        _require(0.0 < self.cache_max_entry_count <= 1.0, "cache_max_entry_count",
                 f"must be in (0, 1], got {self.cache_max_entry_count}")
        _require(self.num_gpu_blocks >= 0, "num_gpu_blocks", "must be >= 0")
        _require(self.device_type in ("auto", "cpu", "cuda"), "device_type",
                 f"expected auto, cpu or cuda, got {self.device_type!r}")
        _require(self.runner in ("auto", "llama", "hf"), "runner",
                 f"expected auto, llama or hf, got {self.runner!r}")
        _refuse_unsupported(self, {"num_cpu_blocks": 0})


@dataclass
class SpeculativeConfig:
    """Which drafter proposes tokens and how many per step (lmdeploy's SpeculativeConfig).

    `model` is the draft checkpoint (eagle3, draft_model); the MTP methods read their head from
    the target checkpoint when `model` is empty. ngram needs no model.
    """

    method: str = "eagle3"
    num_speculative_tokens: int = 1
    model: str = ""
    quant_policy: int = 0  # not supported: the draft KV cache is not quantized
    prompt_lookup_min: int = 1  # ngram: shortest suffix to match
    prompt_lookup_max: int = 4  # ngram: longest suffix to match
    replay_references: str = ""  # replay (bench only): JSON-lines file of prompt -> greedy output
    replay_corrupt_rate: float = 0.0  # replay: probability that a draft is corrupted
    # Each step picks k per sequence in [0, num_speculative_tokens] from its acceptance so far and
    # the measured step costs, k = 0 where drafting does not pay (specd/engine/draft_policy.py);
    # False: num_speculative_tokens every step (not an lmdeploy field).
    adaptive: bool = True

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS, "method",
                 f"expected one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        _require(isinstance(self.num_speculative_tokens, int) and 0 <= self.num_speculative_tokens <= 32,
                 "num_speculative_tokens", f"must be an integer in [0, 32], got {self.num_speculative_tokens!r}")
        _require(self.method not in ("eagle3", "draft_model") or bool(self.model), "model",
                 f"method {self.method!r} needs a draft model path")
        _require(isinstance(self.adaptive, bool), "adaptive", f"must be a bool, got {self.adaptive!r}")
        _require(0.0 <= self.replay_corrupt_rate <= 1.0, "replay_corrupt_rate",
                 f"must be in [0, 1], got {self.replay_corrupt_rate}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
                 f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                 f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        _refuse_unsupported(self, {"quant_policy": 0})


@dataclass
class GenerationConfig:
    """Per-request generation parameters (lmdeploy's GenerationConfig field names).

    do_sample=False is greedy decoding whatever the temperature; temperature 0 is greedy too.
    """

    n: int = 1
    max_new_tokens: int = 512
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's, over the output: [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's, over the output: [-2, 2]
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    bad_words: list[str] | None = None  # not supported yet (refused when set)
    stop_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None  # not supported yet (refused when set)
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only True: special tokens are decoded as written
    # Per output token its logprob and this many top alternatives (0..20; None: off), on
    # Response.logprobs. logprobs_mode (a specd extension, as vLLM's): "raw" log_softmax of the
    # target's logits, or "processed": log of the distribution the token was sampled from.
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    response_format: dict | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _require(self.n == 1, "n", "only n=1 is supported")
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens",
                 f"must be a positive integer, got {self.max_new_tokens!r}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
                 f"must be a non-negative integer (0 disables), got {self.top_k!r}")
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(self.repetition_penalty > 0.0, "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2.0 <= getattr(self, name) <= 2.0, name, f"must be in [-2, 2], got {getattr(self, name)}")
        _require(self.min_new_tokens is None or 0 <= self.min_new_tokens <= self.max_new_tokens,
                 "min_new_tokens", "must be between 0 and max_new_tokens")
        _require(self.random_seed is None or isinstance(self.random_seed, int), "random_seed",
                 f"must be an integer, got {self.random_seed!r}")
        _refuse_unsupported(self, {"bad_words": None, "bad_token_ids": None,
                                   "spaces_between_special_tokens": True})
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                           and 0 <= self.logprobs <= 20), "logprobs",
                 f"must be None or an integer in [0, 20], got {self.logprobs!r}")
        _require(self.logprobs_mode in ("raw", "processed"), "logprobs_mode",
                 f"expected raw or processed, got {self.logprobs_mode!r}")

    @property
    def is_greedy(self) -> bool:
        return (not self.do_sample) or self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


@dataclass
class SpecStats:
    """Per-request speculation figures.

    num_drafts: verify steps that checked at least one draft token; num_draft_tokens: drafts
    proposed; num_accepted_tokens: drafts kept; accepted_per_position[i]: steps whose i-th draft
    was accepted; num_zero_draft_steps: verify steps that checked no draft (k = 0 chosen where
    drafting did not pay, or the drafter proposed none). Acceptance length (accepted + 1 per step,
    bonus/recovered token counted) is derived, as are acceptance rate (accepted / drafted) and
    mean draft length (drafts per verify step, k = 0 steps included).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_zero_draft_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def mean_draft_length(self) -> float:
        steps = self.num_drafts + self.num_zero_draft_steps
        return self.num_draft_tokens / steps if steps else 0.0

    def record_step(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            self.num_zero_draft_steps += 1
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_zero_draft_steps += other.num_zero_draft_steps
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        for i, v in enumerate(other.accepted_per_position):
            mine[i] += v
        self.accepted_per_position = mine

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "num_zero_draft_steps": self.num_zero_draft_steps,
            "mean_draft_length": self.mean_draft_length,
        }


@dataclass
class Response:
    """One finished generation (lmdeploy's Response fields plus spec_stats)."""

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] = field(default_factory=list)
    index: int = 0
    spec_stats: SpecStats | None = None
    # With GenerationConfig(logprobs=N): per output token {token_id: logprob}, the chosen token
    # first, then its top N alternatives (lmdeploy's shape); None otherwise.
    logprobs: list[dict[int, float]] | None = None

    def __repr__(self) -> str:
        return (f"Response(text={self.text!r}, generate_token_len={self.generate_token_len}, "
                f"input_token_len={self.input_token_len}, finish_reason={self.finish_reason!r}, "
                f"spec_stats={self.spec_stats.to_dict() if self.spec_stats else None})")
