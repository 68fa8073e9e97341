"""Model shapes of the trained family, validated on construction.

The defaults keep every checkpoint together under ~40 MB in bfloat16 (the repository carries
them): target ~10 M parameters with tied embeddings, an EAGLE-3 head ~2.3 M, an MTP layer ~1.1 M,
a draft model ~2 M.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 8  # EAGLE-3's layers (2, L // 2, L - 3) = (2, 4, 5) stay distinct
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads: {self.num_heads} does not divide "
                             f"hidden_size={self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide "
                             f"num_heads={self.num_heads}")


TARGET_SHAPE = LlamaShape()
DRAFT_SHAPE = LlamaShape(hidden_size=128, num_layers=4, num_heads=2, num_kv_heads=1,
                         intermediate_size=512)
DRAFT_VOCAB_SIZE = 4096  # EAGLE-3's reduced vocabulary: the most frequent target tokens
