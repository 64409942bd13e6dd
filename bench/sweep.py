"""Tile sweep on the GPU: our forward/backward per tile choice beside torch SDPA (cudnn, flash).

Used to fill the tile tables in fusedattn/plan.py (results go to bench/NOTES.md).
    python3 bench/sweep.py [--pass fwd|bwd|both] [--configs NAME,...]
                           [--fwd-tiles MxNxWxS,...] [--bwd-tiles MxNxWxS/MxNxWxS,...]
Tiles given on the command line replace the built-in candidates for every head dim;
a bwd pair is dK/dV tiles / dQ tiles.
"""
import argparse
import sys

import torch
import triton

from fusedattn.backends.triton.bwd import launch_bwd
from fusedattn.backends.triton.fwd import launch_fwd
from fusedattn.plan import Plan, Tiles, plan
from fusedattn.problem import make_problem

CONFIGS = {  # name: (b, h_q, h_kv, s, d, dtype, causal), ANCHORS.md
    "d64": (8, 12, 12, 1024, 64, torch.float16, False),
    "d64c": (8, 12, 12, 1024, 64, torch.float16, True),
    "d128c": (4, 32, 32, 2048, 128, torch.bfloat16, True),
    "d224": (32, 32, 32, 2048, 224, torch.float16, False),
    "16kc": (1, 32, 32, 16384, 128, torch.bfloat16, True),
    "gqa": (4, 32, 8, 4096, 128, torch.bfloat16, True),
    "8k": (2, 16, 16, 8192, 128, torch.bfloat16, False),
    "d256c": (4, 16, 16, 4096, 256, torch.bfloat16, True),
}

FWD_CANDIDATES = {
    64: [Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3, True), Tiles(128, 128, 8, 3, True), Tiles(128, 64, 4, 3, True),
         Tiles(128, 128, 8, 3, True, True)],
    128: [Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3, True), Tiles(128, 128, 8, 3, True), Tiles(128, 64, 8, 4, True),
          Tiles(128, 128, 8, 3, True, True), Tiles(128, 64, 8, 3, True, True)],
    256: [Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 2, True), Tiles(128, 32, 8, 2), Tiles(64, 64, 4, 2, True)],
}
BWD_CANDIDATES = {
    64: [(Tiles(64, 128, 8, 2), Tiles(128, 64, 8, 2)), (Tiles(32, 128, 4, 2), Tiles(64, 64, 4, 2)),
         (Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3))],
    128: [(Tiles(64, 128, 8, 2), Tiles(128, 64, 8, 2)), (Tiles(32, 128, 8, 2), Tiles(64, 64, 4, 2)),
          (Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)), (Tiles(64, 128, 8, 1), Tiles(128, 32, 8, 2))],
    256: [(Tiles(64, 64, 8, 1), Tiles(64, 64, 8, 1)), (Tiles(32, 32, 8, 1), Tiles(32, 32, 8, 1)),
          (Tiles(64, 32, 8, 2), Tiles(32, 64, 8, 2)), (Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 2)),
          (Tiles(32, 64, 8, 2), Tiles(64, 32, 8, 2))],
}


def inputs(cfg):
    b, hq, hkv, s, d, dt, causal = cfg
    mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=dt).transpose(1, 2)  # noqa: E731  BSHD memory
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def tflops(cfg, ms, bwd=False):
    b, hq, hkv, s, d, dt, causal = cfg
    f = 4.0 * b * hq * s * s * d / (2 if causal else 1) * (2.5 if bwd else 1.0)
    return f / ms / 1e9


def sdpa_times(cfg, q, k, v, do):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    res = {}
    causal = cfg[6]
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(be):
                gqa = q.shape[1] != k.shape[1]
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)  # noqa
                res[name + " fwd"] = tflops(cfg, triton.testing.do_bench(f, return_mode="median"))
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=gqa)
                g = lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)  # noqa
                res[name + " bwd"] = tflops(cfg, triton.testing.do_bench(g, return_mode="median"), bwd=True)
        except Exception as e:  # noqa: BLE001 - a backend refusing a config is a result
            res[name] = f"none ({type(e).__name__})"
    return res


def parse_tiles(text):
    """'128x64x8x3' -> Tiles(128, 64, 8, 3)."""
    return Tiles(*(int(x) for x in text.split("x")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pass", dest="which", default="both")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--fwd-tiles", default="")
    ap.add_argument("--bwd-tiles", default="")
    args = ap.parse_args()
    if args.fwd_tiles:
        tiles = [parse_tiles(t) for t in args.fwd_tiles.split(",")]
        FWD_CANDIDATES.update({b: tiles for b in FWD_CANDIDATES})
    if args.bwd_tiles:
        pairs = [tuple(parse_tiles(t) for t in pair.split("/")) for pair in args.bwd_tiles.split(",")]
        BWD_CANDIDATES.update({b: pairs for b in BWD_CANDIDATES})
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        q, k, v, do = inputs(cfg)
        p, extras = make_problem(q, k, v, causal=cfg[6])
        bucket = 64 if cfg[4] <= 64 else 128 if cfg[4] <= 128 else 256
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        line = [f"{name}: sdpa {sdpa_times(cfg, q, k, v, do)}"]
        if args.which in ("fwd", "both"):
            for t in FWD_CANDIDATES[bucket]:
                try:
                    ms = triton.testing.do_bench(lambda: launch_fwd(p, t, q, k, v, out, lse, extras),
                                                 return_mode="median")
                    line.append(f"  fwd {t}: {tflops(cfg, ms):.0f} TFLOP/s")
                except Exception as e:  # noqa: BLE001
                    line.append(f"  fwd {t}: failed {type(e).__name__}: {str(e)[:100]}")
        if args.which in ("bwd", "both"):
            launch_fwd(p, plan(p).fwd, q, k, v, out, lse, extras)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            for tk, tq in BWD_CANDIDATES[bucket]:
                pl = Plan("triton", None, tk, tq)
                try:
                    ms = triton.testing.do_bench(
                        lambda: launch_bwd(p, pl, q, k, v, out, do, lse, extras, dq, dk, dv, False),
                        return_mode="median")
                    line.append(f"  bwd {tk} / {tq}: {tflops(cfg, ms, True):.0f} TFLOP/s")
                except Exception as e:  # noqa: BLE001
                    line.append(f"  bwd {tk}/{tq}: failed {type(e).__name__}: {str(e)[:100]}")
        print("\n".join(line), flush=True)
        print(f"[sweep] {name} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
