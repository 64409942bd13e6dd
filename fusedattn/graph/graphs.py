"""``pygraph``: cuDNN frontend's graph object, for its SDPA operations.

The life of a graph, as in cuDNN::

    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF,
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    q = graph.tensor_like(q_gpu)                      # or graph.tensor(dim=, stride=, data_type=)
    ...
    o, stats = graph.sdpa(q=q, k=k, v=v, attn_scale=0.125, generate_stats=False, use_causal_mask=True)
    o.set_output(True).set_dim(dims).set_stride(strides)
    graph.validate(); graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support(); graph.build_plans()        # or graph.build([cudnn.heur_mode.A])
    workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
    graph.execute({q: q_gpu, k: k_gpu, v: v_gpu, o: o_gpu}, workspace, handle)

What each step does here: ``validate`` checks dims, infers outputs and assigns uids;
``build_operation_graph`` lowers every node to one functional call (cached); ``check_support``
runs each call once on tiny inputs to learn whether fusedattn can run it (cached per static
problem); ``build_plans`` freezes the graph. ``execute`` only binds and checks the variant pack
and calls the functional layer. Steps run implicitly when skipped (a lenient superset of cuDNN,
which demands the order); ``execute`` before ``build_plans`` is an error.
"""
from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .enums import attention_implementation, data_type, heur_mode, to_data_type
from .enums import diagonal_alignment as _alignment   # the methods' parameter shadows the name
from .errors import GraphError, cudnnGraphNotSupportedError
from .execute import invoke
from .handle import Handle, create_handle
from .nodes import SdpaBackwardNode, SdpaNode
from .support import probe
from .tensors import tensor

__all__ = ["pygraph"]

_OPEN, _VALIDATED, _LOWERED, _PLANNED, _SUPPORTED, _BUILT = range(6)

_DEFAULT_HANDLE: Optional[Handle] = None

# The functional backend of graphs built without ``backend=``: "auto" (Triton on a GPU, the CPU
# path on the CPU). Tests set it to "triton" to run unchanged cuDNN code through the Triton kernels
# under the interpreter.
DEFAULT_BACKEND = "auto"


def _default_handle() -> Handle:
    global _DEFAULT_HANDLE
    if _DEFAULT_HANDLE is None or _DEFAULT_HANDLE.destroyed:
        _DEFAULT_HANDLE = create_handle()
    return _DEFAULT_HANDLE


@dataclass
class _Ctx:
    """What nodes need from the graph while validating and lowering."""

    io_data_type: data_type
    consumed_uids: set = field(default_factory=set)


