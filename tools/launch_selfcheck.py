"""Run the direct launch path's self-check (fusedattn/backends/selfcheck.py) on this GPU and Triton and
print its verdict with the reason, then time one launch both ways.

    python tools/launch_selfcheck.py
"""
import time
import warnings

import torch
import triton

from fusedattn.backends import compat, selfcheck

warnings.simplefilter("always")
print(f"Triton {triton.__version__}, supported {compat.SUPPORTED}, GPU {torch.cuda.get_device_name()}")
for tma in (False, True):
    if tma and torch.cuda.get_device_capability()[0] != 9:
        continue
    t = time.perf_counter()
    ok = selfcheck.fast_launch_ok(tma)
    print(f"{'tma' if tma else 'plain'}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - t:.2f} s); "
          f"last refusal: {compat.last_refusal or '-'}")
