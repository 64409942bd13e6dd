"""fusedattn under F.scaled_dot_product_attention (fusedattn.integrations.torch).

CPU (CI): the routing decision case by case; the fallback (PyTorch's own result and errors, bit for bit);
the fused path through the real activation, with the tests-only switch ``_ALLOW_CPU`` sending CPU tensors
to fusedattn's CPU path, in float64 against PyTorch's math (outputs agree to ~1e-12; gradients to ~1e-7,
as fusedattn keeps the log-sum-exp in float32 for the backward; any semantic slip, a wrong mask sense,
alignment, scale or GQA mapping, moves them by more than 1e-2); torch.compile(fullgraph)
with aot_eager; the flash-slot kernels registered on the CPU key. GPU (marked gpu): a model in bf16 with
and without activate(), the fallbacks, torch.compile with inductor, a CUDA graph, the flash slot.
"""
import os
import threading

import pytest
import torch
import torch.nn.functional as F

import fusedattn.integrations.torch as fa_torch

HAS_CUDA = torch.cuda.is_available()
def gpu(test):
    """A GPU test: marked gpu, skipped (visibly) without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: GPU tests skipped")(test))


SDPA = fa_torch._TORCH_SDPA


@pytest.fixture
def cpu_routing(monkeypatch):
    """Route CPU tensors to fusedattn (tests only) and count the calls fusedattn takes."""
    monkeypatch.setattr(fa_torch, "_ALLOW_CPU", True)
    yield _count_calls(monkeypatch)
    fa_torch.deactivate()


def _count_calls(monkeypatch) -> list:
    """Wrap the fusedattn entry the integration calls; returns the list of each call's keyword args."""
    calls = []
    real = fa_torch.attention

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fa_torch, "attention", counting)
    return calls


def _assert_close(got, want, rel):
    """max |got - want| <= rel * max |want| (errors measured against the tensor's scale)."""
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max error {err:.3g} > {rel} * {want.abs().max().item():.3g}"


def _qkv(b=2, h_q=4, h_kv=4, s_q=17, s_kv=23, d=16, d_v=None, dtype=torch.float64, device="cpu", grad=False):
    g = torch.Generator().manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_(grad)
    return mk(b, h_q, s_q, d), mk(b, h_kv, s_kv, d), mk(b, h_kv, s_kv, d_v or d)


# ---------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------

def _case(name):
    """(args, kwargs) of one SDPA call on CPU float64 tensors, by name."""
    q, k, v = _qkv()
    kv2 = _qkv(h_kv=2)[1:]
    kv3 = _qkv(h_kv=3)[1:]
    cases = {
        "plain": ((q, k, v), {}),
        "causal": ((q, k, v), dict(is_causal=True)),
        "scale": ((q, k, v), dict(scale=0.3)),
        "bool_mask_2d": ((q, k, v), dict(attn_mask=torch.rand(17, 23) > 0.5)),
        "float_mask_4d": ((q, k, v), dict(attn_mask=torch.randn(2, 1, 17, 23, dtype=torch.float64))),
        "gqa": ((q, *kv2), dict(enable_gqa=True)),
        "dropout": ((q, k, v), dict(dropout_p=0.1)),
        "d_v_differs": ((q, k, _qkv(d_v=32)[2]), {}),
        # refused
        "gqa_flag_off": ((q, *kv2), {}),
        "gqa_not_multiple": ((q, *kv3), dict(enable_gqa=True)),
        "mask_and_causal": ((q, k, v), dict(attn_mask=torch.ones(17, 23, dtype=torch.bool), is_causal=True)),
        "mask_dtype": ((q, k, v), dict(attn_mask=torch.zeros(17, 23, dtype=torch.float32))),
        "mask_shape": ((q, k, v), dict(attn_mask=torch.zeros(17, 22, dtype=torch.float64))),
        "mask_5d": ((q, k, v), dict(attn_mask=torch.zeros(1, 2, 1, 17, 23, dtype=torch.float64))),
        "three_d": ((q[0], k[0], v[0]), {}),
        "head_dim_20": (_qkv(d=20), {}),
        "head_dim_264": (_qkv(d=264, s_q=3, s_kv=3), {}),
        "empty_seq": (_qkv(s_q=0), {}),
        "negative_scale": ((q, k, v), dict(scale=-1.0)),
        "dropout_one": ((q, k, v), dict(dropout_p=1.0)),
        "int_dtype": ((q.long(), k.long(), v.long()), {}),
        "subclass": ((torch.nn.Parameter(q), k, v), {}),
        "mixed_dtypes": ((q, k.float(), v), {}),
    }
    return cases[name]


