"""Forward attention: one Triton kernel, features as compile-time switches.

Algorithm (FlashAttention-2): program (pid_m, bh) owns query rows
[start_m, start_m + BLOCK_M) of one (batch, query head); its key/value head is
``head // GROUP`` (GQA/MQA read K/V in place, no copies). The Q tile stays in
registers while K/V tiles stream through; the row state (running max ``m_i``
and sum ``l_i``, both base 2) rescales the fp32 accumulator ``acc`` [BLOCK_M,
d_v] at each tile (online softmax), so memory is O(s), never O(s_q * s_kv).

Key tiles are visited in three runs (``common.kv_block_range``): masked edge
blocks on the left of the band, whole blocks with no mask arithmetic, masked
edge blocks on the right; blocks wholly outside the band or past the sequence
length are never touched.

[Note] empty rows: a row with no key to attend to (band, padding, a -inf bias)
has m_i = -inf and l_i = 0. Exponents use ``m_safe`` (0 where m is -inf) so no
inf - inf arises; the row writes output 0 and stats (log-sum-exp) -inf, the log of
its empty sum, never NaN (rows past seq_len_q too). A row whose sum is NaN (a NaN or inf
in a score it sees) is not empty: it writes NaN, as softmax gives (``l_i != 0``, not ``> 0``,
which read NaN as empty and wrote lse -inf beside an output the NaN had reached through the
accumulator). Merging (out, lse) pairs of split
work then gives an empty part weight exp(-inf) = 0; the backward reads -inf as +inf
(``common.backward_lse``) so such a row's P is 0.

[Note] sinks (HAS_SINK): the per-head sink logit is one more softmax term with no value row, so it
enters once, in the epilogue (``common.fold_sink``): the row max and sum take it, the accumulator is
only rescaled. The stats include it. A row with no key but a sink writes output 0 and lse = sink.
The backward needs no switch: P = exp(s - lse) with that lse is already the sink-normalized P.

[Note] FP8 (compile-time ``FP8``; ``launch_fwd_fp8``; semantics: cuDNN's ``sdpa_fp8``, ``fusedattn.fp8``):
q, K, V are float8 (e4m3 or e5m2, one type); six one-element fp32 tensors give descale_q/k/v/s and
scale_s/o (pointers, read in the kernel, so CUDA graphs replay new values); with ``FP8_HEAD_SCALES``
descale_q is one per query head ([h_q]) and descale_k / descale_v one per kv head ([h_kv]), each program
reading its heads' (fusedattn's addition to cuDNN's per-tensor scales). Rounding points, in order:
* S = dot(q8, k8^T) in fp32 (products of two FP8 values are exact), times ``qk_scale * descale_q *
  descale_k`` (qk_scale = attn_scale * log2 e: base 2 as the 16-bit path); masks as the 16-bit path;
* p = exp2(S - m_running) <= 1 (fp32; the row sum l takes this fp32 p), then P8 = fp8(p * scale_s),
  nearest even, saturating (``common.to_fp8``); acc = acc * alpha + dot(P8, v8), fp32;
* epilogue O = acc / l * descale_s * descale_v; amax_o = max |O| (rows inside the sequence), amax_s =
  max 1 / l (exact: a row's largest P is exp(0) / l), each by one float atomic max per program into
  buffers the host zeroed; o = O * scale_o in the output type (FP8: ``to_fp8``); lse as the 16-bit path.
cuDNN quantizes the normalized P = p / l instead. The kernel stays within ``fusedattn.fp8``'s bound
(``reference_fp8.fp8_forward_bound``): with q(x) = x (1 + t) + n, |t| <= u8, |n| <= a8, the output is
sum_j P_j (1 + t_j) V_j plus sum_j alpha_j n_j descale_s V_j / l, with alpha_j <= 1 the rescale since
key j's tile and l >= 1, so the relative term is the bound's and the subnormal floor term at most
its; p <= 1 never saturates when scale_s <= FP8_MAX (the bound's assumption); the rescales add one
fp32 rounding per key tile, inside the bound's doubled fp32 terms.
sm_90: both products run on 8-bit MMAs; ``max_num_imprecise_acc=FP8_PROMOTE_K`` moves their partial
sums to fp32 after every 32-wide K-step (Triton's sm_90 default never does, and the tensor cores add
with fewer bits than fp32 in between). Within a step the hardware's sum keeps about 14 bits: the
bound's ``u_mma`` (``fusedattn.fp8.MMA_UNIT_FP8``, measured by bench/fp8_mma_probe.py). ``FP8_MMA16``
runs both products as fp16 MMAs on the same FP8 values instead (exact conversions, fp32 sums: the bound
holds a fortiori), where plan times them faster (``plan.fp8_fwd_mma16``).
Interpreter (``FP8_INTERP``): Triton's interpreter (3.6, 3.9) casts fp32 to float8 wrongly but loads
FP8, casts on-grid values exactly and runs FP8 dots as fp16 operands (exact) with fp32 sums, so
``to_fp8`` rounds in fp32 arithmetic first (``common.round_to_fp8_grid``), then casts; everything
else, the FP8 dots included, is the GPU path's code (max_num_imprecise_acc is ignored there).
"""
import torch
import triton
import triton.language as tl

