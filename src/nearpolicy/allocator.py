"""The trainer process's heap: keep freed memory for reuse instead of handing large blocks back to the OS.

An update allocates and frees tensors of about 100 MB every micro-batch (the LM head's logits [n, V], the tied
embedding's gradient [V, H]). glibc serves every request above its mmap threshold (32 MiB at most) with a fresh
mmap and unmaps it on free, so each such tensor is paid again in page faults and kernel zeroing: measured at about
10 % of an update of SmolLM2-135M (docs/results.md sec. 5). With mmap off (M_MMAP_MAX = 0) and a trim threshold of
1 GiB, freed blocks stay in the heap and the next micro-batch reuses them. The price: the process's RSS stays at its
high-water mark instead of shrinking between micro-batches. Engines run in their own spawned processes and keep
glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc malloc.h
GLIBC_DEFAULTS = {M_TRIM_THRESHOLD: 128 * 1024, M_MMAP_MAX: 65536}
REUSE = {M_TRIM_THRESHOLD: 1 << 30, M_MMAP_MAX: 0}


def reuse_freed_memory(enabled: bool) -> bool:
    """Switch this process's glibc allocator to keeping freed memory (`enabled`) or back to glibc's defaults.
    Returns True when the setting was applied; False where there is no glibc `mallopt` (macOS, musl, Windows),
    where it is a no-op. Config: run.reuse_freed_memory."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = REUSE if enabled else GLIBC_DEFAULTS
    return all(mallopt(param, value) == 1 for param, value in settings.items())
