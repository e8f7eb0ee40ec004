"""Policy losses. Shapes: logprobs, proximal_logprobs, mask, weights [B, T]; advantages [B] (one per sequence)
or [B, T]. Log-probs: `logprobs` = log pi_theta (current, with grad); `proximal_logprobs` = the proximal policy
pi_prox, chosen by ops/proximal.proximal_logprobs (decoupled mode: the trainer at the sampling weights, pi_old, or
the EWMA / A-3PO proximal; bypass mode: the engine's rollout_logprobs); `ref_logprobs` = a frozen reference
policy. PPO ratio r = exp(logprobs - proximal_logprobs), log-ratio clamped to
+-20 nats. `weights` is the detached mismatch correction (ops/corrections.py).

Every registered loss has one signature, (PolicyLossInput, PolicyLossParams) -> TokenLoss: a per-token loss
[B, T] (0 at masked positions, weights applied) plus clip indicators. `policy_loss` aggregates it with one of
the modes of `masked.aggregate`, whose denominator is a global count of the whole gradient-accumulation group,
so splitting into micro-batches leaves the loss unchanged (invariant 7). docs/math.md secs. 3 and 7-8."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nearpolicy.ops.kl import KL_ESTIMATORS, kl_penalty_tokens
from nearpolicy.ops.masked import SAFETY_BOUND, aggregate, clamped_exp, masked_sum, select
from nearpolicy.registry import Registry


@dataclass(frozen=True)
class PolicyLossInput:
    logprobs: torch.Tensor  # [B, T] float32, with grad: log pi_theta
    proximal_logprobs: torch.Tensor  # [B, T] float32, detached: pi_prox (ops/proximal.proximal_logprobs)
    advantages: torch.Tensor  # [B] or [B, T]
    mask: torch.Tensor  # [B, T] bool, True = valid response token
    token_denominator: torch.Tensor | float  # valid tokens in the whole accumulation group (>= 1)
    weights: torch.Tensor | None = None  # [B, T] detached mismatch weight, None = 1
    ref_logprobs: torch.Tensor | None = None  # [B, T] detached reference log-probs for the KL penalty, None = no KL
    entropy: torch.Tensor | None = None  # [B, T] with grad: entropy of the sampling distribution (entropy bonus)


@dataclass(frozen=True)
class PolicyLossParams:
    """Plain scalars of the policy losses. clip_low / clip_high: ratio clip [1 - clip_low, 1 + clip_high]
    (DAPO clip-higher when they differ); dual_clip: c > 1 or None (PPO only); gspo_log_ratio_max: upper clamp
    of GSPO's token log-ratio (verl: 10); kl_coef, kl_estimator: KL-to-reference penalty (a name of
    ops/kl.KL_ESTIMATORS; default k3_is, whose expected gradient is grad KL(pi || pi_ref) on- and off-policy);
    entropy_coef: weight of the entropy bonus (the loss subtracts entropy_coef x the token entropy, PPO
    arXiv:1707.06347 eq. 9's c2 S term, aggregated like the policy loss; needs PolicyLossInput.entropy)."""

    clip_low: float = 0.2  # these defaults are config algorithm.*'s (one source)
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    gspo_log_ratio_max: float = 10.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3_is"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS.names():
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS.names())}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")


@dataclass(frozen=True)
class TokenLoss:
    """loss [B, T] (with grad, 0 at masked positions, mismatch weights applied); clipped, clipped_lower [B, T]
    bool (token's ratio clipped by the trust region / by the dual clip); log_ratio [B, T] detached lp - prox."""

    loss: torch.Tensor
    clipped: torch.Tensor
    clipped_lower: torch.Tensor
    log_ratio: torch.Tensor


PolicyLossFn = Callable[[PolicyLossInput, PolicyLossParams], TokenLoss]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

