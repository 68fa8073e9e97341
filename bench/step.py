"""Verify-step time of an 8B-shaped Llama: specd (CUDA graphs, graphs + torch.compile, eager) vs
transformers, vs the floor.

The target forward of one engine step (all layers + lm_head, logits for every new token) over a
batch whose sequences each hold `context` cached tokens, appending q tokens per sequence (q = 1:
plain decode; q = k + 1: verification of k drafts). Random bf16 weights are drawn directly on
the device (no checkpoint); transformers' LlamaForCausalLM uses the very same tensors (no copy)
with its own DynamicCache at the same context and sdpa attention. The floor is reading every
weight once at the GPU's memory bandwidth (default 4.8 TB/s, the H200). With `compile_mode`
(`python -m bench step --compile`) a third specd runner over the same weights runs the static path
with each layer's attention-free regions torch.compile'd (specd/models/compile.py) under the same
CUDA graphs; its compile time is spent in each shape's warm-up and reported in the info.

    python -m bench step --out results/            # 8B shape on CUDA
    python -m bench step --small --out /tmp/x      # toy shape, CPU, seconds (the CPU test)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specd.messages import PytorchEngineConfig
from specd.models.base import SequenceChunk
from specd.models.hf_config import LlamaArchConfig
from specd.models.kernels.l2_prefetch import PrefetchPlan
from specd.models.llama import LlamaForCausalLM
from specd.models.llama_runner import LlamaRunner
from specd.models.merged_linear import checkpoint_tensors

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
    specd_compiled_ms: float | None = None  # graphs + torch.compile'd layer regions
    specd_torch_ops_ms: float | None = None  # graphs over PyTorch ops only (cuBLAS, SDPA): the twin
    specd_no_pdl_ms: float | None = None  # graphs over the kernels, launched without PDL (CUDA only)
    l2_prefetch_ms: dict[str, float] = field(default_factory=dict)  # plan -> graphs ms under it (CUDA)
    env_variant_ms: dict[str, float] = field(default_factory=dict)  # "K=V,..." -> graphs ms under it

    @property
    def compiled_over_floor(self) -> float | None:
        return None if self.specd_compiled_ms is None else self.specd_compiled_ms / self.floor_ms

    @property
    def graphs_over_floor(self) -> float:
        return self.specd_graphs_ms / self.floor_ms

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def time_specd(runner: LlamaRunner, batch: int, q: int, context: int, warmup: int, iters: int) -> float:
    """Forward of `batch` sequences holding `context` tokens, q new tokens each (rolled back after)."""
    ids = list(range(batch))
    for s in ids:
        runner.add_sequence(s)
        runner.kv_cache.append_slots(s, context)  # cached context: slots reserved, values irrelevant
    vocab = runner.config.vocab_size
    chunks = [SequenceChunk(s, [(7 * s + j) % vocab for j in range(q)]) for s in ids]

    def step():
        runner.forward(chunks)
        for s in ids:
            runner.truncate(s, context)

    try:
        return _median_ms(step, runner.device, warmup, iters)
    finally:
        for s in ids:
            runner.free(s)


class runner_setting:
    """Context manager: runner.<attr> = value with its graphs dropped and captured again under it,
    then restored (and dropped again): two columns of one runner differ in nothing else, and no
    second KV cache takes the memory another runner would."""

    def __init__(self, runner: LlamaRunner, attr: str, value) -> None:
        self.runner, self.attr, self.value = runner, attr, value

    def __enter__(self) -> LlamaRunner:
        self.saved = getattr(self.runner, self.attr)
        setattr(self.runner, self.attr, self.value)
        self.runner.static.drop_graphs()
        return self.runner

    def __exit__(self, *exc) -> None:
        setattr(self.runner, self.attr, self.saved)
        self.runner.static.drop_graphs()


def time_without_pdl(runner: LlamaRunner, batch: int, q: int, context: int, warmup: int, iters: int) -> float:
    """The same runner with its kernels launched without PDL (kernels/pdl.py)."""
    with runner_setting(runner, "pdl", "off"):
        return time_specd(runner, batch, q, context, warmup, iters)


class env_variant:
    """Context manager: the environment settings of a kernel experiment ("SPECD_ATTN_PROGRAMS=132,
    SPECD_QKV_SPLIT_K=1"; the kernels read them at capture time) with the runner's graphs dropped
    before and after, so the variant's graphs are captured under them and nothing else differs."""

    def __init__(self, runner: LlamaRunner, spec: str) -> None:
        self.runner = runner
        self.settings = dict(part.split("=", 1) for part in spec.split(",") if part)

    def __enter__(self) -> LlamaRunner:
        self.saved = {k: os.environ.get(k) for k in self.settings}
        os.environ.update(self.settings)
        self.runner.static.drop_graphs()
        return self.runner

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.runner.static.drop_graphs()


def time_l2_prefetch(runner: LlamaRunner, plans: list[str], batch: int, q: int, context: int, warmup: int,
                     iters: int) -> dict[str, float]:
    """The same runner under each L2 prefetch plan (kernels/l2_prefetch.py), PDL as configured."""
    out = {}
    for spec in plans:
        plan = PrefetchPlan.parse(spec)
        with runner_setting(runner, "l2_prefetch", plan):
            out[plan.describe()] = time_specd(runner, batch, q, context, warmup, iters)
    return out


def step_logits(runner: LlamaRunner, batch: int, q: int, context: int) -> torch.Tensor:
    """The logits [batch * q, V] of one step as time_specd runs it (rolled back after). The cached
    keys and values are N(0, 1) draws seeded by the sequence, written through its block table:
    what a sequence attends to must not depend on which physical blocks the allocator hands out
    (a free list returns them in another order on the next call)."""
    ids = list(range(batch))
    for s in ids:
        runner.add_sequence(s)
        runner.kv_cache.append_slots(s, context)
        _fill_sequence_cache(runner, s)
    vocab = runner.config.vocab_size
    try:
        return runner.forward([SequenceChunk(s, [(7 * s + j) % vocab for j in range(q)]) for s in ids]).logits
    finally:
        for s in ids:
            runner.free(s)


def _fill_sequence_cache(runner: LlamaRunner, seq_id: int) -> None:
    """Every cache block of seq_id, in every layer, gets N(0, 1) draws seeded by (seq_id, layer)."""
    blocks = torch.tensor(runner.kv_cache.block_table(seq_id), device=runner.device)
    for layer, (k, v) in enumerate(zip(runner.kv_cache.k_caches, runner.kv_cache.v_caches)):
        gen = torch.Generator(device=runner.device).manual_seed(1000 * seq_id + layer)
        for cache in (k, v):
            shape = (len(blocks),) + tuple(cache.shape[1:])
            cache[blocks] = torch.randn(shape, generator=gen, device=runner.device, dtype=cache.dtype)


def time_env_variants(runner: LlamaRunner, variants: list[str], batch: int, q: int, context: int, warmup: int,
                      iters: int) -> dict[str, float]:
    """The same runner under each environment variant (env_variant), PDL as configured."""
    out = {}
    for spec in variants:
        with env_variant(runner, spec):
            out[spec] = time_specd(runner, batch, q, context, warmup, iters)
    return out


def check_env_variants(graphs: LlamaRunner, context: int, variants: list[str], batch: int, q: int) -> dict:
    """Each variant's logits against the default graphs' on the same cached keys and values: a
    variant may change the fp32 summation order (split-K, more key chunks), so this is the
    relative error, expected at bf16 rounding (~1e-3) or below, and zero for a hint."""
    base = step_logits(graphs, batch, q, context).double()
    out = {}
    for spec in variants:
        with env_variant(graphs, spec):
            got = step_logits(graphs, batch, q, context).double()
        out[spec] = {"max_abs": (got - base).abs().max().item(),
                     "rel_err": ((got - base).norm() / base.norm()).item()}
    return out


def check_step_outputs(graphs: LlamaRunner, torch_ops: LlamaRunner, context: int, shapes,
                       l2_plans: list[str] = ()) -> list[dict]:
    """What the timed columns compute, compared on the same cached keys and values (step_logits
    fills them per sequence, whatever blocks it holds): the kernels with PDL against the same graphs without it
    (a missing wait would be a race: must be bit-identical), under each L2 prefetch plan (a hint:
    must be bit-identical) and against the PyTorch-ops twin (bf16 rounding: relative error ~1e-2)."""
    out = []
    for batch, q in shapes:
        with_pdl = step_logits(graphs, batch, q, context)
        with runner_setting(graphs, "pdl", "off"):
            without = step_logits(graphs, batch, q, context)
        prefetch_diff = 0.0
        for spec in l2_plans:
            with runner_setting(graphs, "l2_prefetch", PrefetchPlan.parse(spec)):
                prefetch_diff = max(prefetch_diff, (step_logits(graphs, batch, q, context) - with_pdl).abs().max().item())
        twin = step_logits(torch_ops, batch, q, context).double()
        rel = ((with_pdl.double() - twin).norm() / twin.norm()).item()
        out.append({"batch": batch, "q": q, "pdl_vs_no_pdl_max_abs": (with_pdl - without).abs().max().item(),
                    "l2_prefetch_vs_none_max_abs": prefetch_diff if l2_plans else None,
                    "kernels_vs_torch_ops_rel_err": rel, "finite": bool(torch.isfinite(with_pdl).all())})
        print(f"check batch {batch} q {q}: {out[-1]}", flush=True)
    return out


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


def run_step_bench(shape: str = "8b", batches=(1, 8, 32, 64, 128), qs=(1, 4), context: int = 1024,
                   device: str | None = None, bandwidth_tbs: float = 4.8, warmup: int = 3, iters: int = 10,
                   with_transformers: bool = True, block_size: int = 64, compile_mode: str | None = None,
                   compile_budget_s: float = 240.0, l2_plans: list[str] = (), prefill_lens=(32, 128),
                   env_variants: list[str] = ()) -> tuple[list[StepRow], dict]:
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
    # compile_mode "0": these two never compile, whatever SPECD_COMPILE says.
    # The default: specd's Triton kernels (fused_forward.py) and the skinny GEMM where they apply;
    # "torch ops": the same static path over PyTorch ops only (cuBLAS, SDPA), their CPU twin.
    graphs = LlamaRunner(".", engine_config, model=model, config=config, use_static_path=True,
                         compile_mode="0", gemm="auto", kernels="auto", pdl="auto")
    torch_ops = LlamaRunner(".", engine_config, model=model, config=config, use_static_path=True,
                            compile_mode="0", gemm="torch", kernels="off")
    eager = LlamaRunner(".", engine_config, model=model, config=config, use_static_path=False,
                        compile_mode="0")
    compiled = (LlamaRunner(".", engine_config, model=model, config=config, use_static_path=True,
                            compile_mode=compile_mode) if compile_mode else None)
    hf = transformers_twin(model, config, dev) if with_transformers else None
    init_s = time.perf_counter() - t0
    rows = []
    for batch in batches:
        for q in qs:
            g = time_specd(graphs, batch, q, context, warmup, iters)
            n = time_without_pdl(graphs, batch, q, context, warmup, iters) if dev.type == "cuda" else None
            pf = time_l2_prefetch(graphs, list(l2_plans), batch, q, context, warmup, iters) if dev.type == "cuda" else {}
            ev = time_env_variants(graphs, list(env_variants), batch, q, context, warmup, iters)
            c = time_specd(torch_ops, batch, q, context, warmup, iters)
            e = time_specd(eager, batch, q, context, warmup, iters)
            h = (time_transformers(hf, config, batch, q, context, dev, dtype, warmup, iters)
                 if hf is not None else None)
            rows.append(StepRow(batch, q, g, e, h, floor_ms, specd_torch_ops_ms=c, specd_no_pdl_ms=n,
                                l2_prefetch_ms=pf, env_variant_ms=ev))
            print(format_row(rows[-1]), flush=True)
            for plan, ms in pf.items():
                print(f"  l2 prefetch {plan}: {ms:.3f} ms (graphs {g:.3f})", flush=True)
            for spec, ms in ev.items():
                print(f"  env {spec}: {ms:.3f} ms (graphs {g:.3f})", flush=True)
    prefill = [{"tokens": n, "graphs_ms": time_specd(graphs, 1, n, 0, warmup, iters),
                "eager_ms": time_specd(eager, 1, n, 0, warmup, iters)}
               for n in prefill_lens if n <= context + max(qs)]  # within the runners' session_len
    for p in prefill:
        print(f"prefill batch 1, {p['tokens']} tokens: graphs {p['graphs_ms']:.2f} ms, eager {p['eager_ms']:.2f} ms",
              flush=True)
    checks = check_step_outputs(graphs, torch_ops, context, [(b, q) for b in (1, 8, 64) if b <= max(batches)
                                                            for q in (max(qs),)],
                                l2_plans=list(l2_plans) if dev.type == "cuda" else [])
    compile_info = time_compiled_column(compiled, rows, context, warmup, iters, compile_budget_s)
    info = {"shape": shape, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": str(dtype), "context": context, "weight_bytes": weight_bytes,
            "bandwidth_tbs": bandwidth_tbs, "init_s": round(init_s, 2),
            "graph_captures": graphs.static.num_captures, "fused_kernels": graphs.static.fused, "torch": torch.__version__,
            "compile_mode": compile_mode, "sdpa_backend": sdpa_backend(config, dtype, dev),
            "output_checks": checks, "prefill": prefill,
            "env_variant_checks": check_env_variants(graphs, context, list(env_variants), 1, max(qs)),
            **compile_info}
    return rows, info


def time_compiled_column(compiled: LlamaRunner | None, rows: list[StepRow], context: int, warmup: int,
                         iters: int, budget_s: float) -> dict:
    """Fill specd_compiled_ms row by row, after every other column is measured: a compile or
    capture failure then costs this column only (recorded as compile_error), and rows past the
    time budget (compiles take seconds per shape) stay empty instead of eating the e2e half."""
    if compiled is None:
        return {}
    t0, info = time.perf_counter(), {}
    for row in rows:
        if time.perf_counter() - t0 > budget_s:
            info["compile_skipped_rows"] = info.get("compile_skipped_rows", 0) + 1
            continue
        try:
            row.specd_compiled_ms = time_specd(compiled, row.batch, row.q, context, warmup, iters)
        except Exception as e:  # noqa: BLE001 - reported in the results, the other columns stand
            info["compile_error"] = f"batch {row.batch} q {row.q}: {type(e).__name__}: {e}"[:2000]
            print(f"compile column stopped: {info['compile_error']}", flush=True)
            break
        print(format_row(row), flush=True)
    # Compiles (first call per shape) + captures + the timed runs of that column.
    info["compile_column_s"] = round(time.perf_counter() - t0, 1)
    return info


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


HEADER = ("| batch | q | specd graphs ms | specd graphs no-PDL ms | specd graphs+compile ms | specd graphs torch-ops ms "
          "| specd eager ms | transformers ms | floor ms | graphs / floor | graphs+compile / floor | transformers / graphs "
          "| transformers / graphs+compile |")


def format_row(r: StepRow) -> str:
    def ms(v):
        return f"{v:.2f}" if v is not None else "-"

    def times(num, den, digits):
        return f"{num / den:.{digits}f}x" if num is not None and den is not None else "-"

    return (f"| {r.batch} | {r.q} | {ms(r.specd_graphs_ms)} | {ms(r.specd_no_pdl_ms)} | {ms(r.specd_compiled_ms)} | "
            f"{ms(r.specd_torch_ops_ms)} | {ms(r.specd_eager_ms)} | {ms(r.transformers_ms)} | {r.floor_ms:.2f} | "
            f"{r.graphs_over_floor:.2f}x | {times(r.specd_compiled_ms, r.floor_ms, 2)} | "
            f"{times(r.transformers_ms, r.specd_graphs_ms, 1)} | "
            f"{times(r.transformers_ms, r.specd_compiled_ms, 1)} |")


def write_step_results(rows: list[StepRow], info: dict, out_dir: Path) -> str:
    lines = [f"verify-step forward, {info['shape']} shape, {info['dtype']}, context {info['context']}, "
             f"{info['device']}; floor = {info['weight_bytes'] / 1e9:.2f} GB of weights at "
             f"{info['bandwidth_tbs']} TB/s; compile mode {info.get('compile_mode') or 'off'}, "
             f"SDPA kernel {info.get('sdpa_backend')}", "", HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [format_row(r) for r in rows]
    lines += ["", "outputs on the same cached keys and values (batch, q: PDL vs no-PDL max |diff|; kernels vs "
              "PyTorch-ops relative error):"]
    lines += [f"- {c['batch']}, {c['q']}: {c['pdl_vs_no_pdl_max_abs']:.3g}; {c['kernels_vs_torch_ops_rel_err']:.3g}"
              f"{'' if c.get('l2_prefetch_vs_none_max_abs') is None else '; L2 prefetch plans vs none max |diff| %.3g' % c['l2_prefetch_vs_none_max_abs']}"
              f"{'' if c['finite'] else ' (NOT FINITE)'}" for c in info.get("output_checks", [])]
    if info.get("prefill"):
        lines += ["", "prefill forward, batch 1, empty cache (graphs: the static path's Q bucket; eager: varlen):", "",
                  "| prompt tokens | graphs ms | eager ms | eager / graphs |", "|---|---|---|---|"]
        lines += [f"| {p['tokens']} | {p['graphs_ms']:.2f} | {p['eager_ms']:.2f} | {p['eager_ms'] / p['graphs_ms']:.1f}x |"
                  for p in info["prefill"]]
    variants = [(r, spec, ms) for r in rows for spec, ms in r.env_variant_ms.items()]
    if variants:
        checks = info.get("env_variant_checks", {})
        lines += ["", "kernel experiments (environment settings, graphs captured under each; logits vs the "
                  "default graphs at batch 1, q max):", "",
                  "| batch | q | settings | ms | vs graphs | / floor | rel err |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r.batch} | {r.q} | {spec} | {ms:.2f} | {ms / r.specd_graphs_ms:.3f}x | {ms / r.floor_ms:.2f}x | "
                  f"{checks.get(spec, {}).get('rel_err', float('nan')):.2g} |" for r, spec, ms in variants]
    plans = [(r, plan, ms) for r in rows for plan, ms in r.l2_prefetch_ms.items()]
    if plans:
        lines += ["", "L2 prefetch plans (kernels/l2_prefetch.py), graphs with PDL as above:", "",
                  "| batch | q | plan | ms | vs graphs | / floor |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.batch} | {r.q} | {plan} | {ms:.2f} | {ms / r.specd_graphs_ms:.3f}x | {ms / r.floor_ms:.2f}x |"
                  for r, plan, ms in plans]
    table = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "step.md").write_text(table)
    (out_dir / "step.json").write_text(json.dumps(
        {"info": info, "rows": [asdict(r) | {"graphs_over_floor": r.graphs_over_floor,
                                              "compiled_over_floor": r.compiled_over_floor,
                                              "transformers_over_graphs": r.transformers_over_graphs}
                                for r in rows]}, indent=1))
    return table
