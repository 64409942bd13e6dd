"""Compile fusedattn's kernels for sm_90 on a machine with no GPU (Triton ships ptxas).

Catches compile errors before spending device time (the interpreter accepts code that sm_90
rejects, e.g. a non-constexpr `if`) and prints each variant's shared memory:
    python tools/aot_check.py [fwd|bwd|all|features]
``ptxas_report(kernel)`` gives registers and spills. The variants compile without the 16-byte
divisibility hints the JIT adds at launch, so pipelining (and shared memory) can differ from
the real kernels': use it for errors and register pressure, not for shared-memory budgets.
"""
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedattn.backends.triton import bwd, fwd

TARGET = GPUTarget("cuda", 90, 32)
FLOATS = {"qk_scale", "softcap", "dropout_rescale", "sm_scale"}
INT64 = {"dropout_seed", "dropout_offset"}


def compile_kernel(kernel, ptrs, constexprs, num_warps, num_stages, jit_like=False, **options):
    """Compile ``kernel`` for sm_90; returns Triton's compiled kernel (asm["cubin"], metadata).

    jit_like: specialize as the JIT does at a real launch (unit strides of the last dim are
    constexpr 1, pointers and other strides divisible by 16), so loads vectorize as on the GPU.
    options: more of Triton's compile options (e.g. maxnreg).
    """
    constexprs = dict(constexprs)
    if jit_like:
        constexprs.update({n: 1 for n in kernel.arg_names if n.startswith("stride_") and n.endswith("d")})
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = ptrs.get(name) or ("fp32" if name in FLOATS else "i64" if name in INT64 else "i32")
        if jit_like and (name in ptrs or name.startswith("stride_") or name in ("D", "D_V", "S_Q", "S_KV")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs or None)
    return triton.compile(src, target=TARGET, options=dict(options, num_warps=num_warps, num_stages=num_stages))


def compile_variant(kernel, ptrs, constexprs, num_warps, num_stages):
    return f"smem={compile_kernel(kernel, ptrs, constexprs, num_warps, num_stages).metadata.shared}"


BASE_SWITCHES = dict(BOTTOM_RIGHT=False, HAS_LEFT=False, HAS_RIGHT=True, HAS_SEQ_Q=False, HAS_SEQ_KV=False,
                     BIAS_KIND=0, HAS_ALIBI=False, SOFTCAP=False, DROPOUT=False, DOT_PRECISION="tf32")


def fwd_spec(d, bm, bn, dtype="bf16", **sw):
    """(pointer types, constexprs) of one forward variant; ``sw`` overrides switches."""
    ptr = f"*{dtype}"
    ptrs = dict(Q=ptr, K=ptr, V=ptr, O=ptr, LSE="*fp32", SEQ_Q="*i32", SEQ_KV="*i32", BIAS=ptr, SLOPES="*fp32",
                TABLE_K="*i32", TABLE_V="*i32", CU_Q="*i32", CU_KV="*i32", SINK="*fp32")
    bd = max(16, triton.next_power_of_2(d))     # args.block_dim: tl.dot needs 16 at least
    c = dict(BASE_SWITCHES, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BLOCK_DV=bd, EVEN_D=bd == d, EVEN_DV=bd == d,
             WRITE_LSE=True, REVERSE_M=True, USE_TMA=False, WARP_SPECIALIZE=False, PAGED=False, PAGE_SIZE=1,
             VARLEN=False)
    # the 16-bit launch leaves the FP8 parameters at their defaults (None pointers: constexpr)
    c.update({name: None for name in FP8_PTRS}, FP8=False, FP8_INTERP=False)
    c.update(sw)
    return ptrs, c


FP8_PTRS = ("DESCALE_Q", "DESCALE_K", "DESCALE_V", "DESCALE_S", "SCALE_S", "SCALE_O", "AMAX_S", "AMAX_O")


def fwd_fp8_spec(d, bm, bn, dtype="fp8e4nv", out="bf16", **sw):
    """(pointer types, constexprs) of an FP8 forward variant (``fwd.launch_fwd_fp8``): float8 q/k/v, six
    scale pointers and two amax pointers, fp32; ``out`` the output type; head-dim tiles of 32 at least."""
    ptrs, c = fwd_spec(d, bm, bn, dtype, **sw)
    bd = max(32, triton.next_power_of_2(d))
    ptrs.update(O=f"*{out}", **{name: "*fp32" for name in FP8_PTRS})
    for name in FP8_PTRS:
        c.pop(name)
    c.update(BLOCK_D=bd, BLOCK_DV=bd, EVEN_D=bd == d, EVEN_DV=bd == d, FP8=True, FP8_INTERP=False)
    c.update(sw)
    return ptrs, c