# Sequence-level objectives weigh each sequence equally whatever its length (invariant 14), so they are only
# defined with seq-mean-token-mean; any other mode weighs a sequence by its token count (TRL #3823).
SEQUENCE_LEVEL_LOSSES = frozenset({"gspo"})
# Losses whose per-token value is A x (a finite function of the row's own log-probs), times detached weights: a row
# whose advantage is 0 at every loss token adds exactly 0 to the gradient (the KL and entropy terms of policy_loss
# aside). training/update.py runs such rows forward only (tests/test_inert_rows.py checks the property for each).
ADVANTAGE_PROPORTIONAL_LOSSES = frozenset({"ppo_clip", "gspo", "cispo", "reinforce", "importance_sampling", "pnpo",
                                           "pnpo_prefix_grad"})


def required_aggregation(loss: str) -> str | None:
    """The aggregation mode a loss is defined with ("seq-mean-token-mean" for a sequence-level loss), or None
    when any mode is valid."""
    return "seq-mean-token-mean" if loss in SEQUENCE_LEVEL_LOSSES else None


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def _prepare(inp: PolicyLossInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask bool, logprobs, prox, advantages), all selected so masked positions hold 0."""
    mask = inp.mask.bool()
    logprobs = select(inp.logprobs, mask)
    prox = select(inp.proximal_logprobs.detach(), mask)
    adv = select(_broadcast_advantages(inp.advantages, logprobs).detach().to(logprobs.dtype), mask)
    return mask, logprobs, prox, adv


def _finish(inp: PolicyLossInput, mask: torch.Tensor, loss_tok: torch.Tensor, clipped: torch.Tensor,
            lower: torch.Tensor, log_ratio: torch.Tensor) -> TokenLoss:
    if inp.weights is not None:
        loss_tok = loss_tok * select(inp.weights.detach().to(loss_tok.dtype), mask, fill=1.0)
    return TokenLoss(select(loss_tok, mask), clipped & mask, lower & mask, select(log_ratio.detach(), mask))


@POLICY_LOSSES.register("ppo_clip", summary="PPO clip, clip-higher (eps_low / eps_high) and dual clip for A < 0",
                        source="arXiv:1707.06347 eq. 7; dual clip arXiv:1912.09729 eq. 5; DAPO arXiv:2503.14476")
def ppo_clip_tokens(inp: PolicyLossInput, params: PolicyLossParams) -> TokenLoss:
    """L_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); for A < 0 also min(L_t, -A c); L_t *= w_t."""
    mask, logprobs, prox, adv = _prepare(inp)
    log_ratio = logprobs - prox
    ratio = clamped_exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    loss_tok = torch.maximum(unclipped, clipped)
    lower_clipped = torch.zeros_like(mask)
    if params.dual_clip is not None:
        dual = -adv * params.dual_clip
        lower_clipped = (adv < 0) & (loss_tok > dual)
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, dual), loss_tok)
    return _finish(inp, mask, loss_tok, clipped > unclipped, lower_clipped, log_ratio)


@POLICY_LOSSES.register("gspo", summary="sequence geometric-mean ratio, token form; sequence-level: only with "
                        "seq-mean-token-mean",
                        source="GSPO arXiv:2507.18071 (GSPO-token form); verl compute_policy_loss_gspo")
def gspo_tokens(inp: PolicyLossInput, params: PolicyLossParams) -> TokenLoss:
    """log s_it = sg(mean_t m (lp - prox)) + lp_t - sg(lp_t), clamped to [-20, gspo_log_ratio_max];
    L_t = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)) * w_t. Value s_it = s_i (the sequence's
    geometric-mean ratio); its gradient is s_i * grad lp_t, so seq-mean-token-mean gives GSPO's gradient."""
    mask, logprobs, prox, adv = _prepare(inp)
    n = mask.sum(-1, keepdim=True).clamp_min(1).to(logprobs.dtype)
    log_seq = (masked_sum(logprobs - prox, mask, dim=-1).unsqueeze(-1) / n).detach()
    log_tok = (log_seq + logprobs - logprobs.detach()).clamp(-SAFETY_BOUND, params.gspo_log_ratio_max)
    ratio = torch.exp(log_tok)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    loss_tok = torch.maximum(unclipped, clipped)
    return _finish(inp, mask, loss_tok, clipped > unclipped, torch.zeros_like(mask), log_seq.expand_as(logprobs))


