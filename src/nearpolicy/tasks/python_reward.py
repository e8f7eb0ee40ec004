"""Your own reward: a Python function named by ``task.reward_function`` replaces a task's built-in answer check.

The spec is ``"module:function"`` (an importable module: on PYTHONPATH, beside the script that runs the training,
or in the current folder; ``"__main__:function"`` names a function of that script) or ``"path/to/file.py:function"``. The function
is called once per response, with keyword arguments, and is given only the ones it declares (or all of them when it
takes ``**kwargs``)::

    def reward(prompt: str, completion: str, answer: str, entry: dict) -> float   # in [0, 1]

``prompt`` is the problem's text (without the system prompt and chat template), ``completion`` the response text
(decoded without special tokens; never the prompt), ``answer`` the reference answer ("" for a JSONL line without
one), ``entry`` the raw item (the JSONL line's object, or the reasoning-gym entry). It must take ``completion``.

Checked at start-up (ValueError naming task.reward_function): the spec's form, the module's import, the function's
presence and signature, and one call on the first training problem with its reference answer as the completion,
which must return a number in [0, 1]. During training each call runs in the scoring process under
task.reward_timeout_s like the built-in scorers (tasks/scoring.py): a call that raises or returns anything but a
number in [0, 1] makes its sample unscorable (reward NaN, counted in reward/unscorable), a call past the limit
scores 0 (reward/timeouts)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import numbers
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from nearpolicy.tasks.base import Problem, Task

__all__ = ["ARGUMENTS", "PythonRewardTask", "check_reward", "load_reward_function"]

ARGUMENTS = ("prompt", "completion", "answer", "entry")
"""The keyword arguments a reward function may declare."""


def _import(module: str, spec: str):
    """The module of `spec`: a file path ending in .py or an importable name. Raises ValueError naming the key."""
    where = f"task.reward_function {spec!r}"
    if module.endswith(".py"):
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{where}: file {path} does not exist")
        name = f"nearpolicy_reward_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        loaded = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = loaded  # so that pickle and dataclasses inside it find it
        try:
            loader_spec.loader.exec_module(loaded)
        except (Exception, SystemExit) as err:  # a module that calls sys.exit at import, too
            sys.modules.pop(name, None)
            raise ValueError(f"{where}: importing {path} failed: {type(err).__name__}: {err}") from err
        return loaded
    top = module.split(".")[0]
    if top not in sys.modules and str(Path.cwd()) not in sys.path and importlib.util.find_spec(top) is None:
        # `nearpolicy train` run from the folder holding the module (spawned children inherit this sys.path)
        sys.path.append(str(Path.cwd()))
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name):
            raise ValueError(f"{where}: no module named {module!r} on sys.path (put its folder on PYTHONPATH, run "
                             f"from that folder, or give a file path: 'rewards.py:function')") from err
        raise ValueError(f"{where}: importing module {module!r} failed: ModuleNotFoundError: {err}") from err
    except (Exception, SystemExit) as err:  # a module that calls sys.exit at import, too
        raise ValueError(f"{where}: importing module {module!r} failed: {type(err).__name__}: {err}") from err


CHECK_S = 60.0  # the start-up check's call; training calls run under task.reward_timeout_s in the scoring process


@contextlib.contextmanager
def _time_limit(seconds: float):
    """TimeoutError when the block runs past `seconds` (SIGALRM; no limit outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"no answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _declared(function: Callable, spec: str) -> tuple[str, ...] | None:
    """The ARGUMENTS `function` declares (None: it takes **kwargs, so all). Raises ValueError for a signature it
    cannot be called with: no `completion`, or a required parameter that is not one of ARGUMENTS."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError) as err:
        raise ValueError(f"task.reward_function {spec!r}: cannot read its signature ({err})") from err
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    unknown = [p.name for p in parameters if p.default is p.empty and p.kind is not p.VAR_POSITIONAL
               and (p.name not in ARGUMENTS or p.kind is p.POSITIONAL_ONLY)]
    names = tuple(p.name for p in parameters if p.name in ARGUMENTS and p.kind is not p.POSITIONAL_ONLY)
    if unknown or "completion" not in names:
        why = (f"its required parameter(s) {unknown} are not among" if unknown
               else "it takes no `completion` keyword parameter, the one it must take of")
        raise ValueError(f"task.reward_function {spec!r}: {why} the keyword arguments it is called with: "
                         f"{', '.join(ARGUMENTS)} (e.g. def reward(completion, answer, **kwargs) -> float in [0, 1])")
    return names


def load_reward_function(spec: str) -> tuple[Callable, tuple[str, ...] | None]:
    """(the function named by ``spec`` = "module:function" or "file.py:function", the ARGUMENTS it declares or None
    for all). Imports the module (running its top-level code). Raises ValueError naming task.reward_function for a
    malformed spec, a module that cannot be imported, a missing or non-callable attribute, or a signature it cannot
    be called with (see the module docstring)."""
    module, _, name = str(spec).rpartition(":")
    if not module or not name.isidentifier():
        raise ValueError(f"task.reward_function {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    found = getattr(_import(module, spec), name, None)
    if found is None:
        raise ValueError(f"task.reward_function {spec!r}: module {module!r} has no attribute {name!r}")
    if not callable(found):
        raise ValueError(f"task.reward_function {spec!r}: {name!r} is a {type(found).__name__}, not a function")
    return found, _declared(found, spec)


def check_reward(spec: str, value: object) -> float:
    """``value`` as a float when it is a real number in [0, 1] (bool counts as 0 / 1). Raises TypeError for a
    non-number (None, str, a tensor) and ValueError for NaN / inf or a value outside [0, 1], naming ``spec``."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward function {spec!r} returned {type(value).__name__} {value!r:.60}; expected a float "
                        "in [0, 1]")
    reward = float(value)
    if not (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        raise ValueError(f"reward function {spec!r} returned {reward!r}, outside [0, 1]")
    return reward


class PythonRewardTask:
    """The problems of ``task`` (train / eval split, prompts, answers), scored by the function ``spec`` names.

    Built in the trainer's process, where the spec is checked and the function called once on a sample (raises
    ValueError naming task.reward_function, see the module docstring). Pickled into the scoring process without
    the function, which is imported there again by ``warm_up``. Other attributes (train_size, skipped_lines, ...)
    are the wrapped task's."""

    def __init__(self, task: Task, spec: str, check: bool = True) -> None:
        self.task, self.spec, self.name = task, str(spec), task.name
        self._function, self._arguments = load_reward_function(self.spec)
        if check:
            self._check_on_a_sample()

    def _check_on_a_sample(self) -> None:
        problem = self.task.train_problem(0)
        try:
            with _time_limit(CHECK_S):
                self.score(problem.answer, problem)
        except (Exception, SystemExit) as err:
            raise ValueError(f"task.reward_function {self.spec!r} failed on a sample (the first training problem, "
                             f"its reference answer {problem.answer!r:.40} as the completion): "
                             f"{type(err).__name__}: {err}") from err

    def __getstate__(self) -> dict:
        return {"task": self.task, "spec": self.spec, "name": self.name}  # the function is imported again there

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _function=None, _arguments=None)

    def __getattr__(self, name: str):
        if name in ("task", "spec", "name", "_function", "_arguments"):  # while unpickling, before __setstate__
            raise AttributeError(name)
        return getattr(self.task, name)

    def warm_up(self) -> None:
        """Import the reward function (in the scoring process, outside the per-call time limit)."""
        if self._function is None:
            self._function, self._arguments = load_reward_function(self.spec)

    def train_problem(self, index: int) -> Problem:
        """The wrapped task's training problem ``index``."""
        return self.task.train_problem(index)

    def eval_problems(self) -> list[Problem]:
        """The wrapped task's held-out problems."""
        return self.task.eval_problems()

    def score(self, response: str, problem: Problem) -> float:
        """The function's reward for ``response`` (text only) in [0, 1]. Raises what the function raises, TypeError
        for a non-number, ValueError outside [0, 1] (the scorer counts the sample as unscorable)."""
        self.warm_up()
        given = {"prompt": problem.question, "completion": response, "answer": problem.answer,
                 "entry": dict(problem.entry)}
        arguments = given if self._arguments is None else {k: given[k] for k in self._arguments}
        return check_reward(self.spec, self._function(**arguments))
