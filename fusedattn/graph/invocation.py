"""The functional layer's keyword arguments of a lowered call (execute): the fixed ones and the scalars
read from their tensors, checked against the function's signature; shared by the dense path
(:mod:`.execute`) and the packed one (:mod:`.ragged`)."""
from __future__ import annotations

import inspect
from typing import Dict, Optional

import torch

from ..problem import NotSupportedError
from .lower import Call

def _functional():
    """The functional layer, imported late so the Graph door imports even while it is absent."""
    from .. import functional
    return functional


_PARAMS_CACHE: Dict[object, Optional[frozenset]] = {}


def _signature_params(fn):
    """The keyword names ``fn`` accepts, or None when it takes ``**kwargs`` (or is opaque).
    Cached per function: ``inspect.signature`` costs tens of microseconds, execute must not."""
    try:
        return _PARAMS_CACHE[fn]
    except KeyError:
        pass
    try:
        params = inspect.signature(fn).parameters
        names = None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) \
            else frozenset(params)
    except (TypeError, ValueError):
        names = None
    _PARAMS_CACHE[fn] = names
    return names


def _host_scalar(t: torch.Tensor, as_int: bool):
    # One host read per execute; cuDNN reads pass-by-value scalars on the host too.
    x = t.reshape(-1)[0].item()
    return int(x) if as_int else float(x)


def _options(call: Call, t: Dict[str, torch.Tensor], feats) -> Dict[str, object]:
    """The functional keyword arguments of ``feats``: the call's fixed ones, and the scalars read
    from their tensors (attn_scale, dropout seed / offset)."""
    kw = {}
    for key, val in call.static.items():
        if key in ("causal", "window", "causal_alignment") and "band" not in feats:
            continue
        if key == "alibi" and "alibi" not in feats:
            continue
        if key.startswith("dropout") and "dropout" not in feats:
            continue
        if key == "return_stats" and "stats" not in feats:
            continue
        if key == "need_dbias" and "dbias" not in feats:
            continue
        if key == "deterministic" and "deterministic" not in feats:
            continue
        kw[key] = val
    if call.scale_role:
        kw["attn_scale"] = _host_scalar(t["attn_scale"], as_int=False)
    if "dropout" in feats:
        if call.seed_role:
            kw["dropout_seed"] = _host_scalar(t["dropout_seed"], as_int=True)
        if call.offset_role:
            kw["dropout_offset"] = _host_scalar(t["dropout_offset"], as_int=True)
    return kw


def _check_params(fn, kw) -> None:
    params = _signature_params(fn)
    if params is not None:
        # a keyword the functional layer does not have yet is a feature it does not support
        missing = [key for key in kw if key not in params]
        if missing:
            raise NotSupportedError(f"{fn.__name__} has no argument {', '.join(missing)} yet")


def _write_rng_dump(t: Dict[str, torch.Tensor], kw) -> None:
    """The kept mask (1 kept, 0 dropped) of the call's dropout, padded [b, h_q, s_q, s_kv]."""
    from ..backends.cpu import dropout_keep_mask
    rd = t["rng_dump"]
    b_, h_, sq_, skv_ = rd.shape
    rd.copy_(dropout_keep_mask(b_, h_, sq_, skv_, kw["dropout_p"], kw.get("dropout_seed", 0),
                               kw.get("dropout_offset", 0), rd.device))

