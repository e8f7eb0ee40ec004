"""Run guards: steps with a non-finite loss or gradient, weights that became non-finite, and prompts that cannot
fit the engine's context. Each guard either lets the run go on (counting what it skipped) or stops it with an
error that says what went wrong and where; none of them writes anything."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class NonFiniteError(FloatingPointError):
    """Too many consecutive steps with a non-finite loss or gradient, or weights that became non-finite."""


def step_fault(metrics: dict[str, float]) -> str | None:
    """Why the step behind `metrics` (policy_update's `actor/*` floats) was skipped, or None when it was not.

    A mini-batch whose loss or gradient norm is NaN / inf is skipped by policy_update (optimizer not stepped) and
    counted in `actor/skipped_minibatches`; the averaged `actor/loss` / `actor/grad_norm` then carry the NaN/inf."""
    skipped = int(metrics.get("actor/skipped_minibatches", 0.0))
    if not skipped:
        return None
    causes = [name for key, name in (("actor/loss", "loss"), ("actor/grad_norm", "gradient norm"))
              if not math.isfinite(metrics.get(key, 0.0))]
    return f"{skipped} mini-batch(es) skipped: non-finite {' and '.join(causes) or 'loss or gradient'}"


def no_signal(metrics: dict[str, float]) -> str | None:
    """Why the step behind `metrics` trained on nothing (advantage/nonzero_frac = 0: every kept sample's advantage
    is 0), or None. Group-relative estimators give 0 to a constant group, a singleton and an unscorable sample
    (ops/advantages.py): a run whose every step says so learns only from its KL or entropy term, if any. A step with
    a forward-KL distillation term (distill/forward_kl) trains every response token through it: never idle."""
    if metrics.get("advantage/nonzero_frac", 1.0) != 0 or "distill/forward_kl" in metrics:
        return None
    return ("no sample has a nonzero advantage (every group constant, a singleton or unscorable): the policy-gradient "
            "term of this step trains on nothing")


@dataclass
class BadStepGuard:
    """Counts skipped (non-finite) steps; `check` stops the run after `max_consecutive` of them in a row."""

    max_consecutive: int
    total: int = 0
    consecutive: int = 0
    last_cause: str = ""

    def observe(self, step: int, metrics: dict[str, float], log) -> dict[str, float]:
        """Classify the step just taken (logging its cause when bad, and a warning when no sample had a nonzero
        advantage: see no_signal); returns the guard's metrics."""
        idle = no_signal(metrics)
        if idle is not None:
            log(f"warning: step {step}: {idle}")
        cause = step_fault(metrics)
        if cause is None:
            self.consecutive = 0
        else:
            self.total += 1
            self.consecutive += 1
            self.last_cause = cause
            log(f"warning: step {step}: {cause} ({self.consecutive} in a row, {self.total} in this run)")
        return {"guard/bad_steps": float(self.total), "guard/consecutive_bad_steps": float(self.consecutive)}

    def check(self, step: int) -> None:
        """Raises NonFiniteError once `max_consecutive` consecutive steps were bad."""
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(f"{self.consecutive} consecutive steps up to step {step} had a non-finite loss or "
                                 f"gradient (run.max_bad_steps = {self.max_consecutive}); last: {self.last_cause}")

    def state(self) -> dict[str, int]:
        return {"bad_steps": self.total, "consecutive_bad_steps": self.consecutive}

    def restore(self, saved: dict) -> None:
        self.total = int(saved.get("bad_steps", 0))
        self.consecutive = int(saved.get("consecutive_bad_steps", 0))


def _finite(t: torch.Tensor) -> bool:
    """No NaN / inf in `t`: max and min propagate NaN and reach +-inf (two reductions, no boolean copy of `t`)."""
    return t.numel() == 0 or bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin()))


def check_finite_weights(model: torch.nn.Module, step: int) -> None:
    """Raises NonFiniteError naming the first parameters with NaN / inf (the weights are then neither exported to
    the engine nor checkpointed)."""
    bad = [name for name, p in model.named_parameters() if not _finite(p.detach())]
    if bad:
        raise NonFiniteError(f"weights became non-finite at step {step} ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''}); they were not saved or sent to the engine")


def check_prompt_lengths(prompt_ids, problems: dict[str, list], max_context: int, max_new_tokens: int) -> None:
    """Refuse, at startup, prompts that cannot fit: chat-templated length + max_new_tokens > max_context.

    `prompt_ids(problem) -> list[int]`; `problems`: split name ("train", "eval") -> problems, each checked.
    Raises ValueError naming the split, index and length of the first offenders, and the two settings."""
    budget = max_context - max_new_tokens
    if budget < 1:
        raise ValueError(f"sampling.max_new_tokens ({max_new_tokens}) leaves no room for a prompt in "
                         f"model.max_context ({max_context})")
    too_long = []
    for split, items in problems.items():
        for i, problem in enumerate(items):
            n = len(prompt_ids(problem))
            if n > budget:
                too_long.append(f"{split} problem {i} ({n} tokens)")
    if too_long:
        shown = ", ".join(too_long[:5]) + (f" and {len(too_long) - 5} more" if len(too_long) > 5 else "")
        raise ValueError(f"{len(too_long)} prompt(s) longer than model.max_context ({max_context}) minus "
                         f"sampling.max_new_tokens ({max_new_tokens}) = {budget} tokens: {shown}; raise "
                         "model.max_context, lower sampling.max_new_tokens or shorten the prompts")


def check_task_prompts(task, prompt_ids, max_context: int, max_new_tokens: int) -> None:
    """check_prompt_lengths over every training problem (task.train_size of them) and every eval problem."""
    train = [task.train_problem(i) for i in range(getattr(task, "train_size", 0))]
    check_prompt_lengths(prompt_ids, {"train": train, "eval": task.eval_problems()}, max_context, max_new_tokens)
