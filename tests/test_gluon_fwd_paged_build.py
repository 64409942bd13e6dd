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


def _recorded_build_locals(constants, kernel="fwd_sm90._attn_fwd_sm90", head_dim=128):
    """Stack bytes and, per loop with wgmmas, (instructions, MUFU.EX2, local-memory accesses: LDL / STL) of a Gluon
    kernel (``kernel``: module.function under backends/gluon) as a real launch compiles it: the shipped store's
    first recorded launch of head dim ``head_dim`` whose compile-time switches match ``constants`` (their reprs),
    rebuilt from this tree's sources (tools/recorded_locals.py: the JIT's specialization, pointer alignment and
    integer divisibility, which change ptxas's register allocation; tools/gluon_check.py's compile_fwd
    specializes on neither)."""
    out = run_compile_child(
        "import recorded_locals as r\n"
        f"found = next(r.recorded_launches({kernel!r}, {constants!r}, head_dim={head_dim}), None)\n"
        "assert found, 'no recorded launch with these switches'\n"
        "stack, _, loops = r.locals_of(found[1])\n"
        "print('STACK', stack)\n"
        "for loop in loops:\n"
        "    print('LOOP', *loop)\n")
    stack = int(next(line.split()[1] for line in out.splitlines() if line.startswith("STACK")))
    loops = [tuple(int(x) for x in line.split()[1:]) for line in out.splitlines() if line.startswith("LOOP")]
    assert loops, f"no loops with wgmmas found: {out[-2000:]}"
    return stack, loops


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gluon_fwd_prefill_masks_hold_no_column_indices(packed):
    """The bench's paged prefill (pages of 16, bottom-right causal, per-sequence key lengths; padded or packed
    queries) as its launch compiles: the band mask compares each score's column as an immediate against a bound
    less the thread's part (fwd_sm90 ``_band_keep`` THREAD_BITS), so no column index lives in a register across
    the persistent grid's tile loop. Before (Triton 3.9.0): LLVM hoisted a thread's 32 column indices (and 16 row
    indices of ``_zero_rows_from``) out of that loop, ptxas spilled them (224-256 bytes of stack) and reloaded
    them at every masked step (31-32 local accesses in the second warpgroup's masked step loop, ~100 per work
    tile; bench/NOTES.md 85). After: 72-88 bytes, at most a few accesses per step loop (on the H100: pages of 64
    +5.1%, pages of 16 -1.1%, its second warpgroup's unmasked step spilling one value instead; NOTES 86)."""
    stack, loops = _recorded_build_locals({"PAGE": "16", "PACKED_Q": repr(packed), "BOTTOM_RIGHT": "True",
                                           "HAS_SEQ_KV": "True", "PERSISTENT": "True"})
    steps = [(n, local) for n, ex2, local in loops if ex2 == 66]
    assert len(steps) >= 2, f"no step loops found: (instructions, MUFU.EX2, local accesses) {loops}"
    assert stack <= 128, f"{stack} bytes of stack (step loops: (instructions, local accesses) {steps})"
    assert all(local <= 8 for _, local in steps), f"(instructions, local accesses) per step loop: {steps}"


@pytest.mark.parametrize("page", ["16", "64"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gluon_fwd_paged_steps_touch_no_local_memory(packed, page):
    """The paged prefill's builds (bottom-right causal, pages of 16 or 64, padded or packed queries) as their launches
    compile: no step loop of either consumer warpgroup reads or writes local memory. On Triton 3.9 the fp32 P carry
    fills the registers, and ptxas kept one step value in local memory until the running max and sum crossed the step
    in shared memory (fwd_sm90 ``PAGED_STATS_SMEM``, [Note] packed P): before, 6 accesses per mask-free step of pages of
    16 (3 masked), 1-4 in the others; after, none, and the pages-of-16 prefill 2.6% faster in elapsed cycles (H100,
    bench/NOTES.md 89)."""
    constants = {"PAGE": page, "PACKED_Q": repr(packed), "BOTTOM_RIGHT": "True", "HAS_SEQ_KV": "True",
                 "PERSISTENT": "True"}
    stack, loops = _recorded_build_locals(constants)
    steps = [(n, local) for n, ex2, local in loops if ex2 == 66]
    assert len(steps) == 4, f"not two step loops per warpgroup: (instructions, MUFU.EX2, local accesses) {loops}"
    assert all(local == 0 for _, local in steps), (
        f"(instructions, local accesses) per step loop: {steps}; {stack} bytes of stack")


def test_gluon_dkdv_causal_mask_holds_no_row_indices():
    """The dK/dV pass under a causal mask (d128, as the backward of the 2k / 4k causal anchors records it): the
    transposed band mask compares each query row as an immediate (bwd_dkdv_sm90 ``_pt_tile``, fwd_sm90
    ``_band_keep``'s THREAD_BITS), so its masked step loops hold no local-memory access. Before (Triton 3.9.0): 7-8
    per masked step, the tile's 16 row indices of a thread hoisted out of the loops and spilled; 475-484
    instructions per masked step, after 388-395 (bench/NOTES.md 85)."""
    stack, loops = _recorded_build_locals({"HAS_RIGHT": "True", "HAS_LEFT": "False", "HAS_ALIBI": "False",
                                           "HAS_SEQ_Q": "False", "DROPOUT": "False", "FP8_EMU": "False"},
                                          "bwd_dkdv_sm90._attn_bwd_dkdv_sm90")
    assert all(local == 0 for _, _, local in loops), (
        f"(instructions, MUFU.EX2, local accesses) per loop with wgmmas: {loops}; {stack} bytes of stack")


def test_gluon_fwd_causal_masked_step_compares_immediates():
    """The causal d128 forward (the 2k causal anchor's build, persistent grid) as its launch compiles: a masked
    step (the diagonal tile) costs the unmasked step plus the band's compares and selects, each column an
    immediate (fwd_sm90 ``_band_keep``'s THREAD_BITS). With the column indices held in registers (n0 + arange),
    Triton 3.6.0 made 899-901 instructions of the masked step against 460-461 unmasked; as immediates 703-704
    (bench/NOTES.md 87: the 2k causal forward +2.1% on the H100)."""
    _, loops = _recorded_build_locals({"HAS_RIGHT": "True", "HAS_LEFT": "False", "BOTTOM_RIGHT": "False",
                                       "HAS_SEQ_KV": "False", "PAGE": "0", "HAS_ALIBI": "False", "DROPOUT": "False",
                                       "PERSISTENT": "True"})
    steps = sorted(n for n, ex2, _ in loops if ex2 == 66)
    assert len(steps) >= 2, f"no step loops found: (instructions, MUFU.EX2, local accesses) {loops}"
    assert steps[-1] <= 1.6 * steps[0], f"instructions per step loop, unmasked to masked: {steps}"
