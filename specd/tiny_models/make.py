"""`specd make-tiny-models DIR`: every checkpoint layout specd loads, tiny and deterministic.

DIR/target-llama         LlamaForCausalLM target (8 layers, so EAGLE-3's layers 2, 4, 5 differ)
DIR/draft-llama-small    a 2-layer Llama sharing the tokenizer (draft_model)
DIR/draft-eagle3         an EAGLE-3 head for target-llama (SafeAILab layout, reduced draft vocab)
DIR/target-deepseek-mtp  a DeepSeek-V3 target with its MTP layer (model.layers.<L>.*)
DIR/target-qwen3_5-mtp   a Qwen3.5 target (hybrid linear attention) with its mtp.* head
Random weights: acceptance of the neural heads is near zero until trained models replace them.
"""

from __future__ import annotations

from pathlib import Path

from specd.tiny_models.llama import write_tiny_llama
from specd.tiny_models.tokenizer import train_tokenizer, write_tokenizer

VOCAB_SIZE = 512
MODEL_NAMES = ("target-llama", "draft-llama-small", "draft-eagle3", "target-deepseek-mtp",
               "target-qwen3_5-mtp")


def make_tiny_models(out_dir: str | Path, seed: int = 0, only: list[str] | None = None) -> dict[str, Path]:
    """Write the tiny checkpoints under out_dir; returns name -> path."""
    from specd.tiny_models.deepseek_mtp import write_tiny_deepseek_mtp_target
    from specd.tiny_models.eagle3 import write_tiny_eagle3
    from specd.tiny_models.qwen3_5_mtp import write_tiny_qwen3_5_mtp_target

    out = Path(out_dir)
    wanted = set(only or MODEL_NAMES)
    unknown = wanted - set(MODEL_NAMES)
    if unknown:
        raise ValueError(f"unknown tiny model(s) {sorted(unknown)}; choose from {MODEL_NAMES}")
    if "draft-eagle3" in wanted:
        wanted.add("target-llama")  # the head is shaped after its target
    tokenizer = train_tokenizer(VOCAB_SIZE)
    paths: dict[str, Path] = {}
    writers = {
        "target-llama": lambda p: write_tiny_llama(
            p, vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
            intermediate_size=128, seed=seed),
        "draft-llama-small": lambda p: write_tiny_llama(
            p, vocab_size=VOCAB_SIZE, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
            intermediate_size=64, seed=seed + 1),
        "draft-eagle3": lambda p: write_tiny_eagle3(p, out / "target-llama", seed=seed + 2),
        "target-deepseek-mtp": lambda p: write_tiny_deepseek_mtp_target(p, VOCAB_SIZE, seed=seed + 3),
        "target-qwen3_5-mtp": lambda p: write_tiny_qwen3_5_mtp_target(p, VOCAB_SIZE, seed=seed + 4),
    }
    for name in MODEL_NAMES:  # this order writes target-llama before its EAGLE-3 head
        if name not in wanted:
            continue
        path = out / name
        path.mkdir(parents=True, exist_ok=True)
        writers[name](path)
        write_tokenizer(path, tokenizer)
        paths[name] = path
    return paths
