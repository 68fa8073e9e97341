"""What a request must satisfy before the engine queues it: a ConfigError naming the field,
which the services turn into HTTP 400 / gRPC INVALID_ARGUMENT, instead of a failure mid-step."""

from __future__ import annotations

from specd.messages import ConfigError
from specd.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], output_token_ids: list[int], params: SamplingParams, *,
                  vocab_size: int, max_model_len: int, grammar_without_backend: bool = False) -> None:
    """output_token_ids: tokens another engine already generated (a resumed request), or []."""
    if not prompt_token_ids:
        raise ConfigError("prompt: must contain at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ConfigError(f"prompt: {len(prompt_token_ids)} tokens leave no room to generate "
                          f"within the context length {max_model_len}")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise ConfigError(f"prompt: token ids must be in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ConfigError(f"logit_bias: token ids must be in [0, {vocab_size}), got {max(params.logit_bias)}")
    if grammar_without_backend:
        raise ConfigError("response_format: structured output needs a grammar backend")
    if output_token_ids:
        if (len(output_token_ids) >= params.max_new_tokens
                or len(prompt_token_ids) + len(output_token_ids) >= max_model_len):
            raise ConfigError(f"output_token_ids: {len(output_token_ids)} tokens already reach the request's limit")
        if min(output_token_ids) < 0 or max(output_token_ids) >= vocab_size:
            raise ConfigError(f"output_token_ids: token ids must be in [0, {vocab_size})")
