"""`nearpolicy arena --workers N`: up to N cells at a time, each run by a child process of its own; this process (the
parent) stays the only writer of OUT/arena-state.json (runner.start_record / finish_record, as for a cell run in
process) and the only speaker on stderr.

Why a subprocess (`python -m nearpolicy.arena.workers`, Popen with start_new_session) and not multiprocessing's
"spawn": a terminal's Ctrl-C goes to its whole foreground process group, and a second SIGINT aborts a run's step in
progress (signals.GracefulStop). A child in a session of its own gets no signal from the terminal, only the ones the
parent forwards, each exactly once; Popen puts it there before it runs any code, which a spawned
multiprocessing.Process cannot be. The child is the ordinary run (runner's `train`, api.run_training by default) in a
fresh interpreter, so a native crash (SIGSEGV in an engine, the OOM killer) ends only its cell. `train` goes to the
child by name (module:qualname, with this process's sys.path), so it must be a module-level function.

The protocol: the parent writes one JSON line on the child's stdin (the cell's config, resume or not, the cell's log
file, the train function's name, sys.path, the result pipe's fd) and keeps stdin open; the child runs the cell, writes
one JSON line {"code", "message"} (the run's exit code and closing message) on the result pipe and exits. The child's
stdout and stderr go to OUT/logs/CELL.log after the run's own log lines (faulthandler's trace of a native crash too).
The wall time recorded is the parent's, from the child's start to its end.

Failure semantics:
- a child that reports is recorded as a cell run in process is (runner.classify: done, diverged, failed, stopped);
- a child that ends without reporting (killed by a signal, os._exit, a broken interpreter) is failed
  ("infrastructure"), its cause (SIGKILL, exit code 3) in the error, and the arena goes on; after a stop was forwarded
  to it, it is stopped (resumable) instead;
- SIGINT / SIGTERM to the parent: each is forwarded to every running child once (the first: the runs stop after the
  step in progress and checkpoint it; a second: they abort the step, keeping the last checkpoint), no cell starts
  any more, the parent waits for the running ones, records each, and the arena exits 130 / 143. Rerunning the same
  command continues every stopped cell from its checkpoint. A child stopped by a signal the parent did not send (a
  `kill` of the child) stops the arena the same way, as a stopped cell does in process;
- the parent killed outright (SIGKILL): the state keeps the cells in flight as "running" (resumed on the next start);
  their children see their stdin close and stop as on SIGTERM (after the step in progress, checkpointed). Let them
  end before rerunning the arena, or a cell's folder has two writers;
- an exception in the parent: its children get SIGTERM, are waited for and recorded, then it propagates."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib import import_module

from nearpolicy.arena.runner import estimated_seconds, finish_record, start_record
from nearpolicy.arena.spec import ArenaSpec, Cell
from nearpolicy.arena.state import FINAL, ArenaState
from nearpolicy.arena.table import duration
from nearpolicy.runs.folder import last_step
from nearpolicy.signals import STOP_SIGNALS, exit_description

ENTRY = "nearpolicy.arena.workers"
POLL_SECONDS = 0.25  # how often the parent looks at its children (exits, new steps, signals to forward)


def train_name(train) -> str:
    """'module:qualname' of `train`, by which a child imports it. Raises ValueError when that name does not lead
    back to `train` (a lambda, a local function, an instance, a function of the __main__ script)."""
    module, qualname = getattr(train, "__module__", None), getattr(train, "__qualname__", "")
    found = None
    if module and module != "__main__" and "<" not in qualname:
        try:
            found = _resolve(f"{module}:{qualname}")
        except (ImportError, AttributeError):
            found = None
    if found is not train:
        raise ValueError(f"--workers > 1 runs each cell in a child process, which imports `train` by name: {train!r} "
                         "is no module-level function of an importable module")
    return f"{module}:{qualname}"


def _resolve(name: str):
    module, qualname = name.split(":")
    target = import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def check_workers(workers: int, train, cells: list[Cell]) -> list[str]:
    """Warnings for running `cells` `workers` at a time (workers x run.threads above the CPU count). Raises
    ValueError for workers < 1 or, above 1, a `train` a child cannot import (train_name)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1 (got {workers})")
    if workers == 1:
        return []
    train_name(train)
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
    """The parent's SIGINT / SIGTERM handlers while children run (main thread only): a signal is only counted here;
    the loop forwards it (Workers._forward), so each child gets each signal once, whenever it started."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._previous: dict[int, object] = {}

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
        self.signum = self.signum or signum
        self.count += 1


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


class Workers:
    """Runs cells up to `workers` at a time in child processes (module docstring), recording each in `state`."""

    def __init__(self, spec: ArenaSpec, state: ArenaState, say, train, workers: int):
        self.spec, self.state, self.say, self.workers = spec, state, say, workers
        self.train = train_name(train)
        self.running: list[_Child] = []
        self.waiting: list[Cell] = []
        self.stop = _Stop()
        self.announced = 0

    def run(self, order: list[Cell], first: int, last: int) -> int:
        """Run order[first:last] that are not final yet, up to `workers` at a time in the order given; returns as
        runner._run_cells: 0, 1 when one failed, 128 + the signal when a signal stopped the arena."""
        queue = []
        for i in range(first, last):
            cell, position = order[i], f"{i + 1}/{len(order)}"
            if self.state.cells[cell.id].status in FINAL:
                self.say(f"arena {position} {cell.id}: {self.state.cells[cell.id].status} earlier, not run again")
            else:
                queue.append((cell, position))
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
        os.set_blocking(read, False)  # read once the child has ended; a grandchild holding the write end cannot block
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
        """Send each running child the stop signals it has not had yet; say the first time each one arrives."""
        if self.stop.count > self.announced:
            self.announced = self.stop.count
            what = ("stopping them after their steps in progress (checkpointed); send it again to abort now"
                    if self.stop.count == 1 else "aborting their steps in progress")
            self.say(f"{signal.Signals(self.stop.signum).name}: forwarded to the {len(self.running)} running "
                     f"cell(s), {what}; no cell starts any more")
        for child in self.running:
            while child.forwarded < self.stop.count:
                child.forwarded += 1
                try:
                    os.kill(child.proc.pid, self.stop.signum)
                except ProcessLookupError:
                    pass

    def _reap(self) -> list[tuple[Cell, int]]:
        """Record the children that have ended; returns (cell, the run's exit code) of each."""
        ended = []
        for child in [c for c in self.running if c.proc.poll() is not None]:
            self.running.remove(child)
            code, message = self._outcome(child)
            finish_record(self.spec, self.state, child.cell, child.position, code, message,
                          time.monotonic() - child.t0, self.say)
            ended.append((child.cell, code))
        return ended

    def _outcome(self, child: _Child) -> tuple[int, str]:
        """The (exit code, message) the child reported; else, for a child that ended without a word, a stop (when
        one was forwarded to it) or an infrastructure failure naming how it ended."""
        chunks = []
        try:
            while chunk := os.read(child.result, 65536):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        os.close(child.result)
        child.proc.stdin.close()
        try:
            report = json.loads(b"".join(chunks))
            return int(report["code"]), str(report["message"])
        except (ValueError, KeyError, TypeError):
            pass
        how = exit_description(child.proc.returncode)
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


def _stop_when_orphaned() -> None:
    """The child's watch on its stdin: at its end (the parent died) the run stops as on SIGTERM. Reads the file
    descriptor itself: a daemon thread blocked in sys.stdin's buffered reader would hold its lock at exit."""
    while os.read(0, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def child_main() -> int:
    """A worker: read the job on stdin, run the cell, report (code, message) on the result pipe (module
    docstring)."""
    from nearpolicy.config.schema import Config

    line = sys.stdin.buffer.readline()
    if not line:
        return 1  # the parent died before sending the job
    job = json.loads(line)
    os.set_inheritable(job["result_fd"], False)  # the run's own processes never hold it
    sys.path[:] = job["sys_path"]
    faulthandler.enable()
    threading.Thread(target=_stop_when_orphaned, daemon=True).start()
    with open(job["log"], "a", encoding="utf-8") as log_file:
        write = lambda msg: (log_file.write(msg + "\n"), log_file.flush())  # noqa: E731
        try:
            code, message = _resolve(job["train"])(Config.model_validate(job["config"]), job["resume"], write, False)
        except Exception as err:  # noqa: BLE001 - the cell's infrastructure failure, as in process
            code, message = 1, f"error: {type(err).__name__}: {err}"
        except KeyboardInterrupt as err:  # SIGINT before the run's own handlers, or its second SIGINT
            code, message = 130, f"interrupted ({err or 'SIGINT'})"
        write(message)
    try:
        with os.fdopen(job["result_fd"], "w", encoding="utf-8") as result:
            result.write(json.dumps({"code": code, "message": message[-8000:]}) + "\n")
    except OSError:
        pass  # the parent is gone; the state says "running" and the next start resumes the cell
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
