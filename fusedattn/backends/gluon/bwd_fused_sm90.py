"""Attention backward in ONE pass for Hopper (sm_90) in Gluon, d=128: FlashAttention-3 style (experimental).

The dK/dV pass (``bwd_dkdv_sm90``, non-SPLIT path) with dQ added, so no separate dQ pass: per
(key tile, query tile) pair 5 matmuls (S^T, dP^T, dV, dK, dQ) instead of the two-pass backward's 7
(the dQ pass recomputes S and dP). dQ is accumulated in fp32 in global memory by reduce-adds from
every key block (not deterministic: the order of the adds varies; ``bwd_dq_sm90`` + ``bwd_dkdv_sm90``
stay the deterministic path).

One program (CTA) owns keys [n0, n0 + 128) of one (batch, kv head) and loops over every query tile
(64 rows) of every query head of the kv head's GQA group, as the dK/dV pass:

* producer (1 warp): ``bwd_dkdv_sm90._dkdv_producer`` (with REVERSE): K, V once; Q, dO
  tiles through a ring of STAGES slots; lse2 / delta rows through a small shared ring.
* two consumer warpgroups: warpgroup WG owns keys [n0 + 64 WG, +64) with its dK, dV [64, 128] fp32
  accumulators in registers (128 of its 240 registers per thread).

Per query tile i (rows [64 t, +64) of head h), in warpgroup WG (xb = i % 2 the dS buffer):

    S^T  = K_WG Q_i^T,  dP^T = V_WG dO_i^T     async wgmmas (shared-memory operands)
    P^T  = exp2(S^T qk_scale - lse2)           masked on causal diagonal tiles only (``_pt_tile``)
    dV  += P^T dO_i                            async, P^T from registers
    dS^T = P^T (dP^T - delta)
    dK  += dS^T Q_i                            async, dS^T from registers
    dS^T (16-bit) -> ds_smem[xb][WG]           [64 keys, 64 rows]; fence; arrive ds_ready[xb] (count 2)
    wait ds_ready[xb]                          both warpgroups' halves are in
    dQ_i[:, 64 WG : +64] = dS_i K[:, 64 WG : +64]   two async wgmmas (K = 64 keys each: the two key
                                               halves), A = ds_smem[xb][h] permuted to [rows, keys]
                                               (MN-major A from shared memory), B = K tile h's
                                               64-column slice; acc [64, 64] fp32 = 32 registers
    wait for dV, dK, dQ; release the Q/dO slot and ds buffer xb (ds_empty, count 2)
    dQ half -> fp32 staging tile -> TMA reduce-add into dq_acc[b, h, rows, cols]
                                               (``cp.reduce.async.bulk.tensor .add``, clipped at s_q)

The dQ accumulator is live only after S^T / dP^T / P^T are dead (dK + dV 128, dQ 32, the two 16-bit
A operands 16 + 16 while their wgmmas run). The dS buffers are double-buffered so a warpgroup may run
one tile ahead of the other. The staging tile is single-buffered per warpgroup: ``tma.store_wait(0)``
(``cp.async.bulk.wait_group.read``, then a warpgroup barrier from the membar pass) before it is
rewritten, one tile later. Triton 3.6's Gluon has the TMA reduce in its builder
(``create_async_tma_reduce``) but no wrapper: ``_tma_reduce_add``.

Host side: dq_acc (fp32 [b, h_q, s_q, 128], contiguous) is zeroed, delta = rowsum(dO * O) comes from
the caller (as the dK/dV pass), and a small Triton kernel writes dq = scale * dq_acc in dq's dtype.

Epilogue: dV through the warpgroup's own V tile (only it reads V_WG); dK through its K tile once the
other warpgroup is done with its dQ products (which read both K tiles): an mbarrier of count 2.

Causal (either alignment) as the dK/dV pass (``_q_tiles``); warpgroup 1 no longer skips the query tiles
that see none of its keys (its dS half, all 0, is part of every dQ product). Rows >= s_q: zero-filled Q
and dO, lse +inf, so P = dS = 0 and the reduce clips them; rows that see no key get dQ = 0. Keys >= s_kv
(zero-filled K, V) are not masked: their dS meets a zero K row in the dQ product (finite P assumed, as
the dK/dV pass assumes it for dV).

Switches (constexpr; module dicts keyed by causal, and keywords of ``launch_bwd_fused_sm90``):

* Order (``REVERSE``): each CTA visits its query tiles last first (band edge, mask-free middle, diagonal).
  Under a causal mask the CTAs of one head then work on the same query tile at the same time (as without
  a mask, where every CTA starts at tile 0), so Q/dO loads and the dQ reduce-adds of concurrent CTAs hit
  the same L2 lines. H100: causal +0-5% (GQA 4k +5%).
* Lag (``LAG``): warpgroup 1 computes tile i's dQ columns at tile i + 1 (waits only for warpgroup 0's dS
  of tile i - 1, and warpgroup 0 for its dS of tile i), so the two need not meet at the same point of
  every tile; the last tile's columns after the loop; a reduce at row s_q (the first step's) is dropped
  whole by TMA. H100: no gain anywhere, GQA 4k causal -2..-12%: off.
* dQ staging (``DQ_FLAT``): two [64, 32] 128-byte-swizzled boxes per warpgroup (conflict-free stores, the
  register tile split by ``gl.split``) or one unswizzled [64, 64] box (one base address, 4-8 fewer spill
  accesses per loop, 8-way bank conflicts on the 16 STS.64). H100: swizzled +5-8% without a mask and at
  GQA 4k, even (+-1%) elsewhere: swizzled.
* ``P16_DS``: dS from the 16-bit P (the dV operand), so the fp32 P dies at the dV issue. bf16 needs an
  unpack per element (F2F + PRMT + IMAD.U32, +50 instructions per loop); spills 14 -> 8 (bf16), 0 (fp16).
  H100: -3..-7%: off. ``stages=3`` (231552 bytes of shared memory): -1..-10% (first sweep): 2.

[Note] status (H100, bench/gluon_fused_sweep.py --variants, three runs; whole backward
TFLOP/s = 2.5x forward flops, /2 causal, including the delta pass, the dq_acc zeroing and conversion).
GPU tests: tests/test_gluon_bwd_fused.py all pass (float64 reference and the two-pass Gluon backward).
With the defaults (swizzled staging, no lag, REVERSE causal), last sweep, fused vs two-pass
(dQ pass + dK/dV pass): bf16 4x32x2048 causal 331.9 vs 365.7 (0.91x), 1x32x16384 causal 453.5 vs 445.7
(1.02x), 4x32/8x4096 causal 404.3 vs 404.8 (1.00x), 2x16x8192 no mask 523.1 vs 446.7 (1.17x; 543.5 vs
463.5 in the first sweep). The fused kernel alone runs 1.5-1.7x the dK/dV pass's time for 1.25x its
matmuls: the dQ part (dS exchange, dQ wgmma, staging) serializes inside each warpgroup and the exchange
re-aligns the two warpgroups every tile. The zeroing + conversion of the fp32 dQ accumulator (335 MB at
4x32x2048) costs 0.14 ms of the 1.04 ms at 2k causal (the kernel alone beats the two passes there too).
No-GPU compile (tools/gluon_fused_check.py, Triton 3.6, sm_90a): 168 registers at entry (240 per consumer
thread by setmaxnreg), 176-192 bytes of stack; consumer loops 442-667 SASS instructions, 32 MUFU.EX2, and
16-27 local-memory (spill) accesses each (~8 registers saved around the exponentials and reloaded before
the dK issue, plus loop-invariant addresses); shared memory 198208 bytes.

Shared memory (STAGES 2): K + V 64 KB, Q/dO ring 64 KB, dS 2 x 16 KB, dQ staging 2 x 16 KB, lse/delta
ring: 198208 bytes (3 stages: 231552, at the limit).
"""
import functools

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .bwd_dkdv_sm90 import _dkdv_producer, _pt_tile, _q_tiles
from .bwd_dq_sm90 import _bwd_problem_ok
from .fwd_sm90 import LOG2E, _desc, _is_sm90, _tma_ready

