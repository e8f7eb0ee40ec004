"""run.reuse_freed_memory (allocator.py) on one GRPO micro-batch of SmolLM2-135M-Instruct: forward + backward of
a group (a 54-token prompt, G = 8 completions of 20-60 tokens, the shared-prompt path), glibc's default allocator
against the one that keeps freed blocks in the heap, alternated in one process so drift hits both alike. Writes
docs/bench/update_allocator.json:

    .venv/bin/python bench/update_allocator.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from nearpolicy.allocator import reuse_freed_memory
from nearpolicy.batching import collate
from nearpolicy.doctor import cpu_model
from nearpolicy.models import default_model_gguf, load_policy
from nearpolicy.policy import sequence_logprobs
from nearpolicy.types import Rollout, SamplingParams


def group_batch(vocab: int, prompt_tokens: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
    rollouts = []
    for k in range(group):
        n = int(torch.randint(20, 60, (1,), generator=g))
        rollouts.append(Rollout(0, k, prompt, torch.randint(0, vocab, (n,), generator=g).tolist(), [-1.0] * n,
                                [0] * n, "length"))
    return collate(rollouts, 0, vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="alternations; each times 3 micro-batches per setting")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/bench/update_allocator.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_policy(str(default_model_gguf()))
    batch = group_batch(model.config.vocab_size, 54, 8)
    sampling = SamplingParams(temperature=1.0)

    def micro_batch() -> None:
        logprobs, _ = sequence_logprobs(model, batch, sampling)
        (logprobs.sum() / 100).backward()

    seconds: dict[str, list[float]] = {"glibc default": [], "reuse freed memory": []}
    for _ in range(args.repeats):
        for name, enabled in (("glibc default", False), ("reuse freed memory", True)):
            if not reuse_freed_memory(enabled):
                raise SystemExit("no glibc mallopt on this system: nothing to compare")
            micro_batch()  # the first one under the new setting fills the heap
            start = time.perf_counter()
            for _ in range(3):
                micro_batch()
            seconds[name].append((time.perf_counter() - start) / 3)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    result = {"cpu": cpu_model(), "threads": args.threads, "tokens": int(batch.completion_lengths.sum()) + 54,
              "seconds_per_micro_batch": seconds, "median_s": medians,
              "reuse_over_default": medians["reuse freed memory"] / medians["glibc default"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"one micro-batch ({result['tokens']} tokens): glibc default {medians['glibc default']:.3f} s, "
          f"reuse freed memory {medians['reuse freed memory']:.3f} s ({result['reuse_over_default']:.2f}x)")


if __name__ == "__main__":
    main()
