"""Programmatic dependent launch (PDL) for the verify step's Triton kernels (Hopper and later).

Why: a small-batch verify step is a chain of ~300 short kernels, and between two dependent kernels
the GPU idles ~1.5 us while the second launches, even inside a CUDA graph: ~0.5 ms of a ~4.9 ms 8B
step. With PDL a kernel may start while its predecessor still runs: it may read weights (memory no
kernel writes) at once, and waits (griddepcontrol.wait) before it reads an activation or stores.
Each kernel signals (griddepcontrol.launch_dependents) when its successor may be scheduled:
single-wave kernels (norms, RoPE, attention) right after their wait, the skinny GEMM only after its
K loop, because a successor scheduled early parks its programs on the SMs and starves the GEMM's
later waves (released right after the wait everywhere, the H200 step took 5.69 ms against 4.90
without PDL).

The contract every kernel here keeps, so that PDL never changes a result: `gdc_wait` before its
first activation read and first store, in every program, unconditionally (a kernel that skipped it
could finish before its predecessor, and its successor would read unfinished data); before the
wait, weight reads only. PDL and non-PDL launches mix freely (torch's kernels and cuBLAS sit
between ours at the step's start and end).

The setting is process-wide and scoped like the GEMM backend (linear.py): a runner holds it around
its forward; a CUDA graph keeps what was active at capture. `SPECD_PDL=0` turns it off; on CPU, in
Triton's interpreter, before Hopper or where the installed Triton lacks it, the kernels run without.
"""

from __future__ import annotations

import logging
import os

import torch

from specd import settings
from specd.models.thread_setting import ThreadSetting

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install
    triton = None

_MODES = ("auto", "off")
_MODE = ThreadSetting("off")  # outside a runner's scope: plain launches (thread_setting.py)
_supported: dict[int, bool] = {}  # CUDA device index -> PDL launches work here


def resolve_pdl_mode(mode: str | None) -> str:
    """mode, or the environment's SPECD_PDL ("0" reads as "off"), or "auto"; validated."""
    mode = mode or settings.PDL.get()
    mode = {"0": "off", "1": "auto"}.get(mode, mode)
    if mode not in _MODES:
        raise ValueError(f"pdl: expected one of {', '.join(_MODES)} (or 0/1), got {mode!r}")
    return mode


class pdl_launches:
    """Context manager: the step's Triton kernels launch with PDL inside, where supported."""

    def __init__(self, mode: str | None) -> None:
        self.mode = resolve_pdl_mode(mode)

    def __enter__(self) -> None:
        self._saved = _MODE.swap(self.mode)

    def __exit__(self, *exc) -> None:
        _MODE.swap(self._saved)


def active_mode() -> str:
    """The PDL mode in force on this thread."""
    return _MODE.get()


def use_pdl(tensor: torch.Tensor) -> bool:
    """Whether a kernel over `tensor` launches with PDL now (the scope's mode, the device, Triton)."""
    if _MODE.get() != "auto" or not tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    if index not in _supported:
        _supported[index] = _probe(index)
    return _supported[index]


def launch_options(enabled: bool) -> dict:
    """Keyword arguments of a kernel launch: USE_PDL (the kernel's constexpr) and launch_pdl."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled else {"USE_PDL": False}


if triton is not None:
    @triton.jit
    def gdc_wait(USE_PDL: tl.constexpr):
        """Wait for the predecessor kernel (its writes visible)."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def gdc_release(USE_PDL: tl.constexpr):
        """Let the successor launch once every program of this kernel got here (or exited)."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def gdc_wait_and_release(USE_PDL: tl.constexpr):
        """Both at once: for single-wave kernels, whose successors may as well start right away."""
        gdc_wait(USE_PDL)
        gdc_release(USE_PDL)

    @triton.jit
    def _probe_kernel(x_ptr, USE_PDL: tl.constexpr):
        gdc_wait_and_release(USE_PDL)
        tl.store(x_ptr, tl.load(x_ptr) + 1)


def _probe(index: int) -> bool:
    """Compute capability >= 9 and a Triton that has PDL; then a chain of PDL launches, run
    directly and captured in a CUDA graph (as the step runs them), must count correctly."""
    if triton is None or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    if not hasattr(tl.extra, "cuda") or not hasattr(tl.extra.cuda, "gdc_wait"):
        logger.info("Triton %s has no griddepcontrol: kernels launch without PDL", triton.__version__)
        return False
    device = torch.device("cuda", index)
    try:
        with torch.cuda.device(device):
            x = torch.zeros(1, dtype=torch.int32, device=device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # eager (compiles), then captured
                for _ in range(3):
                    _probe_kernel[(1,)](x, **launch_options(True))
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(3):
                    _probe_kernel[(1,)](x, **launch_options(True))
            graph.replay()
            graph.replay()
            torch.cuda.synchronize(device)
            ok = int(x.item()) == 9
        if not ok:
            logger.warning("PDL probe counted %d, not 9: kernels launch without PDL", int(x.item()))
        return ok
    except Exception as e:  # an older launcher without launch_pdl, a driver or capture without it
        logger.info("PDL launches unavailable (%s): kernels launch without it", e)
        return False
