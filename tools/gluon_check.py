"""Compile the Gluon sm_90 forward kernel with no GPU, and show what matters in its SASS.

    python tools/gluon_check.py [D] [CAUSAL] [dtype] [pingpong|plain] [BLOCK_N|-] [window] [alibi] [seq_q] [seq_kv]
                                [persistent] [static]
    e.g. ... 256 1 bf16 plain 32, or ... 128 1 bf16 plain - window alibi, or ... 128 0 bf16 plain - seq_q seq_kv,
    or ... 128 1 bf16 plain - persistent
    python tools/gluon_check.py spills     # spill bytes of every persistent variant (one-tile grid beside)
    python tools/gluon_check.py paged PAGE [D] [persistent] [v_warp]   # the load warps' loops over a paged K/V cache
    python tools/gluon_check.py releases PAGE [D]   # where the consumer loops wait for and release K/V slots
    python tools/gluon_check.py 128 1 e4m3 [plain|pingpong] [BLOCK_N|-] [window] [seq_q] [seq_kv]
                                [persistent] [out=e4m3|bf16|fp16|fp32] [promote=0|32] [heads]   # the FP8 switch
                                                                          (heads: per-head descales)
    python tools/gluon_check.py 128 1 bf16 plain - varlen seq_kv bottom_right page=16 persistent   # packed queries
    python tools/gluon_check.py fp8        # every FP8 variant: d 64/128/256 x masks x padding, spills and HGMMA kinds

D is the head dim (64, 128, 224, 256); 224 compiles the 256-wide kernel (fwd_sm90.TILE_D), the
same one as 256. BLOCK_N overrides fwd_sm90.TILES (stages then keep the same shared memory).
seq_q / seq_kv compile the padded kernel (per-batch lengths, HAS_SEQ_Q / HAS_SEQ_KV).
persistent compiles the persistent grid (PERSISTENT, fwd_sm90.QSTAGES Q slots), with its dynamic
tile counter unless static is given too.

Prints registers/spills (ptxas -v on the PTX), shared memory, and for each loop of the SASS
its instruction count and the order of its wgmma-related instructions (HGMMA issue,
WARPGROUP.DEPBAR waits, barriers), so one can check that the QK^T wgmma of tile j and the PV
wgmma of tile j-1 are both in flight while the softmax runs.

``paged`` compiles the bottom-right causal, per-sequence-length kernel over pages of PAGE keys (the chunked
prefill of ``bench --configs prefill``) and shows the load warp's loops (the ones with TMA copies and no
wgmma): spills, then per loop its instruction count, global loads (LDG), lane reductions (REDUX) and TMA
copies (UTMALDG, one per 64-column block), in order, and for each LDG the first instruction of the
iteration that reads its result (a copy's coordinate that waits for a table read: the LDG's result read
between it and that copy); an LDG whose result no instruction of the iteration reads is carried to the next.
"""
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fusedattn.backends.gluon import fwd_sm90  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
FP8_TYPES = {"e4m3": "fp8e4nv", "e5m2": "fp8e5"}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_fwd(d=128, causal=True, dtype="bf16", write_lse=True, bottom_right=False, pingpong=False,
                block_n=None, stages=None, window=False, alibi=False, seq_q=False, seq_kv=False,
                persistent=False, dynamic=True, dropout=False, sink=False, page=0, out="bf16", promote=None,
                varlen=False, packed_kv=False, v_warp=False, fp8_emu=0, head_scales=False):
    """fp8_emu 1 / 2: the FP8 forward on the 16-bit MMAs, P8 in e4m3 / e5m2 (``FP8_EMU``), output in ``out``'s
    type; with dtype fp16 every product is fp16, with dtype e4m3 / e5m2 QK^T is an FP8 wgmma and V fp16
    ([Note] FP8 on 16-bit MMAs). head_scales: the FP8 switch's per-head descales (``FP8_HEAD_SCALES``)."""
    import torch
    fp8 = dtype in FP8_TYPES
    v_fp8 = fp8 and not fp8_emu       # FP8_EMU: V is widened to fp16, in its natural layout
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn,
           "e5m2": torch.float8_e5m2}[dtype]
    ty = FP8_TYPES.get(dtype, dtype)     # Triton's name of the type
    d = fwd_sm90.TILE_D[d]
    default_n, default_stages = (fwd_sm90.FP8_TILES if v_fp8 else fwd_sm90.TILES)[d]
    block_n = block_n or default_n
    stages = stages or max(1, default_stages * default_n // block_n)
    ql = fwd_sm90._smem_layout(fwd_sm90.WG_M, d, tdt)
    kl = fwd_sm90._smem_layout(block_n, d, tdt)
    box = min(page, block_n) if page else block_n     # paged: TMA boxes of at most one page
    box_d = 64 if page and page < block_n else d       # ... of one 64-column block when smaller than a tile
    # FP8: V transposed, [HEAD_D, BLOCK_N] boxes (keys innermost)
    v_sig = (f"tensordesc<{ty}[1, 1, {d}, {block_n}],{fwd_sm90._smem_layout(d, block_n, tdt)!r}>" if v_fp8
             else f"tensordesc<{ty}[1, 1, {box}, {box_d}],{kl!r}>")
    if fp8 and fp8_emu:
        v_sig = f"tensordesc<fp16[1, 1, {block_n}, {d}],{fwd_sm90._smem_layout(block_n, d, torch.float16)!r}>"
    sig = {"q_desc": f"tensordesc<{ty}[1, 1, {fwd_sm90.WG_M}, {d}],{ql!r}>",
           "k_desc": f"tensordesc<{ty}[1, 1, {box}, {box_d}],{kl!r}>",
           "v_desc": v_sig,
           "o_desc": f"tensordesc<{ty}[1, 1, {fwd_sm90.WG_M}, {d}],{ql!r}>",
           "LSE": "*fp32", "stride_lb": "i32", "stride_lh": "i32", "stride_lm": "i32", "SLOPES": "*fp32", "stride_sb": "i32",
           "SEQ_Q": "*i32", "SEQ_KV": "*i32",
           "H_Q": "i32", "GROUP": "i32", "S_Q": "i32", "S_KV": "i32", "qk_scale": "fp32",
           "win_left": "i32", "win_right": "i32", "COUNTER": "*i32", "N_M": "i32", "N_BH": "i32",
           "HEAD_GROUP": "i32", "DROP_SEED": "i32", "DROP_OFFSET": "i32", "DROP_THRESHOLD": "i32",
           "DROP_RESCALE": "fp32", "SINK": "*fp32", "PT_K": "*i32", "PT_V": "*i32", "stride_ptk": "i32",
           "stride_ptv": "i32", "MAX_PAGES": "i32",
           "O": "*" + FP8_TYPES.get(out, out), "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32",
           "D_O": "i32", "SCALES": "*fp32", "AMAX": "*fp32"}
    const = dict(BLOCK_N=block_n, STAGES=stages, HAS_LEFT=window, HAS_RIGHT=causal or window,
                 BOTTOM_RIGHT=bottom_right, HAS_ALIBI=alibi, WRITE_LSE=write_lse,
                 REVERSE_M=causal and not window, HAS_SEQ_Q=seq_q, HAS_SEQ_KV=seq_kv,
                 CONSUMER_REGS=fwd_sm90.CONSUMER_REGS, PRODUCER_REGS=fwd_sm90.PRODUCER_REGS, PINGPONG=pingpong,
                 PERSISTENT=persistent, DYNAMIC=dynamic, QSTAGES=fwd_sm90.QSTAGES[d], DROPOUT=dropout,
                 HAS_SINK=sink, PAGE=page, PROMOTE=fwd_sm90.FP8_PROMOTE if promote is None else promote,
                 PACKED_Q=varlen, PACKED_KV=packed_kv, V_WARP=v_warp, FP8_EMU=fp8_emu)
    if head_scales:
        sig.update(DESCALE_Q="*fp32", DESCALE_K="*fp32", DESCALE_V="*fp32")
        const["FP8_HEAD_SCALES"] = True
    else:       # launches without per-head descales leave their parameters at their defaults
        const.update(DESCALE_Q=None, DESCALE_K=None, DESCALE_V=None, FP8_HEAD_SCALES=False)
    if varlen or packed_kv:
        sig["O"] = "*" + ty     # packed queries: the 16-bit output's masked stores (_store_rows)
    for k in const:
        sig[k] = "constexpr"
    src = GluonASTSource(fn=fwd_sm90._attn_fwd_sm90, signature=sig, constexprs=const)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4))


