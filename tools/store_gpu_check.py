"""Run the shipped kernel store of this Triton on the GPU, against the JIT, call by call.

``tools/store_rebuild.py`` builds a store without a GPU; its ``--check`` compares SASS with a GPU recording.
This is the other half: every call ``python -m fusedattn warmup`` makes (the benchmark's anchors, masks,
decode and paged prefill configurations, ``bench --cold-start``'s call, the packed varlen batches, the long
d=64 calls), run for real in two fresh processes, each with an empty Triton cache:

* ``store``: the shipped store on (``fusedattn/prebuilt/triton-VERSION-sm90``). Every kernel launch must be
  served from it: ``prebuilt.stats["misses"]`` empty (a miss compiles, so the first call would stall);
* ``jit``: ``FUSEDATTN_PREBUILT=0``, every kernel compiled by Triton's JIT here (``warmup`` first, so that
  they compile side by side).

Both draw the same seeded inputs. Each output and gradient is compared: no NaN in either, the same float64
sum within a tolerance, and a strided sample of 65536 elements equal within 1e-2 relative (bitwise equality
is reported, not required: the non-deterministic backward adds dQ in any order). Exit status 1 on any miss
or mismatch.

    python tools/store_gpu_check.py            # both processes, the comparison (about 2-4 minutes on an H100)
    python tools/store_gpu_check.py --only b8-h12-s1024,first-call

Measured (H100, torch 2.11, bench/NOTES.md 63). Triton 3.6.0, the GPU-recorded store of session 23: 33 calls, every
output as the JIT's, but 14 misses (``_attn_fwd``, ``_attn_fwd_sm90``): the inference forwards (no_grad, no stats:
a specialization of their own), which ``warmup`` did not run; the first of them cost a 9 s call. ``warmup`` now
runs them. Triton 3.9.0 (the carried pack), its store built with no GPU (``tools/store_rebuild.py
--launches-from`` the new 3.6.0 recording): 122 hits, 0 misses, 33 calls ok, every output as the JIT's
(the samples bit-equal in 89 of 98 tensors, the others within the non-deterministic backward's order).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

SAMPLE = 65536


def _fingerprint(t):
    """What the comparison needs of one tensor, small enough to pass between processes."""
    import torch
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLE)
    sample = flat[::step][:SAMPLE].float().cpu()
    return {"shape": list(t.shape), "dtype": str(t.dtype), "nan": int(torch.isnan(flat.float()).sum()),
            "sum": float(flat.double().sum()), "abs": float(flat.double().abs().sum()),
            "sample": sample}


def _calls(only):
    """warmup's calls (``fusedattn.warmup.calls``), those whose name contains one of ``only`` if given."""
    from fusedattn import warmup
    todo = warmup.calls()
    return [(n, f) for n, f in todo if any(o in n for o in only)] if only else todo


def child(out_path, only):
    import torch
    from fusedattn.backends import prebuilt
    import triton
    result = {"calls": {}, "triton": triton.__version__}
    start = time.perf_counter()
    for i, (name, thunk) in enumerate(_calls(only)):
        torch.manual_seed(1000 + i)
        t0 = time.perf_counter()
        outs = [o for o in thunk() if isinstance(o, torch.Tensor)]
        torch.cuda.synchronize()
        result["calls"][name] = {"seconds": time.perf_counter() - t0, "tensors": [_fingerprint(o) for o in outs]}
        print(f"  {name}: {len(outs)} tensors, {time.perf_counter() - t0:.2f} s", flush=True)
    result["seconds"] = time.perf_counter() - start
    result["hits"], result["misses"] = prebuilt.stats["hits"], list(prebuilt.stats["misses"])
    torch.save(result, out_path)


def _spawn(mode, out_path, only):
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix=f"store-check-{mode}-"))
    if mode == "store":
        env["FUSEDATTN_PREBUILT_DEBUG"] = "1"       # each miss with its specialization on stderr
    if mode == "jit":
        env["FUSEDATTN_PREBUILT"] = "0"
        # the JIT's compiles on a pool of threads first (warmup, into this process's empty cache): the timed
        # child then loads them, as the store process loads the store's
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fusedattn", "warmup"], env=env, check=True)
        print(f"jit: warmup compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    cmd = [sys.executable, __file__, "--child", out_path] + (["--only", ",".join(only)] if only else [])
    print(f"{mode}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    import torch
    return torch.load(out_path)


def _compare(a, b):
    """'' when the two fingerprints agree, else why not; and whether the samples are bit-equal."""
    import torch
    if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
        return f"shape/dtype {a['shape']} {a['dtype']} vs {b['shape']} {b['dtype']}", False
    if a["nan"] or b["nan"]:
        return f"NaN: {a['nan']} (store) / {b['nan']} (jit)", False
    sa, sb = a["sample"], b["sample"]
    scale = max(float(sb.abs().max()), 1e-6)
    if not torch.allclose(sa, sb, rtol=1e-2, atol=1e-2 * scale):
        return f"sample differs: max |store - jit| {float((sa - sb).abs().max()):.3g} (scale {scale:.3g})", False
    if abs(a["sum"] - b["sum"]) > 1e-2 * max(a["abs"], b["abs"], 1e-6):
        return f"sum differs: {a['sum']:.6g} vs {b['sum']:.6g}", False
    return "", bool(torch.equal(sa, sb))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", metavar="OUT")
    ap.add_argument("--only", default="", help="comma-separated substrings of call names")
    args = ap.parse_args()
    only = [o for o in args.only.split(",") if o]
    if args.child:
        return child(args.child, only)
    tmp = tempfile.mkdtemp(prefix="store-check-")
    store = _spawn("store", os.path.join(tmp, "store.pt"), only)
    jit = _spawn("jit", os.path.join(tmp, "jit.pt"), only)
    failures = []
    print(f"\nTriton {store['triton']}: store process {store['seconds']:.1f} s ({store['hits']} hits, "
          f"{len(store['misses'])} misses), JIT process {jit['seconds']:.1f} s")
    if store["misses"]:
        failures.append(f"kernels missing from the store (compiled instead): {sorted(set(store['misses']))}")
    print(f"{'call':40s} {'store s':>8s} {'jit s':>8s}  tensors  bit-equal  result")
    for name, sc in store["calls"].items():
        jc = jit["calls"][name]
        why, equal = [], 0
        for i, (a, b) in enumerate(zip(sc["tensors"], jc["tensors"])):
            w, eq = _compare(a, b)
            equal += eq
            if w:
                why.append(f"tensor {i}: {w}")
        if len(sc["tensors"]) != len(jc["tensors"]):
            why.append(f"{len(sc['tensors'])} tensors vs {len(jc['tensors'])}")
        print(f"{name:40s} {sc['seconds']:8.2f} {jc['seconds']:8.2f}  {len(sc['tensors']):7d}  {equal:9d}  "
              f"{'ok' if not why else '; '.join(why)}")
        failures += [f"{name}: {w}" for w in why]
    print("\n" + ("FAILED:\n  " + "\n  ".join(failures) if failures else
                  f"ok: {len(store['calls'])} calls, every launch from the store, outputs as the JIT's"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
