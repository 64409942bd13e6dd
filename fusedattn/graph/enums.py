"""cuDNN frontend's enums, with the member names cuDNN code spells (``cudnn.data_type.HALF`` ...).

Only the names are cuDNN's; the values are ours and carry no meaning. Everywhere a
``data_type`` is accepted a ``torch.dtype`` is accepted too (cuDNN's ``Graph`` wrapper
does the same), converted by :func:`to_data_type`.
"""
from __future__ import annotations

import enum

import torch

__all__ = [
    "data_type",
    "heur_mode",
    "diagonal_alignment",
    "attention_implementation",
    "tensor_reordering",
    "build_plan_policy",
    "to_data_type",
    "torch_dtype_of",
]


class data_type(enum.Enum):
    """Tensor element types (cuDNN's ``cudnn.data_type``). ``NOT_SET`` means "inherit"."""

    NOT_SET = 0
    FLOAT = 1
    DOUBLE = 2
    HALF = 3
    INT8 = 4
    INT32 = 5
    INT8x4 = 6
    UINT8 = 7
    UINT8x4 = 8
    INT8x32 = 9
    BFLOAT16 = 10
    INT64 = 11
    BOOLEAN = 12
    FP8_E4M3 = 13
    FP8_E5M2 = 14
    FAST_FLOAT_FOR_FP8 = 15
    FP8_E8M0 = 16
    FP4_E2M1 = 17
    INT4 = 18


class heur_mode(enum.Enum):
    """Plan heuristics (cuDNN's ``cudnn.heur_mode``). fusedattn has one plan per graph, so every
    mode selects the same plan; the modes are accepted so cuDNN code runs unchanged."""

    A = 0
    B = 1
    FALLBACK = 2


class diagonal_alignment(enum.Enum):
    """Which corner the mask's diagonal starts from when ``s_q != s_kv``.

    ``TOP_LEFT``: query row ``i`` is aligned with key ``i`` (PyTorch's ``is_causal``).
    ``BOTTOM_RIGHT``: query row ``i`` is aligned with key ``i + s_kv - s_q`` (the last query
    sees the last key; per sequence when a padding mask gives lengths).
    """

    TOP_LEFT = 0
    BOTTOM_RIGHT = 1


class attention_implementation(enum.Enum):
    """cuDNN's engine family choice; fusedattn accepts every value and runs its own kernel."""

    AUTO = 0
    COMPOSITE = 1
    UNIFIED = 2


class tensor_reordering(enum.Enum):
    """Special memory orders of cuDNN tensors; fusedattn supports ``NONE`` only."""

    NONE = 0
    INT8x32 = 1
    F16x16 = 2
    F8_128x4 = 3


class build_plan_policy(enum.Enum):
    """cuDNN's ``build_plans(policy)`` argument; fusedattn builds its single plan either way."""

    HEURISTICS_CHOICE = 0
    ALL = 1


def _torch_pairs():
    pairs = [
        (torch.float32, data_type.FLOAT),
        (torch.float64, data_type.DOUBLE),
        (torch.float16, data_type.HALF),
        (torch.bfloat16, data_type.BFLOAT16),
        (torch.int8, data_type.INT8),
        (torch.uint8, data_type.UINT8),
        (torch.int32, data_type.INT32),
        (torch.int64, data_type.INT64),
        (torch.bool, data_type.BOOLEAN),
    ]
    # FP8 dtypes exist only in newer torch builds; map them when present.
    for attr, dt in (("float8_e4m3fn", data_type.FP8_E4M3), ("float8_e5m2", data_type.FP8_E5M2),
                     ("float8_e8m0fnu", data_type.FP8_E8M0)):
        if hasattr(torch, attr):
            pairs.append((getattr(torch, attr), dt))
    return pairs


_TORCH_TO_DT = dict(_torch_pairs())
_DT_TO_TORCH = {dt: t for t, dt in _TORCH_TO_DT.items()}


def to_data_type(value, what: str = "data_type") -> data_type:
    """``data_type`` from a ``data_type``, a ``torch.dtype`` or ``None`` (-> ``NOT_SET``).

    Raises ``TypeError`` naming ``what`` for anything else.
    """
    if value is None:
        return data_type.NOT_SET
    if isinstance(value, data_type):
        return value
    if isinstance(value, torch.dtype):
        try:
            return _TORCH_TO_DT[value]
        except KeyError:
            raise TypeError(f"{what}: torch dtype {value} has no cuDNN data_type") from None
    raise TypeError(f"{what} must be a cudnn data_type or a torch.dtype, got {value!r}")


def torch_dtype_of(dt: data_type):
    """The torch dtype of a ``data_type``, or ``None`` when torch has none (NOT_SET, INT8x4 ...)."""
    return _DT_TO_TORCH.get(dt)
