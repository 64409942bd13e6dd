"""Compile the Gluon sm_90 dK/dV backward kernel with no GPU, and show what matters in its SASS.

    python tools/gluon_bwd_check.py [D] [CAUSAL] [dtype] [STAGES|-] [dv_first] [window] [alibi] [seq_q] [seq_kv]
                                    [grid_order]
        e.g. ... 128 1 bf16, ... 256 0 fp16, ... 128 1 bf16 - window alibi (window: a two-sided band)

grid_order compiles a causal kernel without ``HEAVY_FIRST`` (the grid's own program order).

D: 64, 128, 224 or 256 (224 compiles the 256-wide kernel, ``bwd_dkdv_sm90.SPLIT``).

Prints shared memory, registers/spills (ptxas -v on the PTX, with its warnings, e.g. C7514
wgmma serialization), and for each loop of the SASS its instruction count, its MUFU.EX2 count
and where they sit relative to the wgmma waits, and the order of the wgmma-related
instructions (HGMMA issue, WARPGROUP.DEPBAR waits, barriers, shared-memory traffic such as the
SPLIT variant's P^T exchange: STSM / LDSM), so one can check which products are in flight under
the exponentials and the dS arithmetic.
"""
import os
import re
import sys

import triton
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gluon_check import KEY, TARGET, loops, ptxas_report, sass  # noqa: E402
from fusedattn.backends.gluon import bwd_dkdv_sm90 as m  # noqa: E402
from fusedattn.backends.gluon import fwd_sm90  # noqa: E402


def compile_dkdv(d=128, causal=True, dtype="bf16", bottom_right=False, stages=None, dv_first=None, window=False,
                 alibi=False, seq_q=False, seq_kv=False, dropout=False, fp8_grad=None, **over):
    """The dK/dV pass for sm_90 as the JIT specializes it. fp8_grad: the FP8 switch (``FP8_EMU``, tile width 256,
    ``bwd_fused_sm90`` [Note] FP8) with gradients of this Triton type name ("fp8e4nv", "bf16", "fp32", ...): the
    16-bit operands are then fp16, and P_E5M2 / DS_E5M2 may come in ``over``."""
    import torch
    if fp8_grad is not None:
        dtype = "fp16"
    true_d = d
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    d = m.TILE_D[d]             # d=224 compiles the 256-wide kernel (fwd_sm90.TILE_D), the same as 256
    stages = stages or m.STAGES[d, causal or window]
    ql = fwd_sm90._smem_layout(m.BLOCK_M, d, tdt)
    kl = fwd_sm90._smem_layout(m.WG_N, d, tdt)
    sig = {"q_desc": f"tensordesc<{dtype}[1, 1, {m.BLOCK_M}, {d}],{ql!r}>",
           "k_desc": f"tensordesc<{dtype}[1, 1, {m.WG_N}, {d}],{kl!r}>",
           "v_desc": f"tensordesc<{dtype}[1, 1, {m.WG_N}, {d}],{kl!r}>",
           "do_desc": f"tensordesc<{dtype}[1, 1, {m.BLOCK_M}, {d}],{ql!r}>",
           "dk_desc": f"tensordesc<{dtype}[1, 1, {m.WG_N}, {d}],{kl!r}>",
           "dv_desc": f"tensordesc<{dtype}[1, 1, {m.WG_N}, {d}],{kl!r}>",
           "LSE": "*fp32", "stride_lb": "i32", "stride_lh": "i32", "stride_lm": "i32", "DELTA": "*fp32",
           "SLOPES": "*fp32", "stride_sb": "i32", "SEQ_Q": "*i32", "SEQ_KV": "*i32", "H_KV": "i32", "H_Q": "i32", "GROUP": "i32", "S_Q": "i32", "S_KV": "i32",
           "qk_scale": "fp32", "sm_scale": "fp32", "win_left": "i32", "win_right": "i32", "DROP_SEED": "i32",
           "DROP_OFFSET": "i32", "DROP_THRESHOLD": "i32", "DROP_RESCALE": "fp32", "CHUNK": "i32"}
    const = dict(STAGES=stages, HAS_LEFT=window, HAS_RIGHT=causal or window, BOTTOM_RIGHT=bottom_right,
                 HAS_ALIBI=alibi, SPLIT=m.SPLIT[d] or dropout,
                 DV_FIRST=m.DV_FIRST if dv_first is None else dv_first,
                 CONSUMER_REGS=m.CONSUMER_REGS,
                 PRODUCER_REGS=m.PRODUCER_REGS, HAS_SEQ_Q=seq_q, HAS_SEQ_KV=seq_kv, DROPOUT=dropout,
                 HEAVY_FIRST=m.HEAVY_FIRST[causal and not window])
    if fp8_grad is not None:
        sig.update({"SCALES": "*fp32", "AMAX": "*fp32", "DK_OUT": "*" + fp8_grad, "stride_dkb": "i32",
                    "stride_dkh": "i32", "stride_dkm": "i32", "DV_OUT": "*" + fp8_grad, "stride_dvb": "i32",
                    "stride_dvh": "i32", "stride_dvm": "i32"})
        const.update(FP8_EMU=True, P_E5M2=False, DS_E5M2=False, D=true_d if true_d < d else 0)
    else:       # launches without the FP8 switch leave its parameters at their defaults
        const.update(SCALES=None, AMAX=None, DK_OUT=None, stride_dkb=0, stride_dkh=0, stride_dkm=0, DV_OUT=None,
                     stride_dvb=0, stride_dvh=0, stride_dvm=0, FP8_EMU=False, P_E5M2=False, DS_E5M2=False, D=0)
    const.update(over)
    if not const["HEAVY_FIRST"]:
        const["CHUNK"] = 1      # the launcher passes 1, which the JIT specializes into a constant
    for k in const:
        sig[k] = "constexpr"
    src = GluonASTSource(fn=m._attn_bwd_dkdv_sm90, signature=sig, constexprs=const)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4))


