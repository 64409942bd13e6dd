"""Ring attention: K/V blocks travel around the group; each rank merges its queries' partial
results through (out, lse). Forward and backward (dK/dV accumulators travel with the blocks).

Every step's communication is posted (isend/irecv) before the step's kernels run and waited
after them, so the transfer of the next block overlaps the attention on the current one.

The loops here know nothing of the tensors' layout: a *blocks* object (:class:`DenseBlocks` here,
``varlen.VarlenBlocks`` for packed sequences) allocates the accumulators and runs one step's kernel
calls. A rank whose kernel fails keeps taking part in the exchanges (``_comm.StepGuard``), so every
rank ends with an error instead of a hang.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..functional import attention_backward, attention_forward
from . import _comm
from .plans import block_plan, mask_kwargs

__all__ = ["DenseBlocks", "merge_partial", "ring_forward", "ring_backward", "block_plan", "apply_sink",
           "sink_grad_local"]


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partial(out_acc, lse_acc, out_blk, lse_blk) -> None:
    """In place: (out_acc, lse_acc) <- merge with a block's (out, lse), the numerically stable rule
    lse = logaddexp(lse_a, lse_b); out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
    out_acc [..., n, d_v] and lse_acc [..., n] in the accumulation dtype; lse_acc starts at -inf.

    A row with no key on one side has lse -inf there (the package's convention): its weight is
    exp(-inf - lse) = 0. A row empty on both sides stays out 0, lse -inf (the exponents then use 0,
    never -inf - -inf)."""
    lse_blk = lse_blk.to(lse_acc.dtype)
    new = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(new == float("-inf"), torch.zeros_like(new), new)
    out_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1))
    out_acc.add_(out_blk.to(out_acc.dtype) * torch.exp(lse_blk - safe).unsqueeze(-1))
    lse_acc.copy_(new)


def apply_sink(out_acc, lse_acc, sink) -> None:
    """In place, once, after every key block is merged: the sink's extra softmax term exp(sink_h) with no
    value. ``sink`` broadcasts against ``lse_acc`` (the head axis placed by the caller). A row that saw
    no key (lse -inf) gets out 0 and lse = sink, as single-device attention gives."""
    new = torch.logaddexp(lse_acc, sink.to(lse_acc.dtype))
    out_acc.mul_(torch.exp(lse_acc - new).unsqueeze(-1))
    lse_acc.copy_(new)


def sink_grad_local(sink, lse, out, grad_out, row_dim: int):
    """This rank's share of the sink's gradient, fp32 like ``sink``: ``-sum_rows exp(sink - lse) * delta``,
    delta = rowsum(dO * O), over the local rows only. ``sink`` broadcasts against ``lse``; ``row_dim``
    indexes the head axis of ``out``'s rows after the sum over d_v (summed out together with the rest).
    The whole gradient is the sum of the ranks' shares, which the data-parallel all-reduce of replicated
    parameters' gradients forms (as for every other weight of the model)."""
    delta = (grad_out.float() * out.float()).sum(-1)
    p_sink = torch.exp(sink.float() - torch.where(lse == float("-inf"), float("inf"), lse.float()))
    g = -(p_sink * delta)
    dims = [i for i in range(g.dim()) if i != row_dim]
    return g.sum(dim=dims)


class DenseBlocks:
    """BHSD shards: q [b, h_q, L, d], k [b, h_kv, L, d], v [b, h_kv, L, d_v] (any strides).
    Accumulators: out [b, h_q, L, d_v], lse [b, h_q, L] (fp32; fp64 for fp64 inputs)."""

    head_dim = 1                                  # the head axis of lse

    def __init__(self, q, k, v, info, cfg):
        self.q, self.k, self.v, self.info, self.cfg = q, k, v, info, cfg
        self.L = q.shape[2]
        self.kv_shapes = (tuple(k.shape), tuple(v.shape))

    def accumulators(self):
        b, h_q, L, _ = self.q.shape
        acc = acc_dtype(self.q.dtype)
        out = torch.zeros((b, h_q, L, self.v.shape[-1]), dtype=acc, device=self.q.device)
        lse = torch.full((b, h_q, L), float("-inf"), dtype=acc, device=self.q.device)
        return out, lse

    def sink_view(self, sink):
        return sink.view(1, -1, 1)

    def _calls(self, src):
        cfg = self.cfg
        return block_plan(self.info.world, self.info.rank, src, cfg.layout, cfg.causal, self.L, cfg.window)

    def _opts(self, mask):
        cfg = self.cfg
        return dict(attn_scale=cfg.scale, softcap=cfg.softcap, backend=cfg.backend, **mask_kwargs(mask))

    def forward_step(self, src, k_s, v_s, out_acc, lse_acc) -> None:
        q = self.q
        for q0, q1, k0, k1, mask in self._calls(src):
            o, st = attention_forward(q[:, :, q0:q1], k_s[:, :, k0:k1], v_s[:, :, k0:k1], return_stats=True,
                                      **self._opts(mask))
            merge_partial(out_acc[:, :, q0:q1], lse_acc[:, :, q0:q1], o, st[..., 0])

    def backward_step(self, src, k_s, v_s, out, grad_out, lse, dq_acc) -> List[Tuple]:
        """dq_acc += this block's share; returns the block's (k0, k1, dk, dv) pieces."""
        q, grads = self.q, []
        for q0, q1, k0, k1, mask in self._calls(src):
            dq_b, dk_b, dv_b, _ = attention_backward(
                q[:, :, q0:q1], k_s[:, :, k0:k1], v_s[:, :, k0:k1], out[:, :, q0:q1], grad_out[:, :, q0:q1],
                lse[:, :, q0:q1], deterministic=self.cfg.deterministic, **self._opts(mask))
            dq_acc[:, :, q0:q1] += dq_b
            grads.append((k0, k1, dk_b, dv_b))
        return grads

    @staticmethod
    def add_grads(dk_acc, dv_acc, grads) -> None:
        for k0, k1, dk_b, dv_b in grads:
            dk_acc[:, :, k0:k1] += dk_b
            dv_acc[:, :, k0:k1] += dv_b


def ring_forward(blocks, info, cfg, sink=None):
    """(out, lse): the local rows' output (q.dtype) and log-sum-exp (fp32; the sink's term included)
    against the whole sequence, in ``blocks``' layout."""
    q, k, v = blocks.q, blocks.k, blocks.v
    out_acc, lse_acc = blocks.accumulators()
    guard = _comm.StepGuard(keep_going=cfg.check)
    bufs = [_comm.pack((k, v)), None]
    if info.world > 1:
        bufs[1] = torch.empty_like(bufs[0])
    for step in range(info.world):
        src = (info.rank - step) % info.world
        cur = bufs[step % 2]
        works = None
        if step + 1 < info.world:    # the next block is in flight while this one is computed
            works = _comm.ring_exchange(info, cur, bufs[(step + 1) % 2], _comm.TAG_KV)
        with _comm.completing(works), guard.at(step):
            if guard.ok:
                k_s, v_s = (k, v) if step == 0 else _comm.unpack(cur, blocks.kv_shapes)
                blocks.forward_step(src, k_s, v_s, out_acc, lse_acc)
    guard.settle(info, "forward")
    if sink is not None:             # once, after the merge: the sink's term is in no block's lse
        apply_sink(out_acc, lse_acc, blocks.sink_view(sink))
    return out_acc.to(q.dtype), lse_acc.float()


def ring_backward(blocks, out, lse, grad_out, info, cfg):
    """dq, dk, dv of the local shards. Each block's gradient comes from ``attention_backward`` with
    the local rows' final (merged) out and lse, which makes it exact: P = exp(S - lse) is the true
    probability of each key (the sink's term included in lse) and delta = rowsum(dO * O) the true row
    term. dK/dV accumulators travel with the blocks and come home after W exchanges."""
    q, k, v = blocks.q, blocks.k, blocks.v
    acc = acc_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    guard = _comm.StepGuard(keep_going=cfg.check)
    kv = [_comm.pack((k, v)), None]
    dkv = [torch.zeros(kv[0].numel(), dtype=acc, device=q.device), None]
    if info.world > 1:
        kv[1] = torch.empty_like(kv[0])
        dkv[1] = torch.empty_like(dkv[0])
    dkv_works = None
    for step in range(info.world):
        src = (info.rank - step) % info.world
        cur = kv[step % 2]
        kv_works = None
        if step + 1 < info.world:
            kv_works = _comm.ring_exchange(info, cur, kv[(step + 1) % 2], _comm.TAG_KV)
        k_s, v_s = (k, v) if step == 0 else _comm.unpack(cur, blocks.kv_shapes)
        grads = []
        with _comm.completing(kv_works, dkv_works, wait=False), guard.at(step):
            if guard.ok:
                grads = blocks.backward_step(src, k_s, v_s, out, grad_out, lse, dq_acc)
        # the accumulator of this block arrives from the previous rank (posted after its last step)
        _comm.wait_all(dkv_works)
        dkv_cur = dkv[step % 2]
        dk_acc, dv_acc = _comm.unpack(dkv_cur, blocks.kv_shapes)
        blocks.add_grads(dk_acc, dv_acc, grads)
        if info.world > 1:           # pass it on; after the last step it reaches its owner
            dkv_works = _comm.ring_exchange(info, dkv_cur, dkv[(step + 1) % 2], _comm.TAG_DKV)
        _comm.wait_all(kv_works)
    _comm.wait_all(dkv_works)
    guard.settle(info, "backward")
    dk, dv = _comm.unpack(dkv[info.world % 2] if info.world > 1 else dkv[0], blocks.kv_shapes)
    return dq_acc.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
