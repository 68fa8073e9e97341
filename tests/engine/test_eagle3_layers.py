"""An EAGLE-3 head's own `eagle_aux_hidden_state_layer_ids` pick the target layers it is fed."""

import json
import shutil

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams


def test_draft_config_layer_ids_reach_the_runner(tiny_models, tmp_path):
    draft = tmp_path / "eagle3-custom-layers"
    shutil.copytree(tiny_models["draft-eagle3"], draft)
    config = json.loads((draft / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    (draft / "config.json").write_text(json.dumps(config))
    target = tiny_models["target-llama"]
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, model=str(draft))
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=2), spec)
    assert list(engine.runner.aux_layer_ids) == [1, 3, 6]
    prompts = [[5, 9, 11, 13], [40] * 9]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * 2
    want = build_engine(target, PytorchEngineConfig(max_batch_size=2)).generate(prompts, params)
    got = engine.generate(prompts, params)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in want]
    assert sum(s.stats.num_draft_tokens for s in got) > 0
