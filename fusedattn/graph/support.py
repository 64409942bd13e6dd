"""The support probe (check_support): run a lowered call once on tiny inputs with the same head counts,
head dims, dtypes, features and backend, and name the graph argument(s) fusedattn cannot run."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .checks import head_dims_unsupported
from .errors import GraphError, cudnnGraphNotSupportedError
from .execute import build_invocation
from .invocation import _functional
from .lower import FEATURE_ARGS, Call
from .ragged import _Q_SIDE

# A feature that cannot be probed without another one.
_FEATURE_DEPS = {"rng_dump": ("dropout",), "dbias": ("bias",)}

# ---------------------------------------------------------------------------------------------
# the support probe (check_support)
# ---------------------------------------------------------------------------------------------

_PROBE_CACHE: Dict[tuple, Optional[str]] = {}   # static key -> None (runs) or why it does not


def _tiny_tensors(call: Call, device: torch.device, backend: str) -> Dict[str, torch.Tensor]:
    """Role -> small tensors with the call's head counts, head dims, dtypes and broadcast pattern."""
    b, h_q, h_kv, s_q, s_kv, d, d_v = call.dims["_sizes"]
    sq = min(s_q, 3)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(shape, dt):
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        return x.to(device=device, dtype=dt)

    dts = call.dts
    qdt = dts["q"]
    # K and V with different head counts (call.kv_counts) keep them here: execute widens both to h_kv
    h_k, h_v = call.kv_counts or (h_kv, h_kv)
    t = {"_backend": backend, "q": rnd((1, h_q, sq, d), qdt)}
    if call.kv_layout == "dense":
        skv = min(s_kv, 5)
        t["k"] = rnd((1, h_k, skv, d), qdt)
        t["v"] = rnd((1, h_v, skv, d_v), qdt)
    else:
        kdims = call.dims["k"]
        bs = kdims[1] if call.kv_layout == "paged_nshd" else kdims[2]
        # one page in the container, one table entry (all zero); packed tables are unpacked to the graph's
        # page count (execute's _unpack_page_tables), so their tiny tables hold that many entries, and the
        # tiny problem has the keys the tables cover, the graph's s_kv at most
        pages = {role: call.dims[role][2] if call.packed_tables else 1 for role in ("page_table_k", "page_table_v")}
        skv = min(s_kv, bs * min(pages.values()))
        if call.kv_layout == "paged_nshd":
            t["k"] = rnd((1, bs, h_k, d), qdt)
            t["v"] = rnd((1, bs, h_v, d_v), qdt)
            tshapes = {role: (1, 1) for role in pages}
        else:
            t["k"] = rnd((1, h_k, bs, d), qdt)
            t["v"] = rnd((1, h_v, bs, d_v), qdt)
            tshapes = {role: (1, 1, n, 1) for role, n in pages.items()}
        for role, shape in tshapes.items():
            t[role] = torch.zeros(shape, dtype=dts[role], device=device)
        for role in call.packed_tables:
            # one sequence, its entries from the table's start
            off = call.dims[f"ragged_{role}"]
            t[f"ragged_{role}"] = torch.zeros((2,) + (1,) * (len(off) - 1), dtype=dts[f"ragged_{role}"],
                                              device=device)
        t["k_dense"] = rnd((1, h_k, skv, d), qdt)
        t["v_dense"] = rnd((1, h_v, skv, d_v), qdt)
    full = (1, h_q, sq, skv)
    if "bias" in dts:
        shape = tuple(1 if x == 1 else f for x, f in zip(call.dims["bias"], full))
        t["bias"] = (torch.rand(shape, generator=gen) > 0.3).to(device) if dts["bias"] == torch.bool \
            else rnd(shape, dts["bias"])
    for role, n in (("seq_len_q", sq), ("seq_len_kv", skv)):
        if role in dts:
            shape = (1,) if len(call.dims[role]) == 1 else (1, 1, 1, 1)
            t[role] = torch.full(shape, n, dtype=dts[role], device=device)
    if "attn_scale" in dts:
        t["attn_scale"] = torch.ones(call.dims["attn_scale"], dtype=dts["attn_scale"])
    for role in ("dropout_seed", "dropout_offset"):
        if role in dts:
            t[role] = torch.zeros(call.dims[role], dtype=dts[role])
    if "rng_dump" in dts:
        t["rng_dump"] = torch.zeros(full, dtype=dts["rng_dump"], device=device)
    for role in ("sink_token", "dSink_token"):
        if role in dts:
            t[role] = rnd(call.dims[role], dts[role])
    if call.kind == "fwd":
        t["o"] = torch.empty((1, h_q, sq, d_v), dtype=qdt, device=device)
        t["stats"] = torch.empty((1, h_q, sq, 1), dtype=torch.float32, device=device)
    else:
        t["k_dense"], t["v_dense"] = t["k"], t["v"]
        t["o"] = rnd((1, h_q, sq, d_v), qdt)
        t["dO"] = rnd((1, h_q, sq, d_v), qdt)
        t["stats"] = torch.zeros((1, h_q, sq, 1), dtype=torch.float32, device=device)
        t["dQ"], t["dK"], t["dV"] = torch.empty_like(t["q"]), torch.empty_like(t["k"]), torch.empty_like(t["v"])
        if "dBias" in dts:
            shape = tuple(1 if x == 1 else f for x, f in zip(call.dims["dBias"], full))
            t["dBias"] = torch.empty(shape, dtype=dts["dBias"], device=device)
    if call.ragged_roles:
        t["_ragged"] = _tiny_packed(call, t, sq, skv, gen, device)
    return t


