"""The SDPA nodes of a graph: cuDNN's arguments in, one functional call out.

Each ``graph.sdpa(...)`` / ``graph.sdpa_backward(...)`` becomes a node here. A node
does three things, at three moments:

* at the call: parse cuDNN's arguments (every spelling of the mask, dropout, stats flag)
  into one normalized description, raising :class:`GraphError` for contradictions;
* at ``validate()``: check the tensors' dims against each other, infer the outputs' dims,
  strides and data types (as cuDNN does), raise ``cudnnGraphNotSupportedError`` for valid
  requests fusedattn cannot run;
* at ``build_operation_graph()``: lower to a :class:`Call`: the uids to read from the variant
  pack with the shape/dtype each must have, and the keyword arguments of
  :func:`fusedattn.functional.attention_forward` / ``attention_backward`` that never change.
  ``execute`` then only looks tensors up, checks them cheaply and calls the function.

Translation of the mask (cuDNN's names -> the functional door's band)::

    use_causal_mask              -> causal, alignment top_left     (band right bound 0)
    use_causal_mask_bottom_right -> causal, alignment bottom_right
    diagonal_alignment           -> causal_alignment ("top_left" | "bottom_right")
    diagonal_band_left_bound L   -> window left  = L - 1   (cuDNN's bound counts the diagonal:
    sliding_window_length L         L = 1 keeps only the diagonal, i.e. our left = 0)
    diagonal_band_right_bound R  -> window right = R
    use_padding_mask + seq_len_q/seq_len_kv -> seq_len_q / seq_len_kv
    bias / attn_bias             -> attn_bias        use_alibi_mask -> alibi=True
    dropout=p, dropout_seed=s, dropout_offset=o  or  dropout=(p, seed_tensor, offset_tensor)
                                 -> dropout_p, dropout_seed, dropout_offset (ints; tensors read once per execute)
    attn_scale None              -> 1.0  (cuDNN applies no scale when none is given)

Ragged offsets (cuDNN's packed THD layout): when q, k, v and o (and dO, dQ, dK, dV in the
backward) carry ``set_ragged_offset(r)``, the node runs :mod:`fusedattn.varlen` instead::

    r [b + 1] (elements) -> cu_seqlens = r / token stride   (the tensor's stride along s)
    graph dims [b, h, s, d] -> max_seqlen = s; each bound buffer is viewed as [total, h, d]
                               with the graph's token / head / dim strides (any bound shape)
    seq_len_q / seq_len_kv  -> checked equal to diff(cu_seqlens) (derived from it when absent)
    Stats [b, h, s, 1]      -> scattered to / gathered from the padded layout (0 past a length),
                               or packed too when Stats has a ragged offset of its own
"""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..problem import MAX_HEAD_DIM, NotSupportedError
from .enums import data_type, diagonal_alignment, tensor_reordering, torch_dtype_of
from .errors import GraphError, cudnnGraphNotSupportedError
from .tensors import tensor

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
}
# A feature that cannot be probed without another one.
_FEATURE_DEPS = {"rng_dump": ("dropout",), "dbias": ("bias",)}

_FLOAT_DTS = (data_type.HALF, data_type.BFLOAT16, data_type.FLOAT, data_type.DOUBLE)
_INDEX_DTS = (data_type.INT32, data_type.INT64)
_FP8_DTS = (data_type.FP8_E4M3, data_type.FP8_E5M2, data_type.FP8_E8M0, data_type.FAST_FLOAT_FOR_FP8,
            data_type.FP4_E2M1)


# ---------------------------------------------------------------------------------------------
# argument parsing (at the sdpa call)
# ---------------------------------------------------------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_graph_tensor(graph, value, arg: str, where: str):
    """``value`` if it is None or a tensor of ``graph``; GraphError naming ``arg`` otherwise."""
    if value is None:
        return None
    if isinstance(value, tensor):
        if value._graph is not graph:
            raise GraphError(f"{where}: {arg} is a tensor of another graph; create it with this "
                             f"graph's tensor()/tensor_like()")
        return value
    if isinstance(value, torch.Tensor):
        raise GraphError(f"{where}: {arg} is a torch.Tensor; pygraph operations take graph tensors "
                         f"(graph.tensor_like({arg}) describes one), or use cudnn.Graph, which "
                         f"accepts torch tensors directly")
    raise GraphError(f"{where}: {arg} must be a graph tensor, got {type(value).__name__}")


def _alias(where, a_name, a, b_name, b):
    """One of two spellings of the same argument; GraphError when both are given."""
    if a is not None and b is not None:
        raise GraphError(f"{where}: {a_name} and {b_name} are the same argument; give one")
    return a if a is not None else b


def parse_band(where, use_causal_mask, use_causal_mask_bottom_right, alignment, left_bound,
               right_bound, sliding_window_length):
    """cuDNN's mask arguments -> ``(alignment "top_left"|"bottom_right", left, right)``.

    ``left``/``right`` are the functional door's bounds (None = unbounded): key ``j`` is kept
    for query ``i`` iff ``i + off - left <= j <= i + off + right``. cuDNN's left bound counts
    the diagonal, so ``left = diagonal_band_left_bound - 1``.
    """
    if use_causal_mask and use_causal_mask_bottom_right:
        raise GraphError(f"{where}: use_causal_mask and use_causal_mask_bottom_right cannot both be true")
    left_bound = _alias(where, "sliding_window_length", sliding_window_length,
                        "diagonal_band_left_bound", left_bound)
    causal = bool(use_causal_mask or use_causal_mask_bottom_right)
    if causal and right_bound is not None:
        which = "use_causal_mask" if use_causal_mask else "use_causal_mask_bottom_right"
        raise GraphError(f"{where}: {which} and diagonal_band_right_bound cannot be set at the same "
                         f"time (causal is right bound 0)")
    if alignment is not None and not isinstance(alignment, diagonal_alignment):
        raise GraphError(f"{where}: diagonal_alignment must be cudnn.diagonal_alignment.TOP_LEFT or "
                         f"BOTTOM_RIGHT, got {alignment!r}")
    # TOP_LEFT is cuDNN's default alignment, so it cannot contradict use_causal_mask_bottom_right (cuDNN
    # lets the causal flags set the alignment); an explicit BOTTOM_RIGHT with top-left causal can.
    if use_causal_mask and alignment is diagonal_alignment.BOTTOM_RIGHT:
        raise GraphError(f"{where}: use_causal_mask is top-left aligned but diagonal_alignment="
                         f"BOTTOM_RIGHT; use use_causal_mask_bottom_right=True, or diagonal_alignment="
                         f"BOTTOM_RIGHT with diagonal_band_right_bound=0")
    if use_causal_mask:
        align = "top_left"
    elif use_causal_mask_bottom_right:
        align = "bottom_right"
    else:
        align = "bottom_right" if alignment is diagonal_alignment.BOTTOM_RIGHT else "top_left"
    left = None
    if left_bound is not None:
        if not _is_int(left_bound) or left_bound < 1:
            raise GraphError(f"{where}: diagonal_band_left_bound / sliding_window_length must be an int "
                             f">= 1 (1 keeps only the diagonal), got {left_bound!r}")
        left = int(left_bound) - 1
    right = 0 if causal else None
    if right_bound is not None:
        if not _is_int(right_bound) or right_bound < 0:
            raise GraphError(f"{where}: diagonal_band_right_bound must be an int >= 0, got {right_bound!r}")
        right = int(right_bound)
    return align, left, right


