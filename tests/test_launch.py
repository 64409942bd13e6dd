"""Host-overhead shortcuts: the remembered validation of plain calls (problem.make_problem) and
the direct launch of cached compiled kernels (backends/triton/launch.py)."""
import inspect

import pytest
import torch

import fusedattn
from fusedattn.backends import compat
from fusedattn.backends.triton import bwd, fwd
from fusedattn.backends.triton.launch import _UNASKED, cdiv, pow2
from fusedattn.problem import make_problem
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within

from conftest import HAS_CUDA


def _check_against_reference(q, k, v, do, got, low, msg, **kw):
    """Assert the 2x rule (fusedattn.testing.assert_error_within) for got = (out or None, dq, dk, dv)
    against the float64 reference of attention(q, k, v, **kw) with upstream gradient do; ``low`` is
    the same-precision baseline's dtype. Tensors in kw go to the CPU with the inputs."""
    kw = {key: val.cpu() if isinstance(val, torch.Tensor) else val for key, val in kw.items()}
    refs = {}
    for dt in (torch.float64, low):
        rq, rk, rv = (t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v))
        ro, _ = attention_reference(rq, rk, rv, dtype=dt, **kw)
        ro.backward(do.cpu().to(dt))
        refs[dt] = (ro, rq.grad, rk.grad, rv.grad)
    for name, g, gold, base in zip(("out", "dq", "dk", "dv"), got, refs[torch.float64], refs[low]):
        if g is not None:
            assert_error_within(g.detach().cpu(), gold, base, msg=f"{name} {msg}")


def test_pow2_and_cdiv_match_triton():
    import triton
    for n in list(range(1, 300)) + [1023, 1024, 1025]:
        assert pow2(n) == triton.next_power_of_2(n), n
        assert cdiv(n, 64) == triton.cdiv(n, 64), n


def test_make_problem_memo_returns_fresh_extras_and_still_validates():
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    p1, e1 = make_problem(q, k, v, causal=True)
    e1["cu_seqlens_q"] = "mutated by a caller"
    p2, e2 = make_problem(q.clone(), k, v, causal=True)
    assert p2 == p1 and "cu_seqlens_q" not in e2           # same description, an unshared extras dict
    assert make_problem(q, k, v, causal=False)[0].band is None   # options are part of the key
    with pytest.raises(TypeError, match="dtype"):           # a new dtype is validated, not served
        make_problem(q, k.half(), v)
    with pytest.raises(ValueError, match="dropout_seed"):   # so is every scalar
        make_problem(q, k, v, dropout_seed=-1)
    with pytest.raises(ValueError, match="window"):         # an unhashable window still gets its error
        make_problem(q, k, v, window=(3, [1]))
    # a value equal to a remembered one but of another type (True == 1 == 1.0) is validated, not served
    make_problem(q, k, v, attn_scale=1.0, window=(1, 0))
    with pytest.raises(TypeError, match="attn_scale"):
        make_problem(q, k, v, attn_scale=True, window=(1, 0))
    with pytest.raises(ValueError, match="window"):
        make_problem(q, k, v, attn_scale=1.0, window=(True, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: direct-launch test skipped")
def test_sync_debug_mode_does_not_turn_the_fast_path_off(monkeypatch):
    """The self-check's probe reads back to the host once. Asked first under
    ``torch.cuda.set_sync_debug_mode("error")`` (as validate=False callers check that nothing syncs), it
    used to fail there and turn the fast path off for the rest of the process (test_launch failed after
    test_flash_attn_api's validate=False tests in the same worker, H100); it now probes with the mode off."""
    from fusedattn import plan as plan_mod
    from fusedattn.backends import selfcheck
    monkeypatch.setenv("FUSEDATTN_GLUON", "0")
    monkeypatch.setattr(selfcheck, "_RESULT", {})
    plan_mod._plan_cached.cache_clear()
    fwd._FWD.cache.clear()
    try:
        gen = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, 2, 100, 64, generator=gen).to("cuda", torch.float16) for _ in range(3))
        first, _ = fusedattn.attention_forward(q, k, v, validate=False)      # compiles: a cache entry
        torch.cuda.set_sync_debug_mode("error")
        try:
            again, _ = fusedattn.attention_forward(q, k, v, validate=False)  # the repeat asks for the fast path
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert selfcheck._RESULT.get("plain") is True, "the probe failed under sync debug mode"
        assert fwd._FWD.cache and all(e[3] is not None and e[3] is not _UNASKED for e in fwd._FWD.cache.values()), \
            "no direct C launch after a first ask under sync debug mode"
        assert torch.equal(first, again)
    finally:
        plan_mod._plan_cached.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: direct-launch test skipped")
@pytest.mark.parametrize("causal", [False, True])
def test_repeat_calls_launch_the_cached_kernel_and_stay_correct(causal, monkeypatch):
    """The second call with the same metadata takes the direct path (a cache entry exists before
    it); new data, a new layout and a misaligned view must all still give the right answer. The
    Triton kernels' launchers: the Gluon kernels are turned off, whatever the planner's routing."""
    from fusedattn import plan as plan_mod
    monkeypatch.setenv("FUSEDATTN_GLUON", "0")
    plan_mod._plan_cached.cache_clear()
    try:
        _repeat_calls_check(causal)
    finally:
        monkeypatch.delenv("FUSEDATTN_GLUON")
        plan_mod._plan_cached.cache_clear()


