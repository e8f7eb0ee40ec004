"""An arena cell's record: how a run's (exit code, message) is classified, the state bookkeeping of an attempt's start
and end, and the time estimates. Shared by the in-process runner (runner.py) and the child-process workers
(workers.py), neither of which imports the other's module for it."""

from __future__ import annotations

import shutil

from nearpolicy.arena.spec import ArenaSpec, Cell
from nearpolicy.arena.state import FINAL, ArenaState
from nearpolicy.arena.table import duration
from nearpolicy.runs.folder import last_step

STOP_CODES = (130, 143)
DIVERGENCE_MARKS = ("non-finite", "NonFiniteError")  # training.guards.NonFiniteError's messages, as training.run.fit relays


def classify(code: int, message: str) -> tuple[str, str | None]:
    """(status, failure kind) of a cell's run from run_training's (exit code, closing message): done; stopped (a
    signal); diverged (non-finite loss, gradient or weights: the bad-step guard); failed with "infrastructure"
    (any other failure: an engine crash, a run that could not start)."""
    if code == 0:
        return "done", None
    if code in STOP_CODES:
        return "stopped", None
    if code == 1 and any(mark in message for mark in DIVERGENCE_MARKS):
        return "diverged", "divergence"
    return "failed", "infrastructure"


def cell_units(cell: Cell) -> tuple[int, int, int]:
    """(training steps, evals, samples per step) of a cell: the evals are step 0, every logging.eval_every steps
    and the last step."""
    steps, every = cell.config.run.steps, cell.config.logging.eval_every
    a = cell.config.algorithm
    return steps, 1 + steps // every + (steps % every != 0), a.group_size * a.prompts_per_step


def estimated_seconds(spec: ArenaSpec, cells: list[Cell]) -> float:
    """The arena's estimate for `cells` (seconds): per cell start_seconds + evals x eval_seconds + steps x
    step_seconds, the step time scaled linearly by the cell's samples per step against the median cell's."""
    est = spec.estimates
    samples = sorted(cell_units(c)[2] for c in spec.cells)
    median = samples[len(samples) // 2]
    total = 0.0
    for cell in cells:
        steps, evals, per_step = cell_units(cell)
        total += est.start_seconds + evals * est.eval_seconds + steps * est.step_seconds * per_step / median
    return total


def eta_seconds(spec: ArenaSpec, state: ArenaState, todo: list[Cell], elapsed: float,
                running: tuple[int, int] | None = None) -> tuple[float, bool]:
    """(seconds left for the cells `todo`, measured?). `todo[0]` is the running cell, `elapsed` seconds into this
    attempt, with `running` = (steps done in this attempt, steps left) (None: nothing running, the dry run). A cell's
    time is the mean wall time of the done cells when any (diverged ones left out: an early stop is no full cell's
    time), else the running cell's pace (elapsed / steps done x its steps), else the arena's estimates; the running
    cell's own remainder is its pace x its steps left once it has done a step."""
    finished = [r.seconds for r in state.cells.values() if r.status == "done" and r.seconds > 0]
    if running is None or not todo:
        if finished:
            return sum(finished) / len(finished) * len(todo), True
        return estimated_seconds(spec, todo), False
    steps, (done, left) = todo[0].config.run.steps, running
    pace = elapsed / done if done else None
    if finished:
        per_cell, measured = sum(finished) / len(finished), True
    elif pace is not None:
        per_cell, measured = pace * steps, True
    else:
        per_cell, measured = estimated_seconds(spec, todo[:1]), False
    current = pace * left if pace is not None else max(0.0, per_cell - elapsed)
    return current + per_cell * (len(todo) - 1), measured


def _remove_bulk(cell: Cell) -> None:
    """A finished cell's checkpoints/ and engine/ (GBs per cell for SmolLM2); metrics, config, plan and samples stay."""
    for name in ("checkpoints", "engine"):
        shutil.rmtree(cell.run_dir / name, ignore_errors=True)


def start_record(state: ArenaState, cell: Cell) -> None:
    """Record that `cell` starts an attempt (status running, one more attempt), saved."""
    record = state.cells[cell.id]
    record.status, record.attempts = "running", record.attempts + 1
    state.save()


def finish_record(spec: ArenaSpec, state: ArenaState, cell: Cell, position: str, code: int, message: str,
                  seconds: float, say) -> None:
    """Record the end of `cell`'s attempt from its run's (exit code, closing message) and wall `seconds` (classify;
    the last step logged), saved; delete a final cell's bulk unless arena.keep_checkpoints; say how it ended."""
    record = state.cells[cell.id]
    record.seconds += seconds
    state.seconds += seconds
    record.status, record.failure = classify(code, message)
    record.error = None if record.status == "done" else message.strip()[-2000:]
    record.last_step = last_step(cell.run_dir)
    state.save()
    if record.status in FINAL and not spec.keep_checkpoints:
        _remove_bulk(cell)
    say(f"arena {position} {cell.id}: {record.status}" + (f" ({record.failure}): {message.strip()[:300]}"
                                                          if record.failure else f" in {duration(record.seconds)}"))
