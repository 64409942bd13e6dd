"""The K/V-cache door: ``attention_with_kvcache`` (decode and prefill against a contiguous or paged cache).

Semantics are those of :func:`fusedattn.attention` on the cache seen as a dense tensor:
``attention_with_kvcache(q, k_cache, v_cache, page_table=t, seq_len_kv=n)`` equals
``fusedattn.attention(q, K, V, causal=True, causal_alignment="bottom_right", seq_len_kv=n)``
where ``K``/``V`` are the pages of ``t`` laid end to end. The Triton path runs the split-KV decode
kernel (``backends/triton/decode.py``) for a few query rows per kv head and the tiled forward kernel
for prefill, both on the cache in place; the CPU path gathers the pages with torch indexing and
calls the CPU forward.
"""
from __future__ import annotations

import functools
import math

import torch

from .fp8 import is_fp8
from .functional import _check_out, _fill_sink_lse, _like_layout, attention_forward
from .kvcache_fp8 import cache_descales, dequantize_cache, quantize_for_cache
from .plan import choose_backend, large_head_dim_plan
from .problem import (IO_DTYPES, MAX_HEAD_DIM, InvalidArgumentError, InvalidTypeError, NotSupportedError,
                      _is_flag, alibi_slopes, alibi_slopes_2d, check_head_dims, make_band, sink_logits)

__all__ = ["attention_with_kvcache"]

CACHE_LAYOUTS = ("bhsd", "bshd")
MAX_NUM_SPLITS = 128
# Packed queries (cu_seqlens_q) over the cache run as a padded [b, max_seqlen_q] batch when the padding adds
# at most this fraction of rows: the padded prefill path has the Gluon forward on Hopper (paged K/V by TMA),
# the packed one only the portable kernel's VARLEN mode (bench/NOTES.md 56: 260 TFLOP/s at page 16, where
# the padded batch reads 621). More skewed batches keep the packed kernel, which computes no padded row.
PAD_PACKED_MAX_WASTE = 0.25
_FULL_ROWS = object()       # run_triton's seq_len_q: no query lengths (every row of q is computed)


def _reads(q, k_cache, v_cache, k_new, v_new):
    """What a cache call reads while it writes its output (``functional._check_out``'s reads)."""
    return (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new))


