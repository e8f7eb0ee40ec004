"""One policy update (forward + backward of every micro-batch, gradient clipping, an optimizer step at lr 0) of the
SmolLM2-135M policy with the shared-prompt path (algorithm.shared_prompt = true: each group's prompt runs once, its
completions attend to it; model/policy.py) against the padded path (every row runs prompt + completion, padded to its
micro-batch's longest), on the main job's shapes: chain_sum chat-templated prompts (54 tokens), G = 8 samples per
prompt, `--prompts` prompts, micro-batches of 8 rows, completion lengths drawn uniformly from [3, 40] (random ids).

Also counts the tokens each path computes and how many of them are padding (batching.forward_tokens), and checks on
the real model that both paths give the same log-probs and loss. One warm-up update per path, then `--repeats` timed
updates, the two paths alternating. Writes JSON and prints a markdown table.

    PYTHONPATH=src .venv/bin/python bench/shared_prompt.py [--repeats 2] [--out docs/bench/shared_prompt.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from harness import summarize
from nearpolicy.batching import collate, forward_tokens
from nearpolicy.config.schema import TaskConfig, load_config
from nearpolicy.doctor import cpu_facts
from nearpolicy.model.load import chat_prompt_ids, load_policy, pad_token_id
from nearpolicy.tasks import make_task
from nearpolicy.training.trainer import update_settings
from nearpolicy.types import Rollout, SamplingParams
from nearpolicy.training.update import policy_update


def make_rollouts(tokenizer, vocab: int, prompts: int, group: int, lengths: tuple[int, int], seed: int) -> list[Rollout]:
    task = make_task("reasoning_gym", name="chain_sum", options=TaskConfig().resolved_options(), path=None,
                     train_size=200, eval_size=prompts, seed=0, eval_seed=1234, skip_bad_lines=False)
    rng = random.Random(seed)
    out = []
    for g, problem in enumerate(task.eval_problems()):
        prompt = chat_prompt_ids(tokenizer, TaskConfig().system_prompt, problem.question)
        for k in range(group):
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))]
            out.append(Rollout(g, k, prompt, ids, [None] * len(ids), [0] * len(ids), "stop"))  # no engine log-probs: weight 1
    return out


def timed_update(model, batch, settings, sampling, advantages) -> tuple[float, dict, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every repeat sees the same weights
    t0 = time.perf_counter()
    result = policy_update(model, optimizer, batch, None, advantages, sampling, settings)
    return time.perf_counter() - t0, result.metrics, result.old_logprobs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/shared_prompt.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(None)  # the main job's update: ppo_clip, tis, micro-batches of 8, old log-probs fused
    settings, sampling = update_settings(cfg), SamplingParams(1.0, 1.0, 0, cfg.sampling.max_new_tokens)
    model, tokenizer = load_policy("smollm2")
    vocab = model.get_output_embeddings().weight.shape[0]
    rollouts = make_rollouts(tokenizer, vocab, args.prompts, args.group, (args.min_length, args.max_length), seed=0)
    advantages = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(1))
    paths = {"padded": False, "shared": True}
    batches = {name: collate(rollouts, pad_token_id(tokenizer), vocab, shared) for name, shared in paths.items()}
    micro = settings.micro_batch_size
    hidden = model.config.hidden_size
    layouts = {"padded": (batches["padded"], None), "shared": (batches["shared"], None),
               "shared, rows padded to the group's longest": (batches["shared"], False),
               "shared, packed": (batches["shared"], True)}
    tokens = {name: dict(zip(("computed", "padding"), forward_tokens(b, micro, hidden, pack)))
              for name, (b, pack) in layouts.items()}
    for t in tokens.values():
        t["padding_fraction"] = t["padding"] / t["computed"]
    load_before = os.getloadavg()[0]  # another job on this machine shows here (2 cores)
    times, outputs = {name: [] for name in paths}, {}
    for name, batch in batches.items():  # warm-up, and the equality check on the real model
        _, metrics, logprobs = timed_update(model, batch, settings, sampling, advantages)
        outputs[name] = (metrics, logprobs)
        print(f"warm-up {name}: loss {metrics['actor/loss']:.6f}", flush=True)
    for rep in range(args.repeats):
        for name, batch in batches.items():
            seconds = timed_update(model, batch, settings, sampling, advantages)[0]
            times[name].append(seconds)
            print(f"repeat {rep} {name}: {seconds:.2f} s", flush=True)
    mask = batches["padded"].mask
    equality = {"max_abs_logprob_diff": float((outputs["shared"][1] - outputs["padded"][1])[mask].abs().max())}
    for key in ("actor/loss", "actor/grad_norm"):
        equality |= {f"{key}_{name}": outputs[name][0][key] for name in paths}
    summary = {name: summarize(values) for name, values in times.items()}
    speedup = summary["padded"]["median"] / summary["shared"]["median"]
    model_name, _ = cpu_facts(Path("/proc/cpuinfo").read_text())
    prompt_tokens = sorted({len(r.prompt_ids) for r in rollouts})
    meta = {"prompts": args.prompts, "group": args.group, "prompt_tokens": prompt_tokens,
            "completion_lengths": [len(r.completion_ids) for r in rollouts], "micro_batch_size": micro,
            "threads": args.threads, "repeats": args.repeats, "cpu": model_name, "torch": torch.__version__,
            "load_average_1min": [load_before, os.getloadavg()[0]]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": meta, "tokens": tokens, "seconds_per_update": summary,
                                    "speedup": speedup, "equality": equality}, indent=2) + "\n")
    print(f"\n{model_name}, {args.threads} threads; prompts of {prompt_tokens} tokens, G = {args.group}")
    print("| path | tokens computed | padding | update s (median) | runs |\n|---|---|---|---|---|")
    for name, t in tokens.items():
        s = summary.get(name, {"median": float("nan"), "values": []})
        print(f"| {name} | {t['computed']} | {t['padding']} ({100 * t['padding_fraction']:.1f} %) | {s['median']:.2f} | "
              f"{', '.join(f'{v:.2f}' for v in s['values'])} |")
    print(f"speedup {speedup:.2f}x; max |log-prob difference| {equality['max_abs_logprob_diff']:.2e} nats; "
          + ", ".join(f"{k} {v:.7g}" for k, v in equality.items() if k.startswith("actor/")))


if __name__ == "__main__":
    main()
