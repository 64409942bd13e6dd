"""The two errors of the Graph door.

* :class:`GraphError` (a ``ValueError``): the graph or the variant pack is wrong: dims that
  disagree, an output without dims, a tensor missing from the pack, a tensor of the wrong
  dtype / shape / device, a workspace too small. The message names the tensor and the problem.
* :class:`cudnnGraphNotSupportedError` (cuDNN's name; a ``NotImplementedError`` through
  :class:`fusedattn.problem.NotSupportedError`): the graph is valid but fusedattn cannot run
  it (an FP8 graph, a score-mod callback, a feature the kernels do not have yet). cuDNN code
  that catches ``cudnn.cudnnGraphNotSupportedError`` to skip a configuration keeps working.
"""
from __future__ import annotations

from ..problem import FusedAttnError, NotSupportedError

__all__ = ["GraphError", "cudnnGraphNotSupportedError"]


class GraphError(FusedAttnError, ValueError):
    """A graph or variant pack that cannot run as given (bad input; names the tensor)."""


class cudnnGraphNotSupportedError(NotSupportedError):  # noqa: N801 (cuDNN's spelling)
    """A valid graph that fusedattn cannot run (names the argument or feature)."""
