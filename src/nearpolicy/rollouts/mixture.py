"""The adaptive task mixture (task.mixture = "adaptive"; ops/mixture.py's registry entry, docs/math.md sec. 27).

The rule: after each step the accuracy EMA p_k of each dataset seen in the step is updated from its rewards
(ops/data_policies.mixture_accuracy_ema), and the next step's prompts are drawn dataset by dataset with shares
pi_k = eps wbar_k + (1 - eps) q_k, q_k proportional to wbar_k p_k (1 - p_k) (ops/data_policies.adaptive_mixture_probs):
the "learnability" p (1 - p) of Rutherford et al. 2024 ("No Regrets", arXiv:2408.15099) and Foster et al. 2025
("Learning to Reason at the Frontier of Learnability", arXiv:2502.12272), there per problem, here per dataset; the EMA
and the floor eps wbar_k are ours. `AdaptiveMixture` holds that state and draws.

`AdaptiveMixtureRollouts` wraps the synchronous single-turn source (`inner`, rollouts/inline.InlineRollouts), whose
task it replaces by a `MixtureDraws` view. Each `collect` first draws the step's prompts_per_step problems with the
mixture's current shares and plans them at the step's data positions, so the inner source samples exactly those
(group id = data position, as always). The rewards reach the mixture without a change to the trainer: the trainer
scores the collected Rollout objects in place, and `step_metrics` (called after scoring and the update, before the
weights are published) reads those rewards, updates each dataset's accuracy EMA and logs mixture/share/<dataset>
(the shares this step's prompts were drawn with), mixture/accuracy/<dataset> (the EMA after this step) and
mixture/prompts/<dataset> (this step's prompt count). The mixture's state rides in `state_dict` (the checkpoint's
restart state), so a resumed run draws what the uninterrupted one drew."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nearpolicy.ops.data_policies import MIXTURE_PRIOR, mixture_accuracy_ema
from nearpolicy.ops.mixture import MIXTURES
from nearpolicy.rollouts.base import RolloutSource, SourceWrapper, StepSamples
from nearpolicy.tasks import Problem, Task

__all__ = ["AdaptiveMixture", "AdaptiveMixtureRollouts", "MixtureDraws", "adaptive_mixture", "mixture_datasets"]

MIXTURE_STREAM = 0x6D6978  # "mix": the draws' seed stream, apart from the engine's SeedSequence([seed, step])


def mixture_datasets(options: dict) -> tuple[list[str], list[float]]:
    """(names, weights) of a composite task's task.options.datasets, in their order. Raises ValueError naming
    task.options when the list is missing or malformed (tasks/reasoning_gym.py checks the rest)."""
    datasets = options.get("datasets") if isinstance(options, dict) else None
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) and "name" in d for d in datasets):
        raise ValueError("task.mixture = 'adaptive' needs task.options.datasets = [{name, weight, config}, ...]")
    return [str(d["name"]) for d in datasets], [float(d.get("weight", 1.0)) for d in datasets]


def dataset_pools(task: Task, options: dict) -> list[list[Problem]]:
    """Each dataset's training problems of `task` (a composite with task.options `options`), in the datasets' order,
    each in training-set order (by metadata.source_dataset). Raises ValueError naming the datasets without one."""
    return _pools(task, mixture_datasets(options)[0])


def _pools(task: Task, names: list[str]) -> list[list[Problem]]:
    pools: dict[str, list[Problem]] = {name: [] for name in names}
    for index in range(task.train_size):
        problem = task.train_problem(index)
        pools[problem.entry["metadata"]["source_dataset"]].append(problem)
    if empty := [name for name, pool in pools.items() if not pool]:
        raise ValueError(f"task.mixture = 'adaptive': dataset(s) {', '.join(empty)} have no problem among the "
                         f"{task.train_size} training problems: raise task.train_size or their weight, or lower "
                         "task.eval_size or widen their config (training problems equal to a held-out one are dropped)")
    return [pools[name] for name in names]


@dataclass
class AdaptiveMixture:
    """The adaptive mixture's state and draws over a composite `task` (see the module docstring).

    names / weights: the datasets of task.options.datasets (K); decay: beta of the accuracy EMA, [0, 1); floor: eps,
    (0, 1]; seed: run.seed. State: accuracy [K] float64 (MIXTURE_PRIOR before a dataset's first rewards) and one
    cursor per dataset (its next problem, cycling over its pool). Raises ValueError for a dataset without problems,
    decay / floor out of range, or weights <= 0."""

    task: Task
    names: list[str]
    weights: list[float]
    decay: float
    floor: float
    seed: int

    def __post_init__(self) -> None:
        if not 0 <= self.decay < 1:
            raise ValueError(f"task.mixture_decay must be in [0, 1), got {self.decay}")
        if not 0 < self.floor <= 1:
            raise ValueError(f"task.mixture_floor must be in (0, 1], got {self.floor}")
        self.pools = _pools(self.task, self.names)
        self.index = {name: k for k, name in enumerate(self.names)}
        self.load_state_dict(None)
        self.shares()  # weights <= 0 fail here, at construction

    def shares(self) -> torch.Tensor:
        """pi [K] float64: the share of each dataset in the next step's prompts."""
        return MIXTURES.get("adaptive")(self.accuracy, torch.tensor(self.weights, dtype=torch.float64), self.floor)

    def draw(self, step: int, count: int) -> list[Problem]:
        """The `count` problems of training step `step` + 1: each slot's dataset k drawn i.i.d. with probability pi_k
        (numpy Generator seeded by SeedSequence([seed, MIXTURE_STREAM, step]): a resumed run draws alike), then k's
        next problem (its cursor advances)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, MIXTURE_STREAM, step]))
        picks = rng.choice(len(self.names), size=count, p=self.shares().numpy())
        problems = []
        for k in picks.tolist():
            problems.append(self.pools[k][self.cursors[k] % len(self.pools[k])])
            self.cursors[k] += 1
        return problems

    def observe(self, rewards: torch.Tensor, problems: list[Problem]) -> None:
        """One step's feedback: rewards [N] (NaN = unscorable, left out) of samples of `problems` [N] (each sample's
        problem) -> accuracy EMA of each dataset with a scorable sample (mixture_accuracy_ema, beta = decay)."""
        ids = torch.tensor([self.index[p.entry["metadata"]["source_dataset"]] for p in problems], dtype=torch.int64)
        self.accuracy = mixture_accuracy_ema(self.accuracy, rewards.double(), ids, self.decay)

    def state_dict(self) -> dict:
        """Plain JSON values (floats round-trip exactly): accuracy and cursors by dataset name."""
        return {"accuracy": dict(zip(self.names, self.accuracy.tolist())), "cursors": dict(zip(self.names, self.cursors))}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore `state_dict`'s values; None: the prior (accuracy MIXTURE_PRIOR, cursors 0). Raises ValueError when
        the saved datasets differ from this run's."""
        if state is None:
            self.accuracy = torch.full((len(self.names),), MIXTURE_PRIOR, dtype=torch.float64)
            self.cursors = [0] * len(self.names)
            return
        if list(state["accuracy"]) != self.names:
            raise ValueError(f"the checkpoint's mixture has datasets {list(state['accuracy'])}, this run {self.names}")
        self.accuracy = torch.tensor([float(state["accuracy"][n]) for n in self.names], dtype=torch.float64)
        self.cursors = [int(state["cursors"][n]) for n in self.names]


