"""FlashAttention 2.x's public functions over fusedattn: ``from fusedattn.flash_attn import flash_attn_func``.

A thin door: the signatures, defaults, tensor layouts (BSHD, packed THD, FlashAttention's caches) and
return values of ``flash_attn.flash_attn_interface`` (FlashAttention 2.x), mapped onto
:func:`fusedattn.attention`, :func:`fusedattn.attention_varlen` and
:func:`fusedattn.attention_with_kvcache`. BSHD tensors are passed as ``.transpose(1, 2)`` views (no
copies); outputs come back BSHD. Gradients flow through every function but ``flash_attn_with_kvcache``
(which, as in FlashAttention, has no backward).

Semantics (FlashAttention's): ``causal`` is bottom-right aligned (query ``i`` keeps key ``j`` iff
``j <= i + seqlen_k - seqlen_q``); ``window_size=(left, right)`` keeps
``i + off - left <= j <= i + off + right`` around the same diagonal, a negative bound is unbounded;
``softcap > 0`` caps the scaled scores ``softcap * tanh(scores / softcap)``; ``alibi_slopes`` add
``-slope_h * |i + off - j|``; a query row with no key gives output 0 and ``softmax_lse = +inf``.

Every call accepts one extra keyword-only argument, ``backend`` (``"auto"``, ``"triton"``, ``"cpu"``),
passed to fusedattn.

Support table (S = supported, R = refused with ``fusedattn.NotSupportedError``, a NotImplementedError,
naming the argument; I = accepted and ignored):

==================================  ==================  ============================================================
function / keyword                  status              notes
==================================  ==================  ============================================================
flash_attn_func                     S                   fusedattn.attention, causal_alignment="bottom_right"
flash_attn_qkvpacked_func           S                   views qkv[:, :, 0/1/2] (gradient lands in qkv)
flash_attn_kvpacked_func            S                   views kv[:, :, 0/1]
flash_attn_varlen_func              S                   fusedattn.attention_varlen (same THD layout)
flash_attn_varlen_qkvpacked_func    S                   views qkv[:, 0/1/2]
flash_attn_varlen_kvpacked_func     S                   views kv[:, 0/1]
flash_attn_with_kvcache             S (forward only)    fusedattn.attention_with_kvcache(cache_layout="bshd")
q/k/v dtypes                        S                   fp16, bf16 (FlashAttention's) and fp32; fp64 on the CPU path
headdim                             S                   any from 1 to 256 (headdim_v may differ); the kernels mask
                                                        to the true d (no padded copies), scale 1 / sqrt(d)
dropout_p                           S                   fusedattn's Philox dropout (seed drawn from torch's default
                                                        generator): same distribution, not FlashAttention's mask
softmax_scale                       S                   default 1 / sqrt(headdim)
causal                              S                   bottom-right aligned (per sequence for varlen / caches)
window_size                         S                   negative = unbounded
softcap                             S                   > 0 activates
alibi_slopes [nheads] fp32          S when causal or    fusedattn adds slope * (j - i), which equals FlashAttention's
                                    window_size[1]==0   -slope * |i + off - j| up to a per-row constant whenever no
                                                        kept key lies right of the diagonal; the door converts
                                                        softmax_lse exactly (minus slope * off). R otherwise
                                                        (non-causal ALiBi needs |i - j|, which fusedattn lacks)
alibi_slopes [batch, nheads]        S (same rule)       read per (sequence, head) by every kernel
deterministic                       S (dense), I        passed to fusedattn.attention (False allows the atomic
                                    (varlen)            single-pass Hopper backward); attention_varlen has one
                                                        backward, the keyword is ignored there
learnable_sink (keyword-only, FA4)  S (func, varlen,    FlashAttention-4's name (FA2 has none): float (nheads,) sink
                                    with_kvcache)       logits, fusedattn's ``sink``; softmax_lse includes the sink, so
                                                        a row with no key has lse = sink, not +inf; gets its gradient
                                                        (with_kvcache: forward only); R with varlen block_table
q_descale / k_descale / v_descale   S (func, forward)   FlashAttention-3's FP8 keywords for float8_e4m3fn q, k, v
(keyword-only, FA3)                                     (batch_size, nheads_k) equal across the batch, or one element;
                                                        cuDNN's FP8 semantics (fusedattn.fp8), bf16 output; all
                                                        entries equal (a per-tensor scale expanded): the FP8
                                                        kernels; differing per head: the same kernels' per-head
                                                        descales
kvcache q/k/v_descale (FA3)         S (emulated)        float8 k_cache / v_cache with k_descale / v_descale (an FP8 K/V
                                                        cache, fusedattn.kvcache_fp8; k / v quantized on append); a
                                                        float8 q with q_descale is dequantized to fp32 and the output
                                                        is bf16 (FA3's); same (batch_size, nheads_k) rule as above
return_attn_probs                   S (partly)          returns (out, softmax_lse, None): S_dmask is always None
                                                        (fusedattn never materializes probabilities)
varlen block_table                  S (forward only)    attention_with_kvcache(cu_seqlens_q=, page_table=), key counts
                                                        from cu_seqlens_k; R with dropout_p > 0 or requires_grad
cu_seqlens_q / cu_seqlens_k         S                   int32 only (TypeError otherwise, as FlashAttention asserts;
                                                        fusedattn.attention_varlen itself also takes int64)
softmax_lse of rows with no key     S                   +inf, from the band and lengths, and wherever the kernels
                                                        wrote -inf (fusedattn's convention for an empty row)
validate (keyword-only addition)    S                   varlen and with_kvcache: offsets, cache_seqlens, block-table
                                                        entries, cache_batch_idx and rotary positions checked
                                                        (default True); False for CUDA-graph capture of trusted
                                                        metadata: no device value read back (positions clamped)
kvcache k, v (append)               S                   written into the caches in place at cache_seqlens ..
                                                        (fusedattn's append when seqlen_new == seqlen_q, else a
                                                        PyTorch scatter before the call)
kvcache cache_seqlens               S                   int or [batch]; the length BEFORE appending (converted to
                                                        fusedattn's seq_len_kv = cache_seqlens + seqlen_new).
                                                        Required when k/v are given
kvcache block_table                 S                   paged caches [num_blocks, page_block_size, nheads_k, d],
                                                        any page_block_size
kvcache cache_batch_idx             S                   without block_table: the cache rows are read as pages of
                                                        seqlen_cache keys (page table = cache_batch_idx), no copy;
                                                        R together with block_table; a repeated index with k/v to
                                                        append is a ValueError (validate=True)
kvcache cache_leftpad               S                   (batch_size,) int32: keys of sequence i are cache slots
                                                        cache_leftpad[i] .. cache_seqlens[i] + seqlen_new - 1; the
                                                        cache is re-paged (views, no copy: pages of gcd(leftpads,
                                                        row stride, seqlen_cache) keys, one key if validate=False)
                                                        so each sequence starts at key 0; appends and rotary use the
                                                        absolute positions; also with block_table / cache_batch_idx
kvcache rotary_cos/sin/interleaved  S                   applied in PyTorch (fp32 math, rounded to q's dtype) to q
                                                        and the new k before the call, at FlashAttention's
                                                        positions; requires k/v
kvcache num_splits                  I                   fusedattn chooses its own split (results equal up to rounding)
kvcache return_softmax_lse          S                   [batch, nheads, seqlen_q] fp32
==================================  ==================  ============================================================

Differences that remain: fusedattn accepts more than FlashAttention does (fp32, ``d_v != d``, any
strides, any page size); dropout masks differ (same distribution); ``S_dmask`` is None.
"""
from __future__ import annotations

