"""Test helpers: seeded random cases, NaN-guarded buffers, FlashAttention's error rule.

* :func:`guarded` places a tensor inside a NaN-filled buffer with margins and,
  optionally, a shuffled physical dim order with gaps between rows, so a kernel
  that writes outside the tensor (or into a stride gap) is caught by
  :meth:`Guarded.check_untouched`, and an unwritten output element stays NaN.
* :func:`assert_error_within` is FlashAttention's rule: the kernel's max error
  against a float64 reference must be at most ``factor`` times PyTorch's own
  same-precision error, plus a small floor.
* :func:`random_case` draws a geometry from weighted distributions (odd lengths,
  GQA, head dims 40..256, BSHD and gapped layouts) from a seed, and
  :meth:`Case.repro` prints a one-line repro.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Optional, Tuple, Union

import torch

FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}


class Guarded:
    """A tensor living inside a NaN-poisoned buffer."""

    def __init__(self, shape, dtype, device, order=(0, 1, 2, 3), gap=0, margin=8, fill="randn", gen=None):
        # physical layout: dims in `order` (outermost first); the innermost-but-one dim gets `gap` extra elements
        sizes = [shape[i] for i in order]
        strides = [0] * 4
        acc = 1
        for pos in range(3, -1, -1):
            dim = order[pos]
            strides[dim] = acc
            acc *= sizes[pos] + (gap if pos == 3 and gap and sizes[pos] > 0 else 0)
        self.numel_span = acc
        self.buffer = torch.full((acc + 2 * margin,), float("nan"), dtype=dtype, device=device)
        self.view = self.buffer.as_strided(shape, strides, storage_offset=margin)
        self.margin = margin
        if fill == "randn":
            self.view.copy_(torch.randn(shape, generator=gen).to(dtype))
        # map of which buffer elements belong to the tensor
        marker = torch.zeros(acc + 2 * margin, dtype=torch.bool)
        marker.as_strided(shape, strides, storage_offset=margin).fill_(True)
        self.inside = marker.to(device)

    def check_untouched(self, what="tensor"):
        """Fail if anything outside the tensor (margins, stride gaps) is no longer NaN."""
        outside = self.buffer[~self.inside]
        bad = (~torch.isnan(outside.float())).sum().item()
        assert bad == 0, f"{what}: {bad} elements written outside the tensor (margins or stride gaps)"


def guarded(shape, dtype, device, layout="bhsd", gen=None, fill="randn", margin=8):
    """A Guarded tensor of logical shape [b, h, s, d] in the given physical layout.

    layout: "bhsd" (contiguous), "bshd" (models' usual, seen through transpose),
    "gap" (BSHD with 8 unused elements after each row), "sbhd" (sequence outermost).
    margin: elements of NaN before the tensor; 8 keeps the base 16-byte aligned, an odd
    margin tests the misaligned-pointer path.
    """
    order, gap = {"bhsd": ((0, 1, 2, 3), 0), "bshd": ((0, 2, 1, 3), 0), "gap": ((0, 2, 1, 3), 8),
                  "sbhd": ((2, 0, 1, 3), 0)}[layout]
    return Guarded(shape, dtype, device, order=order, gap=gap, gen=gen, fill=fill, margin=margin)


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_error_within(got, gold, base, *, factor=2.0, floor=None, msg=""):
    """FlashAttention's rule: |got - gold| <= factor * |base - gold| + floor (max norms, no NaN)."""
    assert not torch.isnan(got).any(), f"NaN in result ({int(torch.isnan(got).sum())} elements). {msg}"
    floor = FLOOR[base.dtype] if floor is None else floor
    e_got, e_base = max_err(got, gold), max_err(base, gold)
    assert e_got <= factor * e_base + floor, (
        f"error {e_got:.3e} > {factor} x PyTorch's same-precision error {e_base:.3e} + {floor:.1e}. {msg}")


def delta_convention_floors(q, k, out, gold_out, do, probs, scale):
    """Floors (dQ, dK) for the part of the gradients' error that FlashAttention's convention adds.

    FlashAttention's backward takes D_i = rowsum(dO_i * O_i) from the output as stored (the FlashAttention-2
    paper's Algorithm 2, line 4; ``flash_bwd_preprocess`` reads the 16-bit O), and so do our kernels and the
    CPU path. So D_i is off by e_i = sum_c dO_ic (O_ic - gold O_ic), which dS_ij = P_ij (dP_ij - D_i) carries
    into dQ_i = scale sum_j dS_ij K_j and dK_j = scale sum_i dS_ij Q_i (a softcap's tanh' <= 1 only shrinks
    it). PyTorch's softmax backward has no such term: where P is one-hot (one key) its same-precision dS is
    exactly 0, so its error bounds nothing of this one (tests/test_feature_combinations.py, one key with
    dropout: O = V / (1 - p) rounds). The e_i are the call's own (``out``: the output it returned, itself
    checked against the reference), so the floor follows that output's rounding, not a worst case.

    q [b, h_q, s_q, d], k [b, h_kv, s_kv, d], out / gold_out / do [b, h_q, s_q, d_v], probs [b, h_q, s_q,
    s_kv] the float64 softmax before dropout; returns the max-norm floors (dq_floor, dk_floor)."""
    q, k, out, gold_out, do, probs = (t.detach().cpu().double() for t in (q, k, out, gold_out, do, probs))
    g = q.shape[1] // k.shape[1]
    e = (do * (out - gold_out)).sum(-1, keepdim=True).abs()                               # [b, h_q, s_q, 1]
    dq = scale * e * (probs @ k.repeat_interleave(g, dim=1).abs())                         # [b, h_q, s_q, d]
    dk = scale * (probs * e).transpose(-1, -2) @ q.abs()                                   # [b, h_q, s_kv, d]
    dk = dk.unflatten(1, (k.shape[1], g)).sum(2)                                           # the group's heads
    return dq.max().item() if dq.numel() else 0.0, dk.max().item() if dk.numel() else 0.0


def assert_lse_close(got, gold, *, tol=1e-3, msg=""):
    """Stats against the reference's log-sum-exp: -inf on exactly the rows that see no key (the
    package's convention), finite elsewhere and within ``tol * (1 + max |gold|)``; NaN or +inf
    (an unwritten NaN-filled buffer, a wrong convention) fails."""
    got, gold = got.detach().cpu().double(), gold.detach().cpu().double()
    assert got.shape == gold.shape, f"stats shape {tuple(got.shape)} != {tuple(gold.shape)}. {msg}"
    bad = torch.isnan(got) | (got == float("inf"))
    assert not bad.any(), f"NaN or +inf stats ({int(bad.sum())} rows: unwritten?). {msg}"
    empty_got, empty_gold = got == float("-inf"), gold == float("-inf")
    assert torch.equal(empty_got, empty_gold), (
        f"stats are -inf on {int(empty_got.sum())} rows, the reference on {int(empty_gold.sum())} (rows that "
        f"see no key must be -inf, the others finite). {msg}")
    fin = ~empty_gold
    if fin.any():
        err = (got[fin] - gold[fin]).abs().max().item()
        bound = tol * (1 + gold[fin].abs().max().item())
        assert err < bound, f"stats differ from the reference's log-sum-exp by {err:.3e} > {bound:.3e}. {msg}"


@dataclass
class Case:
    """One random attention configuration; ``repro()`` rebuilds it."""

    seed: int
    b: int
    h_q: int
    h_kv: int
    s_q: int
    s_kv: int
    d: int
    d_v: int
    dtype: str
    layout: str
    causal: bool = False
    causal_alignment: str = "top_left"
    window: Optional[Tuple[int, int]] = None
    margin: int = 8

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)

    def kwargs(self):
        return dict(causal=self.causal, causal_alignment=self.causal_alignment, window=self.window)

    def repro(self, test="tests/test_forward.py"):
        return f"repro: pytest {test} -k 'case{self.seed}-' ; {asdict(self)}"


