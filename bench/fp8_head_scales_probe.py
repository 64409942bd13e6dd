"""Per-head FP8 descales (issue 27: "per-head too if it costs nothing"): the forward with descale_q [h_q] and
descale_k / descale_v [h_kv] against per-tensor scales, TFLOP/s of both, same inputs, one process. Both run the
Gluon sm_90 kernel since session 38 (its FP8_HEAD_SCALES switch; the portable kernel's before).

    PYTHONPATH=$PWD python3 bench/fp8_head_scales_probe.py

Measured (H200, Triton 3.6.0, session 37; bench/NOTES.md 77), TFLOP/s per tensor / per head: b4 h32 2k causal
446 / 228, b2 h16 8k 823 / 443, b1 h32 16k causal 849 / 430 (the per-head calls ran the torch emulation before).
"""
import torch

from fusedattn import bench, fp8
from fusedattn.problem import make_band


def main() -> None:
    dev = torch.device("cuda")
    for cfg in bench.fp8_configs()[:3]:
        inp = bench.make_inputs(cfg, dev)
        sc = {n: inp.extra[n] for n in bench.FP8_SCALES}
        per_head = dict(sc, descale_q=sc["descale_q"].reshape(1).repeat(cfg.h_q) * torch.linspace(
            0.5, 2.0, cfg.h_q, device=dev), descale_k=sc["descale_k"].reshape(1).repeat(cfg.h_kv))
        band = make_band(cfg.causal, "top_left", None)
        row = []
        for name, scales in (("per tensor", sc), ("per head", per_head)):
            def fwd():
                return fp8.sdpa_fp8_forward(inp.q, inp.k, inp.v, **scales, attn_scale=cfg.d ** -0.5, band=band,
                                            o_dtype=bench.FP8_OUT)
            ms = bench.time_gpu_ms([fwd], quick=True, graphs=False)
            row.append(f"{name} {bench.fwd_flops(cfg) / ms / 1e9:.0f}")
        print(f"{cfg.name}: " + ", ".join(row) + " TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
