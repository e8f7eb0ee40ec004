"""The greedy held-out eval of a tool-use config without training: accuracy with the tool (greedy episodes through
the MCP server), without it (one greedy turn of task.system_prompt), and how often the model writes a usable call.
It assembles the run exactly as `nearpolicy train` does (the policy exported to the engine's GGUF, the llama.cpp
engine process, the tool server) and runs the Trainer's own eval path (trainer.greedy_eval), then prints the
figures as JSON. Nothing is trained; the run folder goes to a temporary directory.

    .venv/bin/python bench/tool_eval.py configs/tools.toml --set run.threads=1 --set task.eval_size=32 [--show 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from nearpolicy.config import load_config
from nearpolicy.phases import eval_metrics, response_text, score_texts
from nearpolicy.setup import assemble
from nearpolicy.tasks.scoring import BoundedScorer
from nearpolicy.trainer import greedy_eval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--set", action="append", default=[], dest="sets", help="section.key=value (repeatable)")
    parser.add_argument("--show", type=int, default=4, help="eval transcripts to print")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        cfg = load_config(args.config, [*args.sets, f"run.output_dir='{folder}'", "logging.tensorboard=false"])
        run_dir = Path(folder) / cfg.run.name
        run_dir.mkdir(parents=True)
        session, rollouts = assemble(cfg, run_dir, log=lambda line: print(line, flush=True))
        scorer = BoundedScorer(session.task, cfg.task.reward_timeout_s)
        try:
            problems = session.task.eval_problems()
            score = lambda ids, label: score_texts(scorer, session.tokenizer, ids, problems, f"eval{label}")  # noqa: E731
            started = time.perf_counter()
            completions, results, extra = greedy_eval(rollouts, rollouts.eval_engine(), problems, session.prompt_ids,
                                                      cfg.sampling.max_new_tokens, score)
            seconds = time.perf_counter() - started
        finally:
            scorer.close()
            rollouts.close()
    for problem, ids, result in list(zip(problems, completions, results))[: args.show]:
        print(f"--- {problem.question}  (answer {problem.answer}, reward {result.reward})\n"
              f"{response_text(session.tokenizer, ids)}")
    figures = eval_metrics(results, completions) | extra | {"problems": len(problems), "seconds": round(seconds, 1)}
    print(json.dumps(figures, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
