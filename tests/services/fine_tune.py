"""A tiny target taught a few chat answers (a few seconds on the CPU), for tests of what a model
writes that the random tiny targets never do: tool calls, reasoning."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specd.models.loader import load_tokenizer


def fine_tune_chat(base: Path, out_dir: Path, pairs: list[tuple[str, str]], *, tools: list | None = None,
                   template: str | None = None, steps: int = 200) -> None:
    """The base target, trained on (question, answer) chat turns until it repeats the answers
    (greedy); saved with its tokenizer (and `template` as its chat template, when given)."""
    tokenizer = load_tokenizer(base)
    if template is not None:
        tokenizer.chat_template = template
    rows = []
    for question, answer in pairs:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=tools,
                                               tokenize=False, add_generation_prompt=True)
        p = tokenizer.encode(prompt, add_special_tokens=False)
        a = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        rows.append((p + a, len(p)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (row, num_prompt) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, num_prompt:len(row)] = torch.tensor(row[num_prompt:])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, f"fine-tuning did not converge: loss {loss.item():.3f}"
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if (base / "generation_config.json").exists():
        shutil.copy(base / "generation_config.json", out_dir / "generation_config.json")
