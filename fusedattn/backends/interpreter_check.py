"""Triton's interpreter on bfloat16 matmuls, checked once per process (``TRITON_INTERPRET=1`` only).

The interpreter keeps a bfloat16 tile as its 16-bit patterns (numpy has no bfloat16). Its ``tl.dot`` of two
such tiles multiplies the patterns as integers on Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0: a 16 x 16 product
of randn values came out ~2.5e10 off, and a bfloat16 attention with ``backend='triton'`` on CPU tensors
returned values of ~8e8 where the reference has ~1, with no error. Loads, stores and casts are right; float16
and float32 are right. So fusedattn asks, at the first bfloat16 problem under the interpreter, whether one
small ``tl.dot`` gives the product, and refuses bfloat16 there while it does not (``plan``: a
``NotSupportedError`` that names the ways out); a Triton that fixes its interpreter passes and runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_RESULT: list = []        # [bool] once asked


@triton.jit
def _bf16_dot(X, Y, Z, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(X + i[:, None] * N + i[None, :])
    y = tl.load(Y + i[:, None] * N + i[None, :])
    tl.store(Z + i[:, None] * N + i[None, :], tl.dot(x, y))


def bf16_dot_ok() -> bool:
    """Whether this Triton's interpreter multiplies two bfloat16 tiles right (asked once; call it only while
    interpreting)."""
    if not _RESULT:
        n = 16
        grid = torch.arange(n * n, dtype=torch.float32).reshape(n, n)
        x = torch.sin(grid * 0.7).mul_(3).to(torch.bfloat16)      # irregular values, no random stream used
        y = torch.cos(grid * 1.3).mul_(2).to(torch.bfloat16)
        z = torch.full((n, n), float("nan"))
        try:
            _bf16_dot[(1, )](x, y, z, n)
            want = x.float() @ y.float()
            _RESULT.append(bool(torch.allclose(z, want, rtol=1e-2, atol=1e-2)))
        except Exception:  # noqa: BLE001 - an interpreter that cannot run it cannot run ours either
            _RESULT.append(False)
    return _RESULT[0]
