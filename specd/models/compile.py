"""Opt-in kernel fusion for the static (CUDA-graph) step: torch.compile of each layer's two
attention-free regions (llama.LayerRegions), inside our own CUDA graph capture.

Why these choices:
- Regions, not the whole forward: the attention writes the paged KV cache in place
  (index_copy_). Traced by inductor, an input mutation is functionalized and may be copied back
  whole (a cache is hundreds of MB per layer at 8B shapes); left eager between two compiled
  regions it stays a plain in-place write. This is vLLM's piecewise split at attention.
- One graph for all layers: the regions are module-level functions taking the layer as an
  argument, and dynamo treats the layer's parameters as graph inputs, so the 32 layers of an 8B
  model share one compiled graph per input shape (tests/models/test_compile.py checks the count).
- dynamic=False: the static path has few shapes (T = bucket B * Q rows), each gets kernels
  specialised to it; the recompile limit is raised to hold all of them.
- mode "default" (the default here) or "max-autotune-no-cudagraphs": both leave CUDA graphs to
  cuda_graphs.py (inductor's own, "reduce-overhead", would nest graphs inside our capture).
  max-autotune benchmarks GEMM kernels at compile time (minutes at 8B shapes); default keeps cuBLAS
  for the GEMMs and fuses what surrounds them: RMSNorm into one kernel, RoPE into one, the
  residual add with the next RMSNorm, SiLU(gate) * up into one.
- Compilation happens on the first call of each shape, i.e. in StaticForward's warm-up runs before
  a capture (never inside the capture).
"""

from __future__ import annotations

import torch

from specd.models.llama import EAGER_REGIONS, LayerRegions

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
RECOMPILE_LIMIT = 256  # shapes per region: batch buckets x query lengths, with room to spare


def compiled_regions(mode: str = "default") -> LayerRegions:
    """torch.compile'd twins of llama.EAGER_REGIONS (lazily compiled on first call per shape)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode: expected one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    import torch._dynamo.config as dynamo_config

    # Process-wide dynamo settings; raising a limit cannot change another model's results.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                        4 * RECOMPILE_LIMIT)
    options = dict(dynamic=False, fullgraph=True, mode=None if mode == "default" else mode)
    return LayerRegions(attention_input=torch.compile(EAGER_REGIONS.attention_input, **options),
                        attention_output_and_mlp=torch.compile(EAGER_REGIONS.attention_output_and_mlp,
                                                               **options))