@POLICY_LOSSES.register("cispo", summary="-sg(clip(r, 1 - eps_low, 1 + eps_high)) A logprobs: clip the IS weight",
                        source="CISPO, MiniMax-M1 arXiv:2506.13585; verl/TRL cispo loss")
def cispo_tokens(inp: PolicyLossInput, params: PolicyLossParams) -> TokenLoss:
    """L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * lp_t * w_t; every token keeps a gradient."""
    mask, logprobs, prox, adv = _prepare(inp)
    log_ratio = logprobs - prox
    ratio = clamped_exp(log_ratio).detach()
    kept = ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    loss_tok = -kept * adv * logprobs
    return _finish(inp, mask, loss_tok, kept != ratio, torch.zeros_like(mask), log_ratio)


@POLICY_LOSSES.register("reinforce", summary="-A w logprobs (policy gradient, no ratio); bypass + IS weights",
                        source="Williams 1992; verl rollout-correction bypass loss_type=reinforce")
def reinforce_tokens(inp: PolicyLossInput, params: PolicyLossParams) -> TokenLoss:
    """L_t = -A_t * lp_t * w_t (proximal_logprobs only feed the ppo_kl metric)."""
    del params
    mask, logprobs, prox, adv = _prepare(inp)
    zeros = torch.zeros_like(mask)
    return _finish(inp, mask, -adv * logprobs, zeros, zeros, logprobs - prox)


@POLICY_LOSSES.register("importance_sampling", summary="-exp(lp - prox) A w, unclipped (Tinker's IS loss; OPD)",
                        source="tinker-cookbook importance_sampling loss (docs/math.md sec. 15)")
def importance_sampling_tokens(inp: PolicyLossInput, params: PolicyLossParams) -> TokenLoss:
    """L_t = -exp(clamp(lp_t - old_t, +-20)) * A_t * w_t."""
    del params
    mask, logprobs, prox, adv = _prepare(inp)
    zeros = torch.zeros_like(mask)
    return _finish(inp, mask, -clamped_exp(logprobs - prox) * adv, zeros, zeros, logprobs - prox)


def _pnpo(inp: PolicyLossInput, params: PolicyLossParams, prefix_grad: bool) -> TokenLoss:
    mask, logprobs, prox, adv = _prepare(inp)
    count = torch.cumsum(mask.to(logprobs.dtype), -1).clamp_min(1)
    log_prefix = torch.cumsum(logprobs - prox, -1) / count
    if not prefix_grad:
        log_prefix = log_prefix.detach() + logprobs - logprobs.detach()
    ratio = clamped_exp(log_prefix)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    loss_tok = torch.maximum(unclipped, clipped)
    return _finish(inp, mask, loss_tok, clipped > unclipped, torch.zeros_like(mask), log_prefix)


@POLICY_LOSSES.register("pnpo", summary="PPO clip on the prefix geometric-mean ratio, token-form gradient (reconstruction)",
                        source="reconstructed from the abstract of arXiv:2608.01418 (docs/math.md sec. 11)")
def pnpo_tokens(inp: PolicyLossInput, params: PolicyLossParams) -> TokenLoss:
    """log rb_t = sg(sum_{i<=t} m_i (lp_i - old_i) / sum_{i<=t} m_i) + lp_t - sg(lp_t) (value: the prefix
    geometric-mean ratio; gradient rb_t grad lp_t, as GSPO-token, so on-policy it is the plain policy gradient);
    L_t = max(-A rb_t, -A clip(rb_t, 1 - eps_low, 1 + eps_high)) * w_t."""
    return _pnpo(inp, params, prefix_grad=False)


