"""How fast could the main job train on this host? Each fp32 run's phases against their own ceilings (issue 39).

Per training step, from the run's metrics.jsonl:
- the update at the trainer's ceiling: the forward tokens (each group's prompt once, P = the attention mask's prompt
  tokens per row, plus every completion token) at --ms-per-token (forward + backward, docs/bench/update-ceiling.md's
  best), the rows whose gradient is 0 (actor/inert_rows) at --forward-only of that (docs/bench/update_microbatch.json);
- the rollout at llama.cpp's own best rate: 2 N FLOPs per sampled token at --engine-gflops (one 512-token prefill,
  docs/bench/llamacpp-peak.md), the prompts' prefill and every per-call cost left out;
- the weight sync and the evals as measured.
Their sum is the floor: what the run would take with both phases at their ceilings and its sync and evals as they
were; the rest of a step (scoring, diagnostics: "other", under 1 s a run) is left out. One update pass a step is
assumed (algorithm.epochs = minibatches = 1; other runs are refused). Reads packages of cells
(PRECISION__q8_0__sSEED; only the fp32 cells, since the ceiling is fp32's):

    .venv/bin/python bench/main_job_floor.py docs/runs/main-precision-2026-12-07.tar.gz docs/runs/main-onepass-2026-12-07.tar.gz
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lora_table import arena_cells

from nearpolicy.runs.summary import training_seconds

HEADER = ["| package | run | training s | update s (at ceiling) | rollout s (at engine's best) | sync s | evals s | "
          "other s | floor s (min) |",
          "|---|---|---|---|---|---|---|---|---|"]


def floor_row(cell: Path, args: argparse.Namespace) -> tuple[str, float, float]:
    """(markdown row, training seconds, floor seconds) of one run."""
    rows = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines() if line.strip()]
    algorithm = json.loads((cell / "config.json").read_text())["algorithm"]
    if algorithm.get("epochs", 1) * algorithm.get("minibatches", 1) != 1:
        raise SystemExit(f"{cell.name}: {algorithm.get('epochs', 1)} epoch(s) x {algorithm.get('minibatches', 1)} "
                         "minibatch(es) a step; the floor counts one update pass a step")
    groups, samples = algorithm["prompts_per_step"], algorithm["prompts_per_step"] * algorithm["group_size"]
    steps = [r for r in rows if "time/step" in r]
    sums = dict.fromkeys(("update", "rollout", "sync", "update_floor", "rollout_floor"), 0.0)
    for r in steps:
        completions = r["response/length_mean"] * samples
        trained = r["throughput/train_tokens_per_s"] * r["time/update"]  # the attention mask: prompt + completion per row
        forward = groups * (trained - completions) / samples + completions
        inert = r["actor/inert_rows"]
        sums["update_floor"] += args.ms_per_token / 1000 * forward * (inert * args.forward_only + 1 - inert)
        sums["rollout_floor"] += completions * 2 * args.parameters / (args.engine_gflops * 1e9)
        for phase in ("update", "rollout", "sync"):
            sums[phase] += r[f"time/{phase}"]
    evals = sum(r["time/eval"] for r in rows if "time/eval" in r)
    total = training_seconds(rows)
    other = total - evals - sums["update"] - sums["rollout"] - sums["sync"]
    floor = sums["update_floor"] + sums["rollout_floor"] + sums["sync"] + evals
    line = (f"| {cell.parent.parent.name} | {cell.name} | {total:.0f} | {sums['update']:.0f} ({sums['update_floor']:.0f})"
            f" | {sums['rollout']:.0f} ({sums['rollout_floor']:.0f}) | {sums['sync']:.0f} | {evals:.0f} | {other:.0f} | "
            f"{floor:.0f} ({floor / 60:.1f}) |")
    return line, total, floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", type=Path, nargs="+", help="runs' tar.gz packages (or unpacked folders)")
    parser.add_argument("--ms-per-token", type=float, default=6.21, help="trainer forward + backward, ms per token")
    parser.add_argument("--forward-only", type=float, default=0.28, help="a forward-only row's share of that")
    parser.add_argument("--engine-gflops", type=float, default=106.6, help="llama.cpp's best q8_0 rate")
    parser.add_argument("--parameters", type=float, default=134.5e6)
    args = parser.parse_args()
    lines, totals, floors = list(HEADER), [], []
    for package in args.packages:
        with arena_cells(package) as cells:
            fp32 = sorted(c for c in cells.iterdir() if c.name.startswith("fp32"))
            if not fp32:
                print(f"{package}: no fp32 cell, left out", file=sys.stderr)
            for cell in fp32:
                line, total, floor = floor_row(cell, args)
                lines.append(line)
                totals.append(total)
                floors.append(floor)
    if not totals:
        raise SystemExit("no fp32 cell in the packages given: nothing to compare with the fp32 ceiling")
    print("\n".join(lines))
    print(f"\nmean over {len(totals)} runs: training {sum(totals) / len(totals):.0f} s, "
          f"floor {sum(floors) / len(floors):.0f} s ({sum(floors) / len(floors) / 60:.2f} min)")


if __name__ == "__main__":
    main()
