"""Mismatch corrections between the engine (behaviour mu) and the trainer, composable as
level x action x bounds, plus rejection rules and a token veto.

Log-ratio direction (written once): log rho_t = numerator - rollout_logprobs, where
  decoupled mode: numerator = proximal_logprobs (pi_old = old_logprobs by default, AReaL / verl; the EWMA or A-3PO
                  proximal when chosen: ops/proximal.proximal_logprobs decides, the loss's ratio uses the same);
  bypass mode:    numerator = logprobs.detach() (the current policy; the loss's proximal is then rollout_logprobs).
log rho is clamped per token to +-20 nats (and sums again) before exp, and every weight is detached
(invariant 11). A token without an engine log-prob gets log rho = 0 (ratio exactly 1), is never rejected, and
is left out of every mean and metric below (invariant 5); "defined" = valid (mask) and has an engine log-prob.

Levels (ratio each valid token's weight is built from):
  token            rho_t
  sequence         exp(clamp(sum_def log rho, +-20))                         one value per sequence
  geometric        exp(sum_def log rho / n_def)                             one value per sequence
  prefix_min       min_{defined i < t} rho_i  (1 for an empty prefix; i <= t with prefix_inclusive)
  prefix_geometric exp(sum_{defined i <= t} log rho_i / #{defined i <= t})   (1 for an empty prefix)
Actions: off (w = 1), none (w = ratio), truncate (w = clamp(ratio, lower, upper)),
  mask (w = ratio inside [lower, upper], token rejected outside).
Self-normalisation (after the action and rejections, before mix): w <- w / mean w, the mean over defined tokens
(token) or over sequences of per-sequence means (sequence), rejected tokens counting 0; docs/math.md sec. 9.
Rejection rules test a statistic of log rho at token / seq_sum / seq_mean / seq_max level against
[lower, upper] in the statistic's own units; the veto rejects a whole sequence if any defined rho_t < tau.
Sources per preset in ops/correction_presets.py; derivations in docs/math.md secs. 4 and 9-11.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from nearpolicy.ops.masked import SAFETY_BOUND, clamped_exp, masked_sum, select
from nearpolicy.ops.self_normalize import SELF_NORMALIZE, self_normalization_factor

CorrectionAction = Literal["off", "none", "truncate", "mask"]
CorrectionLevel = Literal["token", "sequence", "geometric", "prefix_min", "prefix_geometric"]
CorrectionMode = Literal["decoupled", "bypass"]
RejectionStatistic = Literal["log_ratio", "k1", "k2", "k3"]
RejectionLevel = Literal["token", "seq_sum", "seq_mean", "seq_max"]
ACTIONS = ("off", "none", "truncate", "mask")
LEVELS = ("token", "sequence", "geometric", "prefix_min", "prefix_geometric")
MODES = ("decoupled", "bypass")
STATISTICS = ("log_ratio", "k1", "k2", "k3")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")


def _check_bounds(lower: float, upper: float, what: str) -> None:
    if not (0 <= lower < upper):
        raise ValueError(f"{what} bounds must satisfy 0 <= lower < upper, got [{lower}, {upper}]")


@dataclass(frozen=True)
class RejectionRule:
    """Accept iff lower <= stat <= upper. stat from lr = clamp(log rho, +-20) per defined token:
    log_ratio = lr, k1 = -lr, k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr; aggregated per `level` over the
    sequence's defined tokens (token: the token alone; seq_sum; seq_mean; seq_max; an empty sequence gives 0).
    Bounds on the ratio itself: `RejectionRule.ratio("seq_mean", 0.999, 1.001)` (the geometric mean)."""

    statistic: RejectionStatistic
    level: RejectionLevel
    lower: float = -math.inf
    upper: float = math.inf

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS or self.level not in REJECTION_LEVELS:
            raise ValueError(f"unknown rejection rule {self.statistic!r} at {self.level!r}")
        if not self.lower <= self.upper:
            raise ValueError(f"rejection bounds must satisfy lower <= upper, got [{self.lower}, {self.upper}]")

    @staticmethod
    def ratio(level: RejectionLevel, lower: float, upper: float) -> RejectionRule:
        """Bounds on exp(stat) of the log-ratio: lower <= rho_stat <= upper (lower 0 = no lower bound)."""
        _check_bounds(lower, upper, "rejection")
        return RejectionRule("log_ratio", level, math.log(lower) if lower > 0 else -math.inf, math.log(upper))


@dataclass(frozen=True)
class CorrectionSpec:
    """A composable mismatch correction (see module docstring). veto: tau in (0, 1) or None.
    prefix_inclusive: prefix_min takes the min over i <= t instead of i < t.
    mix: AIS-style interpolation w <- (1 - mix) + mix * w, mix in [0, 1] (1 = full correction).
    self_normalize: off / token / sequence self-normalised IS (module docstring, `self_normalization_factor`)."""

    level: CorrectionLevel = "token"
    action: CorrectionAction = "off"
    lower: float = 0.0
    upper: float = math.inf
    mode: CorrectionMode = "decoupled"
    rejections: tuple[RejectionRule, ...] = field(default_factory=tuple)
    veto: float | None = None
    prefix_inclusive: bool = False
    mix: float = 1.0
    self_normalize: Literal["off", "token", "sequence"] = "off"

    def __post_init__(self) -> None:
        _check_bounds(self.lower, self.upper, "correction")
        if self.self_normalize not in SELF_NORMALIZE:
            raise ValueError(f"unknown self_normalize {self.self_normalize!r}; valid: {', '.join(SELF_NORMALIZE)}")
        if self.level not in LEVELS or self.action not in ACTIONS or self.mode not in MODES:
            raise ValueError(f"unknown level / action / mode {self.level!r} / {self.action!r} / {self.mode!r}; "
                             f"valid: {LEVELS}, {ACTIONS}, {MODES}")
        if self.veto is not None and not 0 < self.veto < 1:
            raise ValueError(f"veto threshold must be in (0, 1), got {self.veto}")
        if not 0 <= self.mix <= 1:
            raise ValueError(f"mix must be in [0, 1], got {self.mix}")

    @property
    def rejects(self) -> bool:
        """True when the spec can reject tokens or whole sequences: action mask, a rejection rule or a veto."""
        return self.action == "mask" or bool(self.rejections) or self.veto is not None


@dataclass(frozen=True)
class CorrectionResult:
    """weights [B, T] detached (1 at padding, 0 at rejected valid tokens); keep [B, T] bool (valid and not
    rejected: use `mask & keep` as the loss mask, and count denominators from it over the whole accumulation
    group, to drop rejected tokens as verl's rejection sampling does; keep the original mask in the denominator
    to follow AReaL); metrics: dict of detached scalars (means over the defined tokens of this call)."""

    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, torch.Tensor]


def mismatch_log_ratio(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, has_rollout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log rho = old_logprobs - rollout_logprobs [B, T] (0 where masked or missing) and the mask of tokens
    where it is defined (valid and with an engine log-prob)."""
    defined = mask.bool() & has_rollout.bool()
    log_rho = select(old_logprobs.detach(), defined) - select(rollout_logprobs.detach(), defined)
    return log_rho, defined


