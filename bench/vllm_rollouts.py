"""Rollout tokens/s with per-token log-probs: vLLM (fp32, bf16; its own environment and process) beside the
llama.cpp engine and the transformers engine, in one run on the same prompts.

Same settings as docs/benchmarks.md section 1: chain_sum prompts, chat-templated, G = 8 samples per prompt, up to
128 new tokens, temperature 1, one batch. vLLM's time includes the pipe to its process (the rollouts come back as
Python lists, as the trainer gets them). Each configuration: one warm-up, then `--repeats` timed runs; prints a
markdown table and writes JSON. Needs .venv-vllm (`make vllm-env`).

    .venv/bin/python bench/vllm_rollouts.py [--threads 1] [--repeats 3] [--out docs/bench/vllm_rollouts.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_for import open_engine  # noqa: E402  ("kind:precision" -> engine, via engines/factory.py)
from rollout_throughput import measure  # noqa: E402

from nearpolicy.doctor import cpu_model  # noqa: E402

CONFIGS = ("llamacpp:f32", "llamacpp:q8_0", "hf:fp32", "vllm:fp32", "vllm:bf16")


def main() -> None:
    from nearpolicy.config.schema import TaskConfig
    from nearpolicy.model.load import chat_prompt_ids, load_policy
    from nearpolicy.tasks import make_task
    from nearpolicy.types import GenerationRequest, SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path("docs/bench/vllm_rollouts.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy("smollm2")
    model.float()
    tc = TaskConfig()
    task = make_task("reasoning_gym", name="chain_sum", options=tc.resolved_options(), path=None, train_size=200,
                     eval_size=args.prompts, seed=0, eval_seed=1234, skip_bad_lines=False)
    prompts = [chat_prompt_ids(tokenizer, tc.system_prompt, p.question) for p in task.eval_problems()]
    requests = [GenerationRequest(i, tuple(p), args.group) for i, p in enumerate(prompts)]
    sampling = SamplingParams(1.0, 1.0, 0, args.new_tokens)
    results = {}
    for config in args.configs:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            engine = open_engine(config, model, tokenizer, Path(tmp), len(requests) * args.group, args.threads)
            start_s = time.perf_counter() - t0
            try:
                results[config] = measure(engine, requests, sampling, args.repeats) | {"start_s": start_s}
            finally:
                engine.close()
        print(f"{config}: {results[config]['tokens_per_s_median']:.1f} tokens/s", flush=True)
    meta = {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens, "threads": args.threads,
            "repeats": args.repeats, "machine": platform.machine(), "processor": cpu_model(), "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": meta, "results": results}, indent=2) + "\n")
    table = markdown(meta, results)
    args.out.with_suffix(".md").write_text(table)  # docs/benchmarks.md includes it (bench/run_all.py)
    print(table)


def markdown(meta: dict, results: dict) -> str:
    """The section docs/benchmarks.md shows: settings, command, CPU, one row per engine."""
    lines = ["## vLLM rollouts beside llama.cpp and transformers (bench/vllm_rollouts.py)", "",
             f"{meta['prompts']} prompts x G = {meta['group']} in one batch, up to {meta['new_tokens']} new tokens, "
             f"temperature 1, {meta['threads']} thread(s), per-token log-probs from every engine; median of "
             f"{meta['repeats']} runs after a warm-up; CPU: {meta['processor']}; torch {meta['torch']}. Measured "
             "separately from `make bench` (it needs .venv-vllm), all rows in one run; the machine was shared.", "",
             "```bash", f".venv/bin/python bench/vllm_rollouts.py --threads {meta['threads']} --repeats "
             f"{meta['repeats']}", "```", "",
             "| engine | tokens/s (median) | runs | tokens per run | engine start s |", "|---|---|---|---|---|"]
    for name, r in results.items():
        runs = ", ".join(f"{x:.1f}" for x in r["tokens_per_s_all"])
        tokens = ", ".join(str(t) for t in r["tokens"])
        lines.append(f"| {name} | {statistics.median(r['tokens_per_s_all']):.1f} | {runs} | {tokens} | "
                     f"{r['start_s']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