def parse_stats_flag(where, is_inference, generate_stats) -> bool:
    """True when stats are generated. cuDNN wants exactly one of the two flags; the seeds pass
    both (consistently) or neither (no stats), so both are accepted when they agree."""
    for name, val in (("is_inference", is_inference), ("generate_stats", generate_stats)):
        if val is not None and not isinstance(val, bool):
            raise GraphError(f"{where}: {name} must be a bool, got {val!r}")
    if is_inference is not None and generate_stats is not None and generate_stats == is_inference:
        raise GraphError(f"{where}: is_inference={is_inference} and generate_stats={generate_stats} "
                         f"contradict (generate_stats is the negation of is_inference; prefer generate_stats)")
    if generate_stats is not None:
        return generate_stats
    if is_inference is not None:
        return not is_inference
    return False


@dataclass
class Dropout:
    p: float
    seed: object    # int, or a graph tensor read at execute
    offset: object


def parse_dropout(graph, where, dropout, dropout_seed, dropout_offset, unsupported) -> Optional[Dropout]:
    """Both spellings: ``dropout=p, dropout_seed=, dropout_offset=`` (ints or graph tensors) and
    cuDNN's ``dropout=(p, seed_tensor, offset_tensor)``. ``(mask, scale)`` is recorded as not
    supported."""
    if dropout is None:
        if dropout_seed is not None or dropout_offset is not None:
            raise GraphError(f"{where}: dropout_seed/dropout_offset given without dropout=p")
        return None
    if isinstance(dropout, (tuple, list)):
        if dropout_seed is not None or dropout_offset is not None:
            raise GraphError(f"{where}: dropout=(p, seed, offset) already carries the seed and offset; "
                             f"do not pass dropout_seed/dropout_offset too")
        if len(dropout) == 3 and _is_real(dropout[0]):
            p, seed, offset = dropout
        elif len(dropout) in (2, 3) and isinstance(dropout[0], tensor):
            unsupported.append("dropout=(mask, scale[, scale_inv]): a user-given dropout mask; fusedattn "
                               "generates its own Philox mask, use dropout=(p, seed, offset)")
            return None
        else:
            raise GraphError(f"{where}: dropout must be a float probability or a tuple (probability, seed "
                             f"tensor, offset tensor), got {dropout!r}")
    else:
        p, seed, offset = dropout, dropout_seed, dropout_offset
    if not _is_real(p) or not (0.0 <= float(p) < 1.0):
        raise GraphError(f"{where}: dropout probability must be a float in [0, 1), got {p!r}")
    out = []
    for name, val in (("dropout seed", seed), ("dropout offset", offset)):
        if val is None:
            val = 0   # the seeds' spelling may omit them; 0 is a valid Philox key
        if isinstance(val, tensor):
            check_graph_tensor(graph, val, name, where)
        elif not _is_int(val) or val < 0:
            raise GraphError(f"{where}: {name} must be an int >= 0 or a one-element graph tensor, got {val!r}")
        else:
            val = int(val)
        out.append(val)
    return Dropout(float(p), out[0], out[1])


def parse_scale(graph, where, attn_scale):
    """``(value, tensor)``: a float, or a one-element graph tensor read at execute; None -> 1.0."""
    if attn_scale is None:
        return 1.0, None
    if isinstance(attn_scale, tensor):
        return None, check_graph_tensor(graph, attn_scale, "attn_scale", where)
    if not _is_real(attn_scale) or not math.isfinite(float(attn_scale)) or float(attn_scale) <= 0:
        raise GraphError(f"{where}: attn_scale must be a finite float > 0 or a graph tensor, got {attn_scale!r}")
    return float(attn_scale), None


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
    """Why fusedattn cannot run head dims ``d`` (q/k) and ``d_v`` (v), or None.

    fusedattn runs multiples of 8 up to ``MAX_HEAD_DIM`` (256). Valid graphs, so "not supported",
    never bad input. ``limit=False`` checks the multiple of 8 only.
    """
    for name, x in (("d (the head dim of q and k)", d), ("d_v (the head dim of v)", d_v)):
        if x % 8 or (limit and x > MAX_HEAD_DIM):
            return (f"{name} = {x} is not supported by fusedattn: head dims are multiples of 8 up to "
                    f"{MAX_HEAD_DIM}")
    return None


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


# ---------------------------------------------------------------------------------------------
# nodes
# ---------------------------------------------------------------------------------------------

