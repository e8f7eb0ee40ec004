"""The response-length distribution of the base policy at the training temperature, to choose a token budget
(`sampling.max_new_tokens`) whose truncation share stays under a target: samples GROUP responses to each of PROMPTS
chain_sum training prompts with the llama.cpp engine at PRECISION and a generous limit, then prints the length
quantiles and the share of responses each candidate budget would cut, and writes them as JSON:

    .venv/bin/python bench/response_lengths.py --out docs/bench/response-lengths.json

The base policy is the longest-winded point of a run (GRPO shortens chain_sum responses within ~15 steps:
docs/runs/*.metrics.jsonl, `response/length_mean`), so a budget chosen here bounds truncation from above."""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import numpy as np

from nearpolicy.config.schema import TaskConfig
from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
from nearpolicy.engines.gguf.export import export_model_gguf
from nearpolicy.model.load import chat_prompt_ids, default_model_gguf, load_policy
from nearpolicy.tasks import make_task
from nearpolicy.types import GenerationRequest, SamplingParams

BUDGETS = (32, 48, 64, 96, 128, 160, 192, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--limit", type=int, default=256, help="the generous limit responses are sampled under")
    parser.add_argument("--precision", default="q8_0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load_policy("smollm2")
    task = make_task("reasoning_gym", name="chain_sum", options=TaskConfig().resolved_options(), path=None,
                     train_size=args.prompts, eval_size=0, seed=args.seed, eval_seed=1234, skip_bad_lines=False)
    problems = [task.train_problem(i) for i in range(args.prompts)]
    prompts = [chat_prompt_ids(tokenizer, TaskConfig().system_prompt, p.question) for p in problems]
    gguf = export_model_gguf(model, Path(tempfile.mkdtemp()), args.precision, (), default_model_gguf(), tokenizer)
    engine = build_engine(EngineRequest("llamacpp", args.precision, max_parallel_sequences=64, threads=args.threads,
                                        adaptive_threads=False, isolated=False), EngineInputs(gguf=gguf))
    requests = [GenerationRequest(i, tuple(p), args.group) for i, p in enumerate(prompts)]
    rollouts = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=args.limit), seed=args.seed)
    engine.close()
    os.remove(gguf)
    lengths = np.array([len(r.completion_ids) for r in rollouts])
    capped = float(np.mean(lengths >= args.limit))
    result = {
        "cpu": platform.processor() or platform.machine(), "precision": args.precision, "temperature": 1.0,
        "prompts": args.prompts, "group": args.group, "limit": args.limit, "seed": args.seed,
        "mean": float(lengths.mean()), "quantiles": {q: float(np.quantile(lengths, q / 100)) for q in (50, 75, 90, 95, 99)},
        "share_at_limit": capped,
        "truncated_share": {b: float(np.mean(lengths >= b)) for b in BUDGETS if b <= args.limit},
    }
    print(f"{lengths.size} responses: mean {result['mean']:.1f} tokens, quantiles {result['quantiles']}, "
          f"{capped:.1%} reached the {args.limit}-token limit")
    for b, share in result["truncated_share"].items():
        print(f"  budget {b:4d}: {share:.1%} truncated")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
