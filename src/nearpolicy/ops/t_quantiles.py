"""Student-t quantiles for small-sample intervals and minimum detectable differences (the arena's paired
statistics, gradbias's jackknife intervals): tables, no scipy at run time."""

from __future__ import annotations

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
