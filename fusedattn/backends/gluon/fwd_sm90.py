"""Attention forward for Hopper (sm_90) in Gluon: FlashAttention-3 style, warp specialized.

One program (CTA) owns query rows [start_m, start_m + 128) of one (batch, query head); its
key/value head is ``head // GROUP``. The CTA is split into three warp-specialized partitions
(``gl.warp_specialize``), which talk only through mbarriers, never through a CTA-wide barrier:

* producer (1 warp, few registers): issues every TMA load. Q arrives once, as two 64-row
  halves (one per consumer warpgroup); K and V tiles stream through a ring of STAGES
  shared-memory slots each. K and V have separate ready/empty barriers, so a K slot is handed
  back as soon as its QK^T is done, before the V of the same tile has been used.
* two consumer warpgroups (4 warps each, most of the registers): warpgroup ``WG`` owns the 64
  query rows [start_m + 64 * WG, +64). Each runs the whole online softmax for its rows on its
  own, so the two drift freely and the tensor cores are shared between them (one's softmax
  overlaps the other's MMAs) with no explicit scheduling.

Inside a consumer warpgroup (FlashAttention-3's intra-warpgroup pipelining), tile j's loop body:

    wait K_j ready;      S = Q K_j^T            (async wgmma, Q and K from shared memory)
    O *= alpha_{j-1}                            (onto tile j-1's running max, while QK^T runs)
    wait V_{j-1} ready;  O += P_{j-1} V_{j-1}   (async wgmma, P from registers)
    wait until one wgmma is in flight (S is done); release K_j
    softmax of S in registers  -> P_j, row max m, row sum l, rescale alpha_j
                                  (overlaps the PV wgmma still running)
    wait for PV; release V_{j-1}

so the exp2 work of tile j hides under the PV product of tile j-1. Scores stay in base 2 with
the scale folded in: p = exp2(s * (scale * log2 e) - m), one FMA per score on mask-free tiles.
P goes from the wgmma accumulator layout to the register A-operand layout without a shuffle
(the two layouts agree thread for thread for 16-bit P).

[Note] keeping the softmax under the PV wgmma. ptxas, not the program order, places the wgmma
waits: left alone it hoists the final wait above the exponentials (they have no data
dependence on it) and the softmax then runs after PV, serialized. The step stores the new row
sum l (which depends on every exponential of the tile) to a small shared-memory slot just
before that wait; ptxas (Triton 3.6's) keeps shared-memory stores and wgmma waits in order,
so all 64 exponentials per thread stay between the two waits (tools/gluon_check.py counts them in the
SASS: 66 MUFU.EX2 = 64 + 2 for alpha). Two things that looked natural and failed: keeping a PV
wgmma in flight across the loop back edge (ptxas then serializes every wgmma, warning C7514,
because the rescale reads its accumulator registers), and unrolling by two so that the two
P register sets alternate (spills, and ptxas still hoisted the wait in one warpgroup's copy).

Optional ping-pong (``PINGPONG``, FA3's inter-warpgroup scheduling): the two consumer
warpgroups take turns issuing their wgmmas through a pair of mbarriers, so one warpgroup's
softmax runs while the other's products occupy the tensor cores.

Masking (``_kv_range``): a CTA visits key tiles [t_lo, t_hi) of the band (causal, or a sliding
window: row i keeps key j iff j < s_kv and i + diag - left <= j <= i + diag + right, either
bound optional). Tile t_lo (the prologue), the band's left edge [t_lo + 1, t_a) and its right
edge and tail [t_b, t_hi) are masked; tiles in [t_a, t_b) are whole for every row of the CTA
and skip the mask arithmetic. Tiles outside the band are never loaded, so a window costs
O(s * window). ALiBi (slope * (j - i), slopes from a [h_q] tensor) adds the column half
slope * (j - row0) (row0: the warpgroup's first row): slope * c (c the column within a tile,
loop-invariant) through the tensor cores in bf16 ([Note] ALiBi by wgmma), in fp16 in the same FMA
that scales the scores, and slope * (n0 - row0) (one scalar per tile) in the row max; the row half
is constant per row, cancels in the softmax and is taken out of the LSE. TMA zero-fills rows past
the tensor (Q rows >= s_q, K/V rows >= s_kv) and clips the output store at s_q; LSE rows >= s_q
are masked out.

[Note] packed P. The loop is issue-bound at d128 (per tile and thread about as many instructions
as the tensor cores take cycles), so its instruction count is its speed. P crosses a step (made
in step j, multiplied in step j + 1): carried as 16-bit values, ptxas swapped the halves of each
packed pair twice (64 PRMT per thread and tile). ``_pack_p`` converts pairs with one
``cvt.rn.bf16x2.f32`` (``f16x2``) into int32 registers that the loop carries; ``_unpack_p`` views
them as the wgmma's A operand without instructions (SASS: 528 -> 464 per mask-free step,
bench/NOTES.md 39).
Triton 3.9 assembles sm_90 with CUDA 13's ptxas, which packs the new P while the PV wgmma still reads
the old one, so into other registers, and then moves them into the A operand's before the next PV wgmma
(21-26 IMAD.MOV per step; CUDA 12's ptxas, Triton 3.6-3.8, packs after the wait, in place). Carried as
fp32 and packed right before its PV wgmma (``P_F32``, 32 more registers across the step), the moves go:
496 -> 468 SASS per step at d128 on 3.9, the same loops on 3.6. It is on over pages on Triton 3.9+
(``PAGED_P_F32``), where Nsight Compute's elapsed cycles (H100, bench/NOTES.md 81; the prefill of
``bench --configs prefill``, 512 queries over 4096 keys, d128 causal) fell 6.9% at pages of 16, 4.2% at
64, 3.0-3.7% for packed varlen queries. Over a contiguous cache the same switch measured 2.2-2.4% faster
at 8k / 16k and 5% slower at 2k causal, 10% at d64 (spills under the causal mask, 16-56 bytes; d64: no
spills, the packing no longer under the PV wgmma). So it is on there only at d128 without a band (causal,
window), ALiBi or dropout (``DENSE_P_F32``): those builds take 28-30 fewer SASS instructions per step (496 ->
468 one-tile, 487 -> 466 persistent; padded and packed queries alike) and spill nothing: b2 h16 8k 1.020x
in elapsed cycles (H100, 3.9.0; the causal, d64 builds unchanged, within 0.2%).
Stats in shared memory. With P carried as fp32 the paged builds' registers are full (12 warps at launch,
240 a consumer thread), and 3.9's ptxas kept one step value in local memory, in one warpgroup or the
other: at pages of 16 a store and reload of the pin slot's address and a swapped value, 6 local accesses
per mask-free step (3 in the masked one) in the prefill's padded build, 4 (4) in the packed one. Over pages
on 3.9+ (``PAGED_STATS_SMEM``) the running max and sum cross a step in the pin slot, now [2 * 64]
(``_stats_store`` after the softmax, where the sum was stored anyway; ``_stats_load`` before the next
one), which frees their 4 registers: no local access in any step loop of the paged builds (pages of 16,
64, 256, padded and packed), +5 SASS instructions per step. Elapsed cycles (H100, 3.9.0, bench/NOTES.md
89): pages of 16 2.6% faster (0.930 -> 0.952 of the contiguous cache), packed queries over 16 2.0%
(0.918 -> 0.934), over 64 0.8%; pages of 64 0.2% slower (they had no spill in the mask-free loop).

[Note] ALiBi by wgmma. The loop is issue-bound, so ALiBi's one add per score (the column term
slope * c / scale) cost its forward 0.89 of the unmasked speed, the instruction ratio of the loops
(538 / 475 mask-free, 819 / 741 masked). The term is a rank-1 update of the score tile, so one more
k = 16 wgmma per tile adds it: A [64, 16] holds 1 in columns 0-2, B [BLOCK_N, 16] holds
slope * c / scale in three bf16 parts (hi, mid, lo: 24 bits, as exact as the fp32 product) in
columns 0-2 (``_alibi_fill``, per warpgroup, 6 KB of shared memory at BLOCK_N 128). The tensor
cores have room for 1/8 more QK^T work; the loops are 476 / 749 (SASS, tools/gluon_check.py). fp16
keeps the FMA: slope * c / scale may pass its 65504.

[Note] empty rows (causal bottom-right with s_q > s_kv: rows with no key): m = -inf and l = 0;
exponents use m_safe (0 where m is -inf), so no inf - inf arises; such rows write output 0 and
LSE -inf (the package's convention: the log of an empty sum, so split results merge with weight 0). A CTA whose rows see no key at all still runs one fully
masked tile, so every path is the same (unpadded kernel; the padded one skips it, below).

[Note] padding (per-batch lengths ``seq_len_q`` / ``seq_len_kv``; compile-time switches
HAS_SEQ_Q / HAS_SEQ_KV, so the unpadded kernel is unchanged). Semantics are the Triton
forward's: len_q / len_kv clamped to [0, s_q] / [0, s_kv]; row i of batch entry bi is valid iff
i < len_q[bi], key j visible iff j < len_kv[bi] and in the band, whose bottom-right diagonal is
len_kv - len_q of the sequence; rows past len_q and rows with no key write output 0 and LSE -inf.
* The band takes the lengths in place of s_q / s_kv (``_kv_range``), so a tile wholly past
  len_kv is never loaded. A CTA whose rows are all past len_q, or that sees no key (len_kv = 0,
  say), gets n_tiles = 0: the producer loads nothing, the consumers skip every wgmma and write
  zeros. Otherwise only the CTA's last tile can reach past len_kv.
* K/V rows in [len_kv, s_kv) are inside the tensor, so TMA loads them (it zero-fills only past
  s_kv), and they may hold anything, NaN included. In K they only reach scores that the mask
  replaces by -inf. In V they meet P = 0 in the PV wgmma, but 0 * NaN = NaN: each consumer
  warpgroup zeroes those rows of the last tile in shared memory before its last PV
  (``_zero_rows_from``: one register round trip of the tile, then fence_async_shared and a
  warpgroup barrier, since the wgmma reads through the async proxy). Both warpgroups zero the
  same slot, each before its own wgmma: neither could know when the other's stores had landed
  without a cross-warpgroup barrier, both store the same bytes (valid rows unchanged, the rest
  0), and the producer never refills that slot (it is the CTA's last tile). Cost (H100, bench/
  GLUON_NOTES.md): paid once per CTA, by the CTAs whose band reaches len_kv.
* Q rows in [len_q, s_q) are in the tensor too; a score row depends only on its own Q row, so
  whatever they hold stays in their own rows, which the epilogue replaces (output 0, LSE -inf).

[Note] packed queries (compile-time ``PACKED_Q``, with HAS_SEQ_Q; ``launch_fwd_sm90(cu_seqlens_q=)``):
the new tokens of b sequences packed into one tensor (FlashAttention's varlen layout, the serving
engines' chunked prefill), over a K/V cache with per-batch lengths, paged or not. Q and O are seen as
one view batch [1, h_q, total, d] and SEQ_Q holds cu_seqlens_q: sequence i's query row m is packed row
cu_seqlens_q[i] + m (``_packed_origin``), len_q = cu_seqlens_q[i + 1] - cu_seqlens_q[i] clamped to [0,
max_seqlen_q], and everything else is the padded kernel above (the grid is (cdiv(max_seqlen_q, 128),
b * h_q); tiles past len_q load and write nothing). Loads: Q's TMA box may run past the sequence into
the next one's rows (or past the tensor: zero-filled); those rows stay in their own score rows. Stores:
a TMA store would write the next sequence's rows too, so only a tile wholly inside its sequence goes
out by TMA; the tile holding the sequence's last row is stored from registers with a row mask
(``_store_rows``, once per sequence and warpgroup), and rows outside [0, total) never are. The LSE goes
to [1, h_q, total] at the packed rows. ``PACKED_KV`` (with HAS_SEQ_KV, not paged; ``cu_seqlens_kv=``) packs
the keys the same way (FlashAttention's varlen call, ``varlen.attention_varlen``): K / V views [1, h_kv,
total_k, d], sequence i's key j at row cu_seqlens_kv[i] + j; a key tile reaching past the sequence reads
the next one's keys (or zeros past the tensor), which the length masks as it masks padding (V's rows
zeroed, above). Offsets are trusted as given (validate=False callers): TMA never reads or writes outside
the tensors, but a sequence whose rows run past them computes with zeros there. Before this the packed call was gathered into a padded batch and
back (kvcache ``_run_packed_padded``): ~25 small PyTorch ops whose host time (0.5 ms on the H100's
host) made the call host-bound at about half the padded batch's speed (bench/NOTES.md 60).

[Note] persistent grid (compile-time ``PERSISTENT``; ``launch_fwd_sm90(persistent=...)``, defaults
in ``PERSISTENT``). The one-tile grid runs (cdiv(s_q, 128), b * h_q) CTAs, one per SM at a time
(shared memory), and each pays a bubble: launch, barrier init, the Q load and the first K/V load
before its first wgmma, and its output store with nothing under it. The persistent grid launches
min(#SMs, #tiles) CTAs that loop over work tiles (query tile, batch * head):
* Order (``_work_tile``): groups of HEAD_GROUP (batch, head) pairs, about one wave of tiles each
  (#SMs // query tiles per head), one group after the other; inside a group the query tile is the
  slow index (descending for a causal-like band: the longest rows first) and the head the fast one,
  so the CTAs that run together share a few heads' K/V in L2.
* Hand-out (``_next_tile``): each CTA starts on tile pid; the producer then takes tickets from a
  global counter (one relaxed atomic per tile; the launch's last ticket resets it to 0), so a CTA
  that drew short tiles takes more of them: greedy, longest first. A static hand-out (tile + nprog,
  ``DYNAMIC`` False) balances causal work badly (a model of b4 h32 s2k put its busiest CTA at 1.5x
  the mean; measured: bench/GLUON_NOTES.md).
* The producer posts each tile's number in a small shared-memory slot next to its Q slot before
  arriving on that slot's ready barrier; the consumers read it after the wait (an mbarrier arrive
  releases the thread's earlier shared-memory stores) and work out the same tile geometry. In padded
  builds (per-batch lengths, packed queries) the slot also holds what the producer loaded for its own
  copies: the sequence's query and key lengths and its first packed row (``_post_tile``), so the
  consumers and the V warp read no global memory per tile (each read was an L2 round trip on their
  path at a tile's start and again at its output: Triton 3.9, packed queries over pages of 16, ~1.8%
  of the stall samples; bench/NOTES.md 84). A number >= #tiles ends them. Tiles with nothing to load
  (padding) still get a Q slot, arrived on without data, so the consumers write their zeros in order.
* The K/V ring's count goes on across work tiles (slot and phase of ring position r: r % STAGES,
  (r // STAGES) & 1), so the next tile's first K/V tiles load while the consumers finish the
  current one. Q has its own ring per consumer warpgroup (``QSTAGES``; ready per warpgroup, empty
  with one arrival from each): at d <= 128 two slots, so tile i+1's Q loads under tile i; each
  slot also stages its tile's output for the TMA store, and goes back to the producer once that
  store has read it (tma.store_wait), during the next tile, after its first QK^T. At d = 256 two
  slots do not fit (256 KB): one slot, handed back right after the output store has read it.
* Every work tile runs the same instructions as on the one-tile grid, so outputs are bit-identical
  (tests/test_gluon_fwd.py checks it on every persistent case).
Register pressure: consumer warpgroup 0 runs in the default partition, which inherits every
shared-memory view as a live value; values kept across the tile loop made ptxas spill there. The
inner loops therefore run over the ring's own count (no extra register for the ring offset: the key
offset is shifted instead, ``_fwd_attend``), and the epilogue re-derives its coordinates from the
tile number in shared memory. ``python tools/gluon_check.py spills``: the plain and causal kernels
(d 64/128/256, either alignment, with or without LSE or ping-pong) and the padded d64/d128 ones
have no spills; the windowed ones spill (at d128 the shared-memory base is reloaded once per
iteration in two loops), padded d256 spills, and ALiBi without a mask spills heavily (728 bytes at
d128), so the defaults leave those on the one-tile grid (whose 90 variants there have none).
Outcome, prediction -> measured (H100, bf16, bench/gluon_sweep.py --persistent, two runs; in the
second, a variant's three rounds spread by up to 9%, and by 19% / 23% on the 8k no-mask / 16k
causal configs; bench/GLUON_NOTES.md):
b4 h32 s2k d128 causal, whose ~1.5 us bubble per ~19 us CTA predicted +8%: +1.5% and +3.5% (472 ->
479, 445 -> 461 TFLOP/s); what stays is each tile's pipeline fill and drain (its first QK^T and
softmax with nothing under them, its last PV alone), which a persistent grid does not remove.
Window (1024, 0) b2 h16 s8k: +4% and +9% (442 -> 459, 418 -> 454). Short, cheap tiles gain most:
d64 b8 h12 s1k +19..21% (causal 184 -> 221, no mask 302 -> 366), d256 causal s4k +8..9%. Long rows
(16k causal, GQA 4k causal) moved -4..+3%, within the spread. Among hand-outs, the static one lost
25..33% under causal (2k 472 -> 352, d256 619 -> 413) and strictly longest-first across all heads
(one head group) lost 33% at 2k (L2: every wave then reads 132 heads' K/V); head groups of 4 or 16
were not better than the default beyond the spread.

[Note] dropout (compile-time ``DROPOUT``): after a tile's softmax the dropped probabilities are
zeroed (``_drop``: the keep-mask of ``dropout.py``, the same one the Triton kernels and the CPU
path make, built by the threads that hold the scores from one Philox call per 2 x 4 group); l sums
them all, and the epilogue scales O by 1 / (1 - p). The Philox words cost more issue slots than the
tile's two matmuls, so the dropout forward is integer-issue-bound (bench/NOTES.md 48).

[Note] sinks (compile-time ``HAS_SINK``): a per-head sink logit is one more softmax term with no
value row, so it enters once, in the epilogue (``_fwd_write``), as in the Triton kernel
(``triton/common.fold_sink``): the row max and sum take it, O is only rescaled, the stats include
it. A row with no key still writes output 0, with lse = sink. The loop is untouched, so a sink costs
one rescale of O per work tile; the backward needs no switch (P = exp(s - lse) with that lse).

[Note] paged K/V (compile-time ``PAGE``, the page size in keys; 0: contiguous). K and V are containers
[blocks, h_kv, PAGE, d] read through int32 page tables [b, pages] (chunked prefill against a serving
cache, ``attention_with_kvcache``). Only the load warp changes (``_kv_ring_loads_paged_at``): a key
tile of BLOCK_N keys is BLOCK_N / BOX TMA copies of BOX = min(PAGE, BLOCK_N) rows, each from the page
the table names into its row slice of the ring slot, all on the slot's one ready barrier; with pages
larger than a tile, one copy from inside the page. The consumers see the same tiles as on a
contiguous cache, so results are bit-identical to it. Page sizes: powers of two of at least 8 keys (a
box never crosses a page; slices keep the swizzle's 8-row atom whole); others take the portable kernel.
Pages smaller than a tile: a scalar table read in front of each copy serialized 16 load latencies per
128-key tile at page 16 (0.92x of contiguous, bench/NOTES.md 54), so the table entries of a tile, K's
and V's, come in one load a tile ahead, one entry per lane of the load warp (``_page_entries``), and
each copy takes its page from its lane with one warp reduction into the uniform registers the TMA
copy reads (``_paged_tile_gather``: one copy per page and 64-column block, in a loop over pages).
That left 0.91-0.93x at pages of 16 (bench/paged_tiles.py): K of tile j + 1 queued behind V of tile j's
16 copies, though the consumers need it first (QK^T of tile j + 1 comes before PV of tile j). So the load
warp's step j copies K of tile j, then V of tile j - 1 (the consumers' order), with one entries load
per step holding K's entries of one tile and V's of the one before. That left 0.947-0.953 (bench/NOTES.md 62;
in order, the same bytes at the contiguous cache's addresses, 0.908: the copies' number, one warp issuing
32 per step). Split load (``V_WARP``, the persistent grid, the default ``PAGED_V_WARP``): a second load warp
(``_fwd_v_loader_persistent``, in the producer's warpgroup, its register cap) copies V while the first copies
Q and K, each issuing half the copies; the V warp learns each work tile from the number the producer posts in
its Q slot, as a consumer does (bench/NOTES.md 63).

[Note] FP8 (q / K / V of one float8 type: the switch is the descriptors' element type, so the 16-bit
kernel is unchanged; ``launch_fwd_sm90_fp8``; semantics: cuDNN's ``sdpa_fp8``, ``fusedattn.fp8``, at the
portable kernel's rounding points, triton/fwd.py [Note] FP8). S = Q8 K8^T and O += P8 V8 are e4m3 (or
e5m2) wgmmas (SASS QGMMA ... E4M3.E4M3); the scores' scale is attn_scale * log2 e * descale_q * descale_k;
p = exp2(S - m) <= 1 in fp32, P8 = fp8(p * scale_s) with ``cvt.rn.satfinite`` (nearest even, saturating, as
``fp8.quantize``), where the kernel computes p * scale_s as one exponential, exp2(S - (m - log2 scale_s)), and
l sums it (divided by scale_s after the last tile: one multiply per score fewer, 64 of a step's 516 SASS
instructions per thread at d=128); the epilogue's O = acc / l * descale_s * descale_v, amax_s = max 1 / l
and amax_o = max |O| over rows inside the sequence (float atomic max), o = O * scale_o in the output's
type, stored from registers (``_fp8_write``: any output type, so no TMA staging tile).
* Per-head descales (``FP8_HEAD_SCALES``, fusedattn's addition, as the portable kernel's): descale_q per query
  head, descale_k / descale_v per kv head, read per work tile (``_head_descales``: the persistent grid's tiles
  change heads); descale_v multiplies the accumulator before the epilogue, whose per-tensor places hold 1.
* V: FP8 wgmmas read both shared-memory operands K-major, and P V's K is the key, so V comes transposed
  ([b, h_kv, d, s_kv], keys innermost: ``transposed_v``, one copy per call) in [HEAD_D, BLOCK_N] tiles,
  handed to the wgmma permuted.
* The key order: the A operand of an 8-bit wgmma holds 4 consecutive K columns per register, where the
  accumulator holds column pairs 8 apart, so a thread's own P values would need a shuffle within its quad
  to become the operand. Instead the copy of V permutes keys within each 16 (``key_order``: operand column
  16 g + 4 q + t is key 16 g + 8 (t // 2) + 2 q + t % 2) and each register is built from the thread's own
  values (``_pack_p8``: two cvt per 4 values; the loop carries them as int32, ``_unpack_p8`` is free in
  SASS). Padding zeroes V's columns by that order (``_zero_cols_from``). Before: 24 SHFL and ~230 byte
  moves per tile (758 SASS instructions per 128-key step at d=128; now 510).
* The accumulation ([Note] FP8 of triton/fwd.py, ``fusedattn.fp8.MMA_UNIT_FP8``): Hopper's FP8 MMA adds a
  K-step's 32 products (and the accumulator) aligned to the largest with about 14 bits. The portable
  kernel moves every step into fp32 (``max_num_imprecise_acc=32``); in Gluon that expands into one waited
  wgmma per K-step, which serializes the loop and spills (``PROMOTE=32``, kept for comparison). The
  default (``FP8_PROMOTE = 0``) puts each key tile's P V into a fresh accumulator and adds it to O in fp32
  (O = O * alpha + T: the rescale's multiply becomes that FMA), so P V's unpromoted chains are BLOCK_N / 32
  K-steps and QK^T's d / 32: the bound's u_mma per product grows by that chain length (at most 4 here;
  ``fusedattn.fp8.mma_unit(device, chain=...)``). The per-tile accumulator is another [64, d] fp32 tile
  of registers, which d = 224 / 256 do not have (``FP8_DIMS``).
* Triton 3.6's wgmma wait cannot carry 8-bit values, so P8 is not among the PV wait's dependencies
  (``_pv_wait``); tools/gluon_check.py checks that no instruction writes P8's registers while the wgmma
  that reads them is in flight.
* No ALiBi, dropout, sinks or pages with FP8 (``supports_fp8``); the persistent grid is on at d=64 only
  (``FP8_PERSISTENT``, measured). V's transposed copy is one small Triton kernel per call
  (``transposed_v``).

[Note] FP8 on 16-bit MMAs (``FP8_EMU``; ``launch_fwd_sm90_fp8_16``, head dims ``FP8_16_DIMS`` = 224 / 256):
there the FP8 switch's per-tile accumulator does not fit beside the [64, 256] fp32 O, and the portable kernel
ran the FP8 forward at half our own bf16 speed (bench/NOTES.md 70). So the 16-bit kernel runs it unchanged
in form (its tiles, layouts, persistent choice) on q, k, v widened to fp16 once per call (every e4m3 / e5m2
value is exact in fp16, and a 16-bit wgmma sums exact products in fp32: no promotion question), with the FP8
switch's semantics turned on by the constexpr FP8_EMU (1: P8 in e4m3, 2: in e5m2): the descales in the
score scale, p * scale_s as one exponential, P8 = fp8(p * scale_s) rounded and widened back to fp16 in the
registers the PV wgmma reads (``_pack_p8_16``: one more cvt per pair than the 16-bit pack), l / scale_s
after the last tile and the FP8 epilogue (``_fp8_write``). FP8_EMU = 0 leaves the 16-bit kernel as it was
(``_fp8_semantics``). Measured (H100, 3.6.0): d256 causal 517, d224 486 TFLOP/s, 0.72-0.80x the bf16 forward;
the three widening copies are ~20% of the call (``widened_fp16``; PyTorch's own copy had made it 332).
* FP8 QK^T (``FP8_16_QK``, on where TMA takes q and k as they are): q and K stay FP8 (descriptors of their
  type, QK^T an FP8 wgmma that reads both K-major as they are, its sums as the FP8 switch's: ``FP8_PROMOTE``,
  chain d / 32), V alone is widened; the P V side (V's ring, P's registers, its promotion) is keyed on V's type, the rest on
  q's. Static (3.6.0, d256): 8 QGMMA + 4 HGMMA per step, loops 387-523 SASS instructions against 418-568
  with every product fp16, no spills in the loops. Measured (H200, 3.6.0): d256 causal 543 -> 685, d224
  501 -> 636 TFLOP/s (1.26-1.27x).

Head dims: d = d_v in {64, 128, 224, 256}. d=256 uses BLOCK_N=64 (K/V tiles of 32 KB each, two
stages) and the [64, 256] fp32 O accumulator takes 128 of the 240 registers of a consumer thread;
d=224 runs the d=256 kernel on 256-wide boxes (TMA zero-fills columns 224..255 on loads and
clips them on the output store; ``TILE_D``).

Tensors are logical [b, h, s, d] with any strides whose last is 1 (TMA: 16-byte aligned base
and strides): each is seen through one 4-D TMA descriptor with box [1, 1, rows, TILE_D[d]], so
batch/head/sequence strides are the tensor's own and out-of-bounds rows are per (b, h).
"""
import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...plan import interpreting
from ..compat import TRITON_VERSION, cta_barrier, smem_reinterpret, tma_load, tma_store
from ..triton.launch import _current_raw_stream, cdiv, pow2
from . import dropout
from .launch import Tma, launch