TAKEN = ["plain", "causal", "scale", "bool_mask_2d", "float_mask_4d", "gqa", "dropout", "d_v_differs", "head_dim_20"]
REFUSED = {"gqa_flag_off": "enable_gqa", "gqa_not_multiple": "enable_gqa", "mask_and_causal": "is_causal",
           "mask_dtype": "attn_mask dtype", "mask_shape": "broadcast", "mask_5d": "broadcast",
           "three_d": "4-D", "head_dim_264": "head dim 264",
           "empty_seq": "empty", "negative_scale": "scale", "dropout_one": "dropout_p",
           "int_dtype": "dtype", "subclass": "plain torch.Tensor", "mixed_dtypes": "dtype"}


@pytest.mark.parametrize("name", TAKEN)
def test_decision_takes(name, cpu_routing):
    args, kwargs = _case(name)
    assert fa_torch.unsupported_reason(*args, **kwargs) is None


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_decision_refuses(name, cpu_routing):
    args, kwargs = _case(name)
    why = fa_torch.unsupported_reason(*args, **kwargs)
    assert why is not None and REFUSED[name] in why, why


def test_decision_cpu_without_switch():
    """Outside tests CPU tensors (and every device but CUDA) stay with PyTorch."""
    args, kwargs = _case("plain")
    assert "device cpu" in fa_torch.unsupported_reason(*args, **kwargs)


