"""Decode: a few new query tokens against a (paged) K/V cache, split along the keys (flash-decoding).

Notation: b, h_q, h_kv, g = h_q // h_kv, s_q (new tokens per sequence), d, d_v. Batch entry
``bi`` holds ``len_kv`` keys in its cache (``seq_len_kv``, the new tokens included), at most
CAP (``s_max`` of a contiguous cache, ``max_pages * PAGE_SIZE`` of a paged one).

GQA packing: the g query heads of one kv head and the s_q tokens share K/V, so they share a
tile. Packed row ``r`` of kv head ``kvh`` is token ``r // g`` of query head ``kvh * g + r % g``
(token-major, so one tile covers a contiguous run of tokens and its band is narrow). One
program owns BLOCK_M packed rows of one (batch, kv head) and reads each K/V tile once for all
of them; the M dimension of the dots is ``g * s_q`` (padded to 16 at least), not s_q.

Split-KV: program (bkv, split, m) visits the ``split``-th of NUM_SPLITS equal runs of whole
key blocks of its row range (per batch entry, so ragged lengths balance too). With one split
it normalizes and writes ``out`` / ``lse`` itself. With more, each writes a partial
``(o / l, log2-sum-exp)`` in fp32 to a workspace and ``_decode_combine`` merges them:
``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``, ``lse = M + log2(sum)``.

Masking is the package's band: token t keeps key j iff ``t + diag - left <= j <= t + diag + right``
and ``j < len_kv``, with ``diag = len_kv - len_q`` (bottom-right: the new tokens are the last of
each sequence; what attention_with_kvcache always asks) or 0 (top-left, for the problem door).
``len_q`` is s_q, or seq_len_q when the problem door has padded queries (rows past it give 0).
Key blocks wholly inside the band run with no mask arithmetic (MASKED=False); only the edges
are masked.

Paged caches: container ``[num_pages, h_kv, PAGE_SIZE, d]`` (any strides) and a page table
row per sequence; key j lives at page ``table[bi, j // PAGE_SIZE]``, slot ``j % PAGE_SIZE``.
The kernel's key tile (BLOCK_N) is independent of PAGE_SIZE: each key row is gathered.

Never out of bounds, validated or not: ``len_kv`` is clamped to [0, CAP], page-table columns
to [0, MAX_PAGES), page numbers to [0, NUM_PAGES) for reads; the append kernel skips a write
whose position or page is out of range rather than clamping it onto someone else's page.

[Note] empty rows: a row with no key (len_kv < s_q under causal, a window, len_kv = 0) has
m = -inf, l = 0: it writes output 0 and lse -inf (partials too: o 0, lse -inf), never NaN. In the
combine an empty split weighs 2^(-inf - M) = 0; a row whose every split is empty (M = -inf) has
den = 0 and writes output 0, lse -inf::

    split:        0            1            2
    row r:   (o0, lse0)   (0, -inf)    (o2, lse2)   ->  out = (2^lse0 o0 + 2^lse2 o2) / (2^lse0 + 2^lse2)
    row e:   (0, -inf)    (0, -inf)    (0, -inf)    ->  out = 0, lse = -inf

[Note] sinks (HAS_SINK): the per-head sink logit joins split 0's partial only (``common.fold_sink``:
one more term 2^(sink - m) in its sum, no value row), so the combine, which merges partials by their
log-sum-exps, counts it exactly once; with one split it is the whole row's. A row whose keys all lie
in other splits still gets the sink from split 0's partial (o 0, lse = sink).
"""
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .args import LOG2E_PY, block_dim, slope_batch_stride
from .common import LN2, fold_sink, load_tile, scores_base2
from ...plan import interpreting
from .launch import Launcher, cdiv, jit_launch, pow2, signature_key


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _page_entries(PT_ROW, stride_pn, cols, len_kv, num_pages, PAGE_SIZE: tl.constexpr):
    """The cache page of each key ``cols`` [BLOCK_N] (int32, clamped into the container); keys past len_kv read
    table slot 0, so a tile past the end (the loop's look-ahead) reads inside the table row."""
    page = tl.load(PT_ROW + tl.where(cols < len_kv, cols // PAGE_SIZE, 0) * stride_pn)
    return tl.minimum(tl.maximum(page, 0), num_pages - 1)


@triton.jit
def _page_rows(pages, cols, stride_b, stride_n, PAGE_SIZE: tl.constexpr, ROWS32: tl.constexpr):
    """Element offsets of keys ``cols`` on their ``pages`` (``_page_entries``): int32 where every offset of the
    container fits (ROWS32, ``_offsets_fit_int32``: a paged bf16 step 938 -> 426 SASS instructions, FP8 549 ->
    462; sm_90a, Triton 3.6), else int64."""
    if ROWS32:
        rows = pages * stride_b + (cols % PAGE_SIZE) * stride_n
    else:
        rows = pages.to(tl.int64) * stride_b + (cols % PAGE_SIZE).to(tl.int64) * stride_n
    return rows


@triton.jit
def _cache_rows(b_off, cols, stride_n, ROWS32: tl.constexpr):
    """Element offsets of keys ``cols`` of a contiguous cache (``b_off``: the batch's), int32 under ROWS32."""
    if ROWS32:
        rows = b_off + cols * stride_n
    else:
        rows = b_off + cols.to(tl.int64) * stride_n
    return rows


@triton.jit
def _widen_pairs(v16, V_PAIRS: tl.constexpr):
    """An FP8 tile read as int16 pairs [N, C] (element c of row n holds FP8 columns 2c and 2c + 1, low byte
    first) widened to two fp16 tiles [N, C]: the even columns and the odd ones. Exact (every e4m3 / e5m2
    value is an fp16 one). V_PAIRS (``v_pairs_code``): 1 e4m3, 2 e5m2 in inline PTX; 3 / 4 the same in
    Triton's own conversions (the interpreter, which runs no PTX: 1.4x the PTX's SASS on a GPU).

    Why ([Note] FP8 V as pairs): P V's B operand holds two consecutive keys of one column per register, and
    a byte tile has no transposing ldmatrix, so read as bytes V's operand costs one shared-memory load per
    byte (128 LDS.U8 a 128-key step). As int16 the tile is 16-bit: ldmatrix.trans gives each thread two keys
    of one pair column in one register, and one byte permute plus two conversions make the even and odd
    columns' operands. Elementwise in any layout: with pack=2 an operand register holds elements i, i + 1."""
    if V_PAIRS >= 3:
        fmt: tl.constexpr = tl.float8e4nv if V_PAIRS == 3 else tl.float8e5
        lo = (v16 & 0xFF).to(tl.uint8).to(fmt, bitcast=True).to(tl.float16)
        hi = ((v16 >> 8) & 0xFF).to(tl.uint8).to(fmt, bitcast=True).to(tl.float16)
        return lo, hi
    elif V_PAIRS == 1:
        return tl.inline_asm_elementwise(
            """{ .reg .b32 t; .reg .b16 lo, hi;
            prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t;
            cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }""",
            "=r,=r,r", [v16], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(
            """{ .reg .b32 t; .reg .b16 lo, hi;
            prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t;
            cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }""",
            "=r,=r,r", [v16], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _decode_blocks(acc, acc_odd, m_i, l_i, q, K_HEAD, V_HEAD, PT_ROW, stride_pn, PTV_ROW, stride_pvn,
                   slope, tok, offs_n, offs_d, offs_dv, start, end, len_kv, num_pages, diag,
                   stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, kb_off, vb_off,
                   D, D_V, qk_scale, softcap, win_left, win_right,
                   MASKED: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   V_PAIRS: tl.constexpr, ONE_TABLE: tl.constexpr, ROWS32: tl.constexpr):
    """Online-softmax update of the packed rows over key blocks [start, end). V_PAIRS: V_HEAD points at
    int16 pairs of FP8 bytes (its strides in pairs, column stride 1) and ``offs_dv`` at pair columns;
    ``acc`` then holds O's even columns and ``acc_odd`` its odd ones (unused otherwise). ONE_TABLE: V's pages
    are K's (one page table), so V's entries are not read again.

    [Note] paged look-ahead: a paged cache's page entries for tile j + 1 are read during tile j and carried.
    Read in the same iteration as the K / V rows they address, Triton's pipeliner gives the table load a stage
    of its own and K / V one shared-memory buffer whatever num_stages says (TTGIR, 64-key FP8 tile, 3 stages:
    23 KB against 39 KB contiguous; Triton 3.6 and 3.9); from a carried value they keep the contiguous cache's
    buffers, and the table loads leave the step's shared memory (sm_90a, Triton 3.6: 567 -> 544 instructions
    at 64 keys). H200, b64 h32/8 kv4k e4m3 pages of 16: 0.71 -> 0.85 of copy (bench/NOTES.md 76)."""
    if PAGED:
        k_pages = _page_entries(PT_ROW, stride_pn, start + offs_n, len_kv, num_pages, PAGE_SIZE)
        v_pages = k_pages
        if not ONE_TABLE:
            v_pages = _page_entries(PTV_ROW, stride_pvn, start + offs_n, len_kv, num_pages, PAGE_SIZE)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if PAGED:
            k_rows = _page_rows(k_pages, cols, stride_kb, stride_kn, PAGE_SIZE, ROWS32)
            v_rows = _page_rows(v_pages, cols, stride_vb, stride_vn, PAGE_SIZE, ROWS32)
            k_pages = _page_entries(PT_ROW, stride_pn, cols + BLOCK_N, len_kv, num_pages, PAGE_SIZE)
            v_pages = k_pages
            if not ONE_TABLE:
                v_pages = _page_entries(PTV_ROW, stride_pvn, cols + BLOCK_N, len_kv, num_pages, PAGE_SIZE)
        else:
            k_rows = _cache_rows(kb_off, cols, stride_kn, ROWS32)
        k = load_tile(K_HEAD + k_rows[:, None] + offs_d[None, :] * stride_kd, cols, offs_d, len_kv, D,
                      MASKED, not EVEN_D)
        # an FP8 cache's bytes widen exactly to q's 16-bit type (e4m3 and e5m2 fit fp16 and bf16); its
        # descale is in qk_scale (K) and in the output's scale (V). A no-op for a 16-bit cache.
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        s = scores_base2(qk, 0.0, slope, tok[:, None], cols[None, :], len_kv, len_kv, diag, win_left, win_right,
                         qk_scale, softcap, MASKED, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, 0, HAS_ALIBI)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not PAGED:
            v_rows = _cache_rows(vb_off, cols, stride_vn, ROWS32)
        if V_PAIRS:
            # offs_dv: pair columns here (BLOCK_DV // 2 of them, from the caller)
            v16 = load_tile(V_HEAD + v_rows[:, None] + offs_dv[None, :], cols, offs_dv, len_kv, D_V // 2,
                            MASKED, not EVEN_DV)
            v_even, v_odd = _widen_pairs(v16, V_PAIRS)
            p16 = p.to(tl.float16)
            acc = tl.dot(p16, v_even, acc * alpha[:, None])
            acc_odd = tl.dot(p16, v_odd, acc_odd * alpha[:, None])
        else:
            v = load_tile(V_HEAD + v_rows[:, None] + offs_dv[None, :] * stride_vd, cols, offs_dv, len_kv, D_V,
                          MASKED, not EVEN_DV)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, acc_odd, m_i, l_i


@triton.jit
def _fp16_rows(q):
    """bf16 rows q [M, D] as fp16 ``q * 2^k_i`` with one power of two per row putting its largest |q| in
    [2^14, 2^15), and ``2^-k_i`` [M] fp32. Exact: a bf16 value (8 significant bits) keeps every bit in fp16
    unless it is below the row's largest by more than 2^28 (fp16's normal range), where it loses at most
    2^-39 of that largest; the exponents come from the bit pattern (no approximate log2 / exp2). Rows of
    zeros keep zeros; inf / NaN stay inf / NaN (an exponent of 255 clamps to 254)."""
    qf = q.to(tl.float32)
    e = (tl.max(tl.abs(qf), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, 15), 254)
    scale = ((268 - e) << 23).to(tl.float32, bitcast=True)          # 2^(141 - e): max |q| * scale < 2^15
    inv = ((e - 14) << 23).to(tl.float32, bitcast=True)             # 2^(e - 141)
    return (qf * scale[:, None]).to(tl.float16), inv


@triton.jit
def _decode_fwd(Q, K, V, PT, PT_V, SEQ_Q, SEQ_KV, SLOPES, O, LSE, O_PART, LSE_PART, SINK, DESCALE_K, DESCALE_V,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_pb, stride_pn, stride_pvb, stride_pvn,
                stride_ob, stride_oh, stride_om, stride_od,
                stride_lb, stride_lh, stride_lm, stride_sb, stride_dsk, stride_dsv,
                B, H_KV, G, S_Q, D, D_V, CAP, NUM_PAGES, NUM_SPLITS,
                qk_scale, softcap, win_left, win_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                HAS_SEQ_Q: tl.constexpr, HAS_SEQ_KV: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
                DOT_PRECISION: tl.constexpr, HAS_SINK: tl.constexpr = False, KV_FP8: tl.constexpr = False,
                V_PAIRS: tl.constexpr = 0, ONE_TABLE: tl.constexpr = False, ROWS32: tl.constexpr = False):
    bkv = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    batch = bkv // H_KV
    kv_head = bkv % H_KV
    len_kv = CAP + batch * 0
    if HAS_SEQ_KV:
        len_kv = tl.minimum(tl.maximum(tl.load(SEQ_KV + batch), 0), CAP)
    len_q = S_Q + batch * 0
    if HAS_SEQ_Q:                                        # the problem door's padded queries (kvcache: never)
        len_q = tl.minimum(tl.maximum(tl.load(SEQ_Q + batch), 0), S_Q)
    diag = len_q * 0
    if BOTTOM_RIGHT:
        diag = len_kv - len_q                            # the new tokens are the last ones

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)       # packed rows: token-major, heads of the group inside
    n_rows = G * S_Q
    row_ok = rows < n_rows
    tok = rows // G
    head = kv_head * G + rows % G
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    b64 = batch.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + head.to(tl.int64)[:, None] * stride_qh + tok[:, None] * stride_qm \
        + offs_d[None, :] * stride_qd
    q = load_tile(q_ptrs, rows, offs_d, n_rows, D, True, not EVEN_D)
    slope = 0.0
    if HAS_ALIBI:
        # [b, h_q] slopes; batch stride 0 for per-head ones
        slope = (tl.load(SLOPES + b64 * stride_sb + head, mask=row_ok, other=0.0) * 1.4426950408889634)[:, None]

    # keys any row of this tile may keep, and the whole blocks every row keeps entirely
    t_lo = (pid_m * BLOCK_M) // G
    t_hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, len_q - 1)
    lo = len_kv * 0
    hi = len_kv
    full_lo = lo
    full_hi = len_kv // BLOCK_N * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(t_lo + diag - win_left, 0)
        full_lo = tl.cdiv(tl.maximum(t_hi + diag - win_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(t_hi + diag + win_right + 1, len_kv)
        full_hi = tl.minimum(full_hi, tl.maximum(t_lo + diag + win_right + 1, 0) // BLOCK_N * BLOCK_N)
    lo = lo // BLOCK_N * BLOCK_N
    hi = tl.where(t_lo > t_hi, lo, tl.maximum(hi, lo))   # a tile of rows past len_q visits nothing
    # this split's run of whole blocks: [s_lo, s_hi)
    chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.maximum(tl.minimum(s_lo + chunk, hi), s_lo)
    f_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    f_hi = tl.minimum(tl.maximum(full_hi, f_lo), s_hi)

    K_HEAD = K + kv_head.to(tl.int64) * stride_kh
    V_HEAD = V + kv_head.to(tl.int64) * stride_vh
    # contiguous caches: the batch term (unused when paged), int32 where the cache's offsets fit (ROWS32)
    kb_off = batch * stride_kb if ROWS32 else b64 * stride_kb
    vb_off = batch * stride_vb if ROWS32 else b64 * stride_vb
    PT_ROW = PT + b64 * stride_pb
    PTV_ROW = PT_V + b64 * stride_pvb

    # [Note] FP8 caches (KV_FP8): K = k8 * descale_k and V = v8 * descale_v per kv head (stride 0: one
    # per tensor); descale_k joins the scores' scale, descale_v the output's, so the tiles stay bytes
    qk_scale_h = qk_scale
    descale_v = 1.0
    if KV_FP8:
        qk_scale_h = qk_scale * tl.load(DESCALE_K + kv_head * stride_dsk)
        descale_v = tl.load(DESCALE_V + kv_head * stride_dsv)
        if q.dtype == tl.bfloat16:
            # both products on fp16 operands: e4m3 / e5m2 -> fp16 is one instruction per pair, -> bf16 goes
            # through fp32 (sm_90 SASS of the unmasked step, Triton 3.6: 1344 instructions against 953 for
            # fp16 queries, 256 of them F2F: bench/NOTES.md 67). q's rows move exactly into fp16 by a power of
            # two each (_fp16_rows); the row's inverse joins the scores' scale, and P rounds to fp16
            q, row_inv = _fp16_rows(q)
            qk_scale_h = qk_scale_h * row_inv[:, None]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if V_PAIRS:
        # [Note] FP8 V as pairs (_widen_pairs): O's even and odd columns, interleaved after the last tile
        v_cols = tl.arange(0, BLOCK_DV // 2)
        acc = tl.zeros([BLOCK_M, BLOCK_DV // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_M, BLOCK_DV // 2], tl.float32)
    else:
        v_cols = offs_dv
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        acc_odd = 0.0
    acc, acc_odd, m_i, l_i = _decode_blocks(
        acc, acc_odd, m_i, l_i, q, K_HEAD, V_HEAD, PT_ROW, stride_pn, PTV_ROW, stride_pvn, slope, tok, offs_n, offs_d,
        v_cols,
        s_lo, f_lo, len_kv, NUM_PAGES, diag, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
        kb_off, vb_off, D, D_V, qk_scale_h, softcap, win_left, win_right,
        True, BLOCK_N, PAGED, PAGE_SIZE, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DOT_PRECISION,
        V_PAIRS, ONE_TABLE, ROWS32)
    acc, acc_odd, m_i, l_i = _decode_blocks(
        acc, acc_odd, m_i, l_i, q, K_HEAD, V_HEAD, PT_ROW, stride_pn, PTV_ROW, stride_pvn, slope, tok, offs_n, offs_d,
        v_cols,
        f_lo, f_hi, len_kv, NUM_PAGES, diag, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
        kb_off, vb_off, D, D_V, qk_scale_h, softcap, win_left, win_right,
        False, BLOCK_N, PAGED, PAGE_SIZE, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DOT_PRECISION,
        V_PAIRS, ONE_TABLE, ROWS32)
    acc, acc_odd, m_i, l_i = _decode_blocks(
        acc, acc_odd, m_i, l_i, q, K_HEAD, V_HEAD, PT_ROW, stride_pn, PTV_ROW, stride_pvn, slope, tok, offs_n, offs_d,
        v_cols,
        f_hi, s_hi, len_kv, NUM_PAGES, diag, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
        kb_off, vb_off, D, D_V, qk_scale_h, softcap, win_left, win_right,
        True, BLOCK_N, PAGED, PAGE_SIZE, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DOT_PRECISION,
        V_PAIRS, ONE_TABLE, ROWS32)

    if V_PAIRS:
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, BLOCK_DV])     # column 2c: even c, 2c + 1: odd c
    if HAS_SINK:
        # split 0 only: the combine then counts the sink once (ALiBi here is unshifted, no frame change)
        first = (rows * 0 + split) == 0
        sink2 = tl.load(SINK + head, mask=row_ok & first, other=float("-inf")) * 1.4426950408889634
        acc, m_i, l_i = fold_sink(acc, m_i, l_i, sink2)
    nonempty = l_i != 0.0     # a NaN sum (a NaN or inf score) is not empty: NaN out, as softmax
    if HAS_SEQ_Q:
        nonempty = nonempty & (tok < len_q)
    out = acc * tl.where(nonempty, descale_v / tl.where(nonempty, l_i, 1.0), 0.0)[:, None]
    dv_ok = offs_dv < D_V
    if SPLIT:
        # partial for the combine: (o / l, log2-sum-exp), -inf for a split that saw no key
        prow = ((split.to(tl.int64) * B + batch) * (H_KV * G) + head) * S_Q + tok
        tl.store(O_PART + prow[:, None] * D_V + offs_dv[None, :], out, mask=row_ok[:, None] & dv_ok[None, :])
        lse2 = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(LSE_PART + prow, lse2, mask=row_ok)
    else:
        o_ptrs = O + b64 * stride_ob + head.to(tl.int64)[:, None] * stride_oh + tok[:, None] * stride_om \
            + offs_dv[None, :] * stride_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
        if WRITE_LSE:
            lse = tl.where(nonempty, (m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * LN2, float("-inf"))
            tl.store(LSE + b64 * stride_lb + head.to(tl.int64) * stride_lh + tok * stride_lm, lse, mask=row_ok)


@triton.jit
def _decode_combine(O_PART, LSE_PART, O, LSE,
                    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
                    ROWS, H_Q, S_Q, D_V, NUM_SPLITS,
                    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Merge the splits' partials of BLOCK_R (batch, query head, token) rows; empty rows give 0 / -inf.

    Partial row ``r`` of split ``s`` sits at ``s * ROWS + r`` (r = (batch * H_Q + head) * S_Q + token).
    Two passes over the splits: the max of their log2-sum-exps, then the weighted sum.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < ROWS
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, NUM_SPLITS):
        m = tl.maximum(m, tl.load(LSE_PART + s * ROWS + rows, mask=r_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for s in range(0, NUM_SPLITS):
        prow = s * ROWS + rows
        w = tl.math.exp2(tl.load(LSE_PART + prow, mask=r_ok, other=float("-inf")) - m_safe)   # 0: empty split
        o = tl.load(O_PART + prow.to(tl.int64)[:, None] * D_V + offs_dv[None, :],
                    mask=r_ok[:, None] & dv_ok[None, :], other=0.0)
        den += w
        acc += w[:, None] * o
    nonempty = den != 0.0     # as above: a NaN partial stays NaN
    out = acc * tl.where(nonempty, 1.0 / tl.where(nonempty, den, 1.0), 0.0)[:, None]
    batch = (rows // (H_Q * S_Q)).to(tl.int64)
    head = ((rows // S_Q) % H_Q).to(tl.int64)
    tok = rows % S_Q
    tl.store(O + (batch * stride_ob + head * stride_oh + tok * stride_om)[:, None] + offs_dv[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=r_ok[:, None] & dv_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(nonempty, (m_safe + tl.math.log2(tl.where(nonempty, den, 1.0))) * LN2, float("-inf"))
        tl.store(LSE + batch * stride_lb + head * stride_lh + tok * stride_lm, lse, mask=r_ok)


@triton.jit
def _append_kv(KN, VN, K, V, PT, SEQ_KV, SEQ_Q, CU_Q,
               stride_knb, stride_knh, stride_knm, stride_knd,
               stride_vnb, stride_vnh, stride_vnm, stride_vnd,
               stride_kb, stride_kh, stride_kn, stride_kd,
               stride_vb, stride_vh, stride_vn, stride_vd,
               stride_pb, stride_pn,
               H_KV, S_Q, D, D_V, CAP, NUM_PAGES,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
               HAS_SEQ_KV: tl.constexpr, HAS_SEQ_Q: tl.constexpr, VARLEN_Q: tl.constexpr):
    """Write token t of k_new/v_new at position len_kv - len_q + t of its cache; skip it if out of range.

    len_q is S_Q, or per sequence: SEQ_Q[batch] (padded new tokens: rows t >= len_q are padding, not
    written) or CU_Q[batch + 1] - CU_Q[batch] (VARLEN_Q: packed new tokens, token t of sequence
    ``batch`` is row CU_Q[batch] + t of k_new/v_new, seen as [1, h_kv, total, d])."""
    bkv = tl.program_id(0)
    tok = tl.program_id(1)
    batch = bkv // H_KV
    kv_head = bkv % H_KV
    b64 = batch.to(tl.int64)
    len_kv = CAP + batch * 0
    if HAS_SEQ_KV:
        len_kv = tl.load(SEQ_KV + batch)                 # raw: an invalid length writes nothing
    len_q = S_Q + batch * 0
    row = tok.to(tl.int64)
    kn_b = b64
    if HAS_SEQ_Q:
        len_q = tl.minimum(tl.load(SEQ_Q + batch), S_Q)
    if VARLEN_Q:
        q0 = tl.load(CU_Q + batch)
        len_q = tl.minimum(tl.load(CU_Q + batch + 1) - q0, S_Q)
        row = q0.to(tl.int64) + tok
        kn_b = b64 * 0
    pos = len_kv - len_q + tok
    ok = (pos >= 0) & (pos < CAP) & (tok < len_q)
    pos = tl.where(ok, pos, 0)
    if PAGED:
        page = tl.load(PT + b64 * stride_pb + (pos // PAGE_SIZE) * stride_pn)
        ok = ok & (page >= 0) & (page < NUM_PAGES)
        page = tl.where(ok, page, 0).to(tl.int64)
        k_row = page * stride_kb + (pos % PAGE_SIZE) * stride_kn
        v_row = page * stride_vb + (pos % PAGE_SIZE) * stride_vn
    else:
        k_row = b64 * stride_kb + pos.to(tl.int64) * stride_kn
        v_row = b64 * stride_vb + pos.to(tl.int64) * stride_vn
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    h64 = kv_head.to(tl.int64)
    # A skipped token writes no column: its column bound is 0. The store masks are tensor
    # comparisons, not ``(offs_d < D) & ok``: Triton's interpreter broadcasts a scalar comparison
    # (``ok``) as int32 data, and since 3.9 it rejects a mask that is not boolean (same code on GPU).
    d_end = tl.where(ok, D, 0)
    dv_end = tl.where(ok, D_V, 0)
    kn = tl.load(KN + kn_b * stride_knb + h64 * stride_knh + row * stride_knm + offs_d * stride_knd,
                 mask=offs_d < d_end)
    tl.store(K + k_row + h64 * stride_kh + offs_d * stride_kd, kn, mask=offs_d < d_end)
    vn = tl.load(VN + kn_b * stride_vnb + h64 * stride_vnh + row * stride_vnm + offs_dv * stride_vnd,
                 mask=offs_dv < dv_end)
    tl.store(V + v_row + h64 * stride_vh + offs_dv * stride_vd, vn, mask=offs_dv < dv_end)


# Bits of the validation kernel's per-batch code
BAD_NEGATIVE, BAD_OVER_CAP, BAD_NO_ROOM, BAD_PAGE, BAD_SEQ_Q = 1, 2, 4, 8, 16


@triton.jit
def _validate_kv(SEQ_KV, PT, SEQ_Q, CODES, stride_pb, stride_pn, S_Q, CAP, NUM_PAGES,
                 NEED_ROOM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
                 HAS_SEQ_Q: tl.constexpr):
    """Per batch entry, a bit set of what is wrong with its length, its new-token count (SEQ_Q: in
    [0, S_Q]) and the page-table slots it uses."""
    batch = tl.program_id(0)
    n = tl.load(SEQ_KV + batch)
    code = tl.where(n < 0, 1, 0) | tl.where(n > CAP, 2, 0)
    need = S_Q + batch * 0
    if HAS_SEQ_Q:
        need = tl.load(SEQ_Q + batch)
        code = code | tl.where((need < 0) | (need > S_Q), 16, 0)
    if NEED_ROOM:
        code = code | tl.where(n < need, 4, 0)
    if PAGED:
        used = tl.cdiv(tl.minimum(tl.maximum(n, 0), CAP), PAGE_SIZE)
        bad = n * 0
        for p0 in range(0, used, BLOCK_P):
            slots = p0 + tl.arange(0, BLOCK_P)
            page = tl.load(PT + batch.to(tl.int64) * stride_pb + slots * stride_pn, mask=slots < used, other=0)
            bad = bad | tl.max(((page < 0) | (page >= NUM_PAGES)).to(tl.int32), 0)
        code = code | tl.where(bad != 0, 8, 0)
    tl.store(CODES + batch, code)


# ----------------------------------------------------------------------------- tiles and splits

@dataclass(frozen=True)
class DecodeTiles:
    block_m: int      # packed rows (g * s_q, padded) per program
    block_n: int      # keys per tile (independent of the page size)
    num_warps: int
    num_stages: int
    max_regs: int = 0  # ptxas's register cap per thread (Triton's ``maxnreg``), 0: the compiler's choice
    ctas_per_sm: int = 0  # programs resident per SM for the split heuristic (ptxas's registers and shared
    #                       memory, sm_90), 0: CTAS_PER_SM


H100_SMS = 132
# Programs resident per SM assumed by the split heuristic: a 16 x 64 tile at d 128 with 3 stages uses
# about 100 KB of shared memory, so two fit in the H100's 228 KB (untuned; measure with the bench).
CTAS_PER_SM = 2
MAX_SPLITS = 64


def decode_tiles(rows: int, d: int, dtype: torch.dtype, interpret: bool, kv_fp8: bool = False) -> DecodeTiles:
    """Tiles for ``rows = g * s_q`` packed query rows at head dim ``d`` (max of d, d_v).

    Decode is memory-bound: the tile is as short in M as tl.dot allows (16) and long enough in N
    to keep bytes in flight. Starting points for sm90, not yet measured: the comments give the
    registers / shared memory ptxas reports for them (Triton 3.6, paged, no spills), which is
    what ruled out the others (64-key tiles with 4 warps at BLOCK_M 64: 242 registers; fp32
    32-key tiles: spills).
    """
    p2 = pow2(max(rows, 1))
    if interpret:
        # the interpreter pays ~10 ms per tile step: 32-key tiles keep CI quick and still give
        # short test caches several blocks (masked edges, whole blocks, splits)
        return DecodeTiles(max(16, min(p2, 32)), 32, 4, 1)
    if rows <= 64:
        bm = max(16, p2)
        if dtype == torch.float32:
            return DecodeTiles(bm, 16, 8, 2)                     # 64-210 regs, 26-54 KB
        if d > 128:
            return DecodeTiles(bm, 32, 8, 2)                     # 127-184 regs, 42-98 KB
        if bm == 16 and kv_fp8:
            # FP8 caches carry half the bytes per key: FP8_TILE (bench/NOTES.md 74)
            return FP8_TILE
        if bm == 16:
            # H100 sweep (bench/decode_sweep.py): 128-key tiles, 4 warps, 2 stages read K/V at
            # 2.80-3.02 TB/s contiguous and 2.87-2.98 TB/s paged (16/64), vs 2.33-2.34 paged with
            # the 64-key / 3-stage tile, against a 3.00 TB/s device copy
            return DecodeTiles(16, 128, 4, 2)
        return DecodeTiles(bm, 64, 8, 3)                        # 128 / 142 regs, 39-83 KB (not measured)
    # prefill against a cache: a forward-like tile
    if dtype == torch.float32:
        return DecodeTiles(64, 16, 8, 2)                         # 210 regs
    if d > 128:
        return DecodeTiles(64, 32, 8, 2)                         # 184 regs, 98 KB
    return DecodeTiles(128, 64, 8, 3)                            # 186 regs, 98 KB


# An FP8 cache's decode tiles (16 rows; bench/NOTES.md 74 and 76, H200 sweeps with V read as pairs). 64-key tiles
# at four programs per SM (b64 h_kv 8 kv4k: 0.91 of copy contiguous, 0.85 paged, against 0.68-0.82 for 128 keys);
# where a contiguous cache's programs do not fill the machine (long caches over few heads), 128-key tiles at two
# per SM (kv16k: 0.98-1.01 against 0.79-0.88). A paged cache keeps the 64-key tile there too, split by the
# heuristic (kv16k pages of 16 / 64: 0.90 / 0.91, against 0.86 / 0.87 for 256 keys, 0.86 / 0.92 for 128).
FP8_TILE = DecodeTiles(16, 64, 4, 3, ctas_per_sm=4)         # 128 registers, 39 KB (Triton 3.6, paged or not)
FP8_TILE_FEW = DecodeTiles(16, 128, 4, 3, ctas_per_sm=2)    # 180 registers, 72 KB (contiguous)

INTERPRETER_SMS = 4      # the interpreter runs programs one by one: a small "machine" means few splits


def num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


@functools.lru_cache(maxsize=1024)
def num_splits_heuristic(programs: int, n_blocks: int, sms: int = H100_SMS,
                         ctas_per_sm: int = CTAS_PER_SM, max_splits: int = MAX_SPLITS) -> int:
    """FlashAttention-2's split count (``num_splits_heuristic`` in ``csrc/flash_attn/flash_api.cpp``).

    ``programs`` = b * h_kv * m-tiles without splitting; ``n_blocks`` = key blocks of the
    longest sequence. If the programs nearly fill the machine (``ctas_per_sm`` per SM) or the
    cache has at most 4 blocks, one split. Else the fewest splits whose wave efficiency
    ``waves / ceil(waves)`` is within 85% of the best, skipping split counts that give the same blocks per split as one fewer.
    Remembered per argument tuple: a pure function of integers, and its loop over up to 64 candidate counts took
    4-12 us of every decode call's host time (2-core CPU, bench/NOTES.md 77).
    """
    slots = sms * ctas_per_sm
    if programs >= 0.8 * slots or n_blocks <= 4:      # FA3 adds: a short cache is never split
        return 1
    max_splits = max(1, min(max_splits, slots, n_blocks))
    eff = []
    for s in range(1, max_splits + 1):
        if s > 1 and math.ceil(n_blocks / s) == math.ceil(n_blocks / (s - 1)):
            eff.append(0.0)
            continue
        waves = programs * s / slots
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    for s, e in enumerate(eff, start=1):
        if e >= 0.85 * best:
            return s
    return 1


# ----------------------------------------------------------------------------- launchers

def _switches(dtype, d, d_v, band, softcap, has_alibi):
    has_left = band is not None and band.left is not None
    has_right = band is not None and band.right is not None
    return dict(
        EVEN_D=block_dim(d) == d, EVEN_DV=block_dim(d_v) == d_v,
        HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_ALIBI=has_alibi, SOFTCAP=softcap > 0.0,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    ), (band.left if has_left else 0), (band.right if has_right else 0)


def plan_decode(b, h_kv, g, s_q, d, d_v, dtype, cap, device, num_splits=None, kv_dtype=None, paged=False):
    """(tiles, splits) of one decode launch: the tile table, then the split heuristic unless forced.
    ``kv_dtype``: the cache's element type (an FP8 cache has its own tiles, by how many programs the call
    has: FP8_TILE / FP8_TILE_FEW), default ``dtype``; ``paged``: a paged cache."""
    kv_fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    tiles = decode_tiles(g * s_q, max(d, d_v), dtype, device.type != "cuda", kv_fp8)
    if tiles is FP8_TILE and not paged \
            and b * h_kv * cdiv(g * s_q, tiles.block_m) < 0.8 * tiles.ctas_per_sm * num_sms(device):
        tiles = FP8_TILE_FEW
    if num_splits is None:
        m_tiles = cdiv(g * s_q, tiles.block_m)
        num_splits = num_splits_heuristic(b * h_kv * m_tiles, cdiv(cap, tiles.block_n), num_sms(device),
                                          ctas_per_sm=tiles.ctas_per_sm or CTAS_PER_SM)
    return tiles, num_splits


def v_pairs_code(v_cache: torch.Tensor, d_v: int) -> int:
    """The kernel's V_PAIRS for an FP8 ``v_cache`` ([Note] FP8 V as pairs in ``_widen_pairs``): 1 / 2 (e4m3 /
    e5m2, PTX) on a GPU, 3 / 4 under the interpreter, 0 where V cannot be read as int16 pairs (an odd d_v, a
    column stride that is not 1, an odd stride or offset) or where half of V's tile is narrower than a dot
    (BLOCK_DV < 32). Sixteen-bit caches: 0."""
    fmt = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}.get(v_cache.dtype, 0)
    if not fmt or d_v % 2 or block_dim(d_v) < 32 or v_cache.stride(3) != 1 or v_cache.storage_offset() % 2 \
            or any(st % 2 for st in v_cache.stride()[:3]):
        return 0
    return fmt + 2 if interpreting() else fmt


def _rows32(k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool, kv_fp8: bool) -> bool:
    """The kernel's ROWS32: int32 key-row offsets where every offset of both caches fits, except a paged 16-bit
    cache. H200, Triton 3.6, under CUDA graphs (bench/NOTES.md 76), TB/s int32 / int64: e4m3 b64 h32/8 kv4k
    contiguous 4.08 / 3.97, pages of 16 3.74 / 3.46; bf16 contiguous 4.40 / 3.98, but bf16 pages of 16 3.83 /
    4.13: int32 rows take that 128-key, 2-stage build from 238 to 156 registers, so three programs fit an SM
    instead of two, and b64 h_kv 8's 512 programs run 1.29 waves instead of 1.94 (a wave effect)."""
    return (kv_fp8 or not paged) and _offsets_fit_int32(k_cache) and _offsets_fit_int32(v_cache)


def _offsets_fit_int32(t: torch.Tensor) -> bool:
    """Whether every element offset of a K / V container from its head's first element fits int32."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) < 2 ** 31


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors read the same elements (one page table passed as both K's and V's)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype)


def launch_decode(q, k_cache, v_cache, page_table, seq_len_kv, slopes, out, lse, *, scale, softcap, band,
                  tiles, num_splits, cap, page_table_v=None, seq_len_q=None, sink=None, descale_k=None,
                  descale_v=None):
    """Run the decode kernel (and the combine when ``num_splits > 1``). No checks: the caller did them.

    q [b,h_q,s_q,d]; k_cache/v_cache [b,h_kv,s_max,d|d_v] or containers [pages,h_kv,page,d|d_v]
    (k and v sharing pages and page size); sink: fp32 contiguous [h_q] sink logits or None; page_table int32 [b, max_pages] view (any strides) or
    None; page_table_v: V's own table of the same shape (cuDNN has two), default page_table;
    seq_len_kv / seq_len_q: int32 [b] contiguous, or None (full lengths); slopes fp32 [b, h_q] (batch
    stride 0 for per-head slopes) or None (ALiBi, base e); out [b,h_q,s_q,d_v] and lse fp32 [b,h_q,s_q] (or None), any strides.
    FP8 caches (k_cache / v_cache float8, q fp16 / bf16 / fp32): descale_k / descale_v fp32 with one element or
    one per kv head (fusedattn.kvcache_fp8's [1, h_kv | 1, 1, 1]), [Note] FP8 caches in the kernel.
    ``band`` is a problem.Band (either alignment) or None; ``cap`` the capacity in keys
    (s_max, or max_pages * page size). Caller's duty: 16-byte aligned base pointers (args.aligned).
    """
    b, h_q, s_q, d = q.shape
    h_kv, d_v = k_cache.shape[1], v_cache.shape[3]
    g = h_q // h_kv
    paged = page_table is not None
    sw, win_left, win_right = _switches(q.dtype, d, d_v, band, softcap, slopes is not None)
    qk_scale = scale / softcap if softcap > 0.0 else scale * LOG2E_PY
    m_tiles = cdiv(g * s_q, tiles.block_m)
    split = num_splits > 1
    if split:
        o_part = torch.empty((num_splits, b, h_q, s_q, d_v), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, b, h_q, s_q), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out
    pt = page_table if paged else q
    pt_strides = page_table.stride() if paged else (0, 0)
    pt_v = page_table_v if page_table_v is not None else pt
    ptv_strides = page_table_v.stride() if page_table_v is not None else pt_strides
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0, 0))
    kv_fp8 = descale_k is not None
    dsk, dsv = (descale_k.reshape(-1), descale_v.reshape(-1)) if kv_fp8 else (q, q)
    v_pairs = v_pairs_code(v_cache, d_v) if kv_fp8 else 0
    if v_pairs:
        v_cache = v_cache.view(torch.int16)              # its strides in pairs; d_v stays in FP8 columns
    grid = (b * h_kv, num_splits, m_tiles)
    args = (q, k_cache, v_cache, pt, pt_v, seq_len_q if seq_len_q is not None else pt,
            seq_len_kv if seq_len_kv is not None else pt, slopes if slopes is not None else q,
            out, lse_arg, o_part, lse_part, sink if sink is not None else q, dsk, dsv,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *pt_strides, *ptv_strides, *out.stride(), *lse_strides,
            slope_batch_stride(slopes), int(kv_fp8 and dsk.numel() > 1), int(kv_fp8 and dsv.numel() > 1),
            b, h_kv, g, s_q, d, d_v, cap, k_cache.shape[0] if paged else 0, num_splits,
            qk_scale, float(softcap), win_left, win_right)
    kwargs = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                  BLOCK_D=block_dim(d), BLOCK_DV=block_dim(d_v),
                  PAGED=paged, PAGE_SIZE=k_cache.shape[2] if paged else 1,
                  HAS_SEQ_Q=seq_len_q is not None, HAS_SEQ_KV=seq_len_kv is not None,
                  BOTTOM_RIGHT=band is not None and band.alignment == "bottom_right",
                  SPLIT=split, WRITE_LSE=lse is not None, HAS_SINK=sink is not None, KV_FP8=kv_fp8,
                  V_PAIRS=v_pairs, ONE_TABLE=paged and _same_view(pt_v, pt),
                  ROWS32=_rows32(k_cache, v_cache, paged, kv_fp8),
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages, **sw)
    if tiles.max_regs:
        kwargs["maxnreg"] = tiles.max_regs
    # decode is host-bound (a few microseconds of GPU work per layer): a repeat signature launches the
    # compiled kernel directly instead of through Triton's dispatcher (launch.Launcher; bench/NOTES.md 54)
    _DECODE(signature_key(args, kwargs), grid, *args, **kwargs)
    if split:
        rows = b * h_q * s_q
        block_r = 64 if q.device.type == "cpu" else 16       # the interpreter: fewer, larger programs
        args = (o_part, lse_part, out, lse_arg, *out.stride(), *lse_strides, rows, h_q, s_q, d_v, num_splits)
        kwargs = dict(BLOCK_R=block_r, BLOCK_DV=pow2(d_v), WRITE_LSE=lse is not None,
                      num_warps=4)
        _COMBINE(signature_key(args, kwargs), (cdiv(rows, block_r),), *args, **kwargs)


_DECODE, _COMBINE = Launcher(_decode_fwd), Launcher(_decode_combine)


# ----------------------------------------------------------------------------- the problem door

DECODE_MAX_ROWS = 64     # g * s_q up to which the planner should prefer this kernel (one 16..64-row tile)


def decode_supports(p) -> bool:
    """Whether an AttentionProblem's features are all ones this kernel has (shape aside).

    Not here: bias tensors, dropout, packed (varlen) batches. The planner routes a problem here
    when this holds and ``decode_rows_fit``.
    """
    return p.bias is None and not p.has_dropout and not getattr(p, "varlen", False)


def decode_rows_fit(s_q: int, group: int) -> bool:
    """Few query rows per kv head (decode): the split-KV kernel beats the tiled forward.
    Beyond, prefill reads K/V once per 64 rows here and belongs to the forward kernel."""
    return s_q * group <= DECODE_MAX_ROWS


def launch_decode_problem(p, extras, q, k, v, out, lse, num_splits=None):
    """Run an AttentionProblem (from problem.make_problem) on the decode kernel.

    q/k/v/out as attention_forward has them (k/v containers when ``p.paged``); lse fp32
    [b,h_q,s_q] view or None. Handles pointer alignment like launch_fwd.
    """
    from .args import aligned, aligned_output
    tiles, splits = plan_decode(p.b, p.h_kv, p.group, p.s_q, p.d, p.d_v, p.dtype, p.s_kv, q.device, num_splits)
    o_buf, o_target = aligned_output(out)
    l_buf, l_target = aligned_output(lse) if lse is not None else (None, None)
    launch_decode(aligned(q), aligned(k), aligned(v), aligned(extras.get("page_table_k")),
                  aligned(extras["seq_len_kv"]), extras["slopes"], o_buf, l_buf, scale=p.scale, softcap=p.softcap,
                  band=p.band, tiles=tiles, num_splits=splits, cap=p.s_kv,
                  page_table_v=aligned(extras.get("page_table_v")), seq_len_q=aligned(extras["seq_len_q"]),
                  sink=extras.get("sink"))
    for buf, target in ((o_buf, o_target), (l_buf, l_target)):
        if target is not None:
            target.copy_(buf)


def launch_append(k_new, v_new, k_cache, v_cache, page_table, seq_len_kv, cap, seq_len_q=None, cu_seqlens_q=None,
                  max_seqlen_q=None):
    """Write k_new/v_new [b,h_kv,s_q,d|d_v] into the caches at len_kv - len_q .. len_kv - 1 (len_q = s_q, or
    seq_len_q int32 [b]: rows past it are padding). Packed new tokens: k_new/v_new [1, h_kv, total, d|d_v]
    views with cu_seqlens_q int32 [b + 1] and max_seqlen_q."""
    _, h_kv, s_q, d = k_new.shape
    d_v = v_new.shape[3]
    b = k_cache.shape[0] if page_table is None else page_table.shape[0]
    if cu_seqlens_q is not None:
        s_q = max_seqlen_q
    paged = page_table is not None
    pt = page_table if paged else k_new
    jit_launch(_append_kv, (b * h_kv, s_q),
        k_new, v_new, k_cache, v_cache, pt, seq_len_kv if seq_len_kv is not None else pt,
        seq_len_q if seq_len_q is not None else pt, cu_seqlens_q if cu_seqlens_q is not None else pt,
        *k_new.stride(), *v_new.stride(), *k_cache.stride(), *v_cache.stride(),
        *(page_table.stride() if paged else (0, 0)),
        h_kv, s_q, d, d_v, cap, k_cache.shape[0] if paged else 0,
        BLOCK_D=pow2(d), BLOCK_DV=pow2(d_v),
        PAGED=paged, PAGE_SIZE=k_cache.shape[2] if paged else 1, HAS_SEQ_KV=seq_len_kv is not None,
        HAS_SEQ_Q=seq_len_q is not None, VARLEN_Q=cu_seqlens_q is not None, num_warps=1,
    )


def launch_validate(seq_len_kv, page_table, num_pages, page_size, s_q, cap, need_room, seq_len_q=None):
    """One small kernel: int32 [b] codes (bits BAD_*), read back by the caller (one host sync).
    seq_len_q: int32 [b] new tokens per sequence (each in [0, s_q], and the room they need), or None."""
    b = seq_len_kv.shape[0]
    codes = torch.empty(b, dtype=torch.int32, device=seq_len_kv.device)
    paged = page_table is not None
    pt = page_table if paged else seq_len_kv
    jit_launch(_validate_kv, (b,),
        seq_len_kv, pt, seq_len_q if seq_len_q is not None else seq_len_kv, codes,
        *(page_table.stride() if paged else (0, 0)), s_q, cap, num_pages,
        NEED_ROOM=need_room, PAGED=paged, PAGE_SIZE=page_size if paged else 1, BLOCK_P=256,
        HAS_SEQ_Q=seq_len_q is not None, num_warps=1,
    )
    return codes
