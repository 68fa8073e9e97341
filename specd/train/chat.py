"""Chat-formatted training examples, so the target also answers OpenAI chat requests with code.

A share of the training files is rendered through the tokenizer's own chat template (the one the
gateway applies): the user turn holds a file's first lines, the assistant turn continues the file.
"""

from __future__ import annotations

import random

MAX_ASSISTANT_CHARS = 2000


def chat_examples(texts: list[str], tokenizer, fraction: float, seed: int) -> list[str]:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction: must be in [0, 1], got {fraction}")
    rng = random.Random(seed)
    out = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        if rng.random() >= fraction or len(lines) < 8:
            continue
        cut = rng.randint(3, min(12, len(lines) - 4))
        messages = [{"role": "user", "content": "".join(lines[:cut]).rstrip("\n")},
                    {"role": "assistant", "content": "".join(lines[cut:])[:MAX_ASSISTANT_CHARS]}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return out
