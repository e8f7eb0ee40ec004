"""The sampling transform, trainer side. The engines implement the same definition in numpy
(`engines/sampling.py`); the contract tests hold the two together (invariant 1).

Transform of raw logits z [..., V] with temperature T, top-k k and top-p p:
    s = z / T
    keep_k = s >= k-th largest s                     (all kept when k == 0 or k >= V)
    keep_p = exclusive cumulative prob (sorted desc, over the top-k renormalised distribution) < p
    log pi(y) = log_softmax(s masked to the kept set)[y]       (-inf outside the kept set)

The trainer scores tokens an engine already sampled: `token_logprobs_and_entropy` always counts the sampled
token as kept, since the engine's and the trainer's numerics can disagree at the top-k / top-p boundary and a
log-prob of -inf would turn the PPO ratio into NaN (-inf - -inf).
"""

from __future__ import annotations

import torch

from nearpolicy.ops.fused_logprobs import fused_logprobs_and_entropy


def keeps_every_token(top_k: int, top_p: float, vocab: int) -> bool:
    """True when top-k and top-p are both disabled for a vocabulary of `vocab` tokens (no kept set)."""
    return (top_k <= 0 or top_k >= vocab) and top_p >= 1.0


def kept_set(scaled_logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """Bool mask [..., V] of the tokens top-k / top-p keep; None when both are disabled. No grad."""
    vocab = scaled_logits.shape[-1]
    if keeps_every_token(top_k, top_p, vocab):
        return None
    with torch.no_grad():
        keep = torch.ones_like(scaled_logits, dtype=torch.bool)
        if 0 < top_k < vocab:
            kth = torch.topk(scaled_logits, top_k, dim=-1).values[..., -1:]
            keep = scaled_logits >= kth
        if top_p < 1.0:
            masked = scaled_logits.masked_fill(~keep, float("-inf"))
            probs = torch.softmax(masked, dim=-1)
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            exclusive = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            keep_sorted = exclusive < top_p
            keep_p = torch.zeros_like(keep).scatter(-1, order, keep_sorted)
            keep = keep & keep_p
    return keep


def transformed_log_softmax(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                            always_keep: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax of the transformed logits. logits [..., V] float -> [..., V] (same dtype), nats.
    `always_keep` [...] int64: a token id per row that stays in the kept set (the sampled one).

    Gradient flows through the values; the kept set is chosen without grad."""
    scaled = logits / temperature
    keep = kept_set(scaled, top_k, top_p)
    if keep is not None:
        if always_keep is not None:
            keep = keep.scatter(-1, always_keep.unsqueeze(-1), True)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `token_ids` and entropy of the sampling distribution (over the kept set).

    logits [B, T, V] float32, token_ids [B, T] int64 -> (logprobs [B, T] with grad, entropy [B, T], nats). The
    entropy is detached unless `entropy_grad` (the entropy bonus, config algorithm.entropy_coef, needs its grad).
    Without top-k / top-p it runs ops/fused_logprobs.py (same values, fewer vocabulary-wide passes).
    """
    if keeps_every_token(top_k, top_p, logits.shape[-1]):
        return fused_logprobs_and_entropy(logits, token_ids, temperature, entropy_grad)
    logp = transformed_log_softmax(logits, temperature, top_k, top_p, always_keep=token_ids)
    picked = torch.gather(logp, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = logp.exp()
        # 0 * log 0 = 0 outside the kept set; masking logp itself (not the product) keeps the gradient finite there
        entropy = -(probs * logp.masked_fill(probs == 0, 0.0)).sum(-1)
    return picked, entropy
