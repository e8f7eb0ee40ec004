"""The task interface: where problems come from and how a response to one is scored."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["UNSCORABLE", "Problem", "Task", "safe_score"]


@dataclass(frozen=True)
class Problem:
    """One problem: the prompt text, its reference answer, and the raw dataset item."""

    question: str
    """The prompt shown to the policy."""
    answer: str
    """The reference answer, as a string."""
    entry: dict
    """The raw dataset item, handed back to the task's scorer."""


@runtime_checkable
class Task(Protocol):
    """A source of train / eval problems and a scorer for responses to them."""

    name: str

    def train_problem(self, index: int) -> Problem:
        """The training problem at ``index`` (deterministic; wraps modulo the train size).

        Raises ValueError for a negative index."""
        ...

    def eval_problems(self) -> list[Problem]:
        """The held-out eval problems, disjoint from the training problems, in a fixed order."""
        ...

    def score(self, response: str, problem: Problem) -> float:
        """Reward in [0, 1] for ``response`` (the response text only, never the prompt). It runs in a scoring
        process (tasks/scoring.py): the task must be picklable; an optional ``warm_up()`` method is called there
        once before the first reward call (imports, caches), outside the per-call time limit."""
        ...


UNSCORABLE = math.nan
"""The reward of a sample its scorer could not score: left out of its group's statistics (advantage 0)."""


def safe_score(task: Task, response: str, problem: Problem) -> tuple[float, str | None]:
    """Score without crashing the run, in the calling thread, without a time limit (the trainer scores through
    tasks.scoring.BoundedScorer, which adds one).

    Returns ``(reward, None)`` on success, or ``(nan, "ExceptionType: message")`` if the scorer raised or
    returned something that is not a finite number in [0, 1]: an unscorable sample is not a wrong answer, and
    the advantage estimators leave NaN rewards out of the group statistics (ops/advantages.py).
    """
    try:
        reward = float(task.score(response, problem))
    except Exception as exc:  # a broken scorer must cost one sample, not the run
        return UNSCORABLE, f"{type(exc).__name__}: {exc}"
    if not (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        return UNSCORABLE, f"ValueError: task {task.name!r} returned reward {reward!r} outside [0, 1]"
    return reward, None


def wrap_index(index: int, size: int) -> int:
    """``index`` modulo ``size``. Raises ValueError for a negative index or an empty split."""
    if index < 0:
        raise ValueError(f"problem index must be >= 0, got {index}")
    if size <= 0:
        raise ValueError("the training split is empty")
    return index % size
