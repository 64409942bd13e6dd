"""FP8 K/V caches (issue 27 item 4, fusedattn.kvcache_fp8): e4m3 caches, contiguous and paged, per-tensor and
per-head descales, read by attention_with_kvcache (decode, prefill, padded and packed queries) and the
FlashAttention door; appends quantized exactly; against float64 attention of the unquantized K / V within the
derived bound (fusedattn.reference_fp8.fp8_kvcache_bound) and of the dequantized cache within fp32's.

Hostile data: cache slots past each sequence's length and the slots an append must fill hold NaN bytes, unused
pages too, unused page-table slots -1 and the page table is shuffled, so a read that should not happen or a
missing write poisons the output."""
import math

import pytest
import torch
import triton
import triton.language as tl

from conftest import TARGETS, run_compile_child
from fusedattn import fp8
from fusedattn.backends.triton import decode as decode_kernels
from fusedattn.flash_attn import flash_attn_with_kvcache
from fusedattn.kvcache import attention_with_kvcache
from fusedattn.problem import InvalidArgumentError, InvalidTypeError, NotSupportedError
from fusedattn.reference_fp8 import fp8_kvcache_bound
from fusedattn.testing import assert_lse_close
from fusedattn.reference import attention_reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN_BYTE = 0x7F          # e4m3's NaN (S.1111.111); e5m2's 0x7F is a NaN too


def _descale(x, fp8_dtype, per_head, pow2):
    """amax / FP8_MAX per tensor or per kv head (x [b, h_kv, s, d]): fp32 [1] or [h_kv]; a power of two
    (exact division) or not (the append's division rounds)."""
    amax = x.float().abs().amax(dim=(0, 2, 3)) if per_head else x.float().abs().amax().reshape(1)
    ds = amax / fp8.FP8_MAX[fp8_dtype]
    if pow2:
        ds = torch.exp2(torch.ceil(torch.log2(ds)))
    return ds


def _pack_bytes(x8):
    return x8.view(torch.uint8)


