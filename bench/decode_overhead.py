"""Why `bench --models`' generate() ran at 0.74x of sdpa (H100, session 15): host time per decode call.

    python3 bench/decode_overhead.py

The generate workload (batch 8, 32/8 heads of 64, one new query against a growing K/V cache) is
host-bound: the GPU waits for the Python that enqueues each layer. For one decode-shaped call this
prints the host time to enqueue it (no sync) and the GPU time, for PyTorch's SDPA, fusedattn's
``attention`` and the transformers integration's ``attention_forward``; then the top of a cProfile of
fusedattn's call, so the layer that costs the time is named.
"""
import cProfile
import pstats

import torch
import torch.nn.functional as F

import fusedattn
from overhead import host_ms     # bench/overhead.py (this folder is on sys.path when run as a script)


def gpu_ms(fn, n=300):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(20):
        fn()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main():
    b, h_q, h_kv, d, s_kv = 8, 32, 8, 64, 600
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, 1, h_q, d, device=dev, dtype=dt).transpose(1, 2)          # [b, h, 1, d] as HF makes it
    k = torch.randn(b, h_kv, s_kv, d, device=dev, dtype=dt)                      # DynamicCache: contiguous BHSD
    v = torch.randn(b, h_kv, s_kv, d, device=dev, dtype=dt)
    calls = {
        "sdpa (enable_gqa)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "fusedattn.attention": lambda: fusedattn.attention(q, k, v),
        "fusedattn.attention(validate=False)": lambda: fusedattn.attention(q, k, v, validate=False),
    }
    try:
        from fusedattn.integrations import transformers as fa_hf
        module = torch.nn.Module()
        module.is_causal = True
        calls["integrations.transformers"] = lambda: fa_hf.attention_forward(module, q, k, v, None, scaling=d ** -0.5)
    except ImportError as exc:
        print(f"transformers integration not measured: {exc}")
    print(f"decode b{b} h{h_q}/{h_kv} d{d} kv{s_kv} bf16: host ms per call (enqueue) / GPU ms per call")
    for name, fn in calls.items():
        print(f"  {name:40s} host {host_ms(fn):.4f}  gpu {gpu_ms(fn):.4f}")
    prof = cProfile.Profile()
    fn = calls["fusedattn.attention"]
    prof.enable()
    for _ in range(500):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
