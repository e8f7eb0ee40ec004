"""Rollouts -> tensors: masks have the response's length, ids go through verbatim (invariants 3, 4, 5)."""

import math

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.types import Rollout


def _rollout(prompt, completion, logprobs, finish="stop"):
    return Rollout(0, 0, prompt, completion, logprobs, [3] * len(completion), finish)


def test_collate_layout_and_masks():
    a = _rollout([5, 6, 7], [8, 9], [-0.1, -0.2])
    b = _rollout([5], [10, 11, 12, 13], [-1.0, None, -3.0, -4.0], finish="length")
    batch = collate([a, b], pad_id=0, vocab_size=20)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 10, 11, 12, 13]]
    assert batch.completion_ids.tolist() == [[8, 9, 0, 0], [10, 11, 12, 13]]
    assert batch.mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    # the logits at position p predict token p + 1
    assert batch.logit_positions[0, :2].tolist() == [2, 3] and batch.logit_positions[1].tolist() == [0, 1, 2, 3]
    assert batch.has_rollout.tolist() == [[True, True, False, False], [True, False, True, True]]
    assert math.isnan(batch.rollout_logprobs[1, 1]) and batch.rollout_logprobs[1, 2].item() == pytest.approx(-3.0)
    assert batch.versions.tolist() == [[3, 3, -1, -1], [3, 3, 3, 3]]


def test_out_of_vocabulary_ids_are_rejected():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        collate([_rollout([1], [99], [-1.0])], pad_id=0, vocab_size=20)


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="log-probs"):
        _rollout([1], [2, 3], [-1.0])


def test_select_keeps_rows_together():
    batch = collate([_rollout([1], [2], [-1.0]), _rollout([1, 2], [3, 4], [-1.0, -2.0])], 0, 10)
    sub = batch.select(slice(1, 2))
    assert sub.input_ids.tolist() == [[1, 2, 3, 4]] and sub.mask.tolist() == [[True, True]]
    assert torch.equal(sub.rollout_logprobs, torch.tensor([[-1.0, -2.0]]))
