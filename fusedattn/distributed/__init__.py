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
With the zigzag layout every rank does the same causal work at every step. A window (with or
without causal) is one band over global positions: each (query chunk, key chunk) pair it reaches is
one call, trimmed so that the band is a top-left window of the kernels (:mod:`.plans`).

Sinks enter once, after the merge (no block's lse holds them): lse = logaddexp(lse_merged, sink_h),
out = out_merged * exp(lse_merged - lse). Softcap applies per score, so per block. Dropout is refused:
the kernels' Philox counters are laid out by each call's own (s_q, s_kv) (see
:func:`context_parallel_attention`).

Packed variable-length batches: :func:`context_parallel_attention_varlen` (:mod:`.varlen`).

The all-gather variant (``variant="allgather"``) gathers K/V once and runs one call per local
query chunk (see :mod:`fusedattn.distributed.allgather`). ``variant="auto"`` picks it by
:func:`choose_variant`'s rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..problem import InvalidArgumentError, InvalidTypeError, NotSupportedError
from . import _comm
from ._comm import ContextParallelError
from .allgather import allgather_backward, allgather_forward
from .layout import (LAYOUTS, check_layout, chunk_ids, num_chunks, sequence_positions, shard_sequence,
                     unshard_sequence)
from .plans import block_plan, gather_plan, global_band
from .ring import DenseBlocks, merge_partial, ring_backward, ring_forward, sink_grad_local
from .varlen import (VarlenBlocks, check_cu_seqlens, local_cu_seqlens, shard_varlen, unshard_varlen,
                     varlen_positions)

__all__ = ["context_parallel_attention", "context_parallel_attention_varlen", "choose_variant", "shard_sequence",
           "unshard_sequence", "gather_sequence", "sequence_positions", "chunk_ids", "num_chunks", "block_plan",
           "gather_plan", "merge_partial", "shard_varlen", "unshard_varlen", "local_cu_seqlens", "varlen_positions",
           "ContextParallelError", "LAYOUTS", "VARIANTS", "AUTO_ALLGATHER_MAX_ROWS", "AUTO_ALLGATHER_MAX_BYTES"]

VARIANTS = ("auto", "ring", "allgather")

# variant="auto": all-gather when a ring step's kernel is too short to hide the step's transfer and
# latency. Per step a rank sends 2*L*h_kv*d elements and computes about 2*L^2*h_q*d FLOPs (a zigzag
# causal step), i.e. L*h_q/h_kv FLOPs per element sent; an H100 at ~600 TFLOP/s over a ~200 GB/s
# link needs several thousand. Not tuned on real multi-GPU runs yet (no such machine was available;
# bench/cp_timeline.py simulates the ring from single-GPU kernel times).
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
    window: Optional[tuple]
    softcap: float
    layout: str
    variant: str
    backend: str
    deterministic: Optional[bool]
    check: bool                 # validate: every rank learns of a peer's failure (StepGuard.settle)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = ("q.shape[0] (batch)", "q.shape[1] (query heads)", "k.shape[1] (key/value heads)",
           "q.shape[2] (local sequence length)", "q.shape[3] (head dim)", "v.shape[3] (value head dim)",
           "q.dtype", "causal", "layout", "variant", "attn_scale (x 1e9, rounded)", "window[0]", "window[1]",
           "softcap (x 1e9, rounded)", "sink (given)", "sink (x 1e9, rounded sum)")


def _fingerprint(q, k, v, causal, layout, variant, scale, window, softcap, sink):
    """The values every rank must agree on, as int64s in _FIELDS' order (shapes for varlen: see there)."""
    dt = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1
    win = window or (-2, -2)
    sink_sum = 0 if sink is None else round(float(sink.detach().double().sum()) * 1e9)
    return [q.shape[0], q.shape[1], k.shape[1], q.shape[2] if q.dim() == 4 else 0, q.shape[-1], v.shape[-1], dt,
            int(causal), LAYOUTS.index(layout), VARIANTS.index(variant), round(scale * 1e9),
            -1 if win[0] is None else win[0], -1 if win[1] is None else win[1], round(softcap * 1e9),
            int(sink is not None), sink_sum]


def _check_same_on_all_ranks(info, device, mine, fields):
    """One small all_gather of each rank's shapes and options; a clear error on every rank (so no
    rank is left waiting in the ring) when they differ."""
    mine = torch.tensor(mine, dtype=torch.int64, device=device)
    rows = torch.stack(_comm.all_gather(info, mine)).cpu().tolist()
    for col, name in enumerate(fields):
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


