"""A markdown table of several runs side by side, from their metrics.jsonl: held-out accuracy at each eval (best and
final), the token-mean k3 between engine and trainer (median over each third of the run, and at the last step), the
sequence ESS at the last step, the entropy at the last step, and the mean step / update / sync seconds.

    .venv/bin/python bench/runs_table.py runs/grpo-smollm2-q4_1-plain runs/grpo-smollm2-q4_1-aligned ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(run: Path) -> dict:
    """The table's numbers for one run folder (raises FileNotFoundError without a metrics.jsonl)."""
    rows = _rows(run)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "mismatch/k3" in r]
    last = max(r["step"] for r in steps)
    thirds = [[r["mismatch/k3"] for r in steps if k * last / 3 < r["step"] <= (k + 1) * last / 3] for k in range(3)]
    final = next(r for r in steps if r["step"] == last)
    mean = lambda key: statistics.mean(r[key] for r in steps if key in r)  # noqa: E731
    return {"run": run.name, "evals": evals, "best": max(a for _, a in evals), "final": evals[-1][1],
            "k3_thirds": [statistics.median(t) if t else None for t in thirds], "k3_last": final["mismatch/k3"],
            "ess_last": final.get("mismatch/ess"), "entropy_last": final.get("entropy"),
            "step_s": mean("time/step"), "update_s": mean("time/update"), "sync_s": mean("time/sync")}


def markdown(summaries: list[dict]) -> str:
    head = ("| run | eval accuracy (step: acc) | best | final | median k3 per third | k3 last step | ESS last | "
            "entropy last | step / update / sync s |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for s in summaries:
        lines.append(f"| {s['run']} | {', '.join(f'{k}: {a:.3f}' for k, a in s['evals'])} | {s['best']:.3f} | "
                     f"{s['final']:.3f} | {' / '.join('-' if x is None else f'{x:.2g}' for x in s['k3_thirds'])} | {s['k3_last']:.3g} | "
                     f"{s['ess_last']:.3f} | {s['entropy_last']:.2f} | {s['step_s']:.0f} / {s['update_s']:.0f} / "
                     f"{s['sync_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    print(markdown([summarize(run) for run in args.runs]))


if __name__ == "__main__":
    main()
