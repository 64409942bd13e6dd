"""Lab probe (issue 27 item 4): prefill against an e4m3 K/V cache in the tiled forward (KV_FP8) beside the
same call on the bf16 cache (which runs the Gluon forward on sm_90), for the bench's prefill configs
(b8 h32/8 s_q 512 over 4096 keys, d128, causal bottom-right; contiguous, pages of 16 / 64 / 256, and the
packed chunks over pages of 16 / 64). Per config: which kernel the e4m3 call launched (the forward on FP8
bytes, never the emulation), then do_bench ms and TFLOP/s of the bf16 and e4m3 calls and their ratio.

    python bench/fp8_prefill_probe.py
"""
import torch
import triton

import fusedattn
from fusedattn import bench
from fusedattn.backends.triton import fwd


def main() -> None:
    launches = []
    real = fwd.launch_fwd
    fwd.launch_fwd = lambda *a, **kw: (launches.append(kw.get("kv_descales") is not None), real(*a, **kw))[1]
    for cfg in bench.prefill_configs():
        inp = bench.make_inputs(cfg, "cuda")
        x = inp.extra
        k16, v16 = (x["k_cache"], x["v_cache"]) if cfg.page_block else (inp.k, inp.v)
        dk = (k16.float().abs().amax() / 448).reshape(1)
        dv = (v16.float().abs().amax() / 448).reshape(1)
        k8 = (k16.float() / dk).clamp(-448, 448).to(torch.float8_e4m3fn)
        v8 = (v16.float() / dv).clamp(-448, 448).to(torch.float8_e4m3fn)
        kw = dict(page_table=x.get("page_table") if cfg.page_block else None, seq_len_kv=x.get("seq_len_kv"),
                  causal=True, validate=False)
        q = inp.q
        if cfg.mask == "varlen":
            q = inp.q.transpose(1, 2).reshape(cfg.b * cfg.s_q, cfg.h_q, cfg.d)
            kw.update(cu_seqlens_q=torch.arange(0, cfg.b + 1, dtype=torch.int32, device="cuda") * cfg.s_q,
                      max_seqlen_q=cfg.s_q)
        runs = {"bf16": lambda: fusedattn.attention_with_kvcache(q, k16, v16, **kw),
                "e4m3": lambda: fusedattn.attention_with_kvcache(q, k8, v8, descale_k=dk, descale_v=dv, **kw)}
        launches.clear()
        o8 = runs["e4m3"]()
        torch.cuda.synchronize()
        err = (o8.float() - runs["bf16"]().float()).abs().max().item()
        ms = {name: triton.testing.do_bench(fn, warmup=10, rep=50) for name, fn in runs.items()}
        tf = {name: bench.fwd_flops(cfg) / t / 1e9 for name, t in ms.items()}
        print(f"{cfg.name}: e4m3 launches (forward on FP8 bytes?) {launches}; max |e4m3 - bf16| {err:.3g}; "
              f"bf16 {ms['bf16']:.3f} ms {tf['bf16']:.0f} TFLOP/s, e4m3 {ms['e4m3']:.3f} ms {tf['e4m3']:.0f} "
              f"TFLOP/s ({ms['bf16'] / ms['e4m3']:.2f}x bf16)")


if __name__ == "__main__":
    main()
