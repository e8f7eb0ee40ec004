"""On-policy distillation (OPD): per-token reverse KL to a teacher on the student's own samples (the default), or
the forward KL KL(teacher || student) at the same positions (distill.divergence = "forward").

Reverse KL. Log-probs [B, T] nats: `student_logprobs` = the student's log-prob of its sampled token (Tinker uses the
engine's, rollout_logprobs; the decoupled choice is old_logprobs), `teacher_logprobs` = the teacher's log-prob
of the same token (detached). The loss is a registered policy loss on the resulting token advantages:
POLICY_LOSSES["importance_sampling"] with old_logprobs := rollout_logprobs is Tinker's (ratio exp(lp - mu)
corrects the engine/trainer mismatch); with old_logprobs = pi_old plus a CorrectionSpec, the decoupled form.
Source: thinking-machines-lab/tinker-cookbook distillation/train_on_policy.py; docs/math.md sec. 15.

Forward KL. At each valid position t the teacher's whole next-token distribution p_T is the target:
fkl_t = sum_v p_T(v) (log p_T(v) - log p_S(v)), both under log_softmax(logits / temperature), teacher detached, so
d fkl_t / d z_S = (p_S - p_T) / temperature (a supervised, cross-entropy-like term on the student's prefixes; it needs
no importance ratio for the token). `forward_kl_tokens` is exact and needs the teacher's logits [.., V];
`forward_kl_top_k_tokens` takes only the teacher's top-k log-probs and ids (what an engine teacher returns),
renormalised over those k: an approximation, equal to the exact form at k = V. Source: "On-Policy or Off-Policy
Learning? A Systematic Study of Distillation Dynamics" (forward KL is robust to the rollout policy, reverse KL is
not; the formula is the textbook KL, the paper's exact estimator is not reproduced here); docs/math.md sec. 15.
"""

from __future__ import annotations

import torch

from nearpolicy.ops.masked import masked_sum, select


