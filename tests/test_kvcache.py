"""attention_with_kvcache: decode against contiguous and paged caches, appending, bad input.

Every case is checked against the float64 reference on the cache seen as a dense tensor
(``causal`` bottom-right, ``seq_len_kv`` as the padding mask), by FlashAttention's 2x rule.
Hostile data: cache slots past each sequence's length, unused pages and the positions an
append must fill are NaN, so a read that should not happen (or a missing write) poisons the
output; unused page-table slots hold -1; page tables are shuffled; q and out live in
NaN-guarded buffers. Each case runs twice (the second hits the compiled kernel).
"""
import math
import random
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import pytest
import torch

from fusedattn.kvcache import attention_with_kvcache
from fusedattn.problem import InvalidArgumentError, InvalidTypeError, NotSupportedError
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within, assert_lse_close, guarded

NAN = float("nan")


@dataclass
class KVCase:
    """One random cache configuration; ``repro()`` names it."""

    seed: int
    b: int
    h_q: int
    h_kv: int
    s_q: int
    d: int
    d_v: int
    page_size: int                 # 0 = contiguous cache
    pages: int                     # page-table columns (paged) / 0
    s_max: int                     # capacity in keys
    lens: Tuple[int, ...]
    dtype: str = "float32"
    q_layout: str = "bhsd"
    cache_layout: str = "bhsd"     # bhsd | bshd (argument) | view (BSHD memory seen through transpose)
    append: bool = False
    causal: bool = True
    num_splits: Optional[int] = None
    window: Optional[Tuple[int, int]] = None
    softcap: float = 0.0
    alibi: bool = False

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)

    def repro(self):
        return f"repro: pytest tests/test_kvcache.py -k 'case{self.seed}-' ; {asdict(self)}"


