"""On-policy distillation (OPD): per-token reverse KL to a teacher on the student's own samples.

Log-probs [B, T] nats: `student_logprobs` = the student's log-prob of its sampled token (Tinker uses the
engine's, rollout_logprobs; the decoupled choice is old_logprobs), `teacher_logprobs` = the teacher's log-prob
of the same token (detached). The loss is a registered policy loss on the resulting token advantages:
POLICY_LOSSES["importance_sampling"] with old_logprobs := rollout_logprobs is Tinker's (ratio exp(lp - mu)
corrects the engine/trainer mismatch); with old_logprobs = pi_old plus a CorrectionSpec, the decoupled form.
Source: thinking-machines-lab/tinker-cookbook distillation/train_on_policy.py; docs/math.md sec. 15.
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
