"""Tasks: where problems come from and how responses are scored (see base.Task)."""

from nearpolicy.tasks.base import Problem, Task, safe_score
from nearpolicy.tasks.factory import make_task

__all__ = ["Problem", "Task", "make_task", "safe_score"]
