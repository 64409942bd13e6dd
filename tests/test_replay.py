"""Launch replays (``fusedattn.backends.replay``): a repeat eager call's recorded launches issued again with its
own tensors.

The CPU tests record a Launcher whose cache entry is set by hand and build replays from hand-made recordings (on
the CPU every launch goes through the interpreter's JIT, which records nothing), and check how arguments are
re-addressed and when a replay is refused; the GPU tests run the single-pass backward through autograd, where the
replay is made and taken."""
from types import SimpleNamespace

import pytest
import torch

import fusedattn
from fusedattn.backends import replay
from fusedattn.backends.gluon.launch import Tma
from fusedattn.backends.triton import launch

from conftest import HAS_CUDA


class _Launcher:
    direct_launches = 0


def _recorded(*launches, complete=True):
    """A finished recording as ``launch.recording`` leaves it: (launcher, go, device, grid, args) per launch."""
    return SimpleNamespace(complete=complete, launches=list(launches))


@pytest.fixture
def on_device_zero(monkeypatch):
    """The launch path's device checks on a CPU machine: device 0 current, raw stream 1234, a context nothing needs."""
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_raw_stream", lambda device: 1234)
    monkeypatch.setattr(replay.compat, "ensure_context", lambda device: None)


def test_recording_lists_cached_launches_and_marks_the_others(on_device_zero, monkeypatch):
    """``launch.recording`` lists each launch that took a Launcher's cached path, with the callable that made it, its
    device, grid (three entries) and arguments; a launch through the JIT (no cached kernel for its key yet), or a
    cached key on another current device, marks the recording incomplete; outside a recording nothing is listed."""
    monkeypatch.setattr(launch, "_no_launch_hooks", lambda: True)
    jitted = []
    monkeypatch.setattr(launch, "jit_launch", lambda kernel, grid, *a, **kw: jitted.append(grid))
    launcher = launch.Launcher(SimpleNamespace(params=[], arg_names=[]))
    went = []
    fast = lambda *x: went.append(x)  # noqa: E731
    launcher.cache["key"] = ("compiled", (), 0, fast, ())
    a = torch.randn(4)
    with launch.recording() as recorded:
        launcher("key", (2, 3), a, 7)
    assert recorded.complete and recorded.launches == [(launcher, fast, 0, (2, 3, 1), (a, 7))]
    assert went == [(2, 3, 1, 1234, (a, 7))] and launcher.direct_launches == 1
    with launch.recording() as recorded:
        launcher("new key", (1,), a)
    assert not recorded.complete and not recorded.launches and jitted == [(1,)]
    monkeypatch.setattr(launch, "_current_device", lambda: 1)
    with launch.recording() as recorded:
        launcher("key", (2, 3), a, 7)
    assert not recorded.complete and not recorded.launches
    assert launch._recording.active is None


def test_replay_passes_the_new_tensors_in_their_roles(on_device_zero):
    """Each tensor argument is the new call's tensor of the same role (matched by address when recorded, a view
    of a role included), a descriptor keeps its shape, strides, box and layout on the new base, scalars stay."""
    q, k, out = torch.randn(2, 8), torch.randn(4, 8), torch.randn(2, 8)
    scratch = torch.zeros(16)
    calls = []
    go = lambda *a: calls.append(a)  # noqa: E731
    desc = Tma(k.view(2, 2, 8), (2, 2, 8), (16, 8, 1), (1, 2, 8), "layout")
    launcher = _Launcher()
    recorded = _recorded((launcher, go, 0, (3, 2, 1), (q, desc, 7, 0.5, None, True, scratch.view(4, 4))),
                         (launcher, go, 0, (1, 1, 1), (out, scratch)))
    made_scratch = torch.zeros(16)
    built = replay.build(recorded, (q, k, out, scratch), lambda q, k: (torch.empty_like(q), made_scratch))
    assert built is not None
    q2, k2 = torch.randn(2, 8), torch.randn(4, 8)
    made = built(q2, k2)
    assert made[1] is made_scratch and made[0].shape == q2.shape
    assert len(calls) == 2 and launcher.direct_launches == 2 and built.calls == 1
    (gx, gy, gz, stream, args), (_, _, _, _, args2) = calls
    assert (gx, gy, gz, stream) == (3, 2, 1, 1234)
    assert args[0] is q2 and args[2:6] == (7, 0.5, None, True) and args[6] is made_scratch
    assert type(args[1]) is Tma and args[1].base is k2 and tuple(args[1])[1:] == tuple(desc)[1:]
    assert args2[0] is made[0] and args2[1] is made_scratch


