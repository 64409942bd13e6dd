"""``python -m fusedattn bench --models``: a Llama-shaped model end to end, in tokens per second.

A few decoder layers of a 1B-class Llama shape (Llama 3.2 1B's: hidden 2048, 32 query / 8 key-value
heads of 64, MLP 8192, RoPE), random weights built from a config (nothing downloaded), bf16, run with
Hugging Face transformers' ``attn_implementation="fusedattn"`` (:mod:`fusedattn.integrations.transformers`)
beside ``"sdpa"`` on the same weights:

* **train**: one step (forward, loss, backward, AdamW step) on ``[batch, seq]`` tokens;
  tokens/s = batch * seq / median step time;
* **generate**: greedy ``generate()`` of ``new`` tokens after a ``prompt``-token prompt (transformers'
  dynamic K/V cache); tokens/s = batch * new / median time (prefill included, as a user sees it).

Times are wall-clock medians after warm-up with the GPU synchronized around each step. Without CUDA a
tiny config runs a step or two so that the command works; its numbers say nothing about speed. Without
transformers the group prints why and returns at once (``pip install "fusedattn[hf]"``).
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

__all__ = ["ModelShape", "GPU_SHAPE", "CPU_SHAPE", "run_models", "measure"]

IMPLS = ("sdpa", "fusedattn")


@dataclass(frozen=True)
class ModelShape:
    """The benchmarked model and workloads (sizes of a 1B-class Llama, fewer layers)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    train_batch: int
    train_seq: int
    gen_batch: int
    prompt: int
    new: int
    steps: int          # timed repetitions per measurement (after warm-up)

    def label(self) -> str:
        return (f"Llama {self.layers} layers, d_model {self.hidden}, heads {self.heads}/{self.kv_heads} of "
                f"{self.hidden // self.heads}, MLP {self.mlp}, vocab {self.vocab}")


GPU_SHAPE = ModelShape(layers=4, hidden=2048, heads=32, kv_heads=8, mlp=8192, vocab=32000,
                       train_batch=4, train_seq=2048, gen_batch=8, prompt=512, new=128, steps=5)
CPU_SHAPE = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, mlp=128, vocab=256,
                       train_batch=2, train_seq=32, gen_batch=2, prompt=8, new=4, steps=1)


def _build(shape: ModelShape, device, dtype):
    """A random-initialized LlamaForCausalLM of ``shape`` (attn_implementation "sdpa" to start)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.mlp,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=max(shape.train_seq,
                      shape.prompt + shape.new), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).to(device)


def _timed(fn, steps: int, warmup: int, device) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls after ``warmup`` untimed ones."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _train_step_fn(model, shape: ModelShape, device):
    """One optimizer step on fixed random tokens ``[train_batch, train_seq]``."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, shape.vocab, (shape.train_batch, shape.train_seq), generator=g).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        opt.step()
    return step


def _generate_fn(model, shape: ModelShape, device):
    """Greedy ``generate()`` of exactly ``new`` tokens after a ``[gen_batch, prompt]`` prompt."""
    model.eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, shape.vocab, (shape.gen_batch, shape.prompt), generator=g).to(device)
    mask = torch.ones_like(ids)

    def gen():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=shape.new, min_new_tokens=shape.new,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == shape.prompt + shape.new
    return gen


def measure(shape: ModelShape, device, dtype, warmup: int = 1) -> dict:
    """``{(phase, impl): tokens per second}`` for phase "train" / "generate", impl "sdpa" / "fusedattn",
    all on one model (same weights; the attention implementation is switched in place). Training
    updates the weights, so each implementation trains from its own copy of the initial state."""
    from .integrations import transformers as fa_hf
    fa_hf.register()
    model = _build(shape, device, dtype)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    results = {}
    for impl in IMPLS:
        model.load_state_dict(initial)
        model.set_attn_implementation(impl)
        t = _timed(_train_step_fn(model, shape, device), shape.steps, warmup, device)
        results[("train", impl)] = shape.train_batch * shape.train_seq / t
        model.zero_grad(set_to_none=True)
        model.load_state_dict(initial)
        t = _timed(_generate_fn(model, shape, device), shape.steps, warmup, device)
        results[("generate", impl)] = shape.gen_batch * shape.new / t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def render(shape: ModelShape, results: dict, device_name: str) -> str:
    """The markdown table of :func:`measure`'s results."""
    rows = [f"Llama-shaped model, {device_name}: {shape.label()}; tokens/s (higher is better)", "",
            "| phase | workload | sdpa | fusedattn | fusedattn / sdpa |", "|---|---|---|---|---|"]
    work = {"train": f"train step, batch {shape.train_batch} x {shape.train_seq} tokens (AdamW)",
            "generate": f"greedy generate, batch {shape.gen_batch}, prompt {shape.prompt}, {shape.new} new"}
    for phase in ("train", "generate"):
        a, b = results[(phase, "sdpa")], results[(phase, "fusedattn")]
        rows.append(f"| {phase} | {work[phase]} | {a:,.0f} | {b:,.0f} | {b / a:.2f} |")
    return "\n".join(rows)


def run_models(args=None) -> int:
    """Entry point of ``fusedattn bench --models``: prints the table; 0 also when transformers is
    missing (the group is skipped, with the reason, in well under a second)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("fusedattn bench --models: skipped, transformers is not installed "
              "(pip install \"fusedattn[hf]\")", file=sys.stderr)
        return 0
    if torch.cuda.is_available():
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, GPU_SHAPE
        name = torch.cuda.get_device_name()
        if getattr(args, "quick", False):
            shape = ModelShape(**dict(shape.__dict__, steps=3))
    else:
        print("no CUDA GPU found: a tiny CPU model, to show the command works; these numbers say nothing "
              "about GPU speed", file=sys.stderr)
        device, dtype, shape, name = torch.device("cpu"), torch.float32, CPU_SHAPE, "CPU"
    results = measure(shape, device, dtype, warmup=1)
    print(render(shape, results, name))
    return 0
