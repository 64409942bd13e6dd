"""fusedattn under PyTorch's ``F.scaled_dot_product_attention`` (opt-in, never on import).

Usage::

    import fusedattn.integrations.torch as fa_torch
    fa_torch.activate()                 # from now on, in this thread: SDPA calls fusedattn can run go to it
    ...
    fa_torch.deactivate()
    with fa_torch.enabled():            # or for a block
        loss = model(x).sum()           # model code calls F.scaled_dot_product_attention as before

Each call is decided on its own by :func:`unsupported_reason` (shapes, dtypes and flags only: no
device sync, nothing read from the tensors). fusedattn takes the call when all of these hold, and
PyTorch's own SDPA runs it otherwise (so every error is PyTorch's own):

* q, k, v plain CUDA tensors on one device, 4-D ``[b, h, s, d]`` (any strides), all float16 or all
  bfloat16; the same batch; k and v the same heads and length; ``d`` of q and k equal; ``d`` and
  ``d_v`` up to 256; no empty dimension;
* ``h_q == h_kv``, or ``enable_gqa=True`` and ``h_q`` a multiple of ``h_kv`` (K/V read in place);
* ``attn_mask``: None, a bool mask (True = takes part) or a float bias of q's dtype (added to the
  scaled scores; a bias with ``requires_grad`` gets its gradient), on q's device, broadcastable
  to ``[b, h_q, s_q, s_kv]``; not together with ``is_causal`` (PyTorch decides that pairing);
* ``is_causal``: top-left aligned, as PyTorch's (key ``j`` kept for query ``i`` iff ``j <= i``);
* ``scale``: None (``1/sqrt(d)``) or a float > 0;
* ``dropout_p`` in ``[0, 1)``. fusedattn draws its own Philox mask, seeded from torch's default
  generator (reproducible under ``torch.manual_seed``, not the same mask as PyTorch's). Under
  ``torch.compile`` and during a CUDA graph capture a call with dropout goes to PyTorch (drawing
  the seed reads a number on the host, which neither allows);
* not every fused backend switched off: inside ``sdpa_kernel(SDPBackend.MATH)`` PyTorch's math runs.

Rows that a mask leaves with no key give output 0 and gradient 0 (as PyTorch 2.5+'s math, efficient
and cuDNN backends do; its math backend gave NaN before 2.5). Outputs and gradients match PyTorch's
within the usual rounding of a different summation order.

Mechanisms (both installed by :func:`activate`, both removed by :func:`deactivate`):

* **Every torch (2.11+): a** ``torch.overrides.TorchFunctionMode`` that sees each call of
  ``F.scaled_dot_product_attention`` (however it was imported) and routes it as above. It is the
  documented public way to intercept a torch function; ``torch.compile(fullgraph=True)`` traces
  through it (the mode is part of the guards: a function compiled while active recompiles after
  :func:`deactivate`). Limits: a mode is per thread (``activate()`` covers the thread that called it;
  call it in each thread that runs models, or use ``enabled()`` there), and while active every torch
  call of that thread passes one Python check (about a microsecond on a CPU host).
* **torch 2.13+: torch's own registry** (``torch.nn.attention.register_flash_attention_impl``, as
  FlashAttention-4 registers itself): this module registers ``"fusedattn"`` on import (registration
  only) and :func:`activate` calls ``activate_flash_attention_impl("fusedattn")``, which replaces the
  CUDA kernels of ``aten::_scaled_dot_product_flash_attention`` and its backward (SDPA's flash slot),
  so calls the mode cannot see (other threads, code calling the aten op) run fusedattn too. The slot
  only ever sees unmasked calls; it hands dropout and anything :func:`unsupported_reason` refuses to
  the kernel it replaced (``torch.library.get_kernel``). :func:`deactivate` restores the implementation
  that was active before (PyTorch's FA2, or e.g. FA4).

CUDA graphs: a routed call syncs nothing and allocates through PyTorch's caching allocator, so it
captures (dropout excepted, see above).

Tests: ``_ALLOW_CPU = True`` (tests only) also routes CPU tensors (float32/64 included) to fusedattn's
CPU path, so the routing and the fused path run in CI without a GPU.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..functional import attention, attention_backward, attention_forward
from ..problem import MAX_HEAD_DIM as _MAX_HEAD_DIM

__all__ = ["activate", "deactivate", "enabled", "is_active", "unsupported_reason",
           "scaled_dot_product_attention", "NAME"]

NAME = "fusedattn"                                   # the name in torch's flash-attention registry
_TORCH_SDPA = F.scaled_dot_product_attention         # PyTorch's own (a builtin: the mode's key)
_ALLOW_CPU = False                                   # tests only: route CPU tensors to the CPU path
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------

def _tensor_reason(name: str, t) -> str | None:
    if type(t) is not torch.Tensor:        # subclasses (DTensor, nested, ...) keep PyTorch's semantics
        return f"{name} is not a plain torch.Tensor ({type(t).__name__})"
    if t.is_nested or t.layout != torch.strided:
        return f"{name} is nested or not strided"
    return None


def _device_reason(query) -> str | None:
    if query.device.type == "cuda":
        return None if query.dtype in _GPU_DTYPES else f"dtype {query.dtype} (fusedattn's GPU path: fp16/bf16)"
    if query.device.type == "cpu" and _ALLOW_CPU:
        return None if query.dtype in _CPU_DTYPES else f"dtype {query.dtype}"
    return f"device {query.device.type}"


def _shape_reason(query, key, value, enable_gqa) -> str | None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs are not 4-D [b, h, s, d]"
    b, h_q, s_q, d = query.shape
    bk, h_kv, s_kv, dk = key.shape
    bv, h_v, s_v, d_v = value.shape
    if not (b == bk == bv) or h_kv != h_v or s_kv != s_v or d != dk:
        return f"shapes q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}"
    if 0 in (b, h_q, h_kv, s_q, s_kv, d, d_v):
        return "an empty dimension"
    if h_q != h_kv and not (enable_gqa and h_q % h_kv == 0):
        return f"heads {h_q} / {h_kv} without enable_gqa (or not a multiple)"
    for dim in (d, d_v):
        if dim > _MAX_HEAD_DIM:
            return f"head dim {dim} (fusedattn: 1 to {_MAX_HEAD_DIM})"
    return None


def _mask_reason(query, key, attn_mask, is_causal) -> str | None:
    if attn_mask is None:
        return None
    why = _tensor_reason("attn_mask", attn_mask)
    if why:
        return why
    if is_causal:
        return "attn_mask together with is_causal"
    if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
        return f"attn_mask dtype {attn_mask.dtype} (bool or q's {query.dtype})"
    if attn_mask.device != query.device:
        return "attn_mask on another device"
    full = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if attn_mask.dim() > 4 or any(n not in (1, m) for n, m in zip(reversed(attn_mask.shape), reversed(full))):
        return f"attn_mask shape {tuple(attn_mask.shape)} does not broadcast to {list(full)}"
    return None


def _dropout_reason(dropout_p, device) -> str | None:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        return f"dropout_p {dropout_p!r}"
    if dropout_p == 0.0:
        return None
    if torch.compiler.is_compiling():
        return "dropout under torch.compile (the seed is read on the host)"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "dropout during a CUDA graph capture"
    return None


@torch.compiler.assume_constant_result
def _math_only() -> bool:
    """Whether every fused SDPA backend is switched off. Dynamo cannot trace these getters (a bool
    out of a torch function): under torch.compile the value is read once, when the call is traced."""
    b = torch.backends.cuda
    return not (b.flash_sdp_enabled() or b.mem_efficient_sdp_enabled() or b.cudnn_sdp_enabled())


def _backends_reason() -> str | None:
    # a user who keeps only SDPA's math backend (sdpa_kernel(SDPBackend.MATH)) asked for PyTorch's math
    return "only SDPA's math backend is enabled" if _math_only() else None


def unsupported_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False) -> str | None:
    """Why fusedattn does not take this ``F.scaled_dot_product_attention`` call, or None if it does.

    Arguments as PyTorch's SDPA (query ``[b, h_q, s_q, d]``, key ``[b, h_kv, s_kv, d]``, value
    ``[b, h_kv, s_kv, d_v]``, attn_mask broadcastable to ``[b, h_q, s_q, s_kv]``). Reads only
    metadata (shapes, dtypes, devices, flags): no sync, safe under ``torch.compile`` and capture.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        why = _tensor_reason(name, t)
        if why:
            return why
    if not (key.dtype == value.dtype == query.dtype) or not (key.device == value.device == query.device):
        return "q, k, v differ in dtype or device"
    if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        return "is_causal / enable_gqa not bools"
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0 and scale != float("inf")):
        return f"scale {scale!r} (fusedattn: a float > 0)"
    return (_device_reason(query) or _shape_reason(query, key, value, enable_gqa)
            or _mask_reason(query, key, attn_mask, is_causal) or _dropout_reason(dropout_p, query.device)
            or _backends_reason())


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``F.scaled_dot_product_attention`` with fusedattn where :func:`unsupported_reason` allows it.

    Same arguments and result as PyTorch's (``[b, h_q, s_q, d_v]`` in q's dtype); callable directly
    whether or not :func:`activate` was called.
    """
    if unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) is not None:
        return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    return attention(query, key, value, attn_scale=scale, causal=is_causal, causal_alignment="top_left",
                     attn_bias=attn_mask, dropout_p=float(dropout_p))


# ---------------------------------------------------------------------------------------------
# Mechanism 1 (torch 2.11+): a TorchFunctionMode
# ---------------------------------------------------------------------------------------------

class SDPAMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` calls through :func:`scaled_dot_product_attention`;
    every other torch call passes unchanged. (PyTorch disables the mode while its handler runs, so
    the fallback to PyTorch's SDPA does not come back here.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _TORCH_SDPA:
            return scaled_dot_product_attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


_local = threading.local()          # .mode: the SDPAMode activate() entered in this thread


# ---------------------------------------------------------------------------------------------
# Mechanism 2 (torch 2.13+): SDPA's flash slot through torch's flash-attention registry
# ---------------------------------------------------------------------------------------------

_FLASH_FWD = "aten::_scaled_dot_product_flash_attention"
_FLASH_BWD = "aten::_scaled_dot_product_flash_attention_backward"


class _FlashSlotHandle:
    """What torch's registry keeps while ``"fusedattn"`` is the active flash implementation."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()      # deregisters our kernels: the ones we replaced run again
            self.library = None


