"""Instruction counts of the forward kernel's loops, from its sm_90 SASS, with no GPU.

    python tools/sass_loops.py D BLOCK_M BLOCK_N WARPS STAGES [SWITCH=VALUE ...]
    e.g. python tools/sass_loops.py 128 128 64 8 3 PAGED=True PAGE_SIZE=64 HAS_SEQ_KV=True

Compiles like the JIT at a real launch (tools/aot_check.compile_kernel(jit_like=True)),
disassembles the cubin with the nvdisasm Triton ships, and prints, for every loop (a
backward branch), its instruction count and the most frequent opcodes: one K/V tile's work
per thread. How bench/NOTES.md entries 8, 11 and 12 were counted.
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton

from aot_check import compile_kernel, fwd_spec, ptxas_report
from fusedattn.backends.triton import fwd


def sass(kernel_obj) -> str:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel_obj.asm["cubin"])
    return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_spans(text: str):
    """[(label, first line, last line)] of each loop of a SASS listing (lines of ``text``): a label and the
    branch back to it."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            spans.append((m.group(1), labels[m.group(1)], i))
    return spans


def loop_stats(text: str):
    """[(label, instructions, [(opcode, count), ...])] for each loop: label ... branch back to it."""
    lines = text.splitlines()
    loops = []
    for label, first, last in loop_spans(text):
        ops = collections.Counter()
        for body in lines[first:last + 1]:
            op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", body)
            if op:
                ops[op.group(2)] += 1
        loops.append((label, sum(ops.values()), ops.most_common(12)))
    return loops


def main():
    d, bm, bn, warps, stages = (int(x) for x in sys.argv[1:6])
    switches = {}
    for arg in sys.argv[6:]:
        name, value = arg.split("=")
        switches[name] = {"True": True, "False": False}.get(value, int(value) if value.isdigit() else value)
    switches.setdefault("HAS_RIGHT", False)
    ptrs, constexprs = fwd_spec(d, bm, bn, **switches)
    k = compile_kernel(fwd._attn_fwd, ptrs, constexprs, warps, stages, jit_like=True)
    print(f"shared memory {k.metadata.shared} bytes; {ptxas_report(k)}")
    for label, n, ops in loop_stats(sass(k)):
        print(f"loop {label}: {n} instructions; " + ", ".join(f"{op} {c}" for op, c in ops))


if __name__ == "__main__":
    main()
