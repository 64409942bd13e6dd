"""Attention backward in ONE pass for Hopper (sm_90) in Gluon, d=128 or 64: FlashAttention-3 style (experimental).

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

(The head dim d is the descriptors'; the text below is d=128's. At d=64 (``HEAD_DIMS``) the tiles stay, each
warpgroup's dQ products are [64, 32] (a 32-column slice of each K tile), dK + dV take 64 registers and the
shared memory halves: 116 KB with 2 stages; a 128-row query tile spilled 169 accesses per step
(tools/gluon_fused_check.py ... d64 m128). H100, bench/d64_fused.py: 1.04-1.13x the Triton pair, which
``plan.GLUON_BWD_FUSED_MIN_WORK`` weighs against the host time of its launches.)

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

(``DQ_FIRST``, FlashAttention-3's order: dK is issued after the dQ product, the staging runs under it.)
The dQ accumulator is live only after S^T / dP^T / P^T are dead (dK + dV 128, dQ 32, the two 16-bit
A operands 16 + 16 while their wgmmas run). The dS buffers are double-buffered so a warpgroup may run
one tile ahead of the other. The staging tile is single-buffered per warpgroup: ``tma.store_wait(0)``
(``cp.async.bulk.wait_group.read``, then a warpgroup barrier from the membar pass) before it is
rewritten, one tile later; its two 32-column halves are separate allocations, since the membar pass
put a warpgroup barrier between the stores to two slices of one. Triton 3.6's Gluon has the TMA reduce
in its builder (``create_async_tma_reduce``) but no wrapper; 3.8+ has ``tma.async_atomic_add``: ``compat.tma_reduce_add``.

Host side (``launch_bwd_fused_sm90``): with ``out=`` one small Triton kernel (``_delta_zero``) computes
delta = rowsum(dO * O) and zeroes dq_acc (fp32 [b, h_q, s_q rounded up to 64 (``acc_rows``), 128],
contiguous) in the same pass; without it delta comes from the caller (as for the dK/dV pass) and dq_acc is
zeroed by torch. A second small kernel writes dq = scale * dq_acc in dq's dtype. All three launch through
``launch.launch`` (a repeat signature skips Triton's dispatch; descriptors are ``Tma`` tuples, each encoded
once per tensor), the FP8 switches' tensors and descriptors by keyword too (bench/NOTES.md 75).

Epilogue: dV through the warpgroup's own V tile (only it reads V_WG); dK through its K tile once the
other warpgroup is done with its dQ products (which read both K tiles): an mbarrier of count 2.

Causal (either alignment) as the dK/dV pass (``_q_tiles``); warpgroup 1 no longer skips the query tiles
that see none of its keys (its dS half, all 0, is part of every dQ product). Rows >= s_q: zero-filled Q
and dO, lse +inf, so P = dS = 0 and the reduce clips them; rows that see no key get dQ = 0. Keys >= s_kv
(zero-filled K, V) are not masked: their dS meets a zero K row in the dQ product (finite P assumed, as
the dK/dV pass assumes it for dV).

Switches (constexpr; module dicts keyed by causal, and keywords of ``launch_bwd_fused_sm90``). H100
numbers: bench/gluon_fused_sweep.py, whole backward; this session's four sweeps are quoted as run1..run4
(two-pass and variants measured in the same run; about +-2% noise between identical columns at 2k-8k, and
up to 10% at 16k causal, where columns timed later in a config's row read higher):

* Order (``REVERSE``): each CTA visits its query tiles last first (band edge, mask-free middle, diagonal).
  Under a causal mask the CTAs of one head then work on the same query tile at the same time (as without
  a mask, where every CTA starts at tile 0), so Q/dO loads and the dQ reduce-adds of concurrent CTAs hit
  the same L2 lines. H100: causal +0-5% (GQA 4k +5%).
* Heavy first (``HEAVY_FIRST``, causal): CTAs take (key block, batch x kv head) from the linear program id
  in chunks of C = SMs // key blocks heads (``bwd_dq_sm90._chunk``: about one wave), key block outermost inside
  a chunk (``bwd_dq_sm90._heavy_first``, shared with the two-pass kernels' ``HEAVY_FIRST``),
  so the long CTAs (key block 0 sees every query tile) start first; C = 1 (16k) is the grid's own order.
  Prediction (list-scheduling model, CTA time ~ its query tiles): tail 1.07x -> 1.02x the mean load at 2k,
  1.14x -> 1.00x at GQA 4k, i.e. +5% and +12%. Measured (vs ``heavy_first=False``): 2k +6.8% (run3),
  +3.0% (run4); GQA 4k -0.1%, +1.0%: the 2k gain is real, the GQA one did not appear. On.
* dQ first (``DQ_FIRST``): the dQ product issued before dK (FA3), so the staging (store_wait, 16 STS, fence,
  2 reduces) runs under the dK wgmma. Predicted +3-8% (the staging was serial). Measured: no gain
  (DQ_FIRST on vs off, runs 1-3: 2k -1.0/-0.4/+1.4%, 8k no mask -1.4/-1.1/-6.4%): the staging was not the
  bottleneck. Off with the swizzled staging; with the "frag" one (``FRAG_DQ_FIRST``, FA4's order) on under a
  causal mask: Nsight Compute cycles (bench/NOTES.md 94) 16k causal 1.066x / GQA 4k causal 1.109x the swizzled
  default against frag with dQ last 1.020x / 1.086x; without a mask 1.038x against 1.070x.
* dK deferred (``DEFER_DK``, needs DQ_FIRST): dK stays in flight into the next step (waited with its S^T), dS^T
  for it read from the exchange buffer, so the tensor core has work across the step boundary. The in-flight
  accumulator is loop-carried: it starts as the result of a wgmma (0 * K_WG), since a plain zero on any path
  to its wait made ptxas serialize every wgmma (C7515), and a 16-bit register copy of dS^T kept alive made it
  run out of registers (C7512). Compiles to 62-82 spill accesses per loop: -25% everywhere (runs 1-2). Off.
* dQ atomics (``DQ_ATOMIC``): the dQ half reduced by 16 ``red.global.add.v2.f32`` per thread straight from
  registers (no staging, no 32 KB of shared memory; dq_acc has whole 64-row tiles per head, ``acc_rows``,
  so no mask: a masked version branched around every atomic). Predicted: +10-20% if shared-memory bandwidth
  (staging store + TMA read, 64 of ~370 KB per step) were the limit. Measured (run2): -15% (2k), -16% (16k),
  -27% (GQA 4k), -21% (8k no mask); with 3 stages the same. Off: the TMA reduce is the cheaper L2 path.
* Lag (``LAG``): warpgroup 1 computes tile i's dQ columns at tile i + 1 (waits only for warpgroup 0's dS
  of tile i - 1, and warpgroup 0 for its dS of tile i), so the two need not meet at the same point of
  every tile; the last tile's columns after the loop; a reduce at row s_q (the first step's) is dropped
  whole by TMA. H100: no gain anywhere, GQA 4k causal -2..-12%: off.
* dQ staging (``DQ_FLAT``): two [64, 32] 128-byte-swizzled boxes per warpgroup (the register tile split by
  ``gl.split``; 2-way bank conflicts on the 16 STS.64, bench/NOTES.md 92) or one unswizzled [64, 64] box (one
  base address, fewer spill accesses, 8-way bank conflicts). H100: swizzled +5-8% without a mask and at GQA 4k,
  even elsewhere (run1: flat -5% at 8k no mask and GQA 4k): swizzled. "frag" ([Note] dQ in fragment order): one
  [16, 256] box per warpgroup in the accumulator's own order (d=128, 16-bit, not with LAG or DQ_ATOMIC), the
  default where it applies: Nsight Compute cycles against the swizzled boxes (bench/NOTES.md 94) 8k 1.070x, 16k
  causal 1.020x, GQA 4k causal 1.086x (with dQ first under a mask, ``FRAG_DQ_FIRST``: 1.066x, 1.109x).

[Note] dQ in fragment order (``DQ_FLAT`` "frag", FlashAttention-3 / 4's dQ path, bench/NOTES.md 93). The TMA reduce's
cost follows its rows (entry 93: eight [64, 8] boxes per warpgroup, 4x the rows of the two [64, 32] ones, cost +47%
of the kernel's cycles), so the warpgroup's [64, 64] fp32 tile goes out as one box of 16 rows of 1 KB: dq_acc holds
each 64-row tile's two column halves as 4096 contiguous values in the order the wgmma accumulator keeps them (flat
index e | i << 1 | lane << 2 | warp << 7 | j << 9 for row 16 warp + 8 i + lane // 4, column 8 j + 2 (lane % 4) + e),
so a warp's store is 512 contiguous bytes (8 STS.128 per thread, no conflicts). ``_frag_tile`` gets there by a
reshape to twelve size-2 dimensions, a permute and a reshape: layout-only, no data moves between threads. The
conversion (``_dq_convert`` FRAG) computes the same index; the padding rows past s_q are interleaved with the rest,
so the out= path zeroes them too (``_delta_zero`` ZERO_PAD); their dQ is 0 (zero-filled Q and dO rows).
* ``P16_DS``: dS from the 16-bit P (the dV operand), so the fp32 P dies at the dV issue. bf16 needs an
  unpack per element (F2F + PRMT + IMAD.U32, +50 instructions per loop); spills 14 -> 8 (bf16), 0 (fp16).
  H100: -3..-7%: off.
* Ring depth (``STAGES``): 3 under a causal mask (231584 bytes of shared memory, at the limit): vs 2, 2k
  +1.5/+0.9/+2.9/+3.4% (runs 1-4), GQA 4k -0.9/-1.2/+2.1/+1.8%; without a mask 2 (3: -4 to -5%, runs 1-3).
* Rotate (``ROTATE``): each CTA's mask-free query tiles start ``pid_n`` (its key block) tiles into their
  order and wrap around, so the CTAs of a head reduce into different dQ tiles at a time instead of all into
  the same one (REVERSE lines them up). Prediction: fewer same-address TMA reduce-adds in L2, a gain at 16k
  causal if those serialize (~1.5 TB/s of reduce traffic there). H100 (session 10, whole backward vs the
  defaults, same run): 2k causal -2.2%, 16k causal -2.4%, GQA 4k -1.0%, 8k no mask -3.6%: the shared tile
  is the cheaper one (its Q/dO and dQ lines are hot in L2); the wrap also costs 6-10 instructions and 5
  spill accesses per step. Off.
* Segments (``SEGMENTS``, GQA / MQA only): the CTA's three runs of query tiles (masked, mask-free, masked)
  each over every head of the group in one loop, head after head (``_tile_loop``; the load warp in the same
  order, ``_dkdv_producer(SEGMENTS=True)``), instead of a loop over the group's heads around the three runs.
  With one head per group both are the same order and the head loop folds away. Found on Triton 3.9: GQA 4k
  causal's backward ran at 0.74x of its 3.6 speed (ncu: 3.74 against 2.68 ms, 41.7 M spill instructions
  against 21.6 M, tensor pipe 39% against 55%), while MHA ran faster on 3.9 than on 3.6; compiled with no GPU
  (``tools/gluon_fused_check.py``), 3.9's runtime-group build spills 544 / 896 bytes (424 local accesses in
  the SASS, 31-54 per step) against 3.6's 340 / 396 (173), and the segment-major one 192 / 156 (277, 1-39
  per step). On 3.6, 3.7 and 3.8 the segment-major build spills more than the head loop (259 / 260 / 249
  local accesses against 173 / 171 / 121): so on from Triton 3.9 only (bench/NOTES.md 64), and by default
  under a causal mask only: without one, 3.9's head loop folds its empty masked runs away and spills less
  (87 local accesses, mask-free loops with 1 each) than the segment-major build (139; 7-10 per step; static,
  ``tools/gluon_fused_check.py survey``, not timed).
* Host (``out=``): delta and the dq_acc zeroing in one kernel (``_delta_zero``) instead of the delta pass
  and torch's zero_: the same bytes, one launch fewer; measured even (runs 1-3, -1..+2%, within noise).

[Note] dropout (``DROPOUT``, at head dims ``DROPOUT_DIMS``): each warpgroup makes the keep bits of its S^T tile
([64 keys, 64 rows] of one query head: ``dropout.keep`` on the transposed tile, the forward's mask, one Philox call
per 2 rows x 4 keys, the counter base of the (batch, query head)) right after P^T, and folds them into P^T's sign
at once (kept P, or -P; the dK/dV pass's form, bwd_dkdv_sm90 [Note] dropout), so no mask stays live. dV +=
max(P, 0)^T dO (1 / (1 - p) applied once in the epilogue); dS = max(P, 0) dP / (1 - p) - |P| delta, with delta =
rowsum(dO * O) of the dropped output, as FlashAttention's; dK and dQ take that dS. Mask made once per (key, query)
tile pair here, where the two passes make it twice. H100 (``DROPOUT_DIMS``' comment): 1.51x the Triton pair at
d=64; at d=128 0.88-0.95x the two Gluon passes, whose consumers have room for the Philox words: here they meet dK,
dV, S^T and dP^T in 240 registers and spill (~100 local accesses per step against 22 without dropout, Triton 3.6).

[Note] FP8 (``FP8_EMU``; ``launch_bwd_fused_fp8``, routed by ``fusedattn.fp8._backward_gluon`` where
``plan.FP8_BWD_GLUON`` is on): cuDNN's ``sdpa_fp8_backward`` with the rounding points of ``fusedattn.fp8``'s
emulation, its products as fp16 wgmmas on the FP8 values (every e4m3 / e5m2 value is exact in fp16; the host
widens q, k, v and dO once per call, ``fwd_sm90.widened_fp16``) instead of FP8 wgmmas, which read both operands
K-major: dV += P^T dO and dK += dS^T Q would need transposed copies of dO and Q per tile (why cuDNN's Hopper FP8
backward takes d = 128 only; [Note] FP8 MMAs makes them). Per step, on the raw values (S_raw = Q8 K8^T,
dP_raw = dO8 V8^T, delta_raw = rowsum(dO8 o)):

    P * scale_s = exp2(S_raw * scale * log2 e * descale_q * descale_k - (lse2 - log2 scale_s))
    P8          = fp8(P * scale_s) in q's type, as fp16          -> dV += P8^T dO8
    dS * scale_dP = (P * scale_s) (dP_raw a - delta_raw b)   a = descale_dO descale_v scale scale_dP / scale_s,
                                                             b = descale_dO descale_o scale scale_dP / scale_s
    dS8         = fp8(dS * scale_dP) in dO's type, as fp16   -> dK += dS8^T Q8, dQ += dS8 K8 (the reduce)

(``_fp8_round16``: cvt.rn.satfinite to FP8, then to f16x2: nearest even, saturating, as ``fp8.quantize``). Each
warpgroup keeps max |dS * scale_dP| per key over its steps (a [64] vector, two registers); the epilogue maxes it
over the keys < s_kv (keys past s_kv are not masked in the steps: their P is exp2(-lse2), their dS lands only in
rows no store writes) into amax_dP / scale_dP, then dV * descale_s * descale_dO and dK * descale_dP * descale_q
(the emulation's order) give amax_dV / amax_dK over keys < s_kv and are stored from registers in the gradients'
type, times scale_dV / scale_dK (``_fp8_grad_write``; no TMA staging, so any gradient type). dQ:
``_dq_convert_fp8`` (dq_acc * descale_dP * descale_k, amax_dQ, times scale_dQ). The scales are read on the device
(one fp32 [12] buffer, ``triton.bwd.FP8_BWD_SCALE_NAMES``), so a CUDA graph replays new values. No-GPU compile
(tools/gluon_fused_check.py's builder, Triton 3.6, sm_90a): d=128 mask-free loop 557 SASS instructions against
the 16-bit kernel's 423 (32 more F2FP for the two roundings, 36 FMNMX for the key maxima, 16 FMUL for delta b,
21 more local accesses: 184 / 224 bytes of spill, 148 / 120 before); d=64 448 against 357, no spills. The
16-bit builds' SASS is unchanged (the switch's values are stand-ins the compiler removes).

[Note] FP8 MMAs (``FP8_MMA``, on where dO has q's type; ``launch_bwd_fused_fp8(mma8=)``, the kernel's
FP8_EMU = 2): the FP8 switch with every product an FP8 wgmma (e4m3 / e5m2 operands, K steps of 32: twice the
fp16 rate, half the shared-memory bytes per product). S^T = K8 Q8^T and dP^T = V8 dO8^T read their tiles as they are (both
K-major). dV += P8^T dO8 and dK += dS8^T Q8 take P8 / dS8 as 8-bit register operands built without a shuffle
(``_fp8_operand``: fwd_sm90 ``_pack_p8``'s column order), so their B operands are transposed copies with the
query rows innermost and in ``key_order`` within each 16 (``fp8_transposes``: Q^T and dO^T, [b, h, d, s], one
small kernel per call each, loaded beside Q and dO under the same barriers, ``bwd_dkdv_sm90._load_q_tile``'s
T_LOADS). dQ += dS8 K8 reads dS8 from the exchange buffer stored transposed ([64 rows, 64 keys] per warpgroup,
``_fp8_store_transposed``) against K^T ([b, h_kv, d, s], keys in order, loaded with K). dV and dK accumulate
every query tile in the wgmmas' own accumulators: Hopper's FP8 sums (~14 bits, fwd_sm90 [Note] FP8) then
reach over group * s_q / 32 K-steps, which the tests' bound scales ``u_mma`` by (no fp32 promotion: a fresh
[64, d] accumulator per step is 64 more registers than the consumers have). dO must be of q's type. No-GPU
compile (d=128, mask-free loop, SASS instructions / local accesses): 3.6.0 493-511 / 0, 3.9.0 503-504 / 0
(the fp16-MMA switch 557 / 25 and 532 / 0; the 16-bit kernel 423 / 4), 16 QGMMA per step, no write to an
in-flight register operand (tools/gluon_check.py ``inflight_a_writes``), 166 KB of shared memory (3 stages,
causal: 199 KB); the 16-bit and fp16-MMA builds' SASS unchanged. Measured (H200, 3.6.0): 1.22-1.25x the fp16
MMAs at d=128 (2k causal 381, 8k 641, 16k causal 653 TFLOP/s; cuDNN frontend's FP8 backward 303 / 694 / 700).

[Note] K and V in registers (``KV_REGS``, on by default; at d=64, 16-bit, without dropout). A warpgroup's K_WG
and V_WG [64 keys, d] are the same tile at every step, the A operands of S^T = K_WG Q^T and dP^T = V_WG dO^T.
The step is shared-memory bound (the status note below), and a wgmma reads its shared-memory A operand again each
time: at d=64 K_WG and V_WG are 8 KB each per warpgroup and step, 32 KB of the two warpgroups' ~180. Held in
registers instead (loaded once after the K/V barrier; 16 + 16 registers per thread, a DotOperandLayout of the
S^T accumulator's), the wgmmas read only Q and dO from shared memory. No-GPU compile (tools/gluon_fused_check.py,
step loops, SASS instructions): Triton 3.6.0 no mask 376 / 361 -> 337 / 339, causal 369 / 517 -> 343 / 494, no
spills in them; 3.9.0 no mask 379 / 392 -> 386 / 381, no spills, causal 405 / 533 -> 385 / 542 with 11 local
accesses in the masked loops. Measured (H100, Nsight Compute elapsed cycles, bench/fused_ab.py, registers /
shared memory): Triton 3.6.0 b8 h12 1k 1.081x, causal 1.056x, b4 h16 4k 1.118x, causal 1.069x; 3.9.0 1.093x,
1.009x (the masked loops' spills), 1.122x, 1.041x. Not at d=128 (32 + 32 more registers where the consumers
have none to spare), not with dropout (its Philox words: 55-96 local accesses per step on 3.9.0). Off:
``kv_regs=False``.

[Note] status (H100, bench/gluon_fused_sweep.py; whole backward TFLOP/s = 2.5x forward flops, /2 causal,
including delta, the dq_acc zeroing and the conversion). GPU tests: tests/test_gluon_bwd_fused.py, 107 pass
(float64 reference and the two-pass Gluon backward). Last sweep (run4, final defaults; "before" = the
previous commit's module, launched the old way, same run), fused vs two-pass:

    bf16 config             two-pass   fused   before   fused/two-pass   kernel alone ms (runs 1-2 -> 4)
    4x32x2048 causal          385.2    355.2    332.4       0.92x            0.899-0.905 -> 0.842
    1x32x16384 causal         449.0    450.3    469.7       1.00x            11.74-11.96 -> 11.55
    4x32/8x4096 causal        411.0    426.7    413.8       1.04x            3.108-3.135 -> 2.944
    2x16x8192 no mask         424.8    530.2    527.9       1.25x            5.07-5.21   -> 5.24

(the two-pass reads 451 at 8k no mask in runs 1-2: 1.15-1.16x there; kernel alone in runs 1-2: 2 stages,
the grid's order). The causal kernels are 2-7% faster (heavy first, 3 stages); the 2k whole backward is still 0.92x because delta + zeroing + conversion cost
~0.13 ms of the 0.97 ms (the kernel alone, 0.842 ms, beats the two passes' 0.892). Where the time goes: per
(key block, query tile) step the two warpgroups read about 370 KB of shared memory (S^T and dP^T 64 KB each
at the m64n64k16 shared-memory limit, dQ operands 64 KB, dV/dK 64 KB, staging 64 KB, Q/dO TMA 32 KB, dS
16 KB), 2900 cycles at 128 B/cycle against 2560 cycles of tensor work; measured ~4600 cycles per step at 8k
(at ~1.75 GHz; the dK/dV pass alone: ~3000 for 224 KB). Extra shared-memory traffic costs in proportion (DEFER_DK's spills,
flat staging's bank conflicts), reordering does not (DQ_FIRST).
No-GPU compile (tools/gluon_fused_check.py, Triton 3.6, sm_90a): 168 registers at entry (240 per consumer
thread by setmaxnreg; more is impossible: 12 warps x 168 is the CTA's pool, the producer warpgroup keeps
24), consumer loops 441-667 SASS instructions, 32 MUFU.EX2, 16-24 local-memory (spill) accesses each with
2 stages, 17-22 with 3 (causal); shared memory 198240 bytes (2 stages), 231584 (3).

Shared memory (STAGES 2): K + V 64 KB, Q/dO ring 64 KB, dS 2 x 16 KB, dQ staging 2 x 2 x 8 KB, lse/delta
ring: 198240 bytes (3 stages: 231584, at the limit).
"""
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..compat import TRITON_VERSION, tma_reduce_add, tma_store
from ..triton.bwd import fp8_grad_out
from . import dropout
from .bwd_dkdv_sm90 import _dkdv_producer, _pt_tile, _q_tiles
from .bwd_dq_sm90 import _bwd_problem_ok, _chunk, _fp8_grad_write, _fp8_round16, _heavy_first
from .fwd_sm90 import (LOG2E, _geometry, _is_sm90, _pack_p8, _smem_layout, _to_fp8, _tma, _tma_ready,
                       _unpack_p8, transposed_v, widened_fp16)
