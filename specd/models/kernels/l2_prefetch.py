"""Pulling the next GEMM's weights into L2 from the current GEMM's epilogue (Hopper; experimental).

Why: at batch 1 the verify step is a chain of weight streams, and the short ones stream slowly:
qkv and o_proj (48 and 32 MB) reach 2.4-3.0 TB/s against 3.8-4.2 for gate_up and lm_head
(BENCHMARKS.md, issue 5), because a 13-17 us kernel spends microseconds ramping up and draining,
and the RoPE, attention and norm kernels between the GEMMs (~14 us a layer) leave HBM idle. The
H200's L2 holds 50 MB. So each skinny GEMM program, once past its own K loop (its loads done), may
issue L2 prefetches for a share of the *next* GEMM's weights: the programs that finish first keep
HBM busy through the grid's tail, and the data keeps arriving while RoPE and attention run. The
next GEMM then reads those bytes from L2. A prefetch is a hint: it moves no data into registers,
writes nothing and nobody waits for it, so it cannot change a result, only a time.

What is prefetched is a plan (`PrefetchPlan`): per product, how many MB of its weights its
predecessor GEMM pulls in ("qkv" is fetched by the previous layer's down_proj, "o" by qkv,
"gate_up" by o_proj, "down" by gate_up, "lm_head" by the last down_proj), and the instruction:
"sector" (prefetch.global.L2 per 32-byte sector), "line" (per 128-byte line) or "bulk"
(cp.async.bulk.prefetch.L2, 4 KB at a time). gate_up is read row-block by row-block in both of its
halves at once (gate rows and up rows, skinny_gemm's SwiGLU epilogue), so its plan fetches the
first rows of each half. The default is "off" until the H200 says which plan pays (SPECD_L2_PREFETCH
or a runner's `l2_prefetch`); on CPU and in Triton's interpreter nothing is prefetched (the
instructions do not exist there), which is the twin: outputs are the same by construction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from specd.models.kernels.pdl import use_pdl
from specd.models.thread_setting import ThreadSetting

try:
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install
    triton = None

L2_PREFETCH_ENV = "SPECD_L2_PREFETCH"
PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")
KINDS = {"sector": (1, 16), "line": (2, 64), "bulk": (3, 2048)}  # name -> (kernel code, elements of 2 bytes)


PREWAIT_ENV = "SPECD_GEMM_PREWAIT_BYTES"  # bytes of each weight row pulled into L2 before the PDL wait
PREWAIT_BYTES = 512  # H200, 8B step at batch 1 (BENCHMARKS.md runs 37-39): 512 gained 1-2.7%, 2048 and up lost


def prewait_lines(x: torch.Tensor) -> int:
    """128-byte lines of each weight row a program prefetches into L2 before its PDL wait (past the
    first tile it loads anyway), while the kernel before it (a norm, RoPE, the attention merge)
    leaves HBM idle: SPECD_GEMM_PREWAIT_BYTES (default PREWAIT_BYTES) rounded up to a power of two
    of lines; none without PDL (nothing to overlap), on CPU and in the interpreter. A hint: it cannot
    change a result (outputs bit-identical in every run)."""
    nbytes = int(os.environ.get(PREWAIT_ENV) or PREWAIT_BYTES)
    if (nbytes < 128 or os.environ.get("TRITON_INTERPRET") == "1" or not use_pdl(x)
            or torch.cuda.get_device_capability(x.device)[0] < 9):
        return 0
    return 1 << (nbytes // 128 - 1).bit_length()  # the next power of two (tl.arange's length)


@dataclass(frozen=True)
class PrefetchPlan:
    """MB of each product's weights that its predecessor GEMM prefetches into L2, and how."""

    megabytes: dict[str, float] = field(default_factory=dict)
    kind: str = "line"

    def __post_init__(self) -> None:
        unknown = set(self.megabytes) - set(PRODUCTS)
        if unknown:
            raise ValueError(f"l2 prefetch: unknown products {sorted(unknown)}; expected {', '.join(PRODUCTS)}")
        if any(v < 0 for v in self.megabytes.values()):
            raise ValueError("l2 prefetch: megabytes must be >= 0")
        if self.kind not in KINDS:
            raise ValueError(f"l2 prefetch: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def enabled(self) -> bool:
        return any(v > 0 for v in self.megabytes.values())

    @classmethod
    def parse(cls, spec: str) -> "PrefetchPlan":
        """"off" | "o=32,gate_up=8,kind=sector" (MB per product; kind optional, default line)."""
        spec = spec.strip()
        if spec in ("", "off", "0"):
            return cls()
        megabytes, kind = {}, "line"
        for part in spec.split(","):
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"l2 prefetch: expected name=value, got {part!r} in {spec!r}")
            name = name.strip()
            if name == "kind":
                kind = value.strip()
                continue
            try:
                megabytes[name] = float(value)
            except ValueError:
                raise ValueError(f"l2 prefetch: {name}: expected a number of MB, got {value!r}") from None
        return cls(megabytes, kind)

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        return ",".join([f"{k}={v:g}" for k, v in self.megabytes.items() if v > 0] + [f"kind={self.kind}"])