def correction_log_ratio(
    mode: CorrectionMode, logprobs: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
    mask: torch.Tensor, has_rollout: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached log rho [B, T] and `defined` [B, T] bool: decoupled = old_logprobs - rollout_logprobs (the
    discrepancy at the sampling weights), bypass = logprobs - rollout_logprobs (total drift). All [B, T] nats."""
    if mode == "decoupled":
        return mismatch_log_ratio(old_logprobs, rollout_logprobs, mask, has_rollout)
    if mode == "bypass":
        return mismatch_log_ratio(logprobs, rollout_logprobs, mask, has_rollout)
    raise ValueError(f"unknown correction mode {mode!r}; valid: {', '.join(MODES)}")


def level_log_ratio(
    log_rho: torch.Tensor, defined: torch.Tensor, level: CorrectionLevel, prefix_inclusive: bool = False
) -> torch.Tensor:
    """Log of the ratio each token's weight is built from, [B, T], for `level` (module docstring). log_rho is
    0 at undefined positions. Not clamped: the caller clamps before exp."""
    d = defined.to(log_rho.dtype)
    n = d.sum(-1, keepdim=True)
    if level == "token":
        return log_rho
    if level == "sequence":
        return log_rho.sum(-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND).expand_as(log_rho)
    if level == "geometric":
        return (log_rho.sum(-1, keepdim=True) / n.clamp_min(1)).expand_as(log_rho)
    if level == "prefix_geometric":
        return torch.cumsum(log_rho, -1) / torch.cumsum(d, -1).clamp_min(1)
    if level == "prefix_min":
        big = torch.full_like(log_rho, math.inf)
        running = torch.cummin(torch.where(defined.bool(), log_rho, big), -1).values
        if not prefix_inclusive:
            running = torch.cat([big[:, :1], running[:, :-1]], -1)
        return torch.where(torch.isinf(running), torch.zeros_like(running), running)
    raise ValueError(f"unknown correction level {level!r}; valid: {', '.join(LEVELS)}")


def rejection_statistic(log_rho: torch.Tensor, defined: torch.Tensor, rule: RejectionRule) -> torch.Tensor:
    """The rule's statistic, [B, T] for token level and [B, 1] for sequence levels (0 for empty sequences)."""
    lr = select(log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND), defined)
    per_tok = {"log_ratio": lr, "k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.exp(lr) - 1 - lr}[rule.statistic]
    per_tok = select(per_tok, defined)
    if rule.level == "token":
        return per_tok
    if rule.level == "seq_sum":
        return per_tok.sum(-1, keepdim=True)
    n = defined.sum(-1, keepdim=True)
    if rule.level == "seq_mean":
        return per_tok.sum(-1, keepdim=True) / n.clamp_min(1).to(per_tok.dtype)
    peak = select(per_tok, defined, fill=-math.inf).max(-1, keepdim=True).values
    return torch.where(n > 0, peak, torch.zeros_like(peak))


def _rule_name(rule: RejectionRule) -> str:
    return f"{rule.level}_{rule.statistic}"


def correct(spec: CorrectionSpec, log_rho: torch.Tensor, defined: torch.Tensor, mask: torch.Tensor,
            normalizer: torch.Tensor | float | None = None) -> CorrectionResult:
    """Apply a composable correction to a detached log-ratio.

    log_rho [B, T] float (nats; 0 at undefined positions, e.g. from `correction_log_ratio`), defined [B, T]
    bool, mask [B, T] bool (valid tokens) -> CorrectionResult. Sequence-level quantities are per row, so the
    result of a micro-batch equals the matching rows of the full batch, except the self-normalisation mean:
    pass the whole batch's `normalizer` (its metric "correction/sn_factor") to each micro-batch call; without
    it the mean of this call is used. Sources: docs/math.md sec. 9."""
    mask, defined = mask.bool(), defined.bool() & mask.bool()
    log_rho = select(log_rho.detach(), defined).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    log_w = level_log_ratio(log_rho, defined, spec.level, spec.prefix_inclusive)
    ratio = clamped_exp(log_w)
    high, low = ratio > spec.upper, ratio < spec.lower
    reject = torch.zeros_like(mask)
    if spec.action == "off":
        w = torch.ones_like(ratio)
    elif spec.action == "none":
        w = ratio
    elif spec.action == "truncate":
        w = ratio.clamp(min=spec.lower, max=spec.upper)
    else:
        w = ratio
        reject = high | low
    if spec.level == "token":  # a token without an engine log-prob keeps w = 1 exactly (invariant 5)
        w, reject = select(w, defined, fill=1.0), reject & defined
    metrics: dict[str, torch.Tensor] = {}
    n_def = defined.sum().clamp_min(1)
    for rule in spec.rejections:
        stat = rejection_statistic(log_rho, defined, rule)
        out = ((stat < rule.lower) | (stat > rule.upper)).expand_as(mask)
        out = out & defined if rule.level == "token" else out
        metrics[f"correction/rejected_{_rule_name(rule)}"] = masked_sum(out.to(log_rho.dtype), defined) / n_def
        reject = reject | out
    if spec.veto is not None:
        vetoed = (select(log_rho, defined) < math.log(spec.veto)).any(-1, keepdim=True).expand_as(mask)
        metrics["correction/vetoed"] = masked_sum(vetoed.to(log_rho.dtype), defined) / n_def
        reject = reject | vetoed
    if spec.self_normalize != "off":
        factor = normalizer if normalizer is not None else self_normalization_factor(w, mask & ~reject, defined,
                                                                                     spec.self_normalize)
        factor = torch.as_tensor(factor, dtype=w.dtype)
        metrics["correction/sn_factor"] = factor
        scaled = defined if spec.level == "token" else defined.any(-1, keepdim=True)  # no engine log-prob: w stays
        w = torch.where(scaled, w / factor, w)
    w = (1 - spec.mix) + spec.mix * w
    keep = mask & ~reject
    weights = torch.where(keep, w, torch.where(mask, torch.zeros_like(w), torch.ones_like(w))).detach()
    seq_valid = mask.any(-1)
    seq_rejected = (seq_valid & (mask & ~keep).any(-1)).sum() / seq_valid.sum().clamp_min(1)
    metrics.update({
        "correction/frac_high": masked_sum(high.to(log_rho.dtype), defined) / n_def,
        "correction/frac_low": masked_sum(low.to(log_rho.dtype), defined) / n_def,
        "correction/weight_mean": masked_sum(weights, defined) / n_def,
        "correction/rejected_frac": masked_sum((mask & ~keep).to(log_rho.dtype), defined) / n_def,
        "correction/rejected_seq_frac": seq_rejected.to(log_rho.dtype),
    })
    return CorrectionResult(weights, keep, metrics)


def mismatch_correction(
    spec: CorrectionSpec, logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
    mask: torch.Tensor, has_rollout: torch.Tensor, normalizer: torch.Tensor | float | None = None,
) -> CorrectionResult:
    """`correct` with the log-ratio of spec.mode: decoupled proximal_logprobs - rollout_logprobs, bypass
    logprobs - rollout_logprobs. proximal_logprobs: the loss's proximal (ops/proximal.proximal_logprobs). All
    inputs [B, T]."""
    log_rho, defined = correction_log_ratio(spec.mode, logprobs, proximal_logprobs, rollout_logprobs, mask, has_rollout)
    return correct(spec, log_rho, defined, mask, normalizer)
