"""The dropout keep-mask inside a Gluon kernel's wgmma accumulator tile, with no data movement.

The mask (``backends/cpu.py`` ``dropout_keep_chunk`` defines it; the Triton kernels and the CPU
path make the same one) takes one Philox4x32-10 call (Triton's ``tl.randint4x``) per group of
2 rows x 4 keys, {r, r + 8} x {k, k + 1, k + 8, k + 9} (r with bit 3 clear, k with bits 0 and 3
clear): its four 32-bit words give eight 16-bit values, and (row, key) takes half (key bit 0) of
word 2 * (row bit 3) + (key bit 3); it is kept iff that value >= threshold = p * 2^16.

Why that grouping: in the accumulator layout of a [64, N] wgmma tile (one warpgroup, four warps
along M) each thread holds rows {m, m + 8} and columns {2q, 2q + 1} + 8i. So in a score tile S
[rows, keys] (forward, dQ pass) a group's eight elements share one thread: a thread makes exactly
the words it needs, an eighth of a Philox call per score, and no thread waits on another. In the
dK/dV pass's S^T [keys, rows] keys k and k + 1 sit in lanes L and L + 4, which hold the same
groups; each of the two makes every other one (rows r and r + 1 alternate) and they swap the
16-bit halves the other needs with one shuffle per two words, so there too a thread makes an
eighth of a call per score (``_keep_t``).

How a tile is built (``keep``): the words are computed on a 4-D tensor of groups in a layout that
puts each group on the thread that holds its elements; the 16-bit halves and the words join as
new register dims, a permute puts every dim where its row or key bit belongs and a reshape gives
[64, N] in the accumulator layout up to the order of registers (the conversion is checked trivial
at compile time, ``assert_trivial``: it costs no instruction).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..cpu import dropout_threshold

# Philox4x32 constants (triton/language/random.py)
_KEY_A = gl.constexpr(0x9E3779B9)
_KEY_B = gl.constexpr(0xBB67AE85)
_ROUND_A = gl.constexpr(0xD2511F53)
_ROUND_B = gl.constexpr(0xCD9E8D57)


@gluon.constexpr_function
def _group_layout(n, keys_last):
    """Layout of the group tensor of a [64, n] accumulator tile (one warpgroup).

    keys_last (S [rows, keys]): dims (u, v, u', q) of row 16u + 8a + v and key 16u' + 8b + 2q + h,
    one group each; q in lanes 0-1, v in lanes 2-4, u in the warps, u' in registers.
    Else (S^T [keys, rows], ``_keep_t``): dims (u, v, u', w) of key 16u + 8a + v and row
    16u' + 8b + 2w + (v & 1): the groups a lane makes, every other row of those it holds; w in
    lanes 0-1, v in lanes 2-4, u in the warps, u' in registers.
    """
    u_bits = (n // 16).bit_length() - 1
    regs = [[0, 0, 1 << i, 0] for i in range(u_bits)]
    lanes = [[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [[1, 0, 0, 0], [2, 0, 0, 0]], [], [4, 8, n // 16, 4])


@gluon.jit
def philox4x32(seed_lo, seed_hi, c0, c1):
    """Philox4x32-10 of the counter (c0, c1, 0, 0) under key (seed_lo, seed_hi): Triton's
    ``tl.randint4x`` (same rounds and constants, so the same words). All uint32."""
    c2 = c0 * 0
    c3 = c2
    k0 = seed_lo
    k1 = seed_hi
    for _ in gl.static_range(10):
        # one 32 x 32 -> 64-bit multiply gives both halves (IMAD.WIDE.U32, not IMAD.HI + IMAD)
        pb = c2.to(gl.uint64) * _ROUND_B
        pa = c0.to(gl.uint64) * _ROUND_A
        c0 = (pb >> 32).to(gl.uint32) ^ c1 ^ k0
        c2 = (pa >> 32).to(gl.uint32) ^ c3 ^ k1
        c1 = pb.to(gl.uint32)
        c3 = pa.to(gl.uint32)
        k0 = k0 + _KEY_A
        k1 = k1 + _KEY_B
    return c0, c1, c2, c3


@gluon.jit
def _keep_halves(w, threshold):
    """Whether each 16-bit half of the uint32 words w is >= threshold, as a new last dim (low half
    first). The high half's test is w >= threshold << 16 (one compare, no shift)."""
    return gl.join((w & 0xFFFF) >= threshold.to(gl.uint32), w >= (threshold.to(gl.uint32) << 16))


def kernel_args(p) -> tuple:
    """The four dropout arguments of the Gluon kernels for problem ``p``: (DROP_SEED, DROP_OFFSET,
    DROP_THRESHOLD = p * 2^16, DROP_RESCALE = 1 / (1 - p)); placeholders without dropout."""
    if not p.has_dropout:
        return 0, 0, 0, 1.0
    return p.dropout_seed, p.dropout_offset, dropout_threshold(p.dropout_p), 1.0 / (1.0 - p.dropout_p)


@gluon.jit
def state(SEED, OFFSET, bh, S_Q, S_KV, THRESHOLD, RESCALE):
    """The dropout state ``keep`` takes for one (batch, query head) bh = batch * h_q + head: a tuple
    (seed low word, seed high word, counter base, key groups per row group, threshold, 1 / (1 - p)
    as RESCALE), from ``kernel_args``'s four. A group's Philox counter is
    OFFSET + (bh * RQ + row group) * KQ + key group with RQ = ceil(S_Q / 16) * 8 and
    KQ = ceil(S_KV / 16) * 4 (``backends/cpu.py`` ``dropout_keep_chunk``)."""
    # the JIT types a small int argument int32 (and 1 as a constant): widen both first
    seed = gl.to_tensor(SEED).to(gl.int64)
    kq = (S_KV + 15) // 16 * 4
    base = gl.to_tensor(OFFSET).to(gl.int64) + bh.to(gl.int64) * ((S_Q + 15) // 16 * 8) * kq
    return ((seed & 0xFFFFFFFF).to(gl.uint32), (seed >> 32).to(gl.uint32), base, kq, THRESHOLD, RESCALE)


@gluon.jit
def _prmt(a, b, selector):
    """PTX prmt.b32: bytes of the pair (b, a) picked by ``selector``'s four nibbles (uint32)."""
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, selector],
                                     dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _swap_lanes4(x):
    """x of lane L ^ 4 (uint32): the partner that holds the same rows and the other key of a pair."""
    return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, 0xffffffff;", "=r,r", [x],
                                     dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _keep_t(w0, w1, w2, w3, odd, threshold):
    """S^T's keep bits from the words of the groups a lane made (rows 2w + odd, ``_group_layout``),
    as dims (u, v, u', w) + (a, b, row bit 0): key bit 3, row bit 3, row bit 0.

    A lane with key parity ``odd`` needs half ``odd`` of every word of both rows 2w and 2w + 1: it
    packs the halves it keeps (words 0 and 1, 2 and 3: key bit 3 in the 16-bit position) and the
    halves its partner (lane ^ 4, the other parity) needs, which the partner made for the other row;
    one shuffle per packed pair swaps them."""
    keep_sel = gl.where(odd, 0x7632, 0x5410).to(gl.uint32)       # the high halves, or the low halves
    give_sel = gl.where(odd, 0x5410, 0x7632).to(gl.uint32)
    own01 = _prmt(w0, w1, keep_sel)
    own23 = _prmt(w2, w3, keep_sel)
    got01 = _swap_lanes4(_prmt(w0, w1, give_sel))
    got23 = _swap_lanes4(_prmt(w2, w3, give_sel))
    # the even row's words are the lane's own if its parity is even, else its partner's
    even01 = gl.where(odd, got01, own01)
    even23 = gl.where(odd, got23, own23)
    odd01 = gl.where(odd, own01, got01)
    odd23 = gl.where(odd, own23, got23)
    # per packed word: key bit 3 is the 16-bit half (``_keep_halves``), row bit 3 the word
    return gl.join(gl.join(_keep_halves(even01, threshold), _keep_halves(even23, threshold)),
                   gl.join(_keep_halves(odd01, threshold), _keep_halves(odd23, threshold)))


@gluon.jit
def keep(drop, m0, n0, layout: gl.constexpr, N: gl.constexpr, KEYS_LAST: gl.constexpr):
    """Keep-mask [64, N] (bool, in ``layout``: a one-warpgroup wgmma accumulator layout) of the tile
    whose element (m, n) is (row m0 + m, key n0 + n) if KEYS_LAST, else (key m0 + m, row n0 + n);
    m0 and n0 are multiples of 16, ``drop`` is ``state``'s tuple. The row and key group indices are
    (row >> 4) * 8 + (row & 7) and (key >> 4) * 4 + ((key & 7) >> 1)."""
    seed_lo = drop[0]
    seed_hi = drop[1]
    base = drop[2]
    kq = drop[3]
    threshold = drop[4]
    GL: gl.constexpr = _group_layout(N, KEYS_LAST)
    u = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, GL))))
    v = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, GL))))
    u2 = gl.arange(0, N // 16, layout=gl.SliceLayout(1, gl.SliceLayout(0, gl.SliceLayout(1, GL))))
    v2 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(1, GL))))
    if KEYS_LAST:
        rows = (m0 // 2 + 8 * u[:, None] + v[None, :])[:, :, None, None]                  # [4, 8, 1, 1]
        keys = (n0 // 4 + 4 * u2[:, None] + v2[None, :])[None, None, :, :]                 # [1, 1, N/16, 4]
        ctr = base + rows.to(gl.int64) * kq + keys
    else:
        keys = (m0 // 4 + 4 * u[:, None] + (v // 2)[None, :])[:, :, None, None]           # [4, 8, 1, 1]
        rows = (n0 // 2 + 8 * u2[:, None] + 2 * v2[None, :])[None, None, :, :]            # [1, 1, N/16, 4]
        odd = (v % 2)[None, :, None, None]
        ctr = base + (rows + odd).to(gl.int64) * kq + keys
    w0, w1, w2, w3 = philox4x32(seed_lo, seed_hi, (ctr & 0xFFFFFFFF).to(gl.uint32), (ctr >> 32).to(gl.uint32))
    if KEYS_LAST:
        # dims (u, v, u', q) + (h, b, a) -> (u, a, v, u', b, q, h): row 16u + 8a + v, key 16u' + 8b + 2q + h
        x = gl.join(gl.join(_keep_halves(w0, threshold), _keep_halves(w1, threshold)),
                    gl.join(_keep_halves(w2, threshold), _keep_halves(w3, threshold)))
        x = x.permute((0, 6, 1, 2, 5, 3, 4))
    else:
        # dims (u, v, u', w) + (a, b, c) -> (u, a, v, u', b, w, c): key 16u + 8a + v, row 16u' + 8b + 2w + c
        x = _keep_t(w0, w1, w2, w3, odd != 0, threshold)
        x = x.permute((0, 4, 1, 2, 5, 3, 6))
    return gl.convert_layout(x.reshape([64, N]), layout, assert_trivial=True)
