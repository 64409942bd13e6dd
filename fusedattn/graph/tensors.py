"""Graph tensors: descriptions (dims, strides, data type, uid), never data.

A ``tensor`` is what ``pygraph.tensor(...)`` / ``tensor_like(...)`` create and what
``sdpa`` returns. Setters return the tensor, so cuDNN's chains work::

    o.set_output(True).set_dim(Q.shape).set_stride(Q.stride())

Tensors are hashable by identity: a variant pack is ``{graph_tensor: torch_tensor}``.
Once the graph is built its tensors are frozen (a setter raises :class:`GraphError`),
because the built graph caches its translation.
"""
from __future__ import annotations

from .enums import data_type, tensor_reordering, to_data_type
from .errors import GraphError

__all__ = ["tensor"]


def _int_list(value, what: str, label: str):
    """``list[int]`` from a list/tuple/torch.Size of non-negative ints, else GraphError."""
    if value is None:
        return None
    try:
        out = [int(x) for x in value]
        ok = all(not isinstance(x, bool) and int(x) == x for x in value)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise GraphError(f"tensor {label}: {what} must be a sequence of ints, got {value!r}")
    if any(x < 0 for x in out):
        raise GraphError(f"tensor {label}: {what} must be non-negative, got {out}")
    return out


class tensor:  # noqa: N801 (cuDNN's spelling: cudnn.tensor)
    """A tensor of a graph: dims ``[d0, d1, ...]``, strides in elements, a data type, a uid.

    cuDNN's rule for virtual tensors: tensors created with ``pygraph.tensor``/``tensor_like``
    are non-virtual (the user supplies them at execute); tensors an operation returns are
    virtual until ``set_output(True)``, which asks for them in the variant pack.
    """

    __slots__ = ("_graph", "_name", "_dim", "_stride", "_data_type", "_uid", "_uid_explicit",
                 "_virtual", "_pass_by_value", "_ragged_offset", "_reordering", "_device",
                 "_producer", "_roles", "__weakref__")

    def __init__(self, graph, *, dim=None, stride=None, data_type=None, is_virtual=False,
                 is_pass_by_value=False, ragged_offset=None, reordering_type=None, name="",
                 uid=-1, device=None, producer=None):
        self._graph = graph
        self._name = str(name or "")
        self._roles = []          # "sdpa_0.q" ... for messages when the tensor has no name
        self._producer = producer  # the node that writes it, when an operation created it
        self._dim = _int_list(dim, "dim", self._label_hint())
        self._stride = _int_list(stride, "stride", self._label_hint())
        self._data_type = to_data_type(data_type, "data_type")
        self._virtual = bool(is_virtual)
        self._pass_by_value = bool(is_pass_by_value)
        self._ragged_offset = None
        self._reordering = tensor_reordering.NONE if reordering_type is None else reordering_type
        self._device = device      # torch.device when created from a torch tensor (tensor_like)
        self._uid = -1
        self._uid_explicit = False
        if uid is not None and uid != -1:
            self._set_uid(uid)
        if ragged_offset is not None:
            self.set_ragged_offset(ragged_offset)

    # -- labels for messages -------------------------------------------------------------
    def _label_hint(self) -> str:
        return repr(self._name) if self._name else "(unnamed)"

    def label(self) -> str:
        """How messages name this tensor: ``'name'``, else its role (``sdpa_0.k``), and its uid."""
        if self._name:
            text = repr(self._name)
        elif self._roles:
            text = repr(self._roles[0])
        else:
            text = "(unnamed)"
        if self._uid != -1:
            text += f" (uid {self._uid})"
        return text

    def _check_mutable(self, what: str) -> None:
        g = self._graph
        if g is not None and g._is_built():
            raise GraphError(
                f"tensor {self.label()}: cannot {what} after the graph was built (the built graph "
                f"caches its translation); create a new graph")
        if g is not None:
            g._invalidate()

    # -- setters (chainable) ---------------------------------------------------------------
    def set_output(self, is_output: bool = True) -> "tensor":
        """Mark as a graph output (non-virtual): it must then be in the variant pack."""
        self._check_mutable("set_output")
        self._virtual = not bool(is_output)
        return self

    def set_is_virtual(self, is_virtual: bool = True) -> "tensor":
        """cuDNN's other spelling of ``set_output(not is_virtual)``."""
        self._check_mutable("set_is_virtual")
        self._virtual = bool(is_virtual)
        return self

    def set_dim(self, dim) -> "tensor":
        """Dims, e.g. ``[b, h, s, d]``; a ``torch.Size`` works."""
        self._check_mutable("set_dim")
        self._dim = _int_list(dim, "dim", self.label())
        return self

    def set_stride(self, stride) -> "tensor":
        """Strides in elements, one per dim (``tensor.stride()`` of the torch tensor)."""
        self._check_mutable("set_stride")
        self._stride = _int_list(stride, "stride", self.label())
        return self

    def set_data_type(self, dtype) -> "tensor":
        """Element type: a ``cudnn.data_type`` or a ``torch.dtype``."""
        self._check_mutable("set_data_type")
        self._data_type = to_data_type(dtype, f"tensor {self.label()} data_type")
        return self

    def set_name(self, name: str) -> "tensor":
        """A name for messages and for ``Graph`` dict calls."""
        self._check_mutable("set_name")
        self._name = str(name)
        return self

    def _set_uid(self, uid) -> None:
        if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
            raise GraphError(f"tensor {self.label()}: uid must be an int >= 0, got {uid!r}")
        self._uid, self._uid_explicit = int(uid), True

    def set_uid(self, uid: int) -> "tensor":
        """The int that keys this tensor in a uid-keyed variant pack (unique in the graph)."""
        self._check_mutable("set_uid")
        self._set_uid(uid)
        return self

    def set_is_pass_by_value(self, value: bool = True) -> "tensor":
        """Mark a one-element tensor whose value is read on the host (cuDNN's scalar inputs)."""
        self._check_mutable("set_is_pass_by_value")
        self._pass_by_value = bool(value)
        return self

    def set_ragged_offset(self, offset: "tensor") -> "tensor":
        """Packed variable-length layout (THD): ``offset`` is an int ``[b+1, 1, 1, 1]`` graph tensor of
        element offsets of each sequence's first token (cuDNN's ragged offset). An sdpa /
        sdpa_backward node whose q/k/v/o (and dO/dQ/dK/dV) all carry one runs the packed varlen
        kernels (``graph/ragged.py``); bias or paged K/V with it raise ``cudnnGraphNotSupportedError``.
        An sdpa node whose q and O carry one over padded or paged K/V (chunked prefill) runs
        ``attention_with_kvcache(cu_seqlens_q=...)`` (forward only; no bias or dropout there)."""
        self._check_mutable("set_ragged_offset")
        if offset is not None and not isinstance(offset, tensor):
            raise GraphError(f"tensor {self.label()}: set_ragged_offset expects a graph tensor, "
                             f"got {type(offset).__name__}")
        self._ragged_offset = offset
        return self

    def set_reordering_type(self, reordering) -> "tensor":
        """Only ``tensor_reordering.NONE`` runs; others fail at ``check_support``."""
        self._check_mutable("set_reordering_type")
        self._reordering = reordering
        return self

    # -- getters -------------------------------------------------------------------------
    def get_dim(self):
        """Dims as a list (empty when not set)."""
        return list(self._dim or [])

    def get_stride(self):
        """Strides as a list (empty when not set)."""
        return list(self._stride or [])

    def get_data_type(self) -> data_type:
        """The element type (``NOT_SET`` until given or inferred at ``validate``)."""
        return self._data_type

    def get_name(self) -> str:
        """The name (operations name their outputs ``op::O``, ``op::Stats``, ``op::dQ`` ...)."""
        return self._name

    def get_uid(self) -> int:
        """The uid (-1 until set, or until the graph is validated, which assigns free ones)."""
        return self._uid

    def get_is_virtual(self) -> bool:
        """True for an operation output not marked ``set_output(True)``."""
        return self._virtual

    def get_is_pass_by_value(self) -> bool:
        """True for a one-element tensor read on the host."""
        return self._pass_by_value

    def get_ragged_offset(self):
        """The ragged-offset graph tensor, or None."""
        return self._ragged_offset

    def get_reordering_type(self):
        """The ``tensor_reordering`` (``NONE`` unless set)."""
        return self._reordering

    def __repr__(self):
        kind = "virtual" if self._virtual else "io"
        return (f"<graph tensor {self.label()} dim={self._dim} stride={self._stride} "
                f"{self._data_type.name} {kind}>")
