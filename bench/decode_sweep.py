"""Decode tile / split sweep on the GPU: K/V TB/s per (config, cache, tile, splits)."""
import torch
from triton.testing import do_bench

from fusedattn.backends.triton import decode
from fusedattn.kvcache import attention_with_kvcache

dev, bf = "cuda", torch.bfloat16
orig = decode.decode_tiles
for b, hq, hkv, s in ((64, 32, 8, 4096), (8, 32, 32, 16384)):
    q = torch.randn(b, 1, hq, 128, device=dev, dtype=bf).transpose(1, 2)
    k = torch.randn(b, s, hkv, 128, device=dev, dtype=bf).transpose(1, 2)
    v = torch.randn_like(k)
    nbytes = 2 * k.numel() * 2
    lens = torch.full((b,), s, dtype=torch.int32, device=dev)
    for page in (0, 16, 64):
        if page:
            per = s // page
            pt = torch.randperm(b * per, device=dev).to(torch.int32).view(b, per)
            kc = torch.empty(b * per, page, hkv, 128, device=dev, dtype=bf)
            vc = torch.empty_like(kc)
            kc[pt.view(-1).long()] = k.transpose(1, 2).reshape(b * per, page, hkv, 128)
            vc[pt.view(-1).long()] = v.transpose(1, 2).reshape(b * per, page, hkv, 128)
            args, kw = (q, kc.transpose(1, 2), vc.transpose(1, 2)), dict(page_table=pt, seq_len_kv=lens)
        else:
            args, kw = (q, k, v), {}
        for bn, w, st in ((64, 4, 3), (64, 8, 3), (128, 8, 3), (128, 4, 2)):
            decode.decode_tiles = lambda rows, d, dt, i, t=(bn, w, st): decode.DecodeTiles(max(16, rows), *t)
            for ns in (None, 2, 4):
                ms = do_bench(lambda: attention_with_kvcache(*args, **kw, num_splits=ns, validate=False),
                              warmup=25, rep=100, return_mode="median")
                print(f"b{b} h{hq}/{hkv} kv{s} page{page} tile{bn}/{w}w/{st}st splits={ns}: {ms:.4f} ms "
                      f"{nbytes / ms / 1e9:.3f} TB/s", flush=True)
        decode.decode_tiles = orig
