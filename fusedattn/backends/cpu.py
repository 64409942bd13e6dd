"""The CPU path: chunked online softmax in PyTorch, same semantics as the kernels.

Memory is O(s * chunk): queries and keys are visited in chunks of
``CHUNK_Q x CHUNK_KV`` and the softmax is accumulated online, so a 16k-token
attention never holds the 16k x 16k score matrix. Masks, bias, ALiBi, softcap
and dropout follow ``backends/triton/common.py`` exactly, including the Philox
counters of the dropout mask, so CPU and GPU drop the same elements.

Math runs in fp32 (fp64 for fp64 inputs, which gradcheck uses).
"""
from __future__ import annotations

import dataclasses

import torch

CHUNK_Q = 256
CHUNK_KV = 512

# Philox4x32-10 constants (Triton's tl.randint)
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_M32 = 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, b: int):
    """(high, low) 32-bit halves of a * b for a uint32 held in int64 and a constant b < 2^32."""
    lo_part = a * (b & 0xFFFF)
    hi_part = a * (b >> 16)
    mid = lo_part + ((hi_part & 0xFFFF) << 16)     # < 2^49: no int64 overflow
    return (hi_part >> 16) + (mid >> 32), mid & _M32


def philox_randint4x(seed: int, counter: torch.Tensor):
    """Triton's ``tl.randint4x(seed, counter)`` for an int64 counter tensor: 4 uint32 words in int64."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1 = counter & _M32, (counter >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mulhilo(c2, _ROUND_B)
        hi_a, lo_a = _mulhilo(c0, _ROUND_A)
        c0, c2 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1
        c1, c3 = lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def dropout_threshold(p: float) -> int:
    """Keep an element iff its 16-bit random value >= p * 2^16 (as the kernels do)."""
    return min(round(p * 2 ** 16), 2 ** 16 - 1)


def dropout_keep_chunk(seed, offset, h_q, s_q, s_kv, p, rows, cols, b, device):
    """Keep-mask [b, h_q, len(rows), len(cols)] of the (rows, cols) window of the global mask.

    As the kernels (``backends/gluon/dropout.py`` says why this grouping): rows {r, r + 8} and keys
    {k, k + 1, k + 8, k + 9} (r with bit 3 clear, k with bits 0 and 3 clear) share one Philox call
    at counter ``offset + (bh * RQ + (r >> 4) * 8 + (r & 7)) * KQ + (k >> 4) * 4 + ((k & 7) >> 1)``,
    RQ = ceil(s_q / 16) * 8, KQ = ceil(s_kv / 16) * 4; (row, key) takes 16-bit half (key bit 0)
    of word 2 * (row bit 3) + (key bit 3).
    """
    bh = torch.arange(b * h_q, device=device, dtype=torch.int64).view(b, h_q, 1, 1)
    rows = rows.view(1, 1, -1, 1).to(torch.int64)
    cols = cols.view(1, 1, 1, -1).to(torch.int64)
    row_group = (rows >> 4) * 8 + (rows & 7)
    key_group = (cols >> 4) * 4 + ((cols & 7) >> 1)
    counter = offset + (bh * ((s_q + 15) // 16 * 8) + row_group) * ((s_kv + 15) // 16 * 4) + key_group
    words = torch.stack(philox_randint4x(seed, counter), dim=-1)           # [b, h, rows, cols, 4]
    word = (2 * ((rows >> 3) & 1) + ((cols >> 3) & 1)).expand(words.shape[:-1])
    r = torch.gather(words, -1, word.unsqueeze(-1)).squeeze(-1)
    r = (r >> (16 * (cols & 1))) & 0xFFFF
    return r >= dropout_threshold(p)


def dropout_keep_mask(b, h_q, s_q, s_kv, dropout_p, seed, offset, device="cpu") -> torch.Tensor:
    """The exact dropout keep-mask the kernels use: bool ``[b, h_q, s_q, s_kv]`` (True = kept)."""
    rows = torch.arange(s_q, device=device)
    cols = torch.arange(s_kv, device=device)
    return dropout_keep_chunk(seed, offset, h_q, s_q, s_kv, dropout_p, rows, cols, b, device)


def gather_pages(container: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Dense [b, h_kv, max_blocks * block_size, d] from a paged container [num_blocks, h_kv, block_size, d]
    and a page table [b, max_blocks] (entries clamped into the container, as the kernels do)."""
    n, h, bs, d = container.shape
    b, nb = table.shape
    blocks = container[table.long().clamp(0, n - 1)]                 # [b, nb, h, bs, d]
    return blocks.permute(0, 2, 1, 3, 4).reshape(b, h, nb * bs, d)


