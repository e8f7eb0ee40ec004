"""Reward calls with a hard time limit that holds in any thread, process or Ray actor (invariant 16).

A task's scorer runs in a dedicated child process (multiprocessing "spawn": no fork of a threaded trainer), fed a
whole batch per call and answering item by item over a pipe. The caller only waits on that pipe (in short polls,
without holding the GIL), so signal handlers, a Ray actor's other methods and watchdogs keep running. When one
item runs past `timeout_s` the child is killed (SIGKILL) and restarted for the rest of the batch; that item scores
0 with status "timeout". math-verify's own alarm-based limit (main thread only) still applies inside the child,
where scoring runs on the main thread.

A scorer that raises, or returns something other than a finite number in [0, 1], makes its sample unscorable:
reward NaN (tasks.base.UNSCORABLE), status "error", left out of its group's statistics by the advantage ops.
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from nearpolicy.signals import exit_description
from nearpolicy.tasks.base import Problem, Task, safe_score

__all__ = ["BoundedScorer", "ScoreResult", "ScoringError"]

STARTUP_S = 120.0  # the child's start (interpreter, imports, unpickling the task, its warm_up) may take this long
POLL_S = 0.05  # the caller wakes this often while waiting (signal handlers run between polls)
Status = Literal["ok", "error", "timeout"]


class ScoringError(RuntimeError):
    """The scoring process could not be started (the task cannot be sent to it, or it did not come up)."""


@dataclass(frozen=True)
class ScoreResult:
    """One reward call: reward in [0, 1], NaN when unscorable ("error"), 0.0 on a "timeout"; `message` says why
    for "error" / "timeout" (None for "ok")."""

    reward: float
    status: Status
    message: str | None = None


def _serve(conn, task: Task) -> None:
    """Child process: score each batch it receives, sending (index, reward, error) per item as it is done."""
    import os

    os.setpgrp()  # a signal to the trainer's process group (Ctrl-C, kill -TERM -PGID) is the trainer's to handle
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    warm_up = getattr(task, "warm_up", None)
    if callable(warm_up):
        warm_up()
    try:
        conn.send(("ready",))
        while True:
            for index, (response, problem) in enumerate(conn.recv()):
                reward, error = safe_score(task, response, problem)
                conn.send((index, reward, error))
    except (EOFError, OSError):  # the parent went away (closed the pipe, exited, or was killed): so does this
        return


class BoundedScorer:
    """Scores (response, problem) pairs with `task` in a child process, each call limited to `timeout_s` seconds.

    The child starts at construction (so a task that cannot be pickled fails here, with ScoringError) and is
    restarted after a timeout or a crash. `close()` stops it; the object is not thread-safe (one caller at a time).
    Raises ValueError unless 0 < timeout_s <= 3600."""

    def __init__(self, task: Task, timeout_s: float, startup_s: float = STARTUP_S):
        if not 0 < timeout_s <= 3600:
            raise ValueError(f"task.reward_timeout_s must be in (0, 3600] seconds, got {timeout_s}")
        self.task, self.timeout_s, self.startup_s = task, float(timeout_s), startup_s
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = self._conn = None
        self._ready = False
        self._start()

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, self.task), daemon=True, name="nearpolicy-scorer")
        try:
            proc.start()
        except Exception as err:  # noqa: BLE001 - pickling errors come in many types
            parent.close()
            raise ScoringError(f"task {getattr(self.task, 'name', self.task)!r} cannot be sent to the scoring "
                               f"process ({type(err).__name__}: {err})") from err
        finally:
            child.close()
        self._proc, self._conn, self._ready = proc, parent, False

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while not self._ready:
            try:
                message = self._receive(deadline)
            except (EOFError, OSError):
                code = self._exit_code()
                self._kill()
                raise ScoringError(f"the scoring process exited while starting ({code}); its error is above") from None
            if message is None:
                self._kill()
                raise ScoringError(f"the scoring process did not start within {self.startup_s:.0f} s")
            if message == ("ready",):
                self._ready = True

    def _receive(self, deadline: float):
        """The child's next message; None at the deadline; raises EOFError when the child died."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._conn.poll(min(left, POLL_S)):
                return self._conn.recv()

    def _exit_code(self) -> str:
        """How the child ended, e.g. 'exit code 3' or 'SIGKILL' (waits up to 5 s for a closing child)."""
        if self._proc is None:
            return "exit code unknown"
        self._proc.join(5)
        return exit_description(self._proc.exitcode)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        """Stop the child process; safe to call twice."""
        self._kill()

    def score(self, items: Sequence[tuple[str, Problem]]) -> list[ScoreResult]:
        """One ScoreResult per (response text, problem), in order. Each call gets `timeout_s` seconds, counted
        from the end of the previous one (the child's start is not counted). Raises ScoringError when the child
        cannot be (re)started."""
        results: list[ScoreResult] = []
        while len(results) < len(items):
            results += self._score_some(items[len(results):])
        return results

    def _score_some(self, items: Sequence[tuple[str, Problem]]) -> list[ScoreResult]:
        """Results for a prefix of `items`: all of them, or up to and including the first timeout / crash."""
        if self._proc is not None and not self._proc.is_alive():  # died between calls (OOM kill, a stray signal)
            self._kill()
        if self._proc is None:
            self._start()
        try:
            self._wait_ready()
            self._conn.send(list(items))
            out: list[ScoreResult] = []
            while len(out) < len(items):
                try:
                    message = self._receive(time.monotonic() + self.timeout_s)
                except (EOFError, OSError):
                    code = self._exit_code()
                    self._kill()
                    return out + [ScoreResult(math.nan, "error", f"the scoring process died ({code})")]
                if message is None:
                    self._kill()
                    return out + [ScoreResult(0.0, "timeout", f"reward call exceeded task.reward_timeout_s = "
                                                              f"{self.timeout_s:g} s")]
                _, reward, error = message
                out.append(ScoreResult(reward, "ok") if error is None else ScoreResult(reward, "error", error))
            return out
        except BaseException:  # a second Ctrl-C, a startup failure: never leave a child mid-batch
            self._kill()
            raise
