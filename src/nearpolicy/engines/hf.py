"""transformers rollout engine: our own sampling loop over a KV-cached decode step (engines/hf_decode.py), weights
and cache in a chosen dtype (fp32 / bf16), in this process. Same log-prob contract and sampler as the llama.cpp
engine (engines/sampling.sample_rows): the returned log-prob is the transformed log softmax of the float32 logits the
token was drawn from, computed in float64. A chunk of at most max_parallel_sequences samples (whole requests) is
decoded together; each distinct prompt is prefilled once."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from nearpolicy.engines.base import DecodeCounts, LoraAdapter
from nearpolicy.engines.hf_decode import COMPACT_BELOW, make_stepper, sample_rows_of
from nearpolicy.engines.sampling import sample_rows
from nearpolicy.ops.logprobs import transformed_log_softmax
from nearpolicy.types import GenerationRequest, Rollout, SamplingParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # config engine.hf_dtype -> torch dtype


class HFEngine:
    """Engine holding its own copy of the policy in `dtype`. `stop_ids` are every id that ends a response.
    `logit_noise` (std in logit units, >= 0; config engine.logit_noise): training samples are drawn from the logits
    plus N(0, std^2) noise per vocabulary entry (from the generate call's seeded generator) and their log-probs are
    reported under that noisy distribution, a mismatch of known size (engines/sampling.py); greedy and score are
    unaffected. Raises ValueError for an unknown dtype or a negative logit_noise."""

    def __init__(self, model: torch.nn.Module, stop_ids: set[int], *, dtype: str = "fp32",
                 max_parallel_sequences: int = 64, version: int = 0, logit_noise: float = 0.0):
        if dtype not in DTYPES:
            raise ValueError(f"hf engine dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if not logit_noise >= 0:
            raise ValueError(f"logit_noise must be >= 0, got {logit_noise}")
        self.logit_noise = float(logit_noise)
        self.model = copy.deepcopy(model).to(DTYPES[dtype]).eval()
        self.stop_ids = set(stop_ids)
        self.max_parallel = max_parallel_sequences
        self.version = version
        self.pad_id = next(iter(sorted(self.stop_ids)))
        self._stepper = make_stepper(self.model)
        self._decode_counts = DecodeCounts()
        self._base: dict[str, torch.Tensor] = {}  # an adapted weight's base values, kept at its first adapter sync

    def update_weights(self, source: Path | dict | LoraAdapter, version: int) -> None:
        """A state dict (loaded by name, non-strict), or a LoraAdapter (source.tensors: the adapter replaces the
        previous one on the engine's base weights, `_apply_adapter`). Raises TypeError for another source."""
        if isinstance(source, LoraAdapter):
            self._apply_adapter(source)
            self.version = version
            return
        if not isinstance(source, dict):
            raise TypeError("the hf engine syncs from a state dict")
        dtype = next(self.model.parameters()).dtype
        try:
            self.model.load_state_dict({k: v.to(dtype) for k, v in source.items()}, strict=False)
        finally:  # a refused dict may have copied some tensors already: the packed copies follow the model anyway
            self._stepper.repack()
        self._base = {}  # new base weights: an adapter sync after this one adds to them
        self.version = version

    @torch.no_grad()
    def _apply_adapter(self, source: LoraAdapter) -> None:
        """W = W_base + scale * B A for each adapted weight (float32 sum, stored in the engine dtype; W_base: the
        weight as it was at its first adapter sync, the engine's copy of the frozen base), then the packed copies
        are rebuilt. Raises TypeError without source.tensors, KeyError naming an unknown weight."""
        if source.tensors is None:
            raise TypeError("the hf engine takes a LoRA adapter as tensors (LoraAdapter.tensors)")
        params = dict(self.model.named_parameters())
        for name in source.tensors:
            if name not in params:
                raise KeyError(f"LoRA adapter weight {name!r} is not a weight of the hf engine's model")
        for name, (a, b) in source.tensors.items():
            base = self._base.setdefault(name, params[name].detach().float().clone())
            params[name].copy_(base + source.scale * (b.float() @ a.float()))
        self._stepper.repack()

    def close(self) -> None:
        self.model = self._stepper = None

    def take_decode_counts(self) -> DecodeCounts:
        """The DecodeCounts of the generate calls since the last take; the count restarts at zero."""
        counts, self._decode_counts = self._decode_counts, DecodeCounts()
        return counts

    def _run(self, requests: list[GenerationRequest], sampling: SamplingParams | None, limits: list[int],
             rng: np.random.Generator | None) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Decode every sample of `requests` (request.n each) to a stop id (none with sampling.ignore_eos) or its own
        token limit (limits [n samples]); sampling None is greedy. Returns (ids, log-probs, finish reason) per sample."""
        prompts, rows = sample_rows_of(requests)
        n = len(rows)
        tokens, logps = [[] for _ in range(n)], [[] for _ in range(n)]
        finish: list[str | None] = ["length" if limit <= 0 else None for limit in limits]
        if all(f is not None for f in finish):
            return tokens, logps, finish
        logits = self._stepper.start(prompts, rows, max(len(p) for p in prompts) + max(limits), self.pad_id)
        live, batch_rows = list(range(n)), n  # live: the sample in each of the stepper's rows, in row order
        while True:
            alive = [j for j, i in enumerate(live) if finish[i] is None]  # rows not finished (some may linger)
            rows_logits = logits if len(alive) == len(live) else logits[alive]
            if sampling is None:
                ids, lps = rows_logits.argmax(-1).tolist(), [0.0] * len(alive)
            else:
                ids, lps = sample_rows(rows_logits.numpy(), sampling, rng, self.logit_noise)
                ids, lps = ids.tolist(), lps.tolist()
            for j, tok, lp in zip(alive, ids, lps):
                i = live[j]
                tokens[i].append(tok)
                logps[i].append(lp)
                if tok in self.stop_ids and not (sampling is not None and sampling.ignore_eos):
                    finish[i] = "stop"
                elif len(tokens[i]) >= limits[i]:
                    finish[i] = "length"
            going = [j for j in alive if finish[live[j]] is None]
            if not going:
                return tokens, logps, finish
            step_ids = torch.full((len(live),), self.pad_id, dtype=torch.long)
            step_ids[alive] = torch.tensor(ids)
            if self._stepper.can_drop_rows and len(going) < COMPACT_BELOW * batch_rows:  # drop finished rows
                self._stepper.keep(torch.tensor(going))
                live, step_ids, batch_rows = [live[j] for j in going], step_ids[going], len(going)
            logits = self._stepper.step(step_ids)
            if sampling is not None:
                self._decode_counts += DecodeCounts(1, len(going), max(self.max_parallel, n))  # n: a large group

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int) -> list[Rollout]:
        rng = np.random.default_rng(seed)
        rollouts = []
        for chunk in _chunks(requests, self.max_parallel):
            limits = [r.token_limit(sampling.max_new_tokens) for r in chunk for _ in range(r.n)]
            toks, lps, fin = self._run(chunk, sampling, limits, rng)
            samples = [(r, k) for r in chunk for k in range(r.n)]
            for (r, k), t, lp, f in zip(samples, toks, lps, fin):
                rollouts.append(Rollout(r.group_id, k, list(r.prompt_ids), t, lp, [self.version] * len(t), f))
        return rollouts

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        requests = [GenerationRequest(i, tuple(p), 1) for i, p in enumerate(prompts)]
        result = []
        for chunk in _chunks(requests, self.max_parallel):
            result += self._run(chunk, None, [max_new_tokens] * len(chunk), None)[0]
        return result

    @torch.no_grad()
    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingParams) -> list[float]:
        if not completion_ids:
            return []
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
        logits = self.model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()
        logp = transformed_log_softmax(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return logp.gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1).tolist()

    def is_stop_token(self, token: int) -> bool:
        return token in self.stop_ids


def _chunks(requests: list[GenerationRequest], max_parallel: int) -> list[list[GenerationRequest]]:
    """Whole requests, in order, at most max_parallel samples a chunk (a request larger than that alone)."""
    chunks, current, size = [], [], 0
    for r in requests:
        if current and size + r.n > max_parallel:
            chunks.append(current)
            current, size = [], 0
        current.append(r)
        size += r.n
    return chunks + ([current] if current else [])