from ..triton.launch import cdiv
from .launch import Tma, launch

WG_N = 64            # keys per consumer warpgroup (one wgmma M)
BLOCK_N = 2 * WG_N   # keys per CTA
BLOCK_M = 64         # query rows per tile of the Q/dO ring
HEAD_DIMS = (64, 128)   # d = d_v; the kernel takes its head dim from the descriptors
# dQ staging (docstring, "Switches"): True: one unswizzled [64, 64] fp32 box per warpgroup (one base address,
# 8-way bank conflicts on the stores); False: two [64, 32] 128-byte-swizzled boxes (2-way conflicts, bench/NOTES.md
# 92); "frag": one [16, 256] box in the accumulator's own order ([Note] dQ in fragment order)
DQ_FLAT = {False: "frag", True: "frag"}  # causal -> flat (bench/NOTES.md 94: "frag" 1.02-1.09x the swizzled boxes)
# dS^T = P^T (dP^T - delta) from the 16-bit P^T (the dV operand) instead of the fp32 one (docstring, "Switches")
P16_DS = False
# warpgroup 1 computes each tile's dQ columns one tile late (docstring, "Switches": Lag)
LAG = {False: False, True: False}        # causal -> lag
STAGES = {False: 2, True: 3}     # causal -> Q/dO ring depth
REVERSE = {False: False, True: True}     # causal -> query tiles last first (docstring, "Switches": Order)
# dQ product issued before dK += dS^T Q, the dQ staging under the dK wgmma (docstring, "Switches": dQ first)
DQ_FIRST = {False: False, True: False}   # causal -> dQ first
# the same with the "frag" dQ staging (FA4's order: its 8 STS.128 and one reduce under the dK wgmma); bench/NOTES.md
# 94: causal 1.07x / 1.11x (16k, GQA 4k) over frag alone's 1.02x / 1.09x, without a mask 1.04x against 1.07x
FRAG_DQ_FIRST = {False: False, True: True}
# with DQ_FIRST: dK's wait moves to the next step, after its S^T / dP^T issue (docstring, "Switches": dK deferred)
DEFER_DK = {False: False, True: False}   # causal -> defer
# dQ reduced by vector atomics from registers instead of staging + TMA reduce (docstring, "Switches": dQ atomics)
DQ_ATOMIC = {False: False, True: False}  # causal -> atomics
# program ids remapped so that heavy CTAs (low key blocks under a causal mask) start first, in chunks of about
# one wave of CTAs (docstring, "Switches": Heavy first)
HEAVY_FIRST = {False: False, True: True}  # causal -> heavy first
# each CTA's mask-free query tiles start at its key block's index into their order and wrap around, so the CTAs
# of a head reduce into different dQ tiles at a time (docstring, "Switches": Rotate)
ROTATE = {False: False, True: False}     # causal -> rotate
# GQA / MQA under a causal mask: each run of query tiles over every head of the group in one loop instead of a
# loop over the group's heads around the runs (docstring, "Switches": Segments); by Triton release, as their
# register allocation differs (bench/NOTES.md 64)
SEGMENTS = TRITON_VERSION >= (3, 9)
# head dims at which dropout takes this kernel (module docstring, [Note] dropout): measured on the H100 against the
# two-pass route, whole backward with p = 0.1 (bench/fused_dropout_ab.py, Triton 3.6.0, TFLOP/s): d=64 b8 h12 2k
# 277 against the Triton pair's 183; d=128 232 / 264 (2k causal), 297 / 314 (8k), 281 / 317 (16k causal), 273 / 305
# (GQA 4k causal) against the two Gluon passes: at d=128 the Philox words beside dK, dV, S^T and dP^T spill (~100
# local accesses per step, none at d=64)
DROPOUT_DIMS = (64,)
CONSUMER_REGS = 240
PRODUCER_REGS = 24


