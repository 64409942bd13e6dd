"""The functional door's bad input (issue 24, item 5): out-of-range ``seq_len_q`` / ``seq_len_kv``
values raise an error naming the argument (``validate=False`` skips the check, lengths are then
clamped); empty batches and zero-length sequences give what PyTorch's SDPA gives.

Every case is seeded and a failure prints a one-line repro (the node id and the case's parameters).
"""
import random

import pytest
import torch
import torch.nn.functional as F

import fusedattn
from fusedattn import problem as problem_mod
from fusedattn.problem import FusedAttnError, InvalidArgumentError, InvalidTypeError

S_Q, S_KV = 13, 21          # different, so an error naming the wrong bound is caught
D = 16


@pytest.fixture
def repro(request):
    """repro(**params) -> the one-line repro of the running test."""
    return lambda **kw: f"repro: pytest '{request.node.nodeid}' ; {kw}"


def inputs(device, seed, b=3, h_q=4, h_kv=2, s_q=S_Q, s_kv=S_KV, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_q, s_q, D, generator=gen).to(device)
    k = torch.randn(b, h_kv, s_kv, D, generator=gen).to(device)
    v = torch.randn(b, h_kv, s_kv, D, generator=gen).to(device)
    do = torch.randn(b, h_q, s_q, D, generator=gen).to(device)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, do


def expect_error(call, exc, needles, rep):
    """call() must raise exc (a FusedAttnError) whose message holds every needle."""
    try:
        call()
    except exc as e:
        msg = str(e)
        assert isinstance(e, FusedAttnError), f"{type(e).__name__} is not a FusedAttnError. {rep}"
    except Exception as e:  # noqa: BLE001 - any other error is a failure, with the repro
        pytest.fail(f"raised {type(e).__name__}: {e} instead of {exc.__name__}. {rep}")
    else:
        pytest.fail(f"no {exc.__name__} raised. {rep}")
    for needle in needles:
        assert needle in msg, f"message {msg!r} lacks {needle!r}. {rep}"
    return msg


def bad_lengths(seed, which, kind, b=3):
    """(seq_len kwargs, bad index, bad value): valid lengths with one entry out of range."""
    rng = random.Random(seed)
    s = S_Q if which == "seq_len_q" else S_KV
    vals = [rng.randint(0, s) for _ in range(b)]
    i = rng.randrange(b)
    vals[i] = -rng.randint(1, 5) if kind == "negative" else s + rng.randint(1, 5)
    return {which: vals}, i, vals[i]


def call_door(door, q, k, v, do, device, backend, lens, **kw):
    """Run one door with the given lengths (lists -> int32 tensors)."""
    t = {n: torch.tensor(x, dtype=torch.int32, device=device) for n, x in lens.items()}
    if door == "attention":
        return fusedattn.attention(q, k, v, backend=backend, **t, **kw)
    if door == "attention_grad":
        o = fusedattn.attention(q.requires_grad_(), k, v, backend=backend, **t, **kw)
        o.backward(do)
        return o
    if door == "attention_forward":
        return fusedattn.attention_forward(q, k, v, backend=backend, **t, **kw)
    # attention_backward: the forward's out/stats from valid inputs, then bad lengths in the backward
    out, stats = fusedattn.attention_forward(q, k, v, backend=backend, return_stats=True)
    return fusedattn.attention_backward(q, k, v, out, do, stats, backend=backend, **t, **kw)


DOORS = ("attention", "attention_grad", "attention_forward", "attention_backward")


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("which,kind", [("seq_len_q", "negative"), ("seq_len_q", "over"),
                                        ("seq_len_kv", "negative"), ("seq_len_kv", "over")])
def test_out_of_range_lengths_raise(which, kind, door, target, repro):
    device, backend = target
    seed = 100 * DOORS.index(door) + 10 * (which == "seq_len_kv") + (kind == "over")
    lens, i, val = bad_lengths(seed, which, kind)
    q, k, v, do = inputs(device, seed)
    rep = repro(seed=seed, door=door, lens=lens, s_q=S_Q, s_kv=S_KV)
    sym, s = ("s_q", S_Q) if which == "seq_len_q" else ("s_kv", S_KV)
    msg = expect_error(lambda: call_door(door, q, k, v, do, device, backend, lens), InvalidArgumentError,
                       [f"{which}[{i}] = {val}", f"[0, {sym}] = [0, {s}]", "validate=False"], rep)
    assert ("negative" in msg) == (kind == "negative"), f"{msg!r}. {rep}"


