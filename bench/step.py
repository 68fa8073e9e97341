"""Verify-step time of an 8B-shaped Llama: specd (CUDA graphs, eager) vs transformers, vs the floor.

The target forward of one engine step (all layers + lm_head, logits for every new token) over a
batch whose sequences each hold `context` cached tokens, appending q tokens per sequence (q = 1:
plain decode; q = k + 1: verification of k drafts). Random bf16 weights are drawn directly on
the device (no checkpoint); transformers' LlamaForCausalLM uses the very same tensors (no copy)
with its own DynamicCache at the same context and sdpa attention. The floor is reading every
weight once at the GPU's memory bandwidth (default 4.8 TB/s, the H200).

    python -m bench step --out results/            # 8B shape on CUDA
    python -m bench step --small --out /tmp/x      # toy shape, CPU, seconds (the CPU test)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specd.messages import PytorchEngineConfig
from specd.models.hf_config import LlamaArchConfig
from specd.models.llama import LlamaForCausalLM
from specd.models.llama_runner import LlamaRunner
from specd.models.merged_linear import checkpoint_tensors

from bench.step_timing import _median_ms, time_specd, time_specd_staged
from bench.step_variants import check_step_outputs, time_recaptured, time_without_pdl

SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "small": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}


@dataclass
class StepRow:
    """One (batch, q) measurement; milliseconds per forward (median)."""

    batch: int
    q: int
    specd_graphs_ms: float
    specd_eager_ms: float
    transformers_ms: float | None
    floor_ms: float
    specd_torch_ops_ms: float | None = None  # graphs over PyTorch ops only (cuBLAS, SDPA): the twin
    specd_no_pdl_ms: float | None = None  # graphs over the kernels, launched without PDL (CUDA only)
    specd_graphs_captures_ms: list[float] = field(default_factory=list)  # each capture's time; the median above
    # The default graphs as the engine launches a verify step: the batch staged while the drafts
    # were out (slots, buffers), timed from the token ids' write to the replay's end.
    specd_staged_ms: float | None = None
    # Columns whose run did not fit the device's memory (printed OOM): on an 80 GB card, the
    # transformers twin's DynamicCache at batch 128 (17 GB) beside three runners' caches.
    out_of_memory: tuple[str, ...] = ()

    @property
    def graphs_over_floor(self) -> float:
        return self.specd_graphs_ms / self.floor_ms

    @property
    def staged_over_floor(self) -> float | None:
        return None if self.specd_staged_ms is None else self.specd_staged_ms / self.floor_ms

    @property
    def transformers_over_graphs(self) -> float | None:
        return None if self.transformers_ms is None else self.transformers_ms / self.specd_graphs_ms


def arch_config(shape: str) -> LlamaArchConfig:
    return LlamaArchConfig(architecture="LlamaForCausalLM", rope_theta=500000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=8192, **SHAPES[shape])


def random_model(config: LlamaArchConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
                 ) -> LlamaForCausalLM:
    """Our model with N(0, 0.02) weights drawn on the device (norm gains 1)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype)
    model.to_empty(device=device)
    model.model.rotary_emb.reset_inv_freq()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def transformers_twin(model: LlamaForCausalLM, config: LlamaArchConfig, device: torch.device):
    """transformers' LlamaForCausalLM whose parameters ARE our model's tensors (shared, no copy:
    its q/k/v_proj and gate/up_proj are row views of our fused qkv_proj / gate_up_proj)."""
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    hf.load_state_dict(checkpoint_tensors(model), assign=True, strict=False)
    # The rotary buffer is not a parameter: rebuild it on the device.
    with torch.device(device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_config)
    leftover = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    assert not leftover, f"transformers twin: tensors left on meta: {leftover[:4]}"
    return hf.eval()


