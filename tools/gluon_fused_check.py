"""Compile the Gluon sm_90 fused (single-pass) backward kernel with no GPU, and show what matters in its SASS.

    python tools/gluon_fused_check.py [CAUSAL] [dtype] [STAGES|-] [bottom_right] [lag|nolag] [reverse|forward]
                                      [flat|swizzled|frag] [p16|p32] [dqfirst|dqlast]
                                      [defer|nodefer] [atomic|tma] [rotate] [d64] [m128] [dropout] [kvsmem]
        e.g. ... 1 bf16, ... 0 fp16 3, ... 1 bf16 - nolag,
             ... 0 fp16 - d64 (head dim 64; default 128), ... 0 fp16 - d64 m128 (128-row query tiles)
    python tools/gluon_fused_check.py survey    # spills of the builds the anchors launch (below)

Prints shared memory, registers/spills (ptxas -v on the PTX, with its warnings, e.g. C7514 wgmma
serialization), and for each inner loop of the SASS its instruction count, MUFU.EX2 count, local-memory
(spill) accesses and the order of the wgmma-related instructions (HGMMA issue, WARPGROUP.DEPBAR waits,
barriers, shared-memory traffic: the dS^T exchange STSM, the dQ staging STS, the TMA reduce UBLKRED /
UTMAREDG), as ``tools/gluon_bwd_check.py`` does for the dK/dV pass.
"""
import os
import re
import sys
import types

import triton
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gluon_bwd_check import RUNS, SHOW, inner_loops  # noqa: E402
from gluon_check import KEY, TARGET, ptxas_report, sass  # noqa: E402
from fusedattn.backends.gluon import bwd_fused_sm90 as m  # noqa: E402
from fusedattn.backends.gluon import fwd_sm90  # noqa: E402


def compile_fused(causal=True, dtype="bf16", bottom_right=False, stages=None, reverse=None, flat=None, p16_ds=None,
                  lag=None, dq_first=None, defer_dk=None, dq_atomic=None, d=128, block_m=None, fp8_grad=None,
                  fp8_mma=False, dropout=False, **over):
    """The fused backward for sm_90 as the JIT specializes it. fp8_grad: the FP8 switch (``FP8_EMU``, module
    [Note] FP8) with gradients of this Triton type name ("fp8e4nv", "bf16", "fp32", ...): the 16-bit operands are
    then fp16, and P_E5M2 / DS_E5M2 may come in ``over``. fp8_mma (with fp8_grad): its FP8 MMAs ([Note] FP8
    MMAs): e4m3 q, k, v, dO and their transposed copies' descriptors. dropout: the DROPOUT switch (module
    [Note] dropout), its seed and offset as the JIT types small integers (i32)."""
    import torch
    if fp8_grad is not None:
        dtype = "fp8e4nv" if fp8_mma else "fp16"
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn}[dtype]
    block_m = block_m or m.BLOCK_M
    stages = stages or m.STAGES[causal]
    ql = fwd_sm90._smem_layout(block_m, d, tdt)
    kl = fwd_sm90._smem_layout(m.WG_N, d, tdt)
    # the staging and dQ-first order a launch of this problem gets (``_dq_flat``, ``_dq_first``)
    flat = m._dq_flat(types.SimpleNamespace(band=object() if causal else None, d=d), flat, lag, dq_atomic,
                      fp8_grad is not None)
    dq_first = m._dq_first(flat, causal, dq_first)
    box, dl = m._dq_box(flat, d)
    sig = {"q_desc": f"tensordesc<{dtype}[1, 1, {block_m}, {d}],{ql!r}>",
           "k_desc": f"tensordesc<{dtype}[1, 1, {m.WG_N}, {d}],{kl!r}>",
           "v_desc": f"tensordesc<{dtype}[1, 1, {m.WG_N}, {d}],{kl!r}>",
           "do_desc": f"tensordesc<{dtype}[1, 1, {block_m}, {d}],{ql!r}>",
           "dk_desc": f"tensordesc<{dtype}[1, 1, {m.WG_N}, {d}],{kl!r}>",
           "dv_desc": f"tensordesc<{dtype}[1, 1, {m.WG_N}, {d}],{kl!r}>",
           "dq_desc": f"tensordesc<fp32[1, 1, {16 if flat == 'frag' else block_m}, {box}],{dl!r}>", "DQ_ACC": "*fp32",
           "LSE": "*fp32", "stride_lb": "i32", "stride_lh": "i32", "stride_lm": "i32",
           "DELTA": "*fp32", "H_KV": "i32", "H_Q": "i32", "GROUP": "i32", "S_Q": "i32", "S_KV": "i32",
           "qk_scale": "fp32", "sm_scale": "fp32", "CHUNK": "i32"}
    const = dict(STAGES=stages, HAS_RIGHT=causal, BOTTOM_RIGHT=bottom_right, LAG=m.LAG[causal] if lag is None else lag,
                 REVERSE=m.REVERSE[causal] if reverse is None else reverse,
                 P16_DS=m.P16_DS if p16_ds is None else p16_ds,
                 DQ_FIRST=dq_first,
                 DEFER_DK=m.DEFER_DK[causal] if defer_dk is None else defer_dk,
                 DQ_ATOMIC=m.DQ_ATOMIC[causal] if dq_atomic is None else dq_atomic, ROTATE=m.ROTATE[causal],
                 CONSUMER_REGS=m.CONSUMER_REGS, PRODUCER_REGS=m.PRODUCER_REGS, SEGMENTS=False, KV_REGS=True)
    if fp8_grad is not None:
        sig.update({"SCALES": "*fp32", "AMAX": "*fp32", "DK_OUT": "*" + fp8_grad, "stride_dkb": "i32",
                    "stride_dkh": "i32", "stride_dkm": "i32", "DV_OUT": "*" + fp8_grad, "stride_dvb": "i32",
                    "stride_dvh": "i32", "stride_dvm": "i32"})
        const.update(FP8_EMU=True, P_E5M2=False, DS_E5M2=False)
        if fp8_mma:
            for name, cols in (("QT_DESC", block_m), ("DOT_DESC", block_m), ("KT_DESC", m.WG_N)):
                sig[name] = f"tensordesc<fp8e4nv[1, 1, {d}, {cols}],{fwd_sm90._smem_layout(d, cols, tdt)!r}>"
            const.update(FP8_EMU=2)
        else:
            const.update(QT_DESC=None, DOT_DESC=None, KT_DESC=None)
    else:       # launches without the FP8 switch leave its parameters at their defaults
        const.update(SCALES=None, AMAX=None, DK_OUT=None, stride_dkb=0, stride_dkh=0, stride_dkm=0, DV_OUT=None,
                     stride_dvb=0, stride_dvh=0, stride_dvm=0, FP8_EMU=False, P_E5M2=False, DS_E5M2=False,
                     QT_DESC=None, DOT_DESC=None, KT_DESC=None)
    if dropout:
        sig.update(DROP_SEED="i32", DROP_OFFSET="i32", DROP_THRESHOLD="i32", DROP_RESCALE="fp32")
        const.update(DROPOUT=True)
    else:
        const.update(DROP_SEED=0, DROP_OFFSET=0, DROP_THRESHOLD=0, DROP_RESCALE=1.0, DROPOUT=False)
    const.update(over)
    for k in const:
        sig[k] = "constexpr"
    # the JIT's specialization of torch allocations: 16-byte aligned pointers
    names = list(sig)
    attrs = {(names.index(a), ): [["tt.divisibility", 16]] for a in ("DQ_ACC", "LSE", "DELTA")}
    src = GluonASTSource(fn=m._attn_bwd_fused_sm90, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4))


