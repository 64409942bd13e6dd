"""A NaN (or an inf) in the inputs reaches exactly the outputs that softmax attention says it reaches.

``softmax`` of a score row holding a NaN is NaN, and PyTorch's math SDPA and FlashAttention return NaN
there; a NaN must not read as "this row saw no key", which writes output 0 and lse -inf (the convention
for empty rows, tests/test_empty_rows.py). Before, every path tested ``l > 0`` for "not empty", which a NaN
sum fails: the CPU path wrote 0 / -inf for such rows and the kernels -inf beside an output that the NaN had
already reached through their accumulator (0 * NaN), so the CPU path and the kernels disagreed. Now a row
is empty when its sum is exactly 0 (``l != 0`` is "not empty").

The cases put one NaN (or inf) into one element and check, against the float64 reference
(``fusedattn.reference``, whose softmax follows the same rule), which rows and columns are NaN and that
every other element is right (FlashAttention's 2x rule). Rows that never see the poisoned key (a causal
mask) stay clean. Each failure prints a repro line.
"""
import pytest
import torch

import fusedattn
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within

from conftest import target_id

CASES = ["q_nan", "k_nan", "q_inf", "k_nan_causal", "v_nan"]
# the interpreter's numpy warns on every NaN it computes with: expected here
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def make_case(case, device):
    """(q, k, v, kwargs, where): one poisoned element; GQA 4/2 so the k / v cases reach two query heads."""
    big = device == "cuda"
    b, h_q, h_kv, s_q, s_kv, d = (2, 4, 2, 300, 260, 128) if big else (2, 4, 2, 37, 29, 32)
    dt = torch.bfloat16 if big else torch.float32
    gen = torch.Generator().manual_seed(660 + CASES.index(case))
    q = torch.randn(b, s_q, h_q, d, generator=gen).to(device, dt).transpose(1, 2)
    k = torch.randn(b, s_kv, h_kv, d, generator=gen).to(device, dt).transpose(1, 2)
    v = torch.randn(b, s_kv, h_kv, d, generator=gen).to(device, dt).transpose(1, 2)
    row, key, col = s_q // 3, s_kv // 2, d // 5
    kw = {"causal": True} if case == "k_nan_causal" else {}
    if case == "q_nan":
        q[1, 2, row, col] = float("nan")
    elif case == "q_inf":
        q[1, 2, row, col] = float("inf")
    elif case in ("k_nan", "k_nan_causal"):
        k[0, 1, key, col] = float("nan")
    else:
        v[0, 1, key, col] = float("nan")
    return q, k, v, kw