class _Node:
    """Shared parts of the forward and backward nodes."""

    kind = ""

    def __init__(self, graph, name: str):
        self.graph = graph
        self.name = name
        self.where = f"{self.op_name} {name!r}"
        self.inputs: Dict[str, tensor] = {}     # role -> tensor, in the order the op reads them
        self.outputs: Dict[str, tensor] = {}    # role -> tensor this node writes
        self.order: List[tensor] = []           # user tensors (read or written) in signature order
        self.unsupported: List[str] = []        # arguments fusedattn cannot run, raised at validate
        self.ragged: Dict[str, tensor] = {}     # role -> tensor with a ragged offset (set at validate)

    op_name = "sdpa"
    partial_padding = False   # the seeds' paged spelling may give seq_len_kv alone
    packed_roles: Tuple[str, ...] = ()   # roles that are packed together (THD); Stats may be too, or not

    def _input(self, role: str, value, arg: Optional[str] = None):
        t = check_graph_tensor(self.graph, value, arg or role, self.where)
        if t is not None:
            self.inputs[role] = t
            self.order.append(t)
            t._roles.append(f"{self.name}.{role}")
        return t

    def _written(self, role: str, value, arg: Optional[str] = None):
        """A user-created tensor the node writes (rng_dump, dBias)."""
        t = check_graph_tensor(self.graph, value, arg or role, self.where)
        if t is not None:
            self.outputs[role] = t
            self.order.append(t)
            t._roles.append(f"{self.name}.{role}")
        return t

    def _new_output(self, role: str, cudnn_name: str) -> tensor:
        t = self.graph._new_tensor(name=f"{self.name}::{cudnn_name}", is_virtual=True, producer=self)
        t._roles.append(f"{self.name}.{role}")
        self.outputs[role] = t
        return t

    def _common_args(self, *, attn_scale, bias, use_alibi_mask, use_padding_mask, seq_len_q, seq_len_kv,
                     use_causal_mask, use_causal_mask_bottom_right, sliding_window_length, diagonal_alignment_,
                     left_bound, right_bound, dropout, dropout_seed, dropout_offset, rng_dump, dbias=None):
        w = self.where
        self.scale, scale_t = parse_scale(self.graph, w, attn_scale)
        if scale_t is not None:
            self._input("attn_scale", scale_t)
        self.band = parse_band(w, bool(use_causal_mask), bool(use_causal_mask_bottom_right),
                               diagonal_alignment_, left_bound, right_bound, sliding_window_length)
        for name, val in (("use_alibi_mask", use_alibi_mask), ("use_padding_mask", use_padding_mask)):
            if not isinstance(val, (bool, type(None))):
                raise GraphError(f"{w}: {name} must be a bool, got {val!r}")
        self.alibi = bool(use_alibi_mask)
        self.padding = bool(use_padding_mask)
        self._input("bias", bias, "bias (attn_bias)")
        if dbias is not None:
            if bias is None:
                raise GraphError(f"{w}: dBias given without bias; the bias gradient needs the bias")
            self._written("dBias", dbias)
        self._input("seq_len_q", seq_len_q)
        self._input("seq_len_kv", seq_len_kv)
        self.dropout = parse_dropout(self.graph, w, dropout, dropout_seed, dropout_offset, self.unsupported)
        if self.dropout is not None:
            if isinstance(self.dropout.seed, tensor):
                self._input("dropout_seed", self.dropout.seed)
            if isinstance(self.dropout.offset, tensor):
                self._input("dropout_offset", self.dropout.offset)
        if rng_dump is not None:
            if self.dropout is None:
                raise GraphError(f"{w}: rng_dump receives the dropout mask, but no dropout is set")
            self._written("rng_dump", rng_dump)

    def _unsupported_arg(self, name: str, value, why: str = ""):
        if value is not None and value is not False:
            self.unsupported.append(f"{name}{': ' + why if why else ''}")

    # -- validate helpers -------------------------------------------------------------------
    def _validate_common(self, ctx, b, h_q, s_q, s_kv, d, d_v, io_dt):
        w = self.where
        if self.unsupported:
            raise cudnnGraphNotSupportedError(
                f"{w}: not supported by fusedattn: " + "; ".join(self.unsupported))
        for role, t in list(self.inputs.items()) + list(self.outputs.items()):
            if t._reordering not in (None, tensor_reordering.NONE):
                raise cudnnGraphNotSupportedError(f"{w}: {role} {t.label()} uses reordering "
                                                  f"{t._reordering}; only NONE is supported")
        self._check_ragged(b)
        if h_q % self.h_kv != 0:
            raise GraphError(f"{w}: query heads ({h_q}) must be a multiple of key/value heads "
                             f"({self.h_kv}) (GQA/MQA)")
        if "bias" in self.inputs:
            t = self.inputs["bias"]
            self.bias_dims = check_broadcast(t, "bias", w, [b, h_q, s_q, s_kv], "[b, h_q, s_q, s_kv]")
            resolve_dt(t, "bias", w, io_dt)
            if t._data_type not in _FLOAT_DTS + (data_type.BOOLEAN,):
                raise GraphError(f"{w}: bias {t.label()} must be a float type (or BOOLEAN, True = keep), "
                                 f"got {t._data_type.name}")
        if self.padding:
            missing = [r for r in ("seq_len_q", "seq_len_kv") if r not in self.inputs]
            if self.partial_padding and len(missing) < 2:
                missing = []
            if missing:
                raise GraphError(f"{w}: use_padding_mask=True requires seq_len_q and seq_len_kv; "
                                 f"missing {', '.join(missing)}")
        else:
            given = [r for r in ("seq_len_q", "seq_len_kv") if r in self.inputs]
            if given:
                raise GraphError(f"{w}: {', '.join(given)} given but use_padding_mask is False; "
                                 f"sequence lengths are used only with use_padding_mask=True")
        for role in ("seq_len_q", "seq_len_kv"):
            if role in self.inputs:
                _index_tensor(self.inputs[role], role, w, b)
        if "attn_scale" in self.inputs:
            _scalar_tensor(self.inputs["attn_scale"], "attn_scale", w,
                           (data_type.FLOAT, data_type.DOUBLE, data_type.HALF, data_type.BFLOAT16))
        for role in ("dropout_seed", "dropout_offset"):
            if role in self.inputs:
                _scalar_tensor(self.inputs[role], role, w, (data_type.INT64, data_type.INT32))
        if "rng_dump" in self.outputs:
            t = self.outputs["rng_dump"]
            dims = need_dims(t, "rng_dump", w)
            if dims != [b, h_q, s_q, s_kv]:
                raise GraphError(f"{w}: rng_dump {t.label()} must have dims [b, h_q, s_q, s_kv] = "
                                 f"{[b, h_q, s_q, s_kv]}, got {dims}")
            if t._virtual:
                raise GraphError(f"{w}: rng_dump {t.label()} is virtual; it must be a graph input the "
                                 f"variant pack provides")
            resolve_dt(t, "rng_dump", w, data_type.FLOAT)
        for role, t in self.inputs.items():
            if t._data_type in _FP8_DTS:
                raise cudnnGraphNotSupportedError(f"{w}: {role} {t.label()} is {t._data_type.name}; FP8 "
                                                  f"attention is not supported by fusedattn")

    def _role_tensor(self, role: str) -> tensor:
        return self.inputs[role] if role in self.inputs else self.outputs[role]

    def _check_ragged(self, b: int) -> None:
        """Which tensors are packed (THD), checked: all of ``packed_roles`` or none (the packed
        path reads and writes one layout), offsets ``[b + 1]`` INT32/INT64 graph inputs, and no
        feature the packed path cannot run. Sets ``self.ragged``."""
        w = self.where
        ragged = {role: t for role, t in list(self.inputs.items()) + list(self.outputs.items())
                  if t._ragged_offset is not None}
        self.ragged = {}
        if not ragged:
            return
        for role, t in ragged.items():
            if role not in self.packed_roles + ("stats",):
                raise cudnnGraphNotSupportedError(
                    f"{w}: {role} {t.label()} has a ragged offset; only {', '.join(self.packed_roles)} and "
                    f"stats can be packed (THD)")
        # A virtual output nobody reads may stay unpacked: it is then not written at all.
        missing = [r for r in self.packed_roles if r not in ragged
                   and not (r in self.outputs and self.outputs[r]._virtual)]
        if missing:
            role0, t0 = next(iter(ragged.items()))
            names = ", ".join(f"{r} {self._role_tensor(r).label()}" for r in missing)
            raise cudnnGraphNotSupportedError(
                f"{w}: {role0} {t0.label()} has a ragged offset (packed THD layout) but {names} "
                f"{'does' if len(missing) == 1 else 'do'} not; fusedattn runs packed variable-length "
                f"batches when {', '.join(self.packed_roles)} all carry ragged offsets")
        for feat, used in (("bias", "bias" in self.inputs), ("paged", self.paged)):
            if used:
                raise cudnnGraphNotSupportedError(
                    f"{w}: {FEATURE_ARGS[feat]} with ragged offsets (packed THD layout) is not supported "
                    f"by fusedattn; the packed path runs causal/band masks, ALiBi, dropout and GQA")
        for role, t in ragged.items():
            what = f"the ragged offset of {role} {t.label()}"
            off = check_graph_tensor(self.graph, t._ragged_offset, what, w)
            dims = need_dims(off, what, w, rank=None)
            if dims not in ([b + 1, 1, 1, 1], [b + 1]):
                raise GraphError(f"{w}: {what} ({off.label()}) must have dims [b + 1, 1, 1, 1] or [b + 1] "
                                 f"with b = {b} (one offset per sequence and the end), got {dims}")
            if off._data_type not in _INDEX_DTS:
                raise GraphError(f"{w}: {what} ({off.label()}) must be INT32 (or INT64), got "
                                 f"{off._data_type.name}")
            if off._virtual:
                raise GraphError(f"{w}: {what} ({off.label()}) is virtual; it must be a graph input the "
                                 f"variant pack provides")
            if t._dim and t._stride and len(t._stride) == 4 and t._stride[2] <= 0:
                raise GraphError(f"{w}: {role} {t.label()} has a ragged offset but stride {t._stride[2]} "
                                 f"along the sequence dim; offsets are counted in tokens of that stride")
        self.ragged = ragged

    def _check_ragged_outputs(self) -> None:
        """A packed output must keep each token's heads x head dim inside its token stride
        (BSHD-like strides): with any other strides the packed tokens would overlap."""
        w = self.where
        for role, t in self.ragged.items():
            if role not in self.outputs:
                continue
            _, h, _, dd = t._dim
            _, sh, ss, sd = t._stride
            (s_in, n_in), (s_out, n_out) = sorted(((sd, dd), (sh, h)))
            disjoint = n_out == 1 or s_out >= (n_in - 1) * s_in + 1
            if not disjoint or ss < (h - 1) * sh + (dd - 1) * sd + 1:
                raise GraphError(f"{w}: {role} {t.label()} has a ragged offset but strides {t._stride} for "
                                 f"dims {t._dim}: packed tokens would overlap; give it token-major (BSHD) "
                                 f"strides [s*h*d, d, h*d, 1], e.g. set_stride like q")

    def _ragged_reqs(self, reqs: List[Req], feats: List[str]) -> Tuple[str, ...]:
        """Add a ``ragged_<role>`` req (its offsets) for each packed role in ``reqs``; the roles."""
        if not self.ragged:
            return ()
        roles = tuple(r.role for r in reqs if r.role in self.ragged)
        for role in roles:
            off = self.ragged[role]._ragged_offset
            n = off._dim[0]
            reqs.append(_req(off, f"ragged_{role}", self.where, alt=[[n], [n, 1, 1, 1]]))
        feats.append("ragged")
        return roles

    def _mask_static(self) -> Tuple[Dict[str, object], List[str]]:
        """Functional kwargs of the mask options (fixed at build), and the features used."""
        kw, feats = {}, []
        align, left, right = self.band
        if left is not None or right is not None:
            feats.append("band")
            if left is None and right == 0:
                kw["causal"] = True
            else:
                kw["window"] = (-1 if left is None else left, -1 if right is None else right)
            if align != "top_left":
                kw["causal_alignment"] = align
        if self.padding:
            feats.append("padding")
        if "bias" in self.inputs:
            feats.append("bias")
        if self.alibi:
            kw["alibi"] = True
            feats.append("alibi")
        if self.dropout is not None:
            kw["dropout_p"] = self.dropout.p
            if not isinstance(self.dropout.seed, tensor):
                kw["dropout_seed"] = self.dropout.seed
            if not isinstance(self.dropout.offset, tensor):
                kw["dropout_offset"] = self.dropout.offset
            feats.append("dropout")
        if "rng_dump" in self.outputs:
            feats.append("rng_dump")
        if self.scale is not None:
            kw["attn_scale"] = self.scale
        return kw, feats

    def _common_reqs(self, reqs: List[Req]):
        w = self.where
        if "bias" in self.inputs:
            reqs.append(_req(self.inputs["bias"], "bias", w))
        for role in ("seq_len_q", "seq_len_kv"):
            if role in self.inputs:
                b = self.inputs[role]._dim[0]
                # cuDNN promotes [b] to [b, 1, 1, 1]; either shape is accepted in the pack
                reqs.append(_req(self.inputs[role], role, w, alt=[[b], [b, 1, 1, 1]]))
        for role in ("attn_scale", "dropout_seed", "dropout_offset"):
            if role in self.inputs:
                reqs.append(_req(self.inputs[role], role, w, host_ok=True))
        if "rng_dump" in self.outputs:
            reqs.append(_req(self.outputs["rng_dump"], "rng_dump", w))

    def used_tensors(self):
        return list(self.inputs.values()) + list(self.outputs.values())


