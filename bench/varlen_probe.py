"""Lab probe (issue 25): FlashAttention's varlen forward (packed queries and keys, ``attention_varlen`` /
``fusedattn.flash_attn.flash_attn_varlen_func``) on the Gluon forward's packed mode against the portable
Triton kernel's VARLEN switch, in one process on the same inputs.

    PYTHONPATH=$PWD python bench/varlen_probe.py

Per config: do_bench ms of the forward through ``attention_varlen`` with the Gluon route (the default on
Hopper) and with it switched off (``varlen._gluon_packed_forward`` -> False: the Triton kernel), TFLOP/s of
the useful work (per sequence 4 * h * s_q * s_kv * d, halved when causal), and the same lengths as a
padded batch through ``attention(seq_len_q=, seq_len_kv=)`` (the Gluon padded kernel) for scale.

Measured: see bench/NOTES.md (entry of the session that ran it).
"""
import torch
import triton

import fusedattn
from fusedattn import varlen
from overhead import host_ms    # bench/overhead.py: enqueue time of one call, no sync

CONFIGS = [  # (name, lengths, h_q, h_kv, d, causal)
    ("lens 2048/1536/1024/512 h32 d128 causal", (2048, 1536, 1024, 512), 32, 32, 128, True),
    ("16 x 1k..4k h32/8 d128 causal", tuple(1024 + 192 * i for i in range(16)), 32, 8, 128, True),
    ("lens 2048/1536/1024/512 h16 d256", (2048, 1536, 1024, 512), 16, 16, 256, False),
]


def main() -> None:
    real = varlen._gluon_packed_forward
    for name, lens, h_q, h_kv, d, causal in CONFIGS:
        g = torch.Generator(device="cuda").manual_seed(0)
        total = sum(lens)
        q = torch.randn(total, h_q, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(total, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(total, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        n = max(lens)
        flops = sum(4 * h_q * s * s * d for s in lens) / (2 if causal else 1)
        call = lambda: fusedattn.attention_varlen(q, k, v, cu, cu, n, n, causal=causal, validate=False)  # noqa
        routes = []
        varlen._gluon_packed_forward = lambda *a: (lambda took: (routes.append(took), took)[1])(real(*a))
        ref = call()
        gluon_ms = triton.testing.do_bench(call, warmup=10, rep=100)
        gluon_host = host_ms(call, n=50)
        took = routes[0]
        varlen._gluon_packed_forward = lambda *a: False
        other = call()
        triton_ms = triton.testing.do_bench(call, warmup=10, rep=100)
        triton_host = host_ms(call, n=50)
        varlen._gluon_packed_forward = real
        diff = (ref.float() - other.float()).abs().max().item()
        # the same lengths as a padded batch (BSHD memory) with per-sequence lengths
        b = len(lens)
        pad = lambda t: torch.zeros(b, n, t.shape[1], d, device="cuda", dtype=t.dtype)  # noqa: E731
        qp, kp, vp = pad(q), pad(k), pad(v)
        for i, s in enumerate(lens):
            qp[i, :s], kp[i, :s], vp[i, :s] = q[cu[i]:cu[i] + s], k[cu[i]:cu[i] + s], v[cu[i]:cu[i] + s]
        lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        padded = lambda: fusedattn.attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),  # noqa
                                             causal=causal, seq_len_q=lens_t, seq_len_kv=lens_t)
        padded_ms = triton.testing.do_bench(padded, warmup=10, rep=100)
        padded_host = host_ms(padded, n=50)
        print(f"{name}: Gluon packed route taken: {took}; max |Gluon - Triton| {diff:.2e}")
        for label, ms, host in (("Gluon packed", gluon_ms, gluon_host), ("Triton VARLEN", triton_ms, triton_host),
                                ("padded batch", padded_ms, padded_host)):
            print(f"    {label:14s} {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  host {host:.3f} ms per call")


if __name__ == "__main__":
    main()