def time_transformers(hf, config: LlamaArchConfig, batch: int, q: int, context: int, device, dtype,
                      warmup: int, iters: int) -> float:
    """transformers' forward with a DynamicCache of `context` tokens, cropped back after each step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    shape = (batch, config.num_key_value_heads, context, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.zeros(shape, dtype=dtype, device=device),
                     torch.zeros(shape, dtype=dtype, device=device), layer)
    input_ids = torch.arange(batch * q, device=device).view(batch, q) % config.vocab_size
    positions = torch.arange(context, context + q, device=device)[None].expand(batch, q)

    def step():
        with torch.no_grad():
            hf(input_ids=input_ids, past_key_values=cache, position_ids=positions, use_cache=True,
               cache_position=positions[0])
        cache.crop(-q)  # negative: remove the q new tokens (old and new transformers agree)

    return _median_ms(step, device, warmup, iters)


def unless_out_of_memory(column: str, oom: list[str], measure):
    """measure(), or None with the column named in `oom` where the device ran out of memory (the
    rest of the table still runs; the allocator's cache is emptied for the next column)."""
    try:
        return measure()
    except torch.OutOfMemoryError:
        oom.append(column)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def run_step_bench(shape: str = "8b", batches=(1, 8, 32, 64, 128), qs=(1, 4), context: int = 1024,
                   device: str | None = None, bandwidth_tbs: float = 4.8, warmup: int = 3, iters: int = 10,
                   with_transformers: bool = True, block_size: int = 64, prefill_lens=(32, 128),
                   graph_captures: int = 1) -> tuple[list[StepRow], dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    config = arch_config(shape)
    t0 = time.perf_counter()
    model = random_model(config, dtype, dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = weight_bytes / (bandwidth_tbs * 1e12) * 1e3
    blocks = max(batches) * -(-(context + max(qs)) // block_size)
    engine_config = PytorchEngineConfig(max_batch_size=max(batches), block_size=block_size,
                                        num_gpu_blocks=blocks, session_len=context + max(qs),
                                        device_type=dev.type,
                                        dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    # Graphs on CUDA; on CPU the static-buffer path without capture (same code, no graph).
    # The default: specd's Triton kernels (fused_forward.py) and the skinny GEMM where they apply;
    # "torch ops": the same static path over PyTorch ops only (cuBLAS, SDPA), their CPU twin.
    graphs = LlamaRunner(".", engine_config, model=model, config=config, use_static_path=True,
                         gemm="auto", kernels="auto", pdl="auto")
    # One KV cache for all of them (each timing adds its sequences and frees them): three 8B
    # caches at batch 128 (18 GB each) and transformers' own did not fit an 80 GB card.
    shared = graphs.kv_cache
    torch_ops = LlamaRunner(".", engine_config, model=model, config=config, use_static_path=True,
                            gemm="torch", kernels="off", kv_cache=shared)
    eager = LlamaRunner(".", engine_config, model=model, config=config, use_static_path=False, kv_cache=shared)
    hf = transformers_twin(model, config, dev) if with_transformers else None
    init_s = time.perf_counter() - t0
    rows = []
    for batch in batches:
        for q in qs:
            each = time_recaptured(graphs, batch, q, context, warmup, iters, graph_captures)
            g = sorted(each)[len(each) // 2]
            st = time_specd_staged(graphs, batch, q, context, warmup, iters)
            n = time_without_pdl(graphs, batch, q, context, warmup, iters) if dev.type == "cuda" else None
            c = time_specd(torch_ops, batch, q, context, warmup, iters)
            e = time_specd(eager, batch, q, context, warmup, iters)
            oom: list[str] = []
            h = (unless_out_of_memory("transformers", oom, lambda: time_transformers(
                hf, config, batch, q, context, dev, dtype, warmup, iters)) if hf is not None else None)
            rows.append(StepRow(batch, q, g, e, h, floor_ms, specd_torch_ops_ms=c, specd_no_pdl_ms=n,
                                specd_graphs_captures_ms=each, specd_staged_ms=st, out_of_memory=tuple(oom)))
            print(format_row(rows[-1]), flush=True)
            if len(each) > 1:
                print(f"  graphs, each capture: {', '.join(f'{ms:.3f}' for ms in each)} ms", flush=True)
    prefill = [{"tokens": n, "graphs_ms": time_specd(graphs, 1, n, 0, warmup, iters),
                "eager_ms": time_specd(eager, 1, n, 0, warmup, iters)}
               for n in prefill_lens if n <= context + max(qs)]  # within the runners' session_len
    for p in prefill:
        print(f"prefill batch 1, {p['tokens']} tokens: graphs {p['graphs_ms']:.2f} ms, eager {p['eager_ms']:.2f} ms",
              flush=True)
    checks = check_step_outputs(graphs, torch_ops, context, [(b, q) for b in (1, 8, 64) if b <= max(batches)
                                                            for q in (max(qs),)])
    info = {"shape": shape, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": str(dtype), "context": context, "weight_bytes": weight_bytes,
            "bandwidth_tbs": bandwidth_tbs, "init_s": round(init_s, 2),
            "graph_captures": graphs.static.num_captures, "fused_kernels": graphs.static.fused, "torch": torch.__version__,
            "sdpa_backend": sdpa_backend(config, dtype, dev),
            "output_checks": checks, "prefill": prefill}
    return rows, info


def sdpa_backend(config: LlamaArchConfig, dtype: torch.dtype, device: torch.device) -> str:
    """Which SDPA kernel the static path's call shape gets (q folded to Hkv heads, float mask), as
    torch's dispatcher picks it; "unknown" where torch does not say (a private helper)."""
    try:
        g = config.num_attention_heads // config.num_key_value_heads
        b, kv, d, s = 2, config.num_key_value_heads, config.head_dim, 1024
        q = torch.zeros(b, kv, g * 4, d, dtype=dtype, device=device)
        k = torch.zeros(b, kv, s, d, dtype=dtype, device=device)
        mask = torch.zeros(b, 1, g * 4, s, dtype=dtype, device=device)
        choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, False, scale=d ** -0.5)
        return str(torch.nn.attention.SDPBackend(choice).name)
    except Exception as e:  # noqa: BLE001 - informational only
        return f"unknown ({type(e).__name__})"


HEADER = ("| batch | q | specd graphs ms | specd graphs staged ms | specd graphs no-PDL ms | specd graphs torch-ops ms "
          "| specd eager ms | transformers ms | floor ms | graphs / floor | staged / floor | transformers / graphs |")


def format_row(r: StepRow) -> str:
    def ms(v, column=""):
        return f"{v:.2f}" if v is not None else ("OOM" if column in r.out_of_memory else "-")

    def times(num, den, digits):
        return f"{num / den:.{digits}f}x" if num is not None and den is not None else "-"

    return (f"| {r.batch} | {r.q} | {ms(r.specd_graphs_ms)} | {ms(r.specd_staged_ms)} | {ms(r.specd_no_pdl_ms)} | "
            f"{ms(r.specd_torch_ops_ms)} | {ms(r.specd_eager_ms)} | "
            f"{ms(r.transformers_ms, 'transformers')} | {r.floor_ms:.2f} | {r.graphs_over_floor:.2f}x | "
            f"{times(r.specd_staged_ms, r.floor_ms, 2)} | {times(r.transformers_ms, r.specd_graphs_ms, 1)} |")


def write_step_results(rows: list[StepRow], info: dict, out_dir: Path) -> str:
    lines = [f"verify-step forward, {info['shape']} shape, {info['dtype']}, context {info['context']}, "
             f"{info['device']}; floor = {info['weight_bytes'] / 1e9:.2f} GB of weights at "
             f"{info['bandwidth_tbs']} TB/s; "
             f"SDPA kernel {info.get('sdpa_backend')}", "", HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [format_row(r) for r in rows]
    lines += ["", "outputs on the same cached keys and values (batch, q: PDL vs no-PDL max |diff|; staged vs "
              "unstaged max |diff|; kernels vs PyTorch-ops relative error):"]
    lines += [f"- {c['batch']}, {c['q']}: {c['pdl_vs_no_pdl_max_abs']:.3g}; {c['staged_vs_unstaged_max_abs']:.3g}; "
              f"{c['kernels_vs_torch_ops_rel_err']:.3g}"
              f"{'' if c['finite'] else ' (NOT FINITE)'}" for c in info.get("output_checks", [])]
    if info.get("prefill"):
        lines += ["", "prefill forward, batch 1, empty cache (graphs: the static path's Q bucket; eager: varlen):", "",
                  "| prompt tokens | graphs ms | eager ms | eager / graphs |", "|---|---|---|---|"]
        lines += [f"| {p['tokens']} | {p['graphs_ms']:.2f} | {p['eager_ms']:.2f} | {p['eager_ms'] / p['graphs_ms']:.1f}x |"
                  for p in info["prefill"]]
    table = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "step.md").write_text(table)
    (out_dir / "step.json").write_text(json.dumps(
        {"info": info, "rows": [asdict(r) | {"graphs_over_floor": r.graphs_over_floor,
                                              "staged_over_floor": r.staged_over_floor,
                                              "transformers_over_graphs": r.transformers_over_graphs}
                                for r in rows]}, indent=1))
    return table