def attention_with_kvcache(q, k_cache, v_cache, *, page_table=None, seq_len_kv=None, k_new=None, v_new=None,
                           seq_len_q=None, cu_seqlens_q=None, max_seqlen_q=None,
                           attn_scale=None, causal=True, window=None, alibi=False, softcap=0.0,
                           cache_layout="bhsd", num_splits=None, return_stats=False, validate=True,
                           backend="auto", out=None, sink=None, descale_k=None, descale_v=None):
    r"""Attention of new query tokens against a K/V cache, optionally appending their keys/values first.

    ``softmax(scale * q @ K^T [+ ALiBi], masked) @ V`` where ``K``/``V`` are the first
    ``seq_len_kv[i]`` keys of sequence ``i``'s cache. Made for decode (``s_q`` = 1..16 new
    tokens per sequence) and works for any ``s_q`` (prefill against a cache). GQA query heads
    of one kv head are processed together, so each K/V byte is read once per step; long caches
    are split along the keys over the GPU (flash-decoding) and the partials merged by their
    log-sum-exps.

    Args:
        q: ``[b, h_q, s_q, d]`` fp16 / bf16 / fp32 (fp64 on the CPU path), any strides: the
            ``s_q`` new tokens of each sequence, which are the LAST ``s_q`` tokens of it. Any head
            dim from 1 to 256 (``d_v`` may differ; 257 to 1024 run the PyTorch path). With
            ``cu_seqlens_q``: packed ``[total_q, h_q, d]``.
        k_cache, v_cache: contiguous caches ``[b, h_kv, s_max, d]`` / ``[b, h_kv, s_max, d_v]``, or,
            with ``page_table``, containers of pages ``[num_blocks, h_kv, block_size, d | d_v]``.
            Any strides. With ``cache_layout="bshd"`` they are given as ``[b, s_max, h_kv, d]`` /
            ``[num_blocks, block_size, h_kv, d]`` (FlashAttention's and vLLM's layout) instead.
            ``h_q`` must be a multiple of ``h_kv``: query head ``i`` reads kv head ``i // (h_q // h_kv)``.
            Any ``block_size`` (16, 32, 64, 128, 256 ...); it need not match the kernel's tile.
        page_table: int32 ``[b, max_blocks]`` or cuDNN's ``[b, 1, max_blocks, 1]``: key ``j`` of
            sequence ``i`` lives in block ``page_table[i, j // block_size]`` at slot
            ``j % block_size``. Slots past a sequence's length are never read (they may hold -1).
        seq_len_kv: int32 (or int64) ``[b]`` or ``[b, 1, 1, 1]``: keys in each cache, the new tokens
            INCLUDED (after appending). Default: the whole cache (``s_max``, or
            ``max_blocks * block_size``). Note: FlashAttention's ``cache_seqlens`` counts the
            cache BEFORE appending; ``seq_len_kv = cache_seqlens + s_q``.
        seq_len_q: int32 ``[b]`` or None: padded new tokens (chunked prefill, speculative decoding with
            a different count per sequence): sequence ``i`` has ``seq_len_q[i] <= s_q`` new tokens, rows
            ``0 .. seq_len_q[i] - 1`` of ``q`` (and of ``k_new``/``v_new``), which are the last
            ``seq_len_q[i]`` of its ``seq_len_kv[i]`` keys; rows past it give output 0 and are not appended.
        cu_seqlens_q, max_seqlen_q: packed new tokens instead (FlashAttention's varlen layout): int32
            ``[b + 1]`` cumulative offsets starting at 0, sequence ``i`` being rows
            ``cu_seqlens_q[i] : cu_seqlens_q[i + 1]`` of ``q [total_q, h_q, d]`` (and of ``k_new`` /
            ``v_new [total_q, h_kv, d | d_v]``, ``out [total_q, h_q, d_v]``; stats ``[h_q, total_q]``);
            ``max_seqlen_q`` an int >= the longest. Causal masks are bottom-right per sequence.
        k_new, v_new: ``[b, h_kv, s_q, d]`` / ``[b, h_kv, s_q, d_v]`` (BHSD whatever ``cache_layout``
            says) or None: written into the cache at positions ``seq_len_kv - s_q .. seq_len_kv - 1``
            (through the page table when paged) before attending, as FlashAttention's
            ``flash_attn_with_kvcache`` does. The caches are modified in place.
        attn_scale: multiplies ``q @ k^T``; default ``1 / sqrt(d)``.
        causal: bottom-right aligned (the new tokens are the last ones): token ``t`` of ``s_q``
            keeps key ``j`` iff ``j <= t + seq_len_kv - s_q``. For s_q = 2, seq_len_kv = 5::

                1 1 1 1 0
                1 1 1 1 1

            A token with no key (``seq_len_kv < s_q``) gives output 0 (stats -inf), never NaN.
        window: ``(left, right)`` around the same bottom-right diagonal (FlashAttention's
            ``window_size``): keep ``j`` iff ``t + off - left <= j <= t + off + right``,
            ``off = seq_len_kv - s_q``; -1 or None is unbounded.
        alibi: True (the ALiBi paper's slopes for ``h_q`` heads) or a float ``[h_q]`` or ``[b, h_q]`` tensor;
            adds ``slope_h * (j - t)`` as :func:`fusedattn.attention` does with ``t`` the index
            within ``q``. Only the stats see the difference from a bottom-right-aligned distance:
            a per-row constant cancels in the softmax.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        cache_layout: ``"bhsd"`` (default) or ``"bshd"``, the order of the caches' dims (above).
        num_splits: key splits per (sequence, kv head) on the Triton path; None chooses
            (FlashAttention-2's heuristic from b * h_kv, the SM count and the cache length); an
            int from 1 to 128 forces it (1: no combine pass). Ignored by the CPU path.
        return_stats: also return the natural-log log-sum-exp, fp32 ``[b, h_q, s_q, 1]``.
        validate: check ``seq_len_kv`` (not negative, within the cache, >= the new tokens when
            appending), ``seq_len_q`` (within ``[0, s_q]``), ``cu_seqlens_q`` (int32, from 0,
            non-decreasing, within ``q``, no sequence over ``max_seqlen_q``: one more host sync) and
            the page-table slots each sequence uses (within ``[0, num_blocks)``) on the
            device, raising a clear error naming the argument. Cost on a GPU: one small kernel and a device-to-host
            sync per call (a few microseconds plus the wait for queued work). It is skipped
            while a CUDA graph is being captured. With ``validate=False`` nothing is checked
            on the device, and still nothing is read or written out of bounds: lengths are
            clamped into the cache, page numbers into the container, and an append whose
            position or page is out of range is dropped.
        backend: ``"auto"`` (the Triton kernels for CUDA tensors, the CPU path for CPU tensors),
            ``"triton"`` (on CPU tensors: Triton's interpreter, needs ``TRITON_INTERPRET=1``),
            ``"cpu"``.
        out: optional preallocated output ``[b, h_q, s_q, d_v]``.
        sink: float ``[h_q]`` learnable sink logits (gpt-oss), as :func:`fusedattn.attention` has them:
            one more softmax term ``exp(sink_h)`` per row, no value row, included in the stats. With
            split keys it joins one split's partial only, so the merge counts it once. Forward only
            (no gradient here).
        descale_k, descale_v: for FP8 caches (``torch.float8_e4m3fn`` or ``float8_e5m2`` k_cache / v_cache, both
            one type), required then and refused otherwise: floats, one-element fp32 tensors or one per kv head
            ``[h_kv]``; the cache holds ``k_cache * descale_k``. q stays fp16 / bf16 / fp32, k_new / v_new in
            q's dtype are quantized on append (``sat_rne(k_new / descale_k)``). Semantics, rounding points and
            the error bound: :mod:`fusedattn.kvcache_fp8`. Emulated for now (dequantized in torch, then the
            fp32 path; num_splits is ignored): the cache's bytes are halved, not yet the time.

    Returns:
        ``out`` ``[b, h_q, s_q, d_v]`` in q's dtype and layout, or ``(out, stats)``.

    Raises:
        ``fusedattn.problem.InvalidArgumentError`` (a ValueError) / ``InvalidTypeError`` (a TypeError)
        naming the argument; ``fusedattn.NotSupportedError`` for a valid request this build cannot run.

    Example::

        >>> import torch
        >>> from fusedattn.kvcache import attention_with_kvcache
        >>> q = torch.randn(2, 8, 1, 64)                       # one new token, 8 query heads
        >>> cache_k = torch.randn(10, 2, 16, 64)               # 10 pages of 16 keys, 2 kv heads
        >>> cache_v = torch.randn(10, 2, 16, 64)
        >>> table = torch.tensor([[3, 7, 1], [0, 9, 2]], dtype=torch.int32)
        >>> lens = torch.tensor([40, 17], dtype=torch.int32)
        >>> attention_with_kvcache(q, cache_k, cache_v, page_table=table, seq_len_kv=lens).shape
        torch.Size([2, 8, 1, 64])
    """
    q_packed = q
    if cu_seqlens_q is not None:
        q = _packed_q(q, cu_seqlens_q, max_seqlen_q, seq_len_q)      # [1, h_q, total_q, d] view
        k_new, v_new = (_packed_view(name, t) for name, t in (("k_new", k_new), ("v_new", v_new)))
    c = _Call(q, k_cache, v_cache, page_table, seq_len_kv, k_new, v_new, attn_scale, causal, window, alibi,
              softcap, cache_layout, num_splits, backend, seq_len_q, cu_seqlens_q, max_seqlen_q, sink,
              descale_k, descale_v)
    if c.packed:
        shape_o = (q.shape[2], c.h_q, c.d_v)
        if out is None:
            out = q_packed.new_empty(shape_o)
        else:
            _check_out("out", out, shape_o, q.dtype, q.device, _reads(q, k_cache, v_cache, k_new, v_new))
        stats = torch.empty((c.h_q, q.shape[2]), dtype=torch.float32, device=q.device) if return_stats else None
        if validate:
            c.validate()
        c.run_packed(out, stats)
        return (out, stats) if return_stats else out
    shape_o = (c.b, c.h_q, c.s_q, c.d_v)
    if out is None:
        out = _like_layout(q, shape_o, q.dtype)
    else:
        _check_out("out", out, shape_o, q.dtype, q.device, _reads(q, k_cache, v_cache, k_new, v_new))
    stats = torch.empty((c.b, c.h_q, c.s_q, 1), dtype=torch.float32, device=q.device) if return_stats else None
    lse = stats[..., 0] if stats is not None else None

    if validate:
        c.validate()
    if c.s_q > 0:
        if c.k_new is not None:
            c.append()
        if c.cap == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))     # no key at all: the log of an empty sum
                if c.sink is not None:       # ... but for the sink's term
                    _fill_sink_lse(lse, {"sink": c.sink, "seq_len_q": c.seq_len_q})
        elif c.backend == "cpu" or (c.fp8 and not c.fp8_decode()):
            c.run_cpu(out, stats)           # FP8 caches past decode: the emulation (dequantize, then fp32)
        else:
            c.run_triton(out, lse)
    return (out, stats) if return_stats else out