def test_many_bad_entries_are_counted(repro):
    q, k, v, _ = inputs("cpu", 7)
    lens = torch.tensor([S_KV + 1, 4, -2], dtype=torch.int32)
    expect_error(lambda: fusedattn.attention(q, k, v, seq_len_kv=lens), InvalidArgumentError,
                 [f"seq_len_kv[0] = {S_KV + 1} exceeds s_kv = {S_KV}", "(2 of 3 entries are out of range)"],
                 repro(lens=lens.tolist()))


def test_int64_lengths_do_not_wrap(repro):
    """2**32 + 3 cast to int32 is 3, a valid length: it must still be refused."""
    q, k, v, _ = inputs("cpu", 8)
    lens = torch.tensor([2 ** 32 + 3, 5, 5], dtype=torch.int64)
    expect_error(lambda: fusedattn.attention(q, k, v, seq_len_kv=lens), InvalidArgumentError,
                 ["seq_len_kv[0]", f"exceeds s_kv = {S_KV}"], repro(lens=lens.tolist()))
    lens = torch.tensor([4, -(2 ** 32) + 2, 5], dtype=torch.int64)       # wraps to +2
    expect_error(lambda: fusedattn.attention(q, k, v, seq_len_q=lens), InvalidArgumentError,
                 ["seq_len_q[1]", "is negative"], repro(lens=lens.tolist()))


BAD_META = [
    ("float", "seq_len_q", lambda b: torch.ones(b), InvalidTypeError, "seq_len_q must be an int32"),
    ("bool", "seq_len_kv", lambda b: torch.ones(b, dtype=torch.bool), InvalidTypeError, "seq_len_kv must be an int32"),
    ("int16", "seq_len_q", lambda b: torch.ones(b, dtype=torch.int16), InvalidTypeError, "seq_len_q must be an int32"),
    ("list", "seq_len_kv", lambda b: [4] * b, InvalidTypeError, "seq_len_kv must be an int32 tensor"),
    ("2-D", "seq_len_q", lambda b: torch.ones(b, 1, dtype=torch.int32), InvalidArgumentError,
     "seq_len_q must have shape [3] or [3, 1, 1, 1]"),
    ("wrong batch", "seq_len_kv", lambda b: torch.ones(b + 1, dtype=torch.int32), InvalidArgumentError,
     "seq_len_kv must have shape [3]"),
    ("4-D wrong", "seq_len_kv", lambda b: torch.ones(1, 1, 1, b, dtype=torch.int32), InvalidArgumentError,
     "seq_len_kv must have shape [3]"),
]


@pytest.mark.parametrize("name,arg,make,exc,needle", BAD_META, ids=[m[0] for m in BAD_META])
@pytest.mark.parametrize("validate", [True, False])
def test_bad_length_dtype_and_shape(name, arg, make, exc, needle, validate, repro):
    """Dtype and shape are checked whatever validate says (no device sync needed for them)."""
    q, k, v, _ = inputs("cpu", 9)
    expect_error(lambda: fusedattn.attention(q, k, v, validate=validate, **{arg: make(3)}), exc, [needle],
                 repro(case=name, validate=validate))


@pytest.mark.parametrize("door", DOORS)
def test_validate_false_skips_check_and_clamps(door, target, repro):
    """validate=False: no error, and the result is that of the lengths clamped into [0, s]."""
    device, backend = target
    seed = 300 + DOORS.index(door)
    rng = random.Random(seed)
    bad = {"seq_len_q": [-3, rng.randint(0, S_Q), S_Q + 7], "seq_len_kv": [S_KV + 1, -1, rng.randint(1, S_KV)]}
    clamped = {"seq_len_q": [0, bad["seq_len_q"][1], S_Q], "seq_len_kv": [S_KV, 0, bad["seq_len_kv"][2]]}
    rep = repro(seed=seed, door=door, lens=bad)
    results = []
    for lens, validate in ((bad, False), (clamped, True)):
        q, k, v, do = inputs(device, seed)
        r = call_door(door, q, k, v, do, device, backend, lens, validate=validate)
        if door == "attention_grad":
            r = (r, q.grad)
        results.append([t for t in (r if isinstance(r, tuple) else (r,)) if t is not None])
    for a, b in zip(*results):
        assert torch.equal(a, b), f"validate=False differs from the clamped lengths' result. {rep}"


