"""fusedattn as a Hugging Face transformers attention implementation (fusedattn.integrations.transformers).

Tiny random-initialized models built from configs (nothing downloaded), fp32 on CPU. Tolerance: the same
math in fp32 on both sides, only the summation order differs (fusedattn's CPU path is a chunked online
softmax, eager / SDPA one full softmax), which moves logits by a few float32 ulps (measured <= ~1e-6 of
their magnitude); 1e-4 relative to the largest reference value leaves two orders of margin and still
catches any semantic error (a wrong mask, window, scale or softcap moves logits by >= 1e-2 relative here,
and the tests below assert that the window and softcap do).
"""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedattn  # noqa: E402
from fusedattn.integrations import transformers as fa_hf  # noqa: E402
from transformers import (AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig,  # noqa: E402
                          Qwen2Config)
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

fa_hf.register()

RTOL = 1e-4
VOCAB, SEQ = 100, 16
# init std 0.2 (not the default 0.02) so scores are large enough that masks, windows and softcap
# change the logits by a lot (with std 0.02 attention is nearly uniform and a wrong mask could hide)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(name, **over):
    kw = dict(COMMON, **over)
    if name == "llama":
        return LlamaConfig(**kw)
    if name == "qwen2":
        return Qwen2Config(**kw)
    if name == "mistral":
        return MistralConfig(**dict(dict(sliding_window=4), **kw))
    if name == "gemma2":
        # softcap small enough to change the scores (default 50 would be a no-op at these sizes);
        # query_pre_attn_scalar != head_dim checks that `scaling` is honoured
        return Gemma2Config(**dict(dict(head_dim=16, sliding_window=4, attn_logit_softcapping=2.0,
                                        query_pre_attn_scalar=32, final_logit_softcapping=None), **kw))
    raise ValueError(name)


MODELS = ["llama", "qwen2", "mistral", "gemma2"]
# Gemma 2 does not support sdpa in transformers (softcap): its "sdpa" comparison is against eager
REFS = {"llama": ("eager", "sdpa"), "qwen2": ("eager", "sdpa"), "mistral": ("eager", "sdpa"),
        "gemma2": ("eager",)}


def _model(name, impl="fusedattn", **over):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name, **over), attn_implementation=impl,
                                             dtype=torch.float32)
    assert model.config._attn_implementation == impl
    return model.eval()


def _ids(b=2, s=SEQ, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (b, s), generator=g)


def _max_err(got, ref):
    return (got - ref).abs().max().item()


def _assert_close(got, ref, what=""):
    err, scale = _max_err(got, ref), max(ref.abs().max().item(), 1e-6)
    assert err <= RTOL * scale, f"{what}: max error {err:.3g} > {RTOL} * {scale:.3g}"


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_eager_and_sdpa(name):
    model = _model(name)
    ids = _ids()
    with torch.no_grad():
        got = model(ids).logits
        for ref_impl in REFS[name]:
            model.set_attn_implementation(ref_impl)
            ref = model(ids).logits
            _assert_close(got, ref, f"{name} fusedattn vs {ref_impl}")
        model.set_attn_implementation("fusedattn")
        assert model.config._attn_implementation == "fusedattn"
        _assert_close(model(ids).logits, got, "after switching back")


@pytest.mark.parametrize("name", MODELS)
def test_loss_gradients_match_eager(name):
    ids = _ids()
    # and a left-padded batch (bool mask, fully masked pad rows), pad positions left out of the loss
    pids, pmask = _left_padded([_ids(1, SEQ, seed=6)[0], _ids(1, 10, seed=7)[0]])
    # labels shift by one: the last pad position predicts the first real token, and a fully masked
    # row is implementation-defined (eager: uniform weights, fusedattn and SDPA: 0), so leave it out too
    labels = pids.masked_fill(pmask.cumsum(-1) <= 1, -100)
    grads = {}
    for impl in ("fusedattn", "eager"):
        model = _model(name, impl).train()          # attention_dropout is 0: train mode, no randomness
        loss = model(ids, labels=ids).loss + model(pids, attention_mask=pmask, labels=labels).loss
        loss.backward()
        grads[impl] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    _assert_close(grads["fusedattn"][0], grads["eager"][0], "loss")
    assert grads["fusedattn"][1].keys() == grads["eager"][1].keys()
    for n, g in grads["eager"][1].items():
        _assert_close(grads["fusedattn"][1][n], g, f"{name} grad {n}")


def _left_padded(seqs):
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, s - len(x):] = x
        mask[i, s - len(x):] = 1
    return ids, mask