WG_N = 64            # keys per consumer warpgroup (one wgmma M)
BLOCK_N = 2 * WG_N   # keys per CTA
BLOCK_M = 64         # query rows per tile of the Q/dO ring
HEAD_D = 128
DQ_N = HEAD_D // 2   # dQ columns per warpgroup
# dQ staging (docstring, "Switches"): True: one unswizzled [64, 64] fp32 box per warpgroup (one base address,
# 8-way bank conflicts on the stores); False: two [64, 32] 128-byte-swizzled boxes (conflict-free stores)
DQ_FLAT = {False: False, True: False}    # causal -> flat
# dS^T = P^T (dP^T - delta) from the 16-bit P^T (the dV operand) instead of the fp32 one (docstring, "Switches")
P16_DS = False
# warpgroup 1 computes each tile's dQ columns one tile late (docstring, "Switches": Lag)
LAG = {False: False, True: False}        # causal -> lag
STAGES = {False: 2, True: 2}     # causal -> Q/dO ring depth
REVERSE = {False: False, True: True}     # causal -> query tiles last first (docstring, "Switches": Order)
CONSUMER_REGS = 240
PRODUCER_REGS = 24


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[box at coord] += shared src (TMA bulk reduce, ``cp.reduce.async.bulk.tensor .add``);
    completion is tracked like a TMA store (``tma.store_wait``). Triton 3.6's Gluon has the op
    (``ttng.async_tma_reduce``) in its builder but no wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _dq_product(ds_smem, k_smem, b, zero_q, WG: gl.constexpr):
    """Async wgmmas: this warpgroup's columns of dQ = dS K from dS^T buffer b:
    dS[:, keys 0..63] K_0[:, WG cols] + dS[:, keys 64..127] K_1[:, WG cols]."""
    WG_N: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    DQ_N: gl.constexpr = zero_q.shape[1]
    k0 = k_smem.index(0).reshape([WG_N, HEAD_D]).slice(WG * DQ_N, DQ_N, dim=1)
    k1 = k_smem.index(1).reshape([WG_N, HEAD_D]).slice(WG * DQ_N, DQ_N, dim=1)
    tok = warpgroup_mma(ds_smem.index(2 * b).permute((1, 0)), k0, zero_q, use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(2 * b + 1).permute((1, 0)), k1, tok, is_async=True)


