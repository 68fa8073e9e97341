"""specd: speculative-decoding LLM serving."""

from specd.messages import (GenerationConfig, PytorchEngineConfig, Response, SpecStats,
                            SpeculativeConfig)

__all__ = ["GenerationConfig", "PytorchEngineConfig", "Response", "SpecStats", "SpeculativeConfig",
           "pipeline"]


def pipeline(model_path, backend_config=None, speculative_config=None, **kwargs):
    """Build an in-process speculative-decoding pipeline (lmdeploy's `pipeline`)."""
    from specd.in_process import Pipeline

    return Pipeline(model_path, backend_config=backend_config,
                    speculative_config=speculative_config, **kwargs)