@pytest.mark.parametrize("name", MODELS)
def test_left_padded_batch_matches_single_sequences(name):
    model = _model(name)
    full = _ids(3, SEQ, seed=2)
    lens = [SEQ, 11, 6]
    seqs = [full[i, :n] for i, n in enumerate(lens)]
    ids, mask = _left_padded(seqs)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation("eager")
        padded_eager = model(ids, attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation("fusedattn")
        for i, x in enumerate(seqs):
            alone = model(x[None]).logits[0]
            _assert_close(padded[i, SEQ - lens[i]:], alone, f"{name} padded row {i} vs alone")
            _assert_close(padded[i, SEQ - lens[i]:], padded_eager[i, SEQ - lens[i]:], f"{name} padded vs eager")


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_matches_sdpa(name):
    ref_impl = REFS[name][-1]
    model = _model(name)
    ids, mask = _left_padded([_ids(1, 9, seed=3)[0], _ids(1, 5, seed=4)[0]])
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        outs = {}
        for impl in ("fusedattn", ref_impl):
            model.set_attn_implementation(impl)
            outs[impl] = (model.generate(ids, attention_mask=mask, **gen),     # padded batch: masks
                          model.generate(ids[:1], **gen),                      # one prompt: mask-free path
                          # static cache: the prefill's keys include empty future slots (s_kv > s_q)
                          # and transformers passes no mask: top-left causal is the right alignment
                          model.generate(ids[:1], cache_implementation="static", **gen))
    for a, b in zip(outs["fusedattn"], outs[ref_impl]):
        assert a.shape[-1] == b.shape[-1]
        assert torch.equal(a, b), f"{name}: fusedattn {a.tolist()} != {ref_impl} {b.tolist()}"


def test_mistral_sliding_window_matters():
    ids = _ids()
    with torch.no_grad():
        windowed = _model("mistral", sliding_window=4)(ids).logits
        unwindowed = _model("mistral", sliding_window=None)(ids).logits
        eager = _model("mistral", "eager", sliding_window=4)(ids).logits
    _assert_close(windowed, eager, "mistral window 4 vs eager")
    assert _max_err(windowed, unwindowed) > 100 * RTOL * unwindowed.abs().max().item(), \
        "the sliding window changed nothing: the test could not see a missing window"


def test_gemma2_softcap_matters():
    ids = _ids()
    with torch.no_grad():
        capped = _model("gemma2")(ids).logits
        uncapped = _model("gemma2", attn_logit_softcapping=None)(ids).logits
        eager = _model("gemma2", "eager")(ids).logits
    _assert_close(capped, eager, "gemma2 softcap vs eager")
    assert _max_err(capped, uncapped) > 100 * RTOL * uncapped.abs().max().item(), \
        "the softcap changed nothing: the test could not see a missing softcap"


def test_dropout_in_training_only():
    ids = _ids()
    model = _model("llama", attention_dropout=0.5)
    with torch.no_grad():
        eval_out = model(ids).logits
        model.set_attn_implementation("eager")
        _assert_close(eval_out, model(ids).logits, "eval mode: no dropout")
        model.set_attn_implementation("fusedattn")
        model.train()
        torch.manual_seed(5)
        train_a = model(ids).logits
        torch.manual_seed(5)
        train_b = model(ids).logits
    assert _max_err(train_a, eval_out) > 1e-2 * eval_out.abs().max().item(), "dropout was not applied in training"
    assert torch.equal(train_a, train_b), "dropout is not reproducible under torch.manual_seed"


class _Module(torch.nn.Module):
    def __init__(self, is_causal=True, groups=2):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups


def _qkv(s_q, s_kv, b=2, h_q=4, h_kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h_q, s_q, d, generator=g), torch.randn(b, h_kv, s_kv, d, generator=g),
            torch.randn(b, h_kv, s_kv, d, generator=g))


@pytest.mark.parametrize("case", ["self_causal", "decode_one_query", "static_prefill", "not_causal",
                                  "bool_mask", "float_mask", "mask_longer_than_keys"])
def test_attention_function_matches_transformers_sdpa(case):
    """The function itself against transformers' sdpa integration, case by case (what the mask interface
    can hand over: None where is_causal suffices, bool keep-masks, additive float masks)."""
    s_q, s_kv = {"decode_one_query": (1, 9), "static_prefill": (5, 12)}.get(case, (7, 7))
    q, k, v = _qkv(s_q, s_kv)
    module = _Module(is_causal=case != "not_causal")
    mask = None
    if case in ("bool_mask", "float_mask", "mask_longer_than_keys"):
        keep = torch.ones(2, 1, s_q, s_kv + (3 if case == "mask_longer_than_keys" else 0), dtype=torch.bool).tril()
        keep[1, :, :, :2] = False                   # left padding of batch entry 1
        keep[1, :, :2, 2] = True                    # so no row is fully masked
        mask = keep if case != "float_mask" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    kw = dict(scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask if case != "mask_longer_than_keys" else mask[..., :s_kv], **kw)
    got, weights = fa_hf.attention_forward(module, q, k, v, mask, **kw)
    assert weights is None
    assert got.shape == (2, s_q, 4, 16)
    _assert_close(got, ref, case)


