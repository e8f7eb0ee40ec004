"""Trainer-side log-probs of sampled tokens (fp32, token-in/token-out)."""

from __future__ import annotations

import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.ops.logprobs import token_logprobs_and_entropy
from nearpolicy.types import SamplingParams


def sequence_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] (nats, grad if enabled) of the completion ids under the sampling transform, and the
    entropy [B, T] of that distribution (detached). Padding positions hold finite junk: mask them."""
    # Run the LM head only where a completion token is predicted: prompt positions need no logits.
    hidden = model.base_model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state  # [B, L, H]
    index = batch.logit_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    picked = model.get_output_embeddings()(torch.gather(hidden, 1, index)).float()  # [B, T, V]
    return token_logprobs_and_entropy(
        picked, batch.completion_ids, sampling.temperature, sampling.top_k, sampling.top_p
    )


@torch.no_grad()
def recompute_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] and entropy [B, T] (float32, no grad) of the batch's completion ids under `model`'s
    current weights, in micro-batches of `micro` rows (old_logprobs when `model` holds the sampling weights)."""
    parts = [sequence_logprobs(model, batch.select(slice(i, i + micro)), sampling) for i in range(0, len(batch), micro)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
