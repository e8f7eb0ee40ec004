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


def _cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(idle, total) jiffies of the aggregate "cpu" line, idle including iowait; None when unreadable."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return values[3] + values[4], sum(values)


def free_cores(window_s: float = WINDOW_S, read=_cpu_times) -> float | None:
    """Cores idle on average over the next `window_s` seconds (0 .. os.cpu_count()), None when /proc/stat is
    unreadable. `read` returns (idle, total) jiffies (a test hook)."""
    before = read()
    time.sleep(window_s)
    after = read()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def fit_threads(configured: int, free: float | None) -> int:
    """The thread count to run with: `configured`, lowered to the free cores rounded to the nearest whole core
    (at least 1); `configured` when the free cores are unknown (None)."""
    if free is None:
        return configured
    return max(1, min(configured, int(free + 0.5)))
