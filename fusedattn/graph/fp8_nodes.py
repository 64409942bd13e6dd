"""The FP8 nodes of a graph: ``graph.sdpa_fp8(...)`` / ``graph.sdpa_fp8_backward(...)`` (cuDNN frontend
1.32's signatures, :mod:`.signatures`), parsed at the call, checked at ``validate()``, lowered to a
:class:`~.lower.Call` of kind ``"fp8_fwd"`` / ``"fp8_bwd"`` and run at ``execute`` by
:func:`fusedattn.fp8.sdpa_fp8_forward` / ``sdpa_fp8_backward`` (:func:`fp8_invocation`), whose
docstring says where each scale applies. Masks as the 16-bit nodes: causal (either alignment),
the diagonal band (``left_bound`` / ``right_bound`` / ``sliding_window``), padding. Dense BHSD-like
tensors with any strides; every device runs the exact torch emulation for now (no FP8 kernels yet).
"""
from __future__ import annotations

from typing import Dict

import torch

from .checks import (_FLOAT_DTS, _FP8_DTS, _index_tensor, _scalar_tensor, dense_qkv_dims, dense_strides_like,
                     head_dims_unsupported, infer_output, need_dims, packed_strides, resolve_dt)
from .enums import data_type
from .errors import GraphError, cudnnGraphNotSupportedError
from .lower import Call, _finish_call, _req
from .nodes import _Node
from .parse import parse_stats_flag

_FP8_IO = (data_type.FP8_E4M3, data_type.FP8_E5M2)
_OUT_DTS = _FP8_IO + (data_type.HALF, data_type.BFLOAT16, data_type.FLOAT)
_AMAX_DIMS = [1, 1, 1, 1]


class _Fp8Node(_Node):
    """Shared parsing of the two FP8 ops: required graph tensors, scales, masks, unsupported extras."""

    fp8 = True
    tensors_in: tuple = ()
    scales: tuple = ()
    outputs_out: tuple = ()      # (role, cuDNN output name)

    def __init__(self, graph, name, args: Dict[str, object]):
        super().__init__(graph, name)
        w = self.where
        for role in self.tensors_in + self.scales:
            if args.get(role) is None:
                raise GraphError(f"{w}: {role} is required (a graph tensor)")
            self._input(role, args[role])
        self._common_args(attn_scale=args.get("attn_scale"), bias=None, use_alibi_mask=False,
                          use_padding_mask=args.get("use_padding_mask"), seq_len_q=args.get("seq_len_q"),
                          seq_len_kv=args.get("seq_len_kv"), use_causal_mask=args.get("use_causal_mask"),
                          use_causal_mask_bottom_right=args.get("use_causal_mask_bottom_right"),
                          sliding_window_length=args.get("sliding_window"),
                          diagonal_alignment_=args.get("diagonal_alignment"), left_bound=args.get("left_bound"),
                          right_bound=args.get("right_bound"), dropout=None, dropout_seed=None,
                          dropout_offset=None, rng_dump=None)
        why = {"bias": "bias", "use_alibi_mask": "ALiBi", "dropout": "dropout", "rng_dump": "dropout",
               "paged_attention_k_table": "paged K/V caches", "paged_attention_v_table": "paged K/V caches",
               "fn": "score-modifier callbacks", "score_max": "use generate_stats",
               "score_sum_exp": "use generate_stats", "sink_token": "attention sinks", "dSink_token": "attention sinks",
               "cu_seq_len_q": "packed variable lengths", "cu_seq_len_kv": "packed variable lengths",
               "stats_use_log2": "stats are natural-log log-sum-exp"}
        for arg, what in why.items():
            self._unsupported_arg(arg, args.get(arg), f"{what} with FP8 attention are not supported yet")
        self.paged = False
        self.dims = None

    def _check_qkv(self, ctx):
        w, io_dt = self.where, ctx.io_data_type
        q, k, v = (self.inputs[r] for r in ("q", "k", "v"))
        b, h_q, s_q, d, h_k, h_v, s_kv, d_v = dense_qkv_dims(q, k, v, w)
        if h_k != h_v:
            raise GraphError(f"{w}: k and v must have the same number of heads for FP8: k {k._dim}, v {v._dim}")
        self.h_kv = h_k
        self.dims = (b, h_q, s_q, s_kv, d, d_v)
        for role in ("q", "k", "v"):
            dt = resolve_dt(self.inputs[role], role, w, io_dt)
            if dt not in _FP8_IO:
                raise GraphError(f"{w}: {role} {self.inputs[role].label()} must be FP8_E4M3 or FP8_E5M2 for "
                                 f"{self.op_name}, got {dt.name} (16-bit attention is sdpa / sdpa_backward)")
        for role in self.scales:
            _scalar_tensor(self.inputs[role], role, w, (data_type.FLOAT,))
        return b, h_q, s_q, s_kv, d, d_v

    def _amax_outputs(self, w):
        for role, name in self.outputs_out:
            if role.startswith("amax"):
                t = self.outputs[role]
                infer_output(t, name, w, _AMAX_DIMS, [1, 1, 1, 1], data_type.FLOAT)
                if t._data_type != data_type.FLOAT:
                    raise GraphError(f"{w}: {name} {t.label()} must be FLOAT, got {t._data_type.name}")

    def _lower(self, kind, in_roles, out_roles) -> Call:
        w = self.where
        # a scale is a pointer to one float in cuDNN: torch tensors [1] or [] are accepted for it too
        reqs = [_req(self.inputs[r], r, w, host_ok=r in self.scales, alt=[[1], []] if r in self.scales else ())
                for r in in_roles]
        self._common_reqs(reqs)
        for role in out_roles:
            t = self.outputs[role]
            reqs.append(_req(t, role, w, scratch=t._virtual))
        static, feats = self._mask_static()
        call = Call(kind=kind, where=w, reqs=reqs, static=static, features=tuple(feats),
                    scale_role="attn_scale" in self.inputs)
        _finish_call(call, self, self.dims[3])
        return call


