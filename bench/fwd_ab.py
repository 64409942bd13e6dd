"""A/B of the Gluon sm_90 forward: this tree's ``fwd_sm90`` against a baseline copy, same inputs, one run.

    python3 bench/fwd_ab.py [--baseline MODULE] [--configs NAME,...] [--rep MS] [--rounds N]
    ncu --profile-from-start off --kernel-name regex:_attn_fwd_sm90 -o R python3 bench/fwd_ab.py --profile [same args]
    ncu --import R.ncu-rep --page raw --csv > raw.csv; python3 bench/fwd_ab.py --cycles raw.csv [same args]

MODULE: a file fusedattn/backends/gluon/MODULE.py holding another version of fwd_sm90 (e.g. the
previous commit's: ``git show HEAD~1:fusedattn/backends/gluon/fwd_sm90.py > .../fwd_base.py``);
without it only this tree's kernel is timed. Each config is timed in ``--rounds`` alternating
rounds (base, new, base, new ...: drifting clocks hit both), medians of triton.testing.do_bench,
as TFLOP/s over the unmasked work (causal: half; window (left, 0): the band; padding: sum over the
batch of each sequence's own work). Also printed: max |new - base| of the output and LSE, our
Triton forward on the same call, and for the small d=64 configs the CUDA-graph replay time of the
new kernel (launch cost out), to tell a host-bound row from a slow kernel. Variants per config
(``VARIANTS``): "tile" forces the one-tile grid, "pers" the persistent one. --profile / --cycles: one call
of each Gluon build under Nsight Compute instead, and its elapsed cycles (``run_device.sh ncu-fwd-ab``).

Measured with --profile / --cycles (session 40, H100, bench/NOTES.md 80): the load warp's K-ahead order against
K and V together, base / new on Triton 3.6.0 | 3.9.0: d224 1.084 | 1.121, d256 causal 1.056 | 1.039, d128 2k causal
1.033 | 1.028, 8k 0.997 | 0.994, 16k causal 0.993 | 1.001, GQA 4k causal 0.982 | 0.998, d64 1.001 | 0.999.
"""
import argparse
import importlib
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fusedattn.backends.gluon import fwd_sm90 as NEW  # noqa: E402
from fusedattn.backends.triton.fwd import launch_fwd  # noqa: E402
from fusedattn.bench import _band_pairs  # noqa: E402
from fusedattn.plan import plan  # noqa: E402
from fusedattn.problem import make_problem  # noqa: E402
from ncu_raw import kernel_metrics  # noqa: E402  (this folder is on sys.path when run as a script)

CONFIGS = {  # name: (b, h_q, h_kv, s, d, dtype, make_problem keywords, lengths)
    "b4-s2k-d128-c": (4, 32, 32, 2048, 128, "bf16", dict(causal=True), None),
    "b1-s16k-d128-c": (1, 32, 32, 16384, 128, "bf16", dict(causal=True), None),
    "b4-gqa-s4k-d128-c": (4, 32, 8, 4096, 128, "bf16", dict(causal=True), None),
    "b2-s8k-d128": (2, 16, 16, 8192, 128, "bf16", {}, None),
    "b8-s1k-d64-fp16": (8, 12, 12, 1024, 64, "fp16", {}, None),
    "b8-s1k-d64-fp16-c": (8, 12, 12, 1024, 64, "fp16", dict(causal=True), None),
    "b4-s4k-d256-c": (4, 16, 16, 4096, 256, "bf16", dict(causal=True), None),
    "b32-s2k-d224-fp16": (32, 32, 32, 2048, 224, "fp16", {}, None),
    "alibi-b4-s2k-d128-c": (4, 32, 32, 2048, 128, "bf16", dict(causal=True, alibi=True), None),
    "window-b2-s8k-d128": (2, 16, 16, 8192, 128, "bf16", dict(window=(1024, 0)), None),
    "pad-b4-s2k-d128-c": (4, 32, 32, 2048, 128, "bf16", dict(causal=True), (2048, 1536, 1024, 512)),
}
VARIANTS = {"alibi-b4-s2k-d128-c": {"tile": dict(persistent=False), "pers": dict(persistent=True)},
            "window-b2-s8k-d128": {"tile": dict(persistent=False), "pers": dict(persistent=True)}}


def work(cfg) -> float:
    """Forward FLOPs of the unmasked work (``fusedattn.bench``'s count: causal half, the band of a window)."""
    b, hq, _, s, d, _, kw, lens = cfg
    window = kw["window"][0] if "window" in kw else 0
    causal = kw.get("causal", False) or bool(window)
    return 4.0 * hq * d * sum(_band_pairs(n, n, causal, window) for n in (lens or [s] * b))


