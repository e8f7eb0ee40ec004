"""The engine log-prob contract's reference, shared by the engine tests: the trainer's log-probs of a completion
under the sampling transform, and the largest gap of a batch of rollouts' engine log-probs from them."""

from __future__ import annotations

import numpy as np
import torch

from nearpolicy.ops.logprobs import transformed_log_softmax
from nearpolicy.types import SamplingParams


@torch.no_grad()
def trainer_logprobs(model, prompt: list[int], completion: list[int], sampling: SamplingParams) -> np.ndarray:
    """The trainer's log-probs [T] (transformers fp32, full forward) of `completion` under the sampling transform."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].double()
    logp = transformed_log_softmax(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).numpy()


def max_gap(model, rollouts, sampling: SamplingParams) -> float:
    """max over rollouts and tokens of |trainer log-prob - the rollout's engine log-prob| (nats)."""
    return max(float(np.abs(trainer_logprobs(model, r.prompt_ids, r.completion_ids, sampling)
                            - np.asarray(r.rollout_logprobs)).max()) for r in rollouts)
