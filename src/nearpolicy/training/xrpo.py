"""The run's side of [xrpo] (config/xrpo.py; docs/math.md sec. 26): `xrpo_rollouts` builds the rollout allocator
(rollouts/allocation.RolloutAllocation) over the inline source, with its scorer, response texts and seeded prompts;
training/assemble.build_rollouts hooks it in. The novelty sharpening lives in the advantage phase
(training/phases.novelty_sharpening)."""

from __future__ import annotations

from nearpolicy.config.schema import Config
from nearpolicy.model.load import chat_prompt_ids
from nearpolicy.rollouts.allocation import AllocationSettings, Exemplar, RolloutAllocation
from nearpolicy.rollouts.base import RolloutSource
from nearpolicy.rollouts.inline import InlineRollouts
from nearpolicy.tasks import Problem
from nearpolicy.tasks.scoring import BoundedScorer
from nearpolicy.training.phases import response_text, score_texts


def allocation_settings(cfg: Config) -> AllocationSettings:
    """[xrpo]'s plain settings for the allocator; a seeded prompt must leave sampling.max_new_tokens of
    model.max_context for the response."""
    x, a = cfg.xrpo, cfg.algorithm
    return AllocationSettings(x.first_round_of(a.group_size), a.group_size, x.alpha, x.exploration, x.seeding,
                              cfg.engine.max_parallel_sequences, cfg.model.max_context - cfg.sampling.max_new_tokens)


def seeded_messages(example: list[dict[str, str]], exemplar: Exemplar) -> list[dict[str, str]]:
    """The worked turns of a seeded prompt: task.example, then the exemplar's question (user) and its full-reward
    response (assistant); the problem's question follows as the next user turn."""
    return [*example, {"role": "user", "content": exemplar.question},
            {"role": "assistant", "content": exemplar.response}]


def xrpo_rollouts(cfg: Config, session, inner: RolloutSource, log=print) -> RolloutSource:
    """XRPO's allocator over `inner` (the inline source; `session`: training/assemble.Session) when [xrpo] allocates,
    else `inner` itself. The allocator scores the first round with a bounded scorer of its own (the task's reward,
    task.reward_timeout_s), as POPO's replay does. Raises TypeError for an inner source other than the inline one."""
    if not cfg.xrpo.allocating:
        return inner
    if not isinstance(inner, InlineRollouts):  # config/checks.check_xrpo refuses what wraps it
        raise TypeError(f"xrpo.allocate samples with the inline single-turn source, not a {type(inner).__name__}")
    scorer, tokenizer, task = BoundedScorer(session.task, cfg.task.reward_timeout_s), session.tokenizer, cfg.task

    def score(rollouts, problems) -> list[float]:
        return [result.reward for result in score_texts(scorer, tokenizer, [r.response_ids() for r in rollouts],
                                                        [problems[r.group_id] for r in rollouts], "XRPO", log)]

    def seeded_prompt(problem: Problem, exemplar: Exemplar) -> list[int]:
        return chat_prompt_ids(tokenizer, task.system_prompt, problem.question, seeded_messages(task.example, exemplar))

    return RolloutAllocation(inner, score, lambda ids: response_text(tokenizer, ids), seeded_prompt,
                             allocation_settings(cfg), scorer.close)
