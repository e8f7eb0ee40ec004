"""An engine with a known mismatch, for testing every correction, estimator and loss through the real Trainer.

`OffsetEngine` wraps an engine whose log-probs are the trainer's own (the hf engine in fp32 on the trainer's weights:
same model, same dtype, the engine's KV-cached forward agrees with the trainer's full forward to about 1e-6 nats)
and reports each sampled token's log-prob plus a chosen, seeded perturbation:

    rollout_logprob_t = logprob_t + shift + noise * z_t,    z_t ~ N(0, 1) seeded by (seed, group id, sample index)

so the mismatch the trainer measures, log pi_old - log mu = -(shift + noise z_t), is known in advance. The tokens
are still drawn from the trainer's distribution; only the reported behaviour log-probs are perturbed (they need
not normalise: this is a fake for checking the arithmetic, not a model of an engine). Everything else (greedy,
score, stop ids, weight sync) is the wrapped engine's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from nearpolicy.types import GenerationRequest, Rollout, SamplingParams


class OffsetEngine:
    """`engine` with its rollout log-probs perturbed by `shift` + `noise` x N(0, 1) nats (see the module doc)."""

    def __init__(self, engine, *, shift: float = 0.0, noise: float = 0.0, seed: int = 0):
        if noise < 0:
            raise ValueError(f"noise must be >= 0 nats, got {noise}")
        self.engine, self.shift, self.noise, self.seed = engine, shift, noise, seed

    @property
    def version(self) -> int:
        return self.engine.version

    def offsets(self, group_id: int, sample_index: int, length: int) -> np.ndarray:
        """The perturbation [length] float64 (nats) added to one sample's log-probs."""
        z = np.random.default_rng([self.seed, group_id, sample_index]).standard_normal(length)
        return self.shift + self.noise * z

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int) -> list[Rollout]:
        out = []
        for r in self.engine.generate(requests, sampling, seed):
            delta = self.offsets(r.group_id, r.sample_index, len(r.rollout_logprobs))
            out.append(replace(r, rollout_logprobs=[float(lp + d) for lp, d in zip(r.rollout_logprobs, delta)]))
        return out

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return self.engine.greedy(prompts, max_new_tokens)

    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingParams) -> list[float]:
        return self.engine.score(prompt_ids, completion_ids, sampling)

    def is_stop_token(self, token: int) -> bool:
        return self.engine.is_stop_token(token)

    def update_weights(self, source, version: int) -> None:
        self.engine.update_weights(source, version)

    def close(self) -> None:
        self.engine.close()


class TiltedEngine:
    """One-token responses from a known behaviour policy, for checking estimators against exact expectations.

    For each prompt the trainer's policy pi = softmax(l / T) over the vocabulary (l: `model`'s last-position logits,
    float64) is tilted by a fixed offset vector: mu = softmax(l / T + tilt), tilt [V] float (nats; 0 = mu is pi).
    Each sample is one token y ~ mu, reported with log mu(y), finish reason "length" (max_new_tokens is 1). Small
    vocabularies make every expectation an exact finite sum (tests/test_gradbias.py). Raises ValueError for a tilt
    whose length is not the vocabulary size."""

    def __init__(self, model, tilt, *, version: int = 0):
        import torch

        self.model, self.version = model, version
        self.tilt = np.asarray(tilt, np.float64)
        vocab = model.get_output_embeddings().weight.shape[0]
        if self.tilt.shape != (vocab,):
            raise ValueError(f"tilt must have one entry per vocabulary id ({vocab}), got shape {self.tilt.shape}")
        self._torch = torch

    def behaviour_logprobs(self, prompt_ids, sampling: SamplingParams) -> np.ndarray:
        """log mu [V] float64 after `prompt_ids`."""
        torch = self._torch
        with torch.no_grad():
            logits = self.model(torch.tensor([list(prompt_ids)])).logits[0, -1].double().numpy()
        s = logits / sampling.temperature + self.tilt
        return s - (s.max() + np.log(np.exp(s - s.max()).sum()))

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int) -> list[Rollout]:
        rng = np.random.default_rng(seed)
        out = []
        for request in requests:
            logmu = self.behaviour_logprobs(request.prompt_ids, sampling)
            ids = rng.choice(len(logmu), size=request.n, p=np.exp(logmu) / np.exp(logmu).sum())
            out += [Rollout(request.group_id, i, list(request.prompt_ids), [int(y)], [float(logmu[y])], [self.version],
                            "length") for i, y in enumerate(ids)]
        return out

    def is_stop_token(self, token: int) -> bool:
        return False

    def close(self) -> None:
        pass