from .args import (aligned, aligned_output, block_dim, extras_key, is_plain as _is_plain, kernel_scalars,
                   set_descriptor_allocator, tma_ok)
from .launch import Launcher, cdiv
from ...plan import interpreting
from .common import (LN2, batch_rows, dropout_keep, fold_sink, fp8_dot, kv_block_range, kv_row_offsets,
                     load_bias, load_tile, scores_base2, to_fp8, to_out)


@triton.jit
def _attn_fwd_blocks(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_table, v_table, stride_tkn, stride_tvn,
                     num_blocks,
                     bias_base, slope,
                     offs_m, offs_n, offs_d, offs_dv, start_m, start, end, len_kv, diag,
                     stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_bm, stride_bn,
                     S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
                     dropout_seed, dropout_offset, dropout_threshold, bh, scale_s,
                     MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                     BIAS_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                     FP8: tl.constexpr = False, FP8_INTERP: tl.constexpr = False,
                     FP8_MMA16: tl.constexpr = False):
    """Online-softmax update of one query tile over key blocks [start, end).

    USE_TMA loads K/V tiles through tensor descriptors (Hopper's bulk copy engine; rows
    past the tensor and head-dim padding arrive as zeros, the score mask does the rest).
    FP8 (module docstring, [Note] FP8): q, K, V are float8; ``qk_scale`` already holds
    descale_q * descale_k; P enters the second product as fp8(p * scale_s) (``scale_s``
    is read only then), and both products accumulate in fp32: FP8 MMAs, or with FP8_MMA16 fp16 MMAs on the
    same values (``common.fp8_dot``: exact conversions, the same rounding points).
    """
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        cols = start_n + offs_n
        if USE_TMA:
            k = k_desc.load([start_n, 0])
        else:
            k_rows = kv_row_offsets(start_n, offs_n, k_table, stride_tkn, S_KV, num_blocks, stride_kb, stride_kn,
                                    PAGED, PAGE_SIZE)
            k = load_tile(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd,
                          cols, offs_d, len_kv, D, MASKED, not EVEN_D)
        if FP8:
            # FP8 MMA; the partial sums move to the fp32 tile after every K-step of 32 (sm_90 wgmma
            # otherwise adds all of d with fewer bits than fp32: Triton's max_num_imprecise_acc)
            qk = fp8_dot(q, tl.trans(k), None, FP8_MMA16)
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or SOFTCAP or BIAS_KIND != 0 or HAS_ALIBI:
            bias = 0.0
            if BIAS_KIND != 0:
                bias = load_bias(bias_base, offs_m[:, None], cols[None, :], stride_bm, stride_bn, S_Q, S_KV, BIAS_KIND)
            s = scores_base2(qk, bias, slope, offs_m[:, None], cols[None, :], len_kv, len_kv, diag, win_left,
                             win_right, qk_scale, softcap, MASKED, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, False)
            if HAS_ALIBI:
                # ALiBi's slope * (j - i) less the per-row constant slope * (start_m - i), which softmax
                # ignores: one add of a per-key vector (the stats are corrected once at the end)
                s += (slope * (cols - start_m).to(tl.float32))[None, :]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
        else:
            # no mask and no score mod: the max of the raw scores (scale > 0) and one FMA per score;
            # no row can be empty, so the max is finite. (A lazy rescale, FlashAttention-4's skip of
            # acc * alpha while no row max grows by 2^8, measured 10-20% slower: bench/NOTES.md 9.)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_safe = m_new
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        if DROPOUT:
            keep = dropout_keep(dropout_seed, dropout_offset, bh, start_m, start_n, S_Q, S_KV, dropout_threshold,
                                BLOCK_M, BLOCK_N, True)
            p = tl.where(keep, p, 0.0)
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        else:
            v_rows = kv_row_offsets(start_n, offs_n, v_table, stride_tvn, S_KV, num_blocks, stride_vb, stride_vn,
                                    PAGED, PAGE_SIZE)
            v = load_tile(v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd,
                          cols, offs_dv, len_kv, D_V, MASKED, not EVEN_DV)
        if FP8:
            # P8 = fp8(p * scale_s) of the unnormalized p <= 1 (the row sum l_i keeps the fp32 p)
            acc = fp8_dot(to_fp8(p * scale_s, v.dtype, FP8_INTERP), v, acc, FP8_MMA16)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def fp8_epilogue(out, inv_l, row_in, DESCALE_S, DESCALE_V, SCALE_O, AMAX_S, AMAX_O, OUT_TY: tl.constexpr,
                 INTERP: tl.constexpr):
    """The FP8 forward's output tile, and its share of the two amaxes (module docstring, [Note] FP8).

    out: acc / l, fp32 [BLOCK_M, BLOCK_DV] (0 on empty rows); inv_l: 1 / l [BLOCK_M] (0 on empty rows);
    row_in: [BLOCK_M] rows inside the sequence (the tile's last rows past len_q attend to zero queries
    and must not count). Returns O * scale_o in OUT_TY (``common.to_out``: float8 saturating, ``to_fp8``).
    """
    out = out * tl.load(DESCALE_S) * tl.load(DESCALE_V)      # matmul_fp8's order: descale A (P), then B (V)
    # amax_s = max P = 1 / l per row (the row's largest term is exp(0)); amax_o = max |O| before scale_o.
    # Both >= 0, where the float atomic max orders as the numbers do; the host zeroes them first.
    tl.atomic_max(AMAX_S, tl.max(tl.where(row_in, inv_l, 0.0), 0))
    tl.atomic_max(AMAX_O, tl.max(tl.max(tl.where(row_in[:, None], tl.abs(out), 0.0), 1), 0))
    return to_out(out * tl.load(SCALE_O), OUT_TY, INTERP)     # float8 saturating; bf16 nearest even on the interpreter


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, SEQ_Q, SEQ_KV, BIAS, SLOPES, TABLE_K, TABLE_V, CU_Q, CU_KV, SINK,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_lb, stride_lh, stride_lm,
              stride_bb, stride_bh, stride_bm, stride_bn, stride_sb, stride_tk, stride_tkn, stride_tv, stride_tvn,
              H_Q, GROUP, S_Q, S_KV, D, D_V, NUM_BLOCKS,
              qk_scale, softcap, win_left, win_right,
              dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
              BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              HAS_SEQ_Q: tl.constexpr, HAS_SEQ_KV: tl.constexpr,
              BIAS_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
              DROPOUT: tl.constexpr, WRITE_LSE: tl.constexpr, REVERSE_M: tl.constexpr,
              DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
              PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, VARLEN: tl.constexpr, HAS_SINK: tl.constexpr = False,
              DESCALE_Q=None, DESCALE_K=None, DESCALE_V=None, DESCALE_S=None, SCALE_S=None, SCALE_O=None,
              AMAX_S=None, AMAX_O=None, FP8: tl.constexpr = False, FP8_INTERP: tl.constexpr = False,
              FP8_MMA16: tl.constexpr = False, FP8_HEAD_SCALES: tl.constexpr = False):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    if REVERSE_M:
        # causal: the longest rows (last tiles) start first, so the tail of the grid is short
        pid_m = tl.num_programs(0) - 1 - pid_m
    batch = bh // H_Q
    head = bh % H_Q
    kv_head = head // GROUP
    start_m = pid_m * BLOCK_M
    b_idx, q0, kv0, len_q, len_kv, row_end, _, diag = batch_rows(
        SEQ_Q, SEQ_KV, CU_Q, CU_KV, batch, S_Q, S_KV, HAS_SEQ_Q, HAS_SEQ_KV, VARLEN, BOTTOM_RIGHT)
    # int64 base offsets: batch * stride can pass 2^31 on large tensors
    b64 = batch.to(tl.int64)
    h64 = head.to(tl.int64)
    kvh64 = kv_head.to(tl.int64)
    q_off = b_idx * stride_qb + q0 * stride_qm
    o_off = b_idx * stride_ob + q0 * stride_om
    l_off = b_idx * stride_lb + q0 * stride_lm
    k_off = b_idx * stride_kb + kv0 * stride_kn
    v_off = b_idx * stride_vb + kv0 * stride_vn

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = Q + q_off + h64 * stride_qh
    if PAGED:
        # containers [num_blocks, h_kv, block_size, d]: the batch lives in the page tables
        k_base = K + kvh64 * stride_kh
        v_base = V + kvh64 * stride_vh
    else:
        k_base = K + k_off + kvh64 * stride_kh
        v_base = V + v_off + kvh64 * stride_vh
    k_table = TABLE_K + b64 * stride_tk
    v_table = TABLE_V + b64 * stride_tv
    bias_base = BIAS
    if BIAS_KIND != 0:
        bias_base = BIAS + b64 * stride_bb + h64 * stride_bh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b64 * stride_sb + head) * 1.4426950408889634   # [b, h_q]; stride 0 for [h_q]

    q = load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                  offs_m, offs_d, len_q, D, True, not EVEN_D)
    k_desc = k_base
    v_desc = v_base
    if USE_TMA:
        # one 2-D [s_kv, d] view per (batch, kv head): any batch/head strides, unit stride on d
        k_desc = tl.make_tensor_descriptor(k_base, shape=[S_KV, D], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[S_KV, D_V], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])

    scale_s = 1.0
    if FP8:
        # cuDNN's bmm1 scale chain folded into the one score multiply (scale * log2(e) * descales)
        if FP8_HEAD_SCALES:
            qk_scale = qk_scale * tl.load(DESCALE_Q + head) * tl.load(DESCALE_K + kv_head)
            descale_v_ptr = DESCALE_V + kv_head
        else:
            qk_scale = qk_scale * tl.load(DESCALE_Q) * tl.load(DESCALE_K)
            descale_v_ptr = DESCALE_V
        scale_s = tl.load(SCALE_S)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = kv_block_range(start_m, len_q, len_kv, diag, win_left, win_right,
                                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    acc, m_i, l_i = _attn_fwd_blocks(
        acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_table, v_table, stride_tkn, stride_tvn, NUM_BLOCKS, bias_base, slope,
        offs_m, offs_n, offs_d, offs_dv, start_m,
        lo, full_lo, len_kv, diag, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_bm, stride_bn,
        S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
        dropout_seed, dropout_offset, dropout_threshold, bh, scale_s,
        True, PAGED, PAGE_SIZE, BLOCK_N, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI, DROPOUT,
        DOT_PRECISION, USE_TMA, False, FP8, FP8_INTERP, FP8_MMA16)
    acc, m_i, l_i = _attn_fwd_blocks(
        acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_table, v_table, stride_tkn, stride_tvn, NUM_BLOCKS, bias_base, slope,
        offs_m, offs_n, offs_d, offs_dv, start_m,
        full_lo, full_hi, len_kv, diag, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_bm, stride_bn,
        S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
        dropout_seed, dropout_offset, dropout_threshold, bh, scale_s,
        False, PAGED, PAGE_SIZE, BLOCK_N, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI, DROPOUT,
        DOT_PRECISION, USE_TMA, WARP_SPECIALIZE, FP8, FP8_INTERP, FP8_MMA16)
    acc, m_i, l_i = _attn_fwd_blocks(
        acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_table, v_table, stride_tkn, stride_tvn, NUM_BLOCKS, bias_base, slope,
        offs_m, offs_n, offs_d, offs_dv, start_m,
        full_hi, hi, len_kv, diag, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_bm, stride_bn,
        S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
        dropout_seed, dropout_offset, dropout_threshold, bh, scale_s,
        True, PAGED, PAGE_SIZE, BLOCK_N, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI, DROPOUT,
        DOT_PRECISION, USE_TMA, False, FP8, FP8_INTERP, FP8_MMA16)

    if HAS_SINK:
        sink2 = tl.load(SINK + head) * 1.4426950408889634 + tl.zeros([BLOCK_M], tl.float32)   # fp32 [h_q]
        if HAS_ALIBI:
            sink2 += slope * (offs_m - start_m).to(tl.float32)     # into the loop's per-row shifted frame
        acc, m_i, l_i = fold_sink(acc, m_i, l_i, sink2)
    # epilogue: normalize; empty rows (l_i == 0) give 0, rows past the sequence give 0; a NaN sum stays NaN
    row_ok = l_i != 0.0
    if HAS_SEQ_Q:
        row_ok = row_ok & (offs_m < len_q)
    inv_l = tl.where(row_ok, dropout_rescale / tl.where(row_ok, l_i, 1.0), 0.0)
    out = acc * inv_l[:, None]
    if FP8:
        out = fp8_epilogue(out, inv_l, offs_m < len_q, DESCALE_S, descale_v_ptr, SCALE_O, AMAX_S, AMAX_O,
                           O.dtype.element_ty, FP8_INTERP)
    else:
        out = out.to(O.dtype.element_ty)
    o_ptrs = O + o_off + h64 * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    if EVEN_DV:
        tl.store(o_ptrs, out, mask=(offs_m < row_end)[:, None])
    else:
        tl.store(o_ptrs, out, mask=(offs_m < row_end)[:, None] & (offs_dv < D_V)[None, :])
    if WRITE_LSE:
        # natural-log log-sum-exp of the scaled scores (cuDNN's Stats); -inf for empty rows
        lse2 = m_i + tl.math.log2(tl.where(row_ok, l_i, 1.0))
        if HAS_ALIBI:
            lse2 -= slope * (offs_m - start_m).to(tl.float32)   # undo the per-row shift of the loop
        lse = tl.where(row_ok, lse2 * LN2, float("-inf"))
        l_ptrs = LSE + l_off + h64 * stride_lh + offs_m * stride_lm
        tl.store(l_ptrs, lse, mask=offs_m < row_end)


_FWD = Launcher(_attn_fwd)
_PLAIN_ARGS = {}        # plain problems: (problem, tiles, strides) -> (grid, non-tensor args, constexprs)
_TENSOR_SLOTS = 14      # Q, K, V, O, LSE, SEQ_Q, SEQ_KV, BIAS, SLOPES, TABLE_K, TABLE_V, CU_Q, CU_KV, SINK


def launch_fwd(problem, tiles, q, k, v, out, lse, extras):
    """Launch the forward kernel. Decisions were made upstream (problem, tiles).

    q [b,h_q,s_q,d], k [b,h_kv,s_kv,d], v [b,h_kv,s_kv,d_v], out [b,h_q,s_q,d_v]: any strides.
    lse: fp32 [b,h_q,s_q] view (or None). extras: from ``problem.make_problem``.
    """
    p = problem
    plain_key = None
    if _is_plain(p) and all(t.data_ptr() % 16 == 0 for t in (q, k, v, out)) and (
            lse is None or lse.data_ptr() % 16 == 0):
        # the common call (no optional tensor): every argument but the tensors is remembered
        plain_key = (p, tiles, q.stride(), k.stride(), v.stride(), out.stride(), lse is None or lse.stride())
        hit = _PLAIN_ARGS.get(plain_key)
        if hit is not None:
            grid, rest, kwargs = hit
            _FWD(plain_key, grid, q, k, v, out, out if lse is None else lse, q, q, out, q, q, q, q, q, q, *rest,
                 **kwargs)
            return
    q, k, v = aligned(q), aligned(k), aligned(v)
    out, out_target = aligned_output(out)
    lse_target = None
    if lse is not None:
        lse, lse_target = aligned_output(lse)
    args = kernel_scalars(p, extras, q)
    bias = aligned(extras["bias"])
    bias_strides = bias.stride() if bias is not None else (0, 0, 0, 0)
    if bias is not None and bias.dtype == torch.bool:
        bias = bias.view(torch.uint8)
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0, 0))
    # descriptors only for power-of-two head dims (ptxas crashes on a 224-wide box over 256)
    use_tma = tiles.tma and not p.paged and not p.varlen and tma_ok(k, v) and args["switches"]["EVEN_D"] and args["switches"]["EVEN_DV"]
    if use_tma:
        set_descriptor_allocator()
    grid = (cdiv(p.s_q, tiles.block_m), p.b * p.h_q)
    table_k, table_v = extras["page_table_k"], extras["page_table_v"]
    tables = (table_k, table_v, *table_k.stride(), *table_v.stride()) if p.paged else (q, q, 0, 0, 0, 0)
    cu_q, cu_kv = (extras["cu_seqlens_q"], extras["cu_seqlens_kv"]) if p.varlen else (q, q)
    num_blocks = k.shape[0] if p.paged else 1
    # everything the non-tensor arguments and the tensors' dtypes/alignment depend on (launch.py);
    # dropout seeds change every call and the JIT specializes on their width: no key
    key = None if p.has_dropout else (
        p, tiles, use_tma, q.stride(), k.stride(), v.stride(), out.stride(), lse_strides, bias_strides,
        tables[2:], num_blocks, extras_key(extras))
    pos = (q, k, v, out, lse_arg, args["seq_q"], args["seq_kv"], bias if bias is not None else out, args["slopes"],
           tables[0], tables[1], cu_q, cu_kv, args["sink"],
           *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse_strides, *bias_strides, args["stride_sb"],
           *tables[2:],
           p.h_q, p.group, p.s_q, p.s_kv, p.d, p.d_v, num_blocks,
           args["qk_scale"], p.softcap, args["win_left"], args["win_right"],
           p.dropout_seed, p.dropout_offset, args["dropout_threshold"], args["dropout_rescale"])
    kwargs = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=args["block_d"], BLOCK_DV=args["block_dv"],
                  WRITE_LSE=lse is not None, REVERSE_M=args["causal_like"],
                  USE_TMA=use_tma, WARP_SPECIALIZE=use_tma and tiles.warp_specialize,
                  PAGED=p.paged, PAGE_SIZE=p.page_size if p.paged else 1, VARLEN=p.varlen,
                  HAS_SINK=p.has_sink, num_warps=tiles.num_warps, num_stages=tiles.num_stages, **args["switches"])
    if plain_key is not None:
        key = plain_key
        if len(_PLAIN_ARGS) >= 512:
            _PLAIN_ARGS.clear()
        _PLAIN_ARGS[plain_key] = (grid, pos[_TENSOR_SLOTS:], kwargs)
    _FWD(key, grid, *pos, **kwargs)
    for buf, target in ((out, out_target), (lse, lse_target)):
        if target is not None:
            target.copy_(buf)


