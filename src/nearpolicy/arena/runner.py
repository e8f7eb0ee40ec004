"""Runs an arena's cells one after another through the ordinary training API (api.run_training, the run
`nearpolicy train` makes), keeping OUT/arena-state.json (state.py) current.

A cell whose run folder exists is continued through the ordinary resume path (`--resume`: from its newest
checkpoint; a finished run is recognised as such), so an interrupted arena continues where it stopped and a done or
diverged cell never runs again. A failed cell is recorded with its error and the arena goes on; SIGINT / SIGTERM
stop the arena after the cell's step in progress (checkpointed), exit 130 / 143. While a cell runs, a progress line
on stderr says which cell (i/N), its step and the arena's ETA, from the done cells' wall times (not the diverged
ones'; before any is done: the running cell's pace, else the arena's estimates, marked "est."). Cells run in this
process, one at a time; with --workers N up to N at a time, each in a child process (workers.py: its failure
semantics). Ray workers are not supported (each cell may still use rollout.backend = "ray" itself).

Order: the arena's (corrections-major: every source and seed of the first correction first); with arena.sequential
= true, seed-major (every cell of the first seed, then of the next), and after each seed from min_seeds on the
sequential rule (sequential.py) looks at the first seeds' results: when every comparison is settled, the cells of the
remaining seeds that are not done or diverged are recorded as "skipped" and the arena ends. The looks are recomputed
from the stored results on every start (a deterministic function of them), so a restarted arena stops at the same
seed, runs skipped cells only when the recomputed rule goes on to their seed, and writes OUT/arena-sequential.json
(the looks and the stop) after each look. With --workers N the cells of that order (of one seed under the rule) start
longest first by the arena's estimate (workers.longest_first)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nearpolicy.arena import sequential
from nearpolicy.arena.spec import ArenaSpec, Cell
from nearpolicy.arena.state import FINAL, ArenaState
from nearpolicy.arena.table import duration
from nearpolicy.arena.records import (STOP_CODES, cell_units, classify, estimated_seconds,  # noqa: F401
                                       eta_seconds, finish_record, start_record)
from nearpolicy.runs.folder import last_step

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


def run_cell(spec: ArenaSpec, state: ArenaState, cell: Cell, position: str, todo: list[Cell], say, train) -> int:
    """Run (or continue) one cell in this process, record it; returns its exit code."""
    start_record(state, cell)
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
    finish_record(spec, state, cell, position, code, message, time.monotonic() - t0, say)
    return code


def _run_cells(spec: ArenaSpec, state: ArenaState, order: list[Cell], first: int, last: int, say, train,
               workers: int = 1) -> int:
    """Run order[first:last] that are not final yet, one after another (workers > 1: workers.py); returns 0, 1 when
    one failed, or a STOP_CODES code (a signal stopped a cell: the arena ends)."""
    if workers > 1:
        from nearpolicy.arena.workers import Workers

        return Workers(spec, state, say, train, workers).run(order, first, last)
    code = 0
    for i in range(first, last):
        cell, position = order[i], f"{i + 1}/{len(order)}"
        if state.cells[cell.id].status in FINAL:
            say(f"arena {position} {cell.id}: {state.cells[cell.id].status} earlier, not run again")
            continue
        todo = [c for c in order[i:] if state.cells[c.id].status not in FINAL]
        cell_code = run_cell(spec, state, cell, position, todo, say, train)
        if cell_code in STOP_CODES:
            say(f"arena stopped at {cell.id}; run the same command again to continue it from its checkpoint")
            return cell_code
        if state.cells[cell.id].status == "failed":
            code = 1
    return code


def rule_of(spec: ArenaSpec) -> sequential.Rule:
    """The sequential rule of `spec` (arena.sequential = true): K looks from min_seeds of the seeds listed. Raises
    ValueError when the arena has no sequential settings."""
    if spec.sequential is None:
        raise ValueError("the arena has arena.sequential = false: no sequential rule")
    return sequential.Rule(len(spec.seeds), spec.sequential.min_seeds, spec.sequential.target_mde)


def seed_major(spec: ArenaSpec, cells: list[Cell]) -> list[Cell]:
    """`cells` seed by seed in arena.seeds' order (each seed's cells in the arena's order)."""
    return sorted(cells, key=lambda c: spec.seeds.index(c.seed))


def look(spec: ArenaSpec, state: ArenaState, rule: sequential.Rule, history: list, done: int) -> sequential.Decision:
    """The rule's look after the first `done` seeds of arena.seeds: each comparison the rule waits for (arena.stop_for;
    default every one of keys.arm_pairs) of the arena.stop_on outcome, paired over those seeds' results only
    (later seeds' cells, if any ran, are left out), judged at the rule's level and appended to `history`; returns
    sequential.decide's decision."""
    from nearpolicy.arena.comparisons import compare_paired
    from nearpolicy.arena.keys import arm_pairs, pair_label
    from nearpolicy.arena.table import arena_results

    seeds = spec.seeds[:done]
    results = [r for r in arena_results(spec, state)[0] if r.seed in seeds]
    eval_size, which = spec.cells[0].config.task.eval_size, spec.sequential.stop_on
    judgments = []
    for arm, base in arm_pairs([c.name for c in spec.corrections], [s.name for s in spec.sources], spec.baseline):
        if not spec.sequential.waits_for(pair_label(arm, base)):
            continue
        paired = compare_paired(results, [], arm, base, which, eval_size)
        judgments.append(sequential.judge(paired.label, paired.seeds, rule.level, rule.target_mde, paired.reason))
    history.append(judgments)
    return sequential.decide(rule, history, seeds)


