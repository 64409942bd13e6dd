"""Lab probe (issue 25 item 3): is a prefill row of ``bench`` the kernel's speed, or the call's host time?

``bench`` times eager calls with ``do_bench``: an L2 flush (a 256 MB memset, ~0.09 ms), a start event, the call,
an end event, one call at a time. The start event fires when the flush ends; if the call's Python takes longer
than the flush to reach its launch, the GPU idles in between and the row counts that host time. The prefill
calls take ~0.42 ms of GPU, so a call needing more than ~0.1 ms of host before its launch reads slower than its
kernel; the paged calls do more host work than the contiguous one, and Triton's launch path changes between
releases. For each prefill config this prints, in TFLOP/s (``bench.fwd_flops``):

* ``bench``: what the bench reads (``bench.time_gpu_ms``, quick, eager);
* ``graph``: CUDA-graph replays of the same call (the kernel alone);
* ``loop``: 100 calls back to back between two events, no flush (``decode_overhead.gpu_ms``; a serving loop:
  max(host, GPU) per call);

and the host time of one call (enqueue, no sync; ``overhead.host_ms``), how the Gluon launches went
(:func:`launch_paths`), and with ``--profile`` a cProfile of each config's Python
(200 calls).

    PYTHONPATH=$PWD python bench/prefill_host_probe.py [--profile]

Measured (session 25, H100 80GB HBM3, torch 2.11, Triton 3.9.0 with its shipped store; bench/NOTES.md 64):

    config                   bench   graph    loop   host ms  GPU ms
    contiguous               634.2   615.9   634.9     0.145   0.418
    pages of 16              564.3   583.8   541.1     0.169   0.441
    pages of 64              544.4   596.5   565.4     0.191   0.432
    pages of 256             589.3   613.3   601.8     0.165   0.420
    packed, pages of 16      564.3   576.9   559.8     0.206   0.447
    packed, pages of 64      555.8   594.3   558.0     0.204   0.434

Host time stays under half the GPU time: the rows are not host-bound. The graph column is another kernel: a
capture has no tile counter, so padded problems take the one-tile grid there (``fwd_sm90._tile_counter``), which
on 3.9 beats the persistent grid's paged builds (bench/paged_tiles.py, session 25).
"""
import argparse
import cProfile
import io
import pstats

import torch

from fusedattn import bench
from fusedattn.backends import compat
from decode_overhead import gpu_ms    # bench/decode_overhead.py: ms per call of n calls back to back
from overhead import host_ms    # bench/overhead.py


def launch_paths() -> str:
    """How the Gluon kernels launched so far go: per kernel, its cached signatures by path (a shipped kernel's
    bound launch, the direct C launch, Triton's public launcher where the fast path refused: why)."""
    from fusedattn.backends.gluon import launch as gluon_launch
    paths = []
    for kernel, launcher in gluon_launch._LAUNCHERS.items():
        kinds = [("public: " + str(compat.last_refusal)) if e[3] is None else type(e[3]).__name__
                 for e in launcher.cache.values()]
        paths.append(f"{getattr(kernel, '__name__', kernel)} {sorted(set(kinds))}")
    return "; ".join(paths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true", help="cProfile 200 calls of each config")
    args = ap.parse_args()
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'config':48s} {'bench':>7s} {'graph':>7s} {'loop':>7s}  {'host ms':>8s} {'GPU ms':>7s}  launch")
    for cfg in bench.prefill_configs():
        inp = bench.make_inputs(cfg, "cuda")
        fn = bench.prepare_ours(cfg, False)(inp).fwd
        flops = bench.fwd_flops(cfg)
        tf = lambda ms: flops / ms / 1e9  # noqa: E731
        eager = bench.time_gpu_ms([fn], quick=True, graphs=False)
        graph = bench.time_gpu_ms([fn], quick=True, graphs=True)
        loop = gpu_ms(fn, n=100)
        host = host_ms(fn, n=200)
        print(f"{cfg.name:48s} {tf(eager):7.1f} {tf(graph):7.1f} {tf(loop):7.1f}  {host:8.3f} {graph:7.3f}  "
              f"{launch_paths()}", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
            print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))
        del inp, fn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
