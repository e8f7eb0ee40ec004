"""Rollouts -> padded tensors for the trainer. Token ids go through verbatim (invariant 3).

Layout per sequence i: input_ids = prompt_ids + completion_ids, right-padded to L. Response tensors are
[B, T] with T = the longest completion; completion token t of sequence i sits at input position
len(prompt_i) + t and is predicted by the logits at position len(prompt_i) + t - 1.

`prompt_group` [B] names the rows whose prompt ids are identical (a GRPO group's): policy.sequence_logprobs then
runs each such prompt once and lets the group's completions attend to it (the shared-prompt path); `forward_tokens`
counts the tokens either path computes.

Multi-turn episodes (rollouts/episodes.py): a completion holds the model's turns and the environment's inserted
tokens (tool results and their template framing, Rollout.model_mask False) in order. They all sit in input_ids
and attention_mask, so the model's later turns attend to them and both paths stay exact; `mask` holds only the
model's tokens (the policy loss, its denominators and every mismatch metric read it), `observation_mask` only the
inserted ones, `turn_index` the turn of each token."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nearpolicy.types import Rollout


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, L] int64
    logit_positions: torch.Tensor  # [B, T] int64: position whose logits predict completion token t
    completion_ids: torch.Tensor  # [B, T] int64 (pad_id at padding)
    mask: torch.Tensor  # [B, T] bool: valid response token (within the generated length) sampled by the model
    rollout_logprobs: torch.Tensor  # [B, T] float32, NaN where missing or padding
    has_rollout: torch.Tensor  # [B, T] bool: the engine reported a log-prob for this token
    versions: torch.Tensor  # [B, T] int64, -1 at padding
    prompt_group: torch.Tensor | None = None  # [B] int64: equal = identical prompt ids; None = no prompt sharing
    observation_mask: torch.Tensor | None = None  # [B, T] bool: valid token inserted by the environment (collate sets it)
    turn_index: torch.Tensor | None = None  # [B, T] int64: turn of each token, 0 for one turn, -1 at padding

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """[B] int64: prompt tokens of each row."""
        return self.logit_positions[:, 0] + 1

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[B] int64: completion tokens of each row (0 for an empty completion)."""
        return self.attention_mask.sum(1) - self.prompt_lengths

    def select(self, index: slice | torch.Tensor) -> "TokenBatch":
        return TokenBatch(**{name: None if getattr(self, name) is None else getattr(self, name)[index]
                             for name in self.__dataclass_fields__})


def collate(rollouts: list[Rollout], pad_id: int, vocab_size: int, shared_prompt: bool = True) -> TokenBatch:
    """Build a TokenBatch; with `shared_prompt`, its prompt_group numbers the distinct prompts in order of first
    appearance (else None: every row runs its own prompt). mask / observation_mask split each completion by
    Rollout.model_mask (None: all the model's). Raises ValueError for token ids outside [0, vocab_size) or an
    empty list of rollouts."""
    if not rollouts:
        raise ValueError("cannot collate an empty list of rollouts")
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    L, T = max(lengths), max(1, max(len(r.completion_ids) for r in rollouts))
    B = len(rollouts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    completion = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    rollout_lp = torch.full((B, T), math.nan, dtype=torch.float32)
    has_rollout = torch.zeros((B, T), dtype=torch.bool)
    versions = torch.full((B, T), -1, dtype=torch.long)
    observation = torch.zeros((B, T), dtype=torch.bool)
    turns = torch.full((B, T), -1, dtype=torch.long)
    for i, r in enumerate(rollouts):
        ids = list(r.prompt_ids) + list(r.completion_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"rollout of group {r.group_id}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        n_prompt, n = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        positions[i] = torch.arange(T) + n_prompt - 1
        positions[i, n:] = n_prompt - 1  # any in-range position; masked out
        if n:
            completion[i, :n] = torch.tensor(r.completion_ids)
            own = torch.ones(n, dtype=torch.bool) if r.model_mask is None else torch.tensor(r.model_mask, dtype=torch.bool)
            mask[i, :n], observation[i, :n] = own, ~own
            turns[i, :n] = 0 if r.turn_index is None else torch.tensor(r.turn_index)
            known = [lp is not None and math.isfinite(lp) for lp in r.rollout_logprobs]
            rollout_lp[i, :n] = torch.tensor([lp if ok else math.nan for lp, ok in zip(r.rollout_logprobs, known)])
            has_rollout[i, :n] = torch.tensor(known) & own
            versions[i, :n] = torch.tensor(r.versions)
    group = None
    if shared_prompt:
        index: dict[tuple[int, ...], int] = {}
        group = torch.tensor([index.setdefault(tuple(r.prompt_ids), len(index)) for r in rollouts], dtype=torch.long)
    return TokenBatch(input_ids, attention, positions, completion, mask, rollout_lp, has_rollout, versions, group,
                      observation, turns)


def packs_completions(steps: torch.Tensor, n_prompt: int, hidden: int, window: int | None = None) -> bool:
    """Whether a prompt group's completions run packed into one row (model/policy.py: no padding, but every packed token's
    attention spans all N packed tokens) rather than as G rows padded to the longest. steps [G] int64: tokens each
    row runs after the prompt. Picks the cheaper by a per-layer cost of about 12 hidden^2 multiply-adds per token
    (projections, MLP) and 2 hidden per query-key pair (scores, values): tokens x 6 hidden + pairs. Never packed when
    a row reaches past a sliding attention `window` (n_prompt + its steps > window): the packed 4-D mask has no window
    and the sliding layers' cache keeps only the last window - 1 prompt tokens; padded rows get transformers' masks."""
    n, rows, width = int(steps.sum()), len(steps), int(steps.max())
    if window is not None and n_prompt + width > window:
        return False
    return n * (6 * hidden + n_prompt + n) <= rows * width * (6 * hidden + n_prompt + width)


def forward_tokens(batch: TokenBatch, micro: int, hidden: int, pack: bool | None = None) -> tuple[int, int]:
    """(tokens computed, of which padding) when the batch's rows run through a model of width `hidden` in
    micro-batches of `micro` rows: without prompt_group every row is padded to its micro-batch's longest prompt +
    completion; with it each prompt group of a micro-batch runs its prompt once and its completions (all but the
    last token, which predicts nothing) packed (no padding) or padded to the group's longest (`pack`; None: as
    packs_completions picks, for a model without a sliding window). Counts only; the model is not run."""
    computed = padding = 0
    for start in range(0, len(batch), micro):
        part = batch.select(slice(start, start + micro))
        if part.prompt_group is None:
            width = int(part.attention_mask.sum(1).max())
            computed += width * len(part)
            padding += width * len(part) - int(part.attention_mask.sum())
            continue
        for g in torch.unique(part.prompt_group):
            rows = part.prompt_group == g
            n_prompt, steps = int(part.prompt_lengths[rows][0]), (part.completion_lengths[rows] - 1).clamp_min(0)
            packed = packs_completions(steps, n_prompt, hidden) if pack is None else pack
            run = int(steps.sum()) if packed else int(steps.max()) * len(steps)
            computed += n_prompt + run
            padding += run - int(steps.sum())
    return computed, padding
