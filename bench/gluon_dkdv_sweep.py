"""Time the Gluon sm_90 dK/dV backward pass against our Triton dK/dV pass alone (same inputs).

    python3 bench/gluon_dkdv_sweep.py [--quick] [--wide]     (--wide: the d 224/256 configs only)

TFLOP/s of the dK/dV pass: 4 matmuls (S^T, dP^T, dV, dK) of 2*b*h_q*s_q*s_kv*d flops each,
halved when causal. "triton" is ``bwd._attn_bwd_dkdv`` launched exactly as ``launch_bwd`` does
(plan(p).bwd tiles), "gluon" is ``launch_dkdv_sm90`` ("alt": the other ring depth, 2 or 3 stages; at
d 224/256 the other ``DV_FIRST``). Medians of
triton.testing.do_bench (host launch cost included) and of do_bench_cudagraph (GPU time only). Inputs physically BSHD (``torch.randn(b, s, h, d).transpose(1, 2)``).
Also prints max |gluon - triton| on dK and dV.
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fusedattn  # noqa: E402
from fusedattn.backends.gluon import bwd_dkdv_sm90 as G  # noqa: E402
from fusedattn.backends.triton import bwd  # noqa: E402
from fusedattn.backends.triton.args import kernel_scalars  # noqa: E402
from fusedattn.backends.triton.launch import pow2  # noqa: E402
from fusedattn.plan import plan  # noqa: E402
from fusedattn.problem import make_problem  # noqa: E402

CONFIGS = [  # (b, h_q, h_kv, s, d, dtype, causal)
    (4, 32, 32, 2048, 128, torch.bfloat16, True),
    (1, 32, 32, 16384, 128, torch.bfloat16, True),
    (4, 32, 8, 4096, 128, torch.bfloat16, True),
    (2, 16, 16, 8192, 128, torch.bfloat16, False),
    (8, 12, 12, 1024, 64, torch.float16, False),
    (8, 12, 12, 1024, 64, torch.float16, True),
    # d 224/256: the SPLIT variant (the bench's two wide anchors first)
    (4, 16, 16, 4096, 256, torch.bfloat16, True),
    (32, 32, 32, 2048, 224, torch.float16, False),
    (4, 16, 16, 4096, 256, torch.bfloat16, False),
    (2, 16, 4, 8192, 256, torch.bfloat16, True),
]


def triton_dkdv(p, extras, q, k, v, do, lse, delta, dk, dv):
    """A closure launching the Triton dK/dV kernel with launch_bwd's arguments (plain problem)."""
    args = kernel_scalars(p, extras, q)
    t = plan(p).bwd
    grid = (triton.cdiv(p.s_kv, t.block_n), p.b * p.h_kv)
    pos = (q, k, v, do, lse, delta, dk, dv, delta, args["seq_q"], args["seq_kv"], q, args["slopes"], q, q,
           *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *lse.stride(),
           0, 0, 0, 0, p.h_q, p.h_kv, p.group, p.s_q, p.s_kv, p.d, p.d_v,
           p.scale, args["qk_scale"], p.softcap, args["win_left"], args["win_right"],
           p.dropout_seed, p.dropout_offset, args["dropout_threshold"], args["dropout_rescale"])
    kw = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=pow2(p.d), BLOCK_DV=pow2(p.d_v), WRITE_DBIAS=False,
              VARLEN=False, num_warps=t.num_warps, num_stages=t.num_stages, **args["switches"])
    return lambda: bwd._attn_bwd_dkdv[grid](*pos, **kw)


def main():
    quick = "--quick" in sys.argv
    wide = "--wide" in sys.argv      # only the d 224/256 configs
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    print("TFLOP/s; plain = do_bench median (host launch cost included), graph = do_bench_cudagraph median (GPU only)")
    print(f"{'config':40s} {'triton':>7s} {'gluon':>7s} {'g/t':>6s} {'alt':>9s} | {'graph t':>7s} {'graph g':>7s} "
          f"{'g/t':>6s} | max|dk| max|dv| (g - t)")
    configs = [c for c in CONFIGS if c[4] > 128] if wide else CONFIGS
    for b, h_q, h_kv, s, d, dt, causal in configs[:2] if quick else configs:
        torch.manual_seed(0)
        q = torch.randn(b, s, h_q, d, device="cuda", dtype=dt).transpose(1, 2)
        k = torch.randn(b, s, h_kv, d, device="cuda", dtype=dt).transpose(1, 2)
        v = torch.randn(b, s, h_kv, d, device="cuda", dtype=dt).transpose(1, 2)
        do = torch.randn(b, s, h_q, d, device="cuda", dtype=dt).transpose(1, 2)
        out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True)
        lse = stats[..., 0]
        delta = (out.float() * do.float()).sum(-1).reshape(b * h_q, s).contiguous()
        p, extras = make_problem(q, k, v, causal=causal)
        assert G.supports(p, q, k, v, do, k, v)
        dk_t, dv_t = torch.empty_like(k), torch.empty_like(v)
        dk_g, dv_g = torch.empty_like(k), torch.empty_like(v)
        run_t = triton_dkdv(p, extras, q, k, v, do, lse, delta, dk_t, dv_t)
        td = G.TILE_D[d]
        # the other ring depth; at tile width 256 (3 stages would need 272 KB of shared memory) the other
        # DV_FIRST instead
        alt_stages = G.STAGES[td, causal] if td == 256 else 2 if G.STAGES[td, causal] != 2 else 3
        alt_kw = dict(stages=alt_stages, dv_first=not G.DV_FIRST if td == 256 else None)
        flops = 8.0 * b * h_q * s * s * d * (0.5 if causal else 1.0)
        tf = lambda ms: flops / ms / 1e9  # noqa: E731
        fns = {"triton": run_t,
               "gluon": lambda: G.launch_dkdv_sm90(p, q, k, v, do, lse, delta, dk_g, dv_g),
               "alt": lambda: G.launch_dkdv_sm90(p, q, k, v, do, lse, delta, dk_g, dv_g, **alt_kw)}
        res, graph = {}, {}
        for name, fn in fns.items():
            try:
                fn()
                torch.cuda.synchronize()
                res[name] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                if name != "alt":
                    graph[name] = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
            except Exception as e:  # a variant that does not compile (shared memory) is reported, not fatal
                print(f"   {name}: {type(e).__name__}: {str(e)[:200]}")
                res[name] = graph[name] = float("nan")
        G.launch_dkdv_sm90(p, q, k, v, do, lse, delta, dk_g, dv_g)
        run_t()
        torch.cuda.synchronize()
        e_dk = (dk_g.float() - dk_t.float()).abs().max().item()
        e_dv = (dv_g.float() - dv_t.float()).abs().max().item()
        cfg = f"b{b} h{h_q}/{h_kv} s{s} d{d} {str(dt)[6:]} {'causal' if causal else 'full'}"
        alt = "dvf" if td == 256 else f"s{alt_stages}"
        print(f"{cfg:40s} {tf(res['triton']):7.1f} {tf(res['gluon']):7.1f} {res['triton'] / res['gluon']:5.2f}x "
              f"{tf(res['alt']):6.1f} {alt:>3s} | {tf(graph['triton']):7.1f} {tf(graph['gluon']):7.1f} "
              f"{graph['triton'] / graph['gluon']:5.2f}x | {e_dk:.2e} {e_dv:.2e}   "
              f"(ms plain: {res['triton']:.3f} / {res['gluon']:.3f} / {res['alt']:.3f})", flush=True)


if __name__ == "__main__":
    main()
