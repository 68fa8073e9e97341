"""Replay drafter (bench only): the target's own greedy continuation, corrupted at a set rate.

Not a real proposer: it needs the answer in advance. The benchmark runs the target greedily once,
writes each prompt's continuation to a references file, and this proposer drafts those tokens,
each position corrupted independently with probability `corrupt_rate` (drawn once per reference
from a generator seeded by (seed, prompt), so reruns draft the same tokens; a step's drafts are a
slice, so the drafter's own cost stays out of the overhead measured). The acceptance is then
known: with k drafts a step, the expected acceptance length is sum_{j=0..k} (1 - r)^j
(`expected_acceptance_length`; `corrupt_rate_for` inverts it), and the gap between the measured
speedup and that ideal is the system's overhead.

Greedy requests only. A sequence whose history leaves its reference keeps drafting k tokens
(repeats of its last token) so the step keeps its shape; `num_diverged` counts them.

References file: JSON lines, one object per prompt: {"prompt": [ids], "output": [ids]}.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from specd.proposers.base import DraftProposal, DraftRequest, greedy_proposals
from specd.sampling_params import SamplingParams


def expected_acceptance_length(corrupt_rate: float, k: int) -> float:
    """Tokens emitted per step when each draft survives with probability 1 - r: sum_{j=0..k} (1-r)^j."""
    keep = 1.0 - corrupt_rate
    return sum(keep ** j for j in range(k + 1))


def corrupt_rate_for(acceptance_length: float, k: int) -> float:
    """The corruption rate whose expected acceptance length at k drafts per step is the one given."""
    if not 1.0 <= acceptance_length <= k + 1:
        raise ValueError(f"acceptance_length: must be in [1, {k + 1}] for k={k}, got {acceptance_length}")
    lo, hi = 0.0, 1.0  # expected_acceptance_length decreases in r
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_acceptance_length(mid, k) > acceptance_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def load_references(path: str | Path) -> dict[tuple[int, ...], list[int]]:
    """prompt -> greedy output, from a JSON-lines references file."""
    refs: dict[tuple[int, ...], list[int]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                entry = json.loads(line)
                refs[tuple(int(t) for t in entry["prompt"])] = [int(t) for t in entry["output"]]
    return refs


def write_references(path: str | Path, pairs: list[tuple[list[int], list[int]]]) -> None:
    """Write (prompt, greedy output) pairs as a references file."""
    with open(path, "w", encoding="utf-8") as f:
        for prompt, output in pairs:
            f.write(json.dumps({"prompt": list(prompt), "output": list(output)}) + "\n")


def _key_hash(tokens: tuple[int, ...]) -> int:
    return int.from_bytes(hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(),
                                          digest_size=8).digest(), "little") >> 1


class _Replay:
    """One sequence: its full reference (prompt + output) and how far the history matches it."""

    def __init__(self) -> None:
        self.history: list[int] = []
        self.reference: list[int] | None = None  # prompt + greedy output
        self.drafted: list[int] = []  # the reference, corrupted where drawn: drafts at position p
        self.diverged = False


class ReplayProposer:
    """Drafts the reference continuation; corrupts position p iff hash(seed, prompt, p) < rate."""

    method = "replay"
    hidden_kind = "none"

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int,
                 corrupt_rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= corrupt_rate <= 1.0:
            raise ValueError(f"corrupt_rate: must be in [0, 1], got {corrupt_rate}")
        if vocab_size < 2:
            raise ValueError("vocab_size: must be >= 2 (a corrupted draft needs another token)")
        self.references = references
        self.prompt_lengths = sorted({len(p) for p in references})
        self.vocab_size = vocab_size
        self.corrupt_rate = corrupt_rate
        self.seed = seed
        self.draft_constraints = None  # no draft masking: the verifier's masks still apply
        self._seqs: dict[int, _Replay] = {}
        self.num_diverged = 0

    def open(self, seq_id: int, params: SamplingParams, grammar=None) -> None:
        self._seqs[seq_id] = _Replay()

    def close(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def _attach(self, seq: _Replay) -> int:
        """Find the reference whose prompt starts the history (the first step brings prompt + 1);
        returns the prompt's length (0 when none matches)."""
        for n in self.prompt_lengths:
            if n >= len(seq.history):
                break
            output = self.references.get(tuple(seq.history[:n]))
            if output is not None:
                seq.reference = list(seq.history[:n]) + output
                seq.drafted = self._corrupted(seq.reference, _key_hash(tuple(seq.history[:n])))
                return n
        return 0

    def _corrupted(self, reference: list[int], key_hash: int) -> list[int]:
        """The reference with each position replaced, with probability corrupt_rate, by another
        token (a greedy target rejects it for certain); deterministic in (seed, prompt)."""
        ref = np.asarray(reference, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64([self.seed, key_hash]))
        corrupt = rng.random(len(ref)) < self.corrupt_rate
        offsets = rng.integers(1, self.vocab_size, len(ref))  # in [1, V): never the reference's token
        return np.where(corrupt, (ref + offsets) % self.vocab_size, ref).tolist()

    def _drafts(self, seq: _Replay, k: int) -> list[int]:
        if seq.reference is None or seq.diverged:
            return [seq.history[-1]] * k
        pos = len(seq.history)
        drafts = seq.drafted[pos:pos + k]
        return drafts + [seq.history[-1]] * (k - len(drafts))

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        drafts: list[list[int]] = []
        for req in requests:
            seq = self._seqs[req.seq_id]
            start = len(seq.history)
            seq.history.extend(req.new_token_ids)
            if seq.reference is None and not seq.diverged:
                start = self._attach(seq)
                if seq.reference is None:
                    seq.diverged = True
                    self.num_diverged += 1
            if seq.reference is not None and not seq.diverged:
                if seq.history[start:] != seq.reference[start:len(seq.history)]:
                    seq.diverged = True
                    self.num_diverged += 1
            drafts.append(self._drafts(seq, req.num_draft_tokens) if req.num_draft_tokens > 0 else [])
        return greedy_proposals(drafts)
