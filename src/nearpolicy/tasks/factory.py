"""Build a task from its config fields."""

from __future__ import annotations

from pathlib import Path

from nearpolicy.tasks.base import Task

__all__ = ["TASK_KINDS", "make_task"]

TASK_KINDS = ("reasoning_gym", "jsonl")


def make_task(
    kind: str,
    *,
    name: str | None = None,
    options: dict | None = None,
    path: str | Path | None = None,
    train_size: int = 1000,
    eval_size: int = 100,
    seed: int = 0,
    eval_seed: int = 1,
    skip_bad_lines: bool = False,
) -> Task:
    """The task of ``kind`` ("reasoning_gym" needs ``name``; "jsonl" needs ``path``).

    Raises ValueError for an unknown kind or a missing required field, plus whatever the task's
    constructor raises (see ReasoningGymTask / JsonlTask).
    """
    if kind == "reasoning_gym":
        if not name:
            raise ValueError("task.name is required for kind 'reasoning_gym'")
        from nearpolicy.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(name, options or {}, train_size, eval_size, seed, eval_seed)
    if kind == "jsonl":
        if path is None:
            raise ValueError("task.path is required for kind 'jsonl'")
        if options:
            raise ValueError("task.options applies only to kind 'reasoning_gym'")
        from nearpolicy.tasks.jsonl import JsonlTask

        return JsonlTask(path, eval_size, seed, eval_seed, skip_bad_lines)
    raise ValueError(f"unknown task kind {kind!r}; valid kinds: {', '.join(TASK_KINDS)}")
