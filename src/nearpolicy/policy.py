"""Trainer-side log-probs of sampled tokens (fp32, token-in/token-out).

Two ways to run a TokenBatch through the model, equal to float32 rounding:
- padded: every row runs its prompt + completion, right-padded to the batch's longest row;
- shared prompt (the batch has a prompt_group): per group of rows with identical prompt ids, the prompt runs once
  ([1, P], its key/values kept with their graph), the cache is repeated to the group's G rows, and the completions
  ([G, R - 1]: the last token predicts nothing) run at positions P..P+R-2 attending to that one prefix. Causal
  attention makes the prompt's hidden states the same in every row, so this is exact, and the gradient of all G
  completions flows back through the one prefix. Source: "Shared-Prompt Flash Attention for Efficient RL Training
  with Large Rollouts and Long Contexts" (DualKV): N(P+R) tokens repacked into P + NR.
"""

from __future__ import annotations

import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.ops.logprobs import token_logprobs_and_entropy
from nearpolicy.types import SamplingParams


def sequence_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] (nats, grad if enabled) of the completion ids under the sampling transform, and the
    entropy [B, T] of that distribution (detached). Padding positions hold finite junk (the same on both paths:
    the logits at the prompt's last position): mask them. Runs the shared-prompt path when batch.prompt_group is
    set (module docstring), else the padded path."""
    hidden = _padded_hidden(model, batch) if batch.prompt_group is None else _shared_hidden(model, batch)
    # The LM head runs only where a completion token is predicted: prompt positions need no logits.
    picked = model.get_output_embeddings()(hidden).float()  # [B, T, V]
    return token_logprobs_and_entropy(
        picked, batch.completion_ids, sampling.temperature, sampling.top_k, sampling.top_p
    )


def _padded_hidden(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Final hidden states [B, T, H] at batch.logit_positions, every row run in full (right-padded)."""
    hidden = model.base_model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state  # [B, L, H]
    index = batch.logit_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


def _shared_hidden(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Final hidden states [B, T, H] at batch.logit_positions, each prompt group's prompt run once."""
    parts, order = [], []
    for group in torch.unique(batch.prompt_group):
        rows = (batch.prompt_group == group).nonzero().squeeze(1)
        parts.append(_group_hidden(model, batch, rows))
        order.append(rows)
    return torch.cat(parts)[torch.argsort(torch.cat(order))]


def _group_hidden(model: torch.nn.Module, batch: TokenBatch, rows: torch.Tensor) -> torch.Tensor:
    """Hidden states [G, T, H] of one prompt group's rows (identical prompts of P tokens): the prompt [1, P] once,
    then the completions [G, R - 1] on its repeated, not detached, key/value cache."""
    from transformers import DynamicCache

    n_prompt, lengths = int(batch.prompt_lengths[rows[0]]), batch.completion_lengths[rows]
    steps, width = int(lengths.max()) - 1, batch.completion_ids.shape[1]
    cache = DynamicCache(config=model.config)
    prefix = model.base_model(input_ids=batch.input_ids[rows[:1], :n_prompt], cache=cache, use_cache=True)
    hidden = prefix.last_hidden_state[:, -1:].expand(len(rows), 1, -1)  # [G, 1, H]: predicts completion token 0
    if steps > 0:
        cache.batch_repeat_interleave(len(rows))
        attention = torch.cat([torch.ones((len(rows), n_prompt), dtype=torch.long),
                               batch.attention_mask[rows, n_prompt:n_prompt + steps]], dim=1)
        positions = torch.arange(n_prompt, n_prompt + steps).expand(len(rows), -1)
        out = model.base_model(input_ids=batch.completion_ids[rows, :steps], attention_mask=attention,
                               position_ids=positions, cache=cache, use_cache=True)
        hidden = torch.cat([hidden, out.last_hidden_state], dim=1)  # [G, R, H]
    t = torch.arange(width)
    index = torch.where(t < lengths[:, None], t, 0).clamp_max(hidden.shape[1] - 1)  # padding: the prompt's last
    return torch.gather(hidden, 1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


@torch.no_grad()
def recompute_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] and entropy [B, T] (float32, no grad) of the batch's completion ids under `model`'s
    current weights, in micro-batches of `micro` rows (old_logprobs when `model` holds the sampling weights)."""
    parts = [sequence_logprobs(model, batch.select(slice(i, i + micro)), sampling) for i in range(0, len(batch), micro)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
