"""Plain attention math, for tests only: the whole score matrix, no tiling, no tricks.

``attention_reference`` runs in whatever dtype it is given: float64 for the
golden result, the input dtype for "PyTorch's own same-precision error"
(FlashAttention's rule compares the kernel's error to that one). It is
differentiable, so gradients come from autograd through it.

Order of operations (the kernels' too): logits = softcap(scale * q k^T) + bias
+ ALiBi slope_h * (j - i); then the band / padding mask; softmax; an empty row
gives output 0 and stats -inf (the log of an empty sum); dropout scales kept probabilities by 1 / (1 - p).

A sink (``sink``, float ``[h_q]``) is one more logit per head in every row inside its sequence: a
column of value 0 appended to the scores, so it adds ``exp(sink_h)`` to the denominator and nothing
to the output; the stats include it (a row whose keys are all masked then has output 0 and stats
``sink_h``; rows past ``seq_len_q`` stay 0 / -inf). Differentiable in ``sink`` too.
"""
from __future__ import annotations

import torch

from .backends.cpu import dropout_keep_mask
from .problem import alibi_slopes, keep_mask, make_band


def attention_reference(q, k, v, *, attn_scale=None, causal=False, causal_alignment="top_left", window=None,
                        seq_len_q=None, seq_len_kv=None, attn_bias=None, alibi=False, softcap=0.0,
                        dropout_p=0.0, dropout_seed=0, dropout_offset=0, sink=None, dtype=torch.float64):
    """Returns (out [b,h_q,s_q,d_v], lse [b,h_q,s_q,1]) computed in ``dtype``."""
    b, h_q, s_q, d = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    g = h_q // h_kv
    scale = attn_scale if attn_scale is not None else d ** -0.5
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(g, dim=1)
    vf = vf.repeat_interleave(g, dim=1)
    s = qf @ kf.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s * (scale / softcap))
    else:
        s = s * scale
    rows = torch.arange(s_q, device=q.device).view(-1, 1)
    cols = torch.arange(s_kv, device=q.device).view(1, -1)
    if attn_bias is not None:
        if attn_bias.dtype == torch.bool:
            s = s.masked_fill(~attn_bias.expand(b, h_q, s_q, s_kv), float("-inf"))
        else:
            s = s + attn_bias.to(dtype)
    if isinstance(alibi, torch.Tensor) or alibi:
        slopes = alibi if isinstance(alibi, torch.Tensor) else alibi_slopes(h_q, q.device)
        s = s + slopes.to(dtype).reshape(-1, h_q, 1, 1) * (cols - rows).to(dtype)     # [h_q] or [b, h_q]
    len_q = seq_len_q.reshape(b).long() if seq_len_q is not None else torch.full((b,), s_q, device=q.device)
    len_kv = seq_len_kv.reshape(b).long() if seq_len_kv is not None else torch.full((b,), s_kv, device=q.device)
    lq = len_q.view(b, 1, 1, 1)
    keep = keep_mask(torch.arange(s_q, device=q.device), s_kv, len_q, len_kv, make_band(causal, causal_alignment, window))
    s = s.masked_fill(~keep, float("-inf"))
    if sink is not None:
        # one more column: the sink logit, for rows inside their sequence only (padding rows stay empty)
        col = sink.to(dtype).view(1, h_q, 1, 1).expand(b, h_q, s_q, 1)
        s = torch.cat([s, col.masked_fill(~(rows < lq), float("-inf"))], dim=-1)
    prob, lse = masked_softmax(s)
    if sink is not None:
        prob = prob[..., :s_kv]               # the sink's probability multiplies no value
    if dropout_p > 0:
        kept = dropout_keep_mask(b, h_q, s_q, s_kv, dropout_p, dropout_seed, dropout_offset, q.device)
        prob = prob * kept / (1.0 - dropout_p)
    out = prob @ vf
    return out, lse.float()


def masked_softmax(s: torch.Tensor):
    """Softmax over the last dim of scores ``s`` whose masked entries are -inf, and its log-sum-exp
    (keepdim): a row whose every score is -inf gets probabilities 0 and lse -inf (the library's convention
    for a row that sees no key), never NaN; a row with a NaN score, or an inf one, gets NaN (as ``softmax``:
    its sum is NaN, which is not an empty row)."""
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    nonempty = l != 0
    prob = e / torch.where(nonempty, l, torch.ones_like(l))
    lse = torch.where(nonempty, m + torch.log(torch.where(nonempty, l, torch.ones_like(l))),
                      torch.full_like(l, float("-inf")))
    return prob, lse
