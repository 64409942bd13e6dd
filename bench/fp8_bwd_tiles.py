"""Tiles of the portable FP8 backward (bwd.py ``launch_bwd_fp8``, plan.py ``_BWD_FP8_SM90``): which ones make
every FP8 dot a wgmma (SASS ``QGMMA``) without spilling, and how fast they run.

    python bench/fp8_bwd_tiles.py --sass [--d 128] [--top 6] [--full]   # no GPU: compile for sm_90a, tables
    python bench/fp8_bwd_tiles.py --dry-run [--survey FILE]             # no GPU: the GPU run's plan
    python bench/fp8_bwd_tiles.py [--rep MS] [--configs 0,2]            # H100: time the candidates

Why: the FP8 backward ran 90 / 110 / 104 TFLOP/s (b4 h32 2k d128 causal / b2 h16 8k d128 / b1 h32 16k d128
causal) and 58 / 53 at d256 / d224 on an H100, against cuDNN's FP8 backward 234 / 684 / 629 and our bf16
backward 407 / 587 / 527. Its d128 dK/dV tile has 32 keys, and that pass's dots have the key count as their
M dimension (``tl.dot(k, tl.trans(q))``, ``tl.dot(p8_t, do)``, ...): with M = 32 Triton lowers them to
mma.sync, which on sm_90 has no FP8 form, so every FP8 operand is unpacked to f16 (SASS ``F2FP...UNPACK_B``)
and multiplied on ``HMMA.16816``: no FP8 tensor-core rate at all. d256 runs 32x32 tiles in both passes.

``--sass`` (no GPU): for d in 64, 128, 256 and every tile (block_m, block_n in 32, 64, 128; 4 or 8 warps;
1-3 stages) of each pass, compiles the pass with e4m3 q/k/v/o, e5m2 dO and bf16 gradients (``tools/
aot_check``'s FP8 backward spec, JIT-like strides) for sm_90a and reads, from Triton's TTGIR and the cubin:
the dots lowered to ``ttng.warp_group_dot`` (wgmma) vs ``tt.dot`` (mma.sync), the SASS ``QGMMA`` (FP8
wgmma) and ``HMMA`` (what mma.sync of unpacked FP8 becomes) counts, registers (cuobjdump), spill-store
bytes (the SASS ``STL`` bytes: ``ptxas -v``'s spill stores, checked equal on seven kernels)
and shared memory (``metadata.shared``, against the H100's 227 KB per block). Causal tiles first (both
passes hold the same three loops, masked / unmasked / masked, causal or not); the non-causal kernel is
compiled for the tiles whose causal one is all-wgmma and fits, and its spill is the row's ``nc`` column.
Results are kept in a JSON file (``--json``) so a second run only prints. Without ``--full`` each table
keeps the all-wgmma tiles that fit (``--top N``: the best N) and the default; ``--full`` prints every tile.

GPU mode (default): for the FP8 bench configs (``fusedattn.bench.fp8_configs``, table "fp8": the five above,
and a d64 one of its own, index 5) times ``fusedattn.fp8.sdpa_fp8_backward`` as ``bench --configs fp8`` does
for "ours" (``bench.prepare_ours_fp8``: e4m3 q/k/v/dO, our forward's e4m3 o and stats, e4m3 gradients, the
group's scales) with ``plan._BWD_FP8_SM90`` patched in-process to each candidate (:data:`CANDIDATES`, the
default first); ``triton.testing.do_bench`` median, TFLOP/s = 2.5 x ``bench.fwd_flops`` (4 b h s^2 d, halved causal).
Every candidate's kernels compile first, side by side (``launch.compiling_ahead``), so the run stays well
inside one 10-minute device call. Each candidate's dQ / dK / dV (e4m3) and four amaxes are checked against
the default tiles' on the same inputs: max |x - x_default| / max |x_default| (one e4m3 step at the maximum
is 0.125; an accumulation-order flip can give that; more means a wrong result: flagged ``CHECK``).

Measured (no GPU, Triton 3.6, sm_90a ptxas), 2026-11-26: ``--sass --top 6``, the 324 causal kernels and 219
non-causal ones (20 minutes on 2 cores; no tile failed to compile, none over 227K, the largest 224K: d256 dQ
128x128/3 stages). Per pass the six best all-wgmma tiles by :func:`rank_key`, and the default:

    Triton 3.6.0, sm_90a, e4m3 q/k/v/o, e5m2 dO, bf16 grads. Causal kernels: shared memory
    (limit 227K), registers, spill-store bytes / LDL+STL in the step loops (nc: the same, non-causal),
    wg: dots lowered to wgmma / all FP8 dots (TTGIR), QGMMA / HMMA: SASS instructions

    d=64
     dkdv: 54 tiles, 36 all-wgmma (36 fit): 4 spill nothing, 14 nothing in the step loops (causal and not)
      dkdv 32x128/8w/1s   22.0K regs 224 spill     0/0    nc       0/0 wgmma wg 12/12 QGMMA  18 HMMA   0
      dkdv 32x64/4w/2s    14.2K regs 255 spill     0/0    nc       0/0 wgmma wg 12/12 QGMMA  18 HMMA   0  <- default
      dkdv 32x64/8w/1s    14.0K regs 215 spill     0/0    nc       0/0 wgmma wg 12/12 QGMMA  30 HMMA   0
      dkdv 32x64/4w/1s    14.0K regs 228 spill     0/0    nc       0/0 wgmma wg 12/12 QGMMA  18 HMMA   0
      dkdv 64x64/4w/1s    20.0K regs 255 spill    12/0    nc       0/0 wgmma wg 12/12 QGMMA  24 HMMA   0
      dkdv 64x128/8w/1s   28.0K regs 255 spill    20/0    nc       0/0 wgmma wg 12/12 QGMMA  24 HMMA   0
     dq: 54 tiles, 36 all-wgmma (36 fit): 24 spill nothing, 25 nothing in the step loops (causal and not)
      dq   128x64/8w/3s   36.0K regs 222 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  12 HMMA   0
      dq   64x128/8w/3s   48.0K regs 254 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  24 HMMA   0
      dq   128x64/4w/3s   36.0K regs 255 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  24 HMMA   0
      dq   128x64/8w/2s   32.0K regs 216 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  12 HMMA   0
      dq   128x64/8w/1s   28.0K regs 218 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  12 HMMA   0
      dq   128x64/4w/1s   28.0K regs 255 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  24 HMMA   0
      dq   64x64/4w/2s    24.0K regs 168 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  12 HMMA   0  <- default

    d=128
     dkdv: 54 tiles, 36 all-wgmma (36 fit): 0 spill nothing, 3 nothing in the step loops (causal and not)
      dkdv 32x128/8w/1s   44.0K regs 255 spill    16/0    nc       8/0 wgmma wg 12/12 QGMMA  30 HMMA   0
      dkdv 32x64/8w/1s    28.0K regs 255 spill    48/0    nc       0/0 wgmma wg 12/12 QGMMA  54 HMMA   0
      dkdv 32x64/8w/2s    28.2K regs 255 spill   160/0    nc      64/0 wgmma wg 12/12 QGMMA  54 HMMA   0
      dkdv 32x64/8w/3s    28.5K regs 255 spill   476/1    nc     216/0 wgmma wg 12/12 QGMMA  54 HMMA   0
      dkdv 32x128/8w/2s   44.2K regs 255 spill   180/7    nc      44/0 wgmma wg 12/12 QGMMA  30 HMMA   0
      dkdv 32x128/8w/3s   44.5K regs 255 spill   464/18   nc      60/0 wgmma wg 12/12 QGMMA  30 HMMA   0
      dkdv 64x32/8w/1s    24.0K regs 232 spill     0/0    nc       0/0 SYNC  wg  0/12 QGMMA   0 HMMA 192  <- default
     dq: 54 tiles, 36 all-wgmma (36 fit): 12 spill nothing, 12 nothing in the step loops (causal and not)
      dq   64x64/8w/3s    56.0K regs 194 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  36 HMMA   0
      dq   128x32/8w/3s   52.0K regs 232 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  18 HMMA   0
      dq   64x64/8w/2s    48.0K regs 192 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  36 HMMA   0
      dq   128x32/8w/2s   48.0K regs 232 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  18 HMMA   0  <- default
      dq   64x64/8w/1s    40.0K regs 210 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  36 HMMA   0
      dq   128x32/8w/1s   44.0K regs 234 spill     0/0    nc       0/0 wgmma wg  9/ 9 QGMMA  18 HMMA   0

    d=256
     dkdv: 54 tiles, 36 all-wgmma (36 fit): 0 spill nothing, 0 nothing in the step loops (causal and not)
      dkdv 32x64/8w/1s    56.0K regs 255 spill   724/209  nc   532/125 wgmma wg 12/12 QGMMA 102 HMMA   0
      dkdv 32x64/8w/2s    56.2K regs 255 spill  1104/234  nc   672/131 wgmma wg 12/12 QGMMA 102 HMMA   0
      dkdv 32x64/8w/3s    56.5K regs 255 spill  1484/282  nc  1072/150 wgmma wg 12/12 QGMMA 102 HMMA   0
      dkdv 64x64/8w/1s    80.0K regs 255 spill  2108/626  nc  1720/420 wgmma wg 12/12 QGMMA 108 HMMA   0
      dkdv 64x64/8w/3s    81.0K regs 255 spill  3376/719  nc  2372/380 wgmma wg 12/12 QGMMA 108 HMMA   0
      dkdv 64x64/8w/2s    80.5K regs 255 spill  2972/733  nc  1604/369 wgmma wg 12/12 QGMMA 108 HMMA   0
      dkdv 32x32/8w/1s    40.0K regs 255 spill    24/0    nc      16/0 SYNC  wg  0/12 QGMMA   0 HMMA 288  <- default
     dq: 54 tiles, 36 all-wgmma (36 fit): 0 spill nothing, 0 nothing in the step loops (causal and not)
      dq   64x32/8w/3s    72.0K regs 255 spill   124/16   nc      56/8 wgmma wg  9/ 9 QGMMA  66 HMMA   0
      dq   64x32/8w/2s    64.0K regs 255 spill   132/18   nc      64/9 wgmma wg  9/ 9 QGMMA  66 HMMA   0
      dq   64x32/8w/1s    56.0K regs 255 spill   192/21   nc    176/20 wgmma wg  9/ 9 QGMMA  66 HMMA   0
      dq   64x64/8w/2s    96.0K regs 255 spill   268/45   nc    192/28 wgmma wg  9/ 9 QGMMA  68 HMMA   0
      dq   128x32/8w/3s  104.0K regs 255 spill   420/108  nc   440/110 wgmma wg  9/ 9 QGMMA  34 HMMA   0
      dq   64x64/8w/1s    80.0K regs 255 spill   644/132  nc    224/28 wgmma wg  9/ 9 QGMMA  68 HMMA   0
      dq   32x32/8w/1s    40.0K regs 182 spill     0/0    nc       0/0 SYNC  wg  0/ 9 QGMMA   0 HMMA 160  <- default

* The lowering rule, without exception over the 324 tiles: a pass's FP8 dots all become wgmma when the dots'
  M side is 64 or more (dK/dV pass: block_n, the keys; dQ pass: block_m, the rows) and all mma.sync when it
  is 32, whatever the warps. So the d128 dK/dV default (64x32) and both d256 defaults (32x32) run every dot
  as HMMA.16816 on F2FP-unpacked f16 operands; the d64 defaults and the d128 dQ default are wgmma already.
* d64: plenty of clean tiles (dK/dV 32x128/8w/1s 224 registers, no spill; dQ 128x64/8w/3s 222, none).
* d128: no all-wgmma dK/dV tile is spill-free (its two fp32 [block_n, 128] accumulators plus the [block_n,
  block_m] S/dP tiles fill 255 registers), but three keep the spill out of the step loops: 32x128/8w/1s (16
  bytes, 8 non-causal), 32x64/8w/1s (48, 0), 32x64/8w/2s (160, 64). 4 warps spill 280+ bytes everywhere.
  dQ: twelve clean all-wgmma tiles, 8 warps, block_m 64 or 128 with block_n 32 or 64 (the default among them).
* d256: every all-wgmma tile spills inside its loops; the least: dK/dV 32x64/8w/1s (724 bytes, 209 LDL/STL
  per trip of the step loops), dQ 64x32/8w/3s (124 bytes, 16). The default 32x32 tiles spill ~nothing
  because mma.sync fragments are small, and pay for it in HMMA.
* The bench's types (e4m3 dO and gradients, the GPU run's) give the same shared memory and QGMMAs; spills of
  the candidates: d128 dK/dV 32x128/8w/1s 36/0, 32x64/8w/1s 120/0, dQ 128x32/8w/3s 0/0; d256 dK/dV
  32x64/8w/1s 708/205, dQ 64x32/8w/3s 112/13 (spot check, causal).
* Stages barely move the dK/dV pass's shared memory (+0.5K a stage: its loop loads go through registers,
  not the pipeliner) but add spill; they do move the dQ pass's (K / V tiles pipelined).
* Triton 3.9 (/tmp/venv-t3.9.0, the whole survey again, 543 kernels, ``--sass --top 3``): the same lowering
  rule, no errors, nothing over 227K. d128 dK/dV: four all-wgmma tiles keep the spill out of the step loops,
  32x128/8w/3s (48 bytes, 0 non-causal), 32x64/8w/2s (68), 32x64/8w/3s (72), 32x64/8w/1s (100), while
  32x128/8w/1s, 3.6's best, spills 72 bytes with 16 LDL/STL in its loops (hence the sixth d128 candidate);
  dQ the same twelve clean tiles. d256: dK/dV 32x64/8w/1s still the least bad (772 / 226), but three dQ
  tiles spill nothing (64x32/8w/3s, /2s, /1s: 244, 241, 251 registers). d64: 13 clean dK/dV tiles (3.6: 4),
  64x128/8w/1s and 32x128/8w/3s first; dQ 128x64/8w/3s first, as 3.6. Same shortlist at d256; at d128 3.9
  picks 32x128/8w/3s and 32x64/8w/2s for dK/dV.

Prediction (for the GPU run to check). d128: the dK/dV pass leaves mma.sync, which on sm_90 is f16 HMMA after an
F2FP unpack of every FP8 operand (at best a third of FP8 wgmma's rate, plus the unpack ALU work), so the gain
comes from the dK/dV tile: dkdv 32x128/8w/1s + dq 128x32/8w/3s fastest, 1.6-2x the default on the long configs
(8k: 110 -> 180-220 TFLOP/s; 16k causal: 104 -> 170-210) and 1.3-1.6x at 2k causal (90 -> 120-145, fewer key
blocks per head to hide the causal tail). 32x64/8w/1s loses to 32x128 by ~10% (8 warps on 64 keys split the wgmma
N: 48 64x16x32 QGMMAs where 32x128 issues 24 64x32x32), and under Triton 3.6 32x128/8w/3s (18 LDL/STL in its
loops) loses to 32x128/8w/1s (0): spill inside the step loop is what costs. The dQ tiles differ by < 5% (128x32
keeps 128 rows of q / dO resident, half the K / V traffic of 64x64; both issue 64x32x32 QGMMAs for S and dP, and
64x128x32 against 64x64x32 for dQ). Still below cuDNN (234 / 684 / 629) and our bf16 backward: the three K-major
transposes (bwd.py [Note] FP8) and the 255-register dK/dV pass stay. d256 / d224: dq 64x32/8w/3s clearly beats the
32x32 mma.sync dQ, but every wgmma dK/dV tile spills in its loops, so the best pair (32x64/8w/1s, 64x32/8w/3s)
gains only 1.1-1.4x (58 -> 65-80, 53 -> 60-75), and 64x64/8w/1s dK/dV (626 LDL/STL) is slower than 32x64; if
32x64/8w/1s dK/dV loses to the default, d256 needs a split head dim in the dK/dV pass, not other tiles.

Measured (H100 80GB HBM3, torch 2.11, Triton 3.6.0, session 22; 47 s with the compiles), TFLOP/s, the default
first:

    config                          default  32x128/1s  32x128/1s  32x64/1s  32x64/1s  32x128/3s
                                             + 64x64/3s + 128x32/3s + 64x64   + 128x32  + 128x32/3s
    b4 h32 s2048 d128 causal          90.4      103.4      124.9       74.1      84.5      124.5
    b2 h16 s8192 d128                108.5      121.2      149.7       83.1      95.7      148.7
    b1 h32 s16384 d128 causal        103.8      121.9      153.4       79.5      91.5      152.9
    (d256 / d224: the four candidates 0.91-1.02x of the 32x32 default: 59.3 / 53.4)

The best pair (dK/dV 32x128/8w/1s, dQ 128x32/8w/3s) is 1.38 / 1.38 / 1.48x, below the 1.6-2x predicted (125 /
150 / 153 against 120-145 / 180-220 / 170-210); its gradients differ from the default's by at most half an e4m3
step at the maximum. 32x64/8w/1s loses to the default (its predicted ~10% behind 32x128 was 30-40%). d256: as
predicted, no tile pair gains; the dK/dV pass needs a split head dim. NOT landed: on
tests/test_fp8_bwd_kernel.py's decode row (b3 h8/2, s_q 1, s_kv 100, d128, causal bottom-right) that pair leaves
NaN in dV, differently from run to run, where the default tiles give the same bits every run (the same shape
under the Triton interpreter with these tiles: no NaN, so the kernel's logic holds and the compiled sm_90 code
does not). ``case_check`` now runs every candidate on the test's shapes after the timings.

Session 23, ``--configs 0`` (same GPU, Triton 3.6.0): default 91.7, the five candidates 103.4 / 124.9 / 74.0 / 84.5
/ 124.5 TFLOP/s (as session 22). Case check, three runs each into NaN-filled outputs: every candidate clean on
the six other shapes; on the decode row NaN in dV for dK/dV 32x128/8w/1s + dQ 128x32/8w/3s (again) and for
32x64/8w/1s + 64x64/8w/3s, none this time for 32x128/8w/1s + 64x64/8w/3s (NaN in session 22) nor for
32x64/8w/1s + 128x32/8w/3s; 32x128/8w/3s + 128x32/8w/3s (124.5, the same speed as the best) clean, and with it
in plan._BWD_FP8_SM90 tests/test_fp8_bwd_kernel.py + test_fp8.py passed three times (15 GPU tests each). So
every 1-stage dK/dV tile at 8 warps has left NaN in dV on that shape in some run, and which dQ tile runs beside
it changes only the odds: a run-to-run race, not a tile-specific miscompile. The PTX of the 1-stage dK/dV kernel
(this shape's specialization) has a CTA barrier before every shared-memory store and after every fence, so the
race is not a missing barrier there; not found. The 3-stage pair is not landed either: "clean in six runs" is
not proof against a race, and the 1-stage pair's NaN is not understood. Next: the same case check at 100 runs
per candidate (``--configs 0 --case-runs 100 --case-only decode_row``), and compute-sanitizer (racecheck) on the
decode row with the 1-stage kernel.

Session 24 (same GPU; ``--no-timing`` runs the case check alone). Triton 3.6.0, decode row, 100 runs each: NaN
in dV in 100 of 100 runs for 32x128/8w/1s + 128x32/8w/3s (24576 NaN in the first) and 32x64/8w/1s +
64x64/8w/3s (64), none in 100 for the other four, the 3-stage pair among them; every test shape 20 runs each:
only those two pairs, only on the decode row. So not the odds of a race but two kernels that fail there every
time. compute-sanitizer on the decode row (one run, ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``): memcheck 0 errors,
initcheck 0 errors (no read outside an allocation, no read of unwritten global memory); racecheck reports shared
memory hazards only in the Gluon forward that builds the test's o and stats (warp-specialized, synchronized by
mbarriers: not understood by the tool), none in the backward passes. The TTGIR of the 1-stage and 3-stage dK/dV
kernels (32x128/8w, causal) differ only in lse / delta going through async copies: q and dO reach their wgmmas
the same way in both (a register load, a shared store, a fence, each wgmma waited at once). Triton 3.9.0 (the
carried pack), decode row, 50 runs each: no NaN for any candidate, and ``--configs 0``: default 85.0, the
candidates 102.7 / 122.7 / 70.3 / 79.2 / 126.6 TFLOP/s (the 3-stage pair 1.49x). So a Triton 3.6 code-generation
fault in those two kernels, gone in 3.9, not located. Landed: the 3-stage pair is plan._BWD_FP8_SM90's d128 entry
(3.6 1.36x, 3.9 1.49x); tests/test_fp8_bwd_kernel.py passed with it on 3.9 (10 GPU tests).
"""
import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SURVEY_DIMS = (64, 128, 256)
SIDES = (32, 64, 128)          # block_m, block_n: 32 at least, an 8-bit MMA's K-step
WARPS = (4, 8)
STAGES = (1, 2, 3)
SMEM_LIMIT = 227 * 1024        # H100: the most dynamic shared memory one block may have
PASSES = ("dkdv", "dq")

