"""Hugging Face transformers integration: ``attn_implementation="fusedattn"``.

Usage::

    import fusedattn.integrations.transformers as fa_hf
    fa_hf.register()                                   # once per process (idempotent)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fusedattn")
    model.set_attn_implementation("fusedattn")         # or switch an existing model

Importing this module imports ``transformers``; importing ``fusedattn`` does not.

What :func:`attention_forward` honours (the signature of transformers' attention functions,
``(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)``; query
``[b, h_q, s_q, d]``, key/value ``[b, h_kv, s_kv, d]``; returns ``(out [b, s_q, h_q, d], None)``):

* ``scaling`` -> ``attn_scale`` (None: ``1/sqrt(d)``).
* ``dropout`` -> ``dropout_p`` (transformers passes 0 in eval; in training fusedattn's own Philox
  dropout runs, seeded from torch's default generator: reproducible under ``torch.manual_seed``
  but not the same mask as eager/SDPA draw).
* GQA/MQA: key/value are read in place (no ``repeat_kv``); ``h_q`` must be a multiple of ``h_kv``.
* ``attention_mask``: the 4-D mask built by transformers' mask interface. ``register()`` also
  registers transformers' own ``sdpa_mask`` for ``"fusedattn"`` in ``AttentionMaskInterface``
  (otherwise transformers builds no mask at all for a custom implementation, and padded batches
  would be silently wrong), so the mask is a bool keep-mask, passed as fusedattn's bool
  ``attn_bias``; a float (additive) 4-D mask, e.g. one a user passes, goes in as a float
  ``attn_bias``. A mask longer than the keys is cut to ``s_kv``. The mask is authoritative: it
  already encodes causality, padding and the sliding window, so ``causal``/``window`` are not
  added on top (exactly as the sdpa and eager integrations do).
* ``attention_mask is None``: ``sdpa_mask`` drops the mask only where PyTorch's ``is_causal``
  (top-left alignment) is right: a single query (no causal mask needed: we pass
  ``causal=False``), ``s_q == s_kv`` with no padding, or the prefill of an empty static cache
  (``s_kv > s_q``, the extra keys are future cache slots: top-left is right there and
  bottom-right would be wrong). So, like transformers' sdpa integration, ``causal = is_causal and
  s_q > 1`` with ``causal_alignment="top_left"``; ``is_causal`` comes from ``kwargs`` if given,
  else ``module.is_causal`` (default True).
* ``sliding_window`` (kwargs; transformers keeps ``sliding_window`` keys including the query's
  own: ``kv_idx > q_idx - sliding_window``) -> ``window=(sliding_window - 1, 0 or -1)`` when no
  mask is given (with a mask it is already in the mask). ``sdpa_mask`` never drops the mask while
  the window can cut anything, so this matters only for callers that pass no mask themselves.
* ``softcap`` (kwargs, Gemma 2) -> ``softcap`` (``softcap * tanh(scale * q k^T / softcap)``,
  before the mask, as Gemma 2's eager attention).
* Sinks (``s_aux``, GPT-OSS's per-head ``sinks`` parameter, float ``[h_q]``) -> ``sink``: one more
  logit per head in each row's softmax denominator with no value, as GPT-OSS's eager attention
  concatenates it to the scores and drops its column after the softmax; the sink gets its gradient.
  ``position_bias`` (T5-style) is not supported: raises ``fusedattn.NotSupportedError``.
* ``output_attentions``: weights are never materialized; returns None (one warning), as sdpa.
* Packed sequences with their boundaries (``cu_seq_lens_q`` / ``cu_seq_lens_k``, and ``max_length_q`` /
  ``max_length_k`` when given: what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds to
  the batch and transformers hands every attention call, batch 1) -> :func:`fusedattn.attention_varlen`
  over the packed tokens: each sequence attends only to itself, with no ``[s, s]`` mask (the mask
  transformers may also build from ``position_ids`` says the same and is not read). Packed rows given by
  ``position_ids`` alone get transformers' block-diagonal mask, read as above.
"""
from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..functional import attention
from ..problem import NotSupportedError
from ..varlen import attention_varlen

__all__ = ["register", "attention_forward", "NAME"]

NAME = "fusedattn"

_warned: set = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs):
    """transformers' attention function for ``attn_implementation="fusedattn"`` (see the module doc)."""
    sink = kwargs.get("s_aux")
    if sink is None:
        sink = kwargs.get("sinks")
    if kwargs.get("position_bias") is not None:
        raise NotSupportedError("fusedattn's transformers integration does not support `position_bias` "
                                "(T5-style relative bias) yet; use attn_implementation='eager' or 'sdpa'")
    if kwargs.get("output_attentions", False):
        _warn_once("output_attentions", "fusedattn does not materialize attention weights: "
                                        "output_attentions=True returns None for them")
    s_q, s_kv = query.shape[2], key.shape[2]
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    softcap = kwargs.get("softcap")
    opts = dict(attn_scale=scaling, dropout_p=float(dropout or 0.0), softcap=float(softcap or 0.0), sink=sink)
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(f"fusedattn expects a 4-D attention_mask [b or 1, h or 1, s_q, s_kv] from "
                             f"transformers' mask interface, got shape {list(attention_mask.shape)}")
        if attention_mask.shape[-1] > s_kv:
            attention_mask = attention_mask[..., :s_kv]
        if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
            attention_mask = attention_mask.to(query.dtype)
        opts["attn_bias"] = attention_mask
    else:
        causal = bool(is_causal) and s_q > 1
        sliding_window = kwargs.get("sliding_window")
        window = None
        if sliding_window is not None and sliding_window > 0 and s_kv > 0:
            window = (int(sliding_window) - 1, 0 if causal else -1)
        opts.update(causal=causal, causal_alignment="top_left", window=window)
    packed = _packed_boundaries(query, kwargs)
    if packed is not None:
        return _attention_packed(query, key, value, packed, is_causal, kwargs.get("sliding_window"), opts), None
    out = attention(query, key, value, **opts)
    return out.transpose(1, 2).contiguous(), None


def _packed_boundaries(query: torch.Tensor, kwargs: dict):
    """(cu_q, cu_k, max_q, max_k) when transformers passes packed-sequence boundaries for a batch of one
    packed row, else None. cu_* int32 [n + 1]; max_* ints (computed from cu_* when not given)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None or query.shape[0] != 1:
        return None
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    max_q = int(max_q) if max_q is not None else int(cu_q.diff().max())
    max_k = int(max_k) if max_k is not None else int(cu_k.diff().max())
    return cu_q, cu_k, max_q, max_k


def _attention_packed(query, key, value, packed, is_causal, sliding_window, opts):
    """The packed row [1, h, total, d] as fusedattn's varlen layout [total, h, d] (views, no copy), each
    sequence causal from its own start (as FlashAttention's varlen call in transformers), the window
    likewise; returns [1, total, h_q, d_v]."""
    cu_q, cu_k, max_q, max_k = packed
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    causal = bool(is_causal) and max_q > 1
    window = None
    if sliding_window is not None and sliding_window > 0:
        window = (int(sliding_window) - 1, 0 if causal else -1)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, attn_scale=opts["attn_scale"], causal=causal,
                           window=window, softcap=opts["softcap"], dropout_p=opts["dropout_p"], sink=opts["sink"])
    return out.unsqueeze(0)


def register(name: str = NAME) -> None:
    """Add ``name`` (default ``"fusedattn"``) to transformers' ``AttentionInterface`` and its mask
    builder (transformers' ``sdpa_mask``: bool keep-masks, dropped where ``is_causal`` suffices) to
    ``AttentionMaskInterface``. Idempotent."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
