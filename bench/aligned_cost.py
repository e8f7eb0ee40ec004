"""Cost of the precision-aligned trainer forward (model/aligned.py): forward + backward of one GRPO micro-batch of
SmolLM2-135M-Instruct (8 sequences of a 54-token prompt + 32 completion tokens, one shared prompt group), plain vs
aligned to the q8_0 engine and to q4_1 with q8_0 embeddings; median of 5 after one warm-up, one thread.

    .venv/bin/python bench/aligned_cost.py [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nearpolicy.model.aligned import align_model
from nearpolicy.batching import collate
from nearpolicy.model.load import default_model_gguf, load_policy
from nearpolicy.model.policy import sequence_logprobs
from nearpolicy.types import Rollout, SamplingParams


def _batch(shared: bool):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 49152, (54,), generator=g).tolist()
    rollouts = [Rollout(0, k, prompt, torch.randint(3, 49152, (32,), generator=g).tolist(), [-1.0] * 32, [0] * 32,
                        "length") for k in range(8)]
    return collate(rollouts, 2, 49152, shared_prompt=shared)


def _step_seconds(model, batch, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        model.zero_grad()
        t0 = time.perf_counter()
        logprobs, _ = sequence_logprobs(model, batch, SamplingParams())
        torch.where(batch.mask, logprobs, 0.0).sum().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_policy(str(default_model_gguf()))[0].float().train()
    batch = _batch(shared=True)
    plain = _step_seconds(model, batch, args.repeats)
    print(f"plain: {plain:.2f} s")
    for precision, overrides in (("q8_0", ()), ("q4_1", (("embeddings", "q8_0"),))):
        with align_model(model, precision, overrides):
            aligned = _step_seconds(model, batch, args.repeats)  # the weight cache is filled in the warm-up
        print(f"aligned {precision}{' ' + str(overrides) if overrides else ''}: {aligned:.2f} s ({aligned / plain:.2f}x)")


if __name__ == "__main__":
    main()
