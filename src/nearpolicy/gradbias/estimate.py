"""Bias, variance and cosine of a correction's gradient against the on-policy gradient, from paired replicates.

Replicate batch n (n = 1..N) gives the reference gradient X_n (samples of the trainer's own policy, no correction)
and, on the same prompts, a cell's gradient Y_n (samples of a mismatched engine, one correction applied). Every
statistic is a function of the three N x N Gram matrices <X_i, X_j>, <Y_i, Y_j>, <Y_i, X_j>, so a gradient is
only ever needed through inner products (sketch.py stores it as a count-sketch). With D_n = Y_n - X_n, S the
sample covariance (N - 1 denominator) and bars the means over n:

  ||g*||^2          = ||Xbar||^2 - tr S_X / N                   (unbiased for ||E X||^2)
  bias^2            = ||Dbar||^2 - tr S_D / N                   (unbiased for ||E Y - E X||^2; may come out < 0)
  <E Y, E X>        = <Ybar, Xbar> - tr S_YX / N;  ||E Y||^2 = ||Ybar||^2 - tr S_Y / N
  cosine            = <E Y, E X> / sqrt(||E Y||^2 ||E X||^2)
  variance          = tr S_Y  (one batch's mean squared distance from E Y);  MSE = bias^2 + variance

Relative figures divide by ||g*||^2 (rel_bias = sqrt(max(bias^2, 0)) / ||g*||). Confidence intervals: the
delete-one jackknife over the replicate index n (pairs left out together, so a difference between two corrections
on the same batches is a paired one) with Student-t quantiles on N - 1 degrees of freedom (`jackknife`). The
percentile bootstrap was tried first and undercovers here: on the main model at N = 10 its interval for the null
source's bias^2 excluded 0, with a spread 2.5x narrower than the jackknife's (docs/gradbias.md). The debiased
squared norm is a U-statistic (mean of <D_i, D_j> over i != j), for which the jackknife variance is the standard,
slightly conservative estimate (Efron & Stein 1981, Ann. Statist. 9(3)); the noise term tr S / N is the variance of
a mean of N independent replicates."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nearpolicy.ops.t_quantiles import m80, t975

Z_95, Z_80_POWER = 1.959964, 0.841621  # two-sided 95 % and one-sided 80 % power normal quantiles
STATISTICS = ("rel_bias", "rel_bias2", "cosine", "rel_variance", "rel_mse")


@dataclass(frozen=True)
class Grams:
    """The inner products of one cell with the reference, each [N, N] float64: xx[i, j] = <X_i, X_j>,
    yy[i, j] = <Y_i, Y_j>, yx[i, j] = <Y_i, X_j>."""

    xx: np.ndarray
    yy: np.ndarray
    yx: np.ndarray

    def __post_init__(self) -> None:
        n = self.xx.shape[0]
        if n < 2 or any(g.shape != (n, n) for g in (self.xx, self.yy, self.yx)):
            raise ValueError(f"need three N x N Gram matrices with N >= 2 replicates, got shapes "
                             f"{self.xx.shape}, {self.yy.shape}, {self.yx.shape}")


def _mean_products(g: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    """(<Abar, Bbar>, sum_n c_n <A_n, B_n>) of Gram g[i, j] = <A_i, B_j> under replicate multiplicities `counts`."""
    n = counts.sum()
    return float(counts @ g @ counts) / n ** 2, float(counts @ np.diag(g))


def _debiased(g: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    """(<E A, E B> estimate, tr of the sample cross-covariance S_AB) from Gram g under `counts`."""
    n = counts.sum()
    mean, total = _mean_products(g, counts)
    trace = (total - n * mean) / (n - 1)
    return mean - trace / n, trace


def point_statistics(grams: Grams, counts: np.ndarray | None = None) -> dict[str, float]:
    """The module docstring's statistics at replicate multiplicities `counts` [N] (None: each replicate once):
    ref_norm2, bias2 (absolute, squared gradient units), rel_bias2 = bias2 / ref_norm2, rel_bias, cosine,
    rel_variance, rel_mse. NaN where ||g*||^2 or ||E Y||^2 estimates <= 0 (too few replicates to see g*)."""
    c = np.ones(grams.xx.shape[0]) if counts is None else np.asarray(counts, float)
    ref_norm2, _ = _debiased(grams.xx, c)
    mean_norm2, var_y = _debiased(grams.yy, c)
    inner, _ = _debiased(grams.yx, c)
    dd = grams.yy - grams.yx - grams.yx.T + grams.xx
    bias2, _ = _debiased(dd, c)
    if ref_norm2 <= 0:
        nan = float("nan")
        return dict(ref_norm2=ref_norm2, bias2=bias2, rel_bias2=nan, rel_bias=nan, cosine=nan, rel_variance=nan,
                    rel_mse=nan)
    cosine = inner / math.sqrt(mean_norm2 * ref_norm2) if mean_norm2 > 0 else float("nan")
    return dict(ref_norm2=ref_norm2, bias2=bias2, rel_bias2=bias2 / ref_norm2,
                rel_bias=math.sqrt(max(bias2, 0.0) / ref_norm2), cosine=float(np.clip(cosine, -1, 1)),
                rel_variance=var_y / ref_norm2, rel_mse=(bias2 + var_y) / ref_norm2)


@dataclass(frozen=True)
class Estimate:
    """A point value with its 95 % interval, standard error `sd` and the degrees of freedom `df` of its t quantiles
    (None: normal)."""

    value: float
    low: float
    high: float
    sd: float
    df: int | None = None

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    @property
    def mde(self) -> float:
        """The smallest true value a two-sided 5 % test detects with 80 % power at this `sd` (noncentral-t multiplier
        for `df`, ops/t_quantiles.m80)."""
        return (Z_95 + Z_80_POWER if self.df is None else m80(self.df)) * self.sd

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high, "sd": self.sd, "df": self.df}


def jackknife(statistic: Callable[[np.ndarray | None], float], replicates: int) -> Estimate:
    """statistic(counts) at every replicate (counts None) and with each replicate left out (counts a 0/1 vector [N]):
    the estimate with its delete-one jackknife standard error and a t interval on N - 1 degrees of freedom."""
    value = statistic(None)
    loo = np.array([statistic(np.where(np.arange(replicates) == i, 0.0, 1.0)) for i in range(replicates)])
    if not np.isfinite(value) or not np.all(np.isfinite(loo)):
        return Estimate(value, float("nan"), float("nan"), float("nan"), replicates - 1)
    se = math.sqrt((replicates - 1) / replicates * float(((loo - loo.mean()) ** 2).sum()))
    half = t975(replicates - 1) * se
    return Estimate(value, value - half, value + half, se, replicates - 1)


def cell_estimates(grams: Grams) -> dict[str, Estimate]:
    """Every statistic of `point_statistics` (STATISTICS) with its jackknife interval."""
    n = grams.xx.shape[0]
    out = {k: jackknife(lambda c, k=k: point_statistics(grams, c)[k], n) for k in STATISTICS}
    out["rel_bias"] = root(out["rel_bias2"])  # the norm's interval from its square's (which may reach below 0)
    cos = out["cosine"]
    out["cosine"] = Estimate(cos.value, max(cos.low, -1.0), min(cos.high, 1.0), cos.sd, cos.df)
    return out


def bias2_change(base: Grams, other: Grams) -> Estimate:
    """rel_bias2(other) - rel_bias2(base) for two corrections on the same batches against the same reference (e.g.
    base = no correction): below 0 when `other` lands closer to g*. Paired: the reference's noise and the batches'
    shared noise cancel in the difference, so its interval is far tighter than either bias^2's. Jackknife interval."""

    def value(c: np.ndarray | None) -> float:
        return point_statistics(other, c)["rel_bias2"] - point_statistics(base, c)["rel_bias2"]

    return jackknife(value, base.xx.shape[0])


