"""One GRPO micro-batch of SmolLM2-135M-Instruct in the update: a group (a 54-token prompt, G = 8 completions of
20-60 tokens, the shared-prompt path), forward + backward under glibc's default allocator and under
run.reuse_freed_memory (training/allocator.py), and the same group run forward only under no_grad, what the update pays for
a group whose gradient is exactly 0 (update.inert_rows). Each arm runs in its own process (glibc's dynamic mmap
threshold cannot be restored once changed), the arms alternated so drift hits all alike.
Writes docs/bench/update_microbatch.json:

    .venv/bin/python bench/update_microbatch.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from nearpolicy.training.allocator import reuse_freed_memory
from nearpolicy.batching import collate
from nearpolicy.doctor import cpu_model
from nearpolicy.model.load import default_model_gguf, load_policy
from nearpolicy.model.policy import sequence_logprobs
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


ARMS = ("glibc default", "reuse freed memory", "forward only")


def one_arm(arm: str, threads: int) -> float:
    """Seconds per micro-batch of `arm`, in this (fresh) process: one warm-up, then the mean of 3."""
    torch.set_num_threads(threads)
    if arm != "glibc default" and not reuse_freed_memory(True):  # forward only: as in a run, reuse on
        raise SystemExit("no glibc mallopt on this system: nothing to compare")
    model, _ = load_policy(str(default_model_gguf()))
    batch = group_batch(model.config.vocab_size, 54, 8)
    sampling = SamplingParams(temperature=1.0)

    def micro_batch() -> None:
        if arm == "forward only":
            with torch.no_grad():
                sequence_logprobs(model, batch, sampling)
            return
        logprobs, _ = sequence_logprobs(model, batch, sampling)
        (logprobs.sum() / 100).backward()

    return seconds_per_call(micro_batch)


def seconds_per_call(call, repeats: int = 3) -> float:
    """Mean seconds of `call()` over `repeats` calls after one warm-up call (also used by bench/update_precision.py)."""
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each runs every arm in its own process")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/bench/update_microbatch.json")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a fresh process
    args = parser.parse_args()
    if args.arm:
        print(json.dumps({"seconds": one_arm(args.arm, args.threads)}))
        return
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:  # a fresh process each: once mallopt is called, glibc's dynamic threshold is gone for good
            out = subprocess.run([sys.executable, __file__, "--arm", arm, "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True).stdout
            seconds[arm].append(json.loads(out.strip().splitlines()[-1])["seconds"])
    medians = {arm: statistics.median(s) for arm, s in seconds.items()}
    tokens = int(group_batch(49152, 54, 8).completion_lengths.sum()) + 54
    result = {"cpu": cpu_model(), "threads": args.threads, "tokens": tokens, "seconds_per_micro_batch": seconds,
              "median_s": medians, "reuse_over_default": medians["reuse freed memory"] / medians["glibc default"],
              "forward_only_over_default": medians["forward only"] / medians["glibc default"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"one micro-batch ({tokens} tokens), forward + backward: glibc default {medians['glibc default']:.3f} s, "
          f"reuse freed memory {medians['reuse freed memory']:.3f} s ({result['reuse_over_default']:.2f}x); "
          f"forward only {medians['forward only']:.3f} s ({result['forward_only_over_default']:.2f}x)")


if __name__ == "__main__":
    main()
