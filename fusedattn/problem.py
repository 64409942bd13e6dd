"""One validated, immutable description of an attention call.

Both front doors (the functional API and the cuDNN-style Graph) build an
:class:`AttentionProblem`; nothing below it knows which door was used. Every
check on user input and every clear error message lives here.

Notation used across the package::

    b        batch                      h_q, h_kv   query / key-value heads
    g        h_q // h_kv (GQA group)    s_q, s_kv   query / key sequence lengths
    d        query/key head dim         d_v         value head dim

Mask model: every causal / window / padding spelling is one diagonal *band*.
Query row ``i`` keeps key ``j`` iff::

    i + off - left <= j <= i + off + right          (a bound of None is unbounded)
    off = 0                      for alignment "top_left"
    off = len_kv - len_q         for alignment "bottom_right" (per-sequence lengths)

so ``causal`` is ``Band(alignment, left=None, right=0)``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Optional, Tuple

import torch

__all__ = [
    "FusedAttnError",
    "NotSupportedError",
    "Band",
    "AttentionProblem",
    "make_problem",
    "check_seq_len_values",
    "IO_DTYPES",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_TORCH",
]

IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256          # the kernels' largest head dim (Triton and Gluon, every pass)
# Head dims past MAX_HEAD_DIM, up to this, run the PyTorch path (backends/cpu.py: chunked online softmax in
# torch ops, the kernels' semantics) on whatever device the tensors are on, with one warning. cuDNN 9.9+
# runs head dims up to 520 on Hopper (its own test_mhas.py draws 264 and 520), so the Graph door must too.
MAX_HEAD_DIM_TORCH = 1024
ALIGNMENTS = ("top_left", "bottom_right")


class FusedAttnError(Exception):
    """Base class of every error fusedattn raises on purpose."""


class InvalidArgumentError(FusedAttnError, ValueError):
    """Bad input: the message names the argument, what was given and what is allowed."""


class InvalidTypeError(FusedAttnError, TypeError):
    """An argument of the wrong type or dtype."""


class NotSupportedError(FusedAttnError, NotImplementedError):
    """A valid request that this build cannot run (the message says what would)."""


@dataclass(frozen=True)
class Band:
    """The diagonal band of kept keys (see the module docstring).

    ``left``/``right`` are ``None`` when unbounded. ``Band("top_left", None, 0)``
    is PyTorch's ``is_causal``; ``Band("bottom_right", None, 0)`` is
    FlashAttention's causal.
    """

    alignment: str = "top_left"
    left: Optional[int] = None
    right: Optional[int] = None

    @property
    def is_full(self) -> bool:
        """True when nothing is masked by the band itself."""
        return self.left is None and self.right is None


def parse_window(window) -> Tuple[Optional[int], Optional[int]]:
    """``window=(left, right)`` as (left, right) bounds, None for an unbounded side (-1 or None);
    ``window=None`` is (None, None)."""
    if window is None:
        return None, None
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise InvalidArgumentError(
            f"window must be a pair (left, right) of ints (-1 or None = unbounded), got {window!r}")
    bounds = []
    for name, w in zip(("left", "right"), window):
        if w is None or (isinstance(w, int) and not isinstance(w, bool) and w == -1):
            bounds.append(None)
        elif isinstance(w, int) and not isinstance(w, bool) and w >= 0:
            bounds.append(int(w))
        else:
            raise InvalidArgumentError(
                f"window[{name}] must be an int >= 0, or -1/None for unbounded; got {w!r}")
    return bounds[0], bounds[1]


def make_band(causal: bool, causal_alignment: str, window, s_q: Optional[int] = None,
              s_kv: Optional[int] = None) -> Optional[Band]:
    """Translate the functional door's ``causal`` / ``window`` into one Band (or None).

    With the sizes given, a bound of at least s_q + s_kv keys keeps every key it could reach under
    either alignment, so it becomes unbounded (None): the kernels compute ``i + off - left`` and
    ``i + off + right`` in int32, where a window of ~2^31 keys would overflow."""
    if causal_alignment not in ALIGNMENTS:
        raise InvalidArgumentError(
            f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    left, right = parse_window(window)
    if causal:
        right = 0 if right is None else min(right, 0)
    if s_q is not None and s_kv is not None:
        reach = s_q + s_kv      # |i + off - j| < s_q + s_kv for every row i and key j, off in either alignment
        left = None if left is not None and left >= reach else left
        right = None if right is not None and right >= reach else right
    if left is None and right is None:
        return None
    return Band(causal_alignment, left, right)


def keep_mask(rows: torch.Tensor, s_kv: int, len_q: torch.Tensor, len_kv: torch.Tensor,
              band: Optional[Band]) -> torch.Tensor:
    """Bool ``[b, 1, len(rows), s_kv]``: True where query ``rows[i]`` sees key ``j`` (padding, then the
    band around the per-sequence diagonal, as :func:`make_band`'s Band means it). The dense form of the
    mask, for the reference and emulation paths (the kernels compute it per tile)."""
    b = len_q.shape[0]
    r = rows.view(1, 1, -1, 1)
    c = torch.arange(s_kv, device=rows.device).view(1, 1, 1, -1)
    lq, lkv = len_q.view(b, 1, 1, 1), len_kv.view(b, 1, 1, 1)
    keep = (r < lq) & (c < lkv)
    if band is not None:
        off = (lkv - lq) if band.alignment == "bottom_right" else 0
        if band.left is not None:
            keep = keep & (c >= r + off - band.left)
        if band.right is not None:
            keep = keep & (c <= r + off + band.right)
    return keep


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise InvalidArgumentError(
            f"{name} must be {ndim}-D [batch, heads, seq, head_dim] (BHSD; use .transpose(1, 2) "
            f"for BSHD memory), got shape {tuple(t.shape)}")
    if t.dtype not in IO_DTYPES:
        raise InvalidTypeError(
            f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32 (float64 on the CPU path)")


def _seq_lens(name: str, t, b: int, device) -> Optional[torch.Tensor]:
    """Accept [b] or [b,1,1,1] integer tensors; return a flat int32 view/copy of length b."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be an int32 tensor of shape [b] or [b, 1, 1, 1], got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise InvalidTypeError(f"{name} must be an int32 (or int64) tensor, got dtype {t.dtype}")
    if t.numel() != b or (t.dim() not in (1, 4)) or (t.dim() == 4 and tuple(t.shape) != (b, 1, 1, 1)):
        raise InvalidArgumentError(f"{name} must have shape [{b}] or [{b}, 1, 1, 1] (batch {b}), got {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device} but q is on {device}")
    t = t.reshape(b)
    if t.dtype == torch.int64:
        # a plain cast wraps 2**32 + 3 to 3 (which validation would then pass): saturate first
        t = t.clamp(-1, 2 ** 31 - 1)
    return t.to(torch.int32).contiguous()


def check_seq_len_values(extras, s_q: int, s_kv: int, device) -> None:
    """Every ``seq_len_q`` entry in [0, s_q] and ``seq_len_kv`` entry in [0, s_kv] (``validate=True``).

    Reading the values waits for the device: one device-to-host copy for both tensors (their
    min and max). Skipped while a CUDA graph is being captured, where a sync is an error; the
    kernels and the CPU path clamp lengths into range whether or not this ran.
    """
    named = [(name, extras[name], sym, s) for name, sym, s in (("seq_len_q", "s_q", s_q), ("seq_len_kv", "s_kv", s_kv))
             if extras[name] is not None and extras[name].numel()]
    if not named or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return
    bounds = torch.stack([m for _, t, _, _ in named for m in torch.aminmax(t)]).tolist()     # the one sync
    for j, (name, t, sym, s) in enumerate(named):
        lo, hi = bounds[2 * j], bounds[2 * j + 1]
        if lo >= 0 and hi <= s:
            continue
        vals = t.tolist()                   # the error path only: find the first bad entry
        bad = [i for i, n in enumerate(vals) if not 0 <= n <= s]
        i, n = bad[0], vals[bad[0]]
        what = "is negative" if n < 0 else f"exceeds {sym} = {s}"
        raise InvalidArgumentError(
            f"{name}[{i}] = {n} {what}; expected every entry in [0, {sym}] = [0, {s}]"
            + (f" ({len(bad)} of {len(vals)} entries are out of range)" if len(bad) > 1 else "")
            + ". Pass validate=False to skip this check (then lengths are clamped into range).")


def check_page_table_values(extras, problem, num_blocks: int, device) -> None:
    """Every page-table slot a sequence uses (the first ceil(len_kv / page_size), len_kv its
    ``seq_len_kv`` or the tables' capacity) names a block in [0, num_blocks) (``validate=True``; one
    device-to-host copy; skipped in CUDA graph capture). Slots past a sequence's keys are never read
    and may hold anything (-1)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    b, page = problem.b, problem.page_size
    lens = extras["seq_len_kv"]
    lens = (torch.full((b,), problem.s_kv, dtype=torch.int32, device=device) if lens is None
            else lens.clamp(0, problem.s_kv))
    for name in ("page_table_k", "page_table_v"):
        table = extras[name]
        used = (torch.arange(table.shape[1], device=device).view(1, -1) * page) < lens.view(-1, 1)
        bad = used & ((table < 0) | (table >= num_blocks))
        if not bool(bad.any()):         # the one sync per table
            continue
        i, j = (int(x) for x in bad.nonzero()[0])
        n = int(lens[i])
        raise InvalidArgumentError(
            f"{name}[{i}, {j}] = {int(table[i, j])} is out of range of the containers' {num_blocks} blocks "
            f"(valid: 0 .. {num_blocks - 1}); sequence {i} of {n} keys uses slots 0 .. {-(-n // page) - 1}. "
            "Pass validate=False to skip this check.")


def check_device_type(device) -> None:
    """fusedattn runs CPU tensors (the CPU path, Triton's interpreter) and CUDA tensors; anything else
    (meta, mps, ...) is refused here rather than failing inside a kernel."""
    if device.type not in ("cpu", "cuda"):
        raise NotSupportedError(f"q, k, v are on {device}; fusedattn runs on CPU and CUDA tensors only")


def check_deterministic(deterministic) -> None:
    """``deterministic`` is None (follow ``torch.are_deterministic_algorithms_enabled()``) or a bool: a
    string such as "no" would otherwise read as True."""
    if deterministic is not None and not _is_flag(deterministic):
        raise InvalidTypeError(f"deterministic must be None, True or False, got {deterministic!r}")


def check_scale(scale, d: int, name: str = "attn_scale") -> float:
    """The scores' scale as a float, finite and > 0; None gives 1 / sqrt(d). Errors name the argument as
    the calling door spells it (FlashAttention's ``softmax_scale``)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    try:
        if isinstance(scale, bool):
            raise TypeError
        scale = float(scale)
    except (TypeError, ValueError):
        raise InvalidTypeError(f"{name} must be a float, got {scale!r}") from None
    if not math.isfinite(scale) or scale <= 0:
        raise InvalidArgumentError(f"{name} must be finite and > 0, got {scale}")
    return scale


def _is_flag(x) -> bool:
    """A bool-like option (bool, 0 / 1, None for off, numpy's bool): not a string or a list by mistake."""
    return x is None or (isinstance(x, (bool, int)) and x in (0, 1)) or type(x).__name__ in ("bool_", "bool")


@dataclass(frozen=True)
class AttentionProblem:
    """Everything static about one attention call (shapes, dtype, options).

    Run-time magnitudes that change call to call (scale, window widths, dropout
    seed) are plain fields too, but only the presence of a feature enters
    :meth:`static_key` (the compile/plan cache key).
    """

    b: int
    h_q: int
    h_kv: int
    s_q: int
    s_kv: int
    d: int
    d_v: int
    dtype: torch.dtype
    device_type: str
    scale: float
    band: Optional[Band] = None
    has_seq_len_q: bool = False
    has_seq_len_kv: bool = False
    bias: Optional[str] = None          # None | "float" | "bool"
    bias_shape: Tuple[int, ...] = ()    # the user's broadcastable shape
    alibi: Optional[str] = None         # None | "default" | "tensor"
    softcap: float = 0.0
    dropout_p: float = 0.0
    dropout_seed: int = 0
    dropout_offset: int = 0
    paged: bool = False
    page_size: int = 0
    varlen: bool = False                # packed [total, h, d] sequences with cumulative offsets
    has_sink: bool = False              # a learnable per-head sink logit (extras["sink"], fp32 [h_q])

    def __hash__(self) -> int:
        # kept once computed: make_problem's memo hands a training loop the same problem every step, and each
        # step hashes it for the launch and replay caches (~3.5 us for the 25 fields on the H100 machine's host,
        # bench/NOTES.md 90); equality still compares the fields
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # a copy or an unpickled problem hashes anew (string hashes differ between processes)
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 = MHA, h_q = MQA)."""
        return self.h_q // self.h_kv

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0.0

    def static_key(self) -> tuple:
        """What a compiled kernel depends on: presence of features, never magnitudes."""
        band = self.band
        return (
            self.dtype, self.device_type, self.d, self.d_v,
            None if band is None else (band.alignment, band.left is not None, band.right is not None),
            self.has_seq_len_q, self.has_seq_len_kv, self.bias, self.alibi is not None,
            self.softcap > 0.0, self.has_dropout, self.paged, self.varlen, self.has_sink,
        )

    def flops(self, backward: bool = False) -> float:
        """FLOPs by the usual count: 2*b*h*s_q*s_kv*(d+d_v), halved for causal; bwd 2.5x."""
        f = 2.0 * self.b * self.h_q * self.s_q * self.s_kv * (self.d + self.d_v)
        if self.band is not None and self.band.right == 0 and self.band.left is None:
            f /= 2
        return f * (2.5 if backward else 1.0)


_PLAIN = {}                 # validated calls (no optional tensor but lengths): metadata key -> (problem, extras)
_PLAIN_MAX = 1024
_SCALARS = (type(None), bool, int, float, str)


def make_problem(q, k, v, *, attn_scale=None, causal=False, causal_alignment="top_left",
                 window=None, seq_len_q=None, seq_len_kv=None, attn_bias=None, alibi=False,
                 softcap=0.0, dropout_p=0.0, dropout_seed=0, dropout_offset=0,
                 page_table_k=None, page_table_v=None, sink=None, validate=True):
    """Validate the inputs of one attention call and describe it.

    Returns ``(problem, extras)`` where ``extras`` holds the normalized run-time
    tensors: ``seq_len_q``/``seq_len_kv`` as int32 ``[b]``, ``bias`` as a
    ``[b, h_q, s_q, s_kv]`` expanded view (strides 0 where broadcast),
    ``slopes`` as fp32 ``[b, h_q]`` (batch stride 0 for per-head slopes),
    ``sink`` as fp32 contiguous ``[h_q]`` (None without a sink).
    Raises InvalidArgumentError / InvalidTypeError naming the argument. ``validate`` also checks the
    values of ``seq_len_q`` / ``seq_len_kv`` (:func:`check_seq_len_values`: a device sync).

    Calls with no optional tensor but per-batch lengths, no user slopes and no dropout are
    remembered by their metadata (shapes, dtypes, devices, scalar options, the lengths' shapes and
    dtypes): validation depends on nothing else, and a repeat call (every training step) then
    costs a dict lookup instead of ~20-60 us (the eager padded and ALiBi calls were host-bound on
    the H100, bench/NOTES.md). The length tensors themselves are normalized anew on every call.
    """
    key = hit = None
    if (attn_bias is None and sink is None and (alibi is False or alibi is True)
            and page_table_k is None and page_table_v is None and not dropout_p
            and type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and (seq_len_q is None or type(seq_len_q) is torch.Tensor)
            and (seq_len_kv is None or type(seq_len_kv) is torch.Tensor)
            and type(attn_scale) in _SCALARS and type(softcap) in _SCALARS and type(causal) in _SCALARS
            and type(dropout_seed) in _SCALARS and type(dropout_offset) in _SCALARS
            and (window is None or type(window) is tuple)):
        lens = tuple(None if t is None else (t.shape, t.dtype, t.device) for t in (seq_len_q, seq_len_kv))
        # the scalars' types too: True == 1 == 1.0 as keys, but validation takes attn_scale=1.0 and refuses True
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               attn_scale, causal, causal_alignment, window, softcap, dropout_p, dropout_seed, dropout_offset,
               alibi, lens, tuple(map(type, (attn_scale, causal, softcap, dropout_p, dropout_seed, dropout_offset))),
               None if window is None else tuple(map(type, window)))
        try:
            hit = _PLAIN.get(key)
        except TypeError:           # an unhashable window entry: validate (and reject) below
            hit = key = None
    if hit is not None:
        problem, extras = hit[0], dict(hit[1])
        b = q.shape[0]
        if seq_len_q is not None:
            extras["seq_len_q"] = _seq_lens("seq_len_q", seq_len_q, b, q.device)
        if seq_len_kv is not None:
            extras["seq_len_kv"] = _seq_lens("seq_len_kv", seq_len_kv, b, q.device)
    else:
        problem, extras = _make_problem(
            q, k, v, attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment, window=window,
            seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, attn_bias=attn_bias, alibi=alibi, softcap=softcap,
            dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
            page_table_k=page_table_k, page_table_v=page_table_v, sink=sink)
        if key is not None:
            if len(_PLAIN) >= _PLAIN_MAX:
                _PLAIN.clear()
            # the lengths are the caller's tensors: never kept (normalized per call above)
            _PLAIN[key] = (problem, dict(extras, seq_len_q=None, seq_len_kv=None))
    if validate is not True and validate is not False and (validate is None or not _is_flag(validate)):
        raise InvalidTypeError(f"validate must be True or False, got {validate!r}")
    # the lengths' values change call to call (never part of the cache key): checked on every call
    if validate:
        check_seq_len_values(extras, problem.s_q, problem.s_kv, q.device)
        if problem.paged:
            check_page_table_values(extras, problem, k.shape[0], q.device)
    return problem, extras


def _make_problem(q, k, v, *, attn_scale, causal, causal_alignment, window, seq_len_q, seq_len_kv, attn_bias,
                  alibi, softcap, dropout_p, dropout_seed, dropout_offset, page_table_k, page_table_v, sink=None):
    paged = page_table_k is not None or page_table_v is not None
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    b, h_q, s_q, d = q.shape
    bk, h_kv, s_kv, dk = k.shape
    bv, h_v, s_v, d_v = v.shape
    page_size = 0
    tables = {}
    if paged:
        # k, v are containers [num_blocks, h_kv, block_size, d]; key j of sequence i lives in block
        # table[i, j // block_size], slot j % block_size. The logical s_kv is the tables' capacity.
        if page_table_k is None or page_table_v is None:
            raise InvalidArgumentError("paged K/V needs both page_table_k and page_table_v (they may be the same tensor)")
        if k.shape[0] != v.shape[0] or k.shape[2] != v.shape[2]:
            raise InvalidArgumentError(
                f"paged containers k {tuple(k.shape)} and v {tuple(v.shape)} must share num_blocks and block_size")
        page_size = k.shape[2]
        for name, t in (("page_table_k", page_table_k), ("page_table_v", page_table_v)):
            tables[name] = _page_table(name, t, b, q.device)
        if tables["page_table_k"].shape != tables["page_table_v"].shape:
            raise InvalidArgumentError("page_table_k and page_table_v must have the same shape")
        s_kv = s_v = tables["page_table_k"].shape[1] * page_size
        bk = bv = b
    if not (k.dtype == q.dtype and v.dtype == q.dtype):
        raise InvalidTypeError(f"q, k, v must share a dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (k.device == q.device and v.device == q.device):
        raise InvalidArgumentError(f"q, k, v must be on one device; got q {q.device}, k {k.device}, v {v.device}")
    check_device_type(q.device)
    if q.dtype == torch.float64 and q.device.type != "cpu":
        raise InvalidTypeError("float64 is supported on the CPU path only (for gradcheck); use float32/16 on the GPU")
    if bk != b or bv != b:
        raise InvalidArgumentError(f"batch sizes differ: q has {b}, k has {bk}, v has {bv}")
    if dk != d:
        raise InvalidArgumentError(f"head dim of k ({dk}) must equal that of q ({d})")
    if h_v != h_kv or s_v != s_kv:
        raise InvalidArgumentError(
            f"k and v must have the same heads and sequence length; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h_kv == 0 or h_q % h_kv != 0:
        raise InvalidArgumentError(
            f"query heads ({h_q}) must be a multiple of key/value heads ({h_kv}) for GQA/MQA")
    check_head_dims(d, d_v)
    if h_q == 0:
        # b == 0 is valid (an empty output, as SDPA gives); the GQA mapping needs heads
        raise InvalidArgumentError(f"q has no heads (h_q = 0): shape {tuple(q.shape)}")

    attn_scale = check_scale(attn_scale, d)

    if not _is_flag(causal):
        raise InvalidTypeError(f"causal must be a bool, got {causal!r}")
    band = make_band(bool(causal), causal_alignment, window, s_q, s_kv)
    extras = {
        "page_table_k": tables.get("page_table_k"),
        "page_table_v": tables.get("page_table_v"),
        "seq_len_q": _seq_lens("seq_len_q", seq_len_q, b, q.device),
        "seq_len_kv": _seq_lens("seq_len_kv", seq_len_kv, b, q.device),
        "bias": None,
        "slopes": None,
        "sink": sink_logits(sink, h_q, q.device),
    }

    bias_kind, bias_shape = None, ()
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor):
            raise InvalidTypeError(f"attn_bias must be a tensor, got {type(attn_bias).__name__}")
        if attn_bias.dtype == torch.bool:
            bias_kind = "bool"
        elif attn_bias.dtype in IO_DTYPES:
            bias_kind = "float"
        else:
            raise InvalidTypeError(f"attn_bias dtype {attn_bias.dtype}; supported: bool (True = keep), float16, bfloat16, float32")
        if attn_bias.device != q.device:
            raise InvalidArgumentError(f"attn_bias is on {attn_bias.device} but q is on {q.device}")
        bias_shape = tuple(attn_bias.shape)
        try:
            bias4 = attn_bias.reshape((1,) * (4 - attn_bias.dim()) + bias_shape) if attn_bias.dim() < 4 else attn_bias
            extras["bias"] = bias4.expand(b, h_q, s_q, s_kv)
        except RuntimeError:
            raise InvalidArgumentError(
                f"attn_bias of shape {bias_shape} does not broadcast to [b, h_q, s_q, s_kv] = {[b, h_q, s_q, s_kv]}") from None

    alibi_kind = None
    if isinstance(alibi, torch.Tensor):
        alibi_kind = "tensor"
        extras["slopes"] = alibi_slopes_2d(alibi, b, h_q, q.device)
    elif not _is_flag(alibi):
        raise InvalidTypeError(f"alibi must be True / False (the paper's slopes or none) or a float tensor of "
                               f"slopes [h_q] or [b, h_q], got {alibi!r}")
    elif alibi:
        alibi_kind = "default"
        extras["slopes"] = _default_slopes(h_q, q.device).expand(b, h_q)

    for name, val in (("softcap", softcap), ("dropout_p", dropout_p)):
        try:
            float(val or 0.0)
        except (TypeError, ValueError):
            raise InvalidTypeError(f"{name} must be a float, got {val!r}") from None
    softcap = float(softcap or 0.0)
    dropout_p = float(dropout_p or 0.0)
    if not math.isfinite(softcap) or softcap < 0:
        raise InvalidArgumentError(f"softcap must be >= 0 (0 = off), got {softcap}")
    if not (0.0 <= dropout_p < 1.0):
        raise InvalidArgumentError(f"dropout_p must be in [0, 1), got {dropout_p}")
    for name, val in (("dropout_seed", dropout_seed), ("dropout_offset", dropout_offset)):
        if not isinstance(val, int) or isinstance(val, bool) or not (0 <= val < 2 ** 63):
            raise InvalidArgumentError(f"{name} must be an int in [0, 2**63), got {val!r}")

    problem = AttentionProblem(
        b=b, h_q=h_q, h_kv=h_kv, s_q=s_q, s_kv=s_kv, d=d, d_v=d_v, dtype=q.dtype,
        device_type=q.device.type, scale=attn_scale, band=band,
        has_seq_len_q=extras["seq_len_q"] is not None, has_seq_len_kv=extras["seq_len_kv"] is not None,
        bias=bias_kind, bias_shape=bias_shape, alibi=alibi_kind, softcap=softcap,
        dropout_p=dropout_p, dropout_seed=int(dropout_seed), dropout_offset=int(dropout_offset),
        paged=paged, page_size=page_size, has_sink=extras["sink"] is not None,
    )
    return problem, extras


def check_head_dims(d: int, d_v: int) -> None:
    """Any head dim from 1 to MAX_HEAD_DIM_TORCH, d_v != d included. Up to MAX_HEAD_DIM the kernels run
    it, padded inside: the portable Triton kernels mask their loads and stores to the true d (tiles of
    max(16, next power of two)); the Gluon sm_90 kernels take only the dims they were built for
    (plan.py). Larger ones run the PyTorch path (plan.py). The scale defaults to 1 / sqrt(true d)."""
    for name, dim in (("d (q/k head dim)", d), ("d_v (v head dim)", d_v)):
        if dim <= 0 or dim > MAX_HEAD_DIM_TORCH:
            raise InvalidArgumentError(f"{name} = {dim}; supported: any head dim from 1 to {MAX_HEAD_DIM_TORCH} "
                                       f"(the kernels up to {MAX_HEAD_DIM}, the PyTorch path above)")


def sink_logits(sink, h_q: int, device, name: str = "sink") -> Optional[torch.Tensor]:
    """A learnable sink (gpt-oss's ``sinks``, FlashAttention-4's ``learnable_sink``): a float tensor
    ``[h_q]``, one logit per query head in the units of the scaled scores, as fp32 contiguous
    ``[h_q]`` (None stays None). It adds ``exp(sink_h)`` to the softmax denominator of every row of
    head h, with no value row; its gradient comes from the autograd door, not through this copy."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or not sink.is_floating_point() or tuple(sink.shape) != (h_q,):
        raise InvalidArgumentError(
            f"{name} must be a float tensor of shape [{h_q}] (one logit per query head), got "
            f"{tuple(getattr(sink, 'shape', ()))} {getattr(sink, 'dtype', type(sink).__name__)}")
    if sink.device != device:
        raise InvalidArgumentError(f"{name} is on {sink.device} but q is on {device}")
    return sink.detach().to(torch.float32).contiguous()


def alibi_slopes_2d(alibi, b: int, h_q: int, device, name: str = "alibi slopes") -> torch.Tensor:
    """A user's ALiBi slopes, float ``[h_q]`` or ``[b, h_q]`` (FlashAttention's two shapes), as fp32
    ``[b, h_q]``: a per-head tensor is expanded (batch stride 0, no copy of its values per batch),
    which is how every kernel reads them (``SLOPES + batch * stride_sb + head``)."""
    if not isinstance(alibi, torch.Tensor) or not alibi.is_floating_point() or \
            tuple(alibi.shape) not in ((h_q,), (b, h_q)):
        raise InvalidArgumentError(
            f"{name} must be a float tensor of shape [{h_q}] (h_q) or [{b}, {h_q}] (b, h_q), got "
            f"{tuple(getattr(alibi, 'shape', ()))} {getattr(alibi, 'dtype', type(alibi).__name__)}")
    if alibi.device != device:
        raise InvalidArgumentError(f"{name} are on {alibi.device} but q is on {device}")
    slopes = alibi.to(torch.float32)
    if slopes.dim() == 1:
        return slopes.contiguous().expand(b, h_q)
    return slopes if slopes.stride(1) == 1 else slopes.contiguous()


def _page_table(name, t, b, device):
    """Accept int32 [b, max_blocks] or cuDNN's [b, 1, max_blocks, 1]; return the [b, max_blocks] view."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be an int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InvalidTypeError(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device} but q is on {device}")
    if t.dim() == 4 and t.shape[0] == b and t.shape[1] == 1 and t.shape[3] == 1:
        t = t[:, 0, :, 0]
    elif not (t.dim() == 2 and t.shape[0] == b):
        raise InvalidArgumentError(f"{name} must have shape [{b}, max_blocks] or [{b}, 1, max_blocks, 1], got {tuple(t.shape)}")
    if t.shape[1] == 0:
        raise InvalidArgumentError(f"{name} has no blocks: shape {tuple(t.shape)}")
    return t


def alibi_slopes(n_heads: int, device=None) -> torch.Tensor:
    """The ALiBi paper's per-head slopes, fp32 ``[n_heads]`` (non-powers of two as the seeds do)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != n_heads:
        extra_base = base ** 0.5
        slopes += [extra_base ** p for p in range(1, 2 * (n_heads - closest) + 1, 2)]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=64)
def _default_slopes(n_heads: int, device) -> torch.Tensor:
    """alibi_slopes, made once per (head count, device): building it is a host-to-device copy that
    waits for the GPU (measured on the H100: an ALiBi forward at 0.69 ms instead of ~0.3).
    Kernels only read it."""
    return alibi_slopes(n_heads, device)
