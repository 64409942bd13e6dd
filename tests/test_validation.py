"""Every bad input gets a clear error that names the argument (ValueError / TypeError), never a
crash or a wrong answer; valid-but-unsupported requests raise NotSupportedError."""
import pytest
import torch

import fusedattn
from fusedattn.problem import FusedAttnError


def qkv(b=2, h_q=4, h_kv=2, s=8, d=64, d_v=64, dtype=torch.float32):
    return (torch.randn(b, h_q, s, d, dtype=dtype), torch.randn(b, h_kv, s, d, dtype=dtype),
            torch.randn(b, h_kv, s, d_v, dtype=dtype))


BAD = [
    ("rank", lambda q, k, v: (q[0], k, v), {}, ValueError, r"q must be 4-D"),
    ("batch", lambda q, k, v: (q, k[:1], v[:1]), {}, ValueError, r"batch sizes differ"),
    ("head dim", lambda q, k, v: (q, k[..., :32], v), {}, ValueError, r"head dim of k \(32\) must equal"),
    ("gqa", lambda q, k, v: (q[:, :3], k, v), {}, ValueError, r"multiple of key/value heads"),
    ("dtype", lambda q, k, v: (q.int(), k.int(), v.int()), {}, TypeError, r"q has dtype torch.int32"),
    ("mixed dtype", lambda q, k, v: (q.half(), k, v), {}, TypeError, r"share a dtype"),
    ("d > 1024", lambda q, k, v: tuple(torch.randn(1, 1, 4, 1032) for _ in range(3)),
     {}, ValueError, r"d \(q/k head dim\) = 1032"),
    ("d = 0", lambda q, k, v: (q[..., :0], k[..., :0], v), {}, ValueError, r"= 0; supported: any head dim from 1"),
    ("kv mismatch", lambda q, k, v: (q, k, v[:, :, :5]), {}, ValueError, r"same heads and sequence length"),
    ("scale nan", lambda q, k, v: (q, k, v), dict(attn_scale=float("nan")), ValueError, r"attn_scale must be finite"),
    ("scale <= 0", lambda q, k, v: (q, k, v), dict(attn_scale=-1.0), ValueError, r"attn_scale must be finite and > 0"),
    ("alignment", lambda q, k, v: (q, k, v), dict(causal=True, causal_alignment="middle"), ValueError,
     r"causal_alignment must be one of"),
    ("window", lambda q, k, v: (q, k, v), dict(window=(3,)), ValueError, r"window must be a pair"),
    ("window neg", lambda q, k, v: (q, k, v), dict(window=(-5, 0)), ValueError, r"window\[left\] must be"),
    ("seq_len dtype", lambda q, k, v: (q, k, v), dict(seq_len_kv=torch.ones(2)), TypeError, r"seq_len_kv must be an int32"),
    ("seq_len shape", lambda q, k, v: (q, k, v), dict(seq_len_q=torch.ones(3, dtype=torch.int32)), ValueError,
     r"seq_len_q must have shape \[2\]"),
    ("bias shape", lambda q, k, v: (q, k, v), dict(attn_bias=torch.randn(3, 1, 8, 8)), ValueError,
     r"attn_bias of shape \(3, 1, 8, 8\) does not broadcast"),
    ("bias dtype", lambda q, k, v: (q, k, v), dict(attn_bias=torch.ones(8, 8, dtype=torch.int64)), TypeError,
     r"attn_bias dtype"),
    ("alibi shape", lambda q, k, v: (q, k, v), dict(alibi=torch.ones(3)), ValueError, r"alibi slopes must be"),
    ("dropout", lambda q, k, v: (q, k, v), dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    ("softcap", lambda q, k, v: (q, k, v), dict(softcap=-1.0), ValueError, r"softcap must be >= 0"),
    ("backend", lambda q, k, v: (q, k, v), dict(backend="cuda"), ValueError, r"backend must be one of"),
    ("out shape", lambda q, k, v: (q, k, v), dict(out=torch.empty(2, 4, 8, 32)), ValueError, r"out must have shape"),
    ("not a tensor", lambda q, k, v: (q.tolist(), k, v), {}, TypeError, r"q must be a torch.Tensor"),
]


@pytest.mark.parametrize("name,make,kw,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name, make, kw, exc, match):
    q, k, v = make(*qkv())
    with pytest.raises(exc, match=match) as info:
        fusedattn.attention(q, k, v, **kw)
    assert isinstance(info.value, FusedAttnError)


def test_devices_differ():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to place tensors on two devices")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        fusedattn.attention(q.cuda(), k, v)


def test_triton_on_cpu_without_interpreter_is_not_supported(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from fusedattn import plan
    plan._plan_cached.cache_clear()
    try:
        with pytest.raises(fusedattn.NotSupportedError, match="TRITON_INTERPRET=1"):
            fusedattn.attention(*qkv(), backend="triton")
    finally:
        plan._plan_cached.cache_clear()


def test_float64_only_on_cpu_path():
    q, k, v = qkv(dtype=torch.float64)
    out = fusedattn.attention(q, k, v, backend="cpu")
    assert out.dtype == torch.float64
    with pytest.raises(fusedattn.NotSupportedError, match="CPU path"):
        fusedattn.attention(q, k, v, backend="triton")


def test_bfloat16_under_the_interpreter_is_right_or_refused():
    """Triton's interpreter multiplies bfloat16 tiles wrongly in tl.dot (3.6-3.9: results ~1e8 off, no
    error; ``backends/interpreter_check.py``): fusedattn refuses bfloat16 there, naming the ways out, while
    the probe finds it wrong, and on an interpreter that gets it right computes what the CPU path computes.
    Never a silent wrong answer."""
    from conftest import INTERPRET
    if not INTERPRET:
        pytest.skip("Triton interpreter off (TRITON_INTERPRET unset)")
    from fusedattn.backends.interpreter_check import bf16_dot_ok
    q, k, v = qkv(dtype=torch.bfloat16)
    if bf16_dot_ok():
        got = fusedattn.attention(q, k, v, backend="triton")
        torch.testing.assert_close(got, fusedattn.attention(q, k, v, backend="cpu"), atol=2e-2, rtol=2e-2)
    else:
        with pytest.raises(fusedattn.NotSupportedError, match=r"bfloat16 under Triton's interpreter.*backend='cpu'"):
            fusedattn.attention(q, k, v, backend="triton")
    # float16 is unaffected: the interpreter runs it
    assert fusedattn.attention(*qkv(dtype=torch.float16), backend="triton").dtype == torch.float16


def test_output_buffers_sharing_memory_with_inputs_are_refused():
    """An ``out=`` (``dq=`` / ``dk=`` / ``dv=``, a cache call's ``out=``) that shares memory with a tensor the
    call reads is refused by name: the kernels read K/V for every row while they write rows of the output,
    so out=k gave errors of 0.86 on the Triton path, and out=q would hand autograd overwritten inputs. A
    slice of the same buffer that shares nothing with them is accepted and right."""
    q, k, v = qkv(h_kv=4, s=40, d=16, d_v=16)
    with pytest.raises(ValueError, match="out shares memory with k"):
        fusedattn.attention_forward(q, k, v, out=k)
    with pytest.raises(ValueError, match="out shares memory with q"):
        fusedattn.attention_forward(q, k, v, out=q)
    with pytest.raises(ValueError, match="out shares memory with v"):
        fusedattn.attention_forward(q, k, v, out=v.view(v.shape))
    out, stats = fusedattn.attention_forward(q, k, v, return_stats=True)
    do = torch.randn_like(out)
    with pytest.raises(ValueError, match="dq shares memory with grad_out"):
        fusedattn.attention_backward(q, k, v, out, do, stats, dq=do)
    with pytest.raises(ValueError, match="dk shares memory with v"):
        fusedattn.attention_backward(q, k, v, out, do, stats, dk=v)
    with pytest.raises(ValueError, match="out shares memory with k_cache"):
        fusedattn.attention_with_kvcache(q, k, v, out=k)
    # the cache door checks its flag as make_problem does (bool("no") is True)
    with pytest.raises(TypeError, match="causal must be a bool, got 'no'"):
        fusedattn.attention_with_kvcache(q, k, v, causal="no")
    # disjoint parts of one buffer: accepted, and the same answer as fresh buffers
    buf = torch.empty(2, *q.shape)
    buf[0] = q
    got, _ = fusedattn.attention_forward(buf[0], k, v, out=buf[1])
    torch.testing.assert_close(got, fusedattn.attention(q, k, v))


def test_zero_length_sequences():
    q, k, v = qkv(s=8)
    out = fusedattn.attention(q, k[:, :, :0], v[:, :, :0])
    assert out.shape == (2, 4, 8, 64) and (out == 0).all()
    assert fusedattn.attention(q[:, :, :0], k, v).shape == (2, 4, 0, 64)
