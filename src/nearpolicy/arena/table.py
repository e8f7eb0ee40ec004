"""The arena's numbers: per cell from its run's metrics.jsonl (runs.folder.read_metrics), then per correction x source
over the seeds, and which differences from the baseline correction lie inside the seed spread (Welch, unpaired; the
paired analysis is comparisons.py's).

Per cell (CellResult): eval/accuracy (greedy, held-out) at step 0, at the cell's last step (run.steps; missing or
non-finite there: None, shown as n/a and said in the cell's notes, never an earlier eval in its place) and its best;
the median over training steps of mismatch/k3 (token-mean k3 estimate of KL(mu || pi_old), nats/token); the mean over
steps of the fraction of tokens the correction changed (`changed_fraction`); the mean over steps of the fraction of
training responses cut at sampling.max_new_tokens (`truncated`, response/frac_truncated; above TRUNCATION_LIMIT the
cell gets a note); the mean time/step (seconds, eval steps included); each eval problem's reward at the last step (`final_outcomes`, for paired.py's bootstrap;
`outcomes_recorded` counts the problems recorded) from eval_outcomes.jsonl, or else from samples.jsonl when that
records every problem (runs/samples.py); the eval AUC (`auc_accuracy`: the eval-accuracy curve's mean over the
run's steps, each problem's in `auc_outcomes`) and the mean training reward of the last N steps (`late_reward`,
N = `late_steps`), outcomes.py's. A cell "diverged" when its run stopped on non-finite steps or weights (the
bad-step guard), or when its accuracy collapsed (`collapsed`: the final accuracy below half the step-0 accuracy, by
more than twice the binomial standard error of the difference on the eval set)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from nearpolicy.arena.outcomes import auc_accuracy, auc_outcomes, default_late_steps, eval_curve, late_reward
from nearpolicy.arena.paired import t975
from nearpolicy.arena.spec import ArenaSpec, Cell
from nearpolicy.arena.state import ArenaState, CellRecord
from nearpolicy.runs.folder import METRICS, RunFolderError, finite_points, is_finite_number, read_metrics
from nearpolicy.runs.samples import OUTCOMES, SAMPLES, read_outcomes, read_samples

TRUNCATION_LIMIT = 0.10  # a cell cutting more of its training responses at the token budget gets a note
COLLAPSE = 0.5  # final accuracy below this fraction of the step-0 accuracy (and significantly lower) is a collapse


def collapsed(initial: float, final: float, n: int) -> bool:
    """Whether the accuracy fell from `initial` to `final` (fractions of `n` eval problems) to below COLLAPSE x
    initial, by more than 2 sqrt(2 p (1 - p) / n), p = (initial + final) / 2: twice the standard error of the
    difference of two binomial proportions on n problems each (pooled), so eval noise on a small set is no collapse."""
    p = (initial + final) / 2
    return final < COLLAPSE * initial and initial - final > 2 * math.sqrt(2 * p * (1 - p) / max(n, 1))


def changed_fraction(row: dict, action: str) -> float | None:
    """Fraction of a step's tokens (with an engine log-prob) the correction changed: masked or rejected
    (correction/rejected_frac: the mask action, rejection rules, the veto) plus, for the truncate action, clipped
    to a bound (correction/frac_high + frac_low); capped at 1 (an upper bound when a truncation also rejects).
    Reweighting alone (action none) changes no token by this count. None when the step logs no correction/*."""
    rejected = row.get("correction/rejected_frac")
    if not is_finite_number(rejected):
        return None
    clipped = 0.0
    if action == "truncate":
        clipped = sum(float(row[k]) for k in ("correction/frac_high", "correction/frac_low")
                      if is_finite_number(row.get(k)))
    return min(1.0, float(rejected) + clipped)


@dataclass
class CellResult:
    """One cell's numbers (module docstring); None where its run logged nothing to compute it from."""

    id: str
    correction: str
    source: str
    seed: int
    status: str
    failure: str | None = None
    error: str | None = None
    steps: int = 0
    initial_accuracy: float | None = None
    final_accuracy: float | None = None
    best_accuracy: float | None = None
    diverged: bool | None = None
    k3_median: float | None = None
    changed_fraction: float | None = None
    step_seconds: float | None = None
    truncated: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    accuracy: list[tuple[int, float]] = field(default_factory=list)
    k3: list[tuple[int, float]] = field(default_factory=list)
    outcomes_recorded: int = 0
    final_outcomes: list[float | None] | None = None
    auc_accuracy: float | None = None
    auc_outcomes: list[float | None] | None = None
    late_reward: float | None = None
    late_steps: int | None = None


def duration(seconds: float) -> str:
    """'1h12m', '7m05s', '42s'."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _eval_at(rows: list[dict], step: int, notes: list[str]) -> float | None:
    """eval/accuracy logged at `step` (the last such row); None, with a note, when that step has no eval or a
    non-finite one: never an eval of another step in its place."""
    logged = [r["eval/accuracy"] for r in rows if r.get("step") == step and "eval/accuracy" in r]
    if logged and is_finite_number(logged[-1]):
        return float(logged[-1])
    notes.append(f"eval at step {step} {'is ' + str(logged[-1]) if logged else 'missing'}: reported as n/a")
    return None


def _recorded_outcomes(cell: Cell) -> tuple[int, list | None, str, list[str]]:
    """(how many eval problems the run records at its last step, their rewards in index order when it records all
    task.eval_size of them (else None), the file they come from, warnings): eval_outcomes.jsonl's row of the last
    step when it holds one reward per problem, else samples.jsonl's rows of that step when they cover every index
    (runs/samples.py; the committed cells have only samples.jsonl, with SAMPLES_PER_EVAL problems)."""
    size, step = cell.config.task.eval_size, cell.config.run.steps
    rows, warnings = read_outcomes(cell.run_dir)
    logged = [r["rewards"] for r in rows if r["step"] == step]
    if logged and len(logged[-1]) == size:
        return size, logged[-1], OUTCOMES, warnings
    if logged:
        warnings.append(f"{OUTCOMES}'s step-{step} row has {len(logged[-1])} rewards for {size} eval problems: "
                        f"left out, {SAMPLES} read instead")
    samples, problems = read_samples(cell.run_dir)
    seen = {r["index"]: r.get("reward") for r in samples if r["step"] == step and isinstance(r.get("index"), int)}
    recorded = sum(0 <= i < size for i in seen)
    return recorded, [seen[i] for i in range(size)] if recorded == size else None, SAMPLES, warnings + problems


def final_outcomes(cell: Cell, final: float | None) -> tuple[int, list[float | None] | None, list[str]]:
    """(how many eval problems the run records at the cell's last step, every problem's reward in index order when
    it records all task.eval_size of them (None for an unscorable one; else None for the list), warnings), from
    eval_outcomes.jsonl or else samples.jsonl (_recorded_outcomes). A full list whose scorable mean is not the logged
    final accuracy is dropped with a warning."""
    recorded, rewards, source, warnings = _recorded_outcomes(cell)
    if rewards is None:
        return recorded, None, warnings
    outcomes = [float(v) if is_finite_number(v) else None for v in rewards]
    scored = [v for v in outcomes if v is not None]
    if final is None or not scored or abs(statistics.fmean(scored) - final) > 1e-9:
        return recorded, None, warnings + [f"{source}'s step-{cell.config.run.steps} rewards do not give the logged "
                                           f"final accuracy {final}: per-problem outcomes left out"]
    return recorded, outcomes, warnings


def cell_result(cell: Cell, record: CellRecord, late_steps: int | None = None) -> tuple[CellResult, list[str]]:
    """(the cell's numbers, warnings from reading its metrics). A cell never run, or without metrics, has only its
    status. `late_steps`: N of the late reward (arena.late_steps; None: outcomes.default_late_steps of the cell's
    run.steps). Raises ValueError when it is below 1 or above the cell's run.steps."""
    result = CellResult(cell.id, cell.correction, cell.source, cell.seed, record.status, record.failure, record.error,
                        seconds=record.seconds)
    if not (cell.run_dir / METRICS).exists():
        return result, []
    try:
        log = read_metrics(cell.run_dir)
    except RunFolderError as err:
        return result, [str(err)]
    rows = log.rows
    train = [r for r in rows if "reward/mean" in r]
    result.accuracy, result.k3 = finite_points(rows, "eval/accuracy"), finite_points(train, "mismatch/k3")
    result.steps = max((r["step"] for r in train), default=0)
    result.initial_accuracy = _eval_at(rows, 0, result.notes)
    result.final_accuracy = _eval_at(rows, cell.config.run.steps, result.notes)
    result.outcomes_recorded, result.final_outcomes, problems = final_outcomes(cell, result.final_accuracy)
    steps = cell.config.run.steps
    curve = eval_curve(rows, steps, result.notes)
    result.auc_accuracy = auc_accuracy(curve, steps)
    result.auc_outcomes, auc_problems = auc_outcomes(cell, curve, result.auc_accuracy)
    result.late_steps = late_steps if late_steps is not None else default_late_steps(steps)
    result.late_reward = late_reward(train, steps, result.late_steps, result.notes)
    if result.accuracy:
        result.best_accuracy = max(v for _, v in result.accuracy)
    if result.k3:
        result.k3_median = statistics.median(v for _, v in result.k3)
    action = cell.config.correction.spec().action
    result.changed_fraction = _mean([f for r in train if (f := changed_fraction(r, action)) is not None])
    result.step_seconds = _mean([v for _, v in finite_points(train, "time/step")])
    result.truncated = _mean([v for _, v in finite_points(train, "response/frac_truncated")])
    if result.truncated is not None and result.truncated > TRUNCATION_LIMIT:
        result.notes.append(f"{100 * result.truncated:.1f} % of its training responses cut at "
                            f"sampling.max_new_tokens = {cell.config.sampling.max_new_tokens} (above "
                            f"{100 * TRUNCATION_LIMIT:.0f} %: the budget shapes what is learned)")
    if record.status == "diverged":
        result.diverged = True
    elif record.status == "done" and None not in (result.initial_accuracy, result.final_accuracy):
        result.diverged = collapsed(result.initial_accuracy, result.final_accuracy, cell.config.task.eval_size)
    return result, log.warnings + problems + auc_problems


@dataclass
class Aggregate:
    """One correction x source over its seeds: (mean, sample sd; sd None below 2 seeds) of the final and best
    accuracy, the diverged count, the median k3 (over every step of every seed), the mean changed fraction and
    step time. `n` counts the seeds with a final accuracy (those in the means); `failed` the seeds whose cell failed
    or has not run; `finished` the seeds done or diverged, `diverged` of them how many diverged (stopped or
    collapsed), `diverged_in_mean` how many diverged seeds are in the means (a collapse, or a stop at the last step):
    the page marks those means. `auc` and `late_reward`: (mean, sd) of the eval AUC and the late reward over the
    finished seeds that have one, `auc_n` and `late_reward_n` of them."""

    correction: str
    source: str
    seeds: int
    n: int
    final: tuple[float | None, float | None]
    best: tuple[float | None, float | None]
    diverged: int
    k3_median: float | None
    changed_fraction: float | None
    step_seconds: float | None
    failed: int
    finished: int = 0
    diverged_in_mean: int = 0
    auc: tuple[float | None, float | None] = (None, None)
    late_reward: tuple[float | None, float | None] = (None, None)
    auc_n: int = 0
    late_reward_n: int = 0


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def aggregate(results: list[CellResult], correction: str, source: str) -> Aggregate:
    """The Aggregate of one correction x source over its cells in `results`."""
    mine = [r for r in results if r.correction == correction and r.source == source]
    finished = [r for r in mine if r.status in ("done", "diverged")]
    scored = [r for r in finished if r.final_accuracy is not None]
    k3 = [v for r in scored for _, v in r.k3]
    auc = [r.auc_accuracy for r in finished if r.auc_accuracy is not None]
    late = [r.late_reward for r in finished if r.late_reward is not None]
    return Aggregate(correction, source, len(mine), len(scored), _mean_sd([r.final_accuracy for r in scored]),
                     _mean_sd([r.best_accuracy for r in scored]), sum(bool(r.diverged) for r in finished),
                     statistics.median(k3) if k3 else None,
                     _mean([r.changed_fraction for r in scored if r.changed_fraction is not None]),
                     _mean([r.step_seconds for r in scored if r.step_seconds is not None]),
                     sum(r.status not in ("done", "diverged") for r in mine), len(finished),
                     sum(bool(r.diverged) for r in scored), _mean_sd(auc), _mean_sd(late), len(auc), len(late))


MIN_SEEDS = 3  # seeds per arm below which no difference is claimed


def arm_se(mean: float, sd: float, n: int, eval_size: int) -> float:
    """Standard error of an arm's mean accuracy over n seeds: sd / sqrt(n), floored at the eval set's binomial
    noise sqrt(p (1 - p) / eval_size) / sqrt(n), p the mean clamped to [1 / eval_size, 1 - 1 / eval_size], so seeds
    that happen to agree on a coarse eval set never give a zero spread."""
    p = min(max(mean, 1 / eval_size), 1 - 1 / eval_size) if eval_size > 1 else 0.5
    return max(sd, math.sqrt(p * (1 - p) / max(eval_size, 1))) / math.sqrt(n)


@dataclass(frozen=True)
class Comparison:
    """a - base of the mean `which` accuracy; `bound` the 95 % half-width t_{0.975, df} x SE (Welch: SE =
    sqrt(se_a^2 + se_b^2) with arm_se's floored errors, df by Welch-Satterthwaite); bound and df None when either arm
    has fewer than MIN_SEEDS seeds."""

    difference: float
    seeds: int
    bound: float | None = None
    df: float | None = None


def compare(a: Aggregate, base: Aggregate, eval_size: int, which: str = "final") -> Comparison | None:
    """The Comparison of the `which` accuracy of a against base; None when either has no accuracy."""
    (ma, sa), (mb, sb) = getattr(a, which), getattr(base, which)
    if ma is None or mb is None:
        return None
    seeds = min(a.n, base.n)
    if seeds < MIN_SEEDS:
        return Comparison(ma - mb, seeds)
    va, vb = arm_se(ma, sa or 0.0, a.n, eval_size) ** 2, arm_se(mb, sb or 0.0, base.n, eval_size) ** 2
    df = (va + vb) ** 2 / (va * va / (a.n - 1) + vb * vb / (base.n - 1))
    return Comparison(ma - mb, seeds, t975(df) * math.sqrt(va + vb), df)


def _said(which: str, got: Comparison | None) -> str:
    if got is None:
        return f"{which} accuracy: not available (a cell has no result)"
    if got.bound is None:
        return (f"{which} {got.difference:+.3f}: not established: {got.seeds} seed{'' if got.seeds == 1 else 's'}; "
                f"at least {MIN_SEEDS} needed")
    inside = abs(got.difference) <= got.bound
    return (f"{which} {got.difference:+.3f} ({'inside' if inside else 'OUTSIDE'} the seed spread: 95 % bound "
            f"t(0.975, df {int(got.df)}) x SE = {got.bound:.3f}, Welch, SE floored at the eval set's binomial noise)")


def spread_statements(aggregates: list[Aggregate], baseline: str, eval_size: int) -> list[str]:
    """One plain sentence per correction x source against the baseline correction under the same source: the
    final and best accuracy differences and whether each lies inside the seed spread (|difference| <= the 95 %
    Welch bound of compare) or outside it; no claim with fewer than MIN_SEEDS seeds on either side."""
    lines = []
    for agg in aggregates:
        base = next((b for b in aggregates if b.correction == baseline and b.source == agg.source), None)
        if agg.correction == baseline or base is None:
            continue
        parts = [_said(which, compare(agg, base, eval_size, which)) for which in ("final", "best")]
        lines.append(f"{agg.correction} vs {baseline} under {agg.source}: " + "; ".join(parts)
                     + (f"; diverged {agg.diverged}/{agg.finished} vs {base.diverged}/{base.finished}"
                        if agg.diverged or base.diverged else "")
                     + "".join(f"; {a.correction}'s means include {a.diverged_in_mean} diverged seed(s)"
                               for a in (agg, base) if a.diverged_in_mean))
    return lines


def arena_results(spec: ArenaSpec, state: ArenaState) -> tuple[list[CellResult], list[Aggregate], list[str]]:
    """(every cell's result, every correction x source aggregate in the arena's order, warnings)."""
    results, warnings = [], []
    for cell in spec.cells:
        result, problems = cell_result(cell, state.cells[cell.id], spec.late_steps)
        results.append(result)
        warnings += [f"{cell.id}: {p}" for p in problems]
    aggregates = [aggregate(results, c.name, s.name) for c in spec.corrections for s in spec.sources]
    return results, aggregates, warnings
