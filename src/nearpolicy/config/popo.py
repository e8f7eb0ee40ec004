"""The [popo] section of the config schema (config/schema.py assembles the whole schema): POPO's prioritized group
replay (rollouts/replay.py, ops/popo.py; docs/math.md sec. 25). Its rules across sections are
config/checks.check_popo."""

from __future__ import annotations

from pydantic import Field, StrictBool

from nearpolicy.config.sections import Section


class PopoConfig(Section):
    """POPO, Group Prioritized Off-Policy Optimization (reconstructed from the abstract of arXiv:2606.01281;
    docs/math.md sec. 25): each step, every fresh group whose rewards are all equal (no GRPO signal) gives its slot to
    a stored effective group of an earlier step, ranked by its reward std x recency_decay^age; the replayed tokens
    keep the engine's log-probs and versions they were sampled with, so the decoupled correction weights them by
    pi_old / mu under the same clip. Synchronous single-turn rollouts, correction.mode = "decoupled" with an IS
    weight."""

    enabled: StrictBool = False
    """Replace constant-reward groups by replayed effective groups (off: every group is the step's own sample)."""
    buffer_groups: int = Field(64, ge=1, le=4096)
    """Most effective groups kept for replay; beyond it the lowest priorities (std x decay^age) leave."""
    max_age: int = Field(4, ge=1, le=64)
    """A stored group is replayed only while it is at most this many policy versions old (then it leaves)."""
    recency_decay: float = Field(0.5, gt=0, le=1)
    """lambda: a stored group's priority is its reward std x lambda^age (age in versions); 1 = recency ignored."""
