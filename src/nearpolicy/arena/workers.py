"""`nearpolicy arena --workers N`: up to N cells at a time, each run by a child process of its own; this process (the
parent) stays the only writer of OUT/arena-state.json (runner.start_record / finish_record, as for a cell run in
process) and the only speaker on stderr.

Why a subprocess (`python -m nearpolicy.arena.worker_child`, Popen with start_new_session) and not multiprocessing's
"spawn": a terminal's Ctrl-C goes to its whole foreground process group, and a second SIGINT aborts a run's step in
progress (signals.GracefulStop). A child in a session of its own gets no signal from the terminal, only the ones the
parent forwards, each exactly once; Popen puts it there before it runs any code, which a spawned
multiprocessing.Process cannot be. The child is the ordinary run (runner's `train`, api.run_training by default) in a
fresh interpreter, so a native crash (SIGSEGV in an engine, the OOM killer) ends only its cell. `train` goes to the
child by name (module:qualname, with this process's sys.path), so it must be a module-level function.

The protocol: the parent writes one JSON line on the child's stdin (the cell's config, resume or not, the cell's log
file, the train function's name, sys.path, the result pipe's fd) and keeps stdin open; the child runs the cell, writes
one JSON line {"code": int, "message": str} (the run's exit code and closing message; UTF-8, at most REPORT_BYTES: the
message's last characters that fit, report_line) on the result pipe and exits. The parent empties the result pipe
without blocking on every poll, so no report, however long, blocks a child in its write, and reads the report from
the last complete line (parse_report; anything the child wrote before it is ignored). The child's stdout and stderr go
to OUT/logs/CELL.log after the run's own log lines (faulthandler's trace of a native crash too). The wall time
recorded is the parent's, from the child's start to its end.

Failure semantics:
- a child that reports is recorded as a cell run in process is (runner.classify: done, diverged, failed, stopped);
- a child that ends without reporting (killed by a signal, os._exit, a broken interpreter) is failed
  ("infrastructure"), its cause (SIGKILL, exit code 3) in the error, and the arena goes on; after a stop was forwarded
  to it, it is stopped (resumable) instead;
- a child whose report is malformed (not JSON, a code that is no integer: Infinity, 1e999, "0", true; a message that
  is no string) is failed ("infrastructure"), what is wrong in the error, and the arena goes on;
- SIGINT / SIGTERM to the parent: each is forwarded, as itself, to every running child once, one signal per poll in
  the order they came (the first: the runs stop after the step in progress and checkpoint it; a second: they abort the
  step, keeping the last checkpoint; each one said on stderr), no cell starts any more, the parent waits for the
  running ones, records each, and the arena exits 128 + the first signal (130 / 143). Rerunning the same
  command continues every stopped cell from its checkpoint. A child stopped by a signal the parent did not send (a
  `kill` of the child) stops the arena the same way, as a stopped cell does in process;
- the parent killed outright (SIGKILL): the state keeps the cells in flight as "running" (resumed on the next start);
  their children see their stdin close and stop as on SIGTERM (after the step in progress, checkpointed). Let them
  end before rerunning the arena, or a cell's folder has two writers;
- an exception in the parent: its children get SIGTERM, are waited for and recorded, then it propagates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from nearpolicy.arena.records import estimated_seconds, finish_record, start_record
from nearpolicy.arena.worker_child import REPORT_BYTES, parse_report, report_line, resolve  # noqa: F401
from nearpolicy.arena.spec import ArenaSpec, Cell
from nearpolicy.arena.state import FINAL, ArenaState
from nearpolicy.arena.table import duration
from nearpolicy.runs.folder import last_step
from nearpolicy.signals import STOP_SIGNALS, exit_description

ENTRY = "nearpolicy.arena.worker_child"
POLL_SECONDS = 0.25  # how often the parent looks at its children (exits, reports, new steps, signals to forward)
KEPT_BYTES = 4 * REPORT_BYTES  # of what a child writes on its result pipe, the parent keeps the last KEPT_BYTES


def train_name(train) -> str:
    """'module:qualname' of `train`, by which a child imports it. Raises ValueError when that name does not lead
    back to `train` (a lambda, a local function, an instance, a function of the __main__ script)."""
    module, qualname = getattr(train, "__module__", None), getattr(train, "__qualname__", "")
    found = None
    if module and module != "__main__" and "<" not in qualname:
        try:
            found = resolve(f"{module}:{qualname}")
        except (ImportError, AttributeError):
            found = None
    if found is not train:
        raise ValueError(f"--workers > 1 runs each cell in a child process, which imports `train` by name: {train!r} "
                         "is no module-level function of an importable module")
    return f"{module}:{qualname}"


def check_workers(workers: int, train, cells: list[Cell]) -> list[str]:
    """Warnings for running `cells` `workers` at a time (oversubscribed). Raises ValueError for workers < 1 or, above
    1, a `train` a child cannot import (train_name)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1 (got {workers})")
    if workers == 1:
        return []
    train_name(train)
    return oversubscribed(workers, cells)


