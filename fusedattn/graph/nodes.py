"""The SDPA nodes of a graph (build): each ``graph.sdpa(...)`` / ``graph.sdpa_backward(...)`` /
``graph.sdpa_fp8(...)`` becomes a node here, which parses its arguments (:mod:`.parse`), checks them
at ``validate()`` (:mod:`.checks`) and lowers itself to a :class:`~.lower.Call` at
``build_operation_graph()`` (:mod:`.lower`); the ragged (packed THD) checks of the build are here too."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .checks import (_FLOAT_DTS, _FP8_DTS, _INDEX_DTS, _index_tensor, _scalar_tensor, check_broadcast,
                     check_float_io, dense_qkv_dims, dense_strides_like, head_dims_unsupported, infer_output,
                     kv_heads, need_dims, packed_strides, resolve_dt)
from .enums import data_type, tensor_reordering
from .errors import GraphError, cudnnGraphNotSupportedError
from .lower import FEATURE_ARGS, Call, Req, _finish_call, _req
from .parse import _is_int, check_graph_tensor, parse_band, parse_dropout, parse_scale, parse_stats_flag
from .tensors import tensor

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
        return self._attach(self.inputs, role, value, arg)

    def _written(self, role: str, value, arg: Optional[str] = None):
        """A user-created tensor the node writes (rng_dump, dBias)."""
        return self._attach(self.outputs, role, value, arg)

    def _attach(self, table: dict, role: str, value, arg: Optional[str]):
        t = check_graph_tensor(self.graph, value, arg or role, self.where)
        if t is not None:
            table[role] = t
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

    def _refuse_kv_heads(self) -> None:
        """Raise cudnnGraphNotSupportedError for K and V with different head counts (``self.kv_counts``,
        from :func:`~.checks.kv_heads`) with packed q over padded or paged K/V (chunked prefill): that path
        takes K and V as they are, while the dense and paged ones widen them to one head count (and packed
        q/k/v run as the padded call, :func:`.ragged._padded_invocation`). At the end of validate, so
        malformed graphs report their own error first."""
        if self.kv_counts is not None and self.packed_q_only:
            h_k, h_v = self.kv_counts
            raise cudnnGraphNotSupportedError(
                f"{self.where}: k has {h_k} heads and v has {h_v}: different key/value head counts do not run "
                f"with packed q over padded or paged K/V (ragged q and O only); give k and v the same head "
                f"count (repeat_interleave along heads), or pack k and v too")

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
            if t._data_type in _FP8_DTS and not getattr(self, "fp8", False):   # fp8_nodes' nodes take FP8
                raise cudnnGraphNotSupportedError(f"{w}: {role} {t.label()} is {t._data_type.name}; FP8 "
                                                  f"tensors go to sdpa_fp8 / sdpa_fp8_backward")

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
        self.packed_q_only = False
        self.packed_tables = self._check_packed_tables(ragged, b)
        for role in self.packed_tables:
            del ragged[role]
        if not ragged:
            return
        for role, t in ragged.items():
            if role not in self.packed_roles + ("stats",):
                raise cudnnGraphNotSupportedError(
                    f"{w}: {role} {t.label()} has a ragged offset; only {', '.join(self.packed_roles)} and "
                    f"stats can be packed (THD)")
        # Chunked prefill (cuDNN's test_sdpa_chunked_prefill.py): packed Q and O over padded or paged K/V,
        # run by fusedattn.attention_with_kvcache(cu_seqlens_q=...); forward only, as that door is.
        self.packed_q_only = (self.op_name == "sdpa" and "q" in ragged and "k" not in ragged and "v" not in ragged)
        if self.packed_q_only:
            self._check_packed_q_only(ragged)
            self._check_offsets(ragged, b)
            self.ragged = ragged
            return
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
        # A bias (and K/V of different head counts) runs too: as the padded call (ragged._padded_invocation)
        if self.paged:
            raise cudnnGraphNotSupportedError(
                f"{w}: {FEATURE_ARGS['paged']} with ragged offsets on q, k, v (packed THD layout) is not supported "
                f"by fusedattn; the packed path runs causal/band masks, bias, ALiBi, dropout and GQA")
        self._check_offsets(ragged, b)
        self.ragged = ragged

    def _check_packed_tables(self, ragged, b) -> Tuple[str, ...]:
        """The page tables among the ragged tensors (cuDNN's packed page tables, test_mhas.py's
        ``convert_uniform_to_ragged_page_tables``): a table declared ``[b, 1, max_pages, 1]`` whose
        sequence ``i`` starts at element ``offset[i]`` of the flattened table. Execute unpacks each to the
        padded table the paged path reads (:func:`.execute._unpack_page_tables`); its offsets are
        checked like q's. The seeds' ``[b, pages]`` tables (paged_nshd) have no packed form."""
        roles = tuple(r for r in ("page_table_k", "page_table_v") if r in ragged)
        if roles and self.kv_layout != "paged":
            raise cudnnGraphNotSupportedError(
                f"{self.where}: a ragged offset on a [b, pages] page table is not supported; packed page tables "
                f"are cuDNN's [b, 1, max_pages, 1] tables (paged_attention_k_table / paged_attention_v_table)")
        self._check_offsets({r: ragged[r] for r in roles}, b)
        return roles

    def _check_packed_q_only(self, ragged) -> None:
        """Packed queries over padded or paged K/V: O packed too (or a virtual O nobody reads), and only
        what attention_with_kvcache runs (no bias, no dropout)."""
        w = self.where
        o = self.outputs.get("o")
        if "o" not in ragged and not (o is not None and o._virtual):
            raise cudnnGraphNotSupportedError(
                f"{w}: q {ragged['q'].label()} has a ragged offset (packed THD layout) but O {o.label()} does "
                f"not; with padded or "
                f"paged K/V (chunked prefill) fusedattn writes O packed like q: give O a ragged offset too")
        for feat, used in (("bias", "bias" in self.inputs), ("dropout", self.dropout is not None)):
            if used:
                raise cudnnGraphNotSupportedError(
                    f"{w}: {FEATURE_ARGS[feat]} with packed q over padded or paged K/V (chunked prefill) is not "
                    f"supported by fusedattn; that path runs causal/band masks, ALiBi, sinks and GQA")

    def _check_offsets(self, ragged, b) -> None:
        """Each ragged offset: a [b + 1] INT32/INT64 graph input, and a positive token stride."""
        w = self.where
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
        if "sink_token" in self.inputs:
            feats.append("sink")
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
        if "sink_token" in self.inputs:
            reqs.append(_req(self.inputs["sink_token"], "sink_token", w))
        if "dSink_token" in self.outputs:
            reqs.append(_req(self.outputs["dSink_token"], "dSink_token", w))

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
        # a learnable sink, one float logit per query head ([1, h_q, 1, 1] in cuDNN): fusedattn's sink=
        self._input("sink_token", sink_token)
        self._unsupported_arg("cu_seq_len_q", cu_seq_len_q, "give packed variable lengths as ragged offsets "
                              "(q.set_ragged_offset(...)) with use_padding_mask")
        self._unsupported_arg("cu_seq_len_kv", cu_seq_len_kv, "give packed variable lengths as ragged offsets "
                              "(k/v.set_ragged_offset(...)) with use_padding_mask")
        self._unsupported_arg("stats_use_log2", stats_use_log2, "stats are natural-log log-sum-exp")
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
        self.h_kv, self.kv_counts = kv_heads(h_q, h_k, h_v, w)
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
        self._refuse_kv_heads()
        # Last, so malformed graphs report their own error. At validate(), where cuDNN refuses head dims
        # (multiples of 8; cuDNN frontend's test_mhas.py skips on a refusal there and nowhere later).
        why = head_dims_unsupported(d, d_v)
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
        for role in self.packed_tables:
            off = self.inputs[role]._ragged_offset
            n = off._dim[0]
            reqs.append(_req(off, f"ragged_{role}", w, alt=[[n], [n, 1, 1, 1]]))
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
                    max_seq_len_kv=self.max_seq_len_kv if self.paged else None, ragged_roles=ragged_roles,
                    packed_q_only=self.packed_q_only, packed_tables=self.packed_tables)
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
        # the forward's sink (its Stats include it) and its gradient, written like dBias
        self._input("sink_token", sink_token)
        if dSink_token is not None:
            if sink_token is None:
                raise GraphError(f"{w}: dSink_token given without sink_token; the sink's gradient needs the sink")
            self._written("dSink_token", dSink_token)
        self.dq = self._new_output("dQ", "dQ")
        self.dk = self._new_output("dK", "dK")
        self.dv = self._new_output("dV", "dV")
        self.paged = False

    def validate(self, ctx):
        """Check dims against each other, infer dQ / dK / dV like Q / K / V."""
        w, io_dt = self.where, ctx.io_data_type
        q, k, v, o, do, st = (self.inputs[r] for r in ("q", "k", "v", "o", "dO", "stats"))
        b, h_q, s_q, d, h_k, h_v, s_kv, d_v = dense_qkv_dims(q, k, v, w)
        self.h_kv, self.kv_counts = kv_heads(h_q, h_k, h_v, w)
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
        self._refuse_kv_heads()
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
