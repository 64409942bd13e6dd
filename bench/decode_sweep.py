"""Decode tile / split sweep on the GPU: K/V TB/s per (config, cache, tile, splits).

    python bench/decode_sweep.py            # bf16 caches: the sweep behind decode_tiles' H100 choice
    python bench/decode_sweep.py --fp8      # e4m3 caches (issue 27 item 4), TB/s of the FP8 bytes

What it measured (H100): bf16 caches, 128-key tiles / 4 warps / 2 stages read 2.80-3.02 TB/s
(contiguous) and 2.87-2.98 (pages of 16/64) against a 3.00 TB/s copy; that is decode_tiles' choice.
An e4m3 cache on the same tile read 2.16 / 1.68 / 2.22 TB/s of FP8 bytes (session 19, bench --configs
fp8: 0.72 / 0.56 / 0.74 of the copy; the issue asks 0.9). An FP8 tile carries half the bytes, so the
--fp8 candidates double the bytes in flight (256-key tiles, or 4 stages) and use 8 warps, where ptxas
(tools/decode_aot_check.py, Triton 3.6, bf16 q) reports no spill: 128/8w/2st 242 regs, 128/8w/4st
178, 256/8w/2st 249, 256/8w/3st 248 (the 4-warp tiles spill 16-48 bytes contiguous).

Session 29 (H100, Triton 3.6.0, after the fp16-operand change of bench/NOTES.md 67-68), --fp8, splits=None, TB/s,
b64 h32/8 kv4k contiguous / pages of 16 / 64, then b8 h32 kv16k contiguous / 16 / 64:
128/4w/2st (decode_tiles' choice) 2.55 / 2.20 / 2.33, 2.69 / 2.36 / 2.46; 128/8w/4st 2.17 / 1.39 / 1.44, 2.40 /
1.47 / 1.48; 256/8w/3st 2.11 / 1.40 / 1.43, 2.41 / 1.43 / 1.45; 64/8w/4st 2.25 / 1.66 / 1.69,
2.42 / 1.75 / 1.77; 128/8w/2st and 256/8w/2st 1.3-1.7. Splits 2 / 4 lower everywhere. Every 8-warp tile loses
(a 16-row tile split over 8 warps reduces its softmax rows across warps). Not yet timed: 4-warp tiles with
fewer registers, so that 3 programs fit an SM instead of 2 (ptxas, Triton 3.6, bf16 q, e4m3: 128/4w/2st
contiguous 255 registers, paged 208; 64/4w/3st and 64/4w/4st contiguous 168, no spill; 64/4w/2st paged 150;
32/4w/4st 166; 128/4w/2st capped at 168 (Triton's maxnreg, the fourth --tiles field) 68 bytes of spill,
outside the unmasked step: 980 instructions against 968):

    python bench/decode_sweep.py --fp8 --splits none --tiles 128/4/2,128/4/2/168,64/4/2,64/4/3,64/4/4,32/4/4

Session 30 ran it, TB/s, b64 h32/8 kv4k contiguous / pages of 16 / 64, then b8 h32 kv16k the same. On an H200
(Triton 3.6.0): 128/4w/2st 2.54 / 2.32 / 2.44, 2.92 / 2.48 / 2.57; capped at 168 registers 2.48 / 2.08 / 2.11,
2.88 / 2.33 / 2.35; 64/4w/2st 2.10 / 1.78 / 1.78, 2.19 / 1.85 / 1.90; 64/4w/3st 2.71 / 1.85 / 1.89, 2.88 /
1.96 / 1.98; 64/4w/4st 2.67 / 1.85 / 1.89, 2.90 / 1.96 / 1.98; 32/4w/4st 2.68 / 1.24 / 1.25, 2.17 / 1.33 / 1.34.
On an H100 (3.6.0, contiguous only; splits none / 2): 128/4w/2st 2.54 / 2.39, 2.69 / 2.62; 64/4w/3st 1.98 / 2.37,
2.79 / 2.05; 64/4w/4st 2.35 / 2.42, 2.82 / 2.44. So the 64-key tiles' third program per SM pays on the H200 at b64
(+7%) and loses on the H100 (-8 to -22%); paged, every 64-key tile loses by 20-25% (the row gather costs per key,
not per byte). The 128-key tile stays (bench/NOTES.md 69).

Session 35 (H200, Triton 3.6.0 / 3.9.0; V read as int16 pairs, ``--pairs on,off`` times both routes; bench/NOTES.md
74), TB/s of e4m3 bytes against a 4.22 TB/s copy: b64 contiguous 128/4w/2st bytes 2.78 -> pairs 2.90-3.02,
64/4w/3st pairs 3.73-3.85 (now ``decode.FP8_TILE``, four per SM), kv16k 128/4w/3st pairs 4.15-4.27 (``FP8_TILE_FEW``),
kv16k paged 256/4w/2st 3.68-3.77; ``--tiles default`` times the planner's own choice:

    python bench/decode_sweep.py --fp8 --pairs on,off --splits none --configs 0,1,2 --tiles default,128/4/2

Session 36 (H200, Triton 3.6.0; bench/NOTES.md 76): eager rows of one kernel moved 1.2-3.7 TB/s within a call, so
``--graphs --repeat 3`` (CUDA-graph replays, settings alternating; spread within 2-3%) is how rows are compared
now. The paged look-ahead took e4m3 b64 pages of 16 from 3.01 to 3.58 (eager); int32 rows and one table read
(``--lean-pages on,off,rows,table``) then 3.49 -> 3.68 (graphs), bf16 contiguous 3.98 -> 4.40, and cost the bf16
paged 128 / 2 tile 7% (4.12 -> 3.84, the rows part), which therefore keeps int64 rows:

    python bench/decode_sweep.py --fp8 --splits none --configs 0,1 --pages 0,16,64 --lean-pages on,off \
        --tiles default --repeat 3 --graphs
"""
import argparse

