"""How many CPU cores other work leaves free right now, for the llama.cpp engine's thread count.

ggml's CPU backend synchronises its threads with a spin barrier after every graph node (about 1100 per decode step
of SmolLM2). When another process takes one of the cores a 2-thread engine runs on, each barrier waits for a
descheduled thread: measured on a loaded 2-core Intel Xeon, 32 sequences x 32 tokens ran at 3.0 tokens/s with 2
threads and 15.7 with 1 (docs/results.md sec. 10). The engine therefore runs each generate / greedy call with at
most the cores idle just before it (`fit_threads`); llama.cpp's results do not depend on its thread count
(tests/test_cpu_load.py holds the log-probs bit for bit). Linux only (/proc/stat); elsewhere the configured count."""

from __future__ import annotations

import os
import time

WINDOW_S = 0.05  # how long the idle share is sampled before a call: short against a rollout (seconds)


def _allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on (its affinity mask), None where the platform has no such call."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _cpu_times(path: str = "/proc/stat", cpus: set[int] | None = None) -> tuple[int, int] | None:
    """(idle, total) jiffies summed over the per-CPU lines of `cpus` (default: this process's affinity mask, so a
    container pinned to 2 of a host's 64 cores reads its own 2), idle including iowait; None when unreadable."""
    cpus = _allowed_cpus() if cpus is None else cpus
    idle = total = 0
    try:
        with open(path) as f:
            for line in f:
                name, *fields = line.split()
                if not (name.startswith("cpu") and name[3:].isdigit()):
                    continue
                if cpus is not None and int(name[3:]) not in cpus:
                    continue
                values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                idle, total = idle + values[3] + values[4], total + sum(values)
    except (OSError, ValueError, IndexError):
        return None
    return (idle, total) if total > 0 else None


def free_cores(window_s: float = WINDOW_S, read=_cpu_times) -> float | None:
    """Cores idle on average over the next `window_s` seconds (0 .. the CPUs this process may use), None when
    /proc/stat is unreadable. `read` returns (idle, total) jiffies over those CPUs (a test hook)."""
    before = read()
    time.sleep(window_s)
    after = read()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * len(_allowed_cpus() or range(os.cpu_count() or 1))


def fit_threads(configured: int, free: float | None) -> int:
    """The thread count to run with: `configured`, lowered to the free cores rounded to the nearest whole core
    (at least 1); `configured` when the free cores are unknown (None)."""
    if free is None:
        return configured
    return max(1, min(configured, int(free + 0.5)))
