"""Compile ahead of the first call: ``fusedattn.warmup()`` / ``python -m fusedattn warmup``.

Compiling the kernels of a forward and backward takes seconds (Triton compiles for this GPU, this
Triton and these compile-time switches); Triton keeps the results in its on-disk cache (``~/.triton/cache``
or ``TRITON_CACHE_DIR``), keyed by the GPU architecture, the Triton version and its compiler's source,
the kernel's source and every compile-time constant and specialization. So a kernel compiled once, by
any process, is loaded in milliseconds by every later one, and a stale entry (another Triton, another
kernel source) is never found. Triton writes each entry to a temporary name and renames it into place,
so processes sharing the cache never read a half-written entry (``tests/test_kernel_cache.py``).

``warmup`` runs the common configurations (the benchmark's: ``shared/ANCHORS.md``'s eight, each mask
kind, decode and paged prefill; each one's forward alone, as inference calls it, and its forward under
autograd with the backward; the FP8 group's forward and backward through the Graph door and its forward through
the functional one; then ``bench --cold-start``'s call, two packed varlen batches and four long
d=64 calls, fp16 / bf16, causal or not) at
their real sizes (shapes decide the kernels' specializations) inside
``backends.triton.launch.compiling_ahead``: nothing runs on the GPU, and every kernel compiles on a pool
of threads, side by side. Without it, a process's first call compiles only what it needs, its backward's
kernels side by side with its forward's (``functional._compile_backward_ahead``).
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

GROUPS = ("anchors", "masked", "decode", "prefill", "fp8")


def warmup(groups: Iterable[str] = GROUPS, device: Optional[torch.device] = None, verbose: bool = False,
           record: Optional[str] = None) -> dict:
    """Compile the kernels of the benchmark's configurations in ``groups`` (forward and backward) for
    ``device`` (default: the current CUDA device) into Triton's cache. Returns ``{"configs": n,
    "kernels": compiles started, "seconds": wall time}``; raises the first compile error. On a machine
    without CUDA (or under the interpreter) there is nothing to compile: returns zeros.

    ``record``: a directory; every kernel compiled is also written to a store of shipped kernels under
    it (``backends.prebuilt``; the store's path is returned as ``"store"``). Recording compiles
    everything, shipped store or not, so use a fresh process."""
    from .backends import prebuilt
    from .backends.triton import launch
    from .plan import interpreting
    if not torch.cuda.is_available() or interpreting():
        return {"configs": 0, "kernels": 0, "seconds": 0.0}
    device = device or torch.device("cuda", torch.cuda.current_device())
    store = prebuilt.start_recording(record, prebuilt.device_arch(device.index or 0)) if record else None
    todo = calls(groups, device)
    start = time.perf_counter()
    with launch.compiling_ahead() as ahead:
        for name, call in todo:
            call()
            if verbose:
                print(f"warmup: {name}: {len(ahead.futures)} compiles started", flush=True)
    ahead.wait()
    torch.cuda.synchronize(device)
    n_configs = sum(":" in name for name, _ in todo)
    return {"configs": n_configs, "kernels": len(ahead.futures), "seconds": time.perf_counter() - start,
            "store": store}


def calls(groups: Iterable[str] = GROUPS, device: Optional[torch.device] = None) -> list:
    """Every call ``warmup`` makes, in its order, as ``[(name, call)]``; ``call()`` runs it and returns the tensors
    it produced (outputs, gradients). Names: ``GROUP:CONFIG`` for the benchmark's configurations (each one's
    forward alone, as inference calls it (no_grad: no stats written, a kernel specialization of its own), then
    its forward under autograd with the backward), then ``first-call``, ``varlen-N`` and ``d64-4k-DTYPE[-causal]``.
    tools/store_gpu_check.py runs them for real against the shipped kernels."""
    from . import bench
    device = device or torch.device("cuda", torch.cuda.current_device())

    def config_call(cfg):
        inputs = bench.make_inputs(cfg, device)
        if cfg.table == "fp8":
            return _fp8_calls(cfg, inputs)
        runner = bench.prepare_ours(cfg, True)(inputs)
        outs = [runner.fwd()]
        if runner.make_bwd is not None:
            # the forward under autograd compiles the backward's kernels ahead (functional.
            # _compile_backward_ahead); the backward itself runs on PyTorch's autograd thread,
            # where launches run: it waits for those compiles and launches on the placeholder data
            outs += list(runner.make_bwd()())
        return outs

    from .plan import fp8_kernels_run
    # no FP8 group where the FP8 kernels do not compile (the emulation runs those calls: nothing to warm)
    groups = [g for g in groups if g != "fp8" or fp8_kernels_run(device)]
    todo = [(f"{group}:{cfg.name}", lambda cfg=cfg: config_call(cfg))
            for group in groups for cfg in bench.select_configs(_Args(group))]
    todo.append(("first-call", lambda: _first_call(device)))
    for max_len in (2048, 1999):        # the JIT specializes an int on divisibility by 16
        todo.append((f"varlen-{max_len}", lambda m=max_len: _varlen_call(device, m)))
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            todo.append((f"d64-4k-{str(dtype)[6:]}{'-causal' if causal else ''}",
                         lambda d=dtype, c=causal: _long_d64_call(device, d, c)))
    return todo


def _fp8_calls(cfg, inputs) -> list:
    """One FP8 configuration of the benchmark (issue 27) as its users call it: the Graph door's ``sdpa_fp8`` /
    ``sdpa_fp8_backward`` as ``bench`` times them (e4m3 O and gradients, cuDNN's Hopper types), then the functional
    door's FP8 forward (``fusedattn.attention`` on the e4m3 tensors: bf16 O, no stats: builds of their own).
    Returns [o, dq, dk, dv, o_bf16]."""
    from .functional import attention
    from . import bench
    runner = bench.prepare_ours_fp8(cfg, True)(inputs)
    outs = [runner.fwd()] + list(runner.make_bwd()()[:3])
    descales = {f"descale_{n}": inputs.extra[f"descale_{n}"] for n in "qkv"}
    outs.append(attention(inputs.q, inputs.k, inputs.v, causal=cfg.causal, **descales))
    return outs


def _first_call(device: torch.device) -> list:
    """The call ``bench --cold-start`` times (``fusedattn.coldstart``): forward and backward, b 4, h 16,
    s 2048, d 128, bf16, causal, physically BSHD. Returns [out, dq, dk, dv]."""
    from .functional import attention
    b, h, s, d = 4, 16, 2048, 128
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    out = attention(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    return [out, q.grad, k.grad, v.grad]


def _varlen_call(device: torch.device, max_len: int) -> list:
    """A packed batch (``attention_varlen``): 8 sequences of 256 to ``max_len`` tokens, h 32, d 128,
    bf16, causal, forward and backward. Returns [out, dq, dk, dv]."""
    from .varlen import attention_varlen
    lens = torch.linspace(256, max_len, 8).round().int()
    lens[-1] = max_len
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]).to(device)
    q, k, v = (torch.randn(int(lens.sum()), 32, 128, device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    out = attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=True)
    out.backward(torch.ones_like(out))
    return [out, q.grad, k.grad, v.grad]


def _long_d64_call(device: torch.device, dtype: torch.dtype, causal: bool) -> list:
    """Forward and backward at d 64, b 2, h 16, s 4096, physically BSHD: the d=64 backward's single-pass kernel
    (``plan.GLUON_BWD_FUSED_MIN_WORK``), as the benchmark's d=64 configurations take it too (at other head counts).
    Returns [out, dq, dk, dv]."""
    from .functional import attention
    b, h, s, d = 2, 16, 4096, 64
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))
    out = attention(q, k, v, causal=causal)
    out.backward(torch.ones_like(out))
    return [out, q.grad, k.grad, v.grad]


class _Args:
    """What ``bench.select_configs`` reads."""

    def __init__(self, group: str):
        self.configs, self.only = group, None