def test_build_refuses_what_it_cannot_re_address():
    """No replay where it could not be exact: a launch through the JIT (not listed), nothing launched, two roles at
    one address, a tensor argument no role holds (a persistent buffer: it must not be swapped for new memory), a
    pointer-like argument of another kind, launches on two devices."""
    a, b, kept = torch.randn(8), torch.randn(8), torch.randn(8)
    go = lambda *x: None  # noqa: E731
    make = lambda *x: ()  # noqa: E731
    one = (_Launcher(), go, 0, (1, 1, 1), (a, b))
    assert replay.build(_recorded(one), (a, b), make) is not None
    assert replay.build(_recorded(one, complete=False), (a, b), make) is None
    assert replay.build(_recorded(), (a, b), make) is None
    assert replay.build(_recorded(one), (a, b, a[0:]), make) is None
    assert replay.build(_recorded((_Launcher(), go, 0, (1, 1, 1), (a, kept))), (a, b), make) is None
    assert replay.build(_recorded((_Launcher(), go, 0, (1, 1, 1), (a, SimpleNamespace(data_ptr=lambda: 16)))),
                        (a, b), make) is None
    assert replay.build(_recorded(one, (_Launcher(), go, 1, (1, 1, 1), (a,))), (a, b), make) is None


def test_replay_steps_aside_where_launches_must_take_the_ordinary_path(on_device_zero, monkeypatch):
    """Another current device, or compiles ahead on this thread: the replay makes and launches nothing (None), so
    the caller takes the ordinary path."""
    a = torch.randn(8)
    calls = []
    built = replay.build(_recorded((_Launcher(), lambda *x: calls.append(x), 0, (1, 1, 1), (a,))), (a,),
                         lambda a: ())
    with launch.compiling_ahead():
        assert built(torch.randn(8)) is None
    monkeypatch.setattr(launch, "_current_device", lambda: 1)
    assert built(torch.randn(8)) is None
    assert not calls and built.calls == 0
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    refusing = replay.build(_recorded((_Launcher(), lambda *x: calls.append(x), 0, (1, 1, 1), (a,))), (a,),
                            lambda a: None)      # make found the call unlike the recorded one
    assert refusing(torch.randn(8)) is None and not calls and refusing.calls == 0


def test_forward_is_not_recorded_inside_a_graph_capture(monkeypatch):
    """``functional._record_forward`` runs the forward but keeps no replay (not even a refusal) while a CUDA graph is
    being captured: a capture's first launch on a stream with no tile counter takes another grid, which a replay
    would keep for every later eager call. Outside a capture the key gets its entry (here None: the CPU path
    launches no kernel to replay). The CPU path stands in for the GPU's launches."""
    from fusedattn import functional
    from fusedattn.plan import plan
    from fusedattn.problem import make_problem
    q = torch.randn(1, 2, 16, 8)
    p, extras = make_problem(q, q, q)
    problem = (p, extras, plan(p, "cpu"))
    for capturing in (True, False):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        out = torch.full_like(q, float("nan"))
        functional._record_forward(("test key", capturing), problem, q, q, q, out, None)
        assert not torch.isnan(out).any(), "the forward did not run"
        assert (("test key", capturing) in functional._forward_replays) is not capturing