class SdpaFp8Node(_Fp8Node):
    """``graph.sdpa_fp8``: O, Stats, Amax_S, Amax_O from FP8 Q, K, V and the six scale tensors."""

    op_name = "sdpa_fp8"
    tensors_in = ("q", "k", "v")
    scales = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    outputs_out = (("o", "O"), ("stats", "Stats"), ("amax_s", "Amax_S"), ("amax_o", "Amax_O"))

    def __init__(self, graph, name, args):
        super().__init__(graph, name, args)
        self.generate_stats = parse_stats_flag(self.where, args.get("is_inference"), args.get("generate_stats"))
        self.results = [self._new_output(role, cname) if role != "stats" or self.generate_stats else None
                        for role, cname in self.outputs_out]

    def validate(self, ctx):
        w = self.where
        b, h_q, s_q, s_kv, d, d_v = self._check_qkv(ctx)
        self._validate_common(ctx, b, h_q, s_q, s_kv, d, d_v, ctx.io_data_type)
        q = self.inputs["q"]
        o_dims = [b, h_q, s_q, d_v]
        infer_output(self.outputs["o"], "O", w, o_dims, packed_strides(o_dims), q._data_type)
        if self.outputs["o"]._data_type not in _OUT_DTS:
            raise GraphError(f"{w}: O {self.outputs['o'].label()} must be FP8_E4M3 / FP8_E5M2 / HALF / BFLOAT16 / "
                             f"FLOAT, got {self.outputs['o']._data_type.name}")
        if self.generate_stats:
            s_dims = [b, h_q, s_q, 1]
            infer_output(self.outputs["stats"], "Stats", w, s_dims, packed_strides(s_dims), data_type.FLOAT)
            if self.outputs["stats"]._data_type != data_type.FLOAT:
                raise GraphError(f"{w}: Stats must be FLOAT, got {self.outputs['stats']._data_type.name}")
        self._amax_outputs(w)
        why = head_dims_unsupported(d, d_v)
        if why:
            raise cudnnGraphNotSupportedError(f"{w}: {why}")

    def lower(self, ctx) -> Call:
        outs = ["o", "amax_s", "amax_o"] + (["stats"] if self.generate_stats else [])
        return self._lower("fp8_fwd", self.tensors_in + self.scales, outs)


