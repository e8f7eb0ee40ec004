"""A run's eval gain over its step-0 eval, paired over the held-out problems (one seed): for each later eval,
accuracy, the paired difference to step 0 with the bootstrap's 95 % CI and MDE (arena/paired.paired_bootstrap over
problems x the run's one seed), and McNemar's discordant counts.

    .venv/bin/python bench/eval_gain.py docs/runs/grpo-gemma3-270m-chain-sum.eval_outcomes.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from nearpolicy.arena.paired import paired_bootstrap


def main(path: Path) -> None:
    evals = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    base = np.asarray(evals[0]["rewards"], dtype=np.float64)
    print(f"{path.name}: {len(base)} eval problems, step {evals[0]['step']} accuracy {base.mean():.3f}")
    print("| step | accuracy | paired difference to step 0 | 95 % CI | MDE (80 %) | problems gained / lost |")
    print("|---|---|---|---|---|---|")
    for e in evals[1:]:
        r = np.asarray(e["rewards"], dtype=np.float64)
        p = paired_bootstrap(r[None, :], base[None, :])
        gained, lost = int(((r > 0.5) & (base < 0.5)).sum()), int(((r < 0.5) & (base > 0.5)).sum())
        print(f"| {e['step']} | {r.mean():.3f} | {p.difference:+.3f} | [{p.low:+.3f}, {p.high:+.3f}] | {p.mde:.3f} | "
              f"{gained} / {lost} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