class SdpaNode(_Node):
    """``graph.sdpa``: O [b, h_q, s_q, d_v] and Stats fp32 [b, h_q, s_q, 1] from Q, K, V."""

    op_name = "sdpa"
    packed_roles = ("q", "k", "v", "o")

    def __init__(self, graph, name, *, q, k, v, is_inference, attn_scale, bias, block_mask, use_alibi_mask,
                 use_padding_mask, seq_len_q, seq_len_kv, use_causal_mask, use_causal_mask_bottom_right,
                 sliding_window_length, diagonal_alignment_, left_bound, right_bound, dropout, dropout_seed,
                 dropout_offset, rng_dump, paged_attention_k_table, paged_attention_v_table,
                 paged_attention_max_seq_len_kv, max_total_seq_len_q, max_total_seq_len_kv, score_mod,
                 generate_stats, score_max, score_sum_exp, sink_token, cu_seq_len_q, cu_seq_len_kv,
                 stats_use_log2, kv_layout="dense"):
        super().__init__(graph, name)
        w = self.where
        for role, val in (("q", q), ("k", k), ("v", v)):
            if val is None:
                raise GraphError(f"{w}: {role} is required")
            self._input(role, val)
        # Inputs register in the order the op's signature lists them, which is the positional order
        # of a cudnn.Graph call: the seeds' sdpa_with_paged_cache(q, k, v, page_table, ...) reads the
        # table fourth, cuDNN's sdpa lists its tables last.
        if kv_layout == "paged_nshd":
            self._input("page_table_k", paged_attention_k_table, "page_table")
            self._input("page_table_v", paged_attention_v_table, "page_table_v")
        self._common_args(attn_scale=attn_scale, bias=bias, use_alibi_mask=use_alibi_mask,
                          use_padding_mask=use_padding_mask, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
                          use_causal_mask=use_causal_mask, use_causal_mask_bottom_right=use_causal_mask_bottom_right,
                          sliding_window_length=sliding_window_length, diagonal_alignment_=diagonal_alignment_,
                          left_bound=left_bound, right_bound=right_bound, dropout=dropout,
                          dropout_seed=dropout_seed, dropout_offset=dropout_offset, rng_dump=rng_dump)
        self.generate_stats = parse_stats_flag(w, is_inference, generate_stats)
        # paging
        self.kv_layout = kv_layout
        if kv_layout != "paged_nshd":
            self._input("page_table_k", paged_attention_k_table, "paged_attention_k_table")
            self._input("page_table_v", paged_attention_v_table, "paged_attention_v_table")
        self.paged = kv_layout != "dense" or "page_table_k" in self.inputs or "page_table_v" in self.inputs
        if self.paged and self.kv_layout == "dense":
            self.kv_layout = "paged"
        if paged_attention_max_seq_len_kv is not None:
            if not _is_int(paged_attention_max_seq_len_kv) or paged_attention_max_seq_len_kv <= 0:
                raise GraphError(f"{w}: paged_attention_max_seq_len_kv must be an int > 0, got "
                                 f"{paged_attention_max_seq_len_kv!r}")
            if not self.paged:
                raise GraphError(f"{w}: paged_attention_max_seq_len_kv is set but no page table is given")
        self.max_seq_len_kv = paged_attention_max_seq_len_kv
        # cuDNN sizes its ragged workspace with these; the packed path allocates its own
        self.max_total_seq_len_q, self.max_total_seq_len_kv = max_total_seq_len_q, max_total_seq_len_kv
        # arguments fusedattn does not run
        self._unsupported_arg("block_mask", block_mask, "block-sparse masks are not supported")
        self._unsupported_arg("score_mod", score_mod, "score-modifier callbacks are not supported")
        self._unsupported_arg("score_max", score_max, "separate max/sum-exp outputs are not supported; use generate_stats")
        self._unsupported_arg("score_sum_exp", score_sum_exp, "use generate_stats (log-sum-exp)")
        self._unsupported_arg("sink_token", sink_token, "attention sinks are not supported")
        self._unsupported_arg("cu_seq_len_q", cu_seq_len_q, "give packed variable lengths as ragged offsets "
                              "(q.set_ragged_offset(...)) with use_padding_mask")
        self._unsupported_arg("cu_seq_len_kv", cu_seq_len_kv, "give packed variable lengths as ragged offsets "
                              "(k/v.set_ragged_offset(...)) with use_padding_mask")
        self._unsupported_arg("stats_use_log2", stats_use_log2, "stats are natural-log log-sum-exp")
        if self.paged and self.dropout is not None:
            self.unsupported.append("dropout with paged K/V caches (the mask's key index is ambiguous)")
        self.o = self._new_output("o", "O")
        self.stats = self._new_output("stats", "Stats") if self.generate_stats else None

    # -- validate ---------------------------------------------------------------------------
    def validate(self, ctx):
        """Check dims against each other, infer O / Stats (dims, strides, data types)."""
        w, io_dt = self.where, ctx.io_data_type
        q, k, v = self.inputs["q"], self.inputs["k"], self.inputs["v"]
        b, h_q, s_q, d = need_dims(q, "q", w)
        kd, vd = need_dims(k, "k", w), need_dims(v, "v", w)
        if self.kv_layout == "paged_nshd":
            # the seeds' containers [num_pages, page_size, h, d]
            kd = [kd[0], kd[2], kd[1], kd[3]]
            vd = [vd[0], vd[2], vd[1], vd[3]]
        _, h_k, s_k, d_k = kd
        _, h_v, s_v, d_v = vd
        if d_k != d:
            raise GraphError(f"{w}: k {k.label()} has head dim {d_k} but q {q.label()} has {d} "
                             f"(dims q {q._dim}, k {k._dim})")
        if h_k != h_v:
            raise cudnnGraphNotSupportedError(f"{w}: k has {h_k} heads and v has {h_v}; fusedattn needs "
                                              f"the same key/value head count")
        self.h_kv = h_k
        if not self.paged:
            if kd[0] != b or vd[0] != b:
                raise GraphError(f"{w}: batch sizes differ: q {q._dim}, k {k._dim}, v {v._dim}")
            if s_v != s_k:
                raise GraphError(f"{w}: k and v must have the same sequence length: k {k._dim}, v {v._dim}")
            s_kv = s_k
        else:
            s_kv = self._validate_paging(b, kd, vd)
        self.dims = (b, h_q, s_q, s_kv, d, d_v)
        dts = {}
        for role, t in (("q", q), ("k", k), ("v", v)):
            dts[role] = resolve_dt(t, role, w, io_dt)
        if not (dts["q"] == dts["k"] == dts["v"]):
            raise GraphError(f"{w}: q, k, v must share a data type; got q {dts['q'].name}, k {dts['k'].name}, "
                             f"v {dts['v'].name}")
        check_float_io(dts, w)
        self._validate_common(ctx, b, h_q, s_q, s_kv, d, d_v, io_dt)
        # outputs
        # O defaults to Q's type (cuDNN says io_data_type; they agree unless Q is typed otherwise,
        # and then Q's type is the one fusedattn can write)
        # a packed O defaults to Q's (token-major) layout: packed BHSD strides would overlap its tokens
        o_dims = [b, h_q, s_q, d_v]
        infer_output(self.o, "O", w, o_dims, dense_strides_like(o_dims, q._stride) if "o" in self.ragged
                     else packed_strides(o_dims), dts["q"])
        if self.o._data_type != dts["q"]:
            raise cudnnGraphNotSupportedError(
                f"{w}: O {self.o.label()} is {self.o._data_type.name} but q is {dts['q'].name}; fusedattn "
                f"writes O in the inputs' data type")
        if self.stats is not None:
            s_dims = [b, h_q, s_q, 1]
            infer_output(self.stats, "Stats", w, s_dims, dense_strides_like(s_dims, q._stride)
                         if "stats" in self.ragged else packed_strides(s_dims), data_type.FLOAT)
            if self.stats._data_type != data_type.FLOAT:
                raise GraphError(f"{w}: Stats {self.stats.label()} must be FLOAT (fp32 log-sum-exp), got "
                                 f"{self.stats._data_type.name}")
        self._check_ragged_outputs()
        # Last, so malformed graphs report their own error. Where cuDNN refuses (Hopper, cuDNN 9.19):
        # its validate() wants head dims that are multiples of 8; larger ones than it runs pass
        # validate and fail at check_support, where `probe` checks our upper limit.
        why = head_dims_unsupported(d, d_v, limit=False)
        if why:
            raise cudnnGraphNotSupportedError(f"{w}: {why}")

    def _validate_paging(self, b, kd, vd) -> int:
        w = self.where
        tables = {}
        for role in ("page_table_k", "page_table_v"):
            if role not in self.inputs:
                raise cudnnGraphNotSupportedError(
                    f"{w}: only one of paged_attention_k_table / paged_attention_v_table is given; fusedattn "
                    f"pages K and V together (missing {role.replace('page_table', 'paged_attention')}_table)")
            t = self.inputs[role]
            if self.kv_layout == "paged_nshd":
                dims = need_dims(t, "page_table", w, rank=2)
                if dims[0] != b:
                    raise GraphError(f"{w}: page_table {t.label()} must have dims [b, blocks_per_seq] with "
                                     f"b = {b}, got {dims}")
                tables[role] = dims[1]
            else:
                dims = need_dims(t, role, w)
                if dims[0] != b or dims[1] != 1 or dims[3] != 1:
                    raise GraphError(f"{w}: {role} {t.label()} must have dims [b, 1, max_blocks_per_seq, 1] "
                                     f"with b = {b}, got {dims}")
                tables[role] = dims[2]
            if t._data_type not in _INDEX_DTS:
                raise GraphError(f"{w}: {role} {t.label()} must be INT32, got {t._data_type.name}")
        cap = min(tables["page_table_k"] * kd[2], tables["page_table_v"] * vd[2])
        if self.max_seq_len_kv is not None:
            if self.max_seq_len_kv > cap:
                raise GraphError(f"{w}: paged_attention_max_seq_len_kv = {self.max_seq_len_kv} exceeds what "
                                 f"the page tables cover ({cap} = blocks x block size)")
            return self.max_seq_len_kv
        return cap

    # -- lower ------------------------------------------------------------------------------
    def lower(self, ctx) -> Call:
        """The execute-time description of this node (uids, checks, fixed kwargs)."""
        w = self.where
        b, h_q, s_q, s_kv, d, d_v = self.dims
        reqs = [_req(self.inputs[r], r, w) for r in ("q", "k", "v")]
        for role in ("page_table_k", "page_table_v"):
            if role in self.inputs:
                reqs.append(_req(self.inputs[role], role, w))
        self._common_reqs(reqs)
        consumed = ctx.consumed_uids
        reqs.append(_req(self.o, "o", w, scratch=self.o._virtual))
        static, feats = self._mask_static()
        if self.stats is not None and (not self.stats._virtual or self.stats._uid in consumed):
            reqs.append(_req(self.stats, "stats", w, scratch=self.stats._virtual))
            static["return_stats"] = True
            feats.append("stats")
        if self.paged:
            feats.append("paged")
        ragged_roles = self._ragged_reqs(reqs, feats)
        call = Call(kind="fwd", where=w, reqs=reqs, static=static, features=tuple(feats),
                    scale_role="attn_scale" in self.inputs, seed_role="dropout_seed" in self.inputs,
                    offset_role="dropout_offset" in self.inputs,
                    kv_layout=self.kv_layout, table_layout="bn" if self.kv_layout == "paged_nshd" else "b1n1",
                    max_seq_len_kv=self.max_seq_len_kv if self.paged else None, ragged_roles=ragged_roles)
        _finish_call(call, self, s_kv)
        return call


