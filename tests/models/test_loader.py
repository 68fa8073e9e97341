"""Runner selection and tokenizer loading."""

from __future__ import annotations

import json

import pytest

from specd.messages import PytorchEngineConfig
from specd.models.hf_runner import HFRunner
from specd.models.llama_runner import LlamaRunner
from specd.models.loader import choose_runner, load_target_runner, load_tokenizer
from specd.models.model_path import ModelNotFoundError


def config(runner: str = "auto") -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type="cpu", runner=runner, session_len=64, max_batch_size=2)


@pytest.mark.parametrize("kind,expected", [("llama", LlamaRunner), ("qwen2", LlamaRunner),
                                           ("qwen3", LlamaRunner), ("mistral", LlamaRunner),
                                           ("deepseek_v3", HFRunner), ("qwen3_5", HFRunner)])
def test_auto_selection(kind, expected, checkpoint):
    assert type(load_target_runner(checkpoint(kind), config())) is expected


def test_forced_runners(checkpoint):
    assert type(load_target_runner(checkpoint("llama"), config("hf"))) is HFRunner
    assert type(load_target_runner(checkpoint("qwen3"), config("llama"))) is LlamaRunner


def test_unsupported_rope_falls_back_to_hf(checkpoint, tmp_path):
    src = checkpoint("llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert choose_runner(tmp_path, "auto") == "hf"
    assert choose_runner(tmp_path, "llama") == "llama"


def test_missing_model():
    with pytest.raises(ModelNotFoundError, match="does not download weights"):
        load_target_runner("no-such-org/no-such-model-xyz", config())


def test_load_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path))("hello world")["input_ids"] == [1, 2]