@POLICY_LOSSES.register("pnpo_prefix_grad", summary="pnpo with the gradient through every token of the prefix (variant)",
                        source="reconstructed from the abstract of arXiv:2608.01418 (docs/math.md sec. 11)")
def pnpo_prefix_grad_tokens(inp: PolicyLossInput, params: PolicyLossParams) -> TokenLoss:
    """As pnpo without the stop-gradient: d rb_t / d lp_i = rb_t / #{valid j <= t} for every valid i <= t, so an
    early token collects gradient from every later position."""
    return _pnpo(inp, params, prefix_grad=True)




def policy_loss(
    name: str, inp: PolicyLossInput, params: PolicyLossParams, mode: str = "token-mean",
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Registered loss `name`, plus kl_coef * KL(pi_theta || pi_ref) when inp.ref_logprobs is given and
    kl_coef > 0 (estimator params.kl_estimator of ops/kl.py, its importance ratio taken against
    inp.proximal_logprobs; not multiplied by the mismatch weights), minus entropy_coef * inp.entropy when
    entropy_coef > 0 (ValueError when inp.entropy is None then), aggregated by `mode` over the global `denominator`
    (default inp.token_denominator, allowed for token-mean only; pass `masked.aggregation_denominator` of the
    whole accumulation group for the other modes). Returns (loss scalar with grad, detached metrics normalised by
    inp.token_denominator, so that summing them over micro-batches gives the accumulation-group mean; entropy_bonus
    is the term the loss subtracts, aggregated by `mode` over the same denominator, so it sums likewise).
    Raises KeyError for an unknown loss or KL estimator, ValueError for an unknown mode, a missing denominator,
    or a sequence-level loss (SEQUENCE_LEVEL_LOSSES) with a mode other than seq-mean-token-mean."""
    if denominator is None and mode != "token-mean":
        raise ValueError(f"aggregation {mode!r} needs an explicit global denominator (see aggregation_denominator)")
    required = required_aggregation(name)
    if required is not None and mode != required:
        raise ValueError(f"loss {name!r} is sequence-level: aggregation {mode!r} would weigh each sequence by its "
                         f"length; use {required!r}")
    mask = inp.mask.bool()
    out = POLICY_LOSSES.get(name)(inp, params)
    loss_tok = out.loss
    kl = None
    if inp.ref_logprobs is not None and params.kl_coef > 0:
        kl = kl_penalty_tokens(inp.logprobs, inp.ref_logprobs, mask, params.kl_estimator, inp.proximal_logprobs)
        loss_tok = loss_tok + params.kl_coef * kl
    if params.entropy_coef > 0:
        if inp.entropy is None:
            raise ValueError("entropy_coef > 0 needs the token entropy with grad (PolicyLossInput.entropy)")
        loss_tok = loss_tok - params.entropy_coef * torch.where(mask, inp.entropy, torch.zeros_like(inp.entropy))
    denominator = inp.token_denominator if denominator is None else denominator
    loss = aggregate(loss_tok, mask, mode, denominator)
    tok = torch.as_tensor(inp.token_denominator, dtype=loss_tok.dtype).clamp_min(1)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_sum(out.clipped.to(loss_tok.dtype), mask) / tok,
            "pg_clipfrac_lower": masked_sum(out.clipped_lower.to(loss_tok.dtype), mask) / tok,
            "ppo_kl": masked_sum(-out.log_ratio, mask) / tok,
        }
        if kl is not None:
            metrics["kl_ref"] = masked_sum(kl.detach(), mask) / tok
        if params.entropy_coef > 0:
            metrics["entropy_bonus"] = params.entropy_coef * aggregate(inp.entropy.detach(), mask, mode, denominator)
    return loss, metrics
