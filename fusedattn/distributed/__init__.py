"""Context-parallel attention: one sequence split across the ranks of a torch.distributed group.

Each of the ``W`` ranks of ``group`` holds a shard of the sequence (queries, keys and values of
the same positions; see :mod:`fusedattn.distributed.layout` for the zigzag and contiguous
layouts) and gets the attention output of its own query rows against the *whole* sequence, as
if ``fusedattn.attention`` had run on one device; gradients flow back to the local shards.

Algorithm (ring variant, ``variant="ring"``)::

    forward, on rank r (W steps):
        out_acc = 0, lse_acc = -inf                  (fp32; fp64 for fp64 inputs)
        blk = own K/V (K and V packed in one buffer; GQA: only the h_kv heads travel)
        for step in 0 .. W-1:                        blk belongs to rank src = (r - step) mod W
            post isend(blk -> r+1), irecv(next blk <- r-1)     (unless last step)
            for each kernel call of block_plan(r, src):         (causal: skip masked chunk pairs)
                o, lse = attention_forward(q rows, blk rows, causal=diagonal?, return_stats=True)
                lse_new = logaddexp(lse_acc, lse)
                out_acc = out_acc * exp(lse_acc - lse_new) + o * exp(lse - lse_new)
                lse_acc = lse_new
            wait for the exchange; blk = next blk
    backward, on rank r (W steps, dK/dV accumulators travel with the blocks):
        for step in 0 .. W-1:
            post the K/V exchange for the next step
            per call: dq_b, dk_b, dv_b = attention_backward(q rows, blk rows, out, dO, lse)
                (out and lse are the local rows' *final* merged values, so P = exp(S - lse) is each
                 key's true probability and every block's gradient is exact)
            dq += dq_b; wait for this block's accumulator (from r-1); acc += (dk_b, dv_b)
            post isend(acc -> r+1), irecv(<- r-1)      (after W hops it is back with its owner)

With a causal mask each (query chunk, key chunk) pair is fully visible (key chunk earlier),
causal-diagonal (same chunk: top-left causal inside the block) or fully masked (skipped: there is
nothing to compute. A call with rows that see no key would merge correctly too: such rows come
back with out 0 and lse -inf, the package's convention, and weigh exp(-inf) = 0 in the merge).
With the zigzag layout every rank does the same causal work at every step.

The all-gather variant (``variant="allgather"``) gathers K/V once and runs one call per local
query chunk (see :mod:`fusedattn.distributed.allgather`). ``variant="auto"`` picks it by
:func:`choose_variant`'s rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..problem import InvalidArgumentError, InvalidTypeError
from . import _comm
from .allgather import allgather_backward, allgather_forward, gather_plan
from .layout import (LAYOUTS, check_layout, chunk_ids, num_chunks, sequence_positions, shard_sequence,
                     unshard_sequence)
from .ring import block_plan, merge_partial, ring_backward, ring_forward

__all__ = ["context_parallel_attention", "choose_variant", "shard_sequence", "unshard_sequence",
           "gather_sequence", "sequence_positions", "chunk_ids", "num_chunks", "block_plan", "gather_plan",
           "merge_partial", "LAYOUTS", "VARIANTS", "AUTO_ALLGATHER_MAX_ROWS", "AUTO_ALLGATHER_MAX_BYTES"]

VARIANTS = ("auto", "ring", "allgather")

# variant="auto": all-gather when a ring step's kernel is too short to hide the step's transfer and
# latency. Per step a rank sends 2*L*h_kv*d elements and computes about 2*L^2*h_q*d FLOPs (a zigzag
# causal step), i.e. L*h_q/h_kv FLOPs per element sent; an H100 at ~600 TFLOP/s over a ~200 GB/s
# link needs several thousand. Not tuned on real multi-GPU runs yet (no such machine was available).
AUTO_ALLGATHER_MAX_ROWS = 4096
AUTO_ALLGATHER_MAX_BYTES = 1 << 30      # the gathered K/V of the whole sequence, per rank


def choose_variant(world_size: int, local_len: int, h_q: int, h_kv: int, kv_bytes_per_rank: int = 0) -> str:
    """The variant ``variant="auto"`` runs: ``"allgather"`` when ``world_size > 2`` and
    ``local_len * (h_q // h_kv) < AUTO_ALLGATHER_MAX_ROWS`` (a ring step would be latency-bound) and
    the whole gathered K/V (``world_size * kv_bytes_per_rank``) fits in ``AUTO_ALLGATHER_MAX_BYTES``;
    else ``"ring"`` (with 2 ranks the ring's single exchange already overlaps the first step, and
    the ring keeps memory at O(local length)). Depends only on shapes equal on every rank, so every
    rank picks the same variant."""
    if world_size <= 2:
        return "ring"
    if local_len * max(1, h_q // max(1, h_kv)) >= AUTO_ALLGATHER_MAX_ROWS:
        return "ring"
    if world_size * kv_bytes_per_rank > AUTO_ALLGATHER_MAX_BYTES:
        return "ring"
    return "allgather"


@dataclass(frozen=True)
class _Config:
    scale: float
    causal: bool
    layout: str
    variant: str
    backend: str
    deterministic: Optional[bool]


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = ("q.shape[0] (batch)", "q.shape[1] (query heads)", "k.shape[1] (key/value heads)",
           "q.shape[2] (local sequence length)", "q.shape[3] (head dim)", "v.shape[3] (value head dim)",
           "q.dtype", "causal", "layout", "variant", "attn_scale (x 1e9, rounded)")


def _check_same_on_all_ranks(q, k, v, info, causal, layout, variant, scale):
    """One small all_gather of each rank's shapes and options; a clear error on every rank (so no
    rank is left waiting in the ring) when they differ."""
    dt = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1
    mine = torch.tensor([q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3], v.shape[3], dt, int(causal),
                         LAYOUTS.index(layout), VARIANTS.index(variant), round(scale * 1e9)],
                        dtype=torch.int64, device=q.device)
    rows = torch.stack(_comm.all_gather(info, mine)).cpu().tolist()
    for col, name in enumerate(_FIELDS):
        values = [row[col] for row in rows]
        if len(set(values)) > 1:
            if name == "q.dtype":
                values = [str(_DTYPES[x]) if x >= 0 else "other" for x in values]
            elif name == "layout":
                values = [LAYOUTS[x] for x in values]
            elif name == "variant":
                values = [VARIANTS[x] for x in values]
            per_rank = ", ".join(f"rank {r}: {x}" for r, x in enumerate(values))
            raise InvalidArgumentError(f"{name} must be the same on every rank of the group, got {per_rank}")


def _validate(q, k, v, group, causal, layout, variant, attn_scale, validate):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InvalidArgumentError(f"{name} must be 4-D [b, h, s_local, d] (BHSD), got shape {list(t.shape)}")
    check_layout(layout)
    if variant not in VARIANTS:
        raise InvalidArgumentError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if k.device != q.device or v.device != q.device:
        raise InvalidArgumentError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    L = q.shape[2]
    for name, t in (("k", k), ("v", v)):
        if t.shape[2] != L:
            raise InvalidArgumentError(
                f"{name}.shape[2] (local sequence length) must equal q.shape[2] = {L}: every rank holds the "
                f"queries, keys and values of the same positions, got {t.shape[2]}")
    if k.shape[:3] != v.shape[:3]:
        raise InvalidArgumentError(f"k and v must agree in [b, h_kv, s_local], got {list(k.shape)} and {list(v.shape)}")
    if L == 0:
        raise InvalidArgumentError("q.shape[2] (local sequence length) must be positive, got 0")
    info = _comm.group_info(group)
    per_rank = num_chunks(info.world, layout) // info.world
    if L % per_rank:
        raise InvalidArgumentError(
            f"q.shape[2] (local sequence length) must be even with layout='zigzag': each rank holds 2 equal "
            f"chunks (chunk rank and chunk 2W-1-rank of 2W), got {L}; pad the sequence to a multiple of "
            f"2 * world_size = {2 * info.world} or use layout='contiguous'")
    if attn_scale is None:
        attn_scale = q.shape[-1] ** -0.5
    if not isinstance(attn_scale, (int, float)) or isinstance(attn_scale, bool):
        raise InvalidTypeError(f"attn_scale must be a float or None, got {type(attn_scale).__name__}")
    if validate and info.world > 1:
        _check_same_on_all_ranks(q, k, v, info, causal, layout, variant, float(attn_scale))
    return info, float(attn_scale)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info, cfg):
        fwd = ring_forward if cfg.variant == "ring" else allgather_forward
        out, lse = fwd(q, k, v, info, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.cfg = info, cfg
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:     # still take part in the ring: the other ranks wait for this one
            grad_out = torch.zeros_like(out)
        if grad_out.dtype != out.dtype:
            grad_out = grad_out.to(out.dtype)
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        bwd = ring_backward if ctx.cfg.variant == "ring" else allgather_backward
        dq, dk, dv = bwd(q, k, v, out, lse, grad_out, ctx.info, ctx.cfg)
        return dq, dk, dv, None, None


def context_parallel_attention(q, k, v, group=None, *, causal=False, layout="zigzag", variant="auto",
                               attn_scale=None, return_stats=False, deterministic=None, backend="auto",
                               validate=True):
    r"""Attention over a sequence sharded across the ranks of ``group``, forward and backward.

    Every rank calls it with its own shard; the result is each rank's shard of what
    ``fusedattn.attention`` gives on the whole sequence. Zigzag layout, W = 2 ranks, causal::

        whole sequence  | c0 | c1 | c2 | c3 |      (4 = 2W chunks of length c)
        rank 0 holds    | c0 | c3 |   -> q, k, v [b, h, 2c, d], out [b, h_q, 2c, d_v]
        rank 1 holds    | c1 | c2 |

        queries \ keys   c0  c1  c2  c3      ## = every key seen, \\ = causal diagonal block
        c0 (rank 0)      \\                   rank 0: c0 (1 diagonal) + c3 (3 full + 1 diagonal)
        c1 (rank 1)      ##  \\               rank 1: c1 (1 full + 1 diagonal) + c2 (2 full + 1 diagonal)
        c2 (rank 1)      ##  ##  \\           -> 3 full + 2 diagonal blocks on each rank (balanced)
        c3 (rank 0)      ##  ##  ##  \\

    Use :func:`shard_sequence` / :func:`sequence_positions` to build the shards (and index position
    embeddings) and :func:`unshard_sequence` / :func:`gather_sequence` to reassemble.

    Args:
        q: ``[b, h_q, s_local, d]`` the local query rows (any strides).
        k: ``[b, h_kv, s_local, d]``, v: ``[b, h_kv, s_local, d_v]``: the same positions' keys and
            values; ``h_q`` a multiple of ``h_kv`` (GQA: only the h_kv heads travel).
        group: the torch.distributed process group (None: the default group); gloo for CPU
            tensors, NCCL for CUDA ones. Every rank of it must call this function (and its
            backward) with the same shapes and options.
        causal: causal mask over *global* positions (query i sees keys j <= i).
        layout: ``"zigzag"`` (rank i holds chunks i and 2W-1-i of 2W: balanced causal work;
            s_local must be even) or ``"contiguous"`` (rank i holds chunk i of W).
        variant: ``"ring"`` (K/V passed around the ring with isend/irecv, overlapped with the
            previous step's kernels; O(s_local) memory), ``"allgather"`` (K/V all-gathered once;
            O(s) memory), or ``"auto"`` (:func:`choose_variant`).
        attn_scale: default ``1 / sqrt(d)``.
        return_stats: also return the log-sum-exp of the local rows over the whole sequence,
            fp32 ``[b, h_q, s_local, 1]`` (natural log).
        deterministic, backend: as in :func:`fusedattn.attention` (backend ``"cpu"`` or
            ``"triton"``; on CPU tensors ``"auto"`` is the CPU path).
        validate: check with one small all_gather that every rank passed the same shapes and
            options (an error on every rank instead of a hang or garbage). ``False`` skips it.

    Returns:
        ``out`` ``[b, h_q, s_local, d_v]`` in q's dtype, or ``(out, stats)``.

    Raises:
        ValueError / TypeError (``fusedattn.FusedAttnError``) naming the argument: an odd local
        length with zigzag, different shapes or options on different ranks, k/v lengths unlike q's,
        torch.distributed not initialized, an unknown layout or variant.

    Not supported here: windows, biases, ALiBi, dropout, padding masks, softcap (plain and causal
    attention only); ``torch.compile`` graphs (the communication is eager).
    """
    info, scale = _validate(q, k, v, group, causal, layout, variant, attn_scale, validate)
    if variant == "auto":
        kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        variant = choose_variant(info.world, q.shape[2], q.shape[1], k.shape[1], kv_bytes)
    cfg = _Config(scale=scale, causal=bool(causal), layout=layout, variant=variant, backend=backend,
                  deterministic=deterministic)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad:
        out, stats = _ContextParallelAttention.apply(q, k, v, info, cfg)
    else:
        fwd = ring_forward if variant == "ring" else allgather_forward
        out, stats = fwd(q, k, v, info, cfg)
    return (out, stats) if return_stats else out


def gather_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The whole sequence on every rank from each rank's shard ``x`` (all_gather + :func:`unshard_sequence`;
    no autograd). Shards must have the same shape on every rank."""
    check_layout(layout)
    info = _comm.group_info(group)
    return unshard_sequence(_comm.all_gather(info, x), layout, dim)
