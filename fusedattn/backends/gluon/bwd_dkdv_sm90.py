"""Attention backward, dK/dV pass, for Hopper (sm_90) in Gluon: FlashAttention-3 style.

One program (CTA) owns keys [n0, n0 + 128) (d 64/128; 64 at d 224/256, see the end) of one
(batch, kv head) and accumulates their dK and dV over every query row of every query head of
the kv head's GQA group (so each dK/dV element has exactly one writer: bitwise deterministic,
no atomics). dQ is a separate pass
(``bwd_dq_sm90``); delta = rowsum(dO * O) is an input (fp32 [b*h_q, s_q], written by whichever
pass or preprocess computes it).

Partitions (``gl.warp_specialize``), talking only through mbarriers:

* producer (1 warp): K and V once (two 64-key halves each, one per consumer warpgroup), then Q
  and dO tiles of 64 query rows through a ring of STAGES slots (separate ready barriers for Q
  and dO, one empty barrier per slot released by both consumer warpgroups), across all query
  tiles of all heads of the group; with each tile, its 64 lse2 and delta values (plain loads
  issued before the slot wait, stored to a small shared ring, a third ready barrier). Kept in
  registers by the consumers instead, they spilled inside the loop (bench/GLUON_NOTES.md).
* two consumer warpgroups (4 warps each): warpgroup WG owns keys [n0 + 64 WG, +64) and keeps
  its dK and dV [64, d] fp32 accumulators in registers for the whole program.

Per query tile (64 rows, Q_i and dO_i in shared memory), in each consumer warpgroup, on
transposed tiles [keys, rows] (as the Triton pass):

    S^T  = K Q_i^T           async wgmma (K and Q from shared memory)
    dP^T = V dO_i^T          async wgmma, in flight while
    P^T  = exp2(S^T * qk_scale - lse2)      (lse2 = lse * log2 e; masked on causal diagonal tiles only)
    dV  += P^T dO_i          async wgmma, P^T from registers (A operand), in flight while
    dS^T = P^T * (dP^T - delta)
    dK  += dS^T Q_i          async wgmma, dS^T from registers; wait for dV and dK, release the slot

and at the end dK *= scale; dK and dV go to global memory through the (free) K/V shared tiles
with TMA stores (which clip keys >= s_kv).

Tails need no mask: TMA zero-fills Q and dO rows >= s_q and K/V rows >= s_kv. Such a row's lse
is loaded as +inf (and delta as 0), so its P is exactly 0 and it adds nothing (with ALiBi a
finite lse could make exp2 of a large positive bias overflow); keys >= s_kv only produce dK/dV
rows that the TMA store clips. Bands (``_q_tiles``, the transpose of the forward's ``_kv_range``):
causal (either alignment, diag = 0 or s_kv - s_q) and sliding windows: query tiles whose rows see
none of the CTA's keys are never loaded (and under a right bound warpgroup 1 skips the tiles
where none of its 64 keys is seen yet); tiles whose rows all see every real key of the block run
mask-free; the tiles below (right bound: ``key <= row + diag + right``) and above (left bound:
``key >= row + diag - left``) apply the mask. Rows that see no key at all (bottom-right, s_q >
s_kv) have every key masked there, and their lse (-inf, the forward's) is staged as +inf, so their P
is exactly 0 (never exp2(-inf - -inf) = NaN) and they add nothing. ALiBi (slope * (j - i),
slope per query head of the GQA group): the producer folds the row half -slope * (i - t * 64)
into the lse it stages, the consumer adds the key half slope * (j - t * 64) (``_pt_tile``).

Order: key block 0 has the most query tiles under a causal mask, and the grid runs it first within
each (batch, kv head); under a causal-like band (a right bound, no left one) ``HEAVY_FIRST`` extends
that to the whole grid: the linear program id is cut into chunks of ``bwd_dq_sm90._chunk`` (batch, kv
head) pairs (about one wave of CTAs), key block outermost inside a chunk (``bwd_dq_sm90._heavy_first``,
the single-pass backward's order), instead of one head's blocks after another's (7.4% of SM time idle
at the end at 2k causal in the grid's order, H100, bench/BWD_PROFILE.md 7.2; a 132-SM list-scheduling
model: 6.5% -> 1.6%). A permutation of the CTAs: each dK/dV element keeps its one writer, and results
are bitwise the same in either order.

Tensors are logical [b, h, s, d] with any strides of unit last stride (TMA rules: 16-byte
aligned base and strides; ``fwd_sm90._tma_ready``), each seen through a 4-D TMA descriptor
(box [1, 1, 64, TILE_D[d]]) so out-of-bounds rows are per (b, h).

Head dims 224 and 256 (``SPLIT``: tile width 256; d=224 runs on 256-wide TMA boxes like the
forward, ``fwd_sm90.TILE_D``: TMA zero-fills columns 224..255 on loads, so they add nothing to
S^T and dP^T, and clips them on the dK/dV stores). A warpgroup cannot hold both dK and dV
[64, 256] fp32 (2 x 128 registers per thread, of 240), so the CTA owns 64 keys only and the two
consumer warpgroups split the work by output instead of by key, each with one accumulator:

    warpgroup 0                                  warpgroup 1
    S^T  = K Q_i^T        (SS wgmma)             dP^T = V dO_i^T      (SS wgmma)
    P^T  = exp2(S^T qk_scale - lse2), masked     wait for P^T in exchange slot i % 2
    P^T -> exchange slot i % 2 (fp16), arrive    dS^T = P^T (dP^T - delta); free the slot
    dV  += P^T dO_i       (RS wgmma)             dK  += dS^T Q_i      (RS wgmma)

Per query tile that is two wgmmas per warpgroup (the same four products as above, none
recomputed), and the phases interleave on the tensor cores: warpgroup 0's exponentials run under
dP^T, warpgroup 1's dS arithmetic under dV. Only warpgroup 0 masks (P^T = 0 where a row must
not see a key, so dS^T = 0 too). The exchange is two [64 keys, 64 rows] fp16 tiles (fp16 for
any input dtype: P is in [0, 1] and 11 bits keep dS^T = P^T (dP^T - delta) as exact as the
fp32 P of the other variant to well under one bf16 ulp), with ready/empty mbarriers
(stmatrix / ldmatrix in the SASS; Gluon puts a warpgroup barrier before each single-thread
arrive, so all 128 threads' stores are in when the other warpgroup is released). Each
warpgroup reads one operand tile only (warpgroup 0 K, warpgroup 1 V), so each writes its
result through that tile in the epilogue (dV through K's, dK through V's) without waiting for
the other. Shared memory: K + V 64 KB, 2 x (Q + dO) 128 KB, exchange 16 KB, lse/delta ring:
214512 bytes (the limit is 232448; a third ring stage would need 64 KB more). Twice as many CTAs
stream Q and dO as at d=128 (64 keys per CTA instead of 128): 64 KB of L2 reads per 8.4 MFLOP.

[Note] dropout (``DROPOUT``) runs the SPLIT variant at every head dim: warpgroup 0 makes the
keep-mask (``dropout.keep`` on the transposed tile: the forward's mask, one Philox call per 2 rows
x 4 keys; keys k and k + 1 sit in lanes L and L ^ 4 here, which split the calls and swap halves
by shuffle) and sends it to
warpgroup 1 in the sign of the exchanged P^T (P kept, -P dropped); both accumulate without
1 / (1 - p) and scale once at the end. With dK and dV in one warpgroup the Philox words spilled
(~150 local accesses per step at d128, tools/gluon_bwd_check.py); one accumulator per warpgroup
leaves them room.

[Note] FP8 (``FP8_EMU``, SPLIT only; ``launch_bwd_fp8``, routed by ``fusedattn.fp8._backward_gluon`` at d = d_v in
224 / 256, where the single-pass kernel's FP8 switch does not fit): cuDNN's ``sdpa_fp8_backward`` with the rounding
points of ``fusedattn.fp8``'s emulation, as ``bwd_fused_sm90`` [Note] FP8 has them, on fp16 wgmmas of the FP8
values (the host widens q, k, v and dO once per call, ``fwd_sm90.widened_fp16``). Warpgroup 0: P = exp2(S_raw
qk_scale descale_q descale_k - lse2) and P8 = fp8(P * scale_s) in q's type (``_fp8_round16``) for dV += P8^T dO8;
the exchange carries P itself (fp16, as in the 16-bit kernel). Warpgroup 1: dS * scale_dP = P (dP_raw a -
delta_raw b), a = descale_dO descale_v scale scale_dP, b = descale_dO descale_o scale scale_dP, its max |.| per key
kept in registers, dS8 = fp8(.) in dO's type for dK += dS8^T Q8. The epilogue descales dV (descale_s descale_dO)
and dK (descale_dP descale_q), maxes them and amax_dP over keys < s_kv and stores from registers in the gradients'
own type times their scales (``bwd_dq_sm90._fp8_grad_write``; at d = 224 the columns past 224 are left out). delta
is the raw rowsum(dO8 o), written by the dQ pass (``bwd_dq_sm90`` [Note] FP8), which also makes dQ. The 16-bit
builds' SASS is unchanged (the switch's values are stand-ins the compiler removes). No-GPU compile (Triton 3.6.0,
d256 causal, e4m3 gradients): no spills, 168 registers, 214544 bytes of shared memory; warpgroup 0's loops 280 /
445 SASS instructions against the 16-bit build's 235 / 390, warpgroup 1's 319 against 249.

[Note] status (SPLIT, keep current): no-GPU compile (tools/gluon_bwd_check.py 256|224): consumer
loops spill-free (60-76 bytes of ptxas spills, all in the producer warp and the prologue); H100,
two runs of bench/gluon_dkdv_sweep.py --wide: 2.5-3.1x the Triton dK/dV pass (d256 causal 562-575
TFLOP/s, d224 fp16 504-528); ``DV_FIRST`` within the spread (bench/GLUON_NOTES.md).
"""
import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..compat import tma_load, tma_store
from . import dropout
from .bwd_dq_sm90 import (_bwd_problem_ok, _chunk, _fp8_ds_factors, _fp8_grad_write, _fp8_round16, _heavy_first,
                          _padding_ok, launch_dq_sm90)
