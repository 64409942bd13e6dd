"""Packed (ragged) calls (execute): when q, k, v and o (and dO, dQ, dK, dV in the backward) carry
``set_ragged_offset(r)``, the call runs :mod:`fusedattn.varlen` instead::

    r [b + 1] (elements) -> cu_seqlens = r / token stride   (the tensor's stride along s)
    graph dims [b, h, s, d] -> max_seqlen = s; each bound buffer is viewed as [total, h, d]
                               with the graph's token / head / dim strides (any bound shape)
    seq_len_q / seq_len_kv  -> checked equal to diff(cu_seqlens) (derived from it when absent)
    Stats [b, h, s, 1]      -> scattered to / gathered from the padded layout (-inf past a length, as
                               cuDNN 9.14+ writes for rows that see no key),

when the call has what varlen does not run (a bias, in the padded coordinates; K and V of different head
counts), it runs as the padded call it stands for (``_padded_invocation``: the packed tensors copied into
padded ones, the dense invocation, the outputs scattered back), and when only q and O (and Stats) are
packed, over padded or paged K/V (cuDNN's chunked prefill), the forward runs
:func:`fusedattn.attention_with_kvcache` with ``cu_seqlens_q`` (``_packed_q_invocation``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from .errors import GraphError, cudnnGraphNotSupportedError
from .invocation import _check_params, _options, _write_rng_dump
from .lower import Call, Req

# ---------------------------------------------------------------------------------------------
# packed (ragged) calls: fusedattn.varlen
# ---------------------------------------------------------------------------------------------

_Q_SIDE = ("q", "o", "dO", "dQ", "stats")   # packed by q's sequences
_KV_SIDE = ("k", "v", "dK", "dV")           # packed by k's


@dataclass
class _Packed:
    """A packed binding: ``[total, h, d]`` views of the bound buffers and the sequences."""

    views: Dict[str, torch.Tensor]   # role -> [total, h, d] view (stats: [total, h_q])
    cu_q: torch.Tensor               # int32 [b + 1] from 0, on the data's device
    cu_kv: torch.Tensor
    lens_q: List[int]
    lens_kv: List[int]
    max_q: int                       # the graph's s_q / s_kv: the padded problem it stands for
    max_kv: int


def _span(x: torch.Tensor) -> int:
    """Elements from ``x``'s first element to one past its last: what a view of it may reach."""
    if x.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))