# --------------------------------------------------------------------------------------------- static survey


def tile_grid():
    """Every (block_m, block_n, num_warps, num_stages) the survey compiles."""
    return [(m, n, w, s) for m, n in itertools.product(SIDES, SIDES) for w in WARPS for s in STAGES]


def default_tiles(d):
    """The plan's (dK/dV, dQ) FP8 tiles for head-dim bucket ``d``, as 4-tuples."""
    from fusedattn.plan import _BWD_FP8_SM90
    return tuple((t.block_m, t.block_n, t.num_warps, t.num_stages) for t in _BWD_FP8_SM90[d])


def fp8_bwd_spec(d, causal):
    """(pointer types, constexprs) of the FP8 backward's passes as ``tools/aot_check.bwd_fp8_variants``
    compiles them: e4m3 q/k/v/o, e5m2 dO (the recipe's usual), bf16 gradients, no masks but ``causal``."""
    import triton
    from aot_check import BASE_SWITCHES
    bd = max(32, triton.next_power_of_2(d))
    c = dict(BASE_SWITCHES, BLOCK_D=bd, BLOCK_DV=bd, EVEN_D=bd == d, EVEN_DV=bd == d, VARLEN=False, FP8=True,
             FP8_INTERP=False, FP8_MMA16=False, HAS_RIGHT=causal)
    e4 = "*fp8e4nv"
    ptrs = dict(Q=e4, K=e4, V=e4, O=e4, DO="*fp8e5", LSE="*fp32", DELTA="*fp32", DK="*bf16", DV="*bf16",
                DBIAS="*fp32", DQ="*bf16", SEQ_Q="*i32", SEQ_KV="*i32", BIAS=e4, SLOPES="*fp32", CU_Q="*i32",
                CU_KV="*i32", FP8_SCALES="*fp32", AMAX="*fp32")
    return ptrs, c


