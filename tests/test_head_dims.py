"""Any head dim from 1 to 256 (d_v != d included) and ALiBi slopes of shape [b, h_q] (issue 25 item 2),
forward and backward, on the CPU path and the real Triton kernels (interpreter here, GPU on the device),
against the float64 reference with FlashAttention's 2x rule (fusedattn.testing)."""
import pytest
import torch

import fusedattn
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within

# (d, d_v): below the 16-wide tile, odd, just under a power of two, between buckets, the maximum
HEAD_DIMS = [(1, 1), (3, 3), (7, 5), (59, 59), (111, 111), (200, 72), (256, 256), (24, 130)]


def _inputs(seed, b, h_q, h_kv, s_q, s_kv, d, d_v, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    return mk(b, h_q, s_q, d), mk(b, h_kv, s_kv, d), mk(b, h_kv, s_kv, d_v)


def _check(target, d, d_v, seed, **kw):
    """Forward (into a NaN-filled out= buffer), stats and gradients against float64; returns the output."""
    device, backend = target
    dtype = torch.float16 if device == "cuda" else torch.float32
    b, h_q, h_kv, s_q, s_kv = 2, 4, 2, 17, 29
    repro = f"repro: d={d} d_v={d_v} seed={seed} kw={kw} target={target}"
    q, k, v = _inputs(seed, b, h_q, h_kv, s_q, s_kv, d, d_v, dtype, device)
    out = torch.full((b, h_q, s_q, d_v), float("nan"), dtype=dtype, device=device)
    fusedattn.attention_forward(q, k, v, backend=backend, out=out, **kw)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    got, stats = fusedattn.attention(qs, ks, vs, backend=backend, return_stats=True, **kw)
    do = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    got.backward(do)
    ref = {}
    for dt in (torch.float64, dtype):
        rq, rk, rv = (t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v))
        ro, rl = attention_reference(rq, rk, rv, dtype=dt, **{n: (x.cpu() if torch.is_tensor(x) else x)
                                                             for n, x in kw.items()})
        ro.backward(do.cpu().to(dt))
        ref[dt] = (ro, rl, rq.grad, rk.grad, rv.grad)
    gold, base = ref[torch.float64], ref[dtype]
    for name, g, gd, gb in zip(("out=", "out", "dq", "dk", "dv"), (out, got, qs.grad, ks.grad, vs.grad),
                               (gold[0], gold[0], *gold[2:]), (base[0], base[0], *base[2:])):
        assert g.shape == gd.shape, f"{name}: shape {tuple(g.shape)} != {tuple(gd.shape)}. {repro}"
        assert_error_within(g.cpu(), gd, gb, msg=f"{name}. {repro}")
    torch.testing.assert_close(stats.cpu(), gold[1].float(), atol=2e-3, rtol=1e-3, msg=lambda m: f"{m}. {repro}")
    return got


@pytest.mark.parametrize("d,d_v", HEAD_DIMS, ids=lambda x: str(x))
def test_any_head_dim_forward_backward(d, d_v, target):
    """Scale 1 / sqrt(true d) (the default), causal bottom-right, GQA: the padded tile part changes nothing,
    and no gradient leaks into it (dq/dk/dv have exactly the inputs' shapes and match the reference)."""
    _check(target, d, d_v, seed=d * 1000 + d_v, causal=True, causal_alignment="bottom_right")


@pytest.mark.parametrize("d,d_v", [(3, 3), (59, 40)], ids=lambda x: str(x))
def test_head_dims_with_padding_and_window(d, d_v, target):
    device, _ = target
    lens_q = torch.tensor([17, 9], dtype=torch.int32, device=device)
    lens_kv = torch.tensor([5, 29], dtype=torch.int32, device=device)
    _check(target, d, d_v, seed=7 + d, window=(6, 2), seq_len_q=lens_q, seq_len_kv=lens_kv)


@pytest.mark.parametrize("shape", ["[h]", "[b,h]"])
def test_alibi_slopes_per_batch(shape, target):
    """slopes [b, h_q]: each batch entry uses its own row (checked against the reference, which reads them
    per batch too, and against the same call with the rows swapped)."""
    device, _ = target
    gen = torch.Generator().manual_seed(11)
    slopes = torch.rand(2, 4, generator=gen).to(device) if shape == "[b,h]" else torch.rand(4, generator=gen).to(device)
    got = _check(target, 40, 40, seed=3, causal=True, alibi=slopes)
    if shape == "[b,h]":
        swapped = _check(target, 40, 40, seed=3, causal=True, alibi=slopes.flip(0))
        assert not torch.allclose(got, swapped), "the batch rows of the slopes made no difference"