def _report(decision: sequential.Decision, prefix: str, target_mde: float, say) -> None:
    for line in sequential.verdict_lines(decision, target_mde):
        say(prefix + line)


def _take_look(spec: ArenaSpec, state: ArenaState, rule: sequential.Rule, history: list,
               decisions: list[sequential.Decision], done: int, say) -> bool:
    """The look after `done` seeds: decide, record the skipped cells (state) and the looks (arena-sequential.json),
    say the verdicts; returns whether the arena stops here (every comparison settled before the last seed)."""
    decision = look(spec, state, rule, history, done)
    decisions.append(decision)
    where = (f"after {done} seeds ({', '.join(map(str, decision.seeds))}; look {decision.look} of {decision.looks}, "
             f"level {decision.level:.4f})")
    stops = decision.stop and done < len(spec.seeds)
    skipped = None
    if stops:
        later = set(spec.seeds[done:])
        skipped = [c.id for c in seed_major(spec, list(spec.cells))
                   if c.seed in later and state.cells[c.id].status not in FINAL]
        for cid in skipped:
            state.cells[cid].status = "skipped"
        state.save()
    sequential.write_record(spec.out, sequential.record(rule, spec.sequential.stop_on, decisions, skipped,
                                                        spec.sequential.stop_for))
    if done == len(spec.seeds):
        _report(decision, f"sequential: every seed run, {where}: ", rule.target_mde, say)
    elif stops:
        _report(decision, f"sequential stop {where}: ", rule.target_mde, say)
        say(f"sequential stop: {len(skipped)} cell(s) of seed(s) {', '.join(map(str, spec.seeds[done:]))} recorded "
            f"as skipped; the looks are in {spec.out / sequential.RECORD}")
    else:
        settled = sum(v.settled_at is not None for v in decision.verdicts)
        say(f"sequential look {where}: {settled} of {len(decision.verdicts)} comparisons settled; going on to seed "
            f"{spec.seeds[done]}")
        _report(decision, "  ", rule.target_mde, say)
    return stops


def run_sequential(spec: ArenaSpec, state: ArenaState, chosen: list[Cell], say, train, workers: int = 1) -> int:
    """Run `chosen` seed-major under the sequential rule (module docstring), a look after each seed from min_seeds
    on (once every cell of the seed has ended, whatever `workers`); returns as _run_cells."""
    rule, order = rule_of(spec), seed_major(spec, chosen)
    history, decisions, code = [], [], 0
    if (changed := sequential.changed_stop_for(spec)) is not None:
        say(f"warning: {changed}; the looks are retaken with the file's list, and a choice made after seeing results "
            f"is not covered by the rule's error rate")
    for done in range(len(spec.seeds) + 1):
        if done >= rule.min_seeds and _take_look(spec, state, rule, history, decisions, done, say):
            return code
        mine = [i for i, c in enumerate(order) if done < len(spec.seeds) and c.seed == spec.seeds[done]]
        if mine:
            cell_code = _run_cells(spec, state, order, mine[0], mine[-1] + 1, say, train, workers)
            if cell_code in STOP_CODES:
                return cell_code
            code = max(code, cell_code)
    return code


def run_arena(spec: ArenaSpec, only: str | list[str] | None = None, say: Callable[[str], None] | None = None,
              train: Callable | None = None, workers: int = 1) -> int:
    """Run the cells of `spec` matching the glob `only` (all when None) that are not final yet (in the arena's
    order; seed-major under the sequential rule, which may skip the last seeds: module docstring), then write the
    arena page (page.write_page) over every cell run so far. `train(cfg, resume, log, progress) -> (exit code,
    message)` defaults to api.run_training; `workers` > 1 cells run at a time in child processes (workers.py). Returns
    0 when every selected cell is done, diverged or skipped, 1 when one failed, 130 / 143 when a signal stopped the
    arena. Raises ArenaError for a changed arena (state.py) or an --only that matches no cell, ValueError for bad
    `workers` (workers.check_workers)."""
    from nearpolicy.arena.page import write_page
    from nearpolicy.arena.workers import check_workers

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    train = train or _default_train
    chosen = spec.select(only)
    for warning in check_workers(workers, train, chosen):
        say(f"warning: {warning}")
    state = ArenaState.open(spec.out, spec)
    state.save()
    if spec.sequential is None:
        code = _run_cells(spec, state, chosen, 0, len(chosen), say, train, workers)
    else:
        code = run_sequential(spec, state, chosen, say, train, workers)
    for warning in write_page(spec, state):
        say(f"warning: {warning}")
    counts = state.counts()
    skipped = f"{counts['skipped']} skipped by the sequential rule, " if counts["skipped"] else ""
    say(f"arena: {counts['done']} done, {counts['diverged']} diverged, {counts['failed']} failed, {skipped}"
        f"{counts['pending'] + counts['running'] + counts['stopped']} not run of {len(spec.cells)} cells; machine "
        f"time so far {duration(state.seconds)}; wrote {spec.out / 'arena.md'}, arena.json and arena.html")
    return code


