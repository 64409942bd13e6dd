"""Host side: the run-time scalars and compile-time switches every launch derives from a problem."""
import functools

import torch
import triton

from ..compat import TRITON_VERSION
from ..cpu import dropout_threshold
from .launch import pow2


LOG2E_PY = 1.4426950408889634


def kernel_scalars(p, extras, dummy):
    """Run-time scalars and compile-time switches shared by the forward and backward launches."""
    args = dict(_static_scalars(p))
    args["seq_q"] = extras["seq_len_q"] if extras["seq_len_q"] is not None else dummy
    args["seq_kv"] = extras["seq_len_kv"] if extras["seq_len_kv"] is not None else dummy
    args["slopes"] = extras["slopes"] if extras["slopes"] is not None else dummy
    args["stride_sb"] = slope_batch_stride(extras["slopes"])
    args["sink"] = extras["sink"] if extras.get("sink") is not None else dummy
    return args


def slope_batch_stride(slopes) -> int:
    """Batch stride of fp32 [b, h_q] ALiBi slopes (0 for per-head slopes, expanded); 0 without ALiBi."""
    return slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0


def block_dim(d: int) -> int:
    """The tile width over a head dim: the next power of two, at least 16 (tl.dot's smallest K and N).
    Dims below it (any d from 1 to 256) are masked to the true d on every load and store."""
    return max(16, pow2(d))


def head_blocks(p) -> tuple:
    """(BLOCK_D, BLOCK_DV): the forward's and backward's tile widths over d and d_v.

    Each is :func:`block_dim` of its dim, except before Triton 3.9 where neither dim fills its tile and
    the two tiles differ: then both take the wider one. Triton 3.6 compiles those kernels wrongly (H100,
    session 27, fuzzing: d 24 / d_v 8 with a bias or dropout gave NaN or errors of 0.3-1.4, with per-batch
    query lengths an illegal address; d 40 / 8 likewise), while d 24 / 24, 24 / 16, 32 / 8 and 64 / 8 were
    right, as was 3.9.0 at 24 / 8. One width for both is the d 24 / 24 kernel, masked to the true d_v.
    3.7 and 3.8 are not measured: treated as 3.6. Power-of-two dims (MLA's 192 / 128 has d_v 128) keep
    their own widths.
    """
    block_d, block_dv = block_dim(p.d), block_dim(p.d_v)
    if block_d != p.d and block_dv != p.d_v and TRITON_VERSION < (3, 9):
        block_d = block_dv = max(block_d, block_dv)
    return block_d, block_dv


@functools.lru_cache(maxsize=256)
def _static_scalars(p):
    """The part of kernel_scalars that depends on the problem alone (cached: ~15 us of host time)."""
    band = p.band
    has_left = band is not None and band.left is not None
    has_right = band is not None and band.right is not None
    softcap = p.softcap > 0.0
    qk_scale = p.scale / p.softcap if softcap else p.scale * LOG2E_PY
    block_d, block_dv = head_blocks(p)
    return {
        "block_d": block_d,
        "block_dv": block_dv,
        "qk_scale": qk_scale,
        "win_left": band.left if has_left else 0,
        "win_right": band.right if has_right else 0,
        "dropout_threshold": dropout_threshold(p.dropout_p),
        "dropout_rescale": 1.0 / (1.0 - p.dropout_p),
        "causal_like": has_right and not has_left,
        "switches": dict(
            BOTTOM_RIGHT=band is not None and band.alignment == "bottom_right",
            HAS_LEFT=has_left, HAS_RIGHT=has_right,
            HAS_SEQ_Q=p.has_seq_len_q, HAS_SEQ_KV=p.has_seq_len_kv,
            BIAS_KIND={None: 0, "float": 1, "bool": 2}[p.bias],
            HAS_ALIBI=p.alibi is not None, SOFTCAP=softcap, DROPOUT=p.has_dropout,
            DOT_PRECISION="ieee" if p.dtype == torch.float32 else "tf32",
            # head dims that are not powers of two (40, 96, 224) or below 16 pad the tile and mask loads
            EVEN_D=block_d == p.d, EVEN_DV=block_dv == p.d_v,
        ),
    }


# the optional tensors a problem may carry (the kernels get dummies, already aligned, for absent ones)
_EXTRA_TENSORS = ("seq_len_q", "seq_len_kv", "bias", "slopes", "page_table_k", "page_table_v",
                  "cu_seqlens_q", "cu_seqlens_kv", "sink")


def is_plain(p) -> bool:
    """No optional tensor and no per-call scalar: the kernels get dummies (q, out) for every
    optional tensor, so a launch's whole argument list can be remembered (fwd/bwd _PLAIN_ARGS)."""
    return not (p.paged or p.varlen or p.bias or p.alibi or p.has_dropout or p.has_seq_len_q or p.has_seq_len_kv
                or p.has_sink)


def extras_key(extras):
    """dtype and 16-byte alignment of each optional tensor (the JIT specializes on both) and its
    strides (the slopes' batch stride is a kernel argument): part of a launch.Launcher key."""
    return tuple(None if t is None else (t.dtype, t.data_ptr() % 16 == 0, t.stride())
                 for t in (extras.get(n) for n in _EXTRA_TENSORS))


def misaligned(t) -> bool:
    """Compiled Triton kernels assume 16-byte aligned base pointers (measured on an H100 with
    Triton 3.6: a bf16 tensor at storage offset 7 gave wrong results and illegal accesses)."""
    return t is not None and t.data_ptr() % 16 != 0


def aligned(t):
    """t itself, or an aligned copy when its base pointer is not 16-byte aligned (rare: odd slices)."""
    return t.clone() if misaligned(t) else t


def aligned_output(t):
    """(buffer to write, tensor to copy it into afterwards or None)."""
    if misaligned(t):
        return torch.empty_like(t), t
    return t, None


def tma_ok(*tensors) -> bool:
    """Tensor descriptors need a unit stride on the head dim and 16-byte aligned row strides."""
    return all(t.is_cuda and t.stride(-1) == 1 and (t.stride(-2) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in tensors)


_ALLOCATOR_SET = False


def set_descriptor_allocator():
    """In-kernel tl.make_tensor_descriptor needs a global scratch allocator (once per process)."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET = True
