"""No GPU needed: the single-pass backward's dropout build (bwd_fused_sm90 [Note] dropout) compiles for sm_90 with this
Triton's compiler and ptxas (``tools/gluon_fused_check.compile_fused(dropout=True)``; a child process, since
Triton's interpreter, which CI turns on, compiles nothing), at d=64 (where it is routed, ``DROPOUT_DIMS``) and d=128,
no mask and causal; each step loop keeps the 16-bit kernel's 32 exponentials and gains the Philox rounds (each
round one 32 x 32 -> 64-bit multiply pair, ``dropout.philox4x32``: 4 calls x 10 rounds x 2 per thread and step)
beside the build without dropout. The GPU tests (tests/test_gluon_bwd_fused.py) check its results.
"""
from conftest import run_compile_child


def test_gluon_fused_dropout_compiles_for_sm90():
    out = run_compile_child(
        "import gluon_fused_check as c\n"
        "from gluon_check import sass\n"
        "from gluon_bwd_check import inner_loops\n"
        "for d in (64, 128):\n"
        "    for causal in (False, True):\n"
        "        for drop in (False, True):\n"
        "            k = c.compile_fused(causal, 'fp16' if d == 64 else 'bf16', d=d, dropout=drop)\n"
        "            for _, n, body in inner_loops(sass(k)):\n"
        "                print('LOOP', d, int(causal), int(drop), sum('MUFU.EX2' in b for b in body),\n"
        "                      sum('IMAD.WIDE.U32' in b for b in body))\n")
    loops = {}
    for line in out.splitlines():
        if line.startswith("LOOP"):
            d, causal, drop, ex2, wide = (int(x) for x in line.split()[1:])
            if ex2 == 32:        # the step loops (the producer's and the epilogue's have no exponentials)
                loops.setdefault((d, causal, drop), []).append(wide)
    for d in (64, 128):
        for causal in (0, 1):
            plain, dropped = loops.get((d, causal, 0)), loops.get((d, causal, 1))
            assert plain and dropped, f"d={d} causal={causal}: step loops missing: {loops}"
            assert min(dropped) >= max(plain) + 80, (
                f"d={d} causal={causal}: the dropout build's step loops lack the Philox rounds "
                f"(64-bit multiplies {dropped} against {plain} without dropout)")