LOG2E = 1.4426950408889634
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
LOG2E_C: gl.constexpr = gl.constexpr(LOG2E)

WG_M = 64          # query rows per consumer warpgroup (one wgmma M)
BLOCK_M = 2 * WG_M  # query rows per CTA (two consumer warpgroups)

# head dim -> width of the shared-memory tiles (HEAD_D inside the kernel). d=224 runs on 256-wide
# tiles: TMA zero-fills columns 224..255 of Q, K and V on loads (bounds are per dimension, so a
# row never reads the next head's data) and clips them on the output store; the zero columns add
# nothing to Q K^T and give output columns that are never written. The compiled kernel is the
# d=256 one; only the host descriptors differ.
TILE_D = {64: 64, 128: 128, 224: 256, 256: 256}
# (tile width) -> (BLOCK_N, STAGES). Shared memory: Q 2*64*D*2 bytes + STAGES * 2 (K and V) * BLOCK_N*D*2.
# d=128: 32 KB + 2 * 64 KB = 160 KB (3 stages would need 224 KB, the limit is 227 KB with no room
# left for the compiler's own scratch). d=64: 16 KB + 3 * 32 KB = 112 KB. d=256: 64 KB + 2 * 64 KB
# (BLOCK_N=64) = 192 KB; per consumer thread O [64, 256] fp32 is 128 registers, S [64, 64] 32 and
# P 16 (ptxas: no spills under CONSUMER_REGS=240, bench/GLUON_NOTES.md).
TILES = {64: (128, 3), 128: (128, 2), 256: (64, 2)}
# (tile width) -> consumer warpgroups take turns issuing wgmmas (see _fwd_step). Off: on the H100 it moved
# the d128 configs of bench/gluon_sweep.py by -4%..+4% (within the run-to-run spread), d64
# inconsistently, d256 -7% causal / +2% not (bench/GLUON_NOTES.md).
PINGPONG = {64: False, 128: False, 256: False}
# head dims that ``supports`` accepts by default (callers may pass head_dims to narrow or widen,
# within TILE_D). d=224/256: H100, bench/gluon_sweep.py, 1.33-1.41x our Triton forward
# (bench/GLUON_NOTES.md); which dims are routed here is plan.py's choice (_GLUON_FWD_DIMS).
SUPPORTED_DIMS = (64, 128, 224, 256)
# (mask kind, tile width) -> launch_fwd_sm90 takes the persistent grid (module docstring, [Note]
# persistent grid); mask kinds: "none", "causal" (either alignment), "window" (any other band),
# "padded" (per-batch lengths with no mask or causal); with ALiBi only at tile width 128
# (``_persistent_default``). From the H100 (bench/gluon_sweep.py --persistent, two runs, TFLOP/s
# one-tile grid -> persistent): d64 +19..21% (no mask and causal); d256 causal +8..9%; d128 no mask
# -2..+7% at 2k and +4% at 8k, causal 2k +1.5..3.5% (16k and GQA 4k: -4..+3%, within the runs'
# spread), padded +1..7%. Session 8 (bench/fwd_ab.py, packed P): d128 window (1024, 0) 433 -> 468,
# ALiBi causal 2k 402 -> 445; their persistent kernels no longer spill (window) or spill 4-20 bytes
# (ALiBi; 728 before the loop-invariant column term), tools/gluon_check.py spills. Off: d256 no mask
# (-2.4 / +4%: no gain shown), d256 windows / padding (they spill), d64 windows and padding (not
# measured).
PERSISTENT = {(kind, td): False for kind in ("none", "causal", "window", "padded") for td in (64, 128, 256)}
PERSISTENT.update({("none", 64): True, ("causal", 64): True, ("none", 128): True, ("causal", 128): True,
                   ("window", 128): True, ("causal", 256): True, ("padded", 128): True})
# (tile width) -> Q slots per consumer warpgroup on the persistent grid. Two let the next work
# tile's Q load under the current one (Q 2 x 2 x 64 x D x 2 bytes: 64 KB at d=128, with the K/V
# ring 192 KB); at 256-wide tiles two would need 256 KB, so the next Q waits for the last output.
QSTAGES = {64: 2, 128: 2, 256: 1}
CONSUMER_REGS = 240   # per thread, each consumer warpgroup (setmaxnreg)
# FP8 ([Note] FP8): the wgmmas' partial sums move to the fp32 accumulator after every K-step of 32
# (``max_num_imprecise_acc``), as the portable kernel's (``triton/common.FP8_PROMOTE_K``): the error bound's
# ``u_mma`` (``fusedattn.fp8.MMA_UNIT_FP8``) assumes it
FP8_PROMOTE_K = 32
PRODUCER_REGS = 24    # the load warp
# pages smaller than a key tile on the persistent grid: a second load warp copies V ([Note] paged K/V); up to
# Triton 3.8: on 3.9 one load warp read +2.4..+3.7% at pages of 16 and +3.2..+3.4% at 64 (two A/B rounds in
# one process, H100; bench/NOTES.md 64), while on 3.6 the second warp gains 1-3% there
PAGED_V_WARP = TRITON_VERSION < (3, 9)
# the load warp's order over a contiguous cache (``_kv_ring_loads_at``'s K_AHEAD: K of tile j before V of tile
# j - 1, the consumers' order, as over pages) for head dims above this one. Nsight Compute's elapsed cycles, H100
# (bench/fwd_ab.py, run_device.sh ncu-fwd-ab; bench/NOTES.md 80), K ahead / K and V together, Triton 3.6.0 | 3.9.0:
# d224 (b32 h32 2k) 1.084 | 1.121 and d256 (b4 h16 4k causal) 1.056 | 1.039 faster; at d128 mixed: 2k causal 1.033 |
# 1.028 faster, 8k 0.997 | 0.994, 16k causal 0.993 | 1.001, GQA 4k causal 0.982 | 0.998; d64 1.001 | 0.999
K_AHEAD_ABOVE_D = gl.constexpr(128)
# over pages, Triton 3.9+: P crosses a step as fp32, packed at the next step's PV ([Note] packed P, its last paragraph)
PAGED_P_F32 = gl.constexpr(TRITON_VERSION >= (3, 9))
# ... and over a contiguous cache at d128 without a band, ALiBi or dropout (the same note: no spills there)
DENSE_P_F32 = gl.constexpr(TRITON_VERSION >= (3, 9))
# over pages, Triton 3.9+: the running max and sum cross a step in shared memory ([Note] packed P, stats in shared
# memory), which frees the registers whose lack put a step value in local memory (bench/NOTES.md 89)
PAGED_STATS_SMEM = gl.constexpr(TRITON_VERSION >= (3, 9))


@gluon.jit
def _kv_end(start_m, S_Q, S_KV, diag, win_right, HAS_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr):
    """One past the last key that any row of [start_m, min(start_m + BLOCK_M, S_Q)) sees
    (``_kv_range``'s band; may be <= 0)."""
    hi = S_KV
    if HAS_RIGHT:
        # keys [.., last_row + diag + win_right] are visible to the last (widest-reaching) row
        last_row = gl.minimum(start_m + BLOCK_M, S_Q) - 1
        hi = gl.minimum(last_row + diag + win_right + 1, S_KV)
    return hi


@gluon.jit
def _kv_range(start_m, S_Q, S_KV, diag, win_left, win_right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key tiles of a CTA under a band (causal, sliding window): (t_lo, t_a, t_b, t_hi).

    Row i keeps key j iff j < S_KV, j >= i + diag - win_left (HAS_LEFT) and j <= i + diag +
    win_right (HAS_RIGHT). The CTA visits tiles [t_lo, t_hi): tile t_lo first (the prologue,
    masked), then [t_lo + 1, t_a) masked (the band's left edge), [t_a, t_b) mask-free and
    [t_b, t_hi) masked (the right edge and the tail past S_KV). At least one tile is visited
    (a fully masked one when no row sees a key). With no left bound t_lo = 0 and t_a = 1 (the dQ
    pass uses it that way: bwd_dq_sm90).
    """
    last_row = gl.minimum(start_m + BLOCK_M, S_Q) - 1
    hi = _kv_end(start_m, S_Q, S_KV, diag, win_right, HAS_RIGHT, BLOCK_M)
    full_hi = S_KV // BLOCK_N
    if HAS_RIGHT:
        # a whole tile is mask-free up to what the first row sees
        full_hi = gl.minimum(full_hi, gl.maximum(start_m + diag + win_right + 1, 0) // BLOCK_N)
    t_lo = 0
    full_lo = 0
    if HAS_LEFT:
        # the first row reaches furthest left; a tile is mask-free from where the last row starts
        t_lo = gl.maximum(start_m + diag - win_left, 0) // BLOCK_N
        full_lo = (gl.maximum(last_row + diag - win_left, 0) + BLOCK_N - 1) // BLOCK_N
    t_hi = gl.maximum((gl.maximum(hi, 0) + BLOCK_N - 1) // BLOCK_N, t_lo + 1)
    t_a = gl.minimum(gl.maximum(full_lo, t_lo + 1), t_hi)
    t_b = gl.minimum(gl.maximum(full_hi, t_a), t_hi)
    return t_lo, t_a, t_b, t_hi


@gluon.jit
def _cta_tiles(start_m, len_q, len_kv, diag, win_left, win_right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
               PADDED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """``_kv_range`` on the sequence's own lengths, plus the number of tiles the CTA loads:
    (t_lo, t_a, t_b, t_hi, n_tiles) (forward, dQ pass).

    PADDED: n_tiles = 0 when every row is padding or no row sees a key (len_kv = 0, say): nothing
    is loaded (a tile wholly past len_kv never is) and the consumers write zeros. Otherwise tile
    t_hi - 1 starts below the band's end (<= len_kv), so it is the only tile that can reach past
    len_kv (the consumers zero its rows there in shared memory: ``_zero_rows_from``)."""
    t_lo, t_a, t_b, t_hi = _kv_range(start_m, len_q, len_kv, diag, win_left, win_right, HAS_LEFT, HAS_RIGHT,
                                     BLOCK_M, BLOCK_N)
    n_tiles = t_hi - t_lo
    if PADDED:
        hi = _kv_end(start_m, len_q, len_kv, diag, win_right, HAS_RIGHT, BLOCK_M)
        n_tiles = gl.where((start_m < len_q) & (hi > t_lo * BLOCK_N), n_tiles, 0)
    return t_lo, t_a, t_b, t_hi, n_tiles


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, q_smem0, q_smem1, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
                  v_empty, batch, head, kv_head, start_m, t_lo, n_tiles, pages,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PADDED: gl.constexpr, PAGE: gl.constexpr,
                  q_batch=0, q_off=0, kv_batch=0, k_off=0):
    """Load warp: Q once, then K and V of key tile t_lo + j (j < n_tiles) into slot j % STAGES
    once the consumers freed it. Padded: a CTA with n_tiles = 0 computes nothing and loads nothing.
    PAGE > 0: K/V come from pages of PAGE keys (``_kv_ring_loads_paged_at``; pages: its tables). Q's rows
    are read at [q_batch, head, q_off + start_m], K / V's at [kv_batch, kv_head, k_off + key] (``_packed_origin``)."""
    WG_M: gl.constexpr = q_desc.block_type.shape[2]
    K_AHEAD: gl.constexpr = k_desc.block_type.shape[3] > K_AHEAD_ABOVE_D
    load_q = True
    if PADDED:
        load_q = n_tiles > 0
    if load_q:
        # coordinates are [batch, head, row, column] of the 4-D views
        mbarrier.expect(q_bar.index(0), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_batch, head, q_off + start_m, 0], q_bar.index(0), q_smem0)
        mbarrier.expect(q_bar.index(1), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_batch, head, q_off + start_m + WG_M, 0], q_bar.index(1), q_smem1)
    if PAGE > 0:
        _kv_ring_loads_paged_at(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, batch, kv_head,
                                t_lo, n_tiles, 0, pages, PAGE, BLOCK_N, STAGES)
    else:
        _kv_ring_loads_at(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, kv_batch, kv_head, t_lo,
                          n_tiles, 0, BLOCK_N, STAGES, k_off, K_AHEAD)


@gluon.jit
def _kv_ring_loads(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, batch, kv_head, t_lo, n_tiles,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producers' K/V stream of one work tile (forward, dQ pass): ``_kv_ring_loads_at`` from ring
    slot 0."""
    _kv_ring_loads_at(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, batch, kv_head, t_lo,
                      n_tiles, 0, BLOCK_N, STAGES)


# Which bits of a score tile's column index come from the thread: wgmma's accumulator fragment gives thread t the
# columns 2 * (t % 4) + {0, 1} + 8 * i (PTX ISA, "Matrix fragments for wgmma .m64nNk16"), so bits 1-2 are the
# thread's and the others the register's (``_band_keep``'s THREAD_BITS).
MMA_COL_THREAD_BITS = gl.constexpr(6)


@gluon.jit
def _band_keep(rows, cols, S_KV, diag, win_left, win_right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
               THREAD_BITS: gl.constexpr = 0):
    """Which (row i, key j) pairs of a score tile a band keeps (forward, dQ pass): j < S_KV and
    (HAS_LEFT) j >= i + diag - win_left and (HAS_RIGHT) j <= i + diag + win_right. rows: [M, 1],
    cols: [1, N] (the band's offsets go on the row side, the one with few values per thread).

    THREAD_BITS (nonzero only where cols is a ``gl.arange`` from 0 of a power-of-two length in a distributed
    layout): the bits of a column index that the thread contributes (``MMA_COL_THREAD_BITS`` in the wgmma
    accumulator's layout). Each compare is then made as j_reg OP bound - j_thread, with j_reg = j & ~THREAD_BITS,
    which the compiler folds to an immediate per register, and j_thread one value per thread: no column index is
    held in a register. Otherwise LLVM hoists the 32 column indices of a thread out of the persistent grid's tile
    loop and ptxas, short of registers beside the step loop, spilled them and reloaded them at every masked step
    (Triton 3.9, padded builds over a paged cache: 224-256 bytes of stack, ~100 local loads per work tile,
    bench/NOTES.md 85). Any THREAD_BITS gives the same answer (j_reg + j_thread = j); the layout's own bits give
    the immediates. Not for the length mask alone: there LLVM holds no index either when S_KV is known to be a
    multiple of 16 (the JIT's divisibility), and compares each 16-column group once (8 compares a thread, not 32)."""
    if (THREAD_BITS != 0) & (HAS_LEFT or HAS_RIGHT):
        # the same compares as below, the thread's part of each column moved to the bounds' side
        c_thread = cols & THREAD_BITS
        c_reg = cols & (cols.shape[1] - 1 - THREAD_BITS)
        if HAS_LEFT:
            hi = S_KV - 1
            if HAS_RIGHT:
                hi = gl.minimum(rows + (diag + win_right), S_KV - 1)
            keep = (c_reg <= hi - c_thread) & (c_reg >= rows + (diag - win_left) - c_thread)
        else:
            keep = c_reg < S_KV - c_thread
            keep = keep & (c_reg <= rows + (diag + win_right) - c_thread)
    elif HAS_LEFT:
        # a window: S_KV folds into the right bound (one value per row), so a score costs two
        # compares and one select (it was three and two: SASS 862 -> 753 per masked tile)
        hi = S_KV - 1
        if HAS_RIGHT:
            hi = gl.minimum(rows + (diag + win_right), S_KV - 1)
        keep = (cols <= hi) & (cols >= rows + (diag - win_left))
    else:
        # no left bound: kept as two compares. Folded into one, ptxas computes the 64 compares
        # ahead of the scores' wgmma wait and parks the predicates in registers (LOP3): 732 -> 824
        keep = cols < S_KV
        if HAS_RIGHT:
            keep = keep & (cols <= rows + (diag + win_right))
    return keep


@gluon.jit
def _index_below(idx, bound, THREAD_BITS: gl.constexpr):
    """idx < bound for an index vector ``idx`` (a ``gl.arange`` from 0 of a power-of-two length in a distributed
    layout) whose thread-given bits are THREAD_BITS, compared as ``_band_keep`` compares: each register's part
    of the index an immediate, the thread's part taken off the bound, so that no index is held in a register
    across the persistent grid's tile loop."""
    return (idx & (idx.shape[0] - 1 - THREAD_BITS)) < bound - (idx & THREAD_BITS)


@gluon.jit
def _p_base(m, p_shift, SCALED_P: gl.constexpr):
    """The per-row base of p's exponent: m, or m - log2(scale_s) where p comes out scaled (FP8)."""
    if SCALED_P:
        m = m - p_shift
    return m


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, rows, n0, S_KV, diag, win_left, win_right, alibi_col, slope2, row0,
                  MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr,
                  COL_IN_S: gl.constexpr = False, SCALED_P: gl.constexpr = False, p_shift=0.0):
    """Online-softmax update for one score tile s (raw q.k, fp32, wgmma accumulator layout).

    Returns (p, m_new, l_new, alpha): p = exp2(t - m_new) (0 where masked) with t the base-2
    logit, and alpha = exp2(m_old - m_new), the factor that moves O and l onto the new running
    max. ALiBi: t = s * qk_scale + alibi_col[c] + alibi_shift for the tile's column c, i.e. the
    column half of slope * (j - i) measured from the warpgroup's first row (the row half is
    constant per row, so it cancels in the softmax; the consumer takes it out of the LSE at the
    end), split into a loop-invariant vector (slope * c, ``_alibi_cols``) and the tile's scalar
    (slope * (n0 - row0)); the scalar joins the per-row max instead of every score. The scalar is
    computed here, next to its uses, and the logit is an explicit FMA: the compiler fuses a product
    into an add (an FMA) only within one basic block, so a product computed across a branch (the
    persistent grid's prologue has one) would round differently on the two grids, whose outputs
    must agree bit for bit.
    Instruction counts per thread and [64, 128] tile (tools/gluon_check.py): one FMA per score
    for the exponent where the logit is a scaled score, one add more with ALiBi.
    COL_IN_S: the scores hold the loop-invariant column term already (``_alibi_by_mma``): the
    logit is s * qk_scale again, one FMA per score as without ALiBi.
    SCALED_P (FP8, [Note] FP8): p comes out scaled by 2^p_shift = scale_s (p_shift joins the per-row base
    of the exponent; l then sums the scaled p), so P8 = fp8(p) needs no multiply per score.
    """
    BLOCK_N: gl.constexpr = s.shape[1]
    alibi_shift = 0.0
    if HAS_ALIBI:
        alibi_shift = slope2 * (n0 - row0).to(gl.float32)
    if MASKED:
        # the tile's columns from 0 and the band moved by -n0: the column indices are the layout's alone, each
        # compared as an immediate (``_band_keep``'s THREAD_BITS). Triton 3.6.0, causal d128: 899 -> 703
        # instructions per masked step, the 2k causal forward +2.1%, padded +3.9% (H100, bench/NOTES.md 87)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        keep = _band_keep(rows[:, None] - n0, cols[None, :], S_KV - n0, diag, win_left, win_right, HAS_LEFT,
                          HAS_RIGHT, MMA_COL_THREAD_BITS)
        if COL_IN_S:
            s = gl.where(keep, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale + alibi_shift)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * qk_scale - _p_base(m_safe - alibi_shift, p_shift, SCALED_P)[:, None])
        elif HAS_ALIBI:
            t = gl.where(keep, gl.fma(s, qk_scale, alibi_col[None, :]), float("-inf"))
            m_new = gl.maximum(m_i, gl.max(t, 1) + alibi_shift)
            # a row with no key yet keeps m = -inf; exponents then use 0 so no inf - inf arises
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(t - _p_base(m_safe - alibi_shift, p_shift, SCALED_P)[:, None])
        else:
            # masked raw scores: -inf * qk_scale stays -inf, so the exponent is one FMA as below
            s = gl.where(keep, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * qk_scale - _p_base(m_safe, p_shift, SCALED_P)[:, None])
    elif COL_IN_S:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale + alibi_shift)
        m_safe = m_new
        p = gl.exp2(s * qk_scale - _p_base(m_new - alibi_shift, p_shift, SCALED_P)[:, None])
    elif HAS_ALIBI:
        # one FMA per score for the logit, one subtract for the exponent
        t = gl.fma(s, qk_scale, alibi_col[None, :])
        m_new = gl.maximum(m_i, gl.max(t, 1) + alibi_shift)
        m_safe = m_new
        p = gl.exp2(t - _p_base(m_new - alibi_shift, p_shift, SCALED_P)[:, None])
    else:
        # every key valid: the max of the raw scores times the (positive) scale, and one FMA
        # per score for the exponent
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_safe = m_new
        p = gl.exp2(s * qk_scale - _p_base(m_new, p_shift, SCALED_P)[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _pack_p(p, dtype: gl.constexpr):
    """P [64, BLOCK_N] fp32 -> [64, BLOCK_N // 2] int32, columns 2c and 2c + 1 as one 16-bit pair
    (2c in the low half): the registers the PV wgmma takes its A operand in. The softmax carries
    P across a step in this form (module docstring, [Note] packed P): carried as 16-bit values,
    ptxas swapped the halves of every pair twice per step (64 PRMT per thread in the d128 loop)."""
    lo, hi = p.reshape([p.shape[0], p.shape[1] // 2, 2]).split()
    if dtype == gl.bfloat16:
        pk = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=gl.int32,
                                       is_pure=True, pack=1)
    else:
        pk = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=gl.int32,
                                       is_pure=True, pack=1)
    return pk


@gluon.jit
def _unpack_p(pk, dtype: gl.constexpr, layout: gl.constexpr):
    """``_pack_p``'s pairs as the 16-bit [64, BLOCK_N] A operand (``layout``) of the PV wgmma; the
    halves are taken apart and joined back in the same registers (no instructions)."""
    lo = (pk & 0xFFFF).to(gl.int16).to(dtype, bitcast=True)
    hi = (pk >> 16).to(gl.int16).to(dtype, bitcast=True)
    p = gl.join(lo, hi).reshape([pk.shape[0], pk.shape[1] * 2])
    return gl.convert_layout(p, layout)


@gluon.constexpr_function
def _is_fp8(dtype):
    """Whether the kernel runs the FP8 switch ([Note] FP8): its q / K / V type is an 8-bit float."""
    return dtype.is_fp8()


@gluon.constexpr_function
def _mma_k(dtype):
    """K of one wgmma instruction: 32 bytes of each operand row (16 for 16-bit types, 32 for FP8)."""
    return 256 // dtype.primitive_bitwidth


@gluon.constexpr_function
def _promote_k(dtype, PROMOTE):
    """``max_num_imprecise_acc`` of the FP8 wgmmas ([Note] FP8): PROMOTE = 32 moves their partial sums to
    fp32 after every K-step of 32 (``FP8_PROMOTE_K``, as the portable kernel); 0: never within one product
    (Triton's sm_90 default), and for 16-bit types (fp32 sums)."""
    return PROMOTE if dtype.is_fp8() and PROMOTE > 0 else 0


@gluon.jit
def _wgmma(a, b, acc, PROMOTE_K: gl.constexpr, use_acc=True):
    """An async wgmma; PROMOTE_K > 0 (FP8): ``max_num_imprecise_acc=PROMOTE_K`` (``_promote_k``)."""
    if PROMOTE_K > 0:
        tok = warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True, max_num_imprecise_acc=PROMOTE_K)
    else:
        tok = warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True)
    return tok


