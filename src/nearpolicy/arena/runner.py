"""Runs an arena's cells one after another through the ordinary training API (api.run_training, the run
`nearpolicy train` makes), keeping OUT/arena-state.json (state.py) current.

A cell whose run folder exists is continued through the ordinary resume path (`--resume`: from its newest
checkpoint; a finished run is recognised as such), so an interrupted arena continues where it stopped and a done or
diverged cell never runs again. A failed cell is recorded with its error and the arena goes on; SIGINT / SIGTERM
stop the arena after the cell's step in progress (checkpointed), exit 130 / 143. While a cell runs, a progress line
on stderr says which cell (i/N), its step and the arena's ETA, from the done cells' wall times (not the diverged
ones'; before any is done: the running cell's pace, else the arena's estimates, marked "est."). Ray workers are
not supported: cells run in this process, one at a time (each cell may still use rollout.backend = "ray" itself)."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

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


class Progress(threading.Thread):
    """Prints `line(step)` whenever the running cell's metrics.jsonl logs a new step (polled every `every` s)."""

    def __init__(self, run_dir: Path, line: Callable[[int | None], str], say: Callable[[str], None],
                 every: float = 1.0):
        super().__init__(daemon=True)
        self.run_dir, self.line, self.say, self.every = run_dir, line, say, every
        self.done = threading.Event()

    def run(self) -> None:
        seen = -1
        while not self.done.wait(self.every):
            step = last_step(self.run_dir)
            if step is not None and step != seen:
                seen = step
                self.say(self.line(step))

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


def _default_train(cfg, resume, log, progress):
    from nearpolicy.api import run_training

    return run_training(cfg, resume=resume, log=log, progress=progress)


def _remove_bulk(cell: Cell) -> None:
    """A finished cell's checkpoints/ and engine/ (GBs per cell for SmolLM2); metrics, config, plan and samples stay."""
    for name in ("checkpoints", "engine"):
        shutil.rmtree(cell.run_dir / name, ignore_errors=True)


def run_cell(spec: ArenaSpec, state: ArenaState, cell: Cell, position: str, todo: list[Cell], say, train) -> int:
    """Run (or continue) one cell, record it; returns its exit code."""
    record = state.cells[cell.id]
    record.status, record.attempts = "running", record.attempts + 1
    state.save()
    logs = spec.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0, first = time.monotonic(), last_step(cell.run_dir) or 0

    def line(step: int | None) -> str:
        step = step or 0
        left, measured = eta_seconds(spec, state, todo, time.monotonic() - t0,
                                     (max(0, step - first), cell.config.run.steps - step))
        counts = state.counts()
        return (f"arena {position} {cell.id}: step {step}/{cell.config.run.steps} | {counts['done']} done, "
                f"{counts['diverged']} diverged, {counts['failed']} failed | ETA {duration(left)}"
                f"{'' if measured else ' (est.)'}")

    say(line(first))
    watcher = Progress(cell.run_dir, line, say)
    watcher.start()
    with (logs / f"{cell.folder}.log").open("a", encoding="utf-8") as log_file:
        write = lambda msg: (log_file.write(msg + "\n"), log_file.flush())  # noqa: E731
        try:
            code, message = train(cell.config, cell.run_dir.exists(), write, False)
        except Exception as err:  # noqa: BLE001 - recorded as the cell's infrastructure failure, the arena goes on
            code, message = 1, f"error: {type(err).__name__}: {err}"
        finally:
            watcher.stop()
        write(message)
    record.seconds += time.monotonic() - t0
    state.seconds += time.monotonic() - t0
    record.status, record.failure = classify(code, message)
    record.error = None if record.status == "done" else message.strip()[-2000:]
    record.last_step = last_step(cell.run_dir)
    state.save()
    if record.status in FINAL and not spec.keep_checkpoints:
        _remove_bulk(cell)
    say(f"arena {position} {cell.id}: {record.status}" + (f" ({record.failure}): {message.strip()[:300]}"
                                                          if record.failure else f" in {duration(record.seconds)}"))
    return code


def run_arena(spec: ArenaSpec, only: str | None = None, say: Callable[[str], None] | None = None,
              train: Callable | None = None) -> int:
    """Run the cells of `spec` matching the glob `only` (all when None) that are not final yet, then write the
    arena page (page.write_page) over every cell run so far. `train(cfg, resume, log, progress) -> (exit code,
    message)` defaults to api.run_training. Returns 0 when every selected cell is done or diverged, 1 when one
    failed, 130 / 143 when a signal stopped the arena. Raises ArenaError for a changed arena (state.py) or an
    --only that matches no cell."""
    from nearpolicy.arena.page import write_page

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    train = train or _default_train
    chosen = spec.select(only)
    state = ArenaState.open(spec.out, spec)
    state.save()
    code = 0
    for i, cell in enumerate(chosen):
        position = f"{i + 1}/{len(chosen)}"
        if state.cells[cell.id].status in FINAL:
            say(f"arena {position} {cell.id}: {state.cells[cell.id].status} earlier, not run again")
            continue
        todo = [c for c in chosen[i:] if state.cells[c.id].status not in FINAL]
        cell_code = run_cell(spec, state, cell, position, todo, say, train)
        if cell_code in STOP_CODES:
            code = cell_code
            say(f"arena stopped at {cell.id}; run the same command again to continue it from its checkpoint")
            break
        if state.cells[cell.id].status == "failed":
            code = 1
    for warning in write_page(spec, state):
        say(f"warning: {warning}")
    counts = state.counts()
    say(f"arena: {counts['done']} done, {counts['diverged']} diverged, {counts['failed']} failed, "
        f"{counts['pending'] + counts['running'] + counts['stopped']} not run of {len(spec.cells)} cells; machine "
        f"time so far {duration(state.seconds)}; wrote {spec.out / 'arena.md'}, arena.json and arena.html")
    return code


def _count(items, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def dry_run(spec: ArenaSpec, only: str | None = None) -> str:
    """The cells `only` selects, each with its status (from a stored state, if any) and every override it gets
    (arena.set, source, correction, [[override]]s, in the order applied), and the
    estimated budget. Writes nothing. Raises ArenaError for a changed arena or an --only matching nothing."""
    chosen = spec.select(only)
    state = ArenaState.open(spec.out, spec)
    todo = [c for c in chosen if state.cells[c.id].status not in FINAL]
    steps = sum(cell_units(c)[0] for c in todo)
    samples = sum(cell_units(c)[0] * cell_units(c)[2] for c in todo)
    left, measured = eta_seconds(spec, state, todo, 0.0)
    lines = [f"# nearpolicy arena --dry-run {spec.path}: base {spec.base}, output {spec.out}; nothing was run",
             f"# {_count(spec.corrections, 'correction')} x {_count(spec.sources, 'source')} x "
             f"{_count(spec.seeds, 'seed')} = {_count(spec.cells, 'cell')}; {len(chosen)} selected, {len(todo)} to run"]
    for cell in chosen:
        lines.append(f"{cell.id:<40} {state.cells[cell.id].status:<9} {' '.join(cell.sets)}")
    basis = "from the done cells" if measured else "arena.step_seconds, eval_seconds, start_seconds"
    lines.append(f"# budget of the cells to run: {steps} training steps, {samples} samples; estimated "
                 f"{duration(left)} ({basis})")
    return "\n".join(lines) + "\n"
