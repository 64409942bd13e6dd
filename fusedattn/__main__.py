"""Command line: ``fusedattn demo`` and ``fusedattn bench [...]`` (also ``python -m fusedattn ...``).

``demo`` runs the seeds' basic, causal, GQA and BSHD examples on the best device
present, checks each against PyTorch and prints a small table of results and
times. ``bench`` times fusedattn beside every attention importable in the same
process (``fusedattn bench --help`` lists its options).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: fusedattn {demo,bench} [options]

  demo     run the seeds' examples (basic, causal, GQA, BSHD), check them against
           torch.nn.functional.scaled_dot_product_attention, print a table
  bench    time fusedattn beside PyTorch SDPA backends, FlexAttention, cuDNN frontend
           and FlashAttention-4 (see: fusedattn bench --help)
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch to the demo or the benchmark; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    # Imported lazily: each pulls in torch (and the bench, triton), which --help should not wait for.
    if command == "demo":
        from fusedattn import demo
        return demo.main(rest)
    if command == "bench":
        from fusedattn import bench
        return bench.main(rest)
    print(f"fusedattn: unknown command {command!r}; expected 'demo' or 'bench'\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