def test_decision_respects_math_only(cpu_routing):
    """sdpa_kernel(SDPBackend.MATH) asks for PyTorch's math: fusedattn steps aside."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    args, kwargs = _case("plain")
    with sdpa_kernel(SDPBackend.MATH):
        assert "math" in fa_torch.unsupported_reason(*args, **kwargs)
    assert fa_torch.unsupported_reason(*args, **kwargs) is None


# ---------------------------------------------------------------------------------------------
# Activation: the fused path (CPU switch) and the fallback
# ---------------------------------------------------------------------------------------------

FUSED_CASES = ["plain", "causal", "scale", "bool_mask_2d", "float_mask_4d", "gqa", "d_v_differs", "head_dim_20"]


def _run_with_grads(args, kwargs):
    args = [t.detach().clone().requires_grad_(True) for t in args]
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs = dict(kwargs, attn_mask=mask.detach().clone().requires_grad_(True))
    out = F.scaled_dot_product_attention(*args, **kwargs)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    leaves = list(args) + ([kwargs["attn_mask"]] if mask is not None and mask.is_floating_point() else [])
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("name", FUSED_CASES)
def test_activate_runs_fusedattn_and_matches_torch(name, cpu_routing):
    """float64: fusedattn's output and every gradient (q, k, v, a float mask) equal PyTorch's."""
    args, kwargs = _case(name)
    want_out, want_grads = _run_with_grads(args, kwargs)
    assert not cpu_routing
    with fa_torch.enabled():
        got_out, got_grads = _run_with_grads(args, kwargs)
    assert len(cpu_routing) == 1
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)
    assert len(got_grads) == len(want_grads)
    for got, want in zip(got_grads, want_grads):
        _assert_close(got, want, 1e-6)


def _drawn_call(seed):
    """(args, kwargs, description) of a random SDPA call as models make them (float64 CPU tensors): GQA with
    enable_gqa, d_v != d, odd lengths, strided (BSHD) q, is_causal (PyTorch's top-left) or a bool / float mask
    of a broadcast shape (every row keeps a key: an empty row is test_fully_masked_rows_give_zero's), a scale."""
    import random
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b, h_kv = rng.choice([1, 2, 3]), rng.choice([1, 2])
    h_q = h_kv * rng.choice([1, 2, 4])
    s_q, s_kv = rng.choice([1, 5, 17, 40]), rng.choice([1, 6, 23, 40])
    d = rng.choice([8, 16, 20, 40, 64])
    d_v = d if rng.random() < 0.7 else rng.choice([8, 24, 32])
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)      # noqa: E731
    q = mk(b, s_q, h_q, d).transpose(1, 2) if rng.random() < 0.5 else mk(b, h_q, s_q, d)
    k, v = mk(b, h_kv, s_kv, d), mk(b, h_kv, s_kv, d_v)
    kwargs = {"enable_gqa": True} if h_q != h_kv else {}
    r = rng.random()
    if r < 0.3:
        kwargs["is_causal"] = True
    elif r < 0.7:
        shape = rng.choice([(s_q, s_kv), (1, s_kv), (b, 1, s_q, s_kv), (1, h_q, s_q, s_kv), (b, h_q, s_q, s_kv),
                            (b, h_q, 1, s_kv)])
        if rng.random() < 0.5:
            mask = torch.rand(*shape, generator=g) > 0.3
            mask[..., 0] = True             # every row keeps a key
        else:
            mask = mk(*shape)
        kwargs["attn_mask"] = mask
    if rng.random() < 0.3:
        kwargs["scale"] = rng.choice([0.05, 0.5, 2.0])
    described = (f"b{b} h{h_q}/{h_kv} s{s_q}x{s_kv} d{d}/{d_v} "
                 + ", ".join(f"{n}={tuple(x.shape) if isinstance(x, torch.Tensor) else x}" for n, x in kwargs.items()))
    return (q, k, v), kwargs, described


@pytest.mark.parametrize("seed", range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "40"))))
def test_random_sdpa_call_matches_torch(seed, cpu_routing):
    """Seeded random SDPA calls (``_drawn_call``) under activate(): fusedattn takes each one, and its output
    and every gradient (q, k, v, a float mask) equal PyTorch's math in float64 (as the named cases above)."""
    args, kwargs, described = _drawn_call(seed)
    rep = f"repro: pytest tests/test_torch_sdpa.py -k 'test_random_sdpa_call_matches_torch and [{seed}]' ; {described}"
    why = fa_torch.unsupported_reason(*args, **kwargs)
    assert why is None, f"{why}. {rep}"
    want_out, want_grads = _run_with_grads(args, kwargs)
    with fa_torch.enabled():
        got_out, got_grads = _run_with_grads(args, kwargs)
    assert len(cpu_routing) == 1, rep
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10, msg=lambda m: f"{m}. {rep}")
    for i, (got, want) in enumerate(zip(got_grads, want_grads)):
        # 1e-5: the float32 log-sum-exp the backward keeps is off by |lse| * 2^-24, which large scores (scale 2,
        # d 64: |lse| ~ 30) lift to ~3e-6; a semantic slip moves gradients by > 1e-2. Plus a float64 round-off
        # floor: with one key (s_kv 1, or a causal first row) dQ is 0 up to ~1e-15
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert err <= 1e-5 * scale + 1e-12, f"gradient {'qkvm'[i]}: error {err:.3g} of {scale:.3g}. {rep}"


