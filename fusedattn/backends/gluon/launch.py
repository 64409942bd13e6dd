"""Gluon kernel launches with less host time: the compiled kernel is cached per argument signature
and TMA descriptors are plain tuples on the repeat path.

Through ``kernel[grid](...)`` a Gluon launch binds and specializes every argument, builds the
specialization string of each TMA descriptor and looks the kernel up; the Gluon
``TensorDescriptor`` re-checks alignment and strides in Python when built. On the H100 machine's
host an eager padded forward spent 0.29 ms of host time for 0.18 ms of GPU time, and the padded
backward 0.62 ms for 0.56 ms (bench/NOTES.md 30), so those calls were host-bound.

:class:`Tma` holds a descriptor's fields. :func:`launch` keys the kernel's cache on what the JIT
specializes on (:func:`signature_key`); a repeat signature calls the compiled kernel's launcher
directly (``backends.triton.launch.Launcher``), whose C side builds the ``CUtensorMap`` from the
tuple's base, shape and strides; a new signature goes through the JIT once, with real descriptors.
The callers' ``supports`` has checked TMA's rules (``fwd_sm90._tma_ready``) on every tensor.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..triton.launch import Launcher

__all__ = ["Tma", "launch", "signature_key"]


class Tma(NamedTuple):
    """A TMA descriptor's arguments. The compiled launcher reads base, shape, strides and padding;
    the JIT specializes on the base's dtype, block_shape and layout."""
    base: torch.Tensor
    shape: Any                  # sizes, outermost first
    strides: Any                # element strides, the last 1
    block_shape: tuple          # the box one TMA copy moves
    layout: Any                 # the shared-memory layout (NVMMASharedLayout) of a box
    padding: str = "zero"

    def descriptor(self) -> TensorDescriptor:
        """The checked Gluon descriptor (for the JIT's first launch of a signature)."""
        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape), self.layout,
                                self.padding)


def _tma_key(a):
    # the layout by identity: layouts are built once and kept (``fwd_sm90._smem_layout``), and a
    # frozen dataclass's hash rebuilds a tuple of its fields on every call
    return a.base.dtype, a.block_shape, id(a.layout)


def _int_key(a):
    # the JIT's integer specializations: the width, == 1, divisible by 16
    return a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31


_ARG_KEYS = {
    Tma: _tma_key,
    torch.Tensor: lambda a: (a.dtype, a.data_ptr() % 16 == 0),
    bool: lambda a: a,
    int: _int_key,
    float: lambda a: float,
}


def signature_key(args, kwargs) -> tuple:
    """The cache key of one launch: what the JIT specializes on for each positional argument (a
    tensor's dtype and 16-byte alignment, an integer's value class, a descriptor's dtype, box and
    layout) and the values of the keyword ones (constexprs and launch options; the call site fixes
    their order)."""
    try:
        return tuple(_ARG_KEYS[type(a)](a) for a in args), tuple(kwargs.items())
    except KeyError as exc:
        raise TypeError(f"fusedattn: unexpected kernel argument type {exc}") from None


def _jit_arg(a):
    return a.descriptor() if isinstance(a, Tma) else a


_LAUNCHERS: dict = {}


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` for a Gluon kernel whose TMA descriptor arguments are
    :class:`Tma` tuples; a repeat signature skips the JIT (see the module docstring)."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = Launcher(kernel, jit_arg=_jit_arg)
    launcher(signature_key(args, kwargs), grid, *args, **kwargs)