def ptxas_report(kernel, ptx=None):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx or kernel.asm["ptx"])
    r = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    # Triton 3.9's PTX names a newer ISA version than the ptxas it ships reads (Triton itself lowers the
    # version line before it assembles): do the same
    m = re.search(r"Unsupported \.version \S+; current version is '([\d.]+)'", r.stderr)
    if m and ptx is None:
        return ptxas_report(kernel, re.sub(r"\.version \d+\.\d+", f".version {m.group(1)}", kernel.asm["ptx"], 1))
    return r.stderr


def sass(kernel):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    return subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                          check=True).stdout


KEY = re.compile(r"[HQ]GMMA|WARPGROUP|DEPBAR|BAR\.|SYNCS|MUFU\.EX2|UTMALDG|UTMASTG|USETMAXREG")


def loops(text):
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)]:i + 1]
            n = sum(1 for b in body if re.match(r"\s*/\*[0-9a-f]+\*/", b))
            yield m.group(1), n, body


def inner_loops(text, min_len=60):
    """The loops of the SASS that matter: at least min_len instructions, no EXIT inside (the mbarrier
    try-wait retry stubs after the last EXIT branch back across partitions)."""
    found = [(label, n, body) for label, n, body in loops(text) if not any("EXIT" in b for b in body)]
    heads = {label for label, _, _ in found}
    # a loop whose body holds another loop's head is an outer one
    return [(label, n, body) for label, n, body in found if n >= min_len
            and not any(re.match(rf"^({'|'.join(re.escape(h) for h in heads - {label})}):", b) for b in body)]


