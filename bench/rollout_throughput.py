"""Rollout tokens/s with per-token log-probs: llama.cpp engine (f16, q8_0) vs the transformers engine.

Same prompts (chain_sum, chat-templated), G = 8 samples per prompt, up to 128 new tokens, temperature 1.
Each configuration is run `--repeats` times after one warm-up; prints a markdown table and writes JSON.

    .venv/bin/python bench/rollout_throughput.py [--prompts 4] [--repeats 2] [--out docs/bench/rollout_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nearpolicy.config.schema import TaskConfig
from nearpolicy.model.load import chat_prompt_ids, load_policy
from nearpolicy.tasks import make_task
from nearpolicy.types import GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_for import open_engine  # noqa: E402  ("kind:precision" -> engine, via engines/factory.py)


def measure(engine, requests, sampling, repeats: int) -> dict:
    engine.generate(requests[:1], SamplingParams(1.0, 1.0, 0, 8), seed=0)  # warm-up
    rates, tokens = [], []
    for rep in range(repeats):
        t0 = time.perf_counter()
        rollouts = engine.generate(requests, sampling, seed=rep)
        dt = time.perf_counter() - t0
        n = sum(len(r.completion_ids) for r in rollouts)
        assert all(len(r.rollout_logprobs) == len(r.completion_ids) for r in rollouts)
        rates.append(n / dt)
        tokens.append(n)
    return {"tokens_per_s_median": statistics.median(rates), "tokens_per_s_all": rates, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                        help="transformers engine dtypes (bf16 matmul is about 10x slower than fp32 on this CPU)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/rollout_throughput.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy("smollm2")
    task = make_task("reasoning_gym", name="chain_sum", options=TaskConfig().resolved_options(), path=None, train_size=200,
                     eval_size=args.prompts, seed=0, eval_seed=1234, skip_bad_lines=False)
    prompts = [chat_prompt_ids(tokenizer, TaskConfig().system_prompt, p.question) for p in task.eval_problems()]
    requests = [GenerationRequest(i, tuple(p), args.group) for i, p in enumerate(prompts)]
    sampling = SamplingParams(1.0, 1.0, 0, args.new_tokens)
    batch = args.prompts * args.group
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("f16", "q8_0"):
            config = f"llamacpp:{precision}"
            engine = open_engine(config, model, tokenizer, Path(tmp), batch, args.threads)
            results[config] = measure(engine, requests, sampling, args.repeats)
            engine.close()
    for dtype in args.hf_dtypes:
        config = f"hf:{dtype}"
        with tempfile.TemporaryDirectory() as tmp:
            engine = open_engine(config, model, tokenizer, Path(tmp), batch, args.threads)
        results[config] = measure(engine, requests, sampling, args.repeats)
        engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens, "threads": args.threads,
            "repeats": args.repeats, "machine": platform.machine(), "torch": torch.__version__}
    args.out.write_text(json.dumps({"settings": meta, "results": results}, indent=2) + "\n")
    print("| engine | tokens/s (median) | runs |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tokens_per_s_median']:.1f} | {', '.join(f'{x:.1f}' for x in r['tokens_per_s_all'])} |")


if __name__ == "__main__":
    main()
