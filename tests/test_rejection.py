"""Tests for specd.rejection: greedy exactness, and statistical losslessness with a power check.

The losslessness tests treat the target and the drafter as first-order Markov chains over a tiny
vocabulary: p(x_{t+1} | x_t) = P[x_t], with a first distribution for the token after the prompt.
target_probs[:, j] for j >= 1 is then P[d_{j-1}], the conditional a real verifier computes at draft
j - 1, so the joint of the first two emitted tokens must be first[x0] * P[x0, x1].
"""

from dataclasses import dataclass

import pytest
import torch
from scipy import stats

import specd.rejection as rejection
from specd.random import SALT_DRAFT, SALT_SAMPLE
from specd.rejection import rejection_sample
from specd.sampling import SamplingTensors, processed_probs, sample_from_probs
from specd.sampling_params import SamplingParams

VOCAB = 6
NUM_DRAWS = 40_000
START = 50  # absolute position of the first token emitted in the tests' first step


def one_hot(tokens: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """[B, K + 1] token ids -> [B, K + 1, V] one-hot target distributions (greedy target)."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def greedy(target: list[list[int]], drafts: list[list[int]], num_drafts: list[int],
           draft_probs: torch.Tensor | None = None) -> rejection.RejectionResult:
    batch = len(target)
    return rejection_sample(one_hot(target), torch.tensor(drafts), draft_probs,
                            torch.tensor(num_drafts), torch.arange(batch) + 100,
                            torch.full((batch,), START))


# ---------------------------------------------------------------------------------------------
# Greedy exactness


def test_greedy_full_accept_gives_bonus():
    r = greedy([[3, 1, 4, 1]], [[3, 1, 4]], [3])
    assert r.output_token_ids.tolist() == [[3, 1, 4, 1]]
    assert r.num_accepted.tolist() == [3] and r.num_emitted.tolist() == [4]


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_greedy_reject_at_position(reject_at):
    target = [3, 1, 4, 1]
    drafts = target[:3]
    drafts[reject_at] = (drafts[reject_at] + 1) % VOCAB
    r = greedy([target], [drafts], [3])
    expected = target[:reject_at + 1] + [-1] * (3 - reject_at)
    assert r.output_token_ids.tolist() == [expected]
    assert r.num_accepted.tolist() == [reject_at] and r.num_emitted.tolist() == [reject_at + 1]


def test_greedy_variable_num_drafts_and_padding_ignored():
    target = [[2, 5, 0, 1]] * 4
    drafts = [[2, 5, 0], [2, 5, -1], [2, 3, 0], [-1, -1, -1]]  # -1 and 3 past n are padding
    r = greedy(target, drafts, [3, 2, 1, 0])
    assert r.output_token_ids.tolist() == [[2, 5, 0, 1], [2, 5, 0, -1], [2, 5, -1, -1],
                                           [2, -1, -1, -1]]
    assert r.num_accepted.tolist() == [3, 2, 1, 0]
    assert r.num_emitted.tolist() == [4, 3, 2, 1]


def test_zero_drafts_and_k_zero_sample_like_plain_decoding():
    probs = torch.softmax(torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    seeds, positions = torch.arange(8), torch.arange(8) * 3
    plain = sample_from_probs(probs, seeds, positions, SALT_SAMPLE)
    k_zero = rejection_sample(probs[:, None], torch.zeros(8, 0, dtype=torch.int64), None,
                              torch.zeros(8, dtype=torch.int64), seeds, positions)
    assert k_zero.output_token_ids.tolist() == plain[:, None].tolist()
    padded = torch.cat([probs[:, None]] * 3, dim=1)  # K = 2, but no drafts this step
    no_drafts = rejection_sample(padded, torch.zeros(8, 2, dtype=torch.int64), None,
                                 torch.zeros(8, dtype=torch.int64), seeds, positions)
    assert no_drafts.output_token_ids[:, 0].tolist() == plain.tolist()
    assert (no_drafts.output_token_ids[:, 1:] == -1).all()
    assert no_drafts.num_emitted.tolist() == [1] * 8


def test_greedy_exact_with_probabilistic_drafts():
    q = torch.softmax(torch.randn(3, 3, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    q[0, 1] = torch.eye(VOCAB)[5]  # q(d) = 1 on the argmax draft
    q[1, 0] = torch.eye(VOCAB)[4] * (1 - 1e-30) + 1e-30  # q(argmax) ~ 0: p / q ~ huge
    r = greedy([[1, 5, 2, 3]] * 3, [[1, 5, 2], [1, 5, 0], [0, 5, 2]], [3, 3, 3], draft_probs=q)
    assert r.output_token_ids.tolist() == [[1, 5, 2, 3], [1, 5, 2, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize("u", [2.0 ** -24, 1.0 - 2.0 ** -24])
def test_greedy_exact_at_extreme_uniforms(monkeypatch, u):
    # The largest and smallest uniforms hashed_uniform can return: accept argmax, reject the rest.
    monkeypatch.setattr(rejection, "hashed_uniform",
                        lambda seeds, positions, salt, num: torch.full((len(seeds), num), u))
    r = greedy([[3, 1, 4, 1]] * 2, [[3, 1, 4], [3, 2, 4]], [3, 3])
    assert r.output_token_ids.tolist() == [[3, 1, 4, 1], [3, 1, -1, -1]]


def test_one_hot_target_shortcut_equals_the_general_path():
    """one_hot_target=True (all requests greedy) draws no noise and returns exactly what the
    general path returns, for one-hot and sampled drafts, every acceptance pattern and padding."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(200):
        batch, k = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(0, 5, (1,), generator=gen))
        target_ids = torch.randint(0, VOCAB, (batch, k + 1), generator=gen)
        # drafts that often agree with the target, so long accepted runs are exercised too
        agree = torch.rand(batch, k, generator=gen) < 0.7
        drafts = torch.where(agree, target_ids[:, :k], torch.randint(0, VOCAB, (batch, k), generator=gen))
        num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
        draft_probs = (torch.rand(batch, k, VOCAB, generator=gen) + 0.01) if trial % 2 else None
        if draft_probs is not None:
            draft_probs /= draft_probs.sum(-1, keepdim=True)
        args = (one_hot(target_ids.tolist()), drafts, draft_probs, num_drafts,
                torch.randint(0, 2**62, (batch,), generator=gen), torch.randint(0, 1000, (batch,), generator=gen))
        general, shortcut = rejection_sample(*args), rejection_sample(*args, one_hot_target=True)
        assert torch.equal(general.output_token_ids, shortcut.output_token_ids), trial
        assert torch.equal(general.num_accepted, shortcut.num_accepted), trial