def _ins(body):
    return [re.sub(r"\s+", " ", b.split("*/", 1)[1].split(";")[0].strip()) for b in body
            if re.match(r"\s*/\*[0-9a-f]+\*/", b)]


def inflight_a_writes(body):
    """Instructions that write a register of a register-A wgmma (its A operand R<n>..R<n+3>) between that
    wgmma and the next full wait (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) in one loop body: must be none (the
    FP8 path's PV wait does not carry P8 as a dependency; fwd_sm90 ``_pv_wait``)."""
    bad, live = [], set()
    for i in _ins(body):
        m = re.match(r"(?:@!?U?P\w+ )?[HQ]GMMA\S* R\d+, R(\d+), gdesc", i)
        if m:
            live |= set(range(int(m.group(1)), int(m.group(1)) + 4))
            continue
        if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in i:
            live = set()
            continue
        m = re.match(r"(?:@!?U?P\w+ )?([A-Z][A-Z0-9_.]*) (R\d+)(\.64)?,", i)
        if live and m and not m.group(1).startswith(("ST", "UTMA", "SYNCS", "BAR", "WARPGROUP", "ISETP", "FSETP")):
            first = int(m.group(2)[1:])
            regs = {first, first + 1} if m.group(3) else {first}
            if regs & live:
                bad.append(i)
    return bad