@gluon.constexpr_function
def _tile_acc(dtype, PROMOTE):
    """Whether each key tile's P V goes into a fresh accumulator that the loop adds to O in fp32
    (O = O * alpha + T; [Note] FP8, PROMOTE = 0): FP8 without per-step promotion."""
    return dtype.is_fp8() and PROMOTE == 0


@gluon.jit
def _to_fp8(x, dtype: gl.constexpr):
    """fp32 ``x`` (any shape and layout) as the FP8 ``dtype``: nearest even, saturating at the largest
    finite value (``cvt.rn.satfinite``: the semantics' ``quantize`` and the portable kernel's ``to_fp8``,
    whatever a Triton version's own cast does on overflow); four values per 32-bit register."""
    if dtype == gl.float8e5:
        y = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [x], dtype=gl.float8e5, is_pure=True, pack=4)
    else:
        y = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)
    return y


@gluon.jit
def _p_carry(p, dtype: gl.constexpr, o_layout: gl.constexpr, FP8_EMU: gl.constexpr = 0):
    """P of a step in the form the loop carries to the next step's PV wgmma: 16-bit pairs packed in int32
    (``_pack_p``), or for FP8 P8 = fp8(p) (p scaled by scale_s already: ``_softmax_tile``'s SCALED_P) in the
    A operand's register layout ([Note] FP8: the layout change is a shuffle within each quad of threads, done
    here under the PV wgmma); FP8_EMU ([Note] FP8 on 16-bit MMAs): P8 as fp16 pairs (``_pack_p8_16``)."""
    if _is_fp8(dtype):
        pk = _pack_p8(p, dtype)
    elif _fp8_semantics(gl.float16, FP8_EMU):
        pk = _pack_p8_16(p, FP8_EMU == 2)
    else:
        pk = _pack_p(p, dtype)
    return pk


@gluon.jit
def _pack_p8_16(p, E5M2: gl.constexpr):
    """``_pack_p``'s fp16 pairs of P8 = fp8(p) (e4m3, or e5m2 where E5M2; nearest even, saturating, as
    ``fp8.quantize``): every FP8 value is exact in fp16, so the 16-bit PV wgmma multiplies the FP8 values
    ([Note] FP8 on 16-bit MMAs). Two conversions per pair."""
    lo, hi = p.reshape([p.shape[0], p.shape[1] // 2, 2]).split()
    if E5M2:
        pk = gl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e5m2x2.f32 t, $2, $1; cvt.rn.f16x2.e5m2x2 $0, t; }", "=r,r,r",
            [lo, hi], dtype=gl.int32, is_pure=True, pack=1)
    else:
        pk = gl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $2, $1; cvt.rn.f16x2.e4m3x2 $0, t; }", "=r,r,r",
            [lo, hi], dtype=gl.int32, is_pure=True, pack=1)
    return pk


@gluon.constexpr_function
def _fp8_semantics(dtype, FP8_EMU):
    """The FP8 forward's semantics (scaled P, P8, the FP8 epilogue): FP8 inputs, or 16-bit ones that hold FP8
    values (FP8_EMU, [Note] FP8 on 16-bit MMAs)."""
    return dtype.is_fp8() or bool(FP8_EMU)       # (None: a build that predates the switch, tools' compiles)


@gluon.jit
def _pack_p8(x, dtype: gl.constexpr):
    """P8 = fp8(x) (x = p * scale_s, fp32 [64, BLOCK_N], wgmma accumulator layout), four values per int32 in
    the order the FP8 PV wgmma's register A operand takes them (``_unpack_p8``), with the operand's columns
    in the key order of the transposed V copy (``key_order``; [Note] FP8, the key order): a thread's
    accumulator holds columns 8i + 2q + e of a row (q its lane in the quad, e = 0, 1), the A operand wants
    4 consecutive columns 4q + t in one register, so operand column 32kb + 16h + 4q + t holds score column
    32kb + 16h + 8(t // 2) + 2q + t % 2, and each register is made of two values from each of two of the
    thread's accumulator column pairs. Per 4 values: two ``cvt.rn.satfinite`` (e4m3x2 / e5m2x2: nearest
    even, saturating, as ``quantize``) and one byte merge. The loop carries the int32 form: carried as 8-bit
    values, they live in 16-bit registers and are masked and merged again before every wgmma."""
    WG_M: gl.constexpr = x.shape[0]
    BLOCK_N: gl.constexpr = x.shape[1]
    # column c = 32 kb + 16 h + 8 u + 2 q + e  ->  dims [row, kb, h, q, u, e]
    x = x.reshape([WG_M, BLOCK_N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5))
    x0, x1 = x.split()          # e = 0, 1
    a, c = x0.split()           # (u, e) = (0, 0), (1, 0)
    b, d = x1.split()           # (0, 1), (1, 1)
    if dtype == gl.float8e5:
        w = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [a, b, c, d], dtype=gl.int32, is_pure=True, pack=1)
    else:
        w = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [a, b, c, d], dtype=gl.int32, is_pure=True, pack=1)
    return w        # [row, kb, h, q]: byte t is operand column 32 kb + 16 h + 4 q + t


@gluon.jit
def _unpack_p8(w, dtype: gl.constexpr, layout: gl.constexpr):
    """``_pack_p8``'s int32 [64, kb, h, q] as the FP8 [64, BLOCK_N] A operand (``layout``): each register's
    four bytes become four consecutive operand columns."""
    WG_M: gl.constexpr = w.shape[0]
    BLOCK_N: gl.constexpr = w.shape[1] * 32
    # byte t of w: logical shifts and bitcasts (what the compiler makes of them is checked in the SASS;
    # asm over joined copies of w depends on how a layout orders its registers)
    t0 = (w & 0xFF).to(gl.int8).to(dtype, bitcast=True)
    t1 = ((w >> 8) & 0xFF).to(gl.int8).to(dtype, bitcast=True)
    t2 = ((w >> 16) & 0xFF).to(gl.int8).to(dtype, bitcast=True)
    t3 = ((w >> 24) & 0xFF).to(gl.int8).to(dtype, bitcast=True)
    # join(join(t0, t1), join(t2, t3))[.., j, i] is byte 2 i + j: operand column 4 q + 2 i + j
    y = gl.join(gl.join(t0, t1), gl.join(t2, t3)).permute((0, 1, 2, 3, 5, 4))
    return gl.convert_layout(y.reshape([WG_M, BLOCK_N]), layout)


@gluon.jit
def _p_operand(pk, dtype: gl.constexpr, o_layout: gl.constexpr):
    """``_p_carry``'s P as the PV wgmma's register A operand."""
    if _is_fp8(dtype):
        p = _unpack_p8(pk, dtype, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))
    else:
        p = _unpack_p(pk, dtype, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return p


@gluon.jit
def _pv_wait(o_tok, p):
    """Wait for the PV wgmma (all wgmmas of the warpgroup) and return O; P, its register A operand, stays
    live until then (a wait's dependency). FP8: Triton 3.6's wait cannot carry 8-bit values (LLVM ERROR
    "Unexpected bitwidth in WGMMAWaitGroupOp: 8"), so only O is; ptxas keeps an in-flight wgmma's
    registers itself, and tools/gluon_check.py checks in the SASS that no instruction writes P's registers
    between the PV HGMMAs and their wait."""
    if _is_fp8(p.dtype):
        o = warpgroup_mma_wait(0, deps=(o_tok, ))
    else:
        o, p = warpgroup_mma_wait(0, deps=(o_tok, p))
    return o


@gluon.jit
def _v_operand(v_smem, slot, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr):
    """One V slot as the PV wgmma's B operand [BLOCK_N, HEAD_D]: the slot itself (16-bit), or for FP8 the
    transposed slot [HEAD_D, BLOCK_N] (keys innermost, as FP8 wgmmas read B: K-major) permuted."""
    if _is_fp8(v_smem.dtype):
        view = v_smem.index(slot).reshape([HEAD_D, BLOCK_N]).permute((1, 0))
    else:
        view = _kv_view(v_smem, slot, BLOCK_N, HEAD_D)
    return view


@gluon.jit
def _alibi_slope2(SLOPES, batch, head, stride_sb):
    """ALiBi's slope of (``batch``, ``head``) (fp32 [b, h_q] tensor, natural units; batch stride 0 for
    per-head slopes) in base 2, the kernels' exponent base."""
    return gl.load(SLOPES + batch.to(gl.int64) * stride_sb + head) * LOG2E_C


@gluon.jit
def _alibi_cols(slope2, like):
    """slope * c in base 2 for the columns c of a score tile ``like`` (in its column layout): the
    loop-invariant half of ALiBi's column term (``_softmax_tile``)."""
    BLOCK_N: gl.constexpr = like.shape[1]
    return slope2 * gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, like.type.layout)).to(gl.float32)


@gluon.constexpr_function
def _alibi_by_mma(has_alibi, dtype):
    """Whether ALiBi's loop-invariant column term goes through the tensor cores ([Note] ALiBi by
    wgmma): bf16, whose 8-bit exponent holds any slope * c / scale; fp16 keeps the FMA."""
    return bool(has_alibi) and dtype == gl.bfloat16


@gluon.jit
def _alibi_operands(dtype: gl.constexpr, WG_M: gl.constexpr, BLOCK_N: gl.constexpr, BY_MMA: gl.constexpr):
    """Shared memory for ALiBi's column term as one k = 16 wgmma ([Note] ALiBi by wgmma): A [WG_M, 16]
    and B [BLOCK_N, 16] (``_alibi_fill``), or (0, 0) when not BY_MMA."""
    if BY_MMA:
        # 16 16-bit columns: 32-byte rows, so the 32-byte swizzle
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
        return (gl.allocate_shared_memory(dtype, [WG_M, 16], layout),
                gl.allocate_shared_memory(dtype, [BLOCK_N, 16], layout))
    else:
        return (0, 0)


@gluon.jit
def _alibi_fill(bias, slope2, qk_scale):
    """Write ALiBi's operands for slope2 (base 2): A = 1 in columns 0-2, B row c = slope2 * c / qk_scale
    as three 16-bit parts (hi, mid, lo: 24 bits, the fp32 product's precision) in columns 0-2, zeros
    elsewhere, so that A B^T adds slope2 * c / qk_scale to score column c."""
    a = bias[0]
    b = bias[1]
    WG_M: gl.constexpr = a.shape[0]
    BLOCK_N: gl.constexpr = b.shape[0]
    dtype: gl.constexpr = b.dtype
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0])
    k = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))[None, :]
    c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout)).to(gl.float32)[:, None]
    col = (slope2 / qk_scale) * c
    hi = col.to(dtype).to(gl.float32)
    mid = (col - hi).to(dtype).to(gl.float32)
    lo = col - hi - mid
    b.store(gl.where(k == 0, hi, gl.where(k == 1, mid, gl.where(k == 2, lo, 0.0))).to(dtype))
    r = gl.arange(0, WG_M, layout=gl.SliceLayout(1, layout))[:, None]
    a.store(gl.where((k < 3) & (r >= 0), 1.0, 0.0).to(dtype))      # r >= 0: broadcast to [WG_M, 16]
    fence_async_shared()
    cta_barrier()


@gluon.jit
def _qk_mma(q_view, k_tile, zero_s, bias, BY_MMA: gl.constexpr, PROMOTE: gl.constexpr = FP8_PROMOTE_K):
    """Issue S = Q K^T for one key tile ([BLOCK_N, HEAD_D] shared memory) as async wgmmas, plus
    ALiBi's column term (A B^T, ``_alibi_fill``) when BY_MMA; returns the in-flight accumulator."""
    s_tok = _wgmma(q_view, k_tile.permute((1, 0)), zero_s, _promote_k(q_view.dtype, PROMOTE), use_acc=False)
    if BY_MMA:
        s_tok = warpgroup_mma(bias[0], bias[1].permute((1, 0)), s_tok, is_async=True)
    return s_tok


@gluon.jit
def _kv_view(ring, slot, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr):
    """One K or V slot of a ring [STAGES, 1, 1, BLOCK_N, HEAD_D] as a 2-D [BLOCK_N, HEAD_D] tile."""
    return ring.index(slot).reshape([BLOCK_N, HEAD_D])


@gluon.jit
def _drop(p, drop, row0, n0):
    """Dropout on the probabilities p [64, BLOCK_N] of rows row0.., keys n0..: the dropped ones set
    to 0 (``dropout.keep``, the same mask as every other path); the kept ones are scaled by
    1 / (1 - p) in the epilogue (``_fwd_write``), once per row instead of once per score."""
    layout: gl.constexpr = p.type.layout
    BLOCK_N: gl.constexpr = p.shape[1]
    keep = dropout.keep(drop, row0, n0, layout, BLOCK_N, True)
    return gl.where(keep, p, 0.0)


@gluon.jit
def _stats_store(pin, m_i, l_i):
    """STATS_SMEM: a step's running sum and max into ``pin`` (fp32 [2 * 64]: l in the first half, m in the second).
    Each thread writes its own rows (the four threads of a row write the same values) and reads back only those
    addresses, so its own program order makes the next step's ``_stats_load`` see them: no barrier."""
    WG_M: gl.constexpr = pin.shape[0] // 2
    pin.slice(0, WG_M).store(l_i)
    pin.slice(WG_M, WG_M).store(m_i)


@gluon.jit
def _stats_load(pin, layout: gl.constexpr):
    """(m, l) as the last ``_stats_store`` left them, in the rows' ``layout``."""
    WG_M: gl.constexpr = pin.shape[0] // 2
    return pin.slice(WG_M, WG_M).load(layout), pin.slice(0, WG_M).load(layout)


@gluon.jit
def _fwd_step(j, q_view, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, o, pk, alpha, m_i, l_i, zero_s,
              qk_scale, p_shift, rows, row0, kv0, S_KV, diag, win_left, win_right, slope2, alibi_col, bias, pin, turn,
              turn0,
              drop, WG: gl.constexpr,
              MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr,
              DROPOUT: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, PROMOTE: gl.constexpr = 32,
              FP8_EMU: gl.constexpr = 0, P_F32: gl.constexpr = False, STATS_SMEM: gl.constexpr = False):
    """Step j >= 1 (key tile kv0 / BLOCK_N + j): QK^T of this tile, then PV of the previous one
    overlapped with this tile's softmax.

    alpha is tile j-1's rescale, applied to O just before O += P_{j-1} V_{j-1}; the returned
    alpha is tile j's. ``pin`` is the shared-memory slot that keeps the softmax ahead of the PV
    wait (module docstring, [Note] keeping the softmax under the PV wgmma).

    j counts the K/V ring's stream: on the persistent grid it goes on across work tiles, and
    kv0 is then the key offset of the work tile's first tile minus ring0 * BLOCK_N (ring0: the
    tiles that went through the ring before it), so that n0 = kv0 + j * BLOCK_N is still the
    tile's first key. turn0 + j - 1 counts the ping-pong steps taken before this one (turn0 = 0
    on the one-tile grid). DROPOUT: the PV product takes P with the dropped scores zeroed
    (``_drop``); l keeps the sum of them all. P_F32 (16-bit only): ``pk`` in and out is P itself, fp32, packed
    here right before its PV wgmma ([Note] packed P). STATS_SMEM: m_i and l_i in and out are unused; the step reads
    them from ``pin`` ([2 * 64]) and leaves its own there (``_stats_store``).
    """
    BLOCK_N: gl.constexpr = zero_s.shape[1]
    HEAD_D: gl.constexpr = q_view.shape[1]
    BY_MMA: gl.constexpr = _alibi_by_mma(HAS_ALIBI, q_view.dtype)
    o_layout: gl.constexpr = o.type.layout
    slot = j % STAGES
    prev = (j - 1) % STAGES
    if PINGPONG:
        # FA3's ping-pong: the two consumer warpgroups take turns issuing their two wgmmas, so
        # one's softmax runs while the other's products keep the tensor cores busy. Step j of
        # warpgroup 0 waits for step j-1 of warpgroup 1 (its first passes: the parity of the
        # phase before a fresh barrier's first counts as complete); step j of warpgroup 1 waits
        # for step j of warpgroup 0.
        mbarrier.wait(turn.index(WG), ((turn0 + j - 1) & 1) ^ (1 - WG))
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    pv_dtype: gl.constexpr = v_smem.dtype      # the PV product's operand type ([Note] FP8 on 16-bit MMAs)
    TILE_ACC: gl.constexpr = _tile_acc(pv_dtype, PROMOTE)
    s_tok = _qk_mma(q_view, _kv_view(k_smem, slot, BLOCK_N, HEAD_D), zero_s, bias, BY_MMA, PROMOTE)
    # O (relative to the max before tile j-1) onto tile j-1's max, while QK^T runs
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    if not TILE_ACC:
        o = o * alpha_o[:, None]
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    if P_F32:
        pk = _p_carry(pk, pv_dtype, o_layout, FP8_EMU)
    p = _p_operand(pk, pv_dtype, o_layout)
    if TILE_ACC:
        # FP8, PROMOTE = 0: tile j-1's P V in a fresh accumulator, added to O in fp32 after the wait
        o_tok = warpgroup_mma(p, _v_operand(v_smem, prev, BLOCK_N, HEAD_D), gl.zeros_like(o), use_acc=False,
                              is_async=True)
    else:
        o_tok = _wgmma(p, _v_operand(v_smem, prev, BLOCK_N, HEAD_D), o, _promote_k(pv_dtype, PROMOTE))
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG))
    # wgmma groups retire in order: one left in flight means the QK^T (issued first) is done
    n0 = kv0 + j * BLOCK_N
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(slot))
    if STATS_SMEM:
        m_i, l_i = _stats_load(pin, gl.SliceLayout(1, zero_s.type.layout))
    p_new, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, rows, n0, S_KV, diag, win_left, win_right,
                                           alibi_col, slope2, row0, MASKED, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, BY_MMA,
                                           _fp8_semantics(q_view.dtype, FP8_EMU), p_shift)
    # l depends on every exponential of the tile: storing it orders them all before the wait
    if STATS_SMEM:
        _stats_store(pin, m_i, l_i)
    else:
        pin.store(l_i)
    if DROPOUT:
        p_new = _drop(p_new, drop, row0, n0)
    if TILE_ACC:
        o = gl.fma(o, alpha_o[:, None], _pv_wait(o_tok, p))
    else:
        o = _pv_wait(o_tok, p)
    mbarrier.arrive(v_empty.index(prev))
    # 16-bit P packed in the registers of the PV wgmma's A operand, or FP8 P8 = fp8(p), p scaled already, there
    if not P_F32:
        p_new = _p_carry(p_new, pv_dtype, o_layout, FP8_EMU)
    return o, p_new, alpha, m_i, l_i