def _tool(name):
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


STL_BYTES = {"": 4, ".64": 8, ".128": 16, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2}


def inner_loop_local(text: str) -> int:
    """Local-memory instructions (LDL / STL: spill traffic) inside the innermost loops of a SASS listing,
    per trip of each, summed: a spill there costs every step; one outside (the prologue, the epilogue, the
    GQA head loop around the step loops) costs once per program or head."""
    from sass_loops import loop_spans        # tools/ (on sys.path for --sass)
    lines = text.splitlines()
    loops = [(first, last) for _, first, last in loop_spans(text)]
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return sum(len(re.findall(r"\b(?:LDL|STL)\b", "\n".join(lines[a:b + 1]))) for a, b in inner)


def sass_counts(cubin: bytes):
    """(QGMMA, HMMA, spill-store bytes, LDL/STL in the innermost loops) of a cubin's SASS, and its registers
    (cuobjdump -res-usage)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    qgmma = len(re.findall(r"\bQGMMA\.", text))
    hmma = len(re.findall(r"\bHMMA\.", text))
    spill = sum(STL_BYTES.get(m, 4) for m in re.findall(r"\bSTL((?:\.\w+)?)\s", text))
    regs = re.search(r"REG:(\d+)", res)
    return qgmma, hmma, spill, inner_loop_local(text), int(regs.group(1)) if regs else -1


def compile_one(job):
    """Compile one pass for one tile (a process-pool task); returns its survey record (``error`` on failure)."""
    d, pass_, tile, causal = job
    rec = dict(d=d, pass_=pass_, tile=list(tile), causal=causal)
    t0 = time.time()
    try:
        from aot_check import compile_kernel
        from fusedattn.backends.triton import bwd
        ptrs, c = fp8_bwd_spec(d, causal)
        kern, extra = ((bwd._attn_bwd_dkdv, dict(WRITE_DBIAS=False)) if pass_ == "dkdv" else
                       (bwd._attn_bwd_dq, dict(REVERSE_M=True, WRITE_DELTA=True)))
        k = compile_kernel(kern, ptrs, dict(c, BLOCK_M=tile[0], BLOCK_N=tile[1], **extra), tile[2], tile[3],
                           jit_like=True)
        ir = k.asm["ttgir"]
        qgmma, hmma, spill, loop_local, regs = sass_counts(k.asm["cubin"])
        rec.update(smem=k.metadata.shared, regs=regs, spill=spill, loop_local=loop_local, qgmma=qgmma, hmma=hmma,
                   wg_dots=len(re.findall(r"ttng\.warp_group_dot ", ir)), sync_dots=len(re.findall(r"tt\.dot ", ir)))
    except Exception as exc:     # a tile Triton or ptxas refuses is a result too
        rec["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else ''}"
    rec["secs"] = round(time.time() - t0, 1)
    return rec


def _key(rec):
    return (rec["d"], rec["pass_"], tuple(rec["tile"]), rec["causal"])


def run_jobs(jobs, done, path, workers):
    """Compile the jobs not in ``done`` (dict key -> record) on ``workers`` processes, saving as they finish."""
    todo = [j for j in jobs if (j[0], j[1], tuple(j[2]), j[3]) not in done]
    if not todo:
        return
    print(f"compiling {len(todo)} kernels on {workers} processes ...", file=sys.stderr, flush=True)
    t0 = time.time()
    with ProcessPoolExecutor(workers) as pool:
        for i, rec in enumerate(pool.map(compile_one, todo), 1):
            done[_key(rec)] = rec
            if i % 10 == 0 or i == len(todo):
                save(done, path)
                print(f"  {i}/{len(todo)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)


def save(done, path):
    with open(path, "w") as f:
        json.dump(sorted(done.values(), key=lambda r: (r["d"], r["pass_"], r["tile"], r["causal"])), f, indent=0)


def load(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {_key(r): r for r in json.load(f)}


def all_wgmma(rec):
    return "error" not in rec and rec["sync_dots"] == 0 and rec["hmma"] == 0 and rec["wg_dots"] > 0


def fits(rec):
    return "error" not in rec and rec["smem"] <= SMEM_LIMIT


def survey(dims, workers, path, only=None):
    """Causal kernels for every tile, then non-causal ones for the all-wgmma tiles that fit (and the defaults).
    only: {(d, pass): tiles} to compile instead of the whole grid (--tiles-from). Returns {key: record}."""
    done = load(path)
    grid = {(d, p): (only or {}).get((d, p), tile_grid()) for d in dims for p in PASSES}
    run_jobs([(d, p, t, True) for (d, p), tiles in grid.items() for t in tiles], done, path, workers)
    second = []
    for d in dims:
        defaults = default_tiles(d)
        for i, p in enumerate(PASSES):
            for t in grid[(d, p)]:
                rec = done[(d, p, t, True)]
                if (all_wgmma(rec) and fits(rec)) or t == defaults[i]:
                    second.append((d, p, t, False))
    run_jobs(second, done, path, workers)
    return done


# ------------------------------------------------------------------------------------------------ shortlist


def worst(done, rec, field):
    """The larger ``field`` of the causal and the non-causal kernel (the causal one's if the other is missing)."""
    nc = done.get((rec["d"], rec["pass_"], tuple(rec["tile"]), False))
    return max(rec[field], nc[field] if nc and "error" not in nc else 0)


def rank_key(done, rec):
    """Best first: the least spill traffic inside the step loops, then the least spill anywhere (causal and not),
    then the larger tile (more MMA work per operand byte loaded, and a larger wgmma N), then more stages (loads
    in flight), then fewer registers."""
    m, n, w, s = rec["tile"]
    return (worst(done, rec, "loop_local"), worst(done, rec, "spill"), -m * n, -s, rec["regs"], w)


def shortlist(done, d, pass_, keep=2):
    """The ``keep`` best all-wgmma tiles of a pass that fit, one per (block_m, block_n, warps) shape (its
    best stage count), so the GPU run compares shapes, not only pipelining depth."""
    recs = [r for (dd, p, t, c), r in done.items() if dd == d and p == pass_ and c and all_wgmma(r) and fits(r)]
    best = {}
    for r in sorted(recs, key=lambda r: rank_key(done, r)):
        best.setdefault(tuple(r["tile"][:3]), r)
    return [tuple(r["tile"]) for r in sorted(best.values(), key=lambda r: rank_key(done, r))[:keep]]


def candidates_from(done, dims=SURVEY_DIMS):
    """{d: [(dK/dV tile, dQ tile), ...]}: the default first, then the best two tiles of each pass crossed
    (four pairs: the GPU run can tell which pass a gain comes from)."""
    out = {}
    for d in dims:
        pairs = [default_tiles(d)]
        for pair in itertools.product(shortlist(done, d, "dkdv"), shortlist(done, d, "dq")):
            if pair not in pairs:
                pairs.append(pair)
        out[d] = pairs
    return out


# ---------------------------------------------------------------------------------------------------- tables


def tile_name(t):
    return f"{t[0]}x{t[1]}/{t[2]}w/{t[3]}s"


def row(done, rec, default):
    if "error" in rec:
        return f"  {rec['pass_']:4} {tile_name(rec['tile']):13} error: {rec['error'][:90]}"
    nc = done.get((rec["d"], rec["pass_"], tuple(rec["tile"]), False))
    nc_txt = "-" if nc is None else "err" if "error" in nc else f"{nc['spill']}/{nc['loop_local']}"
    mma = "wgmma" if all_wgmma(rec) else "SYNC" if rec["wg_dots"] == 0 else "mixed"
    return (f"  {rec['pass_']:4} {tile_name(rec['tile']):13} {rec['smem'] / 1024:5.1f}K{'' if fits(rec) else ' OVER'} "
            f"regs {rec['regs']:3} spill {rec['spill']:5}/{rec['loop_local']:<4} nc {nc_txt:>9} {mma:5} "
            f"wg {rec['wg_dots']:2}/{rec['wg_dots'] + rec['sync_dots']:2} QGMMA {rec['qgmma']:3} HMMA {rec['hmma']:3}"
            f"{'  <- default' if default else ''}")


def print_tables(done, dims, full, top=None):
    import triton
    print(f"Triton {triton.__version__}, sm_90a, e4m3 q/k/v/o, e5m2 dO, bf16 grads. Causal kernels: shared memory\n"
          f"(limit {SMEM_LIMIT // 1024}K), registers, spill-store bytes / LDL+STL in the step loops (nc: the same, "
          f"non-causal),\nwg: dots lowered to wgmma / all FP8 dots (TTGIR), QGMMA / HMMA: SASS instructions")
    for d in dims:
        defaults = default_tiles(d)
        print(f"\nd={d}")
        for i, p in enumerate(PASSES):
            recs = sorted((r for (dd, pp, t, c), r in done.items() if dd == d and pp == p and c),
                          key=lambda r: ("error" in r, not all_wgmma(r), rank_key(done, r) if "error" not in r
                                         else ()))
            shown = [r for r in recs if full or tuple(r["tile"]) == defaults[i] or (all_wgmma(r) and fits(r))]
            n_wg = sum(all_wgmma(r) for r in recs)
            n_fit = sum(all_wgmma(r) and fits(r) for r in recs)
            n_ok = sum(all_wgmma(r) and fits(r) and worst(done, r, "spill") == 0 for r in recs)
            n_loop = sum(all_wgmma(r) and fits(r) and worst(done, r, "loop_local") == 0 for r in recs)
            print(f" {p}: {len(recs)} tiles, {n_wg} all-wgmma ({n_fit} fit): {n_ok} spill nothing, {n_loop} nothing "
                  f"in the step loops (causal and not)")
            kept = shown[:top] + [r for r in shown[top:] if tuple(r["tile"]) == defaults[i]] if top else shown
            for r in kept:
                print(row(done, r, tuple(r["tile"]) == defaults[i]))
    print("\nshortlist (CANDIDATES, default first):")
    for d, pairs in candidates_from(done, dims).items():
        print(f"    {d}: {pairs},")


def sass_main(args):
    import triton
    dims = tuple(args.d) if args.d else SURVEY_DIMS
    path = args.json or os.path.join(tempfile.gettempdir(), f"fp8_bwd_tiles-triton{triton.__version__}.json")
    t0 = time.time()
    only = None
    if args.tiles_from:      # another run's GPU candidates (e.g. another Triton's): a cheaper cross-check
        pairs = candidates_from(load(args.tiles_from), dims)
        only = {(d, p): sorted({pair[i] for pair in pairs[d]}) for d in dims for i, p in enumerate(PASSES)}
    done = survey(dims, args.jobs, path, only)
    print_tables(done, dims, args.full, args.top)
    print(f"\n({len(done)} kernels in {path}; this run {time.time() - t0:.0f} s)")


# ------------------------------------------------------------------------------------------------- GPU mode

# The GPU run's tiles per head-dim bucket: (dK/dV, dQ) 4-tuples (block_m, block_n, warps, stages), the
# default (plan's route) first, then the static survey's shortlist (``--sass`` prints it: the best two
# all-wgmma, fitting, least-spilling tiles of each pass, crossed). Triton 3.6, 2026-11-26.
CANDIDATES = {
    64: [((32, 64, 4, 2), (64, 64, 4, 2)), ((32, 128, 8, 1), (128, 64, 8, 3)), ((32, 128, 8, 1), (64, 128, 8, 3)),
         ((32, 64, 4, 2), (128, 64, 8, 3)), ((32, 64, 4, 2), (64, 128, 8, 3)),       # no d64 config: not timed
         # fp16 MMAs (session 28): the 16-bit backward's d64 tiles (a GPU test saw dK differ between two runs
         # at 64x64/4/3: case-check them, --no-timing) and two narrower
         ((64, 64, 4, 3), (64, 64, 4, 3), "mma16"), ((64, 64, 4, 2), (64, 64, 4, 2), "mma16"),
         ((32, 64, 4, 2), (64, 64, 4, 2), "mma16")],
    # d128, session 28: plan's route first (fp16 MMAs, 64x64/4/2 both: 167 / 199 / 199 TFLOP/s on Triton 3.6 against
    # the FP8 MMAs' best, next, 125 / 148 / 153), then fp16-MMA neighbours of the 16-bit backward's tiles
    128: [((64, 64, 4, 2), (64, 64, 4, 2), "mma16"), ((32, 128, 8, 3), (128, 32, 8, 3)),
          ((32, 128, 8, 2), (64, 64, 4, 2), "mma16"), ((64, 64, 4, 3), (64, 64, 4, 3), "mma16"),
          ((64, 128, 8, 2), (64, 64, 4, 2), "mma16"), ((64, 64, 4, 2), (128, 64, 8, 2), "mma16")],
    256: [((32, 32, 8, 1), (32, 32, 8, 1)), ((32, 64, 8, 1), (64, 32, 8, 3)), ((32, 64, 8, 1), (64, 64, 8, 2)),
          ((64, 64, 8, 1), (64, 32, 8, 3)), ((64, 64, 8, 1), (64, 64, 8, 2)),
          # fp16 MMAs (session 28, untimed): the 16-bit backward's d256 tiles and two wider ones
          ((32, 32, 4, 2), (32, 32, 4, 2), "mma16"), ((32, 64, 4, 2), (64, 32, 4, 2), "mma16"),
          ((64, 32, 8, 2), (32, 64, 8, 2), "mma16")],
}


def candidate_tiles(args):
    """{bucket: [(dkdv, dq), ...]} from --survey (a --sass JSON file) or the module's CANDIDATES."""
    return candidates_from(load(args.survey)) if args.survey else CANDIDATES


def fp8_configs(args):
    """The bench's five FP8 configs, then this probe's own (index 5: d64, which the bench's ANCHORS-derived
    group has none of, so the d64 candidates get timed)."""
    from fusedattn import bench
    cfgs = [c for c in bench.fp8_configs() if c.table == "fp8"]
    cfgs.append(bench.Config("fp8", 8, 16, 16, 4096, 4096, 64, "e4m3", causal=True))
    return [c for i, c in enumerate(cfgs) if args.configs is None or i in args.configs]


def bucket(d):
    from fusedattn.plan import _bucket
    return _bucket(d)


def patched_tiles(d, pair):
    """A copy of plan's FP8 backward tiles (the fp16-MMA table for an ``mma16`` candidate) with bucket ``d``'s
    tiles replaced by ``pair`` (two 4-tuples, and "mma16" as a third item for the FP8_MMA16 switch)."""
    from fusedattn import plan
    table = dict(plan._BWD_FP8_MMA16_SM90 if is_mma16(pair) else plan._BWD_FP8_SM90)
    table[d] = tuple(plan.Tiles(*t) for t in pair[:2])
    return table


def is_mma16(pair):
    return len(pair) > 2 and pair[2] == "mma16"


def use_candidate(d, pair):
    """Route bucket ``d``'s FP8 backward to ``pair`` (plan's table and its FP8_BWD_MMA16 switch); returns the
    function that puts plan back."""
    from fusedattn import plan
    saved = plan._BWD_FP8_SM90, plan._BWD_FP8_MMA16_SM90, plan.FP8_BWD_MMA16
    plan.FP8_BWD_MMA16 = is_mma16(pair)
    if is_mma16(pair):
        plan._BWD_FP8_MMA16_SM90 = patched_tiles(d, pair)
    else:
        plan._BWD_FP8_SM90 = patched_tiles(d, pair)

    def restore():
        plan._BWD_FP8_SM90, plan._BWD_FP8_MMA16_SM90, plan.FP8_BWD_MMA16 = saved
    return restore


def pair_name(pair):
    return f"dkdv {tile_name(pair[0])} dq {tile_name(pair[1])}" + (" fp16 MMAs" if is_mma16(pair) else "")


def dry_run(args):
    """The GPU run's plan: configs, FLOPs, candidates (no GPU, no compile)."""
    from fusedattn import bench
    cands = candidate_tiles(args)
    for cfg in fp8_configs(args):
        flops = bench.fwd_flops(cfg) * 2.5
        pairs = cands[bucket(cfg.d)]
        print(f"{cfg.name}: {flops / 1e12:.2f} TFLOP per backward, bucket d{bucket(cfg.d)}, {len(pairs)} candidates")
        for i, pair in enumerate(pairs):
            print(f"    {'default ' if i == 0 else 'cand    '}{pair_name(pair)}")
    n = sum(len(cands[bucket(c.d)]) for c in fp8_configs(args))
    print(f"{n} timings; every candidate's two kernels compiled first, side by side")


def rel_diff(x, ref):
    """max |x - ref| / max |ref| in fp32."""
    x, ref = x.float(), ref.float()
    den = ref.abs().max().item()
    return (x - ref).abs().max().item() / den if den > 0 else (x - ref).abs().max().item()


def prepare(cfg):
    """(backward closure, FLOPs) of one config: bench's inputs and 'ours' FP8 runner; runs the forward."""
    import torch
    from fusedattn import bench
    inp = bench.make_fp8_inputs(cfg, torch.device("cuda"))
    bwd = bench.prepare_ours_fp8(cfg, True)(inp).make_bwd()
    return bwd, bench.fwd_flops(cfg) * 2.5


def compile_ahead(preps, cands):
    """Compile every (config, candidate)'s kernels on the compile threads; prints failures and goes on."""
    from fusedattn.backends.triton import launch
    t0 = time.time()
    errors = 0
    try:
        with launch.compiling_ahead() as ahead:
            for cfg, (bwd, _) in preps:
                for pair in cands[bucket(cfg.d)]:
                    restore = use_candidate(bucket(cfg.d), pair)
                    try:
                        bwd()
                    except Exception as exc:
                        errors += 1
                        print(f"  ahead {cfg.name} {pair_name(pair)}: {type(exc).__name__}: {exc}", flush=True)
                    finally:
                        restore()
        for future in ahead.futures:
            try:
                future.result()
            except Exception as exc:
                errors += 1
                print(f"  compile error: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    except Exception as exc:     # the facility itself failing only costs time: the timings compile on first call
        print(f"  compile ahead failed ({type(exc).__name__}: {exc}); compiling on first call", flush=True)
    print(f"compiled ahead in {time.time() - t0:.0f} s ({errors} errors)", flush=True)


def time_config(cfg, bwd, flops, pairs, rep):
    """Time each candidate of one config (the default first: the reference) and check it against it."""
    import torch
    from triton.testing import do_bench
    ref, base = None, None
    for i, pair in enumerate(pairs):
        restore = use_candidate(bucket(cfg.d), pair)
        try:
            out = [t.clone() for t in bwd()]      # dQ, dK, dV, amax dQ / dK / dV / dP
            torch.cuda.synchronize()
            ms = do_bench(bwd, warmup=25, rep=rep, return_mode="median")
            tflops = flops / ms / 1e9
            if i == 0:
                ref, base = out, tflops
                check = "reference"
            else:
                diffs = [rel_diff(x, r) for x, r in zip(out, ref)] if ref is not None else []
                check = ("dQ/dK/dV " + " ".join(f"{x:.3g}" for x in diffs[:3]) + " amax " +
                         " ".join(f"{x:.2g}" for x in diffs[3:]) + ("  CHECK" if max(diffs[:3]) > 0.13 else "")
                         if diffs else "no reference")
            speed = f" ({tflops / base:.2f}x)" if base and i else ""
            print(f"  {'default' if i == 0 else 'cand   '} {pair_name(pair)}: {ms:8.3f} ms {tflops:6.1f} TFLOP/s"
                  f"{speed}  {check}", flush=True)
        except Exception as exc:      # one candidate failing (compile, launch, shared memory) is a result
            print(f"  {'default' if i == 0 else 'cand   '} {pair_name(pair)}: FAILED {type(exc).__name__}: "
                  f"{str(exc).strip()[:300]}", flush=True)
        finally:
            restore()


def case_check(cands, device="cuda", runs=3, only=None):
    """Every candidate on tests/test_fp8_bwd_kernel.py's shapes (odd sizes, GQA / MQA, masks, padding, one
    decode row; ``only``: the cases whose name contains it): ``runs`` runs each into NaN-filled gradients,
    which must come back with no NaN and bit-equal (the kernel is deterministic). Session 22 found dK/dV
    32x128/8w/1s leaving NaN in dV, differently from run to run, on the decode row (s_q 1, s_kv 100, GQA 8/2,
    d128) that no bench config has; session 23 saw it with other 1-stage dK/dV tiles, in some runs only: a
    race, so a verdict needs many runs (``--case-runs``)."""
    import torch
    from fusedattn import fp8
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import test_fp8_bwd_kernel as cases
    for name, (shape, _mask, _dt, _do, _o, g_dtype, _bshd) in cases.CASES.items():
        if only and only not in name:
            continue
        b, h_q, h_kv, s_q, s_kv, d, d_v = shape
        q8, k8, v8, o, do8, stats, sc, mask = cases._problem(name, device, "triton")
        scales = {n: torch.tensor([x], dtype=torch.float32, device=device) for n, x in sc.items()}
        lens = [fp8._lengths(mask.get(n), n, b, s, device) if n in mask else None
                for n, s in (("seq_len_q", s_q), ("seq_len_kv", s_kv))]
        for pair in cands[bucket(max(d, d_v))]:
            restore = use_candidate(bucket(max(d, d_v)), pair)
            try:
                first, bad, same = None, [], True
                for _ in range(runs):
                    bufs = [torch.full(sh, float("nan"), dtype=g_dtype, device=device)
                            for sh in ((b, h_q, s_q, d), (b, h_kv, s_kv, d), (b, h_kv, s_kv, d_v))]
                    res = fp8._backward_kernel(q8, k8, v8, o, do8, stats, scales, d ** -0.5, mask["band"], *lens,
                                               g_dtype, *bufs)
                    got = [x.float().cpu() for x in res]
                    nan = [int(x.isnan().sum()) for x in got]
                    if any(nan):
                        bad.append(nan)
                    first = first or got
                    same = same and all(torch.equal(x, y) for x, y in zip(first, got))
                verdict = ("ok" if same and not bad else
                           f"BAD: NaN in {len(bad)} of {runs} runs "
                           f"(dQ/dK/dV/... counts, first: {bad[0] if bad else 0}), "
                           f"bit-equal runs {same}")
            except Exception as exc:
                verdict = f"FAILED {type(exc).__name__}: {str(exc).strip()[:200]}"
            finally:
                restore()
            print(f"  case {name:28s} {pair_name(pair)}: {verdict}", flush=True)


def gpu_main(args):
    import torch
    import triton
    cands = candidate_tiles(args)
    if not torch.cuda.is_available():
        raise SystemExit("no GPU here: --sass (static survey) and --dry-run (the plan) run without one")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    t0 = time.time()
    preps = []
    for cfg in [] if args.no_timing else fp8_configs(args):
        try:
            preps.append((cfg, prepare(cfg)))
        except Exception as exc:
            print(f"{cfg.name}: inputs / forward FAILED {type(exc).__name__}: {exc}", flush=True)
    if not args.no_ahead:
        compile_ahead(preps, cands)
    for cfg, (bwd, flops) in preps:
        print(f"{cfg.name} ({flops / 1e12:.2f} TFLOP per backward)", flush=True)
        time_config(cfg, bwd, flops, cands[bucket(cfg.d)], args.rep)
    if not args.no_cases:
        print(f"the candidates on tests/test_fp8_bwd_kernel.py's shapes (NaN-filled outputs, {args.case_runs} runs)",
              flush=True)
        case_check(cands, runs=args.case_runs, only=args.case_only)
    print(f"total {time.time() - t0:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="static survey for sm_90a (no GPU)")
    ap.add_argument("--d", type=int, action="append", help="--sass: head dims (default 64, 128, 256)")
    ap.add_argument("--full", action="store_true", help="--sass: print every tile, not only the all-wgmma ones")
    ap.add_argument("--top", type=int, help="--sass: print the best N tiles of each pass (and the default)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="--sass: compile processes")
    ap.add_argument("--json", help="--sass: the survey's record file (default: a temp file per Triton version)")
    ap.add_argument("--tiles-from", help="--sass: compile only the GPU candidates (default and shortlist) of "
                                         "this earlier --sass JSON (e.g. another Triton's)")
    ap.add_argument("--survey", help="GPU / --dry-run: take the candidates from this --sass JSON file")
    ap.add_argument("--dry-run", action="store_true", help="print the GPU run's plan (no GPU)")
    ap.add_argument("--configs", type=lambda s: [int(x) for x in s.split(",")],
                    help="GPU: indices into the five FP8 configs (default all)")
    ap.add_argument("--rep", type=int, default=300, help="GPU: do_bench rep (ms)")
    ap.add_argument("--no-timing", action="store_true", help="GPU: only the case check (e.g. under compute-sanitizer)")
    ap.add_argument("--no-cases", action="store_true", help="GPU: skip the test shapes' NaN / determinism check")
    ap.add_argument("--no-ahead", action="store_true", help="GPU: compile on first call, one kernel at a time")
    ap.add_argument("--case-runs", type=int, default=3, help="GPU: runs per candidate and test shape")
    ap.add_argument("--case-only", help="GPU: only the test shapes whose name contains this (e.g. decode_row)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))     # aot_check (--sass)
    if args.sass:
        sass_main(args)
    elif args.dry_run:
        dry_run(args)
    else:
        gpu_main(args)


if __name__ == "__main__":
    main()
