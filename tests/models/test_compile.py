"""The opt-in torch.compile of the static path's layer regions (compile.py), on CPU (inductor's
C++ backend): same logits as the eager static path, one compiled graph per shape for all layers."""

from __future__ import annotations

import shutil

import pytest
import torch

from specd.messages import PytorchEngineConfig
from specd.models.base import SequenceChunk
from specd.models.llama_runner import LlamaRunner

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor on CPU needs a C++ compiler")


def _runner(path, compile_mode: str) -> LlamaRunner:
    config = PytorchEngineConfig(block_size=4, max_batch_size=4, session_len=128, device_type="cpu")
    return LlamaRunner(path, config, use_static_path=True, compile_mode=compile_mode)


def _script(runner: LlamaRunner) -> list[torch.Tensor]:
    """Prefill (eager: longer than max_query_len), ragged verify, rollback, decode (static)."""
    for s in range(3):
        runner.add_sequence(s)
    outs = [runner.forward([SequenceChunk(s, [(5 * s + j) % 256 for j in range(18 + s)]) for s in range(3)]).logits]
    outs.append(runner.forward([SequenceChunk(0, [1, 2, 3, 4]), SequenceChunk(1, [5]),
                                SequenceChunk(2, [7, 8])]).logits)  # B bucket 4, Q 4
    runner.truncate(0, 19)
    outs.append(runner.forward([SequenceChunk(0, [9, 10, 11]), SequenceChunk(2, [12, 13, 14, 15])]).logits)  # 2, 4
    outs.append(runner.forward([SequenceChunk(s, [20 + s]) for s in range(3)]).logits)  # 4, 1
    return outs


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: q/k norms inside the compiled region
def test_compiled_static_path_equals_eager(kind, checkpoint):
    from torch._dynamo.utils import counters

    path = checkpoint(kind)
    want = _script(_runner(path, "0"))
    torch._dynamo.reset()  # count this test's graphs only (no cache entries from earlier compiles)
    graphs_before = counters["stats"]["unique_graphs"]
    runner = _runner(path, "default")
    assert runner.compile_mode == "default"
    got = _script(runner)
    assert runner.static.num_static_forwards == 3  # the three verify / decode steps ran static
    for w, g in zip(want, got):
        assert w.shape == g.shape
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0)
    # Three static shapes (T = 16, 8, 4 rows) x two regions, however many layers (4 here): the
    # layer is a graph input, not a constant; per-layer graphs would hit the recompile limit on an
    # 8B model's 32 layers and silently fall back to eager.
    assert runner.config.num_hidden_layers == 4
    assert counters["stats"]["unique_graphs"] - graphs_before == 6


def test_compile_mode_is_validated(checkpoint, monkeypatch):
    from specd.models.compile import compiled_regions

    with pytest.raises(ValueError, match="compile mode"):
        compiled_regions("reduce-overhead")  # its CUDA graphs would nest inside ours
    monkeypatch.setenv("SPECD_COMPILE", "0")
    assert _runner(checkpoint("llama"), None).compile_mode is None
    monkeypatch.setenv("SPECD_COMPILE", "default")
    assert _runner(checkpoint("llama"), None).compile_mode == "default"