def fp8_report(k, label=""):
    """Spills, shared memory, and per inner loop: instruction count, exponentials under the PV wgmma, the
    wgmma kinds (QGMMA ... E4M3: the FP8 ones), SHFL count and in-flight A-operand writes."""
    rep = ptxas_report(k)
    m = re.search(r"\d+ bytes stack frame, \d+ bytes spill stores, \d+ bytes spill loads", rep)
    regs = re.search(r"Used \d+ registers", rep)
    serial = "; ptxas serialized wgmmas" if "C751" in rep else ""
    print(f"{label}: shared {k.metadata.shared} bytes, {regs.group(0) if regs else '?'}, "
          f"{m.group(0) if m else rep.strip()}{serial}")
    for name, n, body in inner_loops(sass(k)):
        ins = _ins(body)
        kinds = sorted({re.match(r"(?:@!?U?P\w+ )?(\S+)", i).group(1) for i in ins if "GMMA" in i})
        ex2 = sum("MUFU.EX2" in i for i in ins)
        under, inside = 0, False
        for i in ins:
            if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in i:
                inside = True
            elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in i:
                inside = False
            elif inside and "MUFU.EX2" in i:
                under += 1
        shfl = sum(i.split(" ")[0].startswith("SHFL") for i in ins)
        spill = sum(bool(re.search(r"\b(STL|LDL)\b", i)) for i in ins)
        bad = inflight_a_writes(body)
        print(f"  loop {name}: {n} instructions, {ex2} MUFU.EX2 ({under} under the PV wgmma), {shfl} SHFL, "
              f"{spill} STL/LDL, {len(bad)} writes to an in-flight A operand; wgmmas {', '.join(kinds)}")
        for b in bad[:4]:
            print("    in-flight A write:", b)


def _fp8_case(args):
    k = compile_fwd(**args)
    import io
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fp8_report(k, " ".join(f"{a}={v}" for a, v in args.items()))
    return buf.getvalue()


def fp8_survey():
    """Every FP8 variant the routing takes (fwd_sm90.FP8_DIMS, FP8_TILES): no mask, causal (both
    alignments), window, padded q / kv, the persistent grid; plus 128-key tiles at d=128, e5m2 and PROMOTE=32 for comparison."""
    from concurrent.futures import ProcessPoolExecutor
    cases = []
    for d in fwd_sm90.FP8_DIMS:
        for causal, br in ((False, False), (True, False), (True, True)):
            for extra in ({}, dict(write_lse=False), dict(seq_q=True, seq_kv=True), dict(seq_kv=True),
                          dict(persistent=True), dict(persistent=True, seq_q=True, seq_kv=True)):
                cases.append(dict(d=d, causal=causal, bottom_right=br, dtype="e4m3", **extra))
        cases.append(dict(d=d, causal=True, window=True, dtype="e4m3"))
    cases += [dict(d=128, causal=c, dtype="e4m3", block_n=128, stages=3) for c in (False, True)]
    cases += [dict(d=128, causal=True, dtype="e5m2"), dict(d=128, causal=True, dtype="e4m3", out="e4m3"),
              dict(d=128, causal=True, dtype="e4m3", promote=32)]
    with ProcessPoolExecutor(os.cpu_count()) as ex:
        for text in ex.map(_fp8_case, cases):
            print(text, end="", flush=True)


def _spills(args):
    """(args, spill report) of one compile_fwd(**args) (a process-pool worker of ``spill_survey``)."""
    m = re.search(r"\d+ bytes spill stores, \d+ bytes spill loads", ptxas_report(compile_fwd(**args)))
    return args, m.group(0) if m else "?"


def spill_survey():
    """Spills of the persistent grid's kernels (fwd_sm90 [Note] persistent grid: register pressure)
    and of the one-tile grid's: head dims x masks (none, causal top-left / bottom-right, window,
    ALiBi, window + ALiBi) x LSE or not x ping-pong, the padded ones (q, kv, both; windowed) and
    dropout."""
    from concurrent.futures import ProcessPoolExecutor
    cases = []
    for persistent in (True, False):
        for d in (64, 128, 256):
            for causal, br in ((False, False), (True, False), (True, True)):
                for extra in ({}, dict(write_lse=False), dict(pingpong=True), dict(window=True), dict(alibi=True),
                              dict(window=True, alibi=True), dict(seq_q=True), dict(seq_kv=True),
                              dict(seq_q=True, seq_kv=True), dict(seq_kv=True, window=True), dict(dropout=True)):
                    cases.append(dict(d=d, causal=causal, bottom_right=br, persistent=persistent, **extra))
    with ProcessPoolExecutor(os.cpu_count()) as ex:
        for args, rep in ex.map(_spills, cases):
            print(" ".join(f"{k}={v}" for k, v in args.items()), "->", rep, flush=True)


