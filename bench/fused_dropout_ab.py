"""Dropout's backward on the single-pass kernel against the two Gluon passes (bwd_fused_sm90 [Note] dropout;
bench/NOTES.md 79).

    python bench/fused_dropout_ab.py [--rep MS] [--rounds N] [--p P]

For each config, one process, the same inputs: ``fusedattn.attention_backward`` (the functional backward: delta,
the kernels, the dQ conversion) with dropout p routed to the single pass ("fused": ``_FUSED_CAUSAL_MIN_KEYS`` 0,
so every causal call takes it, and ``DROPOUT_DIMS`` every head dim; the numbers quoted in bench/NOTES.md 79 were
taken before that switch existed, when the kernel took dropout at both) or to the two Gluon passes ("two-pass":
``bwd_fused_sm90.supports`` refused), and the same call with no dropout on the single pass ("no dropout"). Rounds
interleave the three; the median of do_bench medians is printed. TFLOP/s = 2.5 x 4 b h s^2 d / time, halved when
causal. The two dropout routes' gradients are compared (max |difference| over max |gradient|): they apply the same
mask.
"""
import argparse

import torch
import triton

import fusedattn
from fusedattn import functional
from fusedattn.backends.gluon import bwd_fused_sm90

CONFIGS = [  # b, h_q, h_kv, s, d, causal
    (4, 32, 32, 2048, 128, True),      # bench --configs masked's dropout row
    (2, 16, 16, 8192, 128, False),
    (1, 32, 32, 16384, 128, True),
    (4, 32, 8, 4096, 128, True),
    (8, 12, 12, 2048, 64, False),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--p", type=float, default=0.1)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    real_supports = bwd_fused_sm90.supports
    real_min = functional._FUSED_CAUSAL_MIN_KEYS
    real_dims = bwd_fused_sm90.DROPOUT_DIMS
    for b, h_q, h_kv, s, d, causal in CONFIGS:
        g = torch.Generator(device=dev).manual_seed(0)
        dt = torch.bfloat16 if d == 128 else torch.float16
        q, k, v, do = (torch.randn(b, s, h, d, device=dev, generator=g, dtype=dt).transpose(1, 2)
                       for h in (h_q, h_kv, h_kv, h_q))
        drop = dict(dropout_p=args.p, dropout_seed=1234, dropout_offset=0)
        outs = {}
        for name, kw in (("dropout", drop), ("plain", {})):
            outs[name] = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True, **kw)

        def call(kw, name):
            out, stats = outs[name]
            return fusedattn.attention_backward(q, k, v, out, do, stats, causal=causal, deterministic=False, **kw)

        def routed(fused, kw, name):
            def fn():
                bwd_fused_sm90.supports = real_supports if fused else (lambda *a, **k: False)
                functional._FUSED_CAUSAL_MIN_KEYS = 0
                bwd_fused_sm90.DROPOUT_DIMS = bwd_fused_sm90.HEAD_DIMS       # every head dim the kernel has
                bwd_fused_sm90._problem_ok.cache_clear()
                try:
                    return call(kw, name)
                finally:
                    bwd_fused_sm90.supports = real_supports
                    functional._FUSED_CAUSAL_MIN_KEYS = real_min
                    bwd_fused_sm90.DROPOUT_DIMS = real_dims
                    bwd_fused_sm90._problem_ok.cache_clear()
            return fn

        variants = {"fused": routed(True, drop, "dropout"), "two-pass": routed(False, drop, "dropout"),
                    "no dropout": routed(True, {}, "plain")}
        a = [t.float() for t in variants["fused"]()[:3]]
        b2 = [t.float() for t in variants["two-pass"]()[:3]]
        diffs = " ".join(f"{n} {((x - y).abs().max() / y.abs().max()).item():.2e}"
                         for n, x, y in zip(("dq", "dk", "dv"), a, b2))
        flops = 2.5 * 4 * b * h_q * s * s * d / (2 if causal else 1)
        times = {n: [] for n in variants}
        for _ in range(args.rounds):
            for n, fn in variants.items():
                times[n].append(triton.testing.do_bench(fn, rep=args.rep))
        name = f"b{b} h{h_q}/{h_kv} s{s} d{d}{' causal' if causal else ''} p{args.p}"
        row = []
        for n in variants:
            ms = sorted(times[n])[len(times[n]) // 2]
            row.append(f"{n} {flops / ms / 1e9:.0f} ({' '.join(f'{flops / t / 1e9:.0f}' for t in times[n])})")
        print(f"{name} | " + " | ".join(row) + f" | fused vs two-pass: {diffs}", flush=True)


if __name__ == "__main__":
    main()