def test_one_hot_target_shortcut_draws_no_noise(monkeypatch):
    def no_noise(*args, **kwargs):
        raise AssertionError("noise drawn for a one-hot target")

    monkeypatch.setattr(rejection, "hashed_uniform", no_noise)
    monkeypatch.setattr(rejection, "sample_from_probs", no_noise)
    out = rejection_sample(one_hot([[1, 2, 3]]), torch.tensor([[1, 4]]), None, torch.tensor([2]),
                           torch.tensor([7]), torch.tensor([START]), one_hot_target=True)
    assert out.output_token_ids.tolist() == [[1, 2, -1]] and out.num_accepted.tolist() == [1]


def test_result_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(2)
    target = torch.softmax(torch.randn(5, 4, VOCAB, generator=gen), -1)
    q = torch.softmax(torch.randn(5, 3, VOCAB, generator=gen), -1)
    drafts = torch.randint(0, VOCAB, (5, 3), generator=gen)
    n, seeds, positions = torch.tensor([3, 1, 0, 2, 3]), torch.arange(5) * 11, torch.arange(5) + 7
    full = rejection_sample(target, drafts, q, n, seeds, positions)
    for i in range(5):
        alone = rejection_sample(target[i:i + 1], drafts[i:i + 1], q[i:i + 1], n[i:i + 1],
                                 seeds[i:i + 1], positions[i:i + 1])
        assert torch.equal(alone.output_token_ids[0], full.output_token_ids[i])


# ---------------------------------------------------------------------------------------------
# Statistical losslessness


@dataclass
class MarkovChain:
    """A toy language model: first [V] after the prompt, transition [V, V] afterwards."""

    first: torch.Tensor  # [V]
    transition: torch.Tensor  # [V, V], row x: distribution of the next token after x

    def joint_of_first_two(self) -> torch.Tensor:  # [V, V]
        return self.first[:, None] * self.transition


def random_chain(gen: torch.Generator, params: SamplingParams | None = None) -> MarkovChain:
    """Random logits, processed by `params` through processed_probs (plain softmax if None)."""
    logits = torch.randn(VOCAB + 1, VOCAB, generator=gen) * 1.5  # [V + 1, V]
    params = params or SamplingParams(temperature=1.0)
    probs = processed_probs(logits, SamplingTensors.from_params([params] * (VOCAB + 1)))
    return MarkovChain(first=probs[0], transition=probs[1:])


def speculative_step(target: MarkovChain, drafter: MarkovChain, prev: torch.Tensor | None,
                     num_drafts: torch.Tensor, max_drafts: int, one_hot_drafts: bool,
                     seeds: torch.Tensor, positions: torch.Tensor) -> rejection.RejectionResult:
    """Draft up to max_drafts tokens per row from `drafter`, verify them against `target`.

    prev: [N] the last committed token (None: right after the prompt). Drafts are sampled with
    SALT_DRAFT (d ~ q, q passed along) or taken greedily (argmax of q, passed as one-hot drafts).
    """
    num = len(seeds)
    p_rows = [target.first.expand(num, -1) if prev is None else target.transition[prev]]
    q_rows = [drafter.first.expand(num, -1) if prev is None else drafter.transition[prev]]
    drafts = []
    for j in range(max_drafts):
        if one_hot_drafts:
            token = q_rows[j].argmax(dim=-1)
        else:
            token = sample_from_probs(q_rows[j], seeds, positions + j, SALT_DRAFT)
        drafts.append(token)
        p_rows.append(target.transition[token])
        q_rows.append(drafter.transition[token])
    return rejection_sample(torch.stack(p_rows, dim=1), torch.stack(drafts, dim=1),
                            None if one_hot_drafts else torch.stack(q_rows[:-1], dim=1),
                            num_drafts, seeds, positions)