class _Call:
    """One validated call: normalized views of every input and the derived sizes."""

    def __init__(self, q, k_cache, v_cache, page_table, seq_len_kv, k_new, v_new, attn_scale, causal, window,
                 alibi, softcap, cache_layout, num_splits, backend, seq_len_q=None, cu_seqlens_q=None,
                 max_seqlen_q=None, sink=None, descale_k=None, descale_v=None):
        _tensor("q", q, "[b, h_q, s_q, d]")
        dev = q.device
        if q.dtype not in IO_DTYPES:
            raise InvalidTypeError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32 "
                                   f"(float64 on the CPU path)")
        if cache_layout not in CACHE_LAYOUTS:
            raise InvalidArgumentError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {cache_layout!r}")
        self.paged = page_table is not None
        kind = ("[num_blocks, h_kv, block_size, d]" if self.paged else "[b, h_kv, s_max, d]")
        if cache_layout == "bshd":
            kind = ("[num_blocks, block_size, h_kv, d]" if self.paged else "[b, s_max, h_kv, d]")
        _tensor("k_cache", k_cache, kind + (" (a paged container, since page_table is given)" if self.paged else ""))
        _tensor("v_cache", v_cache, kind.replace(", d]", ", d_v]"))
        self.fp8 = is_fp8(k_cache) or is_fp8(v_cache)       # dtypes checked by cache_descales, below
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not self.fp8 and t.dtype != q.dtype:
                raise InvalidTypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match "
                                       f"(or be float8 with descale_k / descale_v)")
            if t.device != dev:
                raise InvalidArgumentError(f"{name} is on {t.device} but q is on {dev}")
        if cache_layout == "bshd":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        self.q, self.k_cache, self.v_cache = q, k_cache, v_cache
        self.b, self.h_q, self.s_q, self.d = q.shape
        # packed new tokens: q is a [1, h_q, total_q, d] view; b sequences of at most max_seqlen_q
        self.packed = cu_seqlens_q is not None
        self.cu_seqlens_q = cu_seqlens_q
        if self.packed:
            self.b, self.s_q = cu_seqlens_q.numel() - 1, max_seqlen_q
        n0, self.h_kv, s1, dk = k_cache.shape
        if tuple(v_cache.shape[:3]) != (n0, self.h_kv, s1):
            raise InvalidArgumentError(
                f"k_cache and v_cache must agree on all dims but the last; got k_cache {_shape(k_cache, cache_layout)}"
                f", v_cache {_shape(v_cache, cache_layout)} (cache_layout={cache_layout!r})")
        self.d_v = v_cache.shape[3]
        if dk != self.d:
            raise InvalidArgumentError(f"head dim of k_cache ({dk}) must equal that of q ({self.d})")
        check_head_dims(self.d, self.d_v)
        if self.b == 0 or self.h_q == 0:
            raise InvalidArgumentError(f"q has an empty batch or head dim: shape {tuple(q.shape)}")
        if self.h_kv == 0 or self.h_q % self.h_kv != 0:
            raise InvalidArgumentError(
                f"query heads ({self.h_q}) must be a multiple of the caches' kv heads ({self.h_kv}) for GQA/MQA")
        self.g = self.h_q // self.h_kv
        self.descale_k, self.descale_v = cache_descales(k_cache, v_cache, descale_k, descale_v, self.h_kv, dev)

        if self.paged:
            self.page_table = _page_table(page_table, self.b, dev)
            self.num_pages, self.page_size = n0, s1
            if self.num_pages == 0 or self.page_size == 0:
                raise InvalidArgumentError(
                    f"k_cache container has no pages: shape {_shape(k_cache, cache_layout)} "
                    f"(num_blocks or block_size 0)")
            self.cap = self.page_table.shape[1] * self.page_size
        else:
            self.page_table = None
            if n0 != self.b:
                raise InvalidArgumentError(
                    f"k_cache has batch {n0} but q has {self.b} (a contiguous cache is [b, h_kv, s_max, d]; "
                    f"pass page_table= for a paged container)")
            self.num_pages, self.page_size = 0, 0
            self.cap = s1
        self.seq_len_kv = _lengths(seq_len_kv, self.b, dev)
        self.seq_len_q = _lengths(seq_len_q, self.b, dev, "seq_len_q") if not self.packed else None

        self.k_new = self.v_new = None
        if (k_new is None) != (v_new is None):
            raise InvalidArgumentError("k_new and v_new must be given together (or neither)")
        if k_new is not None:
            for name, t, dd in (("k_new", k_new, self.d), ("v_new", v_new, self.d_v)):
                _tensor(name, t, "[b, h_kv, s_q, d]")
                want = (self.b, self.h_kv, self.s_q, dd) if not self.packed else (1, self.h_kv, q.shape[2], dd)
                if tuple(t.shape) != want:
                    last = "d" if name == "k_new" else "d_v"
                    raise InvalidArgumentError(f"{name} must have shape [b, h_kv, s_q, {last}] = {list(want)}, "
                                               f"got {list(t.shape)}")
                if t.dtype != q.dtype:
                    raise InvalidTypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match"
                                           + (" (an FP8 cache quantizes them on append)" if self.fp8 else ""))
                if t.device != dev:
                    raise InvalidArgumentError(f"{name} is on {t.device} but q is on {dev}")
            if self.seq_len_kv is None and self.cap < self.s_q:
                raise InvalidArgumentError(
                    f"the cache holds {self.cap} keys, fewer than the s_q = {self.s_q} new tokens of k_new/v_new")
            self.k_new, self.v_new = k_new, v_new

        if attn_scale is None:
            attn_scale = 1.0 / math.sqrt(self.d)
        try:
            attn_scale = float(attn_scale)
            softcap = float(softcap or 0.0)
        except (TypeError, ValueError):
            raise InvalidTypeError(f"attn_scale and softcap must be floats, got {attn_scale!r}, {softcap!r}") from None
        if not math.isfinite(attn_scale) or attn_scale <= 0:
            raise InvalidArgumentError(f"attn_scale must be finite and > 0, got {attn_scale}")
        if not math.isfinite(softcap) or softcap < 0:
            raise InvalidArgumentError(f"softcap must be >= 0 (0 = off), got {softcap}")
        self.scale, self.softcap = attn_scale, softcap
        if not _is_flag(causal):        # bool("no") is True: a mistyped flag must not read as a mask
            raise InvalidTypeError(f"causal must be a bool, got {causal!r}")
        self.causal, self.window, self.alibi = bool(causal), window, alibi
        self.band = make_band(self.causal, "bottom_right", window, self.s_q, self.cap)
        self.slopes = None
        if isinstance(alibi, torch.Tensor):
            self.slopes = alibi_slopes_2d(alibi, self.b, self.h_q, dev)        # fp32 [b, h_q]
        elif alibi:
            self.slopes = alibi_slopes(self.h_q, dev).expand(self.b, self.h_q)
        self.sink = sink_logits(sink, self.h_q, dev)                           # fp32 [h_q] or None

        if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                       or not 1 <= num_splits <= MAX_NUM_SPLITS):
            raise InvalidArgumentError(f"num_splits must be None (automatic) or an int in [1, {MAX_NUM_SPLITS}], "
                                       f"got {num_splits!r}")
        self.num_splits = num_splits
        d_max = max(self.d, self.d_v)
        self.backend = (large_head_dim_plan(backend, d_max, dev.type).backend if d_max > MAX_HEAD_DIM
                        else choose_backend(backend, dev.type))
        if self.backend == "triton" and q.dtype == torch.float64:
            raise NotSupportedError("float64 runs on the CPU path only (backend='cpu')")

    @functools.cached_property
    def lens_q(self):
        """New tokens per sequence, [b] int32 on the device, or None (every sequence has s_q). Packed calls make
        it from cu_seqlens_q on first use only (the validation's room check, the appends, the portable routes):
        the kernels read cu_seqlens_q themselves, so a trusted call (validate=False) launches no subtraction."""
        if self.packed:
            return (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).contiguous()
        return self.seq_len_q

    # -- device-side checks

    def validate(self):
        """seq_len_kv, seq_len_q / cu_seqlens_q and the used page-table slots, on the device; one host sync
        (two with cu_seqlens_q), skipped in graph capture."""
        q = self.q
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if self.packed:
            _check_cu_seqlens_q(self.cu_seqlens_q, q.shape[2], self.s_q)
        if self.seq_len_kv is None and not self.paged and self.lens_q is None:
            return
        lens = self.seq_len_kv
        if lens is None:
            lens = torch.full((self.b,), self.cap, dtype=torch.int32, device=q.device)
        need_room = self.k_new is not None
        if self.backend == "triton":
            from .backends.triton.decode import launch_validate
            from .backends.triton.args import aligned
            codes = launch_validate(aligned(lens), aligned(self.page_table) if self.paged else None,
                                    self.num_pages, self.page_size, self.s_q, self.cap, need_room,
                                    aligned(self.lens_q))
        else:
            codes = _codes_torch(lens, self.page_table, self.num_pages, self.page_size, self.s_q, self.cap,
                                 need_room, self.lens_q)
        codes = codes.tolist()
        if any(codes):
            self._raise(codes, lens)

    def _raise(self, codes, lens):
        from .backends.triton.decode import BAD_NEGATIVE, BAD_NO_ROOM, BAD_OVER_CAP, BAD_SEQ_Q
        i = next(j for j, code in enumerate(codes) if code)
        code, n = codes[i], int(lens[i])
        n_q = int(self.lens_q[i]) if self.lens_q is not None else self.s_q
        where = (f"the page table covers {self.page_table.shape[1]} blocks x block_size {self.page_size} = "
                 f"{self.cap} keys" if self.paged else f"the cache holds s_max = {self.cap} keys")
        if code & BAD_SEQ_Q:
            msg = f"seq_len_q[{i}] = {n_q} is outside [0, s_q] = [0, {self.s_q}]"
        elif code & BAD_NEGATIVE:
            msg = f"seq_len_kv[{i}] = {n} is negative"
        elif code & BAD_OVER_CAP:
            msg = f"seq_len_kv[{i}] = {n} is beyond the cache: {where}"
        elif code & BAD_NO_ROOM:
            new = (f"s_q = {n_q}" if self.lens_q is None else
                   f"{n_q} new tokens of sequence {i} ({'cu_seqlens_q' if self.packed else 'seq_len_q'})")
            msg = (f"seq_len_kv[{i}] = {n} < {new}: seq_len_kv counts the keys INCLUDING the new tokens of "
                   f"k_new/v_new (FlashAttention's cache_seqlens + s_q)")
        else:
            used = -(-max(0, min(n, self.cap)) // self.page_size)
            row = self.page_table[i, :used].cpu()
            j = int(((row < 0) | (row >= self.num_pages)).nonzero()[0, 0])
            msg = (f"page_table[{i}, {j}] = {int(row[j])} is out of range of the containers' "
                   f"{self.num_pages} blocks (valid: 0 .. {self.num_pages - 1}); sequence {i} of {n} keys uses "
                   f"page-table slots 0 .. {used - 1}")
        bad = sum(1 for code in codes if code)
        raise InvalidArgumentError(msg + (f" ({bad} sequences have invalid lengths or pages)" if bad > 1 else "")
                                   + ". Pass validate=False to skip these checks (then lengths and pages are "
                                   "clamped, never read out of bounds).")

    # -- append
    def append(self):
        """Write k_new/v_new into the caches (in place) at seq_len_kv - s_q .. seq_len_kv - 1."""
        from .backends.triton.args import misaligned
        if self.fp8:
            _append_fp8(self)
        elif self.backend == "triton" and not any(misaligned(t) for t in (self.k_cache, self.v_cache, self.page_table,
                                                                          self.seq_len_kv, self.seq_len_q,
                                                                          self.cu_seqlens_q)):
            from .backends.triton.decode import launch_append
            launch_append(self.k_new, self.v_new, self.k_cache, self.v_cache, self.page_table, self.seq_len_kv,
                          self.cap, seq_len_q=self.seq_len_q, cu_seqlens_q=self.cu_seqlens_q,
                          max_seqlen_q=self.s_q if self.packed else None)
        else:
            _append_torch(self)

    # -- the two paths
    def fp8_decode(self) -> bool:
        """Whether an FP8 cache's call runs the decode kernel on the cache's bytes (KV_FP8, [Note] FP8
        caches in backends/triton/decode.py): a few query rows per kv head and 16-bit queries. Prefill
        against an FP8 cache (the tiled forward), fp32 queries and GPUs without FP8 kernels
        (``plan.fp8_kernels_run``) run the emulation."""
        from .backends.triton import decode
        from .plan import fp8_kernels_run
        return (self.q.dtype in (torch.float16, torch.bfloat16) and decode.decode_rows_fit(self.s_q, self.g)
                and fp8_kernels_run(self.q.device))

    def run_cpu(self, out, stats, q=None):
        """Gather the used pages into dense [b, h_kv, n, d] tensors and run the CPU forward
        (q: the padded queries [b, h_q, s_q, d] of a packed call).

        FP8 caches (the emulation, any device): the gathered bytes are dequantized to fp32 and the dense
        forward runs in fp32 on the call's backend; out (q's dtype) takes the fp32 result, rounded once."""
        k, v = self.k_cache, self.v_cache
        lens = self.seq_len_kv
        longest = self.cap
        if lens is not None and (self.paged or self.fp8):
            longest = int(lens.clamp(0, self.cap).max())         # read only up to the longest sequence
        if self.paged:
            n_pages = max(1, -(-longest // self.page_size))
            idx = self.page_table[:, :n_pages].long().clamp(0, self.num_pages - 1)       # [b, n_pages]
            k, v = (_gather_pages(t, idx) for t in (k, v))
        elif self.fp8:
            k, v = k[:, :, :max(1, longest)], v[:, :, :max(1, longest)]        # dequantize only the used rows
        backend, out_dense = "cpu", out
        if self.fp8:
            k, v = dequantize_cache(k, self.descale_k), dequantize_cache(v, self.descale_v)
            q = (self.q if q is None else q).float()
            backend = self.backend
            if out.dtype != torch.float32:
                out_dense = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        if lens is not None:
            # keys past a sequence's length may hold anything (NaN from torch.empty, a previous
            # sequence): the CPU forward multiplies their zero probabilities by V, so zero them
            past = torch.arange(k.shape[2], device=k.device)[None, :] >= lens.long()[:, None]
            k, v = (t.masked_fill(past[:, None, :, None], 0) for t in (k, v))
        attention_forward(
            self.q if q is None else q, k, v, attn_scale=self.scale, causal=self.causal,
            causal_alignment="bottom_right", window=self.window, seq_len_q=self.lens_q, seq_len_kv=lens,
            alibi=self.slopes if self.slopes is not None else False, softcap=self.softcap, backend=backend,
            out=out_dense, stats_out=stats, sink=self.sink,
            validate=False)     # lengths: checked by self.validate(), or clamped (validate=False)
        if out_dense is not out:
            out.copy_(out_dense)
        return out

    def run_packed(self, out, stats):
        """Packed new tokens: append, then attend. out [total_q, h_q, d_v], stats fp32 [h_q, total_q] or None.

        The Triton path is the tiled forward kernel with both of its switches on, VARLEN (query rows from
        cu_seqlens_q) and PAGED (keys through the page table; a contiguous cache is read as pages of
        s_max keys, page i = sequence i): the keys' lengths come from cumulative offsets built from
        seq_len_kv on the device (no sync). The CPU path pads the queries and runs run_cpu."""
        if self.k_new is not None and self.s_q > 0:
            self.append()
        if self.backend == "cpu" or self.fp8:
            from .varlen import _pad, _unpad
            q_pad, _ = _pad(self.q[0].transpose(0, 1), self.cu_seqlens_q, self.b, self.s_q)
            o = torch.empty((self.b, self.h_q, self.s_q, self.d_v), dtype=self.q.dtype, device=self.q.device)
            st = torch.empty((self.b, self.h_q, self.s_q, 1), dtype=torch.float32, device=self.q.device)
            if self.cap == 0:
                o.zero_()
                st.fill_(float("-inf"))         # no key at all: the log of an empty sum
                if self.sink is not None:       # ... but for the sink's term (padding rows are cut below)
                    st.copy_(self.sink.view(1, -1, 1, 1).expand_as(st))
            else:
                self.run_cpu(o, st, q=q_pad)
            total = self.q.shape[2]
            # rows past cu_seqlens_q[-1] keep what out / stats held, as on the kernels' routes
            end = max(0, min(int(self.cu_seqlens_q[-1]), total))
            out[:end].copy_(_unpad(o, self.cu_seqlens_q, total)[:end])
            if stats is not None:
                stats[:, :end].copy_(_unpad(st, self.cu_seqlens_q, total)[:end, ..., 0].T)
            return
        if self.s_q == 0 or self.q.shape[2] == 0:
            return                      # no new token: nothing to write (rows past cu_seqlens_q[-1] are left)
        if self.cap == 0 or self.b == 0:
            out.zero_()
            if stats is not None:
                stats.fill_(float("-inf"))      # no key at all: the log of an empty sum
                if self.sink is not None:       # ... but for the sink's term
                    stats.copy_(self.sink.view(-1, 1).expand_as(stats))
            return
        if self._run_packed_gluon(out, stats):
            return
        total = self.q.shape[2]
        if self.b * self.s_q <= (1 + PAD_PACKED_MAX_WASTE) * total:
            self._run_packed_padded(out, stats)
            return
        import dataclasses
        from .backends.triton.fwd import launch_fwd
        from .plan import plan
        from .problem import make_problem
        table, k, v = self.page_table, self.k_cache, self.v_cache
        if table is None:
            table = torch.arange(self.b, dtype=torch.int32, device=self.q.device).view(self.b, 1)
        lens = self.seq_len_kv if self.seq_len_kv is not None else \
            torch.full((self.b,), self.cap, dtype=torch.int32, device=self.q.device)
        cu_kv = torch.zeros(self.b + 1, dtype=torch.int32, device=self.q.device)
        torch.cumsum(lens, 0, dtype=torch.int32, out=cu_kv[1:])     # differences are exact even if it wraps
        q4 = self.q.expand(self.b, -1, -1, -1)                        # batch stride 0: VARLEN reads rows by offset
        p, extras = make_problem(q4, k, v, attn_scale=self.scale, causal=self.causal,
                                 causal_alignment="bottom_right", window=self.window,
                                 alibi=self.slopes[0] if self.slopes is not None else False, softcap=self.softcap,
                                 page_table_k=table, page_table_v=table, sink=self.sink, validate=False)
        p = dataclasses.replace(p, s_q=self.s_q, varlen=True)
        extras.update(cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_kv=cu_kv, slopes=self.slopes)
        lse4 = stats.unsqueeze(0) if stats is not None else None          # [1, h_q, total_q]
        launch_fwd(p, plan(p, "triton").fwd, q4, k, v, out.unsqueeze(0).transpose(1, 2), lse4, extras)

    def _run_packed_gluon(self, out, stats) -> bool:
        """Packed queries on the Gluon sm_90 forward's packed mode (``fwd_sm90`` [Note] packed queries): the
        kernel reads each sequence's rows from the packed q and writes them to ``out`` / ``stats`` in place,
        over the paged or contiguous cache, with no gather and no host sync. False (nothing done) where it
        does not take the call (not Hopper, softcap, a dtype or strides TMA cannot read ...). out [total_q,
        h_q, d_v], stats fp32 [h_q, total_q] or None."""
        import dataclasses
        from .functional import _run_packed_gluon
        from .problem import make_problem
        if not self.q.is_cuda:
            return False
        table = self.page_table if self.paged else None
        lens = self.seq_len_kv if self.seq_len_kv is not None else \
            torch.full((self.b,), self.cap, dtype=torch.int32, device=self.q.device)
        q4 = self.q.expand(self.b, -1, -1, -1)          # the padded batch it stands for (s_q set below)
        p, extras = make_problem(q4, self.k_cache, self.v_cache, attn_scale=self.scale, causal=self.causal,
                                 causal_alignment="bottom_right", window=self.window,
                                 alibi=self.slopes[0] if self.slopes is not None else False, softcap=self.softcap,
                                 seq_len_kv=lens, page_table_k=table, page_table_v=table, sink=self.sink,
                                 validate=False)
        p = dataclasses.replace(p, s_q=self.s_q, has_seq_len_q=True)
        o4 = out.unsqueeze(0).transpose(1, 2)                           # [1, h_q, total_q, d_v]
        lse4 = stats.unsqueeze(0) if stats is not None else None        # [1, h_q, total_q]
        return _run_packed_gluon(p, self.q, self.k_cache, self.v_cache, o4, lse4, self.cu_seqlens_q,
                                 slopes=self.slopes, seq_len_kv=extras["seq_len_kv"], sink=extras["sink"],
                                 page_table_k=extras["page_table_k"], page_table_v=extras["page_table_v"])

    def _run_packed_padded(self, out, stats):
        """Packed queries as a padded batch through :meth:`run_triton` (``PAD_PACKED_MAX_WASTE`` says why).
        Gathers on the device, no host sync (CUDA graphs keep working). Each sequence's rows sit at the
        *end* of its padded block, so the kernel runs with no query lengths at all: bottom-right alignment
        against the block's s_q rows puts row j of a sequence of n rows on key L - n + j, as its own
        alignment would; the padding rows in front are computed (masked, often empty) and never read back.
        Query lengths would make the kernel mask its stores, which cost the padded route half its speed on
        an H100 (bench/NOTES.md 57). Packed rows past cu_seqlens_q[-1] keep what ``out`` / ``stats`` held,
        as in the packed kernel. out [total_q, h_q, d_v], stats fp32 [h_q, total_q] or None."""
        q = self.q[0].transpose(0, 1)                               # [total, h_q, d]
        total, dev = q.shape[0], q.device
        cu = self.cu_seqlens_q.long()
        lens = (cu[1:] - cu[:-1]).clamp_(0, self.s_q)
        start = cu[:-1] + lens - self.s_q                           # packed row of padded row 0 (may be < 0)
        src = (start[:, None] + torch.arange(self.s_q, device=dev)).clamp_(0, max(total - 1, 0))   # [b, s_q]
        q_pad = q[src].transpose(1, 2)                              # [b, h_q, s_q, d] over BSHD memory
        o_pad = torch.empty((self.b, self.s_q, self.h_q, self.d_v), dtype=out.dtype, device=dev).transpose(1, 2)
        st_pad = (torch.empty((self.b, self.h_q, self.s_q), dtype=torch.float32, device=dev)
                  if stats is not None else None)
        self.run_triton(o_pad, st_pad, q=q_pad, seq_len_q=_FULL_ROWS)
        row = torch.arange(total, device=dev)
        seq = torch.searchsorted(cu[1:], row, right=True)           # the sequence of each packed row
        written = seq < self.b                                      # False past cu_seqlens_q[-1]
        seq = seq.clamp_(max=self.b - 1)
        pos = (row - start[seq]).clamp_(0, self.s_q - 1)
        # one row gather from the padded output's [b * s_q] rows (contiguous: index_select's fast path,
        # not the general two-index gather), then one select into out in place (no extra copy pass)
        o_rows = o_pad.transpose(1, 2).reshape(self.b * self.s_q, self.h_q, self.d_v)      # a view
        torch.where(written[:, None, None], o_rows.index_select(0, seq * self.s_q + pos), out, out=out)
        if stats is not None:
            st = st_pad.transpose(1, 2)[seq, pos]                   # [total, h_q]
            if self.slopes is not None:
                # ALiBi adds slope * (j - i) with i the row's index (cuDNN's convention): a row moved down
                # by s_q - n saw a bias lower by slope * (s_q - n); the output does not see a row's constant
                st = st + self.slopes[seq] * (self.s_q - lens[seq]).to(st.dtype)[:, None]
            stats.copy_(torch.where(written[:, None], st, stats.T).T)

    def run_triton(self, out, lse, q=None, seq_len_q=None):
        """The Triton kernels on ``q`` (default: the call's) with per-sequence query lengths ``seq_len_q``
        (default: the call's; ``_FULL_ROWS``: none, every row is a query): the tiled forward for prefill,
        split-KV decode for a few rows a kv head."""
        from .backends.triton import decode
        from .backends.triton.args import aligned, aligned_output
        q = self.q if q is None else q
        if seq_len_q is None:
            seq_len_q = self.seq_len_q
        elif seq_len_q is _FULL_ROWS:
            seq_len_q = None
        if not decode.decode_rows_fit(self.s_q, self.g):
            # prefill: the tiled forward kernel reads the cache, paged or not, in place
            table = self.page_table if self.paged else None
            attention_forward(
                q, self.k_cache, self.v_cache, attn_scale=self.scale, causal=self.causal,
                causal_alignment="bottom_right", window=self.window, seq_len_q=seq_len_q,
                seq_len_kv=self.seq_len_kv, alibi=self.slopes if self.slopes is not None else False,
                softcap=self.softcap,
                page_table_k=table, page_table_v=table, backend="triton", out=out,
                stats_out=lse.unsqueeze(-1) if lse is not None else None, sink=self.sink,
                validate=False)             # lengths: checked by self.validate(), or clamped (validate=False)
            return
        tiles, splits = decode.plan_decode(self.b, self.h_kv, self.g, self.s_q, self.d, self.d_v, self.q.dtype,
                                           self.cap, self.q.device, self.num_splits,
                                           kv_dtype=self.k_cache.dtype, paged=self.paged)
        o_buf, o_target = aligned_output(out)
        l_buf, l_target = aligned_output(lse) if lse is not None else (None, None)
        decode.launch_decode(
            aligned(q), aligned(self.k_cache), aligned(self.v_cache), aligned(self.page_table),
            aligned(self.seq_len_kv), self.slopes, o_buf, l_buf, scale=self.scale, softcap=self.softcap,
            band=self.band, tiles=tiles, num_splits=splits, cap=self.cap, seq_len_q=aligned(seq_len_q),
            sink=self.sink, descale_k=self.descale_k, descale_v=self.descale_v)
        for buf, target in ((o_buf, o_target), (l_buf, l_target)):
            if target is not None:
                target.copy_(buf)


# ----------------------------------------------------------------------------- helpers

def _tensor(name, t, shape_doc):
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dim() != 4:
        raise InvalidArgumentError(f"{name} must be 4-D {shape_doc}, got shape {list(t.shape)}")


def _shape(t, layout):
    return list(t.transpose(1, 2).shape) if layout == "bshd" else list(t.shape)


def _page_table(t, b, device):
    """[b, max_blocks] or [b, 1, max_blocks, 1] int32 -> a [b, max_blocks] view (no copy)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"page_table must be an int32 tensor [b, max_blocks] or [b, 1, max_blocks, 1], "
                               f"got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InvalidTypeError(f"page_table must be int32 (as cuDNN's and FlashAttention's), got {t.dtype}")
    if t.dim() == 4 and t.shape[0] == b and t.shape[1] == 1 and t.shape[3] == 1:
        t = t[:, 0, :, 0]
    elif not (t.dim() == 2 and t.shape[0] == b):
        raise InvalidArgumentError(
            f"page_table must have shape [b, max_blocks] or [b, 1, max_blocks, 1] with b = {b}, got {list(t.shape)}")
    if t.shape[1] == 0:
        raise InvalidArgumentError("page_table has no columns (max_blocks = 0)")
    if t.device != device:
        raise InvalidArgumentError(f"page_table is on {t.device} but q is on {device}")
    return t


def _lengths(t, b, device, name="seq_len_kv"):
    """seq_len_kv (or seq_len_q) as int32 [b] (int64 is converted, clamped so that no value wraps into range)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be an int32 tensor of shape [b] or [b, 1, 1, 1], "
                               f"got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise InvalidTypeError(f"{name} must be an int32 (or int64) tensor, got dtype {t.dtype}")
    if t.numel() != b or t.dim() not in (1, 4) or (t.dim() == 4 and tuple(t.shape) != (b, 1, 1, 1)):
        raise InvalidArgumentError(f"{name} must have shape [{b}] or [{b}, 1, 1, 1] (batch {b}), "
                                   f"got {list(t.shape)}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device} but q is on {device}")
    t = t.reshape(b)
    if t.dtype == torch.int64:
        t = t.clamp(-1, 2 ** 31 - 1).to(torch.int32)
    return t.contiguous()                 # the kernels read seq_len_kv[i] at offset i


def _codes_torch(lens, page_table, num_pages, page_size, s_q, cap, need_room, lens_q=None):
    """The validation kernel's per-batch codes, in torch (the CPU path)."""
    from .backends.triton.decode import BAD_NEGATIVE, BAD_NO_ROOM, BAD_OVER_CAP, BAD_PAGE, BAD_SEQ_Q
    lens = lens.long()
    codes = (lens < 0).int() * BAD_NEGATIVE + (lens > cap).int() * BAD_OVER_CAP
    need = torch.full_like(lens, s_q)
    if lens_q is not None:
        need = lens_q.long()
        codes += ((need < 0) | (need > s_q)).int() * BAD_SEQ_Q
    if need_room:
        codes += (lens < need).int() * BAD_NO_ROOM
    if page_table is not None:
        used = (lens.clamp(0, cap) + page_size - 1) // page_size
        slot = torch.arange(page_table.shape[1], device=lens.device)
        bad = (slot[None, :] < used[:, None]) & ((page_table < 0) | (page_table >= num_pages))
        codes += bad.any(1).int() * BAD_PAGE
    return codes


def _gather_pages(container, idx):
    """Container [N, h, P, d] and block indices [b, n] -> dense [b, h, n * P, d]."""
    b, n = idx.shape
    _, h, p, d = container.shape
    return container[idx].permute(0, 2, 1, 3, 4).reshape(b, h, n * p, d)


def _append_torch(c):
    """The append with torch indexing (CPU path; misaligned caches): skips out-of-range positions/pages."""
    dev = c.q.device
    lens = c.seq_len_kv.long() if c.seq_len_kv is not None else torch.full((c.b,), c.cap, device=dev)
    len_q = c.lens_q.long().clamp(max=c.s_q) if c.lens_q is not None else torch.full((c.b,), c.s_q, device=dev)
    tok = torch.arange(c.s_q, device=dev)[None, :]
    pos = lens[:, None] - len_q[:, None] + tok                                  # [b, s_q]
    ok = (pos >= 0) & (pos < c.cap) & (tok < len_q[:, None])
    pos = torch.where(ok, pos, 0)
    if c.paged:
        page = c.page_table.long().gather(1, pos // c.page_size)
        ok = ok & (page >= 0) & (page < c.num_pages)
        bi, ti = ok.nonzero(as_tuple=True)
        first, second = page[bi, ti], pos[bi, ti] % c.page_size
    else:
        bi, ti = ok.nonzero(as_tuple=True)
        first, second = bi, pos[bi, ti]
    if c.packed:
        # packed new tokens: token t of sequence i is row cu_seqlens_q[i] + t of k_new/v_new [1, h_kv, total, d]
        rows = c.cu_seqlens_q.long()[bi] + ti
        for cache, new in ((c.k_cache, c.k_new), (c.v_cache, c.v_new)):
            cache.transpose(1, 2)[first, second] = new[0].transpose(0, 1)[rows]
        return
    for cache, new in ((c.k_cache, c.k_new), (c.v_cache, c.v_new)):
        cache.transpose(1, 2)[first, second] = new.transpose(1, 2)[bi, ti]


def _append_fp8(c):
    """The append into FP8 caches: k_new / v_new quantized with the caches' descales (kvcache_fp8's rule),
    then written by the torch append (any device; a Triton append would round with its own conversion)."""
    k_new, v_new = c.k_new, c.v_new
    c.k_new = quantize_for_cache(k_new, c.descale_k, c.k_cache.dtype)
    c.v_new = quantize_for_cache(v_new, c.descale_v, c.v_cache.dtype)
    try:
        _append_torch(c)
    finally:
        c.k_new, c.v_new = k_new, v_new


def _packed_q(q, cu_seqlens_q, max_seqlen_q, seq_len_q):
    """Packed new tokens q [total_q, h_q, d] -> the [1, h_q, total_q, d] view the kernels read; checks
    the offsets' type and shape (their values: _check_cu_seqlens_q, under validate)."""
    if seq_len_q is not None:
        raise InvalidArgumentError("seq_len_q and cu_seqlens_q are two spellings of the new tokens per "
                                   "sequence (padded or packed); pass one of them")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise InvalidArgumentError(f"with cu_seqlens_q, q must be packed [total_q, h_q, d], got "
                                   f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dtype != torch.int32 or \
            cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
        raise InvalidTypeError(f"cu_seqlens_q must be an int32 tensor [b + 1] of cumulative offsets, got "
                               f"{getattr(cu_seqlens_q, 'dtype', type(cu_seqlens_q).__name__)} "
                               f"{list(getattr(cu_seqlens_q, 'shape', []))}")
    if cu_seqlens_q.device != q.device:
        raise InvalidArgumentError(f"cu_seqlens_q is on {cu_seqlens_q.device} but q is on {q.device}")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise InvalidArgumentError(f"max_seqlen_q must be an int >= 0 (the longest new-token run) with "
                                   f"cu_seqlens_q, got {max_seqlen_q!r}")
    return q.unsqueeze(0).transpose(1, 2)


def _packed_view(name, t):
    """k_new / v_new packed [total_q, h_kv, d] -> [1, h_kv, total_q, d] views (None stays None)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise InvalidArgumentError(f"with cu_seqlens_q, {name} must be packed [total_q, h_kv, d], got "
                                   f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return t.unsqueeze(0).transpose(1, 2)


def _check_cu_seqlens_q(cu, total, max_len):
    """cu_seqlens_q's values (validate=True; one host sync): from 0, non-decreasing, within the packed q,
    no run longer than max_seqlen_q."""
    c = cu.cpu().long()
    lens = c[1:] - c[:-1]
    if int(c[0]) != 0:
        raise InvalidArgumentError(f"cu_seqlens_q[0] = {int(c[0])}; cumulative offsets start at 0")
    if (lens < 0).any():
        i = int((lens < 0).nonzero()[0, 0])
        raise InvalidArgumentError(f"cu_seqlens_q must be non-decreasing: cu_seqlens_q[{i + 1}] = {int(c[i + 1])} "
                                   f"< cu_seqlens_q[{i}] = {int(c[i])}")
    if int(c[-1]) > total:
        raise InvalidArgumentError(f"cu_seqlens_q[-1] = {int(c[-1])} exceeds the {total} rows of the packed q")
    if lens.numel() and int(lens.max()) > max_len:
        i = int(lens.argmax())
        raise InvalidArgumentError(f"sequence {i} has {int(lens[i])} new tokens (cu_seqlens_q), more than "
                                   f"max_seqlen_q = {max_len}")