@gluon.jit
def _fp8_operand(x, E5M2: gl.constexpr, layout: gl.constexpr):
    """fp32 ``x`` (a [64, 64] wgmma accumulator) rounded to FP8 (e4m3, or e5m2 where E5M2; nearest even,
    saturating) as an FP8 wgmma's register A operand (``layout``), its columns in ``fwd_sm90.key_order``
    within each 16 (``_pack_p8``: no shuffle), so the B operand's K rows come in that order ([Note] FP8 MMAs)."""
    if E5M2:
        y = _unpack_p8(_pack_p8(x, gl.float8e5), gl.float8e5, layout)
    else:
        y = _unpack_p8(_pack_p8(x, gl.float8e4nv), gl.float8e4nv, layout)
    return y


@gluon.jit
def _fp8_store_transposed(x, E5M2: gl.constexpr, dst):
    """fp32 ``x`` [64 keys, 64 rows] (dS^T) rounded to FP8 as ``_fp8_operand`` and stored transposed into
    ``dst`` [64 rows, 64 keys] (shared memory, keys innermost): the dQ product's A operand ([Note] FP8 MMAs)."""
    if E5M2:
        y = _to_fp8(x, gl.float8e5)
    else:
        y = _to_fp8(x, gl.float8e4nv)
    dst.store(gl.permute(y, (1, 0)))


@gluon.jit
def _dq_product(ds_smem, k_smem, b, zero_q, WG: gl.constexpr, FP8_MMA: gl.constexpr = False):
    """Async wgmmas: this warpgroup's columns of dQ = dS K from dS^T buffer b:
    dS[:, keys 0..63] K_0[:, WG cols] + dS[:, keys 64..127] K_1[:, WG cols]. FP8_MMA ([Note] FP8 MMAs): the
    buffers hold dS8 itself ([64 rows, 64 keys], keys innermost) and k_smem is K^T ([2, 1, 1, d, 64 keys]):
    both operands K-major, as FP8 wgmmas read them."""
    DQ_N: gl.constexpr = zero_q.shape[1]
    if FP8_MMA:
        HEAD_D: gl.constexpr = k_smem.shape[3]
        WG_N: gl.constexpr = k_smem.shape[4]
        k0 = k_smem.index(0).reshape([HEAD_D, WG_N]).slice(WG * DQ_N, DQ_N, dim=0).permute((1, 0))
        k1 = k_smem.index(1).reshape([HEAD_D, WG_N]).slice(WG * DQ_N, DQ_N, dim=0).permute((1, 0))
        tok = warpgroup_mma(ds_smem.index(2 * b), k0, zero_q, use_acc=False, is_async=True)
        tok = warpgroup_mma(ds_smem.index(2 * b + 1), k1, tok, is_async=True)
    else:
        WG_N: gl.constexpr = k_smem.shape[3]
        HEAD_D: gl.constexpr = k_smem.shape[4]
        k0 = k_smem.index(0).reshape([WG_N, HEAD_D]).slice(WG * DQ_N, DQ_N, dim=1)
        k1 = k_smem.index(1).reshape([WG_N, HEAD_D]).slice(WG * DQ_N, DQ_N, dim=1)
        tok = warpgroup_mma(ds_smem.index(2 * b).permute((1, 0)), k0, zero_q, use_acc=False, is_async=True)
        tok = warpgroup_mma(ds_smem.index(2 * b + 1).permute((1, 0)), k1, tok, is_async=True)
    return tok


# the "frag" dQ staging ([Note] dQ in fragment order): a warpgroup's [64, 64] fp32 dQ tile as [16, 256]
FRAG_ROWS = gl.constexpr(16)
FRAG_ROW = gl.constexpr(256)


@gluon.jit
def _frag_tile(dq):
    """[Note] dQ in fragment order: the wgmma accumulator dq [64 rows, 64 cols] (m64n64 layout: row = 16 warp +
    8 i + lane // 4, col = 8 j + 2 (lane % 4) + e, registers (j, i, e)) as [16, 256] whose flat index is
    f = e | i << 1 | lane << 2 | warp << 7 | j << 9: a layout-only reshape (bits of row and col permuted), no data
    moves between threads."""
    bits = dq.reshape([2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])   # row bits r5..r0, col bits c5..c0
    # f11..f0 = c5 c4 c3 | r5 r4 | r2 r1 r0 | c2 c1 | r3 | c0
    return bits.permute((6, 7, 8, 0, 1, 3, 4, 5, 9, 10, 2, 11)).reshape([FRAG_ROWS, FRAG_ROW])