def fwd_fp8_variant(d, bm, bn, warps, stages, dtype="fp8e4nv", out="bf16", **sw):
    """Compile an FP8 forward variant; returns 'smem=... regs=[...] spill_stores=[...]'."""
    k = compile_kernel(fwd._attn_fwd, *fwd_fp8_spec(d, bm, bn, dtype, out, **sw), warps, stages)
    return f"smem={k.metadata.shared} {ptxas_report(k)}"


def fwd_variant(d, bm, bn, warps, stages, dtype="bf16", **sw):
    return compile_variant(fwd._attn_fwd, *fwd_spec(d, bm, bn, dtype, **sw), warps, stages)


def bwd_variants(d, tk, tq, dtype="bf16", **sw):
    ptr = f"*{dtype}"
    bd = max(16, triton.next_power_of_2(d))     # args.block_dim: tl.dot needs 16 at least
    c = dict(BASE_SWITCHES, BLOCK_D=bd, BLOCK_DV=bd, EVEN_D=bd == d, EVEN_DV=bd == d)
    # the 16-bit launch leaves the FP8 parameters at their defaults (None pointers: constexpr)
    c.update(FP8_SCALES=None, AMAX=None, FP8=False, FP8_INTERP=False, FP8_MMA16=False)
    c.update(sw)
    ptrs = dict(Q=ptr, K=ptr, V=ptr, O=ptr, DO=ptr, LSE="*fp32", DELTA="*fp32", DK=ptr, DV=ptr, DBIAS="*fp32", DQ=ptr,
                SEQ_Q="*i32", SEQ_KV="*i32", BIAS=ptr, SLOPES="*fp32", CU_Q="*i32", CU_KV="*i32")
    a = compile_variant(bwd._attn_bwd_dkdv, ptrs, dict(c, BLOCK_M=tk[0], BLOCK_N=tk[1], WRITE_DBIAS=False, VARLEN=c.get("VARLEN", False)), tk[2], tk[3])
    b = compile_variant(bwd._attn_bwd_dq, ptrs, dict(c, BLOCK_M=tq[0], BLOCK_N=tq[1], REVERSE_M=True, WRITE_DELTA=True, VARLEN=c.get("VARLEN", False)), tq[2], tq[3])
    return a, b


def bwd_fp8_variants(d, tk, tq, dtype="fp8e4nv", do="fp8e5", o="fp8e4nv", grad="bf16", **sw):
    """Compile the FP8 backward's two passes (``bwd.launch_bwd_fp8``): float8 q/k/v (``dtype``), dO (``do``)
    and o (``o``), gradients ``grad``, the scale and amax buffers; head-dim tiles of 32 at least. tk / tq:
    (block_m, block_n, warps, stages) of the dK/dV and dQ passes. Returns (dK/dV report, dQ report), each
    'smem=... regs=[...] spill_stores=[...]'."""
    bd = max(32, triton.next_power_of_2(d))
    c = dict(BASE_SWITCHES, BLOCK_D=bd, BLOCK_DV=bd, EVEN_D=bd == d, EVEN_DV=bd == d, VARLEN=False, FP8=True,
             FP8_INTERP=False, FP8_MMA16=False)
    c.update(sw)
    ptr = f"*{dtype}"
    ptrs = dict(Q=ptr, K=ptr, V=ptr, O=f"*{o}", DO=f"*{do}", LSE="*fp32", DELTA="*fp32", DK=f"*{grad}",
                DV=f"*{grad}", DBIAS="*fp32", DQ=f"*{grad}", SEQ_Q="*i32", SEQ_KV="*i32", BIAS=ptr, SLOPES="*fp32",
                CU_Q="*i32", CU_KV="*i32", FP8_SCALES="*fp32", AMAX="*fp32")
    out = []
    for kern, t, extra in ((bwd._attn_bwd_dkdv, tk, dict(WRITE_DBIAS=False)),
                           (bwd._attn_bwd_dq, tq, dict(REVERSE_M=True, WRITE_DELTA=True))):
        k = compile_kernel(kern, ptrs, dict(c, BLOCK_M=t[0], BLOCK_N=t[1], **extra), t[2], t[3], jit_like=True)
        out.append(f"smem={k.metadata.shared} {ptxas_report(k)}")
    return tuple(out)