class SdpaBackwardNode(_Node):
    """``graph.sdpa_backward``: dQ, dK, dV (and dBias) from Q, K, V, O, dO and the forward's Stats."""

    op_name = "sdpa_backward"
    packed_roles = ("q", "k", "v", "o", "dO", "dQ", "dK", "dV")

    def __init__(self, graph, name, *, q, k, v, o, dO, stats, attn_scale, bias, dBias, use_alibi_mask,
                 use_padding_mask, seq_len_q, seq_len_kv, max_total_seq_len_q, max_total_seq_len_kv,
                 use_causal_mask, use_causal_mask_bottom_right, sliding_window_length, diagonal_alignment_,
                 left_bound, right_bound, dropout, dropout_seed, dropout_offset, rng_dump,
                 use_deterministic_algorithm, score_mod, score_mod_bprop, sink_token, dSink_token):
        super().__init__(graph, name)
        w = self.where
        for role, val in (("q", q), ("k", k), ("v", v), ("o", o), ("dO", dO), ("stats", stats)):
            if val is None:
                raise GraphError(f"{w}: {role} is required")
            self._input(role, val)
        self._common_args(attn_scale=attn_scale, bias=bias, use_alibi_mask=use_alibi_mask,
                          use_padding_mask=use_padding_mask, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
                          use_causal_mask=use_causal_mask, use_causal_mask_bottom_right=use_causal_mask_bottom_right,
                          sliding_window_length=sliding_window_length, diagonal_alignment_=diagonal_alignment_,
                          left_bound=left_bound, right_bound=right_bound, dropout=dropout,
                          dropout_seed=dropout_seed, dropout_offset=dropout_offset, rng_dump=rng_dump,
                          dbias=dBias)
        if use_deterministic_algorithm is None:
            use_deterministic_algorithm = False      # cuDNN's pygraph: None = not given = its default
        if not isinstance(use_deterministic_algorithm, bool):
            raise GraphError(f"{w}: use_deterministic_algorithm must be a bool, got {use_deterministic_algorithm!r}")
        self.deterministic = use_deterministic_algorithm
        for nm, val in (("max_total_seq_len_q", max_total_seq_len_q), ("max_total_seq_len_kv", max_total_seq_len_kv)):
            if val is not None and (not _is_int(val) or val <= 0):
                raise GraphError(f"{w}: {nm} must be an int > 0, got {val!r}")
        # cuDNN sizes its ragged workspace with these; the packed path allocates its own
        self.max_total_seq_len_q, self.max_total_seq_len_kv = max_total_seq_len_q, max_total_seq_len_kv
        self._unsupported_arg("score_mod", score_mod, "score-modifier callbacks are not supported")
        self._unsupported_arg("score_mod_bprop", score_mod_bprop, "score-modifier callbacks are not supported")
        self._unsupported_arg("sink_token", sink_token, "attention sinks are not supported")
        self._unsupported_arg("dSink_token", dSink_token, "attention sinks are not supported")
        self.dq = self._new_output("dQ", "dQ")
        self.dk = self._new_output("dK", "dK")
        self.dv = self._new_output("dV", "dV")
        self.paged = False

    def validate(self, ctx):
        """Check dims against each other, infer dQ / dK / dV like Q / K / V."""
        w, io_dt = self.where, ctx.io_data_type
        q, k, v, o, do, st = (self.inputs[r] for r in ("q", "k", "v", "o", "dO", "stats"))
        b, h_q, s_q, d = need_dims(q, "q", w)
        kb, h_k, s_kv, d_k = need_dims(k, "k", w)
        vb, h_v, s_v, d_v = need_dims(v, "v", w)
        if kb != b or vb != b:
            raise GraphError(f"{w}: batch sizes differ: q {q._dim}, k {k._dim}, v {v._dim}")
        if d_k != d:
            raise GraphError(f"{w}: k {k.label()} has head dim {d_k} but q {q.label()} has {d}")
        if s_v != s_kv:
            raise GraphError(f"{w}: k and v must have the same sequence length: k {k._dim}, v {v._dim}")
        if h_k != h_v:
            raise cudnnGraphNotSupportedError(f"{w}: k has {h_k} heads and v has {h_v}; fusedattn needs "
                                              f"the same key/value head count")
        self.h_kv = h_k
        for role, t in (("o", o), ("dO", do)):
            dims = need_dims(t, role, w)
            if dims != [b, h_q, s_q, d_v]:
                raise GraphError(f"{w}: {role} {t.label()} must have dims [b, h_q, s_q, d_v] = "
                                 f"{[b, h_q, s_q, d_v]}, got {dims}")
        sdims = need_dims(st, "stats", w)
        if sdims != [b, h_q, s_q, 1]:
            raise GraphError(f"{w}: stats {st.label()} must have dims [b, h_q, s_q, 1] = {[b, h_q, s_q, 1]}, "
                             f"got {sdims}")
        self.dims = (b, h_q, s_q, s_kv, d, d_v)
        dts = {r: resolve_dt(t, r, w, io_dt) for r, t in (("q", q), ("k", k), ("v", v), ("o", o), ("dO", do))}
        if len(set(dts.values())) != 1:
            raise GraphError(f"{w}: q, k, v, o, dO must share a data type; got "
                             + ", ".join(f"{r} {dt.name}" for r, dt in dts.items()))
        check_float_io(dts, w)
        resolve_dt(st, "stats", w, data_type.FLOAT)
        if st._data_type != data_type.FLOAT:
            raise GraphError(f"{w}: stats {st.label()} must be FLOAT (the forward's fp32 log-sum-exp), got "
                             f"{st._data_type.name}")
        self._validate_common(ctx, b, h_q, s_q, s_kv, d, d_v, io_dt)
        if "dBias" in self.outputs:
            t = self.outputs["dBias"]
            check_broadcast(t, "dBias", w, [b, h_q, s_q, s_kv], "[b, h_q, s_q, s_kv]")
            resolve_dt(t, "dBias", w, io_dt)
            if t._data_type not in _FLOAT_DTS:
                raise GraphError(f"{w}: dBias {t.label()} must be a float type, got {t._data_type.name}")
            if self.inputs["bias"]._data_type == data_type.BOOLEAN:
                raise GraphError(f"{w}: dBias is requested but bias is BOOLEAN (a mask has no gradient)")
            if t._virtual:
                raise GraphError(f"{w}: dBias {t.label()} is virtual; it must be a tensor the variant pack provides")
        grad_dt = dts["q"]
        for out, src, role in ((self.dq, q, "dQ"), (self.dk, k, "dK"), (self.dv, v, "dV")):
            infer_output(out, role, w, src._dim, dense_strides_like(src._dim, src._stride), grad_dt)
            if out._data_type != grad_dt:
                raise cudnnGraphNotSupportedError(
                    f"{w}: {role} {out.label()} is {out._data_type.name} but q is {grad_dt.name}; fusedattn "
                    f"writes gradients in the inputs' data type")
        self._check_ragged_outputs()
        # Last, so malformed graphs report their own error. cuDNN's backward validate() refuses
        # head dims it cannot run (multiples of 8 up to 256 on Hopper): so does ours.
        why = head_dims_unsupported(d, d_v)
        if why:
            raise cudnnGraphNotSupportedError(f"{w}: {why}")

    def lower(self, ctx) -> Call:
        """The execute-time description of this node (uids, checks, fixed kwargs)."""
        w = self.where
        b, h_q, s_q, s_kv, d, d_v = self.dims
        reqs = [_req(self.inputs[r], r, w) for r in ("q", "k", "v", "o", "dO", "stats")]
        self._common_reqs(reqs)
        for role, t in (("dQ", self.dq), ("dK", self.dk), ("dV", self.dv)):
            reqs.append(_req(t, role, w, scratch=t._virtual))
        static, feats = self._mask_static()
        static["deterministic"] = self.deterministic
        feats.append("deterministic")
        if "dBias" in self.outputs:
            reqs.append(_req(self.outputs["dBias"], "dBias", w))
            static["need_dbias"] = True
            feats.append("dbias")
        ragged_roles = self._ragged_reqs(reqs, feats)
        call = Call(kind="bwd", where=w, reqs=reqs, static=static, features=tuple(feats),
                    scale_role="attn_scale" in self.inputs, seed_role="dropout_seed" in self.inputs,
                    offset_role="dropout_offset" in self.inputs, ragged_roles=ragged_roles)
        _finish_call(call, self, s_kv)
        return call


