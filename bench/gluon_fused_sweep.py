"""Time the experimental single-pass Gluon backward (bwd_fused_sm90) against the two-pass Gluon backward
(bwd_dq_sm90 + bwd_dkdv_sm90) on the d128 anchor configs.

    python3 bench/gluon_fused_sweep.py [--quick] [--gqa] [--variants[=a,b,...]] [--order] [--baseline=MODULE]

TFLOP/s of the whole backward: 2.5x the forward's 4*b*h_q*s_q*s_kv*d flops, halved when causal.
Columns (medians of triton.testing.do_bench, ms -> TFLOP/s):
  2pass   what functional._run_gluon_backward launches: [delta pass if no mask] + dQ pass (which writes
          delta under a causal mask) + dK/dV pass
  fused   the whole single-pass backward as launch_bwd_fused_sm90(out=) runs it: delta + zeroing dq_acc
          (one kernel, ``_delta_zero``) + fused kernel + dQ conversion
  dq, dkdv, kern   ms of the dQ pass, the dK/dV pass, the fused kernel alone (each on its own);
  kTF     the fused kernel alone in TFLOP/s (its 5 matmuls = the backward flops above)
  --variants: the fused whole backward with one switch away from the defaults (VARIANTS: sepz = the delta
          pass and torch's zero_ as two launches, dqfst / dqlast = the dQ product issued before / after dK
          (``DQ_FIRST``), lin = the grid's own CTA order (``HEAVY_FIRST`` off), defer = ``DEFER_DK`` on,
          st2 / st3 = a 2- / 3-deep Q/dO ring, flat = unswizzled dQ staging, atom = dQ by vector atomics
          (``DQ_ATOMIC``), atom3 = atomics and a 3-deep ring, seg / noseg = ``SEGMENTS`` on / off: GQA only),
          and with --order also the other query-tile order (``REVERSE``); --variants=a,b times only those
  --gqa: only the GQA config (where ``SEGMENTS`` matters)
  --baseline=MODULE: also fusedattn/backends/gluon/MODULE.py, another copy of bwd_fused_sm90 (e.g. the
          previous commit's, copied there for the run), with its defaults, as column "base:"
Every kernel is compiled first in parallel processes (small inputs of the same specialization), so the
serial timing loop finds them in Triton's cache.
Inputs physically BSHD. Also prints max |fused - 2pass| of dQ, dK, dV (dQ: atomics, not bitwise).
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fusedattn  # noqa: E402
from fusedattn.backends.gluon import bwd_dkdv_sm90 as DKDV  # noqa: E402
from fusedattn.backends.gluon import bwd_dq_sm90 as DQ  # noqa: E402
from fusedattn.backends.gluon import bwd_fused_sm90 as F  # noqa: E402
from fusedattn.backends.triton.bwd import launch_delta  # noqa: E402
from fusedattn.problem import make_problem  # noqa: E402

CONFIGS = [  # (b, h_q, h_kv, s, dtype, causal)
    (4, 32, 32, 2048, torch.bfloat16, True),
    (1, 32, 32, 16384, torch.bfloat16, True),
    (4, 32, 8, 4096, torch.bfloat16, True),
    (2, 16, 16, 8192, torch.bfloat16, False),
]


def bench(fn, rep=250):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


VARIANTS = {"sepz": dict(sepz=True), "dqfst": dict(dq_first=True), "dqlast": dict(dq_first=False),
            "lin": dict(heavy_first=False), "defer": dict(defer_dk=True, dq_first=True), "st2": dict(stages=2), "st3": dict(stages=3), "flat": dict(flat=True),
            "atom": dict(dq_atomic=True), "atom3": dict(dq_atomic=True, stages=3), "rot": dict(rotate=True),
            "seg": dict(segments=True), "noseg": dict(segments=False), "order": "flip"}


def _variant_kw(name, causal):
    if name.startswith("base:"):
        return dict(baseline=name[5:])
    kw = VARIANTS[name]
    return dict(reverse=not F.REVERSE[causal]) if kw == "flip" else dict(kw)


def _fused(p, q, k, v, do, out, lse, delta, dq, dk, dv, acc=None, sepz=False, baseline=None, **kw):
    """The whole single-pass backward: delta and the zeroing of dq_acc in one kernel (``out=``), or
    (sepz) the Triton delta pass and torch's zero_ as before; baseline: another copy of the module
    (fusedattn.backends.gluon.<baseline>, e.g. the previous commit's file) with its defaults, timed the
    old way (delta pass, then its launch_bwd_fused_sm90 with delta)."""
    if baseline:
        import importlib
        mod = importlib.import_module(f"fusedattn.backends.gluon.{baseline}")
        launch_delta(p, out, do, delta)
        mod.launch_bwd_fused_sm90(p, q, k, v, do, lse, delta, dq, dk, dv, dq_acc=acc)
    elif sepz:
        launch_delta(p, out, do, delta)
        F.launch_bwd_fused_sm90(p, q, k, v, do, lse, delta, dq, dk, dv, dq_acc=acc, **kw)
    else:
        F.launch_bwd_fused_sm90(p, q, k, v, do, lse, delta, dq, dk, dv, out=out, dq_acc=acc, **kw)


def _inputs(b, h_q, h_kv, s, dt, causal, d=128):
    torch.manual_seed(0)
    q = torch.randn(b, s, h_q, d, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(b, s, h_kv, d, device="cuda", dtype=dt).transpose(1, 2)
    v = torch.randn(b, s, h_kv, d, device="cuda", dtype=dt).transpose(1, 2)
    do = torch.randn(b, s, h_q, d, device="cuda", dtype=dt).transpose(1, 2)
    out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True)
    p, _ = make_problem(q, k, v, causal=causal)
    return p, q, k, v, do, out, stats[..., 0]


def _warm(job):
    """Compile one config's kernels (same specialization at s=256) in this process: the two passes
    (name None) or one fused variant ("" for the defaults)."""
    cfg, name = job
    b, h_q, h_kv, s, dt, causal = cfg
    p, q, k, v, do, out, lse = _inputs(b, h_q, h_kv, 256, dt, causal)
    delta = torch.empty((b * h_q, 256), dtype=torch.float32, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launch_delta(p, out, do, delta)
    if name is None:
        DQ.launch_dq_sm90(p, q, k, v, do, lse, delta, dq, out=out if causal else None)
        DQ.launch_dq_sm90(p, q, k, v, do, lse, delta, dq)
        DKDV.launch_dkdv_sm90(p, q, k, v, do, lse, delta, dk, dv)
    else:
        _fused(p, q, k, v, do, out, lse, delta, dq, dk, dv, **(_variant_kw(name, causal) if name else {}))
    torch.cuda.synchronize()
    return job


def main():
    quick = "--quick" in sys.argv
    # --variants: all of VARIANTS ("order" with --order); --variants=a,b: those
    picked = [a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--variants=")]
    variants = "--variants" in sys.argv or bool(picked)
    base = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--baseline=")]
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__, flush=True)
    print("whole-backward TFLOP/s (2.5x fwd flops, /2 causal); dq/dkdv/kern: ms of each kernel alone")
    head = (f"{'config':34s} {'2pass':>6s} {'fused':>6s} {'f/2p':>6s} | {'dq ms':>6s} {'dkdv':>6s} {'kern':>6s} "
            f"{'kTF':>6s}")
    d = 128
    configs = CONFIGS[:2] if quick else CONFIGS
    if "--gqa" in sys.argv:
        configs = [c for c in CONFIGS if c[1] != c[2]]
    names = picked[0] if picked else [n for n in VARIANTS if n != "order" or "--order" in sys.argv] if variants else []
    names += [f"base:{b}" for b in base]
    if names:
        head += " |" + "".join(f" {n[:6]:>6s}" for n in names)
    print(head + " | max|d| dq dk dv (fused - 2pass)", flush=True)
    import concurrent.futures
    import multiprocessing
    jobs = [(c, n) for c in configs for n in [None, ""] + names]
    with concurrent.futures.ProcessPoolExecutor(min(len(jobs), 14),
                                                mp_context=multiprocessing.get_context("spawn")) as ex:
        list(ex.map(_warm, jobs))
    for b, h_q, h_kv, s, dt, causal in configs:
        p, q, k, v, do, out, lse = _inputs(b, h_q, h_kv, s, dt, causal)
        delta = torch.empty((b * h_q, s), dtype=torch.float32, device="cuda")
        dq2, dk2, dv2 = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dqf, dkf, dvf = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        acc = torch.empty((b, h_q, F.acc_rows(s), d), dtype=torch.float32, device="cuda")
        assert F.supports(p, q, k, v, do, dqf, dkf, dvf)

        def two_pass():
            if causal:
                DQ.launch_dq_sm90(p, q, k, v, do, lse, delta, dq2, out=out)
            else:
                launch_delta(p, out, do, delta)
                DQ.launch_dq_sm90(p, q, k, v, do, lse, delta, dq2)
            DKDV.launch_dkdv_sm90(p, q, k, v, do, lse, delta, dk2, dv2)

        def fused(**kw):
            _fused(p, q, k, v, do, out, lse, delta, dqf, dkf, dvf, acc=acc, **kw)

        flops = 2.5 * 4.0 * b * h_q * s * s * d * (0.5 if causal else 1.0)
        tf = lambda ms: flops / ms / 1e9  # noqa: E731
        two_pass()
        fused()
        torch.cuda.synchronize()
        errs = [(x.float() - y.float()).abs().max().item() for x, y in ((dqf, dq2), (dkf, dk2), (dvf, dv2))]
        res = {"2pass": bench(two_pass), "fused": bench(fused),
               "dq": bench(lambda: DQ.launch_dq_sm90(p, q, k, v, do, lse, delta, dq2)),
               "dkdv": bench(lambda: DKDV.launch_dkdv_sm90(p, q, k, v, do, lse, delta, dk2, dv2)),
               "kern": bench(lambda: F.launch_kernel(p, q, k, v, do, lse, delta, acc, dkf, dvf))}
        if names:
            for name in names:
                try:
                    res[name] = bench(lambda: fused(**_variant_kw(name, causal)))
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    print(f"   {name}: {type(e).__name__}: {str(e)[:200]}")
                    res[name] = float("nan")
        cfg = f"b{b} h{h_q}/{h_kv} s{s} d{d} {str(dt)[6:]} {'causal' if causal else 'full'}"
        line = (f"{cfg:34s} {tf(res['2pass']):6.1f} {tf(res['fused']):6.1f} {res['2pass'] / res['fused']:5.2f}x | "
                f"{res['dq']:6.3f} {res['dkdv']:6.3f} {res['kern']:6.3f} {tf(res['kern']):6.1f}")
        if names:
            line += " |" + "".join(f" {tf(res[n]):6.1f}" for n in names)
        line += f" | {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}"
        print(line + f"   (ms 2pass {res['2pass']:.3f} fused {res['fused']:.3f})", flush=True)


if __name__ == "__main__":
    main()
