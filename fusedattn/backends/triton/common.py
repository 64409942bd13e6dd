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

LOG2E: tl.constexpr = 1.4426950408889634
LN2: tl.constexpr = 0.6931471805599453


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
def q_block_range(start_n, len_q, len_kv, diag, win_left, win_right, num_q_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks that key columns [start_n, start_n + BLOCK_N) are seen by (the band transposed).

    Returns (lo, hi) in units of rows, lo a multiple of BLOCK_M: rows in
    [lo, hi) may keep one of the keys. Key j is kept by row i iff
    j - diag - right <= i <= j - diag + left.
    """
    last = tl.minimum(start_n + BLOCK_N, len_kv) - 1
    lo = start_n * 0
    hi = len_q
    if HAS_RIGHT:
        lo = tl.maximum(start_n - diag - win_right, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(last - diag + win_left + 1, len_q)
    hi = tl.where(start_n >= len_kv, lo, tl.maximum(hi, lo))
    return lo, hi


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
def load_bias(BIAS, offs_m, offs_n, stride_bm, stride_bn, S_Q, S_KV, BIAS_KIND: tl.constexpr):
    """The bias tile in natural units, fp32: float bias as is, bool mask as 0 / -inf."""
    ptrs = BIAS + offs_m[:, None] * stride_bm + offs_n[None, :] * stride_bn
    inside = (offs_m < S_Q)[:, None] & (offs_n < S_KV)[None, :]
    if BIAS_KIND == 2:
        keep = tl.load(ptrs, mask=inside, other=1)
        return tl.where(keep != 0, 0.0, float("-inf"))
    else:
        return tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def scores_base2(qk, bias, slope, offs_m, offs_n, len_kv, diag, win_left, win_right, qk_scale, softcap,
                 MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 SOFTCAP: tl.constexpr, BIAS_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Attention logits of one tile in base 2, -inf where masked.

    Order (the reference's too): softcap(scale * q.k) + bias + ALiBi, then the band and
    length mask. ``qk_scale`` is ``scale * log2(e)``, or ``scale / softcap`` with SOFTCAP.
    ALiBi adds ``slope * (j - i)`` (cuDNN's sign); ``slope`` arrives in base 2.
    """
    if SOFTCAP:
        x = qk * qk_scale
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no libdevice needed
        t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
        s = t * (softcap * LOG2E)
    else:
        s = qk * qk_scale
    if BIAS_KIND != 0:
        s += bias * LOG2E
    if HAS_ALIBI:
        s += slope * (offs_n[None, :] - offs_m[:, None]).to(tl.float32)
    if MASKED:
        keep = (offs_n < len_kv)[None, :]
        if HAS_LEFT:
            keep = keep & (offs_n[None, :] >= offs_m[:, None] + (diag - win_left))
        if HAS_RIGHT:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + (diag + win_right))
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def dropout_keep(seed, offset, bh, offs_m, offs_n, S_Q, S_KV, threshold):
    """Which probabilities survive dropout: a pure function of (seed, offset, b*h_q+head, row, col).

    Philox (tl.randint) at the 64-bit counter ``offset + (bh * S_Q + row) * S_KV + col``;
    keep iff the top 31 bits >= threshold = p * 2^31. Independent of tile sizes, so the
    backward regenerates the forward's mask; ``backends.cpu.dropout_keep_mask`` mirrors it.
    """
    rows = (bh.to(tl.int64) * S_Q + offs_m) * S_KV
    counter = offset + rows[:, None] + offs_n[None, :]
    r = tl.randint(seed, counter)
    return (r >> 1).to(tl.int32) >= threshold
