"""The Llama-family architecture read from a Hugging Face `config.json`.

One dataclass covers LlamaForCausalLM (Llama 2/3.x, rope type "llama3"), Qwen2ForCausalLM (q/k/v
bias), Qwen3ForCausalLM (per-head q/k RMSNorm, head_dim independent of hidden/heads) and
MistralForCausalLM (sliding window). Anything our compact model cannot reproduce exactly raises
`UnsupportedArchitectureError`, so the loader can fall back to transformers instead of computing
wrong logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LLAMA_FAMILY_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedArchitectureError(ValueError):
    """The checkpoint uses a feature the compact Llama model does not implement."""


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise UnsupportedArchitectureError(f"{field_name}: {message}")


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def normalize_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict with "rope_type" or None) from either HF layout.

    transformers 5 writes `rope_parameters: {"rope_type", "rope_theta", ...}`; older checkpoints
    have a top-level `rope_theta` and `rope_scaling: {"type" | "rope_type", ...}`.
    """
    params = config.get("rope_parameters")
    legacy = config.get("rope_scaling")
    theta = config.get("rope_theta")
    scaling: dict[str, Any] = {}
    for source in (legacy, params):  # rope_parameters wins when both are present
        if isinstance(source, dict):
            scaling.update(source)
    theta = float(scaling.pop("rope_theta", theta if theta is not None else 10000.0))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


@dataclass(slots=True)
class LlamaArchConfig:
    """Shapes and options of a Llama-family decoder, validated on construction."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}; None: plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on the output projection (Llama's attention_bias covers it too)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention | sliding_attention
    hidden_act: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        _require(self.architecture in LLAMA_FAMILY_ARCHITECTURES, "architectures",
                 f"expected one of {', '.join(LLAMA_FAMILY_ARCHITECTURES)}, got {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name,
                     f"must be a positive integer, got {value!r}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}")
        _require(self.head_dim % 2 == 0, "head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(self.hidden_act == "silu", "hidden_act",
                 f"only silu (SwiGLU) is supported, got {self.hidden_act!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            _require(rope_type in SUPPORTED_ROPE_TYPES, "rope_scaling",
                     f"rope type {rope_type!r} is not supported by the Llama runner "
                     f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            _require(float(self.rope_scaling.get("partial_rotary_factor", 1.0)) == 1.0, "rope_scaling",
                     "partial_rotary_factor != 1 is not supported")
            needed = {"llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings"),
                      "linear": ("factor",)}.get(rope_type, ())
            missing = [k for k in needed if k not in self.rope_scaling]
            _require(not missing, "rope_scaling", f"rope type {rope_type!r} needs {', '.join(missing)}")
        _require(self.sliding_window is None or self.sliding_window >= 1, "sliding_window",
                 f"must be >= 1 or null, got {self.sliding_window}")
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        _require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                 f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in _LAYER_TYPES})
        _require(not bad, "layer_types", f"unsupported layer types {bad}")
        _require("sliding_attention" not in self.layer_types or self.sliding_window is not None,
                 "sliding_window", "sliding_attention layers need a sliding_window")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_sliding_window(self, layer_id: int) -> int | None:
        """The window of one layer: None for full attention."""
        return self.sliding_window if self.layer_types[layer_id] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
                  ) -> "LlamaArchConfig":
        """Parse a config.json dict (plus generation_config.json for extra eos ids)."""
        architectures = config.get("architectures") or []
        arch = architectures[0] if architectures else ""
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
        theta, scaling = normalize_rope(config)
        # Qwen2 always biases q/k/v (and never o); Llama/Qwen3's attention_bias covers all four.
        qkv_bias = True if arch == "Qwen2ForCausalLM" else bool(config.get("attention_bias", False))
        o_bias = False if arch == "Qwen2ForCausalLM" else bool(config.get("attention_bias", False))
        sliding_window, layer_types = _sliding_layout(arch, config)
        eos = _as_id_list(config.get("eos_token_id"))
        for token_id in _as_id_list((generation_config or {}).get("eos_token_id")):
            if token_id not in eos:
                eos.append(token_id)
        return cls(
            architecture=arch,
            vocab_size=config.get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=config.get("intermediate_size"),
            num_hidden_layers=config.get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            layer_types=layer_types,
            hidden_act=config.get("hidden_act", "silu"),
            eos_token_ids=eos,
            bos_token_id=config.get("bos_token_id"),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "LlamaArchConfig":
        """Read `config.json` (and `generation_config.json` when present) from a checkpoint dir."""
        model_dir = Path(model_dir)
        gen_path = model_dir / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(read_json(model_dir / "config.json"), gen)


def _sliding_layout(arch: str, config: dict[str, Any]) -> tuple[int | None, list[str]]:
    """(sliding_window, layer_types) as transformers would run the checkpoint."""
    window = config.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen's window only applies with use_sliding_window, to layers >= max_window_layers.
        if not config.get("use_sliding_window", False):
            window = None
        layer_types = config.get("layer_types")
        if window is None:
            return None, []
        if not layer_types:
            first = config.get("max_window_layers", 0)
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(config["num_hidden_layers"])]
        return window, list(layer_types)
    if arch == "MistralForCausalLM":
        return window, []  # Mistral: every layer uses the window when one is set
    # Llama has no sliding window; ignore a stray value rather than change the maths.
    return None, list(config.get("layer_types") or [])
