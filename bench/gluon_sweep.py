"""The Gluon sm_90 forward kernel beside our Triton forward and cuDNN (torch SDPA) on the GPU.

    python3 bench/gluon_sweep.py [--configs NAME,...] [--rep MS] [--graph] [--padded]
    python3 bench/gluon_sweep.py --persistent [--configs NAME,...] [--variants tile,dyn,...] [--rep MS]

Physically-BSHD inputs (``torch.randn(b, s, h, d).transpose(1, 2)``). For each config: first
the max |difference| between the Gluon and the Triton outputs (and LSE), then the median time
of each (triton.testing.do_bench) as TFLOP/s, forward FLOPs 4*b*h*s*s*d, halved when causal.
Gluon variants: "gluon" (the defaults of fwd_sm90), "pp" (ping-pong toggled from the default),
and in the "alt" column for d=64 "n64" (BLOCK_N=64, 4 stages), for d=224/256 "n32" (BLOCK_N=32,
4 stages: the same shared memory). d=224 runs the 256-wide kernel (fwd_sm90.TILE_D). Inputs are
bf16 unless the config names fp16.

--graph adds GPU-only times (triton.testing.do_bench_cudagraph: launches replayed from a CUDA
graph, so host launch cost is out) and each path's host cost per call (median wall time of one
call with the GPU idle, i.e. Python, descriptor and launch work), so launch-bound small
configs show what the kernels themselves do.

--persistent runs PERSISTENT_CONFIGS instead: the one-tile grid ("tile") against the persistent
grid's variants ("dyn": dynamic tile counter, default head groups; "static": tile + nprog;
"dyn-hg4" / "dyn-hg16": head groups of 4 / 16; "dyn-hg-all": one head group, i.e. strictly longest
tiles first), TFLOP/s over the useful work, each
output checked bit for bit against the one-tile grid's (fwd_sm90 [Note] persistent grid).

--padded runs PADDED_CONFIGS instead: padding masks (seq_len_q = seq_len_kv = L_b per batch entry,
self-attention of padded sequences), TFLOP/s counted over the unpadded work only (sum over the
batch of 4*h*L_b^2*d, halved when causal): the Gluon kernel unpadded on the full s, padded with
L_b drawn in [s/2, s], our Triton forward on the same padded call, and the cost of zeroing the V
rows past len_kv in a CTA's last tile (fwd_sm90 [Note] padding): every L_b = s - 128 (whole
tiles, nothing to zero) against L_b = s - 129 (the same tiles, the last one zeroed from row 127).
The padded rows of Q, K and V hold NaN for the correctness check (max |gluon - triton| over
valid rows) and are finite for the timings.
"""
import argparse
import functools
import statistics
import time

import torch
import triton

from fusedattn.backends.gluon.fwd_sm90 import PINGPONG, TILE_D, launch_fwd_sm90, supports
from fusedattn.backends.triton.fwd import launch_fwd
from fusedattn.plan import plan
from fusedattn.problem import make_problem

CONFIGS = {  # name: (b, h_q, h_kv, s, d, causal[, dtype]); dtype bf16 unless given
    "b4-s2k-d128-c": (4, 32, 32, 2048, 128, True),
    "b1-s16k-d128-c": (1, 32, 32, 16384, 128, True),
    "b2-s8k-d128": (2, 16, 16, 8192, 128, False),
    "b4-gqa-s4k-d128-c": (4, 32, 8, 4096, 128, True),
    "b8-s1k-d64": (8, 12, 12, 1024, 64, False),
    "b8-s1k-d64-c": (8, 12, 12, 1024, 64, True),
    "b4-s4k-d256-c": (4, 16, 16, 4096, 256, True),
    "b4-s4k-d256": (4, 16, 16, 4096, 256, False),
    "b32-s2k-d224-fp16": (32, 32, 32, 2048, 224, False, torch.float16),
}

PADDED_CONFIGS = {  # as CONFIGS, for --padded
    "b4-s4k-d128-c": (4, 32, 32, 4096, 128, True),
    "b4-s4k-d128": (4, 32, 32, 4096, 128, False),
    "b4-s4k-d256-c": CONFIGS["b4-s4k-d256-c"],
}