def _repeat_calls_check(causal):
    torch.manual_seed(0)
    launchers = (fwd._FWD, bwd._DQ, bwd._DKDV)
    for x in launchers:
        x.cache.clear()     # entries of earlier tests in this process, launched once, stay _UNASKED
    b, h, s, d = 2, 4, 200, 64

    def check(q, k, v):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fusedattn.attention(qs, ks, vs, causal=causal)
        do = torch.randn_like(out)
        out.backward(do)
        _check_against_reference(q, k, v, do, (out, qs.grad, ks.grad, vs.grad), torch.float16, f"causal={causal}",
                                 causal=causal)

    bshd = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2)  # noqa: E731
    check(bshd(), bshd(), bshd())
    entries = [len(x.cache) for x in launchers]
    direct = [x.direct_launches for x in launchers]
    assert min(entries) >= 1
    check(bshd(), bshd(), bshd())                       # direct launches, new data
    assert [len(x.cache) for x in launchers] == entries
    assert all(x.direct_launches > n for x, n in zip(launchers, direct)), "the repeat call went through the JIT"
    # through the C launch function itself (compat.direct_launch, after its self-check)
    assert all(entry[3] is not None and entry[3] is not _UNASKED for x in launchers for entry in x.cache.values()), \
        f"no direct C launch: {compat.last_refusal}"
    bhsd = lambda: torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)  # noqa: E731
    check(bhsd(), bhsd(), bhsd())                       # new strides: a new key
    assert len(fwd._FWD.cache) == entries[0] + 1
    base = torch.randn(b * h * s * d + 8, device="cuda", dtype=torch.float16)
    odd = base[3:3 + b * h * s * d].view(b, h, s, d)     # 6-byte offset: copied to an aligned buffer
    check(odd, bhsd(), bhsd())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: direct-launch test skipped")
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_repeat_calls_skip_the_jit_and_stay_correct(splits):
    """Decode (one query row against a growing cache, as generate() calls it) is host-bound: a repeat
    signature launches the split-KV kernel and its combine directly (decode._DECODE / _COMBINE), and a
    new cache length that keeps the signature reuses the entry; results stay within the rule."""
    from fusedattn.backends.triton import decode
    gen = torch.Generator().manual_seed(splits)
    b, h_q, h_kv, d = 3, 8, 2, 64

    def step(s_kv):
        q = torch.randn(b, 1, h_q, d, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, h_kv, s_kv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        out = fusedattn.attention_with_kvcache(q, k, v, num_splits=splits)
        gold, _ = attention_reference(q.cpu(), k.cpu(), v.cpu())
        base, _ = attention_reference(q.cpu(), k.cpu(), v.cpu(), dtype=torch.bfloat16)
        assert_error_within(out.cpu(), gold, base, msg=f"decode s_kv={s_kv} splits={splits}")

    step(300)
    direct = decode._DECODE.direct_launches, decode._COMBINE.direct_launches
    for s_kv in (301, 302, 303):          # the same signature class (not == 1, not % 16, int32)
        step(s_kv)
    assert decode._DECODE.direct_launches >= direct[0] + 3, "repeat decode calls went through the JIT"
    if splits > 1:
        assert decode._COMBINE.direct_launches >= direct[1] + 3, "repeat combines went through the JIT"


def test_remembered_integer_keys_are_the_specialization():
    """triton/launch.py's integer memo (``_int_key``): a remembered integer's key is what the JIT specializes on
    (== 1, divisible by 16, 32-bit), the same on a second call, negative and huge values included, and a full
    memo starts over instead of growing."""
    from fusedattn.backends.triton import launch
    lo, hi = -2 ** 31, 2 ** 31
    values = (0, 1, 2, 15, 16, 17, 32, -1, -16, hi - 16, hi, hi + 1, lo - 16, lo, 3 * 2 ** 40)
    for _ in range(2):                                  # first computed, then remembered
        keys, _ = launch.signature_key(values, {})
        assert keys == tuple((v == 1, v % 16 == 0, lo <= v < hi) for v in values)
    assert launch.signature_key((16,), {}) != launch.signature_key((1,), {}) != launch.signature_key((17,), {})
    for v in range(5000):
        launch.signature_key((v,), {})
    assert len(launch._INT_KEYS) <= 4097
    assert launch.signature_key((1, 48, 2 ** 33), {})[0] == ((True, False, True), (False, True, True),
                                                            (False, True, False))


def test_gluon_signature_key_separates_what_the_jit_specializes_on():
    """backends/gluon/launch.py: equal keys for new data of the same metadata; a new key for a new
    dtype, alignment, box, integer class (== 1, divisible by 16, width), constexpr or an unknown type."""
    from fusedattn.backends.gluon.fwd_sm90 import _tma
    from fusedattn.backends.gluon.launch import signature_key
    x = torch.randn(2, 3, 40, 64, dtype=torch.float16)

    def key(t, rows=64, n=48, **kw):
        return signature_key((_tma(t, rows), t, n, 0.5, True), dict(BLOCK=64, **kw))

    assert key(x) == key(torch.randn_like(x))                        # new data, same metadata
    assert key(x) != key(x.to(torch.bfloat16))
    flat = torch.randn(2 * 3 * 40 * 64 + 8, dtype=torch.float16)
    assert key(x) != key(flat[1:1 + x.numel()].view_as(x))           # a 2-byte offset breaks 16-byte alignment
    assert key(x) != key(x, rows=128)
    assert key(x, n=48) == key(x, n=32) != key(x, n=40) != key(x, n=1) != key(x, n=2 ** 31 + 16)
    assert key(x) != key(x, SWITCH=True)
    with pytest.raises(TypeError, match="unexpected kernel argument"):
        signature_key((x.numpy(),), {})
    # a tensor or descriptor passed by keyword (the FP8 switches' scales and gradient buffers, new on every call):
    # keyed as a positional one, by name (the Launcher passes its value on each call; bench/NOTES.md 73 / 75)
    assert key(x, SCALES=x) == key(x, SCALES=torch.randn_like(x)) != key(x, SCALES=x.to(torch.bfloat16))
    assert key(x, SCALES=x) != key(x, AMAX=x)
    assert key(x, DESC=_tma(x, 64)) == key(x, DESC=_tma(torch.randn_like(x), 64)) != key(x, DESC=_tma(x, 128))
    assert not any(isinstance(v, torch.Tensor) or isinstance(v, tuple) and any(isinstance(e, torch.Tensor) for e in v)
                   for part in key(x, SCALES=x, DESC=_tma(x, 64))[1] for v in part), "a key holds a tensor"
    assert key(x, BLOCK2=64, STRIDE=0, SCALES=None) == key(x, BLOCK2=64, STRIDE=0, SCALES=None)


def _fake_jit(monkeypatch, tl_launch, seen):
    """A Launcher's surroundings with no GPU: the JIT records each launch's keywords into ``seen`` and returns a
    cacheable stand-in; one device, stream 0, no capture."""
    compiled = type("Compiled", (), {"packed_metadata": None})()      # what the JIT returns: cacheable
    monkeypatch.setattr(tl_launch, "jit_launch", lambda kernel, grid, *a, **kw: seen.append(kw) or compiled)
    monkeypatch.setattr(tl_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(tl_launch, "_current_raw_stream", lambda device: 0)
    monkeypatch.setattr(tl_launch, "interpreting", lambda: False)
    monkeypatch.setattr(tl_launch.compat, "ensure_context", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_a_launch_with_tensors_by_keyword_passes_them_on_each_call(monkeypatch):
    """backends/triton/launch.py ``Launcher``: a launch whose keyword arguments hold tensors is cached like any
    other, and its cached launches pass each call's tensors, with every parameter before the last of them, after the
    positional arguments in signature order (defaults where the call leaves one out); the cache keeps none of them
    (the FP8 switches' scales and gradient buffers: bench/NOTES.md 73 / 75)."""
    import weakref
    from types import SimpleNamespace
    from fusedattn.backends.triton import launch as tl_launch
    seen, launched = [], []
    _fake_jit(monkeypatch, tl_launch, seen)
    params = [SimpleNamespace(name=n, default=d, is_constexpr=c) for n, d, c in
              (("X", inspect.Parameter.empty, False), ("BLOCK", 16, True), ("SCALES", None, False),
               ("STRIDE", 0, False), ("AMAX", None, False), ("FLAG", False, True))]
    kernel = type("K", (), {"arg_names": [p.name for p in params], "params": params})()

    def direct(compiled, tail, args):
        return lambda gx, gy, gz, stream, call: launched.append((call, tail))
    launcher = tl_launch.Launcher(kernel, direct=direct)
    x, buf = torch.zeros(2), torch.zeros(4)
    ref = weakref.ref(buf)
    kw = dict(SCALES=buf, AMAX=torch.ones(3), STRIDE=7, FLAG=True)
    launcher(tl_launch.signature_key((x,), kw), (1,), x, **kw)
    assert len(seen) == 1 and len(launcher.cache) == 1
    for _ in range(2):
        fresh = dict(kw, SCALES=torch.zeros(4), AMAX=torch.ones(3))
        launcher(tl_launch.signature_key((x,), fresh), (1,), x, **fresh)
        call, tail = launched[-1]
        assert call[0] is x and call[1] == 16 and call[2] is fresh["SCALES"] and call[3] == 7 and call[4] is fresh["AMAX"]
        assert tail == (True,), tail
    assert len(seen) == 1 and launcher.direct_launches == 2, "the repeat launches skip the JIT"
    del buf, kw, seen[:], launched[:]
    assert ref() is None, "the cache kept a call's keyword tensor alive"


def test_a_runtime_number_by_keyword_is_passed_on_each_call(monkeypatch):
    """backends/triton/launch.py ``Launcher``: a number given by keyword for a runtime parameter with a default
    (``Launcher.runtime_names``: the fused backward's dropout seed and offset, bwd_fused_sm90 [Note] dropout) is
    keyed by its value class, as a positional integer, and passed on each call: a new seed per training step
    reuses the cached launch (one JIT launch) and launches with that step's seed, never a kept one; a value of
    another class (== 1) is a new key; a constexpr keyword stays keyed by its value."""
    from types import SimpleNamespace
    from fusedattn.backends.triton import launch as tl_launch
    seen, launched = [], []
    _fake_jit(monkeypatch, tl_launch, seen)
    params = [SimpleNamespace(name=n, default=d, is_constexpr=c) for n, d, c in
              (("X", inspect.Parameter.empty, False), ("STAGES", 2, True), ("SEED", 0, False), ("RESCALE", 1.0, False),
               ("DROPOUT", False, True))]
    kernel = type("K", (), {"arg_names": [p.name for p in params], "params": params})()
    launcher = tl_launch.Launcher(kernel, direct=lambda compiled, tail, args: (
        lambda gx, gy, gz, stream, call: launched.append((call, tail))))
    assert launcher.runtime_names == {"SEED", "RESCALE"}

    def run(**kw):
        launcher(tl_launch.signature_key((x,), kw, runtime_names=launcher.runtime_names), (1,), x, **kw)
    x = torch.zeros(2)
    for seed in (1234, 98765, 2 ** 20 + 3, 5):
        run(STAGES=3, SEED=seed, RESCALE=1 / 0.9, DROPOUT=True)
        if seed != 1234:
            call, tail = launched[-1]
            assert call == (x, 3, seed, 1 / 0.9), call      # this call's seed, the constexpr in its place
            assert tail == (True,), tail
    assert len(seen) == 1, "a new seed went through the JIT"
    run(STAGES=3, SEED=1, RESCALE=1 / 0.9, DROPOUT=True)      # the JIT specializes 1: a new key
    run(STAGES=2, SEED=7, RESCALE=1 / 0.9, DROPOUT=True)      # a constexpr by its value: a new key
    assert len(seen) == 3


@pytest.mark.parametrize("causal", [False, True])
def test_plain_forward_args_remembered_interpreter_or_gpu(causal):
    """The remembered argument list of plain forwards (fwd._PLAIN_ARGS): a repeat call with new
    data (and one without stats) must match the reference; runs the real kernel (interpreter on CPU)."""
    from conftest import INTERPRET
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("needs the GPU or Triton's interpreter")
    device = "cuda" if HAS_CUDA else "cpu"
    torch.manual_seed(1)
    shape = (1, 2, 100, 32)        # s_q * group > 64: the tiled kernel, not decode
    mk = lambda: torch.randn(shape, device=device, dtype=torch.float32)  # noqa: E731
    for stats in (True, True, False):
        q, k, v = mk(), mk(), mk()
        out, lse = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=stats, backend="triton")
        gold, gold_lse = attention_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), causal=causal,
                                             dtype=torch.float64)
        base, _ = attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=causal, dtype=torch.float32)
        assert_error_within(out.cpu(), gold, base, msg=f"causal={causal} stats={stats}")
        if stats:
            assert torch.allclose(lse.cpu().double().squeeze(-1), gold_lse.double().squeeze(-1), atol=1e-4)
    remembered = [key for key in fwd._PLAIN_ARGS if key[0].s_q == 100 and key[0].d == 32 and
                  (key[0].band is not None) == causal]
    assert len(remembered) == 2, remembered                  # with and without stats


