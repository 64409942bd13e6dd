"""Triton's on-disk kernel cache, checked before a cached kernel is used.

Compiled kernels live in Triton's cache (``~/.triton/cache`` or ``TRITON_CACHE_DIR``), one folder per
key; the key hashes the Triton release and its compiler's source, the target (GPU architecture and
ptxas version), the kernel's source with everything it calls, and every compile-time constant and
specialization. A kernel from another Triton, another GPU or an older fusedattn is therefore never
found: it is compiled anew.

What Triton does not check is the files themselves: a cubin truncated by a full disk or a crash, or
changed on disk, would be loaded as it is. :class:`CheckedCacheManager` is Triton's own file cache with
one addition: when a kernel's files are written, their SHA-256 digests go into the group file that
lists them, and when they are read back, a file whose digest differs makes the whole entry a miss, so
the kernel is compiled again and the entry rewritten. Each file is still written to a temporary name
and renamed into place, so processes sharing one cache never read a half-written file
(``tests/test_kernel_cache.py`` runs two processes compiling into one cache, and a corrupted entry).

:func:`install` makes it Triton's cache manager for the process, once, on fusedattn's first compile,
unless the user chose a cache manager of their own (``TRITON_CACHE_MANAGER``). Entries written by
plain Triton carry no digests and are used as Triton would use them.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional

from triton import knobs
from triton.runtime.cache import FileCacheManager

_DIGESTS = "fusedattn_sha256"


def _digest(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


class CheckedCacheManager(FileCacheManager):
    """Triton's ``FileCacheManager`` whose groups carry (and are checked against) their files' digests."""

    def put_group(self, filename: str, group: Dict[str, str]) -> str:
        digests = {name: _digest(path) for name, path in group.items()}
        contents = json.dumps({"child_paths": group, _DIGESTS: digests})
        return self.put(contents, f"__grp__{filename}", binary=False)

    def get_group(self, filename: str) -> Optional[Dict[str, str]]:
        group = super().get_group(filename)
        if not group:
            return group
        try:
            with open(self._make_path(f"__grp__{filename}")) as f:
                digests = json.load(f).get(_DIGESTS) or {}
        except (OSError, ValueError):
            return None
        for name, path in group.items():
            if name in digests and _digest(path) != digests[name]:
                return None         # a changed or truncated file: compile again (the writes replace it)
        return group


_installed = False


def install() -> None:
    """Make :class:`CheckedCacheManager` Triton's cache manager for this process, unless the user set one."""
    global _installed
    if _installed:
        return
    _installed = True
    if knobs.cache.manager_class is None and not os.environ.get("TRITON_CACHE_MANAGER"):
        knobs.cache.manager_class = CheckedCacheManager
