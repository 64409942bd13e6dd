"""Attention layers built on :func:`fusedattn.attention`.

* :class:`MultiheadSelfAttention` (alias :data:`MultiheadAttention`): fused QKV
  projection, GQA/MQA, causal, dropout, output projection.
* :class:`CausalSelfAttention`: nanoGPT's block (``c_attn`` / ``c_proj``, same
  parameter names, so nanoGPT state dicts load), GQA optional.
* :func:`qkv_attention`: the functional core both call.

Layout: BSHD throughout, no copies before the kernel. The QKV projection writes
one ``[b, s, (h_q + 2 h_kv) * d]`` tensor; it is viewed as
``[b, s, h_q + 2 h_kv, d]`` and q, k, v are head slices of that view handed to
the kernel as ``.transpose(1, 2)`` views (strides ``(s*n*d, d, n*d, 1)`` with
``n = h_q + 2 h_kv``). The kernels take any strides, so there is nothing to
copy; the output comes back BSHD in memory (it follows q's layout), so the
``[b, s, h_q * d]`` input of the output projection is a view as well.

Shape legend: ``b`` batch, ``s`` sequence, ``E`` embed_dim, ``h_q`` query heads
(``num_heads``), ``h_kv`` key/value heads, ``d`` head_dim.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .functional import attention
from .problem import InvalidArgumentError, MAX_HEAD_DIM

__all__ = ["qkv_attention", "MultiheadSelfAttention", "MultiheadAttention", "CausalSelfAttention"]

# fusedattn's own backends, plus PyTorch's SDPA for side-by-side comparisons
LAYER_BACKENDS = ("auto", "triton", "cpu", "sdpa")


def _check_heads(embed_dim: int, num_heads: int, num_kv_heads: Optional[int], head_dim: Optional[int]):
    """Validate the head geometry once, at construction; return (h_kv, d)."""
    for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
        if not isinstance(val, int) or val <= 0:
            raise InvalidArgumentError(f"{name} must be a positive int, got {val!r}")
    h_kv = num_heads if num_kv_heads is None else num_kv_heads
    if not isinstance(h_kv, int) or h_kv <= 0 or num_heads % h_kv != 0:
        raise InvalidArgumentError(
            f"num_kv_heads must divide num_heads (query head i reads kv head i // (num_heads // num_kv_heads)); "
            f"got num_heads={num_heads}, num_kv_heads={num_kv_heads}")
    if head_dim is None:
        if embed_dim % num_heads != 0:
            raise InvalidArgumentError(
                f"embed_dim ({embed_dim}) must be a multiple of num_heads ({num_heads}), or pass head_dim")
        head_dim = embed_dim // num_heads
    if head_dim <= 0 or head_dim > MAX_HEAD_DIM or head_dim % 8 != 0:
        raise InvalidArgumentError(
            f"head_dim = {head_dim}; fusedattn supports a multiple of 8 from 8 to {MAX_HEAD_DIM} "
            f"(change embed_dim / num_heads, or pass head_dim)")
    return h_kv, head_dim


def _check_backend(backend: str) -> str:
    if backend not in LAYER_BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {LAYER_BACKENDS}, got {backend!r}")
    return backend


def qkv_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: Optional[int] = None, *,
                  causal: bool = False, dropout_p: float = 0.0, attn_scale: Optional[float] = None,
                  backend: str = "auto") -> torch.Tensor:
    """Attention over the output of a fused QKV projection, with no copies before the kernel.

    Args:
        qkv: ``[b, s, (h_q + 2 h_kv) * d]``: query heads, then key heads, then value heads
            along the last dim (nanoGPT's ``c_attn(x).split(E, dim=2)`` order when h_kv = h_q).
            Any strides; split into heads with views only.
        num_heads: ``h_q``.
        num_kv_heads: ``h_kv`` (GQA; 1 is MQA); default ``h_q``. Query head ``i`` reads
            key/value head ``i // (h_q // h_kv)``.
        causal: top-left causal mask (query ``i`` sees keys ``j <= i``), as SDPA's ``is_causal``.
        dropout_p: attention-probability dropout (pass 0.0 outside training).
        attn_scale: default ``1 / sqrt(d)``.
        backend: ``"auto"`` / ``"triton"`` / ``"cpu"`` (fusedattn's, see
            :func:`fusedattn.attention`) or ``"sdpa"`` (``F.scaled_dot_product_attention``,
            for comparisons; its output is BHSD, so the final reshape copies).

    Returns:
        ``[b, s, h_q * d]`` in qkv's dtype; a view of the kernel's BSHD output.

    Example::

        >>> import torch
        >>> from fusedattn.nn import qkv_attention
        >>> qkv = torch.randn(2, 10, (4 + 2 * 2) * 16)    # h_q = 4, h_kv = 2, d = 16
        >>> qkv_attention(qkv, 4, 2, causal=True).shape
        torch.Size([2, 10, 64])
    """
    _check_backend(backend)
    if qkv.dim() != 3:
        raise InvalidArgumentError(f"qkv must be 3-D [b, s, (h_q + 2 h_kv) * d], got shape {tuple(qkv.shape)}")
    b, s, width = qkv.shape
    h_q = num_heads
    h_kv = h_q if num_kv_heads is None else num_kv_heads
    n = h_q + 2 * h_kv
    if width % n != 0:
        raise InvalidArgumentError(
            f"qkv's last dim ({width}) must be (num_heads + 2 * num_kv_heads) * head_dim = {n} * d")
    d = width // n
    heads = qkv.view(b, s, n, d)    # splitting one dim is always a view, whatever qkv's strides
    q = heads[:, :, :h_q].transpose(1, 2)               # [b, h_q, s, d], strides (s*n*d, d, n*d, 1)
    k = heads[:, :, h_q:h_q + h_kv].transpose(1, 2)     # [b, h_kv, s, d]
    v = heads[:, :, h_q + h_kv:].transpose(1, 2)        # [b, h_kv, s, d]
    if backend == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p, scale=attn_scale,
                                           enable_gqa=h_kv != h_q)
    else:
        o = attention(q, k, v, causal=causal, dropout_p=dropout_p, attn_scale=attn_scale, backend=backend)
    # fusedattn allocates out in q's physical layout (BSHD), so this reshape is a view
    return o.transpose(1, 2).reshape(b, s, h_q * d)


class MultiheadSelfAttention(nn.Module):
    r"""Multi-head self-attention with a fused QKV projection, on :func:`fusedattn.attention`.

    ``y = out_proj(attention(q, k, v))`` with ``[q | k | v] = qkv_proj(x)``. Not a drop-in
    for ``torch.nn.MultiheadAttention``: self-attention only, batch first, ``forward(x)``
    returns the output alone (no attention weights; they never exist in memory).

    Args:
        embed_dim: ``E``, the model width (input and output features).
        num_heads: ``h_q`` query heads.
        num_kv_heads: ``h_kv`` key/value heads (GQA; 1 is MQA); default ``h_q``. With 6 query
            and 2 kv heads, query heads 0, 1, 2 read kv head 0 and 3, 4, 5 read kv head 1.
        head_dim: ``d``; default ``E // h_q``. A multiple of 8 up to 256.
        causal: query ``i`` attends to keys ``j <= i`` only.
        dropout: attention-probability dropout, applied in training mode only (inside the
            kernel, as ``dropout_p``; the mask is drawn from torch's default generator).
        bias: biases in both projections.
        attn_scale: default ``1 / sqrt(d)``.
        backend: ``"auto"`` (Triton on CUDA, the CPU path on CPU), ``"triton"``, ``"cpu"``, or
            ``"sdpa"`` to run ``F.scaled_dot_product_attention`` instead (same weights and layout;
            for comparisons).
        device, dtype: factory kwargs of the projections.

    Shapes:
        - ``qkv_proj.weight``: ``[(h_q + 2 h_kv) * d, E]`` (one matmul for q, k and v)
        - ``out_proj.weight``: ``[E, h_q * d]``
        - input ``x``: ``[b, s, E]``; output: ``[b, s, E]``

    Example::

        >>> import torch
        >>> from fusedattn.nn import MultiheadSelfAttention
        >>> attn = MultiheadSelfAttention(128, 8, num_kv_heads=2, causal=True)
        >>> attn(torch.randn(2, 50, 128)).shape
        torch.Size([2, 50, 128])
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, causal: bool = False, dropout: float = 0.0, bias: bool = True,
                 attn_scale: Optional[float] = None, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        self.num_kv_heads, self.head_dim = _check_heads(embed_dim, num_heads, num_kv_heads, head_dim)
        if not 0.0 <= dropout < 1.0:
            raise InvalidArgumentError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.causal, self.dropout, self.attn_scale = causal, dropout, attn_scale
        self.backend = _check_backend(backend)
        fk = dict(device=device, dtype=dtype)
        self.qkv_proj = nn.Linear(embed_dim, (num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=bias, **fk)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, s, E]`` -> ``[b, s, E]``."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise InvalidArgumentError(f"x must be [batch, seq, {self.embed_dim}], got shape {tuple(x.shape)}")
        y = qkv_attention(self.qkv_proj(x), self.num_heads, self.num_kv_heads, causal=self.causal,
                          dropout_p=self.dropout if self.training else 0.0, attn_scale=self.attn_scale,
                          backend=self.backend)
        return self.out_proj(y)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, dropout={self.dropout}, backend={self.backend!r}")


#: Alias: the name the issue uses. See :class:`MultiheadSelfAttention` (not torch's signature).
MultiheadAttention = MultiheadSelfAttention


class CausalSelfAttention(nn.Module):
    """nanoGPT's causal self-attention block on :func:`fusedattn.attention`.

    Same parameters and names as ``model.py`` of karpathy/nanoGPT (``c_attn``, ``c_proj``,
    ``resid_dropout``), so its state dicts load; the differences are GQA
    (``n_kv_head``) and that the q/k/v split is views, not copies.

    Args:
        n_embd: ``E``. n_head: ``h_q``; ``E // h_q`` must be a multiple of 8 up to 256.
        n_kv_head: ``h_kv`` (default ``h_q``).
        bias: biases in ``c_attn`` / ``c_proj`` (nanoGPT's ``config.bias``).
        dropout: attention dropout (in the kernel) and residual dropout, training mode only.
        backend: as :class:`MultiheadSelfAttention` (``"sdpa"`` is nanoGPT's own code path).

    Shapes: ``x`` ``[b, s, E]`` -> ``[b, s, E]``; ``c_attn.weight`` ``[(h_q + 2 h_kv) * d, E]``.
    """

    def __init__(self, n_embd: int, n_head: int, *, n_kv_head: Optional[int] = None, bias: bool = True,
                 dropout: float = 0.0, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        self.n_kv_head, self.head_dim = _check_heads(n_embd, n_head, n_kv_head, None)
        self.n_embd, self.n_head, self.dropout = n_embd, n_head, dropout
        self.backend = _check_backend(backend)
        fk = dict(device=device, dtype=dtype)
        self.c_attn = nn.Linear(n_embd, (n_head + 2 * self.n_kv_head) * self.head_dim, bias=bias, **fk)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias, **fk)
        self.resid_dropout = nn.Dropout(dropout)

    @classmethod
    def from_config(cls, config, **kw) -> "CausalSelfAttention":
        """Build from a nanoGPT ``GPTConfig``-like object (``n_embd``, ``n_head``, ``bias``, ``dropout``)."""
        return cls(config.n_embd, config.n_head, n_kv_head=getattr(config, "n_kv_head", None),
                   bias=getattr(config, "bias", True), dropout=getattr(config, "dropout", 0.0), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, s, E]`` -> ``[b, s, E]``."""
        if x.dim() != 3 or x.shape[-1] != self.n_embd:
            raise InvalidArgumentError(f"x must be [batch, seq, {self.n_embd}], got shape {tuple(x.shape)}")
        y = qkv_attention(self.c_attn(x), self.n_head, self.n_kv_head, causal=True,
                          dropout_p=self.dropout if self.training else 0.0, backend=self.backend)
        return self.resid_dropout(self.c_proj(y))

    def extra_repr(self) -> str:
        return f"n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, backend={self.backend!r}"
