"""Student-t quantiles for small-sample intervals and minimum detectable differences (the arena's paired
statistics and its sequential rule, gradbias's jackknife intervals): tables at the 5 % level, and exact functions at
any level (the sequential rule's alpha / K), no scipy at run time.

The exact functions: `t_quantile` inverts Student's t CDF, F(t) = 1 - I_{df / (df + t^2)}(df / 2, 1 / 2) / 2
for t >= 0 (Abramowitz & Stegun 26.7.1 with 26.5.27), I the regularized incomplete beta by its continued fraction
(A&S 26.5.8, evaluated by the modified Lentz method: Press et al., Numerical Recipes, 3rd ed., sec. 6.4), by
bisection. `mde_multiplier` is the exact noncentral-t multiplier of M80 at any level: the delta with
P(|T'| > t_{1 - level / 2, df}) = power, T' = (Z + delta) / S noncentral t, S = sqrt(chi2_df / df); the power is
E_S[Phi(delta - c S) + Phi(-delta - c S)], integrated over S's density by Simpson's rule, and delta found by
bisection (tests/test_arena_sequential.py reproduces M80 at level 0.05 and checks other levels by simulation)."""

from __future__ import annotations

import functools
import math

POWER = 0.80

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""t_{0.975, df} for df = 1..30 (Student's t, two-sided 95 %; the standard table, e.g. NIST/SEMATECH e-Handbook of
Statistical Methods, sec. 1.3.6.7.2). Above 30 degrees of freedom the df = 30 value is used (conservative)."""

M80 = (16.334, 5.653, 4.256, 3.761, 3.514, 3.367, 3.270, 3.201, 3.150, 3.110, 3.078, 3.053, 3.031, 3.013, 2.998,
       2.985, 2.973, 2.963, 2.954, 2.945, 2.938, 2.932, 2.926, 2.920, 2.915, 2.911, 2.906, 2.902, 2.899, 2.895)
"""For df = 1..30: the noncentrality delta at which the two-sided 5 % t test with df degrees of freedom has power
0.80, P(|T'| > t_{0.975, df}) = 0.80 with T' noncentral t(df, delta): the MDE in units of SE. Computed by solving
that equation with the noncentral-t distribution (scipy.stats.nct, brentq; tests/test_arena_paired.py checks df 2
by simulation). Bloom's approximation t_{0.975} + t_{0.80} (5.364 at df 2) has power 0.77 there. Above 30 the df =
30 value is used (conservative)."""


def t975(df: float) -> float:
    """t_{0.975, df} from T975, df rounded down (fewer degrees of freedom: a wider bound), clamped to [1, 30]."""
    return T975[min(max(int(df), 1), len(T975)) - 1]


def m80(df: float) -> float:
    """The MDE multiplier M80 (80 % power, two-sided 5 %) for df degrees of freedom (rounded down, clamped to 1..30)."""
    return M80[min(max(int(df), 1), len(M80)) - 1]


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (A&S 26.5.8), modified Lentz, to 1e-15."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and x in [0, 1] (module docstring).
    Raises ValueError outside that domain."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"betainc needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df > 0 degrees of freedom (A&S 26.7.1 via the incomplete beta)."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=512)
def t_quantile(p: float, df: float) -> float:
    """t_{p, df}: the p-quantile of Student's t (bisection on t_cdf to a relative 1e-12). Raises ValueError unless
    0 < p < 1 and df > 0."""
    if not (0.0 < p < 1.0 and df > 0):
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2.0 * high
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
        if high - low <= 1e-12 * high:
            break
    return 0.5 * (low + high)


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def noncentral_power(delta: float, c: float, df: int, points: int = 4000) -> float:
    """P(|T'| > c), T' noncentral t with df degrees of freedom and noncentrality delta: the power of the two-sided
    t test with critical value c (module docstring; Simpson's rule over S = sqrt(chi2_df / df) on [0, 1 + 10 /
    sqrt(df)], `points` intervals)."""
    top = 1.0 + 10.0 / math.sqrt(df)
    h = top / points
    log_norm = math.log(2.0) + (df / 2.0) * math.log(df / 2.0) - math.lgamma(df / 2.0)
    total = 0.0
    for k in range(points + 1):
        s = k * h
        if s == 0.0:
            density = math.exp(log_norm) if df == 1 else 0.0
        else:
            density = math.exp(log_norm + (df - 1) * math.log(s) - df * s * s / 2.0)
        weight = 1 if k in (0, points) else 4 if k % 2 else 2
        total += weight * density * (_phi(delta - c * s) + _phi(-delta - c * s))
    return total * h / 3.0


@functools.lru_cache(maxsize=512)
def mde_multiplier(level: float, df: int, power: float = POWER) -> float:
    """M(level, df): the MDE in units of SE for the two-sided paired t test at `level` with df degrees of freedom
    and the given power: the noncentrality delta with noncentral_power(delta, t_{1 - level / 2, df}, df) = power
    (bisection to 1e-6). At level 0.05 and power 0.80 it is M80. Raises ValueError unless
    0 < level < 1, df >= 1 and 0 < power < 1."""
    if not (0.0 < level < 1.0 and df >= 1 and 0.0 < power < 1.0):
        raise ValueError(f"mde_multiplier needs 0 < level < 1, df >= 1, 0 < power < 1; got {level}, {df}, {power}")
    c = t_quantile(1.0 - level / 2.0, df)
    low, high = 0.0, c + 5.0
    while noncentral_power(high, c, df) < power:
        low, high = high, 2.0 * high
    while high - low > 1e-6:
        mid = 0.5 * (low + high)
        low, high = (mid, high) if noncentral_power(mid, c, df) < power else (low, mid)
    return 0.5 * (low + high)
