"""No GPU needed: the Gluon forward's step loops (over pages; at d128 with no band mask) hand P to the PV
wgmma without moving it between registers (fwd_sm90 [Note] packed P, its last paragraph), on this Triton's compiler
and ptxas (a child process, ``conftest.run_compile_child``: CI's interpreter compiles nothing). CUDA 12's ptxas
(Triton 3.6-3.8) packs P in place after the PV wait; CUDA 13's (Triton 3.9) packed it early into other registers
and moved them into the A operand's with 21-26 IMAD.MOV per step, until ``PAGED_P_F32`` carried P as fp32 over pages and
``DENSE_P_F32`` at d128 without a band mask, ALiBi or dropout. The builds: the bench's prefill (bottom-right
causal, packed varlen queries, pages of 16, the persistent grid), a d128 forward on the persistent grid and a
padded one on the one-tile grid; their step loops are those with one tile's exponentials (64 rows x 128 keys
/ 128 threads + 2 for the row maxima). The GPU tests (tests/test_gluon_fwd_paged.py, test_gluon_fwd.py) check
their results.
"""
import pytest
from conftest import run_compile_child


def _step_moves(build):
    """(instructions, IMAD.MOV) of each step loop of the Gluon forward compiled as ``build`` (keywords of
    tools/gluon_check.py's compile_fwd after d, causal, dtype)."""
    out = run_compile_child(
        "import gluon_check as c\n"
        f"k = c.compile_fwd({build})\n"
        "for _, n, body in c.inner_loops(c.sass(k)):\n"
        "    print('LOOP', n, sum('MUFU.EX2' in b for b in body), sum('IMAD.MOV' in b for b in body))\n")
    steps = [(n, moves) for n, ex2, moves in
             (tuple(int(x) for x in line.split()[1:]) for line in out.splitlines() if line.startswith("LOOP"))
             if ex2 == 66]
    assert len(steps) >= 2, f"no step loops found: {out[-2000:]}"
    return steps


@pytest.mark.parametrize("build", [
    "128, True, 'bf16', seq_q=True, seq_kv=True, varlen=True, bottom_right=True, page=16, persistent=True",
    "128, False, 'bf16', persistent=True",
    "128, False, 'fp16', seq_q=True, seq_kv=True",
], ids=["paged_prefill", "dense_persistent", "dense_padded"])
def test_gluon_fwd_steps_move_no_p_registers(build):
    steps = _step_moves(build)
    assert all(moves <= 4 for _, moves in steps), (
        f"(instructions, IMAD.MOV) per step loop: {steps}; a step should move at most a few scalars, not P")


def _tile_loop_loads(build):
    """(instructions, LDG) of each consumer work-tile loop of the persistent Gluon forward compiled as ``build``:
    the loops holding more wgmmas than one step's 16 (a tile's steps and its output) and no TMA copy (the load
    warps')."""
    out = run_compile_child(
        "import gluon_check as c\n"
        f"k = c.compile_fwd({build})\n"
        "for _, n, body in c.loops(c.sass(k)):\n"
        "    if any('EXIT' in b for b in body):\n"
        "        continue\n"
        "    print('LOOP', n, sum('GMMA' in b for b in body), sum('UTMALDG' in b for b in body),\n"
        "          sum(' LDG' in b for b in body))\n")
    loops = [tuple(int(x) for x in line.split()[1:]) for line in out.splitlines() if line.startswith("LOOP")]
    tiles = [(n, ldg) for n, mma, tma, ldg in loops if mma > 16 and tma == 0]
    assert tiles, f"no consumer work-tile loops found: {out[-2000:]}"
    return tiles


@pytest.mark.parametrize("build", [
    "128, True, 'bf16', seq_q=True, seq_kv=True, varlen=True, bottom_right=True, page=16, persistent=True",
    "128, True, 'fp16', seq_q=True, seq_kv=True, persistent=True",
], ids=["paged_prefill", "padded_persistent"])
def test_gluon_fwd_persistent_consumers_take_lengths_from_the_slot(build):
    """The persistent grid's padded builds: the producer posts each work tile's lengths and packed row beside its
    number (fwd_sm90 ``_post_tile``), so the consumers' per-tile code loads nothing from global memory (before:
    5 LDG per tile, each an L2 round trip on the warpgroup's path; bench/NOTES.md 84)."""
    tiles = _tile_loop_loads(build)
    assert all(ldg == 0 for _, ldg in tiles), f"(instructions, LDG) per consumer work-tile loop: {tiles}"