def tflops(cfg, ms):
    b, hq, _, s, d, causal = cfg[:6]
    return 4.0 * b * hq * s * s * d / (2 if causal else 1) / ms / 1e9


def cudnn_ms(cfg, q, k, v, rep):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    causal = cfg[5]
    gqa = q.shape[1] != k.shape[1]
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)  # noqa
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            f()
            return triton.testing.do_bench(f, rep=rep, return_mode="median"), ""
    except Exception as e:  # noqa: BLE001 - cuDNN refusing GQA: time it on expanded K/V
        if not gqa:
            return None, f"({type(e).__name__})"
    g = q.shape[1] // k.shape[1]
    ke, ve = (t.repeat_interleave(g, dim=1) for t in (k, v))
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, ke, ve, is_causal=causal)  # noqa
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return triton.testing.do_bench(f, rep=rep, return_mode="median"), "(K/V expanded)"


def host_us(fn, n=30):
    """Median wall time of one call while the GPU keeps up (the host side of a launch), in us."""
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def graph_times(cfg, fns, rep):
    """{name: (TFLOP/s from CUDA-graph replay, host us per call)}; None where capture fails."""
    res = {}
    for name, fn in fns.items():
        try:
            ms = triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
            res[name] = (tflops(cfg, ms), host_us(fn))
        except Exception as e:  # noqa: BLE001 - a path refusing capture is a result
            res[name] = (float("nan"), float("nan"))
            print(f"  graph {name}: {type(e).__name__}: {str(e)[:120]}")
    return res


def sdpa_fn(cfg, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gqa = q.shape[1] != k.shape[1]

    def f():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cfg[5], enable_gqa=gqa)
    return f


