"""The bench's GPU timing (``fusedattn.bench.do_bench_cold``): every timed call starts from a cold L2 that holds
nothing dirty (bench/NOTES.md 77: triton.testing.do_bench's zeroing flush made each call write back the flush's
dirty lines, 5% of a b64 FP8 decode row)."""
import pytest
import torch

from fusedattn import bench

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: GPU tests skipped")]


def _hot_ms(fn, n=50):
    """Median ms of back-to-back calls (what L2 already holds stays there)."""
    for _ in range(5):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[n // 2]


def test_flush_evicts_what_a_call_would_reuse():
    # an 8 MiB copy (16 MiB of source and destination) fits the L2 of an A100 / H100 / H200: back to back it
    # runs from L2; after the flush its source must come from DRAM again, so it must take clearly longer
    src = torch.randn(4 * 2 ** 20, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    hot = _hot_ms(lambda: dst.copy_(src))
    cold = bench.do_bench_cold(lambda: dst.copy_(src), warmup=5, rep=20)
    assert cold > 1.2 * hot, f"cold {cold:.4f} ms vs hot {hot:.4f} ms: the flush left the copy's data in L2"


def test_flush_leaves_nothing_to_write_back():
    # a 256 MiB copy: timed after the reading flush it is not slower than after triton's zeroing one (which
    # leaves L2 dirty); a flush that dirtied L2 would cost the call its write-back
    from triton.testing import do_bench
    src = torch.randn(128 * 2 ** 20, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    cold = bench.do_bench_cold(lambda: dst.copy_(src), warmup=5, rep=50)
    zeroed = do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    assert cold <= 1.01 * zeroed, f"after the reading flush {cold:.4f} ms, after the zeroing one {zeroed:.4f} ms"
