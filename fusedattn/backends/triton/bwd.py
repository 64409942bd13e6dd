"""Backward attention: FlashAttention-2's split, deterministic (no atomics).

Notation as in fwd.py. Given q, k, v, o, dO and the forward's natural-log
stats ``lse``, with P = exp(S - lse) recomputed tile by tile (never stored; a row that saw
no key has lse = -inf, read as +inf so its P is 0 and its dQ 0, never NaN):

    delta = rowsum(dO * O)                          [b*h_q, s_q] fp32, written by the dQ pass
    dS_ij = P_ij * (dP_ij - delta_i),  dP = dO V^T   (dropout: dP masked and scaled)
    dQ_i  = scale * sum_j dS_ij K_j                  _attn_bwd_dq,   program = (query block, b, q head)
    dV_j  = sum_i P_ij^T dO_i        (dropout: P masked and scaled by 1/(1-p))
    dK_j  = scale * sum_i dS_ij^T Q_i                _attn_bwd_dkdv, program = (key block, b, kv head)

The dQ pass runs first: each program computes delta for its own rows (it holds dO
already) before its loop, so no separate preprocess launch is needed; the dK/dV pass
then reads delta. (``_attn_bwd_preprocess`` is the standalone delta kernel, for passes
that cannot write it themselves.)

The dK/dV program owns one key block of one kv head and loops over the query
heads of its GQA group and the query blocks that see it (the band transposed,
``common.q_block_range``), so every dK/dV element has exactly one writer: the
result is bitwise reproducible. It works on transposed tiles [keys, rows]
(S^T = K Q^T) so no tile is transposed in registers. With softcap, dS also
carries the tanh derivative (1 - t^2). dBias (when asked) is dS itself,
written per (row, key) by the dK/dV program into a zeroed fp32 buffer.

[Note] FP8 (compile-time ``FP8``; ``launch_bwd_fp8``; semantics: cuDNN's ``sdpa_fp8_backward``,
``fusedattn.fp8``): q, K, V float8 (one type, e4m3 or e5m2), dO float8 (e4m3 or e5m2, its own type), o
float8 or 16/32-bit; one fp32 [12] buffer holds the scales (``FP8_BWD_SCALE_NAMES``, read in the kernels,
so CUDA graphs replay new values) and one fp32 [4] the amaxes (dQ, dK, dV, dP; float atomic max, zeroed by
the host). The rounding points are the emulation's, in its order:
* delta = rowsum(dO8 * o) * descale_dO * descale_o (fp32 products and sum), by the dQ pass as before;
* S = dot(q8, k8^T) (fp32 sums of exact FP8 products) * qk_scale * descale_q * descale_k (base 2);
  P = exp2(S - lse * log2 e): the normalized P, as cuDNN's graph (no running max here);
* dP = dot(dO8, V8^T) * descale_dO * descale_v; dS = (dP - delta) * P * attn_scale (natural units,
  attn_scale inside dS, not applied at the end as the 16-bit path does); amax_dP = max |dS|, by the dK/dV
  pass (its masked tiles mask rows past len_q and keys past len_kv; its unmasked ones lie inside);
* dK/dV pass: dV += dot(P8^T, dO8) with P8 = fp8(P * scale_s) in q's type; dK += dot(dS8^T, q8) with
  dS8 = fp8(dS * scale_dP) in dO's type (``common.to_fp8``: nearest even, saturating); the group's query
  heads summed, then dV * descale_s * descale_dO and dK * descale_dP * descale_q (matmul_fp8's gqa_c);
* dQ pass: dQ += dot(dS8, k8); dQ * descale_dP * descale_k;
* each gradient: amax of the descaled fp32 tile (rows / keys inside the sequence), then * scale_dX in
  its type (``common.to_out``: FP8 saturating).
All five products are FP8 MMAs on sm_90 with ``max_num_imprecise_acc=FP8_PROMOTE_K`` (the forward's;
the unit ``fusedattn.fp8.MMA_UNIT_FP8`` enters the bound, ``reference_fp8.fp8_backward_bound(mma_unit=)``),
or with ``FP8_MMA16`` fp16 MMAs on the same FP8 values (``common.fp8_dot``: exact conversion, so the same
products and rounding points; the 16-bit tiles and rate, for the shapes where FP8 MMAs do not pay: plan.py).
The products dot(P8^T, dO8), dot(dS8^T, q8) and dot(dS8, k8) sum over the row / key axis, which is not
innermost in dO, q and K: an FP8 wgmma wants both operands K-major, so Triton transposes those tiles on
the way to shared memory (the forward's V, bench/NOTES.md 57); staging transposed copies is the speed step
after the GPU check. Interpreter: ``FP8_INTERP`` as the forward's (``common.to_fp8`` and ``to_out`` round
in fp32 arithmetic first, the interpreter's float8 and bf16 casts being wrong). The 16-bit kernels are the
same code with the FP8 parameters at their defaults (None / False): their PTX is unchanged.
"""
import torch
import triton
import triton.language as tl