PAGED_KEY = re.compile(r"\bLDG\b|REDUX|UTMALDG|TRYWAIT|\bLDL\b|\bSTL\b")


def _regs(operands):
    """Registers an instruction's operand text names (R4.64 names R4 and R5)."""
    out = set()
    for r, wide in re.findall(r"\bR(\d+)(\.64)?\b", operands):
        out.add(int(r))
        if wide:
            out.add(int(r) + 1)
    return out


def paged_loads(page, d=128, persistent=False, v_warp=False):
    """The load warp's loops of the paged kernel (module docstring, ``paged``; v_warp: V from a second warp)."""
    k = compile_fwd(d, True, "bf16", bottom_right=True, seq_kv=True, persistent=persistent, page=page,
                    v_warp=v_warp)
    rep = ptxas_report(k)
    m = re.search(r"\d+ bytes stack frame, \d+ bytes spill stores, \d+ bytes spill loads", rep)
    print(f"page {page} d{d} {'persistent' if persistent else 'one-tile grid'}: "
          f"{m.group(0) if m else rep.strip().splitlines()[-2]}")
    for label, n, body in loops(sass(k)):
        if not any("UTMALDG" in b for b in body) or any("HGMMA" in b for b in body):
            continue
        ins = [re.sub(r"\s+", " ", b.split("*/", 1)[1].split(";")[0].strip()) for b in body
               if re.match(r"\s*/\*[0-9a-f]+\*/", b)]
        count = {op: sum(bool(re.search(rf"\b{op}\b", i)) for i in ins) for op in ("LDG", "REDUX", "UTMALDG")}
        print(f"  loop {label}: {n} instructions, " + ", ".join(f"{c} {op}" for op, c in count.items()))
        for pos, i in enumerate(ins):
            if not PAGED_KEY.search(i):
                continue
            note = ""
            if re.search(r"\bLDG\b", i):
                note = "  <- result not read in this iteration (carried)"
                dst = int(re.search(r"LDG\S*\s+R(\d+)", i).group(1))
                for at in range(pos + 1, len(ins)):
                    words = ins[at].split(" ", 2) if ins[at].startswith("@") else [""] + ins[at].split(" ", 1)
                    op, operands = words[1], words[2] if len(words) > 2 else ""
                    target, _, sources = operands.partition(",")
                    if dst in _regs(operands if op.startswith(("ST", "UTMA", "SYNCS")) else sources):
                        copies = sum("UTMALDG" in x for x in ins[pos + 1:at])
                        note = f"  <- read at {at} by '{ins[at]}' ({copies} UTMALDG between)"
                        break
                    if dst in _regs(target) and not op.startswith(("ST", "UTMA", "SYNCS")):
                        break       # overwritten unread
            print(f"    {pos:4d} {i}{note}")


def consumer_releases(page, d=128):
    """The consumer loops of the persistent bottom-right causal kernel over pages of PAGE keys (0: contiguous):
    per loop, its instruction count and where its slot waits (TRYWAIT), wgmma waits (DEPBAR), warpgroup
    barriers and slot releases (SYNCS.ARRIVE: K's empty barrier, then V's) stand. Session 29 (bench/NOTES.md
    68): the unmasked loop releases K right after QK^T's wgmma completes (189 of 495 instructions, 3.6.0 and
    3.9.0); the masked loop near its end (3.9.0 pages of 16: 723 of 769)."""
    k = compile_fwd(d, True, "bf16", bottom_right=True, seq_kv=True, persistent=True, page=page)
    print(f"page {page} d{d} persistent (one load warp)")
    for label, n, body in inner_loops(sass(k)):
        ins = _ins(body)
        if not any("GMMA" in i for i in ins):
            continue
        marks = [f"{pos} {i.split()[0] if not i.startswith('@') else i.split()[1]}" for pos, i in enumerate(ins)
                 if re.search(r"TRYWAIT|DEPBAR|BAR\.SYNC|SYNCS\.ARRIVE", i)]
        print(f"  loop {label}: {n} instructions: " + ", ".join(marks))