from .fwd_sm90 import (LOG2E, LOG2E_C, MMA_COL_THREAD_BITS, TILE_D, _alibi_slope2, _is_sm90,
                       _seq_length, _slopes_ok, _tma, _tma_ready, widened_fp16)
from ..triton.launch import cdiv
from .launch import launch

WG_N = 64            # keys per consumer warpgroup (one wgmma M)
BLOCK_N = 2 * WG_N   # keys per CTA (WG_N under SPLIT)
BLOCK_M = 64         # query rows per tile of the Q/dO ring
# (tile width, causal) -> ring stages. Shared memory: K, V 2 * BLOCK_N * d * 2 bytes + STAGES * (Q + dO)
# 2 * 64 * d * 2: d=128 64 KB + 2-3 * 32 KB = 128-160 KB; d=64 32 KB + 4 * 16 KB = 96 KB; tile width 256
# (SPLIT, BLOCK_N 64) 64 KB + 2 * 64 KB + exchange 16 KB = 208 KB (3 stages do not fit). H100, two runs of
# bench/gluon_dkdv_sweep.py (TFLOP/s, 2 stages vs 3): non-causal 8k 647/656 vs 689/690; causal 16k 629/639
# vs 617/613, 2k 514/533 vs 518/531, GQA 4k 562/573 vs 572/567.
STAGES = {(64, False): 4, (64, True): 4, (128, False): 3, (128, True): 2, (256, False): 2, (256, True): 2}
# tile width -> the two consumer warpgroups split by output over 64 shared keys (module docstring)
SPLIT = {64: False, 128: False, 256: True}
# SPLIT: warpgroup 0 issues its dV wgmma before handing P^T over (the exchange under the wgmma; ``_p_dv_step``)
DV_FIRST = False
# causal-like band (right bound, no left) -> program ids in longest-first order over the whole grid, in chunks of
# about one wave (``bwd_dq_sm90._chunk``, ``bwd_dq_sm90._heavy_first``; module docstring); off: the grid's own
# order (key block 0, the longest, first within each (batch, kv head))
HEAVY_FIRST = {False: False, True: True}
SUPPORTED_DIMS = (64, 128, 224, 256)
CONSUMER_REGS = 240
PRODUCER_REGS = 24


