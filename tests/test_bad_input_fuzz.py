"""Fuzzing the public doors with malformed input a user plausibly passes (CPU tensors, backends "cpu" and
"auto"): each case must raise a specific fusedattn error (a FusedAttnError: ValueError / TypeError /
NotImplementedError) whose message names the argument, never a crash, a hang, a silent result or a NaN.

Cases marked ``# fixed`` raised a raw torch error (RuntimeError / AttributeError) or succeeded silently
before the validation layer learned them.
"""
import numpy as np
import pytest
import torch

import fusedattn
import fusedattn as cudnn
from fusedattn import flash_attn as fa
from fusedattn.problem import FusedAttnError, InvalidArgumentError, InvalidTypeError, NotSupportedError

B, H, HK, S, D = 2, 4, 2, 8, 16
I32 = torch.int32


def t(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def q_(**kw):
    return t(B, H, S, D, **kw)


def kv_(**kw):
    return t(B, HK, S, D, **kw)


def ints(*vals, dtype=I32):
    return torch.tensor(vals, dtype=dtype)


def att(be, *a, **kw):
    return fusedattn.attention(*a, backend=be, **kw)


def fwd(be, *a, **kw):
    return fusedattn.attention_forward(*a, backend=be, **kw)


def bwd(be, **kw):
    q, k, v = q_(), kv_(), kv_()
    out, st = fusedattn.attention_forward(q, k, v, return_stats=True)
    args = dict(out=out, grad_out=torch.randn_like(out), stats=st)
    args.update(kw)
    return fusedattn.attention_backward(q, k, v, args.pop("out"), args.pop("grad_out"), args.pop("stats"),
                                        backend=be, **args)


def packed(n=10, h=H):
    return t(n, h, D)


CU, CU_K = ints(0, 4, 10), ints(0, 4, 10)


def varlen(be, cu_q=None, cu_k=None, mq=6, mk=6, **kw):
    return fusedattn.attention_varlen(packed(), packed(h=HK), packed(h=HK), CU if cu_q is None else cu_q,
                                      CU_K if cu_k is None else cu_k, mq, mk, backend=be, **kw)


def kvc(be, q=None, kc=None, vc=None, **kw):
    kc = t(B, HK, 16, D) if kc is None else kc
    return fusedattn.attention_with_kvcache(t(B, H, 1, D) if q is None else q, kc, kc if vc is None else vc,
                                            backend=be, **kw)


def pages():
    return t(6, HK, 4, D)


def paged_fwd(be, table, table_v="same", **kw):
    c = t(4, HK, 4, D)
    return fwd(be, q_(), c, c, page_table_k=table, page_table_v=table if table_v == "same" else table_v, **kw)


def fa_func(be, q=None, k=None, v=None, **kw):
    return fa.flash_attn_func(t(B, S, H, D) if q is None else q, t(B, S, HK, D) if k is None else k,
                              t(B, S, HK, D) if v is None else v, backend=be, **kw)


def fa_varlen(be, cu_q=None, cu_k=None, mq=6, mk=6, k=None, **kw):
    k = packed(h=HK) if k is None else k
    return fa.flash_attn_varlen_func(packed(), k, k, CU if cu_q is None else cu_q, CU_K if cu_k is None else cu_k,
                                     mq, mk, backend=be, **kw)


def fa_kvc(be, q=None, kc=None, **kw):
    kc = t(B, 16, HK, D) if kc is None else kc
    return fa.flash_attn_with_kvcache(t(B, 1, H, D) if q is None else q, kc, kc, backend=be, **kw)


IAE, ITE, NSE = InvalidArgumentError, InvalidTypeError, NotSupportedError

# (id, call(backend), exception, words the message must hold)
CASES = [
    # ---- fusedattn.attention: ranks, sizes, dtypes, devices, non-tensors
    ("att-q-3d", lambda be: att(be, t(H, S, D), kv_(), kv_()), IAE, ["q must be 4-D"]),
    ("att-k-5d", lambda be: att(be, q_(), t(1, B, HK, S, D), kv_()), IAE, ["k must be 4-D"]),
    ("att-batch", lambda be: att(be, q_(), t(3, HK, S, D), t(3, HK, S, D)), IAE, ["batch sizes differ", "q has 2"]),
    ("att-headdim", lambda be: att(be, q_(), t(B, HK, S, 8), kv_()), IAE, ["head dim of k (8)"]),
    ("att-gqa", lambda be: att(be, t(B, 5, S, D), kv_(), kv_()), IAE, ["query heads (5)", "key/value heads (2)"]),
    ("att-kv-heads", lambda be: att(be, q_(), kv_(), t(B, 1, S, D)), IAE, ["k and v must have the same heads"]),
    ("att-int-q", lambda be: att(be, q_(dtype=I32), kv_(), kv_()), ITE, ["q has dtype torch.int32"]),
    ("att-mixed-dtype", lambda be: att(be, q_(), kv_(dtype=torch.float16), kv_()), ITE, ["q, k, v must share a dtype"]),
    ("att-meta-k", lambda be: att(be, q_(), kv_(device="meta"), kv_()), IAE, ["one device", "k meta"]),
    ("att-all-meta", lambda be: att(be, q_(device="meta"), kv_(device="meta"), kv_(device="meta")), NSE,
     ["meta"]),                                                                                        # fixed (auto)
    ("att-list-q", lambda be: att(be, q_().tolist(), kv_(), kv_()), ITE, ["q must be a torch.Tensor", "list"]),
    ("att-numpy-q", lambda be: att(be, q_().numpy(), kv_(), kv_()), ITE, ["q must be a torch.Tensor", "ndarray"]),
    ("att-none-v", lambda be: att(be, q_(), kv_(), None), ITE, ["v must be a torch.Tensor", "NoneType"]),
    ("att-d0", lambda be: att(be, t(B, H, S, 0), t(B, HK, S, 0), t(B, HK, S, 0)), IAE, ["d (q/k head dim) = 0"]),
    ("att-d1032", lambda be: att(be, t(1, 1, 2, 1032), t(1, 1, 2, 1032), t(1, 1, 2, 1032)), IAE,
     ["= 1032", "1024"]),
    ("att-h0", lambda be: att(be, t(B, 0, S, D), t(B, 0, S, D), t(B, 0, S, D)), IAE, ["query heads (0)"]),
    # ---- scalars
    ("att-scale-nan", lambda be: att(be, q_(), kv_(), kv_(), attn_scale=float("nan")), IAE, ["attn_scale", "nan"]),
    ("att-scale-inf", lambda be: att(be, q_(), kv_(), kv_(), attn_scale=float("inf")), IAE, ["attn_scale", "inf"]),
    ("att-scale-neg", lambda be: att(be, q_(), kv_(), kv_(), attn_scale=-1.0), IAE, ["attn_scale", "> 0"]),
    ("att-scale-zero", lambda be: att(be, q_(), kv_(), kv_(), attn_scale=0.0), IAE, ["attn_scale", "> 0"]),
    ("att-scale-str", lambda be: att(be, q_(), kv_(), kv_(), attn_scale="x"), ITE, ["attn_scale must be a float"]),
    ("att-scale-tensor-nan", lambda be: att(be, q_(), kv_(), kv_(), attn_scale=torch.tensor(float("nan"))), IAE,
     ["attn_scale"]),
    ("att-scale-tensor-2", lambda be: att(be, q_(), kv_(), kv_(), attn_scale=torch.tensor([1., 2.])), ITE,
     ["attn_scale must be a float"]),
    ("att-scale-bool", lambda be: att(be, q_(), kv_(), kv_(), attn_scale=True), ITE,
     ["attn_scale must be a float", "True"]),                                                          # fixed
    ("att-causal-str", lambda be: att(be, q_(), kv_(), kv_(), causal="no"), ITE, ["causal must be a bool"]),  # fixed
    ("att-deterministic-str", lambda be: att(be, q_(), kv_(), kv_(), deterministic="no"), ITE,
     ["deterministic must be None, True or False"]),                                                 # fixed
    ("att-validate-none", lambda be: att(be, q_(), kv_(), kv_(), validate=None), ITE,
     ["validate must be True or False"]),                                                            # fixed
    ("att-validate-str", lambda be: fwd(be, q_(), kv_(), kv_(), validate="yes"), ITE,
     ["validate must be True or False"]),                                                            # fixed
    ("bwd-deterministic-list", lambda be: bwd(be, deterministic=[True]), ITE,
     ["deterministic must be None, True or False"]),                                                 # fixed
    ("att-alignment", lambda be: att(be, q_(), kv_(), kv_(), causal=True, causal_alignment="bottom"), IAE,
     ["causal_alignment must be one of"]),
    ("att-window-3", lambda be: att(be, q_(), kv_(), kv_(), window=(1, 2, 3)), IAE, ["window must be a pair"]),
    ("att-window-neg", lambda be: att(be, q_(), kv_(), kv_(), window=(-2, 0)), IAE, ["window[left]", "-2"]),
    ("att-window-float", lambda be: att(be, q_(), kv_(), kv_(), window=(1.5, 0)), IAE, ["window[left]", "1.5"]),
    ("att-window-int", lambda be: att(be, q_(), kv_(), kv_(), window=3), IAE, ["window must be a pair"]),
    ("att-window-str", lambda be: att(be, q_(), kv_(), kv_(), window="ab"), IAE, ["window must be a pair"]),
    ("att-window-unhashable", lambda be: att(be, q_(), kv_(), kv_(), window=([1], 0)), IAE, ["window[left]"]),
    ("att-window-npint", lambda be: att(be, q_(), kv_(), kv_(), window=(np.int64(2), 0)), IAE, ["window[left]"]),
    ("att-dropout-1", lambda be: att(be, q_(), kv_(), kv_(), dropout_p=1.0), IAE, ["dropout_p must be in [0, 1)"]),
    ("att-dropout-neg", lambda be: att(be, q_(), kv_(), kv_(), dropout_p=-0.1), IAE, ["dropout_p", "-0.1"]),
    ("att-dropout-nan", lambda be: att(be, q_(), kv_(), kv_(), dropout_p=float("nan")), IAE, ["dropout_p", "nan"]),
    ("att-dropout-str", lambda be: att(be, q_(), kv_(), kv_(), dropout_p="a"), ITE,
     ["dropout_p must be a float", "'a'"]),                                                             # message fixed
    ("att-softcap-str", lambda be: att(be, q_(), kv_(), kv_(), softcap="a"), ITE, ["softcap must be a float"]),
    ("att-seed-neg", lambda be: att(be, q_(), kv_(), kv_(), dropout_p=0.1, dropout_seed=-1), IAE, ["dropout_seed"]),
    ("att-seed-float", lambda be: att(be, q_(), kv_(), kv_(), dropout_p=0.1, dropout_seed=1.5), IAE, ["dropout_seed"]),
    ("att-offset-neg", lambda be: att(be, q_(), kv_(), kv_(), dropout_offset=-1), IAE, ["dropout_offset"]),
    ("att-softcap-neg", lambda be: att(be, q_(), kv_(), kv_(), softcap=-1.0), IAE, ["softcap must be >= 0"]),
    ("att-softcap-nan", lambda be: att(be, q_(), kv_(), kv_(), softcap=float("nan")), IAE, ["softcap", "nan"]),
    ("att-softcap-inf", lambda be: att(be, q_(), kv_(), kv_(), softcap=float("inf")), IAE, ["softcap", "inf"]),
    # ---- optional tensors
    ("att-seqlen-len", lambda be: att(be, q_(), kv_(), kv_(), seq_len_q=ints(1)), IAE, ["seq_len_q must have shape [2]"]),
    ("att-seqlen-float", lambda be: att(be, q_(), kv_(), kv_(), seq_len_q=torch.tensor([1., 2.])), ITE,
     ["seq_len_q must be an int32"]),
    ("att-seqlen-neg", lambda be: att(be, q_(), kv_(), kv_(), seq_len_q=ints(-1, 2)), IAE, ["seq_len_q[0] = -1"]),
    ("att-seqlen-over", lambda be: att(be, q_(), kv_(), kv_(), seq_len_kv=ints(9, 2)), IAE,
     ["seq_len_kv[0] = 9", "s_kv = 8"]),
    ("att-seqlen-list", lambda be: att(be, q_(), kv_(), kv_(), seq_len_kv=[1, 2]), ITE, ["seq_len_kv must be an int32"]),
    ("att-seqlen-meta", lambda be: att(be, q_(), kv_(), kv_(), seq_len_kv=ints(1, 2).to("meta")), IAE,
     ["seq_len_kv is on meta"]),
    ("att-sink-shape", lambda be: att(be, q_(), kv_(), kv_(), sink=t(H + 1)), IAE, ["sink must be a float tensor", "[4]"]),
    ("att-sink-int", lambda be: att(be, q_(), kv_(), kv_(), sink=torch.zeros(H, dtype=I32)), IAE, ["sink", "int32"]),
    ("att-sink-2d", lambda be: att(be, q_(), kv_(), kv_(), sink=t(1, H)), IAE, ["sink", "(1, 4)"]),
    ("att-sink-list", lambda be: att(be, q_(), kv_(), kv_(), sink=[0.] * H), IAE, ["sink", "list"]),
    ("att-sink-meta", lambda be: att(be, q_(), kv_(), kv_(), sink=t(H, device="meta")), IAE, ["sink is on meta"]),
    ("att-alibi-shape", lambda be: att(be, q_(), kv_(), kv_(), alibi=t(H + 1)), IAE, ["alibi slopes", "(5,)"]),
    ("att-alibi-int", lambda be: att(be, q_(), kv_(), kv_(), alibi=torch.zeros(H, dtype=torch.int64)), IAE,
     ["alibi slopes", "int64"]),
    ("att-alibi-str", lambda be: att(be, q_(), kv_(), kv_(), alibi="yes"), ITE, ["alibi must be", "'yes'"]),  # fixed
    ("att-bias-shape", lambda be: att(be, q_(), kv_(), kv_(), attn_bias=t(3, S, S)), IAE,
     ["attn_bias of shape (3, 8, 8) does not broadcast"]),
    ("att-bias-int", lambda be: att(be, q_(), kv_(), kv_(), attn_bias=torch.zeros(S, S, dtype=I32)), ITE,
     ["attn_bias dtype torch.int32"]),
    ("att-bias-5d", lambda be: att(be, q_(), kv_(), kv_(), attn_bias=t(1, 1, 1, S, S)), IAE, ["attn_bias of shape"]),
    ("att-bias-list", lambda be: att(be, q_(), kv_(), kv_(), attn_bias=[[0.] * S] * S), ITE, ["attn_bias must be a tensor"]),
    ("att-bias-meta", lambda be: att(be, q_(), kv_(), kv_(), attn_bias=t(S, S, device="meta")), IAE,
     ["attn_bias is on meta"]),
    # ---- out=
    ("att-out-shape", lambda be: att(be, q_(), kv_(), kv_(), out=t(B, H, S, D + 1)), IAE, ["out must have shape"]),
    ("att-out-dtype", lambda be: att(be, q_(), kv_(), kv_(), out=t(B, H, S, D, dtype=torch.float16)), ITE,
     ["out must have dtype"]),
    ("att-out-list", lambda be: att(be, q_(), kv_(), kv_(), out=[0]), ITE, ["out must be a torch.Tensor"]),
    ("att-out-expanded", lambda be: att(be, q_(), kv_(), kv_(), out=t(1, 1, 1, D).expand(B, H, S, D)), IAE,
     ["out has overlapping memory"]),                                                                   # fixed
    ("att-out-grad", lambda be: att(be, q_().requires_grad_(), kv_(), kv_(), out=t(B, H, S, D)), IAE,
     ["out= cannot be used with autograd"]),
    ("att-fp8-opts", lambda be: att(be, q_(), kv_(), kv_(), scale_s=1.0), IAE, ["scale_s"]),
    ("att-descale-fp32", lambda be: att(be, q_(), kv_(), kv_(), descale_q=1.0), IAE, ["descale_q"]),
    # ---- attention_forward
    ("fwd-stats-shape", lambda be: fwd(be, q_(), kv_(), kv_(), stats_out=t(B, H, S + 1, 1)), IAE,
     ["stats_out must have shape"]),
    ("fwd-stats-dtype", lambda be: fwd(be, q_(), kv_(), kv_(), stats_out=t(B, H, S, 1, dtype=torch.float64)), ITE,
     ["stats_out must have dtype"]),
    ("fwd-stats-list", lambda be: fwd(be, q_(), kv_(), kv_(), stats_out=[1]), ITE,
     ["stats_out must be a float32 torch.Tensor"]),                                                     # fixed
    ("fwd-out-expanded", lambda be: fwd(be, q_(), kv_(), kv_(), out=t(1, 1, 1, D).expand(B, H, S, D)), IAE,
     ["out has overlapping memory"]),                                                                   # fixed
    ("fwd-stats-expanded", lambda be: fwd(be, q_(), kv_(), kv_(), stats_out=t(1, 1, 1).expand(B, H, S)), IAE,
     ["stats_out has overlapping memory"]),                                                             # fixed
    ("fwd-page-only-k", lambda be: paged_fwd(be, torch.zeros(B, 2, dtype=I32), table_v=None), IAE,
     ["needs both page_table_k and page_table_v"]),
    ("fwd-page-oob", lambda be: paged_fwd(be, torch.full((B, 2), 9, dtype=I32)), IAE,
     ["page_table_k[0, 0] = 9", "4 blocks"]),                                                           # fixed
    ("fwd-page-neg", lambda be: paged_fwd(be, torch.full((B, 2), -1, dtype=I32)), IAE,
     ["page_table_k[0, 0] = -1"]),                                                                      # fixed
    ("fwd-page-v-oob", lambda be: paged_fwd(be, torch.zeros(B, 2, dtype=I32), table_v=ints([0, 1], [2, 4])), IAE,
     ["page_table_v[1, 1] = 4"]),                                                                       # fixed
    ("fwd-page-int64", lambda be: paged_fwd(be, torch.zeros(B, 2, dtype=torch.int64)), ITE, ["page_table_k must be int32"]),
    ("fwd-page-shape", lambda be: paged_fwd(be, torch.zeros(B + 1, 2, dtype=I32)), IAE, ["page_table_k must have shape"]),
    # ---- attention_backward
    ("bwd-stats-shape", lambda be: bwd(be, stats=t(B, 1, S, 1)), IAE, ["stats must have shape"]),
    ("bwd-stats-dtype", lambda be: bwd(be, stats=t(B, H, S, 1, dtype=torch.float64)), ITE, ["stats must have dtype"]),
    ("bwd-stats-none", lambda be: bwd(be, stats=None), ITE, ["stats must be a float32 torch.Tensor", "NoneType"]),  # fixed
    ("bwd-stats-list", lambda be: bwd(be, stats=[1]), ITE, ["stats must be a float32 torch.Tensor", "list"]),      # fixed
    ("bwd-gradout-shape", lambda be: bwd(be, grad_out=t(B, H, 1, D)), IAE, ["grad_out must have shape"]),
    ("bwd-gradout-dtype", lambda be: bwd(be, grad_out=t(B, H, S, D, dtype=torch.float16)), ITE, ["grad_out must have dtype"]),
    ("bwd-out-none", lambda be: bwd(be, out=None), ITE, ["out must be a torch.Tensor"]),
    ("bwd-dq-shape", lambda be: bwd(be, dq=t(1)), IAE, ["dq must have shape"]),
    ("bwd-dq-expanded", lambda be: bwd(be, dq=t(1, 1, 1, D).expand(B, H, S, D)), IAE, ["dq has overlapping memory"]),  # fixed
    ("bwd-dk-expanded", lambda be: bwd(be, dk=t(1, 1, 1, D).expand(B, HK, S, D)), IAE, ["dk has overlapping memory"]),  # fixed
    ("bwd-dsink-shape", lambda be: bwd(be, sink=t(H), dsink=t(H + 1)), IAE, ["dsink must have shape"]),
    ("bwd-dbias-no-bias", lambda be: bwd(be, need_dbias=True), IAE, ["need_dbias", "no attn_bias"]),   # fixed
    ("bwd-dbias-bool", lambda be: bwd(be, need_dbias=True, attn_bias=torch.ones(S, S, dtype=torch.bool)), IAE,
     ["need_dbias", "bool attn_bias"]),                                                                 # fixed
    # ---- attention_varlen
    ("var-q-4d", lambda be: fusedattn.attention_varlen(t(1, 10, H, D), packed(h=HK), packed(h=HK), CU, CU_K, 6, 6,
                                                       backend=be), IAE, ["q must be 3-D packed"]),
    ("var-q-list", lambda be: fusedattn.attention_varlen([1], packed(h=HK), packed(h=HK), CU, CU_K, 6, 6, backend=be),
     IAE, ["q must be 3-D packed", "list"]),
    ("var-cu-from-1", lambda be: varlen(be, cu_q=ints(1, 4, 10)), IAE, ["cu_seqlens_q must start at 0"]),
    ("var-cu-decreasing", lambda be: varlen(be, cu_q=ints(0, 6, 4)), IAE, ["cu_seqlens_q", "non-decreasing"]),
    ("var-cu-float", lambda be: varlen(be, cu_q=torch.tensor([0., 4., 10.])), ITE, ["cu_seqlens_q must be an int32"]),
    ("var-cu-over", lambda be: varlen(be, cu_q=ints(0, 4, 12), mq=8), IAE, ["cu_seqlens_q[-1] = 12", "10 rows"]),
    ("var-cu-count", lambda be: varlen(be, cu_k=ints(0, 10), mk=10), IAE, ["cu_seqlens_q has 3", "cu_seqlens_kv has 2"]),
    ("var-cu-2d", lambda be: varlen(be, cu_q=CU.view(1, 3)), ITE, ["cu_seqlens_q must be"]),
    ("var-cu-list", lambda be: varlen(be, cu_q=[0, 4, 10]), ITE, ["cu_seqlens_q must be", "list"]),
    ("var-cu-single", lambda be: varlen(be, cu_q=ints(0), cu_k=ints(0)), ITE, ["cu_seqlens_q must be"]),
    ("var-cu-meta", lambda be: varlen(be, cu_q=CU.to("meta")), IAE, ["cu_seqlens_q is on meta"]),
    ("var-cu-int64-wrap", lambda be: varlen(be, cu_q=ints(0, 2 ** 32 + 4, 10, dtype=torch.int64)), IAE,
     ["cu_seqlens_q", "4294967300"]),
    ("var-max-small", lambda be: varlen(be, mq=3), IAE, ["exceeds max_seqlen = 3", "cu_seqlens_q"]),
    ("var-max-neg", lambda be: varlen(be, mq=-1), IAE, ["max_seqlen_q must be an int >= 0"]),
    ("var-max-float", lambda be: varlen(be, mq=6.0), IAE, ["max_seqlen_q must be an int"]),
    ("var-max-tensor", lambda be: varlen(be, mq=torch.tensor(6)), IAE, ["max_seqlen_q must be an int"]),
    ("var-max-bool", lambda be: varlen(be, mq=True), IAE, ["max_seqlen_q must be an int", "True"]),    # fixed
    ("var-q-int", lambda be: fusedattn.attention_varlen(packed().int(), packed(h=HK), packed(h=HK), CU, CU_K, 6, 6,
                                                        backend=be), ITE, ["q has dtype torch.int32"]),
    ("var-heads", lambda be: fusedattn.attention_varlen(packed(h=3), packed(h=HK), packed(h=HK), CU, CU_K, 6, 6,
                                                        backend=be), IAE, ["query heads (3)"]),
    ("var-sink-shape", lambda be: varlen(be, sink=t(H + 1)), IAE, ["sink must be a float tensor"]),
    ("var-dropout-1", lambda be: varlen(be, dropout_p=1.0), IAE, ["dropout_p must be in [0, 1)"]),
    ("var-meta", lambda be: fusedattn.attention_varlen(*(x.to("meta") for x in (packed(), packed(h=HK), packed(h=HK),
                                                                                 CU, CU_K)), 6, 6, backend=be), NSE,
     ["meta"]),                                                                                          # fixed
    # ---- attention_with_kvcache
    ("kvc-len-over", lambda be: kvc(be, seq_len_kv=ints(3, 17)), IAE, ["seq_len_kv[1] = 17", "s_max = 16"]),
    ("kvc-len-neg", lambda be: kvc(be, seq_len_kv=ints(-1, 5)), IAE, ["seq_len_kv[0] = -1 is negative"]),
    ("kvc-len-count", lambda be: kvc(be, seq_len_kv=ints(3)), IAE, ["seq_len_kv must have shape [2]"]),
    ("kvc-len-float", lambda be: kvc(be, seq_len_kv=torch.tensor([3., 5.])), ITE, ["seq_len_kv must be an int32"]),
    ("kvc-len-int", lambda be: kvc(be, seq_len_kv=5), ITE, ["seq_len_kv must be an int32 tensor"]),
    ("kvc-page-oob", lambda be: kvc(be, kc=pages(), page_table=ints([0, 1], [2, 7]), seq_len_kv=ints(8, 8)), IAE,
     ["page_table[1, 1] = 7", "6 blocks"]),
    ("kvc-page-neg", lambda be: kvc(be, kc=pages(), page_table=ints([0, -1], [2, 3]), seq_len_kv=ints(8, 8)), IAE,
     ["page_table[0, 1] = -1"]),
    ("kvc-page-shape", lambda be: kvc(be, kc=pages(), page_table=ints([0, 1]), seq_len_kv=ints(8, 8)), IAE,
     ["page_table must have shape"]),
    ("kvc-page-int64", lambda be: kvc(be, kc=pages(), page_table=ints([0, 1], [2, 3], dtype=torch.int64)), ITE,
     ["page_table must be int32"]),
    ("kvc-page-list", lambda be: kvc(be, kc=pages(), page_table=[[0, 1], [2, 3]]), ITE, ["page_table must be an int32"]),
    ("kvc-page-cap", lambda be: kvc(be, kc=pages(), page_table=ints([0, 1], [2, 3]), seq_len_kv=ints(8, 9)), IAE,
     ["seq_len_kv[1] = 9", "8 keys"]),
    ("kvc-knew-shape", lambda be: kvc(be, k_new=t(B, HK, 2, D), v_new=t(B, HK, 2, D), seq_len_kv=ints(3, 5)), IAE,
     ["k_new must have shape"]),
    ("kvc-knew-alone", lambda be: kvc(be, k_new=t(B, HK, 1, D), seq_len_kv=ints(3, 5)), IAE, ["k_new and v_new"]),
    ("kvc-knew-dtype", lambda be: kvc(be, k_new=t(B, HK, 1, D, dtype=torch.float16),
                                      v_new=t(B, HK, 1, D, dtype=torch.float16), seq_len_kv=ints(3, 5)), ITE,
     ["k_new has dtype torch.float16"]),
    ("kvc-no-room", lambda be: kvc(be, k_new=t(B, HK, 1, D), v_new=t(B, HK, 1, D), seq_len_kv=ints(0, 5)), IAE,
     ["seq_len_kv[0] = 0"]),
    ("kvc-cache-dtype", lambda be: kvc(be, kc=t(B, HK, 16, D, dtype=torch.float16)), ITE, ["k_cache has dtype"]),
    ("kvc-cache-3d", lambda be: kvc(be, kc=t(HK, 16, D)), IAE, ["k_cache must be 4-D"]),
    ("kvc-gqa", lambda be: kvc(be, q=t(B, 5, 1, D)), IAE, ["query heads (5)"]),
    ("kvc-cache-batch", lambda be: kvc(be, kc=t(B + 1, HK, 16, D)), IAE, ["k_cache has batch 3"]),
    ("kvc-kv-differ", lambda be: kvc(be, vc=t(B, HK, 12, D)), IAE, ["k_cache and v_cache must agree"]),
    ("kvc-cache-meta", lambda be: kvc(be, kc=t(B, HK, 16, D, device="meta")), IAE, ["k_cache is on meta"]),
    ("kvc-layout", lambda be: kvc(be, cache_layout="bsdh"), IAE, ["cache_layout must be one of"]),
    ("kvc-splits-0", lambda be: kvc(be, num_splits=0), IAE, ["num_splits"]),
    ("kvc-splits-big", lambda be: kvc(be, num_splits=1000), IAE, ["num_splits"]),
    ("kvc-splits-float", lambda be: kvc(be, num_splits=2.5), IAE, ["num_splits"]),
    ("kvc-scale-nan", lambda be: kvc(be, attn_scale=float("nan")), IAE, ["attn_scale"]),
    ("kvc-softcap-neg", lambda be: kvc(be, softcap=-1.0), IAE, ["softcap"]),
    ("kvc-window", lambda be: kvc(be, window=(-3, 0)), IAE, ["window[left]"]),
    ("kvc-sink", lambda be: kvc(be, sink=t(H + 1)), IAE, ["sink must be a float tensor"]),
    ("kvc-alibi", lambda be: kvc(be, alibi=t(H + 1)), IAE, ["alibi slopes"]),
    ("kvc-seqlen-q", lambda be: kvc(be, seq_len_q=ints(2, 1)), IAE, ["seq_len_q[0] = 2"]),
    ("kvc-out-shape", lambda be: kvc(be, out=t(B, H, 2, D)), IAE, ["out must have shape"]),
    ("kvc-out-expanded", lambda be: kvc(be, out=t(1, 1, 1, D).expand(B, H, 1, D)), IAE,
     ["out has overlapping memory"]),                                                                   # fixed
    ("kvc-cu-decreasing", lambda be: kvc(be, q=t(3, H, D), cu_seqlens_q=ints(0, 2, 1), max_seqlen_q=2), IAE,
     ["cu_seqlens_q must be non-decreasing"]),
    ("kvc-cu-no-max", lambda be: kvc(be, q=t(3, H, D), cu_seqlens_q=ints(0, 2, 3)), IAE, ["max_seqlen_q"]),
    ("kvc-cu-over", lambda be: kvc(be, q=t(3, H, D), cu_seqlens_q=ints(0, 2, 5), max_seqlen_q=3), IAE,
     ["cu_seqlens_q[-1] = 5"]),
    ("kvc-descale-float", lambda be: kvc(be, descale_k=1.0, descale_v=1.0), IAE, ["descale_k"]),
    ("kvc-q-int", lambda be: kvc(be, q=t(B, H, 1, D).int()), ITE, ["q has dtype torch.int32"]),
    ("kvc-q-list", lambda be: kvc(be, q=[1]), ITE, ["q must be a torch.Tensor"]),
    ("kvc-meta", lambda be: kvc(be, q=t(B, H, 1, D, device="meta"), kc=t(B, HK, 16, D, device="meta")), NSE, ["meta"]),
    # ---- flash_attn door
    ("fa-q-3d", lambda be: fa_func(be, q=t(S, H, D)), IAE, ["q must be 4-D"]),
    ("fa-gqa", lambda be: fa_func(be, q=t(B, S, 5, D)), IAE, ["query heads (5)"]),
    ("fa-window-3", lambda be: fa_func(be, window_size=(1, 2, 3)), IAE, ["window_size must be a pair"]),
    ("fa-window-none", lambda be: fa_func(be, window_size=None), IAE, ["window_size must be a pair"]),
    ("fa-window-float", lambda be: fa_func(be, window_size=(1.5, 0)), IAE, ["window_size[left] must be an int"]),  # fixed
    ("fa-window-str", lambda be: fa_func(be, window_size=("3", 0)), IAE, ["window_size[left] must be an int"]),    # fixed
    ("fa-dropout-1", lambda be: fa_func(be, dropout_p=1.0), IAE, ["dropout_p must be in [0, 1)"]),
    ("fa-dropout-nan", lambda be: fa_func(be, dropout_p=float("nan")), IAE, ["dropout_p"]),
    ("fa-softcap-neg", lambda be: fa_func(be, softcap=-1.0), IAE, ["softcap"]),
    ("fa-scale-nan", lambda be: fa_func(be, softmax_scale=float("nan")), IAE, ["softmax_scale", "nan"]),
    ("fa-scale-neg", lambda be: fa_func(be, softmax_scale=-0.5), IAE, ["softmax_scale", "> 0"]),
    ("fa-scale-str", lambda be: fa_func(be, softmax_scale="x"), ITE, ["softmax_scale must be a float"]),  # fixed
    ("fa-causal-str", lambda be: fa_func(be, causal="no"), ITE, ["causal must be a bool"]),               # fixed
    ("fa-alibi-shape", lambda be: fa_func(be, causal=True, alibi_slopes=t(H + 1)), IAE, ["alibi_slopes must have shape"]),
    ("fa-sink-shape", lambda be: fa_func(be, learnable_sink=t(H + 1)), IAE, ["sink must be a float tensor"]),
    ("fa-mixed-dtype", lambda be: fa_func(be, k=t(B, S, HK, D, dtype=torch.float16)), ITE, ["share a dtype"]),
    ("fa-list-q", lambda be: fa_func(be, q=[1]), ITE, ["q must be a torch.Tensor"]),
    ("fa-d0", lambda be: fa_func(be, q=t(B, S, H, 0), k=t(B, S, HK, 0), v=t(B, S, HK, 0)), NSE, ["headdim 0"]),
    ("fa-int-q", lambda be: fa_func(be, q=t(B, S, H, D).int()), ITE, ["q has dtype torch.int32"]),
    ("fav-cu-int64", lambda be: fa_varlen(be, cu_q=ints(0, 4, 10, dtype=torch.int64)), ITE,
     ["cu_seqlens_q must be an int32"]),
    ("fav-cu-from-2", lambda be: fa_varlen(be, cu_q=ints(2, 4, 10)), IAE, ["cu_seqlens_q must start at 0"]),
    ("fav-cu-decreasing", lambda be: fa_varlen(be, cu_q=ints(0, 6, 4)), IAE, ["cu_seqlens_q", "non-decreasing"]),
    ("fav-cu-over", lambda be: fa_varlen(be, cu_q=ints(0, 4, 12), mq=8), IAE, ["cu_seqlens_q[-1] = 12"]),
    ("fav-max-small", lambda be: fa_varlen(be, mq=2), IAE, ["max_seqlen = 2"]),
    ("fav-max-str", lambda be: fa_varlen(be, mq="6"), IAE, ["max_seqlen_q must be an int"]),
    ("fav-q-4d", lambda be: fa.flash_attn_varlen_func(t(1, 10, H, D), packed(h=HK), packed(h=HK), CU, CU_K, 6, 6,
                                                      backend=be), IAE, ["q must be 3-D"]),
    ("fav-block-oob", lambda be: fa_varlen(be, k=t(6, 4, HK, D), cu_k=ints(0, 8, 16), mk=8,
                                           block_table=ints([0, 9], [2, 3])), IAE, ["page_table[0, 1] = 9"]),
    ("fav-block-shape", lambda be: fa_varlen(be, k=t(6, 4, HK, D), cu_k=ints(0, 4, 8), mk=8,
                                             block_table=ints([0, 1])), IAE, ["page_table must have shape"]),
    ("fav-block-float", lambda be: fa_varlen(be, k=t(6, 4, HK, D), cu_k=ints(0, 4, 8), mk=8,
                                             block_table=torch.zeros(2, 2)), ITE, ["page_table must be int32"]),
    ("fak-lens-over", lambda be: fa_kvc(be, cache_seqlens=ints(3, 17)), IAE, ["seq_len_kv[1] = 17"]),
    ("fak-lens-neg", lambda be: fa_kvc(be, cache_seqlens=ints(-3, 5)), IAE, ["seq_len_kv[0] = -3"]),
    ("fak-lens-int-neg", lambda be: fa_kvc(be, cache_seqlens=-1), IAE, ["seq_len_kv[0] = -1"]),
    ("fak-lens-float", lambda be: fa_kvc(be, cache_seqlens=torch.tensor([3., 5.])), ITE, ["cache_seqlens must be"]),
    ("fak-lens-count", lambda be: fa_kvc(be, cache_seqlens=ints(3, 5, 6)), IAE, ["cache_seqlens must be"]),
    ("fak-lens-list", lambda be: fa_kvc(be, cache_seqlens=[3, 5]), ITE, ["cache_seqlens must be"]),
    ("fak-append-full", lambda be: fa_kvc(be, k=t(B, 1, HK, D), v=t(B, 1, HK, D), cache_seqlens=ints(3, 16)), IAE,
     ["seq_len_kv[1] = 17"]),
    ("fak-k-alone", lambda be: fa_kvc(be, k=t(B, 1, HK, D), cache_seqlens=ints(3, 5)), IAE, ["k and v must be given"]),
    ("fak-block-oob", lambda be: fa_kvc(be, kc=t(6, 4, HK, D), block_table=ints([0, 1], [2, 7]),
                                        cache_seqlens=ints(8, 8)), IAE, ["page_table[1, 1] = 7"]),
    ("fak-batch-idx-oob", lambda be: fa_kvc(be, cache_seqlens=ints(3, 5), cache_batch_idx=ints(0, 5)), IAE,
     ["page_table[1, 0] = 5"]),
    ("fak-batch-idx-float", lambda be: fa_kvc(be, cache_seqlens=ints(3, 5), cache_batch_idx=torch.tensor([0., 1.])),
     IAE, ["cache_batch_idx must be an int tensor", "float32"]),                                       # fixed
    ("fak-leftpad", lambda be: fa_kvc(be, cache_seqlens=ints(3, 5), cache_leftpad=ints(4, 0)), IAE,
     ["cache_leftpad[0] = 4"]),
    ("fak-window", lambda be: fa_kvc(be, cache_seqlens=ints(3, 5), window_size=(0,)), IAE, ["window_size"]),
    ("fak-softcap", lambda be: fa_kvc(be, cache_seqlens=ints(3, 5), softcap=-2.0), IAE, ["softcap"]),
    ("fak-rotary-no-k", lambda be: fa_kvc(be, cache_seqlens=ints(3, 5), rotary_cos=t(16, 4), rotary_sin=t(16, 4)), IAE,
     ["rotary_cos/rotary_sin need the new k"]),
    ("fak-q-3d", lambda be: fa_kvc(be, q=t(1, H, D), cache_seqlens=ints(3, 5)), IAE, ["q must be 4-D"]),
]


@pytest.mark.parametrize("backend", ["cpu", "auto"])
@pytest.mark.parametrize("name,call,exc,needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, call, exc, needles, backend):
    with pytest.raises(exc) as info:
        call(backend)
    assert isinstance(info.value, FusedAttnError), f"{name}: {type(info.value).__name__} is not a FusedAttnError"
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{name}: message {msg!r} lacks {needle!r}"


def test_valid_neighbours_still_run():
    """The fixes refuse nothing valid: 0/1 and numpy bools as flags, alibi=None, BSHD and sliced outputs,
    unused page-table slots holding -1, int64 cache_batch_idx."""
    q, k, v = q_(), kv_(), kv_()
    ref = fusedattn.attention(q, k, v, causal=True)
    assert torch.equal(fusedattn.attention(q, k, v, causal=1), ref)
    assert torch.equal(fusedattn.attention(q, k, v, causal=np.bool_(True)), ref)
    assert torch.equal(fusedattn.attention(q, k, v, causal=True, alibi=None), ref)
    for out in (torch.empty(B, S, H, D).transpose(1, 2), torch.empty(B, H, S, 2 * D)[..., ::2]):
        fusedattn.attention(q, k, v, causal=True, out=out)
        assert torch.equal(out, ref)
    c = t(4, HK, 4, D)
    table = ints([0, 1], [2, -1])               # sequence 1 has 3 keys: its slot 1 is never read
    fusedattn.attention_forward(q, c, c, page_table_k=table, page_table_v=table, seq_len_kv=ints(8, 3))
    fa.flash_attn_with_kvcache(t(B, 1, H, D), t(B, 16, HK, D), t(B, 16, HK, D), cache_seqlens=ints(3, 5),
                               cache_batch_idx=ints(1, 0, dtype=torch.int64))


def test_varlen_unchecked_decreasing_offsets_do_not_crash():
    """validate=False with offsets that decrease: clamped (as the kernels clamp), no RuntimeError."""
    out = fusedattn.attention_varlen(packed(), packed(h=HK), packed(h=HK), ints(0, 6, 4), CU_K, 6, 6,
                                     backend="cpu", validate=False)
    assert out.shape == (10, H, D) and not out.isnan().any()


# ---- the cuDNN-style Graph door

def _graph(q_shape=(1, 4, 8, 16), k_shape=(1, 4, 8, 16), **sdpa):
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    tensors = [graph.tensor(name=n, dim=s, stride=torch.empty(s).stride()) for n, s in
               (("Q", q_shape), ("K", k_shape), ("V", k_shape))]
    o, _ = graph.sdpa(*tensors, is_inference=True, **sdpa)
    o.set_output(True)
    graph.build()
    return graph, tensors, o


def _run_graph(**pack):
    graph, (q, k, v), o = _graph()
    vals = {"q": t(1, 4, 8, 16), "k": t(1, 4, 8, 16), "v": t(1, 4, 8, 16), "o": t(1, 4, 8, 16)}
    vals.update(pack)
    graph.execute({q: vals["q"], k: vals["k"], v: vals["v"], o: vals["o"]}, None)


GRAPH_CASES = [
    ("scale-nan", lambda: _graph(attn_scale=float("nan")), ["attn_scale"]),
    ("scale-neg", lambda: _graph(attn_scale=-1.0), ["attn_scale"]),
    ("scale-str", lambda: _graph(attn_scale="a"), ["attn_scale"]),
    ("dropout-1", lambda: _graph(dropout=(1.0, None, None)), ["dropout probability"]),
    ("left-bound-neg", lambda: _graph(diagonal_band_left_bound=-3), ["diagonal_band_left_bound"]),
    ("right-bound-neg", lambda: _graph(diagonal_band_right_bound=-3), ["diagonal_band_right_bound"]),
    ("left-bound-float", lambda: _graph(diagonal_band_left_bound=1.5), ["diagonal_band_left_bound"]),
    ("window-neg", lambda: _graph(use_causal_mask=True, sliding_window_length=-2), ["sliding_window_length"]),
    ("alignment-str", lambda: _graph(diagonal_alignment="nope"), ["diagonal_alignment"]),
    ("gqa", lambda: _graph(q_shape=(1, 5, 8, 16)), ["query heads (5)"]),
    ("d0", lambda: _graph(q_shape=(1, 4, 8, 0), k_shape=(1, 4, 8, 0)), ["'Q'", "empty dim"]),
    ("rank-3", lambda: _graph(q_shape=(4, 8, 16)), ["'Q'", "4-D"]),
    ("neg-dim", lambda: cudnn.pygraph().tensor(name="Q", dim=[1, -4, 8, 16], stride=[512, 128, 16, 1]),
     ["'Q'", "non-negative"]),
    ("pack-int-q", lambda: _run_graph(q=t(1, 4, 8, 16).int()), ["'Q'", "torch.int32"]),
    ("pack-none-q", lambda: _run_graph(q=None), ["missing q"]),
    ("pack-meta-q", lambda: _run_graph(q=t(1, 4, 8, 16, device="meta")), ["meta"]),
    ("pack-list-q", lambda: _run_graph(q=[1, 2]), ["must be a torch tensor"]),
    ("pack-o-expanded", lambda: _run_graph(o=t(1, 1, 1, 16).expand(1, 4, 8, 16)), ["overlapping memory"]),  # fixed
]


@pytest.mark.parametrize("name,call,needles", GRAPH_CASES, ids=[c[0] for c in GRAPH_CASES])
def test_graph_bad_input(name, call, needles):
    with pytest.raises(cudnn.GraphError) as info:
        call()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{name}: message {msg!r} lacks {needle!r}"
