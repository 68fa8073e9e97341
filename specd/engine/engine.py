"""The speculative-decoding engine: admit, draft, verify, commit — one step for the whole batch.

The same core runs in-process (pipeline, tests) and inside the verifier service, where the
proposer is a client of the remote drafter. Greedy output is token-for-token the target's own;
sampled output follows the target distribution exactly (see specd/rejection.py).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from specd import settings
from specd.engine.admission import defer_shared_prompts, take_admissions
from specd.engine.constraints import ConstraintTracker
from specd.engine.device_clock import DeviceClock
from specd.engine.draft_policy import DraftLengthPolicy
from specd.engine.drafting import Drafting, default_carry, plan_draft_lengths
from specd.engine.first_token import sample_first_tokens
from specd.engine.logprobs import TokenLogprob, asking, verify_logprobs
from specd.engine.overlap import decode_ahead_blocks, HostRows, next_decode_batch, PinnedRing, StepInFlight
from specd.engine.request_checks import check_request
from specd.engine.sequence import Sequence, SequenceStatus
from specd.engine.staging import VerifyStaging
from specd.engine.stats import EngineStats
from specd.engine.stop import StopChecker
from specd.engine.verify import BatchSamplingTensors, pad_drafts, target_probs_of, verify_logits
from specd.grammar.backend import GrammarSpec
from specd.messages import SpecStats
from specd.models.base import SequenceChunk, TargetRunner
from specd.proposers.base import DraftProposal, Proposer
from specd.rejection import RejectionResult, rejection_sample
from specd.sampling_params import SamplingParams

log = logging.getLogger("specd.engine")


class SpecEngine:
    """Continuous batching over a target runner and an optional proposer."""

    def __init__(self, runner: TargetRunner, proposer: Proposer | None, num_speculative_tokens: int,
                 *, max_batch_size: int, max_model_len: int, tokenizer=None,
                 max_prefill_tokens: int = 8192, grammar_backend=None, draft_ahead: bool | None = None,
                 draft_carry: int | None = None, adaptive: bool = True,
                 draft_policy: DraftLengthPolicy | None = None) -> None:
        """draft_ahead: send the next step's draft requests right after each commit where the
        proposer answers asynchronously (drafting.py); None reads SPECD_DRAFT_AHEAD (default on;
        "0" off, for A/B measurements). draft_carry: drafts asked past k per request, carried
        to the next step where it accepts all (drafting.py); None: drafting.default_carry.
        adaptive / draft_policy: k per sequence and step where it pays, else the most budget and
        cache allow (draft_policy.py; False: fixed k); a policy built by the caller (tests)."""
        self.runner = runner
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.max_batch_size = max_batch_size
        capacity = getattr(runner, "max_cached_tokens", None)
        if capacity is not None and capacity < max_model_len:
            # A sequence must fit the cache alone, or one long request would stop the engine: the
            # cache's size is the context length then (requests past it get a clear error).
            log.warning("the KV cache holds %d tokens, fewer than the context length %d: serving a "
                        "context of %d (raise num_gpu_blocks / cache_max_entry_count or lower session_len)",
                        capacity, max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.stop = StopChecker(runner.info.eos_token_ids, max_model_len, tokenizer)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._hidden_kind = proposer.hidden_kind if proposer is not None else "none"
        self.constraints = ConstraintTracker(grammar_backend, max_model_len)
        if draft_ahead is None:
            draft_ahead = settings.DRAFT_AHEAD.get()
        if draft_carry is None:
            draft_carry = default_carry(proposer, self.num_speculative_tokens)
        self._batch_sampling = BatchSamplingTensors()
        # k per running sequence, planned together for the cache as it is (plan_draft_lengths); None
        # once the cache changed (a commit, admission, preemption, abort).
        self._ks: dict[int, int] | None = None
        self._staging = VerifyStaging(runner)  # the next verify batch, staged while its drafts are out
        device = getattr(runner, "device", torch.device("cpu"))
        # Stats: the device's own time of each verify step. Two clocks in turn: with a decode step
        # in flight the next one is marked before the first is read (overlap.py).
        self._clocks = (DeviceClock(device), DeviceClock(device))
        self._clock = self._clocks[0]
        self._marking: DeviceClock | None = None  # the clock of the verify forward being launched
        if hasattr(runner, "on_launch"):  # the runner marks its forward's first device work
            runner.on_launch = self._mark_launch
        # Decode steps queued before the last one's tokens reach the host (overlap.py), on runners
        # that read a chunk's first token from the device: steps where no sequence drafts (no
        # proposer, or adaptive drafting gave every sequence k = 0), where the drafter needs no
        # hidden rows (a decode step queued ahead keeps none; the drafter catches up on tokens alone).
        self._overlap = self._hidden_kind == "none" and getattr(runner, "takes_first_token_ids", False)
        self._in_flight: StepInFlight | None = None
        # Prompts start from the cached blocks of earlier ones (kv_cache.py) unless the drafter
        # needs the target's hidden state of every prompt token, which only a full prefill gives.
        self._prefix_caching = getattr(runner, "prefix_caching", False) and self._hidden_kind == "none"
        self._failed: list[Sequence] = []  # failed in this step (_fail_lost_constraints): _take_failed
        self._pinned = PinnedRing(device, max_batch_size)
        self.drafting = Drafting(proposer, lambda seq: self._num_drafts(seq), ahead=draft_ahead,
                                 carry=draft_carry if proposer is not None else 0)
        self.draft_policy = draft_policy or DraftLengthPolicy(
            self.num_speculative_tokens, adaptive=adaptive, method=getattr(proposer, "method", None),
            measure_costs=getattr(runner, "parallel", None) is None)
        # Called in step() with the sequences its prefill just started (their first token sampled),
        # before their first draft and verify: the verifier sends those first tokens out at once
        # (a request's time to first token is its prefill, not its prefill and a whole step). It
        # may abort sequences (engine.abort) and add requests: the step's batch is taken after it.
        self.on_admitted: Callable[[list[Sequence]], None] | None = None

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    grammar: GrammarSpec | None = None, *, output_token_ids: list[int] | None = None,
                    spec_stats: SpecStats | None = None) -> Sequence:
        """Queue a request; with output_token_ids, resume one another engine already started.

        A resumed request is admitted like a preempted one: prompt + output re-prefilled, its next
        token sampled at the same position (hence the same noise), its grammar matcher rebuilt
        by replaying the output; spec_stats carries on counting from the given figures.
        """
        check_request(prompt_token_ids, output_token_ids or [], params, vocab_size=self.runner.info.vocab_size,
                      max_model_len=self.max_model_len,
                      grammar_without_backend=grammar is not None and self.constraints.backend is None)
        output = list(output_token_ids or [])
        seq = Sequence(next(self._ids), list(prompt_token_ids), params, output_token_ids=output, grammar=grammar,
                       stats=copy.deepcopy(spec_stats) if spec_stats is not None else SpecStats())
        if params.logprobs is not None:  # a resumed request's emitted tokens went out with theirs
            seq.output_logprobs = [None] * len(output)
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        """Whether a step has work: a sequence waits or runs. (A decode step may still be in flight
        with sequences that all stopped: the next step drops it.)"""
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence, reason: str = "abort") -> bool:
        """Drop a sequence between steps: free its KV blocks and draft state, mark it finished.

        The verifier calls this for requests past their deadline. Returns False when the sequence
        is not (or no longer) in the engine; its tokens so far stay on the Sequence.
        """
        # By identity: Sequence is a dataclass whose == compares (tensor) fields.
        if any(s is seq for s in self.running):
            self.running = [s for s in self.running if s is not seq]
            self._release(seq)
        elif any(s is seq for s in self.waiting):
            # Waiting sequences hold no cache (never admitted, or preempted and freed).
            self.waiting = deque(s for s in self.waiting if s is not seq)
        else:
            return False
        seq.finish(reason)
        return True

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 grammars: list[GrammarSpec | None] | None = None) -> list[Sequence]:
        """Run the given requests to completion (the in-process path)."""
        grammars = grammars or [None] * len(prompts)
        seqs = [self.add_request(p, sp, g) for p, sp, g in zip(prompts, params, grammars)]
        while self.has_unfinished():
            self.step()
        return seqs

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it."""
        t0, before = time.perf_counter(), self.stats.timings.copy()
        prefetched = self.drafting.collect()  # first: nothing else touches the proposer before
        t_collect = time.perf_counter()
        finished: list[Sequence] = []
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            batch = next_decode_batch(self.running, flight, self.runner.plan_appends(), self.stop)
            if batch and self._drafts_nothing(batch):
                return self._overlapped_step(flight, batch, t0, before, t_collect)
            finished += self._land(flight)  # the synchronous step below starts from landed state
        finished += self._admit_and_announce()
        t1 = time.perf_counter()
        if not self._staging.holds():  # (a staged batch has every sequence's room reserved)
            self._preempt_if_full()
        self._resync_drafts()
        batch = [s for s in self.running if not s.is_finished]
        proposals = self.draft(batch, prefetched)
        t2 = time.perf_counter()
        if (self._overlap and batch and self._drafts_nothing(batch)
                and not any(decode_ahead_blocks(s) for s in batch)):
            self._in_flight = self._launch(batch, proposals, None)  # lands in the next step
            t3 = time.perf_counter()
        else:
            verdict = self.verify(batch, proposals)
            t3 = time.perf_counter()
            finished += self.commit(batch, proposals, verdict)
        finished += self._take_failed()
        t_sent = time.perf_counter()
        self.drafting.send_ahead([s for s in self.running if not s.is_finished])
        t_staged = time.perf_counter()
        self._staging.stage_next(self.running, self._num_drafts, drafts_out=self.drafting.in_flight,
                                 admission_due=bool(self.waiting) and len(self.running) < self.max_batch_size,
                                 want_aux_hidden=self._hidden_kind == "aux")
        t_end = time.perf_counter()
        self.stats.timings.add_step(t0, t_collect, t1, t2, t3, t_sent, t_staged, t_end)
        self.stats.num_steps += 1
        if batch:  # the step's measured cost at the ks it verified
            self.draft_policy.observe_timings(self.stats.timings.since(before), t_end - t0)
        return finished

    def _overlapped_step(self, flight: StepInFlight, batch: list[Sequence], t0: float, before,
                         t_collect: float) -> list[Sequence]:
        """Queue the next decode step behind the one in flight, then land that one (its tokens
        appended while the device runs the next), then admit: new sequences join the step after."""
        self._in_flight = self._launch(batch, self.draft(batch), flight)
        t_launched = time.perf_counter()
        finished = self._land(flight)
        t_landed = time.perf_counter()
        finished += self._admit_and_announce()
        finished += self._take_failed()  # (admissions whose grammar was lost)
        t_end = time.perf_counter()
        self.stats.timings.add_overlapped_step(t0, t_collect, t_launched, t_landed, t_end)
        self.stats.num_steps += 1
        self.draft_policy.observe_timings(self.stats.timings.since(before), t_end - t0)
        return finished

    def _drafts_nothing(self, batch: list[Sequence]) -> bool:
        """No sequence of batch drafts this step: no proposer, or k = 0 for all (draft_policy.py)."""
        return self.proposer is None or not any(self._num_drafts(s) for s in batch)

    def _launch(self, batch: list[Sequence], proposals: list[DraftProposal], flight: StepInFlight | None
                ) -> StepInFlight:
        """A decode step queued on the device, its tokens' copy to the host queued behind it."""
        out, result, _ = self.verify(batch, proposals, carried=flight)  # (none asks logprobs: overlap.py)
        tokens = result.output_token_ids[:, 0]  # [B]: decode verifies no drafts
        return StepInFlight(batch, {s.seq_id: i for i, s in enumerate(batch)}, tokens,
                            HostRows(tokens, self._pinned.take()), self._clock, proposals)

    def _land(self, flight: StepInFlight) -> list[Sequence]:
        """Append a decode step's tokens (sequences aborted since it was queued are skipped)."""
        t0 = time.perf_counter()
        tokens = flight.landing.wait()
        self.stats.timings.device_wait += time.perf_counter() - t0
        self.stats.timings.add_device_clock(flight.clock.read())
        return self.commit(flight.batch, flight.proposals, None, landed=[[0, t] for t in tokens])

    def _admit_and_announce(self) -> list[Sequence]:
        """admit, then hand the sequences it started to on_admitted; the ones that stopped at once."""
        num_running = len(self.running)
        finished = self.admit()
        if self.on_admitted is not None and len(self.running) > num_running:
            self.on_admitted(self.running[num_running:])
        return finished

    def admit(self) -> list[Sequence]:
        """Prefill waiting sequences while the batch and the cache have room; sample their first token."""
        if not self.waiting or len(self.running) >= self.max_batch_size:
            return []
        admitted = take_admissions(self.waiting, self.running, self.runner, max_batch_size=self.max_batch_size,
                                   max_prefill_tokens=self.max_prefill_tokens,
                                   num_speculative_tokens=self.num_speculative_tokens,
                                   max_model_len=self.max_model_len)
        if admitted and self._prefix_caching:
            admitted = defer_shared_prompts(admitted, self.waiting, self.runner, self.runner.block_size,
                                            self._prefill_tokens)
        if not admitted:
            return []
        self._ks = None
        # A preempted sequence comes back with its output: re-prefill all but its last token, which
        # is still waiting to be verified; its next token is not sampled again.
        t_prefill = time.perf_counter()
        chunks = []
        for s in admitted:
            tokens = self._prefill_tokens(s)
            cached = self.runner.match_prefix(s.seq_id, tokens) if self._prefix_caching else 0
            s.num_cached_tokens = max(s.num_cached_tokens, cached)
            self.stats.num_prefix_hit_tokens += cached
            chunks.append(SequenceChunk(s.seq_id, tokens[cached:]))
        eager_before = getattr(self.runner, "num_eager_forwards", None)  # None: a runner without a static path
        out = self.runner.forward(chunks, want_hidden=self._hidden_kind == "final",
                                  want_aux_hidden=self._hidden_kind == "aux", last_logits_only=True)
        self.stats.num_prefills += 1
        self.stats.num_prefill_tokens += sum(len(c.token_ids) for c in chunks)
        self.stats.num_eager_prefills += eager_before is None or self.runner.num_eager_forwards > eager_before
        if self._prefix_caching:  # their prompts' blocks serve requests admitted from now on
            for s in admitted:
                self.runner.register_prefix(s.seq_id, self._prefill_tokens(s))
        first, first_logprobs = sample_first_tokens(out, admitted, self.constraints, self.stop)
        self.stats.timings.prefill += time.perf_counter() - t_prefill
        self._fail_lost_constraints(admitted)
        finished = []
        for i, seq in enumerate(admitted):
            if seq.is_finished:  # its grammar was lost (_fail_lost_constraints): reported by step
                continue
            seq.status = SequenceStatus.RUNNING
            resumed = bool(seq.output_token_ids)
            if self.proposer is not None:
                # (grammar only when constrained: proposers without draft masking keep working)
                if seq.grammar is None:
                    self.proposer.open(seq.seq_id, seq.params)
                else:
                    self.proposer.open(seq.seq_id, seq.params, grammar=seq.grammar)
                seq.undrafted_token_ids = list(seq.prompt_token_ids) + list(seq.output_token_ids)
                hidden = self._hidden_rows(out, i, seq.num_tokens - (1 if resumed else 0))
                if hidden is not None:
                    seq.undrafted_hidden = [hidden]
            if not resumed:
                self._append(seq, [first[i]], [first_logprobs[i]])
                self.constraints.committed(seq, [first[i]])
                if self.proposer is not None:
                    seq.undrafted_token_ids.append(first[i])
            if seq.is_finished:
                self._release(seq)
                finished.append(seq)
            else:
                self.running.append(seq)
        return finished

    def draft(self, batch: list[Sequence], prefetched: dict[int, DraftProposal] | None = None
              ) -> list[DraftProposal]:
        """k_i drafts per sequence (drafting.py: sent ahead where they apply, else asked now)."""
        ks = [self._num_drafts(s) for s in batch] if self.proposer is not None else []  # verify budgets
        proposals = self.drafting.draft(batch, prefetched or {}, ask=any(ks))
        self.stats.record_draft_lengths(ks)
        self.draft_policy.drafted(len(batch) + sum(p.token_ids.numel() for p in proposals), max(ks, default=0))
        return proposals

    def verify(self, batch: list[Sequence], proposals: list[DraftProposal], carried: StepInFlight | None = None):
        """One target forward over [last token, drafts] per sequence, then rejection sampling.
        carried: a decode step in flight whose tokens are the last tokens of its sequences here
        (read on the device: overlap.py); the host's last tokens are one step behind for those."""
        if not batch:
            return None
        device = self.runner.device
        vocab = self.runner.info.vocab_size
        t0 = time.perf_counter()
        num_drafts = [int(p.token_ids.numel()) for p in proposals]
        # Host copies of the drafts come from the proposals (CPU), never from the device tensors:
        # no device-to-host sync before the forward. The step's only sync is commit's.
        host_drafts = [p.token_ids.tolist() for p in proposals]
        chunks = [SequenceChunk(s.seq_id, [s.last_token_id] + host_drafts[i]) for i, s in enumerate(batch)]
        first_token_ids, ahead = self._carried_tokens(batch, carried)
        staged = self._staging.taken()
        self._clock = self._clocks[self._clock is self._clocks[0]]  # the other one (see __init__)
        self._clock.start()
        self._marking = self._clock
        # The forward first: everything sampling needs is built while the device runs it. Its
        # host-to-device copies are asynchronous (non_blocking, staged by the driver), so they
        # queue behind the forward instead of waiting for it, and they leave the critical path.
        forward_args = {} if first_token_ids is None else {"first_token_ids": first_token_ids}
        out = self.runner.forward(chunks, want_hidden=self._hidden_kind == "final",
                                  want_aux_hidden=self._hidden_kind == "aux", **forward_args)
        self._marking = None
        self.stats.timings.launch += time.perf_counter() - t0
        self._clock.forward_queued(staged)
        draft_ids, draft_probs, num_drafts_t = pad_drafts(proposals, host_drafts, vocab, device)
        st = self._batch_sampling.get(batch, device)
        positions = torch.tensor([s.num_tokens + a for s, a in zip(batch, ahead)]).to(device, non_blocking=True)
        histories = ([(s.prompt_token_ids, s.output_token_ids) for s in batch]
                     if any(s.params.needs_output_history for s in batch) else None)
        biases = [s.params.logit_bias for s in batch] if any(s.params.logit_bias for s in batch) else None
        suppress = None  # rows that may not stop yet (min_new_tokens), built only when some exist
        if any(s.params.min_new_tokens > s.num_output_tokens for s in batch):
            suppress = [(s.params.min_new_tokens - s.num_output_tokens, sorted(self.stop.stop_token_ids(s)))
                        for s in batch]
        masks = self.constraints.masks(batch, host_drafts)
        self._fail_lost_constraints()
        all_greedy = all(s.params.is_greedy for s in batch)
        logits = verify_logits(out, num_drafts, st, histories, host_drafts, suppress, masks, biases)
        if all_greedy and not any(num_drafts) and not asking(batch):
            # Greedy decoding: the token is each row's argmax (rejection sampling's answer for a
            # one-hot row and no draft), without the [B, V] one-hot rows and their kernels.
            tokens = logits.argmax(dim=-1)  # [B]
            no_drafts = torch.zeros_like(tokens)
            result, logprobs = RejectionResult(tokens[:, None], no_drafts, no_drafts + 1), None
        else:
            target_probs = target_probs_of(logits, num_drafts, st, all_greedy)
            result = rejection_sample(target_probs, draft_ids, draft_probs, num_drafts_t, st.seeds, positions,
                                      one_hot_target=all_greedy)
            logprobs = verify_logprobs(batch, out.logits, out.offsets, num_drafts, target_probs,
                                       result.output_token_ids)
        self._clock.step_queued()
        return out, result, logprobs

    def commit(self, batch: list[Sequence], proposals: list[DraftProposal], verdict,
               landed: list[list[int]] | None = None) -> list[Sequence]:
        """Keep the accepted prefix in the target cache, append tokens, finish stopped sequences.
        landed: a decode step's rows [0, token] read already (overlap.py; verdict None then):
        sequences that finished since it was queued (aborted) are skipped."""
        if not batch:
            return []
        out = verdict[0] if verdict is not None else None
        self._ks = None  # the caches change below
        logprobs: dict[int, list[TokenLogprob]] = {}
        if landed is None:
            # The step's one device-to-host transfer: accepted counts and emitted tokens together.
            result = verdict[1]
            t0 = time.perf_counter()
            landed = torch.cat([result.num_accepted[:, None], result.output_token_ids], dim=1).tolist()
            self.stats.timings.device_wait += time.perf_counter() - t0
            self.stats.timings.add_device_clock(self._clock.read())
            if verdict[2] is not None:  # computed behind the step: read after its sync, not before
                logprobs = verdict[2].read()
        num_accepted = [row[0] for row in landed]
        emitted = [row[1:] for row in landed]
        finished = []
        verdict_ids, verdict_ks, verdict_ms = [], [], []  # the draft policy's evidence
        for i, seq in enumerate(batch):
            if seq.is_finished:
                continue
            k, m = int(proposals[i].token_ids.numel()), num_accepted[i]
            seq.stats.record_step(k, m)
            verdict_ids.append(seq.seq_id)
            verdict_ks.append(k)
            verdict_ms.append(m)
            if k:
                # The cache holds the last token and all k drafts; keep the last token + m accepted.
                # (Without drafts it holds what it keeps, and a decode step queued since has
                # appended past it: overlap.py.)
                self.runner.truncate(seq.seq_id, seq.num_tokens + m)
            new_tokens = emitted[i][:m + 1]
            if self.proposer is not None and self._hidden_kind != "none":
                hidden = self._hidden_rows(out, i, m + 1)
                if hidden is not None:
                    seq.undrafted_hidden.append(hidden)
            num_appended = self._append(seq, new_tokens, logprobs.get(i))
            self.constraints.committed(seq, new_tokens[:num_appended])
            if self.proposer is not None:
                seq.undrafted_token_ids.extend(new_tokens[:num_appended])
                self.drafting.settle(seq, k, m, new_tokens[:num_appended])
            if seq.is_finished:
                self._release(seq)
                finished.append(seq)
        self.draft_policy.observe_verdicts(verdict_ids, verdict_ks, verdict_ms)
        self.running = [s for s in self.running if not s.is_finished]
        return finished

    # ---- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _prefill_tokens(seq: Sequence) -> list[int]:
        return seq.prompt_token_ids + seq.output_token_ids[:-1]

    def _preempt_if_full(self) -> None:
        """Free the newest sequences' caches until every running sequence can verify one token.

        Preempted sequences go back to the front of the queue and are re-prefilled later
        (recompute); their tokens are kept, so nothing already emitted changes.
        """
        while True:
            plan = self.runner.plan_appends()  # every sequence's next token, together
            if all(plan.take(s.seq_id, 1) for s in self.running):
                return
            if len(self.running) == 1:
                raise RuntimeError("the KV cache cannot hold a single request; raise num_gpu_blocks")
            self._preempt(self.running.pop())  # the most recently admitted

    def _resync_drafts(self) -> None:
        """Give sequences whose draft state was lost (a drafter died) a fresh start on a live one.

        The proposer names them once a drafter can take them (RemoteProposer.take_resync); until
        then they decode target-only. Drafters that need no hidden states get the whole token
        history in the next draft call; the others need the target's hidden rows of the history,
        which only a re-prefill yields, so those sequences are preempted (their tokens are kept).
        """
        take = getattr(self.proposer, "take_resync", None)
        lost = set(take()) if take is not None else set()
        if not lost:
            return
        for seq in [s for s in self.running if s.seq_id in lost]:
            self.proposer.close(seq.seq_id)
            if self._hidden_kind == "none":
                if seq.grammar is None:
                    self.proposer.open(seq.seq_id, seq.params)
                else:
                    self.proposer.open(seq.seq_id, seq.params, grammar=seq.grammar)
                seq.undrafted_token_ids = seq.prompt_token_ids + seq.output_token_ids
                seq.undrafted_hidden = []
            else:
                self.running = [s for s in self.running if s is not seq]
                self._preempt(seq)

    def _preempt(self, victim: Sequence) -> None:
        """Free a running sequence's cache and queue it first for a re-prefill (tokens kept)."""
        self._ks = None
        self.stats.num_preemptions += 1
        if self._prefix_caching:  # its re-prefill finds them
            self.runner.register_prefix(victim.seq_id, victim.prompt_token_ids + victim.output_token_ids[:-1])
        self.runner.free(victim.seq_id)
        self.constraints.close(victim)
        if self.proposer is not None:
            self.proposer.close(victim.seq_id)
        victim.status = SequenceStatus.WAITING
        victim.undrafted_token_ids, victim.undrafted_hidden = [], []
        self.waiting.appendleft(victim)

    def _take_failed(self) -> list[Sequence]:
        """The sequences _fail_lost_constraints finished since the last call (a step reports them)."""
        failed, self._failed = self._failed, []
        return failed

    def _fail_lost_constraints(self, admitted: list[Sequence] = ()) -> None:
        """Finish ("error") the sequences whose grammar matchers were lost for good and free them;
        the step reports them with its finished ones. Their rows of the step in progress are
        dropped (commit skips finished sequences)."""
        failed = self.constraints.failed
        if not failed:
            return
        for seq in [s for s in [*self.running, *admitted] if s.seq_id in failed]:
            seq.finish("error")
            seq.error = failed.pop(seq.seq_id)
            if any(s is seq for s in self.running):
                self.running = [s for s in self.running if s is not seq]
                self._release(seq)
            else:  # admitted in this step: its cache only (its drafter state is not open yet)
                self.runner.free(seq.seq_id)
            self._failed.append(seq)
        failed.clear()

    def _carried_tokens(self, batch: list[Sequence], flight: StepInFlight | None
                        ) -> tuple[torch.Tensor | None, list[int]]:
        """The forward's first_token_ids from the step in flight ([B] on the device, -1 where the
        host has the token: sequences admitted since), and per sequence the tokens it is ahead
        of the host (1 where carried)."""
        if flight is None:
            return None, [0] * len(batch)
        rows = flight.carried_rows(batch)
        ahead = [int(r >= 0) for r in rows]
        if rows == list(range(len(flight.batch))):  # the same batch as the step in flight
            return flight.token_ids, ahead
        index = torch.tensor(rows).to(self.runner.device, non_blocking=True)
        return torch.where(index >= 0, flight.token_ids[index.clamp(min=0)], -1), ahead

    def _mark_launch(self) -> None:
        """The runner's launch hook: marks the verify forward's launch (a prefill's is not marked)."""
        if self._marking is not None:
            self._marking.launching()

    def _num_drafts(self, seq: Sequence) -> int:
        """k for this sequence, planned for the whole batch: what pays (draft_policy.py) of the most
        budget and cache room allow (drafting.plan_draft_lengths)."""
        ks = self._ks
        if ks is None or seq.seq_id not in ks:
            caps = plan_draft_lengths([s for s in self.running if not s.is_finished], self.runner.plan_appends(),
                                      self.num_speculative_tokens, self.max_model_len)
            ks = self._ks = self.draft_policy.plan(caps)
        return ks.get(seq.seq_id, 0)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob | None] | None = None) -> int:
        """Append tokens until one stops seq; logprobs: row j's for tokens[j] (where seq asked)."""
        n = self.stop.append(seq, tokens)
        self.stats.num_output_tokens += n
        if seq.params.logprobs is not None:
            seq.output_logprobs.extend(logprobs[:n] if logprobs is not None else [None] * n)
        return n

    def _hidden_rows(self, out, i: int, count: int) -> torch.Tensor | None:
        source = {"final": out.hidden_states, "aux": out.aux_hidden_states}.get(self._hidden_kind)
        if source is None:
            return None
        start = out.offsets[i]
        return source[start:start + count]

    def _release(self, seq: Sequence) -> None:
        self._ks = None
        if self._prefix_caching:  # the tokens its cache holds: all but the last (never fed)
            self.runner.register_prefix(seq.seq_id, seq.prompt_token_ids + seq.output_token_ids[:-1])
        self.runner.free(seq.seq_id)
        self.constraints.close(seq)
        if self.proposer is not None:
            self.proposer.close(seq.seq_id)