def _token_offsets(call: Call, r: Req, off: torch.Tensor) -> List[int]:
    """The ragged offsets of ``r`` (elements) in tokens of its sequence stride, checked."""
    w, tok = call.where, r.stride[2]
    vals = [int(x) for x in off.reshape(-1).tolist()]   # one host read, as cuDNN's offsets are
    what = f"the ragged offset of {r.role} {r.label}"
    if any(x < 0 for x in vals) or any(a > b for a, b in zip(vals, vals[1:])):
        raise GraphError(f"{w}: {what} must be non-negative and non-decreasing (each sequence's first "
                         f"element, then the end), got {vals[:16]}")
    bad = [x for x in vals if x % tok]
    if bad:
        raise GraphError(f"{w}: {what} counts elements and must hold multiples of {r.role}'s token stride "
                         f"{tok} (its stride along the sequence dim): {bad[0]} is not, in {vals[:16]}")
    return [x // tok for x in vals]


def _ragged_bind(call: Call, t: Dict[str, torch.Tensor], feats) -> _Packed:
    """The packed views of a ragged call's buffers, from their offsets (host reads), checked
    against each other, the graph's dims, the seq_len tensors and the bound buffers' extents."""
    w = call.where
    reqs = {r.role: r for r in call.reqs}
    tokens = {role: _token_offsets(call, reqs[role], t[f"ragged_{role}"]) for role in call.ragged_roles}
    seqs = {}
    for side, lead in ((_Q_SIDE, "q"), (_KV_SIDE, "k")):
        # offsets may start anywhere in a buffer; the sequences are what must agree
        rel = [c - tokens[lead][0] for c in tokens[lead]]
        for role in side:
            if role in tokens and role != lead:
                mine = [c - tokens[role][0] for c in tokens[role]]
                if mine != rel:
                    raise GraphError(f"{w}: the ragged offsets of {role} and {lead} describe different "
                                     f"sequences (tokens from the first: {lead} {rel[:16]}, {role} {mine[:16]}); "
                                     f"{role} is packed like {lead}")
        seqs[lead] = rel
    if len(seqs["q"]) != len(seqs["k"]):
        raise GraphError(f"{w}: the ragged offsets of q and k hold {len(seqs['q'])} and {len(seqs['k'])} "
                         f"entries; both are [b + 1]")
    lens_q = [b - a for a, b in zip(seqs["q"], seqs["q"][1:])]
    lens_kv = [b - a for a, b in zip(seqs["k"], seqs["k"][1:])]
    max_q, max_kv = t.get("_max_seqlen") or (reqs["q"].shape[2], reqs["k"].shape[2])
    for lens, mx, lead, dim in ((lens_q, max_q, "q", "s_q"), (lens_kv, max_kv, "k", "s_kv")):
        i = max(range(len(lens)), key=lens.__getitem__)
        if lens[i] > mx:
            raise GraphError(f"{w}: sequence {i} has {lens[i]} tokens by the ragged offsets of {lead}, more "
                             f"than {lead}'s dims allow ({dim} = {mx}, the padded maximum)")
    if "padding" in feats:
        for name, lens, lead in (("seq_len_q", lens_q, "q"), ("seq_len_kv", lens_kv, "k")):
            if name not in t:
                continue
            given = [int(x) for x in t[name].reshape(-1).tolist()]
            for i, (g, n) in enumerate(zip(given, lens)):
                if g < 0 or g > n:
                    raise GraphError(f"{w}: {name}[{i}] = {g} but the ragged offsets of {lead} leave {n} tokens "
                                     f"for sequence {i}; with packed tensors seq_len must equal the difference "
                                     f"of consecutive offsets (in tokens)")
            for i, (g, n) in enumerate(zip(given, lens)):
                if g < n:
                    raise cudnnGraphNotSupportedError(
                        f"{w}: {name}[{i}] = {g} is shorter than the {n} tokens between the ragged offsets of "
                        f"{lead}: gaps between packed sequences are not supported by fusedattn; pack them back "
                        f"to back (offset[i + 1] = offset[i] + seq_len[i] * token stride)")
    views = {role: _packed_view(call, reqs[role], t[role], seqs["q"] if role in _Q_SIDE else seqs["k"],
                                tokens[role][0]) for role in call.ragged_roles}
    dev = t["q"].device
    return _Packed(views=views, cu_q=torch.tensor(seqs["q"], dtype=torch.int32, device=dev),
                   cu_kv=torch.tensor(seqs["k"], dtype=torch.int32, device=dev), lens_q=lens_q,
                   lens_kv=lens_kv, max_q=max_q, max_kv=max_kv)


def _packed_view(call: Call, r: Req, x: torch.Tensor, seq: List[int], first: int) -> torch.Tensor:
    """The ``[total, h, d]`` view (stats: ``[total, h]``) of a packed role's bound buffer, from its first
    token ``first`` through the graph's strides, checked to fit in the buffer."""
    total = seq[-1]
    _, h, _, dd = r.shape
    _, hs, tok, ds = r.stride
    start = first * tok
    need = start + (total - 1) * tok + (h - 1) * hs + (dd - 1) * ds + 1 if total else 0
    if need > _span(x):
        raise GraphError(f"{call.where}: {r.role} {r.label} is too small for its ragged offsets: {total} tokens from "
                         f"element {start} in strides {list(r.stride)} reach {need} elements, but the bound "
                         f"tensor (shape {list(x.shape)}, strides {list(x.stride())}) spans {_span(x)}")
    # the bound buffer may be [total, h, d], flat, or the declared [b, h, s, d]: only its
    # memory is used, through the graph's strides
    v = x.as_strided((total, h, dd), (tok, hs, ds), x.storage_offset() + start)
    return v[..., 0] if r.role == "stats" else v


def _padded_index(lens: List[int], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of each packed token: its place in the padded [b, h, s] layout."""
    n = torch.tensor(lens, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(lens)), n)
    starts = torch.cumsum(n, 0) - n
    return seq.to(device), (torch.arange(int(n.sum())) - starts[seq]).to(device)


def _varlen_backward(q, k, v, out, grad_out, stats, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                     *, attn_scale=None, causal=False, causal_alignment="top_left", window=None, alibi=False,
                     dropout_p=0.0, dropout_seed=0, dropout_offset=0, backend="auto"):
    """Gradients ``(dq, dk, dv)`` of :func:`fusedattn.attention_varlen` from its output and stats
    fp32 ``[h_q, total_q]``: the sdpa_backward node gives those explicitly (no autograd graph)."""
    from ..plan import plan
    from ..varlen import make_varlen_problem, varlen_backward
    p, extras, *_ = make_varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, validate=False,
        attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment, window=window, alibi=alibi,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    return varlen_backward(p, extras, plan(p, backend), q, k, v, out, grad_out, stats)


def _ragged_invocation(call: Call, t: Dict[str, torch.Tensor], feats):
    """``build_invocation`` of a packed call: :func:`fusedattn.attention_varlen` (forward) or
    :func:`_varlen_backward` on views of the bound buffers; ``post`` writes the results in place."""
    from .. import varlen
    if call.packed_q_only:
        return _packed_q_invocation(call, t, feats)
    if "bias" in feats or call.kv_counts is not None:
        return _padded_invocation(call, t, feats)
    if "sink" in feats:
        raise cudnnGraphNotSupportedError("sink_token with ragged (packed) tensors is not supported yet; use padded "
                                "tensors with use_padding_mask")
    pk = _ragged_bind(call, t, feats)
    views = pk.views
    kw = _options(call, t, feats)
    # the packed forward always returns stats; the backward is deterministic whatever is asked
    kw.pop("return_stats", None)
    kw.pop("deterministic", None)
    kw["backend"] = t.get("_backend", "auto")
    if call.kind == "fwd":
        fn = varlen.attention_varlen
        args = (views["q"], views["k"], views["v"], pk.cu_q, pk.cu_kv, pk.max_q, pk.max_kv)
        kw.update(return_stats=True, validate=False)
    else:
        fn = _varlen_backward
        if "stats" in views:
            lse = views["stats"]
        else:
            seq, pos = _padded_index(pk.lens_q, t["stats"].device)
            lse = t["stats"][..., 0][seq, :, pos]            # [total_q, h_q]
        args = (views["q"], views["k"], views["v"], views["o"], views["dO"],
                lse.t().to(torch.float32).contiguous(), pk.cu_q, pk.cu_kv, pk.max_q, pk.max_kv)
    _check_params(fn, kw)

    def post(result):
        if call.kind == "fwd":
            _write_forward(result, views, t, feats, pk.lens_q)
        else:
            for role, g in zip(("dQ", "dK", "dV"), result):
                if role in views:
                    views[role].copy_(g)
        if "rng_dump" in feats:
            _write_rng_dump(t, kw)

    return fn, args, kw, post



# ---------------------------------------------------------------------------------------------
# packed calls the packed path cannot run: the padded call they stand for
# ---------------------------------------------------------------------------------------------

def _padded_invocation(call: Call, t: Dict[str, torch.Tensor], feats):
    """A packed call with what :mod:`fusedattn.varlen` does not run (a bias ``[b|1, h|1, s_q, s_kv]``, which
    is in the padded coordinates; K and V of different head counts) run as the padded call it stands for.

    The packed inputs (q, k, v; o, dO and packed Stats in the backward) are copied into zero-padded
    ``[b, h, s_max, d]`` tensors (``s_max`` the graph's s_q / s_kv) at the places the offsets give, the
    lengths (from the offsets, :func:`_ragged_bind`) become seq_len_q / seq_len_kv, the dense invocation
    (:func:`.execute.build_invocation`: widened heads, dBias, rng_dump and all) runs on them, and ``post``
    scatters O and Stats (forward) or dQ, dK, dV (backward) back through the packed views. The dropout
    mask is the same either way: the packed path keys it by the padded problem too.

    Cost: one padded copy of each packed input and output per call (``b * h * s_max * d`` elements each),
    on the device; the offsets are read on the host, as for every packed call."""
    from .execute import build_invocation
    pk = _ragged_bind(call, t, feats)
    views, b = pk.views, len(pk.lens_q)
    dev = t["q"].device
    index = {"q": _padded_index(pk.lens_q, dev), "k": _padded_index(pk.lens_kv, dev)}

    def where(role):
        """(sequence, position) of each packed token of ``role`` and the padded length."""
        return (index["q"], pk.max_q) if role in _Q_SIDE else (index["k"], pk.max_kv)

    def padded(role, fill=0.0):
        (seq, pos), s = where(role)
        x = views[role]
        if role == "stats":                                  # [total, h] -> fp32 [b, h, s_q, 1]
            out = torch.full((b, x.shape[1], s, 1), fill, dtype=torch.float32, device=dev)
            out[seq, :, pos, 0] = x.to(torch.float32)
        else:                                                # [total, h, d] -> [b, h, s, d]
            out = torch.full((b, x.shape[1], s, x.shape[2]), fill, dtype=x.dtype, device=dev)
            out[seq, :, pos] = x
        return out

    td = {key: x for key, x in t.items() if key != "_max_seqlen"}
    for role in ("q", "k", "v") + (("o", "dO") if call.kind == "bwd" else ()):
        td[role] = padded(role)
    lens = {"seq_len_q": pk.lens_q, "seq_len_kv": pk.lens_kv}
    for role, n in lens.items():
        td[role] = torch.tensor(n, dtype=torch.int32, device=dev)
    if call.kind == "fwd":
        h_q, d_v = td["q"].shape[1], td["v"].shape[3]
        td["o"] = torch.empty((b, h_q, pk.max_q, d_v), dtype=td["q"].dtype, device=dev)
        if "stats" in feats:
            td["stats"] = torch.empty((b, h_q, pk.max_q, 1), dtype=torch.float32, device=dev)
    else:
        if "stats" in views:
            # rows past a length see no key: their stats are never read (0 keeps them finite)
            td["stats"] = padded("stats")
        for role, src in (("dQ", "q"), ("dK", "k"), ("dV", "v")):
            td[role] = torch.empty_like(td[src])
    fn, args, kw, dense_post = build_invocation(call, td, (set(feats) - {"ragged"}) | {"padding"})

    def post(result):
        dense_post(result)
        if call.kind == "fwd":
            seq, pos = index["q"]
            lse = td["stats"][seq, :, pos, 0].t() if "stats" in feats else None
            _write_forward((td["o"][seq, :, pos], lse), views, t, feats, pk.lens_q)
        else:
            for role in ("dQ", "dK", "dV"):
                if role in views:
                    (seq, pos), _ = where(role)
                    views[role].copy_(td[role][seq, :, pos])

    return fn, args, kw, post



# ---------------------------------------------------------------------------------------------
# packed queries over padded or paged K/V (chunked prefill): fusedattn.attention_with_kvcache
# ---------------------------------------------------------------------------------------------

def _packed_q_invocation(call: Call, t: Dict[str, torch.Tensor], feats):
    """Q and O packed (THD, ragged offsets), K/V padded ``[b, h_kv, s_kv, d]`` or paged, as cuDNN's
    test_sdpa_chunked_prefill.py builds them: :func:`fusedattn.attention_with_kvcache` with
    ``cu_seqlens_q``. Sequence ``i`` has the tokens between q's offsets and ``seq_len_kv[i]`` keys (the
    whole K/V, or ``paged_attention_max_seq_len_kv``, without a padding mask). That door's masks are
    bottom-right per sequence: a top-left band runs as the same band shifted by ``off = seq_len_kv[i] -
    seq_len_q[i]`` (read on the host) when every sequence has the same ``off`` and the shifted bounds stay
    >= 0 (cuDNN's chunked prefill: right bound = off, the bottom-right causal mask); else not supported."""
    from ..kvcache import attention_with_kvcache
    w = call.where
    reqs = {r.role: r for r in call.reqs}
    tokens = {role: _token_offsets(call, reqs[role], t[f"ragged_{role}"]) for role in call.ragged_roles}
    seq = [c - tokens["q"][0] for c in tokens["q"]]
    for role in call.ragged_roles:
        mine = [c - tokens[role][0] for c in tokens[role]]
        if mine != seq:
            raise GraphError(f"{w}: the ragged offsets of {role} and q describe different sequences (tokens from "
                             f"the first: q {seq[:16]}, {role} {mine[:16]}); {role} is packed like q")
    lens_q = [e - a for a, e in zip(seq, seq[1:])]
    b = len(lens_q)
    max_q = (t.get("_max_seqlen") or (reqs["q"].shape[2],))[0]
    if lens_q and max(lens_q) > max_q:
        raise GraphError(f"{w}: a sequence has {max(lens_q)} tokens by the ragged offsets of q, more than q's dims "
                         f"allow (s_q = {max_q})")
    views = {role: _packed_view(call, reqs[role], t[role], seq, tokens[role][0]) for role in call.ragged_roles}
    kw = _options(call, t, feats)
    kw.pop("deterministic", None)
    kw["return_stats"] = True
    k, v, table, layout = t["k"], t["v"], None, "bhsd"
    if "paged" in feats:
        table = t["page_table_k"]
        if not torch.equal(table, t["page_table_v"]):
            raise cudnnGraphNotSupportedError(f"{w}: different page tables for K and V with packed q: fusedattn's "
                                              f"K/V-cache path pages K and V through one table")
        table = table.reshape(table.shape[0], -1)
        layout = "bshd" if call.kv_layout == "paged_nshd" else "bhsd"
    lens_kv = None
    if "padding" in feats and "seq_len_q" in t:
        given = [int(x) for x in t["seq_len_q"].reshape(-1).tolist()]
        if given != lens_q:
            raise GraphError(f"{w}: seq_len_q = {given[:16]} but the ragged offsets of q give {lens_q[:16]}; with "
                             f"packed q they must agree")
    if "padding" in feats and "seq_len_kv" in t:
        lens_kv = t["seq_len_kv"].reshape(-1)
    elif call.max_seq_len_kv is not None:
        lens_kv = torch.full((b,), call.max_seq_len_kv, dtype=torch.int32, device=k.device)
    # the support probe's tiny lengths say nothing of the real offsets: it checks the features, with off 0
    _bottom_right(call, kw, lens_q, lens_kv, k, table, layout, probing="_max_seqlen" in t)
    kw["backend"] = t.get("_backend", "auto")
    cu_q = torch.tensor(seq, dtype=torch.int32, device=t["q"].device)
    args = (views["q"], k, v)
    kw.update(page_table=table, seq_len_kv=lens_kv, cu_seqlens_q=cu_q, max_seqlen_q=max_q, cache_layout=layout,
              validate=False)
    if "sink" in feats:
        kw["sink"] = t["sink_token"].reshape(-1)
    _check_params(attention_with_kvcache, kw)

    def post(result):
        _write_forward(result, views, t, feats, lens_q)

    return attention_with_kvcache, args, kw, post


def _write_forward(result, views: dict, t: dict, feats, lens_q) -> None:
    """Write a packed forward's (out, lse) into the graph's tensors: O through its packed view (a virtual O
    nobody reads may be unpacked: not written), Stats packed, or padded [b, h, s, 1] with -inf on the rows
    past each sequence's length, which see no key (cuDNN 9.14+)."""
    out, lse = result
    if "o" in views:
        views["o"].copy_(out)
    if "stats" in feats and "stats" in t:
        if "stats" in views:
            views["stats"].copy_(lse.t())
        else:
            target = t["stats"][..., 0]
            target.fill_(float("-inf"))
            if lse.numel():
                seq, pos = _padded_index(lens_q, target.device)
                target[seq, :, pos] = lse.t()


def _bottom_right(call: Call, kw, lens_q: List[int], lens_kv, k, table, layout, probing=False) -> None:
    """The band of ``kw`` as attention_with_kvcache's bottom-right (causal / window) arguments, in place
    (``probing``: the support probe's call, whose made-up lengths are not the graph's: no shift)."""
    align = kw.pop("causal_alignment", "top_left")
    causal, window = kw.pop("causal", False), kw.pop("window", None)
    if not causal and window is None:
        kw["causal"] = False                     # the K/V-cache door's default is causal
        return
    left, right = (None, 0) if causal else tuple(None if x == -1 else x for x in window)
    if causal and window is not None:
        left = None if window[0] == -1 else window[0]
    if align == "top_left":
        if lens_kv is None:
            cap = k.shape[2] if layout == "bhsd" else k.shape[1]
            n_kv = [cap * (table.shape[1] if table is not None else 1)] * len(lens_q)
        else:
            n_kv = [int(x) for x in lens_kv.tolist()]
        offs = {n - m for n, m in zip(n_kv, lens_q) if m > 0} if not probing else set()
        off = offs.pop() if len(offs) == 1 else 0
        shifted = (None if left is None else left + off, None if right is None else right - off)
        if len(offs) or any(x is not None and x < 0 for x in shifted):
            raise cudnnGraphNotSupportedError(
                f"{call.where}: a top-left diagonal band with packed q over padded or paged K/V runs as a "
                f"bottom-right one shifted by seq_len_kv - seq_len_q, which must then be the same for every "
                f"sequence and keep the bounds >= 0 (here bounds {(left, right)}, offsets {sorted(offs | {off})})")
        left, right = shifted
    kw["causal"] = right == 0 and left is None
    if not kw["causal"]:
        kw["window"] = (-1 if left is None else left, -1 if right is None else right)
