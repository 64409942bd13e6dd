"""Capture the autograd backward of fusedattn.attention in a CUDA graph, the way fusedattn.bench
does (warm-up on a side stream, then torch.cuda.graph), for several masks in a row, and print
what fails (the bench's non-causal d=64 backward capture failed; bench/NOTES.md 7).

    python3 tools/graph_capture_check.py
"""
import traceback

import torch

import fusedattn


def capture_bwd(causal, b=8, h=12, s=1024, d=64):
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2).requires_grad_()  # noqa
    q, k, v = mk(), mk(), mk()
    out = fusedattn.attention(q, k, v, causal=causal)
    do = torch.randn_like(out)
    fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = fn()
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return max((g - r).abs().max().item() for g, r in zip(grads, ref))


def main():
    for causal in (False, True, False):
        try:
            print(f"causal={causal}: captured, replay max|diff| vs eager {capture_bwd(causal):.2e}", flush=True)
        except Exception:  # noqa: BLE001 - report and go on
            print(f"causal={causal}: FAILED", flush=True)
            traceback.print_exc()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
