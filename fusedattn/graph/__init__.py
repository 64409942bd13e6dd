"""cuDNN frontend's Python Graph API for SDPA, running fusedattn's kernels.

Code written for cuDNN frontend runs with one changed import::

    import fusedattn as cudnn

Both spellings work: the released frontend's ``cudnn.pygraph`` (tensors, ``sdpa``,
``sdpa_backward``, ``validate`` ... ``build_plans``, ``execute(variant_pack, workspace,
handle)``) and the seeds' ``with cudnn.Graph(...) as graph:`` context manager that builds on
exit and is then called as ``graph(Q, K, V, handle=handle)``.

The Graph door only translates: every ``sdpa`` / ``sdpa_backward`` node becomes one call of
:func:`fusedattn.functional.attention_forward` / ``attention_backward`` (the same path the
functional API takes), worked out once when the graph is built and reused by every
``execute``.

The modules, in cuDNN's order (build -> check_support -> execute):

* build: :mod:`.graphs` (``pygraph``, the graph's steps), :mod:`.tensors` (graph tensors),
  :mod:`.parse` (the sdpa call's arguments: band, stats flag, dropout, scale), :mod:`.nodes` (the
  SDPA nodes and their ``validate``), :mod:`.checks` (validate's dims / data-type checks),
  :mod:`.lower` (the lowered form: ``Call``, from ``build_operation_graph``);
* check_support: :mod:`.support` (the support probe: tiny inputs, naming what is not supported);
* execute: :mod:`.execute` (a lowered call run through :mod:`fusedattn.functional`),
  :mod:`.invocation` (its keyword arguments, shared by both paths), :mod:`.ragged` (packed THD
  calls through :mod:`fusedattn.varlen`);
* around them: :mod:`.wrapper` (the seeds' ``cudnn.Graph``), :mod:`.signatures` (cuDNN's argument
  lists), :mod:`.enums`, :mod:`.errors`, :mod:`.handle`; :mod:`.sdpa` re-exports the SDPA names.
"""
from .enums import (attention_implementation, build_plan_policy, data_type, diagonal_alignment,
                    heur_mode, tensor_reordering)
from .errors import GraphError, cudnnGraphNotSupportedError
from .handle import (Handle, backend_version, backend_version_string, create_handle, destroy_handle,
                     get_stream, set_stream)
from .graphs import pygraph
from .tensors import tensor
from .wrapper import Graph

__all__ = [
    "Graph",
    "pygraph",
    "tensor",
    "Handle",
    "create_handle",
    "destroy_handle",
    "set_stream",
    "get_stream",
    "backend_version",
    "backend_version_string",
    "data_type",
    "heur_mode",
    "diagonal_alignment",
    "attention_implementation",
    "tensor_reordering",
    "build_plan_policy",
    "GraphError",
    "cudnnGraphNotSupportedError",
]