def test_alibi_slopes_bad_shape_names_the_argument():
    q = k = v = torch.randn(2, 4, 8, 16)
    with pytest.raises(ValueError, match=r"alibi slopes must be a float tensor of shape \[4\] \(h_q\) or \[2, 4\]"):
        fusedattn.attention(q, k, v, alibi=torch.ones(3, 4))


def test_head_dim_out_of_range_names_the_argument():
    with pytest.raises(ValueError, match=r"d_v \(v head dim\) = 1025; supported: any head dim from 1 to 1024"):
        fusedattn.attention(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 1025))


@pytest.mark.parametrize("d,d_v", [(264, 264), (64, 520), (520, 200)], ids=lambda x: str(x))
def test_head_dims_past_256_run_the_torch_path(d, d_v, target):
    """Past the kernels' 256 (cuDNN 9.9+ runs 264 and 520 on Hopper), up to 1024: the PyTorch path
    (backends/cpu.py) on the tensors' own device, with one warning on a GPU; backend='triton' (the
    interpreter here) asks for a kernel that does not exist and is refused, naming backend='auto'."""
    device, backend = target
    if device == "cpu" and backend == "triton":
        q = torch.randn(1, 2, 4, d)
        with pytest.raises(NotImplementedError, match=f"head dim {max(d, d_v)} > 256 has no Triton kernel.*'auto'"):
            fusedattn.attention(q, torch.randn(1, 2, 4, d), torch.randn(1, 2, 4, d_v), backend="triton")
        return
    kw = dict(causal=True, causal_alignment="bottom_right")
    if device == "cuda":
        from fusedattn import plan
        from fusedattn.backends import compat
        compat._warned.discard("large-head-dim")
        plan._plan_cached.cache_clear()
        with pytest.warns(RuntimeWarning, match="PyTorch path"):
            _check(("cuda", "auto"), d, d_v, seed=d + d_v, **kw)
    else:
        _check(target, d, d_v, seed=d + d_v, **kw)


def test_large_head_dim_plan():
    """The routing, asked about a CUDA device directly (runs without one)."""
    from fusedattn.backends import compat
    from fusedattn.plan import large_head_dim_plan
    compat._warned.discard("large-head-dim")
    with pytest.warns(RuntimeWarning, match="head dim 520 > 256: .* PyTorch path .* on cuda"):
        assert large_head_dim_plan("auto", 520, "cuda").backend == "cpu"
    assert large_head_dim_plan("cpu", 520, "cpu").backend == "cpu"
    with pytest.raises(NotImplementedError, match="backend='cpu' needs CPU tensors"):
        large_head_dim_plan("cpu", 520, "cuda")
    with pytest.raises(NotImplementedError, match="has no Triton kernel"):
        large_head_dim_plan("triton", 520, "cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        large_head_dim_plan("gluon", 520, "cuda")


@pytest.mark.parametrize("d", [5, 72])
def test_varlen_odd_head_dim_and_alibi_per_sequence(d, target):
    """attention_varlen: an odd head dim and [b, h] slopes, each sequence against its own reference."""
    device, backend = target
    dtype = torch.float16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(d)
    lens_q, lens_kv = [7, 1, 12], [9, 4, 12]
    cq = torch.tensor([0, 7, 8, 20], dtype=torch.int32, device=device)
    ck = torch.tensor([0, 9, 13, 25], dtype=torch.int32, device=device)
    q = torch.randn(20, 4, d, generator=gen).to(device, dtype)
    k = torch.randn(25, 2, d, generator=gen).to(device, dtype)
    v = torch.randn(25, 2, d, generator=gen).to(device, dtype)
    slopes = torch.rand(3, 4, generator=gen).to(device)
    out = fusedattn.attention_varlen(q, k, v, cq, ck, 12, 12, causal=True, causal_alignment="bottom_right",
                                     alibi=slopes, backend=backend)
    for i in range(3):
        a, b_, c, e = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        seq = lambda t, lo, hi: t[lo:hi].transpose(0, 1)[None].cpu()  # noqa: E731
        res = [attention_reference(seq(q, a, b_), seq(k, c, e), seq(v, c, e), causal=True, dtype=dt,
                                   causal_alignment="bottom_right", alibi=slopes[i].cpu())[0]
               for dt in (torch.float64, dtype)]
        assert_error_within(seq(out, a, b_), *res, msg=f"repro: d={d} sequence {i} target={target}")
