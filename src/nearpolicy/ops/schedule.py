"""Learning-rate schedules over a run's training steps (config algorithm.lr_schedule, warmup_steps, min_lr_ratio).

The rate of training step s (0-based, s < S = run.steps), peak rate L, W warmup steps, floor ratio m:
    s < W:            L (s + 1) / W                               (linear warmup; step W - 1 reaches L)
    s >= W, p = (s - W) / max(1, S - 1 - W) in [0, 1]:
        constant:     L
        linear:       L (m + (1 - m)(1 - p))
        cosine:       L (m + (1 - m)(1 + cos(pi p)) / 2)          (SGDR, arXiv:1608.03983 eq. 5, one cycle)
so the last step runs at m L for linear and cosine (when S > W + 1). The schedule is a pure function of the step,
so a resumed run continues it without stored state; config refuses W >= S, and a resume that changes run.steps
under a decaying schedule (runs.start_checks.check_same_config)."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def learning_rate(step: int, total_steps: int, peak: float, schedule: str = "constant", warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0) -> float:
    """The learning rate of training step `step` (module docstring). Raises ValueError for an unknown schedule,
    a step outside [0, total_steps), a negative warmup or a floor ratio outside [0, 1]."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} is outside the run's [0, {total_steps}) steps")
    if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"need warmup_steps >= 0 and 0 <= min_lr_ratio <= 1, got {warmup_steps}, {min_lr_ratio}")
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)
    remaining = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * remaining)