def _flash_slot_reason(query, key, value, dropout_p, return_debug_mask=False) -> str | None:
    """The flash slot's refusals: the SDPA ones, plus dropout (the slot's Philox state is PyTorch's)
    and ``d_v != d`` (the slot's output is shaped like the query)."""
    if dropout_p or return_debug_mask:
        return "dropout or debug mask in the flash slot"
    if value.dim() == 4 and query.dim() == 4 and value.shape[-1] != query.shape[-1]:
        return "d_v != d in the flash slot"
    return unsupported_reason(query, key, value, enable_gqa=True)


def _flash_forward(original, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                   scale=None):
    """``aten::_scaled_dot_product_flash_attention``: BHSD q/k/v -> (out like q, lse fp32 [b, h, s_q],
    None, None, s_q, s_kv, rng_state, unused, debug_mask) as PyTorch's meta function shapes them."""
    if _flash_slot_reason(query, key, value, dropout_p, return_debug_mask) is not None:
        return original(query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
    out = torch.empty_like(query)
    stats = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    attention_forward(query, key, value, attn_scale=scale, causal=is_causal, out=out, stats_out=stats)
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, stats, None, None, query.shape[2], key.shape[2], rng_state, unused, debug


def _flash_backward(original, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                    dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward``: (dq, dk, dv) like q, k, v. The same
    refusals as the forward, so a call goes back to the implementation that ran its forward (both
    use the natural-log log-sum-exp of the scaled scores, so either could take either)."""
    if _flash_slot_reason(query, key, value, dropout_p) is not None:
        return original(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                        dropout_p, is_causal, philox_seed, philox_offset, scale=scale)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    # dq / dk / dv: attention_backward allocates them like query / key / value (empty_like, as aten does)
    dq, dk, dv, _ = attention_backward(query, key, value, out, grad_out, logsumexp, attn_scale=scale,
                                       causal=is_causal)
    return dq, dk, dv


def _missing_kernel(*args, **kwargs):
    raise NotImplementedError("no PyTorch flash kernel for this dispatch key to fall back to")


def _register_flash_slot(dispatch_key: str = "CUDA", require_original: bool = True):
    """torch's ``register_fn`` for ``"fusedattn"``: replace the flash slot's kernels for
    ``dispatch_key``, keeping the replaced ones for the calls we refuse. Returns the handle the
    registry keeps (``remove()`` restores the replaced kernels), or None where the key has no flash
    kernel to replace (a CPU-only build); ``require_original=False`` (tests, on "CPU") registers
    anyway, refused calls then raising NotImplementedError."""
    try:
        fwd_kernel, bwd_kernel = (torch.library.get_kernel(name, dispatch_key) for name in (_FLASH_FWD, _FLASH_BWD))
    except RuntimeError:
        if require_original:
            return None
        fwd_kernel = bwd_kernel = None
    # the kernels are boxed calls that want the dispatch keys first; these adapters restore the
    # plain signature for _flash_forward / _flash_backward's fallback
    keys = torch._C.DispatchKeySet(dispatch_key)

    def fwd_original(*args, **kwargs):
        return (fwd_kernel.call_boxed(keys, *args, **kwargs) if fwd_kernel is not None
                else _missing_kernel())

    def bwd_original(*args, **kwargs):
        return (bwd_kernel.call_boxed(keys, *args, **kwargs) if bwd_kernel is not None
                else _missing_kernel())

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention",
             lambda *a, **k: _flash_forward(fwd_original, *a, **k), dispatch_key)
    lib.impl("_scaled_dot_product_flash_attention_backward",
             lambda *a, **k: _flash_backward(bwd_original, *a, **k), dispatch_key)
    return _FlashSlotHandle(lib)


def _registry():
    """torch.nn.attention's flash-attention registry functions (torch 2.13+), or None."""
    import torch.nn.attention as nn_attention
    names = ("register_flash_attention_impl", "activate_flash_attention_impl",
             "current_flash_attention_impl", "restore_flash_attention_impl")
    if not all(hasattr(nn_attention, n) for n in names):
        return None
    return nn_attention


_reg = _registry()
if _reg is not None:
    # registration only (torch asks providers never to activate on import)
    _reg.register_flash_attention_impl(NAME, register_fn=_register_flash_slot)
_previous_impl: list = []           # the flash implementation active before activate() (None = PyTorch's)


# ---------------------------------------------------------------------------------------------
# Public switches
# ---------------------------------------------------------------------------------------------

def is_active() -> bool:
    """Whether :func:`activate` is in force in this thread."""
    return getattr(_local, "mode", None) is not None


def activate() -> None:
    """Route ``F.scaled_dot_product_attention`` to fusedattn (where it can run the call) in this
    thread, and on torch 2.13+ put fusedattn in SDPA's flash slot for the whole process. Idempotent."""
    if is_active():
        return
    mode = SDPAMode()
    mode.__enter__()
    _local.mode = mode
    if _reg is not None and _reg.current_flash_attention_impl() != NAME:
        _previous_impl[:] = [_reg.current_flash_attention_impl()]
        _reg.activate_flash_attention_impl(NAME)


def deactivate() -> None:
    """Undo :func:`activate` (this thread's mode; the flash slot's previous implementation comes
    back). A no-op when not active. Raises RuntimeError if a torch function mode entered after
    :func:`activate` is still active (leave that one first)."""
    mode = getattr(_local, "mode", None)
    if mode is not None:
        top = torch.overrides._get_current_function_mode()
        if top is not mode:
            raise RuntimeError(f"fusedattn.integrations.torch.deactivate(): another torch function mode "
                               f"({type(top).__name__}) was entered after activate() and is still active; "
                               "exit it first")
        mode.__exit__(None, None, None)
        _local.mode = None
    if _reg is not None and _reg.current_flash_attention_impl() == NAME:
        previous = _previous_impl[0] if _previous_impl else None
        if previous is not None:
            _reg.activate_flash_attention_impl(previous)
        else:
            _reg.restore_flash_attention_impl()
        _previous_impl.clear()


@contextlib.contextmanager
def enabled():
    """``with enabled(): ...``: :func:`activate` for the block; leaves things as they were after."""
    was_active = is_active()
    activate()
    try:
        yield
    finally:
        if not was_active:
            deactivate()
