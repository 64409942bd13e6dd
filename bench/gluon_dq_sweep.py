"""The Gluon sm_90 dQ pass (fusedattn/backends/gluon/bwd_dq_sm90.py) beside our Triton dQ pass.

    python3 bench/gluon_dq_sweep.py [--configs NAME,...] [--rep MS] [--variants]

Physically-BSHD inputs (``torch.randn(b, s, h, d).transpose(1, 2)``); out/lse from our forward,
delta = rowsum(dO * O). For each config: the max
|difference| between the Gluon and the Triton dQ, then the median time of each
(triton.testing.do_bench) as TFLOP/s with the dQ pass counted as 3 matmuls, 6*b*h_q*s_q*s_kv*d
flops, halved when causal. "triton" is ``_attn_bwd_dq`` alone (the tiles of ``plan(p).bwd_dq``),
launched the way ``launch_bwd`` launches it: both compute and write delta = rowsum(dO * O) in the
pass (Gluon: ``out=``). --variants also times Gluon reading a given delta ("rd"), with the S/dP wait
split toggled ("split"), other ring depths ("sN"), and BLOCK_N=128 at d=64 ("n128").
"""
import argparse

import torch
import triton

import fusedattn
from fusedattn.backends.gluon.bwd_dq_sm90 import SPLIT, TILES, launch_dq_sm90, supports
from fusedattn.backends.triton import bwd as tbwd
from fusedattn.backends.triton.args import kernel_scalars
from fusedattn.backends.triton.launch import cdiv, pow2
from fusedattn.plan import plan
from fusedattn.problem import make_problem

CONFIGS = {  # name: (b, h_q, h_kv, s, d, causal[, dtype]); dtype bf16 unless given
    "b4-s2k-d128-c": (4, 32, 32, 2048, 128, True),
    "b1-s16k-d128-c": (1, 32, 32, 16384, 128, True),
    "b4-gqa-s4k-d128-c": (4, 32, 8, 4096, 128, True),
    "b2-s8k-d128": (2, 16, 16, 8192, 128, False),
    "b8-s1k-d64-fp16": (8, 12, 12, 1024, 64, False, torch.float16),
    "b8-s1k-d64-fp16-c": (8, 12, 12, 1024, 64, True, torch.float16),
}


def tflops(cfg, ms):
    b, hq, _, s, d, causal = cfg[:6]
    return 6.0 * b * hq * s * s * d / (2 if causal else 1) / ms / 1e9


