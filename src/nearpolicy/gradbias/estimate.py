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

Relative figures divide by ||g*||^2 (rel_bias = sqrt(max(bias^2, 0)) / ||g*||). Confidence intervals: percentile
bootstrap over the replicate index n, centred on the point estimate (`interval`; pairs resampled together, all cells of a source with the same draws, so a
difference between two corrections is a paired one). Sources: the plug-in U-statistic debiasing of a squared norm
is standard (e.g. Efron & Tibshirani 1993 ch. 10 on bias correction); the noise term tr S / N is the variance of a
mean of N independent replicates."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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


def bootstrap_counts(replicates: int, draws: int, seed: int) -> np.ndarray:
    """[draws, replicates] float multiplicities of a bootstrap over the replicate index (seeded, so every cell of
    a source is resampled with the same draws)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, replicates, size=(draws, replicates))
    return np.stack([np.bincount(row, minlength=replicates) for row in picks]).astype(float)


@dataclass(frozen=True)
class Estimate:
    """A point value with its 95 % percentile-bootstrap interval and bootstrap standard deviation `sd`."""

    value: float
    low: float
    high: float
    sd: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    @property
    def mde(self) -> float:
        """The smallest true value a two-sided 5 % test detects with 80 % power at this `sd`."""
        return (Z_95 + Z_80_POWER) * self.sd

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high, "sd": self.sd}


def interval(value: float, draws: np.ndarray) -> Estimate:
    """Estimate of `value` from its bootstrap draws [B] (NaN draws dropped; fewer than 2 give a NaN interval): the
    95 % percentile interval of the draws moved so that their median sits on `value`. The move matters here: a
    resample repeats replicates, so the noise terms tr S / N that the debiased statistics subtract are not those of
    the draws' own replicates, and the plain percentile interval centres on the plug-in value instead (a bias of
    the order of tr Var / N; tests/test_gradbias.py shows it)."""
    finite = draws[np.isfinite(draws)]
    if finite.size < 2 or not np.isfinite(value):
        return Estimate(value, float("nan"), float("nan"), float("nan"))
    low, mid, high = np.quantile(finite, [0.025, 0.5, 0.975])
    return Estimate(value, float(value + low - mid), float(value + high - mid), float(finite.std(ddof=1)))


def cell_estimates(grams: Grams, counts: np.ndarray) -> dict[str, Estimate]:
    """Every statistic of `point_statistics` (STATISTICS) with its bootstrap interval over `counts`
    [B, N] (bootstrap_counts)."""
    point = point_statistics(grams)
    draws = [point_statistics(grams, c) for c in counts]
    out = {k: interval(point[k], np.array([d[k] for d in draws])) for k in STATISTICS}
    out["rel_bias"] = root(out["rel_bias2"])  # the norm's interval from its square's (which may reach below 0)
    cos = out["cosine"]
    out["cosine"] = Estimate(cos.value, max(cos.low, -1.0), min(cos.high, 1.0), cos.sd)
    return out


def bias2_change(base: Grams, other: Grams, counts: np.ndarray) -> Estimate:
    """rel_bias2(other) - rel_bias2(base) for two corrections on the same batches against the same reference (e.g.
    base = no correction): below 0 when `other` lands closer to g*. Paired: the reference's noise and the batches'
    shared noise cancel in the difference, so its interval is far tighter than either bias^2's. Bootstrap interval
    over `counts` [B, N]."""

    def value(c: np.ndarray | None) -> float:
        return point_statistics(other, c)["rel_bias2"] - point_statistics(base, c)["rel_bias2"]

    return interval(value(None), np.array([value(c) for c in counts]))


def root(e: Estimate) -> Estimate:
    """sqrt of a squared quantity's Estimate, bounds included (negative parts read as 0): the interval of a norm
    from the interval of its debiased square."""
    f = lambda v: math.sqrt(max(v, 0.0)) if np.isfinite(v) else float("nan")  # noqa: E731
    sd = e.sd / (2 * f(e.value)) if f(e.value) > 0 else float("nan")
    return Estimate(f(e.value), f(e.low), f(e.high), sd)


def relative_shift(ref_xx: np.ndarray, base: Grams, counts: np.ndarray) -> Estimate:
    """||E Y - E X|| / ||g*|| for two corrections on the same batches: `base` holds X = the baseline correction's
    sketches (base.xx) and Y = the other's (base.yy, base.yx = <Y_i, X_j>); ref_xx [N, N] the reference's Gram
    (||g*||^2). Paired over the same batches, so the batch noise they share cancels: this is how far the
    correction moves the expected gradient, an upper bound on the bias it can remove (triangle inequality). The
    interval is the root of the squared shift's bootstrap interval over `counts` [B, N]."""

    def value(c: np.ndarray | None) -> float:
        cc = np.ones(ref_xx.shape[0]) if c is None else c
        ref, _ = _debiased(ref_xx, cc)
        return point_statistics(base, c)["bias2"] / ref if ref > 0 else float("nan")

    return root(interval(value(None), np.array([value(c) for c in counts])))


def mean_interval(values: np.ndarray) -> Estimate:
    """Mean of per-replicate values [N] with a normal 95 % interval from their standard error (batch means)."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if v.size < 2:
        m = float(v.mean()) if v.size else float("nan")
        return Estimate(m, float("nan"), float("nan"), float("nan"))
    se = float(v.std(ddof=1) / math.sqrt(v.size))
    return Estimate(float(v.mean()), float(v.mean() - Z_95 * se), float(v.mean() + Z_95 * se), se)
