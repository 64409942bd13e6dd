"""The lowered form (build, at ``build_operation_graph()``): a :class:`Call` per node: the uids to read
from the variant pack with the shape/dtype each must have (:class:`Req`), and the keyword arguments of
:func:`fusedattn.functional.attention_forward` / ``attention_backward`` that never change, plus the
static key the support probe caches on. ``execute`` then only looks tensors up, checks them cheaply
and calls the function."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from .enums import data_type, torch_dtype_of
from .errors import cudnnGraphNotSupportedError
from .tensors import tensor

if TYPE_CHECKING:
    from .nodes import _Node

# Graph-argument names of each feature, for not-supported messages.
FEATURE_ARGS = {
    "band": "the diagonal band (use_causal_mask / use_causal_mask_bottom_right / diagonal_alignment / "
            "diagonal_band_left_bound / diagonal_band_right_bound / sliding_window_length)",
    "padding": "use_padding_mask (seq_len_q / seq_len_kv)",
    "bias": "bias (attn_bias)",
    "alibi": "use_alibi_mask",
    "dropout": "dropout",
    "rng_dump": "rng_dump",
    "paged": "paged_attention_k_table / paged_attention_v_table",
    "stats": "generate_stats",
    "dbias": "dBias",
    "deterministic": "use_deterministic_algorithm",
    "ragged": "ragged offsets (set_ragged_offset: packed THD layout)",
    "sink": "sink_token / dSink_token (attention sinks)",
}


# ---------------------------------------------------------------------------------------------
# the lowered form
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Req:
    """One tensor ``execute`` must find in the variant pack (or allocate, when ``scratch``)."""

    role: str
    uid: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    label: str
    host_ok: bool = False     # one-element scalars may live on the CPU (pass-by-value)
    alt_shapes: Tuple[Tuple[int, ...], ...] = ()   # also accepted (seq lens as [b])
    scratch: bool = False     # a virtual output nobody asked for: allocated per execute
    ragged: bool = False      # packed (THD): any bound shape, read through the graph strides at its
    #                           ragged offsets (the node checks the extent at execute)


@dataclass
class Call:
    """What ``execute`` runs for one node: requirements, fixed kwargs, and how to call."""

    kind: str                               # "fwd" | "bwd"
    where: str                              # "sdpa 'name'" for messages
    reqs: List[Req]
    static: Dict[str, object]               # functional kwargs fixed at build
    features: Tuple[str, ...]               # FEATURE_ARGS keys this call uses
    scale_role: bool = False                # attn_scale comes from a tensor
    seed_role: bool = False
    offset_role: bool = False
    kv_layout: str = "dense"                # "dense" | "paged" | "paged_nshd" (seed containers)
    table_layout: str = "b1n1"              # "b1n1" | "bn" (seed page tables)
    max_seq_len_kv: Optional[int] = None    # paged: fill seq_len_kv when none is given
    ragged_roles: Tuple[str, ...] = ()      # packed roles; each has a "ragged_<role>" offsets req
    packed_q_only: bool = False             # packed q/O over padded or paged K/V: attention_with_kvcache
    packed_tables: Tuple[str, ...] = ()     # page tables with ragged offsets ("ragged_<role>" reqs):
    #                                         unpacked to padded tables at execute
    kv_counts: Optional[Tuple[int, int]] = None   # (h_k, h_v) when they differ: both run widened to
    #                                               h_kv heads (graph.checks.kv_heads), gradients summed back
    dims: Dict[str, Tuple[int, ...]] = field(default_factory=dict)   # declared dims, for the probe
    dts: Dict[str, torch.dtype] = field(default_factory=dict)
    probe_key: tuple = ()


def _torch_dt(dt: data_type, role: str, where: str, t: tensor) -> torch.dtype:
    tdt = torch_dtype_of(dt)
    if tdt is None:
        raise cudnnGraphNotSupportedError(f"{where}: {role} {t.label()} has data type {dt.name}, which "
                                          f"fusedattn cannot hold in a torch tensor")
    return tdt


def _req(t: tensor, role: str, where: str, *, host_ok=False, alt=(), scratch=False) -> Req:
    return Req(role=role, uid=t._uid, shape=tuple(t._dim), stride=tuple(t._stride),
               dtype=_torch_dt(t._data_type, role, where, t), label=t.label(), host_ok=host_ok,
               alt_shapes=tuple(tuple(a) for a in alt), scratch=scratch,
               ragged=t._ragged_offset is not None)



def _finish_call(call: Call, node: _Node, s_kv: int):
    """Record declared dims/dtypes (for the support probe) and the static key of the call."""
    for r in call.reqs:
        call.dims[r.role] = r.shape
        call.dts[r.role] = r.dtype
    b, h_q, s_q, _, d, d_v = node.dims
    call.dims["_sizes"] = (b, h_q, node.h_kv, s_q, s_kv, d, d_v)
    call.kv_counts = getattr(node, "kv_counts", None)      # the FP8 nodes run K and V as given
    static_items = tuple(sorted((k, v if not isinstance(v, float) else "float")
                                for k, v in call.static.items()))
    # Shapes enter the key without b / s (they do not change what is supported), but the
    # broadcast pattern of bias-like tensors and the head dims do.
    shape_sig = tuple(sorted((r.role, tuple(x == 1 for x in r.shape), len(r.shape), str(r.dtype))
                             for r in call.reqs))
    call.probe_key = (call.kind, call.features, static_items, shape_sig, h_q, node.h_kv, d, d_v,
                      call.kv_layout, call.scale_role, call.seed_role, call.offset_role, call.packed_q_only,
                      call.kv_counts)
    # The paged block size can matter to the kernels: keep it in the key.
    if node.paged:
        kdims = call.dims["k"]
        call.probe_key += (kdims[1] if call.kv_layout == "paged_nshd" else kdims[2],)

