"""Running a lowered call (execute): role -> torch tensor in, one call of
:func:`fusedattn.functional.attention_forward` / ``attention_backward`` (or of :mod:`fusedattn.varlen`
for a packed call, :mod:`.ragged`), the functional layer's errors translated to the Graph door's."""
from __future__ import annotations

from typing import Dict

import torch

from ..problem import NotSupportedError
from .errors import GraphError, cudnnGraphNotSupportedError
from .invocation import _check_params, _functional, _options, _write_rng_dump
from .lower import Call
from .ragged import _ragged_invocation

# ---------------------------------------------------------------------------------------------
# running a call
# ---------------------------------------------------------------------------------------------

def build_invocation(call: Call, t: Dict[str, torch.Tensor], feats=None):
    """``(function, args, kwargs, post)`` for the functional layer from role -> torch tensor.

    ``feats`` restricts the features (the support probe uses it); ``None`` = all of the call's.
    ``post`` is run after the function with its result (rng_dump, dBias copies).
    """
    if call.kind.startswith("fp8_"):        # sdpa_fp8 / sdpa_fp8_backward: fusedattn.fp8's emulation
        from .fp8_nodes import fp8_invocation
        return fp8_invocation(call, t)
    feats = set(call.features if feats is None else feats)
    if "ragged" in feats:
        # the probe keeps a packed binding apart from its dense tiny tensors
        t = t.get("_ragged", t)
    if call.packed_tables and "paged" in feats:
        t = _unpack_page_tables(call, t)
    if "ragged" in feats:
        return _ragged_invocation(call, t, feats)
    fn_mod = _functional()
    kw = _options(call, t, feats)
    if "padding" in feats:
        for role in ("seq_len_q", "seq_len_kv"):
            if role in t:
                kw[role] = t[role]
    if "bias" in feats:
        kw["attn_bias"] = t["bias"]
    if "sink" in feats:
        kw["sink"] = t["sink_token"].reshape(-1)       # cuDNN's [1, h_q, 1, 1] as fusedattn's [h_q]
    k, v = t["k"], t["v"]
    if "paged" in feats:
        pk, pv = t["page_table_k"], t["page_table_v"]
        if call.kv_layout == "paged_nshd":
            # The seeds' containers [num_pages, page_size, h, d] seen as [num_pages, h, page_size, d]
            # (a view), and page tables [b, n] as [b, 1, n, 1] (a view).
            k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
            pk, pv = pk[:, None, :, None], pv[:, None, :, None]
        cap = min(pk.shape[2] * k.shape[2], pv.shape[2] * v.shape[2])
        if "dropout" in feats:
            # The dropout mask (and rng_dump) is keyed by the logical key position in the graph's
            # [b, h, s_q, s_kv] problem, as for dense K/V; a paged problem spans the tables' capacity, a
            # different s_kv, which would key the mask differently. So the pages are gathered into dense
            # K/V of the graph's s_kv keys and the dense path runs: one copy of each sequence's K and V
            # (b * h_kv * s_kv * d elements each) per call, on the device, no host read.
            s_kv = min(call.dims["_sizes"][4], cap)
            k, v = _gather_paged(k, pk, s_kv), _gather_paged(v, pv, s_kv)
        else:
            kw["page_table_k"], kw["page_table_v"] = pk, pv
            if "attn_bias" in kw:
                kw["attn_bias"] = _bias_over_pages(kw["attn_bias"], cap)
            if call.max_seq_len_kv is not None and "seq_len_kv" not in kw:
                if call.max_seq_len_kv < cap:
                    # cuDNN's max_seq_len_kv bounds every sequence; a constant length says the same.
                    b = t["q"].shape[0]
                    kw["seq_len_kv"] = torch.full((b,), call.max_seq_len_kv, dtype=torch.int32, device=k.device)
    elif call.kv_layout != "dense":
        # probe without paging: the tiny inputs carry dense k/v under these roles
        k, v = t["k_dense"], t["v_dense"]
    widened = {}        # "k" / "v" -> the graph's head count, for each tensor run with h_kv heads
    if call.kv_counts is not None:
        h_kv = call.dims["_sizes"][2]
        widened = {role: h for role, h in zip("kv", call.kv_counts) if h != h_kv}
        k, v = _widen_heads(k, h_kv), _widen_heads(v, h_kv)
    backend = t.get("_backend", "auto")
    if call.kind == "fwd":
        fn = fn_mod.attention_forward
        args = (t["q"], k, v)
        kw["out"] = t["o"]
        if "stats" in feats:
            kw["stats_out"] = t["stats"]
    else:
        fn = fn_mod.attention_backward
        args = (t["q"], k, v, t["o"], t["dO"], t["stats"])
        kw["dq"], kw["dk"], kw["dv"] = t["dQ"], t["dK"], t["dV"]
        for role, x in (("k", k), ("v", v)):
            if role in widened:
                # one gradient per widened head (several heads writing one graph head would race):
                # summed back into the graph's dK / dV by post
                kw["d" + role] = fn_mod._like_layout(t["dQ"], x.shape, x.dtype)
    kw["backend"] = backend
    # cuDNN reads seq_len_q / seq_len_kv at execute without checking their values (no host sync, and a
    # graph may be replayed inside a CUDA graph): the functional door's per-call value check is off here
    kw["validate"] = False
    _check_params(fn, kw)

    def post(result):
        if "rng_dump" in feats:
            _write_rng_dump(t, kw)
        if call.kind == "bwd":
            for role, h in widened.items():
                t["d" + role.upper()].copy_(_fold_heads(kw["d" + role], h))
        if call.kind == "bwd" and "dbias" in feats:
            dbias = result[3]
            if dbias is None:
                raise NotSupportedError("attention_backward returned no dbias for need_dbias=True")
            target = t["dBias"]
            if tuple(dbias.shape) != tuple(target.shape):
                dbias = dbias.sum_to_size(target.shape)   # reduce over the dims the bias broadcasts
            target.copy_(dbias)
        if call.kind == "bwd" and "sink" in feats and "dSink_token" in t:
            t["dSink_token"].copy_(result[4].view(t["dSink_token"].shape))

    return fn, args, kw, post



