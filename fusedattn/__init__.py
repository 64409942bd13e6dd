"""fusedattn: fused scaled-dot-product attention (the FlashAttention algorithm) in Triton.

Two front doors over one validated problem description:

* ``fusedattn.attention(q, k, v, causal=True)``: functional, autograd, ``torch.compile``;
* the cuDNN frontend Graph API (``import fusedattn as cudnn``): ``Graph``, ``pygraph``, ...
"""
__version__ = "0.1.0"

from .functional import attention, attention_backward, attention_forward  # noqa: F401
from .varlen import attention_varlen  # noqa: F401
from .kvcache import attention_with_kvcache  # noqa: F401
from . import fp8  # noqa: F401  (FP8 attention: cuDNN sdpa_fp8 semantics)
from .fp8 import attention_fp8  # noqa: F401
from .problem import FusedAttnError, NotSupportedError, alibi_slopes  # noqa: F401

from .graph import *  # noqa: F401,F403  (the cuDNN-compatible Graph door)
