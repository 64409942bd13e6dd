"""Handles, streams and the backend version: the module-level functions cuDNN code calls.

fusedattn needs no library context, so a handle only remembers its device and the stream
that :func:`set_stream` gave it; ``execute`` runs the kernels on that stream.
"""
from __future__ import annotations

import contextlib

import torch

from .errors import GraphError

__all__ = [
    "Handle",
    "create_handle",
    "destroy_handle",
    "set_stream",
    "get_stream",
    "backend_version",
    "backend_version_string",
]

# The cuDNN release whose SDPA semantics the Graph door follows (ANCHORS.md measured 9.19).
# cuDNN code gates features on it (``assert cudnn.backend_version() >= 90500``).
_BACKEND_VERSION = 91900


def backend_version() -> int:
    """The cuDNN version (as cuDNN encodes it, ``major*10000 + minor*100 + patch``) whose SDPA
    semantics fusedattn follows: ``91900``. fusedattn's own version is ``fusedattn.__version__``."""
    return _BACKEND_VERSION


def backend_version_string() -> str:
    """:func:`backend_version` as ``"9.19.0"``."""
    v = _BACKEND_VERSION
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


class Handle:
    """What :func:`create_handle` returns: the current CUDA device (or None) and a stream."""

    __slots__ = ("device", "stream", "destroyed", "_torch_stream")

    def __init__(self):
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.stream = None          # what the user passed to set_stream (int pointer or Stream)
        self._torch_stream = None   # the torch.cuda stream object built from it, once
        self.destroyed = False

    def __repr__(self):
        state = "destroyed" if self.destroyed else f"device={self.device}, stream={self.stream!r}"
        return f"<fusedattn handle {state}>"

    def check(self, where: str) -> None:
        """Raise GraphError if this handle was destroyed."""
        if self.destroyed:
            raise GraphError(f"{where}: the handle was destroyed by destroy_handle(); create a new one")

    def stream_context(self, device: torch.device):
        """A context that makes the handle's stream current for CUDA work (no-op otherwise)."""
        if self.stream is None or device.type != "cuda":
            return contextlib.nullcontext()
        if self._torch_stream is None:
            s = self.stream
            if isinstance(s, torch.cuda.Stream):
                self._torch_stream = s
            elif int(s) == 0:
                self._torch_stream = torch.cuda.default_stream(device)
            else:
                # A raw cudaStream_t, as cuDNN code passes ``torch.cuda.current_stream().cuda_stream``.
                self._torch_stream = torch.cuda.ExternalStream(int(s), device=device)
        return torch.cuda.stream(self._torch_stream)


def create_handle() -> Handle:
    """A new handle for the current CUDA device (any handle works on the CPU path too)."""
    return Handle()


def destroy_handle(handle: Handle) -> None:
    """Mark ``handle`` destroyed; executing with it afterwards raises :class:`GraphError`."""
    if not isinstance(handle, Handle):
        raise TypeError(f"destroy_handle expects a handle from create_handle(), got {type(handle).__name__}")
    handle.destroyed = True
    handle.stream = handle._torch_stream = None


def set_stream(handle: Handle, stream) -> None:
    """Run later ``execute`` calls made with ``handle`` on ``stream``.

    ``stream`` is a raw ``cudaStream_t`` int (``torch.cuda.current_stream().cuda_stream``, as
    cuDNN code passes it) or a ``torch.cuda.Stream``.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"set_stream expects a handle from create_handle(), got {type(handle).__name__}")
    handle.check("set_stream")
    if not (isinstance(stream, torch.cuda.Stream) or (isinstance(stream, int) and not isinstance(stream, bool))):
        raise TypeError(f"stream must be a cudaStream_t int or a torch.cuda.Stream, got {type(stream).__name__}")
    if stream is not handle.stream:
        handle.stream, handle._torch_stream = stream, None


def get_stream(handle: Handle):
    """The stream last given to :func:`set_stream` for ``handle`` (``None``: the current stream)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"get_stream expects a handle from create_handle(), got {type(handle).__name__}")
    return handle.stream
