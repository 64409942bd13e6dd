"""``fusedattn bench --cold-start``: the first call of a fresh process, ours beside torch's cuDNN backend
and FlexAttention, with an empty compile cache and with a warm one.

Each measurement is a new Python process (``python -c``) that imports torch, makes the inputs on the GPU
(CUDA context up, synchronized) and runs one tiny autograd backward (PyTorch's own first-backward
imports), then times its first forward + backward (b 4, h 16, s 2048, d 128, bf16,
causal; physically BSHD) to the end of a synchronize. "empty cache" gives the process a new, empty Triton
cache (and Inductor cache, for Flex); "warm" runs the same again on the cache the first run filled, as a
user's second process does (or any process after ``fusedattn warmup``). Kernels shipped compiled
(``backends.prebuilt``) are found either way; fusedattn's cells say how many it loaded from there
(``FUSEDATTN_PREBUILT=0`` in the environment measures without them). FUSEDATTN_COLD_PROFILE=PREFIX
writes each child's cProfile (top 40 by cumulative time) to PREFIX-WHICH-PID.txt.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time
import torch
which = sys.argv[1]
b, h, s, d = 4, 16, 2048, 128
mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
q, k, v = mk(), mk(), mk()
# PyTorch's first backward with an explicit gradient imports torch.fx's symbolic shapes (sympy: 2.65 s of a
# 3.57 s warm first call on the H100 machine, whose site-packages keep no bytecode), whatever the attention:
# paid here, before the clock, for every subject (a scalar backward does not import it)
warm = torch.ones(2, device="cuda", requires_grad=True)
(warm * 2).backward(torch.ones_like(warm))
torch.cuda.synchronize()
t_import = time.perf_counter()
if which == "fusedattn":
    import fusedattn
    attn = lambda: fusedattn.attention(q, k, v, causal=True)
elif which == "flex":
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(lambda b_, h_, i, j: j <= i, None, None, s, s, device="cuda")
    flex = torch.compile(flex_attention)
    attn = lambda: flex(q, k, v, block_mask=mask)
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    def attn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
import os
profile = os.environ.get("FUSEDATTN_COLD_PROFILE")
if profile:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t0 = time.perf_counter()
out = attn()
out.backward(torch.ones_like(out))
torch.cuda.synchronize()
t1 = time.perf_counter()
if profile:
    prof.disable()
    import pstats
    with open(f"{profile}-{which}-{os.getpid()}.txt", "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
shipped = -1
if which == "fusedattn":
    from fusedattn.backends import prebuilt
    shipped = prebuilt.stats["loads"]
    print("MISSES", sorted(set(prebuilt.stats["misses"])))
print(f"RESULT {t1 - t0:.3f} {t0 - t_import:.3f} {shipped}")
"""

SUBJECTS = (("fusedattn", "fusedattn"), ("torch cuDNN", "cudnn"), ("FlexAttention", "flex"))


def _run(which: str, cache: str) -> str:
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, which], env=env, capture_output=True, text=True,
                           timeout=300)
    except subprocess.TimeoutExpired:
        return "timeout"
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            fields = line.split()
            shipped = int(fields[3]) if len(fields) > 3 else -1
            misses = next((m[len("MISSES "):] for m in r.stdout.splitlines() if m.startswith("MISSES ")), "[]")
            return f"{float(fields[1]):.2f} s" + (f" ({shipped} kernels shipped, compiled: {misses})"
                                                  if shipped >= 0 else "")
    errors = [line for line in r.stderr.splitlines() if "Error" in line or "error" in line] or ["?"]
    return "failed: " + errors[-1].strip()[:100]


def cold_start_table(only: str = "") -> str:
    """The markdown table: first call (forward + backward) in a fresh process, empty and warm cache;
    ``only``: comma-separated substrings of the subjects' names (fusedattn, cudnn, flex)."""
    rows = ["| first fwd+bwd call, fresh process (b4 h16 s2048 d128 bf16 causal) | empty cache | warm cache |",
            "|---|---|---|"]
    keys = [k.strip().lower() for k in only.split(",") if k.strip()]
    for label, which in SUBJECTS:
        if keys and not any(k in which or k in label.lower() for k in keys):
            continue
        with tempfile.TemporaryDirectory(prefix="fusedattn-cold-") as cache:
            cold = _run(which, cache)
            warm = _run(which, cache)
        rows.append(f"| {label} | {cold} | {warm} |")
    return "\n".join(rows)
