"""Kernels written in Triton's Gluon dialect (explicit layouts, shared memory and barriers).

``fwd_sm90``: a Hopper-only (sm_90) attention forward kernel, FlashAttention-3 style.
"""
