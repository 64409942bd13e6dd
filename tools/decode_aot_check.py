"""Compile the split-KV decode kernel (backends/triton/decode.py) for sm_90 without a GPU: a 16-bit cache and
FP8 caches (KV_FP8: e4m3 / e5m2 bytes widened to q's type; V_PAIRS: V read as int16 pairs), contiguous and paged,
at the H100 decode tile (16 x 128, 4 warps, 2 stages). Prints shared memory, registers / spills (ptxas) and the
TTGIR's async copies (pipelined K / V loads).

    python tools/decode_aot_check.py [--loops] [DTYPE/KV/PAIRS ...]   # --loops: each loop's SASS instruction
                                                                       # count and top opcodes; e.g. bf16/fp8e4nv/1

Session 35 (Triton 3.6, --loops, the unmasked step, bf16 q, e4m3): V as bytes 961 (contiguous) / 1204 (paged)
instructions, 255 / 208 registers; V as int16 pairs 617 / 805, 184 / 168 (bench/NOTES.md 74).

Session 36 (Triton 3.6, --loops, the unmasked step): a paged cache's table read in the same iteration as its K / V
rows left K / V one shared-memory buffer (FP8 64-key tile, 3 stages: 23 KB against 39 KB contiguous); read a tile
ahead, paged builds have the contiguous ones' buffers. int32 rows (ROWS32) and one table read (ONE_TABLE): FP8 64
keys paged 549 -> 462 instructions, contiguous 390 -> 375; bf16 128 keys paged 938 -> 426, contiguous 558 -> 432
(bench/NOTES.md 76).

Session 18 (Triton 3.6): bf16 cache 208-220 regs, 72 KB; e4m3 cache 168-255 regs (contiguous bf16 q: 16
bytes of spill), 40 KB; 12 async copies in every variant.

Session 28 (Triton 3.6, --loops, the unmasked step): bf16 cache 553 instructions; e4m3 cache with bf16 queries
1344 (256 F2F + 128 PRMT: e4m3 -> f16 -> f32 -> bf16), with fp16 queries 953 (bench/NOTES.md 67;
bench/pending/fp8-decode-fp16-operands.patch: bf16 queries 968).
"""
import sys
sys.path.insert(0, "tools")
import triton
from triton.compiler import ASTSource
import aot_check as a
from fusedattn.backends.triton import decode

def compile_decode(dtype, kv, fp8, paged, bn=128, bm=16, w=4, st=2, d=128, pairs=0, split=True, one_table=None, rows32=None):
    """The decode kernel compiled for sm_90 (no GPU): q / out of ``dtype``, the cache of ``kv`` (a Triton type
    name; V as ``*i16`` where ``pairs``: decode.V_PAIRS), a 16 x ``bn`` tile with ``w`` warps and ``st`` stages; ``one_table``: K and V paged
    by one table (decode ONE_TABLE; default: where paged, as ``attention_with_kvcache`` calls it); ``rows32``:
    int32 row offsets (decode ROWS32; default on, as for any cache under 2^31 elements)."""
    k = decode._decode_fwd
    ptrs = dict(Q=f"*{dtype}", K=f"*{kv}", V="*i16" if pairs else f"*{kv}", PT="*i32", PT_V="*i32", SEQ_Q="*i32",
                SEQ_KV="*i32", SLOPES="*fp32", O=f"*{dtype}", LSE="*fp32", O_PART="*fp32", LSE_PART="*fp32",
                SINK="*fp32", DESCALE_K="*fp32", DESCALE_V="*fp32")
    c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, BLOCK_DV=d, EVEN_D=True, EVEN_DV=True, PAGED=paged, PAGE_SIZE=16 if paged else 1,
             HAS_SEQ_Q=False, HAS_SEQ_KV=True, BOTTOM_RIGHT=True, HAS_LEFT=False, HAS_RIGHT=True, HAS_ALIBI=False,
             SOFTCAP=False, SPLIT=split, WRITE_LSE=True, DOT_PRECISION="tf32", HAS_SINK=False, KV_FP8=fp8,
             V_PAIRS=pairs, ONE_TABLE=paged if one_table is None else one_table,
             ROWS32=True if rows32 is None else rows32)
    for n in k.arg_names:
        if n.startswith("stride_") and n.endswith("d"):
            c[n] = 1
    sig, attrs = {}, {}
    for i, n in enumerate(k.arg_names):
        if n in c:
            sig[n] = "constexpr"; continue
        sig[n] = ptrs.get(n) or ("fp32" if n in ("qk_scale", "softcap") else "i32")
        if n in ptrs or n.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=k, signature=sig, constexprs=c, attrs=attrs), target=a.TARGET,
                          options=dict(num_warps=w, num_stages=st))


def variant(dtype, kv, fp8, paged, loops=False, pairs=0, **tile):
    kk = compile_decode(dtype, kv, fp8, paged, pairs=pairs, **tile)
    t = kk.asm["ttgir"]
    line = f"smem={kk.metadata.shared} {a.ptxas_report(kk)} async_copies={t.count('async_copy_global_to_local')}"
    if loops:
        from sass_loops import loop_stats, sass
        line += "".join(f"\n    loop {label}: {n} instructions, {top[:8]}" for label, n, top in loop_stats(sass(kk))
                        if n > 1)
    return line


CASES = (("bf16", "bf16", False, 0), ("bf16", "fp8e4nv", True, 0), ("bf16", "fp8e4nv", True, 1),
         ("fp16", "fp8e4nv", True, 0), ("fp16", "fp8e4nv", True, 1), ("bf16", "fp8e5", True, 0), ("bf16", "fp8e5", True, 2))
if __name__ == "__main__":
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    for dtype, kv, fp8, pairs in CASES:
        if only and f"{dtype}/{kv}/{pairs}" not in only:
            continue
        for paged in (False, True):
            print(dtype, kv, f"pairs={pairs}", "paged" if paged else "contig",
                  variant(dtype, kv, fp8, paged, loops="--loops" in sys.argv, pairs=pairs))