class SdpaFp8BackwardNode(_Fp8Node):
    """``graph.sdpa_fp8_backward``: dQ, dK, dV and four amaxes from FP8 Q, K, V, O, dO, Stats and scales."""

    op_name = "sdpa_fp8_backward"
    tensors_in = ("q", "k", "v", "o", "dO", "stats")
    scales = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
              "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
    outputs_out = tuple((r, r) for r in ("dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP"))

    def __init__(self, graph, name, args):
        super().__init__(graph, name, args)
        det = args.get("use_deterministic_algorithm")
        if det is not None and not isinstance(det, bool):
            raise GraphError(f"{self.where}: use_deterministic_algorithm must be a bool, got {det!r}")
        self.results = [self._new_output(role, cname) for role, cname in self.outputs_out]

    def validate(self, ctx):
        w = self.where
        b, h_q, s_q, s_kv, d, d_v = self._check_qkv(ctx)
        for role in ("o", "dO"):
            t = self.inputs[role]
            dims = need_dims(t, role, w)
            if dims != [b, h_q, s_q, d_v]:
                raise GraphError(f"{w}: {role} {t.label()} must have dims [b, h_q, s_q, d_v] = "
                                 f"{[b, h_q, s_q, d_v]}, got {dims}")
            dt = resolve_dt(t, role, w, ctx.io_data_type)
            if dt not in _OUT_DTS:
                raise GraphError(f"{w}: {role} {t.label()} must be FP8 / HALF / BFLOAT16 / FLOAT, got {dt.name}")
        st = self.inputs["stats"]
        if need_dims(st, "stats", w) != [b, h_q, s_q, 1]:
            raise GraphError(f"{w}: stats {st.label()} must have dims {[b, h_q, s_q, 1]}, got {st._dim}")
        if resolve_dt(st, "stats", w, data_type.FLOAT) != data_type.FLOAT:
            raise GraphError(f"{w}: stats {st.label()} must be FLOAT, got {st._data_type.name}")
        self._validate_common(ctx, b, h_q, s_q, s_kv, d, d_v, ctx.io_data_type)
        for role in ("dQ", "dK", "dV"):
            src = self.inputs[role[1:].lower()]
            out = self.outputs[role]
            infer_output(out, role, w, src._dim, dense_strides_like(src._dim, src._stride), src._data_type)
            if out._data_type not in _OUT_DTS:
                raise GraphError(f"{w}: {role} {out.label()} must be FP8 / HALF / BFLOAT16 / FLOAT, got "
                                 f"{out._data_type.name}")
        self._amax_outputs(w)
        why = head_dims_unsupported(d, d_v)
        if why:
            raise cudnnGraphNotSupportedError(f"{w}: {why}")

    def lower(self, ctx) -> Call:
        return self._lower("fp8_bwd", self.tensors_in + self.scales,
                           ["dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP"])


# ---------------------------------------------------------------------------------------------
# execute
# ---------------------------------------------------------------------------------------------

def _band(static):
    if static.get("causal"):
        return (static.get("causal_alignment", "top_left"), None, 0)
    if "window" in static:
        left, right = static["window"]
        return (static.get("causal_alignment", "top_left"), None if left == -1 else left,
                None if right == -1 else right)
    return None


def fp8_invocation(call: Call, t: Dict[str, torch.Tensor]):
    """``(fn, args, kw, post)`` as :func:`.execute.build_invocation`: ``fn`` runs the emulation and
    writes the outputs the pack provides (copies into the caller's tensors and strides)."""
    from .. import fp8
    kw = dict(attn_scale=float(t["attn_scale"].reshape(-1)[0]) if call.scale_role else call.static.get("attn_scale"),
              band=_band(call.static), seq_len_q=t.get("seq_len_q"), seq_len_kv=t.get("seq_len_kv"),
              where=call.where)
    scale_names = {r.role for r in call.reqs if r.host_ok and r.role not in ("attn_scale",)}
    for role in scale_names:
        kw[role] = t[role].to(t["q"].device)

    if call.kind == "fp8_fwd":
        def fn():
            return fp8.sdpa_fp8_forward(t["q"], t["k"], t["v"], o_dtype=t["o"].dtype, **kw)
        names = ("o", "stats", "amax_s", "amax_o")
    else:
        def fn():
            return fp8.sdpa_fp8_backward(t["q"], t["k"], t["v"], t["o"], t["dO"], t["stats"],
                                         grad_dtype=t["dQ"].dtype, **kw)
        names = ("dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP")

    def post(result):
        for name, val in zip(names, result):
            if name in t:
                if name in ("dK", "dV") and t[name].dtype != val.dtype:
                    val = val.to(t[name].dtype)
                t[name].copy_(val.reshape(t[name].shape))
    return fn, (), {}, post