def test_forward_key_holds_what_the_launches_depend_on():
    """The forward replay's key (``functional._forward_key``) tells apart every shape, stride, dtype and scalar option
    of a plain call, and is None (no replay) for what it cannot stand for: a tensor not 16-byte aligned, a tensor
    option (hashed by identity, not value), an unhashable window; the eligible call's key is stable."""
    from fusedattn import functional
    q = torch.randn(2, 4, 64, 16)
    k = v = torch.randn(2, 2, 64, 16)
    args = dict(attn_scale=None, causal=True, causal_alignment="top_left", window=None, softcap=0.0,
                return_stats=False, validate=True, backend="auto")
    key = functional._forward_key(q, k, v, **args)
    assert key is not None and key == functional._forward_key(q.clone(), k.clone(), v.clone(), **args)
    others = [functional._forward_key(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, **args),
              functional._forward_key(q[:, :, :32], k, v, **args),
              functional._forward_key(q.half(), k.half(), v.half(), **args)]
    others += [functional._forward_key(q, k, v, **dict(args, **{name: value})) for name, value in
               (("attn_scale", 0.5), ("causal", False), ("causal_alignment", "bottom_right"), ("window", (8, 0)),
                ("softcap", 30.0), ("return_stats", True))]
    assert None not in others and len({key, *others}) == len(others) + 1
    flat = torch.randn(2 * 4 * 64 * 16 + 1)
    assert functional._forward_key(flat[1:].view(2, 4, 64, 16), k, v, **args) is None          # 4-byte aligned
    assert functional._forward_key(q, k, v, **dict(args, attn_scale=torch.tensor(0.5))) is None
    assert functional._forward_key(q, k, v, **dict(args, window=([1], 0))) is None
    assert functional._forward_key(q, k, v, **dict(args, causal=1)) is None
    # equal values of other types (True == 1 == 1.0) are other keys: validation may refuse one and take another
    ones = [functional._forward_key(q, k, v, **dict(args, attn_scale=one)) for one in (1, 1.0, True)]
    ones += [functional._forward_key(q, k, v, **dict(args, window=(one, 0))) for one in (1, True)]
    assert None not in ones and len(set(ones)) == len(ones)


def test_cache_forgets_when_full_and_on_clear_all():
    cache = replay.Cache(limit=2)
    cache.keep("a", None)
    cache.keep("b", None)
    cache.keep("c", None)
    assert list(cache) == ["c"]
    replay.clear_all()
    assert not cache


_HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _HOPPER, reason="the single-pass backward is Hopper-only (compute capability 9.x): "
                                        "GPU test skipped")
# (d, h, s, causal): problems of the single pass (at d=64 from plan.GLUON_BWD_FUSED_MIN_WORK's 2^25 scores on) and of
# the portable pair (smaller d=64 calls)
@pytest.mark.parametrize("d, h, s, causal", [(64, 4, 2112, False), (64, 8, 2112, True), (128, 4, 512, False),
                                             (64, 4, 300, True), (64, 2, 512, False)])
