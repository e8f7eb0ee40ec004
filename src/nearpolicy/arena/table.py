"""The arena's numbers: per cell from its run's metrics.jsonl (runs.read_metrics), then per correction x source
over the seeds, and which differences from the baseline correction lie inside the seed spread.

Per cell (CellResult): eval/accuracy (greedy, held-out) at step 0, at the last eval and its best; the median over
training steps of mismatch/k3 (token-mean k3 estimate of KL(mu || pi_old), nats/token); the mean over steps of the
fraction of tokens the correction changed (`changed_fraction`); the mean time/step (seconds, eval steps included).
A cell "diverged" when its run stopped on non-finite steps or weights (the bad-step guard), or when its accuracy
collapsed (`collapsed`: the final accuracy below half the step-0 accuracy, by more than twice the binomial standard
error of the difference on the eval set)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from nearpolicy.arena.spec import ArenaSpec, Cell
from nearpolicy.arena.state import ArenaState, CellRecord
from nearpolicy.runs import RunFolderError, finite_points, is_finite_number, read_metrics

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
    seconds: float = 0.0
    accuracy: list[tuple[int, float]] = field(default_factory=list)
    k3: list[tuple[int, float]] = field(default_factory=list)


def duration(seconds: float) -> str:
    """'1h12m', '7m05s', '42s'."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def cell_result(cell: Cell, record: CellRecord) -> tuple[CellResult, list[str]]:
    """(the cell's numbers, warnings from reading its metrics). A cell never run, or without metrics, has only its
    status."""
    result = CellResult(cell.id, cell.correction, cell.source, cell.seed, record.status, record.failure, record.error,
                        seconds=record.seconds)
    if not (cell.run_dir / "metrics.jsonl").exists():
        return result, []
    try:
        log = read_metrics(cell.run_dir)
    except RunFolderError as err:
        return result, [str(err)]
    rows = log.rows
    train = [r for r in rows if "reward/mean" in r]
    result.accuracy, result.k3 = finite_points(rows, "eval/accuracy"), finite_points(train, "mismatch/k3")
    result.steps = max((r["step"] for r in train), default=0)
    if result.accuracy:
        values = [v for _, v in result.accuracy]
        result.initial_accuracy, result.final_accuracy, result.best_accuracy = values[0], values[-1], max(values)
    if result.k3:
        result.k3_median = statistics.median(v for _, v in result.k3)
    action = cell.config.correction.spec().action
    result.changed_fraction = _mean([f for r in train if (f := changed_fraction(r, action)) is not None])
    result.step_seconds = _mean([v for _, v in finite_points(train, "time/step")])
    if record.status == "diverged":
        result.diverged = True
    elif record.status == "done" and result.final_accuracy is not None:
        result.diverged = collapsed(result.initial_accuracy, result.final_accuracy, cell.config.task.eval_size)
    return result, log.warnings


@dataclass
class Aggregate:
    """One correction x source over its seeds: (mean, sample sd; sd None below 2 seeds) of the final and best
    accuracy, the diverged count, the median k3 (over every step of every seed), the mean changed fraction and
    step time. `n` counts the seeds with an accuracy; `failed` the seeds whose cell failed or has not run."""

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


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def aggregate(results: list[CellResult], correction: str, source: str) -> Aggregate:
    mine = [r for r in results if r.correction == correction and r.source == source]
    scored = [r for r in mine if r.final_accuracy is not None and r.status in ("done", "diverged")]
    k3 = [v for r in scored for _, v in r.k3]
    return Aggregate(correction, source, len(mine), len(scored), _mean_sd([r.final_accuracy for r in scored]),
                     _mean_sd([r.best_accuracy for r in scored]), sum(bool(r.diverged) for r in scored),
                     statistics.median(k3) if k3 else None,
                     _mean([r.changed_fraction for r in scored if r.changed_fraction is not None]),
                     _mean([r.step_seconds for r in scored if r.step_seconds is not None]),
                     sum(r.status not in ("done", "diverged") for r in mine))


def compare(a: Aggregate, base: Aggregate, which: str = "final") -> tuple[float, float | None] | None:
    """(difference of means a - base, twice its standard error sqrt(sd_a^2 / n_a + sd_b^2 / n_b)) of the `which`
    accuracy; the error is None below 2 seeds on either side; None when either has no accuracy."""
    (ma, sa), (mb, sb) = getattr(a, which), getattr(base, which)
    if ma is None or mb is None:
        return None
    if sa is None or sb is None:
        return ma - mb, None
    return ma - mb, 2 * math.sqrt(sa * sa / a.n + sb * sb / base.n)


def spread_statements(aggregates: list[Aggregate], baseline: str) -> list[str]:
    """One plain sentence per correction x source against the baseline correction under the same source: the
    final and best accuracy differences and whether each lies inside the seed spread (|difference| <= 2 standard
    errors) or outside it."""
    lines = []
    for agg in aggregates:
        base = next((b for b in aggregates if b.correction == baseline and b.source == agg.source), None)
        if agg.correction == baseline or base is None:
            continue
        parts = []
        for which in ("final", "best"):
            got = compare(agg, base, which)
            if got is None:
                parts.append(f"{which} accuracy: not available (a cell has no result)")
            elif got[1] is None:
                parts.append(f"{which} {got[0]:+.3f}: one seed, the spread is unknown, so no difference can be claimed")
            else:
                inside = abs(got[0]) <= got[1]
                parts.append(f"{which} {got[0]:+.3f} ({'inside' if inside else 'OUTSIDE'} the seed spread, "
                             f"2 SE = {got[1]:.3f})")
        lines.append(f"{agg.correction} vs {baseline} under {agg.source}: " + "; ".join(parts)
                     + (f"; diverged {agg.diverged}/{agg.n} vs {base.diverged}/{base.n}"
                        if agg.diverged or base.diverged else ""))
    return lines


def arena_results(spec: ArenaSpec, state: ArenaState) -> tuple[list[CellResult], list[Aggregate], list[str]]:
    """(every cell's result, every correction x source aggregate in the arena's order, warnings)."""
    results, warnings = [], []
    for cell in spec.cells:
        result, problems = cell_result(cell, state.cells[cell.id])
        results.append(result)
        warnings += [f"{cell.id}: {p}" for p in problems]
    aggregates = [aggregate(results, c.name, s.name) for c in spec.corrections for s in spec.sources]
    return results, aggregates, warnings