def oversubscribed(workers: int, cells: list[Cell]) -> list[str]:
    """The warning (a list of at most one) when `workers` x the largest run.threads of `cells` is above the CPU
    count; none for one worker (the run then uses run.threads as it is)."""
    if workers <= 1:
        return []
    threads, cpus = max((c.config.run.threads for c in cells), default=1), os.cpu_count() or 1
    if workers * threads > cpus:
        return [f"--workers {workers} x run.threads {threads} = {workers * threads} threads on {cpus} CPU(s): the "
                "cells will compete for cores (each slower, the arena maybe no faster)"]
    return []


def parallel_eta(spec: ArenaSpec, state: ArenaState, running: list[tuple[Cell, float, int, int]],
                 waiting: list[Cell], workers: int) -> tuple[float, bool]:
    """(seconds left, measured?) with `workers` cells at a time. `running`: (cell, seconds into this attempt, steps
    done in it, steps left) per running cell; `waiting`: the cells still to start. A cell's time is the mean wall
    time of the done cells (diverged ones left out), else the running cells' mean pace x their steps, else the
    arena's estimates; a running cell's remainder is its own pace x its steps left once it has done a step. The sum
    is divided by min(workers, cells left)."""
    finished = [r.seconds for r in state.cells.values() if r.status == "done" and r.seconds > 0]
    paced = [elapsed / done * cell.config.run.steps for cell, elapsed, done, _ in running if done]
    per_cell = sum(finished) / len(finished) if finished else sum(paced) / len(paced) if paced else None
    left = 0.0
    for cell, elapsed, done, steps_left in running:
        whole = per_cell if per_cell is not None else estimated_seconds(spec, [cell])
        left += elapsed / done * steps_left if done else max(0.0, whole - elapsed)
    left += per_cell * len(waiting) if per_cell is not None else estimated_seconds(spec, waiting) if waiting else 0.0
    return left / max(1, min(workers, len(running) + len(waiting))), per_cell is not None


class _Stop:
    """The parent's SIGINT / SIGTERM handlers while children run (main thread only): a signal is only recorded here,
    in `signals` in the order they came; the loop handles them one per poll (Workers._forward), so each child gets
    each signal once, as itself, whenever it started. `signum` is the first one (the arena's exit code), or None."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._previous: dict[int, object] = {}

    @property
    def signum(self) -> int | None:
        return self.signals[0] if self.signals else None

    def __enter__(self) -> "_Stop":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, lambda signum, frame: self.request(signum))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def request(self, signum: int) -> None:
        self.signals.append(signum)


@dataclass
class _Child:
    cell: Cell
    position: str
    proc: subprocess.Popen
    result: int  # the result pipe's read end
    t0: float
    first: int  # the cell's last logged step when it started
    seen: int
    forwarded: int = 0  # stop signals forwarded to it
    report: bytearray = field(default_factory=bytearray)  # what it has written on its result pipe so far (the tail)


def longest_first(spec: ArenaSpec, queue: list[tuple[Cell, str]]) -> list[tuple[Cell, str]]:
    """`queue` ordered by the arena's estimate of each cell's time (records.estimated_seconds), longest first, ties in
    the given order. With a barrier after every seed (the sequential rule) the order given can leave a seed's longest
    cell to run alone at its end (G = 2, 8, 2, 8 cells of about 7, 14, 8 and 16 minutes on two workers: 7 + 8 + 16 = 31
    minutes on one worker beside 14 on the other; longest first: 16 + 7 beside 14 + 8, 23 minutes). Longest first is
    Graham's greedy rule (1969: at most 4/3 of the shortest possible makespan)."""
    return sorted(queue, key=lambda item: -estimated_seconds(spec, [item[0]]))


