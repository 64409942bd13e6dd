"""``Graph``: the seeds' context-manager spelling over :class:`pygraph`.

::

    with cudnn.Graph(io_data_type=cudnn.data_type.HALF,
                     intermediate_data_type=cudnn.data_type.FLOAT,
                     compute_data_type=cudnn.data_type.FLOAT) as graph:
        output, stats = graph.sdpa(q=Q, k=K, v=V, attn_scale=scale, is_inference=True)
        output.set_output(True).set_dim(Q.shape).set_stride(Q.stride())
    result = graph(Q, K, V, handle=handle)     # built on exit; called with the inputs

Operations take torch tensors directly (each distinct tensor becomes one graph input, by
identity). On exit the graph is validated and built; an operation none of whose outputs was
marked ``set_output(True)`` gets its primary outputs marked (O; dQ, dK, dV). Calling it maps the positional arguments
to the graph's inputs **in the order the operations first read them**, each operation in its
signature order (``sdpa``: q, k, v, attn_scale, bias, seq_len_q, seq_len_kv, dropout seed and
offset, rng_dump, page tables; ``sdpa_with_paged_cache``: q, k, v, page_table, ...;
``sdpa_backward``: q, k, v, o, dO, stats, attn_scale, bias, dBias, ...; buffers an operation
writes, rng_dump and dBias, are inputs too), allocates every output marked
``set_output(True)`` with the dims, strides and data type set on it (or inferred), runs, and
returns the outputs in the order the operations created them: one tensor, or a tuple.
``set_io_tuples(inputs, outputs)`` (cuDNN's wrapper) fixes another order.
"""
from __future__ import annotations

import inspect
import weakref

import torch

from .enums import heur_mode, torch_dtype_of
from .errors import GraphError
from .graphs import pygraph
from .tensors import tensor

__all__ = ["Graph"]

_OPS = ("sdpa", "sdpa_backward", "sdpa_with_paged_cache", "sdpa_fp8", "sdpa_fp8_backward")
_SIGS = {op: inspect.signature(getattr(pygraph, op)) for op in _OPS}