def random_case(seed: int, dtypes=("float32", "float16"), max_s=300, head_dims=(40, 64, 96, 128, 224)) -> Case:
    """Draw a geometry from weighted distributions: odd lengths, s_q != s_kv both ways, GQA/MQA."""
    rng = random.Random(seed)
    s_choices = [1, 2, 17, 33, 64, 113, 128, 200, max_s]
    s_q = rng.choice(s_choices)
    s_kv = rng.choice(s_choices) if rng.random() < 0.6 else s_q
    h_kv = rng.choice([1, 2, 3])
    h_q = h_kv * rng.choice([1, 1, 2, 4])
    d = rng.choice(head_dims)
    d_v = d if rng.random() < 0.8 else rng.choice([32, 64, 96])
    mask = rng.random()
    causal, window = False, None
    if mask < 0.35:
        causal = True
    elif mask < 0.5:
        window = (rng.choice([-1, 0, 5, 40]), rng.choice([-1, 0, 3, 17]))
    return Case(seed=seed, b=rng.choice([1, 2, 3]), h_q=h_q, h_kv=h_kv, s_q=s_q, s_kv=s_kv, d=d, d_v=d_v,
                dtype=rng.choice(dtypes), layout=rng.choice(["bhsd", "bshd", "gap", "sbhd"]), causal=causal,
                causal_alignment=rng.choice(["top_left", "bottom_right"]), window=window,
                margin=rng.choice([8, 8, 8, 3]))


