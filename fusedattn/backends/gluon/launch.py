"""Gluon kernel launches with less host time: the compiled kernel is cached per argument signature,
TMA descriptors are plain tuples on the repeat path, and their encoded form is kept per tensor.

Through ``kernel[grid](...)`` a Gluon launch binds and specializes every argument, builds the
specialization string of each TMA descriptor and looks the kernel up; the Gluon
``TensorDescriptor`` re-checks alignment and strides in Python when built. On the H100 machine's
host an eager padded forward spent 0.29 ms of host time for 0.18 ms of GPU time, and the padded
backward 0.62 ms for 0.56 ms (bench/NOTES.md 30), so those calls were host-bound.

:class:`Tma` holds a descriptor's fields. :func:`launch` keys the kernel's cache on what the JIT
specializes on (:func:`signature_key`); a new signature goes through the JIT once, with real
descriptors. A repeat signature calls the kernel's C launcher directly (:func:`_direct`): Triton's
Python launcher would encode every descriptor anew (``make_tensordesc_arg``: a ``CUtensorMap``
from base, shape, strides and the kernel's box and swizzle) and allocate empty scratch on every
call; the direct path encodes a (base pointer, shape, strides) once and reuses it (bench/NOTES.md
45: the d64 forward's eager calls were host-bound). Where ``compat.direct_launch`` does not know
this Triton's launcher, or its self-check failed, the launch goes through Triton's ``run``.
The callers' ``supports`` has checked TMA's rules (``fwd_sm90._tma_ready``) on every tensor.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import compat
from ..triton.launch import Launcher
from ..triton.launch import signature_key as _signature_key

__all__ = ["Tma", "launch", "signature_key"]


class Tma(NamedTuple):
    """A TMA descriptor's arguments. The compiled launcher reads base, shape, strides and padding;
    the JIT specializes on the base's dtype, block_shape and layout."""
    base: torch.Tensor
    shape: Any                  # sizes, outermost first
    strides: tuple              # element strides, the last 1
    block_shape: tuple          # the box one TMA copy moves
    layout: Any                 # the shared-memory layout (NVMMASharedLayout) of a box
    padding: str = "zero"
    round_f32_to_tf32: bool = False     # read by Triton 3.7+'s descriptor encoder; fp32 stays fp32

    def descriptor(self) -> TensorDescriptor:
        """The checked Gluon descriptor (for the JIT's first launch of a signature)."""
        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape), self.layout,
                                self.padding)


def signature_key(args, kwargs, runtime_names=frozenset()) -> tuple:
    """The cache key of one launch (``triton.launch.signature_key``; runtime_names: the kernel's
    ``Launcher.runtime_names``), a :class:`Tma` keyed by its dtype, box and layout (the layout by value, through
    :func:`_layout_token`)."""
    return _signature_key(args, kwargs, Tma, _tma_key, runtime_names)


def _tma_key(a: Tma) -> tuple:
    return a.base.dtype, a.block_shape, _layout_token(a.layout)


_LAYOUT_TOKENS: dict = {}       # id(layout) -> (layout, its token)


def _layout_token(layout):
    """A layout's part of a launch key: equal for equal layouts, cheap for the same object. Layouts are built once
    and kept (``fwd_sm90._smem_layout``), so an identity lookup answers (a frozen dataclass's hash rebuilds a tuple
    of its fields on every call); the entry holds the layout, so its id is not reused by another object while the
    entry lives, and a layout made anew per call still keys by value (its repr), never by address: keyed by
    ``id()`` alone, the fused backward's per-call dQ layout missed the launch cache on most calls
    (bench/NOTES.md 88) and a reused address could have matched another layout's entry."""
    entry = _LAYOUT_TOKENS.get(id(layout))
    if entry is not None and entry[0] is layout:
        return entry[1]
    if len(_LAYOUT_TOKENS) >= 256:
        _LAYOUT_TOKENS.clear()
    token = repr(layout)
    _LAYOUT_TOKENS[id(layout)] = (layout, token)
    return token


def _jit_arg(a):
    return a.descriptor() if isinstance(a, Tma) else a


def _direct(compiled, tail, args):
    """The fast launch of ``compiled`` (``compat.direct_launch``), each TMA descriptor encoded once per
    (base pointer, shape, strides)."""
    return compat.direct_launch(compiled, tail, args, tuple(i for i, a in enumerate(args) if type(a) is Tma))


_LAUNCHERS: dict = {}


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` for a Gluon kernel whose TMA descriptor arguments are
    :class:`Tma` tuples; a repeat signature skips the JIT (see the module docstring)."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = Launcher(kernel, jit_arg=_jit_arg, direct=_direct, runtime_kinds=(Tma,))
    launcher(signature_key(args, kwargs, launcher.runtime_names), grid, *args, **kwargs)
