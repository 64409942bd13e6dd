"""``fusedattn demo``: the seeds' examples, checked against PyTorch and timed beside it.

Runs the basic, causal, GQA and BSHD examples of ``shared/seeds/sdpa-tutorial.md``
and ``llm-quick-start.md`` with ``fusedattn.attention`` on the best device
present (the seeds' sizes on a GPU, small ones on the CPU), compares each with
``torch.nn.functional.scaled_dot_product_attention`` on the same inputs using
the seed's own tolerances (``torch.testing.assert_close`` semantics:
``|ours - sdpa| <= atol + rtol * |sdpa|`` everywhere), and prints one table row
per case: shape, max error, pass/fail, our time and SDPA's. Exits 1 if any
check fails.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Case:
    """One seed example: sizes, layout and the tolerance the seed checks it with."""

    name: str
    b: int
    h_q: int
    h_kv: int
    s: int
    d: int
    dtype: torch.dtype
    causal: bool
    bshd: bool          # physical [b, s, h, d] memory seen through .transpose(1, 2)
    atol: float
    rtol: float
    source: str

    @property
    def shape(self) -> str:
        heads = f"{self.h_q}" if self.h_q == self.h_kv else f"{self.h_q}/{self.h_kv}"
        dt = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        extra = (", causal" if self.causal else "") + (", BSHD" if self.bshd else "")
        return f"{self.b}, {heads}, {self.s}, {self.d}, {dt}{extra}"


def seed_cases(on_gpu: bool) -> List[Case]:
    """The seeds' four examples; on the CPU the same features at small sizes."""
    fp16, bf16 = torch.float16, torch.bfloat16
    tut, quick = "sdpa-tutorial.md", "llm-quick-start.md"
    if on_gpu:
        return [
            Case("basic", 8, 12, 12, 1024, 64, fp16, False, False, 5e-3, 3e-3, tut),
            Case("causal", 8, 12, 12, 1024, 64, fp16, True, False, 5e-3, 3e-3, tut),
            Case("GQA", 8, 32, 8, 1024, 128, fp16, False, False, 5e-3, 3e-3, tut),
            Case("BSHD (LLM quick start)", 4, 32, 32, 2048, 128, bf16, True, True, 1e-2, 1e-2, quick),
        ]
    return [
        Case("basic", 2, 4, 4, 128, 64, fp16, False, False, 5e-3, 3e-3, tut),
        Case("causal", 2, 4, 4, 128, 64, fp16, True, False, 5e-3, 3e-3, tut),
        Case("GQA", 2, 8, 2, 128, 128, fp16, False, False, 5e-3, 3e-3, tut),
        Case("BSHD (LLM quick start)", 2, 8, 8, 256, 128, bf16, True, True, 1e-2, 1e-2, quick),
    ]


def make_qkv(case: Case, device: str):
    """Random q, k, v as the seed builds them (BHSD, or BSHD memory viewed as BHSD)."""
    def one(h):
        if case.bshd:
            return torch.randn(case.b, case.s, h, case.d, device=device, dtype=case.dtype).transpose(1, 2)
        return torch.randn(case.b, h, case.s, case.d, device=device, dtype=case.dtype)
    return one(case.h_q), one(case.h_kv), one(case.h_kv)


def sdpa_reference(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """PyTorch's SDPA; GQA through ``enable_gqa`` where this torch has it, else repeated K/V."""
    if q.shape[1] != k.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        except TypeError:          # torch < 2.5 has no enable_gqa
            pass
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def time_ms(fn: Callable[[], object], on_gpu: bool) -> float:
    """Median ms: the bench's timing on a GPU (``bench.do_bench_cold``: L2 flushed before each call), wall time
    on the CPU."""
    from fusedattn.bench import do_bench_cold, time_cpu_ms
    if on_gpu:
        return do_bench_cold(fn, warmup=10, rep=50)
    return time_cpu_ms(fn, reps=3)


@dataclass
class Result:
    case: Case
    max_err: float = float("nan")
    ok: bool = False
    ours_ms: float = float("nan")
    sdpa_ms: float = float("nan")
    error: str = ""


def run_case(case: Case, device: str, attention) -> Result:
    """Check one example against SDPA, then time both (time only if the check ran)."""
    res = Result(case)
    on_gpu = device == "cuda"
    q, k, v = make_qkv(case, device)
    scale = 1.0 / math.sqrt(case.d)
    try:
        with torch.no_grad():
            ours = attention(q, k, v, attn_scale=scale, causal=case.causal)
            ref = sdpa_reference(q, k, v, case.causal, scale)
            diff = (ours.float() - ref.float()).abs()
            res.max_err = diff.max().item()
            res.ok = bool(torch.isfinite(ours).all()) and bool((diff <= case.atol + case.rtol * ref.float().abs()).all())
            res.ours_ms = time_ms(lambda: attention(q, k, v, attn_scale=scale, causal=case.causal), on_gpu)
            res.sdpa_ms = time_ms(lambda: sdpa_reference(q, k, v, case.causal, scale), on_gpu)
    except Exception as exc:       # report, do not crash the demo: the table says which case broke
        res.ok = False
        res.error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
    return res


def render(results: Sequence[Result]) -> str:
    head = "| case | shape (b, h_q/h_kv, s, d, dtype) | max abs error | tolerance (atol, rtol) | check | fusedattn ms | SDPA ms |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.case
        check = "pass" if r.ok else ("FAIL" if not r.error else "ERROR")
        lines.append(f"| {c.name} | {c.shape} | {r.max_err:.2e} | {c.atol:g}, {c.rtol:g} ({c.source}) | {check} | "
                     f"{r.ours_ms:.3f} | {r.sdpa_ms:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``fusedattn demo``; returns 0 when every example matches PyTorch."""
    parser = argparse.ArgumentParser(prog="fusedattn demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where to run (auto: the GPU when there is one)")
    args = parser.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        from fusedattn import attention
    except ImportError as exc:
        print(f"fusedattn.attention is not importable: {exc}", file=sys.stderr)
        return 1
    torch.manual_seed(42)
    where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (no GPU found: small sizes)"
    print(f"fusedattn demo on {where}; torch {torch.__version__}")
    results = [run_case(case, device, attention) for case in seed_cases(device == "cuda")]
    print(render(results))
    for r in results:
        if r.error:
            print(f"{r.case.name}: {r.error}", file=sys.stderr)
    failed = [r.case.name for r in results if not r.ok]
    # Not "N passed, N failed": CI logs read that shape as a test runner's summary.
    print(f"demo: all {len(results)} examples match PyTorch" if not failed
          else f"demo: {len(failed)} of {len(results)} examples FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
