"""Lab helper: the profiled kernels' metrics from Nsight Compute's raw page (``ncu --import R --page raw --csv``).

The A/B scripts that profile one call per build under ncu (``fused_ab.py``, ``fwd_ab.py``, ``profile_paged.py``)
read their elapsed cycles (``gpc__cycles_elapsed.max``: repeatable to ~0.1% where event timings move by several
percent, bench/NOTES.md 78) here, one row per profiled kernel in profiling order.
"""
import csv

CYCLES = "gpc__cycles_elapsed.max"
TENSOR = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"


def raw_table(path: str) -> tuple:
    """(header, kernel rows) of a raw page: the header is the row that starts with "ID", the units row under it
    is skipped, every later row is one profiled kernel in profiling order."""
    rows = list(csv.reader(open(path)))
    at = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    return rows[at], rows[at + 2:]


def kernel_metrics(path: str, kernel_prefix: str, expected: int, metrics=(CYCLES, )) -> list:
    """One tuple of ``metrics`` per kernel whose name starts with ``kernel_prefix``, in profiling order (numbers
    as floats, thousands separators dropped). Exits with a message unless there are ``expected`` of them: a
    profile cut short or a label list out of step with the run must not pair numbers with the wrong names."""
    head, rows = raw_table(path)
    col = {k: head.index(k) for k in ("Kernel Name", *metrics)}
    kernels = [r for r in rows if r[col["Kernel Name"]].startswith(kernel_prefix)]
    if len(kernels) != expected:
        raise SystemExit(f"{len(kernels)} {kernel_prefix} kernels in {path}, {expected} expected")
    return [tuple(float(r[col[m]].replace(",", "")) for m in metrics) for r in kernels]
