"""Tests for specd.sampling on tiny hand-made tensors."""

import math

import pytest
import torch
from scipy import stats

from specd.random import SALT_SAMPLE
from specd.sampling import (SamplingTensors, apply_logit_bias, apply_presence_frequency_penalties,
                            apply_repetition_penalty, processed_probs,
                            sample_from_probs)
from specd.sampling_params import SamplingParams


def tensors(*params: SamplingParams) -> SamplingTensors:
    return SamplingTensors.from_params(list(params))


def softmax(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).softmax(dim=-1)


def test_from_params_columns_and_dtypes():
    st = tensors(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                                repetition_penalty=1.2, seed=42),
                 SamplingParams())
    assert st.num_rows == 2
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.int64
    assert st.seeds.tolist() == [42, 0] and st.is_greedy.tolist() == [False, True]
    assert st.top_k.tolist() == [5, 0]
    assert st.top_p[0].item() == pytest.approx(0.9) and st.min_p[0].item() == pytest.approx(0.1)
    assert st.repetition_penalty[0].item() == pytest.approx(1.2)


def test_repeat_interleave_expands_rows_in_order():
    st = tensors(SamplingParams(seed=1), SamplingParams(temperature=1.0, seed=2),
                 SamplingParams(seed=3))
    expanded = st.repeat_interleave(torch.tensor([2, 0, 3]))
    assert expanded.seeds.tolist() == [1, 1, 3, 3, 3]
    assert expanded.is_greedy.tolist() == [True] * 5
    assert st.repeat_interleave([1, 2, 1], output_size=4).seeds.tolist() == [1, 2, 2, 3]
    assert st.index_select(torch.tensor([2, 0])).seeds.tolist() == [3, 1]


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    for t in (0.5, 1.0, 2.0):
        probs = processed_probs(logits, tensors(SamplingParams(temperature=t)))
        torch.testing.assert_close(probs[0], softmax([1 / t, 2 / t, 3 / t]))


def test_top_k_keeps_k_most_likely_and_ties_with_the_kth():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 3.0, 3.0, 2.0]])
    probs = processed_probs(logits, tensors(SamplingParams(temperature=1.0, top_k=2),
                                            SamplingParams(temperature=1.0, top_k=2)))
    torch.testing.assert_close(probs[0], torch.tensor([0.0, *softmax([4.0, 3.0]), 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.5, 0.5, 0.0]))
    # top_k >= V keeps everything.
    wide = processed_probs(logits[:1], tensors(SamplingParams(temperature=1.0, top_k=10)))
    torch.testing.assert_close(wide[0], softmax([1.0, 4.0, 3.0, 2.0]))


def test_top_p_keeps_smallest_set_reaching_the_mass():
    probs_in = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    logits = probs_in.log()
    cases = {0.45: [0, 1, 0, 0],  # the top token alone holds 0.5 >= 0.45
             0.6: [0, 1, 0, 1],  # 0.5 < 0.6, add 0.25
             0.8: [0, 1, 1, 1],  # 0.75 < 0.8, add 0.15
             0.01: [0, 1, 0, 0],  # the top token always stays
             1.0: [1, 1, 1, 1]}
    for top_p, kept in cases.items():
        probs = processed_probs(logits, tensors(SamplingParams(temperature=1.0, top_p=top_p)))[0]
        expected = probs_in[0] * torch.tensor(kept, dtype=torch.float32)
        torch.testing.assert_close(probs, expected / expected.sum())


def test_min_p_is_relative_to_the_top_probability():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    probs = processed_probs(probs_in.log(), tensors(SamplingParams(temperature=1.0, min_p=0.4)))
    # threshold 0.4 * 0.5 = 0.2: keeps 0.5 and 0.3
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_filters_compose_after_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0]])
    st = tensors(SamplingParams(temperature=0.5, top_k=4, top_p=0.99))
    scaled = softmax([4.0, 2.0, 0.0, -2.0])  # top-k on the tempered logits
    # the top two hold < 0.99, the top three >= 0.99: top-p keeps three of the four
    assert scaled[:2].sum() < 0.99 <= scaled[:3].sum()
    expected = torch.zeros(5)
    expected[:3] = scaled[:3] / scaled[:3].sum()
    torch.testing.assert_close(processed_probs(logits, st)[0], expected)


def test_greedy_rows_are_one_hot_at_first_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 2.0, 5.0], [0.0, 1.0, 2.0, 9.0]])
    st = tensors(SamplingParams(), SamplingParams(temperature=0.0, top_p=0.5),
                 SamplingParams(temperature=1.3, top_k=1))  # top_k == 1 counts as greedy
    probs = processed_probs(logits, st)
    assert torch.equal(probs, torch.eye(4)[[1, 0, 3]])


