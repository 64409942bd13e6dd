"""The single-pass backward's fragment-order dQ accumulator ([Note] dQ in fragment order in
``fusedattn/backends/gluon/bwd_fused_sm90.py``) converted back to dQ by ``launch_convert(frag=True)``: the
conversion kernel runs under Triton's interpreter on the CPU (CI, both Tritons) and for real on a GPU.
"""
import pytest
import torch


@pytest.mark.parametrize("s_q", [64, 200])
def test_gluon_fused_frag_conversion(s_q):
    """The fragment-order dQ accumulator ([Note] dQ in fragment order) converts back to dQ: dq_acc filled as the
    kernel's ``_frag_tile`` (reshape to twelve size-2 dimensions, the same permute, reshape to [16, 256]) lays
    out each 64-row tile's two [64, 64] halves, ``launch_convert(frag=True)`` gives scale * dQ (runs under
    Triton's interpreter on the CPU, the kernel itself on a GPU)."""
    from fusedattn.backends.gluon import bwd_fused_sm90 as fused
    from fusedattn.problem import make_problem
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(s_q)
    b, h, d = 2, 3, 128
    q = torch.randn(b, h, s_q, d, device=device, dtype=torch.bfloat16)      # only its shape and scale matter
    p, _ = make_problem(q, q, q)
    rows = fused.acc_rows(s_q)
    full = torch.randn(b, h, rows, d, device=device)          # the accumulator's values, row-major
    tiles = full.view(b, h, rows // 64, 64, 2, 64).permute(0, 1, 2, 4, 3, 5)      # [.., tile, half, r, c]
    frag = tiles.reshape(b, h, rows // 64, 2, *([2] * 12)).permute(
        0, 1, 2, 3, *(4 + i for i in (6, 7, 8, 0, 1, 3, 4, 5, 9, 10, 2, 11))).contiguous()
    # fp32 dQ: the conversion's one multiply, exact to compare (the interpreter's bf16 rounding is not the GPU's)
    dq = torch.full((b, h, s_q, d), float("nan"), device=device, dtype=torch.float32)
    fused.launch_convert(p, frag.view(-1), dq, frag=True)
    want = full[:, :, :s_q] * torch.tensor(p.scale, dtype=torch.float32, device=device)
    assert torch.equal(dq, want), f"frag conversion differs. repro: s_q={s_q}"
