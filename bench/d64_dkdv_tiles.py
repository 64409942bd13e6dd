"""Lab survey and timing (issue 28, bench/BWD_PROFILE.md 7.4 #6a): can the d=64 dK/dV pass run three CTAs per SM?

The d=64 backward is the portable Triton pair of passes on Hopper (plan._BWD_SM90[(64, 2)]: dK/dV 64x64,
4 warps, 3 stages). ncu (BWD_PROFILE 7.1) read its dK/dV kernel at 214 registers (239 causal), two CTAs per SM
by registers, 60% of the d=64 backward's time, tensor pipe 45% / 37% active, stalls spread over barrier / long
scoreboard / wait (occupancy x latency). Shared memory allows three CTAs; registers allow three at <= 168 per
thread (3 x 128 x 168 = 64.5K of 64K... 65536 / (3 x 128) = 170, rounded down to ptxas's granule of 8: 168).

``--sass`` (no GPU) compiles the dK/dV pass for sm_90a (tools/aot_check.compile_kernel, JIT-like strides, bf16, d=64, no mask
and causal) at each tile with no register cap and with ``maxnreg`` 168 / 160 (Triton's CUDA option, a ``.maxnreg``
directive in the PTX), and prints registers, spill-store bytes (ptxas -v) and shared memory per tile:

    PYTHONPATH=$PWD python3 bench/d64_dkdv_tiles.py --sass [--tiles 64x64x4x3,64x64x4x2,...]
    PYTHONPATH=$PWD python3 bench/d64_dkdv_tiles.py [--rep MS]          # H100: time CANDIDATES

The compile specializes as the JIT does for the anchor (unit strides and GROUP = 1 constant; without that the
same kernel reads 255 registers and 728 bytes of spill): its 214 / 239 registers match ncu's. Measured (Triton
3.6.0, session 22), registers / spill-store bytes (CTAs per SM by registers):

    tile (m x n x warps x stages)  mask    smem    no cap            cap 168           cap 160
    64x64x4x3 (the default)        none    65.0K   214 /   0 B (2)   168 /  40 B (3)   160 / 136 B (3)
                                   causal          239 /   0 B (2)   168 / 228 B (3)   160 / 208 B (3)
    64x64x4x2                      none    49.0K   213 /   0 B (2)   168 /  12 B (3)   160 /  84 B (3)
                                   causal          236 /   0 B (2)   168 /  44 B (3)   160 /  88 B (3)
    64x64x4x1                      none    32.0K   212 /   0 B (2)   168 /  60 B (3)   160 / 140 B (3)
                                   causal          255 /   0 B (2)   168 / 548 B (3)   160 / 716 B (3)
    32x64x4x2                      none    32.2K   157 /   0 B (3)   (no spill under either cap)
                                   causal          164 /   0 B (3)
    32x64x4x3                      none    41.0K   161 /   0 B (3)
                                   causal          160 /   0 B (3)
    64x32x4x2                      none    28.5K   133 /   0 B (3+)
                                   causal          168 /   0 B (3)
    32x32x4x2                      none    18.2K   100 /   0 B (5)
                                   causal          132 /   0 B (3)
    64x64x8x3                      none    65.0K   169 /   0 B (1 CTA of 8 warps: the same 8 warps per SM)
                                   causal          213 /   0 B (1)

So three CTAs per SM come either from a cap on today's tile (64x64/4/2 under 168: 12 / 44 bytes of spill) or
from a smaller tile that needs no cap (32x64, 64x32: twice the CTAs, each loading its K/V and looping over all
of Q). GPU mode (default) times these candidates on the two d=64 anchors (b8 h12 s1024 fp16, no mask and
causal) with ``plan._BWD_SM90[(64, 2)]`` swapped in-process and the cap passed at launch (a wrapper around
``bwd._DKDV`` adds ``maxnreg``; the shipped store is off, ``FUSEDATTN_PREBUILT=0``), CUDA-graph replays (the
d=64 causal backward is host-bound eagerly, BWD_PROFILE 7.3) and eager calls, and checks dQ / dK / dV against
the default's. Prediction from the profile: dK/dV is 60% of the d=64 backward and latency-bound at two CTAs,
so a third CTA per SM gives 0 to +9% overall, less where spills appear; the smaller tiles re-read Q / dO twice
as often (L2, not DRAM, at this size).

Measured (H100 80GB HBM3, torch 2.11, Triton 3.6.0, session 23), CUDA graphs, TFLOP/s of the whole d=64 backward
(/ the default):

    candidate            no mask          causal
    64x64x4x3 (default)  284.9 (1.000)    207.2 (1.000)
    64x64x4x3 cap 168    289.0 (1.014)    200.5 (0.968)
    64x64x4x2 cap 168    292.0 (1.025)    202.6 (0.978)
    32x64x4x2            266.7 (0.936)    204.5 (0.987)
    32x64x4x3            281.6 (0.988)    208.9 (1.008)
    64x32x4x2            185.9 (0.652)    148.7 (0.718)

-2.2% to +2.5% against the predicted 0 to +9%: a third CTA per SM buys nothing measurable, so occupancy is not
what holds the d=64 dK/dV pass back (its stalls are spread, BWD_PROFILE 7.1); the default stays. The d=64
gain came from the single-pass kernel instead (bench/d64_fused.py).
"""
import argparse
import os
import sys

