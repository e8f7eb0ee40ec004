"""The fixed vs adaptive task mixture of configs/arena-mixture.toml (issue 43 item 5), per dataset of the composite:
each arm's greedy eval accuracy at each eval step on the held-out problems of that dataset, the share of the
training prompts each dataset got (drawn prompts over the run; the adaptive arm's `mixture/prompts/<dataset>`, the
fixed arm's its data positions in order), and the adaptive arm's shares and accuracy EMA at steps 1, 10, 20, 30.

    .venv/bin/python bench/mixture_table.py docs/arena-runs/arena-mixture.tar.gz > docs/bench/mixture-table.md

The held-out problems' datasets come from the task itself (training/assemble.build_task on the cell's config.json:
`metadata.source_dataset` of each eval problem, as reasoning-gym's composite writes it); the outcomes from the cell's
eval_outcomes.jsonl (runs/samples.read_outcomes).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import Counter
from pathlib import Path

import numpy as np
from lora_table import arena_cells, cell_rows
from paired_cells import evals

from nearpolicy.config.schema import Config
from nearpolicy.tasks import Task
from nearpolicy.training.assemble import build_task

SHARE_STEPS = (1, 10, 20, 30)


@functools.cache
def cell_task(cell: Path) -> tuple[Config, Task]:
    """The cell's config (its config.json) and task (training/assemble.build_task), built once per cell."""
    config = Config.model_validate(json.loads((cell / "config.json").read_text()))
    return config, build_task(config)


def eval_datasets(cell: Path) -> list[str]:
    """The source dataset of each held-out problem of the cell's task, in eval order."""
    return [p.entry["metadata"]["source_dataset"] for p in cell_task(cell)[1].eval_problems()]


def fixed_draws(cell: Path) -> Counter:
    """Training prompts per dataset of a fixed-mixture run: data positions 0 .. steps x prompts_per_step - 1 of its
    training set (one prompt per position, in order; the run's last step taken from metrics.jsonl)."""
    (config, task), steps = cell_task(cell), max(r["step"] for r in cell_rows(cell))
    positions = range(steps * config.algorithm.prompts_per_step)
    return Counter(task.train_problem(i).entry["metadata"]["source_dataset"] for i in positions)  # it wraps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arena", type=Path, help="the arena folder or its tar.gz package")
    parser.add_argument("--arms", nargs="+", default=["fixed", "adaptive"])
    parser.add_argument("--source", default="q8_0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with arena_cells(args.arena) as cells:
        folders = {arm: cells / f"{arm}__{args.source}__s{args.seed}" for arm in args.arms}
        missing = [arm for arm, folder in folders.items() if not (folder / "metrics.jsonl").is_file()]
        if missing:
            raise SystemExit(f"no run of arm(s) {', '.join(missing)} in {cells} (seed {args.seed}, {args.source})")
        names = eval_datasets(folders[args.arms[0]])
        order = list(dict.fromkeys(names))
        print("| arm | dataset | held-out problems (distinct) | eval accuracy by step | training prompts (share) |")
        print("|---|---|---|---|---|")
        for arm, folder in folders.items():
            curve, drawn = evals(folder), _drawn(folder)
            total = sum(drawn.values())
            for name in [*order, "all"]:
                pick = np.array([n == name or name == "all" for n in names])
                accs = ", ".join(f"{s}: {np.nanmean(curve[s][pick]):.3f}" for s in sorted(curve))
                count = total if name == "all" else drawn.get(name, 0)
                share = f"{count / total:.2f}" if total else "-"
                print(f"| {arm} | {name} | {int(pick.sum())} ({_distinct(folder, pick)}) | {accs} | {count} ({share}) |")
        for arm, folder in folders.items():
            rows = {r["step"]: r for r in cell_rows(folder)}
            if not any(key.startswith("mixture/share/") for row in rows.values() for key in row):
                continue  # a fixed mixture logs no shares
            print(f"\n{arm}: share of the next step's prompts / accuracy EMA p per dataset\n")
            steps = [s for s in SHARE_STEPS if s in rows]
            print("| dataset | " + " | ".join(f"step {s}" for s in steps) + " |")
            print("|---|" + "---|" * len(steps))
            for name in order:
                print(f"| {name} | " + " | ".join(f"{rows[s].get(f'mixture/share/{name}', float('nan')):.2f} / "
                                                   f"{rows[s].get(f'mixture/accuracy/{name}', float('nan')):.2f}"
                                                   for s in steps) + " |")


def _distinct(cell: Path, pick: np.ndarray) -> int:
    """Distinct questions among the picked held-out problems (a small problem space repeats questions)."""
    problems = cell_task(cell)[1].eval_problems()
    return len({problems[i].question for i in np.flatnonzero(pick)})


def _drawn(cell: Path) -> Counter:
    """Training prompts per dataset: the adaptive arm's logged counts when present, else fixed_draws."""
    rows = cell_rows(cell)
    logged = Counter()
    for row in rows:
        for key, value in row.items():
            if key.startswith("mixture/prompts/") and value is not None:
                logged[key.removeprefix("mixture/prompts/")] += int(value)
    return logged or fixed_draws(cell)


if __name__ == "__main__":
    main()