def test_check_runs_once_per_call(monkeypatch, repro):
    """One check (one device sync on a GPU) per call: the autograd backward reuses the forward's
    problem, the custom ops' backward passes validate=False, and validate=False checks nothing."""
    calls = []
    real = problem_mod.check_seq_len_values
    monkeypatch.setattr(problem_mod, "check_seq_len_values", lambda *a: calls.append(1) or real(*a))
    lens = dict(seq_len_q=torch.tensor([3, 13, 0], dtype=torch.int32),
                seq_len_kv=torch.tensor([21, 1, 5], dtype=torch.int32))
    for how, validate, want in (("eager", True, 1), ("eager", False, 0), ("op", True, 1), ("op", False, 0)):
        calls.clear()
        q, k, v, do = inputs("cpu", 10, grad=True)
        if how == "eager":
            o = fusedattn.attention(q, k, v, validate=validate, **lens)
        else:       # the torch.library ops torch.compile calls, run eagerly with their autograd
            from fusedattn.ops import attention_op
            opts = dict(attn_scale=None, causal=False, causal_alignment="top_left", window=None, alibi=False,
                        softcap=0.0, dropout_p=0.0, dropout_seed=0, dropout_offset=0, backend="cpu",
                        validate=validate, **lens)
            o, _ = attention_op(q, k, v, None, opts)
        o.backward(do)
        assert len(calls) == want, f"{len(calls)} checks for forward + backward, expected {want}. " \
                                   f"{repro(how=how, validate=validate)}"
        assert q.grad is not None and torch.isfinite(q.grad).all()


def test_boundary_lengths_accepted(target, repro):
    """0 and s itself are valid lengths (no off-by-one in the check)."""
    device, backend = target
    q, k, v, _ = inputs(device, 11)
    lens = dict(seq_len_q=torch.tensor([0, S_Q, 1], dtype=torch.int32, device=device),
                seq_len_kv=torch.tensor([S_KV, 0, S_KV], dtype=torch.int32, device=device))
    out = fusedattn.attention(q, k, v, backend=backend, **lens)
    rep = repro(lens={n: t.tolist() for n, t in lens.items()})
    assert torch.isfinite(out).all(), rep
    assert (out[0] == 0).all() and (out[1] == 0).all(), f"rows with no query / no key must be 0. {rep}"


# ------------------------------------------------------------------------------ empty inputs

EMPTY = [(0, 8, 8), (2, 0, 8), (2, 8, 0), (2, 0, 0), (0, 0, 0), (0, 5, 0)]     # (b, s_q, s_kv)


def sdpa(q, k, v, causal, bias=None):
    g = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal)