def test_plain_backward_args_remembered_interpreter_or_gpu():
    """bwd._PLAIN_ARGS: the second backward with the same metadata reuses the remembered argument
    lists (three kernels) and must still match float64 autograd of the reference."""
    from conftest import INTERPRET
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("needs the GPU or Triton's interpreter")
    device = "cuda" if HAS_CUDA else "cpu"
    torch.manual_seed(2)
    shape_q, shape_kv = (1, 4, 70, 32), (1, 2, 45, 32)
    for _ in range(2):
        q = torch.randn(shape_q, device=device)
        k, v = torch.randn(shape_kv, device=device), torch.randn(shape_kv, device=device)
        do = torch.randn(shape_q, device=device)
        out, stats = fusedattn.attention_forward(q, k, v, causal=True, return_stats=True, backend="triton")
        got = fusedattn.attention_backward(q, k, v, out, do, stats, causal=True, backend="triton")[:3]
        _check_against_reference(q, k, v, do, (None, *got), torch.float32, "plain backward", causal=True)
    assert any(key[0].s_q == 70 and key[0].s_kv == 45 for key in bwd._PLAIN_ARGS)


@pytest.mark.parametrize("what, names", [("forward", ("fwd_sm90", )),
                                         ("backward", ("bwd_dq_sm90", "bwd_dkdv_sm90"))])