def main():
    if sys.argv[1:2] == ["releases"]:
        return consumer_releases(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 128)
    if sys.argv[1:2] == ["spills"]:
        return spill_survey()
    if sys.argv[1:2] == ["fp8"]:
        return fp8_survey()
    if sys.argv[1:2] == ["paged"]:
        return paged_loads(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 128,
                           "persistent" in sys.argv[4:], "v_warp" in sys.argv[4:])
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    causal = bool(int(sys.argv[2])) if len(sys.argv) > 2 else True
    dtype = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    pingpong = len(sys.argv) > 4 and sys.argv[4] == "pingpong"
    block_n = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "-" else None
    # any of "window", "alibi", "seq_q", "seq_kv", "persistent", "static", "dropout", "varlen" (packed queries:
    # seq_q implied), "varlen_kv" (packed queries and keys: needs seq_kv), "bottom_right", "page=N"
    extra = sys.argv[6:]
    if dtype in FP8_TYPES:
        # the FP8 switch: "out=TYPE" (e4m3, e5m2, bf16, fp16, fp32), "promote=N" (fwd_sm90.FP8_PROMOTE)
        opts = dict(a.split("=", 1) for a in extra if "=" in a)
        k = compile_fwd(d, causal, dtype, pingpong=pingpong, block_n=block_n, window="window" in extra,
                        seq_q="seq_q" in extra, seq_kv="seq_kv" in extra, out=opts.get("out", "bf16"),
                        promote=int(opts.get("promote", fwd_sm90.FP8_PROMOTE)), persistent="persistent" in extra,
                        head_scales="heads" in extra)
        return fp8_report(k, f"d{d} causal={int(causal)} {dtype} {' '.join(sys.argv[4:])}".strip())
    page = int(dict(a.split("=", 1) for a in extra if "=" in a).get("page", 0))
    k = compile_fwd(d, causal, dtype, pingpong=pingpong, block_n=block_n, window="window" in extra,
                    alibi="alibi" in extra, seq_q="seq_q" in extra or "varlen" in extra or "varlen_kv" in extra, seq_kv="seq_kv" in extra,
                    persistent="persistent" in extra, dynamic="static" not in extra, dropout="dropout" in extra,
                    varlen="varlen" in extra or "varlen_kv" in extra, bottom_right="bottom_right" in extra, page=page,
                    packed_kv="varlen_kv" in extra)
    print(f"shared {k.metadata.shared} bytes")
    print(ptxas_report(k).strip())
    text = sass(k)
    with open(f"/tmp/gluon_fwd_d{d}_c{int(causal)}{'_p' if 'persistent' in extra else ''}.sass", "w") as f:
        f.write(text)
    for label, n, body in loops(text):
        if n < 60:
            continue
        ex2 = sum("MUFU.EX2" in b for b in body)
        # exponentials between the wait for QK^T (one wgmma left) and the wait for PV: these
        # run under the PV wgmma (module docstring of fwd_sm90, [Note] keeping the softmax ...)
        under, inside = 0, False
        for b in body:
            if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in b:
                inside = True
            elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in b:
                inside = False
            elif inside and "MUFU.EX2" in b:
                under += 1
        print(f"loop {label}: {n} instructions, {ex2} MUFU.EX2, {under} of them between the two wgmma waits")
        seq = []
        for b in body:
            m = KEY.search(b)
            if m and "MUFU" not in b:
                seq.append(re.sub(r"\s+", " ", b.split("*/", 1)[1].split(";")[0].strip()))
        for s in seq:
            print("   ", s)


if __name__ == "__main__":
    main()