import math
import numbers

import torch

from .fp8 import _scale as _fp8_scale, is_fp8
from .functional import attention
from .kvcache import attention_with_kvcache
from .kvcache_fp8 import quantize_for_cache
from .problem import MAX_HEAD_DIM, InvalidArgumentError, InvalidTypeError, NotSupportedError, check_scale
from .varlen import attention_varlen

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


# ----------------------------------------------------------------------------- shared translation

def _bsh(name, t, ndim, shape_doc):
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise InvalidArgumentError(f"{name} must be {ndim}-D {shape_doc}, got shape {list(t.shape)}")


def _check_headdim(name, d):
    if d <= 0 or d > MAX_HEAD_DIM:
        raise NotSupportedError(f"{name} has headdim {d}: fusedattn supports any head dim from 1 to {MAX_HEAD_DIM}")


def _window(window_size, causal):
    """FlashAttention's (left, right), negative = unbounded -> fusedattn's window (None where unbounded)."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise InvalidArgumentError(f"window_size must be a pair (left, right) of ints, -1 = unbounded; "
                                   f"got {window_size!r}")
    bounds = []
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            # int(1.5) would be 1 and int("3") 3: a silent window of another width
            raise InvalidArgumentError(f"window_size[{side}] must be an int, got {w!r}")
        w = int(w)
        bounds.append(None if w < 0 else w)
    left, right = bounds
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right, (None if left is None and right is None else (left, right))


def _slopes(alibi_slopes, nheads, right, device, batch):
    """Validate alibi_slopes; returns fp32 [nheads] or [batch_size, nheads], or None."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor) or not alibi_slopes.is_floating_point():
        raise InvalidTypeError(f"alibi_slopes must be a float tensor [nheads] or [batch_size, nheads] (fp32), got "
                               f"{getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise InvalidArgumentError(f"alibi_slopes must have shape [nheads] = [{nheads}] or [batch_size, nheads] = "
                                   f"[{batch}, {nheads}], got {list(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise InvalidArgumentError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    if right != 0:
        raise NotSupportedError(
            "alibi_slopes without causal=True (or window_size[1] == 0): FlashAttention adds "
            "-slope * |i + seqlen_k - seqlen_q - j|, fusedattn adds slope * (j - i), and the two agree only "
            "when no key right of the diagonal is kept; use causal=True, window_size=(left, 0), or "
            "fusedattn.attention with an explicit attn_bias")
    return alibi_slopes.to(torch.float32)


def _empty_rows(i, off, sk, left, right):
    """Rows (broadcast of query index i, diagonal offset off, key count sk) whose band holds no key."""
    lo = torch.zeros_like(i + off) if left is None else (i + off - left).clamp_min(0)
    hi = (sk - 1) + torch.zeros_like(i + off) if right is None else torch.minimum(i + off + right, sk - 1 + 0 * i)
    return hi < lo


def _fa_lse(lse, empty, slopes, off, sink=None):
    """fusedattn's lse -> FlashAttention's: minus slope * off under ALiBi, +inf on rows with no key
    (with a sink such a row's lse is the sink's logit: kept). lse [..., h, rows]; empty [..., 1 or h,
    rows] bool; off broadcastable to [..., 1, rows].

    ``empty`` is the geometry (band and lengths); a row the kernels found empty for any other reason
    writes lse = -inf (fusedattn's convention, issue 24), which becomes FlashAttention's +inf too."""
    lse = lse.detach()
    if sink is not None:
        empty = torch.zeros_like(empty)
    empty = empty | (lse == float("-inf"))
    if slopes is not None:
        # slopes [h] or [b, h] against lse [b, h, rows]; or already per token [h, rows] (varlen)
        lse = lse - (slopes if slopes.dim() == lse.dim() == 2 else slopes.unsqueeze(-1)) * off.to(torch.float32)
    return lse.masked_fill(empty, float("inf"))


def _scale(softmax_scale, d):
    """``softmax_scale`` as a float, finite and > 0 (default 1 / sqrt(headdim)), checked by its name."""
    return check_scale(softmax_scale, d, "softmax_scale")


def _dropout(dropout_p):
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise InvalidArgumentError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


# ----------------------------------------------------------------------------- dense

def _fa3_descale(name, x, batch, nheads_k, group):
    """FA3's ``(batch_size, nheads_k)`` descale as fusedattn's: one element where every entry holds the same
    value (a per-tensor scale expanded to FA3's shape, as serving code passes it: every FP8 kernel takes
    it), else per head (``[nheads_k * group]``: the FP8 forward kernels read it per head, while the FP8 backward
    takes one scale per tensor); a one-element tensor as it is; None stays None (attention then names it as missing). One
    device read per tensor (the two equality checks together)."""
    if x is None or not isinstance(x, torch.Tensor) or x.numel() == 1:
        return x
    if tuple(x.shape) != (batch, nheads_k):
        raise InvalidArgumentError(f"{name} must have shape (batch_size, nheads_k) = {(batch, nheads_k)} or one element, "
                         f"got {tuple(x.shape)}")
    same_everywhere, same_per_batch = torch.stack([(x == x.reshape(-1)[0]).all(), (x == x[:1]).all()]).tolist()
    if same_everywhere:
        return x.reshape(-1)[:1]
    if not same_per_batch:
        raise NotSupportedError(f"NYI: {name} differing between batch entries (fusedattn's FP8 scales are per "
                                f"tensor or per head)")
    return x[0].repeat_interleave(group)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, backend="auto",
                    learnable_sink=None, q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention's ``flash_attn_func`` on fusedattn.

    Args:
        q: ``(batch_size, seqlen_q, nheads, headdim)``.
        k: ``(batch_size, seqlen_k, nheads_k, headdim)``; nheads a multiple of nheads_k (GQA/MQA).
        v: ``(batch_size, seqlen_k, nheads_k, headdim_v)``.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes (``(nheads,)`` fp32, causal or
            ``window_size[1] == 0`` only), deterministic: FlashAttention's meanings (module docstring).
        return_attn_probs: also return ``softmax_lse`` and ``S_dmask`` (always None).
        backend: fusedattn's backend (an addition).
        learnable_sink: ``(nheads,)`` float sink logits (FlashAttention-4's keyword; fusedattn's ``sink``),
            differentiable; softmax_lse then includes the sink.
        q_descale, k_descale, v_descale: FlashAttention-3's FP8 keywords, for ``torch.float8_e4m3fn`` q, k, v:
            fp32 ``(batch_size, nheads_k)`` (FA3's shape; fusedattn needs the same value in every batch row)
            or one element; the output is bf16 (as FA3's). Runs :func:`fusedattn.fp8.attention_fp8` (cuDNN's
            FP8 semantics: P quantized to e4m3 with scale 256), forward only.

    Returns:
        ``out (batch_size, seqlen_q, nheads, headdim_v)``, or ``(out, softmax_lse, None)`` with
        ``softmax_lse (batch_size, nheads, seqlen_q)`` fp32.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _bsh(name, t, 4, "(batch_size, seqlen, nheads, headdim)")
    _check_headdim("q", q.shape[-1])
    _check_headdim("v", v.shape[-1])
    left, right, window = _window(window_size, causal)
    nheads = q.shape[2]
    slopes = _slopes(alibi_slopes, nheads, right, q.device, q.shape[0])
    fp8_kw = {}
    if q_descale is not None or k_descale is not None or v_descale is not None:
        g = nheads // k.shape[2]
        fp8_kw = {f"descale_{n}": _fa3_descale(f"{n}_descale", x, q.shape[0], k.shape[2], g if n == "q" else 1)
                  for n, x in (("q", q_descale), ("k", k_descale), ("v", v_descale))}
    out, stats = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           attn_scale=_scale(softmax_scale, q.shape[-1]), causal=causal,
                           causal_alignment="bottom_right", window=window,
                           alibi=slopes if slopes is not None else False, softcap=float(softcap or 0.0),
                           dropout_p=_dropout(dropout_p), deterministic=bool(deterministic), return_stats=True,
                           backend=backend, sink=learnable_sink, **fp8_kw)
    out = out.transpose(1, 2)
    if not return_attn_probs:
        return out
    s_q, s_k = q.shape[1], k.shape[1]
    i = torch.arange(s_q, device=q.device)
    off = torch.tensor(s_k - s_q, device=q.device)
    empty = _empty_rows(i, off, torch.tensor(s_k, device=q.device), left, right)
    return out, _fa_lse(stats[..., 0], empty.view(1, 1, s_q), slopes, off, learnable_sink), None


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              backend="auto"):
    """FlashAttention's ``flash_attn_qkvpacked_func``: ``qkv (batch_size, seqlen, 3, nheads, headdim)``.

    Same as :func:`flash_attn_func` on the views ``qkv[:, :, 0]``, ``qkv[:, :, 1]``, ``qkv[:, :, 2]``
    (no copies; the gradient arrives in ``qkv``). Returns ``out (batch_size, seqlen, nheads, headdim)``
    or ``(out, softmax_lse (batch_size, nheads, seqlen), None)``.
    """
    _bsh("qkv", qkv, 5, "(batch_size, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise InvalidArgumentError(f"qkv must be (batch_size, seqlen, 3, nheads, headdim), got {list(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs, backend=backend)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             backend="auto"):
    """FlashAttention's ``flash_attn_kvpacked_func``: ``q (batch_size, seqlen_q, nheads, headdim)``,
    ``kv (batch_size, seqlen_k, 2, nheads_k, headdim)``.

    Same as :func:`flash_attn_func` on the views ``kv[:, :, 0]``, ``kv[:, :, 1]``. Returns
    ``out (batch_size, seqlen_q, nheads, headdim)`` or ``(out, softmax_lse (batch_size, nheads, seqlen_q), None)``.
    """
    _bsh("kv", kv, 5, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise InvalidArgumentError(f"kv must be (batch_size, seqlen_k, 2, nheads_k, headdim), got {list(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, backend=backend)


# ----------------------------------------------------------------------------- varlen

def _max_len(name, m):
    if isinstance(m, torch.Tensor):
        m = int(m.item())
    if isinstance(m, bool) or not isinstance(m, int):
        raise InvalidArgumentError(f"{name} must be an int, got {m!r}")
    return m


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, backend="auto",
                           validate=True, learnable_sink=None):
    """FlashAttention's ``flash_attn_varlen_func`` on :func:`fusedattn.attention_varlen`.

    Args:
        q: ``(total_q, nheads, headdim)``; k: ``(total_k, nheads_k, headdim)``; v: ``(total_k, nheads_k, headdim_v)``.
        cu_seqlens_q, cu_seqlens_k: ``(batch_size + 1,)`` int32 cumulative offsets.
        max_seqlen_q, max_seqlen_k: ints, the longest sequences.
        dropout_p ... return_attn_probs: as :func:`flash_attn_func`, per sequence (causal / window / ALiBi
            aligned with each sequence's own lengths). ``deterministic`` is ignored (one backward).
        block_table: optional ``(batch_size, max_num_blocks_per_seq)`` int32: k/v are then paged caches
            ``(num_blocks, page_block_size, nheads_k, headdim)`` and ``cu_seqlens_k`` gives each sequence's key
            count (forward only, as in FlashAttention): :func:`fusedattn.attention_with_kvcache` with
            ``cu_seqlens_q``.
        validate: check the offsets (int32, from 0, non-decreasing, within the tensors) and the block table's
            entries on the device, one host sync each (an addition; False for CUDA-graph capture of trusted
            metadata: nothing is then read or written out of bounds, lengths and pages are clamped).
        learnable_sink: ``(nheads,)`` float sink logits, as :func:`flash_attn_func` (not with block_table).

    Returns:
        ``out (total_q, nheads, headdim_v)``, or ``(out, softmax_lse (nheads, total_q) fp32, None)`` (the
        conversion to FlashAttention's lse reads the offsets on the host: one sync).
    """
    _bsh("q", q, 3, "(total, nheads, headdim)")
    for name, t in (("k", k), ("v", v)):
        _bsh(name, t, 3 if block_table is None else 4,
             "(total, nheads, headdim)" if block_table is None else "(num_blocks, page_block_size, nheads_k, headdim)")
    _check_headdim("q", q.shape[-1])
    _check_headdim("v", v.shape[-1])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _cu_int32(name, cu)
    left, right, window = _window(window_size, causal)
    nseq = cu_seqlens_q.numel() - 1
    slopes = _slopes(alibi_slopes, q.shape[1], right, q.device, nseq)
    if block_table is not None and learnable_sink is not None:
        raise NotSupportedError("learnable_sink with block_table (paged varlen) is not supported yet; "
                                "use flash_attn_with_kvcache(learnable_sink=) or a dense k/v")
    if block_table is not None:
        out, stats = _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, _max_len("max_seqlen_q", max_seqlen_q),
                                   _max_len("max_seqlen_k", max_seqlen_k), dropout_p, softmax_scale, causal, window,
                                   softcap, slopes, block_table, backend, validate)
    else:
        out, stats = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, _max_len("max_seqlen_q", max_seqlen_q),
                                      _max_len("max_seqlen_k", max_seqlen_k),
                                      attn_scale=_scale(softmax_scale, q.shape[-1]), causal=causal,
                                      causal_alignment="bottom_right", window=window,
                                      alibi=slopes if slopes is not None else False, softcap=float(softcap or 0.0),
                                      dropout_p=_dropout(dropout_p), return_stats=True, validate=validate,
                                      backend=backend, sink=learnable_sink)
    if not return_attn_probs:
        return out
    # per token: index within its sequence, the sequence's diagonal offset and key count
    cq = cu_seqlens_q.long().cpu()
    ck = cu_seqlens_k.long().cpu()
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    total = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(lq.numel()), lq)
    i = torch.arange(int(cq[-1])) - cq[seq]
    off_tok, sk_tok = (lk - lq)[seq], lk[seq]
    pad = total - i.numel()              # rows past cu_seqlens_q[-1] belong to no sequence: no key
    i = torch.cat([i, torch.zeros(pad, dtype=i.dtype)])
    off_tok = torch.cat([off_tok, torch.zeros(pad, dtype=i.dtype)])
    sk_tok = torch.cat([sk_tok, torch.zeros(pad, dtype=i.dtype)])
    empty = _empty_rows(i, off_tok, sk_tok, left, right).to(q.device).view(1, total)
    if slopes is not None and slopes.dim() == 2:
        # [batch_size, nheads] -> per token [nheads, total] (rows past cu_seqlens_q[-1]: sequence 0's, no key)
        seq_tok = torch.cat([seq, torch.zeros(pad, dtype=seq.dtype)]).to(q.device)
        slopes = slopes[seq_tok].T if nseq else slopes.new_zeros(q.shape[1], total)
    return out, _fa_lse(stats, empty, slopes, off_tok.to(q.device).view(1, total), learnable_sink), None


