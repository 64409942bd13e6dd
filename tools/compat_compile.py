"""Compile every Gluon sm_90 kernel (and a few portable Triton variants) for sm_90 with no GPU, on
whichever Triton is installed: the first check of a new Triton release before any device time.

    python tools/compat_compile.py          # prints one line per kernel: ok / the compile error

Measured use (2026-11-25): found the Triton 3.9 Gluon break (``tma.async_copy_*`` removed) on a CPU machine.
"""
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton  # noqa: E402

import aot_check  # noqa: E402
import gluon_bwd_check  # noqa: E402
import gluon_check  # noqa: E402
import gluon_dq_check  # noqa: E402
import gluon_fused_check  # noqa: E402

CASES = [
    ("gluon fwd d128 causal", lambda: gluon_check.compile_fwd(128, True, "bf16")),
    ("gluon fwd d64 plain", lambda: gluon_check.compile_fwd(64, False, "fp16")),
    ("gluon fwd d256 window alibi", lambda: gluon_check.compile_fwd(256, True, "bf16", window=True, alibi=True)),
    ("gluon fwd d128 padded dropout", lambda: gluon_check.compile_fwd(128, False, "bf16", seq_q=True, seq_kv=True,
                                                                       dropout=True)),
    ("gluon fwd d128 persistent", lambda: gluon_check.compile_fwd(128, True, "bf16", persistent=True)),
    # issue 26: sinks in the Gluon forward (both grids; with ALiBi's row shift)
    ("gluon fwd d64 sink persistent", lambda: gluon_check.compile_fwd(64, False, "bf16", persistent=True, sink=True)),
    ("gluon fwd d128 causal sink alibi", lambda: gluon_check.compile_fwd(128, True, "bf16", alibi=True, sink=True)),
    # issue 25 item 3: paged K/V in the Gluon forward (pages smaller and larger than a key tile)
    ("gluon fwd d128 paged16 padded persistent", lambda: gluon_check.compile_fwd(128, True, "bf16", bottom_right=True,
                                                                               seq_kv=True, persistent=True, page=16)),
    ("gluon fwd d64 paged256", lambda: gluon_check.compile_fwd(64, True, "fp16", bottom_right=True, page=256)),
    # pages smaller than a tile: table entries a tile ahead, one copy per page and 64-column block
    ("gluon fwd d256 paged16 padded", lambda: gluon_check.compile_fwd(256, True, "bf16", bottom_right=True,
                                                                      seq_kv=True, page=16)),
    ("gluon fwd d64 paged8", lambda: gluon_check.compile_fwd(64, False, "fp16", page=8)),
    ("gluon dq d128 causal", lambda: gluon_dq_check.compile_dq(128, True, "bf16")),
    ("gluon dq d256", lambda: gluon_dq_check.compile_dq(256, False, "fp16")),
    ("gluon dkdv d128 causal", lambda: gluon_bwd_check.compile_dkdv(128, True, "bf16")),
    ("gluon dkdv d256 dropout", lambda: gluon_bwd_check.compile_dkdv(256, False, "bf16", dropout=True)),
    ("gluon fused d128 causal", lambda: gluon_fused_check.compile_fused(True, "bf16")),
    ("gluon fused d128", lambda: gluon_fused_check.compile_fused(False, "bf16")),
    ("triton fwd d64", lambda: aot_check.fwd_variant(64, 64, 64, 4, 3)),
    ("triton bwd d64", lambda: aot_check.bwd_variants(64, (64, 64, 4, 3), (64, 64, 4, 3))),
    # issue 25: [b, h] ALiBi slopes (a batch stride) in every kernel; head dims below 16 / odd (masked tiles)
    ("gluon dq d128 alibi", lambda: gluon_dq_check.compile_dq(128, True, "bf16", alibi=True)),
    ("gluon dkdv d128 causal alibi", lambda: gluon_bwd_check.compile_dkdv(128, True, "bf16", alibi=True)),
    ("triton fwd d3 alibi", lambda: aot_check.fwd_variant(3, 64, 64, 4, 2, HAS_ALIBI=True)),
    ("triton bwd d59 alibi", lambda: aot_check.bwd_variants(59, (64, 64, 4, 2), (64, 64, 4, 2), HAS_ALIBI=True)),
    # issue 26: dsink folded into the kernel that computes delta (atomics; deterministic=False)
    ("gluon dq d128 causal sink", lambda: gluon_dq_check.compile_dq(128, True, "bf16", sink=True)),
    ("gluon dq d128 padded alibi sink", lambda: gluon_dq_check.compile_dq(
        128, True, "bf16", bottom_right=True, alibi=True, seq_q=True, seq_kv=True, sink=True)),
    ("triton delta d128 sink", lambda: aot_check.delta_variant(128, HAS_SINK=True)),
    # issue 27: the portable forward's FP8 switch (plan._FWD_FP8_SM90 tiles; e4m3 and e5m2 in, FP8 / 16-bit out)
    ("triton fwd fp8 d64 causal e4m3->bf16", lambda: aot_check.fwd_fp8_variant(64, 64, 64, 4, 3)),
    ("triton fwd fp8 d128 e4m3->e4m3", lambda: aot_check.fwd_fp8_variant(128, 64, 64, 8, 3, out="fp8e4nv",
                                                                         HAS_RIGHT=False)),
    ("triton fwd fp8 d128 padded window e5m2->fp16", lambda: aot_check.fwd_fp8_variant(
        128, 64, 64, 8, 3, dtype="fp8e5", out="fp16", HAS_LEFT=True, HAS_SEQ_Q=True, HAS_SEQ_KV=True,
        BOTTOM_RIGHT=True)),
    ("triton fwd fp8 d40 causal e4m3->fp32", lambda: aot_check.fwd_fp8_variant(40, 64, 64, 4, 3, out="fp32")),
    ("triton fwd fp8 d256 e4m3->bf16", lambda: aot_check.fwd_fp8_variant(256, 64, 64, 8, 2)),
]


def main():
    failed = 0
    for name, fn in CASES:
        t = time.time()
        try:
            fn()
            print(f"ok    {name} ({time.time() - t:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 -- report every case
            failed += 1
            last = traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()[-1]
            print(f"FAIL  {name}: {last[:300]}", flush=True)
    print(f"Triton {triton.__version__}: {len(CASES) - failed} compiled, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
