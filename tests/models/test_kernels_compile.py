"""Every Triton kernel of specd compiles for the H200 (sm_90) here, without a GPU.

Triton's interpreter (the other kernel tests) runs a kernel's Python semantics but not its
compiler, which rejects things the interpreter accepts (a variable of two types across an if).
triton.compile with an explicit sm_90 target runs the real front end and the PTX back end on CPU.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="triton (xgrammar pulls it)")


def test_kernels_compile_to_sm90_ptx():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompileTimeAssertionFailure

    from specd.models import skinny_gemm
    from specd.models.kernels import norm_act, paged_decode_attention as pda, rope_cache

    tgt = GPUTarget("cuda", 90, 32)

    def comp(fn, sig, consts, release_after_loads=False):
        """Compile with and without PDL (kernels/pdl.py): the wait and the release are there only
        with it, and come before any store; a multi-wave kernel (the GEMM) releases its successor
        only after its last global load."""
        sig = dict(sig, USE_PDL="constexpr")
        for use_pdl in (False, True):
            ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(consts, USE_PDL=use_pdl)),
                                 target=tgt).asm["ptx"]
            assert ".target sm_90" in ptx
            assert ("griddepcontrol.wait" in ptx) == use_pdl
            assert ("griddepcontrol.launch_dependents" in ptx) == use_pdl
            if use_pdl:
                assert ptx.index("griddepcontrol.wait") < ptx.index("st.global"), fn
                if release_after_loads:
                    last_load = max(ptx.rfind("ld.global"), ptx.rfind("cp.async"))
                    assert last_load > 0 and ptx.index("griddepcontrol.launch_dependents") > last_load, fn

    P = "*bf16"
    comp(rope_cache._rope_cache_kernel, {"qkv_ptr":P,"cos_ptr":P,"sin_ptr":P,"slots_ptr":"*i64","q_out_ptr":P,"k_cache_ptr":P,"v_cache_ptr":P,
      "stride_qkv":"i32","stride_cos":"i32","stride_qo_t":"i32","stride_qo_h":"i32","stride_slot":"i32","stride_cache_h":"i32",
      "NUM_HEADS":"constexpr","NUM_KV_HEADS":"constexpr","HALF":"constexpr"}, {"NUM_HEADS":32,"NUM_KV_HEADS":8,"HALF":64})
    norm_sig = {"x_ptr":P,"delta_ptr":P,"w_ptr":P,"res_out_ptr":P,"out_ptr":P,"stride_x":"i32","stride_ds":"i32","stride_d":"i32","stride_r":"i32","stride_o":"i32","eps":"fp32","H":"constexpr","BLOCK":"constexpr","DELTA_SPLITS":"constexpr"}
    for delta_ptr, splits in [(P, 0), (P, 1), ("*fp32", 2)]:  # no delta, a bf16 delta, split-K partials
        comp(norm_act._rmsnorm_kernel, dict(norm_sig, delta_ptr=delta_ptr), {"H":4096,"BLOCK":4096,"DELTA_SPLITS":splits})
    comp(norm_act._silu_mul_kernel, {"gu_ptr":P,"out_ptr":P,"stride_gu":"i32","stride_o":"i32","inter":"i32","BLOCK":"constexpr"},{"BLOCK":1024})
    attn_sig = {"q_ptr":P,"k_ptr":P,"v_ptr":P,"tables_ptr":"*i64","ctx_ptr":"*i64","acc_ptr":"*fp32","ml_ptr":"*fp32",
      "cos_ptr":P,"sin_ptr":P,"slots_ptr":"*i64",
      "stride_qt":"i32","stride_qh":"i32","stride_kb":"i32","stride_ks":"i32","stride_kh":"i32","stride_tb":"i32",
      "stride_cos":"i32","scale":"fp32","window":"i32","tiles_per_split":"i32",
      "QLEN":"constexpr","GROUP":"constexpr","ROWS":"constexpr","D":"constexpr","BLOCK_SIZE":"constexpr","BLOCK_N":"constexpr","HAS_WINDOW":"constexpr",
      "ROPE":"constexpr"}
    attn_consts = {"QLEN":4,"GROUP":4,"ROWS":16,"D":128,"BLOCK_SIZE":64,"BLOCK_N":64,"HAS_WINDOW":True,"ROPE":False}
    for rope in (False, True):  # q rotated already (the draft heads); the rope fold (the verify step)
        consts = dict(attn_consts, ROPE=rope)
        comp(pda._partials_kernel, attn_sig, consts)
        # the host-copied ctx and block table (and the rope tables, slots) are read before the wait
        # (pdl.py); the cache writes after it
        ptx = triton.compile(ASTSource(fn=pda._partials_kernel, signature=dict(attn_sig, USE_PDL="constexpr"),
                                       constexprs=dict(consts, USE_PDL=True)), target=tgt).asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        assert ptx.index("ld.global") < wait
        if rope:  # the k/v writes, then the barrier before the key loop's reads
            assert wait < ptx.index("st.global") < ptx.index("bar.sync", ptx.index("st.global"))
    comp(pda._combine_kernel, {"acc_ptr":"*fp32","ml_ptr":"*fp32","out_ptr":P,"stride_ot":"i32","stride_oh":"i32",
      "QLEN":"constexpr","GROUP":"constexpr","ROWS":"constexpr","D":"constexpr","SPLITS":"constexpr"},{"QLEN":4,"GROUP":4,"ROWS":16,"D":128,"SPLITS":17})
    gemm_sig = {"x_ptr":P,"w_ptr":P,"y_ptr":P,"M":"i32","N":"i32","K":"i32","stride_xm":"i32","stride_wn":"i32","stride_ys":"i32","stride_ym":"i32",
                "M_BUCKET":"constexpr","BLOCK_N":"constexpr","BLOCK_K":"constexpr","SWIGLU":"constexpr","SPLIT_K":"constexpr",
                "PREWAIT_LINES":"constexpr"}
    # plain, SwiGLU, split-K partials
    for y_ptr, swiglu, split_k in [(P, False, 1), (P, True, 1), ("*fp32", False, 2)]:
        comp(skinny_gemm._skinny_gemm_kernel.fn, dict(gemm_sig, y_ptr=y_ptr), {"M_BUCKET":16,"BLOCK_N":32,"BLOCK_K":128,"SWIGLU":swiglu,"SPLIT_K":split_k,
             "PREWAIT_LINES":0}, release_after_loads=True)
    with pytest.raises(CompileTimeAssertionFailure):  # SwiGLU's epilogue needs the whole sum
        comp(skinny_gemm._skinny_gemm_kernel.fn, dict(gemm_sig, y_ptr="*fp32"), {"M_BUCKET":16,"BLOCK_N":32,"BLOCK_K":128,"SWIGLU":True,"SPLIT_K":2,
             "PREWAIT_LINES":0})


def test_gemm_prewait_prefetch_comes_before_the_pdl_wait():
    """The program's own next weight lines, prefetched into L2 before the PDL wait (skinny_gemm's
    PREWAIT_LINES; 8 lines of 64 gate rows and 64 up rows over 128 threads: 8 instructions a
    thread), and none with PREWAIT_LINES 0."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specd.models import skinny_gemm

    P = "*bf16"
    sig = {"x_ptr":P,"w_ptr":P,"y_ptr":P,"M":"i32","N":"i32","K":"i32","stride_xm":"i32","stride_wn":"i32","stride_ys":"i32",
           "stride_ym":"i32","M_BUCKET":"constexpr","BLOCK_N":"constexpr","BLOCK_K":"constexpr","SWIGLU":"constexpr",
           "SPLIT_K":"constexpr","USE_PDL":"constexpr","PREWAIT_LINES":"constexpr"}
    for lines in (0, 8):
        consts = {"M_BUCKET":16,"BLOCK_N":64,"BLOCK_K":128,"SWIGLU":True,"SPLIT_K":1,"USE_PDL":True,"PREWAIT_LINES":lines}
        ptx = triton.compile(ASTSource(fn=skinny_gemm._skinny_gemm_kernel.fn, signature=sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert ptx.count("prefetch.global.L2") == lines
        if lines:
            assert ptx.rindex("prefetch.global.L2") < ptx.index("griddepcontrol.wait")
