"""Pieces shared by the forward and backward kernels.

Everything that decides *which* (query, key) pairs exist lives here once:
per-sequence lengths, the diagonal band (causal / window / alignment), the
block ranges that skip tiles wholly outside the band, the score modifiers
(scale, softcap, bias, ALiBi) and the dropout mask. The forward and the
backward call the same functions, so they cannot disagree on a mask.

Scores inside kernels are kept in base 2: ``s2 = log2(e) * s`` so that
``exp2`` replaces ``exp`` and the scale folds into one multiply.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def sequence_lengths(SEQ_Q, SEQ_KV, batch, S_Q, S_KV,
                     HAS_SEQ_Q: tl.constexpr, HAS_SEQ_KV: tl.constexpr):
    """Valid lengths of this batch entry, clamped to the tensors so no read can go out of bounds."""
    len_q = S_Q
    len_kv = S_KV
    if HAS_SEQ_Q:
        len_q = tl.minimum(tl.maximum(tl.load(SEQ_Q + batch), 0), S_Q)
    if HAS_SEQ_KV:
        len_kv = tl.minimum(tl.maximum(tl.load(SEQ_KV + batch), 0), S_KV)
    return len_q, len_kv


@triton.jit
def varlen_bounds(CU_Q, CU_KV, batch, S_Q, S_KV):
    """Packed (THD) batches: first row of this sequence in q and in k/v (int64), and its lengths
    (clamped to the max lengths S_Q, S_KV the grid was sized for)."""
    q0 = tl.load(CU_Q + batch)
    kv0 = tl.load(CU_KV + batch)
    len_q = tl.minimum(tl.maximum(tl.load(CU_Q + batch + 1) - q0, 0), S_Q)
    len_kv = tl.minimum(tl.maximum(tl.load(CU_KV + batch + 1) - kv0, 0), S_KV)
    return q0.to(tl.int64), kv0.to(tl.int64), len_q, len_kv


@triton.jit
def batch_rows(SEQ_Q, SEQ_KV, CU_Q, CU_KV, batch, S_Q, S_KV, HAS_SEQ_Q: tl.constexpr,
               HAS_SEQ_KV: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """Where batch entry ``batch`` lives, how long it is, and where its diagonal sits.

    Returns (b_idx, q0, kv0, len_q, len_kv, row_end, col_end, diag). A tensor's base offset is
    ``b_idx * stride_b + q0 * stride_m`` (keys: ``kv0 * stride_n``):
    * dense [b, h, s, d]: b_idx = batch, q0 = kv0 = 0; memory bounds are the tensors' S_Q / S_KV
      (rows in [len_q, S_Q) are padding, written as 0);
    * packed (VARLEN, [total, h, d]): b_idx = 0, q0 / kv0 from the cumulative offsets; memory
      bounds are the sequence's own lengths (the next rows belong to the next sequence).
    diag: 0 (top-left) or len_kv - len_q (bottom-right), per sequence.
    """
    len_q, len_kv = sequence_lengths(SEQ_Q, SEQ_KV, batch, S_Q, S_KV, HAS_SEQ_Q, HAS_SEQ_KV)
    b_idx = batch.to(tl.int64)
    q0 = b_idx * 0
    kv0 = q0
    row_end = S_Q
    col_end = S_KV
    if VARLEN:
        q0, kv0, len_q, len_kv = varlen_bounds(CU_Q, CU_KV, batch, S_Q, S_KV)
        b_idx = q0 * 0
        row_end = len_q
        col_end = len_kv
    diag = len_q * 0
    if BOTTOM_RIGHT:
        diag = len_kv - len_q
    return b_idx, q0, kv0, len_q, len_kv, row_end, col_end, diag


@triton.jit
def kv_block_range(start_m, len_q, len_kv, diag, win_left, win_right,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks that query rows [start_m, start_m + BLOCK_M) visit.

    Returns (lo, full_lo, full_hi, hi): the rows visit keys in [lo, hi);
    blocks starting in [full_lo, full_hi) are kept whole for every row (no mask
    arithmetic needed), the ones in [lo, full_lo) and [full_hi, hi) need the
    mask. lo, full_lo, full_hi are multiples of BLOCK_N.
    Row i keeps key j iff  i + diag - left <= j <= i + diag + right  and j < len_kv.
    """
    last = tl.minimum(start_m + BLOCK_M, len_q) - 1        # last real row of the tile
    lo = start_m * 0
    hi = len_kv
    full_lo = lo
    full_hi = len_kv // BLOCK_N * BLOCK_N                 # whole blocks below len_kv
    if HAS_LEFT:
        # first row decides where the tile starts, last row where masking stops
        lo = tl.maximum(start_m + diag - win_left, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last + diag - win_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        # last row decides where the tile ends, first row where masking starts
        hi = tl.minimum(last + diag + win_right + 1, len_kv)
        full_hi = tl.minimum(full_hi, tl.maximum(start_m + diag + win_right + 1, 0) // BLOCK_N * BLOCK_N)
    hi = tl.where(start_m >= len_q, lo, tl.maximum(hi, lo))   # a tile past the sequence visits nothing
    hi_ceil = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi_ceil)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_ceil)
    return lo, full_lo, full_hi, hi


