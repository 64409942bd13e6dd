"""fusedattn.nn: the layers against references built from F.scaled_dot_product_attention with the
same weights (forward and every gradient, FlashAttention's 2x rule against float64), GQA/MQA, the
no-copy promise (q/k/v are views of the QKV projection, nothing is copied before the kernel),
dropout only in training, and a short training run whose loss falls."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fusedattn.nn as fnn
from fusedattn.nn import CausalSelfAttention, MultiheadAttention, MultiheadSelfAttention, qkv_attention
from fusedattn.problem import InvalidArgumentError
from fusedattn.testing import assert_error_within

B, S, E, H, D = 2, 37, 64, 4, 16     # odd sequence length: partial tiles


def layer_backend(target):
    device, backend = target
    return device, ("auto" if device == "cuda" else backend)


def reference_mha(layer, x, causal):
    """Independent multi-head attention on the layer's weights: split/reshape/repeat copies and SDPA."""
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    b, s, _ = x.shape
    qkv = F.linear(x, layer.qkv_proj.weight, layer.qkv_proj.bias)
    q, k, v = qkv.split([h * d, h_kv * d, h_kv * d], dim=-1)
    q = q.reshape(b, s, h, d).transpose(1, 2).contiguous()
    # GQA spelled out: query head i reads kv head i // (h // h_kv)
    k, v = (t.reshape(b, s, h_kv, d).transpose(1, 2).repeat_interleave(h // h_kv, dim=1) for t in (k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return F.linear(o.transpose(1, 2).reshape(b, s, h * d), layer.out_proj.weight, layer.out_proj.bias)


def reference_nanogpt(block, x):
    """nanoGPT's CausalSelfAttention.forward (karpathy/nanoGPT model.py, flash branch), on block's weights."""
    B_, T, C = x.size()
    q, k, v = block.c_attn(x).split(block.n_embd, dim=2)
    k = k.view(B_, T, block.n_head, C // block.n_head).transpose(1, 2)
    q = q.view(B_, T, block.n_head, C // block.n_head).transpose(1, 2)
    v = v.view(B_, T, block.n_head, C // block.n_head).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B_, T, C)
    return block.resid_dropout(block.c_proj(y))


def run_and_grads(layer, fwd, x, dout):
    """Forward, backward with dout; returns (out, {name: grad}) including the input's gradient."""
    x = x.detach().clone().requires_grad_()
    out = fwd(layer, x)
    out.backward(dout)
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in layer.named_parameters()})
    return out.detach(), grads


def check_layer(layer, ours, ref, device, dtype, seed=0, b=B, s=S):
    """FlashAttention's rule on the output and every gradient: |ours - fp64| <= 2 |ref(dtype) - fp64| + floor."""
    gen = torch.Generator().manual_seed(seed)
    # inputs and weights rounded to dtype first, so every error measured is the computation's own
    x = torch.randn(b, s, layer_width(layer), generator=gen).to(dtype).double()
    dout = torch.randn(b, s, layer_width(layer), generator=gen).to(dtype).double()
    layer = layer.to(dtype)
    gold_layer = copy.deepcopy(layer).to("cpu", torch.float64)
    base_layer = copy.deepcopy(layer).to(device, dtype)
    got_layer = copy.deepcopy(layer).to(device, dtype)
    gold, gold_g = run_and_grads(gold_layer, ref, x, dout)
    base, base_g = run_and_grads(base_layer, ref, x.to(device, dtype), dout.to(device, dtype))
    got, got_g = run_and_grads(got_layer, ours, x.to(device, dtype), dout.to(device, dtype))
    assert_error_within(got.cpu(), gold, base.cpu(), msg="layer output")
    assert got_g.keys() == gold_g.keys()
    for name in gold_g:
        assert_error_within(got_g[name].cpu(), gold_g[name], base_g[name].cpu(), msg=f"grad of {name}")


def layer_width(layer):
    return layer.embed_dim if isinstance(layer, MultiheadSelfAttention) else layer.n_embd


def target_dtype(device):
    # the GPU case is the training dtype; on CPU fp32 (the interpreter and the CPU path)
    return torch.bfloat16 if device == "cuda" else torch.float32


@pytest.mark.parametrize("h_kv,causal,bias", [
    pytest.param(4, True, True, id="mha-causal"),
    pytest.param(4, False, False, id="mha-full-nobias"),
    pytest.param(2, True, False, id="gqa2-causal"),
    pytest.param(1, False, True, id="mqa-full"),
])
def test_mha_matches_sdpa_reference(target, h_kv, causal, bias):
    device, backend = layer_backend(target)
    torch.manual_seed(0)
    layer = MultiheadSelfAttention(E, H, num_kv_heads=h_kv, causal=causal, bias=bias, backend=backend)
    check_layer(layer, lambda m, x: m(x), lambda m, x: reference_mha(m, x, causal), device, target_dtype(device),
                s=S if device != "cuda" else 301)


def test_causal_self_attention_matches_nanogpt(target):
    device, backend = layer_backend(target)
    torch.manual_seed(1)
    block = CausalSelfAttention(E, H, backend=backend)
    check_layer(block, lambda m, x: m(x), reference_nanogpt, device, target_dtype(device), seed=1)


def test_nanogpt_state_dict_names():
    """Same parameter names and shapes as nanoGPT's block, so its checkpoints load."""
    block = CausalSelfAttention(E, H)
    shapes = {k: tuple(v.shape) for k, v in block.state_dict().items()}
    assert shapes == {"c_attn.weight": (3 * E, E), "c_attn.bias": (3 * E,),
                      "c_proj.weight": (E, E), "c_proj.bias": (E,)}


def test_gqa_shapes_and_alias():
    layer = MultiheadAttention(E, 8, num_kv_heads=2, head_dim=8)
    assert MultiheadAttention is MultiheadSelfAttention
    assert layer.qkv_proj.weight.shape == ((8 + 2 * 2) * 8, E)      # q heads + k heads + v heads
    assert layer.out_proj.weight.shape == (E, 8 * 8)
    assert layer(torch.randn(3, 5, E)).shape == (3, 5, E)
    block = CausalSelfAttention(E, 4, n_kv_head=1)
    assert block.c_attn.weight.shape == ((4 + 2) * 16, E)


# ------------------------------------------------------------------------------------------- no copies

class _OpLog(TorchDispatchMode):
    """Records every aten op dispatched while ``on`` (the spy switches it off inside the kernel)."""

    def __init__(self):
        super().__init__()
        self.ops, self.on = [], True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# aten ops that copy data. Not ``_unsafe_view``: a view (no copy) that torch 2.15's nn.Linear on a 3-D input
# returns its addmm's output through; a reshape that must copy dispatches ``clone`` (or ``_reshape_copy``) first.
COPY_OPS = {"clone", "contiguous", "copy_", "_to_copy", "copy", "cat", "stack", "repeat_interleave",
            "expand_copy", "transpose_copy", "view_copy", "_reshape_copy"}


@pytest.mark.parametrize("make", [
    pytest.param(lambda: MultiheadSelfAttention(E, H, num_kv_heads=2, causal=True), id="mha-gqa"),
    pytest.param(lambda: CausalSelfAttention(E, H), id="nanogpt"),
])
def test_no_copy_before_kernel(monkeypatch, make):
    """q, k, v reach fusedattn.attention as strided views of the QKV projection's output (no copy),
    and the attention output reaches the output projection as a view too."""
    layer = make()
    qkv_mod, out_mod = (layer.qkv_proj, layer.out_proj) if hasattr(layer, "qkv_proj") else (layer.c_attn, layer.c_proj)
    seen = {}
    log = _OpLog()
    qkv_mod.register_forward_hook(lambda m, i, o: seen.setdefault("proj", o))
    out_mod.register_forward_pre_hook(lambda m, i: seen.setdefault("out_in", i[0]))
    real = fnn.attention

    def spy(q, k, v, **kw):
        seen.update(q=q, k=k, v=v, kw=kw)
        log.on = False                                 # what the kernel does inside is its own business
        try:
            out = real(q, k, v, **kw)
        finally:
            log.on = True
        seen["attn_out"] = out
        return out

    monkeypatch.setattr(fnn, "attention", spy)
    x = torch.randn(B, S, E)
    with log:
        layer(x)
    proj, q, k, v = seen["proj"], seen["q"], seen["k"], seen["v"]
    h, h_kv, d = H, getattr(layer, "num_kv_heads", getattr(layer, "n_kv_head", None)), E // H
    n = h + 2 * h_kv
    base = proj.untyped_storage().data_ptr()
    esize = proj.element_size()
    for name, t, head0 in (("q", q, 0), ("k", k, h), ("v", v, h + h_kv)):
        assert t.untyped_storage().data_ptr() == base, f"{name} does not share the projection's storage"
        assert t.data_ptr() == proj.data_ptr() + head0 * d * esize, f"{name} starts at the wrong head"
        # BSHD memory seen as [b, heads, s, d]: the head stride is d, the sequence stride the full row n*d
        assert t.stride() == (S * n * d, d, n * d, 1), f"{name} strides {t.stride()}"
    assert seen["attn_out"].untyped_storage().data_ptr() == seen["out_in"].untyped_storage().data_ptr(), \
        "the output projection got a copy of the attention output"
    copies = sorted(COPY_OPS.intersection(log.ops))
    assert not copies, f"copy ops outside the kernel: {copies} (all ops: {log.ops})"


# ------------------------------------------------------------------------------------------- dropout

def test_dropout_only_in_training(monkeypatch):
    """dropout_p reaches the kernel in train mode and is 0 in eval mode."""
    layer = MultiheadSelfAttention(E, H, dropout=0.25, causal=True)
    got = []
    real = fnn.attention
    monkeypatch.setattr(fnn, "attention", lambda q, k, v, **kw: got.append(kw["dropout_p"]) or real(q, k, v, **kw))
    x = torch.randn(B, S, E)
    layer.train()
    torch.manual_seed(0)
    y_train = layer(x)
    layer.eval()
    y_eval, y_eval2 = layer(x), layer(x)
    assert got == [0.25, 0.0, 0.0]
    assert torch.equal(y_eval, y_eval2)
    assert not torch.allclose(y_train, y_eval)
    layer.train()
    torch.manual_seed(0)                 # the kernel's dropout seed comes from torch's generator
    assert torch.equal(layer(x), y_train)


# ------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kw,match", [
    (dict(embed_dim=64, num_heads=6), "multiple of num_heads"),
    (dict(embed_dim=64, num_heads=4, num_kv_heads=3), "num_kv_heads must divide"),
    (dict(embed_dim=48, num_heads=4), "head_dim = 12"),
    (dict(embed_dim=64, num_heads=4, backend="flash"), "backend must be one of"),
])
def test_bad_geometry_raises(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        MultiheadSelfAttention(**kw)


def test_bad_input_raises():
    layer = MultiheadSelfAttention(E, H)
    with pytest.raises(InvalidArgumentError, match=r"x must be \[batch, seq, 64\]"):
        layer(torch.randn(B, S, E + 1))
    with pytest.raises(InvalidArgumentError, match="qkv's last dim"):
        qkv_attention(torch.randn(B, S, 100), 4, 2)


# ------------------------------------------------------------------------------------------- training

class TinyLM(torch.nn.Module):
    """Embedding, one causal attention block, LM head: enough to learn a copy task."""

    def __init__(self, vocab, width, heads, backend):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(64, width)
        self.attn = CausalSelfAttention(width, heads, n_kv_head=heads // 2, backend=backend)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(x + self.attn(x))


def copy_task(gen, batch, half, vocab):
    """Random first half, repeated: the second half is predictable only by attending back."""
    first = torch.randint(vocab, (batch, half), generator=gen)
    return torch.cat([first, first], dim=1)


def train_tiny(backend, steps=30, seed=0):
    torch.manual_seed(seed)
    model = TinyLM(vocab=16, width=32, heads=4, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        seq = copy_task(gen, 16, 12, 16)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits[:, 11:].flatten(0, 1), seq[:, 12:].flatten())   # the copied half
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def one_thread():
    """Tiny ops gain nothing from threads, and on a shared, busy machine OpenMP's spinning threads make
    this test 100x slower (0.1 s vs 10 s measured on 2 loaded cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_short_training_run_loss_decreases(one_thread):
    """30 steps of a copy task: the loss falls well below chance, on the same curve as SDPA's."""
    losses = train_tiny("auto")
    start, end = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert end < 0.5 * start, f"loss did not fall: {losses}"
    ref = train_tiny("sdpa")                            # same seed: same init and batches
    assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-3, f"fusedattn {losses}\nsdpa {ref}"