def test_fully_masked_rows_give_zero(cpu_routing):
    """A row a bool mask leaves empty: output 0 and gradient 0 (PyTorch 2.5+'s backends), never NaN."""
    q, k, v = _qkv(grad=True)
    mask = torch.rand(17, 23, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[5] = False
    with fa_torch.enabled():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.sum().backward()
    assert len(cpu_routing) == 1
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    assert torch.equal(q.grad[:, :, 5], torch.zeros_like(q.grad[:, :, 5]))
    assert torch.isfinite(out).all() and torch.isfinite(k.grad).all()
    torch.testing.assert_close(out, SDPA(q, k, v, attn_mask=mask), rtol=1e-10, atol=1e-10)


def test_dropout_is_fusedattn_and_reproducible(cpu_routing):
    """dropout_p goes to fusedattn's Philox dropout: seeded by torch.manual_seed, and it drops."""
    q, k, v = _qkv()
    with fa_torch.enabled():
        torch.manual_seed(5)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        torch.manual_seed(5)
        b = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert len(cpu_routing) == 2
    assert torch.equal(a, b)
    assert not torch.allclose(a, SDPA(q, k, v), atol=1e-3)


@pytest.mark.parametrize("name", ["mask_dtype", "head_dim_264", "three_d", "subclass"])
def test_fallback_is_torch_bit_for_bit(name, cpu_routing):
    args, kwargs = _case(name)
    want = SDPA(*args, **kwargs)
    with fa_torch.enabled():
        got = F.scaled_dot_product_attention(*args, **kwargs)
    assert not cpu_routing
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["gqa_flag_off", "gqa_not_multiple", "mask_shape", "int_dtype"])
def test_fallback_keeps_torch_errors(name, cpu_routing):
    """A call PyTorch rejects is rejected with PyTorch's own error, not one of ours."""
    args, kwargs = _case(name)
    with pytest.raises(RuntimeError) as want:
        SDPA(*args, **kwargs)
    with fa_torch.enabled(), pytest.raises(RuntimeError) as got:
        F.scaled_dot_product_attention(*args, **kwargs)
    assert str(got.value) == str(want.value)
    assert not cpu_routing


def test_not_active_on_import_and_deactivate(cpu_routing):
    args, kwargs = _case("plain")
    assert not fa_torch.is_active()
    F.scaled_dot_product_attention(*args, **kwargs)
    assert not cpu_routing                        # importing the module activated nothing
    fa_torch.activate()
    fa_torch.activate()                           # idempotent: one mode
    assert fa_torch.is_active()
    F.scaled_dot_product_attention(*args, **kwargs)
    fa_torch.deactivate()
    assert not fa_torch.is_active()
    F.scaled_dot_product_attention(*args, **kwargs)
    assert len(cpu_routing) == 1
    fa_torch.deactivate()                         # a no-op now


def test_enabled_nests_and_leaves_an_outer_activate(cpu_routing):
    fa_torch.activate()
    with fa_torch.enabled():
        assert fa_torch.is_active()
    assert fa_torch.is_active()                   # the outer activate() still holds
    fa_torch.deactivate()
    with fa_torch.enabled():
        pass
    assert not fa_torch.is_active()


def test_activation_is_per_thread(cpu_routing):
    """The mode covers the thread that activated it (documented); another thread runs PyTorch's."""
    args, kwargs = _case("plain")
    with fa_torch.enabled():
        t = threading.Thread(target=lambda: F.scaled_dot_product_attention(*args, **kwargs))
        t.start()
        t.join()
        assert not cpu_routing
        F.scaled_dot_product_attention(*args, **kwargs)
    assert len(cpu_routing) == 1


def test_deactivate_under_another_mode_raises(cpu_routing):
    from torch.overrides import TorchFunctionMode
    fa_torch.activate()
    with TorchFunctionMode():
        with pytest.raises(RuntimeError, match="another torch function mode"):
            fa_torch.deactivate()
    fa_torch.deactivate()
    assert not fa_torch.is_active()


# ---------------------------------------------------------------------------------------------
# A model that calls F.scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------