@pytest.mark.parametrize("geom", EMPTY, ids=lambda g: "b{}sq{}skv{}".format(*g))
def test_empty_like_sdpa(geom, target, repro):
    """Forward, stats and autograd gradients of empty problems equal SDPA's (and are never NaN)."""
    device, backend = target
    b, s_q, s_kv = geom
    seed = 400 + EMPTY.index(geom)
    rng = random.Random(seed)
    h_kv = rng.choice([1, 2])
    h_q = h_kv * rng.choice([1, 2])
    causal, bshd, padded = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
    rep = repro(seed=seed, b=b, h_q=h_q, h_kv=h_kv, s_q=s_q, s_kv=s_kv, causal=causal, bshd=bshd, padded=padded)
    gen = torch.Generator().manual_seed(seed)

    def make(h, s):
        t = torch.randn(b, s, h, D, generator=gen).transpose(1, 2) if bshd else torch.randn(b, h, s, D, generator=gen)
        return t.to(device)
    q, k, v, do = make(h_q, s_q), make(h_kv, s_kv), make(h_kv, s_kv), make(h_q, s_q)
    kw = dict(causal=causal)
    if padded:      # valid lengths (all 0 on an empty side)
        kw.update(seq_len_q=torch.tensor([rng.randint(0, s_q) for _ in range(b)], dtype=torch.int32, device=device),
                  seq_len_kv=torch.tensor([rng.randint(0, s_kv) for _ in range(b)], dtype=torch.int32, device=device))

    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    gold = [t.clone().requires_grad_() for t in (q, k, v)]
    out, stats = fusedattn.attention(*ours, backend=backend, return_stats=True, **kw)
    ref = sdpa(*gold, causal)
    assert out.shape == ref.shape == (b, h_q, s_q, D) and out.dtype == ref.dtype, f"{tuple(out.shape)}. {rep}"
    assert stats.shape == (b, h_q, s_q, 1), f"stats {tuple(stats.shape)}. {rep}"
    assert torch.equal(out, ref), f"output differs from SDPA's. {rep}"
    assert (stats == float("-inf")).all(), f"stats of rows with no key must be -inf. {rep}"
    out.backward(do)
    ref.backward(do)
    for name, a, g in zip("qkv", ours, gold):
        assert a.grad is not None and a.grad.shape == g.grad.shape, f"d{name} {a.grad}. {rep}"
        assert torch.equal(a.grad, g.grad), f"d{name} differs from SDPA's. {rep}"


@pytest.mark.parametrize("geom", EMPTY, ids=lambda g: "b{}sq{}skv{}".format(*g))
def test_empty_forward_backward_doors(geom, target, repro):
    """attention_forward / attention_backward write every element of given outputs (NaN-filled here)."""
    device, backend = target
    b, s_q, s_kv = geom
    q, k, v, do = inputs(device, 500 + EMPTY.index(geom), b=b, s_q=s_q, s_kv=s_kv)
    rep = repro(b=b, s_q=s_q, s_kv=s_kv)
    nan = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    out, stats = nan(do), torch.full((b, 4, s_q, 1), float("nan"), device=device)
    fusedattn.attention_forward(q, k, v, backend=backend, out=out, stats_out=stats)
    assert (out == 0).all() and (stats == float("-inf")).all(), f"out/stats not written as 0 / -inf. {rep}"
    dq, dk, dv = nan(q), nan(k), nan(v)
    got = fusedattn.attention_backward(q, k, v, out, do, stats, backend=backend, dq=dq, dk=dk, dv=dv)
    for name, g, t in zip("qkv", got[:3], (q, k, v)):
        assert g.shape == t.shape and (g == 0).all(), f"d{name} not written as 0. {rep}"


@pytest.mark.parametrize("geom", [(0, 8, 8), (2, 8, 0), (2, 0, 8)], ids=lambda g: "b{}sq{}skv{}".format(*g))
def test_empty_with_bias_gradient(geom, target, repro):
    """A float attn_bias's gradient on an empty problem: zeros of the bias's shape (SDPA leaves it None,
    autograd's spelling of zero: ours is the explicit zero, so the None is compared as zeros)."""
    device, backend = target
    b, s_q, s_kv = geom
    q, k, v, do = inputs(device, 600, b=b, h_q=2, h_kv=2, s_q=s_q, s_kv=s_kv)
    bias = torch.randn(1, 2, s_q, s_kv, generator=torch.Generator().manual_seed(601)).to(device)
    ours = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    gold = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = fusedattn.attention(*ours[:3], attn_bias=ours[3], backend=backend)
    ref = sdpa(*gold[:3], False, bias=gold[3])
    out.backward(do)
    ref.backward(do)
    rep = repro(b=b, s_q=s_q, s_kv=s_kv)
    assert torch.equal(out, ref), f"output differs from SDPA's. {rep}"
    for name, a, g in zip(("q", "k", "v", "bias"), ours, gold):
        want = torch.zeros_like(g) if g.grad is None else g.grad
        assert a.grad is not None and torch.equal(a.grad, want), f"d{name} differs from SDPA's. {rep}"
