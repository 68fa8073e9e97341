"""The target model's linear layers, and which GEMM they run: the skinny Triton kernel or F.linear.

`Linear` is nn.Linear (same parameters, same checkpoint names) whose forward goes through
`linear()`; `MergedLinear` (merged_linear.py) derives from it. The backend is a process-wide
setting that a runner holds around its forward (`gemm_backend`), not a module attribute, because
runners share modules: the step bench times a cuBLAS runner and a kernel runner over the very same
weights. Outside any runner the backend is "torch" (plain F.linear), so drafters and training
code that call these modules directly are unaffected.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from specd import settings
from specd.models import skinny_gemm
from specd.models.skinny_gemm import skinny_linear
from specd.models.thread_setting import ThreadSetting

# "auto": the kernel where it applies (skinny_gemm.kernel_applies), else F.linear; "torch": always
# F.linear. A CUDA graph keeps whatever was chosen when it was captured.
GEMM_BACKENDS = ("auto", "torch")
_BACKEND = ThreadSetting("torch")  # outside a runner's scope: F.linear (thread_setting.py)


def active_backend() -> str:
    """The GEMM backend in force on this thread."""
    return _BACKEND.get()


def resolve_gemm_backend(name: str | None) -> str:
    """name, or the environment's SPECD_GEMM, or "auto"; validated."""
    name = name or settings.GEMM.get()
    if name not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend: expected one of {', '.join(GEMM_BACKENDS)}, got {name!r}")
    return name


class gemm_backend:
    """Context manager: the model's linears use `name` inside (see resolve_gemm_backend)."""

    def __init__(self, name: str) -> None:
        self.name = resolve_gemm_backend(name)

    def __enter__(self) -> None:
        self._saved = _BACKEND.swap(self.name)

    def __exit__(self, *exc) -> None:
        _BACKEND.swap(self._saved)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The model's linear: skinny_linear under the "auto" backend, F.linear under "torch"."""
    if _BACKEND.get() == "auto":
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def takes_skinny_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(x, weight) would run the skinny kernel now (backend and operands)."""
    return _BACKEND.get() == "auto" and skinny_gemm.kernel_applies(x.reshape(-1, x.shape[-1]), weight)


class Linear(nn.Linear):
    """nn.Linear through linear(): the runner's GEMM backend decides the kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
