"""Lab probe (issue 25): which kernel does the bench's packed prefill (varlen queries over a paged
cache) launch, and what does each route cost?

bench's prefill group measured 260 / 356 TFLOP/s for the packed configs (pages of 16 / 64) after the
padded route landed (kvcache.PAD_PACKED_MAX_WASTE), where the same chunks as a padded batch read
610 / 646: this counts the Gluon paged forward's launches for one packed call and times the packed
call, the padded call and the padded route's gathers alone (do_bench, ms).

    PYTHONPATH=$PWD python bench/prefill_route_probe.py

Session 20 (H100, Triton 3.6): packed 0.927 / 0.785 ms (278 / 328 TFLOP/s), padded batch 0.422 / 0.398,
the q gather 0.030 / 0.029, pages of 16 / 64; one route ('padded'), one Gluon paged launch.
Session 21 (same, stale kernel store): packed 0.771 / 0.883 ms with 0.718 / 0.798 ms of host time per call
(enqueue, no sync): host-bound; the padded batch 0.430 / 0.413 (host 0.200 / 0.182), over BSHD memory
0.470 / 0.449. The route's ~25 small PyTorch ops cost ~0.5 ms of host; on the GPU its gathers and where took
~0.09 ms per call. Then the Gluon forward's packed mode (fwd_sm90 [Note] packed queries) replaced the route.
Session 23 (same, fresh store): one Gluon packed launch per call; packed 0.411 / 0.401 ms (627 / 642 TFLOP/s)
with 0.223 / 0.234 ms of host time per call, the padded batch 0.420 / 0.422 (host 0.174 / 0.184): GPU-bound,
the packed call now at or above the padded batch.
"""
import torch
import triton

import fusedattn
from fusedattn import bench, kvcache
from fusedattn.backends.gluon import fwd_sm90
from overhead import host_ms    # bench/overhead.py: enqueue time of one call, no sync


def main() -> None:
    calls = []
    real = fwd_sm90.launch_fwd_sm90
    fwd_sm90.launch_fwd_sm90 = lambda p, *a, **kw: (calls.append((p.paged, "packed" if kw.get("cu_seqlens_q")
                                                                  is not None else "batch")), real(p, *a, **kw))[1]
    routes = []
    padded = kvcache._Call._run_packed_padded
    kvcache._Call._run_packed_padded = lambda self, o, s: (routes.append("padded"), padded(self, o, s))[1]
    gluon = kvcache._Call._run_packed_gluon
    kvcache._Call._run_packed_gluon = lambda self, o, s: (lambda took: (routes.append(f"gluon packed: {took}"),
                                                                        took)[1])(gluon(self, o, s))
    for cfg in bench.prefill_configs():
        if cfg.mask != "varlen":
            continue
        inp = bench.make_inputs(cfg, "cuda")
        x = inp.extra
        q = inp.q.transpose(1, 2).reshape(cfg.b * cfg.s_q, cfg.h_q, cfg.d)
        cu = torch.arange(0, cfg.b + 1, dtype=torch.int32, device="cuda") * cfg.s_q
        packed = lambda: fusedattn.attention_with_kvcache(  # noqa: E731
            q, x["k_cache"], x["v_cache"], page_table=x["page_table"], seq_len_kv=x["seq_len_kv"],
            cu_seqlens_q=cu, max_seqlen_q=cfg.s_q, causal=True, validate=False)
        batch = lambda: fusedattn.attention_with_kvcache(  # noqa: E731
            inp.q, x["k_cache"], x["v_cache"], page_table=x["page_table"], seq_len_kv=x["seq_len_kv"],
            causal=True, validate=False)
        calls.clear(), routes.clear()
        packed()
        torch.cuda.synchronize()
        print(f"{cfg.name}: one packed call: routes {routes}, Gluon launches (paged?) {calls}")
        src = (cu[:-1, None].long() + torch.arange(cfg.s_q, device="cuda")).clamp_(0, q.shape[0] - 1)
        gather = lambda: q[src]  # noqa: E731
        # the padded batch over BSHD memory, as the packed route hands it to the kernel (q gathered into
        # [b, s_q, h, d] rows, out [b, s_q, h, d_v]): does the layout alone cost the kernel speed?
        q_bshd = inp.q.transpose(1, 2).contiguous().transpose(1, 2)
        o_bshd = torch.empty_like(q_bshd)
        batch_bshd = lambda: fusedattn.attention_with_kvcache(  # noqa: E731
            q_bshd, x["k_cache"], x["v_cache"], page_table=x["page_table"], seq_len_kv=x["seq_len_kv"],
            causal=True, validate=False, out=o_bshd)
        for name, fn in (("packed", packed), ("padded batch", batch), ("padded BSHD", batch_bshd),
                         ("gather of q", gather)):
            ms = triton.testing.do_bench(fn, warmup=10, rep=50)
            tf = bench.fwd_flops(cfg) / ms / 1e9
            print(f"    {name:14s} {ms:.3f} ms  {tf:.0f} TFLOP/s  host {host_ms(fn, n=50):.3f} ms per call (enqueue, "
                  f"no sync: host >= GPU means host-bound)")
        # where the packed call's GPU time goes, kernel by kernel (session 20 measured packed 0.93 / 0.79 ms
        # against the padded batch's 0.42 / 0.40 at pages of 16 / 64, with the q gather at 0.03: the ~0.4 ms
        # left is not in the route's bytes)
        for name, fn in (("packed", packed), ("padded batch", batch)):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            print(f"    profile of 10 {name} calls:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
