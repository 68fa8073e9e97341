"""The draft heads' CUDA graphs (specd/proposers/head_graphs.py) draft as their eager path does.

On CPU the fixed-shape path runs eagerly and the head tests compare it with a full recompute
(static_steps in conftest); here, on CUDA, the captured graphs are replayed and compared with the
eager path over several steps of commits and rollbacks, greedy and sampled.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from specd.proposers.eagle3 import Eagle3Proposer
from specd.sampling_params import SamplingParams
from specd.tiny_models.eagle3 import write_tiny_eagle3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
DTYPE = torch.float64  # no near-ties between the paths' summation orders
PROMPTS = [[10, 11, 12, 13], [40] * 2, [99], list(range(100, 150))]


@pytest.fixture(scope="module")
def target_dir(llama_target_dir):
    return llama_target_dir


@pytest.fixture(scope="module")
def rows_fn(sim, target_dir):
    target = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=DTYPE).eval()
    return sim.target_rows_fn(target, [2, 4, 5])


def check_graphs_match_eager(sim, make_proposer, rows_fn, params: list[SamplingParams], num_steps: int = 10):
    """Two verifiers committing alike; the graphs' drafts (and q) equal the eager path's."""
    graphed, eager = make_proposer(None), make_proposer(False)
    assert graphed.graphs is not None and eager.graphs is None
    sims = [sim.Verifier(p, rows_fn, seed=3) for p in (graphed, eager)]
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        for v in sims:
            v.open(i, prompt, p)
        sims[1].seqs[i].tokens = list(sims[0].seqs[i].tokens)
    schedule = [{0: 3, 1: 3, 2: 3, 3: 3}, {0: 1, 1: 4, 2: 0, 3: 2}, {0: 4, 1: 2, 2: 3, 3: 1}]
    for step in range(num_steps):
        ks = schedule[step % len(schedule)]
        got, want = (v.step(ks) for v in sims)
        for i in ks:
            assert got[i][1] == want[i][1], f"step {step}, seq {i}"
            if want[i][2] is None:
                assert got[i][2] is None
            else:
                torch.testing.assert_close(got[i][2], want[i][2], atol=1e-9, rtol=1e-7)
            sims[1].seqs[i].tokens = list(sims[0].seqs[i].tokens)
    return graphed.graphs


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_eagle3_graphs_match_eager(sim, tmp_path, target_dir, rows_fn, sampled):
    draft_dir = write_tiny_eagle3(tmp_path / "eagle3", target_dir, seed=1)
    params = [SamplingParams()] * len(PROMPTS)
    if sampled:
        params[1] = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
        params[3] = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.2, seed=6)
    graphs = check_graphs_match_eager(
        sim, lambda static: Eagle3Proposer(draft_dir, target_dir, device="cuda", dtype=DTYPE,
                                           static_steps=static), rows_fn, params)
    assert graphs.num_captures > 0 and graphs.num_capture_failures == 0
    assert graphs.num_static_forwards > graphs.num_captures  # replays, not only captures


def _mtp_case(method: str, path):
    """(proposer class, target directory, the target in float64 on CPU) of an MTP method."""
    if method == "deepseek_mtp":
        from transformers import DeepseekV3ForCausalLM

        from specd.proposers.deepseek_mtp import DeepseekMTPProposer
        from specd.tiny_models.deepseek_mtp import write_tiny_deepseek_mtp_target

        target_dir = write_tiny_deepseek_mtp_target(path, 512, seed=3)
        # grouped_mm (the default experts kernel) has no float64
        return DeepseekMTPProposer, target_dir, DeepseekV3ForCausalLM.from_pretrained(
            str(target_dir), dtype=DTYPE, experts_implementation="eager")
    from transformers import Qwen3_5ForCausalLM

    from specd.proposers.qwen3_5_mtp import Qwen35MTPProposer
    from specd.tiny_models.qwen3_5_mtp import write_tiny_qwen3_5_mtp_target

    target_dir = write_tiny_qwen3_5_mtp_target(path, 512, seed=4)
    return Qwen35MTPProposer, target_dir, Qwen3_5ForCausalLM.from_pretrained(str(target_dir), dtype=DTYPE)


@pytest.mark.parametrize("method", ["deepseek_mtp", "qwen3_5_mtp"])
def test_mtp_graphs_match_eager(sim, tmp_path, method):
    """Greedy and sampled together; a layer a graph cannot hold (MoE routing that reads the
    device) must fall back to eager forwards and still draft alike."""
    proposer_class, target_dir, target = _mtp_case(method, tmp_path / method)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=7), SamplingParams(), SamplingParams()]
    graphs = check_graphs_match_eager(
        sim, lambda static: proposer_class(target_dir, device="cuda", dtype=DTYPE, static_steps=static),
        sim.target_rows_fn(target.eval(), None), params)
    assert graphs.num_static_forwards > 0
    assert graphs.num_captures > 0 or graphs.num_capture_failures > 0
