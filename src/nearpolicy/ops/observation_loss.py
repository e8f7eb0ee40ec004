"""ECHO's observation loss: an auxiliary cross-entropy on the environment's observation tokens (tool results and
the template tokens framing them), computed from the same forward pass as the policy loss.

    total loss = policy loss (model tokens, advantages) + coef x observation_loss(raw_logprobs, observation_mask)

coef = config algorithm.observation_loss_coef (0 = off, the default). Source: ECHO, "Terminal Agents Learn World
Models for Free", arXiv:2605.24517: L = L_GRPO(actions) + lambda L_Env(observations), L_Env a length-normalised
cross-entropy on the environment's tokens, same actor forward pass.

The log-probs must be the model's raw distribution, log softmax(logits) at temperature 1 with no top-k / top-p
(`raw_logprobs`, or policy.sequence_logprobs under SamplingParams(1.0, 1.0, 0)): the sampling transform is how the
engine drew the model's tokens, not a distribution the environment's tokens came from, and it would put -inf on an
observation token outside the kept set.
"""

from __future__ import annotations

import torch

from nearpolicy.ops.masked import masked_sum


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token_ids]: logits [..., V] float (untransformed), token_ids [...] int64 ->
    [...] float32 nats, with grad."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, token_ids.unsqueeze(-1)).squeeze(-1)


def observation_loss(logprobs: torch.Tensor, observation_mask: torch.Tensor,
                     denominator: torch.Tensor | float | None = None) -> torch.Tensor:
    """Token-mean cross-entropy -sum_{obs} log p / #obs over the observation tokens (scalar, nats, with grad).

    logprobs [B, T] float: raw log-probs (module docstring) of the completion ids; observation_mask [B, T] bool:
    the environment's tokens (never the model's own, never padding). Masked positions are never read (selection,
    not product: NaN or inf there changes neither the value nor the gradient). `denominator` replaces #obs by a
    count over the whole gradient-accumulation group, so micro-batch sums equal the full-batch loss (invariant 7);
    None: this batch's #obs. No observation token (or a zero denominator) gives 0 whose gradient is 0, never NaN.
    Raises ValueError when the shapes differ or the mask is not bool."""
    if logprobs.shape != observation_mask.shape or observation_mask.dtype != torch.bool:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and observation_mask {tuple(observation_mask.shape)} "
                         f"{observation_mask.dtype} must have one shape [B, T], the mask bool")
    count = observation_mask.sum() if denominator is None else denominator
    count = torch.as_tensor(count, dtype=logprobs.dtype, device=logprobs.device).clamp_min(1)
    return -masked_sum(logprobs, observation_mask) / count