@gluon.jit
def _dq_stage(dq, dq_lo, dq_hi, dq_out, batch, head, row, WG: gl.constexpr, DQ_ATOMIC: gl.constexpr):
    """This warpgroup's dQ columns (fp32 [64, 64] registers) reduced into dq_acc[batch, head, row:row+64,
    WG cols] (rows >= S_Q dropped).

    dq_out = (dq_desc, dq_ptr, S_Q): the TMA descriptor of dq_acc, a pointer to dq_acc[batch, head, 0, 0]
    (``acc_rows`` rows of 128 per head) and the number of rows per head. DQ_ATOMIC: 16 vector atomics per
    thread (``red.global.add.v2.f32``, two adjacent columns each) straight from the wgmma registers, no
    shared memory. Else through a staging tile and TMA reduce-adds (a row of S_Q drops the whole tile): dq_lo,
    dq_hi [2 warpgroups, 1, 1, 64, box] buffers; swizzled (box 32): columns [0, 32) of the warpgroup's 64 in
    dq_lo, [32, 64) in dq_hi, two allocations so that the barrier pass sees the two stores as disjoint (one
    allocation cost a warpgroup barrier between them); flat (box 64): dq_lo alone."""
    BLOCK_M: gl.constexpr = dq.shape[0]
    DQ_N: gl.constexpr = dq.shape[1]
    DQ_BOX: gl.constexpr = dq_lo.shape[4]
    DQ_FRAG: gl.constexpr = DQ_BOX == FRAG_ROW
    dq_desc, dq_ptr, S_Q = dq_out
    if DQ_ATOMIC:
        # no mask: dq_acc has whole 64-row tiles per head, and rows >= S_Q (dQ = 0 there) are never read
        # (a mask cost a branch around every atomic, BSSY/BSYNC, and 15-20 more spill accesses)
        HEAD_D: gl.constexpr = 2 * DQ_N
        rows = row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq.type.layout))
        cols = WG * DQ_N + gl.arange(0, DQ_N, layout=gl.SliceLayout(0, dq.type.layout))
        gl.atomic_add(dq_ptr + rows[:, None] * HEAD_D + cols[None, :], dq, sem="relaxed")
    else:
        # the previous reduce out of the staging tile has read it (long since: one tile ago)
        tma.store_wait(0)
        if DQ_FRAG:
            # fragment order ("frag", ``_frag_tile``): the tile's 4096 values as [16, 256], each thread's four
            # registers of a column block contiguous and the lanes in order, so a warp's store is 512 contiguous
            # bytes (STS.128, no conflicts) and one reduce of 16 rows of 1 KB moves the whole tile (row // 2: the
            # tile's 32 rows of 256 per 64 query rows, this warpgroup's 16 of them)
            dq_lo.index(WG).reshape([FRAG_ROWS, FRAG_ROW]).store(_frag_tile(dq))
            fence_async_shared()
            tma_reduce_add(dq_desc, [batch, head, row // 2 + WG * FRAG_ROWS, 0], dq_lo.index(WG))
        elif DQ_BOX == DQ_N:
            dq_lo.index(WG).reshape([BLOCK_M, DQ_N]).store(dq)
            fence_async_shared()
            tma_reduce_add(dq_desc, [batch, head, row, WG * DQ_N], dq_lo.index(WG))
        else:
            halves = dq.reshape([BLOCK_M, 2, DQ_BOX]).permute((0, 2, 1))
            lo, hi = gl.split(halves)
            dq_lo.index(WG).reshape([BLOCK_M, DQ_BOX]).store(lo)
            dq_hi.index(WG).reshape([BLOCK_M, DQ_BOX]).store(hi)
            fence_async_shared()
            tma_reduce_add(dq_desc, [batch, head, row, WG * DQ_N], dq_lo.index(WG))
            tma_reduce_add(dq_desc, [batch, head, row, WG * DQ_N + DQ_BOX], dq_hi.index(WG))


@gluon.jit
def _fused_step(it, t, WG: gl.constexpr, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo,
                dq_hi, q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q,
                keys, band, qk_scale, batch, head, prev_head, prev_row, MASKED: gl.constexpr,
                HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr, P16_DS: gl.constexpr, LAG: gl.constexpr,
                DQ_FIRST: gl.constexpr, DEFER_DK: gl.constexpr, DQ_ATOMIC: gl.constexpr, fp8=None, kmax=None,
                FP8_EMU: gl.constexpr = False, DROPOUT: gl.constexpr = False, drop_args=0):
    """One query tile (rows [t * 64, +64) of one head) in warpgroup WG: dV += P^T dO, dK += dS^T Q, and
    this warpgroup's 64 columns of dQ_i = dS_i K reduced into the fp32 accumulator; under LAG (warpgroup 1,
    ``LAG``) those of the previous tile instead (prev_head, prev_row; prev_row = S_Q before the first).
    DQ_FIRST: the dQ product is issued before dK += dS^T Q, so the dQ staging runs under the dK wgmma.
    DEFER_DK (with DQ_FIRST, not LAG): dK += dS^T Q reads dS^T from the exchange buffer and is left in
    flight (dk an accumulator token) until S^T of the next step is done, so the tensor core has work at the
    step boundary; that step releases this one's Q/dO slot and dS buffer. ds_keep: zeros in a_layout,
    passed through (the operand of the 0 * K_WG wgmma that starts a deferred dk).
    FP8_EMU ([Note] FP8): fp8 = (lse shift, dP factor, delta factor, P's type is e5m2, dS's type is e5m2); P
    comes out scaled by scale_s and rounded to FP8 for dV, dS scaled by scale_dP and rounded to FP8 for dK and
    dQ, and kmax [64 keys] keeps max |dS * scale_dP| over the rows so far.
    DROPOUT ([Note] dropout): drop_args = (seed, offset, threshold, 1 / (1 - p), H_Q, S_Q, S_KV, the warpgroup's
    first key); the keep bits of this (keys, rows) tile are the forward's (``dropout.keep`` on the transposed
    tile), dV takes the kept P and dS = P (dP * keep / (1 - p) - delta).
    kv_a: (K_WG, V_WG), the A operands of S^T = K_WG Q^T and dP^T = V_WG dO^T: the warpgroup's shared-memory
    tiles, or (``KV_REGS``) the same tiles held in registers for the whole loop.
    Returns dk, dv, ds_keep, the (head, row) whose dQ the next LAG step reduces, and kmax."""
    BLOCK_M: gl.constexpr = zero_s.shape[1]
    WG_N: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    s_layout: gl.constexpr = zero_s.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    # FP8_EMU >= 2 ([Note] FP8 MMAs): every product an FP8 wgmma, P8 / dS8 as 8-bit register operands; the
    # consumer's step code 2 + (P in e5m2) + 2 (dS in e5m2) carries their types as compile-time values (a
    # tuple's constexprs do not stay constexprs through these calls)
    FP8_MMA: gl.constexpr = FP8_EMU >= 2
    P8_E5M2: gl.constexpr = (FP8_EMU == 3) or (FP8_EMU == 5)
    DS8_E5M2: gl.constexpr = FP8_EMU >= 4
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv.type.layout, k_width=4 if FP8_MMA else 2)
    dtype: gl.constexpr = k_smem.dtype
    k_view = k_smem.index(WG).reshape([WG_N, HEAD_D])
    slot = it % STAGES
    phase = (it // STAGES) & 1
    xb = it % 2
    xphase = (it // 2) & 1
    q_view = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
    do_view = do_smem.index(slot).reshape([BLOCK_M, HEAD_D])

    mbarrier.wait(q_ready.index(slot), phase)
    s_tok = warpgroup_mma(kv_a[0], q_view.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(slot), phase)
    dp_tok = warpgroup_mma(kv_a[1], do_view.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(l_ready.index(slot), phase)
    lse2 = lse_smem.index(slot).load(col_layout)
    if FP8_EMU:
        lse2 = lse2 - fp8[0]        # P * scale_s = exp2(S - (lse2 - log2 scale_s)): the scale in the exponent
    # groups retire in order: one left in flight means S^T is done (dP^T runs on)
    if DEFER_DK:
        # ... and so is the previous step's dK (issued before S^T), the last reader of its Q/dO slot and of
        # its dS buffer
        s, dk = warpgroup_mma_wait(1, deps=(s_tok, dk))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > 0)
        mbarrier.arrive(ds_empty.index((it + 1) % 2), pred=it > 0)
    else:
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p = _pt_tile(s, qk_scale, lse2, t, keys, band, 0.0, MASKED, False, HAS_RIGHT, False)
    if DROPOUT:
        # the keep bits of keys [n0 + 64 WG, +64) x rows [t * 64, +64) of this query head: the forward's mask
        # (``dropout.keep`` on the transposed tile; the counter base is the (batch, query head)'s), folded into
        # P's sign at once (P >= 0: kept P, or -P dropped; -0.0 keeps its sign), so no mask stays live
        seed, offset, threshold, rescale, h_q, s_q, s_kv, key0 = drop_args
        drop = dropout.state(seed, offset, batch * h_q + head, s_q, s_kv, threshold, rescale)
        p = gl.where(dropout.keep(drop, key0, t * BLOCK_M, s_layout, BLOCK_M, False), p, -p)
    if FP8_MMA:
        # P8 as the register operand, its query rows in dO^T's row order (fwd_sm90 ``_pack_p8``, ``key_order``)
        p16 = _fp8_operand(p, P8_E5M2, a_layout)
        dot_view = fp8[6].index(slot).reshape([HEAD_D, BLOCK_M]).permute((1, 0))
        dv_tok = warpgroup_mma(p16, dot_view, dv, is_async=True)
    else:
        if FP8_EMU:
            pb = _fp8_round16(p, fp8[3])       # P8 = fp8(P * scale_s), exact in fp16
        elif DROPOUT:
            pb = gl.maximum(p, 0.0).to(dtype)      # the kept P; dV's 1 / (1 - p) once in the epilogue
        else:
            pb = p.to(dtype)
        p16 = gl.convert_layout(pb, a_layout)
        if P16_DS:
            # dS from the 16-bit P (the dV operand): the fp32 P dies here (``P16_DS``)
            p = pb.to(gl.float32)
        dv_tok = warpgroup_mma(p16, do_view, dv, is_async=True)
    delta = delta_smem.index(slot).load(col_layout)
    # dP^T done, dV += P^T dO runs on under the dS arithmetic
    dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    if FP8_EMU:
        # dS * scale_dP = (P * scale_s) (dP_raw * a - delta_raw * b): a and b hold the descales, the softmax
        # scale, scale_dP and 1 / scale_s
        x = p * (dp * fp8[1] - (delta * fp8[2])[None, :])
        kmax = gl.maximum(kmax, gl.max(gl.abs(x), axis=1))
        if FP8_MMA:
            ds = x
        else:
            ds = _fp8_round16(x, fp8[4])       # dS8 = fp8(dS * scale_dP), exact in fp16
    elif DROPOUT:
        # dS = P (dP keep / (1 - p) - delta) from the signed P (the dK/dV pass's form, bwd_dkdv_sm90 _dp_dk_step)
        ds = (gl.maximum(p, 0.0) * (dp * drop_args[3]) - gl.abs(p) * delta[None, :]).to(dtype)
    else:
        ds = (p * (dp - delta[None, :])).to(dtype)
    if DEFER_DK:
        ds16 = ds_keep      # dK reads dS^T from the exchange buffer
    elif FP8_MMA:
        ds16 = _fp8_operand(ds, DS8_E5M2, a_layout)      # dS8^T, rows in Q^T's row order
    else:
        ds16 = gl.convert_layout(ds, a_layout)
    if not DQ_FIRST:
        if FP8_MMA:
            dk_tok = warpgroup_mma(ds16, fp8[5].index(slot).reshape([HEAD_D, BLOCK_M]).permute((1, 0)), dk,
                                   is_async=True)
        else:
            dk_tok = warpgroup_mma(ds16, q_view, dk, is_async=True)

    # dS^T half -> buffer xb once both warpgroups' dQ products of tile it - 2 have read it
    mbarrier.wait(ds_empty.index(xb), xphase ^ 1)
    if FP8_MMA:
        _fp8_store_transposed(ds, DS8_E5M2, ds_smem.index(2 * xb + WG))      # dS8 [rows, keys], the dQ operand
    else:
        ds_smem.index(2 * xb + WG).store(ds)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(xb))
    if LAG:
        # tile it - 1's buffer (before the first tile: a fresh barrier's phase 1, which passes at once)
        rb = (it + 1) % 2
        mbarrier.wait(ds_ready.index(rb), ((it + 1) // 2 + 1) & 1)
        dq_row = prev_row
        dq_head = prev_head
    else:
        rb = xb
        mbarrier.wait(ds_ready.index(xb), xphase)
        dq_row = t * BLOCK_M
        dq_head = head
    if FP8_MMA:
        dq_tok = _dq_product(ds_smem, fp8[7], rb, zero_q, WG, True)
    else:
        dq_tok = _dq_product(ds_smem, k_smem, rb, zero_q, WG)
    if DQ_FIRST:
        # FA3's order: dK is issued after dQ, and the dQ staging (wait for the previous reduce, 16 STS,
        # fence, reduce) runs while dK += dS^T Q keeps the tensor core busy
        if DEFER_DK:
            # dS^T from shared memory (this warpgroup's half of the exchange buffer): no 16-bit register
            # copy stays live while dK is in flight into the next step
            dk_tok = warpgroup_mma(ds_smem.index(2 * xb + WG), q_view, dk, is_async=True)
        else:
            dk_tok = warpgroup_mma(ds16, q_view, dk, is_async=True)
        # groups in flight: dV, dQ (2), dK; one left means dV and dQ are done
        dv, dq, p16 = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok, p16))
        if not DEFER_DK:
            _release_ds(ds_empty, rb, it, LAG)
        _dq_stage(dq, dq_lo, dq_hi, dq_out, batch, dq_head, dq_row, WG, DQ_ATOMIC)
        if DEFER_DK:
            dk = dk_tok
        else:
            dk, ds16 = warpgroup_mma_wait(0, deps=(dk_tok, ds16))
            mbarrier.arrive(empty.index(slot))
    else:
        if FP8_MMA:
            # Triton 3.6's wait cannot carry 8-bit values; ptxas keeps an in-flight wgmma's registers (fwd_sm90
            # _pv_wait; tools/gluon_check.py inflight_a_writes)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
        else:
            dv, dk, dq, p16, ds16 = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, p16, ds16))
        mbarrier.arrive(empty.index(slot))
        _release_ds(ds_empty, rb, it, LAG)
        _dq_stage(dq, dq_lo, dq_hi, dq_out, batch, dq_head, dq_row, WG, DQ_ATOMIC)
    return dk, dv, ds_keep, head, t * BLOCK_M, kmax


@gluon.jit
def _release_ds(ds_empty, rb, it, LAG: gl.constexpr):
    """Both dQ products of dS buffer rb have read it (under LAG none before the first tile: no arrival)."""
    if LAG:
        mbarrier.arrive(ds_empty.index(rb), pred=it > 0)
    else:
        mbarrier.arrive(ds_empty.index(rb))


