"""Tool-use runs side by side (docs/results.md sec. 12), from their metrics.jsonl: greedy held-out accuracy with the
tool and without it at the first and last eval; the sampled training reward (each step's episodes are fresh
problems, scored before the update on them) over the first and the last `--window` steps; tool calls, tool errors
and turns per episode over the same windows; the engine/trainer k3 per turn index at step 1 and its median over the run;
the mean step seconds; and the sampled reward of every step.

    .venv/bin/python bench/tool_runs_table.py runs/grpo-smollm2-tools-outcome runs/grpo-smollm2-tools-trace ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.mean(values) if values else None


def summarize(run: Path, window: int) -> dict:
    """The table's numbers for one run folder (raises FileNotFoundError without a metrics.jsonl)."""
    rows = _rows(run)
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "reward/mean" in r]
    first, last = steps[:window], steps[-window:]
    turns = sorted({k for r in steps for k in r if k.startswith("mismatch/k3_turn")})
    return {"run": run.name, "steps": len(steps),
            "eval": [(r["step"], r["eval/accuracy"], r.get("eval/accuracy_no_tool")) for r in evals],
            "reward": (_mean(first, "reward/mean"), _mean(last, "reward/mean")),
            "calls": (_mean(first, "episode/tool_calls_mean"), _mean(last, "episode/tool_calls_mean")),
            "errors": (_mean(first, "episode/tool_errors"), _mean(last, "episode/tool_errors")),
            "turns": (_mean(first, "episode/turns_mean"), _mean(last, "episode/turns_mean")),
            "k3_turn": {k.removeprefix("mismatch/k3_"): statistics.median(r[k] for r in steps if k in r) for k in turns},
            "k3_turn_step1": {k.removeprefix("mismatch/k3_"): steps[0][k] for k in turns if k in steps[0]},
            "reward_by_step": [r["reward/mean"] for r in steps],
            "step_s": _mean(steps, "time/step")}


def _pair(values: tuple, fmt: str = "{:.3f}") -> str:
    return " -> ".join("-" if v is None else fmt.format(v) for v in values)


def table(summaries: list[dict], window: int) -> str:
    head = ["run", "steps", "greedy with tool (first -> last eval)", "greedy without tool",
            f"sampled reward (first -> last {window} steps)", "tool calls / episode", "tool errors / step",
            "turns / episode", "k3 by turn at step 1", "k3 by turn (median)", "s / step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        evals = s["eval"]
        with_tool = _pair((evals[0][1], evals[-1][1])) + f" (steps {evals[0][0]}, {evals[-1][0]})" if evals else "-"
        no_tool = _pair((evals[0][2], evals[-1][2])) if evals else "-"
        k3 = ", ".join(f"{k}: {v:.2e}" for k, v in s["k3_turn"].items())
        k3_first = ", ".join(f"{k}: {v:.2e}" for k, v in s["k3_turn_step1"].items())
        lines.append("| " + " | ".join([s["run"], str(s["steps"]), with_tool, no_tool, _pair(s["reward"]),
                                        _pair(s["calls"], "{:.2f}"), _pair(s["errors"], "{:.1f}"),
                                        _pair(s["turns"], "{:.2f}"), k3_first, k3, f"{s['step_s']:.0f}"]) + " |")
    steps = max(s["steps"] for s in summaries)
    lines += ["", "| sampled reward by step | " + " | ".join(str(k) for k in range(1, steps + 1)) + " |",
              "|" + "---|" * (steps + 1)]
    for s in summaries:
        lines.append(f"| {s['run']} | " + " | ".join(f"{v:.2f}" for v in s["reward_by_step"]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=4, help="steps averaged at the start and at the end")
    args = parser.parse_args()
    print(table([summarize(run, args.window) for run in args.runs], args.window))


if __name__ == "__main__":
    main()