class Cache:
    """Unquantized dense K / V, the FP8 cache holding them (contiguous or paged), queries and new tokens."""

    def __init__(self, *, paged, s_q=1, lens=(45, 17, 30), b=3, h_q=4, h_kv=2, d=32, d_v=24, page=8,
                 dtype=torch.bfloat16, fp8_dtype=E4M3, per_head=True, pow2=False, append=True, seq_len_q=None,
                 seed=0, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.b, self.h_kv, self.s_q, self.append, self.fp8_dtype = b, h_kv, s_q, append, fp8_dtype
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.lens_q = torch.tensor(seq_len_q, dtype=torch.int32) if seq_len_q is not None else None
        cap = max(lens) + 5
        head_gain = torch.tensor([4.0 ** i for i in range(h_kv)]).view(1, h_kv, 1, 1)   # per-head scales matter
        self.k = (torch.randn(b, h_kv, cap, d, generator=g) * head_gain).to(dtype)
        self.v = (torch.randn(b, h_kv, cap, d_v, generator=g) * head_gain).to(dtype)
        self.q = torch.randn(b, h_q, s_q, d, generator=g).to(dtype)
        self.dk = _descale(self.k, fp8_dtype, per_head, pow2)
        self.dv = _descale(self.v, fp8_dtype, per_head, pow2)
        self.k8 = fp8.quantize(self.k.float() / self.dk.view(1, -1, 1, 1), fp8_dtype)    # dense bytes
        self.v8 = fp8.quantize(self.v.float() / self.dv.view(1, -1, 1, 1), fp8_dtype)
        # which slots the cache already holds (the rest, new tokens included, start as NaN bytes)
        n_new = self.lens_q if self.lens_q is not None else torch.full((b,), s_q if append else 0)
        slot = torch.arange(cap)[None, :]
        held = slot < (self.lens - (n_new if append else 0))[:, None]
        self.new_slots = (slot < self.lens[:, None]) & ~held                              # [b, cap]
        kc, vc = (torch.where(held[:, None, :, None], x.view(torch.uint8), NAN_BYTE).view(fp8_dtype)
                  for x in (self.k8, self.v8))
        self.page_table = None
        if paged:
            n_pages = -(-cap // page)
            pad = n_pages * page - cap
            kc, vc = (torch.cat([x, torch.full((b, h_kv, pad, x.shape[3]), NAN_BYTE, dtype=torch.uint8)
                                 .view(fp8_dtype)], 2) for x in (kc, vc))
            perm = torch.randperm(b * n_pages + 3, generator=g)                             # 3 unused pages
            table = perm[:b * n_pages].view(b, n_pages).to(torch.int32)
            cont = lambda x: torch.full((b * n_pages + 3, h_kv, page, x.shape[3]), NAN_BYTE,   # noqa: E731
                                        dtype=torch.uint8).view(fp8_dtype)
            kp, vp = cont(kc), cont(vc)
            for i in range(b):
                used = -(-int(self.lens[i]) // page)
                for j in range(n_pages):
                    kp[table[i, j]] = kc[i, :, j * page:(j + 1) * page]
                    vp[table[i, j]] = vc[i, :, j * page:(j + 1) * page]
                table[i, used:] = -1                                                         # never read
            kc, vc, self.page_table = kp, vp, table
        self.k_cache, self.v_cache = kc, vc
        self.k_new = self.v_new = None
        if append:
            idx = (self.lens - n_new)[:, None] + torch.arange(s_q)[None, :]                 # [b, s_q]
            idx = idx.clamp(0, cap - 1)
            self.k_new = torch.stack([self.k[i, :, idx[i]] for i in range(b)])              # [b, h_kv, s_q, d]
            self.v_new = torch.stack([self.v[i, :, idx[i]] for i in range(b)])
        if device != "cpu":
            for name in ("q", "k_cache", "v_cache", "page_table", "k_new", "v_new", "lens", "lens_q", "dk", "dv"):
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, t.to(device))

    def kwargs(self):
        return dict(page_table=self.page_table, seq_len_kv=self.lens, k_new=self.k_new, v_new=self.v_new,
                    seq_len_q=self.lens_q, descale_k=self.dk, descale_v=self.dv)

    def dense_cache_bytes(self):
        """The cache read back densely (through the page table): [b, h_kv, cap, d] float8."""
        cap = self.k8.shape[2]
        if self.page_table is None:
            return self.k_cache[:, :, :cap].cpu(), self.v_cache[:, :, :cap].cpu()
        out = []
        for c in (self.k_cache.cpu(), self.v_cache.cpu()):
            t = self.page_table.cpu().long().clamp(min=0)
            pages = c[t]                                                 # [b, n, h, page, d]
            out.append(pages.permute(0, 2, 1, 3, 4).reshape(self.b, self.h_kv, -1, c.shape[-1])[:, :, :cap])
        return tuple(out)

    def check(self, out, stats, lower=0.0, kernel=False):
        """The stored bytes, then out against float64 of the dequantized cache (tight) and of the unquantized
        K / V (the derived bound, reached to at least ``lower`` of it). ``kernel``: the call ran the decode
        kernel on the cache's bytes, which rounds P to fp16 before P @ V (the bound's p_dtype; bf16 queries too:
        the kernel runs their products on fp16 operands, [Note] FP8 caches in backends/triton/decode.py)."""
        k8, v8 = self.dense_cache_bytes()
        kept = (torch.arange(k8.shape[2])[None, :] < self.lens[:, None].cpu())[:, None, :, None]
        if self.append:      # the appended slots hold exactly torch's own cast of k_new / descale_k
            sel = self.new_slots[:, None, :, None].expand_as(k8)
            m = fp8.FP8_MAX[self.fp8_dtype]
            want = (self.k.float() / self.dk.cpu().view(1, -1, 1, 1)).clamp(-m, m).to(self.fp8_dtype)
            assert torch.equal(_pack_bytes(k8)[sel], _pack_bytes(want)[sel])
            want = (self.v.float() / self.dv.cpu().view(1, -1, 1, 1)).clamp(-m, m).to(self.fp8_dtype)
            sel = self.new_slots[:, None, :, None].expand_as(v8)
            assert torch.equal(_pack_bytes(v8)[sel], _pack_bytes(want)[sel])
        assert torch.equal(_pack_bytes(k8).where(kept, 0), _pack_bytes(self.k8).where(kept, 0))
        assert torch.equal(_pack_bytes(v8).where(kept, 0), _pack_bytes(self.v8).where(kept, 0))
        # every slot the call read holds the expected bytes; the rest stay out of the reference
        zero = lambda x, m: x.where(m, torch.zeros((), dtype=x.dtype))                # noqa: E731
        k8z, v8z = zero(self.k8.float(), kept).to(self.fp8_dtype), zero(self.v8.float(), kept).to(self.fp8_dtype)
        o_ref, o_deq, bound, bound_deq = fp8_kvcache_bound(
            self.q.cpu(), zero(self.k.float(), kept), zero(self.v.float(), kept), k8z, v8z, descale_k=self.dk.cpu(),
            descale_v=self.dv.cpu(), out_dtype=self.q.dtype, seq_len_kv=self.lens.cpu(),
            seq_len_q=self.lens_q.cpu() if self.lens_q is not None else None, p_dtype=torch.float16 if kernel else None)
        got = out.detach().cpu().double()
        assert not torch.isnan(got).any(), "NaN in the output: a slot past a length or an unwritten append was read"
        err_deq, err = (got - o_deq).abs(), (got - o_ref).abs()
        assert (err_deq <= bound_deq).all(), f"vs the dequantized cache: {(err_deq / bound_deq).max():.3f} x bound"
        ratio = (err / bound).nan_to_num(0.0).max().item()
        assert ratio <= 1.0, f"error exceeds the derived bound by {ratio:.3f}x"
        assert ratio >= lower, f"bound vacuous here: error only {ratio:.4f} of it"
        # stats: the log-sum-exp of the dequantized scores
        K = (k8z.double() * self.dk.cpu().double().view(1, -1, 1, 1))
        V = (v8z.double() * self.dv.cpu().double().view(1, -1, 1, 1))
        _, lse = attention_reference(self.q.cpu().double(), K, V, causal=True, causal_alignment="bottom_right",
                                     seq_len_kv=self.lens.cpu(),
                                     seq_len_q=self.lens_q.cpu() if self.lens_q is not None else None)
        assert_lse_close(stats, lse, tol=1e-5)
        return ratio


GEOMS = {
    "decode_contig": dict(paged=False),
    "decode_paged": dict(paged=True),
    "decode_paged_no_append": dict(paged=True, append=False),
    "prefill_paged": dict(paged=True, s_q=13, lens=(45, 17, 30)),
    "prefill_contig_padded_q": dict(paged=False, s_q=7, seq_len_q=(7, 3, 0), lens=(45, 9, 30)),
}


@pytest.mark.parametrize("scales", ["per_tensor_pow2", "per_head"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("geom", list(GEOMS))
def test_fp8_cache_within_derived_bound(geom, dtype, scales):
    c = Cache(dtype=dtype, per_head=scales == "per_head", pow2=scales != "per_head", **GEOMS[geom])
    out, stats = attention_with_kvcache(c.q, c.k_cache, c.v_cache, return_stats=True, **c.kwargs())
    assert out.dtype == dtype
    c.check(out, stats, lower=0.02)         # measured: 4-16% of the bound (its worst case needs aligned roundings)


@pytest.mark.parametrize("geom", ["decode_paged", "prefill_paged", "prefill_contig_padded_q"])
def test_fp8_cache_on_each_target(geom, target, monkeypatch):
    """The Triton targets run the decode kernel on the cache's bytes (KV_FP8), the CPU the emulation; each
    within its bound. The interpreter runs fp16 queries (its fp32 -> bf16 cast truncates: 2x the rounding
    error, over the bound's output term; the GPU runs bf16, whose rows the kernel moves into fp16 exactly,
    ``test_fp16_rows_exact``)."""
    from fusedattn.backends.triton import decode
    device, backend = target
    dtype = torch.float16 if (device, backend) == ("cpu", "triton") else torch.bfloat16
    c = Cache(device=device, dtype=dtype, **GEOMS[geom])
    fp8_launches = []
    real = decode.launch_decode
    monkeypatch.setattr(decode, "launch_decode",
                        lambda *a, **kw: (fp8_launches.append(kw.get("descale_k") is not None), real(*a, **kw))[1])
    out, stats = attention_with_kvcache(c.q, c.k_cache, c.v_cache, return_stats=True, backend=backend, **c.kwargs())
    kernel = backend == "triton"
    assert fp8_launches == ([True] if kernel else []), f"decode kernel launches (FP8 bytes?): {fp8_launches}"
    c.check(out, stats, kernel=kernel)


@pytest.mark.parametrize("v_read, programs, paged", [("pairs", "many", True), ("pairs", "few", False),
                                                     ("pairs", "few", True), ("bytes", "many", False)])
def test_fp8_tiles_under_interpreter(v_read, programs, paged, target, monkeypatch):
    """The sm90 FP8 decode tiles run by the interpreter: ``decode.FP8_TILE`` (64 keys, 3 stages; the split
    heuristic at its 4 programs per SM) where the programs fill the machine or the cache is paged, else
    ``FP8_TILE_FEW`` (128 keys), with V read as int16 pairs (``_widen_pairs``: the even and odd columns' products
    interleaved after the last tile; a padded d_v, half of 48 in a half tile of 32) or as bytes (the route where
    the pairs view does not apply): the planned tile, within the derived bound."""
    from fusedattn.backends.triton import decode
    device, backend = target
    if (device, backend) != ("cpu", "triton"):
        pytest.skip("interpreter only (the GPU runs these tiles anyway)")
    original, pairs_code, launch = decode.decode_tiles, decode.v_pairs_code, decode.launch_decode
    monkeypatch.setattr(decode, "decode_tiles", lambda rows, d, dt, interpret, *rest: original(rows, d, dt, False, *rest))
    monkeypatch.setattr(decode, "num_sms", lambda device: 1 if programs == "many" else 132)
    codes, tiles = [], []
    monkeypatch.setattr(decode, "v_pairs_code", lambda v, d_v: codes.append(pairs_code(v, d_v) if v_read == "pairs"
                                                                            else 0) or codes[-1])
    monkeypatch.setattr(decode, "launch_decode", lambda *a, **kw: (tiles.append(kw["tiles"]), launch(*a, **kw))[1])
    c = Cache(device=device, paged=paged, dtype=torch.float16, d=64, d_v=48, lens=(150, 17, 96), per_head=True,
              seed=41)
    out, stats = attention_with_kvcache(c.q, c.k_cache, c.v_cache, return_stats=True, backend=backend, **c.kwargs())
    assert codes == [3 if v_read == "pairs" else 0], codes       # 3: e4m3 pairs in Triton's conversions
    assert tiles == [decode.FP8_TILE if programs == "many" or paged else decode.FP8_TILE_FEW], tiles
    c.check(out, stats, kernel=True)


def test_v_pairs_code_where_the_view_applies(monkeypatch):
    """``decode.v_pairs_code``: FP8 V read as int16 pairs (PTX on a GPU: 1 e4m3 / 2 e5m2; the interpreter: 3 / 4)
    only where the view is exact and half a tile is a dot's width: an even d_v, column stride 1, even strides and
    offset, BLOCK_DV >= 32; 16-bit caches never."""
    from fusedattn.backends.triton import decode
    v = torch.zeros(2, 3, 5, 64, dtype=E4M3)                                         # [b, h_kv, s, d_v]
    monkeypatch.setattr(decode, "interpreting", lambda: False)
    assert decode.v_pairs_code(v, 64) == 1
    assert decode.v_pairs_code(v.view(torch.uint8).view(E5M2), 64) == 2
    assert decode.v_pairs_code(torch.zeros(2, 3, 5, 24, dtype=E4M3), 24) == 1       # BLOCK_DV 32: halves of 16
    assert decode.v_pairs_code(torch.zeros(2, 3, 5, 16, dtype=E4M3), 16) == 0       # halves of 8: narrower than a dot
    assert decode.v_pairs_code(torch.zeros(2, 3, 5, 63, dtype=E4M3)[..., :62], 62) == 0    # odd row stride
    assert decode.v_pairs_code(torch.zeros(2, 3, 5, 65, dtype=E4M3)[..., 1:], 64) == 0     # odd offset
    assert decode.v_pairs_code(torch.zeros(2, 3, 64, 5, dtype=E4M3).transpose(2, 3), 64) == 0  # column stride 5
    assert decode.v_pairs_code(torch.zeros(2, 3, 5, 64, dtype=torch.bfloat16), 64) == 0
    monkeypatch.setattr(decode, "interpreting", lambda: True)
    assert decode.v_pairs_code(v, 64) == 3
    assert decode.v_pairs_code(v.view(torch.uint8).view(E5M2), 64) == 4


def test_packed_queries():
    """cu_seqlens_q: packed new tokens against a paged FP8 cache equal the padded call, row for row."""
    lens_q = (4, 1, 0)
    pad = Cache(paged=True, s_q=4, seq_len_q=lens_q, lens=(45, 17, 30), seed=4)
    packed = Cache(paged=True, s_q=4, seq_len_q=lens_q, lens=(45, 17, 30), seed=4)
    out_pad, st_pad = attention_with_kvcache(pad.q, pad.k_cache, pad.v_cache, return_stats=True, **pad.kwargs())
    pad.check(out_pad, st_pad)
    rows = [(i, t) for i in range(3) for t in range(lens_q[i])]
    take = lambda x: torch.stack([x[i, :, t] for i, t in rows])                     # noqa: E731  [total, h, d]
    cu = torch.tensor([0, 4, 5, 5], dtype=torch.int32)
    kw = packed.kwargs()
    kw.update(seq_len_q=None, k_new=take(packed.k_new), v_new=take(packed.v_new))
    out, st = attention_with_kvcache(take(packed.q), packed.k_cache, packed.v_cache, cu_seqlens_q=cu, max_seqlen_q=4,
                                     return_stats=True, **kw)
    assert torch.equal(out, take(out_pad))
    assert torch.equal(st, torch.stack([st_pad[i, :, t, 0] for i, t in rows]).T)
    assert torch.equal(packed.k_cache.view(torch.uint8), pad.k_cache.view(torch.uint8))     # same appends


def test_e5m2_cache():
    c = Cache(paged=True, fp8_dtype=E5M2, per_head=True, seed=2)
    out, stats = attention_with_kvcache(c.q, c.k_cache, c.v_cache, return_stats=True, **c.kwargs())
    c.check(out, stats)


def test_bound_is_reached():
    """Values just below a rounding midpoint (1 + 1/16 - 2^-12 rounds down to 1), q = 0 (uniform P): every
    value loses almost u8 of itself in the same direction, so the error reaches > 90% of the bound."""
    c = Cache(paged=True, dtype=torch.float32, per_head=False, pow2=True, append=True, seed=1)
    c.q.zero_()
    c.v.copy_(1 + 1 / 16 - 2 ** -12)
    c.dv = torch.ones(1)
    c.v8 = fp8.quantize(c.v, E4M3)
    c.v_new.copy_(1 + 1 / 16 - 2 ** -12)
    c.v_cache.view(torch.uint8).copy_(torch.where(c.v_cache.float().isnan(), NAN_BYTE, 0x38))   # 1.0 everywhere held
    out, stats = attention_with_kvcache(c.q, c.k_cache, c.v_cache, return_stats=True, **c.kwargs())
    assert c.check(out, stats) > 0.9


def test_per_head_descales_matter():
    """The per-head descale of head 1 scales head 1's values: passing one per-tensor descale instead changes
    the output of the heads reading kv head 1 (and only those)."""
    c = Cache(paged=False, append=False, per_head=True, seed=3)
    out = attention_with_kvcache(c.q, c.k_cache, c.v_cache, **c.kwargs())
    kw = dict(c.kwargs(), descale_v=c.dv[:1])
    other = attention_with_kvcache(c.q, c.k_cache, c.v_cache, **kw)
    assert torch.equal(out[:, :2], other[:, :2]) and not torch.equal(out[:, 2:], other[:, 2:])


@pytest.mark.parametrize("geom", ["decode_contig", "decode_paged"])
def test_strided_per_head_descales_read_each_head(geom, target):
    """Per-head descales given as a strided view (every other element of a buffer) mean what their values
    say: the same output, bit for bit, as contiguous copies. The decode kernel once read such a view as
    contiguous (stride 1), taking other heads' descales (found by the FP8 prefill patch's tests)."""
    device, backend = target
    dtype = torch.float16 if (device, backend) == ("cpu", "triton") else torch.bfloat16
    c = Cache(device=device, dtype=dtype, per_head=True, append=False, seed=6, **GEOMS[geom])
    kw = c.kwargs()
    dense = attention_with_kvcache(c.q, c.k_cache, c.v_cache, backend=backend, **kw)
    strided = {}
    for name in ("descale_k", "descale_v"):
        buf = torch.full((2 * kw[name].numel(),), 1e6, dtype=torch.float32, device=kw[name].device)
        buf[::2] = kw[name].reshape(-1)
        strided[name] = buf[::2]
        assert strided[name].stride() == (2,)
    out = attention_with_kvcache(c.q, c.k_cache, c.v_cache, backend=backend, **dict(kw, **strided))
    assert torch.equal(out, dense), f"repro: geom={geom} target={target} strided per-head descales"


def test_append_rounds_and_saturates_as_torch_casts():
    """Non-power-of-two descales (the division rounds), values past 448 * descale (saturate, not inf / NaN),
    a NaN stays NaN: the stored bytes are torch's own cast of clamp(k_new / descale_k)."""
    c = Cache(paged=True, append=True, per_head=True, pow2=False, seed=5)
    c.k_new[0, 0, 0, :4] = torch.tensor([1e4, -1e4, float("inf"), float("nan")], dtype=c.k_new.dtype)
    attention_with_kvcache(c.q, c.k_cache, c.v_cache, **c.kwargs())
    k8, _ = c.dense_cache_bytes()
    pos = int(c.lens[0]) - 1
    got = k8[0, 0, pos, :4].float()
    assert got[:3].tolist() == [448.0, -448.0, 448.0] and math.isnan(got[3].item())
    want = fp8.quantize(c.k_new.float() / c.dk.view(1, -1, 1, 1), E4M3)
    torch_cast = (c.k_new.float() / c.dk.view(1, -1, 1, 1)).clamp(-448, 448).to(E4M3)
    assert torch.equal(want.view(torch.uint8), torch_cast.view(torch.uint8))
    for i in range(c.b):
        n = int(c.lens[i])
        assert torch.equal(k8[i, :, n - 1].view(torch.uint8), want[i, :, 0].view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, err, words", [
    (dict(descale_k=torch.ones(3)), InvalidArgumentError, ["descale_k", "per head (2)", "[3]"]),
    (dict(descale_v=torch.ones(2, 2)), InvalidArgumentError, ["descale_v", "[2, 2]"]),
    (dict(descale_k=None), InvalidArgumentError, ["descale_k", "required", "float8_e4m3fn"]),
    (dict(descale_v=None), InvalidArgumentError, ["descale_v", "required"]),
    (dict(descale_k="0.5"), InvalidTypeError, ["descale_k"]),
    (dict(descale_k=torch.ones(1, dtype=torch.int32)), InvalidTypeError, ["descale_k", "int32"]),
    (dict(v_cache="e5m2"), InvalidTypeError, ["v_cache", "float8_e5m2", "k_cache"]),
    (dict(v_cache="bf16"), InvalidTypeError, ["v_cache", "bfloat16"]),
    (dict(k_new="fp16"), InvalidTypeError, ["k_new", "float16", "quantizes"]),
], ids=["k_descale_shape", "v_descale_shape", "no_descale_k", "no_descale_v", "descale_str", "descale_int",
        "mixed_fp8_types", "fp8_and_bf16", "k_new_dtype"])
def test_bad_fp8_input_names_the_argument(change, err, words):
    c = Cache(paged=True)
    kw = c.kwargs()
    k_cache, v_cache = c.k_cache, c.v_cache
    if change.get("v_cache") == "e5m2":
        v_cache = v_cache.float().nan_to_num(0).to(E5M2)
    elif change.get("v_cache") == "bf16":
        v_cache = v_cache.float().nan_to_num(0).to(torch.bfloat16)
    elif change.get("k_new") == "fp16":
        kw["k_new"] = c.k_new.to(torch.float16)
    else:
        kw.update(change)
    with pytest.raises(err) as e:
        attention_with_kvcache(c.q, k_cache, v_cache, **kw)
    for w in words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"


def test_16bit_cache_refuses_descales():
    c = Cache(paged=False, append=False)
    k, v = c.k.to(torch.bfloat16), c.v.to(torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="descale_k given but k_cache is torch.bfloat16"):
        attention_with_kvcache(c.q, k, v, seq_len_kv=c.lens, descale_k=c.dk)
    with pytest.raises(InvalidArgumentError, match="descale_v given"):
        attention_with_kvcache(c.q, k, v, seq_len_kv=c.lens, descale_v=1.0)
    attention_with_kvcache(c.q, k, v, seq_len_kv=c.lens)                     # and without them it runs


# ---------------------------------------------------------------------------------------------
# the FlashAttention door: FlashAttention-3's k_descale / v_descale / q_descale
# ---------------------------------------------------------------------------------------------

def _bshd_cache(c):
    return c.k_cache.transpose(1, 2), c.v_cache.transpose(1, 2)       # BSHD views of the same bytes


def _fa3(x, b):          # FA3's (batch_size, nheads_k) descale, equal rows
    return x.view(1, -1).expand(b, -1).contiguous()


def test_flash_attn_door_fp8_cache():
    a, ref = Cache(paged=True, seed=6), Cache(paged=True, seed=6)
    kc, vc = _bshd_cache(a)
    out = flash_attn_with_kvcache(a.q.transpose(1, 2), kc, vc, k=a.k_new.transpose(1, 2), v=a.v_new.transpose(1, 2),
                                  cache_seqlens=a.lens - 1, block_table=a.page_table, causal=True,
                                  k_descale=_fa3(a.dk, a.b), v_descale=_fa3(a.dv, a.b))
    want = attention_with_kvcache(ref.q, ref.k_cache, ref.v_cache, **ref.kwargs())
    assert torch.equal(out.transpose(1, 2), want)
    assert torch.equal(a.k_cache.view(torch.uint8), ref.k_cache.view(torch.uint8))


def test_flash_attn_door_all_fp8_call():
    """FA3's all-FP8 call: float8 q, k_cache, v_cache and new k / v with q/k/v_descale; the new k / v bytes land
    in the cache unchanged, the output is bf16 and equals the dequantized-q call."""
    a, ref = Cache(paged=False, seed=7, dtype=torch.float32), Cache(paged=False, seed=7, dtype=torch.float32)
    q8, dq = fp8.quantize_per_tensor(a.q)
    k8 = fp8.quantize(a.k_new.float() / a.dk.view(1, -1, 1, 1), E4M3)
    v8 = fp8.quantize(a.v_new.float() / a.dv.view(1, -1, 1, 1), E4M3)
    kc, vc = _bshd_cache(a)
    out = flash_attn_with_kvcache(q8.transpose(1, 2), kc, vc, k=k8.transpose(1, 2), v=v8.transpose(1, 2),
                                  cache_seqlens=a.lens - 1, causal=True, q_descale=torch.full((a.b, a.h_kv), dq.item()),
                                  k_descale=_fa3(a.dk, a.b), v_descale=_fa3(a.dv, a.b))
    assert out.dtype == torch.bfloat16
    want = attention_with_kvcache(q8.float() * dq, ref.k_cache, ref.v_cache, **ref.kwargs())
    assert torch.equal(out.transpose(1, 2), want.to(torch.bfloat16))
    assert torch.equal(a.k_cache.view(torch.uint8), ref.k_cache.view(torch.uint8))
    assert torch.equal(a.v_cache.view(torch.uint8), ref.v_cache.view(torch.uint8))


def test_flash_attn_door_append_longer_than_q():
    """seqlen_new != seqlen_q (the door's own scatter): the new keys are quantized with the cache's descale."""
    c = Cache(paged=True, append=False, seed=8)
    kc, vc = _bshd_cache(c)
    k_new = torch.randn(c.b, 3, c.h_kv, c.k.shape[-1]).to(torch.bfloat16)
    v_new = torch.randn(c.b, 3, c.h_kv, c.v.shape[-1]).to(torch.bfloat16)
    before = c.lens - 3
    flash_attn_with_kvcache(c.q.transpose(1, 2), kc, vc, k=k_new, v=v_new, cache_seqlens=before,
                            block_table=c.page_table, causal=True, k_descale=_fa3(c.dk, c.b), v_descale=_fa3(c.dv, c.b))
    k8, _ = c.dense_cache_bytes()
    want = fp8.quantize(k_new.float() / c.dk.view(1, 1, -1, 1), E4M3)           # BSHD
    for i in range(c.b):
        n = int(before[i])
        assert torch.equal(k8[i, :, n:n + 3].view(torch.uint8), want[i].transpose(0, 1).view(torch.uint8))


@pytest.mark.parametrize("kw, err, words", [
    (dict(k_descale=None), InvalidArgumentError, ["k_descale", "required"]),
    (dict(v_descale="diff"), NotSupportedError, ["v_descale", "batch"]),
    (dict(k_descale="shape"), InvalidArgumentError, ["k_descale", "(batch_size, nheads_k)"]),
    (dict(q_descale=torch.ones(1)), InvalidArgumentError, ["q_descale", "float8 q"]),
], ids=["no_k_descale", "v_descale_per_batch", "k_descale_shape", "q_descale_16bit_q"])
def test_flash_attn_door_bad_descales(kw, err, words):
    c = Cache(paged=False, append=False)
    kc, vc = _bshd_cache(c)
    args = dict(k_descale=_fa3(c.dk, c.b), v_descale=_fa3(c.dv, c.b))
    args.update(kw)
    if kw.get("v_descale") == "diff":
        args["v_descale"] = torch.arange(1.0, 1.0 + c.b * c.h_kv).view(c.b, c.h_kv)
    if kw.get("k_descale") == "shape":
        args["k_descale"] = torch.ones(c.b + 1, c.h_kv)
    with pytest.raises(err) as e:
        flash_attn_with_kvcache(c.q.transpose(1, 2), kc, vc, cache_seqlens=c.lens, **args)
    for w in words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"
    with pytest.raises(InvalidArgumentError, match="k_descale given"):
        flash_attn_with_kvcache(c.q.transpose(1, 2), c.k.transpose(1, 2), c.v.transpose(1, 2), k_descale=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
@pytest.mark.parametrize("geom", list(GEOMS))
def test_gpu_fp8_cache_within_derived_bound(geom):
    c = Cache(device="cuda", per_head=True, **GEOMS[geom])
    out, stats = attention_with_kvcache(c.q, c.k_cache, c.v_cache, return_stats=True, **c.kwargs())
    c.check(out, stats, kernel=True)        # every geometry here is decode-sized: the kernel on FP8 bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
@pytest.mark.parametrize("dims", [(32, 24), (128, 128)], ids=["d32_dv24", "d128"])
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gpu_fp8_cache_each_format(fp8_dtype, dtype, paged, dims):
    """The decode kernel on FP8 bytes for both formats, both query types (bf16 queries run on fp16 operands,
    ``decode._fp16_rows``), contiguous and paged, padded (d 32 / d_v 24) and full head dims: within the derived
    bound (the other GPU cases are e4m3 with bf16 queries only)."""
    c = Cache(device="cuda", paged=paged, dtype=dtype, fp8_dtype=fp8_dtype, d=dims[0], d_v=dims[1], per_head=True,
              seed=29)
    out, stats = attention_with_kvcache(c.q, c.k_cache, c.v_cache, return_stats=True, **c.kwargs())
    c.check(out, stats, kernel=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gpu_fp8_cache_v_as_bytes(fp8_dtype, paged, monkeypatch):
    """The decode kernel's other V route on the GPU: V read as FP8 bytes (where ``decode.v_pairs_code`` finds no
    int16 view: odd strides, narrow d_v), forced here; within the derived bound like the pairs route above."""
    from fusedattn.backends.triton import decode
    monkeypatch.setattr(decode, "v_pairs_code", lambda v, d_v: 0)
    c = Cache(device="cuda", paged=paged, dtype=torch.bfloat16, fp8_dtype=fp8_dtype, d=128, d_v=128,
              per_head=True, seed=31)
    out, stats = attention_with_kvcache(c.q, c.k_cache, c.v_cache, return_stats=True, **c.kwargs())
    c.check(out, stats, kernel=True)


@triton.jit
def _fp16_rows_kernel(Q, Q16, INV, M: tl.constexpr, D: tl.constexpr):
    rows, cols = tl.arange(0, M), tl.arange(0, D)
    q16, inv = decode_kernels._fp16_rows(tl.load(Q + rows[:, None] * D + cols[None, :]))
    tl.store(Q16 + rows[:, None] * D + cols[None, :], q16)
    tl.store(INV + rows, inv)


@pytest.mark.parametrize("target", TARGETS[1:])
def test_fp16_rows_exact(target):
    """The decode kernel's bf16 queries against an FP8 cache run on fp16 operands (``decode._fp16_rows``): each
    row moves into fp16 by one power of two, its largest |q| into [2^14, 2^15), and back exactly; zeros stay
    zeros, inf / NaN stay inf / NaN. Rows from 2^-100 to 2^100, one of zeros, one with an inf and a NaN."""
    device = target[0]
    g = torch.Generator().manual_seed(28)
    q = torch.randn(16, 32, generator=g) * torch.exp2(torch.linspace(-100, 100, 16))[:, None]
    q[3] = 0.0
    q[5, 7], q[5, 9] = float("inf"), float("nan")
    q = q.to(torch.bfloat16)
    q16 = torch.full((16, 32), float("nan"), dtype=torch.float16, device=device)
    inv = torch.full((16,), float("nan"), device=device)
    _fp16_rows_kernel[(1,)](q.to(device), q16, inv, M=16, D=32)
    q16, inv = q16.cpu().float(), inv.cpu()
    assert torch.equal(torch.log2(inv), torch.log2(inv).round()), "the scales must be powers of two"
    finite = torch.ones(16, dtype=torch.bool)
    finite[5] = False
    top = q16[finite].abs().amax(1)
    assert ((top >= 2 ** 14) | (top == 0)).all() and (top < 2 ** 15).all()
    back = q16 * inv[:, None]
    assert torch.equal(back[finite], q.float()[finite]), "rows must round-trip exactly"
    assert back[5, 7] == float("inf") and back[5, 9].isnan()


def test_fp8_v_pairs_compile_for_sm90():
    """No GPU needed: the decode kernel's FP8 builds with V read as int16 pairs (``decode._widen_pairs``: inline
    PTX, which the interpreter CI runs cannot) compile for sm_90 at both FP8 tiles, contiguous and paged, e4m3 and
    e5m2 (``tools/decode_aot_check.compile_decode`` in a child process), and their step loops read V by ldmatrix
    with no byte-wide shared-memory load, where the bytes route (V_PAIRS 0) has them (bench/NOTES.md 74)."""
    out = run_compile_child(
        "from decode_aot_check import compile_decode\n"
        "from sass_loops import loop_spans, sass\n"
        "for kv, pairs, paged, bn, st in (('fp8e4nv', 1, False, 64, 3), ('fp8e5', 2, True, 64, 3),\n"
        "                                 ('fp8e4nv', 1, False, 128, 3), ('fp8e4nv', 0, False, 64, 3)):\n"
        "    text = sass(compile_decode('bf16', kv, True, paged, bn=bn, st=st, pairs=pairs))\n"
        "    lines = text.splitlines()\n"
        "    for _, first, last in loop_spans(text):\n"
        "        body = lines[first:last + 1]\n"
        "        print('LOOP', pairs, sum('LDS.U8' in b for b in body), sum('LDSM' in b for b in body),\n"
        "              sum('HMMA' in b for b in body))\n")
    loops = [tuple(int(x) for x in line.split()[1:]) for line in out.splitlines() if line.startswith("LOOP")]
    steps = [lp for lp in loops if lp[3]]           # loops with MMAs: the key-tile steps
    pairs_steps = [lp for lp in steps if lp[0]]
    assert len(pairs_steps) >= 9, f"step loops of the pairs builds: {loops}"
    assert all(lp[1] == 0 and lp[2] > 0 for lp in pairs_steps), f"(pairs, LDS.U8, LDSM, HMMA) per step: {loops}"
    assert any(lp[1] > 0 for lp in steps if not lp[0]), f"the bytes route reads V by bytes: {loops}"


def test_paged_look_ahead_keeps_the_pipeline_for_sm90():
    """No GPU needed: with a page table the decode kernel's K / V copies keep the contiguous cache's shared-memory
    buffers and copies ([Note] paged look-ahead in ``decode._decode_blocks``: the next tile's page entries read a
    tile ahead). Read in the same iteration, Triton's pipeliner gave the table load a stage of its own and K / V
    one buffer each (the FP8 64-key tile, 3 stages: 23 KB against 39 KB; bench/NOTES.md 76: 0.71 -> 0.85 of copy
    at b64 pages of 16 on an H200)."""
    out = run_compile_child(
        "from decode_aot_check import compile_decode\n"
        "for kv, fp8, pairs, bn, st in (('fp8e4nv', True, 1, 64, 3), ('bf16', False, 0, 128, 2)):\n"
        "    for paged in (False, True):\n"
        "        k = compile_decode('bf16', kv, fp8, paged, bn=bn, st=st, pairs=pairs)\n"
        "        print('SMEM', kv, int(paged), k.metadata.shared,\n"
        "              k.asm['ttgir'].count('async_copy_global_to_local'))\n")
    smem = {(kv, p): (int(b), int(c)) for _, kv, p, b, c in (line.split() for line in out.splitlines()
                                                              if line.startswith("SMEM"))}
    for kv in ("fp8e4nv", "bf16"):
        assert smem[(kv, "1")] == smem[(kv, "0")], smem        # (bytes, async copies): paged as contiguous
    assert smem[("fp8e4nv", "0")][0] >= 38 * 1024, smem      # two K / V buffers of the 64-key FP8 tile