class TinyAttentionModel(torch.nn.Module):
    """Embedding -> 2 causal GQA self-attention blocks (F.scaled_dot_product_attention) -> logits."""

    def __init__(self, vocab=50, dim=64, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, attn_mask=None):
        x = self.emb(tokens)
        b, s, _ = x.shape
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = qkv(x).view(b, s, -1, self.head_dim).transpose(1, 2).split(
                [self.heads, self.kv_heads, self.kv_heads], dim=1)
            if attn_mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
            x = x + proj(y.transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


def _model_step(model, tokens, **kw):
    model.zero_grad()
    logits = model(tokens, **kw)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare_model(dtype, device, rel, **kw):
    torch.manual_seed(0)
    model = TinyAttentionModel().to(device, dtype)
    tokens = torch.randint(0, 50, (2, 37), device=device)
    want_logits, want_grads = _model_step(model, tokens, **kw)
    with fa_torch.enabled():
        got_logits, got_grads = _model_step(model, tokens, **kw)
    _assert_close(got_logits, want_logits, rel)
    for name in want_grads:
        _assert_close(got_grads[name], want_grads[name], rel)


def test_model_same_logits_and_gradients(cpu_routing):
    _compare_model(torch.float64, "cpu", 1e-6)
    assert len(cpu_routing) == 2                  # both layers ran fusedattn


def test_model_with_padding_mask(cpu_routing):
    """A causal + padding keep-mask [b, 1, s, s] as models build it."""
    s = 37
    keep = torch.ones(2, 1, s, s, dtype=torch.bool).tril()
    keep[1, :, :, 30:] = False                    # the second sequence is padded after 30 tokens
    _compare_model(torch.float64, "cpu", 1e-6, attn_mask=keep)
    assert len(cpu_routing) == 2


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_compile_fullgraph(dropout, cpu_routing):
    """torch.compile(fullgraph=True) traces through the mode into fusedattn's custom op (no graph break);
    with dropout the call goes to PyTorch's SDPA under compile (the seed would be read on the host)."""
    q, k, v = _qkv(grad=True)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout).sin()

    torch._dynamo.reset()
    with fa_torch.enabled():
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        torch.manual_seed(0)
        out = compiled(q, k, v)
        out.sum().backward()
    assert len(cpu_routing) == (0 if dropout else 1)
    if not dropout:
        want = SDPA(q, k, v, is_causal=True).sin()
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        assert q.grad is not None and torch.isfinite(q.grad).all()
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# The flash slot (torch 2.13+'s registry), its kernels registered on the CPU key for the test
# ---------------------------------------------------------------------------------------------

has_registry = pytest.mark.skipif(fa_torch._reg is None, reason="this torch has no flash-attention registry")


@has_registry
def test_registered_not_active():
    import torch.nn.attention as nn_attention
    assert fa_torch.NAME in nn_attention.list_flash_attention_impls()
    assert nn_attention.current_flash_attention_impl() != fa_torch.NAME


@has_registry
def test_flash_slot_kernels_on_cpu(cpu_routing):
    """The aten flash ops with our kernels (on the CPU key, tests only): autograd through PyTorch's own
    derivative formula reaches our backward; results equal PyTorch's math; refusals go to the original
    (none on CPU: NotImplementedError); remove() unregisters them."""
    handle = fa_torch._register_flash_slot("CPU", require_original=False)
    try:
        q, k, v = _qkv(s_q=23, grad=True)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=0.2)[0]
        (out * out).sum().backward()
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        want = SDPA(q2, k2, v2, is_causal=True, scale=0.2)
        (want * want).sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for got, ref in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
            _assert_close(got, ref, 1e-6)
        with pytest.raises(NotImplementedError, match="fall back"):
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.1, False)      # dropout: refused
    finally:
        handle.remove()
    with pytest.raises(NotImplementedError):       # no CPU kernel of PyTorch's own: ours is gone
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def gpu_calls(monkeypatch):
    yield _count_calls(monkeypatch)
    fa_torch.deactivate()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
@gpu
def test_gpu_model_same_logits_and_gradients(dtype, masked, gpu_calls):
    """bf16/fp16 model: fusedattn's logits and gradients against PyTorch's fused SDPA, both against the
    float64 model: fusedattn's error at most 2x PyTorch's plus a floor of a few ulps."""
    torch.manual_seed(0)
    model = TinyAttentionModel().cuda()
    tokens = torch.randint(0, 50, (2, 301), device="cuda")
    s = tokens.shape[1]
    keep = None
    if masked:
        keep = torch.ones(2, 1, s, s, dtype=torch.bool, device="cuda").tril()
        keep[1, :, :, 250:] = False
    kw = {} if keep is None else dict(attn_mask=keep)
    ref_logits, ref_grads = _model_step(model.double(), tokens, **kw)
    model = model.to(dtype)
    base_logits, base_grads = _model_step(model, tokens, **kw)
    with fa_torch.enabled():
        got_logits, got_grads = _model_step(model, tokens, **kw)
    assert len(gpu_calls) == 2
    eps = torch.finfo(dtype).eps

    def check(got, base, ref, name):
        ref = ref.double()
        floor = 4 * eps * ref.abs().max().item()
        err, base_err = (got.double() - ref).abs().max().item(), (base.double() - ref).abs().max().item()
        assert err <= 2 * base_err + floor, f"{name}: fusedattn {err:.3g} vs torch {base_err:.3g}"

    check(got_logits, base_logits, ref_logits, "logits")
    for name in ref_grads:
        check(got_grads[name], base_grads[name], ref_grads[name], name)


