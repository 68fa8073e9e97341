"""Configs validate on construction and name the bad field."""

import pytest

from specd.messages import ConfigError, GenerationConfig, PytorchEngineConfig, SpecStats, SpeculativeConfig
from specd.sampling_params import SamplingParams


@pytest.mark.parametrize("make, field", [
    (lambda: SpeculativeConfig(method="medusa"), "method"),
    (lambda: SpeculativeConfig(method="eagle3", num_speculative_tokens=3), "model"),
    (lambda: SpeculativeConfig(method="ngram", num_speculative_tokens=-1), "num_speculative_tokens"),
    (lambda: GenerationConfig(max_new_tokens=0), "max_new_tokens"),
    (lambda: GenerationConfig(top_p=0.0), "top_p"),
    (lambda: GenerationConfig(temperature=-1.0), "temperature"),
    (lambda: PytorchEngineConfig(block_size=48), "block_size"),
    (lambda: PytorchEngineConfig(tp=0), "tp"),
    (lambda: PytorchEngineConfig(dtype="int4"), "dtype"),
])
def test_bad_values_name_their_field(make, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        make()


@pytest.mark.parametrize("make, field", [
    (lambda: GenerationConfig(bad_words=["x"]), "bad_words"),
    (lambda: GenerationConfig(bad_token_ids=[3]), "bad_token_ids"),
    (lambda: GenerationConfig(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
    (lambda: PytorchEngineConfig(num_cpu_blocks=16), "num_cpu_blocks"),
    (lambda: SpeculativeConfig(method="ngram", quant_policy=8), "quant_policy"),
])
def test_unimplemented_lmdeploy_fields_are_refused_when_set(make, field):
    with pytest.raises(ConfigError, match=f"^{field}: is not supported"):
        make()


def test_unimplemented_lmdeploy_fields_construct_at_their_defaults():
    GenerationConfig(bad_words=None, bad_token_ids=None, spaces_between_special_tokens=True, logprobs=None)
    PytorchEngineConfig(enable_prefix_caching=False, num_cpu_blocks=0)
    SpeculativeConfig(method="ngram", quant_policy=0)


@pytest.mark.parametrize("make, field", [
    (lambda: GenerationConfig(logprobs=21), "logprobs"),
    (lambda: GenerationConfig(logprobs=-1), "logprobs"),
    (lambda: GenerationConfig(logprobs=True), "logprobs"),
    (lambda: GenerationConfig(logprobs=2, logprobs_mode="logits"), "logprobs_mode"),
])
def test_bad_logprobs_name_their_field(make, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        make()


def test_logprobs_reach_the_sampling_params():
    from specd.sampling_params import SamplingParams

    params = SamplingParams.from_generation_config(GenerationConfig(logprobs=3, logprobs_mode="processed"))
    assert (params.logprobs, params.logprobs_mode) == (3, "processed")
    assert SamplingParams.from_generation_config(GenerationConfig()).logprobs is None


def test_greedy_mapping_follows_lmdeploy():
    assert SamplingParams.from_generation_config(GenerationConfig()).is_greedy  # do_sample=False
    sampled = SamplingParams.from_generation_config(GenerationConfig(do_sample=True, temperature=0.7,
                                                                     random_seed=5))
    assert not sampled.is_greedy and sampled.temperature == 0.7 and sampled.seed == 5


def test_spec_stats_definitions():
    s = SpecStats()
    s.record_step(3, 2)
    s.record_step(3, 0)
    s.record_step(0, 0)  # a step without drafts is not a draft step
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 2)
    assert s.accepted_per_position == [1, 1, 0]
    assert s.mean_acceptance_length == 2.0 and s.acceptance_rate == pytest.approx(1 / 3)
    assert s.num_zero_draft_steps == 1 and s.mean_draft_length == pytest.approx(2.0)  # 6 drafts, 3 steps


def test_spec_stats_dict_only_adds_keys_and_survives_json():
    import json
    from dataclasses import asdict

    from specd.transport.redis_streams import _spec_stats

    s = SpecStats()
    s.record_step(2, 1)
    s.record_step(0, 0)
    d = s.to_dict()
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
            "acceptance_rate", "mean_acceptance_length"} <= set(d)
    assert d["num_zero_draft_steps"] == 1 and d["mean_draft_length"] == 1.0
    assert _spec_stats(json.dumps(asdict(s))) == s
    assert _spec_stats(json.dumps({"num_drafts": 1, "a_newer_field": 3})).num_drafts == 1  # skipped
    merged = SpecStats()
    merged.merge(s)
    assert merged.num_zero_draft_steps == 1


def test_speculative_config_adaptive_switch():
    assert SpeculativeConfig(method="ngram").adaptive
    assert not SpeculativeConfig(method="ngram", adaptive=False).adaptive
    with pytest.raises(ConfigError, match="adaptive"):
        SpeculativeConfig(method="ngram", adaptive="no")