@gluon.jit
def _dq_stage(dq, dq_smem, dq_desc, batch, head, row, WG: gl.constexpr):
    """This warpgroup's dQ columns (fp32 [64, 64] registers) -> staging tile -> TMA reduce-add into
    dq_acc[batch, head, row:row+64, WG cols] (rows >= S_Q clipped: a row of S_Q drops the whole tile)."""
    BLOCK_M: gl.constexpr = dq.shape[0]
    DQ_N: gl.constexpr = dq.shape[1]
    DQ_BOX: gl.constexpr = dq_smem.shape[4]
    # the previous reduce out of the staging tile has read it (long since: one tile ago)
    tma.store_wait(0)
    if DQ_BOX == DQ_N:
        dq_smem.index(WG).reshape([BLOCK_M, DQ_N]).store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [batch, head, row, WG * DQ_N], dq_smem.index(WG))
    else:
        halves = dq.reshape([BLOCK_M, 2, DQ_BOX]).permute((0, 2, 1))
        lo, hi = gl.split(halves)
        dq_smem.index(2 * WG).reshape([BLOCK_M, DQ_BOX]).store(lo)
        dq_smem.index(2 * WG + 1).reshape([BLOCK_M, DQ_BOX]).store(hi)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [batch, head, row, WG * DQ_N], dq_smem.index(2 * WG))
        _tma_reduce_add(dq_desc, [batch, head, row, WG * DQ_N + DQ_BOX], dq_smem.index(2 * WG + 1))