@gpu
def test_gpu_fallbacks(gpu_calls):
    """float64 and a float32 mask with bf16 q (PyTorch casts it; we leave that to PyTorch) fall back:
    PyTorch's result bit for bit, fusedattn not called; the same call with a bf16 mask is taken."""
    q, k, v = _qkv(device="cuda")
    mask = torch.randn(17, 23, device="cuda")
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    cases = [((q, k, v), {}), ((qb, kb, vb), dict(attn_mask=mask))]
    wants = [SDPA(*a, **kw) for a, kw in cases]
    with fa_torch.enabled():
        gots = [F.scaled_dot_product_attention(*a, **kw) for a, kw in cases]
        assert not gpu_calls
        F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask.bfloat16())
    assert len(gpu_calls) == 1
    # bit for bit, NaN where PyTorch gives NaN (a float32 mask beside bf16 q gives NaN rows on torch 2.11's
    # H100 path; falling back means reproducing that too)
    for i, (got, want) in enumerate(zip(gots, wants)):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), \
            f"case {i}: the fallback is not PyTorch's result"


@gpu
def test_gpu_compile_fullgraph_inductor(gpu_calls):
    torch.manual_seed(0)
    model = TinyAttentionModel().cuda().bfloat16()
    tokens = torch.randint(0, 50, (2, 129), device="cuda")
    with fa_torch.enabled():
        eager_logits, eager_grads = _model_step(model, tokens)
        compiled = torch.compile(model, fullgraph=True)
        got_logits, got_grads = _model_step(compiled, tokens)
    assert len(gpu_calls) >= 4                    # 2 eager + 2 traced
    torch.testing.assert_close(got_logits, eager_logits, rtol=2e-2, atol=2e-2)
    got_grads = {name.replace("_orig_mod.", ""): g for name, g in got_grads.items()}     # the compiled wrapper's
    assert got_grads.keys() == eager_grads.keys()
    for name in eager_grads:
        torch.testing.assert_close(got_grads[name], eager_grads[name], rtol=5e-2, atol=5e-2)
    torch._dynamo.reset()


@gpu
def test_gpu_cuda_graph(gpu_calls):
    """A forward captured in a CUDA graph while active replays to the eager result."""
    q, k, v = (t.bfloat16() for t in _qkv(s_q=300, s_kv=300, d=64, device="cuda"))
    with fa_torch.enabled():
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)        # warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        graph.replay()
        torch.cuda.synchronize()
    assert len(gpu_calls) == 3
    assert torch.equal(out, want)


@has_registry
@gpu
def test_gpu_flash_slot_in_another_thread(monkeypatch):
    """torch 2.13+: a thread without the mode still reaches fusedattn through SDPA's flash slot."""
    import torch.nn.attention as nn_attention
    calls = []
    real = fa_torch.attention_forward
    monkeypatch.setattr(fa_torch, "attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = (t.bfloat16() for t in _qkv(s_q=128, s_kv=128, d=64, device="cuda"))
    want = SDPA(q, k, v, is_causal=True)
    got = []
    try:
        fa_torch.activate()
        assert nn_attention.current_flash_attention_impl() == fa_torch.NAME
        # the flash backend asked for: torch may prefer cuDNN's SDPA on Hopper (torch 2.11 on the H100
        # machine did), and only the flash slot is fusedattn's outside the activating thread

        def call():
            with nn_attention.sdpa_kernel(nn_attention.SDPBackend.FLASH_ATTENTION):
                got.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        t = threading.Thread(target=call)
        t.start()
        t.join()
    finally:
        fa_torch.deactivate()
    assert nn_attention.current_flash_attention_impl() != fa_torch.NAME
    assert calls, "the flash slot did not run fusedattn"
    torch.testing.assert_close(got[0], want, rtol=2e-2, atol=2e-2)
