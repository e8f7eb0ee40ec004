"""The arena's comparisons of two arms, paired (paired.py): every correction against the baseline correction under
each source, and every source against the first source for each correction (e.g. eta4 vs eta1, G8 vs G2).

For each comparison and each outcome of OUTCOMES (the final and the best accuracy, the eval AUC and the mean
training reward of the last N steps: table.py, outcomes.py): the paired difference over the seeds both arms finished
with that outcome (a seed's cells share its data order and sampling seeds; every cell scores the same eval
problems), its 95 % CI and MDE at 80 % power (paired.paired_seeds). For the final and best accuracy the eval set's
noise counts at least its lower bound paired.problem_noise_floor from the seeds' counts of correct answers; the eval
AUC and the late reward are no counts, so their floor is 0: the AUC's eval-set share is in the bootstrap below where
available, and the late reward's training samples' noise is inside each seed's value, so the seeds' spread holds it.
For the final accuracy and the eval AUC, where the runs record every eval problem's outcome in every matched cell
(table.final_outcomes, outcomes.auc_outcomes), the paired bootstrap over problems x seeds (paired.paired_bootstrap)
stands beside it; for the final and best accuracy the unpaired Welch bound of table.compare, for reference. Below
MIN_SEEDS matched seeds nothing is claimed. A CI that contains 0 is worded "no difference detected (CI [lo, hi],
MDE m)". The CIs are per comparison, not adjusted for their number: of k comparisons with no true difference, about
0.05 k are expected to exclude 0."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nearpolicy.arena.paired import (MOST_SEEDS, Paired, paired_bootstrap, paired_seeds, problem_noise_floor,
                                     seeds_for_mde, t975, verdict)
from nearpolicy.arena.keys import arm_pairs, pair_label
from nearpolicy.arena.table import MIN_SEEDS, Aggregate, CellResult, Comparison, compare


@dataclass(frozen=True)
class Outcome:
    """What an outcome name means: the CellResult attribute of its value, a human label (`{steps}`: the late
    reward's number of steps, '3 steps'), a short name for the page's table, the CellResult attribute of its
    per-problem values for the bootstrap over problems x seeds (None: over seeds only), and whether it is a count of
    correct eval answers / eval_size (then paired.problem_noise_floor and Welch's binomial floor apply)."""

    attribute: str
    label: str
    short: str
    per_problem: str | None = None
    counts: bool = False


OUTCOMES = {
    "final": Outcome("final_accuracy", "final accuracy", "final", "final_outcomes", counts=True),
    "best": Outcome("best_accuracy", "best accuracy", "best", counts=True),
    "auc": Outcome("auc_accuracy", "eval AUC", "eval AUC", "auc_outcomes"),
    "late_reward": Outcome("late_reward", "mean training reward of the last {steps}", "late reward (last {steps})"),
}
WHICH = tuple(OUTCOMES)
PLANNING_MDE = 0.05  # a null's statement says how many seeds at its spread would bring its MDE to this (issue 37's bar)


@dataclass(frozen=True)
class PairedComparison:
    """arm - base, both (correction, source), of the `which` outcome (OUTCOMES): `seeds` the paired t over matched
    seeds (None when there are fewer than MIN_SEEDS, `reason` says why), `problems` the bootstrap over problems x
    seeds (None: `problems_reason` says why; both None for an outcome without per-problem values), `welch`
    table.compare's unpaired bound (None without an accuracy, and for the eval AUC and late reward), `late_steps`
    the late reward's N when every matched cell has the same (else None)."""

    arm: tuple[str, str]
    base: tuple[str, str]
    which: str
    seeds: Paired | None
    problems: Paired | None
    reason: str | None
    problems_reason: str | None
    welch: Comparison | None
    late_steps: int | None = None

    @property
    def what(self) -> str:
        """The outcome's human label: 'final accuracy', 'eval AUC', 'mean training reward of the last 3 steps'."""
        return OUTCOMES[self.which].label.format(steps=self._steps("N steps (N differs between the cells)"))

    @property
    def short(self) -> str:
        """The outcome's name in the page's table: 'final', 'best', 'eval AUC', 'late reward (last 3 steps)'."""
        return OUTCOMES[self.which].short.format(steps=self._steps("N steps"))

    def _steps(self, unknown: str) -> str:
        n = self.late_steps
        return unknown if n is None else f"{n} step{'' if n == 1 else 's'}"

    @property
    def label(self) -> str:
        """'tis vs off under q4_1' (two corrections) or 'bypass: eta4 vs eta1' (two sources): keys.pair_label."""
        return pair_label(self.arm, self.base)

    def statement(self) -> str:
        """One sentence: the paired verdict over seeds, the bootstrap's (or why there is none), Welch's bound."""
        head = f"{self.label}, {self.what}: "
        if self.seeds is None:
            return head + str(self.reason)
        p = self.seeds
        said = (f"paired over seeds {', '.join(str(s) for s, _ in p.per_seed)}: {verdict(p)} (per-seed differences "
                f"{', '.join(f'{d:+.3f}' for _, d in p.per_seed)}; paired t, df {p.df}; {self._se_said()})")
        if not p.detected and p.se > 0 and p.mde > PLANNING_MDE:
            n = seeds_for_mde(p, PLANNING_MDE)
            said += (f"; at this spread about {n} seeds would bring its MDE to {PLANNING_MDE}" if n is not None else
                     f"; at this spread no number of seeds up to {MOST_SEEDS} brings its MDE to {PLANNING_MDE}")
        if OUTCOMES[self.which].per_problem is not None:
            said += "; over problems x seeds: " + (
                f"{verdict(self.problems)} ({self.problems.problems} problems x {self.problems.seeds} seeds, paired "
                f"bootstrap)" if self.problems is not None else str(self.problems_reason))
        if self.welch is not None and self.welch.bound is not None:
            said += f"; unpaired Welch 95 % bound +-{self.welch.bound:.3f}, for reference"
        return head + said

    def _se_said(self) -> str:
        """What the SE is made of: the seeds and the eval set's floor (a count), or the seeds alone, and why."""
        p = self.seeds
        if OUTCOMES[self.which].counts:
            return (f"SE {p.se:.3f} = seeds {p.se_seeds:.3f} (+) eval set >= {p.eval_floor:.3f}; the seeds alone: CI "
                    f"[{p.difference - t975(p.df) * p.se_seeds:+.3f}, {p.difference + t975(p.df) * p.se_seeds:+.3f}]")
        if self.which == "auc":
            return (f"SE {p.se:.3f}, the seeds' alone: an AUC is no count of correct answers, so the eval set's share "
                    f"is not bounded here; it is in the bootstrap over problems x seeds, where available")
        return (f"SE {p.se:.3f}, the seeds' alone: the noise of the training samples behind each step's mean reward "
                f"is inside each seed's value, so the seeds' spread holds it (eval set floor 0)")


def _accuracies(results: list[CellResult], arm: tuple[str, str], which: str) -> dict[int, CellResult]:
    """seed -> the arm's finished cell (done or diverged) with a `which` outcome."""
    attribute = OUTCOMES[which].attribute
    return {r.seed: r for r in results if (r.correction, r.source) == arm and r.status in ("done", "diverged")
            and getattr(r, attribute) is not None}


def _bootstrap(a: dict[int, CellResult], b: dict[int, CellResult], seeds: list[int], eval_size: int,
               which: str = "final") -> tuple[Paired | None, str | None]:
    """The paired bootstrap of the `which` outcome's per-problem values over problems x the matched seeds, or
    (None, why not)."""
    cells = [a[s] for s in seeds] + [b[s] for s in seeds]
    attribute = OUTCOMES[which].per_problem
    if any(getattr(c, attribute) is None for c in cells):
        if which == "auc":
            return None, ("not available: eval_outcomes.jsonl does not hold every eval problem's reward at every eval "
                          "step in every matched cell (the bootstrap needs each problem's AUC)")
        recorded = min(c.outcomes_recorded for c in cells)
        return None, (f"not available: samples.jsonl records {recorded} of {eval_size} eval problems at the last step "
                      f"(the bootstrap needs every problem's outcome)")
    keep = [p for p in range(eval_size) if all(getattr(c, attribute)[p] is not None for c in cells)]
    if not keep:
        return None, "not available: no eval problem was scorable in every matched cell"
    table = lambda arm: np.array([[getattr(arm[s], attribute)[p] for p in keep] for s in seeds])  # noqa: E731
    return paired_bootstrap(table(a), table(b), seeds), None


def eval_floor(a: dict[int, float], b: dict[int, float], eval_size: int) -> float:
    """paired.problem_noise_floor from the seeds' counts of correct answers (accuracy x eval_size); 0 when an
    accuracy is no whole count of eval_size (unscorable answers made it a fraction of fewer problems)."""
    counts = [(a[s] * eval_size, b[s] * eval_size) for s in sorted(a)]
    if any(abs(x - round(x)) > 1e-6 for pair in counts for x in pair):
        return 0.0
    return problem_noise_floor([round(x) - round(y) for x, y in counts], eval_size)


def compare_paired(results: list[CellResult], aggregates: list[Aggregate], arm: tuple[str, str],
                   base: tuple[str, str], which: str, eval_size: int) -> PairedComparison:
    """The PairedComparison of arm against base for the `which` outcome (a key of OUTCOMES; module docstring).
    Raises KeyError for another name."""
    outcome = OUTCOMES[which]
    a, b = _accuracies(results, arm, which), _accuracies(results, base, which)
    by = {(g.correction, g.source): g for g in aggregates}
    welch = compare(by[arm], by[base], eval_size, which) if outcome.counts and arm in by and base in by else None
    seeds = sorted(set(a) & set(b))
    windows = {c.late_steps for c in [a[s] for s in seeds] + [b[s] for s in seeds]}
    late = windows.pop() if which == "late_reward" and len(windows) == 1 else None
    if not seeds:
        return PairedComparison(arm, base, which, None, None, "not available (no seed has a result in both arms)",
                                None, welch, late)
    if len(seeds) < MIN_SEEDS:
        return PairedComparison(arm, base, which, None, None, f"not established: {len(seeds)} seed"
                                f"{'' if len(seeds) == 1 else 's'}; at least {MIN_SEEDS} needed", None, welch, late)
    value = lambda cells: {s: getattr(cells[s], outcome.attribute) for s in seeds}  # noqa: E731
    floor = eval_floor(value(a), value(b), eval_size) if outcome.counts else 0.0
    paired = paired_seeds(value(a), value(b), floor)
    problems, why = _bootstrap(a, b, seeds, eval_size, which) if outcome.per_problem else (None, None)
    return PairedComparison(arm, base, which, paired, problems, None, why, welch, late)


def _recorded(results: list[CellResult], arms: tuple[tuple[str, str], ...], which: str) -> bool:
    """Whether any cell of the arms has the `which` outcome."""
    return any((r.correction, r.source) in arms and getattr(r, OUTCOMES[which].attribute) is not None
               for r in results)


def paired_comparisons(results: list[CellResult], aggregates: list[Aggregate], corrections: list[str],
                       sources: list[str], baseline: str, eval_size: int,
                       outcomes: tuple[str, ...] = WHICH) -> list[PairedComparison]:
    """Every comparison of arm_pairs, for each of `outcomes` (keys of OUTCOMES, in that order) of each pair. The
    final and best accuracy are always compared; the eval AUC and the late reward only where some cell of the two
    arms has one (results built without them, or runs without a step-0 eval, get no rows of 'not available').
    Raises KeyError for an unknown outcome."""
    return [compare_paired(results, aggregates, arm, base, which, eval_size)
            for arm, base in arm_pairs(corrections, sources, baseline) for which in outcomes
            if OUTCOMES[which].counts or _recorded(results, (arm, base), which)]


METHOD = (
    "Paired statistics. A seed's cells share its training-data order and sampling seeds, and every cell scores the "
    "same eval problems, so two arms are compared seed by seed: d_s = a_s - b_s over the seeds both finished, "
    "difference = mean d_s; SE^2 = (sd(d_s) / sqrt(n))^2 (the seeds) + floor^2 (the eval set); 95 % CI = difference "
    "+- t(0.975, n - 1) x SE (the paired t interval). The seeds' part alone is given the eval set (it speaks of these "
    "problems); the floor is the least standard error that sampling the eval problems can add, given each seed's "
    "count of correct answers in both arms (the net count difference spread as evenly as the problems allow: 0 when "
    "it is 0), so it is a lower bound and the CI and MDE are the narrowest the data allow. Where the runs record "
    "every eval problem's outcome at the last step (eval_outcomes.jsonl), the final accuracy also gets a paired "
    "bootstrap over problems x seeds (10 000 replicates, each drawing seeds and problems with replacement, the same draws for both "
    "arms; percentile CI; Owen 2007's two-way bootstrap), which includes the eval set's noise itself. MDE: the "
    "smallest true difference detected with 80 % power at a two-sided 5 % level, taking the SE as the true one: "
    "M x SE, M the exact noncentral-t multiplier for n - 1 df (5.653 at 3 seeds), 2.802 for the bootstrap; a null "
    "over seeds with an MDE above 0.05 says how many seeds would bring it to 0.05 if the spread stayed as observed "
    "(the SE scaled by sqrt(n / N), a planning figure: 3 seeds estimate the spread loosely). 'bound "
    "set by': the eval set when its floor exceeds the seeds' SE, else not known (the floor is only a lower bound). "
    "A difference is detected when its CI excludes 0; otherwise 'no difference detected' (not: the arms are the "
    "same). The CIs are not adjusted for the number of comparisons (of k with no true difference, about 0.05 k "
    "exclude 0). The unpaired Welch bound (SE floored at the eval set's binomial noise) is shown for reference. "
    "Two less noisy outcomes are compared the same way: the eval AUC (the trapezoid under the eval-accuracy curve "
    "from step 0 to the last step, divided by the steps: the mean accuracy over the run, which weighs early learning "
    "as much as the end; bootstrapped over problems x seeds where every problem's reward is recorded at every eval) "
    "and the mean training reward (reward/mean, sampled on training problems) of the last N steps; neither is a count "
    "of correct answers, so their eval-set floor is 0 and they get no Welch bound (the late reward's sampling noise "
    "is inside each seed's value).")
