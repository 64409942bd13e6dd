"""Lab script: per-SASS-line stall samples from an Nsight Compute source page (no GPU: reads the CSV).

``run_device.sh ncu-paged`` (and the other ncu parts) write ``source.csv``: ``ncu --import REPORT --page source
--csv --print-source sass``, one block per profiled kernel, one row per SASS instruction with its warp-state
samples. This reads it and prints, per kernel:

    python bench/ncu_stalls.py SOURCE.csv [--top N]      # the N hottest instructions, their main stall reason
    python bench/ncu_stalls.py SOURCE.csv --waits        # every mbarrier wait (SYNCS.PHASECHK) and its samples
    python bench/ncu_stalls.py SOURCE.csv --loop K       # kernel K's hottest loop, its samples between landmarks
    python bench/ncu_stalls.py SOURCE.csv --buckets      # samples by execution count (per step, per tile ...)
    python bench/ncu_stalls.py SOURCE.csv --opcodes      # samples by opcode (idle warps' NOPs left out)
    python bench/ncu_stalls.py SOURCE.csv --conflicts    # the instructions with shared-memory bank conflicts

``--waits`` is what told the paged prefill's load warp from its consumers (bench/NOTES.md 66): a wait executed
once per key tile by one warp (the count of the load loop's iterations) is the load warp waiting for a free ring
slot (``k_empty`` / ``v_empty``: the consumers are behind); one executed by the consumer warps is a consumer
waiting for data (``k_ready`` / ``v_ready``: the copies are behind). The samples of a wait land on the branch
after it, so each wait's count sums its own line and the next two.

Measured (H100, session 27, prefill b8 h32/8 q512 over 4096 keys d128 causal; kernels: contiguous, pages of 16,
pages of 64): Triton 3.9.0 pages of 16, load warp's empty waits 361 + 1198 samples against 160 + 2762 contiguous;
first consumer's V-ready wait 1368 against 310; Triton 3.6.0 (two load warps) 2128 + 2131 and 506.
"""
import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path):
    """[(kernel name, [row dict per SASS instruction])] in the file's order."""
    out, hdr = [], None
    with open(path) as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                out.append((row[1], []))
                hdr = None
            elif row and row[0] == "Address":
                hdr = row
            elif hdr and out and len(row) == len(hdr):
                out[-1][1].append(dict(zip(hdr, row)))
    return out


