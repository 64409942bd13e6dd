"""A/B of the Gluon FP8 forward's consumer count and accumulation (fwd_sm90 [Note] FP8; bench/NOTES.md 79).

    python bench/fp8_consumers_ab.py [--rep MS] [--rounds N] [--only NAME,...]

The d=128 FP8 forward runs two consumer warpgroups (128 query rows per CTA) whose tensor pipe idled about half
the time (bench/NOTES.md 69: the step is latency-bound, 0.58 eligible warps per scheduler). Variants
(``launch_fwd_sm90_fp8`` keywords):

* default: FP8_TILES (128 keys, 3 stages), each key tile's P V in a fresh accumulator added to O in fp32;
* direct: ``promote=-1``, P V accumulated into O by the wgmma itself (cuDNN's and FlashAttention-3's
  accumulation), which frees the per-tile accumulator's 64 registers per thread;
* c3-n64 / c3-n128: three consumer warpgroups (192 rows per CTA, ``consumers=3``) with direct accumulation and
  ``consumer_regs`` 160 (the register file's share of 3 x 128 consumer threads beside the load warp's group);
* c3-n64-tile: three warpgroups with the fresh per-tile accumulator (64-key tiles).

Each variant is checked against a float64 reference on the dequantized inputs (max |error| of the bf16
output) and timed in interleaved rounds (do_bench median of the launch alone; V's transposed copy made once);
TFLOP/s = 4 b h s^2 d / time, halved when causal.
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
]
VARIANTS = {
    "default": {},
    "direct": dict(promote=-1),
    "c3-n64": dict(consumers=3, consumer_regs=160, promote=-1, block_n=64, stages=4),
    "c3-n128": dict(consumers=3, consumer_regs=160, promote=-1, block_n=128, stages=3),
    "c3-n64-tile": dict(consumers=3, consumer_regs=160, block_n=64, stages=4),
}


def reference(q, k, v, dq, dk, dv, causal, rows=256):
    """float64 attention of the dequantized inputs, for the last ``rows`` query rows of every head."""
    qd, kd, vd = (x.double() * s for x, s in ((q, dq), (k, dk), (v, dv)))
    group = q.shape[1] // k.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s_q, s_kv = q.shape[2], k.shape[2]
    sc = qd[:, :, -rows:] @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        r = torch.arange(s_q - rows, s_q, device=q.device)[:, None]
        sc = sc.masked_fill(torch.arange(s_kv, device=q.device)[None, :] > r, float("-inf"))
    return torch.softmax(sc, -1) @ vd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    variants = {n: kw for n, kw in VARIANTS.items() if not args.only or n in args.only.split(",")}
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    for b, h_q, h_kv, s, d, causal in CONFIGS:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device=dev, generator=g).transpose(1, 2) for h in (h_q, h_kv, h_kv))
        (q8, dq), (k8, dk), (v8, dv) = (fp8.quantize_per_tensor(x) for x in (q, k, v))
        band = make_band(causal, "top_left", None)
        p = AttentionProblem(b=b, h_q=h_q, h_kv=h_kv, s_q=s, s_kv=s, d=d, d_v=d, dtype=q8.dtype, device_type="cuda",
                             scale=d ** -0.5, band=band)
        scales = torch.tensor([float(dq), float(dk), float(dv), 1 / 256, 256.0, 1.0], device=dev)
        vt = fwd_sm90.transposed_v(v8)
        ref = reference(q8, k8, v8, float(dq), float(dk), float(dv), causal)
        flops = 4 * b * h_q * s * s * d / (2 if causal else 1)
        name = f"b{b} h{h_q}/{h_kv} s{s} d{d}{' causal' if causal else ''}"
        fns, errs = {}, {}
        for vname, kw in variants.items():
            out = torch.full((b, h_q, s, d), float("nan"), dtype=torch.bfloat16, device=dev)
            lse = torch.empty(b, h_q, s, dtype=torch.float32, device=dev)
            amax = torch.zeros(2, device=dev)
            fn = (lambda out=out, lse=lse, amax=amax, kw=kw:
                  fwd_sm90.launch_fwd_sm90_fp8(p, q8, k8, vt, out, lse, scales, amax, **kw))
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # a variant that does not compile or launch: reported, not timed
                print(f"{name} | {vname}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            errs[vname] = (out[:, :, -ref.shape[2]:].double() - ref).abs().max().item()
            fns[vname] = fn
        times = {n: [] for n in fns}
        for _ in range(args.rounds):
            for vname, fn in fns.items():
                times[vname].append(triton.testing.do_bench(fn, rep=args.rep))
        for vname in fns:
            ms = sorted(times[vname])[len(times[vname]) // 2]
            print(f"{name} | {vname}: {flops / ms / 1e9:.0f} TFLOP/s (rounds "
                  f"{' '.join(f'{flops / t / 1e9:.0f}' for t in times[vname])}), max err {errs[vname]:.3g}",
                  flush=True)


if __name__ == "__main__":
    main()
