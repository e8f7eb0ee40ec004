"""The update's micro-batch in fp32 against algorithm.trainer_precision = "bf16" (torch.autocast on the transformer
body, LM head and log-softmax in fp32; model/policy.trainer_compute): seconds per forward + backward of one GRPO
group of SmolLM2-135M-Instruct (a chain-sum prompt, G = 8 completions the fp32 model sampled itself, up to 64
tokens, the shared-prompt path), and how far the bf16 log-probs of those tokens land from the fp32 ones (the
mismatch a bf16 trainer adds, to set beside the engine's). Each arm runs in its own process, the arms alternated so
drift hits both alike. Writes docs/bench/update_precision.json:

    .venv/bin/python bench/update_precision.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from update_microbatch import seconds_per_call

from nearpolicy.batching import collate
from nearpolicy.doctor import cpu_model
from nearpolicy.model.load import default_model_gguf, load_policy
from nearpolicy.model.policy import sequence_logprobs, trainer_compute
from nearpolicy.training.allocator import reuse_freed_memory
from nearpolicy.types import Rollout, SamplingParams

ARMS = ("fp32", "bf16")
PROMPT = "Solve this: 7 + 5 = ?\nGive the final answer after 'Answer:'."


def sample_group(group: int, max_new_tokens: int, seed: int) -> dict:
    """A prompt's ids and `group` completions the fp32 policy samples from it (temperature 1)."""
    model, tokenizer = load_policy(str(default_model_gguf()))
    model.eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt] * group), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)
    completions = []
    for row in out[:, len(prompt):].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        completions.append(row[:end])
    return {"prompt": prompt, "completions": completions, "vocab": model.config.vocab_size}


def one_arm(arm: str, threads: int, group_file: str) -> dict:
    """Seconds per forward + backward of `arm` in this (fresh) process (one warm-up, then the mean of 3) and the
    log-probs [n] of every completion token under it (no grad)."""
    torch.set_num_threads(threads)
    reuse_freed_memory(True)
    model, _ = load_policy(str(default_model_gguf()))
    group = json.loads(Path(group_file).read_text())
    rollouts = [Rollout(0, k, group["prompt"], ids, [-1.0] * len(ids), [0] * len(ids), "length")
                for k, ids in enumerate(group["completions"])]
    batch = collate(rollouts, 0, group["vocab"])
    sampling = SamplingParams(temperature=1.0)

    def micro_batch() -> None:  # as policy_update runs it: the forward under trainer_compute, the backward outside
        with trainer_compute(arm):
            logprobs, _ = sequence_logprobs(model, batch, sampling)
        (logprobs.sum() / 100).backward()

    seconds = seconds_per_call(micro_batch)
    with torch.no_grad(), trainer_compute(arm):
        logprobs, _ = sequence_logprobs(model, batch, sampling)
    return {"seconds": seconds, "logprobs": logprobs[batch.mask].tolist()}


def deviation(fp32: list[float], bf16: list[float]) -> dict:
    """Per-token statistics of d = bf16 - fp32 log-probs (nats) of tokens the fp32 policy sampled: mean |d|, max |d|,
    and the k3 estimate of KL(fp32 || bf16), mean of exp(d) - 1 - d (Schulman, "Approximating KL divergence", 2020)."""
    d = torch.tensor(bf16, dtype=torch.float64) - torch.tensor(fp32, dtype=torch.float64)
    return {"tokens": len(d), "mean_abs_nats": float(d.abs().mean()), "max_abs_nats": float(d.abs().max()),
            "k3": float((d.exp() - 1 - d).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each runs both arms in their own processes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/bench/update_precision.json")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a fresh process
    parser.add_argument("--group-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(one_arm(args.arm, args.threads, args.group_file)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        group_file = Path(tmp) / "group.json"
        group = sample_group(8, 64, args.seed)
        group_file.write_text(json.dumps(group))
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for _ in range(args.repeats):
            for arm in ARMS:
                out = subprocess.run([sys.executable, __file__, "--arm", arm, "--threads", str(args.threads),
                                      "--group-file", str(group_file)], capture_output=True, text=True, check=True)
                runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    seconds = {arm: [r["seconds"] for r in rs] for arm, rs in runs.items()}
    medians = {arm: statistics.median(s) for arm, s in seconds.items()}
    tokens = len(group["prompt"]) + sum(len(c) for c in group["completions"])
    dev = deviation(runs["fp32"][0]["logprobs"], runs["bf16"][0]["logprobs"])
    result = {"cpu": cpu_model(), "threads": args.threads, "tokens": tokens,
              "completion_lengths": [len(c) for c in group["completions"]], "seconds_per_micro_batch": seconds,
              "median_s": medians, "bf16_over_fp32": medians["bf16"] / medians["fp32"], "logprob_deviation": dev}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"one micro-batch ({tokens} tokens), forward + backward: fp32 {medians['fp32']:.3f} s, bf16 "
          f"{medians['bf16']:.3f} s ({result['bf16_over_fp32']:.2f}x); bf16 - fp32 log-probs over {dev['tokens']} "
          f"sampled tokens: mean |d| {dev['mean_abs_nats']:.4f} nats, max {dev['max_abs_nats']:.3f}, "
          f"k3 {dev['k3']:.2e}")


if __name__ == "__main__":
    main()
