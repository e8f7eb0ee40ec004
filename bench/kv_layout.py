"""llama.cpp's KV layout at the GRPO batch: one unified cache for all sequences (`unified_kv=True`) vs one stream
per sequence (`kv_unified = false`, llama.cpp's "high-throughput" mode; the engine's default since 2026-12-03, with
live sequences packed into consecutive streams, engines/llama_context.py). In the unified cache every decode step
attends over every live cell (masked), so the attention work grows with the sequences x their length; split streams
attend over their own cells only, but a group's prompt, evaluated once, must be copied to G streams.

Same chain_sum prompts as the main job (4 x G = 8 sampled), the q8_0 GGUF given, 1 thread, each layout twice,
interleaved. Prints tokens/s and whether the two layouts sample the same ids with the same log-probs under one seed.
(The engine's greedy eval runs in split streams whatever `unified_kv` says: bench/greedy_eval.py.)

    .venv/bin/python bench/kv_layout.py runs/grpo-smollm2-chain-sum/engine/policy-q8_0.gguf [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nearpolicy.config.schema import TaskConfig
from nearpolicy.engines.llamacpp import LlamaCppEngine
from nearpolicy.model.load import chat_prompt_ids, load_policy
from nearpolicy.tasks import make_task
from nearpolicy.types import GenerationRequest, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    _, tokenizer = load_policy("smollm2")
    task = make_task("reasoning_gym", name="chain_sum", options=TaskConfig().resolved_options(), path=None,
                     train_size=50, eval_size=4, seed=0, eval_seed=1234, skip_bad_lines=False)
    prompts = [chat_prompt_ids(tokenizer, TaskConfig().system_prompt, p.question) for p in task.eval_problems()]
    requests = [GenerationRequest(i, tuple(p), 8) for i, p in enumerate(prompts)]
    sampling = SamplingParams(1.0, 1.0, 0, args.new_tokens)
    first = {}
    for unified in (True, False, True, False):
        # Built directly, not by engines/factory.py: unified_kv is engine-internal, not an EngineRequest field.
        engine = LlamaCppEngine(args.gguf, max_context=1024, max_parallel_sequences=64, threads=args.threads,
                                unified_kv=unified, adaptive_threads=False)
        try:
            engine.generate(requests[:1], SamplingParams(1.0, 1.0, 0, 4), seed=0)  # warm-up
            started = time.perf_counter()
            rollouts = engine.generate(requests, sampling, seed=7)
            sampled_s = time.perf_counter() - started
        finally:
            engine.close()
        tokens = sum(len(r.completion_ids) for r in rollouts)
        print(f"unified_kv={unified}: sampled {tokens} tokens in {sampled_s:.2f} s ({tokens / sampled_s:.1f} tokens/s)", flush=True)
        first.setdefault(unified, rollouts)
    pairs = list(zip(first[True], first[False], strict=True))
    same = [(a, b) for a, b in pairs if a.completion_ids == b.completion_ids and a.completion_ids]
    gap = max((max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) for a, b in same), default=0.0)
    print(f"same sampled ids: {len(same)} / {len(pairs)} sequences; largest log-prob gap on those: {gap:.3g} nats")


if __name__ == "__main__":
    main()
