"""The seed's pipeline example, with `lmdeploy` replaced by `specd` and local model paths."""

import sys

from specd import PytorchEngineConfig, pipeline
from specd.messages import SpeculativeConfig

if __name__ == '__main__':
    model_path = sys.argv[1] if len(sys.argv) > 1 else 'models/specd-py-target'
    draft_path = sys.argv[2] if len(sys.argv) > 2 else 'models/specd-py-eagle3'
    spec_cfg = SpeculativeConfig(
        method='eagle3',
        num_speculative_tokens=3,
        model=draft_path,
    )
    pipe = pipeline(model_path,
                    backend_config=PytorchEngineConfig(max_batch_size=128),
                    speculative_config=spec_cfg)
    response = pipe(['Hi, pls intro yourself', 'Shanghai is'])
    print(response)
