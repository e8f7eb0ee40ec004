"""R-OPD's gradient trigger: has the mean gradient stopped moving by more than its own noise?

Reconstructed from the abstract of the R-OPD paper (the exact rule and constants are not public to us): during
on-policy distillation, compare the mean gradient of consecutive steps; when the change is within the mini-batch
noise `patience` steps in a row (twice, by default), switch the rollout source to the initial policy
(rollouts/curriculum.py does the switch; docs/math.md sec. 15.2).

Inputs are gradient estimates x_j [m, d], one per micro-batch j of a step, each an estimate of the step's mean
gradient (d coordinates: the whole flattened gradient or a fixed subset of its coordinates, the same at every step).
With gbar_t = mean_j x_j and SE_t^2 = sum_j ||x_j - gbar_t||^2 / (m (m - 1)) (the squared standard error of gbar_t):

    change_t = ||gbar_t - gbar_{t-1}||,  noise_t = z sqrt(SE_t^2 + SE_{t-1}^2),  quiet_t = change_t <= noise_t

noise_t is z standard errors of the difference of two independent means: with no true change,
E ||gbar_t - gbar_{t-1}||^2 = SE_t^2 + SE_{t-1}^2 (our choice of the reference scale: the rule as we have it says
"within the mini-batch variation" and gives no formula). A step with no previous one, with a non-finite statistic,
or with zero noise (no gradient seen on the coordinates: nothing to compare with) is never quiet. Units: those of
the gradient (loss per parameter unit)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlateauCheck:
    """One step of the trigger. Scalars are 0-dim tensors, float64 unless said: change ||gbar_t - gbar_{t-1}|| (NaN
    without a previous step), noise z sqrt(SE_t^2 + SE_{t-1}^2) (NaN without one), se2 SE_t^2; quiet (bool),
    streak (int64: consecutive quiet steps ending here), triggered (bool: streak >= patience); mean gbar_t [d] (the
    next step's previous mean)."""

    change: torch.Tensor
    noise: torch.Tensor
    se2: torch.Tensor
    quiet: torch.Tensor
    streak: torch.Tensor
    triggered: torch.Tensor
    mean: torch.Tensor


def gradient_plateau(estimates: torch.Tensor, previous_mean: torch.Tensor | None,
                     previous_se2: torch.Tensor | float | None, streak: int, z: float = 1.0,
                     patience: int = 2) -> PlateauCheck:
    """R-OPD's trigger for one step (module docstring). estimates [m, d] (m >= 2 micro-batch estimates of the mean
    gradient, any float dtype, read in float64, detached); previous_mean [d] and previous_se2 (scalar) of the previous
    step (None at the first step); streak: consecutive quiet steps before this one; z > 0; patience >= 1. Returns a
    PlateauCheck. Raises ValueError for fewer than 2 estimates, a previous mean of another size, z <= 0 or
    patience < 1. Reconstructed from the abstract of the R-OPD paper (see the module docstring)."""
    if estimates.dim() != 2 or estimates.shape[0] < 2:
        raise ValueError(f"need estimates [m, d] with m >= 2 micro-batches, got shape {tuple(estimates.shape)}")
    if not z > 0 or patience < 1:
        raise ValueError(f"need z > 0 and patience >= 1, got z = {z}, patience = {patience}")
    x = estimates.detach().double()
    m = x.shape[0]
    mean = x.mean(0)
    se2 = ((x - mean) ** 2).sum() / (m * (m - 1))
    nan = torch.tensor(math.nan, dtype=torch.float64)
    if previous_mean is None or previous_se2 is None:
        change, noise = nan, nan
    else:
        if previous_mean.shape != mean.shape:
            raise ValueError(f"previous mean of shape {tuple(previous_mean.shape)}, this step's {tuple(mean.shape)}")
        change = torch.linalg.vector_norm(mean - previous_mean.double())
        noise = z * torch.sqrt(se2 + torch.as_tensor(previous_se2, dtype=torch.float64))
    quiet = (change <= noise) & (noise > 0)  # NaN compares False: never quiet without a previous step
    run = torch.where(quiet, torch.tensor(streak + 1), torch.tensor(0))
    return PlateauCheck(change, noise, se2, quiet, run, run >= patience, mean)