@gluon.jit
def _q_tiles(n0, S_Q, S_KV, diag, win_left, win_right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(t_lo, t_a, t_b, t_hi): the CTA visits query tiles [t_lo, t_hi); [t_lo, t_a) and [t_b, t_hi)
    are masked, [t_a, t_b) mask-free (the transpose of ``fwd_sm90._kv_range``).

    Row i keeps key j iff j < S_KV, (HAS_RIGHT) j <= i + diag + win_right, i.e. i >= j - diag -
    win_right, and (HAS_LEFT) j >= i + diag - win_left, i.e. i <= j - diag + win_left. Causal is
    HAS_RIGHT with win_right = 0. Tiles before t_lo / from t_hi on have no row that sees any of keys
    [n0, last] (last: the block's last real key); in [t_a, t_b) every row sees every real key of the
    block. Bounds are clamped at 0 before dividing (integer division truncates toward zero)."""
    t_hi = (S_Q + BLOCK_M - 1) // BLOCK_M
    t_lo = S_Q * 0
    t_a = t_lo
    t_b = t_hi
    last = gl.minimum(n0 + BLOCK_N, S_KV) - 1
    if HAS_RIGHT:
        t_lo = gl.minimum(gl.maximum(n0 - diag - win_right, 0) // BLOCK_M, t_hi)
        t_a = (gl.maximum(last - diag - win_right, 0) + BLOCK_M - 1) // BLOCK_M
    if HAS_LEFT:
        # rows up to last - diag + win_left see some key; rows up to n0 - diag + win_left see all
        t_hi = gl.minimum(t_hi, (gl.maximum(last - diag + win_left + 1, 0) + BLOCK_M - 1) // BLOCK_M)
        t_hi = gl.maximum(t_hi, t_lo)
        t_b = gl.maximum(n0 - diag + win_left + 1, 0) // BLOCK_M
    t_a = gl.minimum(gl.maximum(t_a, t_lo), t_hi)
    t_b = gl.minimum(gl.maximum(t_b, t_a), t_hi)
    return t_lo, t_a, t_b, t_hi


@gluon.jit
def _pt_tile(s, qk_scale, lse2, t, keys, band, slope2, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
             HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """P^T = exp2(S^T * qk_scale [+ ALiBi] - lse2) on a transposed tile [keys, rows of query tile t].

    keys: the tile's key indices; band = (diag, win_left, win_right) (``_q_tiles``). ALiBi
    slope2 * (j - i) in base 2: the key half slope2 * (j - t * BLOCK_M) here, the row half
    -slope2 * (i - t * BLOCK_M) folded into lse2 by the producer (both halves stay small where P is
    not negligible, as in the forward)."""
    BLOCK_M: gl.constexpr = s.shape[1]
    x = s * qk_scale - lse2[None, :]
    if HAS_ALIBI:
        x = x + (slope2 * (keys - t * BLOCK_M).to(gl.float32))[:, None]
    if MASKED:
        diag, win_left, win_right = band
        # fwd_sm90._band_keep transposed, with the offsets on the key side (2 values per thread here, the
        # rows 32; 224 more instructions per masked loop set the other way); keys past S_KV stay
        # unmasked: only their own dK/dV rows see them, and the store clips those. The rows are the tile's
        # columns: each compared as an immediate (its register's part) against the key side less the thread's
        # part and the tile's first row (fwd_sm90 ``_band_keep``'s THREAD_BITS), so that no row index is held in
        # a register across the loops (Triton 3.9 spilled them: up to 39 local accesses per masked step of the
        # d=128 single pass, bench/NOTES.md 85)
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s.type.layout))
        r_reg = (cols & (BLOCK_M - 1 - MMA_COL_THREAD_BITS))[None, :]
        k_side = keys[:, None] - t * BLOCK_M - (cols & MMA_COL_THREAD_BITS)[None, :]
        if HAS_RIGHT:
            keep = k_side - (diag + win_right) <= r_reg
            if HAS_LEFT:
                keep = keep & (r_reg <= k_side - (diag - win_left))
        else:
            keep = r_reg <= k_side - (diag - win_left)
        x = gl.where(keep, x, float("-inf"))
    return gl.exp2(x)


@gluon.jit
def _dkdv_producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar,
                   q_ready, do_ready, l_ready, empty, LSE, stride_lb, stride_lh, stride_lm, DELTA, SLOPES, stride_sb, batch,
                   kv_head, n0, H_Q, GROUP, S_Q, len_q, t_lo, t_hi, STAGES: gl.constexpr, HAS_ALIBI: gl.constexpr,
                   HAS_SEQ_Q: gl.constexpr, REVERSE: gl.constexpr = False, ROTATE: gl.constexpr = False, t_a=0,
                   t_b=0, rot=0, SEGMENTS: gl.constexpr = False, t_io=None, T_LOADS: gl.constexpr = False):
    """Load warp: K and V once (every 64-key tile of the CTA), then Q_i and dO_i (TMA) and the tile's
    lse2 = lse * log2 e and delta rows (plain loads; +inf and 0 for rows >= len_q, the sequence's
    length, S_Q unpadded) of every (head of the group, query tile). REVERSE: each head's query tiles
    last-first (the single-pass backward under a causal mask, ``bwd_fused_sm90``). ROTATE: the mask-free
    tiles [t_a, t_b) of each head start ``rot`` tiles into their order and wrap around (``bwd_fused_sm90``,
    "Switches": Rotate; ``_tile_loop`` visits them in the same order). SEGMENTS: segment-major order (the
    single-pass backward, ``bwd_fused_sm90`` "Switches": Segments): the masked run before the mask-free one of
    every head of the group, then every head's mask-free run, then every head's other masked run; each
    head's tiles in the same order as without it, so with one head per group the order is the same.
    T_LOADS (the single-pass backward's FP8 MMAs, ``bwd_fused_sm90`` [Note] FP8 MMAs): t_io = (Q^T, dO^T, K^T
    descriptors, their shared memory): K^T's tiles with K's, each tile's Q^T and dO^T with its Q and dO, under
    the same barriers."""
    WG_N: gl.constexpr = k_desc.block_type.shape[2]
    N_KV: gl.constexpr = k_smem.shape[0]     # 64-key K/V tiles of the CTA: 2, or 1 (SPLIT)
    if T_LOADS:
        mbarrier.expect(kv_bar, N_KV * (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                                        + t_io[2].block_type.nbytes))
        for h in gl.static_range(N_KV):
            tma_load(t_io[2], [batch, kv_head, 0, n0 + h * WG_N], kv_bar, t_io[5].index(h))
    else:
        mbarrier.expect(kv_bar, N_KV * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for h in gl.static_range(N_KV):
        tma_load(k_desc, [batch, kv_head, n0 + h * WG_N, 0], kv_bar, k_smem.index(h))
    for h in gl.static_range(N_KV):
        tma_load(v_desc, [batch, kv_head, n0 + h * WG_N, 0], kv_bar, v_smem.index(h))
    it = 0
    if SEGMENTS:
        # the runs in the consumers' order (``bwd_fused_sm90._fused_consumer``)
        lo0, hi0, lo2, hi2 = t_lo, t_a, t_b, t_hi
        if REVERSE:
            lo0, hi0, lo2, hi2 = t_b, t_hi, t_lo, t_a
        for r in gl.static_range(3):
            lo, hi = t_a, t_b
            if r == 0:
                lo, hi = lo0, hi0
            elif r == 2:
                lo, hi = lo2, hi2
            for g in range(GROUP):
                head = kv_head * GROUP + g
                lse_base = LSE + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
                delta_base = DELTA + (batch * H_Q + head).to(gl.int64) * S_Q
                slope2 = 0.0
                if HAS_ALIBI:
                    slope2 = _alibi_slope2(SLOPES, batch, head, stride_sb)
                for i in range(hi - lo):
                    t = hi - 1 - i if REVERSE else lo + i
                    if ROTATE:
                        if r == 1:
                            j = (i + rot) % (hi - lo)
                            t = hi - 1 - j if REVERSE else lo + j
                    _load_q_tile(q_desc, do_desc, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, l_ready,
                                 empty, lse_base, stride_lm, delta_base, slope2, batch, head, t, it, len_q, STAGES,
                                 HAS_ALIBI, HAS_SEQ_Q, t_io, T_LOADS)
                    it += 1
    else:
        for g in range(GROUP):
            head = kv_head * GROUP + g
            lse_base = LSE + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
            delta_base = DELTA + (batch * H_Q + head).to(gl.int64) * S_Q
            slope2 = 0.0
            if HAS_ALIBI:
                slope2 = _alibi_slope2(SLOPES, batch, head, stride_sb)
            for i in range(t_hi - t_lo):
                t = t_hi - 1 - i if REVERSE else t_lo + i
                if ROTATE:
                    # position j in the mask-free run (it follows the masked tiles before it in this order)
                    j = i - (t_hi - t_b) if REVERSE else i - (t_a - t_lo)
                    if (j >= 0) & (j < t_b - t_a):
                        j = (j + rot) % (t_b - t_a)      # the load warp: a division per tile is cheap here
                        t = t_b - 1 - j if REVERSE else t_a + j
                _load_q_tile(q_desc, do_desc, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, l_ready,
                             empty, lse_base, stride_lm, delta_base, slope2, batch, head, t, it, len_q, STAGES,
                             HAS_ALIBI, HAS_SEQ_Q, t_io, T_LOADS)
                it += 1


@gluon.jit
def _load_q_tile(q_desc, do_desc, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, l_ready, empty, lse_base,
                 stride_lm, delta_base, slope2, batch, head, t, it, len_q, STAGES: gl.constexpr,
                 HAS_ALIBI: gl.constexpr, HAS_SEQ_Q: gl.constexpr, t_io=None, T_LOADS: gl.constexpr = False):
    """The load warp's work for query tile t of one head, the it-th tile of the CTA: Q and dO into ring slot
    it % STAGES (TMA), lse2 and delta rows into their slots, then l_ready (``_dkdv_producer``); T_LOADS: Q^T
    and dO^T too, each under its untransposed tile's barrier."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    slot = it % STAGES
    rows = t * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
    # issued before the slot wait: their latency hides under it
    # rows past len_q (Q and dO rows that TMA zero-fills, or that this warp zeroes below): lse = +inf
    # makes their P exactly 0
    lse2 = gl.load(lse_base + rows.to(gl.int64) * stride_lm, mask=rows < len_q, other=float("inf"))
    delta = gl.load(delta_base + rows, mask=rows < len_q, other=0.0)
    # first use of a slot: the phase before a fresh barrier's first counts as complete
    mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
    if T_LOADS:
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + t_io[0].block_type.nbytes)
        tma_load(q_desc, [batch, head, t * BLOCK_M, 0], q_ready.index(slot), q_smem.index(slot))
        tma_load(t_io[0], [batch, head, 0, t * BLOCK_M], q_ready.index(slot), t_io[3].index(slot))
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes + t_io[1].block_type.nbytes)
        tma_load(do_desc, [batch, head, t * BLOCK_M, 0], do_ready.index(slot), do_smem.index(slot))
        tma_load(t_io[1], [batch, head, 0, t * BLOCK_M], do_ready.index(slot), t_io[4].index(slot))
    else:
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma_load(q_desc, [batch, head, t * BLOCK_M, 0], q_ready.index(slot), q_smem.index(slot))
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        tma_load(do_desc, [batch, head, t * BLOCK_M, 0], do_ready.index(slot), do_smem.index(slot))
    # rows that saw no key have lse -inf: +inf makes their P exactly 0, as for rows >= len_q
    lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2) * LOG2E_C
    if HAS_ALIBI:
        lse2 = lse2 + slope2 * (rows - t * BLOCK_M).to(gl.float32)     # ALiBi's row half (_pt_tile)
    lse_smem.index(slot).store(lse2)
    delta_smem.index(slot).store(delta)
    if HAS_SEQ_Q:
        n_valid = len_q - t * BLOCK_M
        if n_valid < BLOCK_M:
            # a head's last tile reaches past len_q: its padding rows of Q and dO (inside the
            # tensor, so TMA loads them; they may hold NaN) are zeroed once landed, so the zero
            # P^T and dS^T of those rows meet zeros in dV += P^T dO and dK += dS^T Q, never
            # 0 * NaN. The consumers wait for l_ready before their first wgmma on a padded
            # problem's tile, and the fence orders these stores before the wgmmas' reads.
            phase = (it // STAGES) & 1
            mbarrier.wait(q_ready.index(slot), phase)
            mbarrier.wait(do_ready.index(slot), phase)
            _zero_rows_by_chunks(q_smem.index(slot).reshape([BLOCK_M, HEAD_D]), n_valid)
            _zero_rows_by_chunks(do_smem.index(slot).reshape([BLOCK_M, HEAD_D]), n_valid)
            fence_async_shared()
    mbarrier.arrive(l_ready.index(slot))


@gluon.jit
def _zero_rows_by_chunks(tile, n_valid):
    """Zero rows [n_valid, BLOCK_M) of a [BLOCK_M, HEAD_D] shared tile from the one-warp producer
    (24 registers): [8, 64] chunks, the smallest slices of the 128-byte swizzle pattern (16 values
    per thread), each skipped unless it holds padding. Whole-width chunks spilled the producer."""
    BLOCK_M: gl.constexpr = tile.shape[0]
    HEAD_D: gl.constexpr = tile.shape[1]
    # 8 consecutive 16-bit columns (16 bytes) per thread, the warp covers 4 rows of 64 columns
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    for c in gl.static_range(BLOCK_M // 8):
        if (c + 1) * 8 > n_valid:
            r = c * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
            for h in gl.static_range(HEAD_D // 64):
                chunk = tile.slice(c * 8, 8).slice(h * 64, 64, dim=1)
                x = chunk.load(layout)
                chunk.store(gl.where(r[:, None] < n_valid, x, gl.zeros_like(x)))


@gluon.jit
def _zero_key_rows(acc, n0, len_kv):
    """Padding: rows of a [keys, HEAD_D] accumulator for keys n0 + r >= len_kv set to 0 (their K/V
    rows are padding, which may hold NaN; their dK/dV are 0)."""
    keys = n0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
    return gl.where((keys < len_kv)[:, None], acc, 0.0)


@gluon.jit
def _dkdv_step(it, t, k_view, v_view, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, l_ready, empty,
               dk, dv, zero_s, keys, band, slope2, qk_scale, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
               HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, STAGES: gl.constexpr, HAS_SEQ_Q: gl.constexpr):
    """One query tile (rows [t * 64, +64) of one head): dV += P^T dO, dK += dS^T Q.

    keys: this warpgroup's key indices; band, slope2: ``_pt_tile``."""
    BLOCK_M: gl.constexpr = zero_s.shape[1]
    HEAD_D: gl.constexpr = k_view.shape[1]
    s_layout: gl.constexpr = zero_s.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    dtype: gl.constexpr = k_view.dtype
    slot = it % STAGES
    phase = (it // STAGES) & 1
    q_view = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
    do_view = do_smem.index(slot).reshape([BLOCK_M, HEAD_D])
    if HAS_SEQ_Q:
        # padding: the producer zeroes a tile's rows past len_q before it releases l_ready
        mbarrier.wait(l_ready.index(slot), phase)

    mbarrier.wait(q_ready.index(slot), phase)
    s_tok = warpgroup_mma(k_view, q_view.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(slot), phase)
    dp_tok = warpgroup_mma(v_view, do_view.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(l_ready.index(slot), phase)
    lse2 = lse_smem.index(slot).load(col_layout)
    # groups retire in order: one left in flight means S^T is done (dP^T runs on)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p = _pt_tile(s, qk_scale, lse2, t, keys, band, slope2, MASKED, HAS_LEFT, HAS_RIGHT, HAS_ALIBI)
    p16 = gl.convert_layout(p.to(dtype), a_layout)
    dv_tok = warpgroup_mma(p16, do_view, dv, is_async=True)
    delta = delta_smem.index(slot).load(col_layout)
    # dP^T done, dV += P^T dO runs on under the dS arithmetic
    dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    ds = p * (dp - delta[None, :])
    ds16 = gl.convert_layout(ds.to(dtype), a_layout)
    dk_tok = warpgroup_mma(ds16, q_view, dk, is_async=True)
    dv, dk, p16, ds16 = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p16, ds16))
    mbarrier.arrive(empty.index(slot))
    return dk, dv


@gluon.jit
def _dkdv_consumer(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, q_ready,
                   do_ready, l_ready, empty, dk_desc, dv_desc, SLOPES, stride_sb, batch, kv_head, n0, GROUP, band, tiles,
                   qk_scale, sm_scale, len_q, len_kv, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   HAS_ALIBI: gl.constexpr, STAGES: gl.constexpr, HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr):
    """Consumer warpgroup WG: dK, dV of keys [n0 + 64 WG, +64). Padding: rows past len_q are zeroed
    in each head's last query tile, keys past len_kv get dK = dV = 0."""
    WG_N: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    zero_s = gl.zeros([WG_N, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([WG_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([WG_N, HEAD_D], gl.float32, acc_layout)
    keys = n0 + WG * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(1, s_layout))
    k_view = k_smem.index(WG).reshape([WG_N, HEAD_D])
    v_view = v_smem.index(WG).reshape([WG_N, HEAD_D])
    mbarrier.wait(kv_bar, 0)

    t_lo, t_a, t_b, t_hi = tiles
    diag, win_left, win_right = band
    t_wg = t_lo
    if HAS_RIGHT:
        # tiles [t_lo, t_wg) have no row that sees a key of this warpgroup (warpgroup 1's first tile on
        # the diagonal): their slots are handed back unread
        t_wg = gl.minimum(gl.maximum(gl.maximum(n0 + WG * WG_N - diag - win_right, 0) // BLOCK_M, t_lo), t_a)
    slope2 = qk_scale * 0.0
    it = 0
    for g in range(GROUP):
        if HAS_ALIBI:
            slope2 = _alibi_slope2(SLOPES, batch, kv_head * GROUP + g, stride_sb)
        if HAS_RIGHT:
            for t in range(t_lo, t_wg):
                slot = it % STAGES
                # the slot's data has landed, so the previous round's arrivals are all in and this
                # arrival counts for this round
                mbarrier.wait(q_ready.index(slot), (it // STAGES) & 1)
                mbarrier.arrive(empty.index(slot))
                it += 1
        for t in range(t_wg, t_a):
            dk, dv = _dkdv_step(it, t, k_view, v_view, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
                                l_ready, empty, dk, dv, zero_s, keys, band, slope2, qk_scale, True, HAS_LEFT,
                                HAS_RIGHT, HAS_ALIBI, STAGES, HAS_SEQ_Q)
            it += 1
        for t in range(t_a, t_b):
            dk, dv = _dkdv_step(it, t, k_view, v_view, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
                                l_ready, empty, dk, dv, zero_s, keys, band, slope2, qk_scale, False,
                                HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, HAS_SEQ_Q)
            it += 1
        for t in range(t_b, t_hi):
            dk, dv = _dkdv_step(it, t, k_view, v_view, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
                                l_ready, empty, dk, dv, zero_s, keys, band, slope2, qk_scale, True, HAS_LEFT,
                                HAS_RIGHT, HAS_ALIBI, STAGES, HAS_SEQ_Q)
            it += 1

    if HAS_SEQ_KV:
        dk = _zero_key_rows(dk, n0 + WG * WG_N, len_kv)
        dv = _zero_key_rows(dv, n0 + WG * WG_N, len_kv)
    # epilogue: through this warpgroup's own (now unused) K and V tiles; TMA clips keys >= S_KV
    v_view.store(dv.to(dtype))
    k_view.store((dk * sm_scale).to(dtype))
    fence_async_shared()
    tma_store(dv_desc, [batch, kv_head, n0 + WG * WG_N, 0], v_smem.index(WG))
    tma_store(dk_desc, [batch, kv_head, n0 + WG * WG_N, 0], k_smem.index(WG))
    tma.store_wait(0)


# ----------------------------------------------------------------------------------------------
# SPLIT variant (tile width 256: d 224 and 256), module docstring "Head dims 224 and 256"


@gluon.jit
def _p_dv_step(it, t, k_view, q_smem, do_smem, lse_smem, x_smem, q_ready, do_ready, l_ready, empty, x_ready,
               x_empty, dv, zero_s, keys, key0, band, slope2, qk_scale, drop, MASKED: gl.constexpr,
               HAS_LEFT: gl.constexpr,
               HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, STAGES: gl.constexpr, DV_FIRST: gl.constexpr,
               HAS_SEQ_Q: gl.constexpr, DROPOUT: gl.constexpr, fp8=None, FP8_EMU: gl.constexpr = False,
               P_E5M2: gl.constexpr = False):
    """Warpgroup 0, one query tile: P^T into exchange slot it % 2, and dV += P^T dO.

    DROPOUT (``drop``: ``dropout.state`` of this query head): the keep bit (``dropout.keep`` on the
    transposed tile, the forward's mask) rides in the exchanged P^T's sign, ps = P kept, -P dropped
    (P >= 0; -0.0 keeps its sign in fp16), and dV accumulates max(ps, 0)^T dO, the kept P without
    1 / (1 - p) (applied once at the end).
    FP8_EMU ([Note] FP8): dV += P8^T dO8 with P8 = fp8(P * scale_s) (fp8 = (scale_s, ...); e5m2 where P_E5M2),
    held in fp16; the exchange keeps P itself."""
    BLOCK_M: gl.constexpr = zero_s.shape[1]
    HEAD_D: gl.constexpr = k_view.shape[1]
    col_layout: gl.constexpr = gl.SliceLayout(0, zero_s.type.layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv.type.layout, k_width=2)
    slot = it % STAGES
    phase = (it // STAGES) & 1
    xs = it % 2
    q_view = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
    do_view = do_smem.index(slot).reshape([BLOCK_M, HEAD_D])
    if HAS_SEQ_Q:
        # padding: the producer zeroes a tile's rows past len_q before it releases l_ready
        mbarrier.wait(l_ready.index(slot), phase)

    mbarrier.wait(q_ready.index(slot), phase)
    s_tok = warpgroup_mma(k_view, q_view.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(l_ready.index(slot), phase)
    lse2 = lse_smem.index(slot).load(col_layout)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    p = _pt_tile(s, qk_scale, lse2, t, keys, band, slope2, MASKED, HAS_LEFT, HAS_RIGHT, HAS_ALIBI)
    if DROPOUT:
        s_layout: gl.constexpr = zero_s.type.layout
        p = gl.where(dropout.keep(drop, key0, t * BLOCK_M, s_layout, BLOCK_M, False), p, -p)
    # P^T for warpgroup 1 (fp16 whatever the input dtype: 11 bits for dS = P (dP - delta)) into
    # slot xs once its previous P^T (tile it - 2) has been read. The arrive follows a warpgroup
    # barrier (Gluon's lowering), so all 128 threads' stores are in before warpgroup 1 reads.
    # DV_FIRST: issue dV += P^T dO first and do the exchange under it.
    px = p.to(gl.float16)
    if DROPOUT:
        p = gl.maximum(p, 0.0)
    if FP8_EMU:
        p16 = gl.convert_layout(_fp8_round16(p * fp8[0], P_E5M2), a_layout)
    else:
        p16 = gl.convert_layout(p.to(k_view.dtype), a_layout)
    if not DV_FIRST:
        mbarrier.wait(x_empty.index(xs), ((it // 2) & 1) ^ 1)
        x_smem.index(xs).store(px)
        mbarrier.arrive(x_ready.index(xs))
    mbarrier.wait(do_ready.index(slot), phase)
    dv_tok = warpgroup_mma(p16, do_view, dv, is_async=True)
    if DV_FIRST:
        mbarrier.wait(x_empty.index(xs), ((it // 2) & 1) ^ 1)
        x_smem.index(xs).store(px)
        mbarrier.arrive(x_ready.index(xs))
    dv, p16 = warpgroup_mma_wait(0, deps=(dv_tok, p16))
    mbarrier.arrive(empty.index(slot))
    return dv


@gluon.jit
def _dp_dk_step(it, t, v_view, q_smem, do_smem, delta_smem, x_smem, q_ready, do_ready, l_ready, empty, x_ready,
                x_empty, dk, zero_s, keep_scale, STAGES: gl.constexpr, HAS_SEQ_Q: gl.constexpr,
                DROPOUT: gl.constexpr, fp8=None, kmax=None, FP8_EMU: gl.constexpr = False,
                DS_E5M2: gl.constexpr = False):
    """Warpgroup 1, one query tile: dP^T, P^T from exchange slot it % 2, dS^T, dK += dS^T Q.

    No mask: P^T is already 0 where a row must not see a key, so dS^T is too. DROPOUT: the
    exchanged ps carries the keep bit in its sign (``_p_dv_step``), and with r = 1 / (1 - p),
    dS = P * (dP * keep * r - delta) = r * (max(ps, 0) * dP - |ps| * delta * keep_scale) with
    keep_scale = 1 - p; dK accumulates it without r (applied once at the end).
    FP8_EMU ([Note] FP8): dS^T * scale_dP = P^T (dP^T_raw a - delta_raw b) (fp8 = (scale_s, a, b)), its max
    |.| per key into kmax, rounded to FP8 (e5m2 where DS_E5M2) in fp16 for dK += dS8^T Q8.
    Returns dK and kmax (unchanged without FP8_EMU)."""
    BLOCK_M: gl.constexpr = zero_s.shape[1]
    HEAD_D: gl.constexpr = v_view.shape[1]
    s_layout: gl.constexpr = zero_s.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    slot = it % STAGES
    phase = (it // STAGES) & 1
    xs = it % 2
    q_view = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
    do_view = do_smem.index(slot).reshape([BLOCK_M, HEAD_D])
    if HAS_SEQ_Q:
        # padding: the producer zeroes a tile's rows past len_q before it releases l_ready
        mbarrier.wait(l_ready.index(slot), phase)

    mbarrier.wait(do_ready.index(slot), phase)
    dp_tok = warpgroup_mma(v_view, do_view.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(l_ready.index(slot), phase)
    delta = delta_smem.index(slot).load(col_layout)
    # P^T arrives from warpgroup 0 while dP^T runs
    mbarrier.wait(x_ready.index(xs), (it // 2) & 1)
    p = x_smem.index(xs).load(s_layout).to(gl.float32)
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    if DROPOUT:
        ds = gl.maximum(p, 0.0) * dp - gl.abs(p) * (delta * keep_scale)[None, :]
    elif FP8_EMU:
        ds = p * (dp * fp8[1] - (delta * fp8[2])[None, :])
        kmax = gl.maximum(kmax, gl.max(gl.abs(ds), axis=1))
    else:
        ds = p * (dp - delta[None, :])
    mbarrier.arrive(x_empty.index(xs))
    if FP8_EMU:
        ds16 = gl.convert_layout(_fp8_round16(ds, DS_E5M2), a_layout)
    else:
        ds16 = gl.convert_layout(ds.to(v_view.dtype), a_layout)
    mbarrier.wait(q_ready.index(slot), phase)
    dk_tok = warpgroup_mma(ds16, q_view, dk, is_async=True)
    dk, ds16 = warpgroup_mma_wait(0, deps=(dk_tok, ds16))
    mbarrier.arrive(empty.index(slot))
    return dk, kmax


@gluon.jit
def _split_consumer(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, x_smem, kv_bar,
                    q_ready, do_ready, l_ready, empty, x_ready, x_empty, dk_desc, dv_desc, SLOPES, stride_sb, batch, kv_head,
                    n0, GROUP, band, tiles, qk_scale, sm_scale, len_q, len_kv, drop_args, HAS_LEFT: gl.constexpr,
                    HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, STAGES: gl.constexpr, DV_FIRST: gl.constexpr,
                    HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr, DROPOUT: gl.constexpr, fp8_io=None,
                    FP8_EMU: gl.constexpr = False, P_E5M2: gl.constexpr = False, DS_E5M2: gl.constexpr = False,
                    D: gl.constexpr = 0):
    """Consumer warpgroup WG of the SPLIT variant, keys [n0, n0 + 64): WG 0 computes P^T and dV,
    WG 1 dP^T, dS^T and dK; each keeps its one [64, HEAD_D] fp32 accumulator in registers.
    DROPOUT (any tile width: the Philox words need the registers a second accumulator would take):
    drop_args = (seed, offset, threshold, 1 / (1 - p), S_Q, S_KV, bh of the group's first query head);
    warpgroup 0 makes the mask, warpgroup 1 reads it from the sign of the exchanged P^T.
    FP8_EMU ([Note] FP8): fp8_io = (SCALES, AMAX, dK's output, dV's output, S_KV); P's and dS's FP8 types e5m2
    where P_E5M2 / DS_E5M2; D: the gradients' head dim where narrower than the tile (224), else 0."""
    WG_N: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    zero_s = gl.zeros([WG_N, BLOCK_M], gl.float32, s_layout)
    acc = gl.zeros([WG_N, HEAD_D], gl.float32, acc_layout)       # dV (WG 0) or dK (WG 1)
    keys = n0 + gl.arange(0, WG_N, layout=gl.SliceLayout(1, s_layout))
    k_view = k_smem.index(0).reshape([WG_N, HEAD_D])
    v_view = v_smem.index(0).reshape([WG_N, HEAD_D])
    mbarrier.wait(kv_bar, 0)

    t_lo, t_a, t_b, t_hi = tiles
    slope2 = qk_scale * 0.0
    it = 0     # position in the producer's sequence of (head, query tile): ring slot and phases
    keep_scale = qk_scale * 0.0 + 1.0
    if DROPOUT:
        keep_scale = 1.0 / drop_args[3]
    fp8 = None
    # FP8_EMU: max |dS * scale_dP| per key (warpgroup 1; loop-carried, folded away in the 16-bit kernel)
    kmax = gl.zeros([WG_N], gl.float32, gl.SliceLayout(1, s_layout))
    if FP8_EMU:
        gl.static_assert(not (DROPOUT or HAS_ALIBI or HAS_SEQ_Q or HAS_SEQ_KV), "FP8: masks and windows only")
        qk_scale, ds_a, ds_b = _fp8_ds_factors(fp8_io[0], qk_scale, sm_scale)
        fp8 = (gl.load(fp8_io[0] + 7), ds_a, ds_b)        # scale_s (SCALES[7]) for P8
    for g in range(GROUP):
        if WG == 0:
            if HAS_ALIBI:
                slope2 = _alibi_slope2(SLOPES, batch, kv_head * GROUP + g, stride_sb)
            drop = 0
            if DROPOUT:
                seed, offset, threshold, rescale, s_q, s_kv, bh0 = drop_args
                drop = dropout.state(seed, offset, bh0 + g, s_q, s_kv, threshold, rescale)
            for t in range(t_lo, t_a):
                acc = _p_dv_step(it, t, k_view, q_smem, do_smem, lse_smem, x_smem, q_ready, do_ready, l_ready,
                                 empty, x_ready, x_empty, acc, zero_s, keys, n0, band, slope2, qk_scale, drop, True,
                                 HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, DV_FIRST, HAS_SEQ_Q, DROPOUT, fp8,
                                 FP8_EMU, P_E5M2)
                it += 1
            for t in range(t_a, t_b):
                acc = _p_dv_step(it, t, k_view, q_smem, do_smem, lse_smem, x_smem, q_ready, do_ready, l_ready,
                                 empty, x_ready, x_empty, acc, zero_s, keys, n0, band, slope2, qk_scale, drop, False,
                                 HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, DV_FIRST, HAS_SEQ_Q, DROPOUT, fp8,
                                 FP8_EMU, P_E5M2)
                it += 1
            for t in range(t_b, t_hi):
                acc = _p_dv_step(it, t, k_view, q_smem, do_smem, lse_smem, x_smem, q_ready, do_ready, l_ready,
                                 empty, x_ready, x_empty, acc, zero_s, keys, n0, band, slope2, qk_scale, drop, True,
                                 HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, DV_FIRST, HAS_SEQ_Q, DROPOUT, fp8,
                                 FP8_EMU, P_E5M2)
                it += 1
        else:
            # the mask is in P^T already: one loop over every tile
            for t in range(t_lo, t_hi):
                acc, kmax = _dp_dk_step(it, t, v_view, q_smem, do_smem, delta_smem, x_smem, q_ready, do_ready,
                                        l_ready, empty, x_ready, x_empty, acc, zero_s, keep_scale, STAGES, HAS_SEQ_Q,
                                        DROPOUT, fp8, kmax, FP8_EMU, DS_E5M2)
                it += 1

    # epilogue through the warpgroup's own operand tile (WG 0 reads only K, WG 1 only V, so the
    # other warpgroup may still be running); TMA clips keys >= S_KV and, at d=224, columns >= 224
    if HAS_SEQ_KV:
        acc = _zero_key_rows(acc, n0, len_kv)
    if DROPOUT:
        acc = acc * drop_args[3]      # the loops left out 1 / (1 - p)
    if FP8_EMU:
        # [Note] FP8: amax_dP = max |dS| over the keys inside the sequence; dV, dK descaled in the emulation's
        # order and written from registers in the gradients' own type
        SCALES = fp8_io[0]
        AMAX = fp8_io[1]
        S_KV = fp8_io[4]
        if WG == 0:
            _fp8_grad_write(acc * gl.load(SCALES + 5) * gl.load(SCALES + 4), n0, S_KV, fp8_io[3], batch, kv_head,
                            SCALES + 10, AMAX + 2, D)
        else:
            gl.atomic_max(AMAX + 3, gl.max(gl.where(keys < S_KV, kmax, 0.0), 0) / gl.load(SCALES + 11))
            _fp8_grad_write(acc * gl.load(SCALES + 6) * gl.load(SCALES), n0, S_KV, fp8_io[2], batch, kv_head,
                            SCALES + 9, AMAX + 1, D)
    elif WG == 0:
        _store_acc(acc, k_smem.index(0), dv_desc, batch, kv_head, n0)
    else:
        _store_acc(acc * sm_scale, v_smem.index(0), dk_desc, batch, kv_head, n0)


@gluon.jit
def _store_acc(acc, tile, desc, batch, kv_head, n0):
    """acc (fp32 [64, HEAD_D]) -> 16-bit shared tile [1, 1, 64, HEAD_D] -> TMA store at key n0."""
    tile.reshape([acc.shape[0], acc.shape[1]]).store(acc.to(tile.dtype))
    fence_async_shared()
    tma_store(desc, [batch, kv_head, n0, 0], tile)
    tma.store_wait(0)


@gluon.jit(do_not_specialize_on_alignment=["CHUNK"])     # CHUNK: == 1 or not, one compile for every other value
def _attn_bwd_dkdv_sm90(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, stride_lb, stride_lh, stride_lm,
                        DELTA, SLOPES, stride_sb, SEQ_Q, SEQ_KV, H_KV, H_Q, GROUP, S_Q, S_KV, qk_scale, sm_scale, win_left,
                        win_right, DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE, CHUNK, STAGES: gl.constexpr,
                        HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                        BOTTOM_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, SPLIT: gl.constexpr,
                        DV_FIRST: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr, DROPOUT: gl.constexpr = False,
                        HEAVY_FIRST: gl.constexpr = False, SCALES=None, AMAX=None, DK_OUT=None, stride_dkb=0,
                        stride_dkh=0, stride_dkm=0, DV_OUT=None, stride_dvb=0, stride_dvh=0, stride_dvm=0,
                        FP8_EMU: gl.constexpr = False, P_E5M2: gl.constexpr = False, DS_E5M2: gl.constexpr = False,
                        D: gl.constexpr = 0):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    WG_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    N_KV: gl.constexpr = 1 if SPLIT else 2     # 64-key tiles per CTA: one per warpgroup, or one shared
    BLOCK_N: gl.constexpr = N_KV * WG_N
    dtype: gl.constexpr = q_desc.dtype

    pid_n = gl.program_id(0)     # key block 0 has the most query tiles under a causal mask: it runs first
    bh = gl.program_id(1)
    if HEAVY_FIRST:
        # the linear program id in chunks of CHUNK (batch, kv head) pairs, key block outermost inside a chunk:
        # key block 0 of every pair of the chunk is dispatched before any key block 1, and so on
        n_blocks = gl.num_programs(0)
        pid_n, bh = _heavy_first(pid_n + bh * n_blocks, n_blocks, CHUNK)
    batch = bh // H_KV
    kv_head = bh % H_KV
    n0 = pid_n * BLOCK_N
    len_q = _seq_length(SEQ_Q, batch, S_Q, HAS_SEQ_Q)
    len_kv = _seq_length(SEQ_KV, batch, S_KV, HAS_SEQ_KV)
    diag = S_Q * 0
    if BOTTOM_RIGHT:
        diag = len_kv - len_q      # bottom-right: each sequence's own lengths
    t_lo, t_a, t_b, t_hi = _q_tiles(n0, len_q, len_kv, diag, win_left, win_right, HAS_LEFT, HAS_RIGHT, BLOCK_M,
                                    BLOCK_N)
    if HAS_SEQ_KV:
        # a key block wholly past len_kv visits no query tile (its dK/dV rows are written as 0)
        t_hi = gl.where(n0 < len_kv, t_hi, t_lo)
        t_a = gl.minimum(t_a, t_hi)
        t_b = gl.minimum(t_b, t_hi)
    tiles = (t_lo, t_a, t_b, t_hi)
    band = (diag, win_left, win_right)
    gl.static_assert(SPLIT or not DROPOUT, "dropout runs the SPLIT variant (_split_consumer)")
    drop_args = 0
    if DROPOUT:
        drop_args = (DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE, S_Q, S_KV, batch * H_Q + kv_head * GROUP)

    k_smem = gl.allocate_shared_memory(dtype, [N_KV, 1, 1, WG_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [N_KV, 1, 1, WG_N, HEAD_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    l_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(l_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)     # one arrival from each consumer warpgroup

    gl.static_assert(SPLIT or not FP8_EMU, "FP8 runs the SPLIT variant (_split_consumer)")
    if FP8_EMU:
        fp8_io = (SCALES, AMAX, (DK_OUT, stride_dkb, stride_dkh, stride_dkm),
                  (DV_OUT, stride_dvb, stride_dvh, stride_dvm), S_KV)
    else:
        # stand-ins of the same structure (warp_specialize takes typed values only), never read
        fp8_io = (DELTA, DELTA, (DELTA, S_KV, S_KV, S_KV), (DELTA, S_KV, S_KV, S_KV), S_KV)
    if SPLIT:
        # P^T exchange, warpgroup 0 -> 1: two [keys, rows] fp16 slots with ready/empty barriers
        x_smem = gl.allocate_shared_memory(gl.float16, [2, WG_N, BLOCK_M],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(x_ready.index(i), count=1)
            mbarrier.init(x_empty.index(i), count=1)
        gl.warp_specialize([
            (_split_consumer, (0, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, x_smem, kv_bar.index(0),
                               q_ready, do_ready, l_ready, empty, x_ready, x_empty, dk_desc, dv_desc, SLOPES, stride_sb, batch,
                               kv_head, n0, GROUP, band, tiles, qk_scale, sm_scale, len_q, len_kv, drop_args,
                               HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, DV_FIRST, HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT,
                               fp8_io, FP8_EMU, P_E5M2, DS_E5M2, D)),
            (_split_consumer, (1, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, x_smem, kv_bar.index(0),
                               q_ready, do_ready, l_ready, empty, x_ready, x_empty, dk_desc, dv_desc, SLOPES, stride_sb, batch,
                               kv_head, n0, GROUP, band, tiles, qk_scale, sm_scale, len_q, len_kv, drop_args,
                               HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, DV_FIRST, HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT,
                               fp8_io, FP8_EMU, P_E5M2, DS_E5M2, D)),
            (_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                              kv_bar.index(0), q_ready, do_ready, l_ready, empty, LSE, stride_lb, stride_lh,
                              stride_lm, DELTA, SLOPES, stride_sb, batch, kv_head, n0, H_Q, GROUP, S_Q, len_q, t_lo, t_hi,
                              STAGES, HAS_ALIBI, HAS_SEQ_Q)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        return

    gl.warp_specialize([
        (_dkdv_consumer, (0, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar.index(0), q_ready,
                          do_ready, l_ready, empty, dk_desc, dv_desc, SLOPES, stride_sb, batch, kv_head, n0, GROUP, band, tiles,
                          qk_scale, sm_scale, len_q, len_kv, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, HAS_SEQ_Q,
                          HAS_SEQ_KV)),
        (_dkdv_consumer, (1, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar.index(0), q_ready,
                          do_ready, l_ready, empty, dk_desc, dv_desc, SLOPES, stride_sb, batch, kv_head, n0, GROUP, band, tiles,
                          qk_scale, sm_scale, len_q, len_kv, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, STAGES, HAS_SEQ_Q,
                          HAS_SEQ_KV)),
        (_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                          kv_bar.index(0), q_ready, do_ready, l_ready, empty, LSE, stride_lb, stride_lh, stride_lm,
                          DELTA, SLOPES, stride_sb, batch, kv_head, n0, H_Q, GROUP, S_Q, len_q, t_lo, t_hi, STAGES,
                          HAS_ALIBI, HAS_SEQ_Q)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# host side


def supports(p, q, k, v, grad_out, dk, dv, *, slopes=None, seq_len_q=None, seq_len_kv=None) -> bool:
    """True when this kernel computes exactly the dK/dV that ``p`` asks for on these tensors.

    The problem half is cached per problem; the tensor half (sm_90 GPU, dtypes, TMA's stride
    rules on q, k, v, grad_out, dk, dv; ALiBi slopes fp32 [b, h_q]; int32 [b] lengths when padded)
    is checked each call."""
    if not (_problem_ok(p) and isinstance(q, torch.Tensor) and q.is_cuda and _is_sm90(q.device.index)):
        return False
    if p.alibi is not None and not _slopes_ok(p, slopes):
        return False
    if not _padding_ok(p, seq_len_q, seq_len_kv):
        return False
    return all(t.dtype == p.dtype and _tma_ready(t) for t in (q, k, v, grad_out, dk, dv))


@functools.lru_cache(maxsize=256)
def _problem_ok(p) -> bool:
    """The forward's filter (no mask, causal, sliding windows, ALiBi, padding, dropout; plain inputs,
    fp16/bf16, d = d_v) at this pass's head dims, and row offsets b * h_q * s_q (the lse/delta rows)
    that fit int32."""
    return _bwd_problem_ok(p, SUPPORTED_DIMS) and p.b * p.h_q * p.s_q < 2 ** 31


def launch_dkdv_sm90(p, q, k, v, grad_out, lse, delta, dk, dv, *, slopes=None, seq_len_q=None, seq_len_kv=None,
                     stages=None, dv_first=None, heavy_first=None, fp8=None):
    """dK, dV of attention on Hopper, written in place.

    q [b,h_q,s_q,d], k/v [b,h_kv,s_kv,d], grad_out [b,h_q,s_q,d], dk/dv like k/v: any strides with
    unit last stride (``supports`` checks them); lse fp32 [b,h_q,s_q] view (any strides,
    natural log, the forward's); delta fp32 contiguous [b*h_q, s_q] (rowsum(dO * O)); slopes fp32
    [b, h_q] when p.alibi; seq_len_q / seq_len_kv int32 [b] when p has them (padding: rows past len_q
    add nothing, dK/dV rows of keys past len_kv are written as 0). stages overrides ``STAGES``,
    dv_first ``DV_FIRST``, heavy_first ``HEAVY_FIRST`` (tuning). fp8 ([Note] FP8; tile width 256): (scales,
    amax, P's type is e5m2, dS's type is e5m2); q, k, v, grad_out then hold FP8 values in fp16 (p's dtype fp16),
    delta the raw rowsum(dO8 o), and dk / dv are the gradients in their own type (any strides, unit last),
    written from registers with amax_dK / amax_dV / amax_dP into amax[1:4]."""
    if (p.has_seq_len_q and seq_len_q is None) or (p.has_seq_len_kv and seq_len_kv is None):
        raise ValueError("the problem has per-batch lengths: pass seq_len_q / seq_len_kv")
    band = p.band
    has_left = band is not None and band.left is not None
    has_right = band is not None and band.right is not None
    td = TILE_D[p.d]
    stages = stages or STAGES[td, band is not None]
    assert delta.is_contiguous() and delta.dtype == torch.float32
    # dropout takes the SPLIT variant at every tile width (``_split_consumer``)
    split = SPLIT[td] or p.has_dropout
    block_n = WG_N if split else BLOCK_N
    grid = (cdiv(p.s_kv, block_n), p.b * p.h_kv)
    heavy = HEAVY_FIRST[has_right and not has_left] if heavy_first is None else heavy_first
    fp8_kw = {}
    if fp8 is not None:
        scales, amax, p_e5m2, ds_e5m2 = fp8
        fp8_kw = dict(SCALES=scales, AMAX=amax, DK_OUT=dk, stride_dkb=dk.stride(0), stride_dkh=dk.stride(1),
                      stride_dkm=dk.stride(2), DV_OUT=dv, stride_dvb=dv.stride(0), stride_dvh=dv.stride(1),
                      stride_dvm=dv.stride(2), FP8_EMU=True, P_E5M2=bool(p_e5m2), DS_E5M2=bool(ds_e5m2),
                      D=p.d if p.d < td else 0)
    # FP8: k and v stand in for dk's and dv's descriptors (the FP8 epilogue stores from registers)
    dk_tile, dv_tile = (dk, dv) if fp8 is None else (k, v)
    launch(
        _attn_bwd_dkdv_sm90, grid,
        _tma(q, BLOCK_M), _tma(k, WG_N), _tma(v, WG_N), _tma(grad_out, BLOCK_M), _tma(dk_tile, WG_N), _tma(dv_tile, WG_N), lse, *lse.stride(), delta, slopes if p.alibi is not None else delta,
        slopes.stride(0) if p.alibi is not None else 0,
        seq_len_q if p.has_seq_len_q else delta, seq_len_kv if p.has_seq_len_kv else delta, p.h_kv, p.h_q, p.group, p.s_q, p.s_kv, p.scale * LOG2E, p.scale,
        band.left if has_left else 0, band.right if has_right else 0,
        *dropout.kernel_args(p), _chunk(grid, q.device.index) if heavy else 1,
        STAGES=stages, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        BOTTOM_RIGHT=band is not None and band.alignment == "bottom_right", HAS_ALIBI=p.alibi is not None,
        SPLIT=split, DV_FIRST=DV_FIRST if dv_first is None else dv_first,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, HAS_SEQ_Q=p.has_seq_len_q,
        HAS_SEQ_KV=p.has_seq_len_kv, DROPOUT=p.has_dropout, HEAVY_FIRST=heavy, num_warps=4, **fp8_kw,
    )
    return dk, dv


# ----------------------------------------------------------------------------------------------
# the FP8 switch at tile width 256 ([Note] FP8)

def supports_fp8(p, q8, k8, v8, o, do8, dq, dk, dv) -> bool:
    """True when the two passes' FP8 switch runs this ``fusedattn.fp8.sdpa_fp8_backward`` call: sm_90, d = d_v
    in 224 / 256 (the SPLIT variant's tile width; d = 64 / 128 run the single-pass kernel's switch), no mask,
    causal or a sliding window (either alignment), GQA, no lengths; q / k / v of one float8 type, dO float8,
    o any float type, every tensor with a unit last stride."""
    from ... import fp8      # late: fusedattn.fp8 loads this module on demand
    p16 = dataclasses.replace(p, dtype=torch.float16)       # the kernels' 16-bit MMAs on the FP8 values
    if not (isinstance(q8, torch.Tensor) and q8.is_cuda and _is_sm90(q8.device.index) and _problem_ok(p16)):
        return False
    if p.d != p.d_v or TILE_D.get(p.d) != 256 or p.has_seq_len_q or p.has_seq_len_kv or p.alibi is not None \
            or p.has_dropout:
        return False
    if not (fp8.is_fp8(q8) and k8.dtype == q8.dtype and v8.dtype == q8.dtype and fp8.is_fp8(do8)):
        return False
    return all(t.stride(-1) == 1 for t in (q8, k8, v8, o, do8, dq, dk, dv))


def launch_bwd_fp8(p, q8, k8, v8, o, do8, lse, scales, amax, dq, dk, dv):
    """``fusedattn.fp8.sdpa_fp8_backward`` on the two Gluon passes' FP8 switch ([Note] FP8), written in place: the
    dQ pass (which writes delta = rowsum(dO8 o) from the raw values), then the dK/dV pass.

    q8 [b,h_q,s_q,d], k8 / v8 [b,h_kv,s_kv,d]: one float8 type; do8 [b,h_q,s_q,d] float8 (e4m3 or e5m2); o the
    forward's output (float8 or any float); lse fp32 [b,h_q,s_q] view (natural log). scales: fp32 contiguous
    [12] on the device in ``triton.bwd.FP8_BWD_SCALE_NAMES``' order; amax: fp32 [4] (dQ, dK, dV, dP), zeroed by
    the caller. dq / dk / dv: the gradients in any of the FP8 door's types (any strides, unit last)."""
    p16 = dataclasses.replace(p, dtype=torch.float16)
    # exact fp16 copies, one streaming kernel each (fwd_sm90 ``widened_fp16``)
    q, k, v, grad_out = (widened_fp16(t) for t in (q8, k8, v8, do8))
    delta = torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=q8.device)
    launch_dq_sm90(p16, q, k, v, grad_out, lse, delta, dq, out=o, fp8=(scales, amax, do8.dtype == torch.float8_e5m2))
    launch_dkdv_sm90(p16, q, k, v, grad_out, lse, delta, dk, dv,
                     fp8=(scales, amax, q8.dtype == torch.float8_e5m2, do8.dtype == torch.float8_e5m2))
    return dq, dk, dv
