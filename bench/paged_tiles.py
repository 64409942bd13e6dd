"""Lab probe (issue 25 item 3): the Gluon forward's key tile and ring depth over a paged K/V cache.

Pages of 16 keys read 0.92-0.93 of the contiguous cache in ``bench --configs prefill`` (b8 h32/8, 512 new
queries over 4096 cached keys, d128 bf16, causal bottom-right), pages of 64 0.98, against the 0.95 the issue
asks. The consumers see the same tiles at every page size; only the load warp's copies differ: a 128-key K
(or V) tile is 16 TMA copies of [16 keys, 64 columns] at pages of 16, 4 at pages of 64, 2 contiguous
(``fwd_sm90._paged_tile_gather``). Hypothesis: a tile's 16 small copies take longer from the first issue to
the last completion than the one tile of lead the 2-stage ring gives at 128 keys, so the consumers wait.
A 64-key tile in a 4-stage ring holds the same shared memory and gives 1.5 tiles-of-128 of lead with half
the copies per tile; a deeper ring on the one-tile grid (its Q takes half the shared memory) gives more.

    PYTHONPATH=$PWD python3 bench/paged_tiles.py [--rep MS] [--pages 0,16,32,64]

For each cache (contiguous, pages of P) and variant (BLOCK_N / STAGES / grid, passed to ``launch_fwd_sm90``
as its tuning overrides through ``attention_with_kvcache``, the bench's call), TFLOP/s (``bench.fwd_flops``,
do_bench median) and the max |difference| from the default variant's output on the same cache (the key
tile changes the summation order: a few bf16 steps at most). The varlen rows pack the same chunks
(cu_seqlens_q) as ``bench``'s "varlen" prefill configs.

Measured (H100 80GB HBM3, torch 2.11, Triton 3.6.0, session 22, ``--rep 100 --pages 0,16,32``), TFLOP/s and / the
contiguous cache's default:

    cache             default (persistent  n64/s4       tile n128/s2  tile n128/s3  tile n64/s4  tile n64/s5
                      n128/s2)
    contiguous        641.7  1.000         549.8 0.857  620.5 0.967   597.8 0.932   535.6 0.835  529.4 0.825
    pages of 16       582.2  0.907         505.8 0.788  559.0 0.871   575.5 0.897   503.2 0.784  513.9 0.801
    pages of 32       595.6  0.928         525.1 0.818  591.3 0.921   580.5 0.905   509.7 0.794  507.5 0.791
    varlen, pages 16  573.7  0.894         517.4 0.806  574.5 0.895   578.8 0.902   496.4 0.774  504.1 0.785

The hypothesis half held: a deeper ring helps pages of 16 on the one-tile grid (s3 575 against s2 559) and hurts
contiguous (598 against 621), so the small pages' copies do wait; but 64-key tiles cost 14-17% everywhere (twice
the barrier round trips and softmax steps per key), more than they give. The default stays; the fix was the load
warp's order instead (``fwd_sm90`` [Note] paged K/V: K of tile j before V of tile j - 1). Same probe after it,
``--rep 200 --pages 0,16,32,64 --variants default`` (a later call, another machine start): contiguous 604.5,
pages of 16 575.0 (0.951), 32 593.8 (0.982), 64 593.6 (0.982), varlen pages of 16 577.8 (0.956), 64 597.2 (0.988).

Session 23 (same GPU model, Triton 3.6.0, a fresh machine each call). One Q slot and a third K/V stage on the
persistent grid (``q1/s3``: 224 KB of shared memory; ``q1/s2`` isolates the Q slot): contiguous 613 / 621 against
640, pages of 16 577 / 577 against 599, pages of 64 602 / 606 against 613, varlen pages of 16 567 / 427 against
584: the deeper ring does not pay for the next tile's Q load it gives up. ``--in-order`` (pages 0, 1, 2 ... of
the same containers: the same bytes at the same addresses as the contiguous cache, only the copies differ),
``--rep 200 --pages 0,16,64 --variants default``: contiguous 613.4; pages of 16 584.8 (0.953) shuffled against
557.0 (0.908) in order, 64 601.7 (0.981) against 595.3 (0.970); varlen 16 577.8 (0.942) against 559.5
(0.912). So the per-copy cost of 16-key pages is ~9% with no address effect at all, and shuffled pages
recover half of it (their copies spread over more DRAM channels at once); the cost is the copies' number,
which a TMA gather cannot lower on Hopper (a 128-byte-swizzled box holds 64 columns: two copies per page).
FlashAttention-3 takes TMA for paged K/V only when the page is a multiple of its key tile, and cp.async loads
by the producer warpgroup otherwise (``PagedKVNonTMA``): the next step for pages under 64 keys.

Session 24: if one warp issuing 32 copies a step is the limit, two warps issuing 16 each remove it. A second load
warp (``fwd_sm90.V_WARP``: V's copies, following the producer's work tiles; "default" below) against the one load
warp ("one load warp", ``v_warp=False``), ``--rep 200``, one process each, three calls (two machines; Triton 3.6.0
in the first and third, 3.9.0 in the second), TFLOP/s / the contiguous default:

    cache                 3.6 (1)          3.6 (2)          3.9
                          V warp  one      V warp  one      V warp  one
    contiguous            1.000   1.004    1.000   0.996    1.000   0.992
    pages of 16           0.987   0.955    0.983   0.949    0.957   0.945
    pages of 32           0.986   0.968      -       -        -       -
    pages of 64           0.993   0.984    0.983   0.981    0.979   0.987
    varlen, pages of 16   0.968   0.980    0.954   0.928    0.940   0.949
    varlen, pages of 64   0.982   0.979    0.971   0.966    0.973   0.982

Session 25 (bench/NOTES.md 64), ``--pages 0,16,64,256 --variants default,one_load_warp,tile_n128/s2 --rep 100``,
Triton 3.9.0 then 3.6.0 in one call, / the contiguous default: pages of 16 V warp 0.884 / one warp 0.915 / one-tile
grid 0.928 on 3.9 against 0.945 / 0.960 / 0.796 on 3.6; pages of 64 0.885 / 0.960 / 0.936 against 0.979 / 0.971
/ 0.953; pages of 256 0.950 / 0.950 / 0.998 against 0.983 / 0.969 / 0.982. Two more V warp / one warp rounds on
3.9.0: one warp +2.4 / +3.7% at 16, +3.4 / +3.2% at 64. So ``PAGED_V_WARP`` is off from Triton 3.9.

Session 24: predicted +2-5% at pages of 16; measured +1.2 to +3.4% there (0.949-0.955 -> 0.957-0.987), within +-1% at pages
of 64, mixed for the packed varlen rows (-1.2% to +2.8%). Every output bit-identical (max diff 0). Taken as the
default for pages smaller than a tile on the persistent grid.
"""
import argparse
import functools
from dataclasses import replace