def _check_tensors(q, k, v, dims, what):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if type(t) is not torch.Tensor and type(t).__name__ == "DTensor":
            raise NotSupportedError(
                f"NYI: {name} is a DTensor; pass its local shard ({name}.to_local(), in the layout's order) and "
                f"group={name}.device_mesh (a 1-D mesh)")
        if t.dim() != dims:
            raise InvalidArgumentError(f"{name} must be {dims}-D {what}, got shape {list(t.shape)}")
    if k.device != q.device or v.device != q.device:
        raise InvalidArgumentError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_options(q, attn_scale, window, softcap, dropout_p, sink, causal):
    """Single-rank checks of the options; returns (scale, window as a normalized pair or None)."""
    if dropout_p:
        raise NotSupportedError(
            "NYI: dropout_p > 0 in context-parallel attention. The kernels key each dropped probability's "
            "Philox counter by its row and key *within the call* and by the call's own (s_q, s_kv) "
            "(counter = offset + (bh * ceil(s_q/16)*8 + row_group) * ceil(s_kv/16)*4 + key_group), so a "
            "ring block cannot reproduce the mask one device draws for the whole sequence with any "
            "dropout_offset; that needs the kernels to take the block's global row/key origin and the "
            "whole sequence's lengths. Apply dropout outside attention, or run without it")
    if attn_scale is None:
        attn_scale = q.shape[-1] ** -0.5
    if not isinstance(attn_scale, (int, float)) or isinstance(attn_scale, bool):
        raise InvalidTypeError(f"attn_scale must be a float or None, got {type(attn_scale).__name__}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or softcap < 0:
        raise InvalidArgumentError(f"softcap must be a float >= 0 (0 = off), got {softcap!r}")
    band = global_band(bool(causal), window)          # checks the window's form
    norm = band if window is not None else None       # causal's cap folded in; None: no bound at all
    if sink is not None:
        if not isinstance(sink, torch.Tensor) or sink.dim() != 1 or sink.shape[0] != q.shape[1] \
                or not sink.is_floating_point():
            raise InvalidArgumentError(f"sink must be a float tensor [h_q] = [{q.shape[1]}], got "
                                       f"{getattr(sink, 'dtype', type(sink).__name__)} "
                                       f"{list(getattr(sink, 'shape', []))}")
        if sink.device != q.device:
            raise InvalidArgumentError(f"sink is on {sink.device} but q is on {q.device}")
    return float(attn_scale), norm


def _validate(q, k, v, group, causal, layout, variant, attn_scale, validate, window, softcap, dropout_p, sink):
    _check_tensors(q, k, v, 4, "[b, h, s_local, d] (BHSD)")
    check_layout(layout)
    if variant not in VARIANTS:
        raise InvalidArgumentError(f"variant must be one of {VARIANTS}, got {variant!r}")
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
    scale, window = _check_options(q, attn_scale, window, softcap, dropout_p, sink, causal)
    info = _comm.group_info(group)
    per_rank = num_chunks(info.world, layout) // info.world
    if L % per_rank:
        raise InvalidArgumentError(
            f"q.shape[2] (local sequence length) must be even with layout='zigzag': each rank holds 2 equal "
            f"chunks (chunk rank and chunk 2W-1-rank of 2W), got {L}; pad the sequence to a multiple of "
            f"2 * world_size = {2 * info.world} or use layout='contiguous'")
    if validate and info.world > 1:
        mine = _fingerprint(q, k, v, causal, layout, variant, scale, window, float(softcap), sink)
        _check_same_on_all_ranks(info, q.device, mine, _FIELDS)
    return info, scale, window


class _ContextParallelAttention(torch.autograd.Function):
    """Autograd over the ring / all-gather passes. Inputs: q, k, v, sink (or None), then the blocks
    factory, group info and config (no gradient). The sink's gradient is this rank's share."""

    @staticmethod
    def forward(ctx, q, k, v, sink, make_blocks, info, cfg):
        blocks = make_blocks(q, k, v)
        fwd = ring_forward if cfg.variant == "ring" else allgather_forward
        out, lse = fwd(blocks, info, cfg, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.make_blocks, ctx.info, ctx.cfg = make_blocks, info, cfg
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        if grad_out is None:     # still take part in the ring: the other ranks wait for this one
            grad_out = torch.zeros_like(out)
        if grad_out.dtype != out.dtype:
            grad_out = grad_out.to(out.dtype)
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        blocks = ctx.make_blocks(q, k, v)
        bwd = ring_backward if ctx.cfg.variant == "ring" else allgather_backward
        dq, dk, dv = bwd(blocks, out, lse, grad_out, ctx.info, ctx.cfg)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_grad_local(blocks.sink_view(sink), lse, out, grad_out, blocks.head_dim).to(sink.dtype)
        return dq, dk, dv, dsink, None, None, None


def _run(q, k, v, sink, make_blocks, info, cfg):
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink))
    if needs_grad:
        return _ContextParallelAttention.apply(q, k, v, sink, make_blocks, info, cfg)
    fwd = ring_forward if cfg.variant == "ring" else allgather_forward
    return fwd(make_blocks(q, k, v), info, cfg, sink)


