"""Lab probe (issue 25): how much the paged prefill's timing varies between input sets and between repeats.

``bench/paged_tiles.py`` read the packed (varlen) queries over pages of 16 at 0.91 / 0.87 of the contiguous cache
in one call (Triton 3.9 / 3.6, H100) and 0.505 / 0.527 in the next (session 31). This times the bench's prefill
problems (b8 h32/8, 512 new queries over 4096 cached keys, d128 bf16, causal bottom-right): contiguous, pages of
16, packed queries over pages of 16 and of 64, each on three fresh input sets (a new page shuffle each) and three
``do_bench`` repeats of 100 ms per set, TFLOP/s:

    PYTHONPATH=$PWD python3 bench/p16_var_probe.py

Measured (H100 80GB HBM3, Triton 3.6.0, session 31, two runs in one call, first / second):

    contiguous           593-631 / 522-644   (first repeat of a set highest, then 540-600)
    pages of 16          505-610 / 535-590
    packed, pages of 16  505-599 / 533-582
    packed, pages of 64  529-610 / 546-596

No input set was 2x slower; the repeats of one set spread 5-15%, as wide as the gaps the issue's 0.95 target
measures, so a single ``paged_tiles.py`` row decides nothing below ~10%: compare in interleaved rounds. The same
call's ``bench --configs prefill --quick`` on 3.9.0: contiguous 639, pages of 16 585 (0.915), 64 606 (0.948), 256
619 (0.969), packed 16 582 (0.911), packed 64 590 (0.923) TFLOP/s.
"""
import functools
from dataclasses import replace

import torch
import triton

import fusedattn
from fusedattn import bench


def main() -> None:
    base = [c for c in bench.prefill_configs() if c.mask != "varlen" and c.page_block == 0][0]
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    for page, mask in ((0, base.mask), (16, base.mask), (16, "varlen"), (64, "varlen")):
        cfg = replace(base, page_block=page, mask=mask)
        for trial in range(3):
            inp = bench.make_inputs(cfg, "cuda")
            x = inp.extra
            kw = dict(causal=True, validate=False)
            if mask == "varlen":
                q = inp.q.transpose(1, 2).reshape(cfg.b * cfg.s_q, cfg.h_q, cfg.d)
                cu = torch.arange(0, cfg.b + 1, dtype=torch.int32, device="cuda") * cfg.s_q
                call = functools.partial(fusedattn.attention_with_kvcache, q, x["k_cache"], x["v_cache"],
                                         page_table=x["page_table"], seq_len_kv=x["seq_len_kv"], cu_seqlens_q=cu,
                                         max_seqlen_q=cfg.s_q, **kw)
            elif page:
                call = functools.partial(fusedattn.attention_with_kvcache, inp.q, x["k_cache"], x["v_cache"],
                                         page_table=x["page_table"], seq_len_kv=x["seq_len_kv"], **kw)
            else:
                call = functools.partial(fusedattn.attention_with_kvcache, inp.q, inp.k, inp.v, **kw)
            call()
            torch.cuda.synchronize()
            tfs = [bench.fwd_flops(cfg) / triton.testing.do_bench(call, warmup=25, rep=100) / 1e9 for _ in range(3)]
            print(f"{cfg.name:60s} input {trial}: " + " ".join(f"{t:6.1f}" for t in tfs), flush=True)


if __name__ == "__main__":
    main()