def _tiny_packed(call: Call, t, sq: int, skv: int, gen, device) -> Dict[str, torch.Tensor]:
    """``t`` with each packed role bound as execute binds it, at probe size: a flat buffer holding
    one sequence (``sq`` or ``skv`` tokens) in the call's strides, and its offsets ``[0, end]``."""
    rt = dict(t)
    reqs = {r.role: r for r in call.reqs}
    for role in call.ragged_roles:
        r, off = reqs[role], reqs[f"ragged_{role}"]
        n = sq if role in _Q_SIDE else skv
        _, h, _, dd = r.shape
        _, hs, tok, ds = r.stride
        size = (n - 1) * tok + (h - 1) * hs + (dd - 1) * ds + 1
        buf = torch.zeros(size) if role == "stats" else torch.randn(size, generator=gen)
        rt[role] = buf.to(device=device, dtype=r.dtype)
        rt[f"ragged_{role}"] = torch.tensor([0, n * tok], dtype=off.dtype, device=device).reshape(
            (2,) + (1,) * (len(off.shape) - 1))
    rt["_max_seqlen"] = (sq, skv)
    return rt


def _try(call: Call, t, feats) -> Optional[BaseException]:
    """Run the call on tiny inputs with only ``feats``; the NotSupported error, or None."""
    try:
        fn, args, kw, post = build_invocation(call, t, feats)
        with torch.no_grad():
            post(fn(*args, **kw))
    except NotImplementedError as e:   # NotSupportedError included
        return e
    return None


def _explain(call: Call, t, err: BaseException) -> str:
    """Name the graph arguments behind a not-supported error: try the plain attention, then each
    feature alone (with what it needs); the ones that fail alone are the culprits."""
    base = _try(call, t, ())
    if base is not None:
        return f"this attention (dtype / head dims / backend) is not supported: {base}"
    culprits = [f for f in call.features
                if _try(call, t, {f, *_FEATURE_DEPS.get(f, ())}) is not None]
    if culprits:
        names = "; ".join(FEATURE_ARGS[f] for f in culprits)
        return f"{names}: not supported by fusedattn yet ({err})"
    names = "; ".join(FEATURE_ARGS[f] for f in call.features)
    return f"this combination of {names} is not supported by fusedattn yet ({err})"


def _known_limits(call: Call, device: torch.device) -> Optional[str]:
    """What fusedattn cannot run in a valid graph, known without running it: head dims past
    ``MAX_HEAD_DIM_TORCH`` or not multiples of 8, and DOUBLE off the CPU (the CPU path has it for
    gradcheck). The functional layer raises InvalidArgument for these, which here is not bad input."""
    *_, d, d_v = call.dims["_sizes"]
    why = head_dims_unsupported(d, d_v)
    if why is None and call.dts["q"] == torch.float64 and device.type != "cpu":
        why = f"DOUBLE (float64) attention runs on the CPU only in fusedattn; the graph's tensors are on {device}"
    return why


def probe(call: Call, device: torch.device, backend: str) -> None:
    """Raise ``cudnnGraphNotSupportedError`` naming the graph argument(s) the functional layer
    cannot run, by running the call once on tiny inputs (``b = 1``, ``s <= 5``) with the same
    head counts, head dims, dtypes, features and backend. Cached on the call's static key, so a
    second graph of the same problem probes nothing."""
    if call.kind.startswith("fp8_"):
        # the FP8 ops run fusedattn.fp8's torch emulation, on every device, for every graph validate()
        # accepted (head dims were checked there): nothing to probe until FP8 kernels exist
        return
    key = (call.probe_key, device.type, backend)
    if key in _PROBE_CACHE:
        why = _PROBE_CACHE[key]
        if why is not None:
            raise cudnnGraphNotSupportedError(f"{call.where}: {why}")
        return
    try:
        _functional()
    except ImportError as e:
        raise cudnnGraphNotSupportedError(
            f"{call.where}: fusedattn.functional is not importable ({e}); the Graph door runs through it") from e
    why = _known_limits(call, device)
    if why is not None:
        # the functional layer would call these invalid arguments; for a valid graph they are limits
        _PROBE_CACHE[key] = why
        raise cudnnGraphNotSupportedError(f"{call.where}: {why}")
    try:
        t = _tiny_tensors(call, device, backend)
        err = _try(call, t, call.features)
        why = None if err is None else _explain(call, t, err)
    except (ValueError, TypeError) as e:
        # Invalid for the functional layer (a dtype, a head dim): bad input, not "unsupported".
        raise GraphError(f"{call.where}: fusedattn rejects this graph: {e}") from e
    _PROBE_CACHE[key] = why
    if why is not None:
        raise cudnnGraphNotSupportedError(f"{call.where}: {why}")
