"""`specd train family OUT`: tokenizer, target, EAGLE-3 head, MTP head and draft model in one run.

Writes OUT/specd-py-{target,eagle3,mtp,draft} in the layouts specd's loaders read and
OUT/TRAINING.json (corpus, sizes, losses, agreement, timings). Stage budgets keep the whole run
inside a time limit on any hardware (specd.train.loop); `Budget.toy()` is the CPU-test size.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from specd.proposers.eagle3 import default_aux_layer_ids
from specd.train.chat import chat_examples
from specd.train.corpus import WindowSampler, split_stdlib, tokenize_texts
from specd.train.data import DrafterBatches, self_distillation_pool
from specd.train.draft import train_draft
from specd.train.eagle3 import build_eagle3_task, frequent_token_ids, save_eagle3
from specd.train.loop import LoopConfig
from specd.train.mtp import build_mtp_task, save_mtp
from specd.train.pair_head import train_pair_head
from specd.train.shapes import DRAFT_SHAPE, DRAFT_VOCAB_SIZE, TARGET_SHAPE, LlamaShape
from specd.train.target import llama_config, mean_nll, save_llama, train_lm

NAMES = {"target": "specd-py-target", "eagle3": "specd-py-eagle3", "mtp": "specd-py-mtp",
         "draft": "specd-py-draft"}


@dataclass
class StageBudget:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    time_budget_s: float | None = None

    def loop(self, log_every: int) -> LoopConfig:
        return LoopConfig(steps=self.steps, lr=self.lr, warmup_steps=min(100, self.steps // 10),
                          time_budget_s=self.time_budget_s, log_every=log_every)


@dataclass
class Budget:
    target: StageBudget = field(default_factory=lambda: StageBudget(3000, 64, 512, 2e-3, 100))
    eagle3: StageBudget = field(default_factory=lambda: StageBudget(6000, 64, 256, 1.5e-3, 140))
    mtp: StageBudget = field(default_factory=lambda: StageBudget(6000, 64, 256, 1.5e-3, 100))
    draft: StageBudget = field(default_factory=lambda: StageBudget(4000, 64, 256, 2e-3, 60))
    target_shape: LlamaShape = TARGET_SHAPE
    draft_shape: LlamaShape = DRAFT_SHAPE
    draft_vocab_size: int = DRAFT_VOCAB_SIZE
    ttt_steps: int = 4
    self_fraction: float = 0.5  # share of drafter batches from the target's own greedy text
    self_pool_batches: int = 8
    self_pool_batch_size: int = 256  # rows generated together: the pool costs sequential steps
    chat_fraction: float = 0.25
    corpus_limit_bytes: int | None = None
    log_every: int = 100

    @classmethod
    def toy(cls) -> "Budget":
        """Seconds on CPU: tiny shapes, a few dozen steps, a 300 kB corpus."""
        tiny = LlamaShape(vocab_size=384, hidden_size=32, num_layers=6, num_heads=2,
                          num_kv_heads=1, intermediate_size=64, max_position_embeddings=512)
        small = replace(tiny, hidden_size=16, num_layers=2, num_heads=1)
        stage = StageBudget(40, 8, 64, 3e-3)
        return cls(target=stage, eagle3=stage, mtp=stage, draft=stage, target_shape=tiny,
                   draft_shape=replace(small, vocab_size=tiny.vocab_size), draft_vocab_size=128,
                   ttt_steps=3, self_pool_batches=2, self_pool_batch_size=8, chat_fraction=0.5,
                   corpus_limit_bytes=300_000, log_every=10)


def train_family(out_dir: str | Path, budget: Budget | None = None, device: str | None = None,
                 seed: int = 0, corpus_root: str | Path | None = None, log=print) -> dict:
    from specd.tiny_models.tokenizer import EOS_TOKEN, IM_END, train_tokenizer

    budget = budget or Budget()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    started = time.monotonic()
    record: dict = {"python": sys.version.split()[0], "platform": platform.platform(),
                    "torch": torch.__version__, "device": str(dev), "budget": asdict(budget)}
    if dev.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(dev)
        torch.backends.cuda.matmul.allow_tf32 = True

    split = split_stdlib(root=Path(corpus_root) if corpus_root else None)
    train_texts = split.texts("train", budget.corpus_limit_bytes)
    held_texts = split.texts("held_out", budget.corpus_limit_bytes)
    tokenizer = train_tokenizer(budget.target_shape.vocab_size, texts=train_texts)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    eos_ids = [eos_id, tokenizer.convert_tokens_to_ids(IM_END)]
    chats = chat_examples(train_texts, tokenizer, budget.chat_fraction, seed)
    stream = tokenize_texts(tokenizer, train_texts + chats, eos_id)
    held_stream = tokenize_texts(tokenizer, held_texts, eos_id)
    record["corpus"] = {"stdlib": str(split.root), "train_files": len(split.train),
                        "held_out_files": len(split.held_out), "chat_examples": len(chats),
                        "train_tokens": int(stream.numel()),
                        "held_out_tokens": int(held_stream.numel()),
                        "tokenize_s": round(time.monotonic() - started, 1)}
    log(f"[corpus] {record['corpus']}")

    # target --------------------------------------------------------------------------------------
    b = budget.target
    target = LlamaForCausalLM(llama_config(budget.target_shape, 0, eos_ids, eos_id)).to(dev)
    sampler = WindowSampler(stream, b.seq_len, b.batch_size, seed)
    nll_before = mean_nll(target, held_stream, b.seq_len, dev)
    result = train_lm(target, sampler, b.loop(budget.log_every), dev, log=log)
    record["target"] = dict(result.to_dict(), held_out_nll_before=round(nll_before, 4),
                            held_out_nll=round(mean_nll(target, held_stream, b.seq_len, dev), 4),
                            parameters=sum(p.numel() for p in target.parameters()))
    target.eval().requires_grad_(False)
    paths = {"target": save_llama(target, out / NAMES["target"], tokenizer)}
    target = target.float()  # keep training the drafters against float32 master weights
    aux_ids = default_aux_layer_ids(budget.target_shape.num_layers)

    # One pool of the target's own greedy text serves every drafter stage (same seq_len).
    drafter_len = budget.eagle3.seq_len
    if {budget.mtp.seq_len, budget.draft.seq_len} != {drafter_len}:
        raise ValueError("eagle3, mtp and draft stages must share one seq_len (one pool)")
    t0 = time.monotonic()
    pool = None
    if budget.self_fraction > 0 and budget.self_pool_batches > 0:
        pool = self_distillation_pool(
            target, WindowSampler(stream, drafter_len, budget.self_pool_batch_size, seed + 10),
            budget.self_pool_batches, dev)
    record["self_distillation"] = {"rows": 0 if pool is None else int(pool.shape[0]),
                                   "seq_len": drafter_len, "fraction": budget.self_fraction,
                                   "seconds": round(time.monotonic() - t0, 1)}
    log(f"[data] {record['self_distillation']}")

    def drafter_batches(stage: StageBudget, stage_seed: int) -> DrafterBatches:
        return DrafterBatches(WindowSampler(stream, stage.seq_len, stage.batch_size, stage_seed),
                              pool, dev, budget.self_fraction, stage_seed)

    def train_head(name: str, stage: StageBudget, stage_seed: int, task, save) -> None:
        """One TTT-trained head (EAGLE-3 or MTP): train, record, save (save(head) -> path)."""
        task.head.to(dev)
        result, agree = train_pair_head(task, target, aux_ids, drafter_batches(stage, stage_seed),
                                        stage.loop(budget.log_every), dev, name, log)
        record[name] = dict(result.to_dict(), top1_agreement_per_step=agree,
                            parameters=sum(p.numel() for p in task.head.parameters() if p.requires_grad))
        paths[name] = save(task.head)

    # EAGLE-3 -------------------------------------------------------------------------------------
    draft_ids = frequent_token_ids(stream, budget.target_shape.vocab_size, budget.draft_vocab_size)
    task, raw = build_eagle3_task(target, draft_ids, aux_ids, budget.ttt_steps)
    train_head("eagle3", budget.eagle3, seed + 1, task,
               lambda head: save_eagle3(head, raw, out / NAMES["eagle3"], tokenizer))
    del task

    # DeepSeek-style MTP --------------------------------------------------------------------------
    task, config = build_mtp_task(target, budget.ttt_steps)
    train_head("mtp", budget.mtp, seed + 2, task,
               lambda head: save_mtp(head, config, out / NAMES["mtp"], tokenizer))
    del task

    # draft model ---------------------------------------------------------------------------------
    b = budget.draft
    draft = LlamaForCausalLM(llama_config(budget.draft_shape, 0, eos_ids, eos_id)).to(dev)
    result = train_draft(draft, target, drafter_batches(b, seed + 3), b.loop(budget.log_every),
                         dev, log=log)
    record["draft"] = dict(result.to_dict(),
                           held_out_nll=round(mean_nll(draft, held_stream, b.seq_len, dev), 4),
                           parameters=sum(p.numel() for p in draft.parameters()))
    paths["draft"] = save_llama(draft, out / NAMES["draft"], tokenizer)

    record["seconds"] = round(time.monotonic() - started, 1)
    record["paths"] = {k: str(v) for k, v in paths.items()}
    (out / "TRAINING.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    log(f"[family] done in {record['seconds']} s: {record['paths']}")
    return record
