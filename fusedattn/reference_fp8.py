"""Float64 references and error bounds for FP8 attention (tests only), in :mod:`fusedattn.reference`'s style.

* :func:`fp8_forward_same_points`: the whole score matrix in float64 with the FP8 rounding points of
  :mod:`fusedattn.fp8` (P rounded with scale_s, O not rounded), plus ``slack``: where float64 and the
  emulation's fp32 P may round to neighbouring FP8 values (P * scale_s within 1e-4 relative of a
  rounding midpoint), the most that can move each output element.
* :func:`fp8_forward_bound` / :func:`fp8_backward_bound`: float64 attention (and its autograd
  gradients) of the dequantized inputs, and the per-element bound of :mod:`fusedattn.fp8`'s docstring
  on the emulation's (and the FP8 Triton kernels') distance to it; ``mma_unit`` adds the GPU's FP8 MMA
  sums (``fusedattn.fp8.mma_unit``). Both assume consistent scales (``scale_s * descale_s == 1``,
  ``scale_dP * descale_dP == 1``, powers of two in practice) and ``scale_s <= FP8_MAX``.
* :func:`fp8_kvcache_bound`: an FP8 K/V cache (:mod:`fusedattn.kvcache_fp8`): float64 attention of the
  unquantized and of the dequantized K / V, and the bounds on the emulation's distance to each.
"""
from __future__ import annotations

import math

import torch

from .fp8 import FP8_MAX, ROUNDING
from .problem import keep_mask, make_band
from .reference import masked_softmax

EPS32 = 2.0 ** -24


def _f(x):
    return float(x.reshape(-1)[0]) if isinstance(x, torch.Tensor) else float(x)


def _dense_keep(b, s_q, s_kv, causal, causal_alignment, window, seq_len_q, seq_len_kv, device):
    len_q = seq_len_q.reshape(b).long() if seq_len_q is not None else torch.full((b,), s_q, device=device)
    len_kv = seq_len_kv.reshape(b).long() if seq_len_kv is not None else torch.full((b,), s_kv, device=device)
    return keep_mask(torch.arange(s_q, device=device), s_kv, len_q, len_kv, make_band(causal, causal_alignment, window))


def _deq(q8, k8, v8, dq, dk, dv):
    h_q, h_kv = q8.shape[1], k8.shape[1]
    g = h_q // h_kv

    def per_head(s, h):
        s = s if isinstance(s, torch.Tensor) else torch.tensor(float(s))
        s = s.double().to(q8.device)
        return s.reshape(1, -1, 1, 1) if s.numel() == h else s.reshape(1, 1, 1, 1)
    q = q8.double() * per_head(dq, h_q)
    k = (k8.double() * per_head(dk, h_kv)).repeat_interleave(g, 1)
    v = (v8.double() * per_head(dv, h_kv)).repeat_interleave(g, 1)
    return q, k, v


def _softmax(s, keep):
    return masked_softmax(s.masked_fill(~keep, float("-inf")))


def _common(q8, k8, v8, scales, attn_scale, mask):
    q, k, v = _deq(q8, k8, v8, scales["descale_q"], scales["descale_k"], scales["descale_v"])
    d = q8.shape[-1]
    scale = attn_scale if attn_scale is not None else d ** -0.5
    keep = _dense_keep(q8.shape[0], q8.shape[2], k8.shape[2], device=q8.device, **mask)
    p, lse = _softmax((q @ k.transpose(-1, -2)) * scale, keep)
    return q, k, v, scale, keep, p, lse


def _round(x, dtype):
    m = FP8_MAX.get(dtype)
    return (x.clamp(-m, m) if m else x).to(dtype).double()


def fp8_forward_same_points(q8, k8, v8, *, attn_scale=None, causal=False, causal_alignment="top_left", window=None,
                            seq_len_q=None, seq_len_kv=None, **scales):
    """``(O before scale_o [b,h_q,s_q,d_v], stats, amax_s, amax_o, slack)`` in float64."""
    mask = dict(causal=causal, causal_alignment=causal_alignment, window=window, seq_len_q=seq_len_q,
                seq_len_kv=seq_len_kv)
    q, k, v, scale, keep, p, lse = _common(q8, k8, v8, scales, attn_scale, mask)
    ss, ds = _f(scales["scale_s"]), _f(scales["descale_s"])
    x = p * ss
    p8 = _round(x, q8.dtype)
    o = (p8 * ds) @ v
    lo, hi = _round(x * (1 - 1e-4), q8.dtype), _round(x * (1 + 1e-4), q8.dtype)
    slack = ((hi - lo).abs() * ds) @ v.abs()
    return o, lse, p.abs().amax(), o.abs().amax(), slack


