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