def padded(rep):
    """The --padded sweep (module docstring)."""
    print(f"{torch.cuda.get_device_name()}: padding (seq_len_q = seq_len_kv = L_b), TFLOP/s over unpadded work")
    for name, cfg in PADDED_CONFIGS.items():
        b, hq, hkv, s, d, causal = cfg[:6]
        torch.manual_seed(0)
        mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
        q, k, v = mk(hq), mk(hkv), mk(hkv)
        out, lse = torch.empty_like(q), torch.empty((b, hq, s), device="cuda", dtype=torch.float32)

        def run(lens, backend):
            """(median ms, useful TFLOP/s, output) of one forward; lens None: unpadded."""
            seq = {} if lens is None else dict(seq_len_q=lens, seq_len_kv=lens)
            p, extras = make_problem(q, k, v, causal=causal, **seq)
            seq = dict(seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"])
            if backend == "gluon":
                assert supports(p, q, k, v, out, head_dims=tuple(TILE_D), **seq), name
                fn = lambda: launch_fwd_sm90(p, q, k, v, out, lse, **seq)  # noqa: E731
            else:
                tiles = plan(p, "triton").fwd
                fn = lambda: launch_fwd(p, tiles, q, k, v, out, lse, extras)  # noqa: E731
            fn()
            res = out.clone()
            ms = triton.testing.do_bench(fn, rep=rep, return_mode="median")
            ls = [s] * b if lens is None else lens.tolist()
            work = sum(4.0 * hq * n * n * d / (2 if causal else 1) for n in ls)
            return ms, work / ms / 1e9, res

        lens = torch.randint(s // 2, s + 1, (b,), device="cuda", dtype=torch.int32)
        _, t_full, _ = run(None, "gluon")
        _, t_pad, o_pad = run(lens, "gluon")
        _, t_tri, o_tri = run(lens, "triton")
        ms_whole, _, _ = run(torch.full((b,), s - 128, device="cuda", dtype=torch.int32), "gluon")
        ms_zero, _, _ = run(torch.full((b,), s - 129, device="cuda", dtype=torch.int32), "gluon")
        # NaN in every padding row of Q, K and V: the valid rows must not change
        for t in (q, k, v):
            for bi, n in enumerate(lens.tolist()):
                t[bi, :, n:] = float("nan")
        _, _, o_nan = run(lens, "gluon")
        valid = (torch.arange(s, device="cuda")[None, None, :, None] < lens.view(b, 1, 1, 1)).expand_as(o_nan)
        err = (o_pad.float() - o_tri.float()).abs().max().item()
        err_nan = (o_nan.float() - o_pad.float()).abs().max().item()
        print(f"{name}: L_b {lens.tolist()}: gluon unpadded {t_full:.0f}, padded {t_pad:.0f} "
              f"({t_pad / t_full:.2f} of unpadded), triton padded {t_tri:.0f} TFLOP/s; "
              f"V-row zeroing: L=s-128 {ms_whole:.3f} ms, L=s-129 {ms_zero:.3f} ms "
              f"({100 * (ms_zero / ms_whole - 1):+.1f}%); max|gluon - triton| {err:.1e}, "
              f"NaN padding: max change {err_nan:.1e}, NaN in valid rows {bool(o_nan[valid].isnan().any())}",
              flush=True)


PERSISTENT_CONFIGS = {  # name: (b, h_q, h_kv, s, d, mask[, lengths]); mask: "causal", "none" or (left, right)
    "b4-s2k-d128-c": (4, 32, 32, 2048, 128, "causal"),
    "b4-s2k-d128": (4, 32, 32, 2048, 128, "none"),
    "b2-s8k-d128-w1024": (2, 16, 16, 8192, 128, (1024, 0)),
    "b2-s8k-d128": (2, 16, 16, 8192, 128, "none"),
    "b1-s16k-d128-c": (1, 32, 32, 16384, 128, "causal"),
    "b4-gqa-s4k-d128-c": (4, 32, 8, 4096, 128, "causal"),
    "b8-s1k-d64-c": (8, 12, 12, 1024, 64, "causal"),
    "b8-s1k-d64": (8, 12, 12, 1024, 64, "none"),
    "b4-s4k-d256-c": (4, 16, 16, 4096, 256, "causal"),
    "b4-s2k-d256": (4, 16, 16, 2048, 256, "none"),
    "b4-s2k-d128-c-pad": (4, 32, 32, 2048, 128, "causal", (2048, 1536, 1024, 512)),
    "b4-s2k-d128-pad": (4, 32, 32, 2048, 128, "none", (2048, 1536, 1024, 512)),
}
ROUNDS = 3  # --persistent: timing rounds per variant
PERSISTENT_VARIANTS = {  # name: launch_fwd_sm90 keywords
    "tile": dict(persistent=False),
    "dyn": dict(persistent=True),
    "static": dict(persistent=True, dynamic=False),
    "dyn-hg4": dict(persistent=True, head_group=4),
    "dyn-hg16": dict(persistent=True, head_group=16),
    "dyn-hg-all": dict(persistent=True, head_group=1 << 20),
}


def persistent_sweep(rep, names, variants):
    """--persistent: the one-tile grid against the persistent grid's variants (PERSISTENT_VARIANTS),
    TFLOP/s over the useful work (4*h*sum(L_b^2)*d, halved under causal, the window's band
    counted exactly); each variant's output must equal the one-tile grid's bit for bit."""
    print(f"{torch.cuda.get_device_name()}: persistent grid, bf16, BSHD, TFLOP/s (median of do_bench, rep {rep} ms)")
    rows = []
    for name in names:
        cfg = PERSISTENT_CONFIGS[name]
        b, hq, hkv, s, d, mask = cfg[:6]
        lens = cfg[6] if len(cfg) > 6 else None
        torch.manual_seed(0)
        mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
        q, k, v = mk(hq), mk(hkv), mk(hkv)
        kw = {"causal": dict(causal=True), "none": {}}.get(mask) if isinstance(mask, str) else dict(window=mask,
                                                                                                    causal=True)
        if lens is not None:
            lt = torch.tensor(lens, device="cuda", dtype=torch.int32)
            kw.update(seq_len_q=lt, seq_len_kv=lt)
        p, extras = make_problem(q, k, v, **kw)
        seq = dict(seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"])
        assert supports(p, q, k, v, q, head_dims=tuple(TILE_D), **seq), name
        # useful score entries per (batch, head): rows i < L, keys j <= i (causal) within the band
        i = torch.arange(s, device="cuda")[:, None]
        j = torch.arange(s, device="cuda")[None, :]
        band = torch.ones(s, s, dtype=torch.bool, device="cuda")
        if mask != "none":
            band &= j <= i
        if isinstance(mask, tuple):
            band &= j >= i - mask[0]
        work = sum(4.0 * hq * d * band[:n, :n].sum().item() for n in (lens or [s] * b))
        lse = torch.empty((b, hq, s), device="cuda", dtype=torch.float32)
        outs, fns, times = {}, {}, {vn: [] for vn in variants}
        for vname in variants:
            out = torch.empty_like(q)
            fns[vname] = functools.partial(launch_fwd_sm90, p, q, k, v, out, lse, **seq, **PERSISTENT_VARIANTS[vname])
            fns[vname]()
            torch.cuda.synchronize()
            outs[vname] = out.clone()
        # the variants take turns, ROUNDS times, and each keeps the median of its rounds: clock and
        # thermal drift then reach every variant alike
        for _ in range(ROUNDS):
            for vname in variants:
                times[vname].append(triton.testing.do_bench(fns[vname], rep=rep, return_mode="median"))
        res = {vn: work / statistics.median(ts) / 1e9 for vn, ts in times.items()}
        spread = max((max(ts) - min(ts)) / statistics.median(ts) for ts in times.values())
        same = {vn: torch.equal(outs[vn].view(torch.int16), outs["tile"].view(torch.int16)) for vn in variants}
        rows.append((name, res, same))
        print(name + ": " + "  ".join(f"{vn} {t:.0f}{'' if same[vn] else ' (DIFFERS)'}" for vn, t in res.items())
              + f"  (largest spread of a variant's rounds {100 * spread:.1f}%)", flush=True)
    print(f"\n{'config':22s} " + " ".join(f"{vn:>10s}" for vn in variants) + "   best/tile")
    for name, res, same in rows:
        best = max(t for vn, t in res.items() if vn != "tile")
        print(f"{name:22s} " + " ".join(f"{res[vn]:10.0f}" for vn in variants) + f"   {best / res['tile']:8.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    ap.add_argument("--graph", action="store_true", help="also CUDA-graph (GPU-only) times and host cost")
    ap.add_argument("--padded", action="store_true", help="the padding-mask sweep (PADDED_CONFIGS) instead")
    ap.add_argument("--persistent", action="store_true",
                    help="the persistent-grid sweep (PERSISTENT_CONFIGS; --configs picks among them) instead")
    ap.add_argument("--variants", default=",".join(PERSISTENT_VARIANTS), help="--persistent: variants to time")
    args = ap.parse_args()
    if args.padded:
        return padded(args.rep)
    if args.persistent:
        names = args.configs.split(",") if args.configs != ",".join(CONFIGS) else list(PERSISTENT_CONFIGS)
        return persistent_sweep(args.rep, names, args.variants.split(","))
    rows = []
    graph_rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        b, hq, hkv, s, d, causal = cfg[:6]
        dt = cfg[6] if len(cfg) > 6 else torch.bfloat16
        torch.manual_seed(0)
        mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=dt).transpose(1, 2)  # noqa: E731
        q, k, v = mk(hq), mk(hkv), mk(hkv)
        p, extras = make_problem(q, k, v, causal=causal)
        out_g, out_t = torch.empty_like(q), torch.empty_like(q)
        lse_g = torch.empty((b, hq, s), device="cuda", dtype=torch.float32)
        lse_t = torch.empty_like(lse_g)
        assert supports(p, q, k, v, out_g, head_dims=tuple(TILE_D)), name
        tiles = plan(p).fwd
        launch_fwd_sm90(p, q, k, v, out_g, lse_g)
        launch_fwd(p, tiles, q, k, v, out_t, lse_t, extras)
        torch.cuda.synchronize()
        err_o = (out_g.float() - out_t.float()).abs().max().item()
        err_l = (lse_g - lse_t).abs().max().item()
        ms_g = triton.testing.do_bench(lambda: launch_fwd_sm90(p, q, k, v, out_g, lse_g), rep=args.rep,
                                       return_mode="median")
        variants = {"pp": dict(pingpong=not PINGPONG[TILE_D[d]])}
        if d == 64:
            variants["n64"] = dict(block_n=64, stages=4)
        if TILE_D[d] == 256:
            variants["n32"] = dict(block_n=32, stages=4)
        var = {}
        for vname, kw in variants.items():
            out_v = torch.empty_like(q)
            launch_fwd_sm90(p, q, k, v, out_v, lse_g, **kw)
            e = (out_v.float() - out_t.float()).abs().max().item()
            ms = triton.testing.do_bench(lambda: launch_fwd_sm90(p, q, k, v, out_v, lse_g, **kw), rep=args.rep,
                                         return_mode="median")
            var[vname] = (tflops(cfg, ms), e)
        ms_t = triton.testing.do_bench(lambda: launch_fwd(p, tiles, q, k, v, out_t, lse_t, extras), rep=args.rep,
                                       return_mode="median")
        ms_c, note = cudnn_ms(cfg, q, k, v, args.rep)
        if args.graph:
            g = graph_times(cfg, {"gluon": lambda: launch_fwd_sm90(p, q, k, v, out_g, lse_g),
                                  "triton": lambda: launch_fwd(p, tiles, q, k, v, out_t, lse_t, extras),
                                  "cudnn": sdpa_fn(cfg, q, k, v)}, args.rep)
            graph_rows.append((name, g))
            print(f"{name} (CUDA graph): " + "  ".join(f"{k} {t:.0f} TFLOP/s, host {h:.0f} us/call"
                                                          for k, (t, h) in g.items()), flush=True)
        row = (name, tflops(cfg, ms_g), tflops(cfg, ms_t), tflops(cfg, ms_c) if ms_c else float("nan"), note,
               err_o, err_l, var)
        rows.append(row)
        extra = "  ".join(f"{k} {t:.0f} (err {e:.1e})" for k, (t, e) in var.items())
        print(f"{name}: gluon {row[1]:.0f}  {extra}  triton {row[2]:.0f}  cudnn {row[3]:.0f} {note}  TFLOP/s; "
              f"max|gluon - triton| out {err_o:.2e} lse {err_l:.2e}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, BSHD memory, TFLOP/s (median of do_bench); alt: n64 (d64), "
          f"n32 (d224/256)")
    print(f"{'config':22s} {'gluon':>7s} {'pp':>5s} {'alt':>5s} {'triton':>7s} {'cudnn':>7s}  gluon/triton  "
          f"max|dO|  max|dLSE|")
    for name, g, t, c, note, eo, el, var in rows:
        pp = f"{var['pp'][0]:5.0f}" if "pp" in var else "    -"
        alt = next((f"{var[k][0]:5.0f}" for k in ("n64", "n32") if k in var), "    -")
        print(f"{name:22s} {g:7.0f} {pp} {alt} {t:7.0f} {c:7.0f}  {g / t:11.2f}x  {eo:.1e}  {el:.1e} {note}")
    if graph_rows:
        print("\nCUDA-graph replay (GPU time only), TFLOP/s; host cost of one call, us")
        print(f"{'config':22s} {'gluon':>7s} {'triton':>7s} {'cudnn':>7s}  gluon/triton  "
              f"{'host us: gluon':>15s} {'triton':>7s} {'cudnn':>7s}")
        for name, g in graph_rows:
            (tg, hg), (tt, ht), (tc, hc) = g["gluon"], g["triton"], g["cudnn"]
            print(f"{name:22s} {tg:7.0f} {tt:7.0f} {tc:7.0f}  {tg / tt:11.2f}x  {hg:15.0f} {ht:7.0f} {hc:7.0f}")


if __name__ == "__main__":
    main()