@pytest.mark.parametrize("sliding_window", [1, 3, 6])
def test_sliding_window_without_mask_keeps_transformers_count(sliding_window):
    """No mask given: transformers' convention keeps keys kv > q - sliding_window (sliding_window keys,
    the query's own included)."""
    q, k, v = _qkv(10, 10)
    got, _ = fa_hf.attention_forward(_Module(), q, k, v, None, scaling=0.25, sliding_window=sliding_window)
    i = torch.arange(10)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
    ref, _ = sdpa_attention_forward(_Module(), q, k, v, keep[None, None], scaling=0.25)
    _assert_close(got, ref, f"sliding_window={sliding_window}")


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "bool_mask"])
def test_sinks_s_aux_match_gpt_oss_eager(masked):
    """``s_aux`` (GPT-OSS's per-head sinks) goes in as fusedattn's sink: the function against GPT-OSS's
    eager formula (the sink concatenated to the scores, its column dropped after the softmax), and the
    sink's gradient."""
    q, k, v = _qkv(7, 7)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril() if masked else None
    got, _ = fa_hf.attention_forward(_Module(), q, k, v, mask, scaling=0.3, s_aux=sink)
    kr, vr = (t.repeat_interleave(2, dim=1) for t in (k, v))
    scores = q @ kr.transpose(-1, -2) * 0.3
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    ref_sink = sink.detach().clone().requires_grad_()
    full = torch.cat([scores, ref_sink.view(1, 4, 1, 1).expand(2, 4, 7, 1)], dim=-1).softmax(-1)
    ref = (full[..., :7] @ vr).transpose(1, 2)
    _assert_close(got, ref, "s_aux")
    g = torch.randn_like(ref)
    _assert_close(torch.autograd.grad(got, sink, g)[0], torch.autograd.grad(ref, ref_sink, g)[0], "dsink")


HAS_GPT_OSS = hasattr(transformers, "GptOssConfig")


def _gpt_oss(impl):
    """A tiny random GPT-OSS (sinks on every layer, alternating sliding and full attention, MoE)."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**dict(COMMON, intermediate_size=64, head_dim=16, num_local_experts=4,
                                           num_experts_per_tok=2, sliding_window=4))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:      # sinks large enough to matter (init std 0.2 gives ~0.1)
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, layer.self_attn.sinks.numel()))
    return model.eval()


@pytest.mark.skipif(not HAS_GPT_OSS, reason="the installed transformers has no GptOss")
def test_gpt_oss_logits_gradients_generate_match_eager():
    """GPT-OSS (sinks) has no sdpa path in transformers: fusedattn against eager for logits, the loss
    gradients (the sinks' included) and greedy generate() of a left-padded batch."""
    ids = _ids()
    grads, logits = {}, {}
    for impl in ("fusedattn", "eager"):
        model = _gpt_oss(impl).train()
        out = model(ids, labels=ids)
        out.loss.backward()
        logits[impl] = out.logits.detach()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_close(logits["fusedattn"], logits["eager"], "gpt_oss logits")
    assert any("sinks" in n for n in grads["eager"]) and grads["fusedattn"].keys() == grads["eager"].keys()
    for n, g in grads["eager"].items():
        _assert_close(grads["fusedattn"][n], g, f"gpt_oss grad {n}")

    model = _gpt_oss("fusedattn")
    pids, pmask = _left_padded([_ids(1, 9, seed=3)[0], _ids(1, 5, seed=4)[0]])
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(pids, attention_mask=pmask, **gen)
        model.set_attn_implementation("eager")
        want = model.generate(pids, attention_mask=pmask, **gen)
        # the sinks matter: without them the logits move
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        model.set_attn_implementation("fusedattn")
        assert _max_err(model(ids).logits, logits["eager"]) > 1e-3
    assert torch.equal(got, want), f"gpt_oss: fusedattn {got.tolist()} != eager {want.tolist()}"


def test_importing_fusedattn_does_not_import_transformers():
    code = ("import sys, fusedattn, fusedattn.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported'; "
            "import fusedattn.integrations.transformers; assert 'transformers' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_packed_row_with_boundaries_matches_sequences_one_by_one(name, monkeypatch):
    """Packed sequences with their boundaries (``cu_seq_lens_q/k``, ``max_length_q/k``: what
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds) run fusedattn's varlen path, each
    sequence attending only to itself (window and softcap included), with no [s, s] mask; logits equal
    the sequences run one by one."""
    import fusedattn.integrations.transformers as integration
    calls = []
    real = integration.attention_varlen
    monkeypatch.setattr(integration, "attention_varlen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = _model(name)
    lens = (9, 16, 5)
    ids = _ids(1, sum(lens), seed=7)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    cu = torch.tensor([0, 9, 25, 30], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=16, max_length_k=16,
                       use_cache=False).logits
        single = torch.cat([model(ids[:, a:b], use_cache=False).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
    assert calls, "the packed boundaries did not reach fusedattn's varlen path"
    _assert_close(packed, single, f"{name} packed with boundaries vs one by one")
