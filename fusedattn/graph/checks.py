"""Validation helpers (build, at ``validate()``): check the tensors' dims and data types against each
other, infer the outputs' dims, strides and data types (as cuDNN does), and name the head dims
fusedattn cannot run."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from ..problem import MAX_HEAD_DIM, MAX_HEAD_DIM_TORCH
from .enums import data_type
from .errors import GraphError, cudnnGraphNotSupportedError
from .tensors import tensor

_FLOAT_DTS = (data_type.HALF, data_type.BFLOAT16, data_type.FLOAT, data_type.DOUBLE)
_INDEX_DTS = (data_type.INT32, data_type.INT64)
_FP8_DTS = (data_type.FP8_E4M3, data_type.FP8_E5M2, data_type.FP8_E8M0, data_type.FAST_FLOAT_FOR_FP8,
            data_type.FP4_E2M1)


# ---------------------------------------------------------------------------------------------
# dims helpers (at validate)
# ---------------------------------------------------------------------------------------------

def need_dims(t: tensor, role: str, where: str, rank: Optional[int] = 4, positive=True) -> List[int]:
    """The dims of ``t``, checked to be set, of ``rank``, with strides of the same rank."""
    if not t._dim:
        raise GraphError(f"{where}: {role} tensor {t.label()} has no dims; call set_dim([...]) and "
                         f"set_stride([...]) (tensor_like(torch_tensor) sets both)")
    if rank is not None and len(t._dim) != rank:
        raise GraphError(f"{where}: {role} tensor {t.label()} must be {rank}-D, got dims {t._dim}")
    if not t._stride:
        raise GraphError(f"{where}: {role} tensor {t.label()} has dims {t._dim} but no strides; "
                         f"call set_stride([...])")
    if len(t._stride) != len(t._dim):
        raise GraphError(f"{where}: {role} tensor {t.label()} has {len(t._dim)} dims {t._dim} but "
                         f"{len(t._stride)} strides {t._stride}")
    if positive and any(d <= 0 for d in t._dim):
        raise GraphError(f"{where}: {role} tensor {t.label()} has an empty dim: {t._dim}")
    return list(t._dim)


def packed_strides(dims) -> List[int]:
    """Row-major strides of ``dims``."""
    out, acc = [0] * len(dims), 1
    for i in range(len(dims) - 1, -1, -1):
        out[i] = acc
        acc *= max(int(dims[i]), 1)
    return out


def dense_strides_like(dims, strides) -> List[int]:
    """Packed strides for ``dims`` in the dim order of ``strides`` (``empty_like`` for views):
    dQ of a BSHD-strided Q is allocated BSHD, without the gaps a view might have."""
    order = sorted(range(len(dims)), key=lambda i: (-strides[i], i))
    out, acc = [0] * len(dims), 1
    for i in reversed(order):
        out[i] = acc
        acc *= max(int(dims[i]), 1)
    return out


def infer_output(t: tensor, role: str, where: str, dims, default_strides, dt: data_type):
    """cuDNN's inference for an operation output: dims/strides when both unset, else check them.

    Sets the inferred values on the tensor (``get_dim()`` then returns them, as in cuDNN).
    """
    if bool(t._dim) != bool(t._stride):
        raise GraphError(f"{where}: output {role} {t.label()}: set_dim and set_stride must be declared "
                         f"together (got dim {t._dim}, stride {t._stride}), or both left unset to be inferred")
    if not t._dim:
        t._dim, t._stride = list(dims), list(default_strides)
        if t._graph is not None:
            t._graph._inferred_uids.add(t._uid)      # inferred anew when execute overrides shapes
    elif list(t._dim) != list(dims):
        raise GraphError(f"{where}: output {role} {t.label()} has dims {t._dim}, but the operation "
                         f"produces {list(dims)}")
    elif len(t._stride) != len(dims):
        raise GraphError(f"{where}: output {role} {t.label()} has strides {t._stride} for dims {t._dim}")
    if t._data_type is data_type.NOT_SET:
        t._data_type = dt


def check_broadcast(t: tensor, role: str, where: str, full: List[int], names: str) -> List[int]:
    """Dims of a bias-like tensor: each 1 or the full extent (``names`` spells the full dims)."""
    dims = need_dims(t, role, where)
    for i, (got, want) in enumerate(zip(dims, full)):
        if got not in (1, want):
            raise GraphError(f"{where}: {role} {t.label()} has dims {dims}; each must be 1 or the "
                             f"full extent of {names} = {full} (dim {i} is {got})")
    return dims


def resolve_dt(t: tensor, role: str, where: str, default: data_type) -> data_type:
    """The tensor's data type, or ``default`` (the graph's io_data_type) when NOT_SET."""
    dt = t._data_type if t._data_type is not data_type.NOT_SET else default
    if dt is data_type.NOT_SET:
        raise GraphError(f"{where}: {role} tensor {t.label()} has no data type; pass data_type= to "
                         f"tensor(), or set the graph's io_data_type")
    t._data_type = dt
    return dt


def check_float_io(dts: Dict[str, data_type], where: str) -> None:
    """Attention inputs are float: FP8 is valid cuDNN but not supported here, the rest is bad input."""
    for role, dt in dts.items():
        if dt in _FP8_DTS:
            raise cudnnGraphNotSupportedError(f"{where}: {role} is {dt.name}; FP8 attention is not supported "
                                              f"by fusedattn (use HALF or BFLOAT16)")
        if dt not in _FLOAT_DTS:
            raise GraphError(f"{where}: {role} is {dt.name}; attention inputs must be HALF, BFLOAT16 or FLOAT")


def _index_tensor(t: tensor, role: str, where: str, b: int):
    """seq_len-style tensors: dims [b, 1, 1, 1] or [b], INT32/INT64."""
    dims = need_dims(t, role, where, rank=None)
    if dims not in ([b, 1, 1, 1], [b]):
        raise GraphError(f"{where}: {role} {t.label()} must have dims [b, 1, 1, 1] or [b] with b = {b}, "
                         f"got {dims}")
    if t._data_type not in _INDEX_DTS:
        raise GraphError(f"{where}: {role} {t.label()} must be INT32 (or INT64), got {t._data_type.name}")


def _scalar_tensor(t: tensor, role: str, where: str, kinds):
    """One-element tensors read on the host at execute (attn_scale, dropout seed/offset)."""
    dims = need_dims(t, role, where, rank=None)
    if math.prod(dims) != 1:
        raise GraphError(f"{where}: {role} {t.label()} must hold one element (dims [1, 1, 1, 1]), got {dims}")
    if t._data_type is data_type.NOT_SET:
        t._data_type = kinds[0]
    if t._data_type not in kinds:
        raise GraphError(f"{where}: {role} {t.label()} must be {'/'.join(k.name for k in kinds)}, "
                         f"got {t._data_type.name}")


def head_dims_unsupported(d: int, d_v: int, limit=True) -> Optional[str]:
    """Why the Graph door cannot run head dims ``d`` (q/k) and ``d_v`` (v), or None.

    It runs multiples of 8 (cuDNN's own rule) up to ``MAX_HEAD_DIM_TORCH``: the kernels up to
    ``MAX_HEAD_DIM`` (256), the PyTorch path above (``plan.large_head_dim_plan``; cuDNN 9.9+ runs 264
    and 520 on Hopper). Valid graphs, so "not supported", never bad input. ``limit=False`` checks the
    multiple of 8 only.
    """
    for name, x in (("d (the head dim of q and k)", d), ("d_v (the head dim of v)", d_v)):
        if x % 8 or (limit and x > MAX_HEAD_DIM_TORCH):
            return (f"{name} = {x} is not supported by fusedattn: head dims are multiples of 8 up to "
                    f"{MAX_HEAD_DIM_TORCH} (fused kernels up to {MAX_HEAD_DIM})")
    return None



def dense_qkv_dims(q: tensor, k: tensor, v: tensor, where: str) -> Tuple[int, ...]:
    """``(b, h_q, s_q, d, h_k, h_v, s_kv, d_v)`` of dense ``q [b, h_q, s_q, d]``, ``k [b, h_k, s_kv, d]`` and
    ``v [b, h_v, s_kv, d_v]``: batch sizes, q's and k's head dims and k's and v's lengths must agree
    (GraphError); the head counts are for the caller (:func:`kv_heads`)."""
    b, h_q, s_q, d = need_dims(q, "q", where)
    kb, h_k, s_kv, d_k = need_dims(k, "k", where)
    vb, h_v, s_v, d_v = need_dims(v, "v", where)
    if kb != b or vb != b:
        raise GraphError(f"{where}: batch sizes differ: q {q._dim}, k {k._dim}, v {v._dim}")
    if d_k != d:
        raise GraphError(f"{where}: k {k.label()} has head dim {d_k} but q {q.label()} has {d}")
    if s_v != s_kv:
        raise GraphError(f"{where}: k and v must have the same sequence length: k {k._dim}, v {v._dim}")
    return b, h_q, s_q, d, h_k, h_v, s_kv, d_v


def kv_heads(h_q: int, h_k: int, h_v: int, where: str) -> Tuple[int, Optional[Tuple[int, int]]]:
    """How the kernels run K with ``h_k`` heads and V with ``h_v``: ``(h_kv, kv_counts)``.

    cuDNN reads K and V head by head on their own: query head i reads K head ``i // (h_q // h_k)`` and V
    head ``i // (h_q // h_v)`` (its reference expands each separately), so both must divide h_q (else
    GraphError: malformed). The kernels take one ``h_kv`` for both, and map query head i to kv head
    ``i // (h_q // h_kv)``. With ``h_kv = lcm(h_k, h_v)`` (it divides h_q, a common multiple of both) and
    K widened to h_kv heads so that its head j is K head ``j // (h_kv // h_k)`` (V likewise), query head i
    reads K head ``(i // (h_q // h_kv)) // (h_kv // h_k) = i // (h_q // h_k)``: cuDNN's mapping. E.g.
    h_q 6, K 2, V 3: h_kv 6, K heads 0 0 0 1 1 1, V heads 0 0 1 1 2 2.

    Widening (execute's ``_widen_heads``) is a stride-0 view for a single-head tensor (no copy) and a
    gather copy of the tensor otherwise (one copy each of K and V, or of their paged containers); the
    backward sums each widened head's gradient back onto the head it was copied from (fp32).
    ``kv_counts`` is ``(h_k, h_v)`` when they differ, else None (nothing to widen).
    """
    if h_k == h_v:
        return h_k, None            # the common check (GQA/MQA) names a bad ratio
    if h_q % h_k or h_q % h_v:
        raise GraphError(f"{where}: query heads ({h_q}) must be a multiple of key/value heads: k has {h_k}, "
                         f"v has {h_v} (query head i reads k head i // (h_q // h_k), v head i // (h_q // h_v))")
    return math.lcm(h_k, h_v), (h_k, h_v)