def _cu_int32(name, cu):
    """FlashAttention's cumulative offsets are int32 [batch_size + 1]: say so rather than convert."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise InvalidTypeError(f"{name} must be an int32 tensor (batch_size + 1,) of cumulative offsets, got "
                               f"{getattr(cu, 'dtype', type(cu).__name__)} {list(getattr(cu, 'shape', []))}")


def _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  window, softcap, slopes, block_table, backend, validate):
    """flash_attn_varlen_func with block_table: packed queries over paged caches (key counts from cu_seqlens_k),
    forward only. Returns (out (total_q, nheads, headdim_v), stats (nheads, total_q))."""
    if _dropout(dropout_p) > 0:
        raise NotSupportedError("dropout_p > 0 with block_table: the paged forward has no dropout (as in "
                                "FlashAttention, paged K/V is for inference)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotSupportedError("block_table with tensors that require grad: paged K/V is forward only (as in "
                                "FlashAttention); run it under torch.no_grad()")
    lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    cap = block_table.shape[-1] * k.shape[1] if isinstance(block_table, torch.Tensor) else 0
    if validate and max_seqlen_k > cap:
        raise InvalidArgumentError(f"max_seqlen_k = {max_seqlen_k} exceeds the block table's capacity of {cap} keys "
                                   f"({block_table.shape[-1]} blocks x page_block_size {k.shape[1]})")
    return attention_with_kvcache(
        q, k, v, page_table=block_table, seq_len_kv=lens_k, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
        attn_scale=_scale(softmax_scale, q.shape[-1]), causal=causal, window=window,
        alibi=slopes if slopes is not None else False, softcap=float(softcap or 0.0), cache_layout="bshd",
        return_stats=True, validate=validate, backend=backend)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, backend="auto"):
    """FlashAttention's ``flash_attn_varlen_qkvpacked_func``: ``qkv (total, 3, nheads, headdim)``,
    ``cu_seqlens (batch_size + 1,)`` int32, ``max_seqlen`` int.

    Same as :func:`flash_attn_varlen_func` on the views ``qkv[:, 0/1/2]`` with the same offsets for q and k.
    Returns ``out (total, nheads, headdim)`` or ``(out, softmax_lse (nheads, total), None)``.
    """
    _bsh("qkv", qkv, 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise InvalidArgumentError(f"qkv must be (total, 3, nheads, headdim), got {list(qkv.shape)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, backend=backend)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    backend="auto"):
    """FlashAttention's ``flash_attn_varlen_kvpacked_func``: ``q (total_q, nheads, headdim)``,
    ``kv (total_k, 2, nheads_k, headdim)``.

    Same as :func:`flash_attn_varlen_func` on the views ``kv[:, 0]``, ``kv[:, 1]``. Returns
    ``out (total_q, nheads, headdim)`` or ``(out, softmax_lse (nheads, total_q), None)``.
    """
    _bsh("kv", kv, 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise InvalidArgumentError(f"kv must be (total_k, 2, nheads_k, headdim), got {list(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, backend=backend)


# ----------------------------------------------------------------------------- K/V cache

def _rotary(x, cos, sin, pos, interleaved):
    """Rotary embedding of x [b, s, h, d] at positions pos [b, s], as FlashAttention's apply_rotary_emb:
    the first rotary_dim = 2 * cos.shape[1] dims rotate (pairs (0,1),(2,3).. if interleaved, else
    (0, rd/2),(1, rd/2+1)..), the rest pass through; fp32 math, rounded to x's dtype."""
    rd = 2 * cos.shape[1]
    c = cos[pos].to(torch.float32).unsqueeze(2)            # [b, s, 1, rd/2]
    s = sin[pos].to(torch.float32).unsqueeze(2)
    xr = x[..., :rd].to(torch.float32)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            backend="auto", validate=True, learnable_sink=None, q_descale=None, k_descale=None,
                            v_descale=None):
    """FlashAttention's ``flash_attn_with_kvcache`` on :func:`fusedattn.attention_with_kvcache` (forward only).

    Args:
        q: ``(batch_size, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_size_cache, seqlen_cache, nheads_k, headdim[_v])``, or with ``block_table``
            ``(num_blocks, page_block_size, nheads_k, headdim[_v])`` (any page_block_size).
        k, v: optional ``(batch_size, seqlen_new, nheads_k, headdim[_v])``: written into the caches IN PLACE at
            positions ``cache_seqlens .. cache_seqlens + seqlen_new - 1`` (rotated first when rotary is on),
            then attended to. Requires ``cache_seqlens``.
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)``; k is rotated at positions
            ``cache_seqlens + t``; q at ``cache_seqlens + t`` when causal or windowed, else at ``cache_seqlens``.
            Requires k/v. ``rotary_interleaved``: pairs (0, 1), (2, 3)... (True) or GPT-NeoX halves (False).
        cache_seqlens: int or ``(batch_size,)`` int32: keys in each cache BEFORE appending k/v (None: the whole
            cache). fusedattn's ``seq_len_kv`` is ``cache_seqlens + seqlen_new``.
        cache_batch_idx: optional ``(batch_size,)`` int32: sequence ``i`` uses cache row ``cache_batch_idx[i]``
            (contiguous caches only).
        cache_leftpad: optional ``(batch_size,)`` int32: sequence ``i``'s keys start at cache slot
            ``cache_leftpad[i]`` (left padding): it attends to slots ``cache_leftpad[i] .. cache_seqlens[i] +
            seqlen_new - 1``, re-indexed from 0 for causal / window / ALiBi (as FlashAttention); k/v are still
            appended at ``cache_seqlens`` and rotated at absolute positions. Needs ``0 <= cache_leftpad <=
            cache_seqlens`` (checked when ``validate``). The cache is read through a page table of views.
        block_table: optional ``(batch_size, max_num_blocks_per_seq)`` int32 (paged caches).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as :func:`flash_attn_func`, around the
            bottom-right diagonal ``off = cache_seqlens + seqlen_new - seqlen_q``.
        num_splits: accepted and ignored (fusedattn chooses its split).
        return_softmax_lse: also return ``softmax_lse``.
        backend: fusedattn's backend (an addition).
        validate: check ``cache_seqlens`` (within the cache, room for k/v), the block table's entries, that
            ``cache_batch_idx`` names no cache row twice when appending and that rotary_cos has a row for every
            position (an addition; one host sync each). False for CUDA-graph capture of trusted metadata:
            nothing is read back to the host, nor read or written out of bounds (append and rotary positions
            are clamped into range).
        k_descale, v_descale: FlashAttention-3's keywords for an FP8 K/V cache (``torch.float8_e4m3fn`` k_cache /
            v_cache, required then): fp32 ``(batch_size, nheads_k)`` equal across the batch, or one element; the
            cache holds ``k_cache * k_descale`` and ``k`` / ``v`` (q's dtype) are quantized on append
            (:mod:`fusedattn.kvcache_fp8`: semantics and error bound; emulated for now).
        q_descale: with a float8 ``q`` (FA3 feeds one FP8 type): ``(batch_size, nheads_k)`` as above (query head
            ``i`` uses column ``i // (nheads // nheads_k)``) or one element; q is dequantized to fp32 and the
            output is bf16, as FA3 returns for FP8.

    Returns:
        ``out (batch_size, seqlen_q, nheads, headdim_v)``, or ``(out, softmax_lse (batch_size, nheads, seqlen_q))``.
    """
    _bsh("q", q, 4, "(batch_size, seqlen_q, nheads, headdim)")
    cache_doc = ("(num_blocks, page_block_size, nheads_k, headdim)" if block_table is not None
                 else "(batch_size_cache, seqlen_cache, nheads_k, headdim)")
    _bsh("k_cache", k_cache, 4, cache_doc)
    _bsh("v_cache", v_cache, 4, cache_doc)
    _check_headdim("q", q.shape[-1])
    _check_headdim("v_cache", v_cache.shape[-1])
    if (k is None) != (v is None):
        raise InvalidArgumentError("k and v must be given together (or neither)")
    if (rotary_cos is None) != (rotary_sin is None):
        raise InvalidArgumentError("rotary_cos and rotary_sin must be given together (or neither)")
    if rotary_cos is not None and k is None:
        raise InvalidArgumentError("rotary_cos/rotary_sin need the new k and v to append (as in FlashAttention)")
    if k is not None and cache_seqlens is None:
        raise InvalidArgumentError("k/v (append) need cache_seqlens: the length of each cache before appending")
    b, s_q, h_q, d = q.shape
    dev = q.device
    q, out_dtype = _fa3_query(q, q_descale, k_cache.shape[2])
    descale_k, descale_v = _fa3_cache_descales(k_cache, v_cache, k_descale, v_descale, b)
    if k is not None and v is not None and (is_fp8(k) or is_fp8(v)):
        k, v = _fa3_fp8_new_kv(k, v, k_cache, descale_k, descale_v, q.dtype)

    if block_table is not None and cache_batch_idx is not None:
        raise NotSupportedError("cache_batch_idx together with block_table: the block table already selects "
                                "each sequence's pages; pass cache_batch_idx=None")
    page_table = block_table
    if block_table is None:
        if cache_batch_idx is not None:
            # each cache row is one page of seqlen_cache keys: page_table[i] = [cache_batch_idx[i]]
            if not isinstance(cache_batch_idx, torch.Tensor) or tuple(cache_batch_idx.shape) != (b,) or \
                    cache_batch_idx.dtype not in (torch.int32, torch.int64):
                raise InvalidArgumentError(f"cache_batch_idx must be an int tensor (batch_size,) = ({b},), got "
                                           f"{getattr(cache_batch_idx, 'shape', type(cache_batch_idx).__name__)} "
                                           f"{getattr(cache_batch_idx, 'dtype', '')}")
            page_table = cache_batch_idx.to(device=dev, dtype=torch.int32).view(b, 1)
            if validate and k is not None:
                _check_distinct_rows(cache_batch_idx)
        elif k_cache.shape[0] > b:
            k_cache, v_cache = k_cache[:b], v_cache[:b]            # FlashAttention's default indices 0 .. b - 1
    cap = (page_table.shape[1] * k_cache.shape[1]) if page_table is not None else k_cache.shape[1]

    if cache_seqlens is None:
        lens_before = None
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lens_before = torch.full((b,), cache_seqlens, dtype=torch.int32, device=dev)
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype in (torch.int32, torch.int64):
        if cache_seqlens.numel() != b:
            raise InvalidArgumentError(f"cache_seqlens must be an int or a (batch_size,) = ({b},) int32 tensor, "
                                       f"got shape {list(cache_seqlens.shape)}")
        lens_before = cache_seqlens.reshape(b).to(device=dev, dtype=torch.int32)
    else:
        raise InvalidTypeError(f"cache_seqlens must be an int or an int32 tensor (batch_size,), got "
                               f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)}")

    left, right, window = _window(window_size, causal)
    slopes = _slopes(alibi_slopes, h_q, right, dev, b)

    s_new = 0
    if k is not None:
        _bsh("k", k, 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        _bsh("v", v, 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        s_new = k.shape[1]
        if v.shape[1] != s_new:
            raise InvalidArgumentError(f"k has seqlen_new {s_new} but v has {v.shape[1]}")
    if rotary_cos is not None:
        if rotary_cos.dim() != 2 or tuple(rotary_sin.shape) != tuple(rotary_cos.shape) or \
                2 * rotary_cos.shape[1] > d:
            raise InvalidArgumentError(f"rotary_cos/rotary_sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim "
                                       f"<= headdim = {d}; got {list(rotary_cos.shape)}, {list(rotary_sin.shape)}")
        base = lens_before.long()
        t_k = base[:, None] + torch.arange(s_new, device=dev)[None, :]
        t_q = base[:, None] + (torch.arange(s_q, device=dev)[None, :] if (causal or window is not None)
                               else torch.zeros(1, s_q, dtype=torch.long, device=dev))
        if validate:                    # one host sync: the largest position must have its row
            need = int(max(t_k.max().item() if s_new else 0, t_q.max().item() if s_q else 0)) + 1
            if need > rotary_cos.shape[0]:
                raise InvalidArgumentError(f"rotary_cos/rotary_sin have seqlen_ro = {rotary_cos.shape[0]} rows but "
                                           f"position {need - 1} is needed (cache_seqlens + seqlen)")
        else:                           # no host read (CUDA-graph capture): positions clamped to the table
            if rotary_cos.shape[0] == 0:
                raise InvalidArgumentError("rotary_cos/rotary_sin have seqlen_ro = 0 rows")
            t_k, t_q = (t.clamp(0, rotary_cos.shape[0] - 1) for t in (t_k, t_q))
        k = _rotary(k, rotary_cos, rotary_sin, t_k, rotary_interleaved)
        q = _rotary(q, rotary_cos, rotary_sin, t_q, rotary_interleaved)

    if cache_leftpad is not None:
        # FlashAttention's cache_leftpad: sequence i's keys start at slot cache_leftpad[i] of its cache row.
        # Rotary (above) and appends use the absolute positions; attention sees keys 0.. from the pad on.
        if lens_before is None:
            lens_before = torch.full((b,), cap, dtype=torch.int32, device=dev)
        k_cache, v_cache, page_table, lens_before, cap = _leftpad_pages(
            k_cache, v_cache, page_table, cache_leftpad, lens_before, s_new, cap, validate,
            "block_table" if block_table is not None else "cache_batch_idx" if cache_batch_idx is not None else None)
    seq_len_kv = None if lens_before is None else lens_before + s_new
    k_new = v_new = None
    if k is not None:
        if s_new == s_q:
            k_new, v_new = k.transpose(1, 2), v.transpose(1, 2)       # fusedattn appends (BHSD views)
        elif s_new > 0:
            if descale_k is not None:          # an FP8 cache stores the quantized k / v (kvcache_fp8's rule)
                k, v = (quantize_for_cache(x, _fp8_scale(sc, name, dev, x.shape[2], "flash_attn_with_kvcache")
                                           .reshape(1, 1, -1, 1), c.dtype)
                        for x, sc, name, c in ((k, descale_k, "k_descale", k_cache), (v, descale_v, "v_descale",
                                                                                       v_cache)))
            _append(k_cache, v_cache, page_table, lens_before, k, v, cap, validate)

    out, stats = attention_with_kvcache(
        q.transpose(1, 2), k_cache, v_cache, page_table=page_table, seq_len_kv=seq_len_kv, k_new=k_new, v_new=v_new,
        attn_scale=_scale(softmax_scale, d), causal=causal, window=window,
        alibi=slopes if slopes is not None else False, softcap=float(softcap or 0.0), cache_layout="bshd",
        return_stats=True, validate=validate, backend=backend, sink=learnable_sink, descale_k=descale_k,
        descale_v=descale_v)
    out = out.transpose(1, 2).to(out_dtype)
    if not return_softmax_lse:
        return out
    sk = seq_len_kv.long() if seq_len_kv is not None else torch.full((b,), cap, device=dev)
    off = (sk - s_q).view(b, 1, 1)
    empty = _empty_rows(torch.arange(s_q, device=dev).view(1, 1, s_q), off, sk.view(b, 1, 1), left, right)
    return out, _fa_lse(stats[..., 0], empty, slopes, off, learnable_sink)


def _fa3_query(q, q_descale, nheads_k):
    """``(q, output dtype)``: a float8 q (FA3's FP8 path) dequantized to fp32 with ``q_descale`` (the output then
    bf16, FA3's); any other q as it is (q_descale refused)."""
    if not is_fp8(q):
        if q_descale is not None:
            raise InvalidArgumentError(f"q_descale given but q is {q.dtype}; it goes with a float8 q (FA3's FP8 path)")
        return q, q.dtype
    if q_descale is None:
        raise InvalidArgumentError(f"q is {q.dtype}, so q_descale is required (fp32 (batch_size, nheads_k) or one "
                                   f"element: the factor that turns a stored byte into its value)")
    h_q = q.shape[2]
    qd = _fa3_descale("q_descale", q_descale, q.shape[0], nheads_k, h_q // max(1, nheads_k))
    qd = _fp8_scale(qd, "q_descale", q.device, h_q, "flash_attn_with_kvcache").reshape(1, 1, -1, 1)
    return q.float() * qd, torch.bfloat16


def _fa3_fp8_new_kv(k, v, k_cache, descale_k, descale_v, q_dtype):
    """FA3's all-FP8 call: float8 k / v (already in the cache's type and scale) as fp32 values ``k * k_descale``,
    which the append quantizes back to the very same bytes (a 4-bit significand times the descale, divided
    by it in fp32, is within 2 fp32 ulps of the byte's value: it rounds back to it)."""
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype or q_dtype != torch.float32:
        raise InvalidTypeError(f"float8 k / v ({k.dtype} / {v.dtype}) need a float8 q (with q_descale) and a cache "
                               f"of the same type ({k_cache.dtype}); or pass k / v in q's dtype (quantized on append)")
    h_kv = k.shape[2]
    return tuple(x.float() * _fp8_scale(sc, name, x.device, h_kv, "flash_attn_with_kvcache").reshape(1, 1, -1, 1)
                 for x, sc, name in ((k, descale_k, "k_descale"), (v, descale_v, "v_descale")))


def _fa3_cache_descales(k_cache, v_cache, k_descale, v_descale, b):
    """FA3's k_descale / v_descale as attention_with_kvcache's descale_k / descale_v ([nheads_k] or one
    element), with the errors naming FA3's argument names."""
    fp8_cache = is_fp8(k_cache) or is_fp8(v_cache)
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if fp8_cache and x is None:
            raise InvalidArgumentError(f"k_cache / v_cache are {k_cache.dtype} / {v_cache.dtype}, so {name} is "
                                       f"required (fp32 (batch_size, nheads_k) or one element)")
        if not fp8_cache and x is not None:
            raise InvalidArgumentError(f"{name} given but k_cache / v_cache are {k_cache.dtype} / {v_cache.dtype}; "
                                       f"it goes with a float8 cache")
    h_kv = k_cache.shape[2]
    return (_fa3_descale("k_descale", k_descale, b, h_kv, 1), _fa3_descale("v_descale", v_descale, b, h_kv, 1))


def _check_distinct_rows(cache_batch_idx):
    """Appending through cache_batch_idx: two sequences naming one cache row would write the same slots
    (which one wins is undefined): refuse, naming both (one host sync)."""
    idx = cache_batch_idx.reshape(-1).tolist()
    seen = {}
    for i, row in enumerate(idx):
        if row in seen:
            raise InvalidArgumentError(
                f"cache_batch_idx[{seen[row]}] = cache_batch_idx[{i}] = {row}: with k/v to append, each sequence "
                f"needs its own cache row (both would write the same slots); pass distinct indices")
        seen[row] = i


def _leftpad_pages(k_cache, v_cache, page_table, cache_leftpad, lens_before, s_new, cap, validate, table_name):
    """cache_leftpad without a kernel change: re-page the cache so that each sequence's keys start at key 0.

    The BSHD caches are ``[outer, L, nheads_k, d]``: contiguous rows (``L = seqlen_cache``, outer = cache row)
    or pages (``L = page_block_size``); logical key ``p`` of sequence ``i`` lives at outer
    ``table[i, p // L]``, slot ``p % L`` (``table``: the block table, ``cache_batch_idx`` as [b, 1], or
    ``arange(b)``). With ``m = stride(0) / stride(1)`` that is slot ``table[i, p // L] * m + p % L`` of one
    strided run of slots, which we cut into pages of ``g`` slots, ``g`` dividing ``m``, ``L`` and every
    leftpad (read on the host when ``validate``; ``g = 1``, one-key pages, otherwise, reading nothing).
    Relative page ``t`` of sequence ``i`` is then the page holding its key ``leftpad[i] + t * g``.

    Returns ``(k_pages, v_pages [num_pages, g, nheads_k, d] views, page_table int32 [b, n], lens_before -
    leftpad, capacity n * g)``; appends then land at the absolute ``cache_seqlens`` as in FlashAttention.
    """
    b = lens_before.shape[0]
    dev = lens_before.device
    lp = _leftpad_tensor(cache_leftpad, b, dev)
    outer, L = k_cache.shape[:2]
    table = page_table if page_table is not None else torch.arange(b, dtype=torch.int32, device=dev).view(b, 1)
    m = _slot_ratio("k_cache", k_cache, L)
    if _slot_ratio("v_cache", v_cache, L) != m and outer > 1:
        raise NotSupportedError("cache_leftpad with k_cache and v_cache of different row strides (in slots): "
                                "the re-paged caches share one page table; give both the same layout")
    g = 1                                               # validate=False: no host read of the leftpads
    if validate:
        _check_leftpad(lp, lens_before, s_new, cap, table, outer, L, table_name)
        g = math.gcd(m, L, *set(lp.tolist()))
    lp = lp.long().clamp(0, cap)                       # validate=False: never a negative or past-the-end slot
    n = -(-cap // g)
    pos = lp[:, None] + torch.arange(n, device=dev)[None, :] * g          # [b, n] first key of each page
    inside = pos < cap                                  # pages past the table's end are never read: slot 0
    pos = torch.where(inside, pos, 0)
    slot = table.long().gather(1, pos // L).clamp(0, outer - 1) * m + pos % L
    pages = torch.where(inside, slot // g, 0).to(torch.int32)
    k_pages, v_pages = (_slot_pages(c, m, L, g) for c in (k_cache, v_cache))
    return k_pages, v_pages, pages, (lens_before.long() - lp).to(torch.int32), n * g


def _leftpad_tensor(cache_leftpad, b, dev):
    if not isinstance(cache_leftpad, torch.Tensor) or cache_leftpad.dtype != torch.int32 or \
            tuple(cache_leftpad.shape) != (b,):
        raise InvalidTypeError(f"cache_leftpad must be an int32 tensor (batch_size,) = ({b},), got "
                               f"{getattr(cache_leftpad, 'dtype', type(cache_leftpad).__name__)} "
                               f"{list(getattr(cache_leftpad, 'shape', []))}")
    if cache_leftpad.device != dev:
        raise InvalidArgumentError(f"cache_leftpad is on {cache_leftpad.device} but q is on {dev}")
    return cache_leftpad


def _slot_ratio(name, cache, L):
    """stride(0) / stride(1) of a BSHD cache [outer, L, h, d]: the outer step in key slots (the re-paged view
    addresses every key as one strided run of slots)."""
    so, ss = cache.stride(0), cache.stride(1)
    if cache.shape[0] == 1:
        return L
    if ss <= 0 or so % ss:
        raise NotSupportedError(f"cache_leftpad with {name} strides {tuple(cache.stride())}: its row (or page) "
                                f"stride must be a multiple of its key stride to re-page it without a copy")
    return so // ss


def _slot_pages(cache, m, L, g):
    """[outer, L, h, d] -> the [num_pages, g, h, d] view: page P = slots P*g .. P*g + g - 1 of the run."""
    n_pages = ((cache.shape[0] - 1) * m + L) // g
    ss, sh, sd = cache.stride(1), cache.stride(2), cache.stride(3)
    return cache.as_strided((n_pages, g, cache.shape[2], cache.shape[3]), (g * ss, ss, sh, sd),
                            cache.storage_offset())


def _check_leftpad(lp, lens_before, s_new, cap, table, outer, L, table_name):
    """validate=True (one host sync): 0 <= cache_leftpad <= cache_seqlens, cache_seqlens + seqlen_new within the
    cache, and the block-table entries those keys use within the container."""
    lpl, lens = lp.tolist(), lens_before.tolist()
    for i, (a, n) in enumerate(zip(lpl, lens)):
        if not 0 <= a <= n:
            raise InvalidArgumentError(f"cache_leftpad[{i}] = {a} must be in [0, cache_seqlens[{i}]] = [0, {n}]: "
                                       f"sequence {i}'s keys are cache slots cache_leftpad .. cache_seqlens - 1")
        if n + s_new > cap:
            raise InvalidArgumentError(f"cache_seqlens[{i}] = {n} plus seqlen_new = {s_new} exceeds the cache's "
                                       f"{cap} keys")
        if table_name is not None and n + s_new > a:
            used = table[i, a // L:(n + s_new - 1) // L + 1].tolist()
            bad = [x for x in used if not 0 <= x < outer]
            what = "block" if table_name == "block_table" else "cache row"
            if bad:
                raise InvalidArgumentError(f"{table_name}[{i}] names {what} {bad[0]}, out of range of the "
                                           f"{outer} {what}s (valid: 0 .. {outer - 1}); sequence {i} reads keys "
                                           f"{a} .. {n + s_new - 1}")


def _append(k_cache, v_cache, page_table, lens_before, k, v, cap, validate=True):
    """Write k/v (seqlen_new != seqlen_q, which fusedattn's append does not take) into the BSHD caches.

    validate: check cache_seqlens on the host (one sync). False reads nothing back (CUDA-graph capture):
    positions are clamped into the cache and block-table entries into the container instead, so an
    untrusted length writes to a wrong slot of the cache, never out of it."""
    b, s_new = k.shape[:2]
    dev = k.device
    pos = lens_before.long()[:, None] + torch.arange(s_new, device=dev)[None, :]       # [b, s_new]
    if validate:
        if bool(((lens_before < 0) | (pos[:, -1] >= cap)).any()):
            raise InvalidArgumentError(f"cache_seqlens + seqlen_new (seqlen_new = {s_new}) exceeds the cache's "
                                       f"{cap} keys, or cache_seqlens is negative")
    else:
        if cap <= 0:
            raise InvalidArgumentError(f"seqlen_new = {s_new} keys to append but the cache holds none")
        pos = pos.clamp(0, cap - 1)
    if page_table is not None:
        bs = k_cache.shape[1]
        first = page_table.long().gather(1, pos // bs)
        if not validate:
            first = first.clamp(0, k_cache.shape[0] - 1)
        second = pos % bs
    else:
        first = torch.arange(b, device=dev)[:, None].expand(b, s_new)
        second = pos
    k_cache[first, second] = k
    v_cache[first, second] = v