class Fp8Node(_Node):
    """``graph.sdpa_fp8`` / ``graph.sdpa_fp8_backward``: cuDNN's FP8 attention, which fusedattn cannot
    run yet. The call takes cuDNN's arguments (graph tensors are checked and recorded, the outputs
    are made, so the graph reads as in cuDNN) and ``validate`` (so ``check_support`` / ``build``)
    raises ``cudnnGraphNotSupportedError``, on which cuDNN code skips the configuration.

    ``args``: every argument of the call by name; ``required``: the ones that must be graph tensors;
    ``outputs``: (role, cuDNN output name) pairs, with ``stats`` made only when stats are generated.
    """

    # tensors the op writes rather than reads (cuDNN passes their descriptors as arguments)
    _WRITTEN = ("rng_dump", "score_max", "score_sum_exp", "dSink_token")

    def __init__(self, graph, name, op_name, args, required, outputs):
        self.op_name = op_name
        super().__init__(graph, name)
        w = self.where
        for role in required:
            if args[role] is None:
                raise GraphError(f"{w}: {role} is required")
        for role, val in args.items():
            if role == "dropout" and isinstance(val, (tuple, list)):    # (p, seed, offset) / (mask, scale)
                for i, x in enumerate(val):
                    if isinstance(x, (tensor, torch.Tensor)):
                        self._input(f"dropout_{i}", x, "dropout")
            elif isinstance(val, (tensor, torch.Tensor)):
                (self._written if role in self._WRITTEN else self._input)(role, val)
        # the forward's Stats exist only when stats are generated (cuDNN returns None otherwise)
        stats = "is_inference" in args and parse_stats_flag(w, args["is_inference"], args["generate_stats"])
        self.results = [self._new_output(role, cudnn_name) if role != "stats" or stats else None
                        for role, cudnn_name in outputs]

    def validate(self, ctx):
        raise cudnnGraphNotSupportedError(
            f"{self.where}: FP8 attention is not supported by fusedattn yet; use sdpa / sdpa_backward with "
            f"HALF or BFLOAT16 tensors")