@triton.jit
def q_block_range(start_n, len_q, len_kv, diag, win_left, win_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks that see key columns [start_n, start_n + BLOCK_N): the band transposed.

    Returns (lo, full_lo, full_hi, hi) in rows: rows [lo, hi) may keep one of the
    keys; row blocks starting in [full_lo, full_hi) keep all of them and lie inside
    len_q (no mask needed). Key j is kept by row i iff j - diag - right <= i <= j - diag + left.
    """
    last = tl.minimum(start_n + BLOCK_N, len_kv) - 1       # last real key of the block
    lo = start_n * 0
    hi = len_q
    full_lo = lo
    full_hi = len_q // BLOCK_M * BLOCK_M
    full_hi = tl.where(last < start_n + BLOCK_N - 1, lo, full_hi)   # a ragged key block: mask every row block
    if HAS_RIGHT:
        lo = tl.maximum(start_n - diag - win_right, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(last - diag - win_right, 0), BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(last - diag + win_left + 1, len_q)
        full_hi = tl.minimum(full_hi, tl.maximum(start_n - diag + win_left + 1, 0) // BLOCK_M * BLOCK_M)
    hi = tl.where(start_n >= len_kv, lo, tl.maximum(hi, lo))
    hi_ceil = tl.cdiv(hi, BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi_ceil)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_ceil)
    return lo, full_lo, full_hi, hi


@triton.jit
def kv_row_offsets(start_n, offs_n, table_row, stride_table, S_KV, num_blocks, stride_block, stride_n,
                   PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets of key rows ``start_n + offs_n`` from the (batch, kv head) base.

    PAGED: key j lives in block ``table_row[(j // PAGE_SIZE) * stride_table]`` (clamped into the container, so a
    bad table never reads out of bounds) at slot ``j % PAGE_SIZE``; the block's offset is int64. When the
    tile fits in one page (PAGE_SIZE a multiple of the tile, start_n a multiple of the tile) one table
    read serves it and its rows stay contiguous, so K/V load as wide as unpaged ones.
    """
    cols = start_n + offs_n
    if PAGED:
        if tl.constexpr(PAGE_SIZE) % offs_n.shape[0] == 0:
            page = tl.load(table_row + (start_n // PAGE_SIZE) * stride_table, mask=start_n < S_KV, other=0)
        else:
            page = tl.load(table_row + (cols // PAGE_SIZE) * stride_table, mask=cols < S_KV, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
        return page.to(tl.int64) * stride_block + (cols % PAGE_SIZE) * stride_n
    else:
        return cols * stride_n


@triton.jit
def load_tile(ptrs, rows, cols, n_rows, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, bounds-checking only the dimensions that can run past the tensor."""
    if CHECK_ROWS and CHECK_COLS:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], other=0.0)
    elif CHECK_ROWS:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
    elif CHECK_COLS:
        return tl.load(ptrs, mask=(cols < n_cols)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def load_bias(BIAS, rows, cols, stride_bm, stride_bn, S_Q, S_KV, BIAS_KIND: tl.constexpr):
    """The bias tile in natural units, fp32: float bias as is, bool mask as 0 / -inf.

    ``rows`` / ``cols`` are broadcastable 2-D index tensors, so the same code serves a
    [rows, cols] tile (forward, dQ) and a [cols, rows] one (dK/dV).
    """
    ptrs = BIAS + rows * stride_bm + cols * stride_bn
    inside = (rows < S_Q) & (cols < S_KV)
    if BIAS_KIND == 2:
        keep = tl.load(ptrs, mask=inside, other=1)
        return tl.where(keep != 0, 0.0, float("-inf"))
    else:
        return tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def backward_lse(lse):
    """The forward's lse as the backward uses it: -inf (a row that saw no key) becomes +inf.

    P = exp(s - lse) must be exactly 0 on such a row, for masked scores (s = -inf: -inf - -inf
    would be NaN) and unmasked ones alike (s finite: exp(s + inf) would be inf); with +inf it is
    exp(-inf) = 0 for any s, so the row adds nothing to dQ, dK, dV or dBias.
    """
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def fold_sink(acc, m_i, l_i, sink2):
    """A finished row state (base 2: max ``m_i``, sum ``l_i``, unnormalized ``acc``) with the sink's
    term added: one more ``2^(sink2 - m)`` in the sum and no value row, so ``acc`` is only rescaled.

    sink2: base-2 sink logit per row (in the frame of m_i), -inf where a row takes no sink. A row with
    neither a key nor a sink stays empty (l 0): its new max is 0, not -inf, so no -inf - -inf arises.
    """
    m_new = tl.maximum(m_i, sink2)
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_new)
    return acc * alpha[:, None], m_new, l_i * alpha + tl.math.exp2(sink2 - m_new)


@triton.jit
def softcap_tanh(qk, qk_scale):
    """tanh(qk * qk_scale) as 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no libdevice needed."""
    return 1.0 - 2.0 / (tl.math.exp2(qk * (qk_scale * 2.0 * LOG2E)) + 1.0)


@triton.jit
def scores_base2(qk, bias, slope, rows, cols, len_q, len_kv, diag, win_left, win_right, qk_scale, softcap,
                 MASKED: tl.constexpr, MASK_ROWS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 SOFTCAP: tl.constexpr, BIAS_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Attention logits of one tile in base 2, -inf where masked.

    ``rows`` (query index) and ``cols`` (key index) are broadcastable 2-D index
    tensors matching the tile's orientation. Order (the reference's too):
    softcap(scale * q.k) + bias + ALiBi, then the band and length masks.
    ``qk_scale`` is ``scale * log2(e)``, or ``scale / softcap`` with SOFTCAP.
    ALiBi adds ``slope * (j - i)`` (cuDNN's sign); ``slope`` arrives in base 2.
    MASK_ROWS also drops rows past ``len_q`` (the backward needs it; the forward
    zeroes those rows at the end instead).
    """
    if SOFTCAP:
        s = softcap_tanh(qk, qk_scale) * (softcap * LOG2E)
    else:
        s = qk * qk_scale
    if BIAS_KIND != 0:
        s += bias * LOG2E
    if HAS_ALIBI:
        s += slope * (cols - rows).to(tl.float32)
    if MASKED:
        keep = cols < len_kv
        if MASK_ROWS:
            keep = keep & (rows < len_q)
        if HAS_LEFT:
            keep = keep & (cols >= rows + (diag - win_left))
        if HAS_RIGHT:
            keep = keep & (cols <= rows + (diag + win_right))
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def _halves(w):
    """A uint32 word's two 16-bit halves as a new last dim (low half first)."""
    return tl.join(w & 0xFFFF, w >> 16)


@triton.jit
def dropout_keep(seed, offset, bh, row0, key0, S_Q, S_KV, threshold,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_LAST: tl.constexpr):
    """Which probabilities of a tile survive dropout: a pure function of (seed, offset, b*h_q+head, row, col).

    Rows {r, r + 8} x keys {k, k + 1, k + 8, k + 9} share one Philox call (tl.randint4x), whose
    four words give eight 16-bit values; ``backends/cpu.py`` ``dropout_keep_chunk`` defines the
    counters and which value each (row, key) takes, and ``backends/gluon/dropout.py`` says why this
    grouping. Keep iff the value >= threshold = p * 2^16. row0 and key0 (the tile's first row and
    key) are multiples of 16, as are BLOCK_M and BLOCK_N, so the mask does not depend on tile sizes
    and the backward regenerates the forward's. KEYS_LAST: tile [rows, keys] (forward, dQ), else
    [keys, rows] (dK/dV).
    """
    row_groups = row0 // 2 + tl.arange(0, BLOCK_M // 2)                  # (row >> 4) * 8 + (row & 7)
    key_groups = key0 // 4 + tl.arange(0, BLOCK_N // 4)                  # (key >> 4) * 4 + ((key & 7) >> 1)
    ctr = (offset + (bh.to(tl.int64) * ((S_Q + 15) // 16 * 8) + row_groups[:, None]) * ((S_KV + 15) // 16 * 4)
           + key_groups[None, :])                                                           # [M/2, N/4]
    w0, w1, w2, w3 = tl.randint4x(seed, ctr)
    # join appends its axis last: x[g, k, h, b, a] = half h of word 2a + b of row group g, key group k
    x = tl.join(tl.join(_halves(w0), _halves(w1)), tl.join(_halves(w2), _halves(w3)))
    # g = 8u + v, k = 4u' + q -> (u, a, v, u', b, q, h): row 16u + 8a + v, key 16u' + 8b + 2q + h
    x = tl.reshape(x, [BLOCK_M // 16, 8, BLOCK_N // 16, 4, 2, 2, 2])
    r = tl.reshape(tl.permute(x, (0, 6, 1, 2, 5, 3, 4)), [BLOCK_M, BLOCK_N])
    if not KEYS_LAST:
        r = tl.trans(r)
    return r.to(tl.int32) >= threshold


# FP8 (fusedattn.fp8): K-step after which sm_90's FP8 MMA hands its partial sums to the fp32 accumulator
# (tl.dot's max_num_imprecise_acc; 32 is one wgmma K-step for 8-bit inputs, so every step is promoted)
FP8_PROMOTE_K = tl.constexpr(32)
_ROUND_INT = tl.constexpr(12582912.0)     # 1.5 * 2^23: x + it - it rounds |x| < 2^22 to an integer, nearest even


@triton.jit
def fp8_dot(a, b, acc, MMA16: tl.constexpr):
    """``a @ b`` (plus ``acc`` when given) of float8 tiles, fp32 sums: FP8 MMAs with every K-step promoted
    (``FP8_PROMOTE_K``), or with MMA16 fp16 MMAs on the same values. Every e4m3 and e5m2 value is an fp16
    value (e4m3: 3 mantissa bits, 2^-9 .. 448; e5m2: 2 bits, 2^-16 .. 57344; fp16: 10 bits, 2^-24 .. 65504),
    so the conversion is exact and each product is the FP8 product; only the MMA rate and the accumulation
    differ (a 16-bit wgmma adds in fp32, tighter than the FP8 MMA's unit that the bound assumes)."""
    if MMA16:
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    else:
        return tl.dot(a, b, acc, max_num_imprecise_acc=FP8_PROMOTE_K)


@triton.jit
def round_to_fp8_grid(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 ``x`` (any shape) rounded to the nearest value of an FP8 grid, ties to even, in fp32
    arithmetic: ``MANT_BITS`` stored mantissa bits, ``MIN_EXP`` the smallest normal exponent (its
    spacing holds down to 0, the subnormals). No saturation here (``to_fp8`` clamps first).

    Why: the interpreter's fp32 -> float8 cast (``_convert_float``, Triton 3.6 and 3.9 alike) rounds
    ties away from zero (e4m3 1.0625 -> 1.125), drops the carry when rounding overflows the mantissa
    (e5m2 1.96 -> 1.0, e4m3 -0.486 -> -0.25) and does not saturate (e4m3 1000 -> 256, 1e6 -> NaN);
    casts of values already on the grid are exact (triton-lang/triton issue 8322; the open PR 11897
    fixes it). So under the interpreter ``to_fp8`` rounds here first. On sm_90 the cast is one
    ``cvt.rn.satfinite.e4m3x2.f32`` / ``e5m2x2.f32`` (checked in the PTX of Triton 3.6 and 3.9).
    The spacing at |x| is 2^(e - MANT_BITS) with e = max(exponent of |x|, MIN_EXP), read from the fp32
    bits; |x| / spacing < 2^(MANT_BITS + 1) rounds exactly by the 1.5 * 2^23 addition.
    """
    ax = tl.abs(x)
    e = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    spacing = ((e - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
    r = ((ax / spacing + _ROUND_INT) - _ROUND_INT) * spacing
    return tl.where(x < 0, -r, r)


@triton.jit
def to_fp8(x, FP8_TY: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``x`` (any shape) as ``FP8_TY`` (tl.float8e4nv or tl.float8e5): nearest even, saturating at
    the largest finite value (+-448 / +-57344, the ``cvt.rn.satfinite`` of cuDNN's graph and
    ``fusedattn.fp8.quantize``). The clamp is explicit so the result does not depend on how a Triton
    version's cast treats overflow. INTERP: round in fp32 first (``round_to_fp8_grid``), then cast."""
    if FP8_TY == tl.float8e5:
        x = tl.minimum(tl.maximum(x, -57344.0), 57344.0)
        if INTERP:
            x = round_to_fp8_grid(x, 2, -14)
    else:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        if INTERP:
            x = round_to_fp8_grid(x, 3, -6)
    return x.to(FP8_TY)


@triton.jit
def to_out(x, OUT_TY: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``x`` as an FP8 kernel's output type OUT_TY: float8 through ``to_fp8`` (saturating); bf16 nearest
    even; fp16 / fp32 by the plain cast. INTERP: Triton's interpreter (3.6) casts fp32 to bf16 by truncation
    (66.466 -> 66.0, not 66.5), so there the fp32 bits are rounded to bf16's first (add 0x7FFF plus the
    kept last bit, clear the low half; finite normal values: its cast also mishandles fp32 subnormals), which
    the cast then keeps exactly. On the GPU the cast is ``cvt.rn.bf16.f32``."""
    if OUT_TY.is_fp8():
        return to_fp8(x, OUT_TY, INTERP)
    if INTERP and OUT_TY == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(OUT_TY)
