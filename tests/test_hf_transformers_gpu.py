"""fusedattn as a Hugging Face transformers attention implementation, on the GPU in bf16 (issue 26's
model table; the fp32 CPU half is test_hf_transformers.py).

Tiny random-initialized models built from configs (nothing downloaded): llama, qwen2 (GQA), mistral
(sliding window), gemma2 (softcap, sliding window, a `scaling` other than 1/sqrt(d)) and gpt_oss (sinks,
where the installed transformers has it), 2 layers, 4 query / 2 key-value heads of head dim 64, so the
real GPU kernels run (bool-mask, causal, window, softcap and sink variants, forward and backward).
Tested: logits (a dense and a left-padded batch), loss gradients, greedy generate() with the dynamic
and the static cache, and a packed batch against its sequences one by one.

Tolerance (FlashAttention's rule): bf16 is compared with what bf16 can do, not with a fixed number.
The reference is the same weights in float32 with attn_implementation="eager" on the same device
(TF32 off; not float64: transformers' eager softmax runs in float32, where float64's mask minimum is
-inf, so a fully masked pad row turns NaN and spreads to the real positions through its values);
fusedattn in bf16 must be within twice the error of transformers' own bf16 attention (the baseline:
sdpa, or eager for gemma2, whose softcap sdpa ignores, and gpt_oss, whose sinks sdpa lacks) plus a
small floor:

    max|fusedattn - ref| <= 2 * max|baseline - ref| + FLOOR * max|ref|      (FLOOR = 2e-3)

for logits and for each compared gradient (embedding, layer-0 q/k/v projections, gpt_oss's sinks).
Most of the bf16 error is in the projections and MLPs, which both sides share; an attention error
moves logits by several times this bound (measured with these models: no sliding window 17x, no
softcap 18x, no sinks 3.6x, gemma2's scale at 1/sqrt(d) 3x). The floor
keeps a lucky, nearly exact baseline from making the bound vanish; it is a fifth of a 1e-2 floor,
which would hide real errors at these sizes. Greedy decoding is compared token by token; a different
token is accepted only where the two picks were a near tie in the reference at that step (see
_assert_same_or_near_tie).

On a machine without CUDA everything skips. FUSEDATTN_HF_GPU_TEST_DEVICE=cpu runs the same tests on
the CPU (bf16; fusedattn's CPU path), for checking this file's logic only.
"""
import functools
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedattn.integrations import transformers as fa_hf  # noqa: E402
from transformers import (AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig,  # noqa: E402
                          Qwen2Config)