def root(e: Estimate) -> Estimate:
    """sqrt of a squared quantity's Estimate, bounds included (negative parts read as 0): the interval of a norm
    from the interval of its debiased square."""
    f = lambda v: math.sqrt(max(v, 0.0)) if np.isfinite(v) else float("nan")  # noqa: E731
    sd = e.sd / (2 * f(e.value)) if f(e.value) > 0 else float("nan")
    return Estimate(f(e.value), f(e.low), f(e.high), sd, e.df)


def relative_shift(ref_xx: np.ndarray, base: Grams) -> Estimate:
    """||E Y - E X|| / ||g*|| for two corrections on the same batches: `base` holds X = the baseline correction's
    sketches (base.xx) and Y = the other's (base.yy, base.yx = <Y_i, X_j>); ref_xx [N, N] the reference's Gram
    (||g*||^2). Paired over the same batches, so the batch noise they share cancels: this is how far the
    correction moves the expected gradient, an upper bound on the bias it can remove (triangle inequality). The
    interval is the root of the squared shift's jackknife interval."""

    def value(c: np.ndarray | None) -> float:
        cc = np.ones(ref_xx.shape[0]) if c is None else c
        ref, _ = _debiased(ref_xx, cc)
        return point_statistics(base, c)["bias2"] / ref if ref > 0 else float("nan")

    return root(jackknife(value, ref_xx.shape[0]))


def mean_interval(values: np.ndarray) -> Estimate:
    """Mean of per-replicate values [N] with a t 95 % interval from their standard error (batch means)."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if v.size < 2:
        m = float(v.mean()) if v.size else float("nan")
        return Estimate(m, float("nan"), float("nan"), float("nan"))
    se = float(v.std(ddof=1) / math.sqrt(v.size))
    half = t975(v.size - 1) * se
    return Estimate(float(v.mean()), float(v.mean() - half), float(v.mean() + half), se, int(v.size - 1))