@gluon.jit
def _tile_loop(lo, hi, it, WG: gl.constexpr, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi,
               q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q, keys,
               band, qk_scale, batch, head, prev_head, prev_row, MASKED: gl.constexpr, HAS_RIGHT: gl.constexpr,
               STAGES: gl.constexpr, P16_DS: gl.constexpr, LAG: gl.constexpr, REVERSE: gl.constexpr,
               DQ_FIRST: gl.constexpr, DEFER_DK: gl.constexpr, DQ_ATOMIC: gl.constexpr, ROTATE: gl.constexpr = False,
               rot=0, SEGMENTS: gl.constexpr = False, GROUP=1, fp8=None, kmax=None, FP8_EMU: gl.constexpr = False,
               DROPOUT: gl.constexpr = False, drop_args=0):
    """Query tiles [lo, hi) of one head, ascending (or descending under REVERSE); ROTATE: starting ``rot``
    tiles into that order and wrapping around (the producer's order, ``_dkdv_producer``). SEGMENTS: the same
    tiles of GROUP heads, head after head, in one loop (head and dq_out: the first head's; "Switches":
    Segments)."""
    n = hi - lo
    start = 0
    if ROTATE:
        start = rot % gl.maximum(n, 1)       # one division per run; the loop wraps with a compare
    if SEGMENTS:
        BLOCK_M: gl.constexpr = q_smem.shape[3]
        HEAD_D: gl.constexpr = k_smem.shape[4]
        dq_desc, dq_first, S_Q = dq_out
        # dq_acc: contiguous [b, h_q, S_Q rounded up to BLOCK_M, HEAD_D] (``acc_rows``)
        head_elems = ((S_Q + BLOCK_M - 1) // BLOCK_M * BLOCK_M * HEAD_D).to(gl.int64)
        g = 0
        i = 0
        for v in range(GROUP * n):
            j = i
            if ROTATE:
                j = i + start
                if j >= n:
                    j = j - n
            t = hi - 1 - j if REVERSE else lo + j
            dk, dv, ds_keep, prev_head, prev_row, kmax = _fused_step(
                it, t, WG, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi, q_ready,
                do_ready, l_ready, empty, ds_ready, ds_empty, (dq_desc, dq_first + g * head_elems, S_Q), dk, dv,
                ds_keep, zero_s, zero_q, keys, band, qk_scale, batch, head + g, prev_head, prev_row, MASKED, HAS_RIGHT,
                STAGES, P16_DS, LAG, DQ_FIRST, DEFER_DK, DQ_ATOMIC, fp8, kmax, FP8_EMU, DROPOUT, drop_args)
            it += 1
            i += 1
            if i == n:
                i = 0
                g += 1
    else:
        for i in range(n):
            j = i
            if ROTATE:
                j = i + start
                if j >= n:
                    j = j - n
            t = hi - 1 - j if REVERSE else lo + j
            dk, dv, ds_keep, prev_head, prev_row, kmax = _fused_step(
                it, t, WG, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi, q_ready,
                do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q, keys, band,
                qk_scale, batch, head, prev_head, prev_row, MASKED, HAS_RIGHT, STAGES, P16_DS, LAG, DQ_FIRST, DEFER_DK,
                DQ_ATOMIC, fp8, kmax, FP8_EMU, DROPOUT, drop_args)
            it += 1
    return it, dk, dv, ds_keep, prev_head, prev_row, kmax


@gluon.jit
def _runs(t_lo, t_a, t_b, t_hi, it, WG: gl.constexpr, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem,
          dq_lo, dq_hi, q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q,
          keys, band, qk_scale, batch, head, prev_head, prev_row, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr,
          P16_DS: gl.constexpr, LAG: gl.constexpr, REVERSE: gl.constexpr, DQ_FIRST: gl.constexpr,
          DEFER_DK: gl.constexpr, DQ_ATOMIC: gl.constexpr, ROTATE: gl.constexpr, rot, SEGMENTS: gl.constexpr, GROUP,
          fp8=None, kmax=None, FP8_EMU: gl.constexpr = False, DROPOUT: gl.constexpr = False, drop_args=0):
    """The CTA's query tiles of one head (or under SEGMENTS of GROUP heads from ``head`` on): masked [lo0, hi0),
    mask-free [t_a, t_b), masked [lo2, hi2): the band's left edge first, or with REVERSE the last query tile
    first (module docstring, "Switches": Order)."""
    lo0, hi0, lo2, hi2 = t_lo, t_a, t_b, t_hi
    if REVERSE:
        lo0, hi0, lo2, hi2 = t_b, t_hi, t_lo, t_a
    # [t_b, t_hi) is masked only under a left window bound, which this kernel never has (``_q_tiles`` with
    # HAS_LEFT off leaves it empty, but not provably so): that run is not compiled
    if not REVERSE:
        it, dk, dv, ds_keep, prev_head, prev_row, kmax = _tile_loop(
            lo0, hi0, it, WG, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi,
            q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q, keys,
            band, qk_scale, batch, head, prev_head, prev_row, True, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE,
            DQ_FIRST, DEFER_DK, DQ_ATOMIC, False, 0, SEGMENTS, GROUP, fp8, kmax, FP8_EMU, DROPOUT, drop_args)
    it, dk, dv, ds_keep, prev_head, prev_row, kmax = _tile_loop(
        t_a, t_b, it, WG, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi,
        q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q, keys,
        band, qk_scale, batch, head, prev_head, prev_row, False, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE,
        DQ_FIRST, DEFER_DK, DQ_ATOMIC, ROTATE, rot, SEGMENTS, GROUP, fp8, kmax, FP8_EMU, DROPOUT, drop_args)
    if REVERSE:
        it, dk, dv, ds_keep, prev_head, prev_row, kmax = _tile_loop(
            lo2, hi2, it, WG, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi,
            q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q, keys,
            band, qk_scale, batch, head, prev_head, prev_row, True, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE,
            DQ_FIRST, DEFER_DK, DQ_ATOMIC, False, 0, SEGMENTS, GROUP, fp8, kmax, FP8_EMU, DROPOUT, drop_args)
    return it, dk, dv, ds_keep, prev_head, prev_row, kmax


@gluon.jit
def _fused_consumer(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi,
                    kv_bar, q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, done, dk_desc, dv_desc, dq_desc,
                    DQ_ACC, batch, kv_head, n0, H_Q, GROUP, S_Q, band, tiles, qk_scale, sm_scale,
                    HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr, REVERSE: gl.constexpr, P16_DS: gl.constexpr,
                    LAG: gl.constexpr, DQ_FIRST: gl.constexpr, DEFER_DK: gl.constexpr, DQ_ATOMIC: gl.constexpr,
                    ROTATE: gl.constexpr, rot, SEGMENTS: gl.constexpr, fp8_io=None, FP8_EMU: gl.constexpr = False,
                    P_E5M2: gl.constexpr = False, DS_E5M2: gl.constexpr = False, DROPOUT: gl.constexpr = False,
                    drop_io=0, KV_REGS: gl.constexpr = False):
    """Consumer warpgroup WG: dK, dV of keys [n0 + 64 WG, +64), and its dQ columns of every tile
    (LAG: each one a tile late, the last one after the loop). FP8_EMU ([Note] FP8): fp8_io = (SCALES, AMAX,
    dK's output, dV's output, S_KV); P's and dS's FP8 types e5m2 where P_E5M2 / DS_E5M2, else e4m3.
    DROPOUT ([Note] dropout): drop_io = (seed, offset, threshold, 1 / (1 - p), S_KV).
    KV_REGS ([Note] K and V in registers): at d=64, 16-bit, no dropout, K_WG and V_WG are loaded into registers
    once and are the A operands of every step's S^T and dP^T wgmmas."""
    WG_N: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    DQ_N: gl.constexpr = HEAD_D // 2
    dtype: gl.constexpr = k_smem.dtype
    FP8_MMA: gl.constexpr = FP8_EMU == 2          # [Note] FP8 MMAs: 8-bit wgmmas (K steps of 32)
    # the steps' code for it (``_fused_step``): 2 + (P in e5m2) + 2 (dS in e5m2)
    STEP_EMU: gl.constexpr = 2 + P_E5M2 + 2 * DS_E5M2 if FP8_MMA else FP8_EMU
    MMA_K: gl.constexpr = 32 if FP8_MMA else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, MMA_K])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, MMA_K])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DQ_N, MMA_K])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4 if FP8_MMA else 2)
    gl.static_assert(DQ_FIRST or not DEFER_DK, "DEFER_DK needs DQ_FIRST (dK the last group in flight)")
    gl.static_assert(not (LAG and DEFER_DK), "DEFER_DK releases dS buffers a step late, LAG reads them late")
    gl.static_assert(not (LAG and DQ_ATOMIC), "DQ_ATOMIC addresses the current head's rows only")
    gl.static_assert(not (DROPOUT and (FP8_EMU or P16_DS)), "dropout: the 16-bit kernel, dS from the fp32 P")
    zero_s = gl.zeros([WG_N, BLOCK_M], gl.float32, s_layout)
    zero_q = gl.zeros([BLOCK_M, DQ_N], gl.float32, q_layout)
    dk = gl.zeros([WG_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([WG_N, HEAD_D], gl.float32, acc_layout)
    # DEFER_DK: the A operand of the dK wgmma in flight (none before the first step)
    ds_keep = gl.zeros([WG_N, BLOCK_M], dtype, a_layout)
    keys = n0 + WG * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(1, s_layout))
    k_view = k_smem.index(WG).reshape([WG_N, HEAD_D])
    v_view = v_smem.index(WG).reshape([WG_N, HEAD_D])
    mbarrier.wait(kv_bar, 0)
    if KV_REGS and HEAD_D == 64 and not FP8_EMU and not DROPOUT:
        # [Note] K and V in registers: 16 + 16 registers per thread, read from shared memory once
        ka_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        kv_a = (k_view.load(ka_layout), v_view.load(ka_layout))
    else:
        kv_a = (k_view, v_view)
    if DEFER_DK:
        # dk is loop-carried as an in-flight wgmma accumulator (``_fused_step``); it starts as the result of
        # a wgmma too, 0 * K_WG with use_acc=False, so that no plain instruction defines it on any path to a
        # wgmma wait
        dk = warpgroup_mma(ds_keep, k_view, dk, use_acc=False, is_async=True)

    fp8 = None
    # FP8_EMU: max |dS * scale_dP| per key (loop-carried; unchanged, and folded away, in the 16-bit kernel)
    kmax = gl.zeros([WG_N], gl.float32, gl.SliceLayout(1, s_layout))
    if FP8_EMU:
        gl.static_assert(not (LAG or DEFER_DK or P16_DS), "FP8_EMU: the default order only")
        gl.static_assert(not (FP8_MMA and DQ_FIRST), "FP8 MMAs: dK before dQ")
        SCALES = fp8_io[0]
        # SCALES: fusedattn.backends.triton.bwd.FP8_BWD_SCALE_NAMES' order
        d_q, d_k, d_v, d_o, d_do = gl.load(SCALES), gl.load(SCALES + 1), gl.load(SCALES + 2), gl.load(SCALES + 3), \
            gl.load(SCALES + 4)
        scale_s, scale_dp = gl.load(SCALES + 7), gl.load(SCALES + 11)
        qk_scale = qk_scale * d_q * d_k
        ds_unit = sm_scale * scale_dp / scale_s
        if FP8_MMA:
            # ... and the transposed tiles: the Q^T and dO^T rings, K^T ([Note] FP8 MMAs)
            t_smem = fp8_io[5]
            fp8 = (gl.log2(scale_s), d_do * d_v * ds_unit, d_do * d_o * ds_unit, P_E5M2, DS_E5M2, t_smem[0],
                   t_smem[1], t_smem[2])
        else:
            fp8 = (gl.log2(scale_s), d_do * d_v * ds_unit, d_do * d_o * ds_unit, P_E5M2, DS_E5M2)
    drop_args = 0
    if DROPOUT:
        drop_args = (drop_io[0], drop_io[1], drop_io[2], drop_io[3], H_Q, S_Q, drop_io[4], n0 + WG * WG_N)
    t_lo, t_a, t_b, t_hi = tiles
    it = 0
    prev_head = kv_head * GROUP
    prev_row = S_Q       # LAG: no tile before the first (a reduce at row S_Q is clipped whole)
    # ``_dq_stage``: the descriptor, a head's rows of dq_acc (contiguous [b, h_q, S_Q rounded up to BLOCK_M,
    # HEAD_D]), S_Q
    acc_rows = (S_Q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if SEGMENTS:
        head = kv_head * GROUP
        dq_out = (dq_desc, DQ_ACC + (batch * H_Q + head).to(gl.int64) * acc_rows * HEAD_D, S_Q)
        it, dk, dv, ds_keep, prev_head, prev_row, kmax = _runs(
            t_lo, t_a, t_b, t_hi, it, WG, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo,
            dq_hi, q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q,
            keys, band, qk_scale, batch, head, prev_head, prev_row, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE,
            DQ_FIRST, DEFER_DK, DQ_ATOMIC, ROTATE, rot, True, GROUP, fp8, kmax, STEP_EMU, DROPOUT, drop_args)
    else:
        for g in range(GROUP):
            head = kv_head * GROUP + g
            dq_out = (dq_desc, DQ_ACC + (batch * H_Q + head).to(gl.int64) * acc_rows * HEAD_D, S_Q)
            it, dk, dv, ds_keep, prev_head, prev_row, kmax = _runs(
                t_lo, t_a, t_b, t_hi, it, WG, k_smem, kv_a, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo,
                dq_hi, q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, dq_out, dk, dv, ds_keep, zero_s, zero_q,
                keys, band, qk_scale, batch, head, prev_head, prev_row, HAS_RIGHT, STAGES, P16_DS, LAG, REVERSE,
                DQ_FIRST, DEFER_DK, DQ_ATOMIC, ROTATE, rot, False, 1, fp8, kmax, STEP_EMU, DROPOUT, drop_args)
    if DEFER_DK:
        # the last step's dK (its Q/dO slot and dS buffer are not released: nothing is loaded or stored
        # into them again)
        dk = warpgroup_mma_wait(0, deps=(dk, ))
    if LAG:
        # the last tile's dQ columns (no tile at all: prev_row = S_Q, the reduce is clipped whole)
        pb_ = (it + 1) % 2
        mbarrier.wait(ds_ready.index(pb_), ((it + 1) // 2 + 1) & 1)
        dq_tok = _dq_product(ds_smem, k_smem, pb_, zero_q, WG)
        dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
        _dq_stage(dq, dq_lo, dq_hi, (dq_desc, DQ_ACC, S_Q), batch, prev_head, prev_row, WG, DQ_ATOMIC)

    if FP8_EMU:
        # [Note] FP8: amax_dP = max |dS| over the keys inside the sequence; dV, dK descaled in the emulation's
        # order (matmul_fp8's: descale A, then B) and written from registers in the gradients' own type
        SCALES = fp8_io[0]
        AMAX = fp8_io[1]
        dk_out = fp8_io[2]
        dv_out = fp8_io[3]
        S_KV = fp8_io[4]
        key0 = n0 + WG * WG_N
        key_in = keys < S_KV
        gl.atomic_max(AMAX + 3, gl.max(gl.where(key_in, kmax, 0.0), 0) / gl.load(SCALES + 11))
        _fp8_grad_write(dv * gl.load(SCALES + 5) * gl.load(SCALES + 4), key0, S_KV, dv_out, batch, kv_head,
                        SCALES + 10, AMAX + 2)
        _fp8_grad_write(dk * gl.load(SCALES + 6) * gl.load(SCALES), key0, S_KV, dk_out, batch, kv_head, SCALES + 9,
                        AMAX + 1)
        tma.store_wait(0)       # the last dQ reduce has read its staging tile before the CTA exits
    else:
        # dV through this warpgroup's V tile (only it reads V_WG); TMA clips keys >= S_KV
        if DROPOUT:
            dv = dv * drop_io[3]      # the kept P's 1 / (1 - p), left out of the steps
        v_view.store(dv.to(dtype))
        fence_async_shared()
        tma_store(dv_desc, [batch, kv_head, n0 + WG * WG_N, 0], v_smem.index(WG))
        # dK through its K tile once the other warpgroup's dQ products (they read both K tiles) are done
        mbarrier.arrive(done)
        mbarrier.wait(done, 0)
        k_view.store((dk * sm_scale).to(dtype))
        fence_async_shared()
        tma_store(dk_desc, [batch, kv_head, n0 + WG * WG_N, 0], k_smem.index(WG))
        tma.store_wait(0)


@gluon.jit
def _attn_bwd_fused_sm90(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DQ_ACC, LSE, stride_lb,
                         stride_lh, stride_lm, DELTA, H_KV, H_Q, GROUP, S_Q, S_KV, qk_scale, sm_scale, CHUNK,
                         STAGES: gl.constexpr, HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, REVERSE: gl.constexpr,
                         P16_DS: gl.constexpr, LAG: gl.constexpr, DQ_FIRST: gl.constexpr, DEFER_DK: gl.constexpr,
                         DQ_ATOMIC: gl.constexpr, ROTATE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, SEGMENTS: gl.constexpr = False, SCALES=None, AMAX=None,
                         DK_OUT=None, stride_dkb=0, stride_dkh=0, stride_dkm=0, DV_OUT=None, stride_dvb=0,
                         stride_dvh=0, stride_dvm=0, FP8_EMU: gl.constexpr = False, P_E5M2: gl.constexpr = False,
                         DS_E5M2: gl.constexpr = False, QT_DESC=None, DOT_DESC=None, KT_DESC=None, DROP_SEED=0,
                         DROP_OFFSET=0, DROP_THRESHOLD=0, DROP_RESCALE=1.0, DROPOUT: gl.constexpr = False,
                         KV_REGS: gl.constexpr = True):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    WG_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    DQ_BOX: gl.constexpr = dq_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = 2 * WG_N
    dtype: gl.constexpr = q_desc.dtype

    # program ids in chunks of CHUNK (batch, kv head) pairs, key block outermost inside a chunk
    # (``HEAVY_FIRST``, ``bwd_dq_sm90._heavy_first``): key block 0 (the most query tiles under a causal mask) of
    # every pair of the chunk is dispatched before any key block 1, and so on; CHUNK = 1 is the grid's own order
    n_blocks = gl.num_programs(0)
    pid_n, bh = _heavy_first(gl.program_id(0) + gl.program_id(1) * n_blocks, n_blocks, CHUNK)
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
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    FP8_MMA: gl.constexpr = FP8_EMU == 2
    if FP8_MMA:
        # [Note] FP8 MMAs: the dS exchange holds dS8 itself, [buffer, warpgroup] -> [64 rows, 64 keys], keys
        # innermost (the dQ wgmma's A operand is K-major); Q^T and dO^T rings beside Q's and dO's, K^T beside K
        DS_TY: gl.constexpr = gl.float8e5 if DS_E5M2 else gl.float8e4nv
        ds_smem = gl.allocate_shared_memory(DS_TY, [4, BLOCK_M, WG_N],
                                            gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
        qt_smem = gl.allocate_shared_memory(QT_DESC.dtype, [STAGES, 1, 1, HEAD_D, BLOCK_M], QT_DESC.layout)
        dot_smem = gl.allocate_shared_memory(DOT_DESC.dtype, [STAGES, 1, 1, HEAD_D, BLOCK_M], DOT_DESC.layout)
        kt_smem = gl.allocate_shared_memory(KT_DESC.dtype, [2, 1, 1, HEAD_D, WG_N], KT_DESC.layout)
        t_io = (QT_DESC, DOT_DESC, KT_DESC, qt_smem, dot_smem, kt_smem)
    else:
        # dS^T exchange: [buffer, warpgroup] -> [64 keys, 64 rows] 16-bit tiles
        ds_smem = gl.allocate_shared_memory(dtype, [4, WG_N, BLOCK_M],
                                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        t_io = (q_desc, do_desc, k_desc, q_smem, do_smem, k_smem)      # stand-ins, never read
    # dQ staging: per warpgroup [64 rows, 32] fp32 boxes (the reduce's), columns [0, 32) and [32, 64) of its
    # 64 in two allocations (``_dq_stage``); flat: one [64, 64] box each, dq_lo alone
    if DQ_BOX == FRAG_ROW:
        # "frag": one [16, 256] box per warpgroup ([Note] dQ in fragment order)
        gl.static_assert(HEAD_D == 128 and not LAG and not DQ_ATOMIC, "frag dQ staging: d=128, no LAG, no atomics")
        dq_lo = gl.allocate_shared_memory(gl.float32, [2, 1, 1, FRAG_ROWS, FRAG_ROW], dq_desc.layout)
    else:
        dq_lo = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, DQ_BOX], dq_desc.layout)
    if DQ_BOX == HEAD_D // 2 or DQ_BOX == FRAG_ROW:
        dq_hi = dq_lo
    else:
        dq_hi = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, DQ_BOX], dq_desc.layout)
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

    if FP8_MMA:
        fp8_io = (SCALES, AMAX, (DK_OUT, stride_dkb, stride_dkh, stride_dkm),
                  (DV_OUT, stride_dvb, stride_dvh, stride_dvm), S_KV, (qt_smem, dot_smem, kt_smem))
    elif FP8_EMU:
        fp8_io = (SCALES, AMAX, (DK_OUT, stride_dkb, stride_dkh, stride_dkm),
                  (DV_OUT, stride_dvb, stride_dvh, stride_dvm), S_KV)
    else:
        # stand-ins of the same structure (warp_specialize takes typed values only), never read
        fp8_io = (DELTA, DELTA, (DELTA, S_KV, S_KV, S_KV), (DELTA, S_KV, S_KV, S_KV), S_KV)
    drop_io = 0
    if DROPOUT:
        drop_io = (DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE, S_KV)
    gl.warp_specialize([
        (_fused_consumer, (0, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi,
                           kv_bar.index(0), q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, done.index(0),
                           dk_desc, dv_desc, dq_desc, DQ_ACC, batch, kv_head, n0, H_Q, GROUP, S_Q, band, tiles,
                           qk_scale, sm_scale, HAS_RIGHT, STAGES, REVERSE, P16_DS, False, DQ_FIRST, DEFER_DK,
                           DQ_ATOMIC, ROTATE, pid_n, SEGMENTS, fp8_io, FP8_EMU, P_E5M2, DS_E5M2, DROPOUT, drop_io,
                           KV_REGS)),
        (_fused_consumer, (1, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_lo, dq_hi,
                           kv_bar.index(0), q_ready, do_ready, l_ready, empty, ds_ready, ds_empty, done.index(0),
                           dk_desc, dv_desc, dq_desc, DQ_ACC, batch, kv_head, n0, H_Q, GROUP, S_Q, band, tiles,
                           qk_scale, sm_scale, HAS_RIGHT, STAGES, REVERSE, P16_DS, LAG, DQ_FIRST, DEFER_DK,
                           DQ_ATOMIC, ROTATE, pid_n, SEGMENTS, fp8_io, FP8_EMU, P_E5M2, DS_E5M2, DROPOUT, drop_io,
                           KV_REGS)),
        # the dK/dV pass's producer (no ALiBi, no padding; SLOPES unused: DELTA stands in, batch stride 0)
        (_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                          kv_bar.index(0), q_ready, do_ready, l_ready, empty, LSE, stride_lb, stride_lh, stride_lm,
                          DELTA, DELTA, 0, batch, kv_head, n0, H_Q, GROUP, S_Q, S_Q, tiles[0], tiles[3], STAGES, False,
                          False, REVERSE, ROTATE, tiles[1], tiles[2], pid_n, SEGMENTS, t_io, FP8_MMA)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@triton.jit
def _delta_zero(O, DO, DELTA, ACC, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, H_Q, S_Q,
                ACC_ROWS, BLOCK: tl.constexpr, D: tl.constexpr, ZERO_PAD: tl.constexpr = False):
    """delta[bh, rows] = rowsum(dO * O) in fp32 and dq_acc[bh, rows, :] = 0 for BLOCK rows of one (batch,
    head): the delta pass and the zeroing of the fused kernel's dQ accumulator (ACC_ROWS rows per head, the
    padding past S_Q left alone) in one launch (both are bandwidth-bound; one pass saves the second launch
    and its tail). ZERO_PAD: the padding rows zeroed too (the "frag" layout interleaves them with the rest)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    batch = (bh // H_Q).to(tl.int64)
    head = (bh % H_Q).to(tl.int64)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    keep = (rows < S_Q)[:, None]
    o = tl.load(O + batch * stride_ob + head * stride_oh + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
                mask=keep, other=0.0)
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows.to(tl.int64)[:, None] * stride_dom
                 + cols[None, :], mask=keep, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * S_Q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < S_Q)
    tl.store(ACC + (bh.to(tl.int64) * ACC_ROWS + rows)[:, None] * D + cols[None, :],
             tl.zeros([BLOCK, D], tl.float32), mask=(rows < ACC_ROWS)[:, None] if ZERO_PAD else keep)


@triton.jit
def _dq_convert(ACC, DQ, stride_b, stride_h, stride_m, H_Q, S_Q, ACC_ROWS, scale, BLOCK: tl.constexpr,
                D: tl.constexpr, FRAG: tl.constexpr = False):
    """dq[b, h, rows] = scale * dq_acc[b, h, rows] in dq's dtype (dq: any strides, unit last; dq_acc ACC_ROWS
    rows per head; FRAG: each 64-row tile's two 64-column halves in fragment order, [Note] dQ in fragment order)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    if FRAG:
        # f = e | i << 1 | lane << 2 | warp << 7 | j << 9 of (r, c) within a [64, 64] half (``_frag_tile``)
        r = (rows % 64)[:, None]
        c = (cols % 64)[None, :]
        f = ((c & 1) | ((r >> 3) & 1) << 1 | ((c >> 1) & 3) << 2 | (r & 7) << 4 | ((r >> 4) & 3) << 7
             | (c >> 3) << 9)
        offs = bh.to(tl.int64) * ACC_ROWS * D + ((rows // 64) * (64 * D))[:, None] + ((cols // 64) * 4096)[None, :] + f
    else:
        offs = (bh.to(tl.int64) * ACC_ROWS + rows)[:, None] * D + cols[None, :]
    acc = tl.load(ACC + offs, mask=(rows < S_Q)[:, None])
    base = DQ + (bh // H_Q).to(tl.int64) * stride_b + (bh % H_Q).to(tl.int64) * stride_h
    tl.store(base + rows.to(tl.int64)[:, None] * stride_m + cols[None, :], (acc * scale).to(DQ.dtype.element_ty),
             mask=(rows < S_Q)[:, None])


@triton.jit
def _dq_convert_fp8(ACC, DQ, stride_b, stride_h, stride_m, H_Q, S_Q, ACC_ROWS, SCALES, AMAX, BLOCK: tl.constexpr,
                    D: tl.constexpr):
    """The FP8 backward's dq ([Note] FP8): dq_acc * descale_dP * descale_k (the emulation's order), its amax
    into AMAX[0] and dq = that * scale_dQ in dq's type (``triton.bwd.fp8_grad_out``: FP8 saturating)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    row_in = rows < S_Q
    acc = tl.load(ACC + (bh.to(tl.int64) * ACC_ROWS + rows)[:, None] * D + cols[None, :], mask=row_in[:, None],
                  other=0.0)
    val = fp8_grad_out(acc * tl.load(SCALES + 6) * tl.load(SCALES + 1), row_in, SCALES + 8, AMAX,
                       DQ.dtype.element_ty, False)
    base = DQ + (bh // H_Q).to(tl.int64) * stride_b + (bh % H_Q).to(tl.int64) * stride_h
    tl.store(base + rows.to(tl.int64)[:, None] * stride_m + cols[None, :], val, mask=row_in[:, None])


# ----------------------------------------------------------------------------------------------
# host side

def acc_rows(s_q):
    """Rows per head of the fp32 dQ accumulator: s_q rounded up to whole query tiles (``DQ_ATOMIC`` adds
    whole tiles, unmasked)."""
    return cdiv(s_q, BLOCK_M) * BLOCK_M


@functools.lru_cache(maxsize=None)
def _dq_box(flat, d=128):
    """(box width, shared layout) of the dQ staging tile / TMA reduce (``DQ_FLAT``) at head dim d: a
    warpgroup's d / 2 columns in one unswizzled box (flat) or in 32-column (128-byte) swizzled boxes.
    Made once per (flat, d), as every layout a launch passes: ``launch._layout_token`` answers a kept layout by
    identity and a new one only through its repr (built anew per call, and keyed by id() as it once was, this one
    sent most backwards through the JIT's dispatch: ~120 us of host time at d=64, bench/NOTES.md 88)."""
    if flat == "frag":
        return FRAG_ROW.value, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    if flat:
        return d // 2, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    return 32, gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)


def supports(p, q, k, v, grad_out, dq, dk, dv) -> bool:
    """True when this kernel computes the whole backward of ``p`` on these tensors: sm_90, fp16/bf16,
    d = d_v in ``HEAD_DIMS``, no mask or causal (either alignment), dropout at ``DROPOUT_DIMS``; no windows, ALiBi,
    padding, bias, softcap (``bwd_dq_sm90._bwd_problem_ok`` minus windows, ALiBi and padding); TMA-ready q,
    k, v, grad_out, dk, dv; dq any strides with unit last stride."""
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
    if p.has_seq_len_q or p.has_seq_len_kv:      # no per-sequence lengths here
        return False
    if p.has_dropout and p.d not in DROPOUT_DIMS:
        return False
    return _bwd_problem_ok(p, HEAD_DIMS) and p.d in HEAD_DIMS and p.b * p.h_q * p.s_q < 2 ** 31


def launch_bwd_fused_sm90(p, q, k, v, grad_out, lse, delta, dq, dk, dv, *, out=None, dq_acc=None, stages=None,
                          reverse=None, flat=None, p16_ds=None, lag=None, dq_first=None, defer_dk=None,
                          dq_atomic=None, heavy_first=None, rotate=None, segments=None, kv_regs=None):
    """dQ, dK, dV of attention on Hopper in one pass (plus preparing dQ's fp32 accumulator and converting
    it), written in place.

    q [b,h_q,s_q,d], k/v [b,h_kv,s_kv,d], grad_out [b,h_q,s_q,d] (d = 128 or 64), dq like q, dk/dv like k/v (any
    strides of unit last stride; ``supports`` checks them); lse fp32 [b,h_q,s_q] view (natural log, the
    forward's). delta: fp32 contiguous [b*h_q, s_q]; out: the forward's output [b,h_q,s_q,d] (unit last
    stride, 16-byte aligned base) or None:

    * out given: one small kernel (``_delta_zero``) computes delta = rowsum(dO * O) into ``delta`` (a fresh
      buffer when None) and zeroes dq_acc in the same pass;
    * out None: delta holds rowsum(dO * O) already (the caller's delta pass) and dq_acc is zeroed here.

    dq_acc: optional fp32 scratch of b*h_q*acc_rows(s_q)*d elements. Tuning: stages, reverse, flat, p16_ds, lag,
    dq_first, defer_dk, dq_atomic, heavy_first, rotate, segments override ``STAGES``, ``REVERSE``, ``DQ_FLAT``,
    ``P16_DS``, ``LAG``, ``DQ_FIRST``, ``DEFER_DK``, ``DQ_ATOMIC``, ``HEAVY_FIRST``, ``ROTATE``, ``SEGMENTS``;
    kv_regs=False keeps K and V in shared memory at d=64 ([Note] K and V in registers)."""
    frag = _dq_flat(p, flat, lag, dq_atomic) == "frag"
    if dq_acc is None:
        dq_acc = _acc_buffer(p, q.device)
    dq_acc = dq_acc.view(p.b, p.h_q, acc_rows(p.s_q), p.d)
    if out is not None:
        if delta is None:
            delta = _delta_buffer(p, q.device)
        launch_delta_zero(p, out, grad_out, delta, dq_acc, zero_pad=frag)
    else:
        dq_acc.zero_()
    launch_kernel(p, q, k, v, grad_out, lse, delta, dq_acc, dk, dv, stages=stages, reverse=reverse, flat=flat,
                  p16_ds=p16_ds, lag=lag, dq_first=dq_first, defer_dk=defer_dk, dq_atomic=dq_atomic,
                  heavy_first=heavy_first, rotate=rotate, segments=segments, kv_regs=kv_regs)
    launch_convert(p, dq_acc, dq, frag=frag)
    return dq, dk, dv


def scratch(p, device) -> tuple:
    """(dq_acc, delta): dQ's fp32 accumulator [b, h_q, acc_rows(s_q), d] and delta's fp32 [b*h_q, s_q], uninitialized
    (``_delta_zero`` writes both), as ``launch_bwd_fused_sm90`` makes them."""
    return _acc_buffer(p, device), _delta_buffer(p, device)


def _acc_buffer(p, device):
    return torch.empty((p.b, p.h_q, acc_rows(p.s_q), p.d), dtype=torch.float32, device=device)


def _delta_buffer(p, device):
    return torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=device)


def launch_delta_zero(p, out, grad_out, delta, dq_acc, zero_pad=False):
    """delta = rowsum(dO * O) (fp32 contiguous [b*h_q, s_q]) and dq_acc = 0 (fp32 contiguous
    [b, h_q, acc_rows(s_q), d]; rows >= s_q left alone) in one launch. out, grad_out [b,h_q,s_q,d], any strides with unit last stride."""
    assert delta.is_contiguous() and delta.dtype == torch.float32
    assert dq_acc.is_contiguous() and dq_acc.dtype == torch.float32
    assert out.stride(-1) == 1 and grad_out.stride(-1) == 1
    block = 64
    launch(_delta_zero, (cdiv(p.s_q, block), p.b * p.h_q),
        out, grad_out, delta, dq_acc, out.stride(0), out.stride(1), out.stride(2), grad_out.stride(0),
        grad_out.stride(1), grad_out.stride(2), p.h_q, p.s_q, acc_rows(p.s_q), BLOCK=block, D=p.d, num_warps=4,
        **({"ZERO_PAD": True} if zero_pad else {}))


def launch_kernel(p, q, k, v, grad_out, lse, delta, dq_acc, dk, dv, *, stages=None, reverse=None, flat=None,
                  p16_ds=None, lag=None, dq_first=None, defer_dk=None, dq_atomic=None, heavy_first=None, rotate=None,
                  segments=None, fp8=None, fp8_t=None, kv_regs=None):
    """The fused kernel alone: dK, dV written, dQ / scale added into dq_acc (fp32 contiguous
    [b, h_q, acc_rows(s_q), d]; its rows >= s_q are scratch). fp8 ([Note] FP8): (scales, amax, P's type is e5m2,
    dS's type is e5m2); q, k, v, grad_out then hold the FP8 values in fp16, dk / dv are the gradients in their own
    type (any strides, unit last), and dq_acc receives the raw sums dS8 K8. fp8_t ([Note] FP8 MMAs): (Q^T, dO^T,
    K^T) as ``fp8_transposes`` makes them; q, k, v, grad_out are then the FP8 tensors themselves. A problem with
    dropout runs the DROPOUT switch ([Note] dropout) with its seed and offset."""
    band = p.band
    causal = band is not None
    stages = stages or STAGES[causal]
    flat = _dq_flat(p, flat, lag, dq_atomic, fp8 is not None)
    dq_first = _dq_first(flat, causal, dq_first)
    defer_dk = DEFER_DK[causal] if defer_dk is None else defer_dk
    assert dq_first or not defer_dk, "defer_dk needs dq_first (dK the last wgmma group in flight)"
    assert delta.is_contiguous() and delta.dtype == torch.float32
    assert dq_acc.is_contiguous() and dq_acc.dtype == torch.float32
    box, layout = _dq_box(flat, p.d)
    if flat == "frag":
        # [Note] dQ in fragment order: per head acc_rows / 2 rows of 256, each 64-row tile's two halves 16 rows each
        assert p.d == 128 and fp8 is None, "the frag dQ staging: d=128, 16-bit"
        dq_acc = dq_acc.view(p.b, p.h_q, acc_rows(p.s_q) // 2, FRAG_ROW.value)
        dq_desc = Tma(dq_acc, tuple(dq_acc.shape), dq_acc.stride(), (1, 1, FRAG_ROWS.value, box), layout)
    else:
        dq_acc = dq_acc.view(p.b, p.h_q, acc_rows(p.s_q), p.d)
        # the TMA reduce clips at s_q (LAG's reduce at row s_q before the first tile is dropped whole)
        dq_desc = Tma(dq_acc, (p.b, p.h_q, p.s_q, p.d), dq_acc.stride(), (1, 1, BLOCK_M, box), layout)
    grid = (cdiv(p.s_kv, BLOCK_N), p.b * p.h_kv)
    switch_kw = {}
    if fp8 is not None:
        scales, amax, p_e5m2, ds_e5m2 = fp8
        switch_kw = dict(SCALES=scales, AMAX=amax, DK_OUT=dk, stride_dkb=dk.stride(0), stride_dkh=dk.stride(1),
                         stride_dkm=dk.stride(2), DV_OUT=dv, stride_dvb=dv.stride(0), stride_dvh=dv.stride(1),
                         stride_dvm=dv.stride(2), FP8_EMU=True, P_E5M2=bool(p_e5m2), DS_E5M2=bool(ds_e5m2))
        dk, dv = k, v        # the descriptors' stand-ins: the FP8 epilogue stores from registers
        if fp8_t is not None:
            qt, dot, kt = fp8_t
            switch_kw.update(FP8_EMU=2, QT_DESC=_t_desc(qt, BLOCK_M), DOT_DESC=_t_desc(dot, BLOCK_M),
                             KT_DESC=_t_desc(kt, WG_N))
    if kv_regs is False:
        # passed only to turn it off (A/B), so the default launches keep their keys (the shipped stores')
        switch_kw["KV_REGS"] = False
    if p.has_dropout:
        # passed only with dropout, so the other launches keep their keys (the shipped stores'); the numbers go
        # over on each call (triton/launch.Launcher.runtime_names): a new seed per step reuses the cached launch
        seed, offset, threshold, rescale = dropout.kernel_args(p)
        switch_kw.update(DROP_SEED=seed, DROP_OFFSET=offset, DROP_THRESHOLD=threshold, DROP_RESCALE=rescale,
                         DROPOUT=True)
    # through launch.launch (a repeat signature skips the JIT; each descriptor encoded once per tensor), the FP8
    # switches' tensors and descriptors by keyword too (passed on each call, not kept: triton/launch.Launcher)
    launch(_attn_bwd_fused_sm90, grid,
        _tma(q, BLOCK_M), _tma(k, WG_N), _tma(v, WG_N), _tma(grad_out, BLOCK_M), _tma(dk, WG_N),
        _tma(dv, WG_N), dq_desc, dq_acc, lse, *lse.stride(), delta,
        p.h_kv, p.h_q, p.group, p.s_q, p.s_kv, p.scale * LOG2E, p.scale,
        _chunk(grid, q.device.index) if (HEAVY_FIRST[causal] if heavy_first is None else heavy_first) else 1,
        STAGES=stages, HAS_RIGHT=causal, BOTTOM_RIGHT=causal and band.alignment == "bottom_right",
        REVERSE=REVERSE[causal] if reverse is None else reverse, P16_DS=P16_DS if p16_ds is None else p16_ds,
        LAG=LAG[causal] if lag is None else lag, DQ_FIRST=dq_first, DEFER_DK=defer_dk,
        DQ_ATOMIC=DQ_ATOMIC[causal] if dq_atomic is None else dq_atomic,
        ROTATE=ROTATE[causal] if rotate is None else rotate, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS,
        # one head per group: the same order either way, and the per-head loop folds away (group 1 is a constant);
        # by default under a causal mask only (docstring, "Switches": Segments)
        SEGMENTS=bool(SEGMENTS and causal if segments is None else segments) and p.group > 1, num_warps=4,
        **switch_kw,
    )


def _dq_flat(p, flat, lag, dq_atomic, fp8=False):
    """The dQ staging a launch gets: ``flat`` where given, else ``DQ_FLAT``'s, with "frag" ([Note] dQ in fragment
    order) only where it applies (d=128, 16-bit, no LAG, no atomics; else the swizzled boxes)."""
    if flat is not None:
        return flat
    causal = p.band is not None
    flat = DQ_FLAT[causal]
    lag = LAG[causal] if lag is None else lag
    dq_atomic = DQ_ATOMIC[causal] if dq_atomic is None else dq_atomic
    if flat == "frag" and (p.d != 128 or fp8 or lag or dq_atomic):
        return False
    return flat


def _dq_first(flat, causal, dq_first=None):
    """Whether the dQ product goes before dK's: ``dq_first`` where given, else ``FRAG_DQ_FIRST``'s with the "frag"
    staging and ``DQ_FIRST``'s with the others."""
    if dq_first is not None:
        return dq_first
    return (FRAG_DQ_FIRST if flat == "frag" else DQ_FIRST)[causal]


def launch_convert(p, dq_acc, dq, frag=False):
    """dq = scale * dq_acc in dq's dtype (dq: any strides with unit last stride); frag: dq_acc in fragment order
    ([Note] dQ in fragment order)."""
    block = 64
    launch(_dq_convert, (cdiv(p.s_q, block), p.b * p.h_q),
        dq_acc, dq, dq.stride(0), dq.stride(1), dq.stride(2), p.h_q, p.s_q, acc_rows(p.s_q), p.scale, BLOCK=block,
        D=p.d, num_warps=4, **({"FRAG": True} if frag else {}))


# ----------------------------------------------------------------------------------------------
# the FP8 switch ([Note] FP8)

# [Note] FP8 MMAs: the FP8 switch with every product an FP8 wgmma, where dO has q's type (else fp16 MMAs on widened
# copies). Measured against the fp16 MMAs (H200, Triton 3.6.0, bench/fp8_bwd_gluon_ab.py, TFLOP/s): d=128 2k causal
# 313 -> 381, 8k 512 -> 641, 16k causal 532 -> 653 (bench/NOTES.md 72)
FP8_MMA = True


def supports_fp8_mma(q8, k8, v8, do8) -> bool:
    """Whether the FP8 MMAs take these tensors (``supports_fp8`` having taken the call): TMA's rules on q, k, v
    and dO as they are, and dO of q's type (V8 dO8^T and its transpose in one FP8 type each)."""
    return do8.dtype == q8.dtype and all(_tma_ready(t) for t in (q8, k8, v8, do8))

def supports_fp8(p, q8, k8, v8, o, do8, dq, dk, dv) -> bool:
    """True when the fused kernel's FP8 switch runs this ``fusedattn.fp8.sdpa_fp8_backward`` call: sm_90, the
    problem as :func:`supports` takes it (d = d_v in ``HEAD_DIMS``, no mask or causal, no lengths), q / k / v of
    one float8 type, dO float8, o any type ``_delta_zero`` loads, gradients with a unit last stride."""
    import dataclasses
    import fusedattn.fp8 as fp8
    p16 = dataclasses.replace(p, dtype=torch.float16)       # the kernel's 16-bit MMAs on the FP8 values
    if not (isinstance(q8, torch.Tensor) and q8.is_cuda and _is_sm90(q8.device.index) and _problem_ok(p16)):
        return False
    if p.has_dropout or not (fp8.is_fp8(q8) and k8.dtype == q8.dtype and v8.dtype == q8.dtype and fp8.is_fp8(do8)):
        return False
    return all(t.stride(-1) == 1 for t in (q8, k8, v8, o, do8, dq, dk, dv))


def _t_desc(t, cols):
    """The descriptor of a transposed FP8 copy [b, h, d, s_pad] (``fp8_transposes``): [d, cols] boxes."""
    d = t.shape[2]
    return Tma(t, t.shape, _geometry(t)[1], (1, 1, d, cols), _smem_layout(d, cols, t.dtype))


def fp8_transposes(q8, k8, do8):
    """The FP8 MMAs' transposed copies ([Note] FP8 MMAs), each [b, h, d, s rounded up to 16] with the rows
    innermost: Q^T and dO^T with their rows in ``fwd_sm90.key_order`` within each 16 (the B operands of
    dK += dS8^T Q8 and dV += P8^T dO8, whose register A operands come in that order), K^T in key order."""
    return transposed_v(q8), transposed_v(do8), transposed_v(k8, permute=False)


def launch_bwd_fused_fp8(p, q8, k8, v8, o, do8, lse, scales, amax, dq, dk, dv, *, mma8=None):
    """``fusedattn.fp8.sdpa_fp8_backward`` on the fused kernel ([Note] FP8), written in place.

    q8 [b,h_q,s_q,d], k8 / v8 [b,h_kv,s_kv,d]: one float8 type; do8 [b,h_q,s_q,d] float8 (e4m3 or e5m2); o the
    forward's output (float8 or any float); lse fp32 [b,h_q,s_q] view (natural log). scales: fp32 contiguous
    [12] on the device in ``triton.bwd.FP8_BWD_SCALE_NAMES``' order; amax: fp32 [4] (dQ, dK, dV, dP), zeroed
    by the caller. dq / dk / dv: the gradients in any of the FP8 door's types (any strides, unit last). mma8:
    the FP8 MMAs ([Note] FP8 MMAs; default ``FP8_MMA`` where ``supports_fp8_mma``), else fp16 MMAs on widened
    copies."""
    import dataclasses
    mma8 = (FP8_MMA and supports_fp8_mma(q8, k8, v8, do8)) if mma8 is None else mma8
    dq_acc = torch.empty((p.b, p.h_q, acc_rows(p.s_q), p.d), dtype=torch.float32, device=q8.device)
    delta = torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=q8.device)
    launch_delta_zero(p, o, do8, delta, dq_acc)      # rowsum(dO8 * o), the raw values: the kernel scales it
    fp8 = (scales, amax, q8.dtype == torch.float8_e5m2, do8.dtype == torch.float8_e5m2)
    if mma8:
        launch_kernel(p, q8, k8, v8, do8, lse, delta, dq_acc, dk, dv, fp8=fp8, fp8_t=fp8_transposes(q8, k8, do8))
    else:
        p = dataclasses.replace(p, dtype=torch.float16)
        # exact fp16 copies by one streaming kernel each (PyTorch's float8 copy is ~3x slower: widened_fp16)
        q, k, v, grad_out = (widened_fp16(t) for t in (q8, k8, v8, do8))
        launch_kernel(p, q, k, v, grad_out, lse, delta, dq_acc, dk, dv, fp8=fp8)
    block = 64
    launch(_dq_convert_fp8, (cdiv(p.s_q, block), p.b * p.h_q), dq_acc, dq, dq.stride(0), dq.stride(1),
           dq.stride(2), p.h_q, p.s_q, acc_rows(p.s_q), scales, amax, BLOCK=block, D=p.d, num_warps=4)
    return dq, dk, dv