def test_mixed_rows_in_one_batch_match_rows_alone():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=1.5, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=0.6, top_k=5, top_p=0.9, min_p=0.05)]
    batched = processed_probs(logits, SamplingTensors.from_params(params))
    for i, p in enumerate(params):
        alone = processed_probs(logits[i:i + 1], SamplingTensors.from_params([p]))
        torch.testing.assert_close(batched[i:i + 1], alone)
    torch.testing.assert_close(batched.sum(dim=-1), torch.ones(6))
    assert batched.dtype == torch.float32


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    penalty = torch.tensor([2.0, 1.0, 4.0])
    prev = [torch.tensor([0, 1, 1]), torch.tensor([0, 3]), torch.tensor([], dtype=torch.int64)]
    out = apply_repetition_penalty(logits, prev, penalty)
    torch.testing.assert_close(out[0], torch.tensor([1.0, -2.0, 0.5, 3.0]))  # +: /2, -: *2, once
    torch.testing.assert_close(out[1], logits[1])  # penalty 1: unchanged
    torch.testing.assert_close(out[2], logits[2])  # no context
    # The padded [N, L] form with -1 padding gives the same result and leaves the input alone.
    padded = torch.tensor([[0, 1, 1], [0, 3, -1], [-1, -1, -1]])
    torch.testing.assert_close(apply_repetition_penalty(logits, padded, penalty), out)
    assert logits[0, 0].item() == 2.0


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer counts [V] to probs [V], on the cells with positive probability."""
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    mask = probs > 0
    expected = probs[mask].double() / probs[mask].double().sum() * counts.sum().item()
    return stats.chisquare(counts[mask].double().numpy(), expected.numpy()).pvalue


def test_sample_from_probs_matches_distribution():
    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.2, 0.05])
    num_draws = 40_000
    seeds = torch.arange(num_draws, dtype=torch.int64) + 12345
    positions = torch.full((num_draws,), 7, dtype=torch.int64)
    tokens = sample_from_probs(probs.expand(num_draws, -1), seeds, positions, SALT_SAMPLE)
    assert tokens.dtype == torch.int64 and tokens.shape == (num_draws,)
    counts = torch.bincount(tokens, minlength=8)
    assert chi_square_pvalue(counts, probs) > 1e-3
    # Also along one request's positions (one seed, many positions), as decoding consumes them.
    along = sample_from_probs(probs.expand(num_draws, -1), torch.full((num_draws,), 9),
                              torch.arange(num_draws), SALT_SAMPLE)
    assert chi_square_pvalue(torch.bincount(along, minlength=8), probs) > 1e-3


def test_sample_from_probs_one_hot_and_determinism():
    probs = torch.eye(5)[[4, 0, 2, 2]]
    seeds = torch.tensor([0, 1, 2, 3])
    positions = torch.tensor([0, 0, 5, 2**40])
    assert sample_from_probs(probs, seeds, positions, SALT_SAMPLE).tolist() == [4, 0, 2, 2]
    soft = torch.full((4, 5), 0.2)
    a = sample_from_probs(soft, seeds, positions, SALT_SAMPLE)
    assert torch.equal(a, sample_from_probs(soft, seeds, positions, SALT_SAMPLE))
    assert torch.equal(a[1:3], sample_from_probs(soft[1:3], seeds[1:3], positions[1:3], SALT_SAMPLE))


def test_processed_then_sampled_end_to_end():
    logits = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.1)]])
    num_draws = 20_000
    st = tensors(SamplingParams(temperature=1.0, top_p=0.8)).repeat_interleave([num_draws])
    probs = processed_probs(logits.expand(num_draws, -1), st)
    tokens = sample_from_probs(probs, torch.arange(num_draws), torch.zeros(num_draws, dtype=torch.int64),
                               SALT_SAMPLE)
    assert chi_square_pvalue(torch.bincount(tokens, minlength=3), torch.tensor([2 / 3, 1 / 3, 0.0])) > 1e-3


def test_a_vanishing_temperature_decodes_greedily_instead_of_nan():
    from specd.sampling_params import SamplingParams

    params = [SamplingParams(temperature=1e-40, seed=3), SamplingParams(temperature=1.0, seed=3)]
    assert params[0].is_greedy and not params[1].is_greedy
    logits = torch.tensor([[0.1, 2.0, -1.0], [0.1, 2.0, -1.0]])
    probs = processed_probs(logits, SamplingTensors.from_params(params))
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [0.0, 1.0, 0.0]  # one-hot on the argmax


def test_presence_and_frequency_penalties_count_the_output():
    """OpenAI's definition, row by row: logit - frequency * count - presence * (count > 0)."""
    logits = torch.randn(3, 6)
    outputs = [torch.tensor([2, 2, 5]), torch.tensor([], dtype=torch.long), torch.tensor([0, 1, 0, 0])]
    presence, frequency = torch.tensor([0.5, 1.0, -0.3]), torch.tensor([0.25, 2.0, 0.7])
    got = apply_presence_frequency_penalties(logits, outputs, presence, frequency)
    want = logits.clone()
    for i, out in enumerate(outputs):
        for token in set(out.tolist()):
            count = out.tolist().count(token)
            want[i, token] -= frequency[i] * count + presence[i]
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], logits[1])  # no output yet: nothing to penalise


def test_logit_bias_adds_to_the_named_tokens_of_each_row():
    logits = torch.randn(2, 5)
    got = apply_logit_bias(logits, [{1: 3.0, 4: -100.0}, {}])
    want = logits.clone()
    want[0, 1] += 3.0
    want[0, 4] -= 100.0
    torch.testing.assert_close(got, want)
    assert torch.equal(apply_logit_bias(logits, [{}, {}]), logits)


@pytest.mark.parametrize("field,value,message", [
    ("presence_penalty", 2.5, "presence_penalty: must be in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty: must be a finite number"),
    ("logit_bias", {"x": 1.0}, "logit_bias: keys must be token ids"),
    ("logit_bias", {3: 101}, "logit_bias: values must be numbers in [-100, 100]"),
    ("logit_bias", {-1: 1}, "logit_bias: token ids must be >= 0"),
])
def test_bad_penalties_and_biases_name_their_field(field, value, message):
    from specd.messages import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_logit_bias_keys_arrive_as_strings_and_become_token_ids():
    """JSON (the Redis stream, the OpenAI API) carries the keys as strings."""
    assert SamplingParams(logit_bias={"7": 2, "3": -1.5}).logit_bias == {7: 2.0, 3: -1.5}