@torch.compiler.disable
def context_parallel_attention(q, k, v, group=None, *, causal=False, layout="zigzag", variant="auto",
                               attn_scale=None, window=None, softcap=0.0, sink=None, dropout_p=0.0,
                               return_stats=False, deterministic=None, backend="auto", validate=True):
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
        group: a torch.distributed ``ProcessGroup``, a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]`` of a
            data x context mesh), or None (the default group); gloo for CPU tensors, NCCL for CUDA
            ones. Every rank of it must call this function (and its backward) with the same shapes
            and options.
        causal: causal mask over *global* positions (query i sees keys j <= i).
        layout: ``"zigzag"`` (rank i holds chunks i and 2W-1-i of 2W: balanced causal work;
            s_local must be even) or ``"contiguous"`` (rank i holds chunk i of W).
        variant: ``"ring"`` (K/V passed around the ring with isend/irecv, overlapped with the
            previous step's kernels; O(s_local) memory), ``"allgather"`` (K/V all-gathered once;
            O(s) memory), or ``"auto"`` (:func:`choose_variant`).
        attn_scale: default ``1 / sqrt(d)``.
        window: ``(left, right)`` over global positions, as :func:`fusedattn.attention` (key j kept for
            query i iff ``i - left <= j <= i + right``; -1 / None unbounded; causal caps right at 0).
            Blocks the window does not reach are skipped.
        softcap: as :func:`fusedattn.attention` (``softcap * tanh(s / softcap)`` per score).
        sink: float ``[h_q]`` learnable sink logits, as :func:`fusedattn.attention`, the same on every
            rank; its term enters each row's softmax once. Its gradient on a rank is that rank's rows'
            share: sum it over the group, as the data-parallel all-reduce of a replicated parameter does.
        dropout_p: must be 0: refused (``NotSupportedError``), the kernels' Philox counters depend on
            each call's own lengths, so no block reproduces the whole sequence's mask.
        return_stats: also return the log-sum-exp of the local rows over the whole sequence,
            fp32 ``[b, h_q, s_local, 1]`` (natural log; the sink's term included).
        deterministic, backend: as in :func:`fusedattn.attention` (backend ``"cpu"`` or
            ``"triton"``; on CPU tensors ``"auto"`` is the CPU path).
        validate: check with one small all_gather that every rank passed the same shapes and
            options (an error on every rank instead of a hang or garbage), and end each pass with one
            more (a host sync) through which every rank learns that a peer's kernel failed: a rank
            that raises mid-ring keeps taking part in the exchanges, then it raises its own error and
            every other rank a :class:`ContextParallelError` naming it; the group stays usable.
            ``False`` skips both (for CUDA graphs / no host syncs): a failing rank then raises at once
            and its peers see the process group's timeout.

    Returns:
        ``out`` ``[b, h_q, s_local, d_v]`` in q's dtype, or ``(out, stats)``.

    Raises:
        ValueError / TypeError (``fusedattn.FusedAttnError``) naming the argument: an odd local
        length with zigzag, different shapes or options on different ranks, k/v lengths unlike q's,
        torch.distributed not initialized, an unknown layout or variant, a mesh that is not 1-D.
        ``NotSupportedError``: dropout, DTensor inputs. ``ContextParallelError``: a peer failed.

    Not supported here: biases, ALiBi, padding masks (``seq_len_q`` / ``seq_len_kv``: use
    :func:`context_parallel_attention_varlen`), dropout. Under ``torch.compile`` the call is a graph
    break (``torch.compiler.disable``: the communication is eager), so ``fullgraph=True`` fails and
    the rest of the model compiles around it.
    """
    info, scale, window = _validate(q, k, v, group, causal, layout, variant, attn_scale, validate, window, softcap,
                                    dropout_p, sink)
    if variant == "auto":
        kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        variant = choose_variant(info.world, q.shape[2], q.shape[1], k.shape[1], kv_bytes)
    cfg = _Config(scale=scale, causal=bool(causal), window=window, softcap=float(softcap), layout=layout,
                  variant=variant, backend=backend, deterministic=deterministic, check=bool(validate))

    def make_blocks(q_, k_, v_):
        return DenseBlocks(q_, k_, v_, info, cfg)

    out, lse = _run(q, k, v, sink, make_blocks, info, cfg)
    return (out, lse.unsqueeze(-1)) if return_stats else out


_VARLEN_FIELDS = ("q.shape[0] (local tokens)", "q.shape[1] (query heads)", "k.shape[1] (key/value heads)", "-",
                  "q.shape[2] (head dim)", "v.shape[2] (value head dim)", "q.dtype", "causal", "layout", "variant",
                  "attn_scale (x 1e9, rounded)", "window[0]", "window[1]", "softcap (x 1e9, rounded)",
                  "sink (given)", "sink (x 1e9, rounded sum)", "cu_seqlens (number of sequences)",
                  "cu_seqlens (checksum)")


@torch.compiler.disable
def context_parallel_attention_varlen(q, k, v, cu_seqlens, group=None, *, causal=False, layout="zigzag",
                                      attn_scale=None, softcap=0.0, sink=None, return_stats=False,
                                      deterministic=None, backend="auto", validate=True):
    """Context-parallel attention over a packed batch of variable-length sequences (THD), ring variant.

    Each sequence is sharded by the layout on its own (:mod:`fusedattn.distributed.varlen` draws it):
    build the local shards with :func:`shard_varlen` (positions: :func:`varlen_positions`) and reassemble
    with :func:`unshard_varlen`. The result is each rank's shard of ``fusedattn.attention_varlen`` on the
    whole packed batch.

    Args:
        q: ``[T, h_q, d]``, k: ``[T, h_kv, d]``, v: ``[T, h_kv, d_v]``: this rank's tokens of every
            sequence, ``T = cu_seqlens[-1] / W``.
        cu_seqlens: int32 ``[n + 1]``, the *global* cumulative sequence offsets, the same on every rank;
            every sequence length a multiple of ``2W`` (zigzag) or ``W`` (contiguous). The local
            offsets are ``cu_seqlens / W`` (:func:`local_cu_seqlens`).
        group, causal, layout, attn_scale, softcap, sink, deterministic, backend, validate: as
            :func:`context_parallel_attention` (ring variant only; no window yet: NotSupportedError).
        return_stats: also return the log-sum-exp, fp32 ``[h_q, T]`` (``attention_varlen``'s layout).

    Returns:
        ``out`` ``[T, h_q, d_v]`` in q's dtype, or ``(out, stats)``.
    """
    _check_tensors(q, k, v, 3, "packed [tokens, heads, head_dim]")
    check_layout(layout)
    T = q.shape[0]
    if k.shape[0] != T or v.shape[0] != T or k.shape[1] != v.shape[1]:
        raise InvalidArgumentError(f"k and v must hold the same {T} local tokens as q and agree in heads, got "
                                   f"{list(k.shape)} and {list(v.shape)}")
    scale, _ = _check_options(q, attn_scale, None, softcap, 0.0, sink, causal)
    info = _comm.group_info(group)
    cu = check_cu_seqlens(cu_seqlens, info.world, layout)
    if cu[-1] != T * info.world:
        raise InvalidArgumentError(
            f"q.shape[0] (local tokens) must be cu_seqlens[-1] / world_size = {cu[-1]} / {info.world}, got {T}")
    if validate and info.world > 1:
        mine = _fingerprint(q, k, v, causal, layout, "ring", scale, None, float(softcap), sink)
        mine += [len(cu), sum((i + 1) * x for i, x in enumerate(cu)) % (1 << 61)]
        _check_same_on_all_ranks(info, q.device, mine, _VARLEN_FIELDS)
    cfg = _Config(scale=scale, causal=bool(causal), window=None, softcap=float(softcap), layout=layout,
                  variant="ring", backend=backend, deterministic=deterministic, check=bool(validate))

    def make_blocks(q_, k_, v_):
        return VarlenBlocks(q_, k_, v_, cu, info, cfg)

    out, lse = _run(q, k, v, sink, make_blocks, info, cfg)
    out = out.transpose(0, 1)                 # [h_q, T, d_v] accumulators -> [T, h_q, d_v]
    return (out, lse) if return_stats else out


@torch.compiler.disable
def gather_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The whole sequence on every rank from each rank's shard ``x`` (all_gather + :func:`unshard_sequence`;
    no autograd). Shards must have the same shape on every rank."""
    check_layout(layout)
    info = _comm.group_info(group)
    return unshard_sequence(_comm.all_gather(info, x), layout, dim)