def num(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def stall_columns(rows):
    return [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]


def top(rows, n):
    total = sum(num(r[SAMPLES]) for r in rows) or 1.0
    cols = stall_columns(rows)
    shares = {c[6:]: sum(num(r[c]) for r in rows) / total * 100 for c in cols}
    ranked = sorted(shares.items(), key=lambda x: -x[1])[:8]
    print("  stalls (% of samples):", ", ".join(f"{k} {v:.1f}" for k, v in ranked))
    hot = sorted(range(len(rows)), key=lambda i: -num(rows[i][SAMPLES]))[:n]
    for i in sorted(hot):
        r = rows[i]
        reason = max(cols, key=lambda c: num(r[c]))[6:]
        print(f"  {i:5d} {num(r[SAMPLES]) / total * 100:5.1f}% {reason:14s} x{r['Instructions Executed']:>9s} "
              f"{r['Source'][:90]}")


def waits(rows):
    for i, r in enumerate(rows):
        if "SYNCS.PHASECHK" in r["Source"]:
            barrier = r["Source"].split("[")[1].split("]")[0]
            samples = sum(num(rows[j][SAMPLES]) for j in range(i, min(i + 3, len(rows))))
            print(f"  {i:5d} {barrier:18s} {int(samples):7d} samples, executed x{r['Instructions Executed']}")


LANDMARKS = ("HGMMA", "QGMMA", "DEPBAR", "SYNCS", "BAR.", "UTMA", "STSM", "MEMBAR", "FENCE", "MUFU", "LDL", "STL",
             "BRA", "STS", "LDS")


def loop(rows, min_share=0.003):
    """The instructions executed most often (a consumer loop: one warp count per step) as stretches between
    landmarks (wgmma issue and waits, barriers, shared-memory traffic, branches, spills, or any instruction
    holding min_share of the kernel's samples), each with the samples since the previous landmark, as a share of
    the loop's, and its three main stall reasons. bench/NOTES.md 78 read the fused backward's step this way."""
    counts = {}
    for r in rows:
        counts[r["Instructions Executed"]] = counts.get(r["Instructions Executed"], 0) + num(r[SAMPLES])
    hot = max(counts, key=counts.get)
    total = sum(num(r[SAMPLES]) for r in rows) or 1.0
    in_loop = sum(num(r[SAMPLES]) for r in rows if r["Instructions Executed"] == hot) or 1.0
    cols = stall_columns(rows)
    print(f"  loop: instructions executed x{hot}, {in_loop / total * 100:.1f}% of the kernel's samples")
    acc, since, n = {}, 0.0, 0
    for i, r in enumerate(rows):
        if r["Instructions Executed"] != hot:
            continue
        s = num(r[SAMPLES])
        for c in cols:
            acc[c] = acc.get(c, 0.0) + num(r[c])
        since, n = since + s, n + 1
        if any(m in r["Source"] for m in LANDMARKS) or s / total > min_share:
            top = sorted(acc, key=lambda c: -acc[c])[:3]
            why = ", ".join(f"{c[6:]} {acc[c] / max(since, 1) * 100:.0f}" for c in top)
            print(f"  {i:5d} +{n:3d} {since / in_loop * 100:5.2f}% [{why}]  {r['Source'][:80]}")
            acc, since, n = {}, 0.0, 0


def buckets(rows, n=6):
    """Samples by execution count: the instructions a warp runs once per step, once per work tile, once per CTA
    ... each share one count, so two builds of one kernel compare region by region (bench/NOTES.md 84 found the
    packed prefill's extra time in the per-tile code this way). The n counts with the most samples, each with its
    samples, instructions and main stall reasons."""
    total = sum(num(r[SAMPLES]) for r in rows) or 1.0
    cols = stall_columns(rows)
    groups = {}
    for r in rows:
        groups.setdefault(r["Instructions Executed"], []).append(r)
    ranked = sorted(groups.items(), key=lambda kv: -sum(num(r[SAMPLES]) for r in kv[1]))
    for count, members in ranked[:n]:
        s = sum(num(r[SAMPLES]) for r in members)
        reasons = sorted(cols, key=lambda c: -sum(num(r[c]) for r in members))[:3]
        why = ", ".join(f"{c[6:]} {sum(num(r[c]) for r in members) / max(s, 1) * 100:.0f}" for c in reasons)
        print(f"  x{count:>9s}: {int(s):7d} samples ({s / total * 100:4.1f}%), {len(members):5d} instructions [{why}]")


def opcodes(rows, n=16):
    """Samples by opcode (the part before the first dot; wgmma waits, mbarrier waits kept apart), as a share of
    the kernel's; warps parked in NOPs (executed fewer than 10000 times: the idle warps of a producer warpgroup)
    left out. bench/NOTES.md 92 compared our single-pass backward with FlashAttention-4's this way (FA4's warps
    wait at HGMMA issue, the tensor pipe full; ours at the step's last wgmma wait)."""
    by = {}
    for r in rows:
        words = r["Source"].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        if op == "NOP" and num(r["Instructions Executed"]) < 10000:
            continue
        key = ("DEPBAR (wgmma wait)" if op.startswith("WARPGROUP.DEPBAR") else
               "mbarrier wait" if op.startswith("SYNCS.PHASECHK") else op.split(".")[0])
        by[key] = by.get(key, 0.0) + num(r[SAMPLES])
    total = sum(by.values()) or 1.0
    ranked = sorted(by.items(), key=lambda kv: -kv[1])[:n]
    print("  samples by opcode (%):", ", ".join(f"{k} {v / total * 100:.1f}" for k, v in ranked))


def conflicts(rows, n=12):
    """The instructions with the most shared-memory wavefronts beyond the ideal (bank conflicts): executions,
    wavefronts, ideal. bench/NOTES.md 92 found the fused backward's dQ staging stores at twice the ideal."""
    excess = "L1 Wavefronts Shared Excessive"
    if not rows or excess not in rows[0]:
        print("  no shared-memory wavefront columns (the SourceCounters section)")
        return
    hot = sorted(rows, key=lambda r: -num(r[excess]))[:n]
    for r in hot:
        if num(r[excess]) == 0:
            break
        print(f"  x{r['Instructions Executed']:>9s} wavefronts {r['L1 Wavefronts Shared']:>12s} ideal "
              f"{r['L1 Wavefronts Shared Ideal']:>12s}  {r['Source'].strip()[:70]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source_csv")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--waits", action="store_true")
    ap.add_argument("--loop", type=int, metavar="K", help="kernel K's hottest loop by stretches (loop())")
    ap.add_argument("--buckets", action="store_true", help="samples by execution count (buckets())")
    ap.add_argument("--opcodes", action="store_true", help="samples by opcode (opcodes())")
    ap.add_argument("--conflicts", action="store_true", help="shared-memory bank conflicts by instruction")
    a = ap.parse_args()
    for i, (name, rows) in enumerate(kernels(a.source_csv)):
        if a.loop is not None and i != a.loop:
            continue
        print(f"kernel {i}: {name}, {len(rows)} instructions, {int(sum(num(r[SAMPLES]) for r in rows))} samples")
        if rows and a.loop is not None:
            loop(rows)
        elif rows and a.buckets:
            buckets(rows)
        elif rows and a.waits:
            waits(rows)
        elif rows and a.opcodes:
            opcodes(rows)
        elif rows and a.conflicts:
            conflicts(rows)
        elif rows:
            top(rows, a.top)


if __name__ == "__main__":
    main()
