"""The training corpus: the Python standard library's sources, split into train and held-out files.

The split is by a hash of each file's path relative to the stdlib root, so it is the same on every
machine and Python version for the files they share; held-out files never reach training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EXCLUDED_PARTS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str, held_out_percent: int) -> bool:
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < held_out_percent


@dataclass(frozen=True)
class CorpusSplit:
    """Relative paths of the train and held-out source files under `root`."""

    root: Path
    train: tuple[str, ...]
    held_out: tuple[str, ...]

    def texts(self, which: str, limit_bytes: int | None = None) -> list[str]:
        """The decodable files of one side, in path order, up to about limit_bytes in total."""
        texts, total = [], 0
        for rel in getattr(self, which):
            try:
                text = (self.root / rel).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few test fixtures are deliberately not UTF-8
            texts.append(text)
            total += len(text)
            if limit_bytes is not None and total >= limit_bytes:
                break
        return texts


def split_stdlib(held_out_percent: int = 5, root: Path | None = None) -> CorpusSplit:
    if not 0 < held_out_percent < 100:
        raise ValueError(f"held_out_percent: must be in (0, 100), got {held_out_percent}")
    root = root or stdlib_root()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if not EXCLUDED_PARTS & set(p.parts))
    if not files:
        raise RuntimeError(f"no Python sources under {root}")
    held = tuple(f for f in files if is_held_out(f, held_out_percent))
    train = tuple(f for f in files if not is_held_out(f, held_out_percent))
    return CorpusSplit(root=root, train=train, held_out=held)


def tokenize_texts(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """One flat int32 stream [N]: every text's tokens followed by EOS, so files stay apart."""
    ids: list[int] = []
    for batch_start in range(0, len(texts), 256):
        for enc in tokenizer(texts[batch_start:batch_start + 256], add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


class WindowSampler:
    """Random windows [batch, seq_len] of a token stream, reproducible from the seed."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        if stream.numel() <= seq_len:
            raise ValueError(f"stream of {stream.numel()} tokens is shorter than seq_len={seq_len}")
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, device: torch.device | str) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - self.seq_len, (self.batch_size,),
                               generator=self.gen)
        offsets = starts[:, None] + torch.arange(self.seq_len)[None, :]  # [B, T]
        return self.stream[offsets].long().to(device, non_blocking=True)