@pytest.mark.parametrize("case", CASES)
def test_nan_reaches_exactly_what_softmax_says(case, target):
    """Forward into NaN-filled buffers: NaN exactly where the float64 reference has NaN (the poisoned
    row, the rows that see the poisoned key, or for V the poisoned column of the rows that see the key),
    lse NaN on rows whose scores hold the NaN and finite elsewhere, and every other element within 2x
    PyTorch's same-precision error of the reference."""
    device, backend = target
    rep = f"repro: pytest tests/test_nan_inputs.py -k '{case} and {target_id(target)}'"
    q, k, v, kw = make_case(case, device)
    gold_out, gold_lse = attention_reference(*(t.cpu() for t in (q, k, v)), dtype=torch.float64, **kw)
    # PyTorch's same-precision error on the inputs' device: the GPU machine's torch 2.11 CPU bf16 matmul
    # spread the one NaN to rows the float64 reference keeps clean (its blocked kernel), cuBLAS does not
    base_out = attention_reference(q, k, v, dtype=q.dtype, **kw)[0].cpu()
    nan_gold = torch.isnan(gold_out)
    assert torch.equal(torch.isnan(base_out), nan_gold), f"PyTorch's {q.dtype} reference poisons other rows. {rep}"
    assert nan_gold.any() and not nan_gold.all(), f"the case must poison some outputs, not all. {rep}"
    if case == "k_nan_causal":
        # rows before the poisoned key (top-left causal) do not see it: they stay clean
        key = k.shape[2] // 2
        assert not nan_gold[0, 2:4, :key].any() and nan_gold[0, 2:4, key:].all(), rep

    out = torch.full(q.shape[:3] + (v.shape[-1],), float("nan"), dtype=q.dtype, device=device)
    stats = torch.full(q.shape[:3] + (1,), float("nan"), device=device)
    fusedattn.attention_forward(q, k, v, backend=backend, out=out, stats_out=stats, **kw)
    got = out.cpu()
    nan_got = torch.isnan(got)
    assert torch.equal(nan_got, nan_gold), (
        f"NaN at {int(nan_got.sum())} outputs, the reference at {int(nan_gold.sum())}; first differing "
        f"(b, h, row, col): {(nan_got != nan_gold).nonzero()[:3].tolist()}. {rep}")
    assert_error_within(got[~nan_gold], gold_out[~nan_gold], base_out[~nan_gold], msg=f"clean outputs. {rep}")

    lse = stats.cpu()[..., 0]
    bad_rows = ~torch.isfinite(gold_lse[..., 0])       # the rows whose scores hold the NaN / inf
    if case == "v_nan":
        assert not bad_rows.any(), rep                  # V is not in the scores
    else:
        assert bad_rows.any(), rep
    # NaN (or +inf), never -inf: -inf says "this row saw no key", which these rows are not
    assert not torch.isfinite(lse[bad_rows]).any() and not (lse[bad_rows] == float("-inf")).any(), (
        f"lse must be NaN / +inf on the poisoned rows, got {lse[bad_rows][:4].tolist()}. {rep}")
    assert torch.isfinite(lse[~bad_rows]).all(), f"lse must stay finite on the other rows. {rep}"
    torch.testing.assert_close(lse[~bad_rows].double(), gold_lse[..., 0][~bad_rows].double(), atol=2e-3, rtol=2e-3,
                               msg=lambda m: f"{m}. {rep}")


@pytest.mark.parametrize("case", ["k_nan", "v_nan"])
def test_nan_in_the_kv_cache_reaches_the_decode_rows_that_read_it(case, target):
    """The split-KV decode path (one query row against a cache; ``attention_with_kvcache``): the NaN
    reaches the sequences that read the poisoned key, through the split combine, and no other."""
    device, backend = target
    rep = f"repro: pytest tests/test_nan_inputs.py -k 'decode and {case} and {target_id(target)}'"
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(670 + (case == "v_nan"))
    b, h_q, h_kv, s_kv, d = 3, 8, 2, 700, 64
    q = torch.randn(b, h_q, 1, d, generator=gen).to(device, dt)
    k = torch.randn(b, h_kv, s_kv, d, generator=gen).to(device, dt)
    v = torch.randn(b, h_kv, s_kv, d, generator=gen).to(device, dt)
    lens = torch.tensor([s_kv, 650, 200], dtype=torch.int32)
    (k if case == "k_nan" else v)[1, 0, 400, 7] = float("nan")      # inside sequence 1, past sequence 2's end
    (k if case == "k_nan" else v)[2, 0, 600, 7] = float("nan")      # past sequence 2's length: never read
    out = fusedattn.attention_with_kvcache(q, k, v, seq_len_kv=lens.to(device), backend=backend)
    nan_got = torch.isnan(out.cpu())
    assert not nan_got[0].any() and not nan_got[2].any(), f"sequences 0 and 2 never read the NaN. {rep}"
    group = h_q // h_kv
    if case == "k_nan":          # every column of the kv head's query heads in sequence 1
        assert nan_got[1, :group].all() and not nan_got[1, group:].any(), rep
    else:                        # column 7 of those heads only
        assert nan_got[1, :group, :, 7].all() and nan_got[1].sum() == group, rep
    # the clean sequences against the reference on the same cache without the NaN past sequence 2's end
    # (the float64 reference multiplies every key's V, read or not: 0 * NaN)
    k0, v0 = k.cpu().clone(), v.cpu().clone()
    (k0 if case == "k_nan" else v0)[2, 0, 600, 7] = 0.0
    gold, _ = attention_reference(q.cpu(), k0, v0, seq_len_kv=lens, dtype=torch.float64)
    base, _ = attention_reference(q.cpu(), k0, v0, seq_len_kv=lens, dtype=dt)
    for seq in (0, 2):
        assert_error_within(out.cpu()[seq], gold[seq], base[seq], msg=f"sequence {seq}. {rep}")
