"""Rollout tokens/s of the llama.cpp engine with llama.cpp's extra buffer types off and on (`engine.extra_buffers`),
at q8_0, q4_1 and f16, on this CPU and this llama.cpp build. Each configuration runs in its own engine process
(engines/process.py, the way training runs it), so a configuration that crashes on this CPU (the AMX fault,
ggml-org/llama.cpp#20824) is recorded as such instead of ending the benchmark.

Same prompts (chain_sum, chat-templated), G = 8 samples per prompt, up to 128 new tokens, temperature 1; one warm-up,
then `--repeats` timed runs. Writes JSON (CPU, flags, llama.cpp features) and prints a markdown table.

    .venv/bin/python bench/extra_buffers.py [--repeats 3] [--label native] [--out docs/bench/extra_buffers.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from nearpolicy.config.schema import TaskConfig
from nearpolicy.doctor import SIMD_FLAGS, cpu_facts
from nearpolicy.engines.base import EngineError
from nearpolicy.engines.llama_lib import system_info
from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
from nearpolicy.model.load import default_model_gguf, load_policy
from nearpolicy.engines.gguf.export import export_model_gguf
from nearpolicy.model.load import chat_prompt_ids
from nearpolicy.tasks import make_task
from nearpolicy.types import GenerationRequest, SamplingParams


def measure(engine, requests, sampling, repeats: int) -> dict:
    engine.generate(requests[:1], SamplingParams(1.0, 1.0, 0, 8), seed=0)  # warm-up
    rates = []
    for rep in range(repeats):
        t0 = time.perf_counter()
        rollouts = engine.generate(requests, sampling, seed=rep)
        rates.append(sum(len(r.completion_ids) for r in rollouts) / (time.perf_counter() - t0))
    return {"tokens_per_s_median": statistics.median(rates), "tokens_per_s_all": rates}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", default=["q8_0", "q4_1", "f16"])
    parser.add_argument("--label", default="", help="a name for this llama.cpp build, e.g. native or portable")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/extra_buffers.json"))
    args = parser.parse_args()
    import llama_cpp

    model, tokenizer = load_policy("smollm2")
    task = make_task("reasoning_gym", name="chain_sum", options=TaskConfig().resolved_options(), path=None,
                     train_size=200, eval_size=args.prompts, seed=0, eval_seed=1234, skip_bad_lines=False)
    prompts = [chat_prompt_ids(tokenizer, TaskConfig().system_prompt, p.question) for p in task.eval_problems()]
    requests = [GenerationRequest(i, tuple(p), args.group) for i, p in enumerate(prompts)]
    sampling = SamplingParams(1.0, 1.0, 0, args.new_tokens)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            path = export_model_gguf(model, Path(tmp), precision, (), default_model_gguf(), tokenizer)
            for extra in (False, True):
                name = f"llamacpp:{precision} extra_buffers={'on' if extra else 'off'}"
                request = EngineRequest("llamacpp", precision, max_context=512,
                                        max_parallel_sequences=args.prompts * args.group, threads=args.threads,
                                        kv_cache="f16", flash_attention=False, extra_buffers=extra, isolated=True)
                try:  # its own process (log: tmp/llamacpp.log), probed with the first prompt before it is timed
                    engine = build_engine(request, EngineInputs(gguf=path, workdir=Path(tmp), probe_prompt=prompts[0]))
                    results[name] = measure(engine, requests, sampling, args.repeats)
                    engine.close()
                except EngineError as err:
                    results[name] = {"failed": str(err).splitlines()[0]}
                print(name, results[name], flush=True)
    model_name, flags = cpu_facts(Path("/proc/cpuinfo").read_text())
    meta = {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens, "threads": args.threads,
            "repeats": args.repeats, "cpu": model_name, "cpu_flags": [f for f in SIMD_FLAGS if f in flags],
            "llama_cpp_python": llama_cpp.__version__, "llama_cpp_features": system_info(), "build": args.label}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": meta, "results": results}, indent=2) + "\n")
    print(f"\n{model_name} ({' '.join(meta['cpu_flags'])}); build {args.label}: {meta['llama_cpp_features']}")
    print("| engine | tokens/s (median) | runs |\n|---|---|---|")
    for name, r in results.items():
        runs = r.get("failed") or ", ".join(f"{x:.1f}" for x in r["tokens_per_s_all"])
        print(f"| {name} | {r.get('tokens_per_s_median', float('nan')):.1f} | {runs} |")


if __name__ == "__main__":
    main()
