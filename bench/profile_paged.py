"""Lab probe (issue 25 item 3): one paged-prefill forward per cache, for Nsight Compute.

On Triton 3.9 the persistent Gluon forward over pages of 16 reads 0.91 of the contiguous cache (bench/NOTES.md
65), on 3.6 0.97: the load warp's loop and the consumers' loops are the same instructions on both releases
(``tools/gluon_check.py paged 16 128 persistent``), so the difference is in how they run. This probe runs the
``bench --configs prefill`` problems (b8, h 32/8, 512 new queries over 4096 cached keys, d128 bf16, causal
bottom-right), each cache once under ``cudaProfilerStart``/``Stop`` (ncu ``--profile-from-start off``) after
two warm-up calls, with an NVTX range named after it:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section SourceCounters ... python3 bench/profile_paged.py [--pages 0,16,64] [--varlen]

``run_device.sh ncu-paged`` runs it (the report, details and per-instruction source counters in
$OUT/ncu-paged/); with a Triton pack carried, once per release (``TRITON_PACK``) compares 3.6 against 3.9.
What to read: per kernel, the duration and tensor-pipe share; in the SASS source page, the stall samples of
the load warp's barrier waits (``SYNCS.PHASECHK``: the ring is full, the consumers are behind) against the
consumers' waits on ``k_ready`` / ``v_ready`` (the copies are behind), and of the copies' own issue
(``UTMALDG``), per release.
"""
import argparse
from dataclasses import replace

import torch
import triton

from fusedattn import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", default="0,16,64", help="page sizes (0: the contiguous cache)")
    ap.add_argument("--varlen", action="store_true", help="also the packed (varlen) queries over each paged cache")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    base = [c for c in bench.prefill_configs() if c.mask != "varlen" and c.page_block == 0][0]
    cfgs = [replace(base, page_block=int(p)) for p in args.pages.split(",")]
    if args.varlen:
        cfgs += [replace(c, mask="varlen") for c in cfgs if c.page_block]
    for cfg in cfgs:
        inp = bench.make_inputs(cfg, "cuda")
        call = bench.prepare_ours(cfg, False)(inp).fwd     # the bench's own call for the config
        for _ in range(2):      # the first call loads the shipped kernel (or compiles it)
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.nvtx.range_push(cfg.name)
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled: {cfg.name}", flush=True)
        del inp, call
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