# ------------------------------------------------------------------------------------------------
# cases for the Hopper (Gluon) kernels' GPU tests: d = d_v, a mask named by its alignment

MODES = ("none", "top_left", "bottom_right")
# sliding windows (left, right), -1 unbounded: zero-width, left-only bands of several widths, two-sided,
# one side unbounded, a right reach past several tiles
WINDOWS = ((0, 0), (37, 0), (200, 0), (64, 64), (130, -1), (-1, 90), (5, 300))


@dataclass
class HopperCase:
    """One configuration for a Gluon sm_90 kernel test; ``repro(nodeid)`` rebuilds it.

    mode: "none" or the causal alignment; window: (left, right) with -1 unbounded (aligned by
    ``mode``, top-left when "none"); alibi: True (the paper's slopes for h_q heads) or a tuple of
    h_q slopes (a user's [h_q] tensor on the GPU); dropout: p, with
    the seed and counter offset derived from ``seed`` (an offset past 2^32 when seed is odd, so
    the counter's high word is exercised)."""

    seed: int
    b: int
    h_q: int
    h_kv: int
    s_q: int
    s_kv: int
    d: int
    dtype: str
    mode: str
    layout: str
    window: Optional[Tuple[int, int]] = None
    alibi: Union[bool, Tuple[float, ...]] = False
    dropout: float = 0.0

    def kwargs(self):
        kw = dict(causal=self.mode != "none", causal_alignment="top_left" if self.mode == "none" else self.mode)
        if self.window is not None:
            kw["window"] = self.window
        if isinstance(self.alibi, tuple):
            kw["alibi"] = torch.tensor(self.alibi, dtype=torch.float32, device="cuda")
        elif self.alibi:
            kw["alibi"] = True
        if self.dropout:
            kw.update(dropout_p=self.dropout, dropout_seed=self.seed * 7919 + (self.seed % 2) * 2 ** 40,
                      dropout_offset=(self.seed % 2) * (2 ** 32 + 5) + 11)
        return kw

    def repro(self, nodeid):
        return f"repro: pytest '{nodeid}' ; {asdict(self)}"


def window_alibi_case(seed_base: int, mode: str, window, alibi: bool) -> HopperCase:
    """The Gluon kernels' band test case: d=128 bf16, GQA 2, BSHD, seed from (mode, window, alibi);
    lengths alternate between s_q < s_kv and s_q > s_kv (partial tiles both ways)."""
    seed = seed_base + 100 * MODES.index(mode) + 10 * WINDOWS.index(window) + alibi
    s_q, s_kv = (700, 1000) if seed % 2 else (1000, 333)
    return HopperCase(seed=seed, b=1, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=128, dtype="bfloat16", mode=mode,
                      layout="bshd", window=window, alibi=alibi)


