"""transformers rollout engine: our own sampling loop over a KV-cached forward pass, weights and cache in
a chosen dtype (fp32 / bf16). Same log-prob contract as the llama.cpp engine: the returned log-prob is the
transformed log softmax (ops/logprobs.py) of the logits the token was drawn from, in float32."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

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

    def update_weights(self, source: Path | dict, version: int) -> None:
        if not isinstance(source, dict):
            raise TypeError("the hf engine syncs from a state dict")
        dtype = next(self.model.parameters()).dtype
        self.model.load_state_dict({k: v.to(dtype) for k, v in source.items()}, strict=False)
        self.version = version

    def close(self) -> None:
        self.model = None

    @torch.no_grad()
    def _run(self, prompts: list[tuple[int, ...]], sampling: SamplingParams | None, limits: list[int],
             generator: torch.Generator | None) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Decode every prompt to a stop id or its own token limit (limits [n])."""
        n, max_new = len(prompts), max(limits)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps the last prompt token at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        tokens, logps = [[] for _ in range(n)], [[] for _ in range(n)]
        finish = [None] * n
        next_pos = pos[:, -1:] + 1
        for _ in range(max_new):
            if sampling is None:
                tok = logits.argmax(-1)
                lp = torch.zeros(n)
            else:
                if self.logit_noise:  # the engine samples from, and reports, the perturbed distribution
                    logits = logits + self.logit_noise * torch.randn(logits.shape, generator=generator)
                logp = transformed_log_softmax(logits, sampling.temperature, sampling.top_k, sampling.top_p)
                gumbel = -torch.log(-torch.log(torch.rand(logp.shape, generator=generator).clamp_min(1e-20)))
                tok = (logp + gumbel).argmax(-1)
                lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            for i in range(n):
                if finish[i] is None:
                    tokens[i].append(int(tok[i]))
                    logps[i].append(float(lp[i]))
                    if int(tok[i]) in self.stop_ids:
                        finish[i] = "stop"
                    elif len(tokens[i]) >= limits[i]:
                        finish[i] = "length"
            if all(f is not None for f in finish):
                break
            attn = torch.cat([attn, torch.ones((n, 1), dtype=torch.long)], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                             past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1].float()
            next_pos = next_pos + 1
        return tokens, logps, finish

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int) -> list[Rollout]:
        generator = torch.Generator().manual_seed(seed)
        flat = [(r, k) for r in requests for k in range(r.n)]
        rollouts = []
        for start in range(0, len(flat), self.max_parallel):
            chunk = flat[start : start + self.max_parallel]
            limits = [r.token_limit(sampling.max_new_tokens) for r, _ in chunk]
            toks, lps, fin = self._run([r.prompt_ids for r, _ in chunk], sampling, limits, generator)
            for (r, k), t, lp, f in zip(chunk, toks, lps, fin):
                rollouts.append(Rollout(r.group_id, k, list(r.prompt_ids), t, lp, [self.version] * len(t), f))
        return rollouts

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        result = []
        for start in range(0, len(prompts), self.max_parallel):
            chunk = [tuple(p) for p in prompts[start : start + self.max_parallel]]
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