def _unpack_page_tables(call: Call, t: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``t`` with each packed page table (cuDNN's ragged page tables: test_mhas.py's
    ``convert_uniform_to_ragged_page_tables``) replaced by the padded ``[b, 1, max_pages, 1]`` table the
    paged path reads: entry ``j`` of sequence ``i`` is element ``offset[i] + j * stride`` of the bound
    buffer (``stride`` the graph's stride along the pages dim, ``offset`` in elements as for q/k/v).

    A gather on the tables' device, no host read (cuDNN reads these offsets on the device, and a graph
    may be replayed in a CUDA graph): indices past the buffer are clamped into it. Entries past a
    sequence's own pages then read its neighbour's (or the clamped last) entry; they hold keys past
    ``seq_len_kv`` / ``paged_attention_max_seq_len_kv``, which are never attended. The copy is
    ``b * max_pages`` indices per table, per call."""
    t = dict(t)
    reqs = {r.role: r for r in call.reqs}
    for role in call.packed_tables:
        r, x, off = reqs[role], t[role], t[f"ragged_{role}"].reshape(-1)
        # b from the offsets: the support probe binds one sequence (the graph's pages, all zero)
        b, n = off.numel() - 1, r.shape[2]
        span = 1 + sum((m - 1) * st for m, st in zip(x.shape, x.stride())) if x.numel() else 0
        if span == 0:
            raise GraphError(f"{call.where}: {role} {r.label} is empty but carries ragged offsets")
        flat = x.as_strided((span,), (1,), x.storage_offset())
        first = off[:b].to(device=x.device, dtype=torch.long)
        idx = first[:, None] + torch.arange(n, device=x.device, dtype=torch.long)[None, :] * r.stride[2]
        t[role] = flat[idx.clamp_(0, span - 1)].view(b, 1, n, 1)
    return t


def _gather_paged(container: torch.Tensor, table: torch.Tensor, s_kv: int) -> torch.Tensor:
    """Dense ``[b, h, s_kv, d]`` K or V from a paged container ``[num_pages, h, page_size, d]`` and its
    ``[b, 1, pages, 1]`` table: the first ``s_kv`` keys of each sequence (entries clamped into the
    container, as the kernels do)."""
    from ..backends.cpu import gather_pages
    return gather_pages(container, table.reshape(table.shape[0], -1))[:, :, :s_kv]


def _bias_over_pages(bias: torch.Tensor, cap: int) -> torch.Tensor:
    """A paged graph's bias [.., s_kv] widened to the page tables' capacity ``cap`` keys.

    cuDNN sizes the bias by the graph's kv length (``paged_attention_max_seq_len_kv``, below the tables'
    capacity when the last page is partly used: its test_mhas.py builds s_kv = 24 on pages of 128); a
    paged fusedattn problem spans the whole capacity. Keys past the graph's length are never attended
    (seq_len_kv, given or filled from max_seq_len_kv, bounds them), so zero columns complete the bias.
    A bias broadcast along keys (last dim 1) or already that wide is returned as it is."""
    n = bias.shape[-1]
    if n == 1 or n >= cap:
        return bias
    return torch.nn.functional.pad(bias, (0, cap - n))


def _widen_heads(x: torch.Tensor, h_kv: int) -> torch.Tensor:
    """``x`` (dim 1 its ``h`` heads, h dividing ``h_kv``) seen or copied as ``h_kv`` heads, head j of the
    result being head ``j // (h_kv // h)`` of ``x``: with the kernels' query head -> kv head mapping that is
    cuDNN's own for K and V of different head counts (:func:`.checks.kv_heads` shows why).

    One head: a view with head stride 0 (no copy). More: a gather copy (``repeat_interleave`` along
    heads), one copy of ``x`` per call, because the kernels take one head count for K and V. Dim 1 holds
    the heads of dense ``[b, h, s, d]`` tensors and of paged containers ``[num_blocks, h, block_size, d]``
    alike (a paged container is copied whole).
    """
    h = x.shape[1]
    if h == h_kv:
        return x
    if h == 1:
        return x.expand(-1, h_kv, -1, -1)
    return x.repeat_interleave(h_kv // h, dim=1)


def _fold_heads(per_head: torch.Tensor, h: int) -> torch.Tensor:
    """The gradient of :func:`_widen_heads` to ``h`` heads: ``per_head [b, h_kv, s, d]`` (one gradient per
    widened head) summed over the ``h_kv // h`` heads each original head became, in fp32 so the sum is
    rounded once, into the graph's data type by the caller's copy."""
    h_kv = per_head.shape[1]
    return per_head.unflatten(1, (h, h_kv // h)).sum(2, dtype=torch.float32)


def invoke(call: Call, t: Dict[str, torch.Tensor]):
    """Run one call on role -> torch tensor, translating the functional layer's errors."""
    try:
        fn, args, kw, post = build_invocation(call, t)
        result = fn(*args, **kw)
        post(result)
    except (GraphError, cudnnGraphNotSupportedError):
        raise
    except NotImplementedError as e:   # NotSupportedError included
        raise cudnnGraphNotSupportedError(f"{call.where}: {e}") from e
    except (ValueError, TypeError) as e:
        raise GraphError(f"{call.where}: fusedattn rejected the call: {e}") from e

