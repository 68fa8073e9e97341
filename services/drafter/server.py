"""The drafter process: load one proposer and serve it over gRPC, with health and reflection.

Only the drafter's own weights are loaded: the target contributes its config.json (vocabulary
size, hidden width) and, where the method reads them from the target checkpoint, the tensors it
needs (EAGLE-3's embeddings, the MTP heads), never the target model itself.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from services.common.grpc_server import RunningServer, serve_until_signal, start_grpc_server
from services.common.tls import PLAINTEXT, TLSConfig
from services.drafter.fast_steps import FastStepServer
from services.drafter.servicer import DrafterServicer
from specd import settings
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.models.hf_config import read_json
from specd.step_trace import DRAFTER_TRACE_FILE, StepTracer, TraceWindow
from specd.v1 import drafter_pb2, drafter_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50061
DRAFTER_SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


def target_text_config(target_path: str | Path) -> dict:
    """The target's config.json, or its `text_config` for multimodal checkpoints."""
    raw = read_json(Path(target_path) / "config.json")
    return raw.get("text_config") or raw


def _draft_constraints(target):
    """Draft masking for constrained requests; the grammar tables are built on first use."""
    from specd.proposers.draft_constraints import DraftConstraints

    def compiler():
        from specd.grammar.compiler import GrammarCompilerCache

        return GrammarCompilerCache.from_model_dir(target)

    return DraftConstraints(compiler)


def load_drafter(model_path: str | Path, spec: SpeculativeConfig, target_path: str | Path | None = None,
                 *, device: str = "cpu", dtype: str = "auto", max_num_draft_tokens: int = 32,
                 max_batch_size: int = 128, cache_max_entry_count: float = 0.8,
                 eager_mode: bool = False) -> DrafterServicer:
    """Build the proposer `spec` names and wrap it in a servicer.

    model_path: the draft checkpoint for eagle3 / draft_model when spec.model is empty (spec.model
    wins when set); for MTP and ngram pass the target. target_path: the target checkpoint
    (default: model_path). max_batch_size sizes draft_model's KV cache (all streams together), and
    cache_max_entry_count caps it at that fraction of the GPU memory free at load. eager_mode: no
    CUDA graphs (draft_model's steps, the EAGLE-3 / MTP heads' forwards).
    """
    from specd.models.runner_setup import select_dtype
    from specd.models.model_path import resolve_model_path
    from specd.proposers.factory import build_proposer
    from specd.proposers.warm_up import warm_up

    target = resolve_model_path(str(target_path or model_path))
    if not spec.model and target_path is not None and Path(model_path) != Path(target_path):
        spec = dataclasses.replace(spec, model=str(model_path))
    text = target_text_config(target)
    vocab_size = int(text["vocab_size"])
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)  # the draft runner places itself on the current CUDA device
    engine_config = PytorchEngineConfig(dtype=dtype, device_type=dev.type, max_batch_size=max_batch_size,
                                        cache_max_entry_count=cache_max_entry_count, eager_mode=eager_mode)
    proposer = build_proposer(spec, target, vocab_size, engine_config, dev, select_dtype(engine_config, dev))
    proposer.draft_constraints = _draft_constraints(target)
    hidden_size = {"none": 0, "final": int(text["hidden_size"]),
                   "aux": len(getattr(proposer, "aux_layer_ids", None) or []) * int(text["hidden_size"])
                   }[proposer.hidden_kind]
    # One-time costs (CUDA graphs, KV pools) before SERVING, not inside a verifier's step deadline.
    warm_up(proposer, hidden_width=hidden_size,
            num_draft_tokens=max(1, min(spec.num_speculative_tokens, max_num_draft_tokens)))
    window = TraceWindow.from_settings(settings.DRAFTER_TRACE_STEPS, DRAFTER_TRACE_FILE)
    return DrafterServicer(proposer, vocab_size=vocab_size, hidden_size=hidden_size,
                           max_num_draft_tokens=max_num_draft_tokens,
                           tracer=StepTracer(window, dev, host_ops=True) if window is not None else None)


DrafterServer = RunningServer  # the name tests and callers use


def start_server(servicer: DrafterServicer, host: str = "0.0.0.0", port: int = 0,
                 max_workers: int = 32, tls: TLSConfig = PLAINTEXT, fast_step_port: int = 0) -> RunningServer:
    """Start serving `servicer` (port 0: any free port; TLS when `tls` has a certificate); health turns
    SERVING once started. Without TLS, DraftSteps is also served over framed sockets on
    fast_step_port (0: any free port, -1: not at all; fast_steps.py), advertised in Info."""
    fast = None
    if fast_step_port >= 0 and not tls.serves_tls:
        fast = FastStepServer(servicer, host, fast_step_port)  # before gRPC: Info advertises its port
    running = start_grpc_server(servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, DRAFTER_SERVICE,
                                host=host, port=port, max_workers=max_workers, name="drafter", tls=tls)
    if fast is not None:
        running.also_stop.append(fast.stop)
    if servicer.tracer is not None:  # stopped inside its window: what was traced is still written
        running.also_stop.append(servicer.tracer.close)
    return running


def serve_drafter(model_path: str | Path, spec: SpeculativeConfig, target_path: str | Path | None = None,
                  host: str = "0.0.0.0", port: int = DEFAULT_PORT, device: str = "cpu", *,
                  dtype: str = "auto", max_num_draft_tokens: int = 32, max_batch_size: int = 128,
                  cache_max_entry_count: float = 0.8, max_workers: int = 32, grace_s: float = 5.0,
                  tls: TLSConfig = PLAINTEXT, fast_step_port: int = 0, eager_mode: bool = False) -> None:
    """Load, serve until SIGTERM or SIGINT, then stop gracefully (blocks; call from the main thread)."""
    t0 = time.perf_counter()
    servicer = load_drafter(model_path, spec, target_path, device=device, dtype=dtype,
                            max_num_draft_tokens=max_num_draft_tokens, max_batch_size=max_batch_size,
                            cache_max_entry_count=cache_max_entry_count, eager_mode=eager_mode)
    running = start_server(servicer, host, port, max_workers, tls, fast_step_port)
    logger.info("event=drafter_serving method=%s host=%s port=%d fast_step_port=%d device=%s load_s=%.2f",
                servicer.proposer.method, host, running.port, servicer.fast_step_port, device,
                time.perf_counter() - t0)
    serve_until_signal(running, logger, "drafter", grace_s)
