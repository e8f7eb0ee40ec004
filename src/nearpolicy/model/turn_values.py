"""The model side of TRACE's turn credit (ops/turn_credit.py "trace"): a frozen reference model's log-prob of the
gold answer at every tool-call boundary of each episode.

Boundaries of an episode (one TokenBatch row: prompt ids + completion ids, the completion holding the model's turns
and the observation tokens between them): k = 0 is the end of the prompt (start of the episode); k >= 1 is the end
of the k-th maximal run of observation tokens in the completion (after a tool result and the template tokens framing
it, i.e. where the model would write its next turn). For each boundary the row "prefix up to boundary k + gold
answer ids" is scored:

    gold_logprob[i, k] = sum_{j} log pi_ref(g_j | prefix_k, g_<j)      (nats, temperature 1, no top-k / top-p)
    values[i, k] = gold_logprob[i, k] - gold_logprob[i, 0]             (log-ratio to the start of the episode)

so values[:, 0] = 0 and values[i, k] is how much more likely the reference model finds the gold answer after the
first k tool observations than before any. The TD turn rewards (values[k + 1] - values[k]) are the same for any
baseline fixed per episode. Boundaries an episode lacks are NaN.

Tokenisation rule of the gold answer: the answer written the way the task asks the model to write it, by default
the system prompt's "Answer: <number>" line (config task.system_prompt), i.e. `answer_format.format(answer=...)`
tokenised without special tokens (gold_answer_ids). Source: TRACE as described in issue 18 (reconstructed; the
paper was not located); the gold-answer log-likelihood potential follows TIPS, arXiv:2603.22293.
"""

from __future__ import annotations

import torch

from nearpolicy.batching import TokenBatch, collate
from nearpolicy.ops.turn_credit import DEFAULT_ANSWER_FORMAT
from nearpolicy.model.policy import sequence_logprobs
from nearpolicy.types import Rollout, SamplingParams

RAW = SamplingParams(1.0, 1.0, 0, 1)  # temperature 1, no top-k / top-p: the model's own distribution


def gold_answer_ids(tokenizer, answer: str, answer_format: str = DEFAULT_ANSWER_FORMAT) -> list[int]:
    """Token ids of `answer_format` filled with `answer`, tokenised without special tokens (no BOS). Raises
    ValueError for an empty result or a format without "{answer}"."""
    if "{answer}" not in answer_format:
        raise ValueError(f"answer format {answer_format!r} has no {{answer}} placeholder")
    ids = tokenizer(answer_format.format(answer=answer), add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"gold answer {answer!r} tokenises to no ids")
    return list(ids)


def boundary_ends(observation_mask: torch.Tensor, length: int) -> list[int]:
    """Completion prefix lengths [0, e_1, e_2, ...] of one row's boundaries: 0, then 1 + the last index of each
    maximal run of True in observation_mask[:length] (observation_mask [T] bool)."""
    obs = observation_mask[:length].bool()
    ends = [t + 1 for t in range(length) if obs[t] and (t + 1 == length or not obs[t + 1])]
    return [0, *ends]


def _rows(batch: TokenBatch, observation_mask: torch.Tensor, gold_ids: list[list[int]]):
    """(rollouts, (row, boundary) of each): one Rollout per boundary, prompt = prefix, completion = gold ids."""
    prompt_lengths, lengths = batch.prompt_lengths.tolist(), batch.completion_lengths.tolist()
    rollouts, where = [], []
    for i, (n_prompt, n, gold) in enumerate(zip(prompt_lengths, lengths, gold_ids)):
        if not gold:
            raise ValueError(f"row {i}: empty gold answer ids")
        prompt, completion = batch.input_ids[i, :n_prompt].tolist(), batch.completion_ids[i, :n].tolist()
        for k, end in enumerate(boundary_ends(observation_mask[i], n)):
            rollouts.append(Rollout(i, k, prompt + completion[:end], list(gold), [None] * len(gold),
                                    [0] * len(gold), "stop"))
            where.append((i, k))
    return rollouts, where


@torch.no_grad()
def gold_logprobs(model: torch.nn.Module, batch: TokenBatch, observation_mask: torch.Tensor,
                  gold_ids: list[list[int]], micro: int = 8) -> torch.Tensor:
    """gold_logprob [B, K + 1] float32 (nats; module docstring), NaN past a row's last boundary; K = the most
    observation runs of any row. The rows "prefix + gold" are sorted so rows with one prefix (every episode's
    boundary 0 in a GRPO group) are neighbours and run in micro-batches of `micro` rows on the shared-prompt path
    (policy.sequence_logprobs: each distinct prefix runs once per micro-batch). Under no_grad; `model` is not
    changed. observation_mask [B, T] bool over the completion; gold_ids: B lists of ids (gold_answer_ids).
    Raises ValueError for a gold_ids list of the wrong length, an empty one, or micro < 1."""
    if len(gold_ids) != len(batch):
        raise ValueError(f"{len(gold_ids)} gold answers for {len(batch)} rows")
    if observation_mask.shape != batch.completion_ids.shape:
        raise ValueError(f"observation_mask {tuple(observation_mask.shape)} must have the completion's shape "
                         f"{tuple(batch.completion_ids.shape)}")
    if micro < 1:
        raise ValueError(f"micro must be >= 1, got {micro}")
    rollouts, where = _rows(batch, observation_mask, gold_ids)
    order = sorted(range(len(rollouts)), key=lambda r: (rollouts[r].prompt_ids, rollouts[r].completion_ids))
    vocab = model.get_output_embeddings().weight.shape[0]
    width = 1 + max(k for _, k in where)
    out = torch.full((len(batch), width), float("nan"), dtype=torch.float32)
    for start in range(0, len(order), micro):
        chunk = order[start:start + micro]
        part = collate([rollouts[r] for r in chunk], pad_id=0, vocab_size=vocab, shared_prompt=True)
        logprobs, _ = sequence_logprobs(model, part, RAW)
        sums = torch.where(part.mask, logprobs, torch.zeros_like(logprobs)).sum(1)
        for r, value in zip(chunk, sums.tolist()):
            out[where[r]] = value
    return out


def turn_values(model: torch.nn.Module, batch: TokenBatch, observation_mask: torch.Tensor,
                gold_ids: list[list[int]], micro: int = 8) -> torch.Tensor:
    """TRACE's state values [B, K + 1] float32 (nats): gold_logprobs minus each row's boundary-0 value (so column 0
    is 0), NaN past a row's last boundary; the `values` input of ops.turn_credit "trace". Same errors as
    gold_logprobs."""
    lp = gold_logprobs(model, batch, observation_mask, gold_ids, micro)
    return lp - lp[:, :1]
