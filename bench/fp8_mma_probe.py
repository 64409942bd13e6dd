"""Lab probe (issue 27): how precisely does an sm_90 FP8 MMA (Triton ``tl.dot`` on float8_e4m3fn
operands, fp32 accumulator) add its products?

The FP8 forward's error bound (``fusedattn.fp8``, ``reference_fp8.fp8_forward_bound``) assumed fp32
sums; the H100 run of tests/test_fp8_kernel.py (session 18) found the kernel's log-sum-exp further from
float64 than fp32 sums allow. Hopper's FP8 wgmma keeps fewer bits than fp32 while it adds a K-step's
products (DeepSeek-V3's report: "around 14 bits"), which is why the kernel promotes every K-step of 32
into the fp32 tile (``max_num_imprecise_acc``). This probe measures, for each promotion interval and K:

    ratio = max over elements |dot - exact| / sum_k |a_ik b_kj|

on random e4m3 operands and on adversarial ones (one large product, many small), so the bound can
carry a measured unit ``u_mma`` (the worst ratio seen, with margin). Prints one line per case.

    python bench/fp8_mma_probe.py
"""
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PROMOTE: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(A + rm[:, None] * K + rk[None, :])
    b = tl.load(B + rk[:, None] * N + rn[None, :])
    c = tl.dot(a, b, max_num_imprecise_acc=PROMOTE) if PROMOTE > 0 else tl.dot(a, b)
    tl.store(C + rm[:, None] * N + rn[None, :], c)


def probe(kind: str, K: int, promote: int, seed: int, M: int = 128, N: int = 128) -> float:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * 4
    b = torch.randn(K, N, generator=g) * 4
    if kind == "adversarial":       # one large product per row/column pair, the rest 2^-8 of it
        a = a.abs() * 2 ** -6
        a[:, 0] = 400.0
        b = b.abs()
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    exact = a8.double() @ b8.double()
    scale = a8.double().abs() @ b8.double().abs()
    c = torch.empty(M, N, device="cuda", dtype=torch.float32)
    _dot[(1,)](a8.cuda(), b8.cuda(), c, M, N, K, promote, num_warps=4)
    return ((c.cpu().double() - exact).abs() / scale).max().item()


def lse_probe(d: int, causal: bool, seed: int) -> float:
    """The FP8 forward kernel's log-sum-exp against float64: max |lse - lse_ref| / A_i (the bound's row
    scale: max_j attn_scale * sum_k |q8 k8|)."""
    from fusedattn import fp8
    from fusedattn.reference_fp8 import fp8_forward_bound
    from fusedattn.problem import make_band
    g = torch.Generator().manual_seed(seed)
    b, h, s = 2, 4, 333
    q8, k8, v8 = ((torch.randn(b, h, s, d, generator=g) * 3).to(torch.float8_e4m3fn) for _ in range(3))
    one = torch.ones(1, 1, 1, 1)
    sc = dict(descale_q=one, descale_k=one, descale_v=one, descale_s=one / 256, scale_s=one * 256, scale_o=one)
    band = make_band(causal, "top_left", None)
    _, stats, _, _ = fp8.sdpa_fp8_forward(q8.cuda(), k8.cuda(), v8.cuda(), band=band, o_dtype=torch.bfloat16,
                                          **{n: t.cuda() for n, t in sc.items()})
    _, lse, _ = fp8_forward_bound(q8, k8, v8, o_dtype=torch.bfloat16, causal=causal, **sc)
    A = (q8.double().abs() @ k8.double().abs().transpose(-1, -2)).amax(-1, keepdim=True) * d ** -0.5
    return ((stats.cpu().double().view_as(lse) - lse).abs() / A).max().item()


def main() -> None:
    print(f"device {torch.cuda.get_device_name()}, triton {triton.__version__}")
    worst = 0.0
    for kind in ("random", "adversarial"):
        for K in (32, 64, 128, 256):
            for promote in (32, 0):
                r = max(probe(kind, K, promote, seed) for seed in range(8))
                if promote == 32:
                    worst = max(worst, r)
                print(f"{kind:12s} K={K:4d} promote={'every 32' if promote else 'never   '} "
                      f"max |err|/sum|ab| = {r:.3e} = 2^{math.log2(r) if r else float('-inf'):.1f}")
    print(f"worst with promotion every 32: {worst:.3e} = 2^{math.log2(worst) if worst else float('-inf'):.1f}")
    for d in (64, 128, 256):
        for causal in (False, True):
            r = max(lse_probe(d, causal, seed) for seed in range(3))
            print(f"FP8 forward kernel d={d} causal={causal}: max |lse - lse_ref| / A = {r:.3e} = 2^{math.log2(r):.1f}")


if __name__ == "__main__":
    main()