@gluon.jit
def _zero_rows_from(tile, n_valid, other=None):
    """Zero rows [n_valid, BLOCK_N) of a [BLOCK_N, HEAD_D] tile in shared memory (a padded
    sequence's last V tile here; K/V in the dQ pass, Q/dO in the dK/dV pass), and the same rows of
    ``other`` (a second tile of the same shape) when given, before the wgmmas that read them
    (module docstring, [Note] padding). Runs in one consumer warpgroup.

    The whole tile makes one round trip through registers (64 per thread at d=128 and d=256,
    beside the live O accumulator: no spills, tools/gluon_check.py); chunked, data-dependent
    variants made ptxas spill and pay a warpgroup barrier per chunk. The generic-proxy stores
    are fenced for the async proxy (the wgmma reads shared memory through it) and the warpgroup
    synchronizes, so every thread's zeros are in place before any thread issues the wgmma."""
    BLOCK_N: gl.constexpr = tile.shape[0]
    HEAD_D: gl.constexpr = tile.shape[1]
    # 8 consecutive 16-bit columns (16 bytes) per thread; a warp covers 256 // HEAD_D rows
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_D, HEAD_D // 8], [4, 1], [1, 0])
    # a row's low bits are the thread's (its lane's row in the warp, then the warp), the rest the register's
    ROW_THREAD_BITS: gl.constexpr = 4 * (256 // HEAD_D) - 1
    if n_valid < BLOCK_N:
        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        keep = _index_below(r, n_valid, ROW_THREAD_BITS)[:, None]
        x = tile.load(layout)
        tile.store(gl.where(keep, x, gl.zeros_like(x)))
        if other is not None:
            y = other.load(layout)
            other.store(gl.where(keep, y, gl.zeros_like(y)))
        fence_async_shared()
        cta_barrier()


@gluon.jit
def _zero_cols_from(tile, n_valid):
    """Zero columns [n_valid, BLOCK_N) of an 8-bit [HEAD_D, BLOCK_N] tile in shared memory: the FP8
    forward's transposed V slot ([Note] FP8), whose columns are keys, as ``_zero_rows_from`` does for a
    16-bit V slot (one register round trip, fence, warpgroup barrier; a padded sequence's last tile)."""
    HEAD_D: gl.constexpr = tile.shape[0]
    BLOCK_N: gl.constexpr = tile.shape[1]
    # 16 consecutive 8-bit columns (16 bytes) per thread; a warp covers 512 // BLOCK_N rows
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [512 // BLOCK_N, BLOCK_N // 16], [4, 1], [1, 0])
    if n_valid < BLOCK_N:
        c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        # the key of column c (``key_order``, ``_pack_p8``): c = 16 g + 4 q + t holds key
        # 16 g + 8 (t // 2) + 2 q + t % 2
        c = (c & ~15) + ((c & 2) << 2) + ((c >> 1) & 6) + (c & 1)
        x = tile.load(layout)
        tile.store(gl.where(c[None, :] < n_valid, x, gl.zeros_like(x)))
        fence_async_shared()
        cta_barrier()


@gluon.jit
def _zero_landed_rows(tile, tile_ready, other, other_ready, phase, n_valid):
    """Padding in the backward passes: once ``tile`` and ``other`` (two [rows, HEAD_D] shared tiles
    of the same shape: K and V in the dQ pass, Q and dO in the dK/dV pass) have landed (their
    ready mbarriers at ``phase``), zero their rows [n_valid, rows), a no-op when n_valid >= rows.
    TMA loads those rows (they are inside the tensor) and they may hold NaN: the masks give them
    zero probabilities, but a wgmma would still meet 0 * NaN. Both consumer warpgroups zero the
    same rows, each before its own wgmmas, as the forward zeroes V (module docstring, [Note]
    padding)."""
    mbarrier.wait(tile_ready, phase)
    mbarrier.wait(other_ready, phase)
    _zero_rows_from(tile, n_valid, other)


@gluon.jit
def _fwd_attend(WG: gl.constexpr, q_view, q_ready, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, pin,
                bias, ring0, turn0, q_free, release, rows, row0, t_lo, t_a, t_b, t_hi, n_tiles, len_kv, diag, win_left,
                win_right, slope2, qk_scale, drop, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                HAS_ALIBI: gl.constexpr, PADDED: gl.constexpr, HAS_SEQ_KV: gl.constexpr, DROPOUT: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, scale_s=1.0,
                PROMOTE: gl.constexpr = 32, FP8_EMU: gl.constexpr = 0, P_F32: gl.constexpr = False,
                STATS_SMEM: gl.constexpr = False):
    """The online softmax of one consumer warpgroup's 64 query rows (``rows``, first ``row0``, Q in
    ``q_view`` [64, HEAD_D]) over key tiles [t_lo, t_hi) (``_kv_range``); key tile t_lo + j sits in
    ring slot (ring0 + j) % STAGES (ring0: the K/V tiles of earlier work tiles; 0 on the one-tile
    grid), turn0 counts the earlier ping-pong steps. Returns (o, m_i, l_i): the unnormalized output
    [64, HEAD_D] fp32 (wgmma layout), the base-2 running max and the row sums.

    q_ready: Q's ready barrier to wait on (phase 0), or None when the caller has waited already
    (the persistent consumer, which reads its work tile under the same barrier). q_free / release
    (persistent grid, 2 Q slots): once this tile's first QK^T is done, the previous work tile's Q
    slot is handed back to the producer (after its output store has read it), so the next Q load
    runs under this tile. Keys >= len_kv are masked; with padding a tile with n_tiles = 0
    computes nothing and returns o = 0, l = 0 (the epilogue then writes zeros). STATS_SMEM: the steps pass the
    running max and sum through ``pin`` ([2 * 64] fp32, ``_stats_store``) instead of registers."""
    WG_M: gl.constexpr = q_view.shape[0]
    HEAD_D: gl.constexpr = q_view.shape[1]
    dtype: gl.constexpr = q_view.dtype
    # wgmma layouts of one warpgroup: scores [64, BLOCK_N] and output [64, HEAD_D] accumulators
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, _mma_k(dtype)])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, _mma_k(v_smem.dtype)])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    zero_s = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([WG_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([WG_M], gl.float32, row_s)
    o = gl.zeros([WG_M, HEAD_D], gl.float32, o_layout)

    # with padding a CTA may have nothing to compute (n_tiles = 0: _cta_tiles); it keeps
    # o = 0, l = 0 and the epilogue writes zeros. Without padding this is a compile-time True.
    compute = True
    if PADDED:
        compute = n_tiles > 0
    if compute:
        if q_ready is not None:
            mbarrier.wait(q_ready, 0)

        # prologue: tile t_lo (always through the masked path; it may be partial or empty)
        kv0 = t_lo * BLOCK_N
        # ALiBi's column term: slope * c (loop-invariant, c the column in a tile) + slope * (n0 - row0)
        alibi_col = 0.0
        BY_MMA: gl.constexpr = _alibi_by_mma(HAS_ALIBI, dtype)
        if BY_MMA:
            _alibi_fill(bias, slope2, qk_scale)
        elif HAS_ALIBI:
            alibi_col = _alibi_cols(slope2, zero_s)
        slot0 = ring0 % STAGES
        mbarrier.wait(k_ready.index(slot0), (ring0 // STAGES) & 1)
        s_tok = _qk_mma(q_view, _kv_view(k_smem, slot0, BLOCK_N, HEAD_D), zero_s, bias, BY_MMA, PROMOTE)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot0))
        if q_free is not None:
            if release:
                # the previous work tile's output store (from its Q slot) has long been issued;
                # once it has read shared memory the slot may take the next Q
                tma.store_wait(0)
                mbarrier.arrive(q_free)
        # FP8: p comes out of its exponential scaled by scale_s, and l sums it so ([Note] FP8)
        p_shift = 0.0
        if _fp8_semantics(dtype, FP8_EMU):
            p_shift = gl.log2(scale_s)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, rows, kv0, len_kv, diag, win_left, win_right,
                                           alibi_col, slope2, row0, True, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, BY_MMA,
                                           _fp8_semantics(dtype, FP8_EMU), p_shift)
        if STATS_SMEM:
            _stats_store(pin, m_i, l_i)
        if DROPOUT:
            p = _drop(p, drop, row0, kv0)
        # P as the loop carries it to the next step (P_F32: fp32 on 16-bit operands, [Note] packed P)
        CARRY_F32: gl.constexpr = P_F32 and not _is_fp8(v_smem.dtype) and not _fp8_semantics(dtype, FP8_EMU)
        pk = p if CARRY_F32 else _p_carry(p, v_smem.dtype, o_layout, FP8_EMU)

        # steps j (key tile t_lo + j - ring0, ring slot j % STAGES): the band's masked left edge, the
        # mask-free middle, the masked right edge. The loops run over the ring's own count, with
        # the key offset shifted to match (kvr), so that ring0 costs no register inside them.
        kvr = kv0 - ring0 * BLOCK_N
        turn_r = turn0 - ring0
        for j in range(ring0 + 1, ring0 + t_a - t_lo):
            o, pk, alpha, m_i, l_i = _fwd_step(j, q_view, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, o, pk,
                                              alpha, m_i, l_i, zero_s, qk_scale, p_shift, rows, row0, kvr, len_kv, diag,
                                              win_left, win_right, slope2, alibi_col, bias, pin, turn, turn_r, drop,
                                              WG,
                                              True, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, DROPOUT, STAGES, PINGPONG,
                                              PROMOTE, FP8_EMU, CARRY_F32, STATS_SMEM)
        for j in range(ring0 + t_a - t_lo, ring0 + t_b - t_lo):
            o, pk, alpha, m_i, l_i = _fwd_step(j, q_view, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, o, pk,
                                              alpha, m_i, l_i, zero_s, qk_scale, p_shift, rows, row0, kvr, len_kv, diag,
                                              win_left, win_right, slope2, alibi_col, bias, pin, turn, turn_r, drop,
                                              WG,
                                              False, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, DROPOUT, STAGES, PINGPONG,
                                              PROMOTE, FP8_EMU, CARRY_F32, STATS_SMEM)
        for j in range(ring0 + t_b - t_lo, ring0 + t_hi - t_lo):
            o, pk, alpha, m_i, l_i = _fwd_step(j, q_view, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, o, pk,
                                              alpha, m_i, l_i, zero_s, qk_scale, p_shift, rows, row0, kvr, len_kv, diag,
                                              win_left, win_right, slope2, alibi_col, bias, pin, turn, turn_r, drop,
                                              WG,
                                              True, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, DROPOUT, STAGES, PINGPONG,
                                              PROMOTE, FP8_EMU, CARRY_F32, STATS_SMEM)

        if STATS_SMEM:
            m_i, l_i = _stats_load(pin, row_s)
        # last PV product
        last = ring0 + t_hi - t_lo - 1
        slot = last % STAGES
        mbarrier.wait(v_ready.index(slot), (last // STAGES) & 1)
        if HAS_SEQ_KV:
            # the last tile is the only one that can reach past len_kv (_cta_tiles); its V rows
            # there are padding that TMA loaded (it zero-fills only past S_KV): P is 0 on them, but
            # 0 * NaN would still poison O. (Persistent grid: the producer refills this slot only
            # after both warpgroups' PV products, v_empty, so the zeros stay until both are done.)
            if _is_fp8(v_smem.dtype):
                # V's slot is transposed ([HEAD_D, BLOCK_N], [Note] FP8): the keys are its columns
                _zero_cols_from(v_smem.index(slot).reshape([HEAD_D, BLOCK_N]), len_kv - (t_hi - 1) * BLOCK_N)
            else:
                _zero_rows_from(_kv_view(v_smem, slot, BLOCK_N, HEAD_D), len_kv - (t_hi - 1) * BLOCK_N)
        if CARRY_F32:
            pk = _p_carry(pk, v_smem.dtype, o_layout, FP8_EMU)
        p = _p_operand(pk, v_smem.dtype, o_layout)
        if _tile_acc(v_smem.dtype, PROMOTE):
            o_tok = warpgroup_mma(p, _v_operand(v_smem, slot, BLOCK_N, HEAD_D), gl.zeros_like(o), use_acc=False,
                                  is_async=True)
            o = gl.fma(o, gl.convert_layout(alpha, row_o)[:, None], _pv_wait(o_tok, p))
        else:
            o = o * gl.convert_layout(alpha, row_o)[:, None]
            o_tok = _wgmma(p, _v_operand(v_smem, slot, BLOCK_N, HEAD_D), o, _promote_k(v_smem.dtype, PROMOTE))
            o = _pv_wait(o_tok, p)
        mbarrier.arrive(v_empty.index(slot))
        if _fp8_semantics(dtype, FP8_EMU):
            # l summed the scaled p: the epilogue's l is softmax's own
            l_i = l_i / scale_s
    return o, m_i, l_i


@gluon.jit
def _fwd_write(o, m_i, l_i, rows, row0, stage, o_desc, LSE, stride_lb, stride_lh, stride_lm, batch, head, S_Q,
               len_q, slope2, drop, SINK, HAS_ALIBI: gl.constexpr, WRITE_LSE: gl.constexpr, HAS_SEQ_Q: gl.constexpr,
               DROPOUT: gl.constexpr, HAS_SINK: gl.constexpr, fp8_out=None, q_off=0, PACKED_Q: gl.constexpr = False,
               FP8_EMU: gl.constexpr = 0):
    """Epilogue of one consumer warpgroup: normalize O (empty rows give 0, rows >= len_q too) and
    store it through ``stage`` ([1, 1, 64, HEAD_D] shared memory: the warpgroup's Q buffer, free
    once its QK^T products are done) with TMA, which clips rows >= S_Q; the LSE (natural log)
    with plain stores. Returns with the TMA store in flight (the caller waits: tma.store_wait).
    DROPOUT: O is scaled by drop[5] = 1 / (1 - p) (``dropout.state``), the kept probabilities' factor.
    HAS_SINK: the head's sink logit (fp32 ``SINK[head]``) joins the row's sum first (module docstring,
    [Note] sinks). FP8 (stage's type; [Note] FP8): fp8_out = (O, stride_ob, stride_oh, stride_om, D,
    SCALES, AMAX); the output is descaled, counted into the amaxes, scaled and stored from registers (``_fp8_write``)
    instead of through ``stage``. PACKED_Q ([Note] packed queries): ``batch`` is the views' batch (0) and the
    sequence's rows start at row q_off of the packed O / LSE; a tile wholly inside the sequence goes out by
    TMA, the one that holds its last row by masked stores from registers (``_store_rows``: TMA would write
    the next sequence's rows), a tile past it not at all; fp8_out = (O, the packed row count, stride_oh,
    stride_om, D, unused, unused)."""
    WG_M: gl.constexpr = stage.shape[2]
    HEAD_D: gl.constexpr = stage.shape[3]
    o_layout: gl.constexpr = o.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if HAS_SINK:
        # base 2, in the loop's frame: ALiBi's rows are shifted by slope2 * (row - row0) (_softmax_tile)
        sink2 = gl.load(SINK + head) * LOG2E_C + gl.zeros_like(m_i)
        if HAS_ALIBI:
            sink2 = sink2 + slope2 * (rows - row0).to(gl.float32)
        m_new = gl.maximum(m_i, sink2)
        # a row with neither a key nor a sink (-inf) stays empty: max 0, so no -inf - -inf arises
        m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_new)           # 0 where the row saw no key (m_i -inf)
        l_i = l_i * alpha + gl.exp2(sink2 - m_new)
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        m_i = m_new
    l_o = gl.convert_layout(l_i, row_o)
    ok = l_o != 0.0       # empty rows (0) write 0; a NaN sum (a NaN or inf score) stays NaN, as softmax
    if HAS_SEQ_Q:
        ok = ok & (gl.convert_layout(rows, row_o) < len_q)
    inv_l = gl.where(ok, 1.0 / gl.where(ok, l_o, 1.0), 0.0)
    if DROPOUT:
        inv_l = inv_l * drop[5]
    out = o * inv_l[:, None]
    if HAS_SEQ_Q:
        # rows >= len_q ran on padding rows of Q, which may hold NaN or inf (0 * NaN is NaN)
        out = gl.where(ok[:, None], out, 0.0)
    if _fp8_semantics(stage.dtype, FP8_EMU):
        _fp8_write(out, inv_l, gl.convert_layout(rows, row_o), batch, head, S_Q, len_q, fp8_out)
    elif PACKED_Q:
        if row0 + WG_M <= len_q:
            stage.reshape([WG_M, HEAD_D]).store(out.to(stage.dtype))
            fence_async_shared()
            tma_store(o_desc, [batch, head, q_off + row0, 0], stage)
        elif row0 < len_q:
            _store_rows(out.to(stage.dtype), gl.convert_layout(rows, row_o), q_off, head, len_q, fp8_out)
    else:
        stage.reshape([WG_M, HEAD_D]).store(out.to(stage.dtype))
        fence_async_shared()
        tma_store(o_desc, [batch, head, row0, 0], stage)
    if WRITE_LSE:
        # natural-log log-sum-exp of the scaled scores; -inf for empty rows and rows >= len_q
        ok_s = l_i != 0.0
        if HAS_SEQ_Q:
            ok_s = ok_s & (rows < len_q)
        lse2 = m_i + gl.log2(gl.where(ok_s, l_i, 1.0))
        if HAS_ALIBI:
            lse2 = lse2 - slope2 * (rows - row0).to(gl.float32)     # the row half of ALiBi (_softmax_tile)
        lse = gl.where(ok_s, lse2 * LN2, float("-inf"))
        base = LSE + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
        if PACKED_Q:
            at = q_off + rows
            gl.store(base + at.to(gl.int64) * stride_lm, lse, mask=(rows < len_q) & (at >= 0) & (at < fp8_out[1]))
        else:
            gl.store(base + rows.to(gl.int64) * stride_lm, lse, mask=rows < S_Q)


@gluon.jit
def _store_rows(val, rows, q_off, head, len_q, o_out):
    """Rows [0, len_q) of a PACKED_Q output tile (``_fwd_write``) by masked plain stores: val [WG_M, HEAD_D] in the
    accumulator's layout, rows its sequence rows (the layout's row slice), written at packed row q_off + row
    of O; o_out = (O, packed row count, stride_oh, stride_om, D, ...). Rows outside [0, count) are never
    written, whatever cu_seqlens_q holds (validate=False promises no access out of bounds)."""
    HEAD_D: gl.constexpr = val.shape[1]
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, val.type.layout))
    at = q_off + rows
    base = o_out[0] + head.to(gl.int64) * o_out[2]
    ptrs = base + at.to(gl.int64)[:, None] * o_out[3] + cols[None, :]
    keep = (rows < len_q) & (at >= 0) & (at < o_out[1])
    gl.store(ptrs, val, mask=keep[:, None] & _index_below(cols, o_out[4], MMA_COL_THREAD_BITS)[None, :])


@gluon.jit
def _head_descales(qk_scale, fp8_out, head):
    """The FP8 forward's per-head descales ([Note] FP8; FP8_HEAD_SCALES): the score scale times descale_q of query
    head ``head`` and descale_k of its kv head, and that kv head's descale_v (fp8_out's last entry: the three
    pointers and the group). descale_v multiplies the accumulator before the epilogue's 1 / l (``_fp8_write``
    multiplies by the per-tensor one, 1 here)."""
    DESCALE_Q, DESCALE_K, DESCALE_V, GROUP = fp8_out[7]
    kv_head = head // GROUP
    return qk_scale * gl.load(DESCALE_Q + head) * gl.load(DESCALE_K + kv_head), gl.load(DESCALE_V + kv_head)


@gluon.jit
def _fp8_write(out, inv_l, rows, batch, head, S_Q, len_q, fp8_out):
    """The FP8 forward's output ([Note] FP8), as the portable kernel's ``fp8_epilogue``: O = out *
    descale_s * descale_v (out = acc / l, 0 on empty rows and rows >= len_q), amax_s = max 1 / l and
    amax_o = max |O| over the rows inside the sequence (a float atomic max each into AMAX[0], AMAX[1],
    zeroed by the host: both >= 0, where the float order is the integer one), then O * scale_o in O's type
    (FP8: saturating, ``_to_fp8``) by plain masked stores (rows < S_Q, columns < D: the 256-wide tile of
    d=224 too). SCALES: fp32 [6] = descale_q, descale_k, descale_v, descale_s, scale_s, scale_o."""
    O = fp8_out[0]
    SCALES = fp8_out[5]
    AMAX = fp8_out[6]
    o_layout: gl.constexpr = out.type.layout
    HEAD_D: gl.constexpr = out.shape[1]
    out = out * gl.load(SCALES + 3) * gl.load(SCALES + 2)   # matmul_fp8's order: descale A (P), then B (V)
    row_in = rows < len_q
    gl.atomic_max(AMAX, gl.max(gl.where(row_in, inv_l, 0.0), 0))
    gl.atomic_max(AMAX + 1, gl.max(gl.max(gl.where(row_in[:, None], gl.abs(out), 0.0), 1), 0))
    out = out * gl.load(SCALES + 5)
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    base = O + batch.to(gl.int64) * fp8_out[1] + head.to(gl.int64) * fp8_out[2]
    ptrs = base + rows.to(gl.int64)[:, None] * fp8_out[3] + cols[None, :]
    _store_as(ptrs, out, (rows < S_Q)[:, None] & (cols < fp8_out[4])[None, :])


@gluon.jit
def _store_as(ptrs, x, mask):
    """fp32 ``x`` stored at ``ptrs`` (masked) in their element type: FP8 saturating (``_to_fp8``), else a cast."""
    OUT_TY: gl.constexpr = ptrs.dtype.element_ty
    if OUT_TY.is_fp8():
        val = _to_fp8(x, OUT_TY)
    else:
        val = x.to(OUT_TY)
    gl.store(ptrs, val, mask=mask)


