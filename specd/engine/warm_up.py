"""One short request through the engine before it serves, so that its first real request does
not pay the one-time costs.

Why: the first prompt captures every prefill layout's CUDA graph (~0.5 s each at 8B on the GPU:
cuda_graphs.py), and the first steps initialise cuBLAS, the attention kernels and the drafter's
side. A pod that reported ready before paying them stalled its first requests by seconds. The
request is greedy, ignores EOS and runs two full speculative steps; its totals are then cleared,
so the engine's statistics count served requests only.

Then the step cost model of adaptive drafting (draft_policy.py) forgets those steps (one-time
costs are not a step's) and is measured afresh: the request again at the full draft length, then
without drafts, so the first served steps choose k from this deployment's own timings.
"""

from __future__ import annotations

import logging
import time

from specd.engine.stats import EngineStats
from specd.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def warm_up_engine(engine, prompt_len: int = 16) -> float:
    """Generate from a prompt of prompt_len zeros (token 0 is in every vocabulary) through at
    least two verify steps, then reset engine.stats; returns the seconds it took."""
    if prompt_len < 1 or prompt_len >= engine.max_model_len - 4 * (engine.num_speculative_tokens + 1):
        prompt_len = 1  # a tiny context (tests): one token still runs every stage
    t0 = time.perf_counter()
    # The first token comes from the prefill; each step then emits 1..k+1.
    params = SamplingParams(max_new_tokens=1 + 2 * (engine.num_speculative_tokens + 1), ignore_eos=True)
    engine.generate([[0] * prompt_len], [params])
    policy = engine.draft_policy
    if policy.adaptive:
        policy.cost.reset()
        for k in (engine.num_speculative_tokens, 0):
            policy.forced_k = k
            try:
                engine.generate([[0] * prompt_len], [params])
            finally:
                policy.forced_k = None
    policy.restart_probes()
    engine.stats = EngineStats()
    seconds = time.perf_counter() - t0
    log.info("event=engine_warm_up k=%d seconds=%.3f", engine.num_speculative_tokens, seconds)
    return seconds