def fp8_forward_bound(q8, k8, v8, *, o_dtype, attn_scale=None, causal=False, causal_alignment="top_left",
                      window=None, seq_len_q=None, seq_len_kv=None, mma_unit=0.0, **scales):
    """``(O_ref, stats_ref, bound)``: float64 attention of the dequantized inputs and the bound on
    ``|o / scale_o - O_ref|`` (fusedattn.fp8's docstring), both ``[b, h_q, s_q, d_v]``. ``mma_unit``:
    the FP8 MMA's relative sum error (``fusedattn.fp8.mma_unit(device)``; 0 for fp32 sums)."""
    mask = dict(causal=causal, causal_alignment=causal_alignment, window=window, seq_len_q=seq_len_q,
                seq_len_kv=seq_len_kv)
    q, k, v, scale, keep, p, lse = _common(q8, k8, v8, scales, attn_scale, mask)
    ss, ds, so = _f(scales["scale_s"]), _f(scales["descale_s"]), _f(scales["scale_o"])
    if ss * ds != 1.0 or ss > FP8_MAX[q8.dtype]:
        raise ValueError("the bound assumes scale_s * descale_s == 1 and scale_s <= FP8_MAX")
    d, s_kv = q8.shape[-1], k8.shape[2]
    u8, a8 = ROUNDING[q8.dtype]
    uo, ao = ROUNDING[o_dtype]
    o_ref = p @ v
    A = ((q.abs() @ k.abs().transpose(-1, -2)) * abs(scale)).masked_fill(~keep, 0).amax(-1, keepdim=True)
    # the Gluon kernel's p comes out scaled, exp2(S - (m - log2 scale_s)), and l / scale_s at the end: the
    # shifted base's rounding moves p by |log2 scale_s| eps more, the division by one eps
    shift = (abs(math.log2(ss)) + 1) * EPS32
    delta = 2 * (d + 3) * EPS32 * A + 2 * mma_unit * A + (s_kv + 6) * EPS32 + shift
    gamma = (s_kv + 4) * EPS32 + mma_unit        # P8 @ V's sum: fp32, or the FP8 MMA's
    b1 = (u8 + delta * (1 + u8) + gamma) * (p @ v.abs()) + a8 * ds * (1 + gamma) * (keep.double() @ v.abs())
    b1 = 2 * b1 - u8 * (p @ v.abs())          # fp32 terms doubled for second-order effects; u8 once
    bound = b1 + (uo + 2 * EPS32) * (o_ref.abs() + b1) + ao / so
    return o_ref, lse, bound


