"""The main job in fp32 and with algorithm.trainer_precision = "bf16", 3 seeds each (docs/results.md sec. 1): one
markdown row per run from its metrics.jsonl: training seconds (runs/summary.training_seconds), the median step and
its phases, the response lengths, the update's seconds per 1000 trained completion tokens, the evals and the
engine/trainer mismatch. Reads the committed package (cells PRECISION__q8_0__sSEED):

    .venv/bin/python bench/main_precision_table.py docs/runs/main-precision-2026-12-07.tar.gz
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from lora_table import arena_cells

from nearpolicy.runs.summary import training_seconds

HEADER = ["| precision | seed | training s | median step s (rollout, update, sync) | response tokens (mean) | "
          "truncated | update s per 1k completion tokens | eval 0 / 10 / 20 / 30 | mismatch k3 | "
          "mean abs log-prob diff |",
          "|---|---|---|---|---|---|---|---|---|---|"]


def row(cell: Path) -> str:
    """One run's line; mismatch and lengths are means over its training steps (samples per step from its config)."""
    rows = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines() if line.strip()]
    algorithm = json.loads((cell / "config.json").read_text())["algorithm"]
    samples = algorithm["prompts_per_step"] * algorithm["group_size"]
    steps = [r for r in rows if r.get("step", 0) > 0 and "time/step" in r]
    median = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    mean = lambda key: statistics.fmean(r[key] for r in steps)  # noqa: E731
    tokens = sum(r["response/length_mean"] * samples for r in steps)
    update = sum(r["time/update"] for r in steps) / tokens * 1000
    evals = " / ".join(f"{r['eval/accuracy']:.3f}" for r in rows if "eval/accuracy" in r)
    precision, _, seed = cell.name.split("__")
    return (f"| {precision} | {seed[1:]} | {training_seconds(rows):.0f} | {median('time/step'):.2f} "
            f"({median('time/rollout'):.2f}, {median('time/update'):.2f}, {median('time/sync'):.2f}) | "
            f"{mean('response/length_mean'):.1f} | {mean('response/frac_truncated'):.2f} | {update:.2f} | {evals} | "
            f"{mean('mismatch/k3'):.4f} | {mean('mismatch/mean_abs_logprob_diff'):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path, help="the runs' tar.gz package (or its unpacked folder)")
    args = parser.parse_args()
    with arena_cells(args.package) as cells:
        cells = sorted(cells.iterdir(), key=lambda c: (not c.name.startswith("fp32"), c.name))  # fp32 first
        print("\n".join(HEADER + [row(cell) for cell in cells]))


if __name__ == "__main__":
    main()