class _Chunker:
    """Scores of one (query chunk, key chunk) with every modifier and mask applied.

    Shapes: tiles are [b, h_kv, g, rows, cols] so GQA reads K/V in place.
    """

    def __init__(self, p, q, k, v, extras, cdt):
        self.p, self.cdt = p, cdt
        self.q = q.unflatten(1, (p.h_kv, p.group))
        self.k, self.v = k[:, :, None], v[:, :, None]
        dev = q.device
        lens_q = extras["seq_len_q"]
        lens_kv = extras["seq_len_kv"]
        self.len_q = (lens_q.clamp(0, p.s_q) if lens_q is not None else torch.full((p.b,), p.s_q, device=dev)).long()
        self.len_kv = (lens_kv.clamp(0, p.s_kv) if lens_kv is not None else torch.full((p.b,), p.s_kv, device=dev)).long()
        band = p.band
        self.diag = (self.len_kv - self.len_q) if (band is not None and band.alignment == "bottom_right") \
            else torch.zeros_like(self.len_q)
        self.bias = extras["bias"]
        self.slopes = extras["slopes"]

    @staticmethod
    def _b5(x):
        """[b] -> [b, 1, 1, 1, 1] for broadcasting against tiles."""
        return x.view(-1, 1, 1, 1, 1)

    def logits(self, i0, i1, j0, j1):
        """(s, t): natural-unit logits [b, h_kv, g, rows, cols] with -inf where masked, and tanh of softcap."""
        p = self.p
        qc = self.q[..., i0:i1, :].to(self.cdt)
        kc, _ = self.kv(j0, j1)
        s = torch.matmul(qc, kc.transpose(-1, -2))
        t = None
        if p.softcap > 0:
            t = torch.tanh(s * (p.scale / p.softcap))
            s = t * p.softcap
        else:
            s = s * p.scale
        rows = torch.arange(i0, i1, device=s.device)
        cols = torch.arange(j0, j1, device=s.device)
        if self.bias is not None:
            bias = self.bias[:, :, i0:i1, j0:j1].unflatten(1, (p.h_kv, p.group))
            if bias.dtype == torch.bool:
                s = s.masked_fill(~bias, float("-inf"))
            else:
                s = s + bias.to(self.cdt)
        if self.slopes is not None:
            # slopes [b, h_q] (batch stride 0 for per-head slopes)
            slope = self.slopes.to(self.cdt).reshape(-1, p.h_kv, p.group, 1, 1)
            s = s + slope * (cols.view(1, -1) - rows.view(-1, 1)).to(self.cdt)
        r = rows.view(1, 1, 1, -1, 1)
        c = cols.view(1, 1, 1, 1, -1)
        keep = (c < self._b5(self.len_kv)) & (r < self._b5(self.len_q))
        band = p.band
        if band is not None:
            if band.left is not None:
                keep = keep & (c >= r + self._b5(self.diag) - band.left)
            if band.right is not None:
                keep = keep & (c <= r + self._b5(self.diag) + band.right)
        return s.masked_fill(~keep, float("-inf")), t

    def kv(self, j0, j1):
        """K, V rows [j0, j1) in the compute dtype, zeroed past each sequence's length (padding may hold NaN)."""
        kc = self.k[..., j0:j1, :].to(self.cdt)
        vc = self.v[..., j0:j1, :].to(self.cdt)
        cols = torch.arange(j0, j1, device=kc.device).view(1, 1, 1, -1, 1)
        valid = cols < self._b5(self.len_kv)
        if not bool(valid.all()):
            kc = torch.where(valid, kc, 0.0)
            vc = torch.where(valid, vc, 0.0)
        return kc, vc

    def dropout(self, i0, i1, j0, j1):
        """Keep-mask of this tile, [b, h_kv, g, rows, cols], or None without dropout."""
        p = self.p
        if not p.has_dropout:
            return None
        rows = torch.arange(i0, i1, device=self.q.device)
        cols = torch.arange(j0, j1, device=self.q.device)
        keep = dropout_keep_chunk(p.dropout_seed, p.dropout_offset, p.h_q, p.s_q, p.s_kv, p.dropout_p,
                                  rows, cols, p.b, self.q.device)
        return keep.unflatten(1, (p.h_kv, p.group))

    def kv_range(self, i0, i1):
        """Key chunks that can hold a kept key for query rows [i0, i1) of any batch entry."""
        p, band = self.p, self.p.band
        lo, hi = 0, p.s_kv
        if band is not None:
            dmin, dmax = int(self.diag.min()), int(self.diag.max())
            if band.left is not None:
                lo = max(0, i0 + dmin - band.left)
            if band.right is not None:
                hi = min(p.s_kv, i1 - 1 + dmax + band.right + 1)
        lo = lo // CHUNK_KV * CHUNK_KV
        return range(lo, max(hi, lo), CHUNK_KV)


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward(p, q, k, v, extras, out, lse):
    """out [b,h_q,s_q,d_v] (written), lse fp32 [b,h_q,s_q] natural log (written when not None).

    A row with no key (band, padding, bool bias, all -inf bias) gets output 0 and lse -inf.

    Paged K/V (containers + page tables) are gathered into dense tensors first.
    """
    if p.paged:
        k = gather_pages(k, extras["page_table_k"])
        v = gather_pages(v, extras["page_table_v"])
        p = dataclasses.replace(p, paged=False)
    cdt = _compute_dtype(q.dtype)
    ch = _Chunker(p, q, k, v, extras, cdt)
    scale_out = 1.0 / (1.0 - p.dropout_p)
    for i0 in range(0, p.s_q, CHUNK_Q):
        i1 = min(i0 + CHUNK_Q, p.s_q)
        m = torch.full((p.b, p.h_kv, p.group, i1 - i0), float("-inf"), dtype=cdt, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros((p.b, p.h_kv, p.group, i1 - i0, p.d_v), dtype=cdt, device=q.device)
        for j0 in ch.kv_range(i0, i1):
            j1 = min(j0 + CHUNK_KV, p.s_kv)
            s, _ = ch.logits(i0, i1, j0, j1)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            e = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = l * alpha + e.sum(-1)
            keep = ch.dropout(i0, i1, j0, j1)
            if keep is not None:
                e = e * keep
            acc = acc * alpha[..., None] + torch.matmul(e, ch.kv(j0, j1)[1])
            m = m_new
        if p.has_sink:
            acc, m, l = _add_sink(p, ch, extras["sink"], acc, m, l, i0, i1)
        ok = l != 0           # 0: no key (output 0, lse -inf); NaN (a NaN or inf score) stays NaN, as softmax
        o = torch.where(ok[..., None], acc * (scale_out / torch.where(ok, l, 1.0))[..., None], 0.0)
        out[:, :, i0:i1].copy_(o.flatten(1, 2))
        if lse is not None:
            # a row with no key (l == 0): log of an empty sum, -inf (merges with weight 0)
            lse[:, :, i0:i1].copy_(torch.where(ok, m + torch.log(torch.where(ok, l, 1.0)), float("-inf")).flatten(1, 2))


def _add_sink(p, ch, sink, acc, m, l, i0, i1):
    """Fold the sink logit into a finished row state (m, l natural units; acc unnormalized): one more
    term exp(sink_h - m) in the sum and no value row, so acc is only rescaled. Rows past ``seq_len_q``
    get no sink (they stay empty: output 0, lse -inf)."""
    rows = torch.arange(i0, i1, device=acc.device).view(1, 1, 1, -1)
    s = sink.to(acc.dtype).view(1, p.h_kv, p.group, 1)
    s = torch.where(rows < ch._b5(ch.len_q)[..., 0], s, float("-inf"))      # [b, h_kv, g, rows]
    m_new = torch.maximum(m, s)
    m_new = torch.where(m_new == float("-inf"), 0.0, m_new)                  # no key and no sink
    alpha = torch.exp(m - m_new)
    return acc * alpha[..., None], m_new, l * alpha + torch.exp(s - m_new)


def sink_grad(sink, lse, delta):
    """The sink's gradient, fp32 ``[h_q]``: with p_sink = exp(sink_h - lse) (lse includes the sink),
    dL/dsink_h = sum over rows of p_sink * (0 - delta), delta = rowsum(dO * O), since the sink's
    "value" is 0 (dP_sink = 0) and dS = P * (dP - delta) holds for it as for any logit.

    sink fp32 [h_q]; lse [b, h_q, s_q] (natural log; -inf on rows past seq_len_q: p_sink 0 there);
    delta [b, h_q, s_q] or [b * h_q, s_q] fp32."""
    h_q = sink.shape[0]
    # few element-wise kernels (on the GPU each is a launch beside a ~1 ms backward): lse -inf -> +inf in
    # one nan_to_num (p_sink 0 there, never inf * 0), then in place: exp, negate, times delta
    lse = torch.nan_to_num(lse.reshape(-1, h_q, lse.shape[-1]).to(delta.dtype), neginf=float("inf"))
    neg_p_sink = torch.sub(sink.to(delta.dtype).view(1, h_q, 1), lse).exp_().neg_()
    return neg_p_sink.mul_(delta.reshape(lse.shape)).sum(dim=(0, 2)).float()


def backward(p, q, k, v, out, grad_out, lse, extras, dq, dk, dv, need_dbias=False, dsink=None):
    """Gradients from the forward's natural-log ``lse`` [b,h_q,s_q] (recompute, no stored P).

    Writes dq [b,h_q,s_q,d], dk [b,h_kv,s_kv,d], dv [b,h_kv,s_kv,d_v]; returns dbias
    fp32 [b,h_q,s_q,s_kv] when ``need_dbias`` (the caller reduces broadcast dims). With a sink, the
    lse already includes it, so dQ, dK, dV are computed as without one; ``dsink`` (fp32 [h_q]) gets
    the sink's gradient (:func:`sink_grad`).
    """
    cdt = _compute_dtype(q.dtype)
    ch = _Chunker(p, q, k, v, extras, cdt)
    g5 = lambda t: t.unflatten(1, (p.h_kv, p.group))  # noqa: E731  [b,h_q,...] -> [b,h_kv,g,...]
    do = g5(grad_out)
    delta = (do.to(cdt) * g5(out).to(cdt)).sum(-1)             # rowsum(dO * O) [b,h_kv,g,s_q]
    if dsink is not None:
        dsink.copy_(sink_grad(extras["sink"], lse, delta))
    # rows with no key have lse -inf: read as +inf so their P = exp(s - lse) is 0 (never -inf - -inf)
    lse5 = g5(lse).to(cdt)
    lse5 = torch.where(lse5 == float("-inf"), float("inf"), lse5)
    rescale = 1.0 / (1.0 - p.dropout_p)
    dq_acc = torch.zeros((p.b, p.h_kv, p.group, p.s_q, p.d), dtype=cdt, device=q.device)
    dk_acc = torch.zeros((p.b, p.h_kv, p.s_kv, p.d), dtype=cdt, device=q.device)
    dv_acc = torch.zeros((p.b, p.h_kv, p.s_kv, p.d_v), dtype=cdt, device=q.device)
    dbias = torch.zeros((p.b, p.h_q, p.s_q, p.s_kv), dtype=torch.float32, device=q.device) if need_dbias else None
    for i0 in range(0, p.s_q, CHUNK_Q):
        i1 = min(i0 + CHUNK_Q, p.s_q)
        qc = ch.q[..., i0:i1, :].to(cdt)
        doc = do[..., i0:i1, :].to(cdt)
        for j0 in ch.kv_range(i0, i1):
            j1 = min(j0 + CHUNK_KV, p.s_kv)
            s, t = ch.logits(i0, i1, j0, j1)
            prob = torch.exp(s - lse5[..., i0:i1, None])           # masked entries: exp(-inf) = 0
            keep = ch.dropout(i0, i1, j0, j1)
            kc, vc = ch.kv(j0, j1)
            pd = prob if keep is None else prob * keep * rescale
            dv_acc[:, :, j0:j1] += torch.matmul(pd.transpose(-1, -2), doc).sum(2)
            dp = torch.matmul(doc, vc.transpose(-1, -2))
            if keep is not None:
                dp = dp * keep * rescale
            ds = prob * (dp - delta[..., i0:i1, None])            # d loss / d logit
            if dbias is not None:
                dbias[:, :, i0:i1, j0:j1] = ds.flatten(1, 2).float()
            if t is not None:
                ds = ds * (1.0 - t * t)                            # through softcap * tanh(x / softcap)
            ds = ds * p.scale
            dq_acc[..., i0:i1, :] += torch.matmul(ds, kc)
            dk_acc[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qc).sum(2)
    dq.copy_(dq_acc.flatten(1, 2))
    dk.copy_(dk_acc)
    dv.copy_(dv_acc)
    return dbias
