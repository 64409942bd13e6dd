r"""FP8 K/V caches for :func:`fusedattn.attention_with_kvcache` (issue 27 item 4): semantics, append, emulation.

Semantics. A cache of ``torch.float8_e4m3fn`` (or ``float8_e5m2``) bytes ``k8``, ``v8`` with fp32 descales
``descale_k``, ``descale_v`` (one per tensor, or one per kv head ``[h_kv]``) holds the values::

    K[b, h, j, :] = k8[b, h, j, :] * descale_k[h]          V = v8 * descale_v  likewise

(contiguous ``[b, h_kv, s_max, d]`` or paged ``[num_blocks, h_kv, block_size, d]``, either cache layout),
and ``attention_with_kvcache(q, k8, v8, descale_k=, descale_v=, ...)`` computes what the same call computes
on a 16-bit cache holding ``K``, ``V``: ``softmax(attn_scale * q @ K^T, masked) @ V`` with ``q`` in fp16 /
bf16 / fp32, the output in q's dtype, the stats the fp32 log-sum-exp of the scaled scores. Decode, split
keys, padded (``seq_len_q``) or packed (``cu_seqlens_q``) queries per sequence, paged prefill, windows,
ALiBi, softcap and sinks mean what they mean for a 16-bit cache.

Append. ``k_new`` / ``v_new`` (q's dtype, as for a 16-bit cache) are stored as::

    k8 = sat_rne(float32(k_new) / descale_k)        (per kv head with per-head descales)

an IEEE fp32 division (correctly rounded), then round-to-nearest-even to the FP8 type, saturating at
+-448 (e4m3) / +-57344 (e5m2) as :func:`fusedattn.fp8.quantize` does (NaN stays NaN). With a power-of-two
descale (:func:`fusedattn.fp8.quantize_per_tensor` gives those) the division is exact and equals a
multiplication by the scale; a kernel must divide correctly rounded (``div_rn``) to store the same bytes.

Rounding points: two. (1) Storage: each K / V value is rounded to FP8 once, when appended (or by whoever
wrote the cache). (2) The output, rounded to q's dtype once. Everything between is fp32: ``k8 * descale``
(a 4-bit significand times an fp32: one fp32 rounding), q upcast exactly, scores, softmax and ``P @ V``
(P is *not* rounded to 16 bits here).

Error bound (:func:`fusedattn.reference_fp8.fp8_kvcache_bound` computes it). Against float64 attention of the
*unquantized* K / V (the values before the cache's rounding; none saturates: ``|K / descale_k| <= FP8_MAX``),
``O = P @ V`` with ``P = softmax(S)``, ``S = attn_scale * q @ K^T``. e4m3 keeps 3 mantissa bits: its relative
step is 2^-3, so rounding moves a value by at most ``u8 = 2^-4`` of itself, or ``a8 = 2^-10`` (half the
smallest subnormal, 2^-9) in the subnormal range (e5m2: ``2^-3``, ``2^-17``). Per element::

    dK_jc = u8 |K_jc| + a8 descale_k            |K'_jc - K_jc| <= dK_jc        (dV likewise)
    E_i   = max_{j kept} attn_scale * sum_c |q_ic| dK_jc                          |S'_ij - S_ij| <= E_i
    P'_ij / P_ij  in  [exp(-2 E_i), exp(2 E_i)]     (every logit of the row moves by at most E_i)
    O' - O = sum_j P'_ij (V'_j - V_j) + sum_j (P'_ij - P_ij) (V_j - O_i)    (both P rows sum to 1)

    |o - O|_ic <= exp(2 E_i) * sum_j P_ij dV_jc + (exp(2 E_i) - 1) * sum_j P_ij |V_jc - O_ic|
                  + fp32 terms + u_o (|O_ic| + the above) + a_o

``u_o, a_o``: q's dtype's unit roundoff and half-subnormal (bf16 2^-8, fp16 2^-11 and 2^-25, fp32 0). The
fp32 terms are those of :mod:`fusedattn.fp8`'s bound (relative ``2 (d + 3) eps A_i + (s_kv + 6) eps`` on P,
``(s_kv + 4) eps`` on the sum, ``eps = 2^-24``, taken twice). To first order the bound is
``u8 * sum_j P |V| + 2 E_i * sum_j P |V - O|``: the value rounding costs up to 6% of ``sum_j P |V|``, the key
rounding grows with the logits' size (``E_i ~ u8 * attn_scale * sum_c |q_c| |K_c|``). Random data lands far
inside (the roundings' signs cancel: the worst element at 4-16% of its bound in the tests); values placed
just below a rounding midpoint, read with uniform P, reach over 90% of it (``tests/test_fp8_kvcache.py``).
The decode kernel (below) rounds its unnormalized probabilities ``p <= 1`` to fp16 before ``P @ V`` (bf16
queries too: their products run on fp16 operands, the rows moved into fp16 exactly by a power of two each):
that adds ``u_16 * sum_j P |V'| + a_16 * sum_{j kept} |V'|`` (fp16 ``2^-11`` and ``2^-25``; the row sum is at
least 1), ``fp8_kvcache_bound(p_dtype=torch.float16)``.

Execution. Decode (a few query rows per kv head, ``backends.triton.decode.decode_rows_fit``) with fp16 /
bf16 queries runs the split-KV decode kernel on the cache's bytes (``KV_FP8``; [Note] FP8 caches there):
each K / V tile is read as FP8 and widened exactly to q's type, ``descale_k`` joins the scores' scale and
``descale_v`` the output's, so the kernel reads half the bytes of a 16-bit cache. Everything else (prefill
against an FP8 cache, fp32 queries, ``backend='cpu'``) is the emulation: the used pages / rows of each
sequence are gathered through the page table (torch indexing: only the keys up to the longest
``seq_len_kv`` are read), dequantized to fp32 with torch ops, and the dense path runs on them in fp32.
Appends always run in torch (quantize, then an index write), on any device.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .fp8 import FP8_DTYPES, _scale, is_fp8, quantize
from .problem import InvalidArgumentError, InvalidTypeError

__all__ = ["cache_descales", "quantize_for_cache", "dequantize_cache"]

WHERE = "attention_with_kvcache"


def cache_descales(k_cache, v_cache, descale_k, descale_v, h_kv: int,
                   device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Check the caches' dtypes against the descales; ``(descale_k, descale_v)`` as fp32 ``[1, h_kv or 1, 1, 1]``
    for FP8 caches, ``(None, None)`` for 16-bit ones (whose dtype the caller checks against q's).

    Raises InvalidArgumentError / InvalidTypeError naming the argument: descales with a 16-bit cache, an FP8
    cache without its descale, caches of different FP8 types or one FP8 and one not, a descale with neither
    one element nor ``h_kv``."""
    k8, v8 = is_fp8(k_cache), is_fp8(v_cache)
    if not (k8 or v8):
        given = [n for n, x in (("descale_k", descale_k), ("descale_v", descale_v)) if x is not None]
        if given:
            raise InvalidArgumentError(
                f"{WHERE}: {' and '.join(given)} given but k_cache is {k_cache.dtype} and v_cache {v_cache.dtype}; "
                f"descales go with float8 caches ({', '.join(str(t) for t in FP8_DTYPES)})")
        return None, None
    if k_cache.dtype != v_cache.dtype:
        raise InvalidTypeError(f"{WHERE}: k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}; an FP8 cache "
                               f"needs both in one float8 type")
    for name, x in (("descale_k", descale_k), ("descale_v", descale_v)):
        if x is None:
            raise InvalidArgumentError(
                f"{WHERE}: the caches are {k_cache.dtype}, so {name} is required: the fp32 factor that turns a "
                f"stored byte into its value (a float, one element, or one per kv head [{h_kv}]; e.g. amax / 448)")
    return (_scale(descale_k, "descale_k", device, h_kv, WHERE), _scale(descale_v, "descale_v", device, h_kv, WHERE))


def quantize_for_cache(x: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New keys or values ``x [b, h_kv, s, d]`` (16-bit or fp32) as the cache stores them:
    ``sat_rne(float32(x) / descale)`` in ``dtype`` (descale fp32 ``[1, h_kv or 1, 1, 1]``)."""
    return quantize(x.float() / descale, dtype)


def dequantize_cache(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """Gathered cache bytes ``x8 [b, h_kv, n, d]`` -> their fp32 values ``x8 * descale`` (one fp32 rounding)."""
    return x8.float() * descale
