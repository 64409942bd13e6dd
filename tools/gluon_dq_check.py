"""Compile the Gluon sm_90 dQ kernel (fusedattn/backends/gluon/bwd_dq_sm90.py) with no GPU and
show what matters in its SASS.

    python tools/gluon_dq_check.py [D] [CAUSAL] [dtype] [BLOCK_N] [STAGES] [split] [window] [alibi] [seq_q] [seq_kv]
        [dropout] [sink] [grid_order]
        e.g. ... 128 1 bf16 64 0 split   (BLOCK_N / STAGES 0: the defaults)

grid_order compiles a causal kernel without ``HEAVY_FIRST`` (the grid's own program order).

Prints shared memory, registers/spills (ptxas -v on the PTX), and for each loop of the SASS its
instruction count, its MUFU.EX2 count and how many of them sit between the wait that leaves one
wgmma in flight (S and dP done) and the wait for the dQ wgmma, then the order of the
wgmma-related instructions (HGMMA issue, WARPGROUP.DEPBAR waits, barriers).
Same approach as tools/gluon_check.py (the forward's).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gluon_check import TARGET, loops, ptxas_report, sass, KEY  # noqa: E402

import re  # noqa: E402

import triton  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from fusedattn.backends.gluon import bwd_dq_sm90, fwd_sm90  # noqa: E402


def compile_dq(d=128, causal=True, dtype="bf16", bottom_right=False, block_n=None, stages=None, split=False,
               write_delta=True, window=False, alibi=False, seq_q=False, seq_kv=False, dropout=False, sink=False,
               heavy_first=None, fp8_grad=None, o_type=None, ds_e5m2=False):
    """The dQ pass for sm_90 as the JIT specializes it. fp8_grad: the FP8 switch (``FP8_EMU``, [Note] FP8) with dQ
    of this Triton type name ("fp8e4nv", "bf16", ...): the 16-bit operands are then fp16; o_type: O's type name
    (default the operands')."""
    import torch
    if fp8_grad is not None:
        dtype = "fp16"
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    td = fwd_sm90.TILE_D[d]
    block_n = block_n or bwd_dq_sm90.TILES[td][0]
    stages = stages or bwd_dq_sm90.TILES[td][1]
    ql = fwd_sm90._smem_layout(bwd_dq_sm90.WG_M, td, tdt)
    kl = fwd_sm90._smem_layout(block_n, td, tdt)
    qd = f"tensordesc<{dtype}[1, 1, {bwd_dq_sm90.WG_M}, {td}],{ql!r}>"
    kd = f"tensordesc<{dtype}[1, 1, {block_n}, {td}],{kl!r}>"
    sig = {"q_desc": qd, "do_desc": qd, "k_desc": kd, "v_desc": kd, "dq_desc": qd,
           "LSE": "*fp32", "stride_lb": "i32", "stride_lh": "i32", "stride_lm": "i32", "DELTA": "*fp32",
           "O": f"*{o_type or dtype}", "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32",
           "SINK": "*fp32", "DSINK": "*fp32", "SLOPES": "*fp32", "stride_sb": "i32",
           "SEQ_Q": "*i32", "SEQ_KV": "*i32",
           "H_Q": "i32", "GROUP": "i32", "S_Q": "i32", "S_KV": "i32", "qk_scale": "fp32", "sm_scale": "fp32",
           "win_left": "i32", "win_right": "i32", "DROP_SEED": "i32", "DROP_OFFSET": "i32",
           "DROP_THRESHOLD": "i32", "DROP_RESCALE": "fp32", "CHUNK": "i32"}
    heavy = bwd_dq_sm90.HEAVY_FIRST[causal and not window] if heavy_first is None else heavy_first
    const = dict(BLOCK_N=block_n, STAGES=stages, HAS_LEFT=window, HAS_RIGHT=causal or window,
                 BOTTOM_RIGHT=bottom_right, HAS_ALIBI=alibi, REVERSE_M=causal and not window,
                 CONSUMER_REGS=bwd_dq_sm90.CONSUMER_REGS, PRODUCER_REGS=bwd_dq_sm90.PRODUCER_REGS,
                 SPLIT=split, WRITE_DELTA=write_delta, D=d, HAS_SEQ_Q=seq_q,
                 HAS_SEQ_KV=seq_kv, DROPOUT=dropout, HAS_SINK=sink, HEAVY_FIRST=heavy)
    if fp8_grad is not None:
        sig.update({"SCALES": "*fp32", "AMAX": "*fp32", "DQ_OUT": "*" + fp8_grad, "stride_dqb": "i32",
                    "stride_dqh": "i32", "stride_dqm": "i32"})
        const.update(FP8_EMU=True, DS_E5M2=ds_e5m2)
    else:       # launches without the FP8 switch leave its parameters at their defaults
        const.update(SCALES=None, AMAX=None, DQ_OUT=None, stride_dqb=0, stride_dqh=0, stride_dqm=0, FP8_EMU=False,
                     DS_E5M2=False)
    if not heavy:
        const["CHUNK"] = 1      # the launcher passes 1, which the JIT specializes into a constant
    for k in const:
        sig[k] = "constexpr"
    src = GluonASTSource(fn=bwd_dq_sm90._attn_bwd_dq_sm90, signature=sig, constexprs=const)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4))


def main():
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    causal = bool(int(sys.argv[2])) if len(sys.argv) > 2 else True
    dtype = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    block_n = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "0" else None
    stages = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "0" else None
    # any of: split, window (a two-sided band), alibi, seq_q, seq_kv (padding), dropout, sink
    flags = set(sys.argv[6:])
    k = compile_dq(d, causal, dtype, block_n=block_n, stages=stages, split="split" in flags,
                   window="window" in flags, alibi="alibi" in flags, seq_q="seq_q" in flags,
                   seq_kv="seq_kv" in flags, dropout="dropout" in flags, sink="sink" in flags,
                   heavy_first=False if "grid_order" in flags else None)
    print(f"shared {k.metadata.shared} bytes")
    print(ptxas_report(k).strip())
    text = sass(k)
    path = f"/tmp/gluon_dq_d{d}_c{int(causal)}.sass"
    with open(path, "w") as f:
        f.write(text)
    print(f"SASS: {path}")
    for label, n, body in loops(text):
        # real key loops only (the others are the spin loops of barrier waits, which span code)
        if n < 60 or n > 1000 or not any("HGMMA" in b for b in body):
            continue
        ex2 = sum("MUFU.EX2" in b for b in body)
        # MUFU.EX2 after each wgmma wait (the last wait, 0x0, is the dQ product's)
        after, cur = {}, None
        for b in body:
            m = re.search(r"WARPGROUP.DEPBAR.LE gsb0, (0x\d)", b)
            if m:
                cur = m.group(1)
            elif "MUFU.EX2" in b:
                after[cur] = after.get(cur, 0) + 1
        print(f"loop {label}: {n} instructions, {ex2} MUFU.EX2; after each wait: {after} "
              f"(want none after 0x0)")
        for b in body:
            if KEY.search(b) and "MUFU" not in b:
                print("   ", re.sub(r"\s+", " ", b.split("*/", 1)[1].split(";")[0].strip()))


if __name__ == "__main__":
    main()