os.environ.setdefault("FUSEDATTN_PREBUILT", "0")     # GPU mode: the JIT, so that the cap reaches the compile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import triton  # noqa: E402

import aot_check  # noqa: E402  (tools/aot_check.py)
from fusedattn.backends.triton import bwd  # noqa: E402

TILES = ["64x64x4x3", "64x64x4x2", "64x64x4x1", "32x64x4x2", "32x64x4x3", "64x32x4x2", "32x32x4x2", "64x64x8x3"]
CAPS = [None, 168, 160]


def compile_dkdv(tile, causal, maxnreg):
    """Compile the d=64 dK/dV pass; returns (registers, spill-store bytes, shared memory)."""
    bm, bn, warps, stages = tile
    c = dict(aot_check.BASE_SWITCHES, HAS_RIGHT=causal, BLOCK_D=64, BLOCK_DV=64, EVEN_D=True, EVEN_DV=True,
             FP8_SCALES=None, AMAX=None, FP8=False, FP8_INTERP=False, FP8_MMA16=False, BLOCK_M=bm, BLOCK_N=bn, WRITE_DBIAS=False,
             VARLEN=False)
    ptr = "*bf16"
    ptrs = dict(Q=ptr, K=ptr, V=ptr, O=ptr, DO=ptr, LSE="*fp32", DELTA="*fp32", DK=ptr, DV=ptr, DBIAS="*fp32",
                DQ=ptr, SEQ_Q="*i32", SEQ_KV="*i32", BIAS=ptr, SLOPES="*fp32", CU_Q="*i32", CU_KV="*i32")
    # as the JIT specializes a launch of the anchor (b8 h12 s1024 d64, MHA, BSHD): unit strides (jit_like) and
    # the group of 1 become constants (what left the runtime kernel at 214 registers where a compile without
    # them reads 255 and spills), lengths and pointers divisible by 16
    c.update(GROUP=1, stride_lm=1)
    cap = dict(maxnreg=maxnreg) if maxnreg else {}
    k = aot_check.compile_kernel(bwd._attn_bwd_dkdv, ptrs, c, warps, stages, jit_like=True, **cap)
    rep = aot_check.ptxas_report(k)          # "regs=['214'] spill_stores=['0']"
    regs = rep.split("regs=['")[1].split("'")[0]
    spill = rep.split("spill_stores=['")[1].split("'")[0] if "spill_stores=['" in rep else "0"
    return int(regs), int(spill), k.metadata.shared


# (dK/dV tile (block_m, block_n, warps, stages), maxnreg or None); the default first
CANDIDATES = [((64, 64, 4, 3), None), ((64, 64, 4, 3), 168), ((64, 64, 4, 2), 168), ((32, 64, 4, 2), None),
              ((32, 64, 4, 3), None), ((64, 32, 4, 2), None)]
CONFIGS = [(8, 12, 1024, 64, False), (8, 12, 1024, 64, True)]      # ANCHORS.md's d=64 pair, fp16