def random_kv_case(seed: int, gpu: bool = False) -> KVCase:
    """Weighted geometry: mostly one new token, GQA 1/4/8, every page size, ragged lengths with 0 and 1."""
    rng = random.Random(seed)
    h_kv = rng.choice([1, 2, 8] if gpu else [1, 2])
    g = rng.choice([1, 4, 8])
    s_q = rng.choice([1, 1, 1, 1, 2, 3, 5, 16])
    d = rng.choice([64, 128, 128, 96, 256] if gpu else [32, 64, 40])
    d_v = d if rng.random() < 0.85 else rng.choice([32, 64])
    page = rng.choice([0, 0, 16, 32, 64, 128, 256])
    longest = rng.choice([1, 100, 1000, 4097, 9000] if gpu else [1, 5, 17, 64, 113, 200])
    b = rng.choice([1, 2, 3, 8] if gpu else [1, 2, 3])
    append = rng.random() < 0.4
    lens = [longest] + [rng.choice([0, 1, 1, s_q, rng.randint(0, longest), longest]) for _ in range(b - 1)]
    rng.shuffle(lens)
    if append:
        lens = [max(n, s_q) for n in lens]
    longest = max(lens)
    if page:
        pages = -(-longest // page) + rng.choice([0, 0, 1])
        s_max = pages * page
    else:
        pages, s_max = 0, longest + rng.choice([0, 3, 16])
    mask = rng.random()
    return KVCase(seed=seed, b=b, h_q=h_kv * g, h_kv=h_kv, s_q=s_q, d=d, d_v=d_v, page_size=page, pages=pages,
                  s_max=s_max, lens=tuple(lens),
                  dtype=rng.choice(["float16", "bfloat16"] if gpu else ["float32", "float16"]),
                  q_layout=rng.choice(["bhsd", "bshd"]), cache_layout=rng.choice(["bhsd", "bshd", "view"]),
                  append=append, causal=rng.random() < 0.85, num_splits=rng.choice([None, None, 1, 2, 5]),
                  window=(rng.choice([3, 40]), 0) if mask < 0.1 else None,
                  softcap=2.5 if 0.1 <= mask < 0.15 else 0.0, alibi=0.15 <= mask < 0.2)


class Built:
    """The tensors of one case: dense reference K/V and the cache under test (contiguous or paged)."""

    def __init__(self, case: KVCase, device, gen):
        c, dt = case, case.torch_dtype
        self.case = c
        b, h, cap = c.b, c.h_kv, c.s_max
        lens = torch.tensor(c.lens, dtype=torch.int32)
        self.lens = lens.to(device)
        self.k_dense = torch.randn(b, h, cap, c.d, generator=gen).to(dt)        # finite everywhere (reference)
        self.v_dense = torch.randn(b, h, cap, c.d_v, generator=gen).to(dt)
        self.k_new = self.v_new = None
        kept = torch.arange(cap)[None, :] < lens[:, None]                      # [b, cap] slots the cache holds
        written = torch.zeros_like(kept)
        if c.append:
            self.k_new = torch.randn(b, h, c.s_q, c.d, generator=gen).to(dt)
            self.v_new = torch.randn(b, h, c.s_q, c.d_v, generator=gen).to(dt)
            for i, n in enumerate(c.lens):
                self.k_dense[i, :, n - c.s_q:n] = self.k_new[i]
                self.v_dense[i, :, n - c.s_q:n] = self.v_new[i]
                written[i, n - c.s_q:n] = True
            self.k_new, self.v_new = self.k_new.to(device), self.v_new.to(device)
        # what the cache holds before the call: NaN past each length and where the append must write
        poison = ~kept | written
        k_before = self.k_dense.masked_fill(poison[:, None, :, None], NAN)
        v_before = self.v_dense.masked_fill(poison[:, None, :, None], NAN)
        # and what it must hold after
        k_after = self.k_dense.masked_fill(~kept[:, None, :, None], NAN)
        v_after = self.v_dense.masked_fill(~kept[:, None, :, None], NAN)
        self.page_table = None
        if c.page_size:
            p, m = c.page_size, c.pages
            n_blocks = b * m + 3                                              # spare pages stay NaN
            perm = torch.randperm(n_blocks, generator=gen)[:b * m].view(b, m).to(torch.int32)
            used = -(-lens // p)
            table = perm.clone()
            for i in range(b):                                               # unused slots: -1 (never read)
                if c.seed % 2 == 0:
                    table[i, used[i]:] = -1
            self.page_table = table.to(device)
            k_before, v_before, k_after, v_after = (self._paginate(t, perm, n_blocks) for t in
                                                    (k_before, v_before, k_after, v_after))
        self.k_cache = self._place(k_before, device)
        self.v_cache = self._place(v_before, device)
        self.k_expected, self.v_expected = k_after, v_after

    def _paginate(self, dense, perm, n_blocks):
        """[b, h, m*P, d] -> container [n_blocks, h, P, d] with page perm[i, j] = keys j*P.. of sequence i."""
        c = self.case
        b, h, _, d = dense.shape
        out = torch.full((n_blocks, h, c.page_size, d), NAN, dtype=dense.dtype)
        pages = dense.view(b, h, c.pages, c.page_size, d).permute(0, 2, 1, 3, 4)   # [b, m, h, P, d]
        out[perm.reshape(-1).long()] = pages.reshape(b * c.pages, h, c.page_size, d)
        return out

    def _place(self, t, device):
        """The cache as passed: BHSD memory, BSHD memory (cache_layout='bshd') or BSHD seen through transpose."""
        layout = self.case.cache_layout
        if layout == "bhsd":
            return t.clone().to(device)
        bshd = t.transpose(1, 2).contiguous().to(device)
        return bshd if layout == "bshd" else bshd.transpose(1, 2)

    def cache_as_bhsd(self, t):
        return t.transpose(1, 2) if self.case.cache_layout == "bshd" else t

    def kwargs(self):
        c = self.case
        return dict(page_table=self.page_table, seq_len_kv=self.lens, k_new=self.k_new, v_new=self.v_new,
                    causal=c.causal, window=c.window, softcap=c.softcap, alibi=c.alibi,
                    cache_layout="bshd" if c.cache_layout == "bshd" else "bhsd", num_splits=c.num_splits)

    def reference(self, q, dtype):
        c = self.case
        return attention_reference(q.cpu(), self.k_dense, self.v_dense, causal=c.causal,
                                   causal_alignment="bottom_right", window=c.window, softcap=c.softcap,
                                   alibi=c.alibi, seq_len_kv=self.lens.cpu(), dtype=dtype)


def run_kv_case(case: KVCase, device, backend):
    gen = torch.Generator().manual_seed(case.seed)
    dt = case.torch_dtype
    built = Built(case, device, gen)
    q = guarded((case.b, case.h_q, case.s_q, case.d), dt, device, case.q_layout, gen)
    out = guarded((case.b, case.h_q, case.s_q, case.d_v), dt, device, case.q_layout, fill=None)
    msg = case.repro()
    for _ in range(2):   # the second run: cached compile, and an append that rewrites the same values
        out.view.fill_(NAN)
        _, stats = attention_with_kvcache(q.view, built.k_cache, built.v_cache, out=out.view, return_stats=True,
                                          backend=backend, **built.kwargs())
    gold, gold_lse = built.reference(q.view, torch.float64)
    base, _ = built.reference(q.view, dt)
    assert_error_within(out.view.cpu(), gold, base, msg=msg)
    assert_lse_close(stats, gold_lse, tol=2e-3, msg=msg)
    q.check_untouched(f"q. {msg}")
    out.check_untouched(f"out. {msg}")
    for name, got, want in (("k_cache", built.k_cache, built.k_expected), ("v_cache", built.v_cache, built.v_expected)):
        torch.testing.assert_close(built.cache_as_bhsd(got).cpu(), want, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{name} after the call: {m}. {msg}")
    return built, q, out


N_CASES = 40


@pytest.mark.parametrize("seed", range(N_CASES), ids=lambda s: f"case{s}")
def test_kvcache_random(seed, target):
    device, backend = target
    run_kv_case(random_kv_case(seed, gpu=device == "cuda"), device, backend)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_every_block_size_and_group(page_size, group, target):
    """Every page size against every GQA ratio: ragged lengths 1, a page boundary +- 1, a long one."""
    device, backend = target
    long = max(300 if device == "cuda" else 140, page_size + 20)
    lens = (1, page_size + 1, page_size - 1, long)
    pages = -(-long // page_size)
    case = KVCase(seed=500 + page_size + group, b=4, h_q=2 * group, h_kv=2, s_q=1, d=64, d_v=64,
                  page_size=page_size, pages=pages, s_max=pages * page_size, lens=lens,
                  dtype="float16" if device == "cuda" else "float32", cache_layout="view")
    run_kv_case(case, device, backend)


@pytest.mark.parametrize("page_size", [0, 8, 16, 32], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("append", [False, True])
def test_prefill_uses_the_tiled_kernel(page_size, append, target):
    """Prefill (s_q * group > 64 query rows per kv head) runs the forward kernel on the cache in place:
    ragged lengths (one shorter than s_q: its first rows see no key), shuffled pages, NaN past lengths."""
    device, backend = target
    s_q, long = 40, 150
    lens = (long, 60, 20 if not append else s_q)
    pages = -(-long // page_size) if page_size else 0
    case = KVCase(seed=900 + page_size + append, b=3, h_q=4, h_kv=2, s_q=s_q, d=32, d_v=32,
                  page_size=page_size, pages=pages, s_max=pages * page_size if page_size else long + 3,
                  lens=lens, dtype="float16", cache_layout="view", append=append)
    run_kv_case(case, device, backend)


def _same_data_contiguous(built: Built, device):
    """The paged case's logical cache as a contiguous [b, h, cap, d] tensor (NaN where the paged one is)."""
    c = built.case
    table = built.page_table.cpu().long()
    table = torch.where(table < 0, 0, table)
    dense = []
    for t in (built.k_cache, built.v_cache):
        t = built.cache_as_bhsd(t).cpu()
        dense.append(t[table].permute(0, 2, 1, 3, 4).reshape(c.b, c.h_kv, c.pages * c.page_size, -1).to(device))
    return dense


@pytest.mark.parametrize("rows", ["int32", "int64"])
@pytest.mark.parametrize("page_size,num_splits", [(16, 1), (64, 3), (256, 2)])
def test_paged_bitwise_equals_contiguous(page_size, num_splits, rows, target, monkeypatch):
    """Same data, same tiles and splits: the paged kernel only reads other addresses, so the bits agree; with the
    key rows' offsets in int32 and in int64 (the kernel's ROWS32, forced either way: ``decode._rows32`` picks)."""
    from fusedattn.backends.triton import decode
    device, backend = target
    monkeypatch.setattr(decode, "_rows32", lambda *_: rows == "int32")
    long = 2000 if device == "cuda" else 130
    pages = -(-long // page_size)
    case = KVCase(seed=700 + page_size + num_splits, b=3, h_q=8, h_kv=2, s_q=2, d=64, d_v=64, page_size=page_size,
                  pages=pages, s_max=pages * page_size, lens=(long, 7, pages * page_size),
                  dtype="float16" if device == "cuda" else "float32", num_splits=num_splits)
    gen = torch.Generator().manual_seed(case.seed)
    built = Built(case, device, gen)
    q = torch.randn(case.b, case.h_q, case.s_q, case.d, generator=gen).to(device, case.torch_dtype)
    k, v = _same_data_contiguous(built, device)
    dense_out, dense_stats = attention_with_kvcache(q, k, v, seq_len_kv=built.lens, num_splits=num_splits,
                                                    return_stats=True, backend=backend)
    paged_out, paged_stats = attention_with_kvcache(q, built.k_cache, built.v_cache, page_table=built.page_table,
                                                    seq_len_kv=built.lens, num_splits=num_splits, return_stats=True,
                                                    backend=backend)
    assert torch.equal(dense_out, paged_out), f"paged != contiguous (max diff " \
        f"{(dense_out.float() - paged_out.float()).abs().max().item():.3e}). {case.repro()}"
    assert torch.equal(dense_stats, paged_stats)
    gold, _ = built.reference(q, torch.float64)
    base, _ = built.reference(q, case.torch_dtype)
    assert_error_within(paged_out.cpu(), gold, base, msg=case.repro())


def test_matches_functional_attention(target):
    """The promise of the docstring: attention(q, K, V, causal bottom-right, seq_len_kv) on the dense cache."""
    import fusedattn
    device, backend = target
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 3, 64, generator=gen).to(device)
    k = torch.randn(2, 2, 70, 64, generator=gen).to(device)
    v = torch.randn(2, 2, 70, 64, generator=gen).to(device)
    lens = torch.tensor([70, 2], dtype=torch.int32, device=device)     # the second: token 0 sees nothing
    got, got_lse = attention_with_kvcache(q, k, v, seq_len_kv=lens, return_stats=True, backend=backend)
    want, want_lse = fusedattn.attention(q.cpu(), k.cpu(), v.cpu(), causal=True, causal_alignment="bottom_right",
                                         seq_len_kv=lens.cpu(), return_stats=True, backend="cpu")
    got, got_lse = got.cpu(), got_lse.cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    assert (got[1, :, 0] == 0).all() and (got_lse[1, :, 0] == float("-inf")).all(), \
        "a token with no key must give output 0, stats -inf"


@pytest.mark.parametrize("kw", [dict(causal=False), dict(window=(5, 0)), dict(softcap=1.5), dict(alibi=True),
                                dict(attn_scale=0.3), dict(alibi="tensor")], ids=lambda kw: next(iter(kw)))
def test_options_matter(kw, target):
    """Each option changes the output, and each result equals the reference."""
    device, backend = target
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 4, 32, generator=gen)
    k = torch.randn(2, 2, 40, 32, generator=gen)
    v = torch.randn(2, 2, 40, 32, generator=gen)
    lens = torch.tensor([40, 23], dtype=torch.int32)
    if kw.get("alibi") == "tensor":
        kw = dict(alibi=torch.rand(4, generator=gen))
    dev_kw = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    plain = attention_with_kvcache(q.to(device), k.to(device), v.to(device), seq_len_kv=lens.to(device),
                                   backend=backend)
    got = attention_with_kvcache(q.to(device), k.to(device), v.to(device), seq_len_kv=lens.to(device), backend=backend,
                                 num_splits=2, **dev_kw)
    ref_kw = dict(kw)
    ref_kw.setdefault("causal", True)
    gold, _ = attention_reference(q, k, v, causal_alignment="bottom_right", seq_len_kv=lens, **ref_kw)
    assert (got.cpu() - plain.cpu()).abs().max() > 1e-3, f"{kw} had no effect"
    assert (got.cpu().double() - gold).abs().max() < 1e-4, f"{kw} wrong"


def test_splits_agree_and_empty_splits(target):
    """More splits than key blocks (empty splits), a zero-length sequence, and a cache of one key."""
    device, backend = target
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 4, 1, 64, generator=gen).to(device)
    k = torch.randn(3, 1, 50, 64, generator=gen).to(device)
    v = torch.randn(3, 1, 50, 64, generator=gen).to(device)
    lens = torch.tensor([50, 0, 1], dtype=torch.int32, device=device)
    gold, gold_lse = attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=True, causal_alignment="bottom_right",
                                         seq_len_kv=lens.cpu())
    for splits in (1, 3, 16):
        o, lse = attention_with_kvcache(q, k, v, seq_len_kv=lens, num_splits=splits, return_stats=True, backend=backend)
        assert (o.cpu().double() - gold).abs().max() < 1e-5, f"num_splits={splits}"
        assert_lse_close(lse, gold_lse, tol=1e-4, msg=f"num_splits={splits}")
        assert (o[1] == 0).all() and (lse[1] == float("-inf")).all(), "an empty sequence gives 0 and stats -inf"


def test_cudnn_page_table_shape_and_defaults(target):
    """[b, 1, max_blocks, 1] tables, no seq_len_kv (the whole cache), s_q = 0."""
    device, backend = target
    gen = torch.Generator().manual_seed(10)
    b, h, p, m, d = 2, 2, 16, 3, 32
    container = torch.randn(b * m, h, p, d, generator=gen).to(device)
    table = torch.arange(b * m, dtype=torch.int32).flip(0).view(b, 1, m, 1).to(device)
    q = torch.randn(b, h, 1, d, generator=gen).to(device)
    got = attention_with_kvcache(q, container, container, page_table=table, backend=backend)
    dense = container[table.view(b, m).long()].permute(0, 2, 1, 3, 4).reshape(b, h, m * p, d)
    gold, _ = attention_reference(q.cpu(), dense.cpu(), dense.cpu(), causal=True, causal_alignment="bottom_right")
    assert (got.cpu().double() - gold).abs().max() < 1e-5
    empty = attention_with_kvcache(q[:, :, :0], container, container, page_table=table, backend=backend)
    assert empty.shape == (b, h, 0, d)


# ----------------------------------------------------------------------------- bad input

def _small(device, paged=True):
    gen = torch.Generator().manual_seed(11)
    b, h, p, m, d = 2, 2, 16, 4, 32
    q = torch.randn(b, 2 * h, 2, d, generator=gen).to(device)
    if paged:
        k = torch.randn(b * m, h, p, d, generator=gen).to(device)
        v = torch.randn(b * m, h, p, d, generator=gen).to(device)
        table = torch.randperm(b * m, generator=gen).view(b, m).to(torch.int32).to(device)
    else:
        k = torch.randn(b, h, m * p, d, generator=gen).to(device)
        v = torch.randn(b, h, m * p, d, generator=gen).to(device)
        table = None
    lens = torch.tensor([50, 20], dtype=torch.int32, device=device)
    k_new = torch.randn(b, h, 2, d, generator=gen).to(device)
    return q, k, v, table, lens, k_new


def _lens(device, *vals):
    return torch.tensor(vals, dtype=torch.int32, device=device)


BAD_VALUES = {
    # name: (what to change, expected error class, words the message must contain)
    "page_out_of_range": (lambda t, L, d: dict(page_table=t.clone().index_fill_(1, torch.tensor([1], device=d), 99)),
                          InvalidArgumentError, ["page_table[", "99", "out of range"]),
    "page_negative": (lambda t, L, d: dict(page_table=t.clone().index_fill_(1, torch.tensor([0], device=d), -3)),
                      InvalidArgumentError, ["page_table[", "-3"]),
    "len_beyond_table": (lambda t, L, d: dict(seq_len_kv=_lens(d, 65, 20)), InvalidArgumentError,
                         ["seq_len_kv[0] = 65", "64 keys"]),
    "len_negative": (lambda t, L, d: dict(seq_len_kv=_lens(d, 50, -1)), InvalidArgumentError,
                     ["seq_len_kv[1] = -1", "negative"]),
    "len_without_room_for_new": (lambda t, L, d: dict(seq_len_kv=_lens(d, 50, 1), append=True), InvalidArgumentError,
                                 ["seq_len_kv[1] = 1", "s_q = 2", "INCLUDING"]),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_bad_values_raise(name, target):
    """Values only the device knows: validate=True (the default) raises, naming the entry."""
    device, backend = target
    q, k, v, table, lens, k_new = _small(device)
    make, err, words = BAD_VALUES[name]
    kw = dict(page_table=table, seq_len_kv=lens)
    kw.update(make(table, lens, device))
    if kw.pop("append", False):
        kw.update(k_new=k_new, v_new=k_new)
    k0 = k.clone()
    with pytest.raises(err) as info:
        attention_with_kvcache(q, k, v, backend=backend, **kw)
    for w in words:
        assert w in str(info.value), f"message {str(info.value)!r} lacks {w!r}"
    assert torch.equal(k, k0), "a rejected call must not have appended anything"


def test_contiguous_len_beyond_cache(target):
    device, backend = target
    q, k, v, _, _, _ = _small(device, paged=False)
    with pytest.raises(InvalidArgumentError, match=r"seq_len_kv\[1\] = 65 is beyond the cache: .*s_max = 64"):
        attention_with_kvcache(q, k, v, seq_len_kv=_lens(device, 3, 65), backend=backend)


def test_unused_slots_may_hold_garbage(target):
    """Slots past a sequence's pages are not checked, nor read (vLLM pads tables with -1 or junk)."""
    device, backend = target
    q, k, v, table, lens, _ = _small(device)
    junk = table.clone()
    junk[1, 2:] = torch.tensor([-1, 10 ** 6], dtype=torch.int32)      # sequence 1 has 20 keys: slots 0, 1
    a = attention_with_kvcache(q, k, v, page_table=junk, seq_len_kv=lens, backend=backend)
    b = attention_with_kvcache(q, k, v, page_table=table, seq_len_kv=lens, backend=backend)
    assert torch.equal(a, b)


BAD_ARGS = [
    # (name, change, error class, words)
    ("page_table int64", lambda a: a.update(page_table=a["page_table"].long()), InvalidTypeError,
     ["page_table", "int32"]),
    ("page_table 3-D", lambda a: a.update(page_table=a["page_table"][:, None]), InvalidArgumentError,
     ["page_table", "[b, max_blocks]"]),
    ("page_table batch", lambda a: a.update(page_table=a["page_table"][:1]), InvalidArgumentError,
     ["page_table", "b = 2"]),
    ("seq_len float", lambda a: a.update(seq_len_kv=a["seq_len_kv"].float()), InvalidTypeError,
     ["seq_len_kv", "int32"]),
    ("seq_len shape", lambda a: a.update(seq_len_kv=a["seq_len_kv"][:1]), InvalidArgumentError, ["seq_len_kv", "[2]"]),
    ("container 3-D", lambda a: a.update(k_cache=a["k_cache"][0]), InvalidArgumentError,
     ["k_cache", "4-D", "num_blocks"]),
    ("container dtype", lambda a: a.update(k_cache=a["k_cache"].half()), InvalidTypeError, ["k_cache", "dtype"]),
    ("k/v containers differ", lambda a: a.update(v_cache=a["v_cache"][:, :, :8]), InvalidArgumentError,
     ["k_cache and v_cache"]),
    ("head dim", lambda a: a.update(k_cache=a["k_cache"][..., :16]), InvalidArgumentError, ["head dim of k_cache"]),
    ("gqa", lambda a: a.update(q=a["q"][:, :3]), InvalidArgumentError, ["multiple", "kv heads"]),
    ("k_new alone", lambda a: a.update(k_new=a["k_new"]), InvalidArgumentError, ["k_new and v_new"]),
    ("k_new shape", lambda a: a.update(k_new=a["k_new"][:, :, :1], v_new=a["k_new"]), InvalidArgumentError,
     ["k_new", "[b, h_kv, s_q, d]"]),
    ("layout", lambda a: a.update(cache_layout="nhd"), InvalidArgumentError, ["cache_layout"]),
    ("num_splits", lambda a: a.update(num_splits=0), InvalidArgumentError, ["num_splits"]),
    ("backend", lambda a: a.update(backend="cuda"), InvalidArgumentError, ["backend"]),
    ("q not a tensor", lambda a: a.update(q=[1.0]), InvalidTypeError, ["q must be a torch.Tensor"]),
    ("contiguous batch", lambda a: a.update(page_table=None, k_cache=a["k_cache"][:3], v_cache=a["v_cache"][:3]),
     InvalidArgumentError, ["k_cache has batch 3", "page_table="]),
]


@pytest.mark.parametrize("name,change,err,words", BAD_ARGS, ids=[x[0] for x in BAD_ARGS])
def test_bad_arguments_raise(name, change, err, words, target):
    device, backend = target
    q, k, v, table, lens, k_new = _small(device)
    args = dict(q=q, k_cache=k, v_cache=v, page_table=table, seq_len_kv=lens, backend=backend, k_new=k_new)
    change(args)
    if name != "k_new alone" and name != "k_new shape":
        args.pop("k_new")
    with pytest.raises(err) as info:
        attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    for w in words:
        assert w in str(info.value), f"message {str(info.value)!r} lacks {w!r}"


def test_validate_false_never_reads_or_writes_out_of_bounds(target):
    """Garbage lengths and pages with validate=False: finite output, nothing outside the caches touched.

    The containers sit inside NaN-filled buffers, every page of them finite: a read outside a
    container shows up as NaN in the output, a write outside it as a non-NaN margin.
    """
    device, backend = target
    gen = torch.Generator().manual_seed(12)
    b, h, p, m, d, s_q = 3, 2, 16, 4, 32, 2
    shape = (b * m, h, p, d)
    n = math.prod(shape)
    margin = 4096
    bufs = []
    for _ in range(2):
        buf = torch.full((n + 2 * margin,), NAN)
        buf[margin:margin + n] = torch.randn(n, generator=gen)
        bufs.append(buf.to(device))
    k, v = (buf[margin:margin + n].view(shape) for buf in bufs)
    q = torch.randn(b, 2 * h, s_q, d, generator=gen).to(device)
    table = torch.tensor([[0, 1, 2, 3], [10 ** 6, -5, 2 ** 31 - 1, -2 ** 31], [4, 5, 6, 7]], dtype=torch.int32,
                         device=device)
    new = torch.randn(b, h, s_q, d, generator=gen).to(device)
    for lens in ((10 ** 6, 30, -7), (2 ** 31 - 1, -2 ** 31, 1), (64, 64, 0)):
        lens = _lens(device, *lens)
        out = attention_with_kvcache(q, k, v, page_table=table, seq_len_kv=lens, k_new=new, v_new=new,
                                     validate=False, backend=backend)
        assert torch.isfinite(out).all(), f"a read outside the container (lens {lens.tolist()})"
        out = attention_with_kvcache(q, k, v, seq_len_kv=lens, validate=False, backend=backend,
                                     page_table=table, num_splits=3)
        assert torch.isfinite(out).all()
    for buf in bufs:
        assert torch.isnan(buf[:margin]).all() and torch.isnan(buf[margin + n:]).all(), "a write outside the cache"
    # contiguous cache too
    kc = bufs[0][margin:margin + b * h * 40 * d].view(b, h, 40, d)
    out = attention_with_kvcache(q, kc, kc, seq_len_kv=_lens(device, 10 ** 6, -3, 40), k_new=new, v_new=new,
                                 validate=False, backend=backend)
    assert torch.isfinite(out).all()
    assert torch.isnan(bufs[0][:margin]).all() and torch.isnan(bufs[0][margin + n:]).all()


def test_int64_lengths_accepted_and_unclamped_errors(target):
    device, backend = target
    q, k, v, table, lens, _ = _small(device)
    a = attention_with_kvcache(q, k, v, page_table=table, seq_len_kv=lens.long(), backend=backend)
    b = attention_with_kvcache(q, k, v, page_table=table, seq_len_kv=lens, backend=backend)
    assert torch.equal(a, b)
    with pytest.raises(InvalidArgumentError, match="beyond the cache"):
        attention_with_kvcache(q, k, v, page_table=table, seq_len_kv=lens.long() + 2 ** 40, backend=backend)


def test_fp64_needs_cpu_path():
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    out = attention_with_kvcache(q, k, k, backend="cpu")
    assert out.dtype == torch.float64
    from fusedattn.plan import interpreting
    if interpreting():
        with pytest.raises(NotSupportedError, match="float64"):
            attention_with_kvcache(q, k, k, backend="triton")


def test_num_splits_heuristic():
    from fusedattn.backends.triton.decode import num_splits_heuristic
    assert num_splits_heuristic(64 * 8, 4096 // 64) == 1          # the machine is full
    assert num_splits_heuristic(8, 4) == 1                        # a short cache is not split
    s = num_splits_heuristic(1 * 8, 16384 // 64)                  # b 1, 8 kv heads: split to fill 264 slots
    assert 16 <= s <= 64
    assert num_splits_heuristic(2 * 8, 16384 // 64) > 1


# ----------------------------------------------------------------------------- GPU (skipped without CUDA)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
@pytest.mark.parametrize("page_size", [0, 16, 64, 256], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("s_q", [1, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_decode_large(page_size, s_q, dtype):
    """Serving sizes: b 8, 32/8 heads, ragged caches up to 9000 keys, d 128, appending."""
    lens = tuple(max(n, s_q) for n in (9000, 1, 4096, 17, 8191, 3000, 64, 2))
    pages = -(-9000 // page_size) if page_size else 0
    case = KVCase(seed=900 + page_size + s_q, b=8, h_q=32, h_kv=8, s_q=s_q, d=128, d_v=128, page_size=page_size,
                  pages=pages, s_max=pages * page_size if page_size else 9000, lens=lens, dtype=dtype,
                  q_layout="bshd", cache_layout="view", append=True)
    run_kv_case(case, "cuda", "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_paged_bitwise_and_splits(page_size):
    """bf16 at bench-like sizes: paged == contiguous bit for bit, and forced splits agree with the heuristic."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    b, h_q, h_kv, s, d = 16, 32, 8, 4096, 128
    k = torch.randn(b, s, h_kv, d, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    v = torch.randn(b, s, h_kv, d, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    q = torch.randn(b, 1, h_q, d, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    lens = torch.randint(1, s + 1, (b,), device=dev, dtype=torch.int32, generator=gen)
    per = s // page_size
    table = torch.randperm(b * per, device=dev, generator=gen).to(torch.int32).view(b, per)
    kc = torch.empty(b * per, page_size, h_kv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    kc[table.view(-1).long()] = k.transpose(1, 2).reshape(b * per, page_size, h_kv, d)
    vc[table.view(-1).long()] = v.transpose(1, 2).reshape(b * per, page_size, h_kv, d)
    gold, _ = attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=True, causal_alignment="bottom_right",
                                  seq_len_kv=lens.cpu())
    base, _ = attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=True, causal_alignment="bottom_right",
                                  seq_len_kv=lens.cpu(), dtype=torch.bfloat16)
    for splits in (None, 1, 4, 16):
        dense = attention_with_kvcache(q, k, v, seq_len_kv=lens, num_splits=splits)
        paged = attention_with_kvcache(q, kc, vc, page_table=table, seq_len_kv=lens, num_splits=splits,
                                       cache_layout="bshd")
        assert torch.equal(dense, paged), f"num_splits={splits}"
        assert_error_within(paged.cpu(), gold, base, msg=f"num_splits={splits}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
def test_gpu_cuda_graph_capture_skips_validation():
    """validate=True does not sync inside a CUDA graph capture; replays follow new lengths."""
    dev = "cuda"
    q = torch.randn(4, 8, 1, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(64, 2, 64, 128, device=dev, dtype=torch.bfloat16)
    table = torch.randperm(64, device=dev).view(4, 16).to(torch.int32)
    lens = torch.tensor([1000, 5, 64, 1024], dtype=torch.int32, device=dev)
    out = torch.empty(4, 8, 1, 128, device=dev, dtype=torch.bfloat16)
    attention_with_kvcache(q, k, k, page_table=table, seq_len_kv=lens, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention_with_kvcache(q, k, k, page_table=table, seq_len_kv=lens, out=out)
    lens.copy_(torch.tensor([3, 900, 1, 77], dtype=torch.int32))
    graph.replay()
    want = attention_with_kvcache(q, k, k, page_table=table, seq_len_kv=lens)
    assert torch.equal(out, want)


def test_int32_rows_only_where_every_offset_fits():
    """``decode._offsets_fit_int32``: the largest element offset of a container (its shape and strides, any order)
    decides int32 key rows; one element past 2^31 - 1 does not fit (meta tensors: no memory). ``_rows32``: both
    caches must fit, and a paged 16-bit cache keeps int64 rows (measured faster, bench/NOTES.md 76)."""
    from fusedattn.backends.triton import decode
    small, big = torch.empty(4, 2, 16, 64, device="meta"), torch.empty(2 ** 17 + 1, 8, 16, 128, device="meta")
    assert decode._rows32(small, small, paged=True, kv_fp8=True) and decode._rows32(small, small, False, False)
    assert not decode._rows32(small, small, paged=True, kv_fp8=False)
    assert not decode._rows32(small, big, paged=False, kv_fp8=True)
    fits = torch.empty(2 ** 17, 8, 16, 128, device="meta")                   # 2^31 elements: last offset 2^31 - 1
    assert decode._offsets_fit_int32(fits)
    assert not decode._offsets_fit_int32(torch.empty(2 ** 17 + 1, 8, 16, 128, device="meta"))
    assert not decode._offsets_fit_int32(torch.empty(2 ** 17, 16, 8, 129, device="meta").transpose(1, 2)[..., :128])
    assert decode._offsets_fit_int32(fits.transpose(1, 2))                   # BHSD views of the same container
    assert decode._offsets_fit_int32(torch.empty(0, 8, 16, 128, device="meta"))


# ----------------------------------------------------------------------------- the problem door (planner routing)

def _lens_t(device, *vals):
    return torch.tensor(vals, dtype=torch.int32, device=device)


PROBLEM_KINDS = {
    "causal_top_left": lambda dev: dict(causal=True),
    "padded_bottom_right": lambda dev: dict(causal=True, causal_alignment="bottom_right",
                                            seq_len_q=_lens_t(dev, 3, 1), seq_len_kv=_lens_t(dev, 2, 37)),
    "window_top_left": lambda dev: dict(window=(4, 2), seq_len_kv=_lens_t(dev, 40, 9)),
    "alibi_softcap": lambda dev: dict(alibi=True, softcap=2.0, causal=True, causal_alignment="bottom_right",
                                      seq_len_kv=_lens_t(dev, 33, 40)),
    "paged_two_tables": lambda dev: dict(causal=True, causal_alignment="bottom_right", seq_len_kv=_lens_t(dev, 40, 17)),
}


@pytest.mark.parametrize("kind", list(PROBLEM_KINDS))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_problem_door(kind, num_splits, target):
    """decode.launch_decode_problem runs what make_problem describes (top-left too, padded queries, two tables)."""
    from fusedattn.backends.triton import decode
    from fusedattn.problem import make_problem
    device, backend = target
    if backend != "triton":
        pytest.skip("the Triton decode kernel only")
    gen = torch.Generator().manual_seed(13)
    b, h_q, h_kv, s_q, s_kv, d = 2, 8, 2, 3, 40, 32
    q = torch.randn(b, h_q, s_q, d, generator=gen).to(device)
    k = torch.randn(b, h_kv, s_kv, d, generator=gen).to(device)
    v = torch.randn(b, h_kv, s_kv, d, generator=gen).to(device)
    kw = PROBLEM_KINDS[kind](device)
    call_k, call_v, tables = k, v, {}
    if kind == "paged_two_tables":
        p_size, m = 8, s_kv // 8
        conts, tabs = [], []
        for t in (k, v):
            perm = torch.randperm(b * m + 2, generator=gen)[:b * m].view(b, m).to(torch.int32)
            cont = torch.full((b * m + 2, h_kv, p_size, d), NAN)
            pages = t.cpu().view(b, h_kv, m, p_size, d).permute(0, 2, 1, 3, 4).reshape(-1, h_kv, p_size, d)
            cont[perm.reshape(-1).long()] = pages
            conts.append(cont.to(device))
            tabs.append(perm.to(device))
        call_k, call_v = conts
        tables = dict(page_table_k=tabs[0], page_table_v=tabs[1])
    p, extras = make_problem(q, call_k, call_v, **kw, **tables)
    assert decode.decode_supports(p)
    out = torch.full((b, h_q, s_q, d), NAN, device=device)
    lse = torch.full((b, h_q, s_q), NAN, device=device)
    decode.launch_decode_problem(p, extras, q, call_k, call_v, out, lse, num_splits=num_splits)
    ref_kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    gold, gold_lse = attention_reference(q.cpu(), k.cpu(), v.cpu(), **ref_kw)
    assert (out.cpu().double() - gold).abs().max() < 1e-5, kind
    assert_lse_close(lse, gold_lse[..., 0], tol=1e-4, msg=kind)


@pytest.mark.parametrize("geom", [(4, 1, 64, "float16"), (8, 16, 64, "float16"), (2, 5, 256, "float16"),
                                  (4, 2, 128, "float32")],
                         ids=lambda g: "g{}sq{}d{}{}".format(g[0], g[1], g[2], g[3][5:]))
def test_gpu_tiles_under_interpreter(geom, target, monkeypatch):
    """The sm90 tile table's shapes (64/128-row, 64-key tiles), run by the interpreter on CPU."""
    from fusedattn.backends.triton import decode
    device, backend = target
    if device != "cpu" or backend != "triton":
        pytest.skip("interpreter only (the GPU runs these tiles anyway)")
    original = decode.decode_tiles
    monkeypatch.setattr(decode, "decode_tiles", lambda rows, d, dt, interpret, *rest: original(rows, d, dt, False, *rest))
    g, s_q, d, dtype = geom
    case = KVCase(seed=1200 + g + s_q, b=2, h_q=2 * g, h_kv=2, s_q=s_q, d=d, d_v=d, page_size=16, pages=9,
                  s_max=144, lens=(144, 30), dtype=dtype, num_splits=2, append=True)
    run_kv_case(case, device, backend)
