"""Bounded reward calls (invariant 16) and unscorable samples (invariant 6): tasks/scoring.py, tasks/base.py.

The tasks here are module-level classes, so the scoring process (spawned) can unpickle them by reference."""

from __future__ import annotations

import math
import signal
import threading
import time

import pytest

from nearpolicy.tasks.base import Problem
from nearpolicy.tasks.scoring import BoundedScorer, ScoringError

PROBLEM = Problem("q", "1", {})
LIMIT_S = 1.0
MARGIN_S = 1.0  # kill + join of the child; the restart is lazy (charged to the next batch, not to this one)


class ScriptedTask:
    """Scores "hang" by sleeping 60 s, "raise" by raising, "nan" as NaN, "2" as 2.0 (out of range), else 1.0."""

    name = "scripted"

    def train_problem(self, index: int) -> Problem:
        return PROBLEM

    def eval_problems(self) -> list[Problem]:
        return []

    def score(self, response: str, problem: Problem) -> float:
        if response == "hang":
            time.sleep(60)
        if response == "raise":
            raise RuntimeError("checker broke")
        return {"nan": math.nan, "2": 2.0}.get(response, 1.0)


@pytest.fixture
def scorer():
    s = BoundedScorer(ScriptedTask(), LIMIT_S)
    assert [r.reward for r in s.score([("ok", PROBLEM)])] == [1.0]  # started and warm: the timing below is scoring
    yield s
    s.close()


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_a_hung_reward_call_scores_0_within_the_limit_and_is_counted(scorer, where):
    """A 60 s call against a 1 s limit returns 0 after 1-2 s, statuses say timeout; the next call is served by a
    restarted child. math-verify's own limit works on the main thread only; this one works in any thread."""
    out = {}

    def run():
        t0 = time.monotonic()
        out["results"] = scorer.score([("ok", PROBLEM), ("hang", PROBLEM)])
        out["seconds"] = time.monotonic() - t0

    if where == "main thread":
        run()
    else:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(30)
        assert not thread.is_alive()
    first, hung = out["results"]
    assert (first.reward, first.status) == (1.0, "ok")
    assert (hung.reward, hung.status) == (0.0, "timeout") and "task.reward_timeout_s = 1 s" in hung.message
    assert LIMIT_S <= out["seconds"] < LIMIT_S + MARGIN_S
    assert [(r.reward, r.status) for r in scorer.score([("ok", PROBLEM)] * 3)] == [(1.0, "ok")] * 3


def test_a_stop_signal_is_handled_at_once_while_a_reward_call_hangs(scorer):
    """SIGINT 0.2 s into a hung call: its handler runs within 0.5 s of it (the wait holds neither the GIL nor the
    main thread), while the call itself still ends at its limit."""
    handled = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: handled.append(time.monotonic()))
    try:
        timer = threading.Timer(0.2, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT))
        t0 = time.monotonic()
        timer.start()
        (result,) = scorer.score([("hang", PROBLEM)])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.status == "timeout"
    assert len(handled) == 1 and handled[0] - t0 < 0.2 + 0.5


def test_unscorable_rewards_are_nan_with_the_reason_and_a_batch_is_fast(scorer):
    results = scorer.score([("raise", PROBLEM), ("nan", PROBLEM), ("2", PROBLEM), ("ok", PROBLEM)])
    assert [r.status for r in results] == ["error", "error", "error", "ok"]
    assert all(math.isnan(r.reward) for r in results[:3]) and results[3].reward == 1.0
    assert results[0].message == "RuntimeError: checker broke" and "outside [0, 1]" in results[2].message
    t0 = time.monotonic()
    assert [r.reward for r in scorer.score([("ok", PROBLEM)] * 256)] == [1.0] * 256
    assert time.monotonic() - t0 < 1.0  # one batch per step: per-call overhead well under 4 ms


def test_a_task_that_cannot_reach_the_scoring_process_is_named():
    task = ScriptedTask()
    task.score = lambda response, problem: 1.0  # a local function cannot be pickled
    with pytest.raises(ScoringError, match="task 'scripted' cannot be sent to the scoring process"):
        BoundedScorer(task, LIMIT_S)
    with pytest.raises(ValueError, match=r"task\.reward_timeout_s"):
        BoundedScorer(ScriptedTask(), 0)


def test_a_scoring_process_killed_between_calls_is_restarted(scorer):
    """An OOM kill or a stray signal between two steps: the next call restarts the process instead of failing."""
    import os

    assert [r.reward for r in scorer.score([("ok", PROBLEM)])] == [1.0]
    os.kill(scorer._proc.pid, signal.SIGKILL)
    scorer._proc.join(5)
    assert [(r.reward, r.status) for r in scorer.score([("ok", PROBLEM), ("ok", PROBLEM)])] == [(1.0, "ok")] * 2


def test_the_scoring_process_is_outside_the_trainers_process_group(scorer):
    """A signal to the trainer's process group (Ctrl-C, scancel, kill -TERM -PGID) is the trainer's to handle."""
    import os

    scorer.score([("ok", PROBLEM)])
    assert os.getpgid(scorer._proc.pid) == scorer._proc.pid != os.getpgid(0)