def resolve_plan(spec: str | PrefetchPlan | None) -> PrefetchPlan:
    """A plan, or one parsed from spec, or from SPECD_L2_PREFETCH, else off."""
    if isinstance(spec, PrefetchPlan):
        return spec
    return PrefetchPlan.parse(spec if spec is not None else os.environ.get(L2_PREFETCH_ENV, "off"))


_PLAN = ThreadSetting(PrefetchPlan())  # outside a runner's scope: no prefetch (thread_setting.py)


class l2_prefetch_scope:
    """Context manager: the fused forward prefetches by `plan` inside (a CUDA graph keeps the plan
    of its capture, like kernels/pdl.py's setting)."""

    def __init__(self, plan: PrefetchPlan) -> None:
        self.plan = plan

    def __enter__(self) -> None:
        self._saved = _PLAN.swap(self.plan)

    def __exit__(self, *exc) -> None:
        _PLAN.swap(self._saved)


def active_plan() -> PrefetchPlan:
    """The prefetch plan in force on this thread."""
    return _PLAN.get()


@dataclass(frozen=True)
class PrefetchTarget:
    """What one GEMM launch prefetches in its epilogue: the first `units` prefetch units of
    `weight` (of each of its `regions` equal row blocks, starting at row 0 of each)."""

    weight: torch.Tensor
    units: int  # per region
    regions: int
    kind_code: int
    unit_elems: int

    @property
    def region_stride(self) -> int:
        """Elements between the regions' starts (gate rows, then up rows)."""
        return self.weight.numel() // self.regions


def target_for(product: str, weight: torch.Tensor | None, plan: PrefetchPlan | None = None) -> PrefetchTarget | None:
    """The prefetch a GEMM issues for `product`'s weight under the plan (None: nothing)."""
    plan = plan or _PLAN.get()
    mb = plan.megabytes.get(product, 0.0)
    if weight is None or mb <= 0 or not weight.is_cuda or weight.element_size() != 2 or not weight.is_contiguous():
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.get_device_capability(weight.device)[0] < 9:
        return None  # the instructions exist from sm_90 (bulk) / the interpreter has none
    code, unit = KINDS[plan.kind]
    regions = 2 if product == "gate_up" else 1
    per_region = min(int(mb * 2 ** 20) // 2 // regions, weight.numel() // regions)
    units = per_region // unit
    if units <= 0:
        return None
    return PrefetchTarget(weight, units, regions, code, unit)


if triton is not None:
    @triton.jit
    def _prefetch_l2(ptrs, KIND: tl.constexpr):
        """One L2 prefetch per address in ptrs (a hint: nothing comes back, nothing waits)."""
        if KIND == 3:
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;", "=r,l",
                                      [ptrs], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_share(pf_ptr, pf_units, pf_regions, pf_region_stride, program, num_programs,
                       KIND: tl.constexpr, UNIT: tl.constexpr):
        """Program `program` of `num_programs` prefetches its share of the target: units
        [0, pf_units) of each of pf_regions regions (pf_region_stride elements apart), UNIT elements
        each, 128 at a time; the clamped tail may name a unit twice (harmless for a hint)."""
        total = pf_units * pf_regions
        per = tl.cdiv(total, num_programs)
        lo = program * per
        hi = tl.minimum(lo + per, total)
        for i in range(lo, hi, 128):
            u = tl.minimum(i + tl.arange(0, 128), hi - 1)  # [128] unit ids
            region = u // pf_units
            offsets = region.to(tl.int64) * pf_region_stride + (u - region * pf_units).to(tl.int64) * UNIT
            _prefetch_l2(pf_ptr + offsets, KIND)
