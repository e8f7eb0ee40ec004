"""Log-prob of the sampled token and entropy of softmax(z / T) in one autograd node, for the common case of no
top-k / top-p (every token kept).

The unfused graph, log_softmax -> gather (+ exp, masked_fill, mul, sum for the entropy), makes about a dozen passes
over the [n, V] logits and allocates several [n, V] buffers, the gather's backward a zero-filled one: with
SmolLM2's V = 49152 these vocabulary-wide passes, not the LM head's matmul, were a visible share of an update.
Here the forward keeps only per-row scalars and the backward rebuilds the softmax once from the saved logits:

    s = z / T,  lse = logsumexp(s),  log p = s - lse
    log pi(y) = log p_y                     d/ds_j = [j = y] - p_j
    H = -sum_j p_j log p_j                  d/ds_j = -p_j (s_j - E[s]) = -p_j (log p_j + H)
    d/dz = (d/ds) / T

Equal to ops/logprobs.py's unfused path to float32 rounding (tests/test_fused_logprobs.py, values and gradients).
"""

from __future__ import annotations

import torch


# log p below this has p = exp(log p) = 0 exactly in float32 and float64: flooring there changes no value, and keeps
# 0 * log 0 (a -inf logit) at 0 instead of NaN, as the unfused path's masked_fill did
LOGP_FLOOR = -1e4


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor, temperature: float):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not a tensor of zeros
        scaled = logits / temperature if temperature != 1.0 else logits
        lse = torch.logsumexp(scaled, dim=-1)  # [n]
        logp = scaled - lse.unsqueeze(-1)  # [n, V], freed after the forward
        picked = logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
        logp.clamp_min_(LOGP_FLOOR)
        # -sum p log p, not lse - E[s]: the two terms of the latter are large and cancel
        entropy = -torch.linalg.vecdot(torch.exp(logp), logp)
        ctx.save_for_backward(logits, token_ids, lse, entropy)
        ctx.temperature = temperature
        return picked, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_picked: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        if grad_picked is None and grad_entropy is None:
            return None, None, None
        logits, token_ids, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        # a new [n, V] buffer: it becomes the gradient
        logp = (logits / temperature).sub_(lse.unsqueeze(-1)).clamp_min_(LOGP_FLOOR)
        # d/ds_j = p_j c_j + gL [j = y], with c_j = -gL - gH (log p_j + H)   (s_j - E[s] = log p_j + H)
        if grad_entropy is not None:
            coef = (logp + entropy.unsqueeze(-1)).mul_(-grad_entropy.unsqueeze(-1))
            if grad_picked is not None:
                coef.sub_(grad_picked.unsqueeze(-1))
        else:
            coef = -grad_picked.unsqueeze(-1)
        grad = logp.exp_().mul_(coef)
        if grad_picked is not None:
            grad.scatter_add_(-1, token_ids.unsqueeze(-1), grad_picked.unsqueeze(-1))
        return grad.div_(temperature), None, None


def fused_logprobs_and_entropy(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float,
                               entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(z / T)[y] and the entropy of softmax(z / T), every token kept (no top-k / top-p).

    logits [..., V] float32, token_ids [...] int64, temperature > 0 -> (logprobs [...] with grad, entropy [...]),
    nats. The entropy is detached unless `entropy_grad`. Raises ValueError on a non-positive temperature or
    mismatched shapes."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    picked, entropy = _LogprobEntropy.apply(logits.reshape(-1, vocab), token_ids.reshape(-1), float(temperature))
    if not (entropy_grad and torch.is_grad_enabled()):
        entropy = entropy.detach()
    return picked.reshape(lead), entropy.reshape(lead)