import torch
from triton.testing import do_bench, do_bench_cudagraph

from fusedattn.backends.triton import decode
from fusedattn.kvcache import attention_with_kvcache

BF16_TILES = ((64, 4, 3), (64, 8, 3), (128, 8, 3), (128, 4, 2))
FP8_TILES = ((128, 4, 2), (128, 8, 2), (128, 8, 4), (256, 8, 2), (256, 8, 3), (64, 8, 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8", action="store_true", help="e4m3 caches (descale 1) instead of bf16")
    ap.add_argument("--tiles", help="BLOCK_N/WARPS/STAGES[/MAX_REGS[/CTAS_PER_SM]],... instead of the list (e.g. "
                    "64/4/3,128/4/2/168: a fourth field caps ptxas's registers, DecodeTiles.max_regs; a fifth "
                    "tells the split heuristic how many programs fit an SM, DecodeTiles.ctas_per_sm)")
    ap.add_argument("--splits", default="none,2,4", help="split counts to time (none: the heuristic's)")
    ap.add_argument("--pages", default="0,16,64", help="page sizes (0: contiguous)")
    ap.add_argument("--configs", default="0,1", help="0: b64 h32/8 kv4k, 1: b8 h32/32 kv16k, 2: b16 h32/8 kv8k")
    ap.add_argument("--pairs", default="on", help="FP8 V read as int16 pairs (decode.v_pairs_code): on, off "
                    "or on,off (both, one process)")
    ap.add_argument("--lean-pages", default="on", help="paged caches: int32 page rows and one table read for K "
                    "and V (decode ROWS32 / ONE_TABLE), or off (int64 rows, V's entries read again), or rows / table "
                    "(one of the two), or force (int32 rows wherever the offsets fit, a paged 16-bit cache too): a list, one process")
    ap.add_argument("--repeat", type=int, default=1, help="time every setting this many times, alternating, and "
                    "print each one's median and best (the paged rows move 20-30%% between calls)")
    ap.add_argument("--graphs", action="store_true", help="time under CUDA graphs (no host time)")
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if args.fp8 else bf
    tiles = FP8_TILES if args.fp8 else BF16_TILES
    if args.tiles:      # "default": the planner's own choice (decode.plan_decode)
        tiles = tuple(t if t == "default" else tuple(int(x) for x in t.split("/")) for t in args.tiles.split(","))
    splits = [None if x == "none" else int(x) for x in args.splits.split(",")]
    configs = [((64, 32, 8, 4096), (8, 32, 32, 16384), (16, 32, 8, 8192))[int(i)] for i in args.configs.split(",")]
    fp8_kw = dict(descale_k=torch.ones(1, device=dev), descale_v=torch.ones(1, device=dev)) if args.fp8 else {}
    orig, orig_pairs = decode.decode_tiles, decode.v_pairs_code
    orig_lean = decode._offsets_fit_int32, decode._same_view
    orig_rows32 = decode._rows32
    for b, hq, hkv, s in configs:
        q = torch.randn(b, 1, hq, 128, device=dev, dtype=bf).transpose(1, 2)
        k = torch.randn(b, s, hkv, 128, device=dev, dtype=bf).to(cache_dtype).transpose(1, 2)
        v = torch.randn(b, s, hkv, 128, device=dev, dtype=bf).to(cache_dtype).transpose(1, 2)
        nbytes = 2 * k.numel() * k.element_size()
        lens = torch.full((b,), s, dtype=torch.int32, device=dev)
        for page in (int(x) for x in args.pages.split(",")):
            if page:
                per = s // page
                pt = torch.randperm(b * per, device=dev).to(torch.int32).view(b, per)
                kc = torch.empty(b * per, page, hkv, 128, device=dev, dtype=cache_dtype)
                vc = torch.empty_like(kc)
                kc[pt.view(-1).long()] = k.transpose(1, 2).reshape(b * per, page, hkv, 128)
                vc[pt.view(-1).long()] = v.transpose(1, 2).reshape(b * per, page, hkv, 128)
                call, kw = (q, kc.transpose(1, 2), vc.transpose(1, 2)), dict(page_table=pt, seq_len_kv=lens)
            else:
                call, kw = (q, k, v), {}
            for tile in tiles:
                if tile == "default":
                    decode.decode_tiles, (bn, w, st), cap = orig, ("default", "", ""), ""
                else:
                    decode.decode_tiles = lambda rows, d, dt, i, *_, t=tile: decode.DecodeTiles(max(16, rows), *t)
                    bn, w, st = tile[:3]
                    cap = f"/{tile[3]}regs" if len(tile) > 3 and tile[3] else ""
                    cap += f"/{tile[4]}persm" if len(tile) > 4 else ""
                seen = {}
                for rep in range(args.repeat):      # settings alternate within each repeat (A B A B ...)
                    for pairs, lean in ((x, y) for x in args.pairs.split(",") for y in args.lean_pages.split(",")):
                        decode.v_pairs_code = orig_pairs if pairs == "on" else (lambda v, d_v: 0)
                        decode._offsets_fit_int32, decode._same_view = (
                            orig_lean[0] if lean in ("on", "rows", "force") else (lambda t: False),
                            orig_lean[1] if lean in ("on", "table", "force") else (lambda a, b: False))
                        decode._rows32 = orig_rows32 if lean != "force" else (
                            lambda k, v, paged, fp8: orig_lean[0](k) and orig_lean[0](v))
                        for ns in splits:
                            def run():
                                attention_with_kvcache(*call, **kw, **fp8_kw, num_splits=ns, validate=False)
                            ms = do_bench_cudagraph(run, rep=100, return_mode="median") if args.graphs else \
                                do_bench(run, warmup=25, rep=100, return_mode="median")
                            label = (f"{'e4m3' if args.fp8 else 'bf16'} b{b} h{hq}/{hkv} kv{s} page{page} "
                                     f"tile{bn}/{w}w/{st}st{cap} pairs={pairs} lean={lean} splits={ns}")
                            seen.setdefault(label, []).append(nbytes / ms / 1e9)
                            print(f"{label}: {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s", flush=True)
                if args.repeat > 1:
                    for label, tbs in seen.items():
                        tbs = sorted(tbs)
                        print(f"summary {label}: median {tbs[len(tbs) // 2]:.3f} best {tbs[-1]:.3f} TB/s "
                              f"({' '.join(f'{x:.2f}' for x in tbs)})", flush=True)
            decode.decode_tiles, decode.v_pairs_code = orig, orig_pairs
            decode._offsets_fit_int32, decode._same_view = orig_lean
            decode._rows32 = orig_rows32


if __name__ == "__main__":
    main()
