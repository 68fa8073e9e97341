"""What an engine counts over its life: steps, output tokens, seconds per verb."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specd.engine.device_clock import DeviceMarks


@dataclass
class StepTimings:
    """Seconds spent in each verb of one step."""

    admit: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    commit: float = 0.0  # device_wait included
    device_wait: float = 0.0  # of commit: blocked on the device's results (the step's one sync)
    send_ahead: float = 0.0  # of commit: the next step's draft requests sent (rows to the host, the write)
    stage: float = 0.0  # of commit: the next verify batch staged in the runner (staging.py)
    launch: float = 0.0  # of verify: the host's work before the forward is queued on the device
    prefill: float = 0.0  # of admit: the admitted requests' forward and first tokens (to their sync)
    # On the device's clock (device_clock.py), from each verify step's start: to its forward's
    # launch (the host's work before the device's first, where the runner marks it), to its
    # forward's end, to its sampling's end (what the host's verify + device_wait wait for, less
    # the wake-up).
    device_launch: float = 0.0
    device_forward: float = 0.0
    device_step: float = 0.0
    launch_mark_host: float = 0.0  # host seconds in the launch mark (device_clock.DeviceMarks)
    # The forward's own device time (its launch to its end), by whether its batch was staged while
    # its drafts were out (staging.py): seconds and forwards of each kind.
    forward_staged: float = 0.0
    num_forward_staged: int = 0
    forward_unstaged: float = 0.0
    num_forward_unstaged: int = 0

    def add_step(self, start: float, collected: float, admitted: float, drafted: float, verified: float,
                 committed: float, sent: float, end: float) -> None:
        """One engine step's verbs from its perf_counter marks: the drafts sent ahead collected
        (from start), admission, drafting, verify, then commit with its tails (sending the next
        step's requests, staging the next verify) to the end."""
        self.draft += (collected - start) + (drafted - admitted)
        self.admit += admitted - collected
        self.verify += verified - drafted
        self.commit += end - verified
        self.send_ahead += sent - committed
        self.stage += end - sent

    def add_overlapped_step(self, start: float, collected: float, launched: float, landed: float,
                            end: float) -> None:
        """An overlapped decode step (specd/engine/overlap.py): the next forward queued, the one in
        flight landed (the commit), then admission."""
        self.draft += collected - start
        self.verify += launched - collected
        self.commit += landed - launched
        self.admit += end - landed

    def copy(self) -> "StepTimings":
        return replace(self)

    def since(self, before: "StepTimings") -> "StepTimings":
        """What was added since `before` (an earlier copy): one step's seconds and counts."""
        return StepTimings(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def add_device_clock(self, marks: "DeviceMarks | None") -> None:
        if marks is not None:
            self.device_launch += marks.launch or 0.0
            self.device_forward += marks.forward
            self.device_step += marks.step
            self.launch_mark_host += marks.launch_mark_host
            if marks.launch is not None and marks.staged:
                self.forward_staged += marks.forward - marks.launch
                self.num_forward_staged += 1
            elif marks.launch is not None:
                self.forward_unstaged += marks.forward - marks.launch
                self.num_forward_unstaged += 1


@dataclass
class EngineStats:
    """Running totals over the engine's life (fed to logs and, in the services, Prometheus)."""

    num_steps: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0  # sequences whose cache was freed for room (re-prefilled later)
    num_prefills: int = 0  # admission forwards (each prefills the sequences admitted together)
    num_eager_prefills: int = 0  # of them, those outside the runner's static path (CUDA graphs)
    num_prefill_tokens: int = 0
    num_prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache, not prefilled
    timings: StepTimings = field(default_factory=StepTimings)
    # Draft lengths chosen (draft_policy.py), steps with a proposer only: draft_length_counts[k]
    # counts sequence-steps whose verify budget was k drafts; num_undrafted_steps counts steps in
    # which every sequence had k = 0 (plain decoding: nothing paid, or no budget left),
    # num_drafted_steps those in which some sequence drafted.
    draft_length_counts: list[int] = field(default_factory=list)
    num_undrafted_steps: int = 0
    num_drafted_steps: int = 0

    def record_draft_lengths(self, ks: list[int]) -> None:
        """One step's chosen k per sequence (none: a step without a proposer or a batch)."""
        if not ks:
            return
        for k in ks:
            if k >= len(self.draft_length_counts):
                self.draft_length_counts.extend([0] * (k + 1 - len(self.draft_length_counts)))
            self.draft_length_counts[k] += 1
        self.num_undrafted_steps += not any(ks)
        self.num_drafted_steps += any(ks)

    @property
    def mean_draft_length(self) -> float:
        """Mean chosen k per sequence-step (0.0 before any)."""
        n = sum(self.draft_length_counts)
        return sum(k * c for k, c in enumerate(self.draft_length_counts)) / n if n else 0.0