def fp8_backward_bound(q8, k8, v8, o, dO8, *, grad_dtype, attn_scale=None, causal=False,
                       causal_alignment="top_left", window=None, seq_len_q=None, seq_len_kv=None, mma_unit=0.0,
                       with_ds=False, **scales):
    """``((dQ_ref, dK_ref, dV_ref), (bound_dQ, bound_dK, bound_dV))``: float64 gradients of attention of
    the dequantized inputs for the dequantized ``dO8 * descale_dO``, and bounds on the emulation's (and the
    FP8 Triton backward's) dequantized gradients (``dQ / scale_dQ`` ...). ``o``: the forward's stored output
    (with descale_o).

    ``mma_unit``: the FP8 MMA's relative sum error (``fusedattn.fp8.mma_unit(device)``; 0 for fp32 sums, the
    emulation and the interpreter). It enters as in :func:`fp8_forward_bound`, at each of the five products:
    S's recomputation and the forward's stats (``2 u_mma A_i`` each, inside delta), dP = dO V^T (relative to
    ``sum |dO||V|``), and the three sums P8^T dO8, dS8 K8, dS8^T Q8 (relative to their sums of magnitudes).
    with_ds: also return ``(dS_ref, bound_dS)`` (``[b, h_q, s_q, s_kv]``, cuDNN's "dP" before scale_dP), for
    amax_dP: ``|amax_dP - max |dS_ref|| <= max bound_dS``."""
    mask = dict(causal=causal, causal_alignment=causal_alignment, window=window, seq_len_q=seq_len_q,
                seq_len_kv=seq_len_kv)
    q, k, v, scale, keep, p, lse = _common(q8, k8, v8, scales, attn_scale, mask)
    f = {n: _f(x) for n, x in scales.items() if n not in ("descale_q", "descale_k", "descale_v")}
    if f["scale_s"] * f["descale_s"] != 1.0 or f["scale_dP"] * f["descale_dP"] != 1.0:
        raise ValueError("the bound assumes scale_s * descale_s == 1 and scale_dP * descale_dP == 1")
    b, h_q, s_q, d = q8.shape
    h_kv, s_kv, d_v = k8.shape[1], k8.shape[2], v8.shape[-1]
    g = h_q // h_kv
    u8, a8 = ROUNDING[q8.dtype]
    uds, ads = ROUNDING[dO8.dtype]
    ug, ag = ROUNDING[grad_dtype]
    dO = dO8.double() * f["descale_dO"]
    o_given = o.double() * f["descale_o"]
    o_ref = p @ v
    kept = keep.double().expand_as(p)
    # exact gradients
    dV = p.transpose(-1, -2) @ dO
    dP = dO @ v.transpose(-1, -2)
    D = (dO * o_ref).sum(-1, keepdim=True)
    dS = p * (dP - D) * scale
    dQ = dS @ k
    dK = dS.transpose(-1, -2) @ q
    A = ((q.abs() @ k.abs().transpose(-1, -2)) * abs(scale)).masked_fill(~keep, 0).amax(-1, keepdim=True)
    # P = exp(S - stats): S recomputed and the forward's stats, each within the forward's delta_i
    delta = 2 * (2 * (d + 3) * EPS32 * A + 2 * mma_unit * A + (s_kv + 6) * EPS32)
    # dV: P rounding (relative u8 plus the subnormal floor) and fp32 (or the FP8 MMA's) sums
    gam_q = (s_q * g + 4) * EPS32 + mma_unit
    bdV = ((u8 + 2 * delta + 2 * gam_q) * p + a8 * f["descale_s"] * kept).transpose(-1, -2) @ dO.abs()
    # dS: the error of D (the forward's rounded O) and of fp32
    E_D = ((dO * (o_given - o_ref)).sum(-1, keepdim=True)).abs() + 2 * (d_v + 4) * EPS32 * (dO.abs() * o_given.abs()).sum(-1, keepdim=True)
    E_dP = 2 * ((d_v + 4) * EPS32 + mma_unit) * (dO.abs() @ v.abs().transpose(-1, -2))
    EdS = abs(scale) * p * (E_D + E_dP + (delta + 4 * EPS32) * ((dP - D).abs() + E_D + E_dP))
    per = (EdS + uds * (dS.abs() + EdS)) + ads * f["descale_dP"] * kept
    gam_kv = (s_kv + 4) * EPS32 + mma_unit
    bdQ = per @ k.abs() + 2 * gam_kv * (dS.abs() + per) @ k.abs()
    bdK = per.transpose(-1, -2) @ q.abs() + 2 * gam_q * (dS.abs() + per).transpose(-1, -2) @ q.abs()

    def fold(x):     # GQA: sum the group's query heads into their kv head
        return x.view(b, h_kv, g, *x.shape[2:]).sum(2)
    dK, dV, bdK, bdV = fold(dK), fold(dV), fold(bdK), fold(bdV)

    def out(ref, bnd, name):
        return bnd + (ug + 2 * EPS32) * (ref.abs() + bnd) + ag / f[name]
    res = (dQ, dK, dV), (out(dQ, bdQ, "scale_dQ"), out(dK, bdK, "scale_dK"), out(dV, bdV, "scale_dV"))
    return res + ((dS, EdS),) if with_ds else res