@gluon.jit
def _fwd_consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                  o_desc, LSE, stride_lb, stride_lh, stride_lm, batch, head, start_m, t_lo, t_a, t_b, t_hi,
                  n_tiles, S_Q, len_q, len_kv, diag, win_left, win_right, slope2, qk_scale, drop, SINK,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, WRITE_LSE: gl.constexpr,
                  HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr, DROPOUT: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, HAS_SINK: gl.constexpr,
                  scale_s=1.0, fp8_out=None, PROMOTE: gl.constexpr = 32, q_off=0, PACKED_Q: gl.constexpr = False,
                  FP8_EMU: gl.constexpr = 0, FP8_HEAD_SCALES: gl.constexpr = False, P_F32: gl.constexpr = False,
                  STATS_SMEM: gl.constexpr = False):
    """Consumer warpgroup WG (one work tile per CTA): the online softmax of query rows
    [start_m + 64 * WG, +64) over key tiles [t_lo, t_hi) (``_fwd_attend``), then the epilogue
    through the (now free) Q buffer (``_fwd_write``). Keys j >= len_kv are masked (len_kv = S_KV
    unless padded); with padding, a CTA with n_tiles = 0 computes nothing and writes zeros, and
    rows >= len_q are written as zeros (module docstring, [Note] padding). scale_s, fp8_out: the FP8
    switch's P scale and output (``_fwd_write``; [Note] FP8), FP8_HEAD_SCALES its per-head descales
    (``_head_descales``). batch is the Q / O views' batch and q_off the sequence's first row in them
    (``_packed_origin``; PACKED_Q, [Note] packed queries)."""
    WG_M: gl.constexpr = q_smem.shape[2]
    HEAD_D: gl.constexpr = q_smem.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, _mma_k(q_smem.dtype)])
    row0 = start_m + WG * WG_M
    rows = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))   # global query row of each accumulator row
    pin = gl.allocate_shared_memory(gl.float32, [2 * WG_M if STATS_SMEM else WG_M],
                                    gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bias = _alibi_operands(q_smem.dtype, WG_M, BLOCK_N, _alibi_by_mma(HAS_ALIBI, q_smem.dtype))
    descale_v = 1.0
    if FP8_HEAD_SCALES:
        qk_scale, descale_v = _head_descales(qk_scale, fp8_out, head)
    o, m_i, l_i = _fwd_attend(WG, q_smem.reshape([WG_M, HEAD_D]), q_bar, k_smem, v_smem, k_ready, k_empty, v_ready,
                              v_empty, turn, pin, bias, 0, 0, None, False, rows, row0, t_lo, t_a, t_b, t_hi, n_tiles,
                              len_kv, diag, win_left, win_right, slope2, qk_scale, drop, HAS_LEFT, HAS_RIGHT,
                              HAS_ALIBI, HAS_SEQ_Q or HAS_SEQ_KV, HAS_SEQ_KV, DROPOUT, BLOCK_N, STAGES, PINGPONG,
                              scale_s, PROMOTE, FP8_EMU, P_F32, STATS_SMEM)
    if FP8_HEAD_SCALES:
        o = o * descale_v
    _fwd_write(o, m_i, l_i, rows, row0, q_smem, o_desc, LSE, stride_lb, stride_lh, stride_lm, batch, head, S_Q,
               len_q, slope2, drop, SINK, HAS_ALIBI, WRITE_LSE, HAS_SEQ_Q, DROPOUT, HAS_SINK, fp8_out, q_off, PACKED_Q,
               FP8_EMU)
    tma.store_wait(0)


@gluon.jit
def _seq_length(SEQ, batch, S, HAS_SEQ: gl.constexpr):
    """Length of batch entry ``batch``: SEQ[batch] (int32 [b]) clamped to [0, S], or S when
    there is no length tensor (as the Triton forward's sequence_lengths)."""
    n = S
    if HAS_SEQ:
        n = gl.minimum(gl.maximum(gl.load(SEQ + batch), 0), S)
    return n


@gluon.jit
def _packed_length(SEQ, batch, S, HAS_SEQ: gl.constexpr, PACKED: gl.constexpr):
    """Rows (query or key) of batch entry ``batch``: ``_seq_length``'s, or when PACKED (SEQ = cumulative
    offsets, int32 [b + 1]) SEQ[batch + 1] - SEQ[batch] clamped to [0, S] (S: the longest sequence)."""
    if PACKED:
        n = gl.minimum(gl.maximum(gl.load(SEQ + batch + 1) - gl.load(SEQ + batch), 0), S)
    else:
        n = _seq_length(SEQ, batch, S, HAS_SEQ)
    return n


@gluon.jit
def _packed_origin(SEQ, batch, PACKED: gl.constexpr):
    """Where batch entry ``batch``'s rows sit in their 4-D views: (the views' batch, the first row). PACKED
    ([Note] packed queries): one view batch of packed rows, (0, SEQ[batch]); else (batch, 0)."""
    view_batch = batch
    first = batch * 0
    if PACKED:
        view_batch = batch * 0
        first = gl.load(SEQ + batch)
    return view_batch, first


@gluon.jit
def _fwd_tile(pid_m, bh, SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, win_left, win_right, HAS_LEFT: gl.constexpr,
              HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, HAS_SEQ_Q: gl.constexpr,
              HAS_SEQ_KV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PACKED_Q: gl.constexpr = False,
              PACKED_KV: gl.constexpr = False):
    """Where work tile (query tile pid_m, batch * H_Q + head = bh) sits and which key tiles it
    visits: (batch, head, kv_head, start_m, len_q, len_kv, diag, t_lo, t_a, t_b, t_hi, n_tiles)
    (``_cta_tiles``; diag: the band's diagonal offset, len_kv - len_q under bottom-right)."""
    batch = bh // H_Q
    len_q = _packed_length(SEQ_Q, batch, S_Q, HAS_SEQ_Q, PACKED_Q)
    len_kv = _packed_length(SEQ_KV, batch, S_KV, HAS_SEQ_KV, PACKED_KV)
    return _fwd_tile_at(pid_m, bh, len_q, len_kv, H_Q, GROUP, win_left, win_right, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT,
                        HAS_SEQ_Q or HAS_SEQ_KV, BLOCK_M, BLOCK_N)


@gluon.jit
def _fwd_tile_at(pid_m, bh, len_q, len_kv, H_Q, GROUP, win_left, win_right, HAS_LEFT: gl.constexpr,
                 HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, PADDED: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """``_fwd_tile`` for a work tile whose sequence lengths are known already (the persistent grid's posted
    ones, ``_post_tile``)."""
    batch = bh // H_Q
    head = bh % H_Q
    kv_head = head // GROUP
    start_m = pid_m * BLOCK_M
    diag = len_q * 0
    if BOTTOM_RIGHT:
        diag = len_kv - len_q      # bottom-right: each sequence's own lengths
    t_lo, t_a, t_b, t_hi, n_tiles = _cta_tiles(start_m, len_q, len_kv, diag, win_left, win_right, HAS_LEFT,
                                               HAS_RIGHT, PADDED, BLOCK_M, BLOCK_N)
    return batch, head, kv_head, start_m, len_q, len_kv, diag, t_lo, t_a, t_b, t_hi, n_tiles


# ----------------------------------------------------------------------------------------------
# persistent grid (PERSISTENT; module docstring, [Note] persistent grid)

@gluon.jit
def _work_tile(tile, N_M, N_BH, HEAD_GROUP, REVERSE_M: gl.constexpr):
    """Work tile number -> (pid_m, bh) on the persistent grid. Tiles run in groups of HEAD_GROUP
    (batch, head) pairs (the last group may be smaller), each group's tiles one after the
    other; inside a group the query tile is the slow index (descending under REVERSE_M: the
    longest rows of a causal-like band first) and the head the fast one. Tiles that run at the
    same time then share a few heads' K/V in L2, and the short tiles come last."""
    per_group = HEAD_GROUP * N_M
    g = tile // per_group
    r = tile - g * per_group              # position inside the group
    bh0 = g * HEAD_GROUP
    size = gl.minimum(HEAD_GROUP, N_BH - bh0)
    m_idx = r // size
    bh = bh0 + (r - m_idx * size)
    pid_m = m_idx
    if REVERSE_M:
        pid_m = N_M - 1 - m_idx
    return pid_m, bh


@gluon.jit
def _next_tile(tile, COUNTER, total, DYNAMIC: gl.constexpr):
    """The producer's next work tile after ``tile`` (>= total: none left).

    Static: tile + nprog. Dynamic: the next ticket of the launch's tile counter (an int32 in
    global memory, 0 at launch): tiles nprog, nprog + 1, ... go to whichever CTA asks first, so
    a CTA that drew short tiles takes more of them (greedy, longest first). Each launch takes
    exactly ``total`` tickets (total - nprog tiles and one past the end per CTA), so the CTA that
    draws ticket total - 1, the launch's last, resets the counter to 0 for the next launch (the
    kernel boundary orders that store before the next launch's atomics)."""
    nprog = gl.num_programs(0)
    nxt = tile + nprog
    if DYNAMIC:
        # one lane of the (1-warp) producer takes the ticket; a warp reduction hands it to every lane
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        lane = gl.arange(0, 32, layout=lay)
        ptrs = COUNTER + lane * 0
        # relaxed: the counter publishes no data, it only has to hand out each ticket once
        old = gl.atomic_add(ptrs, gl.full([32], 1, gl.int32, lay), mask=lane == 0, sem="relaxed")
        ticket = gl.max(gl.where(lane == 0, old, 0), 0)
        gl.store(ptrs, gl.zeros([32], gl.int32, lay), mask=(lane == 0) & (ticket == total - 1))
        nxt = nprog + ticket
    return nxt


# what a work tile's slot holds (``_post_tile``): its number, then in padded builds (POSTED_FIELDS of them) its
# sequence's query and key lengths and the sequence's first row in the packed query view
TILE_NUMBER = gl.constexpr(0)
TILE_LEN_Q = gl.constexpr(1)
TILE_LEN_KV = gl.constexpr(2)
TILE_Q_OFF = gl.constexpr(3)
POSTED_FIELDS = gl.constexpr(4)


@gluon.jit
def _field_store(tile_smem, at, value):
    """One int32 into entry ``at`` of the work tiles' slots (``_post_tile``)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tile_smem.index(at).store(gl.full([1], value, gl.int32, lay))


@gluon.jit
def _post_tile(tile_smem, qs, FIELDS: gl.constexpr, tile, len_q=0, len_kv=0, q_off=0):
    """The producer writes the work tile number into Q slot qs's entry of ``tile_smem`` ([QSTAGES * FIELDS, 1]
    int32 shared memory); the consumers read it (``_take_tile``) after the Q ready barrier that the producer
    arrives on next (an mbarrier arrive releases the thread's earlier shared-memory stores). With FIELDS =
    POSTED_FIELDS (padded builds) the entry also holds the lengths and packed row the producer loaded for the
    tile (``_fwd_tile``), so the consumers and the V warp read them here instead of global memory, where each
    read put an L2 round trip on their path at every work tile's start and output (bench/NOTES.md 84)."""
    _field_store(tile_smem, qs * FIELDS + TILE_NUMBER, tile)
    if FIELDS > 1:
        _field_store(tile_smem, qs * FIELDS + TILE_LEN_Q, len_q)
        _field_store(tile_smem, qs * FIELDS + TILE_LEN_KV, len_kv)
        _field_store(tile_smem, qs * FIELDS + TILE_Q_OFF, q_off)


@gluon.jit
def _tile_field(tile_smem, qs, FIELDS: gl.constexpr, field: gl.constexpr):
    """Field ``field`` of Q slot qs's work tile entry (``_post_tile``), in every thread."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.sum(tile_smem.index(qs * FIELDS + field).load(lay), 0)


@gluon.jit
def _take_tile(tile_smem, qs, FIELDS: gl.constexpr, ready, phase):
    """A consumer's next work tile: wait for its Q ready barrier, then read the number the
    producer posted for Q slot qs (``_post_tile``)."""
    mbarrier.wait(ready, phase)
    return _tile_field(tile_smem, qs, FIELDS, TILE_NUMBER)


@gluon.jit
def _posted_tile(tile_smem, qs, FIELDS: gl.constexpr, pid_m, bh, SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, win_left,
                 win_right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
                 HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 PACKED_Q: gl.constexpr, PACKED_KV: gl.constexpr):
    """``_fwd_tile`` of the work tile (pid_m, bh) a consumer or the V warp took from Q slot qs: the lengths from
    the slot's entry, where the producer posted them (padded builds), else as ``_fwd_tile`` finds them."""
    if FIELDS > 1:
        res = _fwd_tile_at(pid_m, bh, _tile_field(tile_smem, qs, FIELDS, TILE_LEN_Q),
                           _tile_field(tile_smem, qs, FIELDS, TILE_LEN_KV), H_Q, GROUP, win_left, win_right,
                           HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, True, BLOCK_M, BLOCK_N)
    else:
        res = _fwd_tile(pid_m, bh, SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, win_left, win_right, HAS_LEFT, HAS_RIGHT,
                        BOTTOM_RIGHT, HAS_SEQ_Q, HAS_SEQ_KV, BLOCK_M, BLOCK_N, PACKED_Q, PACKED_KV)
    return res


@gluon.jit
def _kv_ring_loads_at(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, batch, kv_head, t_lo,
                      n_tiles, ring0, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, key0=0,
                      K_AHEAD: gl.constexpr = False):
    """The producers' K/V stream: K and V of key tile t_lo + j into ring slot (ring0 + j) % STAGES once
    the consumers freed it, K and V on separate ready/empty barriers. ring0: the tiles that went
    through the ring before (0 for a one-tile grid; the persistent grid's count so far). key0: the
    sequence's first row in the K / V views (packed keys, ``_packed_origin``). K_AHEAD (the forward): step
    j loads K of tile j, then V of tile j - 1, the order the forward's consumers use them in (QK^T of tile
    j before PV of tile j - 1), so K's slot wait does not queue behind V's, which frees later (after a PV
    rather than a QK^T); the dQ pass uses K and V of one tile together."""
    if K_AHEAD:
        for j in range(n_tiles + 1):
            if j < n_tiles:
                _k_tile_load(k_desc, k_smem, k_ready, k_empty, batch, kv_head, t_lo, j, ring0, key0, BLOCK_N, STAGES)
            if j > 0:
                _v_tile_load(v_desc, v_smem, v_ready, v_empty, batch, kv_head, t_lo, j - 1, ring0, key0, BLOCK_N,
                             STAGES)
    else:
        for j in range(n_tiles):
            _k_tile_load(k_desc, k_smem, k_ready, k_empty, batch, kv_head, t_lo, j, ring0, key0, BLOCK_N, STAGES)
            _v_tile_load(v_desc, v_smem, v_ready, v_empty, batch, kv_head, t_lo, j, ring0, key0, BLOCK_N, STAGES)


@gluon.jit
def _k_tile_load(k_desc, k_smem, k_ready, k_empty, batch, kv_head, t_lo, j, ring0, key0, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
    """K of key tile t_lo + j into ring slot (ring0 + j) % STAGES once the consumers freed it
    (``_kv_ring_loads_at``). The slot's empty barrier completes once per reuse; its first use waits on the
    parity of the phase before the barrier's first one, which counts as complete (no wait)."""
    it = ring0 + j
    slot = it % STAGES
    mbarrier.wait(k_empty.index(slot), ((it // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    tma_load(k_desc, [batch, kv_head, key0 + (t_lo + j) * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))


@gluon.jit
def _v_tile_load(v_desc, v_smem, v_ready, v_empty, batch, kv_head, t_lo, j, ring0, key0, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
    """V of key tile t_lo + j into ring slot (ring0 + j) % STAGES once the consumers freed it
    (``_kv_ring_loads_at``)."""
    it = ring0 + j
    slot = it % STAGES
    mbarrier.wait(v_empty.index(slot), ((it // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    if _is_fp8(v_desc.dtype):
        # FP8: V is stored transposed, [b, h_kv, d, s_kv] ([Note] FP8): the tile is [HEAD_D, BLOCK_N]
        tma_load(v_desc, [batch, kv_head, 0, (t_lo + j) * BLOCK_N], v_ready.index(slot), v_smem.index(slot))
    else:
        tma_load(v_desc, [batch, kv_head, key0 + (t_lo + j) * BLOCK_N, 0], v_ready.index(slot),
                 v_smem.index(slot))


@gluon.jit
def _paged_tile_loads(desc, ring_slot, ready, table_row, max_pages, key0, kv_head, PAGE: gl.constexpr,
                      BLOCK_N: gl.constexpr):
    """One K (or V) tile of BLOCK_N keys from key0 on, from a page of PAGE >= BLOCK_N keys: one TMA load
    of BLOCK_N rows (the descriptor's box) from inside the page the table names, completing on
    ``ready``. A page index past the table (the last tile's keys beyond the cache) is clamped to the
    table's last entry: those keys are masked (or their rows zeroed, padded). Smaller pages:
    ``_paged_tile_gather``."""
    mbarrier.expect(ready, desc.block_type.nbytes)
    page = gl.load(table_row + gl.minimum(key0 // PAGE, max_pages - 1))
    # coordinates are [block, head, row in the page, column] of the paged container's 4-D view
    tma_load(desc, [page, kv_head, key0 % PAGE, 0], ready, ring_slot)


@gluon.jit
def _page_entries(row_k, row_v, tile_k, tile_v, valid_k, valid_v, max_pages, ENTRIES: gl.constexpr):
    """The page-table entries of K's key tile ``tile_k`` and V's key tile ``tile_v`` (ENTRIES pages of
    BLOCK_N / ENTRIES keys each), one per lane of the load warp: lane c < ENTRIES holds K's c-th page,
    lane ENTRIES + c V's; one load, no entry waits on another. An index past the table is clamped to its
    last entry (as ``_paged_tile_loads``). A side not valid (``valid_k``, ``valid_v``) reads nothing (0)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lay)
    is_v = lane >= ENTRIES
    idx = gl.minimum(gl.where(is_v, tile_v * ENTRIES + lane - ENTRIES, tile_k * ENTRIES + lane), max_pages - 1)
    valid = gl.where(is_v, valid_v, valid_k) & (lane < 2 * ENTRIES)
    return gl.load(gl.where(is_v, row_v, row_k) + idx, mask=valid, other=0)


@gluon.jit
def _lane_value(entries, lane):
    """Lane ``lane`` of the load warp's ``entries`` (``_page_entries``) as a scalar: a 32-lane integer
    sum with one nonzero term, one redux.sync whose result lands in the uniform registers that the
    TMA copy takes its coordinates from (0 for a lane >= 32)."""
    lanes = gl.arange(0, 32, layout=entries.type.layout)
    return gl.sum(gl.where(lanes == lane, entries, 0), 0)


@gluon.jit
def _paged_tile_gather(desc, ring, slot, ready, entries, lane0, page, max_pages, kv_head, BLOCK_N: gl.constexpr):
    """One K (or V) tile of BLOCK_N keys from pages of BOX < BLOCK_N keys (the descriptor's box rows):
    page c (of BLOCK_N / BOX) is lane lane0 + c of ``entries`` (``page``: lane0's, extracted already)
    and lands in rows [c * BOX, (c + 1) * BOX) of ring slot ``slot``, all copies completing on ``ready``.

    The descriptor's box is one 64-column block of a page ([1, 1, BOX, 64], the widest box of the
    128-byte swizzle; the compiler splits a wider one into such copies anyway), so that a copy's
    destination is a whole block of the ring ([BOX, 64] elements in a row: the ring's layout keeps a
    slot's 64-column blocks of BLOCK_N rows one after another), which ``index`` reaches with a run-time
    page number. So the pages are a loop, of a run-time count: unrolled (static slices), ptxas issued
    every page's lane extraction and copy set-up up front and spilled the load warp's 24 registers.
    Four copies per iteration (two pages below d=256), each page's extraction issued one page ahead,
    under the copies before it. The loop counts lanes, not pages: counting pages, LLVM kept a lane
    constant per compare live across the tile loop, which spilled (Triton 3.9; 3.6's persistent grid)."""
    BOX: gl.constexpr = desc.block_type.shape[2]
    COLS: gl.constexpr = desc.block_type.shape[3]
    STAGES: gl.constexpr = ring.shape[0]
    PAGES: gl.constexpr = BLOCK_N // BOX      # a power of two >= 2
    BLOCKS: gl.constexpr = ring.shape[4] // COLS
    U: gl.constexpr = 2 if BLOCKS <= 2 else 1          # pages per iteration
    boxes = smem_reinterpret(ring, ring.dtype, [STAGES * BLOCKS * PAGES, 1, 1, BOX, COLS], ring.layout)
    mbarrier.expect(ready, desc.block_type.nbytes * (BLOCKS * PAGES))
    # the page count as a run-time value (max_pages >= 1): LLVM unrolls a loop of a known count
    n_pages = U * gl.minimum(max_pages + PAGES // U, PAGES // U)
    for lane in range(lane0, lane0 + n_pages, U):
        for u in gl.static_range(U):
            c = lane - lane0 + u
            # the next page's (past the last page: another lane's or 0, unused)
            nxt = _lane_value(entries, lane + u + 1)
            for h in gl.static_range(BLOCKS):
                # coordinates are [block, head, row in the page, column] of the paged container's 4-D view
                tma_load(desc, [page, kv_head, 0, h * COLS], ready, boxes.index((slot * BLOCKS + h) * PAGES + c))
            page = nxt


@gluon.jit
def _kv_ring_loads_paged_at(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, batch, kv_head, t_lo,
                            n_tiles, ring0, pages, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            LOAD_K: gl.constexpr = True, LOAD_V: gl.constexpr = True):
    """``_kv_ring_loads_at`` over a paged K/V cache (module docstring, [Note] paged K/V): key tile
    t_lo + j of sequence ``batch`` is read through the page tables ``pages`` = (PT_K, PT_V, stride_ptk,
    stride_ptv, MAX_PAGES): int32 [b, MAX_PAGES] rows of block indices into the containers.

    Step j copies K of tile j, then V of tile j - 1 (the order of the consumers' QK^T and PV). Pages
    smaller than a tile: a step's table entries, K's and V's, arrive in one load issued a step ahead
    (``_page_entries``; it completes under the step's slot waits and copies), so no copy waits for a
    table read. Pages of a tile or more: one table read per tile (``_paged_tile_loads``). LOAD_K / LOAD_V: which
    of the two this warp copies (the V warp of [Note] paged K/V's split load: one each)."""
    PT_K, PT_V, stride_ptk, stride_ptv, MAX_PAGES = pages
    row_k = PT_K + batch.to(gl.int64) * stride_ptk
    row_v = PT_V + batch.to(gl.int64) * stride_ptv
    # K of tile j does not queue behind V of tile j - 1's copies (16 per tile at pages of 16)
    if PAGE < BLOCK_N:
        PAGES: gl.constexpr = BLOCK_N // PAGE
        # the entries step j copies with (K's of tile j, V's of tile j - 1), loaded one step ahead
        ahead = _page_entries(row_k, row_v, t_lo, t_lo, (n_tiles > 0) & LOAD_K, False, MAX_PAGES, PAGES)
        for j in range(n_tiles + 1):
            entries = ahead
            ahead = _page_entries(row_k, row_v, t_lo + j + 1, t_lo + j, (j + 1 < n_tiles) & LOAD_K,
                                  (j < n_tiles) & LOAD_V, MAX_PAGES, PAGES)
            if LOAD_K and j < n_tiles:
                it = ring0 + j
                slot = it % STAGES
                page = _lane_value(entries, 0)
                mbarrier.wait(k_empty.index(slot), ((it // STAGES) & 1) ^ 1)     # as _kv_ring_loads_at
                _paged_tile_gather(k_desc, k_smem, slot, k_ready.index(slot), entries, 0, page, MAX_PAGES,
                                   kv_head, BLOCK_N)
            if LOAD_V and j > 0:
                it = ring0 + j - 1
                slot = it % STAGES
                page = _lane_value(entries, PAGES)
                mbarrier.wait(v_empty.index(slot), ((it // STAGES) & 1) ^ 1)
                _paged_tile_gather(v_desc, v_smem, slot, v_ready.index(slot), entries, PAGES, page, MAX_PAGES,
                                   kv_head, BLOCK_N)
    else:
        for j in range(n_tiles + 1):
            if LOAD_K and j < n_tiles:
                it = ring0 + j
                slot = it % STAGES
                mbarrier.wait(k_empty.index(slot), ((it // STAGES) & 1) ^ 1)     # as _kv_ring_loads_at
                _paged_tile_loads(k_desc, k_smem.index(slot), k_ready.index(slot), row_k, MAX_PAGES,
                                  (t_lo + j) * BLOCK_N, kv_head, PAGE, BLOCK_N)
            if LOAD_V and j > 0:
                it = ring0 + j - 1
                slot = it % STAGES
                mbarrier.wait(v_empty.index(slot), ((it // STAGES) & 1) ^ 1)
                _paged_tile_loads(v_desc, v_smem.index(slot), v_ready.index(slot), row_v, MAX_PAGES,
                                  (t_lo + j - 1) * BLOCK_N, kv_head, PAGE, BLOCK_N)


@gluon.jit
def _fwd_producer_persistent(q_desc, k_desc, v_desc, q_smem0, q_smem1, tile_smem, k_smem, v_smem, q_ready0,
                             q_ready1, q_empty, k_ready, k_empty, v_ready, v_empty, COUNTER, SEQ_Q, SEQ_KV, H_Q,
                             GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, win_left, win_right, pages,
                             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
                             REVERSE_M: gl.constexpr, HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QSTAGES: gl.constexpr,
                             DYNAMIC: gl.constexpr, PAGE: gl.constexpr, PACKED_Q: gl.constexpr = False,
                             PACKED_KV: gl.constexpr = False, V_WARP: gl.constexpr = False):
    """Load warp of the persistent grid (V_WARP: V's copies are another warp's, ``_fwd_v_loader_persistent``).
    For each work tile (i-th of this CTA): wait until Q slot
    i % QSTAGES is free (both consumers' q_empty), post the tile number there, load the two Q
    halves onto q_ready0 / q_ready1 (or, for a tile with nothing to load, arrive on them
    without data), then stream its K/V tiles through the ring, whose count continues across
    work tiles. After the last tile it posts a number >= total, which ends the consumers."""
    WG_M: gl.constexpr = q_desc.block_type.shape[2]
    K_AHEAD: gl.constexpr = k_desc.block_type.shape[3] > K_AHEAD_ABOVE_D
    BLOCK_M: gl.constexpr = 2 * WG_M
    FIELDS: gl.constexpr = tile_smem.shape[0] // QSTAGES
    total = N_M * N_BH
    tile = gl.program_id(0)
    i = 0
    ring = 0
    while tile < total:
        pid_m, bh = _work_tile(tile, N_M, N_BH, HEAD_GROUP, REVERSE_M)
        batch, head, kv_head, start_m, len_q, len_kv, diag, t_lo, t_a, t_b, t_hi, n_tiles = _fwd_tile(
            pid_m, bh, SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, win_left, win_right, HAS_LEFT, HAS_RIGHT,
            BOTTOM_RIGHT, HAS_SEQ_Q, HAS_SEQ_KV, BLOCK_M, BLOCK_N, PACKED_Q, PACKED_KV)
        q_batch, q_off = _packed_origin(SEQ_Q, batch, PACKED_Q)
        kv_batch, k_off = _packed_origin(SEQ_KV, batch, PACKED_KV)
        qs = i % QSTAGES
        mbarrier.wait(q_empty.index(qs), ((i // QSTAGES) & 1) ^ 1)
        _post_tile(tile_smem, qs, FIELDS, tile, len_q, len_kv, q_off)
        if n_tiles > 0:
            # coordinates are [batch, head, row, column] of the 4-D views
            mbarrier.expect(q_ready0.index(qs), q_desc.block_type.nbytes)
            tma_load(q_desc, [q_batch, head, q_off + start_m, 0], q_ready0.index(qs), q_smem0.index(qs))
            mbarrier.expect(q_ready1.index(qs), q_desc.block_type.nbytes)
            tma_load(q_desc, [q_batch, head, q_off + start_m + WG_M, 0], q_ready1.index(qs), q_smem1.index(qs))
        else:
            mbarrier.arrive(q_ready0.index(qs))
            mbarrier.arrive(q_ready1.index(qs))
        if PAGE > 0:
            _kv_ring_loads_paged_at(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, batch,
                                    kv_head, t_lo, n_tiles, ring, pages, PAGE, BLOCK_N, STAGES, True, not V_WARP)
        else:
            _kv_ring_loads_at(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, kv_batch, kv_head,
                              t_lo, n_tiles, ring, BLOCK_N, STAGES, k_off, K_AHEAD)
        ring += n_tiles
        i += 1
        tile = _next_tile(tile, COUNTER, total, DYNAMIC)
    # the end: a tile number past the last tells both consumers to stop
    qs = i % QSTAGES
    mbarrier.wait(q_empty.index(qs), ((i // QSTAGES) & 1) ^ 1)
    _post_tile(tile_smem, qs, FIELDS, total)
    mbarrier.arrive(q_ready0.index(qs))
    mbarrier.arrive(q_ready1.index(qs))


@gluon.jit
def _fwd_v_loader_persistent(k_desc, v_desc, k_smem, v_smem, tile_smem, q_ready0, k_ready, k_empty, v_ready, v_empty,
                             SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, win_left, win_right, pages,
                             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
                             REVERSE_M: gl.constexpr, HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QSTAGES: gl.constexpr,
                             PAGE: gl.constexpr, BLOCK_M: gl.constexpr, PACKED_Q: gl.constexpr = False):
    """V's load warp of the persistent grid over pages smaller than a tile ([Note] paged K/V, split load): it
    follows the work tiles as a consumer does (the number the producer posts in each Q slot, on warpgroup 0's
    Q ready barrier) and copies V's tiles of each into the ring, while the producer copies Q and K. A slot's
    number is read before the consumers can finish that tile (they need its V), so before the producer
    posts another there."""
    FIELDS: gl.constexpr = tile_smem.shape[0] // QSTAGES
    total = N_M * N_BH
    i = 0
    ring = 0
    tile = _take_tile(tile_smem, 0, FIELDS, q_ready0.index(0), 0)
    while tile < total:
        pid_m, bh = _work_tile(tile, N_M, N_BH, HEAD_GROUP, REVERSE_M)
        batch, head, kv_head, start_m, len_q, len_kv, diag, t_lo, t_a, t_b, t_hi, n_tiles = _posted_tile(
            tile_smem, i % QSTAGES, FIELDS, pid_m, bh, SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, win_left, win_right,
            HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, HAS_SEQ_Q, HAS_SEQ_KV, BLOCK_M, BLOCK_N, PACKED_Q, False)
        _kv_ring_loads_paged_at(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, batch, kv_head,
                                t_lo, n_tiles, ring, pages, PAGE, BLOCK_N, STAGES, False, True)
        ring += n_tiles
        i += 1
        tile = _take_tile(tile_smem, i % QSTAGES, FIELDS, q_ready0.index(i % QSTAGES), (i // QSTAGES) & 1)


@gluon.jit
def _fwd_consumer_persistent(WG: gl.constexpr, q_smem, tile_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                             k_empty, v_ready, v_empty, turn, o_desc, LSE, stride_lb, stride_lh, stride_lm, SLOPES, stride_sb,
                             SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, qk_scale, win_left,
                             win_right, DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE, SINK,
                             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                             BOTTOM_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, WRITE_LSE: gl.constexpr,
                             REVERSE_M: gl.constexpr, HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr,
                             DROPOUT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                             QSTAGES: gl.constexpr, PINGPONG: gl.constexpr, HAS_SINK: gl.constexpr,
                             scale_s=1.0, fp8_out=None, PROMOTE: gl.constexpr = 32, PACKED_Q: gl.constexpr = False,
                             PACKED_KV: gl.constexpr = False, FP8_EMU: gl.constexpr = 0,
                             FP8_HEAD_SCALES: gl.constexpr = False, P_F32: gl.constexpr = False,
                             STATS_SMEM: gl.constexpr = False):
    """Consumer warpgroup WG of the persistent grid: work tiles as the producer posts them (the
    i-th in Q slot i % QSTAGES of q_smem [QSTAGES, 1, 1, 64, HEAD_D]), each one as on the
    one-tile grid (``_fwd_attend``, ``_fwd_write``), the O epilogue staged in the tile's own Q
    slot. The Q slot goes back to the producer (q_empty) once the output store has read it:
    with 2 slots during the next tile (after its first QK^T), so that tile's successor's Q
    loads under it; with 1 slot right after the store (the next Q load then waits for it). FP8 (q_smem's
    type; [Note] FP8): scale_s, fp8_out, PROMOTE and FP8_HEAD_SCALES as ``_fwd_consumer``'s; the output goes
    out from registers, so the slot holds nothing for it."""
    WG_M: gl.constexpr = q_smem.shape[3]
    HEAD_D: gl.constexpr = q_smem.shape[4]
    BLOCK_M: gl.constexpr = 2 * WG_M
    PADDED: gl.constexpr = HAS_SEQ_Q or HAS_SEQ_KV
    FIELDS: gl.constexpr = tile_smem.shape[0] // QSTAGES
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, _mma_k(q_smem.dtype)])
    total = N_M * N_BH
    pin = gl.allocate_shared_memory(gl.float32, [2 * WG_M if STATS_SMEM else WG_M],
                                    gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bias = _alibi_operands(q_smem.dtype, WG_M, BLOCK_N, _alibi_by_mma(HAS_ALIBI, q_smem.dtype))
    i = 0          # work tiles done by this CTA
    ring = 0       # K/V tiles consumed so far (the ring's count)
    steps = 0      # ping-pong turns taken so far (one per key tile after each work tile's first)
    tile = _take_tile(tile_smem, 0, FIELDS, q_ready.index(0), 0)
    while tile < total:
        qs = i % QSTAGES
        pid_m, bh = _work_tile(tile, N_M, N_BH, HEAD_GROUP, REVERSE_M)
        batch, head, kv_head, start_m, len_q, len_kv, diag, t_lo, t_a, t_b, t_hi, n_tiles = _posted_tile(
            tile_smem, qs, FIELDS, pid_m, bh, SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, win_left, win_right, HAS_LEFT,
            HAS_RIGHT, BOTTOM_RIGHT, HAS_SEQ_Q, HAS_SEQ_KV, BLOCK_M, BLOCK_N, PACKED_Q, PACKED_KV)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = _alibi_slope2(SLOPES, batch, head, stride_sb)
        row0 = start_m + WG * WG_M
        rows = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
        drop = 0
        if DROPOUT:
            drop = dropout.state(DROP_SEED, DROP_OFFSET, bh, S_Q, S_KV, DROP_THRESHOLD, DROP_RESCALE)
        stage = q_smem.index(qs)
        # with 2 Q slots, the previous tile's slot is released during this one (_fwd_attend)
        prev_free = q_empty.index((i + QSTAGES - 1) % QSTAGES)
        qk_tile = qk_scale
        descale_v = 1.0
        if FP8_HEAD_SCALES:
            qk_tile, descale_v = _head_descales(qk_scale, fp8_out, head)
        o, m_i, l_i = _fwd_attend(WG, stage.reshape([WG_M, HEAD_D]), None, k_smem, v_smem, k_ready, k_empty,
                                  v_ready, v_empty, turn, pin, bias, ring, steps, prev_free, (QSTAGES == 2) & (i > 0),
                                  rows, row0, t_lo, t_a, t_b, t_hi, n_tiles, len_kv, diag, win_left, win_right,
                                  slope2, qk_tile, drop, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, PADDED, HAS_SEQ_KV,
                                  DROPOUT, BLOCK_N, STAGES, PINGPONG, scale_s, PROMOTE, FP8_EMU, P_F32, STATS_SMEM)
        if FP8_HEAD_SCALES:
            o = o * descale_v
        if PADDED:
            if (QSTAGES == 2) & (i > 0) & (n_tiles == 0):
                # an empty tile ran no QK^T, so _fwd_attend released nothing
                tma.store_wait(0)
                mbarrier.arrive(prev_free)
        # the epilogue's coordinates are worked out again from the tile number, which is still in
        # its slot (the producer rewrites it only after this tile's Q slot is released): a
        # shared-memory read is not merged with the first, so none of them stays live across the
        # loops above (module docstring, [Note] persistent grid: register pressure)
        tile = _tile_field(tile_smem, qs, FIELDS, TILE_NUMBER)
        pid_m, bh = _work_tile(tile, N_M, N_BH, HEAD_GROUP, REVERSE_M)
        batch = bh // H_Q
        head = bh % H_Q
        row0 = pid_m * BLOCK_M + WG * WG_M
        rows = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
        if HAS_ALIBI:
            slope2 = _alibi_slope2(SLOPES, batch, head, stride_sb)
        if PADDED:
            # posted by the producer (_post_tile): no global round trip before the output goes out
            len_q = _tile_field(tile_smem, qs, FIELDS, TILE_LEN_Q)
            q_batch = batch
            q_off = batch * 0
            if PACKED_Q:
                q_batch = batch * 0
                q_off = _tile_field(tile_smem, qs, FIELDS, TILE_Q_OFF)
        else:
            len_q = _packed_length(SEQ_Q, batch, S_Q, HAS_SEQ_Q, PACKED_Q)
            q_batch, q_off = _packed_origin(SEQ_Q, batch, PACKED_Q)
        _fwd_write(o, m_i, l_i, rows, row0, stage, o_desc, LSE, stride_lb, stride_lh, stride_lm, q_batch, head, S_Q,
                   len_q, slope2, drop, SINK, HAS_ALIBI, WRITE_LSE, HAS_SEQ_Q, DROPOUT, HAS_SINK, fp8_out, q_off,
                   PACKED_Q, FP8_EMU)
        if QSTAGES == 1:
            # the only Q slot holds this output until the store has read it
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(0))
        ring += n_tiles
        if PINGPONG:
            steps += gl.maximum(n_tiles - 1, 0)
        i += 1
        tile = _take_tile(tile_smem, i % QSTAGES, FIELDS, q_ready.index(i % QSTAGES), (i // QSTAGES) & 1)
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_sm90(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, stride_lm, SLOPES, stride_sb, SEQ_Q, SEQ_KV,
                   H_Q, GROUP, S_Q, S_KV, qk_scale, win_left, win_right, COUNTER, N_M, N_BH, HEAD_GROUP,
                   DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE, SINK, PT_K, PT_V, stride_ptk, stride_ptv,
                   MAX_PAGES, O, stride_ob, stride_oh, stride_om, D_O, SCALES, AMAX, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   BOTTOM_RIGHT: gl.constexpr, HAS_ALIBI: gl.constexpr, WRITE_LSE: gl.constexpr,
                   REVERSE_M: gl.constexpr, HAS_SEQ_Q: gl.constexpr, HAS_SEQ_KV: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
                   PERSISTENT: gl.constexpr = False, DYNAMIC: gl.constexpr = True, QSTAGES: gl.constexpr = 2,
                   DROPOUT: gl.constexpr = False, HAS_SINK: gl.constexpr = False, PAGE: gl.constexpr = 0,
                   PROMOTE: gl.constexpr = 32, PACKED_Q: gl.constexpr = False, PACKED_KV: gl.constexpr = False,
                   V_WARP: gl.constexpr = False, FP8_EMU: gl.constexpr = 0, DESCALE_Q=None, DESCALE_K=None,
                   DESCALE_V=None, FP8_HEAD_SCALES: gl.constexpr = False):
    """The forward kernel (module docstring). One-tile grid (PERSISTENT False): grid
    (N_M, b * H_Q), program (pid_m, bh) owns one work tile. Persistent grid: grid (nprog,) with
    nprog <= N_M * N_BH, the work tiles (``_work_tile``'s order) handed out statically (tile +
    nprog) or, DYNAMIC, from the tile counter COUNTER (int32, 0 at launch, left 0); QSTAGES Q
    slots per consumer warpgroup (1 or 2). COUNTER, N_M, N_BH and HEAD_GROUP are unused by the
    one-tile grid. DROPOUT: Philox seed and counter offset (int64), threshold p * 2^16 and
    1 / (1 - p) (``dropout.py``); unused otherwise. HAS_SINK: SINK holds fp32 [H_Q] sink logits
    (module docstring, [Note] sinks); unused otherwise. PAGE > 0: k_desc / v_desc view paged containers
    [blocks, H_KV, PAGE, d] and PT_K / PT_V are int32 [b, MAX_PAGES] page tables (batch strides
    stride_ptk / stride_ptv; module docstring, [Note] paged K/V); unused otherwise.
    FP8 (q_desc's type is an 8-bit float; module docstring, [Note] FP8): v_desc views V transposed
    [b, H_KV, d, S_KV]; O (any type, strides stride_ob / oh / om, unit last; D_O columns) is written by
    plain stores, o_desc unused; SCALES fp32 [6] (descale_q, descale_k, descale_v, descale_s, scale_s,
    scale_o) and AMAX fp32 [2] (amax_s, amax_o; zeroed by the host) are read / maxed into; unused otherwise.
    PACKED_Q (16-bit, with HAS_SEQ_Q; module docstring, [Note] packed queries): SEQ_Q is cu_seqlens_q (int32
    [b + 1]), q_desc / o_desc view packed rows [1, H_Q, total, d] and LSE [1, H_Q, total], S_Q is the longest
    sequence; O (the packed output), stride_ob = total, stride_oh, stride_om and D_O serve the masked stores of
    each sequence's last tile (``_store_rows``). PACKED_KV (16-bit, with HAS_SEQ_KV, not paged): SEQ_KV is
    cu_seqlens_kv and k_desc / v_desc view packed keys [1, H_KV, total_k, d], S_KV the longest sequence.
    V_WARP (persistent grid, 0 < PAGE < BLOCK_N): V's copies come from a second load warp ([Note] paged K/V)."""
    WG_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = 2 * WG_M
    dtype: gl.constexpr = q_desc.dtype
    PADDED: gl.constexpr = HAS_SEQ_Q or HAS_SEQ_KV
    FP8: gl.constexpr = _is_fp8(dtype)
    # FP8_EMU: FP8 values in 16-bit descriptors, the FP8 semantics on 16-bit MMAs ([Note] FP8 on 16-bit MMAs)
    FP8_SEM: gl.constexpr = _fp8_semantics(dtype, FP8_EMU)
    pages = (PT_K, PT_V, stride_ptk, stride_ptv, MAX_PAGES)
    P_F32: gl.constexpr = (PAGED_P_F32 and PAGE > 0) or (DENSE_P_F32 and HEAD_D == 128 and not (
        HAS_LEFT or HAS_RIGHT or HAS_ALIBI or DROPOUT))
    STATS_SMEM: gl.constexpr = PAGED_STATS_SMEM and PAGE > 0
    if FP8_SEM:
        gl.static_assert(not (HAS_ALIBI or DROPOUT or HAS_SINK or PAGE > 0 or PACKED_Q),
                         "the FP8 forward runs masks, padding and GQA only")
    if PACKED_Q:
        gl.static_assert(HAS_SEQ_Q and not DROPOUT, "packed queries: HAS_SEQ_Q on, no dropout")
    if PACKED_KV:
        gl.static_assert(HAS_SEQ_KV and not DROPOUT and PAGE == 0 and not FP8, "packed keys: HAS_SEQ_KV on, "
                         "no dropout, not paged, 16-bit")
    scale_s = 1.0
    # the FP8 epilogue's arguments (unused by the 16-bit kernel: _fwd_write decides by the type)
    # FP8_HEAD_SCALES ([Note] FP8, per-head descales): descale_q per query head, descale_k / descale_v per kv head;
    # SCALES then holds 1 in their places
    heads = (SCALES, SCALES, SCALES, GROUP)
    if FP8_HEAD_SCALES:
        heads = (DESCALE_Q, DESCALE_K, DESCALE_V, GROUP)
    fp8_out = (O, stride_ob, stride_oh, stride_om, D_O, SCALES, AMAX, heads)
    if FP8_SEM:
        # cuDNN's bmm1 scale chain folded into the one score multiply (scale * log2 e * descales), in the
        # portable kernel's order; scale_s quantizes P (read here, so a CUDA graph replays new values)
        qk_scale = qk_scale * gl.load(SCALES) * gl.load(SCALES + 1)
        scale_s = gl.load(SCALES + 4)

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    if _is_fp8(v_desc.dtype):
        # V transposed (keys innermost): FP8 wgmmas read both operands K-major ([Note] FP8)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, 1, HEAD_D, BLOCK_N], v_desc.layout)
    else:
        # (FP8 QK^T with FP8_EMU: V widened to fp16, [Note] FP8 on 16-bit MMAs)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # one arrival from each consumer warpgroup frees a slot
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)

    if PERSISTENT:
        # per consumer warpgroup a ring of QSTAGES Q halves (each also stages its tile's output),
        # the work tile number of each slot, and the slots' ready (per warpgroup) / empty barriers
        q_smem0 = gl.allocate_shared_memory(dtype, [QSTAGES, 1, 1, WG_M, HEAD_D], q_desc.layout)
        q_smem1 = gl.allocate_shared_memory(dtype, [QSTAGES, 1, 1, WG_M, HEAD_D], q_desc.layout)
        # (one int32 entry per field and Q slot: [QSTAGES * fields, 1], _post_tile)
        fields: gl.constexpr = POSTED_FIELDS if HAS_SEQ_Q or HAS_SEQ_KV else 1
        tile_smem = gl.allocate_shared_memory(gl.int32, [QSTAGES * fields, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        q_ready0 = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
        q_ready1 = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QSTAGES):
            mbarrier.init(q_ready0.index(i), count=1)
            mbarrier.init(q_ready1.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        if V_WARP:
            gl.warp_specialize([
                (_fwd_consumer_persistent, (0, q_smem0, tile_smem, k_smem, v_smem, q_ready0, q_empty, k_ready, k_empty,
                                            v_ready, v_empty, turn, o_desc, LSE, stride_lb, stride_lh, stride_lm, SLOPES, stride_sb,
                                            SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, qk_scale,
                                            win_left, win_right, DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE,
                                            SINK, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, HAS_ALIBI, WRITE_LSE, REVERSE_M,
                                            HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT, BLOCK_N, STAGES, QSTAGES, PINGPONG,
                                            HAS_SINK, scale_s, fp8_out, PROMOTE, PACKED_Q, PACKED_KV,
                                            FP8_EMU, FP8_HEAD_SCALES, P_F32, STATS_SMEM)),
                (_fwd_consumer_persistent, (1, q_smem1, tile_smem, k_smem, v_smem, q_ready1, q_empty, k_ready, k_empty,
                                            v_ready, v_empty, turn, o_desc, LSE, stride_lb, stride_lh, stride_lm, SLOPES, stride_sb,
                                            SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, qk_scale,
                                            win_left, win_right, DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE,
                                            SINK, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, HAS_ALIBI, WRITE_LSE, REVERSE_M,
                                            HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT, BLOCK_N, STAGES, QSTAGES, PINGPONG,
                                            HAS_SINK, scale_s, fp8_out, PROMOTE, PACKED_Q, PACKED_KV,
                                            FP8_EMU, FP8_HEAD_SCALES, P_F32, STATS_SMEM)),
                (_fwd_producer_persistent, (q_desc, k_desc, v_desc, q_smem0, q_smem1, tile_smem, k_smem, v_smem, q_ready0,
                                            q_ready1, q_empty, k_ready, k_empty, v_ready, v_empty, COUNTER, SEQ_Q, SEQ_KV,
                                            H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, win_left, win_right, pages,
                                            HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, REVERSE_M, HAS_SEQ_Q, HAS_SEQ_KV, BLOCK_N,
                                            STAGES, QSTAGES, DYNAMIC, PAGE, PACKED_Q, PACKED_KV, V_WARP)),
                (_fwd_v_loader_persistent, (k_desc, v_desc, k_smem, v_smem, tile_smem, q_ready0, k_ready, k_empty, v_ready,
                                            v_empty, SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP,
                                            win_left, win_right, pages, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, REVERSE_M,
                                            HAS_SEQ_Q, HAS_SEQ_KV, BLOCK_N, STAGES, QSTAGES, PAGE, BLOCK_M, PACKED_Q)),
            ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_fwd_consumer_persistent, (0, q_smem0, tile_smem, k_smem, v_smem, q_ready0, q_empty, k_ready, k_empty,
                                            v_ready, v_empty, turn, o_desc, LSE, stride_lb, stride_lh, stride_lm, SLOPES, stride_sb,
                                            SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, qk_scale,
                                            win_left, win_right, DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE,
                                            SINK, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, HAS_ALIBI, WRITE_LSE, REVERSE_M,
                                            HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT, BLOCK_N, STAGES, QSTAGES, PINGPONG,
                                            HAS_SINK, scale_s, fp8_out, PROMOTE, PACKED_Q, PACKED_KV,
                                            FP8_EMU, FP8_HEAD_SCALES, P_F32, STATS_SMEM)),
                (_fwd_consumer_persistent, (1, q_smem1, tile_smem, k_smem, v_smem, q_ready1, q_empty, k_ready, k_empty,
                                            v_ready, v_empty, turn, o_desc, LSE, stride_lb, stride_lh, stride_lm, SLOPES, stride_sb,
                                            SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, qk_scale,
                                            win_left, win_right, DROP_SEED, DROP_OFFSET, DROP_THRESHOLD, DROP_RESCALE,
                                            SINK, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, HAS_ALIBI, WRITE_LSE, REVERSE_M,
                                            HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT, BLOCK_N, STAGES, QSTAGES, PINGPONG,
                                            HAS_SINK, scale_s, fp8_out, PROMOTE, PACKED_Q, PACKED_KV,
                                            FP8_EMU, FP8_HEAD_SCALES, P_F32, STATS_SMEM)),
                (_fwd_producer_persistent, (q_desc, k_desc, v_desc, q_smem0, q_smem1, tile_smem, k_smem, v_smem, q_ready0,
                                            q_ready1, q_empty, k_ready, k_empty, v_ready, v_empty, COUNTER, SEQ_Q, SEQ_KV,
                                            H_Q, GROUP, S_Q, S_KV, N_M, N_BH, HEAD_GROUP, win_left, win_right, pages,
                                            HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, REVERSE_M, HAS_SEQ_Q, HAS_SEQ_KV, BLOCK_N,
                                            STAGES, QSTAGES, DYNAMIC, PAGE, PACKED_Q, PACKED_KV, V_WARP)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        if REVERSE_M:
            # causal: the longest rows (last tiles) start first, so the tail of the grid is short
            pid_m = gl.num_programs(0) - 1 - pid_m
        batch, head, kv_head, start_m, len_q, len_kv, diag, t_lo, t_a, t_b, t_hi, n_tiles = _fwd_tile(
            pid_m, bh, SEQ_Q, SEQ_KV, H_Q, GROUP, S_Q, S_KV, win_left, win_right, HAS_LEFT, HAS_RIGHT,
            BOTTOM_RIGHT, HAS_SEQ_Q, HAS_SEQ_KV, BLOCK_M, BLOCK_N, PACKED_Q, PACKED_KV)
        q_batch, q_off = _packed_origin(SEQ_Q, batch, PACKED_Q)
        kv_batch, k_off = _packed_origin(SEQ_KV, batch, PACKED_KV)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = _alibi_slope2(SLOPES, batch, head, stride_sb)
        drop = 0
        if DROPOUT:
            drop = dropout.state(DROP_SEED, DROP_OFFSET, bh, S_Q, S_KV, DROP_THRESHOLD, DROP_RESCALE)

        q_smem0 = gl.allocate_shared_memory(dtype, [1, 1, WG_M, HEAD_D], q_desc.layout)
        q_smem1 = gl.allocate_shared_memory(dtype, [1, 1, WG_M, HEAD_D], q_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar.index(0), count=1)
        mbarrier.init(q_bar.index(1), count=1)

        gl.warp_specialize([
            # consumer warpgroup 0 (the default partition, warps 0-3), consumer warpgroup 1 (warps 4-7)
            (_fwd_consumer, (0, q_smem0, k_smem, v_smem, q_bar.index(0), k_ready, k_empty, v_ready, v_empty, turn,
                             o_desc, LSE, stride_lb, stride_lh, stride_lm, q_batch, head, start_m, t_lo, t_a, t_b,
                             t_hi, n_tiles, S_Q, len_q, len_kv, diag, win_left, win_right, slope2, qk_scale, drop,
                             SINK, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, WRITE_LSE, HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT,
                             BLOCK_N, STAGES, PINGPONG, HAS_SINK, scale_s, fp8_out, PROMOTE, q_off, PACKED_Q,
                             FP8_EMU, FP8_HEAD_SCALES, P_F32, STATS_SMEM)),
            (_fwd_consumer, (1, q_smem1, k_smem, v_smem, q_bar.index(1), k_ready, k_empty, v_ready, v_empty, turn,
                             o_desc, LSE, stride_lb, stride_lh, stride_lm, q_batch, head, start_m, t_lo, t_a, t_b,
                             t_hi, n_tiles, S_Q, len_q, len_kv, diag, win_left, win_right, slope2, qk_scale, drop,
                             SINK, HAS_LEFT, HAS_RIGHT, HAS_ALIBI, WRITE_LSE, HAS_SEQ_Q, HAS_SEQ_KV, DROPOUT,
                             BLOCK_N, STAGES, PINGPONG, HAS_SINK, scale_s, fp8_out, PROMOTE, q_off, PACKED_Q,
                             FP8_EMU, FP8_HEAD_SCALES, P_F32, STATS_SMEM)),
            # the load warp (warp 8)
            (_fwd_producer, (q_desc, k_desc, v_desc, q_smem0, q_smem1, k_smem, v_smem, q_bar, k_ready, k_empty,
                             v_ready, v_empty, batch, head, kv_head, start_m, t_lo, n_tiles, pages, BLOCK_N,
                             STAGES, PADDED, PAGE, q_batch, q_off, kv_batch, k_off)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# host side

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# the FP8 switch's input types ([Note] FP8); kept apart, so the 16-bit filters (``_problem_ok``, which the
# backward passes share) never see them
_GL_FP8 = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


def _tma_strides(t):
    """Element strides for a 4-D TMA view of t. A dimension of size 1 is never stepped, so its
    stride (which PyTorch may report as anything) is replaced by a valid one (16-byte multiple)."""
    return tuple(s if n > 1 else t.shape[-1] for n, s in zip(t.shape[:-1], t.stride()[:-1])) + (1, )


_GEOMETRY = {}  # (shape, strides, dtype) -> _geometry (supports and the launch ask on every call)


def _geometry(t):
    """(whether t's strides meet TMA's rules, its 4-D TMA strides), cached per shape, strides and dtype."""
    key = (t.shape, t.stride(), t.dtype)
    g = _GEOMETRY.get(key)
    if g is None:
        shape, strides, size = t.shape, key[1], t.element_size()
        ready = strides[-1] == 1 and all(
            n <= 1 or (s > 0 and s * size % 16 == 0 and s * size < 2 ** 40) for n, s in zip(shape[:-1], strides[:-1]))
        if len(_GEOMETRY) >= 1024:
            _GEOMETRY.clear()
        g = _GEOMETRY[key] = (ready, _tma_strides(t))
    return g


def _tma_ready(t) -> bool:
    """TMA's rules: 16-byte aligned base, unit last stride, other strides (of dims that are stepped)
    positive multiples of 16 bytes below 2^40 bytes."""
    return t is not None and t.is_cuda and t.data_ptr() % 16 == 0 and _geometry(t)[0]


@functools.lru_cache(maxsize=None)
def _is_sm90(device_index) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _lengths_ok(t, p) -> bool:
    """A per-batch length tensor the kernel can read: int32 [b], contiguous, on q's GPU
    (``problem._seq_lens`` normalizes the user's to this)."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.is_cuda and t.dim() == 1
            and t.numel() == p.b and t.stride(0) == 1)


def supports(p, q, k, v, out, *, head_dims=None, slopes=None, seq_len_q=None, seq_len_kv=None, sink=None,
             page_table_k=None, page_table_v=None) -> bool:
    """True when this kernel computes exactly what ``p`` asks for on these tensors.

    head_dims: the head dims to accept (default ``SUPPORTED_DIMS``; at most those of ``TILE_D``).
    seq_len_q / seq_len_kv: the normalized length tensors (``extras``) when p has them; sink: the
    fp32 [h_q] sink logits when p.has_sink; page_table_k / page_table_v: the int32 [b, pages] tables
    when p.paged (k / v are then the containers [blocks, h_kv, page, d]).
    The problem half is cached per problem (the planner's callers ask on every forward); the
    tensor half (GPU, dtypes, TMA's stride rules) is checked each call."""
    dims = SUPPORTED_DIMS if head_dims is None else tuple(head_dims)
    if not (_fwd_problem_ok(p, dims) and isinstance(q, torch.Tensor) and q.is_cuda and _is_sm90(q.device.index)):
        return False
    if p.alibi is not None and not _slopes_ok(p, slopes):
        return False
    if (p.has_seq_len_q and not _lengths_ok(seq_len_q, p)) or (p.has_seq_len_kv and not _lengths_ok(seq_len_kv, p)):
        return False
    if p.has_sink and not _sink_ok(p, sink):
        return False
    if p.paged and not (_table_ok(page_table_k, p) and _table_ok(page_table_v, p)):
        return False
    return all(t.dtype == p.dtype and _tma_ready(t) for t in (q, k, v, out))


def _slopes_ok(p, slopes) -> bool:
    """ALiBi slopes as the kernels read them: fp32 [b, h_q] on the GPU (batch stride 0 for per-head
    slopes), unit stride on heads."""
    return (isinstance(slopes, torch.Tensor) and slopes.dtype == torch.float32 and slopes.is_cuda
            and tuple(slopes.shape) == (p.b, p.h_q) and slopes.stride(-1) == 1)


def _table_ok(t, p) -> bool:
    """A page table as the kernel reads it: int32 [b, pages] on the GPU, unit stride along pages."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.is_cuda and t.dim() == 2
            and t.shape[0] == p.b and t.shape[1] >= 1 and t.stride(1) == 1)


def _page_fits(page, d) -> bool:
    """Pages the paged loads can gather: a power of two of at least 8 keys (a whole number of TMA
    boxes per key tile, or of key tiles per page; 8 rows keep the 128-byte swizzle's atom whole)."""
    return page >= 8 and page & (page - 1) == 0 and d in TILE_D


def _sink_ok(p, sink) -> bool:
    """Sink logits as the kernel reads them: fp32 [h_q], contiguous, on the GPU (``problem`` makes them so)."""
    return (isinstance(sink, torch.Tensor) and sink.dtype == torch.float32 and sink.is_cuda
            and tuple(sink.shape) == (p.h_q, ) and sink.stride(0) == 1)


@functools.lru_cache(maxsize=256)
def _problem_ok(p, dims) -> bool:
    """The problem's features and sizes are ones this kernel has (no mask or causal, plain inputs)."""
    if p.dtype not in _GL_DTYPES or p.d != p.d_v or p.d not in dims or p.d not in TILE_D:
        return False
    if (p.paged or p.varlen or p.bias is not None or p.alibi is not None or p.has_dropout or p.softcap
            or p.has_seq_len_q or p.has_seq_len_kv):
        return False
    if not (p.scale > 0.0) or p.s_q < 1 or p.s_kv < 1 or p.b < 1 or p.h_q < 1:
        return False
    band = p.band
    if band is not None and not (band.left is None and band.right == 0):
        return False     # only no mask or causal (either alignment)
    return max(p.s_q, p.s_kv) < 2 ** 31 and p.b * p.h_q <= 65535     # grid y = b * h_q


@functools.lru_cache(maxsize=256)
def _fwd_problem_ok(p, dims) -> bool:
    """The forward also takes sliding windows (any band), ALiBi (slopes in the kernel), padding
    (per-batch lengths), dropout, sinks and paged K/V; ``_problem_ok``, the backward's filter too, refuses those."""
    if (p.alibi is None and not p.has_seq_len_q and not p.has_seq_len_kv and not p.has_dropout and not p.has_sink
            and not p.paged and (p.band is None or (p.band.left is None and p.band.right == 0))):
        return _problem_ok(p, dims)
    if p.paged and not _page_fits(p.page_size, p.d):
        return False
    plain = dataclasses.replace(p, alibi=None, band=None, has_seq_len_q=False, has_seq_len_kv=False, dropout_p=0.0,
                                dropout_seed=0, dropout_offset=0, has_sink=False, paged=False, page_size=0)
    return _problem_ok(plain, dims)


_LAYOUTS = {}


def _smem_layout(rows, d, dtype):
    key = (rows, d, dtype)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], {**_GL_DTYPES, **_GL_FP8}[dtype])
    return _LAYOUTS[key]


def _tma(t, rows, box_rows=None, box_cols=None) -> Tma:
    """4-D TMA descriptor arguments of t with box [1, 1, rows, tile width] (for ``launch.launch``); the
    box may be wider than t's last dim (d=224 on 256-wide tiles): TMA zero-fills the columns past it
    and clips stores. box_rows / box_cols: a smaller box that fills a ``rows``-row tile in pieces (paged
    K/V), in the tile's shared-memory layout (the swizzle depends on the row width only, 128 bytes for
    every tile width here)."""
    d = TILE_D[t.shape[-1]]
    return Tma(t, t.shape, _geometry(t)[1], (1, 1, box_rows or rows, box_cols or d), _smem_layout(rows, d, t.dtype))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index) -> int:
    """Streaming multiprocessors of the GPU: the persistent grid's size (one CTA per SM)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_COUNTERS = {}


def _tile_counter(device) -> torch.Tensor:
    """The dynamic persistent grid's tile counter: int32 [1], 0 between launches (each launch
    leaves it 0: ``_next_tile``). One per (device, stream): launches on one stream run one after
    another, so they can share it, launches on two streams may overlap and must not. (Graphs
    captured on one stream and replayed concurrently on several would share it: not supported.)
    None when the stream has none yet and is capturing a CUDA graph: made inside the capture, the
    counter would live in that graph's private memory pool (and its zeroing would be a captured
    op), so a later launch could reach freed memory; the caller then takes the static hand-out (equal
    tiles) or the one-tile grid."""
    # the raw stream handle, as the launcher gets it (a torch Stream object costs ~8 us a launch)
    key = (device.index, _current_raw_stream(device.index))
    c = _COUNTERS.get(key)
    if c is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        c = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


def _persistent_default(p) -> bool:
    """Whether ``launch_fwd_sm90`` takes the persistent grid when not told (``PERSISTENT``; with
    ALiBi only at tile width 128, the one measured: tools/gluon_check.py spills, bench/fwd_ab.py;
    with dropout not at tile width 256, where its persistent consumer spills 192 bytes and the
    one-tile grid's none)."""
    if p.alibi is not None and TILE_D[p.d] != 128:
        return False
    if p.has_dropout and TILE_D[p.d] == 256:
        return False
    band = p.band
    if band is None:
        kind = "none"
    elif band.left is None and band.right == 0:
        kind = "causal"
    else:
        kind = "window"
    if (p.has_seq_len_q or p.has_seq_len_kv) and kind != "window":
        kind = "padded"       # padded with no mask or causal; a padded window counts as a window
    return PERSISTENT[(kind, TILE_D[p.d])]


def launch_fwd_sm90(p, q, k, v, out, lse, *, slopes=None, seq_len_q=None, seq_len_kv=None, sink=None,
                    page_table_k=None, page_table_v=None, cu_seqlens_q=None, cu_seqlens_kv=None, block_n=None,
                    stages=None, pingpong=None, persistent=None, dynamic=None, head_group=None, ctas=None,
                    v_warp=None, fp8=None):
    """Attention forward on Hopper. q [b,h_q,s_q,d], k/v [b,h_kv,s_kv,d], out [b,h_q,s_q,d]:
    any strides with unit last stride (``supports`` checks them); lse: fp32 [b,h_q,s_q] view
    (any strides) or None; slopes: fp32 [b, h_q] ALiBi slopes (natural units) when p.alibi;
    seq_len_q / seq_len_kv: int32 [b] lengths when p.has_seq_len_q / p.has_seq_len_kv (padding:
    rows past len_q are written as 0, keys past len_kv are masked); sink: fp32 [h_q] sink logits when
    p.has_sink (the stats include the sink's term); page_table_k / page_table_v: int32 [b, pages] when
    p.paged, k / v then being the containers [blocks, h_kv, page, d] (any strides, unit last).
    cu_seqlens_q: int32 [b + 1] (packed queries, [Note] packed queries; p then has per-batch query lengths,
    p.s_q the longest sequence, and no dropout): q / out are packed [1, h_q, total, d] views and lse
    [1, h_q, total]; sequence i's rows are rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1 (``supports_packed``).
    cu_seqlens_kv: the same for packed keys (FlashAttention's varlen call; p with per-batch key lengths, p.s_kv
    the longest, not paged): k / v packed [1, h_kv, total_k, d] views.
    Writes out and lse in place.

    block_n / stages / pingpong override the defaults (``TILES``, ``PINGPONG``); persistent (the
    persistent grid, default ``PERSISTENT`` per mask kind and head dim), dynamic (its tile
    counter, default on) and head_group (heads per group of its tile order, default: about one
    wave's worth, ``_work_tile``) likewise; ctas caps the persistent grid's size (tests: a few
    CTAs then run many work tiles each); v_warp (pages smaller than a key tile on the persistent grid: V's
    copies from a second load warp, default ``PAGED_V_WARP``); for tuning.

    fp8 = (scales, amax, e5m2[, head_scales]) runs the FP8 forward on the 16-bit MMAs ([Note] FP8 on 16-bit MMAs;
    ``launch_fwd_sm90_fp8_16``): v then holds FP8 values as fp16, q / k too or are float8 themselves (QK^T an
    FP8 wgmma), out is the FP8 call's output (any float type, unit last stride), scales / amax as
    ``launch_fwd_sm90_fp8``'s, e5m2 P8's type.
    """
    td = TILE_D[p.d]
    block_n = block_n or TILES[td][0]
    stages = stages or TILES[td][1]
    pingpong = PINGPONG[td] if pingpong is None else pingpong
    persistent = _persistent_default(p) if persistent is None else persistent
    band = p.band
    has_left = band is not None and band.left is not None
    has_right = band is not None and band.right is not None
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0, 0))
    varlen = cu_seqlens_q is not None
    if varlen:
        if not p.has_seq_len_q or p.has_dropout:
            raise ValueError("packed queries: the problem has per-batch query lengths and no dropout")
        seq_len_q = cu_seqlens_q
    packed_kv = cu_seqlens_kv is not None
    if packed_kv:
        if not p.has_seq_len_kv or p.has_dropout or p.paged:
            raise ValueError("packed keys: the problem has per-batch key lengths, no dropout and no pages")
        seq_len_kv = cu_seqlens_kv
    if (p.has_seq_len_q and seq_len_q is None) or (p.has_seq_len_kv and seq_len_kv is None):
        raise ValueError("the problem has per-batch lengths: pass seq_len_q / seq_len_kv")
    if p.has_sink and sink is None:
        raise ValueError("the problem has a sink: pass sink")
    if p.paged and (page_table_k is None or page_table_v is None):
        raise ValueError("the problem is paged: pass page_table_k and page_table_v")
    n_m, n_bh = cdiv(p.s_q, BLOCK_M), p.b * p.h_q
    dynamic = True if dynamic is None else bool(dynamic)
    counter = _tile_counter(q.device) if persistent and dynamic else lse_arg
    if counter is None:
        # first launch on a capturing stream: no counter to share (_tile_counter). Equal work tiles (no
        # band, no lengths) keep the persistent grid with the static hand-out (tile + nprog), which
        # needs no counter and balances equal tiles as well; the others take the one-tile grid
        counter = lse_arg
        if band is None and not (p.has_seq_len_q or p.has_seq_len_kv):
            dynamic = False
        else:
            persistent = False
    if persistent:
        n_sm = _sm_count(q.device.index)
        grid = (min(ctas or n_sm, n_m * n_bh), )
        # the tiles of about one wave (n_sm CTAs) share their heads' K/V in L2 (_work_tile)
        head_group = head_group or max(1, min(n_bh, grid[0] // n_m))
    else:
        grid = (n_m, n_bh)
        head_group = 1
    if p.paged:
        # a TMA box never crosses a page: a tile from inside a page (_paged_tile_loads), or one
        # 64-column block of a page smaller than a tile (_paged_tile_gather)
        small = p.page_size < block_n
        k_tma, v_tma = (_tma(t, block_n, box_rows=min(p.page_size, block_n), box_cols=64 if small else None)
                        for t in (k, v))
        tables = (page_table_k, page_table_v, page_table_k.stride(0), page_table_v.stride(0), page_table_k.shape[1])
        v_warp = PAGED_V_WARP if v_warp is None else v_warp
        v_warp = bool(v_warp and small and persistent)
    else:
        v_warp = False
        k_tma, v_tma = _tma(k, block_n), _tma(v, block_n)
        tables = (lse_arg, lse_arg, 0, 0, 1)
    if fp8 is not None:
        # the FP8 epilogue writes out from registers ([Note] FP8): q's descriptor stands in for O's
        o_tma, o_args = _tma(q, WG_M), (out, out.stride(0), out.stride(1), out.stride(2), p.d_v, fp8[0], fp8[1])
    else:
        # packed queries: the output for the masked stores of each sequence's last tile (_store_rows), its
        # row count in the batch stride's place; else the FP8 switch's output, scales and amaxes (unused)
        o_tma = _tma(out, WG_M)
        o_args = ((out, out.shape[2], out.stride(1), out.stride(2), p.d_v) if varlen else (lse_arg, 0, 0, 0, 0)) \
            + (lse_arg, lse_arg)
    launch(
        _attn_fwd_sm90, grid,
        _tma(q, WG_M), k_tma, v_tma, o_tma, lse_arg, *lse_strides,
        slopes if p.alibi is not None else lse_arg, slopes.stride(0) if p.alibi is not None else 0,
        seq_len_q if p.has_seq_len_q else lse_arg, seq_len_kv if p.has_seq_len_kv else lse_arg,
        p.h_q, p.group, p.s_q, p.s_kv, p.scale * LOG2E, band.left if has_left else 0, band.right if has_right else 0,
        counter, n_m, n_bh, head_group,
        *dropout.kernel_args(p), sink if p.has_sink else lse_arg, *tables, *o_args,
        BLOCK_N=block_n, STAGES=stages, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        BOTTOM_RIGHT=band is not None and band.alignment == "bottom_right", HAS_ALIBI=p.alibi is not None,
        # a causal-like band: the longest rows (last query tiles) start first
        WRITE_LSE=lse is not None, REVERSE_M=has_right and not has_left,
        HAS_SEQ_Q=p.has_seq_len_q, HAS_SEQ_KV=p.has_seq_len_kv,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, PINGPONG=pingpong,
        PERSISTENT=bool(persistent), DYNAMIC=dynamic, QSTAGES=QSTAGES[td], DROPOUT=p.has_dropout,
        HAS_SINK=p.has_sink, PAGE=p.page_size if p.paged else 0, PACKED_Q=varlen, PACKED_KV=packed_kv,
        V_WARP=v_warp, FP8_EMU=0 if fp8 is None else 1 + bool(fp8[2]),
        # FP8 q / k (QK^T an FP8 wgmma, [Note] FP8 on 16-bit MMAs): the FP8 switch's accumulation (FP8_PROMOTE)
        **(dict(PROMOTE=FP8_PROMOTE) if q.dtype in _GL_FP8 else {}),
        **_head_scale_args(p, fp8[3] if fp8 is not None and len(fp8) > 3 else None), num_warps=4,
    )
    return out, lse


def _offsets_ok(cu, p) -> bool:
    """Cumulative offsets as the packed modes read them: int32 [p.b + 1], contiguous, on the GPU."""
    return (isinstance(cu, torch.Tensor) and cu.dtype == torch.int32 and cu.is_cuda and cu.dim() == 1
            and cu.numel() == p.b + 1 and cu.stride(0) == 1)


def supports_packed(p, q, k, v, out, cu_seqlens_q, cu_seqlens_kv=None, **lens) -> bool:
    """``supports`` for packed queries (``launch_fwd_sm90(cu_seqlens_q=)``): q / out packed [1, h_q, total, d]
    views, p with per-batch query lengths (p.b sequences, p.s_q the longest) and no dropout, cu_seqlens_q int32
    [p.b + 1] contiguous on q's GPU; with cu_seqlens_kv, packed keys too (k / v [1, h_kv, total_k, d], p with
    per-batch key lengths, not paged); lens as ``supports``'s (neither length tensor among them)."""
    if not (p.has_seq_len_q and not p.has_dropout and p.dtype in _GL_DTYPES and q.dim() == 4 and q.shape[0] == 1
            and tuple(out.shape) == (1, p.h_q, q.shape[2], p.d_v) and _offsets_ok(cu_seqlens_q, p)):
        return False
    if q.shape[2] == 0 or k.shape[2] == 0 or v.shape[2] == 0:
        return False        # no row to read or write (a TMA descriptor needs every dim >= 1)
    if cu_seqlens_kv is not None:
        if not (p.has_seq_len_kv and not p.paged and k.shape[0] == 1 and v.shape[0] == 1
                and _offsets_ok(cu_seqlens_kv, p)):
            return False
        lens = dict(lens, seq_len_kv=cu_seqlens_kv[1:])
    # the problem half as the padded batch it stands for, the tensor half (TMA's rules) on the packed views
    return supports(p, q, k, v, out, seq_len_q=cu_seqlens_q[1:], **lens)


# ----------------------------------------------------------------------------------------------
# the FP8 switch (module docstring, [Note] FP8)

# (tile width) -> (BLOCK_N, STAGES) of the FP8 forward. 8-bit K and V tiles are half the bytes, so shared
# memory is not the limit (d=128: Q 2 x 64 x 128 + 3 x (K + V) 2 x 128 x 128 bytes = 112 KB); registers are: per
# consumer thread O [64, d] fp32, each tile's P V in its own accumulator ([Note] FP8: another [64, d]), S
# [64, BLOCK_N] and P8. tools/gluon_check.py fp8 (ptxas, Triton 3.6): d=128 with 64-key tiles has no spills
# (mask-free loop 336 SASS instructions per tile, 672 per 128 keys); with 128-key tiles 8 bytes (no mask) /
# 164 bytes (causal) of spills, all in the masked loops (mask-free loop 510 per 128 keys). Measured
# (bench/gluon_fp8_sweep.py, H100, Triton 3.6, bf16 out, TFLOP/s, 64 x 4 -> 128 x 3): b4 h32 2k causal 438 ->
# 481, b2 h16 8k 700 -> 817, b1 h32 16k causal 693 -> 826, GQA 32/8 4k causal 564 -> 659 (bench/NOTES.md 59):
# the 128-key tiles, spills and all. d=64: 128-key tiles, no spills. d=224 / 256 (O alone is 128 registers,
# the per-tile accumulator another 128): not here yet, the portable kernel runs them (FP8_DIMS).
FP8_TILES = {64: (128, 3), 128: (128, 3), 256: (64, 2)}
FP8_DIMS = (64, 128)
# the FP8 wgmmas' promotion ([Note] FP8, the accumulation): 0 = each key tile's P V in a fresh accumulator
# added to O in fp32, nothing promoted inside one product (the products' chains: d / 32 K-steps for QK^T,
# BLOCK_N / 32 for P V); 32 = every K-step of 32 moved to fp32 as the portable kernel does, which Triton
# expands into one waited wgmma per K-step (serialized, the softmax no longer under P V: tools/gluon_check.py)
FP8_PROMOTE = 0
# (tile width) -> the FP8 switch on the persistent grid ([Note] persistent grid; launch_fwd_sm90_fp8(persistent=)).
# Measured beside the one-tile grid (bench/gluon_fp8_sweep.py, H100, Triton 3.6, TFLOP/s): d=64 b8 h12 1k 294
# -> 322, causal 135 -> 193 (short tiles: the grid's tail and launch dominate); d=128 with 128-key tiles mixed
# (2k causal 481 -> 492, 8k 817 -> 819, 16k causal 826 -> 791, GQA 4k causal 659 -> 652): off there
FP8_PERSISTENT = {64: True, 128: False, 256: False}


def fp8_mma_chain(d, block_n=None, promote=None) -> int:
    """K-steps of 32 that the FP8 switch's wgmmas add up before their sum moves into fp32 ([Note] FP8, the
    accumulation): QK^T's d / 32 and P V's BLOCK_N / 32 with ``FP8_PROMOTE`` = 0, 1 with 32. The error
    bound's ``u_mma`` is ``fusedattn.fp8.mma_unit(device, chain)``."""
    td = TILE_D[d]
    block_n = block_n or FP8_TILES[td][0]
    promote = FP8_PROMOTE if promote is None else promote
    return 1 if promote else max(td, block_n) // 32


def supports_fp8(p, q, k, v, out, *, seq_len_q=None, seq_len_kv=None) -> bool:
    """True when the FP8 switch computes what ``p`` asks for on these tensors: q / k / v of one float8
    type (``_GL_FP8``) on an sm_90 GPU, d = d_v in ``FP8_DIMS``, no mask, causal or any band,
    padding (seq_len_q / seq_len_kv: int32 [b]), GQA; TMA's rules on q and k (v is restaged transposed by
    ``launch_fwd_sm90_fp8``); out: any float type, unit last stride."""
    if not (isinstance(q, torch.Tensor) and q.is_cuda and q.dtype in _GL_FP8 and _is_sm90(q.device.index)):
        return False
    if not (k.dtype == q.dtype and v.dtype == q.dtype and p.d == p.d_v and p.d in FP8_DIMS):
        return False
    if (p.paged or p.varlen or p.bias is not None or p.alibi is not None or p.has_dropout or p.softcap
            or p.has_sink or not p.scale > 0.0 or min(p.s_q, p.s_kv, p.b, p.h_q) < 1):
        return False
    if max(p.s_q, p.s_kv) >= 2 ** 31 or p.b * p.h_q > 65535:
        return False
    if (p.has_seq_len_q and not _lengths_ok(seq_len_q, p)) or (p.has_seq_len_kv and not _lengths_ok(seq_len_kv, p)):
        return False
    return (_tma_ready(q) and _tma_ready(k) and isinstance(out, torch.Tensor) and out.is_cuda
            and out.stride(-1) == 1 and tuple(out.shape) == (p.b, p.h_q, p.s_q, p.d_v))


# head dims whose FP8 forward runs on the 16-bit MMAs ([Note] FP8 on 16-bit MMAs): where the FP8 switch's
# per-tile accumulator does not fit (FP8_DIMS), the 16-bit kernel's own tiles with FP8 values in fp16
FP8_16_DIMS = (224, 256)
# ... with QK^T an FP8 wgmma on q and k as they are (its sums promoted as the FP8 switch's, FP8_PROMOTE; only
# V widened), else every product fp16 on widened copies. Measured (H200, Triton 3.6.0, bench/fp8_16_qk_ab.py,
# TFLOP/s): d256 4k causal 543 -> 685, d224 2k 501 -> 636 (bench/NOTES.md 72)
FP8_16_QK = True


def supports_fp8_16(p, q, k, v, out, *, seq_len_q=None, seq_len_kv=None) -> bool:
    """True when ``launch_fwd_sm90_fp8_16`` computes what ``p`` asks for: q / k / v of one float8 type on an
    sm_90 GPU, d = d_v in ``FP8_16_DIMS``, the masks, padding and GQA of the 16-bit kernel (no ALiBi, dropout,
    sinks, pages or packed rows); out: any float type, unit last stride (q, k, v are widened to fp16, so any
    strides)."""
    if not (isinstance(q, torch.Tensor) and q.is_cuda and q.dtype in _GL_FP8 and _is_sm90(q.device.index)):
        return False
    if not (k.dtype == q.dtype and v.dtype == q.dtype and p.d == p.d_v and p.d in FP8_16_DIMS):
        return False
    if p.paged or p.varlen or p.alibi is not None or p.has_dropout or p.has_sink:
        return False
    if not _fwd_problem_ok(dataclasses.replace(p, dtype=torch.float16), SUPPORTED_DIMS):
        return False
    if (p.has_seq_len_q and not _lengths_ok(seq_len_q, p)) or (p.has_seq_len_kv and not _lengths_ok(seq_len_kv, p)):
        return False
    return (isinstance(out, torch.Tensor) and out.is_cuda and out.stride(-1) == 1
            and tuple(out.shape) == (p.b, p.h_q, p.s_q, p.d_v))


def launch_fwd_sm90_fp8_16(p, q, k, v, out, lse, scales, amax, *, seq_len_q=None, seq_len_kv=None, qk_fp8=None,
                           head_scales=None, **tuning):
    """The FP8 forward on the 16-bit kernel's MMAs ([Note] FP8 on 16-bit MMAs; ``supports_fp8_16``): v (one
    float8 type with q and k, any strides) is widened to fp16 once, exactly, and the 16-bit kernel runs the
    call with the FP8 switch's semantics (``FP8_EMU``): scores scaled by the descales, P8 = fp8(p * scale_s)
    as fp16, the FP8 epilogue. QK^T: an FP8 wgmma on q and k as they are where ``qk_fp8`` (default
    ``FP8_16_QK``) and TMA takes them, else fp16 on widened copies too. Arguments as
    ``launch_fwd_sm90_fp8``'s (v not transposed); tuning: ``launch_fwd_sm90``'s keywords. Writes out, lse and
    amax in place."""
    if qk_fp8 is None:
        qk_fp8 = FP8_16_QK
    if not (qk_fp8 and _tma_ready(q) and _tma_ready(k)):
        q, k = widened_fp16(q), widened_fp16(k)
    p16 = dataclasses.replace(p, dtype=torch.float16)
    launch_fwd_sm90(p16, q, k, widened_fp16(v), out, lse, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
                    fp8=(scales, amax, v.dtype == torch.float8_e5m2, head_scales), **tuning)
    return out, lse


@triton.jit
def _widen_fp8(X, Y, H, S, D, stride_xb, stride_xh, stride_xs, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Y[b, h, rows, :] = X[b, h, rows, :] as fp16 (exact for e4m3 and e5m2) for BLOCK_S rows of one (batch,
    head): ``widened_fp16``'s pass. X: any strides, unit last; Y contiguous [b, h, S, D]."""
    pid_s = tl.program_id(0)
    bh = tl.program_id(1)
    batch = (bh // H).to(tl.int64)
    head = (bh % H).to(tl.int64)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    keep = (rows[:, None] < S) & (cols[None, :] < D)
    x = tl.load(X + batch * stride_xb + head * stride_xh + rows.to(tl.int64)[:, None] * stride_xs + cols[None, :],
                mask=keep)
    tl.store(Y + (bh.to(tl.int64) * S + rows)[:, None] * D + cols[None, :], x.to(tl.float16), mask=keep)


def widened_fp16(x) -> torch.Tensor:
    """x [b, h, s, d] float8 (any strides, unit last) as a contiguous fp16 copy, exactly ([Note] FP8 on 16-bit
    MMAs). One streaming kernel (``_widen_fp8``): PyTorch's own float8 -> fp16 copy took about 0.3 ms per
    64 Mi elements on the H100 (the d=256 FP8 forward read 332 TFLOP/s with three of them against 714 for the
    bf16 forward; bench/NOTES.md 71). On the CPU without the interpreter, PyTorch's copy."""
    if not (x.is_cuda or interpreting()) or x.stride(-1) != 1:
        return x.to(torch.float16, memory_format=torch.contiguous_format)
    b, h, s, d = x.shape
    y = torch.empty((b, h, s, d), dtype=torch.float16, device=x.device)
    block_d = pow2(d)
    block_s = max(1, 4096 // block_d)
    launch(_widen_fp8, (cdiv(s, block_s), b * h), x, y, h, s, d, *x.stride()[:3], BLOCK_S=block_s,
           BLOCK_D=block_d, num_warps=4)
    return y


_KEY_ORDERS = {}


def key_order(n, device) -> torch.Tensor:
    """int64 [n] (n a multiple of 16): the key at column c' of the FP8 switch's V copy, within blocks of 16:
    c' = 16 g + 4 q + t holds key 16 g + 8 (t // 2) + 2 q + t % 2, the order in which a thread's P8
    registers reach the PV wgmma without a shuffle (``_pack_p8``; [Note] FP8, the key order)."""
    key = (n, device)
    idx = _KEY_ORDERS.get(key)
    if idx is None:
        c = torch.arange(n)
        idx = (c & ~15) + ((c & 2) << 2) + ((c >> 1) & 6) + (c & 1)
        idx = _KEY_ORDERS[key] = idx.to(device)
    return idx


@triton.jit
def _transpose_v_keys(V, VT, H, S, PAD, D, stride_vb, stride_vh, stride_vs, stride_vd, stride_tb, stride_th,
                      stride_td, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PERMUTE: tl.constexpr = True):
    """VT[b, h, :, c] = V[b, h, key_order(c), :] (0 for keys >= S) for BLOCK_S columns c of one (batch, head):
    ``transposed_v``'s gather, transpose and zero fill in one pass over V's bytes (uint8 views); PERMUTE off:
    key c itself."""
    pid_c = tl.program_id(0)
    bh = tl.program_id(1)
    batch = (bh // H).to(tl.int64)
    head = (bh % H).to(tl.int64)
    c = pid_c * BLOCK_S + tl.arange(0, BLOCK_S)
    # key_order's formula: column 16 g + 4 q + t holds key 16 g + 8 (t // 2) + 2 q + t % 2
    if PERMUTE:
        key = (c // 16) * 16 + (c & 2) * 4 + ((c // 2) & 6) + (c & 1)
    else:
        key = c
    d = tl.arange(0, BLOCK_D)
    src = V + batch * stride_vb + head * stride_vh + key.to(tl.int64)[:, None] * stride_vs + d[None, :] * stride_vd
    x = tl.load(src, mask=(key[:, None] < S) & (d[None, :] < D), other=0)
    dst = VT + batch * stride_tb + head * stride_th + d.to(tl.int64)[:, None] * stride_td + c[None, :]
    tl.store(dst, tl.trans(x), mask=(d[:, None] < D) & (c[None, :] < PAD))


def transposed_v(v, permute=True) -> torch.Tensor:
    """V [b, h_kv, s_kv, d] (any strides) as the FP8 switch reads it ([Note] FP8): [b, h_kv, d, s_pad]
    contiguous with the keys innermost (FP8 wgmmas read B K-major), s_pad = s_kv rounded up to 16 (TMA's
    16-byte row stride), keys in ``key_order`` within each 16 and zeros for keys >= s_kv. One pass of one small
    kernel over uint8 views (``_transpose_v_keys``; PyTorch's gather and transposing copy of 8-bit elements
    took 0.35 ms for 32 MiB on the H100, a third of a 2k causal forward: bench/NOTES.md 59); on the CPU
    without the interpreter, the same through PyTorch (``_transposed_v_torch``). permute=False: the keys in
    their own order (the FP8 backward's K^T, ``bwd_fused_sm90.fp8_transposes``)."""
    b, h, s, d = v.shape
    pad = -(-s // 16) * 16
    if not (v.is_cuda or interpreting()):
        return _transposed_v_torch(v, permute)
    vt = torch.empty((b, h, d, pad), dtype=torch.uint8, device=v.device)
    v8 = v.view(torch.uint8)
    block_s = 128
    # through a Launcher (``launch``): a repeat signature skips Triton's dispatch (jit_launch took ~90 us of
    # host per 2k causal FP8 forward under cProfile, H100 host, session 28, where the whole call is ~0.3 ms)
    launch(_transpose_v_keys, (cdiv(pad, block_s), b * h), v8, vt, h, s, pad, d, *v8.stride(),
           *vt.stride()[:3], BLOCK_S=block_s, BLOCK_D=pow2(d),
           **({} if permute else dict(PERMUTE=False)), num_warps=4)
    return vt.view(v.dtype)


def _transposed_v_torch(v, permute=True) -> torch.Tensor:
    """``transposed_v`` through PyTorch: one gather and one transposing copy through uint8 views (PyTorch has
    few float8 kernels). The CPU's form, and the reference of the kernel's test."""
    b, h, s, d = v.shape
    pad = -(-s // 16) * 16
    idx = key_order(pad, v.device) if permute else torch.arange(pad, device=v.device)
    g = v.view(torch.uint8).index_select(2, idx.clamp(max=s - 1))
    if pad != s:
        g[:, :, idx >= s] = 0
    vt = torch.empty((b, h, d, pad), dtype=torch.uint8, device=v.device)
    vt.copy_(g.transpose(2, 3))
    return vt.view(v.dtype)


def launch_fwd_sm90_fp8(p, q, k, vt, out, lse, scales, amax, *, seq_len_q=None, seq_len_kv=None, block_n=None,
                        stages=None, pingpong=None, promote=None, persistent=None, ctas=None, head_scales=None):
    """The FP8 forward (module docstring, [Note] FP8) on Hopper. q [b, h_q, s_q, d], k [b, h_kv, s_kv, d]
    float8 (``supports_fp8``); vt: V transposed, [b, h_kv, d, s_kv rounded up to 16] in ``key_order``
    (``transposed_v``); out [b, h_q, s_q, d] in any float type (float8: saturating), unit last stride; lse
    fp32 [b, h_q, s_q] view or None;
    scales fp32 [6] contiguous (descale_q, descale_k, descale_v, descale_s, scale_s, scale_o); amax fp32
    [2] (amax_s, amax_o), zeroed by the caller, maxed into. head_scales: per-head descales, (descale_q [h_q],
    descale_k [h_kv], descale_v [h_kv]) (``_head_scale_args``; scales then holds 1 as descale_q / k / v), or None.
    Writes out, lse and amax in place.
    block_n / stages / pingpong / promote override ``FP8_TILES`` / ``PINGPONG`` / ``FP8_PROMOTE`` (tuning);
    persistent: the persistent grid with its dynamic tile counter (default ``FP8_PERSISTENT``; ctas caps its
    size, for tests) as ``launch_fwd_sm90``'s."""
    td = TILE_D[p.d]
    block_n = block_n or FP8_TILES[td][0]
    stages = stages or FP8_TILES[td][1]
    pingpong = PINGPONG[td] if pingpong is None else pingpong
    promote = FP8_PROMOTE if promote is None else promote
    band = p.band
    has_left = band is not None and band.left is not None
    has_right = band is not None and band.right is not None
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (amax, (0, 0, 0))
    if (p.has_seq_len_q and seq_len_q is None) or (p.has_seq_len_kv and seq_len_kv is None):
        raise ValueError("the problem has per-batch lengths: pass seq_len_q / seq_len_kv")
    if vt.shape != (p.b, p.h_kv, p.d, -(-p.s_kv // 16) * 16) or vt.stride(-1) != 1:
        raise ValueError(f"vt must be V transposed by transposed_v, [b, h_kv, d, s_kv rounded up to 16]; got "
                         f"{list(vt.shape)} strides {vt.stride()}")
    n_m, n_bh = cdiv(p.s_q, BLOCK_M), p.b * p.h_q
    persistent = FP8_PERSISTENT[td] if persistent is None else bool(persistent)
    counter = _tile_counter(q.device) if persistent else lse_arg
    if counter is None:         # first launch on a capturing stream (_tile_counter): the one-tile grid
        persistent, counter = False, lse_arg
    if persistent:
        grid = (min(ctas or _sm_count(q.device.index), n_m * n_bh), )
        head_group = max(1, min(n_bh, grid[0] // n_m))
    else:
        grid, head_group = (n_m, n_bh), 1
    q_tma = _tma(q, WG_M)
    v_tma = Tma(vt, vt.shape, _geometry(vt)[1], (1, 1, td, block_n), _smem_layout(td, block_n, vt.dtype))
    launch(
        _attn_fwd_sm90, grid,
        q_tma, _tma(k, block_n), v_tma, q_tma, lse_arg, *lse_strides,
        lse_arg, 0, seq_len_q if p.has_seq_len_q else lse_arg, seq_len_kv if p.has_seq_len_kv else lse_arg,
        p.h_q, p.group, p.s_q, p.s_kv, p.scale * LOG2E, band.left if has_left else 0, band.right if has_right else 0,
        counter, n_m, n_bh, head_group,
        0, 0, 0, 1.0, lse_arg, lse_arg, lse_arg, 0, 0, 1,
        out, out.stride(0), out.stride(1), out.stride(2), p.d_v, scales, amax,
        BLOCK_N=block_n, STAGES=stages, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        BOTTOM_RIGHT=band is not None and band.alignment == "bottom_right", HAS_ALIBI=False,
        WRITE_LSE=lse is not None, REVERSE_M=has_right and not has_left,
        HAS_SEQ_Q=p.has_seq_len_q, HAS_SEQ_KV=p.has_seq_len_kv,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, PINGPONG=pingpong,
        PERSISTENT=persistent, DYNAMIC=True, QSTAGES=QSTAGES[td], DROPOUT=False, HAS_SINK=False, PAGE=0,
        PROMOTE=promote, **_head_scale_args(p, head_scales), num_warps=4,
    )
    return out, lse


def _head_scale_args(p, scales):
    """The kernel's keywords for per-head descales ([Note] FP8, FP8_HEAD_SCALES): scales = (descale_q, descale_k,
    descale_v), contiguous fp32 device tensors of h_q, h_kv and h_kv values, a one-element one expanded (a copy:
    the kernel reads each at its head). Passed only where there are per-head ones, so the other launches keep
    their keys (the shipped stores')."""
    if scales is None:
        return {}
    dq, dk, dv = (t if t.numel() == n else t.reshape(1).expand(n).contiguous()
                  for t, n in zip(scales, (p.h_q, p.h_kv, p.h_kv)))
    return dict(DESCALE_Q=dq, DESCALE_K=dk, DESCALE_V=dv, FP8_HEAD_SCALES=True)
