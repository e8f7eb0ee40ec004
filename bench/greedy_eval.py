"""The greedy eval's wall time on the llama.cpp engine: 128 held-out chain_sum prompts (the main job's eval), at most
64 new tokens, the q8_0 export of SmolLM2-135M-Instruct, 64 parallel sequences. Prints seconds, tokens and accuracy
and writes the completions, so two checkouts can be compared side by side (same GGUF, same prompts):

    PYTHONPATH=OTHER_CHECKOUT/src .venv/bin/python bench/greedy_eval.py --label before
    PYTHONPATH=src .venv/bin/python bench/greedy_eval.py --label after
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from nearpolicy.config.schema import TaskConfig
from nearpolicy.engines.gguf.export import export_model_gguf
from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
from nearpolicy.model.load import chat_prompt_ids, default_model_gguf, load_policy
from nearpolicy.tasks import make_task

PRECISION = "q8_0"  # the export's GGUF type (the default --gguf's name says it)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--problems", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gguf", type=Path, default=Path("runs/bench/greedy-eval-q8_0.gguf"))
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = parser.parse_args()
    model, tokenizer = load_policy("smollm2")
    task = make_task("reasoning_gym", name="chain_sum", options=TaskConfig().resolved_options(), path=None,
                     train_size=50, eval_size=args.problems, seed=0, eval_seed=1234, skip_bad_lines=False)
    problems = task.eval_problems()
    prompts = [chat_prompt_ids(tokenizer, TaskConfig().system_prompt, p.question) for p in problems]
    if not args.gguf.is_file():  # one export shared by every checkout compared
        args.gguf.parent.mkdir(parents=True, exist_ok=True)
        os.replace(export_model_gguf(model, Path(tempfile.mkdtemp()), PRECISION, (), default_model_gguf(), tokenizer),
                   args.gguf)
    request = EngineRequest("llamacpp", PRECISION, max_context=1024, max_parallel_sequences=64, threads=args.threads,
                            adaptive_threads=False, isolated=False)
    engine = build_engine(request, EngineInputs(gguf=args.gguf))
    started = time.perf_counter()
    completions = engine.greedy(prompts, args.new_tokens)
    seconds = time.perf_counter() - started
    engine.close()
    accuracy = sum(task.score(tokenizer.decode(ids, skip_special_tokens=True), p)
                   for ids, p in zip(completions, problems)) / len(problems)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"greedy-eval-{args.label}.json").write_text(json.dumps(
        {"seconds": seconds, "accuracy": accuracy, "threads": args.threads, "completions": completions}) + "\n")
    print(f"{args.label}: {seconds:.1f} s, {sum(map(len, completions))} tokens, accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
