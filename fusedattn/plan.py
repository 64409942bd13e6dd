"""plan(problem, backend) -> Plan: which backend runs a problem, and with which tiles.

Plans are cached on the problem's static key, so a repeated call costs one
dict lookup. Tile tables are per (pass, head-dim bucket, dtype size) with the
measurement or reason beside each entry; nothing autotunes at run time.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .problem import MAX_HEAD_DIM, InvalidArgumentError, NotSupportedError

BACKENDS = ("auto", "triton", "cpu")


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False               # K/V through tensor descriptors (Hopper bulk copies)
    warp_specialize: bool = False   # tl.range(..., warp_specialize=True) on the mask-free loop


@dataclass(frozen=True)
class Plan:
    backend: str          # "triton" | "cpu"
    fwd: Tiles | None
    bwd: Tiles | None     # dK/dV pass (block_m: query rows per step, block_n: keys per program)
    bwd_dq: Tiles | None  # dQ pass
    fwd_gluon: bool = False   # forward on the Gluon sm_90 kernel when its supports() accepts the call
    bwd_gluon: bool = False   # backward on the Gluon sm_90 dQ and dK/dV kernels when both accept the call


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _bucket(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


# Hopper (sm90) forward tiles: (block_m, block_n, warps, stages) by (head-dim bucket, bytes per element).
# Starting points from PyTorch's FlexAttention H100 table, then measured (bench/NOTES.md, entries 1 and 10).
_FWD_SM90 = {
    # H100 bench/sweep.py 2026-11-22, after the one-FMA loop (TFLOP/s): d64 64x64/4 warps/3 stages 347
    # (128x64/8: 342), d64 causal 231 (211); d224 128x64/8 warps/2 stages 419; d256 causal 452.
    (64, 2): Tiles(64, 64, 4, 3),
    (128, 2): Tiles(128, 64, 8, 3),      # long sequences: 16k causal 502 (64x64: 451), GQA 4k 452 (444), 8k 505
    (256, 2): Tiles(128, 64, 8, 2),      # 3 stages exceed shared memory at d 224/256
    (64, 4): Tiles(64, 64, 4, 3),
    (128, 4): Tiles(64, 32, 4, 3),
    (256, 4): Tiles(32, 32, 4, 2),
}
# d128 up to 2k query rows: two 1-warpgroup CTAs per SM beat one 2-warpgroup CTA (b4 h32 s2048 causal: 400 vs 376)
_FWD_SM90_SHORT_D128 = Tiles(64, 64, 4, 3)
_SHORT_ROWS = 2048
# Backward dK/dV (block_m: query rows per step, block_n: keys per program) and dQ passes.
# H100 sweep: 64x64 with 4 warps beat 64x128 with 8 on d64 (285 vs 223) and d128 (430 vs 375 on 8k).
_BWD_SM90 = {
    (64, 2): Tiles(64, 64, 4, 3),
    (128, 2): Tiles(64, 64, 4, 2),
    (256, 2): Tiles(32, 32, 4, 2),       # 134 TFLOP/s at d 224 (64x64/8 warps: 121): spills, bench/NOTES.md
    (64, 4): Tiles(32, 64, 4, 2),
    (128, 4): Tiles(32, 64, 4, 1),
    (256, 4): Tiles(16, 32, 4, 1),
}
# GQA/MQA at d128: the dK/dV program loops over the group's query heads; 32-row steps spill less
# (ptxas: 80 vs 548 bytes) and measured 349 vs 310 TFLOP/s (b4 h32/8 s4096 causal); on MHA they lose (8k: 372 vs 425).
_BWD_SM90_GQA_D128 = Tiles(32, 64, 4, 2)
_BWD_DQ_SM90 = {
    (64, 2): Tiles(64, 64, 4, 3),
    (128, 2): Tiles(64, 64, 4, 2),
    (256, 2): Tiles(32, 32, 4, 2),
    (64, 4): Tiles(64, 32, 4, 2),
    (128, 4): Tiles(64, 32, 4, 1),
    (256, 4): Tiles(32, 16, 4, 1),
}
# The Gluon sm_90 forward (backends/gluon/fwd_sm90.py: TMA producer warp, two consumer warpgroups,
# QK^T and PV in flight under the softmax) at d = d_v in 128, 224, 256, fp16/bf16, no mask or causal.
# H100 (bench/GLUON_NOTES.md): 1.22-1.33x the Triton forward at d128, 1.31-1.41x at d224/256. d64 only
# for plain calls (no band, lengths or ALiBi): session 8 (bench/fwd_ab.py, packed P), fp16 b8 h12 s1k
# eager 368 against Triton's 344 TFLOP/s (CUDA graphs 343 / 325), but causal 164 / 229 (graphs 212 /
# 235): short causal rows are the Triton kernel's (bench/NOTES.md 39).
_GLUON_FWD_DIMS = (128, 224, 256)
_GLUON_FWD_PLAIN_DIMS = (64, )
# Gluon backward (bench/GLUON_NOTES.md "Backward"): the dQ pass, then the Gluon dK/dV pass where it takes the
# call, else the Triton one (functional._run_gluon_backward). d = d_v = 128: on the H100 the dQ pass runs
# 1.12-1.26x and the dK/dV pass 1.03-1.29x our Triton passes. At d=64 they measured 0.90-0.92x (dQ) and
# 0.99-1.00x (dK/dV), so at d=64 only the single-pass kernel (bwd_fused_sm90; not deterministic) is tried,
# no mask or causal (with dropout or not: bwd_fused_sm90.DROPOUT_DIMS, 1.51x the Triton pair at b8 h12 2k, p 0.1),
# from GLUON_BWD_FUSED_MIN_WORK on; everything else at d=64 keeps the Triton pair.
# d = 224/256: the dQ pass on 32-key tiles (the Triton passes spill).
_GLUON_BWD_DIMS = (64, 128, 224, 256)
# head dim -> the least score work (b * h_q * s_q * s_kv, halved under a causal mask) from which the single pass
# runs, at head dims where it is the only Gluon backward tried (smaller calls and the rest keep the Triton
# pair). H100, bench/d64_fused.py (session 23), single pass / Triton pair: CUDA graphs 1.04-1.06x at b8 h12 1k,
# 1.07-1.10x causal, 1.06-1.08x b4 h32 2k causal, 1.11-1.13x b2 h16 8k; eager 1k 0.57x / 0.58x causal (the
# single pass's launches take more host time than its ~0.2 ms of GPU work: host-bound), 2k causal 1.02x,
# 8k 1.11x. 2^28 was the 2k causal call's work. Session 43, with K and V in registers (bwd_fused_sm90.KV_REGS):
# single pass / pair 1.14x graphs and 1.12x eager at b8 h12 1k, 1.13x / 1.11x causal (3.6.0; bench/NOTES.md 83),
# no longer host-bound, so from 2^25 on: the 1k causal call (1.5 * 2^25) and up.
GLUON_BWD_FUSED_MIN_WORK = {64: 2 ** 25}
_GLUON_ENV = "FUSEDATTN_GLUON"          # =0 turns the Gluon kernels off (A/B runs, debugging)
# Interpreter: small tiles so short test sequences still span several blocks.
_INTERPRET = Tiles(32, 16, 4, 1)
# FP8 forward (the portable kernel's FP8 switch, fusedattn.fp8): key tiles of at least 32 (an 8-bit MMA's
# K-step). Timed on an H100 with V staged keys-innermost (bench/fp8_v_layout.py, Triton 3.6, TFLOP/s):
# d128 64x64/8 warps/3 stages 196 (2k causal) and 259 (8k); 128x64/8/3 339 and 492; 128x64/8/2 255 and
# 385. d256 64x64/8/2 257; 128x64/8/2 82 (spills). d <= 64: not timed (ptxas: 64x64/4/3 spills nothing).
_FWD_FP8_SM90 = {64: Tiles(64, 64, 4, 3), 128: Tiles(128, 64, 8, 3), 256: Tiles(64, 64, 8, 2)}
_INTERPRET_FP8 = Tiles(32, 32, 4, 1)


# FP8 backward (the portable kernel's FP8 switch, backends/triton/bwd.py launch_bwd_fp8): (dK/dV pass, dQ pass);
# every tile side at least 32 (an 8-bit MMA's K-step: the dK/dV pass sums over block_m rows, the dQ pass over
# block_n keys). Chosen by ptxas for sm_90 (tools/aot_check.bwd_fp8_variants, Triton 3.6, JIT-like strides), not
# timed: dK/dV d64 32x64/4/2 255 regs no spill (64x64/4/2: 368 bytes), d128 64x32/8/1 232 no spill (64x64/8/1:
# 116 bytes), d256 32x32/8/1 24 bytes (the least found); dQ d64 64x64/4/2 168 regs, d128 128x32/8/2 232, d256
# 32x32/8/1 182, none spilling. Timed on an H100 (bench/fp8_bwd_tiles.py): d128 dK/dV 32x128/8/1 with dQ 128x32/8/3
# runs 1.38-1.48x the 64x32/8/1 + 128x32/8/2 pair (its dots wgmma), but leaves NaN in dV on one test shape (a
# decode row, s_kv 100, GQA 8/2) in every run (100 of 100), as does 32x64/8/1 + 64x64/8/3; memcheck and initcheck
# find nothing, the interpreter gives no NaN: a fault of the compiled 1-stage wgmma kernels, not understood (bench/
# NOTES.md 63). d128 takes dK/dV 32x128/8/3 (Triton 3.9's best tile; 3.6 spills 18 LDL/STL in its loops) with dQ
# 128x32/8/3 instead: 1.36x on Triton 3.6 (124.5 against 91.7 TFLOP/s, b4 h32 2k causal), 1.49x on 3.9 (126.6
# against 85.0), clean in every run: Triton 3.6 the decode row 100 of 100, every test shape 20 of 20; 3.9 the decode
# row 50 of 50 (there no candidate left NaN) and tests/test_fp8_bwd_kernel.py.
_BWD_FP8_SM90 = {64: (Tiles(32, 64, 4, 2), Tiles(64, 64, 4, 2)), 128: (Tiles(32, 128, 8, 3), Tiles(128, 32, 8, 3)),
                 256: (Tiles(32, 32, 8, 1), Tiles(32, 32, 8, 1))}


# The FP8 backward's products as fp16 MMAs on the FP8 values (bwd.py ``FP8_MMA16``, ``common.fp8_dot``: exact, the
# same rounding points; only the MMA rate and the accumulation, fp32 in a 16-bit wgmma, differ). Timed on an H100
# (bench/fp8_bwd_tiles.py, Triton 3.6, session 28, TFLOP/s, b4 h32 2k causal / b2 h16 8k / b1 h32 16k causal,
# d128): the best FP8-MMA pair (dK/dV 32x128/8/3, dQ 128x32/8/3) 125 / 148 / 153; fp16 MMAs with dK/dV and dQ
# 64x64/4/2 167 / 199 / 199, 32x128/8/2 + 64x64/4/2 164 / 196 / 202, 32x128/8/2 + 128x32/8/3 154 / 186 / 192;
# every candidate clean on the test shapes (NaN-filled outputs, 3 runs each, bit-equal). So d128 takes them. d256
# (b4 h16 4k causal): FP8 MMAs 32x32/8/1 58 TFLOP/s, fp16 MMAs 32x32/4/2 both passes 100. d64 (b8 h16 4k causal,
# session 29, `--configs 5`): FP8 MMAs 32x64/4/2 + 64x64/4/2 130, fp16 MMAs 64x64/4/3 both passes 197, 64x64/4/2
# 186, 32x64/4/2 + 64x64/4/2 159; clean on the test shapes.
# FP8_BWD_MMA16 True / False forces one route at every head dim (tests, bench/fp8_bwd_tiles.py).
FP8_BWD_MMA16 = None
# The FP8 backward on the Gluon sm_90 single-pass backward where it runs the call (d = d_v in 64 / 128, no mask or
# causal, no lengths: fusedattn.fp8._backward_gluon; bwd_fused_sm90 [Note] FP8), else the portable kernel above.
# H100, Triton 3.6.0, bench/fp8_bwd_gluon_ab.py (session 32), TFLOP/s portable -> Gluon: b4 h32 2k causal 153 -> 198,
# b2 h16 8k 196 -> 483, b1 h32 16k causal 199 -> 510 (cuDNN frontend's FP8 backward: 234 / 690 / 632);
# tests/test_gluon_fp8_bwd.py passes. d = d_v in 224 / 256: the two Gluon passes' FP8 switch (bwd_dkdv_sm90
# ``launch_bwd_fp8``, no mask, causal or windows; the portable kernel read 88 / 98 TFLOP/s there, H200, session 33).
# False sends every call to the portable kernel (tests, A/B); gluon_fp8_bwd.
FP8_BWD_GLUON = True
_GLUON_FP8_BWD_DIMS = (64, 128, 224, 256)
_FP8_BWD_MMA16_BUCKETS = (64, 128, 256)
_BWD_FP8_MMA16_SM90 = {64: (Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
                       128: (Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)),
                       256: (Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 2))}


def fp8_mma16_compiles_right(d: int, d_v: int) -> bool:
    """Whether the fp16-MMA switch of the portable FP8 kernels is trusted at head dims d, d_v on this Triton.

    Triton 3.6 (H100, session 28) faults with it where d pads its FP8 tile (``fwd.fp8_block_dim``) to another
    width than d_v's: d 48 / d_v 32 and 40 / 32 gave an illegal address (forward, window) or a dK that differs
    between two runs of the same call (backward), and a forward error 107x its bound (causal); every pair of
    one width passed (16, 24, 40, 64, 128 with d_v = d; the bench's 128, 224, 256), and 3.9.0 passed them all.
    So before 3.9 the switch needs one tile width for both (the FP8 MMAs, which those cases pass, run the
    rest); the interpreter takes it everywhere."""
    if interpreting():
        return True
    from .backends.compat import TRITON_VERSION
    from .backends.triton.fwd import fp8_block_dim          # late: the backends import plan
    return TRITON_VERSION >= (3, 9) or fp8_block_dim(d) == fp8_block_dim(d_v)


def fp8_bwd_mma16(d: int, d_v: int) -> bool:
    """Whether the FP8 backward of head dims d, d_v runs its products as fp16 MMAs on the FP8 values (the
    head-dim buckets where they were timed faster, unless ``FP8_BWD_MMA16`` forces a route; never where
    :func:`fp8_mma16_compiles_right` says no)."""
    if not fp8_mma16_compiles_right(d, d_v):
        return False
    if FP8_BWD_MMA16 is not None:
        return FP8_BWD_MMA16
    return _bucket(max(d, d_v)) in _FP8_BWD_MMA16_BUCKETS


def fp8_bwd_tiles(d: int, d_v: int):
    """``(dK/dV tiles, dQ tiles)`` of the FP8 backward for head dims d, d_v <= 256 (the fp16-MMA tiles when
    :func:`fp8_bwd_mma16`)."""
    if interpreting():
        return _INTERPRET_FP8, _INTERPRET_FP8
    table = _BWD_FP8_MMA16_SM90 if fp8_bwd_mma16(d, d_v) else _BWD_FP8_SM90
    return table[_bucket(max(d, d_v))]


# The portable FP8 forward's products as fp16 MMAs on the FP8 values (fwd.py ``FP8_MMA16``, as the backward's
# above), V as it comes (no keys-innermost copy). H100, Triton 3.6, session 28 (bench/fp8_v_layout.py --mma16,
# TFLOP/s, b4 h16 4k d256 causal / b32 h32 2k d224): FP8 MMAs 64x64/8/2 (V keys inner) 259 / 244; fp16 MMAs
# 128x64/8/3 326 / 307 (V d inner; 330 / 324 keys inner), 128x64/8/2 302 / 291, 64x64/4/2 308 / 283, 128x32/8/3
# 271 / 257, 64x128/8/2 214 / 198, 64x64/8/2 178 / 166. d64 / d128 run on the Gluon FP8 forward on an H100; their
# portable route keeps the FP8 MMAs (not timed). FP8_FWD_MMA16 True / False forces a route (tests, the probe).
FP8_FWD_MMA16 = None
_FP8_FWD_MMA16_BUCKETS = (256,)
_FWD_FP8_MMA16_SM90 = {64: Tiles(64, 64, 4, 3), 128: Tiles(128, 64, 8, 3), 256: Tiles(128, 64, 8, 3)}


def fp8_fwd_mma16(d: int, d_v: int) -> bool:
    """Whether the portable FP8 forward of head dims d, d_v runs its products as fp16 MMAs on the FP8 values
    (as :func:`fp8_bwd_mma16`)."""
    if not fp8_mma16_compiles_right(d, d_v):
        return False
    if FP8_FWD_MMA16 is not None:
        return FP8_FWD_MMA16
    return _bucket(max(d, d_v)) in _FP8_FWD_MMA16_BUCKETS


def fp8_fwd_tiles(d: int, d_v: int) -> Tiles:
    """Tiles of the FP8 forward (backends/triton/fwd.py ``launch_fwd_fp8``) for head dims d, d_v <= 256 (the
    fp16-MMA tiles when :func:`fp8_fwd_mma16`)."""
    if interpreting():
        return _INTERPRET_FP8
    return (_FWD_FP8_MMA16_SM90 if fp8_fwd_mma16(d, d_v) else _FWD_FP8_SM90)[_bucket(max(d, d_v))]


# The Gluon sm_90 forward's FP8 switch (backends/gluon/fwd_sm90.py [Note] FP8) takes these head dims (d = d_v)
# ahead of the portable kernel on an H100; its tiles are fwd_sm90.FP8_TILES (64-key tiles in 4 stages at
# d128, 128-key in 3 at d64: chosen by registers, tools/gluon_check.py fp8; not yet timed). d224 / 256 run the
# 16-bit kernel's MMAs on the FP8 values (fwd_sm90 [Note] FP8 on 16-bit MMAs, FP8_16_DIMS: the switch's per-tile
# accumulator does not fit beside a [64, 256] O).
_GLUON_FP8_FWD_DIMS = (64, 128, 224, 256)


# Triton types float8_e4m3fn tensors as fp8e4nv, which it compiles for CUDA GPUs of compute capability 8.9 and
# up only (Ada, Hopper, Blackwell); below that every kernel that reads one fails to compile ("type fp8e4nv not
# supported in this architecture", triton/language/core.py; backends/nvidia/compiler.py adds fp8e4nv at >= 89)
FP8_MIN_CAPABILITY = (8, 9)


def fp8_kernels_run(device: torch.device) -> bool:
    """Whether the FP8 kernels (fusedattn.fp8's forward and backward, the FP8 K/V cache's decode) can run on
    ``device``: a CUDA GPU of compute capability ``FP8_MIN_CAPABILITY`` or higher, or a CPU tensor's device
    (Triton's interpreter has every FP8 type). Elsewhere the exact torch emulation runs the call."""
    if device.type != "cuda":
        return True
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= \
        FP8_MIN_CAPABILITY


@functools.lru_cache(maxsize=64)
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def gluon_fp8_fwd(d: int, d_v: int) -> bool:
    """Whether fusedattn.fp8 tries the Gluon FP8 forward for head dims d, d_v (FUSEDATTN_GLUON=0: never)."""
    return os.environ.get(_GLUON_ENV, "1") != "0" and d == d_v and d in _GLUON_FP8_FWD_DIMS


def gluon_fp8_bwd(d: int, d_v: int) -> bool:
    """Whether fusedattn.fp8 tries the Gluon FP8 backward (``FP8_BWD_GLUON``; d = d_v in 64 / 128: the single-pass
    kernel, 224 / 256: the two passes) for head dims d, d_v (FUSEDATTN_GLUON=0: never)."""
    return FP8_BWD_GLUON and os.environ.get(_GLUON_ENV, "1") != "0" and d == d_v and d in _GLUON_FP8_BWD_DIMS


def choose_backend(backend: str, device_type: str) -> str:
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device_type == "cuda" else "cpu"
    if backend == "triton" and device_type == "cpu" and not interpreting():
        raise NotSupportedError(
            "backend='triton' on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported, or use backend='cpu'")
    if backend == "triton" and device_type not in ("cuda", "cpu"):
        raise NotSupportedError(f"backend='triton' needs CUDA tensors, got device type {device_type!r}")
    if backend == "cpu" and device_type != "cpu":
        raise NotSupportedError(f"backend='cpu' needs CPU tensors, got device type {device_type!r}")
    return backend


@functools.lru_cache(maxsize=1024)
def _plan_cached(static_key, backend: str, d: int, d_v: int, dtype: torch.dtype, device_type: str,
                 short: bool, grouped: bool, plain: bool) -> Plan:
    if max(d, d_v) > MAX_HEAD_DIM:
        return large_head_dim_plan(backend, max(d, d_v), device_type)
    backend = choose_backend(backend, device_type)
    if backend == "cpu":
        return Plan("cpu", None, None, None)
    if dtype == torch.float64:
        raise NotSupportedError("float64 runs on the CPU path only (backend='cpu')")
    if dtype == torch.bfloat16 and interpreting():
        import triton

        from .backends.interpreter_check import bf16_dot_ok
        if not bf16_dot_ok():
            raise NotSupportedError(
                f"bfloat16 under Triton's interpreter (TRITON_INTERPRET=1): Triton {triton.__version__}'s interpreter "
                "multiplies bfloat16 tiles wrongly in tl.dot (backends/interpreter_check.py), so the kernels would "
                "return garbage; use backend='cpu' (the same semantics in PyTorch), float16 or float32, or a GPU")
    if interpreting() or device_type == "cpu":
        return Plan("triton", _INTERPRET, _INTERPRET, _INTERPRET)
    key = (_bucket(max(d, d_v)), 4 if dtype == torch.float32 else 2)
    fwd, bwd = _FWD_SM90[key], _BWD_SM90[key]
    if key == (128, 2):
        fwd = _FWD_SM90_SHORT_D128 if short else fwd
        bwd = _BWD_SM90_GQA_D128 if grouped else bwd
    # where the Gluon forward is the faster choice; what it can compute is its own supports() at launch
    gluon = os.environ.get(_GLUON_ENV, "1") != "0" and d == d_v
    gluon_fwd = gluon and (d in _GLUON_FWD_DIMS or (plain and d in _GLUON_FWD_PLAIN_DIMS))
    return Plan("triton", fwd, bwd, _BWD_DQ_SM90[key], gluon_fwd, gluon and d in _GLUON_BWD_DIMS)


def large_head_dim_plan(backend: str, d_max: int, device_type: str) -> Plan:
    """Head dims past the kernels' MAX_HEAD_DIM (problem.MAX_HEAD_DIM_TORCH says how far) run the PyTorch
    path, ``backends/cpu.py``, on the tensors' own device: the kernels' semantics (masks, bias, ALiBi,
    paging, the same Philox dropout mask), O(s * chunk) memory, no fused kernel. ``backend='triton'``
    asked for a kernel that does not exist: refused."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cpu":
        choose_backend(backend, device_type)        # its device check
    elif backend == "triton":
        raise NotSupportedError(f"head dim {d_max} > {MAX_HEAD_DIM} has no Triton kernel; backend='auto' runs it "
                                f"on fusedattn's PyTorch path")
    if device_type != "cpu":
        from .backends import compat
        compat.warn_once("large-head-dim", f"head dim {d_max} > {MAX_HEAD_DIM}: no fused kernel takes it, so it "
                                           f"runs fusedattn's PyTorch path (chunked, in torch ops) on {device_type}")
    return Plan("cpu", None, None, None)


def plan(problem, backend: str = "auto") -> Plan:
    """The plan for ``problem``; cached on its static key, whether s_q is short, whether K/V heads are shared
    and whether the call is plain (no band, per-batch lengths or ALiBi)."""
    plain = problem.band is None and not (problem.has_seq_len_q or problem.has_seq_len_kv) and problem.alibi is None
    return _plan_cached(problem.static_key(), backend, problem.d, problem.d_v, problem.dtype,
                        problem.device_type, problem.s_q <= _SHORT_ROWS, problem.group > 1, plain)
