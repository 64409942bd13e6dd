"""The backward passes of the d=64 and d=128 anchors (issue 28), one backward each, for Nsight Compute; and
the same kernels' static profile from their sm_90 SASS, with no GPU.

    python3 bench/profile_bwd.py [--configs d64,d64c,2kc,8k,16kc,gqa4kc] [--fa4] [--time N] [--dry-run]
    python3 bench/profile_bwd.py --sass [--configs ...]        # no GPU: ptxas + nvdisasm (bench/BWD_PROFILE.md)
    python3 bench/profile_bwd.py --compare RAW.csv             # no GPU: an ncu-bwd report's kernels side by side

GPU mode: per config, random BSHD inputs (as ``fusedattn bench``), our forward, two warm-up backwards (the
first compiles), then ONE backward (``fusedattn.attention_backward``, the routed path: Triton dQ + dK/dV at
d=64, the Gluon two passes at 2k causal, the single-pass kernel elsewhere) between cudaProfilerStart and
cudaProfilerStop (and in the NVTX range ``ours:<config>``); with ``--fa4`` (where ``flash_attn.cute`` imports)
FlashAttention-4's autograd backward of the same inputs the same way (``fa4:<config>``). Nsight Compute with
``--profile-from-start off`` profiles only those kernels, in the order this script prints
(``run_device.sh ncu-bwd``; ``--dry-run`` prints the command):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section LaunchStats --section SourceCounters -o $OUT/ncu-bwd/bwd python3 bench/profile_bwd.py --fa4

``--time N``: instead (no ncu), N timed backwards per config with CUDA events, ours and FA4's in one process,
median ms and TFLOP/s (bwd = 2.5 x the forward's 4*b*h*s_q*s_kv*d, halved causal: the bench's convention).
``--dry-run``: print the configs, the kernels each backward launches and the ncu command; no GPU needed.
``--sass``: compile every kernel those backwards launch for sm_90 (the tools/ compile helpers) and print,
per kernel, shared memory, registers, spills, CTAs per SM, and per inner loop (one query tile's or key
tile's step) the instruction count, HGMMA shapes and FLOPs, waits, barriers, local-memory accesses, the
dQ reduction's instructions and the issue order.
"""
import argparse
import collections
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# name -> (b, h_q, h_kv, s, d, dtype, causal): the issue-28 anchors at d=64 and d=128
CONFIGS = {
    "d64": (8, 12, 12, 1024, 64, "fp16", False),
    "d64c": (8, 12, 12, 1024, 64, "fp16", True),
    "2kc": (4, 32, 32, 2048, 128, "bf16", True),
    "8k": (2, 16, 16, 8192, 128, "bf16", False),
    "16kc": (1, 32, 32, 16384, 128, "bf16", True),
    "gqa4kc": (4, 32, 8, 4096, 128, "bf16", True),
}
# issue 28's H100 backward TFLOP/s: ours, the best of cuDNN / FA4 (and which)
MEASURED = {"d64": (299, 372, "FA4"), "d64c": (174, 195, "cuDNN"), "2kc": (394, 443, "FA4"),
            "8k": (589, 661, "FA4"), "16kc": (505, 605, "FA4"), "gqa4kc": (451, 516, "FA4")}
PEAK = 790.0      # dense bf16 TFLOP/s measured on the H100 (the brief's figure)
FUSED_CAUSAL_MIN_KEYS = 4096   # functional._FUSED_CAUSAL_MIN_KEYS (checked against the module in --sass)


def route(name):
    """(passes, kernels) of our backward for config ``name`` (functional._run_backward's routing, non-deterministic)."""
    b, hq, hkv, s, d, dt, causal = CONFIGS[name]
    if d not in (128, 224, 256):
        return "Triton two-pass", ["_attn_bwd_dq (writes delta)", "_attn_bwd_dkdv"]
    if not causal or s >= FUSED_CAUSAL_MIN_KEYS:
        return "Gluon single pass", ["_delta_zero", "_attn_bwd_fused_sm90", "_dq_convert"]
    return "Gluon two-pass", ["_attn_bwd_dq_sm90 (writes delta, causal)", "_attn_bwd_dkdv_sm90"]


def flops(name):
    """Useful backward FLOPs (the bench's convention: 2.5 x forward, halved under a causal mask)."""
    b, hq, hkv, s, d, dt, causal = CONFIGS[name]
    f = 2.5 * 4 * b * hq * s * s * d
    return f / 2 if causal else f


SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables",
            "InstructionStats", "WarpStateStats", "SchedulerStats", "Occupancy", "LaunchStats", "SourceCounters")


def ncu_command(out="$OUT/ncu-bwd/bwd", fa4=True):
    return ("ncu --profile-from-start off --clock-control none "
            + " ".join(f"--section {s}" for s in SECTIONS)
            + f" -o {out} python3 bench/profile_bwd.py" + (" --fa4" if fa4 else ""))