@gluon.jit
def _fused_step(it, t, WG: gl.constexpr, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band,
                qk_scale, batch, head, prev_head, prev_row, MASKED: gl.constexpr, HAS_RIGHT: gl.constexpr,
                STAGES: gl.constexpr, P16_DS: gl.constexpr, LAG: gl.constexpr):
    """One query tile (rows [t * 64, +64) of one head) in warpgroup WG: dV += P^T dO, dK += dS^T Q, and
    this warpgroup's 64 columns of dQ_i = dS_i K reduced into the fp32 accumulator; under LAG (warpgroup 1,
    ``LAG``) those of the previous tile instead (prev_head, prev_row; prev_row = S_Q before the first).
    Returns dk, dv and the (head, row) whose dQ the next LAG step reduces."""
    BLOCK_M: gl.constexpr = zero_s.shape[1]
    WG_N: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    s_layout: gl.constexpr = zero_s.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    k_view = k_smem.index(WG).reshape([WG_N, HEAD_D])
    slot = it % STAGES
    phase = (it // STAGES) & 1
    xb = it % 2
    xphase = (it // 2) & 1
    q_view = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
    do_view = do_smem.index(slot).reshape([BLOCK_M, HEAD_D])

    mbarrier.wait(q_ready.index(slot), phase)
    s_tok = warpgroup_mma(k_view, q_view.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(slot), phase)
    dp_tok = warpgroup_mma(v_view, do_view.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(l_ready.index(slot), phase)
    lse2 = lse_smem.index(slot).load(col_layout)
    # groups retire in order: one left in flight means S^T is done (dP^T runs on)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p = _pt_tile(s, qk_scale, lse2, t, keys, band, 0.0, MASKED, False, HAS_RIGHT, False)
    pb = p.to(dtype)
    p16 = gl.convert_layout(pb, a_layout)
    if P16_DS:
        # dS from the 16-bit P (the dV operand): the fp32 P dies here (``P16_DS``)
        p = pb.to(gl.float32)
    dv_tok = warpgroup_mma(p16, do_view, dv, is_async=True)
    delta = delta_smem.index(slot).load(col_layout)
    # dP^T done, dV += P^T dO runs on under the dS arithmetic
    dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    ds = (p * (dp - delta[None, :])).to(dtype)
    ds16 = gl.convert_layout(ds, a_layout)
    dk_tok = warpgroup_mma(ds16, q_view, dk, is_async=True)

    # dS^T half -> buffer xb once both warpgroups' dQ products of tile it - 2 have read it
    mbarrier.wait(ds_empty.index(xb), xphase ^ 1)
    ds_smem.index(2 * xb + WG).store(ds)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(xb))
    if LAG:
        # tile it - 1's buffer (before the first tile: a fresh barrier's phase 1, which passes at once)
        pb_ = (it + 1) % 2
        mbarrier.wait(ds_ready.index(pb_), ((it + 1) // 2 + 1) & 1)
        dq_tok = _dq_product(ds_smem, k_smem, pb_, zero_q, WG)
    else:
        mbarrier.wait(ds_ready.index(xb), xphase)
        dq_tok = _dq_product(ds_smem, k_smem, xb, zero_q, WG)
    dv, dk, dq, p16, ds16 = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, p16, ds16))
    mbarrier.arrive(empty.index(slot))
    if LAG:
        mbarrier.arrive(ds_empty.index(pb_), pred=it > 0)
        _dq_stage(dq, dq_smem, dq_desc, batch, prev_head, prev_row, WG)
    else:
        mbarrier.arrive(ds_empty.index(xb))
        _dq_stage(dq, dq_smem, dq_desc, batch, head, t * BLOCK_M, WG)
    return dk, dv, head, t * BLOCK_M


@gluon.jit
def _tile_loop(lo, hi, it, WG: gl.constexpr, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
               q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band,
               qk_scale, batch, head, prev_head, prev_row, MASKED: gl.constexpr, HAS_RIGHT: gl.constexpr,
               STAGES: gl.constexpr, P16_DS: gl.constexpr, LAG: gl.constexpr, REVERSE: gl.constexpr):
    """Query tiles [lo, hi) of one head, ascending (or descending under REVERSE)."""
    for i in range(hi - lo):
        t = hi - 1 - i if REVERSE else lo + i
        dk, dv, prev_head, prev_row = _fused_step(
            it, t, WG, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_ready, do_ready,
            l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band, qk_scale, batch, head,
            prev_head, prev_row, MASKED, HAS_RIGHT, STAGES, P16_DS, LAG)
        it += 1
    return it, dk, dv, prev_head, prev_row


@gluon.jit
def _fused_consumer(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar,
                    q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, done, dk_desc, dv_desc, dq_desc, batch,
                    kv_head, n0, GROUP, S_Q, band, tiles, qk_scale, sm_scale, HAS_RIGHT: gl.constexpr,
                    STAGES: gl.constexpr, REVERSE: gl.constexpr, P16_DS: gl.constexpr, LAG: gl.constexpr):
    """Consumer warpgroup WG: dK, dV of keys [n0 + 64 WG, +64), and its dQ columns of every tile
    (LAG: each one a tile late, the last one after the loop)."""
    WG_N: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    DQ_N: gl.constexpr = HEAD_D // 2
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DQ_N, 16])
    zero_s = gl.zeros([WG_N, BLOCK_M], gl.float32, s_layout)
    zero_q = gl.zeros([BLOCK_M, DQ_N], gl.float32, q_layout)
    dk = gl.zeros([WG_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([WG_N, HEAD_D], gl.float32, acc_layout)
    keys = n0 + WG * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(1, s_layout))
    k_view = k_smem.index(WG).reshape([WG_N, HEAD_D])
    v_view = v_smem.index(WG).reshape([WG_N, HEAD_D])
    mbarrier.wait(kv_bar, 0)

    t_lo, t_a, t_b, t_hi = tiles
    it = 0
    prev_head = kv_head * GROUP
    prev_row = S_Q       # LAG: no tile before the first (a reduce at row S_Q is clipped whole)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        if REVERSE:
            # last query tile first (module docstring, "Switches": Order)
            it, dk, dv, prev_head, prev_row = _tile_loop(
                t_b, t_hi, it, WG, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_ready,
                do_ready, l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band, qk_scale,
                batch, head, prev_head, prev_row, True, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE)
            it, dk, dv, prev_head, prev_row = _tile_loop(
                t_a, t_b, it, WG, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_ready,
                do_ready, l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band, qk_scale,
                batch, head, prev_head, prev_row, False, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE)
            it, dk, dv, prev_head, prev_row = _tile_loop(
                t_lo, t_a, it, WG, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_ready,
                do_ready, l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band, qk_scale,
                batch, head, prev_head, prev_row, True, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE)
        else:
            it, dk, dv, prev_head, prev_row = _tile_loop(
                t_lo, t_a, it, WG, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_ready,
                do_ready, l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band, qk_scale,
                batch, head, prev_head, prev_row, True, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE)
            it, dk, dv, prev_head, prev_row = _tile_loop(
                t_a, t_b, it, WG, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_ready,
                do_ready, l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band, qk_scale,
                batch, head, prev_head, prev_row, False, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE)
            it, dk, dv, prev_head, prev_row = _tile_loop(
                t_b, t_hi, it, WG, k_smem, v_view, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_ready,
                do_ready, l_ready, empty, ds_ready, ds_empty, dq_desc, dk, dv, zero_s, zero_q, keys, band, qk_scale,
                batch, head, prev_head, prev_row, True, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE)
    if LAG:
        # the last tile's dQ columns (no tile at all: prev_row = S_Q, the reduce is clipped whole)
        pb_ = (it + 1) % 2
        mbarrier.wait(ds_ready.index(pb_), ((it + 1) // 2 + 1) & 1)
        dq_tok = _dq_product(ds_smem, k_smem, pb_, zero_q, WG)
        dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
        _dq_stage(dq, dq_smem, dq_desc, batch, prev_head, prev_row, WG)

    # dV through this warpgroup's V tile (only it reads V_WG); TMA clips keys >= S_KV
    v_view.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dv_desc, [batch, kv_head, n0 + WG * WG_N, 0], v_smem.index(WG))
    # dK through its K tile once the other warpgroup's dQ products (they read both K tiles) are done
    mbarrier.arrive(done)
    mbarrier.wait(done, 0)
    k_view.store((dk * sm_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [batch, kv_head, n0 + WG * WG_N, 0], k_smem.index(WG))
    tma.store_wait(0)


@gluon.jit
def _attn_bwd_fused_sm90(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, stride_lb, stride_lh,
                         stride_lm, DELTA, H_KV, H_Q, GROUP, S_Q, S_KV, qk_scale, sm_scale, STAGES: gl.constexpr,
                         HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, REVERSE: gl.constexpr,
                         P16_DS: gl.constexpr, LAG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    WG_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    DQ_BOX: gl.constexpr = dq_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = 2 * WG_N
    dtype: gl.constexpr = q_desc.dtype

    pid_n = gl.program_id(0)     # key block 0 has the most query tiles under a causal mask: it runs first
    bh = gl.program_id(1)
    batch = bh // H_KV
    kv_head = bh % H_KV
    n0 = pid_n * BLOCK_N
    diag = S_Q * 0
    if BOTTOM_RIGHT:
        diag = S_KV - S_Q
    win = S_Q * 0
    tiles = _q_tiles(n0, S_Q, S_KV, diag, win, win, False, HAS_RIGHT, BLOCK_M, BLOCK_N)
    band = (diag, win, win)

    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, WG_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, WG_N, HEAD_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    # dS^T exchange: [buffer, warpgroup] -> [64 keys, 64 rows] 16-bit tiles
    ds_smem = gl.allocate_shared_memory(dtype, [4, WG_N, BLOCK_M],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    # dQ staging: [warpgroup, column box] -> [64 rows, 32] fp32 (the reduce's box)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2 * (HEAD_D // 2 // DQ_BOX), 1, 1, BLOCK_M, DQ_BOX],
                                        dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    l_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    mbarrier.init(done.index(0), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(l_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)     # one arrival from each consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_empty.index(i), count=2)

    gl.warp_specialize([
        (_fused_consumer, (0, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                           kv_bar.index(0), q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, done.index(0),
                           dk_desc, dv_desc, dq_desc, batch, kv_head, n0, GROUP, S_Q, band, tiles, qk_scale, sm_scale,
                           HAS_RIGHT, STAGES, REVERSE, P16_DS, False)),
        (_fused_consumer, (1, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                           kv_bar.index(0), q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, done.index(0),
                           dk_desc, dv_desc, dq_desc, batch, kv_head, n0, GROUP, S_Q, band, tiles, qk_scale, sm_scale,
                           HAS_RIGHT, STAGES, REVERSE, P16_DS, LAG)),
        # the dK/dV pass's producer (no ALiBi, no padding; SLOPES unused: DELTA stands in)
        (_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                          kv_bar.index(0), q_ready, do_ready, l_ready, empty, LSE, stride_lb, stride_lh, stride_lm,
                          DELTA, DELTA, batch, kv_head, n0, H_Q, GROUP, S_Q, S_Q, tiles[0], tiles[3], STAGES, False,
                          False, REVERSE)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@triton.jit
def _dq_convert(ACC, DQ, stride_b, stride_h, stride_m, H_Q, S_Q, scale, BLOCK: tl.constexpr, D: tl.constexpr):
    """dq[b, h, rows] = scale * dq_acc[b, h, rows] in dq's dtype (dq: any strides, unit last)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    acc = tl.load(ACC + (bh.to(tl.int64) * S_Q + rows)[:, None] * D + cols[None, :], mask=(rows < S_Q)[:, None])
    base = DQ + (bh // H_Q).to(tl.int64) * stride_b + (bh % H_Q).to(tl.int64) * stride_h
    tl.store(base + rows.to(tl.int64)[:, None] * stride_m + cols[None, :], (acc * scale).to(DQ.dtype.element_ty),
             mask=(rows < S_Q)[:, None])


# ----------------------------------------------------------------------------------------------
# host side

def _dq_box(flat):
    """(box width, shared layout) of the dQ staging tile / TMA reduce (``DQ_FLAT``)."""
    if flat:
        return HEAD_D // 2, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    return 32, gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)


def supports(p, q, k, v, grad_out, dq, dk, dv) -> bool:
    """True when this kernel computes the whole backward of ``p`` on these tensors: sm_90, fp16/bf16,
    d = d_v = 128, no mask or causal (either alignment); no windows, ALiBi, padding, bias, dropout,
    softcap (``bwd_dq_sm90._bwd_problem_ok`` minus windows and ALiBi); TMA-ready q, k, v, grad_out, dk,
    dv; dq any strides with unit last stride."""
    if not (_problem_ok(p) and isinstance(q, torch.Tensor) and q.is_cuda and _is_sm90(q.device.index)):
        return False
    if not (isinstance(dq, torch.Tensor) and dq.dtype == p.dtype and dq.stride(-1) == 1 and dq.is_cuda):
        return False
    return all(isinstance(t, torch.Tensor) and t.dtype == p.dtype and _tma_ready(t)
               for t in (q, k, v, grad_out, dk, dv))


@functools.lru_cache(maxsize=256)
def _problem_ok(p) -> bool:
    if p.alibi is not None or not (p.band is None or (p.band.left is None and p.band.right == 0)):
        return False
    if p.has_seq_len_q or p.has_seq_len_kv:      # padding: no per-sequence lengths here
        return False
    return _bwd_problem_ok(p, (128, )) and p.d == 128 and p.b * p.h_q * p.s_q < 2 ** 31


def launch_bwd_fused_sm90(p, q, k, v, grad_out, lse, delta, dq, dk, dv, *, dq_acc=None, stages=None, reverse=None,
                          flat=None, p16_ds=None, lag=None):
    """dQ, dK, dV of attention on Hopper in one pass (plus zeroing dQ's fp32 accumulator and converting
    it), written in place.

    q [b,h_q,s_q,128], k/v [b,h_kv,s_kv,128], grad_out [b,h_q,s_q,128], dq like q, dk/dv like k/v (any
    strides of unit last stride; ``supports`` checks them); lse fp32 [b,h_q,s_q] view (natural log, the
    forward's); delta fp32 contiguous [b*h_q, s_q] = rowsum(dO * O). dq_acc: optional fp32 scratch of
    b*h_q*s_q*128 elements (zeroed here). Tuning: stages, reverse, flat, p16_ds, lag override ``STAGES``,
    ``REVERSE``, ``DQ_FLAT``, ``P16_DS``, ``LAG``."""
    if dq_acc is None:
        dq_acc = torch.zeros((p.b, p.h_q, p.s_q, HEAD_D), dtype=torch.float32, device=q.device)
    else:
        dq_acc = dq_acc.view(p.b, p.h_q, p.s_q, HEAD_D)
        dq_acc.zero_()
    launch_kernel(p, q, k, v, grad_out, lse, delta, dq_acc, dk, dv, stages=stages, reverse=reverse, flat=flat,
                  p16_ds=p16_ds, lag=lag)
    launch_convert(p, dq_acc, dq)
    return dq, dk, dv


def launch_kernel(p, q, k, v, grad_out, lse, delta, dq_acc, dk, dv, *, stages=None, reverse=None, flat=None,
                  p16_ds=None, lag=None):
    """The fused kernel alone: dK, dV written, dQ / scale added into dq_acc (fp32 contiguous
    [b, h_q, s_q, 128])."""
    band = p.band
    causal = band is not None
    stages = stages or STAGES[causal]
    assert delta.is_contiguous() and delta.dtype == torch.float32
    assert dq_acc.is_contiguous() and dq_acc.dtype == torch.float32
    dq_acc = dq_acc.view(p.b, p.h_q, p.s_q, HEAD_D)
    box, layout = _dq_box(DQ_FLAT[causal] if flat is None else flat)
    dq_desc = TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [1, 1, BLOCK_M, box], layout)
    grid = (triton.cdiv(p.s_kv, BLOCK_N), p.b * p.h_kv)
    _attn_bwd_fused_sm90[grid](
        _desc(q, BLOCK_M), _desc(k, WG_N), _desc(v, WG_N), _desc(grad_out, BLOCK_M), _desc(dk, WG_N),
        _desc(dv, WG_N), dq_desc, lse, *lse.stride(), delta,
        p.h_kv, p.h_q, p.group, p.s_q, p.s_kv, p.scale * LOG2E, p.scale,
        STAGES=stages, HAS_RIGHT=causal, BOTTOM_RIGHT=causal and band.alignment == "bottom_right",
        REVERSE=REVERSE[causal] if reverse is None else reverse, P16_DS=P16_DS if p16_ds is None else p16_ds,
        LAG=LAG[causal] if lag is None else lag, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
    )


def launch_convert(p, dq_acc, dq):
    """dq = scale * dq_acc in dq's dtype (dq: any strides with unit last stride)."""
    block = 64
    _dq_convert[(triton.cdiv(p.s_q, block), p.b * p.h_q)](
        dq_acc, dq, dq.stride(0), dq.stride(1), dq.stride(2), p.h_q, p.s_q, p.scale, BLOCK=block, D=HEAD_D,
        num_warps=4)
