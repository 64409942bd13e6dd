r"""FP8 attention with cuDNN frontend's ``sdpa_fp8`` / ``sdpa_fp8_backward`` semantics, emulated exactly.

Where each scale applies (cuDNN frontend 1.32, ``include/cudnn_frontend/node/sdpa_fp8.h``,
``sdpa_fp8_bwd.h`` and ``matmul_fp8.h``, which expand the two ops into pointwise / matmul /
reduction nodes; every multiplication below is one fp32 node, in this order). Notation: ``x8`` is
a stored FP8 tensor (``float8_e4m3fn`` or ``float8_e5m2``), ``q(x, T)`` rounds fp32 ``x`` to dtype
``T`` (round to nearest even; saturating at +-448 / +-57344 for FP8, as the hardware's
``satfinite`` conversions), all other math is fp32. Scales are per-tensor fp32 ``[1, 1, 1, 1]``.

Forward, ``o, stats, amax_s, amax_o = sdpa_fp8(q, k, v, descale_q, descale_k, descale_v, descale_s,
scale_s, scale_o)``::

    S      = (q8 @ k8^T) * attn_scale * descale_q * descale_k           bmm1, then three muls
    S      = mask(S)                    causal / band / padding: masked logits are -inf
    P      = softmax(S)                 normalized; stats = logsumexp(S) (natural log, fp32)
    amax_s = max |P|                    of the unscaled fp32 P, before quantization
    P8     = q(P * scale_s, dtype of q)
    O      = (P8 @ v8) * descale_s * descale_v                          matmul_fp8: A = P8, B = V
    amax_o = max |O|                    before scale_o (matmul_fp8 reduces ahead of its Scale_C)
    o      = q(O * scale_o, dtype of o)  o is FP8 (Hopper) or bf16/fp16 (cuDNN 9.13+ on Blackwell)

Backward, ``dQ, dK, dV, amax_dQ, amax_dK, amax_dV, amax_dP = sdpa_fp8_backward(q, k, v, o, dO,
stats, descale_q, descale_k, descale_v, descale_o, descale_dO, descale_s, descale_dP, scale_s,
scale_dQ, scale_dK, scale_dV, scale_dP)``::

    D      = rowsum(dO8 * o8) * descale_dO * descale_o                  fp32 sum of exact products
    S      = mask((q8 @ k8^T) * attn_scale * descale_q * descale_k)
    P      = exp(S - stats)             the forward's probabilities, recomputed from its stats
    P8     = q(P * scale_s, dtype of q)
    dV     = (P8^T @ dO8) * descale_s * descale_dO;   amax_dV = max |dV|;   dV = q(dV * scale_dV)
    dP     = (dO8 @ v8^T) * descale_dO * descale_v
    dS     = (dP - D) * P * attn_scale; amax_dP = max |dS|   (cuDNN names the gradient of S "dP")
    dS8    = q(dS * scale_dP, dtype of dO)
    dQ     = (dS8 @ k8) * descale_dP * descale_k;   amax_dQ = max |dQ|;   dQ = q(dQ * scale_dQ)
    dK     = (dS8^T @ q8) * descale_dP * descale_q; amax_dK = max |dK|;   dK = q(dK * scale_dK)

With GQA the dK / dV products are summed over the query heads of a group before the descales (the
``gqa_c`` reduction of matmul_fp8). Every amax is of the *unscaled* fp32 value, over the whole tensor
(masked positions are 0), so a recipe sets the next step's scale from it (``scale = FP8_MAX / amax``).
cuDNN's graph quantizes the *normalized* P; a flash kernel that quantizes ``exp(S - m_running)``
instead differs only within the rounding bound below. Note ``max |P|`` over a row is exactly
``exp(m - lse) = 1 / l`` (the largest term of a row is ``exp(0)``), so a kernel gets amax_s exactly
from its final row state, without a second pass.

This module runs the semantics with torch ops on any device (CPU and CUDA alike), chunked over query
rows (memory O(rows_per_chunk * s_kv) per head): it is correct, not fast. The forward also runs on the
portable Triton kernel's FP8 switch (``backends/triton/fwd.py``, [Note] FP8): ``backend='auto'`` on CUDA
and ``backend='triton'`` (CPU tensors: Triton's interpreter) take it, ``backend='cpu'`` keeps this
emulation on any device, and calls the kernel does not take run the emulation (``_kernel_refuses``).
The kernel quantizes the unnormalized ``p = exp(S - m_running) <= 1`` and divides by the row sum at
the end; it stays within the bound below (tests/test_fp8_kernel.py). The backward likewise runs on the
portable kernel's FP8 switch (``backends/triton/bwd.py``, [Note] FP8; :func:`sdpa_fp8_backward`'s
``backend``, refusals in :func:`_kernel_refuses_bwd`) with this module's rounding points in its order: the
normalized P recomputed from the stats, P8 and dS8 quantized as above (tests/test_fp8_bwd_kernel.py). The
Gluon sm_90 FP8 kernels are the next step of issue 27.

The Gluon sm_90 forward (issue 27 item 3): on an sm_90 GPU with Gluon, head dims 64 and 128 run the Gluon
forward's FP8 switch ahead of the portable kernel (``backends/gluon/fwd_sm90.py``, [Note] FP8; routing in
:func:`_run_gluon_fp8`, ``plan.gluon_fp8_fwd``): the same rounding points, e4m3 / e5m2 wgmmas, whose sums
move into fp32 once per key tile rather than once per K-step of 32, so its ``u_mma`` is
``mma_unit(device, chain)`` with ``fwd_sm90.fp8_mma_chain``'s chain (4 at d=128; tests/test_gluon_fp8.py).

Error bound (forward; :func:`fusedattn.reference_fp8.fp8_forward_error_bound` computes it). Compared
with float64 attention of the dequantized inputs, ``O_ref = softmax(S) @ (v8 * descale_v)`` times
``c = scale_s * descale_s`` (1 for consistent scales), the dequantized output ``o / scale_o`` of
this module obeys, per element (i, c), to first order in the fp32 unit ``eps = 2^-24``::

    |o/scale_o - O_ref| <= (u8 + delta_i (1 + u8) + (s_kv + 4) eps) * sum_j P_ij |V_jc| * c
                           + a8 * descale_s * sum_{j kept} |V_jc|
                           + u_o * (|O_ref| + above) + a_o / scale_o

* ``u8, a8``: unit roundoff and half the smallest subnormal of P8's type: e4m3 ``2^-4, 2^-10``,
  e5m2 ``2^-3, 2^-17`` (rounding P * scale_s moves it by at most ``u8 |x| + a8``; it assumes
  ``scale_s <= FP8_MAX``, so that P <= 1 never saturates);
* ``delta_i = 2 * (d + 3) * eps * A_i + 2 * u_mma * A_i + (s_kv + 4) * eps (+ (|log2 scale_s| + 1) eps
  where the Gluon forward computes p * scale_s as one exponential)``: the relative error of P in row i,
  ``A_i = max_j attn_scale * descale_q * descale_k * sum_k |q8_ik k8_jk|`` (bmm1's products of two FP8
  values are exact in fp32, its sum of d terms and the three muls round), doubled to cover
  the row's log-sum-exp; the stats (natural-log lse) are within ``2 * delta_i`` of float64's;
* ``u_mma`` (:func:`mma_unit`): 0 where the products are summed in fp32 (this emulation, Triton's
  interpreter); on a GPU's FP8 MMAs :data:`MMA_UNIT_FP8` = ``2^-8``, and it joins the ``(s_kv + 4) eps``
  of P8 @ V's sum too. FP8 MMAs: Hopper's tensor cores add a K-step's 32 products aligned to the
  largest with about 14 bits (DeepSeek-V3's report; the kernel moves every step into fp32), so a step
  is off by at most ``32 * 2^-13`` of its largest product; bench/fp8_mma_probe.py measured 2^-9.4 at
  worst on an H100 (one large product among small ones) and 2^-13 on random operands. Where the portable
  kernels run their products as fp16 MMAs on the same FP8 values instead (``plan.fp8_fwd_mma16`` /
  ``plan.fp8_bwd_mma16``: the d256 forward and the backward on sm_90, where ``plan.fp8_mma16_compiles_right``
  allows), the conversions are exact
  and a 16-bit MMA sums in fp32, so the same ``u_mma`` over-covers them;
* ``u_o, a_o``: the output type's unit roundoff and half-subnormal (bf16 ``2^-8``, fp16 ``2^-11``
  and ``2^-25``, FP8 as above, fp32 0).

The code takes the fp32 terms and the subnormal floor twice (first-order analysis, so a factor of 2
covers the second-order terms); the tests require the error to stay within the bound and to reach
more than 5% of it (measured: 30-90% on random e4m3 inputs), so the bound is neither broken nor vacuous.

The P term dominates: for e4m3 P8 the relative error of O is about 6% of ``sum_j P_ij |V_j|``, which
is why the Graph door's users choose ``scale_s`` (and why the default here is 2^8 = 256 for e4m3,
keeping P in e4m3's normal range down to 2^-14).

Error bound (backward; :func:`fusedattn.reference_fp8.fp8_backward_bound`). Against float64 gradients of
attention of the dequantized inputs for ``dO8 * descale_dO`` (exact dS = P (dP - D) attn_scale with D
from O_ref), per element, first order, fp32 terms doubled as above::

    |dV/scale_dV - dV_ref| <= sum_i [(u8 + 2 delta'_i + 2 g_q) P_ij + a8 descale_s [kept]] |dO_ic|  (+ output)
    |dQ/scale_dQ - dQ_ref| <= sum_j e_ij |K_jc| + 2 g_kv sum_j (|dS_ij| + e_ij) |K_jc|             (+ output)
    |dK/scale_dK - dK_ref| <= sum_i e_ij |Q_ic| + 2 g_q  sum_i (|dS_ij| + e_ij) |Q_ic|             (+ output)
    e_ij = E_ij + u_dS (|dS_ij| + E_ij) + a_dS descale_dP [kept],
    E_ij = attn_scale P_ij (E_D_i + E_dP_ij + (delta'_i + 4 eps) (|dP_ij - D_i| + E_D_i + E_dP_ij))

with ``delta'_i = 2 delta_i`` (S recomputed and the forward's stats, each within the forward's delta_i,
``u_mma`` terms included), ``g_q = (s_q * g + 4) eps + u_mma``, ``g_kv = (s_kv + 4) eps + u_mma`` (the sums
of P8^T dO8 / dS8^T Q8 over query rows of a GQA group and of dS8 K8 over keys), ``E_dP = 2 ((d_v + 4) eps +
u_mma) sum_c |dO_ic||V_jc|``, ``E_D`` the error of D from the forward's rounded output (``|rowsum(dO (o *
descale_o - O_ref))|``) plus its fp32 sum, ``u_dS, a_dS`` of dO's type (dS8's), ``(+ output)`` the rounding
to the gradient's type as in the forward (``u_g (|ref| + above) + a_g / scale``). ``amax_dP`` is within
``max E`` of ``max |dS_ref|`` and each gradient's amax within its bound for fp32 output of ``max |ref|``;
each amax is exactly the max of the kernel's own unscaled values.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from .problem import ALIGNMENTS, Band, InvalidArgumentError, InvalidTypeError, NotSupportedError, keep_mask, make_band

__all__ = ["FP8_DTYPES", "FP8_MAX", "MMA_UNIT_FP8", "mma_unit", "is_fp8", "quantize", "quantize_per_tensor",
           "sdpa_fp8_forward", "sdpa_fp8_backward", "attention_fp8", "ROWS_PER_CHUNK"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# unit roundoff and half the smallest subnormal, per storage type (the error bound's u and a)
ROUNDING = {E4M3: (2.0 ** -4, 2.0 ** -10), E5M2: (2.0 ** -3, 2.0 ** -17),
            torch.bfloat16: (2.0 ** -8, 2.0 ** -134), torch.float16: (2.0 ** -11, 2.0 ** -25),
            torch.float32: (0.0, 0.0), torch.float64: (0.0, 0.0)}
# default scale_s: the largest power of two whose P = 1 does not saturate (descale exact)
DEFAULT_SCALE_S = {E4M3: 256.0, E5M2: 32768.0}
OUT_DTYPES = FP8_DTYPES + (torch.bfloat16, torch.float16, torch.float32)
ROWS_PER_CHUNK = 128
# The FP8 MMA's sum, relative to the sum of its products' magnitudes (module docstring, "FP8 MMAs"):
# sm_89 / sm_90 tensor cores add a K-step's 32 FP8 products aligned to the largest with about 14 bits,
# so each step is off by at most 32 * 2^-13 of its largest product; the kernel moves each step into
# fp32 (max_num_imprecise_acc=32), so the steps' errors add. bench/fp8_mma_probe.py, H100: worst
# 2^-9.4 (one large product among small ones), 2^-13 on random operands.
MMA_UNIT_FP8 = 2.0 ** -8


def mma_unit(device, chain: int = 1) -> float:
    """``u_mma`` of the error bound for FP8 products computed on ``device``: 0 where they are summed in
    fp32 (the CPU emulation, Triton's interpreter), :data:`MMA_UNIT_FP8` on a CUDA GPU's FP8 MMAs whose
    every K-step of 32 is moved into fp32 (the portable kernel). ``chain``: the K-steps an MMA adds up
    before its sum moves into fp32 (the Gluon sm_90 kernel's: ``backends/gluon/fwd_sm90.fp8_mma_chain``);
    each step's error is then relative to the chain's running sum, so the unit grows by the chain's length."""
    from .backends.triton.launch import interpreting
    device = torch.device(device)
    return chain * MMA_UNIT_FP8 if device.type == "cuda" and not interpreting() else 0.0


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 ``x`` to ``dtype``: nearest even, saturating at the largest finite value for FP8
    (the ``cvt.rn.satfinite`` of FP8 kernels; torch's own cast gives inf for e5m2 overflow)."""
    if dtype in FP8_DTYPES:
        m = FP8_MAX[dtype]
        x = x.clamp(-m, m)
    return x.to(dtype)


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype = E4M3) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x8, descale)``: ``x`` scaled by a power of two so that ``max |x|`` lands in
    ``(FP8_MAX / 2, FP8_MAX]``, then rounded; ``x8.float() * descale`` approximates ``x`` (descale
    fp32 ``[1, 1, 1, 1]``, a power of two, so dequantizing is exact)."""
    if dtype not in FP8_DTYPES:
        raise InvalidTypeError(f"quantize_per_tensor: dtype must be one of {FP8_DTYPES}, got {dtype}")
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    exp = 0 if amax == 0 or not math.isfinite(amax) else math.floor(math.log2(FP8_MAX[dtype] / amax))
    scale = 2.0 ** exp
    x8 = quantize(x.detach().float() * scale, dtype)
    return x8, torch.full((1, 1, 1, 1), 1.0 / scale, dtype=torch.float32, device=x.device)


# ---------------------------------------------------------------------------------------------
# argument helpers
# ---------------------------------------------------------------------------------------------

def _scale(value, name: str, device, heads: Optional[int] = None, where: str = "") -> torch.Tensor:
    """A per-tensor scale as fp32 ``[1, 1, 1, 1]`` on ``device`` (or per-head ``[1, heads, 1, 1]``
    when ``heads`` is given and ``value`` has that many elements)."""
    pre = f"{where}: " if where else ""
    if value is None:
        raise InvalidArgumentError(f"{pre}{name} is required for FP8 attention (a float or an fp32 tensor "
                                   f"[1, 1, 1, 1]); got None")
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise InvalidTypeError(f"{pre}{name} must be a float or a float tensor, got {type(value).__name__}")
    if not isinstance(value, torch.Tensor):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{pre}{name} must be finite, got {value}")
        return torch.full((1, 1, 1, 1), float(value), dtype=torch.float32, device=device)
    if not value.is_floating_point() or value.dtype in FP8_DTYPES:
        raise InvalidTypeError(f"{pre}{name} must be a float32 (or other 16/32/64-bit float) tensor, "
                               f"got {value.dtype}")
    n = value.numel()
    if n == 1:
        return value.reshape(1, 1, 1, 1).to(device=device, dtype=torch.float32)
    if heads is not None and n == heads:
        # contiguous: the kernels read per-head scales at a stride of one element (a strided view, e.g.
        # buf[::2], would hand them other heads' values)
        return value.reshape(1, heads, 1, 1).to(device=device, dtype=torch.float32).contiguous()
    what = "one element" + (f" or one per head ({heads})" if heads is not None else "")
    raise InvalidArgumentError(f"{pre}{name} must have {what}, got shape {list(value.shape)}")


def _lengths(t, name: str, b: int, s: int, device) -> torch.Tensor:
    if t is None:
        return torch.full((b,), s, dtype=torch.int64, device=device)
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise InvalidTypeError(f"{name} must be an int32 tensor [b] or [b, 1, 1, 1], got "
                               f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.numel() != b:
        raise InvalidArgumentError(f"{name} must have b = {b} elements ([b] or [b, 1, 1, 1]), got shape "
                                   f"{list(t.shape)}")
    # clamped into [0, s] as the kernels do, so a bad length never reads out of bounds
    return t.reshape(b).to(device=device, dtype=torch.int64).clamp(0, s)


def _as_band(band) -> Optional[Band]:
    if band is None or isinstance(band, Band):
        return band
    align, left, right = band
    if align not in ALIGNMENTS:
        raise InvalidArgumentError(f"band alignment must be one of {ALIGNMENTS}, got {align!r}")
    return Band(align, left, right)


def _check_qkv(q, k, v, where: str, names=("q", "k", "v")) -> Tuple[int, ...]:
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{where}: {name} must be a torch tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InvalidArgumentError(f"{where}: {name} must be 4-D [b, h, s, d], got shape {list(t.shape)}")
    b, h_q, s_q, d = q.shape
    bk, h_kv, s_kv, dk = k.shape
    bv, h_v, s_v, d_v = v.shape
    if bk != b or bv != b:
        raise InvalidArgumentError(f"{where}: batch sizes differ: q {list(q.shape)}, k {list(k.shape)}, "
                                   f"v {list(v.shape)}")
    if dk != d:
        raise InvalidArgumentError(f"{where}: k's head dim {dk} differs from q's {d}")
    if h_v != h_kv or s_v != s_kv:
        raise InvalidArgumentError(f"{where}: k {list(k.shape)} and v {list(v.shape)} must share heads and "
                                   f"sequence length")
    if h_kv == 0 or h_q % h_kv:
        raise InvalidArgumentError(f"{where}: query heads ({h_q}) must be a multiple of key/value heads "
                                   f"({h_kv}) (GQA/MQA)")
    return b, h_q, h_kv, s_q, s_kv, d, d_v


def _group(x: torch.Tensor, g: int) -> torch.Tensor:
    """[b, h_kv, s, d] -> [b, h_kv * g, s, d] (query head i reads kv head i // g), fp32."""
    x = x.float()
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _amax_into(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.maximum(acc, x.abs().amax()) if x.numel() else acc


def _cast_out(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return quantize(x * scale, dtype)


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------

def sdpa_fp8_forward(q, k, v, *, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o,
                     attn_scale=None, band=None, seq_len_q=None, seq_len_kv=None, o_dtype=None,
                     backend: str = "auto", where: str = "sdpa_fp8"):
    """cuDNN's ``sdpa_fp8`` forward (module docstring), on torch tensors.

    Args:
        q ``[b, h_q, s_q, d]``, k ``[b, h_kv, s_kv, d]``, v ``[b, h_kv, s_kv, d_v]``: FP8 (all the same
            type; fp32/bf16/fp16 values are accepted too and read as they are, for tests).
        descale_* / scale_*: floats or fp32 tensors with one element (descale_q / k / v may also have
            one per head, descale_q per query head and descale_k / descale_v per kv head: the kernels read
            them per head).
        attn_scale: float, default ``1 / sqrt(d)``. band: a :class:`~fusedattn.problem.Band`, an
            ``(alignment, left, right)`` tuple or None. seq_len_q / seq_len_kv: int ``[b]`` (padding).
        o_dtype: output type (default q's).
        backend: ``"auto"`` (CUDA tensors: the kernels, Gluon's on sm_90 where it takes the call, else the
            portable Triton one; CPU tensors: the emulation), ``"triton"``
            (the kernel; on CPU tensors under Triton's interpreter) or ``"cpu"`` (the emulation).
            What the kernel does not take runs the emulation on any backend (:func:`_kernel_refuses`).

    Returns:
        ``(o [b, h_q, s_q, d_v] o_dtype, stats [b, h_q, s_q, 1] fp32, amax_s fp32 [1, 1, 1, 1],
        amax_o fp32 [1, 1, 1, 1])``; an empty row gives o = 0 and stats = -inf.
    """
    b, h_q, h_kv, s_q, s_kv, d, d_v = _check_qkv(q, k, v, where)
    dev = q.device
    g = h_q // h_kv
    p_dtype = q.dtype
    o_dtype = o_dtype or q.dtype
    if o_dtype not in OUT_DTYPES:
        raise InvalidTypeError(f"{where}: output dtype must be one of {OUT_DTYPES}, got {o_dtype}")
    dq, dk = _scale(descale_q, "descale_q", dev, h_q, where), _scale(descale_k, "descale_k", dev, h_kv, where)
    dv = _scale(descale_v, "descale_v", dev, h_kv, where)
    ds, ss = _scale(descale_s, "descale_s", dev, where=where), _scale(scale_s, "scale_s", dev, where=where)
    so = _scale(scale_o, "scale_o", dev, where=where)
    scale = float(attn_scale) if attn_scale is not None else d ** -0.5
    band = _as_band(band)
    # the lengths given, checked and clamped; the kernel takes None for "every row / key"
    len_q = _lengths(seq_len_q, "seq_len_q", b, s_q, dev) if seq_len_q is not None else None
    len_kv = _lengths(seq_len_kv, "seq_len_kv", b, s_kv, dev) if seq_len_kv is not None else None
    scales = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_s=ds, scale_s=ss, scale_o=so)
    if _use_kernel(backend, dev, where) and not _refused(_kernel_refuses(q, k, v, scales, scale), where, dev):
        return _forward_kernel(q, k, v, scales, scale, band, len_q, len_kv, o_dtype)
    len_q = len_q if len_q is not None else _lengths(None, "seq_len_q", b, s_q, dev)
    len_kv = len_kv if len_kv is not None else _lengths(None, "seq_len_kv", b, s_kv, dev)
    dk, dv = (x if x.shape[1] == 1 else x.repeat_interleave(g, dim=1) for x in (dk, dv))
    kf, vf = _group(k, g), _group(v, g)
    o = torch.empty((b, h_q, s_q, d_v), dtype=o_dtype, device=dev)
    stats = torch.empty((b, h_q, s_q, 1), dtype=torch.float32, device=dev)
    amax_s = torch.zeros((), dtype=torch.float32, device=dev)
    amax_o = torch.zeros((), dtype=torch.float32, device=dev)
    for i0 in range(0, s_q, ROWS_PER_CHUNK):
        rows = torch.arange(i0, min(i0 + ROWS_PER_CHUNK, s_q), device=dev)
        # bmm1: products of two FP8 values are exact in fp32; then cuDNN's three muls, in its order
        s = q[:, :, i0:i0 + len(rows)].float() @ kf.transpose(-1, -2)
        s = s * scale * dq * dk
        s = s.masked_fill(~keep_mask(rows, s_kv, len_q, len_kv, band), float("-inf"))
        m = s.amax(-1, keepdim=True)
        empty = torch.isinf(m)                              # no key kept: all -inf
        m = torch.where(empty, torch.zeros_like(m), m)
        e = torch.exp(s - m)
        l = e.sum(-1, keepdim=True)
        p = e / torch.where(empty, torch.ones_like(l), l)
        stats[:, :, i0:i0 + len(rows)] = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(l))
        amax_s = _amax_into(amax_s, p)
        p8 = quantize(p * ss, p_dtype)
        out = (p8.float() @ vf) * ds * dv                   # matmul_fp8: descale A (P), then B (V)
        amax_o = _amax_into(amax_o, out)
        o[:, :, i0:i0 + len(rows)] = _cast_out(out, so, o_dtype)
    return o, stats, amax_s.reshape(1, 1, 1, 1), amax_o.reshape(1, 1, 1, 1)


def _use_kernel(backend: str, device, where: str) -> bool:
    """Whether ``backend`` asks for the Triton kernel: 'auto' and 'triton' on CUDA tensors, 'triton' on
    CPU tensors (Triton's interpreter; refused without it, as plan.choose_backend). 'cpu' (and 'auto'
    on the CPU) is the emulation, on the tensors' own device."""
    from .plan import BACKENDS, choose_backend, fp8_kernels_run
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cpu":
        return False
    use = choose_backend(backend, device.type) == "triton" if backend == "triton" else device.type == "cuda"
    if use and not fp8_kernels_run(device):
        if backend == "triton":
            raise NotSupportedError(
                f"{where}: backend='triton': the FP8 kernels need a GPU of compute capability 8.9 or higher "
                f"(Triton compiles float8_e4m3fn there only); {device} is {_capability_text(device)}. "
                f"backend='auto' runs the exact torch emulation on it")
        from .backends.compat import warn_once
        warn_once(f"fp8-emulation-{device}", f"{device} ({_capability_text(device)}) has no FP8 kernels (Triton "
                                             f"compiles float8_e4m3fn for compute capability 8.9+ only): FP8 "
                                             f"attention runs the exact torch emulation there, same results, far "
                                             f"slower")
        return False
    return use


def _capability_text(device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"


# why the kernels refuse a call that a user makes on purpose only in tests (16-bit values through the FP8 door,
# the emulation's reference use; empty tensors): no warning for those
_QUIET_REFUSALS = ("empty tensors", "inputs are not of one float8 type")


def _refused(why: Optional[str], where: str, device) -> bool:
    """Whether a kernel refused the call (``why`` not None); on a GPU, once per (entry point, reason), a warning
    that the call runs the torch emulation instead (the same results, far slower): per-head descales in the
    backward above all, whose kernels take one scale per tensor."""
    if why is None:
        return False
    if device.type == "cuda" and why not in _QUIET_REFUSALS:
        from .backends.compat import warn_once
        warn_once(f"fp8-refused-{where}-{why}", f"{where} on {device}: the FP8 kernels do not take this call "
                                                f"({why}): it runs the exact torch emulation, far slower")
    return True


def _per_head(scales) -> bool:
    """Whether any of the call's scales holds one value per head (``_scale``'s ``[1, h, 1, 1]``): the forward
    kernels read those per program; the backward kernels take one per tensor."""
    return any(t.numel() != 1 for t in scales.values())


def _kernel_refuses(q, k, v, scales, attn_scale: float) -> Optional[str]:
    """Why the FP8 Triton forward cannot run this call (None: it can). These run the emulation:

    * q, k, v that are not of one float8 type (the emulation reads fp32 / bf16 / fp16 values as they are,
      for tests);
    * head dims past MAX_HEAD_DIM (256), as the 16-bit kernels;
    * attn_scale <= 0: the kernel's unmasked tiles take the row max of the raw products (scale > 0);
    * empty tensors (nothing to launch).
    """
    from .problem import MAX_HEAD_DIM
    d, d_v = q.shape[-1], v.shape[-1]
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return "empty tensors"
    if not is_fp8(q) or k.dtype != q.dtype or v.dtype != q.dtype:
        return "inputs are not of one float8 type"
    if max(d, d_v) > MAX_HEAD_DIM:
        return f"head dim past {MAX_HEAD_DIM}"
    if not attn_scale > 0:
        return "attn_scale <= 0"
    return None


def _forward_kernel(q, k, v, scales, attn_scale: float, band: Optional[Band], len_q, len_kv, o_dtype, out=None,
                    stats_out=None):
    """:func:`sdpa_fp8_forward` on the portable Triton kernel's FP8 switch (backends/triton/fwd.py
    ``launch_fwd_fp8``). scales: one-element fp32 tensors on q's device; len_q / len_kv: int64 ``[b]``
    clamped lengths or None. out / stats_out: buffers to write (tests pass NaN-filled ones: every element
    must be written), default new ones. Returns what :func:`sdpa_fp8_forward` returns."""
    from .backends.triton.fwd import launch_fwd_fp8
    from .plan import fp8_fwd_mma16, fp8_fwd_tiles
    b, h_q, s_q, d = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    p, extras = _kernel_problem(q, k, v, attn_scale, band, len_q, len_kv)
    o = torch.empty((b, h_q, s_q, d_v), dtype=o_dtype, device=dev) if out is None else out
    stats = torch.empty((b, h_q, s_q, 1), dtype=torch.float32, device=dev) if stats_out is None else stats_out
    amax = torch.zeros(2, dtype=torch.float32, device=dev)      # [amax_s, amax_o]: the kernel maxes into them
    if dev.type == "cuda" and _run_gluon_fp8(p, q, k, v, o, stats, scales, amax, extras):
        return o, stats, amax[0].reshape(1, 1, 1, 1), amax[1].reshape(1, 1, 1, 1)
    mma16 = fp8_fwd_mma16(d, d_v)
    if s_kv > 1 and v.stride(2) != 1 and not mma16:
        # FP8 MMAs read both operands K-major from shared memory, and P8 @ V's K is the key: V with its
        # keys innermost lets the kernel prefetch V's tiles as it does K's. With d innermost each V tile is
        # loaded synchronously and transposed through registers (bench/fp8_v_layout.py: 100 TFLOP/s on an
        # H100 at b4 h32 s2k d128). One copy of V per call, a few percent of the forward's time. (fp16 MMAs
        # take V either way: no copy.)
        v = v.transpose(2, 3).contiguous().transpose(2, 3)
    launch_fwd_fp8(p, fp8_fwd_tiles(d, d_v), q, k, v, o, stats[..., 0], extras, scales, amax[0:1], amax[1:2],
                   mma16=mma16)
    return o, stats, amax[0].reshape(1, 1, 1, 1), amax[1].reshape(1, 1, 1, 1)


# the order of the scales in the Gluon kernel's SCALES [6] (backends/gluon/fwd_sm90.py, _attn_fwd_sm90)
_GLUON_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


_ONES: dict = {}


def _one(device) -> torch.Tensor:
    """A one-element fp32 1.0 on ``device``, made once (the per-tensor places of per-head descales; never
    written)."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((1, ), dtype=torch.float32, device=device)
    return one


def _run_gluon_fp8(p, q, k, v, o, stats, scales, amax, extras) -> bool:
    """The forward on the Gluon sm_90 kernel's FP8 switch when it takes the call (``fwd_sm90.supports_fp8``:
    sm_90, head dims 64 / 128, TMA-ready q and k), or at d = 224 / 256 on its 16-bit MMAs (``supports_fp8_16``,
    [Note] FP8 on 16-bit MMAs); False (nothing launched, or a failed launch on a Triton
    we do not support, whose amaxes are zeroed again) lets the portable kernel run it. The Gluon modules come
    through the functional door's loader, so an unsupported Triton turns them off once, with a warning.
    Per-head descales go over as they are (the kernel's FP8_HEAD_SCALES), 1 in their per-tensor places."""
    from .functional import _gluon_kernels, _gluon_ran      # late: functional dispatches here
    from .plan import gluon_fp8_fwd
    if not gluon_fp8_fwd(p.d, p.d_v):
        return False
    gluon = _gluon_kernels("fp8-forward", "fwd_sm90")
    if gluon is None:
        return False
    fwd = gluon[0]
    lens = dict(seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"])
    per_tensor, heads = scales, None
    if _per_head(scales):
        heads = (scales["descale_q"], scales["descale_k"], scales["descale_v"])
        one = _one(q.device)
        per_tensor = dict(scales, descale_q=one, descale_k=one, descale_v=one)
    if fwd.supports_fp8(p, q, k, v, o, **lens):
        def launch(sc):
            fwd.launch_fwd_sm90_fp8(p, q, k, fwd.transposed_v(v), o, stats[..., 0], sc, amax, head_scales=heads,
                                    **lens)
    elif fwd.supports_fp8_16(p, q, k, v, o, **lens):
        def launch(sc):
            fwd.launch_fwd_sm90_fp8_16(p, q, k, v, o, stats[..., 0], sc, amax, head_scales=heads, **lens)
    else:
        return False

    def go():
        launch(torch.cat([per_tensor[name].reshape(1) for name in _GLUON_SCALES]))
        return True

    if _gluon_ran("fp8-forward", go):
        return True
    amax.zero_()
    return False


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------

def sdpa_fp8_backward(q, k, v, o, dO, stats, *, descale_q, descale_k, descale_v, descale_o, descale_dO,
                      descale_s, descale_dP, scale_s, scale_dQ, scale_dK, scale_dV, scale_dP, attn_scale=None,
                      band=None, seq_len_q=None, seq_len_kv=None, grad_dtype=None, backend: str = "auto",
                      where: str = "sdpa_fp8_backward"):
    """cuDNN's ``sdpa_fp8_backward`` (module docstring), on torch tensors.

    Args:
        q, k, v as in :func:`sdpa_fp8_forward`; o and dO ``[b, h_q, s_q, d_v]`` (FP8, or any float);
        stats fp32 ``[b, h_q, s_q, 1]`` from the forward. P8 takes q's type and dS8 dO's type, as in
        cuDNN's graph. grad_dtype: type of dQ / dK / dV (default q's).
        backend: as :func:`sdpa_fp8_forward`'s: ``"auto"`` (CUDA: the portable Triton kernel's FP8
            backward; CPU: the emulation), ``"triton"`` (the kernel; CPU tensors under Triton's
            interpreter), ``"cpu"`` (the emulation on any device). What the kernel does not take (per-head
            descales, dO not float8, ...: :func:`_kernel_refuses_bwd`) runs the emulation.

    Returns:
        ``(dQ, dK, dV, amax_dQ, amax_dK, amax_dV, amax_dP)``: gradients shaped like q, k, v; amaxes
        fp32 ``[1, 1, 1, 1]``.
    """
    b, h_q, h_kv, s_q, s_kv, d, d_v = _check_qkv(q, k, v, where)
    for name, t, shape in (("o", o, (b, h_q, s_q, d_v)), ("dO", dO, (b, h_q, s_q, d_v)),
                           ("stats", stats, (b, h_q, s_q, 1))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise InvalidArgumentError(f"{where}: {name} must have shape {list(shape)}, got "
                                       f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    dev = q.device
    g = h_q // h_kv
    grad_dtype = grad_dtype or q.dtype
    if grad_dtype not in OUT_DTYPES:
        raise InvalidTypeError(f"{where}: gradient dtype must be one of {OUT_DTYPES}, got {grad_dtype}")
    sc = {name: _scale(val, name, dev, where=where) for name, val in (
        ("descale_o", descale_o), ("descale_dO", descale_dO), ("descale_s", descale_s),
        ("descale_dP", descale_dP), ("scale_s", scale_s), ("scale_dQ", scale_dQ), ("scale_dK", scale_dK),
        ("scale_dV", scale_dV), ("scale_dP", scale_dP))}
    dq_s = _scale(descale_q, "descale_q", dev, h_q, where)
    dk_s, dv_s = _scale(descale_k, "descale_k", dev, h_kv, where), _scale(descale_v, "descale_v", dev, h_kv, where)
    dk_g, dv_g = (x if x.shape[1] == 1 else x.repeat_interleave(g, dim=1) for x in (dk_s, dv_s))
    scale = float(attn_scale) if attn_scale is not None else d ** -0.5
    band = _as_band(band)
    if _use_kernel(backend, dev, where) and not _refused(_kernel_refuses_bwd(q, k, v, o, dO, dict(
            sc, descale_q=dq_s, descale_k=dk_s, descale_v=dv_s)), where, dev):
        len_q = _lengths(seq_len_q, "seq_len_q", b, s_q, dev) if seq_len_q is not None else None
        len_kv = _lengths(seq_len_kv, "seq_len_kv", b, s_kv, dev) if seq_len_kv is not None else None
        scales = dict(sc, descale_q=dq_s, descale_k=dk_s, descale_v=dv_s)
        dq, dk, dv = _grad_buffers(q, k, v, grad_dtype)      # one set, whichever kernel takes the call
        if len_q is None and len_kv is None:
            done = _backward_gluon(q, k, v, o, dO, stats, scales, scale, band, grad_dtype, dq, dk, dv)
            if done is not None:
                return done
        return _backward_kernel(q, k, v, o, dO, stats, scales, scale, band, len_q, len_kv, grad_dtype, dq, dk, dv)
    len_q, len_kv = _lengths(seq_len_q, "seq_len_q", b, s_q, dev), _lengths(seq_len_kv, "seq_len_kv", b, s_kv, dev)
    kf, vf = _group(k, g), _group(v, g)
    p_dtype, ds_dtype = q.dtype, dO.dtype
    dq = torch.empty((b, h_q, s_q, d), dtype=grad_dtype, device=dev)
    dk_acc = torch.zeros((b, h_q, s_kv, d), dtype=torch.float32, device=dev)
    dv_acc = torch.zeros((b, h_q, s_kv, d_v), dtype=torch.float32, device=dev)
    amax = {n: torch.zeros((), dtype=torch.float32, device=dev) for n in ("dQ", "dK", "dV", "dP")}
    for i0 in range(0, s_q, ROWS_PER_CHUNK):
        rows = torch.arange(i0, min(i0 + ROWS_PER_CHUNK, s_q), device=dev)
        sl = slice(i0, i0 + len(rows))
        qc, doc = q[:, :, sl].float(), dO[:, :, sl].float()
        D = (doc * o[:, :, sl].float()).sum(-1, keepdim=True) * sc["descale_dO"] * sc["descale_o"]
        s = (qc @ kf.transpose(-1, -2)) * scale * dq_s * dk_g
        keep = keep_mask(rows, s_kv, len_q, len_kv, band)
        lse = stats[:, :, sl].float()
        # exp(S - stats); masked keys and empty rows (stats -inf) have probability 0, never NaN
        p = torch.where(keep & torch.isfinite(lse), torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)), 0.0)
        p8 = quantize(p * sc["scale_s"], p_dtype).float()
        dv_acc += p8.transpose(-1, -2) @ doc
        dp = (doc @ vf.transpose(-1, -2)) * sc["descale_dO"] * dv_g
        dS = (dp - D) * p * scale
        amax["dP"] = _amax_into(amax["dP"], dS)
        ds8 = quantize(dS * sc["scale_dP"], ds_dtype).float()
        dq_c = (ds8 @ kf) * sc["descale_dP"] * dk_g
        amax["dQ"] = _amax_into(amax["dQ"], dq_c)
        dq[:, :, sl] = _cast_out(dq_c, sc["scale_dQ"], grad_dtype)
        dk_acc += ds8.transpose(-1, -2) @ qc
    # GQA: the group's query heads sum before the descales (matmul_fp8's gqa_c reduction)
    if dq_s.shape[1] == 1:
        dk_f = dk_acc.view(b, h_kv, g, s_kv, d).sum(2) * sc["descale_dP"] * dq_s
    else:      # per-head descale_q (fusedattn's addition): each query head's share is descaled first
        dk_f = (dk_acc * dq_s).view(b, h_kv, g, s_kv, d).sum(2) * sc["descale_dP"]
    dv_f = dv_acc.view(b, h_kv, g, s_kv, d_v).sum(2) * sc["descale_s"] * sc["descale_dO"]
    amax["dK"] = _amax_into(amax["dK"], dk_f)
    amax["dV"] = _amax_into(amax["dV"], dv_f)
    dk = _cast_out(dk_f, sc["scale_dK"], grad_dtype)
    dv = _cast_out(dv_f, sc["scale_dV"], grad_dtype)
    a = {n: x.reshape(1, 1, 1, 1) for n, x in amax.items()}
    return dq, dk, dv, a["dQ"], a["dK"], a["dV"], a["dP"]


def _kernel_refuses_bwd(q, k, v, o, dO, scales) -> Optional[str]:
    """Why the FP8 Triton backward cannot run this call (None: it can): what :func:`_kernel_refuses` says
    of q, k, v (attn_scale aside: the backward takes no row max), and dO not float8 (dS8 takes dO's type;
    cuDNN's dO is FP8), o not a float type the kernel loads (float8, bf16, fp16, fp32)."""
    why = _kernel_refuses(q, k, v, scales, 1.0)
    if why:
        return why
    if _per_head(scales):
        return "per-head descales"     # the backward kernels read one scale per tensor (the forward's: per head)
    if not is_fp8(dO):
        return "dO is not float8"
    if o.dtype not in OUT_DTYPES:
        return f"o is {o.dtype}"
    return None


def _kernel_problem(q, k, v, attn_scale: float, band: Optional[Band], len_q, len_kv):
    """(AttentionProblem, extras) of an FP8 kernel call: band bounds of s_q + s_kv or more are unbounded,
    so the kernels' int32 row + offset arithmetic cannot overflow."""
    from .problem import AttentionProblem
    b, h_q, s_q, d = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    if band is not None:
        far = s_q + s_kv
        left = band.left if band.left is not None and band.left < far else None
        right = band.right if band.right is not None and band.right < far else None
        band = None if left is None and right is None else Band(band.alignment, left, right)
    p = AttentionProblem(b=b, h_q=h_q, h_kv=h_kv, s_q=s_q, s_kv=s_kv, d=d, d_v=d_v, dtype=q.dtype,
                         device_type=q.device.type, scale=attn_scale, band=band, has_seq_len_q=len_q is not None,
                         has_seq_len_kv=len_kv is not None)
    extras = dict(seq_len_q=None if len_q is None else len_q.to(torch.int32),
                  seq_len_kv=None if len_kv is None else len_kv.to(torch.int32), slopes=None, sink=None)
    return p, extras


def _backward_gluon(q, k, v, o, dO, stats, scales, attn_scale: float, band: Optional[Band], grad_dtype,
                    dq_out=None, dk_out=None, dv_out=None):
    """:func:`sdpa_fp8_backward` on the Gluon sm_90 backward's FP8 switch (bwd_fused_sm90 [Note] FP8: the same
    rounding points as the emulation) where it runs the call (``plan.gluon_fp8_bwd``; ``supports_fp8``: sm_90,
    d = d_v in 64 / 128 on the single-pass kernel, no mask or causal, or in 224 / 256 on the two passes,
    ``bwd_dkdv_sm90.launch_bwd_fp8``, windows too; no lengths), else None. The module comes through the
    functional door's loader, as the forward's
    (:func:`_run_gluon_fp8`): on an unsupported Triton a failed import or launch turns it off once, with a
    warning, and the portable kernel runs the call. Arguments as :func:`_backward_kernel`'s; returns what it
    returns."""
    from .functional import _gluon_kernels, _gluon_ran      # late: functional dispatches here
    from .plan import gluon_fp8_bwd
    if not (q.is_cuda and gluon_fp8_bwd(q.shape[3], v.shape[3])):
        return None
    two_pass = q.shape[3] > 128
    gluon = _gluon_kernels("fp8-backward", "bwd_dkdv_sm90" if two_pass else "bwd_fused_sm90")
    if gluon is None:
        return None
    bwd = gluon[0]
    p, _ = _kernel_problem(q, k, v, attn_scale, band, None, None)
    dq, dk, dv = _grad_buffers(q, k, v, grad_dtype, dq_out, dk_out, dv_out)
    if not bwd.supports_fp8(p, q, k, v, o, dO, dq, dk, dv):
        return None
    buf, amax = _bwd_scale_buffers(scales, q.device)
    launch = bwd.launch_bwd_fp8 if two_pass else bwd.launch_bwd_fused_fp8

    def go():
        launch(p, q, k, v, o, dO, stats[..., 0], buf, amax, dq, dk, dv)
        return True

    if not _gluon_ran("fp8-backward", go):
        return None         # the portable kernel rewrites every gradient, with amaxes of its own
    a = [amax[i].reshape(1, 1, 1, 1) for i in range(4)]
    return dq, dk, dv, a[0], a[1], a[2], a[3]


def _grad_buffers(q, k, v, grad_dtype, dq_out=None, dk_out=None, dv_out=None):
    """The FP8 backward kernels' dQ, dK, dV: the caller's buffers, or new ones shaped like q, k, v (d_v for dV)
    in ``grad_dtype``."""
    b, h_q, s_q, d = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    dq = torch.empty((b, h_q, s_q, d), dtype=grad_dtype, device=dev) if dq_out is None else dq_out
    dk = torch.empty((b, h_kv, s_kv, d), dtype=grad_dtype, device=dev) if dk_out is None else dk_out
    dv = torch.empty((b, h_kv, s_kv, d_v), dtype=grad_dtype, device=dev) if dv_out is None else dv_out
    return dq, dk, dv


def _bwd_scale_buffers(scales, dev):
    """(the twelve scales as one fp32 [12] buffer the kernels read, in ``FP8_BWD_SCALE_NAMES``' order: a device-side
    copy, so a CUDA graph replays the callers' new values; a zeroed fp32 [4] the kernels max dQ, dK, dV, dP into)."""
    from .backends.triton.bwd import FP8_BWD_SCALE_NAMES
    buf = torch.cat([scales[n].reshape(1).to(device=dev, dtype=torch.float32) for n in FP8_BWD_SCALE_NAMES])
    return buf, torch.zeros(4, dtype=torch.float32, device=dev)


def _backward_kernel(q, k, v, o, dO, stats, scales, attn_scale: float, band: Optional[Band], len_q, len_kv,
                     grad_dtype, dq_out=None, dk_out=None, dv_out=None):
    """:func:`sdpa_fp8_backward` on the portable Triton kernel's FP8 switch (backends/triton/bwd.py
    ``launch_bwd_fp8``). scales: the twelve one-element fp32 tensors on q's device, by name; len_q / len_kv:
    int64 ``[b]`` clamped lengths or None. dq_out / dk_out / dv_out: buffers to write (tests pass NaN-filled
    ones: every element must be written), default new ones. Returns what :func:`sdpa_fp8_backward` returns."""
    from .backends.triton.bwd import launch_bwd_fp8
    from .plan import fp8_bwd_mma16, fp8_bwd_tiles
    d, d_v = q.shape[3], v.shape[3]
    p, extras = _kernel_problem(q, k, v, attn_scale, band, len_q, len_kv)
    dq, dk, dv = _grad_buffers(q, k, v, grad_dtype, dq_out, dk_out, dv_out)
    buf, amax = _bwd_scale_buffers(scales, q.device)
    tiles_dkdv, tiles_dq = fp8_bwd_tiles(d, d_v)
    launch_bwd_fp8(p, tiles_dkdv, tiles_dq, q, k, v, o, dO, stats[..., 0], extras, buf, amax, dq, dk, dv,
                   mma16=fp8_bwd_mma16(d, d_v))
    a = [amax[i].reshape(1, 1, 1, 1) for i in range(4)]
    return dq, dk, dv, a[0], a[1], a[2], a[3]


# ---------------------------------------------------------------------------------------------
# the functional door's FP8 path
# ---------------------------------------------------------------------------------------------

class _Fp8StraightThrough(torch.autograd.Function):
    """Forward: the FP8 semantics on the per-tensor quantized q, k, v. Backward (the documented choice
    for now): fusedattn's 16-bit backward on the *dequantized* inputs in the inputs' dtype, with the
    FP8 forward's output and stats; the quantization itself passes gradients straight through."""

    @staticmethod
    def forward(ctx, q, k, v, opts):
        q8, dq = quantize_per_tensor(q)
        k8, dk = quantize_per_tensor(k)
        v8, dv = quantize_per_tensor(v)
        o, stats, amax_s, amax_o = sdpa_fp8_forward(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,
                                                    o_dtype=q.dtype, **opts["fwd"])
        deq = [(x8.float() * s).to(q.dtype) for x8, s in ((q8, dq), (k8, dk), (v8, dv))]
        ctx.save_for_backward(*deq, o, stats)
        ctx.opts = opts
        ctx.mark_non_differentiable(stats, amax_s, amax_o)
        return o, stats, amax_s, amax_o

    @staticmethod
    def backward(ctx, grad_o, _gs, _ga, _gb):
        from .functional import attention_backward      # late: functional dispatches here
        q, k, v, o, stats = ctx.saved_tensors
        if grad_o is None:
            return None, None, None, None
        dq, dk, dv, _ = attention_backward(q, k, v, o, grad_o.to(q.dtype).contiguous(), stats[..., 0],
                                           **ctx.opts["bwd"])
        return dq, dk, dv, None


def _unsupported(where: str, **given) -> None:
    names = [n for n, val in given.items() if val is not None and val is not False and val != 0.0]
    if names:
        raise NotSupportedError(f"NYI: {where} with FP8 inputs does not take {', '.join(names)} yet (FP8 "
                                f"attention runs causal / window / padding masks and GQA)")


def attention_fp8(q, k, v, *, descale_q=None, descale_k=None, descale_v=None, attn_scale=None, causal=False,
                  causal_alignment="top_left", window=None, seq_len_q=None, seq_len_kv=None, scale_s=None,
                  descale_s=None, scale_o=None, out_dtype=None, return_stats=False, return_amax=False,
                  backend="auto", where="attention"):
    r"""FP8 attention through the functional door (``fusedattn.attention`` calls this for FP8 inputs).

    Two ways in:

    * ``q, k, v`` in ``torch.float8_e4m3fn`` (or ``float8_e5m2``) with ``descale_q`` / ``descale_k`` /
      ``descale_v`` (required: a float, a one-element fp32 tensor, or one per head: ``[h_q]`` for q,
      ``[h_kv]`` for k / v): the values are ``q.float() * descale_q`` and so on. Forward only: a
      gradient for a float8 tensor would be stored in float8 by autograd, so FP8 inputs that
      require grad raise NotSupportedError.
    * ``q, k, v`` in bf16 / fp16 / fp32 without descales: each is quantized per tensor to e4m3 with a
      power-of-two scale (:func:`quantize_per_tensor`), the forward runs the FP8 semantics, and the
      backward (autograd) is fusedattn's 16-bit backward on the dequantized inputs in their dtype,
      with the FP8 forward's output and stats (straight-through quantization; the documented
      choice: the FP8 backward kernel, :func:`sdpa_fp8_backward`, would add dO's and dS's e4m3 rounding
      for little speed: on Hopper it runs 0.92-1.14x the 16-bit backward at d = 128 and 0.91-0.98x at
      d = 224 / 256, elsewhere slower, bench/NOTES.md 72-73).

    The semantics are cuDNN's ``sdpa_fp8`` (:mod:`fusedattn.fp8`): P is quantized with ``scale_s``
    (default 256 for e4m3, 32768 for e5m2) and dequantized with ``descale_s`` (default
    ``1 / scale_s``); the output is ``O * scale_o`` (default 1) in ``out_dtype`` (default bf16 for FP8
    inputs, the inputs' dtype otherwise; a float8 type for an FP8 output).

    Args:
        q ``[b, h_q, s_q, d]``, k ``[b, h_kv, s_kv, d]``, v ``[b, h_kv, s_kv, d_v]``; attn_scale, causal,
        causal_alignment, window, seq_len_q, seq_len_kv: as :func:`fusedattn.attention`.
        return_stats: also return the fp32 log-sum-exp ``[b, h_q, s_q, 1]``.
        return_amax: also return ``amax_s`` (max of P) and ``amax_o`` (max |O| before scale_o), fp32
            ``[1, 1, 1, 1]``, for the next step's scales.
        backend: ``"auto"`` (CUDA: the Gluon FP8 forward on sm_90 where it takes the call, else the
            portable Triton kernel's; CPU: the emulation),
            ``"triton"`` (the kernel; CPU tensors under Triton's interpreter) or ``"cpu"`` (the exact torch
            emulation on the tensors' device); see :func:`sdpa_fp8_forward`. The backward of the
            quantize-inside path is the 16-bit one either way.

    Returns:
        ``out`` ``[b, h_q, s_q, d_v]``, then ``stats`` and ``amax_s, amax_o`` when asked, as a tuple.

    Example::

        >>> import torch, fusedattn
        >>> x = torch.randn(1, 2, 16, 64)
        >>> q8, dq = fusedattn.fp8.quantize_per_tensor(x)
        >>> fusedattn.attention(q8, q8, q8, descale_q=dq, descale_k=dq, descale_v=dq, causal=True).dtype
        torch.bfloat16
    """
    if backend not in ("auto", "cpu", "triton"):
        raise InvalidArgumentError(f"{where}: backend must be 'auto', 'triton' or 'cpu', got {backend!r}")
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{where}: {name} must be a torch tensor, got {type(t).__name__}")
    fp8 = {name: is_fp8(t) for name, t in tensors.items()}
    descales = {"descale_q": descale_q, "descale_k": descale_k, "descale_v": descale_v}
    b_ = make_band(causal, causal_alignment, window)
    fwd_opts = dict(attn_scale=attn_scale, band=b_, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, backend=backend,
                    where=where)
    if any(fp8.values()):
        if not all(fp8.values()) or len({t.dtype for t in tensors.values()}) != 1:
            raise InvalidTypeError(f"{where}: FP8 attention needs q, k, v of one float8 type; got "
                                   + ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()))
        missing = [n for n, val in descales.items() if val is None]
        if missing:
            raise InvalidArgumentError(f"{where}: float8 inputs need {', '.join(missing)} (the factor that "
                                       f"turns the stored value into the real one, e.g. amax / 448)")
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values()):
            raise NotSupportedError(
                f"NYI: {where}: gradients of float8 q / k / v (autograd would store them in float8); pass the "
                f"bf16 / fp16 tensors without descales to fusedattn.attention_fp8 (quantized inside, "
                f"backward in their dtype)")
        s_s = DEFAULT_SCALE_S[q.dtype] if scale_s is None else scale_s
        fwd = dict(fwd_opts, descale_s=(1.0 / s_s if descale_s is None else descale_s), scale_s=s_s,
                   scale_o=1.0 if scale_o is None else scale_o)
        o, stats, amax_s, amax_o = sdpa_fp8_forward(q, k, v, o_dtype=out_dtype or torch.bfloat16, **descales,
                                                    **fwd)
    else:
        given = [n for n, val in descales.items() if val is not None]
        if given:
            raise InvalidArgumentError(f"{where}: {', '.join(given)} given but q, k, v are {q.dtype}; descales "
                                       f"go with float8 inputs (quantize with fusedattn.fp8.quantize_per_tensor)")
        if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or len({t.dtype for t in tensors.values()}) != 1:
            raise InvalidTypeError(f"{where}: q, k, v must share one of float8_e4m3fn, float8_e5m2, bfloat16, "
                                   f"float16, float32; got " + ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()))
        if out_dtype not in (None, q.dtype):
            raise NotSupportedError(f"NYI: {where}: out_dtype={out_dtype} with {q.dtype} inputs (the quantize-inside "
                                    f"path returns the inputs' dtype)")
        s_s = DEFAULT_SCALE_S[E4M3] if scale_s is None else scale_s
        fwd = dict(fwd_opts, descale_s=(1.0 / s_s if descale_s is None else descale_s), scale_s=s_s,
                   scale_o=1.0 if scale_o is None else scale_o)
        bwd = dict(attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment, window=window,
                   seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, backend="auto")
        o, stats, amax_s, amax_o = _Fp8StraightThrough.apply(q, k, v, {"fwd": fwd, "bwd": bwd})
    res = (o,) + ((stats,) if return_stats else ()) + ((amax_s, amax_o) if return_amax else ())
    return res[0] if len(res) == 1 else res
