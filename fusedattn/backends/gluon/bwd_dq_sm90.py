"""Attention backward, dQ pass, for Hopper (sm_90) in Gluon: warp specialized, deterministic.

dQ_i = scale * sum_j dS_ij K_j with dS = P * (dP - delta), P = exp2(S * qk_scale - lse * log2 e),
S = Q K^T, dP = dO V^T (notation of fusedattn/backends/triton/bwd.py). Like the forward
(fwd_sm90.py), query rows stay put and K/V stream, so the structure is the forward's:

* one program (CTA) owns query rows [start_m, start_m + 128) of one (batch, query head), key/value
  head ``head // GROUP``; every dQ element has exactly one writer (no atomics: bitwise
  reproducible).
* producer (1 warp, 24 registers): TMA loads Q and dO once (two 64-row halves each, one per
  consumer warpgroup, one mbarrier per half), then K_j and V_j through rings of STAGES slots with
  separate ready/empty mbarriers.
* two consumer warpgroups (4 warps, 240 registers each via setmaxnreg): warpgroup WG owns rows
  [start_m + 64 WG, +64); it loads its lse (natural log, as the forward writes it) and delta
  rows once into registers, runs the whole key loop on its own and stores its dQ half.

Inside a consumer warpgroup, tile j's loop body (j >= 1):

    wait K_j, V_j ready;  S_j = Q K_j^T,  dP_j = dO V_j^T   (async wgmmas, operands in shared memory)
                          dQ += dS_{j-1} K_{j-1}           (async wgmma, dS from registers)
    wait until one wgmma is in flight (S_j and dP_j done); release V_j
    P_j = exp2(S_j * qk_scale - lse2), dS_j = P_j * (dP_j - delta)   (under the dQ wgmma)
    store rowsum(dS_j) to a small shared slot (pins the elementwise work before the wait below)
    wait for the dQ wgmma; release K_{j-1}
    dS_j -> 16-bit A-operand registers (no data movement, as P in the forward)

so the exponentials and the dS arithmetic of tile j hide under the dQ product of tile j-1, and
the two warpgroups drift freely so one's elementwise work overlaps the other's S/dP products.
A K slot is held across two iterations (QK^T of tile j, dQ product in iteration j+1), a V slot
for one: the K ring decides how far ahead the producer runs.

[Note] pinning (same lesson as the forward, module docstring of fwd_sm90): ptxas places the
wgmma waits, not the program order, and hoists a wait above ALU work that does not depend on
it. A shared-memory store of a value that depends on every dS of the tile keeps the
exponentials and the dS arithmetic between the two waits (tools/gluon_dq_check.py counts the
MUFU.EX2 between ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` and ``0x0`` in each loop of the SASS).

Masking: the forward's key tiles (``fwd_sm90._kv_range``): the CTA visits [t_lo, t_hi); the
first (the prologue), the band's left edge [t_lo + 1, t_a) and its right edge and the tail past
s_kv [t_b, t_hi) set P = 0 where row i must not see key j (causal, sliding windows of either
alignment); [t_a, t_b) skips the mask, and tiles outside the band are never loaded. ALiBi
(slope * (j - i), slopes from an [h_q] tensor): the column half slope * (j - row0) is added to
the scaled scores, the row half is folded into the row's lse once (as the forward takes it out of
the LSE). Rows
past s_q: TMA zero-fills Q and dO, lse and delta load as 0, so dS = 1 * (0 - 0) = 0; their dQ
rows are clipped by the TMA store. Rows with no visible key (causal bottom-right, s_q > s_kv, rows
past len_q): the forward wrote lse -inf, read here as +inf, so P = exp2(x - inf) = 0 whether a key is
masked or not (never -inf - -inf = NaN) and dQ = 0.

Order (causal-like bands: a right bound and no left one, either alignment): a CTA's work grows with
its query block, so the longest rows start first (REVERSE_M, as the forward), and with ``HEAVY_FIRST``
over the whole grid, not only inside one (batch, head): the linear program id is cut into chunks of
``_chunk`` (batch, head) pairs (about one wave of CTAs, one per SM), query block outermost inside a
chunk (``_heavy_first``, shared with the single-pass backward's ``HEAVY_FIRST``; the forward's
persistent order, ``fwd_sm90._work_tile``, is the same), so every long CTA of a chunk is dispatched
before any shorter one while the CTAs in flight share a few heads' K/V in L2. In the grid's own order
the heads run one after another and the last wave mixes long and short CTAs: 7.8% of SM time idle
at the end at 2k causal (H100, bench/BWD_PROFILE.md 7.2); a list-scheduling model of 132 SMs (CTA
time ~ its key tiles) gives 6.5% for the grid's order and 1.6% for this one (b4 h32 s2048). The map
is a permutation of the (query block, batch x head) pairs and every dQ element keeps its one writer,
so results are bitwise the same in either order.

Shared memory (d=128, BLOCK_N=64, STAGES=3): Q 32 KB + dO 32 KB + K 3 x 16 KB + V 3 x 16 KB =
160 KB. Registers per consumer thread: dQ [64, 128] fp32 64, S and dP [64, 64] fp32 32 each, dS
16-bit 16 (two sets while the dQ product runs). The dQ epilogue goes through the warpgroup's own
Q half (free once its last QK^T is done) and a TMA store that clips rows >= s_q.

Inputs are logical [b, h, s, d] views with any strides whose last is 1 (TMA rules: 16-byte aligned
base and strides, ``fwd_sm90._tma_ready``); lse fp32 [b, h_q, s_q] with any strides; delta fp32
contiguous [b * h_q, s_q].

delta: read from the caller's buffer, or (``launch_dq_sm90(..., out=O)``, ``WRITE_DELTA``) computed
here as rowsum(dO * O) and written into it, like the Triton dQ pass since it runs first and feeds
the dK/dV pass (one launch fewer). Each warpgroup reads its 64 O rows once with plain 16-byte
loads (issued before the Q/dO barrier wait) and its dO rows from the shared-memory tile. With
padding a CTA with no key tile to visit never loads dO: it writes delta = 0 (its rows' outputs are
0); rows past len_q get rowsum(dO * O) of whatever the padding holds, as the separate delta pass
gives them (the dK/dV pass never uses them). With a learnable sink (``HAS_SINK``, only beside
WRITE_DELTA) each warpgroup also adds its rows' share of the sink's gradient, -sum exp(sink - lse) *
delta (rows with lse -inf give 0), into an fp32 [h_q] buffer with one atomic: the sink then costs no
launch of its own (issue 26; the deterministic backward computes it with torch instead).

[Note] FP8 (``FP8_EMU``; ``launch_dq_sm90(fp8=...)``, the dQ half of ``bwd_dkdv_sm90.launch_bwd_fp8``, d = 224 /
256): the FP8 backward's dQ with the emulation's rounding points (``bwd_fused_sm90`` [Note] FP8) on fp16 wgmmas of
the FP8 values: the descales in qk_scale, dS * scale_dP = P (dP_raw a - delta_raw b) (a = descale_dO descale_v scale
scale_dP, b = descale_dO descale_o scale scale_dP; delta the raw rowsum(dO8 o), which this pass writes from the
forward's output in any type), dS8 = fp8(.) in dO's type held in fp16 as the dQ wgmma's operand; the epilogue
scales dQ by descale_dP descale_k, maxes it over rows < s_q into amax_dQ and stores it times scale_dQ in its own
type from registers (``_fp8_grad_write``). Masks and windows as the 16-bit pass; no ALiBi, dropout, sink or
lengths. The 16-bit builds' SASS is unchanged. No-GPU compile (Triton 3.6.0, d256 causal): no spills, loops 296-359
SASS instructions against 290-353.

Variants (constexpr / keyword, for tuning): ``SPLIT`` waits for S_j alone first and computes P_j
under dP_j and the dQ product (a second pin keeps the exponentials there), then waits for dP_j;
``stages``; ``block_n`` (d=64 compiles at BLOCK_N=128 with no spills: S, dP 64 registers each, dQ
32; d=128 at BLOCK_N=128 spills 488 bytes: dQ 64 + S 64 + dP 64 + two dS sets 64 > 240).

[Note] status and measurements (keep current). No-GPU compile (tools/gluon_dq_check.py, Triton 3.6,
sm_90a): 0 spills at d 64/128, fp16/bf16, causal or not, SPLIT on or off; each consumer loop holds
its 32 MUFU.EX2 before the dQ wait (plain: all after the S/dP wait ``0x1``; SPLIT: all after the S
wait ``0x2``); mask-free loop body 295 SASS instructions at d128 bf16 (62 FFMA, 36 FADD, 32 FMUL,
32 EX2, 16 F2FP, 4 SHFL for the pin's row sum, 2 STS), masked 434; shared memory 165 KB (d128,
3 stages) / 99 KB (d64, 4 stages). H100 (session 4): bench/gluon_dq_sweep.py --variants: 1.12-1.26x
the Triton dQ pass at d128, 0.90-0.92x at d64 (bench/GLUON_NOTES.md "Backward dQ"), so plan.py routes
d128 and not d64. Session 5: d 224/256 on 32-key tiles, 2 stages (168 registers, no spills, 198 KB
shared memory; 64-key tiles leave room for one stage only), windows and ALiBi (d128 causal mask-free
loop 296 instructions, with ALiBi 360); the 232 GPU tests of tests/test_gluon_bwd_dq.py and
tests/test_launch.py pass. Whole backward (this pass + the Triton dK/dV pass), bench on the H100:
d224 137 -> 170 TFLOP/s, d256 causal 158 -> 198, ALiBi 323 -> 354, window 327 -> 343.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..compat import tma_load, tma_store
from .fwd_sm90 import (LOG2E, LOG2E_C, TILE_D, _alibi_cols, _alibi_slope2, _band_keep, _cta_tiles, _fwd_problem_ok,
                       _is_sm90, _kv_ring_loads, _kv_view, _lengths_ok, _seq_length, _slopes_ok, _sm_count, _tma,
                       _store_as, _tma_ready, _zero_landed_rows)
from . import dropout
from ..triton.launch import cdiv
from .launch import launch

WG_M = 64           # query rows per consumer warpgroup
BLOCK_M = 2 * WG_M  # query rows per CTA
# tile width -> (BLOCK_N, STAGES). d=128: Q+dO 64 KB + STAGES * (K+V) 32 KB; d=64: 32 KB + STAGES * 16 KB;
# d=256 (and 224 on 256-wide tiles): Q+dO 128 KB + STAGES * (K+V) 32 KB at 32-key tiles (64-key tiles
# fit only one stage), registers dQ 128 + S, dP 16 each + dS 8 (x2): 168, no spills.
TILES = {64: (64, 4), 128: (64, 3), 256: (32, 2)}
SUPPORTED_DIMS = (64, 128, 224, 256)
# tile width -> wait for S and dP separately (``_dq_step``)
SPLIT = {64: False, 128: False, 256: False}
# causal-like band (right bound, no left) -> program ids in longest-first order over the whole grid, in chunks of
# about one wave (``_chunk``, ``_heavy_first``; module docstring, "Order"); off: the grid's own order
HEAVY_FIRST = {False: False, True: True}
CONSUMER_REGS = 240
PRODUCER_REGS = 24


@gluon.jit
def _heavy_first(lin, n_blocks, CHUNK):
    """Linear program id lin = program_id(0) + program_id(1) * n_blocks -> (block index, pair) in the
    heavy-first order of the backward kernels (``HEAVY_FIRST`` here, in ``bwd_dkdv_sm90`` and in
    ``bwd_fused_sm90``): the pairs (program_id(1): batch x head) in chunks of CHUNK (the last one may be
    smaller), and inside a chunk the block index is the slow index, the pair the fast one, so block 0 of
    every pair of a chunk is dispatched before any block 1. The caller maps block index 0 to its longest
    CTA (the dK/dV key block 0; the dQ pass's last query block). A permutation of the grid; CHUNK = 1 is
    the grid's own order. (``fwd_sm90._work_tile`` is the same order for the forward's persistent grid.)"""
    c0 = lin // (CHUNK * n_blocks) * CHUNK
    cnt = gl.minimum(CHUNK, gl.num_programs(1) - c0)
    r = lin - c0 * n_blocks
    return r // cnt, c0 + r % cnt


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem0, q_smem1, do_smem0, do_smem1, k_smem, v_smem, q_bar,
                 k_ready, k_empty, v_ready, v_empty, batch, head, kv_head, start_m, t_lo, n_tiles,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PADDED: gl.constexpr):
    """Load warp: Q and dO halves once, then K and V of key tile t_lo + j into slot j % STAGES once
    freed. Padded: a CTA with n_tiles = 0 loads nothing."""
    WG_M: gl.constexpr = q_desc.block_type.shape[2]
    nbytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    load_q = True
    if PADDED:
        load_q = n_tiles > 0
    if load_q:
        mbarrier.expect(q_bar.index(0), nbytes)
        tma_load(q_desc, [batch, head, start_m, 0], q_bar.index(0), q_smem0)
        tma_load(do_desc, [batch, head, start_m, 0], q_bar.index(0), do_smem0)
        mbarrier.expect(q_bar.index(1), nbytes)
        tma_load(q_desc, [batch, head, start_m + WG_M, 0], q_bar.index(1), q_smem1)
        tma_load(do_desc, [batch, head, start_m + WG_M, 0], q_bar.index(1), do_smem1)
    _kv_ring_loads(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, batch, kv_head, t_lo, n_tiles,
                   BLOCK_N, STAGES)


@gluon.jit
def _fp8_round16(x, E5M2: gl.constexpr):
    """fp32 ``x`` rounded to the nearest FP8 value (e4m3, or e5m2 where E5M2; nearest even, saturating: the
    semantics' ``fp8.quantize``), as fp16, where every FP8 value is exact ([Note] FP8: the 16-bit MMAs take it):
    two conversions per pair of values."""
    if E5M2:
        y = gl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e5m2x2.f32 t, $2, $1; cvt.rn.f16x2.e5m2x2 $0, t; }", "=r,r,r", [x],
            dtype=gl.float16, is_pure=True, pack=2)
    else:
        y = gl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $2, $1; cvt.rn.f16x2.e4m3x2 $0, t; }", "=r,r,r", [x],
            dtype=gl.float16, is_pure=True, pack=2)
    return y


@gluon.jit
def _fp8_grad_write(x, key0, S_KV, grad_out, batch, kv_head, SCALE, AMAX, D: gl.constexpr = 0):
    """An FP8 backward's dK or dV tile (fp32 [64 keys, d] registers, descaled) as the portable kernel's
    ``fp8_grad_out``: max |x| over keys < S_KV into AMAX (a float atomic max; every value >= 0, where the float
    order is the integer one; the host zeroed it), then x * SCALE in the output's type (FP8 saturating) by
    masked stores. Keys [key0, key0 + 64); grad_out = (pointer, batch, head and key strides); the head dim is
    unit-stride. D: the output's head dim where it is narrower than the tile (d = 224 on 256-wide tiles: the
    columns past it hold zeros, products of TMA's zero fill), 0 where it is the tile's. The same for a dQ tile
    (rows for keys, S_Q for S_KV, the query head for kv_head: ``bwd_dq_sm90`` [Note] FP8)."""
    layout: gl.constexpr = x.type.layout
    WG_N: gl.constexpr = x.shape[0]
    HEAD_D: gl.constexpr = x.shape[1]
    OUT, stride_b, stride_h, stride_m = grad_out
    keys = key0 + gl.arange(0, WG_N, layout=gl.SliceLayout(1, layout))
    key_in = keys < S_KV
    gl.atomic_max(AMAX, gl.max(gl.max(gl.where(key_in[:, None], gl.abs(x), 0.0), 1), 0))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    base = OUT + batch.to(gl.int64) * stride_b + kv_head.to(gl.int64) * stride_h
    ptrs = base + keys.to(gl.int64)[:, None] * stride_m + cols[None, :]
    if D:
        _store_as(ptrs, x * gl.load(SCALE), key_in[:, None] & (cols < D)[None, :])
    else:
        _store_as(ptrs, x * gl.load(SCALE), key_in[:, None])


@gluon.jit
def _fp8_ds_factors(SCALES, qk_scale, sm_scale):
    """The FP8 backward's factors on the raw products ([Note] FP8; SCALES in ``triton.bwd.FP8_BWD_SCALE_NAMES``'
    order): (qk_scale * descale_q * descale_k, a, b) with dS * scale_dP = P (dP_raw a - delta_raw b),
    a = descale_dO descale_v scale scale_dP, b = descale_dO descale_o scale scale_dP (P normalized, unscaled)."""
    ds_unit = gl.load(SCALES + 4) * sm_scale * gl.load(SCALES + 11)
    return (qk_scale * gl.load(SCALES) * gl.load(SCALES + 1), ds_unit * gl.load(SCALES + 2),
            ds_unit * gl.load(SCALES + 3))


@gluon.jit
def _p_tile(s, qk_scale, lse2, rows, n0, band, slope2, row0, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
            HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """P = exp2(S * qk_scale [+ ALiBi] - lse2) for the key tile at n0, 0 where row i must not see key j.

    band = (S_KV, diag, win_left, win_right): row i keeps key j iff j < S_KV and (HAS_LEFT)
    j >= i + diag - win_left and (HAS_RIGHT) j <= i + diag + win_right, as in the forward.
    ALiBi: slope2 * (j - row0) here (the forward's column half, ``fwd_sm90._softmax_tile``); the row
    half -slope2 * (i - row0) was folded into lse2 by the consumer."""
    x = s * qk_scale - lse2[:, None]
    if HAS_ALIBI:
        x = x + (_alibi_cols(slope2, s) + slope2 * (n0 - row0).to(gl.float32))[None, :]
    if MASKED:
        S_KV, diag, win_left, win_right = band
        BLOCK_N: gl.constexpr = s.shape[1]
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        keep = _band_keep(rows[:, None], cols[None, :], S_KV, diag, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        x = gl.where(keep, x, float("-inf"))
    return gl.exp2(x)


@gluon.jit
def _drop_dp(dp, drop, row0, n0):
    """dP [64, BLOCK_N] (rows row0.., keys n0..) under dropout, less its factor 1 / (1 - p): the
    forward's output is (P * keep / (1 - p)) V, so the gradient reaching P is dP * keep / (1 - p)
    (``dropout.keep``, the forward's mask). dS = P (dP keep / (1 - p) - delta) is made as
    P (dP keep - delta (1 - p)) and dQ scaled by 1 / (1 - p) once at the end: one multiply per
    score less. delta = rowsum(dO * O) is the same with or without dropout."""
    layout: gl.constexpr = dp.type.layout
    BLOCK_N: gl.constexpr = dp.shape[1]
    kept = dropout.keep(drop, row0, n0, layout, BLOCK_N, True)
    return gl.where(kept, dp, 0.0)


@gluon.jit
def _dq_step(j, t_lo, q_view, do_view, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, ds, zero_s, qk_scale,
             lse2, delta, rows, band, slope2, row0, pin, pin_p, drop, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
             HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
             HAS_SEQ_KV: gl.constexpr, DROPOUT: gl.constexpr, fp8=None, FP8_EMU: gl.constexpr = False,
             DS_E5M2: gl.constexpr = False):
    """Key tile j (j > t_lo, the CTA's first tile): S_j and dP_j, then dQ += dS_{j-1} K_{j-1} overlapped
    with dS_j. Tile j sits in ring slot (j - t_lo) % STAGES.

    HAS_SEQ_KV (masked steps): the K and V rows of tile j past len_kv (band[0]) are zeroed first
    (``fwd_sm90._zero_landed_rows``: only the CTA's last tile can reach past it).

    SPLIT: wait for S_j alone first and compute P_j under dP_j (and the dQ product), then wait
    for dP_j; otherwise wait for both, then P_j and dS_j under the dQ product alone.

    DROPOUT: dP_j as the gradient of the dropped, rescaled P (``_drop_dp``).

    FP8_EMU ([Note] FP8): fp8 = (dP factor, delta factor); dS_j comes out scaled by scale_dP and rounded to FP8
    (e5m2 where DS_E5M2, else e4m3), as fp16.
    """
    BLOCK_N: gl.constexpr = zero_s.shape[1]
    HEAD_D: gl.constexpr = q_view.shape[1]
    it = j - t_lo
    slot = it % STAGES
    prev = (it - 1) % STAGES
    phase = (it // STAGES) & 1
    if HAS_SEQ_KV and MASKED:
        _zero_landed_rows(_kv_view(k_smem, slot, BLOCK_N, HEAD_D), k_ready.index(slot),
                          _kv_view(v_smem, slot, BLOCK_N, HEAD_D), v_ready.index(slot), phase, band[0] - j * BLOCK_N)
    mbarrier.wait(k_ready.index(slot), phase)
    s_tok = warpgroup_mma(q_view, _kv_view(k_smem, slot, BLOCK_N, HEAD_D).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    mbarrier.wait(v_ready.index(slot), phase)
    dp_tok = warpgroup_mma(do_view, _kv_view(v_smem, slot, BLOCK_N, HEAD_D).permute((1, 0)), zero_s, use_acc=False,
                           is_async=True)
    dq_tok = warpgroup_mma(ds, _kv_view(k_smem, prev, BLOCK_N, HEAD_D), dq, is_async=True)
    if SPLIT:
        # groups retire in order: two left in flight means S_j is done
        s = warpgroup_mma_wait(2, deps=(s_tok, ))
        p = _p_tile(s, qk_scale, lse2, rows, j * BLOCK_N, band, slope2, row0, MASKED, HAS_LEFT, HAS_RIGHT, HAS_ALIBI)
        pin_p.store(gl.sum(p, 1))
        dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    else:
        # one left in flight means S_j and dP_j are done
        s, dp = warpgroup_mma_wait(1, deps=(s_tok, dp_tok))
        p = _p_tile(s, qk_scale, lse2, rows, j * BLOCK_N, band, slope2, row0, MASKED, HAS_LEFT, HAS_RIGHT, HAS_ALIBI)
    mbarrier.arrive(v_empty.index(slot))
    if DROPOUT:
        dp = _drop_dp(dp, drop, row0, j * BLOCK_N)
    ds_new = _ds_tile(p, dp, delta, fp8, FP8_EMU)
    # depends on every dS of the tile: keeps the elementwise work ahead of the wait (docstring)
    pin.store(gl.sum(ds_new, 1))
    dq, ds = warpgroup_mma_wait(0, deps=(dq_tok, ds))
    mbarrier.arrive(k_empty.index(prev))
    ds_layout: gl.constexpr = ds.type.layout
    ds = _ds_operand(ds_new, ds_layout, q_view.dtype, FP8_EMU, DS_E5M2)
    return dq, ds


@gluon.jit
def _ds_tile(p, dp, delta, fp8, FP8_EMU: gl.constexpr):
    """dS = P (dP - delta) on a [rows, keys] tile; FP8_EMU ([Note] FP8): dS * scale_dP from the raw products,
    P (dP_raw a - delta_raw b) with fp8 = (a, b)."""
    if FP8_EMU:
        ds = p * (dp * fp8[0] - (delta * fp8[1])[:, None])
    else:
        ds = p * (dp - delta[:, None])
    return ds


@gluon.jit
def _ds_operand(ds, layout: gl.constexpr, dtype: gl.constexpr, FP8_EMU: gl.constexpr, DS_E5M2: gl.constexpr):
    """dS as the dQ wgmma's 16-bit register operand: in the inputs' type, or (FP8_EMU) rounded to FP8 and held
    in fp16, where every FP8 value is exact."""
    if FP8_EMU:
        y = gl.convert_layout(_fp8_round16(ds, DS_E5M2), layout)
    else:
        y = gl.convert_layout(ds.to(dtype), layout)
    return y


@gluon.jit
def _dq_consumer(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                 dq_desc, LSE, stride_lb, stride_lh, stride_lm, DELTA, O, stride_ob, stride_oh, stride_om, SINK,
                 DSINK, batch, head, start_m, tiles, S_Q, len_q, band, slope2, qk_scale, sm_scale, drop,
                 HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, SPLIT: gl.constexpr, WRITE_DELTA: gl.constexpr, D: gl.constexpr,
                 HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr, DROPOUT: gl.constexpr, HAS_SINK: gl.constexpr,
                 fp8_io=None, FP8_EMU: gl.constexpr = False, DS_E5M2: gl.constexpr = False):
    """Consumer warpgroup WG: dQ of query rows [start_m + 64 * WG, +64) over key tiles
    tiles = (t_lo, t_a, t_b, t_hi, n_tiles) (``fwd_sm90._cta_tiles``); D: the true head dim.
    Padding (HAS_SEQ_Q / HAS_SEQ_KV): keys past len_kv (band[0]) are masked and their K/V rows
    zeroed in shared memory; rows past len_q are written as 0; a CTA with n_tiles = 0 writes zeros.
    HAS_SINK (with WRITE_DELTA): the warpgroup's rows' share of the sink's gradient,
    -sum exp(sink - lse) * delta, added atomically into DSINK[head] (fp32, zeroed by the caller).
    FP8_EMU ([Note] FP8): fp8_io = (SCALES, AMAX, dQ's output); delta is the raw rowsum(dO8 o)."""
    WG_M: gl.constexpr = q_smem.shape[2]
    HEAD_D: gl.constexpr = q_smem.shape[3]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    row0 = start_m + WG * WG_M
    rows = row0 + gl.arange(0, WG_M, layout=row_s)
    in_q = rows < S_Q
    lse_base = LSE + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
    lse2 = gl.load(lse_base + rows.to(gl.int64) * stride_lm, mask=in_q, other=0.0)
    lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2) * LOG2E_C     # rows with no key: P = 0
    if HAS_SINK:
        # the sink's probability exp(sink - lse), from the plain lse (before ALiBi's row shift below): the
        # lse includes the sink, so it is <= 1 on every row that has it, and exp2(sink2 - inf) = 0 on rows
        # with lse -inf; rows past S_Q (lse read as 0) are left out where it is summed
        p_sink = gl.exp2(gl.load(SINK + head) * LOG2E_C - lse2)
        sink_rows = in_q & (lse2 != float("inf"))
    if HAS_ALIBI:
        # ALiBi's row half, -slope2 * (i - row0), taken out with the LSE (``_p_tile`` adds the column half)
        lse2 = lse2 + slope2 * (rows - row0).to(gl.float32)
    zero_s = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)
    pin = gl.allocate_shared_memory(gl.float32, [WG_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    pin_p = gl.allocate_shared_memory(gl.float32, [WG_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    t_lo, t_a, t_b, t_hi, n_tiles = tiles
    # with padding a CTA may have nothing to compute (n_tiles = 0, ``fwd_sm90._cta_tiles``): it keeps
    # dq = 0 and never loads Q or dO. Without padding this is a compile-time True.
    compute = True
    if HAS_SEQ_Q or HAS_SEQ_KV:
        compute = n_tiles > 0
    if WRITE_DELTA:
        # delta = rowsum(dO * O) for this warpgroup's rows, written for the dK/dV pass: O read once
        # from global memory (16-byte vectors), dO from the shared-memory tile of this pass; 0 where
        # the CTA has nothing to compute (every key of its rows masked: their output is 0)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, ld))
        c = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld))
        d_rows = gl.zeros([WG_M], gl.float32, gl.SliceLayout(1, ld))
        if compute:
            o_base = O + batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
            # columns past D (d=224 on a 256-wide tile) are not O's: read as 0, like TMA's zero-filled dO
            o = gl.load(o_base + r.to(gl.int64)[:, None] * stride_om + c[None, :],
                        mask=(r < S_Q)[:, None] & (c < D)[None, :], other=0.0)
            mbarrier.wait(q_bar, 0)
            do_t = do_smem.reshape([WG_M, HEAD_D]).load(ld)
            d_rows = gl.sum(o.to(gl.float32) * do_t.to(gl.float32), 1)
        gl.store(DELTA + r, d_rows, mask=r < S_Q)
        delta = gl.convert_layout(d_rows, row_s)
        if HAS_SINK:
            # the sink's gradient over this warpgroup's rows: one relaxed fp32 atomic (the sum's order
            # varies, so deterministic=False only, functional._run_gluon_backward); rows without the sink
            # give exactly 0 whatever delta holds there (padding rows of dO may hold anything)
            gl.atomic_add(DSINK + head, -gl.sum(gl.where(sink_rows, p_sink * delta, 0.0), 0), sem="relaxed")
    else:
        delta = gl.load(DELTA + rows, mask=in_q, other=0.0)
    dq_scale = sm_scale
    fp8 = None
    if FP8_EMU:
        qk_scale, ds_a, ds_b = _fp8_ds_factors(fp8_io[0], qk_scale, sm_scale)
        fp8 = (ds_a, ds_b)
    if DROPOUT:
        # 1 / (1 - p) leaves the loop (``_drop_dp``): delta * (1 - p) in dS, dQ * 1 / (1 - p) at the end
        delta = delta / drop[5]
        dq_scale = sm_scale * drop[5]
    q_view = q_smem.reshape([WG_M, HEAD_D])
    do_view = do_smem.reshape([WG_M, HEAD_D])

    dq = gl.zeros([WG_M, HEAD_D], gl.float32, dq_layout)
    if compute:
        if not WRITE_DELTA:
            mbarrier.wait(q_bar, 0)
        # prologue: tile t_lo in slot 0 (masked path: it may be partial or empty)
        if HAS_SEQ_KV:
            _zero_landed_rows(_kv_view(k_smem, 0, BLOCK_N, HEAD_D), k_ready.index(0),
                              _kv_view(v_smem, 0, BLOCK_N, HEAD_D), v_ready.index(0), 0, band[0] - t_lo * BLOCK_N)
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_view, _kv_view(k_smem, 0, BLOCK_N, HEAD_D).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_ready.index(0), 0)
        dp_tok = warpgroup_mma(do_view, _kv_view(v_smem, 0, BLOCK_N, HEAD_D).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
        mbarrier.arrive(v_empty.index(0))
        p = _p_tile(s, qk_scale, lse2, rows, t_lo * BLOCK_N, band, slope2, row0, True, HAS_LEFT, HAS_RIGHT,
                    HAS_ALIBI)
        if DROPOUT:
            dp = _drop_dp(dp, drop, row0, t_lo * BLOCK_N)
        ds = _ds_operand(_ds_tile(p, dp, delta, fp8, FP8_EMU), ds_layout, dtype, FP8_EMU, DS_E5M2)

        # the band's left edge (masked; empty with no left bound), the mask-free middle, the right edge
        # and the tail past S_KV (masked)
        for j in range(t_lo + 1, t_a):
            dq, ds = _dq_step(j, t_lo, q_view, do_view, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, ds,
                              zero_s, qk_scale, lse2, delta, rows, band, slope2, row0, pin, pin_p, drop, True,
                              HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, SPLIT, HAS_SEQ_KV, DROPOUT, fp8, FP8_EMU,
                              DS_E5M2)
        for j in range(t_a, t_b):
            dq, ds = _dq_step(j, t_lo, q_view, do_view, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, ds,
                              zero_s, qk_scale, lse2, delta, rows, band, slope2, row0, pin, pin_p, drop, False,
                              HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, SPLIT, HAS_SEQ_KV, DROPOUT, fp8, FP8_EMU,
                              DS_E5M2)
        for j in range(gl.maximum(t_b, t_lo + 1), t_hi):
            dq, ds = _dq_step(j, t_lo, q_view, do_view, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, ds,
                              zero_s, qk_scale, lse2, delta, rows, band, slope2, row0, pin, pin_p, drop, True,
                              HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, SPLIT, HAS_SEQ_KV, DROPOUT, fp8, FP8_EMU,
                              DS_E5M2)

        # last dQ product
        last = (t_hi - 1 - t_lo) % STAGES
        dq_tok = warpgroup_mma(ds, _kv_view(k_smem, last, BLOCK_N, HEAD_D), dq, is_async=True)
        dq, ds = warpgroup_mma_wait(0, deps=(dq_tok, ds))
        mbarrier.arrive(k_empty.index(last))

    if HAS_SEQ_Q:
        # rows >= len_q ran on padding rows of Q and dO (which may hold NaN): their gradient is 0
        dq_rows = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, dq_layout))
        dq = gl.where((dq_rows < len_q)[:, None], dq, 0.0)
    if FP8_EMU:
        # [Note] FP8: dQ8 K8 * descale_dP * descale_k (the emulation's order), its amax over rows < S_Q, then
        # times scale_dQ in dQ's own type from registers
        SCALES = fp8_io[0]
        GRAD_D: gl.constexpr = D if D < HEAD_D else 0       # d = 224 on 256-wide tiles: the columns to store
        _fp8_grad_write(dq * gl.load(SCALES + 6) * gl.load(SCALES + 1), row0, S_Q, fp8_io[2], batch, head,
                        SCALES + 8, fp8_io[1], GRAD_D)
    else:
        # epilogue: dQ * scale through this warpgroup's Q half (its QK^T products are all done);
        # the TMA store clips rows >= S_Q
        q_view.store((dq * dq_scale).to(dtype))
        fence_async_shared()
        tma_store(dq_desc, [batch, head, row0, 0], q_smem)
        tma.store_wait(0)

@gluon.jit(do_not_specialize_on_alignment=["CHUNK"])     # CHUNK: == 1 or not, one compile for every other value
def _attn_bwd_dq_sm90(q_desc, do_desc, k_desc, v_desc, dq_desc, LSE, stride_lb, stride_lh, stride_lm, DELTA,
                      O, stride_ob, stride_oh, stride_om, SINK, DSINK, SLOPES, stride_sb, SEQ_Q, SEQ_KV,
                      H_Q, GROUP, S_Q, S_KV, qk_scale, sm_scale, win_left, win_right,
                      DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE, CHUNK,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                      BOTTOM_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr,
                      REVERSE_M: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      SPLIT: gl.constexpr, WRITE_DELTA: gl.constexpr, D: gl.constexpr, HAS_SEQ_Q: gl.constexpr,
                      HAS_SEQ_KV: gl.constexpr, DROPOUT: gl.constexpr = False, HAS_SINK: gl.constexpr = False,
                      HEAVY_FIRST: gl.constexpr = False, SCALES=None, AMAX=None, DQ_OUT=None, stride_dqb=0,
                      stride_dqh=0, stride_dqm=0, FP8_EMU: gl.constexpr = False, DS_E5M2: gl.constexpr = False):
    WG_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = 2 * WG_M
    dtype: gl.constexpr = q_desc.dtype
    PADDED: gl.constexpr = HAS_SEQ_Q or HAS_SEQ_KV

    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    if HEAVY_FIRST:
        # the linear program id in chunks of CHUNK (batch, head) pairs, query block outermost inside a chunk
        # (descending under REVERSE_M): the longest CTAs of a chunk's heads are dispatched first
        n_m = gl.num_programs(0)
        pid_m, bh = _heavy_first(pid_m + bh * n_m, n_m, CHUNK)
    if REVERSE_M:
        pid_m = gl.num_programs(0) - 1 - pid_m
    batch = bh // H_Q
    head = bh % H_Q
    kv_head = head // GROUP
    start_m = pid_m * BLOCK_M
    len_q = _seq_length(SEQ_Q, batch, S_Q, HAS_SEQ_Q)
    len_kv = _seq_length(SEQ_KV, batch, S_KV, HAS_SEQ_KV)
    diag = S_Q * 0
    if BOTTOM_RIGHT:
        diag = len_kv - len_q      # bottom-right: each sequence's own lengths
    # the forward's key tiles: [t_lo, t_hi) visited, [t_a, t_b) mask-free, n_tiles loaded
    tiles = _cta_tiles(start_m, len_q, len_kv, diag, win_left, win_right, HAS_LEFT, HAS_RIGHT, PADDED, BLOCK_M,
                       BLOCK_N)
    band = (len_kv, diag, win_left, win_right)
    slope2 = qk_scale * 0.0
    if HAS_ALIBI:
        slope2 = _alibi_slope2(SLOPES, batch, head, stride_sb)
    delta_base = DELTA + bh.to(gl.int64) * S_Q
    drop = 0
    if DROPOUT:
        drop = dropout.state(DROP_SEED, DROP_OFFSET, bh, S_Q, S_KV, DROP_THRESHOLD, DROP_RESCALE)

    q_smem0 = gl.allocate_shared_memory(dtype, [1, 1, WG_M, HEAD_D], q_desc.layout)
    q_smem1 = gl.allocate_shared_memory(dtype, [1, 1, WG_M, HEAD_D], q_desc.layout)
    do_smem0 = gl.allocate_shared_memory(dtype, [1, 1, WG_M, HEAD_D], do_desc.layout)
    do_smem1 = gl.allocate_shared_memory(dtype, [1, 1, WG_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    mbarrier.init(q_bar.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # one arrival from each consumer warpgroup frees a slot
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)

    if FP8_EMU:
        gl.static_assert(not (HAS_ALIBI or DROPOUT or HAS_SINK or PADDED), "FP8: masks and windows only")
        fp8_io = (SCALES, AMAX, (DQ_OUT, stride_dqb, stride_dqh, stride_dqm))
    else:
        # stand-ins of the same structure (warp_specialize takes typed values only), never read
        fp8_io = (LSE, LSE, (LSE, S_Q, S_Q, S_Q))
    gl.warp_specialize([
        (_dq_consumer, (0, q_smem0, do_smem0, k_smem, v_smem, q_bar.index(0), k_ready, k_empty, v_ready, v_empty,
                        dq_desc, LSE, stride_lb, stride_lh, stride_lm, delta_base, O, stride_ob, stride_oh,
                        stride_om, SINK, DSINK, batch, head, start_m, tiles, S_Q, len_q, band, slope2, qk_scale,
                        sm_scale, drop, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, BLOCK_N, STAGES, SPLIT, WRITE_DELTA, D,
                        HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT, HAS_SINK, fp8_io, FP8_EMU, DS_E5M2)),
        (_dq_consumer, (1, q_smem1, do_smem1, k_smem, v_smem, q_bar.index(1), k_ready, k_empty, v_ready, v_empty,
                        dq_desc, LSE, stride_lb, stride_lh, stride_lm, delta_base, O, stride_ob, stride_oh,
                        stride_om, SINK, DSINK, batch, head, start_m, tiles, S_Q, len_q, band, slope2, qk_scale,
                        sm_scale, drop, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, BLOCK_N, STAGES, SPLIT, WRITE_DELTA, D,
                        HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT, HAS_SINK, fp8_io, FP8_EMU, DS_E5M2)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem0, q_smem1, do_smem0, do_smem1, k_smem, v_smem, q_bar,
                        k_ready, k_empty, v_ready, v_empty, batch, head, kv_head, start_m, tiles[0], tiles[4],
                        BLOCK_N, STAGES, PADDED)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

# ----------------------------------------------------------------------------------------------
# host side

def _bwd_problem_ok(p, dims) -> bool:
    """The backward passes' filter: the forward's features (no mask, causal, sliding windows, ALiBi,
    padding, dropout) at ``dims`` (``fwd_sm90._fwd_problem_ok``, cached)."""
    return _fwd_problem_ok(p, dims)


def _chunk(grid, device_index):
    """(batch, head) pairs per chunk of the heavy-first order (``HEAVY_FIRST`` here, in ``bwd_dkdv_sm90`` and
    ``bwd_fused_sm90``; grid = (blocks per head, pairs), one CTA per SM): as many as one wave of CTAs holds,
    at least 1. A list-scheduling model of 132 SMs (CTA time ~ its tiles) puts the tail at 1.000-1.017x
    the average load for 2k-8k causal with this chunk, against 1.07x (2k) and 1.14x (GQA 4 at 4k) in the
    grid's own order."""
    return max(1, min(_sm_count(device_index) // grid[0], grid[1]))


def _padding_ok(p, seq_len_q, seq_len_kv) -> bool:
    """The per-batch length tensors a padded problem needs (``fwd_sm90._lengths_ok``)."""
    return ((not p.has_seq_len_q or _lengths_ok(seq_len_q, p))
            and (not p.has_seq_len_kv or _lengths_ok(seq_len_kv, p)))


def supports(p, q, k, v, grad_out, dq, *, out=None, slopes=None, seq_len_q=None, seq_len_kv=None,
             head_dims=None) -> bool:
    """True when this kernel computes the dQ of ``p`` on these tensors (sm_90, fp16/bf16, d = d_v
    in ``SUPPORTED_DIMS``, no mask, causal, sliding windows, ALiBi and padding as the forward has
    them, TMA-ready strides). The problem half is cached.
    out: the forward's output, when the caller wants delta computed by this pass (unit last
    stride). slopes: fp32 [b, h_q] ALiBi slopes (natural units)
    when p.alibi. seq_len_q / seq_len_kv: int32 [b] lengths when the problem has them."""
    dims = SUPPORTED_DIMS if head_dims is None else tuple(d for d in head_dims if d in SUPPORTED_DIMS)
    if not (_bwd_problem_ok(p, dims) and isinstance(q, torch.Tensor) and q.is_cuda and _is_sm90(q.device.index)):
        return False
    if p.alibi is not None and not _slopes_ok(p, slopes):
        return False
    if not _padding_ok(p, seq_len_q, seq_len_kv):
        return False
    if out is not None and not (isinstance(out, torch.Tensor) and out.dtype == p.dtype and out.is_cuda
                                and out.stride(-1) == 1 and out.shape == grad_out.shape):
        return False
    return all(isinstance(t, torch.Tensor) and t.dtype == p.dtype and _tma_ready(t) for t in (q, k, v, grad_out, dq))


def launch_dq_sm90(p, q, k, v, grad_out, lse, delta, dq, *, out=None, slopes=None, seq_len_q=None,
                   seq_len_kv=None, sink=None, dsink=None, block_n=None, stages=None, split=None, heavy_first=None,
                   fp8=None):
    """dQ pass of the attention backward on Hopper; writes dq in place (``supports`` must hold).

    q [b,h_q,s_q,d], k/v [b,h_kv,s_kv,d], grad_out/dq [b,h_q,s_q,d]: any strides with unit last
    stride. lse: fp32 [b,h_q,s_q] view (any strides; the forward's natural-log stats). delta: fp32
    contiguous [b*h_q, s_q]: read as rowsum(dO * O), or, when ``out`` (the forward's output, same
    shape as grad_out, unit last stride) is given, computed here and written into it (for the
    dK/dV pass; no separate preprocess launch). slopes: fp32 [b, h_q] when p.alibi. seq_len_q /
    seq_len_kv: int32 [b] when p has them (padding: dQ rows past len_q are written as 0, keys past
    len_kv are ignored). sink / dsink (with ``out``): the forward's sink logits, fp32 contiguous [h_q],
    and fp32 contiguous [h_q] zeroed by the caller, into which the sink's gradient
    -sum_rows exp(sink - lse) * delta is added with atomics (``HAS_SINK``; not bitwise reproducible).
    block_n / stages / split / heavy_first override ``TILES`` / ``SPLIT`` / ``HEAVY_FIRST`` (tuning).
    fp8 ([Note] FP8): (scales, amax, dS's type is e5m2); q, k, v, grad_out then hold FP8 values in fp16 (p's dtype
    fp16), ``out`` the forward's output in any type (delta = its raw rowsum with dO), and dq is the gradient in
    its own type (any strides, unit last), written from registers with amax_dQ into amax[0].
    """
    if (p.has_seq_len_q and seq_len_q is None) or (p.has_seq_len_kv and seq_len_kv is None):
        raise ValueError("the problem has per-batch lengths: pass seq_len_q / seq_len_kv")
    has_sink = dsink is not None
    if has_sink and not (out is not None and sink is not None and sink.dtype == dsink.dtype == torch.float32
                         and sink.is_contiguous() and dsink.is_contiguous()):
        raise ValueError("dsink needs out (delta computed here) and fp32 contiguous sink and dsink [h_q]")
    td = TILE_D[p.d]
    block_n = block_n or TILES[td][0]
    stages = stages or TILES[td][1]
    split = SPLIT[td] if split is None else split
    band = p.band
    has_left = band is not None and band.left is not None
    has_right = band is not None and band.right is not None
    causal_like = has_right and not has_left
    heavy = HEAVY_FIRST[causal_like] if heavy_first is None else heavy_first
    grid = (cdiv(p.s_q, BLOCK_M), p.b * p.h_q)
    o_arg, o_strides = (out, out.stride()[:3]) if out is not None else (lse, (0, 0, 0))
    fp8_kw = {}
    if fp8 is not None:
        scales, amax, ds_e5m2 = fp8
        fp8_kw = dict(SCALES=scales, AMAX=amax, DQ_OUT=dq, stride_dqb=dq.stride(0), stride_dqh=dq.stride(1),
                      stride_dqm=dq.stride(2), FP8_EMU=True, DS_E5M2=bool(ds_e5m2))
    # FP8: q stands in for dq's descriptor (the FP8 epilogue stores from registers)
    dq_tile = dq if fp8 is None else q
    launch(
        _attn_bwd_dq_sm90, grid,
        _tma(q, WG_M), _tma(grad_out, WG_M), _tma(k, block_n), _tma(v, block_n), _tma(dq_tile, WG_M),
        lse, *lse.stride(), delta, o_arg, *o_strides, sink if has_sink else lse, dsink if has_sink else lse,
        slopes if p.alibi is not None else lse,
        slopes.stride(0) if p.alibi is not None else 0,
        seq_len_q if p.has_seq_len_q else lse, seq_len_kv if p.has_seq_len_kv else lse, p.h_q, p.group, p.s_q, p.s_kv, p.scale * LOG2E, p.scale,
        band.left if has_left else 0, band.right if has_right else 0,
        *dropout.kernel_args(p), _chunk(grid, q.device.index) if heavy else 1,
        BLOCK_N=block_n, STAGES=stages, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        BOTTOM_RIGHT=band is not None and band.alignment == "bottom_right", HAS_ALIBI=p.alibi is not None,
        # a causal-like band: the longest rows (last query tiles) start first, as the forward
        REVERSE_M=causal_like, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        SPLIT=split, WRITE_DELTA=out is not None, D=p.d, HAS_SEQ_Q=p.has_seq_len_q, HAS_SEQ_KV=p.has_seq_len_kv,
        DROPOUT=p.has_dropout, HAS_SINK=has_sink, HEAVY_FIRST=heavy, num_warps=4, **fp8_kw,
    )
    return dq
