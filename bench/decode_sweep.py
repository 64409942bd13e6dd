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
"""
import argparse

import torch
from triton.testing import do_bench

from fusedattn.backends.triton import decode
from fusedattn.kvcache import attention_with_kvcache

BF16_TILES = ((64, 4, 3), (64, 8, 3), (128, 8, 3), (128, 4, 2))
FP8_TILES = ((128, 4, 2), (128, 8, 2), (128, 8, 4), (256, 8, 2), (256, 8, 3), (64, 8, 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8", action="store_true", help="e4m3 caches (descale 1) instead of bf16")
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if args.fp8 else bf
    tiles = FP8_TILES if args.fp8 else BF16_TILES
    fp8_kw = dict(descale_k=torch.ones(1, device=dev), descale_v=torch.ones(1, device=dev)) if args.fp8 else {}
    orig = decode.decode_tiles
    for b, hq, hkv, s in ((64, 32, 8, 4096), (8, 32, 32, 16384)):
        q = torch.randn(b, 1, hq, 128, device=dev, dtype=bf).transpose(1, 2)
        k = torch.randn(b, s, hkv, 128, device=dev, dtype=bf).to(cache_dtype).transpose(1, 2)
        v = torch.randn(b, s, hkv, 128, device=dev, dtype=bf).to(cache_dtype).transpose(1, 2)
        nbytes = 2 * k.numel() * k.element_size()
        lens = torch.full((b,), s, dtype=torch.int32, device=dev)
        for page in (0, 16, 64):
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
            for bn, w, st in tiles:
                decode.decode_tiles = lambda rows, d, dt, i, t=(bn, w, st): decode.DecodeTiles(max(16, rows), *t)
                for ns in (None, 2, 4):
                    ms = do_bench(lambda: attention_with_kvcache(*call, **kw, **fp8_kw, num_splits=ns, validate=False),
                                  warmup=25, rep=100, return_mode="median")
                    print(f"{'e4m3' if args.fp8 else 'bf16'} b{b} h{hq}/{hkv} kv{s} page{page} tile{bn}/{w}w/{st}st "
                          f"splits={ns}: {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s", flush=True)
            decode.decode_tiles = orig


if __name__ == "__main__":
    main()
