"""Lab probe: the portable Triton kernels at head dims that pad their tiles to different widths, on the GPU.

Why (session 27, H100, Triton 3.6.0, bench/NOTES.md 66): the 300-seed GPU fuzz of tests/test_feature_combinations.py
found d = 24 or 40 with d_v = 8 wrong whenever a score feature was on: NaN with a float bias, errors of 0.3-1.4
with dropout, an illegal address beside per-batch query lengths; d 24 / 24, 24 / 16, 32 / 8 and 64 / 8 were right,
and Triton 3.9.0 was right at 24 / 8. ``backends/triton/args.head_blocks`` now gives both dims the wider tile
before 3.9 when neither fills its own; this probe is its check: forward and gradients of every (d, d_v) pair
below under each feature, fp16 and bf16, against float64, one line per (feature, d) with '.' for a pass and the
relative errors (out / dq / dk / dv) for a failure.

    PYTHONPATH=$PWD python3 bench/odd_dims_probe.py [--narrow]   # --narrow: the tiles as before head_blocks

``--narrow`` patches head_blocks back to block_dim of each dim (the pre-fix kernels), to see the fault again
on a Triton that has it. An illegal address ends the process (the CUDA context is lost): the last line printed
names the case before it; run with CUDA_LAUNCH_BLOCKING=1 to pin it.

Measured (H100, Triton 3.6.0, session 27, the fixed tiles, fp16 only, bias float [b, 1, 1, s_kv] or bool
[b, h, s_q, s_kv]): every (d, d_v) in {8, 24, 40, 72, 136} x {8, 16, 24, 40, 72} passed forward and backward.
Dropout and query lengths were not run on the GPU after the change (the device time was spent).
"""
import argparse

import torch
import triton

import fusedattn
from fusedattn.backends.triton import args as triton_args
from fusedattn.reference import attention_reference

DIMS = (8, 24, 40, 72, 136)
DV = (8, 16, 24, 40, 72)
FEATURES = ("none", "float_bias", "bool_bias", "dropout", "seq_len_q")


def case(d, dv, feature, dtype):
    """Max relative error of (out, dq, dk, dv) against float64, or None when all are under 1%."""
    b, h, sq, skv = 2, 2, 40, 45
    g = torch.Generator().manual_seed(d * 1000 + dv)
    q, k, v, do = (torch.randn(*s, generator=g).to("cuda", dtype)
                   for s in ((b, h, sq, d), (b, h, skv, d), (b, h, skv, dv), (b, h, sq, dv)))
    kw = {}
    if feature == "float_bias":
        kw["attn_bias"] = torch.randn(b, 1, 1, skv, generator=g).to("cuda", dtype)
    elif feature == "bool_bias":
        kw["attn_bias"] = (torch.rand(b, h, sq, skv, generator=g) > 0.2).to("cuda")
    elif feature == "dropout":
        kw.update(dropout_p=0.2, dropout_seed=d, dropout_offset=dv)
    elif feature == "seq_len_q":
        kw["seq_len_q"] = torch.tensor([sq - 5, 3], dtype=torch.int32, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fusedattn.attention(*leaves, backend="triton", **kw)
    got = [out, *torch.autograd.grad(out, leaves, do)]
    torch.cuda.synchronize()
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref_kw = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    if "attn_bias" in ref_kw and ref_kw["attn_bias"].is_floating_point():
        ref_kw["attn_bias"] = ref_kw["attn_bias"].double()
    ref_out = attention_reference(*ref_leaves, dtype=torch.float64, **ref_kw)[0]
    gold = [ref_out, *torch.autograd.grad(ref_out, ref_leaves, do.cpu().double())]
    errs = [((x.detach().cpu().double() - r).nan_to_num(1e9).abs().max() / r.abs().max().clamp_min(1e-6)).item()
            for x, r in zip(got, gold)]
    return None if max(errs) < 0.01 else errs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--narrow", action="store_true", help="the tiles as before head_blocks (each dim its own)")
    a = ap.parse_args()
    if a.narrow:
        triton_args.head_blocks = lambda p: (triton_args.block_dim(p.d), triton_args.block_dim(p.d_v))
        triton_args._static_scalars.cache_clear()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "narrow tiles" if a.narrow else "", flush=True)
    bad = 0
    for dtype in (torch.float16, torch.bfloat16):
        for feature in FEATURES:
            for d in DIMS:
                cells = []
                for dv in DV:
                    errs = case(d, dv, feature, dtype)
                    bad += errs is not None
                    cells.append(f"{dv}:" + ("." if errs is None else "/".join(f"{e:.2g}" for e in errs)))
                print(f"{str(dtype)[6:]:8s} {feature:10s} d{d:<4d}", " ".join(cells), flush=True)
    print(f"{bad} failing cases", flush=True)


if __name__ == "__main__":
    main()