DEVICE = os.environ.get("FUSEDATTN_HF_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason="no CUDA device: transformers bf16 GPU tests skipped")]

fa_hf.register()

DTYPE, REF_DTYPE = torch.bfloat16, torch.float32
FLOOR = 2e-3
VOCAB, SEQ, WINDOW = 512, 128, 48
# init std 0.1: attention scores of a few units, sharp enough that a wrong mask, window or softcap shows
COMMON = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
HAS_GPT_OSS = hasattr(transformers, "GptOssConfig")
MODELS = ["llama", "qwen2", "mistral", "gemma2",
          pytest.param("gpt_oss", marks=pytest.mark.skipif(not HAS_GPT_OSS,
                                                           reason="the installed transformers has no GptOss"))]
# transformers' bf16 attention that fusedattn is held to: sdpa where it computes the model's attention
BASELINE = {"gemma2": "eager", "gpt_oss": "eager"}


def _config(name):
    if name == "llama":
        return LlamaConfig(**COMMON)
    if name == "qwen2":
        return Qwen2Config(**COMMON)
    if name == "mistral":
        return MistralConfig(**COMMON, sliding_window=WINDOW)
    if name == "gemma2":
        # softcap small enough to bite; query_pre_attn_scalar != head_dim checks that `scaling` is honoured
        return Gemma2Config(**COMMON, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                            query_pre_attn_scalar=32, final_logit_softcapping=None)
    if name == "gpt_oss":
        # every expert on every token: no discrete top-k routing that bf16 noise could flip between the
        # two bf16 runs (the router's weights stay a smooth softmax)
        return transformers.GptOssConfig(**dict(COMMON, intermediate_size=128), num_local_experts=4,
                                         num_experts_per_tok=4, sliding_window=WINDOW)
    raise ValueError(name)


@functools.lru_cache(maxsize=None)
def _weights(name):
    """The fp32 state dict every variant of `name` loads (so all of them have the same weights)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32)
    if name == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:      # sinks large enough to matter (the init gives ~0.1)
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, layer.self_attn.sinks.numel()))
    return model.state_dict()


def _model(name, impl, dtype=DTYPE):
    """`name` built with attn_implementation=impl in `dtype` (from_config keeps RoPE's inv_freq in fp32,
    as from_pretrained does; a .to(bf16) of a built model would round it), loaded with _weights(name)."""
    extra = {"experts_implementation": "eager"} if name == "gpt_oss" else {}   # the same MoE code at all dtypes
    model = AutoModelForCausalLM.from_config(_config(name), attn_implementation=impl, dtype=dtype, **extra)
    model.load_state_dict(_weights(name))
    assert model.config._attn_implementation == impl
    return model.to(DEVICE).eval()


def _models(name):
    """(reference float32 eager, baseline bf16, fusedattn bf16) and the baseline's name."""
    base = BASELINE.get(name, "sdpa")
    return _model(name, "eager", REF_DTYPE), _model(name, base), _model(name, "fusedattn"), base


@pytest.fixture(autouse=True)
def _no_tf32():
    """The float32 reference in full float32 (TF32 matmuls would make it barely better than bf16)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _ids(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (b, s), generator=g).to(DEVICE)


def _left_padded(seqs):
    """ids and 0/1 attention_mask of `seqs` left-padded to the longest (pad id 0)."""
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(seqs):
        ids[i, s - len(x):] = x
        mask[i, s - len(x):] = 1
    return ids, mask


def _prompts():
    """A left-padded batch: one row of SEQ tokens, one of 77 (51 pad positions on the left)."""
    return _left_padded([_ids(1, SEQ, seed=1)[0], _ids(1, 77, seed=2)[0]])


def _err(got, ref):
    return (got.double() - ref.double()).abs().max().item()


def _bound(base, ref):
    """The rule's bound for fusedattn's error against `ref`, from the baseline's error."""
    return 2 * _err(base, ref) + FLOOR * ref.double().abs().max().item()


def _assert_within(what, got, base, ref):
    err, bound = _err(got, ref), _bound(base, ref)
    assert err <= bound, (f"{what}: fusedattn max error {err:.4g} > bound {bound:.4g} "
                          f"(2 * baseline error {_err(base, ref):.4g} + {FLOOR} * max|ref|)")


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.mark.parametrize("batch", ["dense", "left_padded"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_float32_reference(name, batch):
    """Logits of fusedattn bf16 vs the float32 eager reference, within the rule; the left-padded batch
    only at real (non-pad) positions (a fully masked pad row is implementation-defined)."""
    ref_m, base_m, fa_m, base = _models(name)
    if batch == "dense":
        ids, kw = _ids(2, SEQ, seed=0), {}
        keep = torch.ones_like(ids, dtype=torch.bool)
    else:
        ids, mask = _prompts()
        kw, keep = dict(attention_mask=mask), mask.bool()
    ref, want, got = (_logits(m, ids, **kw)[keep] for m in (ref_m, base_m, fa_m))
    _assert_within(f"{name} {batch} logits (baseline {base})", got, want, ref)


def _grad_names(name):
    names = ["model.embed_tokens.weight"] + [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    if name == "gpt_oss":
        names += [f"model.layers.{i}.self_attn.sinks" for i in (0, 1)]   # a sliding and a full layer
    return names


def _loss_grads(model, name):
    """Cross-entropy on shifted tokens (transformers shifts `labels`) of a dense and a left-padded batch,
    summed; returns (loss, {parameter: grad}) for _grad_names(name)."""
    ids = _ids(2, SEQ, seed=0)
    pids, pmask = _prompts()
    # pad positions out of the loss, and the first real one too (its label is predicted from a pad row)
    labels = pids.masked_fill(pmask.cumsum(-1) <= 1, -100)
    loss = model(ids, labels=ids).loss + model(pids, attention_mask=pmask, labels=labels).loss
    loss.backward()
    params = dict(model.named_parameters())
    return loss.detach(), {n: params[n].grad for n in _grad_names(name)}


@pytest.mark.parametrize("name", MODELS)
def test_loss_gradients_match_float32_reference(name):
    """The loss and its gradients (embedding, layer-0 q/k/v projections, gpt_oss's sinks) of fusedattn
    bf16 vs the float32 eager reference, each tensor within the rule (relative to its own max)."""
    ref_m, base_m, fa_m, base_impl = _models(name)
    (ref_loss, ref), (base_loss, base), (loss, got) = (_loss_grads(m, name) for m in (ref_m, base_m, fa_m))
    what = f"{name} (baseline {base_impl})"
    _assert_within(f"{what} loss", loss, base_loss, ref_loss)
    for n in ref:
        assert got[n] is not None, f"{what}: no gradient reached {n}"
        _assert_within(f"{what} grad {n}", got[n], base[n], ref[n])


def _assert_same_or_near_tie(what, got, want, prompt_mask, ref_m, base_m):
    """Greedy outputs `got` (fusedattn) and `want` (baseline), both bf16, are token-identical, or each row
    first differs at a near tie.

    Both runs are the same bf16 model up to rounding inside attention, so argmax may legitimately flip
    where the two best next tokens are nearly tied; after a flip the continuations differ and prove
    nothing, so only the first differing step of a row is judged. There the common prefix (the row's
    real prompt tokens and the tokens generated before the step, no padding) is run through the float32
    reference and the bf16 baseline: the logits bound of test_logits_* on that prefix,
    2 * max|baseline - ref| + FLOOR * max|ref|, is what bf16 can move a logit by. The margin judged is
    the reference's best logit at that step minus the lower of the two picked tokens' logits (the top-2
    margin when the runs picked the reference's top two; larger if either pick is not near the top), and
    it must be below 4 times the bound. A flip at a clear margin is an error.
    """
    width = max(got.shape[1], want.shape[1])     # a batch ends early when all its rows hit EOS: pad
    got, want = (torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (got, want))
    n_prompt = prompt_mask.shape[1]
    for row in range(got.shape[0]):
        diff = (got[row] != want[row]).nonzero()
        if len(diff) == 0:
            continue
        step = diff[0].item()
        assert step >= n_prompt, f"{what}: row {row} prompt changed"
        keep = torch.cat([prompt_mask[row].bool(), torch.ones(step - n_prompt, dtype=torch.bool, device=DEVICE)])
        prefix = got[row, :step][keep][None]
        ref, base = _logits(ref_m, prefix)[0], _logits(base_m, prefix)[0]
        picks = ref[-1, [got[row, step], want[row, step]]]
        margin, bound = (ref[-1].max() - picks.min()).item(), _bound(base, ref)
        assert margin <= 4 * bound, (
            f"{what}: row {row} differs at generated token {step - n_prompt} (fusedattn {got[row, step].item()}, "
            f"baseline {want[row, step].item()}) where the reference margin {margin:.4g} is not a near tie "
            f"(> 4 * logits bound {bound:.4g})")


def _generate_both(name, **gen):
    """Greedy generate() of the left-padded prompts with fusedattn and with the baseline (bf16), checked
    by _assert_same_or_near_tie."""
    ref_m, base_m, fa_m, base = _models(name)
    ids, mask = _prompts()
    gen = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, **gen)
    with torch.no_grad():
        got, want = (m.generate(ids, attention_mask=mask, **gen) for m in (fa_m, base_m))
    _assert_same_or_near_tie(f"{name} generate {gen.get('cache_implementation', 'dynamic')} cache "
                             f"(baseline {base})", got, want, mask, ref_m, base_m)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_matches_baseline(name):
    _generate_both(name)


def test_static_cache_generate_llama():
    """The static cache: prefill keys include the empty future slots (s_kv > s_q) and decode steps
    see the whole preallocated cache under a mask."""
    _generate_both("llama", cache_implementation="static")


@pytest.mark.parametrize("name", MODELS)
def test_packed_row_matches_sequences_one_by_one(name):
    """Two sequences in one row, position_ids restarting at 0, no attention_mask: transformers' mask
    builder detects the packing from position_ids (only without a cache, hence use_cache=False: with
    a cache, even the DynamicCache a plain forward makes in eval mode, it does not look) and gives
    fusedattn a block-diagonal causal bool mask. The packed logits of fusedattn bf16 vs the float32
    reference run one sequence at a time, within the rule, the baseline also run one by one (so a
    packing transformers failed to detect cannot hide behind an equally wrong baseline).

    Skipped where the float32 eager reference itself mixes the packed sequences: then the model's
    mask builder never sees position_ids (transformers 5.17-5.24's GptOss passes none to
    create_causal_mask), and no mask-based implementation, eager and sdpa included, can run packed."""
    ref_m, base_m, fa_m, base = _models(name)
    seqs = [_ids(1, 70, seed=3), _ids(1, 58, seed=4)]
    ids = torch.cat(seqs, dim=1)
    pos = torch.cat([torch.arange(s.shape[1], device=DEVICE) for s in seqs])[None]
    ref, want = (torch.cat([_logits(m, s, use_cache=False)[0] for s in seqs]) for m in (ref_m, base_m))
    ref_packed = _logits(ref_m, ids, position_ids=pos, use_cache=False)[0]
    if _err(ref_packed, ref) > 1e-3 * ref.abs().max().item():
        pytest.skip(f"{name}: transformers does not detect packing from position_ids for this model "
                    f"(its float32 eager packed row is off by {_err(ref_packed, ref):.3g})")
    got = _logits(fa_m, ids, position_ids=pos, use_cache=False)[0]
    _assert_within(f"{name} packed row vs one by one (baseline {base})", got, want, ref)


@pytest.mark.parametrize("name", MODELS)
def test_packed_row_with_boundaries_matches_sequences_one_by_one(name):
    """As above, with the boundaries passed as DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    passes them (cu_seq_lens_q/k, max_length_q/k): fusedattn then runs its varlen kernels over the packed
    row (no mask); the reference and baseline run one sequence at a time, so every model, GptOss
    included, has a check."""
    ref_m, base_m, fa_m, base = _models(name)
    seqs = [_ids(1, 70, seed=3), _ids(1, 58, seed=4)]
    ids = torch.cat(seqs, dim=1)
    pos = torch.cat([torch.arange(s.shape[1], device=DEVICE) for s in seqs])[None]
    cu = torch.tensor([0, 70, 128], dtype=torch.int32, device=DEVICE)
    ref, want = (torch.cat([_logits(m, s, use_cache=False)[0] for s in seqs]) for m in (ref_m, base_m))
    got = _logits(fa_m, ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=70, max_length_k=70)[0]
    _assert_within(f"{name} packed row with boundaries vs one by one (baseline {base})", got, want, ref)