def test_repeat_backward_is_replayed_with_each_step_s_tensors(d, h, s, causal):
    """Training steps of one problem and layout, each with new tensors (new addresses, new values): from the third
    backward on, the route's launches are replayed; the replayed steps' gradients match the float64 reference, and a
    step whose q, k and v are one tensor (self-attention on x) is right too."""
    from fusedattn import functional
    from test_launch import _check_against_reference
    torch.manual_seed(11)
    mk = lambda: torch.randn(2, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731

    def step(q, k, v):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fusedattn.attention(qs, ks, vs, causal=causal, deterministic=False)
        do = torch.randn_like(out)
        out.backward(do)
        return do, (None, qs.grad, ks.grad, vs.grad)

    for i in range(4):
        q, k, v = mk(), mk(), mk()
        do, got = step(q, k, v)
        if i >= 2:
            _check_against_reference(q, k, v, do, got, torch.bfloat16, f"d={d} s={s} causal={causal} step {i}",
                                     causal=causal)
    # made on the first call whose launches were all cached (the second, or the first where an earlier test of
    # this worker launched the same kernels)
    replays = [r for r in functional._backward_replays.values() if r is not None]
    assert len(replays) == 1 and replays[0].calls >= 2, "steps 3 and 4 were not replayed"
    calls = replays[0].calls
    x = mk()
    do, got = step(x, x, x)
    _check_against_reference(x, x, x, do, got, torch.bfloat16, f"d={d} self-attention on one tensor", causal=causal)
    assert replays[0].calls == calls + 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU: GPU test skipped")
# (d, h_q, h_kv, s_q, s_kv, causal, return_stats, bshd): the Gluon forward's routes on Hopper (one-tile and
# persistent grids, GQA), a decode-sized call, the portable kernel's head dims
@pytest.mark.parametrize("d, h_q, h_kv, s_q, s_kv, causal, stats, bshd", [
    (64, 12, 12, 1024, 1024, False, False, True), (64, 8, 8, 1000, 1000, True, True, True),
    (128, 8, 2, 640, 1536, True, False, False), (128, 4, 4, 3, 777, False, True, True),
    (40, 4, 4, 200, 300, False, True, False)])
def test_repeat_forward_is_replayed_with_each_call_s_tensors(d, h_q, h_kv, s_q, s_kv, causal, stats, bshd):
    """Forwards of one problem and layout, each with new tensors: a call whose launches were all cached is recorded
    (``functional._forward_replays``) and later calls are replayed where the route allows one; every call's output
    (and stats) matches the float64 reference, without autograd and under it (which asks for the stats: its own
    key), and the replayed autograd calls' gradients are right; another layout of the same shapes is not served by
    the replay."""
    from fusedattn import functional
    from fusedattn.reference import attention_reference
    from fusedattn.testing import assert_error_within, assert_lse_close
    from test_launch import _check_against_reference
    torch.manual_seed(13)

    def mk(h, s, layout_bshd=bshd):
        if layout_bshd:
            return torch.randn(2, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2)
        return torch.randn(2, h, s, d, device="cuda", dtype=torch.float16)

    def check(q, k, v, out, st, msg):
        gold, gold_stats = attention_reference(*(t.detach().cpu() for t in (q, k, v)), causal=causal)
        base, _ = attention_reference(*(t.detach().cpu() for t in (q, k, v)), causal=causal, dtype=torch.float16)
        assert_error_within(out.detach().cpu(), gold, base, msg=f"out {msg}")
        if st is not None:
            assert_lse_close(st, gold_stats, msg=f"stats {msg}")

    def replay_of(q, k, v, with_stats):
        key = functional._forward_key(q, k, v, None, causal, "top_left", None, 0.0, with_stats, True, "auto")
        kept = functional._forward_replays.get(key)
        return None if kept is None else kept[0]

    shapes = ((h_q, s_q), (h_kv, s_kv), (h_kv, s_kv))
    for i in range(4):
        q, k, v = (mk(h, s) for h, s in shapes)
        got = fusedattn.attention(q, k, v, causal=causal, return_stats=stats)
        out, st = got if stats else (got, None)
        check(q, k, v, out, st, f"call {i}")
    replayed = replay_of(q, k, v, stats)
    if replayed is None:
        pytest.skip(f"this route gives no forward replay (a scratch buffer or a JIT launch): d {d}, h {h_q}/{h_kv}, "
                    f"{s_q}x{s_kv}: the outputs were checked, the replay not")
    assert replayed.calls >= 2, "calls 3 and 4 were not replayed"
    for i in range(4):
        # autograd: the forward asks for the stats; the context keeps the replay's problem for the backward
        q, k, v = (mk(h, s).requires_grad_() for h, s in shapes)
        out = fusedattn.attention(q, k, v, causal=causal)
        do = torch.randn_like(out)
        out.backward(do)
        if i >= 2:
            _check_against_reference(q, k, v, do, (out, q.grad, k.grad, v.grad), torch.float16,
                                     f"autograd call {i}", causal=causal)
    assert replay_of(q, k, v, True).calls >= 2, "autograd calls 3 and 4 were not replayed"
    calls = replayed.calls
    q, k, v = (mk(h, s, not bshd) for h, s in shapes)          # the other layout, same shapes
    got = fusedattn.attention(q, k, v, causal=causal, return_stats=stats)
    check(q, k, v, got[0] if stats else got, got[1] if stats else None, "another layout")
    assert replayed.calls == calls


@pytest.mark.gpu
@pytest.mark.skipif(not _HOPPER, reason="the single-pass backward is Hopper-only (compute capability 9.x): "
                                        "GPU test skipped")
def test_replay_key_tells_layouts_and_modes_apart():
    """Another layout (BHSD memory after BSHD) or deterministic=True (the two passes) of the same shapes never takes
    the first layout's replay: each is right against the reference, and the BSHD replay did not run for them."""
    from fusedattn import functional
    from test_launch import _check_against_reference
    torch.manual_seed(12)
    b, h, s, d = 2, 4, 512, 128
    bshd = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    bhsd = lambda: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731

    def step(make, **kw):
        q, k, v = make(), make(), make()
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fusedattn.attention(qs, ks, vs, **kw)
        do = torch.randn_like(out)
        out.backward(do)
        return q, k, v, do, (None, qs.grad, ks.grad, vs.grad)

    for _ in range(3):
        step(bshd, deterministic=False)
    replayed = [r for r in functional._backward_replays.values() if r is not None]
    assert len(replayed) == 1 and replayed[0].calls >= 1
    calls = replayed[0].calls
    for make, kw in ((bhsd, dict(deterministic=False)), (bshd, dict(deterministic=True))):
        q, k, v, do, got = step(make, **kw)
        _check_against_reference(q, k, v, do, got, torch.bfloat16, f"{kw} after the BSHD replay")
    assert replayed[0].calls == calls
