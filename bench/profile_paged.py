"""Lab probe (issue 25 item 3): one paged-prefill forward per cache (and per load-warp variant), for Nsight Compute.

On Triton 3.9 the persistent Gluon forward over pages of 16 reads 0.91 of the contiguous cache (bench/NOTES.md
65), on 3.6 0.97: the load warp's loop and the consumers' loops are the same instructions on both releases
(``tools/gluon_check.py paged 16 128 persistent``), so the difference is in how they run. This probe runs the
``bench --configs prefill`` problems (b8, h 32/8, 512 new queries over 4096 cached keys, d128 bf16, causal
bottom-right), each cache once under ``cudaProfilerStart``/``Stop`` (ncu ``--profile-from-start off``) after
two warm-up calls, with an NVTX range named after it:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section SourceCounters ... python3 bench/profile_paged.py [--pages 0,16,64] [--varlen] [--v-warp 0,1]
    ncu --import R.ncu-rep --page raw --csv > raw.csv; python3 bench/profile_paged.py --cycles raw.csv [same args]

``run_device.sh ncu-paged`` runs it (the report, details and per-instruction source counters in
$OUT/ncu-paged/); with a Triton pack carried, once per release (``TRITON_PACK``) compares 3.6 against 3.9.
What to read: per kernel, the duration and tensor-pipe share; in the SASS source page, the stall samples of
the load warp's barrier waits (``SYNCS.PHASECHK``: the ring is full, the consumers are behind) against the
consumers' waits on ``k_ready`` / ``v_ready`` (the copies are behind), and of the copies' own issue
(``UTMALDG``), per release.

--v-warp 0,1 profiles each paged cache once per value of ``fwd_sm90.PAGED_V_WARP`` (V's copies from a second load
warp, on by default before Triton 3.9; bench/NOTES.md 64-66 timed it both ways with do_bench and read rows that
move 5-15% between calls). ``run_device.sh ncu-paged-ab`` profiles with SpeedOfLight alone and prints, with
--cycles, each kernel's elapsed cycles (``gpc__cycles_elapsed.max``, repeatable to ~0.1%, bench/NOTES.md 78)
and its ratio to the contiguous cache's: the measure that settles the load-warp choice per release.

Measured (session 40, H100, bench/NOTES.md 80), contiguous / this cache, one load warp | the V warp: Triton 3.6.0
pages of 16 0.936 | 0.962, 64 0.976 | 0.989; Triton 3.9.0 pages of 16 0.884 | 0.860, 64 0.919 | 0.881 (contiguous
0.675 M cycles on 3.6.0, 0.700 M on 3.9.0). So each release's shipped ``PAGED_V_WARP`` is its faster choice.
"""
import argparse
from dataclasses import replace

import torch
import triton

from fusedattn import bench
from fusedattn.backends.gluon import fwd_sm90
from ncu_raw import kernel_metrics  # this folder is on sys.path when run as a script


def _runs(args):
    """(label, config, V_WARP or None) in profiling order: the contiguous cache first, then each paged cache
    (and its packed queries with --varlen) once per --v-warp value."""
    base = [c for c in bench.prefill_configs() if c.mask != "varlen" and c.page_block == 0][0]
    cfgs = [replace(base, page_block=int(p)) for p in args.pages.split(",")]
    if args.varlen:
        cfgs += [replace(c, mask="varlen") for c in cfgs]
    warps = [None] if args.v_warp is None else [bool(int(w)) for w in args.v_warp.split(",")]
    runs = []
    for cfg in cfgs:
        for w in ([None] if cfg.page_block == 0 else warps):
            label = f"{'varlen ' if cfg.mask == 'varlen' else ''}pages {cfg.page_block or '-'}" \
                + ("" if w is None else f" v_warp={int(w)}")
            runs.append((label, cfg, w))
    return runs


def cycles(path, labels) -> None:
    """Each profiled forward's elapsed cycles (``ncu_raw``), in profiling order, and its ratio to the contiguous
    cache's with the same queries (padded or packed, "contiguous / this": < 1 means slower than contiguous); packed
    rows also to the padded contiguous cache's."""
    base = {}
    for label, (cyc, ) in zip(labels, kernel_metrics(path, "_attn_fwd_sm90", len(labels))):
        packed = label.startswith("varlen")
        base.setdefault(packed, cyc)
        line = f"{label:26s} {cyc / 1e6:8.4f} M cycles  contiguous / this {base[packed] / cyc:.3f}"
        if packed and False in base:
            line += f"  (padded contiguous / this {base[False] / cyc:.3f})"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", default="0,16,64", help="page sizes (0: the contiguous cache)")
    ap.add_argument("--varlen", action="store_true", help="also the packed (varlen) queries over each cache")
    ap.add_argument("--v-warp", default=None, help="comma list of PAGED_V_WARP values to profile (0,1); default: as shipped")
    ap.add_argument("--cycles", metavar="RAW_CSV", help="print the elapsed cycles of a profile made with the same args")
    args = ap.parse_args()
    runs = _runs(args)
    if args.cycles:
        return cycles(args.cycles, [label for label, _, _ in runs])
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "PAGED_V_WARP", fwd_sm90.PAGED_V_WARP,
          flush=True)
    shipped = fwd_sm90.PAGED_V_WARP
    for label, cfg, v_warp in runs:
        fwd_sm90.PAGED_V_WARP = shipped if v_warp is None else v_warp
        inp = bench.make_inputs(cfg, "cuda")
        call = bench.prepare_ours(cfg, False)(inp).fwd     # the bench's own call for the config
        for _ in range(2):      # the first call loads the shipped kernel (or compiles it)
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.nvtx.range_push(label)
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled: {label}", flush=True)
        del inp, call
        torch.cuda.empty_cache()
    fwd_sm90.PAGED_V_WARP = shipped


if __name__ == "__main__":
    main()
