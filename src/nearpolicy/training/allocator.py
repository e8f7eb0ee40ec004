"""The trainer process's heap: keep freed memory for reuse within an update instead of handing large blocks back to
the OS after every micro-batch.

An update allocates and frees tensors of about 100 MB every micro-batch (the LM head's logits [n, V], the tied
embedding's gradient [V, H]). glibc serves every request above its mmap threshold (32 MiB at most) with a fresh
mmap and unmaps it on free, so each such tensor is paid again in page faults and kernel zeroing: about 10 % of a
micro-batch of SmolLM2-135M (docs/results.md sec. 5). With mmap off (M_MMAP_MAX = 0) and a trim threshold of 1 GiB,
freed blocks stay in the heap and the next micro-batch reuses them. A heap that never returns memory fragments and
its RSS creeps upward over many steps, so `release_freed_memory` (malloc_trim) hands the free pages back once per
update. Engine processes (llama.cpp, vLLM) are spawned and keep glibc's defaults; the hf engine runs in the trainer
process and shares its heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import resource
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc malloc.h
GLIBC_DEFAULTS = {M_TRIM_THRESHOLD: 128 * 1024, M_MMAP_MAX: 65536}
REUSE = {M_TRIM_THRESHOLD: 1 << 30, M_MMAP_MAX: 0}
_state = {"enabled": False}


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc's C library, or None (macOS, musl, Windows). Cached: find_library runs ldconfig in a subprocess, and
    release_freed_memory asks once per update."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def reuse_freed_memory(enabled: bool) -> bool:
    """Switch this process's glibc allocator to keeping freed memory (`enabled`), or back to glibc's default limits
    when this function had switched it on (otherwise False leaves the allocator untouched: any mallopt call turns
    off glibc's dynamic mmap threshold for good). Returns True when the process is in the asked state; False where
    there is no glibc `mallopt`, where this is a no-op. Config: run.reuse_freed_memory."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    if not enabled and not _state["enabled"]:
        return True
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = REUSE if enabled else GLIBC_DEFAULTS
    applied = all(libc.mallopt(param, value) == 1 for param, value in settings.items())
    _state["enabled"] = enabled and applied
    return applied


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc malloc_trim(0)) when reuse_freed_memory is on; called once
    per update, so micro-batches reuse the heap while RSS does not creep over a long run. No-op otherwise."""
    libc = _libc() if _state["enabled"] else None
    if libc is not None:
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.malloc_trim(0)


def peak_memory() -> dict[str, float]:
    """Peak resident memory so far, MiB: `memory/peak_rss_mib` of this (the trainer's) process (ru_maxrss), and
    `memory/children_peak_rss_mib`, the sum of the peaks (VmHWM) of its live direct child processes (the engine and
    scoring processes, multiprocessing's resource tracker; not their own children, e.g. vLLM's engine core; a sum of
    peaks, so at least the peak of the sum, and it drops when a child ends). Linux /proc for the children; else 0."""
    children = 0.0
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        try:  # a thread or a child may end between the listing and the read
            pids = task.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            children += next((int(line.split()[1]) / 1024 for line in status.splitlines()
                              if line.startswith("VmHWM:")), 0.0)
    return {"memory/peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "memory/children_peak_rss_mib": children}
