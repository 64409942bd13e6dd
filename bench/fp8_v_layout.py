"""Lab probe (issue 27): the portable FP8 forward's speed by V's memory layout and tile shape (H100).

Session 18 measured the FP8 forward (backends/triton/fwd.py, FP8 switch) at 100-120 TFLOP/s on the d=128
ANCHORS configs, a fifth of our bf16 forward. Its sm_90 TTGIR showed why: an FP8 wgmma reads both operands
K-major from shared memory, and for P8 @ V the K dim is the key, so with V's head dim innermost Triton
loads each V tile synchronously (`tt.load`, no prefetch) and transposes it through registers; with V's
keys innermost (stride along keys 1, which the JIT specializes) V's tiles become async copies pipelined
like K's (`--ttgir` prints the counts; no GPU needed). fusedattn.fp8 now stages V that way (one copy).

    python bench/fp8_v_layout.py            # GPU: TFLOP/s per V layout and tile shape, beside bf16
    python bench/fp8_v_layout.py --ttgir    # any machine: the sm_90 TTGIR's V loads per layout
    python bench/fp8_v_layout.py --mma16    # GPU: the FP8 MMAs against fp16 MMAs on the FP8 values (FP8_MMA16)

``--mma16`` (session 28): the portable forward's FP8_MMA16 switch (``common.fp8_dot``: both products as fp16 MMAs
on the exactly converted FP8 values) at the FP8 bench's d256 / d224 configs, which the Gluon FP8 forward does not
take (it ran 207 / 206 TFLOP/s there on an H100, Triton 3.6, against cuDNN's 906 / 885 and our bf16 708 / 595),
per tile and V layout; the fp16-MMA outputs must agree within about one FP8 step of the FP8 MMAs' (printed).
"""
import sys

import torch
import triton

import fusedattn
from fusedattn import fp8, plan
from fusedattn.backends.triton.fwd import launch_fwd_fp8
from fusedattn.problem import AttentionProblem, make_band

CONFIGS = [(4, 32, 2048, 128, True), (2, 16, 8192, 128, False), (4, 16, 4096, 256, True)]
# the first of each list is plan._FWD_FP8_SM90's (also timed with V's head dim innermost, the old launch)
TILES = {128: [plan.Tiles(64, 64, 8, 3), plan.Tiles(128, 64, 8, 3), plan.Tiles(128, 64, 8, 2)],
         256: [plan.Tiles(64, 64, 8, 2), plan.Tiles(128, 64, 8, 2)]}


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d * (0.5 if causal else 1.0)


def fp8_call(q8, k8, v8, causal, tiles, mma16=False, out=None):
    b, h, s, d = q8.shape
    band = make_band(causal, "top_left", None)
    p = AttentionProblem(b=b, h_q=h, h_kv=h, s_q=s, s_kv=s, d=d, d_v=d, dtype=q8.dtype, device_type="cuda",
                         scale=d ** -0.5, band=band, has_seq_len_q=False, has_seq_len_kv=False)
    one = torch.ones(1, device="cuda")
    scales = dict(descale_q=one, descale_k=one, descale_v=one, descale_s=one / 256, scale_s=one * 256, scale_o=one)
    o = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="cuda") if out is None else out
    lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
    extras = dict(seq_len_q=None, seq_len_kv=None, slopes=None, sink=None)

    def run():
        amax = torch.zeros(2, device="cuda")
        launch_fwd_fp8(p, tiles, q8, k8, v8, o, lse, extras, scales, amax[0:1], amax[1:2], mma16=mma16)
    return run


def timing() -> None:
    print(f"device {torch.cuda.get_device_name()}, triton {triton.__version__}")
    for b, h, s, d, causal in CONFIGS:
        x = [torch.randn(b, h, s, d, device="cuda") for _ in range(3)]
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in x)
        v8_keys_inner = v8.transpose(2, 3).contiguous().transpose(2, 3)
        name = f"b{b} h{h} s{s} d{d}{' causal' if causal else ''}"
        bf = [t.to(torch.bfloat16) for t in (q8, k8, v8)]
        ms = triton.testing.do_bench(lambda: fusedattn.attention(*bf, causal=causal), warmup=10, rep=50)
        print(f"{name}: ours bf16 {flops(b, h, s, d, causal) / ms / 1e9:.0f} TFLOP/s")
        for i, tiles in enumerate(TILES[d]):
            for layout, v in ((("d inner", v8),) if i == 0 else ()) + (("keys inner", v8_keys_inner),):
                try:
                    ms = triton.testing.do_bench(fp8_call(q8, k8, v, causal, tiles), warmup=10, rep=50)
                    rate = f"{flops(b, h, s, d, causal) / ms / 1e9:.0f} TFLOP/s"
                except Exception as exc:        # out of shared memory / registers for this tile
                    rate = f"failed ({type(exc).__name__}: {str(exc)[:80]})"
                print(f"    FP8 {tiles} V {layout:10s} {rate}")
        ms = triton.testing.do_bench(lambda: fp8.sdpa_fp8_forward(
            q8, k8, v8, band=make_band(causal, "top_left", None), o_dtype=torch.bfloat16,
            **{n: torch.tensor([v], device="cuda") for n, v in (("descale_q", 1.0), ("descale_k", 1.0),
               ("descale_v", 1.0), ("descale_s", 1 / 256), ("scale_s", 256.0), ("scale_o", 1.0))}),
            warmup=10, rep=50)
        print(f"    fusedattn.fp8.sdpa_fp8_forward (default tiles, V staged): "
              f"{flops(b, h, s, d, causal) / ms / 1e9:.0f} TFLOP/s")


