"""The [xrpo] section of the config schema (config/schema.py assembles the whole schema): XRPO's novelty-aware
advantage sharpening (ops/xrpo.py, applied in training/phases.apply_data_policy) and its rollout allocator with
in-context seeding (rollouts/allocation.py; docs/math.md sec. 26). No [xrpo] section (the default) changes nothing.
Its rules across sections are config/checks.check_xrpo."""

from __future__ import annotations

from pydantic import Field, StrictBool, StrictInt, model_validator

from nearpolicy.config.sections import Section


class XrpoConfig(Section):
    """XRPO (eXplore-eXploit GRPO, Bamba et al., arXiv:2510.06672; forms reconstructed from a third-party summary,
    docs/math.md sec. 26): a correct response the sampling policy found unlikely gets a larger advantage (novelty);
    each step samples first_round responses per prompt, then gives the rest of the step's budget, prompts_per_step x
    (group_size - first_round), to the prompts whose mean reward is most uncertain (allocate), so groups differ in
    size; with seeding, the extra responses of a prompt whose first round scored all 0 are sampled with a solved
    problem of the run in context. A [xrpo] table in the file (even empty) or any --set xrpo.KEY turns it on.
    Synchronous single-turn rollouts of the full model."""

    enabled: StrictBool = False
    """On as soon as the config has a [xrpo] table or an xrpo.* override (the section's presence); false in a [xrpo]
    table turns it off."""
    novelty: StrictBool = True
    """Novelty sharpening: A_i > 0 gains min(max(novelty_lambda (1 - eta_i), 0), novelty_kappa A_i), eta_i =
    exp(s_i - group mean s), s_i = the mean engine log-prob of response i (nats per token; logged as
    xrpo/sharpened_frac, xrpo/bonus_mean)."""
    novelty_lambda: float = Field(0.5, ge=0, le=100)
    """lambda: the most a correct response's advantage can gain (reached as its likelihood ratio to its group's mean
    goes to 0); 0 = no sharpening."""
    novelty_kappa: float = Field(0.5, ge=0, le=100)
    """kappa: the gain is at most kappa x A (A+ <= (1 + kappa) A)."""
    allocate: StrictBool = True
    """The rollout allocator: first_round samples per prompt, the step's remaining samples to the prompts of highest
    priority (t-interval half-width reduction + exploration bonus), one at a time; off: every group has group_size."""
    first_round: StrictInt | None = Field(None, ge=2)
    """Samples of each prompt before the allocation (>= 2, < algorithm.group_size); unset: group_size // 2, at least 2."""
    alpha: float = Field(0.05, ge=1e-6, lt=1)
    """The half-width's confidence level is 1 - alpha (Student-t quantile t_{1 - alpha/2, n - 1})."""
    exploration: float = Field(0.1, gt=0, le=100)
    """lambda of the allocator's exploration bonus lambda sqrt(ln(1 + T) / n_q) (T: the step being collected, from 1;
    reward units, as the half-width). Above 0: at 0 a step whose groups are all constant (every priority 0) would give
    its whole budget to the first prompt (ties go to the lowest index)."""
    seeding: StrictBool = False
    """In-context seeding (reconstructed): the extra samples (two or more) of a prompt whose first round scored all 0
    are drawn with a problem the run solved earlier (its question and a full-reward response, as a user / assistant
    turn after task.example) in context, and train as their own group under that seeded prompt. Needs allocate."""

    @model_validator(mode="before")
    @classmethod
    def _on_when_given(cls, data):
        """A [xrpo] table without `enabled` means XRPO on (the schema's default instance is built enabled=False)."""
        return {**data, "enabled": True} if isinstance(data, dict) and "enabled" not in data else data

    def first_round_of(self, group_size: int) -> int:
        """The first round's samples per prompt for algorithm.group_size: first_round, or group_size // 2 (>= 2)."""
        return self.first_round if self.first_round is not None else max(2, group_size // 2)

    @property
    def sharpening(self) -> bool:
        return self.enabled and self.novelty

    @property
    def allocating(self) -> bool:
        return self.enabled and self.allocate