SHOW_F = SHOW + ("UBLKRED", "UTMAREDG", "RED", "ATOM")


def survey():
    """Spills of the builds the d=128 anchors launch, as the JIT specializes them: a group of one folds to a
    constant (MHA), a larger group is a runtime argument (GQA; with and without ``SEGMENTS``). Per build: spill
    bytes (ptxas), local-memory accesses in the SASS, and per inner loop (instructions, local accesses); the
    mask-free loops (the shortest large ones) are where the steps run. Session 25 found Triton 3.9's GQA build
    spilling 2-3x more per step than 3.6's this way (bench/NOTES.md 64)."""
    print(f"Triton {triton.__version__}")
    for causal in (True, False):
        for label, over in (("MHA", {"GROUP": 1}), ("GQA", {}), ("GQA segments", {"SEGMENTS": True})):
            k = compile_fused(causal, "bf16", **over)
            rep = ptxas_report(k)
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
            text = sass(k)
            loops = [(n, sum(("LDL" in b or "STL" in b) for b in body)) for _, n, body in inner_loops(text)]
            local = sum(("LDL" in b or "STL" in b) for b in text.splitlines())
            print(f"{'causal' if causal else 'no mask'} {label:13s} spill {m.group(1)}/{m.group(2)} B, {local} local "
                  f"accesses, loops {loops}", flush=True)


def main():
    if sys.argv[1:2] == ["survey"]:
        return survey()
    causal = bool(int(sys.argv[1])) if len(sys.argv) > 1 else True
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bf16"
    stages = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    flags = set(sys.argv[4:])
    k = compile_fused(causal, dtype, bottom_right="bottom_right" in flags, stages=stages,
                      lag=True if "lag" in flags else False if "nolag" in flags else None,
                      reverse=True if "reverse" in flags else False if "forward" in flags else None,
                      flat=True if "flat" in flags else "frag" if "frag" in flags else False if "swizzled" in flags else None,
                      p16_ds=True if "p16" in flags else False if "p32" in flags else None,
                      dq_first=True if "dqfirst" in flags else False if "dqlast" in flags else None,
                      defer_dk=True if "defer" in flags else False if "nodefer" in flags else None,
                      dq_atomic=True if "atomic" in flags else False if "tma" in flags else None,
                      d=64 if "d64" in flags else 128, block_m=128 if "m128" in flags else None,
                      dropout="dropout" in flags, **({"ROTATE": True} if "rotate" in flags else {}),
                      **({"KV_REGS": False} if "kvsmem" in flags else {}))
    print(f"shared {k.metadata.shared} bytes")
    print(ptxas_report(k).strip())
    text = sass(k)
    path = f"/tmp/gluon_fused_c{int(causal)}.sass"
    with open(path, "w") as f:
        f.write(text)
    with open(path.replace(".sass", ".ptx"), "w") as f:
        f.write(k.asm["ptx"])
    print("SASS in", path)
    for label, n, body in inner_loops(text):
        ex2 = sum("MUFU.EX2" in b for b in body)
        spill = sum(("LDL" in b or "STL" in b) for b in body)
        print(f"loop {label}: {n} instructions, {ex2} MUFU.EX2, {spill} local-memory (spill) accesses")
        seq = []
        for b in body:
            if KEY.search(b) or any(op in b for op in SHOW_F):
                s = re.sub(r"\s+", " ", b.split("*/", 1)[1].split(";")[0].strip())
                op = s.split()[1] if s.startswith("@") else s.split()[0]
                if op.startswith(RUNS + ("RED",)) and seq and seq[-1][0] == op:
                    seq[-1][1] += 1
                else:
                    seq.append([op, 1, s])
        for op, count, s in seq:
            print("   ", s if count == 1 else f"[{count} x {op}]")


if __name__ == "__main__":
    main()