class Workers:
    """Runs cells up to `workers` at a time in child processes (module docstring), recording each in `state`."""

    def __init__(self, spec: ArenaSpec, state: ArenaState, say, train, workers: int):
        self.spec, self.state, self.say, self.workers = spec, state, say, workers
        self.train = train_name(train)
        self.running: list[_Child] = []
        self.waiting: list[Cell] = []
        self.stop = _Stop()
        self.handled = 0  # of stop.signals, those said and forwarded

    def run(self, order: list[Cell], first: int, last: int) -> int:
        """Run order[first:last] that are not final yet, up to `workers` at a time, the longest first (longest_first);
        returns as runner._run_cells: 0, 1 when one failed, 128 + the signal when a signal stopped the arena."""
        queue = []
        for i in range(first, last):
            cell, position = order[i], f"{i + 1}/{len(order)}"
            if self.state.cells[cell.id].status in FINAL:
                self.say(f"arena {position} {cell.id}: {self.state.cells[cell.id].status} earlier, not run again")
            else:
                queue.append((cell, position))
        queue = longest_first(self.spec, queue)
        self.waiting = [c for c in order[first:] if self.state.cells[c.id].status not in FINAL]
        code = 0
        with self.stop:
            try:
                while self.running or (queue and self.stop.signum is None):
                    while queue and len(self.running) < self.workers and self.stop.signum is None:
                        self._launch(*queue.pop(0))
                    self._forward()
                    for cell, cell_code in self._reap():
                        status = self.state.cells[cell.id].status
                        if status == "stopped" and self.stop.signum is None:
                            self.stop.request(cell_code - 128)  # a child stopped by someone else: the arena stops
                        elif status == "failed":
                            code = 1
                    self._progress()
                    time.sleep(POLL_SECONDS)
            except BaseException:
                self._shutdown()
                raise
        if self.stop.signum is not None:
            self.say(f"arena stopped by {signal.Signals(self.stop.signum).name}; run the same command again to "
                     "continue the stopped cells from their checkpoints")
            return 128 + self.stop.signum
        return code

    def _launch(self, cell: Cell, position: str) -> None:
        start_record(self.state, cell)
        self.waiting.remove(cell)
        logs = self.spec.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{cell.folder}.log"
        first = last_step(cell.run_dir) or 0
        read, write = os.pipe()
        os.set_blocking(read, False)  # emptied on every poll (_drain), never waited on
        job = {"config": cell.config.model_dump(mode="json"), "resume": cell.run_dir.exists(), "log": str(log_path),
               "train": self.train, "sys_path": sys.path, "result_fd": write}
        try:
            with log_path.open("ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", ENTRY], stdin=subprocess.PIPE, stdout=log, stderr=log,
                                        pass_fds=(write,), start_new_session=True)
        finally:
            os.close(write)
        child = _Child(cell, position, proc, read, time.monotonic(), first, first)
        self.running.append(child)
        try:
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # the child died at once: _reap records it
        self.say(self._line(child))

    def _forward(self) -> None:
        """Handle the next stop signal not handled yet, if any: say what it does and send it, as itself, to every
        running child. One per poll, in the order they came, so that a child's handler sees each one apart (two
        signals sent at once may arrive as one); no child starts once a stop is under way, so all got the same."""
        if self.handled == len(self.stop.signals):
            return
        signum = self.stop.signals[self.handled]
        self.handled += 1
        if not self.running:
            return
        what = {1: ", stopping them after their steps in progress (checkpointed); send it again to abort now; no cell "
                   "starts any more",
                2: ", aborting their steps in progress; no cell starts any more"}.get(self.handled, " again")
        self.say(f"{signal.Signals(signum).name}: forwarded to the {len(self.running)} running cell(s){what}")
        for child in self.running:
            child.forwarded += 1
            try:
                os.kill(child.proc.pid, signum)
            except ProcessLookupError:
                pass

    def _drain(self, child: _Child) -> None:
        """Add what `child` has written on its result pipe since the last look to child.report (its last
        KEPT_BYTES), without blocking: a child never waits on a full pipe, whatever it writes."""
        try:
            while chunk := os.read(child.result, 65536):
                child.report += chunk
        except BlockingIOError:
            pass
        del child.report[:-KEPT_BYTES]

    def _reap(self) -> list[tuple[Cell, int]]:
        """Empty every running child's result pipe; record the children that have ended; returns (cell, the run's
        exit code) of each."""
        ended = []
        for child in list(self.running):
            self._drain(child)
            if child.proc.poll() is None:
                continue
            self._drain(child)  # what it wrote between the first look and its end
            self.running.remove(child)
            code, message = self._outcome(child)
            finish_record(self.spec, self.state, child.cell, child.position, code, message,
                          time.monotonic() - child.t0, self.say)
            ended.append((child.cell, code))
        return ended

    def _outcome(self, child: _Child) -> tuple[int, str]:
        """The (exit code, message) the child reported; for a malformed report an infrastructure failure saying
        what is wrong; for a child that ended without a word, a stop (when one was forwarded to it) or an
        infrastructure failure naming how it ended."""
        os.close(child.result)
        child.proc.stdin.close()
        how = exit_description(child.proc.returncode)
        try:
            report = parse_report(bytes(child.report))
        except ValueError as err:
            return 1, (f"error: the cell's worker process ended by {how} with a malformed report ({err}); its output "
                       f"is in logs/{child.cell.folder}.log")
        if report is not None:
            return report
        if child.forwarded:
            return 128 + self.stop.signum, (f"stopped by {signal.Signals(self.stop.signum).name} (its worker process "
                                            f"ended by {how} before reporting)")
        return 1, (f"error: the cell's worker process ended by {how} without reporting (a native crash, the OOM "
                   f"killer, a kill?); its output is in logs/{child.cell.folder}.log")

    def _progress(self) -> None:
        for child in self.running:
            step = last_step(child.cell.run_dir)
            if step is not None and step != child.seen:
                child.seen = step
                self.say(self._line(child))

    def _line(self, child: _Child) -> str:
        now = time.monotonic()
        running = [(c.cell, now - c.t0, max(0, c.seen - c.first), c.cell.config.run.steps - c.seen)
                   for c in self.running]
        left, measured = parallel_eta(self.spec, self.state, running, self.waiting, self.workers)
        counts = self.state.counts()
        return (f"arena {child.position} {child.cell.id}: step {child.seen}/{child.cell.config.run.steps} | "
                f"{len(self.running)} running, {counts['done']} done, {counts['diverged']} diverged, "
                f"{counts['failed']} failed | ETA {duration(left)}{'' if measured else ' (est.)'}")

    def _shutdown(self) -> None:
        """On an error in this process: stop the running children as on SIGTERM (unless a stop is under way: a
        further signal still reaches them), wait for each and record it."""
        if self.stop.signum is None:
            self.stop.request(signal.SIGTERM)
        while self.running:
            self._forward()
            self._reap()
            time.sleep(POLL_SECONDS)