class CappedLaunch:
    """``bwd._DKDV`` with ``maxnreg`` added to every launch (its own cache keys: another compile)."""

    def __init__(self, launcher, cap):
        self.launcher, self.cap = launcher, cap

    def __call__(self, key, grid, *args, **kwargs):
        return self.launcher(None if key is None else ("maxnreg", self.cap, key), grid, *args,
                             **dict(kwargs, maxnreg=self.cap))


def gpu_main(args):
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    import fusedattn
    from fusedattn import plan
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"FUSEDATTN_PREBUILT={os.environ.get('FUSEDATTN_PREBUILT')}", flush=True)
    real_tiles, real_launch = plan._BWD_SM90[(64, 2)], bwd._DKDV
    for b, h, s, d, causal in CONFIGS:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
        out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True)
        do = torch.randn_like(out)
        flops = 4 * b * h * s * s * d * 2.5 / (2 if causal else 1)
        print(f"b{b} h{h} s{s} d{d} fp16 {'causal' if causal else 'no mask'} ({flops / 1e12:.3f} TFLOP per backward)")
        ref = None
        for tile, cap in CANDIDATES:
            name = "x".join(map(str, tile)) + (f" cap {cap}" if cap else "")
            plan._BWD_SM90[(64, 2)] = plan.Tiles(*tile)
            plan._plan_cached.cache_clear()
            bwd._DKDV = CappedLaunch(real_launch, cap) if cap else real_launch
            try:
                fn = lambda: fusedattn.attention_backward(q, k, v, out, do, stats, causal=causal,  # noqa: E731
                                                          validate=False)
                grads = [x.clone() for x in fn()[:3]]
                torch.cuda.synchronize()
                graph_ms = do_bench_cudagraph(fn, rep=args.rep)
                eager_ms = do_bench(fn, warmup=25, rep=args.rep)
                if ref is None:
                    ref, base, check = grads, graph_ms, "reference"
                else:
                    diff = max((x.float() - r.float()).abs().max().item() / max(r.float().abs().max().item(), 1e-6)
                               for x, r in zip(grads, ref))
                    check = f"max rel diff {diff:.1e}" + ("  CHECK" if diff > 2e-2 else "")
                print(f"  {name:18s} graph {graph_ms:.4f} ms {flops / graph_ms / 1e9:6.1f} TFLOP/s "
                      f"({base / graph_ms:.3f}x)  eager {eager_ms:.4f} ms {flops / eager_ms / 1e9:6.1f}  {check}",
                      flush=True)
            except Exception as exc:     # a candidate failing (compile, launch, capture) is a result
                print(f"  {name:18s} FAILED {type(exc).__name__}: {str(exc).strip()[:200]}", flush=True)
            finally:
                plan._BWD_SM90[(64, 2)] = real_tiles
                plan._plan_cached.cache_clear()
                bwd._DKDV = real_launch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="static survey for sm_90a (no GPU)")
    ap.add_argument("--tiles", default=",".join(TILES), help="--sass: BMxBNxWARPSxSTAGES, comma-separated")
    ap.add_argument("--rep", type=int, default=200, help="GPU: do_bench rep (ms)")
    args = ap.parse_args()
    if not args.sass:
        return gpu_main(args)
    print(f"Triton {triton.__version__}, sm_90a, d=64 bf16 dK/dV pass (_attn_bwd_dkdv); per cap: regs / spill bytes; "
          f"CTAs/SM by registers at 4 warps = 65536 // (128 x regs)")
    print(f"{'tile':14s} {'mask':7s} {'smem':>7s} " + " ".join(f"{('cap ' + str(c)) if c else 'no cap':>16s}"
                                                            for c in CAPS))
    for t in args.tiles.split(","):
        tile = tuple(int(x) for x in t.split("x"))
        for causal in (False, True):
            cells, smem = [], 0
            for cap in CAPS:
                try:
                    regs, spill, smem = compile_dkdv(tile, causal, cap)
                    ctas = 65536 // (32 * tile[2] * regs)
                    cells.append(f"{regs:3d} / {spill:4d} B ({ctas})")
                except Exception as exc:     # a tile that does not compile is a result
                    cells.append(f"{type(exc).__name__[:16]:>16s}")
            print(f"{t:14s} {'causal' if causal else 'none':7s} {smem / 1024:6.1f}K " + " ".join(f"{c:>16s}"
                                                                                       for c in cells), flush=True)


if __name__ == "__main__":
    main()
