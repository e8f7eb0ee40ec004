"""The [correction] section of the config schema (config/schema.py assembles the whole schema): which correction of
the engine / trainer mismatch the loss applies (ops/correction_presets.py, docs/math.md sec. 9-12)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nearpolicy.config.checks import check_correction, registered
from nearpolicy.config.sections import Section
from nearpolicy.ops.correction_presets import CORRECTIONS, PRESET_FIELDS, correction_spec
from nearpolicy.ops.corrections import ACTIONS, LEVELS, MODES
from nearpolicy.ops.proximal import ADAPTIVE_MIXES, CENTERINGS, PROXIMALS
from nearpolicy.ops.self_normalize import SELF_NORMALIZE


class CorrectionConfig(Section):
    """Engine/trainer mismatch correction: a named preset (`nearpolicy list`), optionally with fields replaced."""

    preset: registered(CORRECTIONS, aliases=("none",)) = "tis"
    """Named correction; "none" is an alias of "off" (no correction)."""
    level: Literal[LEVELS] | None = None
    """Replaces the preset's level: the ratio the weight is built from (token rho_t, sequence prod, geometric mean,
    prefix min / geometric mean up to t; docs/math.md sec. 9-11). None = the preset's."""
    action: Literal[ACTIONS] | None = None
    """Replaces the preset's action: truncate (clamp into [lower, upper]), mask (drop outside), none (raw weight),
    off (no weight). None = the preset's."""
    lower: float | None = Field(None, ge=0)
    """Lower bound of the weight (>= 0). None = the preset's."""
    upper: float | None = Field(None, gt=0, allow_inf_nan=True)
    """Upper bound of the weight (> 0; inf = none). None = the preset's."""
    mode: Literal[MODES] | None = None
    """decoupled: weight pi_old / mu, PPO ratio vs pi_old (AReaL); bypass: PPO ratio vs the engine's log-probs."""
    veto: float | None = Field(None, gt=0, lt=1)
    """Reject a whole sequence when any token ratio is below this."""
    mix: float | None = Field(None, ge=0, le=1)
    """Interpolate w <- (1 - mix) + mix w (1 = the full correction, 0 = none). None = the preset's (1)."""
    self_normalize: Literal[SELF_NORMALIZE] | None = None
    """Self-normalised IS: divide the weights by their mean over the rollout batch, after truncation and rejection
    (token: over defined tokens; sequence: over sequences of per-sequence means; verl rollout_is_batch_normalize)."""
    proximal: Literal[PROXIMALS] = "old"
    """Proximal policy of the decoupled loss (PPO-ratio denominator, mismatch-weight numerator): old = the trainer
    at the sampling weights; ewma = a model holding the bias-corrected EWMA of the policy weights, updated after
    every optimizer step (PPO-EWMA); a3po = log-linear interpolation by token staleness (A-3PO). docs/math.md sec. 12.
    ewma and a3po need mode = 'decoupled'."""
    ewma_decay: float = Field(0.9, ge=0, lt=1)
    """PPO-EWMA decay beta, in [0, 1), used with proximal = "ewma" (0 = the current weights: proximal = old)."""
    adaptive_mix: Literal[ADAPTIVE_MIXES] = "none"
    """ais: per-batch lambda mixing uncorrected and corrected gradients (docs/math.md, AIS reconstruction)."""
    center: Literal[CENTERINGS] = "none"
    """DLC numerical-discrepancy centring of log(pi_old / mu) over the batch before the correction."""

    @model_validator(mode="after")
    def _spec_builds(self) -> "CorrectionConfig":
        check_correction(self)
        return self

    def spec(self):
        """The composable CorrectionSpec this section describes. Raises ValueError for inconsistent bounds."""
        overrides = {name: getattr(self, name) for name in PRESET_FIELDS if getattr(self, name) is not None}
        return correction_spec("off" if self.preset == "none" else self.preset, **overrides)