def _count(items, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def start_refusals(spec: ArenaSpec, only: str | list[str] | None = None,
                   adopted: set[str] = frozenset()) -> dict[str, str]:
    """Cell id -> why its run would be refused at start, for the selected cells still to run: what `nearpolicy train
    --dry-run` checks before a model loads (training/assemble.checked_before_loading: the model's support of every
    configured piece, the task and an adaptive mixture's datasets, the teacher). One cell per correction x source is
    checked (its first selected seed; seconds each), since the seed changes only which problems are drawn."""
    from nearpolicy.training.assemble import checked_before_loading

    state, refused, seen = ArenaState.open(spec.out, spec), {}, set()
    for cell in spec.select(only):
        arm = (cell.correction, cell.source)
        if arm in seen or state.cells[cell.id].status in FINAL or cell.id in adopted:
            continue
        seen.add(arm)
        try:
            checked_before_loading(cell.config)
        except (FileNotFoundError, ValueError) as err:
            refused[cell.id] = str(err)
    return refused


def dry_run(spec: ArenaSpec, only: str | list[str] | None = None, workers: int = 1,
            adopted: set[str] = frozenset()) -> str:
    """The cells `only` selects (seed-major under the sequential rule), each with its status (from a stored state, if
    any) and every override it gets (arena.set, source, correction, [[override]]s, in the order applied), the
    estimated budget and, with arena.sequential = true, the rule (K looks, each look's level and multipliers, the
    target MDE) and the fewest and most cells it runs. With `workers` > 1: the warning a run would give when they
    oversubscribe the CPUs (workers.oversubscribed), and the time divided by the cells at a time (min(workers, cells
    to run); under the sequential rule seed by seed: min(workers, the seed's cells to run)). Cells in `adopted` (those
    --adopt --dry-run would adopt) show as "adopt" and are not counted to run. Writes nothing. Raises
    ArenaError for a changed arena or an --only matching nothing."""
    from nearpolicy.arena.workers import oversubscribed

    chosen = spec.select(only)
    state = ArenaState.open(spec.out, spec)
    rule = rule_of(spec) if spec.sequential is not None else None
    if rule is not None:
        chosen = seed_major(spec, chosen)
    waiting = [c for c in chosen if rule is not None and state.cells[c.id].status == "skipped"]
    todo = [c for c in chosen if state.cells[c.id].status not in FINAL and c not in waiting and c.id not in adopted]
    steps = sum(cell_units(c)[0] for c in todo)
    samples = sum(cell_units(c)[0] * cell_units(c)[2] for c in todo)
    groups = [[c for c in todo if c.seed == seed] for seed in spec.seeds] if rule is not None else [todo]
    (left, measured), at_once = eta_seconds(spec, state, [], 0.0), 1  # 0 s, measured when a cell is done
    for group in (g for g in groups if g):
        seconds, measured = eta_seconds(spec, state, group, 0.0)
        left += seconds / min(workers, len(group))
        at_once = max(at_once, min(workers, len(group)))
    lines = [f"# nearpolicy arena --dry-run {spec.path}: base {spec.base}, output {spec.out}; nothing was run",
             f"# {_count(spec.corrections, 'correction')} x {_count(spec.sources, 'source')} x "
             f"{_count(spec.seeds, 'seed')} = {_count(spec.cells, 'cell')}; {len(chosen)} selected, {len(todo)} to run"
             + (f" ({len(waiting)} skipped by the sequential rule: run only if it, recomputed, goes on to their seed)"
                if waiting else "")]
    lines += [f"# warning: {warning}" for warning in oversubscribed(workers, chosen)]
    if rule is not None:
        first = sum(c.seed in spec.seeds[:rule.min_seeds] for c in chosen)
        lines += [f"# {line}" for line in sequential.rule_lines(rule, spec.sequential.stop_on,
                                                                          spec.sequential.stop_for)]
        lines.append(f"# sequential: at least {first} of the {len(chosen)} selected cells run (the first "
                     f"{rule.min_seeds} seeds), at most all {len(chosen)}")
    for cell in chosen:
        status = "adopt" if cell.id in adopted else state.cells[cell.id].status
        lines.append(f"{cell.id:<40} {status:<9} {' '.join(cell.sets)}")
    basis = "from the done cells" if measured else "arena.step_seconds, eval_seconds, start_seconds"
    parallel = "" if workers == 1 else f" with {workers} workers" + (
        f" (at most {at_once} cells at a time)" if at_once < workers else "")
    lines.append(f"# budget of the cells to run: {steps} training steps, {samples} samples; estimated "
                 f"{duration(left)}{parallel} ({basis})" + (" at most (the rule may stop earlier)" if rule is not None
                                                           else ""))
    return "\n".join(lines) + "\n"
