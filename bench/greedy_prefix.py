"""The greedy eval with and without the shared prompt prefix evaluated once (engines/llama_context.greedy_continuous):
the base policy's greedy completions of EVAL chain_sum eval problems on the llama.cpp engine, timed both ways in one
process, alternating (shared, per-prompt, shared, ...), with the completions and accuracy of each compared:

    .venv/bin/python bench/greedy_prefix.py --out docs/bench/greedy-prefix.json

Prints one line per timed call and writes the JSON (CPU, settings, seconds per call, accuracy, completions that
differ). A completion may differ between the two ways where a near-tie resolves differently: the prefix's keys and
values are computed in another batch shape (with an f16 KV cache llama.cpp's logits depend on how a prompt is split
across decode calls, llama_context's docstring)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from nearpolicy.config.schema import TaskConfig
from nearpolicy.engines import llama_context
from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
from nearpolicy.engines.gguf.export import export_model_gguf
from nearpolicy.model.load import chat_prompt_ids, default_model_gguf, load_policy
from nearpolicy.tasks import make_task


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.machine())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval", type=int, default=256)
    parser.add_argument("--precision", default="q8_0")
    parser.add_argument("--kv-cache", default="f16")
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load_policy("smollm2")
    cfg = TaskConfig()
    task = make_task("reasoning_gym", name="chain_sum", options=cfg.resolved_options(), path=None, train_size=8,
                     eval_size=args.eval, seed=0, eval_seed=1234, skip_bad_lines=False)
    problems = task.eval_problems()
    prompts = [chat_prompt_ids(tokenizer, cfg.system_prompt, p.question) for p in problems]
    gguf = export_model_gguf(model, Path(tempfile.mkdtemp()), args.precision, (), default_model_gguf(), tokenizer)
    engine = build_engine(EngineRequest("llamacpp", args.precision, max_parallel_sequences=args.parallel,
                                        threads=args.threads, adaptive_threads=False, isolated=False,
                                        kv_cache=args.kv_cache), EngineInputs(gguf=gguf))
    engine.greedy(prompts[:4], 8)  # warm-up: contexts made, pages touched
    seconds: dict[str, list[float]] = {"shared": [], "per_prompt": []}
    completions: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for way, minimum in (("shared", llama_context.SHARED_PREFIX_MIN), ("per_prompt", 10**9)):
            original, llama_context.SHARED_PREFIX_MIN = llama_context.SHARED_PREFIX_MIN, minimum
            try:
                start = time.perf_counter()
                completions[way] = engine.greedy(prompts, args.tokens)
                seconds[way].append(time.perf_counter() - start)
            finally:
                llama_context.SHARED_PREFIX_MIN = original
            print(f"{way}: {seconds[way][-1]:.1f} s", flush=True)
    engine.close()
    os.remove(gguf)
    accuracy = {way: sum(task.score(tokenizer.decode(ids, skip_special_tokens=True), p)
                         for ids, p in zip(out, problems)) / len(problems) for way, out in completions.items()}
    result = {
        "cpu": cpu_name(), "load_average_1min": os.getloadavg()[0], "precision": args.precision,
        "kv_cache": args.kv_cache, "eval_problems": args.eval, "parallel": args.parallel, "tokens": args.tokens,
        "threads": args.threads, "shared_prefix_tokens": llama_context.shared_prefix_length([tuple(p) for p in prompts]),
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts), "seconds": seconds, "accuracy": accuracy,
        "completions_differing": sum(a != b for a, b in zip(completions["shared"], completions["per_prompt"])),
    }
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