from .args import aligned, aligned_output, extras_key, is_plain as _is_plain, kernel_scalars
from .launch import Launcher, cdiv, pow2
from .common import (LOG2E, backward_lse, batch_rows, dropout_keep, fp8_dot, kv_block_range, load_bias, load_tile,
                     q_block_range, scores_base2, softcap_tanh, to_fp8, to_out)
from ...plan import interpreting


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, CU_Q, LSE, SINK, DSINK, stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod, stride_lb, stride_lh, stride_lm,
                         H_Q, S_Q, D_V, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, VARLEN: tl.constexpr,
                         HAS_SINK: tl.constexpr):
    """delta = rowsum(dO * O) for BLOCK_M rows of one (batch, query head). HAS_SINK: also the sink's
    gradient of those rows, -sum exp(sink - lse) * delta (``cpu.sink_grad``), added atomically into
    DSINK[head] (fp32 [H_Q], zeroed by the caller): no launch of its own beside this bandwidth-bound one
    (LSE: the forward's natural-log stats, any strides; SINK fp32 [H_Q])."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    batch = bh // H_Q
    head = (bh % H_Q).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    b_idx, q0, _, _, _, row_end, _, _ = batch_rows(CU_Q, CU_Q, CU_Q, CU_Q, batch, S_Q, S_Q,
                                                   False, False, VARLEN, False)
    o_off = b_idx * stride_ob + q0 * stride_om
    do_off = b_idx * stride_dob + q0 * stride_dom
    o = load_tile(O + o_off + head * stride_oh + rows[:, None] * stride_om + offs_dv[None, :] * stride_od,
                  rows, offs_dv, row_end, D_V, True, True)
    do = load_tile(DO + do_off + head * stride_doh + rows[:, None] * stride_dom
                   + offs_dv[None, :] * stride_dod, rows, offs_dv, row_end, D_V, True, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * S_Q + rows, delta, mask=rows < S_Q)
    if HAS_SINK:
        # the lse includes the sink (lse >= sink), so exp(sink - lse) <= 1 on every row that has it;
        # rows with lse -inf (past seq_len_q) and rows past the tensor give exactly 0 whatever delta
        # holds there (padding rows of dO may hold anything), never exp(+inf) * delta
        lse = tl.load(LSE + b_idx * stride_lb + q0 * stride_lm + head * stride_lh + rows * stride_lm,
                      mask=rows < row_end, other=float("-inf"))
        seen = lse != float("-inf")
        p_sink = tl.exp(tl.where(seen, tl.load(SINK + head) - lse, float("-inf")))
        # one relaxed fp32 atomic per program (the sum's order varies: deterministic=False only)
        tl.atomic_add(DSINK + head, -tl.sum(tl.where(seen, p_sink * delta, 0.0), 0), sem="relaxed")


@triton.jit
def fp8_grad_out(x, row_in, SCALE, AMAX, OUT_TY: tl.constexpr, INTERP: tl.constexpr):
    """One FP8-backward gradient tile (dQ, dK or dV, fp32, already descaled) as stored: its share of the
    gradient's amax (max |x| over rows ``row_in``, before the scale; a float atomic max into AMAX, which the
    host zeroed: every value is >= 0, where the float order is the integer one), then ``x * scale`` in
    OUT_TY (``common.to_out``: float8 saturating)."""
    tl.atomic_max(AMAX, tl.max(tl.max(tl.where(row_in[:, None], tl.abs(x), 0.0), 1), 0))
    return to_out(x * tl.load(SCALE), OUT_TY, INTERP)


@triton.jit
def _attn_bwd_dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, bias_base, dbias_base, slope,
                          offs_n, offs_m0, offs_d, offs_dv, start, end, len_q, len_kv, diag, bh, row_end,
                          stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_bm, stride_bn,
                          S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
                          dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
                          MASKED: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                          HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                          BIAS_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                          WRITE_DBIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          amax_ds=0.0, fp8_scales=None, FP8: tl.constexpr = False, FP8_INTERP: tl.constexpr = False,
                          FP8_MMA16: tl.constexpr = False):
    """Accumulate dK, dV [keys, d] of one key block over query rows [start, end) of one head.

    FP8 (module docstring, [Note] FP8): ``fp8_scales`` = (scale_s, descale_dO, descale_v, attn_scale,
    scale_dP) and ``qk_scale`` holds descale_q * descale_k; ``amax_ds`` (fp32 scalar) is the running
    max |dS|, returned updated (unchanged without FP8)."""
    cols = offs_n[:, None]                                    # key index, tiles are [keys, rows]
    BLOCK_N_KEYS: tl.constexpr = offs_n.shape[0]
    key_start = tl.min(offs_n, 0)                             # first key of the block (a multiple of BLOCK_N)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + offs_m0
        rows = offs_m[None, :]
        q = load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                      offs_m, offs_d, row_end, D, MASKED, not EVEN_D)
        if FP8:
            qk_t = fp8_dot(k, tl.trans(q), None, FP8_MMA16)
        else:
            qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        bias = 0.0
        if BIAS_KIND != 0:
            bias = load_bias(bias_base, rows, cols, stride_bm, stride_bn, S_Q, S_KV, BIAS_KIND)
        s_t = scores_base2(qk_t, bias, slope, rows, cols, len_q, len_kv, diag, win_left, win_right, qk_scale,
                           softcap, MASKED, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI)
        if MASKED:
            lse = tl.load(lse_base + offs_m * stride_lm, mask=offs_m < row_end, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < row_end, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m * stride_lm)
            delta = tl.load(delta_base + offs_m)
        p_t = tl.math.exp2(s_t - (backward_lse(lse) * LOG2E)[None, :])     # empty rows (lse -inf): P = 0
        do = load_tile(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                       offs_m, offs_dv, row_end, D_V, MASKED, not EVEN_DV)
        if FP8:
            scale_s, descale_do, descale_v, attn_scale, scale_dp = fp8_scales
            # cuDNN's order: dP = (dO8 V8^T) * descale_dO * descale_v; dV += P8^T dO8 (descaled at the end);
            # dS = (dP - D) * P * attn_scale, amax_dP = max |dS|; dK += dS8^T q8 with dS8 in dO's type
            dp_t = fp8_dot(v, tl.trans(do), None, FP8_MMA16) * descale_do * descale_v
            dv = fp8_dot(to_fp8(p_t * scale_s, q.dtype, FP8_INTERP), do, dv, FP8_MMA16)
            ds_t = (dp_t - delta[None, :]) * p_t * attn_scale
            amax_ds = tl.maximum(amax_ds, tl.max(tl.max(tl.abs(ds_t), 1), 0))
            dk = fp8_dot(to_fp8(ds_t * scale_dp, do.dtype, FP8_INTERP), q, dk, FP8_MMA16)
        else:
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            if DROPOUT:
                keep = dropout_keep(dropout_seed, dropout_offset, bh, start_m, key_start, S_Q, S_KV, dropout_threshold,
                                    BLOCK_M, BLOCK_N_KEYS, False)
                dv = tl.dot(tl.where(keep, p_t * dropout_rescale, 0.0).to(do.dtype), do, dv,
                            input_precision=DOT_PRECISION)
                dp_t = tl.where(keep, dp_t * dropout_rescale, 0.0)
            else:
                dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])                 # d loss / d logit (natural units)
            if WRITE_DBIAS:
                tl.store(dbias_base + rows * S_KV + cols, ds_t, mask=(rows < S_Q) & (cols < S_KV))
            if SOFTCAP:
                t = softcap_tanh(qk_t, qk_scale)
                ds_t = ds_t * (1.0 - t * t)
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv, amax_ds


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, DBIAS, SEQ_Q, SEQ_KV, BIAS, SLOPES, CU_Q, CU_KV,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   stride_lb, stride_lh, stride_lm,
                   stride_bb, stride_bh, stride_bm, stride_bn, stride_sb,
                   H_Q, H_KV, GROUP, S_Q, S_KV, D, D_V,
                   sm_scale, qk_scale, softcap, win_left, win_right,
                   dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                   BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   HAS_SEQ_Q: tl.constexpr, HAS_SEQ_KV: tl.constexpr,
                   BIAS_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
                   DROPOUT: tl.constexpr, WRITE_DBIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   VARLEN: tl.constexpr, FP8_SCALES=None, AMAX=None, FP8: tl.constexpr = False,
                   FP8_INTERP: tl.constexpr = False, FP8_MMA16: tl.constexpr = False):
    pid_n = tl.program_id(0)
    bhkv = tl.program_id(1)
    batch = bhkv // H_KV
    kv_head = bhkv % H_KV
    start_n = pid_n * BLOCK_N
    b_idx, q0, kv0, len_q, len_kv, row_end, col_end, diag = batch_rows(
        SEQ_Q, SEQ_KV, CU_Q, CU_KV, batch, S_Q, S_KV, HAS_SEQ_Q, HAS_SEQ_KV, VARLEN, BOTTOM_RIGHT)
    b64 = batch.to(tl.int64)
    q_off = b_idx * stride_qb + q0 * stride_qm
    do_off = b_idx * stride_dob + q0 * stride_dom
    l_off = b_idx * stride_lb + q0 * stride_lm
    k_off = b_idx * stride_kb + kv0 * stride_kn
    v_off = b_idx * stride_vb + kv0 * stride_vn
    dk_off = b_idx * stride_dkb + kv0 * stride_dkn
    dv_off = b_idx * stride_dvb + kv0 * stride_dvn

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kvh64 = kv_head.to(tl.int64)
    k = load_tile(K + k_off + kvh64 * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                  offs_n, offs_d, col_end, D, True, not EVEN_D)
    v = load_tile(V + v_off + kvh64 * stride_vh + offs_n[:, None] * stride_vn
                  + offs_dv[None, :] * stride_vd, offs_n, offs_dv, col_end, D_V, True, not EVEN_DV)
    if FP8_MMA16:
        # the program's K and V once as fp16 (exact: common.fp8_dot), not once per query tile
        k, v = k.to(tl.float16), v.to(tl.float16)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = q_block_range(start_n, len_q, len_kv, diag, win_left, win_right,
                                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    amax_ds = tl.zeros([], tl.float32)
    fp8_scales = None
    if FP8:
        # cuDNN's bmm1 scale chain folded into the one score multiply (as the forward)
        qk_scale = qk_scale * tl.load(FP8_SCALES + 0) * tl.load(FP8_SCALES + 1)
        fp8_scales = (tl.load(FP8_SCALES + 7), tl.load(FP8_SCALES + 4), tl.load(FP8_SCALES + 2), sm_scale,
                      tl.load(FP8_SCALES + 11))
    for g in range(0, GROUP):
        head = kv_head * GROUP + g                              # query heads of this kv head's group
        h64 = head.to(tl.int64)
        bh = batch * H_Q + head
        q_base = Q + q_off + h64 * stride_qh
        do_base = DO + do_off + h64 * stride_doh
        lse_base = LSE + l_off + h64 * stride_lh
        delta_base = DELTA + bh.to(tl.int64) * S_Q
        bias_base = BIAS
        if BIAS_KIND != 0:
            bias_base = BIAS + b64 * stride_bb + h64 * stride_bh
        dbias_base = DBIAS
        if WRITE_DBIAS:
            dbias_base = DBIAS + bh.to(tl.int64) * S_Q * S_KV
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(SLOPES + b64 * stride_sb + head) * LOG2E     # [b, h_q]; stride 0 for [h_q]
        dk, dv, amax_ds = _attn_bwd_dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, bias_base, dbias_base, slope,
            offs_n, offs_m0, offs_d, offs_dv, lo, full_lo, len_q, len_kv, diag, bh, row_end,
            stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_bm, stride_bn,
            S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
            dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
            True, BLOCK_M, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI, DROPOUT,
            WRITE_DBIAS, DOT_PRECISION, amax_ds, fp8_scales, FP8, FP8_INTERP, FP8_MMA16)
        dk, dv, amax_ds = _attn_bwd_dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, bias_base, dbias_base, slope,
            offs_n, offs_m0, offs_d, offs_dv, full_lo, full_hi, len_q, len_kv, diag, bh, row_end,
            stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_bm, stride_bn,
            S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
            dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
            False, BLOCK_M, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI, DROPOUT,
            WRITE_DBIAS, DOT_PRECISION, amax_ds, fp8_scales, FP8, FP8_INTERP, FP8_MMA16)
        dk, dv, amax_ds = _attn_bwd_dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, bias_base, dbias_base, slope,
            offs_n, offs_m0, offs_d, offs_dv, full_hi, hi, len_q, len_kv, diag, bh, row_end,
            stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_bm, stride_bn,
            S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
            dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
            True, BLOCK_M, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI, DROPOUT,
            WRITE_DBIAS, DOT_PRECISION, amax_ds, fp8_scales, FP8, FP8_INTERP, FP8_MMA16)
    if FP8:
        # the group's query heads are summed (the loop above) before the descales: matmul_fp8's gqa_c;
        # attn_scale is inside dS already. Keys past the sequence hold 0 (their P is 0).
        key_in = offs_n < col_end
        dk = fp8_grad_out(dk * tl.load(FP8_SCALES + 6) * tl.load(FP8_SCALES + 0), key_in, FP8_SCALES + 9,
                          AMAX + 1, DK.dtype.element_ty, FP8_INTERP)
        dv = fp8_grad_out(dv * tl.load(FP8_SCALES + 5) * tl.load(FP8_SCALES + 4), key_in, FP8_SCALES + 10,
                          AMAX + 2, DV.dtype.element_ty, FP8_INTERP)
        tl.atomic_max(AMAX + 3, amax_ds)
    else:
        dk = dk * sm_scale              # d(scale * q.k) / dk; softcap's tanh' is already in dS
    dk_ptrs = DK + dk_off + kvh64 * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + dv_off + kvh64 * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=(offs_n < col_end)[:, None] & (offs_d < D)[None, :])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=(offs_n < col_end)[:, None] & (offs_dv < D_V)[None, :])


@triton.jit
def _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base, slope,
                        offs_m, offs_n0, offs_d, offs_dv, start, end, len_q, len_kv, diag, bh,
                        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
                        S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
                        dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
                        MASKED: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                        BIAS_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, fp8_scales=None, FP8: tl.constexpr = False,
                        FP8_INTERP: tl.constexpr = False, FP8_MMA16: tl.constexpr = False):
    """Accumulate dQ [rows, d] of one query tile over key blocks [start, end).

    FP8: ``fp8_scales`` = (descale_dO, descale_v, attn_scale, scale_dP); ``qk_scale`` holds descale_q *
    descale_k; dQ accumulates dS8 k8 (descaled by the caller)."""
    rows = offs_m[:, None]
    BLOCK_M_ROWS: tl.constexpr = offs_m.shape[0]
    row0 = tl.min(offs_m, 0)                                  # first row of the tile (a multiple of BLOCK_M)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        cols = offs_n[None, :]
        k = load_tile(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                      offs_n, offs_d, len_kv, D, MASKED, not EVEN_D)
        v = load_tile(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                      offs_n, offs_dv, len_kv, D_V, MASKED, not EVEN_DV)
        if FP8:
            qk = fp8_dot(q, tl.trans(k), None, FP8_MMA16)
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        bias = 0.0
        if BIAS_KIND != 0:
            bias = load_bias(bias_base, rows, cols, stride_bm, stride_bn, S_Q, S_KV, BIAS_KIND)
        s = scores_base2(qk, bias, slope, rows, cols, len_q, len_kv, diag, win_left, win_right, qk_scale,
                         softcap, MASKED, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI)
        p = tl.math.exp2(s - lse2[:, None])
        if FP8:
            descale_do, descale_v, attn_scale, scale_dp = fp8_scales
            # the dK/dV pass's dS (same order), quantized to dO's type with scale_dP
            dp = fp8_dot(do, tl.trans(v), None, FP8_MMA16) * descale_do * descale_v
            ds = (dp - delta[:, None]) * p * attn_scale
            dq = fp8_dot(to_fp8(ds * scale_dp, do.dtype, FP8_INTERP), k, dq, FP8_MMA16)
        else:
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            if DROPOUT:
                keep = dropout_keep(dropout_seed, dropout_offset, bh, row0, start_n, S_Q, S_KV, dropout_threshold,
                                    BLOCK_M_ROWS, BLOCK_N, True)
                dp = tl.where(keep, dp * dropout_rescale, 0.0)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                t = softcap_tanh(qk, qk_scale)
                ds = ds * (1.0 - t * t)
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, O, DO, LSE, DELTA, DQ, SEQ_Q, SEQ_KV, BIAS, SLOPES, CU_Q, CU_KV,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_ob, stride_oh, stride_om, stride_od,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 stride_lb, stride_lh, stride_lm,
                 stride_bb, stride_bh, stride_bm, stride_bn, stride_sb,
                 H_Q, GROUP, S_Q, S_KV, D, D_V,
                 sm_scale, qk_scale, softcap, win_left, win_right,
                 dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                 BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 HAS_SEQ_Q: tl.constexpr, HAS_SEQ_KV: tl.constexpr,
                 BIAS_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
                 DROPOUT: tl.constexpr, REVERSE_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 VARLEN: tl.constexpr, WRITE_DELTA: tl.constexpr, FP8_SCALES=None, AMAX=None,
                 FP8: tl.constexpr = False, FP8_INTERP: tl.constexpr = False, FP8_MMA16: tl.constexpr = False):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    batch = bh // H_Q
    head = bh % H_Q
    kv_head = head // GROUP
    start_m = pid_m * BLOCK_M
    b_idx, q0, kv0, len_q, len_kv, row_end, _, diag = batch_rows(
        SEQ_Q, SEQ_KV, CU_Q, CU_KV, batch, S_Q, S_KV, HAS_SEQ_Q, HAS_SEQ_KV, VARLEN, BOTTOM_RIGHT)
    b64 = batch.to(tl.int64)
    q_off = b_idx * stride_qb + q0 * stride_qm
    do_off = b_idx * stride_dob + q0 * stride_dom
    dq_off = b_idx * stride_dqb + q0 * stride_dqm
    l_off = b_idx * stride_lb + q0 * stride_lm
    k_off = b_idx * stride_kb + kv0 * stride_kn
    v_off = b_idx * stride_vb + kv0 * stride_vn

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    h64 = head.to(tl.int64)
    kvh64 = kv_head.to(tl.int64)
    q = load_tile(Q + q_off + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                  offs_m, offs_d, row_end, D, True, not EVEN_D)
    if FP8_MMA16:
        q = q.to(tl.float16)        # once per program (exact: common.fp8_dot); dO keeps its type, dS8's
    do = load_tile(DO + do_off + h64 * stride_doh + offs_m[:, None] * stride_dom
                   + offs_dv[None, :] * stride_dod, offs_m, offs_dv, row_end, D_V, True, not EVEN_DV)
    # rows that saw no key (lse -inf) read +inf: their P is exactly 0 (common.backward_lse)
    lse2 = backward_lse(tl.load(LSE + l_off + h64 * stride_lh + offs_m * stride_lm, mask=offs_m < row_end,
                                other=0.0)) * LOG2E
    delta_ptrs = DELTA + bh.to(tl.int64) * S_Q + offs_m
    if WRITE_DELTA:
        # this pass runs first and computes delta = rowsum(dO * O) for its rows (the dK/dV pass reads
        # it): one launch and one read of dO fewer than a separate preprocess kernel
        o = load_tile(O + b_idx * stride_ob + q0 * stride_om + h64 * stride_oh + offs_m[:, None] * stride_om
                      + offs_dv[None, :] * stride_od, offs_m, offs_dv, row_end, D_V, True, not EVEN_DV)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        if FP8:
            delta = delta * tl.load(FP8_SCALES + 4) * tl.load(FP8_SCALES + 3)     # D's descale_dO, descale_o
        tl.store(delta_ptrs, delta, mask=offs_m < S_Q)
    else:
        delta = tl.load(delta_ptrs, mask=offs_m < row_end, other=0.0)
    k_base = K + k_off + kvh64 * stride_kh
    v_base = V + v_off + kvh64 * stride_vh
    bias_base = BIAS
    if BIAS_KIND != 0:
        bias_base = BIAS + b64 * stride_bb + h64 * stride_bh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b64 * stride_sb + head) * LOG2E         # [b, h_q]; stride 0 for [h_q]

    fp8_scales = None
    if FP8:
        qk_scale = qk_scale * tl.load(FP8_SCALES + 0) * tl.load(FP8_SCALES + 1)
        fp8_scales = (tl.load(FP8_SCALES + 4), tl.load(FP8_SCALES + 2), sm_scale, tl.load(FP8_SCALES + 11))
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full_lo, full_hi, hi = kv_block_range(start_m, len_q, len_kv, diag, win_left, win_right,
                                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base, slope,
                             offs_m, offs_n0, offs_d, offs_dv, lo, full_lo, len_q, len_kv, diag, bh,
                             stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
                             S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
                             dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
                             True, BLOCK_N, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI,
                             DROPOUT, DOT_PRECISION, fp8_scales, FP8, FP8_INTERP, FP8_MMA16)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base, slope,
                             offs_m, offs_n0, offs_d, offs_dv, full_lo, full_hi, len_q, len_kv, diag, bh,
                             stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
                             S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
                             dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
                             False, BLOCK_N, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI,
                             DROPOUT, DOT_PRECISION, fp8_scales, FP8, FP8_INTERP, FP8_MMA16)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base, slope,
                             offs_m, offs_n0, offs_d, offs_dv, full_hi, hi, len_q, len_kv, diag, bh,
                             stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
                             S_Q, S_KV, D, D_V, qk_scale, softcap, win_left, win_right,
                             dropout_seed, dropout_offset, dropout_threshold, dropout_rescale,
                             True, BLOCK_N, EVEN_D, EVEN_DV, HAS_LEFT, HAS_RIGHT, SOFTCAP, BIAS_KIND, HAS_ALIBI,
                             DROPOUT, DOT_PRECISION, fp8_scales, FP8, FP8_INTERP, FP8_MMA16)
    # rows past the sequence get no gradient (their unmasked full blocks computed garbage)
    if FP8:
        # dQ = (dS8 k8) * descale_dP * descale_k (attn_scale is inside dS); amax, then scale_dQ
        row_in = offs_m < len_q
        dq = tl.where(row_in[:, None], dq * tl.load(FP8_SCALES + 6) * tl.load(FP8_SCALES + 1), 0.0)
        dq = fp8_grad_out(dq, row_in, FP8_SCALES + 8, AMAX + 0, DQ.dtype.element_ty, FP8_INTERP)
    else:
        dq = tl.where((offs_m < len_q)[:, None], dq * sm_scale, 0.0)
    dq_ptrs = DQ + dq_off + h64 * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(offs_m < row_end)[:, None] & (offs_d < D)[None, :])


_PREPROCESS, _DKDV, _DQ = Launcher(_attn_bwd_preprocess), Launcher(_attn_bwd_dkdv), Launcher(_attn_bwd_dq)


def launch_delta(p, out, grad_out, delta, *, lse=None, sink=None, dsink=None):
    """delta = rowsum(dO * O) into fp32 contiguous [b*h_q, s_q] (plain problems: no varlen).

    dsink given (with lse, the forward's natural-log stats fp32 [b, h_q, s_q] view of any strides, and
    sink, fp32 contiguous [h_q]): the sink's gradient -sum_rows exp(sink - lse) * delta is added into
    dsink (fp32 contiguous [h_q], zeroed by the caller) by the same launch, with atomics (not bitwise
    reproducible: the deterministic backward keeps ``cpu.sink_grad``)."""
    block_m = 64
    has_sink = dsink is not None
    if has_sink:
        assert lse.dtype == sink.dtype == dsink.dtype == torch.float32 and sink.is_contiguous() \
            and dsink.is_contiguous() and sink.numel() == dsink.numel() == p.h_q
        lse_strides = lse.stride()
    else:
        lse = sink = dsink = delta
        lse_strides = (0, 0, 0)
    # the launch key: everything the JIT specializes on (launch.py's contract), and nothing that changes from
    # call to call: the integers the kernel takes, not the problem, whose dropout seed is new on every training
    # step (bench/NOTES.md 89); delta is fresh (aligned); with the sink, lse's strides and the three fp32
    # pointers' alignment
    key = (out.dtype, grad_out.dtype, p.h_q, p.s_q, p.d_v, out.stride(), grad_out.stride(),
           out.data_ptr() % 16 == 0, grad_out.data_ptr() % 16 == 0,
           has_sink and (lse_strides, lse.data_ptr() % 16 == 0, sink.data_ptr() % 16 == 0, dsink.data_ptr() % 16 == 0))
    _PREPROCESS(key, (cdiv(p.s_q, block_m), p.b * p.h_q),
                out, grad_out, delta, out, lse, sink, dsink, *out.stride(), *grad_out.stride(), *lse_strides,
                p.h_q, p.s_q, p.d_v, BLOCK_M=block_m, BLOCK_DV=pow2(p.d_v), VARLEN=False, HAS_SINK=has_sink)


_PLAIN_ARGS = {}   # plain problems: (problem, tiles, strides) -> per kernel (grid, non-tensor args, constexprs)


def launch_bwd(problem, plan, q, k, v, out, grad_out, lse, extras, dq, dk, dv, need_dbias, delta=None,
               delta_out=None):
    """Launch the dQ pass (which also writes delta) and then the dK/dV pass. Returns the full fp32
    dBias [b,h_q,s_q,s_kv] or None.

    delta: fp32 contiguous [b*h_q, s_q] holding rowsum(dO * O) when dQ is already done (by the Gluon
    dQ pass): only the dK/dV pass runs, reading it (dq is then not touched). delta_out: fp32 contiguous
    [b*h_q, s_q] for the dQ pass to write delta into, for the caller to read afterwards (the sink's
    gradient); a sink needs nothing else here, since the forward's lse already includes it."""
    p = problem
    plain_key = None
    if (delta is None and delta_out is None and _is_plain(p) and not need_dbias
            and all(t.data_ptr() % 16 == 0 for t in (q, k, v, out, grad_out, lse, dq, dk, dv))):
        # the common call: every argument but the tensors is remembered (as fwd._PLAIN_ARGS)
        plain_key = (p, plan.bwd, plan.bwd_dq, q.stride(), k.stride(), v.stride(), out.stride(), grad_out.stride(),
                     lse.stride(), dq.stride(), dk.stride(), dv.stride())
        hit = _PLAIN_ARGS.get(plain_key)
        if hit is not None:
            dq_pass, dkdv = hit
            delta = torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=q.device)
            _DQ(plain_key, dq_pass[0], q, k, v, out, grad_out, lse, delta, dq, q, q, q, q, q, q,
                *dq_pass[1], **dq_pass[2])
            _DKDV(plain_key, dkdv[0], q, k, v, grad_out, lse, delta, dk, dv, delta, q, q, q, q, q, q,
                  *dkdv[1], **dkdv[2])
            return None
    q, k, v, out, grad_out, lse = (aligned(t) for t in (q, k, v, out, grad_out, lse))
    (dq, dq_target), (dk, dk_target), (dv, dv_target) = (aligned_output(t) for t in (dq, dk, dv))
    if delta is not None:
        dq_target = None     # dQ is the caller's, done: nothing to copy back over it
    args = kernel_scalars(p, extras, q)
    sw = args["switches"]
    bias = aligned(extras["bias"])
    bias_strides = bias.stride() if bias is not None else (0, 0, 0, 0)
    if bias is not None and bias.dtype == torch.bool:
        bias = bias.view(torch.uint8)
    bias_arg = bias if bias is not None else q
    block_d, block_dv = args["block_d"], args["block_dv"]

    passes = ((_DQ, "dq"), (_DKDV, "dkdv"))
    if delta is None:
        delta = delta_out if delta_out is not None else torch.empty(
            (p.b * p.h_q, p.s_q), dtype=torch.float32, device=q.device)
    else:
        passes = passes[1:]
    cu_q, cu_kv = (extras["cu_seqlens_q"], extras["cu_seqlens_kv"]) if p.varlen else (q, q)
    # what every non-tensor argument and tensor dtype/alignment depends on (launch.py); no key with
    # dropout (per-call seeds)
    key = plain_key or (None if p.has_dropout else (
        p, q.stride(), k.stride(), v.stride(), out.stride(), grad_out.stride(), lse.stride(), dq.stride(),
        dk.stride(), dv.stride(), bias_strides, need_dbias, extras_key(extras)))

    dbias = torch.zeros((p.b, p.h_q, p.s_q, p.s_kv), dtype=torch.float32, device=q.device) if need_dbias else None
    common = (p.scale, args["qk_scale"], p.softcap, args["win_left"], args["win_right"],
              p.dropout_seed, p.dropout_offset, args["dropout_threshold"], args["dropout_rescale"])
    t = plan.bwd
    dkdv = ((cdiv(p.s_kv, t.block_n), p.b * p.h_kv),
            (q, k, v, grad_out, lse, delta, dk, dv, dbias if dbias is not None else delta,
             args["seq_q"], args["seq_kv"], bias_arg, args["slopes"], cu_q, cu_kv,
             *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
             *lse.stride(), *bias_strides, args["stride_sb"],
             p.h_q, p.h_kv, p.group, p.s_q, p.s_kv, p.d, p.d_v, *common),
            dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                 WRITE_DBIAS=dbias is not None, VARLEN=p.varlen, num_warps=t.num_warps, num_stages=t.num_stages,
                 **sw))
    t = plan.bwd_dq
    dq_pass = ((cdiv(p.s_q, t.block_m), p.b * p.h_q),
               (q, k, v, out, grad_out, lse, delta, dq, args["seq_q"], args["seq_kv"], bias_arg, args["slopes"], cu_q,
                cu_kv, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *grad_out.stride(), *dq.stride(),
                *lse.stride(), *bias_strides, args["stride_sb"],
                p.h_q, p.group, p.s_q, p.s_kv, p.d, p.d_v, *common),
               dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                    REVERSE_M=args["causal_like"], VARLEN=p.varlen, WRITE_DELTA=True, num_warps=t.num_warps,
                    num_stages=t.num_stages, **sw))
    if plain_key is not None:
        if len(_PLAIN_ARGS) >= 512:
            _PLAIN_ARGS.clear()
        _PLAIN_ARGS[plain_key] = tuple((grid, pos[n:], kw) for (grid, pos, kw), n in ((dq_pass, 14), (dkdv, 15)))
    # the dQ pass first: it writes delta, which the dK/dV pass reads
    launches = {"dq": dq_pass, "dkdv": dkdv}
    for launcher, name in passes:
        grid, pos, kw = launches[name]
        launcher(key, grid, *pos, **kw)
    for buf, target in ((dq, dq_target), (dk, dk_target), (dv, dv_target)):
        if target is not None:
            target.copy_(buf)
    return dbias


