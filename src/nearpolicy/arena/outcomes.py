"""A cell's less noisy outcomes (issue 37), beside its final and best accuracy (table.py): the area under its
eval-accuracy curve and the mean training reward of its last steps, from its run's metrics.jsonl rows, and each
eval problem's own AUC from eval_outcomes.jsonl (runs/samples.py) for the paired bootstrap over problems x seeds.
Pure functions of rows and numbers, but for `auc_outcomes`, which reads the cell's eval_outcomes.jsonl.

- **Eval AUC** (`auc_accuracy`): the trapezoid over the eval points (step, eval/accuracy) from step 0 to run.steps,
  divided by run.steps: the accuracy averaged over the run's steps, the curve interpolated linearly between evals
  (in [0, 1], like an accuracy). It averages every eval of the run, so one eval's luck weighs less than in the final
  accuracy; but it weighs every step alike, so early learning counts as much as the end: an arm that learns faster
  and ends at the same accuracy has the larger AUC, and a late collapse costs only its share of the steps. None
  when the eval at step 0 or at run.steps is missing or not finite (as the final accuracy: never another eval in its
  place), or when an eval between them is logged non-finite (said in the cell's notes).
- **Late reward** (`late_reward`): the mean of `reward/mean` over the last N training steps, those whose step lies in
  (run.steps - N, run.steps]. reward/mean is the training batch's mean reward (samples of the engine's policy mu on
  the training problems: sampled, not greedy, not held out), logged every step over prompts_per_step x group_size
  samples, so it costs no eval. N is arena.late_steps, else `default_late_steps` = max(1, run.steps // 4). None when
  any of those N steps has no finite reward/mean.
- **Per-problem AUC** (`auc_outcomes`): where eval_outcomes.jsonl holds every eval problem's reward at every eval step
  of the AUC's curve, problem p's AUC is the same trapezoid over its rewards / run.steps (None for a problem
  unscorable at any of those steps: the bootstrap leaves it out, as it does at the last step). Their mean over the
  problems is the eval AUC by linearity; the rewards of each eval step must give that step's logged accuracy (and,
  every problem scorable, their AUCs' mean the eval AUC) within 1e-9, else they are left out with a warning."""

from __future__ import annotations

import statistics

from nearpolicy.arena.spec import Cell
from nearpolicy.runs.folder import is_finite_number
from nearpolicy.runs.samples import OUTCOMES, read_outcomes

TOLERANCE = 1e-9  # recorded rewards must give the logged accuracy within this


def default_late_steps(steps: int) -> int:
    """N of the late reward when arena.late_steps is not set: max(1, steps // 4), steps the cell's run.steps."""
    return max(1, steps // 4)


def trapezoid(points: list[tuple[int, float]], steps: int) -> float:
    """The area under the piecewise-linear curve through `points` (step, value), divided by `steps` (a mean value
    per step). Raises ValueError unless steps >= 1 and the points' steps rise strictly from 0 to `steps`."""
    xs = [s for s, _ in points]
    if steps < 1 or not xs or xs[0] != 0 or xs[-1] != steps or any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"trapezoid needs points from step 0 to step {steps} in rising order, got steps {xs}")
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(points, points[1:]))
    return area / steps


def _last_by_step(rows: list[dict], key: str) -> dict[int, object]:
    """step -> the value of `key` in the last row of that step that logs it (a later row wins)."""
    return {row["step"]: row[key] for row in rows if key in row}


def eval_curve(rows: list[dict], steps: int, notes: list[str]) -> list[tuple[int, float]] | None:
    """The eval points (step, eval/accuracy) of metrics rows from step 0 to `steps` (run.steps), in step order, the
    last row of a step counting; None when the eval of step 0 or of `steps` is missing or not finite (the final
    accuracy's note says so already) or when one between them is logged non-finite (a note here says which)."""
    logged = {s: v for s, v in _last_by_step(rows, "eval/accuracy").items() if 0 <= s <= steps}
    if not all(is_finite_number(logged.get(s)) for s in (0, steps)):
        return None
    bad = sorted(s for s, v in logged.items() if not is_finite_number(v))
    if bad:
        notes.append(f"eval AUC n/a: the eval at step {bad[0]} is {logged[bad[0]]}")
        return None
    return [(s, float(logged[s])) for s in sorted(logged)]


def auc_accuracy(curve: list[tuple[int, float]] | None, steps: int) -> float | None:
    """The eval AUC (module docstring) of `eval_curve`'s points: trapezoid(curve, steps), a mean accuracy over the
    run's steps in [0, 1]; None when the curve is None or `steps` < 1."""
    return trapezoid(curve, steps) if curve is not None and steps >= 1 else None


def late_reward(rows: list[dict], steps: int, n: int, notes: list[str]) -> float | None:
    """The mean of reward/mean over the training steps in (steps - n, steps] (the last row of a step counting);
    None, with a note naming the first, when any of those steps has no finite reward/mean. Raises ValueError when
    n < 1 or n > steps."""
    if not 1 <= n <= steps:
        raise ValueError(f"late_reward needs 1 <= n <= steps, got n {n}, steps {steps}")
    logged = _last_by_step(rows, "reward/mean")
    window = range(steps - n + 1, steps + 1)
    missing = [s for s in window if not is_finite_number(logged.get(s))]
    if missing:
        said = f"is {logged[missing[0]]}" if missing[0] in logged else "missing"
        notes.append(f"mean reward of the last {n} steps n/a: reward/mean of step {missing[0]} {said}")
        return None
    return statistics.fmean(float(logged[s]) for s in window)


def auc_outcomes(cell: Cell, curve: list[tuple[int, float]] | None,
                 auc: float | None) -> tuple[list[float | None] | None, list[str]]:
    """(each eval problem's AUC in eval-set order (None for a problem unscorable at an eval step of `curve`), or None
    for the list, warnings) from the cell's eval_outcomes.jsonl (module docstring), `curve` and `auc` the cell's
    eval_curve and auc_accuracy. None without a warning when the AUC is None or the file records nothing (a run
    from before it); None with a warning when it lacks a full row (task.eval_size rewards) for an eval step of the
    curve, or its rewards do not give the logged accuracy. Lines it cannot read are final_outcomes' warnings."""
    if curve is None or auc is None:
        return None, []
    size, steps = cell.config.task.eval_size, cell.config.run.steps
    rows, _ = read_outcomes(cell.run_dir)
    if not rows:
        return None, []
    by_step = {r["step"]: r["rewards"] for r in rows}
    lacking = [s for s, _ in curve if len(by_step.get(s, ())) != size]
    if lacking:
        return None, [f"{OUTCOMES} has no row of {size} rewards for eval step {lacking[0]}: per-problem AUCs left out"]
    for s, accuracy in curve:
        scored = [float(v) for v in by_step[s] if v is not None]
        if not scored or abs(statistics.fmean(scored) - accuracy) > TOLERANCE:
            return None, [f"{OUTCOMES}'s step-{s} rewards do not give the logged accuracy {accuracy}: per-problem "
                          f"AUCs left out"]
    outcomes = []
    for p in range(size):
        rewards = [by_step[s][p] for s, _ in curve]
        outcomes.append(None if None in rewards else trapezoid([(s, float(r)) for (s, _), r in zip(curve, rewards)],
                                                                steps))
    if None not in outcomes and abs(statistics.fmean(outcomes) - auc) > TOLERANCE:
        return None, [f"the per-problem AUCs' mean {statistics.fmean(outcomes)} is not the eval AUC {auc}: left out"]
    return outcomes, []