# ----------------------------------------------------------------------------------------------
# GPU mode

def _inputs(name, device="cuda"):
    import torch
    b, hq, hkv, s, d, dt, causal = CONFIGS[name]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda h: torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g).transpose(1, 2)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq), causal


def _ours(name):
    import fusedattn
    q, k, v, do, causal = _inputs(name)
    out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True)
    # dq, dk, dv allocated by the call (empty_like: BSHD strides, no kernel), as autograd's backward does
    return lambda: fusedattn.attention_backward(q, k, v, out, do, stats, causal=causal)


def _fa4(name):
    """FA4's backward of the same inputs (its forward once, outside the profiled range), or None."""
    import site
    import torch
    # the carried wheels' folder (run_device.sh's install_wheels): FA4 finds its DSL through a .pth file there
    for folder in filter(None, os.environ.get("FUSEDATTN_EXTRA_SITE", "").split(os.pathsep)):
        site.addsitedir(folder)
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # noqa: BLE001 - not installed on this machine
        print(f"  FA4: not importable ({type(exc).__name__}: {str(exc)[:100]})")
        return None
    q, k, v, do, causal = _inputs(name)
    qs, ks, vs = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))     # BSHD views
    try:
        out = flash_attn_func(qs, ks, vs, causal=causal)
    except Exception as exc:  # noqa: BLE001 - a failing FA4 must not cost the call our profile
        print(f"  FA4: forward failed ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    out = out[0] if isinstance(out, tuple) else out
    dos = do.transpose(1, 2)

    def run():
        torch.autograd.grad(out, (qs, ks, vs), dos, retain_graph=True)
    return run


def event_times(run, n):
    """n calls of ``run``, each between a pair of CUDA events and synchronized: their ms, sorted."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(n):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        ms.append(start.elapsed_time(end))
    return sorted(ms)


def gpu_main(args):
    import torch
    names = args.configs
    for name in names:
        b, hq, hkv, s, d, dt, causal = CONFIGS[name]
        passes, kernels = route(name)
        print(f"== {name}: b{b} h{hq}/{hkv} s{s} d{d} {dt} causal={causal}: {passes} ({', '.join(kernels)})")
        runners = [("bwd", _ours(name))]
        if args.fa4:
            r = _fa4(name)
            if r is not None:
                runners.append(("fa4", r))
        for tag, run in runners:
            try:
                for _ in range(2):      # the first call compiles (or loads the shipped kernels)
                    run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - FA4's failure must not stop ours (ours raises)
                if tag == "bwd":
                    raise
                print(f"  {tag}: backward failed ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            if args.time:
                ms = event_times(run, args.time)
                med = ms[len(ms) // 2]
                print(f"  {tag}: median {med:.3f} ms over {len(ms)} ({flops(name) / med / 1e9:.1f} TFLOP/s; "
                      f"min {ms[0]:.3f})")
            else:
                # only this backward's kernels are profiled (ncu --profile-from-start off)
                torch.cuda.cudart().cudaProfilerStart()
                torch.cuda.nvtx.range_push(f"{tag}:{name}")
                run()
                torch.cuda.nvtx.range_pop()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"  {tag}: one backward profiled (NVTX range {tag}:{name})")
        del runners
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# static mode (no GPU)

HGMMA = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\.F32")
SMEM_PER_SM = 233472          # H100: 228 KB of shared memory per SM (227 KB per CTA), 1 KB reserved per CTA
COUNTED = ("LDL", "STL", "BAR.SYNC", "WARPGROUP.DEPBAR", "TRYWAIT", "MUFU.EX2", "STSM", "STS.", "LDS.", "LDSM",
           "UTMAREDG", "UBLKRED", "RED.", "ATOM", "LDGSTS", "UTMALDG", "MEMBAR", "FENCE.VIEW")


def _op(line):
    s = re.sub(r"\s+", " ", line.split("*/", 1)[1].split(";")[0].strip())
    return s.split()[1] if s.startswith("@") else s.split()[0]


def order(body):
    """The issue order of what matters, runs folded: HGMMA groups (shape x count), waits, barriers, exchanges."""
    seq = []
    for line in body:
        if "*/" not in line:
            continue
        op = _op(line)
        m = HGMMA.search(line)
        if m:
            tok = f"HG{m.group(1)}x{m.group(2)}" + ("(RS)" if re.search(r"HGMMA\S* R\d+, R\d+", line) else "")
        elif op.startswith("WARPGROUP.DEPBAR"):
            tok = "WAIT<=" + line.split("gsb0,")[1].split(";")[0].strip()[-1]
        elif op.startswith("WARPGROUP.ARRIVE"):
            continue
        elif op.startswith(("BAR.SYNC", "MEMBAR", "FENCE.VIEW", "UTMAREDG", "UBLKRED", "LDGDEPBAR")):
            tok = op.split(".")[0] if not op.startswith("FENCE") else "FENCE"
        elif op.startswith("SYNCS.PHASECHK"):
            tok = "mbar-wait"
        elif op.startswith("SYNCS.ARRIVE"):
            tok = "mbar-arrive"
        elif op.startswith("DEPBAR"):
            tok = "DEPBAR"        # cp.async / bulk-group wait (Triton's LDGSTS ring, the TMA store_wait)
        elif op.startswith(("MUFU.EX2", "STSM", "STS", "LDSM", "LDS", "LDL", "STL", "RED", "ATOM")):
            tok = op.split(".")[0]
        else:
            continue
        if seq and seq[-1][0] == tok:
            seq[-1][1] += 1
        else:
            seq.append([tok, 1])
    return " ".join(t if n == 1 else f"{t}*{n}" for t, n in seq)


def loop_report(text):
    from gluon_bwd_check import inner_loops
    out = []
    for label, n, body in inner_loops(text):
        if not any("HGMMA" in b for b in body):
            continue
        hg = collections.Counter()
        fl = 0
        for b in body:
            m = HGMMA.search(b)
            if m:
                mm, nn, kk = (int(x) for x in m.groups())
                hg[f"{mm}x{nn}x{kk}"] += 1
                fl += 2 * mm * nn * kk
        cnt = {c: sum(c in b for b in body) for c in COUNTED}
        out.append((label, n, dict(hg), fl, cnt, order(body)))
    return out


def kernel_report(title, k, ptxas, threads):
    from gluon_check import sass
    regs = int(re.search(r"Used (\d+) registers", ptxas).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    smem = k.metadata.shared
    by_smem = SMEM_PER_SM // (smem + 1024)
    by_regs = 65536 // (((regs + 7) // 8 * 8) * threads)
    print(f"\n### {title}\n  shared {smem} B, {regs} registers/thread at entry, {threads} threads/CTA, spills "
          f"{spill.group(1)} B stored / {spill.group(2)} B loaded; CTAs/SM: {min(by_smem, by_regs)} "
          f"(shared memory allows {by_smem}, registers {by_regs})")
    for w in re.findall(r"warning[^\n]*", ptxas):
        print("  ptxas", w)
    for label, n, hg, fl, cnt, seq in loop_report(sass(k)):
        nz = ", ".join(f"{c.rstrip('.')} {v}" for c, v in cnt.items() if v)
        print(f"  loop {label}: {n} SASS instr; HGMMA {hg} = {fl / 1e6:.3f} MFLOP per warpgroup per step; {nz}")
        print(f"    order: {seq}")


def sass_main(args):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import triton
    from aot_check import BASE_SWITCHES, compile_kernel
    from fusedattn import functional
    from fusedattn.backends.triton import bwd
    assert functional._FUSED_CAUSAL_MIN_KEYS == FUSED_CAUSAL_MIN_KEYS, "routing changed: update route()"

    def ptxas_text(k):
        import subprocess
        import tempfile
        exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        return subprocess.run([exe, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr

    def triton_pass(which, causal, dtype="fp16", d=64, tiles=(64, 64, 4, 3)):
        # plan._BWD_SM90[(64, 2)] / _BWD_DQ_SM90[(64, 2)]: 64x64, 4 warps, 3 stages; launch_bwd's constexprs
        ptr = f"*{dtype}"
        c = dict(BASE_SWITCHES, BLOCK_D=d, BLOCK_DV=d, EVEN_D=True, EVEN_DV=True, HAS_RIGHT=causal, VARLEN=False,
                 BLOCK_M=tiles[0], BLOCK_N=tiles[1])
        ptrs = dict(Q=ptr, K=ptr, V=ptr, O=ptr, DO=ptr, LSE="*fp32", DELTA="*fp32", DK=ptr, DV=ptr,
                    DBIAS="*fp32", DQ=ptr, SEQ_Q="*i32", SEQ_KV="*i32", BIAS=ptr, SLOPES="*fp32", CU_Q="*i32",
                    CU_KV="*i32")
        if which == "dkdv":
            c.update(WRITE_DBIAS=False)
            return compile_kernel(bwd._attn_bwd_dkdv, ptrs, c, tiles[2], tiles[3], jit_like=True)
        c.update(REVERSE_M=causal, WRITE_DELTA=True)
        return compile_kernel(bwd._attn_bwd_dq, ptrs, c, tiles[2], tiles[3], jit_like=True)

    done = set()
    for name in args.configs:
        b, hq, hkv, s, d, dt, causal = CONFIGS[name]
        passes, _ = route(name)
        key = (passes, dt, causal)
        if key in done:
            print(f"\n## {name}: {passes}, the same kernels as above")
            continue
        done.add(key)
        print(f"\n## {name} (b{b} h{hq}/{hkv} s{s} d{d} {dt} causal={causal}): {passes}")
        if passes == "Triton two-pass":
            for which in ("dq", "dkdv"):
                k = triton_pass(which, causal, dt)
                kernel_report(f"Triton _attn_bwd_{which} d64 {dt} causal={causal} (64x64, 4 warps, 3 stages)",
                              k, ptxas_text(k), 128)
        elif passes == "Gluon two-pass":
            from gluon_bwd_check import compile_dkdv
            from gluon_dq_check import compile_dq
            k = compile_dq(128, causal, dt)
            kernel_report(f"Gluon _attn_bwd_dq_sm90 d128 {dt} causal={causal}", k, ptxas_text(k),
                          32 * k.metadata.num_warps)
            k = compile_dkdv(128, causal, dt)
            kernel_report(f"Gluon _attn_bwd_dkdv_sm90 d128 {dt} causal={causal}", k, ptxas_text(k),
                          32 * k.metadata.num_warps)
        else:
            from gluon_fused_check import compile_fused
            k = compile_fused(causal, dt)
            kernel_report(f"Gluon _attn_bwd_fused_sm90 d128 {dt} causal={causal}", k, ptxas_text(k),
                          32 * k.metadata.num_warps)


def ideal_table():
    print("\nconfig  passes               GFLOP  ours TF  best TF      ours/peak best/peak  ours ms  best ms  "
          "executed MMA TF (ours)")
    for name in CONFIGS:
        passes, _ = route(name)
        f = flops(name) / 1e9
        ours, best, who = MEASURED[name]
        redo = 7 / 5 if "two-pass" in passes else 1.0      # the dQ pass recomputes S and dP
        print(f"{name:7s} {passes:20s} {f:7.1f} {ours:7d} {best:6d} {who:5s} {ours / PEAK:9.2f} {best / PEAK:9.2f} "
              f"{f / ours:8.3f} {f / best:8.3f}  {ours * redo:6.0f}")


# ``--compare``: the main kernels' metrics side by side (label, raw-page metric, scale)
COMPARED = (("elapsed cycles (M)", "gpc__cycles_elapsed.max", 1e-6),
            ("tensor pipe active (%)", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", 1),
            ("instructions (M)", "smsp__inst_executed.sum", 1e-6),
            ("shared store bank conflicts (M)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", 1e-6),
            ("LSU shared wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", 1e-6),
            ("local (spill) loads (M)", "smsp__sass_inst_executed_op_local_ld.sum", 1e-6),
            ("issue slots busy (%)", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1))


def compare(path):
    """From the raw page of an ``ncu-bwd`` report (``ncu --import R --page raw --csv``): the main backward kernel
    of each profiled backward (ours: the single pass or the dK/dV pass; FA4's ``FlashAttentionBackwardSm90``), in
    profiling order, one column each, the ``COMPARED`` metrics as rows (bench/NOTES.md 92's table)."""
    from ncu_raw import raw_table      # this folder is on sys.path when run as a script
    head, rows = raw_table(path)
    name = head.index("Kernel Name")
    main = [r for r in rows if any(k in r[name] for k in ("bwd_fused", "bwd_dkdv", "BackwardSm90"))]
    labels = ["FA4" if "BackwardSm90" in r[name] else r[name].strip("_")[:18] for r in main]
    print(f"{'metric':34s}" + "".join(f"{x:>20s}" for x in labels))
    for label, metric, scale in COMPARED:
        if metric not in head:
            continue
        j = head.index(metric)
        vals = [float(r[j].replace(",", "") or 0) * scale for r in main]
        print(f"{label:34s}" + "".join(f"{v:20.3f}" for v in vals))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--fa4", action="store_true", help="also FlashAttention-4's backward, where it imports")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="time N backwards per config (no ncu)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the ncu command; no GPU")
    ap.add_argument("--sass", action="store_true", help="static SASS profile of the kernels (no GPU)")
    ap.add_argument("--compare", metavar="RAW_CSV", help="the profiled main kernels' metrics side by side (no GPU)")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare)
    args.configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configs {bad}; known: {', '.join(CONFIGS)}")
    if args.dry_run:
        for name in args.configs:
            b, hq, hkv, s, d, dt, causal = CONFIGS[name]
            passes, kernels = route(name)
            print(f"{name}: b{b} h{hq}/{hkv} s{s} d{d} {dt} causal={causal} -> {passes}: {', '.join(kernels)}; "
                  f"{flops(name) / 1e9:.1f} GFLOP")
        ideal_table()
        print("\nncu:", ncu_command())
        return
    if args.sass:
        sass_main(args)
        ideal_table()
        return
    gpu_main(args)


if __name__ == "__main__":
    main()