def first_two_tokens(target: MarkovChain, drafter: MarkovChain, max_drafts: int,
                     one_hot_drafts: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two emitted tokens of NUM_DRAWS independent requests, [N] each.

    Requests draw 0..max_drafts drafts (varied by seed). When the first step emits one token, a
    second speculative step (as the engine would run it) supplies the second.
    """
    seeds = torch.arange(NUM_DRAWS, dtype=torch.int64) * 7 + 1000
    positions = torch.full((NUM_DRAWS,), START, dtype=torch.int64)
    num_drafts = seeds % (max_drafts + 1)
    step1 = speculative_step(target, drafter, None, num_drafts, max_drafts, one_hot_drafts,
                             seeds, positions)
    x0 = step1.output_token_ids[:, 0]
    step2 = speculative_step(target, drafter, x0, torch.full_like(num_drafts, max_drafts),
                             max_drafts, one_hot_drafts, seeds, positions + 1)
    x1 = torch.where(step1.num_emitted >= 2, step1.output_token_ids[:, 1],
                     step2.output_token_ids[:, 0])
    return x0, x1


def empirical_joint(x0: torch.Tensor, x1: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    """Counts of each (first, second) token pair: [N] x 2 -> [V, V] int64."""
    return torch.bincount(x0 * vocab + x1, minlength=vocab * vocab).view(vocab, vocab)


def joint_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square p-value of counts [V, V] against probabilities [V, V].

    A pair of probability 0 that occurs gives 0. Cells expected below 5 are pooled into one, so
    the chi-square approximation holds.
    """
    counts, probs = counts.flatten().double(), expected_probs.flatten().double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * counts.sum()
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    observed_cells = torch.cat([counts[big], counts[small].sum()[None]])
    expected_cells = torch.cat([expected[big], expected[small].sum()[None]])
    keep = expected_cells > 0
    return stats.chisquare(observed_cells[keep].numpy(), expected_cells[keep].numpy()).pvalue


CHAIN_PARAMS = {
    "plain": None,
    "top_k": SamplingParams(temperature=0.8, top_k=3),
    "top_p": SamplingParams(temperature=1.2, top_p=0.75),
}


def chains(kind: str, seed: int) -> tuple[MarkovChain, MarkovChain]:
    gen = torch.Generator().manual_seed(seed)
    return random_chain(gen, CHAIN_PARAMS[kind]), random_chain(gen)


@pytest.mark.parametrize("kind", list(CHAIN_PARAMS))
@pytest.mark.parametrize("max_drafts", [2, 3])
@pytest.mark.parametrize("one_hot_drafts", [False, True], ids=["sampled", "one_hot"])
def test_lossless_joint_of_first_two_tokens(kind, max_drafts, one_hot_drafts):
    target, drafter = chains(kind, seed=10 + max_drafts)
    x0, x1 = first_two_tokens(target, drafter, max_drafts, one_hot_drafts)
    assert joint_pvalue(empirical_joint(x0, x1), target.joint_of_first_two()) > 1e-3


@pytest.mark.parametrize("one_hot_drafts", [False, True], ids=["sampled", "one_hot"])
def test_planted_bug_accept_every_draft_is_detected(monkeypatch, one_hot_drafts):
    monkeypatch.setattr(rejection, "accept_drafts", lambda p, q, u: torch.ones_like(p, dtype=torch.bool))
    target, drafter = chains("plain", seed=12)
    x0, x1 = first_two_tokens(target, drafter, 2, one_hot_drafts)
    assert joint_pvalue(empirical_joint(x0, x1), target.joint_of_first_two()) < 1e-6


def test_planted_bug_recovered_from_p_instead_of_residual_is_detected(monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    target, drafter = chains("plain", seed=12)
    x0, x1 = first_two_tokens(target, drafter, 2, one_hot_drafts=False)
    assert joint_pvalue(empirical_joint(x0, x1), target.joint_of_first_two()) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(4)
    batch, k = 4096, 3
    target = torch.softmax(torch.randn(batch, k + 1, 32, generator=gen), -1)
    q = torch.softmax(torch.randn(batch, k, 32, generator=gen), -1)
    drafts = torch.randint(0, 32, (batch, k), generator=gen)
    n, seeds = torch.randint(0, k + 1, (batch,), generator=gen), torch.arange(batch) * 5
    positions = torch.randint(0, 10_000, (batch,), generator=gen)
    args = (target, drafts, q, n, seeds, positions)
    cpu = rejection_sample(*args)
    gpu = rejection_sample(*(a.cuda() for a in args))
    assert gpu.output_token_ids.device.type == "cuda"
    assert torch.equal(cpu.output_token_ids, gpu.output_token_ids.cpu())
    assert torch.equal(cpu.num_accepted, gpu.num_accepted.cpu())