def reverse_kl_tokens(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rkl_t = student - teacher at valid tokens, 0 elsewhere ([B, T], detached): a one-sample k1 estimate of
    KL(student || teacher) per token."""
    mask = mask.bool()
    return (select(student_logprobs.detach(), mask) - select(teacher_logprobs.detach(), mask)).detach()


def opd_advantages(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, coef: float = 1.0,
    discount: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token advantages [B, T] (dtype of the log-probs, detached) and the metric teacher_kl = sum rkl / #valid.

    A_t = sum_{k >= t, valid} discount^(n(t, k)) (-coef rkl_k) at valid t (0 elsewhere), n(t, k) = the valid
    positions in (t, k]: the return takes one discount step per valid token, and carries through the positions
    between unchanged (a multi-turn episode's tool observations and template tokens, tokens without an engine
    log-prob), so inserting an observation leaves the model tokens' advantages unchanged (verl #7278, fix #7300).
    discount 0: A_t = -coef rkl_t. mask [B, T] bool: the tokens with both log-probs (the model's own tokens).
    Raises ValueError unless 0 <= discount <= 1. Defaults coef 1.0, discount 0.0 (Tinker). docs/math.md sec. 15."""
    if not 0 <= discount <= 1:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    mask = mask.bool()
    reward = -coef * reverse_kl_tokens(student_logprobs, teacher_logprobs, mask)
    if discount == 0:
        adv = reward
    else:
        carry, steps = torch.zeros_like(reward[:, -1]), []
        for t in range(reward.shape[1] - 1, -1, -1):
            carry = torch.where(mask[:, t], reward[:, t] + discount * carry, carry)
            steps.append(carry)
        adv = torch.stack(steps[::-1], dim=1)
    kl = reverse_kl_tokens(student_logprobs, teacher_logprobs, mask)
    return select(adv, mask), {"teacher_kl": masked_sum(kl, mask) / mask.sum().clamp_min(1)}


def forward_kl_tokens(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """Exact forward KL per position: KL(p_T || p_S) = sum_v p_T(v) (log p_T(v) - log p_S(v)), nats.

    student_logits [..., V] float (with grad), teacher_logits [..., V] (detached here), mask [...] bool; p = softmax
    (logits / temperature). Returns [...] in the student's dtype: the KL at masked positions, 0 elsewhere, where
    nothing is computed (the logits are selected first, so NaN / inf there reach neither value nor gradient).
    Gradient wrt the student logits: (p_S - p_T) / temperature. Raises ValueError for a temperature <= 0 or
    mismatched vocabularies. docs/math.md sec. 15."""
    _check(student_logits, teacher_logits.shape[-1], temperature)
    mask = mask.bool()
    log_s = torch.log_softmax(student_logits[mask] / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits[mask].detach().to(log_s.dtype) / temperature, dim=-1)
    return _scatter(_cross_term(log_t, log_s), mask, student_logits.dtype)


def teacher_top_k(teacher_logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's min(k, V) most likely tokens at each position: (log-probs [..., k] under log_softmax(logits /
    temperature), nats, detached; ids [..., k] int64), largest first: what an engine teacher that returns top-k
    log-probs reports. Raises ValueError for k < 1 or a temperature <= 0."""
    if k < 1 or temperature <= 0:
        raise ValueError(f"need k >= 1 and temperature > 0, got k = {k}, temperature = {temperature}")
    logp = torch.log_softmax(teacher_logits.detach() / temperature, dim=-1)
    return torch.topk(logp, min(k, logp.shape[-1]), dim=-1)


def forward_kl_top_k_tokens(student_logits: torch.Tensor, teacher_top_logprobs: torch.Tensor,
                            teacher_top_ids: torch.Tensor, mask: torch.Tensor,
                            temperature: float = 1.0) -> torch.Tensor:
    """Top-k forward KL per position (an approximation): sum_{v in K} q(v) (log q(v) - log p_S(v)), q = the teacher's
    top-k renormalised over K (q(v) = exp(l_v - logsumexp_K l)), log p_S the student's full-vocabulary log-prob.
    Equals forward_kl_tokens when K is the whole vocabulary; the mass the teacher puts outside K is dropped.

    student_logits [..., V] float (with grad); teacher_top_logprobs [..., k] (any normalisation: only differences
    within a position matter, detached), teacher_top_ids [..., k] int64; mask [...] bool. Returns [...] in the
    student's dtype, 0 (never computed) at masked positions. Gradient wrt the student logits: (p_S - q) / temperature
    with q extended by 0 outside K. Raises ValueError for a temperature <= 0 or mismatched shapes."""
    _check(student_logits, student_logits.shape[-1], temperature)
    if teacher_top_logprobs.shape != teacher_top_ids.shape or teacher_top_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"teacher top-k shapes {tuple(teacher_top_logprobs.shape)}, {tuple(teacher_top_ids.shape)} "
                         f"do not fit the student logits {tuple(student_logits.shape)}")
    mask = mask.bool()
    log_s = torch.log_softmax(student_logits[mask] / temperature, dim=-1)
    top = teacher_top_logprobs[mask].detach().to(log_s.dtype)
    log_q = top - torch.logsumexp(top, dim=-1, keepdim=True)
    return _scatter(_cross_term(log_q, torch.gather(log_s, -1, teacher_top_ids[mask])), mask, student_logits.dtype)


def _cross_term(log_t: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of p_T (log p_T - log p_S), a p_T = 0 entry counting 0 (selection, not 0 * -inf)."""
    p_t = log_t.exp()
    return torch.where(p_t > 0, p_t * (log_t - log_s), torch.zeros_like(log_s)).sum(-1)


def _scatter(values: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [n] at the True positions of mask [...], 0 elsewhere (differentiable)."""
    return torch.zeros(mask.shape, dtype=dtype, device=values.device).masked_scatter(mask, values.to(dtype))


def _check(student_logits: torch.Tensor, teacher_vocab: int, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape[-1] != teacher_vocab:
        raise ValueError(f"the student's vocabulary ({student_logits.shape[-1]}) differs from the teacher's "
                         f"({teacher_vocab})")
