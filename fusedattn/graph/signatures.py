"""cuDNN frontend 1.32's Python signatures of the SDPA operations, as a table.

``pygraph.sdpa`` / ``sdpa_backward`` / ``sdpa_fp8`` / ``sdpa_fp8_backward`` must take what cuDNN's take,
keyword by keyword; ``tests/test_graph_signatures.py`` checks them against this table.

Where the facts come from (nvidia-cudnn-frontend 1.32.0, the wheel):

* the compiled binding ``cudnn._compiled_module.backend_graph``: its docstrings carry each op's
  signature (names, order, defaults, types);
* ``cudnn/_pygraph.py``: in 1.32 the public ``cudnn.pygraph`` is a Python class whose SDPA
  builders take ``*args`` up to the op's required tensors (``positional`` below; one more positional
  argument is a ``TypeError``), drop every keyword whose value is None, and pass the rest to the
  binding. So None means "not given" (the binding's default applies) for every keyword.

Each op: ``positional``, the required graph tensors in order (no default), then ``keywords``: rows
``(name, default, accepts_none, binding_type)`` in the binding's order. ``accepts_none`` is what
``cudnn.pygraph`` accepts (every keyword, see above). ``binding_type`` is the binding's own type;
the binding itself rejects None for ``bool``, ``enum`` and ``str`` (checked: a 1.32 binding bool
parameter given None raises ``TypeError``), which only code calling the binding directly meets.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Tuple

from .enums import attention_implementation, data_type, diagonal_alignment

__all__ = ["Kw", "OpSignature", "CUDNN_SIGNATURES", "CUDNN_FRONTEND_VERSION"]

CUDNN_FRONTEND_VERSION = "1.32.0"


class Kw(NamedTuple):
    """One keyword of a cuDNN op: its name, default, whether None is accepted, the binding's type."""

    name: str
    default: object
    accepts_none: bool
    binding_type: str    # "tensor" | "object" | "bool" | "enum" | "str" | "callable"


class OpSignature(NamedTuple):
    positional: Tuple[str, ...]
    keywords: Tuple[Kw, ...]


_TL = diagonal_alignment.TOP_LEFT
_NOT_SET = data_type.NOT_SET
_AUTO = attention_implementation.AUTO


def _kws(*rows) -> Tuple[Kw, ...]:
    # every keyword accepts None in 1.32's cudnn.pygraph (see the module docstring)
    return tuple(Kw(name, default, True, kind) for name, default, kind in rows)


