"""The SDPA nodes of a graph: cuDNN's arguments in, one functional call out (the names other
modules and the tests import from here, re-exported from the modules that hold them).

Each ``graph.sdpa(...)`` / ``graph.sdpa_backward(...)`` becomes a node. A node
does three things, at three moments:

* at the call: parse cuDNN's arguments (every spelling of the mask, dropout, stats flag)
  into one normalized description, raising :class:`GraphError` for contradictions
  (:mod:`.parse`, :mod:`.nodes`);
* at ``validate()``: check the tensors' dims against each other, infer the outputs' dims,
  strides and data types (as cuDNN does), raise ``cudnnGraphNotSupportedError`` for valid
  requests fusedattn cannot run (:mod:`.checks`, :mod:`.nodes`);
* at ``build_operation_graph()``: lower to a :class:`Call`: the uids to read from the variant
  pack with the shape/dtype each must have, and the keyword arguments of
  :func:`fusedattn.functional.attention_forward` / ``attention_backward`` that never change
  (:mod:`.lower`).
  ``execute`` then only looks tensors up, checks them cheaply and calls the function
  (:mod:`.execute`, :mod:`.invocation`, :mod:`.ragged`), after ``check_support`` has probed it once
  (:mod:`.support`).
"""
from __future__ import annotations

from .execute import build_invocation, invoke
from .lower import FEATURE_ARGS, Call, Req
from .nodes import SdpaBackwardNode, SdpaNode
from .support import probe

__all__ = ["FEATURE_ARGS", "Call", "Req", "SdpaNode", "SdpaBackwardNode", "build_invocation",
           "invoke", "probe"]