MMA16_CONFIGS = [(4, 16, 4096, 256, True), (32, 32, 2048, 224, False)]
MMA16_TILES = [plan.Tiles(64, 64, 8, 2), plan.Tiles(128, 64, 8, 2), plan.Tiles(128, 64, 8, 3),
               plan.Tiles(64, 64, 4, 2), plan.Tiles(128, 32, 8, 3), plan.Tiles(64, 128, 8, 2)]


def mma16_timing() -> None:
    print(f"device {torch.cuda.get_device_name()}, triton {triton.__version__}")
    for b, h, s, d, causal in MMA16_CONFIGS:
        q8, k8, v8 = (torch.randn(b, h, s, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        v8_keys_inner = v8.transpose(2, 3).contiguous().transpose(2, 3)
        name = f"b{b} h{h} s{s} d{d}{' causal' if causal else ''}"
        fl = flops(b, h, s, d, causal)
        ref = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="cuda")
        fp8_call(q8, k8, v8_keys_inner, causal, plan._FWD_FP8_SM90[256], out=ref)()
        ms = triton.testing.do_bench(fp8_call(q8, k8, v8_keys_inner, causal, plan._FWD_FP8_SM90[256]), rep=100)
        print(f"{name}: FP8 MMAs {plan._FWD_FP8_SM90[256]} (V keys inner) {fl / ms / 1e9:.0f} TFLOP/s")
        for tiles in MMA16_TILES:
            for layout, v in (("d inner", v8), ("keys inner", v8_keys_inner)):
                out = torch.full_like(ref, float("nan"))
                try:
                    run = fp8_call(q8, k8, v, causal, tiles, mma16=True, out=out)
                    run()
                    diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    ms = triton.testing.do_bench(run, rep=100)
                    rate = f"{fl / ms / 1e9:.0f} TFLOP/s, max |o - o_fp8mma| / max |o| {diff:.2g}"
                except Exception as exc:        # out of shared memory / registers for this tile
                    rate = f"failed ({type(exc).__name__}: {str(exc)[:80]})"
                print(f"    fp16 MMAs {tiles} V {layout:10s} {rate}", flush=True)


def ttgir() -> None:
    sys.path.insert(0, "tools")
    import re
    import aot_check
    from triton.compiler import ASTSource
    from fusedattn.backends.triton import fwd
    for keys_inner in (False, True):
        ptrs, c = aot_check.fwd_fp8_spec(128, 64, 64)
        kern = fwd._attn_fwd
        for n in kern.arg_names:
            if n.startswith("stride_") and n.endswith("d") and not (keys_inner and n == "stride_vd"):
                c[n] = 1
        if keys_inner:
            c["stride_vn"] = 1
        sig = {n: "constexpr" if n in c else ptrs.get(n) or ("fp32" if n in aot_check.FLOATS else "i32")
               for n in kern.arg_names}
        # as the JIT specializes a launch: pointers and non-unit strides divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
                 if n not in c and (n in ptrs or n.startswith("stride_") or n in ("D", "D_V", "S_Q", "S_KV"))}
        k = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=c, attrs=attrs), target=aot_check.TARGET,
                           options=dict(num_warps=8, num_stages=3))
        t = k.asm["ttgir"]
        print(f"V {'keys' if keys_inner else 'd'} innermost: async copies {t.count('async_copy_global_to_local')}, "
              f"synchronous V loads {len(re.findall(r'tt.load %v', t))}")


if __name__ == "__main__":
    ttgir() if "--ttgir" in sys.argv else mma16_timing() if "--mma16" in sys.argv else timing()
