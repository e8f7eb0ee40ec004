"""Build a task from its config fields."""

from __future__ import annotations

from pathlib import Path

from nearpolicy.tasks.base import Task

__all__ = ["TASK_KINDS", "describe_task", "make_task"]

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
    reward_function: str | None = None,
) -> Task:
    """The task of ``kind`` ("reasoning_gym" needs ``name``; "jsonl" needs ``path``), scored by the function
    ``reward_function`` names ("module:function", tasks/python_reward.py) instead of its built-in check when given
    (a JSONL line may then leave out "answer").

    Raises ValueError for an unknown kind or a missing required field, plus whatever the task's
    constructor raises (see ReasoningGymTask / JsonlTask / PythonRewardTask).
    """
    task = _data_task(kind, name, options, path, train_size, eval_size, seed, eval_seed, skip_bad_lines,
                      answer_required=reward_function is None)
    if reward_function is None:
        return task
    from nearpolicy.tasks.python_reward import PythonRewardTask

    return PythonRewardTask(task, reward_function)


def _data_task(kind, name, options, path, train_size, eval_size, seed, eval_seed, skip_bad_lines,
               answer_required) -> Task:
    if kind == "reasoning_gym":
        if not name:
            raise ValueError("task.name is required for kind 'reasoning_gym'")
        from nearpolicy.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(name, options or {}, train_size, eval_size, seed, eval_seed)
    if kind == "jsonl":
        if path is None:
            raise ValueError("task.path is required for kind 'jsonl'")
        if options:
            raise ValueError("task.options applies only to kind 'reasoning_gym'; remove it from the layer that sets "
                             "task.kind = 'jsonl' (a --set task.kind drops the config file's task.options itself)")
        from nearpolicy.tasks.jsonl import JsonlTask

        return JsonlTask(path, eval_size, seed, eval_seed, skip_bad_lines, answer_required)
    raise ValueError(f"unknown task kind {kind!r}; valid kinds: {', '.join(TASK_KINDS)}")


def describe_task(task: Task) -> str:
    """One line for the start-up log: the data, its train / eval split, the lines skipped or problems dropped, and
    the reward, e.g. "task jsonl:data.jsonl: 90 train / 10 eval problems, skipped 2 bad line(s) 3, 7; reward:
    task.reward_function rewards.py:reward"."""
    name = getattr(task, "name", type(task).__name__)
    train = getattr(task, "train_size", None)
    parts = [f"task {name}: {'?' if train is None else train} train / {len(task.eval_problems())} eval problems"]
    skipped = getattr(task, "skipped_lines", None)
    if skipped:
        shown = ", ".join(map(str, skipped[:20])) + (", ..." if len(skipped) > 20 else "")
        parts.append(f"skipped {len(skipped)} bad line(s) {shown}")
    if getattr(task, "dropped_overlap", 0):
        parts.append(f"{task.dropped_overlap} training problem(s) dropped as duplicates of eval problems")
    spec = getattr(task, "spec", None)
    reward = f"task.reward_function {spec}" if spec else "the dataset's answer check"
    return ", ".join(parts) + f"; reward: {reward}"