def main():
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    causal = bool(int(sys.argv[2])) if len(sys.argv) > 2 else True
    dtype = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    stages = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    flags = set(sys.argv[5:])
    k = compile_dkdv(d, causal, dtype, stages=stages, dv_first="dv_first" in flags, window="window" in flags,
                     alibi="alibi" in flags, seq_q="seq_q" in flags, seq_kv="seq_kv" in flags,
                     dropout="dropout" in flags, **({"HEAVY_FIRST": False} if "grid_order" in flags else {}))
    print(f"shared {k.metadata.shared} bytes")
    print(ptxas_report(k).strip())
    text = sass(k)
    path = f"/tmp/gluon_dkdv_d{d}_c{int(causal)}.sass"
    with open(path, "w") as f:
        f.write(text)
    print("SASS in", path)
    for label, n, body in inner_loops(text):
        ex2 = sum("MUFU.EX2" in b for b in body)
        spill = sum(("LDL" in b or "STL" in b) for b in body)
        print(f"loop {label}: {n} instructions, {ex2} MUFU.EX2, {spill} local-memory (spill) accesses")
        seq = []
        for b in body:
            if KEY.search(b) or any(op in b for op in SHOW):
                s = re.sub(r"\s+", " ", b.split("*/", 1)[1].split(";")[0].strip())
                op = s.split()[1] if s.startswith("@") else s.split()[0]
                if op.startswith(RUNS) and seq and seq[-1][0] == op:
                    seq[-1][1] += 1      # a run of the same operation: one line with its count
                else:
                    seq.append([op, 1, s])
        for op, count, s in seq:
            print("   ", s if count == 1 else f"[{count} x {op}]")


# instructions shown besides gluon_check.KEY's; runs of RUNS operations are folded into one line
SHOW = ("HMUL", "STS", "LDS", "LDG", "STSM", "LDSM", "F2FP")
RUNS = ("HGMMA", "MUFU", "F2FP", "STS", "LDS", "LDG", "HMUL")


def inner_loops(text, min_instructions=60):
    """gluon_check.loops, less the false ones (a back edge from the mbarrier try-wait retry stubs after
    the last EXIT, whose body spans partitions) and the outer loops (GQA heads) that hold one."""
    found = [(label, n, body) for label, n, body in loops(text)
             if n >= min_instructions and not any("EXIT" in b or "USETMAXREG" in b for b in body)]
    starts = {body[0] for _, _, body in found}
    return [(label, n, body) for label, n, body in found if not any(b in starts for b in body[1:])]


if __name__ == "__main__":
    main()