class MixtureDraws:
    """A Task view of `task` whose training problems are the mixture's draws: `plan` puts a step's problems at their
    data positions, `train_problem(position)` hands them out (the rollout source's group ids stay its positions);
    eval problems and scoring are `task`'s."""

    def __init__(self, task: Task):
        self.task, self.name, self.planned = task, task.name, {}

    @property
    def train_size(self) -> int:
        return self.task.train_size

    def plan(self, first_position: int, problems: list[Problem]) -> None:
        """Problems of positions first_position, first_position + 1, ... (those planned before are forgotten)."""
        self.planned = {first_position + i: p for i, p in enumerate(problems)}

    def train_problem(self, index: int) -> Problem:
        """The problem planned at data position `index`. Raises KeyError for a position not planned this step."""
        if index not in self.planned:
            raise KeyError(f"data position {index} was not drawn by the adaptive mixture this step "
                           f"(planned: {sorted(self.planned)})")
        return self.planned[index]

    def eval_problems(self) -> list[Problem]:
        return self.task.eval_problems()

    def score(self, response: str, problem: Problem) -> float:
        return self.task.score(response, problem)


class AdaptiveMixtureRollouts(SourceWrapper):
    """RolloutSource: `inner`'s samples of the problems `mixture` draws each step (module docstring). `draws` must be
    the task `inner` reads its problems from; `prompts_per_step`: problems per step."""

    def __init__(self, inner: RolloutSource, mixture: AdaptiveMixture, draws: MixtureDraws, prompts_per_step: int):
        self.inner, self.mixture, self.draws, self.prompts_per_step = inner, mixture, draws, prompts_per_step
        self.last: StepSamples | None = None  # the step collected last: its rollouts carry the trainer's rewards
        self.drawn_shares = mixture.shares()  # the shares the last collect drew with

    def start(self, version: int, data_position: int, state: dict | None) -> None:
        state = state or {}
        self.mixture.load_state_dict(state.get("mixture"))
        self.inner.start(version, data_position, state.get("inner"))

    def collect(self, step: int, version: int, data_position: int) -> StepSamples:
        self.drawn_shares = self.mixture.shares()
        self.draws.plan(data_position, self.mixture.draw(step, self.prompts_per_step))
        self.last = self.inner.collect(step, version, data_position)
        return self.last

    def step_metrics(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                     versions: torch.Tensor, version: int) -> dict[str, float]:
        """The inner source's metrics plus the mixture's (module docstring), after updating its accuracy EMA from
        the rewards the trainer gave the last collected rollouts."""
        metrics = self.inner.step_metrics(old_logprobs, rollout_logprobs, defined, versions, version)
        if self.last is None:
            return metrics
        rollouts, problems = self.last.rollouts, self.last.problems
        self.mixture.observe(torch.tensor([r.reward for r in rollouts], dtype=torch.float64),
                             [problems[r.group_id] for r in rollouts])
        names = self.mixture.names
        counts = [0] * len(names)
        for problem in problems.values():
            counts[self.mixture.index[problem.entry["metadata"]["source_dataset"]]] += 1
        self.last = None  # one update per collected step
        return metrics | {f"mixture/share/{n}": float(s) for n, s in zip(names, self.drawn_shares.tolist())} | {
            f"mixture/accuracy/{n}": float(p) for n, p in zip(names, self.mixture.accuracy.tolist())} | {
            f"mixture/prompts/{n}": float(c) for n, c in zip(names, counts)}

    def state_dict(self) -> dict | None:
        return {"inner": self.inner.state_dict(), "mixture": self.mixture.state_dict()}

    def close(self) -> None:
        self.inner.close()


def adaptive_mixture(source, options: dict, decay: float, floor: float, seed: int) -> AdaptiveMixtureRollouts:
    """Wrap the inline single-turn `source` (it has `task` and `prompts_per_step`) in the adaptive mixture over the
    composite task's datasets (`options`: task.options), beta = `decay`, eps = `floor`, seeded by `seed` (run.seed).
    Raises TypeError for a source without a task to replace, ValueError as AdaptiveMixture."""
    if not (hasattr(source, "task") and hasattr(source, "prompts_per_step")):
        raise TypeError(f"task.mixture = 'adaptive' draws the problems of the inline single-turn source, not of a "
                        f"{type(source).__name__}")
    names, weights = mixture_datasets(options)
    mixture = AdaptiveMixture(source.task, names, weights, decay, floor, seed)
    draws = MixtureDraws(source.task)
    source.task = draws  # the inner source now samples the planned problems
    return AdaptiveMixtureRollouts(source, mixture, draws, source.prompts_per_step)