def triton_dq_fn(p, extras, q, k, v, out, grad_out, lse, delta, dq):
    """A closure launching only the Triton dQ kernel, with launch_bwd's arguments (it computes and
    writes delta itself, WRITE_DELTA)."""
    args = kernel_scalars(p, extras, q)
    t = plan(p).bwd_dq
    common = (p.scale, args["qk_scale"], p.softcap, args["win_left"], args["win_right"],
              p.dropout_seed, p.dropout_offset, args["dropout_threshold"], args["dropout_rescale"])
    grid = (cdiv(p.s_q, t.block_m), p.b * p.h_q)
    pos = (q, k, v, out, grad_out, lse, delta, dq, args["seq_q"], args["seq_kv"], q, args["slopes"], q, q,
           *q.stride(), *k.stride(), *v.stride(), *out.stride(), *grad_out.stride(), *dq.stride(), *lse.stride(),
           0, 0, 0, 0,
           p.h_q, p.group, p.s_q, p.s_kv, p.d, p.d_v, *common)
    kw = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=pow2(p.d), BLOCK_DV=pow2(p.d_v),
              REVERSE_M=args["causal_like"], VARLEN=False, WRITE_DELTA=True, num_warps=t.num_warps, num_stages=t.num_stages,
              **args["switches"])
    key = ("gluon_dq_sweep", p, q.stride(), k.stride(), v.stride(), grad_out.stride(), dq.stride(), lse.stride())
    return (lambda: tbwd._DQ(key, grid, *pos, **kw)), t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    ap.add_argument("--variants", action="store_true", help="also Gluon variants (module docstring)")
    args = ap.parse_args()
    rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        b, hq, hkv, s, d, causal = cfg[:6]
        dt = cfg[6] if len(cfg) > 6 else torch.bfloat16
        torch.manual_seed(0)
        mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=dt).transpose(1, 2)  # noqa: E731
        q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
        out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True)
        lse = stats[..., 0]
        delta = (out.float() * do.float()).sum(-1).reshape(b * hq, s).contiguous()
        p, extras = make_problem(q, k, v, causal=causal)
        dq_g, dq_t = torch.empty_like(q), torch.empty_like(q)
        assert supports(p, q, k, v, do, dq_g), name
        delta_t, delta_g = torch.empty_like(delta), torch.empty_like(delta)
        tri, tiles = triton_dq_fn(p, extras, q, k, v, out, do, lse, delta_t, dq_t)
        launch_dq_sm90(p, q, k, v, do, lse, delta_g, dq_g, out=out)
        tri()
        torch.cuda.synchronize()
        err = (dq_g.float() - dq_t.float()).abs().max().item()
        err_d = max((delta_g - delta).abs().max().item(), (delta_t - delta).abs().max().item())
        scale = dq_t.float().abs().max().item()
        ms_g = triton.testing.do_bench(lambda: launch_dq_sm90(p, q, k, v, do, lse, delta_g, dq_g, out=out),
                                       rep=args.rep, return_mode="median")
        ms_t = triton.testing.do_bench(tri, rep=args.rep, return_mode="median")
        var = {}
        if args.variants:
            bn, st = TILES[d]
            vs = {"rd": dict(), "split": dict(split=not SPLIT[d], out=out)}
            vs.update({f"s{n}": dict(stages=n, out=out) for n in (2, 3, 4) if n != st})
            if d == 64:
                vs["n128"] = dict(block_n=128, stages=3, out=out)
            for vname, kw in vs.items():
                dq_v, d_v = torch.empty_like(q), delta.clone()
                try:
                    launch_dq_sm90(p, q, k, v, do, lse, d_v, dq_v, **kw)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: a result
                    print(f"  {name} {vname}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                e = (dq_v.float() - dq_t.float()).abs().max().item()
                ms = triton.testing.do_bench(lambda: launch_dq_sm90(p, q, k, v, do, lse, d_v, dq_v, **kw),
                                             rep=args.rep, return_mode="median")
                var[vname] = (tflops(cfg, ms), e)
        row = (name, tflops(cfg, ms_g), ms_g, tflops(cfg, ms_t), ms_t, err, scale, var, tiles)
        rows.append(row)
        extra = "  ".join(f"{k} {t:.0f} (err {e:.1e})" for k, (t, e) in var.items())
        print(f"{name}: gluon {row[1]:.0f} TFLOP/s ({ms_g:.3f} ms)  triton {row[3]:.0f} ({ms_t:.3f} ms, "
              f"{tiles.block_m}x{tiles.block_n}/{tiles.num_warps}w/{tiles.num_stages}s)  {extra}  "
              f"max|gluon - triton| {err:.2e} (max|dq| {scale:.2e}), max|delta error| {err_d:.1e}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, BSHD memory, dQ pass only, TFLOP/s (median of do_bench), "
          f"6*b*h*s*s*d flops (halved when causal)")
    print(f"{'config':22s} {'gluon':>7s} {'triton':>7s}  gluon/triton  {'ms gluon':>9s} {'ms triton':>9s}  "
          f"max|dq diff|  variants")
    for name, g, mg, t, mt, err, scale, var, _ in rows:
        extra = " ".join(f"{k}={tf:.0f}" for k, (tf, _) in var.items())
        print(f"{name:22s} {g:7.0f} {t:7.0f}  {g / t:11.2f}x  {mg:9.3f} {mt:9.3f}  {err:.1e}  {extra}")


if __name__ == "__main__":
    main()