def _finish_call(call: Call, node: _Node, s_kv: int):
    """Record declared dims/dtypes (for the support probe) and the static key of the call."""
    for r in call.reqs:
        call.dims[r.role] = r.shape
        call.dts[r.role] = r.dtype
    b, h_q, s_q, _, d, d_v = node.dims
    call.dims["_sizes"] = (b, h_q, node.h_kv, s_q, s_kv, d, d_v)
    static_items = tuple(sorted((k, v if not isinstance(v, float) else "float")
                                for k, v in call.static.items()))
    # Shapes enter the key without b / s (they do not change what is supported), but the
    # broadcast pattern of bias-like tensors and the head dims do.
    shape_sig = tuple(sorted((r.role, tuple(x == 1 for x in r.shape), len(r.shape), str(r.dtype))
                             for r in call.reqs))
    call.probe_key = (call.kind, call.features, static_items, shape_sig, h_q, node.h_kv, d, d_v,
                      call.kv_layout, call.scale_role, call.seed_role, call.offset_role)
    # The paged block size can matter to the kernels: keep it in the key.
    if node.paged:
        kdims = call.dims["k"]
        call.probe_key += (kdims[1] if call.kv_layout == "paged_nshd" else kdims[2],)


# ---------------------------------------------------------------------------------------------
# running a call
# ---------------------------------------------------------------------------------------------

def _functional():
    """The functional layer, imported late so the Graph door imports even while it is absent."""
    from .. import functional
    return functional


_PARAMS_CACHE: Dict[object, Optional[frozenset]] = {}


def _signature_params(fn):
    """The keyword names ``fn`` accepts, or None when it takes ``**kwargs`` (or is opaque).
    Cached per function: ``inspect.signature`` costs tens of microseconds, execute must not."""
    try:
        return _PARAMS_CACHE[fn]
    except KeyError:
        pass
    try:
        params = inspect.signature(fn).parameters
        names = None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) \
            else frozenset(params)
    except (TypeError, ValueError):
        names = None
    _PARAMS_CACHE[fn] = names
    return names


def _host_scalar(t: torch.Tensor, as_int: bool):
    # One host read per execute; cuDNN reads pass-by-value scalars on the host too.
    x = t.reshape(-1)[0].item()
    return int(x) if as_int else float(x)


def _options(call: Call, t: Dict[str, torch.Tensor], feats) -> Dict[str, object]:
    """The functional keyword arguments of ``feats``: the call's fixed ones, and the scalars read
    from their tensors (attn_scale, dropout seed / offset)."""
    kw = {}
    for key, val in call.static.items():
        if key in ("causal", "window", "causal_alignment") and "band" not in feats:
            continue
        if key == "alibi" and "alibi" not in feats:
            continue
        if key.startswith("dropout") and "dropout" not in feats:
            continue
        if key == "return_stats" and "stats" not in feats:
            continue
        if key == "need_dbias" and "dbias" not in feats:
            continue
        if key == "deterministic" and "deterministic" not in feats:
            continue
        kw[key] = val
    if call.scale_role:
        kw["attn_scale"] = _host_scalar(t["attn_scale"], as_int=False)
    if "dropout" in feats:
        if call.seed_role:
            kw["dropout_seed"] = _host_scalar(t["dropout_seed"], as_int=True)
        if call.offset_role:
            kw["dropout_offset"] = _host_scalar(t["dropout_offset"], as_int=True)
    return kw


