"""How the bench's L2 flush moves memory-bound rows: a zeroing flush (triton.testing.do_bench's) against a
reading one, for device copies of several sizes and the decode rows (issue 27 item 4's 0.9 of copy).

    python3 bench/flush_probe.py [--anchors]     # --anchors: four ANCHORS forwards too (PFLOP/s)

do_bench clears L2 before each timed call by zeroing a 256 MB buffer, so the call starts with L2 full of
dirty lines that it must write back while it reads; a 140 us decode call moves ~0.5 GB, the bench's copy
ceiling 2 GiB, so the same write-back weighs about four times more on the decode row. A flush that reads the
buffer leaves L2 holding clean lines (a cold cache with nothing to write back). Prints TB/s per (call, flush).
Session 37's numbers (bench/NOTES.md 77) came from this script's first form, whose reading side was its own
loop of 200 calls with the same flush; it now times through ``bench.do_bench_cold``, which the bench uses.
"""
import sys

import torch
from triton.testing import do_bench

import fusedattn.bench as fb


def timed(fn, flush: str, nbytes: int) -> float:
    """TB/s of ``fn`` moving ``nbytes``: median of triton's do_bench (zeroing flush) or of the bench's own
    ``do_bench_cold`` (the same loop, a reading flush)."""
    if flush == "zero":
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
    else:
        ms = fb.do_bench_cold(fn, warmup=25, rep=200)
    return nbytes / ms / 1e9


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for mib in (1024, 256, 128):
        src = torch.randn(mib * 2 ** 20 // 2, dtype=torch.float16, device=dev)
        dst = torch.empty_like(src)
        rows.append((f"copy {mib} MiB (moves {2 * mib} MiB)", lambda s=src, d=dst: d.copy_(s), 2 * mib * 2 ** 20))
    cfgs = fb.fp8_cache_decode_configs() + fb.decode_configs()
    for cfg in [c for c in cfgs if c.b == 64 and c.page_block in (0, 16)]:
        runner = fb.prepare_ours(cfg, False)(fb.make_inputs(cfg, dev))
        rows.append((cfg.name, runner.fwd, int(fb.kv_bytes(cfg))))
    if "--anchors" in sys.argv:
        # compute-bound rows: "TB/s" here is TFLOP/s x 1e-3 (fwd_flops as bytes), only the ratio matters
        for cfg in [fb.anchor_configs()[i] for i in (2, 3, 4, 6)]:
            runner = fb.prepare_ours(cfg, False)(fb.make_inputs(cfg, dev))
            rows.append((cfg.name + " fwd (PFLOP/s)", runner.fwd, int(fb.fwd_flops(cfg))))
    for rep in range(2):
        for label, fn, nbytes in rows:
            print(f"{label}: zeroing flush {timed(fn, 'zero', nbytes):.3f} TB/s, reading flush "
                  f"{timed(fn, 'read', nbytes):.3f} TB/s", flush=True)


if __name__ == "__main__":
    main()
