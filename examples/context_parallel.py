"""Train a tiny causal language model with its sequence split across 2 ranks (context parallelism).

    python examples/context_parallel.py                 # 2 gloo ranks on the CPU, a few training steps
    python examples/context_parallel.py --world 4 --steps 10 --layout contiguous

Each rank holds a shard of one long sequence (the zigzag layout by default: with W ranks the
sequence is cut into 2W chunks and rank i holds chunks i and 2W-1-i, which balances the causal
work). Embeddings, MLPs, norms and the loss run on the local tokens only; attention is the one
layer that needs the whole sequence, and it runs through
``fusedattn.distributed.context_parallel_attention`` (K/V passed around the ring of ranks,
forward and backward). Position embeddings are indexed with the tokens' *global* positions
(``sequence_positions``). Parameters are replicated: after the backward each rank all-reduces
their gradients, exactly as data parallelism does.

On the first step rank 0 also runs the same model on the whole sequence in one process
(``fusedattn.attention``) and prints how far the loss and the gradients are from the
context-parallel ones (fp32 rounding, about 1e-6 or less).

The processes are spawned here (torch.multiprocessing) and talk over gloo on the loopback
interface; on GPUs the same code runs with the nccl backend and CUDA tensors, one rank per GPU.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))     # run from a checkout without installing

import fusedattn  # noqa: E402
from fusedattn.distributed import context_parallel_attention, sequence_positions, shard_sequence  # noqa: E402

DATA = ROOT / "examples" / "data" / "fables.txt"


class Block(nn.Module):
    def __init__(self, dim, n_head, n_kv_head):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, dim // n_head
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (n_head + 2 * n_kv_head) * self.hd, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attend):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split([self.n_head * self.hd, self.n_kv_head * self.hd,
                                               self.n_kv_head * self.hd], dim=-1)
        # BSHD memory seen as BHSD (no copies); GQA: k/v keep their n_kv_head heads
        q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=128, dim=64, n_head=4, n_kv_head=2, n_layer=2, max_len=1024):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_head, n_kv_head) for _ in range(n_layer))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, positions, attend):
        """idx [b, s] tokens (a shard of the sequence), positions [s] their global positions."""
        x = self.tok(idx) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x, attend)
        return self.head(self.ln(x))


def load_tokens(n, vocab):
    """The first n bytes of the example corpus as tokens (random tokens if it is missing)."""
    if DATA.exists():
        data = torch.tensor(list(DATA.read_bytes()[:n]), dtype=torch.long)
        if data.numel() == n:
            return data % vocab
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))


def run(rank, world, init_file, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)                           # the same initial weights on every rank
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seq_len = args.seq_len
    tokens = load_tokens(args.batch * (seq_len + 1), 128).view(args.batch, seq_len + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # this rank's shard of the sequence (tokens, next tokens, global positions)
    idx = shard_sequence(inputs, world, rank, args.layout, dim=1)
    tgt = shard_sequence(targets, world, rank, args.layout, dim=1)
    pos = sequence_positions(seq_len, world, rank, args.layout)

    def attend(q, k, v):
        return context_parallel_attention(q, k, v, causal=True, layout=args.layout)

    for step in range(args.steps):
        logits = model(idx, pos, attend)
        # the mean over the whole sequence = (sum of the local token losses) / (all tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum") / targets.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():              # replicated parameters: sum the ranks' shares
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if step == 0 and rank == 0:
            check_against_one_process(model, inputs, targets, seq_len, total)
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {total.item():.4f}", flush=True)
    dist.destroy_process_group()


def check_against_one_process(model, inputs, targets, seq_len, cp_loss):
    """The same step on the whole sequence in this process, with fusedattn.attention."""
    ref = TinyLM()
    ref.load_state_dict(model.state_dict())
    logits = ref(inputs, torch.arange(seq_len), lambda q, k, v: fusedattn.attention(q, k, v, causal=True))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    gdiff = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    print(f"one-process check: loss {loss.item():.6f} vs context-parallel {cp_loss.item():.6f}, "
          f"max gradient difference {gdiff:.2e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks (processes), default 2")
    ap.add_argument("--seq-len", type=int, default=256, help="whole sequence length (a multiple of 2 * world)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run, args=(args.world, os.path.join(tmp, "init"), args), nprocs=args.world,
                           start_method="spawn")


if __name__ == "__main__":
    main()
