"""Lab tool (no GPU): local memory of the Gluon kernels as real launches compile them.

    python tools/recorded_locals.py [--store DIR] [--kernel MODULE.FUNCTION] [--where NAME=VALUE ...]
                                    [--keys PREFIX,...] [--all-loops]

Compiles the shipped store's recorded launches of one Gluon kernel (``fwd_sm90._attn_fwd_sm90`` unless
``--kernel`` names another, e.g. ``bwd_dkdv_sm90._attn_bwd_dkdv_sm90``; this Triton's store unless ``--store``)
from this tree's sources, with the JIT's own specialization (tools/store_rebuild.py: pointer alignment and
integer divisibility as recorded), and prints per launch its switches, stack bytes, LDL / STL count, SASS size
and, per loop with wgmmas, (instructions, local accesses). ``--where PAGE=16 --where PACKED_Q=True`` keeps the
launches whose compile-time switches have those reprs. ``--all-loops`` also lists every loop of the SASS of 60
instructions or more with no EXIT inside, outer ones too (the persistent grid's work-tile loops: per work tile
code), with its local accesses. For an A/B, run it from two checkouts (a ``git worktree`` of the base commit) with
the same arguments. ``recorded_launches`` and ``locals_of`` serve tests too.

Why not tools/gluon_check.py: its ``compile_fwd`` specializes on no argument, and ptxas then allocates
registers differently. The bench's paged prefill (pages of 16, packed queries, Triton 3.9.0) compiled there
showed 24 bytes of stack; as the launch compiles it, 256 bytes and ~100 local loads per work tile, which Nsight
Compute showed as long-scoreboard stalls at each tile's masked steps (bench/NOTES.md 85).

Measured (session 49, Triton 3.9.0, ``--where PAGE=16 --all-loops``): the packed prefill's first consumer held 18
local accesses in its work-tile loop against the padded build's 10, 8 without the packed epilogue's partial-tile
stores (bench/NOTES.md 89).

Measured (session 45, Triton 3.9.0 / 3.6.0, sources of commit 746e8bc): the prefill's padded and packed builds
over pages of 16, 64 and 256 hold 216-256 bytes of stack on 3.9.0 (31-32 local accesses in the second
warpgroup's masked step loop), none on 3.6.0; the mask-immediate compares (``fwd_sm90._band_keep``'s
THREAD_BITS, session 46) take 3.9.0 to 56-88 bytes; measured on the H100, bench/NOTES.md 86.
"""
import argparse
import ast
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

import gluon_check  # noqa: E402
import store_rebuild  # noqa: E402
from fusedattn.backends import prebuilt  # noqa: E402

STORE = os.path.join(prebuilt.STORE_ROOT, prebuilt.store_name(90))   # this Triton's store
SHOWN = ("BLOCK_N", "STAGES", "PERSISTENT", "HAS_LEFT", "HAS_RIGHT", "BOTTOM_RIGHT", "HAS_SEQ_Q", "HAS_SEQ_KV",
         "PAGE", "PACKED_Q", "HAS_ALIBI", "DROPOUT", "WRITE_LSE")


def stack_bytes(cubin: bytes) -> int:
    """The kernel's stack frame (cuobjdump -res-usage): where ptxas puts what it spills."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([os.path.join(gluon_check.BIN, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def recorded_launches(kernel="fwd_sm90._attn_fwd_sm90", where=None, keys="", store=None, head_dim=None):
    """(index key, index entry, switches by name) of the store's recorded launches of ``kernel`` (module.function under
    backends/gluon) whose compile-time switches have the reprs in ``where``, whose key starts with one of the
    comma-separated prefixes ``keys`` (any, if empty) and, given ``head_dim``, whose Q box is that wide."""
    module, name = kernel.split(".")
    fn = getattr(importlib.import_module(f"fusedattn.backends.gluon.{module}"), name)
    with open(os.path.join(store or STORE, "index.json")) as f:
        entries = json.load(f)["kernels"]
    for key, entry in entries.items():
        if entry["name"] != name or (keys and not any(key.startswith(p) for p in keys.split(","))):
            continue
        specs = dict(zip(fn.arg_names, ast.literal_eval(entry["specs"])))
        if head_dim is not None and specs["q_desc"][2][3] != head_dim:
            continue
        if all(specs.get(k) == v for k, v in (where or {}).items()):
            yield key, entry, specs


def locals_of(entry):
    """(stack bytes, SASS, [(instructions, MUFU.EX2, LDL + STL) per loop with wgmmas]) of one recorded launch
    compiled from this tree's sources as the JIT compiles it (tools/store_rebuild.py)."""
    kernel = store_rebuild._kernel(entry["kernel"])
    call_args, call_kwargs, _ = store_rebuild.launch_of(kernel, ast.literal_eval(entry["specs"]))
    compiled = store_rebuild.compile_launch(kernel, call_args, call_kwargs)
    text = gluon_check.sass(compiled)
    loops = [(n, sum("MUFU.EX2" in b for b in body), sum("LDL" in b or "STL" in b for b in body))
             for _, n, body in gluon_check.inner_loops(text) if any("GMMA" in b for b in body)]
    return stack_bytes(compiled.asm["cubin"]), text, loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=STORE)
    ap.add_argument("--kernel", default="fwd_sm90._attn_fwd_sm90", help="module.function under backends/gluon")
    ap.add_argument("--where", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--keys", default="", help="comma list of index key prefixes")
    ap.add_argument("--all-loops", action="store_true", help="also every loop with its local accesses, outer ones too")
    args = ap.parse_args()
    where = dict(w.split("=", 1) for w in args.where)
    for key, entry, specs in recorded_launches(args.kernel, where, args.keys, args.store):
        stack, text, loops = locals_of(entry)
        switches = " ".join(f"{k}={specs[k]}" for k in SHOWN if k in specs)
        print(f"{key[:10]} d{specs['q_desc'][2][3]} {switches}\n    stack {stack} LDL {text.count('LDL')} "
              f"STL {text.count('STL')} SASS {len(re.findall(r'/[*][0-9a-f]{4,}[*]/', text))} "
              f"loops with wgmmas (instructions, local) {[(n, local) for n, _, local in loops]}", flush=True)
        if args.all_loops:
            for label, n, body in gluon_check.loops(text):
                if n >= 60 and not any("EXIT" in b for b in body):
                    local = sum("LDL" in b or "STL" in b for b in body)
                    wgmma = " (wgmmas)" if any("GMMA" in b for b in body) else ""
                    print(f"      loop {label}: {n} instructions, {local} local accesses{wgmma}")


if __name__ == "__main__":
    main()