def _check_params(fn, kw) -> None:
    params = _signature_params(fn)
    if params is not None:
        # a keyword the functional layer does not have yet is a feature it does not support
        missing = [key for key in kw if key not in params]
        if missing:
            raise NotSupportedError(f"{fn.__name__} has no argument {', '.join(missing)} yet")


def _write_rng_dump(t: Dict[str, torch.Tensor], kw) -> None:
    """The kept mask (1 kept, 0 dropped) of the call's dropout, padded [b, h_q, s_q, s_kv]."""
    from ..backends.cpu import dropout_keep_mask
    rd = t["rng_dump"]
    b_, h_, sq_, skv_ = rd.shape
    rd.copy_(dropout_keep_mask(b_, h_, sq_, skv_, kw["dropout_p"], kw.get("dropout_seed", 0),
                               kw.get("dropout_offset", 0), rd.device))


def build_invocation(call: Call, t: Dict[str, torch.Tensor], feats=None):
    """``(function, args, kwargs, post)`` for the functional layer from role -> torch tensor.

    ``feats`` restricts the features (the support probe uses it); ``None`` = all of the call's.
    ``post`` is run after the function with its result (rng_dump, dBias copies).
    """
    feats = set(call.features if feats is None else feats)
    if "ragged" in feats:
        # the probe keeps a packed binding apart from its dense tiny tensors
        return _ragged_invocation(call, t.get("_ragged", t), feats)
    fn_mod = _functional()
    kw = _options(call, t, feats)
    if "padding" in feats:
        for role in ("seq_len_q", "seq_len_kv"):
            if role in t:
                kw[role] = t[role]
    if "bias" in feats:
        kw["attn_bias"] = t["bias"]
    k, v = t["k"], t["v"]
    if "paged" in feats:
        pk, pv = t["page_table_k"], t["page_table_v"]
        if call.kv_layout == "paged_nshd":
            # The seeds' containers [num_pages, page_size, h, d] seen as [num_pages, h, page_size, d]
            # (a view), and page tables [b, n] as [b, 1, n, 1] (a view).
            k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
            pk, pv = pk[:, None, :, None], pv[:, None, :, None]
        kw["page_table_k"], kw["page_table_v"] = pk, pv
        if call.max_seq_len_kv is not None and "seq_len_kv" not in kw:
            cap = min(pk.shape[2] * k.shape[2], pv.shape[2] * v.shape[2])
            if call.max_seq_len_kv < cap:
                # cuDNN's max_seq_len_kv bounds every sequence; a constant length says the same.
                b = t["q"].shape[0]
                kw["seq_len_kv"] = torch.full((b,), call.max_seq_len_kv, dtype=torch.int32, device=k.device)
    elif call.kv_layout != "dense":
        # probe without paging: the tiny inputs carry dense k/v under these roles
        k, v = t["k_dense"], t["v_dense"]
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
    kw["backend"] = backend
    # cuDNN reads seq_len_q / seq_len_kv at execute without checking their values (no host sync, and a
    # graph may be replayed inside a CUDA graph): the functional door's per-call value check is off here
    kw["validate"] = False
    _check_params(fn, kw)

    def post(result):
        if "rng_dump" in feats:
            _write_rng_dump(t, kw)
        if call.kind == "bwd" and "dbias" in feats:
            dbias = result[3]
            if dbias is None:
                raise NotSupportedError("attention_backward returned no dbias for need_dbias=True")
            target = t["dBias"]
            if tuple(dbias.shape) != tuple(target.shape):
                dbias = dbias.sum_to_size(target.shape)   # reduce over the dims the bias broadcasts
            target.copy_(dbias)

    return fn, args, kw, post


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
    views = {}
    for role in call.ragged_roles:
        r, x = reqs[role], t[role]
        seq = seqs["q"] if role in _Q_SIDE else seqs["k"]
        total = seq[-1]
        _, h, _, dd = r.shape
        _, hs, tok, ds = r.stride
        start = tokens[role][0] * tok
        need = start + (total - 1) * tok + (h - 1) * hs + (dd - 1) * ds + 1 if total else 0
        if need > _span(x):
            raise GraphError(f"{w}: {role} {r.label} is too small for its ragged offsets: {total} tokens from "
                             f"element {start} in strides {list(r.stride)} reach {need} elements, but the bound "
                             f"tensor (shape {list(x.shape)}, strides {list(x.stride())}) spans {_span(x)}")
        # the bound buffer may be [total, h, d], flat, or the declared [b, h, s, d]: only its
        # memory is used, through the graph's strides
        v = x.as_strided((total, h, dd), (tok, hs, ds), x.storage_offset() + start)
        views[role] = v[..., 0] if role == "stats" else v
    dev = t["q"].device
    return _Packed(views=views, cu_q=torch.tensor(seqs["q"], dtype=torch.int32, device=dev),
                   cu_kv=torch.tensor(seqs["k"], dtype=torch.int32, device=dev), lens_q=lens_q,
                   lens_kv=lens_kv, max_q=max_q, max_kv=max_kv)


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
            out, lse = result
            if "o" in views:           # a virtual O nobody reads may be unpacked: not written
                views["o"].copy_(out)
            if "stats" in feats and "stats" in t:
                if "stats" in views:
                    views["stats"].copy_(lse.t())
                else:
                    # padded Stats [b, h, s, 1]: rows past a sequence's length get 0
                    target = t["stats"][..., 0]
                    target.zero_()
                    if lse.numel():
                        seq, pos = _padded_index(pk.lens_q, target.device)
                        target[seq, :, pos] = lse.t()
        else:
            for role, g in zip(("dQ", "dK", "dV"), result):
                if role in views:
                    views[role].copy_(g)
        if "rng_dump" in feats:
            _write_rng_dump(t, kw)

    return fn, args, kw, post


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
    t = {"_backend": backend, "q": rnd((1, h_q, sq, d), qdt)}
    if call.kv_layout == "dense":
        skv = min(s_kv, 5)
        t["k"] = rnd((1, h_kv, skv, d), qdt)
        t["v"] = rnd((1, h_kv, skv, d_v), qdt)
    else:
        kdims = call.dims["k"]
        bs = kdims[1] if call.kv_layout == "paged_nshd" else kdims[2]
        skv = bs
        if call.kv_layout == "paged_nshd":
            t["k"] = rnd((1, bs, h_kv, d), qdt)
            t["v"] = rnd((1, bs, h_kv, d_v), qdt)
            tshape = (1, 1)
        else:
            t["k"] = rnd((1, h_kv, bs, d), qdt)
            t["v"] = rnd((1, h_kv, bs, d_v), qdt)
            tshape = (1, 1, 1, 1)
        t["page_table_k"] = torch.zeros(tshape, dtype=dts["page_table_k"], device=device)
        t["page_table_v"] = torch.zeros(tshape, dtype=dts["page_table_v"], device=device)
        t["k_dense"] = rnd((1, h_kv, skv, d), qdt)
        t["v_dense"] = rnd((1, h_kv, skv, d_v), qdt)
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
    ``MAX_HEAD_DIM`` or not multiples of 8, and DOUBLE off the CPU (the CPU path has it for
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