def test_gluon_import_failure_falls_back_only_on_an_unsupported_triton(what, names, monkeypatch):
    """Issue 23: on a Triton outside 3.6-3.9 a Gluon module that fails to import turns that pass's Gluon
    kernels off with one warning naming the version; on a supported Triton the failure is raised."""
    import sys

    from fusedattn import functional
    from fusedattn.backends import compat, gluon
    functional._gluon_kernels.cache_clear()
    monkeypatch.delattr(gluon, names[0], raising=False)                           # as if never imported
    monkeypatch.setitem(sys.modules, f"fusedattn.backends.gluon.{names[0]}", None)  # import raises ImportError
    monkeypatch.setattr(functional, "_gluon_off", set())
    monkeypatch.setattr(compat, "_warned", set())
    try:
        monkeypatch.setattr(compat, "SUPPORTED", True)
        with pytest.raises(ImportError):
            functional._gluon_kernels(what, *names)
        monkeypatch.setattr(compat, "SUPPORTED", False)
        with pytest.warns(RuntimeWarning, match=f"Gluon {what} kernels failed on Triton .* outside"):
            assert functional._gluon_kernels(what, *names) is None
        assert what in functional._gluon_off
    finally:
        functional._gluon_kernels.cache_clear()


def test_gluon_launch_failure_falls_back_only_on_an_unsupported_triton(monkeypatch):
    """A Gluon launch that raises (a compile error on a Triton we do not know): on a supported Triton the
    error propagates; on another the pass falls back (False: the caller runs the portable kernel), with
    one warning, and later calls skip Gluon without trying."""
    from fusedattn import functional
    from fusedattn.backends import compat
    monkeypatch.setattr(functional, "_gluon_off", set())
    monkeypatch.setattr(compat, "_warned", set())
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("CompilationError stand-in")

    monkeypatch.setattr(compat, "SUPPORTED", True)
    with pytest.raises(RuntimeError, match="stand-in"):
        functional._gluon_ran("forward", broken)
    assert functional._gluon_ran("forward", lambda: True) is True
    monkeypatch.setattr(compat, "SUPPORTED", False)
    with pytest.warns(RuntimeWarning, match="Gluon forward kernels failed"):
        assert functional._gluon_ran("forward", broken) is False
    assert functional._gluon_ran("forward", broken) is False          # off now: not tried again
    assert len(calls) == 2
    assert functional._gluon_ran("backward", lambda: True) is True     # the other pass is untouched


def _counted(launch, name, calls):
    """``launch`` that appends ``name`` to ``calls`` when it runs (not when it only compiles ahead)."""
    from fusedattn.backends.triton import launch as launch_mod

    def counted(*a, **kw):
        if getattr(launch_mod._ahead, "active", None) is None:
            calls.append(name)
        return launch(*a, **kw)
    return counted