import torch
import triton

import fusedattn
from fusedattn import bench
from fusedattn.backends.gluon import fwd_sm90

# name: launch_fwd_sm90 overrides (None: the defaults, the persistent grid with 128-key tiles, 2 stages);
# "qstages" is not an argument of the launcher: the probe sets fwd_sm90.QSTAGES for the call instead
VARIANTS = {
    "default": {},
    "one load warp": dict(v_warp=False),
    "q1/s3": dict(stages=3, qstages=1),
    "q1/s2": dict(qstages=1),
    "n64/s4": dict(block_n=64, stages=4),
    "tile n128/s2": dict(persistent=False),
    "tile n128/s3": dict(persistent=False, stages=3),
    "tile n64/s4": dict(persistent=False, block_n=64, stages=4),
    "tile n64/s5": dict(persistent=False, block_n=64, stages=5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    ap.add_argument("--pages", default="0,16,32,64", help="page sizes (0: contiguous)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--in-order", action="store_true",
                    help="also each paged cache with its pages in order (page table 0, 1, 2 ...: the same copies, "
                         "sequential addresses) beside the shuffled one")
    args = ap.parse_args()
    real = fwd_sm90.launch_fwd_sm90
    base = [c for c in bench.prefill_configs() if c.mask != "varlen" and c.page_block == 0][0]
    cfgs = [replace(base, page_block=int(p)) for p in args.pages.split(",")]
    cfgs += [replace(c, mask="varlen") for c in cfgs if c.page_block in (16, 64)]
    runs = [(c, False) for c in cfgs] + [(c, True) for c in cfgs if args.in_order and c.page_block]
    contiguous = None
    print(f"{'config':62s} {'variant':14s} {'TFLOP/s':>8s} {'/ contig':>8s} {'max diff':>9s}")
    for cfg, in_order in runs:
        shuffle = torch.randperm
        if in_order:        # bench._add_paged_cache shuffles the pages with torch.randperm
            torch.randperm = lambda n, **kw: torch.arange(n, **{k: x for k, x in kw.items() if k != "generator"})
        try:
            inp = bench.make_inputs(cfg, "cuda")
        finally:
            torch.randperm = shuffle
        label = cfg.name + (" in-order" if in_order else "")
        x = inp.extra
        if cfg.mask == "varlen":
            q = inp.q.transpose(1, 2).reshape(cfg.b * cfg.s_q, cfg.h_q, cfg.d)
            cu = torch.arange(0, cfg.b + 1, dtype=torch.int32, device="cuda") * cfg.s_q
            call = functools.partial(fusedattn.attention_with_kvcache, q, x.get("k_cache", inp.k),
                                     x.get("v_cache", inp.v), page_table=x.get("page_table"),
                                     seq_len_kv=x.get("seq_len_kv"), cu_seqlens_q=cu, max_seqlen_q=cfg.s_q,
                                     causal=True, validate=False)
        elif cfg.page_block:
            call = functools.partial(fusedattn.attention_with_kvcache, inp.q, x["k_cache"], x["v_cache"],
                                     page_table=x["page_table"], seq_len_kv=x["seq_len_kv"], causal=True,
                                     validate=False)
        else:
            call = functools.partial(fusedattn.attention_with_kvcache, inp.q, inp.k, inp.v, causal=True,
                                     validate=False)
        ref = None
        # '_' stands for ' ' in variant names (run_device.sh passes $PAGED_TILES_ARGS unquoted)
        for name in (v.replace("_", " ") for v in args.variants.split(",")):
            launched = []

            def patched(p, *a, _kw=VARIANTS[name], **kw):
                launched.append(1)
                return real(p, *a, **{**kw, **{n: x for n, x in _kw.items() if n != "qstages"}})

            fwd_sm90.launch_fwd_sm90 = patched
            qstages = dict(fwd_sm90.QSTAGES)
            fwd_sm90.QSTAGES[128] = VARIANTS[name].get("qstages", qstages[128])
            try:
                out = call()
                torch.cuda.synchronize()
                if not launched:
                    print(f"{label:62s} {name:14s} not the Gluon forward")
                    break
                ms = triton.testing.do_bench(call, warmup=25, rep=args.rep)
            except Exception as e:  # a ring that does not fit: report and go on
                print(f"{label:62s} {name:14s} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            finally:
                fwd_sm90.launch_fwd_sm90 = real
                fwd_sm90.QSTAGES.update(qstages)
            tf = bench.fwd_flops(cfg) / ms / 1e9
            if cfg.page_block == 0 and cfg.mask != "varlen" and name == "default":
                contiguous = tf
            ref = out if ref is None else ref
            diff = (out.float() - ref.float()).abs().max().item()
            print(f"{label:62s} {name:14s} {tf:8.1f} {tf / contiguous:8.3f} {diff:9.2e}", flush=True)


if __name__ == "__main__":
    main()
