"""MIPU's acceptance test of a candidate update: the improvement proxy and the accept rule (docs/math.md sec. 24).

MIPU (Monotonic Inference Policy Update) and its objective MIPI (Monotonic Inference Policy Improvement) are
reconstructed from the abstract of arXiv:2606.29526 (Liang et al. 2026, "The Mirage of Optimizing Training
Policies: Monotonic Inference Policies as the Real Objective for LLM Reinforcement Learning"): an update that
improves the trainer's policy need not improve the engine's, so a candidate update is synchronised to the engine and
accepted only when "an inference-side gap proxy" says the engine's policy improves. The abstract gives neither the
proxy nor the rule; both below are ours.

Log-probs, [B, T] float32 or float64, detached, of a batch's sampled tokens under the step's sampling transform:
`candidate_logprobs` (after the update) and `behaviour_logprobs` (before it, at the weights the batch was sampled
with). On the engine's side they are the engine's own teacher-forced log-probs (or the rollout log-probs it sampled
with); on the trainer's side the trainer's current log-probs and `old_logprobs`. Ratio direction, once:

    r_t = candidate / behaviour = exp(candidate_t - behaviour_t)      (log-ratios clamped to +-20 before exp)

The proxy estimates the improvement J(candidate) - J(behaviour) from samples of the behaviour policy, with A the
step's advantages (a baseline-centred reward):
    token:    G = sum_{i,t} m_it (r_it - 1) A_it / max(sum m, 1)     (the first-order surrogate, CPI / TRPO's
              L_old(new) - L_old(old), token-mean as the default loss aggregation)
    sequence: w_i = exp(clamp(sum_t m_it log r_it, +-20));  G = mean over rows with a token of (w_i - 1) Abar_i,
              Abar_i = the token mean of A_i  (E_old[(w - 1)(R - b)] = J(new) - J(old) for an outcome reward; higher
              variance)
Both are exactly 0 when the candidate's log-probs equal the behaviour's (a synchronised candidate that rounds back
to the old engine weights). Accept iff G is finite and G >= margin."""

from __future__ import annotations

import torch

from nearpolicy.ops.masked import clamped_exp, masked_mean, masked_sum, select

MIPU_LEVELS = ("token", "sequence")


def improvement_proxy(candidate_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """The MIPU improvement proxy G (module docstring), a detached float64 scalar (advantage units: the step's
    advantages times a ratio change, no nats). candidate_logprobs, behaviour_logprobs [B, T] (nats); advantages
    [B] (broadcast over tokens) or [B, T]; mask [B, T] bool: the tokens that count (the loss's tokens that have the
    log-prob on both sides). Values at masked positions, NaN included, are never read (selection). An empty mask
    gives 0. Raises ValueError for a level outside MIPU_LEVELS. Reconstructed from the abstract of arXiv:2606.29526."""
    if level not in MIPU_LEVELS:
        raise ValueError(f"unknown MIPU proxy level {level!r}; valid: {', '.join(MIPU_LEVELS)}")
    mask = mask.bool()
    log_r = select(candidate_logprobs.detach().double() - behaviour_logprobs.detach().double(), mask)
    adv = advantages.detach().double()
    adv = select(adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv, mask)
    if level == "token":
        return masked_mean((clamped_exp(log_r) - 1) * adv, mask)
    rows = mask.any(1)
    weight = clamped_exp(log_r.sum(1))  # the sequence log-ratio, clamped to +-20 nats
    mean_adv = masked_sum(adv, mask, dim=1) / mask.sum(1).clamp_min(1)
    return masked_mean((weight - 1) * mean_adv, rows)


def accepts(proxy: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """MIPU's accept rule: a bool scalar tensor, True iff `proxy` (improvement_proxy of the engine's log-probs) is
    finite and at least `margin` (advantage units; 0 accepts a candidate that leaves the engine's policy unchanged on
    the batch, a negative margin tolerates that small a loss). Reconstructed from the abstract of arXiv:2606.29526."""
    return torch.isfinite(proxy) & (proxy >= margin)
