"""Tile / grid sweep of the Gluon sm_90 FP8 forward (fwd_sm90 [Note] FP8) beside the portable FP8 kernel and the
bf16 Gluon forward, on the FP8 configs of ``fusedattn bench --configs fp8`` at d <= 128 (H100; TFLOP/s =
4 b h s^2 d / time, halved when causal; do_bench median of the kernel launch alone, V's transposed copy made
once outside the timing, then timed on its own as "vcopy").

    python bench/gluon_fp8_sweep.py [--rep MS] [--check]

Variants (``launch_fwd_sm90_fp8`` keywords): default (fwd_sm90.FP8_TILES), n128 (128-key tiles, 3 stages),
persistent, n128+persistent, pingpong, promote32 (per-K-step fp32 promotion, the portable kernel's
accumulation). --check: each variant's output against the default's (max |diff|, amaxes).
"""
import argparse

import torch
import triton

from fusedattn import fp8
from fusedattn.backends.gluon import fwd_sm90
from fusedattn.problem import AttentionProblem, make_band

CONFIGS = [  # b, h_q, h_kv, s, d, causal
    (4, 32, 32, 2048, 128, True),
    (2, 16, 16, 8192, 128, False),
    (1, 32, 32, 16384, 128, True),
    (4, 32, 8, 4096, 128, True),
    (8, 12, 12, 1024, 64, False),
    (8, 12, 12, 1024, 64, True),
]
VARIANTS = {
    "default": {},
    "n128": dict(block_n=128, stages=3),
    "persistent": dict(persistent=True),
    "n128+persistent": dict(block_n=128, stages=3, persistent=True),
    "pingpong": dict(pingpong=True),
    "promote32": dict(promote=32),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print("config | " + " | ".join(VARIANTS) + " | portable fp8 | gluon bf16 | vcopy ms")
    for b, h_q, h_kv, s, d, causal in CONFIGS:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device=dev, generator=g).transpose(1, 2) for h in (h_q, h_kv, h_kv))
        (q8, dq), (k8, dk), (v8, dv) = (fp8.quantize_per_tensor(x) for x in (q, k, v))
        band = make_band(causal, "top_left", None)
        p = AttentionProblem(b=b, h_q=h_q, h_kv=h_kv, s_q=s, s_kv=s, d=d, d_v=d, dtype=q8.dtype, device_type="cuda",
                             scale=d ** -0.5, band=band)
        scales = torch.tensor([float(dq), float(dk), float(dv), 1 / 256, 256.0, 1.0], device=dev)
        vt = fwd_sm90.transposed_v(v8)
        flops = 4 * b * h_q * s * s * d / (2 if causal else 1)
        row, ref = [], None
        for name, kw in VARIANTS.items():
            out = torch.empty(b, h_q, s, d, dtype=torch.bfloat16, device=dev)
            lse = torch.empty(b, h_q, s, dtype=torch.float32, device=dev)
            amax = torch.zeros(2, device=dev)
            fn = lambda: fwd_sm90.launch_fwd_sm90_fp8(p, q8, k8, vt, out, lse, scales, amax, **kw)  # noqa: E731
            fn()
            if args.check:
                if ref is None:
                    ref = (out.clone(), amax.clone())
                else:
                    print(f"  check {name}: max |o - default| {(out.float() - ref[0].float()).abs().max().item():.3g}, "
                          f"amax {amax.tolist()} vs {ref[1].tolist()}")
            ms = triton.testing.do_bench(fn, rep=args.rep)
            row.append(f"{flops / ms / 1e9:.0f}")
        sc = {n: torch.tensor([x], device=dev) for n, x in
              dict(descale_q=float(dq), descale_k=float(dk), descale_v=float(dv), descale_s=1 / 256, scale_s=256.0,
                   scale_o=1.0).items()}
        real = fp8._run_gluon_fp8
        fp8._run_gluon_fp8 = lambda *a, **kw: False
        try:
            ms = triton.testing.do_bench(lambda: fp8._forward_kernel(q8, k8, v8, sc, d ** -0.5, band, None, None,
                                                                     torch.bfloat16), rep=args.rep)
        finally:
            fp8._run_gluon_fp8 = real
        row.append(f"{flops / ms / 1e9:.0f}")
        qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
        import fusedattn
        ms = triton.testing.do_bench(lambda: fusedattn.attention(qb, kb, vb, causal=causal), rep=args.rep)
        row.append(f"{flops / ms / 1e9:.0f}")
        ms = triton.testing.do_bench(lambda: fwd_sm90.transposed_v(v8), rep=args.rep)
        row.append(f"{ms:.3f}")
        print(f"b{b} h{h_q}/{h_kv} s{s} d{d}{' causal' if causal else ''} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