CUDNN_SIGNATURES: Dict[str, OpSignature] = {
    "sdpa": OpSignature(("q", "k", "v"), _kws(
        ("is_inference", None, "object"),
        ("attn_scale", None, "object"),
        ("bias", None, "tensor"),
        ("block_mask", None, "tensor"),
        ("use_alibi_mask", False, "bool"),
        ("use_padding_mask", False, "bool"),
        ("seq_len_q", None, "tensor"),
        ("seq_len_kv", None, "tensor"),
        ("use_causal_mask", False, "bool"),
        ("use_causal_mask_bottom_right", False, "bool"),
        ("sliding_window_length", None, "object"),
        ("diagonal_alignment", _TL, "enum"),
        ("diagonal_band_left_bound", None, "object"),
        ("diagonal_band_right_bound", None, "object"),
        ("dropout", None, "object"),
        ("rng_dump", None, "tensor"),
        ("paged_attention_k_table", None, "tensor"),
        ("paged_attention_v_table", None, "tensor"),
        ("paged_attention_max_seq_len_kv", None, "object"),
        ("max_total_seq_len_q", None, "object"),
        ("max_total_seq_len_kv", None, "object"),
        ("compute_data_type", _NOT_SET, "enum"),
        ("name", "", "str"),
        ("score_mod", None, "callable"),
        ("generate_stats", None, "object"),
        ("implementation", _AUTO, "enum"),
        ("score_max", None, "tensor"),
        ("score_sum_exp", None, "tensor"),
        ("sink_token", None, "tensor"),
        ("unfuse_fma", False, "bool"),
        ("cu_seq_len_q", None, "tensor"),
        ("cu_seq_len_kv", None, "tensor"),
        ("stats_use_log2", False, "bool"),
    )),
    "sdpa_backward": OpSignature(("q", "k", "v", "o", "dO", "stats"), _kws(
        ("attn_scale", None, "object"),
        ("bias", None, "tensor"),
        ("dBias", None, "tensor"),
        ("use_alibi_mask", False, "bool"),
        ("use_padding_mask", False, "bool"),
        ("seq_len_q", None, "tensor"),
        ("seq_len_kv", None, "tensor"),
        ("max_total_seq_len_q", None, "object"),
        ("max_total_seq_len_kv", None, "object"),
        ("use_causal_mask", False, "bool"),
        ("use_causal_mask_bottom_right", False, "bool"),
        ("sliding_window_length", None, "object"),
        ("diagonal_alignment", _TL, "enum"),
        ("diagonal_band_left_bound", None, "object"),
        ("diagonal_band_right_bound", None, "object"),
        ("dropout", None, "object"),
        ("rng_dump", None, "tensor"),
        ("use_deterministic_algorithm", False, "bool"),
        ("compute_data_type", _NOT_SET, "enum"),
        ("name", "", "str"),
        ("score_mod", None, "callable"),
        ("score_mod_bprop", None, "callable"),
        ("sink_token", None, "tensor"),
        ("dSink_token", None, "tensor"),
    )),
    # The FP8 ops spell the band and the score modifier differently from sdpa (sliding_window,
    # left_bound, right_bound, fn), and take their (de)scale tensors as required arguments.
    "sdpa_fp8": OpSignature(
        ("q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"), _kws(
            ("is_inference", None, "object"),
            ("attn_scale", None, "object"),
            ("bias", None, "tensor"),
            ("use_alibi_mask", False, "bool"),
            ("use_padding_mask", False, "bool"),
            ("seq_len_q", None, "tensor"),
            ("seq_len_kv", None, "tensor"),
            ("use_causal_mask", False, "bool"),
            ("use_causal_mask_bottom_right", False, "bool"),
            ("sliding_window", None, "object"),
            ("diagonal_alignment", _TL, "enum"),
            ("left_bound", None, "object"),
            ("right_bound", None, "object"),
            ("dropout", None, "object"),
            ("rng_dump", None, "tensor"),
            ("paged_attention_k_table", None, "tensor"),
            ("paged_attention_v_table", None, "tensor"),
            ("paged_attention_max_seq_len_kv", None, "object"),
            ("max_total_seq_len_q", None, "object"),
            ("max_total_seq_len_kv", None, "object"),
            ("compute_data_type", _NOT_SET, "enum"),
            ("name", "", "str"),
            ("fn", None, "callable"),
            ("generate_stats", None, "object"),
            ("score_max", None, "tensor"),
            ("score_sum_exp", None, "tensor"),
            ("sink_token", None, "tensor"),
            ("unfuse_fma", False, "bool"),
            ("implementation", _AUTO, "enum"),
            ("cu_seq_len_q", None, "tensor"),
            ("cu_seq_len_kv", None, "tensor"),
            ("stats_use_log2", False, "bool"),
        )),
    "sdpa_fp8_backward": OpSignature(
        ("q", "k", "v", "o", "dO", "stats", "descale_q", "descale_k", "descale_v", "descale_o", "descale_dO",
         "descale_s", "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"), _kws(
            ("attn_scale", None, "object"),
            ("use_padding_mask", False, "bool"),
            ("seq_len_q", None, "tensor"),
            ("seq_len_kv", None, "tensor"),
            ("use_causal_mask", False, "bool"),
            ("use_causal_mask_bottom_right", False, "bool"),
            ("diagonal_alignment", _TL, "enum"),
            ("left_bound", None, "object"),
            ("right_bound", None, "object"),
            ("use_deterministic_algorithm", False, "bool"),
            ("dropout", None, "object"),
            ("compute_data_type", _NOT_SET, "enum"),
            ("name", "", "str"),
            ("sink_token", None, "tensor"),
            ("dSink_token", None, "tensor"),
            ("max_total_seq_len_q", None, "object"),
            ("max_total_seq_len_kv", None, "object"),
        )),
}
