"""Paired statistics of two arena arms: the difference a - b of an accuracy over matched seeds, and over eval
problems x seeds where each eval problem's outcome is recorded. Pure: numbers in, numbers out.

Every cell of an arena with the same seed shares that seed's training-data order and sampling seeds, and every cell
scores the same held-out problems, so two arms' accuracies are paired by seed (and by problem): the seed's own
luck (a hard data order) is shared and cancels in the difference. Two methods (docs/arena.md, "Paired statistics"):

- **Over seeds** (`paired_seeds`): d_s = a_s - b_s over the seeds both arms have; the mean d, its standard error
  over seeds sd(d_s) / sqrt(n) and the 95 % confidence interval d +- t_{0.975, n-1} SE (the paired t interval).
  That alone is given the eval set: its problems are fixed, so it speaks of these problems, not the task's
  population of problems. Where each problem's outcome is not recorded, the eval set's share is bounded below
  from the seeds' counts of correct answers (`problem_noise_floor`) and added in quadrature: SE^2 = (sd(d_s) /
  sqrt(n))^2 + floor^2, so the interval counts at least the eval-set noise the counts prove.
- **Over problems x seeds** (`paired_bootstrap`): D[s, p] = a[s, p] - b[s, p], the outcomes (reward in [0, 1]) of
  problem p at seed s; its mean is the difference of the mean accuracies. A replicate resamples seeds and problems
  independently with replacement (the same draws for both arms: the pairing is kept) and takes the mean of D over
  the drawn seeds x drawn problems (the two-way "pigeonhole" bootstrap: Owen 2007, Ann. Appl. Stat. 1(2), 386-411,
  which is conservative: it counts the seed x problem interaction more than once). The 95 % interval is the 2.5 / 97.5
  percentiles of REPLICATES replicates (a fixed generator seed: the page is reproducible); SE their sd. This one
  includes the problem-sampling noise of a finite eval set.

The minimum detectable difference (MDE) at 80 % power, two-sided 5 %: for the paired t, M80[df] x SE with M80 the
exact noncentral-t multiplier (below); for the bootstrap, (z_0.975 + z_0.80) x SE = 2.802 x SE (normal). Both treat
the observed SE as the true one (Bloom 1995, Evaluation Review 19(5), 547-556: MDE = multiplier x SE).

A difference is *detected* when its 95 % interval excludes 0; otherwise it is worded "no difference detected (CI
[lo, hi], MDE m)", never as the arms being the same."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nearpolicy.ops.t_quantiles import M80, T975, m80, t975  # noqa: F401 (re-exported)

NO_SPREAD = 1e-12  # an SE this small is float rounding of equal differences (0.3 - 0.2 vs 0.7 - 0.6): no spread
Z_MDE = 1.959964 + 0.841621  # z_0.975 + z_0.80: the normal MDE multiplier (the bootstrap's)
REPLICATES = 10_000
BOOTSTRAP_SEED = 0
MOST_SEEDS = 400  # seeds_for_mde looks no further


@dataclass(frozen=True)
class Paired:
    """A paired difference a - b: its estimate, 95 % interval (low, high), standard error, MDE at 80 % power and
    what it was paired over. `method` is "seeds" (paired t, df = seeds - 1) or "problems x seeds" (the bootstrap,
    df None); `seeds` and `problems` count the units (problems None for the seed method); `per_seed` the seeds'
    differences (seed, d_s) in seed order (the seed method) or the seeds' mean differences over problems. For the
    seed method `se` = sqrt(se_seeds^2 + eval_floor^2): the seeds' SE and the eval set's (problem_noise_floor; 0 when
    not given)."""

    method: str
    difference: float
    low: float
    high: float
    se: float
    mde: float
    seeds: int
    problems: int | None = None
    df: int | None = None
    per_seed: tuple[tuple[int, float], ...] = ()
    se_seeds: float | None = None
    eval_floor: float | None = None

    @property
    def detected(self) -> bool:
        """Whether the 95 % interval excludes 0."""
        return self.low > 0 or self.high < 0


def problem_noise_floor(count_differences: list[int], problems: int) -> float:
    """A lower bound on the standard error that sampling the `problems` eval problems adds to a paired difference of
    mean accuracies, from the seeds' differences in correct answers alone (k_a,s - k_b,s, ints; S seeds), when
    each problem's outcome is not recorded. The problem part of the two-way bootstrap's variance is at least
    Var_p(delta_p) / P, delta_p = mean over seeds of the outcome difference on problem p (a multiple of 1 / S; they
    sum to net / S, net = sum of the count differences), least when the |net| units of 1 / S are spread as evenly
    as the problems allow: q = |net| // P, r = |net| % P: r problems at (q + 1) / S, the rest at q / S; so
    Var_p >= (r (q + 1)^2 + (P - r) q^2) / (S^2 P) - (net / (S P))^2. 0 when the net difference is 0 (the bound
    says nothing then). Raises ValueError without seeds or problems."""
    if not count_differences or problems < 1:
        raise ValueError("problem_noise_floor needs at least one seed and one problem")
    n_seeds, net = len(count_differences), abs(sum(count_differences))
    q, r = divmod(net, problems)
    mean_square = (r * (q + 1) ** 2 + (problems - r) * q ** 2) / (n_seeds ** 2 * problems)
    variance = max(0.0, mean_square - (net / (n_seeds * problems)) ** 2)
    return math.sqrt(variance / problems)


def paired_seeds(a: dict[int, float], b: dict[int, float], eval_floor: float = 0.0) -> Paired | None:
    """The paired t of a - b over the seeds both dicts (seed -> accuracy) hold: mean d, se_seeds = sd(d_s) /
    sqrt(n) (sample sd), SE = sqrt(se_seeds^2 + eval_floor^2), CI d +- t975(n - 1) SE, MDE m80(n - 1) SE. With
    eval_floor 0 it is the plain paired t (given the eval set). None with fewer than 2 matched seeds (no sd)."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    d = [a[s] - b[s] for s in seeds]
    n = len(d)
    mean = math.fsum(d) / n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in d) / (n - 1))
    se_seeds = sd / math.sqrt(n)
    se = math.hypot(se_seeds, eval_floor)
    half = t975(n - 1) * se
    return Paired("seeds", mean, mean - half, mean + half, se, m80(n - 1) * se, n, None, n - 1,
                  tuple(zip(seeds, d)), se_seeds, eval_floor)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, seeds: list[int] | None = None, replicates: int = REPLICATES,
                     generator_seed: int = BOOTSTRAP_SEED) -> Paired:
    """The two-way paired bootstrap (module docstring) of mean(a) - mean(b): a, b [S, P] float outcomes (reward in
    [0, 1]) of P problems at S seeds, row s of both from the same seed, column p the same problem. Each replicate
    draws S seeds and P problems with replacement (numpy default_rng(generator_seed)) and takes the mean of
    D = a - b over the drawn rows x columns; CI the 2.5 / 97.5 % percentiles, SE the replicates' sd, MDE Z_MDE x
    SE. Raises ValueError for shapes that differ or an empty table."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2 or 0 in a.shape:
        raise ValueError(f"paired_bootstrap needs two [seeds, problems] tables of one shape, got {a.shape}, {b.shape}")
    d = a - b
    n_seeds, n_problems = d.shape
    rng = np.random.default_rng(generator_seed)
    # counts of each seed / problem in each replicate: the mean over drawn seeds x problems is c_s @ D @ c_p / (S P)
    c_seed = rng.multinomial(n_seeds, np.full(n_seeds, 1 / n_seeds), size=replicates).astype(np.float64)
    c_problem = rng.multinomial(n_problems, np.full(n_problems, 1 / n_problems), size=replicates).astype(np.float64)
    stats = np.einsum("rs,sp,rp->r", c_seed, d, c_problem) / (n_seeds * n_problems)
    low, high = np.quantile(stats, [0.025, 0.975])
    se = float(stats.std(ddof=1))
    labels = seeds if seeds is not None else list(range(n_seeds))
    return Paired("problems x seeds", float(d.mean()), float(low), float(high), se, Z_MDE * se, n_seeds, n_problems,
                  None, tuple((s, float(row.mean())) for s, row in zip(labels, d)))


def seeds_for_mde(p: Paired, target: float, most: int = MOST_SEEDS) -> int | None:
    """The fewest seeds n >= 2 at which a paired t comparison with this one's spread would have MDE <= `target`
    (accuracy units): the SE scaled as 1 / sqrt(n) from the observed one (p.se at p.seeds seeds; the seeds' spread
    and the eval-set floor both shrink so with more seeds), m80(n - 1) x p.se x sqrt(p.seeds / n) <= target. A
    planning figure that takes the observed spread as the true one (3 seeds estimate it loosely). None when `most`
    seeds would not do, for a bootstrap comparison (p.method != "seeds"), and without an observed spread (fewer than
    2 seeds, an SE not finite or at most NO_SPREAD). Raises ValueError unless target > 0 (NaN included)."""
    if not target > 0:
        raise ValueError(f"seeds_for_mde needs a target > 0, got {target}")
    if p.method != "seeds" or p.seeds < 2 or not math.isfinite(p.se) or p.se <= NO_SPREAD:
        return None  # no spread observed: nothing to scale
    for n in range(2, most + 1):
        if m80(n - 1) * p.se * math.sqrt(p.seeds / n) <= target:
            return n
    return None


def verdict(p: Paired) -> str:
    """'difference detected: +0.050 (CI [+0.025, +0.075], MDE 0.033)' or 'no difference detected (CI [-0.100,
    +0.150], MDE 0.210)': the 95 % interval and the MDE at 80 % power beside every estimate; 'not established'
    when the SE is at most NO_SPREAD (every seed's difference the same up to float rounding: no spread to bound it)."""
    if p.se <= NO_SPREAD:
        return (f"not established: every {'seed' if p.problems is None else 'draw'}'s difference is "
                f"{p.difference:+.3f} (sd 0 over {p.seeds} seeds), so there is no spread to bound it")
    said = f"CI [{p.low:+.3f}, {p.high:+.3f}], MDE {p.mde:.3f}"
    if p.detected:
        return f"difference detected: {p.difference:+.3f} ({said})"
    return f"no difference detected ({said})"