def random_hopper_case(seed: int, lengths) -> HopperCase:
    """Seeded geometry: GQA/MQA, lengths from ``lengths``, d 64/128, fp16/bf16, any mask mode, strided layouts."""
    rng = random.Random(seed)
    h_q, h_kv = rng.choice([(2, 2), (8, 2), (4, 1), (3, 3)])
    return HopperCase(seed=seed, b=rng.choice([1, 2]), h_q=h_q, h_kv=h_kv, s_q=rng.choice(lengths),
                      s_kv=rng.choice(lengths), d=rng.choice([64, 128]), dtype=rng.choice(["float16", "bfloat16"]),
                      mode=rng.choice(MODES), layout=rng.choice(["bshd", "bshd", "bhsd", "gap", "sbhd"]))


def backward_inputs(case: HopperCase):
    """A Gluon backward pass's inputs for ``case``, on the GPU: seeded q, k, v, dO in NaN-guarded
    buffers of the case's layout, the Triton forward's out and lse (fp32 [b, h_q, s_q]), delta =
    rowsum(dO * O) (fp32 contiguous [b * h_q, s_q], what the dK/dV pass reads) and the problem.
    Returns (p, extras, q, k, v, do, out, lse, delta); q, k, v, do are ``Guarded`` (``.view``)."""
    import fusedattn
    from .problem import make_problem
    gen = torch.Generator().manual_seed(case.seed)
    dt = getattr(torch, case.dtype)
    q = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, gen)
    k = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, gen)
    v = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, gen)
    do = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, gen)
    kw = case.kwargs()
    out, stats = fusedattn.attention_forward(q.view, k.view, v.view, return_stats=True, backend="triton", **kw)
    delta = (out.float() * do.view.float()).sum(-1).reshape(case.b * case.h_q, case.s_q).contiguous()
    p, extras = make_problem(q.view, k.view, v.view, **kw)
    return p, extras, q, k, v, do, out, stats[..., 0], delta


def triton_backward(p, extras, q, k, v, out, do, lse):
    """(dq, dk, dv) from the portable Triton backward alone (launch_bwd with a plan that names only
    Triton tiles), whatever the planner would route to: the reference kernel the Gluon passes are
    compared with. Shapes as ``fusedattn.attention_backward``; lse fp32 [b, h_q, s_q]."""
    from .backends.triton.bwd import launch_bwd
    from .plan import Plan, plan
    pl = plan(p, "triton")
    pl = Plan("triton", pl.fwd, pl.bwd, pl.bwd_dq)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launch_bwd(p, pl, q, k, v, out, do, lse, extras, dq, dk, dv, False)
    return dq, dk, dv


# padding: per-batch lengths seq_len_q / seq_len_kv (the Gluon kernels' padding tests)
PAD_SIDES = ("q", "kv", "both")
PAD_SHAPES = ((300, 1000), (1000, 257), (200, 200), (17, 300), (600, 600))   # (s_q, s_kv)


def pad_lengths(rng, b, s):
    """b >= 4 lengths in [0, s] that cover 0, 1, s and odd partial ones (in a seeded order)."""
    lens = [0, 1, s, rng.randrange(1, s + 1) | 1] + [rng.randrange(0, s + 1) for _ in range(b - 4)]
    rng.shuffle(lens)
    return [min(n, s) for n in lens]


def pad_case(case, side, seed):
    """(len_q, len_kv) lists for a case padded on ``side`` ("q", "kv" or "both"; None: unpadded side)."""
    rng = random.Random(seed)
    len_q = pad_lengths(rng, case.b, case.s_q) if side in ("q", "both") else None
    len_kv = pad_lengths(rng, case.b, case.s_kv) if side in ("kv", "both") else None
    return len_q, len_kv


def poison_padding(t, lens):
    """NaN into the rows of t [b, h, s, d] past each batch entry's length: in-bounds memory
    that TMA loads, which a kernel must neither use nor let leak (0 * NaN) into valid rows."""
    if lens is not None:
        for bi, n in enumerate(lens):
            t[bi, :, max(n, 0):] = float("nan")