def delta_variant(d_v, dtype="bf16", **sw):
    """The delta pre-process kernel (``bwd._attn_bwd_preprocess``, the launch of ``bwd.launch_delta``)."""
    c = dict(BLOCK_M=64, BLOCK_DV=max(16, triton.next_power_of_2(d_v)), VARLEN=False, HAS_SINK=False)
    c.update(sw)
    ptrs = dict(O=f"*{dtype}", DO=f"*{dtype}", DELTA="*fp32", CU_Q="*i32", LSE="*fp32", SINK="*fp32", DSINK="*fp32")
    return compile_variant(bwd._attn_bwd_preprocess, ptrs, c, 4, 1)


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which == "features":
        return main_features()
    if which in ("fwd", "all"):
        for d, t in ((64, (128, 128, 8, 3)), (128, (128, 64, 8, 3)), (224, (128, 64, 8, 2)), (40, (64, 64, 4, 2))):
            print("fwd", d, t, fwd_variant(d, *t))
        print("fwd all switches", fwd_variant(96, 64, 64, 4, 2, BOTTOM_RIGHT=True, HAS_LEFT=True, HAS_SEQ_Q=True,
                                              HAS_SEQ_KV=True, BIAS_KIND=1, HAS_ALIBI=True, SOFTCAP=True, DROPOUT=True))
        print("fwd fp32", fwd_variant(64, 64, 64, 4, 2, dtype="fp32", DOT_PRECISION="ieee", BIAS_KIND=2))
    if which in ("bwd", "all"):
        for d, tk, tq in ((64, (64, 128, 8, 2), (128, 64, 8, 2)), (128, (64, 128, 8, 2), (128, 64, 8, 2)),
                          (224, (32, 64, 8, 1), (64, 32, 8, 1))):
            print("bwd", d, bwd_variants(d, tk, tq))
        print("bwd all switches", bwd_variants(96, (32, 64, 4, 1), (64, 32, 4, 1), BOTTOM_RIGHT=True, HAS_LEFT=True,
                                               HAS_SEQ_Q=True, HAS_SEQ_KV=True, BIAS_KIND=1, HAS_ALIBI=True,
                                               SOFTCAP=True, DROPOUT=True))
        from fusedattn.plan import _BWD_FP8_SM90
        for d, (tk, tq) in _BWD_FP8_SM90.items():      # the FP8 backward's tiles (plan.fp8_bwd_tiles)
            tk, tq = (tk.block_m, tk.block_n, tk.num_warps, tk.num_stages), (tq.block_m, tq.block_n, tq.num_warps,
                                                                              tq.num_stages)
            print("bwd fp8", d, tk, tq, bwd_fp8_variants(d, tk, tq))
        print("bwd fp8 masks, e5m2 gradients", bwd_fp8_variants(
            96, (64, 32, 8, 1), (128, 32, 8, 2), dtype="fp8e5", do="fp8e5", o="bf16", grad="fp8e5", BOTTOM_RIGHT=True,
            HAS_LEFT=True, HAS_SEQ_Q=True, HAS_SEQ_KV=True))


def ptxas_report(kernel_obj):
    """Registers and spills from ptxas -v on the compiled PTX (no GPU needed)."""
    import os
    import re
    import subprocess
    import tempfile
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel_obj.asm["ptx"])
    r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    text = r.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    return f"regs={regs} spill_stores={spill}"


def main_features():
    """Every switch on at once, paged and varlen: the variants the interpreter accepts but sm_90 might not."""
    for page in (16, 64):
        print("fwd paged", page, fwd_variant(128, 128, 64, 8, 3, PAGED=True, PAGE_SIZE=page, HAS_SEQ_KV=True,
                                             BOTTOM_RIGHT=True))
    print("fwd varlen", fwd_variant(64, 128, 64, 8, 3, VARLEN=True, DROPOUT=True, HAS_ALIBI=True))
    print("bwd varlen", bwd_variants(64, (64, 64, 4, 2), (64, 64, 4, 2), VARLEN=True, DROPOUT=True))


if __name__ == "__main__":
    main()
