"""Train a small random Llama for a few steps and generate with it, on fusedattn through transformers.

The model is Hugging Face transformers' ``LlamaForCausalLM`` built from a config (random weights, nothing
downloaded) with ``attn_implementation="fusedattn"``, made available by one call:

    import fusedattn.integrations.transformers as fa_hf
    fa_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fusedattn")

It trains for ``--steps`` AdamW steps on byte-level text (``examples/data/fables.txt``, shipped in the
repository), then generates greedily from a left-padded batch of two prompts, and checks that
``attn_implementation="sdpa"`` on the same weights generates the same tokens.

    pip install "fusedattn[hf]"                 # transformers 5
    python examples/hf_llama.py                 # CUDA if present (bf16), else the CPU (fp32)
    python examples/hf_llama.py --steps 200 --layers 4

The same model code runs unchanged: only ``attn_implementation`` differs. (To put fusedattn under code
that calls ``F.scaled_dot_product_attention`` itself, see ``fusedattn.integrations.torch.activate()``.)
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))     # run from a checkout without installing

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import fusedattn.integrations.transformers as fa_hf  # noqa: E402

PAD, BOS = 0, 1                  # byte b is token b + 2


def encode(text: str) -> list:
    return [BOS] + [b + 2 for b in text.encode("utf-8")]


def decode(ids) -> str:
    return bytes(i - 2 for i in ids if i >= 2).decode("utf-8", errors="replace")


def build(args, device, dtype):
    """A random-initialized Llama (GQA: 2 key/value heads for 8 query heads) of ``args``' size."""
    cfg = LlamaConfig(vocab_size=258, hidden_size=args.width, intermediate_size=4 * args.width,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=1024, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="fusedattn", dtype=dtype).to(device)


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless random windows ``[batch, seq]`` of the token stream ``data``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        yield torch.stack([data[s:s + seq] for s in starts])


def train(model, data, args, device) -> None:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    it = batches(data, args.batch, args.seq, args.seed)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        ids = next(it).to(device)
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 1 or step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.time() - t0:.1f} s)")


def left_padded(prompts, device):
    """Token ids and attention mask ``[len(prompts), longest]``, padded on the left (as generate wants)."""
    seqs = [encode(p) for p in prompts]
    n = max(len(s) for s in seqs)
    ids = torch.tensor([[PAD] * (n - len(s)) + s for s in seqs], device=device)
    mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs], device=device)
    return ids, mask


def generate(model, ids, mask, new: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="default: 100 on CUDA, 30 on the CPU")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--new", type=int, default=40, help="tokens to generate")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.steps is None:
        args.steps = 100 if device.type == "cuda" else 30
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fa_hf.register()                                     # the one line: "fusedattn" for transformers
    model = build(args, device, dtype)
    print(f"{device.type}, {dtype}: Llama {args.layers} layers, width {args.width}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"attn_implementation={model.config._attn_implementation!r}")

    data = torch.tensor(encode((ROOT / "examples" / "data" / "fables.txt").read_text()))
    train(model, data, args, device)

    ids, mask = left_padded(["The fox and the ", "Once upon a time, a crow"], device)
    out = generate(model, ids, mask, args.new)
    for row in out[:, ids.shape[1]:]:
        print("generated:", repr(decode(row.tolist())))

    model.set_attn_implementation("sdpa")               # same weights, PyTorch's SDPA
    ref = generate(model, ids, mask, args.new)
    same = torch.equal(out, ref)
    print(f"greedy tokens identical to attn_implementation='sdpa': {same}")
    if not same:        # bf16 rounding can flip a near-tie late in a long generation; say where
        first = (out != ref).any(0).nonzero()[0].item() - ids.shape[1]
        print(f"  first difference at generated token {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