# (d, attention kwargs): no mask and causal take both Gluon passes at d=128; a window with ALiBi and the
# wide head dims take the Gluon dQ pass and, where the Gluon dK/dV pass refuses them, the Triton one
GLUON_ROUTES = {"plain": (128, dict()), "causal": (128, dict(causal=True, causal_alignment="bottom_right")),
                "window_alibi": (128, dict(window=(100, 0), alibi=True)),
                "d224_causal": (224, dict(causal=True)),
                # lengths per batch entry (lists here: tensors are made on the GPU in the test)
                "padding_causal": (128, dict(causal=True, seq_len_q=[333, 100], seq_len_kv=[517, 1]))}


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon backward is Hopper-only (compute capability 9.x): GPU test skipped")
@pytest.mark.parametrize("route", GLUON_ROUTES)
def test_gluon_backward_is_routed_and_matches_the_reference(route, monkeypatch):
    """bf16 through autograd takes the Gluon dQ pass and the dK/dV pass that accepts the call (counted),
    and its gradients pass the reference rule; GQA, BSHD memory, odd lengths."""
    from fusedattn.backends.gluon import bwd_dkdv_sm90, bwd_dq_sm90
    from fusedattn.problem import make_problem
    d, kw = GLUON_ROUTES[route]
    kw = {key: torch.tensor(val, dtype=torch.int32, device="cuda") if isinstance(val, list) else val
          for key, val in kw.items()}
    calls = []
    for mod, name in ((bwd_dq_sm90, "launch_dq_sm90"), (bwd_dkdv_sm90, "launch_dkdv_sm90")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, _counted(orig, name, calls))
    torch.manual_seed(3)
    mk = lambda h, s: torch.randn(2, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v = mk(8, 333), mk(2, 517), mk(2, 517)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fusedattn.attention(qs, ks, vs, deterministic=True, **kw)     # the two passes, whatever the mask
    do = torch.randn_like(out)
    out.backward(do)
    p, extras = make_problem(q, k, v, **kw)
    gluon_dkdv = bwd_dkdv_sm90.supports(p, q, k, v, do, torch.empty_like(k), torch.empty_like(v),
                                        slopes=extras["slopes"], seq_len_q=extras["seq_len_q"],
                                        seq_len_kv=extras["seq_len_kv"])
    assert calls == ["launch_dq_sm90"] + ["launch_dkdv_sm90"] * gluon_dkdv, calls
    _check_against_reference(q, k, v, do, (None, qs.grad, ks.grad, vs.grad), torch.bfloat16, f"route={route}", **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon backward is Hopper-only (compute capability 9.x): GPU test skipped")
@pytest.mark.parametrize("mask", ["plain", "causal", "causal_long"])
def test_nondeterministic_backward_routing(mask, monkeypatch):
    """deterministic=False at d128 with no mask takes the single-pass backward (counted), with a causal
    mask the two passes below functional._FUSED_CAUSAL_MIN_KEYS keys and the single pass from there
    ("causal_long": the threshold lowered under this test's 517 keys); True never takes it, nor the
    default (None) under torch.use_deterministic_algorithms(True). Gradients pass the reference rule."""
    from fusedattn import functional
    from fusedattn.backends.gluon import bwd_dkdv_sm90, bwd_dq_sm90, bwd_fused_sm90
    causal = mask != "plain"
    if mask == "causal_long":
        monkeypatch.setattr(functional, "_FUSED_CAUSAL_MIN_KEYS", 512)
    calls = []
    for mod, name in ((bwd_dq_sm90, "launch_dq_sm90"), (bwd_dkdv_sm90, "launch_dkdv_sm90"),
                      (bwd_fused_sm90, "launch_bwd_fused_sm90")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, _counted(orig, name, calls))
    torch.manual_seed(5)
    mk = lambda h, s: torch.randn(2, s, h, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v = mk(8, 333), mk(2, 517), mk(2, 517)
    do = torch.randn_like(q)
    for deterministic, torch_flag in ((True, False), (False, False), (None, False), (None, True)):
        calls.clear()
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fusedattn.attention(qs, ks, vs, causal=causal, deterministic=deterministic)
        torch.use_deterministic_algorithms(torch_flag, warn_only=True)
        try:
            out.backward(do)
        finally:
            torch.use_deterministic_algorithms(False)
        fused = not (deterministic or (deterministic is None and torch_flag)) and mask != "causal"
        assert calls == (["launch_bwd_fused_sm90"] if fused else ["launch_dq_sm90", "launch_dkdv_sm90"]), calls
        _check_against_reference(q, k, v, do, (None, qs.grad, ks.grad, vs.grad), torch.bfloat16,
                                 f"causal={causal} deterministic={deterministic}", causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon kernels are Hopper-only (compute capability 9.x): GPU test skipped")
@pytest.mark.parametrize("route", ["padding_causal", "window_alibi"])
def test_gluon_repeat_calls_launch_the_cached_kernels(route):
    """backends/gluon/launch.py: a second forward + backward with new data of the same metadata launches
    the cached Gluon kernels directly (counted; through the C launcher, TMA encodings kept per base
    pointer, shape and strides) and stays correct (output and gradients against the
    reference); a new layout (BHSD instead of BSHD) is a new cache entry, not a wrong launch."""
    from fusedattn.backends.gluon import bwd_dq_sm90, fwd_sm90
    from fusedattn.backends.gluon.launch import _LAUNCHERS
    d, kw = GLUON_ROUTES[route]
    kw = {key: torch.tensor(val, dtype=torch.int32, device="cuda") if isinstance(val, list) else val
          for key, val in kw.items()}
    torch.manual_seed(6)

    def check(layout):
        mk = {"bshd": lambda h, s: torch.randn(2, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
              "bhsd": lambda h, s: torch.randn(2, h, s, d, device="cuda", dtype=torch.bfloat16)}[layout]
        q, k, v = mk(8, 333), mk(2, 517), mk(2, 517)
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fusedattn.attention(qs, ks, vs, deterministic=True, **kw)
        do = torch.randn_like(out)
        out.backward(do)
        _check_against_reference(q, k, v, do, (out, qs.grad, ks.grad, vs.grad), torch.bfloat16,
                                 f"route={route} layout={layout}", **kw)

    check("bshd")
    launchers = [_LAUNCHERS[fwd_sm90._attn_fwd_sm90], _LAUNCHERS[bwd_dq_sm90._attn_bwd_dq_sm90]]
    # only this test's entries (other tests in this process leave entries launched once, fast path unasked)
    for x in launchers:
        x.cache.clear()
    check("bshd")
    entries = [len(x.cache) for x in launchers]
    direct = [x.direct_launches for x in launchers]
    check("bshd")                                        # new data: direct launches
    assert [len(x.cache) for x in launchers] == entries
    assert all(x.direct_launches > n for x, n in zip(launchers, direct)), "the repeat call went through the JIT"
    # the repeat launches call the C launcher with cached TMA encodings (compat.direct_launch)
    assert all(entry[3] is not None and entry[3] is not _UNASKED for x in launchers for entry in x.cache.values()), \
        "no direct C launch"
    check("bhsd")                                        # new strides: same specialization, re-encoded, still right


def test_gluon_host_layouts_are_made_once():
    """Every layout a launch function passes is one kept object per geometry: backends/gluon/launch._layout_token
    answers a kept layout by identity and a new one only through its repr (hashing the frozen dataclass costs more
    than the launch). The fused backward's dQ box was built anew per call and, keyed by id() then, missed the
    launch cache on most backwards (bench/NOTES.md 88)."""
    pytest.importorskip("triton.experimental.gluon")
    from fusedattn.backends.gluon import bwd_fused_sm90, fwd_sm90
    for flat in (False, True):
        for d in (64, 128):
            first, again = bwd_fused_sm90._dq_box(flat, d), bwd_fused_sm90._dq_box(flat, d)
            assert first[1] is again[1], f"_dq_box(flat={flat}, d={d}) made a new layout"
    assert fwd_sm90._smem_layout(128, 128, torch.bfloat16) is fwd_sm90._smem_layout(128, 128, torch.bfloat16)
    # the two dQ layouts at d=64 share a box shape: only the layout tells their launches apart
    assert bwd_fused_sm90._dq_box(False, 64)[0] == bwd_fused_sm90._dq_box(True, 64)[0]
    assert bwd_fused_sm90._dq_box(False, 64)[1] is not bwd_fused_sm90._dq_box(True, 64)[1]


def test_gluon_launch_keys_layouts_by_value():
    """backends/gluon/launch.signature_key: a descriptor's layout keys by value, so a layout made anew on each call
    (equal fields, a new object, perhaps at a freed one's address) gives the same key, and two layouts that differ
    (the d=64 dQ boxes: the same box shape, swizzled or not) never share one."""
    pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon import language as gl

    from fusedattn.backends.gluon.launch import Tma, signature_key

    def layout(swizzle):
        return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=4)

    acc = torch.zeros(1, 2, 64, 64)

    def key(lay):
        return signature_key((Tma(acc, acc.shape, acc.stride(), (1, 1, 64, 32), lay), 7), {"D": 64})

    kept = layout(128)
    assert key(kept) == key(kept)
    assert key(layout(128)) == key(layout(128)) == key(kept), "equal layouts made apart key differently"
    assert key(layout(0)) != key(layout(128)), "a flat and a swizzled layout share a launch key"
    for _ in range(300):        # past the token table's size: it is cleared, the keys stay the same
        assert key(layout(0)) != key(kept)
    assert key(kept) == key(layout(128))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon kernels are Hopper-only (compute capability 9.x): GPU test skipped")
@pytest.mark.parametrize("d", [64, 128])
def test_fused_backward_repeat_calls_launch_the_cached_kernels(d):
    """The single-pass backward's three launches (delta and dQ-accumulator zeroing, the kernel, dQ's conversion),
    repeated through autograd (the engine's device thread) with new data: every repeat launch takes the cached
    direct path (no new cache entry, one direct launch per kernel per call) and the gradients stay right."""
    from fusedattn.backends.gluon import bwd_fused_sm90
    from fusedattn.backends.gluon.launch import _LAUNCHERS
    from fusedattn.plan import GLUON_BWD_FUSED_MIN_WORK
    torch.manual_seed(8)
    b, h, s = 2, 4, 512
    if d in GLUON_BWD_FUSED_MIN_WORK:     # the d=64 single pass starts at a work size
        s = max(s, int((GLUON_BWD_FUSED_MIN_WORK[d] / (b * h)) ** 0.5) + 64)
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731

    def step():
        q, k, v = mk(), mk(), mk()
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fusedattn.attention(qs, ks, vs, deterministic=False)
        do = torch.randn_like(out)
        out.backward(do)
        return q, k, v, do, (None, qs.grad, ks.grad, vs.grad)

    step()
    launchers = [_LAUNCHERS[kernel] for kernel in (bwd_fused_sm90._delta_zero, bwd_fused_sm90._attn_bwd_fused_sm90,
                                                   bwd_fused_sm90._dq_convert)]
    entries = [len(x.cache) for x in launchers]
    direct = [x.direct_launches for x in launchers]
    for i in range(3):
        q, k, v, do, got = step()
        _check_against_reference(q, k, v, do, got, torch.bfloat16, f"fused backward d={d} repeat {i}")
    assert [len(x.cache) for x in launchers] == entries, "a repeat backward made a new launch-cache entry"
    assert [x.direct_launches - n for x, n in zip(launchers, direct)] == [3, 3, 3], \
        "a repeat backward's launch went through the JIT"


def _all_launchers():
    """Every launch cache of the package: the Gluon kernels' (made at first launch) and the portable kernels'."""
    from fusedattn.backends.gluon.launch import _LAUNCHERS
    from fusedattn.backends.triton import decode
    from fusedattn.backends.triton.launch import Launcher
    found = list(_LAUNCHERS.values())
    for mod in (fwd, bwd, decode):
        found += [x for x in vars(mod).values() if isinstance(x, Launcher)]
    return found


# (d, s, attention kwargs) of training calls taking each backward route: the single pass (d=128 and d=64 from its
# work size, dropout), the two Gluon passes (deterministic, masks), the portable pair (small d=64)
REPEAT_ROUTES = {"fused_d128": (128, 512, dict(deterministic=False)),
                 "fused_d64": (64, 2112, dict(deterministic=False)),
                 "fused_dropout": (128, 512, dict(deterministic=False, dropout_p=0.1)),
                 "two_pass_causal": (128, 700, dict(deterministic=True, causal=True)),
                 "two_pass_window_alibi": (128, 700, dict(deterministic=True, window=(100, 0), alibi=True)),
                 "padding_causal": (128, 517, dict(causal=True, seq_len_q=[333, 100], seq_len_kv=[517, 1])),
                 "portable_d64": (64, 300, dict(causal=True))}


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon kernels are Hopper-only (compute capability 9.x): GPU test skipped")
@pytest.mark.parametrize("route", REPEAT_ROUTES)
def test_repeat_training_steps_add_no_launch_entries(route):
    """A training step repeated with new data of the same metadata (forward and backward through autograd) makes no
    new launch-cache entry in any kernel's cache: every key part is the same from call to call (a part that is not
    sends each call through the JIT's dispatch: the fused backward's per-call dQ layout did while layouts were keyed
    by id(), bench/NOTES.md 88)."""
    d, s, kw = REPEAT_ROUTES[route]
    kw = {key: torch.tensor(val, dtype=torch.int32, device="cuda") if isinstance(val, list) else val
          for key, val in kw.items()}
    torch.manual_seed(9)
    mk = lambda h: torch.randn(2, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731

    def step():
        q, k, v = (mk(h).requires_grad_() for h in (4, 2, 2))
        out = fusedattn.attention(q, k, v, **kw)
        out.backward(torch.randn_like(out))
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), f"route={route}: a non-finite gradient"

    step()
    step()
    torch.cuda.synchronize()
    entries = {id(x): len(x.cache) for x in _all_launchers()}
    direct = sum(x.direct_launches for x in _all_launchers())
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    grown = [(x.kernel.fn.__name__ if hasattr(x.kernel, "fn") else x.kernel, entries.get(id(x), 0), len(x.cache))
             for x in _all_launchers() if len(x.cache) != entries.get(id(x), 0)]
    assert not grown, f"route={route}: repeat steps made launch-cache entries (kernel, before, after): {grown}"
    assert sum(x.direct_launches for x in _all_launchers()) > direct, f"route={route}: no cached launch"


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon kernels are Hopper-only (compute capability 9.x): GPU test skipped")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "plain"])
def test_persistent_forward_first_launched_inside_a_graph_capture(causal):
    """The persistent forward's tile counter is never made inside a CUDA-graph capture (it would live in
    the graph's private pool): a stream's first launch under capture takes the one-tile grid (causal)
    or the persistent grid's static hand-out (equal tiles); replays match the eager (dynamic
    persistent) result bit for bit and the reference."""
    from fusedattn.backends.gluon import fwd_sm90
    from fusedattn.backends.gluon.launch import _LAUNCHERS
    torch.manual_seed(7)
    mk = lambda: torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v = mk(), mk(), mk()
    p, _ = make_problem(q, k, v, causal=causal)
    assert fwd_sm90._persistent_default(p), "the test needs a problem whose default grid is persistent"
    eager = fusedattn.attention_forward(q, k, v, causal=causal)[0]
    # compile the kernel the capture will take outside it
    grid = dict(persistent=False) if causal else dict(persistent=True, dynamic=False)
    fwd_sm90.launch_fwd_sm90(p, q, k, v, torch.empty_like(eager), None, **grid)
    torch.cuda.synchronize()
    compiled = len(_LAUNCHERS[fwd_sm90._attn_fwd_sm90].cache)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = fusedattn.attention_forward(q, k, v, causal=causal)[0]
    assert (q.device.index, stream.cuda_stream) not in fwd_sm90._COUNTERS
    assert len(_LAUNCHERS[fwd_sm90._attn_fwd_sm90].cache) == compiled, "the capture took another grid"
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    gold, _ = attention_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), causal=causal,
                                  dtype=torch.float64)
    base, _ = attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=causal, dtype=torch.bfloat16)
    assert_error_within(captured.cpu(), gold, base, msg=f"captured persistent-default forward, causal={causal}")


def test_launch_delta_interpreter_or_gpu():
    """bwd.launch_delta (the Gluon backward's separate delta pass when there is no mask) writes
    rowsum(dO * O) for every row, odd lengths and BSHD strides included, into a NaN-filled buffer."""
    from conftest import INTERPRET
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("needs the GPU or Triton's interpreter")
    device = "cuda" if HAS_CUDA else "cpu"
    torch.manual_seed(4)
    b, h, s, d = 2, 3, 77, 40
    out = torch.randn(b, s, h, d, device=device).transpose(1, 2)
    do = torch.randn(b, s, h, d, device=device).transpose(1, 2)
    p, _ = make_problem(out, out, out)
    delta = torch.full((b * h, s), float("nan"), device=device)
    bwd.launch_delta(p, out, do, delta)
    gold = (out.double() * do.double()).sum(-1).reshape(b * h, s)
    assert torch.allclose(delta.double().cpu(), gold.cpu(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(window=(20, 0), alibi=True), dict(causal=True, causal_alignment="bottom_right")],
                         ids=["window_alibi", "causal_br"])
def test_launch_bwd_dkdv_only_with_a_given_delta(kw):
    """launch_bwd(..., delta=) (the Triton dK/dV pass after the Gluon dQ pass) runs the dK/dV pass
    alone: dK and dV equal the full backward's bit for bit, and dQ (the caller's) is left untouched."""
    from conftest import INTERPRET
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("needs the GPU or Triton's interpreter")
    from fusedattn.plan import plan
    device = "cuda" if HAS_CUDA else "cpu"
    torch.manual_seed(5)
    q = torch.randn(1, 45, 4, 32, device=device).transpose(1, 2)
    k, v = (torch.randn(1, 2, 70, 32, device=device) for _ in range(2))
    p, extras = make_problem(q, k, v, **kw)
    pl = plan(p, "triton")
    out, stats = fusedattn.attention_forward(q, k, v, return_stats=True, backend="triton", **kw)
    do = torch.randn_like(out)
    lse = stats[..., 0]
    full = [torch.empty_like(t) for t in (q, k, v)]
    bwd.launch_bwd(p, pl, q, k, v, out, do, lse, extras, *full, False)
    delta = torch.empty((p.b * p.h_q, p.s_q), device=device)
    bwd.launch_delta(p, out, do, delta)
    dq = torch.full_like(q, float("nan"))
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    bwd.launch_bwd(p, pl, q, k, v, out, do, lse, extras, dq, dk, dv, False, delta=delta)
    assert torch.isnan(dq).all(), "dQ was written by a dK/dV-only launch"
    assert torch.equal(dk, full[1]) and torch.equal(dv, full[2])


def test_planner_routes_d64_forward_to_gluon_only_for_plain_calls(monkeypatch):
    """plan.py: at d=64 the Gluon forward takes plain calls (no band, lengths or ALiBi), where it
    measured faster than the Triton kernel; causal, windowed, padded and ALiBi calls stay on Triton,
    while d=128 takes Gluon for all of them. The planner itself, on problems that say CUDA (no GPU
    needed: plan() reads only the description)."""
    import dataclasses
    from fusedattn import plan as plan_mod
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FUSEDATTN_GLUON", raising=False)
    plan_mod._plan_cached.cache_clear()
    try:
        lens = torch.tensor([30, 64], dtype=torch.int32)
        cases = {"plain": {}, "causal": dict(causal=True), "window": dict(window=(8, 0)),
                 "padded": dict(seq_len_q=lens, seq_len_kv=lens), "alibi": dict(alibi=True)}
        for d in (64, 128):
            q, k, v = (torch.randn(2, 4, 64, d, dtype=torch.bfloat16) for _ in range(3))
            for name, kw in cases.items():
                p, _ = make_problem(q, k, v, **kw)
                route = plan_mod.plan(dataclasses.replace(p, device_type="cuda"))
                want = d == 128 or name == "plain"
                assert route.backend == "triton" and route.fwd_gluon == want, \
                    f"d={d} {name}: {route}, expected fwd_gluon={want}"
    finally:
        plan_mod._plan_cached.cache_clear()


def _same_sequence(call):
    """A launch call with its kernel-argument sequence (3.7+: the last argument) as a list: the C launcher
    reads a tuple and a list alike (PySequence_Fast)."""
    return tuple(list(a) if isinstance(a, (tuple, list)) and i == len(call) - 1 else a for i, a in enumerate(call))


def test_direct_launch_passes_what_tritons_launcher_would(monkeypatch):
    """compat.direct_launch against Triton's own descriptor wrapper (``wrap_handle_tensordesc``) around a
    stand-in C launch function, in the installed Triton's launcher layout (3.6: flat arguments; 3.7+: one
    tuple beside the argument annotations): the same final arguments as Triton's ``CudaLauncher.__call__``
    passes, TMA descriptors encoded once per (base pointer, shape, strides) and again for a new base or
    new strides. Runs without a GPU (the encoding is a stand-in, the self-check is taken as passed); the
    GPU tests check the real launches and the self-check."""
    from types import SimpleNamespace

    import triton.backends.nvidia.driver as driver

    from fusedattn.backends import compat, selfcheck
    from fusedattn.backends.gluon.fwd_sm90 import _tma
    from fusedattn.backends.gluon.launch import _direct
    from fusedattn.backends.triton.launch import direct_c

    monkeypatch.setattr(selfcheck, "_RESULT", {"plain": True, "tma": True})
    encodings = []

    def encode(arg, meta, *rest):   # stands in for the CUtensorMap: records what it was built from
        encodings.append((arg.base.data_ptr(), tuple(arg.strides)))
        return [("map", arg.base.data_ptr(), meta["swizzle"]), *arg.shape, *arg.strides]

    class CFunction:                # a builtin-like callable (no __code__), recording its arguments
        def __init__(self):
            self.calls = []

        def __call__(self, *args):
            self.calls.append(args)

    generic = compat.TRITON_VERSION[:2] >= (3, 7)
    layout = dict(arg_annotations=("annotations", ), kernel_signature=b"sig") if generic else {}

    def triton_call(launch, grid, stream, compiled, args, tail):
        """What CudaLauncher.__call__ hands its ``launch`` (no scratch, no hooks), in this Triton's layout."""
        run = compiled.run
        if generic:
            return launch(*grid, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                          compiled.packed_metadata, None, None, None, None, None, run.arg_annotations,
                          run.kernel_signature, (*args, *tail))
        return launch(*grid, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                      compiled.packed_metadata, None, None, None, *args, *tail)

    signature = {"desc": "tensordesc<fp16[1, 1, 64, 64]>", "ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    c_function = CFunction()
    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    wrapper = driver.wrap_handle_tensordesc(c_function, signature, [{"swizzle": 128}])
    run = SimpleNamespace(launch=wrapper, global_scratch_size=0, profile_scratch_size=0,
                          launch_cooperative_grid=False, launch_pdl=False, **layout)
    compiled = SimpleNamespace(run=run, function=7, packed_metadata=("meta",),
                               metadata=SimpleNamespace(tensordesc_meta=[{"swizzle": 128}]))
    x = torch.zeros(2, 3, 64, 64, dtype=torch.float16)
    y = torch.zeros(2, 3, 64, 64, dtype=torch.float16)
    lse = torch.zeros(4)
    tail = (64, )
    go = _direct(compiled, tail, (_tma(x, 64), lse, 5))
    assert go is not None
    for t in (x, x, y, x.transpose(1, 2).contiguous().transpose(1, 2)):
        args = (_tma(t, 64), lse, 5)
        go(1, 2, 3, 99, args)
        triton_call(wrapper, (1, 2, 3), 99, compiled, args, tail)
        ours, theirs = map(_same_sequence, c_function.calls[-2:])
        assert ours == theirs
    # x twice: one encoding for our path (its repeat was cached), four for the wrapper's; then y
    # and x's new strides are new encodings for both
    assert len(encodings) == 3 + 4
    # no descriptor among the arguments: the C function itself is called
    plain = SimpleNamespace(run=SimpleNamespace(launch=c_function, global_scratch_size=0, profile_scratch_size=0,
                                                launch_cooperative_grid=True, launch_pdl=False, **layout),
                            function=8, packed_metadata=("m2",), metadata=SimpleNamespace(tensordesc_meta=None))
    direct_c(plain, (1, ), (lse, 3))(4, 5, 6, 77, (lse, 3))
    triton_call(c_function, (4, 5, 6), 77, plain, (lse, 3), (1, ))
    assert _same_sequence(c_function.calls[-1]) == _same_sequence(c_function.calls[-2])
    assert direct_c(compiled, tail, (lse, 3)) is None        # descriptor metadata but no descriptor argument
    plain.run.global_scratch_size = 16                        # scratch to allocate per launch: Triton's path
    assert direct_c(plain, (1, ), (lse, 3)) is None
    plain.run.global_scratch_size = 0
    plain.run.launch = lambda *a: None                        # a Python function is not a C launcher we know
    assert direct_c(plain, (1, ), (lse, 3)) is None
    monkeypatch.setattr(selfcheck, "_RESULT", {"plain": False, "tma": False})
    plain.run.launch = c_function
    assert direct_c(plain, (1, ), (lse, 3)) is None           # the self-check failed: Triton's path


def test_direct_launch_is_off_on_an_unknown_triton(monkeypatch):
    """A Triton newer than the newest we support keeps the public launch path and says so once."""
    from types import SimpleNamespace

    from fusedattn.backends import compat
    monkeypatch.setattr(compat, "TRITON_VERSION", (3, 10, 0))
    monkeypatch.setattr(compat, "SUPPORTED", False)
    monkeypatch.setattr(compat, "_warned", set())
    run = SimpleNamespace(launch=print, arg_annotations=(), kernel_signature=b"", global_scratch_size=0,
                          profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False)
    compiled = SimpleNamespace(run=run, function=1, packed_metadata=(), metadata=SimpleNamespace())
    with pytest.warns(RuntimeWarning, match="direct launch path is off"):
        assert compat.direct_launch(compiled, (), ()) is None
    assert compat.direct_launch(compiled, (), ()) is None      # once


def test_compat_version_parsing():
    from fusedattn.backends.compat import _version
    assert _version("3.9.0") == (3, 9, 0)
    assert _version("3.10.0+git1a2b3c") == (3, 10, 0)
    assert _version("3.6") == (3, 6, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: GPU test skipped")
@pytest.mark.parametrize("d", [64, 128])
def test_backward_compiled_ahead_is_the_one_launched(d, monkeypatch):
    """functional._compile_backward_ahead: the first forward under autograd starts the backward's compiles
    on the compile threads (launching nothing); the backward then waits for them, leaves nothing pending,
    and its gradients pass the reference rule."""
    from fusedattn import functional
    from fusedattn.backends.triton import launch as launch_mod
    started = []
    compile_only = launch_mod._compile_only
    monkeypatch.setattr(launch_mod, "_compile_only", lambda *a: (started.append(a[0]), compile_only(*a))[1])
    torch.manual_seed(11)
    # a geometry no other test uses, so this process compiles it here
    mk = lambda h, s: torch.randn(3, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2)  # noqa: E731
    q, k, v = mk(6, 211), mk(3, 389), mk(3, 389)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    before = len(functional._compiled_ahead)
    out = fusedattn.attention(*leaves, causal=True, causal_alignment="bottom_right")
    assert len(functional._compiled_ahead) == before + 1, "the first forward did not compile its backward ahead"
    assert started, "no backward kernel was compiled ahead"
    do = torch.randn_like(out)
    out.backward(do)
    assert not any(launch_mod._pending.values()), "a compile ahead was left pending after the backward"
    grads = tuple(t.grad for t in leaves)
    _check_against_reference(q, k, v, do, (out, *grads), torch.float16, f"compiled ahead d={d}", causal=True,
                             causal_alignment="bottom_right")


def test_compiling_ahead_compiles_on_threads_and_a_launch_waits_for_it(monkeypatch):
    """backends/triton/launch.compiling_ahead with a stand-in kernel (no GPU): launches inside the context
    return at once and compile on the compile threads; a later real launch of the same kernel waits for
    those compiles before it launches; a compile error is re-raised by wait() and left to the real launch."""
    import threading
    import time

    from fusedattn.backends import kernel_cache
    from fusedattn.backends.triton import launch as launch_mod
    monkeypatch.setattr(launch_mod, "interpreting", lambda: False)
    monkeypatch.setattr(launch_mod, "_current_device", lambda: 0)
    monkeypatch.setattr(launch_mod.compat, "ensure_context", lambda device: None)
    monkeypatch.setattr(launch_mod.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(kernel_cache, "_installed", True)
    monkeypatch.setattr(launch_mod.prebuilt, "find", lambda *args: None)   # no shipped store for a stand-in
    events, release = [], threading.Event()

    class StandIn:
        def warmup(self, *args, grid, **kwargs):
            release.wait(10)
            if args == ("bad", ):
                raise RuntimeError("compile error stand-in")
            events.append(("compiled", threading.current_thread().name, args, kwargs.get("enable_fp_fusion")))

        def __getitem__(self, grid):
            return lambda *args, **kwargs: events.append(("launched", args))

    kernel = StandIn()
    with launch_mod.compiling_ahead() as ahead:
        assert launch_mod.jit_launch(kernel, (1, ), 1, 2) is None
        with launch_mod.compiling_ahead():                   # nested: one list, the outer wait covers it
            assert launch_mod.jit_launch(kernel, (1, ), 3, 4) is None
    assert len(ahead.futures) == 2
    time.sleep(0.05)
    assert events == [], "a launch inside compiling_ahead ran or compiled on the calling thread"
    release.set()
    launch_mod.jit_launch(kernel, (1, ), 1, 2)              # waits for both compiles, then launches
    assert [e[0] for e in events] == ["compiled", "compiled", "launched"]
    assert all(e[1].startswith("fusedattn-compile") and e[3] is True for e in events[:2])
    assert not launch_mod._pending.get(kernel)
    with launch_mod.compiling_ahead() as bad:
        launch_mod.jit_launch(kernel, (1, ), "bad")
    with pytest.raises(RuntimeError, match="stand-in"):
        bad.wait()
    launch_mod.jit_launch(kernel, (1, ), "bad")             # the real launch does not inherit the error
    assert events[-1] == ("launched", ("bad", ))
