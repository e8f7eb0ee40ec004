"""A task backed by a reasoning-gym procedural dataset, scored by the dataset's own checker."""

from __future__ import annotations

from typing import Any

from nearpolicy.registry import did_you_mean
from nearpolicy.tasks.answers import extract_final_answer
from nearpolicy.tasks.base import Problem, wrap_index

__all__ = ["ReasoningGymTask"]


def _create(name: str, options: dict, seed: int, size: int) -> Any:
    """``reasoning_gym.create_dataset``, errors turned into ValueErrors naming the config key."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(
            f"task.name: unknown reasoning-gym dataset {name!r}{did_you_mean(name, DATASETS)}; "
            f"known: {', '.join(sorted(DATASETS))}"
        )
    reserved = sorted({"seed", "size"} & set(options))
    if reserved:
        raise ValueError(
            f"task.options may not set {reserved}; use task.seed / task.eval_seed and "
            "task.train_size / task.eval_size"
        )
    if name == "composite":
        options = {**options, "datasets": _composite_specs(options.get("datasets"))}
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **options)
    except (TypeError, AssertionError, ValueError) as exc:
        raise ValueError(f"task.options {options!r} rejected by dataset {name!r}: {exc}") from exc


def _composite_specs(datasets: Any) -> list:
    """A fixed task mixture: task.name = "composite" with task.options.datasets = [{name, weight, config}, ...] (plain
    TOML tables; config optional, the sub-dataset's keyword options) as reasoning-gym's DatasetSpec list. Each problem
    i is drawn from sub-dataset k with probability weight_k / sum(weight) by reasoning-gym's CompositeDataset (seeded
    per index); its entry's metadata.source_dataset names k, and the composite scores it with k's checker. Raises
    ValueError naming task.options for anything else."""
    from reasoning_gym.composite import DatasetSpec

    if not isinstance(datasets, list) or not datasets:
        raise ValueError("task.options.datasets of the composite dataset must be a non-empty list of "
                         "{name, weight, config} tables")
    specs = []
    for spec in datasets:
        if not (isinstance(spec, dict) and set(spec) <= {"name", "weight", "config"}
                and isinstance(spec.get("name"), str) and isinstance(spec.get("weight"), (int, float))
                and spec["weight"] > 0 and isinstance(spec.get("config", {}), dict)):
            raise ValueError(f"task.options.datasets: {spec!r} is not a {{name, weight > 0, config}} table")
        specs.append(DatasetSpec(spec["name"], float(spec["weight"]), dict(spec.get("config", {}))))
    return specs


def _problem(entry: dict) -> Problem:
    return Problem(question=str(entry["question"]), answer=str(entry["answer"]), entry=dict(entry))


class ReasoningGymTask:
    """Train and eval problems from ``reasoning_gym.create_dataset(name, **options)``.

    The eval set is items ``0..eval_size-1`` of the dataset seeded with ``eval_seed``; the train set
    is items ``0..train_size-1`` of the dataset seeded with ``seed``, minus any whose question also
    appears in the eval set. Both are generated eagerly at construction.

    Raises:
        ValueError: unknown dataset (names ``task.name``); bad options (names ``task.options``);
            sizes out of range; no training problem left after removing eval duplicates.
    """

    def __init__(
        self,
        name: str,
        options: dict,
        train_size: int,
        eval_size: int,
        seed: int,
        eval_seed: int,
    ) -> None:
        if train_size < 1:
            raise ValueError(f"task.train_size must be >= 1, got {train_size}")
        if eval_size < 0:
            raise ValueError(f"task.eval_size must be >= 0, got {eval_size}")
        self.name = name
        self.options = dict(options)
        self._dataset = _create(name, self.options, seed, train_size)
        self._eval: list[Problem] = []
        if eval_size > 0:
            eval_dataset = _create(name, self.options, eval_seed, eval_size)
            self._eval = [_problem(eval_dataset[i]) for i in range(eval_size)]
        eval_questions = {p.question for p in self._eval}
        generated = [_problem(self._dataset[i]) for i in range(train_size)]
        self._train = [p for p in generated if p.question not in eval_questions]
        self.dropped_overlap = len(generated) - len(self._train)
        if not self._train:
            raise ValueError(
                f"reasoning-gym dataset {name!r} has too few distinct problems for a held-out "
                f"split: all {train_size} training items also appear in the eval set"
            )

    @property
    def train_size(self) -> int:
        """Number of training problems kept after removing eval duplicates."""
        return len(self._train)

    def train_problem(self, index: int) -> Problem:
        """Training problem ``index`` (modulo the train size). Raises ValueError if index < 0."""
        return self._train[wrap_index(index, len(self._train))]

    def eval_problems(self) -> list[Problem]:
        """The eval problems in dataset order (a new list each call)."""
        return list(self._eval)

    def score(self, response: str, problem: Problem) -> float:
        """1.0 when the dataset's ``score_answer`` on the answer extracted from ``response`` is full
        credit, else 0.0.

        Only ``response`` is read. No extractable answer gives 0.0. reasoning-gym's default checkers give
        partial credit ``len(oracle) / len(answer)`` when the oracle is a substring of a wrong answer
        (oracle "5", answer "-5" -> 0.5); a wrong answer must score 0 (invariant 12), so the score is
        binarised.
        """
        extracted = extract_final_answer(response)
        if extracted is None:
            return 0.0
        reward = float(self._dataset.score_answer(answer=extracted, entry=problem.entry))
        return 1.0 if reward >= 1.0 else 0.0