# FP8_SCALES: the backward's twelve scales in one fp32 buffer, in this order (the kernels index it)
FP8_BWD_SCALE_NAMES = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                       "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
FP8_BWD_AMAX_NAMES = ("dQ", "dK", "dV", "dP")


def launch_bwd_fp8(problem, tiles_dkdv, tiles_dq, q8, k8, v8, out, grad_out, lse, extras, scales, amax, dq, dk, dv,
                   mma16=False):
    """The FP8 backward (module docstring, [Note] FP8): the dQ pass (which writes delta) and the dK/dV pass.

    q8 [b,h_q,s_q,d], k8 [b,h_kv,s_kv,d], v8 [b,h_kv,s_kv,d_v]: one float8 type; grad_out (dO) float8 (e4m3 or
    e5m2) and out (o) float8 or any float, [b,h_q,s_q,d_v]; any strides. lse: fp32 [b,h_q,s_q] view (the
    forward's natural-log stats). scales: fp32 contiguous [12] on the device, :data:`FP8_BWD_SCALE_NAMES`'
    order (read by the kernels: CUDA graphs replay new values). amax: fp32 contiguous [4] (dQ, dK, dV, dP),
    zeroed by the caller, maxed into. dq / dk / dv: outputs (float8 / bf16 / fp16 / fp32), any strides.
    problem: shapes and the mask (masks, padding and GQA only; fusedattn.fp8 routes the rest to its
    emulation). mma16: the products as fp16 MMAs on the FP8 values (``common.fp8_dot``). Always through the
    JIT's dispatch (key None), as ``fwd.launch_fwd_fp8``.
    """
    from .fwd import fp8_block_dim
    p = problem
    q8, k8, v8, out, grad_out, lse = (aligned(t) for t in (q8, k8, v8, out, grad_out, lse))
    (dq, dq_target), (dk, dk_target), (dv, dv_target) = (aligned_output(t) for t in (dq, dk, dv))
    args = kernel_scalars(p, extras, q8)
    block_d, block_dv = fp8_block_dim(p.d), fp8_block_dim(p.d_v)
    switches = dict(args["switches"], EVEN_D=block_d == p.d, EVEN_DV=block_dv == p.d_v)
    delta = torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=q8.device)
    no_bias, no_slopes = (0, 0, 0, 0), 0
    common = (p.scale, args["qk_scale"], 0.0, args["win_left"], args["win_right"], 0, 0, 0, 1.0)
    fp8_kw = dict(FP8_SCALES=scales, AMAX=amax, FP8=True, FP8_INTERP=interpreting(), FP8_MMA16=bool(mma16))
    t = tiles_dq
    _DQ(None, (cdiv(p.s_q, t.block_m), p.b * p.h_q),
        q8, k8, v8, out, grad_out, lse, delta, dq, args["seq_q"], args["seq_kv"], q8, args["slopes"], q8, q8,
        *q8.stride(), *k8.stride(), *v8.stride(), *out.stride(), *grad_out.stride(), *dq.stride(), *lse.stride(),
        *no_bias, no_slopes, p.h_q, p.group, p.s_q, p.s_kv, p.d, p.d_v, *common,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, REVERSE_M=args["causal_like"],
        VARLEN=False, WRITE_DELTA=True, num_warps=t.num_warps, num_stages=t.num_stages, **fp8_kw, **switches)
    t = tiles_dkdv
    _DKDV(None, (cdiv(p.s_kv, t.block_n), p.b * p.h_kv),
          q8, k8, v8, grad_out, lse, delta, dk, dv, delta, args["seq_q"], args["seq_kv"], q8, args["slopes"], q8, q8,
          *q8.stride(), *k8.stride(), *v8.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(), *lse.stride(),
          *no_bias, no_slopes, p.h_q, p.h_kv, p.group, p.s_q, p.s_kv, p.d, p.d_v, *common,
          BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, WRITE_DBIAS=False,
          VARLEN=False, num_warps=t.num_warps, num_stages=t.num_stages, **fp8_kw, **switches)
    for buf, target in ((dq, dq_target), (dk, dk_target), (dv, dv_target)):
        if target is not None:
            target.copy_(buf)