def launch_fwd_fp8(problem, tiles, q8, k8, v8, out, lse, extras, scales, amax_s, amax_o, mma16=False):
    """Launch the forward kernel with the FP8 switch (module docstring, [Note] FP8).

    q8 [b,h_q,s_q,d], k8 [b,h_kv,s_kv,d], v8 [b,h_kv,s_kv,d_v]: one float8 type, any strides.
    out [b,h_q,s_q,d_v]: float8 / bf16 / fp16 / fp32. lse: fp32 [b,h_q,s_q] view or None.
    scales: dict of one-element fp32 tensors on the device (descale_q, descale_k, descale_v, descale_s,
    scale_s, scale_o): read by the kernel, so a CUDA graph replays with new values. descale_q may instead hold
    one value per query head and descale_k / descale_v one per kv head (``FP8_HEAD_SCALES``: the three go over
    as contiguous [h_q] / [h_kv] / [h_kv], a one-element one expanded). amax_s, amax_o:
    one-element fp32 tensors, zeroed by the caller, maxed into by every program.
    problem: the mask and shapes (dtype: q8's); only masks, padding and GQA (fusedattn.fp8 routes the rest
    to its emulation). mma16: the products as fp16 MMAs on the FP8 values (``common.fp8_dot``). Always
    through the JIT's dispatch (key None): the scale and amax pointers are trailing parameters, which a
    Launcher cache entry would keep from its first call.
    """
    p = problem
    q8, k8, v8 = aligned(q8), aligned(k8), aligned(v8)
    out, out_target = aligned_output(out)
    lse_target = None
    if lse is not None:
        lse, lse_target = aligned_output(lse)
    args = kernel_scalars(p, extras, q8)
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0, 0))
    grid = (cdiv(p.s_q, tiles.block_m), p.b * p.h_q)
    # the tensors no FP8 call has (bias, slopes, page tables, cu_seqlens, sink) get dummies, their strides 0
    no_bias, no_slopes, no_tables = (0, 0, 0, 0), 0, (0, 0, 0, 0)
    no_dropout = (0, 0, 0, 1.0)         # seed, offset, threshold, rescale
    pos = (q8, k8, v8, out, lse_arg, args["seq_q"], args["seq_kv"], out, args["slopes"], q8, q8, q8, q8, args["sink"],
           *q8.stride(), *k8.stride(), *v8.stride(), *out.stride(), *lse_strides, *no_bias, no_slopes, *no_tables,
           p.h_q, p.group, p.s_q, p.s_kv, p.d, p.d_v, 1,
           args["qk_scale"], 0.0, args["win_left"], args["win_right"], *no_dropout)
    switches = dict(args["switches"], EVEN_D=fp8_block_dim(p.d) == p.d, EVEN_DV=fp8_block_dim(p.d_v) == p.d_v)
    if any(scales[name].numel() != 1 for name in ("descale_q", "descale_k", "descale_v")):
        # per-head descales: each program reads its query head's and kv head's (the switch is passed only
        # here, so per-tensor launches keep the shipped store's keys)
        heads = dict(descale_q=p.h_q, descale_k=p.h_kv, descale_v=p.h_kv)
        scales = dict(scales, **{name: scales[name].reshape(-1).expand(n).contiguous() for name, n in heads.items()})
        switches["FP8_HEAD_SCALES"] = True
    kwargs = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=fp8_block_dim(p.d),
                  BLOCK_DV=fp8_block_dim(p.d_v), WRITE_LSE=lse is not None, REVERSE_M=args["causal_like"],
                  USE_TMA=False, WARP_SPECIALIZE=False, PAGED=False, PAGE_SIZE=1, VARLEN=False, HAS_SINK=False,
                  **{name.upper(): scales[name] for name in FP8_SCALE_NAMES}, AMAX_S=amax_s, AMAX_O=amax_o,
                  FP8=True, FP8_INTERP=interpreting(), FP8_MMA16=bool(mma16), num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages, **switches)
    _FWD(None, grid, *pos, **kwargs)
    for buf, target in ((out, out_target), (lse, lse_target)):
        if target is not None:
            target.copy_(buf)


FP8_SCALE_NAMES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


def fp8_block_dim(d: int) -> int:
    """The tile width over a head dim for FP8 operands: a power of two, at least 32 (an 8-bit MMA's
    K-step, and FP8_PROMOTE_K must not exceed a product's K)."""
    return max(32, block_dim(d))
