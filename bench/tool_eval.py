"""The greedy held-out eval of a tool-use config without training: accuracy with the tool (greedy episodes through
the MCP server), without it (one greedy turn of task.system_prompt), and how often the model writes a usable call.
It assembles the run exactly as `nearpolicy train` does (the policy exported to the engine's GGUF, the llama.cpp
engine process, the tool server) and runs the Trainer's own eval path (RolloutSource.evaluate), then prints the
figures as JSON. Nothing is trained; the run folder goes to a temporary directory.

    .venv/bin/python bench/tool_eval.py configs/tools.toml --set run.threads=1 --set task.eval_size=32 [--show 4]

`--sampled N`: instead, sample N training steps' episodes as the run would (sampling.temperature, one group of
algorithm.group_size per problem) and print the reward and call figures: what GRPO would learn from at step 1.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from nearpolicy.config.schema import load_config
from nearpolicy.training.phases import eval_metrics, response_text, score_texts
from nearpolicy.training.assemble import assemble
from nearpolicy.tasks.scoring import BoundedScorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--set", action="append", default=[], dest="sets", help="section.key=value (repeatable)")
    parser.add_argument("--show", type=int, default=4, help="eval transcripts to print")
    parser.add_argument("--sampled", type=int, default=0, help="sample this many training steps instead of the eval")
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
            if args.sampled:
                print(json.dumps(sampled_figures(rollouts, scorer, session, args.sampled), indent=1, sort_keys=True))
                return
            completions, results, extra = rollouts.evaluate(rollouts.eval_engine(), problems, score)
            seconds = time.perf_counter() - started
        finally:
            scorer.close()
            rollouts.close()
    for problem, ids, result in list(zip(problems, completions, results))[: args.show]:
        print(f"--- {problem.question}  (answer {problem.answer}, reward {result.reward})\n"
              f"{response_text(session.tokenizer, ids)}")
    figures = eval_metrics(results, completions) | extra | {"problems": len(problems), "seconds": round(seconds, 1)}
    print(json.dumps(figures, indent=1, sort_keys=True))


def sampled_figures(rollouts, scorer, session, steps: int) -> dict:
    """Reward and episode figures of `steps` training collections at the run's sampling (no update between)."""
    import numpy as np

    rewards, groups_with_signal, figures, position = [], 0, {}, 0
    for step in range(1, steps + 1):
        samples = rollouts.collect(step, 0, position)
        position = samples.next_position
        problems = [samples.problems[r.group_id] for r in samples.rollouts]
        results = score_texts(scorer, session.tokenizer, [r.response_ids() for r in samples.rollouts], problems, "sampled")
        step_rewards = np.array([r.reward for r in results], dtype=float)
        rewards += step_rewards.tolist()
        ids = np.array([r.group_id for r in samples.rollouts])
        groups_with_signal += sum(np.nanstd(step_rewards[ids == g]) > 0 for g in set(ids.tolist()))
        for key, value in samples.metrics.items():
            figures[key] = figures.get(key, 0.0) + value / steps
    return figures | {"sampled/reward_mean": float(np.nanmean(rewards)), "sampled/episodes": len(rewards),
                      "sampled/groups_with_reward_spread": int(groups_with_signal)}


if __name__ == "__main__":
    main()
