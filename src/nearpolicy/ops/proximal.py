"""The proximal policy of the loss, proximal-policy approximations and mismatch-adaptive weights (pure tensor
functions).

Log-probs, all [B, T] nats: `logprobs` = log pi_theta (current, with grad), `old_logprobs` = pi_old (trainer at
the sampling weights, detached), `rollout_logprobs` = mu (the engine's), `proximal_logprobs` = pi_prox, what the
loss's ratio r = exp(logprobs - proximal_logprobs) is taken against: decided by `proximal_logprobs` below and
nowhere else (pi_old, the EWMA policy, the A-3PO interpolation, or the engine's mu in bypass mode).
Discrepancy log-ratio log rho = old - rollout (same weights, different engines); lag log-ratio
log r = logprobs - old (policy drift since sampling). Every returned weight is detached; every log-ratio is
clamped to +-20 before exp. docs/math.md secs. 12-14.
"""

from __future__ import annotations

import torch

from nearpolicy.ops.diagnostics import normalized_ess
from nearpolicy.ops.masked import SAFETY_BOUND, masked_mean, select


# -- PPO-EWMA (Hilton et al. arXiv:2110.00641; openai/ppo-ewma) ----------------------------------------------
def ewma_update(
    ewma: torch.Tensor, theta: torch.Tensor, weight_sum: torch.Tensor, decay: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One bias-corrected EWMA step of a parameter tensor (any shape; no grad):
    W' = decay W + 1; ewma' = (decay W / W') ewma + theta / W'. Returns (ewma', W'). Start from W = 0 (then
    ewma' = theta); decay = 0 resets to the current weights. Source: openai/ppo-ewma ppg.py. Raises
    ValueError unless 0 <= decay < 1."""
    if not 0 <= decay < 1:
        raise ValueError(f"EWMA decay must be in [0, 1), got {decay}")
    with torch.no_grad():
        new_sum = decay * weight_sum + 1
        return (decay * weight_sum / new_sum) * ewma + theta / new_sum, new_sum


# -- A-3PO approximate proximal policy (arXiv:2512.06547; AReaL docs prox_approx.md) -------------------------
def a3po_alpha(v_behave: torch.Tensor, v_prox: torch.Tensor | float, v_theta: torch.Tensor | float) -> torch.Tensor:
    """alpha = (v_prox - v_behave) / (v_theta - v_behave), clamped to [0, 1]; 0 where v_theta == v_behave
    (no lag: the proximal policy is the behaviour one). Versions are integer policy versions, any broadcastable
    shape ([B] or [B, T] for per-token versions)."""
    v_behave = torch.as_tensor(v_behave, dtype=torch.float64)
    num = torch.as_tensor(v_prox, dtype=torch.float64) - v_behave
    den = torch.as_tensor(v_theta, dtype=torch.float64) - v_behave
    return torch.where(den > 0, num / den.clamp_min(1e-12), torch.zeros_like(num)).clamp(0, 1)


def a3po_proximal_logprobs(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, alpha: torch.Tensor | float, kind: str = "loglinear"
) -> torch.Tensor:
    """Approximate log pi_prox [B, T] (detached) without a recompute pass: loglinear = mu + alpha (lp - mu);
    linear = log((1 - alpha) exp(mu) + alpha exp(lp)). alpha: scalar, [B] or [B, T]. Raises ValueError for an
    unknown kind."""
    lp, mu = logprobs.detach(), rollout_logprobs.detach()
    a = torch.as_tensor(alpha, dtype=lp.dtype)
    a = a.unsqueeze(-1) if a.dim() == 1 else a
    if kind == "loglinear":
        return mu + a * (lp - mu)
    if kind == "linear":
        return torch.logaddexp(torch.log1p(-a) + mu, torch.log(a) + lp)
    raise ValueError(f"unknown A-3PO approximation {kind!r}; valid: loglinear, linear")


def a3po_behaviour_proximal(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, has_rollout: torch.Tensor,
    versions: torch.Tensor, version: int, kind: str = "loglinear",
) -> torch.Tensor:
    """A-3PO proximal log-probs [B, T] (detached): behaviour + alpha (sg(logprobs) - behaviour), alpha per token
    = (v_prox - v_tok) / (v_theta - v_tok) with v_prox = version, v_theta = version + 1, clamped to [0, 1]
    (A-3PO arXiv:2512.06547, AReaL prox_approx.md: v_prox = v_theta - 1). Behaviour log-probs: old_logprobs for
    tokens of the trainer's current version (the trainer at exactly the weights that sampled them, so the
    engine/trainer discrepancy stays in the mismatch weight), the engine's rollout_logprobs for stale tokens (no
    trainer record of those weights survives). logprobs: current policy (grad ignored); old_logprobs: the trainer
    at the weights of version `version`; rollout_logprobs: the engine's (NaN where missing, see has_rollout
    [B, T] bool: old_logprobs there); versions [B, T] int64: version that generated each token (-1 at padding:
    old_logprobs there). Staleness 0 everywhere (the synchronous trainer) gives old_logprobs exactly."""
    fresh = (versions >= version) | (versions < 0)
    known = has_rollout.bool() & ~fresh
    behaviour = torch.where(known, rollout_logprobs.detach().nan_to_num(0.0), old_logprobs.detach())
    alpha = torch.where(fresh, 0.0, a3po_alpha(versions, version, version + 1)).to(logprobs.dtype)
    alpha = torch.where(known, alpha, torch.zeros_like(alpha))  # no engine record: exact old_logprobs
    prox = a3po_proximal_logprobs(logprobs, behaviour, alpha, kind)
    return torch.where(alpha > 0, prox, old_logprobs.detach())


# -- the proximal policy of the loss: the one place it is decided ---------------------------------------------
PROXIMALS = ("old", "ewma", "a3po")
PROXIMAL_MODES = ("decoupled", "bypass")


def proximal_logprobs(
    kind: str, mode: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
    has_rollout: torch.Tensor, versions: torch.Tensor | None = None, version: int = 0,
    ewma_logprobs: torch.Tensor | None = None, center: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """The proximal log-probs pi_prox [B, T] (nats, detached) of the loss: its ratio is exp(logprobs - prox) and,
    in decoupled mode, the mismatch log-ratio is log rho = prox - rollout_logprobs (AReaL's pi_prox / pi_behav
    weight, arXiv:2505.24298). docs/math.md sec. 12.

      mode bypass     the engine's rollout_logprobs + `center` (the DLC centre, sec. 13; 0 without centring),
                      with the decoupled proximal below where the engine gave none (has_rollout False: ratio 1)
      mode decoupled, by `kind` (correction.proximal):
        old   old_logprobs (the trainer at the sampling weights)
        ewma  ewma_logprobs: the policy holding the bias-corrected EWMA of its weights (PPO-EWMA, Hilton et al.
              arXiv:2110.00641; model.ewma.EwmaPolicy); decay 0 gives old_logprobs exactly
        a3po  `a3po_behaviour_proximal` from versions [B, T] and the trainer's `version` (no forward pass)

    All log-prob inputs [B, T]; rollout_logprobs may hold NaN where has_rollout is False. Raises ValueError for
    an unknown kind or mode, kind "ewma" without ewma_logprobs, or kind "a3po" without versions."""
    if kind == "old":
        prox = old_logprobs
    elif kind == "ewma":
        if ewma_logprobs is None:
            raise ValueError("proximal policy 'ewma' needs ewma_logprobs (the EWMA policy's log-probs of the batch)")
        prox = ewma_logprobs
    elif kind == "a3po":
        if versions is None:
            raise ValueError("proximal policy 'a3po' needs the per-token versions")
        prox = a3po_behaviour_proximal(logprobs, old_logprobs, rollout_logprobs, has_rollout, versions, version)
    else:
        raise ValueError(f"unknown proximal policy {kind!r}; valid: {', '.join(PROXIMALS)}")
    if mode == "decoupled":
        return prox.detach()
    if mode == "bypass":
        return torch.where(has_rollout.bool(), rollout_logprobs + center, prox).detach()
    raise ValueError(f"unknown correction mode {mode!r}; valid: {', '.join(PROXIMAL_MODES)}")


# -- DLC: discrepancy-lag correction (reconstruction; docs/math.md sec. 13) ----------------------------------
CENTERINGS = ("none", "log_mean", "weight_mean")
"""The kinds of `discrepancy_center` (config correction.center)."""


def discrepancy_center(log_rho: torch.Tensor, defined: torch.Tensor, kind: str = "log_mean") -> torch.Tensor:
    """Scalar centre c of the discrepancy log-ratio over the defined tokens of the WHOLE batch (compute once,
    before micro-batching): log_mean = mean(log rho) (= -k1 KL(mu || pi_old)); weight_mean = log mean(rho)
    (verl's batch normalisation); none = 0. Raises ValueError for an unknown kind."""
    lr = select(log_rho.detach(), defined).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if kind == "none":
        return lr.new_zeros(())
    if kind == "log_mean":
        return masked_mean(lr, defined)
    if kind == "weight_mean":
        return torch.log(masked_mean(lr.exp(), defined).clamp_min(1e-8))
    raise ValueError(f"unknown discrepancy centring {kind!r}; valid: {', '.join(CENTERINGS)}")


# -- AIS mixing coefficient (reconstruction; docs/math.md sec. 14) -------------------------------------------
ADAPTIVE_MIXES = ("none", "ais")
"""config correction.adaptive_mix: none, or `ais_lambda` mixing of uncorrected and corrected gradients."""


def ais_lambda(
    log_rho: torch.Tensor, defined: torch.Tensor, severity_scale: float = 1e-3
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-batch mixing coefficient lambda in [0, 1] (float64 scalar) and its three diagnostics, over the
    defined tokens of the WHOLE batch, with w = exp(clamp(log rho, +-20)), log rho = old - rollout:
      reliability   R = normalised ESS of w                         in (0, 1]
      severity      S = mean(w - 1 - log rho)  (k3 KL(mu || pi_old), nats)   >= 0
      amplification V = max(mean(w^2) - 1, 0)  (chi-square)                  >= 0
      lambda = S / (S + severity_scale) * R / (1 + V)
    Reconstructed from the abstract of arXiv:2605.13907 (the paper's formulas are not public)."""
    lr = select(log_rho.detach().double(), defined).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    w = lr.exp()
    reliability = normalized_ess(lr, defined)
    severity = masked_mean(w - 1 - lr, defined).clamp_min(0)
    amplification = (masked_mean(w * w, defined) - 1).clamp_min(0)
    lam = severity / (severity + severity_scale) * reliability / (1 + amplification)
    return lam.clamp(0, 1), {"ais/reliability": reliability, "ais/severity": severity,
                             "ais/amplification": amplification, "ais/lambda": lam.clamp(0, 1)}
