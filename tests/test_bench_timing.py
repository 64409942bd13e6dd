"""The bench's GPU timing (``fusedattn.bench.do_bench_cold``): every timed call starts from a cold L2 that holds
nothing dirty (bench/NOTES.md 77: triton.testing.do_bench's zeroing flush made each call write back the flush's
dirty lines, 5% of a b64 FP8 decode row)."""
import pytest
import torch

from fusedattn import bench

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: GPU tests skipped")]


def test_flush_evicts_what_a_call_would_reuse(monkeypatch):
    # an 8 MiB copy (16 MiB of source and destination) fits the L2 of an A100 / H100 / H200. Timed by the same
    # loop with a stand-in flush that evicts nothing (a 1 MiB sum: the GPU just as busy before each call) it runs
    # from L2; after the real flush its source comes from DRAM again, so it must take clearly longer
    src = torch.randn(4 * 2 ** 20, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    cold = bench.do_bench_cold(lambda: dst.copy_(src), warmup=5, rep=50)
    small, out = torch.ones(2 ** 18, device="cuda"), torch.empty((), device="cuda")
    monkeypatch.setattr(bench, "_flush_l2", lambda: torch.sum(small, dim=0, out=out))
    warm = bench.do_bench_cold(lambda: dst.copy_(src), warmup=5, rep=50)
    assert cold > 1.2 * warm, f"cold {cold:.4f} ms vs warm {warm:.4f} ms: the flush left the copy's data in L2"


def test_flush_leaves_nothing_to_write_back():
    # a 256 MiB copy: timed after the reading flush it is not slower than after triton's zeroing one (which
    # leaves L2 dirty); a flush that dirtied L2 would cost the call its write-back
    from triton.testing import do_bench
    src = torch.randn(128 * 2 ** 20, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    cold = bench.do_bench_cold(lambda: dst.copy_(src), warmup=5, rep=50)
    zeroed = do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    assert cold <= 1.01 * zeroed, f"after the reading flush {cold:.4f} ms, after the zeroing one {zeroed:.4f} ms"
