"""No GPU needed: over a paged cache, the Gluon forward's step loops hand P to the PV wgmma without moving it
between registers (fwd_sm90 [Note] packed P, its last paragraph), on this Triton's compiler and ptxas (a child
process, ``conftest.run_compile_child``: CI's interpreter compiles nothing). CUDA 12's ptxas (Triton 3.6-3.8)
packs P in place after the PV wait; CUDA 13's (Triton 3.9) packed it early into other registers and moved them
into the A operand's with 21-26 IMAD.MOV per step, until ``PAGED_P_F32`` carried P as fp32 over pages. The build
is the bench's prefill (bottom-right causal, packed varlen queries, pages of 16, the persistent grid), whose
step loops are those with one tile's exponentials (64 rows x 128 keys / 128 threads + 2 for the row maxima).
The GPU tests (tests/test_gluon_fwd_paged.py) check its results.
"""
from conftest import run_compile_child


def test_gluon_fwd_paged_steps_move_no_p_registers():
    out = run_compile_child(
        "import gluon_check as c\n"
        "k = c.compile_fwd(128, True, 'bf16', seq_q=True, seq_kv=True, varlen=True, bottom_right=True, page=16,\n"
        "                  persistent=True)\n"
        "for _, n, body in c.inner_loops(c.sass(k)):\n"
        "    print('LOOP', n, sum('MUFU.EX2' in b for b in body), sum('IMAD.MOV' in b for b in body))\n")
    steps = [(n, moves) for n, ex2, moves in
             (tuple(int(x) for x in line.split()[1:]) for line in out.splitlines() if line.startswith("LOOP"))
             if ex2 == 66]
    assert len(steps) >= 2, f"no step loops found: {out[-2000:]}"
    assert all(moves <= 4 for _, moves in steps), (
        f"(instructions, IMAD.MOV) per step loop: {steps}; a step should move at most a few scalars, not P")