class pygraph:  # noqa: N801 (cuDNN's spelling: cudnn.pygraph)
    """A cuDNN-style graph of SDPA operations.

    Args (cuDNN's constructor, positionally identical):
        name: a label for messages.
        io_data_type: default data type of tensors that do not set one (``cudnn.data_type`` or a
            ``torch.dtype``); outputs default to it, else to Q's type.
        intermediate_data_type, compute_data_type: accepted; fusedattn computes the softmax and
            accumulates in fp32 whatever they say (never less precise than asked).
        handle: the default handle for ``execute``.
        is_override_shape_enabled: lets ``execute`` run the graph at other dims/strides
            (``override_uids`` / ``override_shapes`` / ``override_strides``), as cuDNN's THD and
            chunked-prefill code does to reuse one graph across batches of another maximum length.
        sm_count, sm_version, kernel_cache, device_property, is_dynamic_shape_enabled: accepted for
            compatibility and unused.
        backend: fusedattn's extension: ``"auto"`` (Triton on a GPU, the CPU path on the CPU),
            ``"triton"`` (forces the Triton kernel; on CPU tensors that is Triton's interpreter),
            or ``"cpu"``; passed to the functional layer. Default: ``DEFAULT_BACKEND`` ("auto").
    """

    def __init__(self, name="test_graph", io_data_type=None, intermediate_data_type=None,
                 compute_data_type=None, handle=None, sm_count=None, sm_version=None, kernel_cache=None,
                 device_property=None, is_dynamic_shape_enabled=False, is_override_shape_enabled=False,
                 *, backend=None, **kwargs):
        self.name = str(name)
        self._io_dt = to_data_type(io_data_type, "io_data_type")
        self._intermediate_dt = to_data_type(intermediate_data_type, "intermediate_data_type")
        self._compute_dt = to_data_type(compute_data_type, "compute_data_type")
        if handle is not None and not isinstance(handle, Handle):
            raise GraphError(f"pygraph: handle must come from create_handle(), got {type(handle).__name__}")
        self._handle = handle
        if backend is None:
            backend = DEFAULT_BACKEND
        if backend not in ("auto", "triton", "cpu"):
            raise GraphError(f"pygraph: backend must be 'auto', 'triton' or 'cpu', got {backend!r}")
        self._backend = backend
        self._extra_kwargs = dict(kwargs)    # future cuDNN options: accepted, unused
        self._tensors: List[tensor] = []
        self._nodes: list = []
        self._node_names: set = set()
        self._state = _OPEN
        self._calls: list = []
        self._heur_modes: Optional[list] = None
        self._uid_to_tensor: Dict[int, tensor] = {}
        self._workspace_size = 0          # the functional layer allocates its own scratch
        self._seen_inputs: List[tensor] = []   # graph inputs in the order operations first read them
        self._override_shape = bool(is_override_shape_enabled)
        self._inferred_uids: set = set()       # outputs whose dims validate inferred (not the user's)
        self._override_calls: dict = {}        # execute's overrides -> the calls lowered at those dims

    # ------------------------------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------------------------------
    def _is_built(self) -> bool:
        return self._state >= _BUILT

    def _invalidate(self) -> None:
        """A tensor or node changed before build: later steps must run again."""
        if self._state < _BUILT:
            self._state = _OPEN

    def _check_open(self, what: str) -> None:
        if self._state >= _BUILT:
            raise GraphError(f"graph {self.name!r}: cannot {what} after build_plans(); create a new graph")
        self._state = _OPEN

    # ------------------------------------------------------------------------------------------
    # tensors
    # ------------------------------------------------------------------------------------------
    def _new_tensor(self, **kw) -> tensor:
        t = tensor(self, **kw)
        self._tensors.append(t)
        return t

    def tensor(self, dim=None, stride=None, data_type=None, is_virtual=False, is_pass_by_value=False,
               ragged_offset=None, reordering_type=None, name="", uid=-1, ragged_offset_multiplier=1):
        """A graph input described by dims and strides (elements), e.g.
        ``graph.tensor(name="Q", dim=[b, h, s, d], stride=[h*s*d, s*d, d, 1], data_type=cudnn.data_type.HALF)``.

        ``data_type`` defaults to the graph's ``io_data_type``; ``uid`` keys the tensor in a
        uid-keyed variant pack (free uids are assigned at ``validate`` otherwise).
        """
        self._check_open("add a tensor")
        if ragged_offset_multiplier != 1:
            raise cudnnGraphNotSupportedError("tensor: ragged_offset_multiplier != 1 is not supported")
        return self._new_tensor(dim=dim, stride=stride, data_type=data_type, is_virtual=is_virtual,
                                is_pass_by_value=is_pass_by_value, ragged_offset=ragged_offset,
                                reordering_type=reordering_type, name=name, uid=uid)

    def tensor_like(self, like, name=""):
        """A graph input with the dims, strides and data type of ``like``: a torch tensor (any
        DLPack tensor), or another graph tensor (its description is copied, with a new uid).
        The torch tensor is not kept: only its description and device."""
        self._check_open("add a tensor")
        if isinstance(like, tensor):
            return self._new_tensor(dim=like._dim, stride=like._stride, data_type=like._data_type,
                                    is_pass_by_value=like._pass_by_value, name=name or like._name,
                                    device=like._device)
        if not isinstance(like, torch.Tensor):
            if hasattr(like, "__dlpack__"):
                like = torch.from_dlpack(like)
            else:
                raise GraphError(f"tensor_like expects a torch tensor (or a DLPack tensor) or a graph "
                                 f"tensor, got {type(like).__name__}")
        return self._new_tensor(dim=list(like.shape), stride=list(like.stride()),
                                data_type=to_data_type(like.dtype, "tensor_like"), name=name,
                                device=like.device)

    def query_tensor_attributes_of_uid(self, uid: int) -> tensor:
        """The graph tensor with ``uid`` (uids are assigned by ``validate``)."""
        try:
            return self._uid_to_tensor[uid]
        except KeyError:
            raise GraphError(f"graph {self.name!r}: no tensor has uid {uid}") from None

    # ------------------------------------------------------------------------------------------
    # operations
    # ------------------------------------------------------------------------------------------
    def _node_name(self, name: str, op: str) -> str:
        if not name:
            i = 0
            while f"{op}_{i}" in self._node_names:
                i += 1
            name = f"{op}_{i}"
        if name in self._node_names:
            raise GraphError(f"graph {self.name!r}: operation name {name!r} is already used")
        self._node_names.add(name)
        return name

    def _add_node(self, node) -> None:
        self._nodes.append(node)
        # node.order: the user tensors it reads, and those it writes (rng_dump, dBias: buffers the
        # user passes), in its signature order; outputs of earlier operations are not inputs
        for t in node.order:
            if t._producer is None and t not in self._seen_inputs:
                self._seen_inputs.append(t)

    def sdpa(self, q, k, v, is_inference=None, attn_scale=None, bias=None, block_mask=None,
             use_alibi_mask=False, use_padding_mask=False, seq_len_q=None, seq_len_kv=None,
             use_causal_mask=False, use_causal_mask_bottom_right=False, sliding_window_length=None,
             diagonal_alignment=_alignment.TOP_LEFT, diagonal_band_left_bound=None,
             diagonal_band_right_bound=None, dropout=None, rng_dump=None, paged_attention_k_table=None,
             paged_attention_v_table=None, paged_attention_max_seq_len_kv=None, max_total_seq_len_q=None,
             max_total_seq_len_kv=None, compute_data_type=data_type.NOT_SET, name="", score_mod=None,
             generate_stats=None, implementation=attention_implementation.AUTO, score_max=None,
             score_sum_exp=None, sink_token=None, unfuse_fma=False, cu_seq_len_q=None,
             cu_seq_len_kv=None, stats_use_log2=False, *, attn_bias=None, dropout_seed=None,
             dropout_offset=None, left_bound=None, right_bound=None, sliding_window=None, fn=None):
        """Scaled dot-product attention: ``softmax(attn_scale * Q K^T + bias [+ ALiBi], masked) V``.

        Args (cuDNN frontend 1.32's names, order and defaults: ``signatures.CUDNN_SIGNATURES``; every
        keyword also accepts None, meaning "not given", as cuDNN's ``pygraph`` does; all tensors are
        graph tensors of this graph):
            q: [b, h_q, s_q, d]. k: [b, h_kv, s_kv, d], v: [b, h_kv, s_kv, d_v]; any strides
                (BSHD memory seen through ``.transpose(1, 2)`` included). GQA/MQA when
                ``h_q % h_kv == 0``. With paging, k/v are containers [num_blocks, h_kv, block_size, d].
                k and v may have different head counts h_k != h_v, both dividing h_q (query head i
                reads k head ``i // (h_q // h_k)`` and v head ``i // (h_q // h_v)``, as cuDNN; dense or
                paged, not packed). Both run widened to ``lcm(h_k, h_v)`` heads: a single-head one as a
                stride-0 view, any other as a gather copy (one copy of it, or of its paged container, per
                execute).
            is_inference / generate_stats: stats are produced when ``generate_stats=True`` (or
                ``is_inference=False``); both may be given if they agree; neither means no stats.
            attn_scale: float or a one-element graph tensor; None applies no scale (cuDNN's rule).
            bias (alias ``attn_bias``): broadcastable to [b, h_q, s_q, s_kv] (each dim 1 or full),
                float, or BOOLEAN (True = keep).
            use_alibi_mask: ALiBi bias ``slope_h * (j - i)`` with the ALiBi paper's slopes.
            use_padding_mask + seq_len_q / seq_len_kv: per-sequence lengths, int32 [b, 1, 1, 1] or [b];
                padded query rows give output 0.
            use_causal_mask (top-left), use_causal_mask_bottom_right, diagonal_alignment,
                diagonal_band_left_bound (alias ``left_bound``; counts the diagonal, >= 1),
                diagonal_band_right_bound (alias ``right_bound``; >= 0), sliding_window_length
                (alias ``sliding_window``; same as the left bound): one diagonal band. For query i
                and alignment offset ``off`` (0 top-left, ``s_kv - s_q`` bottom-right) key j is kept iff
                ``i + off - (left_bound - 1) <= j <= i + off + right_bound``.
            dropout: ``p`` with ``dropout_seed=`` / ``dropout_offset=`` (ints or graph tensors), or
                ``(p, seed_tensor, offset_tensor)``. rng_dump: a [b, h_q, s_q, s_kv] graph tensor that
                receives the kept mask (1 kept, 0 dropped).
            paged_attention_k_table / paged_attention_v_table: int32 [b, 1, max_blocks_per_seq, 1];
                paged_attention_max_seq_len_kv: the kv length (default: blocks x block size).
            name: the operation's name (messages; output names ``name::O``, ``name::Stats``).
            Accepted and ignored: compute_data_type (compute is fp32), implementation, unfuse_fma,
            max_total_seq_len_q/kv. Recorded and refused at ``validate`` with
            ``cudnnGraphNotSupportedError``: block_mask, score_mod, score_max, score_sum_exp,
            sink_token, cu_seq_len_q/kv, stats_use_log2, dropout=(mask, scale).

        Returns:
            ``[o, stats]``: graph tensors; O [b, h_q, s_q, d_v] (dims/strides inferred as packed
            BHSD unless set) and Stats fp32 [b, h_q, s_q, 1] (natural-log log-sum-exp), or None
            without stats. Both are virtual until ``set_output(True)``.
        """
        self._check_open("add an operation")
        name = self._node_name(name, "sdpa")
        where = f"sdpa {name!r}"
        if fn is not None:
            score_mod = fn if score_mod is None else score_mod
        node = SdpaNode(
            self, name, q=q, k=k, v=v, is_inference=is_inference, attn_scale=attn_scale,
            bias=_alias_arg(where, "bias", bias, "attn_bias", attn_bias), block_mask=block_mask,
            use_alibi_mask=use_alibi_mask, use_padding_mask=use_padding_mask, seq_len_q=seq_len_q,
            seq_len_kv=seq_len_kv, use_causal_mask=use_causal_mask,
            use_causal_mask_bottom_right=use_causal_mask_bottom_right,
            sliding_window_length=_alias_arg(where, "sliding_window_length", sliding_window_length,
                                             "sliding_window", sliding_window),
            diagonal_alignment_=diagonal_alignment,
            left_bound=_alias_arg(where, "diagonal_band_left_bound", diagonal_band_left_bound,
                                  "left_bound", left_bound),
            right_bound=_alias_arg(where, "diagonal_band_right_bound", diagonal_band_right_bound,
                                   "right_bound", right_bound),
            dropout=dropout, dropout_seed=dropout_seed, dropout_offset=dropout_offset, rng_dump=rng_dump,
            paged_attention_k_table=paged_attention_k_table, paged_attention_v_table=paged_attention_v_table,
            paged_attention_max_seq_len_kv=paged_attention_max_seq_len_kv,
            max_total_seq_len_q=max_total_seq_len_q, max_total_seq_len_kv=max_total_seq_len_kv,
            score_mod=score_mod, generate_stats=generate_stats, score_max=score_max,
            score_sum_exp=score_sum_exp, sink_token=sink_token, cu_seq_len_q=cu_seq_len_q,
            cu_seq_len_kv=cu_seq_len_kv, stats_use_log2=stats_use_log2)
        self._add_node(node)
        return [node.o, node.stats]

    def sdpa_with_paged_cache(self, q, k, v, page_table, *, page_table_v=None, attn_scale=None,
                              is_inference=None, generate_stats=None, use_causal_mask=False,
                              use_causal_mask_bottom_right=False, diagonal_alignment=None,
                              diagonal_band_left_bound=None, diagonal_band_right_bound=None,
                              sliding_window_length=None, seq_len_q=None, seq_len_kv=None,
                              use_padding_mask=None, max_seq_len_kv=None, paged_attention_max_seq_len_kv=None,
                              bias=None, attn_bias=None, use_alibi_mask=False, compute_data_type=None,
                              name=""):
        """The seeds' paged spelling: K/V caches ``[num_pages, page_size, h_kv, d]`` and one page
        table ``[b, blocks_per_seq]`` (int32) shared by K and V (``page_table_v`` for a separate one).

        Equivalent to ``sdpa(..., paged_attention_k_table=, paged_attention_v_table=)`` with the
        containers seen as ``[num_pages, h_kv, page_size, d]`` and the tables as ``[b, 1, n, 1]``
        (views, no copy). ``use_padding_mask`` defaults to "a seq_len was given"; ``seq_len_q``
        may be omitted (every sequence has s_q queries). ``max_seq_len_kv`` (alias
        ``paged_attention_max_seq_len_kv``) bounds the kv length (default: blocks x page size).
        Returns ``[o, stats]`` as :meth:`sdpa`.
        """
        self._check_open("add an operation")
        name = self._node_name(name, "sdpa")
        where = f"sdpa {name!r}"
        mx = _alias_arg(where, "max_seq_len_kv", max_seq_len_kv, "paged_attention_max_seq_len_kv",
                        paged_attention_max_seq_len_kv)
        if use_padding_mask is None:
            use_padding_mask = seq_len_q is not None or seq_len_kv is not None
        node = SdpaNode(
            self, name, q=q, k=k, v=v, is_inference=is_inference, attn_scale=attn_scale,
            bias=_alias_arg(where, "bias", bias, "attn_bias", attn_bias), block_mask=None,
            use_alibi_mask=use_alibi_mask, use_padding_mask=use_padding_mask, seq_len_q=seq_len_q,
            seq_len_kv=seq_len_kv, use_causal_mask=use_causal_mask,
            use_causal_mask_bottom_right=use_causal_mask_bottom_right,
            sliding_window_length=sliding_window_length, diagonal_alignment_=diagonal_alignment,
            left_bound=diagonal_band_left_bound, right_bound=diagonal_band_right_bound,
            dropout=None, dropout_seed=None, dropout_offset=None, rng_dump=None,
            paged_attention_k_table=page_table,
            paged_attention_v_table=page_table if page_table_v is None else page_table_v,
            paged_attention_max_seq_len_kv=mx, max_total_seq_len_q=None, max_total_seq_len_kv=None,
            score_mod=None, generate_stats=generate_stats, score_max=None, score_sum_exp=None,
            sink_token=None, cu_seq_len_q=None, cu_seq_len_kv=None, stats_use_log2=False,
            kv_layout="paged_nshd")
        node.partial_padding = True
        self._add_node(node)
        return [node.o, node.stats]

    def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale=None, bias=None, dBias=None,
                      use_alibi_mask=False, use_padding_mask=False, seq_len_q=None, seq_len_kv=None,
                      max_total_seq_len_q=None, max_total_seq_len_kv=None, use_causal_mask=False,
                      use_causal_mask_bottom_right=False, sliding_window_length=None,
                      diagonal_alignment=_alignment.TOP_LEFT, diagonal_band_left_bound=None,
                      diagonal_band_right_bound=None, dropout=None, rng_dump=None,
                      use_deterministic_algorithm=False, compute_data_type=data_type.NOT_SET, name="",
                      score_mod=None, score_mod_bprop=None, sink_token=None, dSink_token=None, *,
                      attn_bias=None, dropout_seed=None, dropout_offset=None, left_bound=None,
                      right_bound=None, sliding_window=None):
        """Gradients of :meth:`sdpa`: dQ [b, h_q, s_q, d], dK [b, h_k, s_kv, d], dV [b, h_v, s_kv, d_v]
        (h_k, h_v as k's and v's: with h_k != h_v each head gets the sum, in fp32, of the gradients of
        the widened heads it was copied to, i.e. over the query heads that read it).

        Args (cuDNN frontend 1.32's names, order and defaults; every keyword also accepts None, meaning
        "not given"): q, k, v as in :meth:`sdpa`; o and dO [b, h_q, s_q, d_v]; stats fp32 [b, h_q, s_q, 1]
        from the forward (``generate_stats=True``). The mask / bias / dropout arguments must repeat
        the forward's. dBias (a graph tensor shaped like the bias) receives the bias gradient,
        summed over the dims the bias broadcasts. use_deterministic_algorithm is passed through
        (None = cuDNN's default, False).
        max_total_seq_len_q/kv are accepted (cuDNN sizes ragged workspaces with them).

        Returns ``[dQ, dK, dV]``, virtual until ``set_output(True)``; dims and strides default to
        Q's, K's, V's (packed in the same dim order).
        """
        self._check_open("add an operation")
        name = self._node_name(name, "sdpa_backward")
        where = f"sdpa_backward {name!r}"
        node = SdpaBackwardNode(
            self, name, q=q, k=k, v=v, o=o, dO=dO, stats=stats, attn_scale=attn_scale,
            bias=_alias_arg(where, "bias", bias, "attn_bias", attn_bias), dBias=dBias,
            use_alibi_mask=use_alibi_mask, use_padding_mask=use_padding_mask, seq_len_q=seq_len_q,
            seq_len_kv=seq_len_kv, max_total_seq_len_q=max_total_seq_len_q,
            max_total_seq_len_kv=max_total_seq_len_kv, use_causal_mask=use_causal_mask,
            use_causal_mask_bottom_right=use_causal_mask_bottom_right,
            sliding_window_length=_alias_arg(where, "sliding_window_length", sliding_window_length,
                                             "sliding_window", sliding_window),
            diagonal_alignment_=diagonal_alignment,
            left_bound=_alias_arg(where, "diagonal_band_left_bound", diagonal_band_left_bound,
                                  "left_bound", left_bound),
            right_bound=_alias_arg(where, "diagonal_band_right_bound", diagonal_band_right_bound,
                                   "right_bound", right_bound),
            dropout=dropout, dropout_seed=dropout_seed, dropout_offset=dropout_offset, rng_dump=rng_dump,
            use_deterministic_algorithm=use_deterministic_algorithm, score_mod=score_mod,
            score_mod_bprop=score_mod_bprop, sink_token=sink_token, dSink_token=dSink_token)
        self._add_node(node)
        return [node.dq, node.dk, node.dv]

    def sdpa_fp8(self, q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, is_inference=None,
                 attn_scale=None, bias=None, use_alibi_mask=False, use_padding_mask=False, seq_len_q=None,
                 seq_len_kv=None, use_causal_mask=False, use_causal_mask_bottom_right=False, sliding_window=None,
                 diagonal_alignment=_alignment.TOP_LEFT, left_bound=None, right_bound=None, dropout=None,
                 rng_dump=None, paged_attention_k_table=None, paged_attention_v_table=None,
                 paged_attention_max_seq_len_kv=None, max_total_seq_len_q=None, max_total_seq_len_kv=None,
                 compute_data_type=data_type.NOT_SET, name="", fn=None, generate_stats=None, score_max=None,
                 score_sum_exp=None, sink_token=None, unfuse_fma=False, implementation=attention_implementation.AUTO,
                 cu_seq_len_q=None, cu_seq_len_kv=None, stats_use_log2=False):
        """cuDNN's FP8 attention, with cuDNN frontend 1.32's signature (every keyword also accepts None).

        Where each scale applies: :mod:`fusedattn.fp8` (cuDNN's graph expansion). Masks: causal (either
        alignment), the band (left_bound / right_bound / sliding_window), padding; GQA. Runs
        :func:`fusedattn.fp8.sdpa_fp8_forward`: on CUDA the portable Triton kernel's FP8 forward (within the
        emulation's error bound), elsewhere the exact torch emulation; bias, ALiBi, dropout, paging and score_mod raise
        ``cudnnGraphNotSupportedError``. Returns ``[O, Stats, Amax_S, Amax_O]`` as cuDNN does (Stats None
        unless stats are generated).
        """
        args = dict(locals())     # every argument by name: the node records the graph tensors among them
        del args["self"]
        return self._fp8_node("sdpa_fp8", args, ("q", "k", "v", "descale_q", "descale_k", "descale_v",
                                                 "descale_s", "scale_s", "scale_o"),
                              (("o", "O"), ("stats", "Stats"), ("amax_s", "Amax_S"), ("amax_o", "Amax_O")))

    def sdpa_fp8_backward(self, q, k, v, o, dO, stats, descale_q, descale_k, descale_v, descale_o, descale_dO,
                          descale_s, descale_dP, scale_s, scale_dQ, scale_dK, scale_dV, scale_dP, attn_scale=None,
                          use_padding_mask=False, seq_len_q=None, seq_len_kv=None, use_causal_mask=False,
                          use_causal_mask_bottom_right=False, diagonal_alignment=_alignment.TOP_LEFT,
                          left_bound=None, right_bound=None, use_deterministic_algorithm=False, dropout=None,
                          compute_data_type=data_type.NOT_SET, name="", sink_token=None, dSink_token=None,
                          max_total_seq_len_q=None, max_total_seq_len_kv=None):
        """Gradients of :meth:`sdpa_fp8`, with cuDNN frontend 1.32's signature (every keyword also accepts None).

        Runs :func:`fusedattn.fp8.sdpa_fp8_backward` (the exact torch emulation; scales as
        :mod:`fusedattn.fp8` says). Returns ``[dQ, dK, dV, amax_dQ, amax_dK, amax_dV, amax_dP]``.
        """
        args = dict(locals())
        del args["self"]
        return self._fp8_node("sdpa_fp8_backward", args,
                              ("q", "k", "v", "o", "dO", "stats", "descale_q", "descale_k", "descale_v",
                               "descale_o", "descale_dO", "descale_s", "descale_dP", "scale_s", "scale_dQ",
                               "scale_dK", "scale_dV", "scale_dP"),
                              tuple((r, r) for r in ("dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP")))

    def _fp8_node(self, op, args, required, outputs):
        self._check_open("add an operation")
        from .fp8_nodes import SdpaFp8BackwardNode, SdpaFp8Node
        node_cls = SdpaFp8Node if op == "sdpa_fp8" else SdpaFp8BackwardNode
        node = node_cls(self, self._node_name(args.pop("name"), op), args)
        self._add_node(node)
        return node.results

    def __getattr__(self, name):
        # cuDNN's graph has many other operations (matmul, conv_fprop, layernorm ...); say plainly
        # that this one is not here rather than a bare AttributeError.
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"fusedattn's pygraph has no {name!r}: it implements the SDPA part of cuDNN's graph API "
            f"(tensor, tensor_like, sdpa, sdpa_backward, sdpa_with_paged_cache, sdpa_fp8, sdpa_fp8_backward, "
            f"validate ... execute)")

    # ------------------------------------------------------------------------------------------
    # build steps
    # ------------------------------------------------------------------------------------------
    def _assign_uids(self) -> None:
        taken: Dict[int, tensor] = {}
        for t in self._tensors:
            if t._uid_explicit:
                if t._uid in taken:
                    raise GraphError(f"graph {self.name!r}: uid {t._uid} is used by both "
                                     f"{taken[t._uid].label()} and {t.label()}; uids must be unique")
                taken[t._uid] = t
        nxt = 1
        for t in self._tensors:
            if not t._uid_explicit:
                while nxt in taken:
                    nxt += 1
                t._uid = nxt
                taken[nxt] = t
                nxt += 1
        self._uid_to_tensor = taken

    def validate(self) -> None:
        """Check every operation's tensors (dims, data types, options) and infer the outputs'
        dims/strides/data types. Raises :class:`GraphError` (bad graph) or
        ``cudnnGraphNotSupportedError`` (valid, but fusedattn cannot run it)."""
        if self._state >= _VALIDATED:
            return
        if not self._nodes:
            raise GraphError(f"graph {self.name!r} has no operation; add one with sdpa(...) or sdpa_backward(...)")
        self._assign_uids()
        self._inferred_uids = set()
        ctx = _Ctx(io_data_type=self._io_dt)
        for node in self._nodes:
            node.validate(ctx)
        produced = set()
        for node in self._nodes:
            for role, t in node.inputs.items():
                if t._virtual and id(t) not in produced:
                    raise GraphError(f"{node.where}: input {role} {t.label()} is virtual but no earlier "
                                     f"operation produces it; graph inputs must be non-virtual")
            produced.update(id(t) for t in node.outputs.values())
        consumed = {id(t) for n in self._nodes for t in n.inputs.values()}
        for node in self._nodes:
            if not any(not t._virtual or id(t) in consumed for t in node.outputs.values()):
                names = ", ".join(t.label() for t in node.outputs.values() if t is not None)
                raise GraphError(f"{node.where}: none of its outputs ({names}) is marked set_output(True) "
                                 f"or used by another operation; the graph would compute nothing")
        self._state = _VALIDATED

    def build_operation_graph(self) -> None:
        """Lower every operation to its functional call (runs ``validate`` first if needed)."""
        if self._state >= _LOWERED:
            return
        self.validate()
        ctx = _Ctx(io_data_type=self._io_dt,
                   consumed_uids={t._uid for n in self._nodes for t in n.inputs.values()})
        self._calls = [node.lower(ctx) for node in self._nodes]
        self._state = _LOWERED

    def create_execution_plans(self, heur_modes=None) -> None:
        """Record the heuristic modes (a list of ``cudnn.heur_mode``); fusedattn has one plan."""
        modes = heur_modes if heur_modes is not None else [heur_mode.A]
        if isinstance(modes, heur_mode):
            modes = [modes]
        if not isinstance(modes, (list, tuple)) or not modes or not all(isinstance(m, heur_mode) for m in modes):
            raise GraphError(f"create_execution_plans expects a non-empty list of cudnn.heur_mode, got {heur_modes!r}")
        self.build_operation_graph()
        self._heur_modes = list(modes)
        self._state = max(self._state, _PLANNED)

    def _probe_device(self) -> torch.device:
        for node in self._nodes:
            dev = node.inputs["q"]._device
            if dev is not None:
                return torch.device(dev)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def check_support(self) -> None:
        """Raise ``cudnnGraphNotSupportedError`` naming the arguments fusedattn cannot run.

        Each call runs once on tiny inputs (batch 1, a few tokens) with this graph's head
        counts, head dims, dtypes, features and backend, on the device its tensors came from;
        the answer is cached per static problem, so building the same problem again is free.
        On a GPU this also compiles the kernels that ``execute`` will use.
        """
        if self._state >= _SUPPORTED:
            return
        if self._state < _PLANNED:
            self.create_execution_plans()
        device = self._probe_device()
        for call in self._calls:
            probe(call, device, self._backend)
        self._state = _SUPPORTED

    def build_plans(self, policy=None) -> None:
        """Finish the build (runs the earlier steps if skipped); the graph is frozen afterwards."""
        if self._state >= _BUILT:
            return
        self.check_support()
        self._state = _BUILT

    def build(self, heur_modes=None) -> None:
        """``validate``, ``build_operation_graph``, ``create_execution_plans(heur_modes)``,
        ``check_support``, ``build_plans`` in one call (cuDNN's shortcut)."""
        self.validate()
        self.build_operation_graph()
        if self._state < _PLANNED:
            self.create_execution_plans(heur_modes)
        self.check_support()
        self.build_plans()

    def get_execution_plan_count(self) -> int:
        """1 once plans exist (fusedattn has one plan per graph), else 0."""
        return 1 if self._state >= _PLANNED else 0

    def get_engine_count(self) -> int:
        """1: fusedattn's one engine (the functional layer)."""
        return 1

    def build_plan_at_index(self, index: int = 0) -> None:
        """cuDNN's per-plan build: plan 0 is the only plan."""
        self._check_plan_index(index)
        self.build_plans()

    def get_plan_name_at_index(self, index: int = 0) -> str:
        """``"fusedattn:<backend>"`` for plan 0."""
        self._check_plan_index(index)
        return f"fusedattn:{self._backend}"

    def get_workspace_size_plan_at_index(self, index: int = 0) -> int:
        """``get_workspace_size()`` of plan 0."""
        self._check_plan_index(index)
        return self.get_workspace_size()

    def execute_plan_at_index(self, variant_pack, workspace=None, index: int = 0, handle=None):
        """``execute`` with plan 0 (the only plan)."""
        self._check_plan_index(index)
        return self.execute(variant_pack, workspace, handle)

    def _check_plan_index(self, index) -> None:
        if index != 0:
            raise GraphError(f"graph {self.name!r}: plan index {index} out of range: fusedattn has one plan (0)")

    def deselect_workspace_greater_than(self, limit: int) -> None:
        """Accepted: fusedattn's plans need no workspace, so none is excluded."""

    def get_workspace_size(self) -> int:
        """Bytes of workspace ``execute`` needs: 0 (the functional layer allocates its own)."""
        return self._workspace_size

    def key(self) -> int:
        """A hash of the graph's static description (equal graphs, equal keys)."""
        self.build_operation_graph()
        return hash(tuple((c.probe_key, tuple(sorted(c.dims.items()))) for c in self._calls)) & (2 ** 63 - 1)

    # ------------------------------------------------------------------------------------------
    # execute
    # ------------------------------------------------------------------------------------------
    def _bind(self, variant_pack) -> Dict[int, torch.Tensor]:
        """uid -> torch tensor from a pack keyed by graph tensors, uids or names; None keys and
        values are skipped (cuDNN code builds packs with ``{bias: None}`` when a feature is off)."""
        if not isinstance(variant_pack, dict):
            raise GraphError(f"graph {self.name!r}: variant_pack must be a dict {{graph tensor or uid: "
                             f"torch tensor}}, got {type(variant_pack).__name__}")
        bound: Dict[int, torch.Tensor] = {}
        for key, val in variant_pack.items():
            if key is None:
                continue
            if isinstance(key, tensor):
                if key._graph is not self:
                    raise GraphError(f"graph {self.name!r}: variant pack key {key.label()} is a tensor of "
                                     f"another graph")
                uid = key._uid
            elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
                if int(key) not in self._uid_to_tensor:
                    raise GraphError(f"graph {self.name!r}: variant pack key uid {key} is not a tensor of "
                                     f"this graph (uids: {sorted(self._uid_to_tensor)})")
                uid = int(key)
            elif isinstance(key, str):
                hits = [t for t in self._tensors if t._name == key]
                if len(hits) != 1:
                    raise GraphError(f"graph {self.name!r}: variant pack key {key!r} names "
                                     f"{'no' if not hits else 'more than one'} tensor")
                uid = hits[0]._uid
            else:
                raise GraphError(f"graph {self.name!r}: variant pack keys are graph tensors or int uids, "
                                 f"got {type(key).__name__}")
            if val is None:
                continue
            if not isinstance(val, torch.Tensor):
                if hasattr(val, "__dlpack__"):
                    val = torch.from_dlpack(val)
                else:
                    raise GraphError(f"graph {self.name!r}: variant pack value for "
                                     f"{self._uid_to_tensor[uid].label()} must be a torch tensor, got "
                                     f"{type(val).__name__}")
            if uid in bound and bound[uid] is not val:
                raise GraphError(f"graph {self.name!r}: {self._uid_to_tensor[uid].label()} is given twice "
                                 f"in the variant pack (by tensor and by uid) with different tensors")
            bound[uid] = val
        return bound

    def _check_workspace(self, workspace, device) -> None:
        need = self._workspace_size
        if workspace is None:
            if need > 0:
                raise GraphError(f"graph {self.name!r}: execute needs a workspace of {need} bytes "
                                 f"(get_workspace_size()), got None")
            return
        if not isinstance(workspace, torch.Tensor):
            if hasattr(workspace, "__dlpack__"):
                workspace = torch.from_dlpack(workspace)
            else:
                raise GraphError(f"graph {self.name!r}: workspace must be a torch tensor of at least "
                                 f"get_workspace_size() = {need} bytes, got {type(workspace).__name__}")
        have = workspace.numel() * workspace.element_size()
        if have < need:
            raise GraphError(f"graph {self.name!r}: workspace too small: {have} bytes, need {need} "
                             f"(get_workspace_size())")
        if need > 0 and device is not None and workspace.device != device:
            raise GraphError(f"graph {self.name!r}: workspace is on {workspace.device} but the tensors "
                             f"are on {device}")

    def _resolve_handle(self, handle) -> Handle:
        h = handle if handle is not None else (self._handle or _default_handle())
        if not isinstance(h, Handle):
            raise GraphError(f"graph {self.name!r}: handle must come from create_handle(), got "
                             f"{type(h).__name__}")
        h.check(f"graph {self.name!r}: execute")
        return h

    def execute(self, variant_pack, workspace=None, handle=None, override_uids=None, override_shapes=None,
                override_strides=None) -> None:
        """Run the graph: ``variant_pack`` maps graph tensors (or their uids) to torch tensors;
        outputs are written in place.

        Checks, cheaply: every non-virtual tensor is present with the declared shape and data type
        on the inputs' device (one-element scalars may be CPU tensors); the workspace is big enough;
        the handle is alive. Runs on the handle's stream (``set_stream``).
        """
        if self._state < _BUILT:
            raise GraphError(f"graph {self.name!r}: execute before the graph is built; call build_plans() "
                             f"(or build([cudnn.heur_mode.A]))")
        calls = self._calls
        if override_uids or override_shapes or override_strides:
            calls = self._overridden_calls(override_uids, override_shapes, override_strides)
        h = self._resolve_handle(handle)
        bound = self._bind(variant_pack)
        device = None
        with torch.no_grad():
            for call in calls:
                t = {"_backend": self._backend}
                for r in call.reqs:
                    x = bound.get(r.uid)
                    if x is None:
                        if not r.scratch:
                            raise GraphError(f"{call.where}: the variant pack is missing {r.role} {r.label} "
                                             f"(dims {list(r.shape)}, {r.dtype})")
                        x = torch.empty_strided(r.shape, r.stride, dtype=r.dtype, device=device)
                        bound[r.uid] = x
                    else:
                        # a packed (ragged) buffer has any shape: the node checks its extent
                        if not r.ragged and tuple(x.shape) != r.shape and tuple(x.shape) not in r.alt_shapes:
                            raise GraphError(f"{call.where}: {r.role} {r.label} in the variant pack has shape "
                                             f"{list(x.shape)}, but the graph declared {list(r.shape)}")
                        if x.dtype != r.dtype:
                            raise GraphError(f"{call.where}: {r.role} {r.label} in the variant pack is "
                                             f"{x.dtype}, but the graph declared {r.dtype}")
                        if device is None:
                            device = x.device
                        elif x.device != device and not (r.host_ok and x.device.type == "cpu"):
                            raise GraphError(f"{call.where}: {r.role} {r.label} is on {x.device} but the "
                                             f"other tensors are on {device}")
                    t[r.role] = x
                if call is calls[0]:
                    self._check_workspace(workspace, device)
                with h.stream_context(device):
                    invoke(call, t)

    def _overridden_calls(self, override_uids, override_shapes, override_strides) -> list:
        """The graph's calls lowered at ``execute``'s override dims/strides (cuDNN's
        ``is_override_shape_enabled`` graphs), cached per override.

        A copy of the graph takes the new dims (and strides where one has as many entries as the
        dims: cuDNN frontend's THD tests pass a packed ``[T, h, d]`` tensor's own strides for a
        ``[b, h, s, d]`` graph tensor, so a stride of another rank keeps the graph's), is validated,
        lowered and support-checked as at build; outputs whose dims were inferred are inferred anew.
        """
        w = f"graph {self.name!r}: execute"
        if not self._override_shape:
            raise GraphError(f"{w}: override_uids / override_shapes / override_strides need a graph created "
                             f"with is_override_shape_enabled=True")
        uids = list(override_uids or [])
        shapes = list(override_shapes or [])
        strides = list(override_strides) if override_strides is not None else [None] * len(uids)
        if not (len(uids) == len(shapes) == len(strides)):
            raise GraphError(f"{w}: override_uids ({len(uids)}), override_shapes ({len(shapes)}) and "
                             f"override_strides ({len(strides)}) need one entry per uid")
        try:
            key = tuple((int(u), tuple(int(x) for x in shape), None if st is None else tuple(int(x) for x in st))
                        for u, shape, st in zip(uids, shapes, strides))
        except (TypeError, ValueError):
            raise GraphError(f"{w}: override_uids are ints, override_shapes / override_strides lists of ints; "
                             f"got {uids!r}, {shapes!r}, {strides!r}") from None
        calls = self._override_calls.get(key)
        if calls is not None:
            return calls
        # the copy shares the handle and starts with no overrides of its own
        clone = copy.deepcopy(self, {id(self._handle): self._handle, id(self._override_calls): {}})
        for uid in clone._inferred_uids:
            t = clone._uid_to_tensor[uid]
            t._dim = t._stride = None
        for uid, shape, stride in key:
            t = clone._uid_to_tensor.get(uid)
            if t is None:
                raise GraphError(f"{w}: override uid {uid} is not a tensor of this graph "
                                 f"(uids: {sorted(clone._uid_to_tensor)})")
            if t._dim and len(shape) != len(t._dim):
                raise GraphError(f"{w}: override shape {list(shape)} for {t.label()} has {len(shape)} dims; "
                                 f"the tensor has {len(t._dim)}")
            t._dim = list(shape)
            if stride is not None and len(stride) == len(shape):
                t._stride = list(stride)
        clone._state, clone._calls = _OPEN, []
        clone.check_support()
        if len(self._override_calls) >= 64:
            self._override_calls.clear()
        self._override_calls[key] = clone._calls
        return clone._calls

    def __repr__(self):
        ops = ", ".join(n.where for n in self._nodes) or "no operations"
        state = ["open", "validated", "lowered", "planned", "supported", "built"][self._state]
        return f"<fusedattn pygraph {self.name!r}: {ops}; {len(self._tensors)} tensors; {state}>"


def _alias_arg(where, a_name, a, b_name, b):
    if a is not None and b is not None:
        raise GraphError(f"{where}: {a_name} and {b_name} are the same argument; give one")
    return a if a is not None else b