class Graph:
    """A graph built by a ``with`` block and called like a function.

    Args (keyword-only, as cuDNN's ``cudnn.Graph``):
        handle: default handle for calls (a call's ``handle=`` wins).
        inputs, outputs: optional orders for positional calls (as ``set_io_tuples``).
        heuristics: ``cudnn.heur_mode`` list for ``create_execution_plans`` (default [A, FALLBACK]).
        workspace_alloc: accepted (fusedattn needs no workspace).
        io_data_type, intermediate_data_type, compute_data_type, name, backend, ...: passed to
            :class:`pygraph` (``torch.dtype`` values are accepted).
    """

    def __init__(self, *, handle=None, inputs=None, outputs=None, heuristics=None, workspace_alloc=True,
                 **kwargs):
        kwargs.setdefault("name", "graph")
        self._pg = pygraph(handle=handle, **kwargs)
        self._heuristics = list(heuristics) if heuristics else [heur_mode.A, heur_mode.FALLBACK]
        self._by_id = {}          # id(torch tensor) -> (weakref to it, graph tensor)
        self._strong = []         # construction-time references, so ids stay unique; dropped on exit
        self._io = (inputs, outputs)
        self._in_order = None     # positional inputs / returned outputs, fixed at build or by set_io_tuples
        self._out_order = None
        self._out_specs = None
        self._entered = False
        self._built = False

    # -- context manager --------------------------------------------------------------------
    def __enter__(self):
        if self._entered:
            raise GraphError("this Graph was already built; create a new one")
        self._entered = True
        return self

    def __exit__(self, exc_type, exc, tb):
        self._strong = []
        if exc_type is not None:
            return None          # propagate the error from the with block; build nothing
        self._mark_default_outputs()
        self._pg.validate()
        self._pg.build_operation_graph()
        self._pg.create_execution_plans(self._heuristics)
        self._pg.check_support()
        self._pg.build_plans()
        self._built = True
        inputs, outputs = self._io
        if inputs is not None or outputs is not None:
            self.set_io_tuples(inputs or self._default_inputs(), outputs or self._default_outputs())
        else:
            self._set_order(self._default_inputs(), self._default_outputs())
        return None

    def _set_order(self, inputs, outputs) -> None:
        # fixed once: a call only zips and allocates
        self._in_order, self._out_order = list(inputs), list(outputs)
        self._out_specs = [(tuple(t._dim), tuple(t._stride), torch_dtype_of(t._data_type)) for t in outputs]

    def _mark_default_outputs(self) -> None:
        """A graph that is called like a function must return something: for an operation none
        of whose outputs is marked (the seeds' paged and GQA snippets mark none), mark its
        primary outputs (O of sdpa; dQ, dK, dV of sdpa_backward), never its Stats."""
        consumed = {id(t) for n in self._pg._nodes for t in n.inputs.values()}
        for node in self._pg._nodes:
            made = [t for t in node.outputs.values() if t._producer is node]
            if all(t._virtual and id(t) not in consumed for t in made):
                for role in ("o", "dQ", "dK", "dV"):
                    if role in node.outputs:
                        node.outputs[role].set_output(True)

    # -- operations on torch tensors --------------------------------------------------------
    def _convert(self, value, arg: str):
        if isinstance(value, torch.Tensor):
            hit = self._by_id.get(id(value))
            if hit is not None and hit[0]() is value:
                return hit[1]
            gt = self._pg.tensor_like(value.detach(), name="")
            self._by_id[id(value)] = (weakref.ref(value), gt)
            self._strong.append(value)
            return gt
        if isinstance(value, tuple):
            return tuple(self._convert(x, arg) for x in value)
        return value

    def _op(self, op: str, args, kwargs):
        if self._built:
            raise GraphError(f"Graph.{op}: the graph is already built (operations go inside the with block)")
        bound = _SIGS[op].bind(self._pg, *args, **kwargs)
        call = {}
        for i, (name, value) in enumerate(bound.arguments.items()):
            if i == 0:
                continue     # self
            call[name] = self._convert(value, name)
        return getattr(self._pg, op)(**call)

    def sdpa(self, *args, **kwargs):
        """:meth:`pygraph.sdpa` taking torch tensors (or graph tensors); returns ``[o, stats]``."""
        return self._op("sdpa", args, kwargs)

    def sdpa_backward(self, *args, **kwargs):
        """:meth:`pygraph.sdpa_backward` taking torch tensors; returns ``[dQ, dK, dV]``."""
        return self._op("sdpa_backward", args, kwargs)

    def sdpa_with_paged_cache(self, *args, **kwargs):
        """:meth:`pygraph.sdpa_with_paged_cache` (the seeds' paged spelling) on torch tensors."""
        return self._op("sdpa_with_paged_cache", args, kwargs)

    def sdpa_fp8(self, *args, **kwargs):
        """:meth:`pygraph.sdpa_fp8` on torch tensors; returns ``[o, stats, amax_s, amax_o]``."""
        return self._op("sdpa_fp8", args, kwargs)

    def sdpa_fp8_backward(self, *args, **kwargs):
        """:meth:`pygraph.sdpa_fp8_backward` on torch tensors; returns dQ, dK, dV and four amaxes."""
        return self._op("sdpa_fp8_backward", args, kwargs)

    def __getattr__(self, name):
        # tensor, tensor_like, get_workspace_size, execute, key ... are the pygraph's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._pg, name)

    # -- calling ----------------------------------------------------------------------------
    def _default_inputs(self):
        return list(self._pg._seen_inputs)

    def _default_outputs(self):
        return [t for t in self._pg._tensors if t._producer is not None and not t._virtual]

    def _lookup(self, item, what: str, i: int):
        if isinstance(item, tensor):
            return item
        if isinstance(item, torch.Tensor):
            hit = self._by_id.get(id(item))
            if hit is not None and hit[0]() is item:
                return hit[1]
        if isinstance(item, str):
            hits = [t for t in self._pg._tensors if t._name == item]
            if len(hits) == 1:
                return hits[0]
        if isinstance(item, int) and not isinstance(item, bool) and item in self._pg._uid_to_tensor:
            return self._pg._uid_to_tensor[item]
        desc = (f"a torch tensor of shape {list(item.shape)}" if isinstance(item, torch.Tensor)
                 else repr(item))
        raise GraphError(f"{what} {i} ({desc}) is not a tensor of this graph (give graph tensors, the torch "
                         f"tensors its operations were given, names or uids)")

    def set_io_tuples(self, inputs, outputs) -> None:
        """Fix the order of positional inputs and returned outputs (graph tensors, the torch
        tensors the operations were given, names or uids)."""
        if not isinstance(inputs, (list, tuple)) or not isinstance(outputs, (list, tuple)):
            raise GraphError("set_io_tuples expects two lists (inputs, outputs)")
        if not self._built:
            self._io = (inputs, outputs)
            return
        self._set_order([self._lookup(x, "input", i) for i, x in enumerate(inputs)],
                        [self._lookup(x, "output", i) for i, x in enumerate(outputs)])

    def __call__(self, *args, handle=None, workspace=None):
        """Run the built graph: ``graph(Q, K, V, handle=h)`` -> output or tuple of outputs.

        A single dict argument is a variant pack (graph tensors / uids / names -> torch tensors);
        missing outputs are allocated, and the dict, with them added, is returned.
        """
        if not self._built:
            raise GraphError("call the graph after its with block has built it")
        if len(args) == 1 and isinstance(args[0], dict):
            return self._call_dict(args[0], handle, workspace)
        inputs, outputs = self._in_order, self._out_order
        if len(args) != len(inputs):
            names = ", ".join(t.label() for t in inputs)
            raise GraphError(f"the graph takes {len(inputs)} input(s), in the order its operations first "
                             f"read them ({names}); got {len(args)}")
        device = args[0].device if args and isinstance(args[0], torch.Tensor) else \
            next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        pack = dict(zip(inputs, args))
        results = [torch.empty_strided(dims, strides, dtype=dt, device=device)
                   for dims, strides, dt in self._out_specs]
        pack.update(zip(outputs, results))
        self._pg.execute(pack, workspace, handle)
        return results[0] if len(results) == 1 else tuple(results)

    @staticmethod
    def _alloc(t: tensor, device):
        return torch.empty_strided(t.get_dim(), t.get_stride(), dtype=torch_dtype_of(t.get_data_type()),
                                   device=device)

    def _call_dict(self, tensors: dict, handle, workspace):
        pack = {}
        for i, (key, val) in enumerate(tensors.items()):
            pack[self._lookup(key, "variant pack key", i)] = val
        device = next((v.device for v in pack.values() if isinstance(v, torch.Tensor)), None)
        for t in self._default_outputs():
            if t not in pack:
                tensors[t] = pack[t] = self._alloc(t, device)
        self._pg.execute(pack, workspace, handle)
        return tensors

    def __repr__(self):
        return f"<fusedattn Graph over {self._pg!r}>"
