"""Pure tensor functions on xgrammar token bitmasks.

A bitmask is int32 [N, W] with W = ceil(V / 32): bit (t % 32) of word t // 32 is set when token t
is allowed. The functions work on any device; a token id past 32 * W is never allowed (the mask
was built for a smaller vocabulary, so such an id is padding the grammar knows nothing about).
"""

from __future__ import annotations

import torch

_XGRAMMAR_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for vocab_size tokens."""
    return (vocab_size + 31) // 32


def _check_bitmask(bitmask: torch.Tensor, name: str = "bitmask") -> None:
    if bitmask.ndim != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"{name}: expected [N, W] int32, got {list(bitmask.shape)} {bitmask.dtype}")


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [N, W] int32 -> allowed [N, vocab_size] bool (ids >= 32 * W are False)."""
    _check_bitmask(bitmask)
    n, w = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(n, w * 32)  # [N, 32 * W]
    if vocab_size <= w * 32:
        return bits[:, :vocab_size]
    padding = torch.zeros((n, vocab_size - w * 32), dtype=torch.bool, device=bitmask.device)
    return torch.cat([bits, padding], dim=1)


def bool_to_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """allowed [N, V] bool -> bitmask [N, ceil(V / 32)] int32 (bitmask_to_bool's inverse)."""
    if allowed.ndim != 2 or allowed.dtype != torch.bool:
        raise ValueError(f"allowed: expected [N, V] bool, got {list(allowed.shape)} {allowed.dtype}")
    n, vocab = allowed.shape
    width = bitmask_width(vocab)
    padded = torch.nn.functional.pad(allowed, (0, width * 32 - vocab)).view(n, width, 32)
    words = (padded.to(torch.int64) << torch.arange(32, device=allowed.device)).sum(dim=-1)  # unsigned
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits [N, V] with the ids bitmask [N, W] forbids set to -inf; returns logits.

    V may differ from 32 * W: the bitmask's first V bits apply, and ids >= 32 * W are forbidden.
    The bitmask moves to logits' device if needed.
    """
    _check_bitmask(bitmask)
    if logits.ndim != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits: expected [N, V] with N = {bitmask.shape[0]} (the bitmask's rows), "
                         f"got {list(logits.shape)}")
    bitmask = bitmask.to(logits.device)
    vocab, covered = logits.shape[1], bitmask.shape[1] * 32
    if logits.device.type == "cpu" and logits.dtype in _XGRAMMAR_CPU_DTYPES:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, covered))
        if vocab > covered:
            logits[:, covered:] = float("-inf")
    else:  # GPU (xgrammar's kernel there needs triton) and other dtypes: the same in torch
        logits.masked_fill_(~bitmask_to_bool(bitmask, vocab), float("-inf"))
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V], bitmask [N, W] int32 -> a copy of logits with forbidden ids at -inf."""
    return apply_bitmask_(logits.clone(), bitmask)


def translate_bitmask_to_draft_vocab(allowed: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Target-vocabulary allowed set -> the same set in EAGLE-3's reduced draft vocabulary.

    allowed: [N, V] bool, or a bitmask [N, W] int32; d2t: [Vd] int64 offsets, draft id i being
    target id i + d2t[i]. Returns [N, Vd] bool; a draft id whose target id lies outside the target
    vocabulary is not allowed. One gather, no loop over tokens.
    """
    if d2t.ndim != 1:
        raise ValueError(f"d2t: expected [Vd], got {list(d2t.shape)}")
    if allowed.ndim != 2:
        raise ValueError(f"allowed: expected [N, V] bool or [N, W] int32, got {list(allowed.shape)}")
    d2t = d2t.to(allowed.device, torch.int64)
    target_ids = torch.arange(d2t.shape[0], device=allowed.device) + d2t  # [Vd]
    if allowed.dtype == torch.bool:
        vocab = allowed.shape[1]
        in_vocab = (target_ids >= 0) & (target_ids < vocab)
        return allowed[:, target_ids.clamp(0, vocab - 1)] & in_vocab
    _check_bitmask(allowed, "allowed")
    covered = allowed.shape[1] * 32
    in_vocab = (target_ids >= 0) & (target_ids < covered)
    safe = target_ids.clamp(0, covered - 1)
    words = allowed[:, safe // 32]  # [N, Vd] int32: the word holding each draft id's target bit
    return ((words >> (safe % 32).to(torch.int32)) & 1).bool() & in_vocab