def _labels(args):
    """(config, call) in the order --profile runs them: per config base then new, each per variant."""
    tags = ("base", "new") if args.baseline else ("new",)
    return [(name, f"{tag}{'-' + vname if vname else ''}") for name in args.configs.split(",") for tag in tags
            for vname in VARIANTS.get(name, {"": {}})]


def cycles(path, labels) -> None:
    """Each profiled forward's elapsed cycles (``ncu_raw``) and new's ratio of base's (> 1: new is faster)."""
    cyc = {lab: c for lab, (c, ) in zip(labels, kernel_metrics(path, "_attn_fwd_sm90", len(labels)))}
    for (name, key), c in cyc.items():
        base = cyc.get((name, "base" + key[3:])) if key.startswith("new") else None
        print(f"{name:20s} {key:10s} {c / 1e6:8.4f} M cycles" + (f"  base / new {base / c:.4f}" if base else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="no timing: each Gluon call once between cudaProfilerStart / Stop, for ncu")
    ap.add_argument("--cycles", metavar="RAW_CSV", help="print the elapsed cycles of a --profile run's ncu raw page")
    args = ap.parse_args()
    if args.cycles:
        return cycles(args.cycles, _labels(args))
    base = importlib.import_module(f"fusedattn.backends.gluon.{args.baseline}") if args.baseline else None
    print(f"{torch.cuda.get_device_name()}: Gluon forward, this tree (new) vs {args.baseline or 'nothing'} (base), "
          f"TFLOP/s of unmasked work, median over {args.rounds} rounds", flush=True)
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        b, hq, hkv, s, d, dt, kw, lens = cfg
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        torch.manual_seed(0)
        mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)  # noqa: E731
        q, k, v = mk(hq), mk(hkv), mk(hkv)
        seq = {}
        if lens is not None:
            t = torch.tensor(lens, device="cuda", dtype=torch.int32)
            seq = dict(seq_len_q=t, seq_len_kv=t)
        p, extras = make_problem(q, k, v, **kw, **seq)
        opts = dict(slopes=extras["slopes"], seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"])
        outs = {}
        fns = {}
        for tag, mod in (("base", base), ("new", NEW)):
            if mod is None:
                continue
            for vname, vkw in VARIANTS.get(name, {"": {}}).items():
                out, lse = torch.empty_like(q), torch.empty((b, hq, s), device="cuda", dtype=torch.float32)
                key = f"{tag}{'-' + vname if vname else ''}"
                fns[key] = (lambda mod=mod, out=out, lse=lse, vkw=vkw:
                            mod.launch_fwd_sm90(p, q, k, v, out, lse, **opts, **vkw))
                fns[key]()
                outs[key] = (out, lse)
        if args.profile:
            for key, fn in fns.items():
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled: {name}: {', '.join(fns)}", flush=True)
            continue
        tri_out, tri_lse = torch.empty_like(q), torch.empty((b, hq, s), device="cuda", dtype=torch.float32)
        fns["triton"] = lambda: launch_fwd(p, plan(p, "triton").fwd, q, k, v, tri_out, tri_lse, extras)
        fns["triton"]()
        torch.cuda.synchronize()
        times = {key: [] for key in fns}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                times[key].append(triton.testing.do_bench(fn, rep=args.rep, return_mode="median"))
        tf = {key: work(cfg) / statistics.median(ts) / 1e9 for key, ts in times.items()}
        row = "  ".join(f"{key} {val:.0f}" for key, val in tf.items())
        diffs = []
        for key, (out, lse) in outs.items():
            if key.startswith("new"):
                ref = outs.get("base" + key[3:], (tri_out, tri_lse))
                if lens is not None:
                    valid = torch.arange(s, device="cuda")[None, None, :] < torch.tensor(lens, device="cuda")[:, None, None]
                    do = (out - ref[0]).float().abs()[valid.unsqueeze(-1).expand_as(out)].max().item()
                else:
                    do = (out - ref[0]).float().abs().max().item()
                diffs.append(f"{key} |dO| {do:.1e}")
        ratio = ""
        if base is not None:
            ratio = "  new/base " + ", ".join(f"{tf[key] / tf['base' + key[3:]]:.3f}" for key in tf if key.startswith("new"))
        graph = ""
        if d == 64:
            ms = triton.testing.do_bench_cudagraph(fns["new"], rep=args.rep, return_mode="median")
            msg = triton.testing.do_bench_cudagraph(fns["triton"], rep=args.rep, return_mode="median")
            graph = f"  graph: new {work(cfg) / ms / 1e9:.0f} triton {work(cfg) / msg / 1e9:.0f}"
        print(f"{name}: {row}{ratio}{graph}; {'; '.join(diffs)}", flush=True)


if __name__ == "__main__":
    main()