def fp8_kvcache_bound(q, k, v, k8, v8, *, descale_k, descale_v, out_dtype, attn_scale=None, causal=True, window=None,
                      seq_len_q=None, seq_len_kv=None, p_dtype=None):
    """An FP8 K/V cache (:mod:`fusedattn.kvcache_fp8`) against float64, on dense BHSD tensors.

    Args: ``q [b, h_q, s_q, d]`` (any float; the queries as given), ``k, v [b, h_kv, s_kv, d | d_v]`` the
    *unquantized* keys / values, ``k8, v8`` the cache's bytes for them (same shapes, gathered dense),
    descales as :func:`fusedattn.attention_with_kvcache` takes them (per tensor or ``[h_kv]``), ``out_dtype``
    q's dtype. The mask is the cache's: bottom-right causal / window, padded ``seq_len_q`` / ``seq_len_kv``.

    Returns ``(o_ref, o_deq, bound, bound_deq)``, ``[b, h_q, s_q, d_v]`` float64: attention of the
    unquantized K / V and of the dequantized cache; the bound on ``|out - o_ref|`` (the module docstring's)
    and on ``|out - o_deq|`` (fp32 and the output's rounding only). Assumes no value saturated. ``p_dtype``:
    the type the decode kernel rounds its unnormalized probabilities to before ``P @ V`` (q's 16-bit type;
    None: no rounding, the emulation), which adds ``u_p sum_j P |V| + a_p sum_{j kept} |V|`` (the row sum
    is at least 1)."""
    mask = dict(causal=causal, causal_alignment="bottom_right", window=window, seq_len_q=seq_len_q,
                seq_len_kv=seq_len_kv)
    b, h_q, s_q, d = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    g = h_q // h_kv
    u8, a8 = ROUNDING[k8.dtype]
    uo, ao = ROUNDING[out_dtype]
    scale = attn_scale if attn_scale is not None else d ** -0.5
    keep = _dense_keep(b, s_q, s_kv, device=q.device, **mask)
    qd = q.double()

    def per_head(s):
        s = (s if isinstance(s, torch.Tensor) else torch.tensor(float(s))).double().to(q.device)
        return s.reshape(1, -1, 1, 1)

    def grouped(x):
        return x.repeat_interleave(g, 1)
    dk, dv = per_head(descale_k), per_head(descale_v)
    K, V = grouped(k.double()), grouped(v.double())
    Kq, Vq = grouped(k8.double() * dk), grouped(v8.double() * dv)
    # storage: |K' - K| <= dK (the fp32 division before the rounding adds 2 eps relative)
    dK = grouped((u8 + 2 * EPS32) * k.double().abs() + a8 * dk)
    dV = grouped((u8 + 2 * EPS32) * v.double().abs() + a8 * dv)

    p, _ = _softmax((qd @ K.transpose(-1, -2)) * scale, keep)
    pq, _ = _softmax((qd @ Kq.transpose(-1, -2)) * scale, keep)
    o_ref, o_deq = p @ V, pq @ Vq
    # fp32 terms (fusedattn.fp8's): relative error of P and of the sum over keys, taken twice
    A = ((qd.abs() @ Kq.abs().transpose(-1, -2)) * scale).masked_fill(~keep, 0).amax(-1, keepdim=True)
    delta = 2 * (d + 3) * EPS32 * A + (s_kv + 6) * EPS32
    gamma = (s_kv + 4) * EPS32
    fp32 = 2 * (delta + gamma * (1 + delta))

    up, ap = ROUNDING[p_dtype] if p_dtype is not None else (0.0, 0.0)
    kept = keep.double()
    # against the dequantized cache: fp32 and P's rounding (the kernel's), then the output's rounding
    b_deq = (fp32 + up) * (pq @ Vq.abs()) + ap * (kept @ Vq.abs())
    bound_deq = b_deq + uo * (o_deq.abs() + b_deq) + ao
    # against the unquantized K / V: the logits move by at most E_i, so P by a factor exp(+-2 E_i)
    E = ((qd.abs() @ dK.transpose(-1, -2)) * scale).masked_fill(~keep, 0).amax(-1, keepdim=True)
    r = torch.exp(2 * E)
    spread = torch.einsum("bhij,bhijc->bhic", p, (V.unsqueeze(2) - o_ref.unsqueeze(3)).abs())
    b1 = r * (p @ dV) + (r - 1) * spread + r * (fp32 + up) * (p @ (V.abs() + dV)) + ap * (kept @ (V.abs() + dV))
    bound = b1 + uo * (o_ref.abs() + b1) + ao
    return o_ref, o_deq, bound, bound_deq
