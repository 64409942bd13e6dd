"""Argument parsing (build, at the ``graph.sdpa(...)`` call): cuDNN's arguments into one normalized
description: the diagonal band, the stats flag, dropout, the scale; raising :class:`GraphError`
for contradictions.

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
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from .enums import diagonal_alignment
from .errors import GraphError
from .tensors import tensor


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

